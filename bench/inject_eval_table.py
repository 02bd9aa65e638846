"""Renders the fault-injection evaluation table from the campaigns bench/inject_eval.sh
left in OUT (one directory per workload-fault-configuration cell with a summary.json).
Usage: python3 bench/inject_eval_table.py OUT"""
import json
import os
import sys

out = sys.argv[1]
names = {"native": "native", "r2": "run -r 2", "r3": "run -r 3", "ecc": "sei ecc", "dup": "sei dup"}
classes = ["masked", "detected", "crash", "hang", "program-error", "sdc"]
print("| workload | config | fault | runs | activated | " + " | ".join(classes)
      + " | sdc % of activated (95% Wilson) | rate vs native | commit |")
print("|---|---|---|---:|---:|" + "---:|" * len(classes) + "---|---:|---|")
# cells are directories named WORKLOAD-FAULT-CONFIG
cells = {tuple(d.split("-")) for d in os.listdir(out) if d.count("-") == 2
         and os.path.exists(os.path.join(out, d, "summary.json"))}
order = lambda known, seen: [k for k in known if k in seen] + sorted(seen - set(known))
for workload in order(["digest", "redis", "kv"], {c[0] for c in cells}):
    for fault in order(["reg", "mem", "ip", "dest"], {c[1] for c in cells}):
        for cfg in order(["native", "r2", "r3", "ecc", "dup"], {c[2] for c in cells}):
            path = os.path.join(out, f"{workload}-{fault}-{cfg}", "summary.json")
            if not os.path.exists(path):
                continue
            s = json.load(open(path))
            c = {row["class"]: row for row in s["classes"]}
            sdc = c["sdc"]
            if sdc["count"] == 0 and s.get("sdc_upper_bound") is not None:
                rate = f"0 (< {s['sdc_upper_bound']:.2f}% one-sided)"
            elif sdc.get("percent") is None:
                rate = "n/a"
            else:
                rate = f"{sdc['percent']:.2f} [{sdc['interval_low']:.2f}, {sdc['interval_high']:.2f}]"
            t = s.get("throughput") or {}
            commit_file = os.path.join(out, f"{workload}-{fault}-{cfg}", "commit")
            commit = open(commit_file).read().strip() if os.path.exists(commit_file) else "?"
            ratio = f"{t['ratio']:.2f}x" if t.get("ratio") else "—"
            print(f"| {workload} | {names.get(cfg, cfg)} | {fault} | {s['runs']} | {s['activated']} | "
                  + " | ".join(str(c[k]["count"]) for k in classes) + f" | {rate} | {ratio} | {commit} |")
