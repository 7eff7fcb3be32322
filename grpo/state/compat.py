"""Whether a config fits the checkpoints already on disk.

Any checkpoint: the same model and LoRA setup, the fields that change what its weights mean
(``check_compatible`` for a run directory, ``check_init_compatible`` for --init). A
same-phase resume: also the settings that define what one step is and which data comes
next (``check_resumable``). A field added after a run was saved compares as its default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo.config import TrainConfig
from grpo.config_checks import PHASES
from grpo.errors import ConfigError
from grpo.state.checkpoint import read_state
from grpo.state.layout import CheckpointError
from grpo.state.registry import read_registry
from grpo.state.resume import phase_finished

# Config fields that only say how to run, not what a checkpoint's weights mean.
# (optim.micro_batch_rows and optim.logits_chunk_tokens are in "optim", which _meaning never reads:
# they change how a step is computed, not what it computes.)
# The image and prompt bounds change what enters the model, not what its weights mean.
RUNTIME_ONLY_FIELDS = {"model.device", "model.gradient_checkpointing", "model.max_pixels", "model.min_pixels",
                       "model.max_prompt_tokens"}


# The vision adapters' switches: a phase may add them over a checkpoint made without them (new
# adapters start with B = 0, the function the checkpoint computed), never drop trained ones or
# change where they sit. A same-phase resume keeps them as they are (RESUME_FIXED_FIELDS).
VISION_FIELDS = ("lora.vision", "lora.vision_targets", "lora.merger")


def _vision_diffs(saved: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What of the vision switches a checkpoint made with ``saved`` forbids under ``want``."""
    s, w = saved.get("lora") or {}, want.get("lora") or {}
    out = [f"lora.{k}: saved {s[k]!r}, now {w.get(k)!r} (its trained adapters would be dropped)"
           for k in ("vision", "merger") if s.get(k) and not w.get(k)]
    if s.get("vision") and w.get("vision") and list(s.get("vision_targets") or []) != list(w.get("vision_targets") or []):
        out.append(f"lora.vision_targets: saved {list(s['vision_targets'])!r}, now {list(w['vision_targets'])!r}")
    return out


def _meaning(cfg: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
    """The flattened model + lora fields that change what a checkpoint's weights mean.

    A base checkpoint (``extra.kind == "base"``: the tiny warm-up's full-precision weights)
    means the same whether a later phase quantises it or not, so model.load_in_4bit is
    not part of its meaning; an adapter was trained against one of the two and is.
    """
    out = {}
    for sec in ("model", "lora"):
        for k, v in (cfg.get(sec) or {}).items():
            key = f"{sec}.{k}"
            quantisation_of_a_base = kind == "base" and key == "model.load_in_4bit"
            if key not in RUNTIME_ONLY_FIELDS and key not in VISION_FIELDS and not quantisation_of_a_base:
                out[key] = list(v) if isinstance(v, tuple) else v
    return out


def _saved_config(run_dir: Path, phase: str, reg: dict) -> tuple[int, dict, str | None] | None:
    """(step, config, extra.kind) of the newest checkpoint of a phase whose state.json reads; None if none does.

    Only a compatibility check: the resume itself verifies every file, and reports damage.
    """
    for c in sorted(reg["checkpoints"], key=lambda c: -c["step"]):
        try:
            state = read_state(run_dir / phase / c["dir"])
        except CheckpointError:
            continue
        return c["step"], state["config"], (state.get("extra") or {}).get("kind")
    return None


def _diffs(saved: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [f"{k}: saved {saved.get(k, '<missing>')!r}, now {want.get(k, '<missing>')!r}"
            for k in sorted(set(saved) | set(want)) if saved.get(k) != want.get(k)]


def check_compatible(run_dir: str | Path, config: TrainConfig) -> None:
    """Refuse a run directory whose checkpoints were made with another model or LoRA setup."""
    run_dir = Path(run_dir)
    for phase in PHASES:
        reg = read_registry(run_dir, phase)
        saved = _saved_config(run_dir, phase, reg) if reg["checkpoints"] else None
        if saved is None:
            continue
        now = json.loads(config.to_json())
        diffs = _diffs(_meaning(saved[1], saved[2]), _meaning(now, saved[2])) + _vision_diffs(saved[1], now)
        if diffs:
            raise ConfigError(
                f"run_dir {run_dir} holds checkpoints ({phase} step {saved[0]}) made with a different "
                f"model/LoRA config: {'; '.join(diffs)}. Set these back, or use a new --run.run_dir.")


def check_init_compatible(path: str | Path, config: TrainConfig) -> None:
    """Refuse to start a phase from a checkpoint (--init PATH) made with another model or LoRA setup."""
    state = read_state(Path(path))
    kind = (state.get("extra") or {}).get("kind")
    now = json.loads(config.to_json())
    diffs = _diffs(_meaning(state["config"], kind), _meaning(now, kind)) + _vision_diffs(state["config"], now)
    if diffs:
        raise ConfigError(f"--init {path} was made with a different model/LoRA config: {'; '.join(diffs)}. "
                          "Set these back, or start from another checkpoint.")


# Settings a same-phase resume must keep: they define what one step is (G completions of B
# prompts of at most L tokens, accumulated over micro-batches) and which data comes next
# (the saved data position counts draws from this exact stream; dynamic sampling's accuracy
# band decides which groups are refilled, so how many draws a step takes; guided groups, which rows
# a step trains on). The reward plug-ins too: the
# saved controller's weights name them, and the resume imports them again from these specs.
RESUME_FIXED_FIELDS = ("sampling.G", "sampling.max_new_tokens", "phase.prompts_per_step", "optim.accumulation",
                       "optim.updates_per_batch", "sampling.dynamic_sampling", "sampling.accuracy_low",
                       "sampling.accuracy_high",
                       "phase.mixture", "run.seed", "run.data", "run.train_per_stage", "data.columns",
                       "data.max_images", "rewards.extra", *VISION_FIELDS, "sampling.noisy_fraction", "sampling.noise_std",
                       "sampling.guided")
# The warm-up's step: B examples from its mixture, the caption stage first (its length moves
# where the reasoning stage, and the style draws, begin).
WARMUP_FIXED_FIELDS = ("phase.prompts_per_step", "phase.perception_steps", "phase.mixture", "run.seed", "run.data",
                       "run.train_per_stage", "data.columns", "data.max_images")


def check_resumable(run_dir: str | Path, config: TrainConfig) -> None:
    """Refuse to resume config's phase under settings that change what its steps mean."""
    run_dir, phase = Path(run_dir), config.phase.name
    fixed = WARMUP_FIXED_FIELDS if phase == "warmup" else RESUME_FIXED_FIELDS
    reg = read_registry(run_dir, phase)
    if phase == "warmup" and phase_finished(run_dir, phase):  # done: the next phases only read it
        return
    saved = _saved_config(run_dir, phase, reg) if reg["checkpoints"] else None
    if saved is None:
        return
    now = json.loads(config.to_json())
    defaults = json.loads(type(config)().to_json())  # a field added later: older runs had its default

    def pick(cfg: dict) -> dict[str, Any]:
        out = {}
        for key in fixed:
            sec, name = key.split(".")
            value = (cfg.get(sec) or {}).get(name, defaults[sec][name])
            out[key] = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
        return out

    diffs = _diffs(pick(saved[1]), pick(now))
    if diffs:
        raise ConfigError(
            f"run_dir {run_dir} holds phase {phase} up to step {saved[0]}; resuming it with {'; '.join(diffs)} "
            f"would change what a step is, how it is rewarded or which data comes next. Set these back, "
            "or use a new --run.run_dir.")
