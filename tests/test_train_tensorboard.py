"""--run.tensorboard: a tiny warm-up -> A run writes every number of its JSONL log as a
TensorBoard scalar (one TensorBoard run per phase), read back here with TensorBoard's own
reader; a resumed phase's events replace the ones it logs again; without the package the
option is one line and exit code 2 before anything is written."""

import importlib.util
import math

import pytest
from train_helpers import log_lines, run_main

from grpo.run.files import record_scalars
from grpo.state.registry import step_dirname

TINY = [  # tiny-random: a warm-up runs before A, so both kinds of records are written
    "--model.name", "tiny-random", "--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4",
    "--run.test_per_stage", "0",
    "--sampling.G", "2", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
    "--warmup.phase.steps", "2", "--warmup.phase.perception_steps", "2", "--warmup.phase.prompts_per_step", "4",
]


def read_events(log_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in the order TensorBoard's reader keeps them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def by_step(events: dict) -> dict[str, dict[int, float]]:
    out = {tag: dict(pairs) for tag, pairs in events.items()}
    assert all(len(out[tag]) == len(pairs) for tag, pairs in events.items())  # one event per step
    return out


def test_every_logged_number_is_a_scalar_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    rc, _, err = run_main(run, *TINY, "--phase", "A", "--phase.steps", "2", "--run.eval_every", "1",
                          "--run.tensorboard", "true")
    assert rc == 0, err
    assert sorted(p.name for p in (run / "tensorboard").iterdir()) == ["A", "warmup"]
    events = {phase: by_step(read_events(run / "tensorboard" / phase)) for phase in ("warmup", "A")}
    records = log_lines(run)
    a1 = next(r for r in records if r["phase"] == "A" and r["step"] == 1 and "event" not in r)
    # named values, as a TensorBoard user would look for them (fp32 in the event file)
    expected = {"reward": a1["reward"], "kl": a1["kl"], "clip_low": a1["clip_low"], "clip_high": a1["clip_high"],
                "components/correctness": a1["components"]["correctness"],
                "weights/correctness": a1["weights"]["correctness"], "time/step": a1["time"]["step"]}
    for tag, value in expected.items():
        assert events["A"][tag][1] == pytest.approx(value, rel=1e-6, abs=1e-7), tag
    warm = [r for r in records if r["phase"] == "warmup" and "event" not in r]
    assert [events["warmup"]["sft_loss"][r["step"]] for r in warm] == pytest.approx([r["sft_loss"] for r in warm],
                                                                                     rel=1e-6)
    assert sorted(events["warmup"]["perception_loss"]) == [1, 2, 3, 4]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [(r["phase"], r["step"]) for r in evals] == [("warmup", 4), ("A", 1), ("A", 2)]
    for r in evals:
        assert events[r["phase"]]["eval/metrics/exact_match"][r["step"]] == pytest.approx(
            r["metrics"]["exact_match"], abs=1e-7)
    # and every other number of the log, nested keys as a/b
    n = 0
    for r in records:
        for tag, value in record_scalars(r):
            got = events[r["phase"]][tag][r["step"]]
            assert got == pytest.approx(value, rel=1e-6, abs=1e-7) or (math.isnan(got) and math.isnan(value)), tag
            n += 1
    # nothing written that the log does not hold
    assert n > 100 and sum(len(v) for run_events in events.values() for v in run_events.values()) == n
    gate = next(r for r in records if r.get("event") == "gate" and r["decision"]["old"] != r["decision"]["new"])
    assert events["A"][f"gate/{gate['rule']}/decision/new"][gate["step"]] == pytest.approx(gate["decision"]["new"])

    # a resumed phase: the steps after its checkpoint are logged again and replace the old events
    adapter = run / "A" / step_dirname(2) / "adapter.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-3] ^= 0x10  # a damaged latest checkpoint: the phase resumes from step 1
    adapter.write_bytes(bytes(data))
    rc, out, err = run_main(run, *TINY, "--phase", "A", "--phase.steps", "2", "--run.eval_every", "1",
                            "--run.tensorboard", "true")
    assert rc == 0 and "resuming phase A at step 1" in out, err
    again = [r for r in log_lines(run)[len(records):] if r["phase"] == "A" and "event" not in r]
    assert [r["step"] for r in again] == [2]
    resumed = read_events(run / "tensorboard" / "A")
    assert [step for step, _ in resumed["reward"]] == [1, 2]  # step 2 once: the first run's was purged
    assert resumed["reward"][1][1] == pytest.approx(again[0]["reward"])
    assert resumed["time/step"][1][1] == pytest.approx(again[0]["time"]["step"])  # the new run's, not the first one's


def test_record_scalars_flattens_dicts_and_lists_and_skips_what_is_not_a_number():
    record = {"phase": "B", "step": 3, "reward": 0.5, "n": 3, "components": {"format": 1.0, "tag": "x"},
              "updates": [{"loss": 2.0}], "grad_norm": None, "flag": True}
    assert list(record_scalars(record)) == [("reward", 0.5), ("n", 3.0), ("components/format", 1.0),
                                            ("updates/0/loss", 2.0)]
    gate = {"event": "gate", "phase": "A", "step": 1, "rule": "finished", "changes": {"finished": [1.5, 1.75]}}
    assert list(record_scalars(gate)) == [("gate/finished/changes/finished/0", 1.5),
                                          ("gate/finished/changes/finished/1", 1.75)]


def test_without_the_package_the_option_is_one_line_and_exit_2(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    run = tmp_path / "run"
    rc, out, err = run_main(run, *TINY, "--phase", "warmup", "--run.tensorboard", "true")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: run.tensorboard=true needs the tensorboard package: pip install 'vlgrpo[tensorboard]'")
    assert not (run / "train_log.jsonl").exists() and not (run / "tensorboard").exists()
