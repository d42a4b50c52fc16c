"""How many sequences and cache pages fit: the memory plan behind the batch width."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from kivi.models import kv_shape

log = logging.getLogger(__name__)
BUILD_ATTEMPTS = 3  # cache builds tried after CUDA out-of-memory errors, each BUILD_SHRINK of the last's budget
BUILD_SHRINK = 0.85
HEADROOM_PAD = 1.1  # a build short of its workspace gives up this many times its deficit of cache budget
# and at least this share of the budget: on the H200 successive builds' graph pools differ by ~0.1 GiB, and builds
# 0.10 GiB short were 0.10 GiB short again after giving up 0.11 (a 18.7 GiB cache; the probe ran three builds)
HEADROOM_FLOOR_SHARE = 0.01


@dataclass(frozen=True)
class CachePlan:
    num_slots: int  # sequences in flight at most
    num_pages: int
    budget_bytes: int  # what the cache was allowed to take
    workspace_bytes: int  # measured activation peak set aside
    limit_bytes: int = 0  # the whole limit the plan split (0: none given, nothing for check_headroom to check)
    scratch_bytes: int = 0  # set aside for a chunked prompt's full-precision keys and values (scratch_bytes())


class HeadroomShortfall(Exception):
    """A build that fits by the plan's numbers but leaves less than the measured workspace free once its decode
    graphs are captured (their memory pool is only known then): the next build needs `deficit_bytes` less."""

    def __init__(self, deficit_bytes: int, budget_bytes: int) -> None:
        super().__init__(f"the build left {deficit_bytes / 2**30:.2f} GiB less than the prefill workspace (and a "
                         "chunked prompt's scratch) free")
        self.deficit_bytes, self.budget_bytes = deficit_bytes, budget_bytes


def measure_workspace(model, prefill_tokens: int, vocab: int, max_batch: int) -> int:
    """Peak activation bytes of a prefill forward of `prefill_tokens` tokens (no cache) plus decode logits.

    The forward's blocks go back to the device afterwards (empty_cache): without expandable segments the caching
    allocator kept ~9.6 GiB of them reserved (Llama-2-7B, 16,384 tokens), the cache's pools were then carved out of
    them with 3.1 GiB lost to split blocks, and a build under a per-process memory fraction of 40 GiB ran out of
    memory (benchmarks/profile_step.py, which does not set expandable segments as the actor does)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.zeros(1, prefill_tokens, dtype=torch.long, device=device)
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        model.get_output_embeddings()(hidden[:, -1])
    del hidden
    peak = torch.cuda.max_memory_allocated() - before
    torch.cuda.empty_cache()
    return peak + 2 * max_batch * vocab * 4  # decode logits in fp32, twice (graph output + sampling)


PAGE_SLACK = 0.0  # pages a sequence is charged beyond its exact count in the slot plan (0.5 before: mean_pages)


def mean_pages(total_lens: list[int], pages_for) -> float:
    """Mean pages a sequence reserves (the block manager reserves its whole length's pages at admission): exact for
    these lengths, each rounded up to whole pages. The plan used pages_for(mean length) + 0.5 before, which
    charged equal-length batches half a page a sequence they never use: on workload a at 40 GiB (Llama-2-7B,
    KIVI-2) 238 slots held 836 pages of 12 MiB where 714 could ever be used (engine-20261130-h200-v20.json)."""
    if not total_lens:
        raise ValueError("mean_pages needs at least one sequence length")
    return sum(pages_for(n) for n in total_lens) / len(total_lens) + PAGE_SLACK


def scratch_bytes(prefill_lens: list[int], max_prefill_tokens: int, layers: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """Bytes of the full-precision keys and values that a prefill in chunks keeps for all its tokens
    (EngineCache.set_chunk), for the longest of `prefill_lens` (a prompt, or the prompt and output that a preempted
    row's rebuild prefills) that is longer than max_prefill_tokens (0 if none is: none goes through in chunks)."""
    chunked = [n for n in prefill_lens if n > max_prefill_tokens]
    if not chunked:
        return 0
    return 2 * layers * kv_heads * max(chunked) * head_dim * dtype.itemsize


def plan_cache(*, limit_bytes: int, used_bytes: int, workspace_bytes: int, page_bytes: int, slot_bytes: int,
               pages_per_seq: float, max_batch: int, min_pages: int, max_pages_per_slot: int,
               budget_scale: float = 1.0, scratch: int = 0) -> CachePlan:
    """Split the bytes left under `limit_bytes` (times budget_scale: a build retried after running out of memory)
    into slots and pages, after the weights (`used_bytes`), the activations (`workspace_bytes`) and a chunked
    prompt's scratch (`scratch`, scratch_bytes).

    Sequences of about `pages_per_seq` pages each decide how many slots are worth having, as long as
    `min_pages` pages (a sequence of the longest length) are left; every byte not spent on slots becomes
    pages, up to what the slots could ever hold.
    Raises ValueError if not even one sequence fits.
    """
    if not 0 < budget_scale <= 1:
        raise ValueError(f"budget_scale must be in (0, 1], got {budget_scale!r}")
    margin = limit_bytes // 50 if workspace_bytes else 0  # allocator fragmentation and graph pools on a GPU
    budget = int((limit_bytes - used_bytes - workspace_bytes - scratch - margin) * budget_scale)
    per_seq = slot_bytes + pages_per_seq * page_bytes
    num_slots = int(max(1, min(max_batch, budget // max(per_seq, 1))))
    # fewer slots rather than fewer pages than one sequence of the longest length needs
    num_slots = int(max(1, min(num_slots, (budget - min_pages * page_bytes) // max(slot_bytes, 1))))
    num_pages = int((budget - num_slots * slot_bytes) // max(page_bytes, 1))
    num_pages = min(num_pages, num_slots * max_pages_per_slot)  # more could never be used
    if budget <= 0 or num_pages < min_pages:
        scaled = f", {budget_scale:.0%} of it after a build ran short of memory" if budget_scale < 1 else ""
        raise ValueError(
            f"the KV cache does not fit: {budget / 2**30:.2f} GiB left for it under a limit of "
            f"{limit_bytes / 2**30:.2f} GiB (weights {used_bytes / 2**30:.2f} GiB, activations "
            f"{workspace_bytes / 2**30:.2f} GiB, a chunked prompt's scratch {scratch / 2**30:.2f} GiB{scaled}); "
            f"one sequence needs {min_pages} pages of {page_bytes} bytes"
        )
    return CachePlan(num_slots=num_slots, num_pages=num_pages, budget_bytes=budget, workspace_bytes=workspace_bytes,
                     limit_bytes=limit_bytes, scratch_bytes=scratch)


def plan_for(model, storage, config, total_lens: list[int], max_model_len: int, fused=None,
             budget_scale: float = 1.0, prefill_lens: list[int] | None = None,
             chunk_tokens: int | None = None) -> CachePlan:
    """The cache plan of an engine (EngineConfig `config`, its cache `storage`) for sequences of these total
    lengths. On a GPU the limit is memory_limit_gib, or gpu_memory_utilization of the device, less the weights
    allocated now and the measured workspace of a prefill forward (run under `fused`, as the engine's forwards
    will be); on a CPU it is cpu_cache_gib. Either way the scratch of the longest of `prefill_lens` that goes
    through in chunks is set aside (scratch_bytes) where the cache still fits beside it (else it is planned without,
    with a warning, and that prefill may fail alone); the rest is the cache's. chunk_tokens: the length past which a
    prefill goes in chunks (the scheduler's max_prefill_tokens, which a prefill's out-of-memory error lowers;
    config.max_prefill_tokens if None). budget_scale as in plan_cache."""
    param = next(model.parameters())
    layers, kv_heads, head_dim = kv_shape(model.config)
    if param.device.type == "cuda":
        total = torch.cuda.get_device_properties(param.device).total_memory
        limit = config.memory_limit_gib * 2**30 if config.memory_limit_gib else config.gpu_memory_utilization * total
        vocab = model.get_output_embeddings().weight.shape[0]
        with fused or nullcontext():
            workspace = measure_workspace(model, config.max_prefill_tokens, vocab, config.max_batch_size)
        used = torch.cuda.memory_allocated(param.device)
    else:
        limit, workspace, used = config.cpu_cache_gib * 2**30, 0, 0
    most_pages, cache_dtype = max(1, storage.pages_for(max_model_len)), config.torch_cache_dtype(param.dtype)
    plan = partial(plan_cache, limit_bytes=int(limit), used_bytes=used, workspace_bytes=workspace,
                   page_bytes=storage.page_bytes(kv_heads, head_dim, cache_dtype) * layers,
                   slot_bytes=storage.slot_bytes(kv_heads, head_dim, cache_dtype) * layers,
                   pages_per_seq=mean_pages(total_lens, storage.pages_for), max_batch=config.max_batch_size,
                   min_pages=storage.pages_for(max_model_len), max_pages_per_slot=most_pages, budget_scale=budget_scale)
    # the scratch holds the model's own keys and values (its dtype), whatever the cache keeps
    chunk_tokens = chunk_tokens or config.max_prefill_tokens
    scratch = scratch_bytes(prefill_lens or [], chunk_tokens, layers, kv_heads, head_dim, param.dtype)
    try:
        return plan(scratch=scratch)
    except ValueError:
        if not scratch:
            raise
        cache_only = plan()  # raises if the cache does not fit even alone
        log.warning("no room beside the cache for a %.2f GiB prefill scratch (a prompt past %d tokens goes in "
                    "chunks): planned without it; that prefill may run out of memory and fail alone", scratch / 2**30,
                    chunk_tokens)
        return cache_only


def reserved_bytes(device: torch.device) -> int | None:
    """What the caching allocator holds on `device` once its free blocks went back: weights, cache and the decode
    graphs' pool (None off a GPU, where the plan's limit is the cache alone)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def check_headroom(plan: CachePlan, reserved: int | None, strict: bool = True) -> None:
    """Raise HeadroomShortfall (strict; else log a warning) if a build holding `reserved` bytes (reserved_bytes;
    None: nothing to check) leaves less than the plan's workspace free under its limit. The plan's 2% margin was
    meant to hold the graphs' pool; at 512 slots of Llama-3-8B under an 80 GiB cap it did not, and the first
    prefill of workloads a, b, d and e ran out of memory (engine-20261130-h200x2-llama3-80-*.json)."""
    if reserved is None or not plan.limit_bytes:
        return
    free, needed = plan.limit_bytes - reserved, plan.workspace_bytes + plan.scratch_bytes
    if free < needed:
        short = HeadroomShortfall(needed - free, plan.budget_bytes)
        if strict:
            raise short
        log.warning("%s; prefills that run out of memory will be retried smaller", short)


def scratch_room(plan: CachePlan, reserved: int | None) -> int:
    """Bytes a chunked prefill's scratch may take in a build holding `reserved` bytes (reserved_bytes): the plan's
    scratch, or on a GPU all that its limit leaves beside the prefill workspace, if that is more."""
    if reserved is None or not plan.limit_bytes:
        return plan.scratch_bytes
    return max(plan.scratch_bytes, plan.limit_bytes - reserved - plan.workspace_bytes)


def build_shrinking(build: Callable[[float, bool], None], release: Callable[[bool], None]) -> None:
    """build(budget_scale, final) from 1.0; after a CUDA out-of-memory error again at BUILD_SHRINK times the last
    scale (the plan's bytes are what fits by the numbers, but fragmentation, graph pools or another process on the
    GPU can take more), and after a HeadroomShortfall (which build raises only when not final) with its deficit
    (times HEADROOM_PAD, and at least HEADROOM_FLOOR_SHARE of the budget) taken off the budget. After a failure
    release(retrying) drops what the attempt allocated, and its memory goes back to the device once the error's
    frames are gone; after BUILD_ATTEMPTS
    out-of-memory failures a CUDA out-of-memory error with the last one's message is raised (not the error itself:
    its traceback would keep the failed cache alive)."""
    scale = 1.0
    for attempt in range(BUILD_ATTEMPTS):
        final = attempt == BUILD_ATTEMPTS - 1
        try:
            return build(scale, final)
        except HeadroomShortfall as short:
            message = str(short)
            give_up = max(HEADROOM_PAD * short.deficit_bytes, HEADROOM_FLOOR_SHARE * short.budget_bytes)
            next_scale = scale * max(0.5, 1 - give_up / max(short.budget_bytes, 1))
        except torch.OutOfMemoryError as err:
            message, next_scale = str(err), scale * BUILD_SHRINK
        release(not final)
        gc.collect()  # the cache's layers refer back to it: a cycle
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if final:
            raise torch.OutOfMemoryError(f"{message} (building the KV cache, {BUILD_ATTEMPTS} tries down to "
                                         f"{scale:.0%} of its budget)")
        scale = next_scale
        log.warning("%s: building the cache again with %.1f%% of its budget", message, 100 * scale)


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """(peak allocated MiB since the last reset, device name); on a CPU, the process's peak resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.get_device_name(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, "cpu"  # Linux reports kilobytes
