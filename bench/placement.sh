#!/usr/bin/env bash
# Placement experiment: spread replicas (the default) vs everything on one CPU.
# Prints a Markdown table. Usage: bench/placement.sh   (after `cargo build --release`)
set -euo pipefail
cd "$(dirname "$0")/.."
L=target/release/lockstep
work=$(mktemp -d)
trap 'redis-cli -p 7390 shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
cat > "$work/loop.c" <<'C'
#include <fcntl.h>
#include <unistd.h>
int main(void) { char b[64]; int fd = open("/dev/zero", O_RDONLY); for (int i = 0; i < 20000; i++) if (read(fd, b, sizeof b) != sizeof b) return 1; return 0; }
C
gcc -O2 -static -o "$work/loop" "$work/loop.c"
secs() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N); echo "$t1 - $t0" | bc; }
redis_rps() { # placement args...
    "$@" redis-server --port 7390 --save '' --appendonly no >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 50); do redis-cli -p 7390 ping >/dev/null 2>&1 && break; sleep 0.1; done
    redis-benchmark -p 7390 -t set -n 4000 -c 50 -P 1 --csv -q 2>/dev/null | awk -F'"' '/SET/ {print $4}'
    redis-cli -p 7390 shutdown nosave >/dev/null 2>&1 || true
    wait "$pid" || true
}
native_loop=$(secs "$work/loop")
spread_loop=$(secs $L run -r 2 -q -- "$work/loop")
compact_loop=$(secs $L run -r 2 -q --cpus 0,0 --monitor-cpu 0 -- "$work/loop")
native_rps=$(redis_rps env)
spread_rps=$(redis_rps $L run -r 2 -q --)
compact_rps=$(redis_rps $L run -r 2 -q --cpus 0,0 --monitor-cpu 0 --)
echo "| workload | native | -r 2 spread (default) | -r 2 compact (--cpus 0,0 --monitor-cpu 0) | compact vs spread |"
echo "|---|---:|---:|---:|---:|"
printf "| 20,000 read(2) calls, wall s | %.3f | %.3f | %.3f | %.2fx faster |\n" "$native_loop" "$spread_loop" "$compact_loop" "$(echo "$spread_loop / $compact_loop" | bc -l)"
printf "| redis SET rps (50 clients, no pipelining) | %.0f | %.0f (%.1f%% of native) | %.0f (%.1f%% of native) | %.2fx |\n" \
    "$native_rps" "$spread_rps" "$(echo "100 * $spread_rps / $native_rps" | bc -l)" "$compact_rps" \
    "$(echo "100 * $compact_rps / $native_rps" | bc -l)" "$(echo "$compact_rps / $spread_rps" | bc -l)"
