#!/usr/bin/env python3
"""What the fast backend (`lockstep run --backend fast`) costs an HTTP server: nginx serving
a static 1 KiB file, natively and replicated, measured side by side in the same invocation.

Set-up, once per invocation, in a temporary directory: bench/http_load.c is compiled with
`gcc -O2 -Wall -Wextra -Werror`, and a 1 KiB file (1024 bytes of base64 text from
os.urandom) is written as www/index.html. For every single run a fresh directory gets an
nginx.conf for a free port P on 127.0.0.1:

    daemon off; master_process off; worker_processes 1;
    error_log RUN/error.log; pid RUN/nginx.pid;
    events { worker_connections 1024; }
    http { access_log off; client_body_temp_path RUN/client_body; proxy_temp_path
           RUN/proxy; fastcgi_temp_path RUN/fastcgi; uwsgi_temp_path RUN/uwsgi;
           scgi_temp_path RUN/scgi;
           server { listen 127.0.0.1:P; root TMP/www; location / { } } }

(nothing else: nginx's defaults apply, e.g. sendfile off, no open_file_cache,
keepalive_requests 1000, so every request opens and closes the file).

Each round runs, in this order, each in a session of its own (start_new_session):
    nginx -c CONF                                                   (native)
    lockstep run -r 2 --backend fast --stats -- nginx -c CONF
    lockstep run -r 2 --output-check fast --backend fast --stats -- nginx -c CONF
    lockstep run -r 3 --backend fast --stats -- nginx -c CONF
    lockstep run -r 3 --output-check fast --backend fast --stats -- nginx -c CONF
and for each: waits until GET /index.html answers 200 with the file's exact bytes (at most
20 s), runs `http_load -p P -c CONNS -n REQUESTS -u /index.html` (HTTP/1.1 keep-alive, one
request outstanding per connection; it reconnects when nginx closes a connection after
keepalive_requests), then stops the server with SIGQUIT to the process started (nginx, or
lockstep, which forwards it), SIGTERM to its process group after 15 s and SIGKILL after 5
more, and checks that the port no longer accepts connections.

Reported per configuration: the median requests/s, the share of native (median of the
per-round ratios replicated / native of the same round), the fraction of nginx's syscalls
that took the fast path = fast-path calls / (fast-path calls + syscalls intercepted), both
from lockstep's --stats, the intercepted calls per request, and the median of http_load's
p50 and p99 latencies.

The machine may be small and noisy, so configurations are interleaved round by round and
everything is given relative to the native run of the same round; the load average at the
start and end is recorded. Failures (a server that does not come up or serves the wrong
bytes, http_load failing, a server that dies under load, exits non-zero after SIGQUIT or
needs SIGTERM/SIGKILL, `lockstep run: [KIND]` event lines such as divergences on
lockstep's stderr, lines in nginx's error.log) are listed as anomalies with the stderr
tail; they do not stop the bench. `[signal]` events (a signal, here the SIGQUIT, delivered
outside a system call) are listed separately, as they are not failures. Nothing here
asserts on timing.

Usage (from anywhere; the repository root is found from this file's path):
    cargo build --release --locked -p lockstep-cli
    python3 bench/nginx_bench.py [--rounds R] [--requests N] [--conns C] [--out DIR] [--quick]
Defaults: --rounds 3 --requests 50000 --conns 50; --quick is --rounds 1 --requests 10000.
Writes DIR/nginx.json (default bench/out/nginx.json) with every raw per-round number and
the summary, and prints a markdown summary on stdout. Needs gcc and nginx; the fast
backend needs root (see docs/run.md).
"""
import base64
import http.client
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import benchproc
from benchproc import (BIN, ROOT, anomaly, cleanup_all, fmt, free_port, killpg, median, pct,
                       port_accepts, read_file, reap, sh, spawn)

SRC = os.path.join(ROOT, "bench", "http_load.c")
URL_PATH = "/index.html"
FILE_SIZE = 1024
READY_TIMEOUT = 20       # s until the server must answer GET with 200 and the file
QUIT_TIMEOUT = 15        # s after SIGQUIT before SIGTERM to the process group
TERM_TIMEOUT = 5         # s after SIGTERM before SIGKILL

LOAD_RE = re.compile(r"^requests (\d+) errors (\d+) seconds ([0-9.]+) rps ([0-9.]+)\s*$", re.M)
LAT_RE = re.compile(r"latency p50 (\d+) us, p99 (\d+) us, max (\d+) us")
EVENT_RE = re.compile(r"^lockstep run: \[([\w-]+)\]")

# Replicated configurations and their `lockstep run` options (all with --backend fast):
# DMR and TMR, each with strict output checks (the default: the monitor stops the leader
# at every output) and with in-process checks only.
OPTIONS = {
    "fast -r 2": ["-r", "2"],
    "fast -r 2 --output-check fast": ["-r", "2", "--output-check", "fast"],
    "fast -r 3": ["-r", "3"],
    "fast -r 3 --output-check fast": ["-r", "3", "--output-check", "fast"],
}
CONFIGS = ["native"] + list(OPTIONS)

# lockstep event lines that are not failures: listed under "Events" in the summary. `signal`:
# a signal (here the SIGQUIT that stops nginx) was delivered outside a system call.
NOTE_EVENTS = {"signal"}
NOTES = []


def parse_stats(stderr):
    st = benchproc.parse_stats(stderr)
    if st is None:
        return None
    # The per-class breakdown that follows `syscalls intercepted:` (input, output, ...).
    classes = {}
    lines = stderr.splitlines()
    for k, ln in enumerate(lines):
        if benchproc.INTERCEPTED_RE.search(ln):
            for sub in lines[k + 1:]:
                m = re.match(r"^\s{4}([a-z-]+)\s+(\d+)\s*$", sub)
                if not m:
                    break
                classes[m.group(1)] = int(m.group(2))
            break
    st["intercepted_by_class"] = classes
    return st


def write_conf(rdir, port, www):
    for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(rdir, d), exist_ok=True)
    conf = (f"daemon off;\nmaster_process off;\nworker_processes 1;\n"
            f"error_log {rdir}/error.log;\npid {rdir}/nginx.pid;\n"
            f"events {{ worker_connections 1024; }}\n"
            f"http {{\n"
            f"    access_log off;\n"
            f"    client_body_temp_path {rdir}/client_body;\n"
            f"    proxy_temp_path {rdir}/proxy;\n"
            f"    fastcgi_temp_path {rdir}/fastcgi;\n"
            f"    uwsgi_temp_path {rdir}/uwsgi;\n"
            f"    scgi_temp_path {rdir}/scgi;\n"
            f"    server {{\n"
            f"        listen 127.0.0.1:{port};\n"
            f"        root {www};\n"
            f"        location / {{ }}\n"
            f"    }}\n"
            f"}}\n")
    path = os.path.join(rdir, "nginx.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def server_cmd(config, conf):
    nginx = ["nginx", "-c", conf]
    if config == "native":
        return nginx
    return [BIN, "run"] + OPTIONS[config] + ["--backend", "fast", "--stats", "--"] + nginx


def http_get(port):
    """(status, body) of GET URL_PATH, or None if the server does not answer."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        c.request("GET", URL_PATH)
        r = c.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        c.close()


def wait_ready(p, port, content):
    """None once GET answers 200 with the file's bytes, else what went wrong."""
    deadline = time.monotonic() + READY_TIMEOUT
    last = "no connection"
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return f"server exited with status {p.returncode} before serving {URL_PATH}"
        if port_accepts(port):
            got = http_get(port)
            if got is not None:
                status, body = got
                if status == 200 and body == content:
                    return None
                if status == 200:
                    return (f"GET {URL_PATH} returned 200 with {len(body)} bytes that differ "
                            f"from the {len(content)}-byte file")
                last = f"GET {URL_PATH} returned status {status}"
            else:
                last = "port accepts connections but GET got no response"
        time.sleep(0.1)
    return f"not ready within {READY_TIMEOUT} s ({last})"


def stop(p):
    """SIGQUIT to the process started, then SIGTERM / SIGKILL to its process group.
    Returns (exit status, how it ended)."""
    if p.poll() is not None:
        return p.returncode, "already exited"
    try:
        os.kill(p.pid, signal.SIGQUIT)
    except ProcessLookupError:
        pass
    try:
        return p.wait(timeout=QUIT_TIMEOUT), "SIGQUIT"
    except subprocess.TimeoutExpired:
        pass
    killpg(p.pid, signal.SIGTERM)
    try:
        return p.wait(timeout=TERM_TIMEOUT), "SIGTERM"
    except subprocess.TimeoutExpired:
        pass
    killpg(p.pid, signal.SIGKILL)
    return p.wait(), "SIGKILL"


def one(config, args, tmp, load_bin, www, content, where):
    port = free_port()
    tag = where.replace(" ", "_").replace("-", "")
    rdir = os.path.join(tmp, tag)
    os.makedirs(rdir)
    conf = write_conf(rdir, port, www)
    cmd = server_cmd(config, conf)
    load_cmd = [load_bin, "-p", str(port), "-c", str(args.conns), "-n", str(args.requests),
                "-u", URL_PATH]
    rec = {"command": cmd, "load_command": load_cmd, "port": port, "rps": None}
    out_path = os.path.join(rdir, "server.out")
    err_path = os.path.join(rdir, "server.err")
    log_path = os.path.join(rdir, "error.log")
    print(f"  {where}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
        p = spawn(cmd, fo, fe, cwd=rdir)
    load_ok = False
    try:
        what = wait_ready(p, port, content)
        if what is not None:
            rec["error"] = what
            anomaly(where, what, cmd, read_file(err_path) + read_file(out_path)[-2000:])
        else:
            # Load. Generous: up to 20 ms per request on top of two minutes; http_load
            # itself gives up after 10 s without progress.
            timeout = 120 + args.requests * 20e-3
            t0 = time.monotonic()
            try:
                b = subprocess.run(load_cmd, capture_output=True, text=True,
                                   stdin=subprocess.DEVNULL, timeout=timeout)
                rec["load_seconds"] = round(time.monotonic() - t0, 3)
                rec["load_rc"] = b.returncode
                rec["load_stderr"] = b.stderr.strip()[-2000:]
                m = LOAD_RE.search(b.stdout)
                if m:
                    rec.update({"requests": int(m.group(1)), "errors": int(m.group(2)),
                                "seconds": float(m.group(3))})
                    lat = LAT_RE.search(b.stderr)
                    if lat:
                        rec["latency_us"] = {"p50": int(lat.group(1)), "p99": int(lat.group(2)),
                                             "max": int(lat.group(3))}
                load_ok = (b.returncode == 0 and m is not None and
                           int(m.group(1)) == args.requests and int(m.group(2)) == 0)
                if load_ok:
                    rec["rps"] = float(m.group(4))
                load_what = (f"http_load exit {b.returncode}; stdout {b.stdout.strip()[:200]!r}; "
                             f"stderr {b.stderr.strip()[-600:]!r}")
            except subprocess.TimeoutExpired:
                load_what = f"http_load timed out after {timeout:.0f} s"
            if not load_ok:
                rec["error"] = "http_load failed"
            # The server must still be there when we ask it to stop.
            if p.poll() is not None:
                rec["error"] = f"server exited with status {p.returncode} during the load"
                rec["rps"] = None
                anomaly(where, f"server exited with status {p.returncode} during the load "
                        f"({'http_load ok' if load_ok else load_what})", cmd,
                        read_file(err_path))
            elif not load_ok:
                anomaly(where, load_what, load_cmd, read_file(err_path))

        rc, how = stop(p)
        rec["rc"], rec["stopped_by"] = rc, how
        if how in ("SIGTERM", "SIGKILL"):
            anomaly(where, f"did not exit within {QUIT_TIMEOUT} s of SIGQUIT; ended by "
                    f"{how} to its process group (exit status {rc})", cmd, read_file(err_path))
        elif how == "SIGQUIT" and rc != 0:
            anomaly(where, f"exit status {rc} after SIGQUIT", cmd, read_file(err_path))
    finally:
        if p.poll() is None:
            killpg(p.pid)
            p.wait()
        reap(p)

    if port_accepts(port):
        anomaly(where, f"port {port} still accepts connections after the server exited", cmd)
    err = read_file(err_path)
    # Once the run has failed with its stderr listed, the checks below would only repeat it.
    reported = "error" in rec
    if config != "native":
        st = parse_stats(err)
        if st is None:
            if not reported:
                anomaly(where, "no --stats counters on lockstep's stderr", cmd, err)
        else:
            rec.update(st)
            if rec.get("requests"):
                rec["intercepted_per_request"] = st["intercepted"] / rec["requests"]
                rec["fast_path_per_request"] = st["fast_path_calls"] / rec["requests"]
    events = [ln for ln in err.splitlines() if EVENT_RE.match(ln)]
    other = [ln for ln in err.splitlines() + read_file(out_path).splitlines()
             if ln.strip() and not EVENT_RE.match(ln)
             and not (config != "native" and (ln.startswith("lockstep run: stats") or
                                               ln.startswith(" ")))]
    if events:
        rec["lockstep_events"] = events[-50:]
        kinds = sorted({EVENT_RE.match(e).group(1) for e in events})
        if set(kinds) <= NOTE_EVENTS:
            NOTES.append({"where": where, "events": events[-5:]})
        else:
            anomaly(where, f"{len(events)} event line(s) on lockstep's stderr: "
                    f"{', '.join(kinds)}", cmd, err)
    if other:
        rec["other_output"] = other[-50:]
    if other and not reported:
        anomaly(where, f"{len(other)} unexpected line(s) on the server's stdout/stderr: "
                f"{other[0][:200]!r}", cmd, err)
    log = [ln for ln in read_file(log_path).splitlines() if ln.strip()]
    if log:
        rec["error_log"] = log[-50:]
        anomaly(where, f"{len(log)} line(s) in nginx's error.log, the last: {log[-1][:300]!r}")
    print(f"    rps={rec['rps']} rc={rec.get('rc')} ({rec.get('stopped_by')}) "
          f"fast={rec.get('fast_path_calls')} intercepted={rec.get('intercepted')} "
          f"latency={rec.get('latency_us')}", file=sys.stderr, flush=True)
    return rec


def bench(args, tmp, load_bin, www, content):
    rounds = []
    for r in range(args.rounds):
        row = {}
        for config in CONFIGS:
            row[config] = one(config, args, tmp, load_bin, www, content,
                              f"round {r + 1} {config}")
        rounds.append(row)

    summary = {}
    for config in CONFIGS:
        ok = [row[config] for row in rounds if row[config]["rps"] is not None]
        ratios = []
        for row in rounds:
            nat, v = row["native"]["rps"], row[config]["rps"]
            if nat and v is not None:
                ratios.append(v / nat)
        summary[config] = {
            "valid_rounds": len(ok),
            "rps_median": median([x["rps"] for x in ok]),
            "ratio_vs_native_median": median(ratios) if config != "native" else 1.0,
            # Only from rounds that completed (a failed run's counters describe a stall).
            "fast_fraction_median": median([x.get("fast_fraction") for x in ok]),
            "intercepted_per_request_median": median([x.get("intercepted_per_request")
                                                      for x in ok]),
            "fast_path_per_request_median": median([x.get("fast_path_per_request") for x in ok]),
            "latency_p50_us_median": median([x.get("latency_us", {}).get("p50") for x in ok]),
            "latency_p99_us_median": median([x.get("latency_us", {}).get("p99") for x in ok]),
        }
    return {"requests": args.requests, "conns": args.conns, "rounds": rounds,
            "summary": summary}


# ---------------------------------------------------------------- output

def ms(us):
    return "n/a" if us is None else f"{us / 1000:.2f}"


def markdown(meta, res):
    lines = [f"# lockstep fast backend: nginx static file ({meta['commit']})", ""]
    lines += [f"- commit: `{meta['commit']}`{' (dirty tree)' if meta['dirty'] else ''}",
              f"- kernel: `{meta['uname_r']}`, nproc: {meta['nproc']}, load average at "
              f"start / end: {meta['loadavg_start']} / {meta['loadavg_end']}",
              f"- lockstep binary: `{meta['lockstep']}` ({meta['lockstep_binary']})",
              f"- {meta['nginx']}; {FILE_SIZE}-byte file; http_load -c {meta['conns']} "
              f"-n {meta['requests']} (HTTP/1.1 keep-alive, one request in flight per "
              "connection)",
              f"- rounds: {meta['rounds']}, wall time: {meta['wall_seconds']:.0f} s", "",
              "Commands (interleaved in this order every round):", "", "```"]
    lines += meta["commands"]
    lines += ["```", "",
              f"## Throughput (GET {URL_PATH}, {FILE_SIZE} B, {meta['conns']} connections)", "",
              "| config | requests/s | % of native | fast-path fraction | intercepted / request "
              "| p50 ms | p99 ms | valid rounds |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        s = res["summary"][config]
        rep = config != "native"
        lines.append(f"| {config} | {fmt(s['rps_median'], '.0f')} | "
                     f"{pct(s['ratio_vs_native_median'])} | "
                     f"{pct(s['fast_fraction_median'], 2) if rep else '-'} | "
                     f"{fmt(s['intercepted_per_request_median'], '.2f') if rep else '-'} | "
                     f"{ms(s['latency_p50_us_median'])} | {ms(s['latency_p99_us_median'])} | "
                     f"{s['valid_rounds']}/{meta['rounds']} |")
    lines += ["", "Medians over rounds; '% of native' is the median of per-round ratios against "
              "the native run of the same round. Fast-path fraction = fast-path calls / "
              "(fast-path calls + syscalls intercepted), from lockstep's --stats (whole run, "
              "start-up and shutdown included); intercepted / request divides the intercepted "
              "calls by the requests served. p50/p99: http_load's per-request latency.", ""]
    if NOTES:
        lines += [f"## lockstep events that are not failures ({len(NOTES)} runs)", ""]
        for n in NOTES:
            lines.append(f"- **{n['where']}**:")
            lines += [f"  - `{e}`" for e in n["events"]]
        lines.append("")
    lines += benchproc.anomalies_markdown()
    return "\n".join(lines) + "\n"


def loadavg():
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main():
    args, meta = benchproc.bench_start(__doc__, [
        ("--rounds", 3, "measuring rounds"),
        ("--requests", 50000, "http_load -n (total requests)"),
        ("--conns", 50, "http_load -c (connections)", 1000),
    ], quick={"rounds": 1, "requests": 10000})
    nginx_version = sh(["nginx", "-v"], or_stderr=True)
    load_start = loadavg()
    commands = [
        "nginx -c CONF",
        *[f"{BIN} run {' '.join(opts)} --backend fast --stats -- nginx -c CONF"
          for opts in OPTIONS.values()],
        f"(each) GET {URL_PATH} until 200 + the file's bytes; http_load -p P -c {args.conns} "
        f"-n {args.requests} -u {URL_PATH}; SIGQUIT",
        "http_load = gcc -O2 -Wall -Wextra -Werror bench/http_load.c",
    ]
    print(f"nginx_bench: {nginx_version}, load {load_start}", file=sys.stderr, flush=True)

    try:
        with tempfile.TemporaryDirectory(prefix="nginx_bench.") as tmp:
            load_bin = benchproc.build_c(SRC, os.path.join(tmp, "http_load"))
            www = os.path.join(tmp, "www")
            os.makedirs(www)
            content = base64.b64encode(os.urandom(FILE_SIZE))[:FILE_SIZE]
            with open(os.path.join(www, URL_PATH.lstrip("/")), "wb") as f:
                f.write(content)
            res = bench(args, tmp, load_bin, www, content)
    finally:
        cleanup_all()

    benchproc.bench_end(meta)
    meta.update({"nginx": nginx_version, "rounds": args.rounds, "requests": args.requests, "conns": args.conns,
                 "commands": commands, "loadavg_start": load_start, "loadavg_end": loadavg()})
    report = markdown(meta, res)
    out_json = benchproc.write_results(args.out, "nginx.json", {"meta": meta, "nginx": res, "events": NOTES})
    print(report, end="")
    print(f"(raw numbers: {out_json})", file=sys.stderr)


if __name__ == "__main__":
    main()
