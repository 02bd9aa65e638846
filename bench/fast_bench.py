#!/usr/bin/env python3
"""What the fast backend (`lockstep run --backend fast`) costs, against native runs measured
side by side in the same invocation.

Part A, per-call cost: bench/fast_loop.c (compiled here with gcc into a temporary
directory) does N iterations of read(/dev/zero, 64 B) + write(/dev/null, 64 B) and prints
the nanoseconds per syscall. Each round runs, in this order: native; `lockstep run -r 2
--backend fast --stats`; `lockstep run -r 3 --backend fast --stats`; and one `lockstep run
-r 2 --backend ptrace` with a smaller N (N/20, at least 2000; ptrace stops every replica
at every call, so it is orders of magnitude slower). Reported per configuration: the
median ns per call, the added ns per call against native (median of the per-round
differences), the slowdown (median of the per-round ratios) and, for the fast runs, the
fraction of syscalls that took the fast path = fast-path calls / (fast-path calls +
intercepted calls), from lockstep's --stats.

Part B, redis: each round starts redis-server (--save "" --appendonly no, on a free port)
natively and under `lockstep run --backend fast --stats` in each of B_OPTIONS (DMR and
TMR; replicas spread or on one CPU; strict or in-process output checks), waits for
PING, runs `redis-benchmark -t set,get -n N -c 50 --csv` against it, then shuts it down
with `redis-cli shutdown nosave`. Reported per configuration: median SET and GET
requests/s, the share of native (median of the per-round ratios replicated / native of
the same round) and the fast-path fraction of redis's syscalls.

Part C, masking latency: TMR runs of tests/fixtures/fast_target.c with the output of
one replica (a follower, then the leader) corrupted by --test-flip; reported: the `mask`
event's duration (from the start of the monitor's decision to the healthy replicas going
on) and the vote-out's, median and max over --mask-runs runs.

The machine may be small and noisy, so configurations are interleaved round by round and
everything is given relative to the native run of the same round. Failures (a replicated
run exiting early or non-zero, a timeout, output that does not parse) are listed as
anomalies; they do not stop the bench. Nothing here asserts on timing.

Usage (from anywhere; the repository root is found from this file's path):
    cargo build --release --locked -p lockstep-cli
    python3 bench/fast_bench.py [--rounds R] [--requests N] [--loop N] [--mask-runs K]
                                [--out DIR] [--quick]
--quick is --rounds 1 --requests 20000 --loop 50000 --mask-runs 5. Writes DIR/fast.json (default
bench/out/fast.json) with every raw per-round number and the summary, and prints a
markdown summary on stdout. Needs gcc, redis-server, redis-cli and redis-benchmark; the
fast backend needs root (see docs/run.md).
"""
import csv
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import benchproc
from benchproc import (BIN, ROOT, anomaly, cleanup_all, fmt, free_port, killpg, median, pct,
                       read_file, reap, run, spawn, tail)

SRC = os.path.join(ROOT, "bench", "fast_loop.c")
NS_RE = re.compile(r"^ns_per_call\s+([0-9.eE+-]+)\s*$", re.M)


def add_stats(rec, where, cmd, err):
    """Adds lockstep's --stats counters from `err` to `rec`; a missing block is an anomaly."""
    st = benchproc.parse_stats(err)
    if st is None:
        anomaly(where, "no --stats counters on lockstep's stderr", cmd, err)
    else:
        rec.update(st)


# ---------------------------------------------------------------- Part A: fast_loop

# Per-call configurations: the fast backend with strict output checks (the default: the
# leader's write stops in the monitor), with in-process checks only, and ptrace.
A_OPTIONS = {
    "fast -r 2": ["-r", "2", "--backend", "fast", "--stats"],
    "fast -r 2 --output-check fast": ["-r", "2", "--backend", "fast", "--output-check", "fast", "--stats"],
    "fast -r 3": ["-r", "3", "--backend", "fast", "--stats"],
    "fast -r 3 --output-check fast": ["-r", "3", "--backend", "fast", "--output-check", "fast", "--stats"],
    "ptrace -r 2": ["-r", "2", "--backend", "ptrace"],
}
A_CONFIGS = ["native"] + list(A_OPTIONS)


def a_cmd(config, loop_bin, n):
    if config == "native":
        return [loop_bin, str(n)]
    return [BIN, "run"] + A_OPTIONS[config] + ["--", loop_bin, str(n)]


def part_a(args, loop_bin):
    n_ptrace = max(2000, args.loop // 20)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for config in A_CONFIGS:
            n = n_ptrace if config.startswith("ptrace") else args.loop
            cmd = a_cmd(config, loop_bin, n)
            where = f"A round {r + 1} {config}"
            # Generous: up to 1 ms per call (3 replicas on 2 CPUs can be ~100 us/call).
            timeout = 120 + 2 * n * 1e-3
            print(f"  {where}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr,
                  flush=True)
            res = run(cmd, timeout, where)
            rec = {"command": cmd, "n": n, "ns_per_call": None}
            if res is None:
                rec["error"] = "timeout"
                row[config] = rec
                continue
            rc, out, err, secs = res
            rec.update({"rc": rc, "seconds": round(secs, 3)})
            if rc != 0:
                anomaly(where, f"exit status {rc}", cmd, err)
                rec["error"] = f"exit {rc}"
            m = NS_RE.search(out)
            if m:
                rec["ns_per_call"] = float(m.group(1))
            else:
                anomaly(where, f"no ns_per_call in stdout {out.strip()[:200]!r}", cmd, err)
            if "--stats" in cmd:
                add_stats(rec, where, cmd, err)
            print(f"    ns_per_call={rec['ns_per_call']} "
                  f"fast={rec.get('fast_path_calls')} intercepted={rec.get('intercepted')}",
                  file=sys.stderr, flush=True)
            row[config] = rec
        rounds.append(row)

    summary = {}
    for config in A_CONFIGS:
        vals = [row[config]["ns_per_call"] for row in rounds]
        diffs, ratios = [], []
        for row in rounds:
            nat, v = row["native"]["ns_per_call"], row[config]["ns_per_call"]
            if nat is not None and v is not None:
                diffs.append(v - nat)
                ratios.append(v / nat if nat > 0 else None)
        summary[config] = {
            "n": n_ptrace if config.startswith("ptrace") else args.loop,
            "ns_per_call_median": median(vals),
            "added_ns_vs_native_median": median(diffs) if config != "native" else 0.0,
            "ratio_vs_native_median": median(ratios) if config != "native" else 1.0,
            "fast_fraction_median": median([row[config].get("fast_fraction")
                                            for row in rounds]),
            "valid_rounds": sum(v is not None for v in vals),
        }
    return {"n": args.loop, "n_ptrace": n_ptrace, "rounds": rounds, "summary": summary}


# ---------------------------------------------------------------- Part B: redis

# Replicated configurations and their `lockstep run` options: spread over the CPUs (the
# default placement), and all replicas on one CPU (leaves the other to the client), each
# with strict output checks (the default: one stop of the leader per output, so the
# monitor goes on the replicas' CPU too) and with in-process checks only.
B_OPTIONS = {
    "fast -r 2": ["-r", "2"],
    "fast -r 2 --output-check fast": ["-r", "2", "--output-check", "fast"],
    "fast -r 2 --cpus 0,0 --monitor-cpu 0": ["-r", "2", "--cpus", "0,0", "--monitor-cpu", "0"],
    "fast -r 2 --cpus 0,0 --output-check fast": ["-r", "2", "--cpus", "0,0", "--output-check", "fast"],
    "fast -r 3": ["-r", "3"],
    "fast -r 3 --output-check fast": ["-r", "3", "--output-check", "fast"],
    "fast -r 3 --cpus 0,0,0 --monitor-cpu 0": ["-r", "3", "--cpus", "0,0,0", "--monitor-cpu", "0"],
    "fast -r 3 --cpus 0,0,0 --output-check fast": ["-r", "3", "--cpus", "0,0,0", "--output-check", "fast"],
}
B_CONFIGS = ["native"] + list(B_OPTIONS)


def b_server_cmd(config, port):
    redis = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    if config == "native":
        return redis
    return [BIN, "run"] + B_OPTIONS[config] + ["--backend", "fast", "--stats", "--"] + redis


def ping(port):
    try:
        out = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                             text=True, timeout=5, stdin=subprocess.DEVNULL).stdout
    except subprocess.TimeoutExpired:
        return False
    return out.strip() == "PONG"


def parse_csv(text):
    rps = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 2 or row[0].strip().lower() == "test":
            continue
        try:
            rps[row[0].strip().upper()] = float(row[1])
        except ValueError:
            continue
    return rps


def b_one(config, args, tmp, where):
    port = free_port()
    cmd = b_server_cmd(config, port)
    bench_cmd = ["redis-benchmark", "-p", str(port), "-t", "set,get", "-n", str(args.requests),
                 "-c", "50", "--csv"]
    rec = {"command": cmd, "bench_command": bench_cmd, "port": port, "SET": None, "GET": None}
    tag = where.replace(" ", "_")
    out_path = os.path.join(tmp, tag + ".out")
    err_path = os.path.join(tmp, tag + ".err")
    print(f"  {where}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
        p = spawn(cmd, fo, fe)
    try:
        # Wait for PONG.
        deadline = time.monotonic() + 30
        up = False
        while time.monotonic() < deadline:
            if p.poll() is not None:
                break
            if ping(port):
                up = True
                break
            time.sleep(0.1)
        if not up:
            what = (f"server exited with status {p.returncode} before answering PING"
                    if p.poll() is not None else "no PONG within 30 s")
            rec["error"] = what
            anomaly(where, what, cmd, read_file(err_path) + read_file(out_path)[-2000:])
            return rec

        # Benchmark.
        t0 = time.monotonic()
        try:
            b = subprocess.run(bench_cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=120 + args.requests * 5e-3)
            rec["bench_seconds"] = round(time.monotonic() - t0, 3)
            rec["bench_rc"] = b.returncode
            rps = parse_csv(b.stdout)
            rec["SET"], rec["GET"] = rps.get("SET"), rps.get("GET")
            bench_ok = b.returncode == 0 and rec["SET"] is not None and rec["GET"] is not None
            bench_what = (f"redis-benchmark exit {b.returncode}, parsed {rps}; stderr "
                          f"{tail(b.stderr, 3)!r}")
        except subprocess.TimeoutExpired:
            bench_ok, bench_what = False, "redis-benchmark timed out"
        time.sleep(0.1)
        if not bench_ok:
            rec["error"] = "redis-benchmark failed or unparsable"
            rec["SET"] = rec["GET"] = None

        # The server must still be there when we ask it to stop.
        if p.poll() is not None:
            rec["rc"] = p.returncode
            rec["error"] = f"server exited with status {p.returncode} before shutdown"
            anomaly(where, f"server exited with status {p.returncode} before shutdown, during "
                    f"redis-benchmark ({'ok' if bench_ok else bench_what}); "
                    f"benchmark: {' '.join(bench_cmd)}", cmd, read_file(err_path))
        else:
            if not bench_ok:
                anomaly(where, bench_what, bench_cmd, read_file(err_path))
            try:
                subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"],
                               capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                pass
            try:
                rec["rc"] = p.wait(timeout=30)
                if rec["rc"] != 0:
                    # Not counted as a failure of the run (the numbers are in), but kept.
                    rec["note"] = f"exit status {rec['rc']} after shutdown"
            except subprocess.TimeoutExpired:
                killpg(p.pid)
                p.wait()
                rec["rc"] = p.returncode
                rec["error"] = rec.get("error") or "did not exit within 30 s of shutdown"
                anomaly(where, "did not exit within 30 s of `shutdown nosave`; "
                        "process group SIGKILLed", cmd, read_file(err_path))
    finally:
        if p.poll() is None:
            killpg(p.pid)
            p.wait()
        reap(p)

    if config != "native":
        add_stats(rec, where, cmd, read_file(err_path))
    print(f"    SET={rec['SET']} GET={rec['GET']} rc={rec.get('rc')} "
          f"fast={rec.get('fast_path_calls')} intercepted={rec.get('intercepted')}",
          file=sys.stderr, flush=True)
    return rec


def part_b(args, tmp):
    rounds = []
    for r in range(args.rounds):
        row = {}
        for config in B_CONFIGS:
            row[config] = b_one(config, args, tmp, f"B round {r + 1} {config}")
        rounds.append(row)

    summary = {}
    for config in B_CONFIGS:
        s = {"valid_rounds": sum(row[config]["SET"] is not None and
                                 row[config]["GET"] is not None for row in rounds)}
        for t in ("SET", "GET"):
            s[t + "_rps_median"] = median([row[config][t] for row in rounds])
            ratios = []
            for row in rounds:
                nat, v = row["native"][t], row[config][t]
                if nat and v is not None:
                    ratios.append(v / nat)
            s[t + "_ratio_vs_native_median"] = median(ratios)
        # Only from rounds that completed (a halted run's counters describe a stall).
        s["fast_fraction_median"] = median([row[config].get("fast_fraction") for row in rounds
                                            if row[config]["SET"] is not None])
        summary[config] = s
    return {"requests": args.requests, "clients": 50, "rounds": rounds, "summary": summary}


# ---------------------------------------------------------------- Part C: masking

# tests/fixtures/fast_target.c: 40 write(2)s; its one getppid call carries a pointer to
# line 10, so `--test-flip R:getppid:mem:rdi+0:2` corrupts that line in replica R only.
TARGET_SRC = os.path.join(ROOT, "tests", "fixtures", "fast_target.c")
C_FAULTS = {
    "follower (replica 1)": "1:getppid:mem:rdi+0:2",
    "leader (replica 0)": "0:getppid:mem:rdi+0:2",
}


def part_c(args, target_bin, tmp):
    """TMR runs of fast_target with one replica's output corrupted: the `mask` event's
    duration is the time from the start of the monitor's decision (the divergence it was
    told of) to the two healthy replicas going on."""
    rows = {}
    for name, flip in C_FAULTS.items():
        durations, kills = [], []
        for i in range(args.mask_runs):
            events = os.path.join(tmp, f"mask_{i}.jsonl")
            cmd = [BIN, "run", "-r", "3", "--backend", "fast", "--events", events,
                   "--test-flip", flip, "--", target_bin]
            res = run(cmd, 30, f"C {name} run {i + 1}")
            if res is None:
                continue
            if res[0] != 0:
                anomaly(f"C {name} run {i + 1}", f"exit status {res[0]} (the fault was not masked)",
                        cmd, res[2])
                continue
            try:
                with open(events) as f:
                    evs = [json.loads(line) for line in f if line.strip()]
            except (OSError, ValueError) as e:
                anomaly(f"C {name} run {i + 1}", f"events unreadable: {e}", cmd)
                continue
            mask = [e.get("duration_us") for e in evs if e.get("kind") == "mask"]
            kill = [e.get("duration_us") for e in evs if e.get("kind") == "vote" and e.get("action") == "kill"]
            if not mask:
                anomaly(f"C {name} run {i + 1}", "no mask event", cmd)
                continue
            durations.append(mask[0])
            kills.extend(k for k in kill[:1] if k is not None)
        rows[name] = {"flip": flip, "runs": args.mask_runs, "mask_us": durations,
                      "mask_us_median": median(durations), "mask_us_max": max(durations, default=None),
                      "kill_us_median": median(kills)}
    return rows


# ---------------------------------------------------------------- output

def markdown(meta, a, b, c):
    lines = [f"# lockstep fast backend bench ({meta['commit']})", ""]
    lines += [f"- commit: `{meta['commit']}`{' (dirty tree)' if meta['dirty'] else ''}",
              f"- kernel: `{meta['uname_r']}`, nproc: {meta['nproc']}",
              f"- lockstep binary: `{meta['lockstep']}` ({meta['lockstep_binary']})",
              f"- rounds: {meta['rounds']}, fast_loop N: {meta['loop']} (ptrace: {a['n_ptrace']}),"
              f" redis-benchmark -n {meta['requests']} -c 50",
              f"- wall time: {meta['wall_seconds']:.0f} s", "", "Commands (interleaved in this order "
              "every round):", "", "```"]
    lines += meta["commands"]
    lines += ["```", "", "## Per-call cost (read 64 B /dev/zero + write 64 B /dev/null)", "",
              "| config | N | ns/call (median) | added ns/call vs native | x native | "
              "fast-path fraction |",
              "|---|---:|---:|---:|---:|---:|"]
    for config in A_CONFIGS:
        s = a["summary"][config]
        lines.append(f"| {config} | {s['n']} | {fmt(s['ns_per_call_median'], '.1f')} | "
                     f"{fmt(s['added_ns_vs_native_median'], '.1f')} | "
                     f"{fmt(s['ratio_vs_native_median'], '.2f')} | "
                     f"{pct(s['fast_fraction_median'], 2) if config.startswith('fast') else '-'} |")
    lines += ["", f"## redis throughput (redis-benchmark -t set,get -n {meta['requests']} -c 50)",
              "", "| config | SET rps | GET rps | SET % of native | GET % of native | "
              "fast-path fraction |", "|---|---:|---:|---:|---:|---:|"]
    for config in B_CONFIGS:
        s = b["summary"][config]
        lines.append(f"| {config} | {fmt(s['SET_rps_median'], '.0f')} | "
                     f"{fmt(s['GET_rps_median'], '.0f')} | "
                     f"{pct(s['SET_ratio_vs_native_median'])} | "
                     f"{pct(s['GET_ratio_vs_native_median'])} | "
                     f"{pct(s['fast_fraction_median'], 2) if config != 'native' else '-'} |")
    lines += ["", "Medians over rounds; 'added ns', 'x native' and '% of native' are medians of "
              "per-round differences / ratios against the native run of the same round. "
              "Fast-path fraction = fast-path calls / (fast-path calls + intercepted calls).", ""]
    lines += ["## Masking latency (TMR, one replica's output corrupted)", "",
              "| faulty replica | runs | masked | mask µs (median) | mask µs (max) | vote-out µs (median) |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, r in c.items():
        lines.append(f"| {name} | {r['runs']} | {len(r['mask_us'])} | {fmt(r['mask_us_median'], '.0f')} | "
                     f"{fmt(r['mask_us_max'], '.0f')} | {fmt(r['kill_us_median'], '.0f')} |")
    lines += ["", "mask µs: the `mask` event's duration, from the start of the monitor's decision "
              "to the healthy replicas going on (re-integration comes after it).", ""]
    lines += benchproc.anomalies_markdown()
    return "\n".join(lines) + "\n"


def main():
    args, meta = benchproc.bench_start(__doc__, [
        ("--rounds", 3, "measuring rounds"),
        ("--requests", 100000, "redis-benchmark -n"),
        ("--loop", 200000, "fast_loop iterations"),
        ("--mask-runs", 20, "runs per faulty replica (part C)"),
    ], quick={"rounds": 1, "requests": 20000, "loop": 50000, "mask_runs": 5})
    n_ptrace = max(2000, args.loop // 20)
    commands = [
        f"A: fast_loop {args.loop}",
        *[f"A: {BIN} run {' '.join(opts)} -- fast_loop "
          f"{n_ptrace if name.startswith('ptrace') else args.loop}" for name, opts in A_OPTIONS.items()],
        "B: redis-server --port P --save '' --appendonly no",
        *[f"B: {BIN} run {' '.join(opts)} --backend fast --stats -- redis-server --port P "
          "--save '' --appendonly no" for opts in B_OPTIONS.values()],
        f"B: (each) redis-cli -p P ping; redis-benchmark -p P -t set,get -n {args.requests} "
        "-c 50 --csv; redis-cli -p P shutdown nosave",
        *[f"C: {BIN} run -r 3 --backend fast --events E --test-flip {flip} -- fast_target"
          for flip in C_FAULTS.values()],
        "fast_loop = gcc -O2 -Wall -Wextra -Werror bench/fast_loop.c",
        "fast_target = gcc -O2 -Wall -Wextra -Werror tests/fixtures/fast_target.c",
    ]
    try:
        with tempfile.TemporaryDirectory(prefix="fast_bench.") as tmp:
            loop_bin = benchproc.build_c(SRC, os.path.join(tmp, "fast_loop"))
            print("Part A: per-call cost", file=sys.stderr, flush=True)
            a = part_a(args, loop_bin)
            print("Part B: redis", file=sys.stderr, flush=True)
            b = part_b(args, tmp)
            target_bin = benchproc.build_c(TARGET_SRC, os.path.join(tmp, "fast_target"))
            print("Part C: masking latency", file=sys.stderr, flush=True)
            c = part_c(args, target_bin, tmp)
    finally:
        cleanup_all()

    benchproc.bench_end(meta)
    meta.update({"rounds": args.rounds, "loop": args.loop, "requests": args.requests, "commands": commands})
    report = markdown(meta, a, b, c)
    out_json = benchproc.write_results(args.out, "fast.json",
                                       {"meta": meta, "per_call": a, "redis": b, "masking": c})
    print(report, end="")
    print(f"(raw numbers: {out_json})", file=sys.stderr)


if __name__ == "__main__":
    main()
