#!/usr/bin/env bash
# Every GPU measurement of the project in one run: at most 7 minutes on one GPU, offline.
#
#   bash bench/gpu.sh              # on the GPU machine, with bench/gpu_kit/ carried in the tree
#   bash bench/gpu.sh --dry-run    # on a CPU: the same script at CPU-smoke sizes (checks it here)
#   bash bench/gpu.sh --parts step,sampler   # only these parts (e.g. to rerun one that failed)
#
# Before any part: the kit. bitsandbytes (and packaging, if the machine lacks it) from
# bench/gpu_kit/ (bash bench/gpu_kit.sh builds it where there is internet) with
#   pip install --no-index --find-links bench/gpu_kit --no-deps --target <a temporary folder>
# put first on PYTHONPATH: the machine's own torch, triton and transformers are used as they
# are and nothing installed there changes. Then `python -m bench.stack`: one line per
# runtime dependency, its version against pyproject.toml's range.
#
# Results: one log per part, smoke_<part>.log per smoke, stack.log, and summary.md (one row
# per part, written as each part ends; exit 1 when a part or a smoke failed) in $OUT/gpu_results if $OUT is set (the device tool
# brings $OUT back, also after a timeout), otherwise in bench/results/gpu_<date>/. Each
# benchmark prints its tables as it measures them, so a part cut short keeps what it measured.
#
# Parts, in order of value, each under its own timeout; the timeouts add up to the 420 s
# budget, so the run cannot pass 7 minutes even when every part runs to its limit:
#
#   part       GPU command                                                        timeout
#   preflight  the stack (above), then a smoke of every later part at its smallest    45 s
#              size, all at once, 30 s each (SMOKE_S): a part whose smoke fails is
#              skipped below, so one wrong thing costs seconds, not the run
#   tests      kernel tests with the COMPILED Triton kernels on CUDA tensors           85 s
#              (with TRITON_INTERPRET unset the test files import the compiled
#              kernels and put every tensor on cuda) + the CUDA-graph rollout tests
#   grpo_loss  python -m bench.grpo_loss --quick (eager vs Triton, no compile)         25 s
#   logprob    python -m bench.logprob --quick (eager vs Triton, no compile)           35 s
#   step       python -m bench.step   (Qwen2.5-VL-7B shapes, plain vs merged)          95 s
#   memory     python -m bench.memory --gpu-check: real 7B-shape GRPO steps (the       60 s
#              staged paper's setting first), torch.cuda.max_memory_allocated per
#              phase against the memory plan's prediction
#   sampler    python -m bench.sampler (tiny 112 px and a 90M model at 336 px)         30 s
#   compiled   torch.compile, the only part that compiles: bench.grpo_loss (1 compile)  45 s
#              and bench.logprob (fwd and fwd+bwd: 2) at one large shape; each
#              compile is printed as its first call's seconds, then the calls are timed
#                                                                           total  420 s
# Triton kernels compile on first use too (seconds each, cached for the later parts); the
# smoke compiles the ones at small shapes first. --dry-run gives every part 4x its timeout
# (a shared CPU at smoke sizes) and the whole run 4x the budget.
#
# Needs: python with CUDA torch, triton, transformers 5.x, tokenizers, safetensors, pillow,
# numpy, pytest (PYTHON=... picks the interpreter); bitsandbytes from the kit or installed.
# No hub access: every model is built locally (the tiny one is cached under $VLGRPO_CACHE or
# ~/.cache).
set -u

ALL_PARTS="preflight tests grpo_loss logprob step memory sampler compiled"
DRY_RUN=0
PARTS=$ALL_PARTS
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --parts) [ $# -ge 2 ] || { echo "bench/gpu.sh: --parts needs a comma-separated list of: ${ALL_PARTS// /,}" >&2; exit 2; }
             PARTS=${2//,/ }; shift ;;
    --parts=*) PARTS=${1#--parts=}; PARTS=${PARTS//,/ } ;;
    -h|--help) sed -n '2,48p' "$0"; exit 0 ;;
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
SCALE=1
[ "$DRY_RUN" = 1 ] && SCALE=4  # --dry-run: a shared CPU, every limit 4x
BUDGET=${BUDGET:-$((420 * SCALE))}  # seconds for everything, the kit and the smoke included (7 minutes on a GPU)
KIT=${KIT:-bench/gpu_kit}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a part killed by its timeout still leaves what it printed in its log
unset TRITON_INTERPRET KERNELS_BACKEND  # compiled kernels, chosen by device ("auto")

if [ "$DRY_RUN" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1  # force the CPU paths, even on a GPU machine
  SMOKE_S=${SMOKE_S:-240}  # a shared CPU: imports alone take seconds per process
else
  SMOKE_S=${SMOKE_S:-30}
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
} > "$SUMMARY"

# ---- the kit: bitsandbytes from bench/gpu_kit/, offline, into a folder of its own
SITE=$(mktemp -d "${TMPDIR:-/tmp}/vlgrpo_kit.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
t0=$SECONDS
if ls "$KIT"/bitsandbytes-*.whl > /dev/null 2>&1; then
  want="bitsandbytes"
  "$PY" -c "import packaging" 2>/dev/null || want="$want packaging"
  if "$PY" -m pip --version > /dev/null 2>&1; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$KIT" --no-deps \
      --target "$SITE" $want > "$RES/kit.log" 2>&1
    kit_rc=$?
  else  # no pip there: a wheel is a zip of the files site-packages holds
    kit_rc=0
    for w in $want; do
      "$PY" -m zipfile -e "$(ls "$KIT"/"$w"-*.whl | head -n 1)" "$SITE" >> "$RES/kit.log" 2>&1 || kit_rc=1
    done
  fi
  if [ "$kit_rc" = 0 ]; then
    export PYTHONPATH="$SITE:$PYTHONPATH"
    kit_line="kit: $want installed from $KIT with --no-index in $((SECONDS - t0)) s"
  else
    kit_line="kit: FAILED to install from $KIT (kit.log); the parts that quantise (step, memory) will fail"
  fi
elif "$PY" -c "import bitsandbytes" 2>/dev/null; then
  kit_line="kit: no $KIT/; using the bitsandbytes installed here"
else
  kit_line="kit: no $KIT/ and no bitsandbytes: run bash bench/gpu_kit.sh where there is internet and carry $KIT; step and memory will fail"
fi
echo "== $kit_line"
"$PY" -m bench.stack > "$RES/stack.log" 2>&1
stack_rc=$?
cat "$RES/stack.log"
{
  echo "$kit_line"
  echo
  echo '```'
  cat "$RES/stack.log"
  echo '```'
  echo
  echo "| part | exit | seconds | summary |"
  echo "|---|---|---|---|"
} >> "$SUMMARY"

selected() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
FAILED=0  # the exit code: 1 when a part (or a smoke) failed or timed out

# ---- the smoke: every later selected part at its smallest size, all at once
SMOKE_FAILED=""
# smoke PART COMMAND...: start it in the background (its pid in SMOKE_PIDS)
SMOKE_PIDS=""
smoke() {
  local part=$1
  shift
  selected "$part" || return 0
  timeout --kill-after=5 "$SMOKE_S" "$@" > "$RES/smoke_$part.log" 2>&1 &
  SMOKE_PIDS="$SMOKE_PIDS $part:$!"
}

preflight() {
  local t0=$SECONDS line="" entry part rc
  echo "== preflight: smoke of every later part (${SMOKE_S}s each, all at once)"
  smoke tests     "$PY" -m pytest -q --collect-only $KERNEL_TESTS
  smoke grpo_loss "$PY" -m bench.grpo_loss --quick --shape 8 64 --reps 1 --warmup 1
  smoke logprob   "$PY" -m bench.logprob --quick --shape 2 8 --vocab 1000 --hidden 64 --reps 1 --warmup 1
  smoke step      "$PY" -m bench.step --smoke
  smoke memory    "$PY" -m bench.memory --gpu-check --smoke --budget-s 20
  smoke sampler   "$PY" -m bench.sampler --model tiny --B 1 --G 2 --max-new-tokens 4 --repeats 1
  smoke compiled  "$PY" -m bench.grpo_loss --quick --compile --shape 8 64 --reps 1 --warmup 1
  for entry in $SMOKE_PIDS; do
    part=${entry%%:*}
    wait "${entry#*:}"
    rc=$?
    case "$rc" in
      0) line="$line $part ok;" ;;
      124) line="$line $part slow (over ${SMOKE_S}s, runs anyway);" ;;
      *) line="$line $part FAILED ($rc, smoke_$part.log: skipped);"
         SMOKE_FAILED="$SMOKE_FAILED $part"
         FAILED=1
         tail -n 5 "$RES/smoke_$part.log" ;;
    esac
  done
  [ "$stack_rc" = 0 ] || line="stack out of range (stack.log);$line"
  echo "==$line"
  echo "| preflight | $stack_rc | $((SECONDS - t0)) | smoke:${line:- nothing selected} |" >> "$SUMMARY"
}

# run PART TIMEOUT COMMAND...: log to $RES/<part>.log, one row in summary.md as soon as it ends
run() {
  local part=$1 limit=$(($2 * SCALE))
  shift 2
  selected "$part" || return 0
  local left=$((BUDGET - (SECONDS - START)))
  case " $SMOKE_FAILED " in *" $part "*)
    echo "| $part | skipped | 0 | its smoke failed: smoke_$part.log |" >> "$SUMMARY"
    echo "== $part: skipped (its smoke failed)"
    return ;;
  esac
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
  [ "$rc" = 0 ] || FAILED=1
  tail -n 40 "$RES/$part.log"
  # the part's one-line result: a benchmark's "summary:" line or pytest's final count
  local line
  line=$(grep -E '^summary:|passed|failed|error' "$RES/$part.log" | tail -n 1 | tr '|' '/' | cut -c1-300)
  [ "$rc" = 124 ] && line="TIMED OUT after ${limit}s (what it printed is in $part.log). $line"
  echo "| $part | $rc | $secs | $line |" >> "$SUMMARY"
}

KERNEL_TESTS="tests/test_kernels_grpo_loss.py tests/test_kernels_logprob.py tests/test_kernels_rms_norm.py tests/test_rollout_merged.py"
selected preflight && preflight
if [ "$DRY_RUN" = 1 ]; then
  run tests     85  "$PY" -m pytest -x $KERNEL_TESTS
  run grpo_loss 25  "$PY" -m bench.grpo_loss --quick --shape 8 64 --reps 3
  run logprob   35  "$PY" -m bench.logprob --quick --shape 2 8 --vocab 1000 --hidden 64 --reps 3
  run step      95  "$PY" -m bench.step --smoke
  run memory    60  "$PY" -m bench.memory --gpu-check
  run sampler   30  "$PY" -m bench.sampler --model tiny --B 1 --G 2 --max-new-tokens 4 --repeats 1
  run compiled  45  "$PY" -m bench.grpo_loss --quick --compile --shape 8 64 --reps 3
else
  run tests     85  "$PY" -m pytest -rs $KERNEL_TESTS
  run grpo_loss 25  "$PY" -m bench.grpo_loss --quick
  run logprob   35  "$PY" -m bench.logprob --quick
  run step      95  "$PY" -m bench.step
  run memory    60  "$PY" -m bench.memory --gpu-check --budget-s 40
  run sampler   30  "$PY" -m bench.sampler
  run compiled  45  bash -c '"$0" -m bench.grpo_loss --quick --compile --shape 64 4096 &&
                             "$0" -m bench.logprob --quick --compile --shape 32 1024' "$PY"
fi

echo >> "$SUMMARY"
echo "total: $((SECONDS - START)) s of a ${BUDGET} s budget" >> "$SUMMARY"
echo
cat "$SUMMARY"
echo "results in $RES"
exit $FAILED
