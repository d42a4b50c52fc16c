"""The engine's counters: totals and peaks since the last reset, which LLMEngine.stats() reports."""

from __future__ import annotations

import time

import torch

from pipeline.actors.engine.memory import peak_memory_mb

# counts that the snapshot also gives since the engine started (`<name>_total`, across resets): the per-shard stats
# report them, whether an actor resets the engine's stats for each call or never does
LIFETIME = ("oom_retries", "rebuilds")


class EngineCounters:
    """`acc` holds the totals (the same dict across resets, so holders of it stay current). prefill_tokens counts
    every token prefilled, recomputed_tokens those of them prefilled again (prompt and output) after a
    preemption."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.acc: dict = {}
        self.before = dict.fromkeys(LIFETIME, 0)  # LIFETIME counts of the totals before the last reset
        self.reset()

    def reset(self) -> None:
        for key in LIFETIME:
            self.before[key] += self.acc.get(key, 0)
        self.acc.clear()
        self.acc.update(kv_cache_bytes=0, kv_cache_bytes_bf16=0, decode_steps=0, decode_s=0.0, prefill_tokens=0,
                        prefill_s=0.0, max_in_flight=0, oom_retries=0, wall_s=0.0, preemptions=0,
                        recomputed_tokens=0, rebuilds=0)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def count_steps(self, steps: int, batch: int, t0: float) -> None:
        """`steps` decode steps of `batch` rows that ran since perf_counter() was t0."""
        self.acc["decode_steps"] += steps
        self.acc["decode_s"] += time.perf_counter() - t0
        self.acc["max_in_flight"] = max(self.acc["max_in_flight"], batch)

    def record_memory(self, cache, running: list, submissions: list) -> None:
        """Peak of the cache's content, in the totals and in each submission's peaks: packed tokens at their packed
        size, residual tokens at full precision (pages and slots reserved but not yet filled are free space, not
        content)."""
        held = sum(cache.content_bytes(s.cached_len) for s in running)
        bf16 = sum(s.cached_len for s in running) * cache.bf16_token_bytes
        for peaks in (self.acc, *(sub.peaks for sub in submissions)):  # both sizes from the same moment
            if held > peaks["kv_cache_bytes"]:
                peaks["kv_cache_bytes"], peaks["kv_cache_bytes_bf16"] = held, bf16

    def snapshot(self, build_s: float | None, plan) -> dict:
        """The totals with the device's peak memory, the build's time and the plan's slots and pages."""
        max_mb, name = peak_memory_mb(self.device)
        out = dict(self.acc, max_allocated_mb=max_mb, device_name=name, build_s=build_s)
        out.update({f"{key}_total": self.before[key] + self.acc[key] for key in LIFETIME})
        if plan is not None:
            out.update(num_slots=plan.num_slots, num_pages=plan.num_pages)
        return out
