"""``python -m data.clock``: a numeric figure family the shipped tiny model never saw.

One-handed clock faces: a circle, twelve tick marks (the one at 12 o'clock long and red, so
the face has an up), and one thick hand pointing at an hour. The question is always "Which
hour does the hand of the clock point to?" and the gold answer an integer 1..12, drawn
uniformly, so a constant answer scores about 1/12.

Why this family: the shipped base (grpo/tiny_model/) was pretrained on the synthetic
curriculum alone (scenes, tables, bar and line charts, cylinders, grid geometry, region
sums, metro maps: data/gen_stage*.py); none of them asks for a direction, has a dial, or
draws a hand. Reading the hour means reading an angle, a skill the base was never taught.
It is the "real set a model never saw" case of the README's "Your own data" section, made
here so it can be regenerated and measured (bench/collapse.py).

The output is the minimal own-data format (data/sources.py): ``OUT/data.jsonl``, one
``{"pid", "question", "answer", "image"}`` row a line, and ``OUT/images/<pid>.png``; no
reasoning, no metadata, as a user's own set would be. Row ``i`` of seed ``s`` is drawn
from its own ``random.Random("clock/s/i")``, so the same (n, seed) gives the same bytes,
and a longer set extends a shorter one. Faces vary in hand colour, centre, radius and hand
length, so two rows with the same hour are rarely the same picture.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

from data.render import BLACK, COLOURS, Canvas

QUESTION = "Which hour does the hand of the clock point to?"
HOURS = tuple(range(1, 13))
IMAGE_SIZE = 112  # the shipped model's image side (its pretraining's model.image_size)
_RED = COLOURS["red"]
_HAND_COLOURS = ("blue", "green", "orange", "purple", "black")


def sample(rng: random.Random) -> dict:
    """The params of one face: the hour (the answer) and how the face is drawn."""
    return {
        "hour": rng.choice(HOURS),
        "colour": rng.choice(_HAND_COLOURS),
        "cx": round(rng.uniform(0.44, 0.56), 3),
        "cy": round(rng.uniform(0.44, 0.56), 3),
        "r": round(rng.uniform(0.34, 0.42), 3),
        "hand": round(rng.uniform(0.6, 0.8), 3),  # the hand's length, a share of the radius
    }


def render(p: dict, size: int = IMAGE_SIZE):
    """The face of params ``p`` as a PIL image (no anti-aliasing: the same pixels everywhere)."""
    c = Canvas(size)
    cx, cy, r = p["cx"], p["cy"], p["r"]
    c.disc(cx, cy, r, outline=BLACK, width=0.02)
    for h in HOURS:
        a = 2 * math.pi * h / 12  # clockwise from 12 o'clock; y grows downwards
        inner = 0.7 if h == 12 else 0.85
        c.line([(cx + inner * r * math.sin(a), cy - inner * r * math.cos(a)),
                (cx + 0.97 * r * math.sin(a), cy - 0.97 * r * math.cos(a))],
               fill=_RED if h == 12 else BLACK, width=0.03 if h == 12 else 0.015)
    a = 2 * math.pi * p["hour"] / 12
    fill = BLACK if p["colour"] == "black" else COLOURS[p["colour"]]
    tip = (cx + p["hand"] * r * math.sin(a), cy - p["hand"] * r * math.cos(a))
    c.line([(cx, cy), tip], fill=fill, width=0.045)
    c.disc(cx, cy, 0.035, fill=fill)
    return c.image


def rows(n: int, seed: int) -> list[tuple[dict, dict]]:
    """``n`` (row, params) pairs of ``seed``; the row is what data.jsonl holds."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--n must be a positive integer, got {n!r}")
    out = []
    for i in range(n):
        p = sample(random.Random(f"clock/{seed}/{i}"))
        pid = f"clock-{seed}-{i}"
        out.append(({"pid": pid, "question": QUESTION, "answer": str(p["hour"]),
                     "image": f"images/{pid}.png"}, p))
    return out


def write(out: Path, n: int, seed: int, size: int = IMAGE_SIZE) -> int:
    """Write the set into the new (or empty) directory ``out`` atomically; returns the row count."""
    from grpo_infra.atomic import new_directory

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory: name a new one")
    drawn = rows(n, seed)
    with new_directory(out) as tmp:
        (tmp / "images").mkdir()
        for row, p in drawn:
            render(p, size).save(tmp / row["image"], format="PNG")
        (tmp / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row, _ in drawn))
    return len(drawn)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from grpo_infra.signals import StopNow, exit_code, signal_name, stops_at_once

    ap = argparse.ArgumentParser(prog="python -m data.clock", description=__doc__.split("\n\n")[1] + (
        "\n\nWrites OUT/data.jsonl + OUT/images/ (the own-data format); then:"
        "\n    python -m grpo.train --phase B --run.data OUT"), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="a new (or empty) directory to write")
    ap.add_argument("--n", type=int, default=400, help="rows to write (default 400)")
    ap.add_argument("--seed", type=int, default=0, help="the seed the rows are drawn from (default 0)")
    ap.add_argument("--image-size", type=int, default=IMAGE_SIZE, help=f"image side in pixels (default {IMAGE_SIZE})")
    args = ap.parse_args(argv)
    try:
        with stops_at_once():
            print(f"wrote {write(args.out, args.n, args.seed, args.image_size)} clock faces to {args.out} (data.jsonl + "
                  f"images/); train with: python -m grpo.train --phase B --run.data {args.out}")
        return 0
    except StopNow as stop:
        print(f"data.clock stopped on {signal_name(stop.signum)}; nothing was written to {args.out}", file=sys.stderr)
        return exit_code(stop.signum)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
