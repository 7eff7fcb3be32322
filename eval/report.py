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

from eval.blind import BlindGap
from eval.metrics import FAILURE_MODES
from eval.results import EvalResult, SubsetResult
from grpo_infra.atomic import replace_files

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
STAGE_COLUMNS = ("exact_match", "tolerance_accuracy", "parseable_rate", "truncation_rate", "structure", "correctness",
                 "composite")

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
unparseable (a number-like token the strict contract refuses) > wrong > exact. Blind gap:
EM with the true images minus EM with each image swapped for another example's of the same
family (same prompts, same protocol); its interval is the paired normal interval of the
per-prompt differences. An interval that includes 0 means the model's exact match does not
measurably depend on what the picture shows.
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

    # EM, then its control beside it: EM with shuffled images and the blind gap.
    head = ["model", "n", COLUMNS[0][1], "EM shuf", "Gap"] + [c[1] for c in COLUMNS[1:]]
    rows = []
    for name, r in results.items():
        g = r.blind_gap
        cells = [_fmt(f, _value(r.overall, k)) for k, _, f in COLUMNS]
        ctrl = ["—", "—"] if g is None else [_fmt("{:.3f}", g.exact_match_shuffled), _fmt("{:+.3f}", g.gap)]
        rows.append([name, str(r.overall.n_prompts), cells[0], *ctrl, *cells[1:]])
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

    out += ["## Reasoning and answer (eval/reasoning.py)", "", *reasoning_lines(results), ""]

    out += ["## Visual-reliance control (images shuffled across examples, eval/blind.py)", "",
            *control_lines(results), ""]

    sk_rows = [[name, reason, str(n)] for name, r in results.items() for reason, n in sorted(r.skipped.items())]
    out += ["## Skipped rows", "", _table(["model", "reason", "count"], sk_rows) if sk_rows else "None.", ""]
    out += ["## Notes", "", NOTES]
    return "\n".join(out)


def gap_warning(name: str, gap: BlindGap) -> str | None:
    """The one-line warning printed wherever a blind gap's interval includes 0."""
    if gap.n and not gap.includes_zero:
        return None
    return (f"warning: {name}: the blind gap's 95% interval [{gap.lo:+.2f}, {gap.hi:+.2f}] includes 0 -- "
            f"its exact match does not measurably depend on the image")


def control_summary(name: str, result: EvalResult) -> list[str]:
    """What a console prints beside an EM: the control, the greedy answers' spread, and the
    warnings when they are needed."""
    lines = [f"control: none ({result.control_note or 'not run'})"] if result.blind_gap is None else \
        [f"control: {result.blind_gap}"] + ([w] if (w := gap_warning(name, result.blind_gap)) else [])
    if result.records:
        distinct, share, top = result.answer_spread()
        lines.append(f"answers: {distinct} distinct, the most common {top!r} in {share:.0%}" if distinct
                     else "answers: none parsed")
        if (w := collapse_warning(name, result)) is not None:
            lines.append(w)
    return lines


def collapse_warning(name: str, result: EvalResult) -> str | None:
    """One line when every answer is the same: what it means, the likely cause and the fix."""
    distinct, _, top = result.answer_spread()
    if distinct != 1 or result.overall.n_prompts < 2:
        return None
    return (f"warning: {name}: the policy answers {top!r} to every prompt (one constant, whatever the image): "
            "RL without reward signal collapsed onto the label prior; on data the base cannot answer, warm up "
            "on the labels first (--sft-first always) and keep a KL to the warm-up (--optim.beta 1); "
            "--run.stop_on_collapse stops a phase here")


def control_lines(results: Mapping[str, EvalResult]) -> list[str]:
    """The control table (EM true vs shuffled and the paired gap, overall and per stage) + warnings."""
    rows, notes = [], []
    for name, r in results.items():
        if r.control is None:
            notes.append(f"- {name}: no control ({r.control_note or 'not run'}).")
            continue
        for subset, g in r.control.items():
            rows.append([name, subset, str(g.n), _fmt("{:.3f}", g.exact_match), _fmt("{:.3f}", g.exact_match_shuffled),
                         _fmt("{:+.3f}", g.gap), f"[{_fmt('{:+.3f}', g.lo)}, {_fmt('{:+.3f}', g.hi)}]"])
        warning = gap_warning(name, r.control["overall"])
        if warning:
            notes.append(f"- **{warning}**")
    lines = [_table(["model", "subset", "n", "EM", "EM shuffled", "blind gap", "95% interval"], rows)] if rows else []
    return lines + ([""] if rows and notes else []) + notes


def reasoning_lines(results: Mapping[str, EvalResult]) -> list[str]:
    """Answer-follows-reasoning, right reasoning with a wrong answer and key-step accuracy, per
    model and subset, each with its 95% interval and n (the completions or prompts it is over)."""
    rows = []
    for name, r in results.items():
        for subset, m in r.reasoning.items():
            cells = []
            for key in ("answer_follows", "right_reasoning_wrong", "arithmetic_right", "key_step_accuracy"):
                v = m.get(key, {})
                cells.append(f"{_fmt('{:.3f}', v.get('value'))} [{_fmt('{:.3f}', v.get('lo'))}, "
                             f"{_fmt('{:.3f}', v.get('hi'))}] n={v.get('n', 0)}")
            rows.append([name, subset, *cells])
    if not rows:
        return ["None."]
    return [_table(["model", "subset", "answer follows reasoning", "right reasoning, wrong answer",
                    "arithmetic right", "key-step accuracy"], rows), "",
            "Answer follows reasoning: the SOLUTION equals the number the REASONING ends on (n = completions with "
            "both). Right reasoning, wrong answer: that number is the gold and the SOLUTION is not (n = completions). "
            "Arithmetic right: every 'expression = number' of the REASONING is right (n = completions with one). "
            "Key-step accuracy: share of the example's key steps found in the REASONING (n = prompts with key steps)."]


def report_dict(results: Mapping[str, EvalResult], protocol: Mapping[str, Any], title: str, data: str) -> dict[str, Any]:
    return {"title": title, "data": data, "protocol": dict(protocol),
            "models": {name: r.to_dict() for name, r in results.items()}}


def json_safe(obj: Any) -> Any:
    """NaN / inf (an empty stage subset's metrics) -> None, recursively, so the file is standard JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
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
    """Write report.md, report.json and samples_<model>.jsonl into out_dir; return the two report paths.

    Every file is first written whole under a temporary name beside it, and only when all of
    them are written are they renamed into place (grpo_infra/atomic.py): a failed write (a full
    disk) leaves the previous report as it was and no partial file. The
    renames are a few system calls; grpo.evaluate holds the stop signals around this call."""
    if not results:
        raise ValueError("write_report: no results to report; evaluate at least one model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out / "report.md", out / "report.json"
    payload = json_safe(report_dict(results, protocol, title, data))
    files = {md_path: render_markdown(results, protocol, title, data),
             json_path: json.dumps(payload, indent=2, allow_nan=False, default=str)}
    for name, r in results.items():
        files[out / f"samples_{_safe_name(name)}.jsonl"] = "".join(
            json.dumps(rec, ensure_ascii=False) + "\n" for rec in r.records)
    replace_files(files)
    return md_path, json_path
