"""Shared by the trainer tests: run grpo.train.main in-process and read its JSONL log."""

import contextlib
import io
import json
from pathlib import Path

import torch

from grpo.train import main


def run_main(run_dir: Path, *args: str) -> tuple[int, str, str]:
    """main() on run_dir with these arguments: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()  # main() applies --run.cpu_threads to this whole process
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--run.run_dir", str(run_dir), *args])
    finally:
        torch.set_num_threads(threads)
    return rc, out.getvalue(), err.getvalue()


def log_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
