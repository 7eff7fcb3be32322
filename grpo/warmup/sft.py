"""Policy warm-up by supervised fine-tuning on worked reasoning (R1-VL's first stage).

R1-VL (StepGRPO) starts RL from a model that has seen the reasoning format once: an SFT
pass on worked solutions, so that the policy's samples contain reasoning steps the
step-wise rewards can credit. This module is that pass.

What is specific to a tiny model trained from scratch
----------------------------------------------------
A real run starts from Qwen2.5-VL-7B-*Instruct*: a model that can already see and read,
and follows our output contract only part of the time (the staged paper measured 25%
parseable answers on MathVista). ``tiny-random`` starts from random weights, so there the
warm-up plays three roles (``python -m grpo.pretrain`` runs it, longer, to build the
shipped ``tiny`` model, which GRPO then starts from like any pretrained model):

1. it teaches perception, in two stages, the way real VLMs are built (an encoder that
   knows what is in a picture, then an alignment stage on captions, then instructions):
     a. *perception*: the prompt is the image alone and the target its caption, every
        quantity the picture shows in the worked reasoning's grammar ("red circles: 3.
        blue squares: 2."; ``Example.caption``). Every number of it is read off the
        image; a worked solution reads one or two, and the rest of its tokens are
        template the LM learns long before it learns to look.
     b. *worked reasoning*: the question-answer SFT below, which now starts from an LM
        that reads.
   Throughout, ``grpo/warmup/perception.py`` supervises every merged visual token with what
   the renderer drew in its cell (shape, number, colour, position), which keeps the
   vision tower's output informative (without it, it collapses to one vector for all
   images within ~10 steps). Measured on stage 1 (greedy test EM, true vs shuffled
   images): without captions 0.26 vs 0.19 after 600 x 32 steps; with 600 caption
   steps first and 300 QA steps, 0.72 vs 0.19.
2. it teaches the arithmetic of the worked solutions (all weights train: a LoRA on a
   random base could not learn to see), and
3. it leaves an *imperfect* instruct-like base on purpose. Each question family has a
   house style: on "compliant" families most targets follow the contract, on the others
   most targets are free-form ("... The answer is 7."). Greedy decoding then follows the
   contract on roughly the compliant share of questions (20-40%), while sampling still
   produces the contract now and then on every family -- which is exactly the reward
   spread GRPO needs to fix the rest in phase A.

For a pretrained model (anything but "tiny") the same loop trains only the LoRA
parameters, every target follows the contract (``compliance=None``) and there is no
perception stage: the model already sees.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from data.contract import gold_response
from data.mixture import MixtureStream
from data.schema import Example
from grpo.config import TrainConfig
from grpo.config_checks import trains_from_scratch
from grpo.errors import ConfigError
from grpo.evaluation.model_eval import checkpoint_eval, print_eval
from grpo.model.load import load_bundle
from grpo.model.lr_groups import lr_groups, set_lr
from grpo.model.policy import build_policy, input_bounds, load_base_weights
from grpo.model.prompts import encode_prompts
from grpo.run.files import RunFiles
from grpo.run.guard import StepGuard
from grpo.run.phase_data import eval_subset, load_training_data
from grpo.run.prefetch import prefetch
from grpo.run.progress import Progress
from grpo.run.schedule import SaveClock, lr_at
from grpo.run.stop import EvalAbandoned, Stopped, stop_message
from grpo.state.checkpoint import save_checkpoint
from grpo.state.contents import adapter_tensors, base_tensors
from grpo.state.layout import CheckpointError
from grpo.state.registry import read_registry
from grpo.state.resume import resume_point
from grpo.state.rng import restore_rng
from grpo.warmup.perception import PerceptionHead, capture_visual_tokens, token_labels
from grpo_infra.signals import STOP
from lora import enable_gradient_checkpointing, load_lora_state_dict, lora_state_dict

# Families whose warm-up targets mostly follow the contract. The rest mostly answer in
# free form. (Counting scenes, line plots, cylinders and region sums are "sloppy".)
COMPLIANT_FAMILIES = frozenset({"table_read", "bar_chart", "grid_geometry"})


@dataclass
class SFTStyle:
    """How often a warm-up target follows the contract."""

    p_compliant_family: float = 0.85
    """P(contract) for targets of COMPLIANT_FAMILIES."""
    p_other_family: float = 0.2
    """P(contract) for every other family: low, but not zero, so RL can sample it."""


def warmup_target(ex: Example, rng: random.Random, style: SFTStyle | None) -> str:
    """The SFT response for one example: the contract, or (style permitting) a free-form answer."""
    if style is None:
        return gold_response(ex.reasoning, ex.answer)
    family = ex.metadata.get("family", "")
    p = style.p_compliant_family if family in COMPLIANT_FAMILIES else style.p_other_family
    if rng.random() < p:
        return gold_response(ex.reasoning, ex.answer)
    # Free-form answers an instruct model typically gives. None is parseable under the
    # contract, and none starts with <REASONING>, so the first token decides the format.
    # All read the figure first: an "Answer: 7. <reasoning>" target (an earlier variant)
    # trains the answer to be guessed before anything is read off the image.
    reasoning = ex.reasoning or f"the answer is {ex.answer}."
    return rng.choice([
        f"{reasoning} The answer is {ex.answer}.",
        f"{reasoning} That makes {ex.answer}.",
        f"{reasoning} So it is {ex.answer}.",
    ])


def build_sft_batch(bundle, examples: Sequence[Example], targets: Sequence[str],
                    image_only: bool = False) -> dict[str, torch.Tensor]:
    """Prompt (left-padded, from grpo.model.encode_prompts) + target + <|im_end|> (right-padded).

    Returns model inputs plus ``labels`` [B, S] with -100 everywhere except target tokens.
    ``image_only``: the prompt is the image without the question (the perception stage).
    """
    # max_prompt_tokens=0: the warm-up trains on every example (its targets follow the prompts
    # row for row); the cap bounds the GRPO passes and evaluations.
    prompts = encode_prompts(bundle, examples, image_only=image_only, max_prompt_tokens=0)
    tok = bundle.tokenizer
    tgt = [tok(t, add_special_tokens=False)["input_ids"] + [bundle.eos_token_id] for t in targets]
    B, P = prompts.input_ids.shape
    T = max(len(t) for t in tgt)
    input_ids = torch.full((B, P + T), bundle.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    labels = torch.full((B, P + T), -100, dtype=torch.long)
    input_ids[:, :P], attention_mask[:, :P] = prompts.input_ids, prompts.attention_mask
    for b, t in enumerate(tgt):
        input_ids[b, P:P + len(t)] = torch.tensor(t)
        attention_mask[b, P:P + len(t)] = 1
        labels[b, P:P + len(t)] = torch.tensor(t)
    mm = torch.zeros_like(input_ids)
    mm[:, :P] = prompts.mm_token_type_ids
    return dict(input_ids=input_ids, attention_mask=attention_mask, mm_token_type_ids=mm,
                pixel_values=prompts.pixel_values, image_grid_thw=prompts.image_grid_thw, labels=labels)


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over target tokens (logits only where labels exist)."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = model.model(**inputs).last_hidden_state  # [B, S, d], S = prompt + target tokens
    # Position t predicts token t+1: keep only positions whose next token is a target.
    predict = labels[:, 1:] != -100  # [B, S-1] (S: prompt + target tokens)
    h = hidden[:, :-1][predict]  # [M, d]
    logits = model.lm_head(h).float()  # [M, V]: never the full [B, S, V]
    return F.cross_entropy(logits, labels[:, 1:][predict])


def caption_batch(bundle, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
    """The perception stage's batch: the image alone as the prompt, its caption as the target."""
    missing = [ex.pid for ex in examples if not ex.caption]
    if missing:
        raise ValueError(f"examples {missing[:3]} have no caption; the perception stage needs the synthetic "
                         "curriculum (or JSONL data written from it); set --warmup.phase.perception_steps 0")
    return build_sft_batch(bundle, examples, [ex.caption for ex in examples], image_only=True)


def warmup_losses(model, batch: dict[str, torch.Tensor], examples: Sequence[Example],
                  head=None, labels=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(LM loss, perception loss) of one warm-up batch; the second is None without a head.

    The perception loss reads the merged visual tokens that the LM forward computes
    (a forward hook on the tower), so the tower runs once. ``labels``: the batch's
    token_labels if already computed (the warm-up prepares them with the batch).
    """
    if head is None:
        return sft_loss(model, batch), None
    with capture_visual_tokens(model) as feats:
        lm = sft_loss(model, batch)
    labels = labels if labels is not None else token_labels(examples, batch["image_grid_thw"])
    return lm, head.loss(feats[0], labels)


# ----------------------------------------------------------------------------- the warm-up phase

HEAD_PREFIX = "perception_head."  # the head's tensors in a periodic warm-up checkpoint (the final one has none)


@dataclass
class ValCurve:
    """The warm-up's validation curve (phase.val_every): the best EM so far, where, and how many
    evaluations since found none higher. Saved with every periodic checkpoint, so a resumed
    warm-up stops where a straight one would."""

    best: float = -1.0
    best_step: int = 0
    since: int = 0
    at: int = 0  # the step of the last evaluation

    def add(self, em: float, step: int) -> None:
        self.at = step
        if em > self.best:
            self.best, self.best_step, self.since = em, step, 0
        else:
            self.since += 1

    def exhausted(self, patience: int) -> bool:
        return patience > 0 and self.since >= patience


def _latest_is_periodic_at(files: RunFiles, step: int) -> bool:
    reg = read_registry(files.root, "warmup")
    return bool(reg["checkpoints"]) and reg["checkpoints"][-1]["step"] == step and bool(reg["checkpoints"][-1].get("periodic"))


def _resume_warmup(files: RunFiles, model, head, opt, stream: MixtureStream, rng: random.Random, tiny: bool,
                   curve: ValCurve) -> int:
    """Put a stopped warm-up's state back; -> the step to continue at (0: nothing to resume).

    Restores what the next step reads: every trained weight (the model's, or its LoRA), the
    perception head, AdamW's moments (all parameter groups), the stream position and the
    style rng where the batch after the saved step begins, the validation curve, and the
    global RNGs. Called after everything that draws from the global RNGs was built.
    """
    r, damaged = resume_point(files.root, "warmup", set_aside=True)
    for bad_step, why in damaged:
        print(f"phase warmup: checkpoint step {bad_step} is damaged, skipped and set aside ({why})")
        files.write_log(dict(event="damaged_checkpoint", phase="warmup", step=bad_step, error=why))
    if r is None:
        return 0
    data = r.scheduler_state.get("data")
    if data is None or r.optimizer_state is None:
        raise CheckpointError(f"{r.path} is a finished warm-up's checkpoint, not a resumable one; "
                              "use a new --run.run_dir to warm up again")
    if tiny:
        load_base_weights(model, r.tensors)
    else:
        load_lora_state_dict(model, adapter_tensors(r.tensors))
    if head is not None:
        head.load_state_dict({k.removeprefix(HEAD_PREFIX): v for k, v in r.tensors.items() if k.startswith(HEAD_PREFIX)})
    r.restore_optimizer(opt)
    stream.load_state_dict(data["stream"])
    version, internal, gauss = data["style_rng"]
    rng.setstate((version, tuple(internal), gauss))
    curve.__init__(**r.scheduler_state.get("val_curve", {}))
    restore_rng(r.rng)
    print(f"resuming phase warmup at step {r.step} from {r.path}", flush=True)
    return r.step


def _warmup_model(cfg: TrainConfig, device: str, tiny: bool, train: dict) -> tuple[Any, PerceptionHead | None]:
    """The model the warm-up trains: from scratch every weight (the perception head beside it
    when optim.perception_weight > 0), else a LoRA on the pretrained model (the contract kept
    strict)."""
    dtype = getattr(torch, cfg.model.dtype)
    bundle = load_bundle(cfg.model.name, dtype=dtype, device=device, seed=cfg.run.seed, **input_bounds(cfg))
    if not tiny:  # a pretrained model: warm up a LoRA, keep the contract strict
        bundle = build_policy(cfg, device)
    elif cfg.model.gradient_checkpointing:  # build_policy enables it for the LoRA path
        enable_gradient_checkpointing(bundle.model)
    head = None
    if tiny and cfg.optim.perception_weight > 0:
        if not any(ex.marks for s in train for ex in train[s]):  # a family may draw none (geometry)
            raise ConfigError(f"--run.data {cfg.run.data}: the examples carry no renderer marks, so the perception "
                              f"loss has no labels; use the synthetic curriculum or set --warmup.optim.perception_weight 0")
        torch.manual_seed(cfg.run.seed)
        head = PerceptionHead(bundle.model.config.text_config.hidden_size).to(device)
    return bundle, head


def _warmup_optimizer(model: torch.nn.Module, head: PerceptionHead | None,
                      cfg: TrainConfig) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """(every trained parameter, AdamW over them): the language model's at lr, the tower's at
    optim.vision_lr_scale x lr, the perception head's at lr."""
    params = [p for p in model.parameters() if p.requires_grad]
    visual = {id(p) for n, p in model.named_parameters() if ".visual." in f".{n}"}
    head_params = list(head.parameters()) if head is not None else []
    groups = lr_groups((None, [p for p in params if id(p) not in visual], 1.0),
                       (None, [p for p in params if id(p) in visual], cfg.optim.vision_lr_scale), (None, head_params, 1.0))
    return params + head_params, torch.optim.AdamW(groups, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)


def _log_warmup_step(files: RunFiles, bar: Progress, cfg: TrainConfig, k: int, total: int, stage: str, lr: float,
                     t0: float, lm_loss: torch.Tensor, perc_loss: torch.Tensor | None, gnorm: torch.Tensor) -> None:
    """One warm-up step's log record and progress line (printed every run.log_every steps
    when no terminal shows the bar)."""
    record = dict(phase="warmup", step=k + 1, stage=stage, sft_loss=lm_loss.item(), grad_norm=float(gnorm),
                  lr=lr, time=dict(step=time.time() - t0))
    if perc_loss is not None:
        record["perception_loss"] = perc_loss.item()
    files.write_log(record)
    info = (f"{'captions' if stage == 'perception' else 'reasoning'}: lm loss {lm_loss.item():.3f}"
            + (f", perception loss {perc_loss.item():.3f}" if perc_loss is not None else ""))
    bar.update(k + 1, info)
    if (k + 1) % cfg.run.log_every == 0 and not bar.tty:
        eta = bar.eta(k + 1)  # a log read without a terminal still says how long is left
        print(f"[warmup {k + 1}/{total}] {info}  eta {eta / 60:.0f} min" if eta == eta
              else f"[warmup {k + 1}/{total}] {info}", flush=True)


def _validate(cfg: TrainConfig, files: RunFiles, bundle: Any, eval_examples: list, done: int,
              save_progress: Callable[[int], None]) -> Any:
    """The checkpoint-side evaluation at step ``done`` (every optimiser step, captions
    included), printed and logged. A stop abandons it and leaves that step saved as periodic,
    so a resume redoes it."""
    try:
        result = checkpoint_eval(bundle, eval_examples, cfg)
    except EvalAbandoned:
        if not _latest_is_periodic_at(files, done):
            save_progress(done)
        raise Stopped(stop_message(f"warmup step {done} (its evaluation abandoned)"), STOP.signum) from None
    print_eval("warmup", done, result)
    files.write_log(dict(event="eval", phase="warmup", step=done, metrics=result.flat()))
    return result


def _evaluate_and_save(cfg: TrainConfig, files: RunFiles, bundle: Any, eval_examples: list, done: int, tiny: bool,
                       save_progress: Callable[[int], None], opt: torch.optim.Optimizer) -> None:
    """The warm-up's end: the checkpoint-side evaluation, then its checkpoint."""
    result = _validate(cfg, files, bundle, eval_examples, done, save_progress)
    files.write_samples("warmup", done, result.records, eval_examples)
    model = bundle.model
    tensors = base_tensors(model) if tiny else adapter_tensors(lora_state_dict(model))
    # an adapter warm-up keeps AdamW's moments: RL may continue them (optim.warmup_moments)
    save_checkpoint(files.root, "warmup", done, tensors=tensors, optimizer=None if tiny else opt,
                    scheduler_state={"step": done}, controller_state={}, data_position=0,
                    metrics=result.flat(), scores=result.scores, config_json=cfg.to_json(),
                    extra={"kind": "base" if tiny else "adapter", "base": None})


def run_warmup(cfg: TrainConfig, files: RunFiles, device: str) -> None:
    """R1-VL policy warm-up. For the tiny model: all weights, a perception (caption) stage
    first, dense perception labels throughout, imperfect contract on purpose (module docstring).
    Rank 0 only: the warm-up is not data-parallel."""
    train, val = load_training_data(cfg)
    tiny = trains_from_scratch(cfg.model.name)  # tiny-random (or a directory build_tiny_model wrote): random weights
    bundle, head = _warmup_model(cfg, device, tiny, train)
    model = bundle.model
    params, opt = _warmup_optimizer(model, head, cfg)
    style, rng = SFTStyle() if tiny else None, random.Random(cfg.run.seed)  # the worked answers' style and its draws
    stream = MixtureStream(train, cfg.phase.mixture, cfg.run.seed)  # the warm-up's own stage mixture
    B, n_caption = cfg.phase.prompts_per_step, cfg.phase.perception_steps if tiny else 0  # B as in GRPO: examples a step
    total = n_caption + cfg.phase.steps
    what = f"all weights, perception labels {'on' if head else 'off'}, imperfect contract on purpose" if tiny else "LoRA"
    print(f"warm-up: {n_caption} perception steps on image captions, then {cfg.phase.steps} SFT steps on worked "
          f"reasoning, x {B} examples ({what})", flush=True)
    guard = StepGuard([(n, p) for n, p in model.named_parameters() if p.requires_grad], opt, files, cfg)
    model.train()

    def data_state() -> dict:
        """Where the stream and the style rng stand: the next batch is made from here."""
        version, internal, gauss = rng.getstate()
        return {"stream": stream.state_dict(), "style_rng": [version, list(internal), gauss]}

    curve = ValCurve()  # phase.val_every's evaluations so far
    val_examples = eval_subset(cfg, val)  # the rows every evaluation of the warm-up scores
    first = _resume_warmup(files, model, head, opt, stream, rng, tiny, curve)  # 0: a new warm-up
    data = data_state()
    clock = SaveClock(cfg)

    def save_progress(done: int) -> None:
        """A `latest`-only checkpoint of everything the next step reads (a resume continues bit for bit)."""
        tensors = base_tensors(model) if tiny else adapter_tensors(lora_state_dict(model))
        if head is not None:
            tensors.update({HEAD_PREFIX + k: v for k, v in head.state_dict().items()})
        save_checkpoint(files.root, "warmup", done, tensors=tensors, optimizer=opt,
                        scheduler_state={"step": done, "data": data, "val_curve": vars(curve).copy()},
                        controller_state={},
                        data_position=data["stream"]["position"], metrics={}, scores={}, config_json=cfg.to_json(),
                        extra={"kind": "base" if tiny else "adapter", "base": None}, periodic=True)
        clock.saved()

    # Two stages, one loop: step k < n_caption is a caption step (lr warm-up, then constant), the
    # rest are worked-reasoning steps on their own schedule (lr_at: warm-up, then linear decay).
    def batches():  # every step's data, in order (prefetch runs this one step ahead)
        for k in range(first, total):
            stage, step = ("perception", k) if k < n_caption else ("sft", k - n_caption)
            examples = stream.next_batch(B)
            if stage == "perception":
                batch = caption_batch(bundle, examples)
                lr = cfg.optim.lr * min(1.0, (step + 1) / max(1, cfg.optim.warmup_steps))
            else:
                batch = build_sft_batch(bundle, examples, [warmup_target(e, rng, style) for e in examples])
                lr = lr_at(step, cfg)
            labels = token_labels(examples, batch["image_grid_thw"]) if head is not None else None
            # the producer runs ahead: the state after THIS batch travels with it, for a save after its step
            yield k, stage, lr, examples, batch, labels, data_state()

    def val_due(done: int) -> bool:  # a point of the validation curve after this many steps (none at the end)
        sft_steps = done - n_caption
        return bool(cfg.phase.val_every) and 0 < sft_steps and done < total and sft_steps % cfg.phase.val_every == 0

    def curve_says_stop(done: int) -> bool:
        return _curve_says_stop(cfg, files, bundle, val_examples, done, curve, save_progress)

    bar = Progress(total, "warmup", first)
    # resumed where a point of the curve was due but abandoned (a stop during it): that point first;
    # a warm-up whose curve had stopped it (its final evaluation abandoned) trains no further
    stopped = curve.exhausted(cfg.phase.patience) or (val_due(first) and curve.at != first and curve_says_stop(first))
    done = first
    steps = [] if stopped else prefetch(batches())
    for k, stage, lr, examples, batch, labels, data in steps:  # noqa: B007 (save_progress reads data)
        t0 = time.time()
        batch = {key: v.to(device) for key, v in batch.items()}
        set_lr(opt, lr)
        lm_loss, perc_loss = warmup_losses(model, batch, examples, head, labels)
        loss = lm_loss if perc_loss is None else lm_loss + cfg.optim.perception_weight * perc_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
        bad = guard.step()  # a NaN loss or an overflowing update: the weights of before the step are kept
        if bad:
            guard.failed("warmup", k + 1, dict(loss=str(loss.item()), params=bad[:5]),
                         f"[warmup {k + 1}] non-finite update ({len(bad)} tensors, e.g. {bad[0]}): step undone")
        else:
            guard.succeeded()
        _log_warmup_step(files, bar, cfg, k, total, stage, lr, t0, lm_loss, perc_loss, gnorm)
        if val_due(k + 1) and curve_says_stop(k + 1):
            done = k + 1
            break
        if STOP.requested or (k + 1 < total and clock.due(k + 1)):  # the last step is saved with its eval below
            save_progress(k + 1)
            if STOP.requested:
                bar.close()
                raise Stopped(stop_message(f"warmup step {k + 1}"), STOP.signum)
        done = k + 1
    bar.close()
    model.eval()
    if done < total:  # stopped on its curve: a warm-up of that many steps, finished (grpo/state/resume.py)
        cfg = copy.deepcopy(cfg)
        cfg.phase.steps = done - n_caption
    _evaluate_and_save(cfg, files, bundle, val_examples, done, tiny, save_progress, opt)


def _curve_says_stop(cfg: TrainConfig, files: RunFiles, bundle: Any, eval_examples: list, done: int,
                     curve: ValCurve, save_progress: Callable[[int], None]) -> bool:
    """One point of the validation curve at step ``done``; whether phase.patience says stop here."""
    bundle.model.eval()
    em = _validate(cfg, files, bundle, eval_examples, done, save_progress).metrics["exact_match"]
    bundle.model.train()
    curve.add(em, done)
    stop = curve.exhausted(cfg.phase.patience)
    print(f"warmup: validation EM {em:.3f} at step {done}, best {curve.best:.3f} at step {curve.best_step}"
          + (f"; {curve.since} evaluations without a higher one: stopping here (--warmup.phase.patience "
             f"{cfg.phase.patience}; {cfg.phase.steps} steps were planned)" if stop else ""), flush=True)
    return stop
