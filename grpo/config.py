"""Configuration: one dataclass per concern, named presets, one override mechanism.

    TrainConfig
      model     ModelConfig      which VLM, dtype, 4-bit, image size
      lora      LoRAOptions      rank, alpha, targets (-> lora.LoRAConfig)
      sampling  SamplingConfig   G, max_new_tokens, temperature, top-k/p
      optim     OptimConfig      lr + schedule, clip, accumulation, the GRPO loss knobs
      rewards   RewardConfig     which reward components, their weights, tolerance
      phase     PhaseConfig      curriculum phase: stage mixture, init checkpoint, steps
      run       RunConfig        run directory, seed, data, eval/checkpoint cadence
      data      DataConfig       how to read own data: the column map, the images a prompt

Every knob that is set must be the knob that runs (R1-VL's trainer silently sampled at
temperature 1 although configured 1.2): the trainer prints the resolved config at start
and saves it as JSON in the run directory, and `override()` refuses keys it doesn't know.

Overrides are ``--key value`` where key is ``section.field`` (``--sampling.G 4``) or a
field name that is unique across sections (``--G 4``). Values are parsed by the field's
type: ints, floats, bools (true/false/1/0/yes/no), strings, tuples (comma separated) and
dicts (``name=value,name=value``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from data.rows import FIELDS as ROW_FIELDS
from data.rows import MAX_IMAGES
from grpo.batches import micro_batch_rows_fit
from data.stages import ALL

from grpo_kernels.grpo_advantages import SCALES
from grpo_kernels.grpo_loss import CORRECTION_MODES, CORRECTIONS, IMPORTANCE, KL_ESTIMATORS, LOSS_TYPES
from lora.inject import LoRAConfig

# Every default that depends on the phase, in one table: phase_preset(phase) is TrainConfig()
# (the dataclass defaults below) with this phase's entries applied; a --preset and the
# command line's overrides come after it (grpo/cli.py).
#   rewards.weights  the staged paper's initial verifier weights (docs/design.md, section 3)
#   phase.mixture    curriculum stage -> probability
#   optim.lr         GRPO: A (format) at 2e-3 fixes the contract within 60 steps; B at 2e-3
#                    drifted (val EM 0.165 -> 0.095 over its 60 steps) where 5e-4 held; the
#                    warm-up's 5e-4 learned to read faster than 1e-3 or 2e-3 on every
#                    perception probe we ran (bench/EXPERIMENTS.md)
#   budget           GRPO rollout batches x prompts (each sampled G times) and the eval cadence:
#                    the main command spends its ten CPU minutes on A and B, since the model
#                    arrives pretrained (grpo/tiny_model) and no warm-up runs. The warm-up's
#                    (SFT of tiny-random, from random weights): the caption stage first, then
#                    worked reasoning, 32 examples a step; (800 + 250) x 32 examples, 60% of
#                    them stage 1: 8000 per stage keeps repeats to ~2-3 (2000 would be ~10).
PHASE_DEFAULTS: dict[str, dict[str, Any]] = {
    "warmup": {
        "phase.mixture": {1: 0.6, 2: 0.25, 3: 0.15},
        "optim.lr": 5e-4, "optim.warmup_steps": 20, "optim.schedule": "linear",
        "phase.steps": 250, "phase.prompts_per_step": 32, "run.train_per_stage": 8000,
    },
    "A": {
        "rewards.weights": dict(format=1.0, parseable=1.0, finished=1.5, correctness=2.0, brevity=0.25, tolerance=0.0),
        "phase.mixture": {1: 1.0}, "optim.lr": 2e-3,
        "phase.steps": 80, "phase.prompts_per_step": 8, "run.eval_every": 20,
    },
    "B": {
        "rewards.weights": dict(format=0.75, parseable=0.75, finished=1.0, correctness=4.0, brevity=0.20, tolerance=0.0),
        "phase.mixture": {1: 0.7, 2: 0.3}, "optim.lr": 5e-4,
        "phase.steps": 160, "phase.prompts_per_step": 8, "run.eval_every": 40,
    },
    "C": {
        "rewards.weights": dict(format=0.5, parseable=0.5, finished=0.75, correctness=5.0, brevity=0.20, tolerance=1.0),
        "rewards.tolerance": True, "phase.mixture": {2: 0.6, 3: 0.4}, "optim.lr": 5e-4,
        "phase.steps": 160, "phase.prompts_per_step": 8, "run.eval_every": 40,
    },
}
PHASES = tuple(PHASE_DEFAULTS)  # in curriculum order
PHASE_WEIGHTS: dict[str, dict[str, float]] = {  # the GRPO phases' weights (the controller starts from them)
    phase: d["rewards.weights"] for phase, d in PHASE_DEFAULTS.items() if "rewards.weights" in d}
# The checkpoint each phase starts from by default (phase_init).
PHASE_INIT: dict[str, str] = {"warmup": "base", "A": "base", "B": "A:best_structure", "C": "B:best_composite"}
# The warm-up of a model trained from scratch (a random vision tower) adds the perception
# supervision of grpo/warmup/perception.py: a pretrained model already sees, so it never gets these.
PERCEPTION_DEFAULTS: dict[str, Any] = {"phase.perception_steps": 800, "optim.perception_weight": 1.0}


# run.report_to's trackers: name -> (the module imported, the package that provides it);
# mlflow-skinny is MLflow's client and file store without its server's dependencies.
REPORT_TO = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow-skinny")}


def reported_to(run: "RunConfig") -> tuple[str, ...]:
    """The trackers a run writes to: run.report_to, with tensorboard when run.tensorboard is on."""
    names = tuple(dict.fromkeys(run.report_to))
    return names if not run.tensorboard or "tensorboard" in names else ("tensorboard", *names)


def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


class ConfigError(ValueError):
    """A bad configuration value or key; the message names it and says what to do."""


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


def overlong_buffer(rewards: "RewardConfig", max_new_tokens: int) -> int:
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


def weigh_plugins(rewards: "RewardConfig") -> None:
    """A plug-in named in rewards.extra without a weight enters the reward at 1.0 (an explicit
    weight, 0 included, is kept): a plug-in must not be loaded and then silently unpaid."""
    for name in rewards.extra:
        if name not in rewards.weights:
            rewards.weights = {**rewards.weights, name: 1.0}


@dataclass
class ModelConfig:
    name: str = "tiny"
    """'tiny' (the shipped pretrained model), 'tiny-random' (its architecture, random weights), a local directory, or a hub id."""
    dtype: str = "float32"
    """Compute dtype of the base: float32 (CPU default) or bfloat16 (GPU)."""
    load_in_4bit: bool = False
    """Quantise the language model's linear layers to NF4 (bitsandbytes, double quant) under the LoRA (the tiny preset: on; its from-scratch warm-up trains every weight in float32 and each GRPO phase quantises that base)."""
    image_size: int = 112
    """Side of the synthetic images in pixels (112 px = 16 visual tokens after merging)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (every pass with grad runs in training mode so that transformers honours it; the 7B needs it)."""
    max_pixels: int = 0
    """Largest image area in pixels handed to Qwen's processor (real images are resized to fit, as Qwen's own processor does; one visual token per 28x28 px); 0 = the checkpoint's processor config."""
    min_pixels: int = 0
    """Smallest image area in pixels (smaller images are upscaled to it); 0 = the checkpoint's processor config."""
    max_prompt_tokens: int = 0
    """Prompts longer than this many tokens (visual tokens included) are skipped and counted: in GRPO draws (the step's log line) and evaluations (the eval line); the SFT warm-up trains on every example (0 = no cap)."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:i]'."""


@dataclass
class LoRAOptions:
    """The command-line and JSON face of lora.LoRAConfig, the one definition of where and how
    big the adapters are: the same knobs under the config's key names (rank, targets, dtype
    as a string), turned into it by ``to_lora()``."""

    rank: int = 8
    """LoRA rank r."""
    alpha: float = 8.0
    """LoRA scale numerator: the update is (alpha / r) * B A x."""
    dropout: float = 0.0
    """Dropout on the LoRA input branch."""
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module-name suffixes to adapt in the language model (the vision tower has its own switches below)."""
    vision: bool = False
    """LoRA on the vision tower's blocks too (model.visual.blocks: lora.vision_targets), trained at optim.vision_lr_scale x lr, the tower recomputed with grad once per prompt in the training passes; false = the tower frozen (EasyR1's freeze_vision_tower, ms-swift's freeze_vit)."""
    vision_targets: tuple[str, ...] = ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    """Module-name suffixes adapted inside the vision blocks when lora.vision is on (attention qkv / proj, the SwiGLU MLP)."""
    merger: bool = False
    """LoRA on the vision merger too (the projector from 2x2 patches to one language-model token, model.visual.merger: its two linears), trained at optim.merger_lr_scale x lr; false = frozen (ms-swift's freeze_aligner)."""
    dtype: str = "float32"
    """Storage dtype of the LoRA weights: float32 or bfloat16."""

    def to_lora(self) -> LoRAConfig:
        return LoRAConfig(r=self.rank, alpha=self.alpha, dropout=self.dropout,
                          target_modules=tuple(self.targets), lora_dtype=getattr(torch, self.dtype))


@dataclass
class SamplingConfig:
    G: int = 8
    """Group size: completions sampled per prompt (the 'G' in GRPO)."""
    max_new_tokens: int = 48
    """L: the completion budget; also the brevity/truncation reference length."""
    temperature: float = 1.0
    """Sampling temperature (the log-probs of the loss use the same temperature)."""
    temperature_max: float = 1.2
    """The controller's reach: its vanishing-advantage gate (more than half the groups without reward spread at a checkpoint) raises the sampling temperature by .1 per checkpoint up to this (R1-VL's 1.2), never above; at or below sampling.temperature it never raises it. In (0, 5]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    rollout: str = "plain"
    """Decode path of the rollouts: plain (the policy's 4-bit + LoRA layers) or merged (a copy in the compute dtype with LoRA merged, CUDA graph on GPUs; the tiny preset's)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose G rewards are all equal, refill from the stream (grpo/rollout/dynamic_sampling.py)."""
    max_refills: int = 4
    """Dynamic sampling: at most this many refill rounds per step; then train on what was kept (none kept: stop)."""
    noisy_fraction: float = 0.0
    """NoisyRollout (arXiv 2504.13055): this fraction of each group's G completions is sampled from its image with Gaussian noise added (the rest from the clean image), the advantages taken over the whole group; every row is trained conditioned on the clean image (grpo/rollout/noisy.py; 0 = off; the paper mixes half and half)."""
    noise_std: float = 0.5
    """NoisyRollout: the noise's standard deviation at the phase's first step, in the processor's normalised pixel units, annealed to 0 by the phase's last step (sampling.noisy_fraction > 0)."""
    accuracy_low: float = 0.0
    """Dynamic sampling's accuracy band, lower end: keep a group only if its mean correctness (fraction of its G completions right) is >= this (EasyR1's online_filtering: 0.01); 0 and accuracy_high 1 = no band."""
    accuracy_high: float = 1.0
    """Dynamic sampling's accuracy band, upper end: keep a group only if its mean correctness is <= this (EasyR1: 0.99)."""

    def accuracy_band(self) -> tuple[float, float] | None:
        """(low, high) of the accuracy band, or None for the default [0, 1] (no band: any spread)."""
        if self.accuracy_low <= 0.0 and self.accuracy_high >= 1.0:
            return None
        return self.accuracy_low, self.accuracy_high


@dataclass
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate of AdamW on the LoRA parameters; 0 in a GRPO phase = the frozen-policy control (sampled, scored, logged, never updated)."""
    schedule: str = "constant"
    """Learning-rate schedule after warm-up: constant, linear or cosine (to 10% of lr)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay on LoRA parameters."""
    vision_lr_scale: float = 1.0
    """The vision tower's learning rate as a fraction of lr: its LoRA's with lora.vision (must be > 0; 1 = the language model's lr); in the warm-up of a random base, the whole tower's, merger included (0 = frozen)."""
    merger_lr_scale: float = 1.0
    """The merger's LoRA learning rate as a fraction of lr, with lora.merger (must be > 0; 1 = the language model's lr)."""
    perception_weight: float = 0.0
    """Warm-up of a random base: weight of the per-visual-token perception loss (grpo/warmup/perception.py; 0 = off; the tiny model's warm-up: 1)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    accumulation: int = 1
    """Rollout batches (of phase.prompts_per_step prompts x G) sampled and accumulated per optimiser step."""
    micro_batch_rows: int = 0
    """Rows (completions) per training pass: the policy and reference log-probs, the loss and backward run over micro-batches of this many rows of each rollout batch, gradients accumulated (TRL's per_device_train_batch_size); whole groups, so a multiple of G dividing the batch's rows; 0 (or the batch's rows or more) = all rows in one pass. python -m bench.memory says which fits a GPU."""
    logits_chunk_tokens: int = 1024
    """Completion tokens per LM-head chunk in the log-prob passes: the logits exist for one chunk at a time and are recomputed in backward (whole rows: max(1, this // T) rows per chunk)."""
    shared_prefix: bool = True
    """The log-prob passes run each group's prompt through the language model once (B rows) and attend the G completions to its keys and values (grpo/model/shared_prefix.py): the same log-probs and gradients as running the prompt in all B*G rows (False: the full-row pass, the reference), with 1/G of the prompt's compute and saved activations."""
    beta: float = 0.0
    """KL penalty coefficient against the reference (LoRA disabled); the estimator is optim.kl_estimator."""
    eps_low: float = 0.2
    """Lower clip range of the importance ratio: 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip range of the importance ratio: 1 + eps_high (DAPO's clip-higher uses .28)."""
    loss_type: str = "grpo"
    """Aggregation: grpo (per-sequence mean), bnpo (token mean), dr_grpo (sum/(N*L)), dapo."""
    adv_scale: str = "group"
    """Advantage scaling: group (per-group std), batch (batch std) or none (Dr. GRPO)."""
    importance: str = "token"
    """Importance ratio level: token (GRPO) or sequence (GSPO)."""
    updates_per_batch: int = 1
    """mu: optimiser steps per rollout batch (PPO epochs); the ratio is taken against the sampling policy, so the clip binds from the 2nd."""
    kl_bias_correction: bool = False
    """KL term ratio * k (k: optim.kl_estimator) with the gradient through the ratio (TRL's use_bias_correction_kl); needs beta > 0."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss -= entropy_coef * the policy's token entropy, aggregated over the loss's tokens as optim.loss_type aggregates (TRL's entropy_coef, verl's entropy_coeff); its gradient runs through the chunked LM-head pass (grpo/model/logprobs.py). In [0, 1]; 0 = off, no extra work."""
    kl_estimator: str = "k3"
    """Per-token KL estimate in the beta term, d = ref - logp: k1 = -d, k2 = d^2/2 (its gradient is the KL's), k3 = exp(d) - d - 1 (DeepSeekMath's); docs/grpo_loss.md compares them. Needs beta > 0 unless k3."""
    adv_mode: str = "total"
    """Advantage source: total (z-score of the weighted reward) or components (sum_k w_k/sum(w) z(r_k), each term alone)."""
    adv_std_floor: float = 0.0
    """Divide by max(std, floor) instead of std, so a tiny tie-breaker spread is not stretched to a full advantage (0 = off)."""
    rollout_correction: str = "off"
    """Weight the policy term by pi_train / pi_sampler of the sampled tokens: off, token (low variance, biased) or sequence (unbiased, variance grows with length); grpo_kernels/grpo_loss.py."""
    rollout_correction_mode: str = "mask"
    """Above the cap: truncate (TIS, weight min(ratio, C): keeps every sample, biased) or mask (MIS, weight 0: drops samples a large mismatch made untrustworthy)."""
    rollout_correction_cap: float = 3.0
    """C, the largest rollout ratio kept (> 1; TRL's default: sequence level, mask, 3)."""
    mask_truncated: bool = False
    """Completions that hit sampling.max_new_tokens without a stop token get loss mask 0 (TRL's mask_truncated_completions, DAPO's overlong filtering); they keep their rewards and still count in their group's advantage statistics."""


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: dict(PHASE_DEFAULTS["A"]["rewards.weights"]))
    """Reward components and their weights; the controller changes them during training."""
    tolerance: bool = False
    """Credit near misses within the example's precision (phase C turns it on)."""
    rubric_mode: str = "sequence"
    """V-Rubrics credit: 'sequence' (one scalar) or 'prefix' (token-level, up to the evidence)."""
    prefix_answer_weight: float = 0.5
    """'a' in A_t = a*z(R_ans) + (1-a)*sum_j rho_j z(s_j) 1[t <= t_end_j] (prefix mode)."""
    random_reward: bool = False
    """Control, not training: each completion's rewards are replaced by those of a random completion of its batch."""
    overlong_buffer: int = 0
    """L_cache of the overlong component (DAPO's soft overlong punishment, on when rewards.weights names overlong): the penalty ramps from 0 at max_new_tokens - L_cache tokens to -overlong_penalty at max_new_tokens; 0 = a fifth of max_new_tokens."""
    overlong_penalty: float = 1.0
    """The overlong component's value at the budget (verl's penalty_factor; 1 = DAPO: -1 when truncated); > 0."""
    extra: dict[str, str] = field(default_factory=dict)
    """Your own reward components, NAME=module:function (comma separated): function(examples, completions) -> one finite float per completion; weight 1 unless rewards.weights names it (README, "Your own reward")."""


@dataclass
class PhaseConfig:
    name: str = "B"
    """Curriculum phase: warmup (SFT), A (structure), B (correctness), C (harder, tolerance)."""
    steps: int = 60
    """Optimiser steps in this phase."""
    prompts_per_step: int = 4
    """B: distinct prompts per step (each sampled G times)."""
    mixture: dict[int | Literal["all"], float] = field(default_factory=lambda: dict(PHASE_DEFAULTS["B"]["phase.mixture"]))
    """Curriculum stage (1, 2, 3, or all: every usable row, whatever its metadata) -> sampling probability; on data without MathVista metadata the phase defaults become all=1.0."""
    init: str = "auto"
    """Start point: auto (the phase preset's alias), base, a selector like A:best_structure, or a path."""
    controller: bool = True
    """Run the metric-gated controller after each checkpoint eval."""
    perception_steps: int = 0
    """Warm-up of a random base: steps on image captions (image-only prompt) before the worked-reasoning SFT (the tiny model's warm-up: 800)."""


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    """Directory for checkpoints, logs, the resolved config and reports."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    data: str = "synthetic"
    """'synthetic' (built-in curriculum) or a directory of JSONL + images in MathVista schema."""
    train_per_stage: int = 2000
    """Synthetic training examples generated per curriculum stage."""
    eval_size: int = 200
    """Held-out examples for the checkpoint-side eval that feeds the controller gates."""
    eval_every: int = 20
    """Evaluate + checkpoint every this many steps (and at the end of the phase)."""
    save_every: int = 0
    """Also save a `latest`-only checkpoint every this many steps between evaluations (0 = off)."""
    save_every_minutes: float = 30.0
    """Also save a `latest`-only checkpoint when this many minutes passed since the last save (0 = off)."""
    log_every: int = 10
    """Print a one-line human summary every this many steps."""
    run_prior_phases: bool = True
    """If the phase's init checkpoint is missing, run the earlier phases first."""
    test_per_stage: int = 100
    """Held-out synthetic test examples per stage in the end-of-run report (0 = no report)."""
    cpu_threads: int = 1
    """torch CPU threads (0 = torch's default). The tiny model's matmuls gain nothing from
    more, and OpenMP spin-waits collapse (10x slower, measured) when the cores are shared."""
    tensorboard: bool = False
    """Also write every number of train_log.jsonl as a TensorBoard scalar, in <run_dir>/tensorboard/ (tensorboard extra); the same as tensorboard in run.report_to."""
    report_to: tuple[str, ...] = ()
    """Experiment trackers that also get every logged number, the resolved config and each evaluation's sample completions with their images: tensorboard, wandb, mlflow (comma separated; each its optional extra, e.g. pip install 'vlgrpo[wandb]'); grpo/run/trackers.py."""
    collective_timeout_s: float = 300.0
    """Data parallel (torchrun): seconds a collective may wait for a rank before every rank
    stops with one line naming the rank that did not arrive (the warm-up's wait for rank 0
    is exempt). A step's ranks arrive within seconds of each other; a hung one never does."""


@dataclass
class DataConfig:
    columns: dict[str, str] = field(default_factory=dict)
    """Column map for --run.data: field=column pairs naming the dataset's column for a field this project reads (pid, question, answer, image, images, answer_type, question_type, precision, choices, unit, metadata, query), e.g. question=query,answer=label,image=img; a field left out is read from its own name."""
    max_images: int = MAX_IMAGES
    """Most images one prompt of --run.data may show (a row's `images` list; EasyR1's limit_images): a row with more is skipped and counted (too_many_images); each image costs up to model.max_pixels / 784 visual tokens."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    phase: PhaseConfig = field(default_factory=PhaseConfig)
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def validate(self) -> "TrainConfig":
        """Reject impossible values with one line that names the field and the fix.

        Everything a run will use is checked here, before anything is loaded or written:
        a bad value found after a 10-minute warm-up is a bad value found too late.
        """
        self._check_types_and_finite()
        s, o, r, p, m, lo, ru = self.sampling, self.optim, self.run, self.phase, self.model, self.lora, self.rewards
        grpo = p.name != "warmup"
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
             f"stage apply only to a model trained from scratch (tiny-random, what python -m grpo.pretrain uses); set --warmup.optim.perception_weight 0 and "
             f"--warmup.phase.perception_steps 0"),
            (not (p.name == "warmup" and o.perception_weight > 0 and o.vision_lr_scale == 0),
             f"optim.perception_weight={o.perception_weight} trains the vision tower through its labels, but "
             f"optim.vision_lr_scale=0 freezes the tower: set a vision_lr_scale > 0 or perception_weight 0"),
            # The random-reward control draws whole rows; a dropped zero-spread group would be
            # refilled with draws that have spread by chance, and prefix credit is per token.
            (not (ru.random_reward and s.dynamic_sampling),
             "rewards.random_reward with sampling.dynamic_sampling: the control's random draws give spread to "
             "groups that had none, so dynamic sampling would select on noise; turn one of them off"),
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
            (o.updates_per_batch >= 1, f"optim.updates_per_batch={o.updates_per_batch}: must be >= 1 (1 = one update per rollout batch)"),
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
            (p.steps >= 0, f"phase.steps={p.steps}: must be >= 0"),
            (p.prompts_per_step >= 1, f"phase.prompts_per_step={p.prompts_per_step}: must be >= 1"),
            (bool(p.mixture) and all(v >= 0 for v in p.mixture.values()) and sum(p.mixture.values()) > 0,
             f"phase.mixture={p.mixture}: needs at least one stage with positive probability"),
            (set(p.mixture) <= {1, 2, 3, ALL}, f"phase.mixture={p.mixture}: stages are 1, 2 and 3 (or all: every usable row)"),
            (bool(p.init.strip()), "phase.init is empty: use auto, base, a selector like A:best_structure, or a path"),
            (bool(r.run_dir.strip()), "run.run_dir is empty: name a directory for checkpoints and logs"),
            # numpy's legacy seeding (seed_everything) takes 0 .. 2**32 - 1 only
            (0 <= r.seed < 2**32, f"run.seed={r.seed}: must be in [0, 2**32)"),
            (bool(r.data.strip()), "run.data is empty: use synthetic, a data.jsonl directory, a parquet file or a datasets directory"),
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
        checks.append((self.data.max_images >= 1, f"data.max_images={self.data.max_images}: must be >= 1 (images one "
                                                  "prompt may show)"))
        for name in r.report_to:
            checks.append((name in REPORT_TO, f"run.report_to names {name!r}: trackers are {_one_of(tuple(REPORT_TO))}"))
            module, package = REPORT_TO.get(name, (name, name))
            checks.append((name not in REPORT_TO or importlib.util.find_spec(module) is not None,
                           f"run.report_to names {name}, which needs the {package} package: pip install 'vlgrpo[{name}]' "
                           f"(or pip install {package}), or drop {name} from --run.report_to"))
        unknown = [k for k in self.data.columns if k not in ROW_FIELDS]
        checks.append((not unknown, f"data.columns names the field {unknown[0] if unknown else ''!r}, which no row "
                                    f"has: fields are {', '.join(ROW_FIELDS)} (write field=column)"))
        checks.append((r.data != "synthetic" or not self.data.columns,
                       "data.columns maps the columns of --run.data, and the synthetic curriculum has none: "
                       "drop it or give --run.data"))
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
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
        return self

    def _check_types_and_finite(self) -> None:
        """Each field holds its declared type, and every number is finite (lr=inf trains NaN)."""
        for sec_name in _fields(self):
            section = getattr(self, sec_name)
            hints = typing.get_type_hints(type(section))
            for name in _fields(section):
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


# ----------------------------------------------------------------------------- presets


def phase_preset(phase: str) -> TrainConfig:
    """The defaults of one curriculum phase on the embedded tiny model."""
    if phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r}: use one of {', '.join(PHASES)}")
    cfg = TrainConfig()
    cfg.phase.name = phase
    # dicts copied: a config's weights or mixture must never alias the table's
    return apply_overrides(cfg, {k: dict(v) if isinstance(v, dict) else v for k, v in PHASE_DEFAULTS[phase].items()})


def trains_from_scratch(name: str) -> bool:
    """'tiny-random', or a directory build_tiny_model wrote: random weights to start (the
    shipped 'tiny' is pretrained and trains like any pretrained model)."""
    from pathlib import Path

    return name == "tiny-random" or (Path(name) / "vlgrpo_build.json").is_file()


def phase_init(phase: str, model_name: str) -> str:
    """The checkpoint a phase starts from by default. Phase A starts from the pretrained
    base as loaded (the staged paper starts from Qwen2.5-VL-7B-Instruct); only a model
    trained from scratch starts A from its own warm-up, since RL on random weights learns
    nothing. ``--init warmup:latest`` starts A from a warm-up on any model."""
    if phase == "A" and trains_from_scratch(model_name):
        return "warmup:latest"
    return PHASE_INIT[phase]


# Named presets: config keys applied after the phase's defaults. Keys under "grpo" apply to
# the GRPO phases only: the warm-up samples no rollouts, and a rollout setting in its saved
# config would only mislabel it.
PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: tiny model, synthetic curriculum, CPU.
    # Rollouts from the merged copy: on this CPU 2.3x the plain path's decode tokens/s and a
    # 26% shorter GRPO step, its log-probs within 1e-3 of the trainer's (bench/RESULTS.md);
    # the sequence-level mask at C = 3 drops whatever a larger mismatch would make off-policy.
    "tiny": {"model.load_in_4bit": True,
             "grpo": {"sampling.rollout": "merged", "optim.rollout_correction": "sequence"}},
    # Qwen2.5-VL-7B-Instruct on one GPU, as in the staged paper: 4-bit base, rank-8 LoRA.
    "qwen7b": {
        "model.name": "Qwen/Qwen2.5-VL-7B-Instruct", "model.dtype": "bfloat16", "model.load_in_4bit": True,
        "model.image_size": 448, "model.gradient_checkpointing": True, "model.device": "cuda",
        # Real images are resized into [56^2, 448^2] px like the synthetic renders (which 448^2
        # leaves as they are): at most 256 visual tokens per image, not Qwen's 16384.
        "model.max_pixels": 448 * 448, "model.min_pixels": 56 * 56,
        "sampling.max_new_tokens": 256, "sampling.G": 8, "optim.lr": 1e-5, "phase.prompts_per_step": 8,
        # Training passes of 4 groups: the memory plan predicts an 11.8 GiB peak at these lengths
        # (a 16 GB card; all 64 rows at once: 16.7 GiB; python -m bench.memory --preset qwen7b).
        "optim.micro_batch_rows": 32,
        # 7B budgets: a greedy evaluation (and its shuffled-image control) decodes eval_size x 2
        # prompts x 256 tokens, so a smaller subset and a slower cadence than the tiny model's
        # 200 every 20 steps; a latest-only save every 10 steps (~10 minutes of a 7B step).
        "run.eval_size": 100, "run.eval_every": 40, "run.save_every": 10, "run.test_per_stage": 50,
        # The merged bf16 rollout copy (--sampling.rollout merged) samples from a slightly other
        # function than the NF4 + LoRA trainer: over 256 tokens a sequence-level ratio drifts far
        # from 1 (its log is a sum of 256 per-token terms), so weight each token, capped at 2
        # (TIS). With the plain path the sampler is the trainer and every weight is 1.
        "grpo": {"optim.rollout_correction": "token", "optim.rollout_correction_mode": "truncate",
                 "optim.rollout_correction_cap": 2.0},
    },
}


# Which preset a real Qwen2.5-VL trains with when --preset is not given. The released sizes
# by their language model's hidden_size (config.json); only the 7B has a preset. The others
# are refused rather than mapped to qwen7b: its memory plan (micro-batches, 448 px, 256
# tokens) and lr are the 7B's, a 72B does not fit where they fit and a 3B wastes the card;
# `--preset qwen7b` on them is a choice the user makes, not one made for them.
QWEN25VL_SIZES = {2048: "3B", 3584: "7B", 5120: "32B", 8192: "72B"}
SIZE_PRESETS = {"7B": "qwen7b"}
_REAL_SIZE = 1024  # hidden_size from which a Qwen2.5-VL is a real one, not a test-sized model


def _local_qwen_size(path: Any) -> str | None:
    """A local Qwen2.5-VL directory's size ("7B", or "hidden_size N" for an unknown one);
    None for a model of test size, another model type, or a config that cannot be read (the
    model load says what is wrong with it, later)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "qwen2_5_vl":
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    hidden = text.get("hidden_size", cfg.get("hidden_size"))
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < _REAL_SIZE:
        return None
    return QWEN25VL_SIZES.get(hidden, f"hidden_size {hidden}")


def preset_for_model(name: str) -> tuple[str, str] | None:
    """The preset a --model.name implies when no --preset is given: (preset, the line to
    print), or None to keep the default (tiny models, paths that do not exist: the model
    load reports those). A hub id or a local real-size Qwen2.5-VL that no preset fits is one
    ConfigError naming it and the presets. Reads at most a local config.json: nothing is
    loaded or downloaded, so it runs before the run's first check."""
    from pathlib import Path

    if name in ("tiny", "tiny-random"):
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        size = _local_qwen_size(path)
    elif not name.startswith((".", "/", "~")) and name.count("/") == 1 and not path.exists():  # a hub id
        m = re.search(r"qwen2\.5-vl-(\d+)b", name, re.IGNORECASE)
        if m is None:
            raise ConfigError(f"--model.name {name}: no preset is made for this model (presets: {', '.join(PRESETS)}, "
                              "for Qwen2.5-VL-7B); pass --preset explicitly")
        size = f"{m.group(1)}B"
    else:
        return None
    if size is None:
        return None
    preset = SIZE_PRESETS.get(size)
    if preset is None:
        raise ConfigError(f"--model.name {name} is a Qwen2.5-VL of {size}, and no preset is made for it (presets: "
                          f"{', '.join(PRESETS)}; qwen7b is Qwen2.5-VL-7B's); pass --preset qwen7b to start from the "
                          "7B's settings, and size the batch to your memory (--optim.micro_batch_rows)")
    return preset, (f"--model.name {name} is Qwen2.5-VL-{size}: using --preset {preset} (its dtype, 4-bit, image "
                    f"bounds, G, lr and budgets); --preset tiny or another --preset overrides this")


def preset_overrides(preset: str, phase: str) -> dict[str, Any]:
    """The keys a preset sets in one phase (its "grpo" keys in the GRPO phases only)."""
    keys = {k: v for k, v in PRESETS[preset].items() if k != "grpo"}
    return keys | (PRESETS[preset].get("grpo", {}) if phase != "warmup" else {})


# ----------------------------------------------------------------------------- overrides


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _resolve_key(cfg: TrainConfig, key: str) -> tuple[Any, str]:
    """Map 'section.field' or a unique 'field' to (section object, field name)."""
    key = key.replace("-", "_")
    sections = _fields(cfg)
    if "." in key:
        sec, name = key.split(".", 1)
        if sec in sections and name in _fields(getattr(cfg, sec)):
            return getattr(cfg, sec), name
    else:
        owners = [s for s in sections if key in _fields(getattr(cfg, s))]
        if len(owners) == 1:
            return getattr(cfg, owners[0]), key
        if len(owners) > 1:
            raise ConfigError(f"--{key} is ambiguous: write one of " + ", ".join(f"--{s}.{key}" for s in owners))
    known = sorted(f"{s}.{n}" for s in sections for n in _fields(getattr(cfg, s)))
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.7)
    hint = f"did you mean {' or '.join('--' + k for k in near)}? " if near else ""
    raise ConfigError(f"unknown config key --{key}; {hint}known keys: {', '.join(known)}")


def _parse_value(text: str, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
        if typ is str:
            return text
        if origin is tuple:
            return tuple(p.strip() for p in text.split(",") if p.strip())
        if origin is dict:
            ktyp, vtyp = typing.get_args(typ)
            out = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                k, v = item.split("=", 1)
                out[_dict_key(ktyp, k.strip())] = vtyp(v)
            return out
    except ValueError:
        pass
    hint = {bool: "true or false", int: "an integer", float: "a number"}.get(typ, "name=value,name=value" if origin is dict else str(typ))
    raise ConfigError(f"--{key} {text!r}: expected {hint}")


def _dict_key(ktyp: Any, text: str) -> Any:
    """A dict key of type ``ktyp``: str, int, or a union of int and literal names (the stage
    mixture's 1, 2, 3 and "all"); ValueError when it is none of them."""
    options = typing.get_args(ktyp) if typing.get_origin(ktyp) is not None else (ktyp,)
    for option in options:
        if typing.get_origin(option) is Literal:
            if text in typing.get_args(option):
                return text
        else:
            try:
                return option(text)
            except ValueError:
                pass
    raise ValueError(text)


def override(cfg: TrainConfig, key: str, value: str | Any) -> None:
    """Set one field from a CLI string (parsed by the field's type) or a Python value."""
    section, name = _resolve_key(cfg, key)
    hints = typing.get_type_hints(type(section))
    typ = hints[name]
    if isinstance(value, str) and typ is not str:
        value = _parse_value(value, typ, key)
    setattr(section, name, value)


def apply_overrides(cfg: TrainConfig, pairs: dict[str, Any]) -> TrainConfig:
    for k, v in pairs.items():
        override(cfg, k, v)
    return cfg


# Options that may be given more than once: each occurrence adds its NAME=value items (a later
# one for the same NAME wins). Every other option given twice keeps its last value.
REPEATABLE = ("rewards.extra", "extra")


def parse_override_args(argv: list[str]) -> dict[str, str]:
    """['--sampling.G', '4', '--lr=1e-3'] -> {'sampling.G': '4', 'lr': '1e-3'}; a repeated
    ``--rewards.extra`` (any phase prefix) joins its values with commas."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options are written --key value")
        if "=" in arg:
            k, v = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a value: write {arg} VALUE")
            k, v = arg[2:], argv[i + 1]
            i += 2
        repeatable = any(k == r or k.endswith("." + r) for r in REPEATABLE)
        out[k] = f"{out[k]},{v}" if repeatable and k in out else v
    return out


def describe_fields() -> str:
    """A help listing of every key, its default and its docstring (for --help)."""
    import ast
    import inspect

    lines = []
    cfg = TrainConfig()
    for sec_name in _fields(cfg):
        section = getattr(cfg, sec_name)
        docs = _field_docs(type(section), ast, inspect)
        lines.append(f"  [{sec_name}]")
        for name in _fields(section):
            default = getattr(section, name)
            if isinstance(default, tuple):
                default = ",".join(default)
            elif isinstance(default, dict):
                default = ",".join(f"{k}={v}" for k, v in default.items())
            lines.append(f"    --{sec_name}.{name} (default {default})")
            if docs.get(name):
                lines.append(f"        {docs[name]}")
    return "\n".join(lines)


def _field_docs(cls: type, ast: Any, inspect: Any) -> dict[str, str]:
    """Read the one-line docstring that follows each field in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
            docs[node.target.id] = str(nxt.value.value).strip()
    return docs


def from_json(text: str) -> TrainConfig:
    """Rebuild a TrainConfig from its saved JSON (run directory compatibility checks)."""
    raw = json.loads(text)
    cfg = TrainConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"a saved config must be a JSON object of sections, got a {type(raw).__name__}")
    for sec_name, values in raw.items():
        # a checkpoint made by another version (or edited) must not end in an AttributeError
        if sec_name not in _fields(cfg) or not isinstance(values, dict):
            raise ConfigError(f"saved config has an unknown section {sec_name!r} (sections: {', '.join(_fields(cfg))})")
        section = getattr(cfg, sec_name)
        hints = typing.get_type_hints(type(section))
        unknown = sorted(set(values) - set(hints))
        if unknown:
            raise ConfigError(f"saved config section {sec_name!r} has unknown keys {unknown}: "
                              "was it written by another vlgrpo version?")
        for name, value in values.items():
            if typing.get_origin(hints[name]) is tuple:
                value = tuple(value)
            elif typing.get_origin(hints[name]) is dict:
                ktyp = typing.get_args(hints[name])[0]
                try:
                    value = {_dict_key(ktyp, k): v for k, v in value.items()}
                except ValueError as err:
                    raise ConfigError(f"saved config {sec_name}.{name} has an unknown key {err}") from None
            setattr(section, name, value)
    return cfg
