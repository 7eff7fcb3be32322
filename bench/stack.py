"""The stack this machine runs, against the ranges pyproject.toml declares: one line per package.

    python -m bench.stack            # exit 1 if a runtime dependency is missing or out of range

bench/gpu.sh runs it first (after installing the kit), so a wrong stack on the GPU machine
costs seconds, not the run. Each line: name, installed version, the declared range, and
"ok", "OUT OF RANGE" or "MISSING"; then Python, CUDA and the device.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import platform
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def declared(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """{distribution name: its specifier ('>=2.11,<2.15')} of [project].dependencies."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", dep)
        out[m.group(1).lower()] = m.group(2).strip()
    return out


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec`` (packaging's rules; a local tag such as +cu130 is ignored)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version.split("+")[0]) in SpecifierSet(spec)


def check(ranges: dict[str, str]) -> tuple[list[str], int]:
    """(the lines, how many packages are missing or out of range)."""
    lines, bad = [], 0
    for name, spec in ranges.items():
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            lines.append(f"{name}: MISSING (declared {spec})")
            bad += 1
            continue
        ok = in_range(version, spec)
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
