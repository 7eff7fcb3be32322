"""When things happen: the learning rate at each optimiser step, and when a periodic save is due."""

from __future__ import annotations

import math
import time

from grpo.config import TrainConfig


def updates_per_batch(cfg: TrainConfig) -> int:
    """mu: optimiser steps per step in a GRPO phase (the SFT warm-up takes one per step)."""
    return 1 if cfg.phase.name == "warmup" else cfg.optim.updates_per_batch


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based): linear warm-up, then the schedule.

    phase.steps counts steps (each of optim.accumulation rollout batches); a GRPO phase takes
    mu = optim.updates_per_batch optimiser steps per step, so the schedule (and
    optim.warmup_steps) runs over phase.steps x mu optimiser steps, and step s's updates are
    optimiser steps s*mu .. s*mu + mu - 1. A pure function of the step, so resuming needs only
    the step to restore the schedule (checkpoints fall on step boundaries).
    """
    o, total = cfg.optim, max(1, cfg.phase.steps * updates_per_batch(cfg))
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    if o.schedule == "linear":
        return o.lr * (1.0 - 0.9 * frac)
    if o.schedule == "cosine":
        return o.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * frac)))
    return o.lr


# ----------------------------------------------------------------------------- periodic saves


class SaveClock:
    """When a phase saves a `latest`-only checkpoint between evaluations: every
    run.save_every steps, or once run.save_every_minutes passed since the last save of any
    kind (so a crash loses at most that much work even when evaluations are rare)."""

    def __init__(self, cfg: TrainConfig):
        self.every, self.seconds = cfg.run.save_every, 60.0 * cfg.run.save_every_minutes
        self.last = time.monotonic()

    def due(self, done: int) -> bool:
        """Whether a periodic save is due after ``done`` steps (not counting evaluation saves)."""
        by_steps = self.every > 0 and done % self.every == 0
        return by_steps or (self.seconds > 0 and time.monotonic() - self.last >= self.seconds)

    def saved(self) -> None:
        self.last = time.monotonic()
