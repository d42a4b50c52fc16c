#!/usr/bin/env bash
# Scale-out benchmark (issue 4) on the GPU machine, which has no ray and no network: the ray wheel
# (79 MB) is larger than one device call carries (64 MiB), so it travels in two back-to-back calls
# (files under /tmp survive between calls while the machine stays warm, about 30 s).
#
#   call 1, carry [".whl1"]:                   bash benchmarks/scaleout_device.sh step1
#   call 2 at once, carry [".whl2"], 600 s:    bash benchmarks/scaleout_device.sh step2 [PROMPTS]
#   (or `install` in place of step2: ray into /tmp/site and nothing else, as quickstart_device.sh does)
#
# On a machine of N GPUs: CONFIGS=1x1.0,2x1.0 PER_GPU=1536 bash benchmarks/scaleout_device.sh step2 (weak
# scaling: each config gets PER_GPU prompts per GPU it holds, so each GPU does the 1-GPU config's work).
#
# .whl1/raypart.00 and .whl2/raypart.01 are the halves of ray-2.60.0-cp312 (split -b 40M -d);
# .whl2/ also holds ray.sha256, the wheels of ray's dependencies and tokenizer/ (SmolLM2's, saved with
# save_pretrained). Step 2 installs ray and only the dependencies the machine lacks (a newer copy on
# PYTHONPATH would shadow what torch and transformers were installed with), then runs
# benchmarks/bench_scaleout.py within 540 s in all: 7B model build and save, then configs 1x1.0 and
# 2x0.5 of PROMPTS prompts (default 1536: ~1,024 tokens in, 256 out; ~2 minutes each at 3,000-5,000
# output tokens/s). Results: $OUT/scaleout.json and $OUT/scaleout-<config>.log.
set -euo pipefail
STEP=${1:?usage: scaleout_device.sh step1 | step2 [PROMPTS] | install}
PROMPTS=${2:-1536}
CONFIGS=${CONFIGS:-1x1.0,2x0.5}
PER_GPU=${PER_GPU:+--prompts-per-gpu $PER_GPU}
BUDGET_S=540
WHEEL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
OUT=${OUT:-/tmp/scaleout-results}

case "$STEP" in
step1)
    mkdir -p /tmp/parts && cp .whl1/raypart.00 /tmp/parts/
    ls -l /tmp/parts
    ;;
install|step2)
    cat /tmp/parts/raypart.00 .whl2/raypart.01 > "/tmp/$WHEEL"
    echo "$(cut -d' ' -f1 .whl2/ray.sha256)  /tmp/$WHEEL" | sha256sum -c -
    wheels=("/tmp/$WHEEL")
    for pair in jsonschema:jsonschema- jsonschema_specifications:jsonschema_specifications- \
        referencing:referencing- rpds:rpds_py- click:click- msgpack:msgpack- google.protobuf:protobuf- \
        yaml:pyyaml- requests:requests- filelock:filelock- packaging:packaging- attrs:attrs- \
        charset_normalizer:charset_normalizer- idna:idna- urllib3:urllib3- certifi:certifi- \
        typing_extensions:typing_extensions-; do
        if ! python3 -c "import ${pair%%:*}" 2>/dev/null; then
            echo "missing here: ${pair%%:*}"
            wheels+=(.whl2/"${pair#*:}"*.whl)
        fi
    done
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "${wheels[@]}"
    export PYTHONPATH=/tmp/site:$PWD
    python3 -c "import ray, ray.data; print('ray', ray.__version__, 'from', ray.__file__)"
    [ "$STEP" = install ] && exit 0
    mkdir -p "$OUT"
    left=$((BUDGET_S - SECONDS - 5))
    timeout $((left + 30)) python3 benchmarks/bench_scaleout.py --tokenizer .whl2/tokenizer --work /tmp/scaleout \
        --out "$OUT/scaleout.json" --configs "$CONFIGS" --prompts "$PROMPTS" $PER_GPU --max-seconds "$left"
    ;;
*)
    echo "unknown step $STEP (step1, step2 or install)" >&2
    exit 2
    ;;
esac
