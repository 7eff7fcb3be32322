"""NoisyRollout (grpo/rollout/noisy.py, sampling.noisy_fraction / noise_std): which rows are
sampled from the noisy image, the noise's formula and schedule, the rows' order in the joined
output, the log-prob passes conditioning every row on the clean image, the trainer's wiring
and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from train_helpers import full_row_logits, log_lines, run_main

from data.synthetic import generate
from grpo.errors import ConfigError
from grpo.model.logprobs import completion_logprobs
from grpo.model.policy import build_policy
from grpo.model.prompts import encode_prompts
from grpo.presets import phase_preset
from grpo.rollout.noisy import NoisyRollout, noise_std_at, noisy_count, noisy_rows
from grpo.rollout.sampler import sample
from lora import lora_modules

G, B, T = 4, 2, 8


def test_the_schedule_and_the_noisy_rows():
    assert noise_std_at(0, 11, 0.5) == 0.5
    assert noise_std_at(5, 11, 0.5) == pytest.approx(0.25)
    assert noise_std_at(10, 11, 0.5) == 0.0  # gone by the phase's last step
    assert noise_std_at(0, 1, 0.5) == 0.5  # a one-step phase: the first step's noise
    assert noisy_count(0.5, 8) == 4 and noisy_count(0.25, 8) == 2
    assert noisy_rows(2, 4, 1).tolist() == [False, False, False, True] * 2


class _Recording:
    """The inner sampler, recording each call's images, G, output and the generator's state
    when the call returned (the noise is drawn from it next)."""

    def __init__(self):
        self.calls, self.sampler_logprobs = [], []

    def __call__(self, bundle, prompts, *, G, generator=None, **kw):
        out = sample(bundle, prompts, G=G, generator=generator, **kw)
        self.calls.append((prompts.pixel_values.clone(), G, out, generator.get_state()))
        self.sampler_logprobs.append(out.logprobs.clone())
        return out


def _policy(vision=False):
    cfg = phase_preset("A")
    cfg.model.device, cfg.lora.vision = "cpu", vision
    bundle = build_policy(cfg.validate(), "cpu", verbose=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a policy that is not the base: its tower adapters (if any) matter too
        for m in lora_modules(bundle.model).values():
            m.lora_B.copy_(0.05 * torch.randn(m.lora_B.shape, generator=g))
    return bundle


@pytest.fixture(scope="module")
def noisy_batch():
    bundle = _policy()
    prompts = encode_prompts(bundle, generate("train", 1, B, seed=0))
    inner = _Recording()
    rollout = NoisyRollout(inner, fraction=0.25, std=0.8, steps=5)
    rollout.step = 1
    gen = torch.Generator().manual_seed(0)
    out = rollout(bundle, prompts, G=G, max_new_tokens=T, temperature=1.0, generator=gen)
    return bundle, prompts, inner, out


def test_one_row_per_group_is_sampled_from_the_image_plus_gaussian_noise(noisy_batch):
    _, prompts, inner, _ = noisy_batch
    (clean_px, clean_G, _, state), (noisy_px, noisy_G, _, _) = inner.calls
    assert (clean_G, noisy_G) == (3, 1)  # round(.25 * 4) noisy, the rest clean
    assert torch.equal(clean_px, prompts.pixel_values)
    sigma = 0.8 * (1 - 1 / 4)  # step 1 of 5: noise_std * (1 - t / (S - 1))
    eps = torch.randn(clean_px.shape, generator=torch.Generator().set_state(state))
    assert torch.allclose(noisy_px, clean_px + sigma * eps, rtol=0, atol=1e-6)
    assert float((noisy_px - clean_px).std()) == pytest.approx(sigma, rel=0.05)  # the noise really is there


def test_each_group_holds_its_clean_rows_then_its_noisy_row_on_the_clean_context(noisy_batch):
    _, _, inner, out = noisy_batch
    (_, _, clean, _), (_, _, noisy, _) = inner.calls
    assert out.G == G and out.completion_ids.shape[0] == B * G
    assert out.context is clean.context and out.prompt_index.tolist() == [0] * G + [1] * G
    for b in range(B):
        for k in range(G):
            src, j = (clean, b * 3 + k) if k < 3 else (noisy, b)
            n = int(src.completion_mask[j].sum())
            assert torch.equal(out.completion_ids[b * G + k, :n], src.completion_ids[j, :n])
            assert torch.equal(out.logprobs[b * G + k, :n], src.logprobs[j, :n])
            assert int(out.completion_mask[b * G + k].sum()) == n
            assert out.texts[b * G + k] == src.texts[j]


def test_the_log_prob_passes_condition_every_row_on_the_clean_image(noisy_batch):
    """Training is on the clean image (the paper): every row's log-probs recomputed for the loss
    are transformers' forward on the clean pixels; a noisy row's sampler log-probs, which the
    rollout correction compares them with, are replaced by those same clean-image ones (weight
    1), while the noisy sampler's own were another image's."""
    bundle, prompts, inner, out = noisy_batch
    with torch.no_grad():
        logp = completion_logprobs(bundle.model, out.context, out.completion_ids, out.completion_mask, G)
        logits = full_row_logits(bundle, prompts, out.completion_ids, out.completion_mask, G)
    ref = torch.log_softmax(logits, -1).gather(-1, out.completion_ids[..., None]).squeeze(-1) * out.completion_mask
    assert torch.allclose(logp, ref, rtol=0, atol=1e-5)
    assert torch.allclose(out.logprobs, logp, rtol=0, atol=1e-5)  # clean rows: the sampler's function; noisy: replaced
    rows = noisy_rows(B, G, 1)
    under_noise = inner.sampler_logprobs[1]  # [B, T'] the noisy sampler's own, row b = prompt b's noisy row
    n = under_noise.shape[1]
    assert float((logp[rows][:, :n] - under_noise).abs().max()) > 1e-3  # sampled under another image


def test_with_tower_adapters_the_kept_images_are_the_clean_ones():
    bundle = _policy(vision=True)
    prompts = encode_prompts(bundle, generate("train", 1, B, seed=0))
    out = NoisyRollout(sample, 0.5, 0.5, 3)(bundle, prompts, G=G, max_new_tokens=T, temperature=1.0,
                                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.context.vision.pixel_values, prompts.pixel_values)  # the tower's rerun reads them


def test_the_trainer_samples_noisy_groups_and_trains(tmp_path, monkeypatch):
    import grpo.rollout.noisy as noisy_mod

    sigmas = []
    real = noisy_mod.noisy_prompts
    monkeypatch.setattr(noisy_mod, "noisy_prompts", lambda p, s, g: sigmas.append(s) or real(p, s, g))
    rc, out, err = run_main(tmp_path, "--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4",
                            "--sampling.G", "4", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
                            "--phase", "A", "--phase.steps", "3", "--run.eval_every", "3", "--run.test_per_stage", "0",
                            "--sampling.noisy_fraction", "0.5", "--sampling.noise_std", "0.4")
    assert rc == 0, err
    assert sigmas == pytest.approx([0.4, 0.2, 0.0])  # one noisy sampling per step, annealed to 0
    assert len([r for r in log_lines(tmp_path) if r.get("phase") == "A" and "loss" in r]) == 3


@pytest.mark.parametrize("options,message", [
    ({"noisy_fraction": 0.1, "G": 4}, "sampling.noisy_fraction=0.1 of sampling.G=4 completions rounds to 0"),
    ({"noisy_fraction": 0.5, "noise_std": 0.0}, "sampling.noise_std=0.0: must be > 0"),
    ({"noisy_fraction": 1.0}, "sampling.noisy_fraction=1.0: must be in [0, 1)"),
])
def test_bad_noise_settings_are_one_line(options, message):
    cfg = phase_preset("A")
    for k, v in options.items():
        setattr(cfg.sampling, k, v)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert message in str(e.value) and "\n" not in str(e.value)
