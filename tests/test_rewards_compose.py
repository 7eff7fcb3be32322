"""The composition API: reward spec checks, data validation at start, weights read at call time,
per-component reporting, and a property test that no string can break the rewards."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.contract import format_response
from data.schema import Example, Intermediate, RubricItem
from grpo.config import PHASE_WEIGHTS, RewardConfig
from grpo.errors import ConfigError
from grpo.presets import phase_preset
from grpo.rewards import COMPONENT_BOUNDS, KNOWN_COMPONENTS, RUBRIC_RELEASE_WEIGHTS, RewardModel

ALL = {name: 1.0 for name in KNOWN_COMPONENTS}


def full_example(pid="full"):
    """An example with every kind of supervision (what a synthetic stage-3 row carries)."""
    return Example(
        pid=pid, question="Mean of the red and blue bars?", answer="3.5", answer_type="float", precision=1,
        reasoning="red bar: 3. blue bar: 4. 3 + 4 = 7. 7 / 2 = 3.5.",
        key_steps=[["3", "three"], ["4", "four"], ["3 + 4", "3+4"], ["7 / 2", "7/2"]],
        intermediates=[Intermediate("red bar", "3"), Intermediate("blue bar", "4"), Intermediate("sum", "7")],
        difficulty="hard", hops=2,
        rubrics=[RubricItem("Reads red as 3", "VF", "ESSENTIAL", 5.0, {"kind": "number", "value": "3"}),
                 RubricItem("Adds then halves", "RC", "IMPORTANT", 3.0, {"kind": "ordered", "values": ["3", "4", "7"]}),
                 RubricItem("Mentions the blue bar", "VF", "OPTIONAL", 1.0, {"kind": "mentions", "phrases": ["blue bar"]}),
                 RubricItem("Gives 3.5", "IF", "OPTIONAL", 1.0, {"kind": "answer", "value": "3.5"}),
                 RubricItem("Forgets to halve", "RC", "PITFALL", -4.0, {"kind": "answer", "value": "7"})],
    )


def model(weights=None, **kw):
    tolerance = kw.pop("tolerance", True)
    return RewardModel(RewardConfig(weights=dict(ALL if weights is None else weights), tolerance=tolerance, **kw),
                       max_new_tokens=64)


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("weights,match", [
    ({"format": 1.0, "corectness": 2.0}, "unknown component 'corectness'"),
    ({"brevity": -0.5}, "must be >= 0"),
    ({"format": float("nan")}, "finite"),
    ({"format": float("inf")}, "finite"),
    ({"format": "1"}, "finite number"),
    ({"format": True}, "finite number"),
    ({}, "non-empty"),
])
def test_bad_spec_is_a_config_error(weights, match):
    with pytest.raises(ConfigError, match=match):
        model(weights)


def test_other_config_errors():
    with pytest.raises(ConfigError, match="rewards.tolerance is false"):
        model({"tolerance": 1.0}, tolerance=False)
    with pytest.raises(ConfigError, match="rubric_mode"):
        model(rubric_mode="token")
    with pytest.raises(ConfigError, match="prefix_answer_weight"):
        model(prefix_answer_weight=1.5)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        RewardModel(RewardConfig(), max_new_tokens=0)


@pytest.mark.parametrize("phase", ["A", "B", "C"])
def test_phase_presets_are_valid_specs(phase):
    cfg = phase_preset(phase).rewards
    rm = RewardModel(cfg, max_new_tokens=48)
    assert rm.weights == PHASE_WEIGHTS[phase]


def _tokenizer():
    """A tiny byte-level BPE as a transformers tokenizer (same recipe as test_rewards_rubrics)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([format_response(full_example().reasoning, "3.5")] * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<REASONING>", "</REASONING>", "<SOLUTION>", "</SOLUTION>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.mark.parametrize("mode", ["sequence", "prefix"])
def test_rubric_release_weights(mode, tok):
    rm = RewardModel(RewardConfig(weights=dict(RUBRIC_RELEASE_WEIGHTS[mode]), rubric_mode=mode), 64, tokenizer=tok)
    ex = full_example()
    b = rm([ex, ex], [format_response(ex.reasoning, "3.5"), "nope"], [30, 3])
    assert set(b.components) == {"correctness", "format", "rubric"}
    assert (b.prefix is not None) == (mode == "prefix")
    assert b.total[0] > b.total[1]


# ----------------------------------------------------------------------------- data validation


@pytest.mark.parametrize("component,edit,match", [
    ("step_rar", dict(key_steps=[]), "step_rar: example 'bad' has no key_steps"),
    ("step_rar", dict(key_steps=[["3"], []]), "key step group 1"),
    ("step_rar", dict(key_steps=[["3"], ["$ $"]]), "key step group 1"),
    ("detail", dict(intermediates=[]), "detail: example 'bad' has no intermediates"),
    ("detail", dict(difficulty=None), "difficulty None"),
    ("detail", dict(intermediates=[Intermediate("x", "three")]), "not numbers"),
    ("rubric", dict(rubrics=[]), "rubric: example 'bad' has no rubrics"),
    ("correctness", dict(answer=""), "correctness: example 'bad' has gold answer ''"),
    ("correctness", dict(answer="B"), "not a number"),
    ("tolerance", dict(precision=-1), "precision -1"),
])
def test_missing_supervision_is_a_clear_error(component, edit, match):
    bad = full_example("bad")
    for k, v in edit.items():
        setattr(bad, k, v)
    rm = model({component: 1.0})
    rm.validate([full_example("ok")])
    with pytest.raises(ValueError, match=match):
        rm.validate([full_example("ok"), bad])
    with pytest.raises(ValueError, match=match):  # also at call time, never a silent zero
        rm([bad], ["<SOLUTION>1</SOLUTION>"], [5])


def test_components_not_chosen_need_nothing():
    plain = Example(pid="mathvista-1", question="q", answer="12")  # MathVista row: no supervision
    rm = model(dict(PHASE_WEIGHTS["B"]), tolerance=False)
    rm.validate([plain])
    with pytest.raises(ValueError, match="step_rar"):
        model({"correctness": 1.0, "step_rar": 0.1}).validate([plain])


def test_step_rvr_needs_no_key_steps():
    plain = Example(pid="p", question="q", answer="12")
    b = model({"step_rvr": 1.0})([plain], [format_response("because", "12")], [5])
    assert b.components["step_rvr"].item() == 1.0


def test_length_and_type_errors():
    rm = model({"format": 1.0})
    ex = full_example()
    with pytest.raises(ValueError, match="2 examples for 1 completions"):
        rm([ex, ex], ["a"], [1])
    with pytest.raises(TypeError, match="must be str"):
        rm([ex], [b"bytes"], [1])
    with pytest.raises(ValueError, match="num_tokens must hold 1"):
        rm([ex], ["a"], [1, 2])
    with pytest.raises(ValueError, match="num_tokens is needed"):
        rm([ex], ["a"])
    with pytest.raises(TypeError, match="Example"):
        rm.validate([{"pid": "dict"}])


def test_num_tokens_sources(tok):
    rm = RewardModel(RewardConfig(weights={"brevity": 1.0}), max_new_tokens=4, tokenizer=tok)
    ex, text = full_example(), "a b c d e f g"
    n = len(tok.encode(text, add_special_tokens=False))
    assert n >= 4
    assert rm([ex], [text]).components["brevity"].item() == -1.0  # counted by the tokenizer: over L
    assert rm([ex], [text], torch.tensor([1])).components["brevity"].item() == 1.0  # given as a tensor
    assert rm([ex], [text], completion_ids=[[5, 6, 7]]).components["brevity"].item() == 0.5  # from the ids


# ----------------------------------------------------------------------------- weights and reporting


def test_weights_are_read_at_call_time():
    cfg = RewardConfig(weights=dict(format=1.0, correctness=1.0))
    rm = RewardModel(cfg, max_new_tokens=64)
    ex, text = full_example(), format_response("3 + 4 = 7", "3.5")
    assert rm([ex], [text], [10]).total.item() == pytest.approx(3.0)
    cfg.weights["correctness"] = 5.0  # the controller edits the config in place
    assert rm([ex], [text], [10]).total.item() == pytest.approx(7.0)
    rm.set_weights(dict(format=0.5, correctness=2.0, brevity=1.0))
    b = rm([ex], [text], [10])
    assert b.total.item() == pytest.approx(0.5 * 2 + 2.0 + 1.0) and b.weights["brevity"] == 1.0
    with pytest.raises(ConfigError):
        rm.set_weights(dict(format=-1.0))
    assert rm.weights == dict(format=0.5, correctness=2.0, brevity=1.0)  # unchanged by the bad call
    cfg.weights["bogus"] = 1.0
    with pytest.raises(ConfigError, match="bogus"):
        rm([ex], [text], [10])


def test_only_named_components_and_summary():
    rm = model(dict(format=1.0, correctness=2.0, step_rar=0.0))
    ex = full_example()
    texts = [format_response(ex.reasoning, "3.5"), format_response("hm", "4"), "junk", format_response("", "3.5")]
    b = rm([ex] * 4, texts, [10] * 4)
    assert set(b.components) == {"format", "correctness", "step_rar"}
    assert b.components["correctness"].tolist() == [1, 0, 0, 1]
    assert b.components["step_rar"].tolist() == pytest.approx([1.1, 0.0, 0.0, 1.0])
    assert b.total.tolist() == pytest.approx([4.0, 2.0, -0.5, 4.0])  # step_rar weight 0: reported, not paid
    s = b.summary()
    assert s["total/mean"] == pytest.approx(9.5 / 4)
    assert s["correctness/mean"] == 0.5 and s["correctness/frac_nonzero"] == 0.5
    assert s["step_rar/frac_nonzero"] == 0.5 and s["format/frac_nonzero"] == 1.0
    assert "rubric/veto_frac" not in s


def test_all_components_on_a_good_and_a_bad_rollout():
    rm = model(ALL)
    ex = full_example()
    good, bad = format_response(ex.reasoning, "3.5"), format_response("red bar: 3.", "7")
    b = rm([ex, ex], [good, bad], [20, 20])
    c = {k: v.tolist() for k, v in b.components.items()}
    assert c["step_rar"] == pytest.approx([1.1, 0.1 * 1 / 4])
    assert c["step_rvr"] == [1.0, 1.0]
    assert c["detail"] == pytest.approx([2.0, 2.0 * 2 / 3])  # hard + multi-hop: W = 2.0; found 3 and 7
    assert c["rubric"] == pytest.approx([1.0, -0.4])  # bad: vetoed (answered 7), pitfall rho = -4/10
    assert b.vetoed.tolist() == [False, True]


def test_arithmetic_pays_right_equations_only():
    """1 iff the reasoning writes an equation and every equation is right: a wrong sum, a mix of
    right and wrong, and a reasoning with nothing to check earn 0, whatever the answer."""
    rm = model(dict(arithmetic=1.0))
    ex = full_example()
    texts = [format_response("3 + 4 = 7. 7 / 2 = 3.5.", "3.5"), format_response("3 + 4 = 8. 8 / 2 = 4.", "4"),
             format_response("3 + 4 = 7. 7 / 2 = 3.", "3.5"), format_response("red bar: 3. blue bar: 4.", "3.5"),
             format_response("3 + 4 = 7.", "9")]
    assert rm([ex] * 5, texts, [10] * 5).components["arithmetic"].tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]


def dapo_overlong(n, L_max, L_cache):
    """DAPO's R_length (section 3.4), written from the paper's cases."""
    if n <= L_max - L_cache:
        return 0.0
    if n <= L_max:
        return ((L_max - L_cache) - n) / L_cache
    return -1.0


@pytest.mark.parametrize("L,buffer,penalty", [(10, 4, 1.0), (10, 10, 1.0), (48, 0, 1.0), (7, 1, 2.5)])
def test_overlong_is_dapos_soft_punishment(L, buffer, penalty):
    """Every length 0..L+2 against the paper's formula, times the penalty factor, weighted into
    the total; buffer 0 = a fifth of the budget (48 // 5 = 9)."""
    rm = RewardModel(RewardConfig(weights={"overlong": 2.0, "format": 0.0}, overlong_buffer=buffer,
                                  overlong_penalty=penalty), max_new_tokens=L)
    cache = buffer or L // 5
    n = list(range(L + 3))
    b = rm([full_example()] * len(n), ["x"] * len(n), n)
    want = [penalty * dapo_overlong(k, L, cache) for k in n]
    assert b.components["overlong"].tolist() == pytest.approx(want)
    assert b.total.tolist() == pytest.approx([2.0 * w for w in want])
    assert want[L - cache] == 0.0 and want[L] == -penalty and min(want) == -penalty  # 0 up to the buffer, -p at L


def test_overlong_is_off_unless_named_and_its_bad_values():
    ex = full_example()
    assert "overlong" not in model(dict(format=1.0))([ex], ["x"], [64]).components
    for kw, match in [(dict(overlong_buffer=65), r"rewards.overlong_buffer=65: .* an int in 1..64"),
                      (dict(overlong_buffer=-1), r"rewards.overlong_buffer=-1"),
                      (dict(overlong_penalty=0.0), r"rewards.overlong_penalty=0.0: give a finite number > 0"),
                      (dict(overlong_penalty=float("inf")), r"rewards.overlong_penalty=inf")]:
        with pytest.raises(ConfigError, match=match):  # refused even while no weight names it
            model(dict(format=1.0), **kw)
        cfg = phase_preset("B")
        for k, v in kw.items():
            setattr(cfg.rewards, k, v)
        cfg.sampling.max_new_tokens = 64
        with pytest.raises(ConfigError, match=match):  # and by the run's config check, before anything loads
            cfg.validate()


# ----------------------------------------------------------------------------- never raises

PIECES = ["<REASONING>", "</REASONING>", "<SOLUTION>", "</SOLUTION>", "3", "3.5", "7", "-", "1,000", "\\frac{7}{2}",
          "3 + 4", " ", "\n", "blue bar", "\u2212", "\ud800", "\x00", "é", "≥", "\U0001F600", "...", "."]
completion_st = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=40).map("".join),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
)


def _check_bounds(b, n_tokens):
    assert torch.isfinite(b.total).all()
    for name, v in b.components.items():
        lo, hi = COMPONENT_BOUNDS[name]
        assert torch.isfinite(v).all() and (v >= lo - 1e-6).all() and (v <= hi + 1e-6).all(), (name, v)
    if b.prefix is not None:
        p = b.prefix
        last = torch.tensor(n_tokens)[:, None].clamp(min=1) - 1
        assert (p.t_end >= 0).all() and (p.t_end <= last).all()
        assert torch.isfinite(p.R_ans).all() and torch.isfinite(p.s).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(completion_st, min_size=2, max_size=2), n=st.lists(st.integers(0, 200), min_size=2, max_size=2))
def test_any_string_gives_bounded_rewards(texts, n, tok):
    ex = full_example()
    for mode in ("sequence", "prefix"):
        rm = RewardModel(RewardConfig(weights=dict(ALL), tolerance=True, rubric_mode=mode), 64, tokenizer=tok)
        _check_bounds(rm([ex, ex], texts, n), n)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 400), max_size=60))
def test_any_sampled_ids_give_bounded_rewards(ids, tok):
    """Random token ids, decoded: the incremental-decode path of t_end never leaves the sequence."""
    ids = [i % len(tok) for i in ids]
    text = tok.decode(ids, skip_special_tokens=True)
    rm = RewardModel(RewardConfig(weights=dict(ALL), tolerance=True, rubric_mode="prefix"), 64, tokenizer=tok)
    ex = full_example()
    _check_bounds(rm([ex], [text], [len(ids)], [ids]), [len(ids)])


def test_huge_garbage_completion(tok):
    blob = ("<SOLUTION>" + "9" * 5000 + "</SOLUTION>\ud800\x00" + "3 + 4 = 7. é≥ " * 1500 + "<REASONING>") * 2
    assert len(blob) > 50_000  # more than ten times what L = 1024 tokens can hold
    rm = RewardModel(RewardConfig(weights=dict(ALL), tolerance=True, rubric_mode="prefix"), 64, tokenizer=tok)
    b = rm([full_example()], [blob], [10**6])
    _check_bounds(b, [10**6])
    assert b.components["finished"].item() == -1.0 and not math.isnan(b.total.item())
