#!/usr/bin/env python3
"""One point of kv's throughput with what it costs the replicas: a 3-replica `lockstep kv
cluster` in MODE (smr, gop or crosscheck), memcaslap with CONNS connections spread over the
replicas as in bench/kv_bench.py (key 64 B, value 400 B, GET_RATIO of gets), and `perf stat`
over the replicas while it runs: TPS, context switches per operation, the replicas' CPU
time per operation and their calls of libc's malloc per operation (all three replicas
together; through a uprobe, `perf probe -x LIBC malloc`, added if missing; "-" when it
cannot be). A diagnostic for kv_bench's points; nothing is asserted. Needs a release build (make build), memcaslap and perf (scripts/deps.sh bench)."""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["smr", "gop", "crosscheck"])
    ap.add_argument("conns", type=int, help="memcaslap connections")
    ap.add_argument("get_ratio", type=float, help="share of gets, 0..1")
    ap.add_argument("seconds", nargs="?", type=int, default=5, help="measured seconds (default 5)")
    a = ap.parse_args()
    if a.conns < 1 or a.seconds < 1 or not 0 <= a.get_ratio <= 1:
        ap.error("CONNS and SECONDS must be positive, GET_RATIO within 0..1")
    kv_bench.require_fresh_binary()
    events = "context-switches,task-clock"
    if malloc_probe():
        events += ",probe_libc:malloc"
    proc, n = kv_bench.start(a.mode)
    try:
        kv_bench.memcaslap(n, a.get_ratio, a.conns, seconds=2)  # warm-up
        replicas = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        with tempfile.NamedTemporaryFile("r", suffix=".perf") as out:
            perf = subprocess.Popen(["perf", "stat", "-x,", "-e", events, "-p", ",".join(replicas),
                                     "-o", out.name, "--", "sleep", str(a.seconds)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            tps = kv_bench.memcaslap(n, a.get_ratio, a.conns, seconds=a.seconds)
            perf.wait()
            counts = {f[2]: float(f[0]) for f in (line.split(",") for line in out.read().splitlines())
                      if len(f) > 2 and f[0].replace(".", "", 1).isdigit()}
    finally:
        kv_bench.stop(proc)
    ops = tps * a.seconds
    mallocs = counts.get("probe_libc:malloc")
    print("%s, %d conns, %.0f%% get: %d TPS, %.2f context switches/op, %.1f us replica CPU/op, %s mallocs/op"
          % (a.mode, a.conns, 100 * a.get_ratio, tps, counts["context-switches"] / ops,
             counts["task-clock"] * 1000 / ops, "-" if mallocs is None else "%.1f" % (mallocs / ops)))


def malloc_probe():
    """Whether the uprobe probe_libc:malloc exists (added now if it did not)."""
    listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
    if "probe_libc:malloc" in listed:
        return True
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    added = subprocess.run(["perf", "probe", "-x", libc, "malloc"], capture_output=True, text=True)
    if added.returncode != 0:
        print("no malloc count: perf probe -x %s malloc: %s" % (libc, added.stderr.strip()[-200:]), file=sys.stderr)
    return added.returncode == 0


if __name__ == "__main__":
    main()
