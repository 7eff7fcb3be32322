#!/usr/bin/env bash
# Both ends of the declared ranges, true: install a stack in a throwaway venv and run the
# suite's fast part there (or all of it).
#
#   bash bench/compat.sh [lowest]           # the lower bounds; then gpu.sh --dry-run with the GPU kit
#   bash bench/compat.sh newest             # the newest release of everything, HF stack included
#   bash bench/compat.sh newest --all       # ... and the whole suite, not its fast part
#   COMPAT_VENV=/path BASE_PYTHON=/path/to/python3.12 bash bench/compat.sh lowest
#   bash bench/compat.sh lowest --no-dry-run   # the test files only
#
# lowest: the GPU machine's own stack, and pyproject.toml's lower bounds are exactly it:
# Python 3.12, torch 2.11.0 (PyPI's +cu130 build, CUDA 13 libraries included: 4.9 GB in the
# venv), triton 3.6.0 (what that torch pins), transformers 5.17.0 (which needs tokenizers
# >= 0.23.1 and safetensors >= 0.8.0), numpy 1.26.4, pillow 10.4.0 and bitsandbytes 0.50.2
# from bench/gpu_kit/ (`pip install --no-index`, as gpu.sh does there; build it first with
# bash bench/gpu_kit.sh), then bash bench/gpu.sh --dry-run with that venv's python.
# newest: `python3` (BASE_PYTHON), and every dependency unpinned, with trl, peft and Hugging
# Face's `kernels` beside them, as a user's current environment has them. These machines cap
# torch at the releases on their disk (/etc/xdg/pip/constraints.txt); the cap is lifted for
# this venv (PIP_CONSTRAINT), so the newest torch comes from PyPI (its CUDA build, ~4 GB).
# The fast part: model, sampler, log-probs, kernels under the interpreter, quantisation,
# export, the step, the watchdog's two gloo ranks, the package names. Runs on the CPU.
set -u
cd "$(dirname "$0")/.."
MODE=lowest
DRY=1
ALL=0
for a in "$@"; do
  case "$a" in
    lowest|newest) MODE=$a ;;
    --no-dry-run) DRY=0 ;;
    --all) ALL=1 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "bench/compat.sh: unknown argument '$a'; use lowest | newest, --no-dry-run, --all" >&2; exit 2 ;;
  esac
done
VENV=${COMPAT_VENV:-/tmp/vlgrpo_compat_$MODE}
LOWEST="torch==2.11.0 triton==3.6.0 transformers==5.17.0 tokenizers==0.23.1 safetensors==0.8.0 numpy==1.26.4 pillow==10.4.0"
# bitsandbytes comes from the kit: its version is the one gpu_kit.sh packs
TEST_ONLY="pytest peft"
FAST_TESTS="tests/test_config.py tests/test_model.py tests/test_sampler.py tests/test_logprobs.py
  tests/test_shared_prefix.py tests/test_policy_build.py tests/test_lora_quant.py tests/test_export.py
  tests/test_input_bounds.py tests/test_micro_batches.py tests/test_step.py tests/test_kernels_grpo_loss.py
  tests/test_kernels_logprob.py tests/test_lora.py tests/test_memory_plan.py tests/test_cuda_logic.py
  tests/test_collective_timeout.py tests/test_package_names.py"

if [ "$MODE" = lowest ]; then
  BASE_PY=${BASE_PYTHON:-python3.12}
  ls bench/gpu_kit/bitsandbytes-*.whl > /dev/null 2>&1 || { echo "bench/compat.sh: no bench/gpu_kit/; run bash bench/gpu_kit.sh first" >&2; exit 2; }
else
  BASE_PY=${BASE_PYTHON:-python3}
  DRY=0  # gpu.sh --dry-run checks the GPU machine's kit, which is the lowest stack
fi
command -v "$BASE_PY" > /dev/null || { echo "bench/compat.sh: no $BASE_PY here; set BASE_PYTHON" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$BASE_PY" -m venv "$VENV" || exit 1
PY="$VENV/bin/python"
t0=$SECONDS
if [ "$MODE" = lowest ]; then
  "$PY" -m pip install --quiet $LOWEST $TEST_ONLY 2>&1 | grep -v "^WARNING: Location"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "bench/compat.sh: pip could not install $LOWEST" >&2; exit 1; }
  "$PY" -m pip install --quiet --no-index --find-links bench/gpu_kit bitsandbytes || exit 1
else
  PIP_CONSTRAINT=/dev/null "$PY" -m pip install --quiet --upgrade torch triton transformers tokenizers safetensors \
    bitsandbytes pillow numpy trl peft kernels pytest 2>&1 | grep -v "^WARNING: Location"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "bench/compat.sh: pip could not install the newest stack" >&2; exit 1; }
  if [ "$ALL" = 1 ]; then  # the test extra (pyarrow, datasets, trackers...), the stack above kept
    PIP_CONSTRAINT=/dev/null "$PY" -m pip install --quiet -e ".[test]" 2>&1 | grep -v "^WARNING: Location"
  fi
fi
echo "== installed in $((SECONDS - t0)) s:"
"$PY" -c "
import importlib, platform
print('python', platform.python_version(), *(f'{m} {importlib.import_module(m).__version__}' for m in
      ('torch', 'triton', 'transformers', 'tokenizers', 'safetensors', 'numpy', 'PIL', 'bitsandbytes')))"
rc=0
t1=$SECONDS
[ "$ALL" = 1 ] && FAST_TESTS=""  # pytest's testpaths: the whole suite
env -u TRITON_INTERPRET OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES="" "$PY" -m pytest -q -p no:cacheprovider $FAST_TESTS || rc=1
echo "== test files: $((SECONDS - t1)) s, exit $rc"
if [ "$DRY" = 1 ]; then
  t2=$SECONDS
  PYTHON="$PY" bash bench/gpu.sh --dry-run || rc=1
  echo "== gpu.sh --dry-run: $((SECONDS - t2)) s"
fi
echo "summary: compat ($MODE declared stack) exit $rc"
exit $rc
