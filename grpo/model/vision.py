"""The vision tower and merger with LoRA: which layers, their learning rates, their features.

By default the tower is frozen: LoRA adapts the language model only (lora.targets), the
sampler computes each prompt's visual tokens once under no grad and every log-prob pass
reads them (grpo/model/prompt_context.py). ``lora.vision`` puts LoRA on the tower's blocks
too (``model.visual.blocks``: attention ``attn.qkv`` / ``attn.proj`` and the SwiGLU MLP),
``lora.merger`` on the merger (``model.visual.merger.mlp.0`` / ``.2``: 2x2 patches -> one
token of the language model's width). Then what the tower computes depends on the adapters,
and three things change:

    sampler        the tower runs once per prompt with the adapters, as before (the features
                   of the current policy), and its KV cache is copied G times
    policy pass    the tower runs again, once per prompt (B images, not B*G rows), with grad,
                   so the loss reaches the tower's adapters; in training mode, so the blocks'
                   activation checkpointing (model.gradient_checkpointing) is honoured
    reference      the tower runs again with every adapter off (no grad): pi_ref sees the
                   base tower, not the policy's features

For that the prompt context keeps the images' patches (``VisionInputs``), sliced with their
prompts for a training micro-batch or a dynamic-sampling selection. The adapters have their
own learning rates, optim.vision_lr_scale and optim.merger_lr_scale times the phase's lr
(AdamW parameter groups, ``optimizer_groups``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from grpo.model.lr_groups import lr_groups
from lora.inject import LoRAConfig, count_parameters, freeze_all_but_lora, inject_lora, lora_modules, training_mode

VISUAL = "model.visual"  # Qwen2.5-VL's vision tower, merger included (transformers 5's module tree)
BLOCKS = f"{VISUAL}.blocks"
MERGER = f"{VISUAL}.merger"
MERGER_TARGETS = ("mlp.0", "mlp.2")  # the merger's two linears (a GELU between them)


@dataclass
class VisionInputs:
    """The images of a batch's prompts, kept when the tower carries LoRA so the log-prob
    passes can run it again. Images are in prompt order, each prompt's images contiguous."""

    pixel_values: torch.Tensor  # [sum_i patches_i, C] the processor's patches
    image_grid_thw: torch.Tensor  # [n_images, 3] (t, h, w) patch grid per image
    merge: int  # spatial merge size: an image of t*h*w patches gives t*h*w / merge^2 visual tokens

    def tokens_per_image(self) -> list[int]:
        return (self.image_grid_thw.prod(1) // self.merge**2).tolist()

    def images_of(self, visual_tokens: Sequence[int], prompts: Sequence[int]) -> "VisionInputs":
        """The images of ``prompts`` (indices, in order), given each prompt's number of visual tokens."""
        per_image, owner, i = self.tokens_per_image(), [], 0
        for p, n in enumerate(visual_tokens):  # prompt p's images: the next ones until its n tokens are covered
            while n > 0:
                owner.append(p)
                n -= per_image[i]
                i += 1
        patches = self.image_grid_thw.prod(1).tolist()
        first = [sum(patches[:j]) for j in range(len(patches))]
        keep = [j for p in prompts for j in range(len(owner)) if owner[j] == p]
        rows = [r for j in keep for r in range(first[j], first[j] + patches[j])]
        index = torch.tensor(rows, dtype=torch.long, device=self.pixel_values.device)
        return VisionInputs(self.pixel_values[index], self.image_grid_thw[keep], self.merge)

    @staticmethod
    def cat(parts: Sequence["VisionInputs | None"]) -> "VisionInputs | None":
        """The images of several contexts, in order (None: none of them keeps images)."""
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise ValueError("VisionInputs.cat: some contexts keep their images and some do not")
        return VisionInputs(torch.cat([p.pixel_values for p in parts]), torch.cat([p.image_grid_thw for p in parts]),
                            parts[0].merge)


def image_features(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """The tower on these images under the caller's grad mode: [sum_i n_vis_i, d] merged visual tokens."""
    out = model.model.get_image_features(pixel_values, image_grid_thw, return_dict=True)
    return torch.cat(out.pooler_output, 0)  # pooler_output: one [n_vis_i, d] per image


def tower_features(model, vision: VisionInputs) -> torch.Tensor:
    """The tower run again on a context's images (module doc): with grad, in training mode, so
    its blocks' checkpointing holds; then every submodule gets its own mode back."""
    with training_mode(model.model.visual, on=torch.is_grad_enabled()):
        return image_features(model, vision.pixel_values, vision.image_grid_thw)


def has_tower_lora(model: nn.Module) -> bool:
    """True if any LoRA layer sits in the vision tower or its merger."""
    return any(name.startswith(VISUAL + ".") for name in lora_modules(model))


def vision_inputs(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> VisionInputs | None:
    """What a prompt context keeps of its images: they, if the tower carries LoRA; else None."""
    if not has_tower_lora(model):
        return None
    return VisionInputs(pixel_values, image_grid_thw, model.config.vision_config.spatial_merge_size)


# ----------------------------------------------------------------------------- injection


def vision_lora_plan(lora_options: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    """(option, subtree, target suffixes) of each vision switch that is on (lora.vision, lora.merger)."""
    plan = []
    if lora_options.vision:
        plan.append(("lora.vision_targets", BLOCKS, tuple(lora_options.vision_targets)))
    if lora_options.merger:
        plan.append(("lora.merger", MERGER, MERGER_TARGETS))
    return plan


def vision_subtrees(model: nn.Module, lora_options: Any) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(path, subtree, targets) of each vision switch that is on, checked: ValueError, one line
    naming the option and the pattern, for a model without a vision tower or a pattern that
    matches no linear of it."""
    out = []
    for option, path, targets in vision_lora_plan(lora_options):
        try:
            subtree = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"{option}: the model has no {path} (a Qwen2.5-VL vision tower), so there is nothing "
                             f"to adapt; turn lora.vision and lora.merger off for this model") from None
        names = [n for n, m in subtree.named_modules() if isinstance(m, nn.Linear)]
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            kinds = sorted({re.sub(r"^\d+\.", "", n) for n in names})  # one entry per kind, not per block
            raise ValueError(f"{option}: pattern {missing[0]!r} matches no linear layer in {path} "
                             f"(its linears: {', '.join(kinds)})")
        out.append((path, subtree, targets))
    return out


def inject_vision_lora(model: nn.Module, lora_options: Any, verbose: bool = True) -> None:
    """LoRA on the tower's blocks and / or merger as lora_options (a LoRAOptions) says (checked
    by ``vision_subtrees``); nothing when both switches are off."""
    plan = vision_subtrees(model, lora_options)
    if not plan:
        return
    base = lora_options.to_lora()
    for _path, subtree, targets in plan:
        cfg = LoRAConfig(r=base.r, alpha=base.alpha, dropout=base.dropout, target_modules=targets,
                         exclude_modules=(), lora_dtype=base.lora_dtype)
        inject_lora(subtree, cfg, verbose=False)
    freeze_all_but_lora(model)
    if verbose:
        print(f"with the vision LoRA ({', '.join(path for path, _, _ in plan)}): {count_parameters(model)}")


def optimizer_groups(model: nn.Module, params: list[nn.Parameter], optim: Any) -> list:
    """AdamW's parameter groups: ``params`` as they are without tower LoRA (one group, the
    language model's lr); else one group each for the language model's, the blocks' (lr_scale
    = optim.vision_lr_scale) and the merger's adapters (optim.merger_lr_scale), in that order,
    those that exist (grpo/model/lr_groups.py ``lr_groups``; ``set_lr`` sets their lr)."""
    if not has_tower_lora(model):
        return params
    kind = {}
    for name, m in lora_modules(model).items():
        k = "merger" if name.startswith(MERGER + ".") else "vision" if name.startswith(VISUAL + ".") else "language"
        kind[id(m.lora_A)] = kind[id(m.lora_B)] = k
    scales = {"language": 1.0, "vision": optim.vision_lr_scale, "merger": optim.merger_lr_scale}
    return lr_groups(*((k, [p for p in params if kind[id(p)] == k], scale) for k, scale in scales.items()))
