"""Online-softmax pieces of the decode-attention kernels. Only @triton.jit code.

Shared by kernel.py (the KIVI cache) and kivi_kernels/paged_attention (the bf16 baseline), never copied:
    _load_query_group      the Hq / H query heads of one KV head, padded to QG_PAD rows
    _attend_block          one online-softmax step over a [BLOCK_N, D] tile of keys and values
    _store_partial         normalized partial output (+ log-sum-exp when the sequence is split)
    _split_range           which key blocks a split program owns
    _merge_splits_kernel   second pass: merge the splits of one row by their log-sum-exp

Scores are kept in the log2 domain: the launcher passes qk_scale = sm_scale * log2(e) and the kernels
use exp2; every log-sum-exp in the workspace is a base-2 one.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


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
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr = 0,
    WAIT_PRIOR: tl.constexpr = False,
):
    """grid (B, Hq, HEAD_DIM // BLOCK_D): channels [d0, d0 + BLOCK_D) of out[b, h] = sum_s 2**(lse_s - M) o_s /
    sum_s 2**(lse_s - M); zeros if all splits empty. BLOCK_D 0 means HEAD_DIM. WAIT_PRIOR: launched as a
    programmatic dependent of the split kernel (sm_90), so wait for its writes before reading them."""
    tl.static_assert(SPLITS_PAD >= NUM_SPLITS)
    if WAIT_PRIOR:
        gdc_wait()
    BLOCK: tl.constexpr = HEAD_DIM if BLOCK_D == 0 else BLOCK_D
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    s_mask = offs_s < NUM_SPLITS
    # weights of the splits
    lse = tl.load(ws_lse_ptr + b * stride_lse_b + h * stride_lse_h + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    denom = tl.sum(w, axis=0)
    # weighted sum of the normalized partial outputs, this program's channels
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
