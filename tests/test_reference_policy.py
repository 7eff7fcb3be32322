"""RL from an SFT warm-up measures its KL against the warm-up's policy, not the bare base.

The shipped (pretrained) model's warm-up trains a LoRA adapter; a GRPO phase started from it
keeps that adapter's frozen copy as the reference (lora.inject.freeze_reference_adapter). So
at the first step, before any update, the policy is the reference and the KL is exactly 0;
the checkpoints record which warm-up is the reference, a resume and the next phase keep it,
and a phase that never saw a warm-up writes the same checkpoint metadata as before.
"""

from pathlib import Path

from train_helpers import log_lines, run_main

from grpo.state.checkpoint import load_checkpoint
from grpo.state.registry import resolve, step_dirname

SHIPPED = ["--model.device", "cpu", "--run.eval_size", "2", "--run.train_per_stage", "20",
           "--sampling.G", "2", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
           "--warmup.phase.steps", "2", "--warmup.phase.prompts_per_step", "4", "--run.test_per_stage", "0"]


def _steps(run: Path, phase: str) -> dict[int, dict]:
    return {r["step"]: r for r in log_lines(run) if r.get("phase") == phase and "event" not in r}


def test_the_reference_is_the_warm_up_through_phases_and_a_resume(tmp_path):
    run = tmp_path / "run"
    rc, _, err = run_main(run, *SHIPPED, "--phase", "warmup")
    assert rc == 0, err
    warm = f"warmup/{step_dirname(2)}"
    assert load_checkpoint(resolve(run, "warmup:latest")).extra["kind"] == "adapter"

    rl = ["--optim.beta", "0.1", "--run.eval_every", "1", "--sampling.G", "4", "--sampling.max_new_tokens", "24"]
    rc, out, err = run_main(run, *SHIPPED, "--phase", "A", "--init", "warmup:latest", "--phase.steps", "1", *rl)
    assert rc == 0, err
    assert f"phase A: the reference policy is the warm-up {warm} (base + its adapter)" in out
    assert _steps(run, "A")[1]["kl"] == 0.0  # update 1: the policy is the reference, bit for bit
    assert load_checkpoint(resolve(run, "A:latest")).extra == {"kind": "adapter", "base": None, "reference": warm}

    # a resume (one more step) and the next phase keep the warm-up as the reference
    rc, out, err = run_main(run, *SHIPPED, "--phase", "A", "--phase.steps", "2", *rl)
    assert rc == 0, err
    assert f"phase A: the reference policy is the warm-up {warm}" in out
    moved = load_checkpoint(resolve(run, "A:1")).tensors
    assert any(not (moved[k] == v).all() for k, v in load_checkpoint(resolve(run, "warmup:latest")).tensors.items()
               if k.endswith("lora_B")), "step 1 did not update: nothing below is tested"
    assert _steps(run, "A")[2]["kl"] > 0  # the policy moved away from it
    rc, out, err = run_main(run, *SHIPPED, "--phase", "B", "--phase.steps", "1", *rl)
    assert rc == 0, err
    assert f"phase B: the reference policy is the warm-up {warm}" in out
    assert load_checkpoint(resolve(run, "B:latest")).extra["reference"] == warm


def test_without_a_warm_up_the_reference_stays_the_base(tmp_path):
    run = tmp_path / "run"
    rc, out, err = run_main(run, *SHIPPED, "--phase", "A", "--init", "base", "--phase.steps", "1")
    assert rc == 0, err
    assert "reference policy" not in out
    assert load_checkpoint(resolve(run, "A:latest")).extra == {"kind": "adapter", "base": None}


def test_rl_can_continue_the_warm_ups_adamw_moments(tmp_path):
    """optim.warmup_moments: the first GRPO update continues AdamW where the warm-up left it
    (its step count and moments), instead of fresh moments whose first updates are about lr
    per parameter whatever the gradient's size."""
    for flag, steps in (("true", 3), ("false", 1)):
        other = tmp_path / flag
        rc, _, err = run_main(other, *SHIPPED, "--phase", "warmup")
        assert rc == 0, err
        warm = load_checkpoint(resolve(other, "warmup:latest")).optimizer_state  # an adapter warm-up keeps them
        assert warm is not None and {int(s["step"]) for s in warm["state"].values()} == {2}
        rc, out, err = run_main(other, *SHIPPED, "--phase", "A", "--init", "warmup:latest", "--phase.steps", "1",
                                "--A.optim.warmup_moments", flag)
        assert rc == 0, err
        assert ("AdamW continues the warm-up's moments" in out) == (flag == "true")
        state = load_checkpoint(resolve(other, "A:latest")).optimizer_state["state"]
        assert {int(s["step"]) for s in state.values()} == {steps}, flag
