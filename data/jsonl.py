"""Save / load a dataset as one JSONL file plus a folder of PNG images.

Format (a directory):

    data.jsonl          one JSON object per line, one line per example
    images/<pid>.png    the example's image (characters other than A-Z a-z 0-9 . _ - in
                        the pid become "_" in the file name)
    images/<pid>/<k>.png  the k-th image (from 0) of an example of several images

Each line is a MathVista row plus the supervision fields of data/schema.py:

    pid, question, answer (str), answer_type, precision (int or null), question_type,
    choices, unit, metadata {context, skills, grade, language, source, ...},
    image          the image's path relative to the directory ("images/<pid>.png"),
                   exactly as MathVista's own JSON release names its images
    images         instead of ``image``, for several images a prompt: their paths, in the
                   order the prompt shows them (TRL's column name; data/rows.py)
    reasoning      worked solution text, or null
    key_steps      [[alternative, ...], ...]
    intermediates  [{"name": ..., "value": ...}, ...]
    difficulty     "easy" | "middle" | "hard" | null
    hops           int
    rubrics        [{"text", "dimension", "label", "weight", "evidence"}, ...]
    marks          [{"kind", "x", "y", "colour" | "text"}, ...]  what the renderer drew
    caption        "red circles: 3. blue squares: 2." (every quantity drawn), or null

so a MathVista JSON row (no supervision fields) loads too, and the MathVista columns are
parsed by data/rows.py's ``example_from_row``, the MathVista loader's parser too.

Loading is eager for the file list and lazy for pixels: each image file is read and its
integrity checked with PIL's ``verify`` at load time, and decoded on first use.
Loading also records the derived metadata keys context_family and answer_mode
(``data.rows.enrich``).

Bad rows are skipped and counted, never a crash (``load_jsonl(..., return_skipped=True)``):

    bad_json            the line is not a JSON object
    bad_row             a required field (pid, question, answer) is missing, or a
                        supervision field has the wrong shape
    missing_image       the image file named by the row does not exist
    corrupt_image       the file is not an image PIL can read
    image_too_large     the image claims more pixels than PIL's decompression-bomb limit
    image_aspect        one side over 200 times the other (Qwen2-VL's resize refuses it)
    unknown_answer_type / unknown_language / non_numeric_answer
                        as in data/rows.py (a non-numeric gold answer under an
                        integer/float answer type; an empty answer is kept as "no gold";
                        a row without answer_type gets one from its gold, or is skipped)
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from data.rows import MAX_IMAGES, SkipRow, check_columns, example_from_row, map_columns
from data.schema import Example, Intermediate, RubricItem
from grpo_infra.atomic import replace_file

DATA_FILE = "data.jsonl"
IMAGE_DIR = "images"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def image_name(pid: str, k: int | None = None) -> str:
    """The file of a pid's image, or of its k-th image when it has several (a folder per pid:
    no name of one pid's images can be another pid's)."""
    safe = _UNSAFE.sub("_", pid)
    return f"{IMAGE_DIR}/{safe}.png" if k is None else f"{IMAGE_DIR}/{safe}/{k}.png"


def to_row(ex: Example, image: str | list[str] | None) -> dict[str, Any]:
    """The JSON object of one example; ``image`` is its relative image path (or None), or the
    list of them of a several-image example (written as ``images``)."""
    several = isinstance(image, list)
    return {
        "pid": ex.pid, "question": ex.question, "answer": ex.answer,
        "answer_type": ex.answer_type, "precision": ex.precision,
        "question_type": ex.question_type, "choices": ex.choices, "unit": ex.unit,
        "metadata": ex.metadata, "image": None if several else image, **({"images": image} if several else {}),
        "reasoning": ex.reasoning, "key_steps": ex.key_steps,
        "intermediates": [asdict(i) for i in ex.intermediates],
        "difficulty": ex.difficulty, "hops": ex.hops,
        "rubrics": [asdict(r) for r in ex.rubrics], "marks": ex.marks,
        "caption": ex.caption,
    }


def save_jsonl(examples: Iterable[Example], directory: str | os.PathLike) -> Path:
    """Write ``directory``/data.jsonl and ``directory``/images/*.png; returns the JSONL path."""
    root = Path(directory)
    (root / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}
    lines = []
    for ex in examples:
        pictures = ex.images or ([ex.image] if ex.image is not None else [])
        names = [image_name(ex.pid, k if ex.images else None) for k in range(len(pictures))]
        for name, picture in zip(names, pictures):
            if name in seen:
                raise ValueError(f"pids {seen[name]!r} and {ex.pid!r} map to the same image file "
                                 f"{name}; pids must be unique (after replacing unsafe characters)")
            seen[name] = ex.pid
            (root / name).parent.mkdir(exist_ok=True)
            picture.convert("RGB").save(root / name, format="PNG")
        try:
            lines.append(json.dumps(to_row(ex, names if ex.images else (names[0] if names else None)),
                                    ensure_ascii=False))
        except TypeError as err:
            raise ValueError(f"example {ex.pid!r} has a field JSON cannot store: {err}") from err
    path = root / DATA_FILE
    replace_file(path, "\n".join(lines) + ("\n" if lines else ""))  # a reader never sees a half-written file
    return path


def _supervision(ex: Example, row: dict[str, Any]) -> Example:
    """Attach the reward supervision fields of a row (TypeError/KeyError/ValueError if malformed)."""
    ex.reasoning = None if row.get("reasoning") is None else str(row["reasoning"])
    ex.key_steps = [[str(a) for a in group] for group in row.get("key_steps") or []]
    ex.intermediates = [Intermediate(str(i["name"]), str(i["value"])) for i in row.get("intermediates") or []]
    ex.difficulty = row.get("difficulty")
    ex.hops = int(row.get("hops", 1))
    ex.rubrics = [RubricItem(str(r["text"]), str(r["dimension"]), str(r["label"]), float(r["weight"]),
                             dict(r.get("evidence") or {})) for r in row.get("rubrics") or []]
    ex.marks = [dict(m) for m in row.get("marks") or []]
    ex.caption = None if row.get("caption") is None else str(row["caption"])
    return ex


def load_jsonl(directory: str | os.PathLike, return_skipped: bool = False, columns: dict[str, str] | None = None,
               max_images: int = MAX_IMAGES) -> list[Example] | tuple[list[Example], dict[str, int]]:
    """Read a directory written by ``save_jsonl`` (or any MathVista-format JSONL + images).

    Returns the examples, or ``(examples, skipped)`` with ``skipped`` = {reason: count}
    for the reasons that occurred (see the module docstring). ``columns`` maps field names
    to the keys the lines use instead (data/rows.py ``map_columns``); a row with more than
    ``max_images`` images is skipped as too_many_images.
    """
    root = Path(directory)
    path = root / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {DATA_FILE} in {root}; write one with data.jsonl.save_jsonl")
    examples: list[Example] = []
    skipped: Counter[str] = Counter()
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) would make line 1 bad JSON
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8") from None
    parsed = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            skipped["bad_json"] += 1
    if columns:  # a key no line has is a column the data lacks
        check_columns(columns, {k for row in parsed if isinstance(row, dict) for k in row}, path)
    for row in parsed:
        if isinstance(row, dict):
            row = map_columns(row, columns or {})
        if not isinstance(row, dict) or any(k not in row for k in ("pid", "question", "answer")):
            skipped["bad_json" if not isinstance(row, dict) else "bad_row"] += 1
            continue
        try:
            examples.append(_supervision(example_from_row(row, base_dir=root, max_images=max_images), row))
        except SkipRow as skip:
            skipped[skip.reason] += 1
        except (TypeError, KeyError, ValueError, AttributeError):
            skipped["bad_row"] += 1
    return (examples, dict(skipped)) if return_skipped else examples
