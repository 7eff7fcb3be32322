"""Every RL row is sampled, scored and trained with its own prompt's image and gold.

A pairing fault (row n decoded from one prompt's image, scored against another's gold, or
trained on a third's vision features) would look, in training, like a policy that learns to
stop looking: the blind gap falls. It cannot be seen in the numbers the step logs, so this
test checks it row by row against an independent reference, through everything that moves
rows around in a step: DAPO's dynamic sampling (groups dropped and refilled from later
draws), two rollout batches a step, training micro-batches of one group, and rollouts from a
merged copy of the policy.

The reference for row n is its own example alone: its image encoded afresh, the completion's
log-probs from one full forward (grpo/model/logprobs.py, no shared prefix), its reward from
the reward model on that example. The shipped model reads its images, so another image gives
other log-probs: each row's sampler log-probs and training log-probs must be closest to the
reference under its own image, among every image of its rollout batch, and within a small
tolerance of it. The same check on deliberately mispaired rows fails (the last test).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import grpo.step as step_module
from data.contract import gold_response
from data.synthetic import generate
from grpo.model.logprobs import completion_logprobs
from grpo.model.policy import build_policy
from grpo.model.prompt_context import build_prompt_context
from grpo.model.prompts import encode_prompts
from grpo.presets import phase_preset
from grpo.rewards import RewardModel
from grpo.rollout.dynamic_sampling import dynamic_batches, groups_with_spread
from grpo.rollout.merged import MergedRollout
from grpo.rollout.sampler import content_tokens
from grpo.step import Learner, advantage_source, grpo_step, sample_and_score
from lora import lora_parameters

G, L, T = 4, 40, 1.0
TOL = 1e-4  # a token's log-prob under its own image: fp32 rounding (seen: <= 1e-5); under another image: ~10


def _learner(merged: bool, guided: bool = False):
    cfg = phase_preset("A")
    cfg.sampling.guided = guided
    cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step = G, L, 2
    cfg.optim.accumulation, cfg.optim.micro_batch_rows, cfg.model.device, cfg.optim.lr = 2, G, "cpu", 0.0
    bundle = build_policy(cfg, "cpu", verbose=False)
    torch.manual_seed(0)
    for p in lora_parameters(bundle.model):  # a non-zero adapter, so the merged copy has something to fold in
        p.data.normal_(0, 0.005)
    # lr 0: the references below see the policy that sampled
    opt = torch.optim.AdamW(lora_parameters(bundle.model), lr=0.0, weight_decay=0.0)
    rewards = RewardModel(cfg.rewards, L, tokenizer=bundle.tokenizer)

    def spread(r):
        src = advantage_source(r.scores, cfg)
        return groups_with_spread(src.columns, G, valid=src.valid)

    rollout = MergedRollout(bundle.model, graphs=False).sample if merged else step_module.sample
    gather = dynamic_batches(spread, 8, bundle.pad_token_id)
    return Learner(bundle, opt, rewards, cfg, torch.Generator().manual_seed(0), rollout=rollout, gather=gather,
                   backend="torch")


def _own_image_logprobs(learner, examples, ids, mask) -> torch.Tensor:
    """[len(examples), N, T]: every row's completion log-probs under each example's image, alone."""
    model, out = learner.bundle.model, []
    with torch.no_grad():
        for ex in examples:
            ctx = build_prompt_context(model, encode_prompts(learner.bundle, [ex]))
            rows = []
            for n in range(ids.shape[0]):
                rows.append(completion_logprobs(model, ctx, ids[n:n + 1], mask[n:n + 1], 1, temperature=T,
                                                shared_prefix=False)[0])
            out.append(torch.stack(rows))
    return torch.stack(out)


def pairing_errors(learner, r, logp: torch.Tensor) -> list[str]:
    """Rows of rollout batch ``r`` whose log-probs ``logp`` [N, T] are not closest to (and within
    TOL of) the reference under their own example's image, or whose reward is not their own's."""
    mask = r.out.completion_mask
    ref = _own_image_logprobs(learner, r.examples, r.out.completion_ids, mask)  # [B, N, T]
    err = ((ref - logp[None]).abs() * mask[None]).amax(2)  # [B, N]: row n's error under example b's image
    problems, tokens = [], content_tokens(r.out)
    for n in range(mask.shape[0]):
        own = n // G
        others = [float(err[b, n]) for b in range(len(r.examples)) if r.examples[b].pid != r.examples[own].pid]
        if float(err[own, n]) > TOL or (others and min(others) <= float(err[own, n])):
            problems.append(f"row {n}: own image {float(err[own, n]):.2e}, closest other {min(others or [0]):.2e}")
        redo = learner.rewards([r.examples[own]], [r.out.texts[n]], num_tokens=[tokens[n]],
                               completion_ids=r.out.completion_ids[n:n + 1])
        if float(redo.total[0]) != float(r.scores.total[n]):
            problems.append(f"row {n}: reward {float(r.scores.total[n])} vs its own example's {float(redo.total[0])}")
    return problems


@pytest.mark.parametrize("merged, guided", [(False, False), (True, False), (True, True)],
                         ids=["policy", "merged", "merged-guided"])
def test_every_row_is_sampled_scored_and_trained_with_its_own_image_and_gold(monkeypatch, merged, guided):
    """guided: a group with no correct completion holds its own example's gold (grpo/rollout/guided.py),
    its sampler log-probs the policy's under its own image, kept by dynamic sampling and trained so."""
    learner = _learner(merged, guided)
    examples = generate("train", 1, 64, seed=3) + generate("train", 2, 64, seed=3)
    if guided:  # no worked reasoning (as own data comes), so the demonstration fits the budget
        examples = [replace(ex, reasoning=None) for ex in examples]
    examples = iter(examples)
    batches, passes = [], []
    real_gather, real_logprobs = learner.gather, step_module.completion_logprobs

    def gather(draw, B, n):
        got, fill = real_gather(draw, B, n)
        batches.extend(got)
        return got, fill

    def logprobs(model, prompts, ids, seen, G_, **kw):
        if not kw.get("entropy"):  # guided groups' no-grad pass for the demonstrations' sampler log-probs
            return real_logprobs(model, prompts, ids, seen, G_, **kw)
        logp, ent = real_logprobs(model, prompts, ids, seen, G_, **kw)
        passes.append((ids, logp.detach()))
        return logp, ent

    learner.gather = gather
    monkeypatch.setattr(step_module, "completion_logprobs", logprobs)
    draws = []

    def draw(n):
        draws.append(n)
        return sample_and_score(learner, [next(examples) for _ in range(n)], temperature=T)

    result = grpo_step(learner, draw, step=0, temperature=T)
    assert len(batches) == 2 and result.fill is not None
    assert len(draws) > 2, "no refill happened: dynamic sampling's pairing is not tested"
    assert len(passes) == 2 * 2  # two rollout batches x two micro-batches of one group
    for k, r in enumerate(batches):
        train_ids = torch.cat([ids for ids, _ in passes[2 * k:2 * k + 2]])
        assert torch.equal(train_ids, r.out.completion_ids)  # the micro-batches are the batch's rows, in order
        assert pairing_errors(learner, r, r.out.logprobs) == []  # sampled with its own image
        assert pairing_errors(learner, r, torch.cat([lp for _, lp in passes[2 * k:2 * k + 2]])) == []  # trained so
    if guided:
        rows = [(k, n) for k, r in enumerate(batches) for n in r.out.guided.nonzero().flatten().tolist()]
        assert rows, "no group was guided: the guided rows' pairing is not tested"
        for k, n in rows:
            ex = batches[k].examples[n // G]
            assert batches[k].out.texts[n] == gold_response(ex.reasoning, ex.answer)


def test_the_check_catches_a_row_paired_with_another_prompt():
    """Swap the two groups' completions (and their texts) in a rollout batch: every row is now
    scored and checked against the other prompt's image and gold, and the check says so."""
    learner = _learner(merged=False)
    r = sample_and_score(learner, generate("train", 1, 2, seed=5), temperature=T)
    swap = torch.cat([torch.arange(G, 2 * G), torch.arange(0, G)])
    r.out.completion_ids, r.out.completion_mask = r.out.completion_ids[swap], r.out.completion_mask[swap]
    r.out.logprobs, r.out.texts = r.out.logprobs[swap], [r.out.texts[i] for i in swap.tolist()]
    problems = pairing_errors(learner, r, r.out.logprobs)
    assert sum("own image" in p for p in problems) == 2 * G, problems
