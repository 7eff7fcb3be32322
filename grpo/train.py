"""GRPO training: ``python -m grpo.train --phase {warmup,A,B,C} [--key value ...]``.

What is implemented (read top to bottom: it is the algorithm)
-------------------------------------------------------------
Group Relative Policy Optimisation (DeepSeekMath's GRPO in TRL's loss conventions; kernels/
grpo_loss.py says where TRL's defaults differ from ours) for a
vision-language policy = frozen base (optionally NF4 4-bit) + rank-8 LoRA, run as the
staged, metric-gated curriculum of the staged-GRPO paper:

    warmup  R1-VL policy warm-up: SFT on worked reasoning (grpo/sft.py)
    A       stage 1 only, structure-heavy reward weights, from warmup:latest
    B       stage 1 .7 + stage 2 .3, correctness-heavy, from A:best_structure
    C       stage 2 .6 + stage 3 .4, tolerance on, from B:best_composite

One GRPO step, for B prompts:
    1. sample   G completions per prompt; the prompt (and its image) is encoded once and
                its KV cache copied G times (grpo/sampler.py)
    2. reward   verifier components (+ step / detail / rubric terms) weighted by the
                controller's current weights (grpo/rewards); with sampling.dynamic_sampling,
                groups without reward spread are dropped and the batch refilled from the
                stream (DAPO, grpo/dynamic_sampling.py)
    3. logp     completion log-probs under the policy (with grad) and, if beta > 0, the
                reference = the same model with LoRA switched off (grpo/logprobs.py)
    4. loss     group-normalised advantages, clipped ratio, k3 KL, aggregation -- one
                fused pass (kernels/grpo_loss.py: Triton on CUDA, PyTorch on CPU)
    5. step     backward into the LoRA parameters, clip, AdamW, schedule (an update that
                leaves a parameter non-finite is undone, like a NaN loss is skipped)
    3-5 run mu = optim.updates_per_batch times on the same rollouts (PPO epochs)
    6. log      one JSON line (eval/plots.py documents the format) + a progress bar
    every run.eval_every steps and at the end:
    7. eval     greedy decoding on a fixed held-out subset (eval/evaluate.py)
    8. gate     the controller changes reward weights only when those metrics say so
    9. save     atomic checkpoint + aliases latest / best_structure / best_correctness /
                best_composite (grpo/checkpoint.py)

Several updates per batch. With mu = 1 (the default, TRL's and the staged paper's setting)
the "old" policy is the current one detached and the ratio is 1 in value (its gradient is
not), so the clip never binds. With mu > 1 the first update still runs that way and keeps
its log-probs -- they are the sampling policy's, since nothing has been updated yet -- as
old_logp; updates 2..mu take the ratio against them and the clip binds (logged per update:
clip fractions, kl_old = approximate KL of the current policy to the sampling one). This
costs no extra forward pass (TRL runs one without grad at sampling time), rewards and the
reference log-probs are computed once per batch, and on a CPU, where rollouts dominate, it
buys mu updates per rollout. A "step" (phase.steps, eval_every, checkpoints, the log line)
is a rollout batch; the learning-rate schedule counts optimiser steps (lr_at). A merged
rollout copy is refreshed once after the batch's last update: only sampling reads it.
Every combination has a ratio to clip: all four aggregations, token and sequence (GSPO)
importance, the V-Rubrics prefix mode (token advantages, per-token ratio); the policy runs
in eval mode (grpo/policy.py), so no dropout makes two passes of one policy differ.

Simplified: no value model (that is GRPO's point); evaluation is greedy with one sample per
prompt, the staged paper's final protocol.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpo.config import (
    PHASE_INIT,
    PHASES,
    PERCEPTION_DEFAULTS,
    PRESETS,
    WARMUP_DEFAULTS,
    ConfigError,
    TrainConfig,
    apply_overrides,
    describe_fields,
    parse_override_args,
    phase_preset,
    trains_from_scratch,
)

# ----------------------------------------------------------------------------- small helpers

GEN_KEY = "sampler_generator_state"  # checkpoint tensor: the rollout sampler's torch.Generator state


class TrainingDiverged(RuntimeError):
    """Losses stayed non-finite: the run stops (main() prints one line, exit code 1)."""


class NoRewardSpread(RuntimeError):
    """Dynamic sampling found no group with reward spread within its bound (one line, exit code 1)."""


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


class Progress:
    """A one-line progress bar on a terminal; plain periodic lines otherwise (CI logs)."""

    def __init__(self, total: int, label: str, start: int = 0):
        self.total, self.label, self.t0, self.start = max(1, total), label, time.time(), start
        self.tty = sys.stderr.isatty()

    def update(self, done: int, info: str = "") -> None:
        if not self.tty:
            return
        frac = done / self.total
        rate = (done - self.start) / max(1e-9, time.time() - self.t0)
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        sys.stderr.write(f"\r{self.label} [{bar}] {done}/{self.total} eta {eta:4.0f}s {info}   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


@dataclass
class RunFiles:
    """Where a run writes: <run_dir>/config_<phase>.json, train_log.jsonl, <phase>/step_N."""

    root: Path
    writer: bool = True  # False on ranks > 0 of a data-parallel run: rank 0 writes the log

    @property
    def log(self) -> Path:
        return self.root / "train_log.jsonl"

    def write_log(self, record: dict) -> None:
        if not self.writer:
            return
        with self.log.open("a") as f:
            f.write(json.dumps(record) + "\n")


def set_threads(n: int) -> None:
    if n > 0:
        torch.set_num_threads(n)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class StepGuard:
    """Parameters and optimiser state from before an optimiser step, put back if the step
    left a parameter non-finite.

    The loss guard cannot see this: a finite loss with lr=1e30, or an overflow inside
    AdamW, still turns the adapter into NaN, and every later step (and checkpoint) would
    carry it. Costs one copy of the trained tensors and their moments per step.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.opt = opt

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


def diverged(phase: str, step: int, cfg: TrainConfig, files: "RunFiles") -> TrainingDiverged:
    return TrainingDiverged(f"phase {phase}: 3 non-finite losses or updates in a row at step {step}; lower "
                            f"--optim.lr (now {cfg.optim.lr}) or check the rewards; the last good "
                            f"checkpoint is in {files.root / phase}")


# ----------------------------------------------------------------------------- data


def load_training_data(cfg: TrainConfig) -> tuple[dict[int, list], dict[int, list]]:
    """(train, val) examples per curriculum stage. Refuses data without gold answers."""
    from data.mathvista import require_gold_answers

    stages = sorted(cfg.phase.mixture) if cfg.phase.name != "warmup" else [1, 2, 3]
    if cfg.run.data == "synthetic":
        from data.synthetic import generate

        n_val = max(cfg.run.eval_size, 8)
        train = {s: generate("train", s, cfg.run.train_per_stage, cfg.run.seed, cfg.model.image_size) for s in stages}
        val = {s: generate("val", s, n_val, cfg.run.seed, cfg.model.image_size) for s in stages}
    else:
        from data.jsonl import load_jsonl
        from data.stages import select_stage

        try:
            rows, skipped = load_jsonl(cfg.run.data, return_skipped=True)
            lost = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
            if not rows:
                raise ValueError(f"{cfg.run.data} has no usable rows" + (f": {sum(skipped.values())} skipped ({lost})"
                                                                        if skipped else " (data.jsonl is empty)"))
            # The stage filters keep numeric gold answers only, so rows with an empty answer
            # would vanish without a word (MathVista `test` is all such rows): name them.
            if any(not str(ex.answer).strip() for ex in rows):
                require_gold_answers(rows, cfg.run.data)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--run.data: {err}") from None
        if skipped:
            print(f"data: {sum(skipped.values())} rows of {cfg.run.data} skipped ({lost}); training on {len(rows)}")
        train = {s: select_stage(rows, s) for s in stages}
        # Hold out a deterministic tail of each stage for the checkpoint-side eval.
        val = {}
        for s in stages:
            k = min(len(train[s]) // 5, cfg.run.eval_size)
            train[s], val[s] = train[s][: len(train[s]) - k], train[s][len(train[s]) - k:]
    for s in stages:
        if not train[s]:
            raise ConfigError(f"stage {s} has no training examples in {cfg.run.data!r} (the stage filters keep "
                              f"numeric free-form English rows); drop it from --phase.mixture or use other data")
        # The staged paper trained on MathVista `test`, whose answers are empty: its
        # correctness reward was silently 0 on every step. Refuse, loudly.
        require_gold_answers(train[s], f"{cfg.run.data} stage {s}")
    return train, val


def eval_subset(cfg: TrainConfig, val: dict[int, list]) -> list:
    """A fixed held-out subset, split over the phase's stages by the mixture weights."""
    mix = cfg.phase.mixture if cfg.phase.name != "warmup" else {s: 1.0 for s in val}
    total = sum(mix.values())
    out = []
    for s, p in sorted(mix.items()):
        out += val[s][: max(1, round(cfg.run.eval_size * p / total))]
    return out


# ----------------------------------------------------------------------------- eval + checkpoint


def checkpoint_eval(bundle, examples, cfg: TrainConfig, dp=None):
    from eval.evaluate import EvalProtocol
    from grpo.evaluate import evaluate_model

    protocol = EvalProtocol(max_new_tokens=cfg.sampling.max_new_tokens, temperature=0.0,
                            seed=cfg.run.seed, batch_size=64)
    if dp is not None and dp.enabled:  # prompts split over ranks, completions gathered (grpo/distributed.py)
        return dp.evaluate(bundle, examples, protocol)
    return evaluate_model(bundle, examples, protocol)


def print_eval(phase: str, step: int, result) -> None:
    from eval.report import control_summary

    m, iv = result.metrics, result.overall.intervals
    parts = []
    for key, short in (("parseable_rate", "parse"), ("exact_match", "EM"), ("solution_tag_rate", "sol"),
                       ("reasoning_tag_rate", "reas"), ("truncation_rate", "trunc")):
        lo, hi = iv.get(key, (float("nan"), float("nan")))
        parts.append(f"{short} {m[key]:.3f} [{lo:.2f},{hi:.2f}]")
    s = result.scores
    print(f"[{phase} eval @ {step}] n={result.overall.n_prompts} " + "  ".join(parts)
          + f"  struct {s['structure']:.3f} corr {s['correctness']:.3f} comp {s['composite']:.3f}", flush=True)
    for line in control_summary(f"{phase} @ {step}", result):
        print(f"  {line}", flush=True)


# ----------------------------------------------------------------------------- warm-up (SFT)


def run_warmup(cfg: TrainConfig, files: RunFiles, device: str) -> None:
    """R1-VL policy warm-up. For the tiny model: all weights, a perception (caption) stage
    first, dense perception labels throughout, imperfect contract on purpose (grpo/sft.py)."""
    from data.mixture import MixtureStream
    from grpo.checkpoint import save_checkpoint
    from grpo.model import load_bundle
    from grpo.perception import PerceptionHead
    from grpo.policy import base_tensors
    from grpo.sft import SFTStyle, build_sft_batch, caption_batch, warmup_losses, warmup_target

    train, val = load_training_data(cfg)
    dtype = getattr(torch, cfg.model.dtype)
    bundle = load_bundle(cfg.model.name, dtype=dtype, device=device, seed=cfg.run.seed)
    model = bundle.model
    # The embedded model (or any directory build_tiny_model wrote) starts from random weights.
    tiny = cfg.model.name == "tiny" or (Path(cfg.model.name) / "vlgrpo_build.json").is_file()
    if not tiny:  # a pretrained model: warm up a LoRA, keep the contract strict
        from grpo.policy import build_policy

        bundle = build_policy(cfg, device)
        model = bundle.model
    head = None
    if tiny and cfg.optim.perception_weight > 0:
        if not any(ex.marks for s in train for ex in train[s]):  # a family may draw none (geometry)
            raise ConfigError(f"--run.data {cfg.run.data}: the examples carry no renderer marks, so the perception "
                              f"loss has no labels; use the synthetic curriculum or set --warmup.optim.perception_weight 0")
        torch.manual_seed(cfg.run.seed)
        head = PerceptionHead(model.config.text_config.hidden_size).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    visual = {id(p) for n, p in model.named_parameters() if ".visual." in f".{n}"}
    groups = [{"params": [p for p in params if id(p) not in visual], "lr_scale": 1.0},
              {"params": [p for p in params if id(p) in visual], "lr_scale": cfg.optim.vision_lr_scale},
              {"params": list(head.parameters()) if head is not None else [], "lr_scale": 1.0}]
    params += [p for p in groups[2]["params"]]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    style = SFTStyle() if tiny else None
    rng = random.Random(cfg.run.seed)
    stream = MixtureStream(train, cfg.phase.mixture, cfg.run.seed)  # the warm-up's own stage mixture
    B, P = cfg.phase.prompts_per_step, cfg.phase.perception_steps if tiny else 0
    print(f"warm-up: {P} perception steps on image captions, then {cfg.phase.steps} SFT steps on worked "
          f"reasoning, x {B} examples ({'all weights, perception labels ' + ('on' if head else 'off') + ', imperfect contract on purpose' if tiny else 'LoRA'})",
          flush=True)
    guard = StepGuard([(n, p) for n, p in model.named_parameters() if p.requires_grad], opt)
    bad_streak = 0
    model.train()
    # Two stages, one loop: step k < P is a caption step (lr warm-up, then constant), the
    # rest are worked-reasoning steps on their own schedule (lr_at: warm-up, then linear decay).
    bar = Progress(P + cfg.phase.steps, "warmup")
    for k in range(P + cfg.phase.steps):
        t0 = time.time()
        stage, step = ("perception", k) if k < P else ("sft", k - P)
        if stage == "perception":
            examples = stream.next_batch(B)
            batch = caption_batch(bundle, examples)
            lr = cfg.optim.lr * min(1.0, (step + 1) / max(1, cfg.optim.warmup_steps))
        else:
            examples = stream.next_batch(B)
            batch = build_sft_batch(bundle, examples, [warmup_target(e, rng, style) for e in examples])
            lr = lr_at(step, cfg)
        batch = {key: v.to(device) for key, v in batch.items()}
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        lm_loss, perc_loss = warmup_losses(model, batch, examples, head)
        loss = lm_loss if perc_loss is None else lm_loss + cfg.optim.perception_weight * perc_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
        guard.before()
        opt.step()
        bad = guard.non_finite()
        if bad:  # a NaN loss or an overflowing update: keep the weights of before the step
            guard.restore()
            bad_streak += 1
            files.write_log(dict(event="nan", phase="warmup", step=k + 1, loss=str(loss.item()), params=bad[:5]))
            print(f"[warmup {k + 1}] non-finite update ({len(bad)} tensors, e.g. {bad[0]}): step undone "
                  f"({bad_streak} in a row)")
            if bad_streak >= 3:
                raise diverged("warmup", k + 1, cfg, files)
        else:
            bad_streak = 0
        record = dict(phase="warmup", step=k + 1, stage=stage, sft_loss=lm_loss.item(), grad_norm=float(gnorm),
                      lr=lr, time=dict(step=time.time() - t0))
        if perc_loss is not None:
            record["perception_loss"] = perc_loss.item()
        files.write_log(record)
        info = (f"{'captions' if stage == 'perception' else 'reasoning'}: lm loss {lm_loss.item():.3f}"
                + (f", perception loss {perc_loss.item():.3f}" if perc_loss is not None else ""))
        bar.update(k + 1, info)
        if (k + 1) % cfg.run.log_every == 0 and not bar.tty:
            print(f"[warmup {k + 1}/{P + cfg.phase.steps}] {info}", flush=True)
    bar.close()
    model.eval()
    done = P + cfg.phase.steps  # the checkpoint's step counts every optimiser step, captions included
    result = checkpoint_eval(bundle, eval_subset(cfg, val), cfg)
    print_eval("warmup", done, result)
    files.write_log(dict(event="eval", phase="warmup", step=done, metrics=result.flat()))
    from grpo.policy import adapter_tensors
    from lora import lora_state_dict

    tensors = base_tensors(model) if tiny else adapter_tensors(lora_state_dict(model))
    save_checkpoint(files.root, "warmup", done, tensors=tensors, optimizer=None,
                    scheduler_state={"step": done}, controller_state={}, data_position=0,
                    metrics=result.flat(), scores=result.scores, config_json=cfg.to_json(),
                    extra={"kind": "base" if tiny else "adapter", "base": None})


# ----------------------------------------------------------------------------- GRPO phases


def resolve_init(cfg: TrainConfig, files: RunFiles) -> tuple[Path | None, str]:
    """The checkpoint a phase starts from (None = the configured model as is)."""
    from grpo.checkpoint import resolve

    init = PHASE_INIT[cfg.phase.name] if cfg.phase.init == "auto" else cfg.phase.init
    if init == "base":
        return None, init
    return resolve(files.root, init), init


def advantage_kwargs(rb, cfg: TrainConfig, dp, device: str) -> dict:
    """The advantage source of one micro-batch, as kernels.grpo_loss keyword arguments.

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
    """
    if cfg.rewards.rubric_mode == "prefix" and rb.prefix is not None:
        from kernels.grpo_loss import PrefixRubrics

        p = rb.prefix
        prefix = PrefixRubrics(R_ans=p.R_ans.to(device), s=p.s.to(device), scored=p.scored.to(device),
                               rho=p.rho.to(device), t_end=p.t_end.to(device), a=cfg.rewards.prefix_answer_weight)
        _, scale = dp.advantage_inputs(rb.total.to(device), cfg.optim.adv_scale)
        return dict(prefix=prefix, scale=scale, adv_std_floor=cfg.optim.adv_std_floor)
    names = [k for k, w in rb.weights.items() if w > 0]
    if cfg.optim.adv_mode == "components" and names:
        values = torch.stack([rb.components[k] for k in names], 1).to(device)
        w = torch.tensor([rb.weights[k] for k in names], dtype=torch.float32)
        values, scale = dp.advantage_inputs(values, cfg.optim.adv_scale, std_floor=cfg.optim.adv_std_floor)
        return dict(reward_components=values, component_weights=(w / w.sum()).to(device), scale=scale,
                    adv_std_floor=_floor_left(cfg, scale))
    values, scale = dp.advantage_inputs(rb.total.to(device), cfg.optim.adv_scale,  # batch std over ranks
                                        std_floor=cfg.optim.adv_std_floor)
    return dict(rewards=values, scale=scale, adv_std_floor=_floor_left(cfg, scale))


def _floor_left(cfg: TrainConfig, scale: str) -> float:
    """The std floor still to apply: none once the data-parallel batch std (floored) was divided out."""
    return cfg.optim.adv_std_floor if scale == cfg.optim.adv_scale else 0.0


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


def run_grpo_phase(cfg: TrainConfig, files: RunFiles, device: str, dp=None) -> None:
    from grpo.sampler import content_tokens
    from grpo.distributed import DataParallel
    from grpo.checkpoint import load_checkpoint, restore_rng, resume_point, save_checkpoint
    from grpo.controller import Controller
    from grpo.logprobs import completion_logprobs, reference_logprobs
    from grpo.model import encode_prompts
    from grpo.policy import adapter_tensors, base_checkpoint_of, build_policy
    from grpo.rewards import RewardModel
    from grpo.rollout_fast import MergedRollout
    from grpo.dynamic_sampling import Rollout, fill_batch, groups_with_spread, no_spread_message
    from grpo.sampler import sample
    from kernels.grpo_loss import grpo_loss
    from lora import disable_adapters, load_lora_state_dict, lora_parameters, lora_state_dict
    from data.mixture import MixtureStream

    phase = cfg.phase.name
    dp = dp if dp is not None else DataParallel(device=device)  # world 1 unless under torchrun
    dp.check_batch(cfg.phase.prompts_per_step, cfg.optim.adv_scale, cfg.rewards.rubric_mode == "prefix",
                   dynamic_sampling=cfg.sampling.dynamic_sampling)
    gen_key = dp.generator_key(GEN_KEY)  # each rank saves and restores its own sampler generator
    # --- where this phase starts: same-phase resume, or the preset's checkpoint alias
    # the newest intact checkpoint; damaged newer ones are set aside (renamed, not deleted) and named
    resume, damaged = resume_point(files.root, phase, set_aside=dp.is_main)
    for bad_step, why in damaged:
        print(f"phase {phase}: checkpoint step {bad_step} is damaged, skipped and set aside ({why})")
        files.write_log(dict(event="damaged_checkpoint", phase=phase, step=bad_step, error=why))
    if resume is not None and resume.step >= cfg.phase.steps:
        print(f"phase {phase} already finished at step {resume.step} in {files.root}; "
              f"raise --phase.steps to continue it, or use a new --run.run_dir")
        return
    if resume is not None:  # continue on the base this phase was trained on, whatever --init says now
        init_path, init_name, init_ckpt = resume.path, f"{phase}:latest", resume
    else:
        init_path, init_name = resolve_init(cfg, files)
        init_ckpt = load_checkpoint(init_path) if init_path is not None else None
    base_ckpt = base_checkpoint_of(files.root, init_ckpt) if init_ckpt is not None else None

    # --- model: base (+ warm-up weights) -> 4-bit -> LoRA; warm-start the adapter
    bundle = build_policy(cfg, device, base_ckpt)
    model = bundle.model
    if resume is not None:
        load_lora_state_dict(model, adapter_tensors(resume.tensors))
    elif init_ckpt is not None and adapter_tensors(init_ckpt.tensors):
        load_lora_state_dict(model, adapter_tensors(init_ckpt.tensors))  # cross-phase warm start
    params = lora_parameters(model)
    dp.broadcast_parameters(params)  # all ranks start from rank 0's adapter
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    guard = StepGuard(list(zip(lora_state_dict(model), params)), opt)  # same order: A then B per layer
    # Rollouts through the policy's own 4-bit + LoRA layers, or from a merged bf16 copy
    # refreshed after every optimiser step (grpo/rollout_fast.py: ~2x fewer bytes per decode step).
    rollout = MergedRollout(model) if cfg.sampling.rollout == "merged" else None
    sample_fn = rollout.sample if rollout is not None else sample

    # --- data, rewards, controller
    train, val = load_training_data(cfg)
    stream = MixtureStream(train, cfg.phase.mixture, cfg.run.seed)
    eval_examples = eval_subset(cfg, val)
    rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
    rewards.validate([ex for s in train for ex in train[s]])
    controller = Controller(dict(cfg.rewards.weights), cfg.sampling.max_new_tokens,
                            temperature=cfg.sampling.temperature, phase=phase)
    start = 0
    if resume is not None:
        opt_state_loaded = load_checkpoint(resume.path, optimizer=opt)  # restores AdamW moments
        start = resume.step
        stream.load_state_dict({"position": resume.data_position, "seed": cfg.run.seed})
        controller.load_state_dict(resume.controller_state)
        restore_rng(opt_state_loaded.rng)
        if gen_key in resume.tensors:  # the sampler's own generator: resumed runs draw what a straight run draws
            gen_state = resume.tensors[gen_key]
        print(f"resuming phase {phase} at step {start} from {resume.path}")
    else:
        print(f"phase {phase}: starting from {init_name}" + (f" ({init_path})" if init_path else ""))
    if cfg.optim.lr == 0:  # config.validate accepts lr 0 in GRPO phases only, as this control
        print(f"phase {phase}: optim.lr = 0, the frozen-policy control: prompts are sampled, scored, logged, "
              "evaluated and checkpointed exactly as in training, and the policy is never updated")
    rewards.set_weights(controller.weights)
    G, L, B = cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step
    gen = torch.Generator(device=device).manual_seed(dp.sampling_seed(cfg.run.seed))
    if resume is not None and gen_key in resume.tensors:
        gen.set_state(gen_state)
    zero_spread_since_eval: list[float] = []
    nan_streak = 0
    bar = Progress(cfg.phase.steps, f"phase {phase}", start)

    mu = cfg.optim.updates_per_batch

    def draw(n: int) -> Rollout:
        """Sample G completions for each of the stream's next n prompts (this rank's share) and score them."""
        t0 = time.time()
        examples = dp.shard(stream.next_batch(n))  # n is global: this rank's n / world prompts
        prompts = encode_prompts(bundle, examples, on_bad_image="skip").to(device)
        out = sample_fn(bundle, prompts, G=G, max_new_tokens=L, temperature=temperature,
                        top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p, generator=gen)
        timing["sampling"] += time.time() - t0
        # ---- 2. reward: every completion of the group is scored against its prompt's example
        t0 = time.time()
        examples = [examples[i] for i in prompts.kept]
        ex_rows = [examples[row // G] for row in range(len(out.texts))]
        rb = rewards(ex_rows, out.texts, num_tokens=content_tokens(out), completion_ids=out.completion_ids)
        timing["rewards"] += time.time() - t0
        return Rollout(examples, out, rb)

    def spread(r: Rollout) -> list[int]:
        values, valid = spread_columns(r.rb, cfg)
        return groups_with_spread(values, G, valid=valid)

    for step in range(start, cfg.phase.steps):
        t_step = time.time()
        timing = dict(sampling=0.0, rewards=0.0, logprobs=0.0, backward=0.0)
        temperature = controller.temperature

        # ---- 1-2. sample B prompts x G completions and score them, every micro-batch first
        # (dapo needs the step's token count, dynamic sampling the rewards)
        batch = [draw(B) for _ in range(cfg.optim.accumulation)]
        fill = None
        if cfg.sampling.dynamic_sampling:  # DAPO: keep groups with reward spread, refill (grpo/dynamic_sampling.py)
            batch, fill = fill_batch(batch, draw, spread, B, cfg.sampling.max_refills, bundle.pad_token_id)
            if not batch:
                raise NoRewardSpread(no_spread_message(phase, step + 1, fill, G, temperature,
                                                       cfg.sampling.max_refills))
        # dapo divides by the active tokens of the whole step (every micro-batch of every rank);
        # share scales a micro-batch's loss to this rank's part of the global loss (1 on one process)
        active_tokens, shares = dp.loss_shares(cfg.optim.loss_type, [r.out.completion_mask for r in batch])
        adv_kwargs = [advantage_kwargs(r.rb, cfg, dp, device) for r in batch]  # the same for all mu updates

        # ---- 3-5. mu optimiser steps on these rollouts. Update 1 runs with old = the current
        # policy detached (ratio 1 in value, exactly as with mu = 1) and keeps its log-probs:
        # they ARE the sampling policy's (no update happened yet), so updates 2..mu take the
        # ratio against them at no extra forward pass. The reference log-probs do not change.
        ref_cache: list[torch.Tensor | None] = [None] * len(batch)
        old_cache: list[torch.Tensor | None] = [None] * len(batch)
        updates, logs = [], []
        for u in range(mu):
            lr = lr_at(step * mu + u, cfg)  # the schedule counts optimiser steps
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            stats_u, loss_sum = [], 0.0
            for k, (r, share) in enumerate(zip(batch, shares)):
                # ---- 3. log-probs: reference (LoRA off, no grad; once per batch) and policy (with grad)
                t0 = time.time()
                ids, mask, ctx = r.out.completion_ids, r.out.completion_mask, r.out.context
                if cfg.optim.beta > 0 and ref_cache[k] is None:
                    ref_cache[k] = reference_logprobs(model, ctx, ids, mask, G, temperature=temperature,
                                                      ref_context=lambda: disable_adapters(model))
                logp = completion_logprobs(model, ctx, ids, mask, G, temperature=temperature)
                timing["logprobs"] += time.time() - t0

                # ---- 4. loss: group-normalised advantages, clipped ratio against old, KL, aggregation
                t0 = time.time()
                loss, stats = grpo_loss(
                    logp, mask.float(), G=G, old_logp=old_cache[k],
                    ref_logp=ref_cache[k], beta=cfg.optim.beta, eps_low=cfg.optim.eps_low,
                    eps_high=cfg.optim.eps_high, loss_type=cfg.optim.loss_type, importance=cfg.optim.importance,
                    max_len=L, num_active_tokens=active_tokens, kl_bias_correction=cfg.optim.kl_bias_correction,
                    **adv_kwargs[k],
                )
                if u == 0 and mu > 1:
                    old_cache[k] = logp.detach()
                loss = loss * share
                if cfg.optim.loss_type != "dapo":  # dapo already divides by the whole batch's tokens
                    loss = loss / len(batch)

                # ---- 5. backward into the LoRA parameters
                if torch.isfinite(loss):
                    loss.backward()
                loss_sum += float(loss.detach())
                timing["backward"] += time.time() - t0
                stats_u.append(stats)
                if u == 0:
                    logs.append((r.rb, stats, r.out))

            loss_sum = dp.all_reduce_sum(loss_sum)  # the global loss: non-finite on any rank skips the step on all
            # NaN guard: skip the update (and this batch's later ones), log it, stop after three batches in a row.
            if not math.isfinite(loss_sum):
                nan_streak += 1
                opt.zero_grad(set_to_none=True)
                files.write_log(dict(event="nan", phase=phase, step=step + 1, loss=str(loss_sum),
                                     **({"update": u + 1} if mu > 1 else {})))
                print(f"[{phase} {step + 1}] non-finite loss {loss_sum}: update skipped ({nan_streak} in a row)")
                if nan_streak >= 3:
                    raise diverged(phase, step + 1, cfg, files)
                break
            t0 = time.time()
            dp.all_reduce_gradients(params)  # sum of the ranks' shares = the global batch's gradient
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
            guard.before()
            opt.step()
            bad = guard.non_finite(dp)
            if bad:  # a finite loss can still give a non-finite update: undo it, count it like a NaN loss
                guard.restore()
                nan_streak += 1
                files.write_log(dict(event="nan", phase=phase, step=step + 1, loss=loss_sum, params=bad[:5],
                                     **({"update": u + 1} if mu > 1 else {})))
                print(f"[{phase} {step + 1}] non-finite update ({len(bad)} tensors, e.g. {bad[0]}): parameters and "
                      f"optimiser state restored ({nan_streak} in a row)")
                if nan_streak >= 3:
                    raise diverged(phase, step + 1, cfg, files)
                break
            nan_streak = 0
            timing["backward"] += time.time() - t0
            # per update: the clip fractions and the KL to the sampling policy (0 at update 1 by
            # construction), averaged over micro-batches and ranks
            su = dp.mean_over_ranks({key: float(sum(float(getattr(x, f)) for x in stats_u) / len(stats_u))
                                     for key, f in (("clip_low", "clip_low_frac"), ("clip_high", "clip_high_frac"),
                                                    ("kl_old", "kl_old_mean"))})
            updates.append(dict(update=u + 1, loss=loss_sum, grad_norm=float(gnorm), lr=lr, **su))
        if rollout is not None and updates:
            rollout.refresh()  # the merged copy follows the new adapter (it is only read by the next sampling)

        # ---- 6. log: one JSON line per rollout batch (= per optimiser step when mu = 1)
        rb0 = logs[0][0]
        comps = {k: float(torch.cat([r.components[k] for r, _, _ in logs]).mean()) for k in rb0.components}
        totals = torch.cat([r.total for r, _, _ in logs])
        lengths = torch.cat([o.lengths.float() for _, _, o in logs])
        trunc = torch.cat([o.truncated.float() for _, _, o in logs])
        # averaged over ranks: the controller's zero-spread gate must see the same value on every rank
        st = dp.mean_over_ranks({k: float(sum(float(getattr(s, k)) for _, s, _ in logs) / len(logs))
                                 for k in ("kl_mean", "clip_low_frac", "clip_high_frac", "zero_spread_frac",
                                           "adv_abs_mean")})
        # With dynamic sampling the trained batch has no zero-spread group; the gate reads what was sampled.
        zero_spread_since_eval.append(fill.dropped_frac if fill is not None else st["zero_spread_frac"])
        record = dict(phase=phase, step=step + 1, reward=float(totals.mean()), components=comps,
                      weights=dict(rewards.weights), loss=loss_sum, kl=st["kl_mean"],
                      clip_low=st["clip_low_frac"], clip_high=st["clip_high_frac"],
                      zero_spread=st["zero_spread_frac"], adv_abs=st["adv_abs_mean"],
                      completion_len=float(lengths.mean()), truncation=float(trunc.mean()), lr=lr_at(step * mu, cfg),
                      temperature=temperature, grad_norm=float(gnorm) if nan_streak == 0 else None,
                      time=dict(timing, step=time.time() - t_step))
        if mu > 1:  # the first update's loss and stats above (on-policy); every update here
            record["loss"] = updates[0]["loss"] if updates else loss_sum
            record["updates"] = updates
        if fill is not None:
            record["dynamic"] = fill.to_dict()
        record = dp.mean_over_ranks(record)  # rank 0 logs the means over ranks
        files.write_log(record)
        bar.update(step + 1, f"reward {record['reward']:.2f} len {record['completion_len']:.0f}")
        if (step + 1) % cfg.run.log_every == 0:
            bar.close() if bar.tty else None
            print(f"[{phase} {step + 1}/{cfg.phase.steps}] reward {record['reward']:.3f}  "
                  + " ".join(f"{k} {v:.2f}" for k, v in record["components"].items())
                  + f"  len {record['completion_len']:.1f}  zero-spread {record['zero_spread']:.2f}"
                  + (f"  refills {fill.refills} fill {fill.fill:.2f}" if fill is not None else "")
                  + (f"  clip@{len(updates)} {updates[-1]['clip_low'] + updates[-1]['clip_high']:.3f}"
                     if mu > 1 and updates else "")
                  + f"  {record['time']['step']:.2f}s/step", flush=True)

        # ---- 7-9. eval -> gates -> checkpoint
        last = step + 1 == cfg.phase.steps
        if (step + 1) % cfg.run.eval_every == 0 or last:
            bar.close()
            result = checkpoint_eval(bundle, eval_examples, cfg, dp)
            print_eval(phase, step + 1, result)
            files.write_log(dict(event="eval", phase=phase, step=step + 1, metrics=result.flat()))
            if cfg.phase.controller:
                metrics = dict(result.metrics, zero_spread=float(np.mean(zero_spread_since_eval)))
                for d in controller.update(metrics, result.overall.intervals, n=result.overall.n_prompts):
                    print(f"  gate: {d}")
                    files.write_log(dict(event="gate", phase=phase, step=step + 1, rule=d.rule,
                                         changes={d.target: [d.old, d.new]}, decision=d.to_dict()))
                rewards.set_weights(controller.weights)
            zero_spread_since_eval = []
            dp.check_replicas(params)  # every rank must hold the adapter rank 0 is about to save
            tensors = dict(adapter_tensors(lora_state_dict(model)), **dp.generator_states(GEN_KEY, gen))
            if dp.is_main:
                save_checkpoint(files.root, phase, step + 1, tensors=tensors,
                                optimizer=opt, scheduler_state={"step": step + 1},
                                controller_state=controller.state_dict(), data_position=stream.position,
                                metrics=result.flat(), scores=result.scores, config_json=cfg.to_json(),
                                extra={"kind": "adapter",
                                       "base": str(base_ckpt.relative_to(files.root)) if base_ckpt else None})
            bar = Progress(cfg.phase.steps, f"phase {phase}", step + 1)
    bar.close()


# ----------------------------------------------------------------------------- phases and CLI


def phase_config(phase: str, preset: str, overrides: dict[str, str], requested: str) -> TrainConfig:
    """The resolved config of one phase: its preset, then --preset, then the CLI overrides.

    Overrides of phase.* and rewards.weights belong to the requested phase only (steps of
    phase B are not the warm-up's steps); every other override applies to all phases.
    """
    cfg = phase_preset(phase)
    if phase == "warmup":  # SFT defaults of the embedded model; a --preset may override them
        apply_overrides(cfg, WARMUP_DEFAULTS)
    apply_overrides(cfg, PRESETS[preset])
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


def prepare_run_dir(root: Path) -> None:
    """Create the run directory and prove it writable, before any work that would be lost."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--run.run_dir {root} is a file, not a directory: name a directory (it is created if missing)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"--run.run_dir {root}: a part of that path is a file, so the directory cannot be "
                          "created; name another directory") from None
    # os.access says yes to root on a read-only directory and no to some ACL'd ones: try it.
    probe = root / f".tmp-write-probe-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.unlink(probe)


def preflight(configs: dict[str, TrainConfig], plan: list[str], files: RunFiles) -> None:
    """Every check that can fail before a model is loaded: model and LoRA targets, the
    run directory's checkpoints (compatible, resumable, intact), the start checkpoint, data."""
    from grpo.checkpoint import (check_compatible, check_init_compatible, check_resumable, load_checkpoint,
                                 resume_point)
    from grpo.policy import check_policy_config

    first = configs[plan[0]]
    check_policy_config(first)  # model.name and lora.* are the same in every phase
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
            load_training_data(configs[phase])


def _phase_local(key: str) -> bool:
    """Keys that describe one phase (its length, batch, mixture, start, reward weights)."""
    key = key.replace("-", "_")
    return key.split(".")[0] == "phase" or key in ("rewards.weights", "weights", "steps", "prompts_per_step",
                                                   "mixture", "init", "controller")


def phases_to_run(requested: str, files: RunFiles, init: str) -> list[str]:
    """The requested phase, preceded by every earlier phase whose checkpoint is missing."""
    from grpo.checkpoint import read_registry

    order = list(PHASES[: PHASES.index(requested) + 1])
    if init != "auto" or read_registry(files.root, requested).get("aliases"):  # explicit start, or a resume
        return [requested]
    plan = [requested]
    for phase in reversed(order[:-1]):
        need = PHASE_INIT[plan[0]].split(":")[0]
        if need != phase or read_registry(files.root, phase).get("aliases"):
            break
        plan.insert(0, phase)
    return plan


HELP = """\
python -m grpo.train --phase {warmup,A,B,C} [--preset tiny|qwen7b] [--init base|SELECTOR|PATH] [--key value ...]

Phases (the staged, metric-gated curriculum):
  warmup  R1-VL policy warm-up: SFT on worked reasoning (for the embedded tiny model it also
          teaches perception and leaves an imperfect, partly-compliant base on purpose)
  A       GRPO on stage 1, structure-heavy weights; starts from warmup:latest
  B       GRPO on stage 1 (.7) + stage 2 (.3), correctness-heavy; starts from A:best_structure
  C       GRPO on stage 2 (.6) + stage 3 (.4), tolerance on; starts from B:best_composite
A phase whose starting checkpoint is missing from the run directory runs the earlier phases
first, so `python -m grpo.train --phase B` runs warm-up, A and B. --init overrides the start:
'base' (the model as loaded), a selector such as A:best_structure, or a checkpoint path.
The same run directory resumes: the adapter, optimiser, schedule, controller, RNG and data
position of <phase>:latest are restored.

Options (--section.key VALUE, or --key VALUE where the key is unique). phase.* keys and
rewards.weights apply to the requested phase only; prefix a key with a phase name to set it
for that phase alone, e.g. --warmup.phase.steps 100 --A.optim.lr 1e-3:
"""


def main(argv: list[str] | None = None) -> int:
    """The CLI. Every error the project raises on purpose ends as one line on stderr:
    exit 2 when the request is wrong (config, selector, model name, data), exit 1 when the
    run failed (a checkpoint, divergence, the run directory's disk). Anything else is a bug
    and keeps its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from grpo.checkpoint import CheckpointError, SelectorError
    from grpo.model import ModelLoadError
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model load is noise in a training log
    if "-h" in argv or "--help" in argv:
        print(HELP + describe_fields())
        return 0
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--phase", default="B", choices=PHASES)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--init", default="auto")
    known, rest = ap.parse_known_args(argv)
    dp, root = None, None
    try:
        overrides = parse_override_args(rest)
        configs = phase_configs(known.phase, known.preset, overrides, known.init)
        cfg = configs[known.phase]
        files = RunFiles(Path(cfg.run.run_dir))
        root = files.root
        device = pick_device(cfg.model.device)
        prepare_run_dir(files.root)
        from grpo.distributed import init_distributed

        dp = init_distributed(device)  # torchrun: this rank's process group and device; else one process
        device, files.writer = dp.device, dp.is_main
        plan = phases_to_run(known.phase, files, cfg.phase.init) if cfg.run.run_prior_phases else [known.phase]
        preflight(configs, plan, files)
        if len(plan) > 1:
            print(f"phase {known.phase} starts from {PHASE_INIT[known.phase]}, which {files.root} does not have "
                  f"yet: running {' -> '.join(plan)}")
        t_run = time.time()
        for phase in plan:
            pcfg = configs[phase]
            dp.barrier()  # every rank has read the run directory (and rank 0 finished writing it)
            print(f"\n===== phase {phase} =====\nresolved config:\n{pcfg.to_json()}", flush=True)
            if dp.is_main:
                (files.root / f"config_{phase}.json").write_text(pcfg.to_json())
            seed_everything(pcfg.run.seed)
            set_threads(pcfg.run.cpu_threads)
            t_phase = time.time()
            if phase == "warmup":
                from grpo.checkpoint import read_registry

                if read_registry(files.root, "warmup").get("aliases"):
                    print("warm-up already done in this run directory; skipping")
                elif dp.is_main:  # the SFT warm-up is not data-parallel: rank 0 runs it, the others wait
                    run_warmup(pcfg, files, device)
            else:
                run_grpo_phase(pcfg, files, device, dp)
            print(f"phase {phase} took {time.time() - t_phase:.0f}s", flush=True)
        if dp.is_main and known.phase != "warmup" and cfg.run.test_per_stage > 0 and cfg.run.data == "synthetic":
            from grpo.final_report import write_final_report

            write_final_report(files.root, known.phase, cfg, device)
        print(f"done in {time.time() - t_run:.0f}s; checkpoints and train_log.jsonl in {files.root}")
    except (ConfigError, SelectorError, ModelLoadError) as err:  # the command asks for something wrong: say what
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    except (CheckpointError, TrainingDiverged, NoRewardSpread) as err:  # the run failed; its earlier checkpoints are intact
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 1
    except OSError as err:
        if root is None or not _inside(err.filename, root):
            raise  # not the run directory's disk: a bug or an environment problem, keep the traceback
        why = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else err.strerror or str(err)
        print(f"error: cannot write to the run directory {root} ({why}: {err.filename}); "
              "fix its permissions or free space, or use another --run.run_dir", file=sys.stderr)
        return 1
    finally:
        if dp is not None:
            dp.close()
    return 0


def _one_line(err: BaseException) -> str:
    """A message on one line: the selector errors list a run's phases on several."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _inside(filename: object, root: Path) -> bool:
    if not isinstance(filename, (str, os.PathLike)):
        return False
    try:
        return Path(filename).resolve().is_relative_to(root.resolve())
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
