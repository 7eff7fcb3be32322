"""The progress bar on a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on a terminal; nothing otherwise (CI logs get the periodic
    lines the loops print). ``write`` prints a line without breaking the bar."""

    def __init__(self, total: int, label: str, start: int = 0):
        self.total, self.label, self.t0, self.start = max(1, total), label, time.time(), start
        self.tty = sys.stderr.isatty()
        self.shown = False

    def eta(self, done: int) -> float:
        """Seconds left at the rate of this process's steps so far (NaN before the first)."""
        rate = (done - self.start) / max(1e-9, time.time() - self.t0)
        return (self.total - done) / rate if rate > 0 else float("nan")

    def update(self, done: int, info: str = "") -> None:
        if not self.tty:
            return
        frac = done / self.total
        eta = self.eta(done)
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total} eta {eta:4.0f}s {info}   ")
        sys.stderr.flush()
        self.shown = True

    def write(self, text: str) -> None:
        self.close()
        print(text, flush=True)

    def close(self) -> None:
        if self.tty and self.shown:
            sys.stderr.write("\n")
            self.shown = False
