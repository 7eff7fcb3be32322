"""GRPO training: ``python -m grpo.train --phase {warmup,A,B,C} [--key value ...]``.

What is implemented
-------------------
Group Relative Policy Optimisation (DeepSeekMath's GRPO, in TRL's loss conventions) for a
vision-language policy = frozen base (optionally NF4 4-bit) + rank-8 LoRA, run as the
staged, metric-gated curriculum of the staged-GRPO paper (docs/design.md):

    warmup  R1-VL's policy warm-up: SFT on worked reasoning (grpo/sft.py)
    A       stage 1 only, structure-heavy reward weights, from the pretrained base
            (a model trained from scratch, tiny-random, starts A from warmup:latest)
    B       stage 1 .7 + stage 2 .3, correctness-heavy, from A:best_structure
    C       stage 2 .6 + stage 3 .4, tolerance on, from B:best_composite

One GRPO step (one rollout batch of B prompts), as ``run_grpo_phase`` below runs it:

    1. sample     G completions per prompt; each prompt (and its image) is encoded once and
                  its KV cache copied G times (grpo/sampler.py; the tiny preset decodes
                  from a merged copy of the policy, grpo/rollout_fast.py)
    2. reward     the verifier components (+ step / detail / rubric terms), weighted by the
                  controller's current weights (grpo/rewards)
    3. advantage  A = (r - mean_g) / (std_g + 1e-4) within each prompt's group of G
                  (kernels/grpo_advantages.py), once per batch
    4. log-probs  of the completion tokens under the policy (with grad) and, if beta > 0,
                  under the reference = the same model with LoRA switched off (grpo/logprobs.py)
    5. loss       -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A) + beta k3, mean per
                  sequence then over the batch (kernels/grpo_loss.py: one fused pass)
    6. step       backward into the LoRA parameters, clip the gradient norm, AdamW
    4-6 run mu = optim.updates_per_batch times on the same rollouts (PPO epochs)
    7. log        one JSON line (eval/plots.py documents the format)
    every run.eval_every steps and at the end:
    8. eval       greedy decoding on a fixed held-out subset (grpo/evaluate.py)
    9. gate       the controller changes reward weights only when those metrics say so
    10. save      atomic checkpoint + aliases latest / best_structure / best_correctness /
                  best_composite (grpo/checkpoint.py)

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
updates per rollout. A "step" (phase.steps, eval_every, checkpoints, the log line) is a
rollout batch; the learning-rate schedule counts optimiser steps (grpo/run.py lr_at).

Simplified, on purpose:
  - no value model (GRPO's point: the group mean is the baseline);
  - the policy runs in eval mode (no dropout), so two passes of one policy agree and the
    ratio of update 1 is exactly 1;
  - the reference policy is the base with LoRA off, not a separate frozen copy (the same
    weights, no second model in memory);
  - rollouts and the loss use the same temperature-scaled distribution; with
    sampling.rollout=merged the sampler is a merged copy of the policy, whose log-probs
    differ from the trainer's by rounding: the log line's "rollout" entry measures that
    mismatch every step and optim.rollout_correction weights the policy term by
    pi_train / pi_sampler (kernels/grpo_loss.py);
  - evaluation is greedy with one sample per prompt (the staged paper's final protocol);
  - the warm-up is not data-parallel (rank 0 runs it, the others wait);
  - a non-finite loss skips the update and a non-finite update is undone; three in a row
    stop the run (grpo/run.py StepGuard).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from data.mixture import MixtureStream
from grpo import cli
from grpo.checkpoint import phase_finished, save_checkpoint
from grpo.cli import _phase_local, phase_configs  # noqa: F401 (bench/learning.py imports them from here)
from grpo.config import TrainConfig
from grpo.controller import Controller
from grpo.distributed import DataParallel
from grpo.dynamic_sampling import Rollout, fill_batch, groups_with_spread, no_spread_message
from grpo.errors import NoRewardSpread
from grpo.evaluate import checkpoint_eval, print_eval
from grpo.logprobs import completion_logprobs, reference_logprobs
from grpo.model import encode_prompts
from grpo.phase_data import eval_subset, load_training_data
from grpo.policy import adapter_tensors, build_policy
from grpo.resume import find_start
from grpo.rewards import RewardModel
from grpo.rollout_fast import MergedRollout
from grpo.run import (GEN_KEY, Progress, RunFiles, SaveClock, StepGuard, lr_at,  # noqa: F401 (pick_device: bench)
                      pick_device, progress_line, step_record, update_record)
from grpo.sampler import content_tokens, sample
from grpo.sft import run_warmup
from grpo.stop import STOP, EvalAbandoned, Stopped, evals_run_to_the_end, stop_message
from kernels.grpo_advantages import group_advantages
from kernels.grpo_loss import grpo_loss
from lora import disable_adapters, load_lora_state_dict, lora_parameters, lora_state_dict


def run_grpo_phase(cfg: TrainConfig, files: RunFiles, device: str, dp: DataParallel | None = None) -> None:
    """Train one GRPO phase for cfg.phase.steps rollout batches, from where it starts."""
    phase, mu = cfg.phase.name, cfg.optim.updates_per_batch
    G, L, B = cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step  # L: completion budget
    dp = dp if dp is not None else DataParallel(device=device)  # world 1 unless under torchrun
    dp.check_batch(B, cfg.optim.adv_scale, cfg.rewards.rubric_mode == "prefix",
                   dynamic_sampling=cfg.sampling.dynamic_sampling)
    start = find_start(cfg, files, set_aside=dp.is_main)  # this phase's newest checkpoint, or its --init
    if start is None:
        return

    # ---- policy: base (+ warm-up weights) -> 4-bit -> LoRA, the adapter warm-started
    bundle = build_policy(cfg, device, start.base)
    model = bundle.model
    if start.adapter:
        load_lora_state_dict(model, start.adapter)
    params = lora_parameters(model)
    dp.broadcast_parameters(params)  # all ranks start from rank 0's adapter
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    guard = StepGuard(list(zip(lora_state_dict(model), params)), opt, files, cfg)  # same order: A, B per layer
    # Rollouts through the policy's own 4-bit + LoRA layers, or from a merged bf16 copy
    # refreshed after every batch (grpo/rollout_fast.py: ~2x fewer bytes per decode step).
    rollout = MergedRollout(model) if cfg.sampling.rollout == "merged" else None
    sample_fn = rollout.sample if rollout is not None else sample

    # ---- data, rewards, controller; then a resume puts back everything a straight run holds
    train, val = load_training_data(cfg)
    stream = MixtureStream(train, cfg.phase.mixture, cfg.run.seed)
    eval_examples = eval_subset(cfg, val)
    rewards = RewardModel(cfg.rewards, L, tokenizer=bundle.tokenizer)
    rewards.validate([ex for s in train for ex in train[s]])
    controller = Controller(dict(cfg.rewards.weights), L, temperature=cfg.sampling.temperature, phase=phase)
    gen = torch.Generator(device=device).manual_seed(dp.sampling_seed(cfg.run.seed))  # the sampler's own RNG
    gen_key = dp.generator_key(GEN_KEY)  # each rank saves and restores its own generator
    first = start.restore(phase, opt, stream, controller, gen, gen_key, cfg.run.seed)
    if cfg.optim.lr == 0:  # config.validate accepts lr 0 in GRPO phases only, as this control
        print(f"phase {phase}: optim.lr = 0, the frozen-policy control: prompts are sampled, scored, logged, "
              "evaluated and checkpointed exactly as in training, and the policy is never updated")
    rewards.set_weights(controller.weights)
    loss_options = dict(beta=cfg.optim.beta, eps_low=cfg.optim.eps_low, eps_high=cfg.optim.eps_high,
                        loss_type=cfg.optim.loss_type, importance=cfg.optim.importance, max_len=L,
                        kl_bias_correction=cfg.optim.kl_bias_correction,
                        correction=cfg.optim.rollout_correction, correction_mode=cfg.optim.rollout_correction_mode,
                        correction_cap=cfg.optim.rollout_correction_cap)
    zero_spread_since_eval: list[float] = []  # what the controller's zero-spread gate reads
    bar = Progress(cfg.phase.steps, f"phase {phase}", first)

    def draw(n: int) -> Rollout:
        """Steps 1-2 for the stream's next n prompts (this rank's share of them)."""
        t0 = time.time()
        examples = dp.shard(stream.next_batch(n))  # n is global: this rank's n / world prompts
        prompts = encode_prompts(bundle, examples, on_bad_image="skip").to(device)
        out = sample_fn(bundle, prompts, G=G, max_new_tokens=L, temperature=temperature,
                        top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p, generator=gen)
        timing["sampling"] += time.time() - t0
        t0 = time.time()
        examples = [examples[i] for i in prompts.kept]  # a prompt whose image failed to encode is dropped
        rb = rewards([examples[row // G] for row in range(len(out.texts))], out.texts,
                     num_tokens=content_tokens(out), completion_ids=out.completion_ids)
        if cfg.rewards.random_reward:  # the random-reward control (bench/learning.py): rewards cut loose
            # keyed by the data position, so a resumed run draws what a straight run draws
            key = (cfg.run.seed * 1_000_003 + stream.position) * 64 + dp.rank
            rb = rb.random_draw(torch.Generator().manual_seed(key))
        timing["rewards"] += time.time() - t0
        return Rollout(examples, out, rb)

    def spread(r: Rollout) -> list[int]:
        """The groups of a rollout whose advantages are not all zero (dynamic sampling keeps those)."""
        values, valid = spread_columns(r.rb, cfg)
        return groups_with_spread(values, G, valid=valid)

    clock = SaveClock(cfg)

    def save(done: int, result=None, pending: bool = False) -> None:
        """The checkpoint after ``done`` steps: with its evaluation (metrics, scores, every alias),
        or periodic (``latest`` only; with what the next evaluation's gates read, and whether
        this step's evaluation was abandoned: a resume redoes it)."""
        dp.check_replicas(params)  # every rank must hold the adapter rank 0 is about to save
        tensors = dict(adapter_tensors(lora_state_dict(model)), **dp.generator_states(GEN_KEY, gen))
        if dp.is_main:
            base = str(start.base.relative_to(files.root)) if start.base else None
            sched = {"step": done} if result is not None else {
                "step": done, "zero_spread_since_eval": list(zero_spread_since_eval), "eval_pending": pending}
            save_checkpoint(files.root, phase, done, tensors=tensors, optimizer=opt,
                            scheduler_state=sched, controller_state=controller.state_dict(),
                            data_position=stream.position, metrics=result.flat() if result is not None else {},
                            scores=result.scores if result is not None else {},
                            config_json=cfg.to_json(), extra={"kind": "adapter", "base": base},
                            periodic=result is None)
        clock.saved()

    def evaluate_and_save(done: int) -> None:
        """8-10: eval -> gates -> checkpoint. A stop abandons the eval (one process; ranks
        finish it together) and saves the step as periodic, its eval pending."""
        try:
            with evals_run_to_the_end() if dp.enabled else contextlib.nullcontext():
                result = checkpoint_eval(bundle, eval_examples, cfg, dp)
        except EvalAbandoned:
            save(done, pending=True)
            raise Stopped(stop_message(f"{phase} step {done} (its evaluation abandoned)"), STOP.signum) from None
        print_eval(phase, done, result)
        files.write_log(dict(event="eval", phase=phase, step=done, metrics=result.flat()))
        if cfg.phase.controller:
            metrics = dict(result.metrics, zero_spread=float(np.mean(zero_spread_since_eval)))
            for d in controller.update(metrics, result.overall.intervals, n=result.overall.n_prompts):
                print(f"  gate: {d}")
                files.write_log(dict(event="gate", phase=phase, step=done, rule=d.rule,
                                     changes={d.target: [d.old, d.new]}, decision=d.to_dict()))
            rewards.set_weights(controller.weights)
        zero_spread_since_eval.clear()
        save(done, result)

    if start.resume is not None:  # a periodic checkpoint: what the gates read since the last eval
        zero_spread_since_eval.extend(start.resume.scheduler_state.get("zero_spread_since_eval", []))
        if start.resume.scheduler_state.get("eval_pending"):  # stopped during this step's eval: redo it
            evaluate_and_save(first)

    for step in range(first, cfg.phase.steps):
        t_step, timing = time.time(), dict(sampling=0.0, rewards=0.0, logprobs=0.0, backward=0.0)
        temperature = controller.temperature

        # ---- 1-2. sample B prompts x G completions and score them, every micro-batch first
        # (dapo divides by the step's token count; dynamic sampling needs the rewards)
        batch = [draw(B) for _ in range(cfg.optim.accumulation)]
        fill = None
        if cfg.sampling.dynamic_sampling:  # DAPO: keep groups with reward spread, refill from the stream
            batch, fill = fill_batch(batch, draw, spread, B, cfg.sampling.max_refills, bundle.pad_token_id)
            if not batch:
                raise NoRewardSpread(no_spread_message(phase, step + 1, fill, G, temperature,
                                                       cfg.sampling.max_refills))

        # dapo divides by the active tokens of the whole step (every micro-batch of every rank);
        # share scales a micro-batch's loss to this rank's part of the global loss (1 on one process)
        active_tokens, shares = dp.loss_shares(cfg.optim.loss_type, [r.out.completion_mask for r in batch])

        # ---- 3. advantage: z-score each reward within its prompt's group (the same for all mu updates)
        adv = [group_advantages(G=G, T=r.out.completion_ids.shape[1], **advantage_kwargs(r.rb, cfg, dp, device))
               for r in batch]

        # ---- 4-6, mu times. Update 1 runs with old = the current policy detached and keeps its
        # log-probs as old_logp for updates 2..mu; the reference log-probs do not change.
        ref_logp: list[torch.Tensor | None] = [None] * len(batch)
        old_logp: list[torch.Tensor | None] = [None] * len(batch)
        updates, logs = [], []
        for u in range(mu):
            lr = lr_at(step * mu + u, cfg)  # the schedule counts optimiser steps
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            stats_u, loss_sum = [], 0.0
            for k, (r, share) in enumerate(zip(batch, shares)):
                ids, mask, ctx = r.out.completion_ids, r.out.completion_mask, r.out.context
                # ---- 4. log-probs: reference (LoRA off, no grad; once per batch) and policy (with grad)
                t0 = time.time()
                if cfg.optim.beta > 0 and ref_logp[k] is None:
                    ref_logp[k] = reference_logprobs(model, ctx, ids, mask, G, temperature=temperature,
                                                     ref_context=lambda: disable_adapters(model))
                logp = completion_logprobs(model, ctx, ids, mask, G, temperature=temperature)
                timing["logprobs"] += time.time() - t0

                # ---- 5. loss: ratio against old, clip, k3 KL to ref, aggregation; backward
                t0 = time.time()
                # The sampler's own log-probs: the mismatch stats every step, and the rollout
                # correction's weights (a merged copy samples from other weights than the trainer's)
                loss, stats = grpo_loss(logp, mask.float(), G=G, advantages=adv[k], old_logp=old_logp[k],
                                        ref_logp=ref_logp[k], num_active_tokens=active_tokens,
                                        sampler_logp=r.out.logprobs, **loss_options)
                if u == 0 and mu > 1:
                    old_logp[k] = logp.detach()  # the sampling policy's: nothing was updated yet
                loss = loss * share
                if cfg.optim.loss_type != "dapo":  # dapo already divides by the whole batch's tokens
                    loss = loss / len(batch)
                if torch.isfinite(loss):  # a host sync per micro-batch: the price of the NaN guard
                    loss.backward()
                loss_sum += float(loss.detach())
                timing["backward"] += time.time() - t0
                stats_u.append(stats)
                if u == 0:
                    logs.append((r.rb, stats, r.out))

            # ---- 6. step: the global loss (non-finite on any rank skips the step on all), the
            # gradient summed over ranks, clipped, AdamW; an update that leaves a parameter
            # non-finite is undone. Either failure ends this batch's updates.
            loss_sum = dp.all_reduce_sum(loss_sum)
            which = {"update": u + 1} if mu > 1 else {}
            if not math.isfinite(loss_sum):
                opt.zero_grad(set_to_none=True)
                guard.failed(phase, step + 1, dict(loss=str(loss_sum), **which),
                             f"[{phase} {step + 1}] non-finite loss {loss_sum}: update skipped")
                break
            t0 = time.time()
            dp.all_reduce_gradients(params)  # sum of the ranks' shares = the global batch's gradient
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
            bad = guard.step(dp)
            if bad:
                guard.failed(phase, step + 1, dict(loss=loss_sum, params=bad[:5], **which),
                             f"[{phase} {step + 1}] non-finite update ({len(bad)} tensors, e.g. {bad[0]}): "
                             "parameters and optimiser state restored")
                break
            guard.succeeded()
            timing["backward"] += time.time() - t0
            updates.append(update_record(u, loss_sum, gnorm, lr, stats_u, dp))
        if rollout is not None and updates:
            rollout.refresh()  # the merged copy follows the new adapter (only the next sampling reads it)

        # ---- 7. log: one JSON line per rollout batch (= per optimiser step when mu = 1)
        record = step_record(phase, step, logs, rewards.weights, loss_sum, updates, fill, temperature,
                             lr_at(step * mu, cfg), float(gnorm) if guard.streak == 0 else None,
                             dict(timing, step=time.time() - t_step), dp, mu, cfg)
        # with dynamic sampling the trained batch has no zero-spread group: the gate reads what was sampled
        zero_spread_since_eval.append(fill.dropped_frac if fill is not None else record["zero_spread"])
        record = dp.mean_over_ranks(record)  # rank 0 logs the means over ranks
        files.write_log(record)
        bar.update(step + 1, f"reward {record['reward']:.2f} len {record['completion_len']:.0f}")
        if (step + 1) % cfg.run.log_every == 0:
            bar.write(progress_line(phase, step, cfg.phase.steps, record, fill, updates, mu))

        # ---- 8-10. eval -> gates -> checkpoint, every run.eval_every steps and at the end
        evaluated = (step + 1) % cfg.run.eval_every == 0 or step + 1 == cfg.phase.steps
        if evaluated:
            bar.close()
            evaluate_and_save(step + 1)
        # a stop (on any rank) or a periodic save is taken at this step boundary, by all ranks at once
        signum, due = dp.agree(STOP.signum or 0, clock.due(step + 1))
        if (signum or due) and not evaluated:
            save(step + 1)
        if signum:
            bar.close()
            raise Stopped(stop_message(f"{phase} step {step + 1}", signum), signum)
    bar.close()


# ----------------------------------------------------------------------------- step 3: the advantage source


def advantage_kwargs(rb, cfg: TrainConfig, dp: DataParallel, device: str) -> dict:
    """The advantage source of one micro-batch, as group_advantages (and grpo_loss) keywords.

    rubric prefix mode: V-Rubrics token advantages from R_ans and the rubric scores.
    adv_mode "total": A = z(sum_k w_k r_k), GRPO's one z-score of the weighted reward.
    adv_mode "components": A = sum_k (w_k / sum_j w_j) z(r_k), every term z-scored in its
    group on its own (GDPO, Liu et al. 2026, "Group reward-Decoupled Normalization Policy
    Optimization"; TRL's multi_objective_aggregation="normalize_then_sum"). A tie-breaker
    of weight w then moves a tied group's advantages by at most its share w / sum(w) of a
    unit z-score, never the full unit that z(total) gives it; a group that splits on
    every term gets advantages of z(total)'s size. GDPO batch-normalises the sum
    afterwards; we divide by the fixed sum of weights instead, because a batch std would
    stretch a batch of tied groups back to unit size. Components with weight 0 are left
    out (they would add nothing but would count as spread).
    Under torchrun, scale "batch" divides by the std over every rank's rewards
    (grpo/distributed.py), after which no std floor is left to apply.
    """
    if cfg.rewards.rubric_mode == "prefix" and rb.prefix is not None:
        prefix = replace(rb.prefix.to(device), a=cfg.rewards.prefix_answer_weight)
        _, scale = dp.advantage_inputs(rb.total.to(device), cfg.optim.adv_scale)
        return dict(prefix=prefix, scale=scale, adv_std_floor=cfg.optim.adv_std_floor)
    floor = cfg.optim.adv_std_floor
    names = [k for k, w in rb.weights.items() if w > 0]
    if cfg.optim.adv_mode == "components" and names:
        values = torch.stack([rb.components[k] for k in names], 1).to(device)
        w = torch.tensor([rb.weights[k] for k in names], dtype=torch.float32)
        values, scale = dp.advantage_inputs(values, cfg.optim.adv_scale, std_floor=floor)
        return dict(reward_components=values, component_weights=(w / w.sum()).to(device), scale=scale,
                    adv_std_floor=floor if scale == cfg.optim.adv_scale else 0.0)
    values, scale = dp.advantage_inputs(rb.total.to(device), cfg.optim.adv_scale, std_floor=floor)
    return dict(rewards=values, scale=scale, adv_std_floor=floor if scale == cfg.optim.adv_scale else 0.0)


def spread_columns(rb, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values [N, C], valid [N, C] or None): the reward columns the advantages come from, so
    that "a group has spread" means "its advantages are not all zero" (dynamic sampling)."""
    if cfg.rewards.rubric_mode == "prefix" and rb.prefix is not None:
        p = rb.prefix
        values = torch.cat([p.R_ans.float()[:, None], p.s.float()], 1)
        valid = torch.cat([torch.ones(len(p.R_ans), 1, dtype=torch.bool), p.scored.bool()], 1)
        return values, valid
    names = [k for k, w in rb.weights.items() if w > 0]
    if cfg.optim.adv_mode == "components" and names:
        return torch.stack([rb.components[k] for k in names], 1), None
    return rb.total[:, None], None


# ----------------------------------------------------------------------------- the command


def run_phase(cfg: TrainConfig, files: RunFiles, device: str, dp: DataParallel) -> None:
    """One planned phase: the SFT warm-up (once per run directory, on rank 0) or GRPO."""
    if cfg.phase.name != "warmup":
        run_grpo_phase(cfg, files, device, dp)
    elif phase_finished(files.root, "warmup"):
        print("warm-up already done in this run directory; skipping")
    elif dp.is_main:  # the SFT warm-up is not data-parallel: rank 0 runs it, the others wait
        run_warmup(cfg, files, device)


def main(argv: list[str] | None = None) -> int:
    """``python -m grpo.train``: the CLI (grpo/cli.py) running the phases above."""
    return cli.main(argv, run_phase)


if __name__ == "__main__":
    sys.exit(main())
