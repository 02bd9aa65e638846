#!/usr/bin/env python3
"""Benchmarks for `lockstep run` (Python 3 standard library only).

    python3 bench/run.py            full run (about 12 minutes on 2 cores), writes
                                    bench/out/results.json, docs/results.md, docs/charts/*.svg
    python3 bench/run.py --quick    smoke run (about 2 minutes), writes bench/out/quick/ only
    python3 bench/run.py --only redis,xz,recovery
    python3 bench/run.py --render-only   rebuild docs/results.md and the charts from results.json

`make bench` builds lockstep, installs redis-server, redis-tools and xz-utils
(scripts/deps.sh bench) and runs the full benchmark.

Three benchmarks:
  redis     redis-server natively and under `lockstep run -r 2|3 --compare io|args|every`,
            driven by redis-benchmark from outside the replica set. Native runs are
            interleaved with the replicated ones, and every replicated run is compared with
            the native runs just before and just after it.
  xz        `xz -9 -T1` on a generated 20 MB text file: wall time and CPU time (rusage of
            the whole lockstep process tree) natively and under -r 2 / -r 3, plus native
            controls that run 2 or 3 copies at once (same cache and core sharing, no lockstep).
  recovery  a static C program (bench/recovery.c) with a bit flip injected into a follower
            or into the leader under -r 3: masking time and re-integration time vs resident
            memory, read from the --events JSONL.

Nothing here asserts on timing; the numbers are reported, with goals and anchors beside them.
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchproc import free_port
from charts import bar_chart

ROOT = Path(__file__).resolve().parent.parent
BUILT_LOCKSTEP = ROOT / "target" / "release" / "lockstep"
LOCKSTEP = BUILT_LOCKSTEP  # replaced by a private copy in main(), so a rebuild mid-run changes nothing
T0 = time.monotonic()

# Goals and anchors from the product brief (shared/BRIEF.md).
GOALS = {
    "redis_dmr": 0.90,
    "redis_tmr": 0.85,
    "redis_anchor_dmr": "74-79%",
    "redis_anchor_tmr": "68-73%",
    "xz_cpu_overhead": 0.02,
    "xz_anchor": "1.8% (Romain, TMR, SPEC INT)",
    "mask_follower_us": 10,
    "mask_leader_us": 100,
    "mask_anchor_follower_us": 8,
    "mask_anchor_leader_us": 532,
    "reintegrate_ms_per_gib": 50,
}

REDIS_CONFIGS = [(2, "io"), (2, "args"), (2, "every"), (3, "io"), (3, "args"), (3, "every")]
RECOVERY_FLIP_WRITE = 10  # the flip hits the 10th write(2) ...
RECOVERY_FLIP_STOP = 4 + RECOVERY_FLIP_WRITE  # ... which is intercepted stop 14 with execve, prlimit64,
# readlink and getrandom before it (see recovery.c). Which syscalls lockstep intercepts can change (rseq
# became one), so bench_recovery calibrates the stop first and every run checks the write it hit.
RECOVERY_FLIP_SPEC = "mem:rsi+0:1"  # bit 1 of the first byte of the line: 's' -> 'q'

ANOMALIES = []  # lockstep misbehaviour seen during the run (hangs, exit statuses, leftovers)


def log(msg):
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def anomaly(where, what):
    ANOMALIES.append({"where": where, "what": what, "at_s": round(time.monotonic() - T0, 1)})
    log(f"ANOMALY {where}: {what}")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


# --------------------------------------------------------------------------------------
# Environment


def ensure_tools():
    need = ["redis-server", "redis-cli", "redis-benchmark", "xz", "gcc"]
    missing = [t for t in need if shutil.which(t) is None]
    if missing:
        log(f"missing {' '.join(missing)}: running scripts/deps.sh bench")
        subprocess.run([str(ROOT / "scripts" / "deps.sh"), "bench"], check=True)
        missing = [t for t in need if shutil.which(t) is None]
        if missing:
            sys.exit(f"bench: still missing {' '.join(missing)}")
    if not BUILT_LOCKSTEP.exists():
        log("target/release/lockstep missing: cargo build --release")
        subprocess.run(["cargo", "build", "--release", "--locked"], cwd=ROOT, check=True)


def cmd_out(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001 - informational only
        return f"unavailable ({e})"


def machine_info():
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    dirty = cmd_out(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_kib": mem_kib,
        "kernel": platform.release(),
        "os": cmd_out(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
        "git_commit": cmd_out(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        "git_dirty": bool(dirty),
        "lockstep_version": cmd_out([str(LOCKSTEP), "--version"]),
        "lockstep_binary_sha256": hashlib.sha256(BUILT_LOCKSTEP.read_bytes()).hexdigest(),
        "lockstep_binary_mtime": datetime.datetime.fromtimestamp(BUILT_LOCKSTEP.stat().st_mtime, datetime.timezone.utc)
        .isoformat(timespec="seconds"),
        "redis_version": cmd_out(["redis-server", "--version"]),
        "xz_version": cmd_out(["xz", "--version"]).splitlines()[0] if shutil.which("xz") else None,
        "gcc_version": cmd_out(["gcc", "--version"]).splitlines()[0],
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


# --------------------------------------------------------------------------------------
# Processes


def proc_table():
    """[(pid, pgid, cmdline)] for every process we can read."""
    rows = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            rows.append((int(d), int(fields[2]), cmd, fields[0]))
        except (OSError, ValueError):
            continue
    return rows


def leftovers(pgid=None, needle=None):
    out = []
    for pid, pg, cmd, state in proc_table():
        if pid == os.getpid() or state == "Z" and pg != pgid:
            continue
        if (pgid is not None and pg == pgid) or (needle and needle in cmd):
            out.append((pid, cmd, state))
    return out


def kill_pids(pids, sig=signal.SIGKILL):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def status_code(status):
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return None


def rusage_cpu(ru):
    return ru.ru_utime + ru.ru_stime


def run_wait4(argv, stdout, stderr, timeout, cwd=None):
    """Starts argv in its own process group and reaps it with wait4.

    Returns (exit code or -signal, wall s, rusage, timed_out). The rusage covers the
    child and every descendant it reaped (for lockstep: the monitor and all replicas)."""
    p = subprocess.Popen(argv, stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True)
    t0 = time.monotonic()
    fired = []

    def watchdog():
        fired.append(True)
        kill_group(p.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, watchdog)
    timer.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    finally:
        timer.cancel()
    wall = time.monotonic() - t0
    p.returncode = status_code(status)  # keep Popen from waiting again
    left = leftovers(pgid=p.pid)
    if left:
        kill_group(p.pid, signal.SIGKILL)
        anomaly(" ".join(argv[:6]), f"processes left in the process group after exit: {left}")
    return p.returncode, wall, ru, bool(fired)


STATS_RE = {
    "syscalls_intercepted": (r"syscalls intercepted:\s+(\d+)", int),
    "votes": (r"votes:\s+(\d+)", int),
    "bytes_compared": (r"bytes compared:\s+(\d+)", int),
    "bytes_copied": (r"bytes copied:\s+(\d+)", int),
    "rdtsc_emulated": (r"rdtsc emulated:\s+(\d+)", int),
    "divergences": (r"divergences:\s+(\d+)", int),
    "reintegrations": (r"re-integrations:\s+(\d+)", int),
    "monitor_cpu_s": (r"monitor CPU time:\s+([\d.]+) s", float),
}


def parse_stats(text):
    if "lockstep run: stats" not in text:
        return None
    s = {}
    for key, (rx, conv) in STATS_RE.items():
        m = re.search(rx, text)
        s[key] = conv(m.group(1)) if m else None
    m = re.search(r"time in monitor:\s+([\d.]+) s of ([\d.]+) s wall \((\d+) ns per intercepted", text)
    if m:
        s["monitor_time_s"] = float(m.group(1))
        s["stats_wall_s"] = float(m.group(2))
        s["ns_per_intercepted_syscall"] = int(m.group(3))
    block = text.split("syscalls intercepted:", 1)[1].split("rdtsc emulated:", 1)[0]
    s["by_class"] = {k: int(v) for k, v in re.findall(r"^\s{4}(\S+)\s+(\d+)\s*$", block, re.M)}
    return s


# --------------------------------------------------------------------------------------
# 1. redis


def wait_ready(port, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def parse_bench_csv(text):
    ops = {}
    for line in text.splitlines():
        cells = [c.strip('"') for c in line.strip().split(",")]
        if len(cells) >= 5 and cells[0] in ("SET", "GET"):
            try:
                ops[cells[0]] = {"rps": float(cells[1]), "avg_ms": float(cells[2]), "p50_ms": float(cells[4])}
            except ValueError:
                pass
    return ops


def redis_once(label, replicas, compare, n, stats, tmp, bench_timeout):
    """One server lifetime: start, wait for the port, redis-benchmark, shut down."""
    port = free_port()
    server = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    if replicas:
        argv = [str(LOCKSTEP), "run", "-r", str(replicas), "--compare", compare, "-q"]
        argv += ["--stats"] if stats else []
        argv += ["--"] + server
    else:
        argv = server
    err_path = tmp / f"redis-{label}-{port}.err"
    rec = {"label": label, "replicas": replicas, "compare": compare, "n": n, "stats_run": stats, "port": port}
    with open(err_path, "w") as err, open(tmp / f"redis-{label}-{port}.out", "w") as out:
        srv = subprocess.Popen(argv, stdout=out, stderr=err, start_new_session=True)
        t_start = time.monotonic()
        try:
            if not wait_ready(port, srv, 60):
                if srv.poll() is None:
                    anomaly(label, f"server not answering PING on port {port} within 60 s")
                else:
                    anomaly(label, f"server exited with status {srv.poll()} before answering PING on port {port}")
                rec["error"] = "not ready"
            else:
                rec["startup_s"] = round(time.monotonic() - t_start, 3)
                bench = ["redis-benchmark", "-p", str(port), "-t", "set,get", "-n", str(n)]
                bench += ["-c", "50", "-P", "1", "--csv", "-q"]
                t0 = time.monotonic()
                try:
                    r = subprocess.run(bench, capture_output=True, text=True, timeout=bench_timeout)
                    rec["bench_wall_s"] = round(time.monotonic() - t0, 3)
                    rec["ops"] = parse_bench_csv(r.stdout)
                    if r.returncode != 0 or set(rec["ops"]) != {"SET", "GET"}:
                        anomaly(label, f"redis-benchmark exit {r.returncode}: {r.stderr.strip()[:300]}")
                        rec["error"] = "benchmark failed"
                except subprocess.TimeoutExpired:
                    anomaly(label, f"redis-benchmark -n {n} did not finish in {bench_timeout} s")
                    rec["error"] = "benchmark timeout"
        finally:
            rec.update(stop_server(label, srv, port))
    text = err_path.read_text(errors="replace")
    if rec.get("exit_code") != 0:
        msgs = [ln for ln in text.splitlines() if ln.startswith("lockstep run:") and ln != "lockstep run: stats"]
        rec["error_lines"] = msgs[-3:]
        anomaly(label, f"exit status {rec.get('exit_code')} after shutdown nosave (expected 0)"
                + (f"; stderr: {' | '.join(msgs[-3:])}" if msgs else ""))
        rec.setdefault("error", f"exit {rec.get('exit_code')}")
    if stats:
        rec["stats"] = parse_stats(text)
        if rec["stats"] is None:
            anomaly(label, "--stats printed no stats block")
    return rec


def redis_retry(label, replicas, compare, n, stats, tmp, bench_timeout, failures, attempts=3):
    """redis_once, repeated (up to `attempts` times) when lockstep fails; failures are kept."""
    for attempt in range(1, attempts + 1):
        rec = redis_once(label, replicas, compare, n, stats, tmp, bench_timeout)
        rec["attempt"] = attempt
        if not rec.get("error"):
            return rec
        failures.append(rec)
        log(f"redis: {label} failed ({rec['error']}), attempt {attempt}/{attempts}")
    return rec


def stop_server(label, srv, port):
    res = {}
    t0 = time.monotonic()
    try:
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=15)
    except subprocess.TimeoutExpired:
        anomaly(label, "redis-cli shutdown nosave did not return in 15 s")
    try:
        srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        anomaly(label, "server still running 30 s after shutdown nosave; SIGTERM to its process group")
        kill_group(srv.pid, signal.SIGTERM)
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            anomaly(label, "still running 10 s after SIGTERM; SIGKILL to its process group")
            kill_group(srv.pid, signal.SIGKILL)
            srv.wait()
    res["shutdown_s"] = round(time.monotonic() - t0, 3)
    res["exit_code"] = srv.returncode
    time.sleep(0.05)
    left = leftovers(pgid=srv.pid, needle=f"--port {port} ")
    left += [x for x in leftovers(needle=f"*:{port}") if x not in left]  # redis retitles itself
    if left:
        anomaly(label, f"left behind after the server exited: {left}")
        kill_pids([pid for pid, _, _ in left])
        kill_group(srv.pid, signal.SIGKILL)
    res["leftover_processes"] = len(left)
    return res


def cfg_label(replicas, compare):
    return f"{'DMR' if replicas == 2 else 'TMR'} -r {replicas} --compare {compare}"


def bench_redis(quick, tmp):
    per_op_s = 1.5 if quick else 4.0  # target seconds per op (SET, GET) for a replicated run
    native_per_op_s = 1.0 if quick else 2.0
    stats_n = 1500 if quick else 4000
    rounds = 1 if quick else 2
    res = {"target_s_per_op": per_op_s, "native_target_s_per_op": native_per_op_s, "rounds": rounds}

    log("redis: native calibration")
    cal = redis_once("native-cal", 0, None, 20000, False, tmp, 120)
    native_rps = min(cal.get("ops", {}).get(op, {}).get("rps", 50000) for op in ("SET", "GET"))
    native_n = int(min(max(round(native_rps * native_per_op_s, -3), 10000), 400000))
    res["native_calibration"] = cal

    # One --stats run per configuration; it also calibrates N for the measured runs.
    res["stats_runs"] = []
    res["failed_runs"] = failures = []
    cfg_n = {}
    for r, c in REDIS_CONFIGS:
        label = cfg_label(r, c)
        log(f"redis: {label} --stats, n={stats_n}")
        rec = redis_retry(f"r{r}-{c}-stats", r, c, stats_n, True, tmp, 300, failures)
        s = rec.get("stats")
        if s and rec.get("ops") and not rec.get("error"):
            s["requests"] = 2 * stats_n
            s["intercepted_per_request"] = s["syscalls_intercepted"] / (2 * stats_n)
            rps = statistics.fmean(o["rps"] for o in rec["ops"].values())
            s["us_per_request"] = 1e6 / rps
            s["monitor_us_per_request"] = s["ns_per_intercepted_syscall"] * s["intercepted_per_request"] / 1000
            s["monitor_busy_fraction"] = s["monitor_time_s"] / s["stats_wall_s"] if s.get("stats_wall_s") else None
        else:
            rps = 1500.0
        cfg_n[(r, c)] = int(min(max(round(rps * per_op_s, -2), 1000), 60000))
        res["stats_runs"].append(rec)

    # Measured runs: native, cfg, native, cfg, ..., native (per round).
    log(f"redis: measured rounds={rounds}, native n={native_n}, replicated n={dict((cfg_label(*k), v) for k, v in cfg_n.items())}")
    runs = []
    for rnd in range(rounds):
        order = REDIS_CONFIGS if rnd % 2 == 0 else list(reversed(REDIS_CONFIGS))
        runs.append(dict(redis_once("native", 0, None, native_n, False, tmp, 120), round=rnd))
        for r, c in order:
            n = cfg_n[(r, c)]
            log(f"redis: round {rnd + 1}: {cfg_label(r, c)} n={n}")
            runs.append(dict(redis_retry(f"r{r}-{c}", r, c, n, False, tmp, max(90, int(12 * per_op_s * 2)), failures), round=rnd))
            runs.append(dict(redis_once("native", 0, None, native_n, False, tmp, 120), round=rnd))
    res["runs"] = runs

    # Ratios: each replicated run against the mean of the native runs right before and after it.
    for i, rec in enumerate(runs):
        if not rec["replicas"] or "ops" not in rec or rec.get("error"):
            continue
        neighbours = [runs[j] for j in (i - 1, i + 1) if 0 <= j < len(runs) and not runs[j]["replicas"]]
        rec["fraction_of_native"] = {}
        for op in ("SET", "GET"):
            nat = mean(x.get("ops", {}).get(op, {}).get("rps") for x in neighbours)
            if nat:
                rec["fraction_of_native"][op] = rec["ops"][op]["rps"] / nat
                rec.setdefault("native_neighbour_rps", {})[op] = nat

    summary = []
    for r, c in REDIS_CONFIGS:
        mine = [x for x in runs if x["replicas"] == r and x["compare"] == c and x.get("fraction_of_native")]
        stats = next((x.get("stats") for x in res["stats_runs"]
                      if x["replicas"] == r and x["compare"] == c and not x.get("error")), None)
        tried = list({id(x): x for x in runs + res["stats_runs"] + failures if x["replicas"] == r and x["compare"] == c}.values())
        row = {"replicas": r, "compare": c, "label": cfg_label(r, c), "runs": len(mine), "stats": stats,
               "server_runs": len(tried), "failed_server_runs": sum(1 for x in tried if x.get("error"))}
        for op in ("SET", "GET"):
            row[f"{op}_rps"] = median(x["ops"][op]["rps"] for x in mine)
            row[f"{op}_native_rps"] = median(x["native_neighbour_rps"][op] for x in mine)
            row[f"{op}_fraction"] = median(x["fraction_of_native"].get(op) for x in mine)
            row[f"{op}_p50_ms"] = median(x["ops"][op]["p50_ms"] for x in mine)
        row["goal"] = GOALS["redis_dmr"] if r == 2 else GOALS["redis_tmr"]
        row["anchor"] = GOALS["redis_anchor_dmr"] if r == 2 else GOALS["redis_anchor_tmr"]
        summary.append(row)
    natives = [x for x in runs if not x["replicas"] and x.get("ops")]
    res["native_summary"] = {
        op: {
            "median_rps": median(x["ops"][op]["rps"] for x in natives),
            "min_rps": min((x["ops"][op]["rps"] for x in natives), default=None),
            "max_rps": max((x["ops"][op]["rps"] for x in natives), default=None),
            "p50_ms": median(x["ops"][op]["p50_ms"] for x in natives),
            "runs": len(natives),
        }
        for op in ("SET", "GET")
    }
    res["summary"] = summary
    return res


# --------------------------------------------------------------------------------------
# 2. xz


def make_text(path, size):
    """Deterministic pseudo-random text built from a fixed vocabulary (compressible)."""
    rng = random.Random(20240601)
    syll = ["ka", "lo", "mi", "ne", "ra", "tu", "shi", "po", "ve", "dan", "gor", "el", "is", "um", "qua", "bri", "zen", "tor"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(5000)]
    written = 0
    with open(path, "w") as f:
        while written < size:
            line = " ".join(rng.choices(words, k=rng.randint(5, 15))) + ".\n"
            f.write(line)
            written += len(line)


def xz_native(file, copies, tmp, timeout):
    """`copies` native xz processes started together; returns per-copy CPU and the wall time.

    With several copies, copy i is pinned to CPU i mod nproc, the placement lockstep run
    gives its replicas by default (-r 3 on 2 CPUs: 0, 1, 0)."""
    procs, t0 = [], time.monotonic()
    cpus_avail = sorted(os.sched_getaffinity(0))
    with open(os.devnull, "w") as null:
        for i in range(copies):
            pin = None if copies == 1 else {cpus_avail[i % len(cpus_avail)]}
            procs.append(subprocess.Popen(["xz", "-9", "-T1", "-c", str(file)], stdout=null, start_new_session=True,
                                          preexec_fn=(lambda p=pin: os.sched_setaffinity(0, p)) if pin else None))
        timer = threading.Timer(timeout, lambda: [kill_group(p.pid, signal.SIGKILL) for p in procs])
        timer.start()
        cpus, codes = [], []
        for p in procs:
            _, st, ru = os.wait4(p.pid, 0)
            p.returncode = status_code(st)
            codes.append(p.returncode)
            cpus.append(rusage_cpu(ru))
        timer.cancel()
    wall = time.monotonic() - t0
    if any(codes):
        anomaly(f"xz native x{copies}", f"exit statuses {codes}")
    return {"kind": "native" if copies == 1 else f"native x{copies} pinned", "copies": copies, "wall_s": wall,
            "cpu_s_total": sum(cpus), "cpu_s_per_copy": statistics.fmean(cpus), "cpu_s_each": cpus,
            "exit_codes": codes, "loadavg_after": os.getloadavg()}


def xz_lockstep(file, replicas, tmp, timeout):
    err = tmp / f"xz-r{replicas}.err"
    argv = [str(LOCKSTEP), "run", "-r", str(replicas), "--stats", "-q", "--", "xz", "-9", "-T1", "-c", str(file)]
    with open(os.devnull, "w") as null, open(err, "w") as e:
        code, wall, ru, timed_out = run_wait4(argv, null, e, timeout)
    text = err.read_text(errors="replace")
    stats = parse_stats(text)
    cpu = rusage_cpu(ru)
    rec = {"kind": f"lockstep -r {replicas}", "replicas": replicas, "wall_s": wall, "cpu_s_total": cpu,
           "exit_code": code, "timed_out": timed_out, "stats": stats, "loadavg_after": os.getloadavg()}
    if timed_out:
        anomaly(rec["kind"] + " xz", f"killed after {timeout:.0f} s")
    if code != 0:
        anomaly(rec["kind"] + " xz", f"exit status {code}; stderr: {text[-500:]}")
    if stats and stats.get("monitor_cpu_s") is not None:
        rec["monitor_cpu_s"] = stats["monitor_cpu_s"]
        rec["cpu_s_per_replica"] = (cpu - stats["monitor_cpu_s"]) / replicas
    else:
        anomaly(rec["kind"] + " xz", "no --stats block")
    return rec


def bench_xz(quick, tmp):
    size = (2 if quick else 20) * 1000 * 1000
    rounds = 1 if quick else 2
    file = tmp / "words.txt"
    log(f"xz: generating {size / 1e6:.0f} MB of text")
    make_text(file, size)
    res = {"file_bytes": file.stat().st_size, "command": "xz -9 -T1 -c FILE > /dev/null", "rounds": rounds}
    timeout = 900 if not quick else 300
    # Round 1: native, -r 2, native x2, -r 3, native x3, native; round 2 the same in reverse,
    # sharing the native run in the middle.
    forward = [("lockstep", 2), ("native", 2), ("lockstep", 3), ("native", 3)]
    plan = [("native", 1, 0)]
    for rnd in range(rounds):
        steps = forward if rnd % 2 == 0 else list(reversed(forward))
        plan += [(k, n, rnd) for k, n in steps] + [("native", 1, rnd)]
    seq = []
    for kind, n, rnd in plan:
        if kind == "lockstep":
            log(f"xz: round {rnd + 1}: lockstep run -r {n}")
            rec = xz_lockstep(file, n, tmp, timeout)
        else:
            log(f"xz: round {rnd + 1}: native" + (f", {n} pinned copies at once" if n > 1 else ""))
            rec = xz_native(file, n, tmp, timeout)
        rec["round"] = rnd
        seq.append(rec)
    res["runs"] = seq
    solo = [x for x in seq if x["kind"] == "native"]
    nat_cpu = statistics.fmean(x["cpu_s_per_copy"] for x in solo)
    nat_wall = statistics.fmean(x["wall_s"] for x in solo)
    res["native_cpu_s"] = nat_cpu
    res["native_wall_s"] = nat_wall
    for x in seq:
        per = x.get("cpu_s_per_replica", x.get("cpu_s_per_copy"))
        x["cpu_per_unit_s"] = per
        x["cpu_per_replica_vs_native"] = per / nat_cpu if per else None
        x["wall_vs_native"] = x["wall_s"] / nat_wall
        if x.get("replicas"):
            ctrl = next((c for c in seq if c.get("copies") == x["replicas"] and c["round"] == x["round"]), None)
            if ctrl and per:
                x["cpu_per_replica_vs_control"] = per / ctrl["cpu_s_per_copy"]
                x["wall_vs_control"] = x["wall_s"] / ctrl["wall_s"]
    summary = []
    for kind in ["native", "lockstep -r 2", "native x2 pinned", "lockstep -r 3", "native x3 pinned"]:
        xs = [x for x in seq if x["kind"] == kind]
        if not xs:
            continue
        summary.append({
            "kind": kind, "runs": len(xs), "replicas": xs[0].get("replicas"),
            "wall_s": median(x["wall_s"] for x in xs),
            "cpu_s_total": median(x["cpu_s_total"] for x in xs),
            "monitor_cpu_s": median(x.get("monitor_cpu_s") for x in xs),
            "cpu_per_unit_s": median(x["cpu_per_unit_s"] for x in xs),
            "cpu_per_replica_vs_native": median(x["cpu_per_replica_vs_native"] for x in xs),
            "cpu_per_replica_vs_control": median(x.get("cpu_per_replica_vs_control") for x in xs),
            "wall_vs_native": median(x["wall_vs_native"] for x in xs),
            "wall_vs_control": median(x.get("wall_vs_control") for x in xs),
            "syscalls_intercepted": median((x.get("stats") or {}).get("syscalls_intercepted") for x in xs),
        })
    res["summary"] = summary
    return res


# --------------------------------------------------------------------------------------
# 3. recovery


def read_events(path):
    evs = []
    try:
        for line in open(path):
            line = line.strip()
            if line:
                try:
                    evs.append(json.loads(line))
                except json.JSONDecodeError:
                    anomaly("events", f"unparsable line: {line[:200]}")
    except FileNotFoundError:
        pass
    return evs


def flipped_write(evs):
    """The line number k of "qtep k of 20" in the divergence event: which write the flip hit."""
    for e in evs:
        if e.get("kind") == "divergence":
            for v in e.get("values") or []:
                m = re.search(r'write\(1\) "qtep (\d+) of 20', str(v))
                if m:
                    return int(m.group(1))
    return None


def recovery_once(binary, mib, replica, expected, tmp, timeout, stop=None, calibrating=False):
    ev = tmp / f"ev-{mib}-{replica}.jsonl"
    if ev.exists():
        ev.unlink()
    stop = stop or RECOVERY_FLIP_STOP
    flip = f"{replica}:{stop}:{RECOVERY_FLIP_SPEC}"
    argv = [str(LOCKSTEP), "run", "-r", "3", "-q", "--events", str(ev), "--test-flip", flip, "--", str(binary), str(mib)]
    out, err = tmp / "rec.out", tmp / "rec.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        code, wall, _, timed_out = run_wait4(argv, o, e, timeout)
    where = f"recovery {mib} MiB flip in replica {replica}"
    left = leftovers(needle=f"{binary} {mib}")
    if left:
        anomaly(where, f"left behind: {left}")
        kill_pids([pid for pid, _, _ in left])
    evs = read_events(ev)
    rec = {"mib": mib, "faulty_replica": replica, "role": "leader" if replica == 0 else "follower",
           "flip": flip, "flipped_write": flipped_write(evs),
           "exit_code": code, "wall_s": wall, "timed_out": timed_out, "output_ok": out.read_bytes() == expected,
           "events": [e.get("kind") for e in evs]}
    if calibrating:
        return rec
    if rec["flipped_write"] != RECOVERY_FLIP_WRITE:
        anomaly(where, f"the flip at stop {stop} hit write {rec['flipped_write']}, not write {RECOVERY_FLIP_WRITE}")
    if code != 0 or timed_out:
        anomaly(where, f"exit status {code}{' (timed out)' if timed_out else ''}: {err.read_text(errors='replace')[-400:]}")
    if not rec["output_ok"]:
        anomaly(where, "stdout differs from the native output")
    kinds = {e.get("kind"): e for e in evs}
    for e in evs:
        if e.get("kind") == "vote" and e.get("action") == "kill":
            rec["voted_out"] = e.get("replica")
            rec["vote_us"] = e.get("duration_us")
        if e.get("kind") == "divergence":
            rec.setdefault("divergence_us", e.get("duration_us"))
    if "mask" in kinds:
        rec["mask_us"] = kinds["mask"].get("duration_us")
    else:
        anomaly(where, f"no mask event (events: {rec['events']})")
    if "reintegrate" in kinds:
        r = kinds["reintegrate"]
        rec["reintegrate_us"] = r.get("duration_us")
        for v in r.get("values") or []:
            if isinstance(v, str) and v.startswith("resident_kib="):
                rec["resident_kib"] = int(v.split("=", 1)[1])
    else:
        anomaly(where, f"no reintegrate event (events: {rec['events']})")
    if rec.get("voted_out") not in (None, replica):
        anomaly(where, f"vote killed replica {rec['voted_out']}, the flip was in {replica}")
    return rec


def bench_recovery(quick, tmp):
    sizes = [16, 256] if quick else [16, 64, 256, 1024]
    reps = 1 if quick else 5
    binary = tmp / "recovery"
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-static", "-o", str(binary), str(ROOT / "bench" / "recovery.c")], check=True)
    # Calibrate: flip at the documented stop and see which write it hit.
    expected16 = subprocess.run([str(binary), "16"], capture_output=True, timeout=120).stdout
    cal = recovery_once(binary, 16, 1, expected16, tmp, 180, calibrating=True)
    stop = RECOVERY_FLIP_STOP
    if cal["flipped_write"]:
        stop = RECOVERY_FLIP_STOP + RECOVERY_FLIP_WRITE - cal["flipped_write"]
    else:
        anomaly("recovery calibration", f"flip at stop {RECOVERY_FLIP_STOP} hit no write (events {cal['events']})")
    log(f"recovery: write {RECOVERY_FLIP_WRITE} is intercepted stop {stop}")
    res = {"sizes_mib": sizes, "reps": reps, "flip": f"R:{stop}:{RECOVERY_FLIP_SPEC}", "flip_stop": stop,
           "flip_write": RECOVERY_FLIP_WRITE, "calibration": cal, "runs": [], "native_fork_us": {}}
    for mib in sizes:
        expected = subprocess.run([str(binary), str(mib)], capture_output=True, timeout=120).stdout
        fk = subprocess.run([str(binary), str(mib), "fork"], capture_output=True, text=True, timeout=120).stdout
        m = re.search(r"fork_us (\d+)", fk)
        res["native_fork_us"][mib] = int(m.group(1)) if m else None
        for rep in range(reps):
            for replica in (1, 0):
                log(f"recovery: {mib} MiB, flip in replica {replica}, rep {rep + 1}/{reps}")
                res["runs"].append(recovery_once(binary, mib, replica, expected, tmp, 180, stop))
    mask = {}
    for role in ("follower", "leader"):
        xs = [r["mask_us"] for r in res["runs"] if r["role"] == role and r.get("mask_us") is not None]
        mask[role] = {"n": len(xs), "median_us": median(xs), "min_us": min(xs, default=None), "max_us": max(xs, default=None),
                      "goal_us": GOALS[f"mask_{role}_us"], "anchor_us": GOALS[f"mask_anchor_{role}_us"]}
    res["mask_summary"] = mask
    reint = []
    for mib in sizes:
        rs = [r for r in res["runs"] if r["mib"] == mib and r.get("reintegrate_us") is not None]
        ms = median(r["reintegrate_us"] / 1000 for r in rs)
        kib = median(r.get("resident_kib") for r in rs)
        by_role = {role: median(r["reintegrate_us"] / 1000 for r in rs if r["role"] == role) for role in ("follower", "leader")}
        reint.append({"mib": mib, "n": len(rs), "median_ms": ms, "median_ms_by_faulty_role": by_role,
                      "min_ms": min((r["reintegrate_us"] / 1000 for r in rs), default=None),
                      "max_ms": max((r["reintegrate_us"] / 1000 for r in rs), default=None),
                      "resident_kib": kib,
                      "ms_per_gib": ms / (kib / 1048576) if ms is not None and kib else None,
                      "goal_ms": GOALS["reintegrate_ms_per_gib"] * (kib / 1048576) if kib else None,
                      "native_fork_ms": res["native_fork_us"][mib] / 1000 if res["native_fork_us"].get(mib) else None})
    res["reintegrate_summary"] = reint
    return res


# --------------------------------------------------------------------------------------
# Charts: bench/charts.py (matplotlib)


def nice_max(v, floor):
    """The smallest 1/2/2.5/5 x 10^k at least 12% above max(v, floor)."""
    v = max(v or 0, floor) * 1.12
    e = 10 ** (len(str(int(v))) - 1) if v >= 1 else 0.001
    while True:
        for m in (1, 2, 2.5, 5):
            if m * e >= v:
                return m * e
        e *= 10


def pct(v):
    return f"{100 * v:.0f}%"


def charts(results, chart_dir):
    files = {}
    if "redis" in results:
        s = results["redis"]["summary"]
        groups = [f"{'DMR' if r['replicas'] == 2 else 'TMR'} {r['compare']}" for r in s]
        marks = {i: [(r["goal"], f"goal {pct(r['goal'])}"),
                     (int(r["anchor"].split("-")[0]) / 100, f"RCoE {r['anchor']}")] for i, r in enumerate(s)}
        top = max([v for r in s for v in (r["SET_fraction"], r["GET_fraction"]) if v] + [0.95])
        files["redis_throughput.svg"] = bar_chart(
            "redis-benchmark throughput under lockstep run, fraction of native", "throughput / native",
            groups, [("SET", "#4e79a7", [r["SET_fraction"] for r in s]), ("GET", "#f28e2b", [r["GET_fraction"] for r in s])],
            nice_max(top, 1.0) if top > 1 else 1.0, pct, group_marks=marks,
            note="median over rounds; each run divided by the native runs just before and after it")
    if "xz" in results:
        runs = [x for x in results["xz"]["summary"] if x["kind"] != "native"]
        groups = [x["kind"] for x in runs]
        cpu = [x.get("cpu_per_replica_vs_native") for x in runs]
        wall = [x.get("wall_vs_native") for x in runs]
        top = max([v for v in cpu + wall if v] + [1.1])
        files["xz_overhead.svg"] = bar_chart(
            f"xz -9 -T1 on {results['xz']['file_bytes'] / 1e6:.0f} MB: per-replica CPU and wall time vs native (median)",
            "ratio to native (1.0 = native)",
            groups, [("CPU per replica (or per copy)", "#59a14f", cpu), ("wall time", "#9c755f", wall)],
            nice_max(top, 1.1), lambda v: f"{v:.2f}", hlines=[(1 + GOALS["xz_cpu_overhead"], "CPU goal 1.02", "#c00")],
            note="native xN pinned = N plain xz processes at once, pinned like lockstep's replicas (no lockstep)")
    if "recovery" in results:
        rs = results["recovery"]["reintegrate_summary"]
        groups = [f"{r['mib']} MiB" for r in rs]
        vals = [r["median_ms"] for r in rs]
        fork = [r["native_fork_ms"] for r in rs]
        marks = {i: [(r["goal_ms"], f"goal {r['goal_ms']:.1f}")] for i, r in enumerate(rs) if r["goal_ms"]}
        top = max([v for v in vals + fork if v] + [r["goal_ms"] or 0 for r in rs] + [1])
        files["reintegration.svg"] = bar_chart(
            "Re-integration to TMR vs resident memory (median)", "milliseconds",
            groups, [("lockstep re-integration", "#e15759", vals), ("native fork() of same process", "#bab0ac", fork)],
            nice_max(top, 1), lambda v: f"{v:.1f}" if v < 100 else f"{v:.0f}", group_marks=marks,
            note="goal: 50 ms per GiB resident (dashed)")
        m = results["recovery"]["mask_summary"]
        groups = ["faulty follower", "faulty leader"]
        vals = [m["follower"]["median_us"], m["leader"]["median_us"]]
        marks = {0: [(m["follower"]["goal_us"], "goal 10"), (m["follower"]["anchor_us"], "RCoE 8")],
                 1: [(m["leader"]["goal_us"], "goal 100")]}
        top = max([v for v in vals if v] + [110])
        files["masking.svg"] = bar_chart(
            "Masking time under -r 3 (median, from mask events)", "microseconds", groups,
            [("masking time", "#76b7b2", vals)], nice_max(top, 110), lambda v: f"{v:.0f}", group_marks=marks,
            note=f"RCoE anchor for a faulty leader: {GOALS['mask_anchor_leader_us']} us")
    chart_dir.mkdir(parents=True, exist_ok=True)
    for name, svg in files.items():
        (chart_dir / name).write_text(svg)
    return list(files)


# --------------------------------------------------------------------------------------
# Markdown

BEGIN, END = "<!-- bench/run.py: begin -->", "<!-- bench/run.py: end -->"


def f1(v, unit=""):
    return "n/a" if v is None else f"{v:,.1f}{unit}"


def f0(v, unit=""):
    return "n/a" if v is None else f"{v:,.0f}{unit}"


def fpct(v):
    return "n/a" if v is None else f"{100 * v:.1f}%"


def verdict(ok):
    return "n/a" if ok is None else ("meets" if ok else "misses")


def markdown(results, chart_rel, command, json_rel):
    m = results["machine"]
    lines = [
        "# Benchmark results: `lockstep run`", "",
        f"Produced by `{command}` (`make bench` runs the same after building lockstep and installing "
        f"redis-server, redis-tools and xz-utils). Raw numbers: `{json_rel}`.", "",
        f"- date: {m['date']}, total benchmark time {results['duration_s'] / 60:.1f} min",
        f"- machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_total_kib'] // 1048576 if m['mem_total_kib'] else '?'} GiB, "
        f"kernel {m['kernel']}, {m['os']}",
        f"- lockstep {m['lockstep_version']} at commit `{m['git_commit'][:12]}`{' (work tree has uncommitted changes)' if m['git_dirty'] else ''}",
        f"- {m['redis_version'].split(' sha')[0]}; {m['xz_version']}; load average at start {m['loadavg_start'][0]:.2f}, "
        f"at end {results['loadavg_end'][0]:.2f}",
        "- The machine is shared and small (2 cores), so every ratio below is taken side by side in the same run; "
        "nothing asserts on timing. Goals and anchors are from the product brief.", "",
    ]
    kept = results.get("kept_from_previous")
    if kept:
        notes = []
        for section in kept["sections"]:
            prov = results.get(section, {}).get("provenance") or {"command": kept["command"], "commit": kept["commit"]}
            notes.append(f"{section} by `{prov['command']}` at commit `{(prov.get('commit') or '?')[:12]}`")
        lines[-1:-1] = ["- sections measured by earlier runs: " + "; ".join(notes)
                        + ". Only the others were measured by the command above."]
    if "redis" in results:
        lines += md_redis(results["redis"], chart_rel)
    if "xz" in results:
        lines += md_xz(results["xz"], chart_rel)
    if "recovery" in results:
        lines += md_recovery(results["recovery"], chart_rel)
    lines += ["## Misbehaviour seen during the run", ""]
    if results["anomalies"]:
        for a in results["anomalies"]:
            lines.append(f"- {a['where']}: {a['what']}")
    else:
        lines.append("None: every lockstep run exited with the expected status, the replicated output was right, "
                     "no run hit its time limit and no process was left behind.")
    lines.append("")
    return "\n".join(lines)


def md_redis(r, chart_rel):
    nat = r["native_summary"]
    out = [
        "## 1. redis-benchmark throughput vs native", "",
        "Command: `python3 bench/run.py` (section `redis`). Each configuration starts "
        "`redis-server --port P --save '' --appendonly no` (natively or under `lockstep run -r N --compare MODE`) and drives "
        "it from outside the replica set with `redis-benchmark -p P -t set,get -n N -c 50 -P 1 --csv -q`. "
        f"N is chosen per configuration for about {r['target_s_per_op']:.0f} s per operation (native: "
        f"{r['native_target_s_per_op']:.0f} s). The order is native, config, native, config, ..., native, "
        + (f"{r['rounds']} rounds, the second in reverse order" if r["rounds"] > 1 else "one round")
        + "; each replicated run is divided by the mean of the "
        "native runs right before and after it, and the table shows the median over rounds. Client and server "
        "share the same 2 cores.", "",
        "| configuration | SET rps | GET rps | native SET / GET rps | SET % of native | GET % of native | goal | anchor (RCoE LC) | verdict | lockstep failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        f"| native | {f0(nat['SET']['median_rps'])} | {f0(nat['GET']['median_rps'])} | "
        f"({nat['SET']['runs']} runs, SET {f0(nat['SET']['min_rps'])}-{f0(nat['SET']['max_rps'])}) | 100% | 100% | | | | |",
    ]
    for s in r["summary"]:
        fr = [s["SET_fraction"], s["GET_fraction"]]
        ok = None if None in fr else min(fr) >= s["goal"]
        out.append(f"| `{s['label']}` | {f0(s['SET_rps'])} | {f0(s['GET_rps'])} | {f0(s['SET_native_rps'])} / {f0(s['GET_native_rps'])} | "
                   f"{fpct(s['SET_fraction'])} | {fpct(s['GET_fraction'])} | ≥ {s['goal'] * 100:.0f}% | {s['anchor']} | {verdict(ok)} | "
                   f"{s['failed_server_runs']} of {s['server_runs']} |")
    nfail = sum(s["failed_server_runs"] for s in r["summary"])
    if nfail:
        errs = sorted({ln for f in r["failed_runs"] for ln in f.get("error_lines", [])})
        out += ["", f"*Lockstep failures:* {nfail} of {sum(s['server_runs'] for s in r['summary'])} replicated server runs "
                "(counting the `--stats` runs) ended abnormally and were repeated, up to 3 attempts; their numbers are "
                "not in the table. Errors: " + ("; ".join(f"`{e}`" for e in errs) if errs else "see results.json") + "."]
    out += ["", f"![redis throughput fraction]({chart_rel}/redis_throughput.svg)", "",
            "Where the time goes (one extra run per configuration with `--stats`, "
            f"n = {r['stats_runs'][0]['n']} per operation):", "",
            "| configuration | syscalls intercepted | per request | ns per intercepted syscall | monitor time per request | "
            "request time at that rate | monitor busy (of wall) | monitor CPU |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in r["summary"]:
        st = s["stats"] or {}
        out.append(f"| `{s['label']}` | {f0(st.get('syscalls_intercepted'))} | {f1(st.get('intercepted_per_request'))} | "
                   f"{f0(st.get('ns_per_intercepted_syscall'))} | {f1(st.get('monitor_us_per_request'), ' µs')} | "
                   f"{f1(st.get('us_per_request'), ' µs')} | {fpct(st.get('monitor_busy_fraction'))} | {f1(st.get('monitor_cpu_s'), ' s') if st.get('monitor_cpu_s') is not None else 'n/a'} |")
    fr = [x for s in r["summary"] for x in (s["SET_fraction"], s["GET_fraction"]) if x is not None]
    best = max(fr) if fr else None
    sts = [s["stats"] for s in r["summary"] if s["stats"]]
    spr = median(st.get("intercepted_per_request") for st in sts)
    nsps = median(st.get("ns_per_intercepted_syscall") for st in sts)
    natus = 1e6 / mean([nat["SET"]["median_rps"], nat["GET"]["median_rps"]]) if nat["SET"]["median_rps"] else None
    busy = median(st.get("monitor_busy_fraction") for st in sts)
    requs = median(st.get("us_per_request") for st in sts)
    out += ["", "**Interpretation.** "
            + (f"Replicated redis reaches at best {fpct(best)} of native throughput here, far below the goals "
               f"(≥ 90% DMR, ≥ 85% TMR) and below the RCoE anchors (74-79% / 68-73%). " if best is not None and best < 0.68 else
               f"Best configuration: {fpct(best)} of native. " if best is not None else "")
            + (f"Every request costs about {spr:.1f} intercepted syscalls (epoll_wait, read and write, plus accept "
               f"and setup per connection) and each intercepted syscall costs about {nsps / 1000:.0f} µs of time in the "
               "monitor (ptrace stops of every replica, rendezvous, vote, copying inputs to the followers). "
               f"That is {fpct(busy)} of the wall time; the rest of each request's {requs:.0f} µs is waiting: replicas "
               "being stopped and resumed, and 2-3 replicas, the monitor and redis-benchmark's 50 clients sharing 2 "
               f"cores. A native request takes about {natus:.0f} µs at the native rate, so 90% of native leaves "
               f"{natus * (1 / 0.9 - 1):.1f} µs of added time per request, about {natus * (1 / 0.9 - 1) / spr * 1000:.0f} ns "
               f"per intercepted syscall, about {nsps / (natus * (1 / 0.9 - 1) / spr * 1000):.0f}× less than the "
               "measured time in the monitor per intercepted syscall. "
               if spr and nsps and natus and busy and requs else "")
            + mode_spread_text(r["summary"]), ""]
    return out


def mode_spread_text(summary):
    """Says whether the comparison mode matters, from the numbers."""
    txt = []
    for reps in (2, 3):
        fr = [statistics.fmean([s["SET_fraction"], s["GET_fraction"]]) for s in summary
              if s["replicas"] == reps and s["SET_fraction"] is not None and s["GET_fraction"] is not None]
        if len(fr) >= 2:
            txt.append(f"with -r {reps} the three comparison modes span {fpct(min(fr))} to {fpct(max(fr))}")
    if not txt:
        return ""
    return ("Comparison mode: " + "; ".join(txt) + ". Every replica still stops at every intercepted syscall in all three modes (in io mode the leader no longer waits for the followers at inputs, but each follower still stops to take the leader's result), so "
            "a small spread means that the cost of stopping and resuming every replica at each intercepted syscall, "
            "not what is compared, dominates the gap; closing it needs a much cheaper per-syscall rendezvous.")


def md_xz(x, chart_rel):
    mb = x["file_bytes"] / 1e6
    order = "native, -r 2, native x2, -r 3, native x3, native"
    if x["rounds"] > 1:
        order += ", then the same in reverse (native x3, -r 3, native x2, -r 2, native)"
    out = ["## 2. CPU-bound: `xz -9 -T1`", "",
           f"Command: `python3 bench/run.py` (section `xz`). Input: {mb:.1f} MB of generated, deterministic word text. "
           "Each run is `xz -9 -T1 -c FILE > /dev/null`, natively or under `lockstep run -r N --stats -q --`. CPU time is the "
           "rusage that `wait4` returns for the lockstep process, which includes the monitor and every replica it reaped; "
           f"per-replica CPU = (that total − monitor CPU time from `--stats`) / N. Order: {order}. "
           "`lockstep run` pins replica i to CPU i mod 2 by default (so `-r 3` puts replicas 0 and 2 "
           "on CPU 0); the `native xN pinned` rows run N plain xz processes at once with the same pinning, i.e. the same "
           "load on the cores, their caches and the shared L3, without lockstep. \"vs native\" divides by the mean of "
           "all lone native runs; \"vs pinned control\" divides by the `native xN pinned` run of the same round.", "",
           "| run | runs | wall s | CPU s total | monitor CPU s | CPU s per replica / copy | per-replica CPU vs native | "
           "vs pinned control | wall vs native | goal | anchor (Romain) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in x["summary"]:
        lk = bool(r.get("replicas"))
        out.append(f"| {r['kind']} | {r['runs']} | {r['wall_s']:.1f} | {r['cpu_s_total']:.1f} | "
                   f"{f1(r['monitor_cpu_s']) if lk else ''} | {f1(r['cpu_per_unit_s'])} | {fpct(r['cpu_per_replica_vs_native'])} | "
                   f"{fpct(r['cpu_per_replica_vs_control']) if lk else ''} | {r['wall_vs_native']:.2f}× | "
                   f"{'≤ 102%' if lk else ''} | {'101.8%' if lk else ''} |")
    out += ["", "Every run, in the order it ran (the table above shows medians):", "",
            "| # | round | run | wall s | CPU s total | monitor CPU s | CPU s per replica / copy | vs native | vs pinned control | "
            "intercepted syscalls | exit |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(x["runs"], 1):
        lk = bool(r.get("replicas"))
        code = r.get("exit_code", max(r.get("exit_codes", [0]), key=abs))
        out.append(f"| {i} | {r['round'] + 1} | {r['kind']} | {r['wall_s']:.1f} | {r['cpu_s_total']:.1f} | "
                   f"{f1(r.get('monitor_cpu_s')) if lk else ''} | {f1(r['cpu_per_unit_s'])} | {fpct(r['cpu_per_replica_vs_native'])} | "
                   f"{fpct(r.get('cpu_per_replica_vs_control')) if lk else ''} | "
                   f"{(r.get('stats') or {}).get('syscalls_intercepted', '') if lk else ''} | {code} |")
    out += ["", f"![xz ratios]({chart_rel}/xz_overhead.svg)", ""]
    nat = [r["cpu_per_unit_s"] for r in x["runs"] if r["kind"] == "native"]
    spread = (max(nat) - min(nat)) / statistics.fmean(nat) if len(nat) > 1 else None
    parts = []
    more = lambda v: f"{fpct(abs(v - 1))} {'more' if v >= 1 else 'less'}"  # noqa: E731
    for r in x["summary"]:
        if not r.get("replicas") or r["cpu_per_replica_vs_native"] is None:
            continue
        parts.append(f"under `-r {r['replicas']}` each replica used {more(r['cpu_per_replica_vs_native'])} CPU than a lone "
                     "native xz"
                     + (f" and {more(r['cpu_per_replica_vs_control'])} than each of {r['replicas']} pinned native copies "
                        "run together" if r["cpu_per_replica_vs_control"] else "")
                     + f" (monitor {f1(r['monitor_cpu_s'])} s for {f0(r['syscalls_intercepted'])} intercepted syscalls); "
                     f"wall time {r['wall_vs_native']:.2f}× native")
    text = "; ".join(parts)
    out += ["**Interpretation.** " + (text[0].upper() + text[1:] + ". " if parts else "")
            + (f"The lone native runs themselves differ by {fpct(spread)} (max − min over mean), so on this shared "
               "machine differences of a few percent are within noise. " if spread is not None else "")
            + "xz makes few syscalls (large reads and writes), so the monitor itself costs little CPU. The pinned "
            "controls separate what lockstep adds from what running N copies of a memory-hungry compressor (64 MiB "
            "dictionary at -9) on the same cores and caches costs anyway; the ≤ 2% goal is about the former. "
            "With 3 replicas on 2 cores, two "
            "replicas share CPU 0, so the wall time is at least about 2× native, and every rendezvous makes the "
            "replica alone on CPU 1 wait for them.", ""]
    return out


def md_recovery(rc, chart_rel):
    m = rc["mask_summary"]
    out = ["## 3. Recovery under `-r 3`: masking and re-integration", "",
           "Command: `python3 bench/run.py` (section `recovery`). Workload: `bench/recovery.c` (static, `gcc -O2 -static`), "
           "which makes SIZE MiB resident and then writes 20 lines with one write(2) each. Run as "
           f"`lockstep run -r 3 -q --events F --test-flip R:{rc['flip_stop']}:{RECOVERY_FLIP_SPEC} -- recovery SIZE`: bit 1 of the "
           f"first byte of write #{RECOVERY_FLIP_WRITE} (intercepted stop {rc['flip_stop']}, found by a calibration run and "
           "checked in every run from the divergent line) is flipped in replica R, "
           "R = 1 (a follower) or R = 0 (the leader). Masking time is the `duration_us` of the `mask` event (from detection "
           "until the survivors continue); re-integration time and resident size come from the `reintegrate` event. "
           f"{rc['reps']} repetition{'s' if rc['reps'] > 1 else ''} per size and role; medians shown.", "",
           "| faulty replica | runs | median masking time | min | max | goal | anchor (RCoE) | verdict |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for role in ("follower", "leader"):
        s = m[role]
        ok = None if s["median_us"] is None else s["median_us"] <= s["goal_us"]
        out.append(f"| {role} | {s['n']} | {f0(s['median_us'], ' µs')} | {f0(s['min_us'], ' µs')} | {f0(s['max_us'], ' µs')} | "
                   f"≤ {s['goal_us']} µs | {s['anchor_us']} µs | {verdict(ok)} |")
    out += ["", f"![masking time]({chart_rel}/masking.svg)", "",
            "| resident (SIZE) | resident KiB (event) | runs | median re-integration | after follower fault | after leader fault | "
            "min | max | per GiB resident | native fork() of the same process | goal (50 ms/GiB) | verdict |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in rc["reintegrate_summary"]:
        ok = None if s["ms_per_gib"] is None else s["ms_per_gib"] <= GOALS["reintegrate_ms_per_gib"]
        br = s["median_ms_by_faulty_role"]
        out.append(f"| {s['mib']} MiB | {f0(s['resident_kib'])} | {s['n']} | {f1(s['median_ms'], ' ms')} | "
                   f"{f1(br['follower'], ' ms')} | {f1(br['leader'], ' ms')} | {f1(s['min_ms'], ' ms')} | "
                   f"{f1(s['max_ms'], ' ms')} | {f1(s['ms_per_gib'], ' ms')} | {f1(s['native_fork_ms'], ' ms')} | "
                   f"{f1(s['goal_ms'], ' ms')} | {verdict(ok)} |")
    out += ["", f"![re-integration]({chart_rel}/reintegration.svg)", ""]
    fm, lm = m["follower"]["median_us"], m["leader"]["median_us"]
    big = rc["reintegrate_summary"][-1]
    txt = "**Interpretation.** "
    if fm is not None and lm is not None:
        txt += (f"Masking a faulty follower took a median {fm:.0f} µs ({verdict(fm <= GOALS['mask_follower_us'])} the ≤ 10 µs goal; "
                f"RCoE 8 µs) and a faulty leader {lm:.0f} µs ({verdict(lm <= GOALS['mask_leader_us'])} the ≤ 100 µs goal; "
                "RCoE 532 µs). ")
    if big.get("ms_per_gib") is not None:
        txt += (f"Re-integration forks a fresh replica from a healthy one; at {big['mib']} MiB resident it took "
                f"{big['median_ms']:.1f} ms, i.e. {big['ms_per_gib']:.1f} ms per GiB "
                f"({verdict(big['ms_per_gib'] <= GOALS['reintegrate_ms_per_gib'])} the ≤ 50 ms/GiB goal). ")
        if big.get("native_fork_ms"):
            share = big["native_fork_ms"] / big["median_ms"]
            txt += (f"A plain native fork() of the same process takes {big['native_fork_ms']:.1f} ms "
                    f"({fpct(share)} of that): fork copies page tables, not pages (copy-on-write), and "
                    + ("that kernel work is most of the re-integration time at this size. " if share >= 0.5 else
                       "the rest is lockstep's own work around it. "))
        small = rc["reintegrate_summary"][0]
        if small.get("ms_per_gib") and small["ms_per_gib"] > GOALS["reintegrate_ms_per_gib"]:
            txt += (f"At {small['mib']} MiB fixed costs dominate ({small['median_ms']:.1f} ms), so the per-GiB figure "
                    "is far above the goal even though the absolute time is small.")
        br = [s["median_ms_by_faulty_role"] for s in rc["reintegrate_summary"]]
        if all(b["leader"] and b["follower"] for b in br):
            slower = sum(1 for b in br if b["leader"] > b["follower"])
            if slower == len(br):
                txt += " At every size, re-integration after a leader fault took longer than after a follower fault."
            elif slower == 0:
                txt += " At every size, re-integration after a follower fault took longer than after a leader fault."
    out += [txt, ""]
    return out


def write_markdown(path, body):
    block = f"{BEGIN}\n{body}\n{END}\n"
    if path.exists():
        old = path.read_text()
        if BEGIN in old and END in old:
            pre, rest = old.split(BEGIN, 1)
            post = rest.split(END, 1)[1].lstrip("\n")
            path.write_text(pre + block + ("\n" + post if post else ""))
            return
        if old.strip():
            path.write_text(old.rstrip("\n") + "\n\n" + block)
            return
    path.write_text(block)


# --------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description="Benchmarks for lockstep run")
    ap.add_argument("--quick", action="store_true", help="about 2 minutes; writes bench/out/quick/ only")
    ap.add_argument("--only", default="redis,xz,recovery", help="comma-separated subset of redis,xz,recovery")
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: rebuild the Markdown and SVG charts from the existing results.json")
    args = ap.parse_args()
    if args.render_only:
        return render(args.quick)
    which = [w.strip() for w in args.only.split(",") if w.strip()]
    for w in which:
        if w not in ("redis", "xz", "recovery"):
            ap.error(f"unknown benchmark {w!r}")
    ensure_tools()
    command = "python3 bench/run.py" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only != ap.get_default("only") else "")
    out_dir = ROOT / "bench" / "out" / ("quick" if args.quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"command": command, "quick": args.quick, "machine": machine_info(), "goals": GOALS}
    # A partial run (--only) keeps the other sections of the previous results, and says so.
    previous_path = out_dir / "results.json"
    if previous_path.exists() and set(which) != {"redis", "xz", "recovery"}:
        previous = json.loads(previous_path.read_text())
        kept = []
        for section in ("redis", "xz", "recovery"):
            if section not in which and section in previous:
                results[section] = previous[section]
                kept.append(section)
        if kept:
            results["kept_from_previous"] = {
                "sections": kept,
                "command": previous.get("command"),
                "commit": previous.get("machine", {}).get("git_commit"),
            }
    log(f"{command}: {results['machine']['nproc']} CPUs, {results['machine']['cpu_model']}, commit {results['machine']['git_commit'][:12]}")
    with tempfile.TemporaryDirectory(prefix="lockstep-bench-") as t:
        tmp = Path(t)
        global LOCKSTEP
        LOCKSTEP = tmp / "lockstep"
        shutil.copy2(BUILT_LOCKSTEP, LOCKSTEP)
        try:
            provenance = {"command": command, "commit": results["machine"]["git_commit"],
                          "date": results["machine"]["date"]}
            if "redis" in which:
                results["redis"] = bench_redis(args.quick, tmp)
                results["redis"]["provenance"] = provenance
            if "xz" in which:
                results["xz"] = bench_xz(args.quick, tmp)
                results["xz"]["provenance"] = provenance
            if "recovery" in which:
                results["recovery"] = bench_recovery(args.quick, tmp)
                results["recovery"]["provenance"] = provenance
        finally:
            results["duration_s"] = round(time.monotonic() - T0, 1)
            results["loadavg_end"] = os.getloadavg()
            results["anomalies"] = ANOMALIES
            (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    md_path, names = publish(results, args.quick)
    log(f"done in {results['duration_s'] / 60:.1f} min: {out_dir / 'results.json'}, {md_path}, "
        f"{', '.join(names)}; {len(ANOMALIES)} anomalies")
    return 0


def publish(results, quick):
    """Writes the Markdown and the SVG charts for `results` (quick runs stay under bench/out/quick/)."""
    out_dir = ROOT / "bench" / "out" / ("quick" if quick else "")
    if quick:
        chart_dir, md_path = out_dir / "charts", out_dir / "results.md"
    else:
        chart_dir, md_path = ROOT / "docs" / "charts", ROOT / "docs" / "results.md"
    names = charts(results, chart_dir)
    json_rel = (out_dir / "results.json").relative_to(ROOT)
    write_markdown(md_path, markdown(results, "charts", results["command"], json_rel))
    return md_path, [str(chart_dir / n) for n in names]


def render(quick):
    path = ROOT / "bench" / "out" / ("quick" if quick else "") / "results.json"
    results = json.loads(path.read_text())
    md_path, names = publish(results, quick)
    log(f"rendered {path} into {md_path}, {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
