"""One GRPO step, top to bottom: sample -> score -> advantages -> log-probs -> loss -> update.

This file is the algorithm. grpo/train.py is the harness around it (the data stream, data
parallelism, the non-finite guard, timing, the log line, eval -> gates -> checkpoint); read
this first. Names and shapes used throughout:

    B  prompts per rollout batch        G  completions per prompt (one *group*)
    N  = B * G rows, each prompt's G rows contiguous
    T  completion tokens (the longest completion of the rollout batch, <= sampling.max_new_tokens)
    mu optimiser updates per rollout batch (optim.updates_per_batch; PPO's epochs)

Three levels, one word each (grpo/batches.py): a step samples optim.accumulation *rollout batches*, each
decoded N rows at once; the training passes (log-probs, loss, backward) take a rollout batch a *micro-batch*
of optim.micro_batch_rows rows (whole groups) at a time (memory only: backward keeps the activations of
every row a pass runs); under data parallelism each *rank* holds its share of every rollout batch.

GRPO in one paragraph: for each prompt, sample a group of G answers, score each with the reward, and use the
reward's z-score in the group as every token's advantage (no value model: the group mean is the baseline).
Then take a PPO-style clipped policy-gradient step on the LoRA parameters, optionally with an entropy bonus
and a KL penalty to the reference policy (where RL began: the base, LoRA off, or a warm-up's frozen adapter).

The fast paths plug in behind named seams, not as branches here:

    Learner.rollout  who samples: the KV-cache sampler (grpo/rollout/sampler.py) or a merged copy
                     of the policy (grpo/rollout/merged.py), either in NoisyRollout (grpo/rollout/noisy.py)
    Learner.backend  who computes advantages, log-probs and the loss: the Triton kernels on CUDA
                     or their PyTorch references (grpo_kernels/), equal within tested tolerances
    Learner.gather   how a step's rollout batches are collected: ``plain_batches``, or DAPO's
                     dynamic sampling (grpo/rollout/dynamic_sampling.py)
    Hooks            what the harness does around the step; the defaults are one process
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ContextManager

import torch

from grpo.batches import MicroBatch, micro_batches
from grpo.config import TrainConfig
from grpo.model.logprobs import completion_logprobs, reference_logprobs
from grpo.model.lr_groups import set_lr
from grpo.model.prompts import encode_prompts
from grpo.rewards import RewardBatch, RewardModel
from grpo.rollout.dynamic_sampling import FillStats
from grpo.rollout.guided import guide_rollout, shaped_loss, shaped_rows
from grpo.rollout.sampler import Rollout, content_tokens, sample
from grpo.run.schedule import lr_at
from grpo_kernels.grpo_advantages import Advantages, AdvantageSource, group_advantages
from grpo_kernels.grpo_loss import GRPOStats, LossOptions, aggregate, grpo_loss
from lora import disable_adapters


def plain_batches(draw: Callable[[int], Rollout], B: int, batches: int) -> tuple[list[Rollout], None]:
    """The default ``Learner.gather``: ``batches`` rollout batches of B prompts each."""
    return [draw(B) for _ in range(batches)], None


@dataclass
class Learner:
    """What a GRPO step works on: the policy and its optimiser, the reward, the options."""

    bundle: Any  # grpo.model.load.ModelBundle: the policy (base + LoRA), tokenizer, image processor
    opt: torch.optim.Optimizer  # AdamW over the LoRA parameters
    rewards: RewardModel  # the weighted reward terms (grpo/rewards), weights set by the controller
    cfg: TrainConfig
    generator: torch.Generator  # the sampler's own RNG (checkpointed: a resume draws what a straight run draws)
    rollout: Callable[..., Any] = sample  # seam: (bundle, prompts, G=, max_new_tokens=, ...) -> SampleOutput
    backend: str = "auto"  # seam: "auto" (CUDA -> Triton kernels), "torch", "triton"
    gather: Callable[..., tuple[list[Rollout], FillStats | None]] = plain_batches  # seam: (draw, B, batches)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.opt.param_groups for p in group["params"]]


class Hooks:
    """Where the harness wraps a step (grpo/train.py: data parallelism, the non-finite
    guard, timing). These defaults are one process with nothing around it."""

    def timed(self, part: str) -> ContextManager:
        """Time ``part`` ("sampling", "rewards", "logprobs", "backward") of the step."""
        return contextlib.nullcontext()

    def counts_over_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        """(rows, active tokens) of each rollout batch [batches, 2], summed over processes."""
        return counts

    def batch_std(self, columns: torch.Tensor, std_floor: float) -> torch.Tensor | None:
        """scale="batch"'s std of each reward column [N, C] over every process's rows (data
        parallel); None: this process's rows are the batch (the kernel takes their std)."""
        return None

    def global_loss(self, loss: float) -> float:
        """The step's loss summed over processes."""
        return loss

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the gradients over processes."""

    def skipped(self, update: int, loss: float) -> None:
        """The loss was not finite: this update (and the rest of the batch's) is skipped."""

    def optimizer_step(self, opt: torch.optim.Optimizer, update: int, loss: float) -> bool:
        """opt.step(); False: the harness undid it (it left a parameter non-finite)."""
        opt.step()
        return True


# ----------------------------------------------------------------------------- 1-2. sample and score


def sample_and_score(learner: Learner, examples: list, temperature: float, hooks: Hooks = Hooks()) -> Rollout:
    """G completions for each of B prompts, scored; rows N = B*G. A prompt is encoded once, its KV
    cache copied G times (NoisyRollout: a noisy copy too, its rows rescored on the clean image)."""
    cfg, G, L = learner.cfg, learner.cfg.sampling.G, learner.cfg.sampling.max_new_tokens
    with hooks.timed("sampling"):
        prompts = encode_prompts(learner.bundle, examples, on_bad_image="skip").to(learner.bundle.device)
        out = learner.rollout(learner.bundle, prompts, G=G, max_new_tokens=L, temperature=temperature,
                              top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p, generator=learner.generator)
    with hooks.timed("rewards"):
        examples = [examples[i] for i in prompts.kept]  # a bad image or a prompt over the cap was dropped
        scores = learner.rewards([examples[row // G] for row in range(len(out.texts))], out.texts,
                                 num_tokens=content_tokens(out), completion_ids=out.completion_ids)
        if cfg.sampling.guided:  # a group with no correct completion gets the gold in its last row, rescored
            out, scores = guide_rollout(learner, examples, out, scores, temperature)
    return Rollout(examples, out, scores, prompts.counts)


# ----------------------------------------------------------------------------- 3. advantages


def advantage_source(scores: RewardBatch, cfg: TrainConfig, device: torch.device | str = "cpu") -> AdvantageSource:
    """Which rewards the advantages come from (grpo_kernels/grpo_advantages.py ``AdvantageSource``):

    total       A = z(sum_k w_k r_k): GRPO's one z-score of the weighted reward (the default)
    components  A = sum_k (w_k / sum_j w_j) z(r_k): each term z-scored in its group on its own
                (GDPO; a tie-breaker of weight w moves a tied group by at most its share of a
                unit z-score). Terms of weight 0 are left out: they add nothing but would count
                as spread.
    prefix      V-Rubrics: A_t = a z(R_ans) + (1 - a) sum_j rho_j z(s_j) 1[t <= t_end_j], each
                rubric credited to the token prefix that earned it.
    """
    if cfg.rewards.rubric_mode == "prefix" and scores.prefix is not None:
        return AdvantageSource.of_prefix(replace(scores.prefix.to(device), a=cfg.rewards.prefix_answer_weight))
    names = [k for k, w in scores.weights.items() if w > 0]
    if cfg.optim.adv_mode == "components" and names:
        w = torch.tensor([scores.weights[k] for k in names], dtype=torch.float32)
        return AdvantageSource(torch.stack([scores.components[k] for k in names], 1).to(device),
                               weights=(w / w.sum()).to(device))
    return AdvantageSource(scores.total.to(device)[:, None])


def advantages(learner: Learner, r: Rollout, hooks: Hooks = Hooks()) -> Advantages:
    """z-scores of the rollout batch's rewards within each group of G (grpo_kernels/grpo_advantages.py):
    A = (r - mean_group) / (std_group + 1e-4), the same for all mu updates."""
    o = learner.cfg.optim
    src = advantage_source(r.scores, learner.cfg, learner.bundle.device)
    if o.adv_scale == "batch" and src.prefix is None:  # data parallel: the std of every rank's rows
        src.batch_std = hooks.batch_std(src.columns, o.adv_std_floor)
    return group_advantages(src, learner.cfg.sampling.G, T=r.out.completion_ids.shape[1], scale=o.adv_scale,
                            adv_std_floor=o.adv_std_floor, backend=learner.backend)


# ----------------------------------------------------------------------------- 4-6. log-probs, loss, update


@dataclass
class BatchLog:
    """What the log line reads of one rollout batch (at update 1, the on-policy one)."""

    scores: RewardBatch
    stats: GRPOStats
    out: Any  # SampleOutput: lengths, truncation
    entropy: torch.Tensor  # [N, T] the policy's token entropies (grpo/model/logprobs.py), 0 off the loss's tokens


@dataclass
class UpdateResult:
    update: int  # 0-based
    loss: float  # the step's loss (summed over micro-batches, rollout batches and ranks)
    grad_norm: float  # before clipping
    lr: float
    stats: list[GRPOStats]  # one per rollout batch


@dataclass
class StepResult:
    loss: float  # of the last update tried
    grad_norm: float | None  # of the last update; None when an update was skipped or undone
    updates: list[UpdateResult] = field(default_factory=list)  # the updates taken
    logs: list[BatchLog] = field(default_factory=list)  # one per rollout batch
    fill: FillStats | None = None  # what dynamic sampling did (None without it)


def loss_options(cfg: TrainConfig) -> LossOptions:
    """grpo_loss's options from the config (formulas: grpo_kernels/grpo_loss.py)."""
    o = cfg.optim
    return LossOptions(beta=o.beta, eps_low=o.eps_low, eps_high=o.eps_high, loss_type=o.loss_type,
                       importance=o.importance, max_len=cfg.sampling.max_new_tokens,
                       kl_bias_correction=o.kl_bias_correction, kl_estimator=o.kl_estimator, correction=o.rollout_correction,
                       correction_mode=o.rollout_correction_mode, correction_cap=o.rollout_correction_cap)


def grpo_step(learner: Learner, draw: Callable[[int], Rollout], step: int, temperature: float,
              hooks: Hooks = Hooks()) -> StepResult:
    """Rollout batches (draw(n): n prompts, sampled and scored) get advantages once; mu passes over the micro-batches."""
    cfg, model, params, G, mu, opts = (learner.cfg, learner.bundle.model, learner.params, learner.cfg.sampling.G,
                                       learner.cfg.optim.updates_per_batch, loss_options(learner.cfg))
    passes = dict(temperature=temperature, chunk_tokens=cfg.optim.logits_chunk_tokens,
                  shared_prefix=cfg.optim.shared_prefix, backend=learner.backend)
    entropy = "grad" if cfg.optim.entropy_coef > 0 else True  # the entropy bonus needs the entropies' gradient

    # ---- 1-2. sample B prompts x G completions and score them, every rollout batch first
    # (dapo divides by the whole step's token count; dynamic sampling needs the rewards)
    batches, fill = learner.gather(draw, cfg.phase.prompts_per_step, cfg.optim.accumulation)
    masks = [r.out.loss_mask(cfg.optim.mask_truncated) for r in batches]  # the loss's tokens (SampleOutput.loss_mask)
    counts = hooks.counts_over_ranks(torch.tensor([[m.shape[0], float(m.sum())] for m in masks], dtype=torch.float64))
    active_tokens = max(1.0, float(counts[:, 1].sum()))  # mask_truncated may leave 0

    # ---- 3. advantages: z-scores within each group, computed once for all mu updates;
    # then each rollout batch cut into training micro-batches (whole groups), sliced once (LUFFY-shaped guided rows apart)
    adv, guided = zip(*(shaped_rows(advantages(learner, r, hooks), r.out, cfg.optim.guided_gamma) for r in batches))
    parts = [micro_batches(r.out, masks[k], adv[k], counts[k].tolist(), len(batches), cfg.optim.loss_type,
                           cfg.optim.micro_batch_rows, guided_adv=guided[k]) for k, r in enumerate(batches)]

    # ---- 4-6, mu times. Update 1 takes the ratio against the current policy detached (ratio 1,
    # the clip cannot bind) and keeps its log-probs as old_logp: they are the sampling policy's,
    # since nothing was updated yet. Updates 2..mu take the ratio against them, and the clip binds.
    result = StepResult(loss=0.0, grad_norm=None, fill=fill)
    for u in range(mu):
        lr = lr_at(step * mu + u, cfg)  # the schedule counts optimiser steps
        set_lr(learner.opt, lr)  # times each group's lr_scale (the vision tower's LoRA: grpo/model/vision.py)
        learner.opt.zero_grad(set_to_none=True)
        stats_u, loss_sum = [], 0.0
        for k, r in enumerate(batches):
            # ---- 4. log-probs [n, T]: the reference's (adapters off, no grad, once per step) and the policy's
            if cfg.optim.beta > 0 and parts[k][0].ref_logp is None:
                with hooks.timed("logprobs"):
                    for mb in parts[k]:
                        mb.ref_logp = reference_logprobs(model, mb.prompts, mb.ids, mb.seen, G,
                                                         ref_context=lambda: disable_adapters(model), **passes)
            logps = []
            for mb in parts[k]:  # a training micro-batch: forward then backward
                with hooks.timed("logprobs"):
                    logp, ent = completion_logprobs(model, mb.prompts, mb.ids, mb.seen, G, entropy=entropy, **passes)

                # ---- 5. loss: ratio to old, clipped; + beta * KL to the reference; aggregated (- the
                # entropy bonus, aggregated alike); times its share of the step's loss (grpo/batches.py); backward.
                with hooks.timed("backward"):
                    loss, stats = grpo_loss(logp, mb.mask.float(), mb.adv, old_logp=mb.old_logp, ref_logp=mb.ref_logp,
                                            num_active_tokens=active_tokens, sampler_logp=mb.sampler_logp,
                                            options=opts, backend=learner.backend)
                    loss = loss + shaped_loss(logp, mb, cfg.optim.guided_gamma, opts, active_tokens)  # 0.0: no guided row
                    bonus = aggregate(ent, mb.mask, opts, active_tokens) if entropy == "grad" else 0.0
                    loss = (loss - cfg.optim.entropy_coef * bonus) * mb.share  # coef 0: loss - 0.0, the same bits
                    if torch.isfinite(loss):  # a host sync per micro-batch: the price of the NaN guard
                        loss.backward()
                    loss_sum += float(loss.detach())
                logps.append((logp.detach(), ent.detach()))
            if len(parts[k]) > 1:  # the diagnostics of the whole rollout batch, as one pass reports them
                stats = batch_stats(learner, parts[k], r, masks[k], adv[k], torch.cat([lp for lp, _ in logps]),
                                    active_tokens, opts)
            stats_u.append(stats)
            if u == 0:
                for mb, (logp, _) in zip(parts[k], logps):
                    mb.old_logp = logp
                result.logs.append(BatchLog(r.scores, stats, r.out, torch.cat([e for _, e in logps]) * masks[k]))

        # ---- 6. update: the step's loss (a non-finite one skips the update), the gradient
        # clipped to optim.grad_clip, one AdamW step (undone by the harness if it left a
        # parameter non-finite). Either failure ends this step's updates.
        result.loss, result.grad_norm = hooks.global_loss(loss_sum), None
        if not math.isfinite(result.loss):
            learner.opt.zero_grad(set_to_none=True)
            hooks.skipped(u, result.loss)
            break
        with hooks.timed("backward"):
            hooks.reduce_gradients(params)
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
            if not hooks.optimizer_step(learner.opt, u, result.loss):
                break
        result.grad_norm = float(gnorm)
        result.updates.append(UpdateResult(u, result.loss, result.grad_norm, lr, stats_u))
    return result


def batch_stats(learner: Learner, parts: list[MicroBatch], r: Rollout, mask: torch.Tensor, adv: Advantages,
                logp: torch.Tensor, active_tokens: float, opts: LossOptions) -> GRPOStats:
    """The loss's diagnostics of a whole rollout batch from its micro-batches' log-probs (no grad: cheap)."""
    cat = lambda xs: None if xs[0] is None else torch.cat(xs)  # noqa: E731
    _, stats = grpo_loss(logp, mask.float(), adv, old_logp=cat([mb.old_logp for mb in parts]),
                         ref_logp=cat([mb.ref_logp for mb in parts]), num_active_tokens=active_tokens,
                         sampler_logp=r.out.logprobs, options=opts, backend=learner.backend)
    return stats
