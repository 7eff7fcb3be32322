"""Benchmark: one GRPO step of the embedded default against TRL's GRPOTrainer, side by side.

    PYTHONPATH=/path/to/trl_pkgs python -m bench.vs_trl      # 8 prompts x G=8, 48 tokens, 3 timed rounds
    python -m bench.vs_trl --rounds 5 --warmup 2             # more rounds
    python -m bench.vs_trl --ours-only --B 1 --G 2 --max-new-tokens 4 --rounds 1   # our side alone (the smoke test)

TRL is optional and never a dependency of the trainer; install it beside the environment,
without its dependencies (the environment already has transformers, peft, accelerate and
datasets), and put it on the path for this command only:

    pip install --no-deps --target DIR "trl==1.16.*"; PYTHONPATH=DIR python -m bench.vs_trl

Both sides do the same work per step (the embedded default's phase A at --B / --G):

    model      the shipped tiny Qwen2.5-VL (grpo/tiny_model), its language model's 7 linear
               projections per layer in NF4 with fp32 compute, vision tower and lm_head kept
               in fp32; rank-8 LoRA (alpha 8, no dropout) on those 7 projections of every
               language-model layer. Ours: lora/ (our NF4, our LoRALinear). TRL: the model
               loaded by transformers with bitsandbytes' NF4 (the same modules skipped) and
               PEFT's LoRA, as a TRL user would build it.
    prompts    the same B synthetic curriculum examples (stage 1, seed 0), each with its
               112 px image, in the same chat format (the tiny model's own chat template;
               TRL gets them as conversational prompts with the image inside, and its
               processor expands the image placeholders the way ours does)
    rollouts   G completions per prompt, --max-new-tokens at most, temperature 1, no top-k /
               top-p; generation stops when every row has ended (or at the budget)
    reward     the embedded default's reward model (grpo/rewards, its phase A weights), one
               scalar per completion; TRL calls it as its one reward function
    update     GRPO's group-normalised advantages, the clipped objective (eps 0.2, loss type
               "grpo": per-sequence token means), beta 0 (no reference pass), one pass over
               the batch (one optimiser step, no micro-batches, no PPO epochs), AdamW at the
               phase's lr, gradient norm clipped at 1
    TRL set-up per_device_train_batch_size = generation_batch_size = B*G (one step's rollouts
               are one generation batch), no gradient checkpointing (ours has none here), fp32,
               no eval, no checkpoints, no completion logging, report_to none, no tqdm.

What is not equal (it is each side's design, not the benchmark's): our rollouts come from the
merged fp32 copy of base + LoRA (the embedded default's sampling.rollout = merged) and each
prompt is encoded once per group (its KV cache copied G times); TRL samples with
transformers' ``generate`` through PEFT's unmerged adapters over bitsandbytes' NF4, each
prompt repeated G times. Our step also computes the sequence-level rollout correction (the
sampler's log-probs against the trainer's, one extra mask), which TRL does not do without
vLLM. Completions are sampled, so the two sides' lengths differ from step to step: the table
reports the completion tokens per step of each.

Timing: ``--warmup`` steps of each side first (not timed), then ``--rounds`` rounds, each one
TRL step followed by one step of ours, alternated so that load changes on a shared machine
hit both sides. TRL's step is timed from its trainer's on_step_begin to on_step_end callback
(generation, rewards, loss, backward, optimiser; the data loader's fetch of the B prompt
rows, outside that window, is left out); ours is the sum of bench/step.py ``run_step``'s
stages of one real ``grpo.step.grpo_step`` (what run_step adds for bench.step's own tables, a
lone prefill and the rollout-mismatch statistics, is not counted). Breakdown per side:
generation (ours: prompt encoding + sampling; TRL: its ``_generate``, which includes its
prompt tokenisation), rewards, and the rest (log-probs with grad, loss, backward, optimiser;
TRL's rest also holds its advantage and bookkeeping code). Medians with min and max.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import wraps

import torch

from bench._timing import device_name, print_table

TRL_HINT = 'pip install --no-deps --target DIR "trl==1.16.*"; run with PYTHONPATH=DIR'
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class BenchError(SystemExit):
    """One line for the user (SystemExit prints it and exits 1)."""


# ----------------------------------------------------------------------------- our side


def build_ours(B: int, G: int, max_new_tokens: int):
    """The embedded default's phase A config at B x G, its policy (NF4 + LoRA), the merged
    rollout copy, AdamW over the LoRA parameters, and the B examples."""
    from bench.step import build_bundle
    from data.synthetic import generate
    from grpo.cli import phase_config
    from grpo.rollout.merged import MergedRollout
    from lora import lora_parameters

    cfg = phase_config("A", "tiny", {"phase.prompts_per_step": str(B), "sampling.G": str(G),
                                     "sampling.max_new_tokens": str(max_new_tokens)}, "A")
    bundle = build_bundle("tiny", "cpu", four_bit=True, checkpointing=False)
    merged = MergedRollout(bundle.model) if cfg.sampling.rollout == "merged" else None
    opt = torch.optim.AdamW(lora_parameters(bundle.model), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    examples = generate("train", 1, B, seed=0, image_size=cfg.model.image_size)
    return dict(bundle=bundle, cfg=cfg, merged=merged, opt=opt, examples=examples)


PARTS = ("generation", "rewards", "logp+loss", "backward", "optimizer", "other")


def ours_step(ours: dict) -> dict:
    """One timed step of ours: seconds per part (PARTS), the step and the completion tokens."""
    from bench.step import Stages, run_step

    stages = Stages(torch.device("cpu"))
    rollout, _ = run_step(ours["bundle"], ours["cfg"], ours["examples"], stages, ours["opt"], merged=ours["merged"])
    ms = {name: v[0] / 1e3 for name, v in stages.rows.items() if not name.startswith("  ")}
    out = dict(generation=ms.pop("prompts", 0.0) + ms.pop("sampling", 0.0), rewards=ms.pop("rewards", 0.0),
               **{"logp+loss": ms.pop("logp (grad)", 0.0) + ms.pop("loss", 0.0)},
               backward=ms.pop("backward", 0.0), optimizer=ms.pop("optimizer", 0.0))
    out["other"] = sum(ms.values())  # the reference pass when beta > 0
    out["step"] = sum(out.values())
    out["tokens"] = int(rollout.out.completion_mask.sum())
    return out


def reward_fn(ours: dict):
    """Our reward model as one TRL reward function: the examples found by the dataset's
    ``idx`` column, the completions' text and token ids."""
    from grpo.rewards import RewardModel

    cfg = ours["cfg"]
    model = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=ours["bundle"].tokenizer)

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


def build_trl(ours: dict, args, between_steps):
    """TRL's GRPOTrainer on the same model, prompts, reward and work; ``between_steps(timing)``
    is called after every TRL step with that step's timing."""
    trl, GRPOConfig, GRPOTrainer = import_trl()
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, TrainerCallback

    from data.contract import format_prompt
    from grpo.model.shipped import SHIPPED_DIR

    bundle, cfg = ours["bundle"], ours["cfg"]
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["model.visual", "lm_head"])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(SHIPPED_DIR, dtype=torch.float32,
                                                               quantization_config=quant, device_map={"": "cpu"})
    class ImageOnlyProcessor(Qwen2_5_VLProcessor):  # no video processor: that one needs torchvision
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    processor = ImageOnlyProcessor(image_processor=bundle.image_processor, tokenizer=bundle.tokenizer,
                                   video_processor=None, chat_template=bundle.tokenizer.chat_template)
    targets = "|".join(LORA_TARGETS)
    peft = LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                      target_modules=rf".*language_model.*\.({targets})$")
    rows = [{"idx": i, "image": ex.image, "prompt": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": format_prompt(ex.question)}]}]}
        for i, ex in enumerate(ours["examples"])]  # TRL puts the row's image into the placeholder
    B, G, o = len(rows), cfg.sampling.G, cfg.optim
    n_steps = args.warmup + args.rounds
    targs = GRPOConfig(
        output_dir=args.trl_dir, per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
        num_generations=G, generation_batch_size=B * G, max_completion_length=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature, top_p=1.0, top_k=0, beta=o.beta, num_iterations=1,
        epsilon=o.eps_low, epsilon_high=o.eps_high, loss_type="grpo", scale_rewards="group",
        learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip, max_steps=n_steps, gradient_checkpointing=False, bf16=False, fp16=False,
        use_cpu=True, report_to="none", logging_steps=10**6, save_strategy="no", eval_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn(ours), args=targs,
                          train_dataset=Dataset.from_list(rows), processing_class=processor, peft_config=peft)
    parts: dict[str, float] = {}  # seconds inside each wrapped method during the current step
    tokens: list[int] = []

    def timed(name, obj=trainer):
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

    for name in ("_generate", "_calculate_rewards", "_generate_and_score_completions", "_prepare_inputs",
                 "compute_loss", "training_step", "_clip_grad_norm"):
        timed(name)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
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
            between_steps(dict(out, step=step, tokens=sum(tokens) if tokens else None))

    trainer.add_callback(Timer())
    return trainer, trl.__version__


# ----------------------------------------------------------------------------- report


def summary(runs: list[dict], key: str) -> str:
    xs = [r[key] for r in runs]
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def report(sides: dict[str, list[dict]]) -> None:
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
              + ", ".join(f"{x:.2f}x" for x in per_round) + ") against the >= 5x target")
    else:
        print(f"summary: our step {statistics.median(r['step'] for r in sides['ours']):.3f} s (median), TRL not run")


def main(argv: list[str] | None = None) -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=8, help="prompts per step (the embedded default's phase A: 8)")
    p.add_argument("--G", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="completion budget (default 48)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, one step of each side per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each side first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--ours-only", action="store_true", help="our side alone (no TRL needed)")
    p.add_argument("--trl-dir", default="/tmp/vs_trl", help="TRL's output_dir (no checkpoints are saved)")
    args = p.parse_args(argv)
    for name in ("B", "rounds"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.G < 2:
        raise BenchError(f"--G {args.G}: must be >= 2 (GRPO normalises rewards within a group)")
    if args.max_new_tokens < 1 or args.warmup < 0:
        raise BenchError(f"--max-new-tokens {args.max_new_tokens} / --warmup {args.warmup}: must be >= 1 / >= 0")
    if torch.cuda.is_available():
        print("# CUDA is present but this benchmark runs both sides on the CPU (the embedded default's device)")
    if not args.ours_only:
        import_trl()  # fail before any model loads
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    ours = build_ours(args.B, args.G, args.max_new_tokens)
    import transformers

    print(f"# one GRPO step, ours vs TRL, on {device_name('cpu')}: embedded default phase A, B={args.B} x "
          f"G={args.G}, {args.max_new_tokens} new tokens, {args.warmup} warm-up + {args.rounds} timed round(s); "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    sides: dict[str, list[dict]] = {"ours": []}
    for _ in range(args.warmup):
        ours_step(ours)
    if args.ours_only:
        for _ in range(args.rounds):
            sides["ours"].append(ours_step(ours))
        report(sides)
        return
    import peft

    sides["trl"] = []
    done = [0]

    def between_steps(timing: dict) -> None:  # after each TRL step: keep it if timed, then one of ours
        done[0] += 1
        if done[0] > args.warmup:
            sides["trl"].append(timing)
            sides["ours"].append(ours_step(ours))
        print(f"# step {done[0]}: TRL {timing['step']:.3f} s" + (f", ours {sides['ours'][-1]['step']:.3f} s"
              if done[0] > args.warmup else " (warm-up)"), flush=True)

    trainer, version = build_trl(ours, args, between_steps)
    print(f"# trl {version}, peft {peft.__version__}")
    trainer.train()
    report(sides)


if __name__ == "__main__":
    main()
