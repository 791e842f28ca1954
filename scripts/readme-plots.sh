#!/usr/bin/env bash
# Regenerate the README's benchmark plots (docs/images/bench-serve/): serve the default model, load it
# with `tokenmill bench serve --plot-dir`, stop the server. Run from the repository after `make install`
# (`make readme-plots`); nothing else should run meanwhile, the figures are timings.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8765}
DIR=docs/images/bench-serve
mkdir -p "$DIR"
.venv/bin/tokenmill serve --port "$PORT" --host 127.0.0.1 >"$DIR/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
MODEL=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | .venv/bin/python -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
.venv/bin/tokenmill bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --dataset random \
  --num-prompts 64 --input-len 256 --output-len 128 --max-concurrency 16 --seed 0 \
  --goodput ttft:1000 tpot:100 --plot-dir "$DIR" --output-json "$DIR/summary.json"
rm -f "$DIR/server.log"
echo "plots in $DIR"
