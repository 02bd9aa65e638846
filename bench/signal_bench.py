#!/usr/bin/env python3
"""What an asynchronous signal costs a replicated program on the fast path.

`bench/signal_loop.c` makes N writes of 64 bytes to /dev/null (fast-path outputs), with an
interval timer firing SIGALRM every US microseconds (an SA_RESTART handler that counts),
or without a timer (US = 0). Each round runs, for every configuration below, the program
without a timer and with one, back to back; the cost of one signal is

    (ns per write with the timer - ns per write without) * N / signals taken

per round, and the median over rounds is reported, with the ns per write. Natively a
signal costs about nothing; under lockstep every signal takes ptrace stops (the leader's
own copy, each follower's own copy, and each replica's raise of the ring's SIGNAL
record; docs/run.md, "Signals are records of the ring").

`--other BIN` runs a second lockstep binary (another build, say the previous commit's)
in the same rounds, interleaved, so that two implementations are compared on the same
noisy machine. Nothing here asserts on timing.

Usage (from anywhere):
    cargo build --release --locked -p lockstep-cli
    python3 bench/signal_bench.py [--rounds R] [--writes N] [--us US] [--other BIN] [--out DIR]
Writes DIR/signals.json (default bench/out) with every raw number, and prints a markdown
summary.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

import benchproc
from benchproc import BIN, anomaly, cleanup_all, fmt, install_signal_cleanup, median

CONFIGS = {
    "-r 2 --output-check fast": ["-r", "2", "--output-check", "fast"],
    "-r 2 (strict)": ["-r", "2"],
    "-r 3 --output-check fast": ["-r", "3", "--output-check", "fast"],
}
TICKS_RE = re.compile(r"ticks (\d+), (\d+) ns/write")


def measure(cmd, where):
    """(signals taken, ns per write) of one run, or None."""
    got = benchproc.run(cmd, 300, where)
    if got is None:
        return None
    rc, _, err, _ = got
    m = TICKS_RE.search(err)
    if rc != 0 or m is None:
        anomaly(where, f"exit {rc}", cmd, err)
        return None
    return int(m.group(1)), int(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--writes", type=int, default=200000)
    ap.add_argument("--us", type=int, default=1000, help="the timer's interval (µs)")
    ap.add_argument("--other", help="a second lockstep binary, measured in the same rounds")
    ap.add_argument("--out", default=os.path.join(benchproc.ROOT, "bench", "out"))
    args = ap.parse_args()
    install_signal_cleanup()
    tmp = tempfile.mkdtemp(prefix="signal-bench-")
    prog = os.path.join(tmp, "signal_loop")
    subprocess.run(["gcc", "-O2", "-o", prog, os.path.join(benchproc.ROOT, "bench", "signal_loop.c")],
                   check=True)
    bins = {"this": BIN}
    if args.other:
        bins["other"] = os.path.abspath(args.other)
    rows = {}  # (bin, config) -> list of per-round dicts
    native = []
    for rnd in range(args.rounds):
        print(f"round {rnd + 1} of {args.rounds}", file=sys.stderr, flush=True)
        runs = [measure([prog, str(args.writes), str(us)], f"native us={us}") for us in (0, args.us)]
        native.append(runs)
        for config, opts in CONFIGS.items():
            for name, path in bins.items():
                where = f"{name} {config}"
                base = [path, "run", "--backend", "fast"] + opts + ["--", prog, str(args.writes)]
                quiet = measure(base + ["0"], where + " no timer")
                timed = measure(base + [str(args.us)], where + " timer")
                rec = {"no_timer": quiet, "timer": timed, "us_per_signal": None}
                if quiet and timed and timed[0] > 0:
                    rec["us_per_signal"] = (timed[1] - quiet[1]) * args.writes / 1000 / timed[0]
                rows.setdefault((name, config), []).append(rec)
    cleanup_all()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n| binary | config | ns/write, no timer | ns/write, {args.us} µs timer | signals | µs per signal |")
    print("|---|---|---:|---:|---:|---:|")
    nq = median([r[0][1] for r in native if r[0]])
    nt = median([r[1][1] for r in native if r[1]])
    ns = median([r[1][0] for r in native if r[1]])
    print(f"| native | | {fmt(nq, '.0f')} | {fmt(nt, '.0f')} | {fmt(ns, '.0f')} | ~0 |")
    summary = {}
    for (name, config), recs in rows.items():
        q = median([r["no_timer"][1] for r in recs if r["no_timer"]])
        t = median([r["timer"][1] for r in recs if r["timer"]])
        s = median([r["timer"][0] for r in recs if r["timer"]])
        u = median([r["us_per_signal"] for r in recs])
        summary[f"{name} {config}"] = {"ns_no_timer": q, "ns_timer": t, "signals": s, "us_per_signal": u}
        print(f"| {name} | {config} | {fmt(q, '.0f')} | {fmt(t, '.0f')} | {fmt(s, '.0f')} | {fmt(u, '.0f')} |")
    path = benchproc.write_results(args.out, "signals.json", {
        "writes": args.writes, "us": args.us, "binaries": bins, "native": native,
        "runs": {f"{n} {c}": v for (n, c), v in rows.items()}, "summary": summary})
    print(f"\nraw numbers: {path}")
    if benchproc.ANOMALIES:
        print("\n".join(benchproc.anomalies_markdown()))


if __name__ == "__main__":
    main()
