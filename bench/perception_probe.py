"""Perception probes: does the embedded model read its images, and what makes it learn to?

A research tool, not a benchmark of speed: every number of bench/EXPERIMENTS.md sections 1-2
comes from it. Two modes, both on the project's own tiny Qwen2.5-VL, tokenizer, prompt
encoding, SFT batches and perception head (grpo/warmup/sft.py, grpo/warmup/perception.py):

    python -m bench.perception_probe probe --task select --steps 400
        one synthetic task whose answer is read off the picture:
          count   1-6 shapes on the 4x4 lattice, "How many shapes are there in total?"
          select  two colours, "How many red circles are there?"   (content-based read)
          table   a 2x2..3x3 digit table, "What is the number in row i, column j?"
                  (position-based read; --layout aligned puts cell (r, c) on token (r, c))
        measured as the teacher-forced accuracy of the perceived digit (the reasoning's
        value, which no earlier text gives away) with the true images and with images
        shuffled across the batch; --eval-every prints the learning curve.

    python -m bench.perception_probe curriculum --captions 600 --steps 300
        the real curriculum (data/synthetic.py) with strict contract targets, the warm-up's
        two stages (captions, then worked reasoning), then greedy EM on the test split with
        the true images and with images shuffled within each family (eval/blind.py), per
        stage and family.

Options that switch a lever: --no-head (no perception labels), --captions N (caption
steps first), --lr, --B, --vision-lr-scale, --mix / --families (curriculum). One torch
thread; a run of 400 x 32 steps takes ~3 minutes on the development VM.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time

import torch

from data.contract import format_response
from data.render import COLOURS, Canvas
from data.schema import Example

SHAPE_COLOURS = ("red", "blue", "green", "orange")


# ----------------------------------------------------------------------------- probe tasks


def _lattice_xy(cell: int) -> tuple[float, float]:
    return 0.04 + (cell % 4 + 0.5) * 0.23, 0.04 + (cell // 4 + 0.5) * 0.23


def probe_example(task: str, rng: random.Random, layout: str = "aligned") -> Example:
    """One example of a probe task: image, question, worked reasoning, caption, marks."""
    cv = Canvas(112)
    if task == "count":
        k = rng.randint(1, 6)
        for c in rng.sample(range(16), k):
            cv.shape("circle", *_lattice_xy(c), 0.36 * 0.23, COLOURS[rng.choice(SHAPE_COLOURS)])
        q, reasoning, answer, caption = "How many shapes are there in total?", f"shapes: {k}.", k, f"shapes: {k}."
    elif task == "select":
        cols = rng.sample(SHAPE_COLOURS, 2)
        ka = rng.randint(1, 5)
        kb = rng.randint(1, 6 - ka)
        for i, c in enumerate(rng.sample(range(16), ka + kb)):
            cv.shape("circle", *_lattice_xy(c), 0.36 * 0.23, COLOURS[cols[0] if i < ka else cols[1]])
        q, answer = f"How many {cols[0]} circles are there?", ka
        reasoning = f"{cols[0]} circles: {ka}."
        caption = " ".join(f"{c} circles: {k}." for c, k in sorted([(cols[0], ka), (cols[1], kb)]))
    elif task == "table":
        R, C = rng.choice([(2, 2), (2, 3), (3, 2), (3, 3)])
        vals = [[rng.randint(1, 9) for _ in range(C)] for _ in range(R)]
        x0, cw, ch = (0.0, 0.25, 0.25) if layout == "aligned" else (0.06, 0.88 / C, 0.88 / R)
        for r in range(R + 1):
            cv.box(x0, x0 + r * ch - .012, x0 + C * cw, x0 + r * ch + .012, fill=(0, 0, 0))
        for c in range(C + 1):
            cv.box(x0 + c * cw - .012, x0, x0 + c * cw + .012, x0 + R * ch, fill=(0, 0, 0))
        for r in range(R):
            for c in range(C):
                cv.number(str(vals[r][c]), x0 + (c + .5) * cw, x0 + (r + .5) * ch, min(.5 * ch, .14))
        i, j = rng.randrange(R), rng.randrange(C)
        q, answer = f"What is the number in row {i + 1}, column {j + 1}?", vals[i][j]
        reasoning = f"row {i + 1}, column {j + 1}: {answer}."
        caption = " ".join(f"row {r + 1}: {', '.join(map(str, row))}." for r, row in enumerate(vals))
    else:
        raise ValueError(f"unknown task {task!r}; use count, select or table")
    return Example(pid=f"probe-{rng.random():.12f}", question=q, answer=str(answer), image=cv.image,
                   reasoning=reasoning, marks=list(cv.marks), caption=caption)


def _shuffled(examples: list[Example]) -> list[Example]:
    out = [copy.copy(e) for e in examples]
    for e, src in zip(out, examples[1:] + examples[:1]):
        e.image = src.image
    return out


@torch.no_grad()
def perceived_digit_accuracy(bundle, examples: list[Example]) -> float:
    """Teacher-forced accuracy of the digit right before </REASONING> (the perceived value)."""
    from grpo.warmup.sft import build_sft_batch

    batch = build_sft_batch(bundle, examples, [format_response(e.reasoning, e.answer) for e in examples])
    labels = batch.pop("labels")
    logits = bundle.model(**batch).logits
    close = bundle.tokenizer.convert_tokens_to_ids("</REASONING>")
    hits = 0
    for i in range(len(examples)):
        ids = labels[i].tolist()
        j = ids.index(close) - 2  # "...: 3." -> the digit, then "."
        hits += int(logits[i, j - 1].argmax()) == ids[j]
    return hits / len(examples)


# ----------------------------------------------------------------------------- training


def _optimizer(model, head, lr: float, vision_lr_scale: float):
    vis = [p for n, p in model.named_parameters() if ".visual." in f".{n}"]
    ids = {id(p) for p in vis}
    groups = [{"params": [p for p in model.parameters() if id(p) not in ids]},
              {"params": vis, "lr": lr * vision_lr_scale}]
    if head is not None:
        groups.append({"params": list(head.parameters())})
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.0), params


def _step(model, head, opt, params, batch, examples) -> float:
    from grpo.warmup.sft import warmup_losses

    lm, perception = warmup_losses(model, batch, examples, head)
    loss = lm if perception is None else lm + perception
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(lm)


def run_probe(args) -> None:
    from grpo.model.load import load_bundle
    from grpo.warmup.perception import PerceptionHead
    from grpo.warmup.sft import build_sft_batch, caption_batch

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    bundle = load_bundle("tiny")
    model = bundle.model
    head = None if args.no_head else PerceptionHead(model.config.text_config.hidden_size)
    opt, params = _optimizer(model, head, args.lr, args.vision_lr_scale)
    make = lambda: probe_example(args.task, rng, args.layout)  # noqa: E731

    def evaluate(tag: str) -> None:
        model.eval()
        exs = [make() for _ in range(args.n_eval)]
        print(f"  {tag}: perceived digit accuracy {perceived_digit_accuracy(bundle, exs):.3f} true images, "
              f"{perceived_digit_accuracy(bundle, _shuffled(exs)):.3f} shuffled", flush=True)
        model.train()

    t0 = time.time()
    model.train()
    for step in range(args.captions):
        exs = [make() for _ in range(args.B)]
        loss = _step(model, head, opt, params, caption_batch(bundle, exs), exs)
        if step % 50 == 0:
            print(f"caption {step} lm loss {loss:.3f} ({time.time() - t0:.0f}s)", flush=True)
    for step in range(args.steps):
        exs = [make() for _ in range(args.B)]
        batch = build_sft_batch(bundle, exs, [format_response(e.reasoning, e.answer) for e in exs])
        loss = _step(model, head, opt, params, batch, exs)
        if step % 50 == 0:
            print(f"qa {step} lm loss {loss:.3f} ({time.time() - t0:.0f}s)", flush=True)
        if args.eval_every and step and step % args.eval_every == 0:
            evaluate(f"@ {step}")
    evaluate(f"final ({args.steps} steps, {time.time() - t0:.0f}s)")


def run_curriculum(args) -> None:
    from data.mixture import MixtureStream
    from data.synthetic import generate
    from eval.blind import blind_gap, shuffle_images
    from eval.results import EvalProtocol
    from grpo.evaluation.model_eval import evaluate_model
    from grpo.model.load import load_bundle
    from grpo.warmup.perception import PerceptionHead
    from grpo.warmup.sft import build_sft_batch, caption_batch

    torch.manual_seed(args.seed)
    mix = {int(k): float(v) for k, v in (x.split(":") for x in args.mix.split(","))}
    train = {s: generate("train", s, args.train_per_stage, args.seed) for s in mix}
    if args.families:
        keep = set(args.families.split(","))
        train = {s: [e for e in v if e.metadata["family"] in keep] for s, v in train.items()}
        mix = {s: p for s, p in mix.items() if train[s]}
        train = {s: train[s] for s in mix}
    bundle = load_bundle("tiny", seed=args.seed)
    model = bundle.model
    head = None if args.no_head else PerceptionHead(model.config.text_config.hidden_size)
    opt, params = _optimizer(model, head, args.lr, args.vision_lr_scale)
    stream = MixtureStream(train, mix, args.seed)
    t0 = time.time()
    model.train()
    for k in range(args.captions + args.steps):
        exs = stream.next_batch(args.B)
        cap = k < args.captions
        step = k if cap else k - args.captions
        ramp = min(1.0, (step + 1) / 20)
        decay = 1.0 if cap else 1.0 - 0.9 * step / max(1, args.steps)
        for g, base in zip(opt.param_groups, (args.lr, args.lr * args.vision_lr_scale, args.lr)):
            g["lr"] = base * ramp * decay
        batch = caption_batch(bundle, exs) if cap else build_sft_batch(
            bundle, exs, [format_response(e.reasoning, e.answer) for e in exs])
        loss = _step(model, head, opt, params, batch, exs)
        if k % 50 == 0:
            print(f"{'caption' if cap else 'qa'} {step} lm loss {loss:.3f} ({time.time() - t0:.0f}s)", flush=True)
    train_s = time.time() - t0
    model.eval()
    protocol = EvalProtocol(max_new_tokens=48, temperature=0.0, batch_size=64, image_control=False)
    gaps = []
    for s in (1, 2, 3):
        test = generate("test", s, args.n_eval, args.seed)
        true = evaluate_model(bundle, test, protocol)
        shuf = {r["pid"]: r["exact"] for r in evaluate_model(bundle, shuffle_images(test), protocol).records}
        g = blind_gap(true.records, [{"pid": p, "exact": e} for p, e in shuf.items()])
        fam: dict[str, list[int]] = {}
        for rec, ex in zip(true.records, test):
            f = fam.setdefault(ex.metadata["family"], [0, 0, 0])
            f[0], f[1], f[2] = f[0] + rec["exact"], f[1] + shuf.get(rec["pid"], 0), f[2] + 1
        gaps.append(g.gap)
        print(f"stage {s}: {g}; parse {true.metrics['parseable_rate']:.2f}; by family (true/shuffled): "
              + ", ".join(f"{n} {a / c:.2f}/{b / c:.2f}" for n, (a, b, c) in fam.items()), flush=True)
    print(f"overall blind gap {sum(gaps) / 3:+.3f} (mean of the stages); training took {train_s:.0f}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perception_probe", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("probe", "curriculum"):
        p = sub.add_parser(name)
        p.add_argument("--steps", type=int, default=400, help="question-answer SFT steps")
        p.add_argument("--captions", type=int, default=0, help="caption steps first (image-only prompt)")
        p.add_argument("--B", type=int, default=32, help="examples per step")
        p.add_argument("--lr", type=float, default=5e-4)
        p.add_argument("--vision-lr-scale", type=float, default=1.0)
        p.add_argument("--no-head", action="store_true", help="no per-token perception labels")
        p.add_argument("--seed", type=int, default=0)
    probe = sub.choices["probe"]
    probe.add_argument("--task", default="select", choices=("count", "select", "table"))
    probe.add_argument("--layout", default="aligned", choices=("aligned", "spread"), help="table layout")
    probe.add_argument("--eval-every", type=int, default=0)
    probe.add_argument("--n-eval", type=int, default=256, help="examples per evaluation")
    cur = sub.choices["curriculum"]
    cur.add_argument("--mix", default="1:0.6,2:0.25,3:0.15", help="stage:probability,...")
    cur.add_argument("--families", default="", help="comma list: train on these families only")
    cur.add_argument("--train-per-stage", type=int, default=8000)
    cur.add_argument("--n-eval", type=int, default=100, help="test examples per stage")
    args = ap.parse_args(argv)
    for name in ("steps", "captions", "B", "n_eval"):
        if getattr(args, name) < (1 if name in ("B", "n_eval") else 0):
            print(f"error: --{name.replace('_', '-')} {getattr(args, name)} is out of range", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    (run_probe if args.mode == "probe" else run_curriculum)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
