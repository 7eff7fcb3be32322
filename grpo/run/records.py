"""The log line of one rollout batch (keys: eval/plots.py), and its printed summary."""

from __future__ import annotations

from typing import Any

import torch

from grpo.config import TrainConfig


def update_record(u: Any, dp) -> dict:
    """One update's entry of the log line's "updates" (mu > 1), from a grpo.step.UpdateResult:
    its loss, grad norm, lr, the clip fractions and the KL to the sampling policy (0 at
    update 1 by construction), averaged over rollout batches and ranks."""
    su = dp.mean_over_ranks({key: float(sum(float(getattr(x, f)) for x in u.stats) / len(u.stats))
                             for key, f in (("clip_low", "clip_low_frac"), ("clip_high", "clip_high_frac"),
                                            ("kl_old", "kl_old_mean"))})
    return dict(update=u.update + 1, loss=u.loss, grad_norm=u.grad_norm, lr=u.lr, **su)


def step_record(phase: str, step: int, result: Any, weights: dict, temperature: float, lr: float, timing: dict,
                dp, cfg: TrainConfig, prompts: Any = None) -> dict:
    """The log line of one rollout batch (keys: eval/plots.py), from a grpo.step.StepResult.
    Rewards, lengths and the loss's diagnostics are those of update 1, the on-policy one.
    "prompts" (``prompts``: the step's draws' grpo.model.prompts.PromptCounts, totals over
    ranks): what entered the model -- n prompts, mean / max visual tokens and prompt tokens
    per prompt -- the images max_pixels shrank and min_pixels enlarged, and the prompts
    skipped for exceeding model.max_prompt_tokens or for an image that failed.
    "rollout": the sampler against the trainer (grpo_kernels/grpo_loss.py's is_* stats): kl =
    mean k3 estimate of KL(sampler || trainer) per token, ratio_mean / ratio_max of
    pi_train / pi_sampler and over_frac = ratios above the cap, at the correction's level
    (token when off); the max is over rollout batches, then averaged over ranks like every float.
    "entropy": the policy's mean token entropy over the tokens the loss trained on (token mean
    over the step's rollout batches; grpo/model/logprobs.py); "masked_truncated" (with
    optim.mask_truncated): the fraction of the step's completions whose tokens the loss dropped."""
    logs, mu = result.logs, cfg.optim.updates_per_batch
    updates = [update_record(u, dp) for u in result.updates]
    comps = {k: float(torch.cat([m.scores.components[k] for m in logs]).mean()) for k in logs[0].scores.components}
    totals = torch.cat([m.scores.total for m in logs])
    lengths = torch.cat([m.out.lengths.float() for m in logs])
    trunc = torch.cat([m.out.truncated.float() for m in logs])
    trained = sum(float(m.out.loss_mask(cfg.optim.mask_truncated).sum()) for m in logs)
    entropy = sum(float(m.entropy.sum()) for m in logs) / max(trained, 1.0)
    # averaged over ranks: the controller's zero-spread gate must see the same value on every rank
    st = dp.mean_over_ranks({k: float(sum(float(getattr(m.stats, k)) for m in logs) / len(logs))
                             for k in ("kl_mean", "clip_low_frac", "clip_high_frac", "zero_spread_frac",
                                       "adv_abs_mean")})
    record = dict(phase=phase, step=step + 1, reward=float(totals.mean()), components=comps,
                  weights=dict(weights), loss=result.loss, kl=st["kl_mean"],
                  clip_low=st["clip_low_frac"], clip_high=st["clip_high_frac"],
                  zero_spread=st["zero_spread_frac"], adv_abs=st["adv_abs_mean"], entropy=entropy,
                  completion_len=float(lengths.mean()), truncation=float(trunc.mean()), lr=lr,
                  temperature=temperature, grad_norm=result.grad_norm, time=timing)
    o, stats = cfg.optim, [m.stats for m in logs]
    record["rollout"] = dict(
        path=cfg.sampling.rollout, correction=o.rollout_correction, mode=o.rollout_correction_mode,
        cap=float(o.rollout_correction_cap), level="sequence" if o.rollout_correction == "sequence" else "token",
        kl=float(sum(float(s.is_kl) for s in stats) / len(stats)),
        ratio_mean=float(sum(float(s.is_ratio_mean) for s in stats) / len(stats)),
        ratio_max=max(float(s.is_ratio_max) for s in stats),
        over_frac=float(sum(float(s.is_over_frac) for s in stats) / len(stats)))
    if mu > 1:  # the first update's loss and stats above (on-policy); every update here
        record["loss"] = updates[0]["loss"] if updates else result.loss
        record["updates"] = updates
    if o.mask_truncated:
        record["masked_truncated"] = float(trunc.mean())  # = truncation: every truncated row is masked
    if result.fill is not None:
        record["dynamic"] = result.fill.to_dict()
    if cfg.sampling.guided:
        record["guided"] = guided_record(logs)
    if prompts is not None:
        record["prompts"] = prompts.record()
    return record


def guided_record(logs: list) -> dict:
    """Guided groups (grpo/rollout/guided.py) of the step's rollout batches: "share" of the groups
    holding a demonstration, and "sampled_correctness", the correctness of the policy's own rows
    (a demonstration's slot counts 0: it replaced a wrong completion), which the step's
    "correctness" (demonstrations included) overstates."""
    G = logs[0].out.G
    guided = torch.cat([m.out.guided_rows for m in logs])
    correct = torch.cat([m.scores.components["correctness"] for m in logs]).float()
    return dict(share=float(guided.sum()) / max(1, guided.numel() // G),
                sampled_correctness=float((correct * ~guided).mean()))


def progress_line(phase: str, step: int, steps: int, record: dict) -> str:
    """The periodic printed line (every run.log_every steps)."""
    fill, updates = record.get("dynamic"), record.get("updates")
    return (f"[{phase} {step + 1}/{steps}] reward {record['reward']:.3f}  "
            + " ".join(f"{k} {v:.2f}" for k, v in record["components"].items())
            + f"  len {record['completion_len']:.1f}  zero-spread {record['zero_spread']:.2f}"
            + f"  ent {record['entropy']:.2f}"
            + (f"  masked {record['masked_truncated']:.2f}" if "masked_truncated" in record else "")
            + prompts_summary(record.get("prompts"))
            + (f"  refills {fill['refills']} fill {fill['fill']:.2f}" if fill is not None else "")
            + (f"  guided {record['guided']['share']:.2f}" if "guided" in record else "")
            + (f"  clip@{len(updates)} {updates[-1]['clip_low'] + updates[-1]['clip_high']:.3f}" if updates else "")
            + f"  {record['time']['step']:.2f}s/step")


def prompts_summary(p: dict | None) -> str:
    """The printed line's part about what entered the model: mean/max visual tokens per
    prompt, then, only when something happened, images resized and prompts skipped."""
    if p is None:
        return ""
    text = f"  vis {p['visual_tokens']:.0f}/{p['visual_tokens_max']}"
    if p["resized_down"] or p["resized_up"]:
        text += f"  resized down {p['resized_down']} up {p['resized_up']}"
    if p["skipped_long"] or p["skipped_image"]:
        text += f"  skipped {p['skipped_long']} over max_prompt_tokens, {p['skipped_image']} bad images"
    return text
