#!/usr/bin/env bash
# The long tail end to end: the axum app (bench/examples/e2e_server.rs) with every key limited
# to LIMIT/s (burst LIMIT), loaded by wrk on loopback with x-api-key drawn from Zipf(1.0) over
# 100,000 keys (scripts/zipf.lua); Redis behind a TCP proxy that delays each direction by
# DELAY_US (bench/examples/delay_proxy.rs), so the store is a network hop away. Modes, in
# interleaved rounds: no throttle, this crate on Redis with its defaults (credit for cold
# keys), the same with ColdStart::Exact, tower_governor per host, and a Redis Lua bucket asked
# on every request. Reports medians of throughput, p50 and p99, the share of 429s against a
# perfect limiter's at the same traffic, and Redis scripts run per request. Writes docs/e2e-zipf.md
# (docs/e2e-zipf-warm.md with WARM set).
#
#   scripts/bench-e2e-zipf.sh [ROUNDS] [SECONDS] [CONNECTIONS] [LIMIT] [DELAY_US]
#
# WARM=<seconds>: each server first serves the same traffic that long, unmeasured, so the run
# measures a host in its steady state (its keys known, its leases held) rather than one whose
# every key is new; the 429 share is then set against a perfect limiter's over the whole time.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
seconds=${2:-10}
connections=${3:-32}
limit=${4:-100}
delay_us=${5:-1000}
warm=${WARM:-0}
report=docs/e2e-zipf.md
[ "$warm" != 0 ] && report=docs/e2e-zipf-warm.md
export ZIPF_KEYS=100000 ZIPF_S=1.0
modes=(none redis redis-exact governor redis-per-request)

. scripts/bench-lib.sh
need wrk wrk
need redis-server redis-server
need curl curl

cargo build --release -p hierarchical-throttle-bench --example e2e_server --example delay_proxy
server_bin=target/release/examples/e2e_server
proxy_bin=target/release/examples/delay_proxy

work=$(mktemp -d)
redis_port=$(free_port)
proxy_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --logfile "$work/redis.log" --daemonize yes --pidfile "$work/redis.pid"
cleanup() {
    [ -f "$work/redis.pid" ] && kill "$(cat "$work/redis.pid")" 2>/dev/null || true
    [ -n "${server_pid:-}" ] && kill "$server_pid" 2>/dev/null || true
    [ -n "${proxy_pid:-}" ] && kill "$proxy_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
for _ in $(seq 100); do redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break; sleep 0.05; done
"$proxy_bin" "$proxy_port" "127.0.0.1:$redis_port" "$delay_us" >"$work/proxy.log" 2>&1 &
proxy_pid=$!
for _ in $(seq 100); do redis-cli -p "$proxy_port" ping >/dev/null 2>&1 && break; sleep 0.05; done
export REDIS_URL="redis://127.0.0.1:$proxy_port"

# PING round trip through the proxy: the median of 200, over one connection.
rtt_us=$(python3 - "$proxy_port" <<'PY'
import socket, statistics, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(200):
    t = time.perf_counter()
    s.sendall(b"PING\r\n")
    s.recv(64)
    times.append((time.perf_counter() - t) * 1e6)
print(f"{statistics.median(times):.0f}")
PY
)
echo "PING round trip through the proxy: $rtt_us us"

# Scripts Redis has run (EVALSHA and EVAL, less failed calls: an EVALSHA the server did not
# know yet).
scripts_run() {
    redis-cli -p "$redis_port" info commandstats | tr -d '\r' | awk -F'[:,=]' '
        /^cmdstat_(evalsha|eval):/ {
            for (i = 2; i < NF; i += 2) { if ($i == "calls") c += $(i+1); if ($i == "failed_calls") f += $(i+1) }
        }
        END { print c - f }'
}

for round in $(seq "$rounds"); do
    for i in "${!modes[@]}"; do
        mode=${modes[$(((i + round) % ${#modes[@]}))]}
        redis-cli -p "$redis_port" flushall >/dev/null
        port=$(free_port)
        "$server_bin" "$mode" "$port" "$limit" >"$work/server.log" 2>&1 &
        server_pid=$!
        for _ in $(seq 200); do
            curl -s -o /dev/null -H 'x-api-key: warm' "http://127.0.0.1:$port/" && break
            sleep 0.05
        done
        if [ "$warm" != 0 ]; then
            wrk -t1 -c"$connections" -d"${warm}s" -s scripts/zipf.lua "http://127.0.0.1:$port/" >/dev/null
        fi
        before=$(scripts_run)
        out=$(wrk -t1 -c"$connections" -d"${seconds}s" --latency -s scripts/zipf.lua "http://127.0.0.1:$port/")
        after=$(scripts_run)
        kill "$server_pid"; wait "$server_pid" 2>/dev/null || true; server_pid=""
        requests=$(awk '/requests in/ {print $1}' <<<"$out")
        rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
        p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
        p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
        non2xx=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
        scripts=$((after - before))
        echo "round $round  $mode  $rps req/s  p50 $p50  p99 $p99  429s ${non2xx:-0} of $requests  scripts $scripts"
        echo "$mode $rps $p50 $p99 ${non2xx:-0} $requests $scripts" >>"$work/results"
    done
done

python3 - "$work/results" "$rounds" "$seconds" "$connections" "$limit" "$delay_us" "$rtt_us" "$warm" <<'PY' | tee "$report"
import statistics, sys
path, rounds, seconds, connections, limit, delay_us, rtt_us, warm = sys.argv[1:]
seconds, limit, warm = float(seconds), int(limit), float(warm)
n, s = 100_000, 1.0
weights = [1 / k ** s for k in range(1, n + 1)]
total_weight = sum(weights)
def perfect_refused(requests):
    # A perfect limiter at the same traffic: each key admits at most burst + rate x duration.
    # After a warm-up at the same rate, each key over its limit is admitted its rate alone.
    allowance = limit * seconds + (limit if warm == 0 else 0)
    admitted = sum(min(requests * w / total_weight, allowance) for w in weights)
    return 1 - admitted / requests
def micros(v):
    for unit, f in (("us", 1), ("ms", 1e3), ("s", 1e6)):
        if v.endswith(unit):
            return float(v[: -len(unit)]) * f
    raise ValueError(v)
rows = {}
for line in open(path):
    mode, rps, p50, p99, refused, requests, scripts = line.split()
    rows.setdefault(mode, []).append(
        (float(rps), micros(p50), micros(p99), int(refused), int(requests), int(scripts)))
med = lambda mode, i: statistics.median(r[i] for r in rows[mode])
base_rps, base_p99 = med("none", 0), med("none", 2)
gov_rps = med("governor", 0)
print(f"wrk -t1 -c{connections} -d{seconds:.0f}s on loopback, Zipf(1.0) keys over 100,000, each "
      f"limited to {limit}/s burst {limit}; Redis behind a proxy delaying {delay_us} us each way "
      f"(PING round trip {rtt_us} us); {rounds} interleaved rounds, medians; server and wrk share "
      "the machine's 2 cores"
      + (f"; each server warmed by {warm:.0f} s of the same traffic first" if warm else "")
      + ".\n")
print("| mode | requests/s | vs. none | vs. tower_governor | p50 | p99 | p99 vs. none | 429s | a perfect limiter's | Redis scripts per request |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
names = {"none": "no throttle", "redis": "this crate on Redis (defaults: credit)",
         "redis-exact": "this crate on Redis, `ColdStart::Exact`",
         "governor": "tower_governor, per host", "redis-per-request": "a Redis Lua bucket per request"}
for mode in ["none", "redis", "redis-exact", "governor", "redis-per-request"]:
    rps, p50, p99 = med(mode, 0), med(mode, 1), med(mode, 2)
    refused = statistics.median(r[3] / r[4] for r in rows[mode])
    perfect = statistics.median(perfect_refused(r[4]) for r in rows[mode])
    scripts = statistics.median(r[5] / r[4] for r in rows[mode])
    sc = "-" if mode in ("none", "governor") else f"{scripts:.3f}"
    print(f"| {names[mode]} | {rps:,.0f} | {rps / base_rps:.2f}x | {rps / gov_rps:.2f}x | "
          f"{p50 / 1000:.2f} ms | {p99 / 1000:.2f} ms | {p99 / base_p99:.2f}x | "
          f"{refused:.1%} | {perfect:.1%} | {sc} |")
PY
