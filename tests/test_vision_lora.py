"""LoRA in the vision tower and merger (lora.vision, lora.merger): gradients against a plain
autograd reference, the tower once per prompt, checkpointing inside it, the reference's base
tower, the sampler (plain and merged) against generate, micro-batches and dynamic sampling's
selections, the optimiser's groups, a phase adding the adapters, and the one-line refusals."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from train_helpers import full_row_logits

from data.synthetic import generate
from grpo.errors import ConfigError
from grpo.model.logprobs import completion_logprobs, reference_logprobs
from grpo.model.policy import build_policy, check_policy_config
from grpo.model.prompts import encode_prompts
from grpo.model.vision import VISUAL, has_tower_lora, optimizer_groups, vision_subtrees
from grpo.presets import phase_preset
from grpo.rollout.dynamic_sampling import concat_rollouts
from grpo.rollout.merged import MergedRollout
from grpo.rollout.sampler import Rollout, sample, stop_token_ids
from lora import disable_adapters, load_lora_state_dict, lora_modules, lora_state_dict

EPS32 = torch.finfo(torch.float32).eps
G, B, T = 2, 3, 8


def _cfg(vision=True, merger=True):
    cfg = phase_preset("A")
    cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step = G, T, B
    cfg.model.device, cfg.lora.vision, cfg.lora.merger = "cpu", vision, merger
    cfg.optim.vision_lr_scale, cfg.optim.merger_lr_scale = 0.1, 0.5
    return cfg.validate()


def _non_zero_b(model, seed=3):
    """Every adapter's B random: the policy (tower included) differs from the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(0.05 * torch.randn(m.lora_B.shape, generator=g))


@pytest.fixture(scope="module")
def policy():
    bundle = build_policy(_cfg(), "cpu", verbose=False)  # the tiny model's fp32 base: exact comparisons
    _non_zero_b(bundle.model)
    prompts = encode_prompts(bundle, generate("train", 1, B, seed=0))
    out = sample(bundle, prompts, G=G, max_new_tokens=T, temperature=1.0, seed=0)
    return bundle, prompts, out


def _vision_params(model):
    return [p for n, m in lora_modules(model).items() if n.startswith(VISUAL + ".") for p in (m.lora_A, m.lora_B)]


def _weights(out):
    return torch.linspace(-1, 1, out.completion_ids.numel()).view_as(out.completion_ids.float())


def _grads(model, logp, w):
    params = _vision_params(model)
    return torch.autograd.grad((logp * w).sum(), params)


def test_the_switches_adapt_the_tower_and_merger_only_where_asked(policy):
    bundle, _, _ = policy
    names = [n for n in lora_modules(bundle.model) if n.startswith(VISUAL + ".")]
    blocks = len(bundle.model.model.visual.blocks)
    assert len([n for n in names if ".blocks." in n]) == 5 * blocks  # qkv, proj, gate, up, down per block
    assert sorted(n for n in names if ".merger." in n) == [f"{VISUAL}.merger.mlp.0", f"{VISUAL}.merger.mlp.2"]
    assert all(p.requires_grad for p in _vision_params(bundle.model))
    assert not any(p.requires_grad for n, p in bundle.model.named_parameters() if "lora_" not in n)
    off = build_policy(_cfg(vision=False, merger=False), "cpu", verbose=False)
    assert not has_tower_lora(off.model)
    merger_only = build_policy(_cfg(vision=False, merger=True), "cpu", verbose=False)
    assert {n for n in lora_modules(merger_only.model) if n.startswith(VISUAL)} == {
        f"{VISUAL}.merger.mlp.0", f"{VISUAL}.merger.mlp.2"}


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_vision_lora_gradients_equal_the_full_model_autograd_reference(policy, shared_prefix):
    """transformers' forward with the prompt and its pixels in every row (the tower per row, with
    grad) against the log-prob pass that runs the tower once per prompt."""
    bundle, prompts, out = policy
    model, w = bundle.model, _weights(out)
    logits = full_row_logits(bundle, prompts, out.completion_ids, out.completion_mask, G)
    ref = torch.log_softmax(logits, -1).gather(-1, out.completion_ids[..., None]).squeeze(-1) * out.completion_mask
    want = _grads(model, ref, w)
    logp = completion_logprobs(model, out.context, out.completion_ids, out.completion_mask, G,
                               shared_prefix=shared_prefix)
    got = _grads(model, logp, w)
    gmax = max(float(g.abs().max()) for g in want)
    assert gmax > 0
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=256 * EPS32 * gmax), float((a - b).abs().max() / gmax)
    assert torch.allclose(logp, ref, rtol=0, atol=1e-5)
    assert torch.allclose(logp.detach(), out.logprobs, rtol=0, atol=1e-5)  # the sampler's function


def _count_tower(model):
    calls = []
    handle = model.model.visual.register_forward_hook(
        lambda m, args, kwargs, output: calls.append((torch.is_grad_enabled(), args[0].shape[0])), with_kwargs=True)
    return calls, handle


def test_the_passes_run_the_tower_once_per_prompt_and_the_sampler_once(policy):
    bundle, prompts, out = policy
    model = bundle.model
    calls, handle = _count_tower(model)
    try:
        sample(bundle, prompts, G=G, max_new_tokens=T, temperature=1.0, seed=0)
        assert calls == [(False, prompts.pixel_values.shape[0])]  # B images, not B*G
        for shared_prefix in (True, False):
            calls.clear()
            completion_logprobs(model, out.context, out.completion_ids, out.completion_mask, G,
                                shared_prefix=shared_prefix)
            assert calls == [(True, prompts.pixel_values.shape[0])]
            calls.clear()
            sub = out.context.prompts(1, 3)  # a training micro-batch: its own prompts' images only
            completion_logprobs(model, sub, out.completion_ids[G:], out.completion_mask[G:], G,
                                shared_prefix=shared_prefix)
            assert calls == [(True, sub.vision.pixel_values.shape[0])]
            assert sub.vision.pixel_values.shape[0] == int(prompts.image_grid_thw[1:].prod(1).sum())
    finally:
        handle.remove()


def test_micro_batches_and_dynamic_selections_keep_their_prompts_images(policy):
    bundle, _, out = policy
    model, ctx = bundle.model, out.context
    with torch.no_grad():
        whole = completion_logprobs(model, ctx, out.completion_ids, out.completion_mask, G)
        part = completion_logprobs(model, ctx.prompts(1, 3), out.completion_ids[G:], out.completion_mask[G:], G)
        assert torch.equal(part, whole[G:])
        # dynamic sampling: prompts 2 and 0 selected, then joined with prompt 1's rollout
        pick = ctx.select([2, 0], trim=True)
        rows = torch.tensor([2 * G, 2 * G + 1, 0, 1])
        sel = completion_logprobs(model, pick, out.completion_ids[rows], out.completion_mask[rows], G)
        assert torch.allclose(sel, whole[rows], rtol=0, atol=1e-5)
        single = copy.copy(out)
        single.context = ctx.prompts(1, 2)
        for name in ("completion_ids", "completion_mask", "logprobs", "filtered_logprobs", "finished", "truncated"):
            setattr(single, name, getattr(out, name)[G : 2 * G])
        single.texts = out.texts[G : 2 * G]
        first = copy.copy(out)
        first.context = ctx.prompts(0, 1)
        for name in ("completion_ids", "completion_mask", "logprobs", "filtered_logprobs", "finished", "truncated"):
            setattr(first, name, getattr(out, name)[:G])
        first.texts = out.texts[:G]
        def scores(n):  # only the context and completions are read here; the rewards just ride along
            return SimpleNamespace(total=torch.zeros(n), components={}, weights={}, prefix=None, vetoed=None)

        joined = concat_rollouts([Rollout([None], first, scores(G)), Rollout([None], single, scores(G))],
                                 bundle.pad_token_id)
        j = joined.out
        got = completion_logprobs(model, j.context, j.completion_ids, j.completion_mask, G)
        assert torch.allclose(got, whole[: 2 * G], rtol=0, atol=1e-5)


def test_the_reference_sees_the_base_tower(policy):
    bundle, prompts, out = policy
    model = bundle.model
    ref = reference_logprobs(model, out.context, out.completion_ids, out.completion_mask, G,
                             ref_context=lambda: disable_adapters(model))
    base = build_policy(_cfg(vision=False, merger=False), "cpu", verbose=False)  # B = 0: the base itself
    base_ctx = sample(base, prompts, G=G, max_new_tokens=1, temperature=1.0, seed=0).context
    with torch.no_grad():
        want = completion_logprobs(base.model, base_ctx, out.completion_ids, out.completion_mask, G)
        # with only the language model's adapters off, the policy's tower still counts: not the reference
        lm = [m for n, m in lora_modules(model).items() if not n.startswith(VISUAL + ".")]
        for m in lm:
            m.disabled = True
        try:
            tower_on = completion_logprobs(model, out.context, out.completion_ids, out.completion_mask, G)
        finally:
            for m in lm:
                m.disabled = False
    assert torch.allclose(ref, want, rtol=0, atol=1e-5)
    assert float((tower_on - want).abs().max()) > 1e-3  # the tower's adapters change the log-probs


def _greedy_generate(bundle, prompts, n):
    out = bundle.model.generate(**prompts.model_inputs(), do_sample=False, max_new_tokens=n,
                                eos_token_id=stop_token_ids(bundle), pad_token_id=bundle.pad_token_id)
    return out[:, prompts.input_ids.shape[1]:]


@pytest.mark.parametrize("path", ["static", "hf", "merged"])
def test_the_sampler_with_vision_adapters_equals_generate(policy, path):
    bundle, prompts, _ = policy
    with torch.no_grad():
        want = _greedy_generate(bundle, prompts, T)
        if path == "merged":
            got = MergedRollout(bundle.model).sample(bundle, prompts, G=1, max_new_tokens=T, temperature=0.0)
        else:
            got = sample(bundle, prompts, G=1, max_new_tokens=T, temperature=0.0, decode=path)
    n = want.shape[1]
    assert torch.equal(got.completion_ids[:, :n] * got.completion_mask[:, :n], want * got.completion_mask[:, :n])
    # and the adapters matter: the tower off changes what the model reads
    with torch.no_grad(), disable_adapters(bundle.model):
        off = bundle.model.model.get_image_features(prompts.pixel_values, prompts.image_grid_thw, return_dict=True)
    assert not torch.allclose(torch.cat(off.pooler_output), got.context.image_embeds)


def _count_block_calls(model):
    counts = {"forward": 0, "backward": 0}

    def counting(forward):
        def wrapped(*args, **kwargs):
            if torch.is_grad_enabled():
                counts["backward" if torch._C._current_graph_task_id() >= 0 else "forward"] += 1
            return forward(*args, **kwargs)
        return wrapped

    for block in model.model.visual.blocks:
        block.mlp.forward = counting(block.mlp.forward)
    return counts


@pytest.mark.parametrize("checkpointing", [False, True])
def test_checkpointing_inside_the_tower_is_honoured(checkpointing):
    cfg = _cfg()
    cfg.model.gradient_checkpointing = checkpointing
    bundle = build_policy(cfg, "cpu", verbose=False)
    _non_zero_b(bundle.model)
    prompts = encode_prompts(bundle, generate("train", 1, 2, seed=1))
    out = sample(bundle, prompts, G=G, max_new_tokens=4, temperature=1.0, seed=0)
    counts = _count_block_calls(bundle.model)
    logp = completion_logprobs(bundle.model, out.context, out.completion_ids, out.completion_mask, G)
    (logp * _weights(out)).sum().backward()
    blocks = len(bundle.model.model.visual.blocks)
    assert counts == {"forward": blocks, "backward": blocks if checkpointing else 0}
    assert not bundle.model.training
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in _vision_params(bundle.model))


def test_optimizer_groups_give_the_tower_and_merger_their_learning_rates(policy):
    from grpo.rewards import RewardModel
    from grpo.step import Learner, grpo_step, sample_and_score

    cfg = _cfg()
    bundle = build_policy(cfg, "cpu", verbose=False)
    params = [p for p in bundle.model.parameters() if p.requires_grad]
    groups = optimizer_groups(bundle.model, params, cfg.optim)
    assert [(g["name"], g["lr_scale"]) for g in groups] == [("language", 1.0), ("vision", 0.1), ("merger", 0.5)]
    assert sum(len(g["params"]) for g in groups) == len(params)
    opt = torch.optim.AdamW(groups, lr=cfg.optim.lr)
    rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
    ln = Learner(bundle, opt, rewards, cfg, torch.Generator().manual_seed(0), backend="torch")
    grpo_step(ln, lambda n: sample_and_score(ln, generate("train", 1, n, seed=0), 1.0), step=0, temperature=1.0)
    assert [g["lr"] for g in opt.param_groups] == [cfg.optim.lr, cfg.optim.lr * 0.1, cfg.optim.lr * 0.5]
    plain = build_policy(_cfg(vision=False, merger=False), "cpu", verbose=False)
    lm = [p for p in plain.model.parameters() if p.requires_grad]
    assert optimizer_groups(plain.model, lm, cfg.optim) is lm  # the frozen tower: one group, as before


def test_a_phase_adds_vision_adapters_over_a_checkpoint_without_them():
    without = build_policy(_cfg(vision=False, merger=False), "cpu", verbose=False)
    _non_zero_b(without.model)
    saved = lora_state_dict(without.model)
    with_tower = build_policy(_cfg(), "cpu", verbose=False)
    load_lora_state_dict(with_tower.model, saved, new_under=VISUAL)
    for name, t in saved.items():
        assert torch.equal(with_tower.model.get_parameter(name), t)
    assert all(float(m.lora_B.detach().abs().max()) == 0 for n, m in lora_modules(with_tower.model).items()
               if n.startswith(VISUAL + "."))
    with pytest.raises(ValueError, match="missing"):  # without the permission: the strict check
        load_lora_state_dict(with_tower.model, saved)


def test_bad_vision_settings_are_one_line_each():
    cfg = _cfg()
    cfg.lora.vision_targets = ("attn.qkv", "nosuch")
    with pytest.raises(ConfigError, match="lora.vision_targets: pattern 'nosuch' matches no linear layer in "
                                          "model.visual.blocks") as err:
        check_policy_config(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="the model has no model.visual"):
        vision_subtrees(torch.nn.Sequential(torch.nn.Linear(2, 2)), _cfg().lora)
    for key, value, message in [("optim.vision_lr_scale", 0.0, "optim.vision_lr_scale=0.0: lora.vision trains"),
                                ("optim.merger_lr_scale", -1.0, "optim.merger_lr_scale=-1.0: must be > 0"),
                                ("lora.vision_targets", (), "lora.vision_targets='': name at least one")]:
        cfg = _cfg()
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
        with pytest.raises(ConfigError, match=message):
            cfg.validate()


def test_a_resume_or_later_phase_with_another_vision_setting_is_refused(tmp_path):
    from grpo.state.compat import RESUME_FIXED_FIELDS, _vision_diffs

    assert {"lora.vision", "lora.vision_targets", "lora.merger"} <= set(RESUME_FIXED_FIELDS)
    on = {"lora": {"vision": True, "vision_targets": ["attn.qkv"], "merger": True}}
    off = {"lora": {"vision": False, "vision_targets": ["attn.qkv"], "merger": False}}
    assert _vision_diffs(off, on) == []  # adding adapters: allowed (B = 0)
    assert _vision_diffs(on, off) == [
        "lora.vision: saved True, now False (its trained adapters would be dropped)",
        "lora.merger: saved True, now False (its trained adapters would be dropped)"]
    other = {"lora": {"vision": True, "vision_targets": ["attn.proj"], "merger": True}}
    assert _vision_diffs(on, other) == ["lora.vision_targets: saved ['attn.qkv'], now ['attn.proj']"]
