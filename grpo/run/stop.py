"""What a training loop does with a stop request (SIGINT / SIGTERM, grpo_infra/signals.py ``STOP``).

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
step in progress is lost. The handlers themselves, and the at-once stop of the commands
that have no step to finish, are grpo_infra/signals.py's, the one signal module of every command.

Under torchrun the flag is combined over ranks at every step boundary
(grpo/distributed.py ``DataParallel.agree``): a signal to one rank stops all of them at
the same step, and rank 0 saves.
"""

from __future__ import annotations

import threading

from grpo_infra.signals import STOP, signal_name


class Stopped(Exception):
    """A loop stopped on a signal after saving; the message is the one line to print."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class EvalAbandoned(Exception):
    """An evaluation gave up mid-way because a stop was requested."""


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
