"""Benchmark the fused GRPO loss: forward + backward, eager vs torch.compile vs Triton.

    python -m bench.grpo_loss            # GPU: sweep to N = 64 completions x T = 4096 tokens
    python -m bench.grpo_loss --quick    # fewer shapes and repetitions, no torch.compile
    python -m bench.grpo_loss --quick --compile --shape 64 4096   # the compiled comparison alone
    python -m bench.grpo_loss --compile  # on a CPU, include torch.compile (~1 min to compile)
    TRITON_INTERPRET=1 python -m bench.grpo_loss --force-triton --shape 16 64
                                         # smoke-test the Triton provider on a CPU (timings meaningless)

Every provider does the same work: group advantages from [N] rewards, then the loss
(clipped ratio against old log-probs, k3 KL against the reference, the aggregation) and
d loss / d logp. Input validation (shape checks and the NaN scan of the rewards, one host
sync) is left out of all three and timed on its own row, so the providers compare math.

Bandwidth counts the bytes a perfect single pass must move: read logp, old, ref, the mask
and the reference when beta > 0, write d loss / d logp. Peak memory is what one forward
+ backward allocates above the inputs. On a CPU the Triton provider is skipped (the
interpreter is for correctness, not speed) and shapes are scaled down. Each case's table
prints as soon as it is measured. torch.compile compiles once per case (dynamic=False: 2
compiles for --quick's two shapes); the first call of each is printed as its compile time
and only then are the calls timed. --quick leaves compile out unless --compile asks for it.
"""

from __future__ import annotations

import argparse

import torch

from bench import _timing as timing
from grpo_kernels import grpo_loss as gl

GPU_SHAPES = [(8, 512), (16, 1024), (32, 2048), (64, 4096)]
CPU_SHAPES = [(8, 128), (16, 256), (32, 512)]
MODES = {  # name -> loss options; the first is the default swept over shapes
    "grpo/token/kl": dict(loss_type="grpo", importance="token", beta=0.04, source="rewards"),
    "dapo/sequence": dict(loss_type="dapo", importance="sequence", beta=0.0, source="rewards"),
    "bnpo/prefix": dict(loss_type="bnpo", importance="token", beta=0.04, source="prefix"),
    "dr_grpo/components": dict(loss_type="dr_grpo", importance="token", beta=0.0, source="components"),
}
G = 8
J = 4  # rubric items in the prefix mode


def make_inputs(N: int, T: int, device: str, source: str, seed: int = 0) -> dict:
    """Right-padded completions of random length, like a sampled batch."""
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(N, T, generator=g)
    lengths = torch.randint(T // 4, T + 1, (N,), generator=g)
    inp = dict(
        logp=logp, old=logp + 0.1 * torch.randn(N, T, generator=g),
        ref=logp + 0.1 * torch.randn(N, T, generator=g),
        mask=torch.arange(T)[None, :] < lengths[:, None],
        rewards=torch.randint(0, 3, (N,), generator=g).float(),
    )
    if source == "components":
        inp["components"] = torch.randint(0, 2, (N, 3), generator=g).float()
        inp["weights"] = torch.tensor([0.6, 0.3, 0.1])
    inp = {k: v.to(device) for k, v in inp.items()}
    if source == "prefix":
        inp["prefix"] = gl.PrefixRubrics(
            R_ans=inp["rewards"], s=torch.randint(0, 2, (N, J), generator=g).float().to(device),
            scored=torch.ones(N, J, dtype=torch.bool, device=device),
            rho=torch.full((J,), 1.0 / J, device=device),
            t_end=torch.randint(0, T, (N, J), generator=g).to(device), a=0.5)
    return inp


def eager_loss(logp, inp: dict, mode: dict) -> torch.Tensor:
    """The reference pipeline: advantages, then the loss."""
    T = logp.shape[1]
    if mode["source"] == "prefix":
        adv, _ = gl.prefix_advantages_reference(inp["prefix"], T, G)
    elif mode["source"] == "components":
        adv, _ = gl.grpo_advantages_reference(inp["components"], G, weights=inp["weights"])
    else:
        adv, _ = gl.grpo_advantages_reference(inp["rewards"], G)
    loss, _ = gl.grpo_loss_reference(logp, inp["mask"], adv, **loss_args(mode, inp))
    return loss


def loss_args(mode: dict, inp: dict) -> dict:
    """grpo_loss's keyword arguments after the advantages, as the trainer passes them."""
    return dict(old_logp=inp["old"], ref_logp=inp["ref"] if mode["beta"] else None, sampler_logp=None,
                num_active_tokens=None, options=gl.LossOptions(beta=mode["beta"], loss_type=mode["loss_type"],
                                                               importance=mode["importance"]))


def source(inp: dict, mode: dict) -> "gl.AdvantageSource":
    """The advantage input of ``mode``."""
    if mode["source"] == "prefix":
        return gl.AdvantageSource.of_prefix(inp["prefix"])
    if mode["source"] == "components":
        return gl.AdvantageSource(inp["components"], weights=inp["weights"])
    return gl.AdvantageSource(inp["rewards"][:, None])


def triton_loss(logp, inp: dict, mode: dict) -> torch.Tensor:
    """The kernel path of grpo_loss without its input validation: advantages, then the loss."""
    adv = gl.group_advantages(source(inp, mode), G, T=logp.shape[1], backend="triton", checked=False)
    loss, _ = gl._FusedGRPOLoss.apply(logp, dict(mask=inp["mask"], adv=adv, **loss_args(mode, inp)))
    return loss


def validation_only(logp, inp: dict, mode: dict) -> None:
    """What grpo_loss and group_advantages check before any math: the loss's arguments and
    the advantage input (shapes, then the NaN scan, the one host sync)."""
    src = source(inp, mode)
    gl.check_source(src, logp.shape[1], "group", 1e-4, 0.0)
    adv = gl.Advantages(G, "row", coef=src.columns)  # a stand-in of the right shape: no math
    gl._validate(logp, inp["mask"], adv, **loss_args(mode, inp))


def min_bytes(N: int, T: int, mode: dict) -> int:
    per_token = 4 + 4 + 1 + 4  # logp, old, mask (bool), grad out
    per_token += 4 if mode["beta"] else 0
    return N * T * per_token


def bench_case(N: int, T: int, mode_name: str, providers: dict, device: str, args) -> list[dict]:
    mode = MODES[mode_name]
    inp = make_inputs(N, T, device, mode["source"])
    logp = inp["logp"].clone().requires_grad_()
    peak_bw = timing.peak_bandwidth(device)
    rows = []
    for name, loss_fn in providers.items():
        def step(loss_fn=loss_fn):  # bound now: measure() calls it within this iteration anyway
            logp.grad = None
            loss_fn(logp, inp, mode).backward()
        row = dict(shape=f"N={N} T={T}", mode=mode_name, provider=name)
        if name == "compiled":
            timing.print_compile_time(f"N={N} T={T} {mode_name}", step, device)
        measured = timing.measure(step, device, warmup=args.warmup, reps=args.reps)
        if measured is None:
            rows.append({**row, "median ms": "OOM"})
            continue
        t, mem = measured
        bw = timing.gbps(min_bytes(N, T, mode), t.median_ms)
        rows.append({**row, **timing.timing_cells(t), "GB/s": timing.fmt(bw, ".4g"),
                     "% peak": timing.fmt(None if peak_bw is None else 100 * bw * 1e9 / peak_bw, ".3g"),
                     "peak mem": timing.fmt_bytes(mem), "_ms": t.median_ms, "_bw": bw})
    t = timing.time_fn(lambda: validation_only(logp, inp, mode), device, warmup=1, reps=args.reps)
    rows.append(dict(shape=f"N={N} T={T}", mode=mode_name, provider="(validation)", **timing.timing_cells(t)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="two shapes, default mode, fewer reps, no torch.compile")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="include torch.compile (default: on for GPU without --quick, off for CPU)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per case")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shape", type=int, nargs=2, action="append", metavar=("N", "T"),
                        help="benchmark this shape instead of the sweep (repeatable)")
    parser.add_argument("--force-triton", action="store_true",
                        help="run the Triton provider on a CPU too (needs TRITON_INTERPRET=1; "
                             "only to check this script, the timings mean nothing)")
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    args.reps = args.reps or (10 if args.quick else (50 if on_gpu else 10))
    use_compile = on_gpu and not args.quick if args.compile is None else args.compile

    providers = {"eager": eager_loss}
    if use_compile:
        providers["compiled"] = torch.compile(eager_loss, dynamic=False)
    if on_gpu or args.force_triton:
        providers["triton"] = triton_loss
    shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    shapes = shapes[-2:] if args.quick else shapes
    shapes = [tuple(s) for s in args.shape] if args.shape else shapes
    print(f"# grpo_loss forward+backward on {timing.device_name(args.device)}, G={G}, fp32 log-probs")
    if not on_gpu:
        print("# CPU run: scaled-down shapes; the Triton numbers need a GPU"
              + (" (Triton here runs in the interpreter: a smoke test)" if args.force_triton else "")
              + ("" if use_compile else "; add --compile for torch.compile (~1 min)"))

    cases = [(N, T, "grpo/token/kl") for N, T in shapes]
    if not args.quick:
        cases += [(*shapes[-1], mode_name) for mode_name in list(MODES)[1:]]
    rows = []
    for N, T, mode_name in cases:  # each case's table as soon as it is measured
        case = bench_case(N, T, mode_name, providers, args.device, args)
        timing.print_table(case, ["shape", "mode", "provider", "median ms", "p20", "p80", "GB/s", "% peak", "peak mem"])
        rows += case

    N, T = shapes[-1]
    last = {r["provider"]: r for r in rows if r["shape"] == f"N={N} T={T}" and r["mode"] == "grpo/token/kl"}
    ms = {k: v.get("_ms") for k, v in last.items()}
    if on_gpu and ms.get("triton"):
        peak_bw = timing.peak_bandwidth(args.device)
        pct = "" if peak_bw is None else f", {100 * last['triton']['_bw'] * 1e9 / peak_bw:.0f}% of peak"
        vs_c = f", {ms['compiled'] / ms['triton']:.2f}x compiled" if ms.get("compiled") else ""
        print(f"summary: grpo_loss fwd+bwd N={N} T={T}: triton {ms['triton']:.3f} ms = "
              f"{ms['eager'] / ms['triton']:.2f}x eager{vs_c}, {last['triton']['_bw']:.0f} GB/s{pct} "
              "(targets: >= 3x eager, >= 1.5x compiled, >= 60% of peak)")
    else:
        vs_c = f", compiled {ms['compiled']:.3f} ms" if ms.get("compiled") else ""
        print(f"summary: grpo_loss fwd+bwd N={N} T={T} on CPU: eager {ms['eager']:.3f} ms{vs_c}; "
              "Triton numbers need a GPU")


if __name__ == "__main__":
    main()
