#!/usr/bin/env python3
"""A paced load for the example key-value servers (memcaslap's --tps does not pace):
CONNS connections, RATE requests/s in total, 90% get / 10% set of SIZE-byte values over
1000 keys, for SECONDS. Prints one JSON line: achieved ops/s and mean latency (us).
Usage: bench/kv_load.py PORT RATE SIZE SECONDS [CONNS]"""
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sei", "examples"))
from kv_client import Client, get, set_  # noqa: E402


def worker(port, period, size, deadline, seed, out):
    rng = random.Random(seed)
    c = Client(port, False)
    value = b"v" * size
    for k in range(0, 1000, 7):
        c.request(set_("key%d" % k, value))
    ops, latency = 0, 0.0
    next_at = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        if now < next_at:
            time.sleep(next_at - now)
        start = time.monotonic()
        key = "key%d" % rng.randrange(1000)
        c.request(set_(key, value) if rng.random() < 0.1 else get(key))
        latency += time.monotonic() - start
        ops += 1
        next_at += period
    out.append((ops, latency))


def main():
    port, rate, size, seconds = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    conns = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    deadline = time.monotonic() + seconds
    out = []
    threads = [threading.Thread(target=worker, args=(port, conns / rate, size, deadline, i, out)) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ops = sum(o for o, _ in out)
    print(json.dumps({"tps": ops / seconds, "ops": ops, "latency_us": 1e6 * sum(l for _, l in out) / max(ops, 1)}))


if __name__ == "__main__":
    main()
