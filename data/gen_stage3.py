"""Stage 3 families: grid geometry, region sums, and hops on a generated metro-style map.

Hard, multi-step answers: every template chains two or more quantities, so the worked
reasoning has intermediates for RewardMap's detail credit and StepRAR's key steps, and a
typical mistake (forgetting to halve, counting stations instead of stops) gives a
PITFALL rubric with a checkable wrong answer.

    geometry  a rectangle / right triangle / L-shape on a 6x6 unit grid; area or
              perimeter by counting grid units            (geometry diagram, 1-3 ops)
    regions   four boxes with red or blue borders, a digit in each; the red sum, or the
              red total minus the blue total                (abstract scene, 1-3 ops)
    metro     two or three coloured lines on a 5x5 station lattice; stops from the red
              station to the blue one, changing lines at the crossings
                                                            (abstract scene, 1-2 ops)

The metro map is RewardMap's route-planning idea shrunk to 112 px: the route is unique
(lines cross only at the transfer stations), so the stop count per line is a well-defined
intermediate and a transfer makes the question multi-hop.
"""

from __future__ import annotations

import random
from typing import Any

from PIL import Image

from data.gen_common import (
    Annotation,
    Family,
    Solution,
    add_up,
    alternatives,
    expr_alternatives,
    finds,
    finish,
    num,
    rubric_pitfalls,
    rubric_steps,
)
from data.render import BLACK, COLOURS, LIGHT_GREY, WHITE, Canvas
from data.schema import Intermediate

GRID = 6  # geometry board: GRID x GRID unit squares
_FILL = (175, 205, 255)


# ----------------------------------------------------------------------------- grid geometry


def sample_geometry(rng: random.Random) -> dict[str, Any]:
    shape = rng.choice(("rect", "rect", "tri", "L"))
    lo = 3 if shape == "L" else 2
    w, h = rng.randint(lo, GRID - 1), rng.randint(lo, GRID - 1)
    p = {"shape": shape, "x": rng.randint(0, GRID - w), "y": rng.randint(0, GRID - h), "w": w, "h": h}
    if shape == "rect":
        p["ask"] = rng.choice(("area", "perimeter"))
    elif shape == "tri":
        p["corner"] = rng.randrange(2)  # right angle bottom-left (0) or bottom-right (1)
    else:
        p["cw"], p["ch"] = rng.randint(1, w - 1), rng.randint(1, h - 1)
        p["corner"] = rng.randrange(4)  # which corner is cut away
    return p


def geometry_solution(p: dict[str, Any]) -> tuple[str, Solution]:
    """(question, worked solution) of a grid-geometry params dict."""
    w, h = p["w"], p["h"]
    sw, sh = num(w), num(h)
    reads = [Intermediate("width", sw), Intermediate("height", sh)]
    read_rubrics = [finds("the width", sw), finds("the height", sh)]
    if p["shape"] == "rect" and p["ask"] == "area":
        area = num(w * h)
        rubrics = read_rubrics + [rubric_steps("Multiplies width by height", [sw, sh, area])]
        rubrics += rubric_pitfalls(area, [("Computes the perimeter instead of the area", num(2 * (w + h))),
                                          ("Adds width and height", num(w + h))])
        return "What is the area of the rectangle?", Solution(
            area, f"width: {sw}. height: {sh}. {sw} x {sh} = {area}.",
            [alternatives(sw), alternatives(sh), expr_alternatives(sw, "x", sh)], reads, 1, rubrics)
    if p["shape"] == "rect":
        half, perimeter = num(w + h), num(2 * (w + h))
        rubrics = read_rubrics + [rubric_steps("Adds width and height, then doubles",
                                               [sw, sh, half, perimeter])]
        rubrics += rubric_pitfalls(perimeter, [("Computes the area instead of the perimeter", num(w * h)),
                                               ("Forgets to double width + height", half)])
        return "What is the perimeter of the rectangle?", Solution(
            perimeter, f"width: {sw}. height: {sh}. {sw} + {sh} = {half}. 2 x {half} = {perimeter}.",
            [alternatives(sw), alternatives(sh), expr_alternatives(sw, "+", sh),
             expr_alternatives("2", "x", half)],
            reads + [Intermediate("width + height", half)], 2, rubrics)
    if p["shape"] == "tri":
        prod, area = num(w * h), num(w * h / 2)
        rubrics = [finds("the base", sw), finds("the height", sh),
                   rubric_steps("Multiplies base by height, then halves", [sw, sh, prod, area])]
        rubrics += rubric_pitfalls(area, [("Forgets to halve base x height", prod)])
        return "What is the area of the triangle?", Solution(
            area, f"base: {sw}. height: {sh}. {sw} x {sh} = {prod}. {prod} / 2 = {area}.",
            [alternatives(sw), alternatives(sh), expr_alternatives(sw, "x", sh), [f"{prod} / 2", f"{prod}/2"]],
            [Intermediate("base", sw), Intermediate("height", sh), Intermediate("base x height", prod)],
            2, rubrics)
    scw, sch = num(p["cw"]), num(p["ch"])
    full, cut, area = num(w * h), num(p["cw"] * p["ch"]), num(w * h - p["cw"] * p["ch"])
    rubrics = read_rubrics + [rubric_steps("Subtracts the cut corner from the full rectangle",
                                           [full, cut, area])]
    rubrics += rubric_pitfalls(area, [("Gives the area of the full rectangle", full),
                                      ("Adds the cut corner instead of subtracting it",
                                       num(int(full) + int(cut)))])
    return "What is the area of the blue shape?", Solution(
        area, f"full rectangle: {sw} x {sh} = {full}. cut corner: {scw} x {sch} = {cut}. "
              f"{full} - {cut} = {area}.",
        [expr_alternatives(sw, "x", sh), alternatives(full), expr_alternatives(scw, "x", sch),
         alternatives(cut), expr_alternatives(full, "-", cut)],
        reads + [Intermediate("full rectangle", full), Intermediate("cut corner", cut)], 3, rubrics)


def describe_geometry(p: dict[str, Any]) -> str:
    first = "base" if p["shape"] == "tri" else "width"
    out = f"{first}: {p['w']}. height: {p['h']}."
    return out + (f" cut corner: {p['cw']} x {p['ch']}." if p["shape"] == "L" else "")


def annotate_geometry(p: dict[str, Any]) -> Annotation:
    question, sol = geometry_solution(p)
    # A triangle's halving and an L-shape's subtraction are a grade above counting squares.
    grade = "elementary school" if p["shape"] == "rect" else "high school"
    return finish(question, sol, context="geometry diagram",
                  skills=["geometry reasoning", "arithmetic reasoning"], grade=grade,
                  task="geometry problem solving", float_answer=p["shape"] == "tri")


def _geometry_polygon(p: dict[str, Any]) -> list[tuple[int, int]]:
    """Vertices of the shape in grid units (x right, y down)."""
    x, y, w, h = p["x"], p["y"], p["w"], p["h"]
    if p["shape"] == "rect":
        return [(x, y), (x + w, y), (x + w, y + h), (x, y + h)]
    if p["shape"] == "tri":
        if p["corner"] == 0:
            return [(x, y), (x + w, y + h), (x, y + h)]
        return [(x + w, y), (x + w, y + h), (x, y + h)]
    cw, ch, k = p["cw"], p["ch"], p["corner"]
    # Walk the rectangle clockwise, replacing corner k by a notch of size cw x ch.
    corners = [(x, y), (x + w, y), (x + w, y + h), (x, y + h)]
    out: list[tuple[int, int]] = []
    for i, (cx, cy) in enumerate(corners):
        if i != k:
            out.append((cx, cy))
            continue
        dx = cw if cx == x else -cw
        dy = ch if cy == y else -ch
        # Enter the notch along the edge we arrive on, leave along the next one.
        if i % 2 == 0:  # corners 0 and 2: arrive vertically, leave horizontally
            out += [(cx, cy + dy), (cx + dx, cy + dy), (cx + dx, cy)]
        else:  # corners 1 and 3: arrive horizontally, leave vertically
            out += [(cx + dx, cy), (cx + dx, cy + dy), (cx, cy + dy)]
    return out


def render_geometry(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    g0, cell = 0.06, 0.88 / GRID
    pts = [(g0 + gx * cell, g0 + gy * cell) for gx, gy in _geometry_polygon(p)]
    cv.polygon(pts, fill=_FILL)
    end = g0 + GRID * cell
    for k in range(GRID + 1):  # grid over the fill, so units inside the shape stay countable
        at, colour = g0 + k * cell, LIGHT_GREY if k % GRID else BLACK
        cv.line([(at, g0), (at, end)], colour, 0.008)
        cv.line([(g0, at), (end, at)], colour, 0.008)
    cv.line(pts + [pts[0]], COLOURS["blue"], 0.025)
    return cv.image


# ----------------------------------------------------------------------------- region sums


def sample_regions(rng: random.Random) -> dict[str, Any]:
    ask = rng.choice(("sum", "diff"))
    n_red = 2 if ask == "diff" else rng.choice((2, 3))
    colours = ["red"] * n_red + ["blue"] * (4 - n_red)
    rng.shuffle(colours)
    digits = [rng.randint(1, 9) for _ in range(4)]
    if ask == "diff":
        k = colours.index("red")
        if 2 * sum(d for d, c in zip(digits, colours) if c == "red") == sum(digits):
            digits[k] += 1 if digits[k] < 9 else -1  # break the tie: the answer must not be 0
        if 2 * sum(d for d, c in zip(digits, colours) if c == "red") < sum(digits):
            colours = ["blue" if c == "red" else "red" for c in colours]  # red total is the larger
    return {"digits": digits, "colours": colours, "ask": ask}


def annotate_regions(p: dict[str, Any]) -> Annotation:
    digits, colours = p["digits"], p["colours"]
    red = [num(d) for d, c in zip(digits, colours) if c == "red"]
    blue = [num(d) for d, c in zip(digits, colours) if c == "blue"]
    red_total, blue_total = num(sum(map(int, red))), num(sum(map(int, blue)))
    everything = num(sum(digits))
    if p["ask"] == "sum":
        sol = add_up([f"red box {k + 1}" for k in range(len(red))], red, label="red boxes",
                     mistakes=[("Adds the numbers in every box", everything),
                               ("Adds the blue boxes instead", blue_total)])
        return finish("What is the sum of the numbers in the red boxes?", sol, context="abstract scene",
                      skills=["arithmetic reasoning"], grade="elementary school",
                      task="figure question answering")
    answer = num(int(red_total) - int(blue_total))
    rubrics = [finds("the red total", red_total), finds("the blue total", blue_total),
               rubric_steps("Subtracts the blue total from the red total", [red_total, blue_total, answer])]
    rubrics += rubric_pitfalls(answer, [("Adds all four numbers", everything),
                                        ("Gives the red total without subtracting", red_total)])
    sol = Solution(
        answer, f"red: {red[0]} + {red[1]} = {red_total}. blue: {blue[0]} + {blue[1]} = {blue_total}. "
                f"{red_total} - {blue_total} = {answer}.",
        [expr_alternatives(red[0], "+", red[1]), alternatives(red_total),
         expr_alternatives(blue[0], "+", blue[1]), alternatives(blue_total),
         expr_alternatives(red_total, "-", blue_total)],
        [Intermediate("red total", red_total), Intermediate("blue total", blue_total)], 3, rubrics)
    return finish("What is the red total minus the blue total?", sol, context="abstract scene",
                  skills=["arithmetic reasoning"], grade="high school", task="figure question answering")


def describe_regions(p: dict[str, Any]) -> str:
    by = {c: [str(d) for d, cc in zip(p["digits"], p["colours"]) if cc == c] for c in ("red", "blue")}
    return " ".join(f"{c} boxes: {', '.join(v)}." for c, v in by.items() if v)


def render_regions(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)
    for k, (d, c) in enumerate(zip(p["digits"], p["colours"])):
        x0, y0 = 0.05 + (k % 2) * 0.46, 0.05 + (k // 2) * 0.46
        cv.box(x0, y0, x0 + 0.44, y0 + 0.44, outline=COLOURS[c], width=0.05)
        # the digit in its box's colour: colour and number in one visual token
        cv.number(str(d), x0 + 0.22, y0 + 0.22, 0.22, fill=COLOURS[c])
    return cv.image


# ----------------------------------------------------------------------------- metro map

LATTICE = 5  # stations sit on a LATTICE x LATTICE lattice
_LINE_COLOURS = ("green", "orange", "purple")


def _span(rng: random.Random, n: int, must: list[int]) -> list[int]:
    """A run of >= 3 consecutive lattice indices containing every index in ``must``."""
    while True:
        a = rng.randint(0, min(must))
        b = rng.randint(max(must), n - 1)
        if b - a >= 2:
            return list(range(a, b + 1))


def sample_metro(rng: random.Random) -> dict[str, Any]:
    legs = rng.choice((2, 3))
    c = rng.randrange(LATTICE)  # column of the vertical line
    rows = rng.sample(range(LATTICE), legs - 1)  # rows of the horizontal line(s)
    horiz = [[[x, r] for x in _span(rng, LATTICE, [c])] for r in rows]
    vert = [[c, y] for y in _span(rng, LATTICE, rows)]
    lines = [horiz[0], vert] + horiz[1:]  # route order: start line, vertical, (end line)
    # Start on the first line, end on the last, neither at a transfer station.
    start = rng.choice([s for s in lines[0] if s != [c, rows[0]]])
    last_transfer = [c, rows[-1]] if legs == 3 else [c, rows[0]]
    end = rng.choice([s for s in lines[-1] if s != last_transfer])
    if rng.random() < 0.5:  # transpose, so the first line is vertical half the time
        lines = [[[y, x] for x, y in line] for line in lines]
        start, end = [start[1], start[0]], [end[1], end[0]]
    colours = rng.sample(_LINE_COLOURS, legs)
    return {"lines": [{"colour": col, "stations": st} for col, st in zip(colours, lines)],
            "start": start, "end": end}


def metro_legs(p: dict[str, Any]) -> list[int]:
    """Stops ridden on each line of the route (lines cross only at the transfers)."""
    lines = [ln["stations"] for ln in p["lines"]]
    stops, here = [], p["start"]
    for k, line in enumerate(lines):
        exit_ = p["end"] if k == len(lines) - 1 else next(s for s in line if s in lines[k + 1])
        stops.append(abs(line.index(here) - line.index(exit_)))
        here = exit_
    return stops


def annotate_metro(p: dict[str, Any]) -> Annotation:
    names = [f"{ln['colour']} line" for ln in p["lines"]]
    stops = metro_legs(p)
    answer = sum(stops)
    sol = add_up(names, [num(s) for s in stops],
                 mistakes=[("Counts stations instead of stops", num(answer + 1)),
                           (f"Leaves out the {names[-1]}", num(answer - stops[-1]))])
    return finish("How many stops is it from the red station to the blue station?", sol,
                  context="abstract scene", skills=["arithmetic reasoning", "logical reasoning"],
                  grade="high school", task="figure question answering")


def describe_metro(p: dict[str, Any]) -> str:
    return " ".join(f"{ln['colour']} line: {n}." for ln, n in zip(p["lines"], metro_legs(p)))


def render_metro(p: dict[str, Any], size: int) -> Image.Image:
    cv = Canvas(size)

    def at(s: list[int]) -> tuple[float, float]:
        return 0.1 + 0.2 * s[0], 0.1 + 0.2 * s[1]

    for ln in p["lines"]:
        cv.line([at(s) for s in ln["stations"]], COLOURS[ln["colour"]], 0.04)
    for ln in p["lines"]:
        for s in ln["stations"]:
            cv.disc(*at(s), 0.04, fill=WHITE, outline=BLACK, width=0.014)
    cv.disc(*at(p["start"]), 0.06, fill=COLOURS["red"])
    cv.disc(*at(p["end"]), 0.06, fill=COLOURS["blue"])
    return cv.image


FAMILIES = (
    Family("grid_geometry", 3, sample_geometry, annotate_geometry, render_geometry, describe_geometry),
    Family("region_sums", 3, sample_regions, annotate_regions, render_regions, describe_regions),
    Family("metro_map", 3, sample_metro, annotate_metro, render_metro, describe_metro),
)
