"""Bounds on what enters the model: image area (Qwen's max_pixels / min_pixels) and prompt length.

A real image reaches Qwen's processor at whatever size it has; the processor's resize keeps
it inside [min_pixels, max_pixels], one visual token per 28x28 px. These tests check that the
config's bounds reach the processor (load_bundle, build_policy, the presets), that an image
is resized the way Qwen's own ``smart_resize`` does and counted, that a prompt over
``model.max_prompt_tokens`` is skipped and counted, and that a training run's log line and
eval line carry the counts. All on the embedded tiny model (its processor caps at 112^2 px).
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from train_helpers import log_lines, run_main
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from data.schema import Example
from data.synthetic import generate
from grpo.config import TrainConfig
from grpo.model.load import ModelLoadError, load_bundle, set_input_bounds
from grpo.model.prompts import NoPromptsLeft, PromptCounts, encode_prompts
from grpo.overrides import apply_overrides
from grpo.presets import PRESETS
from grpo.run.records import prompts_summary


def _image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _ex(pid: str, h: int, w: int, question: str = "How many red circles are there?") -> Example:
    return Example(pid=pid, question=question, answer="3", image=_image(h, w))


@pytest.fixture(scope="module")
def tiny():
    return load_bundle("tiny")


# ----------------------------------------------------------------------------- image area


def test_an_image_above_max_pixels_is_resized_as_qwen_does_and_counted(tiny):
    max_pixels = 84 * 84  # 9 visual tokens at most
    set_input_bounds(tiny, max_pixels=max_pixels)
    try:
        big, small = _ex("big", 300, 400), _ex("small", 56, 84)
        pb = encode_prompts(tiny, [big, small])
        vis = pb.n_image_tokens.tolist()
        assert vis[0] <= max_pixels // 784 and vis[1] == 6  # 56x84 px fits: 2x3 merged tokens, untouched
        h, w = smart_resize(300, 400, 28, min_pixels=56 * 56, max_pixels=max_pixels)  # Qwen's own resize
        assert pb.image_grid_thw[0].tolist() == [1, h // 14, w // 14]
        c = pb.counts
        assert (c.prompts, c.resized_down, c.resized_up) == (2, 1, 0)
        assert (c.visual_tokens, c.visual_tokens_max) == (sum(vis), max(vis))
        assert c.tokens == int(pb.attention_mask.sum()) and c.tokens_max == pb.input_ids.shape[1]
    finally:
        set_input_bounds(tiny, max_pixels=112 * 112)


def test_min_pixels_upscales_a_small_image_and_counts_it(tiny):
    set_input_bounds(tiny, max_pixels=224 * 224, min_pixels=112 * 112)
    try:
        pb = encode_prompts(tiny, [_ex("tiny", 28, 56)])
        assert int(pb.n_image_tokens[0]) >= 112 * 112 // 784  # 2 tokens at its own size, >= 16 after
        assert (pb.counts.resized_up, pb.counts.resized_down) == (1, 0)
    finally:
        set_input_bounds(tiny, max_pixels=112 * 112, min_pixels=56 * 56)


def test_max_pixels_alone_lowers_the_processor_min_and_a_min_above_its_max_is_one_line(tiny):
    b = load_bundle("tiny", max_pixels=28 * 28)  # below the checkpoint's min (56^2): the min follows it down
    assert b.pixel_bounds == (784, 784)
    pb = encode_prompts(b, [_ex("a", 28, 28), _ex("b", 300, 300)])
    assert pb.n_image_tokens.tolist() == [1, 1]  # smart_resize would upscale the 28x28 one to 56^2 otherwise
    with pytest.raises(ModelLoadError, match=r"model.min_pixels=20000 is above the image processor's max_pixels=12544"):
        load_bundle("tiny", min_pixels=20000)


def test_defaults_leave_the_synthetic_renders_alone(tiny):
    """The tiny preset keeps the checkpoint's bounds (0): a 112-px render is 16 tokens as
    before. The qwen7b preset's 448^2 is the render size of its model.image_size: a 448-px
    render passes untouched as 256 tokens, while a larger photo is shrunk to at most 256."""
    assert "model.max_pixels" not in PRESETS["tiny"]
    q = PRESETS["qwen7b"]
    assert (q["model.max_pixels"], q["model.min_pixels"], q["model.image_size"]) == (448 * 448, 3136, 448)
    assert TrainConfig().model.max_pixels == 0 and TrainConfig().model.min_pixels == 0
    pb = encode_prompts(tiny, generate("train", 1, 2, image_size=112))
    assert pb.n_image_tokens.tolist() == [16, 16] and pb.counts.resized_down == pb.counts.resized_up == 0
    big = load_bundle("tiny", max_pixels=q["model.max_pixels"], min_pixels=q["model.min_pixels"])
    pb = encode_prompts(big, generate("train", 1, 2, image_size=q["model.image_size"]))
    assert pb.n_image_tokens.tolist() == [256, 256] and pb.counts.resized_down == 0
    photo = encode_prompts(big, [_ex("photo", 1080, 1920)])
    assert int(photo.n_image_tokens[0]) <= 256 and photo.counts.resized_down == 1


def test_build_policy_carries_the_configured_bounds():
    from grpo.model.policy import build_policy

    cfg = apply_overrides(TrainConfig(), {"model.max_pixels": 56 * 56, "model.min_pixels": 28 * 28,
                                          "model.max_prompt_tokens": 50, "model.device": "cpu"}).validate()
    bundle = build_policy(cfg, "cpu", verbose=False)
    assert bundle.pixel_bounds == (784, 3136) and bundle.max_prompt_tokens == 50


# ----------------------------------------------------------------------------- prompt length


def test_the_prompt_cap_skips_and_counts_or_raises_one_line(tiny):
    short, long_ = _ex("s", 112, 112, "How many?"), _ex("l", 112, 112, "How many red circles and blue bars are there " * 4)
    n_short = encode_prompts(tiny, [short]).input_ids.shape[1]
    n_long = encode_prompts(tiny, [long_]).input_ids.shape[1]
    assert n_long > n_short
    tiny.max_prompt_tokens = n_short  # the cap counts visual tokens too: 16 of them here
    try:
        pb = encode_prompts(tiny, [long_, short, long_], on_bad_image="skip")
        assert pb.kept == [1] and [i for i, _ in pb.skipped] == [0, 2]
        assert f"prompt of {n_long} tokens (16 visual) > max_prompt_tokens={n_short}" in pb.skipped[0][1]
        assert (pb.counts.prompts, pb.counts.skipped_long, pb.counts.skipped_image) == (1, 2, 0)
        with pytest.raises(ValueError, match=r"item 0: prompt of \d+ tokens .* raise --model.max_prompt_tokens"):
            encode_prompts(tiny, [long_, short])
        with pytest.raises(NoPromptsLeft, match="no prompt could enter the model") as e:
            encode_prompts(tiny, [long_, _ex("bad", 300, 1)], on_bad_image="skip")
        assert (e.value.counts.skipped_long, e.value.counts.skipped_image) == (1, 1)
        assert encode_prompts(tiny, [long_], max_prompt_tokens=0).kept == [0]  # the warm-up's opt-out
    finally:
        tiny.max_prompt_tokens = 0


def test_counts_add_up_over_draws_and_print_only_what_happened():
    a = PromptCounts(prompts=2, visual_tokens=30, visual_tokens_max=16, tokens=120, tokens_max=61, resized_down=1)
    b = PromptCounts(prompts=1, visual_tokens=9, visual_tokens_max=9, tokens=50, tokens_max=50, skipped_long=3)
    rec = PromptCounts().add(a).add(b).add(None).record()
    assert rec == dict(n=3, visual_tokens=13.0, visual_tokens_max=16, tokens=170 / 3, tokens_max=61,
                       resized_down=1, resized_up=0, skipped_long=3, skipped_image=0)
    assert prompts_summary(rec) == "  vis 13/16  resized down 1 up 0  skipped 3 over max_prompt_tokens, 0 bad images"
    assert prompts_summary(PromptCounts().add(a).record()) == "  vis 15/16  resized down 1 up 0"
    assert prompts_summary(None) == ""


# ----------------------------------------------------------------------------- the trainer's log


ARGS = ["--phase", "A", "--init", "base", "--model.device", "cpu", "--sampling.G", "2", "--sampling.max_new_tokens", "4",
        "--run.train_per_stage", "20", "--run.eval_size", "6", "--run.test_per_stage", "0", "--run.log_every", "1",
        "--phase.steps", "3", "--phase.prompts_per_step", "1", "--model.image_size", "224"]


def test_the_log_line_and_the_eval_line_carry_the_counts(tmp_path):
    """One prompt per step, renders at 224 px (the tiny processor shrinks them to 112^2) and a
    cap that the longer questions exceed: every step logs its visual tokens and resized image,
    draws that kept nothing are replaced and counted, and the eval skips the same prompts."""
    rc, out, err = run_main(tmp_path / "run", *ARGS, "--model.max_prompt_tokens", "57")
    assert rc == 0, err
    lines = log_lines(tmp_path / "run")
    steps = [r for r in lines if r.get("phase") == "A" and "event" not in r]
    assert len(steps) == 3
    for r in steps:
        p = r["prompts"]
        assert p["n"] == 1 and p["visual_tokens"] == p["visual_tokens_max"] == 16 and p["resized_down"] == 1
        assert p["tokens_max"] <= 57
    assert sum(r["prompts"]["skipped_long"] for r in steps) > 0  # the cap bit: this data has longer prompts
    printed = [line for line in out.splitlines() if line.startswith("[A ") and "/3]" in line]
    assert len(printed) == 3 and all("vis 16/16  resized down 1 up 0" in line for line in printed)
    assert any("over max_prompt_tokens" in line for line in printed)
    ev = [r for r in lines if r.get("event") == "eval" and r["phase"] == "A"][-1]
    assert ev["skipped"]["sampler_skipped"] > 0 and ev["metrics"]["n"] == 6 - ev["skipped"]["sampler_skipped"]
    assert "(bad image or over model.max_prompt_tokens)" in next(line for line in out.splitlines() if "eval @" in line)


def test_a_cap_no_prompt_fits_stops_with_one_line(tmp_path):
    rc, out, err = run_main(tmp_path / "run", *ARGS, "--model.max_prompt_tokens", "20")
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "phase A: 20 draws in a row kept no prompt (the last: prompt of" in err
    assert "> max_prompt_tokens=20); raise --model.max_prompt_tokens (now 20) or lower --model.max_pixels" in err
