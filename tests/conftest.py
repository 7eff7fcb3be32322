"""Shared by every test file: each test starts with the global random generators in one fixed state.

A fresh Python process seeds torch's global generator at random (with torch 2.13 as installed
here, ``torch.initial_seed()`` differs from run to run), and Python's ``random`` and numpy's
global generator likewise. A test that draws from them without a generator of its own -- a
LoRA init (``kaiming_uniform_`` on A), a ``randn_like`` nudge to the adapters -- would test
other numbers in every run, and other numbers again depending on which tests ran before it
in the same process, so a margin that holds for most draws would fail now and then. Seeding
before every test makes each one repeat exactly, whatever the order. Tests that need their own
stream still seed it (or use a ``torch.Generator``); subprocesses seed themselves (the trainer
from run.seed, tests/test_distributed.py's worker explicitly).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def fixed_global_rng():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
