#!/usr/bin/env bash
# The project installed where users already work: beside a current Hugging Face stack.
#
#   bash tests/coexist.sh            # venv in a fresh temporary folder, removed at the end
#   COEXIST_VENV=/path bash tests/coexist.sh   # reuse (or create) that venv
#
# 1. a venv with torch (the CPU build) and the newest trl, peft and transformers (which brings
#    Hugging Face's `kernels` package: transformers >= 5.25 requires it);
# 2. the project built as a wheel (`pip wheel`, not editable) and installed there: nothing
#    already installed may change version, `pip check` must be clean, the wheel must install
#    no top-level `kernels`, `bench` or `tests`, and the hub's `kernels` still imports as itself;
# 3. from a folder that is not the checkout: a real 1-step phase A run, `python -m
#    grpo.evaluate` of its checkpoint and `python -m grpo.export` of it as a PEFT adapter,
#    each ending rc 0 (the shipped model comes from the wheel, checked against SHA256SUMS);
# 4. the suite's fast part run with that venv's python from the checkout.
# The commands run with HF_HUB_OFFLINE=1 and the tests without it: bitsandbytes' attempt to
# fetch a CPU kernel through `kernels` fails either way here, and must stay off the console.
# pip's cache makes a second run quick (the first downloads the HF stack, ~100 MB). tests/
# test_coexistence.py runs this script, so the README's test command (and CI) runs it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/vlgrpo_coexist.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
VENV=${COEXIST_VENV:-$WORK/venv}
HF_STACK="transformers trl peft kernels"
FAST_TESTS="tests/test_package_names.py tests/test_model.py tests/test_logprobs.py tests/test_lora_quant.py
  tests/test_export.py tests/test_sampler.py"
t0=$SECONDS
say() { echo "== coexist [$((SECONDS - t0)) s] $*"; }
quiet_pip() { "$PY" -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || true; [ "${PIPESTATUS[0]}" = 0 ]; }

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
quiet_pip install -q --upgrade pip
quiet_pip install -q "torch==2.13.0"
quiet_pip install -q $HF_STACK pytest
quiet_pip uninstall -q -y vlgrpo  # a reused venv: the wheel below is installed afresh, with its dependencies
"$PY" -m pip freeze --exclude-editable | grep -v "^vlgrpo" | sort > "$WORK/before.txt"
say "HF stack: $(grep -iE '^(torch|transformers|trl|peft|kernels)==' "$WORK/before.txt" | tr '\n' ' ')"

quiet_pip wheel -q --no-deps -w "$WORK/wheel" "$ROOT"
WHEEL=$(ls "$WORK"/wheel/vlgrpo-*.whl)
top=$("$PY" -c "import sys, zipfile; names = zipfile.ZipFile(sys.argv[1]).namelist()
print(' '.join(sorted({n.split('/')[0] for n in names if '.dist-info' not in n.split('/')[0]})))" "$WHEEL")
say "wheel $(basename "$WHEEL"): top-level $top"
[ "$top" = "data eval grpo grpo_infra grpo_kernels lora" ] || { echo "coexist: the wheel installs '$top'" >&2; exit 1; }
quiet_pip install -q "$WHEEL"
"$PY" -m pip freeze --exclude-editable | grep -v "^vlgrpo" | sort > "$WORK/after.txt"
# added packages are fine (bitsandbytes, for one); a changed version is a downgrade or upgrade
changed=$(comm -23 "$WORK/before.txt" "$WORK/after.txt")
[ -z "$changed" ] || { echo "coexist: installing the wheel changed these versions: $changed" >&2; exit 1; }
say "the wheel added $(comm -13 "$WORK/before.txt" "$WORK/after.txt" | tr '\n' ' ')and changed nothing"
"$PY" -m pip check
(cd "$WORK" && "$PY" -c "
import kernels, grpo_kernels, grpo
assert hasattr(kernels, 'get_kernel'), kernels.__file__   # Hugging Face's, not ours
assert 'site-packages' in grpo.__file__, grpo.__file__      # the wheel, not the checkout
print('kernels from', kernels.__file__)")

RUN="$WORK/outside/run"
mkdir -p "$WORK/outside"
cd "$WORK/outside"
export OMP_NUM_THREADS=1
HF_HUB_OFFLINE=1 "$PY" -m grpo.train --phase A --init base --phase.steps 1 --run.run_dir "$RUN" > "$WORK/train.log" 2>&1 \
  || { tail -20 "$WORK/train.log" >&2; exit 1; }
say "1-step phase A from outside the checkout: rc 0 ($(tail -1 "$WORK/train.log"))"
HF_HUB_OFFLINE=1 "$PY" -m grpo.evaluate --run-dir "$RUN" --limit 4 --no-image-control --out "$WORK/eval" A:latest > "$WORK/eval.log" 2>&1 \
  || { tail -20 "$WORK/eval.log" >&2; exit 1; }
HF_HUB_OFFLINE=1 "$PY" -m grpo.export --run-dir "$RUN" --peft "$WORK/peft" A:latest > "$WORK/export.log" 2>&1 \
  || { tail -20 "$WORK/export.log" >&2; exit 1; }
[ -s "$WORK/peft/adapter_model.safetensors" ] || { echo "coexist: export wrote no adapter" >&2; exit 1; }
! grep -l "kernels-community" "$WORK"/*.log || { echo "coexist: the hub-kernel notice reached the console" >&2; exit 1; }
say "evaluate and export from outside the checkout: rc 0"

cd "$ROOT"
env -u TRITON_INTERPRET "$PY" -m pytest -q -p no:cacheprovider $FAST_TESTS
say "done"
echo "summary: coexist passed in $((SECONDS - t0)) s"
