"""MathVista loading from a fixture in the hub's parquet layout (written here with pyarrow)."""

import io
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data.mathvista import (
    eval_overall_numeric,
    load_mathvista,
    require_gold_answers,
    stage_subsets,
)


def png(color=(200, 30, 30), size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def meta(context, skills, language="english", grade="elementary school"):
    return {"split": "testmini", "language": language, "img_width": 40, "img_height": 30, "source": "fixture",
            "category": "math-targeted-vqa", "task": "figure question answering", "context": context,
            "grade": grade, "skills": skills}


# pid -> row overrides; every row is otherwise a valid free-form English integer question.
ROWS = {
    "1": dict(answer="3", metadata=meta("Synthetic Scene", ["Arithmetic Reasoning"])),      # stage 1 (case!)
    "2": dict(answer="2.5", answer_type="float", precision=1.0,
              metadata=meta("bar chart", ["statistical reasoning"])),                        # stage 2, chart
    "3": dict(answer="7", metadata=meta("line plot", ["algebraic reasoning"], grade="college")),  # stage 2+3
    "4": dict(answer="12", metadata=meta("table", ["arithmetic reasoning"])),               # stage 1+2
    "5": dict(answer="B", question_type="multi_choice", answer_type="text", choices=["A", "B"],
              metadata=meta("geometry diagram", ["geometry reasoning"])),                    # kept, not numeric
    "6": dict(answer="4", metadata=meta("natural image", ["numeric commonsense"], language="persian")),  # kept, not english
    "7": dict(answer="five", metadata=meta("table", ["arithmetic reasoning"])),             # skip: non-numeric
    "8": dict(answer_type="fraction", metadata=meta("table", ["arithmetic reasoning"])),    # skip: answer type
    "9": dict(metadata=meta("table", ["arithmetic reasoning"], language="klingon")),        # skip: language
    "10": dict(decoded_image={"bytes": b"\x89PNG not really", "path": "10.png"}),           # skip: corrupt
    "11": dict(decoded_image={"bytes": None, "path": None}, image="images/11.png"),         # skip: missing
    "12": dict(decoded_image=None, image="images/12.png"),                                  # file next to data
    "13": dict(answer="", metadata=meta("table", ["arithmetic reasoning"])),                # no gold (test split)
}


def make_row(pid, **over):
    row = {"pid": pid, "question": f"How many things are in picture {pid}?", "image": f"images/{pid}.png",
           "decoded_image": {"bytes": png(), "path": f"{pid}.png"}, "choices": None, "unit": None,
           "precision": None, "answer": "1", "question_type": "free_form", "answer_type": "integer",
           "metadata": meta("synthetic scene", ["arithmetic reasoning"]), "query": f"Hint: integer. Q{pid}"}
    row.update(over)
    return row


SCHEMA = pa.schema([
    ("pid", pa.string()), ("question", pa.string()), ("image", pa.string()),
    ("decoded_image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    ("choices", pa.list_(pa.string())), ("unit", pa.string()), ("precision", pa.float64()),
    ("answer", pa.string()), ("question_type", pa.string()), ("answer_type", pa.string()),
    ("metadata", pa.struct([("split", pa.string()), ("language", pa.string()), ("img_width", pa.int64()),
                            ("img_height", pa.int64()), ("source", pa.string()), ("category", pa.string()),
                            ("task", pa.string()), ("context", pa.string()), ("grade", pa.string()),
                            ("skills", pa.list_(pa.string()))])),
    ("query", pa.string()),
])


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("mathvista")
    (root / "data").mkdir()
    (root / "images").mkdir()
    Image.new("RGB", (20, 10), (0, 0, 255)).save(root / "images" / "12.png")
    rows = [make_row(pid, **over) for pid, over in ROWS.items()]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), root / "data" / "testmini-00000-of-00001-abc.parquet")
    return root


@pytest.fixture(scope="module")
def loaded(hub_dir):
    return load_mathvista(hub_dir, "testmini")


def test_loading_counts_and_skips(loaded):
    examples, skipped = loaded
    assert sorted(ex.pid for ex in examples) == sorted(["1", "2", "3", "4", "5", "6", "12", "13"], key=str)
    assert skipped == {"non_numeric_answer": 1, "unknown_answer_type": 1, "unknown_language": 1,
                       "corrupt_image": 1, "missing_image": 1}


def test_fields_images_and_enrichment(loaded):
    ex = {e.pid: e for e in loaded[0]}
    assert ex["2"].precision == 1 and ex["2"].answer_type == "float" and ex["1"].precision is None
    assert ex["1"].image.size == (40, 30) and ex["1"].image.getpixel((0, 0)) == (200, 30, 30)
    assert ex["12"].image.size == (20, 10)  # read from images/12.png next to the data
    assert ex["5"].choices == ["A", "B"] and ex["1"].choices is None
    assert ex["1"].metadata["context"] == "synthetic scene"  # lower-cased vocabulary
    assert ex["1"].metadata["skills"] == ["arithmetic reasoning"]
    assert ex["2"].metadata["context_family"] == "chart" and ex["3"].metadata["context_family"] == "plot"
    assert ex["5"].metadata["answer_mode"] == "multi_choice" and ex["1"].metadata["answer_mode"] == "numeric_free_form"
    assert ex["1"].metadata["query"] == "Hint: integer. Q1" and ex["1"].image_path == "images/1.png"


def test_eval_overall_numeric_selection(loaded):
    sel = eval_overall_numeric(loaded[0])
    # not the multi-choice row, not the Persian one, not the row without a gold answer
    assert sorted(e.pid for e in sel) == ["1", "12", "2", "3", "4"]


def test_stage_filter_membership(loaded):
    stages = stage_subsets(loaded[0])
    ids = {s: sorted(e.pid for e in v) for s, v in stages.items()}
    assert ids[1] == ["1", "12", "4"]  # synthetic scene / table, integer, arithmetic skills
    assert ids[2] == ["2", "3", "4"]  # chart, plot, table
    assert ids[3] == ["3"]  # line plot with algebraic reasoning
    numeric = {e.pid for e in eval_overall_numeric(loaded[0])}
    assert all(e.pid in numeric for v in stages.values() for e in v)  # stages are inside the headline subset


def test_where_filter_skips_images_of_unwanted_rows(hub_dir):
    examples, skipped = load_mathvista(hub_dir, "testmini", where=lambda e: e.pid in {"1", "10"}, limit=5)
    assert [e.pid for e in examples] == ["1"]
    # row-level problems are counted for every row, image problems only for selected rows
    assert skipped == {"corrupt_image": 1, "non_numeric_answer": 1, "unknown_answer_type": 1, "unknown_language": 1}
    assert "missing_image" not in skipped  # row 11 was not selected
    assert len(load_mathvista(hub_dir, "testmini", limit=2)[0]) == 2


def test_require_gold_answers_refuses_the_test_split(loaded):
    require_gold_answers(eval_overall_numeric(loaded[0]), "testmini numeric")  # fine
    with pytest.raises(ValueError, match=r"1 of 8 examples have an empty gold answer \(pids 13\).*MathVista's `test`"):
        require_gold_answers(loaded[0], "mathvista test")
    with pytest.raises(ValueError, match=r"not a number \(pids 5;"):
        require_gold_answers(loaded[0], "mathvista test")
    with pytest.raises(ValueError, match="empty"):
        require_gold_answers([], "nothing")


def test_json_release_layout(tmp_path):
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "1.png")
    raw = {"1": {"question": "q", "image": "images/1.png", "answer": "2", "question_type": "free_form",
                 "answer_type": "integer", "precision": None, "metadata": meta("table", ["arithmetic reasoning"])},
           "2": {"question": "q", "image": "images/2.png", "answer": "2", "question_type": "free_form",
                 "answer_type": "integer", "metadata": meta("table", ["arithmetic reasoning"])}}
    (tmp_path / "annot_testmini.json").write_text(json.dumps(raw))
    examples, skipped = load_mathvista(tmp_path, "testmini")
    assert [e.pid for e in examples] == ["1"] and skipped == {"missing_image": 1}


def test_bad_sources_raise_one_clear_error(tmp_path, hub_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mathvista(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no MathVista split 'test'"):
        load_mathvista(hub_dir, "test")


def test_hub_source_without_datasets_says_what_to_install(monkeypatch):
    pytest.importorskip("pyarrow")
    # a None entry makes `import datasets` raise ImportError, installed or not (the test suite
    # installs it for the datasets-directory format), and the hub path never reaches the network
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="optional `datasets` package"):
        load_mathvista("hub:AI4Math/MathVista", "testmini")
