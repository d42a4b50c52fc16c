#!/usr/bin/env bash
# One device call (600 s) that checks the decode-attention kernels on the GPU and measures them:
#
#   bash benchmarks/kernel_device.sh            # results under $OUT (or /tmp/kernel-device)
#
# 1. The decode-attention GPU tests (the tensor-core kernel with each value copy, stages, ring share, the
#    launcher's defaults), at most 150 s; log in $OUT/gpu-tests.log.
# 2. ncu of the tensor-core kernel alone at B=64, L=4,096, 32/32 and 32/8 heads (its value copy from
#    $NCU_VALUE_COPY when set): details pages and a summary of the per-instruction counters (ncu_summary.py;
#    kernel_notes.md, version 19, says what they showed).
# 3. With NCU_L2=1, L2's throughput breakdown and read requests against sectors for the 2-bit kernel and the
#    paged bf16 kernel at the same shape ($OUT/ncu-l2.txt). kernel_sweep plan $PLAN when set (e.g.
#    PLAN=waves4), its best rows printed.
# 4. bench_kernels --only attention (the README's table), in what is left of 570 s.
# The device returns at most 8 files: the logs of step 2 are folded into one.
# The engine's A/B is a second call: VARIANTS=... bash benchmarks/engine_device.sh.
set -uo pipefail
OUT=${OUT:-/tmp/kernel-device}
BUDGET_S=570
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py tests/test_decode_attention_gluon.py \
    -k "mma or ring or wide_groups or launcher or wave" > "$OUT/gpu-tests.log" 2>&1
echo "GPU tests: exit $? ($(tail -n 1 "$OUT/gpu-tests.log"))"

for shape in "64,4096,32" "64,4096,8"; do
    IFS=, read -r b l kv <<< "$shape"
    name="mma-b$b-l$l-kv$kv"
    timeout 60 ncu --clock-control none -k regex:_decode_attention_mma_kernel --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section SourceCounters -o "$OUT/$name" \
        python3 benchmarks/kernel_sweep.py --ncu --ncu-mma "$b,$l" --ncu-kv-heads "$kv" \
        ${NCU_VALUE_COPY:+--ncu-value-copy "$NCU_VALUE_COPY"} > "$OUT/$name.log" 2>&1
    ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/$name-details.txt" 2>&1
    ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name-sass.csv" 2>&1
    python3 benchmarks/ncu_summary.py "$OUT/$name-sass.csv" > "$OUT/$name-summary.json"
    rm -f "$OUT/$name-sass.csv" "$OUT/$name.ncu-rep"
    tail -n 3 "$OUT/$name.log" >> "$OUT/ncu.log" && rm -f "$OUT/$name.log"
    echo "ncu $name: $(grep -E "Duration|DRAM Throughput|L1/TEX Cache Throughput|L2 Cache Throughput" "$OUT/$name-details.txt" | tr -s ' ' | tr '\n' ';')"
done

if [ -n "${NCU_L2:-}" ]; then  # is L2 what binds? (kernel_notes.md, after version 21): the same metrics on the
    # 2-bit kernel and on the paged bf16 kernel (which streams at 103-112% of copy) at B=64, L=4,096, 32/32
    metrics=breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
    timeout 60 ncu --clock-control none -k regex:_decode_attention_mma_kernel --launch-skip 1 --launch-count 1 \
        --metrics "$metrics" python3 benchmarks/kernel_sweep.py --ncu --ncu-mma 64,4096 > "$OUT/ncu-l2.txt" 2>&1
    timeout 60 ncu --clock-control none -k regex:_paged_decode_kernel --launch-skip 1 --launch-count 1 \
        --metrics "$metrics" python3 benchmarks/ncu_paged.py --shape 64,4096 >> "$OUT/ncu-l2.txt" 2>&1
    grep -E "_kernel|lts__|dram__|gpu__time" "$OUT/ncu-l2.txt" | tr -s ' ' | cut -c1-150
fi

if [ -n "${PLAN:-}" ]; then
    timeout 150 python3 benchmarks/kernel_sweep.py --plan "$PLAN" --no-sdpa --workers 8 --out "$OUT/$PLAN.json" 2>&1 \
        | grep -A14 "best per" | cut -c1-200
fi
left=$((BUDGET_S - SECONDS))
timeout "$left" python3 benchmarks/bench_kernels.py --only attention --out "$OUT/kernels.json" 2>&1 | tail -n 2 \
    | cut -c1-300
