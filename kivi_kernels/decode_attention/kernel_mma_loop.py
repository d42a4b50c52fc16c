"""The packed loop of the tensor-core decode-attention kernel (kernel_mma.py): 64-token blocks through the block
table, arriving by cp.async stages (kernel_mma_stage.py), with the operands of kernel_mma_frag.py. Only
@gluon.jit code.

Each block: its masked scores (_key_scores), one online-softmax step, then the values' products (_value_step),
blocks blk + 1 .. blk + STAGES - 1 in flight meanwhile. (Version 18 computed block blk + 1's scores beside block
blk's values, two dependency chains in one warp; it was 1-13% slower and was removed: kernel_notes.md.)
Version 25 (_packed_loop_pairs, STEP_BLOCKS=2): one online-softmax step over two blocks, the scores of both,
then both blocks' products, so that a step's fixed work (the sums' rescale, the cross-lane max and sum, the
wait) is shared by 128 tokens; STAGES pairs of stages. Version 26: an odd count ends on a masked half pair
instead of a one-block step of its own (a third less code: 3,568 SASS instructions against 4,568).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .kernel_mma_frag import (
    _COLS,
    _MMA,
    _OP_A,
    _OP_B,
    _P3,
    _ROWS,
    _S3,
    _hmul2,
    _key_codes,
    _key_scale_halves,
    _key_zeros,
    _value_codes,
    _value_scale_chunks,
    _value_zeros,
)
from .kernel_mma_frag4 import _key_codes4, _value_codes4
from .kernel_mma_stage import _allocate_stages, _issue_block, _value_words


@gluon.jit
def _key_scores(q8, q_a, kw, ks, kz, n_valid, qk_scale, BITS: gl.constexpr):
    """Masked scores [8 h, 8 nn, 8 j] (log2 domain) of a stage's 64 tokens (token 8 j + nn; n_valid of them are
    packed). q8 [8, 128] fp32 is the query times qk; q_a [16, 128] the raw query as an A operand."""
    # stage 1: key scales of each 32-token half folded into the query: the A operand [16 (half, h), 128]
    ks0, ks1 = _key_scale_halves(ks)
    if q8.dtype == gl.float16:  # fp16 scales: packed fp16 products (q8 is fp16 then)
        q_b, ks0 = gl.broadcast(q8, ks0[None, :])
        q_b, ks1 = gl.broadcast(q8, ks1[None, :])
        a = gl.join(_hmul2(q_b, ks0), _hmul2(q_b, ks1))
    else:
        a = gl.join((q8 * ks0[None, :]).to(gl.float16), (q8 * ks1[None, :]).to(gl.float16))
    a = gl.convert_layout(a.permute(2, 0, 1).reshape([16, 128]), _OP_A)
    codes = _key_codes(kw) if BITS == 2 else _key_codes4(kw)
    raw = mma_v2(a, codes, gl.zeros([16, 64], gl.float32, _MMA))
    # stage 2: the zeros' share, sum_c q k_zero, per head and half (column jj of the product: half jj // 4)
    bias = mma_v2(q_a, _key_zeros(kz), gl.zeros([16, 8], gl.float32, _MMA))
    bias, _ = gl.split(bias.reshape([2, 8, 8]).permute(1, 2, 0))
    bias = gl.convert_layout(bias, gl.SliceLayout(1, _S3)) * qk_scale  # [8 h, 8 j]
    # stage 3: each column's half, its code factor undone, the zeros' share, the mask
    s0, s1 = gl.split(raw.reshape([2, 8, 8, 8]).permute(1, 2, 3, 0))
    s0 = gl.convert_layout(s0, _S3)
    s1 = gl.convert_layout(s1, _S3)
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _S3)))[None, None, :]
    nn = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, _S3)))[None, :, None]
    if BITS == 2:
        factor = 16777216.0 / (1 << (2 * (nn % 5))).to(gl.float32)  # 2^24 / 4^w
    else:
        factor = 16777216.0 / (1 << (4 * (nn % 2))).to(gl.float32)  # 2^24 / 16^w
    s = gl.where(j < 4, s0, s1) * factor + bias[:, None, :]
    return gl.where(8 * j + nn < n_valid, s, float("-inf"))


@gluon.jit
def _online_softmax(s, m_i, l_i):
    """One online-softmax step over scores s [8 h, ...] (3-D, _S3): (p, alpha, m_new, l_i); rows [8] in _ROWS."""
    mx = gl.max(gl.max(s, axis=2), axis=1)
    m_i = gl.convert_layout(m_i, mx.type.layout)
    m_new = gl.maximum(m_i, mx)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None, None])
    l_i = gl.convert_layout(l_i, mx.type.layout) * alpha + gl.sum(gl.sum(p, axis=2), axis=1)
    return p, gl.convert_layout(alpha, _ROWS), gl.convert_layout(m_new, _ROWS), gl.convert_layout(l_i, _ROWS)


@gluon.jit
def _online_softmax_pair(s0, s1, m_i, l_i):
    """One online-softmax step over two blocks' scores s0, s1 [8 h, 8, 8] (_S3): one cross-lane max and one sum
    for both. Returns (p0, p1, alpha, m_new, l_i); rows [8] in _ROWS."""
    mx = gl.max(gl.max(gl.maximum(s0, s1), axis=2), axis=1)
    m_i = gl.convert_layout(m_i, mx.type.layout)
    m_new = gl.maximum(m_i, mx)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p0 = gl.exp2(s0 - m_safe[:, None, None])
    p1 = gl.exp2(s1 - m_safe[:, None, None])
    l_i = gl.convert_layout(l_i, mx.type.layout) * alpha + gl.sum(gl.sum(p0 + p1, axis=2), axis=1)
    return p0, p1, gl.convert_layout(alpha, _ROWS), gl.convert_layout(m_new, _ROWS), gl.convert_layout(l_i, _ROWS)


@gluon.jit
def _value_step(p, vw, st, vs, vz, alpha, acc0, acc1, acc2, acc3, z, NG: gl.constexpr, V_COPY: gl.constexpr,
                BITS: gl.constexpr, RESCALE: gl.constexpr = True):
    """After the rescale by alpha (without RESCALE none: a pair's second block): acc_g [32 rho, 8 h] += codes of
    chunk g x (p v_scale)^T and the zeros' share z [16 (group m % NG), 8 h] += v_zero^T p^T; p [8 h, 8 nn, 8 j]
    are the probabilities of a stage's tokens 8 j + nn."""
    alpha_c = gl.convert_layout(alpha, _COLS)[None, :]
    p_t = gl.convert_layout(p.permute(1, 2, 0), _P3, assert_trivial=True)  # [8 nn, 8 j, 8 h]
    if vs.dtype == gl.float16:  # fp16 scales: the chunks' products in packed fp16 from one rounding of p
        p_t = p_t.to(gl.float16)
    vs0, vs1, vs2, vs3 = _value_scale_chunks(vs, NG)
    acc0 = _value_chunk(p_t, vs0, _value_words(vw, st, 0, V_COPY, BITS), _rescaled(acc0, alpha_c, RESCALE), BITS)
    acc1 = _value_chunk(p_t, vs1, _value_words(vw, st, 1, V_COPY, BITS), _rescaled(acc1, alpha_c, RESCALE), BITS)
    acc2 = _value_chunk(p_t, vs2, _value_words(vw, st, 2, V_COPY, BITS), _rescaled(acc2, alpha_c, RESCALE), BITS)
    acc3 = _value_chunk(p_t, vs3, _value_words(vw, st, 3, V_COPY, BITS), _rescaled(acc3, alpha_c, RESCALE), BITS)
    p_z = gl.convert_layout(p_t.to(vz.dtype).reshape([64, 8]), _OP_B, assert_trivial=True)
    z = mma_v2(_value_zeros(vz, NG), p_z, _rescaled(z, alpha_c, RESCALE))
    return acc0, acc1, acc2, acc3, z


@gluon.jit
def _rescaled(acc, alpha_c, RESCALE: gl.constexpr):
    """acc * alpha_c, or acc as it is without RESCALE."""
    if RESCALE:
        acc = acc * alpha_c
    return acc


@gluon.jit
def _value_chunk(p_t, vs, words, acc, BITS: gl.constexpr):
    """acc [32, 8] + codes of one chunk (words [BITS, 64] its value words) x (p v_scale)^T; vs [8 nn, 8 j] its
    scales (p_t fp16 with fp16 scales, else fp32)."""
    if p_t.dtype == gl.float16:
        p_b, vs_b = gl.broadcast(p_t, vs[:, :, None])
        p_g = _hmul2(p_b, vs_b)
    else:
        p_g = (p_t * vs[:, :, None]).to(gl.float16)
    p_g = gl.convert_layout(p_g.reshape([64, 8]), _OP_B, assert_trivial=True)
    codes = _value_codes(words) if BITS == 2 else _value_codes4(words)
    return mma_v2(codes, p_g, acc)


@gluon.jit
def _issue(stages, stage, blk, ptrs, strides, n_end, nq, bt_row, h, stride_kc_w: gl.constexpr,
           stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr, stride_vs_t: gl.constexpr, GROUP: gl.constexpr,
           PAGE: gl.constexpr, V_COPY: gl.constexpr, BITS: gl.constexpr):
    """cp.async of packed block blk into `stage` (stages, ptrs, strides: the loop's tuples)."""
    kw, ks, kz, vw, vs, vz = stages
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr = ptrs
    stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_vs_n, stride_vs_h = strides
    _issue_block(kw, ks, kz, vw, vs, vz, stage, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, blk,
                 n_end, nq, stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_vs_n,
                 stride_vs_h, stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t, GROUP, PAGE, V_COPY, BITS)


@gluon.jit
def _packed_loop(q8, q_a, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, z, lo, n_end, nq, bt_row, h, ptrs, strides,
                 stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr,
                 stride_vs_t: gl.constexpr, GROUP: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                 V_COPY: gl.constexpr, BITS: gl.constexpr):
    """Packed blocks lo .. n_end - 1 (n_end > lo) of KV head h: (m_i, l_i, acc0, acc1, acc2, acc3, z) after them.
    ptrs: (kc, ks, kz, vc, vs, vz) pointers; strides: their runtime page and head strides."""
    gl.static_assert(STAGES == 2 or STAGES == 3)
    NG: gl.constexpr = 128 // GROUP
    stages = _allocate_stages(ptrs[1].dtype.element_ty, NG, STAGES, V_COPY, BITS)
    kw, ks, kz, vw, vs, vz = stages
    for pre in gl.static_range(STAGES - 1):
        _issue(stages, pre, lo + pre, ptrs, strides, n_end, nq, bt_row, h, stride_kc_w, stride_ks_g, stride_vc_t,
               stride_vs_t, GROUP, PAGE, V_COPY, BITS)
    for blk in range(lo, n_end):
        st = (blk - lo) % STAGES
        # into the stage block blk - 1 was read from (its reads ended with that step's products)
        _issue(stages, (blk - lo + STAGES - 1) % STAGES, blk + STAGES - 1, ptrs, strides, n_end, nq, bt_row, h,
               stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t, GROUP, PAGE, V_COPY, BITS)
        cp.wait_group(STAGES - 1)  # block blk's group (all but the STAGES - 1 newest) has landed
        m_i, l_i, acc0, acc1, acc2, acc3, z = _block_step(q8, q_a, qk_scale, stages, st, nq - blk * 64, m_i, l_i,
                                                          acc0, acc1, acc2, acc3, z, NG, V_COPY, BITS)
    cp.wait_group(0)
    return m_i, l_i, acc0, acc1, acc2, acc3, z


@gluon.jit
def _block_step(q8, q_a, qk_scale, stages, st, n_valid, m_i, l_i, acc0, acc1, acc2, acc3, z, NG: gl.constexpr,
                V_COPY: gl.constexpr, BITS: gl.constexpr):
    """One online-softmax step over the block in stage st (n_valid of its tokens packed): its scores, the step,
    the values' products. Returns (m_i, l_i, acc0, acc1, acc2, acc3, z)."""
    kw, ks, kz, vw, vs, vz = stages
    s = _key_scores(q8, q_a, kw.index(st), ks.index(st), kz.index(st), n_valid, qk_scale, BITS)
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
    acc0, acc1, acc2, acc3, z = _value_step(p, vw, st, vs.index(st), vz.index(st), alpha, acc0, acc1, acc2, acc3, z,
                                            NG, V_COPY, BITS)
    return m_i, l_i, acc0, acc1, acc2, acc3, z


@gluon.jit
def _packed_loop_pairs(q8, q_a, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, z, lo, n_end, nq, bt_row, h, ptrs,
                       strides, stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr,
                       stride_vs_t: gl.constexpr, GROUP: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                       V_COPY: gl.constexpr, BITS: gl.constexpr):
    """_packed_loop two blocks a step (version 25): blocks blk, blk + 1 share one online-softmax step and one
    rescale; 2 STAGES stages, pairs blk + 2 .. in flight. An odd count's last block is the first of a half
    pair (version 26): its second block, n_end, is masked (scores -inf; scales and zeros arrive as zeros, as
    for every block issued past n_end), so the loop's code is the whole of it."""
    gl.static_assert(STAGES == 2 or STAGES == 3)
    NG: gl.constexpr = 128 // GROUP
    NBUF: gl.constexpr = 2 * STAGES
    stages = _allocate_stages(ptrs[1].dtype.element_ty, NG, NBUF, V_COPY, BITS)
    kw, ks, kz, vw, vs, vz = stages
    # tokens past this program's last block count as unpacked: masked scores, scales and zeros read as zeros
    nq = gl.minimum(nq, n_end * 64)
    for pre in gl.static_range(NBUF - 2):
        _issue(stages, pre, lo + pre, ptrs, strides, n_end, nq, bt_row, h, stride_kc_w, stride_ks_g, stride_vc_t,
               stride_vs_t, GROUP, PAGE, V_COPY, BITS)
    for blk in range(lo, n_end, 2):
        st = (blk - lo) % NBUF  # even: the pair's stages st, st + 1
        nxt = (blk - lo + NBUF - 2) % NBUF  # the stages the previous pair was read from
        for k in gl.static_range(2):
            _issue(stages, nxt + k, blk + NBUF - 2 + k, ptrs, strides, n_end, nq, bt_row, h, stride_kc_w,
                   stride_ks_g, stride_vc_t, stride_vs_t, GROUP, PAGE, V_COPY, BITS)
        cp.wait_group(NBUF - 2)  # the pair's two groups have landed
        s0 = _key_scores(q8, q_a, kw.index(st), ks.index(st), kz.index(st), nq - blk * 64, qk_scale, BITS)
        s1 = _key_scores(q8, q_a, kw.index(st + 1), ks.index(st + 1), kz.index(st + 1), nq - (blk + 1) * 64,
                         qk_scale, BITS)
        p0, p1, alpha, m_i, l_i = _online_softmax_pair(s0, s1, m_i, l_i)
        acc0, acc1, acc2, acc3, z = _value_step(p0, vw, st, vs.index(st), vz.index(st), alpha, acc0, acc1, acc2,
                                                acc3, z, NG, V_COPY, BITS)
        acc0, acc1, acc2, acc3, z = _value_step(p1, vw, st + 1, vs.index(st + 1), vz.index(st + 1), alpha, acc0,
                                                acc1, acc2, acc3, z, NG, V_COPY, BITS, RESCALE=False)
    cp.wait_group(0)
    return m_i, l_i, acc0, acc1, acc2, acc3, z
