"""The process's random state as JSON: Python, NumPy (legacy global), torch CPU and every CUDA
device's generator, captured with each checkpoint and restored for an exact resume."""

from __future__ import annotations

import base64
import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


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
