"""Where a decode step's (or a prefill's) GPU time goes: kernel times of the engine's steps, by kernel (issue 3).

On the H200:

    python benchmarks/profile_step.py --out $OUT/profile_step.json

For each system (engine-kivi-2 and engine-bf16 by default) on the Llama-2-7B shape with random bf16 weights:
`--prompts` prompts of `--prompt-len` tokens, `--new-tokens` each, every prompt admitted at once (so all
prefills run before the first decode step), CUDA graphs off so that the profiler sees each kernel. The
torch profiler starts at the first decode step and stops after the last one; kernel times are summed by
name and divided by the number of decode steps. A replayed CUDA graph runs the same kernels without the
launch gaps, so the sum is close to the graph step time (`bench_engine.py` measures that). Prints a table
per system and one JSON object last.

--phase prefill profiles the prefills instead (from the first prefill to the first decode step) and reports
kernel times per 1,000 prompt tokens. A system named with a suffix runs with one engine setting changed, for
an A/B in one process (engine_probe.VARIANTS): "/unfused" (transformers' own RMSNorm and rotary ops),
"/separate" (q, k, v, gate and up as separate products), "/sync" (no decode-ahead).

On a CPU (`--cpu-smoke`: a tiny model, reference kernels): only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import torch  # noqa: E402
from common import env_header, write_json  # noqa: E402
from engine_probe import engine_config, instrumented_runner  # noqa: E402
from engine_setup import MODELS, TINY, StubTokenizer, build_model, free_memory, make_prompts, set_cap  # noqa: E402


class ProfileProbe:
    """For engine_probe.instrumented_runner. phase "decode": starts the profiler at the first decode step
    and records the decode batches and any prefill that runs after it. phase "prefill": profiles from the
    first prefill to the first decode step, counting prompt tokens."""

    def __init__(self, prof, phase: str = "decode") -> None:
        self.prof, self.phase, self.batches, self.prefills_after = prof, phase, [], 0
        self.prefill_tokens, self.profiling, self.done = 0, False, False

    def on_prefill(self, prompts) -> None:
        self.prefills_after += bool(self.batches)
        if self.phase == "prefill" and not self.done:
            if not self.profiling:
                self.prof.start()
                self.profiling = True
            self.prefill_tokens += sum(len(p) for p in prompts)

    def on_decode(self, positions) -> None:
        if self.phase == "prefill":
            if self.profiling and not self.done:
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                self.prof.stop()
                self.done = True
            self.batches.append(len(positions))
            return
        if not self.batches:
            self.prof.start()
            self.profiling = True
        self.batches.append(len(positions))

    def stop(self) -> None:
        if self.profiling and not self.done:
            self.prof.stop()
            self.done = True

    def units(self) -> float:
        """What kernel times are divided by: decode steps, or thousands of prompt tokens."""
        if self.phase == "prefill":
            return max(1e-9, self.prefill_tokens / 1000)
        return max(1, len(self.batches))


def profile_system(model, system: str, prompts, cap_gib: float, device: torch.device, phase: str) -> dict:
    """Kernel times (ms per decode step, or per 1,000 prompt tokens, by kernel name) of one engine's steps."""
    from torch.profiler import ProfilerActivity, profile

    from pipeline.actors.engine import LLMEngine, Request, SamplingParams

    config = engine_config(system, memory_limit_gib=cap_gib if device.type == "cuda" else None, max_batch_size=256,
                           cuda_graphs=False)
    engine = LLMEngine(model, StubTokenizer(), config)
    engine.generate([Request("warmup", prompts[0].ids, SamplingParams(max_new_tokens=3))])  # compile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    probe = ProfileProbe(profile(activities=activities), phase)
    requests = [Request(f"r{i}", p.ids, SamplingParams(max_new_tokens=p.new_tokens)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    try:
        with instrumented_runner(probe):
            engine.generate(requests)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        probe.stop()
    wall = time.perf_counter() - t0
    steps = probe.units()
    kernels = {}
    for evt in probe.prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue  # CPU ops: their device time is their kernels', which are counted as kernels
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0.0)
        if dev_us and dev_us > 0:
            kernels[evt.key[:90]] = dict(ms_per_step=dev_us / 1e3 / steps, calls_per_step=evt.count / steps)
    ranked = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms_per_step"]))
    stats = engine.stats()
    del engine
    free_memory(device)
    return dict(system=system, phase=phase, decode_steps=len(probe.batches),
                mean_batch=sum(probe.batches) / max(1, len(probe.batches)), prefill_tokens=probe.prefill_tokens,
                prefills_while_profiling=probe.prefills_after, wall_s=wall, per=("1000 prompt tokens"
                                                                                 if phase == "prefill" else "step"),
                gpu_ms_per_step=sum(k["ms_per_step"] for k in ranked.values()), num_slots=stats.get("num_slots"),
                kernels=ranked)


def group_of(name: str) -> str:
    """A coarse class of a kernel name, for the summary."""
    low = name.lower()
    for key, group in (("rms_norm", "norm, rotary (fused)"), ("rotary", "norm, rotary (fused)"),
                       ("flash", "attention (prefill)"), ("fmha", "attention (prefill)"),
                       ("decode_attention", "attention (KIVI)"), ("merge_splits", "attention (KIVI)"),
                       ("paged", "attention (bf16 pages)"), ("store", "cache stores"), ("gemm", "matmul"),
                       ("cutlass", "matmul"), ("sm90", "matmul"), ("nvjet", "matmul"), ("sampl", "sampling"),
                       ("softmax", "sampling"), ("argmax", "sampling")):
        if key in low:
            return group
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="engine-kivi-2,engine-bf16")
    p.add_argument("--prompts", default="128,32", help="prompts per system (comma list, same order as --systems)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--cap-gib", type=float, default=40.0)
    p.add_argument("--top", type=int, default=14, help="kernels printed per system")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (reference kernels)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    if device.type == "cpu" and not args.cpu_smoke:
        sys.exit("no CUDA device: run with --cpu-smoke for the CPU check")
    systems = args.systems.split(",")
    counts = [int(x) for x in args.prompts.split(",")]
    if len(counts) != len(systems):
        sys.exit(f"--prompts has {len(counts)} counts for {len(systems)} systems")
    if args.cpu_smoke:
        from kivi import KiviConfig  # noqa: F401  (registers the kivi attention function)

        shape, args.prompt_len, args.new_tokens, counts = TINY, 40, 4, [2] * len(systems)
    else:
        shape = MODELS["llama2-7b"]
        set_cap(args.cap_gib, device)
    model = build_model(shape, device)
    result = dict(header=env_header(device), args=vars(args), systems=[])
    for system, n in zip(systems, counts, strict=True):
        prompts = make_prompts("b", (args.prompt_len, args.new_tokens), n, seed=0, vocab=shape["vocab_size"])
        rec = profile_system(model, system, prompts, args.cap_gib, device, args.phase)
        groups = {}
        for name, k in rec["kernels"].items():
            groups[group_of(name)] = groups.get(group_of(name), 0.0) + k["ms_per_step"]
        rec["groups_ms_per_step"] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
        result["systems"].append(rec)
        print(f"{system} ({args.phase}): {rec['decode_steps']} decode steps, batch {rec['mean_batch']:.0f}, "
              f"{rec['prefill_tokens']} prompt tokens profiled, GPU {rec['gpu_ms_per_step']:.2f} ms per {rec['per']}; "
              f"by class {json.dumps(rec['groups_ms_per_step'])}")
        for name, k in list(rec["kernels"].items())[: args.top]:
            print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:6.1f}  {name}")
        if args.out:
            write_json(args.out, result)
    print(json.dumps({"bench": "profile_step", "device": str(device), "systems": [
        {k: r[k] for k in ("system", "phase", "per", "decode_steps", "mean_batch", "gpu_ms_per_step",
                           "groups_ms_per_step")}
        for r in result["systems"]]}))


if __name__ == "__main__":
    main()
