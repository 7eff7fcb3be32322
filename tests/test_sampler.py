"""The group sampler: equals transformers' greedy generate, log-probs, seeds, groups, stopping, errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from grpo.model.load import ModelBundle, load_bundle
from grpo.model.prompts import encode_prompts
from grpo.rollout.sampler import check_generator_device, filter_logits, sample, sample_token, stop_token_ids

QUESTIONS = ["How many red circles are there?", "Sum?", "What is the total number of squares in the picture shown?"]


def _image(seed: int, size=(112, 112)) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr)


@pytest.fixture(scope="module")
def sharp():
    """The tiny architecture with 7x larger init: a random model whose greedy tokens vary
    (at the default init every row repeats one token, which would make equality tests weak)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    base = load_bundle("tiny")
    cfg = copy.deepcopy(base.model.config)
    cfg.text_config.initializer_range = cfg.vision_config.initializer_range = 0.15
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return ModelBundle(model=model, tokenizer=base.tokenizer, image_processor=base.image_processor, source="sharp")


@pytest.fixture(scope="module")
def prompts(sharp):
    # Three prompt lengths (different image sizes and questions) in one left-padded batch.
    return encode_prompts(sharp, ([_image(0), _image(1, (90, 60)), _image(2, (56, 112))], QUESTIONS))


def _full_forward(bundle, prompts, out, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own forward over prompts + completions (repeated prompts, pixels, no cache):
    (logits [N, T, V], last hidden state [N, T, d]) at the positions that predict the completion."""
    inputs = prompts.repeated(G)
    L = prompts.input_ids.shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], out.completion_ids], 1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], out.completion_mask], 1)
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(out.completion_ids)], 1)
    with torch.no_grad():
        res = bundle.model(**inputs, output_hidden_states=True)
    return res.logits[:, L - 1 : -1].float(), res.hidden_states[-1][:, L - 1 : -1].float()


def logprob_tol(bundle, prompts, out, G: int, temperature: float = 1.0) -> float:
    """How far two float32 computations of the same completion log-probs may differ.

    log p = z_y / tau - logsumexp(z / tau), and each logit z_v = sum_d W_vd h_d adds d terms
    (the hidden size). The paths compared here -- a cached decode step against a full
    forward, a hand-written step against transformers' -- reach those sums through matmuls of
    other shapes, which the CPU's BLAS blocks and orders in its own way (and differently on
    another CPU). A reordered sum of d terms moves by up to (d - 1) eps times
    sum_d |W_vd h_d|, and the layers before perturb h by a few eps relative, which the same
    magnitude bounds: tol = d eps32 max over tokens and vocabulary of sum_d |W_vd h_d| / tau.
    Measured on the sharp tiny model (d = 128): the paths 4.3 eps x that magnitude apart, 1/30
    of tol (the former fixed 2e-5 was 1.7x the error), while a temperature 3% off moves the
    log-probs by ~200 tol.
    """
    _, hidden = _full_forward(bundle, prompts, out, G)
    weight = bundle.model.lm_head.weight.float()
    size = (hidden.abs() @ weight.abs().T).amax(-1) / temperature  # [N, T]
    eps = torch.finfo(torch.float32).eps
    return weight.shape[1] * eps * float(size[out.completion_mask.bool()].max())


def _generate_greedy(bundle, prompts, G: int, max_new_tokens: int) -> torch.Tensor:
    out = bundle.model.generate(**prompts.repeated(G), do_sample=False, max_new_tokens=max_new_tokens,
                                eos_token_id=stop_token_ids(bundle), pad_token_id=bundle.pad_token_id)
    return out[:, prompts.input_ids.shape[1]:]


def _eos_bias(bundle, delta: float):
    """Test-only: add delta to <|im_end|>'s logit so a random model stops at varied steps."""
    eos = bundle.eos_token_id

    def hook(module, inputs, logits):
        return logits + torch.nn.functional.one_hot(torch.tensor(eos), logits.shape[-1]).to(logits.dtype) * delta

    return bundle.model.lm_head.register_forward_hook(hook)


# ----------------------------------------------------------------------------- equality with generate


DECODE = pytest.mark.parametrize("decode", ["static", "hf"])  # hand-written step / transformers forward


@DECODE
def test_greedy_single_prompt_equals_generate(sharp, decode):
    pb = encode_prompts(sharp, ([_image(5)], [QUESTIONS[0]]))
    ours = sample(sharp, pb, G=1, max_new_tokens=12, temperature=0, decode=decode)
    ref = _generate_greedy(sharp, pb, 1, 12)
    assert torch.equal(ours.completion_ids, ref)
    assert len(set(ours.completion_ids[0].tolist())) > 3  # a real sequence, not one repeated token


@DECODE
def test_greedy_batched_different_lengths_equals_generate(sharp, prompts, decode):
    assert len(set(prompts.attention_mask.sum(1).tolist())) == 3
    ours = sample(sharp, prompts, G=2, max_new_tokens=16, temperature=0, decode=decode)
    ref = _generate_greedy(sharp, prompts, 2, 16)
    assert torch.equal(ours.completion_ids, ref)
    # Every member of a group saw the same prompt and image: greedy gives G identical rows,
    # and different prompts give different rows.
    rows = ours.completion_ids.view(3, 2, -1)
    assert torch.equal(rows[:, 0], rows[:, 1])
    assert not torch.equal(rows[0, 0], rows[1, 0]) and not torch.equal(rows[1, 0], rows[2, 0])
    assert ours.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]


@DECODE
def test_several_images_a_prompt_equal_generate(sharp, decode):
    """A two-image prompt alone, and in a batch with one-image prompts: generate's tokens, each
    image of a prompt through the vision tower once for its whole group, and the second image
    read (another one changes the completion)."""
    two = [_image(6), _image(7, (84, 56))]
    alone = encode_prompts(sharp, ([two], ["Which picture has more red?"]))
    assert alone.images_per_prompt == [2] and alone.n_image_tokens.tolist() == [16 + 6]
    ours = sample(sharp, alone, G=1, max_new_tokens=12, temperature=0, decode=decode)
    assert torch.equal(ours.completion_ids, _generate_greedy(sharp, alone, 1, 12))
    other = encode_prompts(sharp, ([[two[0], _image(8, (84, 56))]], ["Which picture has more red?"]))
    assert not torch.equal(sample(sharp, other, G=1, max_new_tokens=12, temperature=0, decode=decode).completion_ids,
                           ours.completion_ids)

    mixed = encode_prompts(sharp, ([_image(0), two, _image(2, (56, 112))], QUESTIONS))
    assert mixed.images_per_prompt == [1, 2, 1]
    patches = []
    handle = sharp.model.model.visual.register_forward_hook(lambda m, args, out: patches.append(args[0].shape[0]))
    try:
        ours = sample(sharp, mixed, G=3, max_new_tokens=12, temperature=0, decode=decode)
    finally:
        handle.remove()
    assert patches == [mixed.pixel_values.shape[0]]  # one vision pass over the 4 images, not G = 3 of them
    assert torch.equal(ours.completion_ids, _generate_greedy(sharp, mixed, 3, 12))
    rows = ours.completion_ids.view(3, 3, -1)
    assert torch.equal(rows[:, 0], rows[:, 2]) and not torch.equal(rows[1, 0], rows[0, 0])


@DECODE
def test_greedy_with_stops_equals_generate(sharp, prompts, decode):
    handle = _eos_bias(sharp, 3.0)
    try:
        ours = sample(sharp, prompts, G=2, max_new_tokens=20, temperature=0, decode=decode)
        uncompacted = sample(sharp, prompts, G=2, max_new_tokens=20, temperature=0, compact=False, decode=decode)
        ref = _generate_greedy(sharp, prompts, 2, 20)
    finally:
        handle.remove()
    # generate pads finished rows with pad_token_id and stops when all are done, as we do;
    # dropping finished rows from the batch (compact) changes nothing for greedy.
    assert torch.equal(ours.completion_ids, ref)
    assert torch.equal(uncompacted.completion_ids, ref)
    lengths = ours.lengths.tolist()
    assert len(set(lengths)) > 1 and ours.finished.any()  # rows stopped at different steps


# ----------------------------------------------------------------------------- log-probs


@DECODE
def test_sampling_logprobs_equal_full_forward(sharp, prompts, decode):
    from grpo.model.logprobs import completion_logprobs

    G, temperature = 3, 0.7
    out = sample(sharp, prompts, G=G, max_new_tokens=10, temperature=temperature, top_k=50, top_p=0.9, seed=0,
                 decode=decode)
    # Full forward through transformers' own path: repeated prompts, pixels, no cache.
    logits, _ = _full_forward(sharp, prompts, out, G)
    tol = logprob_tol(sharp, prompts, out, G, temperature)

    def full(tau):
        logp = torch.log_softmax(logits / tau, -1).gather(-1, out.completion_ids[..., None]).squeeze(-1)
        return logp * out.completion_mask

    torch.testing.assert_close(out.logprobs, full(temperature), rtol=0, atol=tol)
    assert (out.logprobs - full(1.03 * temperature)).abs().max() > 10 * tol  # the tolerance sees a wrong temperature
    with torch.no_grad():
        ours = completion_logprobs(sharp.model, out.context, out.completion_ids, out.completion_mask, G,
                                   temperature=temperature)
    torch.testing.assert_close(ours, out.logprobs, rtol=0, atol=tol)
    # The filtered (actually sampled) distribution puts at least as much mass on the token.
    assert (out.filtered_logprobs >= out.logprobs - 1e-6).all()


# ----------------------------------------------------------------------------- seeds, stopping


def test_same_seed_same_completions(sharp, prompts):
    kw = dict(G=4, max_new_tokens=8, temperature=1.0, top_k=20)
    a = sample(sharp, prompts, seed=123, **kw)
    b = sample(sharp, prompts, seed=123, **kw)
    c = sample(sharp, prompts, seed=124, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # Sampling (not greedy): members of one group differ.
    g = a.completion_ids.view(3, 4, -1)
    assert any(not torch.equal(g[i, 0], g[i, j]) for i in range(3) for j in range(1, 4))


@DECODE
def test_stop_token_ends_sequence_and_mask(sharp, prompts, decode):
    from grpo.model.logprobs import completion_logprobs

    handle = _eos_bias(sharp, 4.0)
    try:
        out = sample(sharp, prompts, G=4, max_new_tokens=12, temperature=1.0, seed=0, decode=decode)
        with torch.no_grad():  # rows left the batch as they stopped: log-probs must still line up
            again = completion_logprobs(sharp.model, out.context, out.completion_ids, out.completion_mask, 4)
    finally:
        handle.remove()
    torch.testing.assert_close(again, out.logprobs, rtol=0, atol=logprob_tol(sharp, prompts, out, 4))
    eos, pad = sharp.eos_token_id, sharp.pad_token_id
    assert out.finished.any()
    for n in range(out.completion_ids.shape[0]):
        ids, mask = out.completion_ids[n].tolist(), out.completion_mask[n].tolist()
        if out.finished[n]:
            k = ids.index(eos)  # first stop token
            assert mask == [1] * (k + 1) + [0] * (len(ids) - k - 1)  # mask includes the stop token
            assert all(t == pad for t in ids[k + 1 :])
            assert all(lp == 0.0 for lp in out.logprobs[n, k + 1 :].tolist())
            assert out.texts[n] == sharp.decode(ids[:k]) and not out.truncated[n]
        else:
            assert out.truncated[n] and sum(mask) == len(ids) == 12
    assert (out.finished ^ out.truncated).all()


def test_sample_token_matches_distribution():
    """Exponential-race sampling draws from softmax(logits / T) after top-k / top-p."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).repeat(40000, 1)
    gen = torch.Generator().manual_seed(0)
    token, logp, logq = sample_token(logits, 0.8, 0, 1.0, gen)
    freq = torch.bincount(token, minlength=5).float() / token.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.8, -1), rtol=0, atol=0.01)
    torch.testing.assert_close(logp, logq)
    token, logp, logq = sample_token(logits, 1.0, 2, 1.0, gen)  # top-2: only ids 0 and 1
    assert set(token.tolist()) == {0, 1}
    p01 = torch.softmax(logits[0, :2], -1)
    freq = torch.bincount(token, minlength=2).float() / token.numel()
    torch.testing.assert_close(freq, p01, rtol=0, atol=0.01)
    assert (logq >= logp).all()


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, 2, 1.0)) == [True, True, False, False]
    assert keep(filter_logits(logits, 0, 0.8)) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert keep(filter_logits(logits, 0, 0.81)) == [True, True, True, False]
    assert keep(filter_logits(logits, 0, 0.1)) == [True, False, False, False]  # the top token always stays


def test_bad_arguments(sharp, prompts):
    with pytest.raises(ValueError, match="G=0"):
        sample(sharp, prompts, G=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        sample(sharp, prompts, G=2, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        sample(sharp, prompts, G=2, max_new_tokens=4, temperature=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        sample(sharp, prompts, G=2, max_new_tokens=4, top_p=0)
    with pytest.raises(ValueError, match="decode='fast'"):
        sample(sharp, prompts, G=2, max_new_tokens=4, decode="fast")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        sample(sharp, prompts, G=2, max_new_tokens=sharp.context_length)


def test_generator_must_live_on_the_logits_device(sharp, prompts):
    """A CPU generator handed to a sampler whose model (and so logits) lives elsewhere is
    refused with one line before any compute: on a GPU it would fail at the first token's
    exponential draw. Here the model is moved to the meta device, which a CPU run can build."""
    check_generator_device(torch.Generator(), torch.device("cpu"))  # the same device: accepted
    check_generator_device(None, torch.device("cuda:0"))  # no generator: the global RNG, accepted
    with pytest.raises(ValueError, match=r"lives on cpu but the model's logits on cuda:0") as err:
        check_generator_device(torch.Generator(), torch.device("cuda:0"))
    assert "\n" not in str(err.value)
    meta = ModelBundle(model=copy.deepcopy(sharp.model).to("meta"), tokenizer=sharp.tokenizer,
                       image_processor=sharp.image_processor, source="sharp on meta")
    with pytest.raises(ValueError, match=r"generator lives on cpu but the model's logits on meta"):
        sample(meta, prompts, G=2, max_new_tokens=2, generator=torch.Generator().manual_seed(0))


def test_static_decode_with_lora_equals_hf(sharp, prompts):
    """The hand-written step calls the model's own (here LoRA-wrapped) modules."""
    inject = pytest.importorskip("lora.inject")
    from grpo.rollout import decoder

    bundle = ModelBundle(model=copy.deepcopy(sharp.model), tokenizer=sharp.tokenizer,
                         image_processor=sharp.image_processor, source="sharp+lora")
    assert decoder.supports(bundle.model)
    inject.inject_lora(bundle.model, inject.LoRAConfig(r=4), verbose=False)
    with torch.no_grad():
        for p in inject.lora_parameters(bundle.model):
            p.add_(0.1 * torch.randn_like(p))
    static = sample(bundle, prompts, G=2, max_new_tokens=10, temperature=0, decode="static")
    hf = sample(bundle, prompts, G=2, max_new_tokens=10, temperature=0, decode="hf")
    plain = sample(sharp, prompts, G=2, max_new_tokens=10, temperature=0)
    assert torch.equal(static.completion_ids, hf.completion_ids)
    torch.testing.assert_close(static.logprobs, hf.logprobs, rtol=0, atol=logprob_tol(bundle, prompts, static, 2))
    assert not torch.equal(static.completion_ids, plain.completion_ids)  # the adapters did act


def test_static_step_helpers_compute_the_same_numbers():
    """The static decode step rotates q and k concatenated along the heads in one pass, and gives
    SDPA a float key mask built once per step: both are the same numbers as rotating each alone
    and passing the bool mask (which SDPA converts to that float mask inside every call)."""
    import torch.nn.functional as F

    from grpo.rollout import decoder

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 1, 8, generator=g), torch.randn(3, 2, 1, 8, generator=g)
    cos, sin = torch.randn(3, 1, 1, 8, generator=g), torch.randn(3, 1, 1, 8, generator=g)
    qk = decoder.apply_rope(torch.cat([q, k], 1), cos, sin)
    assert torch.equal(qk[:, :4], q * cos + decoder._rotate_half(q) * sin)
    assert torch.equal(qk[:, 4:], k * cos + decoder._rotate_half(k) * sin)
    K, V = torch.randn(3, 2, 6, 8, generator=g), torch.randn(3, 2, 6, 8, generator=g)
    keys = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    as_bool = F.scaled_dot_product_attention(q, K, V, attn_mask=keys[:, None, None], enable_gqa=True)
    as_float = F.scaled_dot_product_attention(q, K, V, attn_mask=decoder.additive_mask(keys, q.dtype)[:, None, None],
                                              enable_gqa=True)
    assert torch.equal(as_bool, as_float)
