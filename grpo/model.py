"""The policy model: the embedded tiny Qwen2.5-VL, or a real one, plus prompt encoding.

Three sources, one loader (``load_bundle``):

- ``"tiny"`` (default): a ~1.4M-parameter ``Qwen2_5_VLForConditionalGeneration`` -- the very
  class of the 7B, so the vision tower, the 2x2 patch merger and the multimodal rotary
  positions (M-RoPE) are the real code paths -- pretrained once by ``python -m
  grpo.pretrain`` (perception labels, captions, worked reasoning; about an hour on 2 CPU
  cores) and shipped in ``grpo/tiny_model/`` with a model card and a sha256 manifest that
  every load checks (grpo/shipped.py). GRPO starts from it as a real run starts from
  Qwen2.5-VL-7B-Instruct: a model that reads its images and follows the answer contract
  only part of the time.
- ``"tiny-random"``: the same architecture with random weights and a tokenizer trained here
  (grpo/tokenizer.py), built deterministically on first use into a cache directory
  ($VLGRPO_CACHE, else ~/.cache/vlgrpo) as an ordinary ``save_pretrained`` directory
  (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat
  template, preprocessor_config.json). It is what the pretraining starts from, and what
  tests use when they need a model in seconds; its weights depend on ``seed``.
- a local directory or hub id of Qwen2.5-VL-*-Instruct (e.g. Qwen/Qwen2.5-VL-7B-Instruct),
  on machines that have it. Without hub access a hub id fails with one clear message.

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

import functools
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data.contract import format_prompt, format_response
from grpo import shipped

TINY_NAME = "tiny"
TINY_RANDOM_NAME = "tiny-random"  # the same architecture, random weights: what pretraining starts from
TINY_VERSION = "tiny-qwen2.5-vl-v1"  # bump when the config, tokenizer or corpus changes
TINY_IMAGE_SIZE = 112  # px; 112/14 = 8x8 = 64 patches -> 16 visual tokens after the 2x2 merge

# The tiny architecture. Text: 4 layers, d=128, GQA 4 query / 2 KV heads of dim 32;
# M-RoPE sections [4, 6, 6] are Qwen's [16, 24, 24] scaled to head_dim 32 (sum = 32/2).
# Vision: 2 blocks, d=64; with 112 px images one attention window covers the image, so
# the windowed and the full-attention block compute the same thing (both paths still run).
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
    depth=2,
    hidden_size=64,
    intermediate_size=256,
    num_heads=4,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[1],
)
TINY_VOCAB = 1024


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


# ----------------------------------------------------------------------------- building the tiny model


def _contract_corpus(n: int, seed: int) -> list[str]:
    """A fallback tokenizer corpus made from the contract alone (used if data.synthetic is absent)."""
    rng = random.Random(seed)
    colors = ["red", "blue", "green", "yellow", "purple", "orange", "gray", "black"]
    shapes = ["circles", "squares", "triangles", "stars", "bars", "points", "cubes"]
    out = []
    for _ in range(n):
        c, s, k = rng.choice(colors), rng.choice(shapes), rng.randint(0, 99)
        out.append(format_prompt(f"How many {c} {s} are there in the image?"))
        out.append(format_response(f"I count the {c} {s}: there are {k} of them.", str(k)))
    return out


def _tokenizer_corpus(n: int = 3000, seed: int = 0) -> tuple[list[str], str]:
    """(corpus, source name). The synthetic curriculum's own text when it is available."""
    if _corpus_source() == "contract":
        return _contract_corpus(n, seed), "contract"
    from data.synthetic import tokenizer_corpus

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

    ``corpus`` defaults to ``data.synthetic.tokenizer_corpus(3000, seed)`` (or, if that
    module is missing, a corpus from the contract templates). Returns ``out_dir``.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    from grpo.tokenizer import train_bpe, wrap_for_transformers

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
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tiny_image_processor().save_pretrained(out)
    meta = {"version": TINY_VERSION, "seed": seed, "corpus": source, "corpus_size": len(corpus),
            "n_params": sum(p.numel() for p in model.parameters())}
    (out / "vlgrpo_build.json").write_text(json.dumps(meta, indent=2))
    return out


@functools.lru_cache(maxsize=None)
def _corpus_fingerprint(seed: int) -> str:
    """First 10 hex digits of sha256 over the default tokenizer corpus (memoised per process)."""
    corpus, source = _tokenizer_corpus(3000, seed)
    h = hashlib.sha256(source.encode())
    for text in corpus:
        h.update(text.encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()[:10]


def default_model_dir(seed: int = 0) -> Path:
    """The cached tiny model directory, built on first use.

    $VLGRPO_CACHE (else ~/.cache/vlgrpo) / tiny-qwen2.5-vl-v1-<corpus fingerprint>[-seedN].
    The fingerprint of the tokenizer corpus is in the name because the tokenizer is
    trained on it: if data/synthetic.py changes its text, a new tokenizer (and model) is
    built next to the old one instead of silently mixing the two. Building goes to a
    temporary directory renamed into place, so several processes starting at once never
    see a half-written model.
    """
    root = Path(os.environ.get("VLGRPO_CACHE", Path.home() / ".cache" / "vlgrpo"))
    name = f"{TINY_VERSION}-{_corpus_fingerprint(seed)}" + ("" if seed == 0 else f"-seed{seed}")
    target = root / name
    if (target / "vlgrpo_build.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=name + ".tmp-", dir=root))
    try:
        build_tiny_model(tmp, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: use its copy
            if not (target / "vlgrpo_build.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _corpus_source() -> str:
    """'synthetic' once data/synthetic.py provides tokenizer_corpus, else 'contract'."""
    try:
        import data.synthetic
    except ModuleNotFoundError as e:
        if e.name != "data.synthetic":
            raise  # the module exists but is broken: say so, don't silently fall back
        return "contract"
    return "synthetic" if hasattr(data.synthetic, "tokenizer_corpus") else "contract"


# ----------------------------------------------------------------------------- loading


def _looks_like_hub_id(name: str) -> bool:
    """'org/name' with no local meaning: not absolute, not ./ or ~, exactly one slash."""
    return not name.startswith((".", "/", "~")) and name.count("/") == 1 and not os.path.exists(name)


def _first_line(e: BaseException) -> str:
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
        raise ModelLoadError(f"could not read the model config from {where} ({_first_line(e)}); pass 'tiny', "
                             "a Qwen2.5-VL save_pretrained directory or a hub id") from None
    with torch.device("meta"):
        return Qwen2_5_VLForConditionalGeneration(config)


def load_bundle(
    name_or_path: str = TINY_NAME,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    max_pixels: int | None = None,
    attn_implementation: str = "sdpa",
) -> ModelBundle:
    """Load model, tokenizer and image processor from 'tiny', a local directory or a hub id.

    ``max_pixels`` caps the image area for real models (Qwen's default, 12.8M px, turns one
    photo into thousands of visual tokens); ``seed`` selects the tiny build. Every failure
    is one ModelLoadError naming what was wrong and what to do.
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
        raise ModelLoadError(f"could not load the tokenizer from {where} ({_first_line(e)}); {fix}") from None
    missing = [t for t in ("<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
               if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ModelLoadError(f"the tokenizer in {where} lacks Qwen2.5-VL's tokens {missing}; "
                             "pass a Qwen2.5-VL model directory or 'tiny'")
    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(src, **kw)
    except Exception as e:
        fix = f"rebuild it (delete {src} and load 'tiny' again)" if local else fix_hub
        raise ModelLoadError(f"could not load the image processor from {where} ({_first_line(e)}); {fix}") from None
    if max_pixels is not None:
        image_processor.size = {"shortest_edge": min(56 * 56, max_pixels), "longest_edge": int(max_pixels)}
    try:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            src, dtype=dtype, attn_implementation=attn_implementation, **kw
        )
    except Exception as e:
        fix = f"rebuild it (delete {src} and load 'tiny' again)" if local else fix_hub
        raise ModelLoadError(f"could not load the model weights from {where} ({_first_line(e)}); {fix}") from None
    if model.config.image_token_id != tokenizer.convert_tokens_to_ids("<|image_pad|>"):
        raise ModelLoadError(f"{where}: config.image_token_id={model.config.image_token_id} disagrees with the "
                             "tokenizer's <|image_pad|>; the directory mixes two models")
    model.to(device)
    model.eval()  # no dropout anywhere: sampling and log-probs must see the same function
    return ModelBundle(model=model, tokenizer=tokenizer, image_processor=image_processor,
                       source=str(name_or_path) if str(name_or_path) in (TINY_NAME, TINY_RANDOM_NAME) else src)


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
    perception stage (the answer describes the picture; grpo/sft.py).
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
        raise ValueError(f"image preprocessing failed ({_first_line(e)})") from None
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
