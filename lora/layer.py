"""LoRALinear: a low-rank adapter around a frozen linear layer (plain or 4-bit).

Implemented (LoRA, Hu et al. 2021; QLoRA, Dettmers et al. 2023, for the 4-bit base):

    y = base(x) + (dropout(x) @ A^T @ B^T) * (alpha / r)

    W : [out, in]   the frozen base weight (bf16/fp32, or NF4 inside a bnb Linear4bit)
    A : [r, in]     Kaiming-uniform init (nn.Linear's default), trainable
    B : [out, r]    zero init, trainable -> the adapted model starts *exactly* equal to the base

Only A and B are trained: 8 * (in + out) numbers per adapted layer instead of in * out.

Dtypes. The LoRA weights are stored in `lora_dtype` (fp32 by default: the optimizer's small
updates to a zero-initialised B would round away in bf16), but the LoRA matmuls run in the
*base's compute dtype* (bf16 for the 4-bit base): A and B are cast on the fly, which is
cheap because they are tiny, and gradients flow back through the cast to the fp32 masters.

Simplified on purpose (PEFT has all of these; we need none): one adapter per layer (no
adapter names), no DoRA / rsLoRA / bias training / fan_in_fan_out, no in-place merge. In
particular we never merge into 4-bit weights: W_nf4 + B A would be re-quantised and drift;
`lora.adapter_io.export_merged` dequantises and merges in bf16 instead.

`disabled` turns the adapter off so the same module computes the base model: GRPO's
reference log-probs come from the policy with LoRA off, with no second copy of the base
(see `lora.inject.disable_adapters`). When RL starts from an SFT warm-up the reference is the
warm-up's policy instead (base + its adapter): `lora.inject.freeze_reference_adapter` keeps a
frozen copy of the adapter (`ref_A`, `ref_B`, buffers outside the state dict), and a disabled
module then computes base(x) + the frozen copy's delta, by the same arithmetic as the live one.

Decoding (`frozen_adapter_casts`): a rollout calls every adapter once per generated token with
weights that do not change until it ends, so inside that context A and B are cast (and
transposed) once per module, not per call -- at the 7B's widths in bf16, 14 of a decoder layer's
85 operators per token. An NF4 base whose bitsandbytes matmul dequantises the whole weight and
then multiplies (the CPU's) is dequantised once per rollout too, the same bits
(`lora.dequant`); the price is every such projection in the compute dtype
while the rollout decodes. The alpha / r scaling is skipped when it is 1.0 (alpha = r, both
presets): multiplying by 1.0 changes no bit, forward or backward.
"""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager

import torch
import torch.nn as nn

import lora.dequant as dequant

_FROZEN_CASTS: dict | None = None  # inside frozen_adapter_casts: (id(module), dtype) -> (A^T, B^T), (ids, dtype) -> stacked A^T
_DEQUANTISED: dict | None = None  # inside frozen_adapter_casts: (id(NF4 base layer), dtype) -> its dequantised weight


@contextmanager
def frozen_adapter_casts():
    """While it is open, no-grad LoRA calls reuse one cast of each module's A and B, and an NF4
    base one dequantisation of its weight where that is how bitsandbytes multiplies anyway
    (lora.dequant: the same bits). The caller promises not to change the
    adapters or the base meanwhile: the sampler around one rollout."""
    global _FROZEN_CASTS, _DEQUANTISED
    saved, _FROZEN_CASTS, saved_dq, _DEQUANTISED = _FROZEN_CASTS, {}, _DEQUANTISED, {}
    try:
        yield
    finally:
        _FROZEN_CASTS, _DEQUANTISED = saved, saved_dq


def is_linear4bit(module: nn.Module) -> bool:
    """True for a bitsandbytes Linear4bit. bitsandbytes takes seconds to import, so we only
    look at it if someone already imported it (no module can be a Linear4bit otherwise)."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


class LoRALinear(nn.Module):
    """Wraps `base_layer` (an nn.Linear or bnb Linear4bit, which subclasses nn.Linear).

    The base is kept as the child `base_layer`, like PEFT, so its parameters stay reachable
    (and frozen); the adapter is the two parameters `lora_A` [r, in] and `lora_B` [out, r].
    """

    def __init__(
        self,
        base_layer: nn.Linear,
        r: int,
        alpha: float,
        dropout: float = 0.0,
        lora_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(
                f"LoRALinear wraps an nn.Linear or bitsandbytes Linear4bit, got "
                f"{type(base_layer).__name__}; target only linear layers"
            )
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"LoRA rank r must be a positive int, got r={r!r}")
        if not alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got alpha={alpha!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got dropout={dropout!r}")
        if lora_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"lora_dtype must be float32, bfloat16 or float16, got {lora_dtype}")

        self.base_layer = base_layer
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.r = r
        self.alpha = float(alpha)
        self.scaling = self.alpha / r  # alpha / r: rank-independent update size (LoRA §4.1)
        self.disabled = False
        self.ref_A: torch.Tensor | None = None  # the reference's frozen adapter (freeze_reference_adapter)
        self.ref_B: torch.Tensor | None = None

        device = base_layer.weight.device
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, dtype=lora_dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, dtype=lora_dtype, device=device))
        # nn.Linear's default init for A (what PEFT uses too); B = 0 makes B A = 0 exactly.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the base layer multiplies in: Linear4bit's compute_dtype (bf16 for
        QLoRA), else the base weight's dtype; LoRA computes in the same."""
        if is_linear4bit(self.base_layer):
            return self.base_layer.compute_dtype or x.dtype
        return self.base_layer.weight.dtype

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """base_layer(x); inside frozen_adapter_casts an NF4 base dequantises its weight once, not per call."""
        if _DEQUANTISED is not None and is_linear4bit(self.base_layer):
            y = dequant.dequantised_forward(self.base_layer, x, _DEQUANTISED)
            if y is not None:
                return y
        return self.base_layer(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> y: [..., out]
        y = self.base(x)
        if self.disabled:
            if self.ref_A is None:
                return y  # reference model = the base: LoRA off costs nothing extra
            dtype = self.compute_dtype(x)
            A_t, B_t = self.ref_A.to(dtype).t(), self.ref_B.to(dtype).t()  # reference = base + a frozen adapter
        else:
            dtype = self.compute_dtype(x)
            A_t, B_t = self._adapter_t(dtype)
        h = self.lora_dropout(x).to(dtype) @ A_t  # [..., r]
        delta = h @ B_t  # [..., out]
        if self.scaling != 1.0:
            delta = delta * self.scaling
        return y + delta.to(y.dtype)

    def _adapter_t(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A^T [in, r], B^T [r, out]) in ``dtype``: cast per call (gradients reach the fp32
        masters), or once per rollout inside frozen_adapter_casts."""
        if _FROZEN_CASTS is None or torch.is_grad_enabled():
            return self.lora_A.to(dtype).t(), self.lora_B.to(dtype).t()
        key = (id(self), dtype)
        if key not in _FROZEN_CASTS:
            _FROZEN_CASTS[key] = (self.lora_A.to(dtype).t(), self.lora_B.to(dtype).t())
        return _FROZEN_CASTS[key]

    def decodes_fused(self, x: torch.Tensor) -> bool:
        """Whether ``fused_forward`` may take this module: inside frozen_adapter_casts without
        grad, the adapter on, no active dropout, and x already in the compute dtype (the base's
        output then is too, so the adapter's product can be accumulated into it)."""
        return (_FROZEN_CASTS is not None and not torch.is_grad_enabled() and not self.disabled
                and not (isinstance(self.lora_dropout, nn.Dropout) and self.lora_dropout.training)
                and x.dtype == self.compute_dtype(x))

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A in fp32, [out, in]: what merging adds to the (dequantised) W."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def extra_repr(self) -> str:
        p = self.lora_dropout.p if isinstance(self.lora_dropout, nn.Dropout) else 0.0
        return (
            f"r={self.r}, alpha={self.alpha:g}, dropout={p:g}, "
            f"lora_dtype={self.lora_A.dtype}, disabled={self.disabled}"
        )


def fused_forward(modules: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """``[m(x) for m in modules]`` for one decode step, with the adapter's add folded into its
    B matmul: base(x) + h @ B^T as ``addmm`` into the base's output (one rounding of the sum
    instead of one for the product and one for the add: equal to rounding, not bit for bit).
    Falls back to the modules' own forward unless every one is a LoRALinear that
    ``decodes_fused`` (the sampler's fused decode step, grpo/rollout/decoder.py). The
    modules' A's are stacked into one matmul (``_add_adapters``): q/k/v's three, gate/up's two."""
    if not all(isinstance(m, LoRALinear) and m.decodes_fused(x) for m in modules):
        return [m(x) for m in modules]
    ys = [m.base(x) for m in modules]
    _add_adapters(modules, x, ys)
    return ys


def _add_adapters(modules: list[LoRALinear], x: torch.Tensor, ys: list[torch.Tensor]) -> None:
    """ys[i] += scaling_i * (x @ A_i^T) @ B_i^T in place, with the casts of frozen_adapter_casts.
    The A's of several modules are one matmul: x @ [A_1; A_2; ...]^T, each module's B then reads
    its r columns of that product (a strided view, no copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    h = x2 @ _stacked_a_t(modules, x.dtype)  # [rows, sum of the ranks]
    start = 0
    for m, y in zip(modules, ys):
        y.view(-1, y.shape[-1]).addmm_(h[:, start : start + m.r], m._adapter_t(x.dtype)[1], alpha=m.scaling)
        start += m.r


def _stacked_a_t(modules: list[LoRALinear], dtype: torch.dtype) -> torch.Tensor:
    """[A_1; A_2; ...]^T [in, sum of the ranks] in ``dtype``, cast and stacked once per
    frozen_adapter_casts (one module: its own cast A^T)."""
    if len(modules) == 1:
        return modules[0]._adapter_t(dtype)[0]
    key = (tuple(id(m) for m in modules), dtype)
    if key not in _FROZEN_CASTS:
        _FROZEN_CASTS[key] = torch.cat([m.lora_A for m in modules]).to(dtype).t()
    return _FROZEN_CASTS[key]
