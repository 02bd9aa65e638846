#!/usr/bin/env python3
"""kernels.py - issue 17's SPLASH2-like kernels (bench/kernels.c) under `lockstep run`:
wall time against native, measured in the same invocation.

    python3 bench/kernels.py [--rounds R] [--threads T] [--lockstep BIN]

Builds bench/kernels.c with `gcc -O2 -pthread` into a temporary directory, then for each
kernel (a prefix sum with three barrier waits per round, a barrier-heavy stencil, a work
queue under a mutex and condition variables) runs native, `-r 2`, `-r 3` and
`-r 2 --sync-order object`, and `-r 2` and `-r 3` with `--sync-order serial` in turn, R rounds (the second half in reverse order). A run
counts only when it exits 0 with native's checksum line; anything else is an anomaly
(listed, not fatal). Prints per kernel and configuration the median wall time, the
median of the per-round ratios against that round's native run (issue 17's goal:
<= 1.3x), the CPU time per replica (the whole process tree's, monitor included, divided
by the replicas) against native's, and the ordered events per run from `--stats`. With
T threads per replica on a machine of fewer than T x replicas CPUs, wall time cannot be
below replicas x T / CPUs times native: the CPU column is the overhead that remains.
Nothing here asserts on timing.
"""
import argparse
import os
import resource
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (kernel, size, rounds): 0.05-0.5 s natively on the 2-vCPU VM of docs/results.md (the
# queue is small because its replicated runs take 10-100x longer).
KERNELS = [
    ("prefix", 2_000_000, 20),
    ("stencil", 20_000, 2_000),
    ("queue", 5_000, 2),
]
CONFIGS = {
    "native": None,
    "-r 2": ["-r", "2"],
    "-r 3": ["-r", "3"],
    "-r 2 --sync-order object": ["-r", "2", "--sync-order", "object"],
    "-r 2 --sync-order serial": ["-r", "2", "--sync-order", "serial"],
    "-r 3 --sync-order serial": ["-r", "3", "--sync-order", "serial"],
}
ORDERED_RE = re.compile(r"ordered events:\s+(\d+)")


def replicas_of(opts):
    return 1 if opts is None else int(opts[opts.index("-r") + 1])


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(cmd, timeout):
    """(wall seconds, CPU seconds of the whole process tree, the finished process)."""
    t0, c0 = time.monotonic(), children_cpu()
    p = subprocess.run(cmd, capture_output=True, timeout=timeout)
    return time.monotonic() - t0, children_cpu() - c0, p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lockstep", default=os.path.join(ROOT, "target", "release", "lockstep"))
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    if not os.access(args.lockstep, os.X_OK):
        sys.exit(f"kernels.py: no lockstep binary at {args.lockstep} (cargo build --release -p lockstep-cli)")
    work = tempfile.mkdtemp(prefix="lockstep-kernels-")
    anomalies = []
    try:
        binary = os.path.join(work, "kernels")
        subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-o", binary,
                        os.path.join(ROOT, "bench", "kernels.c")], check=True)
        print("| kernel | configuration | median wall (s) | x native (median of rounds) | CPU per replica (s) | CPU x native | ordered events |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for kernel, size, rounds in KERNELS:
            argv = [binary, kernel, str(args.threads), str(size), str(rounds)]
            want = subprocess.run(argv, capture_output=True, check=True).stdout
            times = {c: [] for c in CONFIGS}
            cpus = {c: [] for c in CONFIGS}
            ratios = {c: [] for c in CONFIGS}
            ordered = {c: [] for c in CONFIGS}
            names = list(CONFIGS)
            for rnd in range(args.rounds):
                order = names if rnd < (args.rounds + 1) // 2 else list(reversed(names))
                this_round = {}
                for config in order:
                    opts = CONFIGS[config]
                    cmd = argv if opts is None else [args.lockstep, "run", *opts, "--stats", "--", *argv]
                    try:
                        wall, cpu, p = one(cmd, args.timeout)
                    except subprocess.TimeoutExpired:
                        anomalies.append(f"{kernel} {config} round {rnd}: timeout after {args.timeout} s")
                        continue
                    if p.returncode != 0 or p.stdout != want:
                        tail = p.stderr.decode(errors="replace").strip().splitlines()[-3:]
                        anomalies.append(f"{kernel} {config} round {rnd}: exit {p.returncode}, "
                                         f"{'same' if p.stdout == want else 'other'} output: {tail}")
                        continue
                    times[config].append(wall)
                    # The CPU each replica used (the monitor's share included).
                    cpus[config].append(cpu / replicas_of(opts))
                    this_round[config] = wall
                    m = ORDERED_RE.search(p.stderr.decode(errors="replace"))
                    if m:
                        ordered[config].append(int(m.group(1)))
                # Each configuration against the native run of the same round.
                if "native" in this_round:
                    for config, wall in this_round.items():
                        ratios[config].append(wall / this_round["native"])
            for config in names:
                if not times[config]:
                    print(f"| {kernel} | {config} | - | - | - | - | - |")
                    continue
                wall = statistics.median(times[config])
                ratio = f"{statistics.median(ratios[config]):.2f}" if ratios[config] else "-"
                events = f"{int(statistics.median(ordered[config])):,}" if ordered[config] else "-"
                cpu = statistics.median(cpus[config])
                cpu_ratio = cpu / statistics.median(cpus["native"]) if cpus["native"] else float("nan")
                print(f"| {kernel} | {config} | {wall:.3f} | {ratio} | {cpu:.3f} | {cpu_ratio:.2f} | {events} |", flush=True)
        print()
        print(f"Commands ({args.rounds} rounds, {args.threads} threads; each configuration's runs interleaved with native's):")
        for kernel, size, rounds in KERNELS:
            print(f"  kernels {kernel} {args.threads} {size} {rounds}; lockstep run <configuration> --stats -- kernels ...")
        if anomalies:
            print()
            print("Anomalies:")
            for a in anomalies:
                print(f"  {a}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
