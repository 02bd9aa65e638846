#!/usr/bin/env python3
"""lockstep fs side by side, in one run, with the native directory and with a FUSE passthrough
that also bypasses the kernel page cache (bindfs -o direct_io). Python 3 stdlib only; run as
root with fio, postmark, gcc and bindfs installed (scripts/deps.sh bench installs them).

Usage: bench/fs_vs_bindfs.py [SECONDS] [ROUNDS] [--quick]
    SECONDS per fio point (default 5), ROUNDS (default 3); --quick: 1 s, 1 round, smaller sizes.

Workloads, each on a fresh mount or directory, all on one fresh ext4 filesystem made for the
run on a loop device (a sparse image under /var/tmp), so that every configuration has the
same backing filesystem and none inherits the fragmentation of a long-used one (on this VM,
native file creation on the much-used /var/tmp ran 25x slower than on a fresh filesystem);
without mkfs.ext4, /var/tmp itself:
  randread4k / randwrite4k  fio, psync, 1 job, 4 KiB random, 64 MiB file            (IOPS)
  seqread1m / seqwrite1m    fio, psync, 1 job, 1 MiB sequential, 256 MiB file       (MiB/s)
      The file is written and fsynced first; fio runs with --invalidate=0 so that every
      configuration reads warm data (native: the kernel page cache; bindfs: the kernel page
      cache of the backing file; lockstep: its own cache, --cache-size 512M). Writes are not
      fsynced: they measure what the application sees.
  create / stat / unlink    a C loop (compiled here with gcc) over N empty files in one
                            directory, one phase after the other                    (ops/s)
  postmark                  PostMark 1.51, 2000 files of 512 B..16 KiB, 10000 transactions:
                            total seconds, and transactions/s of the transaction phase
                            (timed here from PostMark's progress output, not its whole-second
                            report)
Configurations: native, bindfs (-o direct_io), lockstep (default strategy: no --verify),
lockstep --verify none, lockstep --verify every-read.
Before each workload the backing filesystem is synced and left alone for a second.
Rounds are interleaved: within a round every workload runs on every configuration in turn,
in an order rotated from round to round, so that machine noise hits all of them.

Writes bench/out/fs_vs_bindfs.json (everything, including every run), .md (medians and
ratios) and .svg (lockstep / bindfs per workload). Ratios are speed ratios (> 1: lockstep
faster); for PostMark seconds the ratio is inverted accordingly. Nothing here asserts on
timing. Mounts are removed on exit, Ctrl-C, SIGTERM or an exception.
"""
import datetime
import json
import os
import platform
import pty
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import bar_chart  # noqa: E402  (the SVG helper shared by the benchmarks)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = os.path.join(ROOT, "target", "release", "lockstep")
BIN = BUILT  # replaced by a private copy in main(), so a rebuild during the run changes nothing
OUT = os.path.join(ROOT, "bench", "out")
SCRATCH = "/var/tmp"

QUICK = "--quick" in sys.argv[1:]
_args = [a for a in sys.argv[1:] if a != "--quick"]
if any(a.startswith("-") for a in _args) or len(_args) > 2 or not all(a.isdigit() and int(a) > 0 for a in _args):
    sys.exit("usage: bench/fs_vs_bindfs.py [SECONDS] [ROUNDS] [--quick]")
SECONDS = int(_args[0]) if _args else (1 if QUICK else 5)
ROUNDS = int(_args[1]) if len(_args) > 1 else (1 if QUICK else 3)
RAND_SIZE = "64M"
SEQ_SIZE = "64M" if QUICK else "256M"
NFILES = 500 if QUICK else 20000  # 5000 took ~0.5 s per phase: too short to be steady
PM_FILES, PM_TRANSACTIONS = (500, 2000) if QUICK else (2000, 10000)
CACHE = "512M"
GOAL = 0.9  # shared/BRIEF.md: lockstep fs (default strategy) >= 0.9x bindfs -o direct_io

# name -> extra `fs mount` options (None: not lockstep)
CONFIGS = {
    "native": None,
    "bindfs": None,
    "lockstep": [],  # the default strategy, whatever it is in this build
    "lockstep-none": ["--verify", "none"],
    "lockstep-every-read": ["--verify", "every-read"],
}
LOCKSTEPS = [c for c, o in CONFIGS.items() if o is not None]
# metric -> (unit, higher is better)
METRICS = {
    "randread4k": ("IOPS", True),
    "randwrite4k": ("IOPS", True),
    "seqread1m": ("MiB/s", True),
    "seqwrite1m": ("MiB/s", True),
    "create": ("ops/s", True),
    "stat": ("ops/s", True),
    "unlink": ("ops/s", True),
    "postmark_s": ("s", False),
    "postmark_tps": ("transactions/s", True),
}
WORKLOADS = ["randread4k", "randwrite4k", "seqread1m", "seqwrite1m", "meta", "postmark"]

LOOP_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: loop DIR N\n"); return 2; }
    int n = atoi(argv[2]); char p[4096]; struct stat st; double t0, t1, t2, t3;
    t0 = now();
    for (int i = 0; i < n; i++) {
        snprintf(p, sizeof p, "%s/f%d", argv[1], i);
        int fd = open(p, O_CREAT | O_EXCL | O_WRONLY, 0644);
        if (fd < 0 || close(fd)) { perror(p); return 1; }
    }
    t1 = now();
    for (int i = 0; i < n; i++) { snprintf(p, sizeof p, "%s/f%d", argv[1], i); if (stat(p, &st)) { perror(p); return 1; } }
    t2 = now();
    for (int i = 0; i < n; i++) { snprintf(p, sizeof p, "%s/f%d", argv[1], i); if (unlink(p)) { perror(p); return 1; } }
    t3 = now();
    printf("%f %f %f\n", n / (t1 - t0), n / (t2 - t1), n / (t3 - t2));
    return 0;
}
"""

ACTIVE = []     # targets not yet cleaned up
ANOMALIES = []  # unexpected things seen (unmount failures, ...), reported in the outputs


def log(msg):
    print(msg, flush=True)


def warn(msg):
    ANOMALIES.append(msg)
    print("WARNING: " + msg, file=sys.stderr, flush=True)


def sh(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError("%s exited %d: %s" % (" ".join(cmd), p.returncode, (p.stderr or p.stdout).strip()[-600:]))
    return p.stdout


def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1].replace("\\040", " ") == path:
                return True
    return False


class Target:
    """A fresh directory to measure in: native, a bindfs mount or a lockstep mount."""

    def __init__(self, config):
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="lockstep-fsvb-", dir=SCRATCH)
        self.path = os.path.join(self.dir, "mnt")
        self.closed = False
        ACTIVE.append(self)  # before mounting: close() cleans up a half-made target too
        os.makedirs(self.path)
        if config == "bindfs":
            src = os.path.join(self.dir, "src")
            os.makedirs(src)
            # direct_io is a libfuse (2.9) option that bindfs passes through; it is not in
            # `bindfs --help`, which lists only bindfs's own options.
            sh(["bindfs", "-o", "direct_io", src, self.path])
        elif CONFIGS[config] is not None:
            sh([BIN, "fs", "mount", "--store", os.path.join(self.dir, "store"), "--cache-size", CACHE,
                *CONFIGS[config], self.path])
        if config != "native" and not mounted(self.path):
            raise RuntimeError("%s: nothing mounted at %s" % (config, self.path))

    def close(self):
        if self.closed:
            return
        self.closed = True
        try:
            if self.config == "bindfs" and mounted(self.path):
                r = subprocess.run(["fusermount", "-u", self.path], capture_output=True, text=True)
                if r.returncode != 0:
                    warn("fusermount -u %s: %s" % (self.path, r.stderr.strip()))
            elif self.config != "native" and mounted(self.path):
                r = subprocess.run([BIN, "fs", "umount", self.path], capture_output=True, text=True)
                if r.returncode != 0:
                    warn("lockstep fs umount %s (%s) exited %d: %s"
                         % (self.path, self.config, r.returncode, (r.stderr or r.stdout).strip()[-300:]))
            if mounted(self.path):
                subprocess.run(["umount", "-l", self.path], capture_output=True)
        finally:
            if mounted(self.path):
                warn("%s is still mounted; left %s in place" % (self.path, self.dir))
            else:
                subprocess.run(["rm", "-rf", "--one-file-system", self.dir], capture_output=True)
            if self in ACTIVE:
                ACTIVE.remove(self)


def fio(path, rw, bs, size, prepare):
    f = os.path.join(path, "f")
    if prepare:
        sh(["fio", "--name=prep", "--filename=" + f, "--rw=write", "--bs=1M", "--size=" + size,
            "--ioengine=psync", "--fallocate=none", "--end_fsync=1", "--output-format=terse"])
    out = sh(["fio", "--name=b", "--filename=" + f, "--rw=" + rw, "--bs=" + bs, "--size=" + size,
              "--time_based", "--runtime=%d" % SECONDS, "--ioengine=psync", "--numjobs=1", "--invalidate=0",
              "--fallocate=none", "--output-format=json"])
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["read" if rw.endswith("read") else "write"]
    if job.get("error"):
        raise RuntimeError("fio %s in %s: error %s" % (rw, path, job["error"]))
    return side["iops"] if bs == "4k" else side["bw_bytes"] / (1 << 20)


def meta(path, loop):
    c, s, u = map(float, sh([loop, path, str(NFILES)]).split())
    return {"create": c, "stat": s, "unlink": u}


def postmark(path):
    """Runs PostMark with its output on a pty (it flushes its progress lines there), timing the
    transaction phase from "Performing transactions" to the "Done" that follows it."""
    cfg = ("set location %s\nset number %d\nset transactions %d\nset size 512 16384\nset seed 7\nrun\nquit\n"
           % (path, PM_FILES, PM_TRANSACTIONS))
    master, slave = pty.openpty()
    t0 = time.monotonic()
    p = subprocess.Popen(["postmark"], stdin=subprocess.PIPE, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    buf, t_tx, t_done = b"", None, None
    try:
        p.stdin.write(cfg.encode())
        p.stdin.close()
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the pty's other side is closed (PostMark exited)
                break
            if not chunk:
                break
            now = time.monotonic()
            buf += chunk
            i = buf.find(b"Performing transactions")
            if t_tx is None and i >= 0:
                t_tx = now
            if t_tx is not None and t_done is None and buf.find(b"Done", i) >= 0:
                t_done = now
        err = p.stderr.read().decode(errors="replace")
        p.wait()
        total = time.monotonic() - t0
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
            p.wait()
    text = buf.decode(errors="replace")
    if p.returncode != 0 or err.strip() or "Deleting files" not in text:
        raise RuntimeError("PostMark failed in %s (exit %s): %s" % (path, p.returncode, (err or text).strip()[-400:]))
    if t_tx is None or t_done is None or t_done <= t_tx:  # fall back on PostMark's whole seconds
        m = re.search(r"(\d+) seconds of transactions", text)
        tx_s = max(int(m.group(1)), 1) if m else total
        warn("PostMark progress not seen; transactions/s from its whole-second report")
    else:
        tx_s = t_done - t_tx
    return {"postmark_s": total, "postmark_tps": PM_TRANSACTIONS / tx_s}


def settle():
    """Lets the backing filesystem finish what the previous workload left (the removal of a
    256 MiB file and its journal commits), so that it is not charged to the next one."""
    os.sync()
    time.sleep(1)


def run_workload(w, config, loop):
    settle()
    t = Target(config)
    try:
        if w == "randread4k":
            return {w: fio(t.path, "randread", "4k", RAND_SIZE, True)}
        if w == "randwrite4k":
            return {w: fio(t.path, "randwrite", "4k", RAND_SIZE, True)}
        if w == "seqread1m":
            return {w: fio(t.path, "read", "1M", SEQ_SIZE, True)}
        if w == "seqwrite1m":
            return {w: fio(t.path, "write", "1M", SEQ_SIZE, True)}
        if w == "meta":
            return meta(t.path, loop)
        if w == "postmark":
            return postmark(t.path)
        raise ValueError(w)
    finally:
        t.close()


def speed_ratio(metric, a, b):
    """How much faster a is than b (> 1: a faster)."""
    if not a or not b:
        return None
    return a / b if METRICS[metric][1] else b / a


def fmt(v, digits=0):
    return "—" if v is None else f"{v:,.{digits}f}"


def default_strategy():
    try:
        h = subprocess.run([BIN, "fs", "mount", "--help"], capture_output=True, text=True).stdout
        m = re.search(r"--verify\b[^\[]*\[default: ([^\]]+)\]", h)
        return m.group(1) if m else "unknown"
    except OSError:
        return "unknown"


def version(cmd):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
        return (p.stdout or p.stderr).strip().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"


def report(runs, meta_info):
    med = {c: {m: (statistics.median(runs[c][m]) if runs[c][m] else None) for m in METRICS} for c in CONFIGS}
    vs_bindfs = {c: {m: speed_ratio(m, med[c][m], med["bindfs"][m]) for m in METRICS} for c in LOCKSTEPS}
    vs_none = {c: {m: speed_ratio(m, med[c][m], med["lockstep-none"][m]) for m in METRICS}
               for c in LOCKSTEPS if c != "lockstep-none"}
    result = dict(meta_info, runs=runs, median=med, units={m: u for m, (u, _) in METRICS.items()},
                  ratio_vs_bindfs=vs_bindfs, ratio_vs_none=vs_none, anomalies=ANOMALIES)
    with open(os.path.join(OUT, "fs_vs_bindfs.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")

    d = meta_info["default_strategy"]
    lines = [f"`{meta_info['command']}` at {meta_info['commit']}{' (crates/ modified)' if meta_info['crates_dirty'] else ''}, "
             f"{meta_info['date']}; median of {ROUNDS} round(s), {SECONDS} s per fio point; "
             f"lockstep with --cache-size {CACHE}, default strategy `{d}`.", "",
             "| workload | unit | native | bindfs direct_io | lockstep (default) | lockstep none | lockstep every-read |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for m, (unit, _) in METRICS.items():
        dg = 2 if unit == "s" else 0
        lines.append(f"| {m} | {unit} | " + " | ".join(fmt(med[c][m], dg) for c in CONFIGS) + " |")
    lines += ["", f"Speed ratios (> 1: the first is faster; PostMark seconds inverted). Goal for the default "
                  f"strategy vs bindfs: ≥ {GOAL}×.", "",
              "| workload | default / bindfs | none / bindfs | every-read / bindfs | default / none | every-read / none |",
              "|---|---:|---:|---:|---:|---:|"]
    for m in METRICS:
        cells = [vs_bindfs[c][m] for c in ("lockstep", "lockstep-none", "lockstep-every-read")]
        cells += [vs_none[c][m] for c in ("lockstep", "lockstep-every-read")]
        lines.append(f"| {m} | " + " | ".join(fmt(v, 2) for v in cells) + " |")
    lines += ["", f"Workloads: fio psync 1 job, {RAND_SIZE} file (4k random) and {SEQ_SIZE} file (1 MiB sequential), "
                  f"written and fsynced first, read warm (--invalidate=0), writes not fsynced; {NFILES} empty files "
                  f"created, stat'ed and unlinked in one directory; PostMark {PM_FILES} files of 512 B–16 KiB, "
                  f"{PM_TRANSACTIONS} transactions (transactions/s over the transaction phase). Backing filesystem: "
                  f"{meta_info['scratch']}."]
    if ANOMALIES:
        lines += ["", "Anomalies:", ""] + ["- " + a for a in ANOMALIES]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(OUT, "fs_vs_bindfs.md"), "w") as f:
        f.write(md)

    series = [(f"default ({d})", "#4878d0", [vs_bindfs["lockstep"][m] for m in METRICS]),
              ("none", "#6acc64", [vs_bindfs["lockstep-none"][m] for m in METRICS]),
              ("every-read", "#ee854a", [vs_bindfs["lockstep-every-read"][m] for m in METRICS])]
    top = max([v for _, _, vals in series for v in vals if v is not None] + [1.0])
    ymax = min(max(1.5, top * 1.15), 4.0)
    names = [m.replace("postmark_", "pm ") for m in METRICS]
    svg = bar_chart("lockstep fs vs bindfs -o direct_io (speed ratio, median of %d)" % ROUNDS, "lockstep / bindfs",
                    names, series, ymax, lambda v: f"{v:.2f}",
                    hlines=[(GOAL, f"goal {GOAL}x (default)", "#d62728"), (1.0, "parity", "#888")],
                    note=f"{meta_info['command']} at {meta_info['commit']}; > 1: lockstep faster; "
                         "pm s = PostMark time, inverted")
    with open(os.path.join(OUT, "fs_vs_bindfs.svg"), "w") as f:
        f.write(svg)
    return md


def on_signal(signum, frame):
    raise KeyboardInterrupt("signal %d" % signum)


def main():
    global BIN
    if os.geteuid() != 0:
        sys.exit("bench/fs_vs_bindfs.py needs root (FUSE mounts)")
    if not os.path.exists(BUILT):
        sys.exit("build first: cargo build --release -p lockstep-cli")
    missing = [t for t in ("fio", "postmark", "gcc", "bindfs", "fusermount") if not shutil.which(t)]
    if missing:
        sys.exit("missing: %s (scripts/deps.sh bench installs them)" % " ".join(missing))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: it may arrive ignored
        signal.signal(sig, on_signal)
    os.makedirs(OUT, exist_ok=True)
    global SCRATCH
    work = tempfile.mkdtemp(prefix="lockstep-fsvb-bin-", dir=SCRATCH)
    fresh_fs = None
    try:
        if shutil.which("mkfs.ext4"):
            img, fresh_fs = os.path.join(work, "fs.img"), os.path.join(work, "fs")
            os.makedirs(fresh_fs)
            with open(img, "wb") as f:
                f.truncate(16 << 30)
            sh(["mkfs.ext4", "-q", "-F", img])
            sh(["mount", "-o", "loop", img, fresh_fs])
            SCRATCH = fresh_fs
        BIN = os.path.join(work, "lockstep")
        shutil.copy2(BUILT, BIN)
        loop = os.path.join(work, "loop")
        with open(loop + ".c", "w") as f:
            f.write(LOOP_C)
        sh(["gcc", "-O2", "-Wall", "-o", loop, loop + ".c"])
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "crates"],
                                    capture_output=True, text=True).stdout.strip())
        meta_info = {
            "command": "python3 bench/fs_vs_bindfs.py %d %d%s" % (SECONDS, ROUNDS, " --quick" if QUICK else ""),
            "commit": commit, "crates_dirty": dirty,
            "binary_mtime": datetime.datetime.fromtimestamp(os.path.getmtime(BUILT)).isoformat(timespec="seconds"),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "default_strategy": default_strategy(), "seconds": SECONDS, "rounds": ROUNDS, "quick": QUICK,
            "sizes": {"rand": RAND_SIZE, "seq": SEQ_SIZE, "meta_files": NFILES,
                      "postmark_files": PM_FILES, "postmark_transactions": PM_TRANSACTIONS},
            "lockstep_cache": CACHE, "bindfs_options": ["-o", "direct_io"],
            "scratch": "fresh ext4 on a loop device (16 GiB sparse image)" if fresh_fs else SCRATCH,
            "versions": {"bindfs": version(["bindfs", "--version"]), "fio": version(["fio", "--version"]),
                         "kernel": platform.release(), "cpus": os.cpu_count()},
        }
        log("fs_vs_bindfs: %d round(s) x %d workloads x %d configurations, %d s per fio point; default strategy %s"
            % (ROUNDS, len(WORKLOADS), len(CONFIGS), SECONDS, meta_info["default_strategy"]))
        runs = {c: {m: [] for m in METRICS} for c in CONFIGS}
        names = list(CONFIGS)
        for rnd in range(ROUNDS):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for w in WORKLOADS:
                for c in order:
                    t = time.monotonic()
                    r = run_workload(w, c, loop)
                    for m, v in r.items():
                        runs[c][m].append(v)
                    shown = "  ".join("%s %s %s" % (m, fmt(v, 2 if METRICS[m][0] == "s" else 0), METRICS[m][0])
                                      for m, v in r.items())
                    log("round %d/%d  %-11s %-20s %s  (%.1f s)" % (rnd + 1, ROUNDS, w, c, shown, time.monotonic() - t))
        md = report(runs, meta_info)
        log("")
        log(md)
        log("wrote bench/out/fs_vs_bindfs.{json,md,svg}")
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr, flush=True)
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for t in list(reversed(ACTIVE)):
            t.close()
        if fresh_fs and mounted(fresh_fs):
            subprocess.run(["umount", fresh_fs], capture_output=True)
        if fresh_fs and mounted(fresh_fs):
            warn("%s is still mounted; left %s in place" % (fresh_fs, work))
        else:
            subprocess.run(["rm", "-rf", "--one-file-system", work])


if __name__ == "__main__":
    main()
