"""Checkpoint registry: resume round trip, aliases and selectors, crash and disk-full safety, no pickle."""

import errno
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo.state.durable as durable
from grpo.config import TrainConfig
from grpo.controller import Controller
from grpo.errors import ConfigError
from grpo.state.checkpoint import load_checkpoint, save_checkpoint
from grpo.state.compat import check_compatible, check_resumable
from grpo.state.layout import CheckpointError
from grpo.state.registry import SelectorError, read_registry, resolve
from grpo.state.resume import resume_point
from grpo.state.rng import capture_rng, restore_rng

REPO = Path(__file__).resolve().parents[1]


def tiny_trained(seed: int = 0, steps: int = 3):
    """Two LoRA-like matrices trained a few AdamW steps: (params dict, optimizer)."""
    g = torch.Generator().manual_seed(seed)
    params = {"layer.lora_A": torch.randn(2, 5, generator=g).requires_grad_(),
              "layer.lora_B": torch.zeros(4, 2).requires_grad_()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    x = torch.randn(3, 5, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        loss = (x @ params["layer.lora_A"].T @ params["layer.lora_B"].T).square().mean() + params["layer.lora_A"].sum()
        loss.backward()
        opt.step()
    return params, opt, x


def save(run_dir, phase, step, scores=None, params=None, opt=None, config=None, **kw):
    if params is None:
        params, opt, _ = tiny_trained()
    return save_checkpoint(
        run_dir, phase, step,
        tensors={k: v.detach() for k, v in params.items()},
        optimizer=opt,
        scheduler_state={"step": step, "lr": 1e-2},
        controller_state=Controller.for_phase(phase if phase != "warmup" else "A", 48).state_dict(),
        data_position=step * 4,
        metrics={"parseable": 0.9, "exact": 0.3},
        scores=scores if scores is not None else {"structure": 0.5, "correctness": 0.5, "composite": 0.5},
        config_json=(config or TrainConfig()).to_json(),
        **kw,
    )


# ----------------------------------------------------------------------------- resume


def test_resume_round_trip(tmp_path):
    params, opt, x = tiny_trained()
    ctl = Controller.for_phase("B", 48)
    ctl.update(dict(parseable=0.8, solution_tag=0.9, reasoning_tag=0.9, malformed=0.1, truncation=0.0,
                    mean_tokens=10.0, exact=0.2), n=200)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(
        tmp_path, "B", 20, tensors={k: v.detach() for k, v in params.items()}, optimizer=opt,
        scheduler_state={"step": 20, "warmup": [0, 5]}, controller_state=ctl.state_dict(), data_position=80,
        metrics={"exact": 0.2}, scores={"structure": 0.9, "correctness": 0.2, "composite": 0.4},
        config_json=TrainConfig().to_json(), extra={"note": "hi"})
    expected_draws = (torch.rand(4), random.random(), np.random.rand(3))  # right after the capture

    fresh = {k: torch.zeros_like(v).requires_grad_() for k, v in params.items()}
    opt2 = torch.optim.AdamW(fresh.values(), lr=5.0)  # wrong lr/betas: must be overwritten
    loaded = load_checkpoint(path, optimizer=opt2)
    assert (loaded.phase, loaded.step, loaded.data_position) == ("B", 20, 80)
    assert loaded.scheduler_state == {"step": 20, "warmup": [0, 5]} and loaded.extra == {"note": "hi"}
    assert loaded.scores["structure"] == 0.9
    for k, v in params.items():
        assert torch.equal(loaded.tensors[k], v.detach())
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]  # lr, betas (a tuple again), weight decay
    assert isinstance(s2["param_groups"][0]["betas"], tuple)
    for i in s1["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][i][name], s2["state"][i][name]), (i, name)
    # Controller resumes exactly.
    twin = Controller.for_phase("B", 48)
    twin.load_state_dict(loaded.controller_state)
    assert twin.weights == ctl.weights and twin.prev_exact == ctl.prev_exact
    # RNG: after restore, the draws repeat.
    restore_rng(loaded.rng)
    assert torch.equal(torch.rand(4), expected_draws[0])
    assert random.random() == expected_draws[1]
    assert np.array_equal(np.random.rand(3), expected_draws[2])
    # One more optimiser step from original and restored state lands on the same weights.
    with torch.no_grad():
        for k in fresh:
            fresh[k].copy_(loaded.tensors[k])
    for p, o in ((params, opt), (fresh, opt2)):
        o.zero_grad()
        ((x @ p["layer.lora_A"].T @ p["layer.lora_B"].T).square().mean() + p["layer.lora_A"].sum()).backward()
        o.step()
    for k in params:
        assert torch.equal(params[k], fresh[k])
    assert json.loads(loaded.config_json)["lora"]["rank"] == 8


def test_capture_restore_rng_alone():
    state = json.loads(json.dumps(capture_rng()))  # plain JSON
    a = (torch.randn(3), random.random(), np.random.randn(2))
    restore_rng(state)
    b = (torch.randn(3), random.random(), np.random.randn(2))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])
    with pytest.raises(ValueError, match="lacks torch_cpu"):
        restore_rng({"python": state["python"], "numpy": state["numpy"], "torch_cuda": []})


def test_load_errors(tmp_path):
    path = save(tmp_path, "A", 20, params={"w": torch.ones(2)}, opt=None)
    params, opt, _ = tiny_trained()
    with pytest.raises(CheckpointError, match="without optimiser state"):
        load_checkpoint(path, optimizer=opt)
    other, other_opt, _ = tiny_trained()
    path2 = save(tmp_path, "A", 40, params=other, opt=other_opt)
    one = torch.zeros(3, requires_grad=True)
    with pytest.raises(CheckpointError, match="does not fit this optimiser"):
        load_checkpoint(path2, optimizer=torch.optim.AdamW([one]))
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(tmp_path / "A")
    # A file damaged after saving is caught by its recorded size.
    adapter = path2 / "adapter.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(path2)


# ----------------------------------------------------------------------------- aliases and selectors


def fill_run(run_dir):
    # structure ties at 40 and 60 -> 40; correctness best at 60; composite ties at 20 and 40 -> 20.
    for step, (st, co, cp) in zip((20, 40, 60), ((0.5, 0.3, 0.6), (0.7, 0.2, 0.6), (0.7, 0.4, 0.5))):
        save(run_dir, "A", step, {"structure": st, "correctness": co, "composite": cp})
    save(run_dir, "B", 20, {"structure": 0.1, "correctness": 0.9, "composite": 0.8})


def test_aliases_across_phases_ties_to_earliest(tmp_path):
    fill_run(tmp_path)
    A, B = tmp_path / "A", tmp_path / "B"
    assert resolve(tmp_path, "A:best_structure") == A / "step_000040"
    assert resolve(tmp_path, "A:best_correctness") == A / "step_000060"
    assert resolve(tmp_path, "A:best_composite") == A / "step_000020"
    assert resolve(tmp_path, "A:latest") == resolve(tmp_path, "A") == A / "step_000060"
    assert resolve(tmp_path, "B") == resolve(tmp_path, "B:best_structure") == B / "step_000020"
    assert resolve(tmp_path, "A:40") == resolve(tmp_path, "A:step_000040") == A / "step_000040"
    assert resolve(tmp_path, str(A / "step_000020")) == A / "step_000020"  # a plain path
    assert resolve(tmp_path, str(A)) == A / "step_000060"  # a phase directory: its latest
    assert read_registry(tmp_path, "A")["aliases"] == {
        "latest": 60, "best_structure": 40, "best_correctness": 60, "best_composite": 20}


def test_missing_score_leaves_alias_alone(tmp_path):
    save(tmp_path, "warmup", 10, scores={})
    save(tmp_path, "warmup", 20, scores={"structure": 0.3})
    assert read_registry(tmp_path, "warmup")["aliases"] == {"latest": 20, "best_structure": 20}


@pytest.mark.parametrize("selector,match", [
    ("C:latest", "'C:latest' names nothing"),
    ("A:best_nonsense", "aliases are latest, best_structure"),
    ("A:80", "names nothing"),
    ("D:latest", "neither PHASE"),
    ("base", "untrained model"),
])
def test_selector_names_nothing_lists_what_exists(tmp_path, selector, match):
    fill_run(tmp_path)
    with pytest.raises(SelectorError, match=match) as e:
        resolve(tmp_path, selector)
    msg = str(e.value)
    assert "A: steps 20, 40, 60; latest=step 60, best_structure=step 40" in msg
    assert "B: steps 20" in msg and "C: no checkpoints" in msg


def test_steps_must_increase(tmp_path):
    save(tmp_path, "A", 40)
    with pytest.raises(CheckpointError, match="not after it"):
        save(tmp_path, "A", 20)
    save(tmp_path, "B", 20)  # another phase has its own step count


def test_keep_last_prunes_only_unaliased(tmp_path):
    structure = {20: 0.9, 40: 0.1, 60: 0.2, 80: 0.3, 100: 0.4}  # best_structure stays at 20
    for step, s in structure.items():
        save(tmp_path, "A", step, {"structure": s, "correctness": s, "composite": s}, keep_last=1)
    reg = read_registry(tmp_path, "A")
    assert [c["step"] for c in reg["checkpoints"]] == [20, 80, 100]  # aliased 20 and 100, newest free 80
    on_disk = sorted(p.name for p in (tmp_path / "A").iterdir() if p.name.startswith("step_"))
    assert on_disk == ["step_000020", "step_000080", "step_000100"]
    for alias in ("latest", "best_structure", "best_correctness", "best_composite"):
        load_checkpoint(resolve(tmp_path, f"A:{alias}"))


# ----------------------------------------------------------------------------- crash safety


class Killed(BaseException):
    """Stands in for SIGKILL: a BaseException skips the save's OSError cleanup, like a kill."""


def count_writes(tmp_path) -> int:
    n = 0
    real = durable.write_bytes

    def counting(path, data):
        nonlocal n
        n += 1
        real(path, data)

    durable.write_bytes = counting
    try:
        save(tmp_path / "count", "A", 20)
    finally:
        durable.write_bytes = real
    return n


def assert_latest_is(run_dir, step):
    path = resolve(run_dir, "A:latest")
    assert path.name == f"step_{step:06d}"
    loaded = load_checkpoint(path, optimizer=tiny_trained()[1])
    assert loaded.step == step


def test_kill_at_every_write_keeps_previous_latest(tmp_path, monkeypatch):
    n_writes = count_writes(tmp_path)
    assert n_writes == 5  # adapter, optimizer tensors, optimizer json, state.json, registry
    run = tmp_path / "run"
    save(run, "A", 20)
    real = durable.write_bytes
    for kill_at in range(n_writes):
        calls = 0

        def dying(path, data, kill_at=kill_at):
            nonlocal calls
            if calls == kill_at:
                path.write_bytes(data[: len(data) // 2])  # half a file, then the process is gone
                raise Killed()
            calls += 1
            real(path, data)

        monkeypatch.setattr(durable, "write_bytes", dying)
        with pytest.raises(Killed):
            save(run, "A", 40)
        monkeypatch.setattr(durable, "write_bytes", real)
        assert_latest_is(run, 20)
    # Killed between the directory rename and the registry replace: an orphan step dir.
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        save(run, "A", 40)
    monkeypatch.undo()
    assert (run / "A" / "step_000040").is_dir()
    assert_latest_is(run, 20)
    # The next save cleans every leftover and succeeds.
    save(run, "A", 40)
    assert_latest_is(run, 40)
    assert sorted(p.name for p in (run / "A").iterdir()) == ["registry.json", "step_000020", "step_000040"]


def test_sigkill_in_a_subprocess_leaves_latest_valid(tmp_path):
    # A real kill -9 in the middle of the registry write, after the new directory is in place.
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        import grpo.state.checkpoint as ckpt
        import grpo.state.durable as durable
        from grpo.config import TrainConfig
        def save(step):
            ckpt.save_checkpoint({str(tmp_path)!r}, "A", step, tensors={{"w": torch.full((3,), float(step))}},
                optimizer=None, scheduler_state={{}}, controller_state={{}}, data_position=step, metrics={{}},
                scores={{"structure": step}}, config_json=TrainConfig().to_json())
        save(20)
        real = durable.write_bytes
        def dying(path, data):
            if path.name.startswith(".tmp-registry"):
                with open(path, "wb") as f:
                    f.write(data[:7])
                os.kill(os.getpid(), signal.SIGKILL)
            real(path, data)
        durable.write_bytes = dying
        save(40)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert (tmp_path / "A" / "step_000040" / "state.json").is_file()  # renamed into place, never registered
    path = resolve(tmp_path, "A:latest")
    assert path.name == "step_000020"
    assert torch.equal(load_checkpoint(path).tensors["w"], torch.full((3,), 20.0))
    save(tmp_path, "A", 40, params={"w": torch.ones(1)}, opt=None)
    assert resolve(tmp_path, "A:latest").name == "step_000040"
    assert not [p for p in (tmp_path / "A").iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("fail_at,match", [(1, "the disk is full"), (4, "could not be updated")])
def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_at, match):
    save(tmp_path, "A", 20)
    real, calls = durable.write_bytes, 0

    def full(path, data):
        nonlocal calls
        calls += 1
        if calls > fail_at:
            path.write_bytes(data[:3])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(durable, "write_bytes", full)
    with pytest.raises(CheckpointError, match=match):
        save(tmp_path, "A", 40)
    monkeypatch.undo()
    assert not [p for p in (tmp_path / "A").iterdir() if p.name.startswith(".tmp-")]
    assert_latest_is(tmp_path, 20)


# ----------------------------------------------------------------------------- config, bad input, no pickle


def test_incompatible_config(tmp_path):
    cfg = TrainConfig()
    save(tmp_path, "A", 20, config=cfg)
    check_compatible(tmp_path, cfg)
    check_compatible(tmp_path / "empty", cfg)  # nothing saved yet: anything goes
    runtime = TrainConfig()
    runtime.model.device, runtime.optim.lr, runtime.sampling.G = "cuda", 1.0, 2  # don't change what weights mean
    check_compatible(tmp_path, runtime)
    other = TrainConfig()
    other.lora.rank, other.lora.targets = 16, ("q_proj",)
    with pytest.raises(ConfigError) as e:
        check_compatible(tmp_path, other)
    msg = str(e.value)
    assert "lora.rank: saved 8, now 16" in msg and "lora.targets" in msg and "A step 20" in msg


@pytest.mark.parametrize("bad,error,match", [
    (dict(phase="D"), ValueError, "phase 'D': use one of warmup, A, B, C"),
    (dict(step=-1), ValueError, "step=-1"),
    (dict(scores={"accuracy": 1.0}), ValueError, "unknown keys"),
    (dict(scores={"structure": float("nan")}), ValueError, "not NaN"),
    (dict(tensors={"w": [1.0]}), TypeError, "torch.Tensor"),
    (dict(scheduler_state={"fn": {1, 2}}), TypeError, "plain JSON"),
    (dict(config_json="not json"), ValueError, "config_json"),
    (dict(keep_last=-1), ValueError, "keep_last=-1"),
])
def test_bad_save_arguments(tmp_path, bad, error, match):
    args = dict(run_dir=tmp_path, phase="A", step=20, tensors={"w": torch.ones(1)}, optimizer=None, scheduler_state={},
                controller_state={}, data_position=0, metrics={}, scores={}, config_json="{}")
    with pytest.raises(error, match=match):
        save_checkpoint(**{**args, **bad})
    assert not (tmp_path / "A" / "registry.json").exists()


def test_no_pickle_anywhere(tmp_path):
    fill_run(tmp_path)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".json", ".safetensors") for p in files), files
    for p in files:
        head = p.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", p  # pickle protocol 2+ / torch.save zip


# ----------------------------------------------------------------------------- integrity: damaged files are named, never loaded


def flip_bit(path: Path, offset_from_end: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_digests_are_recorded_and_a_flipped_bit_is_refused(tmp_path):
    path = save(tmp_path, "A", 20)
    state = json.loads((path / "state.json").read_text())
    for name in ("adapter.safetensors", "optimizer.safetensors", "optimizer.json"):
        spec = state["files"][name]
        assert spec["size"] == (path / name).stat().st_size and len(spec["sha256"]) == 64
    entry, = read_registry(tmp_path, "A")["checkpoints"]
    assert len(entry["state_sha256"]) == 64
    flip_bit(path / "adapter.safetensors")  # inside the tensor data: the safetensors header still parses
    with pytest.raises(CheckpointError, match=r"adapter.safetensors does not match the sha256 recorded"):
        load_checkpoint(path)


def test_format_1_checkpoints_without_digests_still_load(tmp_path):
    path = save(tmp_path, "A", 20)
    state = json.loads((path / "state.json").read_text())
    state["format_version"] = 1
    state["files"] = {n: spec["size"] for n, spec in state["files"].items()}
    (path / "state.json").write_text(json.dumps(state))
    reg = read_registry(tmp_path, "A")
    reg["format_version"] = 1
    del reg["checkpoints"][0]["state_sha256"]
    (tmp_path / "A" / "registry.json").write_text(json.dumps(reg))
    params, _, _ = tiny_trained()
    loaded = load_checkpoint(path, optimizer=tiny_trained()[1])
    assert torch.equal(loaded.tensors["layer.lora_A"], params["layer.lora_A"].detach())
    # without a digest a garbage header is still one CheckpointError, not a SafetensorError
    adapter = path / "adapter.safetensors"
    adapter.write_bytes(b"\xff" * adapter.stat().st_size)
    with pytest.raises(CheckpointError, match="adapter.safetensors is not a valid safetensors file"):
        load_checkpoint(path)


def test_non_finite_tensors_are_never_saved(tmp_path):
    params, opt, _ = tiny_trained()
    with torch.no_grad():
        params["layer.lora_B"][1, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"adapter.safetensors tensor 'layer.lora_B' has 1 non-finite values"):
        save(tmp_path, "A", 20, params=params, opt=opt)
    assert not (tmp_path / "A" / "registry.json").exists()
    assert not [p for p in (tmp_path / "A").iterdir()]  # nothing was written, not even a temp dir
    params, opt, _ = tiny_trained()
    next(iter(opt.state.values()))["exp_avg_sq"].fill_(float("inf"))
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors tensor 'optim.state.0.exp_avg_sq'"):
        save(tmp_path, "A", 20, params=params, opt=opt)


def test_a_foreign_checkpoint_with_nan_tensors_is_refused_by_name(tmp_path):
    from safetensors.torch import save as st_save

    path = save(tmp_path, "A", 20, params={"w": torch.ones(3)}, opt=None)
    data = st_save({"w": torch.tensor([1.0, float("nan"), float("inf")])})
    (path / "adapter.safetensors").write_bytes(data)
    state = json.loads((path / "state.json").read_text())
    state["files"]["adapter.safetensors"] = {"size": len(data), "sha256": durable.sha256(data)}  # digests re-made
    (path / "state.json").write_text(json.dumps(state))
    reg = read_registry(tmp_path, "A")
    reg["checkpoints"][0]["state_sha256"] = durable.sha256((path / "state.json").read_bytes())
    (tmp_path / "A" / "registry.json").write_text(json.dumps(reg))
    with pytest.raises(CheckpointError, match=r"tensor 'w' has 2 non-finite values \(NaN/inf\) of 3"):
        load_checkpoint(path)


@pytest.mark.parametrize("edit,match", [
    (lambda r: r["checkpoints"].append({"step": 30, "dir": "../../victim", "scores": {}}),
     "dir '../../victim'; it must be that step's own directory 'step_000030'"),
    (lambda r: r["checkpoints"][0].update(dir="/tmp/victim"), "dir '/tmp/victim'"),
    (lambda r: r["checkpoints"][0].update(dir="step_000020"), "step 10 has dir 'step_000020'"),  # would delete step 10
    (lambda r: r.clear(), "lacks 'checkpoints', 'aliases'"),
    (lambda r: r["aliases"].update(latest="20"), "alias 'latest' points to '20'"),
    (lambda r: r["aliases"].update(best_structure=99), "alias 'best_structure' points to 99"),
    (lambda r: r.update(phase="B"), "says phase 'B'"),
])
def test_registry_entries_are_checked_before_anything_is_deleted(tmp_path, edit, match):
    run = tmp_path / "run"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    save(run, "A", 10)
    save(run, "A", 20)
    reg = json.loads((run / "A" / "registry.json").read_text())
    edit(reg)
    (run / "A" / "registry.json").write_text(json.dumps(reg))
    for action in (lambda: save(run, "A", 40, keep_last=0), lambda: resolve(run, "A:latest"),
                   lambda: resume_point(run, "A", set_aside=True)):
        with pytest.raises(CheckpointError, match=match) as e:
            action()
        assert "\n" not in str(e.value)
    assert (victim / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in (run / "A").iterdir()) == ["registry.json", "step_000010", "step_000020"]


@pytest.mark.parametrize("base", ["/etc", "../../elsewhere/A/step_000002", "A/../../x", "A/step_2", 7])
def test_extra_base_must_name_a_checkpoint_inside_the_run(tmp_path, base):
    with pytest.raises(CheckpointError, match="extra.base=.* is not a checkpoint inside the run directory"):
        save(tmp_path, "A", 20, extra={"base": base})
    path = save(tmp_path, "A", 20, extra={"base": "warmup/step_000600"})
    state = json.loads((path / "state.json").read_text())
    state["extra"]["base"] = base
    (path / "state.json").write_text(json.dumps(state))
    reg = read_registry(tmp_path, "A")
    del reg["checkpoints"][0]["state_sha256"]  # an editor who also knows to drop the digest
    (tmp_path / "A" / "registry.json").write_text(json.dumps(reg))
    with pytest.raises(CheckpointError, match=r"state.json: extra.base=.* is not a checkpoint inside"):
        load_checkpoint(path)


def test_resume_point_skips_damaged_latest_and_sets_it_aside(tmp_path):
    for step, s in ((10, 0.9), (20, 0.1), (30, 0.2)):
        save(tmp_path, "A", step, {"structure": s, "correctness": s, "composite": s})
    assert resume_point(tmp_path, "A") [0].step == 30
    (tmp_path / "A" / "step_000030" / "state.json").write_text('{"step": 3')  # half a JSON file
    flip_bit(tmp_path / "A" / "step_000020" / "optimizer.safetensors")
    found, damaged = resume_point(tmp_path, "A")  # looking changes nothing
    assert found.step == 10 and [s for s, _ in damaged] == [30, 20]
    assert "state.json does not match the sha256" in damaged[0][1]
    assert "optimizer.safetensors does not match the sha256" in damaged[1][1]
    assert read_registry(tmp_path, "A")["aliases"]["latest"] == 30
    found, damaged = resume_point(tmp_path, "A", set_aside=True)
    assert found.step == 10
    reg = read_registry(tmp_path, "A")
    assert [c["step"] for c in reg["checkpoints"]] == [10]
    assert reg["aliases"] == {"latest": 10, "best_structure": 10, "best_correctness": 10, "best_composite": 10}
    assert sorted(p.name for p in (tmp_path / "A").iterdir()) == [
        "damaged-step_000020", "damaged-step_000030", "registry.json", "step_000010"]
    save(tmp_path, "A", 20)  # the resumed run saves its steps again; the damaged copies stay
    assert (tmp_path / "A" / "damaged-step_000020").is_dir() and resolve(tmp_path, "A:latest").name == "step_000020"


def test_resume_point_never_starts_from_nothing_silently(tmp_path):
    assert resume_point(tmp_path, "A") == (None, [])
    save(tmp_path, "A", 10)
    (tmp_path / "A" / "step_000010" / "adapter.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint of phase A .* all 1 are damaged "
                                              r"\(step 10: .*adapter.safetensors is missing"):
        resume_point(tmp_path, "A", set_aside=True)
    assert read_registry(tmp_path, "A")["aliases"]["latest"] == 10  # nothing was set aside


def test_resume_must_keep_what_a_step_is(tmp_path):
    cfg = TrainConfig()
    cfg.phase.name = "A"
    save(tmp_path, "A", 20, config=cfg)
    check_resumable(tmp_path, cfg)
    changed = TrainConfig()
    changed.phase.name, changed.phase.steps, changed.optim.lr = "A", 999, 1.0  # how long and how fast: fine
    check_resumable(tmp_path, changed)
    changed.sampling.G = 4
    with pytest.raises(ConfigError, match=r"holds phase A up to step 20; resuming it with sampling.G: saved 8, now 4"):
        check_resumable(tmp_path, changed)
    other_phase = TrainConfig()
    other_phase.sampling.G = 4
    check_resumable(tmp_path, other_phase)  # phase B has nothing to resume


def test_resume_must_keep_the_accuracy_band(tmp_path):
    # The band decides which groups dynamic sampling refills, so how far the data stream runs.
    cfg = TrainConfig()
    cfg.phase.name, cfg.sampling.dynamic_sampling = "A", True
    save(tmp_path, "A", 20, config=cfg)
    check_resumable(tmp_path, cfg)
    cfg.sampling.accuracy_low = 0.01
    with pytest.raises(ConfigError, match=r"resuming it with sampling.accuracy_low: saved 0.0, now 0.01"):
        check_resumable(tmp_path, cfg)
