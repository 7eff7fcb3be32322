"""What a GRPO step computes once per prompt and shares across its G completions.

A VLM prompt is expensive in two ways the text is not: the vision tower (a ViT over every
14x14 patch) and the multimodal rotary positions (M-RoPE), which Qwen2.5-VL computes with
a Python loop over the batch. Both depend only on the prompt. ``PromptContext`` holds
them, computed ONCE per prompt per step and reused by

    the sampler      (prefill of B prompts, then the KV cache is copied G times),
    the policy pass  (log-probs of the B*G completions, LoRA on, with grad),
    the reference    (same, adapters off, no grad).

Generating with repeated prompts (what TRL does, and the only way transformers' generate
works with Qwen2.5-VL images here) runs the vision tower G times per prompt for sampling
and again 2G times for the two log-prob passes: 3G vision passes instead of 1.

With the vision tower frozen (the default: LoRA adapts the language model only), its
features are computed under ``torch.no_grad`` and are the same for policy and reference.
With LoRA in the tower (lora.vision / lora.merger) the context also keeps the images
(``vision``), and the log-prob passes run the tower again once per prompt
(``prompt_embeds(..., tower=True)``; grpo/model/vision.py says why and how).

M-RoPE recap (Qwen2.5-VL, transformers 5): every token has 3 position ids (t, h, w).
Text tokens have t = h = w = running index; the n visual tokens of an image get a grid of
(t, h, w) ids starting at the running index, and the running index then advances by
max(h, w) grid cells, not by n. So a prompt of n_real tokens ends at position
n_real - 1 + delta with delta = max(h, w) - n <= 0 (``rope delta``), and a token k
steps after the prompt sits at ``next_position + k`` with next_position = n_real + delta,
on all three axes. A prompt of several images: each image in turn, so its delta is the sum
of its images' max(h, w) - n_k (transformers' get_rope_index takes the grids in order).

Several images a prompt change nothing below but counts: the vision tower runs over every
image of the batch at once, ``image_embeds`` holds prompt 0's images' tokens, then prompt
1's, ..., and a prompt's share is the number of its ``image_mask`` positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo.model.prompts import PromptBatch
from grpo.model.vision import VisionInputs, image_features, tower_features, vision_inputs


@dataclass
class PromptContext:
    """Per-prompt tensors reused by sampling and both log-prob passes (B = prompts)."""

    input_ids: torch.Tensor  # [B, P] long, left-padded
    attention_mask: torch.Tensor  # [B, P] long
    position_ids: torch.Tensor  # [3, B, P] long, M-RoPE (t, h, w); 0 on padding
    next_position: torch.Tensor  # [B] long, position of the first completion token
    image_embeds: torch.Tensor  # [n_vis_total, d] merged visual tokens of every image, in prompt order, no grad
    image_mask: torch.Tensor  # [B, P] bool, where image_embeds go
    vision: VisionInputs | None = None  # the images, kept only when the tower carries LoRA (grpo/model/vision.py)

    @property
    def B(self) -> int:
        return self.input_ids.shape[0]

    @property
    def P(self) -> int:
        """Prompt length in tokens (padded)."""
        return self.input_ids.shape[1]

    def prompts(self, start: int, stop: int) -> "PromptContext":
        """The context of prompts start..stop-1 alone (a training micro-batch of whole groups).
        The padded length P is kept: every position id is explicit, so a shorter slice would be
        equally right, but equal shapes keep a micro-batch's numbers those of the whole batch."""
        if not 0 <= start < stop <= self.B:
            raise ValueError(f"prompts({start}, {stop}): need 0 <= start < stop <= B = {self.B}")
        return self if (start, stop) == (0, self.B) else self.select(range(start, stop))

    def select(self, prompts: Sequence[int], trim: bool = False) -> "PromptContext":
        """The context of ``prompts`` (indices, in order) alone. The visual tokens are stored
        concatenated in prompt order, so prompt b's rows of ``image_embeds`` (all its images')
        start after the visual tokens of prompts 0..b-1. ``trim``: cut the leading columns that
        are padding in every kept prompt (left padding: they only cost attention work)."""
        prompts = list(prompts)
        n_vis = self.image_mask.sum(1).tolist()  # [B] visual tokens per prompt (a host sync)
        start = [sum(n_vis[:p]) for p in prompts]
        vis = [i for p, s in zip(prompts, start) for i in range(s, s + n_vis[p])]
        idx = torch.tensor(prompts, dtype=torch.long, device=self.input_ids.device)
        am = self.attention_mask[idx]
        first = int((am.sum(0) > 0).nonzero()[0]) if trim and am.numel() else 0
        return PromptContext(
            input_ids=self.input_ids[idx, first:],
            attention_mask=am[:, first:],
            position_ids=self.position_ids[:, idx, first:],
            next_position=self.next_position[idx],
            image_embeds=self.image_embeds[torch.tensor(vis, dtype=torch.long, device=self.image_embeds.device)],
            image_mask=self.image_mask[idx, first:],
            vision=self.vision_of(prompts),
        )

    def vision_of(self, prompts) -> VisionInputs | None:
        """The kept images of ``prompts`` (indices, in order); None when the context keeps none."""
        if self.vision is None:
            return None
        return self.vision.images_of(self.image_mask.sum(1).tolist(), list(prompts))


def mrope_positions(model, prompts: PromptBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, B, P], next_position [B]) from transformers' own get_rope_index."""
    position_ids, rope_deltas = model.model.get_rope_index(
        prompts.input_ids,
        mm_token_type_ids=prompts.mm_token_type_ids,
        image_grid_thw=prompts.image_grid_thw,
        attention_mask=prompts.attention_mask,
    )
    n_real = prompts.attention_mask.sum(1)
    next_position = n_real + rope_deltas.view(-1).to(n_real.device)  # = max position + 1
    return position_ids, next_position


@torch.no_grad()
def vision_features(model, prompts: PromptBatch) -> torch.Tensor:
    """Run the vision tower once over every image (with its adapters, if any): [sum_i n_vis_i, d] merged visual tokens."""
    return image_features(model, prompts.pixel_values, prompts.image_grid_thw)


def build_prompt_context(model, prompts: PromptBatch) -> PromptContext:
    """Vision features + M-RoPE positions for B prompts (the once-per-prompt work)."""
    if prompts.input_ids.device != model.device:
        prompts = prompts.to(model.device)
    position_ids, next_position = mrope_positions(model, prompts)
    image_embeds = vision_features(model, prompts)
    image_mask = prompts.input_ids == model.config.image_token_id
    n_tokens, n_feats = int(image_mask.sum()), image_embeds.shape[0]
    if n_tokens != n_feats:
        raise ValueError(f"prompts have {n_tokens} <|image_pad|> tokens but the images give {n_feats} "
                         "visual tokens; encode prompts with grpo.model.encode_prompts")
    return PromptContext(
        input_ids=prompts.input_ids,
        attention_mask=prompts.attention_mask,
        position_ids=position_ids,
        next_position=next_position,
        image_embeds=image_embeds,
        image_mask=image_mask,
        vision=vision_inputs(model, prompts.pixel_values, prompts.image_grid_thw),
    )


def prompt_embeds(model, ctx: PromptContext, tower: bool = False) -> torch.Tensor:
    """[B, P, d] input embeddings of the prompts with the visual tokens scattered in.

    Cheap (an embedding lookup and a copy); recomputed per pass so it follows the
    embedding table's grad mode. Index the result with a row map to serve B*G rows.
    ``tower``: with a context that keeps its images (LoRA in the tower), run the tower again
    under the caller's grad mode and adapter state (the log-prob passes) instead of reading
    the sampler's features.
    """
    embeds = model.get_input_embeddings()(ctx.input_ids)
    feats = tower_features(model, ctx.vision) if tower and ctx.vision is not None else ctx.image_embeds
    feats = feats.to(embeds.dtype)
    return embeds.masked_scatter(ctx.image_mask[..., None], feats)


def group_rows(B: int, G: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B*G] prompt index of every completion row: rows b*G .. b*G+G-1 belong to prompt b."""
    return torch.arange(B, device=device).repeat_interleave(G)


def completion_position_ids(ctx: PromptContext, rows: torch.Tensor, T: int) -> torch.Tensor:
    """[3, N, T] positions of T completion tokens after each row's prompt (same on t, h, w)."""
    steps = torch.arange(T, device=ctx.next_position.device)
    pos = ctx.next_position[rows, None] + steps  # [N, T]
    return pos.unsqueeze(0).expand(3, -1, -1)
