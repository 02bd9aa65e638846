#!/usr/bin/env python3
"""Benchmarks for `lockstep kv` (CrossCheck), against its own baselines measured in the
same run. Usage: bench/kv_bench.py [SECONDS] [ROUNDS]   (default 5 s per point, 3 rounds)

1. Throughput: memcaslap (libmemcached-tools) with 1, 16 and 64 connections (KV_BENCH_CONNS,
   space-separated, overrides), on at most 2 threads, each bound to one server by
   memcaslap: a cluster's clients reach its leader and one follower, the same roles in
   every mode (KV_BENCH_SPREAD=all: over every replica; see memcaslap()), key 64 B,
   value 400 B (the paper's value size), for two mixes: 100% set and 90% get. Configurations:
   memcached 1.6 itself (Debian's, -m 64 -c 1024), then CrossCheck's Table IV: single (one
   process, no protection), smr (3 replicas on Raft), gop (+ object checks), crosscheck
   (+ validation and repair). All five run side by side for the whole measurement (each
   on its own ports; the idle ones only tick), and every point is measured mode after
   mode, in alternating order, so that the runs a ratio compares are seconds apart and
   machine noise hits them alike; the ratios (per round, then the median) are single
   and smr against memcached, and crosscheck / smr.
2. Latency: one connection to replica 1 (the leader after start-up), one request at a
   time, 500 requests/s (90% get, 400 B): median and p99, and crosscheck - smr.
3. Repair: 3-replica crosscheck cluster with --test-corruption; N corruptions (item, bucket
   and LRU links, at rest and during access) on a follower and on the leader, each followed
   by a request that touches the object. From the events: detection to repaired (divergence
   event to repair event on the failed replica) and the repair step itself (the repair
   event's duration: RECOVER applied to objects replaced).

All replicas run on this one machine over loopback with --no-fsync, so the numbers
include three replicas competing for 2 cores. Writes bench/out/kv.json, bench/out/kv.md
and bench/out/kv.svg. Nothing here asserts on timing.
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from charts import bar_chart

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "lockstep")
OUT = os.path.join(ROOT, "bench", "out")

def _args():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("seconds", nargs="?", type=int, default=5, help="seconds per point (default 5)")
    ap.add_argument("rounds", nargs="?", type=int, default=3, help="measuring rounds (default 3)")
    a = ap.parse_args()
    if a.seconds < 1 or a.rounds < 1:
        ap.error("SECONDS and ROUNDS must be positive")
    return a.seconds, a.rounds


SECONDS, ROUNDS = 5, 3  # main() sets them from the command line
MODES = ["memcached", "single", "smr", "gop", "crosscheck"]
MIXES = [("set", 0.0), ("90% get", 0.9)]
PACED_RATE = 500
CONNS = [int(c) for c in os.environ.get("KV_BENCH_CONNS", "1 16 64").split()]
SPREAD = os.environ.get("KV_BENCH_SPREAD", "two")
if SPREAD not in ("two", "all"):
    raise SystemExit("KV_BENCH_SPREAD is two (the default) or all")
PORT = 17311


def cmd(port, line, timeout=10):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(line.encode() + b"\r\n")
        out = b""
        while not out.endswith(b"\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            if line.startswith("stats") and not out.endswith(b"END\r\n"):
                continue
        return out.decode()


def start_memcached(port=PORT):
    """Debian's memcached with the memory and connection limits kv uses by default."""
    args = ["memcached", "-p", str(port), "-U", "0", "-l", "127.0.0.1", "-m", "64", "-c", "1024"]
    if os.geteuid() == 0:
        args += ["-u", "root"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            if cmd(port, "version").startswith("VERSION"):
                return proc, 1
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("memcached did not start (scripts/deps.sh installs it)")


def start(mode, events=None, extra=(), port=PORT):
    """Start `mode` with its first client port at `port` (its replicas' peers at port + 10000):
    returns the process and the number of client ports."""
    if mode == "memcached":
        return start_memcached(port)
    n = 1 if mode == "single" else 3
    args = [BIN, "kv", "cluster", "-n", str(n), "--port", str(port), "--mode", mode, "--no-fsync", *extra]
    if events:
        args += ["--events", events]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            roles = [cmd(port + i, "stats kv") for i in range(n)]
            if all(("kv_role leader" in r or "kv_role follower" in r or "kv_role single" in r) for r in roles) and \
                    any("kv_role leader" in r or "kv_role single" in r for r in roles):
                return proc, n
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("cluster in mode %s did not start" % mode)


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    time.sleep(0.5)


def memcaslap(n, get_ratio, conns, seconds=None, port=PORT):
    """TPS of memcaslap with `conns` connections to the `n` servers from `port` (key 64 B,
    value 400 B), for `seconds` (SECONDS if None).

    memcaslap binds each of its threads to one server: one process of 2 threads given a
    cluster's ports loads the first two only. So the ports are listed by role, the leader
    first: the same roles carry the clients in every mode (before, which two replicas did
    depended on the election). KV_BENCH_SPREAD=all instead splits the connections evenly
    over every replica, one single-threaded memcaslap each, leader first (it takes the
    remainder), all at once, their TPS added up."""
    seconds = seconds or SECONDS
    with tempfile.NamedTemporaryFile("w", suffix=".cfg", delete=False) as f:
        f.write("key\n64 64 1\nvalue\n400 400 1\ncmd\n0 %.2f\n1 %.2f\n" % (1 - get_ratio, get_ratio))
        cfg = f.name
    by_role = sorted(range(port, port + n), key=lambda p: n > 1 and "kv_role leader" not in cmd(p, "stats kv"))
    if n > 1 and SPREAD == "all":
        share = [conns // n + (1 if i < conns % n else 0) for i in range(n)]
        runs = [([p], c, 1) for p, c in zip(by_role, share) if c > 0]
    else:
        runs = [(by_role, conns, min(2, conns))]
    procs = [subprocess.Popen(["memcaslap", "-s", ",".join("127.0.0.1:%d" % p for p in ports), "-T", str(threads),
                               "-c", str(c), "-t", "%ds" % seconds, "-F", cfg],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for ports, c, threads in runs]
    total = 0
    try:
        for proc in procs:
            out = proc.communicate(timeout=seconds + 60)[0]
            lines = [line for line in out.splitlines() if line.startswith("Run time:")]
            if not lines:
                raise SystemExit("memcaslap printed no totals:\n" + out)
            total += int(lines[-1].split("TPS:")[1].split()[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        os.unlink(cfg)
    return total


def paced(port, count=2000):
    """One connection, one request at a time every 1/PACED_RATE s (90% get, 10% set of
    400 B over 200 keys): the latency of a request on an otherwise idle cluster. Returns
    the median and the 99th percentile in microseconds."""
    value = b"v" * 400
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    f = s.makefile("rb")
    lat = []
    period = 1.0 / PACED_RATE
    next_at = time.perf_counter()
    for i in range(count):
        key = b"lat%d" % (i * 7919 % 200)
        req = (b"set " + key + b" 0 0 400\r\n" + value + b"\r\n") if i % 10 == 0 or i < 200 else b"get " + key + b"\r\n"
        now = time.perf_counter()
        if now < next_at:
            time.sleep(next_at - now)
        next_at += period
        t0 = time.perf_counter()
        s.sendall(req)
        line = f.readline()
        if line.startswith(b"VALUE"):
            f.read(400 + 2)
            line = f.readline()
        lat.append(1e6 * (time.perf_counter() - t0))
        if not (line.startswith(b"STORED") or line.startswith(b"END")):
            raise SystemExit("unexpected reply %r" % line)
    s.close()
    lat = lat[200:]
    lat.sort()
    return statistics.median(lat), lat[int(0.99 * len(lat))]


def roles(n, port=PORT):
    """The client port of the leader and of a follower (the one server for n == 1)."""
    if n == 1:
        return {"leader": port, "follower": port}
    found = {}
    for i in range(n):
        r = cmd(port + i, "stats kv")
        role = "leader" if "kv_role leader" in r else "follower"
        found.setdefault(role, port + i)
    return found


def throughput_and_latency():
    points = [(mix, ratio, c) for c in CONNS for mix, ratio in MIXES]
    tps = {m: {"%s, %d conn" % (mix, c): [] for mix, _, c in points} for m in MODES}
    lat = {m: {"leader": [], "follower": []} for m in MODES}
    # Every mode on its own ports (10 apart; peers 10000 above), all running throughout.
    ports = {mode: PORT + 10 * k for k, mode in enumerate(MODES)}
    running = {}
    try:
        for mode in MODES:
            running[mode] = start(mode, port=ports[mode])
        turn = 0
        for rnd in range(ROUNDS):
            for mix, ratio, c in points:
                # Forward, then backward at the next point: no mode always runs first.
                order = MODES if turn % 2 == 0 else MODES[::-1]
                turn += 1
                for mode in order:
                    t = memcaslap(running[mode][1], ratio, c, port=ports[mode])
                    tps[mode]["%s, %d conn" % (mix, c)].append(t)
                    print("round %d %-10s %-8s %3d conns %7d TPS" % (rnd + 1, mode, mix, c, t), file=sys.stderr)
            for mode in MODES:
                for role, port in roles(running[mode][1], ports[mode]).items():
                    med, p99 = paced(port)
                    lat[mode][role].append((med, p99))
                    print("round %d %-10s latency via %s median %.0f us, p99 %.0f us" % (rnd + 1, mode, role, med, p99),
                          file=sys.stderr)
    finally:
        for proc, _ in running.values():
            stop(proc)
    return tps, lat


def repair_times(count=24):
    evdir = tempfile.mkdtemp(prefix="kv-bench-events-")
    proc, n = start("crosscheck", events=evdir, extra=["--test-corruption", "--max-recoveries", "1000"])
    targets = [(t, r) for t in ("item", "bucket", "links") for r in ("", " recompute")]
    unanswered = 0
    try:
        for i in range(count):
            key = "bench-key-%d" % i
            cmd(PORT, "set %s 0 0 400\r\n%s" % (key, "v" * 400))
            time.sleep(0.2)
            victim = PORT + (i % 3)
            target, how = targets[i % len(targets)]
            cmd(victim, "lockstep_corrupt %s %s%s %d" % (key, target, how, 7 * i + 1))
            try:
                cmd(victim, ("touch %s 1000" if target == "links" else "get %s") % key)
            except OSError:
                unanswered += 1
            time.sleep(0.3)
    finally:
        stop(proc)
    detect_to_repair, repair_step = [], []
    for r in range(1, n + 1):
        events = [json.loads(line) for line in open(os.path.join(evdir, "replica-%d.jsonl" % r))]
        first_divergence = None
        for e in events:
            if e["kind"] == "divergence" and e.get("replica") == r and first_divergence is None:
                first_divergence = e["ts"]
            if e["kind"] == "repair":
                repair_step.append(e["duration_us"])
                if first_divergence is not None:
                    detect_to_repair.append(1e6 * (e["ts"] - first_divergence))
                first_divergence = None
    return {"corruptions": count, "repairs": len(repair_step), "unanswered": unanswered, "detect_to_repair_us": detect_to_repair,
            "repair_step_us": repair_step}


def svg(tps):
    mixes = list(tps[MODES[0]].keys())
    colours = {"memcached": "#222222", "single": "#aaaaaa", "smr": "#4a7ab5", "gop": "#e2a33b", "crosscheck": "#3b9e5a"}
    series = [(mode, colours[mode], [statistics.median(tps[mode][mix]) for mix in mixes]) for mode in MODES]
    peak = max(v for _, _, vals in series for v in vals) * 1.15
    return bar_chart("lockstep kv throughput (median TPS, memcaslap)", "transactions per second", mixes, series,
                     peak, lambda v: "%d" % v)


def newest_source():
    """The newest Rust or C source of the workspace, as (mtime, path)."""
    newest = (0.0, "")
    for top in ("crates", "clib"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".rs", ".c", ".h")):
                    p = os.path.join(d, f)
                    newest = max(newest, (os.path.getmtime(p), p))
    return newest


def require_fresh_binary():
    if not os.path.exists(BIN):
        raise SystemExit("build first: cargo build --release")
    # A stale binary would be measured under the current commit's name.
    when, path = newest_source()
    if when > os.path.getmtime(BIN):
        raise SystemExit("%s is older than %s: build first (make build, or cargo build --release)"
                         % (os.path.relpath(BIN, ROOT), os.path.relpath(path, ROOT)))


def main():
    global SECONDS, ROUNDS
    SECONDS, ROUNDS = _args()
    require_fresh_binary()
    tps, lat = throughput_and_latency()
    rep = repair_times()
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    result = {"seconds": SECONDS, "rounds": ROUNDS, "tps": tps, "paced_latency_us": lat, "repair": rep,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT).stdout.strip()}
    os.makedirs(OUT, exist_ok=True)
    json.dump(result, open(os.path.join(OUT, "kv.json"), "w"), indent=1)
    open(os.path.join(OUT, "kv.svg"), "w").write(svg(tps))
    def ratio(a, b, mix):
        # Per round, then the median: the two runs of a round are seconds apart (each
        # point runs every mode back to back), so machine drift cancels out of each ratio.
        return med([x / y for x, y in zip(tps[a][mix], tps[b][mix])])

    lines = ["### Throughput (median of %d rounds, %d s each, TPS; ratios: median of the per-round ratios)"
             % (ROUNDS, SECONDS), "",
             "| mix, connections | memcached | single | smr | gop | crosscheck | single / memcached | smr / memcached "
             "| crosscheck / smr | gop / smr |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mix in tps[MODES[0]]:
        m = {k: med(tps[k][mix]) for k in MODES}
        lines.append("| %s | %d | %d | %d | %d | %d | %.2f | %.2f | %.2f | %.2f |" % (
            mix, m["memcached"], m["single"], m["smr"], m["gop"], m["crosscheck"], ratio("single", "memcached", mix),
            ratio("smr", "memcached", mix), ratio("crosscheck", "smr", mix), ratio("gop", "smr", mix)))
    lines += ["", "### Latency of one request at a time, %d requests/s (median of rounds)" % PACED_RATE, "",
              "| via | measure | memcached | single | smr | gop | crosscheck | crosscheck - smr |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for role in ("leader", "follower"):
        for name, k in (("median", 0), ("p99", 1)):
            v = {m: med([x[k] for x in lat[m][role]]) for m in MODES}
            lines.append("| %s | %s | %.0f us | %.0f us | %.0f us | %.0f us | %.0f us | %+.0f us |" % (
                role, name, v["memcached"], v["single"], v["smr"], v["gop"], v["crosscheck"], v["crosscheck"] - v["smr"]))
    d, s = rep["detect_to_repair_us"], rep["repair_step_us"]
    lines += ["", "### Repair (%d corruptions, %d repairs, %d requests unanswered)" % (
        rep["corruptions"], rep["repairs"], rep["unanswered"]), "",
              "| measure | median | max |", "|---|---:|---:|",
              "| detection (divergence event) to repaired | %.0f us | %.0f us |" % (med(d), max(d) if d else float("nan")),
              "| repair step (RECOVER applied to objects replaced) | %.0f us | %.0f us |" % (med(s), max(s) if s else float("nan"))]
    md = "\n".join(lines) + "\n"
    open(os.path.join(OUT, "kv.md"), "w").write(md)
    print(md)


if __name__ == "__main__":
    main()
