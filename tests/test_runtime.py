"""The process set-up a training run makes: glibc's allocator keeps freed memory (a step's
buffers are reused by the next instead of being unmapped and faulted in again)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from grpo.run import runtime

PROBE = """
import ctypes, sys, torch
from grpo.run.runtime import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else None
before = libc.mallinfo2().hblkhd
x = torch.empty(6 * 1024 * 1024)  # 24 MiB of float32
print(tuned, libc.mallinfo2().hblkhd - before)
"""


def glibc_with_mallinfo2() -> bool:
    try:
        return sys.platform.startswith("linux") and hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not glibc_with_mallinfo2(), reason="glibc's malloc (mallinfo2, glibc >= 2.33) only")
def test_a_24_mib_buffer_comes_from_the_heap_once_tuned():
    def mapped(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        tuned, grew = out.stdout.split()
        return tuned, int(grew)

    tuned, grew = mapped("tuned")
    assert tuned == "True" and grew < 1024 * 1024  # not a separate mapping: heap memory, kept when freed
    _, grew = mapped("default")
    assert grew >= 24 * 1024 * 1024  # glibc's default maps a block this size on its own (and unmaps it)


def test_the_training_command_tunes_the_allocator():
    from grpo.train import main

    runtime.allocator_tuned = None
    assert main(["--help"]) == 0
    glibc = sys.platform.startswith("linux") and hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    assert runtime.allocator_tuned is glibc  # True here; False where there is no glibc to tune
