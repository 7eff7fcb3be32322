"""The guard against non-finite losses and updates."""

from __future__ import annotations

import torch

from grpo.config import TrainConfig
from grpo.errors import TrainingDiverged
from grpo.run.files import RunFiles


class StepGuard:
    """Parameters and optimiser state from before an optimiser step, put back if the step
    left a parameter non-finite; and the count of non-finite losses or updates in a row.

    The loss check cannot see this: a finite loss with lr=1e30, or an overflow inside
    AdamW, still turns the adapter into NaN, and every later step (and checkpoint) would
    carry it. Costs one copy of the trained tensors and their moments per step (for a
    rank-8 LoRA of the 7B, ~40M floats: cheap next to one rollout).
    """

    LIMIT = 3  # non-finite losses or updates in a row before the run stops

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer,
                 files: RunFiles, cfg: TrainConfig):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.opt, self.files, self.cfg = opt, files, cfg
        self.streak = 0

    def before(self) -> None:
        self.saved = [p.detach().clone() for p in self.params]
        sd = self.opt.state_dict()
        self.saved_opt = {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                                    for i, st in sd["state"].items()},
                          "param_groups": [dict(g) for g in sd["param_groups"]]}

    def non_finite(self, dp=None) -> list[str]:
        """Names of parameters holding NaN/inf after the step (all ranks agree, or none does)."""
        bad = [n for n, p in zip(self.names, self.params) if not bool(torch.isfinite(p).all())]
        if dp is not None and dp.enabled and dp.all_reduce_sum(float(len(bad))) > 0 and not bad:
            return ["<on another rank>"]
        return bad

    @torch.no_grad()
    def restore(self) -> None:
        for p, v in zip(self.params, self.saved):
            p.copy_(v)
        self.opt.load_state_dict(self.saved_opt)

    def step(self, dp=None) -> list[str]:
        """opt.step(), undone if it left a parameter non-finite; -> the bad names ([] = kept)."""
        self.before()
        self.opt.step()
        bad = self.non_finite(dp)
        if bad:
            self.restore()
        return bad

    def failed(self, phase: str, step: int, record: dict, message: str) -> None:
        """Count a skipped loss or an undone update: log it, say it, stop after LIMIT in a row."""
        self.streak += 1
        self.files.write_log(dict(event="nan", phase=phase, step=step, **record))
        print(f"{message} ({self.streak} in a row)")
        if self.streak >= self.LIMIT:
            raise TrainingDiverged(
                f"phase {phase}: 3 non-finite losses or updates in a row at step {step}; lower --optim.lr "
                f"(now {self.cfg.optim.lr}) or check the rewards; the last good checkpoint is in "
                f"{self.files.root / phase}")

    def succeeded(self) -> None:
        self.streak = 0
