"""Triton kernel for RMSNorm over the last dim of a [M, N] view (launched by ops.py)."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr,  # x [M, N], weight [N], out [M, N]
    n_rows, n_cols, eps,
    stride_x_row, stride_out_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # each program normalizes BLOCK_M whole rows (BLOCK_N >= n_cols)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]

    # stage 1: mean of squares in fp32
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # [BLOCK_M], as torch.rsqrt

    # stage 2: normalize and round to the input dtype (as transformers does before the weight)
    x_hat = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)

    # stage 3: scale by the weight; the product is rounded once, to the output dtype
    w = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out = x_hat * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
