"""Triton kernels of the full-precision paged baseline: decode attention and K/V scatter stores. Only @triton.jit
code. The online softmax, split ranges, partial stores and the split merge come from
kivi_kernels/decode_attention/attend.py (shared, not copied)."""

import triton
import triton.language as tl

from kivi_kernels.decode_attention.attend import _attend_block, _load_query_group, _split_range, _store_partial


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_table_ptr, slots_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    qk_scale,
    stride_q_b, stride_q_h,
    stride_kv_n, stride_kv_h, stride_kv_t,
    stride_bt_s,
    stride_o_b, stride_o_h, stride_o_s, stride_lse_b, stride_lse_h,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, QG: tl.constexpr, QG_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ROW_MAJOR: tl.constexpr = False,
):
    """grid (B, H, NUM_SPLITS), or (H, B, NUM_SPLITS) with ROW_MAJOR: KV head h of row b against its QG query
    heads over tokens [0, L) in pages."""
    tl.static_assert(PAGE % BLOCK_N == 0)
    tl.static_assert(QG_PAD >= QG)
    # grid (H, B, num_splits) with ROW_MAJOR: programs start row by row (common.decode_grid); else (B, H, num_splits)
    b = tl.program_id(1 if ROW_MAJOR else 0).to(tl.int64)
    h = tl.program_id(0 if ROW_MAJOR else 1).to(tl.int64)
    split = tl.program_id(2)
    # stage 0: this split's blocks of the row
    seq_len = tl.load(seq_lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    lo, hi = _split_range(tl.cdiv(seq_len, BLOCK_N), split, NUM_SPLITS)
    # stage 1: the query group
    head0 = h * QG
    q = _load_query_group(q_ptr, b, head0, stride_q_b, stride_q_h, QG, QG_PAD, HEAD_DIM, USE_DOT, DOT_DTYPE)
    m_i = tl.full([QG_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QG_PAD], tl.float32)
    acc = tl.zeros([QG_PAD, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # stage 2: pages through the block table
    bt_row = block_table_ptr + slot * stride_bt_s
    for blk in range(lo, hi):
        tok = blk * BLOCK_N
        page = tl.load(bt_row + tok // PAGE).to(tl.int64)
        base = page * stride_kv_n + h * stride_kv_h
        rows = tok % PAGE + offs_n
        valid = offs_n < seq_len - tok
        k_t = tl.load(k_ptr + base + rows[None, :] * stride_kv_t + offs_d[:, None], mask=valid[None, :], other=0.0)
        v = tl.load(v_ptr + base + rows[:, None] * stride_kv_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _attend_block(q, k_t, v, valid, m_i, l_i, acc, qk_scale, USE_DOT, DOT_DTYPE, INPUT_PRECISION)
    # stage 3: normalized output (or split partial + log-sum-exp)
    _store_partial(
        o_ptr, lse_ptr, acc, m_i, l_i, b, head0, split.to(tl.int64),
        stride_o_b, stride_o_h, stride_o_s, stride_lse_b, stride_lse_h,
        QG, QG_PAD, HEAD_DIM, NUM_SPLITS > 1,
    )


@triton.jit
def _store_paged_prefill_kernel(
    key_ptr, value_ptr, starts_ptr, lengths_ptr, slots_ptr, block_table_ptr, k_pages_ptr, v_pages_ptr,
    stride_key_b, stride_key_h, stride_key_t, stride_value_b, stride_value_h, stride_value_t,
    stride_bt_s, stride_kv_n, stride_kv_h, stride_kv_t,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """grid (B, H, cdiv(T, BLOCK_T)): tokens [t0, t0 + BLOCK_T) of row b, head h -> their page slots."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t0 = tl.program_id(2) * BLOCK_T
    length = tl.load(lengths_ptr + b)
    if t0 < length:
        start = tl.load(starts_ptr + b).to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        offs_t = t0 + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, HEAD_DIM)
        valid = (offs_t < length)[:, None]
        # source rows [BLOCK_T, D]
        src = (start + offs_t)[:, None]
        k = tl.load(key_ptr + b * stride_key_b + h * stride_key_h + src * stride_key_t + offs_d[None, :], mask=valid)
        v = tl.load(value_ptr + b * stride_value_b + h * stride_value_h + src * stride_value_t + offs_d[None, :],
                    mask=valid)
        # destination: page block_table[slot, t // P], row t % P
        page = tl.load(block_table_ptr + slot * stride_bt_s + offs_t // PAGE, mask=offs_t < length, other=0)
        dst = page.to(tl.int64) * stride_kv_n + h * stride_kv_h + (offs_t % PAGE) * stride_kv_t
        dst = dst[:, None] + offs_d[None, :]
        tl.store(k_pages_ptr + dst, k.to(k_pages_ptr.dtype.element_ty), mask=valid)
        tl.store(v_pages_ptr + dst, v.to(v_pages_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _store_paged_decode_kernel(
    key_ptr, value_ptr, seq_lens_ptr, slots_ptr, block_table_ptr, k_pages_ptr, v_pages_ptr,
    stride_key_b, stride_key_h, stride_value_b, stride_value_h,
    stride_bt_s, stride_kv_n, stride_kv_h, stride_kv_t,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
):
    """grid (B,): the token at position seq_len - 1 of row b, all heads -> its page slot (rows with 0 skip)."""
    b = tl.program_id(0).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    if seq_len > 0:
        t = seq_len - 1
        slot = tl.load(slots_ptr + b).to(tl.int64)
        page = tl.load(block_table_ptr + slot * stride_bt_s + t // PAGE).to(tl.int64)
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        mask = (offs_h < HEADS)[:, None]
        k = tl.load(key_ptr + b * stride_key_b + offs_h[:, None] * stride_key_h + offs_d[None, :], mask=mask)
        v = tl.load(value_ptr + b * stride_value_b + offs_h[:, None] * stride_value_h + offs_d[None, :], mask=mask)
        dst = page * stride_kv_n + (t % PAGE) * stride_kv_t + offs_h[:, None] * stride_kv_h + offs_d[None, :]
        tl.store(k_pages_ptr + dst, k.to(k_pages_ptr.dtype.element_ty), mask=mask)
        tl.store(v_pages_ptr + dst, v.to(v_pages_ptr.dtype.element_ty), mask=mask)
