"""The packed loop of decode attention without tensor cores, for one query head per KV head (MHA). Only
@triton.jit code; the main kernel (kernel.py) calls _fma_packed_blocks when its USE_FMA constexpr is set.

Why: tl.dot takes its B operands from shared memory, so the tensor-core path pays about ten times the packed
bytes in shared-memory traffic for its dequantized tiles (benchmarks/results/kernel_notes.md). Here nothing
is dequantized. Scales fold into the query (keys: a scale per channel and group) and into the probabilities
(values: a scale per token and channel group); zero points become one dot product per group. Each code
then costs a shift, a LOP3 and one fp32 FMA, all in registers.

    keys, channel d, group g:  k = c * s + z = x * (2**BITS s) + (z - 2**BITS s),  x = 1 + c / 2**BITS
        score[n] = sum_d (q 2**BITS s)[d] x[d, n] + sum_d q[d] (z - 2**BITS s)[d]
    values, token n, channel group:  out[c] = sum_n (p 2**BITS s)[n] x[n, c] + sum_n p[n] (z - 2**BITS s)[n]

x is built exactly from the code bits placed under fp32's exponent of 1.0 (_unit_codes).

Layouts, one warp (the launcher's choice): key words as [DC, WK, DJ] (channel dc * DJ + dj, WK word rows):
lanes along dj (16-byte vectors) and the word rows, the DC chunks in each thread, so a score is mostly an
in-thread sum. Value words as [R_IN, T, WV] (token r * T + t): lanes along t and the words, R_IN tokens in
each thread; products accumulate lazily in [T, D] and are summed over t once, after the loop.
The running max rescales the accumulators only when it grows (a scalar branch).
"""

import triton
import triton.language as tl

KEY_DJ = tl.constexpr(16)  # channels of a key word row per lane group (4 lanes x 4 words)


@triton.jit
def _unit_codes(words, K: tl.constexpr, BITS: tl.constexpr):
    """Code K of each int32 word as the fp32 number 1 + code / 2**BITS (exact): a shift and a LOP3."""
    TOP: tl.constexpr = 23 - BITS  # fp32 mantissa bits [TOP, 23) hold the code
    SHIFT: tl.constexpr = K * BITS - TOP
    if SHIFT > 0:
        x = words >> SHIFT
    elif SHIFT < 0:
        x = words << -SHIFT
    else:
        x = words
    x = (x & (((1 << BITS) - 1) << TOP)) | 0x3F800000
    return x.to(tl.float32, bitcast=True)


@triton.jit
def _join8(a0, a1, a2, a3, a4, a5, a6, a7):
    """[..., 2, 2, 2] that reshapes to [..., 8] in argument order (a0 first)."""
    even = tl.join(tl.join(a0, a4), tl.join(a2, a6))
    odd = tl.join(tl.join(a1, a5), tl.join(a3, a7))
    return tl.join(even, odd)


@triton.jit
def _key_code_scores(words, qs, K: tl.constexpr, BITS: tl.constexpr):
    """[WK]: sum over each word row's channels of qs * x for code K (token K of the row)."""
    return tl.sum(tl.sum(qs * _unit_codes(words, K, BITS), axis=2), axis=0)


@triton.jit
def _value_code_sums(words, pm, K: tl.constexpr, BITS: tl.constexpr):
    """[T, WV]: sum over the in-thread tokens of pm * x for code K (channel K of each word)."""
    return tl.sum(pm * _unit_codes(words, K, BITS), axis=0)


@triton.jit
def _per_code(fn: tl.constexpr, words, w, BITS: tl.constexpr):
    """fn(words, w, k, BITS) for every code k of a word, joined: [..., 2, 2, 2(, 2)], which reshapes to
    [..., PER_WORD] in code order."""
    if BITS == 4:
        out = _join8(fn(words, w, 0, BITS), fn(words, w, 1, BITS), fn(words, w, 2, BITS), fn(words, w, 3, BITS),
                     fn(words, w, 4, BITS), fn(words, w, 5, BITS), fn(words, w, 6, BITS), fn(words, w, 7, BITS))
    else:
        lo = _join8(fn(words, w, 0, BITS), fn(words, w, 2, BITS), fn(words, w, 4, BITS), fn(words, w, 6, BITS),
                    fn(words, w, 8, BITS), fn(words, w, 10, BITS), fn(words, w, 12, BITS), fn(words, w, 14, BITS))
        hi = _join8(fn(words, w, 1, BITS), fn(words, w, 3, BITS), fn(words, w, 5, BITS), fn(words, w, 7, BITS),
                    fn(words, w, 9, BITS), fn(words, w, 11, BITS), fn(words, w, 13, BITS), fn(words, w, 15, BITS))
        out = tl.join(lo, hi)  # the last dim is the code's lowest bit
    return out


@triton.jit
def _key_channels(HEAD_DIM: tl.constexpr):
    """[DC, 1, DJ] channel of each key-tile element. Loads through it are 4 elements wide per thread (words:
    16 bytes), so lanes go 4 along dj and then along the word rows: the same layout for the words, their
    scales and the query, which keeps the dc chunks of a score in one thread."""
    DC: tl.constexpr = HEAD_DIM // KEY_DJ
    dj = tl.max_contiguous(tl.multiple_of(tl.arange(0, KEY_DJ), 4), 4)
    return tl.arange(0, DC)[:, None, None] * KEY_DJ + dj[None, None, :]


@triton.jit
def _fma_key_scores(kc_ptr, ks_ptr, kz_ptr, off, q3, stride_kc_w: tl.constexpr, stride_ks_g: tl.constexpr,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Scores [BLOCK_N] of page tokens [off, off + BLOCK_N) (pointers at page, head) against q3 [DC, WK, DJ]
    (the query times qk_scale, repeated over the word rows), in token order."""
    PER_WORD: tl.constexpr = 32 // BITS
    WK: tl.constexpr = BLOCK_N // PER_WORD
    offs_w = tl.arange(0, WK)[None, :, None]
    chan = _key_channels(HEAD_DIM)
    # unmasked: every word and scale row of a block lies inside its page (columns past nq are masked later)
    words = tl.load(kc_ptr + (off // PER_WORD + offs_w) * stride_kc_w + chan)  # [DC, WK, DJ]
    g_ptrs = (off // GROUP + offs_w // (GROUP // PER_WORD)) * stride_ks_g + chan
    mult = tl.load(ks_ptr + g_ptrs).to(tl.float32) * (1 << BITS)
    offset = tl.load(kz_ptr + g_ptrs).to(tl.float32) - mult
    bias = tl.sum(tl.sum(q3 * offset, axis=2), axis=0)  # [WK]
    s = tl.reshape(_per_code(_key_code_scores, words, q3 * mult, BITS), (WK, PER_WORD)) + bias[:, None]
    return tl.reshape(s, (BLOCK_N,))


@triton.jit
def _fma_values(vc_ptr, vs_ptr, vz_ptr, off, n_valid, p3, acc3, acc_off, stride_vc_t: tl.constexpr,
                stride_vs_t: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """acc3 [T, D] += sum over tokens r * T + t of (p * 2**BITS s) x; acc_off [T, WV] += p * offset.

    p3 [R_IN, T]: probabilities of page tokens off + r * T + t (zero past n_valid)."""
    PER_WORD: tl.constexpr = 32 // BITS
    WV: tl.constexpr = HEAD_DIM // PER_WORD
    R_IN: tl.constexpr = p3.shape[0]
    T: tl.constexpr = p3.shape[1]
    tok = tl.arange(0, R_IN)[:, None, None] * T + tl.arange(0, T)[None, :, None]  # [R_IN, T, 1]
    offs_w = tl.arange(0, WV)[None, None, :]
    words = tl.load(vc_ptr + (off + tok) * stride_vc_t + offs_w)  # [R_IN, T, WV]
    # scale rows past n_valid may hold anything (NaN): masked to zero, so they contribute 0 * x
    valid = tok < n_valid
    g_ptrs = (off + tok) * stride_vs_t + offs_w // (GROUP // PER_WORD)
    mult = tl.load(vs_ptr + g_ptrs, mask=valid, other=0.0).to(tl.float32) * (1 << BITS)
    offset = tl.load(vz_ptr + g_ptrs, mask=valid, other=0.0).to(tl.float32) - mult
    p = p3[:, :, None]
    acc_off += tl.sum(p * offset, axis=0)
    acc3 += tl.reshape(_per_code(_value_code_sums, words, p * mult, BITS), (T, HEAD_DIM))
    return acc3, acc_off


@triton.jit
def _fma_packed_blocks(
    q_ptr, b, head0, stride_q_b, stride_q_h, qk_scale,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, blk_lo, blk_hi, nq,
    stride_kc_n, stride_kc_h, stride_kc_w: tl.constexpr, stride_ks_n, stride_ks_h, stride_ks_g: tl.constexpr,
    stride_vc_n, stride_vc_h, stride_vc_t: tl.constexpr, stride_vs_n, stride_vs_h, stride_vs_t: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, VALUE_T: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Packed key blocks [blk_lo, blk_hi) of row b, KV head h, against its single query head head0.

    Returns m [1] (running max, log2 domain), l [1] (denominator) and acc [1, D] (unnormalized output, natural
    channel order), as _attend_block keeps them."""
    WK: tl.constexpr = BLOCK_N * K_BITS // 32
    V_WORD: tl.constexpr = 32 // V_BITS
    WV: tl.constexpr = HEAD_DIM // V_WORD
    R_IN: tl.constexpr = BLOCK_N // VALUE_T
    # stage 1: the query, scaled into the log2 domain, repeated over the word rows of the key tile
    # [DC, WK, DJ] (loaded in the words' layout, so products with them need no layout conversion)
    q_ptrs = q_ptr + b * stride_q_b + head0 * stride_q_h + _key_channels(HEAD_DIM) + tl.zeros([1, WK, 1], tl.int32)
    q3 = tl.load(q_ptrs).to(tl.float32) * qk_scale
    m_i = tl.max(tl.full([2], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([2], tl.float32), axis=0)
    acc3 = tl.zeros([VALUE_T, HEAD_DIM], tl.float32)
    acc_off = tl.zeros([VALUE_T, WV], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # stage 2: blocks through the block table
    for blk in tl.range(blk_lo, blk_hi, num_stages=NUM_STAGES):
        tok = blk * BLOCK_N
        page = tl.load(bt_row + tok // PAGE).to(tl.int64)
        off = tok % PAGE
        n_valid = nq - tok
        s = _fma_key_scores(kc_ptr + page * stride_kc_n + h * stride_kc_h,
                            ks_ptr + page * stride_ks_n + h * stride_ks_h,
                            kz_ptr + page * stride_ks_n + h * stride_ks_h,
                            off, q3, stride_kc_w, stride_ks_g, K_BITS, GROUP, BLOCK_N, HEAD_DIM)
        s = tl.where(offs_n < n_valid, s, float("-inf"))
        # online softmax: rescale the accumulators only when the running max grows
        m_blk = tl.max(s, axis=0)
        if m_blk > m_i:
            alpha = tl.exp2(m_i - m_blk)
            acc3 = acc3 * alpha
            acc_off = acc_off * alpha
            l_i = l_i * alpha
            m_i = m_blk
        p = tl.exp2(s - m_i)
        l_i += tl.sum(p, axis=0)
        acc3, acc_off = _fma_values(vc_ptr + page * stride_vc_n + h * stride_vc_h,
                                    vs_ptr + page * stride_vs_n + h * stride_vs_h,
                                    vz_ptr + page * stride_vs_n + h * stride_vs_h,
                                    off, n_valid, tl.reshape(p, (R_IN, VALUE_T)), acc3, acc_off,
                                    stride_vc_t, stride_vs_t, V_BITS, GROUP, HEAD_DIM)
    # stage 3: fold the lanes' partial sums, back to _attend_block's shapes
    off_d = tl.reshape(tl.broadcast_to(tl.sum(acc_off, axis=0)[:, None], (WV, V_WORD)), (HEAD_DIM,))
    acc = tl.reshape(tl.sum(acc3, axis=0) + off_d, (1, HEAD_DIM))
    return tl.full([1], 0.0, tl.float32) + m_i, tl.full([1], 0.0, tl.float32) + l_i, acc
