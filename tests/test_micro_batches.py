"""Training micro-batches, activation checkpointing that recomputes, logits that are never whole.

The sampler decodes a whole rollout batch (B prompts x G); the training passes take it
``optim.micro_batch_rows`` rows (whole groups) at a time, gradients accumulated. What is
pinned here:

- the pieces, model-free: the group slices, ``PromptContext.prompts``, ``Advantages.groups``
  and ``grpo.batches.loss_share``: for every aggregation and advantage mode, the shared losses of
  the micro-batches sum to the one-pass loss and their gradients to its gradient;
- a real ``grpo_step`` on the tiny model, the same rollouts trained in one pass and in
  micro-batches of one and two groups (uneven: 3 groups): equal loss, equal gradient of every
  update, equal logged statistics, for every loss type, with mu = 2, the KL reference pass
  and the rollout correction (in float64, and one case in float32: see "Why float64");
- activation checkpointing inside a real ``grpo_step``: every decoder layer's MLP runs again
  in backward (counted, not the flag), and the sampler's function is unchanged;
- what autograd keeps: with checkpointing far less than without, and with grad no
  [rows, T, V] logits tensor is kept, whatever the chunk.

Tolerances: the micro-batch path sums the same terms in another order. Float32 sums of n
terms of size |x| differ by ~n * eps * |x|, so each comparison allows a few eps (1.2e-7)
times the magnitude of what was summed (the largest gradient entry, the loss's terms); in
float64 the same multiple of float64's eps.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from train_helpers import spread_rollout, step_learner

from grpo.batches import loss_share, micro_batch_choices, micro_batch_groups, micro_batch_rows_fit
from grpo.model.logprobs import completion_logprobs
from grpo.presets import phase_preset
from grpo.step import Hooks, grpo_step
from grpo_kernels.grpo_advantages import AdvantageSource, PrefixRubrics, group_advantages
from grpo_kernels.grpo_loss import LOSS_TYPES, LossOptions, grpo_loss

EPS32 = torch.finfo(torch.float32).eps
G = 4


# ----------------------------------------------------------------------------- the pieces


def test_group_slices_cover_the_batch_in_whole_groups():
    assert micro_batch_groups(3, 4, 0) == micro_batch_groups(3, 4, 12) == micro_batch_groups(3, 4, 99) == [(0, 3)]
    assert micro_batch_groups(3, 4, 4) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batch_groups(3, 4, 8) == [(0, 2), (2, 3)]  # the last one shorter
    with pytest.raises(ValueError, match="rows=-1"):
        micro_batch_groups(3, 4, -1)
    # the config's rule and the memory plan's choices are the same rule
    assert micro_batch_choices(4, 2) == [8, 4, 2] == [r for r in range(8, 0, -1) if micro_batch_rows_fit(4, 2, r)]
    assert micro_batch_rows_fit(4, 2, 0) and micro_batch_rows_fit(4, 2, 64) and not micro_batch_rows_fit(4, 2, 6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mode", ["row", "prefix"])
@pytest.mark.parametrize("importance,correction", [("token", "off"), ("sequence", "sequence"), ("token", "token")])
def test_shared_micro_batch_losses_sum_to_the_one_pass_loss(loss_type, mode, importance, correction):
    gen = torch.Generator().manual_seed(7)
    B, T = 3, 9
    N = B * G
    mask = (torch.rand(N, T, generator=gen) > 0.3).long()
    mask[5] = 0  # a row with no active token
    logp = -torch.rand(N, T, generator=gen) * 3
    old = logp + 0.2 * torch.randn(N, T, generator=gen)  # mu > 1: the clip binds
    ref = logp + 0.1 * torch.randn(N, T, generator=gen)
    sampler = old + 0.05 * torch.randn(N, T, generator=gen)
    if mode == "row":
        adv = group_advantages(AdvantageSource(torch.randn(N, 1, generator=gen)), G, backend="torch")
    elif mode == "prefix":
        J = 2
        prefix = PrefixRubrics(R_ans=torch.randn(N, generator=gen), s=torch.rand(N, J, generator=gen),
                               scored=torch.rand(N, J, generator=gen) > 0.2, rho=torch.tensor([0.6, 0.4]),
                               t_end=torch.randint(0, T, (N, J), generator=gen).int(), a=0.5)
        adv = group_advantages(AdvantageSource.of_prefix(prefix), G, T=T, backend="torch")
    opts = dict(old_logp=old, ref_logp=ref, num_active_tokens=float(mask.sum()) + 5, sampler_logp=sampler,
                options=LossOptions(beta=0.04, loss_type=loss_type, importance=importance, max_len=12,
                                    correction=correction), backend="torch")
    x = logp.clone().requires_grad_()
    whole, _ = grpo_loss(x, mask.float(), adv, **opts)
    whole.backward()
    y = logp.clone().requires_grad_()
    parts = 0.0
    for b0, b1 in micro_batch_groups(B, G, G):
        rows = slice(b0 * G, b1 * G)
        sub = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
        loss, _ = grpo_loss(y[rows], mask[rows].float(), adv.groups(b0, b1), **sub)
        loss = loss * loss_share(loss_type, (b1 - b0) * G, float(mask[rows].sum()), N, float(mask.sum()), 1)
        loss.backward()
        parts = parts + float(loss.detach())
    assert y.grad.abs().max() > 0, "no gradient: nothing is compared"
    # the loss is a mean of N*T terms of size <= |A| ratio + beta kl: a few eps of their sum
    scale = float(x.grad.abs().sum() * mask.sum()) + 1.0
    assert math.isclose(parts, float(whole.detach()), abs_tol=8 * EPS32 * scale)
    assert torch.allclose(y.grad, x.grad, rtol=0, atol=8 * EPS32 * float(x.grad.abs().max()) * G)


def test_loss_share_is_exactly_one_for_one_pass_over_one_batch():
    for loss_type in LOSS_TYPES:
        assert loss_share(loss_type, 8, 17, 8, 17, 1) == 1.0
    assert loss_share("grpo", 4, 9, 8, 17, 1) == 0.5 and loss_share("grpo", 4, 9, 8, 17, 2) == 0.25
    assert loss_share("bnpo", 4, 9, 8, 18, 1) == 0.5 and loss_share("bnpo", 4, 0, 8, 0, 1) == 0.0
    assert loss_share("dapo", 4, 9, 8, 17, 3) == 1.0
    with pytest.raises(ValueError, match="loss_type='mean'"):
        loss_share("mean", 4, 9, 8, 17, 1)


# ----------------------------------------------------------------------------- a real step


_learner = step_learner


class _Record(Hooks):
    """The default one-process hooks, recording each update's gradient before the optimiser step."""

    def __init__(self):
        self.grads: list[list[torch.Tensor]] = []
        self.params: list[torch.nn.Parameter] = []

    def optimizer_step(self, opt, update, loss):
        self.grads.append([p.grad.detach().clone() for p in self.params])
        return super().optimizer_step(opt, update, loss)


def _config(loss_type="grpo", mu=1, beta=0.0, correction="off"):
    cfg = phase_preset("A")
    cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step = G, 10, 3
    cfg.optim.lr, cfg.model.device = 1e-3, "cpu"
    cfg.optim.loss_type, cfg.optim.updates_per_batch, cfg.optim.beta = loss_type, mu, beta
    cfg.optim.rollout_correction = correction
    return cfg


@pytest.fixture(scope="module")
def rollouts():
    """One rollout batch of 3 prompts x G, sampled once (LoRA B = 0: any setting samples the
    same), with rewards of guaranteed spread in every group so every update has a gradient,
    and a policy state whose LoRA B is non-zero (spread_rollout)."""
    torch.manual_seed(0)
    return spread_rollout(_learner(_config()), 3)


def _run(rollout_and_state, cfg, checkpointing=False, dtype=torch.float32):
    rollout, state = rollout_and_state
    ln = _learner(cfg, state, checkpointing)
    if dtype != torch.float32:
        ln.bundle.model.to(dtype)  # the same Parameter objects: the optimiser still holds them
        for m in ln.bundle.model.modules():  # rotary angles stay fp32, as transformers computes them: 5.17
            if isinstance(getattr(m, "inv_freq", None), torch.Tensor):  # multiplies inv_freq.float() by fp32
                m.inv_freq = m.inv_freq.to(torch.float32)  # positions (a matmul, no promotion)
        rollout = copy.deepcopy(rollout)
        rollout.out.context.image_embeds = rollout.out.context.image_embeds.to(dtype)
    hooks = _Record()
    hooks.params = ln.params
    result = grpo_step(ln, lambda n: copy.deepcopy(rollout), step=0, temperature=1.0, hooks=hooks)
    return result, hooks.grads, ln


@pytest.fixture
def float64(monkeypatch):
    """float64 end to end: ``Tensor.float()`` leaves a float64 tensor as it is while the test
    runs, so the log-softmax and the loss reference, which cast their inputs with it, compute
    in float64 too (their fp32 inputs, the advantages and the sampler's log-probs, promote)."""
    cast = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda self, *a, **k: self if self.dtype == torch.float64 else cast(self, *a, **k))
    return torch.float64


# Why float64. In float32, dapo with mu = 2 and one group per pass differed at update 2 by ~100
# eps x the largest gradient entry (update 1: 5). Not a slicing error: update 1's gradients,
# summed in another order, leave the parameters different in their last bits, so update 2's
# forward and backward round differently everywhere (its log-probs differ by 1-2 ulp where
# update 1's were bit for bit the same), and the gradient, a sum over every token, collects
# those differences. The same comparison in float64 agrees to 8 eps64 x that entry
# (4e-17); a wrong old_logp or token count per micro-batch would differ at O(1) in any dtype.
# So every case is held in float64 to 64 eps64 (1.4e-14 of the largest entry), and one in
# float32, the dtype a CPU run trains in, to 64 eps32.
@pytest.mark.parametrize("loss_type,mu,beta,correction", [
    ("grpo", 2, 0.04, "sequence"), ("bnpo", 1, 0.04, "off"), ("dr_grpo", 2, 0.0, "token"), ("dapo", 2, 0.04, "off"),
])
def test_micro_batches_equal_the_one_pass_update(rollouts, float64, loss_type, mu, beta, correction):
    _check_micro_batches_equal_one_pass(rollouts, _config(loss_type, mu, beta, correction), float64)


def test_micro_batches_equal_the_one_pass_update_in_float32(rollouts):
    _check_micro_batches_equal_one_pass(rollouts, _config("grpo", 2, 0.04, "sequence"), torch.float32)


def _check_micro_batches_equal_one_pass(rollouts, cfg, dtype, must_move=lambda ln: ln.params):
    """The same rollouts trained in one pass and in micro-batches of one and two groups, in
    ``dtype``: equal gradients (every parameter; ``must_move(learner)`` must get a non-zero
    one), losses and logged statistics in each of the mu updates."""
    eps, mu = torch.finfo(dtype).eps, cfg.optim.updates_per_batch
    whole, whole_grads, ln = _run(rollouts, cfg, dtype=dtype)
    moving = {id(p) for p in must_move(ln)}
    assert len(whole.updates) == mu and whole_grads[0][0].dtype == dtype
    for rows in (G, 2 * G):  # one group per pass; two groups then one (uneven)
        cfg.optim.micro_batch_rows = rows
        part, part_grads, _ = _run(rollouts, cfg, dtype=dtype)
        assert len(part.updates) == mu
        for u in range(mu):
            gmax = max(float(g.abs().max()) for g in whole_grads[u])
            assert max(float(g.abs().max()) for g, p in zip(whole_grads[u], ln.params) if id(p) in moving) > 0, \
                "no gradient: nothing is compared"
            for a, b in zip(part_grads[u], whole_grads[u]):
                assert torch.allclose(a, b, rtol=0, atol=64 * eps * gmax), (rows, u, float((a - b).abs().max()), gmax)
            tol = dict(rel_tol=1e-5, abs_tol=1e-6) if dtype == torch.float32 else dict(rel_tol=1e-12, abs_tol=1e-14)
            assert math.isclose(part.updates[u].loss, whole.updates[u].loss, **tol)
            for name, v in whole.updates[u].stats[0].to_dict().items():
                assert math.isclose(float(getattr(part.updates[u].stats[0], name)), float(v), **tol), (name, rows, u)


def test_micro_batches_with_vision_adapters_equal_the_one_pass_update(float64):
    """mu = 2 with LoRA in the vision tower and merger (lora.vision, lora.merger): each
    micro-batch reruns the tower on its own prompts' images; the tower's adapters get the one
    pass's gradient in both updates, the second taken after the first moved them. In float64,
    like the cases above: in float32 the second update differed by 71 eps x the largest entry
    on one CPU (an Intel Xeon; under 64 on an AMD EPYC), the last-bit drift explained above."""
    from grpo.model.vision import VISUAL
    from lora import lora_modules

    cfg = _config("grpo", 2, 0.04, "sequence")
    cfg.lora.vision = cfg.lora.merger = True
    torch.manual_seed(0)
    rollout = spread_rollout(_learner(cfg), 3)
    assert rollout[0].out.context.vision is not None  # the context keeps its images for the reruns

    def tower(ln):
        return [p for n, m in lora_modules(ln.bundle.model).items() if n.startswith(VISUAL + ".")
                for p in (m.lora_A, m.lora_B)]

    _check_micro_batches_equal_one_pass(rollout, cfg, float64, must_move=tower)


def test_micro_batch_rows_must_be_whole_groups_dividing_the_batch():
    from grpo.errors import ConfigError

    cfg = _config()
    for bad in (-1, 3, 8):  # negative; not whole groups; 8 does not divide 3 x 4 = 12
        cfg.optim.micro_batch_rows = bad
        with pytest.raises(ConfigError, match=f"optim.micro_batch_rows={bad}"):
            cfg.validate()
    for good in (4, 12, 32):  # a group; the batch; more than the batch (one pass, e.g. a preset's value)
        cfg.optim.micro_batch_rows = good
        cfg.validate()


# ----------------------------------------------------------------------------- checkpointing


def _count_mlp_calls(model):
    """Count the language model's MLP forwards with grad, in forward and in backward. The
    forward method itself is wrapped: torch's recompute does not run module hooks."""
    counts = {"forward": 0, "backward": 0}

    def counting(forward):
        def wrapped(*args, **kwargs):
            if torch.is_grad_enabled():  # the sampler's no-grad decode is not counted
                counts["backward" if torch._C._current_graph_task_id() >= 0 else "forward"] += 1
            return forward(*args, **kwargs)
        return wrapped

    layers = model.model.language_model.layers
    for layer in layers:
        layer.mlp.forward = counting(layer.mlp.forward)
    return counts, len(layers)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_checkpointing_recomputes_every_layer_inside_a_real_step(rollouts, checkpointing):
    cfg = _config("grpo", 1, 0.0)
    cfg.optim.micro_batch_rows = G  # 3 training micro-batches
    rollout, state = rollouts
    ln = _learner(cfg, state, checkpointing)
    counts, n_layers = _count_mlp_calls(ln.bundle.model)
    hooks = _Record()
    hooks.params = ln.params
    grpo_step(ln, lambda n: copy.deepcopy(rollout), step=0, temperature=1.0, hooks=hooks)
    assert counts["forward"] == 3 * n_layers
    assert counts["backward"] == (3 * n_layers if checkpointing else 0)
    assert not ln.bundle.model.training  # the pass with grad gave every module its mode back
    if checkpointing:  # and the recomputed update is the plain one
        _, plain_grads, _ = _run(rollouts, cfg, checkpointing=False)
        gmax = max(float(g.abs().max()) for g in plain_grads[0])
        assert all(torch.allclose(a, b, rtol=0, atol=8 * EPS32 * gmax) for a, b in zip(hooks.grads[0], plain_grads[0]))


def _saved_bytes(fn):
    """What autograd keeps for backward while ``fn`` runs: (total bytes, shapes), via saved-tensor hooks."""
    seen: dict[int, torch.Tensor] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t)  # one storage counted once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    total = sum(t.untyped_storage().nbytes() for t in seen.values())
    return total, [tuple(t.shape) for t in seen.values()], out


def test_what_autograd_keeps_checkpointing_and_chunked_logits(rollouts):
    rollout, state = rollouts
    cfg = _config()
    out = rollout.out
    kept = {}
    for checkpointing in (False, True):
        ln = _learner(cfg, state, checkpointing)
        model = ln.bundle.model
        V = model.get_output_embeddings().weight.shape[0]
        for chunk in (1, 10_000):  # one row per chunk; every row in one chunk
            total, shapes, logp = _saved_bytes(lambda model=model, chunk=chunk: completion_logprobs(
                model, out.context, out.completion_ids, out.completion_mask, G, chunk_tokens=chunk))
            assert logp.requires_grad
            # no logits are kept for backward: the chunks recompute them
            assert not [s for s in shapes if s and s[-1] == V], shapes
            kept[checkpointing, chunk] = total
    # checkpointing keeps each layer's input instead of everything inside the layer
    assert kept[True, 1] < 0.5 * kept[False, 1] and kept[True, 10_000] < 0.5 * kept[False, 10_000], kept


def test_the_training_pass_is_the_samplers_function(rollouts):
    """Training mode (checkpointing on) and the sampler's eval mode give the same log-probs."""
    rollout, state = rollouts
    out = rollout.out
    ln = _learner(_config(), state, checkpointing=True)
    model = ln.bundle.model
    with torch.no_grad():
        evaluated = completion_logprobs(model, out.context, out.completion_ids, out.completion_mask, G)
    trained = completion_logprobs(model, out.context, out.completion_ids, out.completion_mask, G)
    assert trained.requires_grad
    assert torch.allclose(trained.detach(), evaluated, rtol=0, atol=1e-5)
