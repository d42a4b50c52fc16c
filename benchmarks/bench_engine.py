"""Engine benchmark (issue 3): Hugging Face `generate` against our LLMEngine, bf16 against KIVI caches.

On the H200 (first run: workloads b and e at 40 GiB on the Llama-2-7B shape, every system, ~6 minutes):

    python benchmarks/bench_engine.py --quick --out $OUT/bench_engine.json

On a CPU (tiny random Llama, tiny workloads, reference kernels; catches bugs before the device):

    python benchmarks/bench_engine.py --cpu-smoke

Systems (all in one process, same prompts, same random-weight bf16 model per shape and cap):
  hf-bf16        model.generate with its default dynamic cache, static batches
  hf-quanto-2/4  model.generate with transformers' QuantizedCache (quanto backend), static batches;
                 recorded as skipped when optimum-quanto is not installed
  hf-kivi-2      model.generate with kivi.KiviCache, static batches
  engine-bf16    LLMEngine, paged bf16 cache, continuous batching (every prompt submitted in one generate())
  engine-kivi-4  LLMEngine, KIVI 4-bit cache
  engine-kivi-2  LLMEngine, KIVI 2-bit cache
  <engine system>/<variant>  the same with one setting changed (/unfused, /separate, /sync, /model-scales: see
                 engine_probe.VARIANTS), e.g. --systems engine-kivi-2,engine-kivi-2/separate for an A/B on
                 one machine in one run

How each number is measured:
  output_tokens_per_s  requested output tokens produced / wall_s. wall_s is the timed region: the whole
                       engine.generate() call (prefill and decode; the engine's plan, allocation and CUDA-graph
                       capture happen before it, in build_s), or the sum of the static batches' generate() calls.
                       Static batches run to the longest request of the batch (workload d); tokens past a row's
                       own count are not counted.
  ms_per_decode_step   engine: engine.stats() decode_s / decode_steps (graph replay + sampling + host work).
                       hf: a StoppingCriteria runs once per generated token; it synchronizes the GPU and takes a
                       timestamp, so (last - first) / (calls - 1) per batch is the decode step (forward, logits
                       processing, sampling, cache update); the first call marks the end of prefill.
  decode_bound_ms      mean over decode steps of (weights read once, input embedding excluded, + the KV cache of
                       every sequence in flight at that step at its format's size: bf16 for bf16 caches; packed
                       codes, scales and zeros for the quantized tokens plus bf16 for the residual tokens for KIVI
                       and quanto) / the copy bandwidth measured at the start of the same run (a 2 GiB copy_,
                       bytes read plus written, median of 10; so reading 13.2 GB of Llama-2-7B weights at the
                       H200's ~4,220 GB/s counts 3.1 ms, not the 6.4 ms of counting the copy's bytes once). The engine's
                       per-step batch and lengths come from a wrapper around ModelRunner.decode (class-level,
                       benchmark process only); hf steps have every row of the batch at prompt + step tokens.
  weights_read_ms      engine: the weights' bytes alone (as in decode_bound_ms) at the copy bandwidth; step_over_weights
                       is ms_per_decode_step over it (issue 3: within 2x at batch 8, e.g. --engine-max-batch 8)
  decode_compute_bound_ms  the same steps' FLOPs (2 x the parameters read per row, + 4 x layers x query heads x
                       head_dim per cached token) at the bf16 matmul rate measured at the start of the run (an
                       8192^3 product, median of 10; header matmul_tflops): a second floor, which the bytes bound
                       does not see and which large batches reach (256 rows of Llama-3-8B: ~4 TFLOP a step).
  decode_floor_ms      both floors where each applies: max(weights' bytes, the weights' FLOPs) for the matmul
                       kernels plus the KV cache's bytes for attention (separate kernels, so their times add).
  max_in_flight        engine: engine.stats(); hf: the static batch size.
  peak_allocated_gib   torch.cuda.max_memory_allocated over the system's whole run (weights included; for the
                       engine its build, i.e. workspace measurement and graph capture, included).
  hf batch size        the largest batch whose bytes fit under the cap: the prefill bytes per row measured with a
                       2-row prefill, against the cache bytes per row at the final length plus a transient of 3
                       layers' bf16 KV (concatenation / dequantized copies), leaving 1 GiB + 3% of the cap as slack.
                       An out-of-memory batch is retried 15% smaller (oom_retries; its time is not counted).
  --max-seconds        per system x workload x cap: the timed region stops there (hf: a StoppingCriteria ends the
                       batch; engine: the wrapper raises out of generate()); the record then says "partial" and
                       counts the tokens produced up to that point (num_prompts_done counts finished prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
# as the job's actors set it (pipeline/actors/actor.py), before torch touches CUDA; every system gets it
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from common import copy_bandwidth, env_header, log, matmul_rate, write_json  # noqa: E402
from engine_probe import VARIANTS, split_system  # noqa: E402
from engine_report import TABLE_HEAD, compact, finish_record, speedups, table_row  # noqa: E402
from engine_setup import (  # noqa: E402
    MODELS,
    NUM_PROMPTS,
    QUICK_NUM_PROMPTS,
    SMOKE_KIVI,
    SMOKE_MODELS,
    SMOKE_SYSTEMS,
    SMOKE_WORKLOADS,
    SYSTEMS,
    WORKLOADS,
    allocated_gib,
    build_model,
    free_memory,
    make_prompts,
    peak_gib,
    reset_peak,
    set_cap,
)
from engine_systems import quanto_available, run_engine, run_hf  # noqa: E402

GiB = 2**30


# -- the matrix -------------------------------------------------------------------------------------------
def run_one(model, model_name: str, system: str, workload: str, cap_gib: float, prompts, ctx) -> dict:
    base = dict(system=system, model=model_name, workload=workload, cap_gib=cap_gib, num_prompts=len(prompts),
                prompt_len=len(prompts[0].ids), new_tokens=ctx.workloads[workload][1])
    dev = ctx.device
    remaining = ctx.budget_end - time.perf_counter()
    if remaining <= 0:
        return dict(base, status="skipped: --budget-seconds spent")
    free_memory(dev)
    reset_peak(dev)
    base["allocated_at_start_gib"] = allocated_gib(dev)
    deadline_s = min(ctx.max_seconds, remaining)
    t0 = time.perf_counter()
    try:
        runner = run_engine if system.startswith("engine") else run_hf
        rec = runner(model, system, prompts, cap_gib, ctx, deadline_s)
        rec = dict(base, **rec)
        if "status" not in rec:
            rec = finish_record(rec, len(prompts), dev)
    except Exception as err:  # one system failing never stops the run
        rec = dict(base, status=f"error: {type(err).__name__}: {str(err)[:300]}",
                   traceback=traceback.format_exc()[-3000:], peak_allocated_gib=peak_gib(dev))
    rec["total_s"] = time.perf_counter() - t0
    free_memory(dev)
    return rec


def parse_num_prompts(text: str | None, defaults: dict) -> dict:
    if not text:
        return dict(defaults)
    if "=" not in text:
        return {w: int(text) for w in defaults}
    out = dict(defaults)
    for part in text.split(","):
        key, value = part.split("=")
        out[key.strip()] = int(value)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None,
                   help=f"comma list of {list(MODELS)} (default: llama2-7b,llama3-8b)")
    p.add_argument("--systems", default=None, help=f"comma list of {list(SYSTEMS)} (default: all); an engine "
                   f"system with a suffix /{{{','.join(VARIANTS)}}} changes one engine setting (A/B in one run)")
    p.add_argument("--workloads", default=None, help="comma list of a,b,c,d,e (default: all)")
    p.add_argument("--caps", default=None, help="comma list of memory caps in GiB (default: 40,80)")
    p.add_argument("--num-prompts", default=None,
                   help=f"N for every workload, or 'b=512,e=256' (default {NUM_PROMPTS})")
    p.add_argument("--max-seconds", type=float, default=None, help="timed seconds per system x workload x cap "
                   "(default 90; --quick 25)")
    p.add_argument("--budget-seconds", type=float, default=None, help="start no run after this many seconds "
                   "from launch (default: none; --quick 480)")
    p.add_argument("--out", default=None, help="full records as JSON (default $OUT/bench_engine.json if $OUT is set, "
                   "else benchmarks/results/engine-<date>.json; --cpu-smoke: /tmp/bench_engine_smoke.json)")
    p.add_argument("--engine-max-batch", type=int, default=256, help="EngineConfig.max_batch_size")
    p.add_argument("--hf-batch", type=int, default=0, help="force the hf systems' static batch size "
                   "(default 0: the largest that fits, from bytes)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="EngineConfig.cuda_graphs=False")
    p.add_argument("--no-fused-layers", action="store_true", help="EngineConfig.fused_layers=False")
    p.add_argument("--no-decode-ahead", action="store_true", help="EngineConfig.decode_ahead=False")
    p.add_argument("--separate-projections", action="store_true", help="EngineConfig.fused_projections=False")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-early", action="store_true", help="engine systems: every request asks for the "
                   "workload's most new tokens and each row stops at its own count, as an EOS would end it (random "
                   "weights never say EOS): what a row reserves without page growth is then more than it uses (d)")
    p.add_argument("--quick", action="store_true", help="first device run: workloads b,e at 40 GiB on llama2-7b, "
                   "all systems, modest prompt counts, ~6 minutes")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny random Llama on the CPU, tiny workloads")
    return p.parse_args(argv)


@dataclass
class Context:
    device: torch.device
    bandwidth: float  # bytes/s
    flop_rate: float  # bf16 matmul FLOP/s
    workloads: dict
    max_seconds: float
    budget_end: float
    engine_max_batch: int
    cuda_graphs: bool
    fused_layers: bool = True
    decode_ahead: bool = True
    fused_projections: bool = True
    cpu_batch: int = 4
    hf_batch: int = 0  # force the static batch size (0: from bytes)
    cpu_cache_gib: float = 1.0
    kivi_kw: dict | None = None  # KiviConfig overrides (smoke only)
    stop_early: bool = False  # engine rows ask for the workload's most new tokens and stop at their own (an EOS)


def load_model(name: str, shape: dict, device: torch.device, header: dict):
    """(model, None), or (None, an error status) if it cannot be built."""
    t0 = time.perf_counter()
    try:
        model = build_model(shape, device)
    except Exception as err:
        free_memory(device)
        return None, f"error: building the model: {type(err).__name__}: {str(err)[:300]}"
    header.setdefault("model_build_s", {})[name] = round(time.perf_counter() - t0, 1)
    return model, None


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_launch = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import transformers

    transformers.logging.set_verbosity_error()
    smoke = args.cpu_smoke
    if smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("no CUDA device: run on the GPU, or use --cpu-smoke")
    models = SMOKE_MODELS if smoke else MODELS
    workloads = SMOKE_WORKLOADS if smoke else WORKLOADS
    pick = lambda text, default: [s.strip() for s in text.split(",")] if text else list(default)
    # the two shapes by default; mistral-7b (and tiny-mistral) when named
    model_names = pick(args.models, ["llama2-7b"] if args.quick else ["tiny-gqa"] if smoke
                       else ["llama2-7b", "llama3-8b"])
    systems = pick(args.systems, SMOKE_SYSTEMS if smoke else SYSTEMS)
    wl_names = pick(args.workloads, ["b", "e"] if args.quick else ["b", "d", "e"] if smoke else workloads)
    caps = [float(c) for c in pick(args.caps, ["40"] if args.quick or smoke else ["40", "80"])]
    try:
        bases = [split_system(s)[0] for s in systems]
    except ValueError as err:
        sys.exit(str(err))
    for name, known in ((model_names, models), (bases, SYSTEMS), (wl_names, workloads)):
        bad = [x for x in name if x not in known]
        if bad:
            sys.exit(f"unknown {bad}; choose from {list(known)}")
    num_prompts = parse_num_prompts(args.num_prompts, {w: 6 for w in workloads} if smoke
                                    else QUICK_NUM_PROMPTS if args.quick else NUM_PROMPTS)
    max_seconds = args.max_seconds or (25.0 if args.quick else 30.0 if smoke else 90.0)
    budget = args.budget_seconds or (480.0 if args.quick else 150.0 if smoke else None)
    out_path = args.out or ("/tmp/bench_engine_smoke.json" if smoke else None)
    if out_path is None:
        out_dir = os.environ.get("OUT")
        out_path = (f"{out_dir}/bench_engine.json" if out_dir else
                    f"benchmarks/results/engine-{time.strftime('%Y%m%d-%H%M%S')}.json")

    header = env_header(device)
    bw = copy_bandwidth(device, nbytes=(64 * 2**20 if smoke else 2 * GiB), iters=(5 if smoke else 10))
    mm = matmul_rate(device, n=(256 if smoke else 8192))
    header.update(copy_bandwidth_gbs=round(bw["gbs"], 1), copy_bandwidth_samples_gbs=bw["samples_gbs"],
                  matmul_tflops=round(mm["tflops"], 1), matmul_samples_tflops=mm["samples_tflops"],
                  quanto_available=quanto_available(), argv=sys.argv[1:],
                  alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), models={m: models[m] for m in model_names},
                  workloads={w: workloads[w] for w in wl_names}, num_prompts={w: num_prompts[w] for w in wl_names},
                  max_seconds=max_seconds, budget_seconds=budget, systems=systems, caps_gib=caps)
    ctx = Context(device=device, bandwidth=bw["gbs"] * 1e9, flop_rate=mm["tflops"] * 1e12, workloads=workloads,
                  max_seconds=max_seconds,
                  budget_end=t_launch + budget if budget else float("inf"), engine_max_batch=(
                      min(args.engine_max_batch, 4) if smoke else args.engine_max_batch),
                  cuda_graphs=not args.no_cuda_graphs, fused_layers=not args.no_fused_layers,
                  decode_ahead=not args.no_decode_ahead, fused_projections=not args.separate_projections,
                  cpu_cache_gib=0.05 if smoke else 1.0,
                  kivi_kw=dict(SMOKE_KIVI) if smoke else {}, hf_batch=args.hf_batch, stop_early=args.stop_early)
    log(f"bench_engine on {header['gpu']}: torch {header['torch']}, transformers {header['transformers']}, "
        f"triton {header['triton']}; copy bandwidth {bw['gbs']:.0f} GB/s; results -> {out_path}")
    log(TABLE_HEAD)
    records: list[dict] = []

    def emit(rec: dict) -> None:
        records.append(rec)
        log(table_row(rec))
        write_json(out_path, {"header": header, "records": records})

    for model_name in model_names:
        model, model_error = None, None
        for cap in caps:
            set_cap(cap, device)  # one model per shape, reused across systems and caps
            for wl in wl_names:
                prompts = make_prompts(wl, workloads[wl], num_prompts[wl], args.seed, models[model_name]["vocab_size"])
                for system in systems:
                    if model is None and model_error is None and time.perf_counter() < ctx.budget_end:
                        model, model_error = load_model(model_name, models[model_name], device, header)
                    if model is None:
                        spent = time.perf_counter() >= ctx.budget_end
                        emit(dict(system=system, model=model_name, workload=wl, cap_gib=cap,
                                  status=model_error or ("skipped: --budget-seconds spent" if spent else "skipped")))
                        continue
                    emit(run_one(model, model_name, system, wl, cap, prompts, ctx))
        del model
        free_memory(device)
    header["total_s"] = round(time.perf_counter() - t_launch, 1)
    write_json(out_path, {"header": header, "records": records})
    summary = dict(bench="bench_engine", out=str(out_path), gpu=header["gpu"], torch=header["torch"],
                   transformers=header["transformers"], triton=header["triton"],
                   copy_bandwidth_gbs=header["copy_bandwidth_gbs"], total_s=header["total_s"],
                   speedups=speedups(records), results=[compact(r) for r in records])
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
