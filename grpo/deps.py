"""The installed releases of our dependencies against the ranges pyproject.toml declares.

An environment can hold an older release than the project supports: a user installs this
project with ``--no-deps`` beside an existing stack, or downgrades transformers later. Left
alone, the first symptom is a traceback from deep inside transformers (a class that moved,
an argument that does not exist yet). The commands call ``exit_on_unsupported_stack`` before
they import torch or transformers, so the user gets one line naming the package, its
version, the range and the pip command that fixes it.

The ranges are read from the installed distribution's metadata (``vlgrpo``'s Requires-Dist)
or, in a checkout that was never installed, from pyproject.toml beside the packages: one
source, the file pip reads. Only the standard library is imported here, and version
comparison covers what the file uses (>=, >, <=, <, ==, != on release numbers; a local
part such as ``+cpu`` and a pre-release suffix are ignored).
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

DIST = "vlgrpo"
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*?)\s*(?:;(.*))?$")
_OPS = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
        "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}


def release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); '5.25.0rc1' -> (5, 25, 0); trailing zeros dropped, so
    '5.17' == '5.17.0'."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:  # '0rc1': the release ends here
            break
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def satisfies(version: str, spec: str) -> bool:
    """Whether ``version`` lies in ``spec`` ('>=5.17,<6'; '' is any version)."""
    have = release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = re.match(r"(>=|<=|==|!=|>|<)\s*(.+)", clause)
        if op is None:
            raise ValueError(f"version specifier {clause!r} is not one of {sorted(_OPS)} followed by a version")
        if not _OPS[op.group(1)](have, release(op.group(2))):
            return False
    return True


def declared_requirements() -> list[tuple[str, str]]:
    """(package, specifier) of every runtime dependency: the installed metadata, or the
    checkout's pyproject.toml; [] where neither can be read (nothing to check against)."""
    try:
        lines = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            lines = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return []
    return parse_requirements(lines)


def parse_requirements(lines: list[str]) -> list[tuple[str, str]]:
    """'transformers>=5.17,<6' lines -> (package, specifier) pairs; a line marked for an extra is left out."""
    out = []
    for line in lines:
        m = _REQ.match(line)
        if m is None or (m.group(3) and "extra" in m.group(3)):  # extras: optional, not checked
            continue
        out.append((m.group(1), _lower_bound_first(m.group(2))))
    return out


def _lower_bound_first(spec: str) -> str:
    """'<6,>=5.17' (as the metadata writes it) -> '>=5.17,<6' (as a person writes it)."""
    order = (">=", ">", "==", "!=", "<=", "<")
    clauses = [c.strip() for c in spec.replace(" ", "").split(",") if c.strip()]
    return ",".join(sorted(clauses, key=lambda c: next(i for i, op in enumerate(order) if c.startswith(op))))


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def stack_problems(requirements: list[tuple[str, str]] | None = None) -> list[str]:
    """One line per dependency that is missing or outside its declared range."""
    problems = []
    for package, spec in declared_requirements() if requirements is None else requirements:
        have = installed_version(package)
        fix = f"pip install '{package}{spec}'"
        if have is None:
            problems.append(f"{package} is not installed; this project needs {package}{spec}: {fix}")
        elif not satisfies(have, spec):
            problems.append(f"{package} {have} is installed, outside the range this project supports "
                            f"({package}{spec}): {fix}")
    return problems


def exit_on_unsupported_stack() -> None:
    """Exit with status 2 and one line (the first problem; a count of the others) when a
    dependency is missing or outside its range. Called by the commands before heavy imports."""
    problems = stack_problems()
    if problems:
        more = f" (and {len(problems) - 1} more: run `pip check`)" if len(problems) > 1 else ""
        print(f"error: {problems[0]}{more}", file=sys.stderr)
        raise SystemExit(2)
