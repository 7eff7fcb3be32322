"""The memory plan of one GRPO step, by component, and the measurements that check it.

    python -m bench.memory --preset qwen7b --sampling.G 2 --phase.prompts_per_step 1 \\
        --sampling.max_new_tokens 64 --model.image_size 336       # the staged paper's setting
    python -m bench.memory --preset qwen7b --gpu-gib 80           # does it fit, and which micro-batch would
    python -m bench.memory --preset qwen7b --measure              # + the 7B-width measurement (minutes, 1 core)
    python -m bench.memory --gpu-check                            # bench/gpu.sh: real 7B-shape steps on a GPU
    python -m bench.memory --gpu-check --smoke                    # its first setting, one 7B layer (gpu.sh's smoke)
    python -m bench.memory                                        # the tiny default: + a whole real step measured

Options: the trainer's own (``--preset``, ``--phase`` and every ``--section.key value`` of
``python -m grpo.train``, parsed by grpo/cli.py), plus this command's (``--gpu-gib``,
``--measure``, ``--device``, ``--prompt-tokens``, ``--layers``, ``--tokens``).

The prediction is grpo/run/memory_plan.py (the trainer prints the same at the start of every
GRPO phase on CUDA): resident weights, LoRA + AdamW, the merged copy, the sampler's KV cache
at its peak, one training micro-batch's activations, the logits chunks and the reference
pass, as formulas of the model's widths. The model's shapes are read off the model itself:
the tiny one is built (seconds); the 7B is built on the meta device (no storage, no
download: Qwen2.5-VL-7B-Instruct's published config, bench/step.py), so its weight bytes
are counted parameter by parameter, NF4 at lora/quant.py's 0.516 bytes per weight.

Measured, not only computed. Two instruments, both on the CPU, both running the project's
own code (grpo.step.grpo_step with a Learner, the sampler's static KV cache, the log-prob
passes, the loss, backward, AdamW):

- ``LiveBytes``: a TorchDispatchMode that sees every tensor an operator returns, counts its
  storage once (views share it) until the storage is freed (a weak reference's callback),
  and keeps the high-water mark per phase of the step (the phases are grpo_step's own
  ``Hooks.timed`` sections: sampling, logprobs, backward; the reference pass is labelled
  apart). Weights, LoRA and AdamW moments exist before and are counted from their storages.
- saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``): the bytes autograd
  keeps for backward in the language model's forward without checkpointing, per layer and
  token, against ``layer_saved_per_token``'s op-by-op count.

``--measure`` at the 7B (needs bitsandbytes; minutes on one core, < 5 GiB of RAM): Qwen2.5-VL
-7B's exact widths (hidden 3584, MLP 18944, 28 query / 4 KV heads, vocabulary 152,064, a
1280-wide vision tower cut to one block: it runs once per prompt without grad) built by
bench/qwen7b_cpu.py in NF4 + rank-8 LoRA, one real step at 1, 2 and 4 decoder layers
and two completion lengths; each phase's measured peak against the plan at the same
shapes, and the layer and token slopes: the plan's 28-layer, 256-token prediction is
those slopes extrapolated. On the tiny model (the default) the whole real step at the
requested config is measured and set against the plan with ``device="cpu"``.

Assumptions (see grpo/run/memory_plan.py): on a GPU the full-row pass's attention runs in
the memory-efficient or flash kernels (no [S, S] scores), the shared-prefix pass's (masked
grouped-query attention, which those kernels do not take) in the math kernel, its scores and
softmax kept; the log-softmax in the Triton kernel (the CPU runs the PyTorch reference: its
fp32 copies are planned with device="cpu" where compared); the peak is what
torch.cuda.max_memory_allocated reports; ``--gpu-gib`` adds the caching allocator's slack
(+10%) and 1 GiB for the CUDA context, cuBLAS workspaces and graph pools. Completions run
to the full budget; a prompt is its visual tokens + 128 text tokens unless
model.max_prompt_tokens caps it (``--prompt-tokens`` overrides).

The last line: ``peak N.N GiB (...)``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from grpo.run.memory_plan import (
    GiB,
    Plan,
    Shapes,
    largest_fitting,
    layer_saved_per_token,
    need_bytes,
    plan_step,
    prompt_tokens,
    shapes_of_model,
)

MiB = 2**20
QWEN7B = "Qwen/Qwen2.5-VL-7B-Instruct"


# ----------------------------------------------------------------------------- instruments


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created while active and still alive; the peak, per label.

    Every operator's outputs pass through ``__torch_dispatch__``; a storage not seen before
    is counted once (a view or an in-place result shares its storage) and uncounted when it
    is freed (``weakref.finalize`` on the storage, which PyTorch keeps as one Python object
    while it lives). ``known`` storages (weights, gradients, optimiser state) exist already:
    they are counted from the start, under "resident", until freed (a step frees the
    previous gradients before its backward). So ``live`` is every byte of tensor storage the
    process holds for the model and the step. ``label`` names the phase new storages are charged to; ``peaks``
    keeps, per label, the largest total seen while that label was current and the live
    bytes by label at that moment. Not seen: scratch memory an operator allocates and frees
    inside itself (e.g. a matmul's workspace), and tensors made outside PyTorch's operators.
    """

    def __init__(self, known: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.seen = WeakIdKeyDictionary()
        self.live = 0
        self.label = "other"
        self.by_label: dict[str, int] = defaultdict(int)
        self.peaks: dict[str, tuple[int, dict[str, int]]] = {}
        with self.labelled("resident"):
            for t in known:
                self._track(t, peak=False)

    def _freed(self, nbytes: int, label: str) -> None:
        self.live -= nbytes
        self.by_label[label] -= nbytes

    def _track(self, t: torch.Tensor, peak: bool = True) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st in self.seen:
            return
        n = st.nbytes()
        self.seen[st] = n
        weakref.finalize(st, self._freed, n, self.label)
        self.live += n
        self.by_label[self.label] += n
        if not peak:
            return
        best = self.peaks.get(self.label)
        if best is None or self.live > best[0]:
            self.peaks[self.label] = (self.live, dict(self.by_label))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out

    @contextlib.contextmanager
    def labelled(self, label: str):
        old, self.label = self.label, label
        try:
            yield
        finally:
            self.label = old

    def peak(self, *labels: str) -> int:
        return max((self.peaks[lb][0] for lb in labels if lb in self.peaks), default=0)


class CudaPeaks:
    """LiveBytes' interface on CUDA, read from the caching allocator itself: the peak of
    ``torch.cuda.max_memory_allocated`` per label (the statistic is read and reset at every
    label change)."""

    def __init__(self):
        self.label, self.peaks = "other", {}

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        self._close()

    def _close(self) -> None:
        torch.cuda.synchronize()
        top = torch.cuda.max_memory_allocated()
        self.peaks[self.label] = (max(top, self.peaks.get(self.label, (0, {}))[0]), {})
        torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def labelled(self, label: str):
        self._close()
        old, self.label = self.label, label
        try:
            yield
        finally:
            self._close()
            self.label = old

    def peak(self, *labels: str) -> int:
        return max((self.peaks[lb][0] for lb in labels if lb in self.peaks), default=0)


@contextlib.contextmanager
def saved_bytes(exclude: Iterable[torch.Tensor] = ()):
    """Bytes autograd saves for backward inside the block, each storage once, those of
    ``exclude`` (the weights a matmul saves) left out: yields a dict whose "bytes" grows as
    the forward runs. Tensors saved inside a checkpointed region go to the checkpoint's own
    hooks and are not seen (run it without checkpointing)."""
    seen: set[int] = {t.untyped_storage().data_ptr() for t in exclude}
    total = {"bytes": 0}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in seen and not t.is_meta:
            seen.add(key)
            total["bytes"] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def resident_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor a step starts with: parameters, their gradients, buffers, NF4 statistics, AdamW's moments."""
    out = [*model.parameters(), *model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            out += [state.absmax, state.code] + ([state.state2.absmax, state.state2.code] if state.nested else [])
    if opt is not None:
        out += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [t for t in out if not t.is_meta]


def init_adamw_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's moments now (a step at lr 0 on zero gradients) and keep the gradients,
    so a measured step is a steady-state one: moments and the previous step's gradients
    exist when it starts (grpo_step frees the gradients only before its backward)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


# ----------------------------------------------------------------------------- one real step, tracked


def measured_step(bundle, cfg, examples, *, early_stop: bool = True) -> dict[str, int]:
    """Run ONE grpo.step.grpo_step (the trainer's core) on ``bundle`` with ``cfg`` and return
    the bytes at its start ("resident": weights, LoRA, gradients, AdamW's moments) and the
    peak of every byte held during each phase ("sampling", "reference", "policy"):
    LiveBytes on a CPU, the CUDA allocator's own statistics on a GPU.

    ``early_stop``: row 0's last completion token is made a stop, as if it had finished one
    token early. A random model never stops, and a batch where no row is padded lets
    transformers drop the attention mask (and take another attention path); a real batch
    always has one."""
    import grpo.step as step_mod
    from grpo.rewards import RewardModel
    from grpo.rollout.merged import MergedRollout
    from grpo.rollout.sampler import sample
    from grpo.step import Hooks, Learner, grpo_step, sample_and_score
    from lora import lora_parameters

    model = bundle.model
    opt = torch.optim.AdamW(lora_parameters(model), lr=cfg.optim.lr)
    init_adamw_state(opt)
    rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
    merged = MergedRollout(model) if cfg.sampling.rollout == "merged" else None  # as the trainer builds it
    learner = Learner(bundle, opt, rewards, cfg, torch.Generator(device=bundle.device).manual_seed(cfg.run.seed),
                      rollout=merged.sample if merged is not None else sample)
    resident = resident_tensors(model, opt)
    if merged is not None:
        resident += [t for layer in merged.weights for pair in layer.values() for t in pair if t is not None]
    tracker = CudaPeaks() if bundle.device.type == "cuda" else LiveBytes(resident)
    resident_bytes = storage_bytes(resident)
    del resident  # held here, the previous gradients would outlive the step's zero_grad, as no real step's do

    class Labels(Hooks):  # grpo_step's own timing sections name the phases
        def timed(self, part):
            return tracker.labelled(part)

    hooks, stream = Labels(), iter(examples)
    reference = step_mod.reference_logprobs

    def labelled_reference(*args, **kwargs):
        with tracker.labelled("reference"):
            return reference(*args, **kwargs)

    def draw(n: int):
        r = sample_and_score(learner, [next(stream) for _ in range(n)], 1.0, hooks)
        if early_stop and r.out.completion_mask.shape[1] > 1 and bool(r.out.completion_mask[0, -1]):
            r.out.completion_mask[0, -1] = 0
        return r

    step_mod.reference_logprobs = labelled_reference
    try:
        with tracker:
            grpo_step(learner, draw, 0, cfg.sampling.temperature, hooks)
    finally:
        step_mod.reference_logprobs = reference
    return dict(resident=resident_bytes, sampling=tracker.peak("sampling"),
                reference=tracker.peak("reference"), policy=tracker.peak("logprobs", "backward"))


def planned_phases(plan: Plan) -> dict[str, int]:
    """The plan in measured_step's terms: resident, and each phase's peak (resident included)."""
    return dict(resident=plan.phase_bytes("resident"), **{ph: plan.phase_bytes(ph) for ph in plan.phases})


# ----------------------------------------------------------------------------- models


def config_from_argv(argv: list[str]):
    """The trainer's resolved config of the requested phase (grpo/cli.py's parsing)."""
    from grpo.cli import phase_configs
    from grpo.config_checks import PHASES
    from grpo.overrides import parse_override_args
    from grpo.presets import PRESETS

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--phase", default="A", choices=[p for p in PHASES if p != "warmup"])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    known, rest = ap.parse_known_args(argv)
    overrides = parse_override_args(rest)
    overrides.setdefault("run.run_prior_phases", "false")
    return phase_configs(known.phase, known.preset, overrides)[known.phase]


def qwen7b_on_meta(cfg):
    """Qwen2.5-VL-7B-Instruct's module tree with the config's LoRA, on the meta device."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from bench.qwen7b_cpu import qwen7b_config
    from bench.step import QWEN7B_TEXT, QWEN7B_VISION
    from grpo.model.load import load_bundle
    from grpo.model.vision import inject_vision_lora
    from lora import inject_lora

    tok = load_bundle("tiny").tokenizer  # special-token ids only
    hf = qwen7b_config(QWEN7B_TEXT["num_hidden_layers"], QWEN7B_VISION["depth"], tok)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg.model.dtype))
    try:
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(hf)
            inject_lora(model, cfg.lora.to_lora(), verbose=False)
            inject_vision_lora(model, cfg.lora, verbose=False)  # lora.vision / lora.merger (off: nothing)
    finally:
        torch.set_default_dtype(default)
    return model


def model_shapes(cfg) -> tuple[Shapes, object | None]:
    """(shapes, the built bundle or None): the tiny models are built; the 7B is read on meta."""
    if cfg.model.name in ("tiny", "tiny-random"):
        from grpo.model.policy import build_policy

        bundle = build_policy(cfg, "cpu", verbose=False)
        return shapes_of_model(bundle.model, cfg), bundle
    if cfg.model.name == QWEN7B:
        return shapes_of_model(qwen7b_on_meta(cfg), cfg), None
    raise SystemExit(f"error: --model.name {cfg.model.name}: bench.memory plans 'tiny', 'tiny-random' and {QWEN7B} "
                     "(built on the meta device, no download)")


# ----------------------------------------------------------------------------- measurements


def tiny_validation(bundle, cfg) -> list[dict]:
    """The whole real step of the tiny model at ``cfg``, measured, against the plan (CPU terms)."""
    from data.synthetic import generate

    B, acc = cfg.phase.prompts_per_step, cfg.optim.accumulation
    examples = generate("train", 1, B * acc + 8, seed=cfg.run.seed, image_size=cfg.model.image_size)
    t0 = time.perf_counter()
    got = measured_step(bundle, cfg, examples)
    secs = time.perf_counter() - t0
    P = prompt_len_of(bundle, cfg, examples[:B])
    want = planned_phases(plan_step(shapes_of_model(bundle.model, cfg), cfg, device="cpu", prompt_len=P))
    print(f"# tiny validation: one real grpo_step ({B} prompts x G={cfg.sampling.G}, {cfg.sampling.max_new_tokens} "
          f"new tokens, prompt {P} tokens) measured in {secs:.1f} s; plan with device=cpu (PyTorch log-softmax)")
    return compare_rows("tiny", got, want)


def prompt_len_of(bundle, cfg, examples) -> int:
    """The padded prompt length the sampler will see for ``examples``."""
    from grpo.model.prompts import encode_prompts

    return int(encode_prompts(bundle, examples, on_bad_image="skip").input_ids.shape[1])


def compare_rows(name: str, got: dict[str, int], want: dict[str, int]) -> list[dict]:
    rows = []
    for phase in ("resident", "sampling", "reference", "policy"):
        if phase in want or got.get(phase):
            g, w = got.get(phase, 0), want.get(phase, 0)
            rows.append({"run": name, "phase": phase, "measured MiB": f"{g / MiB:.1f}", "planned MiB": f"{w / MiB:.1f}",
                         "plan/measured": f"{w / g:.3f}" if g else "-"})
    return rows


def qwen7b_measurement(cfg, layers: list[int], tokens: list[int], image_px: int) -> list[dict]:
    """Real steps at the 7B's widths with each depth in ``layers`` and completion length in
    ``tokens`` (1 prompt x G = 2), tracked, against the plan at the same shapes; then the
    layer and token slopes, and the 4-layer point predicted from the 1- and 2-layer ones."""
    import copy

    from bench._timing import print_table
    from bench.qwen7b_cpu import build_bundle, rss_bytes
    from data.synthetic import generate
    from grpo.overrides import apply_overrides

    t0 = time.perf_counter()
    bundle, _ = build_bundle(max(layers), 1, image_px, checkpointing=cfg.model.gradient_checkpointing,
                             log=lambda *a, **k: None)
    lm = bundle.model.model.language_model
    all_layers = lm.layers
    print(f"# 7B widths, {max(layers)} NF4 + LoRA layers built in {time.perf_counter() - t0:.0f} s "
          f"(RSS {rss_bytes() / GiB:.2f} GiB)", flush=True)
    examples = generate("train", 1, 4, seed=0, image_size=image_px)
    rows, points = [], {}
    for L in layers:
        lm.layers = torch.nn.ModuleList(all_layers[:L])
        lm.config.num_hidden_layers = L
        for T in tokens:
            c = apply_overrides(copy.deepcopy(cfg), {"sampling.G": 2, "phase.prompts_per_step": 1,
                                                     "sampling.max_new_tokens": T, "optim.accumulation": 1,
                                                     "optim.micro_batch_rows": 0, "model.image_size": image_px})
            t1 = time.perf_counter()
            got = measured_step(bundle, c, examples)
            P = prompt_len_of(bundle, c, examples[:1])
            want = planned_phases(plan_step(shapes_of_model(bundle.model, c), c, device="cpu", prompt_len=P))
            points[(L, T)] = (got, want)
            rows += compare_rows(f"L={L} T={T} S={P + T}", got, want)
            print(f"#   {L} layer(s), {T} new tokens: {time.perf_counter() - t1:.0f} s", flush=True)
    lm.layers, lm.config.num_hidden_layers = all_layers, len(all_layers)
    print_table(rows, ["run", "phase", "measured MiB", "planned MiB", "plan/measured"])
    # Extrapolation: per-layer slope from 1 -> 2 layers, checked at 4; per-token slope between the two lengths.
    if {1, 2, 4} <= set(layers):
        ext = []
        for T in tokens:
            for phase in ("sampling", "policy"):
                m1, m2, m4 = (points[(L, T)][0][phase] - points[(L, T)][0]["resident"] for L in (1, 2, 4))
                slope = m2 - m1
                ext.append({"T": T, "phase": phase, "per layer MiB": f"{slope / MiB:.2f}",
                            "4 layers from 1,2 MiB": f"{(m1 + 3 * slope) / MiB:.1f}",
                            "measured 4 MiB": f"{m4 / MiB:.1f}",
                            "error": f"{(m1 + 3 * slope - m4) / m4:+.2%}"})
        print("# extrapolation in depth: each phase's peak above the resident bytes, at 4 layers from the 1- and "
              "2-layer ones (the slope is the bytes per layer)")
        print_table(ext, ["T", "phase", "per layer MiB", "4 layers from 1,2 MiB", "measured 4 MiB", "error"])
    if len(tokens) >= 2:  # extrapolation in length: bytes per added completion token, measured and planned
        t1, t2 = tokens[0], tokens[-1]
        ext = []
        for L in layers:
            for phase in ("sampling", "policy"):
                (g1, w1), (g2, w2) = ((points[(L, t)][0][phase], points[(L, t)][1][phase]) for t in (t1, t2))
                ext.append({"layers": L, "phase": phase, "measured KiB/token": f"{(g2 - g1) / (t2 - t1) / 1024:.1f}",
                            "planned KiB/token": f"{(w2 - w1) / (t2 - t1) / 1024:.1f}"})
        print(f"# extrapolation in length: bytes per completion token ({t1} -> {t2} tokens, 2 rows)")
        print_table(ext, ["layers", "phase", "measured KiB/token", "planned KiB/token"])
    per_layer, planned, n = saved_per_layer(bundle, cfg, examples, T=tokens[0])
    path = "shared-prefix" if cfg.optim.shared_prefix else "full-row"
    print(f"# saved-tensor hooks, one decoder layer without checkpointing ({path} "
          f"pass, {n} tokens through it): {per_layer:,} B measured, {planned:,} B planned ({per_layer / n:,.0f} and "
          f"{planned / n:,.0f} B per token)")
    return rows


@contextlib.contextmanager
def first_layers(model, n: int):
    """The language model cut to its first ``n`` decoder layers inside the block."""
    lm = model.model.language_model
    layers, count = lm.layers, lm.config.num_hidden_layers
    lm.layers, lm.config.num_hidden_layers = torch.nn.ModuleList(layers[:n]), n
    try:
        yield
    finally:
        lm.layers, lm.config.num_hidden_layers = layers, count


@contextlib.contextmanager
def checkpointing_off(model):
    """Every decoder layer runs plainly inside the block (autograd's saves go to our hooks)."""
    layers = list(model.model.language_model.layers)
    flags = [getattr(layer, "gradient_checkpointing", False) for layer in layers]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer, flag in zip(layers, flags):
            layer.gradient_checkpointing = flag


def saved_per_layer(bundle, cfg, examples, G: int = 2, T: int = 8) -> tuple[int, int, int]:
    """(bytes autograd saves per decoder layer, the plan's count, tokens through the layer):
    saved-tensor hooks on the policy pass the config selects (the shared-prefix pass or the
    full-row one, with grad, checkpointing off) at 1 and 2 layers; the difference is one
    layer's. Row 0 stops one token early, so the attention mask is there as in a real batch."""
    from grpo.model.logprobs import completion_hidden_states
    from grpo.model.prompt_context import build_prompt_context
    from grpo.model.prompts import encode_prompts
    from grpo.model.shared_prefix import shared_prefix_hidden_states, supports
    from grpo.run.memory_plan import attention_saved_per_token, pass_shape

    model = bundle.model
    shared = cfg.optim.shared_prefix and supports(model)
    hidden_states = shared_prefix_hidden_states if shared else completion_hidden_states
    prompts = encode_prompts(bundle, examples[:1], on_bad_image="skip").to(bundle.device)
    with torch.no_grad():
        ctx = build_prompt_context(model, prompts)
    # drawn on the CPU (the same ids on every device), then put on the model's device
    ids = torch.randint(0, len(bundle.tokenizer), (G, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(G, T, dtype=torch.long)
    mask[0, -1] = 0
    ids, mask = ids.to(bundle.device), mask.to(bundle.device)
    total, resident = {}, resident_tensors(model, None)
    for n in (1, 2):
        with first_layers(model, n), checkpointing_off(model), saved_bytes(resident) as seen:
            hidden = hidden_states(model, ctx, ids, mask, G)
        total[n] = seen["bytes"]
        del hidden
    sh = shapes_of_model(model, cfg)
    tokens, kv_rows, mask_elems, probs = pass_shape(cfg, 1, G, ctx.P, T, sh.heads)
    b = sh.compute_bytes
    planned = (tokens * layer_saved_per_token(sh, repeated_kv=not shared) + kv_rows * 2 * sh.kv_dim * b
               + mask_elems * b)  # + the attention kernel's float copy of the masks (the CPU's terms: no scores)
    if shared:  # the padding position (row 0's last) keeps only attention's part
        padding = int(ctx.attention_mask.numel() - ctx.attention_mask.sum() + mask.numel() - mask.sum())
        planned -= padding * (layer_saved_per_token(sh, repeated_kv=False) - attention_saved_per_token(sh, False))
    if sh.compute_bytes == 4 and not shared:
        # in fp32 the norms keep their inputs themselves, and the full-row pass's final norm keeps
        # the last layer's output at any depth: the 1 -> 2 layer difference lacks that one [tokens, d]
        planned -= tokens * sh.hidden * 4
    return total[2] - total[1], planned, tokens


# settings of --gpu-check: (name, trainer options on top of the qwen7b preset), in order of value
GPU_SETTINGS = [
    ("staged paper: 1 x G=2, 64 tok, 336 px", {"sampling.G": 2, "phase.prompts_per_step": 1,
                                               "sampling.max_new_tokens": 64, "model.image_size": 336}),
    ("preset 8 x G=8, 256 tok, micro 32", {"optim.micro_batch_rows": 32}),  # the preset's own
    ("preset 8 x G=8, 256 tok, one pass", {"optim.micro_batch_rows": 0}),
]
CPU_SETTINGS = [  # the same code at the tiny model's sizes (gpu.sh --dry-run)
    ("tiny 1 x G=2, 8 tok", {"sampling.G": 2, "phase.prompts_per_step": 1, "sampling.max_new_tokens": 8}),
    ("tiny 2 x G=2, 8 tok, micro 2", {"sampling.G": 2, "phase.prompts_per_step": 2, "sampling.max_new_tokens": 8,
                                      "optim.micro_batch_rows": 2}),
]


def gpu_check(budget_s: float, smoke: bool = False) -> int:
    """Real steps at GPU_SETTINGS on a CUDA device (the 7B's exact shapes, random weights,
    NF4 + LoRA r=8, checkpointing: bench/step.py's build), each phase's
    torch.cuda.max_memory_allocated against the plan; on a CPU the tiny model at
    CPU_SETTINGS, measured with LiveBytes (bench/gpu.sh --dry-run). A setting after the
    first that would start after ``budget_s`` seconds is skipped. ``smoke``: the first
    setting only, and on CUDA one decoder layer of the 7B (seconds: gpu.sh's preflight)."""
    import copy

    from bench._timing import print_table
    from data.synthetic import generate
    from grpo.model.tiny import tiny_image_processor
    from grpo.overrides import apply_overrides

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    if cuda:
        from bench.step import build_bundle
        from grpo.cli import phase_config

        base = phase_config("A", "qwen7b", {"run.run_prior_phases": "false"}, "A")
        bundle = build_bundle("7b", "cuda", four_bit=True, checkpointing=True, layers=1 if smoke else 0)
        settings, where = GPU_SETTINGS, torch.cuda.get_device_name(0)
    else:
        base = config_from_argv(["--sampling.rollout", "plain"])
        base.model.gradient_checkpointing = True
        _, bundle = model_shapes(base)
        settings, where = CPU_SETTINGS, "CPU"
    settings = settings[:1] if smoke else settings
    print(f"# memory plan vs measured on {where}{' (smoke)' if smoke else ''}: model built in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    rows, worst = [], 0.0
    for name, overrides in settings:
        if rows and time.perf_counter() - t0 > budget_s:  # the first setting always runs
            print(f"# {name}: skipped (the {budget_s:.0f} s budget is used up)")
            continue
        cfg = apply_overrides(copy.deepcopy(base), overrides).validate()
        bundle.image_processor = tiny_image_processor(cfg.model.image_size)
        examples = generate("train", 1, cfg.phase.prompts_per_step + 4, seed=0, image_size=cfg.model.image_size)
        t1 = time.perf_counter()
        got = measured_step(bundle, cfg, examples)
        P = prompt_len_of(bundle, cfg, examples[: cfg.phase.prompts_per_step])
        plan = plan_step(shapes_of_model(bundle.model, cfg), cfg, device="cuda" if cuda else "cpu", prompt_len=P)
        want = planned_phases(plan)
        peak_got = max(got[ph] for ph in ("sampling", "reference", "policy"))
        worst = max(worst, abs(plan.peak / peak_got - 1))
        rows += compare_rows(name, got, want)
        rows.append({"run": name, "phase": "PEAK", "measured MiB": f"{peak_got / MiB:.1f}",
                     "planned MiB": f"{plan.peak / MiB:.1f}", "plan/measured": f"{plan.peak / peak_got:.3f}"})
        print(f"#   {name}: prompt {P} tokens, {time.perf_counter() - t1:.0f} s; peak measured "
              f"{peak_got / GiB:.2f} GiB, planned {plan.peak / GiB:.2f} GiB", flush=True)
    print_table(rows, ["run", "phase", "measured MiB", "planned MiB", "plan/measured"])
    print(f"summary: memory plan vs {'torch.cuda.max_memory_allocated' if cuda else 'LiveBytes'} on {where}: "
          f"{sum(r['phase'] == 'PEAK' for r in rows)} setting(s), step peak within {worst:.1%}")
    return 0


# ----------------------------------------------------------------------------- the command


def print_plan(plan: Plan) -> None:
    from bench._timing import print_table

    rows = []
    for ph in ("resident", *plan.phases):
        parts = [p for p in plan.parts if p.phase == ph]
        for p in parts:
            rows.append({"phase": ph, "component": p.name, "MiB": f"{p.bytes / MiB:,.0f}", "note": p.note})
        total = plan.phase_bytes(ph)
        rows.append({"phase": ph, "component": "= phase total" if ph != "resident" else "= resident",
                     "MiB": f"{total / MiB:,.0f}", "note": f"{total / GiB:.2f} GiB"})
    print_table(rows, ["phase", "component", "MiB", "note"])


VISION_SETTINGS = (("frozen tower", False, False), ("merger", False, True), ("tower + merger", True, True))


def vision_training_rows(cfg, device: str, prompt_len: int) -> list[dict]:
    """The plan with the tower frozen, its merger training (lora.merger) and the whole tower
    training (lora.vision + lora.merger) at ``cfg``'s other settings: what training it adds."""
    import copy

    rows, frozen = [], None
    for name, vision, merger in VISION_SETTINGS:
        c = copy.deepcopy(cfg)
        c.lora.vision, c.lora.merger = vision, merger
        plan = plan_step(model_shapes(c)[0], c, device=device, prompt_len=prompt_len)
        frozen = frozen or plan
        rows.append({"tower": name, "policy GiB": f"{plan.phase_bytes('policy') / GiB:.2f}",
                     "peak GiB": f"{plan.peak / GiB:.2f}",
                     "added MiB": f"{(plan.phase_bytes('policy') - frozen.phase_bytes('policy')) / MiB:,.0f}",
                     "peak phase": plan.peak_phase})
    return rows


def main(argv: list[str] | None = None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu-gib", type=float, default=0.0, help="a GPU's memory: say whether the step fits, and which "
                                                             "optim.micro_batch_rows would (largest that fits)")
    p.add_argument("--measure", action="store_true",
                   help="the 7B: also run the 7B-width measurement (minutes); tiny: always measured")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="plan the CUDA kernels (default) or the CPU's PyTorch paths")
    p.add_argument("--prompt-tokens", type=int, default=0, help="tokens per prompt (0 = the plan's assumption)")
    p.add_argument("--layers", default="1,2,4", help="--measure: decoder layers of the 7B-width runs")
    p.add_argument("--tokens", default="8,24", help="--measure: completion lengths of the 7B-width runs")
    p.add_argument("--measure-image-px", type=int, default=224, help="--measure: image side of the 7B-width runs")
    p.add_argument("--gpu-check", action="store_true",
                   help="bench/gpu.sh: real steps at the plan's settings on CUDA, max_memory_allocated vs the plan "
                        "(on a CPU: the tiny model at smoke sizes)")
    p.add_argument("--budget-s", type=float, default=100.0,
                   help="--gpu-check: start no setting but the first after this many seconds")
    p.add_argument("--smoke", action="store_true",
                   help="--gpu-check: its first setting only, on CUDA with one decoder layer of the 7B (seconds)")
    p.add_argument("--threads", type=int, default=1)
    args, trainer_argv = p.parse_known_args(argv)
    torch.set_num_threads(max(1, args.threads))
    if args.gpu_check:
        return gpu_check(args.budget_s, smoke=args.smoke)
    from grpo.errors import ConfigError

    try:
        cfg = config_from_argv(trainer_argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from bench._timing import print_table

    shapes, bundle = model_shapes(cfg)
    P = args.prompt_tokens or prompt_tokens(cfg)
    plan = plan_step(shapes, cfg, device=args.device, prompt_len=P)
    s = cfg.sampling
    print(f"# memory plan of one GRPO step: {cfg.model.name}, {'NF4' if cfg.model.load_in_4bit else cfg.model.dtype} + "
          f"LoRA r={cfg.lora.rank}, {cfg.phase.prompts_per_step} prompt(s) x G={s.G} = {plan.rows} rows, "
          f"{s.max_new_tokens} new tokens, {cfg.model.image_size} px, prompt {P} tokens, beta={cfg.optim.beta}, "
          f"rollout {s.rollout}, micro-batch {plan.micro_batch_rows} rows, logits chunk "
          f"{cfg.optim.logits_chunk_tokens} tokens, {'shared-prefix' if cfg.optim.shared_prefix else 'full-row'} "
          f"log-prob passes, checkpointing {'on' if cfg.model.gradient_checkpointing else 'off'}; "
          f"device terms: {args.device}")
    saves = layer_saved_per_token(shapes, repeated_kv=not cfg.optim.shared_prefix)
    print(f"# {shapes.layers} layers, d={shapes.hidden}, I={shapes.intermediate}, "
          f"{shapes.heads}/{shapes.kv_heads} heads, V={shapes.vocab}, {shapes.compute_bytes} B compute dtype; "
          f"a layer saves {saves:,} B/token without checkpointing")
    print_plan(plan)
    print(f"# training the vision tower (lora.vision / lora.merger; checkpointing "
          f"{'on' if cfg.model.gradient_checkpointing else 'off'}): the same step's plan, one image a prompt")
    print_table(vision_training_rows(cfg, args.device, P), ["tower", "policy GiB", "peak GiB", "added MiB", "peak phase"])

    if bundle is not None:
        print_table(tiny_validation(bundle, cfg), ["run", "phase", "measured MiB", "planned MiB", "plan/measured"])
    elif args.measure:
        qwen7b_measurement(cfg, [int(x) for x in args.layers.split(",")], [int(x) for x in args.tokens.split(",")],
                           args.measure_image_px)

    verdict = ""
    if args.gpu_gib > 0:
        budget = int(args.gpu_gib * GiB)
        fits = need_bytes(plan) <= budget
        best = largest_fitting(shapes, cfg, budget, device=args.device, prompt_len=P)
        print(f"# on a {args.gpu_gib:g} GiB GPU: needs {need_bytes(plan) / GiB:.1f} GiB (peak + 10% allocator slack + "
              f"1 GiB CUDA context/workspaces): {'fits' if fits else 'does NOT fit'}; "
              + (f"largest micro-batch that fits: --optim.micro_batch_rows {best[0]} "
                 f"(peak {best[1].peak / GiB:.1f} GiB)" if best else "no micro-batch size fits"))
        verdict = f", {'fits' if fits else 'does not fit'} {args.gpu_gib:g} GiB" + (
            f", micro_batch_rows {best[0]} fits" if best and not fits else "")
    print(f"peak {plan.peak / GiB:.1f} GiB ({plan.peak_phase}; {plan.summary()} GiB; micro-batch "
          f"{plan.micro_batch_rows}/{plan.rows} rows{verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
