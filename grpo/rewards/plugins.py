"""Reward plug-ins: your own reward components, named on the command line, no edit of this package.

    --rewards.extra short=my_rewards:short_answer        (NAME=module:function; comma separated or repeated)

    def short_answer(examples, completions):             # in my_rewards.py
        return [1.0 if len(c) < 120 else 0.0 for c in completions]

``examples`` is a list of data.schema.Example, one per completion: each prompt's example
repeated for its G completions, contiguous (the reward model's own layout); ``completions``
the decoded texts, in the same order. The function returns one finite float per completion
(a list, tuple, or anything with ``tolist()``). Its values are the raw component NAME:
weighted by rewards.weights like a built-in, logged beside the built-ins.

Imported once, when the run starts (before a model loads), so a wrong path costs a second.
Every failure is one ConfigError line that names the plug-in: a module that does not import,
an attribute that is missing or not callable, a call that raises, a result of the wrong
length, a value that is not a finite number. A call that raises is repeated one row at a
time to name the first row that fails: a bad input row is what usually breaks a reward.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from data.schema import Example
from grpo.config_checks import plugin_target
from grpo.errors import ConfigError

RewardFn = Callable[[list[Example], list[str]], Sequence[float]]


def load_plugins(extra: dict[str, str]) -> dict[str, RewardFn]:
    """name -> the callable of every rewards.extra entry, imported now."""
    return {name: load_plugin(name, spec) for name, spec in extra.items()}


def load_plugin(name: str, spec: str) -> RewardFn:
    module_name, attr = plugin_target(name, spec)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an ImportError, or whatever the module's own top level raised
        first = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError(f"rewards.extra {name}={spec}: module {module_name!r} does not import "
                          f"({type(err).__name__}: {first}); run from the directory that holds it or add it "
                          "to PYTHONPATH") from None
    fn: Any = module
    for part in attr.split("."):  # module:Class.method reaches an attribute of an attribute
        if not hasattr(fn, part):
            raise ConfigError(f"rewards.extra {name}={spec}: module {module_name!r} has no attribute {attr!r}; "
                              f"name a function defined in {getattr(module, '__file__', module_name)}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"rewards.extra {name}={spec}: {attr} is a {type(fn).__name__}, not callable; name a "
                          "function (examples, completions) -> list of floats")
    return fn


def score_plugin(name: str, fn: RewardFn, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
    """The plug-in's values for these completions, checked: one finite float each."""
    examples, completions = list(examples), list(completions)
    N = len(completions)
    try:
        out = fn(examples, completions)
    except Exception as err:
        raise ConfigError(f"reward plug-in {name!r} raised {_failing_row(fn, examples, completions)}"
                          f"{type(err).__name__}: {_first_line(err)}") from None
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # a tensor or an array
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise ConfigError(f"reward plug-in {name!r} returned a {type(out).__name__}: return a list of {N} floats, "
                          "one per completion")
    if len(out) != N:
        raise ConfigError(f"reward plug-in {name!r} returned {len(out)} values for {N} completions: return one "
                          "float per completion, in the order given")
    values = []
    for i, v in enumerate(out):
        if not isinstance(v, Real) or not math.isfinite(v):
            raise ConfigError(f"reward plug-in {name!r} returned {v!r} for row {i} (example {examples[i].pid!r}): "
                              "every value must be a finite number")
        values.append(float(v))
    return values


def _failing_row(fn: RewardFn, examples: list[Example], completions: list[str]) -> str:
    """'on row i (example pid) ' for the first row that raises alone; '' if none does (the
    batch as a whole failed, e.g. a plug-in that needs whole groups)."""
    for i, (ex, text) in enumerate(zip(examples, completions)):
        try:
            fn([ex], [text])
        except Exception:
            return f"on row {i} (example {ex.pid!r}): "
    return f"on a batch of {len(completions)} rows (each row alone scores): "


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]
