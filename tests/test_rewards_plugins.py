"""Reward plug-ins (--rewards.extra NAME=module:function): loading, calling, weights and the
controller, every bad input as one line, and one 2-step phase A run that logs what the
plug-in returned, refuses a resume without it, and stops with one line when it breaks."""

import json

import plugin_rewards
import pytest
import torch
from train_helpers import log_lines, run_main

from data.schema import Example
from grpo.cli import phase_configs
from grpo.config import PHASE_WEIGHTS, RewardConfig
from grpo.controller import Controller
from grpo.errors import ConfigError
from grpo.overrides import parse_override_args
from grpo.presets import phase_preset
from grpo.rewards import RewardModel
from grpo.state.checkpoint import load_checkpoint
from grpo.state.registry import read_registry, resolve


@pytest.fixture(autouse=True)
def fresh_plugin():
    plugin_rewards.RETURNED.clear()
    plugin_rewards.FAIL = False
    yield
    plugin_rewards.FAIL = False


def examples(n=4, G=2):
    """n completions' examples: n / G prompts, each repeated G times, contiguous."""
    return [Example(pid=f"p{i // G}", question="How many bars?", answer="3") for i in range(n)]


def model(extra, weights=None):
    weights = dict(PHASE_WEIGHTS["A"]) | {name: 1.0 for name in extra} if weights is None else weights
    return RewardModel(RewardConfig(weights=weights, extra=dict(extra)), max_new_tokens=8)


COMPLETIONS = ["ab", "abcdefghij" * 2, "", "x" * 50]


# ----------------------------------------------------------------------------- calling

def test_a_plugin_is_a_component_weighted_and_summarised_like_the_built_ins():
    base = model({})(examples(), COMPLETIONS, num_tokens=[8] * 4)
    rm = model({"short": "plugin_rewards:short"}, dict(PHASE_WEIGHTS["A"]) | {"short": 2.5})
    batch = rm(examples(), COMPLETIONS, num_tokens=[8] * 4)
    want = [1 - 2 / 40, 1 - 20 / 40, 1.0, 0.0]
    assert plugin_rewards.RETURNED == [want]  # called once for the whole batch
    assert batch.components["short"].tolist() == pytest.approx(want)
    assert batch.total.tolist() == pytest.approx((base.total + 2.5 * torch.tensor(want)).tolist())
    assert batch.weights["short"] == 2.5
    assert batch.summary()["short/mean"] == pytest.approx(sum(want) / 4)
    assert batch.summary()["short/frac_nonzero"] == 0.75


def test_the_plugin_sees_one_example_per_completion_in_order():
    rm = model({"parity": "plugin_rewards:pid_parity"})
    exs = examples(6, G=3)
    assert rm(exs, ["a"] * 6, num_tokens=[1] * 6).components["parity"].tolist() == [1, 1, 1, 0, 0, 0]


def test_a_plugin_with_weight_0_is_computed_and_unpaid_and_one_left_out_is_not_called():
    rm = model({"short": "plugin_rewards:short"}, dict(PHASE_WEIGHTS["A"]) | {"short": 0.0})
    base = model({})(examples(), COMPLETIONS, num_tokens=[8] * 4)
    batch = rm(examples(), COMPLETIONS, num_tokens=[8] * 4)
    assert "short" in batch.components and torch.equal(batch.total, base.total)
    plugin_rewards.RETURNED.clear()
    rm.set_weights(PHASE_WEIGHTS["A"])  # the weights drop it: not computed, not logged
    assert "short" not in rm(examples(), COMPLETIONS, num_tokens=[8] * 4).components
    assert plugin_rewards.RETURNED == []


# ----------------------------------------------------------------------------- the command line and the config

def test_extra_parses_like_the_other_dicts_and_every_phase_pays_it_1_unless_weighted():
    overrides = parse_override_args(["--rewards.extra", "short=plugin_rewards:short,len=plugin_rewards:length",
                                     "--rewards.weights", "format=1,correctness=4,short=2",
                                     "--A.rewards.weights", "format=1,short=0"])
    configs = phase_configs("B", "tiny", overrides)
    extra = {"short": "plugin_rewards:short", "len": "plugin_rewards:length"}
    assert configs["A"].rewards.extra == configs["B"].rewards.extra == extra  # every phase, like the model
    assert configs["B"].rewards.weights == {"format": 1.0, "correctness": 4.0, "short": 2.0, "len": 1.0}
    assert configs["A"].rewards.weights == {"format": 1.0, "short": 0.0, "len": 1.0}  # an explicit 0 stays 0
    saved = json.loads(configs["B"].to_json())["rewards"]  # the resolved config printed and saved
    assert saved["extra"] == extra and saved["weights"]["len"] == 1.0
    # the phase presets keep their weights; the plug-in joins them
    only_extra = phase_configs("B", "tiny", {"rewards.extra": "short=plugin_rewards:short"})
    assert only_extra["B"].rewards.weights == PHASE_WEIGHTS["B"] | {"short": 1.0}
    assert only_extra["A"].rewards.weights == PHASE_WEIGHTS["A"] | {"short": 1.0}


def test_extra_is_repeatable_and_other_options_keep_their_last_value():
    argv = ["--rewards.extra", "short=plugin_rewards:short", "--rewards.extra", "len=plugin_rewards:length",
            "--B.rewards.extra", "a=m:f", "--B.rewards.extra=b=m:g", "--sampling.G", "4", "--sampling.G", "2"]
    assert parse_override_args(argv) == {"rewards.extra": "short=plugin_rewards:short,len=plugin_rewards:length",
                                         "B.rewards.extra": "a=m:f,b=m:g", "sampling.G": "2"}
    configs = phase_configs("B", "tiny", parse_override_args(argv[:4]))
    assert configs["B"].rewards.extra == {"short": "plugin_rewards:short", "len": "plugin_rewards:length"}


def test_a_config_built_in_code_must_weigh_its_plugins():
    cfg = phase_preset("A")
    cfg.rewards.extra = {"short": "plugin_rewards:short"}
    with pytest.raises(ConfigError, match="rewards.weights gives it no weight: add short=1"):
        cfg.validate()


def test_the_controller_carries_a_plugin_weight_and_no_gate_or_bound_moves_it():
    c = Controller(PHASE_WEIGHTS["A"] | {"short": 9.0, "off": 0.0}, max_new_tokens=8, temperature=1.2)
    bad = dict(parseable=0.5, solution_tag=0.5, reasoning_tag=0.5, malformed=0.5, truncation=0.5, exact=0.1,
               mean_tokens=8.0, zero_spread=0.9)  # every gate on the verifier's weights fires
    good = dict(parseable=1.0, solution_tag=1.0, reasoning_tag=1.0, malformed=0.0, truncation=0.0, exact=0.5,
                mean_tokens=2.0)
    fired = {d.target for d in c.update(bad, n=200) + c.update(good, n=200) + c.update(good, n=200)}
    assert {"parseable", "format", "finished", "brevity", "correctness"} <= fired
    assert c.weights["short"] == 9.0 and c.weights["off"] == 0.0  # above every bound, and switched off: as given
    assert Controller.from_state_dict(json.loads(json.dumps(c.state_dict()))).weights == c.weights  # a resume keeps it


# ----------------------------------------------------------------------------- bad input: one line each

@pytest.mark.parametrize("extra, match", [
    ({"short": "plugin_rewards.short"}, r"rewards.extra short='plugin_rewards.short': write NAME=module:function"),
    ({"short": ":short"}, "write NAME=module:function"),
    ({"format": "plugin_rewards:short"}, "plug-in 'format', which is a built-in reward component"),
    ({"my-reward": "plugin_rewards:short"}, "names a plug-in 'my-reward': give a name of letters, digits and _"),
    ({"short": "no_such_module_anywhere:short"},
     r"module 'no_such_module_anywhere' does not import \(ModuleNotFoundError: No module named 'no_such_module_anywhere'\)"),
    ({"short": "plugin_broken:short"},  # the module exists; an import inside it fails
     r"module 'plugin_broken' does not import \(ModuleNotFoundError: No module named 'package_that_does_not"),
    ({"short": "plugin_rewards:shortest"}, "module 'plugin_rewards' has no attribute 'shortest'"),
    ({"short": "plugin_rewards:NOT_CALLABLE"}, "NOT_CALLABLE is a int, not callable"),
])
def test_bad_plugins_are_refused_when_the_reward_model_is_built(extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        model(extra)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fn, match", [
    ("fails_on_long", r"reward plug-in 'bad' raised on row 1 \(example 'p0'\): ValueError: too long: 20 characters"),
    ("fails_on_batches", "raised on a batch of 4 rows \\(each row alone scores\\): RuntimeError: wants one row"),
    ("one_short", "returned 3 values for 4 completions"),
    ("nan_in_row_1", r"returned nan for row 1 \(example 'p0'\): every value must be a finite number"),
    ("not_a_list", "returned a float: return a list of 4 floats"),
])
def test_a_bad_call_is_one_line_naming_the_plugin_and_the_row(fn, match):
    rm = model({"bad": f"plugin_rewards:{fn}"})
    with pytest.raises(ConfigError, match=match) as err:
        rm(examples(), COMPLETIONS, num_tokens=[8] * 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, match", [
    (["--rewards.extra", "short"], "--rewards.extra 'short': expected name=value,name=value"),
    (["--rewards.extra", "short=plugin_rewards"], "write NAME=module:function"),
    (["--rewards.extra", "tolerance=plugin_rewards:short"], "which is a built-in reward component"),
    (["--rewards.extra", "short=plugin_rewards:nope"], "module 'plugin_rewards' has no attribute 'nope'"),
    (["--rewards.weights", "format=1,short=1"], "unknown component 'short': known components are format, "),
])
def test_the_trainer_refuses_a_bad_plugin_in_one_line_before_a_model_loads(tmp_path, args, match):
    rc, out, err = run_main(tmp_path / "run", "--phase", "A", "--init", "base", "--model.name", "tiny-random", *args)
    assert rc == 2 and err.startswith("error: ") and match in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "quantised" not in out and not (tmp_path / "run" / "A").exists()


# ----------------------------------------------------------------------------- end to end

TINY = ["--model.name", "tiny-random", "--model.device", "cpu", "--run.train_per_stage", "20", "--run.eval_size", "4",
        "--sampling.G", "2", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
        "--run.test_per_stage", "0", "--phase", "A", "--init", "base", "--run.eval_every", "2"]


def test_two_steps_of_phase_A_log_the_plugin_and_a_resume_needs_it(tmp_path):
    run = tmp_path / "run"
    extra = ["--rewards.extra", "short=plugin_rewards:short"]
    rc, out, err = run_main(run, *TINY, "--phase.steps", "2", *extra)
    assert rc == 0, err
    assert '"short": 1.0' in out and '"short": "plugin_rewards:short"' in out  # the resolved config
    steps = [r for r in log_lines(run) if "event" not in r]
    assert len(steps) == len(plugin_rewards.RETURNED) == 2  # one call per rollout batch, none by the eval
    for record, values in zip(steps, plugin_rewards.RETURNED):
        assert len(values) == 4  # 2 prompts x G = 2
        assert record["components"]["short"] == pytest.approx(sum(values) / 4)
        assert record["weights"]["short"] == 1.0
    # a resume without the plug-in would score with other rewards: one line, before a model loads
    rc, out, err = run_main(run, *TINY, "--phase.steps", "3")
    assert rc == 2 and "rewards.extra: saved {'short': 'plugin_rewards:short'}, now {}" in err
    # the resume imports it again; when it breaks there, the run stops with one line, step 2's checkpoint intact
    plugin_rewards.FAIL = True
    rc, out, err = run_main(run, *TINY, "--phase.steps", "3", *extra)
    assert rc == 2 and "resuming phase A at step 2" in out
    assert err.startswith("error: reward plug-in 'short' raised on row 0 (example ")
    assert err.strip().endswith("): ValueError: the scorer broke") and len(err.strip().splitlines()) == 1
    assert read_registry(run, "A")["aliases"]["latest"] == 2
    load_checkpoint(resolve(run, "A:latest"))  # verifies every file's digest
