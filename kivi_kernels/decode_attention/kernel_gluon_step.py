"""The per-step math of the Gluon FMA decode-attention kernel (kernel_gluon.py): unpacking, one online-softmax
step over a packed block, one over 32 ring slots. Only @gluon.jit code; layouts and formulas as in
kernel_gluon.py's docstring."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# residual ring [32 tokens, V_WORDS, 8]: channel 16 w + 8 b + c for one half b, as the accumulator holds it
_LR = gl.constexpr(gl.BlockedLayout([8, 1, 8], [4, 8, 1], [1, 1, 1], [2, 0, 1]))


@gluon.jit
def _work_range(seq_lens_ptr, slots_ptr, b, split, num_splits, GROUP: gl.constexpr, RESIDUAL: gl.constexpr,
                BLOCK_N: gl.constexpr, RING_UNITS: gl.constexpr = 0, WITH_RING: gl.constexpr = True):
    """Row b's token ranges and split `split`'s share of its work units: (slot, nq, n_res, n_packed, n_ring, lo,
    hi). Units are the packed BLOCK_N-token blocks, then the ring: RING_UNITS units per 32-slot chunk, or with
    RING_UNITS 0 one unit per BLOCK_N / 4 slots (its 16-bit bytes per slot are ~5x a packed token's), the split
    holding the ring's first unit reading the whole ring. Without WITH_RING (the ring read by a pass of its own)
    the units are the packed blocks alone."""
    seq_len = gl.load(seq_lens_ptr + b)
    slot = gl.load(slots_ptr + b).to(gl.int64)
    nq = gl.cdiv(gl.maximum(seq_len - RESIDUAL, 0), GROUP) * GROUP
    n_packed = gl.cdiv(nq, BLOCK_N)
    n_ring = gl.minimum(seq_len, RESIDUAL)
    if not WITH_RING:
        n_units = n_packed
    elif RING_UNITS == 0:
        n_units = n_packed + gl.cdiv(n_ring, BLOCK_N // 4)
    else:
        n_units = n_packed + RING_UNITS * gl.cdiv(n_ring, 32)
    per_split = gl.cdiv(n_units, num_splits)
    lo = split * per_split
    return slot, nq, seq_len - nq, n_packed, n_ring, lo, gl.minimum(lo + per_split, n_units)


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
def _value_rows(n_valid, a: gl.constexpr, LV: gl.constexpr):
    """Token rows [NI, 8 j, 1] (16 i + 8 a + j, page offsets from the block's start), word offsets [1, 1, 8] and
    the mask of valid rows [NI, 8, 8], in the layout of one value half."""
    VT3: gl.constexpr = gl.SliceLayout(3, LV)  # [NI, 8 j, V_WORDS]
    NI: gl.constexpr = LV.size_per_thread[0] * LV.threads_per_warp[0]
    offs_i = gl.arange(0, NI, layout=gl.SliceLayout(1, gl.SliceLayout(2, VT3)))
    offs_j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, VT3)))
    offs_vw = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, VT3)))
    row = (offs_i * 16 + 8 * a)[:, None] + offs_j[None, :]  # [NI, 8]
    valid = (row < n_valid)[:, :, None] & (offs_vw < 8)[None, None, :]
    return row[:, :, None], offs_vw[None, None, :], valid


@gluon.jit
def _value_scales(vs_ptr, vz_ptr, off, n_valid, a: gl.constexpr, LV: gl.constexpr, stride_vs_t: gl.constexpr,
                  GROUP: gl.constexpr):
    """Folded scales (4 v_scale, v_zero - 4 v_scale) [NI, 8 j, 8 w] of value half a's tokens 16 i + 8 a + j;
    zeros past n_valid (scale rows past nq may hold anything, NaN included: zeros keep 0 * x finite)."""
    row, offs_vw, valid = _value_rows(n_valid, a, LV)
    s_offs = (off + row) * stride_vs_t + offs_vw * 16 // GROUP
    v_mult = gl.load(vs_ptr + s_offs, mask=valid, other=0.0).to(gl.float32) * 4.0
    v_off = gl.load(vz_ptr + s_offs, mask=valid, other=0.0).to(gl.float32) - v_mult
    return v_mult, v_off


@gluon.jit
def _value_load(vc_ptr, vs_ptr, vz_ptr, off, n_valid, a: gl.constexpr, LV: gl.constexpr,
                stride_vc_t: gl.constexpr, stride_vs_t: gl.constexpr, GROUP: gl.constexpr):
    """Value words [NI, 8 j, 8 w] of tokens 16 i + 8 a + j and their folded scales (_value_scales)."""
    row, offs_vw, _ = _value_rows(n_valid, a, LV)
    words = gl.load(vc_ptr + (off + row) * stride_vc_t + offs_vw)
    v_mult, v_off = _value_scales(vs_ptr, vz_ptr, off, n_valid, a, LV, stride_vs_t, GROUP)
    return words, v_mult, v_off


@gluon.jit
def _value_sum(words, v_mult, v_off, p, LV: gl.constexpr):
    """Value sums of one token half (p [NI, 8 j]) over each thread's tokens: [NI, 8 w, 8 c] partials of
    channels 16 w + c and 16 w + 8 + c (lanes of dim 0 hold the other tokens; the caller sums them)."""
    p_v = gl.convert_layout(p, gl.SliceLayout(2, gl.SliceLayout(3, LV)))[:, :, None]
    p_mult = (p_v * v_mult)[:, :, :, None]
    bias = gl.sum((p_v * v_off)[:, :, :, None], axis=1)  # [NI, 8, 1]
    rot = (40 - 2 * gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV))))) % 32
    lo, hi = _unit_pairs(words[:, :, :, None], rot.to(gl.uint32)[None, None, None, :])
    return gl.sum(lo * p_mult, axis=1) + bias, gl.sum(hi * p_mult, axis=1) + bias


@gluon.jit
def _block_load(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, off, n_valid, LK: gl.constexpr, LV: gl.constexpr,
                stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr,
                stride_vs_t: gl.constexpr, GROUP: gl.constexpr):
    """Key words [D, K_WORDS] with their folded scales (4 k_scale, k_zero - 4 k_scale), and both value halves
    (_value_load) of page tokens [off, off + 16 K_WORDS) (pointers at the page and head): every load of a step
    is issued before any of its math."""
    KW2: gl.constexpr = gl.SliceLayout(2, LK)  # [D, K_WORDS]
    K_WORDS: gl.constexpr = LK.threads_per_warp[1]
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(1, KW2))
    offs_kw = gl.arange(0, K_WORDS, layout=gl.SliceLayout(0, KW2))
    k_words = gl.load(kc_ptr + (off // 16 + offs_kw)[None, :] * stride_kc_w + offs_c[:, None])
    g_offs = ((off + offs_kw * 16) // GROUP)[None, :] * stride_ks_g + offs_c[:, None]
    k_mult = gl.load(ks_ptr + g_offs).to(gl.float32) * 4.0
    k_off = gl.load(kz_ptr + g_offs).to(gl.float32) - k_mult
    v0_words, v0_mult, v0_off = _value_load(vc_ptr, vs_ptr, vz_ptr, off, n_valid, 0, LV, stride_vc_t,
                                            stride_vs_t, GROUP)
    v1_words, v1_mult, v1_off = _value_load(vc_ptr, vs_ptr, vz_ptr, off, n_valid, 1, LV, stride_vc_t,
                                            stride_vs_t, GROUP)
    return k_words, k_mult, k_off, v0_words, v0_mult, v0_off, v1_words, v1_mult, v1_off


@gluon.jit
def _softmax_step(s_lo, s_hi, m_i, l_i):
    """Online softmax over a block's scores (log2 domain): (m_new, alpha, p_lo, p_hi, l_i)."""
    m_new = gl.maximum(m_i, gl.maximum(gl.max(gl.max(s_lo, axis=1), axis=0), gl.max(gl.max(s_hi, axis=1), axis=0)))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p_lo = gl.exp2(s_lo - m_safe)
    p_hi = gl.exp2(s_hi - m_safe)
    return m_new, alpha, p_lo, p_hi, l_i * alpha + gl.sum(gl.sum(p_lo + p_hi, axis=1), axis=0)


@gluon.jit
def _packed_step(q_c, k_words, k_mult, k_off, v0_words, v0_mult, v0_off, v1_words, v1_mult, v1_off, n_valid,
                 m_i, l_i, acc_lo, acc_hi, LK: gl.constexpr, LV: gl.constexpr):
    """One online-softmax step over a block's loaded words (_block_load); n_valid counts its valid tokens."""
    S2: gl.constexpr = gl.SliceLayout(0, LK)  # [K_WORDS, 8] scores
    K_WORDS: gl.constexpr = LK.threads_per_warp[1]
    # stage 1: key scales folded into the query
    q_mult = (q_c[:, None] * k_mult)[:, :, None]
    bias = gl.sum((q_c[:, None] * k_off)[:, :, None], axis=0)  # [K_WORDS, 1]
    # stage 2: scores of tokens 16 w + j (lo) and 16 w + 8 + j (hi), [K_WORDS, 8], log2 domain (q_c is scaled)
    rot = (40 - 2 * gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LK)))) % 32
    lo, hi = _unit_pairs(k_words[:, :, None], rot.to(gl.uint32)[None, None, :])
    tok = ((gl.arange(0, K_WORDS, layout=gl.SliceLayout(1, S2)) * 16)[:, None]
           + gl.arange(0, 8, layout=gl.SliceLayout(0, S2))[None, :])
    s_lo = gl.where(tok < n_valid, gl.sum(lo * q_mult, axis=0) + bias, float("-inf"))
    s_hi = gl.where(tok + 8 < n_valid, gl.sum(hi * q_mult, axis=0) + bias, float("-inf"))
    # stage 3: online softmax
    m_new, alpha, p_lo, p_hi, l_i = _softmax_step(s_lo, s_hi, m_i, l_i)
    # stage 4: the values of both token halves into acc (channel 16 w + c: acc_lo, 16 w + 8 + c: acc_hi); the
    # halves add inside each thread before the sum across lanes
    v0_lo, v0_hi = _value_sum(v0_words, v0_mult, v0_off, p_lo, LV)
    v1_lo, v1_hi = _value_sum(v1_words, v1_mult, v1_off, p_hi, LV)
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
