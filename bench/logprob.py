"""Benchmark selective log-softmax (token log-probs from logits): eager vs compile vs Triton.

    python -m bench.logprob            # GPU: V = 151,936 (Qwen), bf16 logits, up to 64k tokens
    python -m bench.logprob --quick    # two shapes, fewer repetitions, no torch.compile
    python -m bench.logprob --quick --compile --shape 64 1024   # the compiled comparison alone
    python -m bench.logprob --compile  # on a CPU, include torch.compile (slow to compile)
    TRITON_INTERPRET=1 python -m bench.logprob --force-triton --shape 2 8 --vocab 500 --hidden 64
                                       # smoke-test the Triton providers on a CPU (numbers meaningless)

Two passes per shape: "fwd" (no grad, as for the reference policy) and "fwd+bwd" (the
policy). Bandwidth counts the logits read once per pass plus the gradient written by the
backward (fwd: 1x the logits' bytes, fwd+bwd: 3x). "extra mem" is the peak allocation
above the inputs, minus the logits' gradient for fwd+bwd (autograd must return it), as a
percentage of the logits' size: the target is <= 10%. The eager version materialises two
fp32 copies, i.e. 400% for bf16 logits.

N = 64 completions x T = 4096 tokens would be 80 GB of bf16 logits at this vocabulary, so
the sweep stops at 64k tokens (the trainer computes log-probs in chunks of completions).
Input validation (the token-id range check, one host sync) is timed on its own row. On a
CPU the Triton provider is skipped (the interpreter is for correctness, not speed) and
shapes are scaled down. Each shape's table prints as soon as it is measured (a run cut
short keeps what it measured). torch.compile compiles once per shape and pass (dynamic=False:
4 compiles for two shapes); the first call of each is printed as its compile time and only
then are the calls timed. --quick leaves compile out unless --compile asks for it.

The logits are drawn in their own dtype, in place (64 x 1024 x 151,936 bf16: 19.9 GB, where an
fp32 draw scaled by a temporary would peak near 100 GB): the inputs fit an 80 GB card, and a
provider that does not (the eager reference's fp32 copies) is recorded as OOM.

A second table starts from hidden states [N, T, d] (d = 3584, Qwen2.5-VL-7B) and a frozen
lm_head, fwd+bwd: eager (full logits + reference), "triton" (full logits + kernel) and
"triton-chunked" (token_logprobs_from_hidden, 1024-token chunks: the full logits never
exist). "extra mem" is then relative to the size the full logits would have.
"""

from __future__ import annotations

import argparse

import torch

from bench import _timing as timing
from grpo_kernels import logprob as lp

V_QWEN = 151_936
D_QWEN_7B = 3584
GPU_SHAPES = [(8, 256), (16, 512), (32, 1024), (64, 1024)]
CPU_SHAPES = [(1, 16), (2, 16), (2, 32)]
TEMPERATURE = 0.9


def eager(logits, y):
    return lp.token_logprobs_reference(logits, y, TEMPERATURE)


def triton(logits, y):
    """The kernel path of token_logprobs without its input validation."""
    return lp._TokenLogprobs.apply(logits, y, TEMPERATURE)


HIDDEN_PROVIDERS = {
    "eager": lambda h, w, y: lp.token_logprobs_reference(h @ w.T, y, TEMPERATURE),
    "triton": lambda h, w, y: lp._TokenLogprobs.apply(h @ w.T, y, TEMPERATURE),
    "triton-chunked": lambda h, w, y: lp._HiddenTokenLogprobs.apply(
        h.reshape(-1, h.shape[-1]), w, y.reshape(-1), TEMPERATURE, 1024),
}


def bench_hidden(N: int, T: int, V: int, d: int, dtype, providers: list[str], device: str,
                 args) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(N, T, d, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(V, d, generator=g, device=device) / d**0.5).to(dtype)  # frozen lm_head
    y = torch.randint(0, V, (N, T), generator=g, device=device)
    dlogp = torch.randn(N * T, generator=g, device=device)
    logits_bytes = N * T * V * torch.finfo(dtype).bits // 8
    rows = []
    for name in providers:
        def step(name=name):  # bound now: measured within this iteration anyway
            hidden.grad = None
            HIDDEN_PROVIDERS[name](hidden, weight, y).reshape(-1).backward(dlogp)

        row = dict(shape=f"N={N} T={T} V={V} d={d}", provider=name, **{"pass": "fwd+bwd"})
        measured = timing.measure(step, device, warmup=args.warmup, reps=args.reps)
        hidden.grad = None
        if measured is None:
            rows.append({**row, "median ms": "OOM"})
            continue
        t, mem = measured
        rows.append({**row, **timing.timing_cells(t), "peak mem": timing.fmt_bytes(mem),
                     "extra mem": "" if mem is None else f"{100 * mem / logits_bytes:.1f}%"})
    return rows


def bench_shape(N: int, T: int, V: int, dtype, providers: dict, device: str, args) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.empty(N, T, V, dtype=dtype, device=device).normal_(0.0, 3.0, generator=g)  # in place: no fp32 copy
    y = torch.randint(0, V, (N, T), generator=g, device=device)
    dlogp = torch.randn(N, T, generator=g, device=device)
    logits_bytes = logits.numel() * logits.element_size()
    peak_bw = timing.peak_bandwidth(device)
    rows = []
    for name, fn in providers.items():
        for pass_name in ("fwd", "fwd+bwd"):
            x = logits.detach().requires_grad_(pass_name == "fwd+bwd")

            def step(fn=fn, x=x, pass_name=pass_name):  # bound now: measured within this iteration anyway
                x.grad = None
                out = fn(x, y)
                if pass_name == "fwd+bwd":
                    out.backward(dlogp)

            row = dict(shape=f"N={N} T={T} V={V}", provider=name, **{"pass": pass_name})
            if name == "compiled":
                timing.print_compile_time(f"N={N} T={T} {pass_name}", step, device)
            measured = timing.measure(step, device, warmup=args.warmup, reps=args.reps)
            x.grad = None
            if measured is None:
                rows.append({**row, "median ms": "OOM"})
                continue
            t, mem = measured
            extra = None if mem is None else mem - (logits_bytes if pass_name == "fwd+bwd" else 0)
            bw = timing.gbps((1 if pass_name == "fwd" else 3) * logits_bytes, t.median_ms)
            rows.append({**row, **timing.timing_cells(t), "GB/s": timing.fmt(bw, ".4g"),
                         "% peak": timing.fmt(None if peak_bw is None else 100 * bw * 1e9 / peak_bw, ".3g"),
                         "peak mem": timing.fmt_bytes(mem),
                         "extra mem": "" if extra is None else f"{100 * extra / logits_bytes:.1f}%",
                         "_ms": t.median_ms, "_bw": bw, "_extra": extra})
    t = timing.time_fn(lambda: lp._validate(logits, y, TEMPERATURE), device, warmup=1, reps=args.reps)
    rows.append(dict(shape=f"N={N} T={T} V={V}", provider="(validation)", **{"pass": ""}, **timing.timing_cells(t)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="two shapes, fewer reps, no torch.compile")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="include torch.compile (default: on for GPU without --quick, off for CPU)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="logits dtype (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--vocab", type=int, default=V_QWEN)
    parser.add_argument("--hidden", type=int, default=D_QWEN_7B, help="d for the hidden-state table")
    parser.add_argument("--shape", type=int, nargs=2, action="append", metavar=("N", "T"),
                        help="benchmark this shape instead of the sweep (repeatable)")
    parser.add_argument("--force-triton", action="store_true",
                        help="run the Triton providers on a CPU too (needs TRITON_INTERPRET=1; "
                             "only to check this script, the timings mean nothing)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    args.reps = args.reps or (5 if args.quick else (20 if on_gpu else 5))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if on_gpu else "fp32")]
    use_compile = on_gpu and not args.quick if args.compile is None else args.compile

    providers = {"eager": eager}
    if use_compile:
        providers["compiled"] = torch.compile(eager, dynamic=False)
    use_triton = on_gpu or args.force_triton
    if use_triton:
        providers["triton"] = triton
    shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    shapes = shapes[-2:] if args.quick else shapes
    shapes = [tuple(s) for s in args.shape] if args.shape else shapes
    print(f"# token log-probs on {timing.device_name(args.device)}, {dtype}, temperature {TEMPERATURE}")
    if not on_gpu:
        print("# CPU run: scaled-down shapes; the Triton numbers need a GPU"
              + (" (Triton here runs in the interpreter: a smoke test)" if use_triton else "")
              + ("" if use_compile else "; add --compile for torch.compile"))
    rows = []
    for N, T in shapes:  # each shape's table as soon as it is measured
        case = bench_shape(N, T, args.vocab, dtype, providers, args.device, args)
        timing.print_table(case, ["shape", "provider", "pass", "median ms", "p20", "p80", "GB/s", "% peak",
                           "peak mem", "extra mem"])
        rows += case
    if use_triton:
        N, T = shapes[-1]
        print("\n# from hidden states, frozen lm_head (extra mem relative to the full logits)")
        hrows = bench_hidden(N, T, args.vocab, args.hidden, dtype, list(HIDDEN_PROVIDERS),
                             args.device, args)
        timing.print_table(hrows, ["shape", "provider", "pass", "median ms", "p20", "p80", "peak mem",
                            "extra mem"])

    N, T = shapes[-1]
    last = {(r["provider"], r["pass"]): r for r in rows if r["shape"] == f"N={N} T={T} V={args.vocab}"}
    tokens = f"{N * T} tokens x V={args.vocab}"
    tri, eag = last.get(("triton", "fwd+bwd"), {}), last.get(("eager", "fwd+bwd"), {})
    if on_gpu and tri.get("_ms"):
        comp = last.get(("compiled", "fwd+bwd"), {})
        vs_e = f"{eag['_ms'] / tri['_ms']:.2f}x eager" if eag.get("_ms") else "eager OOM"
        vs_c = f", {comp['_ms'] / tri['_ms']:.2f}x compiled" if comp.get("_ms") else ""
        peak_bw = timing.peak_bandwidth(args.device)
        pct = "" if peak_bw is None else f" ({100 * tri['_bw'] * 1e9 / peak_bw:.0f}% of peak)"
        fwd_extra = last[("triton", "fwd")]["extra mem"]
        print(f"summary: logprob fwd+bwd {tokens}: triton {tri['_ms']:.3f} ms = {vs_e}{vs_c}, "
              f"{tri['_bw']:.0f} GB/s{pct}; extra memory fwd {fwd_extra}, fwd+bwd "
              f"{tri['extra mem']} of the logits (target <= 10%)")
    else:
        print(f"summary: logprob fwd+bwd {tokens} on CPU: eager {eag.get('_ms', float('nan')):.2f} ms; "
              "Triton numbers need a GPU")


if __name__ == "__main__":
    main()
