"""Stage 1 families: counting shapes in a synthetic scene, and reading a small table.

Elementary, integer answers, one or two operations. Scenes hold 2-6 filled shapes on a
4x4 lattice, each group one colour AND one kind ("red circles"), so a question can name
a group unambiguously and a 112 px image still shows every object at ~19 px. Tables are
2x2 / 2x3 / 3x2 grids of single digits drawn as thick seven-segment numbers, one cell per
lattice cell (see draw_table).

Questions (one template each, short on purpose):
    count_one    How many red circles are there?                      read         (1 op)
    count_total  How many shapes are there in total?                  add groups   (1-2 ops)
    count_more   How many more red circles than blue squares are there? subtract   (1 op)
    table_cell   What is the number in row 2, column 1?               read         (1 op)
    table_sum    What is the sum of row 2? / of column 1?             add cells    (1-2 ops)
"""

from __future__ import annotations

import random
from typing import Any

from PIL import Image

from data.gen_common import Annotation, Family, add_up, difference, finish, num, read_one
from data.render import BLACK, COLOURS, SHAPES, Canvas

LATTICE = 4  # scene objects sit on a LATTICE x LATTICE grid of cells
_SCENE_COLOURS = ("red", "blue", "green", "orange")


def _plural(colour: str, kind: str) -> str:
    return f"{colour} {kind}s"


# ----------------------------------------------------------------------------- counting scene


def sample_scene(rng: random.Random) -> dict[str, Any]:
    n_groups = rng.choice((2, 2, 3))
    colours = rng.sample(_SCENE_COLOURS, n_groups)
    kinds = rng.sample(SHAPES, n_groups)
    total = rng.randint(n_groups + 1, 6)
    # Random composition of `total` into n_groups positive counts.
    cuts = sorted(rng.sample(range(1, total), n_groups - 1))
    counts = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    cells = rng.sample(range(LATTICE * LATTICE), total)
    groups, at = [], 0
    for colour, kind, c in zip(colours, kinds, counts):
        groups.append({"colour": colour, "kind": kind, "cells": sorted(cells[at:at + c])})
        at += c
    # Canonical group order (the picture has none): the content key must not depend on it,
    # and the "total" reasoning always lists colours in the same order.
    groups.sort(key=lambda g: _SCENE_COLOURS.index(g["colour"]))
    ask, target = rng.choice(("one", "total", "more")), []
    if ask == "one":
        target = [rng.randrange(n_groups)]
    elif ask == "more":
        a, b = rng.sample(range(n_groups), 2)
        na, nb = len(groups[a]["cells"]), len(groups[b]["cells"])
        if na == nb:
            ask = "total"  # "how many more" needs a strict difference
        else:
            target = [a, b] if na > nb else [b, a]  # larger first: the answer is positive
    return {"groups": groups, "ask": ask, "target": target}


def annotate_scene(p: dict[str, Any]) -> Annotation:
    groups = p["groups"]
    names = [_plural(g["colour"], g["kind"]) for g in groups]
    counts = [len(g["cells"]) for g in groups]
    total = num(sum(counts))
    if p["ask"] == "one":
        (i,) = p["target"]
        question = f"How many {names[i]} are there?"
        everything = (f"Counts all {total} shapes, not only the {names[i]}", total)
        sol = read_one(names[i], num(counts[i]), [everything])
    elif p["ask"] == "total":
        question = "How many shapes are there in total?"
        sol = add_up(names, [num(c) for c in counts],
                     mistakes=[(f"Leaves out the {names[-1]}", num(sum(counts[:-1])))])
    else:
        i, j = p["target"]
        question = f"How many more {names[i]} than {names[j]} are there?"
        sol = difference(names[i], counts[i], names[j], counts[j])
    return finish(question, sol, context="synthetic scene", skills=["arithmetic reasoning"],
                  grade="elementary school", task="visual question answering")


def describe_scene(p: dict[str, Any]) -> str:
    return " ".join(f"{_plural(g['colour'], g['kind'])}: {len(g['cells'])}." for g in p["groups"])


def render_scene(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    margin, cell = 0.04, 0.92 / LATTICE
    for g in p["groups"]:
        for c in g["cells"]:
            cx = margin + (c % LATTICE + 0.5) * cell
            cy = margin + (c // LATTICE + 0.5) * cell
            cv.shape(g["kind"], cx, cy, 0.36 * cell, COLOURS[g["colour"]])
    return cv.image


# ----------------------------------------------------------------------------- table


def sample_table(rng: random.Random) -> dict[str, Any]:
    rows, cols = rng.choice(((2, 2), (2, 3), (3, 2)))
    values = [[rng.randint(1, 9) for _ in range(cols)] for _ in range(rows)]
    ask = rng.choice(("cell", "row", "col"))
    i, j = rng.randrange(rows), rng.randrange(cols)
    # Only what the question names enters the params (and so the content key).
    return {"values": values, "ask": ask, "i": None if ask == "col" else i, "j": None if ask == "row" else j}


def annotate_table(p: dict[str, Any]) -> Annotation:
    values, ask, i, j = p["values"], p["ask"], p["i"], p["j"]
    rows, cols = len(values), len(values[0])
    if ask == "cell":
        where = f"row {i + 1}, column {j + 1}"
        mistakes = []
        if j < rows and i < cols:  # the transposed cell exists
            mistakes.append((f"Swaps row and column (row {j + 1}, column {i + 1})", num(values[j][i])))
        return finish(f"What is the number in {where}?", read_one(where, num(values[i][j]), mistakes),
                      context="table", skills=["statistical reasoning"], grade="elementary school",
                      task="math word problem")
    if ask == "row":
        label, cells = f"row {i + 1}", [(i, c) for c in range(cols)]
        swapped = [(r, i) for r in range(rows)] if i < cols else []  # column i: row/column mix-up
    else:
        label, cells = f"column {j + 1}", [(r, j) for r in range(rows)]
        swapped = [(j, c) for c in range(cols)] if j < rows else []
    line = [values[r][c] for r, c in cells]
    mistakes = [(f"Leaves out the last value of {label}", num(sum(line[:-1])))]
    if swapped:
        other = "column" if ask == "row" else "row"
        mistakes.append((f"Adds {other} {(i if ask == 'row' else j) + 1} instead of {label}",
                         num(sum(values[r][c] for r, c in swapped))))
    sol = add_up([f"row {r + 1}, column {c + 1}" for r, c in cells], [num(v) for v in line],
                 label=label, mistakes=mistakes)
    return finish(f"What is the sum of the numbers in {label}?", sol, context="table",
                  skills=["arithmetic reasoning", "statistical reasoning"], grade="elementary school",
                  task="math word problem")


def draw_table(cv: Canvas, values: list[list[str]]) -> None:
    """A grid of numbers with thick rules, one cell per LATTICE cell, anchored top-left.

    Cells sit on the same 4 x 4 lattice as the scene objects, which is also the grid of
    the merged visual tokens at 112 px (28 px each): cell (r, c) is visual token (r, c)
    at every table shape, so "row 2, column 1" always names the same place in the
    picture. Centred tables of shape-dependent cell size (an earlier layout) left a tiny
    model to infer that mapping per table shape, and it did not (row/column reads stayed
    near chance after 25k examples; aligned cells: 0.95 after 19k, with the perception
    labels of grpo/warmup/perception.py). Shared with stage 2.
    """
    rows, cols = len(values), len(values[0])
    x0 = y0 = 0.02
    cw = ch = 0.96 / LATTICE
    rule = 0.025
    for r in range(rows + 1):
        cv.box(x0, y0 + r * ch - rule / 2, x0 + cols * cw, y0 + r * ch + rule / 2, fill=BLACK)
    for c in range(cols + 1):
        cv.box(x0 + c * cw - rule / 2, y0, x0 + c * cw + rule / 2, y0 + rows * ch, fill=BLACK)
    longest = max(len(v) for row in values for v in row)
    h = min(0.5 * ch, 0.6 * cw / (0.8 * longest))
    for r, row in enumerate(values):
        for c, v in enumerate(row):
            cv.number(v, x0 + (c + 0.5) * cw, y0 + (r + 0.5) * ch, h)


def describe_table(p: dict[str, Any]) -> str:
    """Row by row, as the row-sum reasoning reads them: "row 1: 5, 7, 7. row 2: 6, 4, 1." """
    return " ".join(f"row {r + 1}: {', '.join(str(v) for v in row)}." for r, row in enumerate(p["values"]))


def render_table(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    draw_table(cv, [[str(v) for v in row] for row in p["values"]])
    return cv.image


FAMILIES = (
    Family("scene_count", 1, sample_scene, annotate_scene, render_scene, describe_scene),
    Family("table_read", 1, sample_table, annotate_table, render_table, describe_table),
)
