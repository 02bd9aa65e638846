#!/usr/bin/env python3
"""What a state audit of lockstep kv costs: a 3-replica cluster (release build) is filled
with N items, audits run every AUDIT_EVERY seconds, and each replica's `stats` reports how
long its last and its longest audit summary took on the apply thread. The share of the
apply thread's time is that duration over the audit period (default 10 s). Python 3
stdlib only.

Usage: bench/kv_audit_cost.py [ITEMS] [AUDIT_EVERY]   (defaults: 400000 items, 2 s)
"""
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "lockstep")
ITEMS = int(sys.argv[1]) if len(sys.argv) > 1 else 400_000
AUDIT_EVERY = int(sys.argv[2]) if len(sys.argv) > 2 else 2
DEFAULT_PERIOD_S = 10
PORT = 23311


def stats(port):
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"stats\r\n")
    out = b""
    while not out.endswith(b"END\r\n"):
        out += c.recv(1 << 16)
    c.close()
    return dict(line.split(" ", 2)[1:] for line in out.decode().split("\r\n") if line.startswith("STAT "))


def main():
    if not os.path.exists(BIN):
        sys.exit("build first: cargo build --release")
    cluster = subprocess.Popen([BIN, "kv", "cluster", "-n", "3", "--port", str(PORT), "--no-fsync",
                                "--audit-every", str(AUDIT_EVERY), "--snapshot-every", "100000000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while True:
            try:
                if stats(PORT).get("kv_role") in ("leader", "follower"):
                    break
            except OSError:
                pass
            if time.time() > deadline:
                sys.exit("the cluster did not start")
            time.sleep(0.2)
        s = socket.create_connection(("127.0.0.1", PORT))
        t0 = time.time()
        batch = 2000
        for base in range(0, ITEMS, batch):
            s.sendall(b"".join(b"set key%08d 0 0 32 noreply\r\n%s\r\n" % (i, b"v" * 32)
                               for i in range(base, min(base + batch, ITEMS))) + b"mn\r\n")
            reply = b""
            while not reply.endswith(b"MN\r\n"):
                reply += s.recv(1 << 16)
        print("filled %d items in %.1f s" % (ITEMS, time.time() - t0))
        time.sleep(3 * AUDIT_EVERY + 2)
        print("| replica | items | audits | last µs | max µs | share of the apply thread at %d s |" % DEFAULT_PERIOD_S)
        print("|---|---:|---:|---:|---:|---:|")
        for i in range(3):
            st = stats(PORT + i)
            last, worst = int(st["kv_audit_last_us"]), int(st["kv_audit_max_us"])
            print("| %d | %s | %s | %d | %d | %.3f%% |" % (i + 1, st["curr_items"], st["kv_audits"], last, worst,
                                                          100.0 * worst / (DEFAULT_PERIOD_S * 1e6)))
    finally:
        cluster.terminate()
        cluster.wait()


if __name__ == "__main__":
    main()
