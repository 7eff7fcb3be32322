"""What every synthetic family shares: the Family recipe and the supervision builders.

A family is three pure functions:

    sample(rng)            -> params      a small JSON-able dict in size-independent units
                                          (lattice cells, grid squares, values) that
                                          fixes the picture AND the question, and holds
                                          nothing else (no unused choices)
    annotate(params)       -> Annotation  question, gold answer and all the reward
                                          supervision (reasoning, key steps, rubrics)
    render(params, size)   -> PIL image

Because the question and the image are functions of ``params`` alone, the canonical
string of (family, params) is the example's *content key*: two examples with the same
key are the same example. data/synthetic.py hashes that key into a split bucket, which
is what makes train/val/test disjoint by construction.

The worked reasoning texts are short fixed templates ("red circles: 3. blue squares: 2.
3 + 2 = 5."): the embedded 2M-parameter model must learn to produce them in minutes, and
R1-VL's StepRAR / RewardMap's detail reward then look for exactly these numbers in a
policy's reasoning. Conventions every family follows (tests check them):

    key_steps      one group per intermediate result, in the order the reasoning states
                   them; a group lists accepted spellings ("3", "three"; "3 + 2", "2+3")
    hops           arithmetic operations in the worked solution, at least 1 (a plain read
                   is 1); RewardMap's multi-hop bonus applies when hops > 1
    rubrics        VF reads (ESSENTIAL/IMPORTANT), an RC "steps in order" item, an IF item
                   for the final number, and PITFALLs whose evidence is the *answer* a
                   typical mistake gives (every multi-step example has at least one)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from PIL import Image

from data.contract import normalize_number
from data.schema import Intermediate, RubricItem

_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
          "fourteen fifteen sixteen seventeen eighteen nineteen twenty").split()

# V-Rubrics item weights (the paper's rubric rows use integer weights ~1..5).
W_ESSENTIAL, W_IMPORTANT, W_OPTIONAL, W_PITFALL = 5.0, 3.0, 1.0, -4.0


class Solution(NamedTuple):
    """A worked solution and what the step, detail and rubric rewards check in it."""

    answer: str  # canonical (normalize_number) string
    reasoning: str
    key_steps: list[list[str]]
    intermediates: list[Intermediate]
    hops: int  # arithmetic operations, >= 1
    rubrics: list[RubricItem]


@dataclass
class Annotation:
    """Everything about an example that follows from its params (no pixels, no identity)."""

    question: str
    solution: Solution
    answer_type: str  # "integer" | "float"
    precision: int | None
    context: str  # MathVista vocabulary: "synthetic scene", "bar chart", ...
    skills: list[str]
    grade: str  # "elementary school" | "high school" | "college"
    task: str  # MathVista task: "figure question answering", "geometry problem solving", ...
    unit: str | None = None  # e.g. "mL"; MathVista's `unit` field


def finish(question: str, sol: Solution, *, context: str, skills: list[str], grade: str,
           task: str, float_answer: bool = False, unit: str | None = None) -> Annotation:
    """Assemble an Annotation; adds the instruction-following rubric for the final number."""
    sol = sol._replace(rubrics=sol.rubrics + [rubric_answer(sol.answer)])
    return Annotation(question, sol, "float" if float_answer else "integer",
                      1 if float_answer else None, context, skills, grade, task, unit)


@dataclass(frozen=True)
class Family:
    name: str  # unique, part of the content key
    stage: int
    sample: Callable[[random.Random], dict[str, Any]]
    annotate: Callable[[dict[str, Any]], Annotation]
    render: Callable[[dict[str, Any], int], Image.Image]
    # Everything the picture shows that a question of this family can ask about, in the
    # worked reasoning's own "name: value." grammar ("red circles: 3. blue squares: 2.").
    # The perception stage of the warm-up trains on it (grpo/warmup/sft.py): every number in it
    # is read off the image, where a worked solution reads one or two.
    describe: Callable[[dict[str, Any]], str] | None = None


# ----------------------------------------------------------------------------- numbers


def num(v: float | int) -> str:
    """Canonical string of a number, as the contract normalises answers."""
    s = normalize_number(repr(float(v)) if not isinstance(v, int) else str(v))
    if s is None:
        raise ValueError(f"not a finite number: {v!r}")
    return s


def alternatives(value: str) -> list[str]:
    """Accepted spellings of an intermediate value for StepRAR: '3' -> ['3', 'three']."""
    alts = [value]
    if value.isdigit() and int(value) < len(_WORDS):
        alts.append(_WORDS[int(value)])
    return alts


def expr_alternatives(a: str, op: str, b: str) -> list[str]:
    """Spellings of one binary step, '3 + 2' and its spacing / commuted forms."""
    forms = [f"{a} {op} {b}", f"{a}{op}{b}"]
    if op in ("+", "x"):
        forms += [f"{b} {op} {a}", f"{b}{op}{a}"]
    if op == "x":
        forms += [f.replace("x", "*") for f in forms]
    return list(dict.fromkeys(forms))  # dedupe, keep order (a == b gives repeats)


# ----------------------------------------------------------------------------- rubrics


def rubric_read(text: str, value: str, weight: float = W_ESSENTIAL) -> RubricItem:
    """Visual fidelity: the reasoning states a value read off the image."""
    label = "ESSENTIAL" if weight >= W_ESSENTIAL else "IMPORTANT"
    return RubricItem(text, "VF", label, weight, {"kind": "number", "value": value})


def rubric_steps(text: str, values: list[str]) -> RubricItem:
    """Reasoning correctness: the computation's numbers appear in order."""
    return RubricItem(text, "RC", "IMPORTANT", W_IMPORTANT, {"kind": "ordered", "values": values})


def rubric_answer(answer: str) -> RubricItem:
    """Instruction following: the SOLUTION block holds just the gold number."""
    return RubricItem(f"Gives {answer} as the final number", "IF", "OPTIONAL", W_OPTIONAL,
                      {"kind": "answer", "value": answer})


def rubric_pitfalls(answer: str, mistakes: list[tuple[str, str]]) -> list[RubricItem]:
    """PITFALL items: the answer a typical mistake produces (dropped if it equals the gold).

    Evidence is the *answer* (not a number in the reasoning), because a mistaken value
    can also be a legitimate intermediate (3 + 4 = 7, while reading "7" off a bar is fine).
    """
    items, seen = [], {answer}
    for text, wrong in mistakes:
        if wrong in seen:
            continue
        seen.add(wrong)
        items.append(RubricItem(text, "RC", "PITFALL", W_PITFALL, {"kind": "answer", "value": wrong}))
    return items


# ----------------------------------------------------------------------------- solution templates
# The few shapes of worked solution every family reuses; family files add their own only
# where the arithmetic is specific (areas, region totals).

Mistakes = Sequence[tuple[str, str]]  # (what the mistake is, the answer it gives)


def finds(name: str, value: str, weight: float = W_IMPORTANT) -> RubricItem:
    return rubric_read(f"Finds {name} = {value}", value, weight)


def read_one(name: str, value: str, mistakes: Mistakes = ()) -> Solution:
    """A single read: 'red circles: 3.'"""
    return Solution(value, f"{name}: {value}.", [alternatives(value)], [Intermediate(name, value)], 1,
                    [finds(name, value, W_ESSENTIAL)] + rubric_pitfalls(value, mistakes))


def add_up(names: list[str], values: list[str], label: str | None = None,
           mistakes: Mistakes = ()) -> Solution:
    """Read each value, then add them.

    >>> add_up(["red circles", "blue squares"], ["3", "2"]).reasoning
    'red circles: 3. blue squares: 2. 3 + 2 = 5.'
    >>> add_up(["row 1, column 1", "row 1, column 2"], ["4", "5"], label="row 1").reasoning
    'row 1: 4, 5. 4 + 5 = 9.'
    """
    total = num(sum(int(v) for v in values))
    expr = " + ".join(values)
    if label is None:
        reads = " ".join(f"{n}: {v}." for n, v in zip(names, values))
    else:
        reads = f"{label}: {', '.join(values)}."
    if len(values) == 2:
        expr_alts = expr_alternatives(values[0], "+", values[1])
    else:
        expr_alts = [expr, expr.replace(" ", "")]
    rubrics = [finds(n, v) for n, v in zip(names, values)]
    rubrics.append(rubric_steps("Adds the values in order", values + [total]))
    return Solution(total, f"{reads} {expr} = {total}.", [alternatives(v) for v in values] + [expr_alts],
                    [Intermediate(n, v) for n, v in zip(names, values)], len(values) - 1,
                    rubrics + rubric_pitfalls(total, mistakes))


def difference(na: str, a: int, nb: str, b: int) -> Solution:
    """a - b with a > b: 'red bar: 7. blue bar: 3. 7 - 3 = 4.'"""
    sa, sb, d = num(a), num(b), num(a - b)
    rubrics = [finds(na, sa), finds(nb, sb),
               rubric_steps("Subtracts the smaller value from the larger", [sa, sb, d])]
    rubrics += rubric_pitfalls(d, [(f"Adds instead of subtracting ({sa} + {sb})", num(a + b)),
                                   (f"Gives {na} ({sa}) instead of the difference", sa)])
    return Solution(d, f"{na}: {sa}. {nb}: {sb}. {sa} - {sb} = {d}.",
                    [alternatives(sa), alternatives(sb), expr_alternatives(sa, "-", sb)],
                    [Intermediate(na, sa), Intermediate(nb, sb)], 1, rubrics)


def mean_of_two(na: str, a: int, nb: str, b: int) -> Solution:
    """(a + b) / 2, written as two equations so the sum is a checkable intermediate."""
    sa, sb, s, m = num(a), num(b), num(a + b), num((a + b) / 2)
    rubrics = [finds(na, sa), finds(nb, sb),
               rubric_steps("Adds the two values, then divides by 2", [sa, sb, s, m])]
    rubrics += rubric_pitfalls(m, [(f"Forgets to divide the sum {s} by 2", s)])
    return Solution(m, f"{na}: {sa}. {nb}: {sb}. {sa} + {sb} = {s}. {s} / 2 = {m}.",
                    [alternatives(sa), alternatives(sb), expr_alternatives(sa, "+", sb),
                     [f"{s} / 2", f"{s}/2"]],
                    [Intermediate(na, sa), Intermediate(nb, sb), Intermediate("sum", s)], 2, rubrics)
