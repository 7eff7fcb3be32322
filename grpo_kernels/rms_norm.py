"""RMSNorm as one operator: the decode step's norms in one kernel launch each, not eight.

    y = weight * round(x / sqrt(mean(x^2) + eps))       over the last dim, statistics in fp32

``round`` is the cast back to x's dtype, where Qwen2's RMSNorm module casts (it normalises in
fp32, casts to the input dtype, then multiplies by the weight in that dtype): the reference
below is that module's arithmetic. In PyTorch it is 6 operators in fp32 and 8 in bf16 (the two
casts): pow, mean, add, rsqrt, two products. ``torch.nn.functional.rms_norm`` does not help on
the CPU: this torch decomposes it (and its aten fused op) into the same operators.

The kernel: one program per row (a decode step has N rows of d = 3584 at the 7B, one tile
each), the sum of squares in fp32, the same two roundings as the reference. Only the order of
the row's sum differs (a tree in the kernel, torch's own blocking in ``mean``): equal to the
reference to a few fp32 ulps of the statistic, so in bf16 the output is the reference's or one
bf16 ulp away.

``rms_norm`` is registered as a torch custom operator (``grpo_kernels::rms_norm``), so a
dispatcher -- and ``python -m bench.decode_ops``'s operator count -- sees one operator: on CUDA the
one Triton launch; on the CPU its kernel is the reference (the CPU still runs the reference's
operators inside it, below the count). No autograd: it serves the no-grad decode step.

Simplified: weight required; the last dim must fit one tile (<= 65,536: any Qwen width).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_kernels._dispatch import check_launchable, last_dim_contiguous, next_pow2, resolve_backend

_MAX_D = 65_536  # one tile per row


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2's RMSNorm (the spec): x [..., d], weight [d] -> [..., d] in weight * x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    live = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=live, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv).to(y_ptr.dtype.element_ty).to(tl.float32)  # the reference's cast back
    w = tl.load(w_ptr + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=live)


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_launchable(_rms_norm_kernel, x.device, "grpo_kernels.rms_norm")
    x2 = last_dim_contiguous(x.reshape(-1, x.shape[-1]))
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    D = x2.shape[1]
    _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, D, x2.stride(0), y.stride(0), eps,
                                     BLOCK=next_pow2(D))
    return y.view(x.shape)


@torch.library.custom_op("grpo_kernels::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_triton(x, weight, eps)  # CUDA (and any device without its own kernel below)


@_rms_norm_op.register_kernel("cpu")
def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@_rms_norm_op.register_fake
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm of x [..., d] with weight [d] (same dtype) as one operator; "torch" = the reference
    as separate operators, "triton" = the kernel directly (on CPU tensors only under
    TRITON_INTERPRET=1), "auto" = the custom operator (Triton on CUDA, the reference on the CPU)."""
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} {weight.dtype} does not match x's last dim "
                         f"{x.shape[-1]} and dtype {x.dtype}; pass a [d] weight in x's dtype")
    if x.shape[-1] > _MAX_D:
        raise ValueError(f"rms_norm: last dim {x.shape[-1]} exceeds one tile ({_MAX_D}); use backend='torch'")
    resolved = resolve_backend(backend, x.device)
    if resolved == "torch":
        on_cpu_auto = backend == "auto" and x.device.type == "cpu"
        return _rms_norm_op(x, weight, eps) if on_cpu_auto else rms_norm_reference(x, weight, eps)
    return _rms_norm_op(x, weight, eps) if x.device.type == "cuda" else _rms_norm_triton(x, weight, eps)
