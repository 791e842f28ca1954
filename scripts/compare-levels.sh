#!/usr/bin/env bash
# docs/benchmarks.md's per-ISA-level rows: tokenmill (default Q4_1 weights, and bfloat16 weights) against
# llama.cpp on the same Q4_1 GGUF, at one instruction-set level, paired: both servers run at once and
# their runs alternate A B B A with prompts that differ per pair (the same for both engines).
#
# Usage: [CONFIGS="default bf16"] scripts/compare-levels.sh LEVEL [OUT_DIR]
#   LEVEL  a tokenmill level (`tokenmill env` lists this CPU's): avx2, avx512, avx512_vnni, ...; tokenmill
#          runs with TOKENMILL_CPU_CAPABILITY=LEVEL, which also caps oneDNN and MKL (ONEDNN_MAX_CPU_ISA,
#          MKL_ENABLE_INSTRUCTIONS), so an AMX machine measures the lower levels too. llama.cpp is built for the host (its own dispatch):
#          cap it yourself with a build of the same level where the host is above it.
# Needs the peers' start scripts (PEERS, default ../shared/peers) and tokenmill on PATH; about 10 minutes.
set -uo pipefail
LEVEL=${1:?usage: compare-levels.sh LEVEL [OUT_DIR]}
OUT=${2:-bench-levels-$LEVEL}
PEERS=${PEERS:-$(cd "$(dirname "$0")/../.." && pwd)/shared/peers}
mkdir -p "$OUT"
# shellcheck source=paired-runs.sh
source "$(dirname "$0")/paired-runs.sh"
trap 'kill $(jobs -p) 2>/dev/null' EXIT

BURST=(--num-prompts 64 --max-concurrency 16 --input-len 256 --output-len 128)
SINGLE=(--num-prompts 8 --max-concurrency 1 --input-len 128 --output-len 128)
WARM=(--num-prompts 8 --max-concurrency 8 --input-len 64 --output-len 16)

"$PEERS/start-llama-server.sh" 8035 >"$OUT/llama.log" 2>&1 & LL=$!
for config in ${CONFIGS:-default bf16}; do
  args=(); [ $config = bf16 ] && args=(--quantization none --dtype bfloat16)
  TOKENMILL_CPU_CAPABILITY=$LEVEL tokenmill serve "${args[@]}" --port 8034 \
    --host 127.0.0.1 --kv-cache-memory-gb 4 --served-model-name smollm2 >"$OUT/tm-$config.log" 2>&1 & TM=$!
  wait_up 8034 && wait_up 8035 || exit 1
  grep -m1 "kernels:" "$OUT/tm-$config.log"
  run 8034 smollm2 "$TM" "tm-$config-warmup" 300 "${WARM[@]}"; run 8035 default "$LL" "llama-warmup-$config" 300 "${WARM[@]}"
  pairs 8034 smollm2 "$TM" "tm-$config" 8035 default "$LL" "llama-$config" burst 311 "${BURST[@]}"
  pairs 8034 smollm2 "$TM" "tm-$config" 8035 default "$LL" "llama-$config" single 331 "${SINGLE[@]}"
  kill "$TM"; wait "$TM" 2>/dev/null; sleep 3
done

python3 - "$OUT" <<'EOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
def figure(name, key):
    runs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-[12].json"))]
    values = [run["total_tokens_per_s"] if key == "tok/s" else run["tpot_ms"]["p50"] for run in runs]
    return statistics.median(values) if values else float("nan")
for config in sorted({p.name.split("-")[1] for p in out.glob("tm-*-[12].json")}):
    for row, key in (("burst", "tok/s"), ("single", "tpot")):
        tm, ll = figure(f"tm-{config}-{row}", key), figure(f"llama-{config}-{row}", key)
        print(f"{config:8} {row:7} {key:6} tokenmill {tm:9.2f}  llama.cpp {ll:9.2f}  ratio {tm / ll:5.2f}")
EOF
