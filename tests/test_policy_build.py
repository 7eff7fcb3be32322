"""Building the policy never holds the full-precision model on the device.

``build_policy`` loads on the host, quantises each linear layer on its way to the device and
only then moves the parts kept in full precision (grpo/model/policy.py). What the 7B's GPU
peak gains from that (~16 GB of bf16 not allocated) is a CUDA measurement; on a CPU these
tests pin what it depends on, with a sentinel device: "cpu:0" is the CPU to tensors, but a
distinct device to ``.to()``, so every move towards it can be told apart from the host
load (load_bundle's "cpu") and recorded with its size.
"""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from data.synthetic import generate
from grpo.model.load import load_bundle
from grpo.model.policy import build_policy
from grpo.model.prompts import encode_prompts
from grpo.presets import phase_preset
from lora import inject_lora, quantize_model_4bit
from lora.layer import is_linear4bit

DEVICE = torch.device("cpu:0")


def _cfg(load_in_4bit: bool = True):
    cfg = phase_preset("A")
    cfg.model.load_in_4bit, cfg.model.device = load_in_4bit, "cpu"
    return cfg


def _old_order(cfg, device):
    """build_policy as it was: the whole model moved to the device, then quantised there."""
    dtype = getattr(torch, cfg.model.dtype)
    bundle = load_bundle(cfg.model.name, dtype=dtype, device="cpu", seed=cfg.run.seed)
    bundle.model.to(device)
    if cfg.model.load_in_4bit:
        quantize_model_4bit(bundle.model, compute_dtype=dtype, device=device, verbose=False)
    inject_lora(bundle.model, cfg.lora.to_lora(), verbose=False)
    bundle.model.to(device)
    bundle.model.eval()
    return bundle


def _full_precision_bytes(module: torch.nn.Module) -> int:
    """Bytes of the floating-point parameters a move of ``module`` carries unquantised."""
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if p.is_floating_point() and not isinstance(p, bnb.nn.Params4bit))


@pytest.mark.parametrize("load_in_4bit", [True, False], ids=["nf4", "full"])
def test_the_new_order_builds_the_same_policy_bit_for_bit(load_in_4bit):
    cfg = _cfg(load_in_4bit)
    torch.manual_seed(0)  # LoRA's A is drawn from the global RNG: both builds draw the same
    new = build_policy(cfg, "cpu", verbose=False)
    torch.manual_seed(0)
    old = _old_order(cfg, "cpu")
    sd_new, sd_old = new.model.state_dict(), old.model.state_dict()
    assert list(sd_new) == list(sd_old)  # NF4 codes, absmax, quant-state tables, LoRA, the rest
    for k in sd_new:
        assert torch.equal(sd_new[k], sd_old[k]), k
    with torch.no_grad():  # a non-zero LoRA B, the same in both, so the adapter's path is compared too
        for m in (new.model, old.model):
            torch.manual_seed(1)
            for n, p in sorted(m.named_parameters()):
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        prompts = encode_prompts(new, generate("train", 1, 2, seed=0))
        a = torch.log_softmax(new.model(**prompts.model_inputs()).logits, -1)
        b = torch.log_softmax(old.model(**prompts.model_inputs()).logits, -1)
    assert torch.equal(a, b)


def _record_moves(monkeypatch) -> list[tuple[str, int]]:
    """Patch Module.to and bitsandbytes' quantise-on-move to log every transfer to DEVICE:
    ("move", full-precision bytes a Module.to carries) and ("quantise", bytes of the one
    layer's full-precision weight that crosses to be quantised there)."""
    events: list[tuple[str, int]] = []
    module_to, quantise = torch.nn.Module.to, bnb.nn.Params4bit._quantize

    def to(self, *args, **kwargs):
        if torch._C._nn._parse_to(*args, **kwargs)[0] == DEVICE:
            events.append(("move", _full_precision_bytes(self)))
        return module_to(self, *args, **kwargs)

    def quantise_on(self, device):
        if torch.device(device) == DEVICE:
            events.append(("quantise", self.data.numel() * self.data.element_size()))
        return quantise(self, device)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    monkeypatch.setattr(bnb.nn.Params4bit, "_quantize", quantise_on)
    return events


def test_no_move_to_the_device_carries_the_full_precision_linears(monkeypatch):
    """Every linear layer crosses alone, to be quantised on the device; every whole-module
    move comes after the last of them and carries only what stays in full precision. A
    ``model.to(device)`` before quantising (what build_policy did) fails both checks: its
    move carries the linears' full-precision weights too (the next test shows it does)."""
    events = _record_moves(monkeypatch)
    bundle = build_policy(_cfg(), str(DEVICE), verbose=False)
    kinds = [k for k, _ in events]
    n_nf4 = sum(is_linear4bit(m) for m in bundle.model.modules())
    assert n_nf4 > 0 and kinds.count("quantise") == n_nf4  # one crossing per quantised layer
    assert "move" in kinds and kinds.index("move") > max(i for i, k in enumerate(kinds) if k == "quantise")
    kept = _full_precision_bytes(bundle.model)  # embeddings, norms, vision tower, lm_head, LoRA
    linears = sum(b for k, b in events if k == "quantise")
    assert max(b for k, b in events if k == "move") <= kept < kept + linears
    # the device's simulated peak: never above the NF4 model, the kept part and one layer
    nf4 = sum(p.numel() * p.element_size() for p in bundle.model.parameters() if isinstance(p, bnb.nn.Params4bit))
    peak = max(b for _, b in events) + nf4
    assert peak <= nf4 + kept + max(b for k, b in events if k == "quantise")


def test_the_check_catches_the_old_order(monkeypatch):
    """The same recording around the old order: its first move carries the whole
    full-precision model, linears included -- what the previous test's bound refuses."""
    events = _record_moves(monkeypatch)
    bundle = _old_order(_cfg(), DEVICE)
    kept = _full_precision_bytes(bundle.model)
    linears = sum(b for k, b in events if k == "quantise")
    assert events[0][0] == "move" and events[0][1] > kept
    assert events[0][1] == kept + linears - sum(p.numel() * p.element_size() for n, p in bundle.model.named_parameters()
                                                if "lora_" in n)


def test_the_4bit_report_is_printed_once(capsys):
    """build_policy prints the quantisation report itself (prefixed "4-bit base:"), so the
    quantiser's own print stays off: the console once carried the same line twice."""
    build_policy(_cfg(True), "cpu", verbose=True)
    out = capsys.readouterr().out
    assert out.count("linear layers to NF4") == 1 and "4-bit base: quantised" in out
