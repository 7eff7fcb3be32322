"""A static KV cache and a plain-PyTorch decode step for Qwen2.5-VL's language model.

The sampler's decode loop runs one token per row per step through the text decoder. Doing
that through transformers' ``forward`` costs, per step, a dynamic-cache ``torch.cat`` of
every layer's K and V (O(T^2) copying over a completion), a rebuilt 4-D attention mask,
M-RoPE bookkeeping and a few hundred Python calls of wrappers -- on a small model more
than the matmuls themselves. This file is the gpt-fast alternative:

- ``StaticKVCache``: per layer one preallocated [N, H_kv, P + max_new_tokens, D] buffer
  (P prompt tokens); step s writes column P + s for every row (prompts are left-padded, so that is the same
  column for all rows) and attention reads columns [0, P + s]. Filled from the prefill's
  cache with the group copy done in place (prompt b -> rows b*G .. b*G+G-1).
- ``decode_step``: the decoder layer written out -- RMSNorm, q/k/v projections, rotary,
  attention over the cache, o_proj, residual, RMSNorm, SwiGLU MLP, residual -- calling
  the model's own modules (so LoRA and 4-bit linears swapped in by lora/ run unchanged).
  Per token it dispatches what the math needs and little else (python -m bench.decode_ops counts
  it): q and k rotated in one pass, the key mask turned into SDPA's float form once per step
  rather than inside every layer's SDPA call, the KV cache written in place. ``fused=True``
  (the sampler's "fused" decode) cuts a layer further, at the price of other roundings: LoRA
  through lora.fused_forward (the add folded into the B matmul, the A's of q/k/v and of gate/up
  stacked) and RMSNorm as one operator (grpo_kernels/rms_norm.py).

Why plain 1-D rotary is exact here: a text token has the same M-RoPE position p on the
t, h and w axes, and M-RoPE only chooses, per frequency band, which axis's position to
rotate by; with all three equal every band rotates by p, which is ordinary RoPE at p.
(Prefill, where image tokens have distinct (t, h, w), still goes through transformers.)

Supported: rope_type "default" (Qwen2.5-VL's "mrope" is stored as default), full
attention (no sliding window), SDPA. ``supports(model)`` says whether a model qualifies;
the sampler falls back to transformers' forward otherwise. Tests hold both paths to
transformers' own greedy ``generate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_kernels.rms_norm import rms_norm
from lora import fused_forward


def supports(model) -> bool:
    """True if ``decode_step`` computes exactly what transformers' forward does for ``model``."""
    cfg = model.config.text_config
    rope = getattr(cfg, "rope_parameters", None) or {}
    return (
        rope.get("rope_type", "default") == "default"
        and not getattr(cfg, "use_sliding_window", False)
        and getattr(cfg, "_attn_implementation", "sdpa") in ("sdpa", "eager")
    )


def fused_by_default(model) -> bool:
    """Whether the sampler's "auto" decode takes the fused step: where the model computes in
    bf16 / fp16 (the qwen7b preset). There every operator of the reference step rounds to
    half precision already and the fused forms round less often; the log-probs stay a full
    forward's within rounding. In fp32 (the tiny preset, whose greedy evaluations decode here)
    the fused forms are not bit-identical to the reference on this CPU's BLAS, so "auto" keeps
    the reference step there and its numbers bit for bit."""
    return model.model.language_model.embed_tokens.weight.dtype in (torch.bfloat16, torch.float16)


class StaticKVCache:
    """Preallocated K/V per layer: [N, H_kv, S_max, D]; columns [0, length) are filled."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        self.keys, self.values, self.length = keys, values, length

    @classmethod
    def from_prefill(cls, cache, G: int, max_new_tokens: int, *, round_to: int = 1,
                     zero: bool = False) -> StaticKVCache:
        """Copy a transformers prefill cache of B rows into N = B*G rows with room for
        max_new_tokens, the length rounded up to a multiple of ``round_to``.

        ``zero``: zero-fill the unwritten columns. This module's step reads only the written
        ones; a step that attends over all columns under a mask (grpo/rollout/merged.py) needs
        them finite, since 0 * NaN = NaN.
        """
        keys, values = [], []
        for layer in cache.layers:
            k, v = layer.keys, layer.values  # [B, H_kv, P, D], P = prompt tokens
            B, H, P, D = k.shape
            S = -(-(P + max_new_tokens) // round_to) * round_to
            alloc = k.new_zeros if zero else k.new_empty
            kb, vb = alloc(B, G, H, S, D), alloc(B, G, H, S, D)
            # The group copy, written straight into the buffer (broadcast over G, no temporary).
            kb[:, :, :, :P] = k[:, None]
            vb[:, :, :, :P] = v[:, None]
            keys.append(kb.view(B * G, H, S, D))
            values.append(vb.view(B * G, H, S, D))
        return cls(keys, values, P)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's new K and V [N, H_kv, 1, D] into column ``length``, in place: no per-step
        concatenation (the column is a Python int: one copy each, no index tensor)."""
        s = self.length
        self.keys[i][:, :, s : s + 1] = k
        self.values[i][:, :, s : s + 1] = v

    def write_at(self, i: int, col: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i's new K and V [N, H_kv, 1, D] into column ``col`` [1] (a device tensor, so a
        captured CUDA graph writes wherever col says at replay)."""
        self.keys[i].index_copy_(2, col, k)
        self.values[i].index_copy_(2, col, v)

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (batch compaction when completions finish): one gather per layer."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]


def rotary_cos_sin(model, position: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, 1, D] of plain RoPE at ``position`` [N] (what M-RoPE is for text tokens)."""
    rotary = model.model.language_model.rotary_emb
    freqs = position[:, None].float() * rotary.inv_freq.float()[None, :]  # [N, D/2]
    emb = torch.cat([freqs, freqs], -1)  # rotate_half convention: halves, not interleaved pairs
    scale = rotary.attention_scaling
    return (emb.cos() * scale).to(dtype)[:, None, None, :], (emb.sin() * scale).to(dtype)[:, None, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dim of x [..., D]; cos, sin broadcast against it. Elementwise, so q and k
    concatenated along the heads are rotated in one pass with the very same numbers."""
    return x * cos + _rotate_half(x) * sin


def additive_mask(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool key mask as SDPA's float mask: 0 where True, -inf where False. SDPA converts a bool
    mask to exactly this inside every call (three operators per layer per token); done once per
    step instead, the attention computes the same numbers."""
    return torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill_(~key_mask, float("-inf"))


def _rms_norm(norm, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """The model's RMSNorm module ``norm`` on x, or (``fused``) grpo_kernels.rms_norm's one operator:
    the Triton kernel on CUDA (equal to rounding), the module's own arithmetic on the CPU."""
    if fused and norm.weight.dtype == x.dtype:
        return rms_norm(x, norm.weight, norm.variance_epsilon)
    return norm(x)


def _project(modules: list, h: torch.Tensor, fused: bool) -> list[torch.Tensor]:
    """The linear layers reading the same h: each its own call, or lora.fused_forward's."""
    return fused_forward(modules, h) if fused else [m(h) for m in modules]


def _attention(layer, h: torch.Tensor, cos, sin, cache: StaticKVCache, i: int, mask: torch.Tensor,
               fused: bool = False) -> torch.Tensor:
    """One attention block for one new token per row: h [N, 1, d] -> [N, 1, d]."""
    attn = layer.self_attn
    N, D = h.shape[0], attn.head_dim
    q, k, v = (y.view(N, 1, -1, D).transpose(1, 2)  # [N, H_q or H_kv, 1, D]
               for y in _project([attn.q_proj, attn.k_proj, attn.v_proj], h, fused))
    H_q = q.shape[1]
    q, k = apply_rope(torch.cat([q, k], 1), cos, sin).split([H_q, k.shape[1]], 1)  # one rotation for both
    cache.write(i, k, v)
    s = cache.length
    K, V = cache.keys[i][:, :, : s + 1], cache.values[i][:, :, : s + 1]  # views, [N, H_kv, s+1, D]
    # mask [N, 1, 1, s+1] float: -inf on the prompt's left padding. GQA: each K/V head
    # serves H_q / H_kv query heads (enable_gqa avoids materialising repeated K/V).
    out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=attn.scaling,
                                         enable_gqa=attn.num_key_value_groups > 1)
    return _project([attn.o_proj], out.transpose(1, 2).reshape(N, 1, -1), fused)[0]


def _mlp(layer, h: torch.Tensor, fused: bool) -> torch.Tensor:
    """SwiGLU, down(act(gate(h)) * up(h)), as the model's MLP computes it, with ``_project``."""
    mlp = layer.mlp
    gate, up = _project([mlp.gate_proj, mlp.up_proj], h, fused)
    return _project([mlp.down_proj], mlp.act_fn(gate) * up, fused)[0]


def decode_step(model, cache: StaticKVCache, token: torch.Tensor, position: torch.Tensor,
                key_mask: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """token [N] at position [N] through the decoder with ``cache``; returns logits [N, V] fp32.

    key_mask [N, s+1] bool marks real (non-padding) keys, the new token's column included.
    Advances ``cache.length`` by one. ``fused``: the LoRA projections through
    lora.fused_forward and RMSNorm as one operator (fewer operators, other rounding; see
    ``fused_by_default``).
    """
    lm = model.model.language_model
    x = lm.embed_tokens(token[:, None])  # [N, 1, d]
    cos, sin = rotary_cos_sin(model, position, x.dtype)
    mask = additive_mask(key_mask, x.dtype)[:, None, None, :]
    for i, layer in enumerate(lm.layers):
        x = x + _attention(layer, _rms_norm(layer.input_layernorm, x, fused), cos, sin, cache, i, mask, fused)
        h = _rms_norm(layer.post_attention_layernorm, x, fused)
        x = x + (_mlp(layer, h, fused) if fused else layer.mlp(h))
    cache.length += 1
    return model.lm_head(_rms_norm(lm.norm, x, fused))[:, -1].float()
