#!/usr/bin/env bash
# Campaign throughput vs native (issue 3 goal: >= 0.9x). Both sides run the digest
# workload (bench/digest.c) with the same parallelism (-j 2 / 2 native runs at a time), in
# one invocation, so that they share the machine's state:
#   native:   RUNS runs of `digest 40`, two at a time;
#   campaign: `lockstep inject --fault MODEL --runs RUNS -j 2` on the same program.
# Prints both rates and their ratio, and the mean wall time of the campaign's masked runs
# (which pay the tracing overhead but no fault effect) against the native mean.
# Usage: bench/inject_throughput.sh [RUNS] [MODEL]   (default 300 reg)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-300}
MODEL=${2:-reg}
cargo build --release --locked -q
L=$PWD/target/release/lockstep
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gcc -O2 -Wall -Wextra -Werror -o "$work/digest" bench/digest.c
python3 - "$L" "$work" "$RUNS" "$MODEL" <<'PY'
import json, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
L, work, runs, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
prog = [f"{work}/digest", "40"]

def native(_):
    t = time.perf_counter()
    subprocess.run(prog, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t

t0 = time.perf_counter()
with ThreadPoolExecutor(2) as pool:
    walls = list(pool.map(native, range(runs)))
native_s = time.perf_counter() - t0
out = f"{work}/campaign"
t0 = time.perf_counter()
subprocess.run([L, "inject", "--fault", model, "--runs", str(runs), "-j", "2", "--seed", "5",
                "--out", out, "--"] + prog, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
campaign_s = time.perf_counter() - t0
records = [json.loads(l) for l in open(f"{out}/results.jsonl")]
masked = [r["wall_ms"] for r in records if r["class"] == "masked"]
hangs = sum(r["class"] == "hang" for r in records)
native_rate, campaign_rate = runs / native_s, runs / campaign_s
print(f"native:   {runs} runs in {native_s:.1f} s = {native_rate:.1f} runs/s (2 at a time), mean wall {1e3 * sum(walls) / len(walls):.1f} ms")
print(f"campaign: {runs} injections ({model}) in {campaign_s:.1f} s = {campaign_rate:.1f} runs/s (-j 2, golden runs included), {hangs} hangs")
print(f"ratio:    {campaign_rate / native_rate:.2f}x")
if masked:
    print(f"masked runs: {len(masked)}, mean wall {sum(masked) / len(masked):.1f} ms vs native {1e3 * sum(walls) / len(walls):.1f} ms"
          f" = {sum(walls) / len(walls) * 1e3 / (sum(masked) / len(masked)):.2f}x")
PY
