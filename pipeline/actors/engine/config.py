"""The engine's settings: one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kivi.config import KiviConfig

CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """kivi=None runs a plain full-precision paged cache (the baseline)."""

    kivi: KiviConfig | None = KiviConfig()
    gpu_memory_utilization: float = 0.90
    memory_limit_gib: float | None = None  # cap on device memory, overriding utilization * total
    max_batch_size: int = 256
    max_model_len: int | None = None
    max_prefill_tokens: int = 16384
    page_size: int = 128  # pages of the full-precision cache (the KIVI cache uses kivi.page_size)
    # True: a sequence that may stop early (an EOS it does not ignore, or a stop string) takes pages as it grows, as
    # in vLLM; the plan sizes its slots for such sequences by growth_plan_share (below), a growing sequence is
    # admitted while the growing ones in flight are projected to fit (at the share of max_new_tokens that finished
    # rows generated), and when a step finds no page free the newest sequences give theirs back and are prefilled
    # again later from prompt + output (preemptions, in the stats). Sequences that cannot stop early (ignore_eos, or
    # a model without EOS, as in the benchmarks) reserve their whole length, as every sequence does when False.
    # On by default since the thirty-third session: on the H200 (Llama-2-7B, 40 GiB) it gained engine-bf16 12% with
    # EOS-like stops (workload d, 25 -> 33 rows, no preemption) and lost nothing where every such row runs to
    # max_new_tokens (b); KIVI-2's width follows growth_plan_share (below; engine-20261202-h200-page-growth-*.json).
    # The first form, which grew every row and admitted by the prefill's pages alone, lost 6-7% on b.
    page_growth: bool = True
    # with page_growth: the share of max_new_tokens the memory plan sizes a growing sequence's slot for (its prompt
    # + share x its new tokens), or None: 0.5 for caches whose slots hold no memory of their own (the full-precision
    # cache), 1.0 (whole lengths) for KIVI, whose every slot holds a full-precision ring (R tokens: 64 MiB for
    # Llama-2-7B). Slots planned for half lengths ran d's EOS-like stops 4% faster over KIVI-2 and e's rows that all
    # ran to max_new_tokens 9% slower (79 rows against 96: the rings of the slots the plan added took their pages;
    # engine-20261202-h200-page-growth-final-*.json), so KIVI plans for whole lengths unless told.
    growth_plan_share: float | None = None
    cuda_graphs: bool = True
    tune_buckets: bool = True  # with cuda_graphs: time wider graphs and run a bucket in the fastest (model_runner)
    fused_layers: bool = True  # RMSNorm and rotary kernels in the model's forward (CUDA, supported model types)
    decode_ahead: bool = True  # greedy batches: launch step i+1 before the host reads step i's tokens
    fused_projections: bool = True  # with fused_layers: one matmul for q/k/v and one for gate/up
    # with fused_projections: SwiGLU MLPs' act_fn(gate) * up as one kernel (kivi_kernels/silu_mul); on the H200 3% more
    # tokens/s on workload b, 6% faster prefill (engine-20261130-h200-silu-mul.json)
    fused_silu_mul: bool = True
    # with fused_layers: a prefill's MLPs on this many tokens at a time (None: whole), so the activation workspace
    # set aside from the cache holds one chunk's gate/up products (Llama-2-7B at 16,384 prefill tokens: ~1 GiB less)
    mlp_chunk_tokens: int | None = 4096
    # the dtype the cache keeps full-precision tokens in (KIVI's ring and scales, or the plain cache's pages), or None:
    # the model's. A float32 model on a CPU without bf16 arithmetic (pipeline.actors.actor.resolve_dtypes) keeps a
    # bfloat16 cache: float32 matmuls there, the bytes of a bf16 run's cache
    cache_dtype: str | None = None
    cpu_cache_gib: float = 1.0  # KV memory on a CPU-only machine: the cache, and a chunked prefill's scratch
    # prefill two dummy prompts in free slots during the build, so that the prefill path's Triton kernels compile
    # there and not in the first rows' time to first token (1.5-2.5 s for SmolLM2 on an H200); None: on CUDA
    warm_prefill: bool | None = None

    def warm_up_lengths(self, max_model_len: int, on_cuda: bool) -> list[int]:
        """Prompt lengths of the build's warm-up prefill ([] when warm_prefill is off, or None off CUDA): one past
        the first flushes and one a multiple of 16 (Triton compiles those apart), within the prefill budget."""
        if not (self.warm_prefill or (self.warm_prefill is None and on_cuda)):
            return []
        # the bf16 cache has no groups: 16 stands in for one, so the first prompt still ends off a multiple of 16
        kc = self.kivi
        ring, group = (kc.residual_length, kc.group_size) if kc is not None else (self.page_size, 16)
        cap = min(max_model_len - 1, self.max_prefill_tokens // 2)
        return [min(cap, ring + 2 * group + 3), min(cap, 2 * ring)]

    def torch_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache's dtype for a model of `model_dtype` (cache_dtype, or the model's where None)."""
        return model_dtype if self.cache_dtype is None else CACHE_DTYPES[self.cache_dtype]

    def __post_init__(self) -> None:
        if self.cache_dtype is not None and self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {sorted(CACHE_DTYPES)} or None, got {self.cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.mlp_chunk_tokens is not None and (not isinstance(self.mlp_chunk_tokens, int)
                                                  or self.mlp_chunk_tokens < 1):
            raise ValueError(f"mlp_chunk_tokens must be a positive integer or None, got {self.mlp_chunk_tokens!r}")
        for name in ("max_batch_size", "max_prefill_tokens", "page_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        share = self.growth_plan_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ValueError(f"growth_plan_share must be in (0, 1] or None, got {self.growth_plan_share!r}")
        if self.memory_limit_gib is not None and self.memory_limit_gib <= 0:
            raise ValueError(f"memory_limit_gib must be positive, got {self.memory_limit_gib!r}")
