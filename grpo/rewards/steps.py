"""R1-VL's step-wise rewards, StepRAR and StepRVR (their soft key-step matcher: data/soft_match.py).

StepRAR (step-wise reasoning accuracy, R1-VL eq. 2) gives dense credit for the key
intermediate steps a solution needs:

    r_rar = 1[answer correct] + alpha * k     k = matched key-step groups / groups
    r_rar = 0                                 when no answer parses (R1-VL: ans = null)

with alpha = 0.1 (R1-VL section 4.1). A *group* is one key step with its accepted
spellings (R1-VL augments "\\frac{6}{3} = 2" into "6/3 = 2", "6 divided by 3 equals 2";
our generator writes "3" / "three", "3 + 2" / "2+3"); a group matches if any alternative
matches. Key steps are searched in the text *before* the SOLUTION block, so repeating the
answer inside SOLUTION earns no step credit. "Correct" is exact match (data.contract).

StepRVR (step-wise reasoning validity) is 1 iff the reasoning is complete and ordered,
which R1-VL judges as "background before steps, answer only after the steps". Under this
project's contract that reads:

    exactly one REASONING block, closed before the single SOLUTION block opens;
    the reasoning is non-empty and the answer parses (a complete path has a final answer);
    the key steps that are present are completed in their listed order (by where each
    match ends: a combining step "3 + 2" contains the reads "3" and "2" it combines);
    nothing but whitespace after </SOLUTION>.

Text before <REASONING> or between the two blocks is tolerated (the format reward and
the metrics already count tags; StepRVR judges the order of what is there).

Soft matching: data/soft_match.py (one implementation, shared with eval/reasoning.py's metric).
"""

from __future__ import annotations

from data.contract import REASONING_CLOSE, REASONING_OPEN, SOLUTION_CLOSE, SOLUTION_OPEN, ParsedResponse, is_exact
from data.soft_match import SoftText, canonical_tokens, has_content, matched_groups  # noqa: F401 (re-exported)

STEP_ALPHA = 0.1  # R1-VL: "we set the coefficient of match score alpha to 0.1"

# ----------------------------------------------------------------------------- regions


def before_solution(text: str, parsed: ParsedResponse) -> str:
    """The completion up to the single SOLUTION block ('' if there is not exactly one).

    With exactly one complete block, the regex's leftmost match starts at the first
    <SOLUTION>, so a plain find gives its start.
    """
    if parsed.n_solution != 1:
        return ""
    return text[: text.find(SOLUTION_OPEN)]


def through_solution(text: str, parsed: ParsedResponse) -> str:
    """The completion up to and including the single SOLUTION block ('' if not exactly one)."""
    if parsed.n_solution != 1:
        return ""
    close = text.find(SOLUTION_CLOSE, text.find(SOLUTION_OPEN))
    return text[: close + len(SOLUTION_CLOSE)]


# ----------------------------------------------------------------------------- StepRAR


def step_rar(text: str, parsed: ParsedResponse, key_steps: list[list[str]], gold: str,
             alpha: float = STEP_ALPHA) -> float:
    """R1-VL StepRAR in [0, 1 + alpha]: 1[correct] + alpha * (matched groups / groups)."""
    if parsed.answer is None or not key_steps:
        return 0.0
    k = matched_groups(SoftText(before_solution(text, parsed)), key_steps) / len(key_steps)
    return float(is_exact(parsed.answer, gold)) + alpha * k


# ----------------------------------------------------------------------------- StepRVR


def steps_in_order(soft: SoftText, key_steps: list[list[str]]) -> bool:
    """The groups that are present are *completed* in their listed order (absent ones skipped).

    Order is by where a step's match ends, non-decreasing: a combining step contains the
    steps it combines ("3 + 2" after the reads "3" and "2" may be the same tokens), and
    chained steps share a token ("3 + 4 = 7", "7 * 2 = 14"). Greedy: each present group
    takes its earliest-ending match that ends at or after the previous group's end.
    """
    prev_end = 0
    for group in key_steps:
        if soft.find_any(group) < 0:
            continue  # absent: StepRAR's business, not an ordering error
        ends = []
        for alt in group:
            m = len(canonical_tokens(alt))
            i = soft.find(alt, max(0, prev_end - m + 1)) if m else -1
            if i >= 0:
                ends.append(i + m - 1)
        if not ends:
            return False  # present, but only completed before an earlier step
        prev_end = min(ends)
    return True


def step_rvr(text: str, parsed: ParsedResponse, key_steps: list[list[str]]) -> float:
    """R1-VL StepRVR in {0, 1}: reasoning complete and ordered under our contract."""
    if parsed.n_reasoning != 1 or parsed.n_solution != 1 or parsed.answer is None:
        return 0.0
    if not (parsed.reasoning or "").strip():
        return 0.0
    sol_open = text.find(SOLUTION_OPEN)
    # the single reasoning block must close before the solution block opens
    r_close = text.find(REASONING_CLOSE, text.find(REASONING_OPEN))
    if r_close < 0 or r_close + len(REASONING_CLOSE) > sol_open:
        return 0.0
    end = text.find(SOLUTION_CLOSE, sol_open) + len(SOLUTION_CLOSE)
    if text[end:].strip():
        return 0.0
    if key_steps and not steps_in_order(SoftText(parsed.reasoning or ""), key_steps):
        return 0.0
    return 1.0
