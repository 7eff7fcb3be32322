"""One stop path for SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption notice).

The first signal only sets a flag. Every long loop polls it -- the warm-up and GRPO steps
at each step boundary, the evaluations at each batch of prompts -- because a flag polled
only at the main loop's step boundary never fires while a warm-up or an evaluation runs.
A training loop that sees it finishes its step, writes a checkpoint of that step (atomic,
as every save) and raises ``Stopped``; an evaluation raises ``EvalAbandoned`` and its
caller saves what it has. The entry point prints the one line and exits with 128 + the
signal number (130 for SIGINT, 143 for SIGTERM), the shell's convention for a process
ended by that signal.

A second signal stops at once: the handler raises ``StopNow`` (a KeyboardInterrupt, so
no ``except Exception`` on the way swallows it) wherever the main thread is; only the
step in progress is lost. Python runs handlers in the main thread between bytecodes, so
"at once" means after the torch operation running now returns.

Under torchrun the flag is combined over ranks at every step boundary
(grpo/distributed.py ``DataParallel.agree``): a signal to one rank stops all of them at
the same step, and rank 0 saves.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """128 + the signal number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """A loop stopped on a signal after saving; the message is the one line to print."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class StopNow(KeyboardInterrupt):
    """A second signal: stop where the main thread is, saving nothing more."""

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class EvalAbandoned(Exception):
    """An evaluation gave up mid-way because a stop was requested."""


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


def stop_message(where: str, signum: int | None = None, saved: str = "checkpoint saved") -> str:
    """The one line a stop prints: where it stopped, on which signal (this process's unless
    given: under torchrun another rank's may have stopped it), what was kept."""
    name = signal_name(signum) if signum else STOP.name
    return f"stopped at {where} on {name}; {saved}; the same command resumes"


def check_eval() -> None:
    """Raise EvalAbandoned if a stop was requested: called by evaluation loops between batches."""
    if STOP.requested and not _no_abandon.active:
        raise EvalAbandoned(STOP.name)


class _NoAbandon(threading.local):
    active = False


_no_abandon = _NoAbandon()


class evals_run_to_the_end:
    """Within this block evaluations do not abandon (data parallel: every rank must finish
    the collective evaluation together; the stop is then taken at the next step boundary)."""

    def __enter__(self):
        self._old, _no_abandon.active = _no_abandon.active, True
        return self

    def __exit__(self, *exc):
        _no_abandon.active = self._old
        return False


# ----------------------------------------------------------------------------- commands that keep nothing half-done


def stop_at_once(signum: int) -> None:
    """A StopFlag listener for commands whose half-done work is worth nothing (an export, an
    evaluation whose report is not written yet): the first signal raises StopNow where the
    main thread is, instead of waiting for a loop to poll the flag. Those commands write
    their output last, to a temporary name renamed into place (or with the signals held,
    ``signals_held``), so a stop leaves the old output or none, never half of a new one."""
    raise StopNow(signum)


class signals_held:
    """Within this block SIGINT and SIGTERM wait and are acted on when it ends: wrap the few
    file writes and renames that must all happen or none. The handlers are swapped for one
    that only records the signal (blocking it with pthread_sigmask is not enough: it blocks
    one thread, and the kernel hands a process's signal to any thread that does not block
    it, torch's included); on exit the previous handler runs for a recorded signal (raising
    StopNow under ``stop_at_once``). Main thread only; elsewhere it holds nothing."""

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
