"""Where a run writes: its log (JSON lines, and optionally TensorBoard events) beside the checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunFiles:
    """Where a run writes: <run_dir>/config_<phase>.json, train_log.jsonl, <phase>/step_N,
    and with run.tensorboard the log's numbers as TensorBoard events in tensorboard/<phase>/."""

    root: Path
    writer: bool = True  # False on ranks > 0 of a data-parallel run: rank 0 writes the log
    tensorboard: bool = False  # run.tensorboard of the phase being run
    _events: dict = field(default_factory=dict, repr=False)  # phase -> SummaryWriter, opened at its first numbers

    @property
    def log(self) -> Path:
        return self.root / "train_log.jsonl"

    def write_log(self, record: dict) -> None:
        if not self.writer:
            return
        with self.log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard:
            self._write_events(record)

    def _write_events(self, record: dict) -> None:
        """Every number of the record as a scalar at its step, one TensorBoard run per phase
        (each phase counts its steps from 1); tags from record_scalars.

        The first numbers of a phase in this process come from the step it starts at: 1, or
        the one after the checkpoint it resumes. The writer purges from that step on
        (purge_step), so the steps an interrupted run logged after its last checkpoint, which
        this run logs again, are not shown twice."""
        scalars = list(record_scalars(record))
        if not scalars:
            return
        phase, step = str(record.get("phase", "run")), int(record.get("step", 0))
        events = self._events.get(phase)
        if events is None:
            from torch.utils.tensorboard import (
                SummaryWriter,  # optional package: imported only when asked for
            )

            events = self._events[phase] = SummaryWriter(str(self.root / "tensorboard" / phase), purge_step=step)
        for tag, value in scalars:
            events.add_scalar(tag, value, global_step=step)
        # one flush per record (a step takes seconds): a killed run's events are as complete as its JSONL
        events.flush()

    def close(self) -> None:
        for events in self._events.values():
            events.close()
        self._events.clear()


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
