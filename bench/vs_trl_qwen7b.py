"""bench.vs_trl at Qwen2.5-VL-7B's shapes (``--shape qwen7b``): the model both sides load.

The 7B's text and vision widths (bench/step.py's QWEN7B_TEXT and QWEN7B_VISION: hidden 3584,
MLP 18944, 28 query / 4 KV heads, M-RoPE; a 1280-wide vision tower with 112 px windows and
the 2x2 patch merger) with the two stacks cut to ``--layers`` / ``--vision-layers`` (the same
cut on both sides; bench/qwen7b_cpu.py's ``qwen7b_config``, which keeps a full-attention
vision block), random weights (seed 0). It is built once in bf16 and saved under
``--model-cache``; both sides load that directory in fp32, so both start from the same
weights: ours quantises the language model's 7 projections per layer with lora.quant
(NF4, fp32 compute, vision tower and lm_head kept) and injects our rank-8 LoRA; TRL's side
loads it with bitsandbytes' NF4 (the same modules skipped) and PEFT's rank-8 LoRA.

Tokens: the embedded tiny tokenizer (556 ids) on the 7B's vocabulary (``--vocab``, default
its 152,064); ids it does not know are decoded modulo its size on both sides (ours: bench.step's
WrappedBundle; TRL's: the processor's ``batch_decode``), so the reward sees the same text.

Lengths forced equal: random weights would stop a row whenever a stop token happens to be
drawn, so neither side may stop early: ours runs with no stop token (grpo.rollout.sampler's
``stop_token_ids`` replaced by an id no token has, for the benchmark's steps only), TRL's
``generate`` gets ``min_new_tokens = max_new_tokens`` (transformers then masks the stop
tokens' logits until the budget). Every row of both sides is --max-new-tokens long.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch


def model_dir(args) -> Path:
    """The saved random model of ``args``' cut (built on first use); the directory."""
    path = Path(args.model_cache) / f"qwen7b-{args.layers}x{args.vision_layers}-v{args.vocab}"
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return path
    from transformers import Qwen2_5_VLForConditionalGeneration

    from bench.qwen7b_cpu import qwen7b_config
    from grpo.model.load import load_bundle

    cfg = qwen7b_config(args.layers, args.vision_layers, load_bundle("tiny").tokenizer)
    cfg.text_config.vocab_size = args.vocab
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    print(f"# saved the random 7B-shaped model ({sum(p.numel() for p in model.parameters()) / 1e6:,.0f}M "
          f"parameters, bf16) to {path}", flush=True)
    return path


def build_ours_qwen7b(args):
    """Our policy of the saved model: fp32, NF4 language model, rank-8 LoRA; a WrappedBundle."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from bench.step import WrappedBundle
    from grpo.model.load import load_bundle
    from grpo.model.tiny import tiny_image_processor
    from lora import LoRAConfig, inject_lora, quantize_model_4bit

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir(args), dtype=torch.float32)
    quantize_model_4bit(model, compute_dtype=torch.float32, verbose=False)  # vision tower and lm_head kept
    inject_lora(model, LoRAConfig(r=8, alpha=8.0), verbose=False)
    model.eval()
    return WrappedBundle(model=model, tokenizer=load_bundle("tiny").tokenizer,
                         image_processor=tiny_image_processor(args.image_px), source="qwen7b-shapes")


def phase_overrides(args) -> dict[str, str]:
    """The qwen7b preset's phase A at the benchmark's sizes, fp32 on the CPU, one pass over the
    batch (no micro-batches) and no checkpointing (TRL's side has none either)."""
    return {"model.dtype": "float32", "model.device": "cpu", "model.image_size": str(args.image_px),
            "model.max_pixels": str(args.image_px ** 2), "model.gradient_checkpointing": "false",
            "optim.micro_batch_rows": "0"}


@contextmanager
def no_stop_token():
    """Our sampler with no stop token while the block runs: every row decodes the budget."""
    from bench.step import _replaced
    from grpo.rollout import sampler

    with _replaced(sampler, stop_token_ids=lambda bundle: [-1]):  # -1: no token's id
        yield


def modulo_decode(processor_class):
    """``processor_class`` whose batch_decode reads ids modulo the tokenizer's size (as WrappedBundle)."""
    class ModuloDecode(processor_class):
        def batch_decode(self, sequences, **kwargs):
            n = len(self.tokenizer)
            return super().batch_decode([[int(i) % n for i in row] for row in sequences], **kwargs)

    return ModuloDecode
