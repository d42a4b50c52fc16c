"""Version 27: the full-precision ring's share of a decode-attention call, in programs of its own. Only
@triton.jit code; the launcher is ops_ring.ring_partial, the spec reference.ring_partial.

The tensor-core kernel (kernel_mma.py) holds 212 registers a thread for its packed loop, so an SM runs 8 of its
one-warp programs, and it read the ring at 0.85 of the copy bandwidth where the bf16 paged kernel's 4-warp
programs of 96 registers read the same bytes at 1.02 (kernel_notes.md, "The ring's chunks loaded a step ahead").
Here the ring runs in small programs like the paged kernel's, on a side stream beside the tensor-core kernel over
the packed blocks, whose programs leave room on each SM; the split merge joins the two (ops_mma.launch_mma).
"""

import triton
import triton.language as tl

from .attend import _attend_block, _load_query_group, _store_partial


@triton.jit
def _ring_partial_kernel(
    q_ptr, kr_ptr, vr_ptr, slots_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    qk_scale,
    stride_q_b, stride_q_h,
    stride_res_s, stride_res_h, stride_res_t,
    stride_o_b, stride_o_h, stride_lse_b, stride_lse_h,
    GROUP: tl.constexpr, RESIDUAL: tl.constexpr, HEAD_DIM: tl.constexpr, QG: tl.constexpr, QG_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ROW_MAJOR: tl.constexpr = False,
):
    """grid (B, H), or (H, B) with ROW_MAJOR: the QG query heads of KV head h of row b against the ring slots of
    row b (slot j holds a token of [nq, L) iff (j - nq) mod R < L - nq; ring order never matters). Writes the
    normalized partial o [B, Hq, D] (fp32) and its base-2 log-sum-exp [B, Hq] (-inf where the ring is empty)."""
    tl.static_assert(QG_PAD >= QG)
    b = tl.program_id(1 if ROW_MAJOR else 0).to(tl.int64)
    h = tl.program_id(0 if ROW_MAJOR else 1).to(tl.int64)
    # stage 0: the row's ring slots
    seq_len = tl.load(seq_lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    nq = tl.cdiv(tl.maximum(seq_len - RESIDUAL, 0), GROUP) * GROUP
    n_res = seq_len - nq
    n_ring = tl.minimum(seq_len, RESIDUAL)
    nq_mod = nq % RESIDUAL
    # stage 1: the query group
    head0 = h * QG
    q = _load_query_group(q_ptr, b, head0, stride_q_b, stride_q_h, QG, QG_PAD, HEAD_DIM, USE_DOT, DOT_DTYPE)
    m_i = tl.full([QG_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QG_PAD], tl.float32)
    acc = tl.zeros([QG_PAD, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # stage 2: BLOCK_N ring slots a step
    res = kr_ptr + slot * stride_res_s + h * stride_res_h
    res_v = vr_ptr + slot * stride_res_s + h * stride_res_h
    for start in range(0, n_ring, BLOCK_N):
        ring = start + offs_n
        valid = ((ring + RESIDUAL - nq_mod) % RESIDUAL < n_res) & (ring < RESIDUAL)
        k_t = tl.load(res + ring[None, :] * stride_res_t + offs_d[:, None], mask=valid[None, :], other=0.0)
        v = tl.load(res_v + ring[:, None] * stride_res_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _attend_block(q, k_t, v, valid, m_i, l_i, acc, qk_scale, USE_DOT, DOT_DTYPE, INPUT_PRECISION)
    # stage 3: the normalized partial and its log-sum-exp
    _store_partial(o_ptr, lse_ptr, acc, m_i, l_i, b, head0, 0, stride_o_b, stride_o_h, 0, stride_lse_b, stride_lse_h,
                   QG, QG_PAD, HEAD_DIM, True)
