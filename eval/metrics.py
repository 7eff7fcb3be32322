"""Per-completion metrics, their aggregation, and 95% intervals. Pure Python, no torch.

Every number here is read off a completion through the one response contract
(``data.contract.parse_response``), so what the evaluation counts as "parseable" or
"exact" is exactly what the rewards paid for during training.

Per completion (docs/design.md, section 2; L = max new tokens, tok = completion tokens counted
with the real tokenizer):

    solution_tag   exactly one <SOLUTION>...</SOLUTION> block
    reasoning_tag  exactly one <REASONING>...</REASONING> block
    parseable      the single solution block is a contract number
    malformed      not parseable (solution blocks != 1, empty, or not a number)
    exact          normalised answer == normalised gold
    tolerant       exact, or within the example's precision (contract.within_tolerance)
    truncated      tok >= L and the completion is not structurally complete
                   (complete = both tags right and parseable). A completion that closes
                   its answer on exactly the last allowed token is *not* truncated.
    repetition     fraction of word trigrams that repeat an earlier trigram
                   (1 - unique/total): 0 for fresh text, -> 1 for a loop

Each completion also gets exactly one failure mode, the first that applies in this order:

    truncation > missing_solution_tag > missing_reasoning_tag > malformed
               > unparseable > wrong > exact

``missing_solution_tag`` means "not exactly one" SOLUTION block (none, or several).
``malformed`` and ``unparseable`` split the contract's single "malformed" flag (whose rate
the scores and the controller use) into two diagnoses that need different fixes:
*unparseable* = the solution block holds one number-like token the strict contract
refuses ("3/4", "5%", "$5", "1,00", "−5"); *malformed* = anything else (empty, words,
units, several tokens). The first is a format habit, the second a missing answer.

Aggregation: every rate is a mean over all completions (with one sample per prompt this
is the paper's protocol). pass_at_k is per prompt: any of its samples exact.

Intervals (95%): rates use the Wilson score interval. With one sample per prompt that is
the textbook interval over n prompts. With G > 1 samples per prompt the completions of a
prompt are correlated, so n is still the number of *prompts*: treating each prompt's mean
as one Bernoulli draw overstates its variance, so the interval is conservative, never
falsely tight. Means (tokens, repetition, scores) use a normal interval over per-prompt
means. The staged paper gated on 4 examples, where every rate moves in steps of .25 and
a Wilson interval spans most of [0, 1]: the report prints the interval so that is visible.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from data.contract import is_exact, parse_response, within_tolerance

FAILURE_MODES = (
    "truncation",
    "missing_solution_tag",
    "missing_reasoning_tag",
    "malformed",
    "unparseable",
    "wrong",
    "exact",
)
# Rates: means of per-completion booleans. Names are the keys every consumer uses
# (scores, controller gates, reports, the trainer's "eval" log lines).
RATE_KEYS = (
    "exact_match",
    "tolerance_accuracy",
    "parseable_rate",
    "malformed_rate",
    "solution_tag_rate",
    "reasoning_tag_rate",
    "truncation_rate",
)
MEAN_KEYS = ("mean_completion_tokens", "repetition_rate")
Z95 = 1.959963984540054  # two-sided 95% normal quantile

# A single token with a digit and no letters or spaces: what a model meant as a number.
_NUMBER_LIKE_RE = re.compile(r"[^\sA-Za-z]*\d[^\sA-Za-z]*")


@dataclass(frozen=True)
class CompletionMetrics:
    """What one completion scored; one row of the per-completion table."""

    answer: str | None  # normalised numeric answer, if parseable
    solution_tag: bool
    reasoning_tag: bool
    parseable: bool
    malformed: bool
    exact: bool
    tolerant: bool
    truncated: bool
    tokens: int
    repetition: float
    failure_mode: str

    def as_rates(self) -> dict[str, float]:
        """This completion as 0/1 values under the aggregate rate names (for the scores)."""
        return {
            "exact_match": float(self.exact),
            "tolerance_accuracy": float(self.tolerant),
            "parseable_rate": float(self.parseable),
            "malformed_rate": float(self.malformed),
            "solution_tag_rate": float(self.solution_tag),
            "reasoning_tag_rate": float(self.reasoning_tag),
            "truncation_rate": float(self.truncated),
        }

    def to_dict(self) -> dict:
        return asdict(self)


def repetition_rate(text: str, n: int = 3) -> float:
    """Fraction of word n-grams that repeat an earlier one (0 if fewer than n words)."""
    words = text.split()
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def failure_mode(
    truncated: bool, solution_tag: bool, reasoning_tag: bool, parseable: bool, number_like: bool, exact: bool
) -> str:
    """The first failure that applies, in the priority order of FAILURE_MODES."""
    if truncated:
        return "truncation"
    if not solution_tag:
        return "missing_solution_tag"
    if not reasoning_tag:
        return "missing_reasoning_tag"
    if not parseable:
        return "unparseable" if number_like else "malformed"
    return "exact" if exact else "wrong"


def completion_metrics(
    text: str, gold: str, precision: int | None, tokens: int, max_new_tokens: int
) -> CompletionMetrics:
    """Score one completion against its gold answer under the response contract."""
    if not isinstance(tokens, numbers.Integral) or tokens < 0:
        raise ValueError(f"tokens={tokens!r}: pass the completion's token count (an int >= 0) from its tokenizer")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: the completion budget L must be >= 1")
    p = parse_response(text)
    exact = is_exact(p.answer, gold)
    tolerant = exact or within_tolerance(p.answer, gold, precision)
    complete = p.has_reasoning_tag and p.has_solution_tag and p.parseable
    truncated = tokens >= max_new_tokens and not complete
    body = (p.solution_raw or "").strip()
    number_like = bool(_NUMBER_LIKE_RE.fullmatch(body))
    return CompletionMetrics(
        answer=p.answer,
        solution_tag=p.has_solution_tag,
        reasoning_tag=p.has_reasoning_tag,
        parseable=p.parseable,
        malformed=p.malformed,
        exact=exact,
        tolerant=tolerant,
        truncated=truncated,
        tokens=int(tokens),
        repetition=repetition_rate(text),
        failure_mode=failure_mode(truncated, p.has_solution_tag, p.has_reasoning_tag, p.parseable, number_like, exact),
    )


# ----------------------------------------------------------------------------- intervals


def wilson_interval(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (k may be fractional: n * rate)."""
    if n <= 0:
        return (0.0, 1.0)  # no data: the honest interval is everything
    p = min(max(k / n, 0.0), 1.0)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(
    values: Sequence[float], lo: float = -math.inf, hi: float = math.inf, z: float = Z95
) -> tuple[float, float]:
    """Normal-approximation interval of the mean (sample sd), clipped to the range [lo, hi]
    the quantity can take (a token count is never negative); zero width for n < 2."""
    n = len(values)
    if n == 0:
        return (math.nan, math.nan)
    m = sum(values) / n
    if n < 2:
        return (m, m)
    var = sum((v - m) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return (max(lo, m - half), min(hi, m + half))


# ----------------------------------------------------------------------------- aggregation


@dataclass
class Summary:
    """Aggregate of a set of prompts, each with one or more scored completions."""

    n_prompts: int
    n_completions: int
    metrics: dict[str, float]  # RATE_KEYS + MEAN_KEYS + pass_at_k
    intervals: dict[str, tuple[float, float]]  # 95% interval per metric key
    failure_modes: dict[str, int]  # FAILURE_MODES -> count (sums to n_completions)

    def to_dict(self) -> dict:
        return {
            "n_prompts": self.n_prompts,
            "n_completions": self.n_completions,
            "metrics": dict(self.metrics),
            "intervals": {k: list(v) for k, v in self.intervals.items()},
            "failure_modes": dict(self.failure_modes),
        }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def summarize(groups: Sequence[Sequence[CompletionMetrics]]) -> Summary:
    """Aggregate per-prompt groups of completions into rates, means, intervals, modes.

    An empty input gives NaN metrics and [0, 1] rate intervals rather than an error: a
    stage subset can legitimately be empty (e.g. no stage-3 rows in a small eval set).
    """
    groups = [g for g in groups if len(g) > 0]
    flat = [c for g in groups for c in g]
    n_prompts, n = len(groups), len(flat)
    metrics: dict[str, float] = {}
    intervals: dict[str, tuple[float, float]] = {}
    for key in RATE_KEYS:
        rate = _mean([c.as_rates()[key] for c in flat])
        metrics[key] = rate
        # Wilson on the prompt count (see module docstring): rate * n_prompts "successes".
        intervals[key] = wilson_interval(rate * n_prompts if n else 0.0, n_prompts)
    per_prompt_tokens = [_mean([c.tokens for c in g]) for g in groups]
    per_prompt_rep = [_mean([c.repetition for c in g]) for g in groups]
    metrics["mean_completion_tokens"] = _mean([c.tokens for c in flat])
    metrics["repetition_rate"] = _mean([c.repetition for c in flat])
    intervals["mean_completion_tokens"] = mean_interval(per_prompt_tokens, lo=0.0)
    intervals["repetition_rate"] = mean_interval(per_prompt_rep, lo=0.0, hi=1.0)
    hits = sum(any(c.exact for c in g) for g in groups)
    metrics["pass_at_k"] = hits / n_prompts if n_prompts else math.nan
    intervals["pass_at_k"] = wilson_interval(hits, n_prompts)
    modes = {m: 0 for m in FAILURE_MODES}
    for c in flat:
        modes[c.failure_mode] += 1
    return Summary(n_prompts=n_prompts, n_completions=n, metrics=metrics, intervals=intervals, failure_modes=modes)
