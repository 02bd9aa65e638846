#!/usr/bin/env bash
# Campaign throughput vs native (issue 15 goal: >= 0.9x), on a CPU-bound and a server
# workload. Both sides run with the same parallelism (-j 2 / 2 native runs at a time), in
# one invocation, so that they share the machine's state:
#   digest: RUNS native runs of `digest 40` (bench/digest.c) against
#           `lockstep inject --fault MODEL --runs RUNS -j 2` on the same program;
#   redis:  RUNS native server runs (start redis-server, wait for its port, run
#           bench/redis_workload.sh, SIGTERM, wait) against the same campaign in server
#           mode (`--server --client ...`).
# Prints both rates and their ratio, the hang count, and the mean wall time of the
# campaign's masked runs against the native mean (digest: whole runs; redis: the client).
# Usage: bench/inject_throughput.sh [RUNS] [MODEL] [WORKLOAD...]   (default 300 reg digest redis)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-300}
MODEL=${2:-reg}
shift 2 || shift $#
WORKLOADS=("$@")
[ ${#WORKLOADS[@]} -eq 0 ] && WORKLOADS=(digest redis)
cargo build --release --locked -q
L=$PWD/target/release/lockstep
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gcc -O2 -Wall -Wextra -Werror -o "$work/digest" bench/digest.c
python3 - "$L" "$work" "$RUNS" "$MODEL" "$PWD/bench/redis_workload.sh" "${WORKLOADS[@]}" <<'PY'
import json, os, socket, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
L, work, runs, model, redis_client = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
workloads = sys.argv[6:]
# Below the kernel's ephemeral range, one port per native slot and per campaign worker.
NATIVE_PORTS, CAMPAIGN_PORT = (23100, 23101), 23200

def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), 0.1).close()
        return True
    except OSError:
        return False

def redis_argv(port, d):
    return ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
            "--bind", "127.0.0.1", "--dir", d]

def native_digest(_slot):
    t = time.perf_counter()
    subprocess.run([f"{work}/digest", "40"], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t

def native_redis(slot):
    port = NATIVE_PORTS[slot]
    with tempfile.TemporaryDirectory(dir=work) as d:
        srv = subprocess.Popen(redis_argv(port, d), stdout=subprocess.DEVNULL)
        while not port_open(port):
            time.sleep(0.002)
        t = time.perf_counter()
        subprocess.run(["sh", redis_client, str(port)], stdout=subprocess.DEVNULL, check=True)
        client = time.perf_counter() - t
        srv.terminate()
        srv.wait()
    return client

def native(kind):
    one = {"digest": native_digest, "redis": native_redis}[kind]
    def slot_loop(slot):
        return [one(slot) for _ in range(runs // 2 + (slot < runs % 2))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        walls = sum(pool.map(slot_loop, range(2)), [])
    return time.perf_counter() - t0, walls

def campaign(kind):
    out = f"{work}/campaign-{kind}"
    if kind == "digest":
        target = ["--", f"{work}/digest", "40"]
    else:
        target = ["--server", "--port", str(CAMPAIGN_PORT), "--client", f"sh {redis_client} {{port}}",
                  "--"] + redis_argv("{port}", "{dir}")
    t0 = time.perf_counter()
    subprocess.run([L, "inject", "--fault", model, "--runs", str(runs), "-j", "2", "--seed", "5",
                    "--out", out] + target, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0, [json.loads(l) for l in open(f"{out}/results.jsonl")]

for kind in workloads:
    native_s, walls = native(kind)
    campaign_s, records = campaign(kind)
    masked = [r["wall_ms"] for r in records if r["class"] == "masked"]
    count = lambda c: sum(r["class"] == c for r in records)
    native_rate, campaign_rate = runs / native_s, runs / campaign_s
    mean_native_ms = 1e3 * sum(walls) / len(walls)
    print(f"== {kind}")
    print(f"native:   {runs} runs in {native_s:.1f} s = {native_rate:.1f} runs/s (2 at a time), mean wall {mean_native_ms:.1f} ms")
    print(f"campaign: {runs} injections ({model}) in {campaign_s:.1f} s = {campaign_rate:.1f} runs/s (-j 2, golden runs included),"
          f" {count('hang')} hangs, {count('not-activated')} not activated")
    print(f"ratio:    {campaign_rate / native_rate:.2f}x")
    if masked:
        mean_masked = sum(masked) / len(masked)
        print(f"masked runs: {len(masked)}, mean wall {mean_masked:.1f} ms vs native {mean_native_ms:.1f} ms"
              f" = {mean_native_ms / mean_masked:.2f}x")
PY
