"""The log line's policy entropy, and ``optim.mask_truncated``.

- Entropy: the chunked log-prob pass returns H_t = -sum_v p_v log p_v of the softmax its
  log-probs are taken from (the same temperature), equal to torch.distributions.Categorical
  on the whole [N, T, V] logits of transformers' own forward; with grad (each chunk
  checkpointed) it is the same and carries no gradient; a real step logs the same token mean
  whether it runs one pass or micro-batches, the shared-prefix pass or the full-row one.
- mask_truncated: a truncated row's tokens get no gradient at all, every other row's gradient
  is the one it gets with the option off (grpo aggregation: a mean over rows, which still
  counts the masked row), the row's advantage still shapes its group's, and a step whose rows
  are all truncated trains nothing instead of dividing 0 by 0.

Tolerances: two passes compute the same fp32 logits in another order; H moves by at most
2 log V / temperature times the largest logit change (dH/dz_v = -p_v (log p_v + H), whose
absolute values sum to <= 2H <= 2 log V), measured here, plus the entropy's own rounding: a
pairwise sum over V of terms summing to H <= log V, ~log2(V) eps (1.2e-7) each.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import full_row_logits, spread_rollout, step_learner

from grpo.distributed import DataParallel
from grpo.errors import ConfigError
from grpo.model.load import ModelBundle, load_bundle
from grpo.model.logprobs import completion_hidden_states, completion_logprobs
from grpo.model.prompt_context import build_prompt_context
from grpo.model.prompts import encode_prompts
from grpo.model.shared_prefix import shared_prefix_hidden_states
from grpo.overrides import apply_overrides, parse_override_args
from grpo.presets import phase_preset
from grpo.run.records import progress_line, step_record
from grpo.step import grpo_step

EPS32 = torch.finfo(torch.float32).eps
G = 4


def entropy_tol(z_a: torch.Tensor, z_b: torch.Tensor, temperature: float = 1.0) -> float:
    """What two entropies of logits z_a and z_b (the same numbers, summed another way) may differ by."""
    V = z_a.shape[-1]
    dz = float((z_a - z_b).abs().max()) + 4 * EPS32 * float(z_a.abs().max())
    return 2 * math.log(V) * dz / temperature + 4 * math.log2(V) * EPS32 * math.log(V)


# ----------------------------------------------------------------------------- entropy of the chunked pass


@pytest.fixture(scope="module")
def tiny():
    base = load_bundle("tiny")
    bundle = ModelBundle(model=copy.deepcopy(base.model), tokenizer=base.tokenizer,
                         image_processor=base.image_processor, source="tiny")
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, size=(112, 112, 3), dtype=np.uint8)) for _ in range(2)]
    prompts = encode_prompts(bundle, (images, ["How many circles?", "What is the sum?"]))
    ids = torch.randint(0, 300, (2 * G, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0  # completions that stopped early: their padding must not count
    mask[6, 1:] = 0
    return bundle, prompts, ids.masked_fill(mask == 0, bundle.pad_token_id), mask


def _full_logits(bundle, prompts, ids, mask) -> torch.Tensor:
    """transformers' own forward, the prompt in every row: [N, T, V] logits at the positions
    that predict the completion tokens, all at once."""
    with torch.no_grad():
        return full_row_logits(bundle, prompts, ids, mask, G)


@pytest.mark.parametrize("chunk_tokens,temperature,shared", [(1, 1.0, True), (6, 0.7, False), (10_000, 1.3, True)])
def test_entropy_equals_categorical_on_the_whole_logits(tiny, chunk_tokens, temperature, shared):
    bundle, prompts, ids, mask = tiny
    logits = _full_logits(bundle, prompts, ids, mask)
    gold = torch.distributions.Categorical(logits=logits / temperature).entropy() * mask
    ctx = build_prompt_context(bundle.model, prompts)
    with torch.no_grad():  # this path's logits, all at once: how far they are from transformers'
        hidden = (shared_prefix_hidden_states if shared else completion_hidden_states)(bundle.model, ctx, ids, mask, G)
        ours = bundle.model.get_output_embeddings()(hidden).float()
    tol = entropy_tol(logits[mask == 1], ours[mask == 1], temperature)  # padding's logits are not compared
    with torch.no_grad():
        logp, ent = completion_logprobs(bundle.model, ctx, ids, mask, G, temperature=temperature,
                                        chunk_tokens=chunk_tokens, shared_prefix=shared, entropy=True)
    assert ent.shape == ids.shape and ent.dtype == torch.float32 and (ent[mask == 0] == 0).all()
    assert float(gold.sum() / mask.sum()) > 100 * tol, "entropies too small to compare"
    torch.testing.assert_close(ent, gold, rtol=0, atol=tol)
    # the log line's number: the token mean over completion tokens
    assert abs(float(ent.sum() / mask.sum()) - float(gold.sum() / mask.sum())) <= tol
    # the log-probs are those of entropy=False, bit for bit (the entropy only reads the chunk)
    with torch.no_grad():
        plain = completion_logprobs(bundle.model, ctx, ids, mask, G, temperature=temperature,
                                    chunk_tokens=chunk_tokens, shared_prefix=shared)
    assert torch.equal(logp, plain)


def test_entropy_with_grad_is_the_same_and_carries_none(tiny, monkeypatch):
    """The pass with grad checkpoints each chunk: backward recomputes its logits, not its
    entropies (taken once per chunk, detached); the gradient is the log-probs' alone."""
    import grpo.model.logprobs as lp

    bundle, prompts, ids, mask = tiny
    ctx = build_prompt_context(bundle.model, prompts)
    params = [p for p in bundle.model.parameters() if p.requires_grad]
    with torch.no_grad():
        _, gold = completion_logprobs(bundle.model, ctx, ids, mask, G, chunk_tokens=6, entropy=True)
    calls, real = [], lp.token_entropy
    monkeypatch.setattr(lp, "token_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    logp, ent = completion_logprobs(bundle.model, ctx, ids, mask, G, chunk_tokens=6, entropy=True)
    assert logp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(ent, gold, rtol=0, atol=0)
    with_ent = torch.autograd.grad(logp.sum(), params, allow_unused=True)
    assert len(calls) == 2 * G  # one chunk per row (6 tokens): once each, forward only
    plain = completion_logprobs(bundle.model, ctx, ids, mask, G, chunk_tokens=6)
    without = torch.autograd.grad(plain.sum(), params, allow_unused=True)
    assert any(g is not None and g.abs().max() > 0 for g in with_ent)
    for a, b in zip(with_ent, without):
        assert (a is None and b is None) or torch.equal(a, b)


# ----------------------------------------------------------------------------- the entropy bonus's gradient


def _grads(loss, params):
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


@pytest.mark.parametrize("chunk_tokens,temperature,shared", [(6, 1.0, True), (12, 0.7, False), (1, 1.3, True),
                                                             (10_000, 1.0, False)])
def test_entropy_gradient_equals_autograd_through_categorical(tiny, monkeypatch, chunk_tokens, temperature, shared):
    """entropy="grad": the entropies' gradient through the chunked pass (each chunk checkpointed,
    its entropy's backward recomputed a block at a time) equals autograd through
    torch.distributions.Categorical(logits=...).entropy() on the whole [N, T, V] logits of
    transformers' own forward, weighted per token; either pass; each chunk's entropies computed
    once (the recompute in backward reuses them) on that chunk's rows only."""
    import grpo.model.logprobs as lp

    bundle, prompts, ids, mask = tiny
    # the language model's parameters: the pass reuses the prompt's visual tokens (no vision tower rerun)
    params = [p for name, p in bundle.model.named_parameters() if p.requires_grad and "visual" not in name]
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) * mask  # any per-token weights
    gold_logits = full_row_logits(bundle, prompts, ids, mask, G)
    gold_H = torch.distributions.Categorical(logits=gold_logits / temperature).entropy()
    gold = _grads((gold_H * w).sum(), params)
    calls, real = [], lp._EntropyWithGrad.forward
    monkeypatch.setattr(lp._EntropyWithGrad, "forward",
                        staticmethod(lambda c, z, *a: calls.append((z.shape[0], a[-1] is None)) or real(c, z, *a)))
    ctx = build_prompt_context(bundle.model, prompts)
    logp, ent = completion_logprobs(bundle.model, ctx, ids, mask, G, temperature=temperature,
                                    chunk_tokens=chunk_tokens, shared_prefix=shared, entropy="grad")
    assert ent.requires_grad
    ours = _grads((ent * w).sum(), params)
    rows = max(1, chunk_tokens // ids.shape[1])
    first = [r for r, fresh in calls if fresh]
    assert len(first) == -(-2 * G // rows) and all(r <= rows for r, _ in calls)  # once per chunk, chunk-sized
    with torch.no_grad():  # the values: those of the detached entropies, bit for bit
        _, plain = completion_logprobs(bundle.model, ctx, ids, mask, G, temperature=temperature,
                                       chunk_tokens=chunk_tokens, shared_prefix=shared, entropy=True)
    assert torch.equal(ent.detach(), plain)
    scale = max(float(g.abs().max()) for g in gold)
    assert scale > 0
    for a, b in zip(ours, gold):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


# ----------------------------------------------------------------------------- a real step


def _config(mask_truncated=False, loss_type="grpo"):
    cfg = phase_preset("A")
    cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step = G, 10, 2
    cfg.optim.lr, cfg.model.device = 1e-3, "cpu"
    cfg.optim.mask_truncated, cfg.optim.loss_type = mask_truncated, loss_type
    return cfg


_learner = step_learner


@pytest.fixture(scope="module")
def rollouts():
    """One rollout batch of 2 prompts x G with rewards of spread in both groups, and a policy
    whose LoRA B is non-zero (so the policy is not the base)."""
    torch.manual_seed(0)
    return spread_rollout(_learner(_config()), 2)


def _step(rollouts, cfg, truncated=None, monkeypatch=None):
    """grpo_step on a copy of the rollouts (``truncated``: the sampler's flags replaced, so that
    chosen rows count as truncated); returns the result, d loss / d logp [N, T] of the policy
    pass (one micro-batch) and the learner."""
    rollout, state = rollouts
    r = copy.deepcopy(rollout)
    if truncated is not None:
        r.out.truncated = torch.tensor(truncated)
    ln = _learner(cfg, state)
    kept = []
    if monkeypatch is not None:
        import grpo.step

        real = grpo.step.completion_logprobs

        def keep_grad(*args, **kwargs):
            logp, ent = real(*args, **kwargs)
            logp.retain_grad()
            kept.append(logp)
            return logp, ent

        monkeypatch.setattr(grpo.step, "completion_logprobs", keep_grad)
    result = grpo_step(ln, lambda n: r, step=0, temperature=1.0)
    return result, (kept[0].grad if kept else None), ln


def _token_mean_entropy(result, cfg) -> float:
    return step_record("A", 0, result, {"correctness": 1.0}, 1.0, cfg.optim.lr, {"step": 1.0},
                       DataParallel(), cfg)["entropy"]


def test_step_entropy_is_the_same_in_micro_batches_and_either_pass(rollouts):
    cfg = _config()
    gold, _, ln = _step(rollouts, cfg)
    r = rollouts[0]
    args = (ln.bundle.model, r.out.context, r.out.completion_ids, r.out.completion_mask, G)
    with torch.no_grad():  # the two passes' logits: how far apart summing in another order puts them
        z_full = ln.bundle.model.get_output_embeddings()(completion_hidden_states(*args))
        z_shared = ln.bundle.model.get_output_embeddings()(shared_prefix_hidden_states(*args))
    on = r.out.completion_mask == 1
    tol = 2 * entropy_tol(z_full[on], z_shared[on])  # twice: micro-batches reorder sums as much again
    H = _token_mean_entropy(gold, cfg)
    assert 100 * tol < H <= math.log(z_full.shape[-1])
    for rows, shared in ((G, True), (0, False), (G, False)):
        cfg.optim.micro_batch_rows, cfg.optim.shared_prefix = rows, shared
        other, _, _ = _step(rollouts, cfg)
        torch.testing.assert_close(other.logs[0].entropy, gold.logs[0].entropy, rtol=0, atol=tol)
        assert abs(_token_mean_entropy(other, cfg) - H) <= tol, (rows, shared)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_entropy_bonus_adds_minus_coef_times_the_aggregated_entropys_gradient(rollouts, loss_type):
    """optim.entropy_coef = c: the step's gradient is the one without the bonus minus c times
    the gradient of the policy's entropy aggregated as the loss type aggregates its tokens
    (grpo_kernels.grpo_loss.aggregate), the entropy taken here by Categorical on the whole logits
    of the full-row pass in one piece, while the step runs two micro-batches (each its share)
    through the chunked shared-prefix pass. The logged entropy does not change."""
    from grpo_kernels.grpo_loss import LossOptions, aggregate

    c = 0.05
    cfg = _config(loss_type=loss_type)
    cfg.optim.grad_clip = 0.0  # the raw gradients are compared
    plain, _, ln0 = _step(rollouts, cfg)
    cfg.optim.entropy_coef, cfg.optim.micro_batch_rows = c, G
    bonus, _, ln1 = _step(rollouts, cfg)
    r, ln = rollouts[0], _learner(cfg, rollouts[1])
    mask = r.out.completion_mask
    hidden = completion_hidden_states(ln.bundle.model, r.out.context, r.out.completion_ids, mask, G)
    H = torch.distributions.Categorical(logits=ln.bundle.model.get_output_embeddings()(hidden).float()).entropy()
    opts = LossOptions(loss_type=loss_type, max_len=cfg.sampling.max_new_tokens)
    gold = torch.autograd.grad(aggregate(H, mask, opts, float(mask.sum())), ln.params)
    scale = max(float(g.abs().max()) for g in gold)
    assert scale > 0
    for p0, p1, g in zip(ln0.params, ln1.params, gold):
        torch.testing.assert_close(p1.grad - p0.grad, -c * g, rtol=1e-3, atol=1e-4 * c * scale)
    torch.testing.assert_close(bonus.logs[0].entropy, plain.logs[0].entropy, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- optim.mask_truncated

ONE_TRUNCATED = [False, True, False, False, False, False, False, False]  # row 1: advantage > 0 in its group


def test_loss_mask_drops_exactly_the_truncated_rows(rollouts):
    out = copy.deepcopy(rollouts[0].out)
    out.truncated = torch.tensor(ONE_TRUNCATED)
    assert out.loss_mask(False) is out.completion_mask
    m = out.loss_mask(True)
    assert int(m[1].sum()) == 0 and int(out.completion_mask[1].sum()) > 0
    assert torch.equal(m[[0, *range(2, 2 * G)]], out.completion_mask[[0, *range(2, 2 * G)]])


def test_a_truncated_row_gets_no_gradient_and_the_others_theirs(rollouts, monkeypatch):
    on, grad_on, _ = _step(rollouts, _config(True), ONE_TRUNCATED, monkeypatch)
    off, grad_off, _ = _step(rollouts, _config(False), ONE_TRUNCATED, monkeypatch)
    assert float(grad_off[1].abs().max()) > 0, "the row has no gradient without the option: nothing is tested"
    assert torch.equal(grad_on[1], torch.zeros_like(grad_on[1]))
    # grpo: per-row means, then the mean over all 2G rows, the masked one included (as TRL);
    # the advantages are z-scores over the whole group, the truncated row's reward included.
    # So every other row's gradient, -A_i / (n_i 2G) per token, is exactly the one it gets
    # with the option off (leaving the row out of its group's mean and std would move it).
    others = [0, *range(2, 2 * G)]
    torch.testing.assert_close(grad_on[others], grad_off[others], rtol=0, atol=0)


def test_with_a_token_mean_the_masked_tokens_leave_the_denominator(rollouts, monkeypatch):
    """bnpo divides by the active tokens: masking a row shrinks the denominator, so every other
    row's gradient grows by exactly M_off / M_on."""
    on, grad_on, _ = _step(rollouts, _config(True, "bnpo"), ONE_TRUNCATED, monkeypatch)
    off, grad_off, _ = _step(rollouts, _config(False, "bnpo"), ONE_TRUNCATED, monkeypatch)
    mask = rollouts[0].out.completion_mask
    M_off, M_on = float(mask.sum()), float(mask.sum() - mask[1].sum())
    others = [0, *range(2, 2 * G)]
    assert torch.equal(grad_on[1], torch.zeros_like(grad_on[1]))
    g = float(grad_off[others].abs().max())
    torch.testing.assert_close(grad_on[others], grad_off[others] * (M_off / M_on), rtol=0, atol=8 * EPS32 * g)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_step_of_truncated_rows_only_trains_nothing(rollouts, loss_type):
    result, _, ln = _step(rollouts, _config(True, loss_type), [True] * (2 * G))
    assert result.loss == 0 and len(result.updates) == 1
    assert all(p.grad is None or float(p.grad.abs().max()) == 0 for p in ln.params)


def test_the_log_line_has_entropy_and_the_masked_fraction(rollouts):
    for on in (False, True):
        cfg = _config(on)
        result, _, _ = _step(rollouts, cfg, ONE_TRUNCATED)
        rec = step_record("A", 0, result, {"correctness": 1.0}, 1.0, cfg.optim.lr, {"step": 1.0}, DataParallel(), cfg)
        line = progress_line("A", 0, 1, rec)
        assert f"ent {rec['entropy']:.2f}" in line and rec["entropy"] > 0
        assert ("masked_truncated" in rec) == on and ("masked 0.12" in line) == on  # 1 of 8
        if on:
            assert rec["masked_truncated"] == 1 / 8


def test_the_option_parses_and_defaults_off():
    cfg = phase_preset("B")
    assert cfg.optim.mask_truncated is False
    apply_overrides(cfg, parse_override_args(["--optim.mask_truncated", "true"]))
    assert cfg.validate().optim.mask_truncated is True
    with pytest.raises(ConfigError, match="mask_truncated"):
        apply_overrides(cfg, parse_override_args(["--optim.mask_truncated", "maybe"]))
