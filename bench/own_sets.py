"""Own-data sets the shipped base never saw, written in the minimal own-data format.

    python -m bench.own_sets digits  OUT            # 1,797 scanned handwritten digits (scikit-learn), 0-9
    python -m bench.own_sets digit_sum OUT --n 1800 # two scanned digits side by side, "their sum?", 0-18
                                                    # (--reasoning: with "left digit: 3. right digit: 7. 3 + 7 = 10."
                                                    #  and those three steps as key_steps)
    python -m bench.own_sets polygons OUT --n 1200  # a filled regular polygon, "how many sides?", 3-8
    python -m data.clock --out OUT --n 1200         # clock faces, "which hour?", 1-12 (its own module)
    python -m bench.own_sets shuffled OUT --source SET   # SET with its training rows' answers permuted

Each writes ``OUT/data.jsonl`` (``{"pid", "question", "answer", "image"}`` a line) and
``OUT/images/``: no reasoning (but digit_sum's with ``--reasoning``), no metadata, as a user's own set arrives; train with
``python -m grpo.train --phase B --run.data OUT``. They are the measuring sets of the README's
"Your own data: what to expect":

    digits     a real set not made here: scikit-learn's copy of the UCI optical recognition
               of handwritten digits (8 x 8 scans, 16 grey levels; it ships inside the
               scikit-learn wheel, so nothing is downloaded), scaled to 112 px, dark on light.
               A single reading; the shipped base was pretrained on rendered digits in tables,
               never on handwriting.
    digit_sum  two of those scans side by side, the answer their sum: two readings combined.
               Pairs are drawn with a seeded RNG from the 1,797 scans.
    polygons   PIL-drawn filled regular polygons of 3 to 8 sides, random size, rotation and
               colour: a count the base was never asked for.

    shuffled   the label-prior control: SET's rows with the answers of its training rows
               permuted among them (the held-out test tenth, data/holdout.py's choice by pid,
               keeps its true answers), images linked, not copied. A warm-up on it learns the
               label distribution and nothing that depends on the image.

Rows are deterministic in (family, n, seed). scikit-learn is needed for digits and digit_sum
only (``pip install scikit-learn``); it is not a dependency of the trainer.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 112  # the shipped model's image side


def _scans() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("bench.own_sets: the digits sets need scikit-learn (pip install scikit-learn)") from None
    d = load_digits()
    return d.images, d.target


def _scan_image(scan: np.ndarray, size: int) -> Image.Image:
    """An 8 x 8 scan of 0..16 ink as a size x size RGB picture, dark ink on light paper."""
    grey = (255 - scan * (255 / 16)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(grey, "L").resize((size, size), Image.NEAREST).convert("RGB")


def digits(n: int, seed: int) -> list[tuple[dict, Image.Image]]:
    """Every scan once (n <= 1,797: the first n of a seeded shuffle)."""
    images, target = _scans()
    order = list(range(len(target)))
    random.Random(f"digits/{seed}").shuffle(order)
    return [({"pid": f"digit-{i}", "question": "Which digit is written in the image?", "answer": str(int(target[i]))},
             _scan_image(images[i], SIZE)) for i in order[:n]]


def digit_sum(n: int, seed: int, reasoning: bool = False) -> list[tuple[dict, Image.Image]]:
    """Two scans side by side (each half the width), the answer their sum; ``reasoning``: each row
    also carries its worked reasoning, "left digit: 3. right digit: 7. 3 + 7 = 10.", and that
    reasoning's three steps as ``key_steps`` (what R1-VL's step reward, ``step_rar``, credits: each
    reading and the sum); the same rows and images either way."""
    images, target = _scans()
    rng, rows = random.Random(f"digit_sum/{seed}"), []
    for k in range(n):
        a, b = rng.randrange(len(target)), rng.randrange(len(target))
        canvas = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
        half = SIZE // 2
        canvas.paste(_scan_image(images[a], half), (0, SIZE // 4))
        canvas.paste(_scan_image(images[b], half), (half, SIZE // 4))
        ta, tb = int(target[a]), int(target[b])
        row = {"pid": f"sum-{seed}-{k}", "question": "What is the sum of the two digits in the image?",
               "answer": str(ta + tb)}
        if reasoning:
            steps = [f"left digit: {ta}", f"right digit: {tb}", f"{ta} + {tb} = {ta + tb}"]
            row["reasoning"] = ". ".join(steps) + "."
            row["key_steps"] = [[step] for step in steps]
        rows.append((row, canvas))
    return rows


_COLOURS = [(200, 40, 40), (40, 120, 200), (40, 160, 70), (220, 140, 30), (130, 60, 170), (30, 30, 30)]


def polygons(n: int, seed: int) -> list[tuple[dict, Image.Image]]:
    """A filled regular polygon of 3..8 sides, random radius, rotation, centre and colour."""
    rows = []
    for k in range(n):
        rng = random.Random(f"polygons/{seed}/{k}")
        sides = rng.randint(3, 8)
        r, rot = rng.uniform(0.25, 0.42) * SIZE, rng.uniform(0, 2 * math.pi)
        cx, cy = (rng.uniform(0.45, 0.55) * SIZE for _ in range(2))
        img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
        pts = [(cx + r * math.cos(rot + 2 * math.pi * j / sides), cy + r * math.sin(rot + 2 * math.pi * j / sides))
               for j in range(sides)]
        ImageDraw.Draw(img).polygon(pts, fill=rng.choice(_COLOURS))
        rows.append(({"pid": f"polygon-{seed}-{k}", "question": "How many sides does the polygon in the image have?",
                      "answer": str(sides)}, img))
    return rows


FAMILIES = {"digits": digits, "digit_sum": digit_sum, "polygons": polygons}


def shuffled(source: Path, out: Path, seed: int) -> int:
    """SET's data.jsonl with its training rows' answers permuted; the test rows untouched."""
    from data.holdout import TEST_EVERY, TEST_MAX, _rank

    rows = [json.loads(line) for line in (source / "data.jsonl").read_text().splitlines() if line.strip()]
    k = min(len(rows) // TEST_EVERY, TEST_MAX)
    test = set(sorted({str(r["pid"]) for r in rows}, key=_rank)[:k])
    train = [i for i, r in enumerate(rows) if str(r["pid"]) not in test]
    answers = [rows[i]["answer"] for i in train]
    random.Random(f"shuffled/{seed}").shuffle(answers)
    for i, a in zip(train, answers):
        rows[i] = dict(rows[i], answer=a)
    out.mkdir(parents=True, exist_ok=True)
    (out / "images").symlink_to((source / "images").resolve())
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def write(family: str, out: Path, n: int, seed: int, reasoning: bool = False) -> int:
    """Write the set; the directory must be new or empty. -> rows written."""
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"bench.own_sets: {out} is not empty; name a new directory")
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = FAMILIES[family](n, seed, reasoning=True) if reasoning else FAMILIES[family](n, seed)
    with open(out / "data.jsonl", "w") as f:
        for row, img in rows:
            row = dict(row, image=f"images/{row['pid']}.png")
            img.save(out / row["image"])
            f.write(json.dumps(row) + "\n")
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.own_sets", description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=sorted(FAMILIES) + ["shuffled"])
    ap.add_argument("out", type=Path, help="a new (or empty) directory")
    ap.add_argument("--n", type=int, default=1797, help="rows (digits: at most 1,797; default 1797)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", type=Path, help="shuffled: the set whose training answers to permute")
    ap.add_argument("--reasoning", action="store_true",
                    help="digit_sum: each row also carries its worked reasoning (the warm-up's target), the same rows")
    a = ap.parse_args(argv)
    if a.reasoning and a.family != "digit_sum":
        ap.error(f"--reasoning is for digit_sum (its two readings and their sum), not {a.family}")
    if a.family == "shuffled":
        if a.source is None or not (a.source / "data.jsonl").is_file():
            ap.error(f"shuffled needs --source SET, a directory with data.jsonl (got {a.source})")
        if a.out.exists() and any(a.out.iterdir()):
            ap.error(f"{a.out} is not empty; name a new directory")
        n = shuffled(a.source, a.out, a.seed)
        print(f"wrote {n} rows of {a.source} with the training answers permuted to {a.out}")
        return 0
    if a.n < 1 or (a.family == "digits" and a.n > 1797):
        ap.error(f"--n {a.n}: must be 1..{1797 if a.family == 'digits' else 'any'}")
    n = write(a.family, a.out, a.n, a.seed, a.reasoning)
    print(f"wrote {n} {a.family} rows to {a.out}; train with: python -m grpo.train --phase B --run.data {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
