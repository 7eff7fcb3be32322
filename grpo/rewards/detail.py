"""RewardMap's difficulty-aware detail reward: partial credit for partially right work.

RewardMap (ICLR 2026) splits a structured answer into parts that can be checked alone
(for a metro route: start, end, lines, transfer stations, segment count) and scores

    R = W * (R_format + R_correct + alpha * R_detail),   W = W_map + W_question

with W_map = 1.0 / 1.2 / 1.5 for easy / middle / hard maps, W_question +0.5 for multi-hop
questions, alpha = 0.5 (correctness worth 10 in the anchor code).

Our numeric questions have no structured answer, but they do have checkable parts: the
*intermediate quantities* a correct solution computes on the way (data.schema.Intermediate:
"red circles" = 3, "sum" = 14). The component returned here is

    detail = W * d,   W = W_level + W_hops in [1.0, 2.0],   d in [0, 1]
    d      = 1                                  if the answer is exactly right
           = (intermediates found) / (all)      otherwise, if an answer parses
           = 0                                  if no answer parses

so detail lies in [0, 2.0], and it reaches W exactly when the answer is right. The anchor
code's detail score gave a fully correct direct answer only 1 of 10 (an off-by-one in
its segment count); here a right answer earns full detail credit by definition, since an
exactly right final number implies the parts were right enough.

What is simplified, and why:
- Only the detail term carries W. RewardMap multiplies format and correctness by W as
  well; here those are separate components whose weights the metric-gated controller
  tunes, and scaling them per example would change what the controller's gates measure.
  To get RewardMap's weighting of correctness, weight ``detail`` (it is W on a right answer).
- An intermediate is "found" if its value appears as a number (soft matched: "1,000",
  "1000.0", "3/4" -> 0.75, and a fraction also counts its numerator and denominator)
  anywhere up to the end of the SOLUTION block. Nothing checks that the number is
  *attached to* its name; number spam is bounded by the brevity reward and the token
  budget, and RewardMap's route parts have the same "value present" semantics.
- No answer, no detail: otherwise a policy could harvest detail credit without ever
  producing the contract.
"""

from __future__ import annotations

from data.contract import ParsedResponse, is_exact, normalize_number
from data.schema import Intermediate
from grpo.rewards.steps import SoftText, through_solution

W_LEVEL = {"easy": 1.0, "middle": 1.2, "hard": 1.5}  # RewardMap's W_map
W_MULTI_HOP = 0.5  # RewardMap's W_question for a question with more than one hop
DETAIL_MAX = max(W_LEVEL.values()) + W_MULTI_HOP  # 2.0


def difficulty_weight(difficulty: str, hops: int) -> float:
    """W = W_level + W_hops: easy 1.0 / middle 1.2 / hard 1.5, +0.5 when hops > 1."""
    if difficulty not in W_LEVEL:
        raise ValueError(f"difficulty {difficulty!r} has no RewardMap weight: use one of {', '.join(W_LEVEL)}")
    return W_LEVEL[difficulty] + (W_MULTI_HOP if hops > 1 else 0.0)


def detail_fraction(text: str, parsed: ParsedResponse, intermediates: list[Intermediate], gold: str) -> float:
    """d in [0, 1]: 1 for an exactly right answer, else the share of intermediates found."""
    if parsed.answer is None or not intermediates:
        return 0.0
    if is_exact(parsed.answer, gold):
        return 1.0
    present = {value for value, _ in SoftText(through_solution(text, parsed)).numbers()}
    found = sum(normalize_number(it.value) in present for it in intermediates)
    return found / len(intermediates)


def detail_reward(text: str, parsed: ParsedResponse, intermediates: list[Intermediate], gold: str,
                  difficulty: str, hops: int) -> float:
    """RewardMap detail component: W * d in [0, DETAIL_MAX]."""
    return difficulty_weight(difficulty, hops) * detail_fraction(text, parsed, intermediates, gold)
