"""Evaluation: metrics and scores over completions, the blind-gap control, reports and plots.

Pure Python over texts: no model and nothing from grpo/ (layers point one way). Sampling a
model for an evaluation, and the CLI, live above in grpo/evaluation/model_eval.py and grpo/evaluate.py.
"""

from eval.metrics import FAILURE_MODES, MEAN_KEYS, RATE_KEYS, CompletionMetrics, completion_metrics, summarize, wilson_interval
from eval.results import EvalProtocol, EvalResult, SubsetResult, evaluate_completions, evaluate_samples
from eval.scores import SCORE_KEYS, all_scores, composite_score, correctness_score, structure_score

__all__ = [
    "EvalProtocol", "EvalResult", "SubsetResult", "evaluate_completions", "evaluate_samples",
    "FAILURE_MODES", "MEAN_KEYS", "RATE_KEYS", "CompletionMetrics", "completion_metrics", "summarize",
    "wilson_interval", "SCORE_KEYS", "all_scores", "composite_score", "correctness_score", "structure_score",
]
