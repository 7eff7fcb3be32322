"""Choosing between a Triton kernel and its PyTorch reference, and checking that choice.

Every op in ``grpo_kernels/`` has two implementations of the same math behind one function:
a compiled Triton kernel (fast, CUDA) and a plain PyTorch reference (any device, the
spec). The ``backend`` argument picks one:

    "auto"    CUDA tensors -> "triton", anything else -> "torch". The environment
              variable KERNELS_BACKEND (auto | torch | triton), read at call time,
              overrides "auto" so a whole run can be forced one way without code edits.
    "torch"   the reference, always.
    "triton"  the kernel, always. On CPU tensors this only works under the Triton
              interpreter (TRITON_INTERPRET=1), which numpy-executes the kernel one
              program at a time; slow, but it is how the kernels are tested here.

The interpreter is chosen when a kernel is *defined* (``@triton.jit`` returns an
``InterpretedFunction`` instead of a ``JITFunction`` if TRITON_INTERPRET is set), i.e. when
the kernel module is imported, not when it runs. ``check_launchable`` turns the resulting
"compiled kernel got CPU tensors" failure, otherwise a deep driver traceback, into one
clear error. Checked with triton 3.9: the interpreter accepts CPU tensors (fp32, bf16,
int, bool) directly; no copies or workarounds are needed.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" | "torch" | "triton" (+ KERNELS_BACKEND) to "torch" or "triton"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = os.environ.get("KERNELS_BACKEND", "auto").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(
                f"environment variable KERNELS_BACKEND must be one of {BACKENDS}, got {backend!r}"
            )
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    return backend


def next_pow2(x: int, lo: int = 2) -> int:
    """Smallest power of two >= max(x, lo): tl.arange sizes must be powers of two."""
    return max(lo, 1 << max(0, (x - 1).bit_length()))


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index rows by stride and the last dim by +offset: make that dim contiguous
    (no copy if it already is). bool tensors are reinterpreted as uint8 (no copy)."""
    x = x.view(torch.uint8) if x.dtype == torch.bool else x
    return x if x.stride(-1) == 1 else x.contiguous()


def is_interpreted(kernel: object) -> bool:
    """True if ``kernel`` was defined under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel: object, device: torch.device, module: str) -> None:
    """Raise one clear error if ``kernel`` cannot run on tensors of ``device``."""
    if device.type == "cuda" or is_interpreted(kernel):
        return
    raise RuntimeError(
        f"backend='triton' got {device.type} tensors, but the kernels in {module} were "
        "compiled for a GPU. To run them on a CPU, set TRITON_INTERPRET=1 before "
        f"importing {module} (the interpreter is chosen when kernels are defined), or use "
        "backend='torch'."
    )


def compile_for_gpu(
    kernel: object, constexprs: dict, types: dict | None = None, arch: int = 90,
    num_warps: int = 4,
) -> object:
    """Compile ``kernel`` ahead of time for an NVIDIA GPU (sm_``arch``), without a GPU.

    The interpreter runs kernels as numpy, so it accepts Python that the Triton compiler
    rejects (type changes in loops, unsupported ops). Compiling to a cubin with the ptxas
    bundled in the triton wheel catches those on a CPU-only machine; tests use it.
    Arguments named ``*_ptr`` default to ``*fp32``, other runtime arguments to ``i32``;
    ``types`` overrides either (e.g. ``{"beta": "fp32", "mask_ptr": "*u8"}``).
    Needs a process *without* TRITON_INTERPRET: under the interpreter even triton's own
    ``tl.max``/``tl.sum`` are interpreted functions, so tests call this in a subprocess.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if triton.knobs.runtime.interpret:
        raise RuntimeError("compile_for_gpu needs a process without TRITON_INTERPRET=1")
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    types = types or {}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def import_interpreted(module: str) -> object:
    """Import kernel module ``module`` with its kernels under the Triton interpreter (CPU tests).

    Sets TRITON_INTERPRET=1 for the rest of the process (it cannot be undone: the
    interpreter consults it while kernels run). If triton was already imported in compiled
    mode, e.g. by bitsandbytes in an earlier test file, triton's own ``tl.max``/``tl.sum``
    are compiled-only functions the interpreter cannot call, so the Python parts of triton
    and our ``grpo_kernels.*`` modules are dropped from sys.modules and imported afresh (the C
    extension ``triton._C`` is kept). Earlier importers keep their old module objects.
    """
    import importlib
    import sys

    os.environ["TRITON_INTERPRET"] = "1"
    triton_lang = sys.modules.get("triton.language.standard")
    stale = triton_lang is not None and not is_interpreted(triton_lang.max)
    loaded = sys.modules.get(module)
    if loaded is not None and not any(is_interpreted(v) for v in vars(loaded).values()):
        stale = True
    if stale:
        for name in list(sys.modules):
            if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C"):
                del sys.modules[name]
            elif name.startswith("grpo_kernels.") and name != __name__:
                del sys.modules[name]
    return importlib.import_module(module)
