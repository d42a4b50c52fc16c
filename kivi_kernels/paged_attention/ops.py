"""Launchers of the full-precision paged baseline (bf16/fp16/fp32 pools [N, H, P, D], same block table as the
KIVI cache): paged_decode_attention, store_paged_prefill, store_paged_decode."""

from __future__ import annotations

import math

import torch

from kivi_kernels.decode_attention import common as C

from .kernel import _paged_decode_kernel, _store_paged_decode_kernel, _store_paged_prefill_kernel

_INT = (torch.int32,)


def _check_pool(op: str, k_pages: torch.Tensor, v_pages: torch.Tensor, page_size: int) -> tuple[int, int, int]:
    C.check_int(op, "page_size", page_size)
    if not C.is_pow2(page_size) or page_size < 16:
        raise ValueError(f"{op}: page_size={page_size} must be a power of two >= 16")
    C.check_tensor(op, "k_pages", k_pages, (-1, -1, page_size, -1), C.FLOAT_DTYPES)
    C.check_tensor(op, "v_pages", v_pages, tuple(k_pages.shape), (k_pages.dtype,))
    if k_pages.stride() != v_pages.stride():
        raise ValueError(f"{op}: k_pages and v_pages must share strides, got {k_pages.stride()} and {v_pages.stride()}")
    n_pages, kv_heads, _, head_dim = k_pages.shape
    if not C.is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"{op}: k_pages has head_dim {head_dim} (shape {list(k_pages.shape)}), "
                         "not a power of two >= 16")
    return n_pages, kv_heads, head_dim


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
    """q [B, Hq, D] against tokens [0, seq_lens[b]) of pages block_table[slots[b]] -> [B, Hq, D] (q's dtype)."""
    op = "paged_decode_attention"
    _, kv_heads, head_dim = _check_pool(op, k_pages, v_pages, page_size)
    C.check_tensor(op, "q", q, (-1, -1, head_dim), C.FLOAT_DTYPES)
    batch, q_heads, _ = q.shape
    if q_heads % kv_heads:
        raise ValueError(f"{op}: q has {q_heads} heads (shape {list(q.shape)}), not a multiple of the {kv_heads} "
                         f"KV heads of k_pages (shape {list(k_pages.shape)})")
    C.check_tensor(op, "block_table", block_table, (-1, -1), _INT)
    C.check_tensor(op, "slots", slots, (batch,), _INT)
    C.check_tensor(op, "seq_lens", seq_lens, (batch,), _INT)
    C.check_device(op, dict(q=q, k_pages=k_pages, v_pages=v_pages, block_table=block_table, slots=slots,
                            seq_lens=seq_lens))
    out = C.prepare_out(op, out, (batch, q_heads, head_dim), q)
    if batch == 0:
        return out

    qg = q_heads // kv_heads
    dot_dtype, precision = C.dot_config(q.dtype, k_pages.dtype)
    use_dot = True if use_dot is None else bool(use_dot)
    qg_pad = max(16, C.triton_next_pow2(qg)) if use_dot else C.triton_next_pow2(qg)
    if block_n is None:
        block_n = min(page_size, 64)
        if not use_dot:
            block_n = min(block_n, max(16, 8192 // (qg_pad * head_dim)))
    if not C.is_pow2(block_n) or block_n < 16 or page_size % block_n:
        raise ValueError(f"{op}: block_n={block_n} must be a power of two >= 16 dividing page_size={page_size}")
    if num_splits is None:
        num_splits = C.choose_num_splits(batch * kv_heads, block_table.shape[1] * page_size, q.device)
    C.check_int(op, "num_splits", num_splits)

    o, lse, o_strides, workspace = C.output_args(out, num_splits)
    grid, row_major = C.decode_grid(batch, kv_heads, num_splits)
    _paged_decode_kernel[grid](
        q, k_pages, v_pages, block_table, slots, seq_lens, o, lse,
        qk_scale=float(sm_scale) * math.log2(math.e),
        stride_q_b=q.stride(0), stride_q_h=q.stride(1),
        stride_kv_n=k_pages.stride(0), stride_kv_h=k_pages.stride(1), stride_kv_t=k_pages.stride(2),
        stride_bt_s=block_table.stride(0),
        **o_strides,
        PAGE=page_size, HEAD_DIM=head_dim, QG=qg, QG_PAD=qg_pad, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        USE_DOT=use_dot, DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision, ROW_MAJOR=row_major,
        num_warps=4 if use_dot and precision is None else 8,
    )
    if workspace is not None:
        C.merge_splits(*workspace, out)
    return out


def _check_store(op, key, value, rank, per_row: dict, slots, block_table, k_pages, v_pages, page_size):
    _, kv_heads, head_dim = _check_pool(op, k_pages, v_pages, page_size)
    shape = (-1, kv_heads, -1, head_dim) if rank == 4 else (-1, kv_heads, head_dim)
    C.check_tensor(op, "key", key, shape, C.FLOAT_DTYPES)
    C.check_tensor(op, "value", value, tuple(key.shape), C.FLOAT_DTYPES)
    batch = key.shape[0]
    for name, t in dict(per_row, slots=slots).items():
        C.check_tensor(op, name, t, (batch,), _INT)
    C.check_tensor(op, "block_table", block_table, (-1, -1), _INT)
    C.check_device(op, dict(key=key, value=value, **per_row, slots=slots, block_table=block_table,
                            k_pages=k_pages, v_pages=v_pages))
    return batch, kv_heads, head_dim


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
    op = "store_paged_prefill"
    batch, kv_heads, head_dim = _check_store(op, key, value, 4, dict(starts=starts, lengths=lengths), slots,
                                             block_table, k_pages, v_pages, page_size)
    tokens = key.shape[2]
    if batch == 0 or tokens == 0:
        return
    block_t = min(64, C.triton_next_pow2(tokens))
    _store_paged_prefill_kernel[(batch, kv_heads, triton_cdiv(tokens, block_t))](
        key, value, starts, lengths, slots, block_table, k_pages, v_pages,
        stride_key_b=key.stride(0), stride_key_h=key.stride(1), stride_key_t=key.stride(2),
        stride_value_b=value.stride(0), stride_value_h=value.stride(1), stride_value_t=value.stride(2),
        stride_bt_s=block_table.stride(0),
        stride_kv_n=k_pages.stride(0), stride_kv_h=k_pages.stride(1), stride_kv_t=k_pages.stride(2),
        PAGE=page_size, HEAD_DIM=head_dim, BLOCK_T=block_t, num_warps=4,
    )


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
    op = "store_paged_decode"
    batch, kv_heads, head_dim = _check_store(op, key, value, 3, dict(seq_lens=seq_lens), slots, block_table,
                                             k_pages, v_pages, page_size)
    if batch == 0:
        return
    _store_paged_decode_kernel[(batch,)](
        key, value, seq_lens, slots, block_table, k_pages, v_pages,
        stride_key_b=key.stride(0), stride_key_h=key.stride(1),
        stride_value_b=value.stride(0), stride_value_h=value.stride(1),
        stride_bt_s=block_table.stride(0),
        stride_kv_n=k_pages.stride(0), stride_kv_h=k_pages.stride(1), stride_kv_t=k_pages.stride(2),
        PAGE=page_size, HEAD_DIM=head_dim, HEADS=kv_heads, HEADS_PAD=C.triton_next_pow2(kv_heads), num_warps=1,
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
