"""DAPO dynamic sampling: train only on groups whose rewards differ, refilled from the stream.

Why. GRPO's advantage is a z-score within each prompt's group of G completions. A group
whose G rewards are all equal (all right, all wrong, same format) gets advantage 0 on every
token: it costs its sampling, its log-prob passes and its share of the loss normaliser, and
contributes no gradient. As a policy gets better (or stuck), more groups are like that and
the effective batch shrinks. DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", section 3.2) over-samples and keeps only groups with spread, so
every step trains on a full batch of informative groups.

What is implemented
-------------------
    round 0   the step's usual sampling: accumulation x B prompts, G completions each, rewards
    filter    a group is kept iff its advantage inputs are not all constant
              (``groups_with_spread``: the same test as the loss kernel's zero_spread_frac)
              and, with an accuracy band [low, high] set, its mean correctness (the
              fraction of its G completions with correctness 1) lies in the band
              (``groups_in_band``)
    refill    while fewer than B x accumulation groups are kept and fewer than
              ``sampling.max_refills`` refills were made: sample the missing number of
              prompts (the deficit, in sampler calls of at most B prompts) from the phase's
              stream, score them, keep those with spread
    batch     the kept groups, in stream order, cut into rollout batches of B groups

Design choices and what they cost:
- The deficit, not a whole new batch, is sampled per refill (verl samples whole generation
  batches and discards the surplus): every sampled prompt is either kept or has no spread,
  none is thrown away for being one too many, so the stream is not skipped over. The
  price is more (smaller) sampler calls when few groups have spread.
- At the bound. No group with spread after ``max_refills`` refills: the trainer stops with
  one line naming the phase, the step, the refill count and what to change
  (``no_spread_message``). Some but fewer than wanted: the step trains on what it has, in
  ceil(kept / B) rollout batches, the last one smaller (the step's loss averages the
  rollout batches it has, so each kept group counts a little more), and the log says how
  full it was (``fill``).
- Prompts whose image fails to preprocess are dropped by the sampler as before; with
  dynamic sampling their places are refilled too.
- The accuracy band (``sampling.accuracy_low`` / ``accuracy_high``; EasyR1's online_filtering
  keeps 0.01..0.99, OpenRLHF's dynamic_filtering_reward_range) filters on correctness, not on
  the weighted reward: a group that ties on correctness but differs in brevity has spread,
  and the band can drop it (with [0.01, 0.99], every group that is all right or all wrong
  goes, whatever its format terms do). The default [0, 1] is no band: the spread test alone.
- With nothing dropped, the batch is the round-0 rollouts themselves: a run where every
  group has spread is bit-identical to a run with dynamic sampling off.
- The controller's vanishing-advantage gate reads the zero-spread fraction of what was
  *sampled* (zero-spread / sampled groups; ``zero_spread_frac``): the trained batch has
  none by construction. Groups the band dropped had spread and are not counted in it.
- Resume: refills draw from the same seeded stream and the same sampler generator, whose
  positions are checkpointed at step boundaries, so a resumed run refills exactly as a
  straight run does.
- Data parallel: refused (grpo/distributed.py ``check_batch``). Each rank would refill a
  different number of times, so the ranks' stream positions and rollout batch counts would
  part ways; agreeing on them needs collectives inside the refill loop.

Merging rollouts. Kept groups from several sampler calls are joined into one rollout batch
(``select_groups``, ``concat_rollouts``): prompts are re-left-padded to a common length,
completions right-padded to a common length, visual features concatenated in prompt order,
and the reward batch (and V-Rubrics prefix inputs, padded to a common item count) follows
the same rows. The log-prob pass then sees one batch, as without refills.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo.model.prompt_context import PromptContext
from grpo.model.vision import VisionInputs
from grpo.rollout.sampler import Rollout, SampleOutput, pad_right
from grpo_kernels.grpo_advantages import check_groups, group_zscore_reference


@dataclass
class FillStats:
    """What dynamic sampling did in one step (logged as the step line's "dynamic")."""

    target: int  # groups wanted: B x accumulation
    rounds: int = 0  # sampling rounds, round 0 included (refills = rounds - 1)
    sampled_groups: int = 0  # groups sampled over all rounds
    kept_groups: int = 0  # groups with spread (and in the band) that went into the batch
    out_of_band: int | None = None  # groups with spread that the accuracy band dropped (None: no band)

    @property
    def refills(self) -> int:
        return max(0, self.rounds - 1)

    @property
    def dropped_frac(self) -> float:
        """Dropped groups / sampled groups (zero spread, or outside the accuracy band)."""
        return (self.sampled_groups - self.kept_groups) / self.sampled_groups if self.sampled_groups else 0.0

    @property
    def zero_spread_frac(self) -> float:
        """Zero-spread groups / sampled groups: the rate the controller gates on (= dropped_frac without a band)."""
        if not self.sampled_groups:
            return 0.0
        return (self.sampled_groups - self.kept_groups - (self.out_of_band or 0)) / self.sampled_groups

    @property
    def fill(self) -> float:
        return self.kept_groups / self.target if self.target else 0.0

    def to_dict(self) -> dict[str, float | int]:
        out = dict(refills=self.refills, sampled_groups=self.sampled_groups, kept_groups=self.kept_groups,
                   dropped_frac=self.dropped_frac, fill=self.fill)
        if self.out_of_band is not None:
            out["out_of_band"] = self.out_of_band
        return out


# ----------------------------------------------------------------------------- the filter (pure)


def groups_with_spread(values: torch.Tensor, G: int, valid: torch.Tensor | None = None) -> list[int]:
    """Indices of the groups whose advantage inputs are not all constant.

    values [N] (one reward per completion) or [N, C] (several columns, e.g. reward
    components or V-Rubrics scores, with ``valid`` [N, C] marking scored entries). A group
    has spread iff some column differs within it: exactly the groups whose advantages are
    not all zero (grpo_kernels/grpo_advantages.py's "constant" test, max == min, so float
    rounding of a mean never passes for spread).
    """
    cols = values[:, None] if values.dim() == 1 else values
    check_groups(cols.shape[0], G)
    if cols.shape[1] == 0:
        return []
    _, constant = group_zscore_reference(cols.float(), G, valid=valid)
    return (~constant.all(1)).nonzero().flatten().tolist()


def groups_in_band(correct: torch.Tensor, G: int, low: float, high: float) -> list[int]:
    """Indices of the groups whose mean correctness lies in [low, high].

    correct [N]: the correctness component (1 right, 0 not), G contiguous rows a group. The
    mean is k / G with k counted exactly (float64), so a bound written as a fraction (1/3 of
    G = 3) compares as the same float.
    """
    check_groups(correct.shape[0], G)
    acc = correct.double().view(-1, G).sum(1) / G
    return ((acc >= low) & (acc <= high)).nonzero().flatten().tolist()


# ----------------------------------------------------------------------------- merging rollouts


def _select_rewards(scores: Any, rows: torch.Tensor) -> Any:
    idx = rows.cpu()
    prefix = scores.prefix
    if prefix is not None:
        prefix = type(prefix)(R_ans=prefix.R_ans[idx], s=prefix.s[idx], scored=prefix.scored[idx],
                              rho=prefix.rho[idx], t_end=prefix.t_end[idx], a=prefix.a)
    return type(scores)(total=scores.total[idx], components={k: v[idx] for k, v in scores.components.items()},
                    weights=dict(scores.weights), prefix=prefix,
                    vetoed=None if scores.vetoed is None else scores.vetoed[idx])


def select_groups(r: Rollout, groups: Sequence[int]) -> Rollout:
    """The rollout restricted to ``groups`` (prompt indices, in order); all of them -> ``r`` itself."""
    groups = list(groups)
    if groups == list(range(len(r.examples))):
        return r
    out, G = r.out, r.out.G
    dev = out.completion_ids.device
    rows = (torch.tensor(groups, dtype=torch.long, device=dev)[:, None] * G + torch.arange(G, device=dev)).flatten()
    sub = SampleOutput.from_rows([out], out.context.select(groups, trim=True), rows)
    return Rollout([r.examples[i] for i in groups], sub, _select_rewards(r.scores, rows))


def _pad_left(x: torch.Tensor, P: int, value: int | bool) -> torch.Tensor:
    pad = P - x.shape[-1]
    if pad == 0:
        return x
    return torch.cat([torch.full((*x.shape[:-1], pad), value, dtype=x.dtype, device=x.device), x], -1)


def _concat_rewards(parts: Sequence[Any]) -> Any:
    first = parts[0]
    prefix = None
    if first.prefix is not None:
        J = max(scores.prefix.s.shape[1] for scores in parts)  # pad items: scored=False, s=0, rho=0, t_end=0
        ps = [scores.prefix for scores in parts]
        prefix = type(first.prefix)(
            R_ans=torch.cat([p.R_ans for p in ps]), s=torch.cat([pad_right(p.s, J, 0.0) for p in ps]),
            scored=torch.cat([pad_right(p.scored, J, False) for p in ps]),
            rho=torch.cat([pad_right(p.rho, J, 0.0) for p in ps]),
            t_end=torch.cat([pad_right(p.t_end, J, 0) for p in ps]), a=first.prefix.a)
    vetoed = None if first.vetoed is None else torch.cat([scores.vetoed for scores in parts])
    return type(first)(total=torch.cat([scores.total for scores in parts]),
                       components={k: torch.cat([scores.components[k] for scores in parts]) for k in first.components},
                       weights=dict(first.weights), prefix=prefix, vetoed=vetoed)


def concat_rollouts(rs: Sequence[Rollout], pad_id: int) -> Rollout:
    """One rollout holding the groups of ``rs`` in order (one input -> itself)."""
    if len(rs) == 1:
        return rs[0]
    outs = [r.out for r in rs]
    P = max(o.context.P for o in outs)  # the longest prompt
    ctxs = [o.context for o in outs]
    ctx = PromptContext(
        input_ids=torch.cat([_pad_left(c.input_ids, P, pad_id) for c in ctxs]),
        attention_mask=torch.cat([_pad_left(c.attention_mask, P, 0) for c in ctxs]),
        position_ids=torch.cat([_pad_left(c.position_ids, P, 0) for c in ctxs], 1),
        next_position=torch.cat([c.next_position for c in ctxs]),
        image_embeds=torch.cat([c.image_embeds for c in ctxs]),
        image_mask=torch.cat([_pad_left(c.image_mask, P, False) for c in ctxs]),
        vision=VisionInputs.cat([c.vision for c in ctxs]),
    )
    out = SampleOutput.from_rows(outs, ctx, pad_id=pad_id)
    return Rollout([e for r in rs for e in r.examples], out, _concat_rewards([r.scores for r in rs]))


# ----------------------------------------------------------------------------- the refill loop


def fill_batch(
    first: Sequence[Rollout], draw: Callable[[int], Rollout], spread: Callable[[Rollout], list[int]],
    B: int, max_refills: int, pad_id: int, band: Callable[[Rollout], list[int]] | None = None,
) -> tuple[list[Rollout], FillStats]:
    """Keep the groups with spread of ``first`` (the step's round-0 rollout batches), refill.

    draw(n): sample and score the stream's next n prompts. spread(rollout): its group indices
    with spread; band(rollout), if given: its group indices inside the accuracy band (a group
    is kept if in both). Returns (rollout batches of at most B groups, stats); no rollout batch
    at all when none was kept by the bound (the caller stops the run with ``no_spread_message``).
    """
    stats = FillStats(target=B * len(first), rounds=1, out_of_band=None if band is None else 0)
    pool: list[tuple[Rollout, list[int]]] = []

    def take(rollouts: Sequence[Rollout]) -> None:
        for r in rollouts:
            keep = spread(r)
            if band is not None:
                inside = set(band(r))
                stats.out_of_band += sum(g not in inside for g in keep)
                keep = [g for g in keep if g in inside]
            stats.sampled_groups += len(r.examples)
            stats.kept_groups += len(keep)
            pool.append((r, keep))

    take(first)
    if all(len(k) == len(r.examples) == B for r, k in pool):  # nothing to drop, nothing missing
        return list(first), stats
    while stats.kept_groups < stats.target and stats.refills < max_refills:
        stats.rounds += 1
        deficit = stats.target - stats.kept_groups
        take([draw(min(B, deficit - done)) for done in range(0, deficit, B)])
    # The kept groups in stream order, cut into rollout batches of B (a surplus cannot occur:
    # each refill samples at most the deficit).
    flat = [(i, g) for i, (_, keep) in enumerate(pool) for g in keep]
    kept_batches = []
    for start in range(0, len(flat), B):
        chunk = flat[start : start + B]
        parts = []
        for i in dict.fromkeys(i for i, _ in chunk):  # rollouts in order, each once
            parts.append(select_groups(pool[i][0], [g for j, g in chunk if j == i]))
        kept_batches.append(concat_rollouts(parts, pad_id))
    return kept_batches, stats


def no_spread_message(phase: str, step: int, stats: FillStats, G: int, temperature: float, max_refills: int) -> str:
    """The one line the trainer stops with when no group was kept by the bound."""
    if stats.out_of_band:  # some had spread: the band dropped them
        return (f"phase {phase} step {step}: dynamic sampling kept no group after {stats.refills} refills "
                f"({stats.sampled_groups} groups of G={G} sampled; {stats.out_of_band} had reward spread but a "
                f"mean correctness outside the accuracy band, the rest none); widen --sampling.accuracy_low / "
                f"--sampling.accuracy_high, raise --sampling.max_refills (now {max_refills}) or --sampling.G, "
                f"or set --sampling.dynamic_sampling false")
    return (f"phase {phase} step {step}: dynamic sampling found no group with reward spread after "
            f"{stats.refills} refills ({stats.sampled_groups} groups of G={G} sampled, every completion of "
            f"each prompt got the same reward); raise --sampling.temperature (now {temperature:g}), "
            f"--sampling.G or --sampling.max_refills (now {max_refills}), change --rewards.weights so that "
            f"completions differ in reward, or set --sampling.dynamic_sampling false")


class NoSpread(Exception):
    """No sampled group had reward spread within the refill bound; ``fill`` says what was tried."""

    def __init__(self, fill: FillStats):
        super().__init__(f"no group with reward spread in {fill.rounds} sampling rounds")
        self.fill = fill


def dynamic_batches(spread: Callable[[Rollout], list[int]], max_refills: int, pad_id: int,
                    band: Callable[[Rollout], list[int]] | None = None) -> Callable:
    """A ``grpo.step.Learner.gather`` for DAPO's dynamic sampling: the step's rollout batches,
    kept to the groups with spread (and in the accuracy band, if ``band``) and refilled from
    the stream (``fill_batch``); raises NoSpread when none is left to train on."""

    def gather(draw: Callable[[int], Rollout], B: int, batches: int) -> tuple[list[Rollout], FillStats]:
        batch, fill = fill_batch([draw(B) for _ in range(batches)], draw, spread, B, max_refills, pad_id,
                                 band)
        if not batch:
            raise NoSpread(fill)
        return batch, fill

    return gather
