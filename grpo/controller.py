"""Metric-gated reward-weight controller (staged metric-gated GRPO, docs/design.md section 4).

After each checkpoint the trainer evaluates the policy on a fixed held-out eval subset and
hands the aggregate rates to `Controller.update`. The controller changes reward weights
only when a metric crosses a gate, and returns every decision with the numbers behind it:

    gate         condition (point estimates)                          action
    parseable    parseable < .85                                      parseable = max(w, .75)
    format       solution_tag < .90 or reasoning_tag < .88
                 or malformed > .10                                   format = max(w, .75)
    finished     truncation > .15 or mean_tokens > .85 L              finished += .25
    correctness  structure stable (parseable >= .92, solution_tag >= .95,
                 reasoning_tag >= .93, malformed <= .05, truncation <= .08)
                 and exact match plateaued (gain < .02 vs the previous
                 checkpoint; a drop counts as a plateau)              correctness += .5
    vanishing    zero_spread > .5 (added here, see below)             temperature += .1 up to 1.2,
    advantage                                                         then brevity += .05
    bounds       format/parseable [.25, 2], finished [.5, 2], correctness [1, 8],
                 brevity [0, 1], tolerance [0, 2]; other components are left alone
    switched off a weight of exactly 0 stays 0: no gate and no bound turns it on

The intuition: weights start shaped for the phase (A: structure, B: correctness, C: harder
items + tolerance). Structure weights are *floored* when structure slips; correctness is
pushed up only once structure is stable and exact match has stopped rising, so the policy
is not asked to get answers right before it reliably writes a checkable answer.

What is added to the anchor
- Switched-off terms stay off. ``--rewards.weights correctness=0`` (the staged paper's
  accidental setting: its gold answers were empty, so it optimised everything but
  correctness) would otherwise last until the first checkpoint, where the correctness
  floor of 1 (or the plateau gate's +.5) switches the term back on. The gates tune the
  terms being optimised; a term the config set to 0 is left at 0, and a gate that fires on
  it is logged with "left at 0".
- Vanishing advantages. GRPO's advantage is (r - mean_g) / (std_g + eps): a group whose G
  rewards are all equal (all right or all wrong, same format) has zero advantage and
  contributes no gradient. The trainer passes `zero_spread`, the fraction of such groups
  averaged over the steps since the last checkpoint (with dynamic sampling, the fraction of
  the *sampled* groups it dropped: the trained batch has none). Above `zero_spread_max` the
  controller first raises the sampling temperature a notch (more diverse samples within a
  group are the direct cure, and unlike a reward weight it does not change what is being
  optimised), up to `temperature_max` (1.2, R1-VL's setting). Once the temperature is at
  its cap it raises the weight of `spread_component` (brevity by default): brevity is the
  densest verifier term (four length buckets), so completions that tie on correctness and
  format still differ in reward. The trainer must read `controller.temperature` back into
  its sampler (and its log-prob temperature) after each update.
- Evidence. The anchor gated on 4 eval examples, so every rate moved in steps of .25. The
  gates here keep the design's point-estimate semantics (the table tests follow the
  design), but every value is logged beside its 95% Wilson interval, each decision says
  whether the interval straddles the threshold (`borderline`), and
  `GateThresholds.require_clear_evidence=True` fires a threshold only when the whole
  interval lies on the firing side. Eval size (95% Wilson half-width at a rate of .9):
  n=4 -> +-.29, n=50 -> +-.09, n=100 -> +-.06, n=200 -> +-.04, n=456 -> +-.03. Gates sit
  .02-.05 apart, so n >= 200 (the default `run.eval_size`) is the recommended minimum.

Simplified: the exact-match plateau test compares two point estimates (a paired interval
on the gain would need per-example results); `require_clear_evidence` does not apply to it.

Metric keys: the short names below, or eval/metrics.py's summary names
(parseable_rate, exact_match, mean_completion_tokens, ...), so `summary.metrics` and
`summary.intervals` can be passed straight in. All rates in [0, 1]; mean_tokens in tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eval.metrics import wilson_interval
from grpo.config import PHASE_WEIGHTS

log = logging.getLogger(__name__)

RATE_KEYS = ("parseable", "solution_tag", "reasoning_tag", "malformed", "truncation", "exact")
REQUIRED_KEYS = RATE_KEYS + ("mean_tokens",)
OPTIONAL_KEYS = ("zero_spread",)  # a training statistic; the gate is skipped without it
# eval/metrics.py summary names -> the controller's names.
EVAL_KEY_ALIASES = {
    "parseable_rate": "parseable",
    "solution_tag_rate": "solution_tag",
    "reasoning_tag_rate": "reasoning_tag",
    "malformed_rate": "malformed",
    "truncation_rate": "truncation",
    "exact_match": "exact",
    "mean_completion_tokens": "mean_tokens",
}
# Floors and ceilings of the verifier weights (docs/design.md, section 3).
BOUNDS: dict[str, tuple[float, float]] = {
    "format": (0.25, 2.0),
    "parseable": (0.25, 2.0),
    "finished": (0.5, 2.0),
    "correctness": (1.0, 8.0),
    "brevity": (0.0, 1.0),
    "tolerance": (0.0, 2.0),
}
# Comparisons are made on values rounded to this many decimals, so that a rate of
# 41/100 - 39/100 (= 0.01999999999999996 in floating point) counts as a gain of .02.
_DECIMALS = 9


@dataclass(frozen=True)
class GateThresholds:
    """Gate thresholds and step sizes; defaults are the staged paper's (docs/design.md, section 4)."""

    parseable_min: float = 0.85
    """Parseable rate below this floors the parseable weight."""
    parseable_weight_floor: float = 0.75
    """... at this value: parseable = max(w, floor)."""
    solution_tag_min: float = 0.90
    """Solution-tag rate below this floors the format weight."""
    reasoning_tag_min: float = 0.88
    """Reasoning-tag rate below this floors the format weight."""
    malformed_max: float = 0.10
    """Malformed rate above this floors the format weight."""
    format_weight_floor: float = 0.75
    """... at this value: format = max(w, floor)."""
    truncation_max: float = 0.15
    """Truncation rate above this raises the finished weight."""
    mean_tokens_frac_max: float = 0.85
    """Mean completion tokens above this fraction of L raises the finished weight."""
    finished_step: float = 0.25
    """finished += this when the truncation gate fires."""
    stable_parseable: float = 0.92
    """Structure is stable when parseable >= this ..."""
    stable_solution_tag: float = 0.95
    """... and solution_tag >= this ..."""
    stable_reasoning_tag: float = 0.93
    """... and reasoning_tag >= this ..."""
    stable_malformed: float = 0.05
    """... and malformed <= this ..."""
    stable_truncation: float = 0.08
    """... and truncation <= this."""
    plateau_gain: float = 0.02
    """Exact match has plateaued when it gained less than this since the previous checkpoint."""
    correctness_step: float = 0.5
    """correctness += this when structure is stable and exact match has plateaued."""
    zero_spread_max: float = 0.5
    """Fraction of zero-reward-spread groups above which the vanishing-advantage gate fires."""
    temperature_step: float = 0.1
    """Sampling temperature += this when advantages vanish ..."""
    temperature_max: float = 1.2
    """... never above this (the temperature is never lowered by the controller)."""
    spread_component: str = "brevity"
    """Dense reward component raised once the temperature is at its cap."""
    spread_step: float = 0.05
    """... by this much per checkpoint (then bounded)."""
    require_clear_evidence: bool = False
    """Fire a threshold gate only when the metric's 95% interval lies entirely on the firing side."""


@dataclass(frozen=True)
class Decision:
    """One rule that fired: what it read, what it changed (old == new: fired, already satisfied)."""

    rule: str  # parseable | format | finished | correctness | vanishing_advantage | bounds
    condition: str  # the condition that held, with values and intervals, e.g. "parseable=0.800 [0.74, 0.85] < 0.85"
    target: str  # the weight name, or "temperature"
    old: float
    new: float
    values: dict[str, float]  # the metric values the rule read
    intervals: dict[str, tuple[float, float]]  # their 95% intervals, where known
    borderline: bool = False  # an interval straddles a threshold the rule fired on

    def __str__(self) -> str:
        flag = " (borderline: the interval straddles the threshold)" if self.borderline else ""
        return f"[{self.rule}] {self.condition} -> {self.target} {self.old:.4g} -> {self.new:.4g}{flag}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["intervals"] = {k: list(v) for k, v in self.intervals.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Decision":
        return cls(**{**d, "intervals": {k: tuple(v) for k, v in d["intervals"].items()}})


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Check:
    """One comparison `value op threshold`, judged on the point value and on its interval."""

    key: str
    op: str  # "<", ">", "<=", ">="
    threshold: float
    value: float
    interval: tuple[float, float] | None
    label: str = ""  # how the threshold is shown when it is derived (e.g. ".85 L")

    def holds(self) -> bool:
        v, t = round(self.value, _DECIMALS), round(self.threshold, _DECIMALS)
        return {"<": v < t, ">": v > t, "<=": v <= t, ">=": v >= t}[self.op]

    def clear(self) -> bool:
        """True when the whole interval is on the holding side (no interval: the point decides)."""
        if self.interval is None:
            return self.holds()
        lo, hi = (round(x, _DECIMALS) for x in self.interval)
        t = round(self.threshold, _DECIMALS)
        return {"<": hi < t, ">": lo > t, "<=": hi <= t, ">=": lo >= t}[self.op]

    def fires(self, require_clear: bool) -> bool:
        return self.clear() if require_clear else self.holds()

    def text(self) -> str:
        ci = f" [{self.interval[0]:.3f}, {self.interval[1]:.3f}]" if self.interval else ""
        label = f" ({self.label})" if self.label else ""
        return f"{self.key}={self.value:.4g}{ci} {self.op} {self.threshold:.4g}{label}"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _normalise_keys(d: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Map eval/metrics.py names to the controller's; refuse a metric given twice."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = EVAL_KEY_ALIASES.get(k, k)
        if name in out:
            raise ValueError(f"{what}: {name!r} is given twice (as {name!r} and its eval name); pass one")
        out[name] = v
    return out


def check_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Validate the eval metrics: required keys present, numbers finite, rates in [0, 1]."""
    m = _normalise_keys(metrics, "metrics")
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if missing:
        raise ValueError(
            f"controller metrics lack {', '.join(missing)}; it needs {', '.join(REQUIRED_KEYS)} "
            f"(+ optional {', '.join(OPTIONAL_KEYS)}), got {', '.join(sorted(m)) or 'nothing'}"
        )
    out = {}
    for k in REQUIRED_KEYS + OPTIONAL_KEYS:
        if k not in m or m[k] is None:
            continue
        v = m[k]
        if not _is_number(v):
            raise ValueError(f"controller metric {k}={v!r}: expected a finite number")
        if k != "mean_tokens" and not 0.0 <= v <= 1.0:
            raise ValueError(f"controller metric {k}={v}: rates must lie in [0, 1] (pass fractions, not percent)")
        if k == "mean_tokens" and v < 0:
            raise ValueError(f"controller metric mean_tokens={v}: a token count cannot be negative")
        out[k] = float(v)
    return out


def metric_intervals(
    metrics: Mapping[str, float],
    intervals: Mapping[str, tuple[float, float]] | None = None,
    n: int | None = None,
) -> dict[str, tuple[float, float]]:
    """Given intervals (normalised keys), plus Wilson intervals over n for rates that lack one."""
    out = {k: (float(v[0]), float(v[1])) for k, v in _normalise_keys(intervals or {}, "intervals").items()}
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"eval size n={n!r}: must be a positive int (the number of eval prompts)")
        for k in RATE_KEYS:
            if k in metrics and k not in out:
                out[k] = wilson_interval(metrics[k] * n, n)
    return out


def format_metrics(metrics: Mapping[str, float], intervals: Mapping[str, tuple[float, float]]) -> str:
    """'parseable=0.912 [0.866, 0.943] exact=...' for the log line beside each checkpoint."""
    parts = []
    for k in REQUIRED_KEYS + OPTIONAL_KEYS:
        if k in metrics:
            ci = f" [{intervals[k][0]:.3f}, {intervals[k][1]:.3f}]" if k in intervals else ""
            parts.append(f"{k}={metrics[k]:.4g}{ci}")
    return " ".join(parts)


# ----------------------------------------------------------------------------- controller


class Controller:
    """Holds the current reward weights and temperature; `update` applies the gates once per checkpoint."""

    def __init__(
        self,
        weights: Mapping[str, float],
        max_new_tokens: int,
        thresholds: GateThresholds = GateThresholds(),
        temperature: float = 1.0,
        phase: str | None = None,
    ):
        bad = {k: v for k, v in weights.items() if not _is_number(v)}
        if bad:
            raise ValueError(f"controller weights {bad}: every weight must be a finite number")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: L must be a positive int (sampling.max_new_tokens)")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r}: must be > 0")
        if thresholds.spread_component not in BOUNDS:
            raise ValueError(f"spread_component={thresholds.spread_component!r}: use one of {', '.join(BOUNDS)}")
        self.weights: dict[str, float] = {k: float(v) for k, v in weights.items()}
        self.L = max_new_tokens
        self.thresholds = thresholds
        self.temperature = float(temperature)
        self.phase = phase
        self.prev_exact: float | None = None  # exact match at the previous checkpoint
        self.history: list[dict[str, Any]] = []  # one entry per update (JSON-ready)

    @classmethod
    def for_phase(
        cls, phase: str, max_new_tokens: int, thresholds: GateThresholds = GateThresholds(), temperature: float = 1.0
    ) -> "Controller":
        """A new phase starts from its preset weights (PHASE_WEIGHTS), with no exact-match history."""
        if phase not in PHASE_WEIGHTS:
            raise ValueError(
                f"phase {phase!r} has no reward weights (the warm-up is SFT); use one of {', '.join(PHASE_WEIGHTS)}")
        return cls(dict(PHASE_WEIGHTS[phase]), max_new_tokens, thresholds, temperature, phase=phase)

    # ------------------------------------------------------------------ the gates

    def update(
        self,
        metrics: Mapping[str, float],
        intervals: Mapping[str, tuple[float, float]] | None = None,
        n: int | None = None,
    ) -> list[Decision]:
        """Apply every gate to one checkpoint's eval metrics; mutate .weights/.temperature.

        intervals: 95% interval per metric (e.g. eval Summary.intervals); n: eval prompts,
        used for Wilson intervals of rates that have none. Returns the decisions that fired.
        """
        m = check_metrics(metrics)
        ci = metric_intervals(m, intervals, n)
        if self.thresholds.require_clear_evidence and not any(k in ci for k in RATE_KEYS):
            raise ValueError("require_clear_evidence needs intervals or the eval size n: pass update(..., n=eval_size)")
        decisions = (
            self._gate_parseable(m, ci)
            + self._gate_format(m, ci)
            + self._gate_finished(m, ci)
            + self._gate_correctness(m, ci)
            + self._gate_vanishing(m, ci)
            + self._apply_bounds()
        )
        self.prev_exact = m["exact"]
        self._record(m, ci, decisions)
        return decisions

    def _check(self, m: dict, ci: dict, key: str, op: str, threshold: float, label: str = "") -> _Check:
        return _Check(key, op, threshold, m[key], ci.get(key), label)

    def _decide(
        self, rule: str, checks: list[_Check], target: str, new: float, extra: dict | None = None
    ) -> list[Decision]:
        """Set weight `target` to `new` (if the component exists) and describe why."""
        if target == "temperature":
            old = self.temperature
            self.temperature = new
        elif target in self.weights:
            old = self.weights[target]
            if old == 0.0:  # switched off by the config: the gate fired, the term stays off
                new = 0.0
            self.weights[target] = new
        else:
            log.warning("controller rule %s fired but %r is not a reward component here; nothing changed", rule, target)
            return []
        values = {c.key: c.value for c in checks} | (extra or {})
        cis = {c.key: c.interval for c in checks if c.interval is not None}
        any_of = rule in ("format", "finished")  # fire on any check; the rest need all checks
        # Borderline: the gate would not have fired on the intervals alone.
        clear = [c.clear() for c in checks]
        borderline = not (any(clear) if any_of else all(clear))
        cond = (" or " if any_of else " and ").join(c.text() for c in checks)
        if target != "temperature" and old == 0.0:
            cond += f" ({target} has weight 0 = switched off: left at 0)"
        return [Decision(rule, cond, target, old, new, values, cis, borderline)]

    def _fired(self, checks: list[_Check]) -> list[_Check]:
        return [c for c in checks if c.fires(self.thresholds.require_clear_evidence)]

    def _gate_parseable(self, m: dict, ci: dict) -> list[Decision]:
        th = self.thresholds
        fired = self._fired([self._check(m, ci, "parseable", "<", th.parseable_min)])
        if not fired:
            return []
        w = self.weights.get("parseable", 0.0)
        return self._decide("parseable", fired, "parseable", max(w, th.parseable_weight_floor))

    def _gate_format(self, m: dict, ci: dict) -> list[Decision]:
        th = self.thresholds
        fired = self._fired([
            self._check(m, ci, "solution_tag", "<", th.solution_tag_min),
            self._check(m, ci, "reasoning_tag", "<", th.reasoning_tag_min),
            self._check(m, ci, "malformed", ">", th.malformed_max),
        ])
        if not fired:
            return []
        w = self.weights.get("format", 0.0)
        return self._decide("format", fired, "format", max(w, th.format_weight_floor))

    def _gate_finished(self, m: dict, ci: dict) -> list[Decision]:
        th = self.thresholds
        fired = self._fired([
            self._check(m, ci, "truncation", ">", th.truncation_max),
            self._check(m, ci, "mean_tokens", ">", th.mean_tokens_frac_max * self.L,
                        f"{th.mean_tokens_frac_max:g} L, L={self.L}"),
        ])
        if not fired:
            return []
        w = self.weights.get("finished", 0.0)
        return self._decide("finished", fired, "finished", w + th.finished_step)

    def _gate_correctness(self, m: dict, ci: dict) -> list[Decision]:
        th = self.thresholds
        stable = [
            self._check(m, ci, "parseable", ">=", th.stable_parseable),
            self._check(m, ci, "solution_tag", ">=", th.stable_solution_tag),
            self._check(m, ci, "reasoning_tag", ">=", th.stable_reasoning_tag),
            self._check(m, ci, "malformed", "<=", th.stable_malformed),
            self._check(m, ci, "truncation", "<=", th.stable_truncation),
        ]
        if self.prev_exact is None or len(self._fired(stable)) < len(stable):
            return []  # first checkpoint of the phase: no gain to judge yet
        gain = m["exact"] - self.prev_exact
        # The plateau is judged on point estimates only (see the module docstring).
        plateau = _Check("exact_gain", "<", th.plateau_gain, gain, None,
                         f"exact {m['exact']:.4g} vs previous {self.prev_exact:.4g}")
        if not plateau.holds():
            return []
        w = self.weights.get("correctness", 0.0)
        return self._decide("correctness", stable + [plateau], "correctness", w + th.correctness_step,
                            extra={"exact": m["exact"], "prev_exact": self.prev_exact})

    def _gate_vanishing(self, m: dict, ci: dict) -> list[Decision]:
        th = self.thresholds
        if "zero_spread" not in m:
            return []
        fired = self._fired([self._check(m, ci, "zero_spread", ">", th.zero_spread_max)])
        if not fired:
            return []
        if round(self.temperature, _DECIMALS) < round(th.temperature_max, _DECIMALS):
            new_t = max(self.temperature, min(self.temperature + th.temperature_step, th.temperature_max))
            return self._decide("vanishing_advantage", fired, "temperature", new_t)
        comp = th.spread_component
        return self._decide("vanishing_advantage", fired, comp, self.weights.get(comp, 0.0) + th.spread_step)

    def _apply_bounds(self) -> list[Decision]:
        out = []
        for name, (lo, hi) in BOUNDS.items():
            if name in self.weights and self.weights[name] != 0.0:  # 0 = switched off, not too small
                w = self.weights[name]
                clipped = min(max(w, lo), hi)
                if clipped != w:
                    self.weights[name] = clipped
                    out.append(Decision("bounds", f"{name}={w:.4g} outside [{lo:g}, {hi:g}]", name, w, clipped, {}, {}))
        return out

    def _record(self, m: dict, ci: dict, decisions: list[Decision]) -> None:
        log.info("controller eval: %s", format_metrics(m, ci))
        for d in decisions:
            log.info("controller decision: %s", d)
        if not decisions:
            log.info("controller: no gate fired; weights unchanged")
        self.history.append({
            "metrics": dict(m),
            "intervals": {k: list(v) for k, v in ci.items()},
            "decisions": [d.to_dict() for d in decisions],
            "weights": dict(self.weights),
            "temperature": self.temperature,
        })

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the same phase, as plain JSON types."""
        return {
            "version": 1,
            "phase": self.phase,
            "weights": dict(self.weights),
            "max_new_tokens": self.L,
            "temperature": self.temperature,
            "prev_exact": self.prev_exact,
            "thresholds": dataclasses.asdict(self.thresholds),
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a same-phase state. Thresholds and L stay as constructed (a change is logged)."""
        missing = [k for k in ("weights", "temperature", "prev_exact", "history") if k not in state]
        if missing:
            raise ValueError(f"controller state lacks {', '.join(missing)}: pass the dict from Controller.state_dict()")
        if self.phase is not None and state.get("phase") not in (None, self.phase):
            raise ValueError(
                f"controller state is from phase {state['phase']!r} but this controller runs phase {self.phase!r}: "
                "a new phase starts from its preset weights (Controller.for_phase), not from the previous phase's state"
            )
        if state.get("thresholds") not in (None, dataclasses.asdict(self.thresholds)):
            log.warning("controller thresholds differ from the saved ones; using the ones given now")
        if state.get("max_new_tokens") not in (None, self.L):
            log.warning("controller L changed from %s to %s since the state was saved", state["max_new_tokens"], self.L)
        self.weights = {k: float(v) for k, v in state["weights"].items()}
        self.temperature = float(state["temperature"])
        self.prev_exact = None if state["prev_exact"] is None else float(state["prev_exact"])
        self.history = [dict(h) for h in state["history"]]

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], thresholds: GateThresholds | None = None) -> "Controller":
        """Rebuild a controller from its saved state (thresholds: the saved ones unless given)."""
        th = thresholds or GateThresholds(**state.get("thresholds", {}))
        c = cls(state["weights"], int(state["max_new_tokens"]), th, float(state["temperature"]), state.get("phase"))
        c.load_state_dict(state)
        return c
