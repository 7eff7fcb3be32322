"""Stage 1 families: counting shapes in a synthetic scene, and reading a small table.

Elementary, integer answers, one or two operations. Scenes hold 2-6 filled shapes on a
4x4 lattice, each group one colour AND one kind ("red circles"), so a question can name
a group unambiguously and a 112 px image still shows every object at ~19 px. Tables are
2x2 / 2x3 / 3x2 grids of single digits drawn as thick seven-segment numbers.

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

from data.gen_common import (
    W_IMPORTANT, Annotation, Family, alternatives, expr_alternatives, num, rubric_answer,
    rubric_pitfalls, rubric_read, rubric_steps,
)
from data.render import BLACK, COLOURS, SHAPES, Canvas
from data.schema import Intermediate

LATTICE = 4  # scene objects sit on a LATTICE x LATTICE grid of cells
_SCENE_COLOURS = ("red", "blue", "green", "orange")


def _plural(colour: str, kind: str) -> str:
    return f"{colour} {kind}s"


def add_steps(names: list[str], values: list[str]) -> tuple[str, list[list[str]], list[Intermediate]]:
    """Reasoning, key steps and intermediates of 'read each value, then add them'.

    >>> add_steps(["red circles", "blue squares"], ["3", "2"])[0]
    'red circles: 3. blue squares: 2. 3 + 2 = 5.'
    """
    total = num(sum(int(v) for v in values))
    reads = " ".join(f"{n}: {v}." for n, v in zip(names, values))
    expr = " + ".join(values)
    if len(values) == 2:
        expr_alts = expr_alternatives(values[0], "+", values[1])
    else:
        expr_alts = [expr, expr.replace(" ", "")]
    key_steps = [alternatives(v) for v in values] + [expr_alts]
    inter = [Intermediate(n, v) for n, v in zip(names, values)]
    return f"{reads} {expr} = {total}.", key_steps, inter


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
    counts = [num(len(g["cells"])) for g in groups]
    total = num(sum(len(g["cells"]) for g in groups))
    ask = p["ask"]
    if ask == "one":
        i = p["target"][0]
        question = f"How many {names[i]} are there?"
        answer = counts[i]
        reasoning = f"{names[i]}: {answer}."
        key_steps, inter, hops = [alternatives(answer)], [Intermediate(names[i], answer)], 1
        rubrics = [rubric_read(f"Counts {answer} {names[i]}", answer)]
        mistakes = [(f"Counts all {total} shapes instead of only the {names[i]}", total)]
    elif ask == "total":
        question = "How many shapes are there in total?"
        answer = total
        reasoning, key_steps, inter = add_steps(names, counts)
        hops = len(groups) - 1
        rubrics = [rubric_read(f"Counts {c} {n}", c, W_IMPORTANT) for n, c in zip(names, counts)]
        rubrics.append(rubric_steps("Adds the group counts", counts + [total]))
        left_out = num(int(total) - int(counts[-1]))
        mistakes = [(f"Leaves out the {names[-1]}", left_out)]
    else:  # "more"
        i, j = p["target"]
        question = f"How many more {names[i]} than {names[j]} are there?"
        answer = num(int(counts[i]) - int(counts[j]))
        reasoning = f"{names[i]}: {counts[i]}. {names[j]}: {counts[j]}. {counts[i]} - {counts[j]} = {answer}."
        key_steps = [alternatives(counts[i]), alternatives(counts[j]),
                     expr_alternatives(counts[i], "-", counts[j])]
        inter = [Intermediate(names[i], counts[i]), Intermediate(names[j], counts[j])]
        hops = 1
        rubrics = [rubric_read(f"Counts {counts[i]} {names[i]}", counts[i], W_IMPORTANT),
                   rubric_read(f"Counts {counts[j]} {names[j]}", counts[j], W_IMPORTANT),
                   rubric_steps("Subtracts the smaller count from the larger",
                                [counts[i], counts[j], answer])]
        both = num(int(counts[i]) + int(counts[j]))
        mistakes = [(f"Adds the two counts ({counts[i]} + {counts[j]})", both),
                    (f"Reports the number of {names[i]} instead of the difference", counts[i])]
    rubrics += [rubric_answer(answer)] + rubric_pitfalls(answer, mistakes)
    return Annotation(question, answer, "integer", None, "synthetic scene", ["arithmetic reasoning"],
                      "elementary school", "visual question answering", reasoning, key_steps,
                      inter, hops, rubrics)


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
    skills = ["statistical reasoning"]
    if ask == "cell":
        answer = num(values[i][j])
        where = f"row {i + 1}, column {j + 1}"
        question = f"What is the number in {where}?"
        reasoning = f"{where}: {answer}."
        key_steps, inter, hops = [alternatives(answer)], [Intermediate(where, answer)], 1
        rubrics = [rubric_read(f"Reads {answer} in {where}", answer)]
        mistakes = []
        if j < rows and i < cols:  # the transposed cell exists
            mistakes.append((f"Swaps row and column (reads row {j + 1}, column {i + 1})", num(values[j][i])))
    else:
        skills = ["arithmetic reasoning", "statistical reasoning"]
        if ask == "row":
            line, label = values[i], f"row {i + 1}"
            names = [f"row {i + 1}, column {c + 1}" for c in range(cols)]
        else:
            line, label = [values[r][j] for r in range(rows)], f"column {j + 1}"
            names = [f"row {r + 1}, column {j + 1}" for r in range(rows)]
        question = f"What is the sum of the numbers in {label}?"
        cells = [num(v) for v in line]
        answer = num(sum(line))
        _, key_steps, inter = add_steps(names, cells)
        reasoning = f"{label}: {', '.join(cells)}. {' + '.join(cells)} = {answer}."
        hops = len(cells) - 1
        rubrics = [rubric_read(f"Reads the {label} values {', '.join(cells)}", cells[0], W_IMPORTANT),
                   rubric_steps(f"Adds the {label} values in order", cells + [answer])]
        mistakes = [(f"Leaves out the last value of {label}", num(sum(line[:-1])))]
        k = i if ask == "row" else j  # swapping row and column: the line with the same number
        if ask == "row" and k < cols:
            mistakes.append((f"Adds column {k + 1} instead of {label}", num(sum(values[r][k] for r in range(rows)))))
        elif ask == "col" and k < rows:
            mistakes.append((f"Adds row {k + 1} instead of {label}", num(sum(values[k]))))
    rubrics += [rubric_answer(answer)] + rubric_pitfalls(answer, mistakes)
    return Annotation(question, answer, "integer", None, "table", skills, "elementary school",
                      "math word problem", reasoning, key_steps, inter, hops, rubrics)


def draw_table(cv: Canvas, values: list[list[str]], x0: float = 0.06, y0: float = 0.06,
               x1: float = 0.94, y1: float = 0.94) -> None:
    """Grid of numbers with thick rules; digit height follows the cell size (shared with stage 2)."""
    rows, cols = len(values), len(values[0])
    cw, ch = (x1 - x0) / cols, (y1 - y0) / rows
    rule = 0.025
    for r in range(rows + 1):
        cv.box(x0, y0 + r * ch - rule / 2, x1, y0 + r * ch + rule / 2, fill=BLACK)
    for c in range(cols + 1):
        cv.box(x0 + c * cw - rule / 2, y0, x0 + c * cw + rule / 2, y1, fill=BLACK)
    longest = max(len(v) for row in values for v in row)
    h = min(0.5 * ch, 0.6 * cw / (0.8 * longest))
    for r, row in enumerate(values):
        for c, v in enumerate(row):
            cv.number(v, x0 + (c + 0.5) * cw, y0 + (r + 0.5) * ch, h)


def render_table(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    draw_table(cv, [[str(v) for v in row] for row in p["values"]])
    return cv.image


FAMILIES = (
    Family("scene_count", 1, sample_scene, annotate_scene, render_scene),
    Family("table_read", 1, sample_table, annotate_table, render_table),
)
