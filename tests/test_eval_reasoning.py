"""eval/reasoning.py: the answer against the reasoning's own result, and key-step accuracy,
per completion, per subset in evaluate_completions, and in the written report."""

import math

from data.synthetic import generate
from eval.reasoning import arithmetic_right, completion_reasoning, reasoning_result, summarize_reasoning
from eval.report import write_report
from eval.results import evaluate_completions


def box(reasoning: str, answer: str) -> str:
    return f"<REASONING>{reasoning}</REASONING><SOLUTION>{answer}</SOLUTION>"


def test_the_reasoning_result_is_the_number_after_its_last_equals_sign():
    assert reasoning_result(box("red: 5. 5 + 3 + 9 = 17 shapes.", "19")) == "17"
    assert reasoning_result(box("8 + 5 = 13. 13 / 2 = 6.50", "6.5")) == "6.5"
    assert reasoning_result(box("red circles: 1. blue triangles: 2.", "2")) == "2"  # no "=": the last number
    assert reasoning_result(box("I cannot see it.", "2")) is None
    assert reasoning_result("<SOLUTION>3</SOLUTION>") is None  # no reasoning block


def test_right_reasoning_with_a_wrong_answer_is_counted_as_such():
    keys = [["5", "five"], ["3"], ["5 + 3", "5+3"]]
    slip = completion_reasoning(box("red: 5. blue: 3. 5 + 3 = 8.", "9"), "8", keys)
    assert slip == {"reasoning_result": "8", "answer_follows": False, "right_reasoning_wrong": True,
                    "arithmetic_right": True, "key_step_accuracy": 1.0}
    good = completion_reasoning(box("red: five, and three more make 8.", "8"), "8", keys)
    assert (good["answer_follows"], good["right_reasoning_wrong"]) == (True, False)
    assert math.isclose(good["key_step_accuracy"], 1 / 3)  # "five" only: "three" is not a listed spelling of 3
    none = completion_reasoning(box("no idea", "4"), "8", None)
    assert none["answer_follows"] is None and none["key_step_accuracy"] is None


def test_arithmetic_is_checked_clause_by_clause_to_the_decimals_shown():
    assert arithmetic_right(box("column 1: 5, 3, 9. 5 + 3 + 9 = 19.", "19")) is False  # the typical slip
    assert arithmetic_right(box("row 1: 39. row 2: 14. 39 + 14 = 53. 53 / 2 = 26.", "26")) is False
    assert arithmetic_right(box("corner: 2 x 2 = 4. 15 - 4 = 11. 10 / 3 = 3.33. 1,000 + 5 = 1,005", "11")) is True
    assert arithmetic_right(box("red circles: 3. x = 3", "3")) is None  # nothing to check


def test_summaries_count_only_what_each_number_is_defined_on():
    recs = [{"pid": "a", "answer_follows": True, "right_reasoning_wrong": False, "key_step_accuracy": 1.0},
            {"pid": "a", "answer_follows": False, "right_reasoning_wrong": True, "key_step_accuracy": 0.5},
            {"pid": "b", "answer_follows": None, "right_reasoning_wrong": False, "key_step_accuracy": None}]
    s = summarize_reasoning(recs)
    assert (s["answer_follows"]["value"], s["answer_follows"]["n"]) == (0.5, 2)
    assert math.isclose(s["right_reasoning_wrong"]["value"], 1 / 3) and s["right_reasoning_wrong"]["n"] == 3
    assert (s["key_step_accuracy"]["value"], s["key_step_accuracy"]["n"]) == (0.75, 1)  # one prompt with key steps
    assert s["answer_follows"]["lo"] < 0.5 < s["answer_follows"]["hi"]
    assert math.isnan(summarize_reasoning([])["key_step_accuracy"]["value"])


def test_every_evaluation_and_report_carries_the_numbers(tmp_path):
    ex = generate("test", 2, 1, 0, 56)[0]
    gold = ex.answer
    texts = [[box(f"it is {gold}", gold), box(f"x = {gold}", "12345")]]
    res = evaluate_completions([ex], texts, [[9, 9]], max_new_tokens=48)
    o = res.reasoning["overall"]
    assert (o["answer_follows"]["value"], o["answer_follows"]["n"]) == (0.5, 2)
    assert o["right_reasoning_wrong"]["value"] == 0.5
    assert res.flat()["answer_follows"] == 0.5 and "key_step_accuracy" in res.flat()
    assert res.records[1]["right_reasoning_wrong"] is True
    assert set(res.reasoning) == {"overall", "stage1", "stage2", "stage3"}
    md, _ = write_report({"m": res}, {"protocol": "test"}, tmp_path)
    assert "answer follows reasoning" in md.read_text()
