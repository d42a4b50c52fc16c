"""The engine's cache: fixed pools allocated once, batch metadata written by the engine each step.

It is the same transformers `Cache` mechanics as `kivi.KiviCache` (so the model runs through the
same registered attention function), but nothing grows or moves after allocation: tensor
addresses stay fixed, which is what CUDA graph replays need.
"""

from __future__ import annotations

import torch

import kivi_kernels
from kivi.cache import KiviLayer, PagedKVCache, resolve_backend
from kivi.models import kv_shape
from kivi.storage import BatchMeta, FullStorage, QuantizedStorage
from pipeline.actors.engine.config import EngineConfig


def engine_storage(config: EngineConfig, device: torch.device) -> FullStorage | QuantizedStorage:
    """The storage format of an engine (EngineConfig `config`): KIVI's packed pages and ring, or full-precision
    pages when config.kivi is None; Triton kernels on a GPU, the PyTorch references on a CPU."""
    kivi = config.kivi
    if kivi is None:
        return FullStorage(config.page_size, kivi_kernels.get_ops("triton" if device.type == "cuda" else "reference"))
    kivi = resolve_backend(kivi, device, allow_interpreter=False)
    return QuantizedStorage(kivi, kivi_kernels.get_ops(kivi.backend))


class EngineCache(PagedKVCache):
    """Preallocated pools of `num_pages` pages and `num_slots` slots for every layer, in `dtype` (the cache's: its
    full-precision tokens and scales); a chunked prompt's scratch holds the model's keys in `scratch_dtype` (default
    `dtype`)."""

    counts_positions = False

    def __init__(self, config, storage, *, num_slots: int, num_pages: int, max_pages_per_seq: int,
                 dtype: torch.dtype, device: torch.device, scratch_dtype: torch.dtype | None = None) -> None:
        super().__init__(config, lambda _device: storage)
        self.storage = storage
        _, kv_heads, head_dim = kv_shape(config)
        for layer in self.layers:
            layer.num_heads, layer.head_dim, layer.dtype, layer.device = kv_heads, head_dim, dtype, device
            layer.tensors = storage.allocate_pages(num_pages, kv_heads, head_dim, dtype, device)
            layer.tensors.update(storage.allocate_slots(num_slots, kv_heads, head_dim, dtype, device))
            layer.is_initialized = True
        self.block_table = torch.zeros(num_slots, max_pages_per_seq, dtype=torch.int32, device=device)
        self.page_bytes = storage.page_bytes(kv_heads, head_dim, dtype) * len(self.layers)
        self.slot_bytes = storage.slot_bytes(kv_heads, head_dim, dtype) * len(self.layers)
        self.bf16_token_bytes = 2 * kv_heads * head_dim * 2 * len(self.layers)
        self.content_bytes = lambda seq_len: storage.content_bytes(seq_len, kv_heads, head_dim, dtype) * len(
            self.layers)
        self.scratch_dtype = scratch_dtype or dtype
        self.mode = "decode"
        self.prefill_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.scratch: list[tuple[torch.Tensor, torch.Tensor]] = []  # full-precision K/V of a chunked prompt
        self.chunk_start = 0

    def allocate(self, layer: KiviLayer) -> None:
        raise RuntimeError("EngineCache pools are allocated up front")

    def is_prefill(self, layer: KiviLayer, q_len: int) -> bool:
        return self.mode == "prefill"

    def set_prefill(self, slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> None:
        """slots/starts/lengths: [B] int32 on the cache device (rows of a padded prefill batch)."""
        self.mode = "prefill"
        self.meta = BatchMeta(slots=slots, seq_lens=lengths, block_table=self.block_table)
        self.prefill_rows = (starts, lengths)

    def set_decode(self, slots: torch.Tensor, seq_lens: torch.Tensor, table_pages: int | None = None) -> None:
        """slots/seq_lens: [B] int32 (seq_lens include the token being decoded; 0 = padding row). table_pages: the
        kernels see the block table's first table_pages pages (a view: the launchers size their work by its
        width), which must then hold every row (seq_len <= table_pages * page_size)."""
        self.mode = "decode"
        table = self.block_table if table_pages is None else self.block_table[:, :table_pages]
        self.meta = BatchMeta(slots=slots, seq_lens=seq_lens, block_table=table)

    def set_chunk(self, slot: torch.Tensor, start: int, end: int, prompt_len: int) -> None:
        """Prefill tokens [start, end) of one long prompt: they attend to [0, end) in full precision.

        slot: [1] int32; prompt_len: the prompt's length, which the first chunk sizes the scratch by (a
        max_model_len-wide scratch would be 16 GiB for Llama-3-8B at 131,072 positions). Each chunk stores the
        whole prefix [0, end) again (the same groups give the same codes), so the cache is complete after the last
        chunk.
        """
        if not self.scratch:
            layer = self.layers[0]
            shape = (1, layer.num_heads, prompt_len, layer.head_dim)  # this prompt's, not max_model_len's
            self.scratch = [(torch.empty(shape, dtype=self.scratch_dtype, device=layer.device),
                             torch.empty(shape, dtype=self.scratch_dtype, device=layer.device)) for _ in self.layers]
        length = torch.tensor([end], dtype=torch.int32, device=slot.device)
        self.set_prefill(slot, torch.zeros_like(length), length)
        # the layers' seen_tokens stay 0, so transformers sizes its mask as the chunk's alone and, with no padding,
        # builds none: chunk_attention applies the causal mask over the prefix itself (a [T, S] mask would hold
        # 512 MiB at 16,384 tokens of a 32,768-token prefix)
        self.mode, self.chunk_start = "chunk", start

    def end_chunks(self) -> None:
        """Back to decode mode; the scratch (a bf16 copy of one long prompt's K/V) is given back."""
        self.mode = "decode"
        self.scratch = []

    def update_layer(self, layer: KiviLayer, key: torch.Tensor, value: torch.Tensor):
        if self.mode != "chunk":
            return super().update_layer(layer, key, value)
        k_buf, v_buf = self.scratch[layer.layer_idx]  # [1, H, prompt_len, D]
        end = self.chunk_start + key.shape[2]
        k_buf[:, :, self.chunk_start : end] = key
        v_buf[:, :, self.chunk_start : end] = value
        keys, values = k_buf[:, :, :end], v_buf[:, :, :end]
        keys.kivi_step = (layer, "chunk")  # attention over the prefix, then the store of [0, end)
        return keys, values

    def begin_prefill(self, layer: KiviLayer, attention_mask, key: torch.Tensor):
        return self.prefill_rows

    def begin_decode(self, layer: KiviLayer) -> None:
        pass

    def set_pages(self, slot: int, pages: list[int]) -> None:
        if pages:
            self.block_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
