#!/usr/bin/env python3
"""order_programs.py - issue 17's multi-threaded programs under `lockstep run`: how many
runs end as natively (same output, exit 0) with no divergence, under -r 2 and -r 3.

    python3 bench/order_programs.py [--runs N] [--only NAME] [--lockstep BIN]

Each program's native output is taken once; a run counts as good when its exit status is
0, its output equals the native one and lockstep reported no divergence. The Python job's
threads print in the order they finish, which differs natively from run to run: its lines
are compared as a set. Prints one table row per program and
replica count, and the exact commands."""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

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
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="lockstep-order-")
    try:
        print("| program | replicas | good runs | divergences | other endings |")
        print("|---|---:|---:|---:|---|")
        for name, argv, as_set in programs(work):
            if args.only and args.only not in name:
                continue
            if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
                print(f"| {name} | - | not installed | | |")
                continue
            native = subprocess.run(argv, capture_output=True, timeout=args.timeout)
            want = digest(native.stdout, as_set)
            for r in ("2", "3"):
                good, diverged, other = 0, 0, []
                for _ in range(args.runs):
                    cmd = [args.lockstep, "run", "-r", r, "--"] + argv
                    try:
                        p = subprocess.run(cmd, capture_output=True, timeout=args.timeout)
                    except subprocess.TimeoutExpired:
                        other.append("timeout")
                        continue
                    div = b"[divergence]" in p.stderr
                    diverged += div
                    same = digest(p.stdout, as_set) == want
                    if p.returncode == 0 and same and not div:
                        good += 1
                    elif not div:
                        other.append(f"exit {p.returncode}" + ("" if same else ", other output"))
                print(f"| {name} | {r} | {good} of {args.runs} | {diverged} | {', '.join(other) or '-'} |", flush=True)
        print()
        print("Commands (DATA: 18 MB of random bytes in base64):")
        for name, argv, _ in programs(work):
            print(f"  {name}: lockstep run -r 2|3 -- {' '.join(argv)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
