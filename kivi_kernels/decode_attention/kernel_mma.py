"""Version 14: decode attention over a 2-bit KIVI cache on the tensor cores (mma.sync m16n8k16), operand
fragments built in registers, for query groups of 1 to 8 heads per KV head (GQA); with BITS=4 the same over a
4-bit cache (kernel_mma_frag4.py). Only @gluon.jit code; the launcher is ops_mma.launch_mma.

One warp per (row, KV head, split); 64-token steps. Scales fold into the other operand, so codes enter the
tensor cores as they are, with no dequantization:
    scores   S[(half, h), n] = sum_c (q[h, c] qk k_scale[half, c]) code[c, n]      (keys: per channel)
             s[h, n] = S[(half(n), h), n] + qk sum_c q[h, c] k_zero[half(n), c]      (a second, small mma)
    values   O^T[c, h] += sum_t code[t, c] (p[h, t] v_scale[t, g(c)])              (values: per token)
             out[h, c] = O^T[c, h] + sum_t v_zero[t, g(c)] p[h, t]                  (a third, small mma)
A code becomes an fp16 by one AND: kept at mantissa bits 2 w, 2 w + 1 with a zero exponent it reads
c 4^w 2^-24 (a subnormal, exact), and the factor 4^w 2^-24 is undone once per score column (keys) or output
channel (values); 4-bit codes read c 16^w 2^-24 at bits 4 w .. 4 w + 3, w = 0, 1 (kernel_mma_frag4.py). An
AND of a word pair merged by one PRMT gives two codes, i.e. one mma register. The other operands are fp16 too,
for bf16 models as well: q qk k_scale per channel (a logit's share of one channel, far
below fp16's 65,504 for real keys: k_scale is a third of the channel's range over 32 tokens) and p v_scale.

Fragment layouts (NVMMA v2, one warp; lane = 4 r + a):
    keys    B[128 kappa, 64 n]: thread (a, r) holds kappa pairs 8 m + 2 a + {0, 1} (channels in the order of
            kernel_mma_frag._perm_channel, four runs of 8 per lane) and columns n = r + 8 nn; column n is token
            8 r + nn of the step: half r % 2 of key word r // 2, code nn. The halves of two channels' words,
            merged by PRMT, hold 8 tokens of both; tokens nn < 5 sit at bits 2 nn, the others at 2 (nn - 5)
            after one shift by 10.
    scores  S [16, 64]: rows h (key-scale half 0) and 8 + h (half 1); a thread's columns are all in one half.
    values  A[32 rho, 64 k] per 32-channel chunk g: row rho = 8 i + r is channel 32 g + 4 r + i (byte r % 4 of
            value word 2 g + r // 4, code i); column k = 8 nn + j is token 8 j + nn, as for the scores, so the
            probabilities pass from the scores' accumulator to the values' B operand without any data movement.
The residual ring (full precision) takes the same mma path with its own operands and accumulators. Packed
blocks arrive by cp.async in shared-memory stages (kernel_mma_stage.py) while the previous block computes; the
loop over them is kernel_mma_loop.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .kernel_gluon_step import _work_range
from .kernel_mma_frag import (
    _COLS,
    _MMA,
    _OP_A,
    _OP_B,
    _Q8,
    _ROWS,
    _S3_RING,
    _launch_dependents,
    _perm_channel,
    _ring_keys,
    _ring_values,
)
from .kernel_mma_loop import _online_softmax, _packed_loop, _packed_loop_pairs


@gluon.jit
def _query_operand(q_row, stride_q_h, QG: gl.constexpr, dtype: gl.constexpr):
    """The raw query of the QG heads as an A operand [16, 128] in `dtype` (rows from QG on are zero)."""
    offs_ha = gl.arange(0, 16, layout=gl.SliceLayout(1, _OP_A))
    offs_ca = _perm_channel(gl.arange(0, 128, layout=gl.SliceLayout(0, _OP_A)))
    q_a = gl.load(q_row + offs_ha[:, None] * stride_q_h + offs_ca[None, :], mask=(offs_ha < QG)[:, None], other=0.0)
    return q_a.to(dtype)


@gluon.jit
def _ring_step(q_a, kr_ptr, vr_ptr, start, nq_mod, n_res, qk_scale, m_i, l_i, r0, r1, r2, r3,
               stride_res_t: gl.constexpr, RESIDUAL: gl.constexpr, BITS: gl.constexpr):
    """One online-softmax step over ring slots [start, start + 32) (pointers at the row's slot and head): full
    precision keys and values on the same mma path, the value sums into r0..r3 (no code factor). Returns
    (m_i, l_i, alpha, r0, r1, r2, r3); the caller rescales its other sums by alpha."""
    offs_s = start + gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _S3_RING)))
    ok_s = ((offs_s + RESIDUAL - nq_mod) % RESIDUAL < n_res) & (offs_s < RESIDUAL)
    raw = mma_v2(q_a, _ring_keys(kr_ptr, start, ok_s, stride_res_t), gl.zeros([16, 32], gl.float32, _MMA))
    s, _ = gl.split(raw.reshape([2, 8, 32]).permute(1, 2, 0))
    s = gl.convert_layout(s, gl.SliceLayout(1, _S3_RING))
    s = gl.where(ok_s[None, :], s * qk_scale, float("-inf"))[:, None, :]  # [8, 1, 32]
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
    alpha_c = gl.convert_layout(alpha, _COLS)[None, :]
    p_t = gl.convert_layout(p.reshape([8, 32]).permute(1, 0).to(vr_ptr.dtype.element_ty), _OP_B)  # [32, 8]
    r0 = mma_v2(_ring_values(vr_ptr, start, ok_s, 0, stride_res_t, BITS), p_t, r0 * alpha_c)
    r1 = mma_v2(_ring_values(vr_ptr, start, ok_s, 1, stride_res_t, BITS), p_t, r1 * alpha_c)
    r2 = mma_v2(_ring_values(vr_ptr, start, ok_s, 2, stride_res_t, BITS), p_t, r2 * alpha_c)
    r3 = mma_v2(_ring_values(vr_ptr, start, ok_s, 3, stride_res_t, BITS), p_t, r3 * alpha_c)
    return m_i, l_i, alpha, r0, r1, r2, r3


@gluon.jit
def _decode_attention_mma_kernel(
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
    QG: gl.constexpr, GROUP: gl.constexpr, RESIDUAL: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
    STAGES: gl.constexpr = 2, V_COPY: gl.constexpr = 1, RING_UNITS: gl.constexpr = 2, BITS: gl.constexpr = 2,
    PDL: gl.constexpr = False, STEP_BLOCKS: gl.constexpr = 1, ROW_MAJOR: gl.constexpr = False,
    RING_PASS: gl.constexpr = False,
):
    """grid (B, H, num_splits), or (H, B, num_splits) with ROW_MAJOR: the QG query heads of KV head h of row b,
    one split of the keys. Work as in
    kernel_gluon.py (packed 64-token blocks, then the ring in 32-slot chunks, _ring_share); output acc / l in o_ptr's
    dtype, or with SPLIT the fp32 partial and its base-2 log-sum-exp. PDL (sm_90 and newer, split calls): let the
    merge, a programmatic dependent, launch at once (common.merge_splits). STEP_BLOCKS: packed 64-token blocks per
    online-softmax step (1, or 2: kernel_mma_loop._packed_loop_pairs). RING_PASS: the ring is read elsewhere (the
    ring pass of kernel_ring.py, a split of its own), so the splits share out the packed blocks alone."""
    gl.static_assert(PAGE % 64 == 0 and RESIDUAL % 32 == 0 and (GROUP == 32 or GROUP == 64) and QG <= 8)
    gl.static_assert(BITS == 2 or BITS == 4)
    gl.static_assert(STEP_BLOCKS == 1 or STEP_BLOCKS == 2)
    # grid (H, B, num_splits) with ROW_MAJOR: programs start row by row (common.decode_grid); else (B, H, num_splits)
    b = gl.program_id(1 if ROW_MAJOR else 0).to(gl.int64)
    h = gl.program_id(0 if ROW_MAJOR else 1).to(gl.int64)
    split = gl.program_id(2)
    if PDL:  # the merge may launch now and wait at its start (common.merge_splits)
        split = _launch_dependents(split)
    # stage 0: this row's token ranges and this split's work units
    slot, nq, n_res, n_packed, n_ring, lo, hi = _work_range(seq_lens_ptr, slots_ptr, b, split, num_splits, GROUP,
                                                            RESIDUAL, 64, RING_UNITS, not RING_PASS)
    # stage 1: the query group: fp32 times qk in the A operand's order, and raw as an A operand [16, 128]
    q_row = q_ptr + b * stride_q_b + (h * QG) * stride_q_h
    offs_h8 = gl.arange(0, 8, layout=gl.SliceLayout(1, _Q8))
    offs_c8 = _perm_channel(gl.arange(0, 128, layout=gl.SliceLayout(0, _Q8)))
    q8 = gl.load(q_row + offs_h8[:, None] * stride_q_h + offs_c8[None, :], mask=(offs_h8 < QG)[:, None],
                 other=0.0).to(gl.float32) * qk_scale
    if ks_ptr.dtype.element_ty == gl.float16:
        q8 = q8.to(gl.float16)  # the key scales fold in by packed fp16 products
    q_a = _query_operand(q_row, stride_q_h, QG, kz_ptr.dtype.element_ty)  # for the key zeros' product
    m_i = gl.full([8], float("-inf"), gl.float32, _ROWS)
    l_i = gl.full([8], 0.0, gl.float32, _ROWS)
    acc0 = gl.zeros([32, 8], gl.float32, _MMA)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    z = gl.zeros([16, 8], gl.float32, _MMA)
    # stage 2: packed blocks through the block table (kernel_mma_loop.py: STAGES cp.async stages, or STAGES pairs
    # of them with STEP_BLOCKS 2)
    bt_row = block_table_ptr + slot * stride_bt_s
    n_end = gl.minimum(hi, n_packed)
    ptrs = (kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr)
    strides = (stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_vs_n, stride_vs_h)
    if lo < n_end and STEP_BLOCKS == 2:
        m_i, l_i, acc0, acc1, acc2, acc3, z = _packed_loop_pairs(
            q8, q_a, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, z, lo, n_end, nq, bt_row, h, ptrs, strides,
            stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t, GROUP, PAGE, STAGES, V_COPY, BITS)
    elif lo < n_end:
        m_i, l_i, acc0, acc1, acc2, acc3, z = _packed_loop(
            q8, q_a, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3, z, lo, n_end, nq, bt_row, h, ptrs, strides,
            stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t, GROUP, PAGE, STAGES, V_COPY, BITS)
    # stage 3: the full-precision ring, 32 slots at a time, into its own sums (with RING_PASS: none here)
    r0 = gl.zeros([32, 8], gl.float32, _MMA)
    r1 = r0
    r2 = r0
    r3 = r0
    if not RING_PASS:
        if kr_ptr.dtype.element_ty != kz_ptr.dtype.element_ty:  # fp16 scales, bf16 ring
            q_a = _query_operand(q_row, stride_q_h, QG, kr_ptr.dtype.element_ty)
        res = slot * stride_res_s + h * stride_res_h
        m_i, l_i, acc0, acc1, acc2, acc3, z, r0, r1, r2, r3 = _ring_stage(
            q_a, kr_ptr + res, vr_ptr + res, lo, hi, n_packed, n_ring, nq, n_res, qk_scale, m_i, l_i, acc0, acc1,
            acc2, acc3, z, stride_res_t, RESIDUAL, BITS, SPLIT, RING_UNITS)
    # stage 4: codes' factors undone, the zeros' share, normalized (or the split's partial and log-sum-exp)
    _store_item(o_ptr + b * stride_o_b + (h * QG) * stride_o_h + split.to(gl.int64) * stride_o_s,
                lse_ptr + b * stride_lse_b + (h * QG) * stride_lse_h + split, m_i, l_i, acc0, acc1, acc2, acc3, z,
                r0, r1, r2, r3, stride_o_h, stride_lse_h, QG, GROUP, BITS, SPLIT)


@gluon.jit
def _ring_stage(q_a, kr_row, vr_row, lo, hi, n_packed, n_ring, nq, n_res, qk_scale, m_i, l_i, acc0, acc1, acc2,
                acc3, z, stride_res_t: gl.constexpr, RESIDUAL: gl.constexpr, BITS: gl.constexpr,
                SPLIT: gl.constexpr, RING_UNITS: gl.constexpr):
    """The split's share of the ring (_ring_share; pointers at the row's slot and head) into sums of its own,
    r0..r3 [32, 8], the packed sums rescaled as the softmax state moves: (m_i, l_i, acc0..acc3, z, r0..r3)."""
    r0 = gl.zeros([32, 8], gl.float32, _MMA)
    r1 = r0
    r2 = r0
    r3 = r0
    ring_lo, ring_hi = _ring_share(lo, hi, n_packed, n_ring, SPLIT, RING_UNITS)
    for start in range(ring_lo, ring_hi, 32):
        m_i, l_i, alpha, r0, r1, r2, r3 = _ring_step(q_a, kr_row, vr_row, start, nq % RESIDUAL, n_res, qk_scale,
                                                     m_i, l_i, r0, r1, r2, r3, stride_res_t, RESIDUAL, BITS)
        alpha_c = gl.convert_layout(alpha, _COLS)[None, :]
        acc0, acc1, acc2, acc3 = acc0 * alpha_c, acc1 * alpha_c, acc2 * alpha_c, acc3 * alpha_c
        z = z * alpha_c
    return m_i, l_i, acc0, acc1, acc2, acc3, z, r0, r1, r2, r3


@gluon.jit
def _store_item(o_row, lse_row, m_i, l_i, acc0, acc1, acc2, acc3, z, r0, r1, r2, r3, stride_o_h, stride_lse_h,
                QG: gl.constexpr, GROUP: gl.constexpr, BITS: gl.constexpr, SPLIT: gl.constexpr):
    """The QG heads' output at o_row (pointers at the row, first head and split): the codes' factors undone, the
    zeros' share, normalized; with SPLIT the fp32 partial and its base-2 log-sum-exp at lse_row."""
    has_keys = l_i > 0.0
    inv_l = gl.convert_layout(1.0 / gl.where(has_keys, l_i, 1.0), _COLS)[None, :]
    _store_chunk(o_row, acc0, z, r0, inv_l, 0, stride_o_h, QG, GROUP, BITS)
    _store_chunk(o_row, acc1, z, r1, inv_l, 1, stride_o_h, QG, GROUP, BITS)
    _store_chunk(o_row, acc2, z, r2, inv_l, 2, stride_o_h, QG, GROUP, BITS)
    _store_chunk(o_row, acc3, z, r3, inv_l, 3, stride_o_h, QG, GROUP, BITS)
    if SPLIT:
        lse = gl.where(has_keys, m_i + gl.log2(gl.where(has_keys, l_i, 1.0)), float("-inf"))
        offs_h = gl.arange(0, 8, layout=_ROWS)
        gl.store(lse_row + offs_h * stride_lse_h, lse, mask=offs_h < QG)


@gluon.jit
def _ring_share(lo, hi, n_packed, n_ring, SPLIT: gl.constexpr, RING_UNITS: gl.constexpr):
    """Ring slots [ring_lo, ring_hi) of the split holding work units [lo, hi) (_work_range). With RING_UNITS > 0
    the ring goes in 32-slot chunks of RING_UNITS units each to the split holding a chunk's first unit, so that a
    short split never reads the whole ring on top of its share; with 0 the whole ring goes to the split holding
    its first unit (version 20 and before). Unsplit, the one program reads it all from slot 0 (a constant start:
    16 registers fewer than a computed one, which cost 1-3% at 128-238 rows)."""
    if not SPLIT:
        ring_lo = 0
        ring_hi = n_ring
    elif RING_UNITS > 0:
        chunk_lo = gl.cdiv(gl.maximum(lo - n_packed, 0), RING_UNITS)
        chunk_hi = gl.cdiv(gl.maximum(hi - n_packed, 0), RING_UNITS)
        ring_lo = gl.minimum(32 * chunk_lo, n_ring)
        ring_hi = gl.minimum(32 * chunk_hi, n_ring)
    else:
        ring_lo = 0
        ring_hi = gl.where((lo <= n_packed) & (n_packed < hi), n_ring, 0)
    return ring_lo, ring_hi


@gluon.jit
def _store_chunk(o_row, acc, z, ring, inv_l, g: gl.constexpr, stride_o_h, QG: gl.constexpr, GROUP: gl.constexpr,
                 BITS: gl.constexpr):
    """Output channels 32 g + 4 r + i (accumulator row 8 i + r; at 4 bits 32 g + 16 (i // 2) + 8 (r // 4) +
    2 (r % 4) + i % 2, kernel_mma_frag4.py) of the QG heads; z [16, 8 h] holds the zeros' share of group m % NG
    in row m."""
    offs_rho = gl.arange(0, 32, layout=gl.SliceLayout(1, _MMA))
    offs_m = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))
    offs_h = gl.arange(0, 8, layout=_COLS)
    z_g = gl.sum(gl.where((offs_m == (32 * g) // GROUP)[:, None], z, 0.0), axis=0)  # [8 h]
    i = offs_rho // 8
    r = offs_rho % 8
    if BITS == 2:
        factor = 16777216.0 / (1 << (2 * i)).to(gl.float32)  # 2^24 / 4^i
        chan = 32 * g + 4 * r + i
    else:
        factor = 16777216.0 / (1 << (4 * (i % 2))).to(gl.float32)  # 2^24 / 16^(i % 2)
        chan = 32 * g + 16 * (i // 2) + 8 * (r // 4) + 2 * (r % 4) + i % 2
    out = (acc * factor[:, None] + z_g[None, :] + ring) * inv_l
    ptrs = o_row + offs_h[None, :] * stride_o_h + chan[:, None]
    gl.store(ptrs, out.to(o_row.dtype.element_ty), mask=(offs_h < QG)[None, :] & (chan < 128)[:, None])
