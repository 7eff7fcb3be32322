"""One run directory, one writer (grpo/run/lock.py), with real processes.

- The lock itself: refused at once by another process (one line naming the holder; the lock
  file untouched), free at once after a kill -9 of its holder, waited for with a bound
  (--lock-wait), handed to a child (what bench.learning and bench.collapse do with their arms'
  trainers), counted within a process; a file system without locks warns and goes on.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpo.run.lock as lock_mod
from grpo.run.lock import LOCK_FILE, acquire, holder_of
from train_helpers import REPO

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
