#!/usr/bin/env bash
# docs/benchmarks.md's price of determinism: the batch-invariant default against --no-batch-invariant, in
# process (`tokenmill bench throughput`), at each instruction-set level asked, for the default Q4_1 weights
# and bfloat16 weights (`--quantization none`; float32 on a level without native bfloat16), on issue 40's
# workloads. The two modes alternate A B (B A with PAIRS=2), each pair on its own prompts.
#
# Usage: [CONFIGS="default bf16"] [ROWS="long burst single shared"] [PAIRS=1] scripts/determinism-price.sh OUT_DIR LEVEL...
#   LEVEL  a tokenmill level (`tokenmill env` lists this CPU's): TOKENMILL_CPU_CAPABILITY=LEVEL, which also
#          caps oneDNN. PyTorch's SDPA (the --no-batch-invariant prefill attention off AMX) keeps the host's
#          speed under the cap, so capped no-batch-invariant figures are flattered on an AMX host.
# Prints a table (median tok/s of each mode, their ratio; TTFT and TPOT p50 for `single`).
set -uo pipefail
OUT=${1:?usage: determinism-price.sh OUT_DIR LEVEL...}; shift
[ $# -gt 0 ] || { echo "name at least one level" >&2; exit 2; }
mkdir -p "$OUT"
declare -A ROW=(
  [long]="--num-prompts 8 --input-len 2048 --output-len 1"
  [burst]="--num-prompts 32 --max-num-seqs 16 --input-len 256 --output-len 64"
  [single]="--num-prompts 3 --max-num-seqs 1 --input-len 128 --output-len 128"
  [shared]="--dataset shared-prefix --num-prompts 32 --max-num-seqs 16 --prefix-len 512 --input-len 32 --output-len 16"
)
one() {  # level config row mode seed
  local args=(); [ "$2" = bf16 ] && args=(--quantization none)
  # shellcheck disable=SC2086
  TOKENMILL_CPU_CAPABILITY=$1 tokenmill bench throughput ${ROW[$3]} "${args[@]}" "--$4" --dataset-seed "$5" \
    --output-json "$OUT/$1-$2-$3-$4-$5.json" >/dev/null 2>&1 || echo "run $1 $2 $3 $4 $5 failed" >&2
}
for level; do
  for config in ${CONFIGS:-default bf16}; do
    for row in ${ROWS:-long burst single shared}; do
      for pair in $(seq 1 "${PAIRS:-1}"); do
        seed=$((100 * pair))
        if [ $((pair % 2)) = 1 ]; then order="batch-invariant no-batch-invariant"; else order="no-batch-invariant batch-invariant"; fi
        for mode in $order; do one "$level" "$config" "$row" "$mode" "$seed"; done
      done
      echo "done: $level $config $row" >&2
    done
  done
done

python3 - "$OUT" "$@" <<'PY'
import json, pathlib, statistics, sys
out, levels = pathlib.Path(sys.argv[1]), sys.argv[2:]
def runs(level, config, row, mode):
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{level}-{config}-{row}-{mode}-*.json"))]
print(f"{'level':12} {'weights':8} {'row':7} {'invariant tok/s':>16} {'not tok/s':>10} {'ratio':>6}   single: TTFT / TPOT p50 ms")
for level in levels:
    for config in ("default", "bf16"):
        for row in ("long", "burst", "single", "shared"):
            a, b = runs(level, config, row, "batch-invariant"), runs(level, config, row, "no-batch-invariant")
            if not a or not b:
                continue
            ta = statistics.median(r["total_tokens_per_s"] for r in a)
            tb = statistics.median(r["total_tokens_per_s"] for r in b)
            extra = ""
            if row == "single":
                med = lambda rs, key: statistics.median(r[key]["p50"] for r in rs)
                extra = (f"   {med(a, 'ttft_ms'):.0f} / {med(a, 'tpot_ms'):.2f}  vs  "
                         f"{med(b, 'ttft_ms'):.0f} / {med(b, 'tpot_ms'):.2f}")
            print(f"{level:12} {config:8} {row:7} {ta:16.1f} {tb:10.1f} {ta / tb:6.2f}{extra}")
PY
