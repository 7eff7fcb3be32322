"""The embedded tiny Qwen2.5-VL: its architecture, its tokenizer corpus, and the deterministic
build of ``tiny-random`` (random weights, cached on first use)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from data.synthetic import tokenizer_corpus
from grpo_infra.atomic import new_directory

TINY_NAME = "tiny"
TINY_RANDOM_NAME = "tiny-random"  # the same architecture, random weights: what pretraining starts from
TINY_VERSION = "tiny-qwen2.5-vl-v1"  # bump when the build procedure changes (the architecture and
# the tokenizer's corpus are in the cache key already: _build_fingerprint)
TINY_IMAGE_SIZE = 112  # px; 112/14 = 8x8 = 64 patches -> 16 visual tokens after the 2x2 merge
MODEL_FILES = ("config.json", "model.safetensors")  # what a built copy must hold besides the tokenizer

# The tiny architecture. Text: 4 layers, d=128, GQA 4 query / 2 KV heads of dim 32;
# M-RoPE sections [4, 6, 6] are Qwen's [16, 24, 24] scaled to head_dim 32 (sum = 32/2).
# Vision: 4 blocks, d=128, MLP 512, the last one full attention; with 112 px images one
# attention window covers the image, so the windowed and the full-attention blocks compute
# the same thing (both paths still run). The tower was 2 blocks of d=64 until the
# measurements of bench/EXPERIMENTS.md sections 15 and 21: pretrained the same way, this
# one gave +0.03 test EM after GRPO over 3 seeds, for 5 MB more of weights.
TINY_TEXT = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    rms_norm_eps=1e-6,
)
TINY_VISION = dict(
    depth=4,
    hidden_size=128,
    intermediate_size=512,
    num_heads=4,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[3],
)
TINY_VOCAB = 1024


# ----------------------------------------------------------------------------- building the tiny model


def _tokenizer_corpus(n: int = 3000, seed: int = 0) -> tuple[list[str], str]:
    """(corpus, source name): the synthetic curriculum's own text (data/synthetic.py)."""
    return list(tokenizer_corpus(n, seed)), "synthetic"


def _tiny_config(tokenizer) -> Any:
    """A Qwen2_5_VLConfig whose token ids are read from ``tokenizer`` (never hard-coded)."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|image_pad|>",
                                                           "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    text = dict(TINY_TEXT, vocab_size=len(tokenizer), bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    vision = dict(TINY_VISION, out_hidden_size=TINY_TEXT["hidden_size"])
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def tiny_image_processor(image_size: int = TINY_IMAGE_SIZE):
    """Qwen2-VL's PIL image processor capped at image_size^2 pixels (112 px -> 8x8 patches)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # Qwen's resize keeps the aspect ratio and rounds sides to multiples of 28 px within
    # [shortest_edge, longest_edge] *pixels* (area, despite the names).
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": image_size * image_size})


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, corpus: Sequence[str] | None = None) -> Path:
    """Build the tiny model + tokenizer + image processor into ``out_dir``; deterministic in seed and corpus.

    ``corpus`` defaults to ``data.synthetic.tokenizer_corpus(3000, seed)``. Returns ``out_dir``.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    from grpo.model.tokenizer import train_bpe, wrap_for_transformers

    out = Path(out_dir)
    source = "given"
    if corpus is None:
        corpus, source = _tokenizer_corpus(3000, seed)
    # The chat scaffolding is text the model reads on every example: let BPE see it.
    chat_words = ["user\n", "assistant\n", "system\n"] * 50
    tokenizer = wrap_for_transformers(train_bpe(list(corpus) + chat_words, vocab_size=TINY_VOCAB))
    config = _tiny_config(tokenizer)

    # Weight init draws from the global RNG; fork it so building never perturbs the caller.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    out.mkdir(parents=True, exist_ok=True)
    # Once a torch.distributed process group exists, transformers' save_pretrained writes the
    # config and weights on rank 0 only (it assumes the ranks share one model, so that one
    # writer is enough) and returns quietly elsewhere. This copy is each process's own: in a data-parallel run all
    # ranks build the cache at once, and when rank 1 won the race to rename its copy into place
    # the cache held a tokenizer but no config or weights, and every later load failed.
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(out)
    missing = [f for f in MODEL_FILES if not (out / f).is_file()]
    if missing:
        raise RuntimeError(f"building the tiny model wrote no {', '.join(missing)} in {out}")
    tokenizer.save_pretrained(out)
    tiny_image_processor().save_pretrained(out)
    meta = {"version": TINY_VERSION, "seed": seed, "corpus": source, "corpus_size": len(corpus),
            "n_params": sum(p.numel() for p in model.parameters())}
    (out / "vlgrpo_build.json").write_text(json.dumps(meta, indent=2))
    return out


# What a complete cached build holds (the marker is written last, but a later deletion can
# leave it behind without the weights).
BUILD_FILES = MODEL_FILES + ("tokenizer.json", "preprocessor_config.json", "vlgrpo_build.json")


@functools.lru_cache(maxsize=None)
def _build_fingerprint(seed: int) -> str:
    """First 10 hex digits of sha256 over the architecture and the default tokenizer corpus
    (memoised per process)."""
    corpus, source = _tokenizer_corpus(3000, seed)
    h = hashlib.sha256(json.dumps([TINY_TEXT, TINY_VISION, TINY_VOCAB], sort_keys=True).encode())
    h.update(source.encode())
    for text in corpus:
        h.update(text.encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()[:10]


def _cache_name(seed: int) -> str:
    """The cache entry's name: the build's version and fingerprint, and the seed if not 0."""
    return f"{TINY_VERSION}-{_build_fingerprint(seed)}" + ("" if seed == 0 else f"-seed{seed}")


def default_model_dir(seed: int = 0) -> Path:
    """The cached tiny model directory, built on first use.

    $VLGRPO_CACHE (else ~/.cache/vlgrpo) / tiny-qwen2.5-vl-v1-<fingerprint>[-seedN].
    The fingerprint covers the architecture (TINY_TEXT, TINY_VISION, TINY_VOCAB) and the
    tokenizer's corpus, because the build depends on both: if either changes (a wider
    tower, new text in data/synthetic.py), a new model is built next to the old one instead
    of a cached copy of the old architecture being used. Building goes to a
    temporary directory renamed into place, so several processes starting at once never
    see a half-written model.
    """
    root = Path(os.environ.get("VLGRPO_CACHE", Path.home() / ".cache" / "vlgrpo"))
    target = root / _cache_name(seed)
    if all((target / f).is_file() for f in BUILD_FILES):
        return target
    if target.exists():  # a damaged entry (a file deleted by hand or by a full disk): build it again
        shutil.rmtree(target, ignore_errors=True)
    try:
        with new_directory(target) as tmp:
            build_tiny_model(tmp, seed=seed)
    except OSError:  # another process won the race (its copy took the name first): use its copy
        if not all((target / f).is_file() for f in BUILD_FILES):
            raise
    return target
