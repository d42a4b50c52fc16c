"""The packed loop of decode attention with the dequantized tiles as the tensor cores' register operand
(2-bit keys and values, head_dim 128, 128-token blocks, one warp). Only @triton.jit code; the main kernel
(kernel.py) calls _swap_packed_blocks when its SWAP_AB constexpr is set.

Why: in `q @ k^T` and `p @ v` the dequantized tiles are tl.dot's B operand, which Triton stages through
shared memory: about ten times the packed bytes of shared-memory traffic, the bound of the other path
(benchmarks/results/kernel_notes.md). Here the products are transposed, s^T = k @ q^T and o^T = v^T @ p^T,
so the big tiles are the A operand of mma.sync, which lives in registers, and the small ones (q^T, p^T)
take the shared-memory route.

The A operand of an m16n8k16 mma puts row g + 8a + 16i (i: the 16-row tile) and columns 2t + b + 8h on
lane 4g + t. Tokens and channels may be numbered in any order as long as both products agree, so rows and
columns are chosen to make each lane's A fragment come from the code words it loaded itself:
    keys   (a [128, 16] tile per 16-channel chunk dc): row 16k + 8a + g <-> token 16g + k + 8a (the 16 codes of
           key word row g), column 8h + 2t + b <-> channel 16dc + 4t + 2h + b (lane t loads 4 channels);
    values (a [128, 16] tile per 16-token chunk kc of s^T's rows): row 16k + 8a + g <-> channel 16g + k + 8a
           (the 16 codes of value word g), column 8h + 2t + b <-> s^T row 16kc + 8h + 2t + b, which is token
           32t + 16b + kc + 8h.
Code k + 8a of a word sits at position 2k + a of _dequantize_words' expansion, which is why rows count
(k, a) that way.

Measured on the H200 (benchmarks/results/kernels-20261129-h200-sweep-swap.json, kernel_notes.md version 8):
the loop body has no shared-memory traffic for the tiles any more, yet it runs within -12%..+25% of the
other path: removing that traffic exposed the next limit (instruction issue and latency of one-warp
programs), not the DRAM bound. The launcher uses it only where it measured faster (ops.prefer_swap).
"""

import triton
import triton.language as tl

from .unpack import _dequantize_words, _scale_zero


@triton.jit
def _key_tile(kc_ptr, ks_ptr, kz_ptr, off, dc: tl.constexpr, stride_kc_w: tl.constexpr,
              stride_ks_g: tl.constexpr, GROUP: tl.constexpr, DEQ_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Dequantized keys of page tokens [off, off + 128), channels [16 dc, 16 dc + 16), as the A tile [128, 16]."""
    offs_g = tl.arange(0, 8)[:, None]  # word row: tokens 16g .. 16g + 15
    chan = dc * 16 + tl.max_contiguous(tl.multiple_of(tl.arange(0, 16), 4), 4)[None, :]  # 4 per lane
    words = tl.load(kc_ptr + (off // 16 + offs_g) * stride_kc_w + chan)  # [8, 16]
    g_ptrs = (off // GROUP + offs_g * 16 // GROUP) * stride_ks_g + chan
    mult, offset = _scale_zero(tl.load(ks_ptr + g_ptrs), tl.load(kz_ptr + g_ptrs), 2, DEQ_DTYPE)
    keys = _dequantize_words(words, mult, offset, 2, DEQ_DTYPE, USE_ASM)  # [g, 4t + 2h + b, 2k + a]
    keys = tl.permute(tl.reshape(keys, (8, 4, 2, 2, 8, 2)), (4, 5, 0, 2, 1, 3))  # [k, a, g, h, t, b]
    return tl.reshape(keys, (128, 16))


@triton.jit
def _query_chunk(q_ptr, b, head0, stride_q_b, stride_q_h, dc: tl.constexpr, QG: tl.constexpr,
                 QG_PAD: tl.constexpr, DEQ_DTYPE: tl.constexpr):
    """q^T rows of channel chunk dc, in _key_tile's column order: [16, QG_PAD] (padding heads zero)."""
    col = tl.arange(0, 16)
    chan = dc * 16 + (col % 8) // 2 * 4 + (col // 8) * 2 + col % 2
    heads = tl.arange(0, QG_PAD)
    q_ptrs = q_ptr + b * stride_q_b + (head0 + heads)[None, :] * stride_q_h + chan[:, None]
    return tl.load(q_ptrs, mask=(heads < QG)[None, :], other=0.0).to(DEQ_DTYPE)


@triton.jit
def _value_product(vc_ptr, vs_ptr, vz_ptr, off, n_valid, kc: tl.constexpr, p_t, acc_t,
                   stride_vc_t: tl.constexpr, stride_vs_t: tl.constexpr, GROUP: tl.constexpr,
                   DEQ_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc_t [128, QG_PAD] += v^T tile of s^T-row chunk kc (tokens 32t + 16b + kc + 8h) @ p_t [16, QG_PAD]."""
    reg = tl.arange(0, 4)[:, None]  # (b, h) = (reg // 2, reg % 2)
    lane = tl.arange(0, 32)[None, :]  # 4g + t
    word = lane // 4
    tok = 32 * (lane % 4) + 16 * (reg // 2) + kc + 8 * (reg % 2)  # [4, 32]
    words = tl.load(vc_ptr + (off + tok) * stride_vc_t + word)
    valid = tok < n_valid
    g_ptrs = (off + tok) * stride_vs_t + word * 16 // GROUP
    # scale rows past n_valid may hold anything (NaN): zero scales give finite 0 * x values there
    mult, offset = _scale_zero(tl.load(vs_ptr + g_ptrs, mask=valid, other=0.0),
                               tl.load(vz_ptr + g_ptrs, mask=valid, other=0.0), 2, DEQ_DTYPE)
    values = _dequantize_words(words, mult, offset, 2, DEQ_DTYPE, USE_ASM)  # [(b, h), (g, t), 2k + a]
    values = tl.permute(tl.reshape(values, (2, 2, 8, 4, 8, 2)), (4, 5, 2, 1, 3, 0))  # [k, a, g, h, t, b]
    return tl.dot(tl.reshape(values, (128, 16)), p_t, acc_t, input_precision=INPUT_PRECISION)


@triton.jit
def _row_chunk(x, C: tl.constexpr):
    """Rows 16C .. 16C + 15 of x [128, N] as [16, N] (register renames only: the chunk index is a register dim)."""
    N: tl.constexpr = x.shape[1]
    x = tl.reshape(tl.permute(tl.reshape(x, (8, 16, N)), (1, 2, 0)), (16, N, 2, 2, 2))  # C = 4c2 + 2c1 + c0
    lo, hi = tl.split(x)  # c0
    if C % 2 == 1:
        x = hi
    else:
        x = lo
    lo, hi = tl.split(x)  # c1
    if (C // 2) % 2 == 1:
        x = hi
    else:
        x = lo
    lo, hi = tl.split(x)  # c2
    if C // 4 == 1:
        x = hi
    else:
        x = lo
    return x


@triton.jit
def _swap_packed_blocks(
    q_ptr, b, head0, stride_q_b, stride_q_h, qk_scale,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, blk_lo, blk_hi, nq,
    stride_kc_n, stride_kc_h, stride_kc_w: tl.constexpr, stride_ks_n, stride_ks_h, stride_ks_g: tl.constexpr,
    stride_vc_n, stride_vc_h, stride_vc_t: tl.constexpr, stride_vs_n, stride_vs_h, stride_vs_t: tl.constexpr,
    GROUP: tl.constexpr, PAGE: tl.constexpr, QG: tl.constexpr, QG_PAD: tl.constexpr, DEQ_DTYPE: tl.constexpr,
    USE_ASM: tl.constexpr, NUM_STAGES: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Packed 128-token blocks [blk_lo, blk_hi) of row b, KV head h, against query heads [head0, head0 + QG).

    Returns m [QG_PAD] (running max, log2 domain), l [QG_PAD] and acc [QG_PAD, 128] (unnormalized, natural
    channel order), as _attend_block keeps them."""
    # stage 1: online-softmax state
    m_i = tl.full([QG_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QG_PAD], tl.float32)
    acc_t = tl.zeros([128, QG_PAD], tl.float32)
    # s^T row r holds token 16 (r % 8) + r // 16 + 8 ((r // 8) % 2)
    r = tl.arange(0, 128)
    row_tok = 16 * (r % 8) + r // 16 + 8 * ((r // 8) % 2)
    # stage 2: blocks through the block table
    for blk in tl.range(blk_lo, blk_hi, num_stages=NUM_STAGES):
        tok = blk * 128
        page = tl.load(bt_row + tok // PAGE).to(tl.int64)
        off = tok % PAGE
        n_valid = nq - tok
        kp = kc_ptr + page * stride_kc_n + h * stride_kc_h
        sp = page * stride_ks_n + h * stride_ks_h
        s_t = tl.zeros([128, QG_PAD], tl.float32)
        for dc in tl.static_range(8):  # s^T += k tile @ q^T, 16 channels at a time (the compiler hoists q^T)
            s_t = tl.dot(_key_tile(kp, ks_ptr + sp, kz_ptr + sp, off, dc, stride_kc_w, stride_ks_g, GROUP, DEQ_DTYPE,
                                   USE_ASM),
                         _query_chunk(q_ptr, b, head0, stride_q_b, stride_q_h, dc, QG, QG_PAD, DEQ_DTYPE), s_t,
                         input_precision=INPUT_PRECISION)
        # online softmax over the block's tokens (rows); masked rows never count
        s_t = tl.where((row_tok < n_valid)[:, None], s_t * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_t = tl.exp2(s_t - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p_t, axis=0)
        acc_t = acc_t * alpha[None, :]
        m_i = m_new
        # o^T += v^T @ p^T, 16 s^T rows at a time
        p_t = p_t.to(DEQ_DTYPE)
        vp = vc_ptr + page * stride_vc_n + h * stride_vc_h
        vs = vs_ptr + page * stride_vs_n + h * stride_vs_h
        vz = vz_ptr + page * stride_vs_n + h * stride_vs_h
        for kc in tl.static_range(8):
            acc_t = _value_product(vp, vs, vz, off, n_valid, kc, _row_chunk(p_t, kc), acc_t, stride_vc_t,
                                   stride_vs_t, GROUP, DEQ_DTYPE, USE_ASM, INPUT_PRECISION)
    # stage 3: o^T row 16k + 8a + g is channel 16g + 8a + k -> [QG_PAD, 128] in channel order
    acc = tl.permute(tl.reshape(acc_t, (8, 2, 8, QG_PAD)), (3, 2, 1, 0))  # [QG_PAD, g, a, k]
    return m_i, l_i, tl.reshape(acc, (QG_PAD, 128))
