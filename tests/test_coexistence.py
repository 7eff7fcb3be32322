"""The project beside a current Hugging Face stack, installed from its wheel (tests/coexist.sh).

The script builds a venv with the newest trl, peft and transformers (and so Hugging Face's
`kernels`), installs this project's wheel there without changing any installed version,
checks `pip check`, runs a 1-step phase A, an evaluation and an export from a folder outside
the checkout, and the suite's fast part with that venv. It needs the package index (pip's
cache makes a second run quick); its last line is the summary.
"""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_installs_and_runs_beside_the_newest_hf_stack():
    out = subprocess.run(["bash", str(ROOT / "tests" / "coexist.sh")], capture_output=True, text=True, timeout=1500)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    assert "summary: coexist passed" in out.stdout, tail
    assert "top-level data eval grpo grpo_infra grpo_kernels lora" in out.stdout, tail
