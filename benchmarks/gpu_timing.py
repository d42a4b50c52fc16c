"""Timing of GPU calls by CUDA-graph replay over rotating input sets (bench_kernels.py, kernel_sweep.py).

    ms = time_graph([fn_0, fn_1, ...])["ms"]

Each fn_i is a zero-argument call over its own input set (its own memory), so a replay that cycles through
the sets reads from DRAM, not from a warm L2, once the sets together exceed a few times the L2 size
(`sets_for` picks how many). The graph holds `calls` launches (the sets repeated), sized so one replay runs
for about `target_ms`; ms is the median over replays of replay time / calls. Launch gaps inside a replayed
graph are included (about a microsecond each on the H200), as in an engine that replays its decode step.

Random inputs must be drawn before this is called: a capture that fails leaves PyTorch's default CUDA
generator in capture mode (later randn calls raise "Offset increment outside graph capture"), so a failed
capture falls back to eager event timing and nothing random may run inside the timed calls. Callers draw
their data with `cuda_generator(seed)`, a private generator that no capture touches.
"""

from __future__ import annotations

import math
import statistics

import torch


def l2_bytes(device: torch.device | None = None) -> int:
    props = torch.cuda.get_device_properties(device or torch.device("cuda"))
    return int(getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20)


def sets_for(bytes_per_set: int, l2: int, max_sets: int = 64, l2_multiple: float = 4.0) -> int:
    """Input sets so that one pass over all of them reads at least l2_multiple * L2 bytes."""
    return max(1, min(max_sets, math.ceil(l2_multiple * l2 / max(bytes_per_set, 1))))


def cuda_generator(seed: int, device: torch.device | None = None) -> torch.Generator:
    return torch.Generator(device=device or torch.device("cuda")).manual_seed(seed)


def _eager_ms(fns, calls: int, replays: int) -> list[float]:
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fns[i % len(fns)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


def time_graph(fns, est_ms: float | None = None, target_ms: float = 4.0, replays: int = 7,
               max_calls: int = 400) -> dict:
    """Median ms per call of fns (cycled) replayed as one CUDA graph; eager events if capture fails."""
    for fn in fns:  # compile / allocate outside any capture
        fn()
    torch.cuda.synchronize()
    if est_ms is None:
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for fn in fns:
            fn()
        t1.record()
        t1.synchronize()
        est_ms = max(t0.elapsed_time(t1) / len(fns), 1e-3)
    calls = max(len(fns), min(max_calls, math.ceil(target_ms / est_ms)))
    calls = math.ceil(calls / len(fns)) * len(fns)
    res = dict(calls=calls, sets=len(fns), mode="graph")
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    except Exception as exc:  # noqa: BLE001 - record and fall back to eager timing
        res.update(mode="eager", graph_error=f"{type(exc).__name__}: {str(exc)[:200]}")
        del graph
        torch.cuda.synchronize()
        times = _eager_ms(fns, calls, replays)
    else:
        del graph
    res["ms"] = statistics.median(times)
    res["ms_spread"] = (max(times) - min(times)) / res["ms"] if res["ms"] > 0 else None
    return res


def time_eager(fn, replays: int = 20) -> float:
    """Median ms of single eager calls (host launch overhead included when it exceeds the GPU time)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
