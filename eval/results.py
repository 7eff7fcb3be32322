"""Evaluation results: completions scored under one protocol, for many models, into one report.

Three entry points share every line that turns text into numbers:

    evaluate_completions(examples, completions, token_counts, max_new_tokens) -> EvalResult
        pure Python over texts: per-completion metrics (eval/metrics.py), aggregates with
        95% intervals, Structure / Correctness / Composite (eval/scores.py), the failure-
        mode breakdown, and the same again on each curriculum stage subset.
    evaluate_samples(examples, sample_pass, protocol) -> EvalResult
        the same over completions a callable draws, plus the shuffled-image control.
    grpo.evaluation.model_eval.evaluate_model(bundle, examples, protocol) -> EvalResult
        a model's completions under an EvalProtocol; lives above eval/ (it needs the
        sampler), together with the CLI ``python -m grpo.evaluate``.

The trainer's checkpoint-side eval (which feeds the controller gates) calls these same
functions, so a gate and a final report can never disagree about what "parseable" means.

Comparing models fairly means changing nothing but the weights: an ``EvalProtocol`` fixes
the prompts (the example list), sampling settings, seed, token budget and samples per
prompt, and the report prints it next to the numbers. The staged paper's final protocol
was one sample per prompt on its 456-row subset; that is the default here (greedy).

Rows that cannot be scored are skipped and counted (``EvalResult.skipped``), never a
crash: a gold answer that is not a number, a prompt with no completions, an image the
sampler could not encode.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from data.contract import normalize_number
from data.schema import Example
from data.stages import stage_filter
from eval.blind import BlindGap, ControlUnavailable, blind_gap, shuffle_images
from eval.metrics import CompletionMetrics, Summary, completion_metrics, mean_interval, summarize
from eval.reasoning import completion_reasoning, summarize_reasoning
from eval.scores import SCORE_KEYS, SCORE_WEIGHTS, all_scores

STAGES = (1, 2, 3)


@dataclass(frozen=True)
class EvalProtocol:
    """Everything that must be identical across the models of one comparison."""

    samples_per_prompt: int = 1
    """Completions per prompt (the paper's final eval: 1). Rates average over all of them."""
    max_new_tokens: int = 48
    """L: the completion budget; truncation is tok >= L without a complete answer."""
    temperature: float = 0.0
    """0 = greedy decoding; > 0 samples at that temperature."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus mass when sampling (1.0 = off)."""
    seed: int = 0
    """Seed of the sampler's generator (same seed + same model -> same completions)."""
    batch_size: int = 8
    """Prompts per sampler call. Part of the protocol when sampling: each batch has its
    own generator seeded by seed + batch start, so a different batch size draws differently."""
    image_control: bool = True
    """Also score every prompt with another example's image (eval/blind.py) and report the
    blind gap EM(true) - EM(shuffled) with its interval. Doubles the sampling time."""

    def validate(self) -> EvalProtocol:
        checks = [
            (self.samples_per_prompt >= 1, f"samples_per_prompt={self.samples_per_prompt}: must be >= 1"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens}: must be >= 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)"),
            (self.top_k >= 0, f"top_k={self.top_k}: must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p}: must be in (0, 1]"),
            (self.batch_size >= 1, f"batch_size={self.batch_size}: must be >= 1"),
            (self.temperature > 0 or self.samples_per_prompt == 1,
             f"samples_per_prompt={self.samples_per_prompt} with greedy decoding gives identical copies; "
             "set temperature > 0 or samples_per_prompt 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"EvalProtocol: {msg}")
        return self


@dataclass
class SubsetResult:
    """Metrics, scores, intervals and failure modes of one subset (overall or a stage)."""

    n_prompts: int
    n_completions: int
    metrics: dict[str, float]
    scores: dict[str, float]
    intervals: dict[str, tuple[float, float]]  # 95%, for every metric and score key
    failure_modes: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["intervals"] = {k: list(v) for k, v in self.intervals.items()}
        return d


@dataclass
class EvalResult:
    """What an evaluation returns: the overall subset, each stage subset, what was skipped."""

    overall: SubsetResult
    stages: dict[str, SubsetResult]  # "stage1", "stage2", "stage3"
    skipped: dict[str, int]  # reason -> rows not scored
    records: list[dict[str, Any]] = field(default_factory=list)  # one per completion
    # The shuffled-image control (eval/blind.py): "overall", "stage1".. -> BlindGap, or
    # None with control_note saying why there is none (pre-generated completions, n < 2).
    control: dict[str, BlindGap] | None = None
    control_note: str | None = None
    # Does the answer follow the reasoning, does the reasoning take the key steps
    # (eval/reasoning.py): "overall", "stage1".. -> metric -> value, lo, hi, n.
    reasoning: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def blind_gap(self) -> BlindGap | None:
        return None if self.control is None else self.control["overall"]

    def answer_spread(self) -> tuple[int, float, str | None]:
        """(distinct answers, the most common answer's share, that answer) over the
        completions that give one: a policy that answers one constant has 1 distinct answer
        whatever the image (a collapse a blind gap of 0 also shows, with its cause here)."""
        answers = [r.get("answer") for r in self.records if r.get("answer") is not None]
        if not answers:
            return 0, 0.0, None
        top, count = Counter(answers).most_common(1)[0]
        return len(set(answers)), count / len(answers), top

    @property
    def metrics(self) -> dict[str, float]:
        return self.overall.metrics

    @property
    def scores(self) -> dict[str, float]:
        return self.overall.scores

    def flat(self) -> dict[str, float]:
        """Overall metrics and scores in one dict: the trainer's "eval" log line and the gates."""
        flat = {**self.overall.metrics, **self.overall.scores, "n": float(self.overall.n_prompts)}
        if self.records:
            distinct, top_share, _ = self.answer_spread()
            flat.update(answers_distinct=float(distinct), answer_top_share=top_share)
        if self.blind_gap is not None:
            g = self.blind_gap
            flat.update(exact_match_shuffled=g.exact_match_shuffled, blind_gap=g.gap,
                        blind_gap_lo=g.lo, blind_gap_hi=g.hi)
        # only the numbers that exist: no key steps (MathVista rows) leaves key_step_accuracy out, not NaN
        flat.update({k: v["value"] for k, v in self.reasoning.get("overall", {}).items() if math.isfinite(v["value"])})
        return flat

    def to_dict(self, with_records: bool = False) -> dict[str, Any]:
        d = {
            "overall": self.overall.to_dict(),
            "stages": {k: v.to_dict() for k, v in self.stages.items()},
            "skipped": dict(self.skipped),
            "control": None if self.control is None else {k: v.to_dict() for k, v in self.control.items()},
            "control_note": self.control_note,
            "reasoning": self.reasoning,
        }
        if with_records:
            d["records"] = self.records
        return d


# ----------------------------------------------------------------------------- text -> EvalResult


def _subset_result(groups: Sequence[Sequence[CompletionMetrics]]) -> SubsetResult:
    summary: Summary = summarize(groups)
    groups = [g for g in groups if g]
    scores = all_scores(summary.metrics) if summary.n_completions else {k: math.nan for k in SCORE_KEYS}
    intervals = dict(summary.intervals)
    # Scores are linear in the rates, so a score = the mean of per-completion scores: its
    # interval is the normal interval of per-prompt mean scores (see eval/scores.py).
    per_completion = [[all_scores(c.as_rates()) for c in g] for g in groups]
    for key in SCORE_KEYS:
        w = SCORE_WEIGHTS[key].values()  # a score lies in [sum of negative, sum of positive weights]
        intervals[key] = mean_interval([sum(s[key] for s in g) / len(g) for g in per_completion],
                                       lo=sum(x for x in w if x < 0), hi=sum(x for x in w if x > 0))
    return SubsetResult(
        n_prompts=summary.n_prompts,
        n_completions=summary.n_completions,
        metrics=summary.metrics,
        scores=scores,
        intervals=intervals,
        failure_modes=summary.failure_modes,
    )


def _check_shapes(examples: Sequence[Example], completions: Sequence[Sequence[str]], token_counts) -> None:
    if len(completions) != len(examples) or len(token_counts) != len(examples):
        raise ValueError(
            f"evaluate_completions: {len(examples)} examples but {len(completions)} completion lists and "
            f"{len(token_counts)} token-count lists; pass one list of each per example"
        )
    for i, (texts, counts) in enumerate(zip(completions, token_counts)):
        if len(texts) != len(counts):
            raise ValueError(
                f"evaluate_completions: example {i} (pid {examples[i].pid}) has {len(texts)} completions but "
                f"{len(counts)} token counts; count every completion with the tokenizer that produced it"
            )


def evaluate_completions(
    examples: Sequence[Example],
    completions: Sequence[Sequence[str]],
    token_counts: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> EvalResult:
    """Score completions[i][j] (with token_counts[i][j]) against examples[i]."""
    _check_shapes(examples, completions, token_counts)
    predicates = {s: stage_filter(s) for s in STAGES}  # the curriculum's own filters (overlapping)
    skipped: dict[str, int] = {}
    overall: list[list[CompletionMetrics]] = []
    by_stage: dict[int, list[list[CompletionMetrics]]] = {s: [] for s in STAGES}
    records: list[dict[str, Any]] = []
    for ex, texts, counts in zip(examples, completions, token_counts):
        if normalize_number(ex.answer) is None:
            skipped["no_numeric_gold"] = skipped.get("no_numeric_gold", 0) + 1
            continue
        if not texts:
            skipped["no_completions"] = skipped.get("no_completions", 0) + 1
            continue
        group = [completion_metrics(t, ex.answer, ex.precision, int(n), max_new_tokens) for t, n in zip(texts, counts)]
        stages = [s for s in STAGES if predicates[s](ex)]
        overall.append(group)
        for s in stages:
            by_stage[s].append(group)
        for j, (text, cm) in enumerate(zip(texts, group)):
            records.append({"pid": ex.pid, "sample": j, "gold": ex.answer, "stages": stages, "text": text,
                            **cm.to_dict(), **completion_reasoning(text, ex.answer, ex.key_steps)})
    reasoning = {"overall": summarize_reasoning(records)}
    reasoning.update({f"stage{s}": summarize_reasoning([r for r in records if s in r["stages"]]) for s in STAGES})
    return EvalResult(
        overall=_subset_result(overall),
        stages={f"stage{s}": _subset_result(by_stage[s]) for s in STAGES},
        skipped=skipped,
        records=records,
        reasoning=reasoning,
    )


# ----------------------------------------------------------------------------- sampled -> EvalResult

Completions = tuple[list[list[str]], list[list[int]]]  # texts and content-token counts per example


def evaluate_samples(examples: Sequence[Example], sample_pass: Callable[[Sequence[Example]], Completions],
                     protocol: EvalProtocol) -> EvalResult:
    """Score ``sample_pass(examples)``; with ``protocol.image_control`` also a second pass
    over the same prompts with shuffled images (eval/blind.py), whose blind gap overall and
    per stage lands in ``result.control``.

    ``sample_pass`` is whatever draws completions from a model (grpo/evaluation/model_eval.py has the
    one-process and the trainer the data-parallel one): eval/ itself never sees a model.
    """
    protocol.validate()
    result = _score(examples, sample_pass(examples), protocol)
    if protocol.image_control:
        try:
            shuffled = shuffle_images(examples)
        except ControlUnavailable as err:
            result.control_note = str(err)
            return result
        control = _score(shuffled, sample_pass(shuffled), protocol)
        stage_pids = {f"stage{s}": {r["pid"] for r in result.records if s in r["stages"]} for s in STAGES}
        result.control = {"overall": blind_gap(result.records, control.records),
                          **{k: blind_gap(result.records, control.records, pids) for k, pids in stage_pids.items()}}
    return result


def _score(examples: Sequence[Example], completions: Completions, protocol: EvalProtocol) -> EvalResult:
    result = evaluate_completions(examples, *completions, protocol.max_new_tokens)
    lost = result.skipped.pop("no_completions", 0)
    if lost:  # an example whose image the processor could not encode got no completions
        result.skipped["sampler_skipped"] = lost
    return result
