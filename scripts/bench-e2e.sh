#!/usr/bin/env bash
# End-to-end over real sockets: the axum app served in each mode (bench/examples/e2e_server.rs) and
# loaded in turn by wrk on loopback; rounds interleave the modes, each round starting with
# another; medians, and throughput and p99 latency as ratios to the unthrottled app. Writes
# docs/e2e.md.
#
#   scripts/bench-e2e.sh [ROUNDS] [SECONDS] [CONNECTIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
seconds=${2:-5}
connections=${3:-32}
modes=(none memory redis governor redis-per-request)

. scripts/bench-lib.sh
need wrk wrk
need redis-server redis-server

cargo build --release -p hierarchical-throttle-bench --example e2e_server
server_bin=target/release/examples/e2e_server

work=$(mktemp -d)
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --logfile "$work/redis.log" --daemonize yes --pidfile "$work/redis.pid"
cleanup() {
    [ -f "$work/redis.pid" ] && kill "$(cat "$work/redis.pid")" 2>/dev/null || true
    [ -n "${server_pid:-}" ] && kill "$server_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
export REDIS_URL="redis://127.0.0.1:$redis_port"
for _ in $(seq 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.05; done

for round in $(seq "$rounds"); do
    # Each round starts with a different mode, so no mode always runs first or last.
    for i in "${!modes[@]}"; do
        mode=${modes[$(((i + round) % ${#modes[@]}))]}
        port=$(free_port)
        "$server_bin" "$mode" "$port" >"$work/server.log" 2>&1 &
        server_pid=$!
        for _ in $(seq 200); do
            curl -s -o /dev/null -H 'x-api-key: bench' "http://127.0.0.1:$port/" && break
            sleep 0.05
        done
        out=$(wrk -t1 -c"$connections" -d"${seconds}s" --latency -H 'x-api-key: bench' "http://127.0.0.1:$port/")
        kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
        rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
        p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
        non2xx=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
        echo "round $round  $mode  $rps req/s  p99 $p99  non-2xx ${non2xx:-0}"
        echo "$mode $rps $p99 ${non2xx:-0}" >>"$work/results"
    done
done

python3 - "$work/results" "$rounds" "$seconds" "$connections" <<'PY' | tee docs/e2e.md
import statistics, sys
path, rounds, seconds, connections = sys.argv[1:]
def micros(s):
    for unit, f in (("us", 1), ("ms", 1e3), ("s", 1e6)):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * f
    raise ValueError(s)
rows = {}
for line in open(path):
    mode, rps, p99, non2xx = line.split()
    rows.setdefault(mode, []).append((float(rps), micros(p99), int(non2xx)))
base_rps = statistics.median(r for r, _, _ in rows["none"])
base_p99 = statistics.median(p for _, p, _ in rows["none"])
print(f"wrk -t1 -c{connections} -d{seconds}s on loopback, {rounds} interleaved rounds (each "
      "starting with another mode), medians; server and wrk share the machine's 2 cores.\n")
print("| mode | requests/s | vs. no throttle | p99 latency | vs. no throttle | non-2xx |")
print("|---|---:|---:|---:|---:|---:|")
for mode in ["none", "memory", "redis", "governor", "redis-per-request"]:
    rps = statistics.median(r for r, _, _ in rows[mode])
    p99 = statistics.median(p for _, p, _ in rows[mode])
    bad = sum(n for _, _, n in rows[mode])
    print(f"| {mode} | {rps:,.0f} | {rps / base_rps:.2f}x | {p99:,.0f} us | {p99 / base_p99:.2f}x | {bad} |")
PY
