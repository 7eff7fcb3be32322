"""The shuffled-image control: derangement, the paired gap, and its place in every report."""

import types

import pytest
import torch
from PIL import Image

from data.schema import Example
from eval.blind import BlindGap, ControlUnavailable, blind_gap, shuffle_images
from eval.report import gap_warning, render_markdown
from eval.results import EvalProtocol
from grpo.evaluation.model_eval import evaluate_model

R, S = "<REASONING>r</REASONING>", "<SOLUTION>{}</SOLUTION>"


def picture(value: str) -> Image.Image:
    """An image that 'shows' a number: the fake models below read it from .info."""
    img = Image.new("RGB", (8, 8))
    img.info["shows"] = value
    return img


def example(pid: str, answer: str, family: str, context: str = "synthetic scene") -> Example:
    return Example(pid=pid, question=f"q{pid}", answer=answer, image=picture(answer),
                   metadata={"family": family, "context": context, "skills": ["arithmetic reasoning"],
                             "language": "english"})


def test_shuffle_is_a_derangement_within_each_family_and_deterministic():
    exs = [example(str(i), str(i), "a" if i < 4 else "b") for i in range(7)]
    out = shuffle_images(exs)
    assert [e.pid for e in out] == [e.pid for e in exs]  # same prompts, same order
    for orig, sh in zip(exs, out):
        assert sh.image is not orig.image  # nobody keeps their own image
        assert sh.image.info["shows"] in ({"0", "1", "2", "3"} if orig.metadata["family"] == "a" else {"4", "5", "6"})
        assert orig.image.info["shows"] == orig.answer  # the originals are untouched
    assert [e.image for e in shuffle_images(exs)] == [e.image for e in out]
    assert sorted(e.image.info["shows"] for e in out) == [str(i) for i in range(7)]  # a permutation


def test_a_prompt_of_several_images_takes_all_of_another_prompts_images():
    exs = [example(str(i), str(i), "a") for i in range(3)]
    exs[1].images = [exs[1].image, picture("1b")]  # a two-image prompt between one-image ones
    out = shuffle_images(exs)
    for orig, sh in zip(exs, out):
        donor = next(e for e in exs if e.image is sh.image)
        assert donor is not orig and sh.prompt_images == donor.prompt_images
    assert sorted(len(e.prompt_images) for e in out) == [1, 1, 2] and exs[1].images[1].info["shows"] == "1b"


def test_shuffle_pools_singletons_and_refuses_fewer_than_two():
    exs = [example("0", "0", "a"), example("1", "1", "a"), example("2", "2", "lonely")]
    out = shuffle_images(exs)
    assert all(s.image is not e.image for s, e in zip(out, exs))
    two_alone = [example("0", "0", "x"), example("1", "1", "y")]
    assert [e.image.info["shows"] for e in shuffle_images(two_alone)] == ["1", "0"]
    with pytest.raises(ControlUnavailable, match="1 example.*needs at least 2"):
        shuffle_images(exs[:1])
    with pytest.raises(ControlUnavailable):
        shuffle_images([])


def test_blind_gap_is_the_paired_difference_with_its_interval():
    true = [{"pid": p, "exact": e} for p, e in [("a", 1), ("b", 1), ("c", 0), ("d", 1)]]
    shuf = [{"pid": p, "exact": e} for p, e in [("a", 0), ("b", 1), ("c", 0), ("d", 0)]]
    g = blind_gap(true, shuf)
    assert (g.n, g.exact_match, g.exact_match_shuffled, g.gap) == (4, 0.75, 0.25, 0.5)
    # d = 1, 0, 0, 1: mean .5, sd .577, half-width 1.96 * .577 / 2
    assert g.lo == pytest.approx(0.5 - 1.959964 * 0.57735 / 2, abs=1e-4)
    assert g.hi == 1.0  # 0.5 + 0.566, clipped to what a gap can be
    assert g.includes_zero and "includes 0" in gap_warning("m", g)  # 4 prompts cannot tell
    many = blind_gap(true * 5, shuf * 5)  # pids repeat: the same 4 prompts, 5 samples each
    assert many.n == 4 and many.gap == 0.5
    wide = [{"pid": str(i), "exact": 1} for i in range(20)]
    g20 = blind_gap(wide, [{"pid": str(i), "exact": int(i < 2)} for i in range(20)])
    assert g20.gap == pytest.approx(0.9) and g20.lo > 0 and gap_warning("m", g20) is None
    sub = blind_gap(true, shuf, pids={"b", "c"})
    assert (sub.n, sub.gap, sub.lo, sub.hi) == (2, 0.0, 0.0, 0.0) and sub.includes_zero
    assert "includes 0" in gap_warning("m", sub)
    # several samples per prompt: a prompt's exact rate is the mean of its samples
    g2 = blind_gap([{"pid": "a", "exact": 1}, {"pid": "a", "exact": 0}], [{"pid": "a", "exact": 0}])
    assert g2.gap == 0.5 and g2.n == 1
    assert blind_gap(true, []).n == 0


def test_blind_gap_of_pass_at_k_counts_a_prompt_once_if_any_sample_is_exact():
    # a: 1 of 3 samples exact with true images, none shuffled; b: exact both ways; c: never
    true = [{"pid": "a", "exact": e} for e in (0, 1, 0)] + [{"pid": "b", "exact": 1}] * 3 + [{"pid": "c", "exact": 0}] * 3
    shuf = [{"pid": "a", "exact": 0}] * 3 + [{"pid": "b", "exact": e} for e in (0, 0, 1)] + [{"pid": "c", "exact": 0}] * 3
    g = blind_gap(true, shuf, per_prompt="any")
    assert (g.n, g.exact_match, g.exact_match_shuffled) == (3, pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert g.gap == pytest.approx(1 / 3) and g.lo < 0 < g.hi  # d = 1, 0, 0 over 3 prompts
    mean = blind_gap(true, shuf)  # the exact rate pairs the sample means instead
    assert mean.exact_match == pytest.approx((1 / 3 + 1 + 0) / 3) and mean.exact_match_shuffled == pytest.approx(1 / 9)
    with pytest.raises(ValueError, match="per_prompt='max'"):
        blind_gap(true, shuf, per_prompt="max")


def _fake_models(monkeypatch, reads_image: bool):
    """encode_prompts/sample stand-ins: the model answers what the image shows, or the question's pid."""
    import grpo.model.load
    import grpo.model.prompts
    import grpo.rollout.sampler

    def encode_prompts(bundle, items, on_bad_image="raise"):
        obj = types.SimpleNamespace(kept=list(range(len(items))), items=list(items))
        obj.to = lambda device: obj
        return obj

    def sample(bundle, prompts, *, G, max_new_tokens, temperature, top_k, top_p, seed):
        texts = [R + S.format(e.image.info["shows"] if reads_image else e.pid) for e in prompts.items for _ in range(G)]
        n = len(texts)
        return types.SimpleNamespace(texts=texts, lengths=torch.full((n,), 5), finished=torch.ones(n, dtype=torch.bool))

    monkeypatch.setattr(grpo.model.prompts, "encode_prompts", encode_prompts)
    monkeypatch.setattr(grpo.rollout.sampler, "sample", sample)


@pytest.mark.parametrize("reads_image", [True, False])
def test_evaluate_model_reports_the_gap_overall_and_per_stage(monkeypatch, reads_image):
    _fake_models(monkeypatch, reads_image)
    exs = [example(str(i), str(i), "scene" if i % 2 else "table", "synthetic scene" if i % 2 else "table")
           for i in range(8)]
    res = evaluate_model(types.SimpleNamespace(device="cpu"), exs, EvalProtocol(batch_size=3))
    assert res.metrics["exact_match"] == 1.0  # both fakes are right with the true images
    g = res.blind_gap
    assert isinstance(g, BlindGap) and g.n == 8
    if reads_image:  # every answer follows the picture: wrong with another picture
        assert (g.exact_match_shuffled, g.gap, g.lo, g.hi) == (0.0, 1.0, 1.0, 1.0)
        assert gap_warning("reader", g) is None
    else:  # answers from the text alone: the control exposes it
        assert (g.exact_match_shuffled, g.gap) == (1.0, 0.0) and "includes 0" in gap_warning("blind", g)
    assert res.control["stage1"].n == 8 and set(res.control) == {"overall", "stage1", "stage2", "stage3"}
    flat = res.flat()
    assert flat["blind_gap"] == g.gap and flat["exact_match_shuffled"] == g.exact_match_shuffled
    md = render_markdown({"m": res}, {}, "t", "d")
    assert "Visual-reliance control" in md and "EM shuf" in md
    assert ("warning: m: the blind gap" in md) == (not reads_image)


def test_one_example_says_why_there_is_no_control(monkeypatch):
    _fake_models(monkeypatch, True)
    res = evaluate_model(types.SimpleNamespace(device="cpu"), [example("0", "0", "a")], EvalProtocol())
    assert res.control is None and "needs at least 2" in res.control_note
    assert "no control (1 example(s)" in render_markdown({"m": res}, {}, "t", "d")
    assert "blind_gap" not in res.flat()
