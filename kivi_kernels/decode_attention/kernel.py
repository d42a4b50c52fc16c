"""Triton kernel for decode attention over the KIVI cache (design.md, op 3). Only @triton.jit code.

Grid common.decode_grid ((H, B, num_splits), or (B, H, num_splits)); each program streams its split of the
row's BLOCK_N-token blocks (packed pages through the block table, software-pipelined NUM_STAGES deep, then the
residual ring), unpacks code words in registers (unpack.py), and feeds tensor cores (tl.dot, query group padded
to 16 rows) with fp16/bf16 tiles; nothing dequantized is written to global memory. In the default loop the tiles
pass through shared memory on their way to the tensor cores (Triton's dot-operand conversion); kernel_swap.py
holds the loop that keeps them in registers. What bounds both on the H200 is in
benchmarks/results/kernel_notes.md. The online-softmax pieces shared with the bf16 baseline are in attend.py.
"""

import triton
import triton.language as tl

from .attend import _attend_block, _attend_block_lazy, _load_query_group, _split_range, _store_partial
from .kernel_swap import _swap_packed_blocks
from .unpack import _load_packed_keys_t, _load_packed_values, _unpermute_channels, _word_order


@triton.jit
def _decode_attention_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr,
    block_table_ptr, slots_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    qk_scale, num_splits,
    stride_q_b, stride_q_h,
    stride_kc_n, stride_kc_h, stride_kc_w: tl.constexpr,
    stride_ks_n, stride_ks_h, stride_ks_g: tl.constexpr,
    stride_vc_n, stride_vc_h, stride_vc_t: tl.constexpr,
    stride_vs_n, stride_vs_h, stride_vs_t: tl.constexpr,
    stride_res_s, stride_res_h, stride_res_t: tl.constexpr,
    stride_bt_s,
    stride_o_b, stride_o_h, stride_o_s, stride_lse_b, stride_lse_h,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, RESIDUAL: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, QG: tl.constexpr, QG_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, LAZY_L: tl.constexpr,
    KEY_VEC: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_ASM: tl.constexpr,
    SWAP_AB: tl.constexpr = False, RING_N: tl.constexpr = 0, ROW_MAJOR: tl.constexpr = False,
):
    """grid (B, H, num_splits), or (H, B, num_splits) with ROW_MAJOR: KV head h of row b against its QG query
    heads, one split of the keys.

    Key blocks of one row: the packed tokens [0, nq) in BLOCK_N steps through the block table, then the
    ring slots [0, min(L, R)) in BLOCK_N steps (slot j valid iff (j - nq) mod R < L - nq). A split owns a
    contiguous range of those blocks. Packed tiles are dequantized in DOT_DTYPE registers, never stored.
    SWAP_AB (2-bit keys and values, D = 128, BLOCK_N = 128): the packed blocks go through
    kernel_swap._swap_packed_blocks, whose dequantized tiles stay in registers as the mma's A operand.
    RING_N (0: BLOCK_N) ring tokens are attended at a time.
    """
    tl.static_assert(PAGE % BLOCK_N == 0)
    tl.static_assert(QG_PAD >= QG)
    tl.static_assert(BLOCK_N * HEAD_DIM <= 16384)
    tl.static_assert(not SWAP_AB or (K_BITS == 2 and V_BITS == 2 and HEAD_DIM == 128 and BLOCK_N == 128 and USE_DOT))
    RING_STEP: tl.constexpr = BLOCK_N if RING_N == 0 else RING_N
    tl.static_assert(BLOCK_N % RING_STEP == 0)
    # grid (H, B, num_splits) with ROW_MAJOR: programs start row by row (common.decode_grid); else (B, H, num_splits)
    b = tl.program_id(1 if ROW_MAJOR else 0).to(tl.int64)
    h = tl.program_id(0 if ROW_MAJOR else 1).to(tl.int64)
    split = tl.program_id(2)
    # stage 0: this row's token ranges and this split's blocks
    seq_len = tl.load(seq_lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    nq = tl.cdiv(tl.maximum(seq_len - RESIDUAL, 0), GROUP) * GROUP
    n_res = seq_len - nq
    n_packed_blocks = tl.cdiv(nq, BLOCK_N)
    n_ring_blocks = tl.cdiv(tl.minimum(seq_len, RESIDUAL), BLOCK_N)
    lo, hi = _split_range(n_packed_blocks + n_ring_blocks, split, num_splits)

    # stage 1: the query group of KV head h
    head0 = h * QG
    q = _load_query_group(q_ptr, b, head0, stride_q_b, stride_q_h, QG, QG_PAD, HEAD_DIM, USE_DOT, DOT_DTYPE)
    m_i = tl.full([QG_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QG_PAD], tl.float32)
    acc = tl.zeros([QG_PAD, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    # stage 2: packed tokens, page by page through the block table
    bt_row = block_table_ptr + slot * stride_bt_s
    if SWAP_AB:
        m_i, l_i, acc = _swap_packed_blocks(
            q_ptr, b, head0, stride_q_b, stride_q_h, qk_scale,
            kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, lo, tl.minimum(hi, n_packed_blocks), nq,
            stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
            stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
            GROUP, PAGE, QG, QG_PAD, DOT_DTYPE, USE_ASM, NUM_STAGES, INPUT_PRECISION,
        )
    else:
        # key tile column n is token tok + tile_tok[n], the value rows follow it; acc columns are in the value
        # words' channel order
        tile_tok = _word_order(offs_n, 32 // K_BITS)
        l_t = tl.zeros([QG_PAD, BLOCK_N], tl.float32)
        for blk in tl.range(lo, tl.minimum(hi, n_packed_blocks), num_stages=NUM_STAGES):
            tok = blk * BLOCK_N
            page = tl.load(bt_row + tok // PAGE).to(tl.int64)
            off = tok % PAGE
            n_valid = nq - tok
            valid = tile_tok < n_valid
            k_t = _load_packed_keys_t(
                kc_ptr + page * stride_kc_n + h * stride_kc_h,
                ks_ptr + page * stride_ks_n + h * stride_ks_h,
                kz_ptr + page * stride_ks_n + h * stride_ks_h,
                off, n_valid, stride_kc_w, stride_ks_g, K_BITS, GROUP, BLOCK_N, HEAD_DIM, DOT_DTYPE, USE_ASM, KEY_VEC,
            )
            v = _load_packed_values(
                vc_ptr + page * stride_vc_n + h * stride_vc_h,
                vs_ptr + page * stride_vs_n + h * stride_vs_h,
                vz_ptr + page * stride_vs_n + h * stride_vs_h,
                off + tile_tok, valid, stride_vc_t, stride_vs_t, V_BITS, GROUP, BLOCK_N, HEAD_DIM, DOT_DTYPE, USE_ASM,
            )
            if LAZY_L:
                m_i, l_t, acc = _attend_block_lazy(q, k_t, v, valid, m_i, l_t, acc, qk_scale, USE_DOT, DOT_DTYPE,
                                                   INPUT_PRECISION)
            else:
                m_i, l_i, acc = _attend_block(q, k_t, v, valid, m_i, l_i, acc, qk_scale, USE_DOT, DOT_DTYPE,
                                              INPUT_PRECISION)
        if LAZY_L:
            l_i = tl.sum(l_t, axis=1)
        acc = _unpermute_channels(acc, QG_PAD, HEAD_DIM, V_BITS)

    # stage 3: full-precision residual ring (ring order never matters)
    res_off = slot * stride_res_s + h * stride_res_h
    nq_mod = nq % RESIDUAL
    # (RING_STEP tokens at a time: a smaller tile keeps the shared memory of its dots, and so the occupancy of the
    # whole kernel, independent of BLOCK_N)
    offs_ring = tl.arange(0, RING_STEP)
    for blk in tl.range(tl.maximum(lo, n_packed_blocks) - n_packed_blocks, hi - n_packed_blocks, num_stages=1):
        for sub in tl.static_range(BLOCK_N // RING_STEP):
            ring = blk * BLOCK_N + sub * RING_STEP + offs_ring
            valid = ((ring + RESIDUAL - nq_mod) % RESIDUAL < n_res) & (ring < RESIDUAL)
            k_t = tl.load(kr_ptr + res_off + ring[None, :] * stride_res_t + offs_d[:, None], mask=valid[None, :],
                          other=0.0)
            v = tl.load(vr_ptr + res_off + ring[:, None] * stride_res_t + offs_d[None, :], mask=valid[:, None],
                        other=0.0)
            m_i, l_i, acc = _attend_block(q, k_t, v, valid, m_i, l_i, acc, qk_scale, USE_DOT, DOT_DTYPE,
                                          INPUT_PRECISION)

    # stage 4: normalized output (or split partial + log-sum-exp)
    _store_partial(
        o_ptr, lse_ptr, acc, m_i, l_i, b, head0, split.to(tl.int64),
        stride_o_b, stride_o_h, stride_o_s, stride_lse_b, stride_lse_h,
        QG, QG_PAD, HEAD_DIM, SPLIT,
    )

