"""GRPO training: ``python -m grpo.train --phase {warmup,A,B,C} [--key value ...]``.

What is implemented
-------------------
Group Relative Policy Optimisation (DeepSeekMath's GRPO, in TRL's loss conventions) for a
vision-language policy = frozen base (optionally NF4 4-bit) + rank-8 LoRA, run as the
staged, metric-gated curriculum of the staged-GRPO paper (docs/design.md):

    warmup  R1-VL's policy warm-up: SFT on worked reasoning (grpo/warmup/sft.py)
    A       stage 1 only, structure-heavy reward weights, from the pretrained base
            (a model trained from scratch, tiny-random, starts A from warmup:latest)
    B       stage 1 .7 + stage 2 .3, correctness-heavy, from A:best_structure
    C       stage 2 .6 + stage 3 .4, tolerance on, from B:best_composite

One GRPO step (optim.accumulation rollout batches of B prompts, 1 by default), steps 1-6
below, is grpo/step.py, the file to read first; ``run_grpo_phase`` here is the harness
around it (the data stream, data parallelism, the non-finite guard, timing) and steps 7-10
(the log line, eval -> gates -> checkpoint):

    1. sample     G completions per prompt; each prompt (and its image) is encoded once and
                  its KV cache copied G times (grpo/rollout/sampler.py; the tiny preset decodes
                  from a merged copy of the policy, grpo/rollout/merged.py; NoisyRollout
                  samples part of each group from a noisy copy of the image,
                  grpo/rollout/noisy.py). Images are resized
                  into [model.min_pixels, model.max_pixels]; a prompt longer than
                  model.max_prompt_tokens is skipped and counted (grpo/model/prompts.py)
    2. reward     the verifier components (+ step / detail / rubric terms), weighted by the
                  controller's current weights (grpo/rewards)
    3. advantage  A = (r - mean_g) / (std_g + 1e-4) within each prompt's group of G
                  (grpo_kernels/grpo_advantages.py), once per batch
    4. log-probs  of the completion tokens under the policy (with grad) and, if beta > 0,
                  under the reference = the same model with its adapters switched off: the base, or
                  after an SFT warm-up the base + the warm-up's frozen adapter (grpo/model/logprobs.py)
    5. loss       -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) + beta KL (k3 by
                  default), mean per sequence then over the batch (grpo_kernels/grpo_loss.py:
                  one fused pass on CUDA)
    6. step       backward into the LoRA parameters, clip the gradient norm, AdamW
    4-6 run mu = optim.updates_per_batch times on the same rollouts (PPO epochs)
    7. log        one JSON line (eval/plots.py documents the format)
    every run.eval_every steps and at the end:
    8. eval       greedy decoding on a fixed held-out subset (grpo/evaluation/model_eval.py)
    9. gate       the controller changes reward weights only when those metrics say so
    10. save      atomic checkpoint + aliases latest / best_structure / best_correctness /
                  best_composite (grpo/state/checkpoint.py, grpo/state/registry.py)

The defaults are exactly that: token-level ratio, grpo aggregation, beta 0 (no reference
pass), eps 0.2 on both sides, mu = 1, std of the group (unbiased). Options switch on the
variants the loss implements (bnpo / dr_grpo / dapo aggregation, GSPO's sequence ratio,
DAPO's clip-higher and dynamic sampling, per-component advantages (GDPO), a std floor,
V-Rubrics prefix advantages, the bias-corrected KL); the README's option table lists them.

Several updates per batch. With mu = 1 (TRL's and the staged paper's setting) the "old"
policy is the current one detached: the ratio is 1 in value (its gradient is not), so the
clip never binds. With mu > 1 the first update still runs that way and keeps its log-probs
-- they are the sampling policy's, since nothing has been updated yet -- as old_logp;
updates 2..mu take the ratio against them and the clip binds. That costs no extra forward
pass (TRL runs one without grad at sampling time); rewards, advantages and the reference
log-probs are computed once per batch, and on a CPU, where rollouts dominate, it buys mu
updates per rollout. A "step" (phase.steps, eval_every, checkpoints, the log line) is
optim.accumulation rollout batches (1 by default); the learning-rate schedule counts
optimiser steps (grpo/run/schedule.py lr_at).

Simplified, on purpose:
  - no value model (GRPO's point: the group mean is the baseline);
  - no dropout (Qwen2.5-VL has none, GRPO phases refuse LoRA dropout): two passes of one
    policy agree, in training mode or eval mode, and the ratio of update 1 is exactly 1;
  - the reference policy is the policy model with its adapters off (the base, or the base +
    a frozen copy of a warm-up's rank-8 adapter), not a separate frozen copy of the model (the
    same weights, no second model in memory);
  - rollouts and the loss use the same temperature-scaled distribution; with
    sampling.rollout=merged the sampler is a merged copy of the policy, whose log-probs
    differ from the trainer's by rounding: the log line's "rollout" entry measures that
    mismatch every step and optim.rollout_correction weights the policy term by
    pi_train / pi_sampler (grpo_kernels/grpo_loss.py);
  - evaluation is greedy with one sample per prompt (the staged paper's final protocol);
  - the warm-up is not data-parallel (rank 0 runs it, the others wait);
  - a non-finite loss skips the update and a non-finite update is undone; three in a row
    stop the run (grpo/run/guard.py StepGuard).
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch and transformers load: a release out of range is one line
    from grpo.deps import exit_on_unsupported_stack

    exit_on_unsupported_stack()

import contextlib
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.mixture import MixtureStream
from eval.report import collapse_warning
from grpo import cli
from grpo.config import TrainConfig
from grpo.controller import Controller, GateThresholds
from grpo.distributed import DataParallel
from grpo.errors import ConfigError, NoRewardSpread, PolicyCollapsed, StepOutOfMemory
from grpo.evaluation.model_eval import checkpoint_eval, print_eval
from grpo.model.policy import build_policy
from grpo.model.prompts import NoPromptsLeft, PromptCounts
from grpo.model.vision import VISUAL, optimizer_groups
from grpo.rewards import RewardModel
from grpo.rollout.dynamic_sampling import NoSpread, dynamic_batches, groups_in_band, groups_with_spread, no_spread_message
from grpo.rollout.merged import MergedRollout
from grpo.rollout.noisy import NoisyRollout
from grpo.rollout.sampler import sample
from grpo.run.files import RunFiles
from grpo.run.guard import StepGuard
from grpo.run.memory_plan import check_fits, out_of_memory_message
from grpo.run.phase_data import eval_subset, load_training_data
from grpo.run.progress import Progress
from grpo.run.records import progress_line, step_record
from grpo.run.schedule import SaveClock, lr_at
from grpo.run.stop import EvalAbandoned, Stopped, evals_run_to_the_end, stop_message
from grpo.state.resume import phase_finished
from grpo.state.train_state import TrainState, find_start
from grpo.step import Hooks, Learner, advantage_source, grpo_step, plain_batches, sample_and_score
from grpo.warmup.sft import run_warmup
from grpo_infra.signals import STOP
from lora import freeze_reference_adapter, load_lora_state_dict, lora_parameters, lora_state_dict


class PhaseHooks(Hooks):
    """grpo.step's hooks as a training phase fills them: data parallelism (grpo/distributed.py;
    every collective is a no-op in one process), the non-finite guard (grpo/run/guard.py:
    log, undo, stop after three in a row) and the step's timing."""

    def __init__(self, dp: DataParallel, guard: StepGuard, phase: str, mu: int):
        self.dp, self.guard, self.phase, self.mu = dp, guard, phase, mu
        self.begin(0)

    def begin(self, step: int) -> None:
        self.step, self.t0 = step, time.time()
        self.part: str | None = None  # the part running now: an out-of-memory error names it
        self.timing = dict(sampling=0.0, rewards=0.0, logprobs=0.0, backward=0.0)
        self.prompts = PromptCounts()  # what this step's draws put into the model (the log line's "prompts")

    @contextlib.contextmanager
    def timed(self, part: str):
        t0, self.part = time.time(), part
        yield  # an exception leaves self.part naming where it struck
        self.timing[part] += time.time() - t0
        self.part = None

    def counts_over_ranks(self, counts):
        return self.dp.counts_over_ranks(counts)

    def batch_std(self, columns, std_floor):
        return self.dp.global_batch_std(columns, std_floor)

    def global_loss(self, loss):
        return self.dp.all_reduce_sum(loss)

    def reduce_gradients(self, params):
        self.dp.all_reduce_gradients(params)  # the sum of the ranks' shares: the global batch's gradient

    def _which(self, u: int) -> dict:
        return {"update": u + 1} if self.mu > 1 else {}

    def skipped(self, u, loss):
        self.guard.failed(self.phase, self.step + 1, dict(loss=str(loss), **self._which(u)),
                          f"[{self.phase} {self.step + 1}] non-finite loss {loss}: update skipped")

    def optimizer_step(self, opt, u, loss):
        bad = self.guard.step(self.dp)  # opt.step(), undone if it left a parameter non-finite
        if bad:
            self.guard.failed(self.phase, self.step + 1, dict(loss=loss, params=bad[:5], **self._which(u)),
                              f"[{self.phase} {self.step + 1}] non-finite update ({len(bad)} tensors, e.g. "
                              f"{bad[0]}): parameters and optimiser state restored")
            return False
        self.guard.succeeded()
        return True


# Draws in a row that may keep no prompt before the run stops: a cap that fits the data
# skips a prompt now and then, and a whole draw only when prompts_per_step is small.
EMPTY_DRAWS = 20


def no_prompt_message(draws: int, reason: str, cfg: TrainConfig) -> str:
    """One line for a run whose draws keep no prompt: what the last one skipped, and the fix."""
    m = cfg.model
    fix = (f"raise --model.max_prompt_tokens (now {m.max_prompt_tokens}) or lower --model.max_pixels "
           f"(now {m.max_pixels or 'the processor default'})" if "max_prompt_tokens" in reason
           else "check the dataset's images")
    return f"phase {cfg.phase.name}: {draws} draws in a row kept no prompt (the last: {reason}); {fix}"


@dataclasses.dataclass
class PhaseRun:
    """What a GRPO phase's harness holds between steps: the run's files and state, the
    checkpoint-side evaluation's subset, the controller and the reward model it re-weighs."""

    cfg: TrainConfig
    dp: DataParallel
    files: RunFiles
    state: TrainState
    clock: SaveClock
    bundle: Any
    eval_examples: list
    controller: Controller
    rewards: RewardModel

    def save(self, done: int, result=None, pending: bool = False) -> None:
        self.state.save(done, result, pending)
        self.clock.saved()

    def evaluate_and_save(self, done: int) -> None:
        """8-10: eval -> gates -> checkpoint. A stop abandons the eval (one process; ranks
        finish it together) and saves the step as periodic, its eval pending."""
        cfg, phase, files, controller = self.cfg, self.cfg.phase.name, self.files, self.controller
        try:
            with evals_run_to_the_end() if self.dp.enabled else contextlib.nullcontext():
                result = checkpoint_eval(self.bundle, self.eval_examples, cfg, self.dp)
        except EvalAbandoned:
            self.save(done, pending=True)
            raise Stopped(stop_message(f"{phase} step {done} (its evaluation abandoned)"), STOP.signum) from None
        print_eval(phase, done, result)
        files.write_log(dict(event="eval", phase=phase, step=done, metrics=result.flat(), skipped=dict(result.skipped)))
        files.write_samples(phase, done, result.records, self.eval_examples)
        if cfg.phase.controller:
            metrics = dict(result.metrics, zero_spread=float(np.mean(self.state.zero_spread_since_eval)))
            for d in controller.update(metrics, result.overall.intervals, n=result.overall.n_prompts):
                print(f"  gate: {d}")
                files.write_log(dict(event="gate", phase=phase, step=done, rule=d.rule,
                                     changes={d.target: [d.old, d.new]}, decision=d.to_dict()))
            self.rewards.set_weights(controller.weights)
        self.state.zero_spread_since_eval.clear()
        self.save(done, result)
        collapsed = collapse_warning(f"{phase} @ {done}", result)
        if collapsed is not None and cfg.run.stop_on_collapse:
            raise PolicyCollapsed(f"phase {phase} stopped at step {done} (--run.stop_on_collapse; its checkpoint is "
                                  f"saved): {collapsed.removeprefix('warning: ')}")


def _policy_and_optimizer(cfg: TrainConfig, device: str, start: Any, dp: DataParallel) -> tuple[Any, torch.optim.Optimizer]:
    """The policy: base (+ warm-up weights) -> 4-bit -> LoRA, the adapter warm-started and
    every rank on rank 0's; AdamW over the adapter (the tower's LoRA in its own groups)."""
    bundle = build_policy(cfg, device, start.base)
    model = bundle.model
    if start.adapter:  # a phase that adds vision adapters starts them at B = 0 (grpo/state/compat.py)
        load_lora_state_dict(model, start.adapter, new_under=VISUAL)
    warm = f"{start.reference.parent.name}/{start.reference.name}" if start.reference is not None else None
    reference = start.reference_adapter()
    if reference is not None:  # RL from an SFT warm-up: the reference (KL, "adapters off") is the warm-up's policy
        freeze_reference_adapter(model, reference)
        print(f"phase {cfg.phase.name}: the reference policy is the warm-up {warm} (base + its adapter), not the bare base")
    params = lora_parameters(model)
    dp.broadcast_parameters(params)  # all ranks start from rank 0's adapter
    opt = torch.optim.AdamW(optimizer_groups(model, params, cfg.optim), lr=cfg.optim.lr,
                            weight_decay=cfg.optim.weight_decay)
    if cfg.optim.warmup_moments and start.resume is None and start.reference is not None:
        init = start.init if start.init is not None and Path(start.init.path) == start.reference else None
        if init is not None and init.optimizer_state is not None:
            init.restore_optimizer(opt)  # AdamW's moments and step count as the warm-up left them
            print(f"phase {cfg.phase.name}: AdamW continues the warm-up's moments ({warm})")
    return bundle, opt


def _gather(cfg: TrainConfig, pad_id: int):
    """Learner.gather: every rollout batch as drawn, or DAPO's dynamic sampling (the groups
    whose advantages are not all zero, refilled; and, with an accuracy band, in it)."""
    if not cfg.sampling.dynamic_sampling:
        return plain_batches
    G = cfg.sampling.G

    def spread(r):
        src = advantage_source(r.scores, cfg)
        return groups_with_spread(src.columns, G, valid=src.valid)
    band, bounds = None, cfg.sampling.accuracy_band()
    if bounds is not None:  # and its mean correctness in [low, high] (config.validate: correctness is scored)
        def band(r):
            return groups_in_band(r.scores.components["correctness"], G, *bounds)
    return dynamic_batches(spread, cfg.sampling.max_refills, pad_id, band)


def _draw(n: int, learner: Learner, stream: MixtureStream, dp: DataParallel, hooks: PhaseHooks, temperature: float):
    """Steps 1-2 for the stream's next n prompts (this rank's n / world of them). A prompt
    over model.max_prompt_tokens (or with a bad image) is dropped and counted; a draw
    that keeps none is counted and replaced by the stream's next n prompts (with data
    parallelism on that rank alone: its stream then runs ahead of the others' until
    a resume realigns them, no collective waits on it)."""
    cfg = learner.cfg
    for _ in range(EMPTY_DRAWS):
        try:
            r = sample_and_score(learner, dp.shard(stream.next_batch(n)), temperature, hooks)
            break
        except NoPromptsLeft as e:
            hooks.prompts.add(e.counts)
            reason = e.skipped[0][1]
    else:
        raise ConfigError(no_prompt_message(EMPTY_DRAWS, reason, cfg))
    hooks.prompts.add(r.prompts)
    if cfg.rewards.random_reward:  # the random-reward control (bench/learning.py): rewards cut loose,
        # keyed by the data position, so a resumed run draws what a straight run draws
        key = (cfg.run.seed * 1_000_003 + stream.position) * 64 + dp.rank
        r.scores = r.scores.random_draw(torch.Generator().manual_seed(key))
    return r


def _log_step(run: PhaseRun, hooks: PhaseHooks, step: int, result: Any, temperature: float, bar: Progress) -> None:
    """7. log: one JSON line per step (the means over ranks), the progress bar, every
    run.log_every steps the printed line; the zero-spread fraction the gates read."""
    cfg, dp, mu = run.cfg, run.dp, run.cfg.optim.updates_per_batch
    prompts = PromptCounts(**dp.totals_over_ranks(dataclasses.asdict(hooks.prompts), PromptCounts.MAXIMA))
    record = step_record(cfg.phase.name, step, result, run.rewards.weights, temperature, lr_at(step * mu, cfg),
                         dict(hooks.timing, step=time.time() - hooks.t0), dp, cfg, prompts)
    # with dynamic sampling the trained batch has no zero-spread group: the gate reads what was sampled
    fill = result.fill
    run.state.zero_spread_since_eval.append(fill.zero_spread_frac if fill is not None else record["zero_spread"])
    record = dp.mean_over_ranks(record)  # rank 0 logs the means over ranks
    run.files.write_log(record)
    bar.update(step + 1, f"reward {record['reward']:.2f} len {record['completion_len']:.0f}")
    if (step + 1) % cfg.run.log_every == 0:
        bar.write(progress_line(cfg.phase.name, step, cfg.phase.steps, record))


def run_grpo_phase(cfg: TrainConfig, files: RunFiles, device: str, dp: DataParallel | None = None) -> None:
    """Train one GRPO phase for cfg.phase.steps steps (each optim.accumulation rollout batches), from where it starts."""
    phase, mu = cfg.phase.name, cfg.optim.updates_per_batch
    G, B = cfg.sampling.G, cfg.phase.prompts_per_step
    dp = dp if dp is not None else DataParallel(device=device)  # world 1 unless under torchrun
    dp.check_batch(B, cfg.optim.adv_scale, cfg.rewards.rubric_mode == "prefix",
                   dynamic_sampling=cfg.sampling.dynamic_sampling)
    start = find_start(cfg, files, set_aside=dp.is_main)  # this phase's newest checkpoint, or its --init
    if start is None:
        return
    bundle, opt = _policy_and_optimizer(cfg, device, start, dp)
    model = bundle.model
    guard = StepGuard(list(zip(lora_state_dict(model), lora_parameters(model))), opt, files, cfg)  # same order: A, B per layer
    # Rollouts through the policy's own 4-bit + LoRA layers, or from a merged copy (bf16 on a
    # GPU, the compute dtype on a CPU) refreshed after every batch (grpo/rollout/merged.py: no
    # NF4 dequantisation and no separate LoRA matmuls per decode step).
    merged = MergedRollout(model) if cfg.sampling.rollout == "merged" else None

    # ---- data, rewards, controller; then a resume puts back everything a straight run holds
    train, val = load_training_data(cfg)
    # On CUDA: the predicted peak of a step (prompts of the data's most images), and one line
    # instead of an OOM mid-step when it cannot fit
    check_fits(model, cfg, device, world=dp.world, images=max(len(ex.prompt_images) for s in train for ex in train[s]))
    stream = MixtureStream(train, cfg.phase.mixture, cfg.run.seed)
    rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
    rewards.validate([ex for s in train for ex in train[s]])
    controller = Controller(dict(cfg.rewards.weights), cfg.sampling.max_new_tokens,
                            GateThresholds(temperature_max=cfg.sampling.temperature_max),
                            temperature=cfg.sampling.temperature, phase=phase)
    gen = torch.Generator(device=device).manual_seed(dp.sampling_seed(cfg.run.seed))  # the sampler's own RNG
    state = TrainState(phase, model, opt, stream, controller, gen, cfg.run.seed, dp, files, start, cfg.to_json())
    first, eval_pending = state.restore()
    if cfg.optim.lr == 0:  # config.validate accepts lr 0 in GRPO phases only, as this control
        print(f"phase {phase}: optim.lr = 0, the frozen-policy control: prompts are sampled, scored, logged, "
              "evaluated and checkpointed exactly as in training, and the policy is never updated")
    rewards.set_weights(controller.weights)

    rollout = merged.sample if merged is not None else sample
    noisy = None
    if cfg.sampling.noisy_fraction > 0:  # NoisyRollout: part of each group from a noisy image (grpo/rollout/noisy.py)
        rollout = noisy = NoisyRollout(rollout, cfg.sampling.noisy_fraction, cfg.sampling.noise_std, cfg.phase.steps)
    learner = Learner(bundle, opt, rewards, cfg, gen, rollout=rollout, gather=_gather(cfg, bundle.pad_token_id))
    hooks = PhaseHooks(dp, guard, phase, mu)
    bar = Progress(cfg.phase.steps, f"phase {phase}", first)
    run = PhaseRun(cfg, dp, files, state, SaveClock(cfg), bundle, eval_subset(cfg, val), controller, rewards)
    if eval_pending:  # stopped during this step's evaluation: redo it
        run.evaluate_and_save(first)

    for step in range(first, cfg.phase.steps):
        hooks.begin(step)
        temperature = controller.temperature
        draw = functools.partial(_draw, learner=learner, stream=stream, dp=dp, hooks=hooks, temperature=temperature)
        # ---- 1-6: one GRPO step (grpo/step.py)
        if noisy is not None:
            noisy.step = step  # the noise's annealing follows the phase step
        try:
            result = grpo_step(learner, draw, step, temperature, hooks)
        except NoSpread as e:
            raise NoRewardSpread(no_spread_message(phase, step + 1, e.fill, G, temperature,
                                                   cfg.sampling.max_refills)) from None
        except torch.OutOfMemoryError:  # one line: where, the plan's figure, what fits; nothing was saved mid-step
            raise StepOutOfMemory(out_of_memory_message(model, cfg, device, dp.world, step + 1, hooks.part)) from None
        if merged is not None and result.updates:
            merged.refresh()  # the merged copy follows the new adapter (only the next sampling reads it)
        _log_step(run, hooks, step, result, temperature, bar)  # ---- 7. log

        # ---- 8-10. eval -> gates -> checkpoint, every run.eval_every steps and at the end
        evaluated = (step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.phase.steps
        if evaluated:
            bar.close()
            run.evaluate_and_save(step + 1)
        # a stop (on any rank) or a periodic save is taken at this step boundary, by all ranks at once
        signum, due = dp.agree(STOP.signum or 0, run.clock.due(step + 1))
        if (signum or due) and not evaluated:
            run.save(step + 1)
        if signum:
            bar.close()
            raise Stopped(stop_message(f"{phase} step {step + 1}", signum), signum)
    bar.close()


# ----------------------------------------------------------------------------- the command


def run_phase(cfg: TrainConfig, files: RunFiles, device: str, dp: DataParallel) -> None:
    """One planned phase: the SFT warm-up (once per run directory, on rank 0) or GRPO."""
    if cfg.phase.name != "warmup":
        run_grpo_phase(cfg, files, device, dp)
    elif phase_finished(files.root, "warmup"):
        print("warm-up already done in this run directory; skipping")
    else:  # the SFT warm-up is not data-parallel: rank 0 runs it, the others wait (unwatched: it takes long)
        if dp.is_main:
            run_warmup(cfg, files, device)
        dp.barrier(patient=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m grpo.train``: the CLI (grpo/cli.py) running the phases above."""
    return cli.main(argv, run_phase)


if __name__ == "__main__":
    sys.exit(main())
