"""Every evaluation says how many distinct answers the policy gives, and one line names a collapse.

A policy that answers one constant to every prompt has a blind gap of 0 for a reason a reader
should not have to infer: the evaluation line counts the greedy answers (distinct, the most
common one's share; both in the log's eval record), a single answer adds a warning naming the
likely cause and the fix, and ``--run.stop_on_collapse`` stops the run there (exit 1, one line,
the checkpoint saved).
"""

from types import SimpleNamespace

from train_helpers import log_lines, run_main

from eval.report import collapse_warning, control_summary
from eval.results import EvalResult
from grpo.state.registry import read_registry


def _result(answers, n=None):
    ns = SimpleNamespace(records=[{"answer": a} for a in answers], blind_gap=None, control_note="not run",
                         overall=SimpleNamespace(n_prompts=n or len(answers)))
    ns.answer_spread = lambda: EvalResult.answer_spread(ns)
    return ns


def test_the_spread_of_the_answers_and_the_warning():
    assert EvalResult.answer_spread(_result(["6", "6", "3", None])) == (2, 2 / 3, "6")
    assert EvalResult.answer_spread(_result([None])) == (0, 0.0, None)
    assert collapse_warning("B @ 40", _result(["6", "6", "3"])) is None
    warning = collapse_warning("B @ 40", _result(["6"] * 5))
    assert warning.startswith("warning: B @ 40: the policy answers '6' to every prompt (one constant")
    assert "--sft-first always" in warning and "--optim.beta 1" in warning and "\n" not in warning
    lines = control_summary("B @ 40", _result(["6"] * 5))
    assert lines[1] == "answers: 1 distinct, the most common '6' in 100%" and lines[2] == warning


def test_the_log_records_the_spread_and_the_option_stops_the_run(tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = ["--phase", "A", "--init", "base", "--model.device", "cpu", "--phase.steps", "2", "--run.eval_every", "1",
            "--run.eval_size", "4", "--sampling.G", "2", "--sampling.max_new_tokens", "8",
            "--phase.prompts_per_step", "2", "--run.test_per_stage", "0"]
    rc, out, err = run_main(run, *args)
    assert rc == 0, err
    evals = [r for r in log_lines(run) if r.get("event") == "eval"]
    assert evals and all({"answers_distinct", "answer_top_share"} <= set(r["metrics"]) for r in evals)
    assert "  answers: " in out
    # with the option, a collapse (faked: the warning fires) ends the run after the step's checkpoint
    import grpo.train

    monkeypatch.setattr(grpo.train, "collapse_warning", lambda name, result: f"warning: {name}: one constant")
    rc, _, err = run_main(tmp_path / "stop", *args, "--run.stop_on_collapse", "true")
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: phase A stopped at step 1 (--run.stop_on_collapse; its checkpoint is saved): A @ 1:")
    assert read_registry(tmp_path / "stop", "A")["aliases"]["latest"] == 1
