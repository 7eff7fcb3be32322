"""One reward API for every paper's terms: named components, weights read at call time.

    reward = RewardModel(cfg.rewards, max_new_tokens=L, tokenizer=tok)   # judge=None -> RuleJudge
    reward.validate(train_examples)                # at start: loud errors, never a silent zero
    batch = reward(examples, completions, num_tokens, completion_ids)
    batch.total       [N] float32   sum_k w_k * component_k
    batch.components  {name: [N]}   raw (unweighted) values, after the PITFALL veto
    batch.prefix      PrefixInputs for the loss kernel (rubric_mode == "prefix"), else None
    batch.summary()   {"total/mean", "<name>/mean", "<name>/frac_nonzero", ...}

``examples`` has one entry per completion (N = B*G: each prompt's example repeated for its
G completions, contiguous, the layout the loss kernel's group z-scores expect).
``num_tokens`` [N] is what the sampler produced per completion (the trainer passes it; tok
>= L means truncated). ``completion_ids`` (a list of id lists, or an [N, T] tensor padded
after each row's num_tokens) is only read in prefix mode, to put each rubric's supporting
sentence on a token; without it the text is re-encoded with the tokenizer's offsets.

The reward spec is ``RewardConfig.weights`` (component name -> weight). Only named
components are computed; a weight of 0 computes and reports a component without paying
it. The weights are read from the config object on every call, so the metric-gated
controller can edit ``cfg.weights`` in place (or call ``set_weights``) while training runs.

    component    range          source                              needs on the example
    format       [-0.5, 2]      staged GRPO verifier (verifier.py)   -
    parseable    {0, 1}         "                                    -
    finished     {-1, 0, 1}     "                                    -
    correctness  {0, 1}         "                                    numeric gold answer
    tolerance    {0, 1}         " (only with cfg.tolerance)          numeric gold answer
    brevity      [-1, 1]        "                                    -
    step_rar     [0, 1.1]       R1-VL StepRAR (steps.py)             key_steps, numeric gold
    step_rvr     {0, 1}         R1-VL StepRVR (steps.py)             - (key_steps if any)
    detail       [0, 2]         RewardMap W * detail (detail.py)     intermediates, difficulty
    rubric       [-1, 1]        V-Rubrics (rubrics.py)               rubrics (+ evidence for RuleJudge)
    arithmetic   {0, 1}         this project (eval/reasoning.py)     -
    overlong     [-p, 0]        DAPO soft overlong (overlong.py)     -
    NAME         any finite     your plug-in (plugins.py)            whatever it reads

``arithmetic`` is none of the four papers' terms: 1 when the REASONING writes at least one
"expression = number" and every one of them is right (eval.reasoning.arithmetic_right, the
metric every report carries), else 0. It was added to test one lever against the error the
reports count most after misreads: a wrong sum written in the reasoning and copied faithfully
into the SOLUTION (bench/EXPERIMENTS.md has the measurement). ``overlong`` is DAPO's soft
overlong punishment: 0 up to L - L_cache tokens, then a line down to -p at L (p =
``cfg.overlong_penalty``, L_cache = ``cfg.overlong_buffer``); off until a weight names it.

Plug-ins (``RewardConfig.extra``, ``--rewards.extra NAME=module:function``): a function
``(examples, completions) -> list[float]`` called once per batch with the same ``examples``
(one per completion, each prompt's repeated G times, contiguous) and decoded ``completions``
as above, returning one finite float per completion. NAME is then a component like the
built-ins: computed only while rewards.weights names it (the command line gives it 1.0 when
it does not), weighted, logged, kept by the controller (which gates only the verifier's
weights), part of ``R_ans`` in prefix mode, untouched by the PITFALL veto. Imported when the
RewardModel is built; a bad result stops the run with one line naming the plug-in and row.

Weights must be finite and >= 0: components carry their own sign (penalties are negative
values), and a negative weight would turn a penalty into a prize. While the rubric weight
is > 0, a committed PITFALL zeroes ``correctness`` and ``tolerance`` (the answer reward)
for that completion; step_rar / detail keep their own definitions.

Prefix mode: R_ans = sum over the non-rubric components of w_k * c_k (after the veto);
the split between it and the rubric term is ``cfg.prefix_answer_weight`` (a), which the
kernel applies. The rubric weight then only switches rubrics on and enters ``total``
(kept for logging and eval). RUBRIC_RELEASE_WEIGHTS are the V-Rubrics release's
answer/format/rubric weights with answer -> correctness; with the prefix preset, R_ans =
.50 correctness + .05 format and a = .5 gives the rubrics about the release's .45 share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from data.contract import normalize_number, parse_response
from data.schema import Example
from eval.reasoning import arithmetic_right
from grpo.config import RewardConfig
from grpo.config_checks import KNOWN_COMPONENTS, check_weights, overlong_buffer
from grpo.errors import ConfigError
from grpo.rewards.detail import DETAIL_MAX, W_LEVEL, detail_reward
from grpo.rewards.overlong import soft_overlong
from grpo.rewards.plugins import load_plugins, score_plugin
from grpo.rewards.rubrics import (
    Judge,
    PrefixInputs,
    RubricScore,
    RuleJudge,
    TokenLocator,
    build_prefix_inputs,
    check_rubrics,
    coerce_verdicts,
    encodable,
    score_rubrics,
)
from grpo.rewards.steps import STEP_ALPHA, has_content, step_rar, step_rvr
from grpo.rewards.verifier import VERIFIER_COMPONENTS, verify

# The component names are the config's vocabulary (rewards.weights keys): grpo/config_checks.py
# owns them; the verifier's six come first.
assert KNOWN_COMPONENTS[: len(VERIFIER_COMPONENTS)] == VERIFIER_COMPONENTS
COMPONENT_BOUNDS: dict[str, tuple[float, float]] = {
    "format": (-0.5, 2.0), "parseable": (0.0, 1.0), "finished": (-1.0, 1.0), "correctness": (0.0, 1.0),
    "tolerance": (0.0, 1.0), "brevity": (-1.0, 1.0), "step_rar": (0.0, 1.0 + STEP_ALPHA),
    "step_rvr": (0.0, 1.0), "detail": (0.0, DETAIL_MAX), "rubric": (-1.0, 1.0), "arithmetic": (0.0, 1.0),
    "overlong": (-1.0, 0.0),  # at rewards.overlong_penalty 1 (the default): the range scales with it
}
VETOED_COMPONENTS = ("correctness", "tolerance")  # the "answer reward" a committed PITFALL zeroes
RUBRIC_RELEASE_WEIGHTS = {
    "sequence": {"correctness": 0.10, "format": 0.10, "rubric": 0.80},
    "prefix": {"correctness": 0.50, "format": 0.05, "rubric": 0.45},
}
_NEEDS_GOLD = ("correctness", "tolerance", "step_rar", "detail")


@dataclass
class RewardBatch:
    total: torch.Tensor  # [N] float32, weighted sum of the components
    components: dict[str, torch.Tensor]  # name -> [N] float32, raw values
    weights: dict[str, float]  # the weights this batch was scored with
    prefix: PrefixInputs | None = None  # V-Rubrics prefix-mode inputs for the loss kernel
    vetoed: torch.Tensor | None = None  # [N] bool, a PITFALL was committed (rubric only)

    def summary(self) -> dict[str, float]:
        """Per component mean and fraction non-zero, plus the total's mean (for logging)."""
        out = {"total/mean": float(self.total.mean()) if self.total.numel() else 0.0}
        for name, v in self.components.items():
            out[f"{name}/mean"] = float(v.mean()) if v.numel() else 0.0
            out[f"{name}/frac_nonzero"] = float((v != 0).float().mean()) if v.numel() else 0.0
        if self.vetoed is not None and self.vetoed.numel():
            out["rubric/veto_frac"] = float(self.vetoed.float().mean())
        return out

    def random_draw(self, generator: torch.Generator) -> "RewardBatch":
        """The random-reward control: row i gets the rewards of row j ~ U{0..N-1}, drawn with
        replacement from this batch. The reward distribution stays the batch's own (same
        scale, same spread statistics) while any link between a completion and its reward is
        cut, so whatever a policy gains under it is what GRPO's mechanics give for free (on
        Qwen models, random rewards have raised MATH500 scores: a real gain must beat this)."""
        if self.prefix is not None:
            raise ValueError("random_draw replaces scalar rewards; prefix-mode rubric inputs are per token")
        n = self.total.shape[0]
        idx = torch.randint(n, (n,), generator=generator)
        return RewardBatch(total=self.total[idx], components={k: v[idx] for k, v in self.components.items()},
                           weights=dict(self.weights),
                           vetoed=self.vetoed[idx] if self.vetoed is not None else None)


class RewardModel:
    """Scores completions with the components and weights of a RewardConfig."""

    def __init__(self, cfg: RewardConfig, max_new_tokens: int, tokenizer: Any = None, judge: Judge | None = None):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens!r}: the completion budget L must be an int >= 1")
        if cfg.rubric_mode not in ("sequence", "prefix"):
            raise ConfigError(f"rewards.rubric_mode={cfg.rubric_mode!r}: use sequence or prefix")
        if not 0.0 <= cfg.prefix_answer_weight <= 1.0:
            raise ConfigError(f"rewards.prefix_answer_weight={cfg.prefix_answer_weight}: 'a' must be in [0, 1]")
        weights = check_weights(cfg.weights, cfg.tolerance, cfg.extra)
        self.overlong_buffer = overlong_buffer(cfg, max_new_tokens)  # L_cache, checked even while unweighted
        if cfg.rubric_mode == "prefix" and "rubric" in weights and tokenizer is None:
            raise ConfigError("rewards.rubric_mode='prefix' needs the model's tokenizer to map supporting "
                              "sentences to token positions: pass tokenizer=... to RewardModel")
        if judge is not None and not callable(judge):
            raise ConfigError(f"judge={judge!r} is not callable: pass a Judge (example, completion, items) -> verdicts")
        self.cfg, self.L, self.tokenizer = cfg, max_new_tokens, tokenizer
        self.judge: Judge = judge if judge is not None else RuleJudge()
        self.rule_judge = judge is None
        self.plugins = load_plugins(cfg.extra)

    # ------------------------------------------------------------------ the spec

    @property
    def weights(self) -> dict[str, float]:
        """The current weights, read (and checked) from the config now."""
        return check_weights(self.cfg.weights, self.cfg.tolerance, self.plugins)

    def set_weights(self, weights: dict[str, float]) -> None:
        """Replace the weights (the controller's entry point); checked before anything changes."""
        self.cfg.weights = check_weights(dict(weights), self.cfg.tolerance, self.plugins)

    def validate(self, examples: Sequence[Example]) -> None:
        """Raise one ValueError listing every example that lacks what a chosen component needs."""
        names = self.weights
        problems: list[str] = []
        seen: set[int] = set()
        for ex in examples:
            if id(ex) in seen:
                continue
            seen.add(id(ex))
            if not isinstance(ex, Example):
                raise TypeError(f"rewards expect data.schema.Example objects, got {type(ex).__name__}")
            for name in names:
                why = _missing(name, ex, self.rule_judge)
                if why:
                    problems.append(f"  {name}: example {ex.pid!r} {why}")
        if problems:
            head = "\n".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise ValueError(f"{len(problems)} reward/data mismatch(es): the chosen reward components need data "
                             f"these examples lack. Drop the component from rewards.weights or fix the data:\n{head}")

    # ------------------------------------------------------------------ scoring

    def __call__(self, examples: Sequence[Example], completions: Sequence[str],
                 num_tokens: Sequence[int] | torch.Tensor | None = None,
                 completion_ids: Sequence[Sequence[int]] | torch.Tensor | None = None) -> RewardBatch:
        N = len(completions)
        if len(examples) != N:
            raise ValueError(f"got {len(examples)} examples for {N} completions: pass one example per "
                             f"completion (each prompt's example repeated G times)")
        for c in completions:
            if not isinstance(c, str):
                raise TypeError(f"completions must be str (decoded text), got {type(c).__name__}")
        weights = self.weights  # read now: the controller may have changed them since the last call
        self.validate(examples)
        tok = self._num_tokens(completions, num_tokens, completion_ids)
        ids = _rows(completion_ids, tok) if completion_ids is not None else [None] * N
        parsed = [parse_response(c) for c in completions]
        comps: dict[str, list[float]] = {name: [0.0] * N for name in weights}

        for i, (ex, text, p) in enumerate(zip(examples, completions, parsed)):
            if any(n in weights for n in VERIFIER_COMPONENTS):
                for name, v in verify(p, ex.answer, ex.precision, tok[i], self.L, self.cfg.tolerance).items():
                    if name in comps:
                        comps[name][i] = v
            if "step_rar" in comps:
                comps["step_rar"][i] = step_rar(text, p, ex.key_steps, ex.answer)
            if "step_rvr" in comps:
                comps["step_rvr"][i] = step_rvr(text, p, ex.key_steps)
            if "detail" in comps:
                comps["detail"][i] = detail_reward(text, p, ex.intermediates, ex.answer, ex.difficulty, ex.hops)
            if "arithmetic" in comps:  # None (no equation to check) earns nothing
                comps["arithmetic"][i] = 1.0 if arithmetic_right(text) else 0.0
            if "overlong" in comps:
                comps["overlong"][i] = soft_overlong(tok[i], self.L, self.overlong_buffer, self.cfg.overlong_penalty)
        for name, fn in self.plugins.items():
            if name in comps:
                comps[name] = score_plugin(name, fn, examples, completions)

        scores: list[RubricScore | None] = [None] * N
        vetoed = None
        if "rubric" in comps:
            prefix_mode = self.cfg.rubric_mode == "prefix"
            if prefix_mode and self.tokenizer is None:
                raise ConfigError("rewards.rubric_mode='prefix' needs the model's tokenizer: pass tokenizer=...")
            for i, (ex, text) in enumerate(zip(examples, completions)):
                verdicts = coerce_verdicts(self.judge(ex, text, ex.rubrics), len(ex.rubrics), ex.pid)
                locator = TokenLocator(text, tok[i], self.tokenizer, ids[i]) if prefix_mode else None
                scores[i] = score_rubrics(ex.rubrics, verdicts, text, locator)
                comps["rubric"][i] = scores[i].reward
            vetoed = torch.tensor([sc.veto for sc in scores], dtype=torch.bool)
            if weights["rubric"] > 0:  # a switched-off rubric term vetoes nothing
                for i, sc in enumerate(scores):
                    if sc.veto:
                        for name in VETOED_COMPONENTS:
                            if name in comps:
                                comps[name][i] = 0.0

        total = [sum(weights[n] * comps[n][i] for n in weights) for i in range(N)]
        prefix = None
        if "rubric" in comps and self.cfg.rubric_mode == "prefix":
            R_ans = [sum(weights[n] * comps[n][i] for n in weights if n != "rubric") for i in range(N)]
            prefix = build_prefix_inputs(R_ans, scores, self.cfg.prefix_answer_weight)
        return RewardBatch(
            total=torch.tensor(total, dtype=torch.float32),
            components={n: torch.tensor(v, dtype=torch.float32) for n, v in comps.items()},
            weights=weights, prefix=prefix, vetoed=vetoed,
        )

    def _num_tokens(self, completions: Sequence[str], num_tokens: Any, completion_ids: Any) -> list[int]:
        """Completion token counts: given by the trainer, else from the ids, else the tokenizer."""
        N = len(completions)
        if num_tokens is None:
            if completion_ids is not None and not isinstance(completion_ids, torch.Tensor):
                num_tokens = [len(r) for r in completion_ids]
            elif self.tokenizer is not None:
                num_tokens = [len(self.tokenizer.encode(encodable(c), add_special_tokens=False)) for c in completions]
            else:
                raise ValueError("num_tokens is needed (the number of completion tokens sampled): pass it, "
                                 "or completion_ids, or build RewardModel with the tokenizer")
        if isinstance(num_tokens, torch.Tensor):
            num_tokens = num_tokens.tolist()
        out = [int(n) for n in num_tokens]
        if len(out) != N or any(n < 0 for n in out):
            raise ValueError(f"num_tokens must hold {N} counts >= 0, got {num_tokens!r}"[:300])
        return out


def _rows(completion_ids: Any, num_tokens: list[int]) -> list[list[int]]:
    """Each completion's sampled ids, cut to its token count (a padded [N, T] tensor is fine)."""
    rows = completion_ids.tolist() if isinstance(completion_ids, torch.Tensor) else completion_ids
    if len(rows) != len(num_tokens):
        raise ValueError(f"completion_ids has {len(rows)} rows for {len(num_tokens)} completions")
    return [list(r)[:n] for r, n in zip(rows, num_tokens)]


def _missing(name: str, ex: Example, rule_judge: bool) -> str | None:
    """Why ``ex`` cannot be scored by component ``name`` (None if it can)."""
    if name in _NEEDS_GOLD and normalize_number(ex.answer) is None:
        return f"has gold answer {ex.answer!r}, which is not a number (training needs numeric gold answers)"
    if name == "tolerance" and not (ex.precision is None or (isinstance(ex.precision, int) and ex.precision >= 0)):
        return f"has precision {ex.precision!r}: give None (integer answers) or decimals >= 0"
    if name in ("step_rar", "step_rvr") and (name == "step_rar" or ex.key_steps):
        if not ex.key_steps:
            return "has no key_steps"
        for g, group in enumerate(ex.key_steps):
            if not isinstance(group, list) or not group or not all(isinstance(a, str) and has_content(a) for a in group):
                return f"has key step group {g} = {group!r}: give a non-empty list of non-empty alternatives"
    if name == "detail":
        if not ex.intermediates:
            return "has no intermediates"
        bad = [it.value for it in ex.intermediates if normalize_number(str(it.value)) is None]
        if bad:
            return f"has intermediate values {bad!r} that are not numbers"
        if ex.difficulty not in W_LEVEL:
            return f"has difficulty {ex.difficulty!r}: give one of {', '.join(W_LEVEL)}"
        if not isinstance(ex.hops, int) or ex.hops < 1:
            return f"has hops={ex.hops!r}: give an int >= 1"
    if name == "rubric":
        return check_rubrics(ex, rule_judge)
    return None
