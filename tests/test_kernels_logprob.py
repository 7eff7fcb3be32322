"""Selective log-softmax: Triton kernel (interpreter on CPU) vs PyTorch reference vs autograd.

Tolerance table. bf16 logits are held against the fp32 reference on the upcast same values:
the kernel accumulates in fp32 as well, so log-probs differ only by summation order; the
bf16 gradient is rounded to bf16: under one bf16 ulp, 2^-7 relative (the Triton
interpreter's fp32 -> bf16 cast truncates; a GPU rounds to nearest, 2^-8), which rtol 8e-3
covers with 2e-4 to spare, far above the fp32 summation differences (~1e-7).

    quantity          fp32 (atol, rtol)     bf16 vs fp32 gold (atol, rtol)
    log-probs         1e-5, 1e-6            1e-5, 1e-6
    d logp / d logits 1e-6, 1e-5            1e-6, 8e-3

From hidden states (chunked lm_head + kernel) against the reference on full logits
computed by the same matmul in the same dtype: log-probs as above; d hidden and d weight
fp32 (1e-5, 1e-5), bf16 (1% of the largest entry, 1e-2): the chunked path rounds each
chunk's bf16 matmul before summing where the reference rounds once.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

from grpo_kernels._dispatch import import_interpreted

ON_GPU = torch.cuda.is_available()
# On a CPU the kernels must be defined under the Triton interpreter (see import_interpreted).
lp = importlib.import_module("grpo_kernels.logprob") if ON_GPU else import_interpreted("grpo_kernels.logprob")
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: dict(fwd=(1e-5, 1e-6), grad=(1e-6, 1e-5)),
       torch.bfloat16: dict(fwd=(1e-5, 1e-6), grad=(1e-6, 8e-3))}


@pytest.fixture(autouse=True)
def small_vocab_tiles(monkeypatch):
    """64-wide vocabulary tiles so that V = 300 is 4 full tiles and a ragged tail of 44."""
    monkeypatch.setattr(lp, "_MAX_BLOCK_V", 64)


def make_logits(N: int, T: int, V: int, seed: int, dtype=torch.float32, extreme: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(N, T, V, generator=g)
    y = torch.randint(0, V, (N, T), generator=g)
    if extreme and T >= 3:
        x[0, 0] = 1e4  # all equal and huge: log p = -log V, exp overflows if not shifted
        x[0, 1] = -1e4
        x[0, 1, y[0, 1]] = 1e4  # one dominant entry: log p = 0 at the target
        k = min(70, V // 2)
        x[-1, 2, ::3] = -torch.inf  # masked vocabulary entries
        x[-1, 2, :k] = -torch.inf  # ... including a whole 64-wide tile of -inf
        y[-1, 2] = k + (1 - k) % 3  # first unmasked id (not a multiple of 3) at or after k
    return x.to(dtype).to(DEVICE), y.to(DEVICE)


def check(logits, targets, temperature=1.0):
    """Kernel on logits' dtype vs reference on the fp32 copy, values and gradients."""
    dtype = logits.dtype
    tol = TOL[dtype]
    g = torch.randn(targets.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    x_k = logits.detach().clone().requires_grad_()
    x_r = logits.detach().float().clone().requires_grad_()
    out_k = lp.token_logprobs(x_k, targets, temperature=temperature, backend="triton")
    out_r = lp.token_logprobs(x_r, targets, temperature=temperature, backend="torch")
    assert out_k.dtype == torch.float32 and out_k.shape == targets.shape
    torch.testing.assert_close(out_k, out_r, atol=tol["fwd"][0], rtol=tol["fwd"][1])
    (out_k * g).sum().backward()
    (out_r * g).sum().backward()
    assert x_k.grad.dtype == dtype
    torch.testing.assert_close(x_k.grad.float(), x_r.grad, atol=tol["grad"][0], rtol=tol["grad"][1])
    return out_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,T,V,temperature", [(3, 5, 300, 1.0), (2, 7, 50, 0.7), (1, 3, 256, 1.3)])
def test_kernel_matches_reference(N, T, V, temperature, dtype):
    logits, targets = make_logits(N, T, V, seed=V + T, dtype=dtype)
    out = check(logits, targets, temperature)
    assert torch.isfinite(out).all()
    if T >= 3:
        assert abs(out[0, 1].item()) < 1e-6  # dominant target
        assert abs(out[0, 0].item() + torch.log(torch.tensor(float(V))).item()) < 1e-4


def test_non_contiguous_slice_and_2d_input():
    """The trainer slices completion positions out of [N, prompt+T, V]: no copy needed."""
    full, targets = make_logits(2, 9, 130, seed=4)
    sliced = full[:, 2:-1, :]  # [2, 6, 130], row stride 9*130
    assert not sliced.is_contiguous()
    check(sliced, targets[:, 2:-1])
    check(full[0], targets[0])  # [M, V] -> [M]


def test_minus_inf_target_gives_minus_inf_and_finite_gradient():
    logits, targets = make_logits(1, 2, 90, seed=5, extreme=False)
    logits[0, 1, targets[0, 1]] = -torch.inf
    x = logits.clone().requires_grad_()
    out = lp.token_logprobs(x, targets, backend="triton")
    assert out[0, 1] == -torch.inf and torch.isfinite(out[0, 0])
    out[0, 0].backward()
    assert torch.isfinite(x.grad).all()


def test_forward_saves_no_vocab_sized_copy():
    """What the forward keeps for backward beyond the logits is 8 bytes per token."""
    logits, targets = make_logits(2, 4, 300, seed=6, extreme=False)
    x = logits.clone().requires_grad_()
    out = lp.token_logprobs(x, targets, backend="triton")
    extra = [t for t in out.grad_fn.saved_tensors if t.data_ptr() != x.data_ptr() and t is not None]
    extra_bytes = sum(t.numel() * t.element_size() for t in extra if t.dtype.is_floating_point)
    assert extra_bytes == 8 * targets.numel()
    assert extra_bytes <= 0.1 * x.numel() * x.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("train_weight", [True, False])
def test_from_hidden_states_matches_full_logits(dtype, train_weight):
    """Ragged chunks (10 tokens in chunks of 4); frozen lm_head gets no gradient."""
    g = torch.Generator().manual_seed(8)
    N, T, d, V = 2, 5, 16, 200
    hidden = torch.randn(N, T, d, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(V, d, generator=g) / 4).to(dtype).to(DEVICE)
    targets = torch.randint(0, V, (N, T), generator=g).to(DEVICE)
    dlogp = torch.randn(N, T, generator=g).to(DEVICE)
    res = []
    for backend in ("triton", "torch"):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(train_weight)
        out = lp.token_logprobs_from_hidden(h, w, targets, temperature=0.8, chunk_tokens=4,
                                            backend=backend)
        out.backward(dlogp)
        res.append((out, h.grad, w.grad))
    (out_k, dh_k, dw_k), (out_r, dh_r, dw_r) = res
    torch.testing.assert_close(out_k, out_r, atol=1e-5, rtol=1e-6)
    pairs = [(dh_k, dh_r)] + ([(dw_k, dw_r)] if train_weight else [])
    for got, want in pairs:
        assert got.dtype == dtype
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2 * want.abs().max().item(), 1e-2)
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    assert train_weight or dw_k is None


def test_bad_inputs_raise_clear_errors():
    logits, targets = make_logits(2, 3, 40, seed=7, extreme=False)
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        lp.token_logprobs(logits, targets.float())
    with pytest.raises(ValueError, match=r"targets has shape \(2, 2\), expected \(2, 3\)"):
        lp.token_logprobs(logits, targets[:, :2])
    bad = targets.clone()
    bad[1, 1] = 40
    with pytest.raises(ValueError, match=r"token ids in \[0, 40\)"):
        lp.token_logprobs(logits, bad, backend="triton")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        lp.token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(TypeError, match="logits must be floating point"):
        lp.token_logprobs(logits.long(), targets)
    with pytest.raises(ValueError, match=r"\[N, T, V\]"):
        lp.token_logprobs(logits[0, 0], targets[0, 0])
    hidden, weight = torch.randn(2, 3, 8, device=DEVICE), torch.randn(40, 7, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must be \[V, d\] with d = 8"):
        lp.token_logprobs_from_hidden(hidden, weight, targets)


COMPILE_SCRIPT = r"""
import grpo_kernels.logprob as lp
from grpo_kernels._dispatch import compile_for_gpu
for dtype in ("*bf16", "*fp32"):
    types = {"logits_ptr": dtype, "dlogits_ptr": dtype, "targets_ptr": "*i64", "temperature": "fp32"}
    compile_for_gpu(lp._logprob_fwd_kernel, dict(BLOCK_V=4096), types, num_warps=8)
    compile_for_gpu(lp._logprob_bwd_kernel, dict(BLOCK_V=4096), types, num_warps=8)
print("compiled")
"""


def test_kernels_compile_for_a_gpu_without_one():
    """Compile forward and backward for sm_90 with triton's bundled ptxas (no GPU needed):
    the interpreter would accept Python that the compiler rejects."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    if res.returncode != 0 and "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("triton's bundled ptxas is not available on this platform")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
