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


@contextlib.contextmanager
def reward_spread(only=None, component=None):
    """Add a text-dependent bonus in [0, 1] to every reward, so that groups have a spread.

    The embedded model from random weights (``--init base``) writes truncated garbage with
    equal verifier rewards, so without a bonus every advantage is 0 and nothing trains.
    only(example) -> bool limits the bonus to some prompts: the others keep zero spread.
    component: also add it to that raw component (for per-component advantages); the
    total then gets weight x bonus, as if the component had earned it.
    """
    import pytest

    from grpo.rewards import RewardModel

    original = RewardModel.__call__

    def with_spread(self, examples, completions, **kw):
        rb = original(self, examples, completions, **kw)
        bonus = [sum(map(ord, c)) % 5 / 4 if only is None or only(ex) else 0.0
                 for ex, c in zip(examples, completions)]
        bonus = torch.tensor(bonus)
        if component is None:
            rb.total = rb.total + bonus
        else:
            rb.components[component] = rb.components[component] + bonus
            rb.total = rb.total + rb.weights[component] * bonus
        return rb

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RewardModel, "__call__", with_spread)
        yield
