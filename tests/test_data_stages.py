"""Stage filters (on synthetic and MathVista-like rows) and seeded, resumable phase mixtures."""

from __future__ import annotations

from collections import Counter

import pytest

from data.mixture import BLOCK, PHASES, MixtureStream, phase_stream
from data.schema import Example
from data.stages import in_stage, select_stage, stage_filter
from data.synthetic import families, generate

STAGES = (1, 2, 3)


def row(pid="1", answer="3", answer_type="integer", context="bar chart", skills=("statistical reasoning",),
        grade="high school", language="english", question_type="free_form") -> Example:
    """A MathVista-shaped row (metadata as the hub stores it), no image needed for filtering."""
    meta = {"context": context, "grade": grade, "language": language, "source": "MathVista-like",
            "skills": skills if isinstance(skills, str) else list(skills)}
    return Example(pid=pid, question="q", answer=answer, answer_type=answer_type,
                   question_type=question_type, metadata=meta)


# ----------------------------------------------------------------------------- stage filters


@pytest.fixture(scope="module")
def generated() -> dict[int, list[Example]]:
    return {s: generate("train", s, 8 * len(families(s)), seed=0) for s in STAGES}


def test_each_generated_stage_passes_its_own_filter(generated):
    for s in STAGES:
        assert select_stage(generated[s], s) and all(stage_filter(s)(ex) for ex in generated[s])


def test_each_family_is_selected_by_the_right_filters(generated):
    # Which other stages a family also matches follows from its metadata (stages overlap).
    expected = {
        "scene_count": {1}, "table_read": {1, 2},
        "bar_chart": {2}, "line_plot": {2, 3}, "table_stats": {1, 2}, "cylinders": {2, 3},
        "grid_geometry": {3}, "region_sums": {3}, "metro_map": {3},
    }
    seen: dict[str, set[int]] = {}
    for examples in generated.values():
        for ex in examples:
            fam = ex.metadata["family"]
            stages = {s for s in STAGES if in_stage(ex, s)}
            if fam == "table_stats" and ex.answer_type == "float":
                stages |= {1}  # the float rows of this family fail stage 1; integer rows pass it
            seen.setdefault(fam, set()).update(stages)
            assert ex.metadata["stage"] in stages
    assert seen == expected


def test_mathvista_rows():
    assert [in_stage(row(context="bar chart"), s) for s in STAGES] == [False, True, False]
    assert [in_stage(row(context="function plot", skills=["algebraic reasoning"]), s)
            for s in STAGES] == [False, True, True]
    nat = row(context="natural image", skills=["numeric commonsense"], grade="daily life")
    assert [in_stage(nat, s) for s in STAGES] == [True, True, False]
    geo = row(context="geometry diagram", skills=["geometry reasoning"], answer="2.5", answer_type="float")
    assert [in_stage(geo, s) for s in STAGES] == [False, False, True]
    # stage 1 needs integer answers and one of its skills
    assert not in_stage(row(context="table", answer="2.5", answer_type="float"), 1)
    assert not in_stage(row(context="table", skills=["logical reasoning"]), 1)
    assert in_stage(row(context="Table", skills="statistical reasoning"), 1)  # case, lone skill
    # the shared filter: free_form, english, numeric answer that parses
    for bad in (row(question_type="multi_choice"), row(language="chinese"), row(answer_type="text"),
                row(answer="three"), row(answer="")):
        assert not any(in_stage(bad, s) for s in STAGES)


def test_stage3_sorted_harder_grades_first_and_stable():
    rows = [row(pid=str(i), context="scientific figure", skills=["scientific reasoning"], grade=g)
            for i, g in enumerate(["elementary school", "college", "daily life", "high school",
                                   "college", "mystery", "elementary school"])]
    rows.append(row(pid="x", context="bar chart"))  # not stage 3
    out = select_stage(rows, 3)
    assert [r.pid for r in out] == ["1", "4", "3", "0", "6", "2", "5"]
    assert [r.pid for r in select_stage(rows, 2)] == [str(i) for i in range(7)] + ["x"]


def test_bad_stage():
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        stage_filter(0)


# ----------------------------------------------------------------------------- mixtures


def pool(stage: int, n: int) -> list[Example]:
    return [Example(pid=f"s{stage}-{i}", question="q", answer="1", metadata={"stage": stage})
            for i in range(n)]


SOURCES = {1: pool(1, 7), 2: pool(2, 11), 3: pool(3, 5)}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_phase_proportions(phase):
    draws = phase_stream(phase, SOURCES, seed=0).next_batch(20000)
    share = Counter(ex.metadata["stage"] for ex in draws)
    assert set(share) == set(PHASES[phase])
    for stage, w in PHASES[phase].items():
        assert abs(share[stage] / 20000 - w) < 0.02  # ~6 standard errors at n=20000


def test_each_source_cycles_through_seeded_permutations():
    stream = MixtureStream({1: SOURCES[1]}, {1: 1.0}, seed=4)
    epochs = [stream.next_batch(7) for _ in range(3)]
    assert all(sorted(e.pid for e in ep) == sorted(e.pid for e in SOURCES[1]) for ep in epochs)
    assert len({tuple(e.pid for e in ep) for ep in epochs}) > 1  # reshuffled per epoch
    other = MixtureStream({1: SOURCES[1]}, {1: 1.0}, seed=5).next_batch(21)
    assert [e.pid for e in other] != [e.pid for ep in epochs for e in ep]


@pytest.mark.parametrize("k", [0, 1, 123, BLOCK - 3, 2 * BLOCK + 17])
def test_resume_at_any_position(k):
    ref = phase_stream("C", SOURCES, seed=9).next_batch(k + 40)
    s = phase_stream("C", SOURCES, seed=9)
    assert s.take(k, 40) == ref[k:] and s.position == 0  # take leaves the stream alone
    s.load_state_dict({"position": k})  # recount from the position alone
    assert s.next_batch(40) == ref[k:]
    run = phase_stream("C", SOURCES, seed=9)
    run.next_batch(k)
    state = run.state_dict()  # with counts: O(1) restore
    resumed = phase_stream("C", SOURCES, seed=9)
    resumed.load_state_dict(state)
    assert resumed.next_batch(40) == ref[k:] == run.next_batch(40)


def test_mixture_errors():
    with pytest.raises(ValueError, match="no examples"):
        MixtureStream({1: SOURCES[1]}, {1: 0.7, 2: 0.3})
    with pytest.raises(ValueError, match=">= 0"):
        MixtureStream(SOURCES, {1: -1.0})
    with pytest.raises(ValueError, match="empty"):
        MixtureStream(SOURCES, {})
    with pytest.raises(ValueError, match="phase"):
        phase_stream("D", SOURCES)
    s = phase_stream("B", SOURCES, seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({"position": 3, "seed": 2})
    with pytest.raises(ValueError, match="counts"):
        s.load_state_dict({"position": 3, "counts": {"1": 1, "2": 1}})
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict({"position": -1})
