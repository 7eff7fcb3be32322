"""Fast rollouts: decode from a bf16 copy of the language model with LoRA merged in.

Why. The policy is a 4-bit (NF4) base plus LoRA. For a *batch* of rows, bitsandbytes runs
an NF4 linear as dequantise-to-bf16 + bf16 matmul, so every decode step reads the packed
weights (0.5 B/param), writes a bf16 copy (2 B/param) and reads it back (2 B/param), and
runs the LoRA branch as two extra skinny matmuls per layer. Decode is memory-bound, so that
is ~4.5 bytes of traffic per parameter per step against 2 for a bf16 model: about 2x
slower. Training needs the 4-bit base (the backward pass fits); sampling does not.

What is implemented
-------------------
``MergedRollout(model)`` keeps, next to the policy, one bf16 weight per adapted (or 4-bit)
projection of the language model:

    W' = dequant(W_nf4) + (alpha / r) B A        computed in fp32, rounded once to bf16

and ``refresh()`` recomputes them *in place* after every optimiser step (cost: one
dequantisation of the base, ~0.1 s for the 7B on a GPU; the addresses stay fixed, which is
what a captured CUDA graph needs). Everything else -- embeddings, norms, rotary tables,
lm_head, the vision tower -- is the policy's own module, shared, not copied. For the 7B
the copy is the 28 x 7 projections, 6.5B parameters = 13 GB of bf16. Projections that read the
same input are stored stacked (q/k/v as one [out_q + 2 out_kv, in] weight, gate/up as one), so a
layer runs 4 matmuls, not 7.

``MergedRollout.sample`` is ``grpo.rollout.sampler.sample`` -- the same checks, prefill, decode loop
and output -- with this class as its DecodeHook, which swaps the per-token model call:

    prefill     the policy itself (vision tower + M-RoPE via transformers, 4-bit + LoRA):
                once per prompt, compute-bound, so the dequantisation cost is amortised
    KV cache    static: [N, H_kv, S, D] per layer, S = prompt + max_new_tokens rounded up to
                64, zero-filled (masked columns must hold finite numbers: 0 * NaN = NaN)
    decode      ``_decode_step``: the decoder layer written with F.linear over the merged
                weights; every tensor has a fixed shape (the new K/V go in with
                index_copy_ at a column held in a device tensor, attention reads all S
                columns under a float key mask), so on CUDA the whole step -- 28 layers,
                ~900 operators (32 a layer: python -m bench.decode_ops counts them) -- is
                captured once per ``sample`` call into a CUDA graph and replayed: one
                launch per token instead of ~900 (``graphs``)
    sampling    grpo.rollout.sampler.sample_token, eager, outside the graph (it owns the RNG)

GQA without copies: the H_q / H_kv query heads that share one K/V head are laid out as that
head's "query rows" ([N, H_kv, g, D] against K [N, H_kv, S, D]), so attention reads each K/V
head once; ``enable_gqa`` would fall back to repeating K/V g times on kernels that take a
mask.

Numerics. The copy is kept in the model's compute dtype: bf16 for the 7B on a GPU, fp32
for the tiny model on a CPU (its weights and activations are fp32; a bf16 copy there would
add rounding and gain nothing, CPU bf16 matmuls being no faster). Sampling from W' instead
of (W_nf4, B, A) changes the logits by that dtype's rounding (the policy computes W x and
B A x separately): in fp32 ratios pi_train / pi_sampler within ~1e-3 of 1 on the tiny
model, in bf16 a few percent (bench/RESULTS.md, tests/test_rollout_merged.py). The rollouts
are then slightly off-policy, as in every setup that samples with a separate inference
engine; the trainer passes the sampler's log-probs to the loss, logs the mismatch every
step and corrects for it with optim.rollout_correction (grpo_kernels/grpo_loss.py). On the
tiny fp32 model the two paths give the same greedy tokens.

Simplified / left out: no batch compaction (finished rows keep decoding: shapes must stay
fixed for the graph, and at decode batch sizes a step costs the weight reads, not the rows);
no torch.compile (the graph removes the launch overhead, the matmuls are cuBLAS already);
one graph per ``sample`` call, recaptured each time (~3 steps' worth of work out of 256),
so the KV cache is freed between rollouts; the plain path (grpo/rollout/sampler.py) stays the
reference and the dataclass default (the tiny preset samples from this copy).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from grpo.model.load import ModelBundle
from grpo.model.prompt_context import PromptContext
from grpo.model.prompts import PromptBatch
from grpo.rollout import decoder
from grpo.rollout.sampler import DecodeStep, SampleOutput, sample
from lora.layer import LoRALinear, is_linear4bit
from lora.quant import dequantize_weight

PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
# The copy's weights, one per matmul of the step: projections that read the same input are stacked
# along their outputs (q, k, v; gate, up), so the step runs 4 matmuls a layer instead of 7. Each
# output element is the same dot product either way (checked bit for bit in tests/test_rollout_merged.py).
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}
BLOCK = {name: block for block, name in PROJECTIONS}
S_ROUND = 64  # KV cache length rounded up to this (aligned key masks for the fused attention kernels)


def _merged_fp32(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W' [out, in] fp32, bias) of a plain, 4-bit or LoRA-wrapped linear layer."""
    if isinstance(module, LoRALinear):
        # The adapter is merged even if it is switched off at this moment: rollouts come from the policy.
        return dequantize_weight(module.base_layer) + module.delta_weight(), module.base_layer.bias
    return dequantize_weight(module), module.bias


def _needs_copy(module: nn.Module) -> bool:
    return isinstance(module, LoRALinear) or is_linear4bit(module)


class MergedRollout:
    """A merged copy of the LM projections in the model's compute dtype (bf16 on a GPU, fp32 for the tiny
    CPU model) + a graph-captured decode step on CUDA."""

    def __init__(self, model: nn.Module, graphs: str | bool = "auto"):
        if not decoder.supports(model):
            raise ValueError("MergedRollout supports Qwen2.5-VL-style text decoders with default rotary, full "
                             "attention and sdpa/eager attention; set sampling.rollout=plain for this model")
        if graphs not in ("auto", True, False):
            raise ValueError(f"graphs={graphs!r}: use 'auto' (CUDA graphs on CUDA), True or False")
        self.model = model
        self.lm = model.model.language_model
        self.dtype = self.lm.embed_tokens.weight.dtype  # bf16 for the 7B, fp32 for the tiny CPU model
        self.device = self.lm.embed_tokens.weight.device
        self.graphs = (self.device.type == "cuda") if graphs == "auto" else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise ValueError("graphs=True needs the model on a CUDA device; use graphs='auto' or False on a CPU")
        # One [out, in] weight (and bias) per matmul (FUSED) per layer, allocated once, refreshed in place.
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = []
        for layer in self.lm.layers:
            per_layer = {}
            for fused, names in FUSED.items():
                parts = [_merged_fp32(getattr(getattr(layer, BLOCK[n]), n)) for n in names]
                biases = [b for _, b in parts if b is not None]
                if biases and len(biases) != len(parts):
                    raise ValueError(f"{', '.join(names)}: some with a bias and some without; MergedRollout stacks "
                                     f"them into one matmul and needs all or none (set sampling.rollout=plain)")
                W = torch.cat([W for W, _ in parts]).to(self.dtype)
                per_layer[fused] = (W, torch.cat(biases).detach().to(self.dtype) if biases else None)
            self.weights.append(per_layer)
        head = model.lm_head
        self.lm_head = _merged_fp32(head)[0].to(self.dtype) if _needs_copy(head) else head.weight
        self.cache: decoder.StaticKVCache | None = None  # while a rollout decodes

    @property
    def nbytes(self) -> int:
        """Bytes held by the merged copy (what it costs on top of the policy)."""
        n = sum(W.numel() * W.element_size() for layer in self.weights for W, _ in layer.values())
        return n + (self.lm_head.numel() * self.lm_head.element_size() if _needs_copy(self.model.lm_head) else 0)

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-merge the current adapter into the copy, in place (call after every optimiser step)."""
        for layer, per_layer in zip(self.lm.layers, self.weights):
            for fused, names in FUSED.items():
                W, row = per_layer[fused][0], 0
                for n in names:  # each projection into its rows of the stacked weight
                    merged = _merged_fp32(getattr(getattr(layer, BLOCK[n]), n))[0]
                    W[row : row + merged.shape[0]].copy_(merged)
                    row += merged.shape[0]
        if _needs_copy(self.model.lm_head):
            self.lm_head.copy_(_merged_fp32(self.model.lm_head)[0])

    # ------------------------------------------------------------------ the decode step

    def _decode_step(self, token: torch.Tensor, position: torch.Tensor, col: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
        """token [N] at position [N], written to cache column col [1]; mask [N, S] float (0 on the
        keys to attend to, -inf elsewhere: SDPA's own form of a key mask) -> logits [N, V] fp32.

        Fixed shapes, no host syncs, no Python branches on tensor values: capturable.
        """
        x = self.lm.embed_tokens(token[:, None])  # [N, 1, d]
        cos, sin = decoder.rotary_cos_sin(self.model, position, x.dtype)  # [N, 1, 1, D]
        cos, sin = cos[:, 0], sin[:, 0]  # [N, 1, D]: against [N, heads, D]
        mask = mask[:, None, None, :]  # [N, 1, 1, S]: broadcast over heads and grouped query rows
        for i, layer in enumerate(self.lm.layers):
            x = x + self._attention_block(i, layer, layer.input_layernorm(x), cos, sin, col, mask)
            x = x + self._mlp_block(i, layer, layer.post_attention_layernorm(x))
        return F.linear(self.lm.norm(x), self.lm_head)[:, -1].float()

    def _attention_block(self, i: int, layer, h: torch.Tensor, cos, sin, col, mask) -> torch.Tensor:
        """h [N, 1, d] -> attention output [N, 1, d]: one q/k/v matmul, one rotation, two cache writes."""
        w, N, D = self.weights[i], h.shape[0], layer.self_attn.head_dim
        K, V = self.cache.keys[i], self.cache.values[i]
        H_kv = K.shape[1]
        qkv = F.linear(h, *w["qkv"]).view(N, -1, D)  # [N, H_q + 2 H_kv, D]: q's heads, then k's, then v's
        H_qk = qkv.shape[1] - H_kv
        qk = decoder.apply_rope(qkv[:, :H_qk], cos, sin)  # q and k rotated together
        q, k, v = qk[:, : H_qk - H_kv], qk[:, H_qk - H_kv :], qkv[:, H_qk:]
        self.cache.write_at(i, col, k[:, :, None], v[:, :, None])  # the new column, in place
        q = q.reshape(N, H_kv, -1, D)  # query heads j*g .. j*g+g-1 share K/V head j
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=layer.self_attn.scaling)  # [N, H_kv, g, D]
        return F.linear(out.reshape(N, 1, -1), *w["o_proj"])

    def _mlp_block(self, i: int, layer, h: torch.Tensor) -> torch.Tensor:
        """h [N, 1, d] -> SwiGLU output [N, 1, d]: one gate/up matmul, then down."""
        w = self.weights[i]
        gate, up = F.linear(h, *w["gate_up"]).chunk(2, -1)
        return F.linear(layer.mlp.act_fn(gate) * up, *w["down_proj"])

    def _capture(self, token, position, col, mask):
        """A replay function for _decode_step on these static input tensors (CUDA graph)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: cuBLAS workspaces, allocator pools
            for _ in range(2):
                self._decode_step(token, position, col, mask)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._decode_step(token, position, col, mask)
        # The warm-up wrote garbage into column `col` (= the first decode column); the first
        # real step overwrites it before any row attends to it.

        def replay():
            graph.replay()
            return logits

        return replay

    # ------------------------------------------------------------------ sampling

    @torch.no_grad()
    def sample(self, bundle: ModelBundle, prompts: PromptBatch, *, G: int, max_new_tokens: int,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               generator: torch.Generator | None = None) -> SampleOutput:
        """grpo.rollout.sampler.sample (same loop, same SampleOutput) with this copy's decode step."""
        if bundle.model is not self.model:
            raise ValueError("this MergedRollout was built for another model; build one per policy")
        return sample(bundle, prompts, G=G, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, generator=generator, hook=self)

    def begin(self, cache, ctx: PromptContext, rows: torch.Tensor, G: int, max_new_tokens: int) -> DecodeStep:
        """The DecodeHook half of ``sample``: a zero-filled static cache of N = B*G rows and S
        columns, the step's fixed-address inputs, and (CUDA) the captured graph."""
        device, P = self.device, ctx.attention_mask.shape[1]  # P prompt columns
        self.cache = decoder.StaticKVCache.from_prefill(cache, G, max_new_tokens, round_to=S_ROUND, zero=True)
        N, S = rows.shape[0], self.cache.keys[0].shape[2]
        key_mask = torch.zeros(N, S, dtype=torch.bool, device=device)
        key_mask[:, :P] = ctx.attention_mask[rows].bool()
        mask = decoder.additive_mask(key_mask, self.dtype)  # the step's float key mask, opened a column per token
        # Static inputs of the step: a replay reads them where they are.
        token_in = torch.zeros(N, dtype=torch.long, device=device)
        position_in = ctx.next_position[rows].clone()
        col = torch.full((1,), P, dtype=torch.long, device=device)
        run = (self._capture(token_in, position_in, col, mask) if self.graphs
               else lambda: self._decode_step(token_in, position_in, col, mask))

        def step(token: torch.Tensor, position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            new = attention_mask.shape[1] - 1  # the new token's cache column: P + tokens decoded so far
            token_in.copy_(token)
            position_in.copy_(position)
            col.fill_(new)
            mask[:, new] = 0.0
            return run()

        return step

    def end(self) -> None:
        self.cache = None  # free the KV cache between rollouts
