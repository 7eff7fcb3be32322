"""R1-VL StepRAR / StepRVR, the soft matcher, and RewardMap's detail reward."""

import pytest

from data.contract import format_response, parse_response
from data.schema import Intermediate
from grpo.rewards.detail import DETAIL_MAX, detail_fraction, detail_reward, difficulty_weight
from grpo.rewards.steps import STEP_ALPHA, SoftText, canonical_tokens, step_rar, step_rvr


def toks(s):
    return [t.text for t in canonical_tokens(s)]


def P(reasoning, answer, tail=""):
    text = format_response(reasoning, answer) + tail
    return text, parse_response(text)


# ----------------------------------------------------------------------------- soft matching

SAME = [
    ("\\frac{3}{4}", "3/4"),
    ("\\dfrac{3}{4}", "0.75"),
    ("3 / 4", "0.75"),
    ("$\\frac{6}{3} = 2$", "6/3 = 2"),  # R1-VL's own augmentation example
    ("1,000", "1000.0"),
    ("1,000", "1000"),
    ("2.50", "2.5"),
    ("\u22125", "-5"),  # unicode minus
    ("\u20135", "-5"),  # en dash
    ("3+4=7", "3 + 4 = 7"),
    ("Red   Circles", "red circles"),
    ("RED\tcircles\n", "red circles"),
    ("3 × 4", "3*4"),
    ("3 x 4", "3 \\times 4"),
    ("3x4", "3 \\cdot 4"),
    ("12 ÷ 4", "12 / 4"),
    ("\\left( 3 + 4 \\right)", "(3+4)"),
    ("ｆｕｌｌ width", "full width"),  # NFKC
]
DIFFERENT = [
    ("7", "17"),
    ("7", "0.75"),
    ("14 / 2", "7"),  # an integer-valued fraction is a division step, not folded
    ("3 + 4", "4 + 3"),  # no algebra
    ("1,00", "100"),  # not a thousands grouping
    ("2.5/5", "0.5"),  # decimal operands: a division step
    ("1/2/2020", "0.5"),  # a date, not a fraction
]


@pytest.mark.parametrize("a,b", SAME)
def test_soft_equivalent(a, b):
    assert toks(a) == toks(b)
    assert SoftText(f"so {b} here").find(a) == 1


@pytest.mark.parametrize("a,b", DIFFERENT)
def test_soft_distinct(a, b):
    assert SoftText(b).find(a) == -1


def test_token_spans_point_into_the_original():
    text = "Total: \\frac{1}{2} and 1,234.5 apples"
    for t in canonical_tokens(text):
        assert text[t.start:t.end].strip()
    nums = SoftText(text).numbers()
    assert ("0.5", 2) in nums and ("1", 2) in nums and ("2", 2) in nums  # fraction and its parts
    assert ("1234.5", 4) in nums


# ----------------------------------------------------------------------------- StepRAR

KEY = [["3", "three"], ["2", "two"], ["3 + 2", "3+2", "2 + 3"]]


@pytest.mark.parametrize("reasoning,answer,k", [
    ("red circles: 3. blue squares: 2. 3 + 2 = 5.", "5", 3),
    ("Three red circles and two blue squares, 3+2 = 5.", "5", 3),  # alternatives + spacing
    ("$3$ red, $2$ blue, 2 + 3 = 5", "5", 3),
    ("red circles: 3. so 5", "5", 1),
    ("I just know it", "5", 0),
    ("red circles: 3. blue squares: 2. 3 + 2 = 6.", "6", 3),  # wrong answer, all steps
    ("red circles: 3. blue: 4.", "7", 1),
])
def test_step_rar(reasoning, answer, k):
    text, p = P(reasoning, answer)
    expected = float(answer == "5") + STEP_ALPHA * k / 3
    assert step_rar(text, p, KEY, "5") == pytest.approx(expected)


def test_step_rar_zero_without_answer():
    text = "<REASONING>red circles: 3. blue squares: 2. 3 + 2 = 5.</REASONING><SOLUTION>five</SOLUTION>"
    assert step_rar(text, parse_response(text), KEY, "5") == 0.0
    text = "<REASONING>3 + 2 = 5</REASONING>"
    assert step_rar(text, parse_response(text), KEY, "5") == 0.0


def test_step_rar_ignores_the_solution_block():
    """Repeating a key value inside SOLUTION is not a reasoning step."""
    text, p = P("no idea", "3")
    assert step_rar(text, p, [["3"]], "3") == pytest.approx(1.0)


def test_step_rar_formatting_variants():
    key = [["0.75"], ["1000"], ["-4"]]
    text, p = P("share \\frac{3}{4}, total 1,000.0, change \u22124", "1")
    assert step_rar(text, p, key, "2") == pytest.approx(STEP_ALPHA)


# ----------------------------------------------------------------------------- StepRVR


@pytest.mark.parametrize("text,expected", [
    (format_response("red circles: 3. blue squares: 2. 3 + 2 = 5.", "5"), 1.0),
    (format_response("red circles: 3. blue squares: 2. 3 + 2 = 5.", "5") + "\n\n  ", 1.0),  # trailing space ok
    ("Let me look.\n" + format_response("3 + 2 = 5", "5"), 1.0),  # before the reasoning: tolerated
    (format_response("3+2 = 5", "5"), 1.0),  # the combining step contains the reads: in order
    (format_response("2 + 3 = 5, from blue squares: 2 and red circles: 3.", "5"), 0.0),  # steps out of order
    (format_response("blue 2 then red 3", "5"), 0.0),  # 2 before 3 although the groups list 3 first
    (format_response("red circles: 3. so 5", "5"), 1.0),  # absent steps are not an ordering error
    (format_response("3 + 2 = 5", "5") + " Hope this helps!", 0.0),  # text after </SOLUTION>
    ("<SOLUTION>5</SOLUTION><REASONING>3 + 2 = 5</REASONING>", 0.0),  # answer before reasoning
    (format_response("   ", "5"), 0.0),  # empty reasoning
    (format_response("3 + 2", "five"), 0.0),  # no final answer
    ("<REASONING>3</REASONING><REASONING>2</REASONING><SOLUTION>5</SOLUTION>", 0.0),  # two blocks
    ("<SOLUTION>5</SOLUTION>", 0.0),
    ("", 0.0),
])
def test_step_rvr(text, expected):
    assert step_rvr(text, parse_response(text), KEY) == expected


def test_step_rvr_chained_steps_share_a_token():
    key = [["3 + 4 = 7"], ["7 * 2 = 14"]]
    text, p = P("3 + 4 = 7 * 2 = 14", "14")
    assert step_rvr(text, p, key) == 1.0
    text, p = P("7 x 2 = 14 where 3 + 4 = 7", "14")
    assert step_rvr(text, p, key) == 0.0


def test_step_rvr_without_key_steps_checks_structure_only():
    text, p = P("anything at all", "5")
    assert step_rvr(text, p, []) == 1.0


# ----------------------------------------------------------------------------- RewardMap detail

INTER = [Intermediate("red circles", "3"), Intermediate("blue squares", "2")]


@pytest.mark.parametrize("difficulty,hops,W", [("easy", 1, 1.0), ("middle", 1, 1.2), ("hard", 1, 1.5),
                                               ("easy", 2, 1.5), ("middle", 3, 1.7), ("hard", 2, 2.0)])
def test_difficulty_weight(difficulty, hops, W):
    assert difficulty_weight(difficulty, hops) == pytest.approx(W)


def test_fully_right_answer_earns_the_maximum():
    """The anchor's off-by-one gave a direct right answer 1/10 detail credit; here it is full."""
    text, p = P("", "5")  # no intermediates written at all, but the answer is right
    assert detail_fraction(text, p, INTER, "5") == 1.0
    assert detail_reward(text, p, INTER, "5", "hard", 2) == pytest.approx(DETAIL_MAX) == pytest.approx(2.0)


@pytest.mark.parametrize("reasoning,answer,frac", [
    ("red circles: 3. blue squares: 2.", "6", 1.0),
    ("red circles: 3.", "6", 0.5),
    ("red circles: three", "6", 0.0),  # detail matches numbers, not words
    ("nothing", "6", 0.0),
    ("ratio \\frac{3}{2}", "6", 1.0),  # a fraction counts its numerator and denominator
])
def test_detail_partial_credit(reasoning, answer, frac):
    text, p = P(reasoning, answer)
    assert detail_fraction(text, p, INTER, "5") == pytest.approx(frac)
    assert detail_reward(text, p, INTER, "5", "middle", 1) == pytest.approx(1.2 * frac)


def test_detail_soft_number_formats_and_no_answer():
    inter = [Intermediate("total", "1000"), Intermediate("share", "0.75")]
    text, p = P("total 1,000.0 and share 3/4", "7")
    assert detail_fraction(text, p, inter, "8") == 1.0
    text = "<REASONING>total 1,000 share 0.75</REASONING>"
    assert detail_fraction(text, parse_response(text), inter, "8") == 0.0  # no answer, no detail


def test_detail_reads_nothing_after_the_solution():
    text = format_response("nothing", "6") + " red circles: 3"
    assert detail_fraction(text, parse_response(text), INTER, "5") == 0.0


# ----------------------------------------------------------------------------- synthetic data


def _synthetic():
    from data.synthetic import generate

    out = []
    for stage in (1, 2, 3):
        try:
            out += generate("train", stage, 6, seed=1, image_size=56)
        except ModuleNotFoundError:  # a stage's generator not written yet
            pass
    return out


def test_synthetic_gold_reasoning_earns_full_step_and_detail_credit():
    """The generator's own worked solution is the ideal rollout for every step reward."""
    exs = _synthetic()
    assert exs
    for ex in exs:
        text = format_response(ex.reasoning, ex.answer)
        p = parse_response(text)
        assert step_rar(text, p, ex.key_steps, ex.answer) == pytest.approx(1 + STEP_ALPHA), ex.pid
        assert step_rvr(text, p, ex.key_steps) == 1.0, ex.pid
        assert detail_fraction(text, p, ex.intermediates, ex.answer) == 1.0, ex.pid
        # and with a wrong answer, the reasoning alone still finds every intermediate
        wrong = format_response(ex.reasoning, "123456")
        assert detail_fraction(wrong, parse_response(wrong), ex.intermediates, ex.answer) == 1.0, ex.pid
