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
                                   eval metrics, scores, the resolved config, file sizes
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

No pickle: tensors go to safetensors, everything else to JSON. torch.load of a pickle can
run arbitrary code, and a checkpoint directory is the kind of file people share.

Simplified: a single writer per run directory is assumed (no file locking), and steps in a
phase must increase (resuming from an older checkpoint of the same phase into the same
run directory is refused rather than branching the history).
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eval.scores import SCORE_KEYS
from grpo.config import PHASES, ConfigError, TrainConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ALIASES = ("latest",) + tuple(f"best_{k}" for k in SCORE_KEYS)  # latest, best_structure, ...
REGISTRY = "registry.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIM_TENSORS, OPTIM_JSON = "optimizer.safetensors", "optimizer.json"
STATE_FILE = "state.json"
# Config fields that only say how to run, not what a checkpoint's weights mean.
RUNTIME_ONLY_FIELDS = {"model.device", "model.gradient_checkpointing"}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what to do."""


class SelectorError(ValueError):
    """A checkpoint selector names nothing; the message lists what the run directory holds."""


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


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


def read_registry(run_dir: str | Path, phase: str) -> dict[str, Any]:
    """The phase's registry: {"checkpoints": [{"step", "dir", "scores"}...], "aliases": {alias: step}}."""
    path = Path(run_dir) / phase / REGISTRY
    if not path.exists():
        return _empty_registry(phase)
    try:
        reg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); it is only ever replaced atomically, so the disk or an "
                              "outside edit damaged it: restore it or start a new run_dir") from None
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


def _clean_leftovers(phase_dir: Path, reg: dict[str, Any]) -> None:
    """Remove what killed saves left: temporary dirs/files, and step dirs the registry never took."""
    known = {c["dir"] for c in reg["checkpoints"]}
    for p in phase_dir.iterdir():
        stale = p.name.startswith(".tmp-") or (p.is_dir() and p.name.startswith("step_") and p.name not in known)
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
) -> Path:
    """Write one checkpoint atomically, register it, move its aliases; returns its directory.

    scores: {"structure", "correctness", "composite"} (any subset; a missing score leaves
    its alias alone). rng: capture_rng() is taken now unless given. keep_last: keep at
    most this many checkpoints that no alias points to (None = keep all).
    """
    config = _check_save_args(phase, step, tensors, scores, config_json, keep_last)
    phase_dir = Path(run_dir) / phase
    phase_dir.mkdir(parents=True, exist_ok=True)
    reg = read_registry(run_dir, phase)
    if reg["checkpoints"] and step <= reg["aliases"]["latest"]:
        raise CheckpointError(
            f"{phase_dir} already holds step {reg['aliases']['latest']} (latest) and step {step} is not after it: "
            f"continue from {phase}:latest, or use a new run_dir to branch from an older checkpoint")
    _clean_leftovers(phase_dir, reg)

    name = step_dirname(step)
    final = phase_dir / name
    tmp = phase_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    # Serialise everything before touching the disk, so a TypeError costs no cleanup.
    adapter = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    files: dict[str, bytes] = {ADAPTER_FILE: st_save(adapter)}
    if optimizer is not None:
        opt_tensors, opt_structure = _optimizer_payload(optimizer)
        files[OPTIM_TENSORS] = st_save(opt_tensors)
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
        "files": {n: len(b) for n, b in files.items()},  # checked on load: catches truncation
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
    }
    files[STATE_FILE] = _json_bytes(state, "checkpoint state (scheduler/controller/metrics/extra)")

    try:
        tmp.mkdir()
        for fname, data in files.items():
            _write_bytes(tmp / fname, data)
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(phase_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = "the disk is full" if e.errno == errno.ENOSPC else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"could not write checkpoint {final} ({why}); nothing was registered and earlier checkpoints "
            f"are intact. Free space (or pass keep_last to prune) and save again.") from e

    # The directory is complete: now make it exist, in one atomic registry replace.
    reg["checkpoints"].append({"step": step, "dir": name, "scores": dict(scores)})
    _move_aliases(reg, step, scores)
    doomed = _prune(reg, keep_last)
    try:
        _replace_json(phase_dir / REGISTRY, reg)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {final} was written but {phase_dir / REGISTRY} could not be updated ({e}); "
            f"the registry still lists only the earlier checkpoints. Free space and save again.") from e
    for d in doomed:  # after the registry forgot them: a kill here leaves only leftovers
        shutil.rmtree(phase_dir / d, ignore_errors=True)
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


def _read_checked(path: Path, expected: dict[str, int], fname: str) -> bytes:
    data = (path / fname).read_bytes()
    if fname in expected and len(data) != expected[fname]:
        raise CheckpointError(f"{path / fname} has {len(data)} bytes, expected {expected[fname]}: "
                              "the file was damaged after saving")
    return data


def load_checkpoint(
    path: str | Path, optimizer: torch.optim.Optimizer | None = None, device: str | torch.device = "cpu"
) -> LoadedCheckpoint:
    """Read a checkpoint directory; if `optimizer` is given, restore its state in place."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory (no {STATE_FILE}); "
                              "use resolve(run_dir, selector) to find one")
    state = json.loads((path / STATE_FILE).read_text())
    sizes = state.get("files", {})
    tensors = st_load(_read_checked(path, sizes, ADAPTER_FILE))
    tensors = {k: v.to(device) for k, v in tensors.items()}
    if optimizer is not None:
        if OPTIM_JSON not in sizes:
            raise CheckpointError(f"{path} was saved without optimiser state: "
                                  "load it with optimizer=None (fresh optimiser)")
        opt_tensors = st_load(_read_checked(path, sizes, OPTIM_TENSORS))
        opt_state = _join_tensors(json.loads(_read_checked(path, sizes, OPTIM_JSON)), opt_tensors)
        try:
            optimizer.load_state_dict(opt_state)  # casts state to each parameter's device/dtype
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"optimiser state in {path} does not fit this optimiser ({e}): "
                                  "same parameters in the same order are needed (same LoRA rank and targets)") from None
    return LoadedCheckpoint(
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
    )


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


def _meaning(cfg: dict[str, Any]) -> dict[str, Any]:
    """The flattened model + lora fields that change what a checkpoint's weights mean."""
    out = {}
    for sec in ("model", "lora"):
        for k, v in (cfg.get(sec) or {}).items():
            if f"{sec}.{k}" not in RUNTIME_ONLY_FIELDS:
                out[f"{sec}.{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def check_compatible(run_dir: str | Path, config: TrainConfig) -> None:
    """Refuse a run directory whose checkpoints were made with another model or LoRA setup."""
    want = _meaning(json.loads(config.to_json()))
    for phase in PHASES:
        reg = read_registry(run_dir, phase)
        if not reg["checkpoints"]:
            continue
        path = Path(run_dir) / phase / step_dirname(reg["aliases"]["latest"])
        saved = _meaning(json.loads((path / STATE_FILE).read_text()).get("config", {}))
        diffs = [f"{k}: saved {saved.get(k, '<missing>')!r}, now {want.get(k, '<missing>')!r}"
                 for k in sorted(set(saved) | set(want)) if saved.get(k) != want.get(k)]
        if diffs:
            raise ConfigError(
                f"run_dir {run_dir} holds checkpoints ({phase} step {reg['aliases']['latest']}) made with a different "
                f"model/LoRA config: {'; '.join(diffs)}. Set these back, or use a new --run.run_dir.")
