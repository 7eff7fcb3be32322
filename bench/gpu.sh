#!/usr/bin/env bash
# Every GPU measurement of the project in one run, under 8 minutes on one GPU.
#
#   bash bench/gpu.sh              # on a CUDA machine: compiled-kernel tests + all benchmarks
#   bash bench/gpu.sh --dry-run    # on a CPU: the same parts at CPU-smoke sizes (checks the script)
#   bash bench/gpu.sh --parts step,sampler   # only these parts (e.g. to rerun one that failed)
#
# Results: one log per part and summary.md (exit code, seconds and the summary line of each
# part) in $OUT/gpu_results if $OUT is set (the device tool brings $OUT back), otherwise in
# bench/results/gpu_<date>/. Copy the tables into bench/RESULTS.md with the date and GPU.
#
# Parts, in order of value, each under its own timeout (a part that fails or times out is
# recorded and the next one runs; the whole script never exceeds BUDGET seconds):
#
#   part        GPU command                                                     timeout
#   env         nvidia-smi; torch / triton / transformers / bitsandbytes versions    15 s
#   tests       kernel tests with the COMPILED Triton kernels on CUDA tensors      120 s
#               (with TRITON_INTERPRET unset the test files import the compiled
#               kernels and put every tensor on cuda) + the CUDA-graph rollout tests
#   grpo_loss   python -m bench.grpo_loss --quick                                   45 s
#   logprob     python -m bench.logprob --quick                                     60 s
#   step        python -m bench.step   (Qwen2.5-VL-7B shapes, plain vs merged)     170 s
#   memory      python -m bench.memory --gpu-check: real 7B-shape GRPO steps (the   120 s
#               staged paper's setting, the qwen7b preset at its micro-batches of
#               32 rows and in one pass while time remains), torch.cuda.max_memory_allocated
#               per phase against the memory plan's prediction
#   sampler     python -m bench.sampler (tiny 112 px and a 90M model at 336 px)     60 s
#                                                                           total  590 s
# The timeouts add up to more than BUDGET: parts usually finish well inside theirs, and
# when they do not, the last ones are skipped (recorded as such) rather than overrunning.
#
# Needs: python with CUDA torch, triton, transformers 5.x, bitsandbytes, tokenizers,
# safetensors, pillow, numpy, pytest (PYTHON=... picks the interpreter). No hub access:
# every model is built locally (the tiny one is cached under $VLGRPO_CACHE or ~/.cache).
set -u

ALL_PARTS="env tests grpo_loss logprob step memory sampler"
DRY_RUN=0
PARTS=$ALL_PARTS
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --parts) [ $# -ge 2 ] || { echo "bench/gpu.sh: --parts needs a comma-separated list of: ${ALL_PARTS// /,}" >&2; exit 2; }
             PARTS=${2//,/ }; shift ;;
    --parts=*) PARTS=${1#--parts=}; PARTS=${PARTS//,/ } ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "bench/gpu.sh: unknown argument '$1'; use --dry-run, --parts LIST or nothing" >&2; exit 2 ;;
  esac
  shift
done
for part in $PARTS; do
  case " $ALL_PARTS " in
    *" $part "*) ;;
    *) echo "bench/gpu.sh: unknown part '$part' in --parts; use some of ${ALL_PARTS// /,}" >&2; exit 2 ;;
  esac
done
[ -n "${PARTS// /}" ] || { echo "bench/gpu.sh: --parts is empty; use some of ${ALL_PARTS// /,}" >&2; exit 2; }

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-470}  # seconds for all parts together (< 8 minutes)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a part killed by its timeout still leaves what it printed in its log
unset TRITON_INTERPRET KERNELS_BACKEND  # compiled kernels, chosen by device ("auto")

if [ "$DRY_RUN" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1  # force the CPU paths, even on a GPU machine
else
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "bench/gpu.sh: no CUDA device visible to $PY; run on a GPU machine, or use --dry-run to check the script here" >&2
    exit 2
  fi
fi

if [ -n "${OUT:-}" ]; then
  RES="$OUT/gpu_results"
else
  RES="bench/results/gpu_$(date +%Y%m%d_%H%M%S)"
fi
mkdir -p "$RES"
SUMMARY="$RES/summary.md"
START=$SECONDS
{
  echo "# bench/gpu.sh $( [ "$DRY_RUN" = 1 ] && echo '--dry-run (CPU-smoke sizes: timings meaningless)')"
  echo
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "| part | exit | seconds | summary |"
  echo "|---|---|---|---|"
} > "$SUMMARY"

# run PART TIMEOUT COMMAND...: log to $RES/<part>.log, one row in summary.md
run() {
  local part=$1 limit=$2
  shift 2
  case " $PARTS " in *" $part "*) ;; *) return ;; esac  # not selected by --parts
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 10 ]; then
    echo "| $part | skipped | 0 | budget of ${BUDGET}s used up |" >> "$SUMMARY"
    echo "== $part: skipped (budget used up)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $part (timeout ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$RES/$part.log" 2>&1
  local rc=$?
  local secs=$((SECONDS - t0))
  tail -n 40 "$RES/$part.log"
  # the part's one-line result: a benchmark's "summary:" line or pytest's final count
  local line
  line=$(grep -E '^summary:|passed|failed|error' "$RES/$part.log" | tail -n 1 | tr '|' '/' | cut -c1-300)
  [ "$rc" = 124 ] && line="TIMED OUT after ${limit}s. $line"
  echo "| $part | $rc | $secs | $line |" >> "$SUMMARY"
}

# timeout runs programs, not shell functions: the env part is a `bash -c` script ($0 = python)
ENV_INFO='command -v nvidia-smi > /dev/null && nvidia-smi || echo "no nvidia-smi"
"$0" -c "
import importlib, platform, torch
print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      \"device\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"cpu\")
for name in (\"triton\", \"transformers\", \"bitsandbytes\"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # report, do not fail: the later parts say what is missing
        print(name, \"unavailable:\", type(e).__name__, e)
print(\"summary: environment recorded\")
"'

KERNEL_TESTS="tests/test_kernels_grpo_loss.py tests/test_kernels_logprob.py tests/test_rollout_merged.py"
if [ "$DRY_RUN" = 1 ]; then
  run env       15  bash -c "$ENV_INFO" "$PY"
  run tests     120 "$PY" -m pytest -x $KERNEL_TESTS
  run grpo_loss 45  "$PY" -m bench.grpo_loss --quick --shape 8 64 --reps 3
  run logprob   60  "$PY" -m bench.logprob --quick --shape 2 8 --vocab 1000 --hidden 64 --reps 3
  run step      170 "$PY" -m bench.step --smoke
  run memory    120 "$PY" -m bench.memory --gpu-check
  run sampler   60  "$PY" -m bench.sampler --model tiny --B 1 --G 2 --max-new-tokens 4 --repeats 1
else
  run env       15  bash -c "$ENV_INFO" "$PY"
  run tests     120 "$PY" -m pytest -rs $KERNEL_TESTS
  run grpo_loss 45  "$PY" -m bench.grpo_loss --quick
  run logprob   60  "$PY" -m bench.logprob --quick
  run step      170 "$PY" -m bench.step
  run memory    120 "$PY" -m bench.memory --gpu-check --budget-s 75
  run sampler   60  "$PY" -m bench.sampler
fi

echo >> "$SUMMARY"
echo "total: $((SECONDS - START)) s of a ${BUDGET} s budget" >> "$SUMMARY"
echo
cat "$SUMMARY"
echo "results in $RES"
