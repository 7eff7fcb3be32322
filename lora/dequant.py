"""One dequantisation of an NF4 weight per rollout, where that is how bitsandbytes multiplies anyway.

bitsandbytes' no-grad NF4 matmul is the op ``bitsandbytes::gemm_4bit``. Where a device has no
kernel of its own for it (this CPU backend), its default implementation runs: dequantise the
whole weight to the input's dtype, then ``F.linear``. A decode loop calls every projection once
per token with the same weight, so that dequantisation can be done once per loop and kept
(``lora.frozen_adapter_casts`` opens the cache around the sampler's loop): the same two
operations on the same inputs, so the same bits (tests/test_lora_quant.py checks every path
below against Linear4bit's own forward, and a whole rollout). Where bitsandbytes computes another
way (a device's own kernel, CUDA's among them; the repacked CPU layout; a weight stored
[in, out]; grad on), ``dequantised_forward`` returns None and the layer runs as usual. The price
is every such projection in the compute dtype while a rollout decodes (the memory plan counts it).
"""

from __future__ import annotations

import torch
import torch.nn as nn

_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "hpu": "HPU"}
_GEMM_IS_DEFAULT: dict[str, bool] = {}


def gemm_4bit_dequantises_whole(device: torch.device) -> bool:
    """Whether bitsandbytes' no-grad NF4 matmul on ``device`` is its default implementation
    (dequantise the weight, then F.linear): no kernel registered for the device's own key."""
    if device.type not in _GEMM_IS_DEFAULT:
        key, has = _DISPATCH_KEYS.get(device.type), getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
        _GEMM_IS_DEFAULT[device.type] = bool(key and has) and not has("bitsandbytes::gemm_4bit", key)
    return _GEMM_IS_DEFAULT[device.type]


def dequantised_forward(layer: nn.Module, x: torch.Tensor, cache: dict) -> torch.Tensor | None:
    """``layer(x)`` for a Linear4bit without grad, bit for bit, its dequantised weight kept in
    ``cache`` (keyed by layer and dtype) for the next call; None where bitsandbytes' forward
    would take another path (then call the layer)."""
    state = getattr(layer.weight, "quant_state", None)
    dtype = layer.compute_dtype
    # attributes read with getattr: a bitsandbytes without them declines (the layer runs as usual)
    if (torch.is_grad_enabled() or state is None or dtype is None or not getattr(layer, "compute_type_is_set", False)
            or getattr(state, "packing_format_for_cpu", False)
            or (x.device.type == "cpu" and getattr(layer, "support_avx512bf16_for_cpu", True) and not layer.training)
            or len(state.shape) != 2 or (x.shape[-1] == state.shape[0] and x.shape[-1] != state.shape[1])
            or (state.nested and state.state2.blocksize != 256)
            or (layer.bias is not None and layer.bias.dtype != dtype)
            or not gemm_4bit_dequantises_whole(x.device)):
        return None
    key = (id(layer), dtype)
    weight = cache.get(key)
    if weight is None:
        absmax = state.absmax
        if state.nested:  # double quantisation: the block scales are 8-bit codes themselves
            absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
                state.absmax, state.state2.absmax, state.state2.code, 256, torch.float32) + state.offset
        weight = cache[key] = torch.ops.bitsandbytes.dequantize_4bit.default(
            layer.weight.view(-1, 1), absmax, state.blocksize, state.quant_type, state.shape, dtype)
    return torch.nn.functional.linear(x.to(dtype), weight, layer.bias).to(x.dtype)
