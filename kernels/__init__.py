"""Triton kernels, each beside a pure-PyTorch reference of the same math.

    grpo_loss.py        fused GRPO loss: ratio, clip, k3 KL, aggregation, d loss / d logp
    grpo_advantages.py  group z-scored advantages (multi-component, V-Rubrics prefix)
    logprob.py          selective log-softmax: token log-probs from logits or hidden states
    _dispatch.py        backend switch (CUDA -> Triton, CPU -> reference), interpreter helpers

Every public function takes ``backend="auto" | "torch" | "triton"``. On a CPU the kernels
run only under the Triton interpreter, which must be chosen before a kernel module is
imported (TRITON_INTERPRET=1, or ``_dispatch.import_interpreted`` in tests).

Import-time side effects: none; submodules are not imported here. (The Hugging Face hub
also has a package called ``kernels``; bitsandbytes and transformers probe for it. Ours
deliberately defines no ``get_kernel`` so that a probe fails cleanly and they fall back;
see the README.)
"""
