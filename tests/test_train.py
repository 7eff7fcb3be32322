"""The trainer end to end: every phase on the tiny model, phase chaining, alias
resolution across phases, controller weights reaching the rewards, and the user errors
main() must answer with one line instead of a traceback.

Resume equality, crash safety and the NaN guard live in tests/test_train_resume.py.
Settings are tiny (2 prompts x G=2, 8 new tokens, 4 eval prompts): each main() call costs
about a second on 2 CPU cores once the embedded model is cached.
"""

import shutil
from pathlib import Path

import pytest
import torch
from train_helpers import log_lines, run_main

from grpo.config import PHASE_WEIGHTS
from grpo.state.checkpoint import load_checkpoint
from grpo.state.registry import ALIASES, read_registry, resolve, step_dirname
from grpo.train import main

TINY = [  # tiny-random: the chain from random weights (warm-up -> A -> B); the shipped model's path is below
    "--model.name", "tiny-random", "--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4",
    "--sampling.G", "2", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
    "--warmup.phase.steps", "2", "--warmup.phase.perception_steps", "2", "--warmup.phase.prompts_per_step", "4",
]


def train(run_dir: Path, *args: str) -> tuple[int, str, str]:
    """main() on run_dir with this file's tiny settings: (exit code, stdout, stderr)."""
    return run_main(run_dir, *TINY, *args)


def step_records(run_dir: Path, phase: str) -> dict[int, dict]:
    return {r["step"]: r for r in log_lines(run_dir) if r.get("phase") == phase and "event" not in r}


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    """`--phase B` on an empty run directory: warm-up -> A -> B, evaluating after every step."""
    run = tmp_path_factory.mktemp("chained") / "run"
    rc, out, err = train(run, "--phase", "B", "--phase.steps", "2", "--run.eval_every", "1",
                         "--A.phase.steps", "2", "--A.phase.prompts_per_step", "2")
    assert rc == 0, err
    return run, out


def copy_run(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- phases and chaining


def test_phase_B_on_empty_dir_runs_warmup_then_A_then_B(chained):
    run, out = chained
    assert "running warmup -> A -> B" in out
    for phase, steps in (("warmup", [4]), ("A", [1, 2]), ("B", [1, 2])):  # warm-up: 2 caption + 2 SFT steps
        reg = read_registry(run, phase)
        assert [c["step"] for c in reg["checkpoints"]] == steps, phase
        assert reg["aliases"]["latest"] == steps[-1]
        # warm-up saves once with scores; GRPO phases register every alias
        assert set(reg["aliases"]) == set(ALIASES), phase
        assert (run / f"config_{phase}.json").is_file()
    warm = list(step_records(run, "warmup").values())
    assert [(r["step"], r["stage"]) for r in warm] == [(1, "perception"), (2, "perception"), (3, "sft"), (4, "sft")]
    assert all(r["perception_loss"] > 0 for r in warm)
    # the tiny warm-up trains every weight (a base checkpoint); GRPO phases save adapters on it
    assert load_checkpoint(resolve(run, "warmup:latest")).extra["kind"] == "base"
    b = load_checkpoint(resolve(run, "B:latest"))
    assert b.extra == {"kind": "adapter", "base": f"warmup/{step_dirname(4)}"}
    assert b.tensors and all(k.endswith((".lora_A", ".lora_B")) for k in b.tensors if k != "sampler_generator_state")


def test_B_starts_from_A_best_structure(chained):
    run, out = chained
    best = read_registry(run, "A")["aliases"]["best_structure"]
    assert f"phase B: starting from A:best_structure ({run / 'A' / step_dirname(best)})" in out
    assert "phase A: starting from warmup:latest" in out


def test_each_phase_starts_from_its_preset_weights(chained):
    run, _ = chained
    for phase in ("A", "B"):
        first = step_records(run, phase)[1]
        assert first["weights"] == PHASE_WEIGHTS[phase], phase  # not the previous phase's gated weights
        assert first["temperature"] == 1.0


def test_gate_lines_are_logged_and_their_weights_reach_the_rewards(chained):
    run, out = chained
    lines = log_lines(run)
    moved = 0
    for phase in ("A", "B"):
        steps = step_records(run, phase)
        gates = [r for r in lines if r.get("event") == "gate" and r["phase"] == phase]
        assert gates, f"no gate fired in phase {phase} (the tiny model truncates everything)"
        for s, rec in steps.items():
            # the reward each step logs is the weighted sum of its components with the weights it logs
            expect = sum(rec["weights"][k] * v for k, v in rec["components"].items())
            assert rec["reward"] == pytest.approx(expect, abs=1e-5)
            if s + 1 not in steps:
                continue
            weights, temperature = dict(rec["weights"]), rec["temperature"]
            for g in (g for g in gates if g["step"] == s):
                (target, (old, new)), = g["changes"].items()
                if target == "temperature":
                    assert temperature == pytest.approx(old)
                    temperature = new
                else:
                    assert weights[target] == pytest.approx(old)
                    weights[target] = new
                moved += old != new
            nxt = steps[s + 1]
            assert nxt["weights"] == pytest.approx(weights), (phase, s)
            assert nxt["temperature"] == pytest.approx(temperature), (phase, s)
    assert moved, "no gate changed a value: the test above proved nothing"
    assert "  gate: [finished]" in out


def test_phase_C_with_B_present_runs_only_C(chained, tmp_path):
    run = copy_run(chained[0], tmp_path)
    before = {p: read_registry(run, p) for p in ("warmup", "A", "B")}
    rc, out, err = train(run, "--phase", "C", "--phase.steps", "1")
    assert rc == 0, err
    assert "running" not in out.split("=====")[0]  # no chaining announcement
    best = read_registry(run, "B")["aliases"]["best_composite"]
    assert f"phase C: starting from B:best_composite ({run / 'B' / step_dirname(best)})" in out
    assert {p: read_registry(run, p) for p in before} == before
    assert read_registry(run, "C")["aliases"]["latest"] == 1
    rec = step_records(run, "C")[1]
    assert rec["weights"] == PHASE_WEIGHTS["C"] and rec["weights"]["tolerance"] == 1.0
    # a rerun of a finished warm-up is skipped, not repeated
    rc, out, _ = train(run, "--phase", "warmup")
    assert rc == 0 and "warm-up already done" in out
    assert read_registry(run, "warmup") == before["warmup"]


def test_lr_0_is_the_frozen_policy_control_of_a_grpo_phase(chained, tmp_path):
    """--B.optim.lr 0: phase B samples, scores, logs, evaluates and checkpoints like training,
    and the adapter it saves is bit-identical to the one it started from."""
    from grpo.state.contents import adapter_tensors

    run = copy_run(chained[0], tmp_path)
    shutil.rmtree(run / "B")  # phase B again, from the same A:best_structure
    rc, out, err = train(run, "--phase", "B", "--phase.steps", "2", "--run.eval_every", "1", "--B.optim.lr", "0")
    assert rc == 0, err
    assert "optim.lr = 0, the frozen-policy control" in out
    start = adapter_tensors(load_checkpoint(resolve(run, "A:best_structure")).tensors)
    for step in (1, 2):
        saved = adapter_tensors(load_checkpoint(resolve(run, f"B:{step}")).tensors)
        assert saved.keys() == start.keys() and all(torch.equal(saved[k], start[k]) for k in start)
    records = [r for r in log_lines(run) if r.get("phase") == "B" and "event" not in r]
    assert [r["step"] for r in records[-2:]] == [1, 2]
    assert all(r["lr"] == 0 and "reward" in r and "correctness" in r["components"] for r in records[-2:])
    # the warm-up has no rewards to log: there lr 0 stays refused, naming the control
    rc, _, err = train(tmp_path / "other", "--phase", "B", "--optim.lr", "0")
    assert rc == 2 and "optim.lr=0.0: must be > 0 in the warm-up" in err and "--B.optim.lr 0" in err


def test_init_base_runs_just_the_phase_and_resumes_without_repeating_it(tmp_path):
    run = tmp_path / "run"
    rc, out, err = train(run, "--phase", "B", "--init", "base", "--phase.steps", "1")
    assert rc == 0, err
    assert "phase B: starting from base" in out
    assert not (run / "warmup").exists() and not (run / "A").exists()
    assert load_checkpoint(resolve(run, "B:latest")).extra["base"] is None
    # Continuing the phase later without repeating --init must resume it on the same base,
    # not run warm-up and A first and then put the adapter on the warmed-up model.
    rc, out, err = train(run, "--phase", "B", "--phase.steps", "2")
    assert rc == 0, err
    assert f"resuming phase B at step 1 from {run / 'B' / step_dirname(1)}" in out
    assert not (run / "warmup").exists() and not (run / "A").exists()
    assert read_registry(run, "B")["aliases"]["latest"] == 2
    assert load_checkpoint(resolve(run, "B:latest")).extra["base"] is None


# ----------------------------------------------------------------------------- user errors: one line, exit 2


def test_selector_that_names_nothing_lists_what_exists(chained, tmp_path):
    run = copy_run(chained[0], tmp_path)
    rc, out, err = train(run, "--phase", "C", "--init", "A:best_nothing")
    assert rc == 2
    assert "Traceback" not in err
    assert err.startswith("error: checkpoint selector 'A:best_nothing' names nothing")
    assert "best_structure" in err and "A: steps 1, 2" in err and "B: steps 1, 2" in err
    assert not (run / "C").exists()


def test_run_dir_from_an_incompatible_config_says_what_differs(chained, tmp_path):
    run = copy_run(chained[0], tmp_path)
    rc, out, err = train(run, "--phase", "C", "--lora.rank", "4")
    assert rc == 2
    assert err.startswith("error: ") and "lora.rank: saved 8, now 4" in err
    assert not (run / "C").exists()


def test_training_data_without_gold_answers_is_refused(tmp_path):
    from data.jsonl import save_jsonl
    from data.synthetic import generate

    examples = generate("train", 1, 6, seed=0)
    for ex in examples:
        ex.answer = ""  # what MathVista's `test` split looks like
    data = tmp_path / "no_gold"
    save_jsonl(examples, data)
    rc, out, err = train(tmp_path / "run", "--phase", "A", "--init", "base", "--run.data", str(data))
    assert rc == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "6 of 6 examples have an empty gold answer" in err and str(data) in err
    assert not (tmp_path / "run" / "A").exists()


def test_warmup_also_refuses_data_without_gold_answers(tmp_path):
    from data.jsonl import save_jsonl
    from data.synthetic import generate

    examples = generate("train", 1, 4, seed=0)
    examples[0].answer = " "
    save_jsonl(examples, tmp_path / "data")
    rc, _, err = train(tmp_path / "run", "--phase", "warmup", "--run.data", str(tmp_path / "data"))
    assert rc == 2 and "1 of 4 examples have an empty gold answer" in err


@pytest.mark.parametrize("args, message", [
    (["--sampling.Gx", "3"], "unknown config key --sampling.Gx"),
    (["--sampling.G", "three"], "--sampling.G 'three': expected an integer"),
    (["--optim.lr", "fast"], "expected a number"),
    (["--phase.controller", "maybe"], "expected true or false"),
    (["--lr"], "--lr needs a value"),
    (["stray"], "unexpected argument 'stray'"),
    (["--optim.loss_type", "ppo"], "optim.loss_type='ppo': use grpo, bnpo, dr_grpo or dapo"),
])
def test_bad_options_exit_2_with_one_line(tmp_path, args, message):
    rc, out, err = train(tmp_path / "run", "--phase", "A", *args)
    assert rc == 2
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "A").exists()


def test_unknown_phase_is_an_argparse_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--phase", "D", "--run.run_dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "invalid choice: 'D'" in capsys.readouterr().err


def test_help_lists_phases_and_options(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for phase in ("warmup", "A ", "B ", "C "):
        assert f"\n  {phase}" in text
    for key in ("--sampling.G", "--phase.steps", "--run.eval_every", "--lora.rank", "--optim.loss_type"):
        assert key in text
    assert "Group size" in text  # the field docstrings come along


def test_warmup_prefetch_changes_nothing_but_overlap(tmp_path, monkeypatch):
    """The warm-up prepares the next batch in a background thread (grpo.run.prefetch);
    its losses and its checkpoint must equal a plain loop's, bit for bit."""
    import grpo.warmup.sft

    args = ("--phase", "warmup", "--warmup.phase.steps", "3", "--warmup.phase.perception_steps", "3")
    assert train(tmp_path / "prefetched", *args)[0] == 0
    monkeypatch.setattr(grpo.warmup.sft, "prefetch", lambda items, depth=2: iter(items))
    assert train(tmp_path / "plain", *args)[0] == 0
    losses = [[(r["sft_loss"], r.get("perception_loss")) for r in step_records(tmp_path / d, "warmup").values()]
              for d in ("prefetched", "plain")]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    tensors = [load_checkpoint(resolve(tmp_path / d, "warmup:latest")).tensors for d in ("prefetched", "plain")]
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])


def test_prefetch_keeps_order_and_raises_where_the_producer_failed():
    from grpo.run.prefetch import prefetch

    assert list(prefetch(range(50), depth=3)) == list(range(50))

    def failing():
        yield 1
        yield 2
        raise ValueError("bad batch")

    got = []
    with pytest.raises(ValueError, match="bad batch"):
        for x in prefetch(failing()):
            got.append(x)
    assert got == [1, 2]
    it = prefetch(iter(range(10**6)), depth=2)
    assert next(it) == 0
    it.close()  # the consumer stops early: the producer thread ends instead of blocking
