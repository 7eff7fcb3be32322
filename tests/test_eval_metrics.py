"""Per-completion metrics, failure modes, aggregation and intervals (eval/metrics.py)."""

import math

import pytest

from eval.metrics import (
    FAILURE_MODES,
    completion_metrics,
    mean_interval,
    repetition_rate,
    summarize,
    wilson_interval,
)

L = 20  # completion budget in these tests
R, S = "<REASONING>count them</REASONING>", "<SOLUTION>{}</SOLUTION>"

# (completion text, tokens, gold, precision, expected failure mode, expected flags)
# flags: (solution_tag, reasoning_tag, parseable, exact, tolerant, truncated)
TABLE = [
    (R + S.format("12"), 8, "12", None, "exact", (1, 1, 1, 1, 1, 0)),
    (R + S.format("12.0"), 8, "12", None, "exact", (1, 1, 1, 1, 1, 0)),
    (R + S.format("1,200"), 8, "1200", None, "exact", (1, 1, 1, 1, 1, 0)),
    (R + S.format("13"), 8, "12", None, "wrong", (1, 1, 1, 0, 0, 0)),
    (R + S.format("2.34"), 8, "2.3", 1, "wrong", (1, 1, 1, 0, 1, 0)),  # tolerant, not exact
    (R + S.format("3/4"), 8, "0.75", 2, "unparseable", (1, 1, 0, 0, 0, 0)),
    (R + S.format("5%"), 8, "5", None, "unparseable", (1, 1, 0, 0, 0, 0)),
    (R + S.format("−5"), 8, "-5", None, "unparseable", (1, 1, 0, 0, 0, 0)),  # unicode minus
    (R + S.format("twelve"), 8, "12", None, "malformed", (1, 1, 0, 0, 0, 0)),
    (R + S.format("12 apples"), 8, "12", None, "malformed", (1, 1, 0, 0, 0, 0)),
    (R + S.format("  "), 8, "12", None, "malformed", (1, 1, 0, 0, 0, 0)),
    (S.format("12"), 5, "12", None, "missing_reasoning_tag", (1, 0, 1, 1, 1, 0)),
    (R + R + S.format("12"), 9, "12", None, "missing_reasoning_tag", (1, 0, 1, 1, 1, 0)),
    (R + "the answer is 12", 9, "12", None, "missing_solution_tag", (0, 1, 0, 0, 0, 0)),
    (R + S.format("12") + S.format("12"), 12, "12", None, "missing_solution_tag", (0, 1, 0, 0, 0, 0)),
    (R + "<SOLUTION>1", L, "12", None, "truncation", (0, 1, 0, 0, 0, 1)),  # cut mid-answer
    ("no tags at all, rambling", L + 3, "12", None, "truncation", (0, 0, 0, 0, 0, 1)),
    # A complete answer that used exactly the whole budget is NOT truncated.
    (R + S.format("12"), L, "12", None, "exact", (1, 1, 1, 1, 1, 0)),
]


@pytest.mark.parametrize("text,tokens,gold,precision,mode,flags", TABLE)
def test_failure_mode_table(text, tokens, gold, precision, mode, flags):
    m = completion_metrics(text, gold, precision, tokens, L)
    assert m.failure_mode == mode
    got = (m.solution_tag, m.reasoning_tag, m.parseable, m.exact, m.tolerant, m.truncated)
    assert tuple(int(x) for x in got) == flags
    assert m.malformed == (not m.parseable)  # the contract's malformed flag, used by the scores


def test_every_failure_mode_reached_and_priority_order():
    modes = {completion_metrics(t, g, p, n, L).failure_mode for t, n, g, p, _, _ in TABLE}
    assert modes == set(FAILURE_MODES)
    # truncation outranks a missing solution tag, which outranks a missing reasoning tag
    assert completion_metrics("<SOLUTION>x", "1", None, L, L).failure_mode == "truncation"
    assert completion_metrics("nothing", "1", None, 3, L).failure_mode == "missing_solution_tag"


def test_repetition_rate():
    assert repetition_rate("a b") == 0.0  # fewer words than n
    assert repetition_rate("one two three four five") == 0.0
    # 6 trigrams of "x y z x y z x y": xyz yzx zxy xyz yzx zxy -> 3 unique of 6
    assert repetition_rate("x y z x y z x y") == pytest.approx(0.5)
    assert repetition_rate("he " * 50) == pytest.approx(1 - 1 / 48)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="max_new_tokens"):
        completion_metrics("x", "1", None, 3, 0)
    with pytest.raises(ValueError, match="tokens=-1"):
        completion_metrics("x", "1", None, -1, 5)
    with pytest.raises(ValueError, match="tokens=None"):
        completion_metrics("x", "1", None, None, 5)


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    # the staged paper's 4-example gate: a rate of .75 is anywhere in ~[.30, .95]
    lo, hi = wilson_interval(3, 4)
    assert lo < 0.31 and hi > 0.95
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval_and_clipping():
    assert math.isnan(mean_interval([])[0])
    assert mean_interval([3.0]) == (3.0, 3.0)
    lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert lo < 2.0 < hi and hi - 2.0 == pytest.approx(2.0 - lo)
    assert mean_interval([0.0, 0.0, 10.0], lo=0.0)[0] == 0.0


def _m(exact, tokens=5):
    text = R + S.format("1" if exact else "2")
    return completion_metrics(text, "1", None, tokens, L)


def test_summarize_rates_pass_at_k_and_prompt_level_intervals():
    # 3 prompts x 2 samples: prompt 0 both right, prompt 1 one right, prompt 2 none
    groups = [[_m(True), _m(True)], [_m(True), _m(False, 9)], [_m(False), _m(False)]]
    s = summarize(groups)
    assert s.n_prompts == 3 and s.n_completions == 6
    assert s.metrics["exact_match"] == pytest.approx(3 / 6)
    assert s.metrics["pass_at_k"] == pytest.approx(2 / 3)
    assert s.metrics["mean_completion_tokens"] == pytest.approx((5 * 5 + 9) / 6)
    assert s.failure_modes == {**{m: 0 for m in FAILURE_MODES}, "exact": 3, "wrong": 3}
    # Wilson over the 3 prompts, not the 6 correlated completions (conservative)
    assert s.intervals["exact_match"] == pytest.approx(wilson_interval(1.5, 3))
    assert s.intervals["exact_match"][1] - s.intervals["exact_match"][0] > \
        wilson_interval(3, 6)[1] - wilson_interval(3, 6)[0]


def test_summarize_empty_is_nan_not_error():
    s = summarize([])
    assert s.n_prompts == 0 and math.isnan(s.metrics["exact_match"])
    assert s.intervals["exact_match"] == (0.0, 1.0)
    assert sum(s.failure_modes.values()) == 0
