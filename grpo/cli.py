"""What the command-line entry points share: errors as one line, paths inside a directory."""

from __future__ import annotations

import os
from pathlib import Path


def one_line(err: BaseException) -> str:
    """A message on one line: the selector errors list a run's phases on several."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


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
