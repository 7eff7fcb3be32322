"""Process set-up for a phase: the device, torch threads, seeds, the CPU memory allocator."""

from __future__ import annotations

import ctypes
import random
import sys

import numpy as np
import torch

from grpo.errors import ConfigError


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--model.device {name}: no CUDA device here; use --model.device cpu")
    index = name.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"--model.device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return name


def set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 1024 * 1024  # the most glibc accepts on 64-bit (half its heap size)
allocator_tuned: bool | None = None  # what keep_freed_memory did in this process (None: not called)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the next step instead of handing it back
    to the kernel; -> whether it could (False off glibc: nothing to do there).

    A training step frees its activations, logits and rollout buffers and allocates the
    same sizes again in the next one. With glibc's defaults a block above the mmap
    threshold is unmapped when freed and its pages are faulted in again on the next
    allocation, and the heap top is trimmed the same way. Allocations up to 32 MiB now come
    from the heap, which is never trimmed: on the 2-core VM a 15-step phase A took 1.34M
    minor page faults before and 0.30M after (bench/RESULTS.md), at the same peak memory.
    Numbers are unchanged: only where the bytes live.
    """
    global allocator_tuned
    if not sys.platform.startswith("linux"):
        allocator_tuned = False
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # another C library (musl): its own allocator, left alone
        allocator_tuned = False
        return False
    allocator_tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return allocator_tuned
