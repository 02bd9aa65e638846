"""Helpers shared by the bench scripts (fast_bench.py, nginx_bench.py, memcached_bench.py and
others): the repository root and lockstep binary, the start and end of a measuring bench
(its command line and the identity of the run), the list of anomalies a run collects (and
its markdown section), the process groups a script starts (each child in a session of its
own) and their clean-up, running a command with a timeout, building a C helper, lockstep
--stats parsing, and small formatting and lookup helpers.

The anomaly list (ANOMALIES) and the sets of process groups (LIVE_PGIDS, ALL_PGIDS) live
here, once per process: the scripts read them as benchproc.ANOMALIES etc. Standard library
only; the scripts import it as `benchproc` (a script's own directory is on sys.path when it
is run as `python3 bench/SCRIPT.py`, from any directory).
"""
import argparse
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "lockstep")

# Failures seen during a run: dicts with "where", "what" and, when known, "command" and
# "stderr_tail". They do not stop the bench; the scripts list them in their summary.
ANOMALIES = []
# Process groups started by this script (each child runs in its own session).
LIVE_PGIDS = set()
ALL_PGIDS = set()


def anomaly(where, what, cmd=None, stderr=None):
    entry = {"where": where, "what": what}
    if cmd is not None:
        entry["command"] = " ".join(shlex.quote(c) for c in cmd)
    if stderr:
        entry["stderr_tail"] = tail(stderr)
    ANOMALIES.append(entry)
    print(f"ANOMALY [{where}]: {what}", file=sys.stderr)
    if cmd is not None:
        print(f"  command: {entry['command']}", file=sys.stderr)
    if stderr:
        print("  stderr tail:\n    " + entry["stderr_tail"].replace("\n", "\n    "), file=sys.stderr)


def tail(text, lines=15):
    """The last lines of a stderr, lockstep's --stats block condensed to its key counters so
    that the event lines before it ([timeout], [halt], divergence, ...) stay visible."""
    events, stats, in_stats = [], [], False
    for ln in text.rstrip().splitlines():
        if ln.startswith("lockstep run: stats"):
            in_stats = True
            continue
        if in_stats and ln.startswith(" "):
            if re.search(r"syscalls intercepted|fast-path calls|divergences|re-integrations", ln):
                stats.append(re.sub(r"\s+", " ", ln.strip()))
            continue
        in_stats = False
        events.append(ln)
    out = events[-lines:]
    if stats:
        out.append("[--stats] " + "; ".join(stats))
    return "\n".join(out)


def anomalies_markdown():
    """The summary's anomaly section: lines (without newlines) listing ANOMALIES."""
    lines = []
    if ANOMALIES:
        lines += [f"## Anomalies ({len(ANOMALIES)})", ""]
        for an in ANOMALIES:
            lines.append(f"- **{an['where']}**: {an['what']}")
            if "command" in an:
                lines.append(f"  - command: `{an['command']}`")
            if an.get("stderr_tail"):
                lines.append("  - stderr tail:")
                lines.append("")
                lines.append("    ```")
                lines += ["    " + ln for ln in an["stderr_tail"].splitlines()]
                lines.append("    ```")
    else:
        lines.append("Anomalies: none.")
    return lines


# ---------------------------------------------------------------- process groups

def killpg(pgid, sig=signal.SIGKILL):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def cleanup_all():
    for pgid in list(LIVE_PGIDS):
        killpg(pgid)
        LIVE_PGIDS.discard(pgid)


def install_signal_cleanup():
    """On SIGTERM or SIGINT: kill the process groups still live, exit with 128 + signal."""
    def on_signal(signum, _frame):
        cleanup_all()
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def kill_leftovers():
    """Anything of ours still alive (after cleanup_all)? Each such process group is an
    anomaly and is SIGKILLed."""
    time.sleep(0.2)
    left = sorted(pg for pg in ALL_PGIDS if group_alive(pg))
    for pg in left:
        anomaly("cleanup", f"process group {pg} still alive at the end; SIGKILLed")
        killpg(pg)


def spawn(cmd, stdout, stderr, cwd=None):
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                         cwd=cwd, start_new_session=True)
    LIVE_PGIDS.add(p.pid)
    ALL_PGIDS.add(p.pid)
    return p


def reap(p):
    """Kill whatever is left of p's process group (a no-op once it has all exited)."""
    killpg(p.pid)
    LIVE_PGIDS.discard(p.pid)


def run(cmd, timeout, where):
    """Run cmd in its own process group; returns (rc, stdout, stderr, seconds) or None on
    timeout (then the group is killed and an anomaly recorded)."""
    t0 = time.monotonic()
    p = spawn(cmd, subprocess.PIPE, subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        killpg(p.pid)
        out, err = p.communicate()
        reap(p)
        anomaly(where, f"timed out after {timeout} s", cmd, err.decode(errors="replace"))
        return None
    reap(p)
    return p.returncode, out.decode(errors="replace"), err.decode(errors="replace"), \
        time.monotonic() - t0


# ---------------------------------------------------------------- small helpers

def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def sh(cmd, or_stderr=False):
    """cmd's stripped stdout (run in ROOT, at most 30 s), "?" if it cannot be run. With
    or_stderr, its stripped stderr when stdout is empty (e.g. `nginx -v`)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30)
        if or_stderr:
            return (p.stdout.strip() or p.stderr.strip())
        return p.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def read_file(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def write_results(out_dir, name, data):
    """Writes `data` and the anomalies so far as OUT_DIR/NAME (indented JSON); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump({**data, "anomalies": ANOMALIES}, f, indent=1)
        f.write("\n")
    return path


def port_accepts(port):
    """Whether a TCP connection to 127.0.0.1:port succeeds within a second."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bin_id():
    try:
        st = os.stat(BIN)
        return f"{st.st_size} bytes, mtime {time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(st.st_mtime))}Z"
    except OSError:
        return "missing"


def check_bin_unchanged(bin_start):
    """An anomaly if BIN is not the binary bin_id() described as bin_start."""
    bin_end = bin_id()
    if bin_end != bin_start:
        anomaly("binary", f"{BIN} changed during the run ({bin_start} -> {bin_end}); "
                "the runs may mix two builds")


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def pct(x, digits=1):
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


FAST_RE = re.compile(r"fast-path calls:\s+(\d+)")
INTERCEPTED_RE = re.compile(r"syscalls intercepted:\s+(\d+)")


def parse_stats(stderr):
    """The counts of `lockstep run --stats` on stderr: fast-path calls, intercepted calls and
    the fast fraction, or None if the run printed no statistics."""
    f = FAST_RE.search(stderr)
    i = INTERCEPTED_RE.search(stderr)
    if not f or not i:
        return None
    fast, intercepted = int(f.group(1)), int(i.group(1))
    total = fast + intercepted
    return {"fast_path_calls": fast, "intercepted": intercepted,
            "fast_fraction": fast / total if total else None}


def bench_start(doc, counts, quick, more_options=None):
    """The start of a measuring bench. Parses its command line: the positive counts
    [(option, default, help[, maximum])] (--rounds among them), --out DIR (default
    bench/out), --quick (the values in `quick`, by attribute name) and whatever
    `more_options(parser)` adds; checks that the
    release binary is there and installs the signal clean-up. Returns (args, meta): meta
    is what the results record about the run (commit, dirty tree, kernel, nproc, the
    binary's identity), to which bench_end adds the wall time. Says on stderr what runs."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for option, default, help_, *_ in counts:
        ap.add_argument(option, type=int, default=default, help=f"{help_} (default {default})")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out"), help="results folder (default bench/out)")
    ap.add_argument("--quick", action="store_true",
                    help=" ".join(f"--{name.replace('_', '-')} {value}" for name, value in quick.items()))
    if more_options is not None:
        more_options(ap)
    args = ap.parse_args()
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value)
    for option, _, _, *maximum in counts:
        value = getattr(args, option[2:].replace("-", "_"))
        if value < 1 or (maximum and value > maximum[0]):
            ap.error(f"{option} must be in 1..{maximum[0]}, not {value}" if maximum
                     else f"{option} must be positive, not {value}")
    if not os.access(BIN, os.X_OK):
        sys.exit(f"{BIN} not found: run `cargo build --release --locked -p lockstep-cli` first")
    install_signal_cleanup()
    meta = {"commit": sh(["git", "rev-parse", "--short", "HEAD"]),
            "dirty": bool(sh(["git", "status", "--porcelain", "--untracked-files=no"])),
            "uname_r": platform.release(), "nproc": sh(["nproc"]),
            "lockstep": BIN, "lockstep_binary": bin_id(), "started": time.monotonic()}
    print(f"{os.path.basename(sys.argv[0])}: commit {meta['commit']}{' (dirty)' if meta['dirty'] else ''}, "
          f"kernel {meta['uname_r']}, nproc {meta['nproc']}, rounds {args.rounds}", file=sys.stderr, flush=True)
    return args, meta


def bench_end(meta):
    """After the last measurement: kills what is left of the bench's processes, checks that
    the binary did not change under it, and records the date and the wall time."""
    kill_leftovers()
    check_bin_unchanged(meta["lockstep_binary"])
    meta["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["wall_seconds"] = time.monotonic() - meta.pop("started")


def build_c(source, out, *flags):
    """gcc -O2 -Wall -Wextra -Werror source -o out; ends the bench with gcc's messages if
    the build fails."""
    cc = subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", *flags, "-o", out, source],
                        capture_output=True, text=True)
    if cc.returncode != 0:
        sys.exit(f"gcc {source} failed:\n" + cc.stderr)
    return out
