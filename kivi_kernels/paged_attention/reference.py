"""PyTorch fp32 references of the full-precision paged baseline (same signatures as ops.py)."""

from __future__ import annotations

import torch

from kivi_kernels.decode_attention.reference import attend, gather_pages, pages_to_tokens


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    page_size: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
) -> torch.Tensor:
    """Same contract as ops.paged_decode_attention; the tuning arguments are accepted and ignored."""
    del num_splits, block_n, use_dot
    seq_lens = seq_lens.long()
    slots = torch.where(seq_lens > 0, slots.long(), torch.zeros_like(slots.long()))
    n_pages = -(-int(seq_lens.max()) // page_size) if seq_lens.numel() else 0
    pages = gather_pages(block_table, slots, n_pages, k_pages.shape[0])  # [B, n_pages]
    mask = torch.arange(n_pages * page_size, device=q.device)[None, :] < seq_lens[:, None]  # [B, T]
    # values zeroed past each row's length (garbage there must not reach a product); keys as they lie: attend masks
    # those scores to -inf, which also replaces a NaN score
    keys = pages_to_tokens(k_pages[pages].float())
    values = pages_to_tokens(v_pages[pages].float()).masked_fill_(~mask[:, None, :, None], 0.0)
    return attend(q, keys, values, mask, sm_scale, out)


def store_paged_prefill(
    key: torch.Tensor,
    value: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    *,
    page_size: int,
) -> None:
    """Write key/value[b, :, starts[b] + t] for t < lengths[b] to page block_table[slots[b], t // P], row t % P."""
    t = torch.arange(key.shape[2], device=key.device)
    rows, toks = (t[None, :] < lengths.long()[:, None]).nonzero(as_tuple=True)  # every real token
    src = starts.long()[rows] + toks
    pages = block_table[slots.long()[rows], toks // page_size].long()
    k_pages[pages, :, toks % page_size] = key[rows, :, src].to(k_pages.dtype)  # [n, H, D]
    v_pages[pages, :, toks % page_size] = value[rows, :, src].to(v_pages.dtype)


def store_paged_decode(
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    *,
    page_size: int,
) -> None:
    """Write key/value[b] ([B, H, D]) as token seq_lens[b] - 1 of slot slots[b]; rows with seq_len 0 are skipped."""
    rows = (seq_lens > 0).nonzero(as_tuple=True)[0]
    t = seq_lens.long()[rows] - 1
    pages = block_table[slots.long()[rows], t // page_size].long()
    k_pages[pages, :, t % page_size] = key[rows].to(k_pages.dtype)
    v_pages[pages, :, t % page_size] = value[rows].to(v_pages.dtype)
