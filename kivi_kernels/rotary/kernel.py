"""Triton kernel for the rotary embedding of one (batch row, position) per program (launched by ops.py)."""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, row, t, n_heads,
    stride_x_b, stride_x_h, stride_x_t, stride_out_b, stride_out_h, stride_out_t,
    c1, c2, s1, s2,  # [1, HALF] fp32: cos and sin, first and second halves
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = heads < n_heads
    src = x_ptr + row * stride_x_b + t * stride_x_t + heads * stride_x_h + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product and the sum are rounded
    # to the tensor's dtype, as transformers' three elementwise ops round them
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    o1 = (x1 * c1).to(DTYPE).to(tl.float32) + (-x2 * s1).to(DTYPE).to(tl.float32)
    o2 = (x2 * c2).to(DTYPE).to(tl.float32) + (x1 * s2).to(DTYPE).to(tl.float32)
    dst = out_ptr + row * stride_out_b + t * stride_out_t + heads * stride_out_h + cols
    tl.store(dst, o1.to(DTYPE), mask=mask)
    tl.store(dst + HALF, o2.to(DTYPE), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,  # q [B, Hq, T, D], k [B, Hk, T, D], cos/sin [B, T, D]
    seq_len, n_q_heads, n_k_heads,
    stride_q_b, stride_q_h, stride_q_t, stride_k_b, stride_k_h, stride_k_t,
    stride_cos_b, stride_cos_t, stride_sin_b, stride_sin_t,
    stride_qo_b, stride_qo_h, stride_qo_t, stride_ko_b, stride_ko_h, stride_ko_t,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    # one program per (batch row, position): cos and sin are loaded once for all its heads
    pid = tl.program_id(0)
    row = pid // seq_len
    t = pid % seq_len

    # stage 1: this position's cos and sin, split in halves
    cols = tl.arange(0, HALF)[None, :]
    cos = cos_ptr + row * stride_cos_b + t * stride_cos_t + cols
    sin = sin_ptr + row * stride_sin_b + t * stride_sin_t + cols
    c1 = tl.load(cos).to(tl.float32)
    c2 = tl.load(cos + HALF).to(tl.float32)
    s1 = tl.load(sin).to(tl.float32)
    s2 = tl.load(sin + HALF).to(tl.float32)

    # stage 2: every query head, then every key head
    _rotate_heads(q_ptr, q_out_ptr, row, t, n_q_heads, stride_q_b, stride_q_h, stride_q_t,
                  stride_qo_b, stride_qo_h, stride_qo_t, c1, c2, s1, s2, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, k_out_ptr, row, t, n_k_heads, stride_k_b, stride_k_h, stride_k_t,
                  stride_ko_b, stride_ko_h, stride_ko_t, c1, c2, s1, s2, HALF, BLOCK_HK)
