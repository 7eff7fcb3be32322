"""The six verifier components (docs/design.md, section 2) on a table of completions."""

import pytest

from data.contract import parse_response
from data.schema import Example
from grpo.config import RewardConfig
from grpo.rewards import RewardModel
from grpo.rewards.verifier import VERIFIER_COMPONENTS, brevity_reward, verify

L = 100
R = "<REASONING>There are 12 apples.</REASONING>"
INT = Example(pid="int", question="How many?", answer="12")  # precision None -> tolerance +-0.5
FLT = Example(pid="flt", question="Mean?", answer="2.5", answer_type="float", precision=1)  # +-0.05
BIG = Example(pid="big", question="How many?", answer="1000")
NEG = Example(pid="neg", question="Change?", answer="-12")
HALF = Example(pid="half", question="Share?", answer="0.5", answer_type="float", precision=1)

# (case id, example, completion, tok, (format, parseable, finished, correctness, tolerance, brevity))
CASES = [
    # right answers, in every spelling the contract accepts
    ("right", INT, f"{R}<SOLUTION>12</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_newline_between", INT, f"{R}\n<SOLUTION>12</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_padded", INT, f"{R}<SOLUTION>  12 </SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_multiline_body", INT, f"{R}<SOLUTION>\n12\n</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_float_form", INT, f"{R}<SOLUTION>12.0</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_exponent", INT, f"{R}<SOLUTION>1.2e1</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_plus_sign", INT, f"{R}<SOLUTION>+12</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_leading_zeros", INT, f"{R}<SOLUTION>0012</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_trailing_dot", INT, f"{R}<SOLUTION>12.</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_thousands", BIG, f"{R}<SOLUTION>1,000</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_negative", NEG, f"{R}<SOLUTION>-12</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_bare_decimal", HALF, f"{R}<SOLUTION>.5</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    ("right_float", FLT, f"{R}<SOLUTION>2.50</SOLUTION>", 20, (2, 1, 1, 1, 0, 1)),
    # wrong, and near misses inside / outside the tolerance
    ("wrong", INT, f"{R}<SOLUTION>13</SOLUTION>", 20, (2, 1, 1, 0, 0, 1)),
    ("wrong_sign", INT, f"{R}<SOLUTION>-12</SOLUTION>", 20, (2, 1, 1, 0, 0, 1)),
    ("near_int_inside", INT, f"{R}<SOLUTION>12.4</SOLUTION>", 20, (2, 1, 1, 0, 1, 1)),
    ("near_int_boundary", INT, f"{R}<SOLUTION>11.5</SOLUTION>", 20, (2, 1, 1, 0, 1, 1)),
    ("near_int_outside", INT, f"{R}<SOLUTION>12.6</SOLUTION>", 20, (2, 1, 1, 0, 0, 1)),
    ("near_float_inside", FLT, f"{R}<SOLUTION>2.54</SOLUTION>", 20, (2, 1, 1, 0, 1, 1)),
    ("near_float_boundary", FLT, f"{R}<SOLUTION>2.55</SOLUTION>", 20, (2, 1, 1, 0, 1, 1)),
    ("near_float_below", FLT, f"{R}<SOLUTION>2.46</SOLUTION>", 20, (2, 1, 1, 0, 1, 1)),
    ("near_float_outside", FLT, f"{R}<SOLUTION>2.56</SOLUTION>", 20, (2, 1, 1, 0, 0, 1)),
    ("anchor_tol_not_ours", FLT, f"{R}<SOLUTION>2.7</SOLUTION>", 20, (2, 1, 1, 0, 0, 1)),  # anchor: 10% rel.
    # unparseable solutions: malformed, -0.5
    ("words", INT, f"{R}<SOLUTION>twelve</SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("empty_solution", INT, f"{R}<SOLUTION></SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("blank_solution", INT, f"{R}<SOLUTION>   </SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("fraction", INT, f"{R}<SOLUTION>24/2</SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("unit", INT, f"{R}<SOLUTION>12 apples</SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("decimal_comma", INT, f"{R}<SOLUTION>1,00</SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("unicode_minus", NEG, f"{R}<SOLUTION>\u221212</SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("nan", INT, f"{R}<SOLUTION>nan</SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("overflow", INT, f"{R}<SOLUTION>1e999</SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    ("nested_solution", INT, f"{R}<SOLUTION><SOLUTION>12</SOLUTION></SOLUTION>", 20, (1.5, 0, 0, 0, 0, 1)),
    # missing / duplicated tags
    ("no_solution_tag", INT, f"{R}12", 20, (0.5, 0, 0, 0, 0, 1)),
    ("lowercase_tags", INT, f"{R}<solution>12</solution>", 20, (0.5, 0, 0, 0, 0, 1)),
    ("no_reasoning_tag", INT, "<SOLUTION>12</SOLUTION>", 20, (1, 1, 0, 1, 0, 1)),
    ("unclosed_reasoning", INT, "<REASONING>so 12 <SOLUTION>12</SOLUTION>", 20, (1, 1, 0, 1, 0, 1)),
    ("duplicated_solution", INT, f"{R}<SOLUTION>12</SOLUTION><SOLUTION>12</SOLUTION>", 20, (0.5, 0, 0, 0, 0, 1)),
    ("duplicated_reasoning", INT, f"{R}{R}<SOLUTION>12</SOLUTION>", 20, (1, 1, 0, 1, 0, 1)),
    ("bare_number", INT, "12", 5, (-0.5, 0, 0, 0, 0, 1)),
    ("empty", INT, "", 0, (-0.5, 0, 0, 0, 0, 1)),
    # text outside the tags is the format reward's blind spot (StepRVR sees it)
    ("text_outside", INT, f"Sure! {R}<SOLUTION>12</SOLUTION> Hope this helps.", 20, (2, 1, 1, 1, 0, 1)),
    ("solution_first", INT, f"<SOLUTION>12</SOLUTION>{R}", 20, (2, 1, 1, 1, 0, 1)),
    ("binaryish", INT, "\x00\xff\ufffd<SOLUTION>12</SOLUTION>\x7f", 20, (1, 1, 0, 1, 0, 1)),
    # truncation: tok >= L
    ("truncated_mid_solution", INT, f"{R}<SOLUTION>12", L, (0.5, 0, -1, 0, 0, -1)),
    ("truncated_mid_reasoning", INT, "<REASONING>and then and then", L, (-0.5, 0, -1, 0, 0, -1)),
    ("complete_at_budget", INT, f"{R}<SOLUTION>12</SOLUTION>", L, (2, 1, -1, 1, 0, -1)),
    ("over_budget", INT, f"{R}<SOLUTION>12</SOLUTION>", L + 7, (2, 1, -1, 1, 0, -1)),
    # brevity steps at tok / L = .55 / .56 / .75 / .76 / .90 / .91 / .99
    ("len_55", INT, f"{R}<SOLUTION>12</SOLUTION>", 55, (2, 1, 1, 1, 0, 1)),
    ("len_56", INT, f"{R}<SOLUTION>12</SOLUTION>", 56, (2, 1, 1, 1, 0, 0.5)),
    ("len_75", INT, f"{R}<SOLUTION>12</SOLUTION>", 75, (2, 1, 1, 1, 0, 0.5)),
    ("len_76", INT, f"{R}<SOLUTION>12</SOLUTION>", 76, (2, 1, 1, 1, 0, 0)),
    ("len_90", INT, f"{R}<SOLUTION>12</SOLUTION>", 90, (2, 1, 1, 1, 0, 0)),
    ("len_91", INT, f"{R}<SOLUTION>12</SOLUTION>", 91, (2, 1, 1, 1, 0, -0.5)),
    ("len_99_wrong", INT, f"{R}<SOLUTION>7</SOLUTION>", 99, (2, 1, 1, 0, 0, -0.5)),
]


def test_table_is_large_and_ids_unique():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,ex,text,tok,expected", CASES, ids=[c[0] for c in CASES])
def test_verifier_table(name, ex, text, tok, expected):
    got = verify(parse_response(text), ex.answer, ex.precision, tok, L, tolerance=True)
    assert tuple(got[k] for k in VERIFIER_COMPONENTS) == pytest.approx(expected), name


def test_table_through_reward_model_with_weights():
    """Same table through the composition API: components as above, total = weighted sum."""
    w = dict(format=1.0, parseable=0.5, finished=1.5, correctness=2.0, tolerance=1.0, brevity=0.25)
    rm = RewardModel(RewardConfig(weights=w, tolerance=True), max_new_tokens=L)
    batch = rm([c[1] for c in CASES], [c[2] for c in CASES], [c[3] for c in CASES])
    for i, (name, _, _, _, expected) in enumerate(CASES):
        got = tuple(float(batch.components[k][i]) for k in VERIFIER_COMPONENTS)
        assert got == pytest.approx(expected), name
        assert float(batch.total[i]) == pytest.approx(sum(w[k] * e for k, e in zip(VERIFIER_COMPONENTS, expected)))


def test_tolerance_off_pays_nothing():
    text = f"{R}<SOLUTION>12.4</SOLUTION>"
    assert verify(parse_response(text), "12", None, 10, L, tolerance=False)["tolerance"] == 0.0
    rm = RewardModel(RewardConfig(weights=dict(correctness=1.0, tolerance=0.0), tolerance=False), L)
    assert float(rm([INT], [text], [10]).components["tolerance"][0]) == 0.0


def test_exact_is_never_paid_twice():
    """tolerance pays only near misses: an exact answer earns correctness, not tolerance."""
    got = verify(parse_response(f"{R}<SOLUTION>12</SOLUTION>"), "12", None, 10, L, tolerance=True)
    assert (got["correctness"], got["tolerance"]) == (1.0, 0.0)


@pytest.mark.parametrize("L_,tok,expected", [(1, 0, 1.0), (1, 1, -1.0), (20, 11, 1.0), (20, 12, 0.5), (20, 19, -0.5)])
def test_brevity_small_budgets(L_, tok, expected):
    assert brevity_reward(tok, L_) == expected
