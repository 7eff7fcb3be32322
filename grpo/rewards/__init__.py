"""Rewards: the staged paper's verifier, R1-VL's step rewards, RewardMap's detail reward and
V-Rubrics, composed by name and weight (compose.RewardModel is the one entry point).

    verifier.py  format, parseable, finished, correctness, tolerance, brevity
    steps.py     StepRAR, StepRVR and the soft matcher (case, spacing, LaTeX, number formats)
    detail.py    RewardMap's difficulty-weighted partial credit over intermediates
    rubrics.py   V-Rubrics: judge interface, rule judge, sentence location, prefix inputs
    overlong.py  DAPO's soft overlong punishment (the ``overlong`` component)
    compose.py   RewardModel: components by name, weights read at call time, per-component logs
    plugins.py   your own components: --rewards.extra NAME=module:function, imported and checked
"""

from grpo.rewards.compose import (
    COMPONENT_BOUNDS,
    KNOWN_COMPONENTS,
    RUBRIC_RELEASE_WEIGHTS,
    RewardBatch,
    RewardModel,
    check_weights,
)
from grpo.rewards.detail import DETAIL_MAX, W_LEVEL, W_MULTI_HOP, detail_fraction, detail_reward, difficulty_weight
from grpo.rewards.rubrics import (
    FUZZY_THRESHOLD,
    Judge,
    PrefixInputs,
    RuleJudge,
    TokenLocator,
    Verdict,
    judge_from_item_fn,
    locate,
    partial_ratio,
    rubric_rho,
    score_rubrics,
)
from grpo.rewards.steps import STEP_ALPHA, SoftText, canonical_tokens, step_rar, step_rvr
from grpo.rewards.verifier import VERIFIER_COMPONENTS, verify

__all__ = [
    "COMPONENT_BOUNDS", "DETAIL_MAX", "FUZZY_THRESHOLD", "KNOWN_COMPONENTS", "RUBRIC_RELEASE_WEIGHTS", "STEP_ALPHA",
    "VERIFIER_COMPONENTS", "W_LEVEL", "W_MULTI_HOP", "Judge", "PrefixInputs", "RewardBatch", "RewardModel",
    "RuleJudge", "SoftText", "TokenLocator", "Verdict", "canonical_tokens", "check_weights", "detail_fraction",
    "detail_reward", "difficulty_weight", "judge_from_item_fn", "locate", "partial_ratio", "rubric_rho",
    "score_rubrics", "step_rar", "step_rvr", "verify",
]
