"""Process set-up for a phase: the device, torch threads, seeds."""

from __future__ import annotations

import random

import numpy as np
import torch

from grpo.config import ConfigError


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
