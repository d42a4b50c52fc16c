"""Decode attention over a 2-bit KIVI cache on the FMA pipe, in Gluon (Triton's explicit-layout dialect).
Only @gluon.jit code; the launcher is ops.decode_attention (its fma path).

One query head per KV head (Llama-2-style MHA), head_dim 128, 2-bit keys and values, BLOCK_N-token steps
(64 or 128), one warp per program. Scales fold into the query (keys) and into the probabilities (values),
so nothing is dequantized:
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

from .kernel_gluon_async import _load_packed, _packed_loop_async
from .kernel_gluon_magic import _finish_values, _lane_partials, _packed_step_magic
from .kernel_gluon_step import _LR, _packed_step, _ring_block, _work_range


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
    BLOCK_N: gl.constexpr = 128, ASYNC: gl.constexpr = False, MAGIC: gl.constexpr = False,
    ROW_MAJOR: gl.constexpr = False,
):
    """grid (B, H, num_splits), or (H, B, num_splits) with ROW_MAJOR: query head h of row b against KV head h
    (Hq == H), one split of the keys.

    Work of one row: the packed tokens [0, nq) in BLOCK_N-token steps through the block table, then the ring
    slots [0, min(L, R)) in 32-slot steps; a split owns a contiguous range of work units (stage 0). Output:
    acc / l in o_ptr's dtype, or with SPLIT the fp32 partial and its base-2 log-sum-exp.
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
    # grid (H, B, num_splits) with ROW_MAJOR: programs start row by row (common.decode_grid); else (B, H, num_splits)
    b = gl.program_id(1 if ROW_MAJOR else 0).to(gl.int64)
    h = gl.program_id(0 if ROW_MAJOR else 1).to(gl.int64)
    split = gl.program_id(2)
    # stage 0: this row's token ranges and this split's blocks
    slot, nq, n_res, n_packed, n_ring, lo, hi = _work_range(seq_lens_ptr, slots_ptr, b, split, num_splits, GROUP,
                                                            RESIDUAL, BLOCK_N)
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
    # MAGIC: raw per-lane value partials (kernel_gluon_magic.py) until the packed loop ends
    if MAGIC:
        acc_lo, acc_hi, m_acc, off_acc = _lane_partials(LV)
    else:
        acc_lo = gl.zeros([8, 8], gl.float32, layout=ACC2)
        acc_hi = gl.zeros([8, 8], gl.float32, layout=ACC2)
        m_acc, off_acc = l_i, l_i  # unused
    # stage 2: packed blocks through the block table
    bt_row = block_table_ptr + slot * stride_bt_s
    n_end = gl.minimum(hi, n_packed)
    if ASYNC:
        if lo < n_end:
            m_i, l_i, acc_lo, acc_hi, m_acc, off_acc = _packed_loop_async(
                q_c, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, lo, n_end, nq, m_i, l_i, acc_lo,
                acc_hi, m_acc, off_acc, stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h,
                stride_vs_n, stride_vs_h, LK, LV, stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t, GROUP, PAGE,
                BLOCK_N, MAGIC)
    else:
        for blk in range(lo, n_end):
            kw, km, ko, v0w, v0m, v0o, v1w, v1m, v1o = _load_packed(
                kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, blk, n_end, nq, stride_kc_n, stride_kc_h,
                stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_vs_n, stride_vs_h, LK, LV, stride_kc_w,
                stride_ks_g, stride_vc_t, stride_vs_t, GROUP, PAGE, BLOCK_N)
            if MAGIC:
                m_i, l_i, acc_lo, acc_hi, m_acc, off_acc = _packed_step_magic(
                    q_c, kw, km, ko, v0w, v0m, v0o, v1w, v1m, v1o, nq - blk * BLOCK_N, m_i, l_i, acc_lo, acc_hi, m_acc,
                    off_acc, LK, LV)
            else:
                m_i, l_i, acc_lo, acc_hi = _packed_step(q_c, kw, km, ko, v0w, v0m, v0o, v1w, v1m, v1o,
                                                        nq - blk * BLOCK_N, m_i, l_i, acc_lo, acc_hi, LK, LV)
    if MAGIC:
        acc_lo, acc_hi = _finish_values(acc_lo, acc_hi, m_acc, off_acc, ACC2)
    # stage 3: the full-precision ring (ring order never matters), 32 slots at a time
    res = slot * stride_res_s + h * stride_res_h
    nq_mod = nq % RESIDUAL
    has_ring = (lo <= n_packed) & (n_packed < hi)
    for blk in range(0, gl.where(has_ring, gl.cdiv(n_ring, 128), 0)):
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
