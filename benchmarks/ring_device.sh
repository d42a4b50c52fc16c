#!/usr/bin/env bash
# One device call (600 s) for version 27's ring pass (kernel_ring.py beside the tensor-core kernel,
# ops_mma.MMA_RING_PASS):
#
#   bash benchmarks/ring_device.sh            # results under $OUT (or /tmp/ring-device)
#
# 1. The ring pass's GPU tests and the tensor-core kernel's (test_ring_partial.py, test_decode_attention_gluon.py
#    -k "mma or ring"), at most 200 s; log in $OUT/gpu-tests.log.
# 2. ring_pass_probe.py at 2 and 4 bits: the ring inside the kernel against the ring pass with $TILES, on
#    engine-like rows and on issue 5's uniform shapes (the launcher's own split counts); $OUT/ring-probe-<bits>.json.
# 3. bench_kernels --quick --only attention (issue 5's table) in what is left of 570 s; $OUT/kernels-quick.json.
set -uo pipefail
OUT=${OUT:-/tmp/ring-device}
TILES=${TILES:-32x2 64x4}
BUDGET_S=570
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - start))); }
SHAPES="ring:256:128:128:32:32 a:256:161:497:32:32 b:150:1153:1278:32:32 d:125:1040:2048:32:32
  packed:150:4096:4096:32:32 b64:64:4096:4096:32:32 gqa:200:512:4096:32:8 u8:8:4096:4096:32:32 u8g:8:4096:4096:32:8
  u64g:64:4096:4096:32:8 u256g:256:4096:4096:32:8 u8lg:8:32768:32768:32:8 u1:1:131072:131072:32:32
  u1g:1:131072:131072:32:8"

timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ring_partial.py tests/test_decode_attention_gluon.py \
    -k "ring or mma" > "$OUT/gpu-tests.log" 2>&1
echo "GPU tests: exit $? ($(tail -n 1 "$OUT/gpu-tests.log"))"
grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -20

for bits in 2 4; do
    tiles=$TILES; [ "$bits" = 4 ] && tiles=${TILES%% *}
    # shellcheck disable=SC2086
    timeout $(($(left) - 60)) python3 benchmarks/ring_pass_probe.py --bits $bits --tiles $tiles --no-paged \
        --shapes $SHAPES --out "$OUT/ring-probe-$bits.json" > "$OUT/ring-probe-$bits.log" 2>&1
    echo "ring probe $bits-bit: exit $?"; grep -E "^kivi" "$OUT/ring-probe-$bits.log" | cut -c1-120
done
if [ "$(left)" -gt 60 ]; then
    timeout $(($(left) - 10)) python3 benchmarks/bench_kernels.py --quick --only attention \
        --out "$OUT/kernels-quick.json" > "$OUT/kernels-quick.log" 2>&1
    echo "bench_kernels --quick: exit $?"; grep -E "^decode_attention  *2 " "$OUT/kernels-quick.log" | cut -c1-200
fi
