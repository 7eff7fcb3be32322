"""The three levels of a step's batch, and the two rules that tie them together.

One word per level, used everywhere (code, log keys, config, README):

    rollout batch  B prompts x G completions, sampled and scored together; a step takes
                   optim.accumulation of them (gradient accumulation: changes the math,
                   the step's loss averages over them)
    micro-batch    the whole groups one training pass (log-probs, loss, backward) takes of
                   a rollout batch, optim.micro_batch_rows rows: memory only, its size must
                   not change any number
    rank           one process of a data-parallel run (grpo/distributed.py), holding its
                   share of every rollout batch's prompts

The partition rule says which micro-batches a rollout batch is cut into; the loss share
says what each micro-batch's loss weighs in the step's loss. Both are defined here once:
the step, the memory plan (grpo/run/memory_plan.py) and the config check call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grpo_kernels.grpo_advantages import Advantages
from grpo_kernels.grpo_loss import LOSS_TYPES


def groups_per_micro_batch(B: int, G: int, rows: int) -> int:
    """The partition rule: a micro-batch is whole groups (a group's G rows share one prompt
    and one advantage baseline), ``rows`` // G of them; 0, or at least the rollout batch's
    B * G rows, means one pass over all B groups."""
    if G < 1 or rows < 0:
        raise ValueError(f"groups_per_micro_batch: G={G} must be >= 1 and rows={rows} >= 0")
    return B if rows == 0 or rows >= B * G else max(1, rows // G)


def micro_batch_groups(B: int, G: int, rows: int) -> list[tuple[int, int]]:
    """(first group, end group) of each micro-batch of a rollout batch of B groups; the last
    one is shorter when the rule's size does not divide B (dynamic sampling's last batch)."""
    per = groups_per_micro_batch(B, G, rows)
    return [(b, min(b + per, B)) for b in range(0, B, per)]


def loss_share(loss_type: str, rows: float, tokens: float, batch_rows: float, batch_tokens: float,
               batches: int) -> float:
    """The factor that turns one micro-batch's loss (as ``grpo_loss`` returns it for its rows
    alone, on one rank) into its part of the step's loss, so that the shared losses, and
    their gradients, sum over micro-batches, ranks and rollout batches to the step's.

    The step's loss is the mean over its ``batches`` rollout batches of each one's loss, a
    rollout batch's loss being the aggregation over all its rows on every rank. Each
    aggregation is a sum over rows divided by a normaliser; a micro-batch's loss divides by
    its own, and the share swaps it for the rollout batch's:

        grpo, dr_grpo  rows / (batch_rows * batches)      both average over rows
        bnpo           tokens / (batch_tokens * batches)  a token mean over the rollout batch
        dapo           1                                   grpo_loss is given the step's active
                                                           tokens (every rollout batch, every rank)

    rows, tokens: the micro-batch's rows and active tokens; batch_rows, batch_tokens: those
    of its rollout batch summed over ranks. Exactly 1.0 for one pass over a whole rollout
    batch on one rank without accumulation: the one-pass loss bit for bit."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: use one of {', '.join(LOSS_TYPES)}")
    if loss_type == "dapo":
        return 1.0
    if loss_type == "bnpo":
        return tokens / (max(batch_tokens, 1.0) * batches)  # no active token (all truncated): 0
    return rows / (max(batch_rows, 1.0) * batches)


@dataclass
class MicroBatch:
    """One training pass: groups g0..g1-1 of a rollout batch, what the loss reads sliced once."""

    prompts: Any  # PromptContext of these groups (grpo/model/prompt_context.py)
    ids: torch.Tensor  # [n, T] completion tokens
    seen: torch.Tensor  # [n, T] the completion mask the model attends with
    mask: torch.Tensor  # [n, T] the loss's tokens
    adv: Advantages  # these groups' advantages (never re-normalised)
    sampler_logp: torch.Tensor | None  # [n, T] the rollout engine's log-probs
    share: float  # its loss's weight in the step's loss (grpo/batches.py loss_share)
    old_logp: torch.Tensor | None = None  # [n, T] update 1's log-probs: the sampling policy's
    ref_logp: torch.Tensor | None = None  # [n, T] the reference's (beta > 0), once per step
    guided_adv: torch.Tensor | None = None  # [n, T] A of rows trained by LUFFY's shaped term, 0 elsewhere (grpo/step.py)


def micro_batches(out: Any, mask: torch.Tensor, adv: Advantages, counts: list[float], batches: int,
                  loss_type: str, micro_batch_rows: int, guided_adv: torch.Tensor | None = None) -> list[MicroBatch]:
    """A rollout batch (``out``: its SampleOutput, mask [N, T] the loss's tokens) cut by the
    partition rule, each part's loss share from ``counts`` = (rows, active tokens) of the
    rollout batch over every rank, ``batches`` rollout batches in the step (``guided_adv`` alike)."""
    G, cut = adv.G, lambda x, rows: None if x is None else x[rows]  # noqa: E731
    parts = []
    for g0, g1 in micro_batch_groups(out.context.B, G, micro_batch_rows):
        rows = slice(g0 * G, g1 * G)
        tokens = float(mask[rows].sum()) if loss_type == "bnpo" else 0.0  # the one host sync it needs
        share = loss_share(loss_type, (g1 - g0) * G, tokens, *counts, batches)
        parts.append(MicroBatch(out.context.prompts(g0, g1), out.completion_ids[rows], out.completion_mask[rows],
                                mask[rows], adv.groups(g0, g1), cut(out.logprobs, rows), share,
                                guided_adv=cut(guided_adv, rows)))
    return parts


# The config check and the memory plan ask which optim.micro_batch_rows values fit the partition rule.


def micro_batch_rows_fit(B: int, G: int, rows: int) -> bool:
    """Whether optim.micro_batch_rows = ``rows`` cuts a rollout batch of B groups into equal
    micro-batches of whole groups (the config refuses any other value)."""
    return rows == 0 or rows >= B * G or (rows % G == 0 and (B * G) % rows == 0)


def micro_batch_choices(B: int, G: int) -> list[int]:
    """The optim.micro_batch_rows values that fit (``micro_batch_rows_fit``), largest first."""
    return [G * k for k in range(B, 0, -1) if B % k == 0]
