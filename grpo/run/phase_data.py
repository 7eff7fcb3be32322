"""The examples of a phase: its curriculum stages' training data and a fixed held-out
subset for the checkpoint-side eval that feeds the controller's gates.

Synthetic data is generated per stage (deterministic in the seed, splits disjoint by
content hash); a JSONL dataset is split by the stage filters and a deterministic tail of
each stage is held out. Either way a training set without gold answers is refused: the
staged paper trained on MathVista ``test``, whose answers are empty, and its correctness
reward was 0 on every step without a word.
"""

from __future__ import annotations

from data.jsonl import load_jsonl
from data.mathvista import require_gold_answers
from data.stages import select_stage
from data.synthetic import generate
from grpo.config import ConfigError, TrainConfig


def load_training_data(cfg: TrainConfig) -> tuple[dict[int, list], dict[int, list]]:
    """(train, val) examples per curriculum stage. Refuses data without gold answers."""
    stages = sorted(cfg.phase.mixture) if cfg.phase.name != "warmup" else [1, 2, 3]
    if cfg.run.data == "synthetic":
        n_val = max(cfg.run.eval_size, 8)
        train = {s: generate("train", s, cfg.run.train_per_stage, cfg.run.seed, cfg.model.image_size) for s in stages}
        val = {s: generate("val", s, n_val, cfg.run.seed, cfg.model.image_size) for s in stages}
    else:
        try:
            rows, skipped = load_jsonl(cfg.run.data, return_skipped=True)
            lost = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
            if not rows:
                raise ValueError(f"{cfg.run.data} has no usable rows" + (f": {sum(skipped.values())} skipped ({lost})"
                                                                        if skipped else " (data.jsonl is empty)"))
            # The stage filters keep numeric gold answers only, so rows with an empty answer
            # would vanish without a word (MathVista `test` is all such rows): name them.
            if any(not str(ex.answer).strip() for ex in rows):
                require_gold_answers(rows, cfg.run.data)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--run.data: {err}") from None
        if skipped:
            print(f"data: {sum(skipped.values())} rows of {cfg.run.data} skipped ({lost}); training on {len(rows)}")
        train = {s: select_stage(rows, s) for s in stages}
        # Hold out a deterministic tail of each stage for the checkpoint-side eval.
        val = {}
        for s in stages:
            k = min(len(train[s]) // 5, cfg.run.eval_size)
            train[s], val[s] = train[s][: len(train[s]) - k], train[s][len(train[s]) - k:]
    for s in stages:
        if not train[s]:
            raise ConfigError(f"stage {s} has no training examples in {cfg.run.data!r} (the stage filters keep "
                              f"numeric free-form English rows); drop it from --phase.mixture or use other data")
        # The staged paper trained on MathVista `test`, whose answers are empty: its
        # correctness reward was silently 0 on every step. Refuse, loudly.
        require_gold_answers(train[s], f"{cfg.run.data} stage {s}")
    return train, val


def eval_subset(cfg: TrainConfig, val: dict[int, list]) -> list:
    """A fixed held-out subset, split over the phase's stages by the mixture weights."""
    mix = cfg.phase.mixture if cfg.phase.name != "warmup" else {s: 1.0 for s in val}
    total = sum(mix.values())
    out = []
    for s, p in sorted(mix.items()):
        out += val[s][: max(1, round(cfg.run.eval_size * p / total))]
    return out
