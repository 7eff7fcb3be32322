"""Stops that lose nothing (grpo/stop.py): real signals to a real trainer process.

- The warm-up: SIGTERM mid-way, kill -9 after a periodic save, SIGINT during its final
  evaluation -- each resumed by the same command to final weights byte-equal to a
  straight run; periodic saves do not change a straight run's computation (every loss,
  the final weights); a stopped warm-up is resumed, never taken for a finished one.
- A second Ctrl-C stops at once, without a traceback, and the run still resumes.
- GRPO phases: SIGTERM mid-phase and SIGINT during a checkpoint evaluation, resumed
  bit-identically (the kill -9 test's settings, tests/test_train_resume.py); periodic
  `latest`-only saves are pruned and leave the metric aliases to the evaluations.

Every stop must exit 130 (SIGINT) or 143 (SIGTERM), write exactly one line on stderr
and no traceback.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch

from grpo.checkpoint import load_checkpoint, phase_finished, read_registry, resolve
from grpo.cli import phases_to_run
from grpo.run import RunFiles
from train_helpers import Trainer, log_lines, run_main

WARMUP = ["--phase", "warmup", "--model.name", "tiny-random", "--model.device", "cpu", "--run.train_per_stage", "16",
          "--run.eval_size", "4", "--warmup.phase.steps", "5", "--warmup.phase.perception_steps", "5",
          "--warmup.phase.prompts_per_step", "4", "--sampling.max_new_tokens", "8"]
TOTAL = 10  # 5 caption + 5 reasoning steps
STOP_LINE = re.compile(r"stopped at (\w+) step (\d+)( \(its evaluation abandoned\))? on (SIGINT|SIGTERM); "
                       r"checkpoint saved; the same command resumes")


def final_bytes(run: Path, phase: str) -> bytes:
    return (resolve(run, f"{phase}:latest") / "adapter.safetensors").read_bytes()


def losses(run: Path, phase: str = "warmup") -> dict[int, tuple]:
    """step -> the losses it logged (later lines win: a resumed run redoes the lost steps)."""
    return {r["step"]: (r["sft_loss"], r.get("perception_loss")) for r in log_lines(run)
            if r.get("phase") == phase and "event" not in r}


def assert_one_stop_line(rc: int, err: str, signum: int) -> re.Match:
    assert rc == 128 + signum, (rc, err)
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    m = STOP_LINE.fullmatch(lines[0])
    assert m and m.group(4) == signal.Signals(signum).name, lines[0]
    return m


@pytest.fixture(scope="module")
def straight_warmup(tmp_path_factory):
    """The warm-up in one go, with periodic saves switched off."""
    run = tmp_path_factory.mktemp("straight") / "run"
    rc, out, err = run_main(run, *WARMUP, "--run.save_every_minutes", "0")
    assert rc == 0, err
    return run


def test_periodic_saves_change_nothing_in_a_straight_warmup(straight_warmup, tmp_path):
    run = tmp_path / "run"
    rc, out, err = run_main(run, *WARMUP, "--run.save_every", "1")  # a save after every step
    assert rc == 0, err
    assert losses(run) == losses(straight_warmup) and len(losses(run)) == TOTAL
    assert final_bytes(run, "warmup") == final_bytes(straight_warmup, "warmup")
    reg = read_registry(run, "warmup")  # the periodic ones were pruned by the final save
    assert [c["step"] for c in reg["checkpoints"]] == [TOTAL] and "periodic" not in reg["checkpoints"][0]
    assert sorted(p.name for p in (run / "warmup").iterdir()) == ["registry.json", "step_000010"]
    assert load_checkpoint(resolve(run, "warmup:latest")).metrics  # the final one keeps its evaluation


def test_sigterm_mid_warmup_saves_and_the_same_command_resumes_bit_identically(straight_warmup, tmp_path):
    run = tmp_path / "run"
    t = Trainer(run, *WARMUP)
    t.wait_for_step("warmup", 3)
    t.signal(signal.SIGTERM)
    rc, out, err = t.finish()
    m = assert_one_stop_line(rc, err, signal.SIGTERM)
    stopped = int(m.group(2))
    assert m.group(1) == "warmup" and 3 <= stopped < TOTAL and not m.group(3)
    assert "SIGTERM received: stopping after the current step" in out
    reg = read_registry(run, "warmup")
    assert reg["aliases"] == {"latest": stopped} and reg["checkpoints"][-1]["periodic"]
    # not a finished warm-up: phase A would run the warm-up first (it resumes), and refuses to start from it
    assert not phase_finished(run, "warmup")
    assert phases_to_run("A", RunFiles(run), "auto") == ["warmup", "A"]
    rc, _, err2 = run_main(run, *WARMUP[2:], "--phase", "A", "--run.run_prior_phases", "false")
    assert rc == 2 and "a warm-up stopped mid-way" in err2 and "--phase warmup" in err2

    rc, out, err = run_main(run, *WARMUP)
    assert rc == 0, err
    assert f"resuming phase warmup at step {stopped}" in out
    assert final_bytes(run, "warmup") == final_bytes(straight_warmup, "warmup")
    assert losses(run) == losses(straight_warmup)
    assert phase_finished(run, "warmup")


def test_kill_9_after_a_periodic_save_resumes_bit_identically(straight_warmup, tmp_path):
    run = tmp_path / "run"
    t = Trainer(run, *WARMUP, "--run.save_every", "2")
    t.wait_for_step("warmup", 5)
    t.signal(signal.SIGKILL)
    rc, _, _ = t.finish()
    assert rc == -signal.SIGKILL
    latest = read_registry(run, "warmup")["aliases"]["latest"]
    assert latest % 2 == 0 and 4 <= latest < TOTAL
    rc, out, err = run_main(run, *WARMUP, "--run.save_every", "2")
    assert rc == 0, err
    assert f"resuming phase warmup at step {latest}" in out
    assert final_bytes(run, "warmup") == final_bytes(straight_warmup, "warmup")


def test_sigint_during_the_final_evaluation_is_resumed_by_redoing_it(straight_warmup, tmp_path):
    """The evaluation is abandoned at its next batch; the last step is saved as a periodic
    checkpoint; the resume evaluates it and writes the final checkpoint in its place."""
    run, big = tmp_path / "run", ["--run.eval_size", "320"]  # several eval batches: a window to land in
    t = Trainer(run, *WARMUP, *big)
    t.wait_for_step("warmup", TOTAL)
    t.signal(signal.SIGINT)
    rc, out, err = t.finish()
    m = assert_one_stop_line(rc, err, signal.SIGINT)
    assert (m.group(1), int(m.group(2)), m.group(3)) == ("warmup", TOTAL, " (its evaluation abandoned)")
    reg = read_registry(run, "warmup")
    assert reg["aliases"] == {"latest": TOTAL} and reg["checkpoints"][-1]["periodic"]
    assert not phase_finished(run, "warmup")
    rc, out, err = run_main(run, *WARMUP, *big)
    assert rc == 0, err
    assert f"resuming phase warmup at step {TOTAL}" in out and "[warmup eval @ 10]" in out
    reg = read_registry(run, "warmup")
    assert [c["step"] for c in reg["checkpoints"]] == [TOTAL] and "periodic" not in reg["checkpoints"][0]
    assert set(reg["aliases"]) == {"latest", "best_structure", "best_correctness", "best_composite"}
    assert final_bytes(run, "warmup") == final_bytes(straight_warmup, "warmup")
    assert not list((run / "warmup").glob(".tmp-*"))


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(straight_warmup, tmp_path):
    run = tmp_path / "run"
    t = Trainer(run, *WARMUP)
    t.wait_for_step("warmup", 2)
    t.signal(signal.SIGINT)
    t.wait_for_output("SIGINT received")  # two signals before the handler ran would arrive as one
    t.signal(signal.SIGINT)
    rc, out, err = t.finish()
    assert rc == 130 and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines == ["stopped at once on a second SIGINT; the step in progress is lost; "
                     "the same command resumes from the last checkpoint"], err
    rc, out, err = run_main(run, *WARMUP)
    assert rc == 0, err
    assert final_bytes(run, "warmup") == final_bytes(straight_warmup, "warmup")
