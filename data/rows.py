"""One dataset row (a dict of MathVista's columns) -> Example: the parser every loader shares.

The columns are MathVista's (data/mathvista.py lists them); only pid, question, answer and
an image are needed. What a missing column means:

    answer_type    inferred from the gold answer: integer if it is a whole number written
                   without a point ("12", "-3", "1,000"), float if it is any other number
                   ("2.5", "1e3"); a gold that is empty or not a number skips the row as
                   non_numeric_answer (with no stated type there is nothing else to train on)
    question_type  free_form
    metadata       {} -- so language counts as english, and the row has no context or
                   skills for the stage filters (data/stages.py: the pseudo-stage "all")
    precision, choices, unit   none

The image comes from embedded bytes (``decoded_image`` or ``image`` as a {bytes, path}
struct or raw bytes), a PIL image (what ``datasets`` decodes), or a path relative to the
data's directory (``image`` or the struct's ``path``).

Several images a prompt (TRL's ``images`` column): a row whose ``images`` is a list (JSONL
array, parquet or datasets list column) shows every one of them, in order, each element any
of the forms above; it then ignores ``image``. ``max_images`` (``--data.max_images``, default
MAX_IMAGES) bounds the list: the prompt's visual tokens are the sum over its images, so the
count multiplies what one prompt costs. A list of one image is the usual one-image row.

Bad rows raise ``SkipRow(reason)``; the loaders count them by reason, never crash:

    missing_image        no image bytes and no readable file at the row's image path (for an
                         ``images`` list: at any element)
    empty_images         an ``images`` list with no element
    too_many_images      an ``images`` list longer than ``max_images``
    corrupt_image        bytes that PIL cannot identify / verify
    image_too_large      more pixels than PIL's decompression-bomb limit (Image.MAX_IMAGE_PIXELS
                         x 2, 179M by default): a few KB of PNG can claim 30000 x 30000
    image_aspect         one side over MAX_ASPECT (200) times the other: Qwen2-VL's resize
                         refuses it, so it would fail inside a training or eval batch
    unknown_answer_type  a stated type not one of integer, float, text, list
    unknown_language     not one of english, chinese, persian
    non_numeric_answer   a non-empty gold answer that is not a number under an
                         integer/float answer type (an empty answer under a stated type is
                         kept: it means "no gold", and training refuses it loudly), or no
                         stated type and no numeric gold to infer one from
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from data.contract import normalize_number
from data.schema import ANSWER_TYPES, Example

LANGUAGES = ("english", "chinese", "persian")
NUMERIC_ANSWER_TYPES = ("integer", "float")
SKIP_REASONS = ("missing_image", "empty_images", "too_many_images", "corrupt_image", "image_too_large", "image_aspect",
                "unknown_answer_type", "unknown_language", "non_numeric_answer")
# The fields a row may carry (a column map renames the dataset's columns to these), and
# those without which it means nothing.
FIELDS = ("pid", "question", "answer", "image", "images", "decoded_image", "answer_type", "question_type",
          "precision", "choices", "unit", "metadata", "query")
IMAGE_FIELDS = ("image", "images", "decoded_image")  # a row needs one of them
NEEDED = ("question", "answer")
MAX_ASPECT = 200  # Qwen2-VL's smart_resize raises above this long/short side ratio
# Images one prompt may show (--data.max_images). Each costs up to max_pixels / 784 visual
# tokens (256 at the 7B preset's 448^2), so 4 keeps a prompt near 1k visual tokens; EasyR1's
# limit_images and OpenRLHF's max_images_per_prompt are the same bound.
MAX_IMAGES = 4


class SkipRow(Exception):
    """A row that cannot become an Example; ``reason`` is one of SKIP_REASONS."""

    def __init__(self, reason: str, pid: str = "?"):
        super().__init__(f"pid {pid}: {reason}")
        self.reason = reason


def _open_image(data: bytes, pid: str) -> Any:
    """A lazily-decoded PIL image after an integrity check, or SkipRow('corrupt_image')."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as probe:
            probe.verify()  # reads headers / chunk CRCs without decoding all pixels
        return _check_aspect(Image.open(io.BytesIO(data)), pid)  # verify() invalidates its image: reopen
    except Image.DecompressionBombError as err:  # not an OSError: it would escape as a traceback
        raise SkipRow("image_too_large", pid) from err
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise SkipRow("corrupt_image", pid) from err


def _check_aspect(image: Any, pid: str) -> Any:
    w, h = image.size
    if min(w, h) < 1 or max(w, h) / min(w, h) > MAX_ASPECT:
        raise SkipRow("image_aspect", pid)
    return image


def row_images(row: dict[str, Any], base_dir: Path | None, pid: str, max_images: int = MAX_IMAGES) -> list[Any]:
    """Every image of the row, in order: its ``images`` list, else its one image (``row_image``).
    The count is checked before any element is read, so a long list costs nothing."""
    images = row.get("images")
    if images is None:
        return [row_image(row, base_dir, pid)]
    if not isinstance(images, (list, tuple)):  # a parquet / datasets list column reads as a list
        raise SkipRow("missing_image", pid)
    if not images:
        raise SkipRow("empty_images", pid)
    if len(images) > max_images:
        raise SkipRow("too_many_images", pid)
    return [row_image({"image": value}, base_dir, pid) for value in images]


def row_image(row: dict[str, Any], base_dir: Path | None, pid: str) -> Any:
    """The row's image from embedded bytes, a decoded PIL image, or a file next to the data.

    ``decoded_image`` first (MathVista's hub columns carry both), then ``image``, which own
    data often uses for the bytes struct itself."""
    values = [row.get("decoded_image"), row.get("image")]
    for value in values:
        if value is not None and hasattr(value, "size") and hasattr(value, "mode"):
            return _check_aspect(value, pid)  # `datasets` already decoded it into a PIL image
        if isinstance(value, dict) and value.get("bytes"):
            return _open_image(value["bytes"], pid)
        if isinstance(value, (bytes, bytearray)) and value:
            return _open_image(bytes(value), pid)
    for value in values[::-1]:  # the image column's path is the one the row states; the struct's, its file name
        rel = value.get("path") if isinstance(value, dict) else value
        if isinstance(rel, str) and rel and base_dir is not None and (base_dir / rel).is_file():
            return _open_image((base_dir / rel).read_bytes(), pid)
    raise SkipRow("missing_image", pid)


def _precision(value: Any) -> int | None:
    """MathVista stores precision as float64 with NaN/None when absent."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else int(round(v))


def _metadata(raw: Any) -> dict[str, Any]:
    meta = dict(raw) if isinstance(raw, dict) else {}
    for key in ("language", "context", "grade", "category", "task", "source", "split"):
        if isinstance(meta.get(key), str):
            meta[key] = meta[key].strip().lower()
    skills = meta.get("skills")
    meta["skills"] = [str(s).strip().lower() for s in skills] if isinstance(skills, (list, tuple)) else []
    return meta

_WHOLE = re.compile(r"[+-]?(\d+|\d{1,3}(,\d{3})+)")


def infer_answer_type(answer: str, pid: str = "?") -> str:
    """integer / float from a gold answer, for rows that do not state a type (module doc)."""
    if normalize_number(answer) is None:
        raise SkipRow("non_numeric_answer", pid)
    return "integer" if _WHOLE.fullmatch(answer.strip()) else "float"


def example_from_row(row: dict[str, Any], base_dir: Path | None = None, with_image: bool = True,
                     max_images: int = MAX_IMAGES) -> Example:
    """One row (a dict of the fields in the module doc) -> Example, or raise SkipRow."""
    pid = str(row.get("pid", "?"))
    meta = _metadata(row.get("metadata"))
    answer = "" if row.get("answer") is None else str(row["answer"]).strip()
    answer_type = str(row.get("answer_type") or "").strip().lower() or infer_answer_type(answer, pid)
    if answer_type not in ANSWER_TYPES:
        raise SkipRow("unknown_answer_type", pid)
    if meta.get("language", "english") not in LANGUAGES:
        raise SkipRow("unknown_language", pid)
    if answer and answer_type in NUMERIC_ANSWER_TYPES and normalize_number(answer) is None:
        raise SkipRow("non_numeric_answer", pid)
    if row.get("query"):
        meta["query"] = str(row["query"])
    choices = row.get("choices")
    images = row_images(row, base_dir, pid, max_images) if with_image else [None]
    path = row.get("image") if row.get("images") is None else None  # the one image's file name, if stated
    ex = Example(
        pid=pid,
        question=str(row.get("question") or ""),
        answer=answer,
        answer_type=answer_type,
        precision=_precision(row.get("precision")),
        question_type=str(row.get("question_type") or "free_form").strip().lower(),
        metadata=meta,
        image=images[0],
        image_path=path if isinstance(path, str) and path else None,
        images=images if len(images) > 1 else None,
        choices=[str(c) for c in choices] if choices is not None and len(choices) else None,
        unit=str(row["unit"]) if row.get("unit") else None,
    )
    return enrich(ex)


def check_columns(columns: dict[str, str], present: Iterable[str], where: Any) -> None:
    """A column map (field -> the dataset's column) must name columns the data has, and the
    data must then hold the fields a row needs; ValueError naming what is wrong otherwise."""
    present = set(present)
    for name, column in columns.items():
        if column not in present:
            raise ValueError(f"--data.columns {name}={column}: {where} has no column {column!r}; "
                             f"its columns: {', '.join(sorted(present))}")
    have = {name for name in FIELDS if columns.get(name, name) in present}
    missing = [name for name in NEEDED if name not in have]
    if not set(IMAGE_FIELDS) & have:
        missing.append("image (or images)")
    if missing:
        raise ValueError(f"{where} has no column for {', '.join(missing)} (its columns: {', '.join(sorted(present))}); "
                         f"name them with --data.columns, e.g. --data.columns {missing[0]}=<column>")


def map_columns(row: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    """The row with each mapped column under its field's name (the field's own column, if
    the data has one besides, is dropped: the map says which one to read)."""
    if not columns:
        return row
    out = {k: v for k, v in row.items() if k not in columns}
    for name, column in columns.items():
        out[name] = row.get(column)
    return out


def answer_mode(ex: Example) -> str:
    """numeric_free_form | multi_choice | other (free-form text or list answers)."""
    if ex.question_type == "multi_choice":
        return "multi_choice"
    if ex.question_type == "free_form" and ex.answer_type in NUMERIC_ANSWER_TYPES:
        return "numeric_free_form"
    return "other"


def enrich(ex: Example) -> Example:
    """Record derived fields in metadata: context_family and answer_mode."""
    ex.metadata["context_family"] = ex.context_family
    ex.metadata["answer_mode"] = answer_mode(ex)
    ex.metadata.setdefault("dataset", "mathvista")
    return ex
