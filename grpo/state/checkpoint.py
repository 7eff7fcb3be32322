"""Checkpoints: a per-phase registry with score aliases, atomic writes, no pickle.

Layout (one registry per curriculum phase; phases warmup, A, B, C):

    run_dir/
      A/
        registry.json              steps saved here, their scores, aliases -> step
        step_000020/
          adapter.safetensors      the tensors the trainer hands over (LoRA state + extras)
          optimizer.safetensors    optimiser state tensors (AdamW: exp_avg, exp_avg_sq, step)
          optimizer.json           the rest of optimizer.state_dict() (param_groups: lr, betas...)
          state.json               step, phase, scheduler, controller, RNG, data position,
                                   eval metrics, scores, the resolved config, each file's
                                   size and sha256
        step_000040/ ...
      B/ ...

Aliases (staged metric-gated paper): `latest`, and `best_structure`, `best_correctness`,
`best_composite` over the caller's scores (eval/scores.py computes them from the eval
rates). Only a strictly better score moves a best_* alias, so ties go to the earliest
checkpoint. Selectors name checkpoints across phases: `A:best_structure`, `B:latest`,
`B` (= B:latest), `B:40` / `B:step_000040`, or a path to a checkpoint directory.

Crash safety. A checkpoint is written into a temporary directory next to its final place,
every file is fsync'ed, the directory is renamed into place (rename is atomic within one
file system), and only then is registry.json replaced (write temp file, fsync, os.replace).
The registry is the only thing that says a checkpoint exists, so a kill at any moment
leaves either the old registry (pointing at complete, older checkpoints) or the new one
(pointing at a complete new one), never a `latest` that names a half-written directory.
Leftovers of a killed save (a `.tmp-*` directory, or a renamed step directory the registry
never learned about) are removed by the next save. A failed write (e.g. disk full) removes
its temporary directory and raises CheckpointError; older checkpoints are untouched.

Integrity. state.json records the size and sha256 of every tensor and optimiser file, and
the registry records the sha256 of each state.json, so one chain of digests covers every
byte a checkpoint holds: a truncated, flipped, garbage or swapped file is refused on load
with one CheckpointError line naming the file, never read as numbers. A registry whose
entries are not step directories (``{"dir": "../../victim"}``), or a state whose
``extra.base`` leaves the run directory, is refused before anything is read or deleted.
Non-finite tensors are never saved and never loaded. A resume whose latest checkpoint is
damaged continues from the newest intact one of its phase (``resume_point``), setting the
damaged ones aside as ``damaged-step_N`` directories instead of deleting them. Checkpoints
of format 1 (sizes, no digests) still load, with the size check only.

No pickle: tensors go to safetensors, everything else to JSON. torch.load of a pickle can
run arbitrary code, and a checkpoint directory is the kind of file people share.

Periodic saves (``periodic=True``: between evaluations, on a timer, a step count or a stop)
are registry entries marked "periodic": they move `latest` only, the next save removes them
unless an alias holds them, and a phase whose latest is one is not finished
(``phase_finished``), so the next command resumes it instead of starting the next phase.

Simplified: a single writer per run directory is assumed (no file locking), and steps in a
phase must increase (resuming from an older checkpoint of the same phase into the same
run directory is refused rather than branching the history).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eval.scores import SCORE_KEYS
from grpo.config import PHASES, ConfigError, TrainConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: sha256 digests of every file; 1 (sizes only) still loads
READABLE_VERSIONS = (1, 2)
ALIASES = ("latest",) + tuple(f"best_{k}" for k in SCORE_KEYS)  # latest, best_structure, ...
REGISTRY = "registry.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIM_TENSORS, OPTIM_JSON = "optimizer.safetensors", "optimizer.json"
STATE_FILE = "state.json"
DAMAGED_PREFIX = "damaged-"  # where resume_point sets damaged checkpoints aside (never deleted)
STATE_KEYS = ("phase", "step", "scheduler", "controller", "rng", "data_position", "metrics", "scores", "config", "files")
_STEP_DIR = re.compile(r"step_\d{6,}")
_BASE_REF = re.compile(r"(%s)/step_\d{6,}" % "|".join(PHASES))
# Config fields that only say how to run, not what a checkpoint's weights mean.
RUNTIME_ONLY_FIELDS = {"model.device", "model.gradient_checkpointing"}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what to do."""


class SelectorError(ValueError):
    """A checkpoint selector names nothing; the message lists what the run directory holds."""


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_base_ref(base: Any, where: str) -> str | None:
    """extra.base must be None or PHASE/step_N: a checkpoint inside the run directory.

    It is joined to the run directory to rebuild a policy, so anything else (an absolute
    path, '..') would make a shared checkpoint read weights from anywhere on the machine.
    """
    if base is None:
        return None
    if not isinstance(base, str) or not _BASE_REF.fullmatch(base):
        raise CheckpointError(f"{where}: extra.base={base!r} is not a checkpoint inside the run directory "
                              f"(PHASE/step_NNNNNN, phases {', '.join(PHASES)}): the file was edited; "
                              "restore it or use another checkpoint")
    return base


def _nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, int, int] | None:
    """(name, non-finite count, numel) of the first floating tensor holding NaN or inf."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return name, int((~torch.isfinite(t)).sum()), t.numel()
    return None


# ----------------------------------------------------------------------------- durable file I/O


def _write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync one file. Every byte a checkpoint writes goes through here."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (the directory entry itself must reach the disk)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles (Windows): rename durability is the OS's
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _json_bytes(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, indent=1).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be plain JSON data (dict/list/str/number/bool/None): {e}") from None


def _replace_json(path: Path, obj: Any) -> None:
    """Atomically replace a JSON file: temp file in the same directory, fsync, os.replace."""
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        _write_bytes(tmp, _json_bytes(obj, path.name))
        os.replace(tmp, path)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


# ----------------------------------------------------------------------------- tensors inside JSON structures


def _split_tensors(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """Nested state -> JSON, moving every tensor into `tensors` under a dotted key.

    Tuples and non-string dict keys (optimizer state is keyed by parameter index) are
    tagged so `_join_tensors` rebuilds exactly what went in.
    """
    if isinstance(obj, torch.Tensor):
        # A private CPU copy: safetensors refuses tensors that share storage, and the
        # trainer keeps training while the bytes are written. Costs one copy of the state.
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: _split_tensors(v, tensors, f"{key}.{k}") for k, v in obj.items()}
        return {"__items__": [[k, _split_tensors(v, tensors, f"{key}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split_tensors(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split_tensors(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{key}: cannot store a {type(obj).__name__} without pickle; "
                    "use tensors, numbers, strings, lists, dicts")


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: _join_tensors(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(_join_tensors(v, tensors) for v in obj["__tuple__"])
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


# ----------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """Python, NumPy (legacy global), torch CPU and every CUDA device's RNG state, as JSON."""
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {
        "python": [version, list(py_state), gauss],
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch_cpu": _b64(torch.get_rng_state()),  # 5056 bytes of Mersenne Twister state
        "torch_cuda": cuda,
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Undo capture_rng(): the next random draws repeat the ones after the capture."""
    missing = [k for k in ("python", "numpy", "torch_cpu", "torch_cuda") if k not in state]
    if missing:
        raise ValueError(f"RNG state lacks {', '.join(missing)}: "
                         "pass the dict from capture_rng() / LoadedCheckpoint.rng")
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    n = state["numpy"]
    keys = np.asarray(n["keys"], dtype=np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    cuda = state["torch_cuda"]
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            log.warning("checkpoint has RNG states for %d CUDA devices, this machine has %d: restoring the common ones",
                        len(cuda), torch.cuda.device_count())
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), device=i)
    elif cuda:
        log.warning("checkpoint has CUDA RNG states but CUDA is not available: sampling will not repeat exactly")


# ----------------------------------------------------------------------------- registry


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


def _move_aliases(reg: dict[str, Any], step: int, scores: dict[str, float]) -> None:
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


def _prune(reg: dict[str, Any], keep_last: int | None) -> list[str]:
    """Drop the oldest checkpoints no alias points to beyond `keep_last`; returns their dirs."""
    if keep_last is None:
        return []
    held = set(reg["aliases"].values())
    free = [c for c in reg["checkpoints"] if c["step"] not in held]
    doomed = free[: max(len(free) - keep_last, 0)]
    gone = {c["step"] for c in doomed}
    reg["checkpoints"] = [c for c in reg["checkpoints"] if c["step"] not in gone]
    return [c["dir"] for c in doomed]


def _prune_periodic(reg: dict[str, Any]) -> list[str]:
    """Drop every periodic checkpoint but the newest one when no alias holds it; returns their dirs."""
    held = set(reg["aliases"].values())
    newest = reg["checkpoints"][-1]["step"] if reg["checkpoints"] else None
    doomed = [c for c in reg["checkpoints"] if c.get("periodic") and c["step"] not in held and c["step"] != newest]
    gone = {c["step"] for c in doomed}
    reg["checkpoints"] = [c for c in reg["checkpoints"] if c["step"] not in gone]
    return [c["dir"] for c in doomed]


def _clean_leftovers(phase_dir: Path, reg: dict[str, Any]) -> None:
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


# ----------------------------------------------------------------------------- save


def _optimizer_payload(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], Any]:
    """optimizer.state_dict() -> (tensors for safetensors, the rest as JSON).

    AdamW: state[i] = {step, exp_avg, exp_avg_sq} per parameter index i, param_groups =
    [{lr, betas, eps, weight_decay, ..., params: [i...]}].
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = _split_tensors(optimizer.state_dict(), tensors, "optim")
    return tensors, structure


def _check_save_args(
    phase: str, step: int, tensors: dict, scores: dict, config_json: str, keep_last: int | None
) -> dict[str, Any]:
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: use one of {', '.join(PHASES)}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: must be a non-negative int")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 0):
        raise ValueError(f"keep_last={keep_last!r}: must be None (keep all) or an int >= 0")
    bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"tensors must map names to torch.Tensor; bad entries: {bad[:5]}")
    unknown = set(scores) - set(SCORE_KEYS)
    if unknown:
        raise ValueError(f"scores has unknown keys {sorted(unknown)}: "
                         f"use {', '.join(SCORE_KEYS)} (eval.scores.all_scores)")
    for k, v in scores.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise ValueError(f"scores[{k!r}]={v!r}: must be a number (not NaN)")
    try:
        return json.loads(config_json)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config_json is not JSON ({e}): pass TrainConfig.to_json()") from None


def save_checkpoint(
    run_dir: str | Path,
    phase: str,
    step: int,
    *,
    tensors: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    scheduler_state: dict,
    controller_state: dict,
    data_position: int,
    metrics: dict,
    scores: dict,
    config_json: str,
    extra: dict | None = None,
    rng: dict | None = None,
    keep_last: int | None = None,
    periodic: bool = False,
) -> Path:
    """Write one checkpoint atomically, register it, move its aliases; returns its directory.

    scores: {"structure", "correctness", "composite"} (any subset; a missing score leaves
    its alias alone). rng: capture_rng() is taken now unless given. keep_last: keep at
    most this many checkpoints that no alias points to (None = keep all).
    periodic: a save between evaluations (timer, step count or a stop): it moves `latest`
    only, and the next save removes it unless an alias still holds it, so periodic saves
    cost the disk one checkpoint. The next save may be of the same step (the evaluation a
    stop abandoned, redone on resume): it then replaces the periodic one.
    """
    config = _check_save_args(phase, step, tensors, scores, config_json, keep_last)
    check_base_ref((extra or {}).get("base"), "save_checkpoint")
    phase_dir = Path(run_dir) / phase
    phase_dir.mkdir(parents=True, exist_ok=True)
    reg = read_registry(run_dir, phase)
    replaces = bool(reg["checkpoints"]) and step == reg["aliases"]["latest"] and reg["checkpoints"][-1].get("periodic")
    if reg["checkpoints"] and step <= reg["aliases"]["latest"] and not replaces:
        raise CheckpointError(
            f"{phase_dir} already holds step {reg['aliases']['latest']} (latest) and step {step} is not after it: "
            f"continue from {phase}:latest, or use a new run_dir to branch from an older checkpoint")
    _clean_leftovers(phase_dir, reg)

    name = step_dirname(step)
    final = phase_dir / name
    tmp = phase_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    # Serialise everything before touching the disk, so a TypeError costs no cleanup.
    adapter = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    payloads = {ADAPTER_FILE: adapter}
    if optimizer is not None:
        opt_tensors, opt_structure = _optimizer_payload(optimizer)
        payloads[OPTIM_TENSORS] = opt_tensors
    for fname, group in payloads.items():
        # A NaN adapter saved as `latest` would be resumed and evaluated as if it were a model.
        bad = _nonfinite(group)
        if bad:
            raise CheckpointError(f"refusing to save step {step} of phase {phase}: {fname} tensor {bad[0]!r} has "
                                  f"{bad[1]} non-finite values (NaN/inf) of {bad[2]}; nothing was written, "
                                  "earlier checkpoints are intact")
    files: dict[str, bytes] = {fname: st_save(group) for fname, group in payloads.items()}
    if optimizer is not None:
        files[OPTIM_JSON] = _json_bytes(opt_structure, "optimizer state")
    state = {
        "format_version": FORMAT_VERSION,
        "phase": phase,
        "step": step,
        "data_position": int(data_position),
        "scheduler": scheduler_state,
        "controller": controller_state,
        "metrics": metrics,
        "scores": dict(scores),
        "rng": rng if rng is not None else capture_rng(),
        "config": config,
        "extra": extra or {},
        # checked on load: the size catches truncation, the digest every other change
        "files": {n: {"size": len(b), "sha256": _sha256(b)} for n, b in files.items()},
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
    }
    files[STATE_FILE] = _json_bytes(state, "checkpoint state (scheduler/controller/metrics/extra)")

    try:
        tmp.mkdir()
        for fname, data in files.items():
            _write_bytes(tmp / fname, data)
        _fsync_dir(tmp)
        if replaces:  # the periodic checkpoint of this step steps aside (a .tmp- name: a leftover if killed here)
            os.rename(final, phase_dir / f".tmp-replaced-{name}-{uuid.uuid4().hex[:8]}")
        os.rename(tmp, final)
        _fsync_dir(phase_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = "the disk is full" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not write checkpoint {final} ({why}); nothing was registered and earlier checkpoints "
            f"are intact. Free space (or pass keep_last to prune) and save again.") from e

    # The directory is complete: now make it exist, in one atomic registry replace.
    if replaces:
        reg["checkpoints"].pop()
    entry = {"step": step, "dir": name, "scores": dict(scores), "state_sha256": _sha256(files[STATE_FILE])}
    if periodic:
        entry["periodic"] = True
    reg["checkpoints"].append(entry)  # the digest closes the chain
    reg["format_version"] = FORMAT_VERSION
    _move_aliases(reg, step, scores)
    doomed = _prune(reg, keep_last) + _prune_periodic(reg)
    try:
        _replace_json(phase_dir / REGISTRY, reg)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {final} was written but {phase_dir / REGISTRY} could not be updated ({e}); "
            f"the registry still lists only the earlier checkpoints. Free space and save again.") from e
    for d in doomed:  # after the registry forgot them: a kill here leaves only leftovers
        shutil.rmtree(phase_dir / d, ignore_errors=True)
    for p in phase_dir.glob(f".tmp-replaced-{name}-*"):
        shutil.rmtree(p, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- load


@dataclass
class LoadedCheckpoint:
    path: Path
    phase: str
    step: int
    tensors: dict[str, torch.Tensor]
    scheduler_state: dict
    controller_state: dict
    rng: dict  # pass to restore_rng() for an exact same-phase resume
    data_position: int
    metrics: dict
    scores: dict
    config_json: str
    extra: dict = field(default_factory=dict)
    optimizer_state: Any = None  # AdamW's state dict as saved (None: saved without one)

    def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the saved optimiser state (AdamW's moments) into ``optimizer``, in place."""
        if self.optimizer_state is None:
            raise CheckpointError(f"{self.path} was saved without optimiser state: "
                                  "load it with optimizer=None (fresh optimiser)")
        try:
            optimizer.load_state_dict(self.optimizer_state)  # casts state to each parameter's device/dtype
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"optimiser state in {self.path} does not fit this optimiser ({e}): "
                                  "same parameters in the same order are needed (same LoRA rank and targets)") from None


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} {what}: the checkpoint was damaged or replaced after saving; "
                           "use an earlier checkpoint, or restore this one from a copy")


def _file_specs(state: dict, state_path: Path) -> dict[str, tuple[int, str | None]]:
    """state["files"] -> {name: (size, sha256 or None)}; format 1 recorded sizes only."""
    specs = {}
    files = state["files"]
    if not isinstance(files, dict):
        raise _damaged(state_path, f"has files={files!r}, not an object")
    for name, spec in files.items():
        if isinstance(spec, int) and not isinstance(spec, bool):  # format 1
            specs[name] = (spec, None)
        elif isinstance(spec, dict) and isinstance(spec.get("size"), int) and isinstance(spec.get("sha256"), str):
            specs[name] = (spec["size"], spec["sha256"])
        else:
            raise _damaged(state_path, f"records file {name!r} as {spec!r}, not its size and sha256")
    return specs


def _read_checked(path: Path, specs: dict[str, tuple[int, str | None]], fname: str) -> bytes:
    """The bytes of one checkpoint file, after its recorded size and digest are checked."""
    file = path / fname
    if fname not in specs:
        raise _damaged(path / STATE_FILE, f"does not list {fname}")
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise _damaged(file, "is missing") from None
    except OSError as e:  # a directory in its place, unreadable, ...
        raise _damaged(file, f"cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    size, digest = specs[fname]
    if len(data) != size:
        raise _damaged(file, f"has {len(data)} bytes, expected {size}")
    if digest is not None and _sha256(data) != digest:
        raise _damaged(file, "does not match the sha256 recorded in state.json")
    return data


def _tensors(path: Path, specs: dict, fname: str) -> dict[str, torch.Tensor]:
    data = _read_checked(path, specs, fname)
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as e:  # a format-1 checkpoint has no digest to catch this first
        raise _damaged(path / fname, f"is not a valid safetensors file ({e})") from None
    bad = _nonfinite(tensors)
    if bad:
        raise CheckpointError(f"{path / fname}: tensor {bad[0]!r} has {bad[1]} non-finite values (NaN/inf) of "
                              f"{bad[2]}; vlgrpo never saves such a checkpoint, so it was made or edited "
                              "elsewhere: use another checkpoint")
    return tensors


def _registry_entry(path: Path) -> dict | None:
    """The registry entry of a checkpoint directory inside a phase directory, if any."""
    phase = path.parent.name
    if phase not in PHASES or not (path.parent / REGISTRY).is_file():
        return None
    reg = read_registry(path.parent.parent, phase)
    return next((c for c in reg["checkpoints"] if c["dir"] == path.name), None)


def _read_state(path: Path) -> dict[str, Any]:
    """state.json of a checkpoint directory, checked against its registry digest and for shape."""
    state_path = path / STATE_FILE
    if not state_path.is_file():
        if path.is_dir() and (path / ADAPTER_FILE).exists():
            raise _damaged(state_path, "is missing")
        raise CheckpointError(f"{path} is not a checkpoint directory (no {STATE_FILE}); "
                              "use resolve(run_dir, selector) to find one")
    try:
        raw = state_path.read_bytes()
    except OSError as e:
        raise _damaged(state_path, f"cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    entry = _registry_entry(path)
    if entry is not None and entry.get("state_sha256") and _sha256(raw) != entry["state_sha256"]:
        raise _damaged(state_path, f"does not match the sha256 recorded in {path.parent / REGISTRY}")
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(state_path, f"is not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise _damaged(state_path, f"holds a JSON {type(state).__name__}, not an object")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise _damaged(state_path, f"lacks {', '.join(missing)}")
    if state.get("format_version", 1) not in READABLE_VERSIONS:
        raise CheckpointError(f"{state_path} has format_version {state.get('format_version')!r}; this vlgrpo "
                              f"reads {READABLE_VERSIONS}: load it with the version that wrote it")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or state["phase"] not in PHASES:
        raise _damaged(state_path, f"has step={step!r}, phase={state['phase']!r}")
    if entry is not None and (step != entry["step"] or state["phase"] != path.parent.name):
        raise _damaged(state_path, f"is step {step} of phase {state['phase']}, but the registry lists it "
                       f"as step {entry['step']} of phase {path.parent.name} (a checkpoint copied into place?)")
    if not isinstance(state.get("extra", {}), dict) or not isinstance(state["config"], dict) \
            or isinstance(state["data_position"], bool) or not isinstance(state["data_position"], int):
        raise _damaged(state_path, "has extra/config that are not objects or a data_position that is not an int")
    check_base_ref(state.get("extra", {}).get("base"), str(state_path))
    return state


def load_checkpoint(
    path: str | Path, optimizer: torch.optim.Optimizer | None = None, device: str | torch.device = "cpu"
) -> LoadedCheckpoint:
    """Read a checkpoint directory; if `optimizer` is given, restore its state in place.

    Every file state.json lists is checked (size, sha256, safetensors format, finite
    tensors) whether or not its contents are needed: a checkpoint loads whole or not at
    all, so a resume never meets a damaged optimiser file after the adapter looked fine.
    Any problem is one CheckpointError naming the file.
    """
    path = Path(path)
    state = _read_state(path)
    state_path = path / STATE_FILE
    specs = _file_specs(state, state_path)
    tensors = _tensors(path, specs, ADAPTER_FILE)
    opt_state = None
    if OPTIM_JSON in specs:
        opt_tensors = _tensors(path, specs, OPTIM_TENSORS)
        try:
            opt_state = _join_tensors(json.loads(_read_checked(path, specs, OPTIM_JSON)), opt_tensors)
        except (UnicodeDecodeError, ValueError) as e:
            raise _damaged(path / OPTIM_JSON, f"is not valid JSON ({e})") from None
        except (KeyError, TypeError) as e:
            raise _damaged(path / OPTIM_JSON, f"names tensors {OPTIM_TENSORS} does not hold ({e})") from None
    tensors = {k: v.to(device) for k, v in tensors.items()}
    loaded = LoadedCheckpoint(
        path=path,
        phase=state["phase"],
        step=state["step"],
        tensors=tensors,
        scheduler_state=state["scheduler"],
        controller_state=state["controller"],
        rng=state["rng"],
        data_position=state["data_position"],
        metrics=state["metrics"],
        scores=state["scores"],
        config_json=json.dumps(state["config"], indent=2),
        extra=state.get("extra", {}),
        optimizer_state=opt_state,
    )
    if optimizer is not None:
        loaded.restore_optimizer(optimizer)
    return loaded


# ----------------------------------------------------------------------------- resume


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
        _move_aliases(new, c["step"], c.get("scores", {}))
    _replace_json(phase_dir / REGISTRY, new)
    moved = {}
    for step in sorted(steps):
        src = phase_dir / step_dirname(step)
        dst = phase_dir / f"{DAMAGED_PREFIX}{step_dirname(step)}"
        if dst.exists():
            dst = dst.with_name(f"{dst.name}-{uuid.uuid4().hex[:8]}")
        if src.exists():
            os.rename(src, dst)
            moved[step] = dst
    _fsync_dir(phase_dir)
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
    from grpo.config import trains_from_scratch

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
        state = _read_state(Path(run_dir) / phase / last["dir"])
    except CheckpointError:
        return False
    return last["step"] >= planned_steps(state["config"])


def is_periodic(path: str | Path) -> bool:
    """Whether a checkpoint directory is a periodic (between-evaluations) save of its phase."""
    entry = _registry_entry(Path(path))
    return bool(entry and entry.get("periodic"))


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


# ----------------------------------------------------------------------------- compatibility


def _meaning(cfg: dict[str, Any], kind: str | None = None) -> dict[str, Any]:
    """The flattened model + lora fields that change what a checkpoint's weights mean.

    A base checkpoint (``extra.kind == "base"``: the tiny warm-up's full-precision weights)
    means the same whether a later phase quantises it or not, so model.load_in_4bit is
    not part of its meaning; an adapter was trained against one of the two and is.
    """
    out = {}
    for sec in ("model", "lora"):
        for k, v in (cfg.get(sec) or {}).items():
            if f"{sec}.{k}" not in RUNTIME_ONLY_FIELDS and not (kind == "base" and f"{sec}.{k}" == "model.load_in_4bit"):
                out[f"{sec}.{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def _saved_config(run_dir: Path, phase: str, reg: dict) -> tuple[int, dict, str | None] | None:
    """(step, config, extra.kind) of the newest checkpoint of a phase whose state.json reads; None if none does.

    Only a compatibility check: the resume itself verifies every file, and reports damage.
    """
    for c in sorted(reg["checkpoints"], key=lambda c: -c["step"]):
        try:
            state = _read_state(run_dir / phase / c["dir"])
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
        diffs = _diffs(_meaning(saved[1], saved[2]), _meaning(json.loads(config.to_json()), saved[2]))
        if diffs:
            raise ConfigError(
                f"run_dir {run_dir} holds checkpoints ({phase} step {saved[0]}) made with a different "
                f"model/LoRA config: {'; '.join(diffs)}. Set these back, or use a new --run.run_dir.")


def check_init_compatible(path: str | Path, config: TrainConfig) -> None:
    """Refuse to start a phase from a checkpoint (--init PATH) made with another model or LoRA setup."""
    state = _read_state(Path(path))
    kind = (state.get("extra") or {}).get("kind")
    diffs = _diffs(_meaning(state["config"], kind), _meaning(json.loads(config.to_json()), kind))
    if diffs:
        raise ConfigError(f"--init {path} was made with a different model/LoRA config: {'; '.join(diffs)}. "
                          "Set these back, or start from another checkpoint.")


# Settings a same-phase resume must keep: they define what one step is (G completions of B
# prompts of at most L tokens, accumulated over micro-batches) and which data comes next
# (the saved data position counts draws from this exact stream).
RESUME_FIXED_FIELDS = ("sampling.G", "sampling.max_new_tokens", "phase.prompts_per_step", "optim.accumulation",
                       "optim.updates_per_batch", "sampling.dynamic_sampling",
                       "phase.mixture", "run.seed", "run.data", "run.train_per_stage")
# The warm-up's step: B examples from its mixture, the caption stage first (its length moves
# where the reasoning stage, and the style draws, begin).
WARMUP_FIXED_FIELDS = ("phase.prompts_per_step", "phase.perception_steps", "phase.mixture", "run.seed", "run.data",
                       "run.train_per_stage")


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
            f"would change what a step is or which data comes next. Set these back, or use a new --run.run_dir.")
