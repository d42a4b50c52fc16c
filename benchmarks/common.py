"""Helpers shared by the benchmark scripts: environment header, copy bandwidth, JSON output.

Not a test module and not collected by pytest; the scripts import it as `common` (benchmarks/ is on
sys.path when a script in it runs).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or no __version__
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def env_header(device: torch.device) -> dict:
    """Date, machine and library versions, recorded at the top of every result file."""
    header = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "git_commit": _git_commit(),
        "device": device.type,
        "gpu": None,
        "gpu_total_gib": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        header.update(gpu=props.name, gpu_total_gib=round(props.total_memory / 2**30, 2))
    else:
        header["gpu"] = f"none (cpu: {platform.processor() or platform.machine()})"
    return header


def _timed(device: torch.device, fn, *args) -> float:
    """Seconds of one fn(*args) call: CUDA events on the GPU, the wall clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, iters: int = 10, warmup: int = 2) -> dict:
    """Bandwidth of `dst.copy_(src)` for an `nbytes` buffer: bytes read plus written (2 * nbytes) per copy.

    Returns {"gbs": median GB/s (1e9 bytes), "samples_gbs": [...], "nbytes": nbytes}.
    """
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    samples = []
    for i in range(warmup + iters):
        seconds = _timed(device, dst.copy_, src)
        if i >= warmup:
            samples.append(2 * nbytes / seconds / 1e9)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"gbs": statistics.median(samples), "samples_gbs": [round(s, 1) for s in samples], "nbytes": nbytes}


def matmul_rate(device: torch.device, n: int = 8192, iters: int = 10, warmup: int = 2) -> dict:
    """bf16 matmul throughput of [n, n] x [n, n] products (2 n^3 FLOPs each), the compute roof a decode step's
    matmuls can reach. Returns {"tflops": median, "samples_tflops": [...], "n": n}."""
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    samples = []
    for i in range(warmup + iters):
        seconds = _timed(device, torch.matmul, a, b)
        if i >= warmup:
            samples.append(2 * n**3 / seconds / 1e12)
    del a, b
    return {"tflops": statistics.median(samples), "samples_tflops": [round(x, 1) for x in samples], "n": n}


def write_json(path: str | os.PathLike, obj) -> None:
    """Write atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def finish(path: str | os.PathLike | None, result: dict) -> None:
    """End a benchmark: write `result` to `path` (when given), then print it as the last line, one JSON object."""
    if path:
        write_json(path, result)
    print(json.dumps(result, default=str))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
