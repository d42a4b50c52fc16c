"""The engine's parts for one cache plan: cache, block tables, scheduler and model runner (with its CUDA graphs)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import kernels
from kivi.fused import FUSED_MODEL_TYPES, FusedLayers
from pipeline.actors.engine.block_manager import BlockManager
from pipeline.actors.engine.config import EngineConfig
from pipeline.actors.engine.kv_cache import EngineCache, engine_storage
from pipeline.actors.engine.memory import CachePlan, check_headroom, plan_for, reserved_bytes
from pipeline.actors.engine.model_runner import ModelRunner
from pipeline.actors.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    plan: CachePlan
    cache: EngineCache
    blocks: BlockManager
    scheduler: Scheduler
    runner: ModelRunner


def allocate_parts(model, config: EngineConfig, total_lens: list[int], max_model_len: int, budget_scale: float,
                   final: bool, prefill_lens: list[int] | None = None) -> EngineParts:
    """Plan the cache for sequences of these total lengths (and prefills: the longest that goes through in chunks
    has its scratch set aside) at budget_scale of the memory budget, allocate it and
    capture the decode graphs. Raises memory.HeadroomShortfall (only when not final) if the graphs' pool left less
    than the plan's prefill workspace, and torch.OutOfMemoryError as the device does (memory.build_shrinking retries
    both)."""
    param = next(model.parameters())
    storage, fused = engine_storage(config, param.device), fused_layers(model, config, param.device)
    plan = plan_for(model, storage, config, total_lens, max_model_len, fused, budget_scale=budget_scale,
                    prefill_lens=prefill_lens)
    cache = EngineCache(model.config, storage, num_slots=plan.num_slots, num_pages=plan.num_pages,
                        max_pages_per_seq=max(1, storage.pages_for(max_model_len)),
                        dtype=config.torch_cache_dtype(param.dtype), device=param.device, scratch_dtype=param.dtype)
    blocks = BlockManager(plan.num_slots, plan.num_pages, storage.pages_for)
    graphs = config.cuda_graphs and param.device.type == "cuda"
    runner = ModelRunner(model, cache, plan.num_slots, use_cuda_graphs=graphs,
                         layers=fused, tune_buckets=config.tune_buckets)
    check_headroom(plan, reserved_bytes(param.device), strict=not final)  # the graphs' pool is known now
    return EngineParts(plan, cache, blocks, Scheduler(blocks, config.max_prefill_tokens), runner)


def fused_layers(model, config: EngineConfig, device: torch.device) -> FusedLayers | None:
    """The RMSNorm/rotary (and projection, SiLU-and-multiply) patches for this model, or None where they do not
    apply: off in the config, not on CUDA, or a model_type without them (transformers' ops run)."""
    model_type = getattr(model.config, "model_type", None)
    if not (config.fused_layers and device.type == "cuda"):
        return None
    if model_type not in FUSED_MODEL_TYPES:
        log.info("no fused RMSNorm/rotary kernels for model_type %r: transformers' ops run", model_type)
        return None
    return FusedLayers(model, kernels.get_ops("triton"), projections=config.fused_projections,
                       mlp_chunk_tokens=config.mlp_chunk_tokens, silu_mul=config.fused_silu_mul)
