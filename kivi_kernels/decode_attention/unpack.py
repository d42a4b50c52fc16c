"""Code-word unpacking and the packed tile loaders of the decode-attention kernels. Only @triton.jit code.

Strides of the innermost pool dims are constexpr (they are fixed by the layout), so code-word and scale
loads are provably aligned and vectorized; KEY_VEC limits the key-word loads' width along channels, which
decides the register layout of the dequantized key tile and thereby its shared-memory bank conflicts.
"""

import triton
import triton.language as tl


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
