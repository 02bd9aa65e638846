#!/usr/bin/env bash
# `make demo`: the ledger workload under TMR, with one bit flipped in the leader.
# Shows, in order: detection, vote, re-integration, then the output (equal to native).
set -euo pipefail
cd "$(dirname "$0")/.."
LOCKSTEP=target/release/lockstep
WORKLOAD=build/demo-ledger
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Intercepted syscalls of the static workload: execve, rseq (refused, so that glibc does
# not use it), prlimit64, readlink, getrandom, then one write per batch. Stop 10 is the
# write of batch 5; byte 17 is a digit of acct0.
FLIP="0:10:mem:rsi+17:0"

bold() { printf '\033[1m%s\033[0m\n' "$*"; }

bold "== lockstep demo: a toy bank ledger, 3 replicas (TMR)"
echo "   native run first, as the reference"
"$WORKLOAD" > "$work/native.out"
echo
bold "== lockstep run -r 3 -- $WORKLOAD   (test flip: bit 0 of a digit in the leader's 5th output)"
set +e
"$LOCKSTEP" run -r 3 --events "$work/events.jsonl" --test-flip "$FLIP" -- "$WORKLOAD" > "$work/replicated.out"
status=$?
set -e
echo
bold "== program output under lockstep"
cat "$work/replicated.out"
echo
bold "== summary"
kinds() { python3 -c 'import json,sys; print(" -> ".join(json.loads(l)["kind"] for l in open(sys.argv[1])))' "$1"; }
echo "   events:        $(kinds "$work/events.jsonl")"
echo "   exit status:   $status"
if cmp -s "$work/native.out" "$work/replicated.out"; then
    echo "   output:        identical to the native run ($(wc -l < "$work/native.out") lines)"
else
    echo "   output:        DIFFERS from the native run" >&2
    diff "$work/native.out" "$work/replicated.out" >&2 || true
    exit 1
fi
for k in divergence vote reintegrate; do
    grep -q "\"kind\":\"$k\"" "$work/events.jsonl" || { echo "   missing event: $k" >&2; exit 1; }
done
[ "$status" -eq 0 ] || { echo "   lockstep exited $status" >&2; exit 1; }
echo "   the corrupted line never left: the faulty leader was voted out, replica 1 took over,"
echo "   and a fresh replica was forked to restore TMR."
