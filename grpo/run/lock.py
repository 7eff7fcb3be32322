"""One run directory, one writer: the lock a command takes on a run directory before it writes there.

A run directory is one run's record: its train_log.jsonl holds that run's steps in order and
each phase's registry moves `latest` forward one save after the other. Two trainers on one
directory would interleave both. So every command that writes a run directory --
``python -m grpo.train`` (all its phases, the warm-up included, under one lock),
``python -m grpo.pretrain`` on its own directory, bench.learning and bench.collapse on each
arm's directory -- first takes an exclusive ``flock`` on ``<run_dir>/run.lock`` (``acquire``),
before it writes anything there, and holds it until it ends:

- The kernel drops the lock when the process ends, however it ends (kill -9, out of memory, a
  power cut): a lock never outlives its process, so the same command resumes at once. A
  ``run.lock`` left behind is only a file; the next holder takes it over. A clean end
  removes it (``RunLock.release``).
- The file says who holds it: one JSON line {"pid", "host", "since", "command"}, written once
  the lock is held. A second writer is refused at once (``RunDirBusy``: one line naming the
  holder and the two ways on) without having written anything; given ``wait_s`` it first
  waits that long for the holder to end (a scheduler that starts the next job while the
  last one is still saving), then takes the lock and goes on.
- One lock per process and directory: acquiring it again in the holding process counts up
  (grpo.pretrain holds it around the trainer's command line), the last release drops it.
- A child process can be handed the lock (``RunLock.child``): it inherits the locked
  descriptor, whose lock is the parent's, so a benchmark holds an arm's directory across its
  own writes and the trainer it starts, and neither waits for the other. The child never
  unlocks it. (Any process forked from the holder shares it the same way, until it ends.)
- Readers (grpo.evaluate, grpo.export) take no lock: a checkpoint is complete before its
  registry names it, and grpo/state/registry.py ``read_resolved`` reads again what a save
  moved while they read. (The end-of-run report runs inside the trainer, under its lock.)

The lock is advisory: it binds the commands that take it, not ``rm`` or an editor. On NFS
Linux maps flock onto the server's byte-range locks (NFSv4, or v3 with its lock manager),
which hold between hosts; a mount with ``nolock`` keeps them on each client, where two hosts
can both hold the lock. A file system that cannot lock at all (flock fails with ENOLCK,
EOPNOTSUPP or ENOSYS: NFSv3 without its lock manager, Lustre mounted without its flock option)
gets one warning line, and the command goes on unprotected, as before this lock existed
(``RunLock.fd`` is None): refusing would leave such a file system with no way to train at all.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo.run.stop import Stopped
from grpo_infra.signals import STOP, signal_name

LOCK_FILE = "run.lock"
INHERIT_ENV = "VLGRPO_RUN_LOCK"  # "<fd>:<lock file>": a parent's lock handed to this process (RunLock.child)
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}  # flock unsupported where the file lies
POLL_S = 0.2  # how often a waiting writer tries again


class RunDirBusy(RuntimeError):
    """Another process holds the run directory's lock; the message names it and the ways on."""


@dataclass
class RunLock:
    """This process's hold on a run directory (``acquire``); ``release`` it once per acquire."""

    root: Path
    key: tuple[int, int]  # the directory's (st_dev, st_ino): this process's one lock per directory
    fd: int | None  # the locked lock file; None where the file system cannot lock (warned, nothing held)
    inherited: bool = False  # handed over by the parent process: its lock, never unlocked or removed here
    count: int = 1  # acquires in this process not yet released

    @property
    def path(self) -> Path:
        return self.root / LOCK_FILE

    def child(self, env: dict[str, str] | None = None) -> dict:
        """subprocess.Popen / run keyword arguments (env, pass_fds) that hand this lock to a child:
        a trainer started with them on this directory holds it through this process's descriptor."""
        env = dict(os.environ if env is None else env)
        if self.fd is None:
            return {"env": env}
        env[INHERIT_ENV] = f"{self.fd}:{self.path}"
        return {"env": env, "pass_fds": (self.fd,)}

    def release(self) -> None:
        """One acquire undone; the last removes the lock file (while still locked, so no process
        can have taken it meanwhile) and closes it, which drops the lock."""
        with _GUARD:
            self.count -= 1
            if self.count > 0:
                return
            _HELD.pop(self.key, None)
        if self.fd is None:
            return
        if not self.inherited and _names(self.fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


_HELD: dict[tuple[int, int], RunLock] = {}  # (st_dev, st_ino) of a run directory -> this process's lock on it
_GUARD = threading.Lock()  # bench.learning acquires from several threads


def _key(root: Path) -> tuple[int, int]:
    st = os.stat(root)
    return st.st_dev, st.st_ino


def acquire(root: str | Path, wait_s: float = 0.0, *, other: str = "another --run.run_dir",
            wait_flag: str | None = "--lock-wait SECONDS") -> RunLock:
    """The lock on ``root`` (an existing directory) for this process: taken again if this process
    holds it already, handed over by the parent (INHERIT_ENV), or taken now, waiting up to
    ``wait_s`` seconds for another holder to end. Raises RunDirBusy (its message names the
    holder, ``wait_flag`` and ``other``, the options that wait or move elsewhere) when it is
    still held; Stopped on SIGINT / SIGTERM while waiting; OSError when the directory refuses
    the lock file (read-only, full)."""
    root = Path(root)
    key = _key(root)
    with _GUARD:
        held = _HELD.get(key)
        if held is not None:
            held.count += 1
            return held
        lock = _inherited(root, key) or _take(root, key, wait_s, other, wait_flag)
        _HELD[key] = lock
        return lock


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (its holder removes it on release)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _inherited(root: Path, key: tuple[int, int]) -> RunLock | None:
    """The parent's lock on ``root`` if it handed it over (RunLock.child), else None."""
    fd_text, _, name = os.environ.get(INHERIT_ENV, "").partition(":")
    path = root / LOCK_FILE
    if not fd_text.isdigit() or not name or not _names(int(fd_text), path):
        return None  # not handed over, or a lock on another directory
    try:
        fcntl.flock(int(fd_text), fcntl.LOCK_EX | fcntl.LOCK_NB)  # the parent's own lock: granted at once
    except OSError:
        return None
    del os.environ[INHERIT_ENV]  # this process's children get it only through child()
    return RunLock(root, key, int(fd_text), inherited=True)


def _take(root: Path, key: tuple[int, int], wait_s: float, other: str, wait_flag: str | None) -> RunLock:
    """Lock root/run.lock, waiting up to wait_s for its holder; record this process in it."""
    path, deadline, waiting = root / LOCK_FILE, time.monotonic() + wait_s, False
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise RunDirBusy(busy_message(root, holder, wait_s, other, wait_flag)) from None
            if not waiting:
                print(f"run directory {root} is in use ({describe(holder)}); waiting up to {wait_s:g} s for it to end",
                      flush=True)
                waiting = True
            _pause(root)
            continue
        except OSError as err:
            os.close(fd)
            if err.errno not in NO_LOCKS:
                raise
            print(f"warning: {root} is on a file system without file locks (flock: {errno.errorcode[err.errno]}): "
                  "nothing stops a second trainer from writing into it; run one at a time", flush=True)
            return RunLock(root, key, None)
        if _names(fd, path):  # not the file of a holder that removed it as we opened it
            _record(fd)
            if waiting:
                print(f"run directory {root} is free: going on", flush=True)
            return RunLock(root, key, fd)
        os.close(fd)


def _open(path: Path) -> int:
    """The lock file, opened for writing; created only where it is missing (a refused writer changes nothing)."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _pause(root: Path) -> None:
    """Sleep between two tries; a stop (SIGINT / SIGTERM) ends the wait with its one line."""
    signum = STOP.signum
    if signum is None:
        try:
            time.sleep(POLL_S)
        except KeyboardInterrupt as stop:  # no StopFlag installed (grpo.pretrain's own wait), or StopNow
            signum = getattr(stop, "signum", signal.SIGINT)
        signum = signum or STOP.signum
    if signum:
        raise Stopped(f"stopped on {signal_name(signum)} while waiting for the run directory {root}; "
                      "nothing was written", signum)


def _record(fd: int) -> None:
    """Write who holds the lock into the lock file (read by the writers it refuses)."""
    command = shlex.join(getattr(sys, "orig_argv", sys.argv))
    line = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command})
    os.ftruncate(fd, 0)
    os.pwrite(fd, (line + "\n").encode(), 0)


def _holder(fd: int) -> dict:
    """What the lock file says about its holder ({} while it has not written it yet)."""
    try:
        holder = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace") or "{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def holder_of(root: str | Path) -> dict:
    """Who holds ``root``'s lock as its lock file says ({} without one); for tests and messages."""
    try:
        fd = os.open(Path(root) / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return {}
    try:
        return _holder(fd)
    finally:
        os.close(fd)


def describe(holder: dict) -> str:
    """'pid 12 on host h since 2025-01-01 10:00:00 UTC: python -m grpo.train ...', on one line."""
    if not holder:
        return f"its holder has not recorded itself in {LOCK_FILE} yet"
    command = " ".join(str(holder.get("command", "?")).split())  # one line, whatever the arguments held
    command = command if len(command) <= 160 else command[:157] + "..."
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('since', '?')}: {command}"


def busy_message(root: Path, holder: dict, waited: float, other: str, wait_flag: str | None) -> str:
    """RunDirBusy's one line: the holder, then the ways on (wait for it, or another directory)."""
    still = f"still in use after {waited:g} s of waiting" if waited > 0 else "in use"
    wait = f" (or pass {wait_flag} to wait up to that long)" if wait_flag else ""
    return (f"run directory {root} is {still} by another run ({describe(holder)}); one run writes a run directory "
            f"at a time: wait for that run to end{wait} and the same command resumes from its last checkpoint, "
            f"or use {other}")

