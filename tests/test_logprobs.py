"""Completion log-probs: equal to transformers' full forward, same gradients, vision reused, LoRA reference."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import full_row_logits

from grpo.model.load import ModelBundle, load_bundle
from grpo.model.logprobs import completion_logprobs, reference_logprobs
from grpo.model.prompt_context import build_prompt_context
from grpo.model.prompts import encode_prompts

G, T = 2, 7


def _image(seed: int, size=(112, 112)) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr)


@pytest.fixture()
def bundle():
    """A private copy of the tiny model (tests here inject LoRA and take gradients)."""
    base = load_bundle("tiny")
    return ModelBundle(model=copy.deepcopy(base.model), tokenizer=base.tokenizer,
                       image_processor=base.image_processor, source="tiny")


@pytest.fixture()
def batch(bundle):
    prompts = encode_prompts(bundle, ([_image(0), _image(1, (84, 56))], ["How many circles?", "What is the sum?"]))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2 * G, T), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # a completion that stopped early
    mask[3, 2:] = 0
    ids = ids.masked_fill(mask == 0, bundle.pad_token_id)
    return prompts, ids, mask


def _full_forward_logprobs(bundle, prompts, ids, mask, temperature=1.0):
    """transformers' own path: prompts and pixels repeated G times, plain log_softmax."""
    logits = full_row_logits(bundle, prompts, ids, mask, G) / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1) * mask


@pytest.mark.parametrize("chunk_tokens,temperature", [(1, 1.0), (3 * T, 0.7), (10_000, 1.3)])
def test_equals_full_forward(bundle, batch, chunk_tokens, temperature):
    prompts, ids, mask = batch
    ctx = build_prompt_context(bundle.model, prompts)
    with torch.no_grad():
        ours = completion_logprobs(bundle.model, ctx, ids, mask, G, temperature=temperature, chunk_tokens=chunk_tokens)
        ref = _full_forward_logprobs(bundle, prompts, ids, mask, temperature)
    assert ours.shape == (2 * G, T) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)
    assert (ours[mask == 0] == 0).all()


def test_gradients_equal_full_forward(bundle, batch):
    """Same gradients on the language model as the full forward (vision frozen in ours)."""
    prompts, ids, mask = batch
    model = bundle.model
    model.model.visual.requires_grad_(False)
    names = ["lm_head.weight", "model.language_model.layers.1.mlp.up_proj.weight",
             "model.language_model.layers.0.self_attn.k_proj.weight"]
    params = dict(model.named_parameters())
    weights = torch.randn(2 * G, T, generator=torch.Generator().manual_seed(1))  # a loss with per-token weights

    ctx = build_prompt_context(model, prompts)
    (completion_logprobs(model, ctx, ids, mask, G) * weights).sum().backward()
    ours = {n: params[n].grad.clone() for n in names}
    model.zero_grad(set_to_none=True)
    (_full_forward_logprobs(bundle, prompts, ids, mask) * weights).sum().backward()
    for n in names:
        torch.testing.assert_close(ours[n], params[n].grad, rtol=1e-4, atol=1e-6)
        assert ours[n].abs().sum() > 0


def test_vision_tower_runs_once_per_prompt(bundle, batch):
    from grpo.rollout.sampler import sample

    prompts, ids, mask = batch
    calls = []
    handle = bundle.model.model.visual.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    try:
        out = sample(bundle, prompts, G=4, max_new_tokens=3, seed=0)
        assert calls == [prompts.pixel_values.shape[0]]  # one call over the B images, not B*G
        completion_logprobs(bundle.model, out.context, out.completion_ids, out.completion_mask, 4)
        reference_logprobs(bundle.model, out.context, out.completion_ids, out.completion_mask, 4)
        assert len(calls) == 1  # both log-prob passes reuse the sampler's features
    finally:
        handle.remove()


def test_reference_with_lora_disabled(bundle, batch):
    inject = pytest.importorskip("lora.inject")
    prompts, ids, mask = batch
    model = bundle.model
    ctx = build_prompt_context(model, prompts)
    with torch.no_grad():
        base = completion_logprobs(model, ctx, ids, mask, G)
    inject.inject_lora(model, inject.LoRAConfig(r=4), verbose=False)
    inject.freeze_all_but_lora(model)
    with torch.no_grad():  # B starts at zero; move it so the adapters change the function
        for p in inject.lora_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    policy = completion_logprobs(model, ctx, ids, mask, G)
    ref = reference_logprobs(model, ctx, ids, mask, G, ref_context=lambda: inject.disable_adapters(model))
    assert policy.requires_grad and not ref.requires_grad
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-6)
    assert (policy - base).abs().max() > 1e-3
    policy.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in inject.lora_parameters(model))


def test_bad_shapes(bundle, batch):
    prompts, ids, mask = batch
    ctx = build_prompt_context(bundle.model, prompts)
    with pytest.raises(ValueError, match=r"expected \[B\*G, T\] = \[6, T\]"):
        completion_logprobs(bundle.model, ctx, ids, mask, 3)
    with pytest.raises(ValueError, match="completion_mask"):
        completion_logprobs(bundle.model, ctx, ids, mask[:, :3], G)
    with pytest.raises(ValueError, match="G=0"):
        completion_logprobs(bundle.model, ctx, ids, mask, 0)
