#!/usr/bin/env bash
# One device call (600 s) that checks the engine on the GPU and measures its open A/Bs on one machine:
#
#   bash benchmarks/engine_device.sh            # results under $OUT (or /tmp/engine-device)
#
# 1. The engine's and the fused layers' tests on the GPU (decode-ahead with sampled rows, fused projections,
#    silu_mul, bf16 rotary bit-equality, CUDA graphs), at most 170 s; their log is $OUT/gpu-tests.log.
# 2. bench_engine on the Llama-2-7B shape at 40 GiB, workloads b and e, for engine-bf16, engine-kivi-2 and
#    the variants in $VARIANTS (default: engine-kivi-2/separate), each in a window of $WINDOW_S seconds
#    (default 35), inside what is left of a 570 s budget; results in $OUT/engine.json. Ratios between the
#    systems hold within the run (two machines of the same kind differed by 6% in copy bandwidth).
# Optional steps between 1 and 2: MLP_PROBE=1 runs probe_mlp_act.py (silu_mul against transformers' ops,
# ~30 s; $OUT/mlp-act.json); BATCH8=1 runs bench_engine b with --engine-max-batch 8 for engine-bf16 and
# engine-kivi-2 (20 s windows; $OUT/engine-batch8.json), whose step_over_weights is issue 3's batch-8 criterion.
#
#   MLP_PROBE=1 BATCH8=1 VARIANTS=engine-kivi-2/silu-mul bash benchmarks/engine_device.sh
set -uo pipefail
OUT=${OUT:-/tmp/engine-device}
VARIANTS=${VARIANTS:-engine-kivi-2/separate}
WINDOW_S=${WINDOW_S:-35}
BUDGET_S=570
mkdir -p "$OUT"

timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_engine_growth.py tests/test_engine_decode.py tests/test_fused_layers.py \
    tests/test_silu_mul.py > "$OUT/gpu-tests.log" 2>&1
echo "GPU tests: exit $? ($(tail -n 1 "$OUT/gpu-tests.log"))"

if [ "${MLP_PROBE:-0}" = 1 ]; then
    timeout 90 python3 benchmarks/probe_mlp_act.py --out "$OUT/mlp-act.json" > "$OUT/mlp-act.log" 2>&1
    echo "probe_mlp_act: exit $?"
    grep "^{'rows'" "$OUT/mlp-act.log" | cut -c1-220
fi
if [ "${BATCH8:-0}" = 1 ]; then
    python3 benchmarks/bench_engine.py --models llama2-7b --caps 40 --workloads b --engine-max-batch 8 \
        --systems engine-bf16,engine-kivi-2 --max-seconds 20 --budget-seconds 90 \
        --out "$OUT/engine-batch8.json" > "$OUT/engine-batch8.log" 2>&1
    echo "batch 8: exit $?"
    grep -E '^llama' "$OUT/engine-batch8.log" | cut -c1-200
fi

left=$((BUDGET_S - SECONDS))
python3 benchmarks/bench_engine.py --models llama2-7b --caps 40 --workloads b,e \
    --systems "engine-bf16,engine-kivi-2,$VARIANTS" --max-seconds "$WINDOW_S" --budget-seconds "$left" \
    --out "$OUT/engine.json" 2>&1 | tail -n 12 | cut -c1-2000
