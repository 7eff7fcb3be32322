"""The collective watchdog: a data-parallel collective that waits longer than
``run.collective_timeout_s`` for a rank ends every rank with one line naming that rank.

Why not the process group's own timeout: it must stay long (ranks > 0 wait for rank 0's
warm-up at one barrier), gloo's timeout error does not say which peer is missing, and a
hung rank -- stuck in a kernel, a dead NFS read, a debugger -- never reaches a collective
to time out in. So every rank runs a small thread beside its main one:

- Before each collective (grpo/distributed.py routes them all through ``collective``)
  the rank writes its collective count to the process group's key-value store. The ranks
  run the same collectives in the same order, so a rank whose count is below the waiting
  rank's has not arrived.
- The thread wakes every ``poll_s``. If this rank has waited in one collective longer than
  the timeout, it writes the one line (naming the ranks that did not arrive) under an
  abort key, waits a moment for the others to read it, prints it and ends the process
  (exit 1). Any rank whose thread finds the abort key prints the same line and ends too,
  the hung rank included: its thread runs while its main thread is stuck.

The process ends with ``os._exit``: the main thread is blocked in the collective and
cannot unwind. One race is closed by hand: the first rank to end closes its connections,
so a peer's collective can fail ("connection closed by peer") a moment before that peer's
own thread ends it. The thread marks the decision (``ending``) before it writes the abort
key or its acknowledgement, and a collective that fails once it is marked waits for the
thread instead of raising: the one line is printed, not a traceback. Nothing is lost that
a crash would not lose: checkpoints are written atomically (a temporary name, then a
rename) and the log line by line.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PREFIX = "vlgrpo/watchdog"
ABORT_KEY = f"{PREFIX}/abort"

# The collectives this process has entered, over every DataParallel it builds (a test runs
# several trainers in one process group): the ranks enter the same ones in the same order.
_COUNT = itertools.count(1)


def _count_key(rank: int) -> str:
    return f"{PREFIX}/count/{rank}"


def late_ranks(counts: dict[int, int], mine: int) -> list[int]:
    """The ranks that have not entered collective number ``mine``: their count is lower."""
    return sorted(r for r, c in counts.items() if c < mine)


def timeout_message(late: list[int], world: int, number: int, name: str, waited: float) -> str:
    """The one line every rank prints when a collective timed out."""
    if late:
        who = f"rank {', '.join(map(str, late))} of {world} did not arrive"
    else:  # every count is in: the collective itself is stuck (a network or driver fault)
        who = f"every rank of {world} arrived but the collective did not complete"
    return (f"{who} at collective #{number} ({name}) within {waited:.0f} s (run.collective_timeout_s); every "
            "rank stopped. Checkpoints up to the last one saved are intact: the same command resumes from it")


class CollectiveWatch:
    """One rank's watchdog thread (see the module docstring); ``close`` stops it."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, poll_s: float | None = None,
                 end: Callable[[str], None] | None = None):
        self.store, self.rank, self.world, self.timeout = store, rank, world, float(timeout_s)
        self.poll = poll_s if poll_s is not None else min(1.0, self.timeout / 10)
        self.end = end or _end_process
        self.entered: tuple[int, str, float] | None = None  # (number, name, start) while in a collective
        self._lock = threading.Lock()  # the store client is shared with the main thread
        self._closed = threading.Event()
        self.ending = threading.Event()  # the thread has decided to end every rank (set before it tells them)
        self._thread = threading.Thread(target=self._watch, name="collective-watch", daemon=True)
        self._thread.start()
        # A process that ends without ``close`` (a script's last line, an exception nobody caught)
        # must not leave the thread inside a store call while the interpreter finalises: the C++
        # store then aborts the process ("terminate called without an active exception", exit -6).
        atexit.register(self.close)

    @contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Wrap one collective: count it in the store, time it from the thread."""
        number = next(_COUNT)
        with self._lock:
            self.store.set(_count_key(self.rank), str(number))
        self.entered = (number, name, time.monotonic())
        try:
            yield
        except BaseException:
            if self.ending.is_set():  # a peer that already ended broke this collective: the thread ends us
                self._thread.join()
            raise
        finally:
            self.entered = None

    def close(self) -> None:
        """Stop the thread and wait for it (at most a few polls); called again, it does nothing."""
        atexit.unregister(self.close)
        self._closed.set()
        self._thread.join(timeout=5 * self.poll + 1)

    # -------------------------------------------------------------- the thread

    def _has(self, key: str) -> bool:
        with self._lock:
            return self.store.check([key])

    def _get(self, key: str) -> str:
        with self._lock:
            return self.store.get(key).decode()

    def _set(self, key: str, value: str) -> None:
        with self._lock:
            self.store.set(key, value)

    def _watch(self) -> None:
        while not self._closed.wait(self.poll):
            try:
                message = self._check()
            except Exception:  # noqa: BLE001 -- the store went away with its host: the collective's own error says so
                continue
            if message is not None:
                self.end(message)
                return

    def _check(self) -> str | None:
        """The line to end with, or None while nothing is late."""
        if self._has(ABORT_KEY):  # another rank timed out
            message = self._get(ABORT_KEY)
            self.ending.set()
            self._set(f"{PREFIX}/ack/{self.rank}", "1")
            return message
        entered = self.entered
        if entered is None or time.monotonic() - entered[2] <= self.timeout:
            return None
        number, name, t0 = entered
        counts = {r: int(self._get(_count_key(r))) if self._has(_count_key(r)) else 0 for r in range(self.world)}
        message = timeout_message(late_ranks(counts, number), self.world, number, name, time.monotonic() - t0)
        self.ending.set()
        self._set(ABORT_KEY, message)
        deadline = time.monotonic() + min(5.0, self.timeout)  # let the others read it before this host goes
        others = [f"{PREFIX}/ack/{r}" for r in range(self.world) if r != self.rank]
        while time.monotonic() < deadline and not all(self._has(k) for k in others):
            time.sleep(self.poll / 2)
        return message


def _end_process(message: str) -> None:
    """Print the line and end this process now (exit 1): its main thread is blocked."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 -- stdout may be closed; the line goes to stderr anyway
        pass
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)
