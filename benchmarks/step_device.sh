#!/usr/bin/env bash
# Device calls (600 s each) for version 28's blocks a step chosen per program (ops_mma.MMA_PAIRS = 0):
#
#   bash benchmarks/step_device.sh             # PHASE=kernels (default): tests, then step_probe.py
#   PHASE=engine bash benchmarks/step_device.sh
#
# kernels: the tensor-core kernel's GPU tests (test_decode_attention_gluon.py -k mma, test_ring_partial.py), at
#   most 200 s, a failure stopping the call; then step_probe.py at 2 bits ($OUT/step-probe.json).
# engine: bench_engine on the Llama-2-7B shape at 40 GiB, workloads $WORKLOADS (default a,b,e), engine-bf16,
#   engine-kivi-2 and engine-kivi-2/capacity-pairs (the rule before) in $WINDOW_S-second windows (default 25);
#   $OUT/engine.json.
set -uo pipefail
OUT=${OUT:-/tmp/step-device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${PHASE:-kernels}" = kernels ]; then
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_attention_gluon.py tests/test_ring_partial.py \
        -k "mma or ring" > "$OUT/gpu-tests.log" 2>&1
    rc=$?
    echo "GPU tests: exit $rc ($(tail -n 1 "$OUT/gpu-tests.log"))"
    if [ "$rc" != 0 ]; then grep -E "^(FAILED|ERROR|E )" "$OUT/gpu-tests.log" | head -30; exit 1; fi
    timeout 350 python3 benchmarks/step_probe.py --out "$OUT/step-probe.json" > "$OUT/step-probe.log" 2>&1
    echo "step probe: exit $?"; grep -E "^kivi" "$OUT/step-probe.log" | cut -c1-120
else
    python3 benchmarks/bench_engine.py --models llama2-7b --caps 40 --workloads "${WORKLOADS:-a,b,e}" \
        --systems engine-bf16,engine-kivi-2,engine-kivi-2/capacity-pairs --max-seconds "${WINDOW_S:-25}" \
        --budget-seconds 560 --out "$OUT/engine.json" > "$OUT/engine.log" 2>&1
    echo "bench_engine: exit $?"; grep -E '^llama' "$OUT/engine.log" | cut -c1-220
fi
