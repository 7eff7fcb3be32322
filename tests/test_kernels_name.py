"""Our top-level package `kernels` and the Hugging Face hub package of the same name.

transformers imports `kernels` whenever a distribution called `kernels` is installed, and from
this repository that import finds ours. The test fakes the hub package's metadata (a
dist-info folder on the path, nothing else) and checks that importing ours then stops with
the one line that says what to do, and that without the metadata it imports cleanly.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels(extra_path=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([str(extra_path)] if extra_path else []))
    return subprocess.run([sys.executable, "-c", "import kernels"], capture_output=True,
                          text=True, cwd=ROOT, env=env)


def test_hub_kernels_installed_stops_with_what_to_do(tmp_path):
    dist = tmp_path / "kernels-0.19.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    out = _import_kernels(tmp_path)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: the Hugging Face 'kernels' package 0.19.1 is installed")
    assert "transformers<5.25" in last and "pip uninstall -y kernels" in last


def test_without_the_hub_package_ours_imports():
    out = _import_kernels()
    assert out.returncode == 0, out.stderr
