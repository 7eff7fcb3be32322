"""The shipped pretrained model and the command that builds it.

Protects: every load of 'tiny' checks the manifest (a missing, truncated, altered or foreign
file is one line saying how to get a good copy, never a model that means something else);
the pretraining command exports an ordinary save_pretrained directory that loads as a
pretrained model, rebuilds byte for byte, and refuses to resume a run with other settings
without touching its output; the main command starts phase A from the shipped base; and
the random-reward control draws whole rows of its own batch.
"""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import log_lines, run_main

from grpo.config_checks import trains_from_scratch
from grpo.errors import ConfigError
from grpo.model import shipped
from grpo.model.load import ModelLoadError, load_bundle
from grpo.rewards import RewardBatch

ROOT = Path(__file__).resolve().parent.parent
# a pretraining run at smoke size: 2 caption + 2 reasoning steps of 4 examples, 2 test prompts per stage
SMOKE = ["--warmup.phase.steps", "2", "--warmup.phase.perception_steps", "2", "--warmup.phase.prompts_per_step", "4",
         "--run.train_per_stage", "20", "--run.eval_size", "4", "--test-per-stage", "2"]


def test_the_shipped_model_is_intact_and_pretrained():
    path = shipped.verify()
    names = shipped.read_manifest(path)
    assert set(shipped.REQUIRED) <= set(names) and not set(shipped.NOT_MODEL_FILES) & set(names)
    assert (path / "MODEL_CARD.md").is_file() and (path / "pretrain.json").is_file()
    assert not trains_from_scratch("tiny") and trains_from_scratch("tiny-random")
    assert sum(f.stat().st_size for f in path.iterdir()) < 16 * 2**20  # the repository's one binary stays small
    bundle = load_bundle("tiny")
    assert bundle.source == "tiny" and Path(bundle.tokenizer.name_or_path).resolve() == path.resolve()
    # tiny-random, what a rebuild starts from, has the shipped architecture
    from grpo.model.tiny import TINY_TEXT, TINY_VISION

    config = json.loads((path / "config.json").read_text())
    assert {k: config["vision_config"][k] for k in TINY_VISION} == TINY_VISION
    assert {k: config["text_config"][k] for k in TINY_TEXT} == TINY_TEXT


@pytest.fixture
def copy(tmp_path, monkeypatch):
    """A copy of the shipped directory that 'tiny' resolves to for this test."""
    dst = tmp_path / "tiny_model"
    shutil.copytree(shipped.SHIPPED_DIR, dst)
    monkeypatch.setattr(shipped, "SHIPPED_DIR", dst)
    return dst


def _other_build_tokenizer(tmp_path: Path) -> bytes:
    """tokenizer.json of the random build of another seed (trained on another corpus)."""
    from grpo.model.tiny import build_tiny_model

    return (build_tiny_model(tmp_path / "other", seed=3) / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("damage, names", [
    ("missing", "lacks"),
    ("truncated", "damaged or from another build"),
    ("flipped", "damaged or from another build"),
    ("foreign_tokenizer", "damaged or from another build"),
    ("no_manifest", "has no SHA256SUMS"),
])
def test_a_damaged_shipped_model_is_one_line_naming_the_file_and_the_fix(copy, tmp_path, damage, names):
    target = copy / ("tokenizer.json" if damage == "foreign_tokenizer" else "model.safetensors")
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    if damage == "missing":
        target.unlink()
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:1000])
    elif damage == "flipped":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "foreign_tokenizer":
        foreign = _other_build_tokenizer(tmp_path)
        assert foreign != target.read_bytes()
        target.write_bytes(foreign)
    else:
        (copy / shipped.MANIFEST).unlink()
    with pytest.raises(ModelLoadError) as err:
        load_bundle("tiny")
    msg = str(err.value)
    assert names in msg and "\n" not in msg and "python -m grpo.pretrain" in msg
    if damage != "no_manifest":
        assert target.name in msg
    # the trainer says the same in one line, exit 2, and writes nothing into the damaged directory
    rc, out, errtext = run_main(tmp_path / "run", "--phase", "A", "--phase.steps", "1")
    assert rc == 2 and errtext.startswith("error: ") and len(errtext.strip().splitlines()) == 1, errtext
    assert {p.name for p in copy.iterdir()} <= set(before)


def _pretrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo.pretrain", *args], cwd=ROOT, capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def test_pretrain_exports_a_pretrained_model_and_rebuilds_it_byte_for_byte(tmp_path):
    outs = []
    for k in range(2):  # two fresh builds, same settings
        out, run = tmp_path / f"model{k}", tmp_path / f"run{k}"
        proc = _pretrain("--out", str(out), "--run-dir", str(run), *SMOKE)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"pretrain: model written to {out}" in proc.stdout
        outs.append(shipped.read_manifest(shipped.verify(out)))
    assert outs[0] == outs[1]  # every model file, weights included, byte for byte
    card = (tmp_path / "model0" / "MODEL_CARD.md").read_text()
    assert "python -m grpo.pretrain" in card and "blind gap" in card and outs[0]["model.safetensors"] in card
    # the card states the sizes of the model it describes, read from that model's config
    from grpo.model.tiny import TINY_TEXT, TINY_VISION

    assert (f"vision: {TINY_VISION['depth']} blocks, d = {TINY_VISION['hidden_size']}, "
            f"MLP {TINY_VISION['intermediate_size']};") in " ".join(card.split())
    assert f"text: {TINY_TEXT['num_hidden_layers']} layers, d = {TINY_TEXT['hidden_size']}" in " ".join(card.split())
    assert "112 px images -> 16 visual tokens" in " ".join(card.split())
    # an ordinary save_pretrained directory of a pretrained model: loads by path, no random-build stamp
    out = tmp_path / "model0"
    assert not trains_from_scratch(str(out)) and not (out / "vlgrpo_build.json").exists()
    bundle = load_bundle(str(out))
    ckpt_run = tmp_path / "run0"
    from grpo.state.checkpoint import load_checkpoint
    from grpo.state.registry import resolve

    saved = load_checkpoint(resolve(ckpt_run, "warmup:latest")).tensors
    for name, value in bundle.model.state_dict().items():
        assert torch.equal(value, saved["base." + name]), name

    # resumed with another schedule: one line, exit 2, the exported model untouched
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    proc = _pretrain("--out", str(out), "--run-dir", str(ckpt_run), *SMOKE, "--warmup.optim.lr", "1e-3")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == digest


def test_a_base_pretrained_at_another_image_size_is_scored_and_exported_at_it(tmp_path):
    """--model.image_size / --model.max_pixels (a candidate base that sees more visual tokens): the
    export's test figures are drawn at that size and its processor keeps the pixel cap, so the
    model directory reads images as its training did (the shipped processor caps at 112 x 112)."""
    out = tmp_path / "model"
    proc = _pretrain("--out", str(out), "--run-dir", str(tmp_path / "run"), *SMOKE,
                     "--model.image_size", "56", "--model.max_pixels", str(56 * 56))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "greedy, 56 px, with shuffled images" in proc.stdout
    assert load_bundle(str(out)).pixel_bounds[1] == 56 * 56
    assert "56 px images -> 4 visual tokens" in " ".join((out / "MODEL_CARD.md").read_text().split())
    assert load_bundle("tiny").pixel_bounds[1] == 112 * 112


def test_the_main_command_starts_phase_A_from_the_shipped_base(tmp_path):
    run = tmp_path / "run"
    rc, out, err = run_main(run, "--phase", "B", "--model.device", "cpu", "--run.train_per_stage", "20",
                            "--run.eval_size", "4", "--sampling.G", "2", "--sampling.max_new_tokens", "8",
                            "--phase.prompts_per_step", "2", "--phase.steps", "1", "--A.phase.steps", "1",
                            "--A.phase.prompts_per_step", "2", "--run.test_per_stage", "2")
    assert rc == 0, err
    assert "running A -> B" in out and "phase A: starting from base" in out
    assert not (run / "warmup").exists() and not any(r.get("phase") == "warmup" for r in log_lines(run))
    assert "[test] base " in out  # the report's first row is the model RL started from


def test_random_reward_draws_whole_rows_of_its_own_batch():
    total = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    comps = {"correctness": total / 10, "format": total + 100}
    rb = RewardBatch(total=total, components=comps, weights={"correctness": 1.0, "format": 1.0})
    drawn = rb.random_draw(torch.Generator().manual_seed(0))
    again = rb.random_draw(torch.Generator().manual_seed(0))
    assert torch.equal(drawn.total, again.total)  # the draw is the generator's: a resume repeats it
    idx = drawn.total.long()  # each drawn total names the row it came from
    assert torch.equal(drawn.components["correctness"], comps["correctness"][idx])
    assert torch.equal(drawn.components["format"], comps["format"][idx])
    assert not torch.equal(drawn.total, total)  # (this seed's draw is not the identity)


@pytest.mark.parametrize("extra, message", [
    ({"sampling.dynamic_sampling": "true"}, "rewards.random_reward with sampling.dynamic_sampling"),
    ({"rewards.rubric_mode": "prefix", "rewards.weights": "rubric=1.0,correctness=1.0"},
     "rewards.random_reward with rewards.rubric_mode prefix"),
])
def test_random_reward_refuses_what_it_cannot_control(extra, message):
    from grpo.cli import phase_config

    with pytest.raises(ConfigError, match=message):
        phase_config("A", "tiny", {"rewards.random_reward": "true", **extra}, "A")
