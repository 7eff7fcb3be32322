"""NF4 quantisation of the base model's linear layers (QLoRA's storage format), via bitsandbytes.

Implemented: a gpt-fast-style module swap. Each selected nn.Linear becomes a
`bnb.nn.Linear4bit` holding NF4 codes (4-bit NormalFloat, QLoRA §3):

    per block of `blocksize`=64 consecutive weights (row-major, flattened):
        absmax_b = max |w| in the block
        code     = the NF4 level (16 values in [-1, 1], quantiles of N(0,1)) nearest w / absmax_b
    double quantisation: the fp32 absmax_b are themselves stored as 8-bit codes (blocks of
    256, minus their mean), 0.5 -> ~0.127 bits of statistics per weight.
    dequantised w' = code * absmax_b'; the matmul runs in `compute_dtype` (bf16).

Memory: 4 bits + ~0.127 bits of statistics per weight (8/64 + 32/(64*256)), vs 16 for bf16
(about 3.9x smaller). The error is bounded by half the largest gap between neighbouring
NF4 levels times the block's absmax (derived and checked in tests/test_lora_quant.py).
For Qwen2.5-VL-7B (arithmetic from its config, 8.29B parameters): 15.4 GiB of bf16 weights
become ~6.4 GiB = 3.04 GiB NF4 codes + 0.10 GiB statistics + 3.29 GiB kept in bf16
(embeddings, lm_head, vision tower, norms, biases).

One code path for the tiny model on a CPU and the 7B on a GPU: `device` chooses where each
layer is quantised (bitsandbytes 0.50 quantises and runs Linear4bit forward/backward on the
CPU too). For the 7B, load the bf16 model on the host and quantise onto the GPU: each
weight crosses once in bf16, is quantised there and its bf16 copy freed, so the GPU never
holds more than the 4-bit model plus one bf16 layer.

What is quantised, and why (QLoRA/bitsandbytes make the same choice for lm_head):
  - the language model's linear layers: ~80% of Qwen2.5-VL-7B's 8.3B parameters; quantised.
  - lm_head: kept. Its output *is* the logits, whose log-softmax gives the log-probs in the
    GRPO ratio and KL; NF4 error there shifts every token's log-prob directly, and it is
    only ~7% of the 7B (152k x 3584).
  - embeddings: kept. A lookup, not a matmul (Linear4bit does not apply); Qwen2.5-VL-7B
    does not tie them to lm_head.
  - vision tower (`model.visual`, incl. its merger): kept. ~0.67B parameters (~1.3 GB bf16)
    that run once per prompt (the sampler encodes each image once), and their error feeds
    every visual token of every completion. LoRA does not touch it either. (Its MLP's
    in_features 3420 is not even a multiple of 64, see the next point.)
  - any linear whose in_features is not a multiple of `blocksize`: skipped, with a reason
    recorded. bitsandbytes would quantise it (blocks then straddle rows), but its fused
    4-bit inference kernel requires in_features % blocksize == 0 and otherwise warns and
    falls back to dequantise-then-matmul. Keeping such a layer in its dtype costs memory,
    not accuracy. The 7B's language-model in_features (3584, 18944) are multiples of 64.

Not done: 8-bit, fp4 (bitsandbytes has it; NF4 is QLoRA's choice), quantising while loading
from disk (transformers' BitsAndBytesConfig does that with a lower host-memory peak; we
quantise an already-built model so the tiny and the 7B share this one path).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from lora.layer import LoRALinear, is_linear4bit


class _NoHubKernelNotice(logging.Filter):
    """Drop the notices about bitsandbytes' hub kernel ("... kernels-community ...").

    On AVX512-BF16 CPUs bitsandbytes tries, at import, to fetch a packed-4bit CPU kernel
    (kernels-community/quantization-bitsandbytes) through the Hugging Face `kernels` package.
    Where that package is missing, or the hub cannot be reached, the fetch fails and
    bitsandbytes logs that the user should install something; in offline mode (HF_HUB_OFFLINE)
    the `kernels` package first logs that it skips the publisher check. The kernel serves
    only the repacked inference layout, which every Linear4bit here switches off
    (support_avx512bf16_for_cpu = False, below), so these notices are noise on every run.
    A logger's filter sees only records logged on that logger, hence one per source.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


for _source in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_source).addFilter(_NoHubKernelNotice())

DEFAULT_SKIP = ("model.visual", "lm_head")
_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class QuantReport:
    quantized: list[str] = field(default_factory=list)  # names of layers now in NF4
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it stayed in its dtype
    memory: MemoryReport | None = None  # the quantised model's parameter memory

    def __str__(self) -> str:
        lines = [f"quantised {len(self.quantized)} linear layers to NF4"]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped.items()]
        if self.memory is not None:
            lines.append(str(self.memory))
        return "\n".join(lines)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def quantize_linear_4bit(
    linear: nn.Linear,
    compute_dtype: torch.dtype = torch.bfloat16,
    blocksize: int = 64,
    double_quant: bool = True,
    device: torch.device | str | None = None,
) -> nn.Module:
    """A bnb Linear4bit (NF4) holding `linear`'s weight, quantised on `device`."""
    import bitsandbytes as bnb  # slow import (seconds): only when quantising

    device = torch.device(device) if device is not None else linear.weight.device
    has_bias = linear.bias is not None
    # meta: skip allocating the [out, in] fp32 placeholder Linear4bit would otherwise create
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                          compute_dtype=compute_dtype, compress_statistics=double_quant,
                          quant_type="nf4", device="meta")
    # Params4bit.to(device) on an unquantised tensor is what runs bnb's quantize_4bit.
    q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, blocksize=blocksize,
                                 compress_statistics=double_quant, quant_type="nf4",
                                 module=q).to(device)
    if has_bias:
        q.bias = nn.Parameter(linear.bias.data.to(device), requires_grad=False)
    # One code path on every CPU. On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks the
    # weight at the first forward that is in eval mode with a no-grad input, and from then
    # on every forward -- training included -- takes an inference kernel (gemv_4bit) plus an
    # in-place bias add: a later forward with grad through a layer with a bias raises
    # "a view of a leaf Variable ... in-place operation", and layers without bias change
    # numerics. So a checkpoint eval would silently change the next training step, and only
    # on some machines. The attribute is read on every forward; off, the layer always
    # dequantises and multiplies, the path the tests measure everywhere.
    q.support_avx512bf16_for_cpu = False
    return q


def quantize_model_4bit(
    model: nn.Module,
    skip_modules: tuple[str, ...] = DEFAULT_SKIP,
    compute_dtype: torch.dtype = torch.bfloat16,
    blocksize: int = 64,
    double_quant: bool = True,
    device: torch.device | str | None = None,
    verbose: bool = True,
) -> QuantReport:
    """Swap every nn.Linear outside `skip_modules` for an NF4 Linear4bit, in place.
    Quantise *before* injecting LoRA. With `device` set, the rest of the model is moved
    there afterwards."""
    if blocksize not in _BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {_BLOCKSIZES} (bitsandbytes), got {blocksize}")
    if compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"compute_dtype must be bfloat16, float16 or float32, got {compute_dtype}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("quantize_model_4bit: the model already has LoRA layers; quantise the "
                         "base first, then inject_lora (LoRA weights stay in full precision)")
    names = [n for n, _ in model.named_modules()]
    for prefix in skip_modules:
        if not any(_under(n, prefix) for n in names):
            raise ValueError(f"skip pattern {prefix!r} matches no module (it is a path prefix, "
                             f"e.g. 'model.visual' or 'lm_head')")

    report = QuantReport()
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not is_linear4bit(m)]
    for name, linear in targets:
        if any(_under(name, p) for p in skip_modules):
            continue  # by design (see module doc); not listed as a surprise
        if linear.in_features % blocksize != 0:
            report.skipped[name] = (f"in_features={linear.in_features} is not a multiple of "
                                    f"blocksize={blocksize}; kept in {linear.weight.dtype}")
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantize_linear_4bit(linear, compute_dtype, blocksize,
                                                    double_quant, device))
        report.quantized.append(name)
    if device is not None:
        model.to(device)
    report.memory = memory_report(model)
    if verbose:
        print(report)
    return report


@torch.no_grad()
def dequantize_weight(linear: nn.Module) -> torch.Tensor:
    """The weight a (possibly 4-bit) linear layer actually multiplies by, fp32 [out, in]."""
    if isinstance(linear, LoRALinear):
        linear = linear.base_layer
    if not is_linear4bit(linear):
        return linear.weight.detach().float()
    import bitsandbytes.functional as F

    data, state = linear.weight.data, linear.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        # On AVX512-BF16 CPUs bnb repacks weights at the first eval forward; undo it the
        # way bnb's own state_dict does (a private helper: there is no public one).
        data, state = F._convert_weight_packed_for_cpu_inverse(data, state)
    return F.dequantize_4bit(data, state).float()



# ---------------------------------------------------------------- memory report
@dataclass
class MemoryReport:
    """Bytes of the model's parameters and buffers, by what they are."""

    nf4_weights: int = 0  # packed 4-bit codes (uint8, two per byte)
    quant_state: int = 0  # absmax (8-bit when double-quantised), second-level absmax, code tables
    lora: int = 0  # A and B
    other: dict[str, int] = field(default_factory=dict)  # everything else, by dtype
    bf16_equivalent: int = 0  # the same parameters all in bf16, for comparison

    @property
    def total(self) -> int:
        return self.nf4_weights + self.quant_state + self.lora + sum(self.other.values())

    def __str__(self) -> str:
        mb = 1 / 2**20
        rows = [("nf4 weights", self.nf4_weights), ("quant state", self.quant_state),
                ("lora", self.lora)] + [(f"other {k}", v) for k, v in sorted(self.other.items())]
        lines = [f"{'part':<22}{'MiB':>12}"] + [f"{k:<22}{v * mb:>12.3f}" for k, v in rows]
        lines.append(f"{'total':<22}{self.total * mb:>12.3f}")
        lines.append(f"{'(all in bf16)':<22}{self.bf16_equivalent * mb:>12.3f}")
        return "\n".join(lines)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _quant_state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def memory_report(model: nn.Module) -> MemoryReport:
    """Count every parameter, buffer and bnb quant-state tensor once (by storage)."""
    report = MemoryReport()
    other: dict[str, int] = defaultdict(int)
    seen: set[int] = set()

    def fresh(t: torch.Tensor) -> bool:
        key = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        if t.numel() == 0 or key in seen:
            return False
        seen.add(key)
        return True

    lora_ids = {id(p) for m in model.modules() if isinstance(m, LoRALinear)
                for p in (m.lora_A, m.lora_B)}
    for p in model.parameters():
        if not fresh(p):
            continue
        state = getattr(p, "quant_state", None)
        if state is not None:
            report.nf4_weights += _nbytes(p)
            report.bf16_equivalent += 2 * int(torch.Size(state.shape).numel())
            report.quant_state += sum(_nbytes(t) for t in _quant_state_tensors(state) if fresh(t))
            continue
        report.bf16_equivalent += 2 * p.numel()
        if id(p) in lora_ids:
            report.lora += _nbytes(p)
        else:
            other[str(p.dtype).replace("torch.", "")] += _nbytes(p)
    for b in model.buffers():
        if fresh(b):
            other[str(b.dtype).replace("torch.", "") + " buffers"] += _nbytes(b)
            report.bf16_equivalent += _nbytes(b)  # buffers (rotary tables) as they are
    report.other = dict(other)
    return report
