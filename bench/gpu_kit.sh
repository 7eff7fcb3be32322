#!/usr/bin/env bash
# Build here (with internet) the wheelhouse the GPU machine lacks; carry it there in the working tree.
#
#   bash bench/gpu_kit.sh            # -> bench/gpu_kit/ (git-ignored), <= 40 MiB
#
# The GPU machine has torch 2.11 (+cu130), triton 3.6, transformers 5.17, safetensors,
# pillow, numpy and pytest, no bitsandbytes and no internet. The kit holds:
#   bitsandbytes $BNB_VERSION, trimmed to its CUDA 13.0 library (what torch +cu130 loads)
#                and its CPU library (so `bash bench/gpu.sh --dry-run` checks the same kit here)
#   packaging    (a bitsandbytes dependency; transformers needs it too, so it is usually there)
# transformers is not in it: the project runs on 5.17 (bench/compat.sh checks that stack).
# bench/gpu.sh installs the kit with `pip install --no-index --find-links bench/gpu_kit`
# before its first part when bitsandbytes is missing.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BNB_VERSION=${BNB_VERSION:-0.50.2}
KIT=${KIT:-bench/gpu_kit}
LIMIT_MIB=40

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# py3-none wheels: the same files for every Python 3; the platform is the GPU machine's
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_24_x86_64 \
  --python-version 3.12 --implementation py -d "$tmp" "bitsandbytes==$BNB_VERSION" "packaging>=20.9"
rm -rf "$KIT"
mkdir -p "$KIT"
"$PY" -m bench.gpu_kit "$tmp"/bitsandbytes-*.whl "$KIT" --keep-lib cuda130 --keep-lib cpu
cp "$tmp"/packaging-*.whl "$KIT"/
size=$(du -sk "$KIT" | cut -f1)
ls -l "$KIT"
if [ "$size" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "bench/gpu_kit.sh: the kit is $((size / 1024)) MiB, over the ${LIMIT_MIB} MiB it may take in the working tree" >&2
  exit 1
fi
echo "summary: kit in $KIT: $((size / 1024)).$(( (size % 1024) * 10 / 1024 )) MiB; carry this folder to the GPU machine with the working tree"
