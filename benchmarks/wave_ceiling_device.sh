#!/usr/bin/env bash
# One device call (600 s): what holds issue 5's missed decode-attention shapes, and the current tables.
#
#   bash benchmarks/wave_ceiling_device.sh      # results under $OUT (or /tmp/wave-ceiling)
#   python benchmarks/wave_ceiling.py --ncu <OUT>/ncu.csv --kernels <OUT>/kernels.json   # on any machine, after
#
# 1. bench_kernels (every kernel: the README's decode-attention and store tables), at most 330 s.
# 2. ncu's raw counters of the tensor-core kernel alone (launch, occupancy, scheduler, warp-state and instruction
#    sections, plus instructions executed and the SM clock) at the shapes that miss issue 5's targets, all of them
#    one wave of one-warp programs, and at two multi-wave shapes that meet them; one CSV, a `# shape` line before
#    each shape's rows.
# 3. The decode-attention GPU tests (tensor-core kernel, ring, launcher) in what is left of 570 s.
set -uo pipefail
OUT=${OUT:-/tmp/wave-ceiling}
BUDGET_S=570
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

timeout 330 python3 benchmarks/bench_kernels.py --out "$OUT/kernels.json" > "$OUT/bench.log" 2>&1
echo "bench_kernels: exit $? after ${SECONDS} s"

SHAPES=${SHAPES:-"8,4096,8 1,131072,8 64,4096,8 8,32768,8 8,4096,32 64,4096,32 256,4096,32"}
for shape in $SHAPES; do
    IFS=, read -r b l kv <<< "$shape"
    left=$((BUDGET_S - SECONDS - 60))
    [ "$left" -gt 20 ] || { echo "ncu: no time left for $shape"; break; }
    echo "# shape $b,$l,$kv" >> "$OUT/ncu.csv"
    timeout "$((left < 90 ? left : 90))" ncu --clock-control none -k regex:_decode_attention_mma_kernel \
        --launch-skip 1 --launch-count 1 --section LaunchStats --section Occupancy --section SchedulerStats \
        --section WarpStateStats --section SpeedOfLight \
        --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg.per_second --csv --page raw \
        python3 benchmarks/kernel_sweep.py --ncu --ncu-mma "$b,$l" --ncu-kv-heads "$kv" \
        > "$OUT/ncu-one.txt" 2> "$OUT/ncu-one.err"
    rc=$?
    grep -E '^"' "$OUT/ncu-one.txt" >> "$OUT/ncu.csv"
    echo "ncu $shape: exit $rc, $(grep -cE '^"' "$OUT/ncu-one.txt") csv lines after ${SECONDS} s"
    [ "$rc" -eq 0 ] || tail -n 5 "$OUT/ncu-one.txt" "$OUT/ncu-one.err"
done
rm -f "$OUT/ncu-one.txt" "$OUT/ncu-one.err"

left=$((BUDGET_S - SECONDS))
if [ "$left" -gt 30 ]; then
    timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py \
        tests/test_decode_attention_gluon.py tests/test_ring_partial.py -k "mma or ring or launcher or wave" \
        > "$OUT/gpu-tests.log" 2>&1
    echo "GPU tests: exit $? ($(tail -n 1 "$OUT/gpu-tests.log"))"
fi
tail -n 1 "$OUT/bench.log" | cut -c1-400
