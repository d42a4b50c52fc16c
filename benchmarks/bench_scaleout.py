"""Scale-out benchmark (issue 4): the real job (`python -m jobs.generate`, embedded local Ray, Ray Data
actor pool) over a Llama-2-7B-shaped model with random bf16 weights, once per actor configuration.

On the H200 (the whole device step, wheels included, is benchmarks/scaleout_device.sh):

    python benchmarks/bench_scaleout.py --tokenizer .whl2/tokenizer --work /tmp/scaleout \
        --out $OUT/scaleout.json --configs 1x1.0,2x0.5 --prompts 1536

On a CPU (tiny random Llama, a handful of short prompts, reference kernels; checks the whole script):

    python benchmarks/bench_scaleout.py --tiny --tokenizer .scaleout/tokenizer --work /tmp/scaleout-tiny \
        --out /tmp/scaleout-tiny/scaleout.json

Steps: build the model folder (config with the tokenizer's vocabulary, random weights made on the device,
save_pretrained in bf16 safetensors, the tokenizer beside it; reused when its config already matches);
write --prompts rows of about --prompt-len tokens (random token ids decoded, re-tokenized and trimmed)
as --files Parquet files (one shard each); then per config "AxG" (A actors of G GPUs each) run the job
with --max-new-tokens, --ignore-eos, the 2-bit KIVI cache, and read its outputs back.

How each number is measured (per config):
  wall_s                  the job's subprocess from launch to exit: Python and Ray start, actor start, all.
  output_tokens           summed num_generated_tokens of the shard files the job wrote (read back).
  output_tokens_per_s     output_tokens / wall_s (end to end).
  job_output_tokens_per_s the job summary's own figure (its driver's run() time, Ray start included).
  gen_output_tokens_per_s sum over actors of the actor's tokens / (its busy time - its engine build), from the
                          per-shard stats: busy time is its calls' wall time; actors sharing a GPU run concurrently,
                          so their rates add. Excludes Ray start, model load, engine build and idle waits.
  actor_start_s           per actor: model load and engine object (the actor's constructor).
  engine_build_s          per actor: cache plan, allocation, CUDA-graph capture (inside its first call).
  scaling_efficiency      a config's tokens/s / (GPUs it holds * the tokens/s of the first 1-actor config); GPUs
                          held = ceil(actors * gpus_per_actor), so for 2x0.5 (two actors on one GPU) it is the
                          shared GPU's throughput relative to one actor alone. Given for both rates above.
--prompts-per-gpu N (weak scaling) gives each config N prompts (in --files files) per GPU it holds, so that every
GPU gets the same work as the 1-GPU config and the wall times compare directly; without it every config runs the
same --prompts.
--warmup (default on) first runs a short job whose outputs are dropped, so that the first config's engine build
does not include Triton's first compile of the kernels (48 s of the 1-GPU run on 2026-11-29, 4 s warm).
--max-seconds bounds the whole script: a config is not launched with less than --min-run-s left, and a running
job is stopped when the time is up (its completed shards are still counted; the record says partial).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from common import REPO_ROOT, env_header, log, write_json  # noqa: E402
from scaleout_inputs import build_model, make_prompts, write_inputs  # noqa: E402

GPU_DEFAULTS = dict(prompts=1536, prompt_len=1024, max_new_tokens=256, files=16, batch_size=256, max_batch_size=256)
TINY_DEFAULTS = dict(prompts=8, prompt_len=48, max_new_tokens=16, files=4, batch_size=2, max_batch_size=4)


def parse_configs(text: str) -> list[tuple[int, float]]:
    """"1x1.0,2x0.5" -> [(1, 1.0), (2, 0.5)]: actors x GPUs per actor."""
    out = []
    for item in text.split(","):
        try:
            actors, gpus = item.strip().lower().split("x")
            out.append((int(actors), float(gpus)))
        except ValueError:
            raise ValueError(f"config {item!r} is not ACTORSxGPUS_PER_ACTOR, e.g. 2x0.5") from None
    return out


def run_job(args: argparse.Namespace, actors: int, gpus: float, model: Path, out: Path, log_path: Path,
            timeout_s: float, max_new_tokens: int | None = None) -> dict:
    """One job through the real CLI in a subprocess; stopped (whole process group) at timeout_s."""
    new_tokens = args.max_new_tokens if max_new_tokens is None else max_new_tokens
    cmd = [sys.executable, "-m", "jobs.generate", "--input", str(args.work / "input"), "--output", str(out),
           "--model", str(model), "--max-new-tokens", str(new_tokens), "--ignore-eos", "--kivi",
           "--kv-bits", "2", "--actors", str(actors), "--gpus-per-actor", str(gpus),
           "--batch-size", str(args.batch_size), "--max-batch-size", str(args.max_batch_size),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--overwrite"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    log(f"run {actors}x{gpus}: {' '.join(cmd)} (log {log_path}, at most {timeout_s:.0f} s)")
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc, partial = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            rc, partial = _stop(proc), True
    wall = time.perf_counter() - t0
    return {"returncode": rc, "partial": partial, "wall_s": wall, **read_outputs(out)}


def _stop(proc: subprocess.Popen) -> int:
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    return proc.wait()


def read_outputs(out: Path) -> dict:
    """What the job wrote: shard rows, per-shard stats, the summary (when it got that far)."""
    shards = sorted(p for p in out.glob("*.parquet") if not p.name.startswith((".", "_")))
    rows = pa.concat_tables([pq.read_table(p) for p in shards]) if shards else None
    stats_files = sorted((out / "_stats").glob("*.parquet"))
    stats = [r for p in stats_files for r in pq.read_table(p).to_pylist()]
    summary_path = out / "_stats" / "_summary.json"
    summary = json.loads(summary_path.read_text())["summary"] if summary_path.is_file() else None
    reasons = {} if rows is None else dict(zip(*np.unique(rows["finish_reason"].to_numpy(zero_copy_only=False),
                                                          return_counts=True), strict=True))
    return {"shards": len(shards), "rows": 0 if rows is None else rows.num_rows,
            "output_tokens": 0 if rows is None else int(np.sum(rows["num_generated_tokens"].to_numpy())),
            "input_tokens": 0 if rows is None else int(np.sum(  # of the rows that ran, as the job's summary counts
                rows["num_input_tokens"].to_numpy()[rows["finish_reason"].to_numpy(zero_copy_only=False) != "error"])),
            "finish_reasons": {str(k): int(v) for k, v in reasons.items()}, "stats": stats, "summary": summary}


def actor_view(stats: list[dict]) -> list[dict]:
    """Per actor: tokens, busy time (its calls' wall time), start and build times, generation rate."""
    actors = {}
    for r in stats:
        a = actors.setdefault(r["actor_id"], {"actor_id": r["actor_id"], "shards": 0, "output_tokens": 0,
                                              "busy_s": 0.0, "actor_start_s": r.get("actor_start_s"),
                                              "engine_build_s": None, "device_name": r["device_name"]})
        a["shards"] += 1
        a["output_tokens"] += r["total_output_tokens"]
        a["busy_s"] += r["elapsed_time_s"]
        if r.get("engine_build_s") is not None:
            a["engine_build_s"] = max(a["engine_build_s"] or 0.0, r["engine_build_s"])
    for a in actors.values():
        gen_s = a["busy_s"] - (a["engine_build_s"] or 0.0)
        a["gen_output_tokens_per_s"] = a["output_tokens"] / gen_s if gen_s > 0 else 0.0
    return list(actors.values())


def gpus_held(actors: int, gpus_per_actor: float) -> int:
    return max(1, math.ceil(actors * gpus_per_actor - 1e-9))


def summarize_run(actors: int, gpus: float, res: dict) -> dict:
    per_actor = actor_view(res["stats"])
    summary = res["summary"] or {}
    return {
        "config": f"{actors}x{gpus:g}", "actors": actors, "gpus_per_actor": gpus,
        "gpus_held": gpus_held(actors, gpus),
        "output_tokens_per_s": res["output_tokens"] / res["wall_s"] if res["wall_s"] > 0 else 0.0,
        "job_output_tokens_per_s": summary.get("output_tokens_per_second"),
        "gen_output_tokens_per_s": sum(a["gen_output_tokens_per_s"] for a in per_actor),
        "actor_start_s": [a["actor_start_s"] for a in per_actor],
        "engine_build_s": [a["engine_build_s"] for a in per_actor],
        "per_actor": per_actor, **{k: v for k, v in res.items() if k not in ("stats", "summary")},
        "job_summary": summary, "shard_stats": res["stats"],
    }


def add_efficiency(runs: list[dict]) -> None:
    base = next((r for r in runs if r["actors"] == 1 and r["rows"]), None)
    for r in runs:
        for key in ("output_tokens_per_s", "gen_output_tokens_per_s"):
            ref = base[key] if base else 0.0
            r[f"scaling_efficiency_{key}"] = r[key] / (r["gpus_held"] * ref) if ref else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="folder of a tokenizer saved with save_pretrained")
    p.add_argument("--work", type=Path, required=True, help="work dir: model, input, job outputs")
    p.add_argument("--out", type=Path, required=True, help="full results JSON (job logs go beside it)")
    p.add_argument("--configs", default="1x1.0,2x0.5", help="ACTORSxGPUS_PER_ACTOR, comma separated")
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU, few short prompts (smoke test)")
    for name, value in GPU_DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {value} ({TINY_DEFAULTS[name]} tiny)")
    p.add_argument("--prompts-per-gpu", type=int, help="weak scaling: this many prompts per GPU a config holds "
                   "(in --files files per GPU) instead of the same --prompts for every config")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run a short job first to fill Triton's kernel cache (not counted)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-seconds", type=float, default=520.0, help="budget of the whole script")
    p.add_argument("--min-run-s", type=float, default=150.0, help="do not launch a config with less time left")
    p.add_argument("--ray-cpus", type=int, help="start a local Ray head with this many CPUs for the jobs to join "
                   "(a 2-core CPU machine cannot hold 2 CPU actors and the read tasks); default: each job's own Ray")
    args = p.parse_args()
    t_start = time.perf_counter()
    for name, value in (TINY_DEFAULTS if args.tiny else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    configs = parse_configs(args.configs)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"env": env_header(device), "args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    result["model"] = build_model(args.work / "model", args.tokenizer, args.tiny, device)
    t0 = time.perf_counter()
    if args.prompts_per_gpu:
        args.prompts = args.prompts_per_gpu * max(gpus_held(a, g) for a, g in configs)
    texts, lengths = make_prompts(args.tokenizer, args.prompts, args.prompt_len)
    args.texts = texts
    result["prompts"] = {"n": len(texts), "per_gpu": args.prompts_per_gpu, "files_per_job": args.files,
                         "tokens": lengths, "make_s": time.perf_counter() - t0}
    log(f"prompts: {len(texts)} ({args.prompts_per_gpu or 'all'} per GPU), tokens {lengths}")
    head = _ray_head(args.ray_cpus) if args.ray_cpus else None
    try:
        _run_configs(args, configs, result, t_start)
    finally:
        if head is not None:
            _stop(head)
            current = Path("/tmp/ray/ray_current_cluster")  # left behind by a killed `ray start --block`
            if current.is_file() and current.read_text().strip() == os.environ["RAY_ADDRESS"]:
                current.unlink()
    done = [r for r in result["runs"] if "skipped" not in r]
    add_efficiency(done)
    result["total_s"] = time.perf_counter() - t_start
    write_json(args.out, result)
    keys = ("config", "returncode", "partial", "prompts", "rows", "output_tokens", "wall_s", "output_tokens_per_s",
            "gen_output_tokens_per_s", "scaling_efficiency_output_tokens_per_s",
            "scaling_efficiency_gen_output_tokens_per_s", "actor_start_s", "engine_build_s", "finish_reasons")
    table = [{k: _fmt(r.get(k)) for k in keys} for r in done] + [r for r in result["runs"] if "skipped" in r]
    for r in table:
        log(" | ".join(f"{k}={_fmt(v)}" for k, v in r.items()))
    print(json.dumps({"bench": "scaleout", "tiny": args.tiny, "prompts": lengths | {"n": len(texts)},
                      "total_s": round(result["total_s"], 1), "runs": table}, default=str))


def _ray_head(cpus: int) -> subprocess.Popen:
    """A local head (`ray start --block`, ours to stop) the jobs join through RAY_ADDRESS; token
    authentication off (loopback only)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--port=0", f"--num-cpus={cpus}", "--num-gpus=0",
                             "--include-dashboard=false", "--disable-usage-stats"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in head.stdout:  # "... ray start --address='10.0.0.1:6379'" once the head is up
        if "--address='" in line:
            os.environ["RAY_ADDRESS"] = line.split("--address='")[1].split("'")[0]
            return head
    raise RuntimeError(f"ray start exited with {head.wait()}")


def _warmup(args: argparse.Namespace, result: dict) -> None:
    """A short 1-actor job (8 prompts, 4 new tokens) whose outputs are dropped: it fills Triton's on-disk kernel
    cache, so that no config's engine build includes the first compile (~45 s on the H200)."""
    write_inputs(args.work / "input", args.texts[:8], 1)
    res = run_job(args, 1, 1.0, args.work / "model", args.work / "out-warmup", args.out.parent / "scaleout-warmup.log",
                  min(args.max_seconds, 240.0), max_new_tokens=4)
    build = [a["engine_build_s"] for a in actor_view(res["stats"])]
    result["warmup"] = {"returncode": res["returncode"], "wall_s": res["wall_s"], "rows": res["rows"],
                        "engine_build_s": build}
    log(f"warm-up job: rc {res['returncode']}, {res['wall_s']:.1f} s, engine build {build}")


def _run_configs(args: argparse.Namespace, configs: list[tuple[int, float]], result: dict, t_start: float) -> None:
    if args.warmup:
        _warmup(args, result)
    for actors, gpus in configs:
        left = args.max_seconds - (time.perf_counter() - t_start)
        name = f"{actors}x{gpus:g}"
        if left < args.min_run_s:
            log(f"skip {name}: {left:.0f} s left < --min-run-s {args.min_run_s:.0f}")
            result["runs"].append({"config": name, "skipped": f"{left:.0f} s left"})
            continue
        held = gpus_held(actors, gpus)
        texts = args.texts[: args.prompts_per_gpu * held] if args.prompts_per_gpu else args.texts
        files = args.files * held if args.prompts_per_gpu else args.files
        write_inputs(args.work / "input", texts, files)
        log(f"{name}: {len(texts)} prompts in {min(files, len(texts))} files")
        res = run_job(args, actors, gpus, args.work / "model", args.work / f"out-{name}",
                      args.out.parent / f"scaleout-{name}.log", left)
        res["prompts"] = len(texts)
        result["runs"].append(summarize_run(actors, gpus, res))


def _fmt(v):
    if isinstance(v, float):
        return round(v, 3)
    if isinstance(v, list):
        return [_fmt(x) for x in v]
    return v if isinstance(v, (int, str, bool, dict)) or v is None else str(v)


if __name__ == "__main__":
    main()
