#!/bin/bash
# kv_cpu_per_op.sh MODE CONNS GET_RATIO [SECONDS]
#
# One point of kv's throughput with what it costs: a 3-replica `lockstep kv cluster` in
# MODE (smr, gop or crosscheck), memcaslap with CONNS connections spread over the replicas
# (key 64 B, value 400 B, GET_RATIO of gets), and `perf stat` over the replicas for the
# measured seconds: TPS, context switches per operation and the replicas' CPU time per
# operation (all three together). A diagnostic for bench/kv_bench.py's points; nothing is
# asserted. Needs a release build (make build), memcaslap and perf.
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
MODE=$1 CONNS=$2 RATIO=$3 SECONDS_=${4:-5}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=$ROOT/target/release/lockstep
PORT=${KV_CPU_PORT:-23411}
[ -x "$BIN" ] || { echo "build first: make build" >&2; exit 1; }
command -v memcaslap >/dev/null && command -v perf >/dev/null || { echo "needs memcaslap and perf (scripts/deps.sh bench)" >&2; exit 1; }
WORK=$(mktemp -d)
"$BIN" kv cluster -n 3 --port "$PORT" --mode "$MODE" --no-fsync >"$WORK/cluster.log" 2>&1 &
CLUSTER=$!
trap 'kill $CLUSTER 2>/dev/null; wait $CLUSTER 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 3
printf "key\n64 64 1\nvalue\n400 400 1\ncmd\n0 %s\n1 %s\n" "$(python3 -c "print(1 - $RATIO)")" "$RATIO" >"$WORK/slap.cfg"
SERVERS=127.0.0.1:$PORT,127.0.0.1:$((PORT + 1)),127.0.0.1:$((PORT + 2))
memcaslap -s "$SERVERS" -T 2 -c "$CONNS" -t 2s -F "$WORK/slap.cfg" >/dev/null 2>&1 # warm-up
PIDS=$(pgrep -P "$CLUSTER" | paste -sd,)
perf stat -e context-switches,task-clock -p "$PIDS" -o "$WORK/perf" -- sleep "$SECONDS_" >/dev/null 2>&1 &
PERF=$!
memcaslap -s "$SERVERS" -T 2 -c "$CONNS" -t "${SECONDS_}s" -F "$WORK/slap.cfg" >"$WORK/slap" 2>&1
wait $PERF
OPS=$(grep "Run time" "$WORK/slap" | tail -1 | sed 's/.*Ops: \([0-9]*\).*/\1/')
CS=$(awk '/context-switches/ {gsub(",", "", $1); print $1}' "$WORK/perf")
CPU_MS=$(awk '/task-clock/ {gsub(",", "", $1); print $1}' "$WORK/perf")
python3 -c "o = $OPS; print('%s, %s conns, %.0f%% get: %d TPS, %.2f context switches/op, %.1f us replica CPU/op' % ('$MODE', $CONNS, 100 * $RATIO, o / $SECONDS_, $CS / o, $CPU_MS * 1000 / o))"
