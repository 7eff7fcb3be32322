"""Selective log-softmax: log p(target) from logits, never an fp32 [N, T, V] copy.

    logp[n, t] = x[n, t, y] - logsumexp_v x[n, t, v],     x = logits / temperature

GRPO needs the log-probability of the *sampled* token only, at every completion position,
for the policy (with grad) and the reference (without). The naive PyTorch version

    x = logits.float() / temperature           # new fp32 [N, T, V]: 4V bytes per token
    logp = x.log_softmax(-1)                   # another fp32 [N, T, V]
    logp.gather(-1, y[..., None])              # keeps [N, T, 1]

allocates two fp32 copies of the logits: with Qwen's V = 151,936 that is 1.2 MB per token,
4x the bf16 logits themselves. The kernel reads the logits once, BLOCK_V at a time, with an
online log-sum-exp (running max m and running sum s rescaled by exp(m_old - m_new) when the
max grows), and writes 12 bytes per token: logp, and the log-sum-exp (as max and log-sum)
saved for backward.

Backward recomputes the softmax block by block from the saved log-sum-exp:

    d logits[n, t, v] = g[n, t] / temperature * (1[v == y] - softmax(x)[v])

written in the logits' dtype (one read and one write of the logits' size; the gradient
itself is the only [N, T, V] tensor allocated). The kernel uses one program per token: the
vocabulary loop is long (V / BLOCK_V = 38 blocks of 4096 for Qwen) so a token is enough
work, and N*T programs fill any GPU.

Numerics: accumulation in fp32 whatever the logits' dtype. Entries of -inf (masked
vocabulary) are handled: a block of all -inf contributes exactly 0 and does not turn the
running max into NaN. A row whose logits are all -inf has no distribution: log p is NaN,
as in torch.log_softmax.

From hidden states: ``token_logprobs_from_hidden(hidden, lm_head.weight, targets)`` never
holds more than [chunk_tokens, V] logits. Forward: per chunk, logits = h @ W^T (cuBLAS),
then the kernel above; backward recomputes each chunk's logits (one more matmul), turns
them *in place* into d logits with the backward kernel, then d h = d logits @ W and
d W += d logits^T @ h. With grad, the plain path keeps all [N, T, V] logits for backward
(and the gradient of that size); this one keeps [N, T, d] hidden states instead.

Simplified: no ignore_index (every position gets a log-prob; mask them in the loss); the
fused variant chunks with PyTorch matmuls rather than fusing the matmul into the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo_kernels._dispatch import check_launchable, resolve_backend

_MAX_BLOCK_V = 4096  # vocabulary tile; module-level so tests can shrink it to force tails


def token_logprobs_reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
) -> torch.Tensor:
    """logits [..., V], targets [...] int -> fp32 log-probs [...] (the spec; 2 fp32 copies)."""
    x = logits.float() / temperature
    return torch.log_softmax(x, dim=-1).gather(-1, targets[..., None].long()).squeeze(-1)


@triton.jit
def _logprob_fwd_kernel(
    logits_ptr, targets_ptr, logp_ptr, lse_ptr,  # pointers
    T, V,  # dimensions
    stride_ln, stride_lt, stride_yn, stride_yt,  # strides
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: N*T*V overflows int32 at Qwen's vocabulary
    n = row // T
    t = row % T
    x_row = logits_ptr + n * stride_ln + t * stride_lt
    offs = tl.arange(0, BLOCK_V)

    m = float("-inf")  # running max of x
    s = 0.0  # running sum of exp(x - m)
    for start in range(0, V, BLOCK_V):
        v = start + offs
        x = tl.load(x_row + v, mask=v < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(x))
        # While everything seen is -inf, shift by 0 instead: exp(-inf - (-inf)) would be NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift))
        m = m_new
    # log-sum-exp = shift + log(s), kept as two numbers: at |x| ~ 1e4 the sum would round
    # to fp32's 1e-3 spacing there, while (x - shift) - log(s) stays accurate (as log_softmax).
    shift = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log(s)

    y = tl.load(targets_ptr + n * stride_yn + t * stride_yt).to(tl.int64)
    x_y = tl.load(x_row + y).to(tl.float32) / temperature
    tl.store(logp_ptr + row, (x_y - shift) - log_s)
    tl.store(lse_ptr + 2 * row, shift)
    tl.store(lse_ptr + 2 * row + 1, log_s)


@triton.jit
def _logprob_bwd_kernel(
    logits_ptr, targets_ptr, lse_ptr, dlogp_ptr, dlogits_ptr,  # pointers
    T, V,  # dimensions
    stride_ln, stride_lt, stride_yn, stride_yt, stride_dn, stride_dt,  # strides
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = row // T
    t = row % T
    x_row = logits_ptr + n * stride_ln + t * stride_lt
    d_row = dlogits_ptr + n * stride_dn + t * stride_dt
    offs = tl.arange(0, BLOCK_V)
    y = tl.load(targets_ptr + n * stride_yn + t * stride_yt).to(tl.int64)
    shift = tl.load(lse_ptr + 2 * row)
    log_s = tl.load(lse_ptr + 2 * row + 1)
    g = tl.load(dlogp_ptr + row) / temperature  # the 1/temperature of d x / d logits
    for start in range(0, V, BLOCK_V):
        v = start + offs
        x = tl.load(x_row + v, mask=v < V, other=float("-inf")).to(tl.float32) / temperature
        p = tl.exp((x - shift) - log_s)
        grad = tl.where(v == y, g - g * p, -g * p)
        tl.store(d_row + v, grad.to(dlogits_ptr.dtype.element_ty), mask=v < V)


def _as_3d(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T, V] or [M, V] (-> [1, M, V]); the vocabulary dim must be contiguous."""
    if logits.dim() == 2:
        logits, targets = logits[None], targets[None]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits, targets


def _block_v(V: int) -> int:
    return min(_MAX_BLOCK_V, max(16, 1 << (V - 1).bit_length()))


def _logprob_fwd_triton(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    N, T, V = logits.shape
    logp = torch.empty(N, T, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, T, 2, dtype=torch.float32, device=logits.device)  # (shift, log s)
    BLOCK_V = _block_v(V)
    _logprob_fwd_kernel[(N * T,)](
        logits, targets, logp, lse,
        T, V,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        temperature,
        BLOCK_V=BLOCK_V, num_warps=8 if BLOCK_V >= 2048 else 4,
    )
    return logp, lse


def _logprob_bwd_triton(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, dlogp: torch.Tensor,
    temperature: float, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d logits; ``out=logits`` overwrites the logits in place (each program reads a tile
    of its own row before writing the same tile, so this is safe)."""
    N, T, V = logits.shape
    dlogits = torch.empty(N, T, V, dtype=logits.dtype, device=logits.device) if out is None else out
    dlogp = dlogp.float().contiguous()
    BLOCK_V = _block_v(V)
    _logprob_bwd_kernel[(N * T,)](
        logits, targets, lse, dlogp, dlogits,
        T, V,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        dlogits.stride(0), dlogits.stride(1),
        temperature,
        BLOCK_V=BLOCK_V, num_warps=8 if BLOCK_V >= 2048 else 4,
    )
    return dlogits


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        logits3, targets3 = _as_3d(logits, targets)
        logp, lse = _logprob_fwd_triton(logits3, targets3, temperature)
        ctx.save_for_backward(logits3, targets3, lse)  # lse: 8 B/token, all that is added
        ctx.temperature = temperature
        ctx.logits_shape = logits.shape
        return logp.view(targets.shape)

    @staticmethod
    def backward(ctx, dlogp: torch.Tensor):
        logits3, targets3, lse = ctx.saved_tensors
        dlogits = _logprob_bwd_triton(logits3, targets3, lse, dlogp.reshape(lse.shape[:2]),
                                      ctx.temperature)
        return dlogits.view(ctx.logits_shape), None, None


class _HiddenTokenLogprobs(torch.autograd.Function):
    """lm_head + selective log-softmax, ``chunk`` tokens at a time: the logits exist for
    one chunk only ([chunk, V], e.g. 1024 x 151,936 bf16 = 311 MB), in forward and again,
    recomputed, in backward. Costs one extra lm_head matmul per chunk in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        M = hidden.shape[0]
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(M, 2, dtype=torch.float32, device=hidden.device)
        for s in range(0, M, chunk):
            logits = hidden[s:s + chunk] @ weight.T  # [c, V]: the model's own lm_head math
            lp, ls = _logprob_fwd_triton(logits[None], targets[None, s:s + chunk], temperature)
            logp[s:s + chunk], lse[s:s + chunk] = lp[0], ls[0]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp

    @staticmethod
    def backward(ctx, dlogp):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.empty_like(hidden) if need_h else None
        # The weight gradient sums over every chunk: accumulate in fp32, cast once.
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            logits = h @ weight.T
            dlogits = _logprob_bwd_triton(logits[None], targets[None, s:s + ctx.chunk],
                                          lse[None, s:s + ctx.chunk], dlogp[None, s:s + ctx.chunk],
                                          ctx.temperature, out=logits[None])[0]
            if need_h:
                d_hidden[s:s + ctx.chunk] = dlogits @ weight
            if need_w:
                d_weight += (dlogits.T @ h).float()
        return d_hidden, None if d_weight is None else d_weight.to(weight.dtype), None, None, None


def _check_targets(targets: object, shape: tuple, V: int, device: torch.device) -> None:
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of token ids, got "
                        f"{getattr(targets, 'dtype', type(targets).__name__)}")
    if tuple(targets.shape) != tuple(shape):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {tuple(shape)} "
                         "(logits without the vocabulary dim)")
    if targets.device != device:
        raise ValueError(f"targets on {targets.device}, logits on {device}")
    # A host sync (two scalars): an out-of-range id would read outside the row in the kernel.
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"targets must be token ids in [0, {V}), got values in "
                         f"[{int(targets.min())}, {int(targets.max())}]")


def _validate(logits: object, targets: object, temperature: float) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        raise ValueError("logits must be a [N, T, V] or [M, V] tensor, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point (bf16/fp16/fp32), got {logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_targets(targets, logits.shape[:-1], logits.shape[-1], logits.device)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """log softmax(logits / temperature)[targets]: logits [N, T, V] or [M, V] (bf16/fp16/fp32),
    targets [N, T] / [M] int -> fp32 [N, T] / [M], differentiable w.r.t. logits.

    backend: "auto" (CUDA -> Triton, else the reference), "torch", or "triton" (on CPU
    only under TRITON_INTERPRET=1).
    """
    _validate(logits, targets, temperature)
    temperature = float(temperature)
    if resolve_backend(backend, logits.device) == "torch":
        return token_logprobs_reference(logits, targets, temperature)
    check_launchable(_logprob_fwd_kernel, logits.device, __name__)
    return _TokenLogprobs.apply(logits, targets, temperature)


def token_logprobs_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
    temperature: float = 1.0, chunk_tokens: int = 1024, backend: str = "auto",
) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature)[targets] without the full logits.

    hidden [N, T, d] or [M, d] (the final hidden states at the positions that predict the
    targets), weight [V, d] (lm_head, no bias), targets [N, T] / [M] int -> fp32 log-probs,
    differentiable w.r.t. hidden and weight. The Triton path holds one [chunk_tokens, V]
    block of logits at a time; "torch" is the reference on the full logits.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError("hidden must be a [N, T, d] or [M, d] tensor, got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, d] with d = {hidden.shape[-1]} (hidden's last dim), "
                         f"got {tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) and hidden ({hidden.dtype}, "
                         f"{hidden.device}) must share dtype and device")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be floating point (bf16/fp16/fp32), got {hidden.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_targets(targets, hidden.shape[:-1], weight.shape[0], hidden.device)
    temperature = float(temperature)
    if resolve_backend(backend, hidden.device) == "torch":
        return token_logprobs_reference(hidden @ weight.T, targets, temperature)
    check_launchable(_logprob_fwd_kernel, hidden.device, __name__)
    d = hidden.shape[-1]
    logp = _HiddenTokenLogprobs.apply(hidden.reshape(-1, d), weight, targets.reshape(-1),
                                      temperature, chunk_tokens)
    return logp.view(targets.shape)
