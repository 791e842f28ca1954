# Functions shared by compare-peers.sh, compare-levels.sh and compare-gemma3.sh (sourced; OUT must be
# set): wait for a server, run one `tokenmill bench serve`, and run a row as the pairs A B B A.
# Sourcing marks the start of the run, so `summarise` leaves out results of earlier runs in OUT.
touch "$OUT/.started"

wait_up() {  # port
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done
  echo "server on port $1 did not start" >&2; return 1
}

run() {  # port model server_pid name seed [bench args...]
  local port=$1 model=$2 pid=$3 name=$4 seed=$5; shift 5
  tokenmill bench serve --base-url "http://127.0.0.1:$port" --model "$model" --server-pid "$pid" --seed "$seed" \
    --output-json "$OUT/$name.json" "$@" >/dev/null 2>&1 || echo "run $name failed" >&2
}

pairs() {  # A_port A_model A_pid A_name B_port B_model B_pid B_name row_name seed row_args...
  local ap=$1 am=$2 apid=$3 an=$4 bp=$5 bm=$6 bpid=$7 bn=$8 row=$9 seed=${10}; shift 10
  run "$ap" "$am" "$apid" "$an-$row-1" "$seed" "$@"; run "$bp" "$bm" "$bpid" "$bn-$row-1" "$seed" "$@"
  run "$bp" "$bm" "$bpid" "$bn-$row-2" $((seed + 1)) "$@"; run "$ap" "$am" "$apid" "$an-$row-2" $((seed + 1)) "$@"
}

summarise() {  # one line per run of this invocation in OUT
  for f in "$OUT"/*.json; do [ "$f" -ot "$OUT/.started" ] && continue; python - "$f" <<'PY'
import json, os, sys
d = json.load(open(sys.argv[1]))
print(f"{os.path.basename(sys.argv[1])[:-5]:<28} total tok/s {d['total_tokens_per_s']:<8} output tok/s "
      f"{d.get('output_tokens_per_s')!s:<8} TTFT p50 {d['ttft_ms']['p50']:<9} TPOT p50 {d['tpot_ms']['p50']:<7} "
      f"errors {d['errors']}  peak RSS GiB {d.get('server_peak_rss_gib')}")
PY
  done
}
