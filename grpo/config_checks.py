"""What a configuration may hold: every check of a TrainConfig, made before anything loads.

``validate_config`` (what ``TrainConfig.validate`` runs) rejects an impossible value with one
line that names the field and the fix, section by section; ``check_weights``,
``plugin_target`` and ``overlong_buffer`` check the reward spec (grpo/rewards reads them
too). The functions take a grpo.config.TrainConfig, which grpo/config.py defines and this
module does not import: grpo/config.py imports it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import typing
from pathlib import Path
from typing import Any

from data.rows import FIELDS as ROW_FIELDS
from data.stages import ALL
from grpo.batches import micro_batch_rows_fit
from grpo.errors import ConfigError
from grpo_kernels.grpo_advantages import SCALES
from grpo_kernels.grpo_loss import CORRECTION_MODES, CORRECTIONS, IMPORTANCE, KL_ESTIMATORS, LOSS_TYPES

PHASES = ("warmup", "A", "B", "C")  # the curriculum, in order (grpo/config.py PHASE_DEFAULTS: one entry each)

# run.report_to's trackers: name -> (the module imported, the package that provides it);
# mlflow-skinny is MLflow's client and file store without its server's dependencies.
REPORT_TO = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow-skinny")}


def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


# Reward components a rewards.weights dict may name: the six verifier terms of the staged
# paper (grpo/rewards/verifier.py), R1-VL's StepRAR / StepRVR, RewardMap's detail reward,
# the V-Rubrics rubric score, this project's arithmetic check and DAPO's soft overlong
# punishment. Defined here, below grpo/rewards, which imports this module.
KNOWN_COMPONENTS = ("format", "parseable", "finished", "correctness", "tolerance", "brevity",
                    "step_rar", "step_rvr", "detail", "rubric", "arithmetic", "overlong")


def check_weights(weights: Any, tolerance: bool, plugins: Any = ()) -> dict[str, float]:
    """The reward spec as a plain dict, or a ConfigError that names the bad entry.
    ``plugins``: the names of rewards.extra, which a weight may name beside the built-ins."""
    known = KNOWN_COMPONENTS + tuple(plugins)
    if not isinstance(weights, dict) or not weights:
        raise ConfigError(f"rewards.weights={weights!r}: give a non-empty dict component -> weight, "
                          f"components: {', '.join(known)}")
    out = {}
    for name, w in weights.items():
        if name not in known:
            plug = ", or a plug-in of --rewards.extra NAME=module:function" if not plugins else ""
            raise ConfigError(f"rewards.weights names unknown component {name!r}: "
                              f"known components are {', '.join(known)}{plug}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"rewards.weights[{name!r}]={w!r}: give a finite number")
        if w < 0:
            raise ConfigError(f"rewards.weights[{name!r}]={w}: weights must be >= 0 (components carry their own "
                              f"sign; a negative weight would reward the penalty). Use 0 to switch it off")
        out[name] = float(w)
    if out.get("tolerance", 0.0) > 0 and not tolerance:
        raise ConfigError(f"rewards.weights['tolerance']={out['tolerance']} but rewards.tolerance is false, so "
                          f"the component is always 0: set --rewards.tolerance true or the weight to 0")
    return out


# A plug-in's NAME becomes a key of rewards.weights, of the log line's components and of
# TensorBoard's tags, so it is kept to a plain identifier.
_PLUGIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def plugin_target(name: Any, spec: Any) -> tuple[str, str]:
    """(module, attribute) of one rewards.extra entry NAME=module:function, or a ConfigError.
    Syntax only: grpo/rewards/plugins.py imports it."""
    if not isinstance(name, str) or not _PLUGIN_NAME.fullmatch(name):
        raise ConfigError(f"rewards.extra names a plug-in {name!r}: give a name of letters, digits and _ "
                          f"(it becomes a reward component), e.g. --rewards.extra short=my_rewards:short")
    if name in KNOWN_COMPONENTS:
        raise ConfigError(f"rewards.extra names plug-in {name!r}, which is a built-in reward component: give the "
                          f"plug-in another name (built-ins: {', '.join(KNOWN_COMPONENTS)})")
    module, _, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module.strip() or not attr.strip():
        raise ConfigError(f"rewards.extra {name}={spec!r}: write NAME=module:function, e.g. "
                          f"{name}=my_rewards:{name} (the module importable from the current directory or PYTHONPATH)")
    return module.strip(), attr.strip()


def overlong_buffer(rewards: Any, max_new_tokens: int) -> int:
    """L_cache of DAPO's soft overlong punishment (grpo/rewards/overlong.py) for a budget of
    ``max_new_tokens``, or a ConfigError naming the bad value: rewards.overlong_buffer, or
    for 0 a fifth of the budget (DAPO's 4096 of 20480 tokens), at least one token."""
    buffer = rewards.overlong_buffer or max(1, max_new_tokens // 5)
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 1 <= buffer <= max_new_tokens:
        raise ConfigError(f"rewards.overlong_buffer={rewards.overlong_buffer!r}: give the number of tokens before "
                          f"sampling.max_new_tokens={max_new_tokens} over which the penalty ramps in, an int in "
                          f"1..{max_new_tokens} (0 = a fifth of the budget)")
    penalty = rewards.overlong_penalty
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not (math.isfinite(penalty) and penalty > 0):
        raise ConfigError(f"rewards.overlong_penalty={penalty!r}: give a finite number > 0 (1 = DAPO's penalty, "
                          f"-1 at the budget; switch the component off with rewards.weights overlong=0 instead)")
    return buffer


def trains_from_scratch(name: str) -> bool:
    """'tiny-random', or a directory build_tiny_model wrote: random weights to start (the
    shipped 'tiny' is pretrained and trains like any pretrained model)."""
    return name == "tiny-random" or (Path(name) / "vlgrpo_build.json").is_file()


# ----------------------------------------------------------------------------- the whole config


def validate_config(cfg: Any) -> Any:
    """Reject impossible values with one line that names the field and the fix (TrainConfig.validate).

    Everything a run will use is checked here, before anything is loaded or written:
    a bad value found after a 10-minute warm-up is a bad value found too late.
    """
    check_types_and_finite(cfg)
    checks = (_phase_sampling_and_adapter_checks(cfg) + _learning_rate_checks(cfg) + _loss_checks(cfg)
              + _sampling_checks(cfg) + _model_and_reward_checks(cfg) + _phase_and_run_checks(cfg))
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    _check_rewards(cfg)
    return cfg


def _check_rewards(cfg: Any) -> None:
    """The reward spec: plug-in targets, the overlong buffer, and in a GRPO phase the weights."""
    s, ru, grpo = cfg.sampling, cfg.rewards, cfg.phase.name != "warmup"
    for name, spec in ru.extra.items():
        plugin_target(name, spec)
    overlong_buffer(ru, s.max_new_tokens)
    if grpo:  # the warm-up is SFT: it has no rewards
        weights = check_weights(ru.weights, ru.tolerance, ru.extra)
        unweighted = [name for name in ru.extra if name not in weights]
        if unweighted:
            raise ConfigError(f"rewards.extra names plug-in {unweighted[0]!r} but rewards.weights gives it no weight: "
                              f"add {unweighted[0]}=1 to rewards.weights (the command line does this by itself)")
        if not any(w > 0 for w in weights.values()):
            raise ConfigError(f"rewards.weights={ru.weights}: every weight is 0, so every reward and advantage is 0 "
                              "and nothing is learned; give at least one component a positive weight")


def _phase_sampling_and_adapter_checks(cfg: Any) -> list[tuple[bool, str]]:
    """The phase, the group, the sampler's knobs and the adapters."""
    s, p, m, lo = cfg.sampling, cfg.phase, cfg.model, cfg.lora
    grpo = cfg.phase.name != "warmup"
    checks = [
        (p.name in PHASES, f"phase.name={p.name!r}: use one of {', '.join(PHASES)}"),
        # The advantage is a reward minus its group's mean: a group of one has advantage 0
        # on every step, lora_B stays 0 and the run "succeeds" having learned nothing.
        (not grpo or s.G >= 2, f"sampling.G={s.G}: GRPO phase {p.name} needs a group of >= 2 completions per "
                               "prompt (the advantage is a reward minus its group's mean; with one there is no group)"),
        (s.G >= 1, f"sampling.G={s.G}: the group size must be >= 1"),
        (s.max_new_tokens >= 1, f"sampling.max_new_tokens={s.max_new_tokens}: must be >= 1"),
        (s.temperature > 0, f"sampling.temperature={s.temperature}: must be > 0"),
        (isinstance(s.temperature_max, (int, float)) and 0 < s.temperature_max <= 5,
         f"sampling.temperature_max={s.temperature_max}: must be a number in (0, 5] (the highest temperature the "
         "controller's vanishing-advantage gate raises sampling to; 1.2 by default)"),
        (0 < s.top_p <= 1, f"sampling.top_p={s.top_p}: must be in (0, 1]"),
        (s.rollout in ("plain", "merged"), f"sampling.rollout={s.rollout!r}: use plain or merged"),
        (s.top_k >= 0, f"sampling.top_k={s.top_k}: must be >= 0 (0 = off)"),
        (lo.rank >= 1, f"lora.rank={lo.rank}: must be >= 1"),
        (lo.alpha > 0, f"lora.alpha={lo.alpha}: must be > 0 (the update is alpha / rank * B A x)"),
        (0 <= lo.dropout < 1, f"lora.dropout={lo.dropout}: must be in [0, 1)"),
        (bool(lo.targets) and all(t.strip() for t in lo.targets),
         f"lora.targets={','.join(lo.targets)!r}: name at least one module suffix, e.g. q_proj,v_proj"),
        (lo.dtype in ("float32", "bfloat16", "float16"), f"lora.dtype={lo.dtype!r}: use float32 or bfloat16"),
        (not lo.vision or (bool(lo.vision_targets) and all(t.strip() for t in lo.vision_targets)),
         f"lora.vision_targets={','.join(lo.vision_targets)!r}: name at least one module suffix inside the vision "
         f"blocks, e.g. attn.qkv,mlp.down_proj (or turn lora.vision off)"),
        # A from-scratch warm-up trains every weight of the tower itself (optim.vision_lr_scale):
        # there is no frozen tower for an adapter to sit on.
        (not (p.name == "warmup" and trains_from_scratch(m.name) and (lo.vision or lo.merger)),
         f"lora.vision / lora.merger on the warm-up of {m.name!r}: a model trained from scratch trains every "
         f"weight of its vision tower and merger already (at optim.vision_lr_scale x lr); turn them off for the "
         f"warm-up (--warmup.lora.vision false --warmup.lora.merger false)"),
        # The ratio compares the trainer's log-probs with the sampler's: with dropout in the
        # training pass the two would be different functions of the same weights.
        (not (grpo and lo.dropout > 0),
         f"lora.dropout={lo.dropout}: GRPO phase {p.name} scores completions with the sampler's own function "
         f"(the importance ratio compares the two), and dropout would make them differ; use 0 in GRPO phases "
         f"(--warmup.lora.dropout applies to the SFT warm-up alone)"),
    ]
    return checks


def _learning_rate_checks(cfg: Any) -> list[tuple[bool, str]]:
    """The learning rates and what the warm-up trains."""
    o, p, m, lo = cfg.optim, cfg.phase, cfg.model, cfg.lora
    grpo = cfg.phase.name != "warmup"
    checks = [
        # lr 0 is the frozen-policy control of a GRPO phase (bench/learning.py): the same
        # prompts, samples, rewards, log lines, evals and checkpoints as a training run, with
        # a policy that never moves -- the baseline a training curve is read against. The
        # warm-up has no rewards to log, so there lr 0 is only a run that does nothing.
        (o.lr > 0 or (grpo and o.lr == 0),
         f"optim.lr={o.lr}: must be > 0" + (" in the warm-up (lr 0 is accepted in a GRPO phase only, as the "
                                            "frozen-policy control: --B.optim.lr 0 freezes phase B alone)"
                                            if o.lr == 0 else "")),
        (o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps}: must be >= 0"),
        (o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay}: must be >= 0"),
        (o.vision_lr_scale >= 0, f"optim.vision_lr_scale={o.vision_lr_scale}: must be >= 0 (0 = frozen tower)"),
        (not lo.vision or o.vision_lr_scale > 0,
         f"optim.vision_lr_scale={o.vision_lr_scale}: lora.vision trains the tower's LoRA at this fraction of "
         f"optim.lr, so it must be > 0 (1 = the language model's lr); to freeze the tower turn lora.vision off"),
        (o.merger_lr_scale > 0,
         f"optim.merger_lr_scale={o.merger_lr_scale}: must be > 0 (the merger LoRA's lr as a fraction of optim.lr, "
         f"1 = the language model's); to freeze the merger turn lora.merger off"),
        (o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip}: must be >= 0 (0 = off)"),
        (o.perception_weight >= 0, f"optim.perception_weight={o.perception_weight}: must be >= 0 (0 = off)"),
        (p.perception_steps >= 0, f"phase.perception_steps={p.perception_steps}: must be >= 0 (0 = no caption stage)"),
        # The perception labels exist only to teach a tower that trains from scratch.
        (not (p.name == "warmup" and (o.perception_weight > 0 or p.perception_steps > 0)) or trains_from_scratch(m.name),
         f"model.name={m.name!r} is a pretrained model, which already sees: the perception loss and caption "
         f"stage apply only to a model trained from scratch (tiny-random, what python -m grpo.pretrain uses); set "
         f"--warmup.optim.perception_weight 0 and "
         f"--warmup.phase.perception_steps 0"),
        (not (p.name == "warmup" and o.perception_weight > 0 and o.vision_lr_scale == 0),
         f"optim.perception_weight={o.perception_weight} trains the vision tower through its labels, but "
         f"optim.vision_lr_scale=0 freezes the tower: set a vision_lr_scale > 0 or perception_weight 0"),
    ]
    return checks


def _loss_checks(cfg: Any) -> list[tuple[bool, str]]:
    """The controls, the batch levels and the loss's knobs."""
    s, o, p, ru = cfg.sampling, cfg.optim, cfg.phase, cfg.rewards
    checks = [
        # The random-reward control draws whole rows; a dropped zero-spread group would be
        # refilled with draws that have spread by chance, and prefix credit is per token.
        (not (ru.random_reward and s.dynamic_sampling),
         "rewards.random_reward with sampling.dynamic_sampling: the control's random draws give spread to "
         "groups that had none, so dynamic sampling would select on noise; turn one of them off"),
        # Guided groups read the correctness the sampler's rows earned; the control's rewards are
        # drawn after guiding, so a demonstration would be scored at random.
        (not (ru.random_reward and s.guided),
         "rewards.random_reward with sampling.guided: the control scores rows at random, so a group's gold "
         "demonstration would be too; turn one of them off"),
        (math.isfinite(o.guided_gamma) and o.guided_gamma >= 0,
         f"optim.guided_gamma={o.guided_gamma}: must be a finite number >= 0 (0 = no shaping; LUFFY's is 0.1)"),
        (o.guided_gamma == 0 or s.guided,
         f"optim.guided_gamma={o.guided_gamma} shapes guided groups' demonstration rows, but sampling.guided is off: "
         "set --sampling.guided true or leave guided_gamma at 0"),
        (not (ru.random_reward and ru.rubric_mode == "prefix"),
         "rewards.random_reward with rewards.rubric_mode prefix: the control replaces scalar rewards; "
         "use rubric_mode sequence"),
        (o.accumulation >= 1, f"optim.accumulation={o.accumulation}: must be >= 1"),
        (o.micro_batch_rows >= 0, f"optim.micro_batch_rows={o.micro_batch_rows}: must be >= 0 (0 = all rows at once)"),
        # Whole groups: a group's G rows share one prompt (issue: the prompt once per group)
        # and one advantage baseline, so a micro-batch never splits one.
        # (at least the batch's rows: one pass, so a preset's value survives a smaller --G or batch)
        (micro_batch_rows_fit(p.prompts_per_step, s.G, o.micro_batch_rows),
         f"optim.micro_batch_rows={o.micro_batch_rows}: must be a multiple of sampling.G={s.G} (whole groups) that "
         f"divides the rollout batch's {p.prompts_per_step} x {s.G} = {p.prompts_per_step * s.G} rows, e.g. "
         f"{s.G} or {p.prompts_per_step * s.G}; 0 = all rows at once"),
        (o.logits_chunk_tokens >= 1, f"optim.logits_chunk_tokens={o.logits_chunk_tokens}: must be >= 1"),
        (o.beta >= 0, f"optim.beta={o.beta}: must be >= 0"),
        (0 <= o.eps_low < 1, f"optim.eps_low={o.eps_low}: must be in [0, 1) (the ratio's lower clip is 1 - eps_low)"),
        (o.eps_high >= 0, f"optim.eps_high={o.eps_high}: must be >= 0"),
        (o.schedule in ("constant", "linear", "cosine"), f"optim.schedule={o.schedule!r}: use constant, linear or cosine"),
        (o.loss_type in LOSS_TYPES, f"optim.loss_type={o.loss_type!r}: use {_one_of(LOSS_TYPES)}"),
        (o.adv_scale in SCALES, f"optim.adv_scale={o.adv_scale!r}: use {_one_of(SCALES)}"),
        (o.importance in IMPORTANCE, f"optim.importance={o.importance!r}: use {_one_of(IMPORTANCE)}"),
        (o.updates_per_batch >= 1,
         f"optim.updates_per_batch={o.updates_per_batch}: must be >= 1 (1 = one update per step)"),
        (o.adv_mode in ("total", "components"), f"optim.adv_mode={o.adv_mode!r}: use total or components"),
        (o.rollout_correction in CORRECTIONS,
         f"optim.rollout_correction={o.rollout_correction!r}: use {_one_of(CORRECTIONS)}"),
        (o.rollout_correction_mode in CORRECTION_MODES,
         f"optim.rollout_correction_mode={o.rollout_correction_mode!r}: use {_one_of(CORRECTION_MODES)}"),
        (o.rollout_correction_cap > 1,
         f"optim.rollout_correction_cap={o.rollout_correction_cap}: must be > 1 (the largest pi_train / pi_sampler "
         "ratio kept; TRL uses 3)"),
        (o.adv_std_floor >= 0, f"optim.adv_std_floor={o.adv_std_floor}: must be a finite number >= 0 (0 = off)"),
        (not (o.adv_std_floor > 0 and o.adv_scale == "none"),
         f"optim.adv_std_floor={o.adv_std_floor} floors the std, but optim.adv_scale='none' divides by no std: "
         f"use adv_scale group or batch, or drop the floor"),
        (isinstance(o.entropy_coef, (int, float)) and 0 <= o.entropy_coef <= 1,
         f"optim.entropy_coef={o.entropy_coef}: must be a number in [0, 1] (the entropy bonus's weight against "
         "the policy term; verl's examples use 0 to 0.01; 0 = off)"),
        (o.kl_estimator in KL_ESTIMATORS, f"optim.kl_estimator={o.kl_estimator!r}: use {_one_of(KL_ESTIMATORS)}"),
        (o.kl_estimator == "k3" or o.beta > 0,
         f"optim.kl_estimator={o.kl_estimator!r} picks the KL term, which optim.beta=0 switches off: set "
         "--optim.beta > 0 or leave the estimator at k3"),
        (not (o.kl_bias_correction and o.beta == 0),
         "optim.kl_bias_correction=true weights the KL term, which optim.beta=0 switches off: set --optim.beta > 0 "
         "or leave the correction off"),
        (not (o.adv_mode == "components" and ru.rubric_mode == "prefix"),
         "optim.adv_mode='components' with rewards.rubric_mode='prefix': the prefix mode builds its own token "
         "advantages from R_ans and the rubric scores; use adv_mode total or rubric_mode sequence"),
    ]
    return checks


def _sampling_checks(cfg: Any) -> list[tuple[bool, str]]:
    """Dynamic sampling, NoisyRollout and the accuracy band."""
    s, ru = cfg.sampling, cfg.rewards
    grpo = cfg.phase.name != "warmup"
    checks = [
        (s.max_refills >= 0, f"sampling.max_refills={s.max_refills}: must be >= 0"),
        (0 <= s.noisy_fraction < 1,
         f"sampling.noisy_fraction={s.noisy_fraction}: must be in [0, 1) (the share of each group sampled from a "
         f"noisy image; NoisyRollout uses .5; 0 = off)"),
        (s.noisy_fraction == 0 or 1 <= round(s.noisy_fraction * s.G) < s.G,
         f"sampling.noisy_fraction={s.noisy_fraction} of sampling.G={s.G} completions rounds to "
         f"{round(s.noisy_fraction * s.G)} noisy ones: a group needs at least one noisy and one clean completion "
         f"(e.g. .5)"),
        (s.noise_std > 0 if s.noisy_fraction > 0 else s.noise_std >= 0,
         f"sampling.noise_std={s.noise_std}: must be > 0 with sampling.noisy_fraction > 0 (the noise's std at the "
         f"phase's first step, in normalised pixel units)"),
        (0 <= s.accuracy_low <= s.accuracy_high <= 1,
         f"sampling.accuracy_low={s.accuracy_low}, sampling.accuracy_high={s.accuracy_high}: the accuracy band "
         "needs 0 <= low <= high <= 1 (fractions of a group's completions that are right; 0 and 1 = no band)"),
        (not grpo or s.accuracy_band() is None or s.dynamic_sampling,
         f"sampling.accuracy_low={s.accuracy_low}, sampling.accuracy_high={s.accuracy_high} filter the groups of "
         "dynamic sampling, which is off: set --sampling.dynamic_sampling true, or leave the band at 0 and 1"),
        (not grpo or s.accuracy_band() is None or "correctness" in ru.weights,
         "sampling.accuracy_low / accuracy_high filter on the correctness component, which rewards.weights does "
         "not name: add correctness to rewards.weights (correctness=0 scores it without paying it)"),
    ]
    return checks


def _model_and_reward_checks(cfg: Any) -> list[tuple[bool, str]]:
    """The model, its images and prompts, the rubric mode."""
    m, ru = cfg.model, cfg.rewards
    checks = [
        (bool(m.name.strip()), "model.name is empty: use 'tiny', a local model directory or a hub id"),
        (m.dtype in ("float32", "bfloat16", "float16"), f"model.dtype={m.dtype!r}: use float32 or bfloat16"),
        (re.fullmatch(r"auto|cpu|cuda(:\d+)?", m.device) is not None,
         f"model.device={m.device!r}: use auto, cpu, cuda or cuda:N"),
        (m.image_size >= 28, f"model.image_size={m.image_size}: must be >= 28 (two 14-px patches)"),
        (m.max_pixels >= 0 and m.min_pixels >= 0,
         f"model.max_pixels={m.max_pixels}, model.min_pixels={m.min_pixels}: must be >= 0 (0 = the processor's own)"),
        (m.max_pixels == 0 or m.max_pixels >= 28 * 28,
         f"model.max_pixels={m.max_pixels}: must be >= {28 * 28} (one 28x28 visual token), or 0"),
        (not (m.max_pixels and m.min_pixels and m.min_pixels > m.max_pixels),
         f"model.min_pixels={m.min_pixels} > model.max_pixels={m.max_pixels}: the smallest area must not exceed the largest"),
        (m.max_prompt_tokens >= 0, f"model.max_prompt_tokens={m.max_prompt_tokens}: must be >= 0 (0 = no cap)"),
        (ru.rubric_mode in ("sequence", "prefix"), f"rewards.rubric_mode={ru.rubric_mode!r}: use sequence or prefix"),
        (0 <= ru.prefix_answer_weight <= 1, f"rewards.prefix_answer_weight={ru.prefix_answer_weight}: must be in [0, 1]"),
    ]
    return checks


def _phase_and_run_checks(cfg: Any) -> list[tuple[bool, str]]:
    """The phase's budget and mixture, the run's files, cadences and trackers, own data."""
    r, p = cfg.run, cfg.phase
    checks = [
        (p.steps >= 0, f"phase.steps={p.steps}: must be >= 0"),
        (p.prompts_per_step >= 1, f"phase.prompts_per_step={p.prompts_per_step}: must be >= 1"),
        (p.val_every >= 0 and p.patience >= 0,
         f"phase.val_every={p.val_every}, phase.patience={p.patience}: must be >= 0 (0 = off)"),
        (p.name == "warmup" or (p.val_every == 0 and p.patience == 0),
         f"phase.val_every={p.val_every}, phase.patience={p.patience}: the warm-up's validation curve; phase {p.name} "
         f"evaluates every run.eval_every steps (set --warmup.phase.val_every, or --run.eval_every for phase {p.name})"),
        (p.patience == 0 or p.val_every > 0,
         f"phase.patience={p.patience} stops on the validation curve, which needs phase.val_every > 0 (evaluations "
         f"every that many SFT steps)"),
        (bool(p.mixture) and all(v >= 0 for v in p.mixture.values()) and sum(p.mixture.values()) > 0,
         f"phase.mixture={p.mixture}: needs at least one stage with positive probability"),
        (set(p.mixture) <= {1, 2, 3, ALL}, f"phase.mixture={p.mixture}: stages are 1, 2 and 3 (or all: every usable row)"),
        (bool(p.init.strip()), "phase.init is empty: use auto, base, a selector like A:best_structure, or a path"),
        (bool(r.run_dir.strip()), "run.run_dir is empty: name a directory for checkpoints and logs"),
        # numpy's legacy seeding (seed_everything) takes 0 .. 2**32 - 1 only
        (0 <= r.seed < 2**32, f"run.seed={r.seed}: must be in [0, 2**32)"),
        (bool(r.data.strip()),
         "run.data is empty: use synthetic, a data.jsonl directory, a parquet file or a datasets directory"),
        (r.train_per_stage >= 1, f"run.train_per_stage={r.train_per_stage}: must be >= 1"),
        (r.eval_size >= 1, f"run.eval_size={r.eval_size}: must be >= 1"),
        (r.eval_every >= 1, f"run.eval_every={r.eval_every}: must be >= 1 (it is also the checkpoint cadence)"),
        (r.log_every >= 1, f"run.log_every={r.log_every}: must be >= 1"),
        (r.save_every >= 0, f"run.save_every={r.save_every}: must be >= 0 (0 = no step-count saves)"),
        (r.save_every_minutes >= 0, f"run.save_every_minutes={r.save_every_minutes}: must be >= 0 (0 = no timed saves)"),
        (r.test_per_stage >= 0, f"run.test_per_stage={r.test_per_stage}: must be >= 0 (0 = no report)"),
        (r.cpu_threads >= 0, f"run.cpu_threads={r.cpu_threads}: must be >= 0 (0 = torch's default)"),
        (math.isfinite(r.collective_timeout_s) and r.collective_timeout_s > 0,
         f"run.collective_timeout_s={r.collective_timeout_s}: must be a finite number of seconds > 0"),
        # checked here, before a model loads, so a missing package is not found after the warm-up
        (not r.tensorboard or importlib.util.find_spec("tensorboard") is not None,
         "run.tensorboard=true needs the tensorboard package: pip install 'vlgrpo[tensorboard]' "
         "(or pip install tensorboard), or drop --run.tensorboard"),
    ]
    checks.append((cfg.data.max_images >= 1, f"data.max_images={cfg.data.max_images}: must be >= 1 (images one "
                                              "prompt may show)"))
    for name in r.report_to:
        checks.append((name in REPORT_TO, f"run.report_to names {name!r}: trackers are {_one_of(tuple(REPORT_TO))}"))
        module, package = REPORT_TO.get(name, (name, name))
        checks.append((name not in REPORT_TO or importlib.util.find_spec(module) is not None,
                       f"run.report_to names {name}, which needs the {package} package: pip install 'vlgrpo[{name}]' "
                       f"(or pip install {package}), or drop {name} from --run.report_to"))
    unknown = [k for k in cfg.data.columns if k not in ROW_FIELDS]
    checks.append((not unknown, f"data.columns names the field {unknown[0] if unknown else ''!r}, which no row "
                                f"has: fields are {', '.join(ROW_FIELDS)} (write field=column)"))
    checks.append((r.data != "synthetic" or not cfg.data.columns,
                   "data.columns maps the columns of --run.data, and the synthetic curriculum has none: "
                   "drop it or give --run.data"))
    return checks


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def check_types_and_finite(cfg: Any) -> None:
    """Each field holds its declared type, and every number is finite (lr=inf trains NaN)."""
    for sec_name in _field_names(cfg):
        section = getattr(cfg, sec_name)
        hints = typing.get_type_hints(type(section))
        for name in _field_names(section):
            key, value, typ = f"{sec_name}.{name}", getattr(section, name), hints[name]
            origin = typing.get_origin(typ)
            if origin is dict and typing.get_args(typ)[1] is str:  # rewards.extra, data.columns
                if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                    what = "name=module:function" if key.endswith("rewards.extra") else "name=value"
                    raise ConfigError(f"{key}={value!r}: give {what} pairs")
                numbers = []
            elif origin is dict:
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}={value!r}: give name=number pairs")
                numbers = list(value.values())
            elif origin is tuple:
                if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"{key}={value!r}: give comma-separated names")
                numbers = []
            else:
                ok = (isinstance(value, bool) if typ is bool else
                      isinstance(value, int) and not isinstance(value, bool) if typ is int else
                      isinstance(value, (int, float)) and not isinstance(value, bool) if typ is float else
                      isinstance(value, str))
                if not ok:
                    raise ConfigError(f"{key}={value!r}: expected {getattr(typ, '__name__', typ)}")
                numbers = [value] if typ is float else []
            for v in numbers:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ConfigError(f"{key} has non-numeric values {value}: give name=number pairs")
                if not math.isfinite(v):
                    raise ConfigError(f"{key}={value}: must be finite (not inf or nan)" if origin is dict
                                      else f"{key}={value}: must be a finite number (not inf or nan)")
