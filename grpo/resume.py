"""Where a GRPO phase starts: its own newest checkpoint (a resume) or the checkpoint its
preset names (a new phase), each read from disk once.

A resume restores everything a straight run would hold at that step: the adapter, AdamW's
moments, the data stream's position, the controller's weights and history, the Python /
NumPy / torch RNGs and the sampler's own generator. The learning-rate schedule is a pure
function of the step (grpo/run.py lr_at), so the step restores it. The kill -9 test
(tests/test_train_resume.py) holds a resumed run to the bits of an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.checkpoint import LoadedCheckpoint, is_periodic, load_checkpoint, resolve, restore_rng, resume_point
from grpo.config import ConfigError, TrainConfig, phase_init
from grpo.policy import adapter_tensors, base_checkpoint_of
from grpo.run import RunFiles


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

    @property
    def adapter(self) -> dict[str, torch.Tensor]:
        """LoRA tensors to load into the fresh policy ({} = a zero adapter, B = 0)."""
        return adapter_tensors(self.init.tensors) if self.init is not None else {}

    def restore(self, phase: str, opt: torch.optim.Optimizer, stream, controller, gen: torch.Generator,
                gen_key: str, seed: int) -> int:
        """Put a resume's state into the loop's objects; -> the step to continue at (0 = new).

        Called after everything that draws from the global RNGs was built (model, data,
        reward model), so the restored RNG state is what the next step of a straight run
        would have drawn from.
        """
        if self.resume is None:
            path = self.init.path if self.init is not None else None
            print(f"phase {phase}: starting from {self.init_name}" + (f" ({path})" if path else ""))
            return 0
        r = self.resume
        r.restore_optimizer(opt)
        stream.load_state_dict({"position": r.data_position, "seed": seed})
        controller.load_state_dict(r.controller_state)
        restore_rng(r.rng)
        if gen_key in r.tensors:  # the sampler's own generator: resumed runs draw what a straight run draws
            gen.set_state(r.tensors[gen_key])
        print(f"resuming phase {phase} at step {r.step} from {r.path}")
        return r.step


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
    return StartPoint(resume, init, name, base)
