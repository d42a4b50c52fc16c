"""PyTorch fp32 reference of decode_attention (same signature as ops.py), the model's CPU path, and of the ring's
share of it, ring_partial (same signature as ops_ring.py).

Vectorized over the batch: gather the pages of the rows that hold packed tokens through the block table,
dequantize them with kivi_kernels/packing.py, append the residual ring, mask what each row does not hold, one softmax.
"""

from __future__ import annotations

import math

import torch

from kivi_kernels.packing import dequantize_keys, dequantize_values


def quantized_lengths(seq_lens: torch.Tensor, group_size: int, residual_length: int) -> torch.Tensor:
    """nq = G * ceil(max(0, L - R) / G) per row (int64)."""
    over = (seq_lens.long() - residual_length).clamp(min=0)
    return (over + group_size - 1) // group_size * group_size


def ring_mask(seq_lens: torch.Tensor, nq: torch.Tensor, residual_length: int) -> torch.Tensor:
    """[B, R] bool: ring slot j holds a token of [nq, L), i.e. (j - nq) mod R < L - nq."""
    j = torch.arange(residual_length, device=seq_lens.device)
    return (j[None, :] - nq[:, None]) % residual_length < (seq_lens.long() - nq)[:, None]


def ring_tokens(k_res: torch.Tensor, v_res: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                nq: torch.Tensor, residual_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ring_mask [B, R], keys, values [B, H, R, D] fp32) of rows slots[b] (int64, valid for every row). Values are
    zeros in slots that hold no token, so that garbage there (NaN, inf) never reaches a product; keys are as they
    lie, as callers mask those slots' scores to -inf (which also replaces a NaN score): one pass less over the
    ring, which on the CPU path is most of a short row's attention."""
    ring = ring_mask(seq_lens, nq, residual_length)
    k_ring = k_res[slots].float()
    v_ring = v_res[slots].float().masked_fill_(~ring[:, None, :, None], 0.0)
    return ring, k_ring, v_ring


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sm_scale: float,
           out: torch.Tensor | None) -> torch.Tensor:
    """q [B, Hq, D]; keys/values [B, H, T, D] fp32 (zeros where masked); mask [B, T] -> [B, Hq, D]."""
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    qf = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)  # [B, H, QG, D]
    scores = torch.matmul(qf, keys.transpose(-1, -2)) * sm_scale  # [B, H, QG, T]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows without keys -> zeros
    result = torch.matmul(probs, values).view(batch, q_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def gather_pages(block_table: torch.Tensor, slots: torch.Tensor, n_pages: int, pool_size: int) -> torch.Tensor:
    """[B, n_pages] int64 page ids of each row (clamped into the pool; unused ones are masked later)."""
    pages = block_table[slots.long(), :n_pages].long()
    return pages.clamp_(0, pool_size - 1)


def pages_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, n_pages, H, P, D] -> [B, H, n_pages * P, D]."""
    b, n, h, p, d = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b, h, n * p, d)


def _packed_tokens(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table, slots, nq, n_pages: int,
                   k_bits: int, v_bits: int, group_size: int, page_size: int):
    """(keys, values [b, n_pages, H, P, D] fp32, packed [b, n_pages, P] bool) of rows slots [b] holding nq [b]
    packed tokens: their first n_pages pages dequantized, scales and zeros of tokens past nq zeroed first."""
    pages = gather_pages(block_table, slots, n_pages, k_codes.shape[0])  # [b, n_pages]
    tok = torch.arange(n_pages * page_size, device=nq.device).view(n_pages, page_size)
    packed = tok[None] < nq[:, None, None]  # [b, n_pages, P]
    groups = packed[:, :, ::group_size, None, None].transpose(2, 3)  # [b, n_pages, 1, P / G, 1]
    rows = packed[:, :, None, :, None]  # [b, n_pages, 1, P, 1]
    zero = torch.zeros((), device=nq.device)
    keys = dequantize_keys(k_codes[pages], torch.where(groups, k_scale[pages].float(), zero),
                           torch.where(groups, k_zero[pages].float(), zero), k_bits, group_size)
    values = dequantize_values(v_codes[pages], torch.where(rows, v_scale[pages].float(), zero),
                               torch.where(rows, v_zero[pages].float(), zero), v_bits, group_size)
    return keys, values, packed


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    block_table: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    k_bits: int,
    v_bits: int,
    group_size: int,
    residual_length: int,
    page_size: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    lazy: bool | None = None,
    key_vec: int | None = None,
    swap_ab: bool | None = None,
    fma: bool | None = None,
    maxnreg: int | None = None,
    cp_async: bool | None = None,
    magic: bool | None = None,
    mma: bool | None = None,
    value_copy: str | None = None,
    ring_units: int | None = None,
    step_blocks: int | None = None,
    ring_pass: bool | None = None,
) -> torch.Tensor:
    """Same contract as ops.decode_attention; the tuning arguments are accepted and ignored."""
    del num_splits, block_n, use_dot, num_warps, num_stages, lazy, key_vec, swap_ab, fma, maxnreg, cp_async, magic, mma
    del value_copy, ring_units, step_blocks, ring_pass
    batch, q_heads, head_dim = q.shape
    kv_heads = k_res.shape[1]
    seq_lens = seq_lens.long()
    slots = torch.where(seq_lens > 0, slots.long(), torch.zeros_like(slots.long()))  # inactive rows: any slot
    nq = quantized_lengths(seq_lens, group_size, residual_length)  # [B]
    n_pages = -(-int(nq.max()) // page_size) if nq.numel() else 0
    qf = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)  # GQA: [B, H, QG, D]

    # packed tokens [0, n_pages * P) of the rows that hold any (a batch of short rows is mostly rows of the ring
    # alone, which skip the dequantization), in page layout [b, n_pages, H, P, D]. Scales and zeros of tokens past
    # nq are zeroed first (small tensors), so garbage in unused memory never gets through.
    with_packed = (nq > 0).nonzero().squeeze(1)  # [b] rows
    keys, values, packed_rows = _packed_tokens(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                                               slots[with_packed], nq[with_packed], n_pages, k_bits, v_bits,
                                               group_size, page_size)
    packed = torch.zeros((batch, n_pages, page_size), dtype=torch.bool, device=q.device)
    packed[with_packed] = packed_rows  # [B, n_pages, P]
    s_packed = torch.zeros((batch, kv_heads, q_heads // kv_heads, n_pages * page_size), device=q.device)
    s_packed[with_packed] = torch.einsum("bhgd,bnhpd->bhgnp", qf[with_packed], keys).flatten(-2)

    # residual ring [R): slot j valid iff it holds a token of [nq, L)
    ring, k_ring, v_ring = ring_tokens(k_res, v_res, slots, seq_lens, nq, residual_length)
    s_ring = torch.matmul(qf, k_ring.transpose(-1, -2))  # [B, H, QG, R]

    # one softmax over both; rows without keys -> zeros
    mask = torch.cat([packed.flatten(1), ring], dim=1)  # [B, T]
    scores = (torch.cat([s_packed, s_ring], dim=-1) * sm_scale).masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    n_packed = n_pages * page_size
    result = torch.matmul(probs[..., n_packed:], v_ring)  # [B, H, QG, D]
    result[with_packed] += torch.einsum("bhgnp,bnhpd->bhgd",
                                        probs[with_packed, ..., :n_packed].unflatten(-1, (n_pages, page_size)), values)
    result = result.view(batch, q_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def ring_partial(
    q: torch.Tensor,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    group_size: int,
    residual_length: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ops_ring.ring_partial: the ring's share of decode_attention, (o [B, Hq, D] fp32 normalized
    over the ring's tokens, lse [B, Hq] fp32 base-2 log-sum-exp of the scaled scores, -inf where the ring is
    empty). The tuning arguments are accepted and ignored."""
    del block_n, num_warps
    batch, q_heads, head_dim = q.shape
    kv_heads = k_res.shape[1]
    seq_lens = seq_lens.long()
    slots = torch.where(seq_lens > 0, slots.long(), torch.zeros_like(slots.long()))  # inactive rows: any slot
    nq = quantized_lengths(seq_lens, group_size, residual_length)
    ring, k_ring, v_ring = ring_tokens(k_res, v_res, slots, seq_lens, nq, residual_length)
    qf = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)  # [B, H, QG, D]
    scores = (torch.matmul(qf, k_ring.transpose(-1, -2)) * sm_scale).masked_fill_(~ring[:, None, None, :],
                                                                                  float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows without ring tokens -> zeros
    o = torch.matmul(probs, v_ring).view(batch, q_heads, head_dim)
    log2_sum = (torch.logsumexp(scores, dim=-1) * math.log2(math.e)).view(batch, q_heads)
    out = o if out is None else out.copy_(o)
    lse = log2_sum if lse is None else lse.copy_(log2_sum)
    return out, lse
