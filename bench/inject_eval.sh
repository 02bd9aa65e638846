#!/usr/bin/env bash
# Fault-injection evaluation, workload (a): md5sum of a 256 KiB file, natively and under
# lockstep run -r 2 / -r 3, for the reg, mem and ip fault models. Prints a Markdown table
# built from each campaign's summary.json. Usage: bench/inject_eval.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-1000}
L=$PWD/target/release/lockstep
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
head -c 262144 /dev/urandom > "$work/input.bin"
echo "| workload | configuration | fault | runs | activated | masked | detected | crash | hang | program-error | sdc | sdc rate (95% interval) |"
echo "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
for fault in reg mem ip; do
    for cfg in native r2 r3; do
        out="$work/$fault-$cfg"
        case $cfg in
            native) args=(); target=(md5sum "$work/input.bin");;
            r2) args=(--replica any); target=("$L" run -r 2 -q -- md5sum "$work/input.bin");;
            r3) args=(--replica any); target=("$L" run -r 3 -q -- md5sum "$work/input.bin");;
        esac
        "$L" inject --fault "$fault" --runs "$RUNS" --seed 11 --out "$out" "${args[@]}" -- "${target[@]}" >/dev/null 2>&1
        python3 - "$out/summary.json" "$fault" "$cfg" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
c = {row["class"]: row for row in s["classes"]}
sdc = c["sdc"]
if sdc["count"] == 0 and s.get("sdc_upper_bound") is not None:
    rate = f"0 (< {s['sdc_upper_bound']:.2f}%)"
elif sdc["percent"] is None:
    rate = "n/a"
else:
    rate = f"{sdc['percent']:.2f}% [{sdc['interval_low']:.2f}, {sdc['interval_high']:.2f}]"
name = {"native": "native", "r2": "lockstep run -r 2", "r3": "lockstep run -r 3"}[sys.argv[3]]
print(f"| md5sum 256 KiB | {name} | {sys.argv[2]} | {s['runs']} | {s['activated']} | " + " | ".join(str(c[k]["count"]) for k in ["masked", "detected", "crash", "hang", "program-error", "sdc"]) + f" | {rate} |")
PY
    done
done
