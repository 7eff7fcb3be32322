"""Benchmark: the work per generated token, counted -- operators, host syncs, bytes allocated.

    python -m bench.decode_ops                  # the tiny policy and the 7B's widths (2 layers, extrapolated)
    python -m bench.decode_ops --model tiny     # one of them
    python -m bench.decode_ops --quick          # tiny only, fewer tokens: the smoke test

Why a count and not a clock. Decoding one token runs the whole decoder on one new position
per row: tiny matmuls, so on a GPU the cost is the number of kernels launched (a few
microseconds each, whatever their size) plus the weight reads, and on a CPU the number of
PyTorch operators dispatched (each a few microseconds of Python + dispatcher overhead).
Counts are deterministic (same seed, same ops), so they show a change that timings on a
shared machine would bury.

How it counts. A ``TorchDispatchMode`` sees every ATen operator below autograd -- what a
GPU would launch as kernels, one each for most of them -- and records per operator:

- what it is for: the innermost recognised caller on the Python stack -- a module of the
  model (``*RMSNorm`` -> norm, ``self_attn`` -> attention, ``mlp`` -> MLP, the LoRA branch of
  a ``LoRALinear`` -> LoRA, ``embed_tokens`` / ``lm_head``), a function of the decode path
  (rotary -> rope, sample_token -> sampling, the KV cache's methods -> cache), or else the
  loop around it (our decode loop, transformers' model glue: masks and positions, and
  ``generate``'s own loop);
- whether it is a view (its outputs alias an input and it mutates nothing: on a GPU no
  kernel is launched; shown apart);
- whether it is a host sync (``_local_scalar_dense`` behind ``.item()`` / ``int()``,
  ``nonzero``, ``is_nonzero``, ``equal``, ...: on a GPU the CPU waits for the queue to drain);
- the bytes of its outputs that are new storage (not a view, not written in place): the
  allocator traffic per token.

Per token = (count of a rollout of T2 tokens - count of one of T1 tokens) / (T2 - T1): the
vision pass, the prefill and the setup cancel, what is left is one decode step with its
sampling. Per layer = (count at 2 decoder layers - count at 1) (the model's own layers,
truncated for the count); a model of L layers = the 1-layer count + (L - 1) x per layer --
the memory plan's extrapolation -- checked against the direct count on the tiny model.
The rows stay in the batch in both rollouts (the check fails loudly if one stops: then
the difference would mix in a compaction).

Paths: "plain" = grpo.rollout.sampler.sample, the policy's own layers (NF4 + LoRA here) on
the static cache; "merged" = grpo.rollout.merged.MergedRollout, the merged copy (eager: its
CUDA graph replays the same ops as ONE launch on a GPU); "generate" = transformers'
``generate`` on the prompts repeated G times, as bench.sampler runs it.

Models: "tiny" is the trainer's tiny policy (NF4 base + rank-8 LoRA, as the tiny preset
builds it); "7b" is a random Qwen2.5-VL at the 7B's text widths (hidden 3584, MLP 18944,
GQA 28:4, NF4 + LoRA in bf16, as the qwen7b preset) with 2 decoder layers, a vocabulary of
8192 (op counts do not depend on it; the logits' bytes do) and a 1-block vision tower,
extrapolated to 28 layers. On a CPU; what a GPU launches differs where an operator has
another kernel there (bitsandbytes' 4-bit matmul, SDPA with a mask), not in the count of
operators the Python code dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from grpo.model.prompts import encode_prompts

SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique_consecutive",
            "_unique2", "item"}
PURPOSES = ("attention", "MLP", "LoRA", "norm", "rope", "cache", "embed", "head", "sampling", "loop", "glue",
            "generate")
# Functions of the decode paths and of transformers, by name -> what their operators are for.
FUNCTION_PURPOSE = {
    "rotary_cos_sin": "rope", "apply_rope": "rope", "_rotate_half": "rope", "rotate_half": "rope",
    "apply_multimodal_rotary_pos_emb": "rope", "apply_rotary_pos_emb": "rope",
    "sample_token": "sampling", "filter_logits": "sampling",
    "_attention": "attention", "_attention_block": "attention", "sdpa_attention_forward": "attention",
    "_mlp_block": "MLP", "_mlp": "MLP", "_add_adapters": "LoRA", "_rms_norm": "norm",
    "write": "cache", "write_at": "cache", "batch_select_indices": "cache", "update": "cache",
    "batch_repeat_interleave": "cache", "additive_mask": "attention",
    "decode_n_tokens": "loop", "step": "loop",
    "_decode_step": "head", "decode_step": "head",
}


@dataclass
class Counts:
    """What one stretch of code dispatched."""

    ops: Counter = field(default_factory=Counter)  # purpose -> operators (views excluded)
    views: int = 0  # operators that only make a view (no kernel on a GPU)
    syncs: Counter = field(default_factory=Counter)  # operator name -> host syncs
    bytes: int = 0  # new storage allocated by the operators' outputs
    by_op: Counter = field(default_factory=Counter)  # "purpose aten.op" -> operators (views excluded)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def combine(self, other: Counts, a: float, b: float) -> Counts:
        """a * self + b * other, every field (the differences and extrapolations below)."""
        def mix(x: Counter, y: Counter) -> Counter:
            both = {k: round(a * x.get(k, 0) + b * y.get(k, 0), 6) for k in set(x) | set(y)}
            return Counter({k: v for k, v in both.items() if v})  # rounded: 1/3 of an integer difference
        return Counts(mix(self.ops, other.ops), round(a * self.views + b * other.views, 6),
                      mix(self.syncs, other.syncs), round(a * self.bytes + b * other.bytes), mix(self.by_op, other.by_op))


class OpCounter(TorchDispatchMode):
    """Counts every ATen operator dispatched inside it, by purpose (module docstring)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.counts = Counts()
        self.module_purpose: dict[int, str] = {}
        self.lora: dict[int, int] = {}  # id(LoRALinear) -> id(its base layer)
        for name, mod in model.named_modules():
            cls = type(mod).__name__
            if cls == "LoRALinear":
                self.lora[id(mod)] = id(mod.base_layer)
            elif cls.endswith("RMSNorm"):
                self.module_purpose[id(mod)] = "norm"
            elif cls.endswith("RotaryEmbedding"):
                self.module_purpose[id(mod)] = "rope"
            elif name.endswith("self_attn"):
                self.module_purpose[id(mod)] = "attention"
            elif name.endswith(".mlp"):
                self.module_purpose[id(mod)] = "MLP"
            elif name.endswith("embed_tokens"):
                self.module_purpose[id(mod)] = "embed"
            elif name == "lm_head":
                self.module_purpose[id(mod)] = "head"

    def purpose(self) -> str:
        """The innermost recognised caller of the operator being dispatched."""
        f, inner_module = sys._getframe(2), None
        while f is not None:
            code = f.f_code
            slf = f.f_locals.get("self") if "self" in code.co_varnames[:1] else None
            if slf is not None and isinstance(slf, torch.nn.Module):
                key = id(slf)
                if key in self.lora:
                    if inner_module not in (key, self.lora[key]):
                        return "LoRA"  # the adapter's branch, not its base layer
                elif key in self.module_purpose:
                    return self.module_purpose[key]
                inner_module = key
            elif code.co_name in FUNCTION_PURPOSE:
                return FUNCTION_PURPOSE[code.co_name]
            elif "/generation/" in code.co_filename:
                return "generate"
            elif code.co_filename.endswith("cache_utils.py"):
                return "cache"
            f = f.f_back
        return "glue"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        c = self.counts
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        fresh = [t for t in outs if t.untyped_storage().data_ptr() not in inputs]
        if outs and not fresh and not func._schema.is_mutable:
            c.views += 1
        else:
            purpose = self.purpose()
            c.ops[purpose] += 1
            c.by_op[f"{purpose} {name}"] += 1
            c.bytes += sum(t.untyped_storage().nbytes() for t in fresh)
        if name in SYNC_OPS:
            c.syncs[name] += 1
        return out


def count(model: torch.nn.Module, fn) -> Counts:
    with OpCounter(model) as counter:
        fn()
    return counter.counts


# ----------------------------------------------------------------------------- the paths


def prompts_for(bundle, B: int, image_px: int):
    from bench.sampler import QUESTIONS, images

    return encode_prompts(bundle, (images(B, image_px), [QUESTIONS[i % 4] for i in range(B)]))


def rollout_fn(path: str, bundle, prompts, G: int, merged=None):
    """fn(T) -> completion tokens produced per row (min over rows), for one rollout of T tokens."""
    from bench.sampler import run_generate
    from grpo.rollout.sampler import sample

    def plain(T):
        out = sample(bundle, prompts, G=G, max_new_tokens=T, temperature=1.0, seed=0)
        return int(out.lengths.min()) if not bool(out.finished.any()) else -1

    def merged_path(T):
        out = merged.sample(bundle, prompts, G=G, max_new_tokens=T, temperature=1.0, seed=0)
        return int(out.lengths.min()) if not bool(out.finished.any()) else -1

    def generate(T):
        args = argparse.Namespace(G=G, max_new_tokens=T, temperature=1.0, top_k=0, top_p=1.0)
        return run_generate(bundle, prompts, args) // (prompts.input_ids.shape[0] * G)

    return {"plain": plain, "merged": merged_path, "generate": generate}[path]


@contextmanager
def no_stop(vocab_size: int):
    """Stop ids that no row can sample (past the vocabulary), two of them as the real ones: every
    row decodes to the budget, with the same operators as with the real stop ids."""
    import bench.sampler
    import grpo.rollout.sampler

    saved = grpo.rollout.sampler.stop_token_ids, bench.sampler.stop_token_ids
    grpo.rollout.sampler.stop_token_ids = bench.sampler.stop_token_ids = lambda b: [vocab_size, vocab_size + 1]
    try:
        yield
    finally:
        grpo.rollout.sampler.stop_token_ids, bench.sampler.stop_token_ids = saved


def per_token(model, fn, T1: int, T2: int, label: str) -> Counts:
    """(count(T2) - count(T1)) / (T2 - T1), refusing a rollout where a row stopped early."""
    got = {}
    counts = {}
    for T in (T1, T2):
        def run(T=T):
            with no_stop(model.config.text_config.vocab_size):
                got[T] = fn(T)
        counts[T] = count(model, run)
        if got[T] != T:
            raise SystemExit(f"bench.decode_ops: {label}: a row stopped before {T} tokens, so the per-token "
                             f"difference would mix in a compaction")
    return counts[T2].combine(counts[T1], 1 / (T2 - T1), -1 / (T2 - T1))


class Layers:
    """Truncate the language model to its first ``n`` decoder layers (a context manager)."""

    def __init__(self, model, n: int):
        self.lm, self.n = model.model.language_model, n
        self.cfg = model.config.text_config

    def __enter__(self):
        self.saved = self.lm.layers, self.cfg.num_hidden_layers
        self.lm.layers = torch.nn.ModuleList(list(self.saved[0])[: self.n])
        self.cfg.num_hidden_layers = self.n
        return self

    def __exit__(self, *exc):
        self.lm.layers, self.cfg.num_hidden_layers = self.saved


def count_model(bundle, B: int, G: int, image_px: int, T1: int, T2: int, paths: list[str],
                check_direct: bool) -> dict[str, dict[str, Counts]]:
    """{path: {"layer": per layer, "fixed": the rest, "total": at the model's depth[, "direct"]}}."""
    from grpo.rollout.merged import MergedRollout

    model = bundle.model
    L = len(model.model.language_model.layers)
    prompts = prompts_for(bundle, B, image_px)
    res = {}
    for path in paths:
        at = {}
        for n in (1, 2):
            with Layers(model, n):
                merged = MergedRollout(model) if path == "merged" else None
                at[n] = per_token(model, rollout_fn(path, bundle, prompts, G, merged), T1, T2, f"{path}, {n} layers")
        layer = at[2].combine(at[1], 1, -1)
        fixed = at[1].combine(layer, 1, -1)
        res[path] = {"layer": layer, "fixed": fixed, "total": at[1].combine(layer, 1, L - 1)}
        if check_direct:
            merged = MergedRollout(model) if path == "merged" else None
            res[path]["direct"] = per_token(model, rollout_fn(path, bundle, prompts, G, merged), T1, T2, path)
    return res


# ----------------------------------------------------------------------------- models


def tiny_bundle():
    from bench.step import build_bundle

    return build_bundle("tiny", "cpu", four_bit=True, checkpointing=False)


def qwen7b_widths_bundle(layers: int = 2):
    """The 7B's text widths at ``layers`` layers, NF4 + rank-8 LoRA in bf16, vocabulary 8192."""
    from bench.step import QWEN7B_TEXT, QWEN7B_VISION, build_bundle

    text = dict(QWEN7B_TEXT, num_hidden_layers=layers, vocab_size=8192)
    vision = dict(QWEN7B_VISION, depth=1, fullatt_block_indexes=[0])
    return build_bundle("custom", "cpu", four_bit=True, checkpointing=False,
                        custom=(text, vision, torch.bfloat16, 112))


# ----------------------------------------------------------------------------- one whole GRPO step


def count_step(B: int, G: int, T: int) -> tuple[dict[str, Counts], dict]:
    """One GRPO step of the embedded default (bench.step.run_step: the trainer's grpo_step on the
    tiny policy, merged rollouts, shared-prefix log-probs, beta 0, AdamW and the copy's refresh)
    under the counter, one Counts per stage. A small warm-up step first (first-call work is not
    the step's)."""
    from bench.step import Stages, build_bundle, run_step, step_config
    from data.synthetic import generate
    from grpo.rollout.merged import MergedRollout
    from lora import lora_parameters

    bundle = build_bundle("tiny", "cpu", four_bit=True, checkpointing=False)
    merged = MergedRollout(bundle.model)
    opt = torch.optim.AdamW(lora_parameters(bundle.model), lr=1e-5)
    examples = generate("train", 1, B, seed=0, image_size=112)
    run_step(bundle, step_config(1, 2, 4, 0.0, 3.0), examples[:1], Stages(torch.device("cpu")), opt, merged=merged)

    counter = OpCounter(bundle.model)
    per: dict[str, Counts] = {}

    class Counted(Stages):  # the step's own stage names label the counts
        @contextmanager
        def __call__(self, name: str):
            saved, counter.counts = counter.counts, per.setdefault(name.strip(), Counts())
            try:
                yield
            finally:
                counter.counts = saved

    with counter:
        _, facts = run_step(bundle, step_config(B, G, T, 0.0, 3.0), examples, Counted(torch.device("cpu")), opt,
                            merged=merged)
    per.pop("(prefill alone)", None)  # bench.step times the prefill alone too; not part of the step
    return per, facts


def print_step(per: dict[str, Counts], facts: dict) -> None:
    from bench._timing import fmt_bytes, print_table

    tokens = facts["N"] * facts["steps"]
    print(f"\n## one GRPO step of the embedded default: N = {facts['N']} rows, {facts['steps']} decode steps, "
          f"prompt {facts['P']} tokens")
    def by_name(c: Counts) -> Counter:  # the operator alone (a stage's purposes are its own)
        out = Counter()
        for key, n in c.by_op.items():
            out[key.split(" ")[-1]] += n
        return out

    rows = [{"stage": k, "ops": fmt_n(c.total), "views": fmt_n(c.views), "syncs": fmt_n(sum(c.syncs.values())),
             "alloc": fmt_bytes(int(c.bytes)),
             "most frequent": ", ".join(f"{o} {fmt_n(n)}" for o, n in by_name(c).most_common(5))}
            for k, c in per.items()]
    total = Counts()
    for c in per.values():
        total = total.combine(c, 1, 1)
    rows.append({"stage": "step", "ops": fmt_n(total.total), "views": fmt_n(total.views),
                 "syncs": fmt_n(sum(total.syncs.values())), "alloc": fmt_bytes(int(total.bytes))})
    print_table(rows, ["stage", "ops", "views", "syncs", "alloc", "most frequent"])
    print(f"# sampling: {fmt_n(per['sampling'].total / facts['steps'])} ops per decode step "
          f"({tokens} completion tokens); step syncs by operator: "
          + ", ".join(f"{k} {fmt_n(v)}" for k, v in sorted(total.syncs.items())))


# ----------------------------------------------------------------------------- report


def fmt_n(x: float) -> str:
    return f"{x:,.0f}" if abs(x - round(x)) < 1e-6 else f"{x:,.1f}"


def print_report(name: str, L: int, res: dict[str, dict[str, Counts]], N: int) -> None:
    from bench._timing import fmt_bytes, print_table

    print(f"\n## {name}: one decoded token, N = {N} rows, {L} decoder layers (1-layer count + {L - 1} x per layer)")
    rows = []
    for path, parts in res.items():
        for part in ("layer", "total", "direct"):
            if part not in parts:
                continue
            c = parts[part]
            row = {"path": path, "part": {"layer": "per layer", "total": f"{L} layers", "direct": "direct"}[part],
                   "ops": fmt_n(c.total), "views": fmt_n(c.views), "syncs": fmt_n(sum(c.syncs.values())),
                   "alloc": fmt_bytes(int(c.bytes))}
            row.update({p: fmt_n(c.ops.get(p, 0)) for p in PURPOSES})
            rows.append(row)
    print_table(rows, ["path", "part", "ops", *PURPOSES, "views", "syncs", "alloc"])
    for path, parts in res.items():
        syncs = ", ".join(f"{k} {fmt_n(v)}" for k, v in sorted(parts["total"].syncs.items()) if v) or "none"
        top = ", ".join(f"{k} {fmt_n(v)}" for k, v in parts["layer"].by_op.most_common(8))
        print(f"# {path}: host syncs per token: {syncs}; per layer, most frequent: {top}")


def main(argv: list[str] | None = None) -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.decode_ops", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "7b", "both"], default="both", help="which model(s) to count")
    p.add_argument("--paths", default="plain,merged,generate", help="comma-separated: plain, merged, generate")
    p.add_argument("--B", type=int, default=2, help="prompts")
    p.add_argument("--G", type=int, default=4, help="completions per prompt")
    p.add_argument("--t1", type=int, default=3, help="tokens of the shorter rollout")
    p.add_argument("--t2", type=int, default=6, help="tokens of the longer rollout")
    p.add_argument("--quick", action="store_true", help="tiny only, --t1 2 --t2 3, no direct check")
    p.add_argument("--step", action="store_true",
                   help="count one whole GRPO step of the embedded default instead, by stage")
    p.add_argument("--step-B", type=int, default=8, help="prompts of the --step count")
    p.add_argument("--step-tokens", type=int, default=48, help="max new tokens of the --step count")
    args = p.parse_args(argv)
    paths = [s for s in args.paths.split(",") if s]
    bad = [s for s in paths if s not in ("plain", "merged", "generate")]
    if bad or not paths:
        p.error(f"--paths {args.paths!r}: use a comma-separated subset of plain,merged,generate")
    if not 1 <= args.t1 < args.t2:
        p.error(f"--t1 {args.t1} --t2 {args.t2}: need 1 <= t1 < t2")
    if args.quick:
        args.model, args.t1, args.t2 = "tiny", 2, 3
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.step:
        per, facts = count_step(args.step_B, 8, args.step_tokens)
        print_step(per, facts)
        print("summary: operators in one GRPO step of the embedded default: " + ", ".join(
            f"{k} {fmt_n(c.total)}" for k, c in per.items()))
        return
    summary = []
    if args.model in ("tiny", "both"):
        b = tiny_bundle()
        L = len(b.model.model.language_model.layers)
        res = count_model(b, args.B, args.G, 112, args.t1, args.t2, paths, check_direct=not args.quick)
        print_report("tiny policy (NF4 + LoRA, fp32)", L, res, args.B * args.G)
        for path, parts in res.items():
            if "direct" in parts and abs(parts["direct"].total - parts["total"].total) > 1e-6:
                raise SystemExit(f"bench.decode_ops: {path}: the extrapolated count {parts['total'].total} differs from "
                                 f"the direct count {parts['direct'].total}")
        summary.append("tiny " + ", ".join(f"{k} {fmt_n(v['total'].total)}" for k, v in res.items()))
    if args.model in ("7b", "both"):
        from bench.step import QWEN7B_TEXT

        b = qwen7b_widths_bundle(2)
        L = QWEN7B_TEXT["num_hidden_layers"]
        res = count_model(b, 1, 8, 112, args.t1, args.t2, paths, check_direct=False)
        for parts in res.values():  # the bundle has 2 layers; the 7B has 28
            parts["total"] = parts["fixed"].combine(parts["layer"], 1, L)
        print_report("the 7B's widths (NF4 + LoRA, bf16, vocabulary 8192)", L, res, 8)
        summary.append("7B " + ", ".join(f"{k} {fmt_n(v['total'].total)}" for k, v in res.items()))
    print("summary: operators per decoded token: " + "; ".join(summary))


if __name__ == "__main__":
    main()
