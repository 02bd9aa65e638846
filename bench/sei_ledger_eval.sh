#!/usr/bin/env bash
# Fault-injection evaluation of libsei on the handler-dominated service (issue 18): the
# ledger server (bench/sei_ledger_server.c, the handler of bench/sei_ledger.c behind a
# TCP socket) unhardened ("native", -DSEI_NATIVE), hardened in ECC mode and hardened in
# dup mode, under reg, dest and mem faults, as bench/sei_eval.sh does for the key-value
# server. The workload is a fixed set of batches (1000 of 32 transfers, seed 1, 8 per
# pipeline) and a final state checksum, sent by bench/sei_ledger_client.py with CRCs on
# requests and replies; what is compared is the client's output. A reply whose CRC does
# not cover request and reply makes the client exit 86 (detected at the receiver), as
# does a libsei abort of the server.
# 1000 batches, so that serving them, not exec and start-up, takes most of the server's
# CPU time, over which the injection points are uniform (measured: native 8.0 ms of
# which 1.7 ms start-up, dup 15.5 ms of which 2.1 ms; with 200 batches native served for
# only 0.5 ms of 2.2 ms).
# Usage: [FAULTS="reg dest mem"] bench/sei_ledger_eval.sh [RUNS] [CONFIGS...]   (default: 1000 native ecc dup)
# Cells go to OUT/ledger-<fault>-<config>/ (OUT=target/sei-ledger-eval); finished cells
# are skipped and a larger RUNS extends them, as in bench/inject_eval.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/sei_campaign.sh sei-ledger-eval "$@"
export LOCKSTEP_SEI_DIR=$OUT/sei
"$L" cc -O2 -Wall -Wextra -Werror bench/sei_ledger_server.c sei/examples/wire.c -o "$OUT/ledger_sei"
gcc -O2 -Wall -Wextra -Werror -DSEI_NATIVE -Isei/include bench/sei_ledger_server.c sei/examples/wire.c -o "$OUT/ledger_native"
sei_cells ledger "${FAULTS:-reg dest mem}" 25000 "$OUT/ledger_native" "$OUT/ledger_sei" \
    "python3 $PWD/bench/sei_ledger_client.py --port {port} --batches 1000 --seed 1 --pipeline 8"
python3 bench/inject_eval_table.py "$OUT"
