"""The trainer's resume, crash and NaN paths, end to end on the tiny model.

- Resume equality: 4 steps straight == 2 steps, stop, resume for 2 more, bit for bit
  (every LoRA tensor, the sampler generator, the logged rewards), with the tiny preset's
  merged-copy rollouts and with plain ones. The checkpoint eval at
  step 2 runs in both, so this also checks it does not perturb training's RNG.
- A checkpoint write that fails midway leaves the previous `latest` loadable, and resuming
  from it reproduces the straight run.
- Non-finite losses: one is skipped and logged; three in a row stop the run cleanly.

The embedded model starts from random weights here (`--init base`, no warm-up): all its
completions are truncated garbage with equal verifier rewards, so every advantage would be
zero and the adapter would never move, making equality trivial. A deterministic bonus that
depends on the completion text gives each group a reward spread, so the updates are real.
"""

import errno
from pathlib import Path

import pytest
import torch
from train_helpers import log_lines, reward_spread, run_main

import grpo.state.durable as durable
import grpo.step as step_core  # the step calls its grpo_loss by this module's name
from grpo.state.checkpoint import load_checkpoint
from grpo.state.contents import adapter_tensors
from grpo.state.layout import OPTIM_TENSORS
from grpo.state.registry import read_registry, resolve
from grpo.state.train_state import GEN_KEY

TINY = [
    "--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4",
    "--sampling.G", "3", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
    "--phase", "A", "--init", "base", "--run.eval_every", "2", "--optim.lr", "1e-2",
]


def train(run_dir: Path, *args: str) -> tuple[int, str, str]:
    """main() on run_dir with this file's tiny settings: (exit code, stdout, stderr)."""
    return run_main(run_dir, *TINY, *args)


def adapter_at(run_dir: Path, selector: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(resolve(run_dir, selector)).tensors


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:3]}"


def rewards_by_step(run_dir: Path) -> dict[int, float]:
    # later lines win: a crashed run's steps 3-4 are overwritten by the resumed ones
    return {r["step"]: r["reward"] for r in log_lines(run_dir) if r.get("phase") == "A" and "event" not in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four steps in one go (checkpoints at 2 and 4)."""
    run = tmp_path_factory.mktemp("straight") / "run"
    with reward_spread():
        rc, out, err = train(run, "--phase.steps", "4")
    assert rc == 0, err
    return run


def test_straight_run_trains_the_adapter(straight):
    t = adapter_tensors(adapter_at(straight, "A:latest"))
    lora_B = [v for k, v in t.items() if k.endswith(".lora_B")]
    assert lora_B and any(bool(v.abs().sum() > 0) for v in lora_B), "lora_B is still zero: nothing was learned"
    assert [c["step"] for c in read_registry(straight, "A")["checkpoints"]] == [2, 4]


def test_stop_and_resume_matches_the_straight_run(straight, tmp_path):
    run = tmp_path / "run"
    with reward_spread():
        rc, out, err = train(run, "--phase.steps", "2")
        assert rc == 0, err
        assert_same_tensors(adapter_at(run, "A:2"), adapter_at(straight, "A:2"))
        rc, out, err = train(run, "--phase.steps", "4")
    assert rc == 0, err
    assert "resuming phase A at step 2" in out
    assert_same_tensors(adapter_at(run, "A:latest"), adapter_at(straight, "A:latest"))
    assert GEN_KEY in adapter_at(run, "A:latest")
    assert rewards_by_step(run) == rewards_by_step(straight)
    opt_a = (run / "A" / "step_000004" / "optimizer.safetensors").read_bytes()
    assert opt_a == (straight / "A" / "step_000004" / "optimizer.safetensors").read_bytes()
    # the tiny preset's rollout path: the merged copy, rebuilt from the checkpoint's adapter on resume
    steps = [r for r in log_lines(run) if r.get("phase") == "A" and "event" not in r]
    assert steps and all(r["rollout"]["path"] == "merged" and r["rollout"]["correction"] == "sequence"
                         for r in steps)


def test_stop_and_resume_with_plain_rollouts_matches_the_straight_run(tmp_path):
    """The same equality on the plain path (the policy's own layers, batch compaction)."""
    runs = {}
    with reward_spread():
        for name, stops in (("straight", ["4"]), ("resumed", ["2", "4"])):
            for steps in stops:
                rc, out, err = train(tmp_path / name, "--phase.steps", steps, "--sampling.rollout", "plain")
                assert rc == 0, err
            runs[name] = tmp_path / name
    assert "resuming phase A at step 2" in out
    assert_same_tensors(adapter_at(runs["resumed"], "A:latest"), adapter_at(runs["straight"], "A:latest"))
    assert rewards_by_step(runs["resumed"]) == rewards_by_step(runs["straight"])
    assert all(r["rollout"]["path"] == "plain" for r in log_lines(runs["resumed"]) if "rollout" in r)


def test_checkpoint_eval_does_not_perturb_training(tmp_path):
    """With the controller off, evaluating + saving at step 2 must change nothing at step 4."""
    runs = {}
    with reward_spread():
        for every in ("2", "4"):
            rc, _, err = train(tmp_path / every, "--phase.steps", "4", "--run.eval_every", every,
                               "--phase.controller", "false")
            assert rc == 0, err
            runs[every] = tmp_path / every
    assert [c["step"] for c in read_registry(runs["2"], "A")["checkpoints"]] == [2, 4]
    assert [c["step"] for c in read_registry(runs["4"], "A")["checkpoints"]] == [4]
    assert_same_tensors(adapter_at(runs["2"], "A:latest"), adapter_at(runs["4"], "A:latest"))


def test_failed_checkpoint_write_keeps_latest_loadable_and_resumable(straight, tmp_path, monkeypatch):
    run = tmp_path / "run"
    real_write = durable.write_bytes

    def dies_on_step_4(path: Path, data: bytes) -> None:
        if "step_000004" in str(path) and path.name == OPTIM_TENSORS:  # after the adapter file
            raise OSError(errno.EIO, "simulated I/O error")
        real_write(path, data)

    with reward_spread():
        monkeypatch.setattr(durable, "write_bytes", dies_on_step_4)
        rc, out, err = train(run, "--phase.steps", "4")
        assert rc == 1
        assert err.startswith("error: could not write checkpoint") and "simulated I/O error" in err
        assert "Traceback" not in err
        reg = read_registry(run, "A")
        assert reg["aliases"]["latest"] == 2 and [c["step"] for c in reg["checkpoints"]] == [2]
        assert not [p.name for p in (run / "A").iterdir() if p.name.startswith((".tmp-", "step_000004"))]
        assert_same_tensors(adapter_at(run, "A:latest"), adapter_at(straight, "A:2"))

        monkeypatch.setattr(durable, "write_bytes", real_write)
        rc, out, err = train(run, "--phase.steps", "4")
    assert rc == 0, err
    assert "resuming phase A at step 2" in out
    assert_same_tensors(adapter_at(run, "A:latest"), adapter_at(straight, "A:latest"))


def nan_loss_on(calls: set[int]):
    """grpo_loss that returns NaN on the given (1-based) calls, the real loss otherwise."""
    real = step_core.grpo_loss
    n = [0]

    def loss(*args, **kw):
        n[0] += 1
        value, stats = real(*args, **kw)
        return (value * float("nan") if n[0] in calls else value), stats

    return loss


def test_a_nan_step_is_skipped_and_logged(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(step_core, "grpo_loss", nan_loss_on({1}))
    with reward_spread():
        rc, out, err = train(run, "--phase.steps", "2")
    assert rc == 0, err
    nan = [r for r in log_lines(run) if r.get("event") == "nan"]
    assert [(r["phase"], r["step"], r["loss"]) for r in nan] == [("A", 1, "nan")]
    steps = {r["step"]: r for r in log_lines(run) if r.get("phase") == "A" and "event" not in r}
    assert steps[1]["grad_norm"] is None and steps[2]["grad_norm"] is not None
    assert "non-finite loss nan: update skipped (1 in a row)" in out
    assert read_registry(run, "A")["aliases"]["latest"] == 2


def test_three_nan_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(step_core, "grpo_loss", nan_loss_on({1, 2, 3}))
    rc, out, err = train(run, "--phase.steps", "5", "--run.eval_every", "10")
    assert rc == 1
    assert err.startswith("error: phase A: 3 non-finite losses or updates in a row at step 3") and "--optim.lr" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert [r["step"] for r in log_lines(run) if r.get("event") == "nan"] == [1, 2, 3]
    assert not read_registry(run, "A")["checkpoints"]  # nothing half-trained was saved


def test_a_resume_whose_latest_is_damaged_continues_from_the_newest_intact_one(straight, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    adapter = run / "A" / "step_000004" / "adapter.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-3] ^= 0x10  # one flipped bit in the tensor data: the header still parses
    adapter.write_bytes(bytes(data))
    with reward_spread():
        rc, out, err = train(run, "--phase.steps", "4")
    assert rc == 0, err
    assert "phase A: checkpoint step 4 is damaged, skipped and set aside" in out and "does not match the sha256" in out
    assert "resuming phase A at step 2" in out
    assert (run / "A" / "damaged-step_000004").is_dir()  # kept for inspection, out of the registry
    assert_same_tensors(adapter_at(run, "A:latest"), adapter_at(straight, "A:latest"))  # redone, bit for bit
    assert [r["step"] for r in log_lines(run) if r.get("event") == "damaged_checkpoint"] == [4]


def poisoned_update_on(calls: set[int]):
    """AdamW.step that writes a NaN into the first parameter after the given (1-based) calls."""
    real = torch.optim.AdamW.step
    n = [0]

    def step(self, *args, **kw):
        n[0] += 1
        out = real(self, *args, **kw)
        if n[0] in calls:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    return step


def test_a_non_finite_update_is_undone_like_a_skipped_step(tmp_path, monkeypatch):
    """A finite loss whose update makes a parameter NaN: parameters AND optimiser state go
    back to before the step, so the run is bit-identical to one that skipped that step."""
    with reward_spread():
        with monkeypatch.context() as mp:
            mp.setattr(step_core, "grpo_loss", nan_loss_on({1}))
            rc, _, err = train(tmp_path / "skipped", "--phase.steps", "2")
        assert rc == 0, err
        with monkeypatch.context() as mp:
            mp.setattr(torch.optim.AdamW, "step", poisoned_update_on({1}))
            rc, out, err = train(tmp_path / "undone", "--phase.steps", "2")
    assert rc == 0, err
    assert "[A 1] non-finite update (1 tensors, e.g. " in out and "restored (1 in a row)" in out
    nan, = [r for r in log_lines(tmp_path / "undone") if r.get("event") == "nan"]
    assert nan["step"] == 1 and nan["params"][0].endswith(".lora_A")
    assert_same_tensors(adapter_at(tmp_path / "undone", "A:latest"), adapter_at(tmp_path / "skipped", "A:latest"))
    opt = [(tmp_path / r / "A" / "step_000002" / "optimizer.safetensors").read_bytes() for r in ("undone", "skipped")]
    assert opt[0] == opt[1]


def test_three_non_finite_updates_in_a_row_stop_the_run_and_save_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_update_on({1, 2, 3}))
    with reward_spread():
        rc, out, err = train(tmp_path / "run", "--phase.steps", "5", "--run.eval_every", "10")
    assert rc == 1
    assert err.startswith("error: phase A: 3 non-finite losses or updates in a row at step 3")
    assert not read_registry(tmp_path / "run", "A")["checkpoints"]
