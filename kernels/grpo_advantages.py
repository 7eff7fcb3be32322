"""Group-relative advantages: z-scores of rewards within each prompt's G completions.

GRPO's critic-free baseline. Rows are laid out N = B*G with the G completions of one prompt
contiguous, and every reward column c is standardised within its group b:

    z_ic = (r_ic - mean_b(r_c)) / (std_b(r_c) + eps)      scale="group" (default)
    z_ic = (r_ic - mean_b(r_c)) / (std(r_c) + eps)        scale="batch": std of the whole batch
    z_ic =  r_ic - mean_b(r_c)                            scale="none" (Dr. GRPO)

std is the *unbiased* (n - 1) standard deviation, like TRL's torch.std, and eps = 1e-4 by
default (TRL). Only "valid" entries take part (a rubric item counts only in the rollouts
the judge scored); invalid entries get z = 0. A group whose valid values are all equal, or
that has fewer than two of them (G = 1: std undefined), gets z = 0 exactly and is flagged
*constant*; we test max == min rather than std == 0 because the float mean of identical
values is not always the value itself, which would leave (x - mean) / eps noise.

The advantage sources of kernels.grpo_loss are weighted sums of such columns:

    rewards [N]                     A_i   = z(r)_i
    reward_components [N, K], w [K] A_i   = sum_k w_k z(r_k)_i        (each component alone)
    V-Rubrics prefix attribution    A_it  = a z(R_ans)_i + (1 - a) sum_j rho_ij z(s_j)_i 1[t <= t_end_ij]

Tie-breakers that stay small: the std floor. Per-group std normalisation makes every
group's advantages unit-sized, however small its spread. When the G completions of a
prompt tie on correctness and format and differ only in a tie-breaker (brevity, weight .2),
dividing by that group's tiny std turns "be a little shorter" into an advantage as large as
"be right" in a group that splits on correctness (the per-question weighting Dr. GRPO
criticises; issue 13 suspects it of shrinking phase B's completions). ``std_floor`` divides by

    max(std, std_floor) + eps               (scale="group" or "batch"; 0 = off, the default)

so a group whose rewards spread less than the floor keeps its advantages in reward units
(times 1 / floor) instead of being stretched to unit size, while a group whose std is above
the floor is normalised exactly as before. It sits between GRPO (std always) and Dr. GRPO
(scale="none", std never). Choosing it: a term of weight w that sets one completion of G
apart by d has group std w d / sqrt(G) (unbiased), the smallest split that term can make;
with G = 8, correctness (w = 4, d = 1) gives 1.41 and a brevity step (w = .2, d = .5) .035,
so a floor of 1 leaves every correctness split as it was and scales a lone brevity
difference down about 28-fold. The floor is in the units of the column it applies to (the
weighted total, or one raw component in components mode).

The kernel below computes w * z for every column, one program per column looping over the
B groups: [N] floats, microseconds. The per-token prefix sum is done inside the loss kernel
from these [N, 1+J] coefficients, so [N, T, J] never exists in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._dispatch import last_dim_contiguous, next_pow2

SCALES = ("group", "batch", "none")


@dataclass
class PrefixRubrics:
    """V-Rubrics prefix attribution inputs, for N = B*G completions and J rubric items."""

    R_ans: torch.Tensor  # [N] answer reward
    s: torch.Tensor  # [N, J] rubric scores (entries where scored is False are ignored)
    scored: torch.Tensor  # [N, J] bool: did the judge score item j for this rollout
    rho: torch.Tensor  # [J] or [N, J] rubric weights, rho_j = w_j / sum of positive w
    t_end: torch.Tensor  # [N, J] int: last completion token (0-based) that item j credits
    a: float = 0.5  # share of the answer term; 1 - a goes to the rubrics


# ---------------------------------------------------------------------------------------
# Reference: the spec. Plain PyTorch, any device.
# ---------------------------------------------------------------------------------------


def group_zscore_reference(
    values: torch.Tensor, G: int, *, scale: str = "group", eps: float = 1e-4,
    valid: torch.Tensor | None = None, std_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise group z-scores. values [N, C] -> (z [N, C] fp32, constant [B, C] bool).

    std_floor > 0 divides by max(std, std_floor) + eps (module docstring)."""
    N, C = values.shape
    B = N // G
    ok = torch.ones(N, C, dtype=torch.bool, device=values.device) if valid is None else valid.bool()
    v = torch.where(ok, values.float(), 0.0).view(B, G, C)
    ok = ok.view(B, G, C)
    cnt = ok.sum(1, keepdim=True)  # [B, 1, C]
    mean = v.sum(1, keepdim=True) / cnt.clamp(min=1)
    centered = torch.where(ok, v - mean, 0.0)
    hi = torch.where(ok, v, -torch.inf).amax(1)
    lo = torch.where(ok, v, torch.inf).amin(1)
    constant = (cnt.squeeze(1) < 2) | (hi == lo)  # [B, C]
    if scale == "group":
        std = (centered.square().sum(1, keepdim=True) / (cnt - 1).clamp(min=1)).sqrt()
        if std_floor > 0:
            std = std.clamp(min=std_floor)
        z = centered / (std + eps)
    elif scale == "batch":  # TRL: std of the raw rewards over the whole batch, per column
        n_all = ok.sum((0, 1))
        mean_all = v.sum((0, 1)) / n_all.clamp(min=1)
        var_all = torch.where(ok, v - mean_all, 0.0).square().sum((0, 1)) / (n_all - 1).clamp(min=1)
        std_all = var_all.sqrt()
        if std_floor > 0:
            std_all = std_all.clamp(min=std_floor)
        z = centered / (std_all + eps)
    else:
        z = centered
    z = torch.where(constant[:, None, :], 0.0, z)
    return z.reshape(N, C), constant


def grpo_advantages_reference(
    rewards: torch.Tensor, G: int, *, scale: str = "group", eps: float = 1e-4,
    weights: torch.Tensor | None = None, std_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N] or components [N, K] with weights [K] -> (adv [N], zero_spread [B] bool)."""
    values = rewards[:, None] if rewards.dim() == 1 else rewards
    z, constant = group_zscore_reference(values, G, scale=scale, eps=eps, std_floor=std_floor)
    w = torch.ones(values.shape[1], device=z.device) if weights is None else weights.float()
    return (z * w).sum(1), constant.all(1)


def prefix_advantages_reference(
    prefix: PrefixRubrics, T: int, G: int, *, scale: str = "group", eps: float = 1e-4,
    std_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-Rubrics prefix advantages -> (adv [N, T], zero_spread [B] bool).

    Materialises [N, T, J] for clarity; the kernel never does.
    """
    N, J = prefix.s.shape
    z_ans, const_ans = group_zscore_reference(prefix.R_ans[:, None], G, scale=scale, eps=eps, std_floor=std_floor)
    z_s, const_s = group_zscore_reference(prefix.s, G, scale=scale, eps=eps, valid=prefix.scored,
                                          std_floor=std_floor)
    rho = prefix.rho.float().expand(N, J)
    t = torch.arange(T, device=z_s.device)
    covers = t[None, :, None] <= prefix.t_end[:, None, :]  # [N, T, J]
    rubric = (covers * (rho * z_s)[:, None, :]).sum(-1)  # [N, T]
    adv = prefix.a * z_ans + (1.0 - prefix.a) * rubric
    return adv, const_ans[:, 0] & const_s.all(1)


# ---------------------------------------------------------------------------------------
# Triton kernel and launcher
# ---------------------------------------------------------------------------------------


@triton.jit
def _group_zscore_kernel(
    val_ptr, valid_ptr, w_ptr, coef_ptr, const_ptr,  # pointers
    N, B, G,  # dimensions
    stride_vn, stride_okn, stride_wn, stride_wc, stride_cn, stride_kb,  # strides
    eps, std_floor,
    SCALE: tl.constexpr, HAS_VALID: tl.constexpr, HAS_W: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """coef[:, c] = w[:, c] * z(values[:, c]); const[b, c] = 1 if group b is constant."""
    c = tl.program_id(0)
    if SCALE == 2:  # batch std: two passes (mean, then squared deviations) avoid cancellation
        s = 0.0
        cnt = 0.0
        for start in range(0, N, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            ok = rows < N
            if HAS_VALID:
                ok = ok & (tl.load(valid_ptr + rows * stride_okn + c, mask=rows < N, other=0) != 0)
            v = tl.load(val_ptr + rows * stride_vn + c, mask=ok, other=0.0).to(tl.float32)
            s += tl.sum(tl.where(ok, v, 0.0))
            cnt += tl.sum(ok.to(tl.float32))
        mean_all = s / tl.maximum(cnt, 1.0)
        sq = 0.0
        for start in range(0, N, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            ok = rows < N
            if HAS_VALID:
                ok = ok & (tl.load(valid_ptr + rows * stride_okn + c, mask=rows < N, other=0) != 0)
            v = tl.load(val_ptr + rows * stride_vn + c, mask=ok, other=0.0).to(tl.float32)
            sq += tl.sum(tl.where(ok, (v - mean_all) * (v - mean_all), 0.0))
        std_all = tl.maximum(tl.sqrt_rn(sq / tl.maximum(cnt - 1.0, 1.0)), std_floor)  # floor 0: exact no-op

    g = tl.arange(0, G_PAD)
    for b in range(0, B):
        rows = b * G + g
        ok = g < G
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + rows * stride_okn + c, mask=g < G, other=0) != 0)
        v = tl.load(val_ptr + rows * stride_vn + c, mask=ok, other=0.0).to(tl.float32)
        v = tl.where(ok, v, 0.0)  # unscored rubric entries may hold NaN
        cnt = tl.sum(ok.to(tl.float32))
        mean = tl.sum(v) / tl.maximum(cnt, 1.0)
        centered = tl.where(ok, v - mean, 0.0)
        hi = tl.max(tl.where(ok, v, float("-inf")))
        lo = tl.min(tl.where(ok, v, float("inf")))
        constant = (cnt < 2.0) | (hi == lo)
        if SCALE == 1:
            std = tl.sqrt_rn(tl.sum(centered * centered) / tl.maximum(cnt - 1.0, 1.0))
            z = centered / (tl.maximum(std, std_floor) + eps)
        elif SCALE == 2:
            z = centered / (std_all + eps)
        else:
            z = centered
        z = tl.where(constant, 0.0, z)
        if HAS_W:
            z *= tl.load(w_ptr + rows * stride_wn + c * stride_wc, mask=g < G, other=0.0)
        tl.store(coef_ptr + rows * stride_cn + c, z, mask=g < G)
        tl.store(const_ptr + b * stride_kb + c, constant.to(tl.float32))


def group_zscore_triton(
    values: torch.Tensor, valid: torch.Tensor | None, weights: torch.Tensor | None, G: int,
    scale: str, eps: float, std_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """values [N, C], valid [N, C] | None, weights [N, C] | None (any strides) ->
    (coef = w * z [N, C] fp32, const [B, C] fp32: 1.0 where column c of group b is constant)."""
    N, C = values.shape
    values = values.float().contiguous()
    valid = None if valid is None else last_dim_contiguous(valid).contiguous()
    coef = torch.empty(N, C, dtype=torch.float32, device=values.device)
    const = torch.empty(N // G, C, dtype=torch.float32, device=values.device)
    _group_zscore_kernel[(C,)](
        values, values if valid is None else valid, values if weights is None else weights,
        coef, const,
        N, N // G, G,
        values.stride(0), 0 if valid is None else valid.stride(0),
        0 if weights is None else weights.stride(0), 0 if weights is None else weights.stride(1),
        coef.stride(0), const.stride(0),
        eps, float(std_floor),
        SCALE={"none": 0, "group": 1, "batch": 2}[scale], HAS_VALID=valid is not None,
        HAS_W=weights is not None, G_PAD=next_pow2(G), BLOCK_N=min(1024, next_pow2(N, 16)),
    )
    return coef, const
