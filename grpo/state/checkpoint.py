"""Checkpoints: save and load one checkpoint directory, atomically, verified, no pickle.

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

The registry and its aliases are grpo/state/registry.py's, where a phase resumes is
grpo/state/resume.py's, and whether a config fits saved checkpoints grpo/state/compat.py's.

Crash safety. A checkpoint is written into a temporary directory next to its final place,
every file is fsync'ed, the directory is renamed into place (rename is atomic within one
file system), and only then is registry.json replaced (write temp file, fsync, os.replace).
The temporary names and the syncs are grpo_infra/atomic.py's; the order is this file's, because
the registry must follow the directory.
The registry is the only thing that says a checkpoint exists, so a kill at any moment
leaves either the old registry (pointing at complete, older checkpoints) or the new one
(pointing at a complete new one), never a `latest` that names a half-written directory.
Leftovers of a killed save (a `.tmp-*` directory, or a renamed step directory the registry
never learned about) are removed by the next save. A failed write (e.g. disk full) removes
its temporary directory and raises CheckpointError; older checkpoints are untouched.

Integrity. state.json records the size and sha256 of every tensor and optimiser file, and
the registry records the sha256 of each state.json, so one chain of digests covers every
byte a checkpoint holds: a truncated, flipped, garbage or swapped file is refused on load
with one CheckpointError line naming the file, never read as numbers. A state whose
``extra.base`` leaves the run directory is refused before anything is read. Non-finite
tensors are never saved and never loaded. Checkpoints of format 1 (sizes, no digests)
still load, with the size check only.

No pickle: tensors go to safetensors, everything else to JSON. torch.load of a pickle can
run arbitrary code, and a checkpoint directory is the kind of file people share.

Periodic saves (``periodic=True``: between evaluations, on a timer, a step count or a stop)
are registry entries marked "periodic": they move `latest` only, and the next save removes
them unless an alias holds them.

One writer per run directory: the commands that save here hold the directory's lock
(grpo/run/lock.py) from before their first write; save_checkpoint itself does not check it.
Readers take no lock: a directory is complete before the registry names it, and
grpo/state/registry.py ``read_resolved`` reads again a checkpoint a save removed meanwhile.

Simplified: steps in a phase must increase (resuming from an older checkpoint of the same
phase into the same run directory is refused rather than branching the history).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eval.scores import SCORE_KEYS
from grpo.config_checks import PHASES
from grpo.state import durable  # durable.write_bytes: looked up at each call, one seam for every byte
from grpo.state.durable import join_tensors, json_bytes, replace_json, sha256, split_tensors
from grpo.state.layout import (
    ADAPTER_FILE,
    FORMAT_VERSION,
    OPTIM_JSON,
    OPTIM_TENSORS,
    READABLE_VERSIONS,
    REGISTRY,
    STATE_FILE,
    CheckpointError,
)
from grpo.state.registry import clean_leftovers, move_aliases, prune, prune_periodic, read_registry, step_dirname
from grpo.state.rng import capture_rng
from grpo_infra.atomic import fsync_dir, temp_path

STATE_KEYS = ("phase", "step", "scheduler", "controller", "rng", "data_position", "metrics", "scores", "config", "files")
_BASE_REF = re.compile(r"(%s)/step_\d{6,}" % "|".join(PHASES))


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


# ----------------------------------------------------------------------------- save


def _optimizer_payload(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], Any]:
    """optimizer.state_dict() -> (tensors for safetensors, the rest as JSON).

    AdamW: state[i] = {step, exp_avg, exp_avg_sq} per parameter index i, param_groups =
    [{lr, betas, eps, weight_decay, ..., params: [i...]}].
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = split_tensors(optimizer.state_dict(), tensors, "optim")
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
    clean_leftovers(phase_dir, reg)

    name = step_dirname(step)
    final = phase_dir / name
    files = _checkpoint_files(phase, step, tensors, optimizer, dict(
        format_version=FORMAT_VERSION, phase=phase, step=step, data_position=int(data_position),
        scheduler=scheduler_state, controller=controller_state, metrics=metrics, scores=dict(scores),
        rng=rng if rng is not None else capture_rng(), config=config, extra=extra or {}))
    _write_directory(files, final, phase_dir, replaces)
    # The directory is complete: now make it exist, in one atomic registry replace.
    _register(reg, phase_dir, name, step, scores, sha256(files[STATE_FILE]), periodic, replaces, keep_last)
    return final


def _checkpoint_files(phase: str, step: int, tensors: dict[str, torch.Tensor],
                      optimizer: torch.optim.Optimizer | None, state: dict) -> dict[str, bytes]:
    """Every file of a checkpoint as bytes, serialised before anything touches the disk (a
    TypeError costs no cleanup): the adapter, the optimiser's tensors and structure, and
    ``state`` completed with the other files' sizes and digests, the time and torch's version."""
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
        files[OPTIM_JSON] = json_bytes(opt_structure, "optimizer state")
    state = {
        **state,
        # checked on load: the size catches truncation, the digest every other change
        "files": {n: {"size": len(b), "sha256": sha256(b)} for n, b in files.items()},
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
    }
    files[STATE_FILE] = json_bytes(state, "checkpoint state (scheduler/controller/metrics/extra)")
    return files


def _write_directory(files: dict[str, bytes], final: Path, phase_dir: Path, replaces: bool) -> None:
    """``files`` into a temporary directory, made durable, then renamed to ``final`` (which a
    periodic checkpoint of the same step ``replaces``); on an OSError nothing is left."""
    tmp = temp_path(final)
    try:
        tmp.mkdir()
        for fname, data in files.items():
            durable.write_bytes(tmp / fname, data)
        fsync_dir(tmp)
        if replaces:  # the periodic checkpoint of this step steps aside (a .tmp- name: a leftover if killed here)
            os.rename(final, temp_path(final, "replaced"))
        os.rename(tmp, final)
        fsync_dir(phase_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = "the disk is full" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not write checkpoint {final} ({why}); nothing was registered and earlier checkpoints "
            f"are intact. Free space (or pass keep_last to prune) and save again.") from e


def _register(reg: dict, phase_dir: Path, name: str, step: int, scores: dict, state_sha256: str, periodic: bool,
              replaces: bool, keep_last: int | None) -> None:
    """The written checkpoint into the registry (one atomic replace), its aliases moved, the
    checkpoints pruned removed after the registry forgot them."""
    if replaces:
        reg["checkpoints"].pop()
    entry = {"step": step, "dir": name, "scores": dict(scores), "state_sha256": state_sha256}
    if periodic:
        entry["periodic"] = True
    reg["checkpoints"].append(entry)  # the digest closes the chain
    reg["format_version"] = FORMAT_VERSION
    move_aliases(reg, step, scores)
    doomed = prune(reg, keep_last) + prune_periodic(reg)
    try:
        replace_json(phase_dir / REGISTRY, reg)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {phase_dir / name} was written but {phase_dir / REGISTRY} could not be updated ({e}); "
            f"the registry still lists only the earlier checkpoints. Free space and save again.") from e
    for d in doomed:  # after the registry forgot them: a kill here leaves only leftovers
        shutil.rmtree(phase_dir / d, ignore_errors=True)
    for p in phase_dir.glob(f".tmp-replaced-{name}-*"):
        shutil.rmtree(p, ignore_errors=True)


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
    if digest is not None and sha256(data) != digest:
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


def registry_entry(path: Path) -> dict | None:
    """The registry entry of a checkpoint directory inside a phase directory, if any."""
    phase = path.parent.name
    if phase not in PHASES or not (path.parent / REGISTRY).is_file():
        return None
    reg = read_registry(path.parent.parent, phase)
    return next((c for c in reg["checkpoints"] if c["dir"] == path.name), None)


def read_state(path: Path) -> dict[str, Any]:
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
    entry = registry_entry(path)
    if entry is not None and entry.get("state_sha256") and sha256(raw) != entry["state_sha256"]:
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
    state = read_state(path)
    state_path = path / STATE_FILE
    specs = _file_specs(state, state_path)
    tensors = _tensors(path, specs, ADAPTER_FILE)
    opt_state = None
    if OPTIM_JSON in specs:
        opt_tensors = _tensors(path, specs, OPTIM_TENSORS)
        try:
            opt_state = join_tensors(json.loads(_read_checked(path, specs, OPTIM_JSON)), opt_tensors)
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
