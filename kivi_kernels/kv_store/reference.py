"""PyTorch reference for the KV store ops (the CPU backend): same signatures as ops.py.

Vectorized over all groups and residual tokens of the batch (no loops over tokens or rows); fp32 math
through kivi_kernels/packing.py, which is the spec the Triton kernels match bit for bit (checked on CPU and on
an H200). Run on CUDA tensors this reference can differ from the kernel by an fp32 ulp of scale (a code,
rarely): torch's CUDA tensor / Python-scalar division multiplies by the reciprocal instead of dividing.
"""

from __future__ import annotations

import torch

from ..packing import quantize_keys, quantize_values
from .ops import check_store_args


def _ragged(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [B] -> (row, index) [sum(counts)]: row b repeated counts[b] times, index 0..counts[b]-1."""
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    first = torch.cumsum(counts, 0) - counts
    return rows, torch.arange(rows.numel(), device=counts.device) - first[rows]


def _write_groups(k, v, pages, gidx, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                  k_bits, v_bits, group_size):
    """Quantize groups k, v [M, H, G, D] into group gidx[m] of page pages[m] (M, int64), in place."""
    N, H, _, D = k_codes.shape
    G = group_size
    kc, ks, kz = quantize_keys(k, k_bits, G, dtype=k_scale.dtype)  # [M, H, G*kb/32, D], [M, H, 1, D]
    vc, vs, vz = quantize_values(v, v_bits, G, dtype=v_scale.dtype)  # [M, H, G, D*vb/32], [M, H, G, D/G]
    k_codes.view(N, H, -1, G * k_bits // 32, D)[pages, :, gidx] = kc
    k_scale[pages, :, gidx] = ks[:, :, 0]
    k_zero[pages, :, gidx] = kz[:, :, 0]
    v_codes.view(N, H, -1, G, v_codes.shape[-1])[pages, :, gidx] = vc
    v_scale.view(N, H, -1, G, v_scale.shape[-1])[pages, :, gidx] = vs
    v_zero.view(N, H, -1, G, v_zero.shape[-1])[pages, :, gidx] = vz


def store_prefill(key, value, starts, lengths, slots, block_table, k_codes, k_scale, k_zero,
                  v_codes, v_scale, v_zero, k_res, v_res, *, k_bits: int, v_bits: int, group_size: int,
                  residual_length: int, page_size: int, block_c: int | None = None,
                  num_warps: int | None = None) -> None:
    """Reference of ops.store_prefill (same shapes): key, value [B, H, T, D], starts/lengths/slots int32 [B].

    Tokens [0, nq) of each row, nq = G * ceil(max(0, L - R) / G), go to pages block_table[slot, t // P];
    tokens [nq, L) go to ring slots t % R of k_res/v_res [S, H, R, D].
    """
    check_store_args(key, value, (("starts", starts), ("lengths", lengths)), slots, block_table,
                     k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, k_bits=k_bits,
                     v_bits=v_bits, group_size=group_size, residual_length=residual_length,
                     page_size=page_size)
    if key.dim() != 4:
        raise ValueError(f"key must be [B, H, T, D], got shape {tuple(key.shape)}")
    G, R, P = group_size, residual_length, page_size
    T = key.shape[2]
    start, length, slot = starts.long(), lengths.long(), slots.long()
    if bool(((start < 0) | (length < 0) | (start + length > T)).any()):
        raise ValueError(f"starts + lengths must lie in [0, T={T}], got starts={starts} lengths={lengths}")
    nq = (length - R).clamp(min=0).add(G - 1).div(G, rounding_mode="floor") * G  # [B]
    # packed groups: group j of row b holds tokens [j*G, (j+1)*G) at input positions start + j*G + i
    b, j = _ragged(nq // G)
    if b.numel():
        pos = (start[b] + j * G)[:, None] + torch.arange(G, device=key.device)  # [M, G]
        k = key[b[:, None], :, pos].transpose(1, 2)  # [M, G, H, D] -> [M, H, G, D]
        v = value[b[:, None], :, pos].transpose(1, 2)
        pages = block_table[slot[b], (j * G) // P].long()
        _write_groups(k, v, pages, (j * G % P) // G, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                      k_bits, v_bits, G)
    # residual tokens t in [nq, L) -> ring slot t % R
    b, i = _ragged(length - nq)
    if b.numel():
        t = nq[b] + i
        k_res[slot[b], :, t % R] = key[b, :, start[b] + t]  # [M, H, D]
        v_res[slot[b], :, t % R] = value[b, :, start[b] + t]


def store_decode(key, value, seq_lens, slots, block_table, k_codes, k_scale, k_zero,
                 v_codes, v_scale, v_zero, k_res, v_res, *, k_bits: int, v_bits: int, group_size: int,
                 residual_length: int, page_size: int, block_c: int | None = None,
                 num_warps: int | None = None, loop_chunks: bool | None = None) -> None:
    """Reference of ops.store_decode: key, value [B, H, D] = token L = seq_lens[b] - 1 (0 = inactive row);
    block_c, num_warps and loop_chunks (the kernel's tuning) are accepted and ignored.

    If L >= R and (L - R) % G == 0, ring slots (L - R) % R + [0, G) are quantized into page
    block_table[slot, (L - R) // P] first; then the token goes to ring slot L % R.
    """
    check_store_args(key, value, (("seq_lens", seq_lens),), slots, block_table,
                     k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_res, v_res, k_bits=k_bits,
                     v_bits=v_bits, group_size=group_size, residual_length=residual_length,
                     page_size=page_size)
    if key.dim() != 3:
        raise ValueError(f"key must be [B, H, D], got shape {tuple(key.shape)}")
    G, R, P = group_size, residual_length, page_size
    L, slot = seq_lens.long() - 1, slots.long()
    active = L >= 0
    t0 = L - R
    flush = (active & (t0 >= 0) & (t0 % G == 0)).nonzero().flatten()
    if flush.numel():
        s, t0 = slot[flush], t0[flush]
        ring = (t0 % R)[:, None] + torch.arange(G, device=key.device)  # [F, G]
        k = k_res[s[:, None], :, ring].transpose(1, 2)  # [F, G, H, D] -> [F, H, G, D]
        v = v_res[s[:, None], :, ring].transpose(1, 2)
        pages = block_table[s, t0 // P].long()
        _write_groups(k, v, pages, (t0 % P) // G, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                      k_bits, v_bits, G)
    rows = active.nonzero().flatten()
    k_res[slot[rows], :, L[rows] % R] = key[rows]
    v_res[slot[rows], :, L[rows] % R] = value[rows]
