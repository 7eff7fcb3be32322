"""Every bench/ command through its real command line (``python -m bench.X``) at its smallest
size, seconds each: it exits 0 and prints its table and summary line. Speed is not asserted
(the benchmarks report it). The kernel and step benchmarks run exactly the command lines of
bench/gpu.sh --dry-run, read from the script, so the GPU script cannot drift from what is
tested; gpu.sh itself runs its preflight (the kit, the stack check and the smoke of a later
part) and one part (the rest of its parts are these commands and the kernel test files the
suite runs anyway). bench/learning.py's CLI runs in
tests/test_bench_learning.py."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_SH = ROOT / "bench" / "gpu.sh"


def cli(module: str, *args: str, interpret: bool = False, timeout: int = 300, path: str = "") -> str:
    """Run ``python -m <module> args`` as a user would, on the CPU with one thread; its stdout.
    ``path``: a directory put on PYTHONPATH after the repository (an optional package's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERNELS_BACKEND")}
    # CUDA hidden: on a GPU machine the benchmarks would otherwise pick their full GPU sizes.
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), path])))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{module} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def dry_run_commands() -> dict[str, list[str]]:
    """bench/gpu.sh --dry-run's benchmark parts: part -> [module, args...]."""
    text = GPU_SH.read_text()
    block = text[text.index('if [ "$DRY_RUN" = 1 ]; then\n  run tests'):]
    block = block[: block.index("\nelse\n")]
    found = re.findall(r'^\s*run (\w+)\s+\d+\s+"\$PY" -m (bench\.\w+)(.*)$', block, re.M)
    return {part: [module, *rest.split()] for part, module, rest in found}


DRY_RUN = dry_run_commands()


def test_gpu_sh_dry_run_lists_every_kernel_and_step_benchmark():
    assert set(DRY_RUN) == {"grpo_loss", "logprob", "step", "memory", "sampler", "compiled"}
    assert all(cmd[0] == f"bench.{part}" for part, cmd in DRY_RUN.items() if part != "compiled")
    assert DRY_RUN["compiled"][:3] == ["bench.grpo_loss", "--quick", "--compile"]


def test_gpu_sh_part_timeouts_sum_to_seven_minutes():
    """The GPU run's parts under their own timeouts, preflight included: 420 s in all."""
    text = GPU_SH.read_text()
    gpu = text[text.index("\nelse\n  run tests"):text.index("\nfi\n", text.index("\nelse\n  run tests"))]
    limits = [int(n) for n in re.findall(r"^\s*run \w+\s+(\d+)\s", gpu, re.M)]
    table = re.findall(r"^#\s+(preflight|tests|grpo_loss|logprob|step|memory|sampler|compiled)\s.*?(\d+) s$", text, re.M)
    assert [p for p, _ in table] == ["preflight", "tests", "grpo_loss", "logprob", "step", "memory", "sampler",
                                     "compiled"]
    assert [int(n) for _, n in table[1:]] == limits  # the header's table is the script's
    assert sum(int(n) for _, n in table) == 420 and "BUDGET=${BUDGET:-$((420 * SCALE))}" in text


def table_rows(out: str, *cells: str) -> list[str]:
    """Lines of a printed table whose whitespace-separated cells start with ``cells``."""
    return [ln for ln in out.splitlines() if ln.split()[: len(cells)] == list(cells)]


def test_grpo_loss():
    out = cli(*DRY_RUN["grpo_loss"])
    for provider in ("eager", "(validation)"):
        assert table_rows(out, "N=8", "T=64", "grpo/token/kl", provider), provider
    assert re.search(r"^summary: grpo_loss fwd\+bwd N=8 T=64 on CPU: eager [\d.]+ ms", out, re.M)


@pytest.mark.parametrize("module, args, rows", [
    ("bench.grpo_loss", ["--shape", "8", "16"],
     [["N=8", "T=16", mode, "triton"] for mode in ("grpo/token/kl", "dapo/sequence", "bnpo/prefix", "dr_grpo/components")]),
    ("bench.logprob", ["--quick", "--shape", "2", "8", "--vocab", "500", "--hidden", "64"],
     [["N=2", "T=8", "V=500", "triton", p] for p in ("fwd", "fwd+bwd")]
     + [["N=2", "T=8", "V=500", "d=64", p, "fwd+bwd"] for p in ("eager", "triton-chunked")]),
])
def test_triton_providers_under_the_interpreter(module, args, rows):
    # The providers a CPU run skips: the kernel path of each benchmark, which gpu.sh times on a GPU.
    out = cli(module, "--force-triton", "--reps", "1", "--warmup", "0", *args, interpret=True)
    for cells in rows:
        assert table_rows(out, *cells), cells
    assert re.search(r"^summary: .* on CPU: eager [\d.]+ ms", out, re.M)


def test_logprob():
    out = cli(*DRY_RUN["logprob"])
    for provider, pass_ in (("eager", "fwd"), ("eager", "fwd+bwd")):
        assert table_rows(out, "N=2", "T=8", "V=1000", provider, pass_), (provider, pass_)
    assert re.search(r"^summary: logprob fwd\+bwd 16 tokens x V=1000 on CPU: eager [\d.]+ ms", out, re.M)


def test_step():
    pytest.importorskip("bitsandbytes")
    out = cli(*DRY_RUN["step"])
    assert "SCALED DOWN" in out  # a CPU run says it is not the 7B
    for stage in ("prompts", "sampling", "rewards", "step total"):
        assert re.search(rf"^\s*{re.escape(stage)}\s+\d", out, re.M), stage
    for stage in ("ref logp (no grad)", "logp (grad)", "loss", "backward", "optimizer"):  # both log-prob paths
        for prefix in ("shared", "full"):
            assert re.search(rf"^\s*{re.escape(stage)} \[{prefix}\]\s+\d", out, re.M), (stage, prefix)
    for path in ("plain", "merged"):
        assert re.search(rf"^# log-prob paths \({path} rollouts\): shared: training passes [\d.]+ ms, policy pass "
                         rf"[\d.]+ ms, saved [\d.]+ [KMG]?i?B; full: .* full/shared: training passes [\d.]+x; "
                         rf"shared vs full: policy pass time [+-]\d+%, saved -\d+%$", out, re.M), path
    for path in ("plain", "merged"):
        row = re.search(rf"^\s*{path}\s+2\s+4\s+\d+\s+[\d.]+\s+(\d+)", out, re.M)  # 2 rows x 4 steps decoded
        assert row and int(row.group(1)) > 0, path
    assert re.search(r"^summary: GRPO step \(smoke, B=1 G=2 L=4\).*merged/plain decode [\d.]+x", out, re.M)


def test_step_benchmark_refuses_7b_without_a_gpu():
    import torch

    from bench import step

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        step.main(["--scale", "7b"])


def test_memory_gpu_check_dry_run():
    # gpu.sh's memory part on a CPU: the tiny model's real steps against the plan, one row per phase
    pytest.importorskip("bitsandbytes")
    out = cli(*DRY_RUN["memory"])
    for setting in ("tiny 1 x G=2, 8 tok", "tiny 2 x G=2, 8 tok, micro 2"):
        for phase in ("resident", "sampling", "policy", "PEAK"):
            assert re.search(rf"^\s*{re.escape(setting)}\s+{phase}\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M), (setting, phase)
    assert re.search(r"^summary: memory plan vs LiveBytes on CPU: 2 setting\(s\), step peak within [\d.]+%$", out, re.M)


def test_an_empty_table_prints_its_header(capsys):
    from bench._timing import print_table

    print_table([], ["run", "phase"])  # bench.memory --gpu-check with every setting skipped
    assert capsys.readouterr().out.split() == ["run", "phase"]


def test_memory_gpu_check_smoke_runs_its_first_setting_only():
    # gpu.sh's preflight smoke of the memory part
    pytest.importorskip("bitsandbytes")
    out = cli("bench.memory", "--gpu-check", "--smoke")
    assert "(smoke)" in out and re.search(r"^\s*tiny 1 x G=2, 8 tok\s+PEAK\s", out, re.M)
    assert "tiny 2 x G=2" not in out
    assert re.search(r"^summary: memory plan vs LiveBytes on CPU: 1 setting\(s\)", out, re.M)


def test_memory_plan_of_the_tiny_default_measures_its_step():
    pytest.importorskip("bitsandbytes")
    out = cli("bench.memory", "--sampling.G", "2", "--phase.prompts_per_step", "1", "--sampling.max_new_tokens", "4",
              "--gpu-gib", "80")
    for component in ("KV cache", "LoRA + grads + AdamW moments", "policy backward"):
        assert component in out, component
    assert table_rows(out, "tiny", "policy") and table_rows(out, "tiny", "sampling")  # measured against planned
    assert "on a 80 GiB GPU" in out and ": fits;" in out
    assert re.search(r"^peak \d+\.\d GiB \(policy; .*fits 80 GiB\)$", out.splitlines()[-1])


def test_memory_plan_of_the_7b_meets_the_staged_papers_budget():
    """The 7B on the meta device (no download, seconds): the staged paper's setting is
    planned under 12 GiB, and with 12 GiB the command names no smaller micro-batch."""
    out = cli("bench.memory", "--preset", "qwen7b", "--sampling.G", "2", "--phase.prompts_per_step", "1",
              "--sampling.max_new_tokens", "64", "--model.image_size", "336", "--gpu-gib", "16")
    last = out.splitlines()[-1]
    peak = float(re.match(r"^peak (\d+\.\d) GiB \(", last).group(1))
    assert 6.0 < peak <= 12.0 and "fits 16 GiB" in last, last
    # the vision-training table: what training the merger, then the tower too, adds to the policy pass
    added = [float(m.group(1).replace(",", "")) for m in
             re.finditer(r"^\s*(?:frozen tower|merger|tower \+ merger)\s+[\d.]+\s+[\d.]+\s+([\d,]+)\s+\w+$", out, re.M)]
    assert len(added) == 3 and added[0] == 0 < added[1] < added[2], added


def test_sampler():
    out = cli(*DRY_RUN["sampler"])
    row = re.search(r"^\s*tiny\s.*\| generate\s+\d+ ms\s+([\d.]+) tok/s \| ours\s+\d+ ms\s+([\d.]+) tok/s "
                    r"\| speed-up\s+[\d.]+x", out, re.M)
    assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0
    assert re.search(r"^summary: ours vs generate on repeated prompts, G=2: tiny [\d.]+x$", out, re.M)


def test_sampler_with_the_decode_step_compiled():
    """--compile's rows at tiny sizes; the eager backend traces the step without generating code
    (seconds, not inductor's half minute), so the check holds exactly: same tokens, same log-probs."""
    out = cli(*DRY_RUN["sampler"], "--compile", "--compile-backend", "eager")
    assert re.search(r"^\s*tiny compile: first call\s+[\d.]+ s \| eager .* \| compiled .* \| speed-up\s+[\d.]+x$",
                     out, re.M)
    assert re.search(r"^\s*tiny compile: greedy tokens equal True, sampled tokens equal True, "
                     r"max \|logp diff\| 0\.00e\+00$", out, re.M)
    assert re.search(r"^summary: torch.compile'd decode step vs eager \(eager\): tiny [\d.]+x$", out, re.M)


def test_perception_probe():
    out = cli("bench.perception_probe", "probe", "--task", "table", "--steps", "2", "--captions", "1",
              "--B", "2", "--n-eval", "4", "--eval-every", "1")
    assert re.search(r"^caption 0 lm loss [\d.]+", out, re.M) and re.search(r"^qa 0 lm loss [\d.]+", out, re.M)
    acc = r"perceived digit accuracy (\d\.\d{3}) true images, (\d\.\d{3}) shuffled"
    assert re.search(rf"^  @ 1: {acc}$", out, re.M)  # the learning curve
    final = re.search(rf"^  final \(2 steps, \d+s\): {acc}$", out, re.M)
    assert final and all(float(final.group(i)) in (0.0, 0.25, 0.5, 0.75, 1.0) for i in (1, 2))  # of 4 examples


def test_perception_curriculum():
    out = cli("bench.perception_probe", "curriculum", "--steps", "2", "--captions", "1", "--B", "2",
              "--train-per-stage", "4", "--n-eval", "2")
    for stage in (1, 2, 3):
        assert re.search(rf"^stage {stage}: EM [\d.]+, shuffled images [\d.]+, blind gap [+-][\d.]+ .*"
                         r"by family \(true/shuffled\): \w+ [\d.]+/[\d.]+", out, re.M), stage
    assert re.search(r"^overall blind gap [+-][\d.]+ \(mean of the stages\); training took \d+s$", out, re.M)


def gpu_sh(*args: str, out_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    if out_dir is not None:
        env["OUT"] = str(out_dir)
    return subprocess.run(["bash", str(GPU_SH), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_gpu_sh_dry_run(tmp_path):
    """The preflight (the kit from bench/gpu_kit/ when built, the stack, the smoke of the
    selected later part) and that part, each row written into summary.md."""
    proc = gpu_sh("--dry-run", "--parts", "preflight,grpo_loss", out_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "gpu_results" / "summary.md").read_text()
    assert summary.startswith("# bench/gpu.sh --dry-run (CPU-smoke sizes")
    if list((ROOT / "bench" / "gpu_kit").glob("bitsandbytes-*.whl")):
        assert "kit: bitsandbytes installed from bench/gpu_kit with --no-index" in summary
    assert re.search(r"^summary: stack ok$", summary, re.M)
    assert re.search(r"^torch \S+: ok \(declared >=", summary, re.M)
    rows = [ln for ln in summary.splitlines() if ln.startswith("| ") and not ln.startswith("| part ")]
    assert len(rows) == 2, rows
    assert re.fullmatch(r"\| preflight \| 0 \| \d+ \| smoke: grpo_loss ok; \|", rows[0]), rows
    assert re.fullmatch(r"\| grpo_loss \| 0 \| \d+ \| summary: grpo_loss fwd\+bwd .* \|", rows[1]), rows
    assert (tmp_path / "gpu_results" / "smoke_grpo_loss.log").read_text().count("summary:") == 1
    assert re.search(r"^python \S+; torch CUDA \S+; device cpu$", summary, re.M)  # --dry-run hides the GPU
    assert re.search(r"^total: \d+ s of a 1680 s budget$", summary, re.M)


def test_gpu_sh_skips_a_part_whose_smoke_failed(tmp_path):
    """A smoke that fails costs its seconds, not the part's budget: the part is skipped."""
    env_python = tmp_path / "python"  # python with bench.grpo_loss broken, everything else real
    env_python.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = bench.grpo_loss ] && exit 3; done\n'
                          f'exec {sys.executable} "$@"\n')
    env_python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(env_python), "OMP_NUM_THREADS": "1", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(GPU_SH), "--dry-run", "--parts", "preflight,grpo_loss"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # a failed smoke fails the run
    summary = (tmp_path / "gpu_results" / "summary.md").read_text()
    assert "| preflight | 0 |" in summary and "grpo_loss FAILED (3, smoke_grpo_loss.log: skipped);" in summary
    assert "| grpo_loss | skipped | 0 | its smoke failed: smoke_grpo_loss.log |" in summary
    assert not (tmp_path / "gpu_results" / "grpo_loss.log").exists()


@pytest.mark.parametrize("args, message", [
    (["--parts", "preflight,nosuch"], "unknown part 'nosuch' in --parts; use some of "
                                      "preflight,tests,grpo_loss,logprob,step,memory,sampler,compiled"),
    (["--parts"], "--parts needs a comma-separated list of: preflight,tests,"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])
def test_gpu_sh_bad_arguments_are_one_line_with_exit_code_2(args, message, tmp_path):
    proc = gpu_sh("--dry-run", *args, out_dir=tmp_path)
    assert proc.returncode == 2 and not proc.stdout and not (tmp_path / "gpu_results").exists()
    assert proc.stderr.startswith("bench/gpu.sh: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_step_benchmark_on_the_tiny_default_reports_the_rollout_mismatch():
    """--scale tiny: the trainer's own tiny policy; the mismatch table has one row per path,
    the plain path's sampler equals its trainer up to rounding, the merged fp32 copy nearly."""
    pytest.importorskip("bitsandbytes")
    out = cli("bench.step", "--scale", "tiny", "--B", "1", "--G", "2", "--max-new-tokens", "4", "--beta", "0",
              "--threads", "1")
    assert "merged copy dtype torch.float32" in out  # the tiny model computes in fp32 on a CPU
    for path in ("plain", "merged"):
        row = re.search(rf"^\s*{path}\s+([\d.e+-]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        assert row, path
        kl, mean, mx, seq_max, over = map(float, row.groups())
        assert kl < 1e-4 and abs(mean - 1) < 1e-2 and 1 - 1e-2 < mx < 1.1 and seq_max < 1.5 and over == 0, row.group(0)
    assert re.search(r"^summary: GRPO step \(tiny, B=1 G=2 L=4\)", out, re.M)


def test_step_benchmark_runs_one_log_prob_path():
    """--prefix full: only the full-row passes, stages without a path tag, no ratio."""
    pytest.importorskip("bitsandbytes")
    out = cli("bench.step", "--smoke", "--rollout", "plain", "--prefix", "full")
    assert re.search(r"^\s*logp \(grad\)\s+\d", out, re.M) and "[shared]" not in out
    assert re.search(r"^# log-prob paths \(plain rollouts\): full: training passes [\d.]+ ms, policy pass [\d.]+ ms, "
                     r"saved [\d.]+ [KMG]?i?B$", out, re.M)


def _fake_wheel(path: Path) -> Path:
    """A bitsandbytes-shaped wheel: Python files, three native libraries, metadata, a RECORD."""
    import zipfile

    from bench.gpu_kit import record_line

    files = {"bitsandbytes/__init__.py": b"__version__ = '0.0'\n",
             "bitsandbytes/libbitsandbytes_cpu.so": b"cpu" * 10,
             "bitsandbytes/libbitsandbytes_cuda118.so": b"118" * 1000,
             "bitsandbytes/libbitsandbytes_cuda130.so": b"130" * 100,
             "bitsandbytes-0.0.dist-info/METADATA": b"Name: bitsandbytes\nVersion: 0.0\n"}
    rows = [record_line(n, d) for n, d in files.items()] + ["bitsandbytes-0.0.dist-info/RECORD,,"]
    wheel = path / "bitsandbytes-0.0-py3-none-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("bitsandbytes-0.0.dist-info/RECORD", "\n".join(rows) + "\n")
    return wheel


def test_gpu_kit_trims_a_wheel_and_rewrites_its_record(tmp_path):
    """bench/gpu_kit.sh's repacking: only the named libraries stay, the RECORD matches every
    file (what pip checks), a tampered file is caught, a library the wheel lacks is one line."""
    import zipfile

    from bench.gpu_kit import check_wheel

    src = _fake_wheel(tmp_path)
    out = cli("bench.gpu_kit", str(src), str(tmp_path / "kit"), "--keep-lib", "cuda130", "--keep-lib", "cpu")
    assert re.search(r"^summary: .*bitsandbytes-0.0-py3-none-manylinux_2_24_x86_64.whl .* 4 files, RECORD checked; "
                     r"libraries kept: cuda130, cpu\)$", out, re.M), out
    kit = tmp_path / "kit" / src.name
    with zipfile.ZipFile(kit) as z:
        assert sorted(n.rsplit("/", 1)[1] for n in z.namelist() if n.endswith(".so")) == [
            "libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so"]
    assert check_wheel(kit) == 4
    tampered = tmp_path / "tampered.whl"
    with zipfile.ZipFile(kit) as zin, zipfile.ZipFile(tampered, "w") as zout:
        for n in zin.namelist():
            zout.writestr(n, b"changed" if n.endswith("__init__.py") else zin.read(n))
    with pytest.raises(ValueError, match="__init__.py does not match its RECORD row"):
        check_wheel(tampered)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_kit", str(src), str(tmp_path / "k2"), "--keep-lib", "cuda999"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "no libbitsandbytes_cuda999 in the wheel; it has ['cpu', 'cuda118', 'cuda130']" in proc.stderr


def test_decode_counts():
    """bench.decode_ops counts the operators of one decoded token on the three paths; the counts are
    deterministic, so the smoke test holds their structure: every path dispatches some decoder work
    per layer, the merged copy has no LoRA branch, and our two paths sync once per token."""
    out = cli("bench.decode_ops", "--quick")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(plain|merged|generate)\s+per layer\s+([\d,]+)\s", out, re.M)}
    assert set(rows) == {"plain", "merged", "generate"} and all(int(v.replace(",", "")) > 0 for v in rows.values())
    assert re.search(r"^# merged: host syncs per token: _local_scalar_dense 1;", out, re.M)
    lora = re.search(r"^\s*merged\s+per layer(?:\s+[\d,.]+){3}\s+([\d,.]+)\s", out, re.M)  # ops, attention, MLP, LoRA
    assert lora and lora.group(1) == "0"
    assert re.search(r"^summary: operators per decoded token: tiny plain [\d,]+, merged [\d,]+, generate [\d,]+$",
                     out, re.M)


def test_decode_counts_one_grpo_step():
    out = cli("bench.decode_ops", "--step", "--step-B", "1", "--step-tokens", "3")
    stages = re.findall(r"^\s*(prompts|sampling|rewards|logp \(grad\)|loss|backward|optimizer|step)\s+([\d,]+)\s", out, re.M)
    assert sorted(s for s, _ in stages) == sorted(["prompts", "sampling", "rewards", "logp (grad)", "loss", "backward",
                                                   "optimizer", "step"])
    counts = {s: int(n.replace(",", "")) for s, n in stages}
    assert counts["backward"] > 0 and counts["step"] == sum(v for k, v in counts.items() if k != "step")
    assert re.search(r"^summary: operators in one GRPO step of the embedded default: sampling [\d,]+, ", out, re.M)


VS_TRL_TINY = ("--B", "1", "--G", "2", "--max-new-tokens", "4", "--rounds", "1", "--warmup", "0")


def vs_trl_row(out: str, side: str) -> list[float]:
    """A side's row of bench.vs_trl's table: steps, the step's median, then the parts' medians."""
    row = re.search(rf"^\s*{side}\s+(\d+)\s+([\d.]+) \[[\d.]+-[\d.]+\]((?:\s+-?[\d.]+){{6}})\s+(\d+)$", out, re.M)
    assert row, f"no {side} row in:\n{out}"
    return [float(row.group(1)), float(row.group(2)), *map(float, row.group(3).split()), float(row.group(4))]


def test_vs_trl_ours_only():
    out = cli("bench.vs_trl", "--ours-only", *VS_TRL_TINY)
    steps, step, gen, rewards, logp, backward, opt, other, tokens = vs_trl_row(out, "ours")
    assert steps == 1 and gen > 0 and logp > 0 and backward > 0 and 2 <= tokens <= 8  # 2 rows of 1-4 tokens
    assert abs(step - (gen + rewards + logp + backward + opt + other)) < 0.005  # the parts add up (rounding)
    assert re.search(r"^summary: our step [\d.]+ s \(median\), TRL not run$", out, re.M)


def trl_path() -> str:
    """The folder holding trl, or a skip where TRL is not importable (it is never a dependency)."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("trl not importable: pip install --no-deps --target DIR trl==1.16.*; run with PYTHONPATH=DIR")
    return str(Path(spec.origin).parents[1])


def test_vs_trl_against_trl():
    """Both sides at tiny sizes, each in its worker process, the allocator as each side's users run it."""
    out = cli("bench.vs_trl", *VS_TRL_TINY, "--allocator", "default", path=trl_path(), timeout=600)
    ours, trl = vs_trl_row(out, "ours"), vs_trl_row(out, "trl")
    assert ours[0] == trl[0] == 1 and trl[2] > 0 and trl[4] > 0
    assert re.search(r"^# trl [\d.]+, peft [\d.]+; glibc malloc tuned: ours True, TRL False$", out, re.M)
    assert re.search(r"^summary: TRL step / our step = [\d.]+x \(medians [\d.]+ s / [\d.]+ s; per round [\d.]+x\)",
                     out, re.M)


VS_TRL_QWEN7B = ("--shape", "qwen7b", "--layers", "1", "--vision-layers", "1", "--vocab", "1024", "--image-px", "56",
                 "--G", "2", "--max-new-tokens", "2", "--rounds", "1", "--warmup", "0")


def test_vs_trl_qwen7b_ours_only(tmp_path):
    """The 7B's widths, one layer each, a small vocabulary: built, saved, loaded; every row the full budget."""
    out = cli("bench.vs_trl", "--ours-only", *VS_TRL_QWEN7B, "--model-cache", str(tmp_path))
    steps, step, gen, rewards, logp, backward, opt, other, tokens = vs_trl_row(out, "ours")
    assert steps == 1 and gen > 0 and logp > 0 and backward > 0 and tokens == 4  # 2 rows x 2 tokens, no stop
    assert "7B's widths, 1 LM + 1 vision layers, vocabulary 1,024, 56 px, our rollout plain, B=1 x G=2" in out
    assert (tmp_path / "qwen7b-1x1-v1024" / "config.json").exists()


def test_vs_trl_qwen7b_against_trl(tmp_path):
    """Both sides on the same saved 7B-shaped model: equal completion tokens (lengths forced)."""
    out = cli("bench.vs_trl", *VS_TRL_QWEN7B, "--model-cache", str(tmp_path), path=trl_path(), timeout=600)
    ours, trl = vs_trl_row(out, "ours"), vs_trl_row(out, "trl")
    assert ours[-1] == trl[-1] == 4 and trl[1] > 0
    assert "glibc malloc tuned: ours True, TRL True" in out


def test_vs_trl_sweep_ours_only(tmp_path):
    """--sweep G with our side alone: a point per value in the JSON, the shared prefix's prediction, a PNG."""
    import json

    from PIL import Image

    out = cli("bench.vs_trl", "--ours-only", *VS_TRL_TINY, "--sweep", "G", "--sweep-values", "2,3",
              "--out", str(tmp_path))
    data = json.loads((tmp_path / "vs_trl_G.json").read_text())
    assert [p["value"] for p in data["points"]] == [2, 3] and data["allocator"] == "equal"
    for p in data["points"]:
        assert p["ours"]["step"] > 0 and p["prompt_tokens"] > 0 and "ratio" not in p
        P, T, G = p["prompt_tokens"], p["completion_tokens_per_row"], p["G"]
        assert abs(p["predicted_ratio"] - G * (P + T) / (P + G * T)) < 1e-9
    assert Image.open(tmp_path / "vs_trl_G.png").size[0] > 0
    assert re.search(r"^summary: sweep G: 2: ours [\d.]+ s \(prefix predicts [\d.]+x\); 3: ", out, re.M)


def test_vs_trl_sweep_prediction():
    from bench.vs_trl_sweep import image_px, predicted_ratio

    assert predicted_ratio(300, 100, 1) == 1.0  # one row: nothing shared
    assert predicted_ratio(0, 100, 8) == 1.0  # no prompt: nothing to share
    assert abs(predicted_ratio(320, 128, 8) - 8 * 448 / (320 + 8 * 128)) < 1e-12
    assert [image_px(v) for v in (64, 256, 1024)] == [224, 448, 896]


def test_vs_trl_errors_are_one_line(monkeypatch):
    from bench import vs_trl

    with pytest.raises(SystemExit, match=r"^--G 1: must be >= 2"):
        vs_trl.main(["--ours-only", "--G", "1"])
    with pytest.raises(SystemExit, match=r"^--image-px 50: must be a multiple of 28"):
        vs_trl.main(["--ours-only", "--shape", "qwen7b", "--image-px", "50"])
    with pytest.raises(SystemExit, match=r"^--sweep visual: only with --shape qwen7b"):
        vs_trl.main(["--ours-only", "--sweep", "visual"])
    monkeypatch.setitem(sys.modules, "trl", None)  # import trl now raises ImportError
    with pytest.raises(SystemExit, match=r"^TRL is not importable .*pip install --no-deps --target DIR"):
        vs_trl.main([])


def test_collapse(tmp_path):
    """bench.collapse on a 20-row clock set, one arm, two steps a phase: it trains, traces, prints its
    tables; a second call resumes (nothing retrained); a bad arm is one line."""
    assert subprocess.run([sys.executable, "-m", "data.clock", "--out", str(tmp_path / "clock"), "--n", "20"],
                          cwd=ROOT, capture_output=True).returncode == 0
    args = ["--data", str(tmp_path / "clock"), "--out", str(tmp_path / "out"), "--arms", "default", "--seeds", "0",
            "--samples", "1", "--trainer-args", "--A.phase.steps 1 --B.phase.steps 1 --run.eval_size 2 "
            "--sampling.G 2 --model.device cpu"]
    out = cli("bench.collapse", *args)
    assert "  training default seed 0 ..." in out
    assert re.search(r"^test rows: 2; chance \(the most common gold answer's share\) [01]\.\d{3}; ", out, re.M)
    assert re.search(r"^\| default \| 0 \| [01]\.\d{3} \|  \| [+-]\d\.\d{3} \| \d\.\d{3} \| ", out, re.M)
    assert re.search(r"^\| base \|  \|  \|  \|  \| \d\.\d{3} \| ", out, re.M)
    assert re.search(r"^\| B:1 \| \d\.\d{3} \| \d\.\d{3} \| \d\.\d{2} \| 1\.0 \| ", out, re.M)
    assert (tmp_path / "out" / "summary.md").read_text().strip() == out[out.index("## bench.collapse"):].strip()
    again = cli("bench.collapse", *args)
    assert "training" not in again and again.endswith(out[out.index("test rows"):])
    proc = subprocess.run([sys.executable, "-m", "bench.collapse", *args[:4], "--arms", "nope"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "'nope': nope unknown" in proc.stderr


def test_own_sets_and_grad_snr(tmp_path):
    """bench.own_sets writes a set the trainer reads (polygons: no scikit-learn needed), and
    bench.grad_snr measures two GRPO batches' gradients at a 2-step warm-up on it."""
    out = cli("bench.own_sets", "polygons", str(tmp_path / "poly"), "--n", "40")
    assert "wrote 40 polygons rows" in out and len((tmp_path / "poly" / "data.jsonl").read_text().splitlines()) == 40
    run = tmp_path / "run"
    cli("grpo.train", "--phase", "warmup", "--run.data", str(tmp_path / "poly"), "--run.run_dir", str(run),
        "--warmup.phase.steps", "2", "--warmup.phase.prompts_per_step", "4", "--run.eval_size", "2",
        "--run.test_per_stage", "0")
    out = cli("bench.grad_snr", str(run), "--data", str(tmp_path / "poly"), "--batches", "2", "--prompts", "2",
              "--G", "2")
    assert re.search(r"^summary: signal share [0-9.]+ \(noise alone 0\.707\), cosine -?[0-9.]+", out, re.M), out


def test_tower_probe(tmp_path):
    """bench.tower_probe on a small polygons set: its table row and summary line."""
    cli("bench.own_sets", "polygons", str(tmp_path / "poly"), "--n", "30")
    out = cli("bench.tower_probe", str(tmp_path / "poly"), "--steps", "5")
    row = next(line for line in out.splitlines() if line.startswith(str(tmp_path / "poly")))
    train, test, classes, chance, probe, shuffled = row.split()[1:]
    assert (int(train), int(test), int(classes)) == (27, 3, 6) and all(0 <= float(v) <= 1 for v in (chance, probe, shuffled))
    assert "summary: 1 sets probed on tiny's frozen merged visual tokens" in out


def test_tower_probe_quantities():
    """bench.tower_probe --quantities at a tiny size: one row per (family, quantity) with enough
    figures, counts that add up, and a summary line; no set and no --quantities is one usage error."""
    out = cli("bench.tower_probe", "--quantities", "40", "--min-rows", "4", "--steps", "3")
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+[123] ", line)]
    assert rows and {r[0] for r in rows} <= {"1", "2", "3"}
    for r in rows:  # stage family quantity... train test classes chance probe
        train, test, classes = int(r[-5]), int(r[-4]), int(r[-3])
        assert train >= 4 and test >= 1 and classes >= 1 and 0 <= float(r[-2]) <= 1 and 0 <= float(r[-1]) <= 1
    assert f"summary: {len(rows)} quantities probed on tiny's frozen merged visual tokens" in out
    proc = subprocess.run([sys.executable, "-m", "bench.tower_probe"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "name at least one own-data directory, or --quantities N" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bench.tower_probe", "--quantities", "-3"], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "--quantities -3 / --min-rows 40: N must be >= 0" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bench.tower_probe", "--quantities", "8", "--image-size", "20"],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "--image-size 20: the curriculum draws its figures at 32 px or more" in proc.stderr


def test_tower_probe_quantities_at_another_image_size(monkeypatch):
    """--image-size draws the curriculum's figures at that size (a candidate base built at it)."""
    import bench.tower_probe as tower_probe
    import data.synthetic

    sizes = []
    real = data.synthetic.generate
    monkeypatch.setattr(data.synthetic, "generate", lambda *a: sizes.append(a[-1]) or real(*a))
    assert tower_probe.main(["--quantities", "6", "--min-rows", "2", "--steps", "2", "--image-size", "140"]) == 0
    assert sizes == [140] * 6  # train and test of each of the three stages


def test_misreads(tmp_path):
    """bench.misreads on a report of four known answers to synthetic test figures: one right, one
    misread ("red circles: 2" where the figure has 1, the sum right on it), one wrong plan (every
    reading right, combined wrongly) and one arithmetic slip (not a misread); a run without a
    report is one usage error."""
    from data.contract import format_response, is_exact, parse_response
    from data.synthetic import generate
    from eval.reasoning import completion_reasoning

    ex = generate("test", 1, 1, 0)[0]
    assert ex.metadata["family"] == "scene_count" and [i.value for i in ex.intermediates] == ["1", "2", "2"], ex.reasoning
    names = [i.name for i in ex.intermediates]  # red circles, blue triangles, orange squares
    texts = [format_response(ex.reasoning, ex.answer),
             format_response(f"{names[0]}: 2. {names[1]}: 2. {names[2]}: 2. 2 + 2 + 2 = 6.", "6"),
             format_response(f"{names[0]}: 1. {names[1]}: 2. {names[2]}: 2. 1 + 2 = 3.", "3"),
             format_response(f"{names[0]}: 1. {names[1]}: 2. {names[2]}: 2. 1 + 2 + 2 = 6.", "6")]
    # a computed quantity, written "name: 5 x 3 = 15": its value is the clause's result, so only
    # the misread cut corner is charged
    grid = generate("test", 3, 1, 0)[0]
    assert grid.metadata["family"] == "grid_geometry" and grid.reasoning.startswith("full rectangle: 5 x 3 = 15. "
                                                                                  "cut corner: 2 x 2 = 4."), grid.reasoning
    answers = [(ex, t) for t in texts] + [(grid, format_response("full rectangle: 5 x 3 = 15. cut corner: 2 x 3 = 6. "
                                                                 "15 - 6 = 9.", "9"))]
    report = tmp_path / "run" / "report"
    report.mkdir(parents=True)
    with open(report / "samples_B_latest.jsonl", "w") as f:
        for example, text in answers:
            answer = parse_response(text).answer
            f.write(json.dumps({"pid": example.pid, "text": text, "parseable": answer is not None,
                                "exact": is_exact(answer, example.answer),
                                **completion_reasoning(text, example.answer, example.key_steps)}) + "\n")
    out = cli("bench.misreads", str(tmp_path / "run"))
    assert out.startswith("misread: 3 of 5 answers (60.0%); charged by name 2, by value 0, plan 1"), out
    assert re.search(r"^grid_geometry\s+cut corner\s+1\s+1\s+100\.0%$", out, re.M), out
    assert re.search(r"^scene_count\s+red circles\s+1\s+4\s+25\.0%$", out, re.M), out  # 4 answers needed it
    assert re.search(r"^scene_count\s+\(plan\)\s+1\s+0\s+-$", out, re.M), out
    assert re.search(r"^1\s+4\s+2\s+50\.0%$", out, re.M), out  # stage 1: 4 answers, 2 misread
    proc = subprocess.run([sys.executable, "-m", "bench.misreads", str(tmp_path / "none")], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "does not exist: run the phase to its end-of-run report" in proc.stderr


def test_own_sets_digit_sum_reasoning(monkeypatch, tmp_path):
    """bench.own_sets digit_sum --reasoning: the same rows and images, each with its worked
    reasoning, whose readings add up to the gold, and its three steps as key_steps that the step
    reward finds in it; --reasoning on another family is one usage error.
    (The scans are stubbed: scikit-learn is not a test dependency.)"""
    import numpy as np

    import bench.own_sets as own_sets
    from data.contract import parse_response
    from data.jsonl import load_jsonl
    from grpo.rewards.steps import step_rar

    scans = (np.random.default_rng(0).integers(0, 17, (30, 8, 8)).astype(float), np.arange(30) % 10)
    monkeypatch.setattr(own_sets, "_scans", lambda: scans)
    plain, worked = own_sets.digit_sum(12, 0), own_sets.digit_sum(12, 0, reasoning=True)
    for (a, img_a), (b, img_b) in zip(plain, worked):
        assert "reasoning" not in a and {k: v for k, v in b.items() if k not in ("reasoning", "key_steps")} == a
        assert img_a.tobytes() == img_b.tobytes()
        m = re.fullmatch(r"left digit: (\d)\. right digit: (\d)\. (\d) \+ (\d) = (\d+)\.", b["reasoning"])
        assert m and m[1] == m[3] and m[2] == m[4] and int(m[1]) + int(m[2]) == int(m[5]) == int(b["answer"])
        assert b["key_steps"] == [[f"left digit: {m[1]}"], [f"right digit: {m[2]}"], [f"{m[1]} + {m[2]} = {m[5]}"]]
        text = f"<REASONING>{b['reasoning']}</REASONING><SOLUTION>{b['answer']}</SOLUTION>"
        assert step_rar(text, parse_response(text), b["key_steps"], b["answer"]) == pytest.approx(1.1)
    own_sets.write("digit_sum", tmp_path / "w", 12, 0, reasoning=True)  # the loader carries them to the reward
    loaded = load_jsonl(tmp_path / "w")
    assert [ex.key_steps for ex in loaded] == [row["key_steps"] for row, _ in worked]
    proc = subprocess.run([sys.executable, "-m", "bench.own_sets", "polygons", str(tmp_path / "p"), "--reasoning"],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "--reasoning is for digit_sum" in proc.stderr
