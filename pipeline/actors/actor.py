"""The stateful Ray Data UDF: loads the model once per actor, then generates for each batch of rows."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pipeline import prompts, stats
from pipeline.config import JobConfig, template_fields
from pipeline.io import CONSUMED_COLUMNS

log = logging.getLogger(__name__)

# (job) -> (engine, tokenizer); the engine has generate, reset_stats and stats (pipeline.actors.engine)
EngineLoader = Callable[[JobConfig], tuple[Any, Any]]


def load_engine(job: JobConfig) -> tuple[Any, Any]:
    """The real model through kivi.load and the KIVI engine around it."""
    # Before the first CUDA allocation: segments that grow in place, so the prefill's activations of changing
    # sizes do not fragment what the cache plan left free (a user's own setting wins)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    import kivi
    from pipeline.actors.engine import EngineConfig, LLMEngine

    model, gguf_file = model_location(job)
    backend = job.kivi_backend
    if backend == "auto":
        backend = "triton" if torch.cuda.is_available() else "reference"
    cuda = torch.cuda.is_available()
    native_bf16 = None if cuda else cpu_has_native_bf16()  # the CPU's flags matter on a CPU
    cache, (dtype, cache_dtype) = job.kivi_config(backend), resolve_dtypes(job.dtype, cuda, native_bf16)
    hint = cpu_dtype_hint(dtype, cuda, native_bf16)
    if hint:
        log.warning(hint)
    if cache_dtype:
        log.info("this CPU has no bf16 arithmetic: --dtype auto runs the model in %s over a %s cache (the bytes of a "
                 "bf16 run's cache; --dtype bfloat16 computes in bf16, several times slower here)", dtype, cache_dtype)
    hf_model, tokenizer = kivi.load(model, gguf_file=gguf_file, dtype=dtype, kivi=cache)
    config = EngineConfig(
        kivi=cache,
        # actors sharing a GPU each plan for their share of its memory
        gpu_memory_utilization=job.gpu_memory_utilization * min(1.0, job.gpus_per_actor),
        max_batch_size=job.max_batch_size,
        max_model_len=job.max_model_len,
        page_growth=job.page_growth,
        growth_plan_share=job.growth_plan_share,
        cache_dtype=cache_dtype,
    )
    return LLMEngine(hf_model, tokenizer, config), tokenizer


def resolve_dtypes(job_dtype: str, cuda: bool, native_bf16: bool | None) -> tuple[str, str | None]:
    """(the model's dtype, the cache's or None for the model's) for a job's --dtype: "auto" is bfloat16, except on a
    CPU known to lack bf16 arithmetic (native_bf16 False), where the model runs in float32 (its matmuls 2-5x faster
    there) over a bfloat16 cache, so that the cache holds what a bf16 run's would."""
    if job_dtype != "auto":
        return job_dtype, None
    if not cuda and native_bf16 is False:
        return "float32", "bfloat16"
    return "bfloat16", None


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU does bf16 arithmetic in hardware, from the flags in `cpuinfo` (x86: avx512_bf16 or
    amx_bf16; Arm: bf16); None where that file does not exist (not Linux)."""
    try:
        with open(cpuinfo) as f:
            flags = set(f.read().split())
    except OSError:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_dtype_hint(dtype: str, cuda: bool, native_bf16: bool | None) -> str | None:
    """A warning for a bfloat16 model on a CPU without bf16 hardware, where its matmuls run several times
    slower than float32's (4x for SmolLM2's shapes on an AVX-512 Xeon without BF16); None otherwise."""
    if cuda or dtype != "bfloat16" or native_bf16 is not False:
        return None
    return ("this CPU has no bf16 arithmetic (no avx512_bf16, amx_bf16 or Arm bf16 flag): the bfloat16 model's "
            "matmuls run several times slower than float32's; --dtype auto (float32 over a bf16 cache) is faster "
            "here")


def model_location(job: JobConfig) -> tuple[str, str | None]:
    """(model, gguf_file): the job's (a path to a .gguf file is its folder and name), or the embedded
    SmolLM2-135M-Instruct."""
    if job.model is not None:
        model = os.path.expanduser(job.model)  # "~/models/x" from a YAML file, as a shell would expand it
        if job.gguf_file is None and model.endswith(".gguf"):
            return os.path.dirname(model) or ".", os.path.basename(model)
        return model, job.gguf_file
    import kivi

    return kivi.default_model()


class GenerateActor:
    """map_batches UDF. Output: the batch minus prompt/messages/sampling_params, plus the generated
    columns and the hidden per-row stats columns (pipeline.stats) that the driver folds into stats."""

    def __init__(self, job: dict[str, Any], source: str, loader: EngineLoader | None = None):
        self.job = JobConfig(**job)
        self.source = source
        self.needed = set(CONSUMED_COLUMNS)
        if source == "template":
            self.needed |= set(template_fields(self.job.prompt_template))
        self.sampling_defaults = self.job.sampling_defaults()
        t0 = time.perf_counter()
        self.engine, self.tokenizer = (loader or load_engine)(self.job)
        self.start_s = time.perf_counter() - t0  # model load and engine object, once per actor
        self.actor_id = _actor_id()
        if self.job.renders_chat(source) and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.job.model!r} has no chat template, needed for {source!r} prompts")

    def __call__(self, batch: pa.Table) -> pa.Table:
        """One call at a time: the engine runs this batch's rows to completion."""
        start = time.perf_counter()
        requests, errors = self._requests(self._rows(batch))
        self.engine.reset_stats()
        completions = self.engine.generate(requests) if requests else []
        return self._answer(batch, requests, completions, errors, time.perf_counter() - start, self.engine.stats())

    def _rows(self, batch: pa.Table) -> list[dict[str, Any]]:
        return batch.select([c for c in batch.column_names if c in self.needed]).to_pylist()

    def _answer(self, batch: pa.Table, requests, completions, errors, busy_s: float, engine_stats) -> pa.Table:
        assert len(completions) == len(requests), (len(completions), len(requests))
        by_row = {int(c.request_id): c for c in completions}
        return self._output(batch, by_row, errors, busy_s / max(1, batch.num_rows), engine_stats)

    def _requests(self, rows: list[dict[str, Any]]) -> tuple[list[Any], dict[int, str]]:
        """Engine requests for the good rows; {row: message} for the rest."""
        from pipeline.actors.engine import Request

        requests, errors = [], {}
        chat_rendered = self.job.renders_chat(self.source)
        for i, row in enumerate(rows):
            try:
                text = prompts.prompt_text(row, self.source, self.job.prompt_template, self.tokenizer, self.job.chat)
                ids = prompts.token_ids(self.tokenizer, text, chat_rendered)
                params = prompts.sampling(row, self.sampling_defaults)
            except (ValueError, TypeError) as e:
                errors[i] = str(e)
                continue
            requests.append(Request(request_id=str(i), prompt_token_ids=ids, sampling=params))
        return requests, errors

    def _output(
        self, batch: pa.Table, by_row: dict[int, Any], errors: dict[int, str], share: float, es: dict[str, Any]
    ) -> pa.Table:
        n = batch.num_rows
        done = [by_row.get(i) for i in range(n)]
        text = [c.text if c and c.finish_reason != "error" else None for c in done]
        cols = {
            "generated_text": pa.array(text, pa.string()),
            "num_input_tokens": pa.array([c.num_input_tokens if c else 0 for c in done], pa.int64()),
            "num_generated_tokens": pa.array([len(c.token_ids) if c else 0 for c in done], pa.int64()),
            "finish_reason": pa.array([c.finish_reason if c else "error" for c in done], pa.string()),
            "error": pa.array([errors.get(i) if c is None else c.error for i, c in enumerate(done)], pa.string()),
        }
        hidden = {
            "actor_id": self.actor_id,
            "ttft_s": [c.ttft_s if c else None for c in done],
            "tpot_s": [_time_per_output_token(c) for c in done],
            "elapsed_share_s": share,
            "max_allocated_mb": float(es["max_allocated_mb"]),
            "kv_cache_bytes": int(es["kv_cache_bytes"]),
            "kv_cache_bytes_bf16": int(es["kv_cache_bytes_bf16"]),
            "device_name": str(es["device_name"]),
            "model_dtype": es["model_dtype"],
            "cache_dtype": es["cache_dtype"],
            "actor_start_s": self.start_s,
            "engine_build_s": es.get("build_s"),
            "preemptions": [c.preemptions if c else 0 for c in done],
            "engine_oom_retries": int(es["oom_retries_total"]),
            "engine_rebuilds": int(es["rebuilds_total"]),
        }
        cols.update(stats.hidden_columns(n, hidden))
        out = batch.drop_columns([c for c in CONSUMED_COLUMNS if c in batch.column_names])
        for name, values in cols.items():
            out = out.append_column(name, values)
        return out


def _time_per_output_token(c) -> float | None:
    """Seconds per token that a decode step made (after the first token, and but for the tokens that a preempted
    row's rebuilds made, whose time decode_s leaves out); None without a decode step."""
    steps = 0 if c is None or c.decode_s is None else len(c.token_ids) - 1 - c.preemptions
    return c.decode_s / steps if steps > 0 else None


def _actor_id() -> str:
    """The Ray actor's id and this process's: an actor that Ray restarts keeps its id but starts a new engine,
    whose counts (engine_oom_retries, engine_rebuilds) start again, so the stats take it for another actor."""
    try:
        import ray

        if ray.is_initialized():
            actor = ray.get_runtime_context().get_actor_id()
            if actor:
                return f"{actor}-pid-{os.getpid()}"
    except Exception:  # noqa: BLE001 - outside Ray (unit tests): fall back to the process
        pass
    return f"pid-{os.getpid()}"


class StreamingGenerateActor(GenerateActor):
    """The pipeline's UDF. Ray Data runs a few calls of each actor at once (pipeline.run.actor_pool, an
    async __call__); they share the actor's one engine through an EngineService, which admits a call's rows
    while the rows of earlier calls still decode, so the engine stays wide from one call to the next."""

    def __init__(self, job: dict[str, Any], source: str, loader: EngineLoader | None = None, progress=None):
        """progress: a handle of the driver's pipeline.progress.LiveCounter actor (or None), told the rows and
        tokens the engine finishes while calls are in flight, every half progress interval."""
        from pipeline.actors.engine.service import EngineService

        super().__init__(job, source, loader)
        reporter = None if progress is None else lambda rows, tokens: progress.add.remote(rows, tokens)
        self.service = EngineService(self.engine, reporter, report_s=max(0.5, self.job.log_interval_s / 2))

    async def __call__(self, batch: pa.Table):
        start = time.perf_counter()
        requests, errors = self._requests(self._rows(batch))
        prepare_s = time.perf_counter() - start
        completions, engine_stats = await asyncio.wrap_future(self.service.submit(requests))
        # this call's time: its rows' preparation, and its share of the engine's time (its steps are shared)
        busy_s = prepare_s + engine_stats["busy_s"]
        yield self._answer(batch, requests, completions, errors, busy_s, engine_stats)
