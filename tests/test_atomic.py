"""grpo_infra/atomic.py, the one write-then-rename: old or new, never half; temporaries cleaned; fsync where promised."""

from __future__ import annotations

import errno
import os
import re

import pytest

from grpo_infra import atomic


class Killed(BaseException):
    """Stands in for a kill between the write and the rename (no ``except Exception`` catches it)."""


def names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_the_temporary_name_is_one_scheme_beside_the_target(tmp_path):
    a, b = atomic.temp_path(tmp_path / "report.json"), atomic.temp_path(tmp_path / "report.json")
    assert a.parent == tmp_path and a != b
    assert re.fullmatch(r"\.tmp-report\.json-[0-9a-f]{8}", a.name)
    assert re.fullmatch(r"\.tmp-old-step_000004-[0-9a-f]{8}", atomic.temp_path(tmp_path / "step_000004", "old").name)


@pytest.mark.parametrize("stop", [Killed(), OSError(errno.EXDEV, "cross-device link")])
def test_a_crash_between_write_and_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, stop):
    target = tmp_path / "registry.json"
    target.write_text("old")
    written = []

    def dies(src, dst):
        written.append(src.read_text())  # the new bytes were whole under the temporary name
        raise stop

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(type(stop)):
        atomic.replace_file(target, "new")
    monkeypatch.undo()
    assert written == ["new"]
    assert target.read_text() == "old" and names(tmp_path) == ["registry.json"]


def test_a_full_disk_mid_file_leaves_every_old_file_and_no_temporary(tmp_path):
    files = {tmp_path / "report.md": "new md", tmp_path / "report.json": "new json"}
    for path in files:
        path.write_text("old")

    def full(path, data):
        if path.name.startswith(".tmp-report.json"):
            path.write_text(data[:3])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        atomic.write_synced(path, data)

    with pytest.raises(OSError, match="No space"):
        atomic.replace_files(files, write=full)
    assert [p.read_text() for p in files] == ["old", "old"] and names(tmp_path) == ["report.json", "report.md"]
    atomic.replace_files(files)
    assert [p.read_text() for p in files] == ["new md", "new json"] and names(tmp_path) == ["report.json", "report.md"]


def record_syncs_and_renames(monkeypatch) -> list[tuple[str, int]]:
    """("fsync", inode) and ("replace", inode of what was renamed), in the order they happen."""
    events: list[tuple[str, int]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_a_file_is_synced_before_its_rename_and_its_directory_after(tmp_path, monkeypatch):
    events = record_syncs_and_renames(monkeypatch)
    atomic.replace_file(tmp_path / "state.json", b"{}")
    monkeypatch.undo()
    new, parent = (tmp_path / "state.json").stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", new), ("replace", new), ("fsync", parent)]


def test_several_files_all_written_and_synced_before_the_first_rename(tmp_path, monkeypatch):
    events = record_syncs_and_renames(monkeypatch)
    atomic.replace_files({tmp_path / n: n for n in ("a", "b", "c")})
    monkeypatch.undo()
    inodes = [(tmp_path / n).stat().st_ino for n in ("a", "b", "c")]
    assert events == [("fsync", i) for i in inodes] + [("replace", i) for i in inodes] + [("fsync", tmp_path.stat().st_ino)]


def test_a_directory_is_synced_file_by_file_then_renamed_then_its_parent_synced(tmp_path, monkeypatch):
    out = tmp_path / "export"
    events = record_syncs_and_renames(monkeypatch)
    with atomic.new_directory(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-export-")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"w")  # as safetensors would: no fsync of its own
        (tmp / "config.json").write_text("{}")
        assert events == []  # nothing is synced or renamed while the block fills it
    monkeypatch.undo()
    ino = {p: p.stat().st_ino for p in (out / "sub" / "weights.bin", out / "config.json", out / "sub", out)}
    synced_first = {("fsync", i) for i in ino.values()}
    assert set(events[:4]) == synced_first and len(events) == 6
    assert events[4:] == [("replace", ino[out]), ("fsync", tmp_path.stat().st_ino)]
    assert events.index(("fsync", ino[out / "sub"])) > events.index(("fsync", ino[out / "sub" / "weights.bin"]))
    assert names(tmp_path) == ["export"] and names(out) == ["config.json", "sub"]


def test_a_directory_takes_an_empty_ones_place_and_refuses_a_full_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with atomic.new_directory(out) as tmp:
        (tmp / "data.jsonl").write_text("1\n")
    assert names(out) == ["data.jsonl"]
    with pytest.raises(OSError):  # never into existing data
        with atomic.new_directory(out) as tmp:
            (tmp / "data.jsonl").write_text("2\n")
    assert (out / "data.jsonl").read_text() == "1\n" and names(tmp_path) == ["out"]


def test_an_error_while_filling_leaves_no_directory(tmp_path):
    with pytest.raises(KeyboardInterrupt):  # a stop (StopNow is one) while the files are written
        with atomic.new_directory(tmp_path / "merged") as tmp:
            (tmp / "half.safetensors").write_bytes(b"x")
            raise KeyboardInterrupt
    assert names(tmp_path) == []


def test_replace_swaps_a_full_directory_and_restores_it_when_the_rename_fails(tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        with atomic.new_directory(out, replace=True) as tmp:
            (tmp / "model.safetensors").write_text("new")
    monkeypatch.undo()
    assert names(tmp_path) == ["model"] and (out / "model.safetensors").read_text() == "old"
    with atomic.new_directory(out, replace=True) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert names(tmp_path) == ["model"] and names(out) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "new"
