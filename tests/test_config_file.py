"""--config FILE: a saved config_<phase>.json loads back to the same resolved config, YAML
sections and phase sections become the CLI's overrides, flags win, and each bad file is one line."""

import json

import pytest
from train_helpers import run_main

from grpo.cli import command_overrides, phase_configs
from grpo.config_file import read_config_file
from grpo.errors import ConfigError


def test_a_saved_config_loads_back_to_the_same_resolved_config(tmp_path):
    cfgs = phase_configs("B", "tiny", {"optim.lr": "1e-3", "A.phase.steps": "3", "sampling.G": "4"})
    saved = tmp_path / "config_B.json"
    saved.write_text(cfgs["B"].to_json())  # what the CLI writes for phase B
    again = phase_configs("B", "tiny", command_overrides([], str(saved), "B"))
    assert again["B"].to_dict() == cfgs["B"].to_dict()


def test_yaml_sections_phase_sections_and_flags_win(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 1e-3\nsampling: {G: 4}\nA:\n  phase: {steps: 5}\nphase:\n  mixture: {1: 0.5, 2: 0.5}\n")
    assert read_config_file(str(f), "B") == {"optim.lr": "1e-3", "sampling.G": 4, "A.phase.steps": 5,
                                             "phase.mixture": {1: 0.5, 2: 0.5}}
    cfgs = phase_configs("B", "tiny", command_overrides(["--sampling.G", "6"], str(f), "B"))
    assert cfgs["B"].optim.lr == 1e-3 and cfgs["A"].optim.lr == 1e-3 and cfgs["A"].phase.steps == 5
    assert cfgs["B"].sampling.G == 6 and cfgs["B"].phase.mixture == {1: 0.5, 2: 0.5}


@pytest.mark.parametrize("name,text,match", [
    ("bad.json", '{"optim": {"lr": 1,}}', "line 1: Expecting property name"),
    ("bad.yaml", "optim:\n  lr: [1\nA: 2\n", "line 3:"),
    ("k.json", '{"optim": {"lrr": 1}}', "unknown config key --optim.lrr"),
    ("p.json", '{"D": {"optim": {"lr": 1}}}', "unknown section 'D'"),
    ("t.json", '{"optim": {"lr": true}}', "optim.lr=True: expected a number"),
    ("s.json", '{"optim": {"lr": "x"}}', "--optim.lr 'x': expected a number"),
    ("n.json", '{"phase": {"name": "A"}}', "run it with --phase A"),
    ("l.json", "[1]", "not a mapping of sections"),
    ("missing.json", None, "cannot read it"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, name, text, match):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    f = tmp_path / name
    if text is not None:
        f.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        read_config_file(str(f), "B")
    assert str(f) in str(err.value) and "\n" not in str(err.value)


def test_the_cli_reads_the_file_and_refuses_a_later_phase(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"C": {"optim": {"lr": 0.001}}}))
    rc, _, err = run_main(tmp_path / "run", "--phase", "B", "--config", str(f))
    assert rc == 2 and "phase C comes after the requested phase B" in err and len(err.strip().splitlines()) == 1
    f.write_text("{")
    rc, _, err = run_main(tmp_path / "run", "--phase", "B", "--config", str(f))
    assert rc == 2 and err.startswith(f"error: --config {f}: line 1:") and len(err.strip().splitlines()) == 1
