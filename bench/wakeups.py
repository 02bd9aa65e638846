#!/usr/bin/env python3
"""Who wakes whom, and across which CPUs: the hand-off graph of whatever runs on the
machine for SECONDS, from the scheduler's own tracepoints (`perf record -e
sched:sched_wakeup -e sched:sched_switch -a`).

Prints wake-ups per second by (waker, wakee, how), where `how` is `same CPU` (the waker
ran on the CPU the wakee will run on), `other CPU` (the waker sent it from another CPU)
or `from idle` (the wake-up was queued to the wakee's idle CPU by another CPU, which then
did it in its idle loop: the kernel names the idle task as the waker, and the CPU had
halted, which on a VM costs an exit to the hypervisor to wake it), and how often each
CPU went idle. Names are thread names (`comm`), so give the threads of interest
recognisable ones. A diagnostic: nothing is asserted.

Use it around a load that is already running, e.g. for lockstep run (docs/results.md §47):
    memcaslap -s 127.0.0.1:P -T 1 -c 8 -t 8s & sleep 2; python3 bench/wakeups.py 2 --ops 34460
--ops N divides by N operations per second instead of printing per second.
Needs perf and root (scripts/deps.sh bench installs perf)."""
import argparse
import collections
import re
import subprocess
import sys
import tempfile

WAKEUP = re.compile(r"\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+sched:sched_wakeup: comm=(.+?) pid=\d+ .*target_cpu=(\d+)")
SWITCH = re.compile(r"\s*(.+?)\s+\d+\s+\[(\d+)\]\s+sched:sched_switch: prev_comm=.+? prev_pid=\d+ "
                    r".*prev_state=\S+ ==> next_comm=(.+?) next_pid=(\d+)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seconds", type=float, help="how long to record (e.g. 2)")
    ap.add_argument("--ops", type=float, help="operations per second of the load: print per operation")
    ap.add_argument("--top", type=int, default=15, help="rows to print (default 15)")
    a = ap.parse_args()
    if not 0 < a.seconds <= 60:
        ap.error("SECONDS must be within (0, 60]")
    if a.ops is not None and a.ops <= 0:
        ap.error("--ops must be positive")
    with tempfile.NamedTemporaryFile(suffix=".perf") as data:
        rec = subprocess.run(["perf", "record", "-q", "-e", "sched:sched_wakeup", "-e", "sched:sched_switch",
                              "-a", "-o", data.name, "--", "sleep", str(a.seconds)],
                             capture_output=True, text=True)
        if rec.returncode != 0:
            sys.exit(f"wakeups.py: perf record failed: {rec.stderr.strip()[-300:]}")
        script = subprocess.run(["perf", "script", "-i", data.name, "-F", "comm,tid,cpu,event,trace"],
                                capture_output=True, text=True)
    wakes, idle = collections.Counter(), collections.Counter()
    for line in script.stdout.splitlines():
        m = WAKEUP.match(line)
        if m:
            waker, _, cpu, wakee, target = m.groups()
            how = ("from idle" if waker.startswith("swapper") else
                   "same CPU" if cpu == target else "other CPU")
            wakes[(waker.strip(), wakee, how)] += 1
            continue
        m = SWITCH.match(line)
        if m and m.group(4) == "0":
            idle[f"CPU {int(m.group(2))}"] += 1
    per = a.ops * a.seconds if a.ops else a.seconds
    unit = "per operation" if a.ops else "per second"
    print(f"wake-ups {unit} over {a.seconds:g} s (waker -> wakee, how):")
    for (waker, wakee, how), n in wakes.most_common(a.top):
        print(f"  {n / per:10.3f}  {waker} -> {wakee} ({how})")
    print(f"total {sum(wakes.values()) / per:.3f}; from idle {sum(n for k, n in wakes.items() if k[2] == 'from idle') / per:.3f}")
    print(f"CPUs going idle {unit}: " + ", ".join(f"{c} {n / per:.3f}" for c, n in sorted(idle.items())))


if __name__ == "__main__":
    main()
