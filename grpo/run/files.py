"""Where a run writes: its log (JSON lines, and the trackers of run.report_to) beside the checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.run.trackers import TRACKERS, sample_rows


@dataclass
class RunFiles:
    """Where a run writes: <run_dir>/config_<phase>.json, train_log.jsonl, <phase>/step_N,
    and the trackers of run.report_to (grpo/run/trackers.py: TensorBoard events in
    tensorboard/<phase>/, a wandb run, an MLflow run), each fed what the log holds. The
    command holds <run_dir>/run.lock meanwhile (grpo/run/lock.py): no other run writes here."""

    root: Path
    writer: bool = True  # False on ranks > 0 of a data-parallel run: rank 0 writes the log
    report_to: tuple[str, ...] = ()  # the trackers of the phase being run (config.reported_to)
    hparams: dict = field(default_factory=dict, repr=False)  # its resolved config, the trackers' hyperparameters
    _trackers: dict = field(default_factory=dict, repr=False)  # (phase, name) -> tracker, opened at its first numbers

    @property
    def log(self) -> Path:
        return self.root / "train_log.jsonl"

    def track(self, report_to: tuple[str, ...], config: dict) -> None:
        """The trackers and resolved config of the phase about to run (the last phase's are done)."""
        self.close()
        self.report_to, self.hparams = report_to, config

    def write_log(self, record: dict) -> None:
        if not self.writer:
            return
        with self.log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.report_to:
            self._write_trackers(record)

    def write_samples(self, phase: str, step: int, records: list[dict], examples: list) -> None:
        """An evaluation's first completions, with their images, as each tracker's table."""
        if not self.writer or not self.report_to:
            return
        rows = sample_rows(records, examples)
        for tracker in self._open(phase, step):
            tracker.samples(step, rows)

    def _write_trackers(self, record: dict) -> None:
        """Every number of the record at its step, one tracker run per phase (each phase counts
        its steps from 1); tags from record_scalars.

        The first numbers of a phase in this process come from the step it starts at: 1, or
        the one after the checkpoint it resumes (TensorBoard purges from there: the steps an
        interrupted run logged after its last checkpoint, logged again, are not shown twice)."""
        scalars = list(record_scalars(record))
        if not scalars:
            return
        phase, step = str(record.get("phase", "run")), int(record.get("step", 0))
        for tracker in self._open(phase, step):
            tracker.log(step, scalars)

    def _open(self, phase: str, step: int) -> list:
        """This phase's trackers, each opened the first time the phase logs."""
        out = []
        for name in self.report_to:
            tracker = self._trackers.get((phase, name))
            if tracker is None:
                tracker = self._trackers[(phase, name)] = TRACKERS[name](self.root, phase, step, self.hparams)
            out.append(tracker)
        return out

    def close(self) -> None:
        for tracker in self._trackers.values():
            tracker.close()
        self._trackers.clear()


NAME_KEYS = ("phase", "event", "rule")  # what names a record rather than measures it


def record_scalars(record: dict) -> Iterator[tuple[str, float]]:
    """(tag, number) for every number of one log record, tagged [<event>/][<rule>/]<key>[/<sub key>...]
    (the phase is the TensorBoard run). The rule keeps apart the gate records of one step."""
    prefix = "/".join(str(record[k]) for k in NAME_KEYS[1:] if k in record)
    return log_scalars({k: v for k, v in record.items() if k not in (*NAME_KEYS, "step")}, prefix)


def log_scalars(value: Any, tag: str) -> Iterator[tuple[str, float]]:
    """(tag, number) for every int or float in a log record; dict keys and list indices extend
    the tag as tag/key. Strings, booleans and None are not measurements and are left out."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from log_scalars(v, f"{tag}/{k}" if tag else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from log_scalars(v, f"{tag}/{i}" if tag else str(i))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield tag, float(value)
