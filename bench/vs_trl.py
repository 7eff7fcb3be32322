"""Benchmark: one GRPO step of ours against TRL's GRPOTrainer, side by side, at equal work.

    PYTHONPATH=/path/to/trl_pkgs python -m bench.vs_trl      # embedded default: 8 prompts x G=8, 48 tokens, 3 rounds
    python -m bench.vs_trl --rounds 5 --warmup 2             # more rounds
    python -m bench.vs_trl --allocator default               # each side's allocator as its users run it
    python -m bench.vs_trl --shape qwen7b --B 1              # the 7B's widths, 2 + 2 layers, 448 px, G=8, 128 tokens
    python -m bench.vs_trl --shape qwen7b --B 1 --sweep G    # step times and ratio at G = 4, 8, 16: JSON + PNG
    python -m bench.vs_trl --ours-only --B 1 --G 2 --max-new-tokens 4 --rounds 1   # our side alone (the smoke test)

TRL is optional and never a dependency of the trainer; install it beside the environment,
without its dependencies (the environment already has transformers, peft, accelerate and
datasets), and put it on the path for this command only:

    pip install --no-deps --target DIR "trl==1.16.*"; PYTHONPATH=DIR python -m bench.vs_trl

Both sides do the same work per step (phase A at --B / --G):

    model      --shape tiny (default): the shipped tiny Qwen2.5-VL (grpo/tiny_model), its
               language model's 7 linear projections per layer in NF4 with fp32 compute,
               vision tower and lm_head kept in fp32; rank-8 LoRA (alpha 8, no dropout) on
               those 7 projections of every language-model layer. Ours: lora/ (our NF4, our
               LoRALinear). TRL: the model loaded by transformers with bitsandbytes' NF4 (the
               same modules skipped) and PEFT's LoRA, as a TRL user would build it.
               --shape qwen7b: the same recipe on a random model of Qwen2.5-VL-7B's widths
               cut to --layers / --vision-layers (bench/vs_trl_qwen7b.py says how it is built
               and how its lengths are forced equal), with the qwen7b preset's phase A config
               in fp32 on the CPU (no micro-batches, no checkpointing on either side).
    prompts    the same B synthetic curriculum examples (stage 1, seed 0), each with its image
               (tiny: 112 px; qwen7b: --image-px, 448 -> 256 visual tokens), in the same chat
               format (the tiny model's own chat template; TRL gets them as conversational
               prompts with the image inside, and its processor expands the image
               placeholders the way ours does)
    rollouts   G completions per prompt, --max-new-tokens at most, temperature 1, no top-k /
               top-p; tiny: generation stops when every row has ended (or at the budget);
               qwen7b: every row is exactly --max-new-tokens long on both sides
    reward     the phase's reward model (grpo/rewards), one scalar per completion; TRL calls
               it as its one reward function
    update     GRPO's group-normalised advantages, the clipped objective (eps 0.2, loss type
               "grpo": per-sequence token means), beta 0 (no reference pass), one pass over
               the batch (one optimiser step, no micro-batches, no PPO epochs), AdamW at the
               phase's lr, gradient norm clipped at 1
    TRL set-up per_device_train_batch_size = generation_batch_size = B*G (one step's rollouts
               are one generation batch), no gradient checkpointing (ours has none here), fp32,
               no eval, no checkpoints, no completion logging, report_to none, no tqdm.

What is not equal (it is each side's design, not the benchmark's): each prompt is encoded
once per group on our side (its KV cache copied G times) and our log-prob pass runs it once
per group (the shared prefix); TRL samples with transformers' ``generate`` through PEFT's
unmerged adapters over bitsandbytes' NF4, each prompt (and its image) repeated G times, and
its policy pass runs full rows. Tiny: our rollouts come from the merged fp32 copy (the
embedded default's sampling.rollout = merged); qwen7b: from the NF4 + LoRA policy itself (the
preset's plain rollout), or with --rollout merged from the merged fp32 copy (the preset's
option: the LoRA merged into a dequantised copy, refreshed after each optimiser step). Our
step also computes the rollout correction (tiny: sequence level; qwen7b: the preset's
token-level truncation), which TRL does not do without vLLM. Tiny
completions are sampled, so the two sides' lengths differ from step to step: the table
reports the completion tokens per step of each.

Processes and the allocator: with TRL, each side runs in its own worker process (this
module with --worker), both built first, then alternated by this process: ``--warmup``
steps of each side (not timed), then ``--rounds`` rounds, each one TRL step followed by one
step of ours, so that load changes on a shared machine hit both sides. TRL's trainer is
given one step more than it is let run: it waits for that step's "go" instead of ending its
training loop (and its process) while our last step is timed. ``--allocator``:
``equal`` (default) tunes glibc's malloc in both workers the way our trainer tunes it for
itself (grpo/run/runtime.py ``keep_freed_memory``); ``default`` tunes ours only, each side as
its users run it (our trainer always tunes it; TRL never does). --ours-only runs our side in
this process, tuned.

Timing: TRL's step is timed from its trainer's on_step_begin to on_step_end callback
(generation, rewards, loss, backward, optimiser; the data loader's fetch of the B prompt
rows, outside that window, is left out); ours is the sum of bench/step.py ``run_step``'s
stages of one real ``grpo.step.grpo_step`` (what run_step adds for bench.step's own tables, a
lone prefill and the rollout-mismatch statistics, is not counted). Breakdown per side:
generation (ours: prompt encoding + sampling; TRL: its ``_generate``, which includes its
prompt tokenisation), rewards, log-probs with grad + loss, backward (+ the clip), optimiser
(ours: + the merged copy's refresh), other (TRL: its advantage and bookkeeping code and the
trainer's loop). Medians with min and max.

Sweeps (``--sweep``, bench/vs_trl_sweep.py): one such comparison per value of G (4, 8, 16),
of the visual tokens per image (64, 256, 1024: 224, 448, 896 px; qwen7b only) or of the
completion length (64, 128, 256), ``--sweep-values`` to pick others; each point's medians
and ratio go to ``--out``/vs_trl_<sweep>.json and a pillow plot vs_trl_<sweep>.png, beside
what the shared prefix alone predicts: with P prompt tokens (visual ones included) and T
completion tokens per row, TRL's passes run G (P + T) tokens per group and ours P + G T, so
if every token cost the same the ratio would be G (P + T) / (P + G T).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from functools import wraps
from pathlib import Path

import torch

from bench._timing import device_name, print_table

TRL_HINT = 'pip install --no-deps --target DIR "trl==1.16.*"; run with PYTHONPATH=DIR'
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = "@vs_trl "  # a worker's lines to this process start with it; its other output is echoed


class BenchError(SystemExit):
    """One line for the user (SystemExit prints it and exits 1)."""


# ----------------------------------------------------------------------------- our side


def build_ours(args, with_model: bool = True) -> dict:
    """Phase A's config at --B x --G (tiny: the embedded default's; qwen7b: the qwen7b
    preset's on the CPU), the B examples, the tokenizer and image processor, and with
    ``with_model`` our policy (NF4 + LoRA), its merged rollout copy where the config samples
    from one, and AdamW over the LoRA parameters."""
    from data.synthetic import generate
    from grpo.cli import phase_config
    from grpo.rollout.merged import MergedRollout
    from lora import lora_parameters

    sizes = {"phase.prompts_per_step": str(args.B), "sampling.G": str(args.G),
             "sampling.max_new_tokens": str(args.max_new_tokens)}
    if args.shape == "tiny":
        from bench.step import build_bundle

        cfg = phase_config("A", "tiny", sizes, "A")
        bundle = build_bundle("tiny", "cpu", four_bit=True, checkpointing=False)  # cheap: TRL's worker takes its processor
        tokenizer, image_processor = bundle.tokenizer, bundle.image_processor
    else:
        from bench.vs_trl_qwen7b import build_ours_qwen7b, phase_overrides
        from grpo.model.load import load_bundle
        from grpo.model.tiny import tiny_image_processor

        cfg = phase_config("A", "qwen7b", {**sizes, **phase_overrides(args), "sampling.rollout": args.rollout}, "A")
        bundle = build_ours_qwen7b(args) if with_model else None
        tokenizer, image_processor = load_bundle("tiny").tokenizer, tiny_image_processor(args.image_px)
    out = dict(cfg=cfg, tokenizer=tokenizer, image_processor=image_processor, force_length=args.shape == "qwen7b",
               examples=generate("train", 1, args.B, seed=0, image_size=cfg.model.image_size))
    if with_model:
        out.update(bundle=bundle, merged=MergedRollout(bundle.model) if cfg.sampling.rollout == "merged" else None,
                   opt=torch.optim.AdamW(lora_parameters(bundle.model), lr=cfg.optim.lr,
                                         weight_decay=cfg.optim.weight_decay))
    return out


PARTS = ("generation", "rewards", "logp+loss", "backward", "optimizer", "other")


def ours_step(ours: dict) -> dict:
    """One timed step of ours: seconds per part (PARTS), the step, the completion tokens and
    the mean prompt length (visual tokens included)."""
    from bench.step import Stages, run_step
    from bench.vs_trl_qwen7b import no_stop_token

    stages = Stages(torch.device("cpu"))
    with no_stop_token() if ours["force_length"] else nullcontext():
        rollout, _ = run_step(ours["bundle"], ours["cfg"], ours["examples"], stages, ours["opt"],
                              merged=ours["merged"])
    ms = {name: v[0] / 1e3 for name, v in stages.rows.items() if not name.startswith("  ")}
    out = dict(generation=ms.pop("prompts", 0.0) + ms.pop("sampling", 0.0), rewards=ms.pop("rewards", 0.0),
               **{"logp+loss": ms.pop("logp (grad)", 0.0) + ms.pop("loss", 0.0)},
               backward=ms.pop("backward", 0.0), optimizer=ms.pop("optimizer", 0.0))
    out["other"] = sum(ms.values())  # the reference pass when beta > 0
    out["step"] = sum(out.values())
    out["tokens"] = int(rollout.out.completion_mask.sum())
    out["prompt_tokens"] = float(rollout.out.context.attention_mask.sum(1).float().mean())
    return out


def reward_fn(ours: dict):
    """Our reward model as one TRL reward function: the examples found by the dataset's
    ``idx`` column, the completions' text and token ids."""
    from grpo.rewards import RewardModel

    cfg = ours["cfg"]
    model = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=ours["tokenizer"])

    def ours_reward(prompts, completions, completion_ids, idx, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        batch = model([ours["examples"][i] for i in idx], texts, completion_ids=completion_ids)
        return [float(x) for x in batch.total]

    return ours_reward


# ----------------------------------------------------------------------------- TRL's side


def import_trl():
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise BenchError(f"TRL is not importable ({e}): {TRL_HINT}") from None
    return trl, GRPOConfig, GRPOTrainer


def trl_model_and_processor(ours: dict, args):
    """The model as a TRL user loads it (transformers + bitsandbytes' NF4, vision tower and
    lm_head skipped, fp32 compute) and a Qwen2.5-VL processor over our tokenizer and image
    processor (qwen7b: decoding ids modulo the tokenizer's size, as our side does)."""
    from transformers import BitsAndBytesConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

    from bench.vs_trl_qwen7b import model_dir, modulo_decode
    from grpo.model.shipped import SHIPPED_DIR

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["model.visual", "lm_head"])
    source = SHIPPED_DIR if args.shape == "tiny" else model_dir(args)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(source, dtype=torch.float32,
                                                               quantization_config=quant, device_map={"": "cpu"})

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):  # no video processor: that one needs torchvision
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    cls = ImageOnlyProcessor if args.shape == "tiny" else modulo_decode(ImageOnlyProcessor)
    tok = ours["tokenizer"]
    return model, cls(image_processor=ours["image_processor"], tokenizer=tok, video_processor=None,
                      chat_template=tok.chat_template)


def build_trl(ours: dict, args, before_step, after_step):
    """TRL's GRPOTrainer on the same model, prompts, reward and work; ``before_step()`` is
    called as each TRL step begins (its timing starts after it), ``after_step(timing)`` as it ends."""
    trl, GRPOConfig, GRPOTrainer = import_trl()
    from datasets import Dataset
    from peft import LoraConfig

    from data.contract import format_prompt

    cfg = ours["cfg"]
    model, processor = trl_model_and_processor(ours, args)
    targets = "|".join(LORA_TARGETS)
    peft = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                      target_modules=rf".*language_model.*\.({targets})$")
    rows = [{"idx": i, "image": ex.image, "prompt": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": format_prompt(ex.question)}]}]}
        for i, ex in enumerate(ours["examples"])]  # TRL puts the row's image into the placeholder
    B, G, o, T = len(rows), cfg.sampling.G, cfg.optim, cfg.sampling.max_new_tokens
    targs = GRPOConfig(
        output_dir=args.trl_dir, per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
        num_generations=G, generation_batch_size=B * G, max_completion_length=T,
        temperature=cfg.sampling.temperature, top_p=1.0, top_k=0, beta=o.beta, num_iterations=1,
        epsilon=o.eps_low, epsilon_high=o.eps_high, loss_type="grpo", scale_rewards="group",
        learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip, max_steps=args.warmup + args.rounds + 1, gradient_checkpointing=False,
        bf16=False, fp16=False, use_cpu=True, report_to="none", logging_steps=10**6, save_strategy="no",
        eval_strategy="no", disable_tqdm=True, log_completions=False, dataloader_num_workers=0, seed=0,
        generation_kwargs={"min_new_tokens": T} if ours["force_length"] else None)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn(ours), args=targs,
                          train_dataset=Dataset.from_list(rows), processing_class=processor, peft_config=peft)
    parts: dict[str, float] = {}  # seconds inside each wrapped method during the current step
    tokens: list[int] = []
    for name in ("_generate", "_calculate_rewards", "_generate_and_score_completions", "_prepare_inputs",
                 "compute_loss", "training_step", "_clip_grad_norm"):
        time_method(trainer, name, parts, tokens)
    trainer.add_callback(trl_timer(parts, tokens, before_step, after_step))
    return trainer, trl.__version__


def time_method(obj, name: str, parts: dict, tokens: list) -> None:
    """Wrap ``obj.name`` so that its seconds add up in ``parts[name]`` (and _generate's
    completion tokens go to ``tokens``)."""
    fn = getattr(obj, name)

    @wraps(fn)
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            out = fn(*a, **k)
        finally:
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        if name == "_generate":
            tokens.append(sum(len(c) for c in out[1]))  # (prompt_ids, completion_ids, ...)
        return out
    setattr(obj, name, run)


def trl_timer(parts: dict, tokens: list, before_step, after_step):
    """The TrainerCallback that times each TRL step and splits it into PARTS."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            before_step()
            parts.clear()
            tokens.clear()
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            parts["optimizer"] = time.perf_counter() - self.t_opt

        def on_step_end(self, *a, **k):
            step, t = time.perf_counter() - self.t0, parts.get
            out = {"generation": t("_generate", 0.0), "rewards": t("_calculate_rewards", 0.0),
                   "logp+loss": t("compute_loss", 0.0), "optimizer": t("optimizer", 0.0),
                   # training_step = _prepare_inputs (the rollouts) + compute_loss + backward
                   "backward": t("training_step", 0.0) - t("_prepare_inputs", 0.0) - t("compute_loss", 0.0)
                   + t("_clip_grad_norm", 0.0)}
            out["other"] = step - sum(out.values())  # scoring bookkeeping, advantages, the trainer's loop
            after_step(dict(out, step=step, tokens=sum(tokens) if tokens else None))

    return Timer()


# ----------------------------------------------------------------------------- worker processes


def say(message: dict) -> None:
    """A worker's line to the parent process."""
    print(PROTOCOL + json.dumps(message), flush=True)


def tune_allocator(side: str, allocator: str) -> bool:
    """glibc's malloc tuned as our trainer tunes it: always for ours, for TRL with --allocator equal."""
    from grpo.run.runtime import keep_freed_memory

    return keep_freed_memory() if side == "ours" or allocator == "equal" else False


def worker(args) -> None:
    """One side in this process: build, say ready, then one step per "go" line on stdin."""
    tuned = tune_allocator(args.worker, args.allocator)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.worker == "ours":
        ours = build_ours(args)
        say({"ready": True, "allocator_tuned": tuned})
        for line in sys.stdin:
            if line.strip() != "go":
                return
            say(ours_step(ours))
        return
    import peft

    def wait_for_go():
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(0)  # the parent stopped the run

    trainer, version = build_trl(build_ours(args, with_model=args.shape == "tiny"), args, wait_for_go, say)
    say({"ready": True, "allocator_tuned": tuned, "versions": f"trl {version}, peft {peft.__version__}"})
    trainer.train()


def listen(proc: subprocess.Popen, side: str) -> dict:
    """The worker's next message; its other lines are echoed (marked with its side)."""
    for line in proc.stdout:
        if line.startswith(PROTOCOL):
            return json.loads(line[len(PROTOCOL):])
        print(f"# [{side}] {line.rstrip()}", flush=True)
    raise BenchError(f"the {side} worker ended without a result (exit {proc.wait()}); its errors are above")


def run_workers(args, argv: list[str]) -> dict[str, list[dict]]:
    """Both sides in their own processes, built at once, then alternated step by step."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if args.shape == "qwen7b":
        from bench.vs_trl_qwen7b import model_dir

        model_dir(args)  # saved once here, before two processes could race to write it
    procs = {side: subprocess.Popen([sys.executable, "-m", "bench.vs_trl", *argv, "--worker", side], cwd=ROOT,
                                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
             for side in ("trl", "ours")}
    sides: dict[str, list[dict]] = {"ours": [], "trl": []}
    try:
        ready = {side: listen(p, side) for side, p in procs.items()}
        print(f"# {ready['trl']['versions']}; glibc malloc tuned: ours {ready['ours']['allocator_tuned']}, "
              f"TRL {ready['trl']['allocator_tuned']}", flush=True)
        for i in range(args.warmup + args.rounds):
            step = {}
            for side in ("trl", "ours"):
                procs[side].stdin.write("go\n")
                procs[side].stdin.flush()
                step[side] = listen(procs[side], side)
                if i >= args.warmup:
                    sides[side].append(step[side])
            print(f"# step {i + 1}{' (warm-up)' if i < args.warmup else ''}: " + "; ".join(
                f"{side} {step[side]['step']:.3f} s (" + ", ".join(f"{p} {step[side][p]:.3f}" for p in PARTS) + ")"
                for side in ("trl", "ours")), flush=True)  # each step's parts: a stopped run keeps them
    finally:
        for p in procs.values():
            p.stdin.close()
        for p in procs.values():
            p.wait(timeout=120)
    return sides


def run_point(args, argv: list[str]) -> dict[str, list[dict]]:
    """The timed steps of one comparison: in this process for --ours-only, else two workers."""
    if not args.ours_only:
        return run_workers(args, argv)
    tune_allocator("ours", args.allocator)
    ours = build_ours(args)
    for _ in range(args.warmup):
        ours_step(ours)
    return {"ours": [ours_step(ours) for _ in range(args.rounds)]}


# ----------------------------------------------------------------------------- report


def summary(runs: list[dict], key: str) -> str:
    xs = [r[key] for r in runs]
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


TARGET = {"tiny": 3.5, "qwen7b": 5.0}  # TRL's step over ours, equal allocator: what each shape aims at


def report(sides: dict[str, list[dict]], shape: str) -> None:
    rows = []
    for name, runs in sides.items():
        tok = [r["tokens"] for r in runs if r["tokens"] is not None]
        rows.append({"side": name, "steps": str(len(runs)), "step s": summary(runs, "step"),
                     **{f"{p} s": f"{statistics.median(r[p] for r in runs):.3f}" for p in PARTS},
                     "completion tokens": f"{statistics.median(tok):.0f}" if tok else "-"})
    print_table(rows, ["side", "steps", "step s", *[f"{p} s" for p in PARTS], "completion tokens"])
    if len(sides) == 2:
        ours, trl = (statistics.median(r["step"] for r in sides[k]) for k in ("ours", "trl"))
        per_round = [t["step"] / o["step"] for o, t in zip(sides["ours"], sides["trl"])]
        print(f"summary: TRL step / our step = {trl / ours:.2f}x (medians {trl:.3f} s / {ours:.3f} s; per round "
              + ", ".join(f"{x:.2f}x" for x in per_round) + f") against the >= {TARGET[shape]:g}x target")
    else:
        print(f"summary: our step {statistics.median(r['step'] for r in sides['ours']):.3f} s (median), TRL not run")


def parse(argv: list[str]) -> argparse.Namespace:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["tiny", "qwen7b"], default="tiny",
                   help="tiny: the embedded default; qwen7b: Qwen2.5-VL-7B's widths, a few layers")
    p.add_argument("--B", type=int, default=None, help="prompts per step (tiny: 8, phase A's; qwen7b: 1)")
    p.add_argument("--G", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion budget (tiny: 48; qwen7b: 128)")
    p.add_argument("--layers", type=int, default=2, help="qwen7b: language-model layers (the 7B: 28)")
    p.add_argument("--vision-layers", type=int, default=2, help="qwen7b: vision blocks (the 7B: 32)")
    p.add_argument("--image-px", type=int, default=448, help="qwen7b: image side (448 -> 256 visual tokens)")
    p.add_argument("--vocab", type=int, default=152064, help="qwen7b: vocabulary (the 7B's: 152,064)")
    p.add_argument("--rollout", choices=["plain", "merged"], default="plain",
                   help="qwen7b: our sampler, the preset's plain path (default) or its merged fp32 copy")
    p.add_argument("--model-cache", default="/tmp/vs_trl_models", help="qwen7b: where the random model is saved")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, one step of each side per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each side first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--allocator", choices=["equal", "default"], default="equal",
                   help="equal: glibc malloc tuned in both sides' processes; default: ours only")
    p.add_argument("--sweep", choices=["G", "visual", "length"], default=None, help="one comparison per value")
    p.add_argument("--sweep-values", default=None, help="comma-separated values (default 4,8,16 / 64,256,1024 / 64,128,256)")
    p.add_argument("--out", default="bench_out", help="--sweep: the folder of its JSON and PNG")
    p.add_argument("--ours-only", action="store_true", help="our side alone (no TRL needed)")
    p.add_argument("--trl-dir", default="/tmp/vs_trl", help="TRL's output_dir (no checkpoints are saved)")
    p.add_argument("--worker", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = args.shape == "tiny"
    args.B = args.B or (8 if tiny else 1)
    args.max_new_tokens = args.max_new_tokens or (48 if tiny else 128)
    check(args)
    return args


def check(args) -> None:
    """Each wrong value: one line."""
    for name in ("B", "rounds", "layers", "vision_layers", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.G < 2:
        raise BenchError(f"--G {args.G}: must be >= 2 (GRPO normalises rewards within a group)")
    if args.warmup < 0:
        raise BenchError(f"--warmup {args.warmup}: must be >= 0")
    if args.image_px < 56 or args.image_px % 28:
        raise BenchError(f"--image-px {args.image_px}: must be a multiple of 28, at least 56 (14 px patches merged 2x2)")
    if args.sweep == "visual" and args.shape == "tiny":
        raise BenchError("--sweep visual: only with --shape qwen7b (the tiny model's images are its own 112 px)")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        return worker(args)
    if torch.cuda.is_available():
        print("# CUDA is present but this benchmark runs both sides on the CPU (the embedded default's device)")
    if not args.ours_only:
        import_trl()  # fail before any model loads
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    import transformers

    shape = ("embedded default phase A" if args.shape == "tiny" else
             f"Qwen2.5-VL-7B's widths, {args.layers} LM + {args.vision_layers} vision layers, vocabulary "
             f"{args.vocab:,}, {args.image_px} px, our rollout {args.rollout}")
    print(f"# one GRPO step, ours vs TRL, on {device_name('cpu')}: {shape}, B={args.B} x G={args.G}, "
          f"{args.max_new_tokens} new tokens, {args.warmup} warm-up + {args.rounds} timed round(s), allocator "
          f"{args.allocator}; torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    if args.sweep:
        from bench.vs_trl_sweep import run_sweep

        return run_sweep(args, argv, run_point, report)
    report(run_point(args, argv), args.shape)


if __name__ == "__main__":
    main()
