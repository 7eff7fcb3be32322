"""The GRPO loss: clipped ratio, KL to the reference (k1 / k2 / k3), aggregation, in one pass.

What is implemented (TRL's GRPO loss conventions; TRL's own defaults differ in places:
its default aggregation is now "dapo", ours "grpo"):

    A          = group advantages (grpo_kernels/grpo_advantages.py: z-scores within each group)
    ratio_t    = exp(logp_t - old_t)                   importance="token"
    ratio_t    = exp(mean_t'(logp_t' - old_t'))        importance="sequence" (GSPO), every token
    pg_t       = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
    pg_t       = w * pg_t      rollout correction: w = pi_old / pi_sampler, per token or sequence,
                               a constant capped at C (truncate) or 0 above it (mask)
    kl_t       = k3: exp(d_t) - d_t - 1 (default), k1: -d_t, k2: d_t^2 / 2      d_t = ref_t - logp_t
    kl_t       = ratio_t * k_t                         kl_bias_correction=True
    loss       = aggregate(pg_t + beta * kl_t) over active tokens (mask != 0)

Aggregation ("loss_type"), with n_i active tokens in row i and M = sum_i n_i:
    grpo     mean_i( sum_t loss_it / n_i )      per-sequence mean, then mean over the N rows
    bnpo     sum_it loss_it / M                 token mean over this micro-batch
    dr_grpo  sum_it loss_it / (N * max_len)     max_len = max completion length (default T)
    dapo     sum_it loss_it / num_active_tokens tokens of the whole accumulated batch
                                                (default M, i.e. this micro-batch)

Only logp gets a gradient: old_logp, ref_logp, sampler_logp and the advantages are
constants, as in GRPO. The PyTorch reference below is the spec; the Triton kernels after it
compute the same numbers fused (CUDA, or TRITON_INTERPRET=1). Why (the bytes each version
moves), the KL conventions and estimators, mu > 1, the rollout correction's trade-offs and
the gradient at the clip: docs/grpo_loss.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from grpo_kernels._dispatch import check_launchable, last_dim_contiguous, next_pow2, resolve_backend

# The advantage half lives in grpo_advantages; its public names are re-exported from here.
from grpo_kernels.grpo_advantages import (  # noqa: F401
    _ADV_CODE,
    ADV_PREFIX,
    ADV_ROW,
    SCALES,
    Advantages,
    AdvantageSource,
    PrefixRubrics,
    check_groups,
    check_source,
    check_tensor,
    group_advantages,
    group_zscore_reference,
    group_zscore_triton,
    grpo_advantages_reference,
    prefix_advantages_reference,
)

# LossOptions' check, above it: the default LossOptions() of the signatures below runs it at import.


def check_options(o: LossOptions) -> None:
    """The loss's options against the lists of allowed values (``LossOptions`` runs it when built)."""
    if o.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {o.loss_type!r}")
    if o.importance not in IMPORTANCE:
        raise ValueError(f"importance must be one of {IMPORTANCE}, got {o.importance!r}")
    if o.beta < 0 or o.eps_low < 0 or o.eps_high < 0:
        raise ValueError(f"beta, eps_low, eps_high must be >= 0, got {o.beta}, {o.eps_low}, {o.eps_high}")
    if o.max_len is not None and (not isinstance(o.max_len, int) or o.max_len < 1):
        raise ValueError(f"max_len must be a positive int (max completion length), got {o.max_len!r}")
    if o.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {o.kl_estimator!r}")
    if o.correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {o.correction!r}")
    if o.correction_mode not in CORRECTION_MODES:
        raise ValueError(f"correction_mode must be one of {CORRECTION_MODES}, got {o.correction_mode!r}")
    cap = o.correction_cap
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 1):
        raise ValueError(f"correction_cap must be a finite number > 1 (the largest ratio kept), got {cap!r}")


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the one list: grpo/config_checks.py and grpo/batches.py read it
IMPORTANCE = ("token", "sequence")
CORRECTIONS = ("off", "token", "sequence")  # rollout correction level (sampler vs trainer)
CORRECTION_MODES = ("truncate", "mask")
KL_ESTIMATORS = ("k1", "k2", "k3")  # Schulman's estimators of KL(pi || pi_ref); grpo/config_checks.py reads it


@dataclass(frozen=True)
class LossOptions:
    """The loss's knobs (formulas: the module docstring); the defaults are GRPO's.
    grpo/step.py ``loss_options`` fills one from the config; checked when built."""

    beta: float = 0.0  # weight of the KL term (kl_estimator: k1, k2 or k3) against ref_logp (0: no reference needed)
    eps_low: float = 0.2  # the ratio's clip range is [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.2
    loss_type: str = "grpo"  # aggregation: grpo | bnpo | dr_grpo | dapo
    importance: str = "token"  # importance ratio per token, or per sequence (GSPO)
    max_len: int | None = None  # dr_grpo divides by N * max_len (None: T)
    kl_bias_correction: bool = False  # kl_t = ratio_t * k_t (TRL's use_bias_correction_kl)
    kl_estimator: str = "k3"  # k1 | k2 | k3: the per-token KL estimate against ref_logp
    correction: str = "off"  # rollout correction level: off | token | sequence
    correction_mode: str = "mask"  # above the cap: truncate (TIS) or mask (MIS)
    correction_cap: float = 3.0  # C > 1, the largest rollout ratio kept

    def __post_init__(self) -> None:
        check_options(self)  # the values against the lists below


def kl_estimate(d: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from d = ref_logp - logp (k1, k2 or k3)."""
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d * d / 2
    return torch.exp(d) - d - 1


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, options: LossOptions,
              num_active_tokens: float | torch.Tensor | None = None) -> torch.Tensor:
    """per_token [N, T] summed over active tokens, normalised as options.loss_type says (above)."""
    N, T = per_token.shape
    mf = (mask != 0).float()
    total = (per_token * mf).sum()
    if options.loss_type == "grpo":
        return ((per_token * mf).sum(-1) / mf.sum(-1).clamp(min=1)).mean()
    if options.loss_type == "bnpo" or (options.loss_type == "dapo" and num_active_tokens is None):
        return total / mf.sum().clamp(min=1)
    if options.loss_type == "dr_grpo":
        return total / (N * (T if options.max_len is None else options.max_len))
    if isinstance(num_active_tokens, torch.Tensor):  # [] or [1], maybe an int count
        return total / num_active_tokens.reshape(()).float()
    return total / num_active_tokens


def grpo_loss_reference(
    logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, *,
    old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None, num_active_tokens: float | torch.Tensor | None = None,
    options: LossOptions = LossOptions(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss from given advantages adv [N] or [N, T]; stats without zero_spread_frac."""
    o = options
    beta, eps_low, eps_high, importance = o.beta, o.eps_low, o.eps_high, o.importance
    correction, correction_mode = o.correction, o.correction_mode
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

    # Rollout correction: w = pi_train / pi_sampler of the sampled tokens, a constant weight
    # on the policy term. pi_train is the trainer at sampling time: old (detached current
    # when old_logp is None), so every update of a batch gets the same weight.
    is_lr = torch.zeros_like(lp)
    if sampler_logp is not None:
        is_lr = torch.where(m, old.detach() - sampler_logp.float(), 0.0)
    unit_lr = is_lr.sum(-1) if correction == "sequence" else is_lr  # [N] or [N, T]
    units = (mf.sum(-1) > 0) if correction == "sequence" else m
    log_cap = math.log(o.correction_cap)
    over = (unit_lr > log_cap) & units
    if correction != "off":
        if correction_mode == "truncate":  # min(ratio, C), in logs: no inf for a long sequence
            w = torch.exp(torch.clamp(unit_lr, max=log_cap))
        else:
            w = torch.where(unit_lr > log_cap, 0.0, torch.exp(torch.clamp(unit_lr, max=log_cap)))
        per_token = per_token * (w[:, None] if correction == "sequence" else w)

    kl = torch.zeros_like(lp)
    if ref_logp is not None:
        d = torch.where(m, ref_logp.float(), 0.0) - lp
        kl = kl_estimate(d, o.kl_estimator)
        if o.kl_bias_correction:  # TRL's use_bias_correction_kl: the ratio carries gradient too
            kl = ratio * kl
        if beta != 0.0:
            per_token = per_token + beta * kl

    loss = aggregate(per_token, mask, o, num_active_tokens)
    with torch.no_grad():
        return loss, _reference_stats(m, A, ratio, token_log_ratio, kl, is_lr, unit_lr, units, over, o)


def grpo_loss(
    logp: torch.Tensor, mask: torch.Tensor, advantages: Advantages, *,
    old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
    sampler_logp: torch.Tensor | None = None, num_active_tokens: float | torch.Tensor | None = None,
    options: LossOptions = LossOptions(), backend: str = "auto",
) -> tuple[torch.Tensor, GRPOStats]:
    """GRPO loss (0-d fp32, differentiable w.r.t. logp) and detached diagnostics.

    logp, old_logp, ref_logp, mask: [N, T], N = B*G rows, G completions per prompt contiguous.
    advantages: from ``group_advantages`` (computed once per rollout batch; its G is the
    loss's). old_logp=None means one policy update per batch (old = detached logp, ratio =
    1). sampler_logp [N, T]: the rollout engine's log-probs of the same tokens (the mismatch
    stats and the rollout correction; None = the trainer sampled). num_active_tokens: dapo's
    divisor (default this call's active tokens). mask: nonzero = active. options: the
    knobs (``LossOptions``), formulas in the module docstring. backend: "auto" (CUDA ->
    Triton, else the reference), "torch", or "triton" (on a CPU only under
    TRITON_INTERPRET=1). No host sync.
    """
    _validate(logp, mask, advantages, old_logp, ref_logp, sampler_logp, num_active_tokens, options)
    T = logp.shape[1]
    backend = resolve_backend(backend, logp.device)
    loss_args = dict(old_logp=old_logp, ref_logp=ref_logp, num_active_tokens=num_active_tokens,
                     sampler_logp=sampler_logp, options=options)

    if backend == "torch":
        loss, st = grpo_loss_reference(logp, mask, advantages.values(T), **loss_args)
        return loss, GRPOStats(zero_spread_frac=advantages.zero_spread().float().mean(), **st)

    check_launchable(_grpo_loss_fwd_kernel, logp.device, __name__)
    loss, s = _FusedGRPOLoss.apply(logp, dict(mask=mask, adv=advantages, **loss_args))
    return loss, GRPOStats(kl_mean=s[STAT_KL.value], clip_low_frac=s[STAT_CLIP_LOW.value],
                           clip_high_frac=s[STAT_CLIP_HIGH.value], zero_spread_frac=s[STAT_ZERO_SPREAD.value],
                           adv_abs_mean=s[STAT_ADV_ABS.value], kl_old_mean=s[STAT_KL_OLD.value],
                           is_kl=s[STAT_IS_KL.value], is_ratio_mean=s[STAT_IS_RATIO_MEAN.value],
                           is_ratio_max=s[STAT_IS_RATIO_MAX.value], is_over_frac=s[STAT_IS_OVER.value])


@dataclass
class GRPOStats:
    """Diagnostics from the same pass, detached 0-d fp32 tensors (no host sync)."""

    kl_mean: torch.Tensor  # mean KL term vs ref over active tokens (k, or ratio * k; 0 without ref_logp)
    clip_low_frac: torch.Tensor  # active tokens with ratio < 1 - eps_low and A < 0
    clip_high_frac: torch.Tensor  # active tokens with ratio > 1 + eps_high and A > 0
    zero_spread_frac: torch.Tensor  # groups with constant rewards (all their advantages 0)
    adv_abs_mean: torch.Tensor  # mean |A_t| over active tokens
    kl_old_mean: torch.Tensor  # mean k3 of the current policy vs old_logp: (ratio - 1) - log ratio
    # Rollout mismatch (0, 1, 1, 0 without sampler_logp: the trainer is taken as the sampler).
    is_kl: torch.Tensor  # mean k3 (w - 1) - log w of w = pi_train / pi_sampler per token: KL(sampler || trainer)
    is_ratio_mean: torch.Tensor  # mean rollout ratio at the correction's level (token when off)
    is_ratio_max: torch.Tensor  # max rollout ratio at that level
    is_over_frac: torch.Tensor  # tokens / sequences whose ratio exceeds the cap (truncated or masked; off: would be)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---------------------------------------------------------------------------------------
# The reference's diagnostics
# ---------------------------------------------------------------------------------------


def _reference_stats(m: torch.Tensor, A: torch.Tensor, ratio: torch.Tensor, token_log_ratio: torch.Tensor,
                     kl: torch.Tensor, is_lr: torch.Tensor, unit_lr: torch.Tensor, units: torch.Tensor,
                     over: torch.Tensor, o: LossOptions) -> dict[str, torch.Tensor]:
    """``grpo_loss_reference``'s diagnostics (``GRPOStats`` but zero_spread_frac) from its
    intermediates: means over the active tokens, the rollout ratio's at the correction's level."""
    mf = m.float()
    M = mf.sum().clamp(min=1)
    stats = {
        "kl_mean": (kl * mf).sum() / M,
        "clip_low_frac": ((ratio < 1 - o.eps_low) & (A < 0) & m).sum() / M,
        "clip_high_frac": ((ratio > 1 + o.eps_high) & (A > 0) & m).sum() / M,
        "adv_abs_mean": (A.abs() * mf).sum() / M,
        "kl_old_mean": ((torch.exp(token_log_ratio) - 1 - token_log_ratio) * mf).sum() / M,
    }
    n_units = units.sum().clamp(min=1)
    unit_ratio = torch.exp(unit_lr)
    stats.update(
        is_kl=((torch.exp(is_lr) - 1 - is_lr) * mf).sum() / M,
        is_ratio_mean=torch.where(units.any(), torch.where(units, unit_ratio, 0.0).sum() / n_units,
                                  torch.ones((), device=m.device)),  # branchless: torch.compile traces it whole
        is_ratio_max=torch.where(units.any(), torch.where(units, unit_ratio, 0.0).max(),
                                 torch.ones((), device=m.device)),
        is_over_frac=over.sum() / n_units)
    return stats


# ---------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------


def _validate(logp, mask, adv, old_logp, ref_logp, sampler_logp, num_active_tokens, options: LossOptions) -> None:
    """The tensors against each other and the options (the advantages were checked when made)."""
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError(f"logp must be a [N, T] tensor, got {getattr(logp, 'shape', type(logp))}")
    if not isinstance(options, LossOptions):
        raise TypeError(f"options must be a LossOptions, got {type(options).__name__}")
    N, T = logp.shape
    dev = logp.device
    check_tensor("logp", logp, (N, T), dev, floating=True)
    check_tensor("mask", mask, (N, T), dev, floating=False)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampler_logp", sampler_logp)):
        if x is not None:
            check_tensor(name, x, (N, T), dev, floating=True)
    # Duck-typed: a test's reloaded (interpreted) module has its own class.
    missing = [f for f in ("G", "mode", "coef", "t_end", "constant", "values") if not hasattr(adv, f)]
    if missing:
        raise TypeError(f"advantages must come from group_advantages, got {type(adv).__name__}")
    check_groups(N, adv.G)
    if adv.num_rows != N:
        raise ValueError(f"advantages are for {adv.num_rows} rows, the loss has {N}")
    if options.beta > 0 and ref_logp is None:
        raise ValueError(f"beta = {options.beta} > 0 needs ref_logp (the reference policy's log-probs)")
    if options.kl_bias_correction and ref_logp is None:
        raise ValueError("kl_bias_correction=True weights the KL term, which needs ref_logp")
    if isinstance(num_active_tokens, torch.Tensor):
        if num_active_tokens.numel() != 1 or num_active_tokens.device != dev:
            raise ValueError("num_active_tokens must be a number or a 1-element tensor on "
                             f"{dev}, got shape {tuple(num_active_tokens.shape)} on "
                             f"{num_active_tokens.device}")
    elif num_active_tokens is not None and not num_active_tokens > 0:
        raise ValueError(f"num_active_tokens must be > 0, got {num_active_tokens}")


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------


# The finalisation kernel's LOSS_TYPE codes, one per name of LOSS_TYPES.
LOSS_GRPO = tl.constexpr(0)
LOSS_BNPO = tl.constexpr(1)
LOSS_DR_GRPO = tl.constexpr(2)
LOSS_DAPO = tl.constexpr(3)
_LOSS_CODE = {"grpo": LOSS_GRPO, "bnpo": LOSS_BNPO, "dr_grpo": LOSS_DR_GRPO, "dapo": LOSS_DAPO}
# The forward kernel's CORR codes, one per name of CORRECTIONS.
CORR_OFF = tl.constexpr(0)
CORR_TOKEN = tl.constexpr(1)
CORR_SEQ = tl.constexpr(2)
_CORR_CODE = {"off": CORR_OFF, "token": CORR_TOKEN, "sequence": CORR_SEQ}
# The forward kernel's KL_EST codes, one per name of KL_ESTIMATORS.
KL_K1 = tl.constexpr(1)
KL_K2 = tl.constexpr(2)
KL_K3 = tl.constexpr(3)
_KL_CODE = {"k1": KL_K1, "k2": KL_K2, "k3": KL_K3}
# dapo's divisor (NORM_MODE): this micro-batch's active tokens, a number, or a 1-element tensor.
NORM_BATCH_TOKENS = tl.constexpr(0)
NORM_VALUE = tl.constexpr(1)  # also dr_grpo's N * max_len
NORM_TENSOR = tl.constexpr(2)

# Row partials: the forward kernel leaves N_SLOTS fp32 sums per row at part[i, SLOT_*].
SLOT_LOSS = tl.constexpr(0)  # sum_t (pg_t + beta kl_t), times 1 / n_i for grpo
SLOT_TOKENS = tl.constexpr(1)  # n_i, the active tokens
SLOT_KL = tl.constexpr(2)  # sum_t kl_t
SLOT_CLIP_LOW = tl.constexpr(3)  # tokens clipped below (ratio < 1 - eps_low, A < 0)
SLOT_CLIP_HIGH = tl.constexpr(4)  # tokens clipped above (ratio > 1 + eps_high, A > 0)
SLOT_ADV_ABS = tl.constexpr(5)  # sum_t |A_t|
SLOT_KL_OLD = tl.constexpr(6)  # sum_t (r_t - 1) - log r_t against old_logp
SLOT_IS_KL = tl.constexpr(7)  # sum_t (w_t - 1) - log w_t, w_t = pi_train / pi_sampler per token
SLOT_IS_SUM = tl.constexpr(8)  # sum of the rollout ratios at the correction's level (tokens or this row)
SLOT_IS_MAX = tl.constexpr(9)  # their max (0 for a fully masked row)
SLOT_IS_OVER = tl.constexpr(10)  # how many of them exceed the cap (truncated or masked)
SLOT_IS_UNITS = tl.constexpr(11)  # how many there are: n_i (token level) or 1 if n_i > 0 (sequence)
N_SLOTS = tl.constexpr(12)
# The finalisation's outputs: stats[STAT_*] (GRPOStats' order) and extra[EXTRA_*].
STAT_KL = tl.constexpr(0)
STAT_CLIP_LOW = tl.constexpr(1)
STAT_CLIP_HIGH = tl.constexpr(2)
STAT_ZERO_SPREAD = tl.constexpr(3)
STAT_ADV_ABS = tl.constexpr(4)
STAT_KL_OLD = tl.constexpr(5)
STAT_IS_KL = tl.constexpr(6)
STAT_IS_RATIO_MEAN = tl.constexpr(7)
STAT_IS_RATIO_MAX = tl.constexpr(8)
STAT_IS_OVER = tl.constexpr(9)
N_STATS = tl.constexpr(10)
EXTRA_SCALE = tl.constexpr(0)  # the aggregation's normaliser, which backward multiplies in
EXTRA_TOKENS = tl.constexpr(1)  # M, this micro-batch's active tokens
N_EXTRA = tl.constexpr(2)


@triton.jit
def _grpo_loss_fwd_kernel(
    # pointers: [N, T] inputs, the advantage source, outputs grad [N, T] and part [N, N_SLOTS]
    logp_ptr, old_ptr, ref_ptr, mask_ptr, coef_ptr, tend_ptr, grad_ptr, part_ptr, samp_ptr,
    # dimensions: T tokens per row, C reward columns of coef / tend
    T, C,
    # strides: rows only, every last dimension is contiguous (the launcher makes it so)
    stride_lp, stride_old, stride_ref, stride_m, stride_coef, stride_tend, stride_samp,
    # scalars
    beta, eps_low, eps_high, log_cap,
    # meta-parameters: each combination is its own compiled kernel
    ADV_MODE: tl.constexpr,  # ADV_ROW | ADV_PREFIX: whether tend_ptr is read
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, KL_IN_LOSS: tl.constexpr,
    SEQ: tl.constexpr,  # sequence-level importance ratio (GSPO)
    ROW_MEAN: tl.constexpr,  # grpo aggregation: each row's tokens weigh 1 / n_i
    BLOCK_T: tl.constexpr, C_PAD: tl.constexpr,
    BIAS_KL: tl.constexpr,  # kl_t = ratio_t * k3_t (TRL's use_bias_correction_kl)
    HAS_SAMP: tl.constexpr,  # sampler log-probs given: rollout ratios and the mismatch stats
    CORR: tl.constexpr,  # rollout correction: CORR_OFF | CORR_TOKEN | CORR_SEQ
    CORR_MASK: tl.constexpr,  # mask (weight 0) above the cap instead of truncating to it
    KL_EST: tl.constexpr,  # KL_K1 | KL_K2 | KL_K3: the per-token KL estimator
):
    """One program per completion row i. Writes grad[i, :] and the row's N_SLOTS partials."""
    i = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_T)
    lp_row = logp_ptr + i * stride_lp
    old_row = old_ptr + i * stride_old
    m_row = mask_ptr + i * stride_m
    samp_row = samp_ptr + i * stride_samp
    grad_row = grad_ptr + i * T
    SEQ_IS: tl.constexpr = HAS_SAMP and CORR == CORR_SEQ

    # Pass 1: active-token count n (and the GSPO sequence log-ratio, and the sequence-level
    # rollout log-ratio). Reads 1 B/token, more for the sums.
    n = 0.0
    seq_lr = 0.0
    seq_is_lr = 0.0  # sum_t (old_t - sampler_t): log of the row's pi_train / pi_sampler
    if ROW_MEAN or SEQ or SEQ_IS:
        for start in range(0, T, BLOCK_T):
            t = start + offs
            m = tl.load(m_row + t, mask=t < T, other=0) != 0
            n += tl.sum(m.to(tl.float32))
            if SEQ and HAS_OLD:
                lp = tl.load(lp_row + t, mask=t < T, other=0.0).to(tl.float32)
                old = tl.load(old_row + t, mask=t < T, other=0.0).to(tl.float32)
                seq_lr += tl.sum(tl.where(m, lp - old, 0.0))
            if SEQ_IS:
                src = old_row if HAS_OLD else lp_row
                old = tl.load(src + t, mask=t < T, other=0.0).to(tl.float32)
                smp = tl.load(samp_row + t, mask=t < T, other=0.0).to(tl.float32)
                seq_is_lr += tl.sum(tl.where(m, old - smp, 0.0))
    n_safe = tl.maximum(n, 1.0)
    # The row's rollout weight (sequence level): min(ratio, C), or ratio masked to 0 above C,
    # taken in logs so that a long row's exp(sum) cannot overflow into inf * 0.
    w_seq = 1.0
    if SEQ_IS:
        if CORR_MASK:
            w_seq = tl.where(seq_is_lr > log_cap, 0.0, tl.exp(tl.minimum(seq_is_lr, log_cap)))
        else:
            w_seq = tl.exp(tl.minimum(seq_is_lr, log_cap))
    row_w = 1.0
    if ROW_MEAN:
        row_w = 1.0 / n_safe
    ratio_seq = tl.exp(seq_lr / n_safe)

    # The row's advantage: a scalar, or per-column coefficients with token cut-offs.
    cols = tl.arange(0, C_PAD)
    if ADV_MODE == ADV_ROW:
        adv_row = tl.sum(tl.load(coef_ptr + i * stride_coef + cols, mask=cols < C, other=0.0))
    if ADV_MODE == ADV_PREFIX:
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
    acc_dratio = 0.0  # sum_t d (pg_t + beta kl_t) / d ratio_seq (sequence importance only)
    acc_kl_old = 0.0  # sum_t k3(current vs old) = (r_t - 1) - log r_t, token ratios
    acc_is_kl = 0.0  # sum_t k3 of the token rollout ratios
    acc_is_sum = 0.0  # token level: sum_t of the rollout ratios (sequence level: set after the loop)
    acc_is_max = 0.0
    acc_is_over = 0.0
    for start in range(0, T, BLOCK_T):
        t = start + offs
        inb = t < T
        m = tl.load(m_row + t, mask=inb, other=0) != 0
        lp = tl.where(m, tl.load(lp_row + t, mask=inb, other=0.0).to(tl.float32), 0.0)
        if HAS_OLD:
            old = tl.where(m, tl.load(old_row + t, mask=inb, other=0.0).to(tl.float32), 0.0)
        else:
            old = lp  # one iteration per batch: old = detached current, ratio = 1
        if ADV_MODE == ADV_ROW:
            A = tl.zeros([BLOCK_T], dtype=tl.float32) + adv_row
        else:  # ADV_PREFIX: [BLOCK_T, C_PAD] in registers; never [N, T, J] in memory
            covers = t[:, None] <= t_end[None, :]
            A = tl.sum(tl.where(covers, coef[None, :], 0.0), axis=1)
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

        if HAS_SAMP:  # rollout ratio of each token: pi_train (= old) / pi_sampler
            smp = tl.where(m, tl.load(samp_row + t, mask=inb, other=0.0).to(tl.float32), 0.0)
            is_lr = old - smp
            is_r = tl.exp(is_lr)
            acc_is_kl += tl.sum(tl.where(m, is_r - 1.0 - is_lr, 0.0))
            if not SEQ_IS:
                acc_is_sum += tl.sum(tl.where(m, is_r, 0.0))
                acc_is_max = tl.maximum(acc_is_max, tl.max(tl.where(m, is_r, 0.0)))
                acc_is_over += tl.sum((m & (is_lr > log_cap)).to(tl.float32))
            if CORR == CORR_TOKEN:  # a constant weight on the policy term, like the row's below
                if CORR_MASK:
                    w_tok = tl.where(is_lr > log_cap, 0.0, tl.exp(tl.minimum(is_lr, log_cap)))
                else:
                    w_tok = tl.exp(tl.minimum(is_lr, log_cap))
                per_token = per_token * w_tok
                dpg = dpg * w_tok
        if SEQ_IS:
            per_token = per_token * w_seq
            dpg = dpg * w_seq

        dkl = tl.zeros([BLOCK_T], dtype=tl.float32)
        dkl_dratio = tl.zeros([BLOCK_T], dtype=tl.float32)  # d(beta * kl) / d ratio (BIAS_KL)
        if HAS_REF:
            ref = tl.where(m, tl.load(ref_ptr + i * stride_ref + t, mask=inb, other=0.0).to(tl.float32), 0.0)
            d = ref - lp
            if KL_EST == KL_K3:
                e = tl.exp(d)
                kl = e - d - 1.0
                dk = 1.0 - e  # d kl / d logp
            elif KL_EST == KL_K2:
                kl = 0.5 * d * d
                dk = -d
            else:  # KL_K1
                kl = -d
                dk = tl.zeros([BLOCK_T], dtype=tl.float32) + 1.0
            if BIAS_KL:
                acc_kl += tl.sum(tl.where(m, ratio * kl, 0.0))
            else:
                acc_kl += tl.sum(tl.where(m, kl, 0.0))
            if KL_IN_LOSS:
                if BIAS_KL:
                    per_token += beta * ratio * kl
                    if SEQ:  # the direct part; the ratio's part goes through pass 3
                        dkl = beta * ratio * dk
                        dkl_dratio = beta * kl
                    elif KL_EST == KL_K3:  # d(r k3)/d logp = r k3 + r (1 - e) = r (logp - ref)
                        dkl = beta * ratio * (lp - ref)
                    else:  # d(r k)/d logp = r (k + dk)
                        dkl = beta * ratio * (kl + dk)
                else:
                    per_token += beta * kl
                    dkl = beta * dk  # d(beta * kl) / d logp
        if HAS_OLD:  # approximate KL of the current policy against the sampling one
            lr_tok = lp - old
            acc_kl_old += tl.sum(tl.where(m, tl.exp(lr_tok) - 1.0 - lr_tok, 0.0))

        acc_n += tl.sum(m.to(tl.float32))
        acc_loss += tl.sum(tl.where(m, per_token, 0.0))
        acc_lo += tl.sum((m & (ratio < 1.0 - eps_low) & (A < 0.0)).to(tl.float32))
        acc_hi += tl.sum((m & (ratio > 1.0 + eps_high) & (A > 0.0)).to(tl.float32))
        acc_abs += tl.sum(tl.abs(A))
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

    acc_units = acc_n
    if SEQ_IS:
        acc_units = (n > 0.0).to(tl.float32)
        acc_is_sum = tl.exp(seq_is_lr) * acc_units
        acc_is_max = acc_is_sum
        acc_is_over = ((seq_is_lr > log_cap) & (n > 0.0)).to(tl.float32)
    part = part_ptr + i * N_SLOTS
    tl.store(part + SLOT_IS_KL, acc_is_kl)
    tl.store(part + SLOT_IS_SUM, acc_is_sum)
    tl.store(part + SLOT_IS_MAX, acc_is_max)
    tl.store(part + SLOT_IS_OVER, acc_is_over)
    tl.store(part + SLOT_IS_UNITS, acc_units)
    tl.store(part + SLOT_LOSS, acc_loss * row_w)
    tl.store(part + SLOT_TOKENS, acc_n)
    tl.store(part + SLOT_KL, acc_kl)
    tl.store(part + SLOT_CLIP_LOW, acc_lo)
    tl.store(part + SLOT_CLIP_HIGH, acc_hi)
    tl.store(part + SLOT_ADV_ABS, acc_abs)
    tl.store(part + SLOT_KL_OLD, acc_kl_old)


@triton.jit
def _grpo_finalize_kernel(
    # pointers: row partials, per-group constant flags, the dapo normaliser tensor; outputs
    part_ptr, const_ptr, norm_ptr, loss_ptr, stats_ptr, extra_ptr,
    # dimensions
    N, B, C,
    # strides
    stride_kb,
    # scalars
    norm_value,
    # meta-parameters
    LOSS_TYPE: tl.constexpr,  # LOSS_GRPO | LOSS_BNPO | LOSS_DR_GRPO | LOSS_DAPO
    NORM_MODE: tl.constexpr,  # dapo's divisor: NORM_BATCH_TOKENS | NORM_VALUE | NORM_TENSOR
    BLOCK_N: tl.constexpr, C_PAD: tl.constexpr,
    HAS_SAMP: tl.constexpr,  # the rows hold rollout ratios (else the mismatch stats are 1 / 0)
):
    """Row partials [N, N_SLOTS] -> loss, stats [N_STATS] (STAT_*), extra [scale, M]."""
    loss = 0.0
    M = 0.0
    kl = 0.0
    lo = 0.0
    hi = 0.0
    ab = 0.0
    klo = 0.0
    is_kl = 0.0
    is_sum = 0.0
    is_max = 0.0
    is_over = 0.0
    is_units = 0.0
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        ok = rows < N
        loss += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_LOSS, mask=ok, other=0.0))
        M += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_TOKENS, mask=ok, other=0.0))
        kl += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_KL, mask=ok, other=0.0))
        lo += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_CLIP_LOW, mask=ok, other=0.0))
        hi += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_CLIP_HIGH, mask=ok, other=0.0))
        ab += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_ADV_ABS, mask=ok, other=0.0))
        klo += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_KL_OLD, mask=ok, other=0.0))
        is_kl += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_IS_KL, mask=ok, other=0.0))
        is_sum += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_IS_SUM, mask=ok, other=0.0))
        is_max = tl.maximum(is_max, tl.max(tl.load(part_ptr + rows * N_SLOTS + SLOT_IS_MAX, mask=ok, other=0.0)))
        is_over += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_IS_OVER, mask=ok, other=0.0))
        is_units += tl.sum(tl.load(part_ptr + rows * N_SLOTS + SLOT_IS_UNITS, mask=ok, other=0.0))
    M_safe = tl.maximum(M, 1.0)
    if LOSS_TYPE == LOSS_GRPO:  # the row partials already hold sum_t / n_i
        scale = 1.0 / N
    elif LOSS_TYPE == LOSS_BNPO:
        scale = 1.0 / M_safe
    elif LOSS_TYPE == LOSS_DR_GRPO:
        scale = 1.0 / norm_value
    else:
        if NORM_MODE == NORM_BATCH_TOKENS:
            scale = 1.0 / M_safe
        elif NORM_MODE == NORM_VALUE:
            scale = 1.0 / norm_value
        else:
            scale = 1.0 / tl.load(norm_ptr).to(tl.float32)

    zero = 0.0
    cols = tl.arange(0, C_PAD)
    for b in range(0, B):
        flags = tl.load(const_ptr + b * stride_kb + cols, mask=cols < C, other=1.0)  # every column constant
        zero += tl.min(flags)

    tl.store(loss_ptr, loss * scale)
    tl.store(stats_ptr + STAT_KL, kl / M_safe)
    tl.store(stats_ptr + STAT_CLIP_LOW, lo / M_safe)
    tl.store(stats_ptr + STAT_CLIP_HIGH, hi / M_safe)
    tl.store(stats_ptr + STAT_ZERO_SPREAD, zero / B)
    tl.store(stats_ptr + STAT_ADV_ABS, ab / M_safe)
    tl.store(stats_ptr + STAT_KL_OLD, klo / M_safe)
    tl.store(stats_ptr + STAT_IS_KL, is_kl / M_safe)
    if HAS_SAMP:
        units_safe = tl.maximum(is_units, 1.0)
        tl.store(stats_ptr + STAT_IS_RATIO_MEAN, tl.where(is_units > 0.0, is_sum / units_safe, 1.0))
        tl.store(stats_ptr + STAT_IS_RATIO_MAX, tl.where(is_units > 0.0, is_max, 1.0))
        tl.store(stats_ptr + STAT_IS_OVER, is_over / units_safe)
    else:  # no sampler log-probs: the trainer is the sampler
        tl.store(stats_ptr + STAT_IS_RATIO_MEAN, 1.0)
        tl.store(stats_ptr + STAT_IS_RATIO_MAX, 1.0)
        tl.store(stats_ptr + STAT_IS_OVER, 0.0)
    tl.store(extra_ptr + EXTRA_SCALE, scale)
    tl.store(extra_ptr + EXTRA_TOKENS, M)


@triton.jit
def _scale_grad_kernel(
    grad_ptr, out_ptr, g_ptr, extra_ptr,  # pointers: fp32 grad, output in logp's dtype, d out / d loss, extra
    numel,  # dimensions
    BLOCK: tl.constexpr,  # meta-parameters
):
    """The whole backward: out = grad * (g * normaliser), in logp's dtype (one launch)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(g_ptr).to(tl.float32) * tl.load(extra_ptr + EXTRA_SCALE)
    grad = tl.load(grad_ptr + offs, mask=offs < numel, other=0.0)
    tl.store(out_ptr + offs, (grad * k).to(out_ptr.dtype.element_ty), mask=offs < numel)


# ---------------------------------------------------------------------------------------
# Launchers: check, allocate, launch
# ---------------------------------------------------------------------------------------


def _grpo_loss_fwd_triton(
    logp: torch.Tensor, mask: torch.Tensor, adv: Advantages, old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None, num_active_tokens: float | torch.Tensor | None,
    sampler_logp: torch.Tensor | None, options: LossOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss 0-d, stats [N_STATS], extra [N_EXTRA], grad [N, T] fp32 without the normaliser)."""
    o, loss_type = options, options.loss_type
    N, T = logp.shape
    G = adv.G
    dev = logp.device
    logp, mask = last_dim_contiguous(logp), last_dim_contiguous(mask)
    # A pointer the kernel never reads (its HAS_* flag or ADV_MODE says so) still needs a
    # tensor: logp stands in. Which pointers are live is decided by the flags, never by
    # comparing tensors.
    prefix_mode = adv.mode == "prefix"
    old = last_dim_contiguous(old_logp) if old_logp is not None else logp
    ref = last_dim_contiguous(ref_logp) if ref_logp is not None else logp
    samp = last_dim_contiguous(sampler_logp) if sampler_logp is not None else logp
    t_end = adv.t_end if prefix_mode else mask
    C = adv.coef.shape[1]
    grad = torch.empty(N, T, dtype=torch.float32, device=dev)
    part = torch.empty(N, N_SLOTS.value, dtype=torch.float32, device=dev)
    # A whole 4096-token row in one tile (16 warps, 8 tokens per thread): with only N
    # programs, more bytes in flight per program is what keeps HBM busy. The prefix mode
    # holds a [BLOCK_T, C_PAD] tile, so it gets smaller tiles.
    BLOCK_T = min(4096 if not prefix_mode else 1024, next_pow2(T, 16))
    _grpo_loss_fwd_kernel[(N,)](
        logp, old, ref, mask, adv.coef, t_end, grad, part, samp,
        T, C,
        logp.stride(0), old.stride(0), ref.stride(0), mask.stride(0),
        adv.coef.stride(0), t_end.stride(0), samp.stride(0),
        o.beta, o.eps_low, o.eps_high, math.log(o.correction_cap),
        ADV_MODE=_ADV_CODE[adv.mode].value, HAS_OLD=old_logp is not None, HAS_REF=ref_logp is not None,
        KL_IN_LOSS=o.beta != 0.0, SEQ=o.importance == "sequence", ROW_MEAN=loss_type == "grpo",
        BLOCK_T=BLOCK_T, C_PAD=next_pow2(C), BIAS_KL=bool(o.kl_bias_correction) and ref_logp is not None,
        HAS_SAMP=sampler_logp is not None, CORR=_CORR_CODE[o.correction].value,
        CORR_MASK=o.correction_mode == "mask", KL_EST=_KL_CODE[o.kl_estimator].value,
        num_warps=max(4, min(16, BLOCK_T // 256)),
    )
    norm_is_tensor = isinstance(num_active_tokens, torch.Tensor)
    if loss_type == "dr_grpo":
        norm_mode, norm_value = NORM_VALUE, float(N * (T if o.max_len is None else o.max_len))
    elif num_active_tokens is None:
        norm_mode, norm_value = NORM_BATCH_TOKENS, 1.0
    else:
        norm_mode = NORM_TENSOR if norm_is_tensor else NORM_VALUE
        norm_value = 1.0 if norm_is_tensor else float(num_active_tokens)
    loss = torch.empty((), dtype=torch.float32, device=dev)
    stats = torch.empty(N_STATS.value, dtype=torch.float32, device=dev)
    extra = torch.empty(N_EXTRA.value, dtype=torch.float32, device=dev)
    const = adv.constant
    _grpo_finalize_kernel[(1,)](
        part, const, num_active_tokens if norm_is_tensor else part, loss, stats, extra,
        N, N // G, const.shape[1],
        const.stride(0),
        norm_value,
        LOSS_TYPE=_LOSS_CODE[loss_type].value, NORM_MODE=norm_mode.value,
        BLOCK_N=min(1024, next_pow2(N, 16)),
        C_PAD=next_pow2(const.shape[1]), HAS_SAMP=sampler_logp is not None,
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
        # extra[EXTRA_SCALE] is the aggregation normaliser (1/N, 1/M, 1/(N L) or 1/num_active_tokens).
        out = torch.empty(grad.shape, dtype=ctx.logp_dtype, device=grad.device)
        BLOCK = 2048
        _scale_grad_kernel[(triton.cdiv(grad.numel(), BLOCK),)](
            grad, out, g_loss.float().contiguous(), extra, grad.numel(), BLOCK=BLOCK)
        return out, None
