"""What a training phase needs besides the algorithm: its files, progress line, schedule,
seeds, and the guard against non-finite steps. Shared by the GRPO loop (grpo/train.py),
the SFT warm-up (grpo/sft.py) and the CLI (grpo/cli.py).
"""

from __future__ import annotations

import json
import math
import queue
import random
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo.config import ConfigError, TrainConfig
from grpo.errors import TrainingDiverged

GEN_KEY = "sampler_generator_state"  # checkpoint tensor: the rollout sampler's torch.Generator state


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--model.device {name}: no CUDA device here; use --model.device cpu")
    index = name.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"--model.device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                          f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return name


def set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- schedule


def updates_per_batch(cfg: TrainConfig) -> int:
    """mu: optimiser steps per rollout batch in a GRPO phase (the SFT warm-up takes one per batch)."""
    return 1 if cfg.phase.name == "warmup" else cfg.optim.updates_per_batch


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimiser step ``step`` (0-based): linear warm-up, then the schedule.

    phase.steps counts rollout batches; a GRPO phase takes mu = optim.updates_per_batch
    optimiser steps per batch, so the schedule (and optim.warmup_steps) runs over
    phase.steps x mu optimiser steps, and batch s's updates are optimiser steps s*mu ..
    s*mu + mu - 1. A pure function of the step, so resuming needs only the step to restore
    the schedule (checkpoints fall on batch boundaries).
    """
    o, total = cfg.optim, max(1, cfg.phase.steps * updates_per_batch(cfg))
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    if o.schedule == "linear":
        return o.lr * (1.0 - 0.9 * frac)
    if o.schedule == "cosine":
        return o.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * frac)))
    return o.lr


# ----------------------------------------------------------------------------- periodic saves


class SaveClock:
    """When a phase saves a `latest`-only checkpoint between evaluations: every
    run.save_every steps, or once run.save_every_minutes passed since the last save of any
    kind (so a crash loses at most that much work even when evaluations are rare)."""

    def __init__(self, cfg: TrainConfig):
        self.every, self.seconds = cfg.run.save_every, 60.0 * cfg.run.save_every_minutes
        self.last = time.monotonic()

    def due(self, done: int) -> bool:
        """Whether a periodic save is due after ``done`` steps (not counting evaluation saves)."""
        by_steps = self.every > 0 and done % self.every == 0
        return by_steps or (self.seconds > 0 and time.monotonic() - self.last >= self.seconds)

    def saved(self) -> None:
        self.last = time.monotonic()


# ----------------------------------------------------------------------------- files, progress


def prefetch(items: Iterable, depth: int = 2) -> Iterator:
    """Iterate ``items`` with the next ``depth`` produced ahead, in a background thread.

    The warm-up's batch preparation (image preprocessing, tokenisation, perception labels:
    ~0.13 s of a ~0.45 s step on one core) then runs on the machine's second core while
    the model computes. The producer is one thread consuming ``items`` in order, so every
    batch, and every random draw that makes it, is exactly what a plain loop would give.
    An exception in the producer is raised here, at the item it replaced.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry: tuple) -> bool:  # False: the consumer has gone, stop producing
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((None, item)):
                    return
            put((None, done))
        except BaseException as err:  # handed to the consumer, raised there
            put((err, None))

    worker = threading.Thread(target=produce, name="prefetch", daemon=True)
    worker.start()
    try:
        while True:
            err, item = q.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:  # the consumer stopped early (an error, a break, a stop): let the producer end
        stop.set()
        # and wait for it: a daemon thread still inside torch when the interpreter exits
        # aborts the process (SIGABRT) instead of letting it exit with its own code
        worker.join(timeout=60)


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
            from torch.utils.tensorboard import SummaryWriter  # optional package: imported only when asked for

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


class Progress:
    """A one-line progress bar on a terminal; nothing otherwise (CI logs get the periodic
    lines the loops print). ``write`` prints a line without breaking the bar."""

    def __init__(self, total: int, label: str, start: int = 0):
        self.total, self.label, self.t0, self.start = max(1, total), label, time.time(), start
        self.tty = sys.stderr.isatty()
        self.shown = False

    def eta(self, done: int) -> float:
        """Seconds left at the rate of this process's steps so far (NaN before the first)."""
        rate = (done - self.start) / max(1e-9, time.time() - self.t0)
        return (self.total - done) / rate if rate > 0 else float("nan")

    def update(self, done: int, info: str = "") -> None:
        if not self.tty:
            return
        frac = done / self.total
        eta = self.eta(done)
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total} eta {eta:4.0f}s {info}   ")
        sys.stderr.flush()
        self.shown = True

    def write(self, text: str) -> None:
        self.close()
        print(text, flush=True)

    def close(self) -> None:
        if self.tty and self.shown:
            sys.stderr.write("\n")
            self.shown = False


# ----------------------------------------------------------------------------- non-finite steps


class StepGuard:
    """Parameters and optimiser state from before an optimiser step, put back if the step
    left a parameter non-finite; and the count of non-finite losses or updates in a row.

    The loss check cannot see this: a finite loss with lr=1e30, or an overflow inside
    AdamW, still turns the adapter into NaN, and every later step (and checkpoint) would
    carry it. Costs one copy of the trained tensors and their moments per step (for a
    rank-8 LoRA of the 7B, ~40M floats: cheap next to one rollout).
    """

    LIMIT = 3  # non-finite losses or updates in a row before the run stops

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer,
                 files: RunFiles, cfg: TrainConfig):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.opt, self.files, self.cfg = opt, files, cfg
        self.streak = 0

    def before(self) -> None:
        self.saved = [p.detach().clone() for p in self.params]
        sd = self.opt.state_dict()
        self.saved_opt = {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                                    for i, st in sd["state"].items()},
                          "param_groups": [dict(g) for g in sd["param_groups"]]}

    def non_finite(self, dp=None) -> list[str]:
        """Names of parameters holding NaN/inf after the step (all ranks agree, or none does)."""
        bad = [n for n, p in zip(self.names, self.params) if not bool(torch.isfinite(p).all())]
        if dp is not None and dp.enabled and dp.all_reduce_sum(float(len(bad))) > 0 and not bad:
            return ["<on another rank>"]
        return bad

    @torch.no_grad()
    def restore(self) -> None:
        for p, v in zip(self.params, self.saved):
            p.copy_(v)
        self.opt.load_state_dict(self.saved_opt)

    def step(self, dp=None) -> list[str]:
        """opt.step(), undone if it left a parameter non-finite; -> the bad names ([] = kept)."""
        self.before()
        self.opt.step()
        bad = self.non_finite(dp)
        if bad:
            self.restore()
        return bad

    def failed(self, phase: str, step: int, record: dict, message: str) -> None:
        """Count a skipped loss or an undone update: log it, say it, stop after LIMIT in a row."""
        self.streak += 1
        self.files.write_log(dict(event="nan", phase=phase, step=step, **record))
        print(f"{message} ({self.streak} in a row)")
        if self.streak >= self.LIMIT:
            raise TrainingDiverged(
                f"phase {phase}: 3 non-finite losses or updates in a row at step {step}; lower --optim.lr "
                f"(now {self.cfg.optim.lr}) or check the rewards; the last good checkpoint is in "
                f"{self.files.root / phase}")

    def succeeded(self) -> None:
        self.streak = 0


# ----------------------------------------------------------------------------- the log line (step 7 of grpo/train.py)


def update_record(u: int, loss_sum: float, gnorm: torch.Tensor, lr: float, stats_u: list, dp) -> dict:
    """One update's entry of the log line's "updates" (mu > 1): its loss, grad norm, lr, the
    clip fractions and the KL to the sampling policy (0 at update 1 by construction),
    averaged over micro-batches and ranks."""
    su = dp.mean_over_ranks({key: float(sum(float(getattr(x, f)) for x in stats_u) / len(stats_u))
                             for key, f in (("clip_low", "clip_low_frac"), ("clip_high", "clip_high_frac"),
                                            ("kl_old", "kl_old_mean"))})
    return dict(update=u + 1, loss=loss_sum, grad_norm=float(gnorm), lr=lr, **su)


def step_record(phase: str, step: int, logs: list, weights: dict, loss_sum: float, updates: list, fill,
                temperature: float, lr: float, grad_norm: float | None, timing: dict, dp,
                mu: int, cfg: TrainConfig | None = None) -> dict:
    """The log line of one rollout batch (keys: eval/plots.py). Rewards, lengths and the
    loss's diagnostics are those of update 1, the on-policy one. "rollout": the sampler
    against the trainer (kernels/grpo_loss.py's is_* stats): kl = mean k3 estimate of
    KL(sampler || trainer) per token, ratio_mean / ratio_max of pi_train / pi_sampler and
    over_frac = ratios above the cap, at the correction's level (token when off); the max
    is over micro-batches, then averaged over ranks like every float."""
    rb0 = logs[0][0]
    comps = {k: float(torch.cat([r.components[k] for r, _, _ in logs]).mean()) for k in rb0.components}
    totals = torch.cat([r.total for r, _, _ in logs])
    lengths = torch.cat([o.lengths.float() for _, _, o in logs])
    trunc = torch.cat([o.truncated.float() for _, _, o in logs])
    # averaged over ranks: the controller's zero-spread gate must see the same value on every rank
    st = dp.mean_over_ranks({k: float(sum(float(getattr(s, k)) for _, s, _ in logs) / len(logs))
                             for k in ("kl_mean", "clip_low_frac", "clip_high_frac", "zero_spread_frac",
                                       "adv_abs_mean")})
    record = dict(phase=phase, step=step + 1, reward=float(totals.mean()), components=comps,
                  weights=dict(weights), loss=loss_sum, kl=st["kl_mean"],
                  clip_low=st["clip_low_frac"], clip_high=st["clip_high_frac"],
                  zero_spread=st["zero_spread_frac"], adv_abs=st["adv_abs_mean"],
                  completion_len=float(lengths.mean()), truncation=float(trunc.mean()), lr=lr,
                  temperature=temperature, grad_norm=grad_norm, time=timing)
    if cfg is not None:
        o = cfg.optim
        record["rollout"] = dict(
            path=cfg.sampling.rollout, correction=o.rollout_correction, mode=o.rollout_correction_mode,
            cap=float(o.rollout_correction_cap), level="sequence" if o.rollout_correction == "sequence" else "token",
            kl=float(sum(float(s.is_kl) for _, s, _ in logs) / len(logs)),
            ratio_mean=float(sum(float(s.is_ratio_mean) for _, s, _ in logs) / len(logs)),
            ratio_max=max(float(s.is_ratio_max) for _, s, _ in logs),
            over_frac=float(sum(float(s.is_over_frac) for _, s, _ in logs) / len(logs)))
    if mu > 1:  # the first update's loss and stats above (on-policy); every update here
        record["loss"] = updates[0]["loss"] if updates else loss_sum
        record["updates"] = updates
    if fill is not None:
        record["dynamic"] = fill.to_dict()
    return record


def progress_line(phase: str, step: int, steps: int, record: dict, fill, updates: list, mu: int) -> str:
    return (f"[{phase} {step + 1}/{steps}] reward {record['reward']:.3f}  "
            + " ".join(f"{k} {v:.2f}" for k, v in record["components"].items())
            + f"  len {record['completion_len']:.1f}  zero-spread {record['zero_spread']:.2f}"
            + (f"  refills {fill.refills} fill {fill.fill:.2f}" if fill is not None else "")
            + (f"  clip@{len(updates)} {updates[-1]['clip_low'] + updates[-1]['clip_high']:.3f}"
               if mu > 1 and updates else "")
            + f"  {record['time']['step']:.2f}s/step")
