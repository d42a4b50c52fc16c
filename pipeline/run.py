"""One generation job: check everything, then read -> map_batches(actor pool) -> per-shard writes."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from pipeline import resume, stats
from pipeline.actors.actor import StreamingGenerateActor, model_location
from pipeline.config import JobConfig
from pipeline.io import InputPlan, Shard, content_digest, plan_input, read_dataset
from pipeline.paths import check_output_apart
from pipeline.progress import LiveCounter, Progress
from pipeline.sink import OutputStore, ShardAssembler

log = logging.getLogger("kivi_ray")
CALLS_PER_ACTOR = 2  # map_batches calls an actor runs at once, sharing its engine (StreamingGenerateActor)


def run(job: JobConfig) -> dict[str, Any]:
    """Run the job; returns the summary. ValueError (before Ray starts) for bad input or settings;
    RuntimeError when generation itself fails."""
    start = time.perf_counter()
    plan = plan_input(job)
    check_model(job)
    store = OutputStore(job.output, job.s3_endpoint_url)
    check_output_apart(plan, job.output, store.fs, store.root)
    store.prepare()
    complete, input_data = store.completed(), {s.name: s.data for s in plan.shards}
    done = set() if job.overwrite else complete & set(input_data)
    todo = [s for s in plan.shards if s.name not in done]
    settings = resume.row_settings(job, plan)
    recorded = resume.shard_settings(store, sorted(complete))
    resume.check_ours(recorded, job.output, input_data)  # a file of another program where a shard of ours goes
    kept = complete - {s.name for s in todo}  # every complete shard this run does not redo
    by_name = {s.name: s for s in plan.shards}
    known = store.digests()
    store.keep_digests(known, resume.check_resume(settings, {n: recorded[n] for n in sorted(kept)}, job.output,
                                                  input_data, digest=lambda name: content_digest(plan, by_name[name]),
                                                  known=known))
    log.info(
        "input %s: %d shards, %d rows (prompts from %s%s); %d shards already complete in %s, %d to do",
        job.input or "<sample prompts>",
        len(plan.shards),
        sum(s.num_rows for s in plan.shards),
        {"template": "--prompt-template"}.get(plan.source, f"column '{plan.source}'"),
        ", as chat turns" if job.renders_chat(plan.source) else "",
        len(plan.shards) - len(todo),
        job.output,
        len(todo),
    )
    if not todo:  # the output's summary stays that of the run that made it
        log.info("nothing to do: every shard is complete in %s (--overwrite redoes them)", job.output)
        return stats.summarize([], [], time.perf_counter() - start, len(plan.shards), shards_done=0)
    assembler = ShardAssembler(plan, todo, store, job_info(job), settings=settings)
    try:
        if any(s.num_rows for s in todo):
            _generate(job, plan, [s for s in todo if s.num_rows], assembler)
    except ValueError as e:  # raised inside the actors: the job ran and failed (not a bad-input error)
        raise RuntimeError(f"generation failed: {e}") from e
    finally:
        assembler.close()
    assembler.finish()
    summary = stats.summarize(
        assembler.stats_rows, assembler.ttfts_ms, time.perf_counter() - start, len(plan.shards) - len(todo),
        shards_done=assembler.shards_written, tpots_ms=assembler.tpots_ms,
    )
    log.info("%s", stats.format_summary(summary))
    store.write_text(store.summary_path(), stats.summary_json(summary, job.to_dict()))
    log.info("wrote %d shards to %s (summary: %s)", assembler.shards_written, job.output, store.summary_path())
    return summary


def check_model(job: JobConfig) -> None:
    """The model's config must load (a local folder with its GGUF file, or a hub id the driver can reach) and,
    with the KIVI cache, be a supported model type."""
    import kivi

    model, gguf_file = model_location(job)  # "~" already expanded
    if gguf_file is not None and not os.path.isfile(os.path.join(model, gguf_file)):
        raise ValueError(f"gguf_file {gguf_file!r} not found in model folder {model!r}")
    if os.path.isfile(model):
        raise ValueError(f"model {model!r} is a file: give a model folder or a .gguf file")
    if model.startswith((".", "/")) and not os.path.isdir(model):
        raise ValueError(f"model folder {model!r} not found")
    try:
        config = kivi.models.model_config(model, gguf_file).get_text_config()
    except (OSError, ValueError) as e:  # no such hub id, no network, no config.json: one line, before Ray starts
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot load the config of model {model!r}: {reason}") from None
    if job.kivi:
        kivi.check_supported(config)
        job.kivi_config().check_head_dim(kivi.models.kv_shape(config)[2])


def job_info(job: JobConfig) -> dict[str, Any]:
    """The job-level columns of every stats row."""
    model, gguf_file = model_location(job)
    return {
        "kv_bits": job.kv_bits if job.kivi else {"float32": 32}.get(job.model_dtype(), 16),  # plain: the model's
        "group_size": job.group_size if job.kivi else None,
        "residual_length": job.residual_length if job.kivi else None,
        "model": os.path.join(model, gguf_file) if gguf_file else model,
    }


def init_ray() -> None:
    """Join the cluster (inside a job or with RAY_ADDRESS set), or start an embedded local Ray."""
    import ray

    if not ray.is_initialized():
        ray.init(log_to_driver=True)


def cpu_share(cpus: float, actors: int) -> float:
    """CPUs each actor of a CPU-only pool reserves: one, unless `actors` of them would leave no whole CPU for
    the read and write tasks (each asks for one; the pool would wait forever for them): then an equal share of
    all but one (none on a one-CPU machine: Ray schedules an actor that reserves no CPU)."""
    share = min(1.0, max(cpus - 1, 0) / actors)
    if share < 1.0:
        log.warning("%d actors on %g CPUs: each reserves %.2f CPU so that read and write tasks keep one",
                    actors, cpus, share)
    return share


def rows_per_call(total: int, pool: int, max_batch_size: int) -> int:
    """Rows per actor call when --batch-size is not given: a full engine batch, so that with CALLS_PER_ACTOR
    calls in flight the engine always has a call's rows waiting, unless that would leave call slots of the pool
    without a call. Slots, not actors: Ray Data gives an actor that is ready first as many calls as it runs at
    once, so with one call per actor a small input's calls could all go to the first actors while the others
    load."""
    return max(1, min(max_batch_size, math.ceil(total / (pool * CALLS_PER_ACTOR))))


def actor_pool(size: int) -> dict[str, Any]:
    """map_batches arguments of a pool of `size` actors that each run CALLS_PER_ACTOR calls at once (the engine
    admits the next call's rows while the last ones decode)."""
    import inspect

    import ray.data

    pool = dict(size=size, max_tasks_in_flight_per_actor=CALLS_PER_ACTOR)
    if "max_concurrent_calls_per_actor" in inspect.signature(ray.data.ActorPoolStrategy).parameters:
        return {"compute": ray.data.ActorPoolStrategy(**pool, max_concurrent_calls_per_actor=CALLS_PER_ACTOR)}
    return {"compute": ray.data.ActorPoolStrategy(**pool), "max_concurrency": CALLS_PER_ACTOR}  # older Ray


def _generate(job: JobConfig, plan: InputPlan, shards: list[Shard], assembler: ShardAssembler) -> None:
    import ray
    import ray.data

    init_ray()
    ray.data.DataContext.get_current().execution_options.preserve_order = True  # the assembler counts rows
    total = sum(s.num_rows for s in shards)
    gpus, cpus = int(ray.cluster_resources().get("GPU", 0)), ray.cluster_resources().get("CPU", 1)
    per_actor = job.gpus_per_actor
    pool = job.actors or int(gpus / per_actor) or 1
    batch_size = job.batch_size or rows_per_call(total, pool, job.max_batch_size)
    size = min(pool, math.ceil(total / batch_size))
    resources = {"num_gpus": per_actor} if gpus else {"num_cpus": cpu_share(cpus, size)}
    if gpus and size * per_actor > gpus:
        log.warning("%d actors of %g GPU each on a cluster with %d GPUs: the rest wait for GPUs", size, per_actor, gpus)
    log.info("actor pool: %d actors, each with %s; %d rows in batches of %d", size, resources, total,
             min(batch_size, total))
    # streaming repartition into blocks of one actor call each: actors take blocks, so a few large
    # blocks (small inputs are read into one) would leave the rest of the pool idle
    counter = ray.remote(num_cpus=0)(LiveCounter).remote()  # the engines' live rows and tokens
    ds = read_dataset(plan, shards).repartition(target_num_rows_per_block=batch_size).map_batches(
        StreamingGenerateActor,
        fn_constructor_kwargs={"job": job.to_dict(), "source": plan.source, "progress": counter},
        **actor_pool(size),
        batch_size=batch_size,
        batch_format="pyarrow",
        **resources,
    )
    live = lambda: ray.get(counter.totals.remote(), timeout=max(1.0, job.log_interval_s / 2))  # noqa: E731
    with Progress(total, job.log_interval_s, live) as progress:
        assembler.on_row_batch = progress.add
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            assembler.add(batch)
