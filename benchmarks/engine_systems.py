"""bench_engine's systems: Hugging Face `generate` with static batches, and our engine, each timed with a
deadline. How each number is measured is in bench_engine.py's docstring."""

from __future__ import annotations

import inspect
import time

import torch
from engine_probe import (
    RunnerProbe,
    TimeUp,
    build_engine,
    engine_config,
    instrumented_runner,
    kernel_variant,
    step_costs,
)
from engine_setup import (
    GiB,
    KVFormat,
    Prompt,
    StubTokenizer,
    decode_flops,
    free_memory,
    kv_format,
    peak_gib,
    reset_peak,
    weight_read_bytes,
)


# -- Hugging Face generate, static batches --------------------------------------------------------------
def quanto_available() -> bool:
    try:
        from transformers.utils import is_optimum_quanto_available

        return bool(is_optimum_quanto_available())
    except ImportError:
        import importlib.util

        return importlib.util.find_spec("optimum.quanto") is not None


def cache_kwarg(model) -> str:
    """transformers 5.24 renamed generate's/forward's past_key_values to cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_factory(model, system: str, kivi_kw: dict):
    """A callable making a fresh cache for one generate() call, or None for the default dynamic cache."""
    if system == "hf-bf16":
        return None
    bits = int(system.rsplit("-", 1)[1])
    if "quanto" in system:
        from transformers.cache_utils import QuantizedCache

        return lambda: QuantizedCache(backend="quanto", config=model.config, nbits=bits)
    import kivi

    return lambda: kivi.KiviCache(model.config, kivi.KiviConfig(k_bits=bits, v_bits=bits, **kivi_kw))


class StepClock:
    """A StoppingCriteria: generate calls it once per generated token. It synchronizes and takes a
    timestamp (the first call marks the end of prefill), and stops every row once the deadline passes."""

    def __init__(self, deadline: float, device: torch.device) -> None:
        self.deadline, self.device, self.times = deadline, device, []

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times.append(now)
        return torch.full((input_ids.shape[0],), now > self.deadline, dtype=torch.bool, device=input_ids.device)


def hf_batch_size(model, fmt: KVFormat, make_cache, prompt_len: int, total_len: int, n: int,
                  cap_gib: float, ctx) -> tuple[int, dict]:
    """Largest static batch whose bytes fit under the cap (see the module docstring)."""
    if ctx.hf_batch:
        return min(n, ctx.hf_batch), {"how": "--hf-batch"}
    if ctx.device.type != "cuda":
        return min(n, ctx.cpu_batch), {"how": "cpu default"}
    free_memory(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    reset_peak(ctx.device)
    rows = 2
    ids = torch.randint(0, 1000, (rows, prompt_len), device=ctx.device)
    extra = {cache_kwarg(model): make_cache()} if make_cache else {}
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1, **extra)
    del out, extra
    prefill_row = (torch.cuda.max_memory_allocated(ctx.device) - base) / rows
    free_memory(ctx.device)
    vocab = model.config.vocab_size
    decode_row = fmt.held_bytes(total_len) + 3 * fmt.bf16_token * total_len / fmt.layers + 4 * vocab * 4
    slack = GiB + 0.03 * cap_gib * GiB
    batch = int((cap_gib * GiB - base - slack) // max(prefill_row, decode_row))
    detail = dict(how="bytes", prefill_row_mib=round(prefill_row / 2**20, 1),
                  decode_row_mib=round(decode_row / 2**20, 1), base_gib=round(base / GiB, 2), estimate=batch)
    return max(1, min(batch, n)), detail


def run_hf(model, system: str, prompts: list[Prompt], cap_gib: float, ctx, deadline_s: float) -> dict:
    if "quanto" in system and not quanto_available():
        return {"status": "skipped: optimum-quanto is not installed (transformers' quanto backend needs it)"}
    dev = ctx.device
    fmt, make_cache = kv_format(model, system, ctx.kivi_kw), cache_factory(model, system, ctx.kivi_kw)
    kw = cache_kwarg(model)
    prompt_len = len(prompts[0].ids)
    total_len = prompt_len + max(p.new_tokens for p in prompts)
    batch, detail = hf_batch_size(model, fmt, make_cache, prompt_len, total_len, len(prompts), cap_gib, ctx)
    weights = weight_read_bytes(model)
    flops = (*decode_flops(model), ctx.flop_rate)
    from transformers import StoppingCriteria, StoppingCriteriaList

    clock_cls = type("StepClockCriteria", (StepClock, StoppingCriteria), {})
    acc = dict(wall=0.0, tokens=0, done=0, steps=0, decode_s=0.0, bound_s=0.0, compute_s=0.0, floor_s=0.0, rows=0,
               retries=0, wasted=0.0)
    sample, in_flight, i = None, 0, 0
    t_end = time.perf_counter() + deadline_s
    hard_end = t_end + deadline_s  # an out-of-memory batch's time is given back, up to twice the limit in all
    while i < len(prompts) and time.perf_counter() < t_end:
        chunk = prompts[i: i + batch]
        ids = torch.tensor([p.ids for p in chunk], device=dev)
        clock = clock_cls(t_end, dev)
        extra = {kw: make_cache()} if make_cache else {}
        t0 = time.perf_counter()
        oom = False
        try:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max(p.new_tokens for p in chunk),
                                     stopping_criteria=StoppingCriteriaList([clock]), **extra)
        except torch.OutOfMemoryError:
            oom = True
        elapsed = time.perf_counter() - t0
        del extra
        if oom:  # outside the except block, so the traceback no longer holds the batch's tensors
            free_memory(dev)
            acc["retries"] += 1
            acc["wasted"] += elapsed
            t_end = min(t_end + elapsed, hard_end)
            if batch == 1 or acc["retries"] > 6:
                raise RuntimeError(f"out of memory at batch {batch} after {acc['retries']} retries")
            batch = max(1, int(batch * 0.85))
            continue
        generated = out.shape[1] - prompt_len
        sample = sample or out[0, prompt_len: prompt_len + 8].tolist()
        del out
        acc["wall"] += elapsed
        acc["tokens"] += sum(min(p.new_tokens, generated) for p in chunk)
        acc["done"] += sum(generated >= p.new_tokens for p in chunk)
        steps = len(clock.times) - 1
        if steps > 0:
            acc["steps"] += steps
            acc["decode_s"] += clock.times[-1] - clock.times[0]
            acc["rows"] += steps * len(chunk)
            for j in range(1, steps + 1):  # every row of the batch holds prompt_len + j tokens at step j
                bound, compute, floor = step_costs(weights, len(chunk) * fmt.read_bytes(prompt_len + j), len(chunk),
                                                   len(chunk) * (prompt_len + j), ctx.bandwidth, flops)
                acc["bound_s"] += bound
                acc["compute_s"] += compute
                acc["floor_s"] += floor
        in_flight = max(in_flight, len(chunk))
        i += len(chunk)
    return dict(
        output_tokens=acc["tokens"], wall_s=acc["wall"], num_prompts_done=acc["done"], max_in_flight=in_flight,
        decode_steps=acc["steps"], decode_s=acc["decode_s"], decode_bound_s=acc["bound_s"], bound_steps=acc["steps"],
        decode_compute_s=acc["compute_s"], decode_floor_s=acc["floor_s"],
        decode_rows=acc["rows"],
        batch_size=batch, batch_plan=detail, oom_retries=acc["retries"], oom_wasted_s=round(acc["wasted"], 3),
        sample_tokens=sample,
    )


# -- our engine -------------------------------------------------------------------------------------------
def run_engine(model, system: str, prompts: list[Prompt], cap_gib: float, ctx, deadline_s: float) -> dict:
    with kernel_variant(system):  # a variant's kernel default holds for the build (graph capture) and the run
        return _run_engine(model, system, prompts, cap_gib, ctx, deadline_s)


def _run_engine(model, system: str, prompts: list[Prompt], cap_gib: float, ctx, deadline_s: float) -> dict:
    from pipeline.actors.engine import LLMEngine, Request, SamplingParams

    dev = ctx.device
    config = engine_config(system, ctx.kivi_kw, memory_limit_gib=cap_gib, max_batch_size=ctx.engine_max_batch,
                           cuda_graphs=ctx.cuda_graphs, fused_layers=ctx.fused_layers, decode_ahead=ctx.decode_ahead,
                           fused_projections=ctx.fused_projections, cpu_cache_gib=ctx.cpu_cache_gib)
    tokenizer = StubTokenizer()
    most = max(p.new_tokens for p in prompts)
    asked = [most if ctx.stop_early else p.new_tokens for p in prompts]
    engine = (_stopping_engine({f"r{i}": p.new_tokens for i, p in enumerate(prompts)}) if ctx.stop_early
              else LLMEngine)(model, tokenizer, config)
    requests = [Request(f"r{i}", p.ids, SamplingParams(max_new_tokens=n)) for i, (p, n) in
                enumerate(zip(prompts, asked, strict=True))]
    t0 = time.perf_counter()
    prebuilt = build_engine(engine, requests)
    build_retries = engine.stats().get("oom_retries", 0)  # builds redone for memory (before the warm-up's prefill)
    if prebuilt:  # compile the prefill path too, with one short request
        engine.generate([Request("warmup", prompts[0].ids, SamplingParams(max_new_tokens=2))])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    build_s = time.perf_counter() - t0
    build_peak = peak_gib(dev)
    engine.reset_stats()
    tokenizer.__init__()
    fmt = kv_format(model, system, ctx.kivi_kw)
    max_len = max(len(p.ids) + p.new_tokens for p in prompts)
    probe = RunnerProbe(fmt.read_table(max_len), weight_read_bytes(model), ctx.bandwidth,
                        time.perf_counter() + deadline_s, flops=(*decode_flops(model), ctx.flop_rate))
    completions, aborted = None, False
    t0 = time.perf_counter()
    with instrumented_runner(probe):
        try:
            completions = engine.generate(requests)
        except TimeUp:
            aborted = True
    wall = time.perf_counter() - t0
    stats = engine.stats()
    if completions is not None:
        ok = [c for c in completions if c.finish_reason != "error"]
        errors = [c.error for c in completions if c.finish_reason == "error"]
        tokens, done = sum(len(c.token_ids) for c in ok), len(ok)
        short = sum(len(c.token_ids) != p.new_tokens for c, p in zip(completions, prompts, strict=True)
                    if c.finish_reason != "error")
        sample = completions[0].token_ids[:8] if completions else None
        ttfts = [c.ttft_s for c in ok if c.ttft_s is not None]
        mean_ttft = sum(ttfts) / len(ttfts) if ttfts else None
    else:  # stopped at the deadline: every prefill and decode row so far made one token
        tokens, done, errors, short, sample = probe.prefill_rows + probe.rows, tokenizer.finished, [], 0, None
        mean_ttft = None
    rec = dict(
        output_tokens=tokens, wall_s=wall, num_prompts_done=done, max_in_flight=stats.get("max_in_flight"),
        decode_steps=stats.get("decode_steps", 0), decode_s=stats.get("decode_s", 0.0), decode_bound_s=probe.bound_s,
        decode_compute_s=probe.compute_s, decode_floor_s=probe.floor_s,
        bound_steps=probe.steps, decode_rows=probe.rows, build_s=build_s, build_in_timed_region=not prebuilt,
        weights_read_ms=1e3 * probe.weights / ctx.bandwidth,
        build_peak_gib=build_peak, build_retries=build_retries, aborted_at_time_limit=aborted,
        oom_retries=stats.get("oom_retries"), preemptions=stats.get("preemptions"),
        recomputed_tokens=stats.get("recomputed_tokens"), num_slots=stats.get("num_slots"),
        num_pages=stats.get("num_pages"),
        workspace_gib=engine.plan.workspace_bytes / GiB if getattr(engine, "plan", None) else None,
        kv_cache_gib=stats.get("kv_cache_bytes", 0) / GiB, kv_cache_bf16_equiv_gib=stats.get("kv_cache_bytes_bf16", 0)
        / GiB, request_errors=len(errors), first_request_error=errors[0] if errors else None,
        wrong_length_completions=short, mean_ttft_s=mean_ttft, sample_tokens=sample, engine_stats=stats,
        decode_routes=_routes(engine),
    )
    del engine, completions
    return rec


def _stopping_engine(stop_at: dict[str, int]):
    """An LLMEngine whose rows end after stop_at[request_id] tokens, as a model's EOS would end them (bench_engine
    --stop-early; random weights never say EOS), while their requests ask for more."""
    from pipeline.actors.engine import LLMEngine

    class StoppingEngine(LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.eos_ids = self.eos_ids or {-1}  # an EOS no row writes: rows may stop early (page growth holds them)

        def _advance(self, seqs, tokens, now):
            super()._advance(seqs, tokens, now)
            for seq in seqs:
                if not seq.finish_reason and len(seq.output) >= stop_at.get(seq.request.request_id, 1 << 30):
                    seq.finish_reason = "stop"
                    self._finish(seq, now)

    return StoppingEngine


def _routes(engine) -> dict:
    """Buckets whose decode steps ran in a wider graph (model_runner.route_buckets): {bucket: rows}."""
    runner = getattr(engine, "runner", None)
    return {str(b): w for b, w in runner.route.items() if w != b} if runner is not None else {}
