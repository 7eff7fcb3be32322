"""The per-phase checkpoint registry of a run directory: what exists, aliases, selectors.

Each phase directory (warmup, A, B, C) holds registry.json: the steps saved there, their
scores and aliases -> step. The registry is the only thing that says a checkpoint exists:
save_checkpoint (grpo/state/checkpoint.py) renames a complete directory into place first
and replaces the registry after, so `latest` never names a half-written directory.

Aliases (staged metric-gated paper): `latest`, and `best_structure`, `best_correctness`,
`best_composite` over the caller's scores (eval/scores.py computes them from the eval
rates). Only a strictly better score moves a best_* alias, so ties go to the earliest
checkpoint. Selectors name checkpoints across phases: `A:best_structure`, `B:latest`,
`B` (= B:latest), `B:40` / `B:step_000040`, or a path to a checkpoint directory.

Integrity. A registry whose entries are not step directories (``{"dir": "../../victim"}``)
is refused before anything is read or deleted: saves delete pruned checkpoints and the
leftovers of killed saves by these names. Periodic saves (between evaluations) are entries
marked "periodic": they move `latest` only, and the next save removes them unless an alias
holds them.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from eval.scores import SCORE_KEYS
from grpo.config_checks import PHASES
from grpo.run.lock import LOCK_FILE
from grpo.state.layout import FORMAT_VERSION, READABLE_VERSIONS, REGISTRY, STATE_FILE, CheckpointError

log = logging.getLogger(__name__)

ALIASES = ("latest",) + tuple(f"best_{k}" for k in SCORE_KEYS)  # latest, best_structure, ...
_STEP_DIR = re.compile(r"step_\d{6,}")
T = TypeVar("T")


class SelectorError(ValueError):
    """A checkpoint selector names nothing; the message lists what the run directory holds."""


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def _empty_registry(phase: str) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "phase": phase, "checkpoints": [], "aliases": {}}


def _registry_problem(reg: Any, phase: str) -> str | None:
    """What is wrong with a registry's structure, or None.

    Every ``dir`` must be its step's own directory name: save_checkpoint deletes pruned
    dirs and leftovers by these names, so '../../victim' or another step's name would make
    it delete outside the run or a real checkpoint.
    """
    if not isinstance(reg, dict):
        return f"holds a JSON {type(reg).__name__}, not an object"
    missing = [k for k in ("checkpoints", "aliases") if k not in reg]
    if missing:
        return f"lacks {', '.join(map(repr, missing))}"
    if reg.get("format_version", 1) not in READABLE_VERSIONS:
        return f"has format_version {reg.get('format_version')!r}; this vlgrpo reads {READABLE_VERSIONS}"
    if reg.get("phase", phase) != phase:
        return f"says phase {reg.get('phase')!r} but lies in the directory of phase {phase!r}"
    if not isinstance(reg["checkpoints"], list) or not isinstance(reg["aliases"], dict):
        return "needs 'checkpoints' as a list and 'aliases' as an object"
    steps = []
    for i, c in enumerate(reg["checkpoints"]):
        if not isinstance(c, dict) or isinstance(c.get("step"), bool) or not isinstance(c.get("step"), int) \
                or c["step"] < 0:
            return f"entry {i} is not {{'step': int >= 0, 'dir': ..., 'scores': {{...}}}}"
        if c.get("dir") != step_dirname(c["step"]):
            return (f"entry for step {c['step']} has dir {c.get('dir')!r}; it must be that step's own "
                    f"directory {step_dirname(c['step'])!r}")
        if not isinstance(c.get("scores", {}), dict) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in c.get("scores", {}).values()):
            return f"entry for step {c['step']} has scores {c.get('scores')!r}, not name -> number"
        digest = c.get("state_sha256")
        if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            return f"entry for step {c['step']} has state_sha256 {digest!r}, not a sha256 hex digest"
        steps.append(c["step"])
    if steps != sorted(set(steps)):
        return f"lists steps {steps}, which are not strictly increasing"
    for alias, step in reg["aliases"].items():
        if isinstance(step, bool) or not isinstance(step, int) or step not in steps:
            return f"alias {alias!r} points to {step!r}, which is not one of its steps {steps}"
    if steps and reg["aliases"].get("latest") != steps[-1]:
        return f"has latest={reg['aliases'].get('latest')!r} but its newest step is {steps[-1]}"
    return None


def read_registry(run_dir: str | Path, phase: str) -> dict[str, Any]:
    """The phase's registry: {"checkpoints": [{"step", "dir", "scores"}...], "aliases": {alias: step}}.

    Checked before anything uses it (see _registry_problem); a damaged one is a CheckpointError.
    """
    path = Path(run_dir) / phase / REGISTRY
    if not path.exists():
        return _empty_registry(phase)
    why = "it is only ever replaced atomically, so the disk or an outside edit damaged it: restore it or start a new run_dir"
    try:
        reg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); {why}") from None
    problem = _registry_problem(reg, phase)
    if problem:
        raise CheckpointError(f"{path} {problem}; {why}")
    return reg


def move_aliases(reg: dict[str, Any], step: int, scores: dict[str, float]) -> None:
    """latest -> this step; best_x -> this step only if its score is strictly higher."""
    aliases = reg["aliases"]
    aliases["latest"] = step
    by_step = {c["step"]: c for c in reg["checkpoints"]}
    for key in SCORE_KEYS:
        alias = f"best_{key}"
        if key not in scores:
            continue
        holder = aliases.get(alias)
        if holder is None or scores[key] > by_step[holder]["scores"][key]:
            aliases[alias] = step


def prune(reg: dict[str, Any], keep_last: int | None) -> list[str]:
    """Drop the oldest checkpoints no alias points to beyond `keep_last`; returns their dirs."""
    if keep_last is None:
        return []
    held = set(reg["aliases"].values())
    free = [c for c in reg["checkpoints"] if c["step"] not in held]
    doomed = free[: max(len(free) - keep_last, 0)]
    gone = {c["step"] for c in doomed}
    reg["checkpoints"] = [c for c in reg["checkpoints"] if c["step"] not in gone]
    return [c["dir"] for c in doomed]


def prune_periodic(reg: dict[str, Any]) -> list[str]:
    """Drop every periodic checkpoint but the newest one when no alias holds it; returns their dirs."""
    held = set(reg["aliases"].values())
    newest = reg["checkpoints"][-1]["step"] if reg["checkpoints"] else None
    doomed = [c for c in reg["checkpoints"] if c.get("periodic") and c["step"] not in held and c["step"] != newest]
    gone = {c["step"] for c in doomed}
    reg["checkpoints"] = [c for c in reg["checkpoints"] if c["step"] not in gone]
    return [c["dir"] for c in doomed]


def clean_leftovers(phase_dir: Path, reg: dict[str, Any]) -> None:
    """Remove what killed saves left: temporary dirs/files, and step dirs the registry never took."""
    known = {c["dir"] for c in reg["checkpoints"]}
    for p in phase_dir.iterdir():
        stale = p.name.startswith(".tmp-") or (p.is_dir() and _STEP_DIR.fullmatch(p.name) and p.name not in known)
        if not stale:
            continue
        log.info("removing leftover of an interrupted save: %s", p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- selectors


def describe_run(run_dir: str | Path) -> str:
    """One line per phase: its steps and where each alias points."""
    lines = []
    for phase in PHASES:
        reg = read_registry(run_dir, phase)
        if not reg["checkpoints"]:
            lines.append(f"  {phase}: no checkpoints")
            continue
        steps = ", ".join(str(c["step"]) for c in reg["checkpoints"])
        aliases = ", ".join(f"{a}=step {s}" for a, s in reg["aliases"].items())
        lines.append(f"  {phase}: steps {steps}; {aliases}")
    return "\n".join(lines)


def resolve(run_dir: str | Path, selector: str) -> Path:
    """'A:best_structure', 'B:latest', 'B', 'B:40', 'B:step_000040' or a checkpoint path -> its directory."""
    run_dir = Path(run_dir)
    phase, _, name = selector.partition(":")
    if phase in PHASES:
        reg = read_registry(run_dir, phase)
        name = name or "latest"
        steps = {c["step"] for c in reg["checkpoints"]}
        step = reg["aliases"].get(name)
        if step is None and name.removeprefix("step_").isdigit():
            step = int(name.removeprefix("step_"))
            step = step if step in steps else None
        if step is not None:
            path = run_dir / phase / step_dirname(step)
            if not (path / STATE_FILE).is_file():
                raise CheckpointError(f"{selector} -> {path}, which is missing or incomplete: "
                                      "the run directory was edited by hand")
            return path
        known = f"aliases are {', '.join(ALIASES)} or a step number"
        raise SelectorError(f"checkpoint selector {selector!r} names nothing in {run_dir} ({known}). "
                            f"It holds:\n{describe_run(run_dir)}")
    path = Path(selector)
    if (path / STATE_FILE).is_file():
        return path
    if (path / REGISTRY).is_file():  # a phase directory: its latest
        return resolve(path.parent, f"{path.name}:latest")
    hint = ""
    if selector == "base":
        hint = " ('base' is the untrained model: the trainer builds it, there is no checkpoint)"
    raise SelectorError(
        f"checkpoint selector {selector!r} is neither PHASE[:ALIAS] (phases {', '.join(PHASES)}; aliases "
        f"{', '.join(ALIASES)}) nor a checkpoint directory{hint}. {run_dir} holds:\n{describe_run(run_dir)}")


READ_ATTEMPTS = 5  # reads of a selector that a running trainer's saves may move; 5 saves in one read is a stuck disk
SETTLE_S = 0.2  # how long a reader gives a save in progress to replace its registry before calling a failed read damage


def _registry_bytes(run_dir: Path, phase: str) -> bytes | None:
    try:
        return (run_dir / phase / REGISTRY).read_bytes()
    except FileNotFoundError:
        return None


def _moved(run_dir: Path, phase: str, before: bytes | None) -> bool:
    """Whether the phase's registry changed since it read ``before``: at once, or, where a writer
    may be saving (its run.lock is there), once that save had SETTLE_S to replace it. (A save
    that replaces a step's periodic checkpoint renames the new directory in before it replaces
    the registry: a read in between fails with nothing changed yet.)"""
    if _registry_bytes(run_dir, phase) != before:
        return True
    if not (run_dir / LOCK_FILE).exists():
        return False
    time.sleep(SETTLE_S)
    return _registry_bytes(run_dir, phase) != before


def read_resolved(run_dir: str | Path, selector: str, load: Callable[[Path], T]) -> tuple[Path, T]:
    """(path, load(path)) for the checkpoint ``selector`` names, read safely while a trainer
    saves into ``run_dir``: readers (grpo.evaluate, grpo.export) take no lock (grpo/run/lock.py).

    A save never changes a checkpoint directory in place, and names a new one only once it is
    complete; but it moves ``latest`` and removes the periodic checkpoint ``latest`` named until
    then (or sets aside the one of the same step it replaces). A reader that resolved that
    checkpoint a moment before meets missing files, or a state.json the registry does not list,
    and ``load`` raises CheckpointError. When the phase's registry changed during the read
    (``_moved``), that is the run moving on, not damage: the selector is resolved again and the
    checkpoint it names now is read (up to READ_ATTEMPTS times). A load that fails with the
    registry unchanged is damage, raised as it is; so is any error of a path selector, which
    names one directory and nothing newer.
    """
    run_dir = Path(run_dir)
    phase = selector.partition(":")[0]
    for _ in range(READ_ATTEMPTS - 1):
        before = _registry_bytes(run_dir, phase) if phase in PHASES else None
        try:
            path = resolve(run_dir, selector)
            return path, load(path)
        except CheckpointError:
            if phase not in PHASES or not _moved(run_dir, phase, before):
                raise
            log.info("%s moved while it was read (a save in %s): reading it again", selector, run_dir)
    path = resolve(run_dir, selector)
    return path, load(path)
