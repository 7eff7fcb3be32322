"""Markdown + JSON reports of one evaluation protocol over several models.

``write_report(results, protocol, out_dir)`` writes

    report.md               tables for people: headline metrics and scores, their 95%
                            intervals, failure modes, stage-wise diagnostics, skipped rows
    report.json             the same numbers for programs (and the plots), plus protocol
    samples_<model>.jsonl   every scored completion with its failure mode (for reading
                            what the model actually wrote)

The protocol is printed above the numbers on purpose: two columns of a report are only
comparable if the prompts, sampling settings, seed, token budget and samples per prompt
were the same, and the reader should not have to trust that.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eval.evaluate import EvalResult, SubsetResult
from eval.metrics import FAILURE_MODES

# (key, column header, format) of the headline table, in reading order.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("exact_match", "EM", "{:.3f}"),
    ("tolerance_accuracy", "Tol", "{:.3f}"),
    ("parseable_rate", "Parse", "{:.3f}"),
    ("malformed_rate", "Malf", "{:.3f}"),
    ("solution_tag_rate", "Sol-tag", "{:.3f}"),
    ("reasoning_tag_rate", "Reas-tag", "{:.3f}"),
    ("truncation_rate", "Trunc", "{:.3f}"),
    ("mean_completion_tokens", "Tokens", "{:.1f}"),
    ("repetition_rate", "Rep", "{:.3f}"),
    ("pass_at_k", "pass@k", "{:.3f}"),
    ("structure", "Struct", "{:.3f}"),
    ("correctness", "Corr", "{:.3f}"),
    ("composite", "Comp", "{:.3f}"),
)
STAGE_COLUMNS = ("exact_match", "tolerance_accuracy", "parseable_rate", "truncation_rate", "structure", "correctness", "composite")

NOTES = """\
Definitions. Rates are means over all completions. EM: the normalised SOLUTION equals the
normalised gold. Tol: EM or within half a unit of the example's stated precision (integers:
+-0.5). Parse:
exactly one SOLUTION block holding a number. Malf = 1 - Parse. Sol-/Reas-tag: exactly one
block of that tag. Trunc: hit the token budget without a complete answer. Rep: fraction of
repeated word trigrams. pass@k: any sample of a prompt exact. Struct = .35 Parse + .20 Sol
+ .20 Reas - .15 Malf - .10 Trunc; Corr = .70 EM + .20 Tol + .10 Parse; Comp = .45 EM +
.15 Tol + .15 Parse + .10 Sol + .05 Reas - .05 Malf - .05 Trunc. Intervals: Wilson for
rates (n = prompts, conservative when samples > 1), normal for means and scores. Failure
mode: the first of truncation > missing solution tag > missing reasoning tag > malformed >
unparseable (a number-like token the strict contract refuses) > wrong > exact.
"""


def _value(sub: SubsetResult, key: str) -> float:
    return sub.scores[key] if key in sub.scores else sub.metrics.get(key, math.nan)


def _fmt(fmt: str, v: float) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(results: Mapping[str, EvalResult], protocol: Mapping[str, Any], title: str, data: str) -> str:
    """The whole report as one Markdown string (no file I/O; tests read it directly)."""
    out = [f"# {title}", "", f"Data: {data}", ""]
    out += ["## Protocol", "", _table(["setting", "value"], [[k, str(v)] for k, v in protocol.items()]), ""]

    head = ["model", "n"] + [c[1] for c in COLUMNS]
    rows = [[name, str(r.overall.n_prompts)] + [_fmt(f, _value(r.overall, k)) for k, _, f in COLUMNS]
            for name, r in results.items()]
    out += ["## Headline metrics", "", _table(head, rows), ""]

    ci_rows = []
    for name, r in results.items():
        cells = []
        for key, _, fmt in COLUMNS:
            lo, hi = r.overall.intervals.get(key, (math.nan, math.nan))
            cells.append(f"[{_fmt(fmt, lo)}, {_fmt(fmt, hi)}]")
        ci_rows.append([name] + cells)
    out += ["## 95% intervals", "", _table(["model"] + [c[1] for c in COLUMNS], ci_rows), ""]

    fm_rows = []
    for name, r in results.items():
        n = max(r.overall.n_completions, 1)
        fm_rows.append([name] + [f"{r.overall.failure_modes.get(m, 0)} ({100 * r.overall.failure_modes.get(m, 0) / n:.1f}%)"
                                 for m in FAILURE_MODES])
    out += ["## Failure modes (one per completion)", "", _table(["model"] + list(FAILURE_MODES), fm_rows), ""]

    st_rows = []
    for name, r in results.items():
        for stage, sub in r.stages.items():
            st_rows.append([name, stage, str(sub.n_prompts)] + [_fmt("{:.3f}", _value(sub, k)) for k in STAGE_COLUMNS])
    out += ["## Stage-wise diagnostics (data/stages.py filters; stages overlap)", "",
            _table(["model", "stage", "n"] + [dict((c[0], c[1]) for c in COLUMNS)[k] for k in STAGE_COLUMNS], st_rows), ""]

    sk_rows = [[name, reason, str(n)] for name, r in results.items() for reason, n in sorted(r.skipped.items())]
    out += ["## Skipped rows", "", _table(["model", "reason", "count"], sk_rows) if sk_rows else "None.", ""]
    out += ["## Notes", "", NOTES]
    return "\n".join(out)


def report_dict(results: Mapping[str, EvalResult], protocol: Mapping[str, Any], title: str, data: str) -> dict[str, Any]:
    return {"title": title, "data": data, "protocol": dict(protocol),
            "models": {name: r.to_dict() for name, r in results.items()}}


def _finite(obj: Any) -> Any:
    """NaN (an empty stage subset's metrics) -> None, so the file is standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "model"


def write_report(
    results: Mapping[str, EvalResult],
    protocol: Mapping[str, Any],
    out_dir: str | Path,
    title: str = "Evaluation report",
    data: str = "",
) -> tuple[Path, Path]:
    """Write report.md, report.json and samples_<model>.jsonl into out_dir; return the two report paths."""
    if not results:
        raise ValueError("write_report: no results to report; evaluate at least one model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out / "report.md", out / "report.json"
    md_path.write_text(render_markdown(results, protocol, title, data), encoding="utf-8")
    payload = _finite(report_dict(results, protocol, title, data))
    json_path.write_text(json.dumps(payload, indent=2, allow_nan=False, default=str), encoding="utf-8")
    for name, r in results.items():
        with open(out / f"samples_{_safe_name(name)}.jsonl", "w", encoding="utf-8") as f:
            for rec in r.records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return md_path, json_path
