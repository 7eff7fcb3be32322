"""The warm-up's perception supervision: labels from the renderer's marks, captions, the head.

grpo/warmup/perception.py labels every merged visual token with what the renderer drew in its
cell; these tests pin that mapping (a wrong cell or class teaches the tower the wrong
thing without any error), the captions' numbers against the examples' own parameters,
and that the perception loss reaches the vision tower through the LM's own forward.
"""

from __future__ import annotations

import re

import pytest
import torch

from data.stages import STAGES
from data.synthetic import generate
from grpo.model.load import load_bundle
from grpo.warmup.perception import (
    N_COLOUR,
    N_NUMBER,
    N_OBJECT,
    N_POS,
    PerceptionHead,
    _object_class,
    token_labels,
)
from grpo.warmup.sft import build_sft_batch, caption_batch, warmup_losses


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


def _grid(bundle, examples):
    return build_sft_batch(bundle, examples, ["x"] * len(examples))["image_grid_thw"]


def test_every_synthetic_example_has_a_caption_and_marks():
    for stage in STAGES:
        for ex in generate("train", stage, 30, seed=3):
            assert ex.caption and ex.caption.endswith("."), ex.pid
            # grid geometry and metro maps are lines and grids: nothing a cell label names
            assert ex.marks or ex.metadata.get("family") in ("grid_geometry", "metro_map"), ex.pid


def test_captions_state_what_was_drawn():
    seen = set()
    for stage in STAGES:
        for ex in generate("train", stage, 40, seed=1):
            family = ex.metadata.get("family")
            if family == "scene_count":  # "red circles: 3. blue squares: 2." counts the shapes
                stated = sum(int(n) for n in re.findall(r": (\d+)\.", ex.caption))
                assert stated == sum(m["kind"] != "number" for m in ex.marks), (ex.caption, ex.marks)
            elif family in ("table_read", "table_stats"):  # "row 1: 5, 7. row 2: ..." in raster order
                drawn = [m["text"] for m in sorted((m for m in ex.marks if m["kind"] == "number"),
                                                    key=lambda m: (round(m["y"], 2), m["x"]))]
                stated = re.findall(r"\d+(?:\.\d+)?", re.sub(r"row \d+:", "", ex.caption))
                assert stated == drawn, (ex.caption, drawn)
            elif family == "bar_chart":  # each bar's value is printed under it
                values = re.findall(r"bar: (\d+)\.", ex.caption)
                assert sorted(values) == sorted(m["text"] for m in ex.marks if m["kind"] == "number")
            else:
                continue
            seen.add(family)
    assert seen == {"scene_count", "table_read", "table_stats", "bar_chart"}


def test_token_labels_put_each_mark_in_its_cell(bundle):
    examples = generate("train", 1, 6, seed=0)
    grid = _grid(bundle, examples)
    labels = token_labels(examples, grid)
    per_image = [(h // 2) * (w // 2) for _, h, w in grid.tolist()]
    assert labels.object.shape == labels.number.shape == (sum(per_image),)
    assert labels.colour.shape == (sum(per_image), N_COLOUR)
    torch.testing.assert_close(labels.colour.sum(1), torch.ones(sum(per_image)))
    assert int(labels.object.max()) < N_OBJECT and int(labels.number.max()) < N_NUMBER
    start = 0
    for ex, (_, h, w), n in zip(examples, grid.tolist(), per_image):
        rows, cols = h // 2, w // 2
        obj, num = labels.object[start:start + n], labels.number[start:start + n]
        for m in ex.marks:
            k = min(rows - 1, int(m["y"] * rows)) * cols + min(cols - 1, int(m["x"] * cols))
            if m["kind"] == "number":
                assert num[k] == (1 + int(m["text"]) if m["text"].isdigit() else N_NUMBER - 1)
            else:
                assert obj[k] == _object_class(m)
        # raster order: token k is row k // cols, column k % cols (bucketed to N_POS)
        k = torch.arange(n)
        assert torch.equal(labels.row[start:start + n], (k // cols) * N_POS // rows)
        assert torch.equal(labels.col[start:start + n], (k % cols) * N_POS // cols)
        start += n


def test_perception_loss_reaches_the_tower_through_the_lm_forward(bundle):
    examples = generate("train", 1, 4, seed=2)
    batch = caption_batch(bundle, examples)
    head = PerceptionHead(bundle.model.config.vision_config.out_hidden_size)
    bundle.model.zero_grad(set_to_none=True)
    lm, perc = warmup_losses(bundle.model, batch, examples, head)
    assert torch.isfinite(lm) and torch.isfinite(perc) and float(perc.detach()) > 0
    perc.backward()
    tower = [p.grad for p in bundle.model.model.visual.parameters() if p.grad is not None]
    assert tower and any(float(g.abs().sum()) > 0 for g in tower)
    assert head.proj.weight.grad is not None
    lm_only, none = warmup_losses(bundle.model, batch, examples, None)
    assert none is None and torch.allclose(lm_only, lm)
    bundle.model.zero_grad(set_to_none=True)


def test_caption_batch_is_the_image_alone(bundle):
    examples = generate("train", 2, 2, seed=0)
    batch = caption_batch(bundle, examples)
    text = bundle.tokenizer.decode(batch["input_ids"][0])
    assert examples[0].question not in text
    assert examples[0].caption in text
    examples[1].caption = None
    with pytest.raises(ValueError, match="no caption.*perception_steps 0"):
        caption_batch(bundle, examples)
