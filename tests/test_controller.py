"""The metric-gated controller: the staged paper's gates (docs/design.md, section 4) as a table, plus the additions."""

import json
import logging

import pytest

from grpo.config import PHASE_WEIGHTS
from grpo.controller import BOUNDS, Controller, Decision, GateThresholds, check_metrics

L = 48  # .85 L = 40.8 tokens

# Structure stable, no truncation, short answers, nothing vanishing: no gate fires here.
HEALTHY = dict(parseable=0.95, solution_tag=0.97, reasoning_tag=0.96, malformed=0.02, truncation=0.03,
               mean_tokens=20.0, exact=0.40, zero_spread=0.1)
C = PHASE_WEIGHTS["C"]  # format .5, parseable .5, finished .75, correctness 5, brevity .2, tolerance 1
A = PHASE_WEIGHTS["A"]  # format 1, parseable 1, finished 1.5, correctness 2, brevity .25, tolerance 0


def run_gates(weights, metrics, prev_exact=0.30, temperature=1.0, **th):
    ctl = Controller(weights, L, GateThresholds(**th), temperature=temperature)
    ctl.prev_exact = prev_exact
    decisions = ctl.update({**HEALTHY, **metrics})
    return ctl, decisions


# (id, start weights, metric overrides, prev exact, expected changed weights, rules that fired)
TABLE = [
    ("healthy", C, {}, 0.30, {}, []),
    ("parse-low", C, dict(parseable=0.80), 0.30, dict(parseable=0.75), ["parseable"]),
    ("parse-low-already-high", A, dict(parseable=0.80), 0.30, {}, ["parseable"]),
    ("parse-at-threshold", C, dict(parseable=0.85), 0.30, {}, []),
    ("soltag-low", C, dict(solution_tag=0.89), 0.30, dict(format=0.75), ["format"]),
    ("reastag-low", C, dict(reasoning_tag=0.87), 0.30, dict(format=0.75), ["format"]),
    ("reastag-at-threshold", C, dict(reasoning_tag=0.88), 0.30, {}, []),
    ("malformed-high", C, dict(malformed=0.11), 0.30, dict(format=0.75), ["format"]),
    ("malformed-at-threshold", C, dict(malformed=0.10), 0.30, {}, []),
    ("trunc-high", C, dict(truncation=0.16), 0.30, dict(finished=1.0), ["finished"]),
    ("long-answers", C, dict(mean_tokens=41.0), 0.30, dict(finished=1.0), ["finished"]),
    ("long-at-threshold", C, dict(mean_tokens=0.85 * L), 0.30, {}, []),
    ("trunc-and-long-fire-once", C, dict(truncation=0.2, mean_tokens=45.0), 0.30, dict(finished=1.0), ["finished"]),
    ("stable-plateau", C, dict(exact=0.41), 0.40, dict(correctness=5.5), ["correctness"]),
    ("stable-decline-is-plateau", C, dict(exact=0.35), 0.40, dict(correctness=5.5), ["correctness"]),
    ("stable-gain-exactly-.02", C, dict(exact=0.41), 0.39, {}, []),
    ("stable-gain", C, dict(exact=0.50), 0.40, {}, []),
    ("stable-edges-inclusive", C, dict(parseable=0.92, solution_tag=0.95, reasoning_tag=0.93, malformed=0.05,
                                       truncation=0.08, exact=0.40), 0.40, dict(correctness=5.5), ["correctness"]),
    ("unstable-trunc", C, dict(truncation=0.09, exact=0.40), 0.40, {}, []),
    ("unstable-parse", C, dict(parseable=0.91, exact=0.40), 0.40, {}, []),
    ("first-checkpoint", C, dict(exact=0.40), None, {}, []),
    ("everything-broken", C, dict(parseable=0.5, solution_tag=0.5, reasoning_tag=0.5, malformed=0.5,
                                  truncation=0.5, mean_tokens=47.0, exact=0.0), 0.0,
     dict(parseable=0.75, format=0.75, finished=1.0), ["parseable", "format", "finished"]),
    ("ceiling-correctness", dict(C, correctness=7.8), dict(exact=0.40), 0.40, dict(correctness=8.0), ["correctness", "bounds"]),
    ("ceiling-finished", dict(C, finished=2.0), dict(truncation=0.3), 0.30, {}, ["finished", "bounds"]),
    ("floors-without-gates", dict(C, format=0.1, finished=0.2, correctness=0.5, brevity=1.5, tolerance=-1.0, step_rar=9.0),
     {}, 0.30, dict(format=0.25, finished=0.5, correctness=1.0, brevity=1.0, tolerance=0.0), ["bounds"] * 5),
    ("vanishing-raises-temperature", C, dict(zero_spread=0.6), 0.30, {}, ["vanishing_advantage"]),
    # a weight of 0 is switched off: gates fire (and say so), bounds and steps leave it at 0
    ("correctness-off-plateau", dict(C, correctness=0.0), dict(exact=0.41), 0.40, {}, ["correctness"]),
    ("correctness-off-no-floor", dict(A, correctness=0.0), {}, 0.30, {}, []),
    ("format-off-tags-low", dict(C, format=0.0), dict(solution_tag=0.5), 0.30, {}, ["format"]),
    ("vanishing-at-threshold", C, dict(zero_spread=0.5), 0.30, {}, []),
]


@pytest.mark.parametrize("name,weights,metrics,prev,changed,rules", TABLE, ids=[t[0] for t in TABLE])
def test_gate_table(name, weights, metrics, prev, changed, rules):
    ctl, decisions = run_gates(weights, metrics, prev_exact=prev)
    assert ctl.weights == pytest.approx({**weights, **changed})
    assert [d.rule for d in decisions] == rules
    assert ctl.temperature == pytest.approx(1.1 if "vanishing_advantage" in rules else 1.0)


def test_unknown_components_left_alone():
    ctl, _ = run_gates(dict(C, step_rar=9.0, rubric=-3.0), dict(parseable=0.5))
    assert ctl.weights["step_rar"] == 9.0 and ctl.weights["rubric"] == -3.0


def test_vanishing_advantage_temperature_then_dense_weight():
    ctl = Controller(C, L, temperature=1.0)
    spread = {**HEALTHY, "zero_spread": 0.8}
    temps, targets = [], []
    for exact in (0.1, 0.2, 0.3):  # exact keeps rising: only the vanishing gate fires
        (d,) = ctl.update({**spread, "exact": exact})
        temps.append(ctl.temperature)
        targets.append(d.target)
    assert temps == pytest.approx([1.1, 1.2, 1.2])  # capped at temperature_max
    assert targets == ["temperature", "temperature", "brevity"]  # third time: the dense weight instead
    assert ctl.weights["brevity"] == pytest.approx(0.25)
    # brevity is bounded at 1
    ctl.weights["brevity"] = 0.99
    ctl.update({**spread, "exact": 0.4})
    assert ctl.weights["brevity"] == 1.0


def test_vanishing_never_lowers_a_high_temperature():
    ctl = Controller(C, L, temperature=1.5)
    ctl.update({**HEALTHY, "zero_spread": 0.9})
    assert ctl.temperature == 1.5 and ctl.weights["brevity"] == pytest.approx(0.25)


def test_vanishing_gate_skipped_without_training_stat():
    m = {k: v for k, v in HEALTHY.items() if k != "zero_spread"}
    ctl = Controller(C, L)
    assert ctl.update(m) == [] and ctl.temperature == 1.0


def test_first_checkpoint_then_plateau():
    ctl = Controller.for_phase("B", L)
    assert ctl.update(HEALTHY) == []  # no previous exact match yet
    assert ctl.prev_exact == 0.40
    d = ctl.update({**HEALTHY, "exact": 0.41})
    assert [x.rule for x in d] == ["correctness"] and ctl.weights["correctness"] == 4.5
    assert d[0].values["prev_exact"] == 0.40 and d[0].values["exact"] == 0.41


def test_for_phase_copies_presets():
    ctl = Controller.for_phase("C", L)
    assert ctl.weights == C
    ctl.update({**HEALTHY, "parseable": 0.1})
    assert PHASE_WEIGHTS["C"]["parseable"] == 0.5  # the preset is not mutated
    with pytest.raises(ValueError, match="warm-up is SFT"):
        Controller.for_phase("warmup", L)


def test_decision_records_values_intervals_and_borderline():
    ctl = Controller(C, L)
    d = ctl.update({**HEALTHY, "parseable": 0.84}, n=200)
    assert d[0].rule == "parseable" and d[0].values == {"parseable": 0.84}
    lo, hi = d[0].intervals["parseable"]
    assert lo < 0.84 < hi and abs((hi - lo) / 2 - 0.05) < 0.01
    assert d[0].borderline  # .85 lies inside the interval
    assert "parseable=0.84" in d[0].condition and "< 0.85" in d[0].condition
    assert "0.5 -> 0.75" in str(d[0])
    d = Controller(C, L).update({**HEALTHY, "parseable": 0.50}, n=200)
    assert not d[0].borderline
    # An any-of gate is borderline only if none of the checks that fired is clear.
    d = Controller(C, L).update({**HEALTHY, "solution_tag": 0.89, "malformed": 0.16}, n=200)
    assert d[0].rule == "format" and "solution_tag" in d[0].condition and not d[0].borderline
    d = Controller(C, L).update({**HEALTHY, "solution_tag": 0.89, "malformed": 0.11}, n=200)
    assert d[0].borderline
    # Every metric carries its interval in the history, fired or not.
    assert set(ctl.history[-1]["intervals"]) >= {"parseable", "solution_tag", "exact"}


def test_require_clear_evidence():
    th = GateThresholds(require_clear_evidence=True)
    assert Controller(C, L, th).update({**HEALTHY, "parseable": 0.84}, n=200) == []
    assert [d.rule for d in Controller(C, L, th).update({**HEALTHY, "parseable": 0.70}, n=200)] == ["parseable"]
    # the point rule still fires on the same borderline number
    assert [d.rule for d in Controller(C, L).update({**HEALTHY, "parseable": 0.84}, n=200)] == ["parseable"]
    with pytest.raises(ValueError, match="needs intervals"):
        Controller(C, L, th).update(HEALTHY)


def test_eval_summary_keys_and_intervals_accepted():
    summary = {"parseable_rate": 0.80, "solution_tag_rate": 0.97, "reasoning_tag_rate": 0.96, "malformed_rate": 0.02,
               "truncation_rate": 0.03, "mean_completion_tokens": 20.0, "exact_match": 0.4, "tolerance_accuracy": 0.5}
    d = Controller(C, L).update(summary, intervals={"parseable_rate": (0.7, 0.88)})
    assert d[0].rule == "parseable" and d[0].intervals == {"parseable": (0.7, 0.88)} and d[0].borderline
    with pytest.raises(ValueError, match="given twice"):
        check_metrics({**HEALTHY, "parseable_rate": 0.5})


@pytest.mark.parametrize("bad,match", [
    ({"parseable": None}, "lack parseable"),
    ({"exact": 1.5}, "rates must lie in"),
    ({"malformed": float("nan")}, "finite number"),
    ({"mean_tokens": -1.0}, "cannot be negative"),
    ({"zero_spread": "high"}, "finite number"),
])
def test_bad_metrics(bad, match):
    m = {**HEALTHY, **bad}
    m = {k: v for k, v in m.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        Controller(C, L).update(m)


def test_bad_construction():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Controller(C, 0)
    with pytest.raises(ValueError, match="finite number"):
        Controller(dict(C, format="x"), L)
    with pytest.raises(ValueError, match="spread_component"):
        Controller(C, L, GateThresholds(spread_component="nope"))


def test_state_round_trip_through_json():
    ctl = Controller.for_phase("B", L)
    ctl.update({**HEALTHY, "parseable": 0.80, "zero_spread": 0.7}, n=200)
    ctl.update({**HEALTHY, "exact": 0.40})
    state = json.loads(json.dumps(ctl.state_dict()))  # must be plain JSON
    twin = Controller.for_phase("B", L)
    twin.load_state_dict(state)
    assert (twin.weights, twin.temperature, twin.prev_exact) == (ctl.weights, ctl.temperature, ctl.prev_exact)
    assert twin.history == ctl.history
    rebuilt = Controller.from_state_dict(state)
    nxt = {**HEALTHY, "exact": 0.405, "truncation": 0.2, "zero_spread": 0.9}
    a, b, c = ctl.update(nxt), twin.update(nxt), rebuilt.update(nxt)
    assert a == b == c and ctl.weights == twin.weights == rebuilt.weights
    assert [Decision.from_dict(x) for x in ctl.history[-1]["decisions"]] == a


def test_state_from_another_phase_refused():
    state = Controller.for_phase("A", L).state_dict()
    with pytest.raises(ValueError, match="new phase starts from its preset"):
        Controller.for_phase("B", L).load_state_dict(state)


def test_decisions_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="grpo.controller"):
        Controller(C, L).update({**HEALTHY, "truncation": 0.3}, n=200)
    text = caplog.text
    assert "truncation=0.3" in text and "finished 0.75 -> 1" in text and "[" in text


def test_bounds_cover_design_components():
    assert set(BOUNDS) == set(PHASE_WEIGHTS["A"])
    for phase, w in PHASE_WEIGHTS.items():  # presets start inside their bounds
        assert all(BOUNDS[k][0] <= v <= BOUNDS[k][1] for k, v in w.items()), phase


def test_switched_off_weight_stays_off_over_a_phase():
    """correctness=0 (the staged paper's accidental setting) survives every checkpoint of a phase."""
    ctl = Controller(dict(PHASE_WEIGHTS["B"], correctness=0.0), L)
    for exact in (0.10, 0.10, 0.05, 0.05):  # stable structure, plateaued EM: the correctness gate fires
        decisions = ctl.update({**HEALTHY, "exact": exact})
        assert ctl.weights["correctness"] == 0.0
    fired = [d for d in decisions if d.rule == "correctness"]
    assert fired and fired[0].new == 0.0 and "switched off: left at 0" in str(fired[0])


def test_the_caps_option_reaches_the_trainers_controller(tmp_path):
    """--sampling.temperature_max is the cap the trainer's controller climbs to: on the clock set
    (the base near chance, every group soon without spread) the gate raises the temperature past
    the default 1.2 to 1.3, never beyond, then turns to its dense term."""
    import subprocess
    import sys

    from train_helpers import log_lines, run_main

    root = tmp_path / "clock"
    repo = __import__("pathlib").Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-m", "data.clock", "--out", str(root), "--n", "60"], cwd=repo,
                          capture_output=True).returncode == 0
    code, out, err = run_main(tmp_path / "run", "--phase", "A", "--run.data", str(root), "--model.device", "cpu",
                              "--phase.steps", "12", "--run.eval_every", "2", "--run.eval_size", "4",
                              "--run.test_per_stage", "0", "--sampling.temperature_max", "1.3")
    assert code == 0, err
    temps = [r["temperature"] for r in log_lines(tmp_path / "run") if "reward" in r]
    assert max(temps) == pytest.approx(1.3) and "temperature 1.2 -> 1.3" in out
    assert "-> brevity" in out  # at the cap, the dense term
