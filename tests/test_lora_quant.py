"""NF4 base (bitsandbytes, on the CPU): error bound, what gets quantised, LoRA on top.

The dequantisation error bound checked here, derived from the format:

    NF4 stores w as code_i * absmax_b, code_i the nearest of 16 fixed levels in [-1, 1]
    (exact absmax_b of the 64-weight block at quantisation time). Rounding to the nearest
    level errs by at most half the widest gap between neighbouring levels:
        g4 = max_i (c_{i+1} - c_i) = 1 - 0.6962 (between -1 and -0.6962)  -> h4 = g4 / 2 = 0.1519
    Double quantisation then stores absmax_b itself as an 8-bit code (bnb's dynamic map, in
    blocks of 256, after subtracting their mean), so the absmax used at dequantisation,
    absmax_b', is off by at most h8 * absmax2, with h8 the dynamic map's worst rounding
    (half its widest gap, or the distance from +-1 to its extreme levels) and absmax2 the
    largest |absmax - mean| in that 256-block. With |code| <= 1:
        |w - code * absmax_b'| <= h4 * absmax_b + h8 * absmax2
    i.e. at most ~15% of the block's largest magnitude, plus a double-quant term of < 1%.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_lora import image_batch, lm_loss, logits, randomize_lora_B, text_batch, tiny_model
from test_sampler import prompts, sharp  # noqa: F401 (fixtures)

from lora import (
    LoRALinear,
    count_parameters,
    dequantize_weight,
    disable_adapters,
    enable_gradient_checkpointing,
    frozen_adapter_casts,
    inject_lora,
    is_linear4bit,
    lora_modules,
    lora_parameters,
    memory_report,
    quantize_linear_4bit,
    quantize_model_4bit,
)

bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402

LM_LINEARS = 2 * 7  # 2 decoder layers x (q, k, v, o, gate, up, down)


def max_rounding_error(code: torch.Tensor) -> float:
    """Worst |v - nearest level| over v in [-1, 1] for a sorted code book."""
    c = code.float().sort().values
    half_gaps = (c[1:] - c[:-1]) / 2
    return max(half_gaps.max().item(), (c[0] + 1).item(), (1 - c[-1]).item())


def linear_with(w: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


# ---------------------------------------------------------------- the error bound
@pytest.mark.parametrize("dist", ["normal", "heavy_tailed"])
def test_nf4_dequantisation_error_within_derived_bound(dist):
    g = torch.Generator().manual_seed(0)
    shape = (128, 192)  # 384 blocks of 64 -> 2 double-quant blocks of 256 (one partial)
    w = torch.randn(shape, generator=g) * 0.02
    if dist == "heavy_tailed":  # a few large outliers: the case absmax scaling suffers from
        w = w * torch.distributions.StudentT(3.0).sample(shape).abs().clamp(max=20)
    q = quantize_linear_4bit(linear_with(w), compute_dtype=torch.bfloat16)
    state = q.weight.quant_state
    assert state.quant_type == "nf4" and state.nested and state.blocksize == 64

    h4 = max_rounding_error(state.code)
    assert abs(h4 - (1 - 0.6962) / 2) < 1e-3  # the NF4 table's widest gap is at -1
    h8 = max_rounding_error(state.state2.code)

    absmax = w.reshape(-1, 64).abs().amax(dim=1)  # [blocks], exact
    absmax_deq = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    centred = (absmax - state.offset).abs()
    absmax2 = torch.stack([c.max() for c in centred.split(256)]).repeat_interleave(256)[: len(absmax)]
    assert ((absmax_deq - absmax).abs() <= h8 * absmax2 + 1e-7).all()

    err = (dequantize_weight(q) - w).abs().reshape(-1, 64)  # [blocks, 64]
    bound = (h4 * absmax + h8 * absmax2)[:, None]
    assert (err <= bound + 1e-7).all()
    # ... and the bound is tight, not vacuous: some weight comes close to it
    assert (err / bound).max() > 0.8




# ---------------------------------------------------------------- one layer: LoRA over Linear4bit
def test_lora_over_linear4bit_matches_dequantised_reference():
    g = torch.Generator().manual_seed(1)
    lin = linear_with(torch.randn(96, 128, generator=g) * 0.05, torch.randn(96, generator=g))
    layer = LoRALinear(quantize_linear_4bit(lin, compute_dtype=torch.bfloat16), r=4, alpha=8)
    with torch.no_grad():
        layer.lora_B.normal_(std=0.1)
    x = torch.randn(2, 7, 128, generator=g, requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.float32  # Linear4bit returns the input dtype
    # reference: everything in bf16 from the dequantised weight, as the layer claims to do
    bf = torch.bfloat16
    W = dequantize_weight(layer).to(bf)
    A, B = layer.lora_A.to(bf), layer.lora_B.to(bf)
    expected = (x.to(bf) @ W.t() + lin.bias.to(bf) + (x.to(bf) @ A.t() @ B.t()) * 2.0).float()
    torch.testing.assert_close(y, expected, atol=2e-2, rtol=2e-2)  # bf16 accumulation order
    y.sum().backward()  # through bnb's 4-bit matmul on the CPU
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert layer.lora_A.grad.abs().sum() > 0 and layer.base_layer.weight.grad is None
    # dx = dy W^T + LoRA term: compare to the same reference's gradient
    x_ref = x.detach().clone().requires_grad_(True)
    ((x_ref.to(bf) @ W.t() + (x_ref.to(bf) @ A.t() @ B.t()) * 2.0).float().sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=3e-2, rtol=2e-2)


# ---------------------------------------------------------------- the model
def test_quantize_model_swaps_language_model_linears_only(capsys):
    model = tiny_model()
    before = memory_report(model)
    lm_numel = sum(m.weight.numel() for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and n.startswith("model.language_model."))
    report = quantize_model_4bit(model)
    assert "quantised 14 linear layers to NF4" in capsys.readouterr().out
    assert len(report.quantized) == LM_LINEARS and not report.skipped
    assert all(n.startswith("model.language_model.layers.") for n in report.quantized)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert is_linear4bit(m) == name.startswith("model.language_model."), name
    assert type(model.lm_head) is nn.Linear and type(model.model.visual.merger.mlp[0]) is nn.Linear

    after = memory_report(model)
    assert report.memory.total == after.total  # the report carries the same accounting
    assert after.nf4_weights == lm_numel // 2  # two 4-bit codes per byte
    assert after.quant_state >= lm_numel // 64  # >= one 8-bit absmax per block of 64
    # fp32 LM linears (4 bytes/weight) became ~0.52 bytes/weight; the rest is unchanged
    saved = before.total - after.total
    assert 4 * lm_numel - saved == after.nf4_weights + after.quant_state
    # parameter count is logical: the 4-bit weights count as the weights they stand for
    assert count_parameters(model).total == count_parameters(tiny_model()).total


def test_layer_with_blocksize_incompatible_width_is_skipped_with_reason():
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 64))
    report = quantize_model_4bit(model, skip_modules=(), verbose=False)
    assert report.quantized == ["2"]
    assert "in_features=40 is not a multiple of blocksize=64" in report.skipped["0"]
    assert type(model[0]) is nn.Linear and is_linear4bit(model[2])


def test_4bit_model_with_lora_trains_on_cpu_with_checkpointing():
    model = tiny_model()
    quantize_model_4bit(model, verbose=False)
    batch, image = text_batch(), image_batch()
    base, base_image = logits(model, batch), logits(model, image)
    inject_lora(model, verbose=False)
    assert all(is_linear4bit(m.base_layer) for m in lora_modules(model).values())
    assert torch.equal(logits(model, batch), base)  # B = 0: identical to the 4-bit base
    assert torch.equal(logits(model, image), base_image)

    enable_gradient_checkpointing(model)
    model.train()
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        lm_loss(model, batch).backward()
        for n, p in model.named_parameters():
            assert (p.grad is not None) == n.endswith(("lora_A", "lora_B")), n
        opt.step()
    model.eval()
    assert (logits(model, batch) - base).abs().max() > 1e-3
    with disable_adapters(model):
        assert torch.equal(logits(model, batch), base)


def test_lora_on_4bit_gradients_match_without_checkpointing():
    model = tiny_model()
    quantize_model_4bit(model, verbose=False)
    inject_lora(model, verbose=False)
    randomize_lora_B(model)
    model.train()

    def grads():
        model.zero_grad(set_to_none=True)
        lm_loss(model, text_batch()).backward()
        return [p.grad.clone() for p in lora_parameters(model)]

    plain = grads()
    enable_gradient_checkpointing(model)
    for a, b in zip(plain, grads()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_one_code_path_on_every_cpu_eval_pass_leaves_training_gradients_unchanged():
    """The setting, not only the numbers: on a CPU without AVX512-BF16 the numbers below
    match whatever the flag says, so the flag itself is asserted too."""
    model = tiny_model()
    quantize_model_4bit(model, verbose=False)
    layers = [m for m in model.modules() if is_linear4bit(m)]
    assert layers and all(m.support_avx512bf16_for_cpu is False for m in layers)
    assert any(m.bias is not None for m in layers)  # q/k/v carry a bias: the crash case
    inject_lora(model, verbose=False)
    randomize_lora_B(model)

    def grads():
        model.train()
        model.zero_grad(set_to_none=True)
        lm_loss(model, text_batch()).backward()
        return [p.grad.clone() for p in lora_parameters(model)]

    before = grads()
    model.eval()
    with torch.no_grad():  # the checkpoint-side eval: eval mode, no-grad inputs
        logits(model, text_batch())
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    for a, b in zip(before, grads()):
        assert torch.equal(a, b)



# ---------------------------------------------------------------- one dequantisation per rollout
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [(1, 128), (8, 128), (2, 5, 128)])
def test_dequantised_forward_is_the_layers_forward_bit_for_bit(compute_dtype, double_quant, bias, rows):
    """What the decode loop runs instead of Linear4bit's forward (no grad): the same bits, for
    each way the layer can hold its weight and each batch shape; the weight is dequantised once
    and kept (a second call finds it in the cache)."""
    from lora.dequant import dequantised_forward, gemm_4bit_dequantises_whole

    g = torch.Generator().manual_seed(3)
    lin = linear_with(torch.randn(96, 128, generator=g) * 0.05, torch.randn(96, generator=g) if bias else None)
    layer = quantize_linear_4bit(lin, compute_dtype=compute_dtype, double_quant=double_quant)
    assert gemm_4bit_dequantises_whole(torch.device("cpu"))  # this bitsandbytes' CPU path: the premise
    cache = {}
    with torch.no_grad():
        for _call in (0, 1):
            x = torch.randn(*rows, generator=g)
            want, got = layer(x), dequantised_forward(layer, x, cache)
            assert got is not None and got.dtype == want.dtype == x.dtype
            assert torch.equal(got, want)
            assert len(cache) == 1  # dequantised on the first call, reused on the second
    weight = next(iter(cache.values()))
    assert weight.dtype == compute_dtype and weight.shape == (96, 128)


def test_dequantised_forward_declines_where_bitsandbytes_computes_otherwise(monkeypatch):
    """None (the caller then runs the layer itself) with grad on, for the repacked CPU layout,
    and where the device has a gemm kernel of its own; inside frozen_adapter_casts a LoRALinear
    over such a layer still gives the layer's output."""
    import lora.dequant as dequant

    g = torch.Generator().manual_seed(4)
    layer = quantize_linear_4bit(linear_with(torch.randn(32, 64, generator=g)), compute_dtype=torch.float32)
    x = torch.randn(3, 64, generator=g)
    assert dequant.dequantised_forward(layer, x, {}) is None  # grad enabled
    with torch.no_grad():
        layer.support_avx512bf16_for_cpu = True  # would repack at an eval-mode call on such a CPU
        assert dequant.dequantised_forward(layer, x, {}) is not None  # training mode: bitsandbytes does not repack
        assert dequant.dequantised_forward(layer.eval(), x, {}) is None
        layer.support_avx512bf16_for_cpu = False
        monkeypatch.setitem(dequant._GEMM_IS_DEFAULT, "cpu", False)  # a device kernel of its own
        assert dequant.dequantised_forward(layer, x, {}) is None
        wrapped = LoRALinear(layer, r=4, alpha=4)
        with frozen_adapter_casts():
            assert torch.equal(wrapped(x), layer(x))  # B = 0: the base alone


def test_the_sampler_dequantises_each_nf4_projection_once_and_samples_the_same_bits(prompts, monkeypatch):  # noqa: F811
    """The sampler's tiny model in NF4 with LoRA: a rollout's tokens and log-probs are the same
    bits with the reuse as without it (every call through Linear4bit's own forward), and the
    reuse runs: one dequantised weight per projection, each called once per decode step."""
    import lora.dequant as dequant
    from grpo.rollout.sampler import sample
    from tests.test_rollout_merged import _sharp_lora

    bundle = _sharp_lora(four_bit=True)  # the sharp tiny model in NF4 (fp32 compute) with a non-zero LoRA
    projections = sum(is_linear4bit(m) for m in bundle.model.modules())
    calls, sizes = [], []
    real = dequant.dequantised_forward

    def counting(layer, x, cache):
        out = real(layer, x, cache)
        calls.append(out is not None)
        sizes.append(len(cache))
        return out

    monkeypatch.setattr(dequant, "dequantised_forward", counting)
    steps = 6
    reused = sample(bundle, prompts, G=3, max_new_tokens=steps, temperature=1.0, seed=0, compact=False)
    assert projections and all(calls) and max(sizes) == projections
    assert len(calls) == (steps - 1) * projections  # the first token comes from the prefill
    monkeypatch.setattr(dequant, "dequantised_forward", lambda layer, x, cache: None)
    plain = sample(bundle, prompts, G=3, max_new_tokens=steps, temperature=1.0, seed=0, compact=False)
    assert torch.equal(reused.completion_ids, plain.completion_ids)
    assert torch.equal(reused.logprobs, plain.logprobs) and torch.equal(reused.filtered_logprobs, plain.filtered_logprobs)

# ---------------------------------------------------------------- bad input
def test_quantize_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="blocksize must be one of"):
        quantize_model_4bit(model, blocksize=48)
    with pytest.raises(ValueError, match="'visual' matches no module"):
        quantize_model_4bit(model, skip_modules=("visual",))
    inject_lora(model, verbose=False)
    with pytest.raises(ValueError, match="quantise the base first"):
        quantize_model_4bit(model)


def test_the_hub_kernel_notice_is_dropped_and_nothing_else():
    """bitsandbytes logs, on AVX512-BF16 CPUs, that it could not fetch a kernel through the
    hub `kernels` package (missing, or no hub to download from; the kernel it wanted serves
    only the packed layout we switch off), and in offline mode `kernels` first logs that it
    skips the publisher check. lora.quant drops those notices from those two loggers."""
    import logging

    import lora.quant  # noqa: F401 (installs the filters)

    for name, notice in [
        ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: no get_kernel"),
        ("kernels._internals.hf_hub", "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' "
                                      "because Hugging Face Hub is in offline mode."),
    ]:
        log = logging.getLogger(name)
        record = logging.LogRecord(log.name, logging.WARNING, __file__, 1, notice, None, None)
        assert not log.filter(record), name
        record.msg = "some other warning"
        assert log.filter(record), name
