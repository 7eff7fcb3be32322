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
