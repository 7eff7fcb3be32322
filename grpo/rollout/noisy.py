"""NoisyRollout (Liu et al., arXiv 2504.13055): part of each group sampled from a noisy image.

GRPO learns only from groups whose G completions disagree. A policy that reads a figure the
same way every time gives G alike answers; NoisyRollout samples some of them from a perturbed
copy of the image, so the group holds completions from a second, less certain reading, and
the advantages contrast the two. What the paper does, followed here:

    rollouts     of each prompt's G completions, n = round(sampling.noisy_fraction * G) are
                 sampled from the noisy image, the other G - n from the clean one (the
                 paper: half and half); rows b*G .. b*G+G-n-1 of prompt b are clean, the last
                 n noisy (``noisy_rows``)
    rewards      every completion is scored against the prompt's gold answer, and the
                 advantages are z-scores over the whole group of G, clean and noisy together
    training     the policy is trained on the clean image only: the rollout keeps the clean
                 prompt context, so the log-prob passes (and the KL reference) condition every
                 row, noisy ones too, on the clean image; the noise only chooses what is sampled
    annealing    the noise is strongest at the phase's first step and gone by its last, so
                 the late rollouts come from the images the model is tested on

The perturbation: Gaussian noise added to the processor's normalised patches (what the vision
tower reads), x' = x + sigma_t * eps, eps ~ N(0, I) drawn from the sampler's generator (a
resumed run draws what a straight run draws), with sigma_t = sampling.noise_std * (1 - t / (S - 1))
at phase step t of S: a linear decay to 0 (the paper's decay is sigmoid-shaped; linear is one
line and reaches 0 at the last step the same way).

The paper trains the noisy rows as if the clean-image policy had sampled them: no importance
weight for the change of image (its trainer recomputes the old log-probs on the clean image).
Here the sampler's log-probs feed the rollout correction (optim.rollout_correction, which
corrects the sampling engine's numerical mismatch, not a change of input) and the log's
mismatch figures, so a noisy row's are replaced by the policy's own on the clean image, one
no-grad pass over the noisy rows: the correction then weighs them 1, as the paper does, and the
clean rows keep the engine's. (``filtered_logprobs``, a diagnostic, stays the noisy image's.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from grpo.model.logprobs import completion_logprobs
from grpo.model.prompts import PromptBatch
from grpo.rollout.sampler import SampleOutput


def noise_std_at(step: int, steps: int, std: float) -> float:
    """sigma_t: ``std`` at phase step 0, linearly down to 0 at step ``steps`` - 1."""
    return std * (1.0 - step / max(steps - 1, 1))


def noisy_count(fraction: float, G: int) -> int:
    """How many of a group's G completions come from the noisy image."""
    return round(fraction * G)


def noisy_rows(B: int, G: int, n_noisy: int) -> torch.Tensor:
    """[B*G] bool: True on the rows sampled from the noisy image (the last n_noisy of each group)."""
    return (torch.arange(G) >= G - n_noisy).repeat(B)


def noisy_prompts(prompts: PromptBatch, sigma: float, generator: torch.Generator | None) -> PromptBatch:
    """The prompts with Gaussian noise of std ``sigma`` added to every image patch."""
    x = prompts.pixel_values
    eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return replace(prompts, pixel_values=x + (sigma * eps).to(x.dtype))


def join_groups(clean: SampleOutput, noisy: SampleOutput, pad_id: int) -> SampleOutput:
    """One output of G = clean.G + noisy.G rows per prompt, each group's clean rows first, on
    the clean output's prompt context (what the log-prob passes read)."""
    B, Gc, Gn = clean.context.B, clean.G, noisy.G
    G, dev = Gc + Gn, clean.completion_ids.device
    # row j of the joined batch: prompt j // G; clean row b*Gc + k for k < Gc, else noisy b*Gn + k - Gc
    b, k = torch.arange(B * G, device=dev) // G, torch.arange(B * G, device=dev) % G
    src = torch.where(k >= Gc, B * Gc + b * Gn + k - Gc, b * Gc + k)  # into the clean rows, then the noisy
    return SampleOutput.from_rows([clean, noisy], clean.context, src, pad_id=pad_id, G=G)


class NoisyRollout:
    """The rollout seam of grpo/step.py's Learner (``rollout(bundle, prompts, G=, ...)``) with
    NoisyRollout's mixed groups around any inner sampler (grpo/rollout/sampler.py's ``sample``
    or a merged copy's). ``step`` is the phase step being sampled (the trainer sets it);
    ``backend`` is the log-prob kernels' for the noisy rows' scoring pass (the Learner's)."""

    def __init__(self, inner: Callable[..., SampleOutput], fraction: float, std: float, steps: int,
                 backend: str = "auto"):
        self.inner, self.fraction, self.std, self.steps, self.backend = inner, fraction, std, steps, backend
        self.step = 0

    @property
    def sigma(self) -> float:
        return noise_std_at(self.step, self.steps, self.std)

    def __call__(self, bundle, prompts: PromptBatch, *, G: int, generator: torch.Generator | None = None,
                 **kw: Any) -> SampleOutput:
        n = noisy_count(self.fraction, G)
        clean = self.inner(bundle, prompts, G=G - n, generator=generator, **kw)
        noisy = self.inner(bundle, noisy_prompts(prompts, self.sigma, generator), G=n, generator=generator, **kw)
        with torch.no_grad():  # the noisy rows as the clean-image policy scores them (module doc)
            noisy.logprobs = completion_logprobs(bundle.model, clean.context, noisy.completion_ids,
                                                 noisy.completion_mask, n, temperature=kw.get("temperature", 1.0),
                                                 backend=self.backend)
        return join_groups(clean, noisy, bundle.pad_token_id)
