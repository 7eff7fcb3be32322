"""The checkpoint format's names: its versions, the files of a phase directory and of a
checkpoint directory, and CheckpointError, raised for anything on disk that breaks them.

The layout they make is drawn in grpo/state/checkpoint.py.
"""

from __future__ import annotations

FORMAT_VERSION = 2  # 2: sha256 digests of every file; 1 (sizes only) still loads
READABLE_VERSIONS = (1, 2)
REGISTRY = "registry.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIM_TENSORS, OPTIM_JSON = "optimizer.safetensors", "optimizer.json"
STATE_FILE = "state.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what to do."""
