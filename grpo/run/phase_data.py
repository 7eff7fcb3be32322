"""The examples of a phase: its curriculum stages' training data, a fixed held-out subset for
the checkpoint-side eval that feeds the controller's gates, and (own data) the test rows of
the end-of-run report.

Synthetic data is generated per stage (deterministic in the seed, splits disjoint by content
hash). Own data (``--run.data``: any format of data/sources.py) loses its test rows first
(data/holdout.py: a tenth, chosen by pid hash, the same in every phase), then is split by the
stage filters, and a deterministic tail of each stage is held out for the checkpoint eval
and taken out of every stage's training rows (stages overlap). Data without MathVista
metadata has nothing for stages 1-3 to select on: the phases' default mixtures become the
pseudo-stage "all" (``fall_back_to_all``, one printed line). Either way a training set
without gold answers is refused: the staged paper trained on MathVista ``test``, whose
answers are empty, and its correctness reward was 0 on every step without a word.
"""

from __future__ import annotations

from pathlib import Path

from data.holdout import TEST_EVERY, split_test
from data.jsonl import DATA_FILE
from data.mathvista import require_gold_answers
from data.schema import Example
from data.sources import load_source
from data.stages import ALL, has_stage_metadata, is_numeric_free_form, select_stage
from data.synthetic import generate
from grpo.config import PHASE_DEFAULTS, TrainConfig
from grpo.errors import ConfigError

VAL_EVERY = 5  # own data: one training row of a stage in five is held out for the checkpoint eval


def load_own_data(cfg: TrainConfig, say: bool = False) -> tuple[list[Example], list[Example]]:
    """(usable rows to train on, test rows) of ``--run.data``; ConfigError with one line when
    the data cannot train (no rows, no gold answers, no numeric gold). ``say``: print the
    skipped rows by reason (once per command: this runs for every phase)."""
    data = cfg.run.data
    try:
        rows, skipped = load_source(data, cfg.data.columns, cfg.data.max_images)
        # The numeric filter below drops rows with an empty answer, so MathVista `test` (all
        # such rows) would vanish without a word: name them.
        if any(not str(ex.answer).strip() for ex in rows):
            require_gold_answers(rows, data)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--run.data: {err}") from None
    lost = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
    if "too_many_images" in skipped:
        lost += f"; a row may show --data.max_images={cfg.data.max_images} images: raise it to train on more"
    usable = [ex for ex in rows if is_numeric_free_form(ex)]
    if not usable:
        msg = f"--run.data: {data} has no usable rows"
        if skipped:
            msg += f": {sum(skipped.values())} skipped ({lost})"
        elif not rows:
            msg += f" ({DATA_FILE} is empty)" if Path(data).is_dir() else " (it has no rows)"
        if rows or "non_numeric_answer" in skipped:
            msg += (f"{',' if skipped else ':'} {len(rows)} kept and none has a numeric gold answer (free-form, "
                    "English, integer/float): the rewards check the answer as a number; give data whose answers are numbers")
        raise ConfigError(msg)
    if skipped and say:
        print(f"data: {sum(skipped.values())} rows of {data} skipped ({lost}); {len(usable)} usable")
    return split_test(usable)


def fall_back_to_all(configs: dict[str, TrainConfig]) -> None:
    """On own data without MathVista metadata, each phase's default stage mixture becomes
    {"all": 1.0}, with one printed line; a mixture the user gave is kept (and refused later
    if its stages select nothing)."""
    first = next(iter(configs.values()))
    if first.run.data == "synthetic":
        return
    rows, test = load_own_data(first, say=True)
    if has_stage_metadata(rows + test):
        return
    moved = [p for p, c in configs.items() if c.phase.mixture == PHASE_DEFAULTS[p]["phase.mixture"]]
    for phase in moved:
        configs[phase].phase.mixture = {ALL: 1.0}
    if moved:
        print(f"data: no row of {first.run.data} has MathVista metadata (context, skills) for the stage filters; "
              f"{'phases' if len(moved) > 1 else 'phase'} {', '.join(moved)} train{'' if len(moved) > 1 else 's'} "
              "on every usable row (--phase.mixture all=1.0)")


def load_training_data(cfg: TrainConfig) -> tuple[dict, dict]:
    """(train, val) examples per curriculum stage. Refuses data without gold answers."""
    stages = sorted(cfg.phase.mixture, key=str) if cfg.phase.name != "warmup" or ALL in cfg.phase.mixture else [1, 2, 3]
    if cfg.run.data == "synthetic":
        if ALL in stages:
            raise ConfigError("phase.mixture names all, the pseudo-stage of own data (--run.data); the synthetic "
                              "curriculum has stages 1, 2 and 3")
        n_val = max(cfg.run.eval_size, 8)
        train = {s: generate("train", s, cfg.run.train_per_stage, cfg.run.seed, cfg.model.image_size) for s in stages}
        val = {s: generate("val", s, n_val, cfg.run.seed, cfg.model.image_size) for s in stages}
    else:
        rows, _ = load_own_data(cfg)
        train = {s: select_stage(rows, s) for s in stages}
        # Hold out a deterministic tail of each stage for the checkpoint-side eval, out of
        # every stage's training rows: a table row is in stages 1 and 2 alike.
        val = {}
        for s in stages:
            k = min(len(train[s]) // VAL_EVERY, cfg.run.eval_size)
            val[s] = train[s][len(train[s]) - k:]
        held = {id(ex) for s in stages for ex in val[s]}
        train = {s: [ex for ex in train[s] if id(ex) not in held] for s in stages}
    for s in stages:
        if not train[s]:
            hint = (" (it has no MathVista metadata for the stage filters: use --phase.mixture all=1.0)"
                    if cfg.run.data != "synthetic" and s != ALL and not has_stage_metadata(rows) else "")
            raise ConfigError(f"stage {s} has no training examples in {cfg.run.data!r} (the stage filters keep "
                              f"numeric free-form English rows){hint}; drop it from --phase.mixture or use other data")
        # The staged paper trained on MathVista `test`, whose answers are empty: its
        # correctness reward was silently 0 on every step. Refuse, loudly.
        require_gold_answers(train[s], f"{cfg.run.data} stage {s}")
    return train, val


def require_held_out_rows(cfg: TrainConfig, train: dict, val: dict) -> None:
    """ConfigError with one line when own data is too small for the rows a run holds out
    (load_training_data's (train, val) of it, whose stages are known to be non-empty): the
    end-of-run report's tenth (data/holdout.py) and each stage's fifth for the checkpoint
    evaluation. Run by the preflight, not by the loader: a few rows still load (and a
    run with --run.test_per_stage 0 needs no report rows)."""
    if cfg.run.data == "synthetic":
        return
    rows, test = load_own_data(cfg)
    if not test and cfg.run.test_per_stage > 0:
        raise ConfigError(f"--run.data: {cfg.run.data} has {len(rows)} usable rows, too few for the end-of-run "
                          f"report, which tests on a held-out tenth of them: give at least {TEST_EVERY} usable "
                          "rows, or --run.test_per_stage 0 to skip the report")
    for s in val:
        if not val[s]:  # an empty eval has no metrics, and the controller's gates read them
            raise ConfigError(f"--run.data: stage {s} of {cfg.run.data} has {len(train[s])} training rows, too few "
                              f"for the checkpoint evaluation, which holds out a fifth of them: give at least "
                              f"{VAL_EVERY} usable rows for it (after the report's tenth), or other data")


def report_examples(cfg: TrainConfig) -> tuple[list[Example], str]:
    """The end-of-run report's test rows and their description: the synthetic test split
    (run.test_per_stage per stage), or own data's held-out test rows (up to 3 x test_per_stage)."""
    if cfg.run.data == "synthetic":
        n = cfg.run.test_per_stage
        examples = [ex for s in (1, 2, 3) for ex in generate("test", s, n, cfg.run.seed, cfg.model.image_size)]
        return examples, f"synthetic test split, {n} per stage (stages 1-3), seed {cfg.run.seed}"
    _, test = load_own_data(cfg)
    test = test[: 3 * cfg.run.test_per_stage]
    return test, f"{cfg.run.data}: {len(test)} held-out test rows (data/holdout.py), never trained on"


def eval_subset(cfg: TrainConfig, val: dict) -> list:
    """A fixed held-out subset, split over the phase's stages by the mixture weights."""
    mix = cfg.phase.mixture if cfg.phase.name != "warmup" or ALL in cfg.phase.mixture else {s: 1.0 for s in val}
    total = sum(mix.values())
    out = []
    for s, p in sorted(mix.items(), key=lambda kv: str(kv[0])):
        out += val[s][: max(1, round(cfg.run.eval_size * p / total))]
    return out
