"""Group-relative advantages: z-scores of rewards within each prompt's G completions.

GRPO's critic-free baseline. Rows are laid out N = B*G with the G completions of one prompt
contiguous, and every reward column c is standardised within its group b:

    z_ic = (r_ic - mean_b(r_c)) / (std_b(r_c) + eps)      scale="group" (default)
    z_ic = (r_ic - mean_b(r_c)) / (std(r_c) + eps)        scale="batch": std of the whole batch
    z_ic =  r_ic - mean_b(r_c)                            scale="none" (Dr. GRPO)

std is the *unbiased* (n - 1) standard deviation, like TRL's torch.std, and eps = 1e-4 by
default (TRL). Only "valid" entries take part (a rubric item counts only in the rollouts
the judge scored); invalid entries get z = 0. A group whose valid values are all equal
(max == min), or that has fewer than two of them (G = 1), gets z = 0 exactly and is flagged
*constant* (docs/grpo_advantages.md: why not std == 0).

The advantages are weighted sums of such columns; an ``AdvantageSource`` names them:

    the total reward [N, 1]          A_i   = z(r)_i
    reward components [N, K], w [K]  A_i   = sum_k w_k z(r_k)_i        (each component alone)
    V-Rubrics prefix attribution     A_it  = a z(R_ans)_i + (1 - a) sum_j rho_ij z(s_j)_i 1[t <= t_end_ij]

``std_floor`` (optim.adv_std_floor, 0 = off) divides by max(std, std_floor) + eps, so a
tie-breaker's small spread stays small: docs/grpo_advantages.md says why and how to choose
it, and how the kernel computes the columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from grpo_kernels._dispatch import last_dim_contiguous, next_pow2, resolve_backend

SCALES = ("group", "batch", "none")
_INT32_MAX = 2**31 - 1  # t_end of the answer column: it credits every token


@dataclass
class PrefixRubrics:
    """V-Rubrics prefix attribution inputs, for N = B*G completions and J rubric items."""

    R_ans: torch.Tensor  # [N] answer reward
    s: torch.Tensor  # [N, J] rubric scores (entries where scored is False are ignored)
    scored: torch.Tensor  # [N, J] bool: did the judge score item j for this rollout
    rho: torch.Tensor  # [J] or [N, J] rubric weights, rho_j = w_j / sum of positive w
    t_end: torch.Tensor  # [N, J] int: last completion token (0-based) that item j credits
    a: float = 0.5  # share of the answer term; 1 - a goes to the rubrics

    def to(self, device: torch.device | str) -> PrefixRubrics:
        return PrefixRubrics(self.R_ans.to(device), self.s.to(device), self.scored.to(device),
                             self.rho.to(device), self.t_end.to(device), self.a)


@dataclass
class AdvantageSource:
    """The one advantage input: the reward columns whose group z-scores make A.

        columns   [N, C]  rewards: the total [N, 1], reward components [N, K] or, for
                          V-Rubrics, [R_ans, s_1..s_J] ([N, 1 + J])
        valid     [N, C]  bool, entries that take part (rubric items the judge scored); None = all
        weights   [C]     components: A = sum_c weights_c z(columns_c); None for one column
        prefix            V-Rubrics: the items' weights and token cut-offs (columns as above)
        batch_std [C]     scale="batch" divides by this std instead of the columns' own
                          (grpo/distributed.py: the std over every rank's rows)

    Chosen once per rollout batch (grpo/step.py ``advantage_source``) and read by both the
    loss and dynamic sampling, so "a group has spread" means exactly "its advantages are
    not all zero"."""

    columns: torch.Tensor
    valid: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    prefix: PrefixRubrics | None = None
    batch_std: torch.Tensor | None = None

    @classmethod
    def of_prefix(cls, p: PrefixRubrics) -> "AdvantageSource":
        """The V-Rubrics columns [R_ans, s_1..s_J], valid where the judge scored."""
        columns = torch.cat([p.R_ans.float()[:, None], p.s.float()], 1)
        valid = torch.cat([torch.ones(len(p.R_ans), 1, dtype=torch.bool, device=columns.device), p.scored.bool()], 1)
        return cls(columns, valid, prefix=p)


@dataclass
class Advantages:
    """GRPO's A for N = B*G completions, kept factored by reward column; both loss paths read it.

        coef      [N, C] fp32  w_c * z_c: each reward column's group z-score times its weight
        t_end     [N, C] int32 prefix mode only: column c credits completion tokens t <= t_end[:, c]
        constant  [B, C] fp32  1.0 where column c of group b has no spread (its z is 0)

    ``values(T)`` is A itself -- [N] in row mode (the sum over columns), [N, T] in prefix
    mode -- which the reference loss reads and a reader can print. The loss kernel
    reads the factors and forms A_it in registers, so the V-Rubrics [N, T, J] product never
    exists in memory.
    """

    G: int
    mode: str  # "row" | "prefix" (the loss kernel's ADV_MODE)
    coef: torch.Tensor
    t_end: torch.Tensor | None = None
    constant: torch.Tensor | None = None  # always set by group_advantages

    @property
    def num_rows(self) -> int:
        return self.coef.shape[0]

    def values(self, T: int | None = None) -> torch.Tensor:
        """A: [N] (row mode) or [N, T] (prefix mode, which needs T)."""
        if self.mode == "row":
            return self.coef.sum(1)
        if T is None:
            raise ValueError("prefix advantages are per token: values(T) needs the completion length T")
        covers = torch.arange(T, device=self.coef.device)[None, :, None] <= self.t_end[:, None, :]  # [N, T, C]
        return (self.coef[:, None, :] * covers).sum(-1)

    def groups(self, start: int, stop: int) -> "Advantages":
        """The advantages of groups start..stop-1 (rows start*G .. stop*G-1): a training
        micro-batch. Advantages are computed once over the whole rollout batch (the z-scores
        are per group, the batch std of scale="batch" over every row), then sliced: a
        micro-batch never re-normalises."""
        if not 0 <= start < stop <= self.num_rows // self.G:
            raise ValueError(f"groups({start}, {stop}): need 0 <= start < stop <= {self.num_rows // self.G} groups")
        if (start, stop) == (0, self.num_rows // self.G):
            return self
        rows = slice(start * self.G, stop * self.G)
        pick = lambda x, sl: None if x is None else x[sl]  # noqa: E731
        return Advantages(self.G, self.mode, coef=pick(self.coef, rows), t_end=pick(self.t_end, rows),
                          constant=pick(self.constant, slice(start, stop)))

    def zero_spread(self) -> torch.Tensor:
        """[B] bool: groups whose advantages are all zero (every reward column constant)."""
        return (self.constant != 0).all(1)


def group_advantages(
    src: "AdvantageSource", G: int, *, T: int | None = None, scale: str = "group", adv_eps: float = 1e-4,
    adv_std_floor: float = 0.0, backend: str = "auto", checked: bool = True,
) -> Advantages:
    """GRPO's advantage step: z-scores within each prompt's G completions (module docstring)
    of the reward columns ``src`` names, times their weights; the prefix mode needs ``T``.
    ``backend`` picks who computes the z-scores: "auto" (CUDA -> the Triton kernel, else
    ``group_zscore_reference``), "torch" or "triton"; either loss path reads the result.
    Host syncs: the NaN check of the inputs (``checked=False`` skips the checks, for
    bench/grpo_loss.py, which times the kernel alone)."""
    if checked:
        check_groups(src.columns.shape[0] if isinstance(src.columns, torch.Tensor) else 0, G)
        check_source(src, T, scale, adv_eps, adv_std_floor)
    values, N, eps, floor = src.columns, src.columns.shape[0], float(adv_eps), float(adv_std_floor)
    if src.batch_std is not None:  # another's std (every rank's rows): r / (std + eps), centred below
        values, scale, floor = (values.double() / (src.batch_std + eps)).to(values.dtype), "none", 0.0
    # weights [C] -> [N, C] with stride 0 over rows: no copy
    w = None if src.weights is None else src.weights.float()[None, :].expand(values.shape)
    t_end = None
    if src.prefix is not None:  # V-Rubrics: column 0 the answer reward (credits every token), 1.. the rubrics
        p, J, device = src.prefix, values.shape[1] - 1, values.device
        w = torch.cat([torch.full((N, 1), p.a, device=device), (1.0 - p.a) * p.rho.float().expand(N, J)], 1)
        t_end = torch.cat([torch.full((N, 1), _INT32_MAX, dtype=torch.int32, device=device),
                           p.t_end.clamp(-1, T).to(torch.int32)], 1)
    if resolve_backend(backend, values.device) == "torch":
        z, constant = group_zscore_reference(values, G, scale=scale, eps=eps, valid=src.valid, std_floor=floor)
        coef, constant = (z if w is None else z * w), constant.float()
    else:
        coef, constant = group_zscore_triton(values, src.valid, w, G, scale, eps, floor)
    return Advantages(G, "row" if src.prefix is None else "prefix", coef=coef, t_end=t_end, constant=constant)


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
        z = centered / (batch_std(values.float(), ok.view(N, C), std_floor) + eps)
    else:
        z = centered
    z = torch.where(constant[:, None, :], 0.0, z)
    return z.reshape(N, C), constant


def batch_std(values: torch.Tensor, valid: torch.Tensor | None = None, std_floor: float = 0.0,
              all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """scale="batch"'s denominator: the unbiased std of each column of values [N, C] over its
    valid rows -> [C], floored at std_floor. Two passes (the mean, then the squared
    deviations) avoid the cancellation of a sum of squares. ``all_reduce`` (a sum over
    processes, in place) makes it the std over every process's rows: grpo/distributed.py
    passes its own, and this is then the global batch std of a data-parallel run."""
    ok = torch.ones_like(values, dtype=torch.bool) if valid is None else valid.bool()
    v = torch.where(ok, values, 0.0)
    n_sum = torch.stack([ok.sum(0).to(v.dtype), v.sum(0)])  # [2, C]: valid count, sum
    if all_reduce is not None:
        n_sum = all_reduce(n_sum)
    n, mean = n_sum[0], n_sum[1] / n_sum[0].clamp(min=1)
    sq = torch.where(ok, v - mean, 0.0).square().sum(0)
    if all_reduce is not None:
        sq = all_reduce(sq)
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    return std.clamp(min=std_floor) if std_floor > 0 else std


# ---------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------


def check_tensor(name: str, x: object, shape: tuple, device: torch.device, floating: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (fp32/bf16/fp16), got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but logp is on {device}; move it to {device}")


def check_finite(name: str, x: torch.Tensor, where: torch.Tensor | None = None) -> None:
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


def check_groups(N: int, G: object) -> None:
    """Rows are B*G with each prompt's G completions contiguous: the one layout every group
    statistic here (and the loss, and dynamic sampling) assumes."""
    if isinstance(G, bool) or not isinstance(G, int) or G < 1:
        raise ValueError(f"G (completions per prompt) must be a positive int, got {G!r}")
    if N % G != 0:
        raise ValueError(f"N = {N} rows is not divisible by G = {G}: rows must be B*G, "
                         "the G completions of each prompt contiguous")


def check_source(src: "AdvantageSource", T: int | None, scale: str, adv_eps: float, std_floor: float) -> None:
    """The one check of an advantage input: shapes, dtypes and device agree, the values are
    finite where they count, the scale options make sense."""
    if not isinstance(src.columns, torch.Tensor) or src.columns.dim() != 2:
        raise ValueError(f"advantage columns must be a [N, C] tensor, got {getattr(src.columns, 'shape', type(src.columns))}")
    N, C = src.columns.shape
    dev = src.columns.device
    if src.valid is not None:
        check_tensor("valid", src.valid, (N, C), dev, floating=False)
    if src.weights is not None:
        check_tensor("weights", src.weights, (C,), dev, floating=False)
    elif C != 1 and src.prefix is None:
        raise ValueError(f"{C} reward columns need weights [{C}] (A = sum_c weights_c z(columns_c))")
    if src.batch_std is not None:
        check_tensor("batch_std", src.batch_std, (C,), dev, floating=True)
        if scale != "batch":
            raise ValueError(f"batch_std is scale='batch''s divisor, but scale={scale!r}")
    p = src.prefix
    if p is not None:
        # Duck-typed: a reloaded module (tests) or a look-alike dataclass is fine.
        missing = [f for f in ("R_ans", "s", "scored", "rho", "t_end", "a") if not hasattr(p, f)]
        if missing:
            raise TypeError(f"prefix must be a PrefixRubrics, got {type(p).__name__} without {missing}")
        if T is None:
            raise ValueError("prefix advantages need T, the completion length their t_end indexes")
        J = C - 1
        check_tensor("prefix.t_end", p.t_end, (N, J), dev, floating=False)
        if p.t_end.is_floating_point():
            raise TypeError(f"prefix.t_end must be an integer tensor, got {p.t_end.dtype}")
        check_tensor("prefix.rho", p.rho, (J,) if p.rho.dim() == 1 else (N, J), dev, floating=False)
        if not 0.0 <= p.a <= 1.0:
            raise ValueError(f"prefix.a must be in [0, 1], got {p.a}")
        check_finite("prefix.rho", p.rho)
    check_finite("rewards", src.columns, where=None if src.valid is None else src.valid.bool())
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not adv_eps >= 0:
        raise ValueError(f"adv_eps must be >= 0, got {adv_eps}")
    if not std_floor >= 0:  # also refuses NaN
        raise ValueError(f"adv_std_floor must be >= 0 (0 = off), got {std_floor}")
    if std_floor > 0 and scale == "none":
        raise ValueError(f"adv_std_floor = {std_floor} needs a std to floor: scale='none' divides by none")


# ---------------------------------------------------------------------------------------
# Triton kernel and launcher
# ---------------------------------------------------------------------------------------


# The z-score kernel's SCALE codes (constexpr: each is its own compiled variant).
SCALE_NONE = tl.constexpr(0)  # centred only (Dr. GRPO)
SCALE_GROUP = tl.constexpr(1)  # divided by the group's std
SCALE_BATCH = tl.constexpr(2)  # divided by the whole batch's std, per column
_SCALE_CODE = {"none": SCALE_NONE, "group": SCALE_GROUP, "batch": SCALE_BATCH}

# How the loss kernel reads A (its ADV_MODE), set by the advantage source.
ADV_ROW = tl.constexpr(0)  # one value per row: A_i = sum_c coef_ic (rewards, reward components)
ADV_PREFIX = tl.constexpr(1)  # V-Rubrics: A_it = sum_c coef_ic 1[t <= t_end_ic]
_ADV_CODE = {"row": ADV_ROW, "prefix": ADV_PREFIX}


@triton.jit
def _load_column(val_ptr, valid_ptr, rows, in_range, c, stride_vn, stride_okn, HAS_VALID: tl.constexpr):
    """Column c of values at these rows, as fp32 with 0 where not ok; ok = in range (and valid)."""
    ok = in_range
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + rows * stride_okn + c, mask=in_range, other=0) != 0)
    return tl.load(val_ptr + rows * stride_vn + c, mask=ok, other=0.0).to(tl.float32), ok


@triton.jit
def _group_zscore_kernel(
    val_ptr, valid_ptr, w_ptr, coef_ptr, const_ptr,  # pointers
    N, B, G,  # dimensions
    stride_vn, stride_okn, stride_wn, stride_wc, stride_cn, stride_kb,  # strides
    eps, std_floor,  # scalars
    SCALE: tl.constexpr, HAS_VALID: tl.constexpr, HAS_W: tl.constexpr,  # meta-parameters
    G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """coef[:, c] = w[:, c] * z(values[:, c]); const[b, c] = 1 if group b is constant."""
    c = tl.program_id(0)
    if SCALE == SCALE_BATCH:  # batch std: two passes (mean, then squared deviations) avoid cancellation
        s = 0.0
        cnt = 0.0
        for start in range(0, N, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            v, ok = _load_column(val_ptr, valid_ptr, rows, rows < N, c, stride_vn, stride_okn, HAS_VALID)
            s += tl.sum(tl.where(ok, v, 0.0))
            cnt += tl.sum(ok.to(tl.float32))
        mean_all = s / tl.maximum(cnt, 1.0)
        sq = 0.0
        for start in range(0, N, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            v, ok = _load_column(val_ptr, valid_ptr, rows, rows < N, c, stride_vn, stride_okn, HAS_VALID)
            sq += tl.sum(tl.where(ok, (v - mean_all) * (v - mean_all), 0.0))
        std_all = tl.maximum(tl.sqrt_rn(sq / tl.maximum(cnt - 1.0, 1.0)), std_floor)  # floor 0: exact no-op

    g = tl.arange(0, G_PAD)
    for b in range(0, B):
        rows = b * G + g
        v, ok = _load_column(val_ptr, valid_ptr, rows, g < G, c, stride_vn, stride_okn, HAS_VALID)
        v = tl.where(ok, v, 0.0)  # unscored rubric entries may hold NaN
        cnt = tl.sum(ok.to(tl.float32))
        mean = tl.sum(v) / tl.maximum(cnt, 1.0)
        centered = tl.where(ok, v - mean, 0.0)
        hi = tl.max(tl.where(ok, v, float("-inf")))
        lo = tl.min(tl.where(ok, v, float("inf")))
        constant = (cnt < 2.0) | (hi == lo)
        if SCALE == SCALE_GROUP:
            std = tl.sqrt_rn(tl.sum(centered * centered) / tl.maximum(cnt - 1.0, 1.0))
            z = centered / (tl.maximum(std, std_floor) + eps)
        elif SCALE == SCALE_BATCH:
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
    # A pointer the kernel never reads (HAS_VALID / HAS_W false) still needs a tensor: values.
    _group_zscore_kernel[(C,)](
        values, valid if valid is not None else values, weights if weights is not None else values,
        coef, const,
        N, N // G, G,
        values.stride(0), 0 if valid is None else valid.stride(0),
        0 if weights is None else weights.stride(0), 0 if weights is None else weights.stride(1),
        coef.stride(0), const.stride(0),
        eps, float(std_floor),
        SCALE=_SCALE_CODE[scale].value, HAS_VALID=valid is not None,
        HAS_W=weights is not None, G_PAD=next_pow2(G), BLOCK_N=min(1024, next_pow2(N, 16)),
    )
    return coef, const


# ---------------------------------------------------------------------------------------
# Whole-advantage references: the tests' oracles (the trainer calls group_advantages)
# ---------------------------------------------------------------------------------------


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
