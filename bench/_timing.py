"""Shared benchmark helpers: time quantiles, peak memory, achieved bandwidth, tables.

Every benchmark in bench/ reports the same units: median / p20 / p80 milliseconds over
repeated runs, peak memory above what was allocated before the call, and achieved GB/s
against the device's peak memory bandwidth (looked up by device name; blank if unknown).

Timing: on CUDA each run is bracketed by CUDA events (GPU time, launch overhead included
when the GPU waits for the CPU); on a CPU by ``time.perf_counter``. Warm-up runs come first
so compilation, autotuning and allocator growth are not timed.
Peak memory is measured with the CUDA caching allocator's statistics; PyTorch keeps no such
statistics for CPU tensors, so on a CPU it is reported as blank.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

# Peak DRAM bandwidth (bytes/s) by device-name fragment, most specific first; vendor specs.
PEAK_BANDWIDTH = [
    ("GH200", 4.0e12),
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM, "H100 80GB HBM3"
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB parts
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("RTX 4090", 1.008e12),
    ("RTX 3090", 0.936e12),
    ("V100", 0.9e12),
    ("T4", 0.32e12),
]


@dataclass
class Timing:
    """Milliseconds per call over ``reps`` timed runs."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def peak_bandwidth(device: torch.device | str) -> float | None:
    """Peak memory bandwidth in bytes/s for a known GPU, else None."""
    name = device_name(device)
    if torch.device(device).type != "cuda":
        return None
    for fragment, bw in PEAK_BANDWIDTH:
        if fragment in name:
            return bw
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 3,
            reps: int = 20) -> Timing:
    """Run ``fn`` ``warmup`` times, then time ``reps`` runs one by one."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    ms = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            ms.append(1e3 * (time.perf_counter() - t0))
    q = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    return Timing(median_ms=statistics.median(ms), p20_ms=q[1], p80_ms=q[7], reps=reps)


def peak_memory(fn: Callable[[], object], device: torch.device | str) -> int | None:
    """Bytes allocated at the peak of one ``fn()`` call above what was allocated before it
    (CUDA only; None on a CPU). Whatever ``fn`` returns is dropped after the call."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def fmt(x: float | int | None, spec: str = ".3g") -> str:
    """Blank for unknown, otherwise ``format(x, spec)``."""
    return "" if x is None else format(x, spec)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Fixed-width table; each row maps column name -> already formatted string."""
    widths = {c: max([len(c), *(len(str(r.get(c, ""))) for r in rows)]) for c in columns}  # rows may be []
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(widths[c]) for c in columns))
    print(end="", flush=True)  # a part cut short by its timeout keeps every table printed


def first_call_s(step: Callable[[], object], device: torch.device | str) -> float:
    """Seconds of one ``step()`` call, synchronised: for a torch.compile'd step the compile
    itself, which ``measure``'s warm-up would otherwise hide (printed, never timed as a rep)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda *a: None)
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def print_compile_time(label: str, step: Callable[[], object], device: torch.device | str) -> None:
    """Print how long the first call of a compiled ``step`` took (the compile); an
    out-of-memory error is left to ``measure``, which records the row as OOM."""
    try:
        print(f"# torch.compile, first call of {label}: {first_call_s(step, device):.1f} s", flush=True)
    except RuntimeError as err:
        if not is_oom(err):
            raise


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def measure(step: Callable[[], object], device: torch.device | str, *, warmup: int, reps: int | None
            ) -> tuple[Timing, int | None] | None:
    """(timing, peak memory) of ``step``; None when it runs out of device memory (cache freed)."""
    try:
        return time_fn(step, device, warmup=warmup, reps=reps), peak_memory(step, device)
    except RuntimeError as err:
        if not is_oom(err):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def timing_cells(t: Timing) -> dict[str, str]:
    """The median / p20 / p80 columns of a results row."""
    return {"median ms": fmt(t.median_ms, ".4g"), "p20": fmt(t.p20_ms, ".4g"), "p80": fmt(t.p80_ms, ".4g")}
