"""Per-layer KV storage formats: KIVI's packed pages + residual ring, or plain full-precision pages.

A storage object knows the tensor shapes of its format and calls the kernel ops on them; it holds
no tensors itself (the cache layers do), so one object serves every layer of a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kivi.config import KiviConfig


@dataclass
class BatchMeta:
    """Which cache slots a batch reads and writes (shared by all layers of one forward).

    slots:       [B] int32, cache slot of each batch row
    seq_lens:    [B] int32, tokens cached per row including the ones of this forward (0 = inactive row)
    block_table: [S, max_pages] int32, page ids of each slot
    """

    slots: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


class QuantizedStorage:
    """KIVI format: packed key/value pages plus a full-precision residual ring per slot."""

    names = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")

    def __init__(self, kivi: KiviConfig, ops) -> None:
        self.kivi = kivi
        self.ops = ops

    def page_shapes(self, num_heads: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], bool]]:
        """Shape of one page of each pool tensor, and whether it holds int32 codes."""
        c, p, g = self.kivi, self.kivi.page_size, self.kivi.group_size
        c.check_head_dim(head_dim)
        return {
            "k_codes": ((num_heads, p * c.k_bits // 32, head_dim), True),
            "k_scale": ((num_heads, p // g, head_dim), False),
            "k_zero": ((num_heads, p // g, head_dim), False),
            "v_codes": ((num_heads, p, head_dim * c.v_bits // 32), True),
            "v_scale": ((num_heads, p, head_dim // g), False),
            "v_zero": ((num_heads, p, head_dim // g), False),
        }

    def allocate_pages(self, num_pages, num_heads, head_dim, dtype, device) -> dict[str, torch.Tensor]:
        scale_dtype = self.kivi.scale_dtype_for(dtype)
        out = {}
        for name, (shape, is_codes) in self.page_shapes(num_heads, head_dim).items():
            out[name] = torch.zeros((num_pages, *shape), dtype=torch.int32 if is_codes else scale_dtype,
                                    device=device)
        return out

    def allocate_slots(self, num_slots, num_heads, head_dim, dtype, device) -> dict[str, torch.Tensor]:
        shape = (num_slots, num_heads, self.kivi.residual_length, head_dim)
        return {"k_res": torch.zeros(shape, dtype=dtype, device=device),
                "v_res": torch.zeros(shape, dtype=dtype, device=device)}

    def page_bytes(self, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one page across all pool tensors of one layer."""
        item = torch.empty((), dtype=self.kivi.scale_dtype_for(dtype)).element_size()
        total = 0
        for shape, is_codes in self.page_shapes(num_heads, head_dim).values():
            n = 1
            for s in shape:
                n *= s
            total += n * (4 if is_codes else item)
        return total

    def slot_bytes(self, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * num_heads * self.kivi.residual_length * head_dim * item

    def pages_for(self, seq_len: int) -> int:
        """Pages a sequence of seq_len tokens occupies."""
        return -(-self.kivi.quantized_length(seq_len) // self.kivi.page_size)

    def content_bytes(self, seq_len: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one layer's data for a sequence: packed tokens at their packed size (codes, scales and
        zero points), residual tokens at full precision."""
        nq = self.kivi.quantized_length(seq_len)
        packed = self.page_bytes(num_heads, head_dim, dtype) * nq // self.kivi.page_size
        item = torch.empty((), dtype=dtype).element_size()
        return packed + (seq_len - nq) * 2 * num_heads * head_dim * item

    def _ints(self) -> dict[str, int]:
        c = self.kivi
        return dict(k_bits=c.k_bits, v_bits=c.v_bits, group_size=c.group_size,
                    residual_length=c.residual_length, page_size=c.page_size)

    def store_prefill(self, t: dict, key, value, starts, lengths, meta: BatchMeta) -> None:
        """key/value [B, H, T, D]; row b's tokens are key[b, :, starts[b]:starts[b]+lengths[b]]. Keys and values
        of another dtype than the ring's (a float32 model over a bf16 cache) are rounded to it first, so that the
        packed groups quantize what the ring would have held."""
        key, value = key.to(t["k_res"].dtype), value.to(t["k_res"].dtype)
        self.ops.store_prefill(key, value, starts, lengths, meta.slots, meta.block_table,
                               *(t[n] for n in self.names), t["k_res"], t["v_res"], **self._ints())

    def store_decode(self, t: dict, key, value, meta: BatchMeta) -> None:
        """key/value [B, H, D]: the token at position seq_lens[b] - 1 of each row (rounded to the ring's dtype)."""
        key, value = key.to(t["k_res"].dtype), value.to(t["k_res"].dtype)
        self.ops.store_decode(key, value, meta.seq_lens, meta.slots, meta.block_table,
                              *(t[n] for n in self.names), t["k_res"], t["v_res"], **self._ints())

    def decode_attention(self, t: dict, q, meta: BatchMeta, sm_scale: float) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D] over every cached token of each row."""
        return self.ops.decode_attention(q, *(t[n] for n in self.names), t["k_res"], t["v_res"],
                                         meta.block_table, meta.slots, meta.seq_lens,
                                         sm_scale=sm_scale, **self._ints())


class FullStorage:
    """Plain full-precision pages (the bf16 baseline in the engine)."""

    names = ("k_pages", "v_pages")

    def __init__(self, page_size: int, ops) -> None:
        self.page_size = page_size
        self.ops = ops

    def allocate_pages(self, num_pages, num_heads, head_dim, dtype, device) -> dict[str, torch.Tensor]:
        shape = (num_pages, num_heads, self.page_size, head_dim)
        return {n: torch.zeros(shape, dtype=dtype, device=device) for n in self.names}

    def allocate_slots(self, num_slots, num_heads, head_dim, dtype, device) -> dict[str, torch.Tensor]:
        return {}

    def page_bytes(self, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_heads * self.page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    def slot_bytes(self, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 0

    def pages_for(self, seq_len: int) -> int:
        return -(-seq_len // self.page_size)

    def content_bytes(self, seq_len: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return seq_len * 2 * num_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store_prefill(self, t: dict, key, value, starts, lengths, meta: BatchMeta) -> None:
        self.ops.store_paged_prefill(key, value, starts, lengths, meta.slots, meta.block_table,
                                     t["k_pages"], t["v_pages"], page_size=self.page_size)

    def store_decode(self, t: dict, key, value, meta: BatchMeta) -> None:
        self.ops.store_paged_decode(key, value, meta.seq_lens, meta.slots, meta.block_table,
                                    t["k_pages"], t["v_pages"], page_size=self.page_size)

    def decode_attention(self, t: dict, q, meta: BatchMeta, sm_scale: float) -> torch.Tensor:
        return self.ops.paged_decode_attention(q, t["k_pages"], t["v_pages"], meta.block_table, meta.slots,
                                               meta.seq_lens, sm_scale=sm_scale, page_size=self.page_size)
