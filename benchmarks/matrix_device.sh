#!/usr/bin/env bash
# Cells of the engine benchmark's matrix (issue 3) on a machine of two GPUs: two bench_engine processes at
# once, one per GPU, each with its own model, cap and workloads. Each process measures its own GPU's copy
# bandwidth and matmul rate, so every record's bound belongs to the GPU it ran on.
#
#   LANE0="--models llama3-8b --caps 40 --workloads a,c,d" \
#   LANE1="--models llama2-7b --caps 80 --workloads a,c,d" bash benchmarks/matrix_device.sh
#
# SYSTEMS (default engine-kivi-2,engine-bf16,engine-kivi-4,hf-bf16), WINDOW_S (timed seconds per system and
# cell, default 30) and BUDGET_S (start no run after this many seconds, default 480) apply to both lanes.
# Results: $OUT/engine-gpu<i>.json and .log; the rows of both tables are printed last. On a machine of one GPU
# the lanes run one after the other on it (then BUDGET_S counts from each lane's start).
set -uo pipefail
OUT=${OUT:-/tmp/matrix-device}
SYSTEMS=${SYSTEMS:-engine-kivi-2,engine-bf16,engine-kivi-4,hf-bf16}
WINDOW_S=${WINDOW_S:-30}
BUDGET_S=${BUDGET_S:-480}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
lane_run() {  # lane_run INDEX GPU ARGS...
    local index=$1 device=$2
    shift 2
    CUDA_VISIBLE_DEVICES=$device python3 benchmarks/bench_engine.py "$@" --systems "$SYSTEMS" \
        --max-seconds "$WINDOW_S" --budget-seconds "$BUDGET_S" --out "$OUT/engine-gpu$index.json" \
        > "$OUT/engine-gpu$index.log" 2>&1
}
index=0 rc=0 pids=()
for lane in "${LANE0:-}" "${LANE1:-}"; do
    if [ -n "$lane" ]; then
        # shellcheck disable=SC2086  # a lane is a list of bench_engine arguments
        if [ "$GPUS" -ge 2 ]; then lane_run $index $index $lane & pids+=($!); else lane_run $index 0 $lane || rc=1; fi
    fi
    index=$((index + 1))
done
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done

for log in "$OUT"/engine-gpu*.log; do
    echo "== $log"
    grep -v '^{' "$log" | tail -n 24 | cut -c1-240
done
exit $rc
