"""The checkpoint's byte seam and its JSON encoding.

Every byte a checkpoint writes goes through ``write_bytes`` (fsync'ed, grpo_infra/atomic.py),
JSON files are replaced atomically with it (``replace_json``), and nested state that holds
tensors splits into plain JSON plus named tensors (``split_tensors`` / ``join_tensors``),
so nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from grpo_infra.atomic import replace_file, write_synced


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

def write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync one file. Every byte a checkpoint writes goes through this name: the
    one place a test makes the disk full or the process die mid-file."""
    write_synced(path, data)


def json_bytes(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, indent=1).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be plain JSON data (dict/list/str/number/bool/None): {e}") from None


def replace_json(path: Path, obj: Any) -> None:
    """Atomically replace a JSON file (grpo_infra/atomic.py), its bytes written by ``write_bytes``."""
    # write_bytes looked up at each call, so a test's replacement of it is the one used
    replace_file(path, json_bytes(obj, path.name), write=lambda tmp, data: write_bytes(tmp, data))


# ----------------------------------------------------------------------------- tensors inside JSON structures


def split_tensors(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """Nested state -> JSON, moving every tensor into `tensors` under a dotted key.

    Tuples and non-string dict keys (optimizer state is keyed by parameter index) are
    tagged so `join_tensors` rebuilds exactly what went in.
    """
    if isinstance(obj, torch.Tensor):
        # A private CPU copy: safetensors refuses tensors that share storage, and the
        # trainer keeps training while the bytes are written. Costs one copy of the state.
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: split_tensors(v, tensors, f"{key}.{k}") for k, v in obj.items()}
        return {"__items__": [[k, split_tensors(v, tensors, f"{key}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [split_tensors(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_tensors(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{key}: cannot store a {type(obj).__name__} without pickle; "
                    "use tensors, numbers, strings, lists, dicts")


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: join_tensors(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(join_tensors(v, tensors) for v in obj["__tuple__"])
        return {k: join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj
