"""No silent preset: a real Qwen2.5-VL named by --model.name without --preset trains with the
preset made for it (qwen7b for the 7B, said on one line) or is refused in one line; an explicit
--preset always wins. The choice reads at most a local config.json, so these run offline:
fixture directories hold only a config.json, and the CLI is stopped at its first check
(preflight), before anything is loaded or downloaded; --model.device cpu, since the qwen7b
preset asks for CUDA and this machine has none."""

from __future__ import annotations

import json

import pytest
from train_helpers import run_main

import grpo.cli
from grpo.errors import ConfigError
from grpo.model.shipped import SHIPPED_DIR
from grpo.presets import preset_for_model

HUB_7B = "Qwen/Qwen2.5-VL-7B-Instruct"


def model_dir(tmp_path, hidden_size, model_type="qwen2_5_vl", nested=True):
    """A directory with only a config.json: transformers 5 nests hidden_size in text_config,
    the hub's released configs carry it at the top level."""
    d = tmp_path / f"model_{hidden_size}_{model_type}"
    d.mkdir()
    cfg = {"model_type": model_type, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    cfg |= {"text_config": {"hidden_size": hidden_size}} if nested else {"hidden_size": hidden_size}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("nested", [True, False])
def test_the_7b_by_hub_id_or_local_directory_chooses_qwen7b(tmp_path, nested):
    for name in (HUB_7B, "qwen/qwen2.5-vl-7b-instruct-awq", model_dir(tmp_path, 3584, nested=nested)):
        preset, line = preset_for_model(name)
        assert preset == "qwen7b" and f"--model.name {name} is Qwen2.5-VL-7B: using --preset qwen7b" in line


def test_tiny_models_and_others_keep_the_default(tmp_path):
    for name in ("tiny", "tiny-random", str(SHIPPED_DIR), model_dir(tmp_path, 128),
                 model_dir(tmp_path, 3584, model_type="llava"), "/no/such/dir", str(tmp_path)):
        assert preset_for_model(name) is None, name


@pytest.mark.parametrize("size, hidden", [("3B", 2048), ("32B", 5120), ("72B", 8192)])
def test_other_qwen_sizes_are_refused_in_one_line(tmp_path, size, hidden):
    for name in (f"Qwen/Qwen2.5-VL-{size}-Instruct", model_dir(tmp_path, hidden)):
        with pytest.raises(ConfigError, match=rf"--model.name .* is a Qwen2.5-VL of {size}, and no preset is made "
                                              r"for it \(presets: tiny, qwen7b; .*pass --preset qwen7b"):
            preset_for_model(name)
    with pytest.raises(ConfigError, match="no preset is made for this model .* pass --preset explicitly"):
        preset_for_model("someone/some-vlm")


@pytest.fixture
def first_check(monkeypatch):
    """main() up to preflight, the first step that reads a model: the configs it would run."""
    seen = {}

    def stop(configs, plan, files):
        seen.update(configs)
        raise ConfigError("stopped before loading anything")

    monkeypatch.setattr(grpo.cli, "preflight", stop)
    return seen


@pytest.mark.parametrize("name", ["hub", "dir"])
def test_the_cli_trains_the_7b_with_its_preset_and_says_so(tmp_path, first_check, name):
    model = HUB_7B if name == "hub" else model_dir(tmp_path, 3584)
    rc, out, err = run_main(tmp_path / "run", "--phase", "A", "--model.name", model, "--model.device", "cpu")
    assert rc == 2 and "stopped before loading anything" in err
    lines = [x for x in out.splitlines() if "--preset" in x]
    assert lines == [f"--model.name {model} is Qwen2.5-VL-7B: using --preset qwen7b (its dtype, 4-bit, image bounds, "
                     f"G, lr and budgets); --preset tiny or another --preset overrides this"]
    m = first_check["A"].model
    assert (m.name, m.dtype, m.image_size, m.max_pixels, first_check["A"].optim.lr) == (model, "bfloat16", 448, 448**2, 1e-5)


def test_an_explicit_preset_wins(tmp_path, first_check):
    rc, out, err = run_main(tmp_path / "run", "--phase", "A", "--preset", "tiny", "--model.name", HUB_7B)
    assert rc == 2 and "--preset" not in out
    assert (first_check["A"].model.dtype, first_check["A"].model.image_size) == ("float32", 112)
    first_check.clear()
    # refused without --preset, trained as asked with it
    rc, out, err = run_main(tmp_path / "run", "--phase", "A", "--preset", "qwen7b", "--model.name",
                            "Qwen/Qwen2.5-VL-72B-Instruct", "--model.device", "cpu")
    assert rc == 2 and first_check["A"].model.dtype == "bfloat16"


def test_the_cli_refuses_a_size_without_a_preset_in_one_line(tmp_path, first_check):
    rc, out, err = run_main(tmp_path / "run", "--phase", "A", "--model.name", "Qwen/Qwen2.5-VL-3B-Instruct")
    assert rc == 2 and not first_check and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --model.name Qwen/Qwen2.5-VL-3B-Instruct is a Qwen2.5-VL of 3B")


def test_the_default_tiny_run_prints_no_preset_line(tmp_path, first_check):
    rc, out, err = run_main(tmp_path / "run", "--phase", "A")
    assert rc == 2 and "--preset" not in out and first_check["A"].model.load_in_4bit
