#!/usr/bin/env python3
"""memcached under `lockstep run`, side by side with native memcached in the same invocation.

Each round starts memcached 1.6 (Debian's) on a free port, in three thread set-ups, each
natively and under every lockstep configuration below:
  - `t1`: one worker thread, background threads off (`-t 1 -o no_lru_crawler,
    no_lru_maintainer,no_hashexpand,no_slab_reassign`): the main thread and one worker;
  - `t4`: four worker threads, background threads off;
  - `default`: memcached's defaults (four workers, LRU maintainer and crawler, hash and
    slab threads); its background threads' timing can make replicas diverge (issue 17).
It waits until the port accepts connections, runs `memcaslap -s 127.0.0.1:P -T 1 -c 8
-t Ss` against it, reads memcaslap's final TPS, and stops the server with SIGINT.
Reported per set-up and configuration: the median TPS, the share of native (median of
the per-round ratios against the native run of the same round and set-up), the server's
CPU time per request per replica (wait4's rusage of the server, or of lockstep and the
replicas it reaped, divided by replicas and by memcaslap's Ops) and its ratio to native's:
with memcaslap on the same CPUs, TPS is bounded by the machine as much as by lockstep.
The CPU ratio includes the time a replica spins waiting for another (on a machine with
spare CPUs that time costs no throughput); the fraction
of syscalls that took the fast path (--stats), and runs that diverged or failed
(anomalies; they do not stop the bench). Nothing here asserts on timing.

Usage (from anywhere):
    cargo build --release --locked -p lockstep-cli
    python3 bench/memcached_bench.py [--rounds R] [--seconds S] [--out DIR] [--quick]
--quick is --rounds 1 --seconds 3. Writes DIR/memcached.json (default bench/out) with every
raw number, and prints a markdown summary. Needs memcached and memcaslap (libmemcached-tools).
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import benchproc
from benchproc import (BIN, anomaly, cleanup_all, fmt, free_port, killpg, median, pct, port_accepts,
                       read_file, reap, sh, spawn)

NO_BACKGROUND = "no_lru_crawler,no_lru_maintainer,no_hashexpand,no_slab_reassign"
SETUPS = {
    "t1": ["-t", "1", "-o", NO_BACKGROUND],
    "t4": ["-t", "4", "-o", NO_BACKGROUND],
    "default": [],
}
OPTIONS = {
    "fast -r 2": ["-r", "2", "--backend", "fast"],
    "fast -r 2 --output-check fast": ["-r", "2", "--backend", "fast", "--output-check", "fast"],
    "fast -r 3": ["-r", "3", "--backend", "fast"],
    "ptrace -r 2": ["-r", "2", "--backend", "ptrace"],
}
CONFIGS = ["native"] + list(OPTIONS)

TPS_RE = re.compile(r"TPS:\s+(\d+)")
OPS_RE = re.compile(r"Ops:\s+(\d+)")


def replicas_of(config):
    return int(OPTIONS[config][OPTIONS[config].index("-r") + 1]) if config != "native" else 1


def wait_cpu(p, timeout):
    """Wait for p (the server, or lockstep with its replicas) and return the CPU seconds it
    and every descendant it reaped used, from wait4's rusage. Raises TimeoutExpired."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return ru.ru_utime + ru.ru_stime
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(p.args, timeout)
        time.sleep(0.05)


def server_cmd(setup, config, port):
    memcached = ["memcached", "-u", "root", "-p", str(port), "-l", "127.0.0.1"] + SETUPS[setup]
    if config == "native":
        return memcached
    return [BIN, "run"] + OPTIONS[config] + ["--stats", "--"] + memcached


def one(setup, config, args, tmp, where):
    port = free_port()
    cmd = server_cmd(setup, config, port)
    load = ["memcaslap", "-s", f"127.0.0.1:{port}", "-T", "1", "-c", "8", "-t", f"{args.seconds}s"]
    rec = {"command": cmd, "load_command": load, "tps": None}
    err_path = os.path.join(tmp, where.replace(" ", "_") + ".err")
    print(f"  {where}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    with open(os.devnull, "wb") as fo, open(err_path, "wb") as fe:
        p = spawn(cmd, fo, fe)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and p.poll() is None and not port_accepts(port):
            time.sleep(0.1)
        if p.poll() is not None or not port_accepts(port):
            rec["error"] = "server did not accept connections"
            anomaly(where, rec["error"], cmd, read_file(err_path))
            return rec
        try:
            out = sh(load, or_stderr=True)
        except Exception as e:  # a timeout or a missing tool: recorded, the bench goes on
            out = str(e)
        m = TPS_RE.findall(out or "")
        rec["tps"] = int(m[-1]) if m else None
        ops = OPS_RE.findall(out or "")
        rec["ops"] = int(ops[-1]) if ops else None
        if rec["tps"] is None:
            anomaly(where, f"no TPS in memcaslap's output: {benchproc.tail(out or '', 3)!r}", load)
        if p.poll() is not None:
            rec["error"] = f"server exited with status {p.returncode} during the load"
            anomaly(where, rec["error"], cmd, read_file(err_path))
            rec["tps"] = None
        else:
            p.send_signal(2)
            try:
                rec["cpu_s"] = wait_cpu(p, 30)
                rec["rc"] = p.returncode
                if rec["ops"]:
                    # Per replica, so that it compares with native's: the monitor's share and
                    # memcached's start-up are in it (a few ms against seconds of load).
                    rec["cpu_us_per_op"] = 1e6 * rec["cpu_s"] / replicas_of(config) / rec["ops"]
            except Exception:
                killpg(p.pid)
                p.wait()
                rec["rc"] = p.returncode
                anomaly(where, "did not exit within 30 s of SIGINT; SIGKILLed", cmd, read_file(err_path))
    finally:
        if p.poll() is None:
            killpg(p.pid)
            p.wait()
        reap(p)
    err = read_file(err_path)
    if config != "native":
        rec.update(benchproc.parse_stats(err) or {})
        if "[divergence]" in err:
            rec["diverged"] = True
            anomaly(where, "divergence reported", cmd, err)
    print(f"    TPS={rec['tps']} fast={rec.get('fast_path_calls')} intercepted={rec.get('intercepted')}",
          file=sys.stderr, flush=True)
    return rec


def markdown(meta, rounds, summary):
    lines = [f"# memcached under lockstep run ({meta['commit']})", "",
             f"- commit: `{meta['commit']}`{' (dirty tree)' if meta['dirty'] else ''}, kernel "
             f"`{meta['uname_r']}`, nproc {meta['nproc']}, rounds {meta['rounds']}, "
             f"memcaslap -T 1 -c 8 -t {meta['seconds']}s", f"- wall time: {meta['wall_seconds']:.0f} s", "",
             "Commands (interleaved in this order every round, for each set-up):", "", "```"]
    lines += meta["commands"] + ["```", ""]
    for setup in SETUPS:
        lines += [f"## `{setup}`: memcached {' '.join(SETUPS[setup]) or '(defaults)'}", "",
                  "| config | TPS (median) | % of native | CPU µs per request per replica | CPU x native "
                  "| fast-path fraction | diverged runs |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for config in CONFIGS:
            s = summary[setup][config]
            lines.append(f"| {config} | {fmt(s['tps_median'], '.0f')} | {pct(s['ratio_median'])} | "
                         f"{fmt(s['cpu_us_median'], '.1f')} | {fmt(s['cpu_ratio_median'], '.2f')} | "
                         f"{pct(s['fast_fraction_median'], 2) if config.startswith('fast') else '-'} | "
                         f"{s['diverged']} |")
        lines.append("")
    lines += benchproc.anomalies_markdown()
    return "\n".join(lines) + "\n"


def main():
    args, meta = benchproc.bench_start(__doc__, [
        ("--rounds", 3, "measuring rounds"),
        ("--seconds", 5, "memcaslap -t"),
    ], quick={"rounds": 1, "seconds": 3})
    commands = ["memcached -u root -p P -l 127.0.0.1 <set-up options>"]
    commands += [f"{BIN} run {' '.join(o)} --stats -- memcached ..." for o in OPTIONS.values()]
    commands += [f"(each) memcaslap -s 127.0.0.1:P -T 1 -c 8 -t {args.seconds}s; SIGINT to the server"]
    rounds = []
    try:
        with tempfile.TemporaryDirectory(prefix="memcached_bench.") as tmp:
            for r in range(args.rounds):
                row = {setup: {config: one(setup, config, args, tmp, f"round {r + 1} {setup} {config}")
                               for config in CONFIGS} for setup in SETUPS}
                rounds.append(row)
    finally:
        cleanup_all()
    benchproc.bench_end(meta)
    summary = {}
    for setup in SETUPS:
        summary[setup] = {}
        for config in CONFIGS:
            recs = [row[setup][config] for row in rounds]
            ratios = [rec["tps"] / row[setup]["native"]["tps"] for rec, row in zip(recs, rounds)
                      if rec["tps"] is not None and row[setup]["native"]["tps"]]
            cpu_ratios = [rec["cpu_us_per_op"] / row[setup]["native"]["cpu_us_per_op"]
                          for rec, row in zip(recs, rounds)
                          if rec.get("cpu_us_per_op") and row[setup]["native"].get("cpu_us_per_op")]
            summary[setup][config] = {
                "cpu_us_median": median([rec.get("cpu_us_per_op") for rec in recs]),
                "cpu_ratio_median": median(cpu_ratios),
                "tps_median": median([rec["tps"] for rec in recs]),
                "ratio_median": median(ratios),
                "fast_fraction_median": median([rec.get("fast_fraction") for rec in recs]),
                "diverged": sum(bool(rec.get("diverged")) for rec in recs),
            }
    meta.update({"rounds": args.rounds, "seconds": args.seconds, "commands": commands})
    out_json = benchproc.write_results(args.out, "memcached.json",
                                       {"meta": meta, "rounds": rounds, "summary": summary})
    print(markdown(meta, rounds, summary), end="")
    print(f"(raw numbers: {out_json})", file=sys.stderr)


if __name__ == "__main__":
    main()
