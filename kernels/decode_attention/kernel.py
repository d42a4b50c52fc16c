"""Triton kernels for decode attention over the KIVI cache (design.md, op 3). Only @triton.jit code.

Shared with kernels/paged_attention (imported from here, never copied):
    _load_query_group      the Hq / H query heads of one KV head, padded to QG_PAD rows
    _attend_block          one online-softmax step over a [BLOCK_N, D] tile of keys and values
    _store_partial         normalized partial output (+ log-sum-exp when the sequence is split)
    _split_range           which key blocks a split program owns
    _merge_splits_kernel   second pass: merge the splits of one row by their log-sum-exp

The quantized kernel: grid (B, H, num_splits); each program streams its split of the row's BLOCK_N-token
blocks (packed pages through the block table, software-pipelined NUM_STAGES deep, then the residual ring),
unpacks code words in registers (see "Unpacking" below), and feeds tensor cores (tl.dot, query group padded
to 16 rows) with fp16/bf16 tiles; nothing dequantized is written to global memory. The tiles do pass through
shared memory on their way to the tensor cores (Triton's dot-operand conversion), and that traffic (about
ten times the packed bytes) is what bounds the kernel on the H200: benchmarks/results/kernel_notes.md.
Strides of the innermost pool dims are constexpr (they are fixed by the layout), so code-word and scale
loads are provably aligned and vectorized; KEY_VEC limits the key-word loads' width along channels, which
decides the register layout of the dequantized key tile and thereby its shared-memory bank conflicts.

Scores are kept in the log2 domain: the launcher passes qk_scale = sm_scale * log2(e) and the kernels
use exp2; every log-sum-exp in the workspace is a base-2 one.
"""

import triton
import triton.language as tl


@triton.jit
def _split_range(n_blocks, split, num_splits):
    """Contiguous range [lo, hi) of the n_blocks key blocks owned by program `split` of num_splits (a runtime
    int or a constexpr)."""
    per_split = tl.cdiv(n_blocks, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_blocks)
    return lo, hi


@triton.jit
def _scores(q, k_t, valid, qk_scale, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
    """Masked, scaled scores [QG_PAD, BLOCK_N] (log2 domain): tensor cores (query group padded to >= 16
    rows) or multiply-reduce."""
    if USE_DOT:
        s = tl.dot(q, k_t.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
    else:
        s = tl.sum(q[:, :, None] * k_t.to(tl.float32)[None, :, :], axis=1)
    return tl.where(valid[None, :], s * qk_scale, float("-inf"))


@triton.jit
def _weighted_values(p, v, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """P @ V: [QG_PAD, BLOCK_N] x [BLOCK_N, D] -> [QG_PAD, D] fp32."""
    if USE_DOT:
        return tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
    return tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _attend_block(
    q, k_t, v, valid, m_i, l_i, acc, qk_scale,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One online-softmax step over BLOCK_N keys.

    q: [QG_PAD, D] (DOT_DTYPE when USE_DOT, else fp32); k_t: [D, BLOCK_N] keys transposed; v: [BLOCK_N, D];
    valid: [BLOCK_N] bool. m_i, l_i: [QG_PAD] running max (log2 domain) and denominator; acc: [QG_PAD, D] fp32.
    """
    s = _scores(q, k_t, valid, qk_scale, USE_DOT, DOT_DTYPE, INPUT_PRECISION)
    # online softmax; a row that has seen only masked keys keeps m = -inf and contributes nothing
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted_values(p, v, USE_DOT, DOT_DTYPE, INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_block_lazy(
    q, k_t, v, valid, m_i, l_t, acc, qk_scale,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """_attend_block with the denominator kept per column (l_t [QG_PAD, BLOCK_N], summed once after the
    loop): one cross-warp reduction (the max) per step instead of two."""
    s = _scores(q, k_t, valid, qk_scale, USE_DOT, DOT_DTYPE, INPUT_PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_t = l_t * alpha[:, None] + p
    acc = acc * alpha[:, None] + _weighted_values(p, v, USE_DOT, DOT_DTYPE, INPUT_PRECISION)
    return m_new, l_t, acc


@triton.jit
def _store_partial(
    o_ptr, lse_ptr, acc, m_i, l_i, b, head0, split,
    stride_o_b, stride_o_h, stride_o_s, stride_lse_b, stride_lse_h,
    QG: tl.constexpr, QG_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):
    """Write acc / l for query heads [head0, head0 + QG) of row b (zeros where l == 0).

    SPLIT: o_ptr is the fp32 workspace [B, Hq, NUM_SPLITS, D] and lse_ptr gets m + log2(l) (-inf when
    empty); otherwise o_ptr is the final output and lse_ptr is unused.
    """
    offs_h = tl.arange(0, QG_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    heads = head0 + offs_h
    o_ptrs = o_ptr + b * stride_o_b + split * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_h < QG)[:, None])
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lse_b + heads * stride_lse_h + split, lse, mask=offs_h < QG)


@triton.jit
def _merge_splits_kernel(
    ws_o_ptr, ws_lse_ptr, o_ptr,
    stride_ws_b, stride_ws_h, stride_ws_s, stride_lse_b, stride_lse_h, stride_o_b, stride_o_h,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """grid (B, Hq): out[b, h] = sum_s 2**(lse_s - M) o_s / sum_s 2**(lse_s - M); zeros if all splits empty."""
    tl.static_assert(SPLITS_PAD >= NUM_SPLITS)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    # weights of the splits
    lse = tl.load(ws_lse_ptr + b * stride_lse_b + h * stride_lse_h + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    denom = tl.sum(w, axis=0)
    # weighted sum of the normalized partial outputs
    o_ptrs = ws_o_ptr + b * stride_ws_b + h * stride_ws_h + offs_s[:, None] * stride_ws_s + offs_d[None, :]
    parts = tl.load(o_ptrs, mask=s_mask[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_ptr + b * stride_o_b + h * stride_o_h + offs_d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _load_query_group(q_ptr, b, head0, stride_q_b, stride_q_h, QG: tl.constexpr, QG_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Query heads [head0, head0 + QG) of row b as [QG_PAD, D] (padding rows zero)."""
    offs_h = tl.arange(0, QG_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + b * stride_q_b + (head0 + offs_h)[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_h < QG)[:, None], other=0.0).to(tl.float32)
    if USE_DOT:
        q = q.to(DOT_DTYPE)
    return q


# ---------------------------------------------------------------------------------------------------------
# Unpacking. One shift and one LOP3 move two codes of a word into the two 16-bit halves of an int32 (code
# k of the word into the low half, code k + PER_WORD / 2 into the high half), placed in the top mantissa
# bits under the exponent of 1.0: each half *is* the fp16/bf16 number 1 + code / 2**BITS. One packed
# HFMA2 then dequantizes both: x * (2**BITS * scale) + (zero - 2**BITS * scale). fp32 caches use exact
# integer codes (2**23 magic) and the plain scale and zero. Position 2k + a of a word's expansion holds code
# k + a * PER_WORD / 2, so register pairs are memory neighbours; the kernel undoes this order (keys: the
# value rows it loads follow it; values: the accumulator's channels are permuted back).
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _code_pair(words, K: tl.constexpr, BITS: tl.constexpr, DEQ_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """[R, C, 2] in DEQ_DTYPE from codes k and k + PER_WORD / 2 of int32 words [R, C].

    fp32: the codes themselves; fp16 / bf16: 1 + code / 2**BITS.
    """
    if DEQ_DTYPE == tl.float32:
        x = (words >> (K * BITS)) & (((1 << BITS) - 1) * 0x10001)
        lo = ((x & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # exact: 2**23 magic
        hi = ((x >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        pair = tl.join(lo, hi)
    else:
        if DEQ_DTYPE == tl.float16:
            LOW: tl.constexpr = 10 - BITS  # lowest bit of the code: the top of the 10-bit mantissa
            ONE: tl.constexpr = 0x3C003C00  # 1.0 in both halves
        else:
            LOW: tl.constexpr = 7 - BITS  # bf16: 7-bit mantissa
            ONE: tl.constexpr = 0x3F803F80
        SHIFT: tl.constexpr = K * BITS - LOW
        if SHIFT > 0:
            x = words >> SHIFT
        elif SHIFT < 0:
            x = words << -SHIFT
        else:
            x = words
        x = (x & ((((1 << BITS) - 1) << LOW) * 0x10001)) | ONE
        if USE_ASM:
            # the int32 *is* the packed pair: reinterpret it as two 16-bit floats (no repacking PRMTs)
            if DEQ_DTYPE == tl.float16:
                pair = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [tl.join(x, x)], dtype=tl.float16,
                                                 is_pure=True, pack=2)
            else:
                pair = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [tl.join(x, x)], dtype=tl.bfloat16,
                                                 is_pure=True, pack=2)
        else:
            lo = x.to(tl.int16).to(DEQ_DTYPE, bitcast=True)
            hi = (x >> 16).to(tl.int16).to(DEQ_DTYPE, bitcast=True)
            pair = tl.join(lo, hi)
    return pair


@triton.jit
def _scale_zero(scale, zero, BITS: tl.constexpr, DEQ_DTYPE: tl.constexpr):
    """Loaded scale/zero (any float dtype) -> the (multiplier, offset) that _code_pair's values need."""
    scale = scale.to(tl.float32)
    zero = zero.to(tl.float32)
    if DEQ_DTYPE == tl.float32:
        return scale, zero
    scale = scale * (1 << BITS)  # exact
    return scale.to(DEQ_DTYPE), (zero - scale).to(DEQ_DTYPE)


@triton.jit
def _dequantize_words(words, mult, offset, BITS: tl.constexpr, DEQ_DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """words int32 [R, C], mult/offset [R, C] from _scale_zero -> [R, C, 32 // BITS] values in DEQ_DTYPE.

    Position 2k + a of the last dim holds code k + a * PER_WORD / 2 of the word (a register pair).
    """
    tl.static_assert(BITS == 2 or BITS == 4)
    PER_WORD: tl.constexpr = 32 // BITS
    p0 = _code_pair(words, 0, BITS, DEQ_DTYPE, USE_ASM)
    p1 = _code_pair(words, 1, BITS, DEQ_DTYPE, USE_ASM)
    p2 = _code_pair(words, 2, BITS, DEQ_DTYPE, USE_ASM)
    p3 = _code_pair(words, 3, BITS, DEQ_DTYPE, USE_ASM)
    # tl.join appends a minor dim: these leaf orders make the joined dims count k = 0, 1, ...; the pair
    # halves (a) stay the minor dim, so each register pair keeps its two codes
    l0, h0 = tl.split(p0)
    l1, h1 = tl.split(p1)
    l2, h2 = tl.split(p2)
    l3, h3 = tl.split(p3)
    if BITS == 4:
        lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))  # [R, C, k1, k0]
        hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    else:
        l4, h4 = tl.split(_code_pair(words, 4, BITS, DEQ_DTYPE, USE_ASM))
        l5, h5 = tl.split(_code_pair(words, 5, BITS, DEQ_DTYPE, USE_ASM))
        l6, h6 = tl.split(_code_pair(words, 6, BITS, DEQ_DTYPE, USE_ASM))
        l7, h7 = tl.split(_code_pair(words, 7, BITS, DEQ_DTYPE, USE_ASM))
        lo = tl.join(tl.join(tl.join(l0, l4), tl.join(l2, l6)), tl.join(tl.join(l1, l5), tl.join(l3, l7)))
        hi = tl.join(tl.join(tl.join(h0, h4), tl.join(h2, h6)), tl.join(tl.join(h1, h5), tl.join(h3, h7)))
    codes = tl.join(lo, hi)  # [R, C, k..., a]
    codes = tl.reshape(codes, (words.shape[0], words.shape[1], PER_WORD))
    return codes * mult[:, :, None] + offset[:, :, None]


@triton.jit
def _word_order(n, PER_WORD: tl.constexpr):
    """Index (token of a key tile, channel of a value tile) held at tile position n."""
    j = n % PER_WORD
    return n - j + j // 2 + (j % 2) * (PER_WORD // 2)


@triton.jit
def _load_packed_keys_t(
    kc_ptr, ks_ptr, kz_ptr, off, n_valid, stride_kc_w, stride_ks_g,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DEQ_DTYPE: tl.constexpr, USE_ASM: tl.constexpr, KEY_VEC: tl.constexpr = 4,
):
    """Dequantized keys, transposed: [D, BLOCK_N] of page tokens off + _word_order(n) (pointers at page, head).

    k_codes word w, channel d holds tokens w * PER_WORD + i; words of tokens >= n_valid load as zeros.
    """
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_N // PER_WORD
    N_GROUPS: tl.constexpr = (BLOCK_N + GROUP - 1) // GROUP  # scale rows in the block
    tl.static_assert(BLOCK_N % PER_WORD == 0)
    offs_d = tl.max_contiguous(tl.arange(0, HEAD_DIM), KEY_VEC)
    # words, transposed [D, WORDS]
    offs_w = tl.arange(0, WORDS)
    w_ptrs = kc_ptr + (off // PER_WORD + offs_w)[None, :] * stride_kc_w + offs_d[:, None]
    # unmasked: every word and scale row of a block lies inside its page; key columns past nq are masked
    # out of the scores (a NaN there never reaches the output)
    words = tl.load(w_ptrs)
    # scale / zero rows, transposed [D, N_GROUPS], repeated over the words of each group: [D, WORDS]
    offs_g = tl.arange(0, N_GROUPS)
    g_ptrs = (off // GROUP + offs_g)[None, :] * stride_ks_g + offs_d[:, None]
    scale, zero = _scale_zero(tl.load(ks_ptr + g_ptrs), tl.load(kz_ptr + g_ptrs), BITS, DEQ_DTYPE)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (HEAD_DIM, N_GROUPS, WORDS // N_GROUPS)),
                       (HEAD_DIM, WORDS))
    zero = tl.reshape(tl.broadcast_to(zero[:, :, None], (HEAD_DIM, N_GROUPS, WORDS // N_GROUPS)),
                      (HEAD_DIM, WORDS))
    keys = _dequantize_words(words, scale, zero, BITS, DEQ_DTYPE, USE_ASM)  # [D, WORDS, PER_WORD]
    return tl.reshape(keys, (HEAD_DIM, BLOCK_N))


@triton.jit
def _load_packed_values(
    vc_ptr, vs_ptr, vz_ptr, rows, row_valid, stride_vc_t, stride_vs_t,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DEQ_DTYPE: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Dequantized values [BLOCK_N, D] of page tokens `rows` (pointers at page, head); channel c of the
    tile is channel _word_order(c) of the head. Rows not valid load as zeros."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = HEAD_DIM // PER_WORD
    N_GROUPS: tl.constexpr = HEAD_DIM // GROUP
    tl.static_assert(HEAD_DIM % GROUP == 0)
    tl.static_assert(GROUP % PER_WORD == 0)
    row_mask = row_valid[:, None]
    # words [BLOCK_N, WORDS]
    offs_w = tl.arange(0, WORDS)
    words = tl.load(vc_ptr + rows[:, None] * stride_vc_t + offs_w[None, :])  # rows past nq: scale = zero = 0
    # scale / zero [BLOCK_N, N_GROUPS], repeated over the words of each group: [BLOCK_N, WORDS]
    g_ptrs = rows[:, None] * stride_vs_t + tl.arange(0, N_GROUPS)[None, :]
    scale, zero = _scale_zero(tl.load(vs_ptr + g_ptrs, mask=row_mask, other=0.0),
                              tl.load(vz_ptr + g_ptrs, mask=row_mask, other=0.0), BITS, DEQ_DTYPE)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, N_GROUPS, WORDS // N_GROUPS)), (BLOCK_N, WORDS))
    zero = tl.reshape(tl.broadcast_to(zero[:, :, None], (BLOCK_N, N_GROUPS, WORDS // N_GROUPS)), (BLOCK_N, WORDS))
    values = _dequantize_words(words, scale, zero, BITS, DEQ_DTYPE, USE_ASM)  # [BLOCK_N, WORDS, PER_WORD]
    return tl.reshape(values, (BLOCK_N, HEAD_DIM))


@triton.jit
def _unpermute_channels(acc, QG_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """acc [QG_PAD, D] with column c holding channel _word_order(c) -> natural channel order."""
    PER_WORD: tl.constexpr = 32 // BITS
    acc = tl.reshape(acc, (QG_PAD, HEAD_DIM // PER_WORD, PER_WORD // 2, 2))
    return tl.reshape(tl.permute(acc, (0, 1, 3, 2)), (QG_PAD, HEAD_DIM))


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
    SWAP_AB: tl.constexpr = False, RING_N: tl.constexpr = 0,
):
    """grid (B, H, num_splits): KV head h of row b against its QG query heads, one split of the keys.

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
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
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


# the swapped-operand packed loop uses the unpacking helpers above (imported last: it imports them from here)
from .kernel_swap import _swap_packed_blocks  # noqa: E402
