"""Decode attention over a 2-bit KIVI cache on the FMA pipe, in Gluon (Triton's explicit-layout dialect).
Only @gluon.jit code; the launcher is ops.decode_attention (its fma path).

One query head per KV head (Llama-2-style MHA), head_dim 128, 2-bit keys and values, BLOCK_N-token steps
(64 or 128), one warp per program. Scales fold into the query (keys) and into the probabilities (values),
so nothing is dequantized and no tile passes through shared memory:
    score[t] = sum_c (4 q[c] k_scale[g, c]) u[t, c] + sum_c q[c] (k_zero[g, c] - 4 k_scale[g, c])
    out[c]  += sum_t (4 p[t] v_scale[t, g]) u[t, c] + sum_t p[t] (v_zero[t, g] - 4 v_scale[t, g])
with u = 1 + code / 4: codes j and j + 8 of a word become an fp16 pair by one funnel shift and one LOP3,
widened to fp32 for one FFMA each. Plain Triton chooses its own layouts and puts lanes on the reduced dim
of these tiles (the channels of a key word row; kernel_notes.md version 7); here the layouts are explicit:
    keys   [128 channels, K_WORDS = BLOCK_N / 16 words, 8 codes]: lanes = 32 / K_WORDS channel groups x
           K_WORDS words, so a score sums 128 * K_WORDS / 32 products in a thread, then across lanes;
    values [BLOCK_N / 16, 8 (token 16 i + 8 a + j), 8 words, 8 codes]: lanes = 4 token groups x 8 value
           words, so an output channel sums BLOCK_N / 4 products in a thread, then across 4 lanes.
Each thread holds channels 16 w + c and 16 w + 8 + c of its value word (acc_lo, acc_hi). The residual ring
(at most R full-precision tokens) is read in 32-token chunks in the accumulators' channel layout.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# residual ring [32 tokens, V_WORDS, 8]: channel 16 w + 8 b + c for one half b, as the accumulator holds it
_LR = gl.constexpr(gl.BlockedLayout([8, 1, 8], [4, 8, 1], [1, 1, 1], [2, 0, 1]))


@gluon.jit
def _unit_pairs(words, rot):
    """(1 + code_j / 4, 1 + code_(j+8) / 4) in fp32 of int32 words, broadcast against rot = (40 - 2 j) % 32
    (non-negative: Triton's % of a negative int is negative).

    One funnel shift (a rotation) brings codes j and j + 8 to bits 8-9 and 24-25, the tops of the two fp16
    mantissas; one LOP3 keeps them and sets both exponents to 1.0's; two conversions widen the halves. That is
    two integer instructions per two codes (the integer pipe runs at half the FMA pipe's rate on the H200)."""
    w = words.to(gl.uint32, bitcast=True)
    x = ((w << rot) | (w >> ((32 - rot) % 32))).to(gl.int32, bitcast=True)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 m, x; .reg .b16 l, h; mov.b32 m, 0x03000300; lop3.b32 x, $2, m, 0x3C003C00, 0xEA; "
        "mov.b32 {l, h}, x; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
        "=r,=r,r", [x], dtype=(gl.float32, gl.float32), is_pure=True, pack=1)


@gluon.jit
def _value_half(vc_ptr, vs_ptr, vz_ptr, off, n_valid, p, a: gl.constexpr, LV: gl.constexpr,
                stride_vc_t: gl.constexpr, stride_vs_t: gl.constexpr, GROUP: gl.constexpr):
    """Value sums of tokens 16 i + 8 a + j (p [NI, 8 j]) over each thread's tokens: [NI, 8 w, 8 c] partials of
    channels 16 w + c and 16 w + 8 + c (lanes of dim 0 hold the other tokens; the caller sums them)."""
    VT3: gl.constexpr = gl.SliceLayout(3, LV)  # [NI, 8 j, V_WORDS]
    NI: gl.constexpr = LV.size_per_thread[0] * LV.threads_per_warp[0]
    offs_i = gl.arange(0, NI, layout=gl.SliceLayout(1, gl.SliceLayout(2, VT3)))
    offs_j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, VT3)))
    offs_vw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, VT3)))
    row = (offs_i * 16 + 8 * a)[:, None] + offs_j[None, :]  # [NI, 8]
    rows = (off + row)[:, :, None]
    words = gl.load(vc_ptr + rows * stride_vc_t + offs_vw[None, None, :])
    # scale rows past nq may hold anything (NaN): zeros there keep 0 * x finite
    valid = (row < n_valid)[:, :, None] & (offs_vw < 8)[None, None, :]
    s_offs = rows * stride_vs_t + (offs_vw * 16 // GROUP)[None, None, :]
    v_mult = gl.load(vs_ptr + s_offs, mask=valid, other=0.0).to(gl.float32) * 4.0
    v_off = gl.load(vz_ptr + s_offs, mask=valid, other=0.0).to(gl.float32) - v_mult
    p_v = gl.convert_layout(p, gl.SliceLayout(2, VT3))[:, :, None]
    p_mult = (p_v * v_mult)[:, :, :, None]
    bias = gl.sum((p_v * v_off)[:, :, :, None], axis=1)  # [NI, 8, 1]
    rot = (40 - 2 * gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV))))) % 32
    lo, hi = _unit_pairs(words[:, :, :, None], rot.to(gl.uint32)[None, None, None, :])
    return gl.sum(lo * p_mult, axis=1) + bias, gl.sum(hi * p_mult, axis=1) + bias


@gluon.jit
def _packed_block(q_c, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, off, n_valid, m_i, l_i, acc_lo, acc_hi,
                  LK: gl.constexpr, LV: gl.constexpr, stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr,
                  stride_vc_t: gl.constexpr, stride_vs_t: gl.constexpr, GROUP: gl.constexpr):
    """One online-softmax step over page tokens [off, off + 16 K_WORDS) (pointers at the page and head)."""
    KW2: gl.constexpr = gl.SliceLayout(2, LK)  # [D, K_WORDS]
    S2: gl.constexpr = gl.SliceLayout(0, LK)  # [K_WORDS, 8] scores
    K_WORDS: gl.constexpr = LK.threads_per_warp[1]
    # stage 1: key words [D, K_WORDS] and their scales, folded into the query
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(1, KW2))
    offs_kw = gl.arange(0, K_WORDS, layout=gl.SliceLayout(0, KW2))
    words = gl.load(kc_ptr + (off // 16 + offs_kw)[None, :] * stride_kc_w + offs_c[:, None])
    g_offs = ((off + offs_kw * 16) // GROUP)[None, :] * stride_ks_g + offs_c[:, None]
    k_mult = gl.load(ks_ptr + g_offs).to(gl.float32) * 4.0
    k_off = gl.load(kz_ptr + g_offs).to(gl.float32) - k_mult
    q_mult = (q_c[:, None] * k_mult)[:, :, None]
    bias = gl.sum((q_c[:, None] * k_off)[:, :, None], axis=0)  # [K_WORDS, 1]
    # stage 2: scores of tokens 16 w + j (lo) and 16 w + 8 + j (hi), [K_WORDS, 8], log2 domain (q_c is scaled)
    rot = (40 - 2 * gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LK)))) % 32
    lo, hi = _unit_pairs(words[:, :, None], rot.to(gl.uint32)[None, None, :])
    tok = ((gl.arange(0, K_WORDS, layout=gl.SliceLayout(1, S2)) * 16)[:, None]
           + gl.arange(0, 8, layout=gl.SliceLayout(0, S2))[None, :])
    s_lo = gl.where(tok < n_valid, gl.sum(lo * q_mult, axis=0) + bias, float("-inf"))
    s_hi = gl.where(tok + 8 < n_valid, gl.sum(hi * q_mult, axis=0) + bias, float("-inf"))
    # stage 3: online softmax
    m_new = gl.maximum(m_i, gl.maximum(gl.max(gl.max(s_lo, axis=1), axis=0), gl.max(gl.max(s_hi, axis=1), axis=0)))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p_lo = gl.exp2(s_lo - m_safe)
    p_hi = gl.exp2(s_hi - m_safe)
    l_i = l_i * alpha + gl.sum(gl.sum(p_lo + p_hi, axis=1), axis=0)
    # stage 4: the values of both token halves into acc (channel 16 w + c: acc_lo, 16 w + 8 + c: acc_hi); the
    # halves add inside each thread before the sum across lanes
    v0_lo, v0_hi = _value_half(vc_ptr, vs_ptr, vz_ptr, off, n_valid, p_lo, 0, LV, stride_vc_t, stride_vs_t, GROUP)
    v1_lo, v1_hi = _value_half(vc_ptr, vs_ptr, vz_ptr, off, n_valid, p_hi, 1, LV, stride_vc_t, stride_vs_t, GROUP)
    acc_lo = acc_lo * alpha + gl.sum(v0_lo + v1_lo, axis=0)
    acc_hi = acc_hi * alpha + gl.sum(v0_hi + v1_hi, axis=0)
    return m_new, l_i, acc_lo, acc_hi


@gluon.jit
def _ring_block(q_lo, q_hi, kr_ptr, vr_ptr, start, nq_mod, n_res, m_i, l_i, acc_lo, acc_hi,
                stride_res_t: gl.constexpr, RESIDUAL: gl.constexpr):
    """One online-softmax step over ring slots [start, start + 32) (pointers at the row's slot and head)."""
    R3: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _LR))  # [32] tokens
    offs_t = start + gl.arange(0, 32, layout=R3)
    offs_w = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(0, _LR)))
    offs_c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, _LR)))
    chan = (offs_w * 16)[:, None] + offs_c[None, :]  # [8, 8]: the lo half; + 8 for the hi half
    valid = ((offs_t + RESIDUAL - nq_mod) % RESIDUAL < n_res) & (offs_t < RESIDUAL)
    ptrs = offs_t[:, None, None] * stride_res_t + chan[None, :, :]
    mask = valid[:, None, None] & (chan < 128)[None, :, :]
    k_lo = gl.load(kr_ptr + ptrs, mask=mask, other=0.0).to(gl.float32)
    k_hi = gl.load(kr_ptr + ptrs + 8, mask=mask, other=0.0).to(gl.float32)
    s = gl.sum(gl.sum(k_lo * q_lo[None, :, :] + k_hi * q_hi[None, :, :], axis=2), axis=1)
    s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe)
    l_i = l_i * alpha + gl.sum(p, axis=0)
    p = p[:, None, None]
    o_lo = gl.sum(p * gl.load(vr_ptr + ptrs, mask=mask, other=0.0).to(gl.float32), axis=0)
    o_hi = gl.sum(p * gl.load(vr_ptr + ptrs + 8, mask=mask, other=0.0).to(gl.float32), axis=0)
    acc_lo = acc_lo * alpha + gl.convert_layout(o_lo, acc_lo.type.layout)
    acc_hi = acc_hi * alpha + gl.convert_layout(o_hi, acc_hi.type.layout)
    return m_new, l_i, acc_lo, acc_hi


@gluon.jit
def _decode_attention_fma_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr,
    block_table_ptr, slots_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    qk_scale, num_splits,
    stride_q_b, stride_q_h,
    stride_kc_n, stride_kc_h, stride_kc_w: gl.constexpr,
    stride_ks_n, stride_ks_h, stride_ks_g: gl.constexpr,
    stride_vc_n, stride_vc_h, stride_vc_t: gl.constexpr,
    stride_vs_n, stride_vs_h, stride_vs_t: gl.constexpr,
    stride_res_s, stride_res_h, stride_res_t: gl.constexpr,
    stride_bt_s,
    stride_o_b, stride_o_h, stride_o_s, stride_lse_b, stride_lse_h,
    GROUP: gl.constexpr, RESIDUAL: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
    BLOCK_N: gl.constexpr = 128,
):
    """grid (B, H, num_splits): query head h of row b against KV head h (Hq == H), one split of the keys.

    Key blocks of one row: the packed tokens [0, nq) in BLOCK_N-token steps through the block table, then the
    ring slots [0, min(L, R)) in 128-slot steps; a split owns a contiguous range of those blocks (as in
    kernel.py). Output: acc / l in o_ptr's dtype, or with SPLIT the fp32 partial and its base-2 log-sum-exp.
    """
    gl.static_assert(PAGE % BLOCK_N == 0 and (BLOCK_N == 64 or BLOCK_N == 128))
    gl.static_assert(RESIDUAL % 32 == 0)
    K_WORDS: gl.constexpr = BLOCK_N // 16
    # keys [D, K_WORDS, 8 codes j]: channel = 4 (lanes of dim 0) r + 4 lane + i, i < 4 in a 16-byte load;
    # token 16 w + j (lo) or 16 w + 8 + j (hi)
    LK: gl.constexpr = gl.BlockedLayout([4, 1, 8], [32 // K_WORDS, K_WORDS, 1], [1, 1, 1], [2, 0, 1])
    # values [BLOCK_N / 16 i, 8 j, 8 words w, 8 codes c]: token 16 i + 8 a + j (a: the half), channel 16 w + c
    # (lo) or 16 w + 8 + c (hi); lanes = 4 token groups x 8 words
    LV: gl.constexpr = gl.BlockedLayout([BLOCK_N // 64, 8, 1, 8], [4, 1, 8, 1], [1, 1, 1, 1], [3, 1, 0, 2])
    ACC2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LV))  # [8 words, 8]: channels 16 w + c (+ 8)
    b = gl.program_id(0).to(gl.int64)
    h = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    # stage 0: this row's token ranges and this split's blocks
    seq_len = gl.load(seq_lens_ptr + b)
    slot = gl.load(slots_ptr + b).to(gl.int64)
    nq = gl.cdiv(gl.maximum(seq_len - RESIDUAL, 0), GROUP) * GROUP
    n_res = seq_len - nq
    n_packed = gl.cdiv(nq, BLOCK_N)
    n_blocks = n_packed + gl.cdiv(gl.minimum(seq_len, RESIDUAL), 128)
    per_split = gl.cdiv(n_blocks, num_splits)
    lo = split * per_split
    hi = gl.minimum(lo + per_split, n_blocks)
    # stage 1: the query, scaled into the log2 domain, in the key tiles' and the ring's layouts
    q_row = q_ptr + b * stride_q_b + h * stride_q_h
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(1, gl.SliceLayout(2, LK)))
    q_c = gl.load(q_row + offs_c).to(gl.float32) * qk_scale
    offs_w = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(0, _LR)))
    offs_cc = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, _LR)))
    q_lo = gl.load(q_row + (offs_w * 16)[:, None] + offs_cc[None, :]).to(gl.float32) * qk_scale
    q_hi = gl.load(q_row + (offs_w * 16 + 8)[:, None] + offs_cc[None, :]).to(gl.float32) * qk_scale
    m_i = gl.to_tensor(float("-inf"))
    l_i = gl.to_tensor(0.0)
    acc_lo = gl.zeros([8, 8], gl.float32, layout=ACC2)
    acc_hi = gl.zeros([8, 8], gl.float32, layout=ACC2)
    # stage 2: packed blocks through the block table
    bt_row = block_table_ptr + slot * stride_bt_s
    for blk in range(lo, gl.minimum(hi, n_packed)):
        tok = blk * BLOCK_N
        page = gl.load(bt_row + tok // PAGE).to(gl.int64)
        m_i, l_i, acc_lo, acc_hi = _packed_block(
            q_c, kc_ptr + page * stride_kc_n + h * stride_kc_h, ks_ptr + page * stride_ks_n + h * stride_ks_h,
            kz_ptr + page * stride_ks_n + h * stride_ks_h, vc_ptr + page * stride_vc_n + h * stride_vc_h,
            vs_ptr + page * stride_vs_n + h * stride_vs_h, vz_ptr + page * stride_vs_n + h * stride_vs_h,
            tok % PAGE, nq - tok, m_i, l_i, acc_lo, acc_hi, LK, LV, stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t,
            GROUP)
    # stage 3: the full-precision ring (ring order never matters), 32 slots at a time
    res = slot * stride_res_s + h * stride_res_h
    nq_mod = nq % RESIDUAL
    for blk in range(gl.maximum(lo, n_packed) - n_packed, hi - n_packed):
        for sub in gl.static_range(128 // 32):
            m_i, l_i, acc_lo, acc_hi = _ring_block(q_lo, q_hi, kr_ptr + res, vr_ptr + res, blk * 128 + sub * 32,
                                                   nq_mod, n_res, m_i, l_i, acc_lo, acc_hi, stride_res_t, RESIDUAL)
    # stage 4: normalized output (or the split's partial and log-sum-exp)
    has_keys = l_i > 0.0
    inv_l = 1.0 / gl.where(has_keys, l_i, 1.0)
    offs_ow = gl.arange(0, 8, layout=gl.SliceLayout(1, ACC2))
    offs_oc = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC2))
    o_ptrs = (o_ptr + b * stride_o_b + h * stride_o_h + split.to(gl.int64) * stride_o_s
              + (offs_ow * 16)[:, None] + offs_oc[None, :])
    gl.store(o_ptrs, (acc_lo * inv_l).to(o_ptr.dtype.element_ty))
    gl.store(o_ptrs + 8, (acc_hi * inv_l).to(o_ptr.dtype.element_ty))
    if SPLIT:
        lse = gl.where(has_keys, m_i + gl.log2(gl.where(has_keys, l_i, 1.0)), float("-inf"))
        gl.store(lse_ptr + b * stride_lse_b + h * stride_lse_h + split, lse)
