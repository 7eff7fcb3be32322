"""The prompt once per group in the log-prob passes: a shared-prefix forward of the language model.

A group's G rows are one prompt (P positions, the image's visual tokens among them) followed
by G different completions (T positions each). The full-row pass (grpo/model/logprobs.py)
runs all N = B*G rows of P + T positions, so every prompt position goes through every layer
G times, with grad, and its activations are kept G times. The G copies are identical up to
the first completion token: causal attention means a prompt position never sees a
completion. So each prompt runs ONCE (B rows), and only attention, the one place where
positions meet, needs to know that a completion row continues prompt b = row // G:

    tokens      x = [x_prompt (B*P tokens) ; x_completion (N*T tokens)]        [S, d], S = B*P + N*T
    per layer   RMSNorm, q/k/v projections, o_proj, RMSNorm, MLP              token-wise: on the real ones at once
                rotary (M-RoPE cos/sin of every token, computed once)         token-wise
                attention, the two streams:
                  prompt      q [B, H, P, D]  over  k, v [B, H_kv, P, D]                causal + key padding
                  completion  q [N, H, T, D]  over  [k_prompt[row // G] ; k_own]   causal + key padding
                                                     [N, H_kv, P + T, D]
    out         h [N, T, d]: position t is predicted by the completion's position t-1, and
                the first completion token by the prompt's last position (prompts are
                left-padded, so that is column P-1 of every prompt), copied to its G rows.

Padding is left out of the token-wise parts. Prompts are left-padded to the batch's longest
and completions padded after their stop to the longest, so many of the S positions are not
tokens (on the embedded default about a third: completions average ~25 of the batch's ~41).
Nothing reads them: a padding key is masked, a padding position's output predicts nothing.
So the pass keeps only the R real positions through the layers, x [R, d]: norms, projections
and MLP run on R rows; attention alone scatters q, k, v into the [rows, heads, length, D]
layout above (zeros at the padding) and gathers the real rows of its output. Each real row's
arithmetic is its own, so the hidden states and log-probs are the same bits as running every
position. The adapters' gradients sum over tokens, to which the dropped rows only ever added
zeros; with fewer rows the matmul may group that sum otherwise, so they agree to rounding (on
the embedded default: the same samples and rewards, gradient norms within 3e-7 relative).

Autograd does the rest: ``repeat_interleave(G)`` of the prompt's keys and values sums the G
rows' gradients back into the one prompt stream, so the LoRA gradient from all G completions
flows through the prompt's activations exactly as through G identical copies. Same function,
same gradient (Prefix Grouper, Liu et al. 2025, "training-equivalent"); only the order of
float sums changes.

Cost, per layer, against the full-row pass: the projections and the MLP run on the real
tokens of B*P + N*T instead of N*(P + T); attention does the same completion work and 1/G of the prompt
work; the prompt's K/V (GQA: H_kv*D = d*H_kv/H per token, 1/7 of d at the 7B) are copied G
times, the one added tensor. With activation checkpointing each layer keeps its input x,
[R, d] instead of [N, P + T, d]: at the 7B preset (P ~ 380, T = 256, G = 8) at most 0.47x.

The layer is written out here, calling the layer's own modules (LoRA-wrapped or 4-bit
projections, its norms, its MLP) and the language model's own rotary embedding (M-RoPE: the
t/h/w sections are chosen inside it), so it is the same function as transformers' decoder
layer; tests hold it to that layer and the whole pass to the full-row pass, values and
gradients. Checkpointing is done here too (torch.utils.checkpoint, non-reentrant) when the
model's layers have it on: transformers' checkpointing wraps the layer's ``forward``, which
this pass does not call.

Supported: full attention (no sliding window). ``supports(model)`` says so; the log-prob
passes use the full-row pass otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from grpo.model.prompt_context import PromptContext, completion_position_ids, group_rows, prompt_embeds


def supports(model) -> bool:
    """True if every layer of ``model``'s language model is full attention (what this pass computes)."""
    cfg = model.config.text_config
    return not getattr(cfg, "use_sliding_window", False) and all(
        t == "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half convention: x [S, H, D], cos/sin [S, D] (M-RoPE already folded in)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def attention_masks(ctx: PromptContext, completion_mask: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks (True = attend) of the two attention streams.

    prompt      [B, 1, P, P]      key j <= query i and j real (not left padding); the diagonal
                                  always, so a padding query is never left with no key (its output
                                  is never read: real queries do not attend padding)
    completion  [N, 1, T, P + T]  every real prompt key of the row's prompt, then its own
                                  completion keys j <= t that are real (the full-row pass's mask)
    """
    B, P = ctx.attention_mask.shape
    N, T = completion_mask.shape
    dev = completion_mask.device
    real = ctx.attention_mask.bool()  # [B, P]
    causal_p = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    prompt = (causal_p & real[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)
    causal_c = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    rows = group_rows(B, G, dev)
    own = causal_c & completion_mask.bool()[:, None, :]  # [N, T, T]
    completion = torch.cat([real[rows, None, :].expand(N, T, P), own], 2)
    return prompt[:, None], completion[:, None]


def layer_forward(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, masks: tuple[torch.Tensor, torch.Tensor],
                  B: int, P: int, G: int, T: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer over the packed tokens x (B prompts of P, then N = B*G completions of T).

    ``keep`` None: x is every position, [S, d]. Else ``keep`` [R] lists the real positions of
    that layout in order and x [R, d] (and cos, sin [R, D]) holds only them: the token-wise
    parts (norms, projections, MLP) run on real tokens only, and attention, the one part that
    needs the [rows, heads, length, D] layout, gets q, k, v scattered into it (zeros at the
    padding, which no real query attends to) and gives back the real rows.
    """
    attn = layer.self_attn
    D = attn.head_dim
    N = B * G
    S = B * P + N * T
    h = layer.input_layernorm(x)
    q = _rotate(attn.q_proj(h).view(x.shape[0], -1, D), cos, sin)  # [R, H, D]
    k = _rotate(attn.k_proj(h).view(x.shape[0], -1, D), cos, sin)  # [R, H_kv, D]
    v = attn.v_proj(h).view(x.shape[0], -1, D)
    if keep is not None:  # into the full layout: [S, heads, D], zeros at the padding (index_put
        # saves only the indices for backward; index_copy would keep q, k and v as well)
        q, k, v = (t.new_zeros(S, *t.shape[1:]).index_put((keep,), t) for t in (q, k, v))

    def stream(t: torch.Tensor, rows: int, length: int, at: slice) -> torch.Tensor:  # [rows, heads, length, D]
        return t[at].view(rows, length, -1, D).transpose(1, 2)

    at_p, at_c = slice(0, B * P), slice(B * P, S)
    k_p, v_p = stream(k, B, P, at_p), stream(v, B, P, at_p)
    gqa = attn.num_key_value_groups > 1  # each K/V head serves H / H_kv query heads, not materialised
    o_p = F.scaled_dot_product_attention(stream(q, B, P, at_p), k_p, v_p, attn_mask=masks[0], scale=attn.scaling,
                                         enable_gqa=gqa)  # [B, H, P, D]
    # The completions' keys: their prompt's (copied to the G rows; backward sums the copies) then their own.
    k_c = torch.cat([k_p.repeat_interleave(G, 0), stream(k, N, T, at_c)], 2)  # [N, H_kv, P + T, D]
    v_c = torch.cat([v_p.repeat_interleave(G, 0), stream(v, N, T, at_c)], 2)
    o_c = F.scaled_dot_product_attention(stream(q, N, T, at_c), k_c, v_c, attn_mask=masks[1], scale=attn.scaling,
                                         enable_gqa=gqa)  # [N, H, T, D]
    o = torch.cat([o_p.transpose(1, 2).reshape(B * P, -1), o_c.transpose(1, 2).reshape(N * T, -1)], 0)
    if keep is not None:
        o = o.index_select(0, keep)  # [R, H * D]: the real rows
    x = x + attn.o_proj(o)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def shared_prefix_hidden_states(
    model, ctx: PromptContext, completion_ids: torch.Tensor, completion_mask: torch.Tensor, G: int,
    compact: bool = True,
) -> torch.Tensor:
    """Final hidden states at the T positions that predict completion tokens: [N, T, d], each
    prompt run once. The same tensor as logprobs.completion_hidden_states, within float sums.
    ``compact``: the token-wise parts run on real tokens only (``layer_forward``'s ``keep``)."""
    lm = model.model.language_model
    B, P = ctx.B, ctx.P
    N, T = completion_ids.shape
    rows = group_rows(B, G, completion_ids.device)
    x_p = prompt_embeds(model, ctx, tower=True)  # [B, P, d], visual tokens in (the tower once per prompt)
    x_c = model.get_input_embeddings()(completion_ids)  # [N, T, d]
    d = x_p.shape[-1]
    x = torch.cat([x_p.reshape(B * P, d), x_c.reshape(N * T, d)], 0)  # [S, d]
    # M-RoPE cos/sin of every token, once for all layers: the prompt's (t, h, w) positions and
    # the completions' (text: t = h = w = next_position + k, the per-prompt rope delta included).
    cos_p, sin_p = lm.rotary_emb(x_p, ctx.position_ids)  # [B, P, D]
    cos_c, sin_c = lm.rotary_emb(x_c, completion_position_ids(ctx, rows, T))  # [N, T, D]
    cos = torch.cat([cos_p.flatten(0, 1), cos_c.flatten(0, 1)], 0)  # [S, D]
    sin = torch.cat([sin_p.flatten(0, 1), sin_c.flatten(0, 1)], 0)
    masks = attention_masks(ctx, completion_mask, G)
    # The real positions: the prompts' (not left padding) and the completions' own tokens. A
    # completion's last real token predicts nothing, but its keys are read: it stays.
    real = torch.cat([ctx.attention_mask.reshape(-1), completion_mask.reshape(-1)]).bool()
    keep = real.nonzero().squeeze(1) if compact and not bool(real.all()) else None
    if keep is not None:
        x, cos, sin = x.index_select(0, keep), cos.index_select(0, keep), sin.index_select(0, keep)
    for layer in lm.layers:
        if torch.is_grad_enabled() and getattr(layer, "gradient_checkpointing", False):
            # keep x only; backward reruns the layer (cos, sin, masks: shared, no grad)
            x = checkpoint(layer_forward, layer, x, cos, sin, masks, B, P, G, T, keep, use_reentrant=False)
        else:
            x = layer_forward(layer, x, cos, sin, masks, B, P, G, T, keep)
    if keep is not None:  # back into the layout (zeros at the padding: read by nothing but finite)
        x = x.new_zeros(B * P + N * T, d).index_put((keep,), x)
    # The first completion token is predicted by the prompt's last position (column P-1 of every
    # left-padded prompt), token t > 0 by the completion's position t-1. Norm only those.
    last = x[: B * P].view(B, P, d)[:, P - 1][rows, None]  # [N, 1, d]
    return lm.norm(torch.cat([last, x[B * P :].view(N, T, d)[:, : T - 1]], 1))
