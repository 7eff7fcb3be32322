"""The end-of-run report: base vs each phase's chosen checkpoint on the held-out test split.

The checkpoint-side evals that drive the controller use the *val* split; this report uses
the disjoint *test* split, so the numbers in the README were never used to choose a
checkpoint. On own data (``--run.data``) the test split is the tenth of its usable rows that
no phase trains on (data/holdout.py, grpo/run/phase_data.py). One protocol for every model
(eval.results.EvalProtocol: greedy, one sample per prompt, the training token budget),
written as report.md / report.json plus the training plots (eval/plots.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from grpo.config import TrainConfig
from grpo.config_checks import PHASES

# The checkpoint of each phase that the next phase starts from (and C's final pick).
REPORT_ALIAS = {"warmup": "latest", "A": "best_structure", "B": "best_composite", "C": "best_composite"}


def report_selectors(run_dir: Path, last_phase: str) -> list[str]:
    """The model the RL phases started from -- 'base' (the configured model as loaded), or
    'warmup:latest' where the run holds a warm-up -- then each GRPO phase run so far."""
    from grpo.state.registry import read_registry

    out = [] if read_registry(run_dir, "warmup").get("aliases") else ["base"]
    for phase in PHASES[: PHASES.index(last_phase) + 1]:
        if read_registry(run_dir, phase).get("aliases"):
            out.append(f"{phase}:{REPORT_ALIAS[phase]}")
            if phase != "warmup" and REPORT_ALIAS[phase] != "latest":
                out.append(f"{phase}:latest")
    return out


def write_final_report(run_dir: str | Path, last_phase: str, cfg: TrainConfig, device: str = "cpu") -> Path | None:
    from data.holdout import TEST_EVERY
    from eval.plots import plot_run
    from eval.report import control_summary, write_report
    from eval.results import EvalProtocol
    from grpo.evaluation.model_eval import evaluate_model
    from grpo.model.policy import policy_at
    from grpo.run.phase_data import report_examples
    from grpo.state.registry import resolve

    run_dir = Path(run_dir)
    examples, described = report_examples(cfg)
    if not examples:
        print(f"report: none, {cfg.run.data} has no held-out test rows (fewer than {TEST_EVERY} usable rows); "
              "evaluate on other data with python -m grpo.evaluate")
        return None
    protocol = EvalProtocol(max_new_tokens=cfg.sampling.max_new_tokens, temperature=0.0, seed=cfg.run.seed,
                            batch_size=64)
    results, by_path = {}, {}
    for selector in report_selectors(run_dir, last_phase):
        t0 = time.time()
        path = resolve(run_dir, selector).resolve() if selector != "base" else "base"
        if path in by_path:  # two aliases of one checkpoint (A:latest is often A:best_structure): greedy, same result
            results[selector] = results[by_path[path]]
        else:
            bundle = policy_at(None if selector == "base" else path, cfg, run_dir, device)
            results[selector] = evaluate_model(bundle, examples, protocol)
            by_path[path] = selector
        m = results[selector].metrics
        print(f"[test] {selector:<18} EM {m['exact_match']:.3f}  parse {m['parseable_rate']:.3f}  "
              f"composite {results[selector].scores['composite']:.3f}  ({time.time() - t0:.0f}s)", flush=True)
        for line in control_summary(selector, results[selector]):
            print(f"       {line}", flush=True)
    out = run_dir / "report"
    md, _ = write_report(results, protocol.__dict__, out, title=f"{run_dir.name}: test split after phase {last_phase}",
                         data=described)
    plot_run(run_dir / "train_log.jsonl", out)
    print(f"report: {md} (+ report.json, rewards.png, weights.png, checkpoints.png)")
    return md
