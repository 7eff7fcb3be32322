"""bench/learning.py end to end in its --quick configuration (about 40 s on 2 shared cores),
through its command line (python -m bench.learning): one seed, the default run plus three
variants -- the correctness-0 ablation and the random-reward control (both from the shipped
base) and the frozen-policy control (shares the default's phase A) -- through training
subprocesses, the reports, pass@8 with shuffled images, the summary and the plots.
Then: a rerun trains and samples nothing, changed settings refuse the old run directories,
bad arguments are one line with exit code 2. The numbers of a 2-step run mean nothing: only
the structure is asserted (the benchmark itself carries the numbers)."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import learning
from grpo.cli import phase_configs
from grpo.config import PHASE_WEIGHTS
from grpo.overrides import parse_override_args

VARIANTS = "correctness0,random,frozen"
CELL = r"[+-]?\d+\.\d+ \[[+-]?\d+\.\d+, [+-]?\d+\.\d+\]"  # one seed: the value and its 95% interval


def bench(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()  # main() sets this process's torch threads
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = learning.main(list(args))
    finally:
        torch.set_num_threads(threads)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("learning")
    root = Path(__file__).resolve().parents[1]
    # two trainers at a time: both ablations start together once the default run is done
    proc = subprocess.run(
        [sys.executable, "-m", "bench.learning", "--quick", "--seeds", "1", "--variants", VARIANTS, "--out", str(out),
         "--jobs", "2"], cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return out, proc.stdout


def table(md: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after a heading, header included."""
    lines = md.split(heading, 1)[1].splitlines()
    lines = lines[next(i for i, ln in enumerate(lines) if ln.startswith("|")):]
    rows = lines[: next((i for i, ln in enumerate(lines) if not ln.startswith("|")), len(lines))]
    assert rows and set(rows[1].replace("|", "")) == {"-"}, rows[:2]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[:1] + rows[2:]]


def test_quick_run_writes_the_tables_json_and_plots(quick):
    out, stdout = quick
    md = (out / "summary.md").read_text()
    reasoning = ["answer follows", "right reasoning, wrong answer", "arithmetic right", "key steps"]
    cols = ["EM", "EM stage 3", "EM shuffled", "blind gap", "parseable", "tokens", *reasoning,
            "pass@8", "pass@8 shuffled", "pass@8 gap"]
    main = table(md, "## Main run (defaults)")
    assert main[0] == ["model"] + cols
    assert [r[0] for r in main[1:]] == [learning.CHECKPOINT_TITLES[c] for c in learning.CHECKPOINTS]
    # 8-token completions parse nothing: a reasoning metric defined on none of them is "—", never a number
    assert all(re.fullmatch(CELL, c) or (h in reasoning and c == "—")
               for r in main[1:] for h, c in zip(cols, r[1:])), main
    for sel in learning.CHECKPOINTS:  # one table per checkpoint; the control is not a row
        rows = table(md, f"### {learning.CHECKPOINT_TITLES[sel]}")
        assert rows[0] == ["variant"] + cols
        assert [r[0] for r in rows[1:]] == (["`default`"] if sel == "base" else ["`default`", "`correctness0`", "`random`"])
    curves = table(md, "## Training curves")
    assert [r[0] for r in curves[1:]] == ["`default`", "`correctness0`", "`random`", "`frozen`"]
    assert "--B.optim.lr 0" in md and "--A.rewards.weights" in md  # every variant's command line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [0] and list(summary["variants"]) == ["default", "correctness0", "random", "frozen"]
    em = summary["variants"]["default"]["checkpoints"]["B:latest"]["exact_match"]
    assert em["n"] == 1 and em["per_seed"][0]["seed"] == 0 and em["per_seed"][0]["lo"] <= em["mean"] + 1e-9
    assert "checkpoints" not in summary["variants"]["frozen"]
    for png in ("curves_seed0.png", "test_checkpoints.png"):
        assert (out / png).stat().st_size > 10_000
    assert stdout.strip().splitlines()[-1].startswith("summary: 1 seed(s); default test EM base ")
    assert "| Shipped base, before RL (`base`) |" in stdout  # the tables are printed too


def test_ablations_start_from_the_base_and_the_control_from_phase_A(quick):
    out, _ = quick
    default, ablation, random, frozen = (out / v / "seed0" for v in ("default", "correctness0", "random", "frozen"))
    # byte copies: the same checkpoint, the same digests
    assert (frozen / "A" / "registry.json").read_bytes() == (default / "A" / "registry.json").read_bytes()
    for run in (ablation, random):  # their own phase A, from the shipped base; no warm-up anywhere
        assert (run / "A" / "registry.json").read_bytes() != (default / "A" / "registry.json").read_bytes()
        assert "phase A: starting from base" in (run / "train.out").read_text()
    assert not any((out / v / "seed0" / "warmup").exists() for v in ("default", "correctness0", "random", "frozen"))

    def b_steps(run):
        return learning.b_steps_of([json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()])

    assert all(r["weights"]["correctness"] == 0.0 for r in b_steps(ablation))  # held at 0 through the gates
    # the control samples phase B's first batch from the same policy, prompts and seed as training
    assert b_steps(frozen)[0]["reward"] == b_steps(default)[0]["reward"]
    assert all(r["lr"] == 0.0 for r in b_steps(frozen)) and not (frozen / "report").exists()


def test_a_rerun_trains_and_samples_nothing(quick):
    out, _ = quick
    logs = {p: p.read_bytes() for p in out.glob("*/seed0/train_log.jsonl")}
    before = (out / "summary.md").read_text()
    rc, stdout, stderr = bench("--quick", "--seeds", "1", "--variants", VARIANTS, "--out", str(out))  # --jobs 1
    assert rc == 0, stderr
    assert stdout.count("finished earlier, reused") == 4
    assert ": training" not in stdout and "pass@8 of" not in stdout  # no trainer, no sampling
    assert {p: p.read_bytes() for p in logs} == logs
    assert (out / "summary.md").read_text() == before


def test_other_settings_refuse_the_old_run_directories(quick):
    out, _ = quick
    rc, _, err = bench("--seeds", "1", "--variants", "default", "--out", str(out), "--plan")  # the full defaults
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {out / 'default' / 'seed0'} holds a run made with other settings (") and \
        "delete it to rerun with these" in err


@pytest.mark.parametrize("args, message", [
    (["--variants", "nosuch"], "--variants 'nosuch': unknown variant 'nosuch'; use 'all' or some of default,"),
    (["--variants", "mu2,,bogus"], "unknown variant 'bogus'"),
    (["--seeds", "0"], "--seeds 0: must be >= 1"),
    (["--seeds", "-3"], "--seeds -3: must be >= 1"),
    (["--seeds", "three"], "argument --seeds: invalid int value: 'three'"),
    (["--pass-k", "-1"], "--pass-k -1: must be >= 1 samples per prompt, or 0 to skip pass@k"),
    (["--threads", "-1"], "--threads -1: must be >= 0"),
    (["--jobs", "0"], "--jobs 0: must be >= 1"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_one_line_with_exit_code_2(args, message):
    rc, out, err = bench(*args)
    assert rc == 2 and not out
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_variant_options_are_read_from_the_config():
    cfgs = phase_configs("B", "tiny", parse_override_args([]))
    floor = learning.VARIANTS["std_floor"].args(cfgs)
    for phase in ("A", "B"):  # w_correctness / sqrt(G), cut to 3 significant digits
        value = float(floor[floor.index(f"--{phase}.optim.adv_std_floor") + 1])
        exact = cfgs[phase].rewards.weights["correctness"] / cfgs[phase].sampling.G ** 0.5
        assert exact - 0.01 < value <= exact
    weights = learning.VARIANTS["correctness0"].args(cfgs)
    for phase in ("A", "B"):  # the whole preset, not just correctness=0 (an override replaces the dict)
        given = parse_override_args(weights)[f"{phase}.rewards.weights"]
        assert dict(kv.split("=") for kv in given.split(",")) == {
            k: repr(0.0 if k == "correctness" else float(v)) for k, v in PHASE_WEIGHTS[phase].items()}
    assert learning._round_down(1.41421356) == 1.41 and learning._round_down(0.70710678) == 0.707
    tenth = phase_configs("B", "tiny", parse_override_args(learning.VARIANTS["vision_lr"].args(cfgs)))
    for phase in ("A", "B"):  # the vision variant's switches, both learning rates a tenth
        c = tenth[phase]
        assert c.lora.vision and c.lora.merger and c.optim.vision_lr_scale == c.optim.merger_lr_scale == 0.1


# ----------------------------------------------------------------------------- the papers' variants

PAPER_VARIANTS = ("a_continued,no_controller,no_curriculum,step_rewards,detail,rubrics_prefix,rubrics_sequence,arithmetic,"
                  "phase_c")


def test_a_continued_gives_phase_b_every_setting_of_a():
    cfgs = phase_configs("B", "tiny", parse_override_args([]))
    opts = learning.VARIANTS["a_continued"].args(cfgs)
    cont = phase_configs("B", "tiny", parse_override_args(opts))
    a, b = json.loads(cont["A"].to_json()), json.loads(cont["B"].to_json())
    differ = {f"{sec}.{k}" for sec in a for k in a[sec] if a[sec][k] != b[sec][k]}
    assert differ <= {"phase.name", "phase.steps", "phase.init", "run.eval_every"}, differ
    assert cont["B"].phase.init == "A:latest" and cont["B"].phase.steps == cfgs["B"].phase.steps


def test_a_reward_the_data_cannot_feed_is_one_line_naming_variant_and_field():
    import dataclasses

    from data.synthetic import generate

    cfgs = phase_configs("B", "tiny", parse_override_args(
        learning.VARIANTS["detail"].args(phase_configs("B", "tiny", {}))))
    assert learning.reward_data_problem("detail", cfgs) is None  # the synthetic data has intermediates
    def bare(cfg):
        return {1: [dataclasses.replace(generate("train", 1, 1, 0, 56)[0], intermediates=[])]}
    msg = learning.reward_data_problem("detail", cfgs, bare)
    assert "variant detail" in msg and "'detail'" in msg and "has no intermediates" in msg and "\n" not in msg


@pytest.fixture(scope="module")
def papers(tmp_path_factory):
    out = tmp_path_factory.mktemp("papers")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.learning", "--quick", "--seeds", "1", "--variants", PAPER_VARIANTS,
         "--pass-k", "0", "--out", str(out), "--jobs", "2"], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return out


def test_every_paper_variant_trains_and_is_compared_with_the_default(papers):
    summary = json.loads((papers / "summary.json").read_text())
    for name in ["default", *PAPER_VARIANTS.split(",")]:
        last = summary["variants"][name]["final"]
        for key in ("exact_match", "exact_match_stage3", "answer_follows", "right_reasoning_wrong", "key_step_accuracy"):
            assert key in last, (name, key)  # 2-step runs: the value may be None (nothing parsed), the key is there
        if name != "default":
            assert summary["variants"][name]["versus_default"]["n"] == 1, name
    weights = json.loads((papers / "rubrics_prefix" / "seed0" / "config_B.json").read_text())["rewards"]
    assert weights["rubric_mode"] == "prefix" and weights["weights"]["rubric"] > 0
    log = [json.loads(ln) for ln in (papers / "step_rewards" / "seed0" / "train_log.jsonl").read_text().splitlines()]
    assert any("step_rar" in r.get("components", {}) for r in log if r.get("phase") == "A")
    log = [json.loads(ln) for ln in (papers / "arithmetic" / "seed0" / "train_log.jsonl").read_text().splitlines()]
    assert any("arithmetic" in r.get("components", {}) for r in log if r.get("phase") == "B")
    md = (papers / "summary.md").read_text()
    rows = table(md, "## Every variant's last model")
    assert [r[0] for r in rows[1:]] == [f"`{n}`" for n in ["default", *PAPER_VARIANTS.split(",")[:-1]]] + [
        "`phase_c` (C:latest)"]
    c = json.loads((papers / "phase_c" / "seed0" / "bench_eval.json").read_text())
    assert {"C:best_composite", "C:latest"} <= set(c["checkpoints"]) and c["last_minus_before"] is not None
    assert "exact_match_stage2" in summary["variants"]["phase_c"]["final"]


def test_report_only_summarises_what_is_finished_and_trains_nothing(papers, tmp_path):
    import shutil

    out = tmp_path / "partial"
    shutil.copytree(papers / "default", out / "default")
    rc, stdout, _ = bench("--quick", "--seeds", "1", "--pass-k", "0", "--variants", "detail", "--out", str(out),
                          "--report-only")
    assert rc == 0 and "detail seed0: new, left out" in stdout
    assert not (out / "detail").exists()
    assert "- detail seed0" in (out / "summary.md").read_text()
