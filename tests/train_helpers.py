"""Shared by the trainer tests: run grpo.train.main in-process and read its JSONL log; build a
plain one-process Learner and a rollout batch with reward spread for real grpo_step tests; the
completions' logits by transformers' own forward, the reference of the log-prob passes."""

import contextlib
import io
import json
from pathlib import Path

import torch

from grpo.train import main


def run_main(run_dir: Path, *args: str) -> tuple[int, str, str]:
    """main() on run_dir with these arguments: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()  # main() applies --run.cpu_threads to this whole process
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--run.run_dir", str(run_dir), *args])
    finally:
        torch.set_num_threads(threads)
    return rc, out.getvalue(), err.getvalue()


def log_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def reward_spread(only=None, component=None):
    """Add a text-dependent bonus in [0, 1] to every reward, so that groups have a spread.

    The embedded model from random weights (``--init base``) writes truncated garbage with
    equal verifier rewards, so without a bonus every advantage is 0 and nothing trains.
    only(example) -> bool limits the bonus to some prompts: the others keep zero spread.
    component: also add it to that raw component (for per-component advantages); the
    total then gets weight x bonus, as if the component had earned it.
    """
    import pytest

    from grpo.rewards import RewardModel

    original = RewardModel.__call__

    def with_spread(self, examples, completions, **kw):
        rb = original(self, examples, completions, **kw)
        bonus = [sum(map(ord, c)) % 5 / 4 if only is None or only(ex) else 0.0
                 for ex, c in zip(examples, completions)]
        bonus = torch.tensor(bonus)
        if component is None:
            rb.total = rb.total + bonus
        else:
            rb.components[component] = rb.components[component] + bonus
            rb.total = rb.total + rb.weights[component] * bonus
        return rb

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RewardModel, "__call__", with_spread)
        yield


# ----------------------------------------------------------------------------- the trainer as a real process

REPO = Path(__file__).resolve().parents[1]
# The trainer's entry point, optionally with reward_spread on (the subprocess has no pytest fixture)
ENTRY = ("import sys\nfrom grpo.train import main\n"
         "if sys.argv[1] == 'spread':\n    from train_helpers import reward_spread\n"
         "    with reward_spread():\n        sys.exit(main(sys.argv[2:]))\nsys.exit(main(sys.argv[2:]))")


class Trainer:
    """``python -m grpo.train`` (or grpo.train.main with reward_spread) as a subprocess, its
    stdout and stderr in files next to the run directory, so that a test can signal it."""

    def __init__(self, run_dir: Path, *args: str, spread: bool = False, tag: str = "run"):
        import os
        import subprocess
        import sys

        self.run_dir = Path(run_dir)
        self.out_path = self.run_dir.parent / f"{self.run_dir.name}.{tag}.out"
        self.err_path = self.run_dir.parent / f"{self.run_dir.name}.{tag}.err"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", ENTRY, "spread" if spread else "plain",
                                          "--run.run_dir", str(run_dir), *args],
                                         cwd=REPO, env=env, stdout=out, stderr=err)

    def steps(self, phase: str) -> list[int]:
        """Steps of ``phase`` logged so far (a line appears once the step is done)."""
        try:
            text = (self.run_dir / "train_log.jsonl").read_text()
        except FileNotFoundError:
            return []
        rows = [json.loads(x) for x in text.splitlines() if x.strip().endswith("}")]
        return [r["step"] for r in rows if r.get("phase") == phase and "event" not in r]

    def wait_for_step(self, phase: str, step: int, timeout: float = 240.0) -> int:
        """Block until ``phase`` logged ``step`` (or later); -> the newest logged step."""
        import time

        t0 = time.time()
        while time.time() - t0 < timeout:
            done = self.steps(phase)
            if done and max(done) >= step:
                return max(done)
            if self.proc.poll() is not None:
                raise AssertionError(f"the trainer exited ({self.proc.returncode}) before {phase} step {step}:\n"
                                     f"{self.err_path.read_text()[-2000:]}")
            time.sleep(0.02)
        raise AssertionError(f"{phase} step {step} not reached in {timeout}s")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait_for_output(self, text: str, timeout: float = 120.0) -> None:
        """Block until the trainer's stdout holds ``text`` (e.g. its note that a signal arrived)."""
        import time

        t0 = time.time()
        while text not in self.out_path.read_text():
            if self.proc.poll() is not None or time.time() - t0 > timeout:
                raise AssertionError(f"{text!r} never printed (exit {self.proc.returncode})")
            time.sleep(0.01)

    def finish(self, timeout: float = 240.0) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout=timeout)
        return rc, self.out_path.read_text(), self.err_path.read_text()


def step_learner(cfg, state=None, checkpointing=False):
    """A one-process Learner on the tiny policy of ``cfg`` (its state replaced by ``state``), with
    SGD (the update is linear in the gradient, so updates compare as gradients do) and the
    plain PyTorch backend."""
    from grpo.model.policy import build_policy
    from grpo.rewards import RewardModel
    from grpo.step import Learner
    from lora import enable_gradient_checkpointing, lora_parameters

    bundle = build_policy(cfg, "cpu", verbose=False)
    if state is not None:
        bundle.model.load_state_dict(state)
    if checkpointing:
        enable_gradient_checkpointing(bundle.model)
    opt = torch.optim.SGD(lora_parameters(bundle.model), lr=cfg.optim.lr)
    rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
    return Learner(bundle, opt, rewards, cfg, torch.Generator().manual_seed(0), backend="torch")


def spread_rollout(learner, prompts: int):
    """(rollout, state): ``prompts`` stage-1 prompts sampled once by ``learner`` (G = 4), with
    rewards of guaranteed spread in every group (so every update has a gradient), and a copy of
    the policy's state whose LoRA B is non-zero (the policy then differs from the base: the
    reference pass and the KL term carry gradient too)."""
    from data.synthetic import generate
    from grpo.rewards.compose import RewardBatch
    from grpo.step import sample_and_score

    assert learner.cfg.sampling.G == 4, "the rewards below are laid out for G = 4"
    r = sample_and_score(learner, generate("train", 1, prompts, seed=0), temperature=1.0)
    total = torch.tensor([0.0, 1.0, 2.5, -1.0] * prompts)
    r.scores = RewardBatch(total=total, components={"correctness": total}, weights={"correctness": 1.0})
    state = {k: v.clone() for k, v in learner.bundle.model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    adapters = [k for k in state if k.endswith(".lora_B")]  # LoRALinear's parameter: "<module>.lora_B"
    assert adapters, "no LoRA B in the policy's state: the policy would equal the base"
    for k in adapters:
        state[k] = 0.05 * torch.randn(state[k].shape, generator=g)
    assert all(bool(state[k].abs().gt(0).any()) for k in adapters)
    return r, state


def full_row_logits(bundle, prompts, ids: torch.Tensor, mask: torch.Tensor, G: int) -> torch.Tensor:
    """transformers' own forward with the prompt (and its pixels) repeated in each of its G rows:
    fp32 logits [N, T, V] at the positions that predict the completion tokens ``ids`` [N, T],
    under the caller's grad mode."""
    inputs = prompts.repeated(G)
    P = prompts.input_ids.shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], ids], 1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], mask], 1)
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(ids)], 1)
    return bundle.model(**inputs).logits[:, P - 1 : -1].float()

