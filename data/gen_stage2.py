"""Stage 2 families: bar charts, line plots, two-digit tables and a measuring-cylinder figure.

Middle difficulty, integer and float answers (float = the mean of two values, precision 1).
Every value is printed on the figure (bar tops, point labels, cells): at 112 px a tiny
model resolves ~14 px patches, so reading a bar's height off gridlines would test the
eyesight of the vision encoder more than chart reasoning. The measuring cylinders are the
exception on purpose: their level is read against a labelled tick scale (0..6, ~12 px per
unit at 112 px), the one stage-2 skill that is genuinely "read a scale".

Questions:
    bar      value of the red bar / how much taller red than blue / mean of red and blue /
             sum of all bars                                                 (bar chart)
    line     value at x = 3 / highest minus lowest / mean at x = 1 and x = 4  (line plot)
    table2   difference in a row / mean of a column (2 rows)                 (table)
    cylinder level of one / how much more in left than right / poured together
                                                                  (scientific figure, mL)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from PIL import Image

from data.gen_common import Annotation, Family, Solution, add_up, difference, finish, mean_of_two, num, read_one
from data.gen_stage1 import describe_table, draw_table
from data.render import BLACK, COLOURS, GREY, LIGHT_GREY, WHITE, Canvas

_CHART_COLOURS = ("red", "blue", "green", "orange", "purple")


def _finish(question: str, sol: Solution, context: str, skills: list[str], float_answer: bool = False,
            task: str = "figure question answering", unit: str | None = None) -> Annotation:
    # A mean (the float answers) is taught later than reading and subtracting.
    return finish(question, sol, context=context, skills=skills, task=task, unit=unit,
                  grade="high school" if float_answer else "elementary school", float_answer=float_answer)


# ----------------------------------------------------------------------------- bar chart


def sample_bar(rng: random.Random) -> dict[str, Any]:
    n = rng.choice((3, 4))
    colours = rng.sample(_CHART_COLOURS, n)
    values = rng.sample(range(1, 10), n)  # distinct: "taller" is never a tie
    ask = rng.choice(("value", "diff", "mean", "sum"))
    a, b = rng.sample(range(n), 2)
    if values[a] < values[b]:
        a, b = b, a
    # Only the bars the question names enter the params (and so the content key).
    return {"colours": colours, "values": values, "ask": ask,
            "a": None if ask == "sum" else a, "b": b if ask in ("diff", "mean") else None}


def annotate_bar(p: dict[str, Any]) -> Annotation:
    cols, vals, ask, a, b = p["colours"], p["values"], p["ask"], p["a"], p["b"]
    names = [f"{c} bar" for c in cols]
    both = ["arithmetic reasoning", "statistical reasoning"]
    if ask == "value":
        sol = read_one(names[a], num(vals[a]), [("Reads the tallest bar instead", num(max(vals)))])
        return _finish(f"What is the value of the {names[a]}?", sol, "bar chart", ["statistical reasoning"])
    if ask == "diff":
        sol = difference(names[a], vals[a], names[b], vals[b])
        return _finish(f"How much taller is the {names[a]} than the {names[b]}?", sol, "bar chart", both)
    if ask == "mean":
        sol = mean_of_two(names[a], vals[a], names[b], vals[b])
        return _finish(f"What is the mean of the {names[a]} and the {names[b]}?", sol, "bar chart",
                       ["statistical reasoning"], float_answer=True)
    sol = add_up(names, [num(v) for v in vals], mistakes=[("Leaves out the last bar", num(sum(vals[:-1])))])
    return _finish("What is the sum of all the bar values?", sol, "bar chart", both)


def plot_frame(cv: Canvas, x0: float, y0: float, x1: float, y1: float, n: int,
               vmax: int = 9) -> tuple[Callable[[int, float], tuple[float, float]], float]:
    """Axes, a light gridline at every integer 1..vmax, and n equal slots along x.

    Returns ``at(i, v)`` (centre of slot i at value v, in unit coordinates) and the slot width.
    """
    for v in range(1, vmax + 1):
        y = y1 - (y1 - y0) * v / vmax
        cv.line([(x0, y), (x1, y)], LIGHT_GREY, 0.008)
    cv.line([(x0, y0), (x0, y1), (x1, y1)], BLACK, 0.018)
    slot = (x1 - x0) / n
    return (lambda i, v: (x0 + (i + 0.5) * slot, y1 - (y1 - y0) * v / vmax)), slot


def describe_bar(p: dict[str, Any]) -> str:
    return " ".join(f"{c} bar: {v}." for c, v in zip(p["colours"], p["values"]))


def render_bar(p: dict[str, Any], size: int) -> Image.Image:
    """Bars in the lattice's columns (bar i in column i), each value printed in the bar's
    colour in the bottom row, under its bar.

    Each label shares its 28 px cell (one visual token at 112 px) with nothing else, and
    carries the bar's colour: "the value of the red bar" is then one lookup (the cell that
    is red and holds a number), where a label floating above a bar of variable height made
    it two (find the red bar, then the number above it), which the tiny model did not learn.
    """
    cv = Canvas(size)
    at, slot = plot_frame(cv, 0.02, 0.04, 0.02 + 0.96 * len(p["values"]) / 4, 0.72, len(p["values"]))
    for i, (c, v) in enumerate(zip(p["colours"], p["values"])):
        (bx, top), (_, base) = at(i, v), at(i, 0)
        cv.box(bx - 0.32 * slot, top, bx + 0.32 * slot, base, fill=COLOURS[c])
        cv.number(str(v), bx, 0.86, 0.14, fill=COLOURS[c])
    return cv.image


# ----------------------------------------------------------------------------- line plot


def sample_line(rng: random.Random) -> dict[str, Any]:
    n = rng.choice((4, 5))
    values = [rng.randint(1, 8) for _ in range(n)]
    while max(values) == min(values):
        values[rng.randrange(n)] = rng.randint(1, 8)
    ask = rng.choice(("value", "range", "mean"))
    a, b = sorted(rng.sample(range(n), 2))
    return {"values": values, "ask": ask, "a": None if ask == "range" else a,
            "b": b if ask == "mean" else None}


def annotate_line(p: dict[str, Any]) -> Annotation:
    vals, ask, a, b = p["values"], p["ask"], p["a"], p["b"]
    if ask == "value":
        nb = a + 1 if a + 1 < len(vals) else a - 1  # the neighbour: the likeliest misread
        sol = read_one(f"value at x = {a + 1}", num(vals[a]),
                       [(f"Reads the value at x = {nb + 1} instead", num(vals[nb]))])
        return _finish(f"What is the value at x = {a + 1}?", sol, "line plot", ["statistical reasoning"])
    if ask == "range":
        sol = difference("highest", max(vals), "lowest", min(vals))
        return _finish("What is the highest value minus the lowest value?", sol, "line plot",
                       ["arithmetic reasoning", "statistical reasoning"])
    sol = mean_of_two(f"x = {a + 1}", vals[a], f"x = {b + 1}", vals[b])
    return _finish(f"What is the mean of the values at x = {a + 1} and x = {b + 1}?", sol, "line plot",
                   ["statistical reasoning"], float_answer=True)


def describe_line(p: dict[str, Any]) -> str:
    return " ".join(f"x = {i + 1}: {v}." for i, v in enumerate(p["values"]))


def render_line(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    at, _ = plot_frame(cv, 0.06, 0.14, 0.96, 0.82, len(p["values"]))
    pts = [at(i, v) for i, v in enumerate(p["values"])]
    cv.line(pts, COLOURS["blue"], 0.025)
    for i, ((x, y), v) in enumerate(zip(pts, p["values"])):
        cv.disc(x, y, 0.035, fill=COLOURS["blue"])
        # A white patch behind the label keeps it readable where the line runs through it.
        cv.box(x - 0.04, y - 0.14, x + 0.04, y - 0.03, fill=WHITE)
        cv.number(str(v), x, y - 0.085, 0.09)
        cv.number(str(i + 1), x, 0.91, 0.09, fill=GREY)  # x-axis label
    return cv.image


# ----------------------------------------------------------------------------- two-digit table


def sample_table2(rng: random.Random) -> dict[str, Any]:
    rows, cols = rng.choice(((2, 2), (2, 3)))
    values = [[rng.randint(10, 40) for _ in range(cols)] for _ in range(rows)]
    ask = rng.choice(("diff", "mean"))
    i, j = rng.randrange(rows), rng.randrange(cols)
    if ask == "diff" and max(values[i]) == min(values[i]):
        values[i][0] += 1  # a row of equal values has no "largest minus smallest"
    return {"values": values, "ask": ask, "i": i if ask == "diff" else None,
            "j": j if ask == "mean" else None}


def annotate_table2(p: dict[str, Any]) -> Annotation:
    vals, ask, i, j = p["values"], p["ask"], p["i"], p["j"]
    skills = ["arithmetic reasoning", "statistical reasoning"]
    if ask == "diff":
        sol = difference(f"largest in row {i + 1}", max(vals[i]), f"smallest in row {i + 1}", min(vals[i]))
        return _finish(f"What is the largest number in row {i + 1} minus the smallest?", sol, "table",
                       skills, task="math word problem")
    sol = mean_of_two("row 1", vals[0][j], "row 2", vals[1][j])
    return _finish(f"What is the mean of the numbers in column {j + 1}?", sol, "table", skills,
                   float_answer=True, task="math word problem")


def render_table2(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    draw_table(cv, [[str(v) for v in row] for row in p["values"]])
    return cv.image


# ----------------------------------------------------------------------------- measuring cylinders

CYL_MAX = 6  # scale 0..CYL_MAX mL; one unit is ~12 px at 112 px


def sample_cylinder(rng: random.Random) -> dict[str, Any]:
    left, right = rng.sample(range(1, CYL_MAX + 1), 2)
    colour = rng.choice(("blue", "green", "orange"))
    ask, side = rng.choice(("one", "more", "both")), rng.randrange(2)
    return {"levels": [left, right], "colour": colour, "ask": ask, "side": side if ask == "one" else None}


def annotate_cylinder(p: dict[str, Any]) -> Annotation:
    (left, right), ask, side = p["levels"], p["ask"], p["side"]
    names = ["left cylinder", "right cylinder"]
    if ask == "one":
        sol = read_one(names[side], num(p["levels"][side]),
                       [(f"Reads the {names[1 - side]} instead", num(p["levels"][1 - side]))])
        question, skills = f"How many mL of liquid are in the {names[side]}?", ["scientific reasoning"]
    elif ask == "more":
        a, b = (0, 1) if left > right else (1, 0)
        sol = difference(names[a], p["levels"][a], names[b], p["levels"][b])
        question = f"How many more mL are in the {names[a]} than in the {names[b]}?"
        skills = ["scientific reasoning", "arithmetic reasoning"]
    else:
        sol = add_up(names, [num(left), num(right)],
                     mistakes=[("Subtracts instead of adding", num(abs(left - right)))])
        question = "If both cylinders are poured together, how many mL are there?"
        skills = ["scientific reasoning", "arithmetic reasoning"]
    return _finish(question, sol, "scientific figure", skills, task="textbook question answering", unit="mL")


def describe_cylinder(p: dict[str, Any]) -> str:
    left, right = p["levels"]
    return f"left cylinder: {left}. right cylinder: {right}."


def render_cylinder(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    y0, y1 = 0.1, 0.92  # scale top (CYL_MAX) and bottom (0)
    unit = (y1 - y0) / CYL_MAX
    for v in range(0, CYL_MAX + 1, 2):  # labelled scale on the far left
        cv.number(str(v), 0.08, y1 - v * unit, 0.08)
    for k, level in enumerate(p["levels"]):
        cx0, cx1 = 0.2 + k * 0.42, 0.2 + k * 0.42 + 0.3
        cv.box(cx0, y1 - level * unit, cx1, y1, fill=COLOURS[p["colour"]])
        for v in range(CYL_MAX + 1):  # a tick at every mL, long ticks at even values
            y = y1 - v * unit
            cv.line([(cx0, y), (cx0 + (0.12 if v % 2 == 0 else 0.07), y)], BLACK, 0.012)
        cv.line([(cx0, y0 - 0.04), (cx0, y1), (cx1, y1), (cx1, y0 - 0.04)], BLACK, 0.022)
    return cv.image


FAMILIES = (
    Family("bar_chart", 2, sample_bar, annotate_bar, render_bar, describe_bar),
    Family("line_plot", 2, sample_line, annotate_line, render_line, describe_line),
    Family("table_stats", 2, sample_table2, annotate_table2, render_table2, describe_table),
    Family("cylinders", 2, sample_cylinder, annotate_cylinder, render_cylinder, describe_cylinder),
)
