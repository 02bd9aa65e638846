#!/usr/bin/env python3
"""Benchmarks for `lockstep fs` (Loris), against baselines measured in the same run.
Usage: bench/fs_bench.py [SECONDS] [ROUNDS]   (default 5 s per point, 3 rounds; needs root)

1. Overhead of verification: fio random 4 KiB reads (psync, one job) of a 64 MiB file that
   fits in the cache, per strategy: none (the baseline), last-check=1s, last-use=1s and
   every-read, no scrubber. Rounds interleave the strategies; the ratio is IOPS / none.
2. Memory errors caught: 64 MiB written and written back (clean pages) plus 4 MiB written
   and left dirty; then 200 single-bit flips in clean pages and 50 in dirty pages
   (`lockstep fs ctl ... flip`), then every file is read once in full. A flip in a page that
   is read is consumed; it is caught if the read gave the right data (a clean page read
   again from the store) or EIO (a dirty page), and silent if the read returned the
   flipped byte. Per strategy, and for the scrubber alone (--verify none --scrub 100000).
3. Crashes of the cache daemon: a writer (files of 1 B to 256 KiB in 7 directories, each
   read back at once, every fifth renamed, 30 s of dirty data allowed) runs while the
   daemon is aborted CRASHES times at random intervals of 50 to 400 ms. A crash counts as
   recovered if the supervisor's `crash` event is followed by the new daemon's `recover`
   event, the workload saw no error, and at the end every file holds exactly what was
   written (checked on the mount and, after unmount, in the store).
Writes bench/out/fs.json and bench/out/fs.md. Nothing here asserts on timing.
"""
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "lockstep")
OUT = os.path.join(ROOT, "bench", "out")
SECONDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
STRATEGIES = ["none", "last-check=1s", "last-use=1s", "every-read"]


class Mount:
    def __init__(self, *args):
        self.dir = tempfile.mkdtemp(prefix="lockstep-fs-bench-")
        self.mnt = os.path.join(self.dir, "mnt")
        os.makedirs(self.mnt)
        subprocess.run([BIN, "fs", "mount", "--store", os.path.join(self.dir, "store"), "--cache-size", "512M", *args,
                        self.mnt], check=True)

    def ctl(self, *cmd):
        out = subprocess.run([BIN, "fs", "ctl", self.mnt, *cmd], capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    def close(self):
        subprocess.run([BIN, "fs", "umount", self.mnt], capture_output=True)
        subprocess.run(["rm", "-rf", self.dir])


def fio_iops(path):
    out = subprocess.run(["fio", "--name=r", "--filename=" + path, "--rw=randread", "--bs=4k", "--size=64M",
                          "--time_based", "--runtime=%d" % SECONDS, "--ioengine=psync", "--minimal",
                          "--output-format=terse"], capture_output=True, text=True, check=True).stdout
    return int(out.strip().split(";")[7])


def overhead():
    iops = {s: [] for s in STRATEGIES}
    for rnd in range(ROUNDS):
        for s in STRATEGIES:
            m = Mount("--verify", s, "--scrub", "0")
            try:
                path = os.path.join(m.mnt, "f")
                with open(path, "wb") as f:
                    f.write(os.urandom(64 << 20))
                with open(path, "rb") as f:  # warm the cache
                    while f.read(1 << 20):
                        pass
                v = fio_iops(path)
                iops[s].append(v)
                print("round %d %-15s %7d IOPS" % (rnd + 1, s, v), file=sys.stderr)
            finally:
                m.close()
    return iops


def coverage(verify, scrub, wait):
    m = Mount("--verify", verify, "--scrub", scrub, "--dirty-age", "30s", "--test-flips")
    try:
        rng = random.Random(7)
        clean = bytes(rng.getrandbits(8) for _ in range(1 << 16)) * 1024  # 64 MiB
        dirty = bytes(rng.getrandbits(8) for _ in range(1 << 16)) * 64     # 4 MiB
        with open(os.path.join(m.mnt, "clean"), "wb") as f:
            f.write(clean)
        m.ctl("flush")
        with open(os.path.join(m.mnt, "dirty"), "wb") as f:
            f.write(dirty)
        # Let last-check/last-use age past their limits before the flips are consumed.
        time.sleep(wait)
        flipped_clean = m.ctl("flip", "200", "clean")["flipped"]
        flipped_dirty = m.ctl("flip", "50", "dirty")["flipped"]
        time.sleep(1.5 if verify == "none" else 0)
        silent = eio = 0
        for name, want in (("clean", clean), ("dirty", dirty)):
            with open(os.path.join(m.mnt, name), "rb", buffering=0) as f:
                for off in range(0, len(want), 4096):
                    try:
                        f.seek(off)
                        got = f.read(4096)
                    except OSError:
                        eio += 1
                        continue
                    if got != want[off:off + 4096]:
                        silent += 1
        s = m.ctl("stats")
        return {"verify": verify, "scrub": scrub, "flipped_clean": flipped_clean, "flipped_dirty": flipped_dirty,
                "clean_detected": s["clean_detected"], "dirty_detected": s["dirty_detected"], "eio_pages": eio,
                "silent_pages": silent}
    finally:
        m.close()


def crashes(count):
    import threading
    m = Mount("--test-crash", "--dirty-age", "30s", "--events", "/dev/null")
    events = os.path.join(m.dir, "events.jsonl")
    subprocess.run([BIN, "fs", "umount", m.mnt], capture_output=True)
    subprocess.run([BIN, "fs", "mount", "--store", os.path.join(m.dir, "store"), "--cache-size", "512M", "--test-crash",
                    "--dirty-age", "30s", "--events", events, m.mnt], check=True)
    written, errors, stop = {}, [], threading.Event()

    def writer():
        rng = random.Random(11)
        i = 0
        while not stop.is_set():
            d = os.path.join(m.mnt, "d%d" % (i % 7))
            data = rng.randbytes(rng.randrange(1, 256 << 10))
            try:
                os.makedirs(d, exist_ok=True)
                p = os.path.join(d, "w%d" % i)
                with open(p, "wb") as f:
                    f.write(data)
                with open(p, "rb") as f:
                    if f.read() != data:
                        errors.append("read back differs: " + p)
                if i % 5 == 0:
                    os.rename(p, p + ".r")
                    p += ".r"
                written[p] = data
            except OSError as e:
                errors.append("%s: %s" % (p, e))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    rng = random.Random(5)
    for _ in range(count):
        time.sleep(rng.uniform(0.05, 0.4))
        # Right after a crash the new daemon may not listen yet: try until one is there.
        while True:
            r = subprocess.run([BIN, "fs", "ctl", m.mnt, "crash"], capture_output=True, text=True)
            if "Connection refused" not in r.stderr and "No such file" not in r.stderr:
                break
            time.sleep(0.02)
    time.sleep(0.5)
    stop.set()
    t.join()
    wrong = sum(1 for p, data in written.items() if open(p, "rb").read() != data)
    subprocess.run([BIN, "fs", "umount", m.mnt], capture_output=True)
    store = os.path.join(m.dir, "store")
    wrong_on_disk = sum(1 for p, data in written.items()
                        if open(os.path.join(store, os.path.relpath(p, m.mnt)), "rb").read() != data)
    kinds = [json.loads(line)["kind"] for line in open(events)]
    result = {"crashes": count, "crash_events": kinds.count("crash"), "recover_events": kinds.count("recover"),
              "halts": kinds.count("halt"), "files": len(written), "workload_errors": errors[:5],
              "workload_error_count": len(errors), "files_wrong": wrong, "files_wrong_on_disk": wrong_on_disk}
    subprocess.run(["rm", "-rf", m.dir])
    return result


def main():
    if os.geteuid() != 0 or not os.path.exists(BIN):
        raise SystemExit("run as root after cargo build --release")
    if len(sys.argv) > 3 and sys.argv[3] == "crashes-only":
        print(json.dumps(crashes(int(sys.argv[4]) if len(sys.argv) > 4 else 40), indent=1))
        return
    iops = overhead()
    cov = [coverage("every-read", "0", 0), coverage("last-check=1s", "0", 1.2), coverage("last-use=1s", "0", 1.2),
           coverage("last-check=1s", "0", 0), coverage("none", "100000", 0)]
    crash = crashes(40)
    med = {s: statistics.median(v) for s, v in iops.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    os.makedirs(OUT, exist_ok=True)
    json.dump({"seconds": SECONDS, "rounds": ROUNDS, "iops": iops, "coverage": cov, "crashes": crash, "commit": commit},
              open(os.path.join(OUT, "fs.json"), "w"), indent=1)
    lines = ["### Verification overhead (fio randread 4 KiB, cached 64 MiB file, median of %d rounds × %d s)" % (ROUNDS, SECONDS), "",
             "| strategy | IOPS | vs none |", "|---|---:|---:|"]
    for s in STRATEGIES:
        lines.append("| %s | %d | %.3f |" % (s, med[s], med[s] / med["none"]))
    lines += ["", "### Memory errors caught (200 flips in clean pages, 50 in dirty pages, then every page read once)", "",
              "| verify | scrub | wait before flips | flips clean / dirty | clean caught | dirty caught (EIO) | pages read wrong (silent) |",
              "|---|---:|---:|---|---:|---:|---:|"]
    waits = [0, 1.2, 1.2, 0, 0]
    for c, w in zip(cov, waits):
        lines.append("| %s | %s | %.1f s | %d / %d | %d | %d | %d |" % (
            c["verify"], c["scrub"], w, c["flipped_clean"], c["flipped_dirty"], c["clean_detected"], c["dirty_detected"],
            c["silent_pages"]))
    lines += ["", "### Daemon crashes during a write-heavy workload", "",
              "| crashes injected | recovered (crash then recover event) | halts | workload errors | files written | files wrong (mount / disk) |",
              "|---:|---:|---:|---:|---:|---|",
              "| %d | %d | %d | %d | %d | %d / %d |" % (crash["crashes"], min(crash["crash_events"], crash["recover_events"]),
                                                    crash["halts"], crash["workload_error_count"], crash["files"],
                                                    crash["files_wrong"], crash["files_wrong_on_disk"])]
    md = "\n".join(lines) + "\n"
    open(os.path.join(OUT, "fs.md"), "w").write(md)
    print(md)


if __name__ == "__main__":
    main()
