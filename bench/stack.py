"""The stack this machine runs, against the ranges pyproject.toml declares: one line per package.

    python -m bench.stack            # exit 1 if a runtime dependency is missing or out of range

bench/gpu.sh runs it first (after installing the kit), so a wrong stack on the GPU machine
costs seconds, not the run. Each line: name, installed version, the declared range, and
"ok", "OUT OF RANGE" or "MISSING"; then Python, CUDA and the device.
"""

from __future__ import annotations

import importlib
import platform
import sys
import tomllib
from pathlib import Path

from grpo.deps import installed_version, parse_requirements, satisfies

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def declared(pyproject: Path = PYPROJECT) -> list[tuple[str, str]]:
    """(distribution name, its specifier) of [project].dependencies, read from the file itself
    (an installed copy's metadata may predate an edit)."""
    return parse_requirements(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def check(ranges: list[tuple[str, str]]) -> tuple[list[str], int]:
    """(the lines, how many packages are missing or out of range); the comparison is the
    commands' own (grpo/deps.py)."""
    lines, bad = [], 0
    for name, spec in ranges:
        version = installed_version(name)
        if version is None:
            lines.append(f"{name}: MISSING (declared {spec})")
            bad += 1
            continue
        ok = satisfies(version, spec)
        bad += not ok
        lines.append(f"{name} {version}: {'ok' if ok else 'OUT OF RANGE'} (declared {spec})")
    return lines, bad


def main() -> int:
    lines, bad = check(declared())
    for line in lines:
        print(line)
    torch = importlib.import_module("torch")
    cuda = torch.cuda.is_available()
    print(f"python {platform.python_version()}; torch CUDA {torch.version.cuda}; device "
          f"{torch.cuda.get_device_name(0) if cuda else 'cpu'}")
    print(f"summary: stack {'ok' if not bad else f'{bad} package(s) missing or out of range'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
