"""Triton kernels, each beside a pure-PyTorch reference of the same math.

    grpo_loss.py        fused GRPO loss: ratio, clip, k3 KL, aggregation, d loss / d logp
    grpo_advantages.py  group z-scored advantages (multi-component, V-Rubrics prefix)
    logprob.py          selective log-softmax: token log-probs from logits or hidden states
    rms_norm.py         RMSNorm as one operator (a custom op: Triton on CUDA, the reference on CPU)
    _dispatch.py        backend switch (CUDA -> Triton, CPU -> reference), interpreter helpers

Every public function takes ``backend="auto" | "torch" | "triton"``. On a CPU the kernels
run only under the Triton interpreter, which must be chosen before a kernel module is
imported (TRITON_INTERPRET=1, or ``_dispatch.import_interpreted`` in tests).

Import-time side effects: one check, no submodule imports. The Hugging Face hub also has a
package called ``kernels``; bitsandbytes and transformers probe for it. While it is not
installed, a probe finds this package, which deliberately defines no ``get_kernel``, fails
cleanly and falls back. When it is installed (transformers >= 5.25 requires it), transformers
reads its version from the metadata, imports ``kernels``, gets this package and fails on a
missing name deep inside ``import transformers``; so we fail first, with what to do.
"""

from importlib import metadata as _metadata


def _hub_kernels_version():
    """Version of the Hugging Face ``kernels`` distribution in this environment, or None."""
    try:
        return _metadata.version("kernels")
    except _metadata.PackageNotFoundError:
        return None


if _hub_kernels_version() is not None:
    raise ImportError(
        f"the Hugging Face 'kernels' package {_hub_kernels_version()} is installed, and this "
        "project's own top-level package is also named 'kernels', so transformers would import "
        "ours in its place; use transformers < 5.25 (pip install 'transformers<5.25'; 5.25 "
        "requires the hub package) and remove it: pip uninstall -y kernels"
    )
