"""SIGINT / SIGTERM as an exception, for data's own commands (python -m data.mathvista convert).

The trainer's stop path (grpo/run/stop.py) finishes a step before it stops; a data command has
no step to finish, so the signal simply unwinds it: its ``finally`` and ``except`` blocks
remove what was half-written, and the command prints one line and exits 128 + the signal
number (130 for Ctrl-C, 143 for SIGTERM), as a shell expects, without a traceback.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


def _raise(signum: int, frame: object) -> None:
    # A second signal during the clean-up would interrupt the clean-up itself: ignore it.
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


@contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block a SIGINT or SIGTERM raises ``Interrupted``; the old handlers come back after."""
    old = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
