#!/usr/bin/env bash
# Fault-injection evaluation (issue 3): native vs lockstep run -r 2 vs -r 3, for the reg,
# mem, ip and dest fault models, on two workloads:
#   (a) digest: a CPU-bound program that prints a digest (bench/digest.c);
#   (b) redis:  redis-server in server mode with a fixed redis-cli workload
#               (bench/redis_workload.sh), compared on the client's output.
# Each cell is one campaign of RUNS injections (seed 11, 2 workers) into OUT/<cell>/;
# finished cells are skipped, so an interrupted evaluation resumes. Prints the Markdown
# table at the end (bench/inject_eval_table.py OUT renders it at any time).
# Usage: bench/inject_eval.sh [RUNS] [WORKLOADS...]   (default: 1000 digest redis)
# CONFIGS="r2 r3" restricts the configurations; a larger RUNS extends finished cells (the
# campaigns resume), e.g. CONFIGS="r2 r3" bench/inject_eval.sh 3000 digest; FAULTS="reg ip"
# restricts the fault models likewise.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-1000}
shift || true
WORKLOADS=("$@")
[ $# -eq 0 ] && WORKLOADS=(digest redis)
OUT=${OUT:-$PWD/target/inject-eval}
. bench/private_lockstep.sh
gcc -O2 -Wall -Wextra -Werror -o "$OUT/digest" bench/digest.c
# Below the kernel's ephemeral range (32768-60999 by default), which any outgoing
# connection may take.
port=21000
for workload in "${WORKLOADS[@]}"; do
    for fault in ${FAULTS:-reg mem ip dest}; do
        for cfg in ${CONFIGS:-native r2 r3}; do
            cell="$OUT/$workload-$fault-$cfg"
            if [ -f "$cell/summary.json" ] && [ "$(wc -l < "$cell/results.jsonl")" -ge "$RUNS" ]; then
                continue
            fi
            # Under lockstep run a replica that stops making progress is caught by the
            # straggler timeout (1 s here); the campaign's hang timeout must be longer.
            case $cfg in
                native) wrap=(); args=();;
                r2) wrap=("$L" run -r 2 -q --timeout 1 --); args=(--replica any --timeout 5);;
                r3) wrap=("$L" run -r 3 -q --timeout 1 --); args=(--replica any --timeout 5);;
            esac
            case $workload in
                digest) target=("${wrap[@]}" "$OUT/digest" 40); mode=();;
                redis)
                    target=("${wrap[@]}" redis-server --port '{port}' --save '' --appendonly no
                        --bind 127.0.0.1 --dir '{dir}')
                    mode=(--server --port "$port" --client "sh $PWD/bench/redis_workload.sh {port}")
                    port=$((port + 10));;
            esac
            echo "== $workload $fault $cfg: $(date +%T)" >&2
            "$L" inject --fault "$fault" --runs "$RUNS" --seed 11 -j 2 --out "$cell" \
                "${mode[@]}" "${args[@]}" -- "${target[@]}" > "$cell.log" 2>&1 || {
                echo "campaign $cell failed; see $cell.log" >&2
                exit 1
            }
            cp "$OUT/commit" "$cell/commit"  # provenance of each cell
        done
    done
done
python3 bench/inject_eval_table.py "$OUT"
