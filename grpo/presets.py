"""Presets: each phase's defaults on the embedded model, the named presets, and the one a model implies.

``phase_preset(phase)`` is TrainConfig() (grpo/config.py's dataclass defaults) with the
phase's entries of PHASE_DEFAULTS applied; a ``--preset`` (``preset_overrides``) and the
command line's overrides come after it (grpo/cli.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from grpo.config import PHASE_DEFAULTS, PHASE_INIT, TrainConfig
from grpo.config_checks import PHASES, trains_from_scratch
from grpo.errors import ConfigError
from grpo.overrides import apply_overrides


def phase_preset(phase: str) -> TrainConfig:
    """The defaults of one curriculum phase on the embedded tiny model."""
    if phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r}: use one of {', '.join(PHASES)}")
    cfg = TrainConfig()
    cfg.phase.name = phase
    # dicts copied: a config's weights or mixture must never alias the table's
    return apply_overrides(cfg, {k: dict(v) if isinstance(v, dict) else v for k, v in PHASE_DEFAULTS[phase].items()})


def phase_init(phase: str, model_name: str) -> str:
    """The checkpoint a phase starts from by default. Phase A starts from the pretrained
    base as loaded (the staged paper starts from Qwen2.5-VL-7B-Instruct); only a model
    trained from scratch starts A from its own warm-up, since RL on random weights learns
    nothing. ``--init warmup:latest`` starts A from a warm-up on any model."""
    if phase == "A" and trains_from_scratch(model_name):
        return "warmup:latest"
    return PHASE_INIT[phase]


# Named presets: config keys applied after the phase's defaults. Keys under "grpo" apply to
# the GRPO phases only: the warm-up samples no rollouts, and a rollout setting in its saved
# config would only mislabel it.
PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: tiny model, synthetic curriculum, CPU.
    # Rollouts from the merged copy: on this CPU 2.3x the plain path's decode tokens/s and a
    # 26% shorter GRPO step, its log-probs within 1e-3 of the trainer's (bench/RESULTS.md);
    # the sequence-level mask at C = 3 drops whatever a larger mismatch would make off-policy.
    "tiny": {"model.load_in_4bit": True,
             "grpo": {"sampling.rollout": "merged", "optim.rollout_correction": "sequence"}},
    # Qwen2.5-VL-7B-Instruct on one GPU, as in the staged paper: 4-bit base, rank-8 LoRA.
    "qwen7b": {
        "model.name": "Qwen/Qwen2.5-VL-7B-Instruct", "model.dtype": "bfloat16", "model.load_in_4bit": True,
        "model.image_size": 448, "model.gradient_checkpointing": True, "model.device": "cuda",
        # Real images are resized into [56^2, 448^2] px like the synthetic renders (which 448^2
        # leaves as they are): at most 256 visual tokens per image, not Qwen's 16384.
        "model.max_pixels": 448 * 448, "model.min_pixels": 56 * 56,
        "sampling.max_new_tokens": 256, "sampling.G": 8, "optim.lr": 1e-5, "phase.prompts_per_step": 8,
        # Training passes of 4 groups: the memory plan predicts an 11.8 GiB peak at these lengths
        # (a 16 GB card; all 64 rows at once: 16.7 GiB; python -m bench.memory --preset qwen7b).
        "optim.micro_batch_rows": 32,
        # 7B budgets: a greedy evaluation (and its shuffled-image control) decodes eval_size x 2
        # prompts x 256 tokens, so a smaller subset and a slower cadence than the tiny model's
        # 200 every 20 steps; a latest-only save every 10 steps (~10 minutes of a 7B step).
        "run.eval_size": 100, "run.eval_every": 40, "run.save_every": 10, "run.test_per_stage": 50,
        # The merged bf16 rollout copy (--sampling.rollout merged) samples from a slightly other
        # function than the NF4 + LoRA trainer: over 256 tokens a sequence-level ratio drifts far
        # from 1 (its log is a sum of 256 per-token terms), so weight each token, capped at 2
        # (TIS). With the plain path the sampler is the trainer and every weight is 1.
        "grpo": {"optim.rollout_correction": "token", "optim.rollout_correction_mode": "truncate",
                 "optim.rollout_correction_cap": 2.0},
    },
}


# Which preset a real Qwen2.5-VL trains with when --preset is not given. The released sizes
# by their language model's hidden_size (config.json); only the 7B has a preset. The others
# are refused rather than mapped to qwen7b: its memory plan (micro-batches, 448 px, 256
# tokens) and lr are the 7B's, a 72B does not fit where they fit and a 3B wastes the card;
# `--preset qwen7b` on them is a choice the user makes, not one made for them.
QWEN25VL_SIZES = {2048: "3B", 3584: "7B", 5120: "32B", 8192: "72B"}
SIZE_PRESETS = {"7B": "qwen7b"}
_REAL_SIZE = 1024  # hidden_size from which a Qwen2.5-VL is a real one, not a test-sized model


def _local_qwen_size(path: Any) -> str | None:
    """A local Qwen2.5-VL directory's size ("7B", or "hidden_size N" for an unknown one);
    None for a model of test size, another model type, or a config that cannot be read (the
    model load says what is wrong with it, later)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "qwen2_5_vl":
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    hidden = text.get("hidden_size", cfg.get("hidden_size"))
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < _REAL_SIZE:
        return None
    return QWEN25VL_SIZES.get(hidden, f"hidden_size {hidden}")


def preset_for_model(name: str) -> tuple[str, str] | None:
    """The preset a --model.name implies when no --preset is given: (preset, the line to
    print), or None to keep the default (tiny models, paths that do not exist: the model
    load reports those). A hub id or a local real-size Qwen2.5-VL that no preset fits is one
    ConfigError naming it and the presets. Reads at most a local config.json: nothing is
    loaded or downloaded, so it runs before the run's first check."""
    from pathlib import Path

    if name in ("tiny", "tiny-random"):
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        size = _local_qwen_size(path)
    elif not name.startswith((".", "/", "~")) and name.count("/") == 1 and not path.exists():  # a hub id
        m = re.search(r"qwen2\.5-vl-(\d+)b", name, re.IGNORECASE)
        if m is None:
            raise ConfigError(f"--model.name {name}: no preset is made for this model (presets: {', '.join(PRESETS)}, "
                              "for Qwen2.5-VL-7B); pass --preset explicitly")
        size = f"{m.group(1)}B"
    else:
        return None
    if size is None:
        return None
    preset = SIZE_PRESETS.get(size)
    if preset is None:
        raise ConfigError(f"--model.name {name} is a Qwen2.5-VL of {size}, and no preset is made for it (presets: "
                          f"{', '.join(PRESETS)}; qwen7b is Qwen2.5-VL-7B's); pass --preset qwen7b to start from the "
                          "7B's settings, and size the batch to your memory (--optim.micro_batch_rows)")
    return preset, (f"--model.name {name} is Qwen2.5-VL-{size}: using --preset {preset} (its dtype, 4-bit, image "
                    f"bounds, G, lr and budgets); --preset tiny or another --preset overrides this")


def preset_overrides(preset: str, phase: str) -> dict[str, Any]:
    """The keys a preset sets in one phase (its "grpo" keys in the GRPO phases only)."""
    keys = {k: v for k, v in PRESETS[preset].items() if k != "grpo"}
    return keys | (PRESETS[preset].get("grpo", {}) if phase != "warmup" else {})
