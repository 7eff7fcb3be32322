"""Evaluating a model: sample completions under an EvalProtocol, score them with eval/.

Why this sits in grpo/ and not in eval/: everything that turns text into numbers (metrics,
scores, intervals, the blind-gap control, reports) is in eval/ and needs no model; what
needs one -- prompt encoding and the sampler -- lives here, above it. The trainer's
checkpoint-side eval, the data-parallel eval (grpo/distributed.py), the final report and
``python -m grpo.evaluate`` all call ``evaluate_model``, so a gate and a report can never
disagree about what "parseable" means.

grpo.model.prompts and grpo.rollout.sampler are called through their modules
(``grpo.rollout.sampler.sample``), not through bound names, so a test can swap one for a fake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpo.model.prompts
import grpo.rollout.sampler
from data.schema import Example
from eval.report import control_summary
from eval.results import Completions, EvalProtocol, EvalResult, evaluate_samples
from grpo.config import TrainConfig
from grpo.run.stop import check_eval


def sample_completions(bundle: Any, examples: Sequence[Example], protocol: EvalProtocol) -> Completions:
    """One sampling pass over ``examples``: texts and content-token counts per example.

    An example that cannot enter the model -- its image fails to encode, or its prompt is
    longer than the bundle's max_prompt_tokens -- gets no completions: the evaluation counts
    it as skipped ("sampler_skipped", printed on the eval line) and scores the others (the
    same ones at every eval of a run, so the gates compare like with like). Batches of
    ``protocol.batch_size`` prompts, each prompt prefilled once for its G =
    ``protocol.samples_per_prompt`` completions (grpo/rollout/sampler.py).
    """
    G = protocol.samples_per_prompt
    completions: list[list[str]] = [[] for _ in examples]
    token_counts: list[list[int]] = [[] for _ in examples]
    for start in range(0, len(examples), protocol.batch_size):
        check_eval()  # a stop abandons the evaluation between batches (grpo/run/stop.py)
        batch = list(examples[start : start + protocol.batch_size])
        try:
            prompts = grpo.model.prompts.encode_prompts(bundle, batch, on_bad_image="skip").to(bundle.device)
        except ValueError:  # every image of the batch failed: all of them stay empty
            continue
        # One generator per batch, seeded from the protocol seed and the batch's position:
        # the same protocol (batch_size included) always draws the same completions.
        out = grpo.rollout.sampler.sample(bundle, prompts, G=G, max_new_tokens=protocol.max_new_tokens,
                                  temperature=protocol.temperature, top_k=protocol.top_k, top_p=protocol.top_p,
                                  seed=protocol.seed + start)
        ntok = grpo.rollout.sampler.content_tokens(out)
        for n, text in enumerate(out.texts):  # row n belongs to kept prompt n // G
            i = start + prompts.kept[n // G]
            completions[i].append(text)
            token_counts[i].append(int(ntok[n]))
    return completions, token_counts


SamplePass = Callable[[Any, Sequence[Example], EvalProtocol], Completions]


def evaluate_model(bundle: Any, examples: Sequence[Example], protocol: EvalProtocol,
                   sample_pass: SamplePass | None = None) -> EvalResult:
    """Sample ``protocol.samples_per_prompt`` completions per example and score them.

    With ``protocol.image_control`` the same prompts are sampled again with shuffled
    images (eval/blind.py) and ``result.control`` holds the blind gap overall and per
    stage. ``sample_pass`` replaces the one-process pass (``sample_completions``): the
    data-parallel trainer passes one that splits the prompts over ranks and gathers.
    """
    protocol.validate()
    sample_pass = sample_pass or sample_completions
    return evaluate_samples(examples, lambda exs: sample_pass(bundle, exs, protocol), protocol)


def checkpoint_eval(bundle: Any, examples: Sequence[Example], cfg: TrainConfig, dp: Any = None) -> EvalResult:
    """The trainer's eval at every checkpoint: greedy, one sample per prompt (the staged
    paper's final protocol), on the phase's fixed held-out subset. Its metrics feed the
    controller's gates and the checkpoint's scores (best_* aliases)."""
    protocol = EvalProtocol(max_new_tokens=cfg.sampling.max_new_tokens, temperature=0.0,
                            seed=cfg.run.seed, batch_size=64)
    if dp is not None and dp.enabled:  # prompts split over ranks, completions gathered (grpo/distributed.py)
        return dp.evaluate(bundle, examples, protocol)
    return evaluate_model(bundle, examples, protocol)


# How the eval line names EvalResult's skip reasons (eval/results.py).
SKIP_NAMES = {"sampler_skipped": "(bad image or over model.max_prompt_tokens)", "no_numeric_gold": "(no numeric gold)"}


def print_eval(phase: str, step: int, result: EvalResult) -> None:
    """One line of headline metrics with their 95% intervals and the scores, then the blind gap."""
    m, iv = result.metrics, result.overall.intervals
    parts = []
    for key, short in (("parseable_rate", "parse"), ("exact_match", "EM"), ("solution_tag_rate", "sol"),
                       ("reasoning_tag_rate", "reas"), ("truncation_rate", "trunc")):
        lo, hi = iv.get(key, (float("nan"), float("nan")))
        parts.append(f"{short} {m[key]:.3f} [{lo:.2f},{hi:.2f}]")
    s = result.scores
    skipped = "".join(f"  skipped {n} {SKIP_NAMES.get(k, k)}" for k, n in sorted(result.skipped.items()))
    print(f"[{phase} eval @ {step}] n={result.overall.n_prompts} " + "  ".join(parts)
          + f"  struct {s['structure']:.3f} corr {s['correctness']:.3f} comp {s['composite']:.3f}" + skipped,
          flush=True)
    for line in control_summary(f"{phase} @ {step}", result):
        print(f"  {line}", flush=True)
