"""Curriculum stage filters (the staged-GRPO paper's three stages, docs/design.md, section 3).

A stage is a predicate on an Example's MathVista metadata, so the same filter selects from
the synthetic curriculum and from MathVista rows alike:

    all stages   question_type free_form, language english, answer_type integer/float
                 and the gold answer parses as a number (data.contract.normalize_number)
    stage 1      integer;          context family in {synthetic scene, table, natural image};
                 skills meet {arithmetic, statistical reasoning, numeric commonsense}
    stage 2      integer or float; context family in {table, chart, plot,
                 scientific figure, natural image}
    stage 3      integer or float; context family in {geometry diagram, plot,
                 scientific figure, abstract scene}; skills meet {geometry, algebraic,
                 scientific, arithmetic, statistical reasoning}; harder grades first
    "all"        a pseudo-stage: every row the shared filter keeps, whatever its context
                 and skills. Data without MathVista metadata (no row states a context or
                 skills: ``has_stage_metadata``) has nothing for stages 1-3 to select on,
                 so it trains on "all" (grpo/run/phase_data.py)

The context family is ``Example.context_family`` ("bar chart" -> "chart", "line plot" ->
"plot"). Stages overlap on purpose: a table with an integer answer passes stages 1 and 2,
a line plot passes stages 2 and 3; a phase mixture draws each stage from its own source
(data/mixture.py), so overlap only matters when one pool is filtered into stages.

Simplification: the paper's code also capped stage sizes and shuffled; here selection is
a pure filter (plus the stage-3 grade ordering) and the mixture does the sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from data.contract import normalize_number
from data.schema import Example

# Harder grades first; anything unknown sorts last (MathVista uses "not applicable" too).
GRADE_ORDER = ("college", "high school", "elementary school", "daily life", "not applicable")


@dataclass(frozen=True)
class StageSpec:
    answer_types: frozenset[str]
    contexts: frozenset[str]  # context families (Example.context_family)
    skills: frozenset[str] | None  # None: any skills


ALL = "all"
STAGES: dict[int, StageSpec] = {
    1: StageSpec(frozenset({"integer"}),
                 frozenset({"synthetic scene", "table", "natural image"}),
                 frozenset({"arithmetic reasoning", "statistical reasoning", "numeric commonsense"})),
    2: StageSpec(frozenset({"integer", "float"}),
                 frozenset({"table", "chart", "plot", "scientific figure", "natural image"}),
                 None),
    3: StageSpec(frozenset({"integer", "float"}),
                 frozenset({"geometry diagram", "plot", "scientific figure", "abstract scene"}),
                 frozenset({"geometry reasoning", "algebraic reasoning", "scientific reasoning",
                            "arithmetic reasoning", "statistical reasoning"})),
}


def _skills(ex: Example) -> set[str]:
    raw = ex.metadata.get("skills") or []
    if isinstance(raw, str):  # tolerate a single skill stored as a string
        raw = [raw]
    return {str(s).strip().lower() for s in raw}


def is_numeric_free_form(ex: Example) -> bool:
    """The filter shared by all stages: free-form, English, numeric gold answer.

    A row without a language counts as English, as in data/mathvista.py's
    ``is_overall_numeric`` (every MathVista row states one).
    """
    return (ex.question_type == "free_form"
            and str(ex.metadata.get("language", "english")).strip().lower() == "english"
            and ex.answer_type in ("integer", "float")
            and normalize_number(ex.answer) is not None)


def has_stage_metadata(examples: Iterable[Example]) -> bool:
    """Whether any row states a context or skills, the metadata stages 1-3 select on."""
    return any(ex.metadata.get("context") or _skills(ex) for ex in examples)


def in_stage(ex: Example, stage: int | str) -> bool:
    if stage == ALL:
        return is_numeric_free_form(ex)
    spec = _spec(stage)
    return (is_numeric_free_form(ex)
            and ex.answer_type in spec.answer_types
            and ex.context_family in spec.contexts
            and (spec.skills is None or bool(_skills(ex) & spec.skills)))


def stage_filter(stage: int | str) -> Callable[[Example], bool]:
    """Predicate selecting the examples of a curriculum stage (1, 2, 3 or "all")."""
    _spec(stage)  # fail here, not on the first example
    return lambda ex: in_stage(ex, stage)


def grade_rank(ex: Example) -> int:
    """0 for the hardest grade (college); unknown grades after every known one."""
    grade = str(ex.metadata.get("grade", "")).strip().lower()
    return GRADE_ORDER.index(grade) if grade in GRADE_ORDER else len(GRADE_ORDER)


def select_stage(examples: Iterable[Example], stage: int | str) -> list[Example]:
    """The examples in ``stage``, in input order; stage 3 stably sorted harder grades first."""
    keep = stage_filter(stage)
    out = [ex for ex in examples if keep(ex)]
    if stage == 3:
        out.sort(key=grade_rank)  # list.sort is stable: equal grades keep input order
    return out


def _spec(stage: int | str) -> StageSpec | None:
    if stage == ALL:
        return None
    if stage not in STAGES:
        raise ValueError(f"stage must be 1, 2 or 3 (or {ALL!r}: every usable row), got {stage!r}")
    return STAGES[stage]
