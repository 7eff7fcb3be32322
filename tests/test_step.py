"""grpo/step.py on its own, with the default Hooks (one process, no harness around it): what a
reader of the core can run. One step's loss is GRPO written as loops, only the LoRA
parameters move, and the default hooks are exactly a one-process DataParallel's."""

from __future__ import annotations

import pytest
import torch
from test_levers import plain_grpo_loss

from data.synthetic import generate
from grpo.distributed import DataParallel
from grpo.model.logprobs import completion_logprobs
from grpo.model.policy import build_policy
from grpo.presets import phase_preset
from grpo.rewards import RewardModel
from grpo.step import Hooks, Learner, grpo_step, sample_and_score
from lora import lora_parameters


def learner(lr: float = 5e-2) -> Learner:
    cfg = phase_preset("A")
    cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step = 4, 12, 2
    cfg.optim.lr, cfg.model.device = lr, "cpu"
    bundle = build_policy(cfg, "cpu", verbose=False)
    opt = torch.optim.AdamW(lora_parameters(bundle.model), lr=lr, weight_decay=0.0)
    rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
    return Learner(bundle, opt, rewards, cfg, torch.Generator().manual_seed(0), backend="torch")


def test_one_step_is_grpo_written_as_loops_and_moves_only_the_adapter():
    torch.manual_seed(0)
    ln = learner()
    model = ln.bundle.model
    examples = iter(generate("train", 1, 16, seed=0))
    drawn = []

    def draw(n):
        r = sample_and_score(ln, [next(examples) for _ in range(n)], temperature=1.0)
        drawn.append(r)
        return r

    lora = {id(p) for p in lora_parameters(model)}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in lora}
    result = grpo_step(ln, draw, step=0, temperature=1.0)

    (r,) = drawn  # one micro-batch of 2 prompts x G = 4
    assert r.out.completion_ids.shape[0] == 8 and len(result.updates) == 1 and len(result.logs) == 1
    assert float(result.logs[0].stats.zero_spread_frac) < 1, "no group with reward spread: nothing is tested"
    # The loss the step took, recomputed from scratch: log-probs under the policy as it was
    # (restored), the advantages as per-group z-scores, the clipped objective as loops.
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(before)
    with torch.no_grad():
        logp = completion_logprobs(model, r.out.context, r.out.completion_ids, r.out.completion_mask, 4,
                                   temperature=1.0)
    gold, lo, hi, tol = plain_grpo_loss(logp, logp, r.out.completion_mask.bool(), r.scores.total, 4)
    assert abs(result.loss - float(gold)) <= tol  # at ratio 1 both are ~0: tol scales with the terms, not the result
    assert lo == hi == 0  # update 1 is on-policy: ratio 1, the clip cannot bind
    # AdamW moved every LoRA B (all zero before the first step) and nothing else.
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed and all("lora_" in k for k in changed)
    assert all(not torch.equal(after[k], before[k]) for k in after if k.endswith("lora_B.weight"))
    model.load_state_dict(after)
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if id(p) not in lora)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_default_hooks_are_a_one_process_data_parallel(loss_type):
    """The core without a harness computes what the trainer computes in one process."""
    g = torch.Generator().manual_seed(1)
    masks = [(torch.rand(6, 9, generator=g) > 0.3).long(), (torch.rand(4, 5, generator=g) > 0.5).long()]
    counts = torch.tensor([[m.shape[0], float(m.sum())] for m in masks], dtype=torch.float64)
    assert torch.equal(Hooks().counts_over_ranks(counts), DataParallel().counts_over_ranks(counts))
    values = torch.randn(8, 3, generator=g)
    assert Hooks().batch_std(values, 0.0) is None and DataParallel().global_batch_std(values) is None
    assert Hooks().global_loss(1.25) == DataParallel().all_reduce_sum(1.25)


def test_the_backend_seam_reaches_every_kernel_the_step_calls(monkeypatch):
    """Learner.backend is what the advantages, the loss and every log-prob pass (the policy's,
    the reference's and NoisyRollout's scoring of its noisy rows) are computed with."""
    import grpo.model.logprobs as logprobs
    import grpo.step as step
    from grpo.rollout.noisy import NoisyRollout
    from grpo.rollout.sampler import sample

    seen: dict[str, set[str]] = {"advantages": set(), "loss": set(), "logprobs": set()}

    def recording(part, fn):
        def call(*args, backend="auto", **kw):
            seen[part].add(backend)
            return fn(*args, backend=backend, **kw)
        return call

    monkeypatch.setattr(step, "group_advantages", recording("advantages", step.group_advantages))
    monkeypatch.setattr(step, "grpo_loss", recording("loss", step.grpo_loss))
    monkeypatch.setattr(logprobs, "token_logprobs", recording("logprobs", logprobs.token_logprobs))
    torch.manual_seed(0)
    ln = learner()
    ln.cfg.optim.beta = 0.04  # the reference pass too
    ln.rollout = NoisyRollout(sample, 0.5, 0.1, steps=4, backend=ln.backend)
    examples = iter(generate("train", 1, 16, seed=0))
    grpo_step(ln, lambda n: sample_and_score(ln, [next(examples) for _ in range(n)], 1.0), step=0, temperature=1.0)
    assert seen == {"advantages": {"torch"}, "loss": {"torch"}, "logprobs": {"torch"}}
