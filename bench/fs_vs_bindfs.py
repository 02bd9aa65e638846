#!/usr/bin/env python3
"""lockstep fs side by side with a FUSE passthrough that also bypasses the kernel page cache
(bindfs -o direct_io) and with the native directory, in one run (needs root and bindfs).
Usage: bench/fs_vs_bindfs.py [SECONDS] [ROUNDS] [--quick]   (default 5 s per point, 3 rounds)

Workloads, each on a fresh mount or directory per round; within a round the configurations
run one after the other in a rotating order, so that machine noise hits all of them:
  randread4k / randwrite4k  fio, psync, one job, 4 KiB, on a 64 MiB file (written first)
  seqread1m / seqwrite1m    fio, psync, one job, 1 MiB, on a 256 MiB file
  create / stat / unlink    a C loop over N empty files in one directory (ops/s per phase)
  postmark                  PostMark, 2000 files of 512 B to 16 KiB, 10000 transactions
Configurations: native, bindfs (-o direct_io), lockstep (default strategy: every-read) and
lockstep --verify none, both with a 512 MiB cache.
Writes bench/out/fs_vs_bindfs.{json,md,svg}: medians over rounds, the ratio of lockstep to
bindfs, and of every-read to none. Nothing here asserts on timing.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import bar_chart  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "lockstep")
OUT = os.path.join(ROOT, "bench", "out")
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
QUICK = "--quick" in sys.argv
SECONDS = int(ARGS[0]) if ARGS else (1 if QUICK else 5)
ROUNDS = int(ARGS[1]) if len(ARGS) > 1 else (1 if QUICK else 3)
NFILES = 2000 if QUICK else 5000
CONFIGS = ["native", "bindfs", "lockstep", "lockstep-none"]
WORKLOADS = ["randread4k", "randwrite4k", "seqread1m", "seqwrite1m", "create", "stat", "unlink", "postmark"]

LOOP_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    int n = atoi(argv[2]); char p[4096]; struct stat st; double t0, t1, t2, t3;
    t0 = now();
    for (int i = 0; i < n; i++) { snprintf(p, sizeof p, "%s/f%d", argv[1], i); int fd = open(p, O_CREAT | O_WRONLY, 0644); if (fd < 0) { perror(p); return 1; } close(fd); }
    t1 = now();
    for (int i = 0; i < n; i++) { snprintf(p, sizeof p, "%s/f%d", argv[1], i); if (stat(p, &st)) { perror(p); return 1; } }
    t2 = now();
    for (int i = 0; i < n; i++) { snprintf(p, sizeof p, "%s/f%d", argv[1], i); if (unlink(p)) { perror(p); return 1; } }
    t3 = now();
    printf("%f %f %f\n", n / (t1 - t0), n / (t2 - t1), n / (t3 - t2));
    return 0;
}
"""


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


class Target:
    """A directory to measure in: native, a bindfs mount, or a lockstep mount."""

    def __init__(self, config):
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="lockstep-fsvb-", dir="/var/tmp")
        self.path = os.path.join(self.dir, "mnt")
        os.makedirs(self.path)
        if config == "bindfs":
            src = os.path.join(self.dir, "src")
            os.makedirs(src)
            sh(["bindfs", "-o", "direct_io", src, self.path])
        elif config.startswith("lockstep"):
            extra = ["--verify", "none"] if config == "lockstep-none" else []
            sh([BIN, "fs", "mount", "--store", os.path.join(self.dir, "store"), "--cache-size", "512M", *extra,
                self.path])

    def close(self):
        if self.config == "bindfs":
            subprocess.run(["umount", self.path], capture_output=True)
        elif self.config.startswith("lockstep"):
            subprocess.run([BIN, "fs", "umount", self.path], capture_output=True)
        subprocess.run(["rm", "-rf", self.dir])


def fio(path, rw, bs, size):
    out = sh(["fio", "--name=b", "--filename=" + os.path.join(path, "f"), "--rw=" + rw, "--bs=" + bs,
              "--size=" + size, "--time_based", "--runtime=%d" % SECONDS, "--ioengine=psync",
              "--fallocate=none", "--minimal", "--output-format=terse"])
    f = out.strip().split(";")
    # terse v3 (1-based): read IOPS is field 8, write IOPS field 49.
    return float(f[7] if rw.endswith("read") else f[48])


def prepare(path, size):
    sh(["fio", "--name=p", "--filename=" + os.path.join(path, "f"), "--rw=write", "--bs=1M", "--size=" + size,
        "--ioengine=psync", "--fallocate=none", "--minimal"])


def postmark(path):
    files, transactions = (500, 2000) if QUICK else (2000, 10000)
    cfg = ("set location %s\nset number %d\nset transactions %d\nset size 512 16384\nset seed 7\nrun\nquit\n"
           % (path, files, transactions))
    t = time.monotonic()
    p = subprocess.run(["postmark"], input=cfg, text=True, check=True, capture_output=True)
    if p.stderr:
        sys.exit(f"PostMark failed in {path}: {p.stderr[:300]}")
    return (files + transactions) / (time.monotonic() - t)  # operations per second


def measure(config, loop):
    r = {}
    for name, rw, bs, size in [("randread4k", "randread", "4k", "64M"), ("randwrite4k", "randwrite", "4k", "64M"),
                               ("seqread1m", "read", "1M", "256M" if not QUICK else "64M"),
                               ("seqwrite1m", "write", "1M", "256M" if not QUICK else "64M")]:
        t = Target(config)
        try:
            prepare(t.path, size)
            r[name] = fio(t.path, rw, bs, size)
        finally:
            t.close()
    t = Target(config)
    try:
        c, s, u = map(float, sh([loop, t.path, str(NFILES)]).split())
        r.update(create=c, stat=s, unlink=u)
        r["postmark"] = postmark(t.path)
    finally:
        t.close()
    return r


def main():
    if os.geteuid() != 0:
        sys.exit("bench/fs_vs_bindfs.py needs root (FUSE mounts)")
    if not os.path.exists(BIN):
        sys.exit("build first: cargo build --release")
    os.makedirs(OUT, exist_ok=True)
    work = tempfile.mkdtemp(prefix="lockstep-fsvb-bin-")
    loop = os.path.join(work, "loop")
    with open(loop + ".c", "w") as f:
        f.write(LOOP_C)
    sh(["gcc", "-O2", "-o", loop, loop + ".c"])
    runs = {c: {w: [] for w in WORKLOADS} for c in CONFIGS}
    for rnd in range(ROUNDS):
        order = CONFIGS[rnd % len(CONFIGS):] + CONFIGS[:rnd % len(CONFIGS)]
        for c in order:
            print(f"round {rnd + 1}/{ROUNDS}: {c} ...", flush=True)
            for w, v in measure(c, loop).items():
                runs[c][w].append(v)
    med = {c: {w: statistics.median(runs[c][w]) for w in WORKLOADS} for c in CONFIGS}
    ratio = {w: med["lockstep"][w] / med["bindfs"][w] for w in WORKLOADS}
    verify_cost = {w: med["lockstep"][w] / med["lockstep-none"][w] for w in WORKLOADS}
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"command": "python3 bench/fs_vs_bindfs.py %d %d%s" % (SECONDS, ROUNDS, " --quick" if QUICK else ""),
              "commit": commit, "seconds": SECONDS, "rounds": ROUNDS, "files": NFILES, "unit": "operations/s",
              "runs": runs, "median": med, "lockstep_vs_bindfs": ratio, "every_read_vs_none": verify_cost}
    with open(os.path.join(OUT, "fs_vs_bindfs.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"`{result['command']}` at {commit}; operations per second, median of {ROUNDS} round(s).", "",
             "| workload | native | bindfs direct_io | lockstep (every-read) | lockstep none | lockstep / bindfs | every-read / none |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        m = med
        lines.append(f"| {w} | {m['native'][w]:.0f} | {m['bindfs'][w]:.0f} | {m['lockstep'][w]:.0f} | "
                     f"{m['lockstep-none'][w]:.0f} | {ratio[w]:.2f} | {verify_cost[w]:.3f} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(OUT, "fs_vs_bindfs.md"), "w") as f:
        f.write(md)
    svg = bar_chart("lockstep fs vs bindfs -o direct_io (ratio of operations/s)", "ratio", WORKLOADS,
                    [("lockstep / bindfs", "#4878d0", [ratio[w] for w in WORKLOADS]),
                     ("every-read / none", "#ee854a", [verify_cost[w] for w in WORKLOADS])],
                    max(2.0, max(ratio.values()) * 1.1), lambda v: f"{v:.2f}",
                    hlines=[(0.9, "goal 0.9", "#d62728"), (1.0, "", "#888")])
    with open(os.path.join(OUT, "fs_vs_bindfs.svg"), "w") as f:
        f.write(svg)
    print(md)
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
