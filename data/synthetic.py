"""Entry points of the synthetic visual-numeric curriculum (MathVista schema, pillow images).

    generate(split, stage, n, seed, image_size)   -> list[Example]
    curriculum(split, n_per_stage, seed, image_size) -> {1: [...], 2: [...], 3: [...]}
    tokenizer_corpus(n, seed)                     -> texts for training a BPE tokenizer

Three families of tasks, one per curriculum stage (docs/design.md, section 3; the stage filters
in data/stages.py select them, and also MathVista rows):

    stage 1  easy    synthetic scenes and tables, integer answers       data/gen_stage1.py
    stage 2  middle  bar / line charts, tables, a scientific figure,
                     integer and float answers                          data/gen_stage2.py
    stage 3  hard    grid geometry, region sums, metro-map hops,
                     multi-step answers                                 data/gen_stage3.py

Determinism: example ``index`` of (seed, split, stage) is drawn from its own
``random.Random`` seeded by the string "seed/split/stage/index/attempt" (Python seeds a
string through SHA-512, so this is stable across processes and machines), so any
example can be regenerated alone and the same arguments always give the same pixels.

Disjoint splits by construction: a family's params fix both the picture and the question,
so ``family + canonical JSON of params`` is the example's content key. The key is hashed
(BLAKE2b, no seed involved) into [0, 1): train below .8, val below .9, test above. A
candidate whose bucket is another split is rejected and the next attempt drawn, so no
content key, hence no (image, question) pair, can appear in two splits, for any seeds.
Rejection only re-samples params (microseconds); only the accepted candidate is drawn.
What this does NOT promise: that test questions use unseen *templates* or unseen count
combinations. The split is at the level of exact instances, as in CLEVR-style datasets.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from typing import Any

from data.contract import (
    INSTRUCTION,
    REASONING_CLOSE,
    REASONING_OPEN,
    SOLUTION_CLOSE,
    SOLUTION_OPEN,
    format_prompt,
    format_response,
)
from data.gen_common import Annotation, Family
from data.gen_stage1 import FAMILIES as STAGE1
from data.gen_stage2 import FAMILIES as STAGE2
from data.gen_stage3 import FAMILIES as STAGE3
from data.schema import Example

SPLITS = ("train", "val", "test")
_BUCKET_EDGES = {"train": (0.0, 0.8), "val": (0.8, 0.9), "test": (0.9, 1.0)}
DIFFICULTY = {1: "easy", 2: "middle", 3: "hard"}
_FAMILIES = {1: STAGE1, 2: STAGE2, 3: STAGE3}
MAX_ATTEMPTS = 1000  # a test-split example needs ~10 on average


def families(stage: int) -> tuple[Family, ...]:
    """The families of one curriculum stage."""
    if stage not in _FAMILIES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    return _FAMILIES[stage]


def content_key(family: str, params: dict[str, Any]) -> str:
    """Canonical identity of an example: same key <=> same image and question."""
    return family + ":" + json.dumps(params, sort_keys=True, separators=(",", ":"))


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


def split_of(key: str) -> str:
    """Which split a content key belongs to (a pure function of the key)."""
    u = int.from_bytes(_digest(key), "big") / 2.0**64
    return next(s for s, (lo, hi) in _BUCKET_EDGES.items() if lo <= u < hi)


def _check(split: str, stage: int, n: int, seed: int, image_size: int = 112) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    families(stage)  # validates the stage
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if not isinstance(image_size, int) or image_size < 32:
        raise ValueError(f"image_size must be an int >= 32 pixels, got {image_size!r}")


def _draw(split: str, stage: int, index: int, seed: int) -> tuple[Family, dict[str, Any], str]:
    """Params of example ``index``: rejection-sample until the content key hashes to ``split``."""
    fams = families(stage)
    family = fams[index % len(fams)]  # round-robin: every prefix of the list is balanced
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"{seed}/{split}/{stage}/{index}/{attempt}")
        params = family.sample(rng)
        key = content_key(family.name, params)
        if split_of(key) == split:
            return family, params, key
    raise RuntimeError(f"family {family.name!r} found no {split} example in {MAX_ATTEMPTS} attempts")


def _drafts(split: str, stage: int, n: int, seed: int) -> Iterator[tuple[Family, dict, str, Annotation]]:
    for i in range(n):
        family, params, key = _draw(split, stage, i, seed)
        yield family, params, key, family.annotate(params)


def generate(split: str, stage: int, n: int, seed: int = 0, image_size: int = 112) -> list[Example]:
    """``n`` examples of one stage and split, deterministic by (seed, split, stage, index)."""
    _check(split, stage, n, seed, image_size)
    out = []
    for i, (family, params, key, a) in enumerate(_drafts(split, stage, n, seed)):
        image = family.render(params, image_size)
        metadata = {
            "context": a.context, "skills": list(a.skills), "grade": a.grade,
            "language": "english", "source": "synthetic", "dataset": "synthetic",
            "category": "math-targeted-vqa", "task": a.task,
            "img_width": image_size, "img_height": image_size,
            "stage": stage, "split": split, "family": family.name, "seed": seed, "index": i,
            "content_key": _digest(key).hex(),  # what the split bucket was drawn from
        }
        sol = a.solution
        out.append(Example(
            pid=f"syn-{split}-s{stage}-{seed}-{i}", question=a.question, answer=sol.answer,
            answer_type=a.answer_type, precision=a.precision, question_type="free_form",
            metadata=metadata, image=image, unit=a.unit, reasoning=sol.reasoning,
            key_steps=sol.key_steps, intermediates=sol.intermediates, difficulty=DIFFICULTY[stage],
            hops=sol.hops, rubrics=sol.rubrics, marks=list(image.info.get("marks", [])),
            caption=family.describe(params) if family.describe else None,
        ))
    return out


def curriculum(split: str, n_per_stage: int, seed: int = 0,
               image_size: int = 112) -> dict[int, list[Example]]:
    """All three stages of one split: {stage: examples}."""
    return {s: generate(split, s, n_per_stage, seed, image_size) for s in (1, 2, 3)}


def tokenizer_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Texts to train the embedded model's BPE tokenizer on.

    Prompts (``format_prompt(question)``) and SFT targets (``format_response(reasoning,
    answer)``) of ``n`` train examples spread evenly over the three stages, then every
    digit, the contract tags and the instruction on their own, so each is guaranteed to be
    seen even if ``n`` is tiny. Text only: nothing is rendered, so this is fast.
    """
    _check("train", 1, n, seed)
    texts: list[str] = []
    for stage in (1, 2, 3):
        k = n // 3 + (1 if stage <= n % 3 else 0)
        for _, _, _, a in _drafts("train", stage, k, seed):
            texts.append(format_prompt(a.question))
            texts.append(format_response(a.solution.reasoning, a.solution.answer))
    texts.append("0 1 2 3 4 5 6 7 8 9 0123456789 . - + x = : ,")
    texts.append(" ".join([REASONING_OPEN, REASONING_CLOSE, SOLUTION_OPEN, SOLUTION_CLOSE]))
    texts.append(INSTRUCTION)
    return texts
