"""Does the frozen vision tower carry the answer? A linear probe on the merged visual tokens.

    python -m bench.tower_probe DIR [DIR ...]            # own-data sets (data.jsonl + images)
    python -m bench.tower_probe DIR --model tiny --steps 300
    python -m bench.tower_probe --quantities 3000        # the curriculum's quantities, one by one
    python -m bench.tower_probe --quantities 1500 --model DIR --image-size 224   # a base built at 224 px

For each set: every image through the shipped base's vision tower and merger (the tokens the
language model reads, frozen, no LoRA), the tokens of an image concatenated into one vector
(16 x 128 = 2,048 numbers at 112 px), a softmax-regression probe trained on the set's training
rows (its answers as classes) and scored on its held-out test rows (data/holdout.py's tenth,
the rows every report scores). Against chance (the most common training answer) and against
the same probe on images shuffled across rows.

What it tells: where the probe reads the answer well above chance, the tower's output carries
it, and a policy that fails to answer is the language side's (or RL's) failure; where the probe
is near chance, the base cannot see what the question asks, and no amount of RL on top of a
frozen tower will fix it: that is the base's limit (the README's "Your own data"). A linear
probe is a lower bound on what the tokens carry (a deeper reader might do better).

``--quantities N`` asks it of the synthetic curriculum, one quantity at a time: N training and
N/4 test figures a stage (data/synthetic.py's splits), and for each (family, quantity) that the
questions name (an example's ``intermediates``: "red circles", "purple bar", "purple line"...)
with at least --min-rows training figures and a quarter as many test ones, a probe from the
figure's tokens to that quantity's value. A quantity the probe reads near chance is one the tower does not carry,
whatever the policy on top does (issue "base reads": what to change in the base). The figures are
drawn at ``--image-size`` px (112 by default, the shipped base's size): a candidate base built at
another size is probed at its own (its processor's pixel cap decides how many tokens reach the probe).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data.holdout import split_test
from data.sources import load_source
from grpo.model.load import load_bundle
from grpo.model.prompt_context import vision_features
from grpo.model.prompts import encode_prompts
from grpo.model.tiny import TINY_IMAGE_SIZE


@torch.no_grad()
def features(bundle, examples, batch: int = 64) -> torch.Tensor:
    """[n, tokens * d]: each example's merged visual tokens, flattened (one image a row)."""
    rows = []
    for i in range(0, len(examples), batch):
        part = examples[i:i + batch]
        feats = vision_features(bundle.model, encode_prompts(bundle, part))  # [sum of tokens, d]
        rows += list(feats.reshape(len(part), -1, feats.shape[-1]).flatten(1).float())
    return torch.stack(rows)


def probe_accuracy(x_tr, y_tr, x_te, y_te, classes: int, steps: int, seed: int = 0) -> float:
    """A softmax regression (standardised inputs, AdamW, weight decay) trained full-batch."""
    torch.manual_seed(seed)
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    w = torch.nn.Linear(x_tr.shape[1], classes)
    opt = torch.optim.AdamW(w.parameters(), lr=1e-2, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(w(x_tr), y_tr).backward()
        opt.step()
    return float((w(x_te).argmax(1) == y_te).float().mean())


def classes(train: list[str], test: list[str]) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """The values as class indices (train, test), the number of classes, and chance: the test
    share of the most common training value."""
    index = {v: i for i, v in enumerate(sorted(set(train) | set(test)))}
    y_tr, y_te = torch.tensor([index[v] for v in train]), torch.tensor([index[v] for v in test])
    majority = int(torch.bincount(y_tr, minlength=len(index)).argmax())
    return y_tr, y_te, len(index), float((y_te == majority).float().mean())


def probe_set(bundle, directory: Path, steps: int) -> dict[str, float]:
    rows, _ = load_source(str(directory))  # (examples, skipped reasons)
    train, test = split_test(rows)
    y_tr, y_te, k, chance = classes([ex.answer for ex in train], [ex.answer for ex in test])
    x_tr, x_te = features(bundle, train), features(bundle, test)
    shuffled = x_tr[torch.randperm(len(train), generator=torch.Generator().manual_seed(1))]
    return {"train": len(train), "test": len(test), "classes": k, "chance": chance,
            "probe": probe_accuracy(x_tr, y_tr, x_te, y_te, k, steps),
            "probe_shuffled": probe_accuracy(shuffled, y_tr, x_te, y_te, k, steps)}


def quantity_rows(examples) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """(family, quantity name) -> [(index into examples, the quantity's value)]: the readings each
    question needs (its ``intermediates``), computed quantities ("sum", "base x height") included."""
    out: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for i, ex in enumerate(examples):
        for item in ex.intermediates or []:
            out.setdefault((ex.metadata["family"], item.name), []).append((i, item.value))
    return out


def probe_quantities(bundle, n: int, steps: int, min_rows: int, seed: int = 0,
                     image_size: int = TINY_IMAGE_SIZE) -> list[dict]:
    """One probe per (family, quantity) of the curriculum: see the module's docstring."""
    from data.synthetic import generate

    rows = []
    for stage in (1, 2, 3):
        train = generate("train", stage, n, seed, image_size)
        test = generate("test", stage, max(1, n // 4), seed, image_size)
        x_tr, x_te = features(bundle, train), features(bundle, test)
        q_tr, q_te = quantity_rows(train), quantity_rows(test)
        for key in sorted(q_tr):
            tr, te = q_tr[key], q_te.get(key, [])
            if len(tr) < min_rows or len(te) < max(1, min_rows // 4):
                continue
            y_tr, y_te, k, chance = classes([v for _, v in tr], [v for _, v in te])
            rows.append({"stage": stage, "family": key[0], "quantity": key[1], "train": len(tr), "test": len(te),
                         "classes": k, "chance": chance,
                         "probe": probe_accuracy(x_tr[[i for i, _ in tr]], y_tr, x_te[[i for i, _ in te]], y_te, k,
                                                 steps)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tower_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="*", type=Path, help="own-data directories (data.jsonl + images)")
    ap.add_argument("--quantities", type=int, default=0, metavar="N",
                    help="probe the synthetic curriculum's quantities one by one, from N training figures a stage")
    ap.add_argument("--min-rows", type=int, default=40,
                    help="--quantities: probe a quantity only with at least this many training figures (default 40)")
    ap.add_argument("--model", default="tiny", help="the base whose tower is probed (default: the shipped tiny)")
    ap.add_argument("--steps", type=int, default=300, help="full-batch probe training steps (default 300)")
    ap.add_argument("--image-size", type=int, default=TINY_IMAGE_SIZE, metavar="PX",
                    help=f"--quantities: draw the curriculum's figures at PX px (default {TINY_IMAGE_SIZE}, the "
                         "shipped base's)")
    a = ap.parse_args(argv)
    if a.quantities < 0 or a.min_rows < 1:
        ap.error(f"--quantities {a.quantities} / --min-rows {a.min_rows}: N must be >= 0 (0 = off), --min-rows >= 1")
    if a.image_size < 32:
        ap.error(f"--image-size {a.image_size}: the curriculum draws its figures at 32 px or more")
    if not a.sets and a.quantities == 0:
        ap.error("name at least one own-data directory, or --quantities N (N > 0)")
    torch.set_num_threads(1)
    bundle = load_bundle(a.model, dtype=torch.float32, device="cpu")
    if a.quantities > 0:
        rows = probe_quantities(bundle, a.quantities, a.steps, a.min_rows, image_size=a.image_size)
        print(f"{'stage':>5} {'family':<14} {'quantity':<22} {'train':>6} {'test':>5} {'classes':>7} {'chance':>7} "
              f"{'probe':>6}")
        for r in rows:
            print(f"{r['stage']:>5} {r['family']:<14} {r['quantity'][:22]:<22} {r['train']:>6} {r['test']:>5} "
                  f"{r['classes']:>7} {r['chance']:>7.3f} {r['probe']:>6.3f}", flush=True)
        print(f"summary: {len(rows)} quantities probed on {a.model}'s frozen merged visual tokens "
              f"({a.image_size} px figures)")
    if not a.sets:
        return 0
    print(f"{'set':<28} {'train':>6} {'test':>5} {'classes':>7} {'chance':>7} {'probe':>6} {'shuffled':>8}")
    for d in a.sets:
        r = probe_set(bundle, d, a.steps)
        print(f"{str(d):<28} {r['train']:>6} {r['test']:>5} {r['classes']:>7} {r['chance']:>7.3f} {r['probe']:>6.3f} "
              f"{r['probe_shuffled']:>8.3f}", flush=True)
    print(f"summary: {len(a.sets)} sets probed on {a.model}'s frozen merged visual tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
