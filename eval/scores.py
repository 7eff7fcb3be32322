"""Checkpoint scores of the staged metric-gated paper: Structure, Correctness, Composite.

All three are fixed linear combinations of aggregate rates (docs/design.md, section 5):

    Structure   = .35 parse + .20 sol-tag + .20 reas-tag - .15 malformed - .10 trunc
    Correctness = .70 EM + .20 tol + .10 parse
    Composite   = .45 EM + .15 tol + .15 parse + .10 sol-tag + .05 reas-tag
                  - .05 malformed - .05 trunc

They back the checkpoint aliases best_structure / best_correctness / best_composite
(grpo/state/registry.py) and the report. Structure rewards a checkable answer whatever its
value; Correctness is mostly exact match; Composite weighs both, so a checkpoint that
answers right but unreadably does not win it.

Because each score is linear in the rates, a score also equals the mean of the same
formula applied to every completion's 0/1 indicators. The evaluator uses that to put a
95% interval on a score (eval/results.py), with no extra approximation.

The staged paper's Table 6 (MathVista testmini, n=456) is reproduced from its rate
columns in tests/test_eval_scores.py.
"""

from __future__ import annotations

from collections.abc import Mapping

# Keys are the aggregate rate names of eval/metrics.py (RATE_KEYS).
STRUCTURE_WEIGHTS: dict[str, float] = {
    "parseable_rate": 0.35,
    "solution_tag_rate": 0.20,
    "reasoning_tag_rate": 0.20,
    "malformed_rate": -0.15,
    "truncation_rate": -0.10,
}
CORRECTNESS_WEIGHTS: dict[str, float] = {
    "exact_match": 0.70,
    "tolerance_accuracy": 0.20,
    "parseable_rate": 0.10,
}
COMPOSITE_WEIGHTS: dict[str, float] = {
    "exact_match": 0.45,
    "tolerance_accuracy": 0.15,
    "parseable_rate": 0.15,
    "solution_tag_rate": 0.10,
    "reasoning_tag_rate": 0.05,
    "malformed_rate": -0.05,
    "truncation_rate": -0.05,
}
SCORE_WEIGHTS: dict[str, dict[str, float]] = {
    "structure": STRUCTURE_WEIGHTS,
    "correctness": CORRECTNESS_WEIGHTS,
    "composite": COMPOSITE_WEIGHTS,
}
SCORE_KEYS = tuple(SCORE_WEIGHTS)


def _weighted(rates: Mapping[str, float], weights: Mapping[str, float], name: str) -> float:
    missing = [k for k in weights if k not in rates]
    if missing:
        raise KeyError(
            f"{name} score needs the rates {', '.join(missing)}; got {', '.join(sorted(rates)) or 'none'} "
            "(pass the metrics dict of eval.metrics.summarize or EvalResult.metrics)"
        )
    return sum(w * float(rates[k]) for k, w in weights.items())


def structure_score(rates: Mapping[str, float]) -> float:
    """.35 parse + .20 sol-tag + .20 reas-tag - .15 malformed - .10 trunc."""
    return _weighted(rates, STRUCTURE_WEIGHTS, "structure")


def correctness_score(rates: Mapping[str, float]) -> float:
    """.70 EM + .20 tol + .10 parse."""
    return _weighted(rates, CORRECTNESS_WEIGHTS, "correctness")


def composite_score(rates: Mapping[str, float]) -> float:
    """.45 EM + .15 tol + .15 parse + .10 sol-tag + .05 reas-tag - .05 malformed - .05 trunc."""
    return _weighted(rates, COMPOSITE_WEIGHTS, "composite")


def all_scores(rates: Mapping[str, float]) -> dict[str, float]:
    """{'structure': ..., 'correctness': ..., 'composite': ...} from one rates dict."""
    return {name: _weighted(rates, w, name) for name, w in SCORE_WEIGHTS.items()}
