"""The merged-copy rollout path (grpo/rollout/merged.py) against the plain sampler.

On a CPU: greedy tokens equal the plain path's on the tiny architecture with a non-zero
LoRA, fp32 and NF4 bases; sampled tokens equal for one seed; refresh() follows the adapter;
a bf16-rounded copy against the fp32 NF4 trainer makes the mismatch real, and the rollout
correction of grpo_kernels/grpo_loss.py reweights the loss and its gradient.
On CUDA (skipped here; bench/gpu.sh runs it): the graph-captured step equals the eager one
token for token, and the merged path equals the plain one on the GPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from grpo.model.load import ModelBundle, load_bundle
from grpo.model.prompts import encode_prompts
from grpo.rollout.merged import MergedRollout
from grpo.rollout.sampler import sample

QUESTIONS = ["How many red circles are there?", "Sum?", "What is the total number of squares in the picture shown?"]


def _image(seed: int, size=(112, 112)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _sharp_lora(device="cpu", dtype=torch.float32, four_bit=False, lora_seed=0, head=False) -> ModelBundle:
    """The tiny architecture at 7x the init scale (greedy tokens vary) with a non-zero LoRA
    (``head``: on lm_head too, as the own-data plan trains the tiny base)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from lora import DEFAULT_TARGETS, LoRAConfig, inject_lora, lora_parameters

    base = load_bundle("tiny")
    cfg = copy.deepcopy(base.model.config)
    cfg.text_config.initializer_range = cfg.vision_config.initializer_range = 0.15
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2_5_VLForConditionalGeneration(cfg).eval().to(device=device, dtype=dtype)
        if four_bit:
            from lora import quantize_model_4bit

            quantize_model_4bit(model, compute_dtype=dtype, device=device, verbose=False)
        inject_lora(model, LoRAConfig(r=4, target_modules=DEFAULT_TARGETS + (("lm_head",) if head else ())),
                    verbose=False)
        torch.manual_seed(lora_seed)
        with torch.no_grad():
            for p in lora_parameters(model):
                p.add_(0.1 * torch.randn_like(p))
    return ModelBundle(model=model, tokenizer=base.tokenizer, image_processor=base.image_processor, source="sharp")


@pytest.fixture(scope="module")
def bundle():
    return _sharp_lora()


@pytest.fixture(scope="module")
def prompts(bundle):
    # three prompt lengths in one left-padded batch
    return encode_prompts(bundle, ([_image(0), _image(1, (90, 60)), _image(2, (56, 112))], QUESTIONS))


def test_greedy_tokens_equal_the_plain_path(bundle, prompts):
    fast = MergedRollout(bundle.model).sample(bundle, prompts, G=2, max_new_tokens=12, temperature=0)
    plain = sample(bundle, prompts, G=2, max_new_tokens=12, temperature=0)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    assert torch.equal(fast.completion_mask, plain.completion_mask)
    assert fast.texts == plain.texts
    torch.testing.assert_close(fast.logprobs, plain.logprobs, rtol=0, atol=1e-4)
    assert len(set(fast.completion_ids[0].tolist())) > 3  # a real sequence, not one repeated token


def test_sampled_tokens_equal_the_plain_path_for_one_seed(bundle, prompts):
    fast = MergedRollout(bundle.model).sample(bundle, prompts, G=3, max_new_tokens=10, temperature=1.0, seed=3)
    # compact=False: the plain loop then draws the same random numbers (no rows dropped)
    plain = sample(bundle, prompts, G=3, max_new_tokens=10, temperature=1.0, seed=3, compact=False)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, rtol=0, atol=1e-4)


def test_refresh_follows_the_adapter(prompts):
    from lora import lora_parameters

    b = _sharp_lora(lora_seed=1)
    rollout = MergedRollout(b.model)
    before = rollout.sample(b, prompts, G=1, max_new_tokens=10, temperature=0).completion_ids
    with torch.no_grad():  # an "optimiser step" that changes the adapter a lot
        for p in lora_parameters(b.model):
            p.mul_(-3.0)
    plain = sample(b, prompts, G=1, max_new_tokens=10, temperature=0).completion_ids
    assert not torch.equal(plain, before)  # the change matters for the policy
    # without refresh the decode steps still use the old merged weights (the prefill is the policy's)
    assert not torch.equal(rollout.sample(b, prompts, G=1, max_new_tokens=10, temperature=0).completion_ids, plain)
    rollout.refresh()
    assert torch.equal(rollout.sample(b, prompts, G=1, max_new_tokens=10, temperature=0).completion_ids, plain)


def test_an_adapted_lm_head_is_merged_sampled_alike_and_refreshed(prompts):
    """LoRA on lm_head (the own-data plan on the tiny base): the merged copy holds the head with
    its adapter, samples the plain path's tokens for a seed, and follows the head's adapter."""
    from lora import LoRALinear

    b = _sharp_lora(four_bit=True, head=True)
    head = b.model.lm_head
    assert isinstance(head, LoRALinear)
    rollout = MergedRollout(b.model)
    fast = rollout.sample(b, prompts, G=3, max_new_tokens=10, temperature=1.0, seed=3)
    plain = sample(b, prompts, G=3, max_new_tokens=10, temperature=1.0, seed=3, compact=False)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, rtol=0, atol=1e-4)
    with torch.no_grad():
        head.lora_B.mul_(-5.0)  # the head's adapter alone changes
    moved = sample(b, prompts, G=1, max_new_tokens=10, temperature=0).completion_ids
    assert not torch.equal(rollout.sample(b, prompts, G=1, max_new_tokens=10, temperature=0).completion_ids, moved)
    rollout.refresh()
    assert torch.equal(rollout.sample(b, prompts, G=1, max_new_tokens=10, temperature=0).completion_ids, moved)


def test_nf4_base_greedy_tokens_equal_the_plain_path(prompts):
    pytest.importorskip("bitsandbytes")
    b = _sharp_lora(four_bit=True)
    rollout = MergedRollout(b.model)
    assert rollout.nbytes == sum(w.numel() * 4 for layer in rollout.weights for w, _ in layer.values())
    fast = rollout.sample(b, prompts, G=2, max_new_tokens=10, temperature=0)
    plain = sample(b, prompts, G=2, max_new_tokens=10, temperature=0)
    assert torch.equal(fast.completion_ids, plain.completion_ids)


def test_a_bf16_merged_copy_is_off_policy_and_the_correction_reweights_the_loss(prompts):
    """A real sampler/trainer mismatch on a CPU: the merged weights rounded to bf16 (what the
    copy holds on a GPU) sample, the NF4 + LoRA policy in fp32 trains. The fp32 copy's
    mismatch is rounding noise; the bf16 copy's is measurable (KL, ratios away from 1), and
    the rollout correction changes the loss and its gradient -- the more, the tighter the cap.
    """
    from grpo.model.logprobs import completion_logprobs
    from grpo_kernels.grpo_loss import AdvantageSource, LossOptions, group_advantages, grpo_loss
    from lora import lora_parameters

    nf4 = _sharp_lora(four_bit=True)
    G = 4
    fp32_copy = MergedRollout(nf4.model)
    exact = fp32_copy.sample(nf4, prompts, G=G, max_new_tokens=12, temperature=1.0, seed=5)
    bf16_copy = MergedRollout(nf4.model)
    with torch.no_grad():
        for layer in bf16_copy.weights:
            for W, _ in layer.values():
                W.copy_(W.to(torch.bfloat16).float())  # the bf16 copy's rounding, fp32 activations
    out = bf16_copy.sample(nf4, prompts, G=G, max_new_tokens=12, temperature=1.0, seed=5)
    rewards = torch.arange(out.completion_ids.shape[0], dtype=torch.float32) % 3
    mask = out.completion_mask.float()

    def loss_and_grad(o, **kw):
        for p in lora_parameters(nf4.model):
            p.grad = None
        logp = completion_logprobs(nf4.model, o.context, o.completion_ids, o.completion_mask, G)
        adv = group_advantages(AdvantageSource(rewards[:, None]), G)
        loss, st = grpo_loss(logp, o.completion_mask.float(), adv, sampler_logp=o.logprobs, options=LossOptions(**kw))
        loss.backward()
        return float(loss.detach()), torch.cat([p.grad.flatten() for p in lora_parameters(nf4.model)]), st

    _, _, st_exact = loss_and_grad(exact)
    loss_off, grad_off, st = loss_and_grad(out)
    assert float(st_exact.is_kl) < 1e-9 and abs(float(st_exact.is_ratio_max) - 1) < 1e-4  # fp32: rounding only
    assert float(st.is_kl) > 1e-6 and float(st.is_ratio_max) > 1 + 1e-3  # bf16: measurably off-policy
    assert float(st.is_over_frac) == 0  # no token ratio reaches the default cap of 3
    n = int(mask.sum())
    # token ratios strictly between 1 and their max: a cap there truncates some, keeps others
    cap = 1 + (float(st.is_ratio_max) - 1) / 2
    changes = {}
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            loss_c, grad_c, st_c = loss_and_grad(out, correction=level, correction_mode=mode, correction_cap=cap)
            if level == "token":
                assert 0 < float(st_c.is_over_frac) < 1 and float(st_c.is_over_frac) * n >= 1
            assert loss_c != loss_off
            changes[level, mode] = float((grad_c - grad_off).norm() / grad_off.norm())
    assert all(c > 0 for c in changes.values()), changes
    # masking drops the capped tokens' whole term, truncating only their excess weight
    assert changes["token", "mask"] > changes["token", "truncate"], changes


def test_bad_use_is_one_clear_error(bundle, prompts):
    with pytest.raises(ValueError, match="graphs=True needs the model on a CUDA device"):
        MergedRollout(bundle.model, graphs=True)
    with pytest.raises(ValueError, match="graphs='sometimes'"):
        MergedRollout(bundle.model, graphs="sometimes")
    other = ModelBundle(model=copy.deepcopy(bundle.model), tokenizer=bundle.tokenizer,
                        image_processor=bundle.image_processor, source="copy")
    with pytest.raises(ValueError, match="built for another model"):
        MergedRollout(bundle.model).sample(other, prompts, G=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="G=0"):
        MergedRollout(bundle.model).sample(bundle, prompts, G=0, max_new_tokens=2)


# ----------------------------------------------------------------------------- CUDA only (bench/gpu.sh)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@cuda
def test_cuda_graph_step_equals_eager_step():
    b = _sharp_lora(device="cuda", dtype=torch.bfloat16)
    pb = encode_prompts(b, ([_image(0), _image(1, (90, 60)), _image(2, (56, 112))], QUESTIONS)).to("cuda")
    graphed = MergedRollout(b.model, graphs=True).sample(b, pb, G=4, max_new_tokens=16, temperature=0)
    eager = MergedRollout(b.model, graphs=False).sample(b, pb, G=4, max_new_tokens=16, temperature=0)
    assert torch.equal(graphed.completion_ids, eager.completion_ids)
    # same kernels replayed; cuBLAS may still pick another algorithm inside a capture (bf16 rounding)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, rtol=0, atol=5e-2)
    sampled = [MergedRollout(b.model).sample(b, pb, G=4, max_new_tokens=16, temperature=1.0, seed=0).completion_ids
               for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])  # replays are deterministic for a seed


@cuda
def test_cuda_merged_greedy_equals_plain_in_fp32():
    b = _sharp_lora(device="cuda", dtype=torch.float32)
    pb = encode_prompts(b, ([_image(0), _image(1, (90, 60)), _image(2, (56, 112))], QUESTIONS)).to("cuda")
    fast = MergedRollout(b.model).sample(b, pb, G=2, max_new_tokens=12, temperature=0)
    plain = sample(b, pb, G=2, max_new_tokens=12, temperature=0)
    assert torch.equal(fast.completion_ids, plain.completion_ids)


def test_stacked_weights_hold_each_projection_and_refresh_in_place(bundle):
    """The copy stacks q/k/v and gate/up into one weight each (one matmul, not three or two):
    its rows are exactly each projection's merged weight, before and after a refresh (which
    writes into the same storage: a captured graph keeps reading it), and the stacked matmul
    gives each projection's output."""
    from grpo.rollout.merged import FUSED, _merged_fp32
    from lora import lora_parameters

    b = _sharp_lora(lora_seed=2)
    rollout = MergedRollout(b.model)
    layer, w = b.model.model.language_model.layers[1], rollout.weights[1]
    assert set(w) == set(FUSED)

    def rows_equal_each_projection():
        for fused, names in FUSED.items():
            mods = [getattr(layer.self_attn if n in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, n)
                    for n in names]
            parts = [_merged_fp32(m) for m in mods]
            assert torch.equal(w[fused][0], torch.cat([W for W, _ in parts]))
            if parts[0][1] is not None:
                assert torch.equal(w[fused][1], torch.cat([bias for _, bias in parts]))
        h = torch.randn(5, 1, layer.self_attn.q_proj.in_features)
        q, k, v = (torch.nn.functional.linear(h, *_merged_fp32(getattr(layer.self_attn, n))) for n in FUSED["qkv"])
        torch.testing.assert_close(torch.nn.functional.linear(h, *w["qkv"]), torch.cat([q, k, v], -1))

    rows_equal_each_projection()
    ptr = w["qkv"][0].data_ptr()
    with torch.no_grad():
        for p in lora_parameters(b.model):
            p.mul_(-2.0)
    rollout.refresh()
    assert w["qkv"][0].data_ptr() == ptr
    rows_equal_each_projection()
