#!/usr/bin/env bash
# One device call (600 s) for version 28's persistent programs (kernel_mma_persistent.py, persistent=True):
#
#   bash benchmarks/persistent_device.sh       # results under $OUT (or /tmp/persistent-device)
#
# 1. The persistent kernel's GPU tests (test_persistent.py), at most 150 s; log in $OUT/gpu-tests.log. A failure
#    stops the call before any timing.
# 2. persistent_probe.py at 2 bits (and 4 with BITS4=1): the launcher's defaults, one block a step, persistent, on
#    engine-like rows and issue 5's shapes; $OUT/persistent-probe-<bits>.json.
set -uo pipefail
OUT=${OUT:-/tmp/persistent-device}
BUDGET_S=570
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - start))); }

timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_persistent.py > "$OUT/gpu-tests.log" 2>&1
rc=$?
echo "GPU tests: exit $rc ($(tail -n 1 "$OUT/gpu-tests.log"))"
if [ "$rc" != 0 ]; then grep -E "^(FAILED|ERROR|E )" "$OUT/gpu-tests.log" | head -30; exit 1; fi
for bits in 2 ${BITS4:+4}; do
    timeout $(($(left) - 10)) python3 benchmarks/persistent_probe.py --bits $bits \
        ${SHAPES:+--shapes $SHAPES} --out "$OUT/persistent-probe-$bits.json" > "$OUT/persistent-probe-$bits.log" 2>&1
    echo "persistent probe $bits-bit: exit $?"; grep -E "^kivi" "$OUT/persistent-probe-$bits.log" | cut -c1-120
done
