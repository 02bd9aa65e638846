#!/usr/bin/env bash
# A `lockstep inject` campaign as a Slurm job array: array task K of N runs shard K/N of
# the campaign into $OUT/shard-K. Every shard draws the seeds and points the whole
# campaign would, so the merged result equals a campaign run on one machine.
#
#   OUT=/shared/campaign sbatch --array=0-7 examples/inject/slurm-array.sh \
#       --fault reg --runs 8000 --seed 1 -- ./md5job input.bin
#   # when the array is done (or as a job with --dependency=afterok:<array job id>):
#   lockstep inject merge --out /shared/campaign/merged /shared/campaign/shard-*
#
# Environment: OUT (required: a directory every node can write), LOCKSTEP (the binary,
# default `lockstep` on PATH), PORT (server mode: the base port; task K uses PORT + K*J
# and its J workers the ports after it, so tasks on one node never share a port).
# Workers per task: --cpus-per-task (default 1).
#SBATCH --job-name=lockstep-inject
#SBATCH --cpus-per-task=1
set -euo pipefail
: "${SLURM_ARRAY_TASK_ID:?submit this as a job array: sbatch --array=0-N-1 $0 ...}"
: "${OUT:?set OUT to a directory that every node can write}"
if [ "${SLURM_ARRAY_TASK_MIN:-0}" != 0 ] || [ "${SLURM_ARRAY_TASK_STEP:-1}" != 1 ]; then
    echo "slurm-array.sh: the array must be 0-N-1 with step 1 (task K runs shard K/N)" >&2
    exit 2
fi
shards=$((SLURM_ARRAY_TASK_MAX + 1))
jobs=${SLURM_CPUS_PER_TASK:-1}
port=()
if [ -n "${PORT:-}" ]; then
    port=(--port $((PORT + SLURM_ARRAY_TASK_ID * jobs)))
fi
exec "${LOCKSTEP:-lockstep}" inject --shard "$SLURM_ARRAY_TASK_ID/$shards" -j "$jobs" \
    --out "$OUT/shard-$SLURM_ARRAY_TASK_ID" "${port[@]}" "$@"
