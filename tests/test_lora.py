"""LoRA: the layer, injection by name, freezing, the reference switch, gradient checkpointing.

All on a tiny randomly initialised Qwen2.5-VL (transformers 5 module tree): text hidden 64,
2 layers, 4 heads / 2 kv heads, MLP 128, vocab 256; vision depth 2, hidden 64.
4-bit tests live in test_lora_quant.py, adapter I/O in test_lora_io.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lora import (
    LoRAConfig,
    LoRALinear,
    count_parameters,
    disable_adapters,
    enable_gradient_checkpointing,
    find_target_names,
    freeze_reference_adapter,
    inject_lora,
    load_lora_state_dict,
    lora_modules,
    lora_parameters,
    lora_state_dict,
)

IMAGE_TOKEN, VISION_START, VISION_END = 250, 252, 253
LM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- tiny model + inputs
def tiny_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                         bos_token_id=1, eos_token_id=2,
                         # head_dim 16 -> 8 rotary frequencies split over (t, h, w)
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=64, out_hidden_size=64, num_heads=4,
                           intermediate_size=128, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=IMAGE_TOKEN, video_token_id=251,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )


def tiny_model(seed: int = 0):
    """Same seed -> same base weights, so tests can build an identical fresh base."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(tiny_config()).eval()


def text_batch(B: int = 2, T: int = 12, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, 240, (B, T), generator=g)}


def image_batch(seed: int = 2) -> dict:
    """One 56x56 image: 4x4 patches of 14 px -> 16 patch rows of 3*2*14*14 = 1176 values,
    merged 2x2 -> 4 image tokens in the prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = [5, VISION_START] + [IMAGE_TOKEN] * 4 + [VISION_END, 7, 8, 9]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "pixel_values": torch.randn(16, 1176, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "mm_token_type_ids": (input_ids == IMAGE_TOKEN).int(),  # 3-D rope positions
    }


def logits(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def randomize_lora_B(model, seed: int = 3, std: float = 0.05) -> None:
    """Zero-init B makes A's gradient zero and the adapter invisible; tests that need a
    non-trivial adapter give B random values."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(v.shape, generator=g) * std if k.endswith("lora_B") else v)
          for k, v in lora_state_dict(model).items()}
    load_lora_state_dict(model, sd)


def lm_loss(model, batch: dict) -> torch.Tensor:
    out = model(**batch)
    # next-token cross-entropy on the batch itself: any differentiable scalar would do
    return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                       batch["input_ids"][:, 1:].flatten())


# ---------------------------------------------------------------- the layer
def test_lora_linear_matches_formula_and_dtypes():
    torch.manual_seed(0)
    base = nn.Linear(24, 40).to(torch.bfloat16)
    layer = LoRALinear(base, r=4, alpha=8, lora_dtype=torch.float32)
    assert layer.scaling == 2.0 and layer.lora_A.dtype == torch.float32
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 5, 24, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 40)
    # computed in the base's dtype (bf16): A and B cast down, not x cast up
    A, B = layer.lora_A.to(torch.bfloat16), layer.lora_B.to(torch.bfloat16)
    expected = base(x) + (x @ A.t() @ B.t()) * 2.0
    torch.testing.assert_close(y, expected.detach(), atol=0, rtol=0)
    # gradients reach the fp32 masters through the cast
    y.float().sum().backward()
    assert layer.lora_A.grad.dtype == torch.float32 and layer.lora_B.grad.abs().sum() > 0


def test_dropout_only_on_lora_branch():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 16), r=2, alpha=2, dropout=0.5).train()
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer.lora_B.normal_()
        layer.disabled = True
        a, b = layer(x), layer(x)
        assert torch.equal(a, b) and torch.equal(a, layer.base_layer(x))  # base: no dropout
        layer.disabled = False
        assert not torch.equal(layer(x), layer(x))  # LoRA input dropped at random


# ---------------------------------------------------------------- injection
def test_default_injection_targets_language_model_only(capsys):
    model = tiny_model()
    total_before = count_parameters(model).total
    count = inject_lora(model)
    names = list(lora_modules(model))
    assert len(names) == 2 * 7
    assert all(n.startswith("model.language_model.layers.") for n in names)
    assert {n.rsplit(".", 1)[1] for n in names} == set(LM_TARGETS)
    # the vision MLP shares the leaf names gate/up/down_proj but is excluded by path
    vision_mlp = model.model.visual.blocks[0].mlp
    assert type(vision_mlp.gate_proj) is nn.Linear and type(model.lm_head) is nn.Linear
    # r * (in + out) per adapted layer, counted from the config, not from the model
    h, kv, f, r = 64, 32, 128, 8
    per_layer = r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + f) + (f + h))
    assert count.trainable == 2 * per_layer
    assert count.total == total_before + count.trainable
    # the same numbers PEFT prints for this model and config
    assert "trainable params: 16,384 || all params: 364,352" in capsys.readouterr().out


def test_only_lora_parameters_are_trainable():
    model = tiny_model()
    inject_lora(model, verbose=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert len(lora_parameters(model)) == len(trainable) == 28


def test_custom_patterns_select_by_suffix():
    model = tiny_model()
    cfg = LoRAConfig(target_modules=("self_attn.q_proj", "layers.1.mlp.down_proj"))
    assert find_target_names(model, cfg) == [
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.1.self_attn.q_proj",
        "model.language_model.layers.1.mlp.down_proj",
    ]
    # with no exclusion the vision MLP's gate_proj is a target too: why exclusion is by path
    names = find_target_names(model, LoRAConfig(target_modules=("gate_proj",), exclude_modules=()))
    assert "model.visual.blocks.0.mlp.gate_proj" in names


# ---------------------------------------------------------------- identity at init, reference switch
def test_zero_init_equals_base_exactly_text_and_image():
    model = tiny_model()
    text, image = text_batch(), image_batch()
    base_text, base_image = logits(model, text), logits(model, image)
    inject_lora(model, verbose=False)
    assert torch.equal(logits(model, text), base_text)
    assert torch.equal(logits(model, image), base_image)


def test_training_changes_output_and_disable_restores_base():
    model = tiny_model()
    batch = text_batch()
    base = logits(model, batch)
    base_image = logits(model, image_batch())
    inject_lora(model, verbose=False)
    model.train()
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        lm_loss(model, batch).backward()
        if step == 0:  # B = 0: only B has a gradient on the first step, A's is exactly zero
            layer = next(iter(lora_modules(model).values()))
            assert layer.lora_B.grad.abs().sum() > 0 and layer.lora_A.grad.abs().sum() == 0
        for n, p in model.named_parameters():
            assert (p.grad is not None) == n.endswith(("lora_A", "lora_B")), n
        opt.step()
    model.eval()
    adapted = logits(model, batch)
    assert (adapted - base).abs().max() > 1e-3
    with disable_adapters(model):
        assert torch.equal(logits(model, batch), base)
        assert torch.equal(logits(model, image_batch()), base_image)
    assert torch.equal(logits(model, batch), adapted)  # switched back on


def test_disable_adapters_nests_and_restores_on_error():
    model = tiny_model()
    inject_lora(model, verbose=False)
    layers = list(lora_modules(model).values())
    layers[0].disabled = True  # a layer someone switched off by hand stays off
    with pytest.raises(RuntimeError):
        with disable_adapters(model):
            with disable_adapters(model):
                assert all(m.disabled for m in layers)
            assert all(m.disabled for m in layers)
            raise RuntimeError("boom")
    assert layers[0].disabled and not any(m.disabled for m in layers[1:])


def test_a_frozen_reference_adapter_is_what_disable_adapters_computes():
    """RL from a warm-up: the reference is base + the warm-up's adapter, frozen as it was.
    Right after the copy the reference equals the policy bit for bit (the KL starts at
    exactly 0); after training it is still the old adapter's model; a state dict and the
    trainable parameters are unchanged by the copy."""
    model = tiny_model()
    inject_lora(model, verbose=False)
    randomize_lora_B(model)
    batch, image = text_batch(), image_batch()
    warm, warm_image = logits(model, batch), logits(model, image)
    keys, params = set(model.state_dict()), len(lora_parameters(model))
    assert freeze_reference_adapter(model) == sum(p.numel() for p in lora_parameters(model))
    assert set(model.state_dict()) == keys and len(lora_parameters(model)) == params
    with disable_adapters(model):
        assert torch.equal(logits(model, batch), warm) and torch.equal(logits(model, image), warm_image)
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        lm_loss(model, batch).backward()
        opt.step()
    assert (logits(model, batch) - warm).abs().max() > 1e-3  # the policy moved
    with disable_adapters(model):  # the reference did not
        assert torch.equal(logits(model, batch), warm) and torch.equal(logits(model, image), warm_image)


def test_a_reference_adapter_from_tensors_and_its_bad_input():
    model, other = tiny_model(), tiny_model()
    inject_lora(model, verbose=False)
    inject_lora(other, verbose=False)
    randomize_lora_B(other, seed=7)
    freeze_reference_adapter(model, lora_state_dict(other))  # e.g. the warm-up checkpoint's, on a resume
    with disable_adapters(model):
        assert torch.equal(logits(model, text_batch()), logits(other, text_batch()))
    first = next(iter(lora_modules(model)))
    partial = {k: v for k, v in lora_state_dict(other).items() if not k.startswith(first + ".")}
    freeze_reference_adapter(model, partial)  # a layer this phase adds, still at B = 0: its own zero delta
    randomize_lora_B(model)
    with pytest.raises(ValueError, match=f"has no {first}, whose adapter is not zero"):
        freeze_reference_adapter(model, partial)
    wrong = dict(lora_state_dict(other), **{f"{first}.lora_A": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"reference adapter is \(3, 3\)"):
        freeze_reference_adapter(model, wrong)
    with pytest.raises(ValueError, match="no LoRA layers"):
        freeze_reference_adapter(tiny_model())


# ---------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_backward_matches_plain():
    model = tiny_model()
    inject_lora(model, verbose=False)
    randomize_lora_B(model)
    batch = text_batch()

    def lora_grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        lm_loss(model, batch).backward()
        return [p.grad.clone() for p in lora_parameters(model)]

    model.train()
    plain = lora_grads()
    enable_gradient_checkpointing(model)
    assert model.model.language_model.gradient_checkpointing
    checkpointed = lora_grads()
    assert all(g.abs().sum() > 0 for g in checkpointed)  # frozen inputs, grads still arrive
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- bad input
def test_target_pattern_matching_nothing_is_named():
    model = tiny_model()
    with pytest.raises(ValueError, match="'qq_proj' matches no linear layer"):
        inject_lora(model, LoRAConfig(target_modules=("q_proj", "qq_proj")), verbose=False)
    # a vision-only pattern matches nothing once the vision tower is excluded
    with pytest.raises(ValueError, match="'attn.qkv' matches no linear layer"):
        inject_lora(model, LoRAConfig(target_modules=("attn.qkv",)), verbose=False)
    assert not lora_modules(model)  # nothing half-injected


@pytest.mark.parametrize("r", [0, -4, 2.5, True])
def test_bad_rank_is_named(r):
    with pytest.raises(ValueError, match=f"r={r!r}"):
        LoRAConfig(r=r)
    with pytest.raises(ValueError, match="positive int"):
        LoRALinear(nn.Linear(4, 4), r=r, alpha=1.0)


def test_other_bad_configs():
    with pytest.raises(ValueError, match="alpha"):
        LoRAConfig(alpha=0)
    with pytest.raises(ValueError, match="dropout"):
        LoRAConfig(dropout=1.0)
    with pytest.raises(TypeError, match=r"\('q_proj',\)"):
        LoRAConfig(target_modules="q_proj")
    model = tiny_model()
    with pytest.raises(ValueError, match="'model.vision' matches no module"):
        inject_lora(model, LoRAConfig(exclude_modules=("model.vision",)), verbose=False)
    with pytest.raises(ValueError, match="no LoRA layers"):
        with disable_adapters(model):
            pass
    inject_lora(model, verbose=False)
    with pytest.raises(ValueError, match="already injected"):
        inject_lora(model, verbose=False)
    with pytest.raises(TypeError, match="Conv2d"):
        LoRALinear(nn.Conv2d(3, 3, 1), r=2, alpha=2)


def test_frozen_adapter_casts_give_the_same_numbers_with_one_cast_per_module():
    """Inside frozen_adapter_casts a no-grad call reuses one bf16 cast of A and B (the decode loop:
    the adapter is fixed for a rollout); the output is the per-call cast's bit for bit; with grad
    on, or after the context, every call casts again (gradients reach the fp32 masters)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lora import frozen_adapter_casts

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Casts.n += func.overloadpacket.__name__ == "_to_copy"
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 8).to(torch.bfloat16), r=4, alpha=8.0)  # scaling 2: the multiply stays
    nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = layer(x)
        with frozen_adapter_casts():
            with Casts():
                outs = [layer(x) for _ in range(3)]
        assert Casts.n == 2  # A and B, once
    assert all(torch.equal(o, plain) for o in outs)
    with frozen_adapter_casts():
        layer(x).float().sum().backward()  # grad on: cast per call, gradient flows
    assert layer.lora_A.grad is not None and layer.lora_A.grad.abs().sum() > 0
