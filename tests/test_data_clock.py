"""data/clock.py: the one-handed clock set (a figure family the shipped base never saw) is the
own-data format, deterministic from its seed, its gold hours are what the pixels show, and
bad input is one line."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from data.clock import HOURS, QUESTION, main, render, rows
from data.sources import load_source

ROOT = Path(__file__).resolve().parent.parent


def _tip_colour(image: Image.Image, p: dict, hour: int) -> tuple:
    """The pixel halfway along where a hand pointing at ``hour`` would lie."""
    a = 2 * math.pi * hour / 12
    d = 0.5 * p["hand"] * p["r"]
    x, y = p["cx"] + d * math.sin(a), p["cy"] - d * math.cos(a)
    return image.getpixel((int(round(x * image.width)), int(round(y * image.height))))


def test_the_set_loads_as_own_data_and_is_deterministic(tmp_path):
    assert main(["--out", str(tmp_path / "a"), "--n", "24", "--seed", "3"]) == 0
    assert main(["--out", str(tmp_path / "b"), "--n", "24", "--seed", "3"]) == 0
    examples, skipped = load_source(tmp_path / "a")
    assert skipped == {} and len(examples) == 24
    assert {ex.question for ex in examples} == {QUESTION}
    assert all(ex.answer_type == "integer" and int(ex.answer) in HOURS for ex in examples)
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "data.jsonl").read_bytes() == (b / "data.jsonl").read_bytes()
    for name in ("clock-3-0.png", "clock-3-23.png"):
        assert (a / "images" / name).read_bytes() == (b / "images" / name).read_bytes()
    other = [r["answer"] for r, _ in rows(24, 4)]
    assert other != [ex.answer for ex in examples]  # another seed, other rows


def test_the_gold_hour_is_where_the_hand_is():
    for row, p in rows(12, 0):
        image = render(p)
        hand = _tip_colour(image, p, p["hour"])
        assert hand != (255, 255, 255), row
        # every other hour's direction is blank face there (the ticks sit further out)
        assert all(_tip_colour(image, p, h) == (255, 255, 255) for h in HOURS if h != p["hour"]), row
        assert row["answer"] == str(p["hour"])


def test_bad_input_is_one_line(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    for args, words in ((["--n", "0"], "--n must be a positive integer"),
                        (["--out", str(tmp_path / "full")], "not an empty directory")):
        argv = args if "--out" in args else args + ["--out", str(tmp_path / "new")]
        r = subprocess.run([sys.executable, "-m", "data.clock", *argv], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "new").exists()


def test_help_names_the_format():
    r = subprocess.run([sys.executable, "-m", "data.clock", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "data.jsonl" in r.stdout and "--seed" in r.stdout
    with pytest.raises(SystemExit):
        main(["--help"])
