"""Own data in any of three formats -> Examples: the one loader behind ``--run.data``.

    DIR with data.jsonl         data/jsonl.py's format: one JSON row a line, images as files
                                (MathVista's own JSON release reads the same way)
    FILE.parquet                one parquet file: MathVista's hub columns, or just question,
                                answer and image (pid optional); the image a {bytes, path}
                                struct, raw bytes, or a path relative to the file's directory
    DIR from datasets           what ``datasets.Dataset.save_to_disk`` wrote (dataset_info.json
                                + state.json); read with the optional ``datasets`` package,
                                imported only here

Every row goes through data/rows.py's parser, so the three formats mean the same thing:
answer_type inferred from the gold when absent, question_type free_form and language
english when absent, bad rows skipped and counted by reason, an ``images`` list column
(JSONL array, parquet list, datasets Sequence of Image) read as several images a prompt. ``columns`` (``--data.columns
question=query,answer=label,image=img``) names the dataset's column for a field; a map
naming a column the data lacks is one ValueError naming it and listing the columns present.
A row without a pid (parquet, datasets) is named by its row number.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from data.jsonl import DATA_FILE, load_jsonl
from data.rows import MAX_IMAGES, SkipRow, check_columns, example_from_row, map_columns
from data.schema import Example

DATASETS_MARKERS = ("dataset_info.json", "state.json")
FORMATS = (f"a directory with {DATA_FILE} + images, a .parquet file, "
           "or a directory written by datasets' save_to_disk")


def source_kind(path: str | Path) -> str:
    """jsonl | parquet | datasets, or ValueError saying what a source must be."""
    root = Path(path)
    if root.is_dir() and (root / DATA_FILE).is_file():
        return "jsonl"
    if root.is_file() and root.suffix == ".parquet":
        return "parquet"
    if root.is_dir() and (all((root / m).is_file() for m in DATASETS_MARKERS) or (root / "dataset_dict.json").is_file()):
        return "datasets"
    if root.is_file():
        raise ValueError(f"{path} is not a .parquet file: give {FORMATS}")
    raise ValueError(f"no {DATA_FILE} in {path}" + ("" if root.exists() else " (it does not exist)") + f": give {FORMATS}")


def load_source(path: str | Path, columns: dict[str, str] | None = None, max_images: int = MAX_IMAGES
                ) -> tuple[list[Example], dict[str, int]]:
    """(examples, skipped rows by reason) of any of the three formats; a row with more than
    ``max_images`` images is skipped as too_many_images (data/rows.py)."""
    kind = source_kind(path)
    if kind == "jsonl":
        return load_jsonl(path, return_skipped=True, columns=columns, max_images=max_images)
    if kind == "parquet":
        names, rows = _parquet(Path(path))
        base = Path(path).parent
    else:
        names, rows = _datasets(Path(path))
        base = Path(path)
    check_columns(columns or {}, names, path)
    examples: list[Example] = []
    skipped: Counter[str] = Counter()
    for n, row in enumerate(rows):
        row = map_columns(row, columns or {})
        row.setdefault("pid", str(n))
        if row["pid"] is None:
            row["pid"] = str(n)
        try:
            examples.append(example_from_row(row, base, max_images=max_images))
        except SkipRow as skip:
            skipped[skip.reason] += 1
        except (TypeError, KeyError, ValueError, AttributeError):
            skipped["bad_row"] += 1
    return examples, dict(skipped)


def _parquet(path: Path) -> tuple[list[str], Iterable[dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path} is not a readable parquet file ({err})") from None

    def rows() -> Iterator[dict[str, Any]]:  # a batch at a time: only kept rows' image bytes stay in memory
        try:
            for batch in pf.iter_batches(batch_size=64):
                yield from batch.to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path} is damaged: reading its rows failed ({err})") from None

    return list(pf.schema_arrow.names), rows()


def _datasets(path: Path) -> tuple[list[str], Iterable[dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} was written by datasets' save_to_disk, and reading it needs the datasets "
                         "package: pip install 'datasets>=3' (or convert it: python -m data.mathvista convert)") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):  # save_to_disk of several splits: one subdirectory each
        if len(data) != 1:
            raise ValueError(f"{path} holds the splits {', '.join(data)}: give one of them, e.g. {path}/{next(iter(data))}")
        data = next(iter(data.values()))
    return list(data.column_names), iter(data)
