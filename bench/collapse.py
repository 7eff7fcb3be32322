"""Collapse where the base is near chance: the main command on own data, and the levers against it.

    python -m data.clock --out clock --n 600 --seed 0          # a figure family the base never saw
    python -m bench.collapse --data clock                      # every arm x seeds 0,1,2, then the tables
    python -m bench.collapse --data clock --arms default,entropy --seeds 0

What it runs
------------
Each run is RL from the base on own data, ``python -m grpo.train --phase B --run.data DATA
--sft-first never`` (the shipped base -> A -> B with the defaults, then the end-of-run report on
the data's held-out tenth: the own-data command as it was before it learned to warm up on the
labels first where the base has no signal, grpo/own_data.py), plus ``--run.seed k`` and the
arm's options (ARMS), as a subprocess with its own run directory ``<out>/<arm>/seed<k>/`` (the
trainer's console output beside it, in ``seed<k>.out``). A run whose report exists is finished and never rerun; an interrupted one
is continued by the trainer itself (the same command resumes). The run directory is held
(grpo/run/lock.py) while its trainer (handed the lock) and its trace run. ``--trainer-args`` appends
options to every run (the smoke test shrinks the phases with it).

What it measures
----------------
Per run, on the held-out test rows (the same rows for every arm and seed: data/holdout.py
chooses them by pid):

    EM              B:latest's greedy exact match, from the run's own report (Wilson 95%)
    chance          the share of the most common gold answer: what one constant answer scores
    blind gap       EM - EM with the images swapped (the report's control)
    greedy answers  distinct greedy answers of B:latest over the test rows (1 = one constant answer)
    sampled         B:latest sampled at temperature 1, --samples per prompt: distinct answers
                    per prompt (mean; 1 = deterministic) and pass@k
    entropy, zero-spread   the mean of phase B's last 10 steps (train_log.jsonl)
    T end           the sampling temperature at B's last step (the controller's gate raises it)
    ent < .1 at     the first step (phase:step) whose token entropy is below .1, or never

and a trace per run (trace/: ``grpo.evaluate`` of the base and of the checkpoints at steps
that are multiples of 20 and each phase's last, sampled as above), so the collapse can be
read checkpoint by checkpoint. Over seeds: mean and min..max (bench.learning's aggregate),
and each arm's EM paired against the default's on the same seed (mean, min..max, and on how
many seeds it is above).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.learning import aggregate
from grpo.run.lock import RunDirBusy, RunLock, acquire

ARMS: dict[str, tuple[str, list[str]]] = {
    "default": ("the own-data command as a user runs it", []),
    "clip_higher": ("DAPO's clip-higher: ratio clipped at 1 + .28 above", ["--optim.eps_high", "0.28"]),
    # With one update per rollout batch the importance ratio is 1 on every token (on-policy), so
    # no clip binds; clip-higher acts only with several updates per batch: these two arms.
    "mu2": ("two updates per rollout batch (the ratio moves, the clip can bind)", ["--optim.updates_per_batch", "2"]),
    "mu2_clip_higher": ("two updates per batch and clip-higher .28",
                        ["--optim.updates_per_batch", "2", "--optim.eps_high", "0.28"]),
    "reach": ("the gate's cap at 2.0 (today 1.2)", ["--sampling.temperature_max", "2.0"]),
    "reach_often": ("cap 2.0 and a checkpoint (so a gate step) every 5 steps",
                    ["--sampling.temperature_max", "2.0", "--run.eval_every", "5"]),
    "entropy": ("an entropy bonus, coefficient .01", ["--optim.entropy_coef", "0.01"]),
    "entropy_05": ("an entropy bonus, coefficient .05", ["--optim.entropy_coef", "0.05"]),
    "combined": ("clip-higher + cap 2.0 every 5 steps + entropy .05",
                 ["--optim.eps_high", "0.28", "--sampling.temperature_max", "2.0", "--run.eval_every", "5",
                  "--optim.entropy_coef", "0.05"]),
}
TRACE_EVERY = 20  # the default run.eval_every: the checkpoints every arm has
LOW_ENTROPY = 0.1
TAIL = 10  # steps averaged for "at the end"


class Fail(Exception):
    """A bad argument or a failed run: one line for the user."""


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_rows(data: Path, out: Path) -> Path:
    """``out/test_rows``: the data's held-out rows (the report's) as their own set, written once."""
    from data.holdout import split_test
    from data.jsonl import DATA_FILE
    from data.sources import load_source, source_kind
    from grpo_infra.atomic import new_directory

    target = out / "test_rows"
    if (target / DATA_FILE).is_file():
        return target
    if source_kind(data) != "jsonl":
        raise Fail(f"--data {data}: bench.collapse reads a data.jsonl directory (python -m data.clock writes one)")
    examples, _ = load_source(data)
    _, test = split_test(examples)
    if not test:
        raise Fail(f"--data {data}: {len(examples)} usable rows hold out no test row; give at least 10")
    pids = {ex.pid for ex in test}
    rows = [r for r in _lines(data / DATA_FILE) if r.get("pid") in pids]
    with new_directory(target) as tmp:
        for r in rows:
            for name in r.get("images") or [r["image"]]:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(data / name, tmp / name)
        (tmp / DATA_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target


def command(arm: str, seed: int, data: Path, run_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "grpo.train", "--phase", "B", "--run.data", str(data), "--sft-first", "never",
            "--run.seed", str(seed), "--run.run_dir", str(run_dir), *ARMS[arm][1], *extra]


def _call(argv: list[str], log: Path, what: str, lock: RunLock | None = None) -> None:
    """One command, its output appended to ``log``; a trainer is handed ``lock``, the run
    directory's lock this process holds (grpo/run/lock.py), so it writes there as its writer."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, **(lock.child() if lock else {})).returncode
    if code != 0:
        raise Fail(f"{what} exited {code}; its output is in {log}")


def _trace_selectors(run_dir: Path) -> list[str]:
    from grpo.state.registry import read_registry

    out = ["base"]
    for phase in ("A", "B"):
        steps = sorted(c["step"] for c in read_registry(run_dir, phase)["checkpoints"])
        out += [f"{phase}:{s}" for s in steps if s % TRACE_EVERY == 0 or s == steps[-1]]
    return out


def ensure(arm: str, seed: int, args: argparse.Namespace, rows: Path) -> Path:
    """Train (or finish) one run and its trace, holding its run directory throughout (its trainer
    is handed the lock; the trace's grpo.evaluate only reads checkpoints); returns the directory."""
    run_dir = args.out / arm / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = acquire(run_dir, other="another --out", wait_flag=None)
    except RunDirBusy as err:
        raise Fail(f"{arm} seed {seed}: {err}") from None
    try:
        _ensure(arm, seed, args, rows, run_dir, lock)
    finally:
        lock.release()
    return run_dir


def _ensure(arm: str, seed: int, args: argparse.Namespace, rows: Path, run_dir: Path, lock: RunLock) -> None:
    log = args.out / arm / f"seed{seed}.out"
    if not (run_dir / "report" / "report.json").is_file():
        print(f"  training {arm} seed {seed} ...", flush=True)
        _call(command(arm, seed, args.data, run_dir, args.trainer_args), log, f"{arm} seed {seed}'s training", lock)
    trace = run_dir / "trace"
    if not (trace / "report.json").is_file():
        tmp = run_dir / "trace.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        _call([sys.executable, "-m", "grpo.evaluate", "--run-dir", str(run_dir), "--data", str(rows),
               "--samples", str(args.samples), "--temperature", "1", "--seed", str(seed), "--out", str(tmp),
               *_trace_selectors(run_dir)], log, f"{arm} seed {seed}'s trace")
        tmp.rename(trace)


def _window_mean(window: list[dict], key: str) -> float:
    """The mean of ``key`` over a window of log records (nan for an empty one)."""
    return sum(r[key] for r in window) / len(window) if window else float("nan")


def _sampled(samples: Path) -> dict[str, float]:
    """Distinct parsed answers per prompt (mean) and over the set, from one selector's samples file."""
    per: dict[str, set] = {}
    for r in _lines(samples):
        per.setdefault(r["pid"], set())
        if r.get("parseable"):
            per[r["pid"]].add(r["answer"])
    return {"per_prompt": sum(len(v) for v in per.values()) / max(1, len(per)),
            "overall": len(set().union(*per.values())) if per else 0}


def _samples_file(directory: Path, selector: str) -> Path:
    return directory / f"samples_{selector.replace(':', '_')}.jsonl"


def first_low_entropy(log: list[dict]) -> str:
    hit = next((r for r in log if "entropy" in r and "reward" in r and r["entropy"] < LOW_ENTROPY), None)
    return f"{hit['phase']}{hit['step']}" if hit else "never"


def measure(run_dir: Path) -> dict[str, Any]:
    """The numbers of one run (see the module doc)."""
    report = json.loads((run_dir / "report" / "report.json").read_text())
    final = report["models"]["B:latest"]
    log = _lines(run_dir / "train_log.jsonl")
    steps = [r for r in log if "reward" in r and r.get("phase") == "B"]
    tail = steps[-TAIL:]
    greedy = _lines(_samples_file(run_dir / "report", "B:latest"))
    gold = Counter(r["gold"] for r in greedy)
    trace = json.loads((run_dir / "trace" / "report.json").read_text())
    last_sel = [s for s in trace["models"] if s.startswith("B:")][-1]
    sampled = _sampled(_samples_file(run_dir / "trace", last_sel))
    em_lo, em_hi = final["overall"]["intervals"]["exact_match"]
    return {
        "em": final["overall"]["metrics"]["exact_match"], "em_lo": em_lo, "em_hi": em_hi,
        "base_em": report["models"]["base"]["overall"]["metrics"]["exact_match"],
        "chance": gold.most_common(1)[0][1] / len(greedy), "n_test": len(greedy),
        "blind_gap": final["control"]["overall"]["gap"],
        "greedy_answers": len({r["answer"] for r in greedy if r.get("parseable")}),
        "sampled_per_prompt": sampled["per_prompt"], "sampled_overall": sampled["overall"],
        "pass_at_k": trace["models"][last_sel]["overall"]["metrics"]["pass_at_k"],
        "entropy_end": sum(r["entropy"] for r in tail) / len(tail),
        "zero_spread_end": sum(r["zero_spread"] for r in tail) / len(tail),
        "temperature_end": tail[-1]["temperature"],
        "low_entropy_at": first_low_entropy(log),
    }


def trace_rows(run_dir: Path) -> list[list[str]]:
    """One row per traced checkpoint: step, the trainer's eval EM, entropy / zero-spread / T of the
    steps up to it (mean of the last TRACE_EVERY), sampled distinct answers and pass@k."""
    log = _lines(run_dir / "train_log.jsonl")
    trace = json.loads((run_dir / "trace" / "report.json").read_text())
    evals = {(r["phase"], r["step"]): r["metrics"]["exact_match"] for r in log if r.get("event") == "eval"}
    out = []
    for sel, m in trace["models"].items():
        s = _sampled(_samples_file(run_dir / "trace", sel))
        if sel == "base":
            cells = ["base", "", "", "", ""]
        else:
            phase, step = sel.split(":")
            window = [r for r in log if "reward" in r and r["phase"] == phase and int(step) - TRACE_EVERY < r["step"]
                      <= int(step)]
            em = evals.get((phase, int(step)))
            cells = [sel, "" if em is None else f"{em:.3f}", f"{_window_mean(window, 'entropy'):.3f}",
                     f"{_window_mean(window, 'zero_spread'):.2f}",
                     f"{window[-1]['temperature']:.1f}" if window else ""]
        out.append(cells + [f"{m['overall']['metrics']['exact_match']:.3f}", f"{s['per_prompt']:.2f}",
                            str(s["overall"]), f"{m['overall']['metrics']['pass_at_k']:.3f}"])
    return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _cell(values: dict[int, float], fmt: str) -> str:
    agg = aggregate({s: {"value": v} for s, v in values.items()})
    if agg is None:
        return "-"
    if agg["n"] == 1:
        return fmt.format(agg["mean"])
    return f"{fmt.format(agg['mean'])} ({fmt.format(agg['min'])}..{fmt.format(agg['max'])})"


def summary(results: dict[str, dict[int, dict]], k: int) -> list[str]:
    """The arm table (mean (min..max) over seeds) and the per-seed lines."""
    default = results.get("default", {})
    rows = []
    for arm, per in results.items():
        paired = {s: m["em"] - default[s]["em"] for s, m in per.items() if s in default}
        above = sum(d > 0 for d in paired.values())
        rows.append([arm, ",".join(map(str, sorted(per))), _cell({s: m["em"] for s, m in per.items()}, "{:.3f}"),
                     "" if arm == "default" else _cell(paired, "{:+.3f}") + f", above on {above}/{len(paired)}",
                     _cell({s: m["blind_gap"] for s, m in per.items()}, "{:+.3f}"),
                     _cell({s: m["entropy_end"] for s, m in per.items()}, "{:.3f}"),
                     _cell({s: m["zero_spread_end"] for s, m in per.items()}, "{:.2f}"),
                     _cell({s: m["temperature_end"] for s, m in per.items()}, "{:.1f}"),
                     _cell({s: m["greedy_answers"] for s, m in per.items()}, "{:.1f}"),
                     _cell({s: m["sampled_per_prompt"] for s, m in per.items()}, "{:.2f}"),
                     _cell({s: m["pass_at_k"] for s, m in per.items()}, "{:.3f}"),
                     " ".join(m["low_entropy_at"] for _, m in sorted(per.items()))])
    any_run = next(m for per in results.values() for m in per.values())
    lines = [f"test rows: {any_run['n_test']}; chance (the most common gold answer's share) {any_run['chance']:.3f}; "
             f"the base's greedy EM {any_run['base_em']:.3f}", ""]
    lines += _table(["arm", "seeds", "EM", "EM - default (paired)", "blind gap", "entropy end", "zero-spread end",
                     "T end", "greedy answers", f"sampled answers / prompt (T 1, {k})", f"pass@{k}",
                     "entropy < .1 at (per seed)"], rows)
    lines += ["", "per seed: EM [Wilson 95%]"]
    for arm, per in results.items():
        lines.append(f"  {arm}: " + "; ".join(f"seed {s} {m['em']:.3f} [{m['em_lo']:.3f}, {m['em_hi']:.3f}]"
                                              for s, m in sorted(per.items())))
    return lines


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse would print its usage too)
        print(f"error: {message} (python -m bench.collapse --help lists the options)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m bench.collapse", description=__doc__.split("\n\n")[0],
                                 epilog="arms: " + "; ".join(f"{a}: {w} ({' '.join(o) or 'no options'})"
                                                             for a, (w, o) in ARMS.items()))
    ap.add_argument("--data", required=True, type=Path, help="a data.jsonl directory (python -m data.clock writes one)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/collapse"), help="where the runs go (resumable)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (default: all)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (default 0,1,2)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt at temperature 1 in the trace (default 8)")
    ap.add_argument("--trace-seed", type=int, default=None, help="print this seed's checkpoint trace of every arm "
                    "(default: the first seed)")
    ap.add_argument("--trainer-args", default="", help="options appended to every trainer run, e.g. "
                    "'--A.phase.steps 2 --B.phase.steps 2' (quoted, space separated)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        ap.error(f"--arms {args.arms!r}: {', '.join(bad) or 'none given'} unknown; use some of {', '.join(ARMS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2")
    if not seeds:
        ap.error("--seeds is empty: give comma-separated integers, e.g. 0,1,2")
    if args.samples < 1:
        ap.error(f"--samples {args.samples}: must be >= 1")
    if not args.data.is_dir():
        ap.error(f"--data {args.data}: not a directory; write one with python -m data.clock --out DIR")
    args.trainer_args = args.trainer_args.split()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        rows = test_rows(args.data, args.out)
        results: dict[str, dict[int, dict]] = {}
        for seed in seeds:  # seed-major: an interrupted benchmark has every arm of its first seeds
            for arm in arms:
                results.setdefault(arm, {})[seed] = measure(ensure(arm, seed, args, rows))
    except Fail as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.collapse stopped; the finished runs are kept, the same command resumes", file=sys.stderr)
        return 130
    trace_seed = seeds[0] if args.trace_seed is None else args.trace_seed
    lines = ["## bench.collapse", "", f"data {args.data}; trainer: python -m grpo.train --phase B --run.data DATA "
             f"--sft-first never --run.seed k [arm options] {' '.join(args.trainer_args)}".rstrip(), ""]
    lines += summary(results, args.samples)
    for arm in arms:
        if trace_seed in results[arm]:
            lines += ["", f"trace: {arm}, seed {trace_seed} (EM eval: the trainer's checkpoint eval; entropy, "
                      f"zero-spread: mean of the {TRACE_EVERY} steps up to it; T: at its last step; sampled at T 1, "
                      f"{args.samples} a prompt, on the test rows)", ""]
            lines += _table(["checkpoint", "EM eval", "entropy", "zero-spread", "T", "EM test (sampled)",
                             "answers / prompt", "answers overall", f"pass@{args.samples}"],
                            trace_rows(args.out / arm / f"seed{trace_seed}"))
    text = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
