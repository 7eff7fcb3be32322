"""Trim a wheel to the files one machine needs, as a wheel pip still installs (RECORD rewritten).

bitsandbytes' wheel carries a native library for every CUDA, ROCm and XPU release it
supports (~125 MB unpacked); the GPU machine (torch +cu130, no internet) loads exactly one,
libbitsandbytes_cuda130.so, and a CPU check of the kit loads libbitsandbytes_cpu.so. bench/gpu_kit.sh
downloads the wheel here and calls this to keep those two:

    python -m bench.gpu_kit SRC.whl OUT_DIR --keep-lib cuda130 --keep-lib cpu

Every other ``libbitsandbytes_*`` file is dropped; the Python files, metadata and license
stay. The wheel keeps its name (same version: ``pip install --no-index --find-links OUT_DIR
bitsandbytes`` takes it) and its RECORD lists each kept file's sha256 and size, so pip's
install-time check passes.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

LIB = re.compile(r"(^|/)libbitsandbytes_([A-Za-z0-9]+)\.(so|dll|dylib)$")


def record_line(name: str, data: bytes) -> str:
    """One RECORD row: path, urlsafe-base64 sha256 without padding, size (the wheel spec's format)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim_wheel(src: Path, out_dir: Path, keep_libs: list[str]) -> Path:
    """Copy ``src`` into ``out_dir`` without the native libraries not named in ``keep_libs``
    (the part after ``libbitsandbytes_``: "cuda130", "cpu"); returns the new wheel's path."""
    if not keep_libs:
        raise ValueError("trim_wheel: no --keep-lib given; name at least one library (e.g. cuda130)")
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    if dst.resolve() == src.resolve():
        raise ValueError(f"trim_wheel: {src} would overwrite itself; choose another output folder")
    kept_libs, rows = set(), []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        names = zin.namelist()
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ValueError(f"{src}: {len(records)} .dist-info/RECORD files, expected one; is it a wheel?")
        for name in names:
            m = LIB.search(name)
            if name == records[0] or (m and m.group(2) not in keep_libs):
                continue
            if m:
                kept_libs.add(m.group(2))
            data = zin.read(name)
            zout.writestr(zin.getinfo(name), data)
            if not name.endswith("/"):
                rows.append(record_line(name, data))
        missing = sorted(set(keep_libs) - kept_libs)
        if missing:
            raise ValueError(f"{src}: no libbitsandbytes_{missing[0]} in the wheel; it has "
                             f"{sorted({LIB.search(n).group(2) for n in names if LIB.search(n)})}")
        rows.append(f"{records[0]},,")
        zout.writestr(records[0], "\n".join(rows) + "\n")
    return dst


def check_wheel(path: Path) -> int:
    """Every file in the wheel is in its RECORD with the right hash and size (what pip checks);
    returns the number of files checked."""
    with zipfile.ZipFile(path) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        listed = {}
        for line in z.read(record).decode().splitlines():
            name, digest, size = line.rsplit(",", 2)
            listed[name] = (digest, size)
        files = [n for n in z.namelist() if not n.endswith("/") and n != record]
        for name in files:
            want = record_line(name, z.read(name)).rsplit(",", 2)[1:]
            if listed.get(name) != tuple(want):
                raise ValueError(f"{path}: {name} does not match its RECORD row")
        if set(listed) != set(files) | {record}:
            raise ValueError(f"{path}: RECORD lists files the wheel lacks")
    return len(files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_kit", description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path, help="the downloaded bitsandbytes wheel")
    ap.add_argument("out_dir", type=Path, help="the kit's folder (the trimmed wheel is written there)")
    ap.add_argument("--keep-lib", action="append", default=[], metavar="NAME",
                    help="a native library to keep, by the name after libbitsandbytes_ (cuda130, cpu); repeat")
    args = ap.parse_args(argv)
    try:
        dst = trim_wheel(args.wheel, args.out_dir, args.keep_lib)
        n = check_wheel(dst)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        print(f"bench.gpu_kit: {err}", file=sys.stderr)
        return 2
    print(f"summary: {dst} ({dst.stat().st_size / 2**20:.1f} MiB, was {args.wheel.stat().st_size / 2**20:.1f} MiB; "
          f"{n} files, RECORD checked; libraries kept: {', '.join(args.keep_lib)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
