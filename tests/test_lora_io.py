"""Adapter I/O: in-memory state, PEFT-format directories (checked against PEFT itself),
the bf16 merged export, and every malformed adapter we refuse."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lora import image_batch, logits, randomize_lora_B, text_batch, tiny_model

from lora import (
    LoRAConfig,
    export_merged,
    inject_lora,
    load_adapter,
    load_lora_state_dict,
    lora_modules,
    lora_state_dict,
    quantize_model_4bit,
    save_adapter,
)


def adapted_model(seed: int = 0, cfg: LoRAConfig = LoRAConfig(r=8, alpha=16)):
    """A tiny model with a non-trivial adapter (alpha != r, so scaling bugs show)."""
    model = tiny_model(seed)
    inject_lora(model, cfg, verbose=False)
    randomize_lora_B(model)
    return model


# ---------------------------------------------------------------- in-memory state
def test_lora_state_dict_roundtrip_gives_identical_logits():
    src = adapted_model()
    sd = lora_state_dict(src)
    assert len(sd) == 28 and all(k.endswith((".lora_A", ".lora_B")) for k in sd)
    dst = tiny_model()
    inject_lora(dst, LoRAConfig(r=8, alpha=16), verbose=False)
    load_lora_state_dict(dst, {k: v.clone() for k, v in sd.items()})
    batch = text_batch()
    assert torch.equal(logits(dst, batch), logits(src, batch))


def test_load_lora_state_dict_names_missing_and_wrong_shapes():
    model = adapted_model()
    sd = lora_state_dict(model)
    key = "model.language_model.layers.1.mlp.up_proj.lora_B"
    with pytest.raises(ValueError, match=r"1 missing .*up_proj\.lora_B"):
        load_lora_state_dict(model, {k: v for k, v in sd.items() if k != key})
    with pytest.raises(ValueError, match=r"1 unexpected .*'extra\.lora_A'"):
        load_lora_state_dict(model, {**sd, "extra.lora_A": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"up_proj\.lora_B has shape \(128, 4\) but .* \(128, 8\)"):
        load_lora_state_dict(model, {**sd, key: torch.zeros(128, 4)})


# ---------------------------------------------------------------- PEFT format
def test_save_adapter_writes_peft_format(tmp_path):
    model = adapted_model()
    save_adapter(model, tmp_path, base_model_name_or_path="tiny")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    key = "base_model.model.model.language_model.layers.0.self_attn.k_proj.lora_A.weight"
    assert tensors[key].shape == (8, 64) and len(tensors) == 28
    # the target regex selects exactly the adapted layers (never the vision MLP)
    import re
    names = [n for n, _ in model.named_modules()]
    chosen = {n for n in names if re.fullmatch(config["target_modules"], n)}
    assert chosen == set(lora_modules(model))


@pytest.mark.parametrize("pre_injected", [False, True])
def test_save_load_gives_identical_logits(tmp_path, pre_injected):
    src = adapted_model()
    save_adapter(src, tmp_path)
    dst = tiny_model()
    if pre_injected:
        inject_lora(dst, LoRAConfig(r=8, alpha=16), verbose=False)
    load_adapter(dst, tmp_path)  # without LoRA: injected from the file's module names
    assert list(lora_modules(dst)) == list(lora_modules(src))
    for batch in (text_batch(), image_batch()):
        assert torch.equal(logits(dst, batch), logits(src, batch))


def test_adapter_saved_here_loads_in_peft(tmp_path):
    peft = pytest.importorskip("peft")
    src = adapted_model()
    save_adapter(src, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(tiny_model(), str(tmp_path)).eval()
    peft_layer = peft_model.base_model.model.model.language_model.layers[0].self_attn.q_proj
    assert peft_layer.scaling["default"] == 2.0  # alpha / r read from our config
    n_peft = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert n_peft == len(lora_modules(src))  # PEFT adapted exactly our layers
    for batch in (text_batch(), image_batch()):
        torch.testing.assert_close(logits(peft_model, batch), logits(src, batch), atol=1e-5, rtol=1e-5)


def test_adapter_saved_by_peft_loads_here(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"],
                          exclude_modules=r".*visual.*", init_lora_weights=False)  # random B
    peft_model = peft.get_peft_model(tiny_model(), cfg).eval()
    peft_model.save_pretrained(str(tmp_path))
    ours = tiny_model()
    load_adapter(ours, tmp_path)
    assert len(lora_modules(ours)) == 4
    batch = text_batch()
    torch.testing.assert_close(logits(ours, batch), logits(peft_model, batch), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- merged bf16 export
def test_merged_export_matches_adapted_model(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    src = adapted_model()
    export_merged(src, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    files = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in files.values())
    assert not any("lora" in k or "base_layer" in k for k in files)
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    merged.eval()
    assert lora_modules(src) and not lora_modules(merged)
    for batch in (text_batch(), image_batch()):
        want, got = logits(src, batch), logits(merged, batch)
        # every weight rounded once to bf16 (relative error <= 2^-9): logits move by well
        # under 1% of their range on this 2-layer model
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()
        assert (got - want).abs().max() > 0  # and it really is the bf16 copy


def test_merged_export_from_4bit_base_dequantises(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = tiny_model()
    quantize_model_4bit(model, verbose=False)
    inject_lora(model, LoRAConfig(r=8, alpha=16), verbose=False)
    randomize_lora_B(model)
    export_merged(model, tmp_path)
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    merged.eval()
    batch = text_batch()
    want, got = logits(model, batch), logits(merged, batch)
    # the adapted 4-bit model computes in bf16: bf16 activations + bf16 merged weights
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    # far closer than the NF4 base is to the original fp32 weights, i.e. we merged the
    # *dequantised* weights, not the originals
    original = tiny_model()
    inject_lora(original, LoRAConfig(r=8, alpha=16), verbose=False)
    randomize_lora_B(original)
    assert (got - want).abs().max() < 0.5 * (logits(original, batch) - want).abs().max()


# ---------------------------------------------------------------- malformed adapters
@pytest.fixture()
def saved(tmp_path):
    save_adapter(adapted_model(), tmp_path)
    return tmp_path


def rewrite_tensors(path, edit) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_missing_key_is_named(saved):
    key = "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"
    rewrite_tensors(saved, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=r"1 missing .*layers\.0\.mlp\.down_proj\.lora_B"):
        load_adapter(tiny_model(), saved)  # A without its B
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=8, alpha=16), verbose=False)
    with pytest.raises(ValueError, match=r"1 missing .*layers\.0\.mlp\.down_proj\.lora_B"):
        load_adapter(model, saved)


def test_mismatched_shape_is_named(saved):
    key = "base_model.model.model.language_model.layers.1.self_attn.v_proj.lora_A.weight"
    rewrite_tensors(saved, lambda t: t.__setitem__(key, torch.zeros(8, 48)))
    model = tiny_model()
    with pytest.raises(ValueError, match=r"v_proj\.lora_A has shape \(8, 48\) but .* \(8, 64\)"):
        load_adapter(model, saved)
    assert not lora_modules(model)  # checked before injecting: the model is untouched


def test_foreign_key_and_unknown_module_are_named(saved):
    head = "base_model.model.lm_head.weight"  # a full weight, not a LoRA factor
    rewrite_tensors(saved, lambda t: t.update({head: torch.zeros(2)}))
    with pytest.raises(ValueError, match=f"unexpected key '{head}'"):
        load_adapter(tiny_model(), saved)

    def retarget(t):  # factors for a module the model does not have
        t.pop(head)
        t["base_model.model.model.nope.lora_A.weight"] = torch.zeros(8, 64)
        t["base_model.model.model.nope.lora_B.weight"] = torch.zeros(64, 8)

    rewrite_tensors(saved, retarget)
    with pytest.raises(ValueError, match=r"does not have .*e\.g\. \['model\.nope'\]"):
        load_adapter(tiny_model(), saved)


def test_rank_or_alpha_mismatch_with_injected_model_is_named(saved):
    model = tiny_model()
    inject_lora(model, LoRAConfig(r=8, alpha=8), verbose=False)
    with pytest.raises(ValueError, match="lora_alpha=16 but layer .* has r=8, alpha=8"):
        load_adapter(model, saved)


def test_pickle_weights_are_refused(saved):
    (saved / "adapter_model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, saved / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"\['adapter_model.bin'\].*pickle"):
        load_adapter(tiny_model(), saved)
    with pytest.raises(ValueError, match="adapter_model.bin: it is a pickle file"):
        load_adapter(tiny_model(), saved / "adapter_model.bin")


def test_bad_config_and_paths_are_named(saved, tmp_path_factory):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_adapter(tiny_model(), saved / "nowhere")
    cfg_path = saved / "adapter_config.json"
    config = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match=r"\['use_dora'\]"):
        load_adapter(tiny_model(), saved)
    cfg_path.write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="peft_type is 'IA3'"):
        load_adapter(tiny_model(), saved)
    (saved / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    cfg_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_adapter(tiny_model(), saved)


# ---------------------------------------------------------------- adapter mode and non-finite values
def test_peft_adapter_with_dropout_loads_in_eval_mode_like_peft(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "up_proj"],
                          exclude_modules=r".*visual.*", init_lora_weights=False)
    peft.get_peft_model(tiny_model(), cfg).save_pretrained(str(tmp_path))
    reference = peft.PeftModel.from_pretrained(tiny_model(), str(tmp_path))  # inference: PEFT puts it in eval
    assert not reference.training
    ours = tiny_model()  # eval mode, as from_pretrained returns it
    load_adapter(ours, tmp_path)
    layers = lora_modules(ours)
    assert layers and not any(m.training for m in layers.values())
    assert all(isinstance(m.lora_dropout, torch.nn.Dropout) and m.lora_dropout.p == 0.05 for m in layers.values())
    batch = text_batch()
    first = logits(ours, batch)
    assert torch.equal(first, logits(ours, batch))  # no dropout: the same logits on every call
    torch.testing.assert_close(first, logits(reference, batch), atol=1e-5, rtol=1e-5)
    ours.train()  # and training mode still reaches the injected dropout
    assert all(m.lora_dropout.training for m in layers.values())


@pytest.mark.parametrize("mode", [True, False])
def test_injected_layers_take_the_parents_mode(mode):
    model = tiny_model().train(mode)
    inject_lora(model, LoRAConfig(r=2, alpha=2, dropout=0.1), verbose=False)
    assert {m.training for m in lora_modules(model).values()} == {mode}
    assert {m.lora_dropout.training for m in lora_modules(model).values()} == {mode}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_adapters_are_refused_by_tensor_name(saved, value):
    key = "base_model.model.model.language_model.layers.1.mlp.down_proj.lora_B.weight"
    rewrite_tensors(saved, lambda t: t[key].fill_(value))
    model = tiny_model()
    with pytest.raises(ValueError, match=rf"tensor '{re.escape(key)}' has 512 non-finite values \(NaN/inf\) of 512"):
        load_adapter(model, saved)
    assert not lora_modules(model)  # refused before injecting


def test_non_finite_adapter_is_never_saved(tmp_path):
    model = adapted_model()
    with torch.no_grad():
        next(iter(lora_modules(model).values())).lora_A[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"save_adapter: tensor '.*lora_A.weight' has 1 non-finite values"):
        save_adapter(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="export_merged: tensor .* non-finite"):
        export_merged(model, tmp_path / "merged")
