"""Loading the model: the embedded tiny Qwen2.5-VL, or a real one, with its tokenizer and image processor.

Three sources, one loader (``load_bundle``):

- ``"tiny"`` (default): a ~1.4M-parameter ``Qwen2_5_VLForConditionalGeneration`` -- the very
  class of the 7B, so the vision tower, the 2x2 patch merger and the multimodal rotary
  positions (M-RoPE) are the real code paths -- pretrained once by ``python -m
  grpo.pretrain`` (perception labels, captions, worked reasoning; about an hour on 2 CPU
  cores) and shipped in ``grpo/tiny_model/`` with a model card and a sha256 manifest that
  every load checks (grpo/model/shipped.py). GRPO starts from it as a real run starts from
  Qwen2.5-VL-7B-Instruct: a model that reads its images and follows the answer contract
  only part of the time.
- ``"tiny-random"``: the same architecture with random weights and a tokenizer trained here
  (grpo/model/tokenizer.py), built deterministically on first use into a cache directory
  ($VLGRPO_CACHE, else ~/.cache/vlgrpo) as an ordinary ``save_pretrained`` directory
  (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat
  template, preprocessor_config.json). It is what the pretraining starts from, and what
  tests use when they need a model in seconds; its weights depend on ``seed``.
- a local directory or hub id of Qwen2.5-VL-*-Instruct (e.g. Qwen/Qwen2.5-VL-7B-Instruct),
  on machines that have it. Without hub access a hub id fails with one clear message.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.model import shipped
from grpo.model.tiny import TINY_NAME, TINY_RANDOM_NAME, default_model_dir


class ModelLoadError(RuntimeError):
    """The model, tokenizer or image processor could not be loaded; the message says why."""


# ----------------------------------------------------------------------------- bundle


@dataclass
class ModelBundle:
    """A model with the tokenizer and image processor that belong to it."""

    model: Any  # Qwen2_5_VLForConditionalGeneration
    tokenizer: Any  # transformers tokenizer (TokenizersBackend), padding side left
    image_processor: Any  # Qwen2VLImageProcessorPil
    source: str  # "tiny" or the directory / hub id it came from
    system_prompt: str | None = None  # None: whatever the chat template does by default
    max_prompt_tokens: int = 0  # longer prompts (visual tokens included) never enter the model; 0 = no cap

    @property
    def pixel_bounds(self) -> tuple[int, int]:
        """(min_pixels, max_pixels): the image area range Qwen's resize keeps images in."""
        size = self.image_processor.size
        return int(size["shortest_edge"]), int(size["longest_edge"])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_id(self) -> int:
        """<|im_end|>: the end of an assistant turn, where sampling stops."""
        return int(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)

    @property
    def merge_size(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    @property
    def context_length(self) -> int:
        return int(self.model.config.text_config.max_position_embeddings)

    def decode(self, ids: Sequence[int]) -> str:
        """Completion text without special tokens (contract tags are kept: not special)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------- loading


def _looks_like_hub_id(name: str) -> bool:
    """'org/name' with no local meaning: not absolute, not ./ or ~, exactly one slash."""
    return not name.startswith((".", "/", "~")) and name.count("/") == 1 and not os.path.exists(name)


def first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


def _resolve_source(name_or_path: str, seed: int) -> tuple[str, bool]:
    """(path or hub id, is_local)."""
    if name_or_path == TINY_NAME:  # the pretrained model shipped in the package, checked file by file
        try:
            return str(shipped.verify()), True
        except shipped.ShippedModelError as err:
            raise ModelLoadError(str(err)) from None
    if name_or_path == TINY_RANDOM_NAME:
        return str(default_model_dir(seed)), True
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model directory {str(path)!r} has no config.json; pass 'tiny' or a save_pretrained "
                "directory of a Qwen2.5-VL model (config.json, *.safetensors, tokenizer files)"
            )
        return str(path), True
    if _looks_like_hub_id(name_or_path):
        return name_or_path, False
    raise ModelLoadError(
        f"model path {name_or_path!r} does not exist; pass 'tiny' (the embedded model), an existing "
        "local directory, or a hub id such as 'Qwen/Qwen2.5-VL-7B-Instruct'"
    )


def check_model_source(name_or_path: str) -> None:
    """A ModelLoadError now if the name can mean no model; loads and builds nothing."""
    if str(name_or_path) != TINY_RANDOM_NAME:  # built on first use: nothing to check before
        _resolve_source(str(name_or_path), 0)


def model_skeleton(name_or_path: str = TINY_NAME, seed: int = 0) -> torch.nn.Module:
    """The model's module tree on the meta device: no weights, a fraction of a second even
    for the 7B. Lets a run check its LoRA targets before it loads (or trains) anything."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    src, local = _resolve_source(str(name_or_path), seed)
    where = f"directory {src!r}" if local else f"hub id {src!r}"
    try:
        config = AutoConfig.from_pretrained(src, **(dict(local_files_only=True) if local else {}))
    except Exception as e:  # transformers raises OSError, ValueError, hub errors...: one line for all
        raise ModelLoadError(f"could not read the model config from {where} ({first_line(e)}); pass 'tiny', "
                             "a Qwen2.5-VL save_pretrained directory or a hub id") from None
    with torch.device("meta"):
        return Qwen2_5_VLForConditionalGeneration(config)


def set_input_bounds(bundle: ModelBundle, max_pixels: int = 0, min_pixels: int = 0,
                     max_prompt_tokens: int | None = None) -> ModelBundle:
    """Bound what enters the model: the image area range and the prompt length, in place.

    ``max_pixels`` / ``min_pixels`` are Qwen's own knobs, set on the image processor, whose
    resize (``smart_resize``) keeps the aspect ratio, rounds both sides to multiples of 28 px
    and scales an image whose rounded area leaves [min_pixels, max_pixels] into it: one
    visual token per 28x28 px, so max_pixels / 784 bounds the visual tokens of one image.
    0 keeps the processor's value (the checkpoint's preprocessor_config.json; Qwen2.5-VL
    ships 12845056, up to 16384 visual tokens per image). With max_pixels alone, a larger
    processor min_pixels is lowered to it: smart_resize checks the max first and would
    otherwise upscale a small image past the max. ``max_prompt_tokens``: None keeps the
    bundle's cap, 0 removes it (grpo.model.prompts.encode_prompts enforces it).
    """
    if max_pixels or min_pixels:
        lo, hi = bundle.pixel_bounds
        if max_pixels:
            hi, lo = int(max_pixels), min(lo, int(max_pixels))
        if min_pixels:
            if min_pixels > hi:
                raise ModelLoadError(f"model.min_pixels={min_pixels} is above the image processor's max_pixels={hi}; "
                                     f"lower it or set --model.max_pixels as well")
            lo = int(min_pixels)
        bundle.image_processor.size = {"shortest_edge": lo, "longest_edge": hi}
    if max_prompt_tokens is not None:
        bundle.max_prompt_tokens = int(max_prompt_tokens)
    return bundle


def load_bundle(
    name_or_path: str = TINY_NAME,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    max_pixels: int = 0,
    min_pixels: int = 0,
    max_prompt_tokens: int = 0,
    attn_implementation: str = "sdpa",
) -> ModelBundle:
    """Load model, tokenizer and image processor from 'tiny', a local directory or a hub id.

    ``max_pixels`` / ``min_pixels`` / ``max_prompt_tokens`` bound what enters the model
    (``set_input_bounds``; 0 = the checkpoint's processor config, no prompt cap): Qwen's
    default max, 12.8M px, turns one photo into thousands of visual tokens. ``seed``
    selects the tiny build. Every failure is one ModelLoadError naming what was wrong and
    what to do.
    """
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    src, local = _resolve_source(str(name_or_path), seed)
    where = f"directory {src!r}" if local else f"hub id {src!r}"
    # Offline, a hub id can only come from the local HF cache; say so instead of a socket error.
    kw = dict(local_files_only=True) if local else {}
    fix_hub = ("download it on a machine with hub access (e.g. `hf download "
               f"{src} --local-dir DIR`) and pass DIR, or use 'tiny'")
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, padding_side="left", **kw)
    except Exception as e:
        fix = f"rebuild it (delete {src} and load 'tiny' again)" if local else fix_hub
        raise ModelLoadError(f"could not load the tokenizer from {where} ({first_line(e)}); {fix}") from None
    missing = [t for t in ("<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
               if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ModelLoadError(f"the tokenizer in {where} lacks Qwen2.5-VL's tokens {missing}; "
                             "pass a Qwen2.5-VL model directory or 'tiny'")
    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(src, **kw)
    except Exception as e:
        fix = f"rebuild it (delete {src} and load 'tiny' again)" if local else fix_hub
        raise ModelLoadError(f"could not load the image processor from {where} ({first_line(e)}); {fix}") from None
    try:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            src, dtype=dtype, attn_implementation=attn_implementation, **kw
        )
    except Exception as e:
        fix = f"rebuild it (delete {src} and load 'tiny' again)" if local else fix_hub
        raise ModelLoadError(f"could not load the model weights from {where} ({first_line(e)}); {fix}") from None
    if model.config.image_token_id != tokenizer.convert_tokens_to_ids("<|image_pad|>"):
        raise ModelLoadError(f"{where}: config.image_token_id={model.config.image_token_id} disagrees with the "
                             "tokenizer's <|image_pad|>; the directory mixes two models")
    model.to(device)
    model.eval()  # no dropout anywhere: sampling and log-probs must see the same function
    bundle = ModelBundle(model=model, tokenizer=tokenizer, image_processor=image_processor,
                         source=str(name_or_path) if str(name_or_path) in (TINY_NAME, TINY_RANDOM_NAME) else src)
    return set_input_bounds(bundle, max_pixels, min_pixels, max_prompt_tokens)
