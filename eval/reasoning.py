"""Does the answer follow the reasoning, and does the reasoning take the key steps?

Exact match says whether the SOLUTION is right; it cannot tell a model that reasons wrongly
from one that reasons rightly and then writes another number ("5 + 3 + 9 = 17" followed by
``<SOLUTION>19``). Three numbers per evaluated subset separate those cases:

    answer_follows          the SOLUTION equals the number the reasoning ends on (its
                            result): the last number after the last "=" in the REASONING
                            block, or, in a reasoning with no "=", its last number.
                            Over the completions that have both a parseable answer and a
                            number in the reasoning (n says how many); Wilson 95%.
    right_reasoning_wrong   the reasoning's result equals the gold answer and the SOLUTION
                            does not: "right reasoning, wrong answer", over all completions
                            with a numeric gold; Wilson 95%.
    arithmetic_right        every equation the reasoning writes ("5 + 3 + 9 = 17", "53 / 2 =
                            26.5") is right: the left side, evaluated, equals the right side
                            (exactly, or rounded to the decimals the right side shows). Over the
                            completions with at least one such equation; Wilson 95%. A wrong
                            sum copied faithfully into the SOLUTION is a follow, and this is
                            where it shows.
    key_step_accuracy       the share of the example's key steps (data.schema.Example.key_steps,
                            one group of accepted spellings per step) that appear in the
                            REASONING block, matched by the soft matcher R1-VL's StepRAR pays
                            for (data/soft_match.py, shared with grpo/rewards/steps.py), so the metric counts what that reward
                            credits. Mean over completions of examples that have key steps,
                            normal 95% interval over per-prompt means (n = prompts).

"Equals" is the contract's exact match (data.contract.is_exact: numbers normalised, "6.50"
== "6.5"). Simplified: the reasoning's result is read off the text, not recomputed, so a
reasoning that writes a wrong sum ("5 + 3 = 9") and copies it to the SOLUTION counts as
followed (it is; the arithmetic is what is wrong, and exact match and key steps see that).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

from data.contract import is_exact, normalize_number, parse_response
from eval.metrics import mean_interval, wilson_interval

# A number as a reasoning writes it: optional sign, digits with optional thousands commas, an
# optional decimal part (or a bare ".5"); normalize_number decides what it means.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?\.\d+")
KEYS = ("answer_follows", "right_reasoning_wrong", "arithmetic_right", "key_step_accuracy")
# One clause of a reasoning: split at ":" ";" and at a "," or "." before a space or the end (not
# inside "1,000" or "6.5").
_CLAUSE = re.compile(r"[:;]|[,.](?=\s|$)")
_EQUATION = re.compile(r"^\s*(?P<lhs>[0-9.,\s+\-*/x×÷()]*[+\-*/x×÷][0-9.,\s+\-*/x×÷()]*)=\s*(?P<rhs>-?\d[\d,]*(?:\.\d+)?)\s*$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(expr: str) -> float | None:
    """The value of + - * / arithmetic over plain numbers (None for anything else, or 1/0)."""
    try:
        node = ast.parse(expr.replace("×", "*").replace("x", "*").replace("÷", "/").strip(), mode="eval").body
    except SyntaxError:
        return None

    def value(n: ast.AST) -> float:
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return float(n.value)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -value(n.operand)
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](value(n.left), value(n.right))
        raise ValueError(type(n).__name__)

    try:
        return value(node)
    except (ValueError, ZeroDivisionError):
        return None


def arithmetic_right(text: str) -> bool | None:
    """Every "expression = number" clause of the REASONING evaluates to its number (None: none to check)."""
    reasoning = parse_response(text).reasoning or ""
    checked = []
    for clause in _CLAUSE.split(reasoning):
        m = _EQUATION.match(clause)
        if not m:
            continue
        got, rhs = _evaluate(m["lhs"].replace(",", "")), m["rhs"].replace(",", "")
        if got is None:
            continue
        decimals = len(rhs.partition(".")[2])
        # "13 / 2 = 6.5" exact; "10 / 3 = 3.33" right to the two decimals it shows; "53 / 2 = 26" wrong
        checked.append(abs(got - float(rhs)) < 1e-9 or (decimals > 0 and round(got, decimals) == float(rhs)))
    return all(checked) if checked else None


def reasoning_result(text: str) -> str | None:
    """The normalised number the REASONING block ends on (see the module docstring), or None
    when the completion has no single reasoning block or it holds no number."""
    reasoning = parse_response(text).reasoning
    if not reasoning:
        return None
    tail = reasoning[reasoning.rfind("=") + 1:] if "=" in reasoning else reasoning
    found = NUMBER.findall(tail)
    if not found:
        return None
    # after "=" the result is the first number ("= 13 apples, plus ..."); without one, the last
    return normalize_number(found[0] if "=" in reasoning else found[-1])


def key_step_fraction(text: str, key_steps: Sequence[Sequence[str]] | None) -> float | None:
    """Matched key-step groups / groups in the REASONING block (0 without one); None without key steps."""
    if not key_steps:
        return None
    # imported here: the matcher lives with the reward it defines (and brings torch with its package)
    from data.soft_match import SoftText, matched_groups

    reasoning = parse_response(text).reasoning or ""
    return matched_groups(SoftText(reasoning), [list(g) for g in key_steps]) / len(key_steps)


def completion_reasoning(text: str, gold: str, key_steps: Sequence[Sequence[str]] | None) -> dict[str, Any]:
    """The per-completion fields (a samples record's): the reasoning's result, whether the answer
    follows it (None: no answer or no result to compare), right reasoning with a wrong answer,
    and the key-step fraction (None: the example has no key steps)."""
    result, answer = reasoning_result(text), parse_response(text).answer
    follows = None if result is None or answer is None else is_exact(answer, result)
    right = result is not None and is_exact(result, gold)
    wrong_answer = answer is None or not is_exact(answer, gold)
    return {"reasoning_result": result, "answer_follows": follows, "right_reasoning_wrong": right and wrong_answer,
            "arithmetic_right": arithmetic_right(text), "key_step_accuracy": key_step_fraction(text, key_steps)}


def _rate(flags: Sequence[bool]) -> dict[str, float]:
    n = len(flags)
    if not n:
        return {"value": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    k = sum(flags)
    lo, hi = wilson_interval(k, n)
    return {"value": k / n, "lo": lo, "hi": hi, "n": n}


def summarize_reasoning(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """The three numbers (value, lo, hi, n) over records that carry completion_reasoning's fields."""
    follows = [bool(r["answer_follows"]) for r in records if r.get("answer_follows") is not None]
    right_wrong = [bool(r["right_reasoning_wrong"]) for r in records if "right_reasoning_wrong" in r]
    arithmetic = [bool(r["arithmetic_right"]) for r in records if r.get("arithmetic_right") is not None]
    by_prompt: dict[str, list[float]] = {}
    for r in records:
        if r.get("key_step_accuracy") is not None:
            by_prompt.setdefault(str(r["pid"]), []).append(float(r["key_step_accuracy"]))
    means = [sum(v) / len(v) for v in by_prompt.values()]
    if means:
        lo, hi = mean_interval(means, lo=0.0, hi=1.0)
        keys = {"value": sum(means) / len(means), "lo": lo, "hi": hi, "n": len(means)}
    else:
        keys = {"value": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    return {"answer_follows": _rate(follows), "right_reasoning_wrong": _rate(right_wrong),
            "arithmetic_right": _rate(arithmetic), "key_step_accuracy": keys}
