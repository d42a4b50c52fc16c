"""The engine's parts for one cache plan (cache, block tables, scheduler and model runner with its CUDA graphs), and
the engine's builds of them (CacheBuilds: the first, its retries, and the rebuild for a prompt of a larger scratch)."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

import kivi_kernels
from kivi.fused import FUSED_MODEL_TYPES, FusedLayers
from kivi.models import kv_shape
from pipeline.actors.engine.block_manager import BlockManager
from pipeline.actors.engine.config import EngineConfig
from pipeline.actors.engine.kv_cache import EngineCache, engine_storage
from pipeline.actors.engine.memory import (
    CachePlan,
    build_shrinking,
    check_headroom,
    plan_for,
    reserved_bytes,
    scratch_bytes,
    scratch_room,
)
from pipeline.actors.engine.model_runner import ModelRunner
from pipeline.actors.engine.request import Sequence
from pipeline.actors.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    plan: CachePlan
    cache: EngineCache
    blocks: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    scratch_room: int  # bytes a chunked prefill's scratch may take (memory.scratch_room)


def allocate_parts(model, config: EngineConfig, total_lens: list[int], max_model_len: int, budget_scale: float,
                   final: bool, prefill_lens: list[int] | None = None, previous: Scheduler | None = None
                   ) -> EngineParts:
    """Plan the cache for sequences of these total lengths (and prefills: the longest that goes through in chunks
    has its scratch set aside) at budget_scale of the memory budget, allocate it and
    capture the decode graphs. previous: the scheduler of the build before (a rebuild's), whose limits carry over
    (Scheduler.carry_over), its max_prefill_tokens among them: prefills longer than that go in chunks
    (Scheduler.chunk_size), so the plan counts their scratch from there. Raises memory.HeadroomShortfall (only
    when not final) if the graphs' pool left less than the plan's prefill workspace, and torch.OutOfMemoryError
    as the device does (memory.build_shrinking retries both)."""
    param = next(model.parameters())
    storage, fused = engine_storage(config, param.device), fused_layers(model, config, param.device)
    plan = plan_for(model, storage, config, total_lens, max_model_len, fused, budget_scale=budget_scale,
                    prefill_lens=prefill_lens, chunk_tokens=previous.max_prefill_tokens if previous else None)
    cache = EngineCache(model.config, storage, num_slots=plan.num_slots, num_pages=plan.num_pages,
                        max_pages_per_seq=max(1, storage.pages_for(max_model_len)),
                        dtype=config.torch_cache_dtype(param.dtype), device=param.device, scratch_dtype=param.dtype)
    blocks = BlockManager(plan.num_slots, plan.num_pages, storage.pages_for)
    graphs = config.cuda_graphs and param.device.type == "cuda"
    runner = ModelRunner(model, cache, plan.num_slots, use_cuda_graphs=graphs,
                         layers=fused, tune_buckets=config.tune_buckets)
    reserved = reserved_bytes(param.device)
    check_headroom(plan, reserved, strict=not final)  # the graphs' pool is known now
    scheduler = Scheduler(blocks, config.max_prefill_tokens)
    if previous is not None:
        scheduler.carry_over(previous)
    return EngineParts(plan, cache, blocks, scheduler, runner, scratch_room(plan, reserved))


def fused_layers(model, config: EngineConfig, device: torch.device) -> FusedLayers | None:
    """The RMSNorm/rotary (and projection, SiLU-and-multiply) patches for this model, or None where they do not
    apply: off in the config, not on CUDA, or a model_type without them (transformers' ops run)."""
    model_type = getattr(model.config, "model_type", None)
    if not (config.fused_layers and device.type == "cuda"):
        return None
    if model_type not in FUSED_MODEL_TYPES:
        log.info("no fused RMSNorm/rotary kernels for model_type %r: transformers' ops run", model_type)
        return None
    return FusedLayers(model, kivi_kernels.get_ops("triton"), projections=config.fused_projections,
                       mlp_chunk_tokens=config.mlp_chunk_tokens, silu_mul=config.fused_silu_mul)


class CacheBuilds:
    """LLMEngine's set-up (a mixin over its model, config, device, dtype, max_model_len and stats_acc): the build that
    plans, allocates and captures, its out-of-memory retries, and the rebuild for a prompt whose chunked prefill
    needs a larger scratch than the build has room for."""

    def _build(self, seqs: list[Sequence], lens: tuple[list[int], list[int]] | None = None,
               previous: Scheduler | None = None) -> None:
        """Plan and allocate the cache for sequences like these, then capture the decode graphs; out of memory,
        again with a smaller budget (memory.build_shrinking; each retry counts in the stats' oom_retries). Then
        the warm-up prefill (EngineConfig.warm_prefill), so that its kernels compile inside build_s. A rebuild
        (_rebuild) adds its time to build_s; time to first token still counts from the first build's end.
        lens: (plan lengths, prefill lengths) to plan for instead of the sequences' (_plan_lengths); previous: the
        scheduler before a rebuild (allocate_parts)."""
        t0, first = time.perf_counter(), self.build_s is None
        if lens is None:
            lens = self._plan_lengths(seqs)
            if not first:  # slots and pages for the mix the first build saw, every scratch planned so far or now
                lens = (self.planned_lens[0], self.planned_lens[1] + lens[1])
        build_shrinking(lambda scale, final: self._allocate(*lens, scale, final, previous), self._release)
        self.planned_lens, self.scratch_asked = lens, self._scratch_of(lens[1])
        self._warm_prefill()
        self.ready_at = time.perf_counter() if first else self.ready_at
        self.build_s = (self.build_s or 0.0) + time.perf_counter() - t0
        log.info("cache plan: %s (%d bytes/page, %d bytes/slot)", self.plan, self.cache.page_bytes,
                 self.cache.slot_bytes)

    def _scratch_short(self, seq: Sequence) -> bool:
        """Whether a waiting sequence goes through in chunks with a scratch larger than the build has room for and
        than any the build asked for: a longer prompt that came later, or a shorter one that goes in chunks only
        because a prefill's out-of-memory error lowered max_prefill_tokens. A rebuild may make room for it. For a
        scratch no larger than one the build asked for, it had set that aside or had no room for it beside the
        cache (memory.plan_for's warning), and building again would make none."""
        return self._scratch_of([seq.cached_len]) > max(self.scratch_room, self.scratch_asked)

    def _scratch_of(self, prefill_lens: list[int]) -> int:
        """memory.scratch_bytes, in the model's dtype, of the longest of these prefills that goes through in chunks:
        one longer than the scheduler's max_prefill_tokens (Scheduler.chunk_size)."""
        layers, kv_heads, head_dim = kv_shape(self.model.config)
        return scratch_bytes(prefill_lens, self.scheduler.max_prefill_tokens, layers, kv_heads, head_dim, self.dtype)

    def _rebuild(self) -> None:
        """With nothing running: plan, allocate and capture again, for the mix of lengths the first build saw (not
        the few waiting now: one long prompt alone would make a plan of few slots) with the waiting sequences'
        scratch set aside too; they keep their order, and the finished rows' share of new tokens carries over."""
        if self.scheduler.running:
            raise RuntimeError("the cache is built again only with no sequence in flight")
        old, waiting, t0 = self.scheduler, list(self.scheduler.waiting), time.perf_counter()
        log.warning("a %d-token prefill needs more scratch than the cache plan left room for: building the cache "
                    "again for the %d waiting requests", waiting[0].cached_len, len(waiting))
        previous_lens = self.planned_lens
        self._release(False)
        gc.collect()  # the cache's layers refer back to it (a cycle): gone before the new plan measures what is left
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.build_s += time.perf_counter() - t0
        try:
            self._build(waiting, previous=old)
        except (torch.OutOfMemoryError, ValueError):  # the build before fitted: it again, and the long row tries alone
            log.warning("the rebuild failed: building the cache for the lengths planned before", exc_info=True)
            self._build(waiting, previous_lens, old)
            # asked for and no room: no reason for another rebuild (the waiting rows try as they are)
            self.scratch_asked = max(self.scratch_asked, self._scratch_of([s.cached_len for s in waiting]))
        self.stats_acc["rebuilds"] += 1
        self.scheduler.waiting.extend(waiting)

    def _warm_prefill(self) -> None:
        """Dummy prompts (EngineConfig.warm_up_lengths) through the prefill path, in free slots and pages
        (BlockManager.warm_up_rows). Best effort: a failure is logged, and the first real prefill meets it again."""
        lengths = self.config.warm_up_lengths(self.max_model_len, self.device.type == "cuda")
        try:
            self.runner.warm_prefill(*self.blocks.warm_up_rows(lengths))
        except Exception:  # noqa: BLE001 - optional: the build stands, the first rows compile instead
            log.warning("warm-up prefill failed; the first rows' prefill compiles its kernels", exc_info=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _release(self, retrying: bool) -> None:
        """Drop a failed build's cache, graphs and tables (runner None: the next add() builds again)."""
        self.runner = self.cache = self.blocks = self.scheduler = self.plan = None
        self.stats_acc["oom_retries"] += retrying

    def _plan_lengths(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """(the lengths a plan sizes slots and pages for, the prefills' lengths whose longest chunked one's scratch
        it sets aside) of these sequences."""
        share = self.config.growth_plan_share
        if share is None:  # half lengths where a slot costs nothing but its pages, whole ones where it holds a ring
            ring = engine_storage(self.config, self.device).slot_bytes(1, 1, self.config.torch_cache_dtype(self.dtype))
            share = 1.0 if ring else 0.5
        # the prefills: a prompt, or where a row grows (and may be preempted) its prompt and output
        return [s.plan_len(share) for s in seqs], [s.total_len if s.grows else s.prompt_len for s in seqs]

    def _allocate(self, lens: list[int], prefills: list[int], budget_scale: float, final: bool = True,
                  previous: Scheduler | None = None) -> None:
        parts = allocate_parts(self.model, self.config, lens, self.max_model_len, budget_scale, final,
                               prefill_lens=prefills, previous=previous)
        self.plan, self.cache, self.blocks = parts.plan, parts.cache, parts.blocks
        self.scheduler, self.runner, self.scratch_room = parts.scheduler, parts.runner, parts.scratch_room

