"""Guided groups: a group with no correct completion gets the gold answer in one of its slots.

Why. GRPO learns only from a group whose completions differ in reward. Where the policy
cannot yet answer a prompt, all G completions score 0 on correctness, the group's advantage
is 0, and the prompt teaches nothing however often it is drawn. LUFFY (Yan et al. 2025,
"Learning to Reason under Off-Policy Guidance", arXiv 2504.14945) mixes an off-policy
demonstration into such groups: one slot holds a correct answer written by someone else,
so the group has spread, the demonstration gets a positive advantage and the policy's own
wrong answers a negative one.

What is implemented (``sampling.guided``)
------------------------------------------
    which groups   those whose G completions all have correctness 0 (the reward's exact-match
                   term, {0, 1}); a group with any correct completion is left as sampled
    which slot     the group's last row (every row of such a group is wrong, so which one
                   does not matter; the last keeps the choice a pure function of the batch)
    what it holds  the example's gold in the contract, as the warm-up's SFT target writes it
                   (data/contract.py ``gold_response``: the worked reasoning, or "the answer
                   is <gold>."), then the stop token; a demonstration longer than
                   sampling.max_new_tokens is not used (the group stays as sampled; one warning)
    its log-probs  the sampler's log-probs of a demonstration row are the policy's own, from a
                   no-grad pass at the sampling temperature: the sampler did not draw those
                   tokens, so there is no sampler probability to record, and the policy's makes
                   the rollout correction's ratio 1 on that row
    its reward     every row is scored again (the demonstration scores as the gold does), and
                   the advantages are the z-scores over the mixed group, as LUFFY does

How the demonstration row is trained (``optim.guided_gamma``):
    0 (default)   like a sampled row: the PPO term with the ratio to the (detached) policy of
                  update 1, so at mu = 1 its gradient is A * grad log pi(demo), SFT on the gold
                  weighted by the group's advantage
    gamma > 0     LUFFY's policy shaping: the row's policy term is A * f(pi_t) per token with
                  f(p) = p / (p + gamma) (the paper's gamma 0.1), no clip (``shaped_term``
                  below, added to the loss in grpo/step.py). Its gradient A * gamma * pi / (pi + gamma)^2 *
                  grad log pi weighs a token the policy finds unlikely more than one it already
                  predicts, so the policy is pulled toward the demonstration's rare tokens and
                  not toward copying what it already says. The KL term applies as on any row.

Every path sees the same rows: the demonstration is written into the SampleOutput of one
sampler call, before dynamic sampling filters or merges rollout batches (a guided group has
spread, so it is always kept), before micro-batches are cut, and per rank under data
parallelism (each rank guides its own groups; nothing to agree on). It uses no random
numbers, so a resumed run guides exactly what a straight run does. The log line's "guided"
entry gives the share of groups guided and the correctness of what the policy itself
sampled (the step's "correctness" counts the demonstrations too).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from data.contract import gold_response
from grpo.model.logprobs import completion_logprobs
from grpo.rollout.sampler import SampleOutput, content_tokens, pad_right, stop_token_ids
from grpo_kernels.grpo_advantages import Advantages
from grpo_kernels.grpo_loss import LossOptions, aggregate


@dataclass
class Demonstrations:
    """What ``guide`` wrote: which groups got a demonstration and which could not."""

    rows: list[int]  # the rows now holding a demonstration (one per guided group)
    too_long: int  # groups with no correct completion whose demonstration exceeded the budget


def unguided_groups(correctness: torch.Tensor, G: int) -> list[int]:
    """Groups (prompt indices) none of whose G completions is correct: correctness [N] in {0, 1}."""
    return [int(g) for g in (correctness.view(-1, G).amax(1) <= 0).nonzero().flatten()]


def demonstration_ids(text: str, tokenizer, stop_id: int) -> list[int]:
    """The demonstration's completion tokens: the text's, then the stop token (as a sampled
    completion that finished ends)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [stop_id]


def write_demonstrations(out: SampleOutput, demos: dict[int, tuple[str, list[int]]], pad_id: int) -> SampleOutput:
    """``out`` with row r replaced by demos[r] = (text, token ids) for each r: finished, not
    truncated, right-padded like the other rows (all rows padded further when a demonstration is
    longer than the longest completion). Log-probs of a written row are 0 until ``guide`` fills them."""
    if not demos:
        return out
    T = max(out.completion_ids.shape[1], max(len(ids) for _, ids in demos.values()))
    ids, mask = pad_right(out.completion_ids, T, pad_id).clone(), pad_right(out.completion_mask, T, 0).clone()
    lp, flp = pad_right(out.logprobs, T, 0.0).clone(), pad_right(out.filtered_logprobs, T, 0.0).clone()
    finished, truncated, texts = out.finished.clone(), out.truncated.clone(), list(out.texts)
    guided = out.guided_rows.clone()
    for row, (text, tokens) in demos.items():
        n = len(tokens)
        ids[row], mask[row], lp[row], flp[row] = pad_id, 0, 0.0, 0.0
        ids[row, :n] = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)
        mask[row, :n] = 1
        finished[row], truncated[row], texts[row], guided[row] = True, False, text, True
    return replace(out, completion_ids=ids, completion_mask=mask, logprobs=lp, filtered_logprobs=flp,
                   finished=finished, truncated=truncated, texts=texts, guided=guided)


def guide(out: SampleOutput, examples: list, correctness: torch.Tensor, *, text_of, tokenizer, stop_id: int,
          pad_id: int, max_new_tokens: int, policy_logprobs) -> tuple[SampleOutput, Demonstrations]:
    """Each group of ``out`` without a correct completion gets its example's demonstration
    (``text_of(example)``; the trainer's is data/contract.py ``gold_response``) in its last row,
    with the policy's own log-probs as that row's sampler log-probs (``policy_logprobs(out,
    groups)``: [len(groups) * G, T] for those groups' rows, no grad). Returns the new output
    (``out`` itself when nothing was guided) and what was done."""
    G = out.G
    demos, too_long = {}, 0
    for g in unguided_groups(correctness, G):
        text = text_of(examples[g])
        tokens = demonstration_ids(text, tokenizer, stop_id)
        if len(tokens) > max_new_tokens:
            too_long += 1
            continue
        demos[g * G + G - 1] = (text, tokens)
    if not demos:
        return out, Demonstrations([], too_long)
    out = write_demonstrations(out, demos, pad_id)
    groups = sorted(row // G for row in demos)
    with torch.no_grad():
        policy = policy_logprobs(out, groups)  # [len(groups) * G, T]
    lp, flp = out.logprobs.clone(), out.filtered_logprobs.clone()
    for k, g in enumerate(groups):
        row = g * G + G - 1
        lp[row] = flp[row] = policy[k * G + G - 1] * out.completion_mask[row]
    return replace(out, logprobs=lp, filtered_logprobs=flp), Demonstrations(sorted(demos), too_long)


def guide_rollout(learner: Any, examples: list, out: SampleOutput, scores: Any,
                  temperature: float) -> tuple[SampleOutput, Any]:
    """``guide`` as grpo/step.py's ``sample_and_score`` runs it for a Learner, on one sampler call's
    output and rewards (``scores``, a RewardBatch): the demonstration rows' sampler log-probs from a
    no-grad pass of the policy over the guided groups (as training runs it), then every row scored
    again. Returns (output, rewards): ``out`` and ``scores`` themselves when no group was guided."""
    cfg, bundle, G = learner.cfg, learner.bundle, learner.cfg.sampling.G

    def policy_logprobs(o: SampleOutput, groups: list[int]) -> torch.Tensor:
        dev = o.completion_ids.device
        rows = (torch.tensor(groups, dtype=torch.long, device=dev)[:, None] * G + torch.arange(G, device=dev)).flatten()
        return completion_logprobs(bundle.model, o.context.select(groups, trim=True), o.completion_ids[rows],
                                   o.completion_mask[rows], G, temperature=temperature,
                                   chunk_tokens=cfg.optim.logits_chunk_tokens, shared_prefix=cfg.optim.shared_prefix,
                                   backend=learner.backend)

    out, demos = guide(out, examples, scores.components["correctness"],
                       text_of=lambda ex: gold_response(ex.reasoning, ex.answer), tokenizer=bundle.tokenizer,
                       stop_id=stop_token_ids(bundle)[0], pad_id=bundle.pad_token_id,
                       max_new_tokens=cfg.sampling.max_new_tokens, policy_logprobs=policy_logprobs)
    if demos.too_long:
        warnings.warn(f"guided groups: a demonstration is longer than sampling.max_new_tokens="
                      f"{cfg.sampling.max_new_tokens} tokens, so its group stays unguided; raise the budget to guide it",
                      stacklevel=3)
    if not demos.rows:
        return out, scores
    rescored = learner.rewards([examples[row // G] for row in range(len(out.texts))], out.texts,
                               num_tokens=content_tokens(out), completion_ids=out.completion_ids)
    return out, rescored


# ----------------------------------------------------------------------------- LUFFY's shaping (the loss side)


def shaped_rows(adv: Advantages, out: SampleOutput, gamma: float) -> tuple[Advantages, torch.Tensor | None]:
    """With LUFFY's policy shaping (gamma > 0) and demonstration rows in ``out``: the advantages
    the loss kernel gets (those rows' set to 0, so the PPO term leaves them; their KL term stays)
    and theirs, [N, T], 0 on every other row, for ``shaped_term``. Else (adv, None)."""
    if gamma <= 0 or out.guided is None or not bool(out.guided.any()):
        return adv, None
    T, keep = out.completion_ids.shape[1], (~out.guided).to(adv.coef.dtype)
    values = adv.values(T)
    values = values[:, None].expand(-1, T) if values.dim() == 1 else values
    return replace(adv, coef=adv.coef * keep[:, None]), values * out.guided[:, None].to(values.dtype)


def shaped_term(logp: torch.Tensor, guided_adv: torch.Tensor, gamma: float) -> torch.Tensor:
    """LUFFY's policy term of a demonstration row, per token, as a loss: -A * f(pi) with
    f(p) = p / (p + gamma) and pi = exp(logp) the current policy's probability of the gold token
    (the demonstrator's taken as 1; no clip). Its gradient -A * gamma * pi / (pi + gamma)^2 *
    grad logp peaks at pi = gamma: a token the policy already predicts (pi near 1) pulls
    little. [n, T]; 0 wherever guided_adv is."""
    p = logp.float().exp()
    return -guided_adv * p / (p + gamma)


def shaped_loss(logp: torch.Tensor, mb: Any, gamma: float, options: LossOptions,
                num_active_tokens: float) -> torch.Tensor | float:
    """``shaped_term`` of micro-batch ``mb``'s guided rows (grpo/batches.py ``MicroBatch.guided_adv``),
    aggregated over its loss tokens as the kernel's policy term is (same normaliser, so the step's
    share weighs both alike); 0.0 when it has none (loss + 0.0: the same bits)."""
    if mb.guided_adv is None:
        return 0.0
    return aggregate(shaped_term(logp, mb.guided_adv, gamma), mb.mask, options, num_active_tokens)
