"""Prompt encoding: the chat text around one image and a question, and B prompts as one
left-padded batch with their image patches (what ``Qwen2_5_VLProcessor`` would produce).

Images go through transformers' Qwen2-VL image processor with its PIL backend
(``Qwen2VLImageProcessorPil``): resize to multiples of 28 px, normalise, cut into 14x14x2
patches. transformers' combined ``Qwen2_5_VLProcessor`` is *not* used because it insists
on a video processor, which needs torchvision. ``encode_prompts`` does the two things that
processor adds -- expand ``<|image_pad|>`` to one token per merged patch and mark image
tokens in ``mm_token_type_ids`` -- and a test checks the result equals the processor's.
``mm_token_type_ids`` matters: without it Qwen2.5-VL silently falls back to 1-D positions.

Chat format: one user turn ``<|vision_start|><|image_pad|>*n<|vision_end|>`` + the contract
prompt (data.contract.format_prompt), then the assistant header. The tiny model uses no
system prompt (its template adds none); a real Qwen model keeps its own template, which
adds Qwen's default system prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from data.contract import format_prompt
from grpo.model.load import ModelBundle, first_line

# ----------------------------------------------------------------------------- prompt encoding


@dataclass
class PromptBatch:
    """B prompts ready for the model; rows are left-padded so every prompt ends at column P-1.

    Left padding is what batched decoding wants: the next token of every row goes in the
    same column, and the KV cache stays one rectangular tensor.
    """

    input_ids: torch.Tensor  # [B, P] long
    attention_mask: torch.Tensor  # [B, P] long, 0 on left padding
    mm_token_type_ids: torch.Tensor  # [B, P] int, 1 on <|image_pad|> tokens (what turns M-RoPE on)
    pixel_values: torch.Tensor  # [sum_i patches_i, 3*2*14*14] float, images concatenated in row order
    image_grid_thw: torch.Tensor  # [B, 3] long, (t, h, w) patch grid per image
    kept: list[int] = field(default_factory=list)  # input index of each row
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (input index, reason) of dropped inputs

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of Qwen2_5_VLForConditionalGeneration.forward / generate."""
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                    mm_token_type_ids=self.mm_token_type_ids, pixel_values=self.pixel_values,
                    image_grid_thw=self.image_grid_thw)

    def to(self, device: str | torch.device) -> PromptBatch:
        moved = {k: v.to(device) for k, v in self.model_inputs().items()}
        return PromptBatch(**moved, kept=list(self.kept), skipped=list(self.skipped))

    @property
    def n_image_tokens(self) -> torch.Tensor:
        """[B] visual tokens per row (t*h*w / merge^2)."""
        return self.mm_token_type_ids.sum(1)


def prompt_text(bundle: ModelBundle, question: str | None) -> str:
    """The chat-formatted prompt with ONE <|image_pad|> placeholder (expanded later).

    ``question=None``: a user turn that is only the image, the prompt of the warm-up's
    perception stage (the answer describes the picture; grpo/warmup/sft.py).
    """
    messages = []
    if bundle.system_prompt is not None:
        messages.append({"role": "system", "content": bundle.system_prompt})
    content = [{"type": "image"}]
    if question is not None:
        content.append({"type": "text", "text": format_prompt(question)})
    messages.append({"role": "user", "content": content})
    return bundle.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _as_pairs(items) -> list[tuple[Any, str]]:
    """Examples (with .image, .question) or an (images, questions) pair -> [(image, question)]."""
    if isinstance(items, tuple) and len(items) == 2 and isinstance(items[1], (list, tuple)):
        images, questions = items
        if len(images) != len(questions):
            raise ValueError(f"encode_prompts: {len(images)} images but {len(questions)} questions")
        return list(zip(images, questions))
    return [(getattr(ex, "image", None), getattr(ex, "question", None)) for ex in items]


def _preprocess_image(bundle: ModelBundle, image) -> tuple[torch.Tensor, torch.Tensor]:
    """One image -> (patches [n, 1176], grid_thw [3]). Raises ValueError with the reason."""
    if image is None:
        raise ValueError("no image (Example.image is None: decode it before encoding)")
    try:
        out = bundle.image_processor(images=[image], return_tensors="pt")
    except Exception as e:  # PIL and numpy errors vary; the caller needs one reason string
        raise ValueError(f"image preprocessing failed ({first_line(e)})") from None
    return out["pixel_values"], out["image_grid_thw"][0]


def encode_prompts(
    bundle: ModelBundle,
    items,
    *,
    on_bad_image: str = "raise",
    image_only: bool = False,
) -> PromptBatch:
    """Tokenise B (image, question) prompts into one left-padded batch.

    ``items``: a sequence of Examples (``.image`` a PIL image, ``.question``) or a tuple
    ``(images, questions)``. ``on_bad_image="skip"`` drops an example whose image fails
    to preprocess and records it in ``.skipped`` (training goes on); "raise" (default)
    raises one ValueError naming the example. ``image_only``: prompts without the
    question (the warm-up's perception stage).
    """
    if on_bad_image not in ("raise", "skip"):
        raise ValueError(f"on_bad_image={on_bad_image!r}; use 'raise' or 'skip'")
    pairs = _as_pairs(items)
    if not pairs:
        raise ValueError("encode_prompts: no prompts given")
    tok, merge2 = bundle.tokenizer, bundle.merge_size**2
    image_pad = "<|image_pad|>"
    rows, pixels, grids, kept, skipped = [], [], [], [], []
    for i, (image, question) in enumerate(pairs):
        if not image_only and (not isinstance(question, str) or not question.strip()):
            raise ValueError(f"encode_prompts: item {i} has no question text (got {question!r})")
        try:
            patches, grid = _preprocess_image(bundle, image)
        except ValueError as e:
            if on_bad_image == "raise":
                raise ValueError(f"encode_prompts: item {i}: {e}; fix the image or pass on_bad_image='skip'") from None
            skipped.append((i, str(e)))
            continue
        text = prompt_text(bundle, None if image_only else question)
        n_vis = int(grid.prod()) // merge2  # one LM token per 2x2 group of patches
        text = text.replace(image_pad, image_pad * n_vis, 1)
        rows.append(tok(text, add_special_tokens=False)["input_ids"])
        pixels.append(patches)
        grids.append(grid)
        kept.append(i)
    if not rows:
        raise ValueError(f"encode_prompts: every image failed to preprocess: {skipped}")
    P = max(len(r) for r in rows)  # the padded prompt length
    if P > bundle.context_length:
        raise ValueError(f"encode_prompts: a prompt is {P} tokens, longer than the model's context "
                         f"({bundle.context_length}); shorten the question or lower max_pixels")
    B = len(rows)
    input_ids = torch.full((B, P), bundle.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, P - len(r):] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, P - len(r):] = 1
    mm_token_type_ids = (input_ids == bundle.image_token_id).to(torch.long) * attention_mask
    return PromptBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        pixel_values=torch.cat(pixels, 0).to(bundle.model.dtype),
        image_grid_thw=torch.stack(grids, 0),
        kept=kept,
        skipped=skipped,
    )
