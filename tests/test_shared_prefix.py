"""Shared-prefix log-prob passes: the prompt once per group, the same numbers as the full-row pass.

What is pinned, smallest piece first:

- the hand-written decoder layer over the two streams (prompts [B, P, d], completions
  [N, T, d]) against transformers' own Qwen2.5-VL decoder layer run on the full rows
  [N, P + T, d]: outputs and gradients (the layer's weights and both inputs);
- the whole pass against the full-row pass on the tiny model with LoRA: log-probs and LoRA
  gradients, prompts of unequal length (left padding, different rope deltas: M-RoPE), G = 1
  and G = 3, with and without activation checkpointing (which must recompute each layer);
- the same at the 7B's widths (hidden 3584, MLP 18944, 28 query / 4 key-value heads, M-RoPE
  sections 16/24/24) with 2 decoder layers and hand-built M-RoPE positions of an image grid;
- a real ``grpo_step`` with ``optim.shared_prefix`` on and off, on the same rollouts: equal
  gradients of every update, losses and logged statistics for every loss type, mu = 2, the KL
  reference pass, rollout correction, prefix-credited rubrics, training micro-batches;
- padding left out of the token-wise parts (projections, norms, MLP): only real tokens go
  through them, with the same hidden states and gradients as when every position does;
- bad input: a row count that is not B*G (a split group) is refused with one line.

Tolerances: the two paths compute the same terms, but matmuls of other shapes may sum them
in another order; a float32 sum of terms of size |x| then moves by a few eps * |x| per term
summed. Each comparison allows a few eps (1.2e-7) times the magnitude it compares (the
largest gradient entry, the hidden state's or the log-prob's scale) times the length of the
longest sum in its path (the width d, or the step's rows).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from PIL import Image

from grpo.model.load import ModelBundle, load_bundle
from grpo.model.logprobs import completion_hidden_states, completion_logprobs, reference_logprobs
from grpo.model.prompt_context import PromptContext, build_prompt_context, completion_position_ids, group_rows
from grpo.model.prompts import encode_prompts
from grpo.model.shared_prefix import attention_masks, layer_forward, shared_prefix_hidden_states
from lora import enable_gradient_checkpointing, inject, lora_parameters

EPS32 = torch.finfo(torch.float32).eps
T = 6


def _image(seed: int, size=(112, 112)) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr)


def _with_lora(model, seed=0):
    """LoRA r=4 on every projection, B moved off zero so the adapters change the function."""
    inject.inject_lora(model, inject.LoRAConfig(r=4), verbose=False)
    inject.freeze_all_but_lora(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def tiny():
    """The tiny model with LoRA, two prompts of unequal length (one left-padded by 5+ tokens,
    images of different grids: different rope deltas)."""
    base = load_bundle("tiny")
    bundle = ModelBundle(model=_with_lora(copy.deepcopy(base.model)), tokenizer=base.tokenizer,
                         image_processor=base.image_processor, source="tiny")
    prompts = encode_prompts(bundle, ([_image(0), _image(1, (84, 56))],
                                      ["How many circles?", "What is the sum and the rest?"]))
    ctx = build_prompt_context(bundle.model, prompts)
    assert (ctx.attention_mask == 0).any() and ctx.next_position[0] != ctx.next_position[1]
    return bundle.model, ctx


def _completions(B: int, G: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B*G, T] ids and a mask with completions that stopped early (padding after the stop)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B * G, T), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[-1, 2:] = 0
    return ids, mask


def _full_rows(model, ctx: PromptContext, x_p, x_c, G):
    """The full-row layer inputs: prompts repeated G times, then completions: [N, P + T, d],
    positions [3, N, P + T], and transformers' boolean 4-D mask (causal, key padding, diagonal)."""
    rows = group_rows(ctx.B, G)
    N, T_ = x_c.shape[:2]
    L = ctx.P + T_
    x = torch.cat([x_p[rows], x_c], 1)
    pos = torch.cat([ctx.position_ids[:, rows], completion_position_ids(ctx, rows, T_)], 2)
    keys = torch.cat([ctx.attention_mask[rows], torch.ones(N, T_, dtype=torch.long)], 1).bool()
    mask = (torch.ones(L, L, dtype=torch.bool).tril() & keys[:, None, :]) | torch.eye(L, dtype=torch.bool)
    return x, pos, mask[:, None]


# ----------------------------------------------------------------------------- one layer


@pytest.mark.parametrize("G", [1, 3])
def test_layer_equals_transformers_decoder_layer(tiny, G):
    model, ctx = tiny
    lm = model.model.language_model
    layer = lm.layers[1]
    B, P, d = ctx.B, ctx.P, lm.config.hidden_size
    N = B * G
    gen = torch.Generator().manual_seed(1)
    x_p = torch.randn(B, P, d, generator=gen).requires_grad_()
    x_c = torch.randn(N, T, d, generator=gen).requires_grad_()
    w_p, w_c = torch.randn(B, P, d, generator=gen), torch.randn(N, T, d, generator=gen)  # a loss: weighted sum
    real = ctx.attention_mask.bool()[..., None]  # compare real prompt positions only (padding is never read)
    params = [p for p in layer.parameters() if p.requires_grad]
    for p in params:
        p.grad = None

    # transformers' layer on the full rows (the prompt's G copies; backward sums them into x_p)
    x, pos, mask = _full_rows(model, ctx, x_p, x_c, G)
    ref = layer(x, attention_mask=mask, position_embeddings=lm.rotary_emb(x, pos))
    ref_p, ref_c = ref[::G, :P], ref[:, P:]  # each group's first copy of its prompt; the completions
    ((ref_p * w_p * real).sum() + (ref_c * w_c).sum()).backward()
    ref_grads = [t.grad.clone() for t in (x_p, x_c, *params)]
    for t in (x_p, x_c, *params):
        t.grad = None

    # ours: the packed streams
    rows = group_rows(B, G)
    cos_p, sin_p = lm.rotary_emb(x_p, ctx.position_ids)
    cos_c, sin_c = lm.rotary_emb(x_c, completion_position_ids(ctx, rows, T))
    cos, sin = (torch.cat([a.flatten(0, 1), b.flatten(0, 1)]) for a, b in ((cos_p, cos_c), (sin_p, sin_c)))
    masks = attention_masks(ctx, torch.ones(N, T, dtype=torch.long), G)
    out = layer_forward(layer, torch.cat([x_p.flatten(0, 1), x_c.flatten(0, 1)]), cos, sin, masks, B, P, G, T)
    out_p, out_c = out[: B * P].view(B, P, d), out[B * P :].view(N, T, d)
    ((out_p * w_p * real).sum() + (out_c * w_c).sum()).backward()

    scale = float(ref.detach().abs().max())
    torch.testing.assert_close(out_p * real, ref_p * real, rtol=0, atol=4 * d * EPS32 * scale)
    torch.testing.assert_close(out_c, ref_c, rtol=0, atol=4 * d * EPS32 * scale)
    for t, g in zip((x_p, x_c, *params), ref_grads):
        assert g.abs().max() > 0
        torch.testing.assert_close(t.grad, g, rtol=0, atol=4 * d * G * EPS32 * float(g.abs().max()))


# ----------------------------------------------------------------------------- the whole pass


def _grads(params, fn):
    for p in params:
        p.grad = None
    out = fn()
    return out, [p.grad.clone() for p in params]


@pytest.mark.parametrize("G,checkpointing", [(1, False), (3, False), (3, True)])
def test_pass_equals_the_full_row_pass(tiny, G, checkpointing):
    _check_pass(*tiny, G, checkpointing)


@pytest.mark.parametrize("G,checkpointing", [(3, False), (8, True)])
def test_padding_is_left_out_of_the_token_wise_parts(tiny, G, checkpointing):
    """Only real tokens (not a prompt's left padding, not a completion's positions after its
    stop) go through the projections, norms and MLP; attention gets them back in the layout.
    Hidden states and LoRA gradients against every position run: the forward bit for bit (the
    real rows' arithmetic is row by row), the gradients within the summation-order bound of the
    adapters' sums over tokens (the dropped rows added exact zeros, but fewer rows may group the
    sum otherwise)."""
    model, ctx = tiny
    model = copy.deepcopy(model)
    if checkpointing:
        enable_gradient_checkpointing(model)
    ids, mask = _completions(ctx.B, G, 300)
    params = lora_parameters(model)
    rows_seen = []
    q_proj = model.model.language_model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    out = {}
    for compact in (True, False):
        rows_seen.clear()
        h, grads = _grads(params, lambda c=compact: _weighted(shared_prefix_hidden_states(model, ctx, ids, mask, G,
                                                                                          compact=c), mask))
        out[compact] = h, grads, list(rows_seen)
    hook.remove()
    real = int(ctx.attention_mask.sum() + mask.sum())
    every = ctx.B * ctx.P + ids.numel()
    assert real < every and out[True][2][0] == real and out[False][2][0] == every
    assert torch.equal(out[True][0], out[False][0])
    for a, b in zip(out[True][1], out[False][1]):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=4 * every * EPS32 * float(b.abs().max()))


def _weighted(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A loss over the real positions' hidden states (backward run), and those states, detached."""
    h = h * mask[..., None]
    (h * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
    return h.detach()


def test_pass_equals_the_full_row_pass_with_several_images(tiny):
    """A two-image prompt beside a one-image one (and a three-image one): the visual tokens of
    all of a prompt's images in its stream, its rope delta summed over them; a micro-batch's
    slice of the context is that prompt's own."""
    model, _ = tiny
    bundle = load_bundle("tiny")
    images = [[_image(3), _image(4, (84, 56))], [_image(5, (56, 112))], [_image(6, (56, 56)), _image(7), _image(8)]]
    prompts = encode_prompts(bundle, (images, ["Which is larger?", "How many circles?", "Sum the three?"]))
    ctx = build_prompt_context(model, prompts)
    assert prompts.images_per_prompt == [2, 1, 3] and ctx.image_mask.sum(1).tolist() == [22, 8, 36]
    alone = build_prompt_context(model, encode_prompts(bundle, ([images[2]], ["Sum the three?"])))
    part = ctx.prompts(2, 3)
    torch.testing.assert_close(part.image_embeds, alone.image_embeds)
    assert part.next_position.tolist() == alone.next_position.tolist()
    _check_pass(model, ctx, 3, False)


def _check_pass(model, ctx, G, checkpointing):
    """Shared-prefix against full-row on ``ctx``: hidden states, log-probs and LoRA gradients, the reference pass."""
    model = copy.deepcopy(model)
    if checkpointing:
        enable_gradient_checkpointing(model)
    d = model.config.text_config.hidden_size
    ids, mask = _completions(ctx.B, G, 300)
    weights = torch.randn(ctx.B * G, T, generator=torch.Generator().manual_seed(2))
    params = lora_parameters(model)
    with torch.no_grad():  # the reference pass's mode; hidden states first, then log-probs at a temperature
        h_full = completion_hidden_states(model, ctx, ids, mask, G)
        h_shared = shared_prefix_hidden_states(model, ctx, ids, mask, G)
        torch.testing.assert_close(h_shared * mask[..., None], h_full * mask[..., None], rtol=0,
                                   atol=4 * d * EPS32 * float(h_full.abs().max()))
    logp, grads = {}, {}
    for shared in (False, True):
        def loss(shared=shared):
            lp = completion_logprobs(model, ctx, ids, mask, G, temperature=0.7, shared_prefix=shared)
            (lp * weights).sum().backward()
            return lp.detach()
        logp[shared], grads[shared] = _grads(params, loss)
    assert (logp[True][mask == 0] == 0).all()
    torch.testing.assert_close(logp[True], logp[False], rtol=0, atol=4 * d * EPS32 * float(logp[False].abs().max()))
    gmax = max(float(g.abs().max()) for g in grads[False])
    assert gmax > 0 and all(float(g.abs().max()) > 0 for g in grads[True])
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=4 * d * G * EPS32 * gmax)
    with torch.no_grad():
        ref = [reference_logprobs(model, ctx, ids, mask, G, shared_prefix=s,
                                  ref_context=lambda: inject.disable_adapters(model)) for s in (True, False)]
    torch.testing.assert_close(ref[0], ref[1], rtol=0, atol=4 * d * EPS32 * float(ref[1].abs().max()))


def _count_mlp_calls(model):
    """MLP forwards with grad, in forward and in backward (the recompute runs no module hooks)."""
    counts = {"forward": 0, "backward": 0}

    def counting(forward):
        def wrapped(*args, **kwargs):
            if torch.is_grad_enabled():
                counts["backward" if torch._C._current_graph_task_id() >= 0 else "forward"] += 1
            return forward(*args, **kwargs)
        return wrapped

    for layer in model.model.language_model.layers:
        layer.mlp.forward = counting(layer.mlp.forward)
    return counts


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs (each storage once)."""
    seen: dict[int, torch.Tensor] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(t.untyped_storage().nbytes() for t in seen.values())


def test_checkpointing_recomputes_each_layer_once_and_keeps_less(tiny):
    """One MLP call per layer per pass (prompt and completions packed), once more in backward
    with checkpointing; the shared pass keeps less than the full-row pass."""
    model, ctx = tiny
    G = 4
    ids, mask = _completions(ctx.B, G, 300)
    kept = {}
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        if checkpointing:
            enable_gradient_checkpointing(m)
        counts = _count_mlp_calls(m)
        n_layers = len(m.model.language_model.layers)
        completion_logprobs(m, ctx, ids, mask, G).sum().backward()
        assert counts == {"forward": n_layers, "backward": n_layers if checkpointing else 0}
        for shared in (False, True):
            kept[checkpointing, shared] = _saved_bytes(
                lambda m=m, shared=shared: completion_logprobs(m, ctx, ids, mask, G, shared_prefix=shared))
    # packed tokens B*P + N*T against N*(P + T): what a checkpointed layer keeps is its input
    P, N = ctx.P, ctx.B * G
    ratio = (ctx.B * P + N * T) / (N * (P + T))
    assert kept[True, True] < (ratio + 0.1) * kept[True, False], (kept, ratio)
    assert kept[False, True] < kept[False, False], kept


def test_a_split_group_is_refused(tiny):
    model, ctx = tiny
    ids, mask = _completions(ctx.B, 3, 300)
    with pytest.raises(ValueError, match=r"expected \[B\*G, T\] = \[6, T\]"):
        completion_logprobs(model, ctx, ids[:5], mask[:5], 3)  # one group cut short
    with pytest.raises(ValueError, match=r"expected \[B\*G, T\] = \[3, T\]"):
        completion_logprobs(model, ctx.prompts(0, 1), ids, mask, 3)  # rows of another prompt


# ----------------------------------------------------------------------------- the 7B's widths


def _mrope_prompts(B: int, P: int, grid: tuple[int, int], vocab: int, image_token: int, d: int) -> PromptContext:
    """B left-padded prompts of unequal length: 2 text tokens, an image of grid (h, w) merged
    tokens, then text; M-RoPE positions as Qwen2.5-VL assigns them (the image's t/h/w grid, the
    running index advancing by max(h, w)). Visual features random."""
    gh, gw = grid
    gen = torch.Generator().manual_seed(5)
    ids = torch.zeros(B, P, dtype=torch.long)
    pos = torch.zeros(3, B, P, dtype=torch.long)
    attn = torch.zeros(B, P, dtype=torch.long)
    next_pos = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        n_text_after = P - 2 - gh * gw - 3 * b  # prompt b is 3*b tokens shorter
        start = 3 * b
        text = torch.randint(1, vocab, (2 + n_text_after,), generator=gen)
        seq = torch.cat([text[:2], torch.full((gh * gw,), image_token), text[2:]])
        ids[b, start:] = seq
        attn[b, start:] = 1
        p = [(i, i, i) for i in range(2)]
        p += [(2, 2 + i, 2 + j) for i in range(gh) for j in range(gw)]
        nxt = 2 + max(gh, gw)
        p += [(nxt + i,) * 3 for i in range(n_text_after)]
        pos[:, b, start:] = torch.tensor(p).T
        next_pos[b] = pos[:, b].max() + 1
    image_mask = ids == image_token
    feats = torch.randn(int(image_mask.sum()), d, generator=gen)
    return PromptContext(ids, attn, pos, next_pos, feats, image_mask)


@pytest.fixture(scope="module")
def qwen7b_widths():
    """Qwen2.5-VL-7B's text decoder at full width, 2 layers, a 512-token vocabulary (the
    vocabulary does not enter the pass's structure), a 1-block vision tower (unused: the
    visual features are given), LoRA r=4 with B off zero."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from bench.step import QWEN7B_TEXT, QWEN7B_VISION

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(QWEN7B_TEXT, num_hidden_layers=2, vocab_size=512, pad_token_id=0, bos_token_id=0,
                         eos_token_id=1),
        vision_config=dict(QWEN7B_VISION, depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           fullatt_block_indexes=[0]),
        image_token_id=511, video_token_id=510, vision_start_token_id=509, vision_end_token_id=508)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return _with_lora(model, seed=1)


def test_pass_equals_the_full_row_pass_at_7b_widths(qwen7b_widths):
    model = qwen7b_widths
    d = model.config.text_config.hidden_size
    B, G, P = 2, 2, 16
    ctx = _mrope_prompts(B, P, grid=(2, 3), vocab=500, image_token=511, d=d)
    ids, mask = _completions(B, G, 500)
    weights = torch.randn(B * G, T, generator=torch.Generator().manual_seed(3))
    params = lora_parameters(model)
    logp, grads = {}, {}
    for shared in (False, True):
        def loss(shared=shared):
            lp = completion_logprobs(model, ctx, ids, mask, G, shared_prefix=shared)
            (lp * weights).sum().backward()
            return lp.detach()
        logp[shared], grads[shared] = _grads(params, loss)
    torch.testing.assert_close(logp[True], logp[False], rtol=0, atol=4 * d * EPS32 * float(logp[False].abs().max()))
    gmax = max(float(g.abs().max()) for g in grads[False])
    assert gmax > 0
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=4 * d * G * EPS32 * gmax)


# ----------------------------------------------------------------------------- a real step


@pytest.fixture(scope="module")
def rollouts():
    """One rollout batch of 3 prompts x 4 (sampled as the micro-batch tests do: rewards of
    spread in every group, LoRA B off zero), once with scalar rewards, once with prefix rubrics."""
    from test_micro_batches import _config, _learner

    from data.synthetic import generate
    from grpo.rewards.compose import RewardBatch
    from grpo.step import sample_and_score
    from grpo_kernels.grpo_advantages import PrefixRubrics

    torch.manual_seed(0)
    ln = _learner(_config())
    rollout = sample_and_score(ln, generate("train", 1, 3, seed=0), temperature=1.0)
    N, T_ = rollout.out.completion_ids.shape
    total = torch.tensor([0.0, 1.0, 2.5, -1.0] * 3)
    rollout.scores = RewardBatch(total=total, components={"correctness": total}, weights={"correctness": 1.0})
    g = torch.Generator().manual_seed(3)
    state = {k: (0.05 * torch.randn(v.shape, generator=g) if k.endswith("lora_B.weight") else v.clone())
             for k, v in ln.bundle.model.state_dict().items()}
    prefixed = copy.deepcopy(rollout)
    prefixed.scores = RewardBatch(total=total, components={"correctness": total}, weights={"correctness": 1.0},
                                  prefix=PrefixRubrics(R_ans=total, s=torch.rand(N, 2, generator=g),
                                                       scored=torch.rand(N, 2, generator=g) > 0.2,
                                                       rho=torch.tensor([0.6, 0.4]),
                                                       t_end=torch.randint(0, T_, (N, 2), generator=g).int()))
    return (rollout, state), (prefixed, state)


@pytest.mark.parametrize("loss_type,mu,beta,correction,rubrics,rows", [
    ("grpo", 2, 0.04, "sequence", "sequence", 0), ("bnpo", 1, 0.04, "off", "prefix", 4),
    ("dr_grpo", 2, 0.0, "token", "sequence", 8), ("dapo", 2, 0.04, "off", "prefix", 0),
])
def test_grpo_step_equal_on_both_paths(rollouts, loss_type, mu, beta, correction, rubrics, rows):
    from test_micro_batches import _config, _run

    data = rollouts[1] if rubrics == "prefix" else rollouts[0]
    results = {}
    for shared in (False, True):
        cfg = _config(loss_type, mu, beta, correction)
        cfg.rewards.rubric_mode, cfg.optim.micro_batch_rows, cfg.optim.shared_prefix = rubrics, rows, shared
        results[shared] = _run(data, cfg)
    (full, full_grads, ln), (ours, our_grads, _) = results[False], results[True]
    d = ln.bundle.model.config.text_config.hidden_size
    N = data[0].out.completion_ids.shape[0]
    assert len(full.updates) == len(ours.updates) == mu
    for u in range(mu):
        gmax = max(float(g.abs().max()) for g in full_grads[u])
        assert gmax > 0, "no gradient: nothing is compared"
        for a, b in zip(our_grads[u], full_grads[u]):
            assert torch.allclose(a, b, rtol=0, atol=4 * d * EPS32 * gmax), (u, float((a - b).abs().max()), gmax)
        assert math.isclose(ours.updates[u].loss, full.updates[u].loss, rel_tol=N * 4 * d * EPS32, abs_tol=1e-6)
        for name, v in full.updates[u].stats[0].to_dict().items():
            assert math.isclose(float(getattr(ours.updates[u].stats[0], name)), float(v),
                                rel_tol=N * 4 * d * EPS32, abs_tol=1e-6), (name, u)


def test_dynamic_samplings_joined_rollouts_equal_on_both_paths(rollouts):
    """Dynamic sampling joins rollouts whose prompts have different padded lengths (each
    left-padded to the longest, concat_rollouts): both log-prob paths agree on the result."""
    import dataclasses

    from test_micro_batches import _config, _learner

    from data.synthetic import generate
    from grpo.rollout.dynamic_sampling import concat_rollouts
    from grpo.step import sample_and_score

    (first, state), _ = rollouts
    ln = _learner(_config(), state)
    torch.manual_seed(1)
    longer = [dataclasses.replace(ex, question=ex.question + " Read the figure carefully, then count twice.")
              for ex in generate("train", 3, 2, seed=5)]
    other = sample_and_score(ln, longer, temperature=1.0)
    assert other.out.context.P != first.out.context.P, "equal prompt lengths: the padding is not exercised"
    joined = concat_rollouts([first, other], ln.bundle.pad_token_id).out
    model = ln.bundle.model
    d = model.config.text_config.hidden_size
    params = lora_parameters(model)
    got = {}
    for shared in (False, True):
        for p in params:
            p.grad = None
        logp = completion_logprobs(model, joined.context, joined.completion_ids, joined.completion_mask, 4,
                                   shared_prefix=shared)
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        got[shared] = (logp.detach(), [p.grad.clone() for p in params])
    (full, full_g), (ours, our_g) = got[False], got[True]
    assert torch.allclose(ours, full, rtol=0, atol=4 * d * EPS32 * float(full.abs().max()))
    gmax = max(float(g.abs().max()) for g in full_g)
    assert gmax > 0
    assert all(torch.allclose(a, b, rtol=0, atol=4 * d * EPS32 * gmax) for a, b in zip(our_g, full_g))
