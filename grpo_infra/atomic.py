"""Write-then-rename: the one way this project replaces a file or a directory.

A reader, a crash or a kill -9 sees the old version or the new one, never half of either:

- a file (``replace_file``, ``replace_files``) is written whole under a temporary name
  beside it, fsync'ed, renamed over the old one (``os.replace``, atomic within one file
  system), and the directory holding it is fsync'ed so the rename itself survives a power
  loss;
- a directory (``new_directory``) is filled under a temporary name beside it; when the
  block ends, every file and directory in it is fsync'ed, it is renamed into place and
  the parent is fsync'ed.

One temporary name, ``.tmp-[ROLE-]NAME-<8 hex>`` (``temp_path``), in the same directory as
the target (a rename cannot cross file systems): a leftover of a kill is recognisable by
its ``.tmp-`` prefix (the checkpoint registry removes them), and two writers never collide.
On an error or a signal the temporary file or directory is removed and the old version is
left as it was.

Everything written through here is fsync'ed: what it writes (checkpoints, registries,
datasets, reports, exports, model caches) is worth the few milliseconds a sync costs.

It sits in grpo_infra/, the lowest floor, so that data/ (``data.mathvista convert`` and
``data.jsonl.save_jsonl``) and every layer above import it from one place. lora/ does not
need it: its writers (lora/adapter_io.py) fill a directory their caller made with
``new_directory`` (grpo/export.py), so they never replace anything themselves.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

TEMP_PREFIX = ".tmp-"


def temp_path(path: Path, role: str = "") -> Path:
    """The temporary name beside ``path``: ``.tmp-[role-]<name>-<8 hex>``."""
    path = Path(path)
    return path.with_name(f"{TEMP_PREFIX}{role + '-' if role else ''}{path.name}-{uuid.uuid4().hex[:8]}")


def write_synced(path: Path, data: bytes | str) -> None:
    """Write one file (a str as UTF-8) and fsync it: its bytes are on the disk when this returns."""
    with open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (the directory entry itself must reach the disk)."""
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


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first (what a writer
    such as safetensors or save_pretrained left in the page cache)."""
    for here, _, names in os.walk(root, topdown=False):
        for name in names:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(here))


def replace_files(files: Mapping[Path, bytes | str],
                  write: Callable[[Path, bytes | str], None] = write_synced) -> None:
    """Replace each file of ``files`` ({path: contents}) with its new contents: every one is
    written under its temporary name first, then they are renamed into place one after
    the other (a few system calls). A failed write (a full disk) leaves every old file as
    it was and no temporary one. ``write`` writes and syncs one temporary file (the
    checkpoint code passes its own, the one it counts and tests replace)."""
    temps = {Path(path): temp_path(path) for path in files}
    try:
        for path, data in files.items():
            write(temps[Path(path)], data)
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)  # renamed ones are gone already
    for parent in {path.parent for path in temps}:
        fsync_dir(parent)


def replace_file(path: Path, data: bytes | str,
                 write: Callable[[Path, bytes | str], None] = write_synced) -> None:
    """Replace one file atomically and durably (``replace_files`` of one)."""
    replace_files({Path(path): data}, write)


@contextmanager
def new_directory(out: Path, replace: bool = False) -> Iterator[Path]:
    """``with new_directory(out) as tmp:`` fill ``tmp``; when the block ends it becomes ``out``.

    ``out`` may be missing or an empty directory (the rename takes its place); a directory
    that holds files is refused (OSError: the rename fails), unless ``replace``: then the
    old directory is renamed aside first, restored if the new one cannot take its place,
    and removed once it has. On an error or a signal in the block (or while syncing) the
    temporary directory is removed and ``out`` is as it was.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if replace and out.is_dir() and any(out.iterdir()):
            old = temp_path(out, "old")
            os.rename(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename
