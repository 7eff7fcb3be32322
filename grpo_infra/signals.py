"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption notice): the one handler every command uses.

Every command -- python -m grpo.train, grpo.evaluate, grpo.export, grpo.pretrain,
data.mathvista convert, bench.learning -- takes the two signals over through the one
``StopFlag`` here, ``STOP``, and ends a stop the same way: one line on stderr and exit code
128 + the signal number (130 for SIGINT, 143 for SIGTERM), the shell's convention for a
process ended by that signal, never a traceback. Commands differ only in when they stop:

- polled (the trainer, the warm-up, bench.learning): ``STOP.install()``; the first signal
  only sets the flag, and every long loop reads ``STOP.requested`` at its boundaries
  (grpo/run/stop.py says what a training loop then saves). A second signal stops at once.
- at once (an export, an evaluation, a dataset conversion: half-done work worth nothing):
  ``with stops_at_once():`` -- the first signal raises ``StopNow`` wherever the main
  thread is, and later ones are ignored while the command cleans up.

``StopNow`` is a KeyboardInterrupt, so no ``except Exception`` on the way swallows it.
Python runs handlers in the main thread between bytecodes, so "at once" means after the
torch operation running now returns. ``signals_held`` makes the few renames that must all
happen or none wait for their end.

This sits in grpo_infra/, the lowest floor, so that data/ (the lowest layer with a command;
grpo_kernels/ and lora/ have none and take no signals) and every layer above import it from
one place.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """128 + the signal number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopNow(KeyboardInterrupt):
    """Stop where the main thread is, saving nothing more (a second signal, or any signal
    within ``stops_at_once``)."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class StopFlag:
    """The process's stop request. ``install()`` in the entry point; loops read ``requested``."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.listeners: list[Callable[[int], None]] = []  # called with every signal (bench forwards it)
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""

    def install(self) -> None:
        """Take over SIGINT and SIGTERM (main thread only; elsewhere Python forbids it)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals back and forget any request (in-process callers run main() again)."""
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()
        self.signum = None

    def request(self, signum: int) -> None:
        """What the first signal does (tests call it to stop a loop without a signal)."""
        self.signum = signum

    def _handle(self, signum: int, frame) -> None:
        for listener in list(self.listeners):
            listener(signum)
        if self.signum is not None:
            raise StopNow(signum)
        self.signum = signum
        # os.write, not print: a handler may run inside a print of the main thread, and
        # re-entering the buffered stream would raise. On stdout: stderr gets one line, the outcome.
        try:
            os.write(sys.stdout.fileno(), f"\n{signal_name(signum)} received: stopping after the current step "
                                          f"(press Ctrl-C again to stop at once and lose it)\n".encode())
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass  # no file behind stdout (an in-process caller captures it): the note is only a courtesy


STOP = StopFlag()


def stop_at_once(signum: int) -> None:
    """The StopFlag listener of ``stops_at_once``: the first signal raises StopNow where the
    main thread is, instead of waiting for a loop to poll the flag; the signals are ignored
    from then on, so a second one cannot interrupt the command's clean-up (``uninstall``
    gives the handlers back)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise StopNow(signum)


@contextmanager
def stops_at_once() -> Iterator[None]:
    """Within the block a SIGINT or SIGTERM raises ``StopNow`` at once; the old handlers come
    back after. For commands whose half-done work is worth nothing: they write their output
    last, under a temporary name renamed into place (grpo_infra/atomic.py), so a stop leaves the
    old output or none, never half of a new one."""
    STOP.install()
    STOP.listeners.append(stop_at_once)
    try:
        yield
    finally:
        STOP.listeners.remove(stop_at_once)
        STOP.uninstall()


class signals_held:
    """Within this block SIGINT and SIGTERM wait and are acted on when it ends: wrap the few
    file writes and renames that must all happen or none. The handlers are swapped for one
    that only records the signal (blocking it with pthread_sigmask is not enough: it blocks
    one thread, and the kernel hands a process's signal to any thread that does not block
    it, torch's included); on exit the previous handler runs for a recorded signal (raising
    StopNow under ``stops_at_once``). Main thread only; elsewhere it holds nothing."""

    def __enter__(self):
        self._old: dict[int, object] = {}
        self._got: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, lambda signum, frame: self._got.append(signum))
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        for signum in self._got[:1]:  # a second one while held is the same request
            old = self._old[signum]
            if callable(old):
                old(signum, None)
            elif old == signal.SIG_DFL:
                signal.raise_signal(signum)
        return False
