"""Where a phase resumes: its newest intact checkpoint, and whether it is finished.

A resume whose latest checkpoint is damaged continues from the newest intact one of its
phase (``resume_point``), setting the damaged ones aside as ``damaged-step_N`` directories
instead of deleting them. A phase whose latest checkpoint is a periodic save (between
evaluations: on a timer, a step count or a stop) is not finished (``phase_finished``), so
the next command resumes it instead of starting the next phase from it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from grpo.config_checks import trains_from_scratch
from grpo.state.checkpoint import LoadedCheckpoint, load_checkpoint, read_state, registry_entry
from grpo.state.durable import replace_json
from grpo.state.layout import REGISTRY, CheckpointError
from grpo.state.registry import move_aliases, read_registry, step_dirname
from grpo_infra.atomic import fsync_dir

DAMAGED_PREFIX = "damaged-"  # where resume_point sets damaged checkpoints aside (never deleted)


def _set_aside(run_dir: Path, phase: str, steps: set[int]) -> dict[int, Path]:
    """Take damaged checkpoints out of the registry and move their directories aside.

    They are renamed (never deleted: a damaged file is evidence, and may be recoverable) to
    a name the leftover cleaner does not touch. The registry is rewritten first, so a kill
    in between leaves only an unregistered step directory, which the next save removes.
    """
    phase_dir = run_dir / phase
    reg = read_registry(run_dir, phase)
    kept = [c for c in reg["checkpoints"] if c["step"] not in steps]
    new = dict(reg, checkpoints=[], aliases={})
    for c in kept:  # replaying the saves gives the aliases these checkpoints would have had
        new["checkpoints"].append(c)
        move_aliases(new, c["step"], c.get("scores", {}))
    replace_json(phase_dir / REGISTRY, new)
    moved = {}
    for step in sorted(steps):
        src = phase_dir / step_dirname(step)
        dst = phase_dir / f"{DAMAGED_PREFIX}{step_dirname(step)}"
        if dst.exists():
            dst = dst.with_name(f"{dst.name}-{uuid.uuid4().hex[:8]}")
        if src.exists():
            os.rename(src, dst)
            moved[step] = dst
    fsync_dir(phase_dir)
    return moved


def resume_point(run_dir: str | Path, phase: str, set_aside: bool = False
                 ) -> tuple[LoadedCheckpoint | None, list[tuple[int, str]]]:
    """The newest intact checkpoint of `phase` and (step, problem) of every newer damaged one.

    (None, []) when the phase has no checkpoints. If it has some but none is intact, a
    CheckpointError: a resume never restarts a phase from nothing without a word. With
    set_aside, the damaged ones leave the registry (their directories become damaged-step_N),
    so the resumed run can save those steps again.
    """
    run_dir = Path(run_dir)
    reg = read_registry(run_dir, phase)
    damaged: list[tuple[int, str]] = []
    found = None
    for c in sorted(reg["checkpoints"], key=lambda c: -c["step"]):
        try:
            found = load_checkpoint(run_dir / phase / c["dir"])
            break
        except CheckpointError as e:
            damaged.append((c["step"], str(e)))
    if found is None and damaged:
        step, why = damaged[0]
        raise CheckpointError(f"no intact checkpoint of phase {phase} in {run_dir}: all {len(damaged)} are damaged "
                              f"(step {step}: {why}); restore them from a copy or use a new run_dir")
    if damaged and set_aside:
        _set_aside(run_dir, phase, {s for s, _ in damaged})
    return found, damaged


def planned_steps(config: dict[str, Any]) -> int:
    """The optimiser steps a phase's config asks for (a saved state's "config"): the warm-up
    of a model trained from scratch counts its caption steps too."""
    phase = config.get("phase") or {}
    steps = int(phase.get("steps", 0))
    if phase.get("name") == "warmup" and trains_from_scratch(str((config.get("model") or {}).get("name", ""))):
        steps += int(phase.get("perception_steps", 0))
    return steps


def phase_finished(run_dir: str | Path, phase: str) -> bool:
    """Whether ``phase`` ran all the steps it was started with: its latest checkpoint is an
    evaluated one (not a periodic or stop save) at its own config's last step. A phase that
    was stopped or crashed mid-way is not finished, so the next command resumes it instead
    of starting the next phase from it. A damaged latest counts as unfinished (the resume
    deals with it)."""
    reg = read_registry(run_dir, phase)
    if not reg["checkpoints"]:
        return False
    last = reg["checkpoints"][-1]
    if last.get("periodic"):
        return False
    try:
        state = read_state(Path(run_dir) / phase / last["dir"])
    except CheckpointError:
        return False
    return last["step"] >= planned_steps(state["config"])


def is_periodic(path: str | Path) -> bool:
    """Whether a checkpoint directory is a periodic (between-evaluations) save of its phase."""
    entry = registry_entry(Path(path))
    return bool(entry and entry.get("periodic"))
