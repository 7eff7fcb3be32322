"""One run directory, one writer (grpo/run/lock.py), with real processes.

- The lock itself: refused at once by another process (one line naming the holder; the lock
  file untouched), free at once after a kill -9 of its holder, waited for with a bound
  (--lock-wait), handed to a child (what bench.learning and bench.collapse do with their arms'
  trainers), counted within a process; a file system without locks warns and goes on.
- Trainers: a second one on a running trainer's directory ends within seconds with one line
  and exit 2, writing nothing, and the first logs each step exactly once (bit-identical to a
  run that was alone); after kill -9 the same command resumes at once, bit-identically; with
  --lock-wait a job started while the last one still saves waits, then resumes it, bit-identically;
  one lock for all the phases of a command (the warm-up included); grpo.pretrain and torchrun
  (rank 0 holds it) honour it.
- Benchmarks: an arm's directory another run holds is one line naming it, nothing written.
- Readers: grpo.evaluate and grpo.export read a trainer's checkpoints while it saves every step,
  and read_resolved reads again what a save moved under it (a deterministic interleaving too).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import ENTRY, REPO, Trainer, log_lines, reward_spread, run_main

import grpo.run.lock as lock_mod
from grpo.run.lock import LOCK_FILE, acquire, holder_of
from grpo.state.checkpoint import load_checkpoint, save_checkpoint
from grpo.state.layout import CheckpointError
from grpo.state.registry import read_registry, read_resolved, resolve

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
# a process that holds a directory's lock until killed (or argv[2] seconds), saying so on stdout
HOLD = ("import sys, time\nfrom grpo.run.lock import acquire\nlock = acquire(sys.argv[1])\n"
        "print('held', flush=True)\ntime.sleep(float(sys.argv[2]))\nlock.release()")
# a process that tries to take it: exit 0 (taken), 3 (RunDirBusy, its line on stdout)
TRY = ("import sys\nfrom grpo.run.lock import RunDirBusy, acquire\ntry:\n    acquire(sys.argv[1], float(sys.argv[2]))\n"
       "except RunDirBusy as err:\n    print(err)\n    sys.exit(3)\nprint('taken')")


def holder(root: Path, seconds: float = 600.0) -> subprocess.Popen:
    """A process that holds ``root``'s lock (``root`` created), once it said so."""
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root), str(seconds)], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def try_lock(root: Path, wait_s: float = 0.0, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY, str(root), str(wait_s)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, **({"env": ENV} | kw))


def snapshot(root: Path) -> dict:
    """Every path under root with its bytes (files) and mtime: what "nothing written" compares."""
    return {p.relative_to(root): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in [root, *root.rglob("*")]}


def frozen(pid: int) -> None:
    """Wait until a SIGSTOP'ed process is stopped (state T in /proc)."""
    t0 = time.time()
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.time() - t0 < 10
        time.sleep(0.01)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)


# ----------------------------------------------------------------------------- the lock


def test_a_second_process_is_refused_at_once_naming_the_holder_and_writing_nothing(tmp_path):
    run = tmp_path / "run"
    h = holder(run)
    try:
        before = snapshot(run)
        t0 = time.time()
        got = try_lock(run)
        took = time.time() - t0
        assert got.returncode == 3, got.stdout + got.stderr
        line = got.stdout.strip()
        assert len(line.splitlines()) == 1 and f"run directory {run} is in use by another run (pid {h.pid} on host " \
            in line and "wait for that run to end (or pass --lock-wait SECONDS" in line and "another --run.run_dir" in line
        assert snapshot(run) == before  # the lock file (who holds it) unchanged, nothing added
        assert holder_of(run)["pid"] == h.pid and "since" in holder_of(run) and HOLD.splitlines()[0] in \
            holder_of(run)["command"]
        assert took < 10, f"the refusal took {took:.1f}s"
    finally:
        stop(h)


def test_the_lock_dies_with_its_holder_and_the_next_takes_over_its_file(tmp_path):
    run = tmp_path / "run"
    h = holder(run)
    h.send_signal(signal.SIGKILL)
    h.wait(timeout=60)
    assert holder_of(run)["pid"] == h.pid  # the file stays, naming the dead process: it is no lock
    lock = acquire(run)
    try:
        assert holder_of(run)["pid"] == os.getpid()
        assert try_lock(run).returncode == 3  # and it is ours now
    finally:
        lock.release()
    assert not (run / LOCK_FILE).exists()  # a clean end removes the file
    assert try_lock(run).returncode == 0


def test_a_waiting_writer_takes_the_lock_when_its_holder_ends_and_gives_up_after_its_bound(tmp_path):
    run = tmp_path / "run"
    h = holder(run, seconds=1.5)
    t0 = time.time()
    got = try_lock(run, wait_s=60)
    assert got.returncode == 0 and got.stdout.splitlines()[-1] == "taken", got.stdout + got.stderr
    assert f"run directory {run} is in use (pid {h.pid}" in got.stdout and "waiting up to 60 s" in got.stdout
    assert 1.0 < time.time() - t0 < 30
    h.wait(timeout=60)
    h = holder(run)
    try:
        t0 = time.time()
        got = try_lock(run, wait_s=1)
        assert got.returncode == 3 and "is still in use after 1 s of waiting by another run" in got.stdout
        assert 1.0 <= time.time() - t0 < 30
    finally:
        stop(h)


def test_one_process_takes_it_once_and_releases_it_at_the_last_release(tmp_path):
    run, link = tmp_path / "run", tmp_path / "link"
    run.mkdir()
    link.symlink_to(run)
    outer = acquire(run)
    inner = acquire(link)  # another name of the same directory
    assert inner is outer and outer.count == 2
    inner.release()
    assert try_lock(run).returncode == 3  # still held
    outer.release()
    assert try_lock(run).returncode == 0


def test_a_child_handed_the_lock_writes_as_its_parents_writer_and_never_drops_it(tmp_path):
    """What bench.learning / bench.collapse do with their arms' trainers: no deadlock, no gap."""
    lock = acquire(tmp_path)
    try:
        child = try_lock(tmp_path, **lock.child(ENV))
        assert child.returncode == 0 and child.stdout.strip() == "taken", child.stdout + child.stderr
        assert (tmp_path / LOCK_FILE).exists() and holder_of(tmp_path)["pid"] == os.getpid()
        assert try_lock(tmp_path).returncode == 3  # the child's end left the parent holding it
        assert try_lock(tmp_path, env=ENV).returncode == 3  # a child not handed it is refused, not left waiting
    finally:
        lock.release()


def test_a_lock_file_removed_as_it_was_opened_is_not_the_lock(tmp_path, monkeypatch):
    """The holder removes the file on release: a writer that opened it just before holds a lock
    on a file no one else opens, so it takes the new file instead."""
    real_open = lock_mod._open
    calls = []

    def open_then_replaced(path):
        fd = real_open(path)
        if not calls:
            path.unlink()  # the holder's release, between this open and the flock
            path.write_text("")  # and a newer writer's file
        calls.append(fd)
        return fd

    monkeypatch.setattr(lock_mod, "_open", open_then_replaced)
    lock = acquire(tmp_path)
    try:
        assert len(calls) == 2 and os.path.samestat(os.fstat(lock.fd), os.stat(tmp_path / LOCK_FILE))
    finally:
        lock.release()


def test_a_file_system_without_locks_warns_once_and_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_mod.fcntl, "flock", no_locks)
    lock = acquire(tmp_path)
    try:
        assert lock.fd is None
        out = capsys.readouterr().out
        assert out.startswith("warning: ") and "without file locks (flock: ENOLCK)" in out and len(out.splitlines()) == 1
    finally:
        lock.release()


# ----------------------------------------------------------------------------- trainers

# tests/test_stop.py's GRPO settings: phase A from the random model, a reward bonus that gives
# groups a spread (the adapter really moves), evaluations at steps 3 and 6
GRPO = ["--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4", "--sampling.G", "3",
        "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2", "--phase", "A", "--init", "base",
        "--run.eval_every", "3", "--optim.lr", "1e-2", "--phase.steps", "6", "--run.test_per_stage", "0"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    with reward_spread():
        rc, out, err = run_main(run, *GRPO, "--run.save_every_minutes", "0")
    assert rc == 0, err
    return run


def steps_and_rewards(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["reward"]) for r in log_lines(run) if r.get("phase") == "A" and "event" not in r]


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(resolve(run, "A:latest")).tensors


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_second_trainer_ends_within_seconds_and_the_first_logs_each_step_once(straight, tmp_path):
    """The first trainer is frozen (SIGSTOP) after its first step, holding the lock, so that the
    second surely meets it running; it then finishes exactly as a run that was alone."""
    run = tmp_path / "run"
    first = Trainer(run, *GRPO, spread=True)
    first.wait_for_step("A", 1)
    first.signal(signal.SIGSTOP)
    try:
        frozen(first.proc.pid)
        before = snapshot(run)
        t0 = time.time()
        rc, out, err = Trainer(run, *GRPO, spread=True, tag="second").finish()
        took = time.time() - t0
    finally:
        first.signal(signal.SIGCONT)
    assert rc == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: run directory {run} is in use by another "
                                                               f"run (pid {first.proc.pid} on host "), err
    assert "use another --run.run_dir" in err and "--lock-wait SECONDS" in err
    assert snapshot(run) == before  # the second wrote nothing (and the frozen first nothing either)
    assert took < 60, f"the second trainer took {took:.0f}s to end"
    rc, out, err = first.finish()
    assert rc == 0, err
    assert [s for s, _ in steps_and_rewards(run)] == [1, 2, 3, 4, 5, 6]
    assert steps_and_rewards(run) == steps_and_rewards(straight)
    assert_same(adapter(run), adapter(straight))
    assert not (run / LOCK_FILE).exists()


def test_after_kill_9_the_same_command_resumes_at_once_and_bit_identically(straight, tmp_path):
    run, cmd = tmp_path / "run", [*GRPO, "--run.save_every", "1"]
    t = Trainer(run, *cmd, spread=True)
    t.wait_for_step("A", 4)
    t.signal(signal.SIGKILL)
    assert t.finish()[0] == -signal.SIGKILL
    assert holder_of(run)["pid"] == t.proc.pid  # its lock file is left behind; its lock is not
    latest = read_registry(run, "A")["aliases"]["latest"]
    rc, out, err = Trainer(run, *cmd, spread=True, tag="resume").finish()
    assert rc == 0, err
    assert f"resuming phase A at step {latest}" in out and "in use" not in out + err
    assert_same(adapter(run), adapter(straight))
    by_step = dict(steps_and_rewards(run))  # later lines win: the steps after the last save are logged twice
    assert by_step == dict(steps_and_rewards(straight))


def test_with_lock_wait_the_next_job_starts_when_the_last_has_saved_and_resumes_it(straight, tmp_path):
    """A scheduler's restart: the new job is started while the old one, preempted, still saves."""
    run = tmp_path / "run"
    old = Trainer(run, *GRPO, spread=True)
    old.wait_for_step("A", 1)
    old.signal(signal.SIGSTOP)  # held mid-phase until the new job waits for it
    new = Trainer(run, *GRPO, "--lock-wait", "600", spread=True, tag="new")
    try:
        new.wait_for_output(f"run directory {run} is in use (pid {old.proc.pid} on host ")
    finally:
        old.signal(signal.SIGTERM)  # the preemption notice: it saves its step and ends
        old.signal(signal.SIGCONT)
    rc, _, err = old.finish()
    assert rc == 143, err
    stopped = read_registry(run, "A")["aliases"]["latest"]
    rc, out, err = new.finish()
    assert rc == 0 and err == "", err
    assert f"run directory {run} is free: going on" in out and f"resuming phase A at step {stopped}" in out
    assert steps_and_rewards(run) == steps_and_rewards(straight)  # each step once: the old run's, then the new's
    assert_same(adapter(run), adapter(straight))


def test_every_phase_of_a_command_runs_under_one_lock(tmp_path, monkeypatch):
    """--phase A on tiny-random runs the warm-up, then A: the lock is held at the start of each
    (another process is refused) and taken once."""
    import grpo.train

    run, seen, taken = tmp_path / "run", [], []
    real_phase, real_acquire = grpo.train.run_phase, grpo.cli.acquire

    def probing(cfg, files, device, dp):
        seen.append((cfg.phase.name, try_lock(run).returncode))
        real_phase(cfg, files, device, dp)

    monkeypatch.setattr(grpo.train, "run_phase", probing)
    monkeypatch.setattr(grpo.cli, "acquire", lambda *a, **k: taken.append(a) or real_acquire(*a, **k))
    rc, out, err = run_main(run, "--phase", "A", "--model.name", "tiny-random", "--model.device", "cpu",
                            "--run.train_per_stage", "16", "--run.eval_size", "4", "--warmup.phase.steps", "2",
                            "--warmup.phase.perception_steps", "2", "--warmup.phase.prompts_per_step", "4",
                            "--sampling.max_new_tokens", "8", "--sampling.G", "2", "--A.phase.steps", "2",
                            "--A.phase.prompts_per_step", "2", "--run.test_per_stage", "0")
    assert rc == 0, err
    assert seen == [("warmup", 3), ("A", 3)] and len(taken) == 1
    assert not (run / LOCK_FILE).exists() and try_lock(run).returncode == 0


def test_lock_wait_must_be_seconds(tmp_path):
    for bad in ("soon", "-1", "inf", "nan"):
        rc, out, err = run_main(tmp_path / "run", *GRPO, "--lock-wait", bad)
        assert rc == 2 and err.startswith(f"error: --lock-wait {bad!r}: give the seconds") \
            and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_pretrain_is_refused_on_a_held_run_directory(tmp_path):
    from grpo import pretrain

    run = tmp_path / "pre"
    h = holder(run)
    try:
        before = snapshot(run)
        proc = subprocess.run([sys.executable, "-m", "grpo.pretrain", "--run-dir", str(run), "--out",
                               str(tmp_path / "model")], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert f"is in use by another run (pid {h.pid}" in proc.stderr and "use another --run-dir" in proc.stderr
        assert snapshot(run) == before and not (tmp_path / "model").exists()
        assert pretrain.WALL_FILE not in {p.name for p in run.iterdir()}
    finally:
        stop(h)


# ----------------------------------------------------------------------------- torchrun: rank 0 holds it

DP = ["--model.device", "cpu", "--run.train_per_stage", "16", "--run.eval_size", "4", "--sampling.G", "2",
      "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "4", "--phase", "A", "--init", "base",
      "--run.eval_every", "10", "--phase.steps", "200", "--run.test_per_stage", "0"]


def two_ranks(tmp_path: Path, run: Path) -> list[subprocess.Popen]:
    """The two workers torchrun would start on ``run`` (tests/test_stop.py's way)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        err = (tmp_path / f"rank{rank}.err").open("w")
        procs.append(subprocess.Popen([sys.executable, "-c", ENTRY, "plain", "--run.run_dir", str(run), *DP],
                                      cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return procs


def test_under_torchrun_rank_0_holds_the_lock_and_a_refusal_ends_every_rank(tmp_path):
    run = tmp_path / "run"
    procs = two_ranks(tmp_path, run)
    try:
        t0 = time.time()
        while not (run / "train_log.jsonl").is_file():  # a step is logged: the run is under way
            assert all(p.poll() is None for p in procs) and time.time() - t0 < 300
            time.sleep(0.05)
        assert holder_of(run)["pid"] == procs[0].pid
        rc, out, err = run_main(run, *DP)  # a single trainer, in this process
        assert rc == 2 and f"is in use by another run (pid {procs[0].pid} " in err, err
    finally:
        for p in procs:
            stop(p)
    # the other way round: a held directory refuses both ranks, rank 0 with the line
    h = holder(tmp_path / "held")
    try:
        procs = two_ranks(tmp_path, tmp_path / "held")
        rcs = [p.wait(timeout=300) for p in procs]
    finally:
        stop(h)
    errs = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert rcs == [2, 2], errs
    assert len(errs[0].strip().splitlines()) == 1 and f"is in use by another run (pid {h.pid} " in errs[0], errs[0]
    assert errs[1].strip() == "", errs[1]


# ----------------------------------------------------------------------------- benchmarks hold their arms


def test_the_benchmarks_refuse_an_arm_another_run_writes_and_name_it(tmp_path):
    """bench.learning and bench.collapse take each arm's lock before writing there (and hand it to
    the arm's trainers: tests/test_bench_learning.py trains through it); a held arm is one line."""
    from types import SimpleNamespace

    from bench import collapse, learning

    run = learning.Run(learning.VARIANTS["default"], 0, tmp_path / "default" / "seed0", [])
    h = holder(run.dir)
    try:
        before = snapshot(run.dir)
        with pytest.raises(learning.BenchError, match=rf"default seed0: run directory .* is in use by another run "
                                                       rf"\(pid {h.pid} .*or use another --out$") as err:
            learning.ensure_trained(run, [run])
        assert err.value.code == 2 and "--lock-wait" not in str(err.value)
        assert snapshot(run.dir) == before  # no bench_run.json, no train.out
        args = SimpleNamespace(out=tmp_path / "collapse")
        h2 = holder(args.out / "default" / "seed0")
        try:
            with pytest.raises(collapse.Fail, match=rf"default seed 0: run directory .* \(pid {h2.pid} "):
                collapse.ensure("default", 0, args, tmp_path / "rows")
        finally:
            stop(h2)
    finally:
        stop(h)


# ----------------------------------------------------------------------------- readers


def tiny_save(run: Path, step: int, periodic: bool = True) -> None:
    save_checkpoint(run, "A", step, tensors={"w": torch.full((4,), float(step))}, optimizer=None, scheduler_state={},
                    controller_state={}, data_position=step, metrics={}, scores={}, config_json="{}",
                    periodic=periodic)


def test_a_save_between_resolving_and_reading_is_read_again_and_damage_is_not(tmp_path, caplog):
    """Deterministic: A:latest is the periodic step 1 when resolved; the next save removes it
    before it is read. A plain read fails on missing files; read_resolved reads step 2."""
    tiny_save(tmp_path, 1)
    path = resolve(tmp_path, "A:latest")
    tiny_save(tmp_path, 2)  # latest -> 2, the periodic step 1 removed
    with pytest.raises(CheckpointError, match="is missing|not a checkpoint directory"):
        load_checkpoint(path)

    saved = []

    def load_during_a_save(p: Path):
        if not saved:
            saved.append(3)
            tiny_save(tmp_path, 3)  # what a trainer does meanwhile
        return load_checkpoint(p)

    with caplog.at_level(logging.INFO, logger="grpo.state.registry"):
        got_path, ckpt = read_resolved(tmp_path, "A:latest", load_during_a_save)
    assert ckpt.step == 3 and got_path.name == "step_000003" and torch.equal(ckpt.tensors["w"], torch.full((4,), 3.0))
    assert "moved while it was read" in caplog.text
    (got_path / "adapter.safetensors").write_bytes(b"garbage")  # damage, the registry unchanged: raised as it is
    with pytest.raises(CheckpointError, match="adapter.safetensors"):
        read_resolved(tmp_path, "A:latest", load_checkpoint)


READER_RUN = ["--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4", "--sampling.G", "2",
              "--sampling.max_new_tokens", "4", "--phase.prompts_per_step", "2", "--phase", "A", "--init", "base",
              "--run.eval_every", "1000", "--phase.steps", "1000", "--run.save_every", "1", "--run.test_per_stage", "0"]


def test_evaluate_and_export_read_a_trainer_that_saves_every_step(tmp_path, caplog):
    """A trainer saves a periodic checkpoint at every step (each save removes the last); this
    process reads A:latest over and over, and grpo.evaluate and grpo.export run against it."""
    run = tmp_path / "run"
    t = Trainer(run, *READER_RUN, spread=True)
    try:
        t.wait_for_step("A", 2)
        reader = subprocess.Popen([sys.executable, "-m", "grpo.evaluate", "A:latest", "--run-dir", str(run),
                                   "--limit", "2", "--max-new-tokens", "4", "--no-image-control", "--out",
                                   str(tmp_path / "eval")], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        steps, first = [], read_registry(run, "A")["aliases"]["latest"]
        with caplog.at_level(logging.INFO, logger="grpo.state.registry"):
            while reader.poll() is None or len(steps) < 50:
                steps.append(read_resolved(run, "A:latest", load_checkpoint)[1].step)
                time.sleep(0.02)
        out, err = reader.communicate()
        assert reader.returncode == 0 and "Traceback" not in err, err
        export = subprocess.run([sys.executable, "-m", "grpo.export", "A:latest", "--run-dir", str(run), "--merged",
                                 str(tmp_path / "merged"), "--dtype", "fp32"], cwd=REPO, env=ENV, capture_output=True,
                                text=True, timeout=300)
        assert export.returncode == 0, export.stderr
        assert (tmp_path / "merged" / "model.safetensors").is_file()
        last = read_registry(run, "A")["aliases"]["latest"]
    finally:
        t.signal(signal.SIGTERM)
        rc, _, err = t.finish()
    assert rc == 143, err
    assert steps == sorted(steps) and last - first >= 5, (first, last, steps[-5:])  # it saved while they read
    print(f"read A:latest {len(steps)} times over steps {first}..{last}; read again after a save: "
          f"{caplog.text.count('moved while it was read')} times")
