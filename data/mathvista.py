"""MathVista: load a local copy (or the hub through `datasets`), enrich, select eval subsets;
``python -m data.mathvista convert SRC OUT`` writes its numeric subset in the training format.

Sources, all giving the same ``Example`` rows (data/schema.py):

    path/to/file.parquet            one parquet file in the hub's layout
    path/to/dir                     a directory holding ``{split}-*.parquet`` (the hub's
                                    ``data/`` folder) or ``{split}/*.parquet``, or else
                                    ``annot_{split}.json`` / ``{split}.json`` plus the
                                    image files it names (the original release)
    hub:AI4Math/MathVista           the hub, through the optional ``datasets`` package

The hub's parquet columns (checked against the dataset card): pid, question, image (the
image's relative path, str), decoded_image (struct {bytes, path}), choices (list[str]),
unit, precision (float64, NaN/None when absent), answer (str), question_type
(free_form | multi_choice), answer_type (integer | float | text | list), metadata
(struct: split, language, img_width, img_height, source, category, task, context,
grade, skills), query (the question with MathVista's answer-format hint).

Bad rows are skipped and counted by reason, never a crash (the reasons and the parser of one
row, shared with the JSONL loader, are data/rows.py); ``load_mathvista`` returns the counts
so reports can show them.

Images are checked with PIL's ``verify`` (headers and, for PNG, chunk CRCs) and kept as
lazily-decoded PIL images, so 1000 testmini rows cost their compressed bytes, not their
pixels. A JPEG whose header is fine but whose body is cut short passes ``verify`` and
fails later, when the processor decodes it: that is the one case not caught here.

Enrichment (``enrich``) lower-cases the metadata vocabulary, records the context family
(``Example.context_family``: '* chart' -> chart, '* plot' -> plot) and the answer mode
(numeric_free_form / multi_choice / other) in ``metadata``.

``eval_overall_numeric`` is the staged paper's headline subset: free_form, english,
answer_type integer or float, and a gold answer that parses as a number. On the real
testmini it has 456 rows. Check from the anchor's dataset analysis of testmini
(1000 rows): free_form 460 = integer 418 + float 40 + list 2; languages english 936,
chinese 62, persian 2; the 62 Chinese rows are all multi-choice (GeoQA+), the 2 Persian
rows are free-form numeric (ParsVQA-Caps), so 418 + 40 - 2 = 456, matching its recorded
``eval_overall_numeric`` size. The same analysis records the stage filters' sizes on
testmini: stage1 195, stage2 287, stage3 119 (data/stages.py is the one place that
defines them; ``stage_subsets`` uses it). These counts are marginals from the anchor's
logs; the joint table needed to recount the subsets offline is not available here.

Training on MathVista ``test`` must be refused: its 5141 gold answers are empty. The
staged paper trained on it, so its correctness reward was 0 on every step, silently.
``require_gold_answers`` is the check the trainer runs on any training set.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from data.contract import normalize_number
from data.rows import SKIP_REASONS, SkipRow, example_from_row, row_image
from data.schema import Example
from data.stages import is_numeric_free_form, select_stage

# Columns without which a row means nothing: a missing `answer` column would read as "no
# gold" on every row and the report would score against empty answers.
REQUIRED_COLUMNS = ("pid", "question", "answer", "answer_type")
HUB_PREFIX = "hub:"


# ----------------------------------------------------------------------------- sources


def _parquet_files(root: Path, split: str) -> list[Path]:
    if root.is_file():
        return [root]
    files = sorted(p for p in root.rglob("*.parquet") if p.name.startswith(f"{split}-") or p.stem == split)
    # refs/convert/parquet layout: default/<split>/0000.parquet
    files += sorted(p for p in root.rglob("*.parquet") if p.parent.name == split and p not in files)
    return files


def _check_columns(names: Iterable[str], where: Path) -> None:
    names = set(names)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if not {"image", "decoded_image"} & names:
        missing.append("image or decoded_image")
    if missing:
        raise ValueError(f"{where} lacks the MathVista column(s) {', '.join(missing)} (it has {', '.join(sorted(names))}); "
                         "give the hub's layout: pid, question, answer, answer_type, image/decoded_image, ...")


def _json_rows(root: Path, split: str) -> list[dict[str, Any]] | None:
    for name in (f"annot_{split}.json", f"{split}.json", f"data/{split}.json"):
        path = root / name
        if path.is_file():
            try:
                raw = json.loads(path.read_text(encoding="utf-8-sig"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{path} is not UTF-8 JSON ({err})") from None
            # the original release is {pid: record}; a list of records works too
            if isinstance(raw, dict) and all(isinstance(r, dict) for r in raw.values()):
                rows = [dict(r, pid=r.get("pid", k)) for k, r in raw.items()]
            elif isinstance(raw, list) and all(isinstance(r, dict) for r in raw):
                rows = list(raw)
            else:
                raise ValueError(f"{path} must hold {{pid: record}} or a list of records (JSON objects)")
            if rows:  # rows may leave optional keys out; a key no row has is a missing column
                _check_columns({k for r in rows for k in r}, path)
            return rows
    return None


def _iter_parquet(files: list[Path], batch_size: int = 64) -> Iterator[dict[str, Any]]:
    """Rows one batch at a time, so only kept rows' image bytes stay in memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    opened = []
    for path in files:  # every file's columns are checked before the first row is read
        try:
            opened.append(pq.ParquetFile(path))
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path} is not a readable parquet file ({err})") from None
        _check_columns(opened[-1].schema_arrow.names, path)
    for path, pf in zip(files, opened):
        try:
            for batch in pf.iter_batches(batch_size=batch_size):
                yield from batch.to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path} is damaged: reading its rows failed ({err})") from None


def _iter_hub(name: str, split: str) -> Iterator[dict[str, Any]]:
    try:
        import datasets  # optional extra: pip install .[mathvista]
    except ImportError as err:
        raise ImportError(
            f"loading {HUB_PREFIX}{name} needs the optional `datasets` package "
            "(pip install 'vlgrpo[mathvista]'), or pass a local directory of the hub's parquet files"
        ) from err
    yield from datasets.load_dataset(name, split=split)


def iter_rows(source: str | Path, split: str) -> tuple[Iterable[dict[str, Any]], Path | None]:
    """(rows, base directory for relative image paths) of one split of a source."""
    text = str(source)
    if text.startswith(HUB_PREFIX):
        return _iter_hub(text[len(HUB_PREFIX):], split), None
    root = Path(source)
    if not root.exists():
        raise FileNotFoundError(
            f"MathVista source {text!r} does not exist: give a parquet file, a directory with "
            f"{split}-*.parquet or annot_{split}.json + images, or {HUB_PREFIX}AI4Math/MathVista"
        )
    base = root.parent if root.is_file() else root
    files = _parquet_files(root, split)
    if files:
        rows = _iter_parquet(files)
        first = next(rows, None)  # opens and checks every file now, not at the first row consumed
        return ([] if first is None else _chain(first, rows)), base
    rows = _json_rows(root, split)
    if rows is not None:
        return rows, base
    raise FileNotFoundError(
        f"no MathVista split {split!r} under {text}: expected {split}-*.parquet, {split}/*.parquet, "
        f"annot_{split}.json or {split}.json"
    )


def _chain(first: dict[str, Any], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield first
    yield from rest


def load_mathvista(
    source: str | Path,
    split: str = "testmini",
    where: Callable[[Example], bool] | None = None,
    limit: int | None = None,
) -> tuple[list[Example], dict[str, int]]:
    """Load one split as enriched Examples; returns (examples, skipped counts by reason).

    ``where`` filters on everything but the image, *before* the image bytes are checked
    and kept, so loading a subset of `test` (744 MB of images) holds only that subset.
    Row-level problems (answer type, language, gold) are counted for every row; image
    problems only for rows that pass ``where``.
    """
    rows, base = iter_rows(source, split)
    examples: list[Example] = []
    skipped: Counter[str] = Counter()
    for row in rows:
        try:
            probe = example_from_row(row, base, with_image=False)
            if where is not None and not where(probe):
                continue
            probe.image = row_image(row, base, probe.pid)
        except SkipRow as skip:
            skipped[skip.reason] += 1
            continue
        examples.append(probe)
        if limit is not None and len(examples) >= limit:
            break
    return examples, {r: skipped[r] for r in SKIP_REASONS if skipped[r]}


# ----------------------------------------------------------------------------- subsets


def is_overall_numeric(ex: Example) -> bool:
    """Membership of eval_overall_numeric: free_form, english, integer/float, numeric gold.

    The same predicate every curriculum stage starts from (data/stages.py), so a stage
    subset is always a subset of the headline subset.
    """
    return is_numeric_free_form(ex)


def eval_overall_numeric(examples: Iterable[Example]) -> list[Example]:
    """The staged paper's headline subset (456 rows of testmini)."""
    return [ex for ex in examples if is_overall_numeric(ex)]


def stage_subsets(examples: list[Example]) -> dict[int, list[Example]]:
    """{1: [...], 2: [...], 3: [...]} through the curriculum's stage filters (data/stages.py)."""
    return {stage: list(select_stage(examples, stage)) for stage in (1, 2, 3)}


def require_gold_answers(examples: list[Example], name: str) -> None:
    """Refuse a training set whose gold answers are missing or not numbers, saying why and what to do."""
    if not examples:
        raise ValueError(f"training set {name!r} is empty: check the data path, split and stage filters")
    empty = [ex.pid for ex in examples if not str(ex.answer).strip()]
    non_numeric = [ex.pid for ex in examples if str(ex.answer).strip() and normalize_number(ex.answer) is None]
    if not (empty or non_numeric):
        return

    def pids(xs: list[str]) -> str:
        return ", ".join(xs[:5]) + (", ..." if len(xs) > 5 else "")

    parts = []
    if empty:
        parts.append(
            f"{len(empty)} of {len(examples)} examples have an empty gold answer (pids {pids(empty)}). "
            "MathVista's `test` split ships with empty answers; the staged paper trained on it, so its "
            "correctness reward was 0 on every step, silently. Train on data with gold answers (the "
            "synthetic curriculum or a JSONL set) and keep MathVista testmini for evaluation."
        )
    if non_numeric:
        parts.append(
            f"{len(non_numeric)} of {len(examples)} examples have a gold answer that is not a number "
            f"(pids {pids(non_numeric)}; multi-choice or text rows): the numeric rewards can never pay them. "
            "Select numeric free-form rows first (data.stages / data.mathvista.eval_overall_numeric)."
        )
    raise ValueError(f"training set {name!r}: " + " Also, ".join(parts))


# ----------------------------------------------------------------------------- convert

CONVERT_HELP = """\
Convert MathVista (or any data data/sources.py reads) into the training format: OUT/data.jsonl
+ OUT/images/, holding the numeric subset alone (free-form, English, integer/float, a numeric
gold answer: eval_overall_numeric), the rows the trainer can pay. Prints the rows read, the
rows skipped by reason, the numeric subset's size and the stage filters' sizes on it. OUT must
be new or empty; it is written in a temporary directory beside it and renamed when complete,
so an interrupted conversion (Ctrl-C, SIGTERM: exit 130 / 143) leaves nothing behind.
Then: python -m grpo.train --phase B --run.data OUT
"""


def convert(source: str, out: str | Path, split: str = "testmini", columns: dict[str, str] | None = None) -> int:
    """``python -m data.mathvista convert``: the command (see CONVERT_HELP); returns the exit code."""
    import sys

    from data.jsonl import save_jsonl
    from data.sources import load_source, source_kind
    from grpo_infra.atomic import new_directory
    from grpo_infra.signals import StopNow, exit_code, signal_name, stops_at_once

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: {out} exists and is not an empty directory: name a new directory "
              "(convert never writes into existing data)", file=sys.stderr)
        return 2
    try:
        with stops_at_once():
            try:
                own = not str(source).startswith(HUB_PREFIX) and source_kind(source) in ("jsonl", "datasets")
            except ValueError:
                own = False  # a MathVista parquet file or hub-layout directory
            if own:
                examples, skipped = load_source(source, columns)
            else:
                examples, skipped = load_mathvista(source, split)
            numeric = eval_overall_numeric(examples)
            lost = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) or "none"
            print(f"read {len(examples) + sum(skipped.values())} rows of {source}"
                  + ("" if own else f" (split {split})") + f"; skipped {sum(skipped.values())}: {lost}")
            print(f"numeric subset: {len(numeric)} rows ({len(examples) - len(numeric)} loaded rows are multi-choice, "
                  "text, not English or without a gold answer: not written)")
            if not numeric:
                print(f"error: no row of {source} has a numeric gold answer, so there is nothing to train on "
                      "(MathVista's test split ships without answers: convert testmini)", file=sys.stderr)
                return 2
            print("stage filters: " + ", ".join(f"stage{s} {len(v)}" for s, v in stage_subsets(numeric).items()))
            with new_directory(out) as tmp:  # takes an empty OUT's place too; never a half-written one
                save_jsonl(numeric, tmp)
        print(f"wrote {out} (data.jsonl + images/); train with: python -m grpo.train --phase B --run.data {out}")
        return 0
    except StopNow as stop:
        print(f"convert stopped on {signal_name(stop.signum)}; nothing was written to {out}", file=sys.stderr)
        return exit_code(stop.signum)
    except (ValueError, FileNotFoundError, ImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m data.mathvista", description="MathVista tools.")
    sub = ap.add_subparsers(dest="command", required=True)
    cv = sub.add_parser("convert", help="MathVista -> the training format (data.jsonl + images/)",
                        description=CONVERT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    cv.add_argument("source", metavar="SRC", help="a MathVista parquet file, a directory of the hub's parquet files "
                    f"({{split}}-*.parquet), a datasets save_to_disk directory, or {HUB_PREFIX}AI4Math/MathVista")
    cv.add_argument("out", metavar="OUT", help="a new (or empty) directory to write")
    cv.add_argument("--split", default="testmini", help="the MathVista split of a parquet directory (default testmini; "
                    "test has no gold answers)")
    cv.add_argument("--columns", default="", metavar="FIELD=COLUMN,...",
                    help="column map for a datasets directory with other column names, e.g. question=query,answer=label")
    args = ap.parse_args(argv)
    try:
        columns = dict(item.split("=", 1) for item in filter(None, (p.strip() for p in args.columns.split(","))))
    except ValueError:
        ap.error(f"--columns {args.columns!r}: write field=column,field=column")
    return convert(args.source, args.out, args.split, columns)


if __name__ == "__main__":
    raise SystemExit(main())
