"""Per-shard stats rows (one per shard and actor) and the job summary.

The actor tags every output row with hidden columns (HIDDEN, dropped before the output is written):
which actor made it, its time to first token, its share of the batch's wall time, the engine's
peak memory and KV-cache bytes for that batch, and how long the actor took to start (model load and
engine object in its constructor; the engine's cache plan, allocation and CUDA-graph capture, which
happen in its first call and count in that call's time too). The driver folds a finished shard's rows
into stats.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa

PREFIX = "_kivi_ray_"
HIDDEN = {
    "actor_id": pa.string(),
    "ttft_s": pa.float64(),
    "tpot_s": pa.float64(),
    "elapsed_share_s": pa.float64(),
    "max_allocated_mb": pa.float64(),
    "kv_cache_bytes": pa.int64(),
    "kv_cache_bytes_bf16": pa.int64(),
    "device_name": pa.string(),
    "model_dtype": pa.string(),
    "cache_dtype": pa.string(),
    "actor_start_s": pa.float64(),
    "engine_build_s": pa.float64(),
    "preemptions": pa.int64(),
    "engine_oom_retries": pa.int64(),
    "engine_rebuilds": pa.int64(),
}
STATS_SCHEMA = pa.schema(
    [
        ("shard", pa.string()),
        ("num_requests", pa.int64()),
        ("num_failed", pa.int64()),
        ("num_preempted", pa.int64()),
        ("total_input_tokens", pa.int64()),
        ("total_output_tokens", pa.int64()),
        ("elapsed_time_s", pa.float64()),
        ("output_tokens_per_second", pa.float64()),
        ("mean_ttft_ms", pa.float64()),
        ("p99_ttft_ms", pa.float64()),
        ("mean_tpot_ms", pa.float64()),
        ("max_allocated_mb", pa.float64()),
        ("kv_cache_bytes", pa.int64()),
        ("kv_cache_bytes_bf16", pa.int64()),
        ("kv_bits", pa.int64()),
        ("group_size", pa.int64()),
        ("residual_length", pa.int64()),
        ("model", pa.string()),
        ("device_name", pa.string()),
        ("model_dtype", pa.string()),
        ("cache_dtype", pa.string()),
        ("actor_id", pa.string()),
        ("actor_start_s", pa.float64()),
        ("engine_build_s", pa.float64()),
        ("engine_oom_retries", pa.int64()),
        ("engine_rebuilds", pa.int64()),
    ]
)


def hidden(name: str) -> str:
    return PREFIX + name


def hidden_columns(num_rows: int, values: dict[str, Any]) -> dict[str, pa.Array]:
    """The hidden columns of one batch: per-row lists or one value broadcast to every row."""
    out = {}
    for name, typ in HIDDEN.items():
        v = values[name]
        out[hidden(name)] = pa.array(v if isinstance(v, list) else [v] * num_rows, type=typ)
    return out


def strip_hidden(table: pa.Table) -> pa.Table:
    return table.drop_columns([c for c in table.column_names if c.startswith(PREFIX)])


def shard_stats(shard: str, table: pa.Table, job: dict[str, Any]) -> list[dict[str, Any]]:
    """One stats row per actor that worked on this shard. `job`: kv_bits, group_size, residual_length, model."""
    cols = table.select(["num_input_tokens", "num_generated_tokens", "finish_reason"] + list(map(hidden, HIDDEN)))
    d = cols.to_pydict()
    rows = []
    for actor in sorted(set(d[hidden("actor_id")])):
        idx = [i for i, a in enumerate(d[hidden("actor_id")]) if a == actor]
        pick = lambda col: [d[col][i] for i in idx]  # noqa: B023 - used at once
        out_tokens = sum(pick("num_generated_tokens"))
        elapsed = float(sum(pick(hidden("elapsed_share_s"))))
        ttft_ms = [t * 1e3 for t in pick(hidden("ttft_s")) if t is not None]
        tpot_ms = [t * 1e3 for t in pick(hidden("tpot_s")) if t is not None]
        rows.append(
            {
                "shard": shard,
                "num_requests": len(idx),
                "num_failed": sum(r == "error" for r in pick("finish_reason")),
                "num_preempted": sum(n > 0 for n in pick(hidden("preemptions"))),
                "total_input_tokens": sum(n for n, r in zip(pick("num_input_tokens"), pick("finish_reason"),
                                                            strict=True) if r != "error"),  # rows that did not fail
                "total_output_tokens": out_tokens,
                "elapsed_time_s": elapsed,
                "output_tokens_per_second": out_tokens / elapsed if elapsed > 0 else 0.0,
                "mean_ttft_ms": float(np.mean(ttft_ms)) if ttft_ms else None,
                "p99_ttft_ms": float(np.percentile(ttft_ms, 99)) if ttft_ms else None,
                "mean_tpot_ms": float(np.mean(tpot_ms)) if tpot_ms else None,
                "max_allocated_mb": max(pick(hidden("max_allocated_mb"))),
                **_cache_peak(pick(hidden("kv_cache_bytes")), pick(hidden("kv_cache_bytes_bf16"))),
                "device_name": pick(hidden("device_name"))[0],
                "model_dtype": pick(hidden("model_dtype"))[0],
                "cache_dtype": pick(hidden("cache_dtype"))[0],
                "actor_id": actor,
                "actor_start_s": max(pick(hidden("actor_start_s"))),
                "engine_build_s": max((t for t in pick(hidden("engine_build_s")) if t is not None), default=None),
                # the actor's engine since it started, as of this shard's last call (counts that only grow)
                "engine_oom_retries": max(pick(hidden("engine_oom_retries"))),
                "engine_rebuilds": max(pick(hidden("engine_rebuilds"))),
                **job,
            }
        )
    return rows


def _cache_peak(kv: list[int], kv_bf16: list[int]) -> dict[str, int]:
    """The largest cache size among the rows' calls with its bf16 size from the same call (each call's engine
    keeps the two as a pair, taken at one moment; the two maxima of different calls would not be)."""
    i = max(range(len(kv)), key=lambda j: (kv[j], kv_bf16[j]))
    return {"kv_cache_bytes": kv[i], "kv_cache_bytes_bf16": kv_bf16[i]}


def stats_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=STATS_SCHEMA)


def summarize(rows: list[dict[str, Any]], ttfts_ms: list[float], wall_s: float, shards_skipped: int,
              shards_done: int | None = None, tpots_ms: list[float] | None = None) -> dict[str, Any]:
    """Totals of this run over its stats rows; wall_s is the driver's time from start to last write.
    shards_done: shards written (default: those with stats rows; an empty input file has none). ttfts_ms,
    tpots_ms: every row's time to first token and time per output token after the first."""
    out_tokens = sum(r["total_output_tokens"] for r in rows)
    peak = max(rows, key=lambda r: r["kv_cache_bytes"], default=None)  # both sizes from the same moment
    kv, kv_bf16 = (peak["kv_cache_bytes"], peak["kv_cache_bytes_bf16"]) if peak else (0, 0)
    return {
        "shards_done": len({r["shard"] for r in rows}) if shards_done is None else shards_done,
        "shards_skipped": shards_skipped,
        "actors": len({r["actor_id"] for r in rows}),
        "num_requests": sum(r["num_requests"] for r in rows),
        "num_failed": sum(r["num_failed"] for r in rows),
        "num_preempted": sum(r["num_preempted"] for r in rows),
        "total_input_tokens": sum(r["total_input_tokens"] for r in rows),
        "total_output_tokens": out_tokens,
        "wall_time_s": round(wall_s, 3),
        "output_tokens_per_second": out_tokens / wall_s if wall_s > 0 else 0.0,
        "mean_ttft_ms": float(np.mean(ttfts_ms)) if ttfts_ms else None,
        "p99_ttft_ms": float(np.percentile(ttfts_ms, 99)) if ttfts_ms else None,
        "mean_tpot_ms": float(np.mean(tpots_ms)) if tpots_ms else None,
        "max_allocated_mb": max((r["max_allocated_mb"] for r in rows), default=0.0),
        "kv_cache_bytes": kv,
        "kv_cache_bytes_bf16": kv_bf16,
        "kv_cache_ratio": kv / kv_bf16 if kv_bf16 else None,
        "device_names": sorted({r["device_name"] for r in rows}),
        "model_dtypes": sorted({r["model_dtype"] for r in rows if r["model_dtype"]}),  # as the actors resolved them
        "max_actor_start_s": max((r["actor_start_s"] for r in rows), default=None),
        "max_engine_build_s": max((r["engine_build_s"] for r in rows if r["engine_build_s"] is not None),
                                  default=None),
        # each actor's counts since its engine started, as of its last shard
        "engine_oom_retries": _per_actor_sum(rows, "engine_oom_retries"),
        "engine_rebuilds": _per_actor_sum(rows, "engine_rebuilds"),
        "model": rows[0]["model"] if rows else None,
    }


def _per_actor_sum(rows: list[dict[str, Any]], key: str) -> int:
    """The sum over actors of each one's largest `key` among its stats rows (a count since its engine started)."""
    latest: dict[str, int] = {}
    for r in rows:
        latest[r["actor_id"]] = max(latest.get(r["actor_id"], 0), r[key] or 0)
    return sum(latest.values())


def format_summary(summary: dict[str, Any]) -> str:
    """A two-column table for the job log."""
    lines = []
    for key, value in summary.items():
        if isinstance(value, float):
            value = "-" if math.isnan(value) else f"{value:,.3f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        elif value is None:
            value = "-"
        lines.append(f"{key:<26} {value}")
    rule = "-" * max(len(line) for line in lines)
    return "\n".join(["job summary", rule, *lines, rule])


def summary_json(summary: dict[str, Any], job: dict[str, Any]) -> str:
    return json.dumps({"summary": summary, "job": job}, indent=2, default=str)
