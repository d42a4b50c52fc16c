"""KiviCache: a transformers `Cache` whose layers hold keys and values in KIVI's packed form.

Flow of one forward (see kivi/attention.py for the other half):
- prefill (empty layer): `update` returns the full-precision keys/values tagged for the attention
  function, which runs SDPA on them and then stores them (it knows the padding from the mask);
- decode (one new token per row): `update` appends the token (flushing a full residual group into
  the packed store), and the attention function runs the decode kernel over the packed cache.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import kivi_kernels
from kivi.config import KiviConfig
from kivi.models import check_supported
from kivi.storage import BatchMeta, QuantizedStorage

log = logging.getLogger(__name__)


def resolve_backend(kivi: KiviConfig, device: torch.device, allow_interpreter: bool = True) -> KiviConfig:
    """Fall back to the reference backend where Triton cannot run (a CPU, unless the Triton
    interpreter is on and allowed: it is a test tool, far too slow for real runs)."""
    usable = kivi_kernels.triton_usable(device.type) and (device.type == "cuda" or allow_interpreter)
    if kivi.backend == "triton" and not usable:
        log.info("Triton cannot run on %s here: using the reference kernels", device)
        return replace(kivi, backend="reference")
    return kivi


class KiviLayer(CacheLayerMixin):
    """One decoder layer: its pool tensors (pages and residual ring) and how many positions it has seen."""

    is_sliding = False

    def __init__(self, cache: PagedKVCache, layer_idx: int) -> None:
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.tensors: dict[str, torch.Tensor] = {}
        self.seen_tokens = 0  # positions processed, padding included (what transformers' masks count)
        self.num_heads = self.head_dim = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.num_heads, self.head_dim = key_states.shape[1], key_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.cache.allocate(self)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache.update_layer(self, key_states, value_states)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.tensors, self.seen_tokens, self.is_initialized = {}, 0, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KiviCache does not support beam search")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class PagedKVCache(Cache):
    """Shared mechanics of the paged caches: layers, storage format and the batch metadata."""

    def __init__(self, config, storage_factory) -> None:
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        check_supported(text_config)
        self._storage_factory = storage_factory
        self.storage = None
        self.meta: BatchMeta | None = None
        super().__init__(layers=[KiviLayer(self, i) for i in range(text_config.num_hidden_layers)])

    # -- hooks for subclasses -------------------------------------------------------------
    def allocate(self, layer: KiviLayer) -> None:
        raise NotImplementedError

    def begin_prefill(self, layer: KiviLayer, attention_mask, key: torch.Tensor):
        """Return (starts, lengths) int32 [B] of this prefill's rows; set self.meta."""
        raise NotImplementedError

    def begin_decode(self, layer: KiviLayer) -> None:
        """Set self.meta for a decode step (seq_lens include the new token)."""
        raise NotImplementedError

    def is_prefill(self, layer: KiviLayer, q_len: int) -> bool:
        return layer.seen_tokens == 0

    counts_positions = True  # layers count the positions they have seen (for transformers' masks)

    # -- the two halves of a layer's forward -------------------------------------------
    def storage_for(self, device: torch.device):
        if self.storage is None:
            self.storage = self._storage_factory(device)
        return self.storage

    def update_layer(self, layer: KiviLayer, key: torch.Tensor, value: torch.Tensor):
        """Called by the model right before attention. key/value: [B, H, T, D]."""
        q_len = key.shape[2]
        if self.is_prefill(layer, q_len):
            key.kivi_step = (layer, "prefill")  # the attention function stores after its SDPA
        elif q_len == 1:
            self.begin_decode(layer)
            self.storage.store_decode(layer.tensors, key[:, :, 0], value[:, :, 0], self.meta)
            key.kivi_step = (layer, "decode")
        else:
            raise NotImplementedError(
                "KiviCache: a multi-token forward on a non-empty cache (cache reuse across generate calls, "
                "assisted decoding) is not supported; start a new cache"
            )
        if self.counts_positions:
            layer.seen_tokens += q_len
        return key, value

    def store_prefill(self, layer: KiviLayer, key, value, attention_mask) -> None:
        starts, lengths = self.begin_prefill(layer, attention_mask, key)
        self.storage.store_prefill(layer.tensors, key, value, starts, lengths, self.meta)

    def attend_decode(self, layer: KiviLayer, query: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """query [B, Hq, D] -> [B, Hq, D]."""
        return self.storage.decode_attention(layer.tensors, query, self.meta, sm_scale)

    def nbytes(self) -> int:
        """Bytes of every tensor this cache holds now."""
        return sum(layer.nbytes() for layer in self.layers)


def rows_from_mask(attention_mask: torch.Tensor | None, batch: int, kv_len: int, device) -> torch.Tensor:
    """Which key positions are real tokens, from the prefill's 4D mask: bool [B, kv_len]."""
    if attention_mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, :kv_len]  # the last query sees every real key of its row
    valid = last if last.dtype == torch.bool else last == 0
    return valid.expand(batch, kv_len)


class KiviCache(PagedKVCache):
    """Drop-in KIVI cache for `model.generate(**inputs, past_key_values=KiviCache(model.config))`.

    Pages are allocated as sequences grow; padding is stripped at prefill so every row keeps only
    its real tokens. `nbytes()` is what the cache holds now, `nbytes_bf16()` what a bf16 cache
    would hold for the same tokens.
    """

    def __init__(self, config, kivi: KiviConfig | None = None, dtype: torch.dtype | None = None) -> None:
        """dtype: of the full-precision ring and the scales' base (None: the model's keys'); a float32 model can
        keep a bf16 cache, its keys and values rounded to bf16 as they are stored."""
        self.kivi = kivi or KiviConfig()
        self.dtype = dtype
        self.lengths: list[int] = []
        self.pages: list[list[int]] = []
        self.num_pages = 0

        def factory(device):
            self.kivi = resolve_backend(self.kivi, device)
            return QuantizedStorage(self.kivi, kivi_kernels.get_ops(self.kivi.backend))

        super().__init__(config, factory)

    def allocate(self, layer: KiviLayer) -> None:
        storage = self.storage_for(layer.device)
        layer.dtype = self.dtype or layer.dtype
        batch = 0 if self.meta is None else len(self.lengths)
        layer.tensors = storage.allocate_slots(batch, layer.num_heads, layer.head_dim, layer.dtype, layer.device)
        layer.tensors.update(storage.allocate_pages(0, layer.num_heads, layer.head_dim, layer.dtype, layer.device))

    def _grow(self, layer: KiviLayer, batch: int) -> None:
        """Bring the layer's pools up to self.num_pages pages and `batch` residual slots."""
        t, storage = layer.tensors, self.storage
        have = t["k_codes"].shape[0] if "k_codes" in t else 0
        if have < self.num_pages:
            new = storage.allocate_pages(self.num_pages - have, layer.num_heads, layer.head_dim,
                                         layer.dtype, layer.device)
            for name, tensor in new.items():
                t[name] = torch.cat([t[name], tensor]) if have else tensor
        if t["k_res"].shape[0] != batch:
            t.update(storage.allocate_slots(batch, layer.num_heads, layer.head_dim, layer.dtype, layer.device))

    def _assign_pages(self, device) -> None:
        changed = False
        for row, length in enumerate(self.lengths):
            while len(self.pages[row]) < self.storage.pages_for(length):
                self.pages[row].append(self.num_pages)
                self.num_pages += 1
                changed = True
        if changed or self.meta.block_table.numel() == 0:
            width = max(1, max(len(p) for p in self.pages))
            table = [p + [0] * (width - len(p)) for p in self.pages]
            self.meta.block_table = torch.tensor(table, dtype=torch.int32, device=device)

    def begin_prefill(self, layer: KiviLayer, attention_mask, key: torch.Tensor):
        if layer.layer_idx == 0:
            batch, kv_len = key.shape[0], key.shape[2]
            valid = rows_from_mask(attention_mask, batch, kv_len, key.device)
            lengths = valid.sum(-1)
            starts = valid.int().argmax(-1)
            # a real row must be one contiguous run of tokens (left or right padding around it)
            positions = torch.arange(kv_len, device=key.device)
            inside = (positions >= starts[:, None]) & (positions < (starts + lengths)[:, None])
            if not torch.equal(inside, valid):
                raise ValueError("KiviCache needs each row's real tokens to be contiguous in the attention mask")
            self.lengths = lengths.tolist()
            self.pages = [[] for _ in self.lengths]
            self.meta = BatchMeta(
                slots=torch.arange(batch, dtype=torch.int32, device=key.device),
                seq_lens=lengths.to(torch.int32),
                block_table=torch.empty(0, dtype=torch.int32, device=key.device),
            )
            self._starts = starts.to(torch.int32)
            self._assign_pages(key.device)
        self._grow(layer, len(self.lengths))
        return self._starts, self.meta.seq_lens

    def begin_decode(self, layer: KiviLayer) -> None:
        if layer.layer_idx == 0:
            self.lengths = [n + 1 for n in self.lengths]
            self.meta.seq_lens += 1
            self._assign_pages(self.meta.seq_lens.device)
        self._grow(layer, len(self.lengths))

    def reset(self) -> None:
        """Forget every sequence (the cache can then start a new generate call)."""
        super().reset()
        self.lengths, self.pages, self.num_pages, self.meta = [], [], 0, None

    def nbytes_bf16(self) -> int:
        """Bytes a bf16 cache would hold for the same (unpadded) tokens."""
        per_token = sum(2 * layer.num_heads * layer.head_dim * 2 for layer in self.layers)
        return per_token * sum(self.lengths)
