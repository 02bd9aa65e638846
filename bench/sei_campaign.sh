# The campaign loop of libsei's fault-injection evaluations, sourced by bench/sei_eval.sh
# (the key-value example) and bench/sei_ledger_eval.sh (the ledger): one `lockstep inject`
# campaign per fault model and build, each in its own cell OUT/NAME-FAULT-CONFIG; a cell
# that already has RUNS results is skipped, a smaller one is extended.
# Source it from the repository's root as `. bench/sei_campaign.sh DIR "$@"`, where the
# script's arguments are [RUNS] [CONFIGS...] (default 1000, native ecc dup): it sets RUNS,
# CONFIGS and OUT (default target/DIR), and makes the private lockstep copy L
# (bench/private_lockstep.sh).
sei_out_dir=$1
shift
RUNS=${1:-1000}
shift || true
CONFIGS=("$@")
[ $# -eq 0 ] && CONFIGS=(native ecc dup)
OUT=${OUT:-$PWD/target/$sei_out_dir}
. bench/private_lockstep.sh
#
# sei_cells NAME "FAULTS" BASE_PORT NATIVE_BINARY HARDENED_BINARY "CLIENT" [SERVER_ARG...]
sei_cells() {
    local name=$1 faults=$2 port=$3 native=$4 hardened=$5 client=$6
    shift 6
    local fault cfg cell
    local -a server
    for fault in $faults; do
        for cfg in "${CONFIGS[@]}"; do
            cell="$OUT/$name-$fault-$cfg"
            port=$((port + 10))
            if [ -f "$cell/summary.json" ] && [ "$(wc -l < "$cell/results.jsonl")" -ge "$RUNS" ]; then
                continue
            fi
            case $cfg in
                native) server=("$native");;
                ecc) server=(env SEI_MODE=ecc "$hardened");;
                dup) server=(env SEI_MODE=dup "$hardened");;
                *) echo "unknown configuration $cfg (native, ecc or dup)" >&2; exit 2;;
            esac
            echo "== $name $fault $cfg: $(date +%T)" >&2
            "$L" inject --fault "$fault" --runs "$RUNS" --seed 11 -j 2 --timeout 2 --out "$cell" \
                --server --port "$port" --client "$client" \
                -- "${server[@]}" --port '{port}' "$@" > "$cell.log" 2>&1 || {
                echo "campaign $cell failed; see $cell.log" >&2
                exit 1
            }
            cp "$OUT/commit" "$cell/commit"
        done
    done
}
