#!/usr/bin/env python3
"""libsei benchmarks (issue 4): native vs hardened, measured in the same run.

1. Handler cycles (SEI's Table 5 for our store): bench/sei_handler.c, rdtsc around each
   handler, get and set of 8 B, 128 B and 1 KiB values; native, sei-ecc, sei-dup. And the
   handler-dominated service of issue 18's goals (bench/sei_ledger.c), interleaved runs;
   and the server's CPU per request with 32 pipelined requests (sei/client/kv_cli).
2. Memory per thread held by libsei's structures (sei_stats).
3. Server throughput with memcaslap (libmemcached-tools), 90% get / 10% set, for the
   single-threaded server and the threaded one with 1 and 2 workers, values of 8 B,
   128 B and 1 KiB:
   - saturated: as fast as the load generator goes (the server is CPU-bound);
   - paced: bench/kv_load.py at 2000 requests/s over 4 connections, a rate both builds
     sustain (not CPU-bound), where the goal is >= 95% of native throughput; mean
     latency and the server's CPU time per request are reported too.
Writes bench/out/sei.json and bench/out/sei.md. Usage: bench/sei_bench.py [SECONDS]
"""
import json
import os
import socket
import subprocess
import sys
import time

from benchproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "out")
BUILD = os.path.join(ROOT, "target", "sei-bench")
LOCKSTEP = os.path.join(ROOT, "target", "release", "lockstep")
SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
SIZES = [8, 128, 1024]
PACED_TPS = 2000


def sh(*cmd, env=None):
    subprocess.run(cmd, check=True, env=env)


def build():
    os.makedirs(BUILD, exist_ok=True)
    ex = os.path.join(ROOT, "sei", "examples")
    env = dict(os.environ, LOCKSTEP_SEI_DIR=os.path.join(BUILD, "sei"))
    strict = ["-O2", "-Wall", "-Wextra", "-Werror"]
    native = ["gcc", "-DSEI_NATIVE", "-I", os.path.join(ROOT, "sei", "include"), "-pthread"]
    hardened = [LOCKSTEP, "cc"]
    handler = [os.path.join(ROOT, "bench", "sei_handler.c"), os.path.join(ex, "kv_store.c"), "-I", ex]
    for name, cc in (("native", native), ("sei", hardened)):
        sh(*cc, *strict, *handler, "-o", os.path.join(BUILD, "handler-" + name), env=env)
        sh(*cc, *strict, os.path.join(ROOT, "bench", "sei_ledger.c"), "-o", os.path.join(BUILD, "ledger-" + name),
           env=env)
        sh("gcc", "-std=gnu11", *strict, os.path.join(ROOT, "sei", "client", "sei_client.c"),
           os.path.join(ROOT, "sei", "client", "kv_cli.c"), "-o", os.path.join(BUILD, "kv_cli"))
        for server in ("kv_single", "kv_threads"):
            srcs = [os.path.join(ex, f) for f in (server + ".c", "kv_net.c", "kv_store.c", "wire.c")]
            sh(*cc, *strict, *srcs, "-o", os.path.join(BUILD, "%s-%s" % (server, name)), env=env)


def each_build(name):
    """Runs the native build of bench `name` and its hardened build in ecc and dup mode;
    yields (label, the run's stdout)."""
    for label, binary, mode in (("native", name + "-native", None), ("ecc", name + "-sei", "ecc"),
                                ("dup", name + "-sei", "dup")):
        env = dict(os.environ)
        if mode:
            env["SEI_MODE"] = mode
        out = subprocess.run([os.path.join(BUILD, binary)], env=env, check=True, capture_output=True, text=True)
        yield label, out.stdout


def handler_cycles():
    return {label: [json.loads(line) for line in stdout.splitlines()] for label, stdout in each_build("handler")}


LEDGER_ROUNDS = 5
PIPELINE = 32
PIPELINED_REQUESTS = 300000
PIPELINED_ROUNDS = 3


def pipelined_cpu():
    """The single-threaded server's CPU time per request when the C client sends a trace
    in pipelines of 32 (handlers dominate the server's work there): native, ecc and dup,
    rounds interleaved; every build must give the client the same replies."""
    trace = os.path.join(BUILD, "pipelined-trace.txt")
    with open(trace, "w") as f:
        subprocess.run([sys.executable, os.path.join(ROOT, "sei", "examples", "kv_client.py"), "gen-trace",
                        str(PIPELINED_REQUESTS), "5"], stdout=f, check=True)
    us = {"native": [], "ecc": [], "dup": []}
    outputs = set()
    for _ in range(PIPELINED_ROUNDS):
        for label, binary, mode in (("native", "kv_single-native", "ecc"), ("ecc", "kv_single-sei", "ecc"),
                                    ("dup", "kv_single-sei", "dup")):
            port = free_port()
            proc = subprocess.Popen([os.path.join(BUILD, binary), "--port", str(port), "--crc"],
                                    env=dict(os.environ, SEI_MODE=mode), stderr=subprocess.DEVNULL)
            try:
                wait_for_port(port)
                cpu0 = cpu_seconds(proc.pid)
                out = subprocess.run([os.path.join(BUILD, "kv_cli"), "--port", str(port), "--crc", "--pipeline",
                                      str(PIPELINE), "trace", trace], capture_output=True, check=True,
                                     timeout=600).stdout
                us[label].append(1e6 * (cpu_seconds(proc.pid) - cpu0) / PIPELINED_REQUESTS)
                outputs.add(hash(out))
            finally:
                proc.kill()
                proc.wait()
    if len(outputs) != 1:
        sys.exit("pipelined: the builds gave the client different replies")
    median = {k: sorted(v)[len(v) // 2] for k, v in us.items()}
    return {"us_per_request": us, "median": median, "ecc_ratio": median["ecc"] / median["native"],
            "dup_ratio": median["dup"] / median["native"]}


def ledger_cycles():
    """The handler-dominated service (bench/sei_ledger.c): median handler cycles of each
    build, rounds interleaved; every build must end with the native build's state."""
    runs = {"native": [], "ecc": [], "dup": []}
    checksums = set()
    for _ in range(LEDGER_ROUNDS):
        for label, stdout in each_build("ledger"):
            row = json.loads(stdout)
            runs[label].append(row["handler_cycles"])
            checksums.add(row["state_checksum"])
    if len(checksums) != 1:
        sys.exit("ledger: the builds ended with different state: %s" % sorted(checksums))
    median = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    return {"runs": runs, "median": median, "ecc_ratio": median["ecc"] / median["native"],
            "dup_ratio": median["dup"] / median["native"]}


def wait_for_port(port):
    """Until a server accepts connections on 127.0.0.1:port (at most 5 s)."""
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            time.sleep(0.01)


def cpu_seconds(pid):
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_and_load(server, build_name, threads, size, tps):
    port = free_port()
    args = [os.path.join(BUILD, "%s-%s" % (server, build_name)), "--port", str(port)]
    if server == "kv_threads":
        args += ["--threads", str(threads)]
    proc = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port)
        cpu0 = cpu_seconds(proc.pid)
        if tps:
            # memcaslap's --tps does not pace (1.1.4): bench/kv_load.py does
            load = [sys.executable, os.path.join(ROOT, "bench", "kv_load.py"), str(port), str(tps), str(size),
                    str(SECONDS)]
            r = json.loads(subprocess.run(load, capture_output=True, text=True, check=True,
                                          timeout=SECONDS + 60).stdout)
            ops, tps_seen, latency = r["ops"], r["tps"], r["latency_us"]
        else:
            cmd = ["memcaslap", "-s", "127.0.0.1:%d" % port, "-T", "1", "-c", "8", "-t", "%ds" % SECONDS,
                   "-X", str(size)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=SECONDS + 60).stdout
            total = [line for line in out.splitlines() if line.startswith("Run time:")][-1]
            ops = int(total.split("Ops:")[1].split()[0])
            tps_seen, latency = int(total.split("TPS:")[1].split()[0]), None
        cpu = cpu_seconds(proc.pid) - cpu0
        return {"tps": tps_seen, "ops": ops, "latency_us": latency, "server_cpu_us_per_op": 1e6 * cpu / max(ops, 1)}
    finally:
        proc.kill()
        proc.wait()


def throughput():
    rows = []
    for server, threads in (("kv_single", 1), ("kv_threads", 1), ("kv_threads", 2)):
        for size in SIZES:
            for paced in (False, True):
                row = {"server": server, "threads": threads, "value_bytes": size, "paced": paced}
                for b in ("native", "sei"):
                    row[b] = serve_and_load(server, b, threads, size, PACED_TPS if paced else None)
                row["ratio"] = row["sei"]["tps"] / max(row["native"]["tps"], 1)
                row["cpu_ratio"] = row["sei"]["server_cpu_us_per_op"] / max(row["native"]["server_cpu_us_per_op"], 1e-9)
                rows.append(row)
                print("%-10s threads=%d %5d B %-9s native %6d TPS, sei %6d TPS: %.2fx (server CPU/op %.2fx)" % (
                    server, threads, size, "paced" if paced else "saturated", row["native"]["tps"],
                    row["sei"]["tps"], row["ratio"], row["cpu_ratio"]), flush=True)
    return rows


def markdown(cycles, memory, tput, ledger, pipelined):
    m = ledger["median"]
    lines = ["### Handler-dominated service (bench/sei_ledger.c: 32 transfers per request; median of %d "
             "interleaved runs of the per-run median)" % LEDGER_ROUNDS, "",
             "| build | handler cycles | x native | goal |", "|---|---:|---:|---:|",
             "| native | %d | 1.00x | |" % m["native"],
             "| sei ecc | %d | %.2fx | <= 2.2x |" % (m["ecc"], ledger["ecc_ratio"]),
             "| sei dup | %d | %.2fx | <= 4x |" % (m["dup"], ledger["dup_ratio"]), "",
             "### Server CPU per request, %d pipelined requests (kv_single --crc, kv_cli --pipeline %d, "
             "%d requests, median of %d interleaved rounds)" % (PIPELINE, PIPELINE, PIPELINED_REQUESTS,
                                                                PIPELINED_ROUNDS), "",
             "| build | CPU us per request | x native | goal |", "|---|---:|---:|---:|",
             "| native | %.2f | 1.00x | |" % pipelined["median"]["native"],
             "| sei ecc | %.2f | %.2fx | <= 1.3x |" % (pipelined["median"]["ecc"], pipelined["ecc_ratio"]),
             "| sei dup | %.2f | %.2fx | |" % (pipelined["median"]["dup"], pipelined["dup_ratio"]), "",
             "### Handler cycles (mean per handler, rdtsc)", "",
             "| value | op | native | sei ecc | ratio | sei dup | ratio |", "|---:|---|---:|---:|---:|---:|---:|"]
    for i, size in enumerate(SIZES):
        for op in ("get", "set"):
            n = cycles["native"][i][op + "_cycles"]
            e = cycles["ecc"][i][op + "_cycles"]
            d = cycles["dup"][i][op + "_cycles"]
            lines.append("| %d B | %s | %.0f | %.0f | %.2fx | %.0f | %.2fx |" % (size, op, n, e, e / n, d, d / n))
    lines += ["", "Memory per thread held by libsei: %d bytes (%.1f KiB); the largest handler logged %d words." % (
        memory["bytes_per_thread"], memory["bytes_per_thread"] / 1024, memory["max_words"]), "",
        "### Server throughput (saturated: memcaslap, 8 connections; paced: kv_load.py; 90%% get; %d s per point)" % SECONDS, "",
        "| server | workers | value | load | native TPS | sei TPS | sei / native | server CPU per op, sei / native | latency native / sei (us) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in tput:
        lat = "%.0f / %.0f" % (r["native"]["latency_us"], r["sei"]["latency_us"]) if r["paced"] else "—"
        lines.append("| %s | %d | %d B | %s | %d | %d | %.2f | %.2fx | %s |" % (
            r["server"], r["threads"], r["value_bytes"], "paced %d/s" % PACED_TPS if r["paced"] else "saturated",
            r["native"]["tps"], r["sei"]["tps"], r["ratio"], r["cpu_ratio"], lat))
    return "\n".join(lines) + "\n"


def main():
    build()
    cycles = handler_cycles()
    memory = cycles["ecc"][-1]
    cycles = {k: [r for r in v if "value_bytes" in r] for k, v in cycles.items()}
    for k in ("ecc", "dup"):
        for i, size in enumerate(SIZES):
            print("handler %-3s %5d B: get %.2fx, set %.2fx of native" % (
                k, size, cycles[k][i]["get_cycles"] / cycles["native"][i]["get_cycles"],
                cycles[k][i]["set_cycles"] / cycles["native"][i]["set_cycles"]), flush=True)
    ledger = ledger_cycles()
    print("ledger: native %d cycles, ecc %.2fx, dup %.2fx" % (ledger["median"]["native"], ledger["ecc_ratio"],
                                                              ledger["dup_ratio"]), flush=True)
    pipelined = pipelined_cpu()
    print("pipelined x%d: server CPU per request ecc %.2fx, dup %.2fx of native" % (
        PIPELINE, pipelined["ecc_ratio"], pipelined["dup_ratio"]), flush=True)
    tput = throughput()
    os.makedirs(OUT, exist_ok=True)
    json.dump({"handler_cycles": cycles, "memory": memory, "ledger": ledger, "pipelined": pipelined,
               "throughput": tput}, open(os.path.join(OUT, "sei.json"), "w"), indent=1)
    md = markdown(cycles, memory, tput, ledger, pipelined)
    open(os.path.join(OUT, "sei.md"), "w").write(md)
    print(md)


if __name__ == "__main__":
    main()
