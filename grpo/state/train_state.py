"""A GRPO phase's training state: where it starts (its own newest checkpoint -- a resume --
or the checkpoint its preset names, each read from disk once) and ``TrainState``, whose
``save`` and ``restore`` write and read the same things.

A resume restores everything a straight run would hold at that step: the adapter, AdamW's
moments, the data stream's position, the controller's weights and history, the Python /
NumPy / torch RNGs and the sampler's own generator. The learning-rate schedule is a pure
function of the step (grpo/run/schedule.py lr_at), so the step restores it. The kill -9 test
(tests/test_train_resume.py) holds a resumed run to the bits of an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo.config import TrainConfig
from grpo.errors import ConfigError
from grpo.presets import phase_init
from grpo.run.files import RunFiles
from grpo.state.checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from grpo.state.contents import adapter_tensors, base_checkpoint_of
from grpo.state.registry import resolve
from grpo.state.resume import is_periodic, resume_point
from grpo.state.rng import restore_rng
from lora import lora_parameters, lora_state_dict

GEN_KEY = "sampler_generator_state"  # checkpoint tensor: the rollout sampler's torch.Generator state


def resolve_init(cfg: TrainConfig, files: RunFiles) -> tuple[Path | None, str]:
    """The checkpoint a phase starts from (None = the configured model as is)."""
    init = phase_init(cfg.phase.name, cfg.model.name) if cfg.phase.init == "auto" else cfg.phase.init
    if init == "base":
        return None, init
    path = resolve(files.root, init)
    if path.parent.name == "warmup" and is_periodic(path):  # a stopped warm-up's weights are no warm-up
        raise ConfigError(f"phase {cfg.phase.name} would start from {init} = {path}, a warm-up stopped mid-way "
                          f"(a periodic save); finish it first with --phase warmup and the same options (it "
                          f"resumes), or name another start with --init")
    return path, init


@dataclass
class StartPoint:
    """The checkpoint a phase continues (``resume``) or warm-starts from (``init``)."""

    resume: LoadedCheckpoint | None  # this phase's newest intact checkpoint
    init: LoadedCheckpoint | None  # the same when resuming, else the preset's / --init's checkpoint
    init_name: str
    base: Path | None  # the base checkpoint (warm-up weights) the policy is built on
    reference: Path | None = None  # the SFT warm-up whose policy is the reference (None: the base)

    @property
    def adapter(self) -> dict[str, torch.Tensor]:
        """LoRA tensors to load into the fresh policy ({} = a zero adapter, B = 0)."""
        return adapter_tensors(self.init.tensors) if self.init is not None else {}

    def reference_adapter(self) -> dict[str, torch.Tensor] | None:
        """The reference's adapter: the warm-up's LoRA tensors, or None (the reference is the base)."""
        if self.reference is None:
            return None
        same = self.init is not None and Path(self.init.path) == self.reference
        return adapter_tensors((self.init if same else load_checkpoint(self.reference)).tensors)


def reference_of(root: Path, ckpt: LoadedCheckpoint | None) -> Path | None:
    """The warm-up a phase started from ``ckpt`` measures its KL against: ``ckpt`` itself when
    it is an SFT warm-up's adapter, the reference ``ckpt`` recorded when it is a GRPO phase's
    checkpoint that had one (B from A from a warm-up keeps the warm-up), else None (the base)."""
    if ckpt is None:
        return None
    extra = ckpt.extra or {}
    if extra.get("reference"):
        return root / extra["reference"]
    if Path(ckpt.path).parent.name == "warmup" and extra.get("kind") == "adapter":
        return Path(ckpt.path)
    return None


def find_start(cfg: TrainConfig, files: RunFiles, set_aside: bool) -> StartPoint | None:
    """Where phase ``cfg.phase.name`` starts; None when it already ran all its steps.

    Damaged checkpoints newer than the last intact one are set aside (renamed, never
    deleted) by rank 0 (``set_aside``) and named in the log.
    """
    phase = cfg.phase.name
    resume, damaged = resume_point(files.root, phase, set_aside=set_aside)
    for bad_step, why in damaged:
        print(f"phase {phase}: checkpoint step {bad_step} is damaged, skipped and set aside ({why})")
        files.write_log(dict(event="damaged_checkpoint", phase=phase, step=bad_step, error=why))
    if resume is not None and resume.step >= cfg.phase.steps and not resume.scheduler_state.get("eval_pending"):
        print(f"phase {phase} already finished at step {resume.step} in {files.root}; "
              f"raise --phase.steps to continue it, or use a new --run.run_dir")
        return None
    if resume is not None:  # continue on the base this phase was trained on, whatever --init says now
        init, name = resume, f"{phase}:latest"
    else:
        path, name = resolve_init(cfg, files)
        init = load_checkpoint(path) if path is not None else None
    base = base_checkpoint_of(files.root, init) if init is not None else None
    return StartPoint(resume, init, name, base, reference_of(files.root, init))


@dataclass
class TrainState:
    """What a GRPO phase holds between steps and a resume must put back: the adapter (in
    ``model``), AdamW's moments, the data stream's position, the controller's weights and
    history, the RNGs (the global ones, and the sampler's generator of every rank) and what
    the next evaluation's gates read (the zero-spread fractions since the last one).
    ``save`` writes exactly what ``restore`` reads."""

    phase: str
    model: torch.nn.Module  # the policy; its LoRA tensors are the adapter
    opt: torch.optim.Optimizer
    stream: Any  # data.mixture.MixtureStream
    controller: Any  # grpo.controller.Controller
    generator: torch.Generator  # the sampler's
    seed: int
    dp: Any  # grpo.distributed.DataParallel (world 1 in one process)
    files: RunFiles  # where the checkpoints go
    start: StartPoint  # what this phase started from: restore reads its resume, save records its base
    config_json: str  # the phase's resolved config, saved with every checkpoint
    zero_spread_since_eval: list[float] = field(default_factory=list)

    def save(self, done: int, result=None, pending: bool = False) -> None:
        """The checkpoint after ``done`` steps: with its evaluation ``result`` (metrics, scores,
        every alias), or periodic (``latest`` only; with what the next evaluation's gates read,
        and whether this step's evaluation was abandoned: ``restore`` then says to redo it)."""
        params = lora_parameters(self.model)
        self.dp.check_replicas(params)  # every rank must hold the adapter rank 0 is about to save
        tensors = dict(adapter_tensors(lora_state_dict(self.model)),
                       **self.dp.generator_states(GEN_KEY, self.generator))
        if not self.dp.is_main:
            return
        root, base, ref = self.files.root, self.start.base, self.start.reference
        extra = {"kind": "adapter", "base": str(base.relative_to(root)) if base else None}
        if ref is not None:  # only then: a run without a warm-up writes the same state.json as before
            extra["reference"] = str(ref.relative_to(root))
        sched = {"step": done} if result is not None else {
            "step": done, "zero_spread_since_eval": list(self.zero_spread_since_eval), "eval_pending": pending}
        save_checkpoint(root, self.phase, done, tensors=tensors, optimizer=self.opt,
                        scheduler_state=sched, controller_state=self.controller.state_dict(),
                        data_position=self.stream.position, metrics=result.flat() if result is not None else {},
                        scores=result.scores if result is not None else {},
                        config_json=self.config_json, extra=extra,
                        periodic=result is None)

    def restore(self) -> tuple[int, bool]:
        """Put a resume's state back; -> (the step to continue at (0 = new), whether that
        step's evaluation is pending). The adapter was loaded with the policy (start.adapter).

        Called after everything that draws from the global RNGs was built (model, data,
        reward model), so the restored RNG state is what the next step of a straight run
        would have drawn from.
        """
        start = self.start
        if start.resume is None:
            path = start.init.path if start.init is not None else None
            print(f"phase {self.phase}: starting from {start.init_name}" + (f" ({path})" if path else ""))
            return 0, False
        r = start.resume
        r.restore_optimizer(self.opt)
        self.stream.load_state_dict({"position": r.data_position, "seed": self.seed})
        self.controller.load_state_dict(r.controller_state)
        restore_rng(r.rng)
        key = self.dp.generator_key(GEN_KEY)  # each rank saved its own generator
        if key in r.tensors:  # the sampler's own generator: resumed runs draw what a straight run draws
            self.generator.set_state(r.tensors[key])
        print(f"resuming phase {self.phase} at step {r.step} from {r.path}")
        # a periodic checkpoint: what the gates read since the last eval; a pending eval is redone
        self.zero_spread_since_eval[:] = r.scheduler_state.get("zero_spread_since_eval", [])
        return r.step, bool(r.scheduler_state.get("eval_pending"))
