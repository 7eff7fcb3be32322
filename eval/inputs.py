"""What an evaluation reads besides a model: its prompts and pre-generated completions.

No model here: the evaluation CLI (grpo/evaluate.py) calls these
to check the whole request before the first slow evaluation, and a program that produced
completions elsewhere can score them with ``evaluate_completions`` and these alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data.mathvista import eval_overall_numeric, is_overall_numeric, load_mathvista
from data.schema import Example
from data.sources import DATASETS_MARKERS, load_source
from data.synthetic import generate
from eval.results import STAGES


def load_examples(args: Any) -> tuple[list[Example], str, dict[str, int]]:
    """The evaluation prompts named by ``args.data / split / subset / limit`` (and, for the
    synthetic curriculum, ``seed / image_size``; for a dataset directory, ``max_images``, the
    most images a row may show): (examples, a description for the report, rows the loader
    skipped by reason)."""
    if args.data == "synthetic":
        per_stage = max(1, args.limit // len(STAGES)) if args.limit else 100
        examples = [ex for s in STAGES for ex in generate("test", s, per_stage, args.seed, args.image_size)]
        return examples, f"synthetic test split, {per_stage} per stage, seed {args.seed}", {}
    own = (Path(args.data) / "data.jsonl").is_file() or Path(args.data, DATASETS_MARKERS[0]).is_file()
    if own:  # a dataset written by data/jsonl.py (or convert), or by datasets' save_to_disk
        examples, skipped = load_source(args.data, max_images=args.max_images)
        if args.subset == "eval_overall_numeric":
            examples = eval_overall_numeric(examples)
        return examples[: args.limit], f"dataset {args.data} ({args.subset})", skipped

    where = is_overall_numeric if args.subset == "eval_overall_numeric" else None
    examples, skipped = load_mathvista(args.data, args.split, where=where, limit=args.limit)
    if args.subset == "eval_overall_numeric":
        examples = eval_overall_numeric(examples)
    return examples, f"MathVista {args.split} ({args.subset}) from {args.data}", skipped


def read_completions(path: str, examples: list[Example]) -> tuple[list[list[str]], list[list[int]]]:
    """JSONL {"pid", "completions", "token_counts"} aligned to the examples (missing pid -> []).

    Every row is checked: a row without completions, a string where the list belongs, or
    token counts that do not pair one-to-one with the completions would otherwise be scored
    as an empty or misaligned group without a word.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    shape = 'write one JSON object per line: {"pid": ..., "completions": ["..."], "token_counts": [n]}'
    by_pid: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg}); {shape}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object; {shape}")
        missing = [k for k in ("pid", "completions", "token_counts") if k not in row]
        if missing:
            raise ValueError(f"{where}: lacks {', '.join(missing)}; {shape}")
        pid, texts, counts = row["pid"], row["completions"], row["token_counts"]
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise ValueError(f"{where}: pid {pid!r} is not a string or integer")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            kind = "a string" if isinstance(texts, str) else f"{type(texts).__name__}"
            raise ValueError(f"{where}: completions is {kind}, not a list of strings (write [\"...\"])"
                             if not isinstance(texts, list) else f"{where}: completions holds a non-string")
        if not isinstance(counts, list) or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"{where}: token_counts must be a list of integers >= 0, got {counts!r}"[:300])
        if len(counts) != len(texts):
            raise ValueError(f"{where}: {len(texts)} completions but {len(counts)} token_counts; give one count "
                             "per completion, from the tokenizer that produced it")
        if str(pid) in by_pid:
            raise ValueError(f"{where}: pid {pid!r} appears twice; give each prompt's completions on one line")
        by_pid[str(pid)] = row
    texts = [list(by_pid.get(ex.pid, {}).get("completions", [])) for ex in examples]
    counts = [list(by_pid.get(ex.pid, {}).get("token_counts", [])) for ex in examples]
    return texts, counts
