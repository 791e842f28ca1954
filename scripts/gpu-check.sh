#!/usr/bin/env bash
# Prove the GPU path on a GPU machine in one run (scripts/gpu_check.py says what it measures).
#
#   scripts/gpu-check.sh --prepare            here (with network): the wheels tokenmill needs that the GPU
#                                             image lacks (.whl/, for Python 3.12) and the tokenizer files
#                                             (.gpu-check/tokenizer); both folders are git-ignored, carried
#   scripts/gpu-check.sh OUT_DIR              on the GPU machine: install the carried wheels, run the check,
#                                             write OUT_DIR/gpu-check.json
#   scripts/gpu-check.sh --dry-run OUT_DIR    on CPU: the same plumbing at tiny shapes in Triton's interpreter
#   scripts/gpu-check.sh --prepare-before REV here: REV's src/ and gpu_check.py in .gpu-check/before (carried)
#   scripts/gpu-check.sh --paired OUT_DIR     on the GPU machine (or with --dry-run, here): the throughput step, this tree (after)
#                                             against .gpu-check/before, in the order A B B A; a table last
#
# The whole check is more than one device run holds (9 minutes): run it as three,
#   scripts/gpu-check.sh OUT_DIR --deadline 330 --skip kernels hf bf16 throughput quantized serve profile w4a16 fp8 fp8_kv moe batch_invariant
#                                             issue 58's sections (async scheduling) alone
#   scripts/gpu-check.sh OUT_DIR --deadline 330 --skip kernels hf bf16 throughput quantized serve profile async_identical async_decode serve_1b hf_compiled
#                                             issue 59's sections (formats: gpu_check_formats.py) alone
#   scripts/gpu-check.sh OUT_DIR --deadline 300 --skip async_identical async_decode serve_1b hf_compiled w4a16 fp8 fp8_kv moe batch_invariant
#                                             the others
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python

# every step but the throughput one (gpu_check.py --help names them)
PAIRED_SKIP="kernels hf bf16 quantized serve profile async_identical async_decode serve_1b hf_compiled w4a16 fp8 fp8_kv moe batch_invariant"
# what tokenmill imports that the GPU image ('cuda': torch, triton, transformers, numpy, httpx, ...) lacks
WHEELS="gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions opentelemetry-api uvicorn xgrammar apache-tvm-ffi cbor2 pyzmq msgspec compressed-tensors loguru"

if [ "${1:-}" = "--prepare" ]; then
  rm -rf .whl && mkdir -p .whl .gpu-check
  for name in $WHEELS; do
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$name"
  done
  PYTHONPATH=src:scripts $PY -c "
from pathlib import Path
from gpu_check import save_default_tokenizer
save_default_tokenizer(Path('.gpu-check/tokenizer'))"
  # the device gets a copy of the tree without git: the commit it checks goes along
  echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- src scripts || echo -dirty)" > .gpu-check/commit
  du -sh .whl .gpu-check
  echo "carry .whl and .gpu-check; run: scripts/gpu-check.sh \$OUT"
  exit 0
fi

if [ "${1:-}" = "--prepare-before" ]; then
  rev="${2:?usage: scripts/gpu-check.sh --prepare-before REV}"
  rm -rf .gpu-check/before && mkdir -p .gpu-check/before/.gpu-check
  git archive "$rev" src scripts/gpu_check.py | tar x -C .gpu-check/before
  git rev-parse "$rev" > .gpu-check/before/.gpu-check/commit
  du -sh .gpu-check/before
  exit 0
fi

if [ "${1:-}" = "--dry-run" ]; then
  shift
  exec env PYTHONPATH=src $PY scripts/gpu_check.py --dry-run "$@"
fi

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
tokenizer=()
[ -d .gpu-check/tokenizer ] && tokenizer=(--tokenizer .gpu-check/tokenizer)
export PYTHONUNBUFFERED=1
# a rerun starts from the last run's compiled kernels (copied to .gpu-check/triton-cache.tgz)
cache_dir=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -f .gpu-check/triton-cache.tgz ]; then mkdir -p "$cache_dir" && tar xzf .gpu-check/triton-cache.tgz -C "$cache_dir"; fi
site=${PYTHONPATH:-}
if [ "${1:-}" = "--paired" ]; then
  out="${2:?usage: scripts/gpu-check.sh --paired OUT_DIR [gpu_check.py options]}"
  shift 2
  [ -d .gpu-check/before ] || { echo "no .gpu-check/before: run --prepare-before REV here first" >&2; exit 2; }
  mkdir -p "$out"
  i=0
  for side in after before before after; do
    i=$((i+1)); root=.
    [ $side = before ] && root=.gpu-check/before
    PYTHONPATH=$root/src${site:+:$site} $PY $root/scripts/gpu_check.py "/tmp/gpu-pair-$i" "${tokenizer[@]}" \
      --skip $PAIRED_SKIP "$@" > "/tmp/gpu-pair-$i.log" 2>&1 \
      || { echo "run $i ($side) failed:"; tail -20 "/tmp/gpu-pair-$i.log"; }
    cp "/tmp/gpu-pair-$i/gpu-check.json" "$out/pair-$i-$side.json" 2>/dev/null || true
  done
  exec $PY scripts/gpu_check.py --paired-table "$out"
fi
out="${1:?usage: scripts/gpu-check.sh OUT_DIR [gpu_check.py options]}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
export PYTHONPATH=src${site:+:$site}
rc=0
$PY scripts/gpu_check.py "$@" "${tokenizer[@]}" 2>&1 | tee "$out/gpu-check.log" || rc=$?
[ -d "$cache_dir" ] && tar czf "$out/triton-cache.tgz" -C "$cache_dir" . || true
exit $rc
