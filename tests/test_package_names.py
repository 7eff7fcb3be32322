"""What the project installs beside other projects: its import names, and the dependency check.

Hugging Face publishes a package importable as ``kernels`` (transformers >= 5.25 imports it);
ours is ``grpo_kernels``, so both import as themselves in one environment. The wheel's
top-level packages are the ones that run outside a checkout (no ``bench``, ``tests`` or
``kernels``), and the shipped model travels as package data. A release of a dependency
outside pyproject.toml's range stops the commands with one line before any model loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from grpo.deps import declared_requirements, release, satisfies, stack_problems

ROOT = Path(__file__).resolve().parents[1]
WHEEL_TOP_LEVEL = {"grpo", "grpo_infra", "grpo_kernels", "lora", "data", "eval"}


def _run(code_or_args: list[str], extra_path: Path | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(([str(extra_path)] if extra_path else []) + [str(ROOT)])
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def _fake_distribution(where: Path, name: str, version: str) -> None:
    dist = where / f"{name}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_hub_kernels_package_and_ours_import_side_by_side(tmp_path):
    """A stand-in for Hugging Face's `kernels` (its distribution metadata and a module with
    `get_kernel`, as transformers and bitsandbytes look for) on the path: both import, each
    as itself."""
    _fake_distribution(tmp_path, "kernels", "0.19.1")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("def get_kernel(repo_id, version=None):\n    return repo_id\n")
    out = _run(["-c", "import kernels, grpo_kernels.grpo_loss, grpo_kernels.logprob\n"
                      "print(kernels.get_kernel('hub'), grpo_kernels.grpo_loss.__name__)"], extra_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hub", "grpo_kernels.grpo_loss"]


def test_no_top_level_folder_shadows_the_hub_kernels_package():
    assert not (ROOT / "kernels").exists()
    assert (ROOT / "grpo_kernels" / "__init__.py").exists()


def test_the_wheel_installs_only_what_runs_outside_a_checkout():
    """pyproject.toml's package list, resolved the way setuptools resolves it: the top-level
    names are grpo, grpo_kernels, lora, data and eval, and the shipped model is package data."""
    from setuptools import find_packages

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = find_packages(str(ROOT), include=cfg["packages"]["find"]["include"])
    assert {p.split(".")[0] for p in packages} == WHEEL_TOP_LEVEL
    assert "grpo.model" in packages and "grpo_kernels" in packages
    assert cfg["package-data"]["grpo"] == ["tiny_model/*"]
    shipped = {p.name for p in (ROOT / "grpo" / "tiny_model").iterdir()}
    assert {"model.safetensors", "SHA256SUMS", "config.json", "tokenizer.json"} <= shipped


@pytest.mark.parametrize("version, spec, ok", [
    ("2.13.0+cpu", ">=2.11", True), ("2.15.0", ">=2.11", True), ("2.10.1", ">=2.11", False),
    ("5.25.0", ">=5.17,<6", True), ("5.17", ">=5.17,<6", True), ("6.0.0", ">=5.17,<6", False),
    ("5.16.1", ">=5.17,<6", False), ("5.25.0rc1", ">=5.25", True), ("1.26.4", ">=1.26.4", True),
    ("0.50.1", ">=0.50.2", False), ("3.9.0", "", True), ("2.0", "==2", True), ("2.0", "!=2.0.0", False),
])
def test_versions_compare_by_release(version, spec, ok):
    assert satisfies(version, spec) is ok


def test_release_numbers():
    assert release("2.13.0+cpu") == (2, 13) and release("5.25.0rc1") == (5, 25) and release("10.4") == (10, 4)


def test_a_malformed_specifier_names_itself():
    with pytest.raises(ValueError, match="'~=5.17'"):
        satisfies("5.25", "~=5.17")


def test_the_declared_ranges_are_pyproject_tomls():
    """Installed metadata (editable or wheel) or the checkout's file: the same list."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    got = dict(declared_requirements())
    assert set(got) == {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in deps}
    assert satisfies("5.17.0", got["transformers"]) and not satisfies("6.0", got["transformers"])


def test_this_environment_is_in_range():
    assert stack_problems() == []


def test_a_missing_package_and_an_old_one_each_get_their_fix():
    problems = stack_problems([("numpy", ">=99"), ("surely-not-installed-pkg", ">=1")])
    assert problems[0].startswith("numpy ") and "outside the range this project supports (numpy>=99)" in problems[0]
    assert problems[0].endswith("pip install 'numpy>=99'")
    assert problems[1] == ("surely-not-installed-pkg is not installed; this project needs surely-not-installed-pkg>=1: "
                           "pip install 'surely-not-installed-pkg>=1'")


@pytest.mark.parametrize("command", ["grpo.train", "grpo.evaluate", "grpo.export", "grpo.pretrain"])
def test_an_old_transformers_stops_each_command_with_one_line(tmp_path, command):
    """transformers 5.10's metadata ahead on the path: the command stops with one line and
    exit code 2 before it imports transformers (the real, newer one would import fine, so a
    check that ran after the imports would still be caught by the import count below)."""
    _fake_distribution(tmp_path, "transformers", "5.10.0")
    probe = ("import runpy, sys\n"
             f"sys.argv = ['{command}', '--help']\n"
             "try:\n"
             f"    runpy.run_module('{command}', run_name='__main__')\n"
             "finally:\n"
             "    print('transformers imported:', 'transformers' in sys.modules, file=sys.stderr)\n")
    out = _run(["-c", probe], extra_path=tmp_path, cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == ["error: transformers 5.10.0 is installed, outside the range this project supports "
                     "(transformers>=5.17,<6): pip install 'transformers>=5.17,<6'",
                     "transformers imported: False"], out.stderr
