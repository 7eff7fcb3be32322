"""The six verifier components of the staged metric-gated GRPO paper (docs/design.md, section 2).

Each completion is parsed once by the response contract (data.contract.parse_response,
the same parser the metrics use) and scored by six small functions. L = max_new_tokens,
tok = completion tokens the sampler produced (counted by the model's own tokenizer: the
trainer passes the count, so no re-tokenisation happens here).

    component    values                 rule
    format       -0.5 .. 2              +1 one REASONING block, +1 one SOLUTION block,
                                        -0.5 if malformed (solution blocks != 1, empty, not a number)
    parseable    0 / 1                  the single solution parses as a number
    finished     -1 / 0 / 1             +1 tags right, not malformed and tok < L;
                                        -1 truncated (tok >= L); else 0
    correctness  0 / 1                  normalised answer == normalised gold
    tolerance    0 / 1                  only if enabled and not exact: |pred - gold| <= tol
    brevity      -1 / -.5 / 0 / .5 / 1  -1 if tok >= L, else by tok / L:
                                        <= .55 -> 1, <= .75 -> .5, <= .90 -> 0, else -.5

"Truncated" is the anchor's ``tok >= L and not finished``; since finished requires tok < L,
that is simply tok >= L: a completion that used the whole budget counts as cut off even
if its last token happened to close the SOLUTION tag (the sampler cannot tell the two
apart either).

Tolerance: abs = 0.5 * 10^-precision (data.contract.tolerance_for: rounding to the stated
precision), not the anchor's abs = rel = 10^-precision (10% relative at precision 1).
It pays only for near misses; an exact answer is paid by ``correctness`` and gets 0 here,
so the two never double count.
"""

from __future__ import annotations

from data.contract import ParsedResponse, is_exact, within_tolerance

VERIFIER_COMPONENTS = ("format", "parseable", "finished", "correctness", "tolerance", "brevity")
MALFORMED_PENALTY = 0.5
# brevity: (upper bound of tok / L, reward), checked in order; above the last -> -0.5
BREVITY_STEPS = ((0.55, 1.0), (0.75, 0.5), (0.90, 0.0))
BREVITY_LONG = -0.5


def truncated(num_tokens: int, max_new_tokens: int) -> bool:
    return num_tokens >= max_new_tokens


def format_reward(parsed: ParsedResponse) -> float:
    r = float(parsed.has_reasoning_tag) + float(parsed.has_solution_tag)
    return r - MALFORMED_PENALTY if parsed.malformed else r


def parseable_reward(parsed: ParsedResponse) -> float:
    return float(parsed.parseable)


def finished_reward(parsed: ParsedResponse, num_tokens: int, max_new_tokens: int) -> float:
    if truncated(num_tokens, max_new_tokens):
        return -1.0
    done = parsed.has_reasoning_tag and parsed.has_solution_tag and not parsed.malformed
    return 1.0 if done else 0.0


def correctness_reward(parsed: ParsedResponse, gold: str) -> float:
    return float(is_exact(parsed.answer, gold))


def tolerance_reward(parsed: ParsedResponse, gold: str, precision: int | None, enabled: bool) -> float:
    if not enabled or is_exact(parsed.answer, gold):
        return 0.0
    return float(within_tolerance(parsed.answer, gold, precision))


def brevity_reward(num_tokens: int, max_new_tokens: int) -> float:
    if truncated(num_tokens, max_new_tokens):
        return -1.0
    ratio = num_tokens / max_new_tokens
    for upper, r in BREVITY_STEPS:
        if ratio <= upper:
            return r
    return BREVITY_LONG


def verify(parsed: ParsedResponse, gold: str, precision: int | None, num_tokens: int,
           max_new_tokens: int, tolerance: bool) -> dict[str, float]:
    """All six components of one completion, by name."""
    return {
        "format": format_reward(parsed),
        "parseable": parseable_reward(parsed),
        "finished": finished_reward(parsed, num_tokens, max_new_tokens),
        "correctness": correctness_reward(parsed, gold),
        "tolerance": tolerance_reward(parsed, gold, precision, tolerance),
        "brevity": brevity_reward(num_tokens, max_new_tokens),
    }
