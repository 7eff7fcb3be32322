"""Evaluation: metrics and scores over completions, the evaluation CLI, reports and plots.

Pure Python over texts except ``evaluate_model`` and the CLI, which import grpo lazily.
"""

from eval.evaluate import EvalProtocol, EvalResult, SubsetResult, evaluate_completions, evaluate_model
from eval.metrics import FAILURE_MODES, MEAN_KEYS, RATE_KEYS, CompletionMetrics, completion_metrics, summarize, wilson_interval
from eval.scores import SCORE_KEYS, all_scores, composite_score, correctness_score, structure_score

__all__ = [
    "EvalProtocol", "EvalResult", "SubsetResult", "evaluate_completions", "evaluate_model",
    "FAILURE_MODES", "MEAN_KEYS", "RATE_KEYS", "CompletionMetrics", "completion_metrics", "summarize",
    "wilson_interval", "SCORE_KEYS", "all_scores", "composite_score", "correctness_score", "structure_score",
]
