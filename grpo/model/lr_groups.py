"""AdamW's parameter groups with learning-rate scales: built (``lr_groups``) and read (``set_lr``) here.

A group trains at its lr_scale times the schedule's learning rate (grpo/run/schedule.py
``lr_at``): the vision tower's and merger's LoRA at their own fractions in a GRPO phase
(grpo/model/vision.py ``optimizer_groups``), the tower's weights in the SFT warm-up
(grpo/warmup/sft.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lr_groups(*groups: tuple[str | None, Sequence[torch.nn.Parameter], float]) -> list[dict]:
    """AdamW's parameter groups from (name, params, lr_scale), the empty ones left out: each
    group trains at lr_scale x the schedule's lr (``set_lr``). A name of None leaves the group
    unnamed (the warm-up's groups, as its checkpoints hold them)."""
    return [{"params": list(params), "lr_scale": scale} | ({"name": name} if name is not None else {})
            for name, params, scale in groups if len(params)]


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate: the schedule's ``lr`` times the group's lr_scale (a group
    built without one, as a plain parameter list is, trains at ``lr``)."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
