"""The fused decode step (decode="fused", the qwen7b preset's "auto"): LoRA's add folded into its B
matmul, q/k/v's and gate/up's A stacked, RMSNorm as one operator. Other rounding than the
reference step, so it is held to the sampler's contract, not to bit equality: greedy = generate
token for token, sampled log-probs = a full forward within the tolerance of tests/test_sampler.py."""

from __future__ import annotations

import copy

import pytest
import torch

import lora.layer
from grpo.model.load import ModelBundle
from grpo.rollout import decoder
from grpo.rollout.sampler import sample
from lora import LoRALinear, frozen_adapter_casts, fused_forward
from tests.test_sampler import _eos_bias, _full_forward, _generate_greedy, logprob_tol, prompts, sharp  # noqa: F401


@pytest.fixture(scope="module")
def with_lora(sharp):  # noqa: F811
    """The sharp tiny model with rank-4 adapters on every projection, B non-zero."""
    inject = pytest.importorskip("lora.inject")
    bundle = ModelBundle(model=copy.deepcopy(sharp.model), tokenizer=sharp.tokenizer,
                         image_processor=sharp.image_processor, source="sharp+lora")
    with torch.random.fork_rng(devices=[]):  # A's init draws from the global RNG: fix it
        torch.manual_seed(0)
        inject.inject_lora(bundle.model, inject.LoRAConfig(r=4), verbose=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in inject.lora_parameters(bundle.model):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return bundle


@pytest.fixture
def adapter_calls(monkeypatch):
    """How many projections went through the fused LoRA branch (so a test sees it ran)."""
    calls = []
    real = lora.layer._add_adapters

    def counting(modules, x, ys):
        calls.append(len(modules))
        return real(modules, x, ys)

    monkeypatch.setattr(lora.layer, "_add_adapters", counting)
    return calls


def test_fused_greedy_with_stops_equals_generate(with_lora, prompts, adapter_calls):  # noqa: F811
    handle = _eos_bias(with_lora, 3.0)
    try:
        ours = sample(with_lora, prompts, G=2, max_new_tokens=16, temperature=0, decode="fused")
        ref = _generate_greedy(with_lora, prompts, 2, 16)
    finally:
        handle.remove()
    assert adapter_calls, "the fused step did not take the fused LoRA branch"
    assert torch.equal(ours.completion_ids, ref)
    assert len(set(ours.lengths.tolist())) > 1 and ours.finished.any()  # rows stopped at different steps


def test_fused_sampled_logprobs_equal_full_forward(with_lora, prompts, adapter_calls):  # noqa: F811
    G, temperature = 3, 0.7
    out = sample(with_lora, prompts, G=G, max_new_tokens=10, temperature=temperature, top_k=50, top_p=0.9,
                 seed=0, decode="fused")
    assert adapter_calls
    logits, _ = _full_forward(with_lora, prompts, out, G)
    tol = logprob_tol(with_lora, prompts, out, G, temperature)

    def full(tau):
        return torch.log_softmax(logits / tau, -1).gather(-1, out.completion_ids[..., None]).squeeze(-1) * out.completion_mask

    torch.testing.assert_close(out.logprobs, full(temperature), rtol=0, atol=tol)
    assert (out.logprobs - full(1.03 * temperature)).abs().max() > 10 * tol  # the tolerance sees a wrong temperature


def test_auto_fuses_in_half_precision_only(with_lora):
    assert not decoder.fused_by_default(with_lora.model)  # fp32: the reference step, bit for bit
    half = copy.deepcopy(with_lora.model.model.language_model.embed_tokens).to(torch.bfloat16)
    model = type("M", (), {})()
    model.model = type("Inner", (), {})()
    model.model.language_model = type("LM", (), {"embed_tokens": half})()
    assert decoder.fused_by_default(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_equals_the_modules_to_rounding(dtype):
    """Three adapters reading one input (q/k/v): the fused form against each module's own
    forward, within a few roundings of the output's dtype; outside frozen_adapter_casts, or with
    grad, it is the modules' own forward, bit for bit."""
    g = torch.Generator().manual_seed(0)
    mods = []
    for out, alpha in ((32, 8.0), (16, 8.0), (16, 16.0)):  # the last one scales by 2
        m = LoRALinear(torch.nn.Linear(48, out, bias=True), r=8, alpha=alpha)
        with torch.no_grad():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g))
        mods.append(m.to(dtype).eval())
    x = torch.randn(5, 1, 48, generator=g).to(dtype)
    with torch.no_grad():
        ref = [m(x) for m in mods]
        assert all(torch.equal(a, b) for a, b in zip(fused_forward(mods, x), ref))  # no frozen casts: the modules
        with frozen_adapter_casts():
            got = fused_forward(mods, x)
    eps = torch.finfo(dtype).eps
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=4 * eps * float(b.abs().max()))
    lost = LoRALinear(torch.nn.Linear(48, 8), r=8, alpha=8.0).to(dtype)
    lost.lora_B.data.fill_(1.0)
    assert not torch.equal(lost(x), lost.base_layer(x))  # a check that sees a dropped adapter
    with frozen_adapter_casts():
        assert torch.equal(fused_forward([lost], x)[0], lost(x))  # grad on: the module's own forward
