"""V-Rubrics: rule judge, sentence location (exact / case / fuzzy / none), t_end through a real
tokenizer, PITFALL veto, rho, and the prefix-mode inputs of the loss kernel."""

import pytest
import torch

from data.contract import format_response
from data.schema import Example, RubricItem
from grpo.config import RewardConfig
from grpo.errors import ConfigError
from grpo.rewards import RewardModel, RuleJudge, TokenLocator, Verdict, judge_from_item_fn, locate, partial_ratio
from grpo.rewards.rubrics import check_rubrics, rubric_rho, score_rubrics, sentence_spans

TAGS = ["<REASONING>", "</REASONING>", "<SOLUTION>", "</SOLUTION>"]
CORPUS = [
    "<REASONING>red circles: 3. blue squares: 2. 3 + 2 = 5.</REASONING>\n<SOLUTION>5</SOLUTION>",
    "The red bar reaches 7 and the blue bar reaches 3. 7 - 3 = 4. Café prices ≥ 2 €.",
    "How many more red circles than green squares are there? Count them one by one.",
]


def tiny_tokenizer():
    """A byte-level BPE (the kind Qwen2 uses) trained on a few strings, as a transformers tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def ex_counting(pid="count"):
    """'How many more red circles (3) than green squares (2)?', with rubric evidence of every kind."""
    return Example(pid=pid, question="How many more red circles than green squares?", answer="1",
                   rubrics=[
                       RubricItem("Counts 3 red circles", "VF", "ESSENTIAL", 5.0, {"kind": "number", "value": "3"}),
                       RubricItem("Counts 2 green squares", "VF", "IMPORTANT", 3.0, {"kind": "number", "value": "2"}),
                       RubricItem("Subtracts 3 - 2 = 1", "RC", "IMPORTANT", 3.0,
                                  {"kind": "ordered", "values": ["3", "2", "1"]}),
                       RubricItem("Names the green squares", "VF", "OPTIONAL", 1.0,
                                  {"kind": "mentions", "phrases": ["Green Squares"]}),
                       RubricItem("Gives 1 as the final number", "IF", "OPTIONAL", 1.0, {"kind": "answer", "value": "1"}),
                       RubricItem("Adds the counts (3 + 2)", "RC", "PITFALL", -4.0, {"kind": "answer", "value": "5"}),
                   ])


GOOD = format_response("red circles: 3. green squares: 2. 3 - 2 = 1.", "1")


# ----------------------------------------------------------------------------- rule judge


def test_rule_judge_every_evidence_kind():
    ex = ex_counting()
    v = RuleJudge()(ex, GOOD, ex.rubrics)
    assert [x.satisfied for x in v] == [True, True, True, True, True, False]
    assert [x.sentence for x in v] == ["red circles: 3.", "green squares: 2.", "3 - 2 = 1.", "green squares: 2.",
                                       "<SOLUTION>1</SOLUTION>", None]
    for x in v[:5]:
        assert x.sentence in GOOD  # the rule judge quotes the completion verbatim


def test_rule_judge_order_and_pitfall():
    ex = ex_counting()
    text = format_response("1 = 3 - 2 because green squares: 2 and red circles: 3", "5")
    v = RuleJudge()(ex, text, ex.rubrics)
    assert v[2].satisfied is False  # 3, 2, 1 do not appear in that order
    assert v[4].satisfied is False and v[5].satisfied is True  # answered 5: the pitfall
    assert v[5].sentence == "<SOLUTION>5</SOLUTION>"


def test_rule_judge_reads_whole_text_without_a_reasoning_block():
    ex = ex_counting()
    v = RuleJudge()(ex, "red circles: 3. and <SOLUTION>1</SOLUTION>", ex.rubrics)
    assert v[0].satisfied and v[0].sentence == "red circles: 3."


def test_sentence_spans_keep_decimals_together():
    text = "Mean is 3.5 here. Next line\nthird!  "
    assert [text[s:e] for s, e in sentence_spans(text)] == ["Mean is 3.5 here.", "Next line", "third!"]


def test_rho_and_check_rubrics():
    ex = ex_counting()
    assert rubric_rho(ex.rubrics) == pytest.approx([5 / 13, 3 / 13, 3 / 13, 1 / 13, 1 / 13, -4 / 13])
    assert check_rubrics(ex, rule_judge=True) is None
    bad = ex_counting()
    bad.rubrics[5].weight = 4.0
    assert "PITFALL" in check_rubrics(bad, rule_judge=True)
    bad = ex_counting()
    bad.rubrics[0].evidence = {"kind": "vibes"}
    assert "vibes" in check_rubrics(bad, rule_judge=True) and check_rubrics(bad, rule_judge=False) is None
    bad = ex_counting()
    bad.rubrics = [bad.rubrics[5]]
    assert "positive" in check_rubrics(bad, rule_judge=True)


# ----------------------------------------------------------------------------- location

TEXT = ("<REASONING>The red bar reaches 7 and the blue bar reaches 3. "
        "So the difference is 7 - 3 = 4.</REASONING>\n<SOLUTION>4</SOLUTION>")


def test_partial_ratio():
    assert partial_ratio("blue bar", TEXT) == 100.0
    assert partial_ratio(TEXT, "blue bar") == 100.0  # symmetric: the shorter is aligned in the longer
    assert partial_ratio("xyzzy", "abc def") == 0.0
    assert partial_ratio("", "abc") == 0.0
    assert 60 <= partial_ratio("the blue bar is at 3", TEXT) < 100


@pytest.mark.parametrize("sentence,how", [
    ("The red bar reaches 7 and the blue bar reaches 3.", "exact"),
    ("the RED bar reaches 7 AND the blue bar reaches 3.", "case"),
    ("the red bar goes up to 7 and the blue bar reaches 3", "fuzzy"),
    ("Quantum chromodynamics explains gluon confinement", "none"),
    ("", "none"),
    (None, "none"),
])
def test_locate(sentence, how):
    span = locate(TEXT, sentence)
    true_end = TEXT.index("reaches 3.") + len("reaches 3.")
    if how == "none":
        assert span is None
    elif how in ("exact", "case"):
        assert span == (TEXT.index("The red"), true_end)
    else:  # fuzzy: the aligned window ends within a few characters of the true sentence end
        assert abs(span[1] - true_end) <= 3


def test_unicode_lowercase_keeps_indices():
    text = "İstanbul has 3 bridges. Then more."  # 'İ'.lower() is two characters
    assert locate(text, "THEN MORE.") == (text.index("Then"), len(text))


# ----------------------------------------------------------------------------- t_end through a tokenizer

UNI = format_response("Café prices ≥ 2 €. The red bar reaches 7. 7 - 3 = 4.", "4")


@pytest.mark.parametrize("sentence", ["Café prices ≥ 2 €.", "The red bar reaches 7.", "7 - 3 = 4.",
                                      "<SOLUTION>4</SOLUTION>"])
def test_t_end_matches_the_tokenised_text(tok, sentence):
    ids = tok.encode(UNI, add_special_tokens=False) + [tok.eos_token_id]
    char_end = UNI.index(sentence) + len(sentence)
    by_ids = TokenLocator(UNI, len(ids), tok, ids).token_at(char_end)
    by_offsets = TokenLocator(UNI, len(ids), tok).token_at(char_end)
    assert by_ids == by_offsets
    # independent check: the prefix through t_end holds the whole sentence, one token less does not
    assert sentence in tok.decode(ids[:by_ids + 1], skip_special_tokens=True)
    assert sentence not in tok.decode(ids[:by_ids], skip_special_tokens=True)
    # and the offsets say that token covers the sentence's last character
    offsets = tok(UNI, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    s, e = offsets[by_ids]
    assert s < char_end <= e


def test_t_end_beyond_the_text_is_the_last_token(tok):
    ids = tok.encode("abc", add_special_tokens=False)
    assert TokenLocator("abc", 10, tok, ids).token_at(99) == 9  # clamped to the sampled count - 1
    assert TokenLocator("abc", len(ids), tok).token_at(99) == len(ids) - 1


# ----------------------------------------------------------------------------- scores and veto


def test_score_rubrics_veto_and_unlocated():
    ex = ex_counting()
    text = format_response("red circles: 3. green squares: 2. 3 + 2 = 5.", "5")  # the pitfall
    verdicts = RuleJudge()(ex, text, ex.rubrics)
    sc = score_rubrics(ex.rubrics, verdicts, text, None)
    assert sc.veto
    assert sc.s == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # positive credit vetoed, pitfall holds
    assert sc.reward == pytest.approx(-4 / 13)


def test_pitfall_veto_zeroes_the_answer_reward():
    """A right answer with a committed pitfall gets no correctness and no positive rubric credit."""
    ex = Example(pid="veto", question="q", answer="5", rubrics=[
        RubricItem("States the count", "VF", "ESSENTIAL", 5.0, {"kind": "number", "value": "5"}),
        RubricItem("Guesses instead of counting", "RC", "PITFALL", -5.0, {"kind": "mentions", "phrases": ["guess"]}),
    ])
    honest, guess = format_response("I count 5.", "5"), format_response("I guess 5.", "5")
    rm = RewardModel(RewardConfig(weights=dict(correctness=1.0, rubric=1.0)), max_new_tokens=64)
    b = rm([ex, ex], [honest, guess], [10, 10])
    assert b.components["correctness"].tolist() == [1.0, 0.0]
    assert b.components["rubric"].tolist() == pytest.approx([1.0, -1.0])
    assert b.vetoed.tolist() == [False, True]
    assert b.summary()["rubric/veto_frac"] == 0.5
    # a switched-off rubric term (weight 0) is still reported but vetoes nothing
    rm.set_weights(dict(correctness=1.0, rubric=0.0))
    b = rm([ex, ex], [honest, guess], [10, 10])
    assert b.components["correctness"].tolist() == [1.0, 1.0]
    assert b.components["rubric"].tolist() == pytest.approx([1.0, -1.0])


# ----------------------------------------------------------------------------- prefix inputs


def _prefix_batch(tok, judge=None):
    cfg = RewardConfig(weights=dict(format=0.05, correctness=0.5, rubric=0.45), rubric_mode="prefix",
                       prefix_answer_weight=0.5)
    rm = RewardModel(cfg, max_new_tokens=128, tokenizer=tok, judge=judge)
    short = Example(pid="short", question="q", answer="4", rubrics=[
        RubricItem("Gives 4", "IF", "ESSENTIAL", 2.0, {"kind": "answer", "value": "4"})])
    exs = [ex_counting(), ex_counting(), short, short]
    texts = [GOOD, format_response("no idea", "5"), format_response("7 - 3 = 4.", "4"), "garbage"]
    ids = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    n = [len(i) for i in ids]
    width = max(n)
    padded = torch.tensor([i + [tok.pad_token_id or 0] * (width - len(i)) for i in ids])  # right padded
    return rm(exs, texts, torch.tensor(n), padded), texts, ids


def test_prefix_inputs_shapes_padding_and_t_end(tok):
    b, texts, ids = _prefix_batch(tok)
    p = b.prefix
    N, J = 4, 6
    assert p.s.shape == p.scored.shape == p.rho.shape == p.t_end.shape == (N, J)
    assert p.t_end.dtype == torch.int64 and p.scored.dtype == torch.bool and p.R_ans.shape == (N,)
    assert p.a == 0.5
    # rows 2, 3 have one item: the rest is padding, never scored
    assert p.scored[2].tolist() == [True] + [False] * 5 and p.rho[2, 1:].abs().sum() == 0
    assert p.rho[0].tolist() == pytest.approx([5 / 13, 3 / 13, 3 / 13, 1 / 13, 1 / 13, -4 / 13])
    # t_end of row 0: each supporting sentence's last token
    for j, sentence in enumerate(["red circles: 3.", "green squares: 2.", "3 - 2 = 1.", "green squares: 2.",
                                  "<SOLUTION>1</SOLUTION>"]):
        t = int(p.t_end[0, j])
        assert sentence in tok.decode(ids[0][:t + 1]) and sentence not in tok.decode(ids[0][:t])
    last = [len(i) - 1 for i in ids]
    assert int(p.t_end[0, 5]) == last[0]  # the pitfall was not committed: whole response
    assert p.t_end[1].tolist() == [last[1]] * 5 + [tok.encode(texts[1]).index(tok.convert_tokens_to_ids("</SOLUTION>"))]
    assert int(p.t_end[3, 0]) == last[3]  # unsatisfied: whole response
    # R_ans = the non-rubric components, weighted, and the total adds the rubric term
    R_ans = 0.05 * b.components["format"] + 0.5 * b.components["correctness"]
    assert torch.allclose(p.R_ans, R_ans)
    assert torch.allclose(b.total, R_ans + 0.45 * b.components["rubric"])
    assert p.s[1].tolist() == [0, 0, 0, 0, 0, 1] and p.R_ans[1] == pytest.approx(0.05 * 2)  # vetoed row


def test_prefix_inputs_feed_the_loss_kernel_reference(tok):
    gl = pytest.importorskip("grpo_kernels.grpo_loss")
    b, _, ids = _prefix_batch(tok)
    pr = b.prefix  # the reward side builds the kernel's own PrefixRubrics (one definition)
    # by name: an earlier test file may have re-imported kernels/ under the Triton interpreter
    assert type(pr).__qualname__ == gl.PrefixRubrics.__qualname__ == "PrefixRubrics"
    T = max(len(i) for i in ids)
    adv, _ = gl.prefix_advantages_reference(pr, T, G=2)
    assert adv.shape == (4, T) and torch.isfinite(adv).all()
    # tokens after every t_end of a row get the answer term only, which is constant in t
    i = 0
    after = int(pr.t_end[i][pr.scored[i]].max()) + 1
    if after < T:
        assert torch.allclose(adv[i, after:], adv[i, after].expand(T - after))


def test_model_judge_paraphrases_and_abstains(tok):
    """A pluggable judge: paraphrased sentences are found fuzzily; None leaves an item unscored."""
    calls = []

    def judge(example, completion, item):
        calls.append(item.text)
        if item.label == "PITFALL":
            return None  # the model judge failed to answer
        if item.dimension == "IF":
            return (True, "<solution>1</solution>")  # case changed
        return (True, "RED circles are 3")  # paraphrase of "red circles: 3."

    b, texts, ids = _prefix_batch(tok, judge=judge_from_item_fn(judge))
    p = b.prefix
    assert len(calls) == 6 + 6 + 1 + 1
    assert p.scored[0].tolist() == [True] * 5 + [False]
    t = int(p.t_end[0, 0])
    assert "red circles: 3" in tok.decode(ids[0][:t + 2])  # fuzzy window ends at (or 1 before) the sentence end
    assert t < len(ids[0]) - 3


def test_judge_output_is_checked(tok):
    rm = RewardModel(RewardConfig(weights=dict(rubric=1.0)), 64, judge=lambda ex, c, items: [Verdict(True)])
    with pytest.raises(ValueError, match="6 verdicts"):
        rm([ex_counting()], [GOOD], [5])
    with pytest.raises(ConfigError, match="not callable"):
        RewardModel(RewardConfig(weights=dict(rubric=1.0)), 64, judge="gpt")


def test_prefix_mode_needs_a_tokenizer():
    with pytest.raises(ConfigError, match="tokenizer"):
        RewardModel(RewardConfig(weights=dict(rubric=1.0), rubric_mode="prefix"), 64)


def test_synthetic_rubrics_gold_reasoning_scores_full(tok):
    """The rule judge understands every evidence the synthetic generator writes."""
    from data.synthetic import generate

    exs = []
    for stage in (1, 2, 3):
        try:
            exs += generate("train", stage, 6, seed=2, image_size=56)
        except ModuleNotFoundError:
            pass
    rm = RewardModel(RewardConfig(weights=dict(rubric=1.0)), 256)
    rm.validate(exs)
    b = rm(exs, [format_response(e.reasoning, e.answer) for e in exs], [50] * len(exs))
    assert b.components["rubric"].tolist() == pytest.approx([1.0] * len(exs))
    assert not b.vetoed.any()
    # answering a pitfall's wrong value vetoes
    for e in exs:
        pit = [it for it in e.rubrics if it.label == "PITFALL"]
        if pit:
            text = format_response(e.reasoning, pit[0].evidence["value"])
            bb = rm([e], [text], [50])
            assert bb.vetoed.item() and bb.components["rubric"].item() < 0
