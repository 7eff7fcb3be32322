"""The response contract: strict extraction and numeric normalisation (docs/design.md, section 1)."""

import pytest

from data.contract import (
    format_prompt,
    format_response,
    is_exact,
    normalize_number,
    parse_response,
    tolerance_for,
    within_tolerance,
)

R = "<REASONING>count them: 3</REASONING>"

# (completion, expected normalised answer or None, n_reasoning, n_solution)
PARSE_CASES = [
    (f"{R}<SOLUTION>3</SOLUTION>", "3", 1, 1),
    (f"{R}\n<SOLUTION> 3 </SOLUTION>", "3", 1, 1),
    (f"{R}<SOLUTION>\n42\n</SOLUTION>", "42", 1, 1),
    (f"{R}<SOLUTION>1,000</SOLUTION>", "1000", 1, 1),
    (f"{R}<SOLUTION>12,345.5</SOLUTION>", "12345.5", 1, 1),
    (f"{R}<SOLUTION>1,00</SOLUTION>", None, 1, 1),  # not a thousands grouping
    (f"{R}<SOLUTION>3,5</SOLUTION>", None, 1, 1),  # decimal comma is not read as 35
    (f"{R}<SOLUTION>2.000</SOLUTION>", "2", 1, 1),
    (f"{R}<SOLUTION>2.</SOLUTION>", "2", 1, 1),
    (f"{R}<SOLUTION>.5</SOLUTION>", "0.5", 1, 1),
    (f"{R}<SOLUTION>-0</SOLUTION>", "0", 1, 1),
    (f"{R}<SOLUTION>-0.0</SOLUTION>", "0", 1, 1),
    (f"{R}<SOLUTION>+7</SOLUTION>", "7", 1, 1),
    (f"{R}<SOLUTION>-3.25</SOLUTION>", "-3.25", 1, 1),
    (f"{R}<SOLUTION>1e3</SOLUTION>", "1000", 1, 1),
    (f"{R}<SOLUTION>2.5E-1</SOLUTION>", "0.25", 1, 1),
    (f"{R}<SOLUTION>1e999</SOLUTION>", None, 1, 1),  # overflows to inf
    (f"{R}<SOLUTION>nan</SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION>inf</SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION>3/4</SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION>5%</SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION>$5</SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION>\u22125</SOLUTION>", None, 1, 1),  # unicode minus
    (f"{R}<SOLUTION>1_000</SOLUTION>", None, 1, 1),  # float() would accept it
    (f"{R}<SOLUTION>\u0661\u0662</SOLUTION>", None, 1, 1),  # Arabic-Indic digits
    (f"{R}<SOLUTION>five</SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION>3 apples</SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION></SOLUTION>", None, 1, 1),  # empty
    (f"{R}<SOLUTION>   </SOLUTION>", None, 1, 1),
    (f"{R}<SOLUTION>3</SOLUTION><SOLUTION>3</SOLUTION>", None, 1, 2),  # duplicated
    (f"{R}{R}<SOLUTION>3</SOLUTION>", "3", 2, 1),  # duplicated reasoning: answer still parses
    (f"{R}", None, 1, 0),  # missing solution
    ("<SOLUTION>3</SOLUTION>", "3", 0, 1),  # missing reasoning
    (f"{R}<SOLUTION>3", None, 1, 0),  # unclosed
    (f"{R}<solution>3</solution>", None, 1, 0),  # tags are case-sensitive
    ("<SOLUTION><SOLUTION>3</SOLUTION></SOLUTION>", None, 0, 1),  # nested: body is "<SOLUTION>3"
    (f"The answer is {R}<SOLUTION>9</SOLUTION> done", "9", 1, 1),  # text outside tags
    ("", None, 0, 0),
    ("\x00\xff garbage <<>>", None, 0, 0),
    (f"{R}<SOLUTION>0007</SOLUTION>", "7", 1, 1),
    (f"{R}<SOLUTION>0.1</SOLUTION>", "0.1", 1, 1),
    (f"{R}<SOLUTION>3.14159265358979</SOLUTION>", "3.14159265359", 1, 1),
]


@pytest.mark.parametrize("text,answer,n_r,n_s", PARSE_CASES)
def test_parse_cases(text, answer, n_r, n_s):
    p = parse_response(text)
    assert p.answer == answer
    assert (p.n_reasoning, p.n_solution) == (n_r, n_s)
    assert p.malformed == (answer is None)
    assert p.parseable == (answer is not None)


def test_case_table_is_large():
    assert len(PARSE_CASES) >= 30


def test_normalize_is_idempotent():
    for _text, answer, *_ in PARSE_CASES:
        if answer is not None:
            assert normalize_number(answer) == answer


def test_round_trip_of_format_response():
    text = format_response("bars: 3 and 4. 3 + 4 = 7.", "7")
    p = parse_response(text)
    assert p.answer == "7" and p.has_reasoning_tag and p.has_solution_tag
    assert p.reasoning == "bars: 3 and 4. 3 + 4 = 7."


def test_prompt_carries_the_instruction():
    prompt = format_prompt("  How many circles?  ")
    assert prompt.startswith("How many circles?\n")
    assert "<SOLUTION>" in prompt and "<REASONING>" in prompt


def test_exact_match_normalises_both_sides():
    assert is_exact("2.0", "2")
    assert is_exact("1,000", "1000")
    assert not is_exact("2.01", "2")
    assert not is_exact(None, "2")
    assert not is_exact("2", "")  # no gold: never correct


@pytest.mark.parametrize(
    "pred,gold,precision,ok",
    [
        ("3.46", "3.5", 1, True),  # rounds to 3.5
        ("3.54", "3.5", 1, True),
        ("3.56", "3.5", 1, False),
        ("3.55", "3.5", 1, True),  # the boundary counts (float error absorbed)
        ("3.6", "3.5", 1, False),
        ("4.4", "4", None, True),
        ("4.6", "4", None, False),
        ("abc", "4", None, False),
        (None, "4", None, False),
        ("1.234", "1.23", 2, True),
    ],
)
def test_tolerance(pred, gold, precision, ok):
    assert within_tolerance(pred, gold, precision) is ok


def test_tolerance_is_half_a_unit():
    assert tolerance_for(None) == 0.5
    assert tolerance_for(2) == pytest.approx(0.005)
