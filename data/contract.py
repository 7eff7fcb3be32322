"""The response contract: what we ask for, and the one strict parser of what comes back.

Every completion must look like

    <REASONING> free text </REASONING>
    <SOLUTION> a single number </SOLUTION>

This module is the *only* implementation of the contract. The prompt builders (data/),
the reward verifier (grpo/rewards) and the evaluation metrics (eval/) all call it, so
the thing the policy is rewarded for is exactly the thing it is measured on.

Extraction follows the staged-GRPO anchor (docs/design.md, section 1):

- blocks are found with ``<TAG>(.*?)</TAG>`` (non-greedy, dot matches newline);
- the answer exists only if there is exactly one SOLUTION block;
- newlines -> spaces, strip, drop thousands commas, then ``float()``; NaN/inf -> none;
- integral values normalise to ``str(int(round(v)))``, others to ``f"{v:.12g}"``,
  so "2.000", "2" and "2e0" all become "2", and "-0" becomes "0".

Two places where this is deliberately stricter than a bare ``float()`` (and why):

- Only ASCII decimal literals are numbers here: ``float()`` also accepts "1_000",
  "١٢" (Arabic-Indic digits), "infinity" and "nan"; a verifier that accepted those would
  reward answers a human grader would reject.
- A comma is dropped only when it groups thousands ("12,345.5"). "1,00" or "3,5" is not
  a number: silently reading "3,5" as 35 would be a wrong answer scored as right.

Fractions ("3/4"), percents ("5%"), currency ("$5") and the unicode minus ("−5") are not
numbers under the contract: the prompt asks for a plain number, and the format reward is
how the policy learns to give one. (Soft matching of such variants exists, but only for
step-wise partial credit in grpo/rewards, never for the answer itself.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

REASONING_OPEN, REASONING_CLOSE = "<REASONING>", "</REASONING>"
SOLUTION_OPEN, SOLUTION_CLOSE = "<SOLUTION>", "</SOLUTION>"

# The instruction appended to every question. Short on purpose: the tiny embedded model
# reads it thousands of times, and a 7B instruct model needs no more than this.
INSTRUCTION = (
    "Think step by step inside <REASONING> </REASONING>, "
    "then give only the final number inside <SOLUTION> </SOLUTION>."
)

_REASONING_RE = re.compile(r"<REASONING>(.*?)</REASONING>", re.DOTALL)
_SOLUTION_RE = re.compile(r"<SOLUTION>(.*?)</SOLUTION>", re.DOTALL)
# A plain ASCII decimal literal with optional sign, fraction and exponent.
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
# Digits grouped in threes by commas, e.g. 1,000 or -12,345,678.25
_THOUSANDS_RE = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?")


def format_prompt(question: str) -> str:
    """The user text for one question (the image placeholder is added by the chat template)."""
    return f"{question.strip()}\n{INSTRUCTION}"


def format_response(reasoning: str, answer: str) -> str:
    """A completion that satisfies the contract; used for SFT targets and tests."""
    return f"{REASONING_OPEN}{reasoning}{REASONING_CLOSE}\n{SOLUTION_OPEN}{answer}{SOLUTION_CLOSE}"


def gold_response(reasoning: str | None, answer: str) -> str:
    """The contract completion of a labelled example: its worked reasoning, or, for a row with
    none (a user's own set), "the answer is <gold>.". The warm-up's SFT target and the
    demonstration of a guided group (grpo/rollout/guided.py) are this text."""
    return format_response(reasoning or f"the answer is {answer}.", answer)


def normalize_number(text: str | None) -> str | None:
    """Canonical string of a numeric answer, or None if ``text`` is not a number.

    >>> normalize_number(" 1,000 "), normalize_number("2.000"), normalize_number("-0")
    ('1000', '2', '0')
    >>> normalize_number("0.5"), normalize_number("3/4"), normalize_number("1e3")
    ('0.5', None, '1000')
    """
    if text is None:
        return None
    s = text.replace("\r", " ").replace("\n", " ").strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if not _NUMBER_RE.fullmatch(s):
        return None
    v = float(s)
    if math.isnan(v) or math.isinf(v):  # "1e999" overflows to inf
        return None
    if v == int(v) and abs(v) < 1e15:  # beyond 1e15 float spacing exceeds 0.1: keep %g form
        return str(int(round(v)))
    return f"{v:.12g}"


@dataclass(frozen=True)
class ParsedResponse:
    """Everything the verifier and the metrics need to know about one completion's form."""

    n_reasoning: int  # number of complete <REASONING>...</REASONING> blocks
    n_solution: int  # number of complete <SOLUTION>...</SOLUTION> blocks
    reasoning: str | None  # body of the reasoning block, if exactly one
    solution_raw: str | None  # body of the solution block, if exactly one
    answer: str | None  # normalised number, if exactly one solution block that parses

    @property
    def has_reasoning_tag(self) -> bool:
        return self.n_reasoning == 1

    @property
    def has_solution_tag(self) -> bool:
        return self.n_solution == 1

    @property
    def parseable(self) -> bool:
        return self.answer is not None

    @property
    def malformed(self) -> bool:
        """Solution blocks != 1, or the single block is empty or not a number."""
        return self.answer is None


def parse_response(text: str) -> ParsedResponse:
    """Strictly parse one completion under the contract. Never raises on any string."""
    reasonings = _REASONING_RE.findall(text)
    solutions = _SOLUTION_RE.findall(text)
    solution_raw = solutions[0] if len(solutions) == 1 else None
    return ParsedResponse(
        n_reasoning=len(reasonings),
        n_solution=len(solutions),
        reasoning=reasonings[0] if len(reasonings) == 1 else None,
        solution_raw=solution_raw,
        answer=normalize_number(solution_raw),
    )


def extract_answer(text: str) -> str | None:
    """The normalised numeric answer of a completion, or None."""
    return parse_response(text).answer


def is_exact(pred: str | None, gold: str) -> bool:
    """Exact match: equal canonical strings (the gold is normalised the same way)."""
    if pred is None:
        return False
    gold_norm = normalize_number(gold)
    return gold_norm is not None and normalize_number(pred) == gold_norm


def tolerance_for(precision: int | None) -> float:
    """Absolute tolerance for an answer stated to ``precision`` decimals.

    The anchor used abs = rel = 10^-precision (10% relative error accepted at precision 1).
    We use half a unit in the last stated place, 0.5 * 10^-precision: a prediction counts
    if it rounds to the gold at the precision the question asks for. Integer answers
    (precision None) use precision 0, i.e. +-0.5.
    """
    return 0.5 * 10.0 ** -(precision or 0)


def within_tolerance(pred: str | None, gold: str, precision: int | None) -> bool:
    """Numeric closeness at the example's precision (used only where tolerance is enabled)."""
    if pred is None:
        return False
    p, g = normalize_number(pred), normalize_number(gold)
    if p is None or g is None:
        return False
    # A relative epsilon absorbs float representation error at the boundary (2.35 vs 2.3).
    return abs(float(p) - float(g)) <= tolerance_for(precision) * (1 + 1e-9) + 1e-12
