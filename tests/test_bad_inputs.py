"""Bad inputs, as a hostile user would try them: each is one clear line.

One table per entry point. A CLI case asserts the exit code (2: the request is wrong,
1: the run failed) and the one line on stderr; a library case (adapters, checkpoints)
asserts the error type and its one-line message, which names the file and the problem.

Every CLI case must be caught while the request is checked, before a model is loaded:
`no_model_work` makes loading one fail the test. That keeps the file fast (main() runs
in-process, no subprocess per case) and proves the validation really comes first.

The end of the file: inputs that are rightly accepted, and a disk that fills up during a
checkpoint write (a real tmpfs where the machine allows mounting one, else a write that
fails on purpose), which must leave the previous checkpoint intact and loadable.
"""

import contextlib
import errno
import io
import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from train_helpers import run_main

import grpo.state.durable as durable
from grpo.overrides import parse_override_args
from grpo.state.checkpoint import load_checkpoint, save_checkpoint
from grpo.state.layout import ADAPTER_FILE, CheckpointError
from grpo.state.registry import read_registry
from lora import LoRAConfig, inject_lora, load_adapter, save_adapter

OVERRIDES = ["--model.device", "cpu", "--sampling.G", "2", "--sampling.max_new_tokens", "8",
             "--run.train_per_stage", "20", "--run.eval_size", "4", "--phase.prompts_per_step", "2"]
BASE = ["--phase", "A", "--init", "base", *OVERRIDES]


@pytest.fixture(autouse=True)
def no_model_work(monkeypatch, request):
    """Loading a model means a case got past validation: fail it (except where a test trains)."""
    if request.node.get_closest_marker("trains"):
        return

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded: this bad input was not caught by validation")

    monkeypatch.setattr("grpo.model.load.load_bundle", refuse)


def assert_one_line(rc: int, err: str, code: int, message: str) -> None:
    assert "Traceback" not in err, err
    assert rc == code, err
    assert err.startswith("error: "), err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err, err


# ----------------------------------------------------------------------------- fixtures: data, checkpoints


def png_bytes(size=(56, 56)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(side: int = 30000) -> bytes:
    """A 60-byte PNG that claims side x side pixels (far past PIL's decompression-bomb limit)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Three valid stage-1 examples as a JSONL dataset (data.jsonl + images/)."""
    from data.jsonl import save_jsonl
    from data.synthetic import generate

    root = tmp_path_factory.mktemp("dataset") / "data"
    save_jsonl(generate("train", 1, 3, seed=0), root)
    return root


def copy_data(dataset: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "data"
    shutil.copytree(dataset, dst)
    return dst


def rows_of(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]


def write_rows(root: Path, rows: list) -> None:
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def edit_rows(edit):
    """A case builder: a copy of the dataset with every row passed through `edit`."""
    def build(tmp_path, dataset):
        root = copy_data(dataset, tmp_path)
        rows = rows_of(root)
        for r in rows:
            edit(r)  # in place
        write_rows(root, rows)
        return ["--run.data", str(root)]
    return build


def write_images(content: bytes):
    def build(tmp_path, dataset):
        root = copy_data(dataset, tmp_path)
        for p in (root / "images").iterdir():
            p.write_bytes(content)
        return ["--run.data", str(root)]
    return build


def raw_file(text: bytes):
    def build(tmp_path, dataset):
        root = copy_data(dataset, tmp_path)
        (root / "data.jsonl").write_bytes(text)
        return ["--run.data", str(root)]
    return build


def cli_config(*args: str):
    """The phase-A config main() resolves from BASE + args (so a fake checkpoint matches it)."""
    from grpo.cli import phase_configs

    return phase_configs("A", "tiny", parse_override_args(OVERRIDES + list(args)), "base")["A"]


def fake_checkpoint(run: Path, phase: str, step: int, cfg, extra=None) -> Path:
    """A small but real checkpoint (no model needed): what the registry and loaders see."""
    return save_checkpoint(run, phase, step, tensors={"layer.lora_A": torch.ones(2, 3)}, optimizer=None,
                           scheduler_state={"step": step}, controller_state={}, data_position=0, metrics={},
                           scores={"structure": 0.5}, config_json=cfg.to_json(), extra=extra)


def with_checkpoint(edit=None, cfg_args=(), run_args=()):
    """A run directory holding A step 1 (made under BASE + cfg_args), then `edit(run)`."""
    def build(tmp_path, dataset):
        run = tmp_path / "run"
        fake_checkpoint(run, "A", 1, cli_config(*cfg_args))
        if edit is not None:
            edit(run)
        return list(run_args)
    return build


def edit_registry(fn):
    def edit(run):
        path = run / "A" / "registry.json"
        reg = json.loads(path.read_text())
        fn(reg)  # in place
        path.write_text(json.dumps(reg))
    return edit


def flip_last_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-4] ^= 0x01
    path.write_bytes(bytes(data))


def victim_registry(reg):
    reg["checkpoints"].append({"step": 2, "dir": "../../victim", "scores": {}})
    reg["aliases"]["latest"] = 2


# ----------------------------------------------------------------------------- grpo.train: options (exit 2)

OPTION_CASES = [
    # non-finite numbers: one NaN step, then a saved all-NaN adapter, before this
    (["--optim.lr", "inf"], "optim.lr=inf: must be a finite number"),
    (["--optim.lr", "nan"], "optim.lr=nan: must be a finite number"),
    (["--optim.lr", "1e400"], "optim.lr=inf: must be a finite number"),
    (["--optim.lr", "-1"], "optim.lr=-1.0: must be > 0"),
    (["--optim.lr", "0"], "optim.lr=0.0: must be > 0"),
    (["--optim.lr", "fast"], "--optim.lr 'fast': expected a number"),
    (["--sampling.temperature", "inf"], "sampling.temperature=inf: must be a finite number"),
    (["--sampling.temperature", "0"], "sampling.temperature=0.0: must be > 0"),
    (["--sampling.top_p", "nan"], "sampling.top_p=nan: must be a finite number"),
    (["--sampling.top_p", "1.5"], "sampling.top_p=1.5: must be in (0, 1]"),
    (["--optim.grad_clip", "-1"], "optim.grad_clip=-1.0: must be >= 0 (0 = off)"),
    (["--optim.grad_clip", "inf"], "optim.grad_clip=inf: must be a finite number"),
    (["--optim.beta", "nan"], "optim.beta=nan: must be a finite number"),
    (["--optim.beta", "-0.1"], "optim.beta=-0.1: must be >= 0"),
    (["--optim.eps_low", "1"], "optim.eps_low=1.0: must be in [0, 1)"),
    (["--optim.eps_high", "-0.2"], "optim.eps_high=-0.2: must be >= 0"),
    (["--optim.weight_decay", "-0.1"], "optim.weight_decay=-0.1: must be >= 0"),
    (["--optim.vision_lr_scale", "nan"], "optim.vision_lr_scale=nan: must be a finite number"),
    (["--optim.warmup_steps", "-1"], "optim.warmup_steps=-1: must be >= 0"),
    (["--optim.accumulation", "0"], "optim.accumulation=0: must be >= 1"),
    (["--optim.schedule", "cosine2"], "optim.schedule='cosine2': use constant, linear or cosine"),
    (["--optim.adv_scale", "rank"], "optim.adv_scale='rank': use group, batch or none"),
    (["--optim.importance", "token2"], "optim.importance='token2': use token or sequence"),
    (["--optim.loss_type", "ppo"], "optim.loss_type='ppo': use grpo, bnpo, dr_grpo or dapo"),
    # rewards
    (["--rewards.weights", "format=0,correctness=0"], "every weight is 0, so every reward and advantage is 0"),
    (["--rewards.weights", "nosuch=1"], "rewards.weights names unknown component 'nosuch'"),
    (["--rewards.weights", "format=-1"], "rewards.weights['format']=-1.0: weights must be >= 0"),
    (["--rewards.weights", "format=inf"], "rewards.weights={'format': inf}: must be finite (not inf or nan)"),
    (["--rewards.weights", "format"], "--rewards.weights 'format': expected name=value,name=value"),
    (["--rewards.weights", "tolerance=1"], "but rewards.tolerance is false, so the component is always 0"),
    (["--rewards.rubric_mode", "token"], "rewards.rubric_mode='token': use sequence or prefix"),
    (["--rewards.prefix_answer_weight", "2"], "rewards.prefix_answer_weight=2.0: must be in [0, 1]"),
    (["--rewards.prefix_answer_weight", "nan"], "rewards.prefix_answer_weight=nan: must be a finite number"),
    # LoRA and model
    (["--lora.alpha", "0"], "lora.alpha=0.0: must be > 0"),
    (["--lora.alpha", "inf"], "lora.alpha=inf: must be a finite number"),
    (["--lora.dropout", "2"], "lora.dropout=2.0: must be in [0, 1)"),
    (["--lora.dropout", "-0.1"], "lora.dropout=-0.1: must be in [0, 1)"),
    (["--lora.rank", "0"], "lora.rank=0: must be >= 1"),
    (["--lora.rank", "2.5"], "--lora.rank '2.5': expected an integer"),
    (["--lora.targets", "nosuch_proj"], "--lora.targets nosuch_proj: target pattern 'nosuch_proj' matches no linear"),
    (["--lora.targets", "q_proj,visual.merger"], "target pattern 'visual.merger' matches no linear layer outside"),
    (["--lora.targets", ","], "lora.targets='': name at least one module suffix"),
    (["--lora.dtype", "int8"], "lora.dtype='int8': use float32 or bfloat16"),
    (["--model.dtype", "float64"], "model.dtype='float64': use float32 or bfloat16"),
    (["--model.device", "tpu"], "model.device='tpu': use auto, cpu, cuda or cuda:N"),
    (["--model.device", "cuda:x"], "model.device='cuda:x': use auto, cpu, cuda or cuda:N"),
    pytest.param(["--model.device", "cuda"], "--model.device cuda: no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    (["--model.name", "/no/such/dir"], "model path '/no/such/dir' does not exist"),
    (["--model.name", ""], "model.name is empty"),
    (["--model.image_size", "10"], "model.image_size=10: must be >= 28"),
    # bounds on what enters the model
    (["--model.max_pixels", "100"], "model.max_pixels=100: must be >= 784 (one 28x28 visual token), or 0"),
    (["--model.max_pixels", "-1"], "model.max_pixels=-1, model.min_pixels=0: must be >= 0 (0 = the processor's own)"),
    (["--model.min_pixels", "-3136"], "model.max_pixels=0, model.min_pixels=-3136: must be >= 0"),
    (["--model.max_pixels", "3136", "--model.min_pixels", "12544"],
     "model.min_pixels=12544 > model.max_pixels=3136: the smallest area must not exceed the largest"),
    (["--model.max_pixels", "448*448"], "--model.max_pixels '448*448': expected an integer"),
    (["--model.max_prompt_tokens", "-1"], "model.max_prompt_tokens=-1: must be >= 0 (0 = no cap)"),
    # groups and sampling: G = 1 trained nothing and exited 0
    (["--sampling.G", "1"], "sampling.G=1: GRPO phase A needs a group of >= 2 completions per prompt"),
    (["--sampling.G", "0"], "sampling.G=0: GRPO phase A needs a group of >= 2"),
    (["--sampling.G", "-3"], "sampling.G=-3: GRPO phase A needs a group of >= 2"),
    (["--sampling.G", "three"], "--sampling.G 'three': expected an integer"),
    (["--sampling.max_new_tokens", "0"], "sampling.max_new_tokens=0: must be >= 1"),
    (["--sampling.top_k", "-1"], "sampling.top_k=-1: must be >= 0"),
    (["--sampling.rollout", "fast"], "sampling.rollout='fast': use plain or merged"),
    (["--optim.rollout_correction", "row"], "optim.rollout_correction='row': use "),
    (["--optim.rollout_correction_mode", "clip"], "optim.rollout_correction_mode='clip': use "),
    (["--optim.rollout_correction_cap", "1"], "optim.rollout_correction_cap=1.0: must be > 1"),
    (["--optim.rollout_correction_cap", "inf"], "optim.rollout_correction_cap=inf: must be a finite number"),
    # phase
    (["--phase.steps", "-1"], "phase.steps=-1: must be >= 0"),
    (["--phase.prompts_per_step", "0"], "phase.prompts_per_step=0: must be >= 1"),
    (["--phase.mixture", "4=1"], "phase.mixture={4: 1.0}: stages are 1, 2 and 3"),
    (["--phase.mixture", "1=-1"], "phase.mixture={1: -1.0}: needs at least one stage with positive probability"),
    (["--phase.mixture", "1=0"], "needs at least one stage with positive probability"),
    (["--phase.mixture", "1=inf"], "phase.mixture={1: inf}: must be finite"),
    (["--phase.mixture", "1=nan"], "phase.mixture={1: nan}: must be finite"),
    (["--phase.mixture", "x=1"], "--phase.mixture 'x=1': expected name=value,name=value"),
    (["--phase.controller", "maybe"], "--phase.controller 'maybe': expected true or false"),
    # run cadence and bookkeeping: log_every 0 was a ZeroDivisionError
    (["--run.seed", "-1"], "run.seed=-1: must be in [0, 2**32)"),
    (["--run.seed", "4294967296"], "run.seed=4294967296: must be in [0, 2**32)"),
    (["--run.log_every", "0"], "run.log_every=0: must be >= 1"),
    (["--run.eval_every", "0"], "run.eval_every=0: must be >= 1"),
    (["--run.eval_size", "0"], "run.eval_size=0: must be >= 1"),
    (["--run.train_per_stage", "0"], "run.train_per_stage=0: must be >= 1"),
    (["--run.test_per_stage", "-1"], "run.test_per_stage=-1: must be >= 0"),
    (["--run.cpu_threads", "-1"], "run.cpu_threads=-1: must be >= 0"),
    (["--run.run_dir", ""], "run.run_dir is empty"),
    (["--run.data", ""], "run.data is empty"),
    # keys, prefixes, starts
    (["--sampling.Gx", "3"], "unknown config key --sampling.Gx"),
    (["--D.steps", "3"], "unknown config key --D.steps"),
    (["--C.phase.steps", "3"], "--C.phase.steps: phase C comes after the requested phase A and does not run"),
    (["--phase", "B", "--A.optim.lr", "inf"], "optim.lr=inf: must be a finite number"),  # A's config, checked now
    (["--warmup.optim.lr", "nan"], "optim.lr=nan: must be a finite number"),
    (["--G"], "--G needs a value"),
    (["stray"], "unexpected argument 'stray'"),
    (["--init", ""], "phase.init is empty"),
    (["--init", "A:best_nothing"], "checkpoint selector 'A:best_nothing' names nothing"),
    (["--init", "/no/such/checkpoint"], "checkpoint selector '/no/such/checkpoint' is neither PHASE[:ALIAS]"),
]


@pytest.mark.parametrize("args, message", OPTION_CASES)
def test_bad_options(tmp_path, args, message):
    rc, out, err = run_main(tmp_path / "run", *BASE, *args)
    assert_one_line(rc, err, 2, message)
    assert not (tmp_path / "run" / "A").exists()


# ----------------------------------------------------------------------------- grpo.train: datasets (exit 2)


def no_data_jsonl(tmp_path, dataset):
    root = copy_data(dataset, tmp_path)
    (root / "data.jsonl").unlink()
    return ["--run.data", str(root)]


def data_jsonl_is_a_dir(tmp_path, dataset):
    root = copy_data(dataset, tmp_path)
    (root / "data.jsonl").unlink()
    (root / "data.jsonl").mkdir()
    return ["--run.data", str(root)]


def delete_images(tmp_path, dataset):
    root = copy_data(dataset, tmp_path)
    shutil.rmtree(root / "images")
    return ["--run.data", str(root)]


def stage_3_missing(tmp_path, dataset):
    return ["--run.data", str(copy_data(dataset, tmp_path)), "--phase.mixture", "1=0.5,3=0.5"]


def bad_rubrics(row):
    row["rubrics"] = [{"text": "x"}]


DATA_CASES = [
    (lambda t, d: ["--run.data", str(t / "nowhere")], "--run.data: no data.jsonl in"),
    (no_data_jsonl, "--run.data: no data.jsonl in"),
    (data_jsonl_is_a_dir, "--run.data: no data.jsonl in"),
    (raw_file(b""), "has no usable rows (data.jsonl is empty)"),
    (raw_file(b"\n  \n\n"), "has no usable rows (data.jsonl is empty)"),
    (raw_file(b"{not json\n{\"pid\": \n[1, 2\n"), "has no usable rows: 3 skipped (bad_json 3)"),
    (raw_file(b"[1, 2]\n\"a string\"\n"), "has no usable rows: 2 skipped (bad_json 2)"),
    (raw_file("{\"pid\": \"\xe9\"}\n".encode("latin-1")), "data.jsonl is not UTF-8 text (byte 9: invalid"),
    (edit_rows(lambda r: r.pop("pid")), "has no usable rows: 3 skipped (bad_row 3)"),
    (edit_rows(lambda r: r.pop("question")), "has no usable rows: 3 skipped (bad_row 3)"),
    (edit_rows(lambda r: r.pop("answer")), "has no usable rows: 3 skipped (bad_row 3)"),
    (edit_rows(bad_rubrics), "has no usable rows: 3 skipped (bad_row 3)"),
    (edit_rows(lambda r: r.update(answer="")), "3 of 3 examples have an empty gold answer"),
    (edit_rows(lambda r: r.update(answer="  ")), "3 of 3 examples have an empty gold answer"),
    (edit_rows(lambda r: r.update(answer="seven")), "has no usable rows: 3 skipped (non_numeric_answer 3)"),
    (edit_rows(lambda r: r.update(answer="seven", answer_type="text")), "3 kept and none has a numeric gold answer"),
    (edit_rows(lambda r: r.update(answer_type="fraction")), "3 skipped (unknown_answer_type 3)"),
    (edit_rows(lambda r: r.update(metadata=dict(r["metadata"], language="klingon"))),
     "3 skipped (unknown_language 3)"),
    (edit_rows(lambda r: r.update(image="images/none.png")), "3 skipped (missing_image 3)"),
    (delete_images, "3 skipped (missing_image 3)"),
    (write_images(png_bytes()[:40]), "3 skipped (corrupt_image 3)"),
    (write_images(b"this is a text file, not an image\n"), "3 skipped (corrupt_image 3)"),
    (write_images(bomb_png()), "3 skipped (image_too_large 3)"),
    (write_images(png_bytes((402, 2))), "3 skipped (image_aspect 3)"),  # 201:1, Qwen2-VL's resize refuses it
    (stage_3_missing, "stage 3 has no training examples"),
]


@pytest.mark.parametrize("build, message", DATA_CASES)
def test_bad_datasets(tmp_path, dataset, build, message):
    rc, out, err = run_main(tmp_path / "run", *BASE, *build(tmp_path, dataset))
    assert_one_line(rc, err, 2, message)
    assert not (tmp_path / "run" / "A").exists()


# ----------------------------------------------------------------------------- grpo.train: run directories


def run_dir_is_a_file(tmp_path, dataset):
    (tmp_path / "run").write_text("not a directory")
    return []


def run_dir_under_a_file(tmp_path, dataset):
    (tmp_path / "file").write_text("x")
    return ["--run.run_dir", str(tmp_path / "file" / "run")]


def init_from_damaged(tmp_path, dataset):
    other = tmp_path / "other"
    path = fake_checkpoint(other, "A", 1, cli_config())
    flip_last_bytes(path / "adapter.safetensors")
    return ["--init", str(path)]


def init_from_other_rank(tmp_path, dataset):
    path = fake_checkpoint(tmp_path / "other", "A", 1, cli_config("--lora.rank", "4"))
    return ["--init", str(path)]


def extra_base_absolute(run):
    path = run / "A" / "step_000001" / "state.json"
    state = json.loads(path.read_text())
    state["extra"]["base"] = "/etc"
    path.write_text(json.dumps(state))
    edit_registry(lambda r: r["checkpoints"][0].pop("state_sha256"))(run)


RUN_DIR_CASES = [
    (run_dir_is_a_file, 2, "is a file, not a directory"),
    (run_dir_under_a_file, 2, "a part of that path is a file"),
    (with_checkpoint(cfg_args=("--lora.rank", "4")), 2, "made with a different model/LoRA config: lora.rank: saved 4, now 8"),
    (with_checkpoint(cfg_args=("--lora.targets", "q_proj")), 2, "lora.targets: saved ['q_proj'], now"),
    (with_checkpoint(cfg_args=("--sampling.G", "3")), 2,
     "holds phase A up to step 1; resuming it with sampling.G: saved 3, now 2"),
    (with_checkpoint(cfg_args=("--sampling.max_new_tokens", "16")), 2, "sampling.max_new_tokens: saved 16, now 8"),
    (with_checkpoint(cfg_args=("--phase.prompts_per_step", "4")), 2, "phase.prompts_per_step: saved 4, now 2"),
    (with_checkpoint(cfg_args=("--run.seed", "5")), 2, "run.seed: saved 5, now 0"),
    (init_from_other_rank, 2, "was made with a different model/LoRA config: lora.rank: saved 4, now 8"),
    (init_from_damaged, 1, "adapter.safetensors does not match the sha256 recorded in state.json"),
    (with_checkpoint(edit_registry(lambda r: r.clear())), 1, "registry.json lacks 'checkpoints', 'aliases'"),
    (with_checkpoint(edit_registry(lambda r: r["aliases"].update(latest="1"))), 1, "alias 'latest' points to '1'"),
    (with_checkpoint(edit_registry(victim_registry)), 1,
     "entry for step 2 has dir '../../victim'; it must be that step's own directory 'step_000002'"),
    (with_checkpoint(edit_registry(lambda r: r["checkpoints"][0].update(dir="/tmp"))), 1, "has dir '/tmp'"),
    (with_checkpoint(edit_registry(lambda r: r["checkpoints"][0].update(dir="step_000002"))), 1,
     "entry for step 1 has dir 'step_000002'"),
    (with_checkpoint(lambda run: (run / "A" / "registry.json").write_text('{"checkpoints": [')), 1,
     "registry.json is unreadable (JSONDecodeError"),
    (with_checkpoint(lambda run: (run / "A" / "registry.json").write_text("[]")), 1,
     "registry.json holds a JSON list, not an object"),
    (with_checkpoint(lambda run: (run / "A" / "step_000001" / "adapter.safetensors").unlink()), 1,
     "no intact checkpoint of phase A in"),
    (with_checkpoint(lambda run: (run / "A" / "step_000001" / "state.json").write_text('{"phase": "A", "st')), 1,
     "state.json does not match the sha256 recorded in"),
    (with_checkpoint(extra_base_absolute), 1, "extra.base='/etc' is not a checkpoint inside the run directory"),
]


@pytest.mark.parametrize("build, code, message", RUN_DIR_CASES)
def test_bad_run_directories(tmp_path, dataset, build, code, message):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    args = build(tmp_path, dataset)
    before = {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    rc, out, err = run_main(tmp_path / "run", *BASE, *args)
    assert_one_line(rc, err, code, message)
    assert (victim / "keep.txt").read_text() == "mine"
    # nothing was deleted, moved or trained: at most the (empty) run directory appeared
    after = {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert set(before) <= set(after) and set(after) - set(before) <= {Path("run")}, sorted(after)
    rewritten = [p for p, t in before.items() if (tmp_path / p).is_file() and after[p] != t]
    assert not rewritten, rewritten


def test_read_only_run_dir_simulated(tmp_path, monkeypatch):
    """What a read-only mount does to any user (root included): every create fails with EACCES."""
    run = tmp_path / "run"
    run.mkdir()
    real_open = os.open

    def read_only(path, flags, *args, **kw):
        if Path(path).resolve().is_relative_to(run.resolve()) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", read_only)
    rc, out, err = run_main(run, *BASE)  # the first file created there is the lock's (grpo/run/lock.py)
    assert_one_line(rc, err, 1, f"cannot write to the run directory {run} (Permission denied: {run}/run.lock)")
    # a lock file left by a killed run opens without O_CREAT: the write probe finds the directory read-only
    (run / "run.lock").write_text("")
    rc, out, err = run_main(run, *BASE)
    assert_one_line(rc, err, 1, f"cannot write to the run directory {run} (Permission denied: {run}/.tmp-write-probe-")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 0500 directory anyway; "
                                              "test_read_only_run_dir_simulated covers it")
def test_read_only_run_dir_for_real(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o500)
    try:
        rc, out, err = run_main(run, *BASE)
    finally:
        run.chmod(0o700)
    assert_one_line(rc, err, 1, f"cannot write to the run directory {run} (Permission denied")


# ----------------------------------------------------------------------------- python -m grpo.evaluate (exit 2 / 1)


def run_eval(*args: str) -> tuple[int, str, str]:
    from grpo.evaluation.evaluate import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def parquet_without(*columns: str):
    def build(tmp_path, dataset):
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [{"pid": str(i), "question": f"How many? {i}", "answer": "3", "answer_type": "integer",
                 "question_type": "free_form", "image": f"images/{i}.png",
                 "decoded_image": {"bytes": png_bytes(), "path": f"{i}.png"}} for i in range(3)]
        rows = [{k: v for k, v in r.items() if k not in columns} for r in rows]
        path = tmp_path / "testmini.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return ["--data", str(path)]
    return build


def not_parquet(tmp_path, dataset):
    (tmp_path / "testmini.parquet").write_bytes(b"PAR1 but not really, just text")
    return ["--data", str(tmp_path / "testmini.parquet")]


def json_of_strings(tmp_path, dataset):
    (tmp_path / "mv").mkdir()
    (tmp_path / "mv" / "testmini.json").write_text(json.dumps(["a", "b"]))
    return ["--data", str(tmp_path / "mv")]


def completions(*lines, raw: bytes | None = None):
    """Eval over the JSONL dataset with a --completions file of these lines."""
    def build(tmp_path, dataset):
        path = tmp_path / "c.jsonl"
        if raw is not None:
            path.write_bytes(raw)
        else:
            path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
        return ["--data", str(dataset), "--subset", "all", "--completions", f"mine={path}"]
    return build


def eval_with_run(edit=None):
    def build(tmp_path, dataset):
        run = tmp_path / "run"
        fake_checkpoint(run, "A", 1, cli_config())
        if edit is not None:
            edit(run)
        return ["A:latest", "--run-dir", str(run), "--data", str(dataset), "--subset", "all"]
    return build


GOOD = {"pid": "p1", "completions": ["<SOLUTION> 3 </SOLUTION>"], "token_counts": [5]}
EVAL_CASES = [
    (parquet_without("answer"), 2, "testmini.parquet lacks the MathVista column(s) answer (it has"),
    (parquet_without("question"), 2, "lacks the MathVista column(s) question"),
    (parquet_without("pid"), 2, "lacks the MathVista column(s) pid"),
    (parquet_without("answer_type", "pid"), 2, "lacks the MathVista column(s) pid, answer_type"),
    (parquet_without("image", "decoded_image"), 2, "lacks the MathVista column(s) image or decoded_image"),
    (not_parquet, 2, "testmini.parquet is not a readable parquet file"),
    (json_of_strings, 2, "testmini.json must hold {pid: record} or a list of records"),
    (lambda t, d: ["--data", str(t / "nowhere")], 2, "MathVista source"),
    (lambda t, d: ["--data", str(d), "--completions", f"x={t / 'missing.jsonl'}"], 2, "No such file or directory"),
    (lambda t, d: ["--data", str(d), "--completions", "x"], 2, "--completions 'x': write NAME=FILE.jsonl"),
    (lambda t, d: ["--data", str(d), "--completions", "=c.jsonl"], 2, "write NAME=FILE.jsonl"),
    (completions({"pid": "a", "token_counts": [1]}), 2, "c.jsonl:1: lacks completions"),
    (completions({"pid": "a", "completions": "<SOLUTION> 3 </SOLUTION>", "token_counts": [5]}), 2,
     "c.jsonl:1: completions is a string, not a list of strings"),
    (completions({"pid": "a", "completions": ["x", "y"], "token_counts": [3]}), 2,
     "c.jsonl:1: 2 completions but 1 token_counts"),
    (completions({"pid": "a", "completions": ["x"]}), 2, "c.jsonl:1: lacks token_counts"),
    (completions({"pid": "a", "completions": ["x"], "token_counts": [-1]}), 2,
     "token_counts must be a list of integers >= 0"),
    (completions({"pid": "a", "completions": ["x"], "token_counts": ["5"]}), 2,
     "token_counts must be a list of integers >= 0"),
    (completions({"pid": "a", "completions": [3], "token_counts": [1]}), 2, "completions holds a non-string"),
    (completions({"pid": "a", "completions": {"x": 1}, "token_counts": [1]}), 2, "completions is dict, not a list"),
    (completions(GOOD, ["pid", "completions"]), 2, "c.jsonl:2: a JSON list, not an object"),
    (completions(GOOD, "{broken"), 2, "c.jsonl:2: not JSON"),
    (completions({"completions": ["x"], "token_counts": [1]}), 2, "c.jsonl:1: lacks pid"),
    (completions({"pid": None, "completions": ["x"], "token_counts": [1]}), 2, "pid None is not a string or integer"),
    (completions(GOOD, GOOD), 2, "c.jsonl:2: pid 'p1' appears twice"),
    (completions(raw=b'{"pid": "\xff"}\n'), 2, "c.jsonl is not UTF-8 text"),
    (lambda t, d: ["--samples", "0"], 2, "samples_per_prompt=0: must be >= 1"),
    (lambda t, d: ["--temperature", "inf"], 2, "temperature=inf: must be a finite number >= 0"),
    (lambda t, d: ["--temperature", "nan"], 2, "temperature=nan: must be a finite number >= 0"),
    (lambda t, d: ["--top-p", "0"], 2, "top_p=0.0: must be in (0, 1]"),
    (lambda t, d: ["--batch-size", "0"], 2, "batch_size=0: must be >= 1"),
    (lambda t, d: ["--max-new-tokens", "0"], 2, "max_new_tokens=0: must be >= 1"),
    (lambda t, d: ["--samples", "2"], 2, "with greedy decoding gives identical copies"),
    (lambda t, d: ["--limit", "0"], 2, "--limit 0: must be >= 1"),
    (lambda t, d: ["--limit", "-1"], 2, "--limit -1: must be >= 1"),
    (lambda t, d: ["--device", "tpu"], 2, "--device 'tpu': use cpu, cuda or cuda:N"),
    (lambda t, d: ["--max-pixels", "100"], 2, "--max-pixels 100: must be >= 784 (one 28x28 visual token)"),
    (lambda t, d: ["--max-pixels", "3136", "--min-pixels", "12544"], 2, "and >= --min-pixels 12544"),
    (lambda t, d: ["--max-prompt-tokens", "-1"], 2, "--max-prompt-tokens -1: must be >= 0 (0 = the model's own)"),
    (lambda t, d: ["--model", "/no/such/model"], 2, "model path '/no/such/model' does not exist"),
    (lambda t, d: ["A:latest", "--data", str(d)], 2, "selector 'A:latest' needs --run-dir"),
    (lambda t, d: ["A:best_nothing", "--run-dir", str(t), "--data", str(d)], 2,
     "checkpoint selector 'A:best_nothing' names nothing"),
    (eval_with_run(edit_registry(lambda r: r["checkpoints"][0].update(dir="../x"))), 1,
     "entry for step 1 has dir '../x'"),
    (eval_with_run(lambda run: shutil.rmtree(run / "A" / "step_000001")), 1, "which is missing or incomplete"),
]


@pytest.mark.parametrize("build, code, message", EVAL_CASES)
def test_bad_eval_requests(tmp_path, dataset, build, code, message):
    rc, out, err = run_eval(*build(tmp_path, dataset), "--out", str(tmp_path / "reports"))
    assert_one_line(rc, err, code, message)
    assert not (tmp_path / "reports").exists()  # no report from a bad request


# ----------------------------------------------------------------------------- adapters (load_adapter)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    from test_lora import randomize_lora_B, tiny_model

    model = tiny_model()
    inject_lora(model, LoRAConfig(r=8, alpha=16), verbose=False)
    randomize_lora_B(model)
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    save_adapter(model, path)
    return path


def adapter_config(value, raw: bytes | None = None):
    def build(path):
        (path / "adapter_config.json").write_bytes(raw if raw is not None else json.dumps(value).encode())
    return build


def edit_config(**changes):
    def build(path):
        config = json.loads((path / "adapter_config.json").read_text())
        for k, v in changes.items():
            if v is KeyError:
                config.pop(k)
            else:
                config[k] = v
        (path / "adapter_config.json").write_text(json.dumps(config))
    return build


def edit_weights(fn):
    def build(path):
        from safetensors.torch import load_file

        tensors = load_file(path / "adapter_model.safetensors")
        fn(tensors)
        save_file(tensors, str(path / "adapter_model.safetensors"))
    return build


def first_key(tensors) -> str:
    return sorted(tensors)[0]


def fill_first(value):
    return edit_weights(lambda t: t[first_key(t)].fill_(value))


def weights_bytes(fn):
    def build(path):
        f = path / "adapter_model.safetensors"
        f.write_bytes(fn(f.read_bytes()))
    return build


def replace_with_dir(name):
    def build(path):
        (path / name).unlink()
        (path / name).mkdir()
    return build


ADAPTER_CASES = [
    (adapter_config(["r", 8]), ValueError, "adapter_config.json holds a JSON list, not an object"),
    (adapter_config("LORA"), ValueError, "adapter_config.json holds a JSON str, not an object"),
    (adapter_config(None, raw=b'{"peft_type": "LORA", "r": '), ValueError, "adapter_config.json is not valid JSON"),
    (adapter_config(None, raw=b""), ValueError, "adapter_config.json is not valid JSON"),
    (adapter_config(None, raw=b'{"peft_type": "\xff"}'), ValueError, "adapter_config.json is not valid JSON"),
    (edit_config(r=KeyError), ValueError, "adapter_config.json has no 'r'"),
    (edit_config(lora_alpha=KeyError), ValueError, "adapter_config.json has no 'lora_alpha'"),
    (edit_config(peft_type=KeyError), ValueError, "peft_type is None, only 'LORA' is supported"),
    (edit_config(r="8"), ValueError, "r='8'; the rank must be an integer >= 1"),
    (edit_config(r=0), ValueError, "r=0; the rank must be an integer >= 1"),
    (edit_config(lora_alpha=0), ValueError, "lora_alpha=0; it must be a finite number > 0"),
    (edit_config(lora_alpha=float("nan")), ValueError, "lora_alpha=nan; it must be a finite number > 0"),
    (edit_config(lora_dropout=2), ValueError, "lora_dropout=2; it must be a number in [0, 1)"),
    (edit_config(r=4), ValueError, "lora_A has shape (8, 128) but the model expects (4, 128)"),
    (edit_config(use_dora=True), ValueError, "adapter uses ['use_dora']"),
    (replace_with_dir("adapter_config.json"), FileNotFoundError, "has no adapter_config.json"),
    (lambda p: (p / "adapter_config.json").unlink(), FileNotFoundError, "has no adapter_config.json"),
    (lambda p: (p / "adapter_model.safetensors").unlink(), FileNotFoundError, "has no adapter_model.safetensors"),
    (weights_bytes(lambda b: b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"\xff" * (len(b) - 8)), ValueError,
     "adapter_model.safetensors is not a valid safetensors file"),
    (weights_bytes(lambda b: b[: len(b) // 2]), ValueError, "adapter_model.safetensors is not a valid safetensors file"),
    (fill_first(float("nan")), ValueError, "layers.0.mlp.down_proj.lora_A.weight' has 1024 non-finite values"),
    (fill_first(float("inf")), ValueError, "non-finite values (NaN/inf)"),
    (edit_weights(lambda t: t.__setitem__(first_key(t), t[first_key(t)].to(torch.int32))), ValueError,
     "has dtype torch.int32; LoRA factors are floating point"),
    (edit_weights(lambda t: t.__setitem__("base_model.model.lm_head.weight", torch.zeros(2))), ValueError,
     "unexpected key 'base_model.model.lm_head.weight'"),
]


@pytest.mark.parametrize("damage, error, message", ADAPTER_CASES)
def test_bad_adapters(tmp_path, adapter_dir, damage, error, message):
    from test_lora import tiny_model

    from lora import lora_modules

    path = tmp_path / "adapter"
    shutil.copytree(adapter_dir, path)
    damage(path)
    model = tiny_model()
    with pytest.raises(error) as e:
        load_adapter(model, path)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not lora_modules(model)  # refused before anything was injected


@pytest.mark.parametrize("where, message", [
    (lambda t: t / "nowhere", "does not exist"),
    (lambda t: t / "adapter" / "adapter_model.safetensors", "is a file; pass the adapter"),
])
def test_bad_adapter_paths(tmp_path, adapter_dir, where, message):
    from test_lora import tiny_model

    shutil.copytree(adapter_dir, tmp_path / "adapter")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_adapter(tiny_model(), where(tmp_path))


# ----------------------------------------------------------------------------- checkpoints (load_checkpoint)


def real_checkpoint(run: Path, phase: str = "A", step: int = 2) -> Path:
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.sum().backward()
    opt.step()
    from grpo.config import TrainConfig

    return save_checkpoint(run, phase, step, tensors={"m.lora_A": p.detach()}, optimizer=opt, scheduler_state={},
                           controller_state={}, data_position=0, metrics={}, scores={}, config_json=TrainConfig().to_json())


def garbage_same_size(path):
    f = path / "adapter.safetensors"
    f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00" + b"{garbage" + b"\0" * (f.stat().st_size - 16))


def swap_with_optimizer(path):
    shutil.copy(path / "optimizer.safetensors", path / "adapter.safetensors")


def state_edit(fn, keep_digest=False):
    def damage(path):
        f = path / "state.json"
        state = json.loads(f.read_text())
        state = fn(state) or state
        f.write_text(json.dumps(state))
        if not keep_digest:  # someone who also knows to remove the registry's digest
            reg_path = path.parent / "registry.json"
            reg = json.loads(reg_path.read_text())
            reg["checkpoints"][0].pop("state_sha256")
            reg_path.write_text(json.dumps(reg))
    return damage


def state_raw(data: bytes):
    def damage(path):
        state_edit(lambda s: None)(path)  # drop the registry digest first
        (path / "state.json").write_bytes(data)
    return damage


def copied_from_phase_b(path):
    other = real_checkpoint(path.parent.parent / "elsewhere", "B", 2)
    shutil.rmtree(path)
    shutil.copytree(other, path)


CHECKPOINT_CASES = [
    (garbage_same_size, "adapter.safetensors does not match the sha256 recorded in state.json"),
    (lambda p: flip_last_bytes(p / "adapter.safetensors"), "adapter.safetensors does not match the sha256"),
    (lambda p: flip_last_bytes(p / "optimizer.safetensors"), "optimizer.safetensors does not match the sha256"),
    (swap_with_optimizer, "adapter.safetensors has"),
    (lambda p: (p / "adapter.safetensors").unlink(), "adapter.safetensors is missing"),
    (replace_with_dir("adapter.safetensors"), "adapter.safetensors cannot be read (IsADirectoryError"),
    (lambda p: (p / "optimizer.json").write_text("{"), "optimizer.json has 1 bytes, expected"),
    (lambda p: flip_last_bytes(p / "state.json"), "state.json does not match the sha256 recorded in"),
    (lambda p: (p / "state.json").write_text('{"step": 2, "ph'), "state.json does not match the sha256"),
    (state_raw(b'{"step": 2, "ph'), "state.json is not valid JSON"),
    (state_raw(b"\xff\xfe"), "state.json is not valid JSON"),
    (state_edit(lambda s: s.clear()), "state.json lacks phase, step, scheduler"),
    (state_edit(lambda s: ["not", "an", "object"]), "state.json holds a JSON list, not an object"),
    (state_edit(lambda s: s.update(step=7)), "state.json is step 7 of phase A, but the registry lists it as step 2"),
    (state_edit(lambda s: s.update(format_version=99)), "state.json has format_version 99"),
    (state_edit(lambda s: s["files"].update({"adapter.safetensors": "big"})), "records file 'adapter.safetensors'"),
    (state_edit(lambda s: s.update(extra={"base": "../../x/A/step_000001"})), "extra.base='../../x/A/step_000001'"),
    (copied_from_phase_b, "state.json does not match the sha256 recorded in"),
    (lambda p: (p / "state.json").unlink(), "state.json is missing"),
]


@pytest.mark.parametrize("damage, message", CHECKPOINT_CASES)
def test_damaged_checkpoints(tmp_path, damage, message):
    path = real_checkpoint(tmp_path / "run")
    damage(path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- rightly accepted


def test_unicode_bom_and_tiny_images_are_accepted(tmp_path, dataset):
    """Not errors: a UTF-8 byte-order mark, non-ASCII questions and pids, and 1x1 images
    (the processor scales them up to one 28 px patch). Checked on the loaded training data."""
    from grpo.run.phase_data import load_training_data

    root = copy_data(dataset, tmp_path)
    rows = rows_of(root)
    for i, r in enumerate(rows):
        r["pid"], r["question"] = f"π-{i}", r["question"] + " (ça compte ✓)"
    (root / "data.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r, ensure_ascii=False)
                                                                  for r in rows).encode() + b"\n")
    for p in (root / "images").iterdir():
        p.write_bytes(png_bytes((1, 1)))
    cfg = cli_config("--run.data", str(root))
    train, val = load_training_data(cfg)
    got = train[1] + val[1]
    assert sorted(ex.pid for ex in got) == ["π-0", "π-1", "π-2"]
    assert all(ex.image.size == (1, 1) and "ça compte ✓" in ex.question for ex in got)


# ----------------------------------------------------------------------------- a full disk during a checkpoint write


@pytest.fixture()
def tmpfs(tmp_path):
    """A 2 MiB tmpfs (a real full disk), or skip where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()[:100]}); "
                    "test_disk_full_during_a_training_checkpoint simulates it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_real_full_disk_keeps_the_previous_checkpoint(tmpfs):
    run = tmpfs / "run"
    first = real_checkpoint(run, "A", 2)
    with open(tmpfs / "filler", "wb") as f:  # fill the disk, then leave ~32 KiB
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with open(tmpfs / "filler", "r+b") as f:
        f.truncate(max(0, os.path.getsize(tmpfs / "filler") - 32768))
    from grpo.config import TrainConfig

    big = {"m.lora_A": torch.ones(256, 1024)}  # 1 MiB: the adapter file fills the disk midway
    with pytest.raises(CheckpointError, match="could not write checkpoint .*step_000004 .the disk is full."):
        save_checkpoint(run, "A", 4, tensors=big, optimizer=None, scheduler_state={}, controller_state={},
                        data_position=0, metrics={}, scores={}, config_json=TrainConfig().to_json())
    assert sorted(p.name for p in (run / "A").iterdir()) == ["registry.json", "step_000002"]
    assert read_registry(run, "A")["aliases"]["latest"] == 2
    loaded = load_checkpoint(first)  # every digest still matches
    assert loaded.step == 2
    (tmpfs / "filler").unlink()
    save_checkpoint(run, "A", 4, tensors=big, optimizer=None, scheduler_state={}, controller_state={},
                    data_position=0, metrics={}, scores={}, config_json=TrainConfig().to_json())
    assert load_checkpoint(run / "A" / "step_000004").tensors["m.lora_A"].shape == (256, 1024)


@pytest.mark.trains
def test_disk_full_during_a_training_checkpoint(tmp_path, monkeypatch):
    """The trainer's step-4 save hits ENOSPC halfway through a file: exit 1, one line, and
    step 2 is still `latest` and loads with every digest intact."""
    run = tmp_path / "run"
    real = durable.write_bytes

    def full_at_step_4(path: Path, data: bytes) -> None:
        if "step_000004" in str(path) and path.name == ADAPTER_FILE:
            path.write_bytes(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(durable, "write_bytes", full_at_step_4)
    rc, out, err = run_main(run, *BASE, "--phase.steps", "4", "--run.eval_every", "2")
    assert_one_line(rc, err, 1, "could not write checkpoint")
    assert "the disk is full" in err and "earlier checkpoints are intact" in err
    assert sorted(p.name for p in (run / "A").iterdir()) == ["registry.json", "step_000002"]
    assert read_registry(run, "A")["aliases"]["latest"] == 2
    assert load_checkpoint(run / "A" / "step_000002").step == 2  # read whole: every file's digest checked
