"""The GRPO levers: several updates per rollout batch (mu), DAPO dynamic
sampling, tie-breakers that stay small (per-component advantages, the std floor), against
plain references.

Model-free parts:
- mu > 1 on a toy policy (a logits table): every update's loss, gradient and clip fractions
  equal an independent per-token loop of GRPO with old log-probs; update 1 has ratio 1 and
  no clipping, later updates clip (both backends: the PyTorch reference and the Triton
  kernel under the interpreter).
- dynamic sampling's filter and refill loop on synthetic rollouts: only groups with spread,
  in stream order, rows / prompts / images / rewards still aligned after merging, the
  deficit (not a whole batch) drawn per refill, the bound (empty or partial), the exact
  one-line message, and "nothing dropped" returns the round-0 rollouts themselves.
- the trainer's advantage inputs: components mode, normalised weights, zero weights left
  out, and what a tied group's tie-breaker becomes under each option.
End to end on the tiny model (``--init base`` + a text-dependent reward bonus, as in
tests/test_train_resume.py):
- mu = 2: the second update's old_logp is the first update's log-probs bit for bit, its
  loss equals the plain reference on the captured tensors, the clip binds, the log shows it
  per update; mu = 1 passes old_logp=None (today's path) and the first update of mu = 2
  equals the mu = 1 run's update.
- dynamic sampling: refilled batches hold only groups with spread, the fill and refill
  counts are logged, the bound stops the run with one line (exit 1), a partial fill trains.
- resume stays bit-identical with every new option on.
- bad combinations: one ConfigError line each (exit 2); data parallel refuses dynamic sampling.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from loss_helpers import loss_of
from train_helpers import log_lines, reward_spread, run_main

from grpo.config import TrainConfig
from grpo.model.prompt_context import PromptContext, group_rows
from grpo.rewards.compose import RewardBatch
from grpo.rewards.rubrics import PrefixInputs
from grpo.rollout.dynamic_sampling import (
    FillStats,
    concat_rollouts,
    fill_batch,
    groups_in_band,
    groups_with_spread,
    no_spread_message,
    select_groups,
)
from grpo.rollout.sampler import Rollout, SampleOutput
from grpo.state.checkpoint import load_checkpoint
from grpo.state.registry import resolve
from grpo_kernels._dispatch import import_interpreted

ON_GPU = torch.cuda.is_available()
gl = importlib.import_module("grpo_kernels.grpo_loss") if ON_GPU else import_interpreted("grpo_kernels.grpo_loss")
DEVICE = "cuda" if ON_GPU else "cpu"


# ----------------------------------------------------------------------------- a plain reference


class PlainLoss(NamedTuple):
    loss: torch.Tensor
    clip_low: float
    clip_high: float
    tol: float


def plain_grpo_loss(logp, old, mask, rewards, G, eps_low=0.2, eps_high=0.2) -> PlainLoss:
    """GRPO with old log-probs, written as loops: per-group z-score (unbiased std + 1e-4,
    0 for a constant group), per-token -min(r A, clip(r) A), mean per completion, mean over
    completions. Returns the loss, the clip-low and clip-high fractions, and ``tol``: how far
    another float32 computation of the same loss may land from this one.

    The tolerance scales with what is summed, not with the result. The loss is a mean of n
    terms of size |r A| whose advantages sum to 0 within each group, so it is small next to
    them (0 at ratio 1). Each path rounds every term by a few float32 eps (the exp of the
    log-ratio, A in float32 against float64 here, the divisions; which vectorised exp and
    which library kernels run is chosen per CPU) and adds the terms in its own order, which
    moves a sum by up to (n - 1) eps times S, the same mean taken over |term|. tol = 2 n eps S
    bounds both (n = 48 on the trainer's mu = 2 batches: tol = 96 eps S). Measured there: the
    trainer and this loop 2-4 eps S apart on an AMD CPU and ~16 on an Intel one (which failed
    the former 1e-5 relative tolerance), while a clip range of 0.28 for 0.2 moves the loss by
    1200-7500 tol.
    """
    N, T = logp.shape
    total, size, lo, hi, active = 0.0, 0.0, 0, 0, 0
    for b in range(N // G):
        r = rewards[b * G:(b + 1) * G].double()
        adv = [0.0] * G if r.max() == r.min() else ((r - r.mean()) / (r.std() + 1e-4)).tolist()
        for g in range(G):
            i = b * G + g
            terms = []
            for t in range(T):
                if not mask[i, t]:
                    continue
                ratio = torch.exp(logp[i, t] - old[i, t])
                A = adv[g]
                rv = float(ratio.detach())
                terms.append(-torch.minimum(ratio * A, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * A))
                active += 1
                lo += int(rv < 1 - eps_low and A < 0)
                hi += int(rv > 1 + eps_high and A > 0)
            if terms:
                total = total + torch.stack(terms).sum() / len(terms)
                size += float(torch.stack(terms).detach().abs().sum()) / len(terms)
    eps = torch.finfo(torch.float32).eps
    return PlainLoss(total / N, lo / max(active, 1), hi / max(active, 1), 2 * active * eps * size / N)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_several_updates_clip_and_match_a_plain_reference(backend):
    """A toy policy (a [N, T, V] logits table), rollouts sampled once, mu = 4 AdamW steps on
    them with the ratio against the sampling-time log-probs."""
    N, T, V, G, mu = 6, 5, 4, 3, 4
    g = torch.Generator().manual_seed(3)
    theta = torch.nn.Parameter(torch.randn(N, T, V, generator=g))
    tokens = torch.multinomial(torch.softmax(theta.detach(), -1).view(-1, V), 1, generator=g).view(N, T)
    mask = (torch.arange(T)[None, :] < torch.tensor([5, 3, 4, 2, 5, 1])[:, None])
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 0.0])
    opt = torch.optim.AdamW([theta], lr=0.3)
    old = None
    for u in range(mu):
        logp = torch.log_softmax(theta, -1).gather(-1, tokens[..., None])[..., 0]
        opt.zero_grad()
        loss, st = loss_of(gl, logp.to(DEVICE), mask.to(DEVICE), rewards.to(DEVICE), G=G,
                              old_logp=None if old is None else old.to(DEVICE), backend=backend)
        loss.backward()
        grad = theta.grad.clone()
        # the plain loop, on a copy of the same parameters
        theta_ref = theta.detach().clone().requires_grad_()
        logp_ref = torch.log_softmax(theta_ref, -1).gather(-1, tokens[..., None])[..., 0]
        gold, lo, hi, tol = plain_grpo_loss(logp_ref, logp_ref.detach() if old is None else old, mask, rewards, G)
        gold.backward()
        assert abs(float(loss.detach()) - float(gold.detach())) <= tol, u
        # each entry of theta gets one token's gradient (no sum over tokens), so a per-entry relative
        # tolerance is already relative to what was computed
        torch.testing.assert_close(grad, theta_ref.grad, atol=1e-7, rtol=1e-5)
        assert math.isclose(float(st.clip_low_frac), lo, rel_tol=1e-6)
        assert math.isclose(float(st.clip_high_frac), hi, rel_tol=1e-6)
        if u == 0:
            assert lo == hi == 0 and float(st.kl_old_mean) == 0  # ratio 1: the clip cannot bind
            old = logp.detach()  # the sampling policy's log-probs, kept for updates 2..mu
        else:
            assert float(st.kl_old_mean) > 0
        opt.step()
    assert lo + hi > 0, "the clip never bound: the check above proved nothing about it"


# ----------------------------------------------------------------------------- dynamic sampling, model-free


def test_groups_with_spread_is_the_kernel_test():
    r = torch.tensor([1.0, 1.0, 1.0, 0.1, 0.1, 0.1 + 1e-7, 2.0, 0.0, 2.0])
    assert groups_with_spread(r, 3) == [1, 2]  # exact ties only count as no spread
    assert groups_with_spread(r, 1) == []  # G = 1: no group, no advantage
    cols = torch.tensor([[1.0, 5.0], [1.0, 6.0], [2.0, 7.0], [2.0, 7.0]])
    assert groups_with_spread(cols, 2) == [0]  # column 1 differs in group 0
    valid = torch.tensor([[True, False], [True, True], [True, True], [True, True]])
    assert groups_with_spread(cols, 2, valid=valid) == []  # an unscored entry does not count
    _, st = loss_of(gl, torch.zeros(9, 2), torch.ones(9, 2), r, G=3, backend="torch")
    assert float(st.zero_spread_frac) == pytest.approx(1 - len(groups_with_spread(r, 3)) / 3)


G_FAKE = 2


def fake_rollout(pids: list[int], has_spread, prefix: bool = False) -> Rollout:
    """A sampler call's worth of rollouts for prompts ``pids``, every tensor tagged with its
    prompt: text tokens 100 + p, image rows filled with p, completion ids 1000 p + g, texts
    'p<p>g<g>', prompt lengths and image token counts varying with p."""
    lens = [3 + p % 3 for p in pids]
    n_img = [1 + p % 2 for p in pids]
    L, B = max(lens), len(pids)
    ids = torch.zeros(B, L, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.long)
    img = torch.zeros(B, L, dtype=torch.bool)
    for b, (p, n, k) in enumerate(zip(pids, lens, n_img)):
        ids[b, L - n:] = 100 + p
        am[b, L - n:] = 1
        img[b, L - n:L - n + k] = True
    pos = torch.cumsum(am, 1) * am
    ctx = PromptContext(input_ids=ids, attention_mask=am, position_ids=pos[None].expand(3, B, L).clone(),
                        next_position=am.sum(1), image_embeds=torch.cat([torch.full((k, 2), float(p))
                                                                         for p, k in zip(pids, n_img)]),
                        image_mask=img)
    T = 2 + max(p % 2 for p in pids)
    N = B * G_FAKE
    cids = torch.tensor([[1000 * p + g] * T for p in pids for g in range(G_FAKE)])
    cmask = torch.ones(N, T, dtype=torch.long)
    out = SampleOutput(completion_ids=cids, completion_mask=cmask, logprobs=-cids.float() / 1e4,
                       filtered_logprobs=-cids.float() / 1e4, finished=torch.ones(N, dtype=torch.bool),
                       truncated=torch.zeros(N, dtype=torch.bool),
                       texts=[f"p{p}g{g}" for p in pids for g in range(G_FAKE)],
                       prompt_index=group_rows(B, G_FAKE), G=G_FAKE, context=ctx)
    total = torch.tensor([p + (0.5 * g if has_spread(p) else 0.0) for p in pids for g in range(G_FAKE)])
    pre = None
    if prefix:  # p % 3 rubric items per prompt: merging must pad J
        J = max(p % 3 for p in pids)
        pre = PrefixInputs(R_ans=total.clone(), s=torch.ones(N, J), scored=torch.zeros(N, J, dtype=torch.bool),
                           rho=torch.ones(N, J), t_end=torch.zeros(N, J, dtype=torch.int64), a=0.5)
        for b, p in enumerate(pids):
            pre.scored[b * G_FAKE:(b + 1) * G_FAKE, : p % 3] = True
    rb = RewardBatch(total=total, components={"c": total.clone()}, weights={"c": 1.0}, prefix=pre,
                     vetoed=torch.zeros(N, dtype=torch.bool))
    return Rollout([f"ex{p}" for p in pids], out, rb)


class Stream:
    """The phase's stream of prompt ids; draw(n) samples the next n (logged)."""

    def __init__(self, has_spread, prefix=False):
        self.next, self.calls, self.has_spread, self.prefix = 0, [], has_spread, prefix

    def draw(self, n: int) -> Rollout:
        self.calls.append(n)
        pids = list(range(self.next, self.next + n))
        self.next += n
        return fake_rollout(pids, self.has_spread, self.prefix)


def spread_of(r: Rollout) -> list[int]:
    return groups_with_spread(r.scores.total, r.out.G)


def check_aligned(r: Rollout) -> list[int]:
    """Every row, prompt, image and reward of a (merged) rollout belongs together; -> its pids."""
    G, ctx = r.out.G, r.out.context
    pids = [int(e[2:]) for e in r.examples]
    starts = torch.cumsum(ctx.image_mask.sum(1), 0) - ctx.image_mask.sum(1)
    assert (ctx.attention_mask[:, -1] == 1).all()  # left-padded: every prompt ends at the last column
    for b, p in enumerate(pids):
        real = ctx.input_ids[b][ctx.attention_mask[b].bool()]
        assert (real == 100 + p).all() and len(real) == 3 + p % 3
        k = int(ctx.image_mask[b].sum())
        assert k == 1 + p % 2 and (ctx.image_embeds[int(starts[b]):int(starts[b]) + k] == p).all()
        for g in range(G):
            i = b * G + g
            assert r.out.texts[i] == f"p{p}g{g}"
            row = r.out.completion_ids[i][r.out.completion_mask[i].bool()]
            assert (row == 1000 * p + g).all()
            assert r.scores.total[i] == r.scores.components["c"][i]
            assert math.floor(float(r.scores.total[i])) == p
    assert ctx.image_embeds.shape[0] == int(ctx.image_mask.sum())
    assert r.out.prompt_index.tolist() == group_rows(len(pids), G).tolist()
    return pids


def test_refilled_batches_hold_only_groups_with_spread_in_stream_order():
    stream = Stream(lambda p: p % 3 != 0)  # prompts 0, 3, 6, ... tie
    B, acc = 4, 2
    first = [stream.draw(B) for _ in range(acc)]
    micro, stats = fill_batch(first, stream.draw, spread_of, B, max_refills=5, pad_id=0)
    assert [sum(len(r.examples) for r in micro)] == [8] and [len(r.examples) for r in micro] == [4, 4]
    pids = [p for r in micro for p in check_aligned(r)]
    assert pids == [p for p in range(stream.next) if p % 3 != 0]  # every kept one, in stream order
    for r in micro:  # nothing without spread reached the batch
        assert groups_with_spread(r.scores.total, r.out.G) == list(range(len(r.examples)))
    # round 0: 8 prompts, 0, 3, 6 tie -> deficit 3; refill 8, 9, 10 -> 9 ties -> deficit 1; 11
    assert stream.calls == [4, 4, 3, 1]
    assert (stats.rounds, stats.refills, stats.sampled_groups, stats.kept_groups) == (3, 2, 12, 8)
    assert stats.dropped_frac == pytest.approx(4 / 12) and stats.fill == 1.0


def test_nothing_to_drop_returns_the_round_0_rollouts_themselves():
    stream = Stream(lambda p: True)
    first = [stream.draw(3), stream.draw(3)]
    micro, stats = fill_batch(first, stream.draw, spread_of, 3, max_refills=5, pad_id=0)
    assert all(a is b for a, b in zip(micro, first)) and len(micro) == 2
    assert stream.calls == [3, 3] and stats.to_dict() == dict(refills=0, sampled_groups=6, kept_groups=6,
                                                              dropped_frac=0.0, fill=1.0)


def test_the_bound_partial_fill_trains_on_what_was_kept_and_none_is_empty():
    stream = Stream(lambda p: p in (1, 5))
    micro, stats = fill_batch([stream.draw(2)], stream.draw, spread_of, 2, max_refills=2, pad_id=0)
    assert stream.calls == [2, 1, 1] and stats.refills == 2  # the bound: 2 refills of the deficit
    assert [check_aligned(r) for r in micro] == [[1]] and stats.fill == 0.5
    stream = Stream(lambda p: False)
    micro, stats = fill_batch([stream.draw(2), stream.draw(2)], stream.draw, spread_of, 2, max_refills=3,
                              pad_id=0)
    assert micro == [] and stats.refills == 3 and stats.sampled_groups == 4 + 3 * 4 and stats.kept_groups == 0
    msg = no_spread_message("B", 7, stats, 8, 1.1, 3)
    assert msg == ("phase B step 7: dynamic sampling found no group with reward spread after 3 refills (16 groups "
                   "of G=8 sampled, every completion of each prompt got the same reward); raise "
                   "--sampling.temperature (now 1.1), --sampling.G or --sampling.max_refills (now 3), change "
                   "--rewards.weights so that completions differ in reward, or set --sampling.dynamic_sampling false")
    assert "\n" not in msg


def test_merging_pads_rubric_prefix_inputs():
    stream = Stream(lambda p: p != 1, prefix=True)
    micro, _ = fill_batch([stream.draw(3)], stream.draw, spread_of, 3, max_refills=1, pad_id=0)
    (r,) = micro
    pids = check_aligned(r)
    assert pids == [0, 2, 3]
    p = r.scores.prefix
    assert p.s.shape == (6, 2) and p.scored.sum(1).tolist() == [0, 0, 2, 2, 0, 0]  # 3 % 3 = 0 items
    assert torch.equal(p.R_ans, r.scores.total)
    one = select_groups(stream.draw(3), [2])
    assert check_aligned(one) == [6] and one.out.context.P == 3 + 6 % 3  # all-padding columns cut
    assert concat_rollouts([one], 0) is one


def test_fill_stats_of_an_empty_sample():
    assert FillStats(target=4).dropped_frac == 0.0 and FillStats(target=0).fill == 0.0


def easyr1_band(correct: list[float], G: int, low: float, high: float) -> list[int]:
    """EasyR1's online filtering, written from its rule: a group is kept iff low <= the mean of
    its accuracy scores <= high (Python floats, one group at a time)."""
    groups = [correct[i:i + G] for i in range(0, len(correct), G)]
    return [g for g, acc in enumerate(groups) if low <= sum(acc) / len(acc) <= high]


@pytest.mark.parametrize("G,low,high", [(4, 0.01, 0.99), (3, 1 / 3, 2 / 3), (5, 0.0, 0.0), (8, 0.5, 1.0)])
def test_accuracy_band_is_easyr1s_rule(G, low, high):
    gen = torch.Generator().manual_seed(G)
    correct = (torch.rand(40 * G, generator=gen) < torch.rand(40, generator=gen).repeat_interleave(G)).float()
    correct[:G], correct[G:2 * G] = 1.0, 0.0  # an all-right and an all-wrong group
    want = easyr1_band(correct.tolist(), G, low, high)
    assert groups_in_band(correct, G, low, high) == want
    assert 0 < len(want) < 40 or (low, high) == (0.0, 0.0)  # the band kept some and dropped some


def band_of(r: Rollout) -> list[int]:
    """A stand-in band for the fake stream: even prompt ids are in it."""
    return [b for b, e in enumerate(r.examples) if int(e[2:]) % 2 == 0]


def test_the_band_drops_groups_with_spread_and_the_gate_still_counts_zero_spread():
    stream = Stream(lambda p: p % 3 != 0)  # prompts 0, 3, 6, ... tie
    micro, stats = fill_batch([stream.draw(4)], stream.draw, spread_of, 4, max_refills=8, pad_id=0, band=band_of)
    pids = [p for r in micro for p in check_aligned(r)]
    assert pids == [p for p in range(stream.next) if p % 3 != 0 and p % 2 == 0]  # spread and in the band
    ties = sum(p % 3 == 0 for p in range(stream.next))
    outside = sum(p % 3 != 0 and p % 2 == 1 for p in range(stream.next))
    assert stats.out_of_band == outside > 0 and stats.kept_groups == 4 == stats.target
    assert stats.zero_spread_frac == pytest.approx(ties / stream.next)  # what the controller's gate reads
    assert stats.dropped_frac == pytest.approx((ties + outside) / stream.next)
    assert stats.to_dict()["out_of_band"] == outside
    stream = Stream(lambda p: p % 2 == 1)  # spread only outside the band: nothing kept
    micro, stats = fill_batch([stream.draw(2)], stream.draw, spread_of, 2, max_refills=1, pad_id=0, band=band_of)
    msg = no_spread_message("B", 3, stats, 2, 1.0, 1)
    assert micro == [] and stats.out_of_band == 2 and "\n" not in msg
    assert msg.startswith("phase B step 3: dynamic sampling kept no group after 1 refills (4 groups of G=2 sampled; "
                          "2 had reward spread but a mean correctness outside the accuracy band")


# ----------------------------------------------------------------------------- advantage inputs


def batch(components: dict[str, list[float]], weights: dict[str, float]) -> RewardBatch:
    comps = {k: torch.tensor(v) for k, v in components.items()}
    total = sum(weights[k] * comps[k] for k in comps)
    return RewardBatch(total=total, components=comps, weights=weights)


def test_components_mode_keeps_a_tie_breaker_small():
    """Group 0 ties on correctness and differs by one brevity step (.5 x weight .2); group 1
    splits on correctness. z(total) makes group 0's advantages as large as group 1's;
    components mode caps them at brevity's weight share; the std floor scales them down."""
    from grpo.step import advantage_source

    w = {"correctness": 4.0, "brevity": 0.2, "format": 0.0}
    rb = batch({"correctness": [1, 1, 1, 1, 1, 0, 0, 0], "brevity": [1, 1, 1, .5, 1, 1, 1, 1],
                "format": [2, 1, 2, 1, 2, 1, 2, 1]}, w)  # format varies but weighs 0
    cfg = TrainConfig()
    adv = {}
    for mode, floor in (("total", 0.0), ("components", 0.0), ("total", 1.0)):
        cfg.optim.adv_mode, cfg.optim.adv_std_floor = mode, floor
        src = advantage_source(rb, cfg)
        if mode == "components":  # the zero-weight format is left out
            assert torch.equal(src.columns, torch.stack([rb.components["correctness"], rb.components["brevity"]], 1))
            torch.testing.assert_close(src.weights, torch.tensor([4.0, 0.2]) / 4.2)
            kw = dict(reward_components=src.columns, component_weights=src.weights)
        else:
            assert torch.equal(src.columns, rb.total[:, None]) and src.weights is None
            kw = dict(rewards=src.columns[:, 0])
        _, st = loss_of(gl, torch.zeros(8, 3), torch.ones(8, 3), G=4, backend="torch", adv_std_floor=floor, **kw)
        a, _ = gl.grpo_advantages_reference(kw.get("rewards", kw.get("reward_components")), 4,
                                            weights=kw.get("component_weights"), std_floor=floor)
        adv[(mode, floor)] = a
    tie, split = adv[("total", 0.0)][:4].abs().max(), adv[("total", 0.0)][4:].abs().max()
    assert tie > 1.4 and tie > 0.99 * split  # the lone brevity step weighs as much as "be right"
    assert adv[("components", 0.0)][:4].abs().max() <= 0.2 / 4.2 * 1.5 + 1e-6  # z <= 1.5 for G = 4
    assert adv[("total", 1.0)][:4].abs().max() < 0.1  # floored: .075 at most
    torch.testing.assert_close(adv[("total", 1.0)][4:], adv[("total", 0.0)][4:])  # correctness split: as before


def test_lr_schedule_counts_optimiser_steps():
    from grpo.run.schedule import lr_at

    cfg = TrainConfig()
    cfg.phase.name, cfg.phase.steps, cfg.optim.schedule, cfg.optim.warmup_steps = "A", 10, "linear", 2
    one = [lr_at(k, cfg) for k in range(10)]
    cfg.optim.updates_per_batch = 3
    three = [lr_at(k, cfg) for k in range(30)]
    assert three[0] == one[0] and three[1] == one[1]  # warm-up in optimiser steps
    assert three[-1] == pytest.approx(cfg.optim.lr * (1 - 0.9 * 27 / 28)) and one[-1] > three[-1]
    cfg.phase.name = "warmup"  # SFT: one step per batch, mu ignored
    assert [lr_at(k, cfg) for k in range(10)] == one


# ----------------------------------------------------------------------------- the trainer end to end

TINY = [
    "--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4",
    "--sampling.G", "3", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
    "--phase", "A", "--init", "base", "--run.eval_every", "2", "--optim.lr", "1e-2",
    "--run.test_per_stage", "0",
]


def train(run_dir: Path, *args: str) -> tuple[int, str, str]:
    return run_main(run_dir, *TINY, *args)


def steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in log_lines(run_dir) if r.get("phase") == "A" and "event" not in r}


def capture_loss_calls(monkeypatch) -> list[dict]:
    """Record every grpo_loss call of the trainer: its tensors (detached copies) and outputs,
    with the reward inputs of its advantages under kw (the step hands the loss the result
    of group_advantages, computed once per rollout batch)."""
    mod = importlib.import_module("grpo.step")
    real, real_adv, calls, sources = mod.grpo_loss, mod.group_advantages, [], {}

    def adv_spy(src, *args, **kw):
        adv = real_adv(src, *args, **kw)
        sources[id(adv)] = dict(rewards=src.columns[:, 0])
        return adv

    def spy(logp, mask, adv, **kw):
        loss, stats = real(logp, mask, adv, **kw)
        kw = dict(sources.get(id(adv), {}), **kw)
        calls.append(dict(logp=logp.detach().clone(), mask=mask.clone(), kw=dict(kw), loss=float(loss.detach()),
                          clip=float(stats.clip_low_frac + stats.clip_high_frac), kl_old=float(stats.kl_old_mean)))
        return loss, stats

    monkeypatch.setattr(mod, "grpo_loss", spy)
    monkeypatch.setattr(mod, "group_advantages", adv_spy)
    return calls


def test_two_updates_per_batch_clip_against_the_sampling_policy(tmp_path, monkeypatch):
    calls = capture_loss_calls(monkeypatch)
    with reward_spread():
        rc, out, err = train(tmp_path / "mu2", "--phase.steps", "2", "--optim.updates_per_batch", "2",
                             "--optim.lr", "5e-2")
    assert rc == 0, err
    assert len(calls) == 4  # 2 batches x 2 updates x 1 micro-batch
    clipped = 0
    for b in range(2):
        first, second = calls[2 * b], calls[2 * b + 1]
        assert first["kw"]["old_logp"] is None  # update 1: old = current detached, ratio 1
        assert torch.equal(second["kw"]["old_logp"], first["logp"])  # update 2: the sampling policy
        assert torch.equal(second["mask"], first["mask"]) and torch.equal(second["kw"]["rewards"],
                                                                         first["kw"]["rewards"])
        inputs = (second["logp"], second["kw"]["old_logp"], second["mask"].bool(), second["kw"]["rewards"], 3)
        gold, lo, hi, tol = plain_grpo_loss(*inputs)
        assert abs(second["loss"] - float(gold)) <= tol
        if lo + hi > 0:  # the tolerance still tells a clip range of 0.28 from 0.2 (measured: > 1000 tol apart)
            assert abs(second["loss"] - float(plain_grpo_loss(*inputs, eps_low=0.28, eps_high=0.28).loss)) > tol
        assert math.isclose(second["clip"], lo + hi, abs_tol=1e-6)
        assert first["clip"] == 0 and first["kl_old"] == 0 and second["kl_old"] > 0
        clipped += second["clip"] > 0
    assert clipped, "the clip never bound at lr 5e-2"
    recs = steps(tmp_path / "mu2")
    for rec in recs.values():
        ups = rec["updates"]
        assert [u["update"] for u in ups] == [1, 2]
        assert ups[0]["clip_low"] == ups[0]["clip_high"] == ups[0]["kl_old"] == 0 and ups[1]["kl_old"] > 0
        assert ups[0]["loss"] == rec["loss"] and ups[1]["grad_norm"] == rec["grad_norm"]
        assert [u["lr"] for u in ups] == [rec["lr"]] * 2  # constant schedule
    assert sum(u["clip_low"] + u["clip_high"] for r in recs.values() for u in r["updates"]) > 0


def test_mu_1_is_the_old_path_and_the_first_of_mu_2(tmp_path, monkeypatch):
    calls = capture_loss_calls(monkeypatch)
    with reward_spread():
        rc, _, err = train(tmp_path / "mu1", "--phase.steps", "1", "--run.eval_every", "1")
        assert rc == 0, err
        one = list(calls)
        calls.clear()
        rc, _, err = train(tmp_path / "mu2", "--phase.steps", "1", "--run.eval_every", "1",
                           "--optim.updates_per_batch", "2")
        assert rc == 0, err
    assert len(one) == 1 and one[0]["kw"]["old_logp"] is None
    assert torch.equal(calls[0]["logp"], one[0]["logp"]) and calls[0]["loss"] == one[0]["loss"]
    r1, r2 = steps(tmp_path / "mu1")[1], steps(tmp_path / "mu2")[1]
    assert "updates" not in r1 and "dynamic" not in r1
    assert r2["updates"][0]["grad_norm"] == r1["grad_norm"] and r2["loss"] == r1["loss"]


def test_a_non_finite_second_update_skips_the_rest_of_its_batch(tmp_path, monkeypatch):
    mod = importlib.import_module("grpo.step")
    real, n = mod.grpo_loss, [0]

    def nan_on_2(*args, **kw):
        n[0] += 1
        loss, stats = real(*args, **kw)
        return (loss * float("nan") if n[0] == 2 else loss), stats

    monkeypatch.setattr(mod, "grpo_loss", nan_on_2)
    with reward_spread():
        rc, out, err = train(tmp_path / "run", "--phase.steps", "2", "--optim.updates_per_batch", "3")
    assert rc == 0, err
    nan = [r for r in log_lines(tmp_path / "run") if r.get("event") == "nan"]
    assert [(r["step"], r["update"]) for r in nan] == [(1, 2)]
    recs = steps(tmp_path / "run")
    assert [len(recs[s]["updates"]) for s in (1, 2)] == [1, 3]  # update 3 of batch 1 never ran
    assert recs[1]["grad_norm"] is None and recs[2]["grad_norm"] is not None
    assert n[0] == 2 + 3


def even_pid(ex) -> bool:
    return sum(map(ord, ex.pid)) % 2 == 0


def test_dynamic_sampling_trains_only_on_groups_with_spread(tmp_path, monkeypatch):
    calls = capture_loss_calls(monkeypatch)
    # tiny-random writes varied text, so the bonus gives the chosen prompts' groups a spread; the
    # pretrained base writes one completion G times at 8 tokens (entropy ~0.1), which ties them too
    with reward_spread(only=even_pid):  # the other prompts' groups all tie
        rc, out, err = train(tmp_path / "run", "--phase.steps", "4", "--sampling.dynamic_sampling", "true",
                             "--sampling.max_refills", "8", "--optim.accumulation", "2", "--model.name", "tiny-random")
    assert rc == 0, err
    for c in calls:
        r = c["kw"]["rewards"]
        assert groups_with_spread(r, 3) == list(range(len(r) // 3))
    recs = steps(tmp_path / "run")
    dyn = [r["dynamic"] for r in recs.values()]
    assert sum(d["refills"] for d in dyn) > 0, "no refill happened: the test proved little"
    assert all(d["fill"] == 1.0 and d["kept_groups"] == 4 for d in dyn)
    assert all(r["zero_spread"] == 0 for r in recs.values())  # the trained batches
    assert any(d["dropped_frac"] > 0 for d in dyn)  # what the controller's gate reads


def test_the_accuracy_band_filters_the_trainers_groups_on_correctness(tmp_path, monkeypatch):
    """--sampling.accuracy_low/high reach the refill loop: the band is read off each rollout's
    correctness component, and groups with spread outside it are dropped and counted."""
    mod, seen = importlib.import_module("grpo.train"), []
    real = mod.groups_in_band

    def spy(correct, G, low, high):
        seen.append((correct.clone(), G, low, high))
        return real(correct, G, low, high)

    monkeypatch.setattr(mod, "groups_in_band", spy)
    with reward_spread(component="correctness"):  # a text-dependent bonus on correctness: every group has spread
        rc, out, err = train(tmp_path / "run", "--phase.steps", "2", "--sampling.dynamic_sampling", "true",
                             "--sampling.max_refills", "8", "--sampling.accuracy_low", "0.25",
                             "--sampling.accuracy_high", "0.75")
    assert rc == 0, err
    assert seen and all(G == 3 and (low, high) == (0.25, 0.75) for _, G, low, high in seen)
    inside = [set(easyr1_band(c.tolist(), 3, 0.25, 0.75)) for c, *_ in seen]
    # groups whose correctness (so their reward) differs, outside the band: what out_of_band counts
    dropped = sum(g not in keep and len(set(c[3 * g:3 * g + 3].tolist())) > 1
                  for (c, *_), keep in zip(seen, inside) for g in range(len(c) // 3))
    dyn = [r["dynamic"] for r in steps(tmp_path / "run").values()]
    assert sum(d["out_of_band"] for d in dyn) == dropped > 0, "nothing left the band: the test proved little"
    assert all(d["fill"] == 1.0 for d in dyn)


def test_dynamic_sampling_bound_stops_with_one_line(tmp_path):
    # no bonus: the random model's completions all get one reward -> no group ever has spread
    rc, out, err = train(tmp_path / "run", "--phase.steps", "3", "--sampling.dynamic_sampling", "true",
                         "--sampling.max_refills", "2")
    assert rc == 1
    assert err == ("error: phase A step 1: dynamic sampling found no group with reward spread after 2 refills "
                   "(6 groups of G=3 sampled, every completion of each prompt got the same reward); raise "
                   "--sampling.temperature (now 1), --sampling.G or --sampling.max_refills (now 2), change "
                   "--rewards.weights so that completions differ in reward, or set --sampling.dynamic_sampling "
                   "false\n")
    assert not (tmp_path / "run" / "A").exists() or not any((tmp_path / "run" / "A").glob("step_*"))


def test_dynamic_sampling_partial_fill_trains_on_what_it_kept(tmp_path, monkeypatch):
    calls = capture_loss_calls(monkeypatch)
    with reward_spread(only=even_pid):
        rc, _, err = train(tmp_path / "run", "--phase.steps", "4", "--sampling.dynamic_sampling", "true",
                           "--sampling.max_refills", "1", "--phase.prompts_per_step", "4")
    assert rc == 0, err
    fills = [r["dynamic"]["fill"] for r in steps(tmp_path / "run").values()]
    assert any(0 < f < 1 for f in fills), fills
    assert [c["kw"]["rewards"].numel() // 3 for c in calls] == [round(4 * f) for f in fills]


class Killed(Exception):
    pass


def test_resume_is_bit_identical_with_the_new_options_on(tmp_path, monkeypatch):
    """Straight 4 steps == killed right after the step-2 checkpoint, then resumed; the cosine
    schedule over phase.steps x mu optimiser steps included (the run is not shortened: a
    schedule over phase.steps changes with phase.steps)."""
    import grpo.state.train_state as trainer  # TrainState.save calls save_checkpoint by this module's name

    opts = ["--phase.steps", "4", "--sampling.dynamic_sampling", "true", "--optim.updates_per_batch", "2",
            "--optim.beta", "0.05", "--optim.kl_bias_correction", "true", "--optim.adv_mode", "components",
            "--optim.adv_std_floor", "0.5", "--optim.schedule", "cosine", "--optim.accumulation", "2",
            "--rewards.weights", "format=1,finished=1,brevity=0.25"]
    real_save = trainer.save_checkpoint

    def save_then_die(root, phase, step, **kw):
        real_save(root, phase, step, **kw)
        if step == 2:
            raise Killed

    with reward_spread(only=even_pid, component="brevity"):
        rc, _, err = train(tmp_path / "straight", *opts)
        assert rc == 0, err
        monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
        with pytest.raises(Killed):
            train(tmp_path / "resumed", *opts)
        monkeypatch.setattr(trainer, "save_checkpoint", real_save)
        rc, out, err = train(tmp_path / "resumed", *opts)
    assert rc == 0, err
    assert "resuming phase A at step 2" in out
    a = load_checkpoint(resolve(tmp_path / "straight", "A:latest")).tensors
    b = load_checkpoint(resolve(tmp_path / "resumed", "A:latest")).tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("optimizer.safetensors", "adapter.safetensors"):
        assert ((tmp_path / "straight" / "A" / "step_000004" / name).read_bytes()
                == (tmp_path / "resumed" / "A" / "step_000004" / name).read_bytes())

    def strip(r):
        return {k: v for k, v in r.items() if k != "time"}

    sa, sb = steps(tmp_path / "straight"), steps(tmp_path / "resumed")
    assert [strip(sa[s]) for s in (3, 4)] == [strip(sb[s]) for s in (3, 4)]
    assert sum(r["dynamic"]["refills"] for r in sa.values()) > 0  # refills happened across the resume


@pytest.mark.parametrize("args, message", [
    (["--optim.updates_per_batch", "0"], "optim.updates_per_batch=0: must be >= 1"),
    (["--optim.kl_bias_correction", "true"], "optim.kl_bias_correction=true weights the KL term, which optim.beta=0"),
    (["--optim.adv_std_floor", "0.5", "--optim.adv_scale", "none"], "optim.adv_scale='none' divides by no std"),
    (["--optim.adv_std_floor", "-1"], "optim.adv_std_floor=-1.0: must be a finite number >= 0"),
    (["--optim.adv_std_floor", "nan"], "optim.adv_std_floor=nan: must be a finite number (not inf or nan)"),
    (["--optim.adv_mode", "sum"], "optim.adv_mode='sum': use total or components"),
    (["--optim.adv_mode", "components", "--rewards.rubric_mode", "prefix"],
     "optim.adv_mode='components' with rewards.rubric_mode='prefix'"),
    (["--sampling.max_refills", "-1"], "sampling.max_refills=-1: must be >= 0"),
])
def test_bad_lever_options_exit_2_with_one_line(tmp_path, args, message):
    rc, out, err = train(tmp_path / "run", *args)
    assert rc == 2
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_data_parallel_refuses_dynamic_sampling():
    from grpo.distributed import DataParallel, DistributedError

    with pytest.raises(DistributedError, match="sampling.dynamic_sampling is not supported across 2 processes"):
        DataParallel(rank=0, world=2).check_batch(4, dynamic_sampling=True)
    DataParallel().check_batch(4, dynamic_sampling=True)  # one process: fine
