"""The learning benchmark: does GRPO raise exact match here, by how much, and which lever helps?

    python -m bench.learning                      # the main job x 3 seeds, every ablation, the control
    python -m bench.learning --seeds 1 --variants mu2,frozen
    python -m bench.learning --plan               # print every command line, run nothing
    python -m bench.learning --quick              # a tiny smoke configuration (seconds; numbers mean nothing)

What it runs
------------
Every run is the README's main job, ``python -m grpo.train --phase B`` with the defaults
(the shipped base -> A -> B, then the end-of-run report on the held-out test split), started
as a subprocess (a fresh interpreter per run: no torch state, RNG or memory carried from one
run into the next), with ``--run.seed k`` and its own run directory

    <out>/<variant>/seed<k>/     the trainer's run directory (checkpoints, train_log.jsonl,
                                 report/), plus train.out (the trainer's console output),
                                 bench_run.json (what was asked for) and bench_eval.json
                                 (the numbers this script took from it)

This script holds each run directory's lock (grpo/run/lock.py) while it writes there, and hands
it to the trainers it starts (they write as its writer, neither waits for the other): another
benchmark or trainer on the same directory is refused with one line naming this one.

A variant is a named list of trainer options on top of the defaults (``--plan`` prints each
one's command). The defaults are read from grpo/config.py at run time (phase_configs), never
copied here, so when they change the variants follow. Every variant starts from the same
shipped base (grpo/tiny_model: the seed varies the GRPO phases only); its options carry an
``A.`` / ``B.`` prefix. The frozen control starts phase B from the same seed's
A:best_structure, copied from the default run (checked: the shared phase's resolved config
must be equal, or the plan stops before any work).

Resuming. A finished run (phase B at its last step, its report written) is never rerun; a
run that was interrupted is continued by the trainer from its own checkpoints (an
interrupted phase A is completed with ``--phase A`` first: ``--phase B`` alone would start
B from an unfinished A). A run directory made with other settings (another variant's
options, or changed defaults) is refused with the settings that differ, never reused.

What it measures, per seed and checkpoint (the shipped ``base``, ``A:best_structure``,
``B:best_composite``, ``B:latest``) on the synthetic *test* split (the report's examples,
``run.test_per_stage`` per stage, never used to choose a checkpoint):

    EM           greedy exact match, one sample per prompt (the report's protocol), Wilson 95%
    EM shuffled  the same prompts with every image swapped for another of its family
                 (eval/blind.py), Wilson 95%
    blind gap    EM - EM shuffled: how much of EM comes from reading the picture; paired
                 95% interval of the per-prompt differences (includes 0: cannot tell the
                 model from one that ignores its images)
    parseable    the answer is one parseable SOLUTION number, Wilson 95%
    tokens       mean completion tokens, normal 95%
    pass@k       k samples per prompt at temperature 1: any of them exact, Wilson 95% (with
                 true images; and with shuffled images, and their paired gap)

The greedy numbers are read from the run's own report (report/report.json): nothing is
evaluated twice. pass@k is sampled here, once per checkpoint file (a copied phase is the
same file and is not sampled again: results are cached by the sha256 of state.json, and the
base by its model file's).

Aggregation over seeds: mean, and the spread as min..max over the seeds (with 3 seeds an
sd is itself a guess; the range shows every seed). With one seed the cell shows that run's
95% interval instead. summary.md has every per-seed value with its interval, and the
paired per-seed difference B:latest - A:best_structure (what RL adds over phase A).

The frozen-policy control (variant ``frozen``): phase B again from the same
A:best_structure, on the same prompts and sampler seed, with ``--B.optim.lr 0`` -- the
trainer samples, scores, logs, evaluates and checkpoints as in training and never updates
the policy (grpo/config.py accepts lr 0 in GRPO phases only, for this). Its training
reward is the baseline the default's training curve is read against; it is not evaluated
on the test split (its policy is A's). Plots (pillow, eval/plots.py): curves_seed<k>.png
(phase B training reward and correctness, moving average, every variant against the
frozen control; held-out val EM and blind gap at each checkpoint eval) and
test_checkpoints.png (test EM and blind gap per checkpoint, per seed).

The four papers' mechanisms, each against the default on the same seeds (paired over the same
test prompts: each variant's last model minus the default's B:latest):

    a_continued        the curriculum's control: phase A runs on for B's steps (phase B given
                       every setting of A, started from A:latest); the staged curriculum earns
                       its place only if B beats this
    no_controller      the metric-gated controller off in A and B (preset weights fixed)
    no_curriculum      phase A samples B's stage mixture from its first step
    step_rewards       R1-VL: StepRAR + StepRVR, weight 1 each, in A and B
    detail             RewardMap: the difficulty-weighted detail reward, weight alpha = .5, in B
    rubrics_prefix     V-Rubrics: the rubric score credited to token prefixes in the fused loss
    rubrics_sequence   the same rubric score and weight as a sequence reward (isolates the prefix)
    arithmetic         not a paper's: 1 iff every equation of the reasoning is right, weight
                       correctness / 2, in A and B (the reports' most common error after misreads
                       is a wrong sum copied into the SOLUTION)
    phase_c            phase C after the default's B (``--phase C``; A and B copied), reported
                       per stage and as C:latest - C's start (B:latest)

A variant whose reward needs a field the data lacks (key steps, intermediates, rubrics) is
refused at the start with one line naming the variant, the component and the field.

Every checkpoint also gets the reasoning metrics of eval/reasoning.py, recomputed from the
report's samples (so older reports get them too): answer follows reasoning (the SOLUTION is the
number the reasoning ends on), right reasoning with a wrong answer, arithmetic right (every
"a + b = c" of the reasoning is right) and key-step accuracy. ``--report-only`` summarises the
finished runs and trains nothing (the unfinished ones are listed).

The controls a claim of learning is read against: ``frozen`` (above); ``random`` (each
completion's rewards replaced by those of a random completion of its batch: GRPO's
mechanics -- clipping, group normalisation, the format the base already half follows --
without the signal); ``correctness0`` (every weight but correctness, the staged paper's
accidental setting); and, in every row, EM with shuffled images.

Simplified: bit-identical reruns are claimed only on the same machine and software, and
with ``--jobs`` > 1 the trainers' wall times include the sharing of the cores.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.run.lock import LOCK_FILE, RunDirBusy, RunLock, acquire
from grpo.run.stop import EvalAbandoned
from grpo_infra.atomic import new_directory, replace_file
from grpo_infra.signals import STOP, StopNow, exit_code

DEFAULT_OUT = Path("bench/results/learning")
QUICK_OUT = Path("bench/results/learning-quick")
REQUESTED = "B"  # the README's main job: --phase B (the shipped base -> A -> B)
CHECKPOINTS = ("base", "A:best_structure", "B:best_composite", "B:latest")
CHECKPOINT_TITLES = {
    "base": "Shipped base, before RL (`base`)",
    "A:best_structure": "After phase A (`A:best_structure`)",
    "B:best_composite": "After phase B, best composite (`B:best_composite`)",
    "B:latest": "Phase B's last step (`B:latest`)",
}
SHORT = {"base": "base", "A:best_structure": "A best", "B:best_composite": "B best", "B:latest": "B last"}
PASS_TEMPERATURE = 1.0
PASS_BATCH = 8  # prompts per sampler call: part of the sampled protocol (each batch seeds its own generator)
SEP = ".."  # min..max in the tables: brackets are kept for 95% intervals

# A smoke configuration: every phase, eval, report, control and plot runs, in seconds; the
# numbers mean nothing (2 steps of 2 prompts move nothing).
QUICK_ARGS = [
    "--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4", "--run.eval_every", "1",
    "--run.test_per_stage", "2", "--sampling.G", "2", "--sampling.max_new_tokens", "8",
    "--A.phase.steps", "2", "--A.phase.prompts_per_step", "2", "--B.phase.steps", "2", "--B.phase.prompts_per_step", "2",
]


_children: set[subprocess.Popen] = set()  # the running trainers: a stop is forwarded to each


def _forward(signum: int) -> None:
    """Hand a signal on to every running trainer (they stop after their step and save)."""
    for proc in list(_children):
        try:
            proc.send_signal(signum)
        except OSError:  # it just ended
            pass


class BenchStopped(Exception):
    """A run ended by a stop request (its trainer saved its checkpoint)."""


class BenchError(Exception):
    """A request this script refuses (exit 2) or a run that failed (exit 1): one line."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- variants


def _weights(w: dict[str, float], **change: float) -> str:
    """A full weight list for --rewards.weights: an override replaces the phase's whole dict
    (grpo/config.py override), so 'correctness=0' alone would drop every other term."""
    return ",".join(f"{k}={v!r}" for k, v in {**w, **change}.items())


def _round_down(x: float, digits: int = 3) -> float:
    """x cut (not rounded up) to `digits` significant digits: a floor just under a std leaves it unchanged."""
    if x <= 0:
        return 0.0
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.floor(x * scale) / scale


def std_floor(cfg) -> float:
    """The std of the smallest correctness split: one completion of G right, the others tied.

    That group's rewards differ by w_correctness in one place, so its (unbiased) std is
    w / sqrt(G) (grpo_kernels/grpo_advantages.py): 2 / sqrt(8) = .707 in phase A, 4 / sqrt(8) = 1.41
    in B with the current defaults. With the floor there, every group that splits on
    correctness is normalised exactly as before, and a group that ties on correctness and
    format and differs by one brevity bucket (w .2-.25, a step of .5 -> std ~ .04) keeps
    advantages ~ 1/30 of a unit instead of a full unit z-score.
    """
    w = cfg.rewards.weights.get("correctness", 0.0)
    if w <= 0:
        raise BenchError(f"variant std_floor: phase {cfg.phase.name} has correctness weight {w}, so the floor "
                         "(the std of one right answer in G) is 0; give the phase a correctness weight")
    return _round_down(w / math.sqrt(cfg.sampling.G))


@dataclass(frozen=True)
class Variant:
    name: str
    what: str  # one line: --help, the plan and the summary
    args: Callable[[dict], list[str]]  # trainer options, from the default run's resolved configs
    shares: tuple[str, ...] = ()  # phase directories copied from the default run of the same seed
    control: bool = False  # the frozen policy: a curve baseline, not evaluated on the test split
    last: str = REQUESTED  # the last phase it trains (--phase): B, or C for the phase-C variant

    @property
    def extra_checkpoints(self) -> tuple[str, ...]:
        """Checkpoints past the table's four (a run that goes on to phase C: C's best and last)."""
        return () if self.last == REQUESTED else (f"{self.last}:best_composite", f"{self.last}:latest")

    @property
    def final(self) -> str:
        """The checkpoint the variant ends on (the README table's row)."""
        return f"{self.last}:latest"

    @property
    def before_final(self) -> str:
        """The checkpoint its last phase starts from, as the table's "B - A" reads it."""
        return "A:best_structure" if self.last == REQUESTED else "B:latest"


def _both(key: str, value: Callable[[Any], Any]) -> Callable[[dict], list[str]]:
    """The option for phases A and B, each with its own value (the prefix names the phase)."""
    return lambda cfgs: [a for p in ("A", "B") for a in (f"--{p}.{key}", str(value(cfgs[p])))]


def _value(v: Any) -> str:
    """A resolved config value as the command line writes it (dicts name=value, tuples comma separated)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return ",".join(f"{k}={x!r}" for k, x in v.items())
    if isinstance(v, (tuple, list)):
        return ",".join(map(str, v))
    return str(v)


# What phase B keeps of its own when it becomes "phase A continued": its length, its start and
# its eval cadence (the budget the default's B spends), and its name (the checkpoints it writes).
_CONTINUE_KEEPS = {"phase.name", "phase.steps", "phase.init", "run.eval_every"}


def a_continued(cfgs: dict) -> list[str]:
    """Phase B given every setting of phase A (weights, mixture, lr, tolerance, ...) and started
    from A's last step: A simply runs on for B's steps. Read from the resolved configs, so when
    a phase default changes the control follows it. The controller restarts from A's preset
    weights (each phase's controller starts from its config), and AdamW starts afresh."""
    out = ["--B.phase.init", "A:latest"]
    a, b = json.loads(cfgs["A"].to_json()), json.loads(cfgs["B"].to_json())
    for section, fields in a.items():
        for name, value in fields.items():
            key = f"{section}.{name}"
            if key not in _CONTINUE_KEEPS and value != b[section][name]:
                out += [f"--B.{key}", _value(getattr(getattr(cfgs["A"], section), name))]
    return out


def _plus(phases: tuple[str, ...], extra: Callable[[Any], dict[str, float]], *more: str) -> Callable[[dict], list[str]]:
    """The phases' own weights plus `extra(phase config)` (and further fixed options per phase)."""
    return lambda cfgs: [a for p in phases for a in (f"--{p}.rewards.weights",
                                                      _weights(cfgs[p].rewards.weights, **extra(cfgs[p])),
                                                      *[f"--{p}.{m}" if i % 2 == 0 else m for i, m in enumerate(more)])]


# R1-VL's StepGRPO reward is r_auc + r_val: StepRAR (1[correct] + alpha * matched key steps,
# alpha = .1 inside the component) plus StepRVR (0/1 validity), each with weight 1; here they
# are added to the staged paper's terms, which stay as the phase sets them.
R1VL_WEIGHTS = {"step_rar": 1.0, "step_rvr": 1.0}
# RewardMap: R = W (R_format + R_correct + alpha R_detail) with alpha = .5; the detail component
# already carries W (grpo/rewards/detail.py), so its weight is alpha.
REWARDMAP_ALPHA = 0.5
# The tower's and merger's learning rate in vision_lr, as a multiple of the language model's: a
# tenth, the ratio a throwaway prototype of the tower switch tried (one seed, before the switches).
VISION_LR_SCALE = 0.1


def _tower_and_merger(cfgs) -> list[str]:
    """LoRA on the vision tower's blocks and on the merger, in A and B."""
    return _both("lora.vision", lambda c: "true")(cfgs) + _both("lora.merger", lambda c: "true")(cfgs)


def _rubric_weight(cfg) -> dict[str, float]:
    """The rubric term as heavy as the phase's correctness: in sequence mode the rubric score
    then carries about half of the reward, as prefix mode's default split a = .5 gives it."""
    return {"rubric": cfg.rewards.weights.get("correctness", 1.0)}


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("default", "the README's main job with the defaults (every other variant is compared with it)",
            lambda cfgs: []),
    Variant("correctness0", "the staged paper's accidental setting: correctness weight 0 in phases A and B "
            "(its gold answers were empty), every other weight as in the phase preset",
            lambda cfgs: [a for p in ("A", "B") for a in (f"--{p}.rewards.weights",
                                                          _weights(cfgs[p].rewards.weights, correctness=0.0))]),
    Variant("random", "random-reward control: in A and B each completion's rewards are those of a random completion "
            "of its batch (drawn with replacement): GRPO's mechanics without the signal",
            _both("rewards.random_reward", lambda c: "true")),
    Variant("mu2", "two optimiser steps per rollout batch in A and B (the clip binds from the 2nd)",
            _both("optim.updates_per_batch", lambda c: 2)),
    Variant("dynamic", "DAPO dynamic sampling in A and B (zero-spread groups dropped, batch refilled)",
            _both("sampling.dynamic_sampling", lambda c: "true")),
    Variant("components", "per-component advantages in A and B (each reward term z-scored alone, GDPO)",
            _both("optim.adv_mode", lambda c: "components")),
    Variant("std_floor", "advantage std floor in A and B = w_correctness / sqrt(G) of the phase, the std of one "
            "right answer in a group (see std_floor())", _both("optim.adv_std_floor", std_floor)),
    Variant("kl", "KL anchor beta = 0.04 in A and B (k3 against the LoRA-off reference)",
            _both("optim.beta", lambda c: 0.04)),
    Variant("fp32", "phases A and B over the float32 base instead of NF4 (what the 4-bit base costs in EM and time)",
            _both("model.load_in_4bit", lambda c: "false")),
    Variant("kl_mu2", "phase B alone with the KL anchor (beta 0.04) and two updates per rollout batch, from the same "
            "A:best_structure (the two levers positive on every seed of the blind base's benchmark, together)",
            lambda cfgs: ["--B.optim.beta", "0.04", "--B.optim.updates_per_batch", "2"], shares=("A",)),
    Variant("a_continued", "the curriculum's control: no phase B; phase A runs on for B's steps (B given every "
            "setting of A and started from A:latest; B's eval cadence), from the same phase A",
            a_continued, shares=("A",)),
    Variant("no_controller", "the metric-gated controller off in A and B: each phase's preset weights fixed "
            "throughout", _both("phase.controller", lambda c: "false")),
    Variant("no_curriculum", "no curriculum: phase A samples phase B's stage mixture from its first step "
            "(one mixture throughout; the reward weights still change from A to B)",
            lambda cfgs: ["--A.phase.mixture", _value(cfgs["B"].phase.mixture)]),
    Variant("step_rewards", "R1-VL's StepRAR + StepRVR (weight 1 each, alpha .1) added in A and B",
            _plus(("A", "B"), lambda c: R1VL_WEIGHTS)),
    Variant("detail", f"RewardMap's difficulty-weighted detail reward (weight alpha = {REWARDMAP_ALPHA}) added in "
            "phase B, from the same phase A", _plus(("B",), lambda c: {"detail": REWARDMAP_ALPHA}), shares=("A",)),
    Variant("rubrics_prefix", "V-Rubrics in phase B (rubric weight = B's correctness weight), credited to token "
            "prefixes in the fused loss (a = .5), from the same phase A",
            _plus(("B",), _rubric_weight, "rewards.rubric_mode", "prefix"), shares=("A",)),
    Variant("rubrics_sequence", "the same rubric score as rubrics_prefix, as a plain sequence reward (isolates "
            "the prefix credit), from the same phase A",
            _plus(("B",), _rubric_weight, "rewards.rubric_mode", "sequence"), shares=("A",)),
    Variant("arithmetic", "the reasoning's arithmetic as a reward (1 iff every 'expression = number' of the "
            "reasoning is right; none of the four papers' terms) at half the correctness weight, in A and B",
            _plus(("A", "B"), lambda c: {"arithmetic": c.rewards.weights.get("correctness", 1.0) / 2})),
    Variant("vision", "LoRA on the vision tower's blocks and its merger too, in A and B (lora.vision, lora.merger; "
            "their learning rates the language model's)",
            _tower_and_merger),
    Variant("vision_lr", f"the tower's blocks and merger get LoRA in A and B as in vision, trained at "
            f"{VISION_LR_SCALE} x the language model's learning rate (ms-swift's vit_lr / aligner_lr)",
            lambda cfgs: [*_tower_and_merger(cfgs), *_both("optim.vision_lr_scale", lambda c: VISION_LR_SCALE)(cfgs),
                          *_both("optim.merger_lr_scale", lambda c: VISION_LR_SCALE)(cfgs)]),
    Variant("merger", "LoRA on the vision merger (the projector) too, the tower's blocks frozen, in A and B",
            _both("lora.merger", lambda c: "true")),
    Variant("vision_b", "the tower's blocks and merger get LoRA in phase B only (A frozen, as the default's), "
            "from the same phase A", lambda cfgs: ["--B.lora.vision", "true", "--B.lora.merger", "true"],
            shares=("A",)),
    Variant("noisy", "NoisyRollout (arXiv 2504.13055) in A and B: half of each group sampled from the image with "
            "Gaussian noise (sampling.noise_std's default, annealed to 0 over the phase), all trained on the clean image",
            _both("sampling.noisy_fraction", lambda c: 0.5)),
    Variant("phase_c", "phase C (stages 2 and 3, tolerance credit) after the default's A and B, copied from the "
            "default run; reported per stage, and C:latest - B:latest", lambda cfgs: [], shares=("A", "B"), last="C"),
    Variant("frozen", "frozen-policy control: phase B from the same A:best_structure with --B.optim.lr 0 "
            "(sampled, scored and logged like training; curves only)",
            lambda cfgs: ["--B.optim.lr", "0", "--B.run.test_per_stage", "0"], shares=("A",), control=True),
]}


# ----------------------------------------------------------------------------- runs


@dataclass
class Run:
    variant: Variant
    seed: int
    dir: Path
    options: list[str]  # trainer options after --phase B (run dir and seed included)
    configs: dict = field(default_factory=dict)  # phase -> resolved TrainConfig

    @property
    def name(self) -> str:
        return f"{self.variant.name} seed{self.seed}"

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", "grpo.train", "--phase", self.variant.last, *self.options]


def _config_json(configs: dict) -> dict:
    """Resolved configs as plain JSON, without the run directory (it names the run, not what it does)."""
    out = {}
    for phase, cfg in configs.items():
        d = json.loads(cfg.to_json())
        d["run"].pop("run_dir", None)
        out[phase] = d
    return out


def _diffs(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in _diffs(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{where}.{k}" if where else str(k))]
    return [] if a == b else [f"{where}: {a!r} -> {b!r}"]


def _later_phase(base: Sequence[str], last: str) -> list[str]:
    """A run that goes past B gets the base's B-prefixed options for its last phase too (the
    --quick budget: 2 steps of 2 prompts), so that phase is as short as B."""
    if last == REQUESTED:
        return []
    pairs = list(zip(base[::2], base[1::2]))
    return [a for key, value in pairs if key.startswith("--B.") for a in (f"--{last}." + key[4:], value)]


def plan_runs(variants: Sequence[str], seeds: Sequence[int], out: Path, base: Sequence[str]) -> list[Run]:
    """Every run, its options and resolved configs, checked before anything is trained.

    A bad option, a variant that would change a phase it shares with the default run, or an
    existing run directory made with other settings is refused here (BenchError, exit 2).
    """
    from grpo.cli import phase_configs
    from grpo.errors import ConfigError
    from grpo.overrides import parse_override_args

    def resolve(options: list[str], what: str, last: str = REQUESTED) -> dict:
        try:
            return phase_configs(last, "tiny", parse_override_args(options))
        except (ConfigError, ValueError) as err:
            raise BenchError(f"{what}: {err}") from None

    runs: list[Run] = []
    defaults = resolve(list(base), "the default configuration")
    for name in variants:
        v = VARIANTS[name]
        extra = v.args(defaults)
        problem = reward_data_problem(name, resolve([*base, *extra], f"variant {name}", v.last))
        if problem:
            raise BenchError(problem)
        for seed in seeds:
            d = out / name / f"seed{seed}"
            options = ["--run.run_dir", str(d), "--run.seed", str(seed), *base, *_later_phase(base, v.last), *extra]
            run = Run(v, seed, d, options, resolve(options, f"variant {name} seed {seed}", v.last))
            if v.shares:
                main = next(r for r in runs if r.variant.name == "default" and r.seed == seed)
                mine, theirs = _config_json(run.configs), _config_json(main.configs)
                for phase in v.shares:
                    diff = _diffs(theirs[phase], mine[phase])
                    if diff:
                        raise BenchError(f"variant {name} changes phase {phase}, which it shares with the default run "
                                         f"({'; '.join(diff[:3])}): give its options an A. or B. prefix")
            _check_run_dir(run)
            runs.append(run)
    return runs


def _stage_samples(cfg) -> dict[int, list]:
    """A few training examples of each stage the phase samples (synthetic: generated; a data
    directory: its stage subsets)."""
    stages = [st for st, p in cfg.phase.mixture.items() if p > 0]
    if cfg.run.data == "synthetic":
        from data.synthetic import generate

        return {st: generate("train", st, 2, cfg.run.seed, cfg.model.image_size) for st in stages}
    from grpo.run.phase_data import load_training_data

    return {st: exs[:50] for st, exs in load_training_data(cfg)[0].items() if st in stages}


def reward_data_problem(name: str, configs: dict, samples: Callable[[Any], dict[int, list]] = _stage_samples) -> str | None:
    """One line naming the variant, the reward component and the field its examples lack (key
    steps, intermediates, rubrics...), or None: checked before any run starts, so a variant
    never trains on a component that scores 0 because the data cannot feed it."""
    from grpo.rewards.compose import _missing

    for phase, cfg in configs.items():
        if phase == "warmup":
            continue
        extra = [c for c in cfg.rewards.weights if c in ("step_rar", "step_rvr", "detail", "rubric")]
        if not extra:
            continue
        for stage, examples in samples(cfg).items():
            for ex in examples:
                for comp in extra:
                    why = _missing(comp, ex, rule_judge=True)
                    if why:
                        return (f"variant {name}: reward component {comp!r} of phase {phase} needs a field the data "
                                f"({cfg.run.data}, stage {stage}) lacks: example {ex.pid!r} {why}; run the variant "
                                "on data that has it, or leave it out")
    return None


def _check_run_dir(run: Run) -> None:
    """An existing run directory must have been made by this script with these settings."""
    meta = run.dir / "bench_run.json"
    if not run.dir.exists() or not any(p.name != LOCK_FILE for p in run.dir.iterdir()):
        return  # new, or only the lock file of a run killed before it wrote anything
    if not meta.is_file():
        raise BenchError(f"{run.dir} exists but was not made by bench.learning (no bench_run.json): "
                         "move it away or choose another --out")
    try:
        saved = json.loads(meta.read_text())["configs"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BenchError(f"{meta} is unreadable ({err}): delete {run.dir} to rerun it") from None
    diff = _diffs(saved, _config_json(run.configs))
    if diff:
        raise BenchError(f"{run.dir} holds a run made with other settings ({'; '.join(diff[:3])}"
                         f"{f'; {len(diff) - 3} more' if len(diff) > 3 else ''}): delete it to rerun with "
                         "these, or choose another --out")


def _b_steps(run: Run) -> int:
    """The steps of the run's last phase (B, or C for a run that goes on to it)."""
    return run.configs[run.variant.last].phase.steps


def _latest(run_dir: Path, phase: str) -> int | None:
    from grpo.state.layout import CheckpointError
    from grpo.state.registry import read_registry

    try:
        return read_registry(run_dir, phase)["aliases"].get("latest")
    except CheckpointError as err:  # a damaged registry: this run cannot be trusted or resumed
        raise BenchError(f"{err}; delete {run_dir} to rerun it", code=1) from None


def _report(run: Run) -> dict | None:
    """The run's report.json if it is complete (every checkpoint of the table in it)."""
    path = run.dir / "report" / "report.json"
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rep if all(c in rep.get("models", {}) for c in CHECKPOINTS + run.variant.extra_checkpoints) else None


def finished(run: Run) -> bool:
    """Phase B at its last step (evaluated: not a stop's save) and, unless the run makes no
    report, its report written."""
    from grpo.state.resume import phase_finished

    last = run.variant.last
    if not (run.dir / last / "registry.json").is_file() or _latest(run.dir, last) != _b_steps(run) \
            or not phase_finished(run.dir, last):
        return False
    return run.configs[last].run.test_per_stage == 0 or _report(run) is not None


def state(run: Run) -> str:
    if finished(run):
        return "finished: reused"
    if (run.dir / "bench_run.json").is_file():
        return "interrupted: resumed from its checkpoints"
    return "new: trained" + (f" from the default run's {' + '.join(run.variant.shares)}" if run.variant.shares else "")


def _copy_shared(run: Run, main: Run) -> None:
    """Start an ablation from the default run's phases (same seed): the log lines, then the
    phase directories, each written under a temporary name and renamed, so an interrupted
    copy is never mistaken for a complete one."""
    log = run.dir / "train_log.jsonl"
    if not log.exists():
        lines = [json.dumps(row) for row in _log(main) if row.get("phase") in run.variant.shares]
        replace_file(log, "".join(line + "\n" for line in lines))
    for phase in run.variant.shares:
        if (run.dir / phase / "registry.json").is_file():
            continue
        # replace: a leftover without a registry is never a checkpoint
        with new_directory(run.dir / phase, replace=True) as tmp:
            shutil.copytree(main.dir / phase, tmp, dirs_exist_ok=True)
        cfg = main.dir / f"config_{phase}.json"
        if cfg.is_file():
            shutil.copyfile(cfg, run.dir / f"config_{phase}.json")


def _phase_a_options(run: Run) -> list[str]:
    """The options that give phase A the same config when A itself is requested: --phase B's
    unprefixed phase-local options (steps, weights, ...) belong to B and B.-prefixed ones to
    B alone, so both are dropped; no report (B's run writes it)."""
    from grpo.cli import _phase_local, phase_configs
    from grpo.config_checks import PHASES
    from grpo.overrides import parse_override_args

    keep = []
    for key, value in parse_override_args(run.options).items():
        head = key.partition(".")[0]
        if (head in PHASES and head in ("warmup", "A")) or (head not in PHASES and not _phase_local(key)):
            keep += [f"--{key}", value]
    keep += ["--run.test_per_stage", "0"]
    # the translation must give A exactly the config the --phase B command gives it
    mine = _config_json({"A": phase_configs("A", "tiny", parse_override_args(keep))["A"]})["A"]
    want = _config_json({"A": run.configs["A"]})["A"]
    mine["run"].pop("test_per_stage"), want["run"].pop("test_per_stage")
    diff = _diffs(want, mine)
    if diff:
        raise BenchError(f"{run.name}: cannot complete phase A alone with the same config ({'; '.join(diff[:3])}); "
                         f"delete {run.dir} to rerun it from the start")
    return keep


def _train(run: Run, argv: list[str], label: str, lock: RunLock) -> None:
    """One trainer subprocess, its console output appended to train.out; exit 1 names the last line.
    It is handed ``lock``, this process's lock on the run directory (grpo/run/lock.py): it writes
    there as this process's writer, and no other trainer can."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one thread everywhere, as the trainer
    out = run.dir / "train.out"
    t0 = time.time()
    print(f"[bench] {run.name}: {label} ... (console: {out})", flush=True)
    with out.open("a") as f:
        f.write(f"\n$ {shlex.join(['python', *argv[1:]])}\n")
        f.flush()
        if STOP.requested:  # stopping: start no trainer
            raise BenchStopped(run.name)
        # its own session: a Ctrl-C at the terminal reaches this script only, which forwards it
        # once (the terminal's copy and ours would be two: the trainer would stop at once)
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **lock.child(env))
        _children.add(proc)
        try:
            rc = proc.wait()
        finally:
            _children.discard(proc)
    meta_path = run.dir / "bench_run.json"  # wall time of this run's trainer calls (a resume adds up)
    meta = json.loads(meta_path.read_text())
    meta["train_seconds"] = meta.get("train_seconds", 0.0) + time.time() - t0
    replace_file(meta_path, json.dumps(meta, indent=2))
    if rc in (130, 143) and STOP.requested:  # it saved the step it stopped at: the next bench run resumes it
        print(f"[bench] {run.name}: stopped, checkpoint saved ({out})", flush=True)
        raise BenchStopped(run.name)
    if rc != 0:
        lines = [ln for ln in out.read_text().splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "")
        raise BenchError(f"{run.name}: grpo.train exited with {rc} after {time.time() - t0:.0f}s ({last.strip()}); "
                         f"see {out}", code=2 if rc == 2 else 1)
    print(f"[bench] {run.name}: {label} done in {time.time() - t0:.0f}s", flush=True)


def hold(run: Run) -> RunLock:
    """This process's lock on the run's directory (grpo/run/lock.py), the directory created first;
    BenchError (exit 2) naming the holder when another process writes it."""
    run.dir.mkdir(parents=True, exist_ok=True)
    try:
        return acquire(run.dir, other="another --out", wait_flag=None)
    except RunDirBusy as err:
        raise BenchError(f"{run.name}: {err}") from None


def ensure_trained(run: Run, runs: Sequence[Run]) -> None:
    """Train the run, or finish an interrupted one, holding its directory: its bench files, the
    phases copied from the default run and the trainers (each handed the lock) are one writer."""
    if finished(run):
        return
    lock = hold(run)
    try:
        _ensure_trained(run, runs, lock)
    finally:
        lock.release()


def _ensure_trained(run: Run, runs: Sequence[Run], lock: RunLock) -> None:
    (run.dir / "bench_eval.json").unlink(missing_ok=True)  # whatever it says, it is about an older state
    meta_path = run.dir / "bench_run.json"
    seconds = json.loads(meta_path.read_text()).get("train_seconds", 0.0) if meta_path.is_file() else 0.0
    meta = {"variant": run.variant.name, "seed": run.seed, "command": shlex.join(run.command()),
            "configs": _config_json(run.configs), "train_seconds": seconds}
    replace_file(meta_path, json.dumps(meta, indent=2))
    if run.variant.shares:
        main = next(r for r in runs if r.variant.name == "default" and r.seed == run.seed)
        if not finished(main):
            raise BenchError(f"{run.name} starts from the default run of seed {run.seed}, which is not finished "
                             f"({main.dir}); run it first (--variants default)", code=1)
        _copy_shared(run, main)
    a_steps = run.configs["A"].phase.steps
    if (run.dir / "A" / "registry.json").is_file() and not (run.dir / "B" / "registry.json").is_file() \
            and (_latest(run.dir, "A") or 0) < a_steps:
        _train(run, [sys.executable, "-m", "grpo.train", "--phase", "A", *_phase_a_options(run)],
               f"completing the interrupted phase A (step {_latest(run.dir, 'A')} of {a_steps})", lock)
    _train(run, run.command(sys.executable), "training" if not (run.dir / run.variant.last).exists() else "resuming",
           lock)
    if not finished(run):
        raise BenchError(f"{run.name}: grpo.train exited 0 but phase {run.variant.last} is not at step {_b_steps(run)} or the "
                         f"report is missing; see {run.dir / 'train.out'}", code=1)


# ----------------------------------------------------------------------------- evaluation


def _metric(value: Any, lo: Any, hi: Any) -> dict[str, float]:
    def num(x: Any) -> float:  # None (no interval) and non-numbers are NaN
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan

    return {"value": num(value), "lo": num(lo), "hi": num(hi)}


def greedy_metrics(model: dict) -> dict[str, dict[str, float]]:
    """The table's greedy numbers of one report.json model entry (eval/results.EvalResult.to_dict)."""
    from eval.metrics import wilson_interval

    ov, ctrl = model["overall"], (model.get("control") or {}).get("overall")
    m, iv = ov["metrics"], ov["intervals"]
    out = {
        "exact_match": _metric(m.get("exact_match"), *iv.get("exact_match", (None, None))),
        "parseable": _metric(m.get("parseable_rate"), *iv.get("parseable_rate", (None, None))),
        "tokens": _metric(m.get("mean_completion_tokens"), *iv.get("mean_completion_tokens", (None, None))),
    }
    for stage in (1, 2, 3):  # the curriculum's filters (data/stages.py; they overlap); stage 3 is the hardest
        sub = (model.get("stages") or {}).get(f"stage{stage}")
        if sub and sub.get("n_prompts"):
            out[f"exact_match_stage{stage}"] = _metric(sub["metrics"].get("exact_match"),
                                                       *sub["intervals"].get("exact_match", (None, None)))
    if ctrl and ctrl.get("n"):
        n, em_s = int(ctrl["n"]), ctrl.get("exact_match_shuffled")
        lo, hi = wilson_interval(em_s * n, n) if isinstance(em_s, (int, float)) else (None, None)
        out["exact_match_shuffled"] = _metric(em_s, lo, hi)
        out["blind_gap"] = _metric(ctrl.get("gap"), ctrl.get("lo"), ctrl.get("hi"))
    return out


def _digest(checkpoint: Path) -> str:
    return hashlib.sha256((checkpoint / "state.json").read_bytes()).hexdigest()


def _base_digest() -> str:
    """The shipped model's weights digest (its manifest's entry: checked on every load)."""
    from grpo.model import shipped

    return shipped.read_manifest(shipped.SHIPPED_DIR)["model.safetensors"]


def sampled_metrics(run: Run, selector: str, k: int, cache_dir: Path) -> dict[str, dict[str, float]]:
    """pass@k (k samples at temperature 1) with true and with shuffled images, and their
    paired gap; cached by the checkpoint's state.json digest and the protocol."""
    from eval.blind import blind_gap, shuffle_images
    from eval.results import EvalProtocol
    from grpo.evaluation.model_eval import evaluate_model
    from grpo.state.registry import resolve

    cfg = run.configs["B"]
    path = resolve(run.dir, selector) if selector != "base" else None
    protocol = EvalProtocol(samples_per_prompt=k, max_new_tokens=cfg.sampling.max_new_tokens,
                            temperature=PASS_TEMPERATURE, seed=cfg.run.seed, batch_size=PASS_BATCH, image_control=False)
    key = {"protocol": protocol.__dict__, "test_per_stage": cfg.run.test_per_stage,
           "image_size": cfg.model.image_size}
    cache = cache_dir / f"{_digest(path) if path is not None else 'base-' + _base_digest()}.json"
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == json.loads(json.dumps(key)):
            return saved["metrics"]
    from data.synthetic import generate
    from grpo.model.policy import policy_at
    from grpo.run.runtime import pick_device

    t0 = time.time()
    examples = [ex for s in (1, 2, 3) for ex in generate("test", s, cfg.run.test_per_stage, cfg.run.seed,
                                                          cfg.model.image_size)]
    device = pick_device(cfg.model.device)
    bundle = policy_at(path, cfg, run.dir, device)
    true = evaluate_model(bundle, examples, protocol)
    shuffled = evaluate_model(bundle, shuffle_images(examples), protocol)
    gap = blind_gap(true.records, shuffled.records, per_prompt="any")
    em_gap = blind_gap(true.records, shuffled.records)
    tm, ti, sm, si = true.metrics, true.overall.intervals, shuffled.metrics, shuffled.overall.intervals
    metrics = {
        "pass_at_k": _metric(tm["pass_at_k"], *ti["pass_at_k"]),
        "pass_at_k_shuffled": _metric(sm["pass_at_k"], *si["pass_at_k"]),
        "pass_gap": _metric(gap.gap, gap.lo, gap.hi),
        "exact_match_t1": _metric(tm["exact_match"], *ti["exact_match"]),
        "blind_gap_t1": _metric(em_gap.gap, em_gap.lo, em_gap.hi),
    }
    cache_dir.mkdir(parents=True, exist_ok=True)
    replace_file(cache, json.dumps({"key": key, "checkpoint": str(path or "base"), "metrics": metrics}, indent=2))
    print(f"[bench] {run.name}: pass@{k} of {selector}: {tm['pass_at_k']:.3f} (shuffled images "
          f"{sm['pass_at_k']:.3f}) in {time.time() - t0:.0f}s", flush=True)
    return metrics


def paired_difference(run: Run, a: str, b: str) -> dict[str, float] | None:
    """EM(b) - EM(a) on the same test prompts, with the paired 95% interval (the report's samples files)."""
    from eval.blind import blind_gap
    from eval.report import _safe_name

    def records(sel: str) -> list[dict]:
        path = run.dir / "report" / f"samples_{_safe_name(sel)}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    try:
        g = blind_gap(records(b), records(a))
    except (OSError, ValueError):
        return None
    return _metric(g.gap, g.lo, g.hi)


def _samples(run: Run, sel: str) -> list[dict]:
    from eval.report import _safe_name

    path = run.dir / "report" / f"samples_{_safe_name(sel)}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@functools.lru_cache(maxsize=8)
def _test_key_steps(seed: int, per_stage: int, image_size: int) -> dict[str, list[list[str]]]:
    """pid -> key steps of the report's test examples (regenerated: the same split, seed and size)."""
    from data.synthetic import generate

    return {ex.pid: ex.key_steps for s in (1, 2, 3) for ex in generate("test", s, per_stage, seed, image_size)}


def reasoning_metrics(run: Run, sel: str) -> dict[str, dict[str, float]]:
    """Answer-follows-reasoning, right reasoning with a wrong answer and key-step accuracy of one
    checkpoint's greedy test completions (eval/reasoning.py), overall and on the stage-3 filter.
    Recomputed from the report's samples file, so a report written before these metrics existed
    gets them too."""
    from eval.reasoning import completion_reasoning, summarize_reasoning

    cfg = run.configs["B"]
    keys = _test_key_steps(cfg.run.seed, cfg.run.test_per_stage, cfg.model.image_size)
    recs = [{**r, **completion_reasoning(r["text"], r["gold"], keys.get(r["pid"]))} for r in _samples(run, sel)]
    out = {}
    for suffix, subset in (("", recs), ("_stage3", [r for r in recs if 3 in r.get("stages", [])])):
        for key, m in summarize_reasoning(subset).items():
            out[key + suffix] = _metric(m["value"], m["lo"], m["hi"])
    return out


def versus_default(run: Run, default: Run, sel: str, default_sel: str = "B:latest") -> dict[str, float] | None:
    """EM(run's sel) - EM(the default run's B:latest) of the same seed, paired over the same test prompts."""
    from eval.blind import blind_gap

    try:
        g = blind_gap(_samples(run, sel), _samples(default, default_sel))
    except (OSError, ValueError):
        return None
    return _metric(g.gap, g.lo, g.hi)


def _versus(run: Run, default: Run) -> dict[str, float] | None:
    return versus_default(run, default, run.variant.final)


# What evaluate_run computes: a bench_eval.json written by an older version is recomputed (its
# greedy numbers come from the report, so that costs seconds; pass@k stays cached).
EVAL_VERSION = 3


def evaluate_run(run: Run, k: int, cache_dir: Path, default: Run | None = None) -> dict:
    """bench_eval.json: the table's numbers of one finished run (greedy from its report, the
    reasoning metrics from its samples, pass@k sampled, the paired difference from the default run)."""
    path = run.dir / "bench_eval.json"
    want = {"pass_k": k, "pass_temperature": PASS_TEMPERATURE, "version": EVAL_VERSION,
            "versus": str(default.dir) if default is not None and default is not run else None}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("protocol") == want:
            return saved
    result: dict[str, Any] = {"protocol": want, "checkpoints": {}}
    if not run.variant.control:
        report = _report(run)
        for sel in CHECKPOINTS + run.variant.extra_checkpoints:
            metrics = greedy_metrics(report["models"][sel])
            metrics.update(reasoning_metrics(run, sel))
            if k > 0:
                metrics.update(sampled_metrics(run, sel, k, cache_dir))
            result["checkpoints"][sel] = metrics
        result["b_minus_a"] = paired_difference(run, "A:best_structure", "B:latest")
        # the last phase's own gain: B - A, or C - B for a run that goes on to phase C
        result["last_minus_before"] = paired_difference(run, run.variant.before_final, run.variant.final)
        if default is not None and default is not run:  # the variant's last model against the default's
            g = versus_default(run, default, run.variant.final)
            result["versus_default"] = g if run.variant.final == "B:latest" else _versus(run, default)
    result["training"] = training_summary(run)
    lock = hold(run)  # the run's trainers are done; one writer still
    try:
        replace_file(path, json.dumps(result, indent=2))
    finally:
        lock.release()
    return result


def _log(run: Run) -> list[dict]:
    path = run.dir / "train_log.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def b_steps_of(log: list[dict]) -> list[dict]:
    """Phase B's step lines, the last one per step (a resumed run may have logged a step twice)."""
    by_step = {r["step"]: r for r in log if r.get("phase") == "B" and r.get("event", "step") == "step" and "reward" in r}
    return [by_step[s] for s in sorted(by_step)]


def training_summary(run: Run) -> dict[str, float]:
    """Phase B's training reward, correctness and length over its last quarter of steps."""
    steps = b_steps_of(_log(run))
    if not steps:
        return {}
    try:
        seconds = json.loads((run.dir / "bench_run.json").read_text()).get("train_seconds")
    except (OSError, ValueError):
        seconds = None
    tail = steps[-max(1, math.ceil(len(steps) / 4)):]
    def mean(key: Callable[[dict], float]) -> float:
        return sum(key(r) for r in tail) / len(tail)

    return {"reward": mean(lambda r: r["reward"]),
            "correctness": mean(lambda r: r["components"].get("correctness", math.nan)),
            "completion_len": mean(lambda r: r["completion_len"]), "steps": len(tail),
            "train_seconds": seconds}


# ----------------------------------------------------------------------------- aggregation


def columns(k: int) -> list[tuple[str, str, str]]:
    """(metric key, column header, number format) of the tables."""
    cols = [("exact_match", "EM", "{:.3f}"), ("exact_match_stage3", "EM stage 3", "{:.3f}"),
            ("exact_match_shuffled", "EM shuffled", "{:.3f}"),
            ("blind_gap", "blind gap", "{:+.3f}"), ("parseable", "parseable", "{:.3f}"), ("tokens", "tokens", "{:.1f}"),
            ("answer_follows", "answer follows", "{:.3f}"), ("right_reasoning_wrong", "right reasoning, wrong answer",
                                                             "{:.3f}"),
            ("arithmetic_right", "arithmetic right", "{:.3f}"), ("key_step_accuracy", "key steps", "{:.3f}")]
    if k > 0:
        cols += [("pass_at_k", f"pass@{k}", "{:.3f}"), ("pass_at_k_shuffled", f"pass@{k} shuffled", "{:.3f}"),
                 ("pass_gap", f"pass@{k} gap", "{:+.3f}")]
    return cols


def aggregate(per_seed: dict[int, dict[str, float] | None]) -> dict[str, Any] | None:
    """Mean, min, max and sd (n - 1) over the seeds that have the value, plus each seed's value and interval."""
    rows = [(s, m) for s, m in sorted(per_seed.items()) if m and math.isfinite(m["value"])]
    if not rows:
        return None
    vals = [m["value"] for _, m in rows]
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {"mean": mean, "min": min(vals), "max": max(vals), "sd": sd, "n": len(vals),
            "per_seed": [{"seed": s, **m} for s, m in rows]}


def summarize(runs: Sequence[Run], evals: dict[str, dict[int, dict]], k: int, seeds: Sequence[int]) -> dict:
    variants = list(dict.fromkeys(r.variant.name for r in runs))
    results: dict[str, Any] = {}
    for name in variants:
        v, done = VARIANTS[name], evals.get(name, {})
        entry: dict[str, Any] = {"what": v.what, "command": _command_template(runs, name), "seeds": sorted(done),
                                 "training": {key: aggregate({s: _metric(e["training"].get(key), None, None)
                                                              for s, e in done.items() if e.get("training")})
                                              for key in ("reward", "correctness", "completion_len",
                                                          "train_seconds")}}
        if not v.control:
            entry["checkpoints"] = {sel: {key: aggregate({s: e["checkpoints"][sel].get(key) for s, e in done.items()})
                                          for key, _, _ in columns(k) + [("exact_match_t1", "", ""),
                                                                         ("blind_gap_t1", "", "")]}
                                    for sel in CHECKPOINTS}
            entry["b_minus_a"] = aggregate({s: e.get("b_minus_a") for s, e in done.items()})
            entry["versus_default"] = aggregate({s: e.get("versus_default") for s, e in done.items()})
            entry["final_checkpoint"] = v.final
            keys = [key for key, _, _ in columns(k)] + ["exact_match_stage1", "exact_match_stage2"]
            entry["final"] = {key: aggregate({s: e["checkpoints"].get(v.final, {}).get(key) for s, e in done.items()})
                              for key in keys}
            entry["last_minus_before"] = aggregate({s: e.get("last_minus_before") for s, e in done.items()})
        results[name] = entry
    return {"seeds": list(seeds), "spread": "min..max over seeds (sd in 'sd', n - 1)",
            "pass": {"k": k, "temperature": PASS_TEMPERATURE, "batch_size": PASS_BATCH},
            "checkpoints": list(CHECKPOINTS), "variants": results}


def _command_template(runs: Sequence[Run], name: str) -> str:
    """The variant's trainer command with the seed as <k> (a template: put in 0 .. N-1)."""
    run = next(r for r in runs if r.variant.name == name)
    cmd = run.command()
    cmd[cmd.index("--run.seed") + 1] = "SEEDK"
    cmd[cmd.index("--run.run_dir") + 1] = str(run.dir.parent / "seedSEEDK")
    return shlex.join(cmd).replace("SEEDK", "<k>")


# ----------------------------------------------------------------------------- Markdown


def _cell(agg: dict | None, fmt: str) -> str:
    """'mean (min..max)' over seeds; one seed: 'value [lo, hi]', its 95% interval."""
    if not agg:
        return "—"
    if agg["n"] == 1:
        m = agg["per_seed"][0]
        ci = f" [{fmt.format(m['lo'])}, {fmt.format(m['hi'])}]" if math.isfinite(m.get("lo", math.nan)) else ""
        return fmt.format(agg["mean"]) + ci
    return f"{fmt.format(agg['mean'])} ({fmt.format(agg['min'])}{SEP}{fmt.format(agg['max'])})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + \
           ["| " + " | ".join(r) + " |" for r in rows]


def main_table(summary: dict, k: int) -> list[str]:
    """The README's table: the default run, one row per checkpoint."""
    cols = columns(k)
    d = summary["variants"].get("default", {})
    rows = [[CHECKPOINT_TITLES[sel]] + [_cell(d.get("checkpoints", {}).get(sel, {}).get(key), fmt)
                                        for key, _, fmt in cols] for sel in CHECKPOINTS]
    return _table(["model"] + [h for _, h, _ in cols], rows)


def phase_tables(summary: dict, k: int) -> list[str]:
    """One table per checkpoint of the comparison, one row per variant (the base is shared)."""
    cols, out = columns(k), []
    evaluated = [n for n, e in summary["variants"].items() if "checkpoints" in e]
    for sel in CHECKPOINTS:
        names = ["default"] if sel == "base" else evaluated
        rows = [[f"`{n}`"] + [_cell(summary["variants"][n]["checkpoints"][sel].get(key), fmt) for key, _, fmt in cols]
                for n in names if n in summary["variants"]]
        note = " (every variant starts from this model: the one shipped in grpo/tiny_model)" if sel == "base" else ""
        out += [f"### {CHECKPOINT_TITLES[sel]}{note}", ""] + _table(["variant"] + [h for _, h, _ in cols], rows) + [""]
    return out


def training_table(summary: dict) -> list[str]:
    rows = []
    for name, e in summary["variants"].items():
        t = e.get("training", {})
        if any(t.get(key) for key in ("reward", "correctness")):
            rows.append([f"`{name}`", _cell(t.get("reward"), "{:.3f}"), _cell(t.get("correctness"), "{:.3f}"),
                         _cell(t.get("completion_len"), "{:.1f}"), _cell(t.get("train_seconds"), "{:.0f}")])
    return _table(["variant", "weighted reward", "correctness (raw)", "completion tokens", "trainer wall s"], rows)


def per_seed_lines(summary: dict, k: int) -> list[str]:
    cols, out = columns(k), []
    for name, e in summary["variants"].items():
        if "checkpoints" not in e or not e["seeds"]:
            continue
        rows = []
        for sel in CHECKPOINTS:
            for seed in e["seeds"]:
                cells = []
                for key, _, fmt in cols:
                    agg = e["checkpoints"][sel].get(key)
                    m = next((p for p in (agg or {}).get("per_seed", []) if p["seed"] == seed), None)
                    cells.append("—" if m is None else fmt.format(m["value"]) + (
                        f" [{fmt.format(m['lo'])}, {fmt.format(m['hi'])}]" if math.isfinite(m["lo"]) else ""))
                rows.append([SHORT[sel], str(seed)] + cells)
        out += [f"#### `{name}`", ""] + _table(["checkpoint", "seed"] + [h for _, h, _ in cols], rows) + [""]
    return out


def b_minus_a_lines(summary: dict) -> list[str]:
    rows = []
    for name, e in summary["variants"].items():
        agg = e.get("b_minus_a")
        if agg:
            per = ", ".join(f"seed {p['seed']}: {p['value']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]" for p in agg["per_seed"])
            rows.append([f"`{name}`", _cell(agg, "{:+.3f}") if agg["n"] > 1 else f"{agg['mean']:+.3f}", per])
    return _table(["variant", "mean (min..max)", "per seed [paired 95% interval]"], rows)


def variant_table(summary: dict) -> list[str]:
    """The README's comparison: every evaluated variant's last checkpoint (B:latest) on the test split."""
    rows = []
    for name, e in summary["variants"].items():
        if "checkpoints" not in e or not e["seeds"]:
            continue
        last = e.get("final") or e["checkpoints"]["B:latest"]
        rows.append([f"`{name}`" + (f" ({e['final_checkpoint']})" if e.get("final_checkpoint", "B:latest") != "B:latest"
                                    else ""), str(len(e["seeds"]))]
                    + [_cell(last.get(key), fmt) for key, fmt in (("exact_match", "{:.3f}"),
                                                                  ("exact_match_stage3", "{:.3f}"),
                                                                  ("blind_gap", "{:+.3f}"),
                                                                  ("answer_follows", "{:.3f}"),
                                                                  ("right_reasoning_wrong", "{:.3f}"),
                                                                  ("arithmetic_right", "{:.3f}"),
                                                                  ("key_step_accuracy", "{:.3f}"))]
                    + [_cell(e.get("last_minus_before") or e.get("b_minus_a"), "{:+.3f}"),
                       "—" if name == "default" else _cell(e.get("versus_default"), "{:+.3f}")])
    return _table(["variant", "seeds", "test EM", "EM stage 3", "blind gap", "answer follows reasoning",
                   "right reasoning, wrong answer", "arithmetic right", "key steps", "B - A (C - B)",
                   "EM - default's"], rows)


def stage_lines(summary: dict) -> list[str]:
    """Test EM per curriculum stage filter of each variant's last model (phase C's target: stages 2 and 3)."""
    rows = []
    for name, e in summary["variants"].items():
        if "final" not in e or not e["seeds"]:
            continue
        rows.append([f"`{name}`", e["final_checkpoint"]] + [_cell(e["final"].get(f"exact_match_stage{st}"), "{:.3f}")
                                                           for st in (1, 2, 3)] + [_cell(e["final"].get("exact_match"),
                                                                                         "{:.3f}")])
    return _table(["variant", "checkpoint", "EM stage 1", "EM stage 2", "EM stage 3", "EM overall"], rows)


def versus_default_lines(summary: dict) -> list[str]:
    rows = []
    for name, e in summary["variants"].items():
        agg = e.get("versus_default")
        if agg and name != "default":
            per = ", ".join(f"seed {p['seed']}: {p['value']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]" for p in agg["per_seed"])
            rows.append([f"`{name}`", _cell(agg, "{:+.3f}") if agg["n"] > 1 else f"{agg['mean']:+.3f}", per])
    return _table(["variant", "mean (min..max)", "per seed [paired 95% interval]"], rows)


def render(summary: dict, runs: Sequence[Run], k: int, failures: list[str], unfinished: Sequence[str] = ()) -> str:
    seeds = summary["seeds"]
    n_seed = f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} ({', '.join(map(str, seeds))})"
    spread = ("Cells: mean over seeds (min..max over seeds); a cell with one seed shows that run's 95% interval "
              "[lo, hi] instead.")
    sampled = (f"; pass@{k} draws {k} samples per prompt at temperature {PASS_TEMPERATURE:g}" if k > 0
               else "; pass@k was skipped (--pass-k 0)")
    out = ["# Learning benchmark (`python -m bench.learning`)", "",
           (f"The README's main job (`python -m grpo.train --phase B`, defaults from grpo/config.py) for {n_seed}, "
            "evaluated on the held-out synthetic test split (the end-of-run report's examples). Greedy decoding, one "
            f"sample per prompt, for EM, EM shuffled, blind gap, parseable and tokens{sampled}. {spread}"), ""]
    out += ["## Main run (defaults)", ""] + main_table(summary, k) + [""]
    out += ["## Every variant's last model (`B:latest`; `C:latest` for phase C; for `a_continued`, phase A continued)",
            "",
            ("Test EM overall and on the stage-3 filter, the blind gap, the reasoning metrics (eval/reasoning.py), "
             "the last phase's gain (B:latest - A:best_structure, or C:latest - B:latest) and the last model minus the "
             "default's B:latest (both paired over the same test prompts, same seed). Cells: mean (min..max) over "
             "seeds; one seed: its 95% interval.")] + [""] + variant_table(summary) + [""]
    out += ["## Each variant's last model minus the default's `B:latest` (test EM, paired per seed over the same "
            "prompts)", ""]
    out += versus_default_lines(summary) + [""]
    out += ["## Test EM by stage filter of each variant's last model (data/stages.py; the filters overlap)", ""]
    out += stage_lines(summary) + [""]
    out += ["## Phase B's last step minus phase A (`B:latest` - `A:best_structure` test EM, paired per seed)", ""]
    out += b_minus_a_lines(summary) + [""]
    out += ["## Controls and ablations (same seeds, same base, same budget)", ""]
    out += [f"- `{r.variant.name}`: {r.variant.what}" for r in runs if r.seed == seeds[0]] + [""]
    out += phase_tables(summary, k)
    out += ["## Training curves: phase B's last quarter of steps, against the frozen-policy control", "",
            ("Means over the last 25% of phase B's training steps (sampled at the training temperature; the weighted "
             "reward uses each run's own controller weights, correctness is the raw 0/1 term; with dynamic sampling, "
             "over the groups it kept). `frozen` is the same phase on the same prompts with the policy never updated. "
             "Trainer wall s: the run's `grpo.train` time, report included (the frozen control: phase B only, it copies "
             "A; on a shared machine it varies with the load)."),
            ""] + training_table(summary) + [""]
    out += ["## Per-seed values (95% intervals: Wilson for rates, paired normal for gaps, normal for tokens)", ""]
    out += per_seed_lines(summary, k)
    out += ["## Command lines", ""] + [f"- `{r.variant.name}`: `{_command_template(runs, r.variant.name)}`"
                                       for r in runs if r.seed == seeds[0]] + [""]
    if failures:
        out += ["## Runs that failed (not in the tables)", ""] + [f"- {f}" for f in failures] + [""]
    if unfinished:
        out += ["## Runs not finished yet (not in the tables; `python -m bench.learning` with the same options "
                "resumes them)", ""] + [f"- {n}" for n in unfinished] + [""]
    out += ["## What the numbers mean", "",
            ("EM: the SOLUTION number equals the gold. EM shuffled: the same prompts with each image swapped for another "
             "example's of the same family (eval/blind.py). Blind gap = EM - EM shuffled, with the paired interval of "
             "the per-prompt differences: an interval that includes 0 means the EM does not measurably depend on the "
             "image. Parseable: exactly one parseable SOLUTION number. Tokens: mean completion tokens. pass@k: any of k "
             "samples exact; its gap is paired the same way. Plots: curves_seed<k>.png, test_checkpoints.png."), ""]
    return "\n".join(out)


def one_line(summary: dict, k: int) -> str:
    d = summary["variants"].get("default", {})
    em = {sel: (d.get("checkpoints", {}).get(sel, {}).get("exact_match") or {}).get("mean") for sel in CHECKPOINTS}
    if em["B:latest"] is None:
        return "summary: no finished default run to summarise"
    parts = [f"summary: {len(d['seeds'])} seed(s); default test EM " + ", ".join(
        f"{SHORT[s]} {em[s]:.3f}" for s in CHECKPOINTS if em[s] is not None)]
    bma = d.get("b_minus_a")
    if bma:
        parts.append(f"B last - A best {bma['mean']:+.3f} ({bma['min']:+.3f}{SEP}{bma['max']:+.3f})")
    others = {n: (e["checkpoints"]["B:latest"].get("exact_match") or {}).get("mean")
              for n, e in summary["variants"].items() if n != "default" and "checkpoints" in e}
    others = {n: v for n, v in others.items() if v is not None}
    if others:
        best = max(others, key=others.get)
        parts.append(f"best variant on B last EM: {best} {others[best]:.3f} ({others[best] - em['B:latest']:+.3f})")
    frozen = summary["variants"].get("frozen", {}).get("training", {}).get("correctness")
    mine = d.get("training", {}).get("correctness")
    if frozen and mine:
        parts.append(f"B training correctness {mine['mean']:.3f} vs frozen {frozen['mean']:.3f}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- plots


def plot_curves(runs: Sequence[Run], seed: int, path: Path) -> Path | None:
    """Phase B training reward and correctness (moving average) of every variant against the
    frozen control, and the default run's val EM and blind gap at each checkpoint eval."""
    from eval.plots import PALETTE, PanelSpec, Series, moving_average, plot_panels

    mine = [r for r in runs if r.seed == seed]
    reward, corr = [], []
    for i, r in enumerate(mine):
        steps = b_steps_of(_log(r))
        if not steps:
            continue
        xs = [float(s["step"]) for s in steps]
        w = max(1, len(steps) // 6)
        color, dash = ("#000000", True) if r.variant.control else (PALETTE[i % 10], False)
        width = 3 if r.variant.name == "default" else 2
        label = f"{r.variant.name} (MA {w})"
        reward.append(Series(label, xs, moving_average([s["reward"] for s in steps], w), color, width, dash=dash))
        corr.append(Series(label, xs, moving_average([s["components"].get("correctness", math.nan) for s in steps], w),
                           color, width, dash=dash))
    if not reward:
        return None
    evals = []
    for r, color, dash in [(next((x for x in mine if x.variant.name == "default"), None), PALETTE[0], False),
                           (next((x for x in mine if x.variant.control), None), "#000000", True)]:
        if r is None:
            continue
        log = _log(r)
        a_end = max([e["step"] for e in log if e.get("phase") == "A" and e.get("event") == "eval"] or [0])
        pts = [e for e in log if e.get("event") == "eval" and e.get("phase") in ("A", "B")
               and (e.get("phase") == "B" or not r.variant.control)]
        xs = [float(e["step"] + (a_end if e["phase"] == "B" else 0)) for e in pts]
        evals += [Series(f"{r.variant.name} EM", xs, [e["metrics"].get("exact_match", math.nan) for e in pts], color,
                         markers=True, dash=dash),
                  Series(f"{r.variant.name} blind gap", xs, [e["metrics"].get("blind_gap", math.nan) for e in pts],
                         PALETTE[3] if not dash else "#777777", markers=True, dash=dash)]
    main = next((x for x in mine if x.variant.name == "default"), None)
    a_end = max([e["step"] for e in _log(main) if e.get("phase") == "A" and e.get("event") == "eval"] or [0]) \
        if main else 0
    specs = [PanelSpec(f"seed {seed}: phase B training reward (weighted), moving average; frozen control dashed",
                       "reward", reward, xlabel="phase B step"),
             PanelSpec("phase B training correctness (raw 0/1 term, mean over completions), moving average",
                       "correctness", corr, xlabel="phase B step", y_include=(0.0,)),
             PanelSpec("held-out val EM and blind gap at each checkpoint eval (phases A, B)", "rate / gap", evals,
                       xlabel="step (A, then B)", phases=[("A", 0.0), ("B", float(a_end))], y_include=(0.0,))]
    return plot_panels(specs, path)


def _per_checkpoint(entry: dict, key: str, seed: int | None = None) -> list[float]:
    """One value per checkpoint: the mean over seeds, or one seed's value (NaN where missing)."""
    out = []
    for sel in CHECKPOINTS:
        agg = entry["checkpoints"][sel].get(key)
        if agg is None:
            out.append(math.nan)
        elif seed is None:
            out.append(agg["mean"])
        else:
            out.append(next((p["value"] for p in agg["per_seed"] if p["seed"] == seed), math.nan))
    return out


def plot_checkpoints(summary: dict, path: Path) -> Path | None:
    """Test EM and blind gap per checkpoint: the default run per seed, every variant's mean."""
    from eval.plots import PALETTE, PanelSpec, Series, plot_panels

    xs = [float(i) for i in range(len(CHECKPOINTS))]
    em, gap = [], []
    for i, (name, e) in enumerate((n, e) for n, e in summary["variants"].items() if "checkpoints" in e):
        color = PALETTE[i % 10]
        values = functools.partial(_per_checkpoint, e)
        em.append(Series(f"{name} (mean)", xs, values("exact_match"), color, 3 if name == "default" else 2, markers=True))
        gap.append(Series(f"{name} (mean)", xs, values("blind_gap"), color, 3 if name == "default" else 2, markers=True))
        if name == "default" and len(e["seeds"]) > 1:
            for seed in e["seeds"]:
                em.append(Series(f"default seed {seed}", xs, values("exact_match", seed=seed), color, 1, dash=True))
                gap.append(Series(f"default seed {seed}", xs, values("blind_gap", seed=seed), color, 1, dash=True))
    if not em:
        return None
    ticks = {float(i): SHORT[s] for i, s in enumerate(CHECKPOINTS)}
    specs = [PanelSpec("test EM (greedy) per checkpoint", "EM", em, xlabel="checkpoint", xtick_labels=ticks,
                       y_include=(0.0,)),
             PanelSpec("blind gap (EM - EM with shuffled images) per checkpoint", "gap", gap, xlabel="checkpoint",
                       xtick_labels=ticks, y_include=(0.0,))]
    return plot_panels(specs, path)


# ----------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse would print usage + error and exit)
        raise BenchError(f"{message} (python -m bench.learning --help lists the options)")


def build_parser() -> argparse.ArgumentParser:
    variants = "\n".join(f"  {v.name:<17} {v.what}" for v in VARIANTS.values())
    p = _Parser(
        prog="python -m bench.learning",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the README's main job (python -m grpo.train --phase B, defaults from grpo/config.py) for "
                    "several seeds with controls and GRPO levers from the same shipped base, and print test EM, the blind gap, "
                    "parseable, tokens and pass@k per phase with 95% intervals, aggregated over seeds.",
        epilog=f"""variants (each a list of trainer options; --plan prints every command line):
{variants}

what the numbers are (held-out synthetic test split, run.test_per_stage prompts per stage):
  EM            greedy exact match, one sample per prompt (the end-of-run report's protocol)
  EM shuffled   the same prompts, each image swapped for another of the same family
  blind gap     EM - EM shuffled; its 95% interval is paired over prompts (includes 0: the EM
                does not measurably depend on the image)
  parseable     one parseable SOLUTION number; tokens: mean completion tokens
  pass@k        k samples per prompt at temperature 1, any exact (also with shuffled images)
  EM stage 3    EM on the hardest curriculum filter (data/stages.py; the stage filters overlap)
  answer follows  the SOLUTION is the number the reasoning ends on (eval/reasoning.py); right
                reasoning, wrong answer; arithmetic right (every "a + b = c" of the reasoning);
                key steps: share of the example's key steps in the reasoning
  vs default    each variant's last model minus the default's B:latest, paired per seed
  intervals     95%: Wilson for rates, paired normal for gaps, normal for means
  over seeds    'mean (min..max)'; with one seed, that run's 95% interval [lo, hi]

output: <out>/<variant>/seed<k>/ (run directories), <out>/summary.md, summary.json,
curves_seed<k>.png, test_checkpoints.png. Finished runs are reused, interrupted ones resumed.""")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds, run as --run.seed 0 .. N-1 (default 3)")
    p.add_argument("--variants", default="all",
                   help="comma-separated variants to run, or 'all' (default); 'default' is always run, since "
                        "every ablation is compared with it (the frozen control starts from its phase A)")
    p.add_argument("--quick", action="store_true",
                   help="smoke configuration: 2 steps of A and B, 2 test prompts per stage "
                        "(seconds per run; for tests, the numbers mean nothing); default --out becomes "
                        f"{QUICK_OUT}")
    p.add_argument("--out", default=None, help=f"results directory (default {DEFAULT_OUT}, git-ignored)")
    p.add_argument("--pass-k", type=int, default=8,
                   help="samples per prompt for pass@k at temperature 1 (default 8; 0 = skip the sampled eval)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads of this process's evaluation (default 1, like the trainer; 0 = torch's default)")
    p.add_argument("--jobs", type=int, default=1,
                   help="trainer processes at a time (default 1; each uses one thread: at most the CPU cores, "
                        "and the trainer's wall times then include the sharing)")
    p.add_argument("--plan", action="store_true", help="print every run's command line and state, run nothing")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: summarise the finished runs (the others are listed as not finished)")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.seeds < 1:
        raise BenchError(f"--seeds {args.seeds}: must be >= 1 (the number of seeds, run as --run.seed 0 .. N-1)")
    if args.pass_k < 0:
        raise BenchError(f"--pass-k {args.pass_k}: must be >= 1 samples per prompt, or 0 to skip pass@k")
    if args.threads < 0:
        raise BenchError(f"--threads {args.threads}: must be >= 0 (0 = torch's default)")
    if args.jobs < 1:
        raise BenchError(f"--jobs {args.jobs}: must be >= 1 (trainer processes at a time)")
    names = list(VARIANTS) if args.variants.strip() == "all" else [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise BenchError(f"--variants {args.variants!r}: unknown variant {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"use 'all' or some of {', '.join(VARIANTS)}")
    args.names = ["default"] + [n for n in dict.fromkeys(names) if n != "default"]
    args.out = Path(args.out) if args.out else (QUICK_OUT if args.quick else DEFAULT_OUT)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        runs = plan_runs(args.names, list(range(args.seeds)), args.out, QUICK_ARGS if args.quick else [])
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    if args.plan:
        for r in runs:
            print(f"{r.name}: {state(r)}\n  {shlex.join(r.command())}")
        return 0
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per evaluated checkpoint is noise
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    evals: dict[str, dict[int, dict]] = {}
    failures: list[str] = []
    unfinished: list[str] = []  # --report-only: the runs left out
    STOP.install()
    STOP.listeners.append(_forward)
    try:
        _run_all(runs, args, evals, failures, unfinished)
    except StopNow as now:  # a second signal, forwarded too: the trainers stop at once
        print(f"stopped at once on a second {now}; the trainers lose their current step; the same command "
              "resumes (finished runs are reused)", file=sys.stderr)
        return exit_code(now.signum)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    finally:
        STOP.listeners.remove(_forward)
    if STOP.requested:
        code = exit_code(STOP.signum)
        print(f"stopped on {STOP.name}: every running trainer saved its checkpoint; the same command resumes "
              "(finished runs are reused)", file=sys.stderr)
        STOP.uninstall()
        return code
    STOP.uninstall()
    summary = summarize(runs, evals, args.pass_k, list(range(args.seeds)))
    summary["failures"], summary["unfinished"] = failures, unfinished
    md = render(summary, runs, args.pass_k, failures, unfinished)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(md)
    from eval.report import json_safe

    (args.out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2))
    plots = [plot_curves(runs, s, args.out / f"curves_seed{s}.png") for s in range(args.seeds)]
    plots.append(plot_checkpoints(summary, args.out / "test_checkpoints.png"))
    print("\n" + "\n".join(main_table(summary, args.pass_k)) + "\n\n" + "\n".join(phase_tables(summary, args.pass_k)))
    print(f"wrote {args.out / 'summary.md'}, summary.json and {len([p for p in plots if p])} plots "
          f"in {time.time() - t0:.0f}s")
    print(one_line(summary, args.pass_k))
    if failures:
        print(f"error: {len(failures)} run(s) failed: {failures[0]}", file=sys.stderr)
        return 1
    return 0


def _run_all(runs: Sequence[Run], args: argparse.Namespace, evals: dict, failures: list[str],
             unfinished: list[str]) -> None:
    """Train (or reuse) and evaluate every run, up to ``args.jobs`` trainer processes at a time.

    An ablation starts only once its seed's default run has finished (it copies that run's
    phases). Each finished run is evaluated here, in this process, while the next ones
    train. A run that fails (exit 1) is recorded and the others go on: a diverging variant
    is a result too. A refused request (exit 2) stops everything.
    """
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    main_of = {r.seed: r.name for r in runs if r.variant.name == "default"}  # every ablation starts from it

    def ready(run: Run) -> bool:
        return not run.variant.shares or main_of[run.seed] in done

    def succeeded(fut) -> bool:
        """The future's outcome: a failed run (exit 1) is recorded, a refused request (exit 2) raised."""
        try:
            fut.result()
            return True
        except (BenchStopped, EvalAbandoned):  # a stop: neither a result nor a failure
            return False
        except BenchError as err:
            if err.code != 1:
                raise
            print(f"[bench] failed: {err}", flush=True)
            failures.append(str(err))
            return False

    def evaluate(run: Run) -> None:
        main = next((r for r in runs if r.variant.name == "default" and r.seed == run.seed), None)
        main = main if main is not None and finished(main) else None  # the paired difference needs its report
        evals.setdefault(run.variant.name, {})[run.seed] = evaluate_run(run, args.pass_k, args.out / "eval_cache", main)

    if args.report_only:  # summarise what is finished; train nothing
        for run in runs:
            if finished(run):
                evaluate(run)
            else:
                print(f"[bench] {run.name}: {state(run).split(':')[0]}, left out (--report-only trains nothing)",
                      flush=True)
                unfinished.append(run.name)
        return

    def fill() -> None:  # start ready runs in the free slots (none once a stop was requested)
        if STOP.requested:
            pending.clear()
            return
        for run in [r for r in pending if ready(r)][:max(0, args.jobs - len(running))]:
            pending.remove(run)
            if finished(run):
                print(f"[bench] {run.name}: finished earlier, reused ({run.dir})", flush=True)
            running[pool.submit(ensure_trained, run, runs)] = run

    pending, running, evaluating, done, failed = list(runs), {}, set(), set(), set()
    # Trainers in `pool`; evaluations one at a time in `evaluator` (torch in this process, one
    # thread), so a free trainer slot never waits for an evaluation to end.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool, ThreadPoolExecutor(max_workers=1) as evaluator:
        while pending or running or evaluating:
            for run in [r for r in pending if r.variant.shares and main_of[r.seed] in failed]:
                pending.remove(run)  # its default run failed: nothing to start from
                failures.append(f"{run.name}: not run, the default run of seed {run.seed} failed")
            fill()
            if not running and not evaluating:
                break
            finished_now, _ = wait([*running, *evaluating], return_when=FIRST_COMPLETED)
            for fut in finished_now:
                if fut in evaluating:
                    evaluating.remove(fut)
                    succeeded(fut)
                    continue
                run = running.pop(fut)
                if succeeded(fut):
                    done.add(run.name)
                    evaluating.add(evaluator.submit(evaluate, run))
                else:
                    failed.add(run.name)


if __name__ == "__main__":
    raise SystemExit(main())
