"""How much of a GRPO gradient is signal: K rollout batches' gradients at one fixed policy.

    python -m bench.grad_snr RUN --data DIR                       # at RUN's warmup:latest, phase B's config
    python -m bench.grad_snr RUN --data DIR --selector B:latest --batches 16 --prompts 8
    python -m bench.grad_snr RUN --data synthetic --selector A:best_structure   # where phase B learns

A research tool (bench/EXPERIMENTS.md section 11). The policy is frozen (AdamW at lr 0, so
every batch sees the same weights); each batch is a real ``grpo_step`` of phase B's config on
the data (prompts sampled G times, scored, z-scored, the loss's gradient taken). With
g_k the LoRA gradient of batch k and g the mean of K of them:

    signal share   |g| / mean_k |g_k|: 1 if every batch pointed the same way; about 1/sqrt(K)
                   if the batches' gradients were independent noise around zero
    cosine         the mean cosine between two batches' gradients (0 for pure noise)
    significant    the share of LoRA parameters whose mean is beyond 2 standard errors
                   (about 5% for pure noise)

AdamW divides each parameter's update by its own running gradient scale, so a parameter
whose gradient is noise still moves by about lr per step; how far such steps carry the
policy is what this measures the cause of. One torch thread; K batches of phase B's size take
about as long as K training steps.
"""

from __future__ import annotations

import argparse
import sys

import torch

from data.mixture import MixtureStream
from grpo.cli import phase_config
from grpo.model.policy import build_policy
from grpo.rewards import RewardModel
from grpo.run.phase_data import load_training_data
from grpo.state.checkpoint import load_checkpoint
from grpo.state.contents import adapter_tensors
from grpo.state.registry import resolve
from grpo.step import Learner, grpo_step, sample_and_score
from lora import load_lora_state_dict, lora_parameters


def gradients(run: str, data: str, selector: str, batches: int, prompts: int, G: int, seed: int) -> torch.Tensor:
    """[batches, P]: the LoRA gradient of each of ``batches`` GRPO steps at the frozen policy."""
    own = {} if data == "synthetic" else {"phase.mixture": "all=1.0"}  # own data: every row, no stage filters
    cfg = phase_config("B", "tiny", {"run.data": data, **own, "phase.prompts_per_step": str(prompts),
                                     "sampling.G": str(G), "run.seed": str(seed), "sampling.rollout": "plain"}, "B")
    bundle = build_policy(cfg, "cpu", verbose=False)
    load_lora_state_dict(bundle.model, adapter_tensors(load_checkpoint(resolve(run, selector)).tensors))
    train, _ = load_training_data(cfg)
    stream = MixtureStream(train, cfg.phase.mixture, seed)
    params = lora_parameters(bundle.model)
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)  # steps, moves nothing
    learner = Learner(bundle, opt, RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer),
                      cfg, torch.Generator().manual_seed(seed))
    out = []
    for k in range(batches):
        grpo_step(learner, lambda n: sample_and_score(learner, stream.next_batch(n), temperature=1.0), step=k,
                  temperature=1.0)
        out.append(torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in params]))
        print(f"batch {k + 1}/{batches}: |g| {float(out[-1].norm()):.4g}", flush=True)
    return torch.stack(out)


def summary(g: torch.Tensor) -> dict[str, float]:
    K = g.shape[0]
    mean, norms = g.mean(0), g.norm(dim=1)
    unit = g / norms.clamp_min(1e-30)[:, None]
    cos = (unit @ unit.T)[~torch.eye(K, dtype=torch.bool)].mean()
    stderr = g.std(0) / K ** 0.5
    return {"batches": K, "mean |g_k|": float(norms.mean()), "|mean g|": float(mean.norm()),
            "signal share": float(mean.norm() / norms.mean()), "pure noise would give": K ** -0.5,
            "cosine": float(cos), "significant": float((mean.abs() > 2 * stderr).float().mean())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.grad_snr", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run directory holding the checkpoint")
    ap.add_argument("--data", required=True, help="what the run trains on (--run.data: an own-data directory, or synthetic)")
    ap.add_argument("--selector", default="warmup:latest", help="the checkpoint (default warmup:latest)")
    ap.add_argument("--batches", type=int, default=16, help="K rollout batches (default 16)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8, phase B's)")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.batches < 2:
        ap.error(f"--batches {a.batches}: needs at least 2 to compare")
    torch.set_num_threads(1)
    s = summary(gradients(a.run, a.data, a.selector, a.batches, a.prompts, a.G, a.seed))
    print("\n".join(f"{k:>22}  {v:.4g}" for k, v in s.items()))
    print(f"summary: signal share {s['signal share']:.3f} (noise alone {s['pure noise would give']:.3f}), "
          f"cosine {s['cosine']:.3f}, significant {s['significant']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
