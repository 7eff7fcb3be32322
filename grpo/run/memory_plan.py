"""The memory plan: the predicted peak of one GRPO step, by component, from the shapes alone.

One GRPO step (grpo/step.py) goes through three phases, each with its own peak on top of
what stays resident:

    resident    base weights (NF4 codes + statistics, and everything kept in the compute
                dtype: embeddings, lm_head, vision tower, norms, biases), the LoRA
                parameters, their gradients and AdamW's two moments, the merged rollout
                copy (sampling.rollout = merged)
    sampling    the KV cache of the N = B x G rows at its full length (prompt + budget),
                the prefill of the B prompts (their transformers cache, copied G times into
                the static cache, and one layer's activations in flight), the per-token
                logits transients of N rows, one dequantised NF4 weight, and the
                plain sampler's compaction (it gathers the cache of the rows still running
                into new buffers while the old ones exist: x 1.375 at worst)
    reference   (beta > 0) the no-grad pass of one training micro-batch: one decoder
                layer's transients and one logits chunk
    policy      one training micro-batch of m rows (optim.micro_batch_rows), sequence
                S = P + T: with activation checkpointing the input of every decoder layer
                (L x m x S x d), and in backward the larger of one layer recomputed
                (everything autograd saves in a layer, plus the gradients of its backward)
                and the logits chunks' part (the final norm's saved tensors and one chunk
                recomputed with its gradient, and with optim.entropy_coef > 0 the entropy
                bonus's gradient of it too), which is freed before the layers' backward;
                with the vision tower training (lora.vision / lora.merger) the images'
                patches (the batch's, and the micro-batches' copies) and what the tower
                keeps for its backward per patch, checkpointed or not
                (``vision_checkpointed_per_patch``, ``vision_saved_per_patch``)

The previous step's LoRA gradients stay counted as resident through the passes (a step
frees them at zero_grad and its backward makes them again): high by at most their bytes.

The peak of the step is the largest of the three. Each term is a formula of the widths
(hidden d, MLP width I, heads, KV heads, vocabulary V, layers L, compute-dtype bytes b),
written out op by op in ``layer_saved_per_token`` and the functions below. bench/memory.py
measures the same terms by running the real step (allocation tracking and saved-tensor
hooks, on the CPU) at the 7B's widths with 1, 2 and 4 layers and two token counts, and on
the whole tiny model, and prints predicted against measured: that is the calibration of
the two constants below that are not counted op by op (``BACKWARD_EXTRA_*``).

Assumptions (what a CUDA run differs in from the CPU where the terms were measured):

- the full-row pass's attention runs in PyTorch's memory-efficient / flash kernels: no
  [S, S] score matrix is kept, only the output and a log-sum-exp per head and position; the
  padding mask is materialised as an [m, 1, S, S] bias (transformers passes a mask whenever
  a row is padded or stopped early, and then repeats the 4 KV heads to 28); the
  shared-prefix pass (the default) asks for grouped-query attention with a mask, which the
  fused kernels do not take, so the math kernel's scores and softmax are counted
  (``pass_shape``);
- the log-softmax of the log-prob passes is the Triton kernel (grpo_kernels/logprob.py: logits
  and their gradient in the compute dtype, 12 bytes per token besides); on a CPU it is the
  PyTorch reference, whose fp32 copies are counted instead (``device="cpu"``);
- the numbers are what ``torch.cuda.max_memory_allocated`` reports. The caching allocator
  reserves more (fragmentation: ``ALLOCATOR_SLACK``), and the CUDA context, cuBLAS
  workspaces and CUDA-graph pools (``CUDA_OVERHEAD``) are not in that count: ``need_bytes``
  adds both when comparing with a GPU's memory;
- completions run to the full budget (T = sampling.max_new_tokens), and a prompt is
  ``prompt_tokens(cfg, images)`` long: the visual tokens of its images (the data's largest
  count a prompt, data.max_images at most) plus ``TEXT_TOKENS`` of text, or
  model.max_prompt_tokens when that cap is set.

Cheap by design (a few hundred multiplications): the trainer calls it at the start of every
GRPO phase on CUDA (``check_fits``) and stops with one line when the step cannot fit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from grpo.batches import groups_per_micro_batch, micro_batch_choices
from grpo.config import TrainConfig
from grpo.errors import ConfigError

GiB = 2**30
TEXT_TOKENS = 128  # text tokens of a prompt besides its images (the synthetic curriculum's: 45-61, tiny tokenizer)
ALLOCATOR_SLACK = 0.10  # reserved / allocated of the CUDA caching allocator at a training peak (fragmentation)
CUDA_OVERHEAD = int(1.0 * GiB)  # CUDA context + cuBLAS workspaces + graph pools, outside max_memory_allocated
# NF4 storage per weight (lora/quant.py: blocks of 64, double quantisation): 4-bit codes, one
# 8-bit absmax per block, one fp32 absmax per 256 blocks.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
# Measured (one 7B-width decoder layer, NF4 + LoRA, bf16, forward then backward under
# bench/memory.py's LiveBytes, 192 and 384 tokens): the backward's peak is what the layer
# saved, one dequantised weight, and 47 KB per token more -- about one [tokens, I] and one and
# a half [tokens, d] gradients in the compute dtype (autograd frees each saved tensor as soon
# as the op that needed it has run, so the gradients never coexist with all of the saves).
BACKWARD_EXTRA_I = 1.0
BACKWARD_EXTRA_H = 1.5


@dataclass(frozen=True)
class Shapes:
    """What the memory of a step depends on, read off a model (``shapes_of_model``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    compute_bytes: int  # 2 (bf16) or 4 (fp32)
    quantized_bytes: int  # NF4 codes + statistics of the 4-bit linears (0 without 4-bit)
    dense_bytes: int  # every other parameter and buffer of the base, in its own dtype
    lora_params: int
    lora_bytes: int  # bytes per LoRA parameter (its dtype)
    lora_targets: int  # adapted projections per decoder layer
    lora_rank: int
    merged_params: int  # weights of the projections the merged rollout copy holds
    # the vision tower (Qwen2.5-VL's ViT and merger): its widths, and its LoRA (lora.vision / lora.merger)
    vision_blocks: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    vision_heads: int = 0
    vision_targets: frozenset[str] = frozenset()  # adapted linears per block (attn.qkv, mlp.down_proj, ...), by last name
    merger_lora: bool = False
    vision_lora_params: int = 0  # the tower's and merger's LoRA parameters (also in lora_params)
    merger_lora_params: int = 0  # the merger's alone (also in vision_lora_params)
    reference_lora_params: int = 0  # a frozen copy of the warm-up's adapter: the reference (lora.inject.freeze_reference_adapter)
    vision_patch_elems: int = 0  # elements of one image patch as the tower takes it (3 x 2 x 14 x 14)
    vision_merge: int = 2  # spatial merge: merge^2 patches make one visual token
    head_lora: bool = False  # LoRA on lm_head: its product [tokens, V] and the sum beside the head's own logits

    @property
    def vision_trains(self) -> bool:
        """LoRA in the tower or merger: the policy pass runs the tower with grad."""
        return bool(self.vision_targets) or self.merger_lora

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def largest_projection(self) -> int:
        """Weights of the widest decoder projection (MLP: d x I), the size of one dequantised NF4 weight."""
        return self.hidden * self.intermediate


def shapes_of_model(model: torch.nn.Module, cfg: TrainConfig) -> Shapes:
    """The shapes of a built policy (base + LoRA). Parameters still on the meta device (a
    model built without storage, bench/memory.py) count as they will be stored: the
    language model's linears in NF4 when model.load_in_4bit, the rest in the compute dtype."""
    from lora.inject import lora_modules

    t = model.config.text_config
    b = torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8
    lora = lora_modules(model)
    lora_ids = {id(p) for m in lora.values() for p in (m.lora_A, m.lora_B)}
    quantized = dense = lora_params = lora_bytes = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in lora_ids:
            lora_params += p.numel()
            lora_bytes = p.element_size()
            continue
        state = getattr(p, "quant_state", None)
        if state is not None:
            stats = [state.absmax, state.code] + ([state.state2.absmax, state.state2.code] if state.nested else [])
            quantized += p.numel() * p.element_size() + sum(s.numel() * s.element_size() for s in stats)
        elif p.is_meta and cfg.model.load_in_4bit and p.dim() == 2 and _quantizable(name, p):
            quantized += int(p.numel() * NF4_BYTES_PER_WEIGHT)
        else:
            dense += p.numel() * (b if p.is_meta else p.element_size())
    dense += sum(buf.numel() * buf.element_size() for buf in model.buffers())
    per_layer = {n.rsplit(".", 1)[-1] for n in lora if ".layers.0." in n}
    merged = sum(m.in_features * m.out_features for n, m in lora.items() if ".language_model." in n)
    v = model.config.vision_config
    blocks = {n.rsplit(".", 1)[-1] for n in lora if ".visual.blocks.0." in n}
    vision_lora = sum(p.numel() for n, m in lora.items() if ".visual." in f".{n}" for p in (m.lora_A, m.lora_B))
    merger_lora = sum(p.numel() for n, m in lora.items() if ".visual.merger." in f".{n}" for p in (m.lora_A, m.lora_B))
    reference = sum(m.ref_A.numel() + m.ref_B.numel() for m in lora.values() if m.ref_A is not None)
    return Shapes(layers=t.num_hidden_layers, hidden=t.hidden_size, intermediate=t.intermediate_size,
                  heads=t.num_attention_heads, kv_heads=t.num_key_value_heads,
                  head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
                  vocab=t.vocab_size, compute_bytes=b, quantized_bytes=quantized, dense_bytes=dense,
                  lora_params=lora_params, lora_bytes=lora_bytes or 4, lora_targets=len(per_layer),
                  lora_rank=cfg.lora.rank, merged_params=merged, vision_blocks=v.depth, vision_hidden=v.hidden_size,
                  vision_intermediate=v.intermediate_size, vision_heads=v.num_heads, vision_targets=frozenset(blocks),
                  merger_lora=merger_lora > 0, vision_lora_params=vision_lora, merger_lora_params=merger_lora,
                  reference_lora_params=reference, vision_patch_elems=v.in_channels * v.temporal_patch_size * v.patch_size**2,
                  vision_merge=v.spatial_merge_size, head_lora="lm_head" in lora)


def _quantizable(name: str, p: torch.Tensor) -> bool:
    """lora/quant.py's choice: the language model's linear weights whose in_features is a multiple of 64."""
    return ".language_model.layers." in name and name.endswith("weight") and p.shape[1] % 64 == 0


def visual_tokens(cfg: TrainConfig) -> int:
    """Visual tokens of one image: one per 28 x 28 px (max_pixels for real images when set --
    the bound applies to each image --, the synthetic image's side otherwise); the tower sees
    4 patches of 14 x 14 px per token."""
    m = cfg.model
    return m.max_pixels // (28 * 28) if (cfg.run.data != "synthetic" and m.max_pixels) else (m.image_size // 28) ** 2


def prompt_tokens(cfg: TrainConfig, images: int = 1) -> int:
    """Tokens of one prompt of ``images`` images: model.max_prompt_tokens when set (the trainer
    skips longer prompts); else the visual tokens of each image (``visual_tokens``) plus
    TEXT_TOKENS of text."""
    m = cfg.model
    if m.max_prompt_tokens > 0:
        return m.max_prompt_tokens
    return images * visual_tokens(cfg) + TEXT_TOKENS


# ----------------------------------------------------------------------------- per-token terms


def attention_saved_per_token(sh: Shapes, repeated_kv: bool = True) -> int:
    """The part of ``layer_saved_per_token`` that attention's [rows, heads, length, D] layout
    keeps at every position, padding included: q after rotation, K and V, the output, the
    log-sum-exp."""
    q_heads_dim, b = sh.heads * sh.head_dim, sh.compute_bytes
    return 2 * b * q_heads_dim + 2 * (q_heads_dim if repeated_kv else sh.kv_dim) * b + 4 * sh.heads


def layer_saved_per_token(sh: Shapes, repeated_kv: bool = True) -> int:
    """Bytes autograd saves for backward in ONE decoder layer per token (Qwen2.5-VL's layer,
    NF4 + LoRA linears, with grad, not checkpointed). Op by op, b bytes per element of the
    compute dtype:

        input RMSNorm    x.to(fp32) kept for the backward of pow and mul: 4d (b = 4: no
                         copy, it keeps the layer input itself, a new tensor per layer
                         unless checkpointing keeps it anyway)
        q/k/v            their common input, the norm's output: b d (bnb's matmul and LoRA's
                         both save the same tensor); LoRA's rank-r middle: r b per target
        rotary           q after rotation b d (the mul by cos/sin saves only cos/sin)
        attention        K and V: repeated to every query head in transformers' SDPA path
                         with a mask (``repeated_kv``: 2 b d), or the rotated K and V as they
                         are in the shared-prefix pass (2 b d H_kv / H); the output b d;
                         log-sum-exp 4 per head
        o_proj           its input, the output made contiguous: b d
        post RMSNorm     the residual sum in fp32: 4d (b = 4: the sum itself, b d); output b d
        MLP              gate out, SiLU out, up out, their product: 4 b I

    bf16 on the 7B: 22 d + 8 I + 4 heads + 2 r x 7 = 230,624 B per token per layer with the
    KV heads repeated, 218,336 without. (The shared-prefix pass adds, per completion row,
    its prompt's keys and values copied: ``shared_prefix_layer_bytes``. It runs the token-wise
    parts on real tokens only, so a padding position keeps just ``attention_saved_per_token``;
    the plan counts every position as real, the most a batch of its shape can keep.)"""
    d, I, b = sh.hidden, sh.intermediate, sh.compute_bytes  # noqa: E741 (the docstring's I: intermediate size)
    norm_copy = 4 * d
    norm2_in = 4 * d if b < 4 else b * d
    # rotary's q, attention's K, V, output and log-sum-exp: attention_saved_per_token
    return (norm_copy + b * d + sh.lora_targets * sh.lora_rank * b + attention_saved_per_token(sh, repeated_kv)
            + b * d + norm2_in + b * d + 4 * b * I)


def pass_shape(cfg: TrainConfig, prompts: int, rows: int, P: int, T: int, heads: int) -> tuple[int, int, int, int]:
    """(tokens through each layer, prompt K/V rows copied, attention-mask elements, attention
    probabilities kept) of a log-prob pass over ``rows`` completions of ``prompts`` prompts.

    Full-row pass: every row is prompt + completion, rows x (P + T) tokens, masks [rows, 1,
    S, S]; the KV heads repeated by transformers, so a fused attention kernel takes it: no
    probabilities kept. Shared-prefix pass (optim.shared_prefix, grpo/model/shared_prefix.py):
    each prompt once, prompts x P + rows x T tokens; every completion row attends to a copy of
    its prompt's keys and values (rows x (P + T) K/V rows); masks [prompts, 1, P, P] and
    [rows, 1, T, P + T]. It asks SDPA for grouped-query attention WITH a mask, which CUDA's
    fused kernels do not take (transformers' own SDPA path repeats the KV heads whenever there
    is a mask for that reason): planned for CUDA as the math kernel, which keeps the scores and
    the softmax of every head, 2 b per probability. An assumption to check on a GPU; on the
    CPU the fp32 tiny model's count has no such term and the bf16 7B-width one 5% more than
    the plan without it."""
    if cfg.optim.shared_prefix:
        masks = prompts * P * P + rows * T * (P + T)
        return prompts * P + rows * T, rows * (P + T), masks, heads * masks
    return rows * (P + T), 0, rows * (P + T) ** 2, 0


def vision_saved_per_patch(sh: Shapes) -> int:
    """Bytes autograd saves per image patch in the whole vision tower and merger when the
    policy pass runs it with grad (lora.vision / lora.merger; not checkpointed). Qwen2.5-VL's
    block, op by op (width dv, MLP width Iv, H heads, b bytes of the compute dtype; the base
    linears are frozen and plain, so they save none of their inputs: a LoRA A saves its input):

        RMSNorm x 2      the fp32 copy of the input (4 dv) and the rsqrt (4) each; block 0's
                         first norm nothing (its input, the patch embedding, needs no grad)
        attention        q and k after the rotation (2 b dv; the rotation in fp32 saves only
                         cos / sin, 2 x 4 head_dim, one pair for the whole tower), v, a view
                         that keeps the whole qkv output alive (3 b dv), the output (b dv),
                         the log-sum-exp (4 H); window or full attention alike (the fused
                         kernels keep no scores)
        MLP              gate and up outputs and SiLU's (3 b Iv)
        per LoRA target  its input (qkv: the norm's output b dv, proj: b dv, gate / up: the
                         second norm's b dv once, down: b Iv) and its rank-r middle (r b)
        merger           per 4 patches (one token): the norm (4 dv + 4 per patch, with grad
                         from the tower), the first linear's output kept by GELU (b dv per
                         patch); with lora.merger each linear's input (b dv) and middle (r b
                         / 4); the token order's int64 index (2 per patch)

    bf16 at the 7B's tower (dv 1280, Iv 3420, 16 heads, 32 blocks, all five targets and the
    merger): 1,953,674 B, 1.86 MiB per patch: 1.86 GiB for one 448 px image (1,024
    patches). With the blocks checkpointed: ``vision_checkpointed_per_patch``."""
    if not sh.vision_trains:
        return 0
    dv, Iv, H, b, r = sh.vision_hidden, sh.vision_intermediate, sh.vision_heads, sh.compute_bytes, sh.lora_rank
    t = sh.vision_targets
    norm = 4 * dv + 4
    total = 0
    if t:
        lora_inputs = (b * dv * (("qkv" in t) + ("proj" in t) + bool(t & {"gate_proj", "up_proj"}))
                       + b * Iv * ("down_proj" in t) + r * b * len(t))
        block = 2 * norm + 2 * b * dv + 3 * b * dv + b * dv + 4 * H + 3 * b * Iv + lora_inputs
        total += sh.vision_blocks * block - norm + 2 * 4 * (dv // H)
    total += (norm if t else 0) + b * dv + 2
    if sh.merger_lora:
        total += 2 * b * dv + 2 * r * b // 4
    return total


def vision_checkpointed_per_patch(sh: Shapes) -> int:
    """Bytes kept per image patch from the tower's forward to its backward when its blocks
    are checkpointed (model.gradient_checkpointing; lora.vision on). A block keeps its inputs
    only and runs again in backward. Tensor by tensor (seen with bench/memory.py's LiveBytes on
    the tiny tower):

        patch embedding    its output in window order, the first block's input (b dv)
        block inputs       every later block's input, the previous one's output ((blocks - 1) b dv)
        last block         its output, kept by the merger's RMSNorm as an fp32 copy (4 dv;
                           b = 4: the output itself, b dv)
        rotary             cos and sin in window order, fp32 (2 x 4 head_dim)
        token order        the window order and its inverse, int64 per token (2 x 2 per patch)
        merger             the norm's rsqrt (4), the first linear's output kept by GELU (b dv);
                           with lora.merger each linear's input (2 b dv) and rank-r middle (2 r b / 4)

    With lora.merger alone the blocks hold no LoRA and run without grad, checkpointed or not
    (lora.enable_gradient_checkpointing removes transformers' hook that would make the patch
    embedding require grad): ``vision_saved_per_patch``'s merger-only count.

    bf16 at the 7B's tower (dv 1280, 16 heads, 32 blocks, merger LoRA on): 95,376 B per
    patch, 93 MiB for one 448 px image, a twentieth of the tower not checkpointed."""
    if not sh.vision_targets:
        return vision_saved_per_patch(sh)
    dv, b, r = sh.vision_hidden, sh.compute_bytes, sh.lora_rank
    last = 4 * dv if b < 4 else b * dv
    total = b * dv + (sh.vision_blocks - 1) * b * dv + last + 2 * 4 * (dv // sh.vision_heads) + 4
    total += 4 + b * dv
    if sh.merger_lora:
        total += 2 * b * dv + 2 * r * b // 4
    return total


def vision_lora_copies(sh: Shapes, checkpointed: bool = False) -> int:
    """Bytes of the tower's LoRA factors cast to the compute dtype and kept for backward;
    nothing when the LoRA dtype is the compute dtype (then the saved tensors are the
    parameters). Not checkpointed: one copy of each, the first adapted layer's A excepted
    (its input needs no grad); checkpointed with lora.vision: the merger's only (the blocks
    cast theirs again when they rerun); lora.merger alone: as not checkpointed (the blocks run
    without grad either way)."""
    if not sh.vision_trains or sh.lora_bytes == sh.compute_bytes:
        return 0
    if checkpointed and sh.vision_targets:
        return sh.merger_lora_params * sh.compute_bytes
    first_a = sh.lora_rank * sh.vision_hidden * (1 if "qkv" in sh.vision_targets else 0 if sh.vision_targets else 4)
    return (sh.vision_lora_params - first_a) * sh.compute_bytes


def layer_transient_no_grad_per_token(sh: Shapes) -> int:
    """Bytes alive inside one decoder layer without grad (prefill, reference pass), per
    token: the MLP's gate and up outputs and their product in flight (3 b I), the residual
    and the norm's fp32 copy (b d + 4 d)."""
    return 3 * sh.compute_bytes * sh.intermediate + sh.compute_bytes * sh.hidden + 4 * sh.hidden


def logits_bytes_per_token(sh: Shapes, device: str, backward: bool) -> int:
    """One logits chunk, per completion token. CUDA (Triton kernel): the logits in the
    compute dtype, and in backward their gradient of the same size (the kernel writes it
    into a new buffer). CPU (PyTorch reference): the logits, an fp32 copy, the scaled copy
    and the log-softmax (fp32), and in backward the gathered gradient scattered to [V] and
    the log-softmax's gradient (fp32). LoRA on lm_head: its product and the sum, while the
    head's own logits live."""
    V, b = sh.vocab, sh.compute_bytes
    head = 2 * b * V if sh.head_lora else 0
    if device == "cuda":
        return (2 if backward else 1) * b * V + head
    return (b + 3 * 4 + (2 * 4 if backward else 0)) * V + head


def entropy_bonus_bytes(sh: Shapes, chunk: int, block_tokens: int = 128) -> int:
    """The entropy bonus in one chunk's backward (optim.entropy_coef > 0;
    grpo/model/logprobs.py ``_EntropyWithGrad``): the chunk's logits gradient once more, in
    the logits' dtype (autograd then sums the two into one), and the fp32 temporaries of one
    block of ``block_tokens`` tokens: log p, p, and two [V] products in flight. Its forward
    keeps nothing new (the logits it saves are the log-prob pass's own)."""
    return chunk * sh.compute_bytes * sh.vocab + 4 * 4 * min(chunk, block_tokens) * sh.vocab


def decode_bytes_per_row(sh: Shapes) -> int:
    """The sampler's per-step logits transients per row (grpo/rollout/sampler.py
    sample_token): the LM head's output, its fp32 copy, the scaled logits, the log-softmax
    before and after filtering, the exponential draws and their log (fp32 [V] each); with LoRA
    on lm_head, its product and the sum too."""
    return (sh.compute_bytes * (3 if sh.head_lora else 1) + 6 * 4) * sh.vocab


# ----------------------------------------------------------------------------- the plan


@dataclass
class Part:
    name: str
    phase: str  # resident | sampling | reference | policy
    bytes: int
    note: str = ""


@dataclass
class Plan:
    parts: list[Part] = field(default_factory=list)
    micro_batch_rows: int = 0
    rows: int = 0  # N = B x G of one rollout batch
    prompt_tokens: int = 0
    completion_tokens: int = 0
    device: str = "cuda"

    def add(self, name: str, phase: str, nbytes: float, note: str = "") -> None:
        self.parts.append(Part(name, phase, int(nbytes), note))

    def phase_bytes(self, phase: str) -> int:
        resident = sum(p.bytes for p in self.parts if p.phase == "resident")
        return resident + sum(p.bytes for p in self.parts if p.phase == phase) if phase != "resident" else resident

    @property
    def phases(self) -> list[str]:
        return [ph for ph in ("sampling", "reference", "policy") if any(p.phase == ph for p in self.parts)]

    @property
    def peak(self) -> int:
        return max(self.phase_bytes(ph) for ph in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_bytes)

    def summary(self) -> str:
        return " + ".join(f"{ph} {self.phase_bytes(ph) / GiB:.1f}" for ph in self.phases)


def _add_resident(plan: Plan, sh: Shapes, cfg: TrainConfig) -> None:
    """What a step holds throughout: the base weights, the adapter and its optimiser, the merged copy."""
    plan.add("base weights, 4-bit (NF4 codes + statistics)", "resident", sh.quantized_bytes)
    plan.add("base weights, dense (embeddings, lm_head, vision, norms)", "resident", sh.dense_bytes)
    plan.add("LoRA + grads + AdamW moments", "resident", sh.lora_params * sh.lora_bytes * 4,
             f"{sh.lora_params:,} params x 4 tensors")
    if sh.reference_lora_params:
        plan.add("reference adapter (the warm-up's, frozen)", "resident", sh.reference_lora_params * sh.lora_bytes,
                 f"{sh.reference_lora_params:,} params")
    if cfg.sampling.rollout == "merged":
        plan.add("merged rollout copy", "resident", sh.merged_params * sh.compute_bytes,
                 "the adapted projections in the compute dtype")


def _add_sampling(plan: Plan, sh: Shapes, cfg: TrainConfig, P: int, dequant: int, dequant_all: int) -> None:
    """Sampling: the KV cache of N rows at full length, built from the B-prompt prefill (of
    P tokens each), the decode's transients and one dequantised NF4 weight, or all of them
    (``dequant_all``: where the plain decode keeps them for the rollout)."""
    s, b, B = cfg.sampling, sh.compute_bytes, cfg.phase.prompts_per_step
    N, S = B * s.G, P + s.max_new_tokens  # rows, the sampler's sequence
    kv_per_token = 2 * sh.layers * sh.kv_dim * b  # K and V of every layer
    S_cache = S if s.rollout == "plain" else -(-S // 64) * 64  # the merged copy rounds to 64 columns
    cache = N * S_cache * kv_per_token
    plan.add("KV cache (N rows x prompt + budget)", "sampling", cache, f"{kv_per_token // 1024} KiB/token")
    plan.add("prefill cache of the B prompts (copied into it)", "sampling", B * P * kv_per_token)
    if s.rollout == "plain":
        plan.add("cache compaction (rows gathered while the old cache lives)", "sampling", 0.375 * cache,
                 "worst case: a quarter of the rows stopped")
    plan.add("prefill: one layer's activations (B prompts)", "sampling", B * P * layer_transient_no_grad_per_token(sh))
    plan.add("decode logits transients", "sampling", N * decode_bytes_per_row(sh))
    plan.add("dequantised NF4 weight (one projection)", "sampling", dequant)
    if dequant_all:
        plan.add("decode: every NF4 projection dequantised once per rollout", "sampling", dequant_all,
                 "kept while it decodes (lora.dequant)")


def _add_vision(plan: Plan, sh: Shapes, cfg: TrainConfig, images: int, m: int) -> None:
    """lora.vision / lora.merger: the training passes run the tower again on the images of a
    micro-batch of m rows: the patches each pass keeps, the tower's saved activations."""
    o, b, G, B = cfg.optim, sh.compute_bytes, cfg.sampling.G, cfg.phase.prompts_per_step
    N = B * G
    patches = images * visual_tokens(cfg) * sh.vision_merge**2  # of one prompt
    mb_prompts = max(1, m // G)
    # the batch's patches, kept by its prompt context; cut into micro-batches, each micro-batch's
    # context holds a copy of its own prompts' (all cut at once, grpo/step.py): the batch's twice
    pixels = (2 if m < N else 1) * B * patches * sh.vision_patch_elems * b
    for phase in ("reference", "policy") if o.beta > 0 else ("policy",):
        plan.add(f"{phase}: the images' patches (the tower runs again)", phase, pixels)
    ckpt = cfg.model.gradient_checkpointing
    per_patch = vision_checkpointed_per_patch(sh) if ckpt else vision_saved_per_patch(sh)
    plan.add("policy: the vision tower's " + ("kept inputs (checkpointed)" if ckpt else "saved activations"),
             "policy", mb_prompts * patches * per_patch + vision_lora_copies(sh, ckpt),
             f"{mb_prompts} prompts x {patches:,} patches x {per_patch:,} B")


def plan_step(sh: Shapes, cfg: TrainConfig, *, device: str = "cuda", micro_batch_rows: int | None = None,
              prompt_len: int | None = None, images: int = 1) -> Plan:
    """The predicted peak of one GRPO step of ``cfg`` on a model of shapes ``sh``.

    ``micro_batch_rows``: override optim.micro_batch_rows (0 = all rows); ``prompt_len``:
    override ``prompt_tokens(cfg, images)``; ``images``: images a prompt shows (what the
    tower runs on when it trains)."""
    s, o = cfg.sampling, cfg.optim
    B, G, T = cfg.phase.prompts_per_step, s.G, s.max_new_tokens
    N = B * G
    m = o.micro_batch_rows if micro_batch_rows is None else micro_batch_rows
    m = groups_per_micro_batch(B, G, m) * G  # the partition rule (grpo/batches.py)
    P = prompt_tokens(cfg, images) if prompt_len is None else prompt_len
    d, b, L, V = sh.hidden, sh.compute_bytes, sh.layers, sh.vocab
    plan = Plan(micro_batch_rows=m, rows=N, prompt_tokens=P, completion_tokens=T, device=device)

    _add_resident(plan, sh, cfg)
    # bitsandbytes multiplies a batch of rows by an NF4 weight by dequantising it whole first
    # (on CUDA inside its gemm op). On a CPU its no-grad forward does the same, and the plain
    # decode keeps every projection dequantised for the rollout (lora.dequant);
    # the merged rollout decodes from its own copy, counted as resident.
    dequant_bwd = sh.largest_projection * b if sh.quantized_bytes else 0
    dequant = dequant_bwd if device == "cuda" else 0
    keeps_all = device != "cuda" and sh.quantized_bytes and cfg.sampling.rollout == "plain"
    _add_sampling(plan, sh, cfg, P, dequant, sh.merged_params * b if keeps_all else 0)

    # ---- training passes over one micro-batch of m rows (m / G prompts)
    chunk = min(m, max(1, o.logits_chunk_tokens // T)) * T  # completion tokens per LM-head chunk
    tokens, kv_rows, mask_elems, probs = pass_shape(cfg, max(1, m // G), m, P, T, sh.heads)
    # shared-prefix: the prompt K/V copies; on CUDA the math kernel's scores and softmax (see pass_shape)
    kv_extra = kv_rows * 2 * sh.kv_dim * b + (2 * probs * b if device == "cuda" else 0)
    mask = mask_elems * (1 + b)  # the bool masks + the attention kernel's bias in b
    inputs = tokens * (2 * sh.head_dim * b + 3 * 8) + m * T * 20  # rotary cos/sin, positions; ids, masks, log-probs
    if o.beta > 0:
        plan.add("reference: micro-batch inputs + mask", "reference", inputs + mask + tokens * b * d)
        plan.add("reference: one layer (no grad)", "reference",
                 tokens * layer_transient_no_grad_per_token(sh) + kv_extra + dequant)
        plan.add("reference: one logits chunk", "reference", chunk * logits_bytes_per_token(sh, device, False))
    plan.add("policy: micro-batch inputs + mask", "policy", inputs + mask)
    if sh.vision_trains:  # lora.vision / lora.merger: the passes run the tower again on their prompts' images
        _add_vision(plan, sh, cfg, images, m)
    saved = tokens * layer_saved_per_token(sh, repeated_kv=not o.shared_prefix) + kv_extra
    if cfg.model.gradient_checkpointing:
        plan.add("policy: layer inputs kept by checkpointing", "policy", L * tokens * b * d,
                 f"{L} layers x {tokens:,} tokens x {b * d} B")
    else:
        plan.add("policy: every layer's saved activations", "policy", L * saved, f"{saved / tokens:,.0f} B/token/layer")
    # Backward runs the logits chunks first, then the layers from the last one down. Two
    # candidates for its peak, on top of the layer inputs: (1) the logits chunks: the final
    # norm's saved fp32 copy and output, the completion hidden states the chunks keep, and
    # one chunk recomputed with its gradient; all of it is freed before the layers'
    # backward starts. (2) one layer recomputed: everything it saves, the mask bias, its
    # gradients and one dequantised weight.
    final_tokens = m * T if o.shared_prefix else tokens  # the shared pass norms only the T predicting positions
    final = final_tokens * ((4 * d if b < 4 else 0) + b * d) + m * T * b * d
    logits = final + chunk * logits_bytes_per_token(sh, device, True) + chunk * b * d
    if o.entropy_coef > 0:
        logits += entropy_bonus_bytes(sh, chunk)
    recompute = saved + mask_elems * b if cfg.model.gradient_checkpointing else 0
    layer_bwd = recompute + tokens * b * (BACKWARD_EXTRA_I * sh.intermediate + BACKWARD_EXTRA_H * d) + dequant_bwd
    if layer_bwd >= logits:
        plan.add("policy backward: one layer recomputed + its gradients", "policy", layer_bwd,
                 f"the logits chunks' peak would be {logits / 2**20:,.0f} MiB ({chunk} tokens per chunk)")
    else:
        plan.add("policy backward: final norm + one logits chunk recomputed + its gradient", "policy", logits,
                 f"{chunk} tokens x V={V}; one layer's backward would be {layer_bwd / 2**20:,.0f} MiB")
    return plan


# ----------------------------------------------------------------------------- fitting a GPU


def need_bytes(plan: Plan) -> int:
    """What a GPU must have for ``plan``: its peak, the allocator's slack, the CUDA overheads."""
    return int(plan.peak * (1 + ALLOCATOR_SLACK)) + CUDA_OVERHEAD


def largest_fitting(sh: Shapes, cfg: TrainConfig, budget: int, device: str = "cuda",
                    prompt_len: int | None = None, images: int = 1) -> tuple[int, Plan] | None:
    """(micro_batch_rows, plan) of the largest training micro-batch whose step needs at most
    ``budget`` bytes (``need_bytes``), or None when not even one group fits."""
    for rows in micro_batch_choices(cfg.phase.prompts_per_step, cfg.sampling.G):
        plan = plan_step(sh, cfg, device=device, micro_batch_rows=rows, prompt_len=prompt_len, images=images)
        if need_bytes(plan) <= budget:
            return rows, plan
    return None


def check_fits(model: torch.nn.Module, cfg: TrainConfig, device: str, world: int = 1, images: int = 1,
               log=print) -> Plan | None:
    """On CUDA: print the predicted peak of one step and stop (ConfigError: one line, exit 2)
    when it cannot fit in the memory the device has free now. The model is loaded already,
    so its resident bytes are part of both the prediction and ``memory_allocated``: the step
    needs the rest. With ``world`` data-parallel processes each plans its own share of the
    rollout batch (phase.prompts_per_step / world prompts); ``images``: the most images one
    of the phase's prompts shows. Elsewhere (a CPU run): nothing, None -- a CPU has no fixed
    memory to plan against and no OOM to prevent mid-step."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    if world > 1:
        cfg = copy.deepcopy(cfg)
        cfg.phase.prompts_per_step = max(1, cfg.phase.prompts_per_step // world)
    sh = shapes_of_model(model, cfg)
    P = prompt_tokens(cfg, images)
    plan = plan_step(sh, cfg, prompt_len=P, images=images)
    dev = torch.device(device)
    free, total = torch.cuda.mem_get_info(dev)
    held = torch.cuda.memory_allocated(dev)
    more = need_bytes(plan) - CUDA_OVERHEAD - held  # the context exists already, and so do the weights
    log(f"memory plan: predicted peak {plan.peak / GiB:.1f} GiB in {plan.peak_phase} ({plan.summary()} GiB; "
        f"micro-batch {plan.micro_batch_rows} of {plan.rows} rows, prompt ~{plan.prompt_tokens} tokens); "
        f"{free / GiB:.1f} of {total / GiB:.1f} GiB free with the model loaded", flush=True)
    if more <= free:
        return plan
    fit = largest_fitting(sh, cfg, free + held + CUDA_OVERHEAD, prompt_len=P, images=images)
    fix = (f"use --optim.micro_batch_rows {fit[0]} (predicted peak {fit[1].peak / GiB:.1f} GiB)"
           if fit is not None and fit[0] < plan.micro_batch_rows else
           "no training micro-batch fits: lower --sampling.max_new_tokens, --phase.prompts_per_step or "
           "--model.image_size, or use a larger GPU")
    raise ConfigError(f"the step does not fit on {device}: predicted peak {plan.peak / GiB:.1f} GiB "
                      f"({plan.peak_phase}; {ALLOCATOR_SLACK:.0%} allocator slack on top) needs {more / GiB:.1f} GiB "
                      f"beyond the loaded model and {free / GiB:.1f} GiB is free; {fix}")


# ----------------------------------------------------------------------------- an out-of-memory error mid-step

# The step's timed parts (grpo/step.py Hooks.timed): how the one line names each, and the
# plan's phase whose peak it reaches (the log-prob and loss passes run on one training
# micro-batch: the policy's; rewards allocate nothing on the device, so sampling's peak is
# the one in force).
PARTS = {"sampling": ("sampling", "sampling"), "rewards": ("the rewards", "sampling"),
         "logprobs": ("the log-probs", "policy"), "backward": ("the loss and backward", "policy")}


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.0f} MiB"


def device_budget(device: str) -> int | None:
    """The bytes one step may use on ``device``: a CUDA device's total memory (the run alone
    on it); None on a CPU, which has no fixed memory to plan against."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(torch.device(device))[1]


def largest_fitting_budget(sh: Shapes, cfg: TrainConfig, budget: int, device: str = "cuda",
                           micro_batch_rows: int | None = None) -> int | None:
    """The largest sampling.max_new_tokens, in eighths of the current one, whose step the
    plan fits in ``budget`` bytes (``need_bytes``); None when not even an eighth fits."""
    T = cfg.sampling.max_new_tokens
    for t in sorted({max(1, T * k // 8) for k in range(1, 8)}, reverse=True):
        shorter = copy.deepcopy(cfg)
        shorter.sampling.max_new_tokens = t
        if need_bytes(plan_step(sh, shorter, device=device, micro_batch_rows=micro_batch_rows)) <= budget:
            return t
    return None


def out_of_memory_fix(sh: Shapes, cfg: TrainConfig, part: str, budget: int | None, device: str = "cuda") -> str:
    """What the plan says fits, for an out-of-memory error in ``part`` of a step: the memory
    plan's figure for that part, then a smaller optim.micro_batch_rows (the training passes;
    it may change on resume) or sampling.max_new_tokens (sampling; a new run directory)."""
    label, phase = PARTS.get(part, (part, "policy"))
    plan = plan_step(sh, cfg, device=device)
    phase = phase if phase in plan.phases else plan.peak_phase
    figure = (f"the memory plan puts {label} at {_size(plan.phase_bytes(phase))} ({phase}; peak "
              f"{_size(plan.peak)} in {plan.peak_phase}, micro-batch {plan.micro_batch_rows} of {plan.rows} rows)")
    smaller = [r for r in micro_batch_choices(cfg.phase.prompts_per_step, cfg.sampling.G) if r < plan.micro_batch_rows]
    if budget is None:  # no device memory to plan against: the next smaller step
        fix = (f"rerun with --optim.micro_batch_rows {smaller[0]}" if phase == "policy" and smaller else
               f"lower --sampling.max_new_tokens (now {cfg.sampling.max_new_tokens}) in a new run directory")
        return f"{figure}; {fix}"
    have = _size(budget)
    if phase == "policy" and smaller:
        fit = largest_fitting(sh, cfg, budget, device)
        resumes = "the same command with it resumes from the last checkpoint"
        if fit is not None and fit[0] >= plan.micro_batch_rows:  # the plan thought this fits: it runs short here
            return (f"{figure}; the plan predicted that fits in {have}, so try the next smaller "
                    f"--optim.micro_batch_rows {smaller[0]} ({resumes})")
        if fit is not None:
            return (f"{figure}; the plan fits {_size(need_bytes(fit[1]))} of {have} with "
                    f"--optim.micro_batch_rows {fit[0]} ({resumes})")
    rows = smaller[-1] if phase == "policy" and smaller else None
    tokens = largest_fitting_budget(sh, cfg, budget, device, micro_batch_rows=rows)
    if tokens is None or tokens >= cfg.sampling.max_new_tokens:
        return (f"{figure}; the plan fits no shorter sampling.max_new_tokens in {have}: lower "
                "--phase.prompts_per_step or --model.max_pixels in a new run directory, or use a larger GPU")
    return (f"{figure}; the plan fits {have} with --sampling.max_new_tokens {tokens}"
            + (f" and --optim.micro_batch_rows {rows}" if rows else "") + " (in a new run directory: "
            "max_new_tokens is fixed on resume)")


def out_of_memory_message(model: torch.nn.Module, cfg: TrainConfig, device: str, world: int, step: int,
                          part: str | None) -> str:
    """The one line for torch.OutOfMemoryError in step ``step`` of a GRPO phase, during
    ``part`` (None: outside the timed parts): which part, the plan's figure and its fix."""
    if world > 1:
        cfg = copy.deepcopy(cfg)
        cfg.phase.prompts_per_step = max(1, cfg.phase.prompts_per_step // world)
    label = PARTS.get(part, (part or "the step", ""))[0]
    head = f"phase {cfg.phase.name} step {step} ran out of device memory in {label} on {device}"
    try:
        fix = out_of_memory_fix(shapes_of_model(model, cfg), cfg, part or "backward", device_budget(device),
                                "cuda" if str(device).startswith("cuda") else "cpu")
    except Exception as err:  # noqa: BLE001 -- the plan failed on this model: the line still goes out
        fix = f"no memory plan for this model ({type(err).__name__}); lower --optim.micro_batch_rows"
    return f"{head}; {fix}; checkpoints up to the last one saved are intact"
