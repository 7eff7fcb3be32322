"""What a checkpoint's tensors are: a base checkpoint's full weights (``base.<name>``) or an
adapter's LoRA tensors, and which base checkpoint an adapter was trained on."""

from __future__ import annotations

from pathlib import Path

import torch

BASE_PREFIX = "base."


def base_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of a (not yet adapted) model, keyed for a base checkpoint."""
    return {BASE_PREFIX + k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def adapter_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.endswith((".lora_A", ".lora_B"))}


def base_checkpoint_of(run_dir: str | Path, ckpt) -> Path | None:
    """The base checkpoint directory an (adapter or base) checkpoint builds on, if any."""
    from grpo.state.checkpoint import check_base_ref

    extra = ckpt.extra or {}
    if extra.get("kind") == "base":
        return Path(ckpt.path)
    base = check_base_ref(extra.get("base"), f"{ckpt.path}/state.json")  # load_checkpoint checked it too
    return Path(run_dir) / base if base else None
