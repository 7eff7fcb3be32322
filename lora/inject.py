"""Put LoRA into a model by module-name patterns, freeze the rest, count, switch it off.

The staged paper's recipe: rank 8, alpha 8, adapters on the language model's attention and
MLP projections (q/k/v/o, gate/up/down), vision tower untouched. Qwen2.5-VL's vision
blocks *also* have mlp.gate_proj/up_proj/down_proj, so a leaf-name list alone would adapt
the vision tower too; exclusion therefore goes by path: nothing under `model.visual`
(transformers 5's module tree; older 4.x releases called it `visual`). On Qwen2.5-VL-7B
that is 196 layers and 20,185,088 trainable parameters (0.24% of 8.29B; 77 MiB in fp32).

Pattern semantics (deliberately small, no regexes to get wrong):
  target_modules  each entry matches a module whose dotted name equals it or ends with
                  "." + entry: "q_proj" -> every q_proj, "self_attn.q_proj" -> only those,
                  a full name -> exactly that module. Only linear layers are candidates.
  exclude_modules each entry removes a subtree: the module with that name and everything
                  below it ("model.visual" -> the whole vision tower and its merger).
Every entry must match something; a typo raises instead of silently training nothing
(or, for an exclude typo, silently adapting the vision tower).

The reference policy (GRPO's pi_ref, for the KL term) is the same model with the adapters
switched off: `with disable_adapters(model): ...` -- no second copy of a 7B base.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn

from lora.layer import LoRALinear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_EXCLUDE = ("model.visual",)


@dataclass(frozen=True)
class LoRAConfig:
    """Where and how big the adapters are (defaults: the staged paper's rank-8 LoRA)."""

    r: int = 8  # rank of B A
    alpha: float = 8.0  # update scaled by alpha / r (= 1 at the defaults)
    dropout: float = 0.0  # dropout on the LoRA branch's input only
    target_modules: tuple[str, ...] = DEFAULT_TARGETS  # dotted-suffix patterns, see module doc
    exclude_modules: tuple[str, ...] = DEFAULT_EXCLUDE  # subtrees never adapted
    lora_dtype: torch.dtype = torch.float32  # storage dtype of A and B (fp32 master weights)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"LoRA rank r must be a positive int, got r={self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got alpha={self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got dropout={self.dropout!r}")
        for field in ("target_modules", "exclude_modules"):
            value = getattr(self, field)
            if isinstance(value, str):  # ("q_proj") is a str, not a tuple: a classic slip
                raise TypeError(f"{field} must be a tuple of names, got the string {value!r}; "
                                f"write ({value!r},)")
            if any(not isinstance(p, str) or not p for p in value):
                raise ValueError(f"{field} entries must be non-empty strings, got {value!r}")
        if not self.target_modules:
            raise ValueError("target_modules is empty: nothing would be adapted")


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts; 4-bit weights count as their logical (unpacked) size."""

    trainable: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.trainable / max(self.total, 1)

    def __str__(self) -> str:
        return (f"trainable params: {self.trainable:,} || all params: {self.total:,} || "
                f"trainable%: {self.percent:.4f}")


# ---------------------------------------------------------------- matching
def _matches_target(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def find_target_names(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Names of the linear layers `cfg` selects, in module order. Raises if any target or
    exclude pattern matches nothing, or if a selected layer already carries LoRA."""
    all_names = [n for n, _ in model.named_modules()]
    for prefix in cfg.exclude_modules:
        if not any(_under(n, prefix) for n in all_names):
            raise ValueError(
                f"exclude pattern {prefix!r} matches no module; exclusion is by path prefix "
                f"(Qwen2.5-VL's vision tower is 'model.visual' in transformers 5). Pass "
                f"exclude_modules=() if there is nothing to exclude"
            )
    lora_paths = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    candidates = [
        n for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and not any(_under(n, p) for p in cfg.exclude_modules)
        # the base_layer inside an existing LoRALinear is not a separate candidate
        and not any(n.startswith(p + ".") for p in lora_paths)
    ]
    already = [n for n in lora_paths if any(_matches_target(n, p) for p in cfg.target_modules)]
    if already:
        raise ValueError(f"LoRA is already injected at {already[:3]} ({len(already)} layers); "
                         f"inject once, or load an adapter into the existing layers")
    for pattern in cfg.target_modules:
        if not any(_matches_target(n, pattern) for n in candidates):
            raise ValueError(
                f"target pattern {pattern!r} matches no linear layer outside "
                f"{list(cfg.exclude_modules)}; patterns match a dotted-name suffix, e.g. "
                f"'q_proj' or 'self_attn.q_proj'"
            )
    return [n for n in candidates if any(_matches_target(n, p) for p in cfg.target_modules)]


# ---------------------------------------------------------------- injection
def inject_lora(model: nn.Module, cfg: LoRAConfig = LoRAConfig(), verbose: bool = True) -> ParamCount:
    """Wrap every selected linear in a LoRALinear (in place), freeze everything else,
    print and return trainable / total parameter counts. Each new layer takes its
    parent's train/eval mode."""
    for name in find_target_names(model, cfg):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        # A new module starts in training mode; the one it joins may be in eval. Left like
        # that, dropout would run inside an eval-mode model (PEFT: an adapter loaded for
        # inference is in eval), and the logits would change from call to call.
        layer = LoRALinear(base, cfg.r, cfg.alpha, cfg.dropout, cfg.lora_dtype).train(parent.training)
        setattr(parent, child, layer)
    freeze_all_but_lora(model)
    count = count_parameters(model)
    if verbose:
        print(count)
    return count


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{module name: LoRALinear}; the name is the adapted layer's original path."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable tensors (A then B per layer, in module order): give these to the
    optimizer, clip their gradients, all-reduce them."""
    params: list[nn.Parameter] = []
    for m in lora_modules(model).values():
        params += [m.lora_A, m.lora_B]
    return params


def freeze_all_but_lora(model: nn.Module) -> None:
    """requires_grad only on LoRA A/B. Frozen base weights get no .grad buffers, which is
    where most of LoRA's memory saving over full fine-tuning comes from."""
    model.requires_grad_(False)
    for p in lora_parameters(model):
        p.requires_grad_(True)


def _logical_numel(p: torch.Tensor) -> int:
    # A bnb Params4bit stores two 4-bit codes per uint8; its quant_state knows the real shape.
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None:
        return int(torch.Size(quant_state.shape).numel())
    return p.numel()


def count_parameters(model: nn.Module) -> ParamCount:
    trainable = total = 0
    for p in model.parameters():
        n = _logical_numel(p)
        total += n
        trainable += n if p.requires_grad else 0
    return ParamCount(trainable=trainable, total=total)


# ---------------------------------------------------------------- reference model
@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every LoRALinear computes only its base (or base + its frozen
    reference adapter, ``freeze_reference_adapter``): the model *is* pi_ref.

    Use it under torch.no_grad() (reference log-probs need no graph). If a forward under
    this context were checkpointed and its backward ran after the context exited, the
    recomputation would see LoRA on again. Previous per-layer states are restored, so the
    context nests."""
    layers = list(lora_modules(model).values())
    if not layers:
        # With no adapters the "reference" is the policy itself and the KL term is silently 0.
        raise ValueError("disable_adapters: the model has no LoRA layers; call inject_lora first")
    previous = [m.disabled for m in layers]
    for m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for m, was in zip(layers, previous):
            m.disabled = was


def freeze_reference_adapter(model: nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> int:
    """Make the reference (what ``disable_adapters`` computes) base + a frozen adapter: by
    default a copy of the current one, or ``tensors`` ({"<module>.lora_A": ..., ...}, as
    ``lora.adapter_io.lora_state_dict`` names them; e.g. the warm-up checkpoint's on a resume).

    GRPO's KL term and every "adapters off" pass then measure against the policy RL started
    from (an SFT warm-up), not the bare base. The copy is one more adapter's bytes (buffers
    beside the parameters, never trained, not in the state dict); -> the numbers copied."""
    layers = lora_modules(model)
    if not layers:
        raise ValueError("freeze_reference_adapter: the model has no LoRA layers; call inject_lora first")
    def given(name: str, m: LoRALinear) -> bool:
        """A layer the reference adapter lacks is its own zero-delta copy if it starts at B = 0
        (an adapter this phase adds, e.g. the vision tower's); anything else is a mismatch."""
        if tensors is None or f"{name}.lora_A" in tensors and f"{name}.lora_B" in tensors:
            return tensors is not None
        if bool(m.lora_B.detach().eq(0).all()):
            return False
        raise ValueError(f"freeze_reference_adapter: the reference adapter has no {name}, whose adapter is "
                         f"not zero: they were trained with other LoRA targets")

    copied = 0
    for name, m in layers.items():
        own = given(name, m)
        a = tensors[f"{name}.lora_A"] if own else m.lora_A
        b = tensors[f"{name}.lora_B"] if own else m.lora_B
        if a.shape != m.lora_A.shape or b.shape != m.lora_B.shape:
            raise ValueError(f"freeze_reference_adapter: {name}'s reference adapter is {tuple(a.shape)} / "
                             f"{tuple(b.shape)}, the policy's {tuple(m.lora_A.shape)} / {tuple(m.lora_B.shape)}")
        m.ref_A = a.detach().to(m.lora_A.device, m.lora_A.dtype, copy=True)
        m.ref_B = b.detach().to(m.lora_B.device, m.lora_B.dtype, copy=True)
        copied += a.numel() + b.numel()
    return copied


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing in the non-reentrant mode.

    Reentrant checkpointing only backpropagates into a block if one of the block's *inputs*
    requires grad; with a frozen embedding nothing does, so LoRA inside would get no
    gradient (PEFT works around it by forcing the embedding output to require grad). The
    non-reentrant implementation tracks the block's parameters and needs no such trick.
    Costs one extra forward of each decoder layer in backward; saves its activations.

    transformers plays that trick anyway: it hooks every input embedding (the text tokens' and
    the vision tower's patch embedding) so that its output requires grad. Here it only costs:
    with a frozen tower under a trained merger (lora.merger alone) the tower's blocks would run
    with grad, keep their inputs and be backpropagated through for nothing. The hooks go."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


@contextmanager
def training_mode(module: nn.Module, on: bool = True) -> Iterator[None]:
    """Run ``module`` in training mode (``on``), then give every submodule back its own mode.
    transformers checkpoints a layer only in training mode, so a pass with grad that wants
    enable_gradient_checkpointing honoured runs the layers inside this."""
    modes = [(m, m.training) for m in module.modules()]
    if on:
        module.train()
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was
