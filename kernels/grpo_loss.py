"""Fused GRPO loss: advantages, clipped ratio, k3 KL, aggregation and d loss / d logp in one pass.

What is implemented (TRL's GRPO loss, DESIGN.md section 4; TRL's own defaults differ in
places: its default aggregation is now "dapo", ours "grpo"):

    A          = (r - mean_g) / (std_g + adv_eps)      group-normalised advantage, per prompt
    ratio_t    = exp(logp_t - old_t)                   importance="token"
    ratio_t    = exp(mean_t'(logp_t' - old_t'))        importance="sequence" (GSPO), every token
    pg_t       = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
    kl_t       = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                        (k3 estimator)
    kl_t       = ratio_t * k3_t                        kl_bias_correction=True (see below)
    loss       = aggregate(pg_t + beta * kl_t) over active tokens (mask != 0)

KL convention. The plain k3 term is DeepSeekMath's; its value estimates KL(pi || pi_ref)
when the tokens come from pi itself, but its gradient, (1 - exp(ref_t - logp_t)) d logp_t,
is not the gradient of that KL. ``kl_bias_correction=True`` is TRL's
``use_bias_correction_kl`` (DeepSeek-V3.2's unbiased KL estimate): k3 weighted by the same
importance ratio as the policy term, gradient through the ratio included. Its gradient is
ratio_t (logp_t - ref_t) d logp_t, the importance-weighted gradient of KL(pi || pi_ref)
for tokens drawn from the old policy. At mu = 1 the ratio is 1 in value, so the loss value
is unchanged but the gradient is not: the plain term pushes with 1 - exp(ref - logp) ~
(logp - ref) - (logp - ref)^2 / 2, the corrected one with exactly logp - ref. Default off
(the DeepSeekMath form this project has always used; the TRL grpo_config.py we could read
also documents it as off by default, but defaults move between TRL releases: check yours
before comparing runs). kl_mean reports the KL term as it enters the loss (corrected or not).

Aggregation ("loss_type"), with n_i active tokens in row i and M = sum_i n_i:
    grpo     mean_i( sum_t loss_it / n_i )      per-sequence mean, then mean over the N rows
    bnpo     sum_it loss_it / M                 token mean over this micro-batch
    dr_grpo  sum_it loss_it / (N * max_len)     max_len = max completion length (default T)
    dapo     sum_it loss_it / num_active_tokens tokens of the whole accumulated batch
                                                (default M, i.e. this micro-batch)

Advantage sources (exactly one; kernels/grpo_advantages.py has the z-score details):
    rewards [N]                      A = z(r), z = group z-score (unbiased std + adv_eps)
    reward_components [N,K] + w [K]  A = sum_k w_k z(r_k), each component z-scored alone
    prefix (V-Rubrics)               A_t = a z(R_ans) + (1-a) sum_j rho_j z(s_j) 1[t <= t_end_j]
    token_adv [N,T]                  given by the caller, used as is (first-class: rows are
                                     never chunked, so they cannot be mixed up)
zero_spread_frac counts the groups in which every reward input is constant (G = 1
included), i.e. whose advantages are all 0; with token_adv, those whose active token
advantages are all 0. adv_std_floor > 0 divides by max(std, floor) instead of std (the
tie-breaker rule of kernels/grpo_advantages.py).

Several updates per batch (mu > 1, PPO epochs): pass old_logp = the log-probs of the
policy that sampled the batch, detached; from the second update on the ratio differs from
1 and the clip binds. kl_old_mean reports k3 of the current policy against old,
mean_t (ratio_t - 1) - log ratio_t with token ratios (Schulman's approximate KL; 0 when
old_logp is None).

Gradient: only logp gets one. old_logp, ref_logp and all advantage inputs are constants
(exactly as in GRPO). At a tie of the two min() branches the gradient is -A (torch.minimum
gives half to each branch and both carry -A inside the clip range); a token whose clipped
branch wins *and* whose ratio is outside the range gets 0.

Kernels (three launches forward, one backward; no atomics, deterministic):
    1. _group_zscore_kernel  grid (C,): one program per reward column; loops over the B
       groups of that column ([N] floats, microseconds). Writes coef = w * z and the
       constant-group flags.
    2. _grpo_loss_fwd_kernel grid (N,): one program per completion, BLOCK_T tokens at a
       time. Pass 1 counts active tokens (and the sequence log-ratio); pass 2 computes
       loss, stats and the per-token gradient; sequence importance adds pass 3, because
       every token's gradient then depends on a sum over the whole row.
    3. _grpo_finalize_kernel grid (1,): sums the [N, 8] row partials into loss and stats.
    4. _scale_grad_kernel (backward): grad * g * normaliser, cast to logp's dtype. The
       normaliser of bnpo/dapo is known only after every row is done, and g only in
       backward, so the forward stores the gradient without them.
Memory traffic per token: read logp, old, ref (4 B each in fp32), mask (1 B), write the
fp32 gradient (4 B) and rescale it in backward (4 + 4 B). The eager reference runs ~90
ops for forward + backward (torch.profiler, stats included), many a full pass over [N, T].

Gradient accumulation: grpo/bnpo/dr_grpo are per-micro-batch means (average the
micro-batch losses, i.e. divide by the number of steps); dapo with num_active_tokens =
active tokens of the whole accumulated batch is already normalised (sum the losses).

Simplified: no "GSPO-token" variant, no entropy masking, no top-entropy token selection.
Masked positions may hold anything (padding -inf, NaN); they are replaced by 0 before any
arithmetic, so they never poison a sum (TRL multiplies by the mask, where inf * 0 = NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from kernels._dispatch import check_launchable, last_dim_contiguous, next_pow2, resolve_backend
# The advantage half lives in grpo_advantages; its public names are re-exported from here.
from kernels.grpo_advantages import (SCALES, PrefixRubrics, group_zscore_reference,  # noqa: F401
                                     group_zscore_triton, grpo_advantages_reference,
                                     prefix_advantages_reference)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE = ("token", "sequence")
_INT32_MAX = 2**31 - 1


@dataclass
class GRPOStats:
    """Diagnostics from the same pass, detached 0-d fp32 tensors (no host sync)."""

    kl_mean: torch.Tensor  # mean KL term vs ref over active tokens (k3, or ratio * k3; 0 without ref_logp)
    clip_low_frac: torch.Tensor  # active tokens with ratio < 1 - eps_low and A < 0
    clip_high_frac: torch.Tensor  # active tokens with ratio > 1 + eps_high and A > 0
    zero_spread_frac: torch.Tensor  # groups with constant rewards (token_adv: all-zero A)
    adv_abs_mean: torch.Tensor  # mean |A_t| over active tokens
    kl_old_mean: torch.Tensor  # mean k3 of the current policy vs old_logp: (ratio - 1) - log ratio

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---------------------------------------------------------------------------------------
# Reference: the spec. Plain PyTorch, any device, differentiable w.r.t. logp.
# ---------------------------------------------------------------------------------------


def grpo_loss_reference(
    logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, *,
    old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
    beta: float = 0.0, eps_low: float = 0.2, eps_high: float = 0.2, loss_type: str = "grpo",
    importance: str = "token", max_len: int | None = None,
    num_active_tokens: float | torch.Tensor | None = None, kl_bias_correction: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss from given advantages adv [N] or [N, T]; stats without zero_spread_frac."""
    N, T = logp.shape
    m = mask != 0
    mf = m.float()
    lp = torch.where(m, logp.float(), 0.0)  # padding may hold -inf: keep it out of products
    old = lp.detach() if old_logp is None else torch.where(m, old_logp.float(), 0.0)
    A = adv.float()[:, None].expand(N, T) if adv.dim() == 1 else adv.float()
    A = torch.where(m, A.detach(), 0.0)
    n = mf.sum(-1).clamp(min=1)  # [N]

    token_log_ratio = lp - old
    log_ratio = token_log_ratio
    if importance == "sequence":
        log_ratio = ((log_ratio * mf).sum(-1, keepdim=True) / n[:, None]).expand(N, T)
    ratio = torch.exp(log_ratio)
    pg_loss1 = ratio * A
    pg_loss2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * A
    per_token = -torch.minimum(pg_loss1, pg_loss2)

    kl = torch.zeros_like(lp)
    if ref_logp is not None:
        d = torch.where(m, ref_logp.float(), 0.0) - lp
        kl = torch.exp(d) - d - 1
        if kl_bias_correction:  # TRL's use_bias_correction_kl: the ratio carries gradient too
            kl = ratio * kl
        if beta != 0.0:
            per_token = per_token + beta * kl

    M = mf.sum().clamp(min=1)
    total = (per_token * mf).sum()
    if loss_type == "grpo":
        loss = ((per_token * mf).sum(-1) / n).mean()
    elif loss_type == "bnpo":
        loss = total / M
    elif loss_type == "dr_grpo":
        loss = total / (N * (T if max_len is None else max_len))
    elif num_active_tokens is None:
        loss = total / M
    elif isinstance(num_active_tokens, torch.Tensor):  # [] or [1], maybe an int count
        loss = total / num_active_tokens.reshape(()).float()
    else:
        loss = total / num_active_tokens

    with torch.no_grad():
        stats = {
            "kl_mean": (kl * mf).sum() / M,
            "clip_low_frac": ((ratio < 1 - eps_low) & (A < 0) & m).sum() / M,
            "clip_high_frac": ((ratio > 1 + eps_high) & (A > 0) & m).sum() / M,
            "adv_abs_mean": (A.abs() * mf).sum() / M,
            "kl_old_mean": ((torch.exp(token_log_ratio) - 1 - token_log_ratio) * mf).sum() / M,
        }
    return loss, stats


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _grpo_loss_fwd_kernel(
    logp_ptr, old_ptr, ref_ptr, mask_ptr, adv_ptr, coef_ptr, tend_ptr, grad_ptr, part_ptr,
    T, C,
    stride_lp, stride_old, stride_ref, stride_m, stride_adv, stride_coef, stride_tend,
    beta, eps_low, eps_high,
    ADV_MODE: tl.constexpr,  # 0 row advantage, 1 prefix cut-offs, 2 token advantages
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, KL_IN_LOSS: tl.constexpr,
    SEQ: tl.constexpr, ROW_MEAN: tl.constexpr, BLOCK_T: tl.constexpr, C_PAD: tl.constexpr,
    BIAS_KL: tl.constexpr,  # kl_t = ratio_t * k3_t (TRL's use_bias_correction_kl)
):
    """One program per completion row i. Writes grad[i, :] and 8 row partials."""
    i = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    lp_row = logp_ptr + i * stride_lp
    old_row = old_ptr + i * stride_old
    m_row = mask_ptr + i * stride_m
    grad_row = grad_ptr + i * T

    # Pass 1: active-token count n (and the GSPO sequence log-ratio). Reads 1 B/token.
    n = 0.0
    seq_lr = 0.0
    if ROW_MEAN or SEQ:
        for start in range(0, T, BLOCK_T):
            t = start + offs
            m = tl.load(m_row + t, mask=t < T, other=0) != 0
            n += tl.sum(m.to(tl.float32))
            if SEQ and HAS_OLD:
                lp = tl.load(lp_row + t, mask=t < T, other=0.0).to(tl.float32)
                old = tl.load(old_row + t, mask=t < T, other=0.0).to(tl.float32)
                seq_lr += tl.sum(tl.where(m, lp - old, 0.0))
    n_safe = tl.maximum(n, 1.0)
    row_w = 1.0
    if ROW_MEAN:
        row_w = 1.0 / n_safe
    ratio_seq = tl.exp(seq_lr / n_safe)

    # The row's advantage: a scalar, or per-column coefficients with token cut-offs.
    cols = tl.arange(0, C_PAD)
    if ADV_MODE == 0:
        adv_row = tl.sum(tl.load(coef_ptr + i * stride_coef + cols, mask=cols < C, other=0.0))
    if ADV_MODE == 1:
        coef = tl.load(coef_ptr + i * stride_coef + cols, mask=cols < C, other=0.0)
        t_end = tl.load(tend_ptr + i * stride_tend + cols, mask=cols < C, other=-1)

    # Pass 2: loss, stats and the gradient, BLOCK_T tokens at a time. Loads are masked by
    # bounds only (a data-dependent mask would stop 16-byte vectorised loads); padding
    # values (-inf, NaN) are then replaced by 0 with tl.where before any arithmetic.
    acc_n = 0.0  # = n; pass 1 is skipped for bnpo/dr_grpo/dapo with token importance
    acc_loss = 0.0
    acc_kl = 0.0
    acc_lo = 0.0
    acc_hi = 0.0
    acc_abs = 0.0
    acc_max = 0.0
    acc_dratio = 0.0  # sum_t d (pg_t + beta kl_t) / d ratio_seq (sequence importance only)
    acc_kl_old = 0.0  # sum_t k3(current vs old) = (r_t - 1) - log r_t, token ratios
    for start in range(0, T, BLOCK_T):
        t = start + offs
        inb = t < T
        m = tl.load(m_row + t, mask=inb, other=0) != 0
        lp = tl.where(m, tl.load(lp_row + t, mask=inb, other=0.0).to(tl.float32), 0.0)
        if HAS_OLD:
            old = tl.where(m, tl.load(old_row + t, mask=inb, other=0.0).to(tl.float32), 0.0)
        else:
            old = lp  # one iteration per batch: old = detached current, ratio = 1
        if ADV_MODE == 0:
            A = tl.zeros([BLOCK_T], dtype=tl.float32) + adv_row
        elif ADV_MODE == 1:  # [BLOCK_T, C_PAD] in registers; never [N, T, J] in memory
            covers = t[:, None] <= t_end[None, :]
            A = tl.sum(tl.where(covers, coef[None, :], 0.0), axis=1)
        else:
            A = tl.load(adv_ptr + i * stride_adv + t, mask=inb, other=0.0).to(tl.float32)
        A = tl.where(m, A, 0.0)

        if SEQ:
            ratio = tl.zeros([BLOCK_T], dtype=tl.float32) + ratio_seq
        else:
            ratio = tl.exp(lp - old)
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        pg_loss1 = ratio * A
        pg_loss2 = clipped * A
        per_token = -tl.minimum(pg_loss1, pg_loss2)
        in_range = (ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high)
        # d pg / d ratio: -A unless the clipped branch wins while the clip is active.
        dpg = tl.where((pg_loss2 < pg_loss1) & (~in_range), 0.0, -A)

        dkl = tl.zeros([BLOCK_T], dtype=tl.float32)
        dkl_dratio = tl.zeros([BLOCK_T], dtype=tl.float32)  # d(beta * kl) / d ratio (BIAS_KL)
        if HAS_REF:
            ref = tl.where(m, tl.load(ref_ptr + i * stride_ref + t, mask=inb, other=0.0).to(tl.float32), 0.0)
            d = ref - lp
            e = tl.exp(d)
            kl = e - d - 1.0
            if BIAS_KL:
                acc_kl += tl.sum(tl.where(m, ratio * kl, 0.0))
            else:
                acc_kl += tl.sum(tl.where(m, kl, 0.0))
            if KL_IN_LOSS:
                if BIAS_KL:
                    per_token += beta * ratio * kl
                    if SEQ:  # the direct part; the ratio's part goes through pass 3
                        dkl = beta * ratio * (1.0 - e)
                        dkl_dratio = beta * kl
                    else:  # d(r k3)/d logp = r k3 + r (1 - e) = r (logp - ref)
                        dkl = beta * ratio * (lp - ref)
                else:
                    per_token += beta * kl
                    dkl = beta * (1.0 - e)  # d(beta * kl) / d logp
        if HAS_OLD:  # approximate KL of the current policy against the sampling one
            lr_tok = lp - old
            acc_kl_old += tl.sum(tl.where(m, tl.exp(lr_tok) - 1.0 - lr_tok, 0.0))

        acc_n += tl.sum(m.to(tl.float32))
        acc_loss += tl.sum(tl.where(m, per_token, 0.0))
        acc_lo += tl.sum((m & (ratio < 1.0 - eps_low) & (A < 0.0)).to(tl.float32))
        acc_hi += tl.sum((m & (ratio > 1.0 + eps_high) & (A > 0.0)).to(tl.float32))
        acc_abs += tl.sum(tl.abs(A))
        acc_max = tl.maximum(acc_max, tl.max(tl.abs(A)))
        if SEQ:
            acc_dratio += tl.sum(tl.where(m, dpg + dkl_dratio, 0.0))
            grad = dkl
        else:
            grad = dpg * ratio + dkl  # d ratio / d logp = ratio
        tl.store(grad_row + t, tl.where(m, grad * row_w, 0.0), mask=inb)

    if SEQ:
        # Pass 3: ratio_seq = exp(mean_t(logp_t - old_t)) couples the row:
        # d ratio_seq / d logp_t = ratio_seq / n for every active t.
        k = row_w * acc_dratio * ratio_seq / n_safe
        for start in range(0, T, BLOCK_T):
            t = start + offs
            m = tl.load(m_row + t, mask=t < T, other=0) != 0
            grad = tl.load(grad_row + t, mask=t < T, other=0.0)
            tl.store(grad_row + t, grad + tl.where(m, k, 0.0), mask=t < T)

    part = part_ptr + i * 8
    tl.store(part + 0, acc_loss * row_w)
    tl.store(part + 1, acc_n)
    tl.store(part + 2, acc_kl)
    tl.store(part + 3, acc_lo)
    tl.store(part + 4, acc_hi)
    tl.store(part + 5, acc_abs)
    tl.store(part + 6, acc_max)
    tl.store(part + 7, acc_kl_old)


@triton.jit
def _grpo_finalize_kernel(
    part_ptr, const_ptr, norm_ptr, loss_ptr, stats_ptr, extra_ptr,
    N, B, G, C, stride_kb, norm_value,
    LOSS_TYPE: tl.constexpr,  # 0 grpo, 1 bnpo, 2 dr_grpo, 3 dapo
    NORM_MODE: tl.constexpr,  # dapo normaliser: 0 this batch's M, 1 norm_value, 2 *norm_ptr
    TOKEN_ADV: tl.constexpr, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr, C_PAD: tl.constexpr,
):
    """Row partials [N, 8] -> loss, stats [kl, clip_lo, clip_hi, zero_frac, |A|, kl_old], [scale, M]."""
    loss = 0.0
    M = 0.0
    kl = 0.0
    lo = 0.0
    hi = 0.0
    ab = 0.0
    klo = 0.0
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        ok = rows < N
        loss += tl.sum(tl.load(part_ptr + rows * 8 + 0, mask=ok, other=0.0))
        M += tl.sum(tl.load(part_ptr + rows * 8 + 1, mask=ok, other=0.0))
        kl += tl.sum(tl.load(part_ptr + rows * 8 + 2, mask=ok, other=0.0))
        lo += tl.sum(tl.load(part_ptr + rows * 8 + 3, mask=ok, other=0.0))
        hi += tl.sum(tl.load(part_ptr + rows * 8 + 4, mask=ok, other=0.0))
        ab += tl.sum(tl.load(part_ptr + rows * 8 + 5, mask=ok, other=0.0))
        klo += tl.sum(tl.load(part_ptr + rows * 8 + 7, mask=ok, other=0.0))
    M_safe = tl.maximum(M, 1.0)
    if LOSS_TYPE == 0:
        scale = 1.0 / N
    elif LOSS_TYPE == 1:
        scale = 1.0 / M_safe
    elif LOSS_TYPE == 2:
        scale = 1.0 / norm_value
    else:
        if NORM_MODE == 0:
            scale = 1.0 / M_safe
        elif NORM_MODE == 1:
            scale = 1.0 / norm_value
        else:
            scale = 1.0 / tl.load(norm_ptr).to(tl.float32)

    zero = 0.0
    g = tl.arange(0, G_PAD)
    cols = tl.arange(0, C_PAD)
    for b in range(0, B):
        if TOKEN_ADV:  # no rewards: a group is "zero-spread" when all its advantages are 0
            amax = tl.max(tl.load(part_ptr + (b * G + g) * 8 + 6, mask=g < G, other=0.0))
            zero += (amax == 0.0).to(tl.float32)
        else:  # every reward column constant within the group
            flags = tl.load(const_ptr + b * stride_kb + cols, mask=cols < C, other=1.0)
            zero += tl.min(flags)

    tl.store(loss_ptr, loss * scale)
    tl.store(stats_ptr + 0, kl / M_safe)
    tl.store(stats_ptr + 1, lo / M_safe)
    tl.store(stats_ptr + 2, hi / M_safe)
    tl.store(stats_ptr + 3, zero / B)
    tl.store(stats_ptr + 4, ab / M_safe)
    tl.store(stats_ptr + 5, klo / M_safe)
    tl.store(extra_ptr + 0, scale)
    tl.store(extra_ptr + 1, M)


@triton.jit
def _scale_grad_kernel(grad_ptr, out_ptr, g_ptr, norm_ptr, numel, BLOCK: tl.constexpr):
    """The whole backward: out = grad * (g * normaliser), in logp's dtype (one launch)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(g_ptr).to(tl.float32) * tl.load(norm_ptr)
    grad = tl.load(grad_ptr + offs, mask=offs < numel, other=0.0)
    tl.store(out_ptr + offs, (grad * k).to(out_ptr.dtype.element_ty), mask=offs < numel)


# ---------------------------------------------------------------------------------------
# Launchers: check, allocate, launch
# ---------------------------------------------------------------------------------------


def _grpo_loss_fwd_triton(
    logp: torch.Tensor, mask: torch.Tensor, old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None, adv_mode: int, coef: torch.Tensor | None,
    tend: torch.Tensor | None, token_adv: torch.Tensor | None, const: torch.Tensor | None,
    G: int, beta: float, eps_low: float, eps_high: float, loss_type: str, importance: str,
    max_len: int | None, num_active_tokens: float | torch.Tensor | None, kl_bias_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss 0-d, stats [6], extra [2] = [normaliser, M], grad [N, T] fp32 without it)."""
    N, T = logp.shape
    dev = logp.device
    logp, mask = last_dim_contiguous(logp), last_dim_contiguous(mask)
    old = logp if old_logp is None else last_dim_contiguous(old_logp)
    ref = logp if ref_logp is None else last_dim_contiguous(ref_logp)
    adv = logp if token_adv is None else last_dim_contiguous(token_adv)
    coef = logp if coef is None else coef
    tend = mask if tend is None else tend
    C = 1 if coef is logp else coef.shape[1]
    grad = torch.empty(N, T, dtype=torch.float32, device=dev)
    part = torch.empty(N, 8, dtype=torch.float32, device=dev)
    # A whole 4096-token row in one tile (16 warps, 8 tokens per thread): with only N
    # programs, more bytes in flight per program is what keeps HBM busy. The prefix mode
    # holds a [BLOCK_T, C_PAD] tile, so it gets smaller tiles.
    BLOCK_T = min(4096 if adv_mode != 1 else 1024, next_pow2(T, 16))
    _grpo_loss_fwd_kernel[(N,)](
        logp, old, ref, mask, adv, coef, tend, grad, part,
        T, C,
        logp.stride(0), old.stride(0), ref.stride(0), mask.stride(0), adv.stride(0),
        coef.stride(0), tend.stride(0),
        beta, eps_low, eps_high,
        ADV_MODE=adv_mode, HAS_OLD=old_logp is not None, HAS_REF=ref_logp is not None,
        KL_IN_LOSS=beta != 0.0, SEQ=importance == "sequence", ROW_MEAN=loss_type == "grpo",
        BLOCK_T=BLOCK_T, C_PAD=next_pow2(C), BIAS_KL=bool(kl_bias_correction) and ref_logp is not None,
        num_warps=max(4, min(16, BLOCK_T // 256)),
    )
    norm_is_tensor = isinstance(num_active_tokens, torch.Tensor)
    if loss_type == "dr_grpo":
        norm_mode, norm_value = 1, float(N * (T if max_len is None else max_len))
    elif num_active_tokens is None:
        norm_mode, norm_value = 0, 1.0
    else:
        norm_mode = 2 if norm_is_tensor else 1
        norm_value = 1.0 if norm_is_tensor else float(num_active_tokens)
    loss = torch.empty((), dtype=torch.float32, device=dev)
    stats = torch.empty(6, dtype=torch.float32, device=dev)
    extra = torch.empty(2, dtype=torch.float32, device=dev)
    if const is None:
        const = part  # unused when TOKEN_ADV
    _grpo_finalize_kernel[(1,)](
        part, const, num_active_tokens if norm_is_tensor else part, loss, stats, extra,
        N, N // G, G, const.shape[1], const.stride(0), norm_value,
        LOSS_TYPE=LOSS_TYPES.index(loss_type), NORM_MODE=norm_mode,
        TOKEN_ADV=token_adv is not None, BLOCK_N=min(1024, next_pow2(N, 16)), G_PAD=next_pow2(G),
        C_PAD=next_pow2(const.shape[1]),
    )
    return loss, stats, extra, grad


class _FusedGRPOLoss(torch.autograd.Function):
    """Forward writes d loss / d logp (up to one scalar); backward only rescales it."""

    @staticmethod
    def forward(ctx, logp: torch.Tensor, launch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss, stats, extra, grad = _grpo_loss_fwd_triton(logp, **launch)
        ctx.save_for_backward(grad, extra)
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, g_loss: torch.Tensor, g_stats: torch.Tensor):
        grad, extra = ctx.saved_tensors
        # extra[0] is the aggregation normaliser (1/N, 1/M, 1/(N L) or 1/num_active_tokens).
        out = torch.empty(grad.shape, dtype=ctx.logp_dtype, device=grad.device)
        BLOCK = 2048
        _scale_grad_kernel[(triton.cdiv(grad.numel(), BLOCK),)](
            grad, out, g_loss.float().contiguous(), extra, grad.numel(), BLOCK=BLOCK)
        return out, None


# ---------------------------------------------------------------------------------------
# Public API: validate once, then dispatch to the kernel or the reference
# ---------------------------------------------------------------------------------------


def _check_tensor(name: str, x: object, shape: tuple, device: torch.device, floating: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (fp32/bf16/fp16), got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but logp is on {device}; move it to {device}")


def _check_finite(name: str, x: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Error naming the rows with NaN/inf. A host sync (one bool), worth it: a NaN reward
    would otherwise turn its whole group's advantages, and the loss, into NaN silently."""
    bad = ~torch.isfinite(x.float())
    if where is not None:
        bad &= where
    if bad.any():
        rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()
        more = " ..." if len(rows) > 20 else ""
        raise ValueError(
            f"{name} has NaN/inf in rows {rows[:20]}{more}; fix the reward function or drop "
            "those completions (whole groups) before the loss"
        )


def _validate(
    logp, mask, rewards, G, old_logp, ref_logp, beta, eps_low, eps_high, loss_type, scale,
    adv_eps, token_adv, reward_components, component_weights, prefix, importance, max_len,
    num_active_tokens, adv_std_floor=0.0, kl_bias_correction=False,
) -> None:
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a [N, T] tensor, got {getattr(logp, 'shape', type(logp))}")
    N, T = logp.shape
    dev = logp.device
    _check_tensor("logp", logp, (N, T), dev, floating=True)
    _check_tensor("mask", mask, (N, T), dev, floating=False)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp)):
        if x is not None:
            _check_tensor(name, x, (N, T), dev, floating=True)
    if not isinstance(G, int) or G < 1:
        raise ValueError(f"G (completions per prompt) must be a positive int, got {G!r}")
    if N % G != 0:
        raise ValueError(f"N = {N} rows is not divisible by G = {G}: rows must be B*G, "
                         "the G completions of each prompt contiguous")
    given = [n for n, x in (("rewards", rewards), ("reward_components", reward_components),
                            ("prefix", prefix), ("token_adv", token_adv)) if x is not None]
    if len(given) != 1:
        raise ValueError("give exactly one advantage source: rewards, reward_components, prefix "
                         f"or token_adv (got {given or 'none'})")
    if rewards is not None:
        _check_tensor("rewards", rewards, (N,), dev, floating=False)
        _check_finite("rewards", rewards)
    if reward_components is not None:
        if reward_components.dim() != 2:
            raise ValueError(f"reward_components must be [N, K], got {tuple(reward_components.shape)}")
        K = reward_components.shape[1]
        _check_tensor("reward_components", reward_components, (N, K), dev, floating=False)
        if component_weights is None:
            raise ValueError("reward_components needs component_weights [K]")
        _check_tensor("component_weights", component_weights, (K,), dev, floating=False)
        _check_finite("reward_components", reward_components)
    elif component_weights is not None:
        raise ValueError("component_weights is only used with reward_components")
    if prefix is not None:
        # Duck-typed: a reloaded module (tests) or a look-alike dataclass is fine.
        missing = [f for f in ("R_ans", "s", "scored", "rho", "t_end", "a") if not hasattr(prefix, f)]
        if missing:
            raise TypeError(f"prefix must be a PrefixRubrics, got {type(prefix).__name__} "
                            f"without {missing}")
        J = prefix.s.shape[-1]
        _check_tensor("prefix.R_ans", prefix.R_ans, (N,), dev, floating=False)
        _check_tensor("prefix.s", prefix.s, (N, J), dev, floating=False)
        _check_tensor("prefix.scored", prefix.scored, (N, J), dev, floating=False)
        _check_tensor("prefix.t_end", prefix.t_end, (N, J), dev, floating=False)
        if prefix.t_end.is_floating_point():
            raise TypeError(f"prefix.t_end must be an integer tensor, got {prefix.t_end.dtype}")
        rho_shape = (J,) if prefix.rho.dim() == 1 else (N, J)
        _check_tensor("prefix.rho", prefix.rho, rho_shape, dev, floating=False)
        if not 0.0 <= prefix.a <= 1.0:
            raise ValueError(f"prefix.a must be in [0, 1], got {prefix.a}")
        _check_finite("prefix.R_ans", prefix.R_ans)
        _check_finite("prefix.s", prefix.s, where=prefix.scored.bool())
        _check_finite("prefix.rho", prefix.rho)
    if token_adv is not None:
        _check_tensor("token_adv", token_adv, (N, T), dev, floating=True)
        _check_finite("token_adv", token_adv, where=mask != 0)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if importance not in IMPORTANCE:
        raise ValueError(f"importance must be one of {IMPORTANCE}, got {importance!r}")
    if beta < 0 or eps_low < 0 or eps_high < 0 or adv_eps < 0:
        raise ValueError(f"beta, eps_low, eps_high, adv_eps must be >= 0, got "
                         f"{beta}, {eps_low}, {eps_high}, {adv_eps}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta = {beta} > 0 needs ref_logp (the reference policy's log-probs)")
    if not adv_std_floor >= 0:  # also refuses NaN
        raise ValueError(f"adv_std_floor must be >= 0 (0 = off), got {adv_std_floor}")
    if adv_std_floor > 0 and scale == "none":
        raise ValueError(f"adv_std_floor = {adv_std_floor} needs a std to floor: scale='none' divides by none")
    if kl_bias_correction and ref_logp is None:
        raise ValueError("kl_bias_correction=True weights the KL term, which needs ref_logp")
    if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int (max completion length), got {max_len!r}")
    if isinstance(num_active_tokens, torch.Tensor):
        if num_active_tokens.numel() != 1 or num_active_tokens.device != dev:
            raise ValueError("num_active_tokens must be a number or a 1-element tensor on "
                             f"{dev}, got shape {tuple(num_active_tokens.shape)} on "
                             f"{num_active_tokens.device}")
    elif num_active_tokens is not None and not num_active_tokens > 0:
        raise ValueError(f"num_active_tokens must be > 0, got {num_active_tokens}")


def _prepare_advantages_triton(
    rewards, reward_components, component_weights, prefix, token_adv, T, G, scale, adv_eps,
    std_floor=0.0,
) -> dict:
    """Launch the z-score kernel; return the advantage part of the loss kernel's inputs."""
    if token_adv is not None:
        return dict(adv_mode=2, coef=None, tend=None, token_adv=token_adv, const=None)
    if prefix is None:
        if rewards is not None:
            coef, const = group_zscore_triton(rewards[:, None], None, None, G, scale, adv_eps, std_floor)
        else:  # weights [K] -> [N, K] with stride 0 over rows: no copy
            w = component_weights.float()[None, :].expand(reward_components.shape)
            coef, const = group_zscore_triton(reward_components, None, w, G, scale, adv_eps, std_floor)
        return dict(adv_mode=0, coef=coef, tend=None, token_adv=None, const=const)
    # V-Rubrics: column 0 is the answer reward (credits every token), columns 1.. the rubrics.
    N, J = prefix.s.shape
    dev = prefix.s.device
    values = torch.cat([prefix.R_ans.float()[:, None], prefix.s.float()], 1)  # [N, 1+J]
    valid = torch.cat([torch.ones(N, 1, dtype=torch.bool, device=dev), prefix.scored.bool()], 1)
    w = torch.cat([torch.full((N, 1), prefix.a, device=dev),
                   (1.0 - prefix.a) * prefix.rho.float().expand(N, J)], 1)
    tend = torch.cat([torch.full((N, 1), _INT32_MAX, dtype=torch.int32, device=dev),
                      prefix.t_end.clamp(-1, T).to(torch.int32)], 1)
    coef, const = group_zscore_triton(values, valid, w, G, scale, adv_eps, std_floor)
    return dict(adv_mode=1, coef=coef, tend=tend, token_adv=None, const=const)


def grpo_loss(
    logp: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor | None = None, *, G: int,
    old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
    beta: float = 0.0, eps_low: float = 0.2, eps_high: float = 0.2, loss_type: str = "grpo",
    scale: str = "group", adv_eps: float = 1e-4, token_adv: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    component_weights: torch.Tensor | None = None, prefix: PrefixRubrics | None = None,
    importance: str = "token", max_len: int | None = None,
    num_active_tokens: float | torch.Tensor | None = None, adv_std_floor: float = 0.0,
    kl_bias_correction: bool = False, backend: str = "auto",
) -> tuple[torch.Tensor, GRPOStats]:
    """GRPO loss (0-d fp32, differentiable w.r.t. logp) and detached diagnostics.

    logp, old_logp, ref_logp, mask: [N, T], N = B*G rows, G completions per prompt contiguous.
    Advantages from exactly one of rewards [N], reward_components [N, K] (+ component_weights
    [K]), prefix (PrefixRubrics), token_adv [N, T]. old_logp=None means one policy update per
    batch (old = detached logp, ratio = 1). beta=0 needs no ref_logp. scale: "group" |
    "batch" | "none"; importance: "token" | "sequence"; loss_type: "grpo" | "bnpo" |
    "dr_grpo" (divides by N * max_len, default T) | "dapo" (divides by num_active_tokens,
    default this micro-batch's count) - formulas in the module docstring. mask: nonzero =
    active. adv_std_floor: divide by max(std, floor) (0 = off; kernels/grpo_advantages.py).
    kl_bias_correction: kl_t = ratio_t * k3_t (TRL's use_bias_correction_kl). backend: "auto" (CUDA -> Triton, else the reference), "torch", or "triton" (on
    a CPU only under TRITON_INTERPRET=1). Host syncs: the NaN checks of the reward inputs.
    """
    _validate(logp, mask, rewards, G, old_logp, ref_logp, beta, eps_low, eps_high, loss_type,
              scale, adv_eps, token_adv, reward_components, component_weights, prefix,
              importance, max_len, num_active_tokens, adv_std_floor, kl_bias_correction)
    N, T = logp.shape
    loss_args = dict(old_logp=old_logp, ref_logp=ref_logp, beta=float(beta),
                     eps_low=float(eps_low), eps_high=float(eps_high), loss_type=loss_type,
                     importance=importance, max_len=max_len, num_active_tokens=num_active_tokens,
                     kl_bias_correction=bool(kl_bias_correction))
    floor = float(adv_std_floor)

    if resolve_backend(backend, logp.device) == "torch":
        if token_adv is not None:
            adv = token_adv
            active_abs = torch.where(mask != 0, token_adv.float().abs(), 0.0)
            zero = active_abs.amax(1).view(N // G, G).amax(1) == 0
        elif prefix is not None:
            adv, zero = prefix_advantages_reference(prefix, T, G, scale=scale, eps=adv_eps, std_floor=floor)
        else:
            values = rewards if rewards is not None else reward_components
            adv, zero = grpo_advantages_reference(values, G, scale=scale, eps=adv_eps,
                                                  weights=component_weights, std_floor=floor)
        loss, st = grpo_loss_reference(logp, mask, adv, **loss_args)
        return loss, GRPOStats(zero_spread_frac=zero.float().mean(), **st)

    check_launchable(_grpo_loss_fwd_kernel, logp.device, __name__)
    launch = _prepare_advantages_triton(rewards, reward_components, component_weights, prefix,
                                        token_adv, T, G, scale, float(adv_eps), floor)
    launch.update(mask=mask, G=G, **loss_args)
    loss, s = _FusedGRPOLoss.apply(logp, launch)
    return loss, GRPOStats(kl_mean=s[0], clip_low_frac=s[1], clip_high_frac=s[2],
                           zero_spread_frac=s[3], adv_abs_mean=s[4], kl_old_mean=s[5])
