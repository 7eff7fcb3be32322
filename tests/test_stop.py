"""Stops that lose nothing (grpo/run/stop.py): real signals to a real trainer process.

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
from train_helpers import Trainer, log_lines, run_main

from grpo.cli import phases_to_run
from grpo.run.files import RunFiles
from grpo.state.checkpoint import load_checkpoint
from grpo.state.registry import read_registry, resolve
from grpo.state.resume import phase_finished

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
    assert phases_to_run("A", RunFiles(run), "auto", "tiny-random") == ["warmup", "A"]
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


# ----------------------------------------------------------------------------- GRPO phases

# tests/test_train_resume.py's settings: phase A from the random model, a reward bonus that
# gives groups a spread (so the adapter really moves), evaluations at steps 3 and 6
GRPO = ["--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4", "--sampling.G", "3",
        "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2", "--phase", "A", "--init", "base",
        "--run.eval_every", "3", "--optim.lr", "1e-2", "--phase.steps", "6", "--run.test_per_stage", "0"]


def adapter(run: Path, selector: str = "A:latest") -> dict[str, torch.Tensor]:
    return load_checkpoint(resolve(run, selector)).tensors


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def rewards(run: Path) -> dict[int, float]:
    return {r["step"]: r["reward"] for r in log_lines(run) if r.get("phase") == "A" and "event" not in r}


@pytest.fixture(scope="module")
def straight_grpo(tmp_path_factory):
    from train_helpers import reward_spread

    run = tmp_path_factory.mktemp("straight_grpo") / "run"
    with reward_spread():
        rc, out, err = run_main(run, *GRPO, "--run.save_every_minutes", "0")
    assert rc == 0, err
    return run


def test_periodic_saves_in_a_grpo_phase_are_latest_only_pruned_and_change_nothing(straight_grpo, tmp_path):
    from train_helpers import reward_spread

    run = tmp_path / "run"
    with reward_spread():
        rc, out, err = run_main(run, *GRPO, "--run.save_every", "1")
    assert rc == 0, err
    assert rewards(run) == rewards(straight_grpo)
    assert_same(adapter(run), adapter(straight_grpo))
    assert (resolve(run, "A:latest") / "optimizer.safetensors").read_bytes() == \
        (resolve(straight_grpo, "A:latest") / "optimizer.safetensors").read_bytes()
    reg = read_registry(run, "A")
    # periodic saves of steps 1, 2, 4, 5 came and went; the evaluations' checkpoints stay, with every alias
    assert [c["step"] for c in reg["checkpoints"]] == [3, 6]
    assert reg == read_registry(straight_grpo, "A") | {"checkpoints": reg["checkpoints"]}
    assert [c["scores"] for c in reg["checkpoints"]] == [c["scores"] for c in read_registry(straight_grpo, "A")["checkpoints"]]


def test_sigterm_mid_phase_saves_the_step_and_resumes_bit_identically(straight_grpo, tmp_path):
    run = tmp_path / "run"
    t = Trainer(run, *GRPO, spread=True)
    t.wait_for_step("A", 1)
    t.signal(signal.SIGTERM)
    rc, out, err = t.finish()
    m = assert_one_stop_line(rc, err, signal.SIGTERM)
    stopped = int(m.group(2))
    assert m.group(1) == "A" and 1 <= stopped < 6, err
    reg = read_registry(run, "A")
    assert reg["aliases"]["latest"] == stopped
    if stopped % 3:  # between evaluations: a periodic save moves `latest` alone
        assert reg["checkpoints"][-1].get("periodic") and "best_composite" not in reg["aliases"] or stopped > 3
    t = Trainer(run, *GRPO, spread=True, tag="resume")
    rc, out, err = t.finish()
    assert rc == 0, err
    assert f"resuming phase A at step {stopped}" in out
    assert_same(adapter(run), adapter(straight_grpo))
    assert rewards(run) == rewards(straight_grpo)
    assert [c["step"] for c in read_registry(run, "A")["checkpoints"]] == [3, 6]


def test_sigint_during_a_checkpoint_evaluation_abandons_it_and_the_resume_redoes_it(straight_grpo, tmp_path):
    run, big = tmp_path / "run", ["--run.eval_size", "320"]  # several eval batches: a window to land in
    from train_helpers import reward_spread

    with reward_spread():
        rc, _, err = run_main(tmp_path / "ref", *GRPO, *big, "--run.save_every_minutes", "0")
    assert rc == 0, err
    t = Trainer(run, *GRPO, *big, spread=True)
    t.wait_for_step("A", 3)  # its evaluation starts now
    t.signal(signal.SIGINT)
    rc, out, err = t.finish()
    m = assert_one_stop_line(rc, err, signal.SIGINT)
    assert (m.group(1), m.group(2), m.group(3)) == ("A", "3", " (its evaluation abandoned)"), err
    reg = read_registry(run, "A")
    assert reg["aliases"] == {"latest": 3} and reg["checkpoints"][-1]["periodic"]
    assert load_checkpoint(resolve(run, "A:latest")).scheduler_state["eval_pending"] is True
    t = Trainer(run, *GRPO, *big, spread=True, tag="resume")
    rc, out, err = t.finish()
    assert rc == 0, err
    assert "[A eval @ 3]" in out.split("resuming phase A at step 3")[1]
    assert read_registry(run, "A") | {"checkpoints": []} == read_registry(tmp_path / "ref", "A") | {"checkpoints": []}
    assert_same(adapter(run), adapter(tmp_path / "ref"))
    assert_same(adapter(run, "A:3"), adapter(tmp_path / "ref", "A:3"))


# ----------------------------------------------------------------------------- torchrun (2 gloo processes)

DP = ["--model.device", "cpu", "--run.train_per_stage", "16", "--run.eval_size", "4", "--sampling.G", "2",
      "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "4", "--phase", "A", "--init", "base",
      "--run.eval_every", "10", "--phase.steps", "20", "--run.test_per_stage", "0"]


def two_ranks(tmp_path: Path) -> list:
    """The two workers torchrun would start (its environment, set here, so that a test can
    signal or kill one rank and read each rank's own stderr)."""
    import os
    import socket
    import subprocess
    import sys

    from train_helpers import ENTRY, REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}",
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        err = (tmp_path / f"rank{rank}.err").open("w")
        procs.append(subprocess.Popen([sys.executable, "-c", ENTRY, "plain", "--run.run_dir", str(tmp_path / "run"),
                                       *DP], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return procs


def logged_steps(run: Path) -> list[int]:
    try:
        rows = [r for r in log_lines(run) if r.get("phase") == "A" and "event" not in r]
    except (FileNotFoundError, ValueError):
        return []
    return [r["step"] for r in rows]


def wait_logged(run: Path, step: int, procs: list, timeout: float = 300.0) -> None:
    import time

    t0 = time.time()
    while not any(s >= step for s in logged_steps(run)):
        assert all(p.poll() is None for p in procs), "a rank exited early"
        assert time.time() - t0 < timeout
        time.sleep(0.05)


def test_a_signal_to_one_rank_stops_both_at_the_same_step_and_rank_0_saves(tmp_path):
    procs = two_ranks(tmp_path)
    try:
        wait_logged(tmp_path / "run", 1, procs)
        procs[1].send_signal(signal.SIGTERM)  # rank 1 only
        rcs = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    errs = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert rcs == [143, 143], errs
    m = assert_one_stop_line(rcs[0], errs[0], signal.SIGTERM)  # rank 0 says it, once
    assert "Traceback" not in errs[1] and not errs[1].strip(), errs[1]
    stopped = int(m.group(2))
    assert m.group(1) == "A" and stopped < 20
    reg = read_registry(tmp_path / "run", "A")
    assert reg["aliases"]["latest"] == stopped and max(logged_steps(tmp_path / "run")) == stopped
    ckpt = load_checkpoint(resolve(tmp_path / "run", "A:latest"))
    assert {"sampler_generator_state", "sampler_generator_state.rank1"} <= set(ckpt.tensors)  # both ranks' state


def test_a_rank_that_dies_mid_step_makes_the_other_exit_with_one_line_naming_it(tmp_path):
    import time

    procs = two_ranks(tmp_path)
    try:
        wait_logged(tmp_path / "run", 1, procs)
        procs[1].kill()  # SIGKILL: no goodbye
        t0 = time.time()
        rc0 = procs[0].wait(timeout=120)
        waited = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    err = (tmp_path / "rank0.err").read_text()
    assert rc0 == 1, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 of 2 died or stopped responding"), err
    assert "the same command resumes" in lines[0]
    assert waited < 60, f"rank 0 took {waited:.0f}s to notice"


# ----------------------------------------------------------------------------- bench/learning.py


def test_the_learning_benchmark_forwards_a_stop_to_its_trainer_and_resumes(tmp_path):
    """SIGTERM to the benchmark in phase A: its trainer stops after its step and saves, the
    benchmark exits 143 with one line; the same command then finishes the run from there."""
    import os
    import subprocess
    import sys
    import time

    from train_helpers import REPO

    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "bench.learning", "--quick", "--seeds", "1", "--variants", "default",
           "--pass-k", "0", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = out / "default" / "seed0" / "train_log.jsonl"
    with (tmp_path / "bench.err").open("w") as err_f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err_f)
        t0 = time.time()
        while not (log.is_file() and log.read_text().strip()):  # phase A's first step is done
            assert proc.poll() is None and time.time() - t0 < 300, (tmp_path / "bench.err").read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    err = (tmp_path / "bench.err").read_text()
    assert rc == 143 and "Traceback" not in err, err
    assert [x for x in err.splitlines() if x.strip()] == [
        "stopped on SIGTERM: every running trainer saved its checkpoint; the same command resumes "
        "(finished runs are reused)"], err
    run = out / "default" / "seed0"
    console = (run / "train.out").read_text()
    assert "Traceback" not in console
    m = STOP_LINE.search(console)
    assert m and m.group(1) == "A" and m.group(4) == "SIGTERM", console[-2000:]
    assert read_registry(run, "A")["aliases"]["latest"] == int(m.group(2))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming phase A at step {m.group(2)}" in (run / "train.out").read_text()
    assert phase_finished(run, "B") and (out / "summary.md").is_file()
