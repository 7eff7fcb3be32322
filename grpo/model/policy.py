"""Building the policy: base model (+ warm-up weights) -> optional 4-bit -> LoRA (+ adapter).

A checkpoint never stores a whole model twice. There are two kinds:

- a *base* checkpoint (``extra["kind"] == "base"``): full weights. Only the embedded tiny
  model's warm-up writes one, because that warm-up trains every weight of a randomly
  initialised model (a LoRA on a random base could not learn to see). Tensor keys are
  ``base.<parameter name>``.
- an *adapter* checkpoint (everything else): only the LoRA tensors (``*.lora_A``,
  ``*.lora_B``), plus ``extra["base"]``: the run-relative path of the base checkpoint the
  adapter was trained on (None = the configured model as loaded from disk or hub).

``load_policy`` rebuilds the policy of any checkpoint from this chain; the trainer uses it
for cross-phase warm starts and the evaluator for checkpoint selectors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grpo.config import TrainConfig
from grpo.state.contents import BASE_PREFIX, adapter_tensors, base_checkpoint_of


def load_base_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    sd = {k[len(BASE_PREFIX):]: v for k, v in tensors.items() if k.startswith(BASE_PREFIX)}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "lora_" not in k]
    if missing or unexpected:
        raise ValueError(f"base checkpoint does not fit this model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}; was it trained with another model.name?")


def check_policy_config(cfg: TrainConfig) -> None:
    """Fail before any work if the model does not resolve or a LoRA target matches nothing.

    Without this, `--lora.targets nosuch_proj` surfaced when phase A injected LoRA, after
    the whole warm-up had run.
    """
    from grpo.errors import ConfigError
    from grpo.model.load import model_skeleton
    from grpo.model.vision import vision_subtrees
    from lora.inject import find_target_names

    skeleton = model_skeleton(cfg.model.name, seed=cfg.run.seed)  # ModelLoadError: a bad model.name
    try:
        find_target_names(skeleton, cfg.lora.to_lora())
    except ValueError as err:
        raise ConfigError(f"--lora.targets {','.join(cfg.lora.targets)}: {err}") from None
    try:
        vision_subtrees(skeleton, cfg.lora)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def input_bounds(cfg: TrainConfig) -> dict[str, int]:
    """load_bundle's bounds on what enters the model, from the config (0 = the checkpoint's
    processor config for the pixel bounds, no cap for the prompt length)."""
    m = cfg.model
    return dict(max_pixels=m.max_pixels, min_pixels=m.min_pixels, max_prompt_tokens=m.max_prompt_tokens)


def build_policy(cfg: TrainConfig, device: str, base_ckpt: Path | None = None, verbose: bool = True) -> Any:
    """Model bundle with the base (from ``base_ckpt`` if given), 4-bit if configured, LoRA injected.

    The order keeps the full-precision model off the device. The weights are loaded (and a
    base checkpoint applied) on the host; with load_in_4bit each linear layer is then
    quantised on its way to ``device`` (its host copy crosses once, is quantised there and
    its device copy freed, lora/quant.py), and only then do the parts kept in full precision
    (embeddings, norms, vision tower, lm_head) move. The device so never holds more than the
    NF4 model plus one full-precision layer -- moving the whole model first would put the
    7B's ~16 GB of bf16 weights there. LoRA is injected last, on the device.
    """
    from grpo.model.load import load_bundle
    from grpo.model.vision import inject_vision_lora
    from grpo.state.checkpoint import load_checkpoint
    from lora import inject_lora

    dtype = getattr(torch, cfg.model.dtype)
    bundle = load_bundle(cfg.model.name, dtype=dtype, device="cpu", seed=cfg.run.seed, **input_bounds(cfg))
    if base_ckpt is not None:
        load_base_weights(bundle.model, load_checkpoint(base_ckpt).tensors)
    if cfg.model.load_in_4bit:
        from lora import quantize_model_4bit

        # layer by layer onto the device, then the rest (quantize_model_4bit's last move)
        report = quantize_model_4bit(bundle.model, compute_dtype=dtype, device=device, verbose=False)
        if verbose:
            print(f"4-bit base: {report}")
    else:
        bundle.model.to(device)
    inject_lora(bundle.model, cfg.lora.to_lora(), verbose=verbose)
    inject_vision_lora(bundle.model, cfg.lora, verbose=verbose)  # lora.vision / lora.merger (off: nothing)
    bundle.model.to(device)  # a guard: LoRA tensors are created beside their base layer, already there
    if cfg.model.gradient_checkpointing:
        from lora import enable_gradient_checkpointing

        enable_gradient_checkpointing(bundle.model)
    bundle.model.eval()  # no dropout: sampling and log-probs must be the same function
    return bundle


def load_policy(path: str | Path, run_dir: str | Path | None = None, device: str = "cpu") -> Any:
    """The policy a checkpoint describes (base chain + its adapter), ready to sample."""
    from grpo.overrides import from_json
    from grpo.state.checkpoint import load_checkpoint
    from lora import load_lora_state_dict

    path = Path(path)
    ckpt = load_checkpoint(path)
    run_dir = Path(run_dir) if run_dir is not None else path.parent.parent  # <run>/<phase>/step_N
    cfg = from_json(ckpt.config_json)
    bundle = build_policy(cfg, device, base_checkpoint_of(run_dir, ckpt), verbose=False)
    lora = adapter_tensors(ckpt.tensors)
    if lora:
        load_lora_state_dict(bundle.model, lora)
    return bundle


def policy_at(path: str | Path | None, cfg: TrainConfig, run_dir: str | Path, device: str = "cpu") -> Any:
    """The policy a checkpoint describes, or for ``path`` None (the selector 'base') the
    configured model as phase A starts from it: 4-bit if configured, LoRA injected at B = 0."""
    if path is None:
        return build_policy(cfg, device, verbose=False)
    return load_policy(path, run_dir=run_dir, device=device)
