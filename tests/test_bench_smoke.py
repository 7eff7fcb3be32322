"""bench/step.py end to end at its smallest size (seconds): every stage runs on both rollout
paths and the tables and the summary line come out. Speed is not asserted (benchmarks
report it); bench/gpu.sh --dry-run covers the other benchmarks' CPU paths."""

import re

import pytest

from bench import step


def test_step_benchmark_smoke(capsys):
    import torch

    pytest.importorskip("bitsandbytes")
    threads = torch.get_num_threads()
    try:
        step.main(["--smoke", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the benchmark sets the process-wide count
    out = capsys.readouterr().out
    assert "SCALED DOWN" in out  # a CPU run says it is not the 7B
    for stage in ("prompts", "sampling", "rewards", "ref logp (no grad)", "logp (grad)", "loss", "backward",
                  "optimizer", "step total"):
        assert re.search(rf"^\s*{re.escape(stage)}\s+\d", out, re.M), stage
    for path in ("plain", "merged"):
        row = re.search(rf"^\s*{path}\s+2\s+4\s+\d+\s+[\d.]+\s+(\d+)", out, re.M)  # 2 rows x 4 steps decoded
        assert row and int(row.group(1)) > 0, path
    assert re.search(r"^summary: GRPO step \(smoke, B=1 G=2 L=4\).*merged/plain decode [\d.]+x", out, re.M)


def test_step_benchmark_refuses_7b_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        step.main(["--scale", "7b"])


def test_step_benchmark_on_the_tiny_default_reports_the_rollout_mismatch(capsys):
    """--scale tiny: the trainer's own tiny policy; the mismatch table has one row per path,
    the plain path's sampler equals its trainer up to rounding, the merged fp32 copy nearly."""
    import torch

    pytest.importorskip("bitsandbytes")
    threads = torch.get_num_threads()
    try:
        step.main(["--scale", "tiny", "--B", "1", "--G", "2", "--max-new-tokens", "4", "--beta", "0",
                   "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "merged copy dtype torch.float32" in out  # the tiny model computes in fp32 on a CPU
    for path in ("plain", "merged"):
        row = re.search(rf"^\s*{path}\s+([\d.e+-]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        assert row, path
        kl, mean, mx, seq_max, over = map(float, row.groups())
        assert kl < 1e-4 and abs(mean - 1) < 1e-2 and 1 - 1e-2 < mx < 1.1 and seq_max < 1.5 and over == 0, row.group(0)
    assert re.search(r"^summary: GRPO step \(tiny, B=1 G=2 L=4\)", out, re.M)
