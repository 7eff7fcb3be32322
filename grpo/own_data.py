"""Own data: SFT first where RL alone would get no signal, then RL held near what SFT taught.

GRPO learns only from groups whose completions differ in reward. On a kind of figure the base
never saw, nearly every group scores zero everywhere (a zero advantage: no gradient), and the
few that do not drive the policy to one constant answer. So before ``--phase B --run.data
DIR`` starts RL from the base, ``probe`` samples the base on a few training prompts (G
completions each, the phase's sampling settings) and counts the groups with any correct
completion. Below ``SIGNAL_SHARE`` the plan becomes the warm-up (SFT on the labels, R1-VL's
first stage, sized in passes over the training rows) and then phase B from it (the warm-up's
format is the contract, so phase A's structure stage is skipped), with one line saying so.

Phase B from a warm-up keeps a KL term to the warm-up's policy (its reference, grpo/state/
train_state.py) at ``WARMUP_BETA``: a GRPO gradient of one rollout batch is mostly noise, AdamW
moves every parameter about lr per step whatever its gradient's size, and on own data what SFT
taught lives only in the adapter, so without the anchor the adapter's walk erases it within
tens of steps (bench/EXPERIMENTS.md sections 11-12). On the shipped tiny base the plan also sets
both learning rates (``TINY_LR``): the warm-up's 4e-3 (8x the preset's: at 5e-4 a new kind of
figure is still being learned when the linearly decayed lr is spent, section 17) and B's 1e-4
(a fifth of the preset's, section 12). They were chosen on the previous tiny base (a 2 x 64 vision
tower); on today's (4 x 128) the plan as a whole was measured again on four sets (README "Your own
data"), not each setting against its alternatives. A pretrained model keeps its preset's lr (the
7B's 1e-5) in every phase. The warm-up, and every phase after it, trains LoRA in the vision tower
and its merger too (``PLAN_VISION``): a kind of figure the base never saw is read better with them
(section 13); on the shipped tiny base also on lm_head (``HEAD``), whose rows for tokens its
pretraining never wrote cannot be told apart otherwise (section 16). Options the user set win: an
explicit ``--optim.beta``, ``--B.optim.beta``, ``--optim.lr``, ``--warmup.optim.lr``,
``--B.optim.lr``, ``--lora.vision``, ``--lora.merger``, ``--lora.targets`` or
``--warmup.phase.steps`` is kept, and ``--sft-first`` (auto | always | never) overrides the probe.
A warm-up sized in passes is capped at ``MAX_WARMUP_STEPS`` (one line says so); training rows that
all share one gold answer are refused in one line, whatever ``--sft-first`` says.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.config import TrainConfig
from grpo.errors import ConfigError
from grpo.run.phase_data import fall_back_to_all

SIGNAL_SHARE = 0.5  # below it, most groups teach RL nothing: warm up on the labels first
WARMUP_BETA = 1.0  # KL weight toward the warm-up in RL after it (section 11: .1 drifts, 1 holds)
# Phase B's settings when it starts from this plan's warm-up (each kept where the user sets it)
AFTER_WARMUP = {"optim.beta": WARMUP_BETA}
# Each phase's lr on the shipped tiny base (kept where the user sets it; other models keep their preset's):
# - the warm-up's: 8x the preset's 5e-4 (section 17, 17 passes, seed 0, test EM at 5e-4 / 2e-3 / 4e-3): clock faces
#   .376 / .947 / .982, polygons .265 / .306 / .541 (8e-3: .529), digits .855 / .899 / .950, digit sums .100 / - / .428;
#   at 5e-4 the clock faces' loss is still near .09 when the linearly decayed lr is spent, at 4e-3 it reaches 0;
# - B's after it: a fifth of the preset's 5e-4 (section 12: from a 17-pass warm-up, 5e-4 loses more of it).
TINY_LR = {"warmup": 4e-3, "B": 1e-4}
# LoRA in the vision tower's blocks and in the merger, in the warm-up and in every phase after it
# (which carry its adapters): a new kind of figure is read better with them (section 13; on today's base, seed 0,
# the tower's LoRA off and the merger's on: polygons .341 against .724 after the warm-up, digit sums .369 against
# .520, digits .927 against .972; a warm-up step 0.42 s against 0.55-0.57 s, both beside another run)
PLAN_VISION = {"lora.vision": True, "lora.merger": True}
# LoRA on the output head too, where the base is the shipped tiny one: its pretraining curriculum writes 88 of its 556
# tokens, and the output rows of the other 468 stayed nearly parallel (cosine > .9; in the 2 x 64 tower's base and in
# today's alike), so no adapter below the head can make one of them likely. A warm-up target with such a token ('t'
# of "the answer is") is then learned greedily at p ~ .03, and sampled at temperature 1 it is one of ~460 near-equal
# tokens: RL trains on that noise (section 16). A base pretrained on text writes its whole vocabulary and gets no head
# adapter.
HEAD = "lm_head"
CHOICES = {**AFTER_WARMUP, **PLAN_VISION, "lora.targets": (), "optim.lr": 0.0}  # every setting the plan chooses, typed
WARMUP_PASSES = 17  # the warm-up's size in passes over the training rows (section 12, lr 5e-4: digits' test EM .44
# at 5.6, .64 at 10, .78 at 17, .84 at 25 passes; 17 kept a 2,000-row run within 10 minutes on one core with the
# previous, smaller vision tower; with today's, 13.4 minutes, and 8.7-10.8 for sets of 1,700-1,800 rows, the other
# core busy: README "Your own data")
PROBE_PROMPTS = 16
MAX_WARMUP_STEPS = 1000  # ~12.5 minutes on one core of the 2-core CPU (measured 0.75 s a step of 32 rows, tiny model
# with the tower's LoRA on, the other core busy; 0.55-0.68 s under other loads; 0.41-0.47 s with the previous tower)


@dataclass
class Probe:
    groups: int  # prompts sampled
    with_correct: int  # groups with at least one correct completion
    rows: int  # training rows

    @property
    def share(self) -> float:
        return self.with_correct / max(1, self.groups)


def probe(cfg: TrainConfig, device: str, prompts: int = PROBE_PROMPTS) -> Probe:
    """The base, as phase ``cfg`` would start from it, sampled on ``prompts`` training prompts."""
    from data.mixture import MixtureStream
    from grpo.model.policy import build_policy
    from grpo.model.prompts import encode_prompts
    from grpo.rewards import RewardModel
    from grpo.rollout.sampler import content_tokens, sample
    from grpo.run.phase_data import load_training_data

    train, _ = load_training_data(cfg)
    rows = sum(len(v) for v in train.values())
    examples = MixtureStream(train, cfg.phase.mixture, cfg.run.seed).next_batch(min(prompts, rows))
    bundle = build_policy(cfg, device, verbose=False)
    batch = encode_prompts(bundle, examples, on_bad_image="skip").to(bundle.device)
    G, L = cfg.sampling.G, cfg.sampling.max_new_tokens
    with torch.no_grad():
        out = sample(bundle, batch, G=G, max_new_tokens=L, temperature=cfg.sampling.temperature,
                     top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p,
                     generator=torch.Generator(device=bundle.device).manual_seed(cfg.run.seed))
    kept = [examples[i] for i in batch.kept]
    scores = RewardModel(cfg.rewards, L, tokenizer=bundle.tokenizer)(
        [kept[n // G] for n in range(len(out.texts))], out.texts, num_tokens=content_tokens(out),
        completion_ids=out.completion_ids)
    correct = scores.components["correctness"].view(-1, G) > 0
    return Probe(groups=correct.shape[0], with_correct=int(correct.any(1).sum()), rows=rows)


def sft_first(plan: list[str], configs: dict[str, TrainConfig], user_keys: set[str], device: str,
              choice: str = "auto", root: Path | None = None) -> list[str]:
    """The plan for own data: ``plan`` as is, or the warm-up and then B (and C) from it (``configs``
    changed in place: the warm-up's steps and adapters, B's start, KL weight and lr).
    Prints the one line. With a warm-up in the run directory (``root``) what was chosen before
    is kept: a resumed B its KL weight and lr, the warm-up, B and C the warm-up's adapters."""
    if choice not in ("auto", "always", "never"):
        raise ConfigError(f"--sft-first {choice!r}: use auto, always or never")
    if configs[plan[0]].run.data == "synthetic":
        return plan
    plan, line = _choose(plan, configs, user_keys, device, choice)
    if root is not None:
        _keep_saved_choices(plan, configs, root, user_keys)
    if line:  # said once the saved choices are in: a warm-up begun before keeps its adapters
        warm = configs["warmup"]
        print(f"{line}; LoRA in the vision tower {_on(warm.lora.vision)}, merger {_on(warm.lora.merger)} and "
              f"lm_head {_on(HEAD in warm.lora.targets)}; --sft-first never runs RL alone", flush=True)
    return plan


def _choose(plan: list[str], configs: dict[str, TrainConfig], user_keys: set[str], device: str,
            choice: str) -> tuple[list[str], str | None]:
    """``sft_first``'s decision for own data from the command alone (nothing saved read yet):
    (the plan, the start of the line that says why it warms up first, or None)."""
    first = configs[plan[0]]
    check_answers_vary(first)
    if plan[:2] != ["A", "B"] or choice == "never":
        return plan, None
    found = probe(first, device) if choice == "auto" else None
    if found is not None and found.share >= SIGNAL_SHARE:
        print(f"own data: the base answered {found.with_correct} of {found.groups} probe prompts correctly at "
              f"least once in G={first.sampling.G} samples ({found.share:.0%} >= {SIGNAL_SHARE:.0%}): RL has signal, "
              f"running {' -> '.join(plan)} (--sft-first always warms up on the labels first)")
        return plan, None
    warm, b = configs["warmup"], configs["B"]
    fall_back_to_all({"warmup": warm})  # no MathVista metadata: the warm-up too reads every row
    rows = found.rows if found is not None else _training_rows(warm)
    if not _set(user_keys, "warmup", "phase.steps"):
        warm.phase.steps = max(1, math.ceil(WARMUP_PASSES * rows / warm.phase.prompts_per_step))
        if warm.phase.steps > MAX_WARMUP_STEPS:
            print(f"own data: {WARMUP_PASSES} passes over {rows} rows would be {warm.phase.steps} warm-up steps; "
                  f"capped at {MAX_WARMUP_STEPS} ({MAX_WARMUP_STEPS * warm.phase.prompts_per_step / rows:.1f} passes: "
                  "a larger set needs fewer); --warmup.phase.steps sets another size", flush=True)
            warm.phase.steps = MAX_WARMUP_STEPS
    if rows < warm.phase.prompts_per_step:
        raise ConfigError(f"own data: {rows} training rows are too few to warm up on ({warm.phase.prompts_per_step} "
                          "a step, --warmup.phase.prompts_per_step); add rows, or run RL alone with --sft-first never")
    b.phase.init = "warmup:latest"
    for key, value in AFTER_WARMUP.items():
        if not _set(user_keys, "B", key):
            _assign(b, key, value)
    after = [p for p in plan if p != "A"]
    for phase in ["warmup"] + after:
        cfg = configs[phase]
        for key, value in PLAN_VISION.items():
            if not _set(user_keys, phase, key):
                _assign(cfg, key, value)
        if cfg.model.name != "tiny":
            continue
        if HEAD not in cfg.lora.targets and not _set(user_keys, phase, "lora.targets"):
            _assign(cfg, "lora.targets", (*cfg.lora.targets, HEAD))
        if phase in TINY_LR and not _set(user_keys, phase, "optim.lr"):
            _assign(cfg, "optim.lr", TINY_LR[phase])
    why = (f"the base answered {found.with_correct} of {found.groups} probe prompts correctly at least once in "
           f"G={first.sampling.G} samples ({found.share:.0%} < {SIGNAL_SHARE:.0%}): RL alone would get almost no signal"
           if found is not None else "--sft-first always")
    line = (f"own data: {why}; so the warm-up first (SFT on the labels: {warm.phase.steps} steps x "
            f"{warm.phase.prompts_per_step} = {warm.phase.steps * warm.phase.prompts_per_step / max(1, rows):.1f} "
            f"passes over {rows} rows at lr {warm.optim.lr:g}), then phase B from it with a KL to it (beta "
            f"{b.optim.beta:g}), lr {b.optim.lr:g}{', guided groups' if b.sampling.guided else ''}")
    return ["warmup"] + after, line


def check_answers_vary(cfg: TrainConfig) -> None:
    """Refuse training rows that all have one gold answer: always answering it scores 1.0, so
    neither SFT nor RL has anything to learn about the figures (most often a mapped column that is
    not the answer)."""
    from data.contract import normalize_number
    from grpo.run.phase_data import load_training_data

    train, _ = load_training_data(cfg)
    answers = {normalize_number(ex.answer) or ex.answer for rows in train.values() for ex in rows}
    rows = sum(len(v) for v in train.values())
    if rows > 1 and len(answers) == 1:
        raise ConfigError(f"own data: all {rows} training rows of {cfg.run.data} have the gold answer {answers.pop()!r}: "
                          "answering it always scores 1.0, so there is nothing to learn from the figures; check the "
                          "answer column (--data.columns answer=COLUMN)")


def _keep_saved_choices(plan: list[str], configs: dict[str, TrainConfig], root: Path, user_keys: set[str]) -> None:
    """With a warm-up in ``root``, the plan's phases go on with what was chosen for them before,
    each unless the command sets it: a resumed phase B its ``AFTER_WARMUP`` (KL weight) and lr,
    the warm-up its lr (its schedule continues), and the warm-up, B and C the warm-up's adapters
    (``PLAN_VISION`` and the targets, lm_head among them or not: a warm-up begun before keeps its
    own, and dropping trained adapters is refused)."""
    if not (root / "warmup").is_dir():
        return
    if plan == ["B"]:
        _keep(configs["B"], "B", root / "config_B.json", [*AFTER_WARMUP, "optim.lr"], user_keys)
    for phase in plan:
        if phase in ("warmup", "B", "C"):
            keys = [*PLAN_VISION, "lora.targets"] + (["optim.lr"] if phase == "warmup" else [])
            _keep(configs[phase], phase, root / "config_warmup.json", keys, user_keys)


def _keep(cfg: TrainConfig, phase: str, saved: Path, keys: Iterable[str], user_keys: set[str]) -> None:
    try:
        config = json.loads(saved.read_text())
        for key in keys:
            if not _set(user_keys, phase, key):
                section, name = key.split(".")
                _assign(cfg, key, config[section][name])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no saved config, or an unreadable one: the resume's own checks say so


def _assign(cfg: TrainConfig, key: str, value) -> None:
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, type(CHOICES[key])(value))


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _set(user_keys: set[str], phase: str, key: str) -> bool:
    """Whether the command line (or --config) set ``key`` for ``phase`` (a phase.* key without a
    phase prefix belongs to the requested phase, never the warm-up this plan adds)."""
    if f"{phase}.{key}" in user_keys:
        return True
    return not key.startswith("phase.") and (key in user_keys or key.split(".")[-1] in user_keys)


def _training_rows(cfg: TrainConfig) -> int:
    from grpo.run.phase_data import load_training_data

    train, _ = load_training_data(cfg)
    return sum(len(v) for v in train.values())
