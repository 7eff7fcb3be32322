"""Benchmark: one full GRPO step at Qwen2.5-VL-7B's shapes, stage by stage.

    python -m bench.step                         # GPU: 7B shapes, NF4 + rank-8 LoRA, 8 prompts x G=8, 256 tokens
    python -m bench.step --rollout merged        # only the merged-bf16 rollout path (default: both)
    python -m bench.step                         # on a CPU: a scaled-down config (it says so), < 2 min on 2 cores
    python -m bench.step --smoke                 # seconds: the smallest config, for tests
    python -m bench.step --scale tiny --beta 0   # the embedded default's GRPO phases: tiny model, 4 x G=8, 48 tokens
    python -m bench.step --scale 7b-widths --rollout plain   # CPU: the 7B's text widths, 1 layer, 1 x G=8, 256 tokens
    python -m bench.step --prefix shared         # only the shared-prefix log-prob passes (default: both, alternated)

``--scale tiny`` is the trainer's own policy of the embedded default instead (grpo/model/policy.py
build_policy with the tiny preset: the embedded model, NF4 base, rank-8 LoRA, fp32 compute)
at the GRPO phases' shape, random weights (no warm-up checkpoint), so every row decodes
the full budget.

Rollout mismatch table: the sampler's per-token log-probs (SampleOutput.logprobs) against
the trainer's, as the trainer logs them every step (grpo_kernels/grpo_loss.py's is_* stats):
the k3 estimate of KL(sampler || trainer) per token, the mean and max token ratio
pi_train / pi_sampler, the sequence ratios' max, and the fraction of sequences above
--cap (what the sequence-level mask would drop).

The other scales: a randomly initialised Qwen2_5_VLForConditionalGeneration built from the 7B's
config (numbers below, from Qwen/Qwen2.5-VL-7B-Instruct's config.json): speed does not
depend on weight values, so no hub is needed. It is instantiated directly on the GPU in
bf16 (16.6 GB, no CPU copy), quantised to NF4 (vision tower and lm_head kept in bf16, as
the trainer does), given rank-8 LoRA on the 7 projections of every LM layer and gradient
checkpointing: the ``qwen7b`` training preset. Prompts are synthetic curriculum examples at
448 px (1024 patches -> 256 visual tokens). The tokenizer is the embedded tiny one; ids it
does not know are decoded modulo its size, so rewards see text of realistic length.

``--scale 7b-widths``: the 7B's decoder widths (hidden 3584, MLP 18944, 28 / 4 heads, M-RoPE)
with ``--layers`` decoder layers (default 1), a 1-block vision tower at 448 px (256 visual
tokens), 1 prompt x G = 8, 256 new tokens, fp32 compute over NF4, checkpointing on: the
preset's prompt and completion lengths through the 7B's layer, on a CPU. Its vocabulary is
8,192, not 152,064: the LM head is the same work on both log-prob paths, and at one layer
the full head would outweigh the layer it is measured against (at 28 layers it is ~8% of
the pass).

Log-prob paths (``--prefix``): the shared-prefix pass (each prompt once per group,
grpo/model/shared_prefix.py) and the full-row pass (the prompt in all G rows), each one
real step's training passes (the reference pass, the policy pass, the loss, backward and
AdamW) on the same rollouts: the first path's step samples them, the second's reuses them
(the paths' order swapped each step). "saved" is what autograd keeps for backward during
the policy pass (saved-tensor hooks, each storage once). The step total counts every
log-prob path that ran.

One step is the trainer's own: grpo/step.py ``grpo_step`` with a ``Learner`` on phase A's
config at the scale's sizes (one pass: no micro-batches, mu = 1, no accumulation; beta,
the sequence-level rollout correction at --cap, AdamW at lr 1e-5, gradient clip 1), timed
through its ``Hooks`` stage by stage (CUDA-synchronised; peak memory = the CUDA allocator's
peak during the stage, above nothing). A stage inside another is counted apart: the outer
stage's time leaves it out.

    prompts    image preprocessing + tokenisation (CPU)
    sampling   prefill once per prompt + decode B*G rows (one row per table line per path)
    rewards    verifier components on the decoded texts
    ref logp   reference log-probs, LoRA off, no grad (only with --beta > 0)
    logp       policy log-probs with grad (vision features reused)
    loss       the GRPO loss (fused Triton kernel on CUDA)
    backward   into the LoRA parameters (gradient checkpointing recomputes the layers), and
               the gradient clip
    optimizer  AdamW (+ refreshing the merged copy on the merged path)

The step's hooks see the ``Hooks.timed`` sections (sampling, rewards, logprobs, backward)
and the optimiser step; the prompt encoding, the reference pass and the loss are timed by
wrapping the names grpo/step.py calls them by, for the step's duration. The advantages
(microseconds) sit in no stage.

Decode table: tokens/s of the decode loop (sampling minus a separately timed prefill)
against the bandwidth bound: every step must read the LM weights once (NF4 packed codes +
quant state for the plain path, bf16 merged weights for the merged path, lm_head bf16 in
both) plus the KV cache so far; bound = rows / (bytes per step / peak bandwidth). Random
weights rarely emit a stop token, so every row decodes the full budget: an upper bound on
a real step's decode time.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from bench._timing import device_name, fmt, fmt_bytes, peak_bandwidth, print_table
from grpo.model.load import ModelBundle
from grpo.step import Hooks

# Qwen2.5-VL-7B-Instruct (config.json): text decoder and vision tower.
QWEN7B_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                   hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False)
QWEN7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                     fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
# Scaled down for a 2-core CPU: same structure (GQA 4:1, M-RoPE, windowed + full vision blocks).
CPU_TEXT = dict(QWEN7B_TEXT, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]})
CPU_VISION = dict(QWEN7B_VISION, depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256,
                  fullatt_block_indexes=[1])
SMOKE_TEXT = dict(CPU_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=1024)
SMOKE_VISION = dict(CPU_VISION, depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    fullatt_block_indexes=[0])
SCALES = {  # name -> (text, vision, dtype, B, G, max_new_tokens, image px)
    "tiny": (None, None, torch.float32, 4, 8, 48, 112),  # the trainer's own tiny policy (see build_bundle)
    "7b": (QWEN7B_TEXT, QWEN7B_VISION, torch.bfloat16, 8, 8, 256, 448),
    "cpu": (CPU_TEXT, CPU_VISION, torch.float32, 2, 4, 32, 112),
    "smoke": (SMOKE_TEXT, SMOKE_VISION, torch.float32, 1, 2, 4, 56),
    "7b-widths": (dict(QWEN7B_TEXT, num_hidden_layers=1, vocab_size=8192),
                  dict(QWEN7B_VISION, depth=1, fullatt_block_indexes=[0]), torch.float32, 1, 8, 256, 448),
}


@dataclass
class WrappedBundle(ModelBundle):
    """The tiny tokenizer on a bigger vocabulary: unknown ids decode modulo its size."""

    def decode(self, ids) -> str:
        n = len(self.tokenizer)
        return super().decode([int(i) % n for i in ids])


# ----------------------------------------------------------------------------- building the model


def build_bundle(scale: str, device: str, four_bit: bool, checkpointing: bool, layers: int = 0,
                 custom: tuple | None = None) -> WrappedBundle:
    """Random Qwen2.5-VL of the scale's config, built on ``device`` in its dtype, NF4 + LoRA;
    scale "tiny": the trainer's policy of the embedded default (its preset and LoRA).
    ``custom``: (text config, vision config, dtype, image px) instead of the scale's."""
    if scale == "tiny":
        from grpo.cli import phase_config
        from grpo.model.policy import build_policy

        cfg = phase_config("A", "tiny", {"model.load_in_4bit": str(four_bit).lower()}, "A")
        b = build_policy(cfg, device, verbose=False)
        return WrappedBundle(model=b.model, tokenizer=b.tokenizer, image_processor=b.image_processor, source="tiny")
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from grpo.model.load import load_bundle
    from grpo.model.tiny import tiny_image_processor
    from lora import LoRAConfig, enable_gradient_checkpointing, inject_lora, quantize_model_4bit

    text, vision, dtype, *_, image_px = custom or SCALES[scale]
    text = dict(text, num_hidden_layers=layers or text["num_hidden_layers"])
    tiny = load_bundle("tiny")  # tokenizer and special-token ids only
    tok = tiny.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>",
                                                     "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(text, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(vision), image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in bf16 directly: no fp32 copy of 8B params
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    if four_bit:
        quantize_model_4bit(model, compute_dtype=dtype, device=device, verbose=False)
    inject_lora(model, LoRAConfig(r=8, alpha=8.0), verbose=False)
    model.to(device)
    if checkpointing:
        enable_gradient_checkpointing(model)
    model.eval()
    return WrappedBundle(model=model, tokenizer=tok, image_processor=tiny_image_processor(image_px), source=scale)


# ----------------------------------------------------------------------------- timing helpers


class Stages:
    """Wall time and peak memory per named stage (CUDA: the allocator's peak; elsewhere none).
    A stage opened inside another is counted apart: the outer one's time leaves it out, its
    peak takes it in."""

    def __init__(self, device: torch.device):
        self.device, self.rows = device, {}
        self._open: list[list] = []  # per open stage: [start, its inner stages' ms, its peak so far]

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read_peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def add(self, name: str, ms: float, peak: int | None) -> None:
        old = self.rows.get(name, (0.0, None))
        self.rows[name] = (old[0] + ms, peak if old[1] is None else max(old[1], peak or 0))

    @contextmanager
    def __call__(self, name: str):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        if self._open:  # the enclosing stage's peak so far, before this one resets it
            self._open[-1][2] = _larger(self._open[-1][2], self.read_peak())
        self.reset_peak()
        frame = [time.perf_counter(), 0.0, None]
        self._open.append(frame)
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            self._open.pop()
            ms, peak = 1e3 * (time.perf_counter() - frame[0]), _larger(frame[2], self.read_peak())
            if self._open:
                self._open[-1][1] += ms
            self.add(name, ms - frame[1], peak)

    @staticmethod
    def median(runs: list[Stages]) -> Stages:
        """Per stage: the median time and the largest peak over repeated steps."""
        out = Stages(runs[0].device)
        for name in runs[0].rows:
            peaks = [r.rows[name][1] for r in runs if r.rows[name][1] is not None]
            out.rows[name] = (statistics.median(r.rows[name][0] for r in runs), max(peaks) if peaks else None)
        return out


def _larger(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def lm_weight_bytes(model, merged=None) -> int:
    """Bytes of LM weights one decode step must read: the 7 projections x layers + lm_head."""
    from lora.quant import memory_report

    head = model.lm_head.weight
    head_bytes = head.numel() * head.element_size()
    if merged is not None:
        return merged.nbytes + head_bytes
    lm = model.model.language_model
    rep = memory_report(lm)  # packed NF4 codes + quant state (+ LoRA, norms, embeddings)
    embed = lm.embed_tokens.weight
    return rep.total - embed.numel() * embed.element_size() + head_bytes  # a step reads N embedding rows, not the table


def kv_bytes_per_step(model, N: int, P: int, T: int) -> float:
    """Mean KV-cache bytes read per decode step over T steps after a P-token prompt."""
    c = model.config.text_config
    D = c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * D * model.dtype.itemsize
    return N * per_token * (P + T / 2)


# ----------------------------------------------------------------------------- one step


def step_config(B: int, G: int, max_new_tokens: int, beta: float, cap: float, shared_prefix: bool = True):
    """The trainer's config of the timed step: phase A's preset at these sizes, one pass over
    the rollout batch (no micro-batches, mu = 1, no accumulation), the sequence-level rollout
    correction capped at ``cap``, AdamW at lr 1e-5 without warm-up, the gradient clipped at 1."""
    from grpo.presets import phase_preset

    cfg = phase_preset("A")
    cfg.phase.prompts_per_step, cfg.sampling.G, cfg.sampling.max_new_tokens = B, G, max_new_tokens
    cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.top_p = 1.0, 0, 1.0
    o = cfg.optim
    o.beta, o.lr, o.warmup_steps, o.grad_clip = beta, 1e-5, 0, 1.0
    o.rollout_correction, o.rollout_correction_cap = "sequence", cap
    o.shared_prefix, o.micro_batch_rows, o.updates_per_batch, o.accumulation = shared_prefix, 0, 1, 1
    return cfg


class StageHooks(Hooks):
    """grpo_step's timing sections as the benchmark's stages (``tag`` names the log-prob path
    of the training ones); the optimiser step as its own, with the merged copy's refresh; the
    bytes autograd saves during the policy pass."""

    def __init__(self, stages: Stages, tag: str = "", merged=None):
        self.stages, self.tag, self.merged, self.saved = stages, tag, merged, {}

    @contextmanager
    def timed(self, part: str):
        if part != "logprobs":
            with self.stages(f"{part}{self.tag}" if part == "backward" else part):
                yield
            return

        def pack(t):  # what backward will read: each storage counted once
            self.saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with self.stages(f"logp (grad){self.tag}"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def optimizer_step(self, opt: torch.optim.Optimizer, update: int, loss: float) -> bool:
        with self.stages(f"optimizer{self.tag}"):
            opt.step()
            if self.merged is not None:
                self.merged.refresh()
        return True


@contextmanager
def _replaced(module, **names):
    """``module``'s globals ``names`` replaced while the block runs."""
    old = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def run_step(bundle, cfg, examples: list, stages: Stages, opt: torch.optim.Optimizer, *, merged=None,
             tag: str = "", reuse=None):
    """ONE grpo.step.grpo_step on ``bundle`` with ``cfg``, timed into ``stages``: it samples
    and scores ``examples`` (the merged copy's sampler when ``merged`` is given), or trains on
    the Rollout ``reuse`` without sampling. Returns (the Rollout, the decode and mismatch facts)."""
    import grpo.step as step
    from grpo.model.prompt_context import build_prompt_context
    from grpo.rewards import RewardModel
    from grpo.rollout.sampler import prefill, sample

    model, device = bundle.model, bundle.device
    hooks = StageHooks(stages, tag, merged)
    rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
    learner = step.Learner(bundle, opt, rewards, cfg, torch.Generator(device=device).manual_seed(0),
                           rollout=sample if merged is None else merged.sample)
    encode, reference, loss = step.encode_prompts, step.reference_logprobs, step.grpo_loss
    drawn, losses = [], []

    def draw(n: int):
        if reuse is not None:
            drawn.append(reuse)
            return reuse
        with torch.no_grad():  # the prefill alone, for the decode table (sampling minus it)
            prompts = encode(bundle, examples[:n]).to(device)
            with stages("  (prefill alone)"):
                prefill(model, build_prompt_context(model, prompts))
        drawn.append(step.sample_and_score(learner, examples[:n], cfg.sampling.temperature, hooks))
        return drawn[-1]

    def encode_prompts(*args, **kwargs):
        with stages("prompts"):
            return encode(*args, **kwargs)

    def reference_logprobs(*args, **kwargs):
        with stages(f"ref logp (no grad){tag}"):
            return reference(*args, **kwargs)

    def grpo_loss(logp, mask, adv, **kwargs):
        with stages(f"loss{tag}"):
            out = loss(logp, mask, adv, **kwargs)
        losses.append((logp.detach(), mask, adv, kwargs["sampler_logp"]))
        return out

    with _replaced(step, encode_prompts=encode_prompts, reference_logprobs=reference_logprobs, grpo_loss=grpo_loss):
        result = step.grpo_step(learner, draw, 0, cfg.sampling.temperature, hooks)
    r, (logp, mask, adv, sampler) = drawn[0], losses[-1]  # the last loss call: the whole rollout batch
    with torch.no_grad():  # token ratios (the step's stats are at the correction's sequence level)
        _, tok = loss(logp, mask, adv, sampler_logp=sampler)
        seq_ratio = torch.exp(((logp - sampler) * mask).sum(1))
    ids = r.out.completion_ids
    return r, dict(N=ids.shape[0], steps=ids.shape[1], P=r.out.context.P, kl=float(tok.is_kl),
                   ratio_mean=float(tok.is_ratio_mean), ratio_max=float(tok.is_ratio_max),
                   seq_ratio_max=float(seq_ratio.max()), seq_over=float(result.logs[0].stats.is_over_frac),
                   saved=sum(hooks.saved.values()))


def timed_paths(bundle, examples: list, args, prefixes: list[str], merged, stages: Stages) -> dict:
    """One step per log-prob path in ``prefixes`` on the same rollouts (the first one samples
    them): the first path's facts; each path's saved bytes go to args.saved."""
    reuse, facts = None, None
    for prefix in prefixes:
        tag = f" [{prefix}]" if len(args.prefix_paths) > 1 else ""
        cfg = step_config(args.B, args.G, args.max_new_tokens, args.beta, args.cap, prefix == "shared")
        reuse, f = run_step(bundle, cfg, examples, stages, args.opt, merged=merged, tag=tag, reuse=reuse)
        args.saved[prefix], facts = f["saved"], facts or f
    return facts


def prefix_summary(results: dict, paths: list[str], args) -> None:
    """The training passes (log-probs + loss + backward + AdamW) of each log-prob path, and the ratios."""
    parts = ("ref logp (no grad)", "logp (grad)", "loss", "backward", "optimizer")
    for path in paths:
        st = results[path][0].rows
        tag = (lambda p: f" [{p}]") if len(args.prefix_paths) > 1 else (lambda p: "")
        train = {p: sum(st[f"{n}{tag(p)}"][0] for n in parts if f"{n}{tag(p)}" in st) for p in args.prefix_paths}
        logp = {p: st[f"logp (grad){tag(p)}"][0] for p in args.prefix_paths}
        line = "; ".join(f"{p}: training passes {train[p]:.1f} ms, policy pass {logp[p]:.1f} ms, "
                         f"saved {fmt_bytes(args.saved[p])}" for p in args.prefix_paths)
        if len(args.prefix_paths) == 2:
            line += (f"; full/shared: training passes {train['full'] / train['shared']:.2f}x; shared vs full: policy "
                     f"pass time {100 * (logp['shared'] / logp['full'] - 1):+.0f}%, saved "
                     f"{100 * (args.saved['shared'] / args.saved['full'] - 1):+.0f}%")
        print(f"# log-prob paths ({path} rollouts): {line}")


def main(argv: list[str] | None = None) -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.step", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=sorted(SCALES), default=None, help="default: 7b on CUDA, cpu otherwise")
    p.add_argument("--smoke", action="store_true", help="= --scale smoke (seconds)")
    p.add_argument("--rollout", choices=["plain", "merged", "both"], default="both")
    p.add_argument("--prefix", choices=["shared", "full", "both"], default="both",
                   help="log-prob passes: the prompt once per group (shared), in every row (full), or both alternated")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: the scale's; not for --scale tiny)")
    p.add_argument("--B", type=int, default=None, help="prompts per step (default: the scale's)")
    p.add_argument("--G", type=int, default=None, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0 adds the reference pass)")
    p.add_argument("--no-4bit", action="store_true", help="keep the base in the compute dtype")
    p.add_argument("--repeats", type=int, default=1, help="timed steps per path; per-stage medians are shown")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--cap", type=float, default=3.0, help="rollout correction cap C of the mismatch table")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = "smoke" if args.smoke else args.scale or ("7b" if device.type == "cuda" else "cpu")
    _, _, dtype, B, G, T, image_px = SCALES[scale]
    args.B, args.G, args.max_new_tokens = args.B or B, args.G or G, args.max_new_tokens or T
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.cap <= 1:
        raise SystemExit(f"--cap {args.cap}: must be > 1 (the largest pi_train / pi_sampler ratio kept)")
    args.prefix_paths = ["shared", "full"] if args.prefix == "both" else [args.prefix]
    args.saved = {}
    if scale == "7b" and device.type != "cuda":
        raise SystemExit("--scale 7b needs a CUDA GPU (~40 GB); on a CPU use the default scaled-down config, "
                         "or python -m bench.qwen7b_cpu for one step at the 7B's exact shapes (NF4, layer by layer)")

    from data.synthetic import generate
    from grpo.rollout.merged import MergedRollout
    from lora import count_parameters, lora_parameters

    print(f"# one GRPO step on {device_name(device)}: scale {scale}"
          + ("" if scale == "7b" else " (SCALED DOWN: not the 7B's shapes)")
          + f", {dtype}, {'NF4 + ' if not args.no_4bit else ''}LoRA r=8, B={args.B} prompts x G={args.G}, "
          f"{args.max_new_tokens} new tokens, {image_px} px images, beta={args.beta}, "
          f"median of {args.repeats} step(s) per path")
    t0 = time.perf_counter()
    bundle = build_bundle(scale, str(device), four_bit=not args.no_4bit,
                          checkpointing=device.type == "cuda" or scale == "7b-widths", layers=args.layers)
    model = bundle.model
    n_params = count_parameters(model).total  # NF4 weights counted unpacked
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    merged = MergedRollout(model) if args.rollout in ("merged", "both") else None
    merge_s = time.perf_counter() - t0
    if merged is not None:
        print(f"# merged copy dtype {merged.weights[0]['qkv'][0].dtype} (the model's compute dtype)")
    print(f"# model built in {build_s:.1f} s ({n_params / 1e6:,.1f}M parameters); merged {dtype} copy "
          + (f"{fmt_bytes(merged.nbytes)} built in {merge_s:.2f} s" if merged else "not built"))
    args.opt = torch.optim.AdamW(lora_parameters(model), lr=1e-5)
    examples = generate("train", 1, args.B, seed=0, image_size=image_px)

    # Warm-up: one small step per path (cuBLAS, bitsandbytes and Triton kernels compile/load here).
    small = argparse.Namespace(**{**vars(args), "B": 1, "G": 2, "max_new_tokens": 4, "saved": {}})
    paths = ["plain", "merged"] if args.rollout == "both" else [args.rollout]
    for path in paths:
        warm = merged if path == "merged" else None
        timed_paths(bundle, examples[:1], small, args.prefix_paths, warm, Stages(device))

    runs: dict[str, list[Stages]] = {path: [] for path in paths}
    facts: dict[str, dict] = {}
    for i in range(args.repeats):  # alternate the paths so load changes on a shared machine hit both
        for j, path in enumerate(paths):
            k = i * len(paths) + j  # the log-prob paths' order swaps every step
            prefixes = args.prefix_paths[::-1] if k % 2 else list(args.prefix_paths)
            stages = Stages(device)
            facts[path] = timed_paths(bundle, examples, args, prefixes, merged if path == "merged" else None, stages)
            runs[path].append(stages)
            total = sum(ms for name, (ms, _) in stages.rows.items() if not name.startswith("  "))
            print(f"# {path} rollouts: step {total / 1e3:.2f} s (sampling {stages.rows['sampling'][0] / 1e3:.2f} s)",
                  flush=True)  # progress, in case a time limit stops the run before the tables
    results = {path: (Stages.median(runs[path]), facts[path]) for path in paths}

    # ---- stage table: one (ms, peak memory) column pair per rollout path
    totals = {path: sum(ms for name, (ms, _) in st.rows.items() if not name.startswith("  "))
              for path, (st, _) in results.items()}
    rows = []
    for name in results[paths[0]][0].rows:
        row = {"stage": name}
        for path in paths:
            ms, peak = results[path][0].rows[name]
            row[f"{path} ms"], row[f"{path} peak"] = f"{ms:.1f}", fmt_bytes(peak)
        rows.append(row)
    rows.append({"stage": "step total", **{f"{path} ms": f"{totals[path]:.1f}" for path in paths}})
    print_table(rows, ["stage"] + [f"{path} {c}" for path in paths for c in ("ms", "peak")])
    prefix_summary(results, paths, args)

    # ---- decode table
    bw = peak_bandwidth(device)
    drows, tok_s = [], {}
    for path in paths:
        st, f = results[path]
        sample_ms = st.rows["sampling"][0]
        prefill_ms = st.rows["  (prefill alone)"][0]
        decode_s = max(1e-9, (sample_ms - prefill_ms) / 1e3)
        tokens = f["N"] * f["steps"]
        tok_s[path] = tokens / decode_s
        w = lm_weight_bytes(model, merged if path == "merged" else None)
        kv = kv_bytes_per_step(model, f["N"], f["P"], f["steps"])
        bound = f["N"] / ((w + kv) / bw) if bw else None
        drows.append({"path": path, "rows": str(f["N"]), "steps": str(f["steps"]), "decode ms": f"{decode_s * 1e3:.0f}",
                      "ms/step": f"{decode_s * 1e3 / f['steps']:.2f}", "tok/s": f"{tok_s[path]:.0f}",
                      "weights/step": fmt_bytes(w), "KV/step": fmt_bytes(int(kv)),
                      "bound tok/s": fmt(bound, ".0f"), "% of bound": fmt(100 * tok_s[path] / bound if bound else None, ".0f")})
    print()
    print_table(drows, ["path", "rows", "steps", "decode ms", "ms/step", "tok/s", "weights/step", "KV/step",
                        "bound tok/s", "% of bound"])
    print()
    print_table([{"path": path, "KL(sampler||trainer)/token": f"{f['kl']:.3g}", "mean ratio": f"{f['ratio_mean']:.6f}",
                  "max ratio": f"{f['ratio_max']:.6f}", "max seq ratio": f"{f['seq_ratio_max']:.6f}",
                  f"seqs > {args.cap:g}": f"{f['seq_over']:.3f}"} for path, (_, f) in results.items()],
                ["path", "KL(sampler||trainer)/token", "mean ratio", "max ratio", "max seq ratio", f"seqs > {args.cap:g}"])
    if device.type == "cuda":
        peak = f"peak CUDA memory {fmt_bytes(torch.cuda.max_memory_allocated(device))}"
    else:
        peak = f"peak process RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    speed = f", merged/plain decode {tok_s['merged'] / tok_s['plain']:.2f}x" if len(tok_s) == 2 else ""
    print(f"summary: GRPO step ({scale}, B={args.B} G={args.G} L={args.max_new_tokens}) on {device_name(device)}: "
          + ", ".join(f"{totals[k] / 1e3:.2f} s with {k} rollouts" for k in paths) + "; decode "
          + ", ".join(f"{k} {v:.0f} tok/s" for k, v in tok_s.items()) + f"{speed}; {peak}")


if __name__ == "__main__":
    main()
