"""Own data the base cannot answer: the command warms up on the labels first, then RL from it.

`python -m grpo.train --phase B --run.data DIR` probes the base on 16 training prompts
(grpo/own_data.py). On polygons the shipped base never saw (bench/own_sets.py) hardly a group has
a correct completion: the plan becomes warm-up -> B, B starts from warmup:latest with a KL to it
(beta 1, the warm-up its reference), and one line says why. On the synthetic figures it was
pretrained on, most groups do: the plan stays A -> B. --sft-first overrides the probe; the
options the user set are kept; bad input is one line.
"""

import json
import math
import re
from pathlib import Path

import pytest
from test_own_data import minimal_rows
from train_helpers import run_main

import grpo.own_data as own_data
from bench.own_sets import polygons
from grpo.cli import phase_configs
from grpo.own_data import TINY_LR, WARMUP_PASSES, _training_rows, sft_first
from grpo.run.phase_data import fall_back_to_all
from grpo.state.checkpoint import load_checkpoint
from grpo.state.registry import resolve

FAST = ["--model.device", "cpu", "--run.eval_size", "2", "--sampling.max_new_tokens", "24",
        "--phase.prompts_per_step", "2", "--phase.steps", "1", "--A.phase.steps", "1", "--run.test_per_stage", "0",
        "--warmup.phase.prompts_per_step", "4"]


def _write(root: Path, rows) -> Path:
    (root / "img").mkdir(parents=True)
    lines = []
    for row, image in rows:
        row = dict(row, image=f"img/{row['pid']}.png")
        image.save(root / row["image"])
        lines.append(json.dumps(row))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def unseen(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("polygons"), polygons(60, seed=0))


def test_no_signal_warms_up_first_then_rl_from_it_with_a_kl_to_it(unseen, tmp_path):
    run = tmp_path / "run"
    rc, out, err = run_main(run, *FAST, "--phase", "B", "--run.data", str(unseen), "--warmup.phase.steps", "2")
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("own data:"))
    assert re.search(r"the base answered [0-7] of 16 probe prompts correctly at least once in G=8 samples "
                     r"\(\d+% < 50%\): RL alone would get almost no signal", line), line
    assert "so the warm-up first (SFT on the labels: 2 steps x 4" in line and "with a KL to it (beta 1)" in line
    assert not (run / "A").exists() and (run / "warmup").is_dir()
    b = json.loads((run / "config_B.json").read_text())
    assert b["phase"]["init"] == "warmup:latest" and b["optim"]["beta"] == 1.0
    assert b["optim"]["lr"] == 1e-4 and b["sampling"]["guided"] is False  # own_data.TINY_LR, AFTER_WARMUP
    assert "LoRA in the vision tower on, merger on and lm_head on" in line
    w = json.loads((run / "config_warmup.json").read_text())
    assert w["optim"]["lr"] == 4e-3 and "passes over" in line and "rows at lr 0.004)" in line  # TINY_LR: the tiny base
    assert w["lora"]["vision"] and w["lora"]["merger"] and b["lora"]["vision"] and b["lora"]["merger"]  # PLAN_VISION
    assert w["lora"]["targets"][-1] == b["lora"]["targets"][-1] == "lm_head"  # own_data.HEAD: the tiny base
    tensors = load_checkpoint(resolve(run, "warmup:latest")).tensors
    assert any(".visual.blocks." in k for k in tensors) and any(".visual.merger." in k for k in tensors)
    assert any(k.startswith("lm_head.") for k in tensors)
    assert load_checkpoint(resolve(run, "B:latest")).extra["reference"].startswith("warmup/")
    # the same command again: B resumes (one more step) with the KL weight, lr and adapters it ran with
    rc, out, err = run_main(run, *FAST, "--phase", "B", "--run.data", str(unseen), "--B.phase.steps", "2")
    assert rc == 0, err
    b = json.loads((run / "config_B.json").read_text())
    assert b["optim"]["beta"] == 1.0 and b["optim"]["lr"] == 1e-4 and b["lora"]["vision"] and b["lora"]["merger"]
    assert "lm_head" in b["lora"]["targets"]
    # a warm-up begun at another lr keeps it when the plan resumes it (its schedule continues)
    w["optim"]["lr"] = 7e-4
    (run / "config_warmup.json").write_text(json.dumps(w))
    configs = phase_configs("B", "tiny", {"run.data": str(unseen)})
    fall_back_to_all(configs)
    own_data._keep_saved_choices(["warmup", "B"], configs, run, set())
    assert configs["warmup"].optim.lr == 7e-4 and configs["B"].optim.lr == 5e-4  # B's own lr only on a resumed B
    # and phase C after it carries the warm-up's adapters (dropping them would be refused)
    rc, out, err = run_main(run, *FAST, "--phase", "C", "--run.data", str(unseen))
    assert rc == 0, err
    c = json.loads((run / "config_C.json").read_text())
    assert c["lora"]["vision"] and c["lora"]["merger"] and "lm_head" in c["lora"]["targets"]


def test_the_warm_up_is_sized_in_passes_and_user_options_win(unseen, tmp_path):
    rc, out, err = run_main(tmp_path / "run", *FAST, "--phase", "B", "--run.data", str(unseen), "--sft-first", "always",
                            "--B.optim.beta", "0.25", "--warmup.phase.steps", "1", "--optim.lr", "3e-4",
                            "--lora.vision", "false", "--merger", "false", "--lora.targets", "q_proj,v_proj")
    assert rc == 0, err
    assert "own data: --sft-first always; so the warm-up first (SFT on the labels: 1 steps x 4" in out
    b = json.loads((tmp_path / "run" / "config_B.json").read_text())
    assert b["optim"]["beta"] == 0.25 and b["optim"]["lr"] == 3e-4  # what the user set wins
    assert json.loads((tmp_path / "run" / "config_warmup.json").read_text())["optim"]["lr"] == 3e-4  # in every phase
    assert not b["lora"]["vision"] and not b["lora"]["merger"]  # --lora.vision false wins in every phase
    assert b["lora"]["targets"] == ["q_proj", "v_proj"]  # and targets the user names get no lm_head
    assert "LoRA in the vision tower off, merger off and lm_head off" in out
    # the default size: WARMUP_PASSES over the training rows, printed (not run)
    configs = phase_configs("B", "tiny", {"run.data": str(unseen)})
    fall_back_to_all(configs)
    assert sft_first(["A", "B"], configs, set(), "cpu", "always") == ["warmup", "B"]
    rows, per_step = _training_rows(configs["warmup"]), configs["warmup"].phase.prompts_per_step
    assert 40 <= rows <= 54 and configs["warmup"].phase.steps == math.ceil(WARMUP_PASSES * rows / per_step)


def test_the_tiny_bases_learning_rates_are_not_a_pretrained_models(unseen):
    """TINY_LR was measured on the shipped tiny base; another model's phases keep their preset's lr."""
    for name, head in (("tiny", True), ("tiny-random", False)):
        configs = phase_configs("B", "tiny", {"run.data": str(unseen), "model.name": name})
        fall_back_to_all(configs)
        preset = {phase: configs[phase].optim.lr for phase in ("warmup", "B")}
        assert sft_first(["A", "B"], configs, set(), "cpu", "always") == ["warmup", "B"]
        lrs = {phase: configs[phase].optim.lr for phase in ("warmup", "B")}
        assert lrs == (TINY_LR if head else preset), (name, lrs)
        assert ("lm_head" in configs["B"].lora.targets) == head and configs["B"].optim.beta == 1.0


def test_signal_keeps_the_plan_and_never_skips_the_probe(tmp_path):
    data = _write(tmp_path / "synthetic", minimal_rows(60))
    rc, out, err = run_main(tmp_path / "run", *FAST, "--phase", "B", "--run.data", str(data),
                            "--sampling.max_new_tokens", "48")  # the base's worked answers need their length
    assert rc == 0, err
    assert "RL has signal, running A -> B" in out and not (tmp_path / "run" / "warmup").exists()
    rc, out, err = run_main(tmp_path / "never", *FAST, "--phase", "B", "--run.data", str(data), "--sft-first", "never")
    assert rc == 0, err
    assert "own data:" not in out and (tmp_path / "never" / "A").is_dir()


def test_bad_input_is_one_line(unseen, tmp_path):
    rc, _, err = run_main(tmp_path / "a", *FAST, "--phase", "B", "--run.data", str(unseen), "--sft-first", "maybe")
    assert rc == 2 and err.strip() == "error: --sft-first 'maybe': use auto, always or never", err
    few = _write(tmp_path / "few", polygons(30, seed=1))
    rc, _, err = run_main(tmp_path / "b", *FAST, "--phase", "B", "--run.data", str(few), "--sft-first", "always",
                          "--warmup.phase.prompts_per_step", "32")
    assert rc == 2 and "too few to warm up on (32 a step" in err and len(err.strip().splitlines()) == 1, err


def test_one_gold_answer_for_every_row_is_one_line(tmp_path):
    rows = [(dict(row, answer="4"), image) for row, image in polygons(30, seed=2)]
    same = _write(tmp_path / "same", rows)
    rc, _, err = run_main(tmp_path / "run", *FAST, "--phase", "B", "--run.data", str(same), "--sft-first", "never")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "have the gold answer '4': answering it always scores 1.0" in err and "--data.columns answer=" in err


def test_a_warm_up_over_the_step_cap_is_capped_with_one_line(unseen, monkeypatch, capsys):
    monkeypatch.setattr(own_data, "MAX_WARMUP_STEPS", 10)  # the 60 polygons at 17 passes: about 200 steps of 4
    configs = phase_configs("B", "tiny", {"run.data": str(unseen), "warmup.phase.prompts_per_step": "4"})
    fall_back_to_all(configs)
    assert own_data.sft_first(["A", "B"], configs, set(), "cpu", "always") == ["warmup", "B"]
    assert configs["warmup"].phase.steps == 10
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "capped at 10" in ln)
    assert re.search(r"own data: 17 passes over \d+ rows would be \d+ warm-up steps; capped at 10 \(0.\d passes", line)
    configs = phase_configs("B", "tiny", {"run.data": str(unseen), "warmup.phase.steps": "50"})
    fall_back_to_all(configs)
    own_data.sft_first(["A", "B"], configs, {"warmup.phase.steps"}, "cpu", "always")
    assert configs["warmup"].phase.steps == 50  # a size the user set is kept
