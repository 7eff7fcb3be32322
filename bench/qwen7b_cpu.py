"""Benchmark: one GRPO step at Qwen2.5-VL-7B-Instruct's exact shapes, on a CPU.

    python -m bench.qwen7b_cpu                          # the whole 7B: 28 LM + 32 vision layers (long on 1 thread)
    python -m bench.qwen7b_cpu --layers 2 --vision-layers 2   # the 7B's widths, 2 + 2 layers
    python -m bench.qwen7b_cpu --smoke                  # = --layers 1 --vision-layers 2 --max-new-tokens 2

No GPU and no download: the model is a randomly initialised
Qwen2_5_VLForConditionalGeneration with the 7B's config (bench/step.py's QWEN7B_TEXT and
QWEN7B_VISION, from Qwen/Qwen2.5-VL-7B-Instruct's config.json, checked against
transformers' Qwen2_5_VLConfig). --layers and --vision-layers shorten the two stacks and
nothing else: every width, the vocabulary, GQA 28:4, M-RoPE [16, 24, 24], the 112 px vision
windows and the patch merger stay the 7B's. A shortened vision tower keeps the 7B's
full-attention blocks that still exist, or its last block if none does, so both kinds run.

Built so that peak memory stays far below the bf16 model's 15.4 GiB: every module is
created on the meta device (no storage), then materialised one unit at a time (a decoder
layer, a vision block, the embeddings, ...) with transformers' own initialisation, in bf16;
each language-model decoder layer is quantised to NF4 (lora.quant, the trainer's choices:
vision tower, embeddings and lm_head kept in bf16) before the next one exists. Then rank-8
LoRA on q, k, v, o, gate, up, down of every decoder layer and gradient checkpointing: the
``qwen7b`` preset's model. Resident at the end: ~3.3 GiB NF4 codes + statistics, 2 x 1.0 GiB
embeddings / lm_head, 1.3 GiB vision tower, 77 MiB LoRA.

Then ONE GRPO step, the trainer's own (grpo/step.py ``grpo_step``, timed through its hooks
by bench/step.py ``run_step``; the plain rollout the trainer uses on a CPU): a synthetic
448 px prompt (32 x 32 patches: 16 windows of 112 px in the windowed vision blocks, one
1024-patch sequence in the full-attention ones), G completions, rewards, policy log-probs
with grad, the GRPO loss, backward into the LoRA parameters and the clip, AdamW. Per stage:
seconds and the process's peak RSS during the stage (the kernel's high-water mark, reset
before each stage where Linux allows). The vision blocks report the attention segments
they actually ran over.

Counts checked against the 7B's: 8,292,166,656 base parameters (its safetensors total, the
"8.29B" on the model card) and 20,185,088 LoRA parameters (r = 8: 8 x (in + out) per
projection, 196 projections); a shortened model is checked against the same formula at
its depth. A mismatch exits 1 after the step.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from contextlib import contextmanager

import torch

from bench.step import QWEN7B_TEXT, QWEN7B_VISION, Stages, WrappedBundle

KNOWN_7B_PARAMETERS = 8_292_166_656  # Qwen2.5-VL-7B-Instruct's safetensors total
KNOWN_7B_LORA_R8 = 20_185_088  # r=8 on the 7 projections of its 28 layers


# ----------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident set size now."""
    kib = _status_kib("VmRSS")
    return 1024 * kib if kib is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark (since the last reset_peak_rss that worked)."""
    kib = _status_kib("VmHWM")
    return 1024 * (kib if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current RSS (Linux >= 4.0: clear_refs "5")."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RSSStages(Stages):
    """Stages whose peak column is the process's peak RSS during the stage.

    Where the high-water mark cannot be reset, the column is the peak so far (monotone)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.resettable = True  # False once a reset of the high-water mark failed

    def reset_peak(self) -> None:
        self.resettable = reset_peak_rss() and self.resettable

    def read_peak(self) -> int:
        return peak_rss_bytes()

    def add(self, name: str, ms: float, peak: int | None) -> None:
        super().add(name, ms, peak)
        # progress: a run stopped by a time limit still leaves its per-stage figures so far
        print(f"#   {name.strip()}: {ms / 1e3:.1f} s, peak RSS {self.rows[name][1] / 2**30:.2f} GiB", flush=True)


# ----------------------------------------------------------------------------- config and counts


def qwen7b_config(layers: int, vision_layers: int, tokenizer):
    """The 7B's Qwen2_5_VLConfig with the two stacks cut to ``layers`` / ``vision_layers``."""
    from transformers import Qwen2_5_VLConfig

    full = [i for i in QWEN7B_VISION["fullatt_block_indexes"] if i < vision_layers] or [vision_layers - 1]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>",
                                                           "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    return Qwen2_5_VLConfig(
        text_config=dict(QWEN7B_TEXT, num_hidden_layers=layers, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(QWEN7B_VISION, depth=vision_layers, fullatt_block_indexes=full),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)


def expected_counts(cfg, r: int = 8) -> tuple[int, int]:
    """(base parameters, LoRA parameters at rank r) of a Qwen2.5-VL config, by formula.

    Language model: embeddings + lm_head (V x H each, untied); per layer q/k/v with bias,
    o without, gate/up/down, two RMSNorms; a final norm. Vision: a bias-free Conv3d patch
    embedding; per block two RMSNorms, fused qkv and proj with bias, gate/up/down with
    bias; the merger's RMSNorm and two biased linears over 2x2 merged patches."""
    t, v = cfg.text_config, cfg.vision_config
    H, I, V = t.hidden_size, t.intermediate_size, t.vocab_size  # noqa: E741 (the formula's I: intermediate size)
    kv = t.num_key_value_heads * (H // t.num_attention_heads)
    layer = (H * H + H) + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H
    text = 2 * V * H + t.num_hidden_layers * layer + H
    h, vi, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * vi + vi) + (vi * h + h)
    patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * h
    vision = patch + v.depth * block + h + (m * m + m) + (m * v.out_hidden_size + v.out_hidden_size)
    lora = t.num_hidden_layers * r * (2 * (H + H) + 2 * (H + kv) + 3 * (H + I))
    return text + vision, lora


# ----------------------------------------------------------------------------- building


def _units(model) -> list[tuple[str, torch.nn.Module, bool]]:
    """(name, module, recurse) in module order: each decoder layer and vision block whole,
    every other module with only its own parameters and buffers."""
    stacks = {"model.language_model.layers", "model.visual.blocks"}
    units, inside = [], ()
    for name, mod in model.named_modules():
        if inside and any(name.startswith(p + ".") for p in inside):
            continue
        parent = name.rpartition(".")[0]
        if parent in stacks:
            units.append((name, mod, True))
            inside = (*inside, name)
        elif any(True for _ in mod.parameters(recurse=False)) or any(True for _ in mod.buffers(recurse=False)):
            units.append((name, mod, False))
    return units


def build_meta_nf4(cfg, log=print, seed: int = 0):
    """Random Qwen2.5-VL of ``cfg``: meta first, then one unit at a time in bf16, each
    language-model decoder layer quantised to NF4 before the next is materialised.
    Returns (model, seconds materialising, seconds quantising)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from lora import quantize_model_4bit

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(default)
    torch.manual_seed(seed)
    init_s = quant_s = 0.0
    units = _units(model)
    n_layers = cfg.text_config.num_hidden_layers
    for name, unit, recurse in units:
        t0 = time.perf_counter()
        unit.to_empty(device="cpu", recurse=recurse)
        for mod in unit.modules() if recurse else (unit,):
            model._init_weights(mod)  # the class's own init: normal(0.02) linears, ones norms, rope tables
        init_s += time.perf_counter() - t0
        if name.startswith("model.language_model.layers."):
            t0 = time.perf_counter()
            quantize_model_4bit(unit, skip_modules=(), compute_dtype=torch.bfloat16, verbose=False)
            gc.collect()  # the bf16 weights just replaced: give their pages back before the next layer
            quant_s += time.perf_counter() - t0
            i = int(name.rsplit(".", 1)[1])
            if i == 0 or (i + 1) % 7 == 0 or i + 1 == n_layers:
                log(f"#   LM layer {i + 1}/{n_layers} in NF4: RSS {rss_bytes() / 2**30:.2f} GiB, "
                    f"{init_s + quant_s:.0f} s so far", flush=True)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensors still on the meta device after materialising, e.g. {left[0]}")
    return model, init_s, quant_s


def build_bundle(layers: int, vision_layers: int, image_px: int, checkpointing: bool, log=print):
    """Bundle of the 7B-shaped NF4 + LoRA model with the tiny tokenizer; and build facts."""
    from grpo.model.load import load_bundle
    from grpo.model.tiny import tiny_image_processor
    from lora import enable_gradient_checkpointing, inject_lora

    tok = load_bundle("tiny").tokenizer  # its special-token ids; other ids decode modulo its size
    cfg = qwen7b_config(layers, vision_layers, tok)
    model, init_s, quant_s = build_meta_nf4(cfg, log)
    t0 = time.perf_counter()
    count = inject_lora(model, verbose=False)  # LoRAConfig(): r=8, alpha=8 on the 7 projections
    if checkpointing:
        enable_gradient_checkpointing(model)
    model.eval()
    lora_s = time.perf_counter() - t0
    bundle = WrappedBundle(model=model, tokenizer=tok, image_processor=tiny_image_processor(image_px),
                           source=f"qwen7b-shapes-{layers}x{vision_layers}")
    return bundle, dict(config=cfg, count=count, init_s=init_s, quant_s=quant_s, lora_s=lora_s)


@contextmanager
def record_vision_attention(model):
    """Yields {block index: (segments, longest segment)} of the first image each vision
    block attends over: windows in the windowed blocks, whole images in the full ones."""
    seen: dict[int, tuple[int, int]] = {}
    handles = []
    for i, blk in enumerate(model.model.visual.blocks):
        def hook(_mod, _args, kwargs, i=i):
            cu = kwargs.get("cu_seqlens")
            if cu is not None and i not in seen:
                lengths = cu.diff()
                seen[i] = (int(lengths.numel()), int(lengths.max()))
        handles.append(blk.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.qwen7b_cpu", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=QWEN7B_TEXT["num_hidden_layers"],
                   help="language-model decoder layers (the 7B: 28)")
    p.add_argument("--vision-layers", type=int, default=QWEN7B_VISION["depth"], help="vision blocks (the 7B: 32)")
    p.add_argument("--smoke", action="store_true", help="= --layers 1 --vision-layers 2 --max-new-tokens 2")
    p.add_argument("--G", type=int, default=2, help="completions of the one prompt")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--image-px", type=int, default=448, help="image side (448 -> 32x32 patches)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 adds the reference pass)")
    p.add_argument("--cap", type=float, default=3.0,
                   help="rollout-correction cap C of the loss (the step's correction: sequence level)")
    p.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.vision_layers, args.max_new_tokens = 1, 2, 2
    for flag, value, low in (("--layers", args.layers, 1), ("--vision-layers", args.vision_layers, 1),
                             ("--G", args.G, 2), ("--max-new-tokens", args.max_new_tokens, 1),
                             ("--image-px", args.image_px, 56)):
        if value < low:
            p.exit(2, f"error: {flag} {value}: must be >= {low}\n")  # a wrong request: one line, exit 2
    if args.image_px % 28:
        p.exit(2, f"error: --image-px {args.image_px}: must be a multiple of 28 (14 px patches merged 2x2)\n")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from bench._timing import fmt_bytes, print_table
    from bench.step import run_step, step_config
    from data.synthetic import generate
    from lora import lora_parameters

    full = (args.layers, args.vision_layers) == (QWEN7B_TEXT["num_hidden_layers"], QWEN7B_VISION["depth"])
    shape = "the full 7B" if full else f"the 7B's widths, {args.layers} LM + {args.vision_layers} vision layers"
    print(f"# one GRPO step at Qwen2.5-VL-7B's shapes on the CPU ({torch.get_num_threads()} thread(s)): {shape}; "
          f"NF4 + LoRA r=8, 1 prompt x G={args.G}, {args.max_new_tokens} new tokens, {args.image_px} px image, "
          f"beta={args.beta}, gradient checkpointing {'off' if args.no_checkpointing else 'on'}", flush=True)
    t0 = time.perf_counter()
    reset_peak_rss()
    bundle, facts = build_bundle(args.layers, args.vision_layers, args.image_px, not args.no_checkpointing)
    build_s, build_peak = time.perf_counter() - t0, peak_rss_bytes()
    model, cfg = bundle.model, facts["config"]
    base = facts["count"].total - facts["count"].trainable
    want_base, want_lora = expected_counts(cfg)
    print(f"# built in {build_s:.0f} s (materialise {facts['init_s']:.0f} s, NF4 {facts['quant_s']:.0f} s, "
          f"LoRA {facts['lora_s']:.1f} s); RSS {fmt_bytes(rss_bytes())}, peak while building "
          f"{fmt_bytes(build_peak)}", flush=True)
    checks = [("base parameters", base, want_base), ("LoRA parameters", facts["count"].trainable, want_lora),
              ("LoRA layers", len(lora_parameters(model)) // 2, 7 * args.layers)]
    if full:
        checks += [("base = the 7B's published total", base, KNOWN_7B_PARAMETERS),
                   ("LoRA = the 7B's r=8 figure", facts["count"].trainable, KNOWN_7B_LORA_R8)]
    print_table([{"count": name, "built": f"{got:,}", "expected": f"{want:,}", "ok": "yes" if got == want else "NO"}
                 for name, got, want in checks], ["count", "built", "expected", "ok"])
    names = sorted({n.rsplit(".", 1)[1] for n, _ in model.named_modules() if n.endswith(("_proj",))
                    and ".language_model." in n and hasattr(model.get_submodule(n), "lora_A")})
    print(f"# LoRA targets: {', '.join(names)} (e.g. {next(n for n, m in model.named_modules() if hasattr(m, 'lora_A'))})")

    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-5)
    # the trainer's default log-prob path, the shared prefix (bench.step --prefix compares)
    cfg_step = step_config(1, args.G, args.max_new_tokens, args.beta, args.cap, shared_prefix=True)
    examples = generate("train", 1, 1, seed=0, image_size=args.image_px)
    stages = RSSStages(torch.device("cpu"))
    # Which LoRA tensors backward reached, and the gradient's size. On random weights the G
    # rewards usually tie (zero advantage), and then the gradient is exactly 0: reaching
    # every adapter is the structural fact; tests/test_qwen7b_shapes.py makes the rewards
    # differ and checks that every adapter then moves.
    grad_sq: dict[int, float] = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: grad_sq.__setitem__(i, float(p.grad.float().square().sum())))
             for i, p in enumerate(lora_parameters(model))]
    t0 = time.perf_counter()
    try:
        with record_vision_attention(model) as attention:
            _, facts_step = run_step(bundle, cfg_step, examples, stages, opt)
    finally:
        for h in hooks:
            h.remove()
    step_s = time.perf_counter() - t0
    n_lora = len(lora_parameters(model))
    moved_B = sum(int(grad_sq.get(i, 0.0) > 0) for i in range(1, n_lora, 2))  # lora_parameters: A, B per layer
    peak_col = "peak RSS" if stages.resettable else "peak RSS so far"
    rows = [{"stage": name, "s": f"{ms / 1e3:.1f}", peak_col: fmt_bytes(peak)} for name, (ms, peak) in stages.rows.items()]
    total = sum(ms for name, (ms, _) in stages.rows.items() if not name.startswith("  ")) / 1e3
    rows.append({"stage": "step total", "s": f"{total:.1f}", peak_col: fmt_bytes(max(pk for _, pk in stages.rows.values()))})
    print_table(rows, ["stage", "s", peak_col])
    windowed = {i: s for i, s in attention.items() if i not in cfg.vision_config.fullatt_block_indexes}
    fullatt = {i: s for i, s in attention.items() if i in cfg.vision_config.fullatt_block_indexes}
    for kind, seen in (("windowed", windowed), ("full-attention", fullatt)):
        if seen:
            segs = sorted(set(seen.values()))
            print(f"# vision {kind} blocks {sorted(seen)}: "
                  + "; ".join(f"{n} segment(s), longest {m} patches" for n, m in segs))
    print(f"# {facts_step['N']} completions x {facts_step['steps']} tokens after a {facts_step['P']}-token prompt; "
          f"gradient reached {len(grad_sq)}/{n_lora} LoRA tensors, nonzero on {moved_B}/{n_lora // 2} B matrices "
          f"(A's is 0 while B = 0), norm {sum(grad_sq.values()) ** 0.5:.3g}")
    stage_peak = max(pk for _, pk in stages.rows.values())
    peak = max(build_peak, stage_peak) if stages.resettable else peak_rss_bytes()
    ok = all(got == want for _, got, want in checks) and len(grad_sq) == n_lora
    print(f"summary: GRPO step at {shape} on the CPU: step {total:.1f} s ({step_s:.1f} s with the separate "
          f"prefill), build {build_s:.0f} s; peak RSS {fmt_bytes(peak)}; "
          f"{base:,} base + {facts['count'].trainable:,} LoRA parameters; counts {'match' if ok else 'DO NOT match'}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
