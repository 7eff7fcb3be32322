"""RMSNorm as one operator: the Triton kernel (interpreter on CPU) and the custom operator
against the reference, and the reference against Qwen2's RMSNorm module.

Tolerances: the kernel sums the row's squares in another order than torch's ``mean``, so the
statistic moves by a few fp32 ulps; the output is then rounded where the reference rounds.
fp32: rtol 1e-6 (a few ulps). bf16: the same two roundings, so on a GPU the output is the
reference's or one bf16 ulp away where the fp32 value sat at a rounding boundary; the Triton
interpreter's fp32 -> bf16 cast truncates instead (as tests/test_kernels_logprob.py notes), up to
one ulp more per cast: atol = two bf16 ulps of the largest entry (2^-6 relative); on a GPU 90% of
the entries equal."""

import importlib

import pytest
import torch

from grpo_kernels._dispatch import import_interpreted

ON_GPU = torch.cuda.is_available()
rn = importlib.import_module("grpo_kernels.rms_norm") if ON_GPU else import_interpreted("grpo_kernels.rms_norm")
DEVICE = "cuda" if ON_GPU else "cpu"


def _inputs(dtype, d, rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, 1, d, generator=g)).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEVICE)
    return x, w


def test_reference_is_qwens_module():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        x, w = _inputs(dtype, 96)
        norm = Qwen2_5_VLRMSNorm(96, eps=1e-6).to(dtype).to(DEVICE)
        norm.weight.data.copy_(w)
        with torch.no_grad():
            assert torch.equal(rn.rms_norm_reference(x, w, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [96, 130])  # a ragged tile: 130 of 256
def test_kernel_equals_reference(dtype, d):
    x, w = _inputs(dtype, d)
    ref = rn.rms_norm_reference(x, w, 1e-6)
    got = rn.rms_norm(x, w, 1e-6, backend="triton")
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    else:
        two_ulps = float(ref.float().abs().max()) * 2 ** -6
        torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=two_ulps)
        if ON_GPU:  # rounds to nearest: nearly every entry equal (the interpreter truncates most)
            assert (got == ref).float().mean() > 0.9
    wrong = rn.rms_norm_reference(x, w, 1e-2)  # the check sees a wrong eps
    assert not torch.allclose(got.float(), wrong.float(), rtol=0, atol=1e-3)


def test_custom_op_is_one_operator_and_the_reference_on_cpu():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = _inputs(torch.bfloat16, 64)
    with torch.no_grad(), Record():
        got = rn.rms_norm(x, w, 1e-6)
    assert seen == ["grpo_kernels.rms_norm.default"]
    if not ON_GPU:
        assert torch.equal(got, rn.rms_norm_reference(x, w, 1e-6))


def test_bad_weight_is_one_clear_error():
    x, w = _inputs(torch.float32, 64)
    with pytest.raises(ValueError, match=r"does not match x's last dim 64"):
        rn.rms_norm(x, w.to(torch.bfloat16), 1e-6)
