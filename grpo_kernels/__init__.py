"""Triton kernels, each beside a pure-PyTorch reference of the same math.

    grpo_loss.py        fused GRPO loss: ratio, clip, k3 KL, aggregation, d loss / d logp
    grpo_advantages.py  group z-scored advantages (multi-component, V-Rubrics prefix)
    logprob.py          selective log-softmax: token log-probs from logits or hidden states
    rms_norm.py         RMSNorm as one operator (a custom op: Triton on CUDA, the reference on CPU)
    _dispatch.py        backend switch (CUDA -> Triton, CPU -> reference), interpreter helpers

Every public function takes ``backend="auto" | "torch" | "triton"``. On a CPU the kernels
run only under the Triton interpreter, which must be chosen before a kernel module is
imported (TRITON_INTERPRET=1, or ``_dispatch.import_interpreted`` in tests).

The package is named ``grpo_kernels``, not ``kernels``: Hugging Face publishes a package
importable as ``kernels`` that transformers (>= 5.25) imports at start-up, and a second
top-level ``kernels`` in the same environment would shadow one of the two. The torch
custom-op namespace (``grpo_kernels::rms_norm``) carries the same name. Importing this
package has no side effects and imports no submodule.
"""
