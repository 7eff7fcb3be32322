"""The training command line: phase planning, per-phase configs, checks before any model
loads, and errors as one line. ``python -m grpo.train`` calls ``main`` here with the
trainer's phase runner (kept as a parameter, so this module needs nothing from the loop).

Phase planning: ``--phase B`` on an empty run directory runs A and B, because B starts from
A:best_structure and A from the pretrained base (grpo/presets.py phase_init; on tiny-random,
which trains from scratch, A starts from warmup:latest, so the warm-up runs first); a phase
whose start checkpoint exists, or an explicit ``--init``, runs alone. Every phase's
config is built and validated before anything runs, so a bad ``--A.optim.lr`` on
``--phase B`` fails in a second, not after the warm-up.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from transformers.utils import logging as hf_logging

from grpo.config import PERCEPTION_DEFAULTS, TrainConfig, reported_to, weigh_plugins
from grpo.config_checks import PHASES, trains_from_scratch
from grpo.config_file import read_config_file
from grpo.distributed import DataParallel, init_distributed, peer_lost
from grpo.errors import ConfigError, NoRewardSpread, PolicyCollapsed, StepOutOfMemory, TrainingDiverged, inside, one_line
from grpo.evaluation.final_report import write_final_report
from grpo.model.load import ModelLoadError
from grpo.model.policy import check_policy_config
from grpo.overrides import apply_overrides, describe_fields, parse_override_args
from grpo.own_data import sft_first
from grpo.presets import PRESETS, phase_init, phase_preset, preset_for_model, preset_overrides
from grpo.rewards.plugins import load_plugins
from grpo.run.files import RunFiles
from grpo.run.lock import RunDirBusy, RunLock, acquire
from grpo.run.phase_data import fall_back_to_all, load_training_data, require_held_out_rows
from grpo.run.runtime import keep_freed_memory, pick_device, seed_everything, set_threads
from grpo.run.stop import EvalAbandoned, Stopped, stop_message
from grpo.state.checkpoint import load_checkpoint
from grpo.state.compat import check_compatible, check_init_compatible, check_resumable
from grpo.state.layout import CheckpointError
from grpo.state.registry import SelectorError, read_registry
from grpo.state.resume import phase_finished, resume_point
from grpo.state.train_state import resolve_init
from grpo_infra.atomic import temp_path
from grpo_infra.signals import STOP, StopNow, exit_code, signal_name

RunPhase = Callable[[TrainConfig, RunFiles, str, DataParallel], None]  # one planned phase (grpo/train.py run_phase)


def phase_config(phase: str, preset: str, overrides: dict[str, str], requested: str) -> TrainConfig:
    """The resolved config of one phase: its preset, then --preset, then the CLI overrides.

    Overrides of phase.* and rewards.weights belong to the requested phase only (steps of
    phase B are not the warm-up's steps); every other override applies to all phases.
    """
    cfg = apply_overrides(phase_preset(phase), preset_overrides(preset, phase))
    for key, value in overrides.items():
        head, _, tail = key.partition(".")
        if head in PHASES:  # --A.steps 10: for phase A only
            if head == phase:
                apply_overrides(cfg, {tail: value})
        elif phase == requested or not _phase_local(key):
            apply_overrides(cfg, {key: value})
    if phase == "warmup" and trains_from_scratch(cfg.model.name):  # the perception labels teach a random tower
        given = {k.removeprefix("warmup.") for k in overrides}
        apply_overrides(cfg, {k: v for k, v in PERCEPTION_DEFAULTS.items() if k not in given})
    weigh_plugins(cfg.rewards)  # after the weights: a plug-in they leave out is paid 1.0, in the printed config too
    return cfg.validate()


def phase_configs(requested: str, preset: str, overrides: dict[str, str], init: str = "auto") -> dict[str, TrainConfig]:
    """The validated config of every phase up to the requested one (any of them may run).

    All are built before anything runs, so `--A.optim.lr inf` on `--phase B` fails now,
    not after the warm-up. A prefix naming a later phase would set nothing: refused.
    """
    for key in overrides:
        head = key.partition(".")[0]
        if head in PHASES and PHASES.index(head) > PHASES.index(requested):
            raise ConfigError(f"--{key}: phase {head} comes after the requested phase {requested} and does not run "
                              f"in this command; drop the option or run --phase {head}")
    order = PHASES[: PHASES.index(requested) + 1]
    # the requested phase first: its error is the one the user expects to read
    built = {p: phase_config(p, preset, overrides, requested) for p in reversed(order)}
    configs = {p: built[p] for p in order}
    if init != "auto":
        configs[requested].phase.init = init
        configs[requested].validate()
    return configs


def command_overrides(rest: list[str], config: str | None, requested: str) -> dict[str, object]:
    """The --key value flags, after the keys of the --config file if one is given: every flag
    is applied after the file's keys (a repeated key takes the flag's place), so a flag wins."""
    overrides: dict[str, object] = dict(parse_override_args(rest))
    if config is None:
        return overrides
    from_file = read_config_file(config, requested)
    return {k: v for k, v in from_file.items() if k not in overrides} | overrides


def choose_preset(preset: str | None, overrides: dict[str, str]) -> str:
    """An explicit --preset; else the one --model.name implies (printed on one line: a 7B run
    must not train silently with the tiny preset's float32, CPU and 112 px); else tiny."""
    if preset is not None:
        return preset
    names = [v for k, v in overrides.items() if k.replace("-", "_").split(".")[-2:] == ["model", "name"]]
    chosen = preset_for_model(names[-1]) if names else None  # ConfigError: a real model no preset fits
    if chosen is None:
        return "tiny"
    print(chosen[1], flush=True)
    return chosen[0]


def make_run_dir(root: Path) -> None:
    """Create the run directory (and its parents) unless it exists; ConfigError when a file is in the way."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--run.run_dir {root} is a file, not a directory: name a directory (it is created if missing)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"--run.run_dir {root}: a part of that path is a file, so the directory cannot be "
                          "created; name another directory") from None


def prove_writable(root: Path) -> None:
    """Create and remove a file in the run directory, before any work that would be lost."""
    # os.access says yes to root on a read-only directory and no to some ACL'd ones: try it.
    probe = temp_path(root / "write-probe")  # a .tmp- name: a kill here leaves a recognisable leftover
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.unlink(probe)


class MainRankFailed(Exception):
    """Rank 0 could not claim the run directory and printed why; this rank ends with its exit code."""

    def __init__(self, code: int):
        super().__init__(f"rank 0 ended with exit code {code}")
        self.code = code


def claim_exit_code(err: BaseException) -> int:
    """The exit code _main gives the error rank 0 met claiming the run directory."""
    if isinstance(err, (Stopped, StopNow)):
        return exit_code(err.signum)
    return 2 if isinstance(err, (ConfigError, RunDirBusy)) else 1


def claim_run_dir(root: Path, wait_s: float, dp: DataParallel) -> RunLock | None:
    """The run directory, created, locked (grpo/run/lock.py) and proven writable by the one
    process that writes it, before anything is written there: rank 0 under torchrun. A busy
    directory is RunDirBusy after ``wait_s`` seconds. The other ranks never write: they learn
    rank 0's outcome (one unwatched broadcast: rank 0 may be waiting for the lock) and, when
    it failed, end with its exit code (MainRankFailed) and no line of their own."""
    if not dp.is_main:
        code = dp.from_main(0)
        if code:
            raise MainRankFailed(code)
        return None
    lock = None
    try:
        make_run_dir(root)
        lock = acquire(root, wait_s)
        prove_writable(root)
    except BaseException as err:
        if lock is not None:
            lock.release()
        dp.from_main(claim_exit_code(err))
        raise
    dp.from_main(0)
    return lock


def lock_wait(text: str) -> float:
    """--lock-wait SECONDS: a finite number >= 0 (0 = refuse at once when another run holds the directory)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"--lock-wait {text!r}: give the seconds to wait for another run to release the run "
                          "directory, a number >= 0 (0: refuse at once)")
    return seconds


def preflight(configs: dict[str, TrainConfig], plan: list[str], files: RunFiles) -> None:
    """Every check that can fail before a model is loaded: model and LoRA targets, the
    run directory's checkpoints (compatible, resumable, intact), the start checkpoint, data,
    the reward plug-ins (imported now: a wrong module path is found before the model loads)."""
    first = configs[plan[0]]
    check_policy_config(first)  # model.name and lora.* are the same in every phase
    for phase in plan:
        if phase != "warmup":  # SFT computes no reward
            load_plugins(configs[phase].rewards.extra)
    for phase in plan:
        check_compatible(files.root, configs[phase])
        check_resumable(files.root, configs[phase])
    resuming = False
    if plan[0] != "warmup":
        resuming = resume_point(files.root, plan[0])[0] is not None  # all damaged: CheckpointError now
    if not resuming and plan[0] != "warmup":
        init_path, _ = resolve_init(first, files)  # SelectorError: names nothing
        if init_path is not None:
            load_checkpoint(init_path)  # damaged: CheckpointError now, not after building the model
            check_init_compatible(init_path, first)
    for phase in plan:
        if configs[phase].run.data != "synthetic":  # synthetic data is generated, never malformed
            train, val = load_training_data(configs[phase])  # first: a stage with no rows is named as such
            require_held_out_rows(configs[phase], train, val)


def _stop_between(where: str, saved: str) -> None:
    """A stop requested between phases (or before the report) ends the run there: nothing is in progress."""
    if STOP.requested:
        raise Stopped(stop_message(where, saved=saved), STOP.signum)


def _phase_local(key: str) -> bool:
    """Keys that describe one phase (its length, batch, mixture, start, reward weights)."""
    key = key.replace("-", "_")
    return key.split(".")[0] == "phase" or key in ("rewards.weights", "weights", "steps", "prompts_per_step",
                                                   "mixture", "init", "controller")


def phases_to_run(requested: str, files: RunFiles, init: str, model_name: str) -> list[str]:
    """The requested phase, preceded by every earlier phase whose checkpoint is missing."""
    order = list(PHASES[: PHASES.index(requested) + 1])
    if init != "auto" or read_registry(files.root, requested).get("aliases"):  # explicit start, or a resume
        return [requested]
    plan = [requested]
    for phase in reversed(order[:-1]):
        need = phase_init(plan[0], model_name).split(":")[0]
        # a phase stopped mid-way (its latest a periodic or stop save, or short of its steps) runs again: it resumes
        if need != phase or phase_finished(files.root, phase):
            break
        plan.insert(0, phase)
    return plan


HELP = """\
python -m grpo.train --phase {warmup,A,B,C} [--preset tiny|qwen7b] [--init base|SELECTOR|PATH] [--config FILE]
                    [--lock-wait SECONDS] [--sft-first auto|always|never] [--key value ...]

Phases (the staged, metric-gated curriculum):
  warmup  R1-VL policy warm-up: SFT on worked reasoning (a LoRA on a pretrained model; on
          tiny-random it trains every weight, teaches perception and leaves an imperfect,
          partly-compliant base on purpose: python -m grpo.pretrain runs it to build 'tiny')
  A       GRPO on stage 1, structure-heavy weights; starts from the pretrained base
          (from warmup:latest when the model trains from scratch: --model.name tiny-random)
  B       GRPO on stage 1 (.7) + stage 2 (.3), correctness-heavy; starts from A:best_structure
  C       GRPO on stage 2 (.6) + stage 3 (.4), tolerance on; starts from B:best_composite
A phase whose starting checkpoint is missing from the run directory runs the earlier phases
first, so `python -m grpo.train --phase B` runs A and B from the shipped model (and the
warm-up first on tiny-random). --init overrides the start:
'base' (the model as loaded), a selector such as A:best_structure, or a checkpoint path.
The same run directory resumes: the adapter, optimiser, schedule, controller, RNG and data
position of <phase>:latest are restored.

--lock-wait SECONDS: one run writes a run directory at a time. A command whose --run.run_dir
another run is writing is refused at once, with one line naming that run (pid, host, since
when); with --lock-wait it first waits up to SECONDS for that run to end, then goes on and
resumes from its last checkpoint (a scheduler that starts a job again before the old one has
ended). Under torchrun the wait must stay under the process group's 2-hour timeout.

--sft-first auto|always|never: own data (--run.data) on a base that cannot answer it gets no RL
signal. With auto (the default), a command that would start RL from the base first samples the
base on 16 training prompts; if fewer than half get any correct completion, it runs the warm-up
(SFT on the labels, 17 passes over the rows, at most 1,000 steps, LoRA on the vision tower
and merger too) and then phase B from it with a KL term to the warm-up's policy (--optim.beta
1) that keeps RL from erasing what SFT taught. On the shipped tiny base the plan also trains
LoRA on lm_head and sets the warm-up's lr to 4e-3 and B's to 1e-4 (another model keeps its
preset's lr). One line says what it chose and why, and an option you set wins
(--warmup.phase.steps, --warmup.optim.lr, --B.optim.lr, --B.optim.beta, --lora.vision,
--lora.merger, --lora.targets). always: that plan without the probe; never: RL alone, as before.

--preset: tiny by default; a --model.name that is Qwen2.5-VL-7B (its hub id, or a local
directory whose config.json is one) chooses qwen7b, and says so; the other Qwen2.5-VL sizes
need an explicit --preset. An explicit --preset always wins.

--config FILE: config keys from a JSON file (YAML for .yaml/.yml, with PyYAML installed), the
shape of a run's saved config_<phase>.json: {"optim": {"lr": 0.001}, "A": {"phase": {"steps": 20}}}.
Top-level sections apply as the same flags would; a top-level warmup, A, B or C holds keys for
that phase alone (as --A.phase.steps); flags on the command line override the file.

Options (--section.key VALUE, or --key VALUE where the key is unique). phase.* keys and
rewards.weights apply to the requested phase only; prefix a key with a phase name to set it
for that phase alone, e.g. --warmup.phase.steps 100 --A.optim.lr 1e-3:
"""


def main(argv: list[str] | None, run_phase: RunPhase) -> int:
    """The training CLI: resolve every phase's config, plan and check the run, then
    ``run_phase`` each planned phase (grpo/train.py passes the warm-up / GRPO dispatch).

    Every error the project raises on purpose ends as one line on stderr: exit 2 when the
    request is wrong (config, selector, model name, data), exit 1 when the run failed (a
    checkpoint, divergence, a step out of device memory, the run directory's disk). Anything else is a bug and keeps its
    traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    STOP.install()  # from here a signal never ends the run with a traceback (grpo_infra/signals.py, grpo/run/stop.py)
    try:
        return _main(argv, run_phase)
    finally:
        STOP.uninstall()


def _main(argv: list[str], run_phase: RunPhase) -> int:
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model load is noise in a training log
    keep_freed_memory()  # a step's buffers are reused by the next, not unmapped and faulted in again
    if "-h" in argv or "--help" in argv:
        print(HELP + describe_fields())
        return 0
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--phase", default="B", choices=PHASES)
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS))
    ap.add_argument("--init", default="auto")
    ap.add_argument("--config", default=None)
    ap.add_argument("--lock-wait", default="0")
    ap.add_argument("--sft-first", default="auto")
    known, rest = ap.parse_known_args(argv)
    dp, root, files, lock = None, None, None, None
    try:
        overrides = command_overrides(rest, known.config, known.phase)
        configs = phase_configs(known.phase, choose_preset(known.preset, overrides), overrides, known.init)
        cfg = configs[known.phase]
        files = RunFiles(Path(cfg.run.run_dir))
        root, wait_s = files.root, lock_wait(known.lock_wait)
        device = pick_device(cfg.model.device)
        # torchrun: this rank's process group and device; else one process
        dp = init_distributed(device, collective_timeout_s=cfg.run.collective_timeout_s)
        device, files.writer = dp.device, dp.is_main
        lock = claim_run_dir(files.root, wait_s, dp)  # one writer from here to the end: nothing was written before
        _run_plan(known.phase, configs, files, device, dp, run_phase, sft=(known.sft_first, set(overrides)))
    except Stopped as stop:  # a loop saved the step it stopped at (under torchrun every rank stops there)
        if dp is None or dp.is_main:
            print(stop, file=sys.stderr, flush=True)
        return exit_code(stop.signum)
    except StopNow as now:  # a second signal: the step in progress is lost, every checkpoint is intact
        print(f"stopped at once on a second {signal_name(now.signum)}; the step in progress is lost; "
              "the same command resumes from the last checkpoint", file=sys.stderr, flush=True)
        return exit_code(now.signum)
    except MainRankFailed as failed:  # rank 0 said why
        return failed.code
    except (ConfigError, SelectorError, ModelLoadError, RunDirBusy) as err:  # the command asks for something wrong: say what
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    # the run failed; its earlier checkpoints are intact
    except (CheckpointError, TrainingDiverged, NoRewardSpread, StepOutOfMemory, PolicyCollapsed) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        if dp is None or not dp.enabled or not peer_lost(err):
            raise  # not a lost rank: a bug, keep the traceback
        print(f"error: {dp.lost_rank_message(err)}", file=sys.stderr, flush=True)
        dp.owns_group = False  # destroying a group whose peer died can block; the process is ending anyway
        return 1
    except OSError as err:
        if root is None or not inside(err.filename, root):
            raise  # not the run directory's disk: a bug or an environment problem, keep the traceback
        why = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else err.strerror or str(err)
        print(f"error: cannot write to the run directory {root} ({why}: {err.filename}); "
              "fix its permissions or free space, or use another --run.run_dir", file=sys.stderr)
        return 1
    finally:
        if files is not None:
            files.close()  # trackers write their last events into the run directory: before the lock goes
        if dp is not None:
            dp.close()
        if lock is not None:
            lock.release()
    return 0


def _run_plan(requested: str, configs: dict[str, TrainConfig], files: RunFiles, device: str, dp: DataParallel,
              run_phase: RunPhase, sft: tuple[str, set[str]] = ("auto", set())) -> None:
    """Plan and check the run, ``run_phase`` each planned phase, then the end-of-run report.
    ``sft``: --sft-first and the keys the command set (own data: grpo/own_data.py)."""
    cfg = configs[requested]
    plan = phases_to_run(requested, files, cfg.phase.init, cfg.model.name) if cfg.run.run_prior_phases else [requested]
    fall_back_to_all({p: configs[p] for p in plan})  # own data without MathVista metadata: the stage "all"
    plan = sft_first(plan, configs, sft[1], device, sft[0], files.root)  # own data the base cannot answer: SFT first
    preflight(configs, plan, files)
    if len(plan) > 1:
        start = cfg.phase.init if cfg.phase.init != "auto" else phase_init(requested, cfg.model.name)
        print(f"phase {requested} starts from {start}, which {files.root} does not have yet: running {' -> '.join(plan)}")
    t_run = time.time()
    for phase in plan:
        _stop_between(f"the start of phase {phase}", "everything before it is saved")
        pcfg = configs[phase]
        dp.barrier()  # every rank has read the run directory (and rank 0 finished writing it)
        print(f"\n===== phase {phase} =====\nresolved config:\n{pcfg.to_json()}", flush=True)
        if dp.is_main:
            (files.root / f"config_{phase}.json").write_text(pcfg.to_json())
        seed_everything(pcfg.run.seed)
        set_threads(pcfg.run.cpu_threads)
        files.track(reported_to(pcfg.run), pcfg.to_dict())
        t_phase = time.time()
        run_phase(pcfg, files, device, dp)
        print(f"phase {phase} took {time.time() - t_phase:.0f}s", flush=True)
    if dp.is_main and requested != "warmup" and cfg.run.test_per_stage > 0:
        _stop_between("the final report", "every checkpoint is saved")
        try:
            write_final_report(files.root, requested, cfg, device)
        except EvalAbandoned:
            raise Stopped(stop_message("the final report (abandoned)", saved="every checkpoint is saved"),
                          STOP.signum) from None
    print(f"done in {time.time() - t_run:.0f}s; checkpoints and train_log.jsonl in {files.root}")
