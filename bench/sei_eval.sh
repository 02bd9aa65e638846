#!/usr/bin/env bash
# Fault-injection evaluation of libsei (issue 4), in the manner of SEI's Table 2: the
# example key-value server (sei/examples/kv_single.c) unhardened ("native", built with
# -DSEI_NATIVE), hardened in ECC mode and hardened in dup mode, under reg, dest, mem and
# ip faults. The workload is a fixed trace of requests replayed by kv_client.py with
# CRCs on requests and replies; what is compared is the client's output. A reply whose
# CRC does not match makes the client exit 86 (detected at the receiver), as does a
# libsei abort of the server.
# Usage: [FAULTS="reg dest mem ip"] bench/sei_eval.sh [RUNS] [CONFIGS...]   (default: 1000 native ecc dup)
# Cells go to OUT/kv-<fault>-<config>/ (OUT=target/sei-eval); finished cells are
# skipped and a larger RUNS extends them, as in bench/inject_eval.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/sei_campaign.sh sei-eval "$@"
EX=sei/examples
export LOCKSTEP_SEI_DIR=$OUT/sei
"$L" cc -O2 -Wall -Wextra -Werror $EX/kv_single.c $EX/kv_net.c $EX/kv_store.c $EX/wire.c -o "$OUT/kv_sei"
gcc -O2 -Wall -Wextra -Werror -DSEI_NATIVE -Isei/include $EX/kv_single.c $EX/kv_net.c $EX/kv_store.c $EX/wire.c \
    -pthread -o "$OUT/kv_native"
python3 $EX/kv_client.py gen-trace 200 11 > "$OUT/trace.txt"
sei_cells kv "${FAULTS:-reg dest mem ip}" 24000 "$OUT/kv_native" "$OUT/kv_sei" \
    "python3 $PWD/$EX/kv_client.py --port {port} --crc trace $OUT/trace.txt" --crc
python3 bench/inject_eval_table.py "$OUT"
