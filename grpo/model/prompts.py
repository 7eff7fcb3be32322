"""Prompt encoding: the chat text around a prompt's images and its question, and B prompts as
one left-padded batch with their image patches (what ``Qwen2_5_VLProcessor`` would produce).

Images go through transformers' Qwen2-VL image processor with its PIL backend
(``Qwen2VLImageProcessorPil``): resize to multiples of 28 px, normalise, cut into 14x14x2
patches. transformers' combined ``Qwen2_5_VLProcessor`` is *not* used because it insists
on a video processor, which needs torchvision. ``encode_prompts`` does the two things that
processor adds -- expand ``<|image_pad|>`` to one token per merged patch and mark image
tokens in ``mm_token_type_ids`` -- and a test checks the result equals the processor's.
``mm_token_type_ids`` matters: without it Qwen2.5-VL silently falls back to 1-D positions.

Bounds (grpo/model/load.py ``set_input_bounds``): the processor resizes every image into
[min_pixels, max_pixels] (Qwen's smart resize; each image of a prompt on its own), and a
prompt longer than the bundle's ``max_prompt_tokens`` (the visual tokens of all its images
included) does not enter the model: skipped like a bad image, or one ValueError naming it.
``PromptBatch.counts`` says what entered and what did not (the training log line's "prompts"
entry).

Chat format: one user turn ``<|vision_start|><|image_pad|>*n_k<|vision_end|>`` for each image
k of the prompt, in order, + the contract prompt (data.contract.format_prompt), then the
assistant header. The tiny model uses no system prompt (its template adds none); a real Qwen
model keeps its own template, which adds Qwen's default system prompt.

Several images a prompt, as Qwen2.5-VL takes them: ``pixel_values`` concatenates every
image's patches (prompt 0's images, then prompt 1's, ...) and ``image_grid_thw`` has one row
per IMAGE, not per prompt; ``images_per_prompt`` says which rows are whose. The model pairs
them by order: the k-th run of ``<|image_pad|>`` tokens in the batch takes the k-th grid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from data.contract import format_prompt
from grpo.model.load import ModelBundle, first_line

# ----------------------------------------------------------------------------- prompt encoding


@dataclass
class PromptCounts:
    """What entered the model, and what did not, over one or more ``encode_prompts`` calls.

    Sums and maxima, so the counts of several draws (and of several ranks) add up; the
    training log line's "prompts" entry is ``record()`` of a step's draws.
    """

    prompts: int = 0  # prompts that entered the model
    visual_tokens: int = 0  # their visual tokens (one per 28x28 px of each resized image, all its images), summed
    visual_tokens_max: int = 0  # the most of one prompt
    tokens: int = 0  # their prompt tokens (visual included), summed
    tokens_max: int = 0
    resized_down: int = 0  # their images max_pixels shrank (fewer visual tokens than their size gives)
    resized_up: int = 0  # their images min_pixels enlarged
    skipped_long: int = 0  # prompts over max_prompt_tokens: skipped
    skipped_image: int = 0  # prompts an image of which failed to preprocess: skipped

    MAXIMA = ("visual_tokens_max", "tokens_max")  # combined by max; every other field by sum

    def add(self, other: PromptCounts | None) -> PromptCounts:
        """Fold ``other`` into these counts (in place); returns self."""
        if other is not None:
            for f in dataclasses.fields(self):
                a, b = getattr(self, f.name), getattr(other, f.name)
                setattr(self, f.name, max(a, b) if f.name in self.MAXIMA else a + b)
        return self

    def record(self) -> dict[str, Any]:
        """The log line's entry: means and maxima per prompt, counts of resized images and skips."""
        n = max(self.prompts, 1)
        return dict(n=self.prompts, visual_tokens=self.visual_tokens / n, visual_tokens_max=self.visual_tokens_max,
                    tokens=self.tokens / n, tokens_max=self.tokens_max, resized_down=self.resized_down,
                    resized_up=self.resized_up, skipped_long=self.skipped_long, skipped_image=self.skipped_image)


class NoPromptsLeft(ValueError):
    """Every prompt of an ``encode_prompts`` call was skipped (bad images, over the prompt cap).
    ``counts`` and ``skipped`` say which and why, so a caller can count them and draw again."""

    def __init__(self, message: str, skipped: list[tuple[int, str]], counts: PromptCounts):
        super().__init__(message)
        self.skipped, self.counts = skipped, counts


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
    image_grid_thw: torch.Tensor  # [n_images, 3] long, (t, h, w) patch grid per image (row b's after rows < b's)
    images_per_prompt: list[int] = field(default_factory=list)  # [B] images of each row (1 for most data)
    kept: list[int] = field(default_factory=list)  # input index of each row
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (input index, reason) of dropped inputs
    counts: PromptCounts = field(default_factory=PromptCounts)  # what entered the model and what did not

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of Qwen2_5_VLForConditionalGeneration.forward / generate."""
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                    mm_token_type_ids=self.mm_token_type_ids, pixel_values=self.pixel_values,
                    image_grid_thw=self.image_grid_thw)

    def to(self, device: str | torch.device) -> PromptBatch:
        moved = {k: v.to(device) for k, v in self.model_inputs().items()}
        return PromptBatch(**moved, images_per_prompt=list(self.images_per_prompt), kept=list(self.kept),
                           skipped=list(self.skipped), counts=self.counts)

    def repeated(self, G: int) -> dict[str, torch.Tensor]:
        """``model_inputs()`` with every prompt repeated G times, its images with it: what
        transformers' ``generate`` needs to sample G completions a prompt (the TRL way; the
        references the sampler and the log-prob passes are tested against). Rows b*G ..
        b*G+G-1 are prompt b, and each copy brings all of prompt b's images, in order."""
        inputs = {k: v.repeat_interleave(G, 0) for k, v in self.model_inputs().items()
                  if k not in ("pixel_values", "image_grid_thw")}
        grids = self.image_grid_thw.split(self.images_per_prompt)  # per prompt: [k_b, 3]
        patches = self.pixel_values.split([int(g.prod(-1).sum()) for g in grids])
        inputs["pixel_values"] = torch.cat([p for p in patches for _ in range(G)])
        inputs["image_grid_thw"] = torch.cat([g for g in grids for _ in range(G)])
        return inputs

    @property
    def n_image_tokens(self) -> torch.Tensor:
        """[B] visual tokens per row (t*h*w / merge^2)."""
        return self.mm_token_type_ids.sum(1)


def prompt_text(bundle: ModelBundle, question: str | None, n_images: int = 1) -> str:
    """The chat-formatted prompt with ONE <|image_pad|> placeholder per image (expanded later).

    The images come first, then the question (Qwen's own examples put them in this order).
    ``question=None``: a user turn that is only the image, the prompt of the warm-up's
    perception stage (the answer describes the picture; grpo/warmup/sft.py).
    """
    messages = []
    if bundle.system_prompt is not None:
        messages.append({"role": "system", "content": bundle.system_prompt})
    content = [{"type": "image"} for _ in range(n_images)]
    if question is not None:
        content.append({"type": "text", "text": format_prompt(question)})
    messages.append({"role": "user", "content": content})
    return bundle.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _as_pairs(items) -> list[tuple[list[Any], str]]:
    """Examples (``.prompt_images``, ``.question``) or an (images, questions) pair, an entry of
    images one image or a list of a prompt's images -> [(the prompt's images, question)]."""
    if isinstance(items, tuple) and len(items) == 2 and isinstance(items[1], (list, tuple)):
        images, questions = items
        if len(images) != len(questions):
            raise ValueError(f"encode_prompts: {len(images)} images but {len(questions)} questions")
        return [(list(im) if isinstance(im, (list, tuple)) else [im], q) for im, q in zip(images, questions)]
    return [(ex.prompt_images if hasattr(ex, "prompt_images") else [getattr(ex, "image", None)],
             getattr(ex, "question", None)) for ex in items]


def _preprocess_images(bundle: ModelBundle, images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's images -> (patches [sum_k n_k, 1176], grid_thw [k, 3]), each image resized on
    its own (the pixel bounds apply per image). Raises ValueError with the reason."""
    if not images or any(image is None for image in images):
        raise ValueError("no image (Example.image is None: decode it before encoding)")
    try:
        out = bundle.image_processor(images=images, return_tensors="pt")
    except Exception as e:  # PIL and numpy errors vary; the caller needs one reason string
        raise ValueError(f"image preprocessing failed ({first_line(e)})") from None
    return out["pixel_values"], out["image_grid_thw"]


def _image_hw(image) -> tuple[int, int] | None:
    """(height, width) of a PIL image or an array the processor accepts; None if unknown."""
    if hasattr(image, "height") and hasattr(image, "width"):  # PIL
        return int(image.height), int(image.width)
    try:
        from transformers.image_utils import get_image_size, to_numpy_array

        return tuple(int(x) for x in get_image_size(to_numpy_array(image)))
    except Exception:  # noqa: BLE001 -- only a statistic depends on it
        return None


def resize_direction(bundle: ModelBundle, image, grid: torch.Tensor) -> int:
    """-1 if the processor's max_pixels shrank ``image``, +1 if its min_pixels enlarged it, else 0.

    Qwen's smart resize first rounds both sides to multiples of 28 px (patch 14 x merge 2)
    and rescales only when that rounded area leaves [min_pixels, max_pixels]; so a bound
    acted exactly when the patch grid's area differs from the rounded one.
    """
    hw = _image_hw(image)
    if hw is None:
        return 0
    patch = int(bundle.image_processor.patch_size)
    factor = patch * int(bundle.image_processor.merge_size)
    rounded = round(hw[0] / factor) * factor * round(hw[1] / factor) * factor
    area = int(grid[1]) * int(grid[2]) * patch * patch
    return -1 if area < rounded else (1 if area > rounded else 0)


def _prompt_tokens(bundle: ModelBundle, question: str | None, n_images: int, grid: torch.Tensor,
                   i: int) -> tuple[list[int], int]:
    """(token ids, visual tokens) of one prompt: its chat text with each image's placeholder
    expanded to the image's visual tokens (one per 2x2 group of patches, ``grid`` [k, 3])."""
    image_pad = "<|image_pad|>"
    text = prompt_text(bundle, question, n_images)
    per_image = (grid.prod(-1) // bundle.merge_size**2).tolist()  # one LM token per 2x2 group of patches
    # The k-th placeholder becomes image k's tokens (splitting first: a replaced run would
    # be found again by the next replace).
    parts = text.split(image_pad)
    if len(parts) != n_images + 1:
        raise ValueError(f"encode_prompts: item {i}: the chat template wrote {len(parts) - 1} image placeholders "
                         f"for {n_images} images")
    text = parts[0] + "".join(image_pad * n + part for n, part in zip(per_image, parts[1:]))
    return bundle.tokenizer(text, add_special_tokens=False)["input_ids"], sum(per_image)


def _left_padded(rows: list[list[int]], P: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, P] of token rows padded on the left to P."""
    input_ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), P), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, P - len(r):] = torch.tensor(r, dtype=torch.long)
        attention_mask[b, P - len(r):] = 1
    return input_ids, attention_mask


def encode_prompts(
    bundle: ModelBundle,
    items,
    *,
    on_bad_image: str = "raise",
    image_only: bool = False,
    max_prompt_tokens: int | None = None,
) -> PromptBatch:
    """Tokenise B (images, question) prompts into one left-padded batch.

    ``items``: a sequence of Examples (``.prompt_images`` PIL images, ``.question``) or a tuple
    ``(images, questions)``, an entry of ``images`` one image or a list of them. A prompt that
    cannot enter the model -- an image of it fails to preprocess, or it is longer than
    ``max_prompt_tokens`` (None: the bundle's cap; 0: no cap; the visual tokens of all its
    images included) -- is, with ``on_bad_image="skip"``, dropped and recorded
    in ``.skipped`` and ``.counts`` (training goes on); with "raise" (default) it is one
    ValueError naming the example. Every prompt skipped: ``NoPromptsLeft``. ``image_only``:
    prompts without the question (the warm-up's perception stage).
    """
    if on_bad_image not in ("raise", "skip"):
        raise ValueError(f"on_bad_image={on_bad_image!r}; use 'raise' or 'skip'")
    pairs = _as_pairs(items)
    if not pairs:
        raise ValueError("encode_prompts: no prompts given")
    cap = getattr(bundle, "max_prompt_tokens", 0) if max_prompt_tokens is None else int(max_prompt_tokens)
    rows, pixels, grids, kept, skipped, counts = [], [], [], [], [], PromptCounts()
    for i, (images, question) in enumerate(pairs):
        if not image_only and (not isinstance(question, str) or not question.strip()):
            raise ValueError(f"encode_prompts: item {i} has no question text (got {question!r})")
        try:
            patches, grid = _preprocess_images(bundle, images)  # grid [k, 3]: one row per image
        except ValueError as e:
            if on_bad_image == "raise":
                raise ValueError(f"encode_prompts: item {i}: {e}; fix the image or pass on_bad_image='skip'") from None
            skipped.append((i, str(e)))
            counts.skipped_image += 1
            continue
        row, n_vis = _prompt_tokens(bundle, None if image_only else question, len(images), grid, i)
        if cap and len(row) > cap:  # the memory bound: a longer prompt never reaches the model
            why = f"prompt of {len(row)} tokens ({n_vis} visual) > max_prompt_tokens={cap}"
            if on_bad_image == "raise":
                raise ValueError(f"encode_prompts: item {i}: {why}; raise --model.max_prompt_tokens, lower "
                                 "--model.max_pixels, or pass on_bad_image='skip'")
            skipped.append((i, why))
            counts.skipped_long += 1
            continue
        rows.append(row)
        pixels.append(patches)
        grids.append(grid)
        kept.append(i)
        directions = [resize_direction(bundle, image, g) for image, g in zip(images, grid)]
        counts.add(PromptCounts(prompts=1, visual_tokens=n_vis, visual_tokens_max=n_vis, tokens=len(row),
                                tokens_max=len(row), resized_down=sum(d < 0 for d in directions),
                                resized_up=sum(d > 0 for d in directions)))
    if not rows:
        what = "every image failed to preprocess" if not counts.skipped_long else "no prompt could enter the model"
        raise NoPromptsLeft(f"encode_prompts: {what}: {skipped}", skipped, counts)
    P = max(len(r) for r in rows)  # the padded prompt length
    if P > bundle.context_length:
        raise ValueError(f"encode_prompts: a prompt is {P} tokens, longer than the model's context "
                         f"({bundle.context_length}); shorten the question, lower --model.max_pixels "
                         "or set --model.max_prompt_tokens")
    input_ids, attention_mask = _left_padded(rows, P, bundle.pad_token_id)
    mm_token_type_ids = (input_ids == bundle.image_token_id).to(torch.long) * attention_mask
    return PromptBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        pixel_values=torch.cat(pixels, 0).to(bundle.model.dtype),
        image_grid_thw=torch.cat(grids, 0),
        images_per_prompt=[g.shape[0] for g in grids],
        kept=kept,
        skipped=skipped,
        counts=counts,
    )
