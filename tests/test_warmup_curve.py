"""The warm-up's validation curve (--warmup.phase.val_every) and its stop (--warmup.phase.patience).

Evaluating on the validation rows between steps changes nothing in training: every loss and the
final weights equal a warm-up without the curve. With patience the warm-up stops where its
validation EM has not risen for that many evaluations, is finished there (the next phase starts
from it, a second command does not train it further), and a warm-up stopped by a signal and
resumed stops at the same step with the same bytes. The tiny-random base answers nothing right
in a few steps, so its validation EM is flat (0) and the stop's step is known.
"""

from __future__ import annotations

import json
import signal

import pytest
from test_stop import TOTAL, WARMUP, assert_one_stop_line, final_bytes, losses
from train_helpers import Trainer, log_lines, run_main

from grpo.state.checkpoint import load_checkpoint
from grpo.state.registry import read_registry, resolve
from grpo.state.resume import phase_finished

CAPTIONS = 5  # WARMUP's caption steps come first; the curve's points count SFT steps after them


def evals(run) -> list[int]:
    return [r["step"] for r in log_lines(run) if r.get("phase") == "warmup" and r.get("event") == "eval"]


@pytest.fixture(scope="module")
def stopped_warmup(tmp_path_factory):
    """Patience 2 on a flat curve: points after SFT steps 1, 2, 3; the third is the second without a rise."""
    run = tmp_path_factory.mktemp("curve") / "run"
    rc, out, err = run_main(run, *WARMUP, "--warmup.phase.val_every", "1", "--warmup.phase.patience", "2",
                            "--run.save_every_minutes", "0")
    assert rc == 0, err
    return run, out


def test_the_curve_changes_nothing_in_training(tmp_path):
    straight, curve = tmp_path / "straight", tmp_path / "curve"
    assert run_main(straight, *WARMUP, "--run.save_every_minutes", "0")[0] == 0
    rc, out, err = run_main(curve, *WARMUP, "--warmup.phase.val_every", "2", "--run.save_every_minutes", "0")
    assert rc == 0, err
    assert evals(curve) == [CAPTIONS + 2, CAPTIONS + 4, TOTAL] and evals(straight) == [TOTAL]
    assert "warmup: validation EM 0.000 at step 7, best 0.000 at step 7" in out and "stopping" not in out
    assert losses(curve) == losses(straight) and len(losses(curve)) == TOTAL
    assert final_bytes(curve, "warmup") == final_bytes(straight, "warmup")


def test_patience_stops_the_warm_up_and_it_is_finished_there(stopped_warmup):
    run, out = stopped_warmup
    stop = CAPTIONS + 3
    assert evals(run) == [CAPTIONS + 1, CAPTIONS + 2, stop, stop]  # the last: the final evaluation
    assert (f"warmup: validation EM 0.000 at step {stop}, best 0.000 at step {CAPTIONS + 1}; 2 evaluations without "
            "a higher one: stopping here (--warmup.phase.patience 2; 5 steps were planned)") in out
    assert max(losses(run)) == stop
    reg = read_registry(run, "warmup")
    assert [c["step"] for c in reg["checkpoints"]] == [stop] and "periodic" not in reg["checkpoints"][0]
    assert json.loads(load_checkpoint(resolve(run, "warmup:latest")).config_json)["phase"]["steps"] == 3
    assert phase_finished(run, "warmup")
    rc, out, err = run_main(run, *WARMUP, "--warmup.phase.val_every", "1", "--warmup.phase.patience", "2")
    assert rc == 0, err
    assert max(losses(run)) == stop and evals(run)[-1] == stop  # finished: nothing trained again


def test_a_stopped_and_resumed_warm_up_stops_at_the_same_step(stopped_warmup, tmp_path):
    straight, _ = stopped_warmup
    run, curve = tmp_path / "run", ["--warmup.phase.val_every", "1", "--warmup.phase.patience", "2"]
    t = Trainer(run, *WARMUP, *curve)
    t.wait_for_step("warmup", CAPTIONS + 1)
    t.signal(signal.SIGTERM)
    rc, out, err = t.finish()
    stopped = int(assert_one_stop_line(rc, err, signal.SIGTERM).group(2))
    assert CAPTIONS + 1 <= stopped <= CAPTIONS + 3, stopped
    rc, out, err = run_main(run, *WARMUP, *curve)
    assert rc == 0, err
    assert read_registry(run, "warmup")["aliases"]["latest"] == CAPTIONS + 3
    assert final_bytes(run, "warmup") == final_bytes(straight, "warmup")
    assert losses(run) == losses(straight)


@pytest.mark.parametrize("option, says", [
    (["--warmup.phase.patience", "2"], "phase.patience=2 stops on the validation curve, which needs phase.val_every > 0"),
    (["--A.phase.val_every", "2"], "the warm-up's validation curve; phase A evaluates every run.eval_every steps"),
    (["--warmup.phase.val_every", "-1"], "phase.val_every=-1, phase.patience=0: must be >= 0"),
])
def test_bad_curve_options_are_one_line(tmp_path, option, says):
    rc, _, err = run_main(tmp_path / "run", *WARMUP[2:], "--phase", "A", *option)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
