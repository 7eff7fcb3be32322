"""Triton kernels, each beside a pure-PyTorch reference of the same math.

Import-time side effects: none. (The Hugging Face hub also has a package called
``kernels``; bitsandbytes and transformers probe for it. Ours deliberately defines no
``get_kernel`` so that a probe fails cleanly and they fall back; see the README.)
"""
