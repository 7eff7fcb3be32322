"""Reward plug-ins for tests/test_rewards_plugins.py, reached as plugin_rewards:NAME (pytest puts
tests/ on sys.path, as it does for train_helpers)."""

import math

RETURNED: list[list[float]] = []  # every list `short` returned, for the end-to-end test to read back
FAIL = False  # set by a test: `short` then raises, as a plug-in that breaks mid-run


def short(examples, completions):
    """Rewards short completions: 1 - characters / 40, floored at 0."""
    if FAIL:
        raise ValueError("the scorer broke")
    values = [max(0.0, 1 - len(c) / 40) for c in completions]
    RETURNED.append(values)
    return values


def pid_parity(examples, completions):
    """Reads the examples: 1 for even-numbered pids' last digit, so the rows line up with their examples."""
    return [float(int(ex.pid[-1]) % 2 == 0) if ex.pid[-1].isdigit() else 0.5 for ex in examples]


def fails_on_long(examples, completions):
    for c in completions:
        if len(c) > 5:
            raise ValueError(f"too long: {len(c)} characters")
    return [0.0] * len(completions)


def fails_on_batches(examples, completions):
    if len(completions) > 1:
        raise RuntimeError("wants one row at a time")
    return [0.0]


def one_short(examples, completions):
    return [0.0] * (len(completions) - 1)


def nan_in_row_1(examples, completions):
    return [0.0, math.nan] + [0.0] * (len(completions) - 2)


def not_a_list(examples, completions):
    return 1.0


NOT_CALLABLE = 3
