#!/usr/bin/env python3
"""Where replicated servers pay for `lockstep run`: redis, memcached and nginx natively and
under lockstep's output checks, side by side in one invocation.

Servers and loads (Debian's packages; `scripts/deps.sh bench` installs them), each server on
a free port P of 127.0.0.1, in a fresh directory, in a session of its own:
  - `redis`: `redis-server --port P --bind 127.0.0.1 --save '' --appendonly no`, load
    `redis-benchmark -p P -t get,set -n N -c 50 -q` (its final `SET: x requests per second`
    and `GET: y ...` lines; requests = 2N, requests/s = 2N / (N/x + N/y)), stopped with
    `redis-cli -p P shutdown nosave`;
  - `memcached t1`, `memcached t4`, `memcached default`: `memcached -u root -p P -l
    127.0.0.1` with the set-ups of bench/memcached_bench.py (one or four workers with the
    background threads off, or memcached's defaults, whose background threads can make the
    replicas diverge), load `memcaslap -s 127.0.0.1:P -T 1 -c 8 -t Ss` (its final `TPS:`
    is the requests/s, `Ops:` the requests), stopped with SIGINT;
  - `nginx`: the static 1 KiB file and nginx.conf of bench/nginx_bench.py (one process,
    master_process off; keep-alive), load `http_load -p P -c 50 -n N -u /index.html`
    (bench/http_load.c, one request in flight per connection), stopped with SIGQUIT.
Every server runs natively and under `lockstep run --stats` with `-r 2` (the default
strict output check: the monitor's committer writes each output once every follower voted
its digest), `-r 2 --output-check strict-stop` (the older strict path: a ptrace stop of the
leader at every output), `-r 2 --output-check fast` (the leader checks in process), `-r 3`
and `-r 3 --output-check strict-stop`. Each run waits until the port accepts connections
(nginx: until GET answers 200 with the file's bytes), runs the load, stops the server
gracefully (SIGTERM, then SIGKILL, to its process group if it does not exit within 20 s:
an anomaly) and collects the rusage of the process started (the server, or lockstep and
every replica it reaped) with wait4. Configurations are interleaved server by server,
round by round; --quick runs one round of redis, memcached t1 and nginx with short loads.

Reported per server and configuration, medians over the rounds that did not fail:
  - requests/s, and its share of native (median of the per-round ratios against the native
    run of the same round);
  - CPU µs per request per replica: wait4's ru_utime + ru_stime divided by the replicas (1
    natively) and by the requests, and its ratio to native's (per round). It includes
    lockstep's monitor and committer threads, start-up and shutdown, and the time a replica
    spins waiting for another (a waiting replica spins --spin iterations before it sleeps):
    on a machine with spare CPUs that time costs no throughput, on this one (the load
    generator shares the CPUs) it does;
  - context switches per request: wait4's ru_nvcsw + ru_nivcsw (all replicas and the
    monitor together, not per replica) divided by the requests;
  - from lockstep's --stats block on its stderr, per request: ptrace stops of replica
    threads, /proc reads of the monitor, committer wake-ups, ordered events, outputs
    committed by the committer one by one, outputs posted (the leader went on; the
    committer wrote them in batches) and outputs checked by the monitor at a stop; "-" where
    the block has no such line (the committer's only appear under the default strict check).
A run fails (an anomaly, and its row is marked; the bench goes on) if the server does not
come up, the load fails or yields no throughput, the server dies under load or needs
SIGTERM/SIGKILL, lockstep exits with a status other than 0 or the native server's own
shutdown status, prints a `lockstep run: [KIND]` event line other than `[signal]` (a
divergence, a halt, ...) or no --stats block, or the port still accepts connections
after the exit. Nothing here asserts on timing: the machine may be a small, noisy shared
VM, and only ratios measured in the same invocation mean anything.

Usage (from anywhere):
    cargo build --release --locked -p lockstep-cli
    python3 bench/server_costs.py [--rounds R] [--seconds S] [--redis-requests N]
                                  [--nginx-requests N] [--out DIR] [--quick]
                                  [--servers LIST] [--config CONFIG ...] [--compare PATH]
Defaults: --rounds 3 --seconds 10 --redis-requests 100000 --nginx-requests 50000; --quick
is --rounds 1 --seconds 3 --redis-requests 20000 --nginx-requests 10000, and only the
redis, memcached t1 and nginx servers. Writes DIR/server_costs.json (default bench/out)
with every raw number per round, and prints a markdown table per server on stdout.
"""
import base64
import os
import re
import shlex
import signal
import sys
import tempfile
import time

import benchproc
from benchproc import (BIN, anomaly, cleanup_all, fmt, free_port, killpg, median, pct,
                       port_accepts, read_file, reap, spawn)
import memcached_bench
import nginx_bench

OPTIONS = {
    "-r 2": ["-r", "2"],
    "-r 2 --output-check strict-stop": ["-r", "2", "--output-check", "strict-stop"],
    "-r 2 --output-check fast": ["-r", "2", "--output-check", "fast"],
    "-r 3": ["-r", "3"],
    "-r 3 --output-check strict-stop": ["-r", "3", "--output-check", "strict-stop"],
    # Every replica and the monitor on CPU 0, the load generator free to use CPU 1: how a
    # syscall-heavy server shared with its clients runs fastest on two vCPUs (results §23).
    "-r 2 --cpus 0,0 --monitor-cpu 0": ["-r", "2", "--cpus", "0,0", "--monitor-cpu", "0"],
    "-r 2 --cpus 0,0 --monitor-cpu 0 --output-check strict-stop":
        ["-r", "2", "--cpus", "0,0", "--monitor-cpu", "0", "--output-check", "strict-stop"],
    "-r 2 --cpus 0,0 --monitor-cpu 0 --output-check fast":
        ["-r", "2", "--cpus", "0,0", "--monitor-cpu", "0", "--output-check", "fast"],
}
# Native on CPU 0 is the baseline of the one-CPU placements (its ratio is to plain native).
PINNED_NATIVE = "native on CPU 0"
NATIVES = ["native", PINNED_NATIVE]
CONFIGS = NATIVES + list(OPTIONS)
# --compare PATH: each lockstep configuration also runs with this binary, labelled so.
COMPARED = " [compared]"
SERVERS = ["redis", "memcached t1", "memcached t4", "memcached default", "nginx"]
QUICK_SERVERS = ["redis", "memcached t1", "nginx"]

READY_TIMEOUT = 30      # s until the port must accept connections
STOP_TIMEOUT = 20       # s after the graceful stop before SIGTERM to the process group
TERM_TIMEOUT = 5        # s after SIGTERM before SIGKILL

REDIS_RE = re.compile(r"^\s*(SET|GET): ([0-9.]+) requests per second", re.M)
EVENT_RE = nginx_bench.EVENT_RE
NOTE_EVENTS = {"signal"}   # a signal (the stop) delivered outside a system call: no failure
STAT_RE = re.compile(r"^\s+([A-Za-z][A-Za-z/ -]*?):\s+(\d+(?:\.\d+)?)")
CLASS_RE = re.compile(r"^\s{4}([a-z-]+)\s+(\d+)\s*$")
# The --stats counters of the table: (column, --stats line name).
STAT_COLUMNS = [
    ("stops/req", "monitor stops"),
    ("/proc/req", "monitor /proc reads"),
    ("committer wake-ups/req", "committer wake-ups"),
    ("ordered events/req", "ordered events"),
    ("committed/req", "outputs committed"),
    ("posted/req", "outputs posted"),
    ("checked/req", "outputs checked"),
]


def options_of(config):
    """lockstep's options of a configuration (a --compare twin's are its original's)."""
    return OPTIONS[config.removesuffix(COMPARED)]


def replicas_of(config):
    return 1 if config in NATIVES else int(options_of(config)[options_of(config).index("-r") + 1])


def run_load(cmd, timeout, where):
    """Runs a load generator: its record (command, exit status, seconds), status, stdout
    and stderr; status None when it timed out."""
    res = benchproc.run(cmd, timeout, where)
    if res is None:
        return {"load_command": cmd}, None, "", ""
    rc, out, err, secs = res
    return {"load_command": cmd, "load_rc": rc, "load_seconds": round(secs, 3)}, rc, out, err



def parse_stats(stderr):
    """The numbers of lockstep's --stats block, by line name ("monitor stops", ...; the
    per-class lines under `syscalls intercepted` as "intercepted input" etc.), and the
    block's lines; (None, []) if there is no block."""
    lines = stderr.splitlines()
    try:
        start = lines.index("lockstep run: stats")
    except ValueError:
        return None, []
    stats, block = {}, []
    for ln in lines[start + 1:]:
        if not ln.startswith(" "):
            break
        block.append(ln)
        m = STAT_RE.match(ln)
        if m:
            stats[m.group(1)] = float(m.group(2)) if "." in m.group(2) else int(m.group(2))
            continue
        m = CLASS_RE.match(ln)
        if m:
            stats[f"intercepted {m.group(1)}"] = int(m.group(2))
    return stats, block


# ---------------------------------------------------------------- the process started

def exited(p):
    """Whether p has exited, without reaping it (wait4 must get its rusage)."""
    if p.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def wait_rusage(p, timeout):
    """Reaps p with wait4 within timeout seconds: (exit status, rusage) or None. The exit
    status is the shell's: 128 + N when killed by signal N."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        except ChildProcessError:   # reaped elsewhere: no rusage
            if p.returncode is None:
                p.returncode = -1
            return None
        if pid == p.pid:
            code = os.waitstatus_to_exitcode(status)
            p.returncode = code
            return (128 - code if code < 0 else code), ru
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def stop(p, graceful):
    """graceful(), then SIGTERM and SIGKILL to p's process group if p does not exit:
    (exit status, rusage, how it ended)."""
    how = "graceful"
    if not exited(p):
        graceful()
    else:
        how = "already exited"
    got = wait_rusage(p, STOP_TIMEOUT)
    if got is None:
        how = "SIGTERM"
        killpg(p.pid, signal.SIGTERM)
        got = wait_rusage(p, TERM_TIMEOUT)
    if got is None:
        how = "SIGKILL"
        killpg(p.pid, signal.SIGKILL)
        got = wait_rusage(p, 60)
    if got is None:
        return None, None, "not reaped"
    return got[0], got[1], how


# ---------------------------------------------------------------- the servers

class Redis:
    name = "redis"

    def __init__(self, args):
        self.n = args.redis_requests

    def describe(self):
        return (f"redis-server --port P --bind 127.0.0.1 --save '' --appendonly no; "
                f"redis-benchmark -p P -t get,set -n {self.n} -c 50 -q; redis-cli -p P shutdown nosave")

    def command(self, port, rdir):
        return ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no"]

    def ready(self, port):
        return None

    def load(self, port, where):
        cmd = ["redis-benchmark", "-p", str(port), "-t", "get,set", "-n", str(self.n),
               "-c", "50", "-q"]
        rec, rc, out, err = run_load(cmd, 120 + 2 * self.n * 5e-3, where)
        if rc is None:
            return rec, "redis-benchmark timed out"
        rates = {}
        for op, rate in REDIS_RE.findall(out.replace("\r", "\n")):
            rates[op] = float(rate)          # the last line of each op wins
        rec["set_rps"], rec["get_rps"] = rates.get("SET"), rates.get("GET")
        if rc != 0 or len(rates) != 2 or not all(rates.values()):
            last = [ln.strip() for ln in out.replace("\r", "\n").splitlines() if ln.strip()][-1:]
            return rec, (f"redis-benchmark exit {rc}, rates {rates}; its last line {' '.join(last)!r}; "
                         f"stderr {err.strip()[-300:]!r}")
        rec["requests"] = 2 * self.n
        rec["rps"] = 2 * self.n / (self.n / rates["SET"] + self.n / rates["GET"])
        return rec, None

    def graceful(self, p, port, where):
        res = benchproc.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], 30, where)
        if res is not None and res[0] != 0:
            print(f"    redis-cli shutdown: exit {res[0]} {res[1].strip()[:200]!r}",
                  file=sys.stderr, flush=True)


class Memcached:
    def __init__(self, args, setup):
        self.setup = setup
        self.name = f"memcached {setup}"
        self.seconds = args.seconds

    def describe(self):
        return (f"memcached -u root -p P -l 127.0.0.1 {' '.join(memcached_bench.SETUPS[self.setup])}; "
                f"memcaslap -s 127.0.0.1:P -T 1 -c 8 -t {self.seconds}s; SIGINT").replace("  ", " ")

    def command(self, port, rdir):
        return (["memcached", "-u", "root", "-p", str(port), "-l", "127.0.0.1"]
                + memcached_bench.SETUPS[self.setup])

    def ready(self, port):
        return None

    def load(self, port, where):
        cmd = ["memcaslap", "-s", f"127.0.0.1:{port}", "-T", "1", "-c", "8", "-t", f"{self.seconds}s"]
        rec, rc, out, err = run_load(cmd, self.seconds + 60, where)
        if rc is None:
            return rec, "memcaslap timed out"
        tps = memcached_bench.TPS_RE.findall(out)
        ops = memcached_bench.OPS_RE.findall(out)
        if rc != 0 or not tps or not ops or not int(tps[-1]) or not int(ops[-1]):
            return rec, (f"memcaslap exit {rc}, no TPS/Ops: {benchproc.tail(out + err, 4)!r}")
        rec["rps"], rec["requests"] = int(tps[-1]), int(ops[-1])
        return rec, None

    def graceful(self, p, port, where):
        os.kill(p.pid, signal.SIGINT)


class Nginx:
    name = "nginx"

    def __init__(self, args, load_bin, www, content):
        self.n = args.nginx_requests
        self.load_bin, self.www, self.content = load_bin, www, content

    def describe(self):
        return (f"nginx -c CONF (bench/nginx_bench.py's, {nginx_bench.FILE_SIZE}-byte file); "
                f"http_load -p P -c 50 -n {self.n} -u {nginx_bench.URL_PATH}; SIGQUIT")

    def command(self, port, rdir):
        return ["nginx", "-c", nginx_bench.write_conf(rdir, port, self.www)]

    def ready(self, port):
        got = nginx_bench.http_get(port)
        if got is None:
            return "port accepts connections but GET got no response"
        status, body = got
        if status != 200 or body != self.content:
            return (f"GET {nginx_bench.URL_PATH}: status {status}, {len(body)} bytes "
                    f"({'the file' if body == self.content else 'not the file'})")
        return None

    def load(self, port, where):
        cmd = [self.load_bin, "-p", str(port), "-c", "50", "-n", str(self.n), "-u", nginx_bench.URL_PATH]
        rec, rc, out, err = run_load(cmd, 120 + self.n * 20e-3, where)
        if rc is None:
            return rec, "http_load timed out"
        m = nginx_bench.LOAD_RE.search(out)
        lat = nginx_bench.LAT_RE.search(err)
        if lat:
            rec["latency_us"] = {"p50": int(lat.group(1)), "p99": int(lat.group(2)),
                                 "max": int(lat.group(3))}
        if m:
            rec.update({"completed": int(m.group(1)), "errors": int(m.group(2))})
        if rc != 0 or m is None or int(m.group(1)) != self.n or int(m.group(2)) != 0:
            return rec, f"http_load exit {rc}; stdout {out.strip()[:200]!r}; stderr {err.strip()[-400:]!r}"
        rec["rps"], rec["requests"] = float(m.group(4)), self.n
        return rec, None

    def graceful(self, p, port, where):
        os.kill(p.pid, signal.SIGQUIT)


# ---------------------------------------------------------------- one run

def one(server, config, native_rc, tmp, where, compare_bin=None):
    port = free_port()
    rdir = tempfile.mkdtemp(prefix=re.sub(r"[^\w]+", "_", where) + ".", dir=tmp)
    base = server.command(port, rdir)
    if config in NATIVES:
        cmd = base if config == "native" else ["taskset", "-c", "0"] + base
    else:
        binary = compare_bin if config.endswith(COMPARED) else BIN
        cmd = [binary, "run"] + options_of(config) + ["--stats", "--"] + base
    rec = {"command": cmd, "port": port, "replicas": replicas_of(config), "rps": None, "failures": []}
    out_path, err_path = os.path.join(rdir, "server.out"), os.path.join(rdir, "server.err")

    def fail(what, command=cmd, stderr=True):
        # The first failure lists the server's output; the ones after it would repeat it.
        text = None
        if stderr and not rec["failures"]:
            text = "\n".join(read_file(out_path).splitlines()[-5:] + [read_file(err_path)])
        rec["failures"].append(what)
        anomaly(where, what, command, text)

    print(f"  {where}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
        p = spawn(cmd, fo, fe, cwd=rdir)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and not exited(p) and not port_accepts(port):
            time.sleep(0.1)
        up = None
        if exited(p):
            up = "server exited before it accepted connections"
        elif not port_accepts(port):
            up = f"port {port} did not accept connections within {READY_TIMEOUT} s"
        else:
            up = server.ready(port)
        if up is not None:
            fail(up)
        else:
            load, what = server.load(port, where)
            rec.update(load)
            if exited(p):
                rec.pop("rps", None)
                fail("server exited during the load" + (f" ({what})" if what else ""))
            elif what is not None:
                rec.pop("rps", None)
                fail(what, load["load_command"])
        rc, ru, how = stop(p, lambda: server.graceful(p, port, where))
        rec["rc"], rec["stopped_by"] = rc, how
        if ru is not None:
            rec["rusage"] = {k: getattr(ru, k) for k in
                             ("ru_utime", "ru_stime", "ru_maxrss", "ru_minflt", "ru_majflt",
                              "ru_nvcsw", "ru_nivcsw")}
        if how in ("SIGTERM", "SIGKILL", "not reaped"):
            fail(f"did not exit within {STOP_TIMEOUT} s of the graceful stop; ended by {how} "
                 f"(exit status {rc})")
        elif not rec["failures"] and rc != 0 and rc != native_rc:
            fail(f"exit status {rc} after the graceful stop (native: {native_rc})")
    finally:
        if not exited(p):
            killpg(p.pid)
        if p.returncode is None:
            wait_rusage(p, 60)
        reap(p)

    if port_accepts(port):
        fail(f"port {port} still accepts connections after the exit", stderr=False)
    err = read_file(err_path)
    events = [ln for ln in err.splitlines() if EVENT_RE.match(ln)]
    if events:
        rec["lockstep_events"] = events[-50:]
        kinds = sorted({EVENT_RE.match(e).group(1) for e in events} - NOTE_EVENTS)
        if kinds:
            fail(f"{len(events)} event line(s) on lockstep's stderr: {', '.join(kinds)}")
    if config not in NATIVES:
        stats, block = parse_stats(err)
        rec["stats"], rec["stats_block"] = stats, block
        if stats is None:
            if not rec["failures"]:
                fail("no --stats block on lockstep's stderr")
        elif stats.get("divergences") and not events:
            fail(f"--stats counts {stats['divergences']} divergence(s)")
    if os.path.exists(os.path.join(rdir, "error.log")):
        log = [ln for ln in read_file(os.path.join(rdir, "error.log")).splitlines() if ln.strip()]
        if log:
            rec["error_log"] = log[-50:]
            fail(f"{len(log)} line(s) in nginx's error.log, the last: {log[-1][:300]!r}", stderr=False)

    # Per request.
    reqs = rec.get("requests")
    if rec.get("rps") is not None and reqs and "rusage" in rec:
        ru = rec["rusage"]
        rec["cpu_s"] = ru["ru_utime"] + ru["ru_stime"]
        rec["cpu_us_per_req_per_replica"] = 1e6 * rec["cpu_s"] / rec["replicas"] / reqs
        rec["ctx_switches_per_req"] = (ru["ru_nvcsw"] + ru["ru_nivcsw"]) / reqs
        for _, key in STAT_COLUMNS:
            if rec.get("stats") and key in rec["stats"]:
                rec.setdefault("per_req", {})[key] = rec["stats"][key] / reqs
    rec["failed"] = bool(rec["failures"])
    print(f"    rps={fmt(rec.get('rps'), '.0f')} rc={rec.get('rc')} ({rec.get('stopped_by')}) "
          f"cpu_us/req/replica={fmt(rec.get('cpu_us_per_req_per_replica'), '.2f')} "
          f"stops={(rec.get('stats') or {}).get('monitor stops')}"
          f"{' FAILED' if rec['failed'] else ''}", file=sys.stderr, flush=True)
    return rec


# ---------------------------------------------------------------- summary and output

def summarize(rounds, names, configs):
    summary = {}
    for name in names:
        summary[name] = {}
        for config in configs:
            pairs = [(row[name][config], row[name]["native"]) for row in rounds]
            ok = [(r, n) for r, n in pairs if not r["failed"] and r.get("rps") is not None]
            nat_ok = [(r, n) for r, n in ok if not n["failed"] and n.get("rps") is not None]
            s = {
                "rounds": len(pairs), "failed_rounds": len(pairs) - len(ok),
                "rps": median([r["rps"] for r, _ in ok]),
                "rps_ratio": median([r["rps"] / n["rps"] for r, n in nat_ok]),
                "cpu_us_per_req_per_replica": median([r.get("cpu_us_per_req_per_replica") for r, _ in ok]),
                "cpu_ratio": median([r["cpu_us_per_req_per_replica"] / n["cpu_us_per_req_per_replica"]
                                     for r, n in nat_ok if r.get("cpu_us_per_req_per_replica")
                                     and n.get("cpu_us_per_req_per_replica")]),
                "ctx_switches_per_req": median([r.get("ctx_switches_per_req") for r, _ in ok]),
                "per_req": {},
            }
            for _, key in STAT_COLUMNS:
                s["per_req"][key] = median([r.get("per_req", {}).get(key) for r, _ in ok])
            summary[name][config] = s
    return summary


def per_req(x):
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.3g}" if x < 0.1 else f"{x:.2f}"


def markdown(meta, summary, servers, configs):
    lines = [f"# Server costs under lockstep run ({meta['commit']})", "",
             f"- command: `{meta['command_line']}`",
             f"- date: {meta['date']}; commit `{meta['commit']}`{' (dirty tree)' if meta['dirty'] else ''}; "
             f"kernel `{meta['uname_r']}`, nproc {meta['nproc']}; rounds {meta['rounds']}; "
             f"wall time {meta['wall_seconds']:.0f} s",
             f"- lockstep binary: `{meta['lockstep']}` ({meta['lockstep_binary']}); load average at "
             f"start / end: {meta['loadavg_start']} / {meta['loadavg_end']}",
             "- configurations (in this order for each server, every round): native, then "
             + ", ".join(f"`lockstep run {c} --stats --`" for c in configs if c not in NATIVES)
             + (f"; `{COMPARED.strip()}`: the same with `{meta['compare']}`" if meta.get("compare") else ""), ""]
    head = ["config", "req/s", "% native", "CPU µs/req/replica", "CPU × native", "ctx sw/req"] \
        + [c for c, _ in STAT_COLUMNS]
    for srv in servers:
        lines += [f"## {srv.name}", "", f"`{srv.describe()}`", "",
                  "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for config in configs:
            s = summary[srv.name][config]
            label = config if config == "native" else f"`{config}`"
            if s["failed_rounds"]:
                label += f" ⚠ {s['failed_rounds']}/{s['rounds']} failed"
            native = config in NATIVES
            base = config == "native"
            cells = [label, fmt(s["rps"], ".0f"), "100%" if base and s["rps"] else pct(s["rps_ratio"]),
                     fmt(s["cpu_us_per_req_per_replica"], ".2f"),
                     "1.00" if base and s["cpu_us_per_req_per_replica"] else fmt(s["cpu_ratio"], ".2f"),
                     "n/a" if s["rps"] is None else per_req(s["ctx_switches_per_req"])]
            cells += ["-" if native else "n/a" if s["rps"] is None else per_req(s["per_req"][key])
                      for _, key in STAT_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Medians over the rounds that did not fail (⚠: rounds that failed, listed under "
              "Anomalies). % native and CPU × native: medians of the per-round ratios against "
              "the native run of the same round. CPU: wait4's user + system time of the server, "
              "or of lockstep and its replicas, per request and per replica, the monitor, "
              "committer and spinning waits included. ctx sw: voluntary + involuntary context "
              "switches of the same processes, per request (not per replica). The other "
              "columns: lockstep's --stats counters (whole run) per request; - : no such line.", ""]
    lines += benchproc.anomalies_markdown()
    return "\n".join(lines) + "\n"


def more_options(ap):
    ap.add_argument("--servers", help="comma-separated servers to run, of: " + ", ".join(SERVERS)
                    + " (default all; --quick: " + ", ".join(QUICK_SERVERS) + ")")
    ap.add_argument("--config", action="append", metavar="CONFIG",
                    help="a lockstep configuration to run (repeat the option for more), of: "
                    + ", ".join(f"'{c}'" for c in OPTIONS) + f" (default all); '{PINNED_NATIVE}' may "
                    "be named too; plain native always runs (the baseline of every ratio)")
    ap.add_argument("--compare", metavar="PATH",
                    help="a second lockstep binary: every lockstep configuration also runs with "
                    f"it, in the same round, labelled '<config>{COMPARED}' (an A/B measurement)")


def chosen(args):
    """The servers and configurations (in running order) that the command line asks for;
    exits with a usage error for a name that does not exist."""
    def pick(names, every, what):
        if not names:
            return None
        unknown = [n for n in names if n not in every]
        if unknown or not names:
            sys.exit(f"server_costs.py: unknown {what} {', '.join(map(repr, unknown)) or '(none given)'}; "
                     f"known: {', '.join(map(repr, every))}")
        return names
    servers = [n.strip() for n in (args.servers or "").split(",") if n.strip()]
    names = pick(servers, SERVERS, "server") or (QUICK_SERVERS if args.quick else SERVERS)
    configs = pick(args.config, [PINNED_NATIVE] + list(OPTIONS), "configuration") or CONFIGS[1:]
    configs = ["native"] + [c for c in CONFIGS if c in configs]
    if args.compare:
        if not os.access(args.compare, os.X_OK):
            sys.exit(f"server_costs.py: --compare {args.compare}: not an executable file")
        # Each configuration next to its twin, so that both see the same moment.
        configs = [twin for c in configs for twin in ([c] if c in NATIVES else [c, c + COMPARED])]
    return names, configs


def main():
    args, meta = benchproc.bench_start(__doc__, [
        ("--rounds", 3, "measuring rounds"),
        ("--seconds", 10, "memcaslap -t"),
        ("--redis-requests", 100000, "redis-benchmark -n (per test: GET and SET)"),
        ("--nginx-requests", 50000, "http_load -n"),
    ], quick={"rounds": 1, "seconds": 3, "redis_requests": 20000, "nginx_requests": 10000},
        more_options=more_options)
    meta["command_line"] = " ".join(shlex.quote(a) for a in ["python3"] + sys.argv)
    meta["loadavg_start"] = nginx_bench.loadavg()
    names, configs = chosen(args)
    meta["compare"] = args.compare and os.path.abspath(args.compare)
    rounds = []
    try:
        with tempfile.TemporaryDirectory(prefix="server_costs.") as tmp:
            load_bin = benchproc.build_c(nginx_bench.SRC, os.path.join(tmp, "http_load"))
            www = os.path.join(tmp, "www")
            os.makedirs(www)
            content = base64.b64encode(os.urandom(nginx_bench.FILE_SIZE))[:nginx_bench.FILE_SIZE]
            with open(os.path.join(www, nginx_bench.URL_PATH.lstrip("/")), "wb") as f:
                f.write(content)
            every = {"redis": Redis(args), "nginx": Nginx(args, load_bin, www, content)}
            for setup in memcached_bench.SETUPS:
                every[f"memcached {setup}"] = Memcached(args, setup)
            servers = [every[n] for n in names]
            for r in range(args.rounds):
                row = {}
                for srv in servers:
                    row[srv.name] = {}
                    native_rc = 0
                    for config in configs:
                        rec = one(srv, config, native_rc, tmp, f"round {r + 1} {srv.name} {config}",
                                  meta["compare"])
                        if config == "native" and rec.get("rc") is not None:
                            native_rc = rec["rc"]
                        row[srv.name][config] = rec
                rounds.append(row)
    finally:
        cleanup_all()
    benchproc.bench_end(meta)
    meta.update({"rounds": args.rounds, "seconds": args.seconds, "redis_requests": args.redis_requests,
                 "nginx_requests": args.nginx_requests, "servers": names,
                 "loads": {s.name: s.describe() for s in servers},
                 "configs": {c: options_of(c) if c not in NATIVES else [] for c in configs},
                 "loadavg_end": nginx_bench.loadavg()})
    summary = summarize(rounds, names, configs)
    out_json = benchproc.write_results(args.out, "server_costs.json",
                                       {"meta": meta, "rounds": rounds, "summary": summary})
    print(markdown(meta, summary, servers, configs), end="")
    print(f"(raw numbers: {out_json})", file=sys.stderr)


if __name__ == "__main__":
    main()
