"""Fused GRPO loss and group advantages: Triton kernels (interpreter on CPU) vs PyTorch
reference vs autograd, and the reference against hand computations.

Tolerance table. The kernel reads bf16 inputs and computes in fp32, so the bf16 "gold" is
the fp32 reference on the upcast *same* bf16 values: what remains is summation order and,
for bf16, the rounding of the returned gradient to bf16: under one bf16 ulp, 2^-7 relative
(the Triton interpreter's fp32 -> bf16 cast truncates; a GPU rounds to nearest, 2^-8), so
rtol 8e-3 holds it with 2e-4 to spare, far above the fp32 summation differences (~1e-7).

    quantity        fp32 (atol, rtol)     bf16 vs fp32 gold (atol, rtol)
    loss            1e-6, 1e-5            1e-6, 1e-5
    d loss / d logp 1e-7, 1e-5            1e-7, 8e-3
    stats           1e-6, 1e-5            1e-6, 1e-5
"""

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch
from loss_helpers import loss_of, source_of

from grpo_kernels._dispatch import import_interpreted, resolve_backend

ON_GPU = torch.cuda.is_available()
# On a CPU the kernels must be defined under the Triton interpreter (see import_interpreted).
gl = importlib.import_module("grpo_kernels.grpo_loss") if ON_GPU else import_interpreted("grpo_kernels.grpo_loss")
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: dict(loss=(1e-6, 1e-5), grad=(1e-7, 1e-5), stats=(1e-6, 1e-5)),
       torch.bfloat16: dict(loss=(1e-6, 1e-5), grad=(1e-7, 8e-3), stats=(1e-6, 1e-5))}


def make_inputs(N: int, T: int, G: int, seed: int = 0, dtype=torch.float32) -> dict:
    """Awkward on purpose: a fully masked row, a full row, a constant-reward group, ratios
    both below 1 - eps_low and above 1 + eps_high, and -inf/NaN padding under the mask."""
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(N, T, generator=g)
    old = logp + 0.3 * torch.randn(N, T, generator=g)
    ref = logp + 0.3 * torch.randn(N, T, generator=g)
    mask = torch.rand(N, T, generator=g) > 0.25
    mask[0] = False
    mask[-1] = True
    rewards = torch.randint(0, 3, (N,), generator=g).float()
    rewards[:G] = 1.0  # group 0 has zero spread
    logp[~mask] = -torch.inf  # padding garbage must never reach the loss
    old[~mask] = torch.nan
    out = dict(logp=logp, old=old, ref=ref, mask=mask, rewards=rewards)
    return {k: (v.to(dtype) if v.is_floating_point() and k in ("logp", "old", "ref") else v).to(DEVICE)
            for k, v in out.items()}


def make_prefix(N: int, T: int, J: int, seed: int = 1, per_row_rho: bool = False) -> "gl.PrefixRubrics":
    g = torch.Generator().manual_seed(seed)
    scored = torch.rand(N, J, generator=g) > 0.3
    s = torch.randint(0, 2, (N, J), generator=g).float()
    s[~scored] = torch.nan  # unscored placeholders are ignored
    rho_shape = (N, J) if per_row_rho else (J,)
    return gl.PrefixRubrics(
        R_ans=torch.randint(0, 2, (N,), generator=g).float().to(DEVICE), s=s.to(DEVICE),
        scored=scored.to(DEVICE), rho=torch.rand(rho_shape, generator=g).to(DEVICE),
        t_end=torch.randint(-2, T + 3, (N, J), generator=g).to(DEVICE), a=0.4)


def run_both(inp: dict, dtype=torch.float32, **kw) -> tuple:
    """(kernel loss, grad, stats) on inp's dtype; (reference ...) on the fp32 copy."""
    results = []
    for backend, dt in (("triton", dtype), ("torch", torch.float32)):
        logp = inp["logp"].to(dt).clone().requires_grad_()
        loss, stats = loss_of(gl, logp, inp["mask"], **kw, backend=backend)
        loss.backward()
        results.append((loss.detach(), logp.grad, stats.to_dict()))
    return results


def assert_match(kernel, gold, dtype=torch.float32) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(kernel[0], gold[0], atol=tol["loss"][0], rtol=tol["loss"][1])
    assert kernel[1].dtype == dtype
    torch.testing.assert_close(kernel[1].float(), gold[1], atol=tol["grad"][0], rtol=tol["grad"][1])
    for name in gold[2]:
        torch.testing.assert_close(kernel[2][name], gold[2][name].float(), atol=tol["stats"][0],
                                   rtol=tol["stats"][1], msg=name)
    assert torch.isfinite(kernel[1]).all()


# (N, T, G, loss_type, importance, scale, beta, eps_low, eps_high, use_old, source)
CASES = [
    (6, 37, 3, "grpo", "token", "group", 0.0, 0.2, 0.2, True, "rewards"),
    (9, 20, 3, "bnpo", "token", "batch", 0.04, 0.2, 0.28, True, "rewards"),
    (8, 13, 8, "dr_grpo", "sequence", "none", 0.04, 0.1, 0.3, True, "rewards"),
    (5, 17, 1, "dapo", "token", "group", 0.0, 0.2, 0.28, False, "rewards"),
    (10, 19, 2, "grpo", "sequence", "group", 0.1, 0.2, 0.28, True, "components"),
    (12, 37, 3, "dapo", "sequence", "batch", 0.0, 0.2, 0.2, False, "prefix"),
    (8, 29, 2, "bnpo", "token", "group", 0.04, 0.2, 0.28, True, "prefix_rows"),
    (6, 23, 3, "grpo", "token", "none", 0.04, 0.3, 0.1, True, "rewards"),
    (15, 11, 3, "dr_grpo", "token", "group", 0.0, 0.2, 0.28, True, "components"),
    (16, 9, 8, "grpo", "sequence", "group", 0.0, 0.2, 0.28, False, "components"),
    (4, 6, 2, "grpo", "token", "group", 0.0, 0.2, 0.28, True, "prefix_J0"),  # no rubrics
]


def source_kwargs(source: str, inp: dict, N: int, T: int) -> dict:
    g = torch.Generator().manual_seed(7)
    if source == "rewards":
        return dict(rewards=inp["rewards"])
    if source == "components":
        comps = torch.randint(0, 2, (N, 3), generator=g).float()
        comps[:, 2] = 5.0  # a constant component contributes 0 everywhere
        return dict(reward_components=comps.to(DEVICE),
                    component_weights=torch.tensor([1.0, 0.5, 2.0], device=DEVICE))
    J = 0 if source == "prefix_J0" else 3
    return dict(prefix=make_prefix(N, T, J=J, per_row_rho=source == "prefix_rows"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}T{c[1]}G{c[2]}-{c[3]}-{c[4]}-{c[10]}")
def test_kernel_matches_reference(case):
    N, T, G, loss_type, importance, scale, beta, eps_low, eps_high, use_old, source = case
    inp = make_inputs(N, T, G, seed=N * T)
    kw = dict(G=G, old_logp=inp["old"] if use_old else None, ref_logp=inp["ref"] if beta or N % 2 else None,
              beta=beta, eps_low=eps_low, eps_high=eps_high, loss_type=loss_type,
              importance=importance, scale=scale, max_len=T + 5 if loss_type == "dr_grpo" else None,
              **source_kwargs(source, inp, N, T))
    kernel, gold = run_both(inp, **kw)
    assert_match(kernel, gold)
    assert gold[1][~inp["mask"]].abs().max() == 0  # padding gets no gradient
    if use_old and importance == "token" and source == "rewards":
        assert gold[2]["clip_low_frac"] > 0 and gold[2]["clip_high_frac"] > 0  # clipping exercised


# (N, T, G, loss_type, importance, scale, beta, use_old, source, kl_bias_correction, adv_std_floor)
LEVER_CASES = [
    (6, 37, 3, "grpo", "token", "group", 0.1, True, "rewards", True, 0.0),
    (9, 20, 3, "bnpo", "sequence", "group", 0.04, True, "rewards", True, 0.0),
    (8, 13, 2, "dapo", "token", "batch", 0.04, False, "components", True, 0.0),
    (10, 19, 2, "dr_grpo", "sequence", "group", 0.1, False, "rewards", True, 0.5),
    (12, 37, 3, "grpo", "token", "group", 0.0, True, "rewards", False, 0.7),
    (15, 11, 3, "bnpo", "token", "batch", 0.0, True, "components", False, 0.9),
    (12, 29, 3, "grpo", "sequence", "group", 0.04, True, "prefix", True, 0.4),
    (6, 23, 3, "dapo", "token", "group", 0.1, True, "prefix_rows", True, 0.0),
]


@pytest.mark.parametrize("case", LEVER_CASES, ids=lambda c: f"N{c[0]}T{c[1]}-{c[3]}-{c[4]}-{c[8]}-bias{int(c[9])}"
                                                           f"-floor{c[10]}")
def test_kernel_matches_reference_with_bias_corrected_kl_and_std_floor(case):
    """The two levers of the loss (TRL's bias-corrected KL, the std floor): kernel == reference
    (loss, d loss / d logp, every stat including kl_old_mean) on awkward shapes."""
    N, T, G, loss_type, importance, scale, beta, use_old, source, bias, floor = case
    inp = make_inputs(N, T, G, seed=N * T + 1)
    kw = dict(G=G, old_logp=inp["old"] if use_old else None, ref_logp=inp["ref"], beta=beta,
              eps_high=0.28, loss_type=loss_type, importance=importance, scale=scale,
              kl_bias_correction=bias, adv_std_floor=floor, **source_kwargs(source, inp, N, T))
    kernel, gold = run_both(inp, **kw)
    assert_match(kernel, gold)
    if use_old:
        assert gold[2]["kl_old_mean"] > 0
    else:
        assert gold[2]["kl_old_mean"] == 0


def sampler_logp_for(inp: dict, use_old: bool, spread: float, seed: int = 3) -> torch.Tensor:
    """A rollout engine's log-probs of the same tokens: the trainer's at sampling time (old,
    or logp when there is no old) plus noise; NaN under the mask, which must be ignored."""
    g = torch.Generator().manual_seed(seed)
    base = (inp["old"] if use_old else inp["logp"]).float().cpu()
    m = inp["mask"].cpu()
    samp = torch.where(m, base, 0.0) + spread * torch.randn(base.shape, generator=g)
    samp[~m] = torch.nan
    return samp.to(DEVICE)


# (N, T, G, loss_type, importance, use_old, correction, mode, cap, beta)
CORRECTION_CASES = [
    (6, 37, 3, "grpo", "token", True, "token", "truncate", 1.5, 0.04),
    (9, 20, 3, "bnpo", "sequence", True, "token", "mask", 1.5, 0.0),
    (8, 13, 4, "dapo", "token", False, "sequence", "mask", 3.0, 0.1),
    (10, 19, 2, "dr_grpo", "sequence", False, "sequence", "truncate", 2.0, 0.04),
    (12, 37, 3, "grpo", "token", True, "sequence", "mask", 1.2, 0.0),
    (5, 11, 1, "grpo", "token", True, "off", "mask", 1.5, 0.04),  # stats only
    (16, 70, 8, "bnpo", "token", False, "token", "mask", 1.1, 0.04),
]


@pytest.mark.parametrize("case", CORRECTION_CASES, ids=lambda c: f"N{c[0]}T{c[1]}-{c[3]}-{c[4]}-old{int(c[5])}"
                                                                 f"-{c[6]}-{c[7]}-C{c[8]}")
def test_kernel_matches_reference_with_rollout_correction(case):
    """Rollout correction: kernel == reference (loss, d loss / d logp, the mismatch stats) on
    awkward shapes, fully masked rows, NaN sampler padding, caps that bind."""
    N, T, G, loss_type, importance, use_old, corr, mode, cap, beta = case
    inp = make_inputs(N, T, G, seed=N * T + 2)
    kw = dict(G=G, rewards=inp["rewards"], old_logp=inp["old"] if use_old else None,
              ref_logp=inp["ref"] if beta else None, beta=beta, eps_high=0.28, loss_type=loss_type,
              importance=importance, sampler_logp=sampler_logp_for(inp, use_old, 0.4), correction=corr,
              correction_mode=mode, correction_cap=cap)
    kernel, gold = run_both(inp, **kw)
    assert_match(kernel, gold)
    st = gold[2]
    assert st["is_kl"] > 0 and st["is_ratio_max"] > cap and 0 < st["is_over_frac"] < 1  # the cap binds
    off = run_both(inp, **dict(kw, correction="off"))[1]
    if corr != "off":  # the correction changed the loss and its gradient
        assert not torch.allclose(off[1], gold[1])
    for name in ("is_kl", "is_ratio_mean", "is_ratio_max", "is_over_frac"):
        if corr != "sequence":  # token level and off report the same (token) figures
            torch.testing.assert_close(off[2][name], st[name])


@pytest.mark.parametrize("correction", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_correction_against_a_plain_formula(correction, mode):
    """Loss and gradient equal autograd through an independent formula: the policy term
    times a constant weight w = min(r, C) (truncate) or r * [r <= C] (mask), r = exp(old -
    sampler) per token or exp(sum_t) per row; the KL term unweighted; stats by hand."""
    N, T, G, beta, cap = 6, 9, 3, 0.1, 1.6
    inp = make_inputs(N, T, G, seed=33)
    samp = sampler_logp_for(inp, True, 0.3, seed=4)
    m = inp["mask"].cpu()
    mf = m.float()
    n = mf.sum(1, keepdim=True).clamp(min=1)
    lp = torch.where(m, inp["logp"].cpu(), 0.0).clone().requires_grad_()
    old = torch.where(m, inp["old"].cpu(), 0.0)
    ref = torch.where(m, inp["ref"].cpu(), 0.0)
    s = torch.where(m, samp.cpu(), 0.0)
    A = gl.group_advantages(source_of(gl, inp["rewards"].cpu()), G, backend="torch").values()[:, None]
    r = torch.exp(lp - old)
    pg = -torch.minimum(r * A, r.clamp(0.8, 1.2) * A)
    lr_is = (old - s) * mf
    if correction == "sequence":
        lr_is = lr_is.sum(1, keepdim=True)
    ratio = torch.exp(lr_is)
    w = torch.clamp(ratio, max=cap) if mode == "truncate" else torch.where(ratio > cap, 0.0, ratio)
    d = ref - lp
    per_token = w * pg + beta * (torch.exp(d) - d - 1)
    expect = ((per_token * mf).sum(1, keepdim=True) / n).mean()
    expect.backward()
    units = m if correction == "token" else (mf.sum(1, keepdim=True) > 0)
    ratio_u = ratio.expand_as(units)[units]
    for backend in ("torch", "triton"):
        logp = inp["logp"].clone().requires_grad_()
        loss, st = loss_of(gl, logp, m.to(DEVICE), inp["rewards"], G=G, old_logp=inp["old"], ref_logp=inp["ref"],
                                beta=beta, sampler_logp=samp, correction=correction, correction_mode=mode,
                                correction_cap=cap, backend=backend)
        loss.backward()
        torch.testing.assert_close(loss.detach().cpu(), expect.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(logp.grad.cpu(), lp.grad * mf, atol=1e-7, rtol=1e-5)
        k = torch.exp((old - s) * mf)
        torch.testing.assert_close(st.is_kl.cpu(), ((k - 1 - (old - s)) * mf).sum() / mf.sum())
        torch.testing.assert_close(st.is_ratio_mean.cpu(), ratio_u.mean())
        torch.testing.assert_close(st.is_ratio_max.cpu(), ratio_u.max())
        torch.testing.assert_close(st.is_over_frac.cpu(), (ratio_u > cap).float().mean())
    assert (ratio_u > cap).any() and (ratio_u <= cap).any()  # both branches of the cap exercised


def test_rollout_correction_without_a_mismatch_changes_nothing():
    """sampler_logp = the trainer's own log-probs: every ratio is 1, the corrected loss and
    gradient equal the uncorrected ones, and the stats read KL 0, ratio 1, nothing capped."""
    N, T, G = 6, 15, 3
    inp = make_inputs(N, T, G, seed=8)
    for backend in ("torch", "triton"):
        out = []
        for corr in ("off", "sequence"):
            logp = inp["logp"].clone().requires_grad_()
            samp = torch.where(inp["mask"], inp["logp"], 0.0) if corr != "off" else None
            loss, st = loss_of(gl, logp, inp["mask"], inp["rewards"], G=G, sampler_logp=samp, correction=corr,
                                    backend=backend)
            loss.backward()
            out.append((loss.detach(), logp.grad, st))
        torch.testing.assert_close(out[0][0], out[1][0])
        torch.testing.assert_close(out[0][1], out[1][1])
        for st in (out[0][2], out[1][2]):  # without sampler_logp: the trainer is taken as the sampler
            assert float(st.is_kl) == 0 and float(st.is_over_frac) == 0
            assert float(st.is_ratio_mean) == 1 and float(st.is_ratio_max) == 1


def test_rollout_correction_inputs_are_refused_with_clear_errors():
    inp = make_inputs(4, 5, 2)
    base = dict(G=2, rewards=inp["rewards"], backend="torch")
    for kw, msg in ((dict(correction="seq"), "correction must be one of"),
                    (dict(correction_mode="clip"), "correction_mode must be one of"),
                    (dict(correction_cap=1.0), "correction_cap must be a finite number > 1"),
                    (dict(correction_cap=float("inf")), "correction_cap must be a finite number > 1"),
                    (dict(sampler_logp=torch.zeros(4, 6, device=DEVICE)), "sampler_logp")):
        with pytest.raises(ValueError, match=msg):
            loss_of(gl, inp["logp"], inp["mask"], **base, **kw)


@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_bias_corrected_kl_against_autograd_of_a_plain_formula(importance):
    """kl_bias_correction: loss and gradient equal autograd through an independent one-line
    formula, beta * ratio * k3 (ratio with gradient, TRL's use_bias_correction_kl), on rows
    whose advantages are 0 (constant rewards) so that only the KL term is left."""
    N, T, G, beta = 4, 11, 2, 0.3
    inp = make_inputs(N, T, G, seed=21)
    m = inp["mask"].cpu()  # row 0 fully masked: its mean is over max(1, 0) tokens
    mf = m.float()
    n = mf.sum(1, keepdim=True).clamp(min=1)
    for backend in ("torch", "triton"):
        logp = inp["logp"].clone().requires_grad_()
        loss, st = loss_of(gl, logp, m.to(DEVICE), torch.ones(N, device=DEVICE), G=G, old_logp=inp["old"],
                                ref_logp=inp["ref"], beta=beta, importance=importance,
                                kl_bias_correction=True, backend=backend)
        loss.backward()
        lp = torch.where(m, inp["logp"].cpu(), 0.0).clone().requires_grad_()
        old = torch.where(m, inp["old"].cpu(), 0.0)
        ref = torch.where(m, inp["ref"].cpu(), 0.0)
        lr = lp - old
        if importance == "sequence":
            lr = ((lr * mf).sum(1, keepdim=True) / n).expand(N, T)
        d = ref - lp
        kl = torch.exp(lr) * (torch.exp(d) - d - 1)
        expect = ((beta * kl * mf).sum(1, keepdim=True) / n).mean()  # loss_type grpo
        expect.backward()
        torch.testing.assert_close(loss.detach().cpu(), expect.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(logp.grad.cpu(), lp.grad * mf, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(st.kl_mean.cpu(), (kl * mf).sum().detach() / mf.sum())
        if importance == "token":  # the closed form: d(r k3)/d logp = r (logp - ref)
            closed = torch.exp(lp - old) * (lp - ref) * mf * beta / (N * n)
            torch.testing.assert_close(logp.grad.cpu(), closed.detach(), atol=1e-7, rtol=1e-5)


def test_bias_corrected_kl_at_ratio_one_keeps_the_value_and_changes_the_gradient():
    """mu = 1 (old_logp None): the corrected term has the plain term's value (ratio = 1) but
    the gradient beta (logp - ref) instead of beta (1 - exp(ref - logp))."""
    inp = make_inputs(6, 9, 3, seed=4)
    out = {}
    for bias in (False, True):
        logp = inp["logp"].clone().requires_grad_()
        loss, _ = loss_of(gl, logp, inp["mask"], inp["rewards"], G=3, ref_logp=inp["ref"], beta=0.2,
                               kl_bias_correction=bias, backend="triton")
        loss.backward()
        out[bias] = (loss.detach(), logp.grad)
    torch.testing.assert_close(out[True][0], out[False][0])
    m = inp["mask"]
    lp, ref = torch.where(m, inp["logp"], 0.0), torch.where(m, inp["ref"], 0.0)
    n = m.sum(1, keepdim=True).clamp(min=1)
    delta = 0.2 * ((lp - ref) - (1 - torch.exp(ref - lp))) * m / (6 * n)  # corrected - plain
    torch.testing.assert_close(out[True][1] - out[False][1], delta, atol=1e-7, rtol=1e-5)
    assert delta.abs().max() > 1e-4  # 1000x the gradient tolerance: the two gradients do differ


# (N, T, G, loss_type, importance, beta, use_old, kl_estimator, kl_bias_correction)
KL_ESTIMATOR_CASES = [
    (6, 37, 3, "grpo", "token", 0.1, True, "k1", False),
    (9, 20, 3, "bnpo", "sequence", 0.04, True, "k2", False),
    (8, 13, 2, "dapo", "token", 0.3, False, "k2", True),
    (10, 19, 2, "dr_grpo", "sequence", 0.1, False, "k1", True),
    (12, 29, 3, "grpo", "token", 0.2, True, "k2", True),
    (5, 70, 1, "grpo", "sequence", 0.05, True, "k1", True),
    (6, 11, 3, "bnpo", "token", 0.0, True, "k1", False),  # beta 0: the estimator only changes kl_mean
]


@pytest.mark.parametrize("case", KL_ESTIMATOR_CASES, ids=lambda c: f"N{c[0]}T{c[1]}-{c[3]}-{c[4]}-{c[7]}"
                                                                  f"-bias{int(c[8])}-beta{c[5]}")
def test_kernel_matches_reference_with_each_kl_estimator(case):
    """k1 / k2 (k3 is every other case here): kernel == reference, loss, d loss / d logp and stats."""
    N, T, G, loss_type, importance, beta, use_old, est, bias = case
    inp = make_inputs(N, T, G, seed=N * T + 5)
    kw = dict(G=G, rewards=inp["rewards"], old_logp=inp["old"] if use_old else None, ref_logp=inp["ref"],
              beta=beta, eps_high=0.28, loss_type=loss_type, importance=importance, kl_estimator=est,
              kl_bias_correction=bias)
    kernel, gold = run_both(inp, **kw)
    assert_match(kernel, gold)
    k3 = run_both(inp, **dict(kw, kl_estimator="k3"))[1]
    assert not torch.allclose(k3[2]["kl_mean"], gold[2]["kl_mean"])  # the estimate did change
    if beta:
        assert not torch.allclose(k3[1], gold[1])  # and so did the gradient


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_against_autograd_of_the_formulas(est, importance, bias):
    """Each estimator written from Schulman's definitions with r = pi_ref / pi, d = log r:
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r; kl_bias_correction multiplies it
    by the importance ratio (gradient through the ratio). On rows whose advantages are 0 only
    the KL term is left: loss, gradient and kl_mean equal autograd through that formula, and
    the gradient without the correction has the closed forms 1, logp - ref, 1 - r."""
    N, T, G, beta = 6, 13, 3, 0.3
    inp = make_inputs(N, T, G, seed=41)
    m = inp["mask"].cpu()
    mf = m.float()
    n = mf.sum(1, keepdim=True).clamp(min=1)
    lp = torch.where(m, inp["logp"].cpu(), 0.0).clone().requires_grad_()
    old = torch.where(m, inp["old"].cpu(), 0.0)
    ref = torch.where(m, inp["ref"].cpu(), 0.0)
    log_r = ref - lp
    k = {"k1": -log_r, "k2": log_r ** 2 / 2, "k3": torch.exp(log_r) - 1 - log_r}[est]
    lr = lp - old
    if importance == "sequence":
        lr = ((lr * mf).sum(1, keepdim=True) / n).expand(N, T)
    kl = torch.exp(lr) * k if bias else k
    expect = ((beta * kl * mf).sum(1, keepdim=True) / n).mean()  # loss_type grpo
    expect.backward()
    closed = {"k1": torch.ones_like(lp), "k2": lp - ref, "k3": 1 - torch.exp(ref - lp)}[est].detach()
    if not bias:
        torch.testing.assert_close(lp.grad, beta * closed * mf / (N * n), atol=1e-7, rtol=1e-5)
    for backend in ("torch", "triton"):
        logp = inp["logp"].clone().requires_grad_()
        loss, st = loss_of(gl, logp, m.to(DEVICE), torch.ones(N, device=DEVICE), G=G, old_logp=inp["old"],
                           ref_logp=inp["ref"], beta=beta, importance=importance, kl_estimator=est,
                           kl_bias_correction=bias, backend=backend)
        loss.backward()
        torch.testing.assert_close(loss.detach().cpu(), expect.detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(logp.grad.cpu(), lp.grad * mf, atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(st.kl_mean.cpu(), (kl * mf).sum().detach() / mf.sum())


def test_k2_and_k3_agree_near_the_reference_and_k2_has_the_corrected_gradient():
    """Near pi_ref, k3 = d^2/2 + O(d^3) = k2 + O(d^3) (float64: fp32 loses exp(d) - d - 1 to
    cancellation), and k2's gradient equals k3's with the bias correction at ratio 1 (both
    beta (logp - ref)): the identities the module docstring's table rests on."""
    g = torch.Generator().manual_seed(5)
    lp = -2 * torch.rand(4, 9, generator=g)
    ref = lp + 1e-2 * torch.randn(4, 9, generator=g)
    d = (ref - lp).double()
    gap = gl.kl_estimate(d, "k3") - gl.kl_estimate(d, "k2")
    assert (gap.abs() <= d.abs() ** 3).all()  # |d^3 / 6 + ...| <= |d|^3 for |d| << 1
    mask = torch.ones(4, 9, dtype=torch.bool, device=DEVICE)
    grads = {}
    for est, bias in (("k2", False), ("k3", True)):
        logp = lp.clone().to(DEVICE).requires_grad_()
        loss, _ = loss_of(gl, logp, mask, torch.ones(4, device=DEVICE), G=2, ref_logp=ref.to(DEVICE), beta=1.0,
                          kl_estimator=est, kl_bias_correction=bias, backend="triton")
        loss.backward()
        grads[est] = logp.grad
    torch.testing.assert_close(grads["k2"], grads["k3"], atol=1e-9, rtol=1e-5)


def test_kl_old_mean_is_k3_of_the_token_ratios():
    inp = make_inputs(6, 10, 3, seed=6)
    m = inp["mask"]
    lr = torch.where(m, inp["logp"], 0.0) - torch.where(m, inp["old"], 0.0)
    expect = ((torch.exp(lr) - 1 - lr) * m).sum() / m.sum()
    for backend in ("torch", "triton"):
        for importance in ("token", "sequence"):  # token ratios either way
            _, st = loss_of(gl, inp["logp"], m, inp["rewards"], G=3, old_logp=inp["old"],
                                 importance=importance, backend=backend)
            torch.testing.assert_close(st.kl_old_mean, expect)
        _, st = loss_of(gl, inp["logp"], m, inp["rewards"], G=3, backend=backend)
        assert st.kl_old_mean == 0


def test_std_floor_by_hand():
    """max(std, floor) + eps: a tied group's tiny tie-breaker spread stays small, a group
    that splits on a big term is untouched, floor 0 is bit-identical to no floor."""
    G = 4
    tie = torch.tensor([3.0, 3.0, 3.1, 3.0])  # ties on everything but a .1 tie-breaker
    split = torch.tensor([4.0, 0.0, 0.0, 4.1])
    r = torch.cat([tie, split])
    adv, _ = gl.grpo_advantages_reference(r, G)
    adv_f, _ = gl.grpo_advantages_reference(r, G, std_floor=1.0)
    assert adv[:4].abs().max() > 1.4  # the tie-breaker alone: a full-size advantage
    torch.testing.assert_close(adv_f[:4], (tie - tie.mean()) / (1.0 + 1e-4))  # floored: .075 at most
    torch.testing.assert_close(adv_f[4:], adv[4:])  # std 2.3 > floor: as before
    assert torch.equal(gl.grpo_advantages_reference(r, G, std_floor=0.0)[0], adv)
    adv_b, _ = gl.grpo_advantages_reference(r, G, scale="batch", std_floor=10.0)
    torch.testing.assert_close(adv_b[:4], (tie - tie.mean()) / (10.0 + 1e-4))
    for scale in ("group", "batch"):
        for floor in (0.0, 1.0, 10.0):
            coef, const = gl.group_zscore_triton(r[:, None], None, None, G, scale, 1e-4, floor)
            z, c = gl.group_zscore_reference(r[:, None], G, scale=scale, std_floor=floor)
            torch.testing.assert_close(coef, z)
            assert torch.equal(const.bool(), c)


def test_lever_inputs_are_refused_with_clear_errors():
    inp = make_inputs(6, 8, 3)
    logp, mask, r = inp["logp"], inp["mask"], inp["rewards"]
    with pytest.raises(ValueError, match="adv_std_floor must be >= 0"):
        loss_of(gl, logp, mask, r, G=3, adv_std_floor=-1.0)
    with pytest.raises(ValueError, match="scale='none' divides by none"):
        loss_of(gl, logp, mask, r, G=3, adv_std_floor=0.5, scale="none")
    with pytest.raises(ValueError, match="kl_bias_correction=True weights the KL term, which needs ref_logp"):
        loss_of(gl, logp, mask, r, G=3, kl_bias_correction=True)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        loss_of(gl, logp, mask, r, G=3, kl_estimator="low_var_kl")


@pytest.mark.parametrize("loss_type,importance", [("grpo", "token"), ("dapo", "sequence")])
def test_bf16_against_fp32_gold(loss_type, importance):
    inp = make_inputs(9, 37, 3, seed=3, dtype=torch.bfloat16)
    kw = dict(G=3, old_logp=inp["old"], ref_logp=inp["ref"], beta=0.04, eps_high=0.28,
              loss_type=loss_type, importance=importance, rewards=inp["rewards"])
    kernel, gold = run_both(inp, dtype=torch.bfloat16, **kw)
    assert_match(kernel, gold, dtype=torch.bfloat16)


def test_dapo_normaliser_number_and_tensor_agree():
    inp = make_inputs(6, 16, 2, seed=5)
    out = []
    for norm in (123.0, torch.tensor([123], device=DEVICE)):  # a number or a 1-element count
        for backend in ("triton", "torch"):
            logp = inp["logp"].clone().requires_grad_()
            loss, _ = loss_of(gl, logp, inp["mask"], inp["rewards"], G=2, old_logp=inp["old"],
                                   loss_type="dapo", num_active_tokens=norm, backend=backend)
            loss.backward()
            out.append((loss.detach(), logp.grad))
    bnpo, _ = loss_of(gl, inp["logp"], inp["mask"], inp["rewards"], G=2, old_logp=inp["old"],
                           loss_type="bnpo", backend="torch")
    M = inp["mask"].sum().item()
    for loss, grad in out[1:]:
        torch.testing.assert_close(loss, out[0][0])
        torch.testing.assert_close(grad, out[0][1])
    torch.testing.assert_close(out[0][0] * 123.0, bnpo * M)  # same sum, other divisor


def test_backward_scales_with_upstream_gradient():
    inp = make_inputs(4, 10, 2, seed=9)
    grads = []
    for scale in (1.0, 0.25):
        logp = inp["logp"].clone().requires_grad_()
        loss, _ = loss_of(gl, logp, inp["mask"], inp["rewards"], G=2, old_logp=inp["old"],
                               loss_type="bnpo", backend="triton")
        (loss * scale).backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[1], 0.25 * grads[0])


# --- the reference itself, against independent hand computations --------------------------


def test_group_advantages_follow_trl_convention():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.1, 0.1, 0.1 + 1e-7])
    adv, zero = gl.grpo_advantages_reference(r, G=3)
    for b in range(3):
        g = r[3 * b:3 * b + 3]
        expect = (g - g.mean()) / (torch.std(g) + 1e-4)  # torch.std: unbiased, as TRL
        if b == 1:
            expect = torch.zeros(3)  # constant group: exactly 0, not (x - mean)/eps noise
        torch.testing.assert_close(adv[3 * b:3 * b + 3], expect)
    assert zero.tolist() == [False, True, False]
    adv1, zero1 = gl.grpo_advantages_reference(r, G=1)  # std undefined -> 0, zero-spread
    assert adv1.abs().max() == 0 and zero1.all()
    adv_b, _ = gl.grpo_advantages_reference(r, G=3, scale="batch")
    torch.testing.assert_close(adv_b[:3], (r[:3] - r[:3].mean()) / (r.std() + 1e-4))


def test_multi_component_advantages_are_weighted_sums_of_zscores():
    comps = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 3.0], [1.0, 1.0]])
    w = torch.tensor([2.0, 0.5])
    adv, zero = gl.grpo_advantages_reference(comps, G=2, weights=w)
    z0, _ = gl.grpo_advantages_reference(comps[:, 0], G=2)
    z1, _ = gl.grpo_advantages_reference(comps[:, 1], G=2)
    torch.testing.assert_close(adv, 2.0 * z0 + 0.5 * z1)
    assert zero.tolist() == [False, False]  # group 1: component 0 constant, component 1 not


def test_prefix_advantages_match_a_plain_loop():
    N, T, J, G = 6, 7, 3, 3
    p = make_prefix(N, T, J, per_row_rho=True)
    p.t_end = p.t_end.cpu()
    adv, zero = gl.prefix_advantages_reference(p, T, G)
    z_ans, _ = gl.grpo_advantages_reference(p.R_ans.cpu(), G)
    for i in range(N):
        b = i // G
        for t in range(T):
            total = p.a * z_ans[i].item()
            for j in range(J):
                rows = [k for k in range(b * G, b * G + G) if p.scored[k, j]]
                vals = torch.tensor([p.s[k, j].item() for k in rows])
                if not p.scored[i, j] or len(rows) < 2 or vals.max() == vals.min():
                    continue  # unscored here, or constant item: 0
                z = (p.s[i, j].item() - vals.mean().item()) / (vals.std().item() + 1e-4)
                if t <= p.t_end[i, j]:
                    total += (1 - p.a) * p.rho[i, j].item() * z
            assert math.isclose(adv[i, t].item(), total, rel_tol=1e-5, abs_tol=1e-6), (i, t)


def test_ratio_one_gradient_is_minus_advantage_over_tokens():
    """old = detached logp (ratio = 1, the two min() branches tie): grad = -A m / (N n_i)."""
    inp = make_inputs(4, 9, 2, seed=11)
    adv, _ = gl.grpo_advantages_reference(inp["rewards"].cpu(), G=2)
    n = inp["mask"].sum(1).clamp(min=1).cpu()
    expect = -adv[:, None] * inp["mask"].cpu() / (4 * n[:, None])
    for backend in ("torch", "triton"):
        logp = inp["logp"].clone().requires_grad_()
        loss, stats = loss_of(gl, logp, inp["mask"], inp["rewards"], G=2, backend=backend)
        loss.backward()
        torch.testing.assert_close(logp.grad.cpu(), expect.float())
        assert abs(loss.item()) < 1e-6  # sum_i A_i = 0 within each group
        assert stats.clip_low_frac == 0 and stats.clip_high_frac == 0


def test_sequence_ratio_and_k3_kl_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.8, -0.5]])
    ref = torch.tensor([[-0.9, -2.2, -0.7]])
    mask = torch.tensor([[1, 1, 0]])
    A = torch.tensor([0.7])
    loss, st = gl.grpo_loss_reference(logp, mask, A, old_logp=old, ref_logp=ref,
                                      options=gl.LossOptions(beta=0.1, importance="sequence", eps_high=0.28))
    s = math.exp(((-1.0 + 1.1) + (-2.0 + 1.8)) / 2)
    d = [0.1, -0.2]
    kl = [math.exp(x) - x - 1 for x in d]
    expect = sum(-min(s * 0.7, min(max(s, 0.8), 1.28) * 0.7) + 0.1 * k for k in kl) / 2
    assert math.isclose(loss.item(), expect, rel_tol=1e-5)
    assert math.isclose(st["kl_mean"].item(), sum(kl) / 2, rel_tol=1e-5)


# --- bad input: one clear error ----------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    inp = make_inputs(6, 8, 3)
    logp, mask, r = inp["logp"], inp["mask"], inp["rewards"]
    with pytest.raises(ValueError, match="not divisible by G = 4"):
        loss_of(gl, logp, mask, r, G=4)
    with pytest.raises(ValueError, match=r"mask has shape \(6, 7\)"):
        loss_of(gl, logp, mask[:, :7], r, G=3)
    with pytest.raises(ValueError, match="advantages are for 3 rows, the loss has 6"):
        loss_of(gl, logp, mask, r[:3], G=3)
    with pytest.raises(TypeError, match="logp must be a floating-point"):
        loss_of(gl, logp.long(), mask, r, G=3)
    bad = r.clone()
    bad[[1, 4]] = torch.nan
    with pytest.raises(ValueError, match=r"rewards has NaN/inf in rows \[1, 4\]"):
        loss_of(gl, logp, mask, bad, G=3, backend="triton")
    with pytest.raises(ValueError, match="needs ref_logp"):
        loss_of(gl, logp, mask, r, G=3, beta=0.1)
    with pytest.raises(TypeError, match="advantages must come from group_advantages"):
        gl.grpo_loss(logp, mask, r)
    with pytest.raises(ValueError, match="advantages are for 6 rows, the loss has 3"):
        gl.grpo_loss(logp[:3], mask[:3], gl.group_advantages(source_of(gl, r), 3))
    with pytest.raises(ValueError, match=r"2 reward columns need weights \[2\]"):
        gl.group_advantages(gl.AdvantageSource(torch.stack([r, r], 1)), 3)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        loss_of(gl, logp, mask, r, G=3, loss_type="ppo")
    with pytest.raises(ValueError, match="backend must be one of"):
        loss_of(gl, logp, mask, r, G=3, backend="cuda")
    p = make_prefix(6, 8, 2)
    p.t_end = p.t_end.float()
    with pytest.raises(TypeError, match="t_end must be an integer"):
        loss_of(gl, logp, mask, G=3, prefix=p)


def test_backend_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    monkeypatch.setenv("KERNELS_BACKEND", "triton")
    assert resolve_backend("auto", cpu) == "triton"
    assert resolve_backend("torch", cpu) == "torch"  # an explicit argument wins
    monkeypatch.setenv("KERNELS_BACKEND", "fast")
    with pytest.raises(ValueError, match="KERNELS_BACKEND"):
        resolve_backend("auto", cpu)


def test_compiled_kernel_on_cpu_tensors_gives_clear_error():
    from grpo_kernels._dispatch import check_launchable

    class JITFunction:  # stands in for a kernel defined without the interpreter
        pass

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_launchable(JITFunction(), torch.device("cpu"), "grpo_kernels.grpo_loss")


# The non-trivial constexpr branches, in few variants: each compile costs ~1 s of CPU.
COMPILE_SCRIPT = r"""
import grpo_kernels.grpo_advantages as ga
import grpo_kernels.grpo_loss as gl
from grpo_kernels._dispatch import compile_for_gpu
types = {"beta": "fp32", "eps_low": "fp32", "eps_high": "fp32", "eps": "fp32", "norm_value": "fp32",
         "std_floor": "fp32",
         "logp_ptr": "*bf16", "mask_ptr": "*u8", "valid_ptr": "*u8", "tend_ptr": "*i32"}
types["log_cap"] = "fp32"
# (ADV_MODE, SEQ, HAS_OLD, HAS_REF, KL_IN_LOSS, ROW_MEAN, BLOCK_T, BIAS_KL, HAS_SAMP, CORR, CORR_MASK)
for mode, seq, old, ref, kl, row_mean, block, bias, samp, corr, cmask in [
        (0, False, True, True, True, True, 4096, False, False, 0, False),
        (1, True, True, True, False, False, 1024, False, True, 1, True),
        (0, True, False, False, False, True, 4096, False, True, 2, False),
        (0, True, True, True, True, True, 4096, True, True, 0, False),
        (0, False, False, True, True, False, 4096, True, True, 2, True)]:
    compile_for_gpu(gl._grpo_loss_fwd_kernel, dict(ADV_MODE=mode, SEQ=seq, HAS_OLD=old, HAS_REF=ref,
                    KL_IN_LOSS=kl, ROW_MEAN=row_mean, BLOCK_T=block, C_PAD=4, BIAS_KL=bias, HAS_SAMP=samp,
                    CORR=corr, CORR_MASK=cmask), types, num_warps=block // 256)
for scale, valid, w in ((0, False, False), (1, True, True), (2, True, False)):
    compile_for_gpu(ga._group_zscore_kernel, dict(SCALE=scale, HAS_VALID=valid, HAS_W=w, G_PAD=8,
                    BLOCK_N=64), types)
compile_for_gpu(gl._scale_grad_kernel, dict(BLOCK=2048), {"out_ptr": "*bf16"})
for loss_type, norm_mode, samp in ((1, 0, False), (3, 2, True)):
    compile_for_gpu(gl._grpo_finalize_kernel, dict(LOSS_TYPE=loss_type, NORM_MODE=norm_mode,
                    BLOCK_N=64, C_PAD=4, HAS_SAMP=samp), types)
print("compiled")
"""


def test_kernels_compile_for_a_gpu_without_one():
    """The interpreter runs Python the compiler would reject: compile every variant for
    sm_90 with triton's bundled ptxas, in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    if res.returncode != 0 and "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("triton's bundled ptxas is not available on this platform")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_advantages_shape_equals_the_spec_on_both_paths(backend):
    """group_advantages returns one factored shape whatever computes it; its values(T) is the
    reference's A: bit for bit in row mode on the reference path (the trainer's default), to
    float rounding in prefix mode and on the kernel path."""
    N, T, G = 12, 7, 3
    g = torch.Generator().manual_seed(5)
    r = torch.randint(0, 4, (N,), generator=g).float().to(DEVICE)
    comps, w = torch.rand(N, 2, generator=g).to(DEVICE), torch.tensor([0.7, 0.3]).to(DEVICE)
    exact = backend == "torch"
    for kw, spec in ((dict(rewards=r), gl.grpo_advantages_reference(r, G)),
                     (dict(reward_components=comps, component_weights=w),
                      gl.grpo_advantages_reference(comps, G, weights=w))):
        adv = gl.group_advantages(source_of(gl, **kw), G, backend=backend)
        assert adv.mode == "row" and adv.coef.shape[0] == N
        if exact:
            assert torch.equal(adv.values(), spec[0])
        torch.testing.assert_close(adv.values(), spec[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(adv.zero_spread(), spec[1])
    prefix = make_prefix(N, T, 3)
    adv = gl.group_advantages(gl.AdvantageSource.of_prefix(prefix), G, T=T, backend=backend)
    spec_adv, spec_zero = gl.prefix_advantages_reference(prefix, T, G)
    assert adv.mode == "prefix" and adv.values(T).shape == (N, T)
    torch.testing.assert_close(adv.values(T), spec_adv, rtol=1e-6, atol=1e-6)
    assert torch.equal(adv.zero_spread(), spec_zero)
    with pytest.raises(ValueError, match="needs the completion length T"):
        adv.values()
