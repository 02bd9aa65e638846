#!/bin/bash
# Where a replicated memcached's CPU goes, thread by thread: `lockstep run -r 2 --stats
# [OPTIONS] -- memcached -t 1` (background threads off, as in bench/server_costs.py) under
# memcaslap (8 connections, 7 s), and each thread's user + system time (from
# /proc/PID/task/TID/stat) over 5 s in the middle of the load, per request. The leader's
# worker is named mc-worker; a follower's keeps the name memcached (its
# pthread_setname_np is an output only the leader makes); lockstep-commit is the
# monitor's committer, which writes the replies. A diagnostic: nothing is asserted.
#
# Usage: bench/memcached_thread_cpu.sh [LOCKSTEP_BINARY] [lockstep run OPTIONS...]
#        (default binary: target/release/lockstep; build it with make build)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/lockstep}
shift || true
[ -x "$BIN" ] || { echo "no lockstep binary at $BIN (make build)" >&2; exit 2; }
for tool in memcached memcaslap; do
    command -v "$tool" >/dev/null || { echo "$tool is missing (scripts/deps.sh bench installs it)" >&2; exit 2; }
done
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
setsid "$BIN" run -r 2 --stats "$@" -- memcached -u root -p "$PORT" -l 127.0.0.1 -t 1 \
    -o no_lru_crawler,no_lru_maintainer,no_hashexpand,no_slab_reassign 2>"$TMP/stats" &
LS=$!
for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
snapshot() {
    for pid in $(pgrep -s "$LS"); do
        for t in /proc/"$pid"/task/*; do
            awk -v t="$t" '{print t, $2, $14 + $15}' "$t/stat" 2>/dev/null || true
        done
    done | sort
}
memcaslap -s 127.0.0.1:"$PORT" -T 1 -c 8 -t 7s >"$TMP/load" 2>&1 &
LOAD=$!
sleep 1
snapshot >"$TMP/before"
sleep 5
snapshot >"$TMP/after"
wait "$LOAD"
kill -INT "$LS"
wait "$LS" || true
TPS=$(awk '/^Run time/ {print $7}' "$TMP/load" | tail -1)
[ -n "$TPS" ] || { echo "memcaslap gave no TPS:" >&2; cat "$TMP/load" >&2; exit 1; }
HZ=$(getconf CLK_TCK)
echo "TPS: $TPS (memcaslap -T 1 -c 8; CPU over 5 s of it)"
join "$TMP/before" "$TMP/after" | awk -v tps="$TPS" -v hz="$HZ" '
    { d = $5 - $3; total += d
      if (d > 0) printf "%-28s %-18s %.2f us/request\n", $1, $2, d * 1e6 / hz / (tps * 5) }
    END { printf "all threads                                     %.2f us/request\n", total * 1e6 / hz / (tps * 5) }'
grep -E "ring wake-ups|committer wake-ups|outputs posted" "$TMP/stats" || true
