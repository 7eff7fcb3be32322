"""The run's own failures, and how the entry points print an error: one line, no traceback.

Every error the project raises on purpose (a bad option, a damaged checkpoint, a full
disk in the run directory, a diverged run) ends as one line on stderr with an exit code
(2: the request is wrong, 1: the run failed); anything else is a bug and keeps its
traceback. grpo/cli.py (training) and grpo/evaluate.py (evaluation) share these.
"""

from __future__ import annotations

import os
from pathlib import Path


class ConfigError(ValueError):
    """A bad configuration value or key; the message names it and says what to do (exit code 2)."""


class TrainingDiverged(RuntimeError):
    """Losses stayed non-finite: the run stops (one line, exit code 1)."""


class StepOutOfMemory(RuntimeError):
    """A step ran out of device memory: the line names the step, its part and what the memory
    plan says fits (grpo/run/memory_plan.py ``out_of_memory_message``; exit code 1)."""


class PolicyCollapsed(RuntimeError):
    """run.stop_on_collapse: an evaluation found one answer for every prompt (one line, exit code 1)."""


class NoRewardSpread(RuntimeError):
    """Dynamic sampling found no group with reward spread within its bound (one line, exit code 1)."""


def one_line(err: BaseException) -> str:
    """A message on one line: the selector errors list a run's phases on several."""
    out = ""
    for line in (ln.strip() for ln in str(err).splitlines()):
        if line:  # a line ending in ':' introduces the next one ("It holds: A: steps 4; B: ...")
            out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def inside(filename: object, root: Path) -> bool:
    """Whether an OSError's filename lies in ``root``: only then is the error the user's
    directory (full disk, permissions) and worth one line instead of a traceback."""
    if not isinstance(filename, (str, bytes)) and not hasattr(filename, "__fspath__"):
        return False
    try:
        path, root = Path(os.fsdecode(filename)).resolve(), Path(root).resolve()
    except (OSError, ValueError):
        return False
    return path == root or path.is_relative_to(root)
