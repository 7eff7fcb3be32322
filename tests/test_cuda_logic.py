"""The logic of the CUDA-only branches, on a CPU: torch.cuda's queries faked, the branch's own
decisions checked (which device, which rank, which peak, which RNG state, which fix).

What needs the device itself -- compiled Triton kernels, CUDA graphs, the SDPA kernels,
bitsandbytes' CUDA library, NCCL, the allocator's real numbers -- is listed in
bench/RESULTS.md as unverified until a GPU runs it (bench/gpu.sh runs each).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from grpo.errors import ConfigError
from grpo.run.memory_plan import GiB


def test_cuda_peaks_keeps_the_allocators_peak_of_each_label(monkeypatch):
    """bench.memory's CUDA tracker: the peak allocated inside each label, the statistic reset
    at every label change (what --gpu-check reads per phase of a step)."""
    from bench.memory import CudaPeaks

    alloc = {"now": 0, "peak": 0}

    def allocate(n):
        alloc["now"] += n
        alloc["peak"] = max(alloc["peak"], alloc["now"])

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: alloc["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: alloc.update(peak=alloc["now"]))
    with CudaPeaks() as peaks:
        allocate(100)  # resident, outside any label
        with peaks.labelled("sampling"):
            allocate(50)
            allocate(-50)  # freed before the label ends: the peak stays 150
        with peaks.labelled("policy"):
            allocate(30)
            with peaks.labelled("backward"):
                allocate(70)
                allocate(-70)
            allocate(-30)
    assert peaks.peak("sampling") == 150
    assert peaks.peak("backward") == 200
    assert peaks.peak("policy") == 130  # its own stretches only: the nested label's peak is its own
    assert peaks.peak("sampling", "backward") == 200 and peaks.peak("absent") == 0


def test_nccl_branch_refuses_a_local_rank_beyond_the_gpus(monkeypatch):
    from grpo.distributed import DistributedError, init_distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedError, match=r"LOCAL_RANK=1 but this machine has 1 CUDA device\(s\); "
                                                r"use --nproc_per_node 1 or fewer"):
        init_distributed("cuda")


def test_cuda_device_index_beyond_the_machine_is_one_line(monkeypatch):
    from grpo.run.runtime import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("auto") == "cuda" and pick_device("cuda:0") == "cuda:0"
    with pytest.raises(ConfigError, match=r"--model.device cuda:2: this machine has 1 CUDA device\(s\), cuda:0 .. cuda:0"):
        pick_device("cuda:2")


def test_cuda_rng_states_restore_the_devices_this_machine_has(monkeypatch, caplog):
    """A checkpoint saved on 2 GPUs resumed on 1: device 0's state goes back, one warning."""
    from grpo.state.rng import capture_rng, restore_rng

    state = capture_rng()  # CPU here: no CUDA states
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(2)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    with_cuda = capture_rng()
    assert len(with_cuda["torch_cuda"]) == 2
    restored = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.__setitem__(device, s.clone()))
    with caplog.at_level(logging.WARNING):
        restore_rng(dict(state, torch_cuda=with_cuda["torch_cuda"]))
    assert list(restored) == [0] and torch.equal(restored[0], states[0])
    assert "RNG states for 2 CUDA devices, this machine has 1" in caplog.text


def test_out_of_memory_on_cuda_plans_against_the_cards_memory(monkeypatch):
    """On CUDA the out-of-memory line plans against the card's total memory (faked: 16 GiB)."""
    from bench.memory import qwen7b_on_meta
    from grpo.cli import phase_config
    from grpo.run import memory_plan

    cfg = phase_config("A", "qwen7b", {"optim.micro_batch_rows": "0"}, "A")
    model = qwen7b_on_meta(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 16 * GiB))
    line = memory_plan.out_of_memory_message(model, cfg, "cuda", 1, 3, "backward")
    sh = memory_plan.shapes_of_model(model, cfg)
    rows, plan = memory_plan.largest_fitting(sh, cfg, 16 * GiB)
    assert line.startswith("phase A step 3 ran out of device memory in the loss and backward on cuda; ")
    assert f"with --optim.micro_batch_rows {rows} (the same command" in line and "of 16.0 GiB" in line
    assert rows < memory_plan.plan_step(sh, cfg).micro_batch_rows
    # two data-parallel ranks: each plans its half of the batch
    half = copy.deepcopy(cfg)
    half.phase.prompts_per_step //= 2
    assert f"of {memory_plan.plan_step(sh, half).rows} rows" in memory_plan.out_of_memory_message(
        model, cfg, "cuda", 2, 3, "backward")
