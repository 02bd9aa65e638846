#!/usr/bin/env python3
"""order_programs.py - issue 17's multi-threaded programs under `lockstep run`: how many
runs end as natively (same output, exit 0) with no divergence, under -r 2 and -r 3:
zstd, xz, pigz, sort, git gc and a Python thread pool, and memcached with its default
threads under memcaslap.

    python3 bench/order_programs.py [--runs N] [--only NAME] [--lockstep BIN]
                                    [--sync-order global|object|serial] [--leader-dies N]

With --leader-dies N (under -r 3 only), the first leader's process kills itself at the N-th
record of the first thread the program started to get there (the shim's test hook die:N),
and a follower must take its place in the ring for the run to end as natively.

Each program's native output is taken once; a run counts as good when its exit status is
0, its output equals the native one and lockstep reported no divergence. The Python job's
threads print in the order they finish, which differs natively from run to run: its lines
are compared as a set. `git gc` runs on a fresh copy of a repository each time and
counts as good when `git fsck --strict` passes and every object is still there afterwards
(its pack's bytes may differ natively between runs: the delta search is split between
threads). memcached counts as good when memcaslap's verified gets found no wrong value,
memcached answered every request and stopped with 0 on SIGINT. Prints one table row per
program and replica count, and the exact commands."""
import argparse
import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from benchproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_file(work):
    """25 MB of base64 text: compressible, and big enough for several worker blocks."""
    path = os.path.join(work, "data.txt")
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(subprocess.run(["base64"], input=os.urandom(18_000_000), capture_output=True, check=True).stdout)
    return path


PY_POOL = r"""
import concurrent.futures, hashlib, threading
lock = threading.Lock()
done = []
def work(i):
    h = hashlib.sha256(str(i).encode()).hexdigest()
    for _ in range(200):
        h = hashlib.sha256(h.encode()).hexdigest()
    with lock:
        done.append(i)
        print(f"job {i} done {h[:12]}", flush=True)
    return h
with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
    results = list(ex.map(work, range(40)))
print("total", hashlib.sha256("".join(results).encode()).hexdigest()[:16])
"""


def programs(work):
    data = data_file(work)
    py = os.path.join(work, "pool.py")
    with open(py, "w") as f:
        f.write(PY_POOL)
    python = os.path.realpath(shutil.which("python3") or "/usr/bin/python3")
    if "pyenv/shims" in python or not os.access(python, os.X_OK):
        python = "/usr/bin/python3"
    # (name, argv, whether the output's lines are compared as a set)
    return [
        ("zstd (default)", ["zstd", "-q", "-c", data], False),
        ("xz -T2", ["xz", "-T2", "-c", data], False),
        ("pigz -p2", ["pigz", "-p2", "-c", data], False),
        ("sort --parallel=2", ["sort", "--parallel=2", "-S", "8M", data], False),
        ("python ThreadPoolExecutor", [python, py], True),
    ]


def git_template(work):
    """A repository with 40 commits of a growing source-like file: gc has deltas to find."""
    repo = os.path.join(work, "repo")
    if os.path.exists(repo):
        return repo
    git = ["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", repo], check=True)
    lines = [f"line {i} {hashlib.sha256(str(i).encode()).hexdigest()}\n" for i in range(4000)]
    for c in range(40):
        for i in range(c, len(lines), 40):
            lines[i] = lines[i].rstrip("\n") + f" edit {c}\n"
        with open(os.path.join(repo, f"f{c % 4}.txt"), "w") as f:
            f.writelines(lines)
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-q", "-m", f"c{c}"], check=True)
    return repo


def git_objects(repo):
    out = subprocess.run(["git", "-C", repo, "rev-list", "--all", "--objects"], capture_output=True, check=True)
    return digest(out.stdout, as_set=True)


def git_gc_run(lockstep, r, template, work, timeout):
    """(good, diverged, other): one `git gc` with two pack threads on a fresh copy."""
    repo = os.path.join(work, "gc")
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(template, repo, symlinks=True)
    want = git_objects(repo)
    argv = ["git", "-C", repo, "-c", "pack.threads=2", "gc", "--quiet", "--aggressive"]
    cmd = argv if lockstep is None else [lockstep, *LOCKSTEP_RUN, "-r", r, "--"] + argv
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=timeout, env=LOCKSTEP_ENV if lockstep else None)
    except subprocess.TimeoutExpired:
        return False, False, "timeout"
    div = note_divergence("git gc", r, p.stderr)
    fsck = subprocess.run(["git", "-C", repo, "fsck", "--strict", "--no-progress"], capture_output=True)
    same = fsck.returncode == 0 and git_objects(repo) == want
    if p.returncode == 0 and same and not div:
        return True, False, None
    return False, div, None if div else f"exit {p.returncode}" + ("" if same else ", repository differs")


def memcached_run(lockstep, r, timeout):
    """(good, diverged, other): memcached with its default threads under memcaslap -t 3s."""
    port = free_port()
    argv = ["memcached", "-u", "root", "-l", "127.0.0.1", "-p", str(port), "-U", "0"]
    cmd = argv if lockstep is None else [lockstep, *LOCKSTEP_RUN, "-r", r, "--"] + argv
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=LOCKSTEP_ENV if lockstep else None)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    load = subprocess.run(
        ["memcaslap", "-s", f"127.0.0.1:{port}", "-T", "1", "-c", "8", "-t", "3s", "--verify=0.1"],
        capture_output=True, text=True, timeout=timeout)
    server.send_signal(2)
    try:
        _, err = server.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        return False, False, "timeout"
    div = note_divergence("memcached", r, err)
    # memcaslap's summary: "Get: N ... Miss: M ..." lines, and "data verification failed" counts.
    failed = re.search(r"(verify_failed|verification failed|Failed to verify)[^0-9]*([0-9]+)", load.stdout, re.I)
    ops = re.search(r"Ops:\s+(\d+)", load.stdout)
    fine = load.returncode == 0 and ops is not None and int(ops.group(1)) > 0 and (failed is None or failed.group(2) == "0")
    if server.returncode == 0 and fine and not div:
        return True, False, None
    return False, div, None if div else f"exit {server.returncode}" + ("" if fine else ", memcaslap failed")


DIVERGENCES = []  # (program, replicas, lockstep's first divergence line), printed at the end
LOCKSTEP_RUN = ["run"]  # lockstep's subcommand and the options every run gets (main adds them)
LOCKSTEP_ENV = None  # the environment of lockstep's runs (--leader-dies sets the shim's test hook)
FAILOVERS = {}  # program -> runs in which a follower took the dead leader's place in the ring
INJECTED_DEATH = "replica 0 died (killed by signal 9)"


def note_divergence(name, r, stderr):
    """Whether lockstep reported a divergence (other than the death --leader-dies
    injected); keeps its first line for the summary, and counts leader failovers."""
    text = stderr.decode(errors="replace")
    if "in the fast path's ring too" in text:
        FAILOVERS[name] = FAILOVERS.get(name, 0) + 1
    for line in text.splitlines():
        if "[divergence]" in line and not (LOCKSTEP_ENV and INJECTED_DEATH in line):
            DIVERGENCES.append((name, r, line[:400]))
            return True
    return False


def digest(b, as_set=False):
    if as_set:
        b = b"\n".join(sorted(b.split(b"\n")))
    return hashlib.sha256(b).hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", default=None, help="run only programs whose name contains this")
    ap.add_argument("--lockstep", default=os.path.join(ROOT, "target", "release", "lockstep"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--sync-order", default="global", choices=["global", "object", "serial"],
                    help="lockstep run's --sync-order")
    ap.add_argument("--leader-dies", type=int, default=None, metavar="N",
                    help="under -r 3 only, the leader's process kills itself at the N-th record of a "
                         "thread the program started (the shim's test hook die:N); a good run also "
                         "needs its output to be the native one")
    args = ap.parse_args()
    global LOCKSTEP_ENV
    LOCKSTEP_RUN.append(f"--sync-order={args.sync_order}")
    replica_counts = ("2", "3")
    if args.leader_dies is not None:
        LOCKSTEP_ENV = dict(os.environ, LOCKSTEP_FAST_TEST=f"die:{args.leader_dies}")
        replica_counts = ("3",)
    work = tempfile.mkdtemp(prefix="lockstep-order-")
    try:
        print("| program | replicas | good runs | divergences | other endings |")
        print("|---|---:|---:|---:|---|")
        for name, run_once in (("git gc (pack.threads=2)", "git"), ("memcached (default threads)", "memcached")):
            if args.only and args.only not in name:
                continue
            if shutil.which(run_once) is None or (run_once == "memcached" and shutil.which("memcaslap") is None):
                print(f"| {name} | - | not installed | | |")
                continue
            template = git_template(work) if run_once == "git" else None
            for r in replica_counts:
                good, diverged, other = 0, 0, []
                for _ in range(args.runs):
                    if run_once == "git":
                        ok, div, why = git_gc_run(args.lockstep, r, template, work, args.timeout)
                    else:
                        ok, div, why = memcached_run(args.lockstep, r, args.timeout)
                    good += ok
                    diverged += div
                    if why:
                        other.append(why)
                print(f"| {name} | {r} | {good} of {args.runs} | {diverged} | {', '.join(other) or '-'} |", flush=True)
        for name, argv, as_set in programs(work):
            if args.only and args.only not in name:
                continue
            if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
                print(f"| {name} | - | not installed | | |")
                continue
            native = subprocess.run(argv, capture_output=True, timeout=args.timeout)
            want = digest(native.stdout, as_set)
            for r in replica_counts:
                good, diverged, other = 0, 0, []
                for _ in range(args.runs):
                    cmd = [args.lockstep, *LOCKSTEP_RUN, "-r", r, "--"] + argv
                    try:
                        p = subprocess.run(cmd, capture_output=True, timeout=args.timeout, env=LOCKSTEP_ENV)
                    except subprocess.TimeoutExpired:
                        other.append("timeout")
                        continue
                    div = note_divergence(name, r, p.stderr)
                    diverged += div
                    same = digest(p.stdout, as_set) == want
                    if p.returncode == 0 and same and not div:
                        good += 1
                    elif not div:
                        other.append(f"exit {p.returncode}" + ("" if same else ", other output"))
                print(f"| {name} | {r} | {good} of {args.runs} | {diverged} | {', '.join(other) or '-'} |", flush=True)
        if args.leader_dies is not None:
            print()
            print(f"Runs in which a follower took the dead leader's place in the ring (die:{args.leader_dies}):")
            for name, n in FAILOVERS.items():
                print(f"  {name}: {n} of {args.runs}")
        if DIVERGENCES:
            print()
            print("Divergences (first line of each):")
            for name, r, line in DIVERGENCES:
                print(f"  {name} -r {r}: {line}")
        print()
        print(f"Commands (DATA: 18 MB of random bytes in base64; every run with --sync-order={args.sync_order}):")
        for name, argv, _ in programs(work):
            print(f"  {name}: lockstep run -r 2|3 -- {' '.join(argv)}")
        print("  git gc: lockstep run -r 2|3 -- git -C COPY -c pack.threads=2 gc --quiet --aggressive")
        print("  memcached: lockstep run -r 2|3 -- memcached -u root -l 127.0.0.1 -p PORT -U 0;"
              " memcaslap -s 127.0.0.1:PORT -T 1 -c 8 -t 3s --verify=0.1; SIGINT")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
