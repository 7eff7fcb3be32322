"""Adapter state: in-memory dicts, PEFT-format directories, and a bf16 merged export.

Three formats, three readers:
  lora_state_dict / load_lora_state_dict
      {"<module name>.lora_A": [r, in], "<module name>.lora_B": [out, r]} -- our own names,
      for the trainer's checkpoints and for all-reducing across ranks.
  save_adapter / load_adapter  (PEFT's on-disk LoRA format, what PEFT, vLLM, TGI, ... load)
      adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules", ...}
      adapter_model.safetensors  "base_model.model.<module name>.lora_A.weight" etc.
      (the PeftModel wrapper adds "base_model.model."; the adapter name is dropped on disk.)
      `target_modules` is written as one regular expression that PEFT full-matches against
      module names and that selects exactly the layers we adapted.
  export_merged
      W' = dequant(W) + (alpha / r) B A in fp32, rounded once to bf16, saved with
      transformers' save_pretrained (so the checkpoint keys are the hub's usual ones and an
      inference engine loads it like the base). Never W_nf4 + B A re-quantised: that rounds
      the update into 16 levels per block and the merged model drifts from the trained one.

Loading refuses, with one ValueError line naming the file and the problem, anything that is
not a plain finite LoRA: a config that is not a JSON object or lacks r / lora_alpha (or
holds impossible values), tensors with NaN/inf (named), non-float tensors. Saving refuses
non-finite tensors too. Injected layers take the mode of the model they join: an adapter
loaded into an eval-mode model is in eval (PEFT's inference default), so its dropout is off.

Loading accepts safetensors only. A pickle (.bin / .pt) can run arbitrary code when
unpickled; convert it first (load with torch.load(..., weights_only=True) somewhere you
trust, save with safetensors.torch.save_file).

Simplified: one adapter, no DoRA / rsLoRA / per-module ranks (rank_pattern) / trained biases
/ modules_to_save; an adapter that uses any of these is refused by name, not misread.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn as nn

from lora.inject import LoRAConfig, inject_lora, lora_modules
from lora.layer import LoRALinear, is_linear4bit
from lora.quant import dequantize_weight

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


# ---------------------------------------------------------------- in-memory state
def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A and B of every adapted layer, keyed "<module>.lora_A" / "<module>.lora_B".
    The tensors are detached views of the parameters (no copy): clone them for a snapshot;
    an in-place all-reduce on them updates the model."""
    sd: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model).items():
        sd[f"{name}.lora_A"] = m.lora_A.detach()
        sd[f"{name}.lora_B"] = m.lora_B.detach()
    return sd


def _check_keys_and_shapes(expected: dict[str, torch.Size], got: dict[str, torch.Tensor],
                           where: str) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where}: adapter keys do not match the model's LoRA layers: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]}); was it saved from a model with other target modules?"
        )
    for key, shape in expected.items():
        if got[key].shape != shape:
            raise ValueError(f"{where}: {key} has shape {tuple(got[key].shape)} but the model "
                             f"expects {tuple(shape)} (different rank r or base model?)")


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], new_under: str | None = None) -> None:
    """Copy a `lora_state_dict` into the model's LoRA layers; keys and shapes must match
    exactly (dtype and device are converted). ``new_under``: a module path whose layers ``sd``
    may lack all of (adapters added since it was saved, e.g. the vision tower's): they keep
    their initialisation, B = 0, so the model computes what the saved adapter computed."""
    layers = lora_modules(model)
    if not layers:
        raise ValueError("load_lora_state_dict: the model has no LoRA layers; call inject_lora first")
    if new_under is not None and not any(k.startswith(new_under + ".") for k in sd):
        layers = {n: m for n, m in layers.items() if not n.startswith(new_under + ".")}
    expected = {}
    for name, m in layers.items():
        expected[f"{name}.lora_A"] = m.lora_A.shape
        expected[f"{name}.lora_B"] = m.lora_B.shape
    _check_keys_and_shapes(expected, sd, "load_lora_state_dict")
    for name, m in layers.items():
        m.lora_A.copy_(sd[f"{name}.lora_A"])
        m.lora_B.copy_(sd[f"{name}.lora_B"])


# ---------------------------------------------------------------- PEFT format: save
def _target_regex(adapted: list[str], all_names: list[str]) -> str:
    """One regex that full-matches exactly the adapted module names.

    First try the compact form with layer indices generalised (7 alternatives for the
    default targets, however many layers); if that would also match a layer we did not
    adapt (say only some layers were targeted), list the names literally instead."""
    def template(name: str) -> str:
        return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))

    compact = "|".join(sorted({template(n) for n in adapted}))
    if {n for n in all_names if re.fullmatch(compact, n)} == set(adapted):
        return compact
    return "|".join(re.escape(n) for n in adapted)


def save_adapter(model: nn.Module, directory: str | Path,
                 base_model_name_or_path: str | None = None) -> Path:
    """Write `directory`/adapter_config.json + adapter_model.safetensors in PEFT's format."""
    from safetensors.torch import save_file

    layers = lora_modules(model)
    if not layers:
        raise ValueError("save_adapter: the model has no LoRA layers; nothing to save")
    first = next(iter(layers.values()))
    if any((m.r, m.alpha) != (first.r, first.alpha) for m in layers.values()):
        raise ValueError("save_adapter: layers have different r/alpha; PEFT's config holds one")
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0

    directory = Path(directory)
    tensors = {}
    for name, m in layers.items():
        # contiguous CPU copies: safetensors writes raw buffers
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().cpu().contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().cpu().contiguous()
    bad = _nonfinite_tensor(tensors)
    if bad:
        raise ValueError(f"save_adapter: tensor {bad}; nothing was written (a NaN adapter is no model)")
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})

    config = {
        # the fields PEFT's LoraConfig and inference servers read; the rest take defaults
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.r,
        "lora_alpha": int(first.alpha) if first.alpha.is_integer() else first.alpha,
        "lora_dropout": dropout,
        "target_modules": _target_regex(list(layers), [n for n, _ in model.named_modules()]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return directory


# ---------------------------------------------------------------- PEFT format: load
def _refuse_pickles(path: Path) -> None:
    if path.is_file():
        if path.suffix in _PICKLE_SUFFIXES:
            raise ValueError(f"refusing to load {path}: it is a pickle file, which can run "
                             f"arbitrary code when loaded; convert it to safetensors")
        raise ValueError(f"{path} is a file; pass the adapter *directory* containing "
                         f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    if not path.is_dir():
        raise FileNotFoundError(f"adapter directory {path} does not exist")
    if not (path / ADAPTER_WEIGHTS).is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(f"{path} has {pickles} but no {ADAPTER_WEIGHTS}: pickle weights are "
                             f"refused (they can run arbitrary code when loaded); convert them "
                             f"to safetensors")
        raise FileNotFoundError(f"{path} has no {ADAPTER_WEIGHTS}")
    if not (path / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG}")


def _nonfinite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{key!r} has {int((~torch.isfinite(t)).sum())} non-finite values (NaN/inf) of {t.numel()}"
    return None


def _read_config(path: Path) -> dict:
    file = path / ADAPTER_CONFIG
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    except OSError as err:
        raise ValueError(f"{file} cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object with peft_type, r, "
                         "lora_alpha, ...: is it an adapter_config.json?")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {config.get('peft_type')!r}, only 'LORA' is supported")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "use_rslora": bool(config.get("use_rslora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    used = [k for k, v in unsupported.items() if v]
    if used:
        raise ValueError(f"{path}: adapter uses {used}, which this plain LoRA does not implement")
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise ValueError(f"{file} has no {key!r}")
    r, alpha, dropout = config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{file}: r={r!r}; the rank must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{file}: lora_alpha={alpha!r}; it must be a finite number > 0")
    if dropout is None:
        config["lora_dropout"] = dropout = 0.0
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{file}: lora_dropout={dropout!r}; it must be a number in [0, 1)")
    return config


def _split_peft_keys(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """PEFT keys -> our keys: base_model.model.<name>.lora_A.weight -> <name>.lora_A."""
    sd = {}
    for key, t in tensors.items():
        m = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.(lora_A|lora_B)\.weight", key)
        if m is None:
            raise ValueError(f"{path / ADAPTER_WEIGHTS}: unexpected key {key!r}; expected "
                             f"'{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight'")
        sd[f"{m.group(1)}.{m.group(2)}"] = t
    return sd


def load_adapter(model: nn.Module, directory: str | Path, verbose: bool = False) -> None:
    """Load a PEFT-format LoRA adapter into `model`.

    A model without LoRA gets it injected at exactly the modules named in the file (with the
    file's r, alpha, dropout). A model that already has LoRA must match it: same modules,
    same r and alpha, same shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory)
    _refuse_pickles(path)
    config = _read_config(path)
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except SafetensorError as err:
        raise ValueError(f"{path / ADAPTER_WEIGHTS} is not a valid safetensors file: {err}") from None
    sd = _split_peft_keys(tensors, path)
    not_float = [k for k, t in tensors.items() if not t.is_floating_point()]
    if not_float:
        raise ValueError(f"{path / ADAPTER_WEIGHTS}: tensor {not_float[0]!r} has dtype "
                         f"{tensors[not_float[0]].dtype}; LoRA factors are floating point")
    bad = _nonfinite_tensor(tensors)
    if bad:  # checked before injecting, so the model is untouched
        raise ValueError(f"{path / ADAPTER_WEIGHTS}: tensor {bad}; refusing an adapter that would make "
                         "every output NaN")
    r, alpha = config["r"], float(config["lora_alpha"])

    if not lora_modules(model):
        # Check everything against the plain base *before* injecting, so that a bad file
        # leaves the model untouched.
        names = sorted({k.rsplit(".", 1)[0] for k in sd})
        modules = dict(model.named_modules())
        absent = [n for n in names if not isinstance(modules.get(n), nn.Linear)]
        if absent:
            raise ValueError(f"{path}: adapter targets modules the model does not have (or that "
                             f"are not linear), e.g. {absent[:3]}; is it for a different base model?")
        expected = {}
        for n in names:
            expected[f"{n}.lora_A"] = torch.Size([r, modules[n].in_features])
            expected[f"{n}.lora_B"] = torch.Size([modules[n].out_features, r])
        _check_keys_and_shapes(expected, sd, str(path))
        cfg = LoRAConfig(r=r, alpha=alpha, dropout=float(config.get("lora_dropout", 0.0)),
                         target_modules=tuple(names), exclude_modules=())
        inject_lora(model, cfg, verbose=verbose)

    for name, m in lora_modules(model).items():
        if (m.r, m.alpha) != (r, alpha):
            raise ValueError(f"{path}: adapter has r={r}, lora_alpha={alpha:g} but layer {name} "
                             f"has r={m.r}, alpha={m.alpha:g}")
    try:
        load_lora_state_dict(model, sd)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


# ---------------------------------------------------------------- merged bf16 export
@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The model's state dict with LoRA folded in and every 4-bit weight dequantised, in
    `dtype`, on the CPU, under the plain (un-wrapped) module names. Each merged weight is
    computed in fp32 and rounded once; one layer at a time is dequantised on its device."""
    sd: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()  # modules whose weights we wrote ourselves
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            weight = dequantize_weight(module.base_layer) + module.delta_weight()
            bias = module.base_layer.bias
            consumed.add(name)
        elif is_linear4bit(module) and not name.endswith(".base_layer"):
            weight, bias = dequantize_weight(module), module.bias
            consumed.add(name)
        else:
            continue
        sd[f"{name}.weight"] = weight.to(dtype).cpu()
        if bias is not None:
            sd[f"{name}.bias"] = bias.detach().to(dtype).cpu()
    consumed_prefixes = tuple(n + "." for n in consumed)
    for key, t in model.state_dict().items():
        if key.startswith(consumed_prefixes):
            continue  # LoRA A/B, base_layer.*, packed 4-bit codes and their quant-state entries
        sd[key] = (t.to(dtype) if t.is_floating_point() else t).cpu()
    return sd


def export_merged(model: nn.Module, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A save_pretrained directory (config.json, model.safetensors, generation_config.json)
    of the merged model in `dtype` (bf16 by default), loadable with from_pretrained by transformers or an
    inference engine, with no LoRA or bitsandbytes at load time."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"export_merged needs a transformers PreTrainedModel, "
                        f"got {type(model).__name__}")
    directory = Path(directory)
    sd = merged_state_dict(model, dtype)
    bad = _nonfinite_tensor(sd)
    if bad:
        raise ValueError(f"export_merged: tensor {bad}; nothing was written")
    # save_pretrained writes the live model's dtype into config.json; restore ours after.
    model.save_pretrained(str(directory), state_dict=sd)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    # the sub-configs (text_config, vision_config) carry a dtype of their own: all say the same
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    for sub in config.values():
        if isinstance(sub, dict) and "dtype" in sub:
            sub["dtype"] = name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
