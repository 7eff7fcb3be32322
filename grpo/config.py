"""Configuration: one dataclass per concern, and every default that depends on the phase.

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
Beside this file: grpo/config_checks.py (``TrainConfig.validate``: what a value may be),
grpo/overrides.py (``--key value`` onto a config, the --help listing, a saved config read
back) and grpo/presets.py (each phase's defaults, the named presets).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from data.rows import MAX_IMAGES
from grpo.config_checks import PHASES, validate_config
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
assert tuple(PHASE_DEFAULTS) == PHASES  # in curriculum order (grpo/config_checks.py)
PHASE_WEIGHTS: dict[str, dict[str, float]] = {  # the GRPO phases' weights (the controller starts from them)
    phase: d["rewards.weights"] for phase, d in PHASE_DEFAULTS.items() if "rewards.weights" in d}
# The checkpoint each phase starts from by default (phase_init).
PHASE_INIT: dict[str, str] = {"warmup": "base", "A": "base", "B": "A:best_structure", "C": "B:best_composite"}
# The warm-up of a model trained from scratch (a random vision tower) adds the perception
# supervision of grpo/warmup/perception.py: a pretrained model already sees, so it never gets these.
PERCEPTION_DEFAULTS: dict[str, Any] = {"phase.perception_steps": 800, "optim.perception_weight": 1.0}


def reported_to(run: "RunConfig") -> tuple[str, ...]:
    """The trackers a run writes to: run.report_to, with tensorboard when run.tensorboard is on."""
    names = tuple(dict.fromkeys(run.report_to))
    return names if not run.tensorboard or "tensorboard" in names else ("tensorboard", *names)


def weigh_plugins(rewards: "RewardConfig") -> None:
    """A plug-in named in rewards.extra without a weight enters the reward at 1.0 (an explicit
    weight, 0 included, is kept): a plug-in must not be loaded and then silently unpaid."""
    for name in rewards.extra:
        if name not in rewards.weights:
            rewards.weights = {**rewards.weights, name: 1.0}


@dataclass
class ModelConfig:
    name: str = "tiny"
    """'tiny' (the shipped pretrained model), 'tiny-random' (its architecture, random weights), a local directory, or a hub
    id."""
    dtype: str = "float32"
    """Compute dtype of the base: float32 (CPU default) or bfloat16 (GPU)."""
    load_in_4bit: bool = False
    """Quantise the language model's linear layers to NF4 (bitsandbytes, double quant) under the LoRA (the tiny preset: on;
    its from-scratch warm-up trains every weight in float32 and each GRPO phase quantises that base)."""
    image_size: int = 112
    """Side of the synthetic images in pixels (112 px = 16 visual tokens after merging)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (every pass with grad runs in
    training mode so that transformers honours it; the 7B needs it)."""
    max_pixels: int = 0
    """Largest image area in pixels handed to Qwen's processor (real images are resized to fit, as Qwen's own processor
    does; one visual token per 28x28 px); 0 = the checkpoint's processor config."""
    min_pixels: int = 0
    """Smallest image area in pixels (smaller images are upscaled to it); 0 = the checkpoint's processor config."""
    max_prompt_tokens: int = 0
    """Prompts longer than this many tokens (visual tokens included) are skipped and counted: in GRPO draws (the step's log
    line) and evaluations (the eval line); the SFT warm-up trains on every example (0 = no cap)."""
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
    """LoRA on the vision tower's blocks too (model.visual.blocks: lora.vision_targets), trained at optim.vision_lr_scale x
    lr, the tower recomputed with grad once per prompt in the training passes; false = the tower frozen (EasyR1's
    freeze_vision_tower, ms-swift's freeze_vit)."""
    vision_targets: tuple[str, ...] = ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    """Module-name suffixes adapted inside the vision blocks when lora.vision is on (attention qkv / proj, the SwiGLU MLP)."""
    merger: bool = False
    """LoRA on the vision merger too (the projector from 2x2 patches to one language-model token, model.visual.merger: its
    two linears), trained at optim.merger_lr_scale x lr; false = frozen (ms-swift's freeze_aligner)."""
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
    """The controller's reach: its vanishing-advantage gate (more than half the groups without reward spread at a
    checkpoint) raises the sampling temperature by .1 per checkpoint up to this (R1-VL's 1.2), never above; at or below
    sampling.temperature it never raises it. In (0, 5]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    rollout: str = "plain"
    """Decode path of the rollouts: plain (the policy's 4-bit + LoRA layers) or merged (a copy in the compute dtype with
    LoRA merged, CUDA graph on GPUs; the tiny preset's)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose G rewards are all equal, refill from the stream
    (grpo/rollout/dynamic_sampling.py)."""
    max_refills: int = 4
    """Dynamic sampling: at most this many refill rounds per step; then train on what was kept (none kept: stop)."""
    noisy_fraction: float = 0.0
    """NoisyRollout (arXiv 2504.13055): this fraction of each group's G completions is sampled from its image with Gaussian
    noise added (the rest from the clean image), the advantages taken over the whole group; every row is trained
    conditioned on the clean image (grpo/rollout/noisy.py; 0 = off; the paper mixes half and half)."""
    noise_std: float = 0.5
    """NoisyRollout: the noise's standard deviation at the phase's first step, in the processor's normalised pixel units,
    annealed to 0 by the phase's last step (sampling.noisy_fraction > 0)."""
    guided: bool = False
    """Guided groups (LUFFY, arXiv 2504.14945): a group none of whose G completions is correct gets the example's gold, in
    the contract, in its last row, scored like the others (grpo/rollout/guided.py); the log's "guided" is the share."""
    accuracy_low: float = 0.0
    """Dynamic sampling's accuracy band, lower end: keep a group only if its mean correctness (fraction of its G
    completions right) is >= this (EasyR1's online_filtering: 0.01); 0 and accuracy_high 1 = no band."""
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
    """Peak learning rate of AdamW on the LoRA parameters; 0 in a GRPO phase = the frozen-policy control (sampled, scored,
    logged, never updated)."""
    schedule: str = "constant"
    """Learning-rate schedule after warm-up: constant, linear or cosine (to 10% of lr)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay on LoRA parameters."""
    vision_lr_scale: float = 1.0
    """The vision tower's learning rate as a fraction of lr: its LoRA's with lora.vision (must be > 0; 1 = the language
    model's lr); in the warm-up of a random base, the whole tower's, merger included (0 = frozen)."""
    merger_lr_scale: float = 1.0
    """The merger's LoRA learning rate as a fraction of lr, with lora.merger (must be > 0; 1 = the language model's lr)."""
    perception_weight: float = 0.0
    """Warm-up of a random base: weight of the per-visual-token perception loss (grpo/warmup/perception.py; 0 = off; the
    tiny model's warm-up: 1)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    accumulation: int = 1
    """Rollout batches (of phase.prompts_per_step prompts x G) sampled and accumulated per optimiser step."""
    micro_batch_rows: int = 0
    """Rows (completions) per training pass: the policy and reference log-probs, the loss and backward run over
    micro-batches of this many rows of each rollout batch, gradients accumulated (TRL's per_device_train_batch_size);
    whole groups, so a multiple of G dividing the batch's rows; 0 (or the batch's rows or more) = all rows in one pass.
    python -m bench.memory says which fits a GPU."""
    logits_chunk_tokens: int = 1024
    """Completion tokens per LM-head chunk in the log-prob passes: the logits exist for one chunk at a time and are
    recomputed in backward (whole rows: max(1, this // T) rows per chunk)."""
    shared_prefix: bool = True
    """The log-prob passes run each group's prompt through the language model once (B rows) and attend the G completions to
    its keys and values (grpo/model/shared_prefix.py): the same log-probs and gradients as running the prompt in all B*G
    rows (False: the full-row pass, the reference), with 1/G of the prompt's compute and saved activations."""
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
    """mu: optimiser steps per rollout batch (PPO epochs); the ratio is taken against the sampling policy, so the clip
    binds from the 2nd."""
    warmup_moments: bool = False
    """RL from an SFT warm-up continues the warm-up's AdamW moments instead of fresh ones: each update is then scaled by
    the warm-up's gradient sizes, not renormalised to about lr per parameter (bench/EXPERIMENTS.md section 11). Only when
    the phase starts from a warm-up's adapter."""
    kl_bias_correction: bool = False
    """KL term ratio * k (k: optim.kl_estimator) with the gradient through the ratio (TRL's use_bias_correction_kl); needs
    beta > 0."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss -= entropy_coef * the policy's token entropy, aggregated over the loss's tokens as
    optim.loss_type aggregates (TRL's entropy_coef, verl's entropy_coeff); its gradient runs through the chunked LM-head
    pass (grpo/model/logprobs.py). In [0, 1]; 0 = off, no extra work."""
    kl_estimator: str = "k3"
    """Per-token KL estimate in the beta term, d = ref - logp: k1 = -d, k2 = d^2/2 (its gradient is the KL's), k3 = exp(d)
    - d - 1 (DeepSeekMath's); docs/grpo_loss.md compares them. Needs beta > 0 unless k3."""
    adv_mode: str = "total"
    """Advantage source: total (z-score of the weighted reward) or components (sum_k w_k/sum(w) z(r_k), each term alone)."""
    adv_std_floor: float = 0.0
    """Divide by max(std, floor) instead of std, so a tiny tie-breaker spread is not stretched to a full advantage (0 =
    off)."""
    rollout_correction: str = "off"
    """Weight the policy term by pi_train / pi_sampler of the sampled tokens: off, token (low variance, biased) or sequence
    (unbiased, variance grows with length); grpo_kernels/grpo_loss.py."""
    rollout_correction_mode: str = "mask"
    """Above the cap: truncate (TIS, weight min(ratio, C): keeps every sample, biased) or mask (MIS, weight 0: drops
    samples a large mismatch made untrustworthy)."""
    rollout_correction_cap: float = 3.0
    """C, the largest rollout ratio kept (> 1; TRL's default: sequence level, mask, 3)."""
    guided_gamma: float = 0.0
    """Guided groups' demonstration rows (sampling.guided): 0 = trained like a sampled row (the PPO term, ratio to the
    policy); gamma > 0 = LUFFY's policy shaping, -A * pi / (pi + gamma) per token, no clip (the paper's 0.1)."""
    mask_truncated: bool = False
    """Completions that hit sampling.max_new_tokens without a stop token get loss mask 0 (TRL's mask_truncated_completions,
    DAPO's overlong filtering); they keep their rewards and still count in their group's advantage statistics."""


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
    """L_cache of the overlong component (DAPO's soft overlong punishment, on when rewards.weights names overlong): the
    penalty ramps from 0 at max_new_tokens - L_cache tokens to -overlong_penalty at max_new_tokens; 0 = a fifth of
    max_new_tokens."""
    overlong_penalty: float = 1.0
    """The overlong component's value at the budget (verl's penalty_factor; 1 = DAPO: -1 when truncated); > 0."""
    extra: dict[str, str] = field(default_factory=dict)
    """Your own reward components, NAME=module:function (comma separated): function(examples, completions) -> one finite
    float per completion; weight 1 unless rewards.weights names it (README, "Your own reward")."""


@dataclass
class PhaseConfig:
    name: str = "B"
    """Curriculum phase: warmup (SFT), A (structure), B (correctness), C (harder, tolerance)."""
    steps: int = 60
    """Optimiser steps in this phase."""
    prompts_per_step: int = 4
    """B: distinct prompts per step (each sampled G times)."""
    mixture: dict[int | Literal["all"], float] = field(default_factory=lambda: dict(PHASE_DEFAULTS["B"]["phase.mixture"]))
    """Curriculum stage (1, 2, 3, or all: every usable row, whatever its metadata) -> sampling probability; on data without
    MathVista metadata the phase defaults become all=1.0."""
    init: str = "auto"
    """Start point: auto (the phase preset's alias), base, a selector like A:best_structure, or a path."""
    controller: bool = True
    """Run the metric-gated controller after each checkpoint eval."""
    perception_steps: int = 0
    """Warm-up of a random base: steps on image captions (image-only prompt) before the worked-reasoning SFT (the tiny
    model's warm-up: 800)."""
    val_every: int = 0
    """Warm-up: also evaluate on the held-out validation rows every this many SFT steps (its validation curve, printed
    and logged; 0 = only at the end). The GRPO phases evaluate every run.eval_every steps."""
    patience: int = 0
    """Warm-up with val_every: stop once this many evaluations in a row found no higher validation EM than the best one
    before them (0 = run every step). The stopped warm-up is finished there, with that step's weights."""


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
    stop_on_collapse: bool = False
    """Stop the run (exit 1, after the checkpoint is saved) at an evaluation where the policy gives one answer to every prompt."""
    run_prior_phases: bool = True
    """If the phase's init checkpoint is missing, run the earlier phases first."""
    test_per_stage: int = 100
    """Held-out synthetic test examples per stage in the end-of-run report (0 = no report)."""
    cpu_threads: int = 1
    """torch CPU threads (0 = torch's default). The tiny model's matmuls gain nothing from
    more, and OpenMP spin-waits collapse (10x slower, measured) when the cores are shared."""
    tensorboard: bool = False
    """Also write every number of train_log.jsonl as a TensorBoard scalar, in <run_dir>/tensorboard/ (tensorboard extra);
    the same as tensorboard in run.report_to."""
    report_to: tuple[str, ...] = ()
    """Experiment trackers that also get every logged number, the resolved config and each evaluation's sample completions
    with their images: tensorboard, wandb, mlflow (comma separated; each its optional extra, e.g. pip install
    'vlgrpo[wandb]'); grpo/run/trackers.py."""
    collective_timeout_s: float = 300.0
    """Data parallel (torchrun): seconds a collective may wait for a rank before every rank
    stops with one line naming the rank that did not arrive (the warm-up's wait for rank 0
    is exempt). A step's ranks arrive within seconds of each other; a hung one never does."""


@dataclass
class DataConfig:
    columns: dict[str, str] = field(default_factory=dict)
    """Column map for --run.data: field=column pairs naming the dataset's column for a field this project reads (pid,
    question, answer, image, images, answer_type, question_type, precision, choices, unit, metadata, query), e.g.
    question=query,answer=label,image=img; a field left out is read from its own name."""
    max_images: int = MAX_IMAGES
    """Most images one prompt of --run.data may show (a row's `images` list; EasyR1's limit_images): a row with more is
    skipped and counted (too_many_images); each image costs up to model.max_pixels / 784 visual tokens."""


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
        """Reject impossible values with one line that names the field and the fix
        (grpo/config_checks.py ``validate_config``); returns the config."""
        return validate_config(self)
