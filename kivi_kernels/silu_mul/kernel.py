"""Triton kernel for SiLU-and-multiply over a [M, 2 N] gate/up product (launched by ops.py)."""

import triton
import triton.language as tl


@triton.jit
def silu_mul_kernel(
    gate_up_ptr, out_ptr,  # gate_up [M, 2 N] (gate columns first), out [M, N]
    n_rows, n_cols,
    stride_gate_up_row, stride_out_row,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # each program takes a [BLOCK_M, BLOCK_N] tile of the output
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]

    # stage 1: the gate and up halves of each row, math in fp32 (row offsets in int64: a prefill's product can
    # pass 2**31 elements)
    row_offsets = rows.to(tl.int64)
    gate_ptrs = gate_up_ptr + row_offsets[:, None] * stride_gate_up_row + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)

    # stage 2: silu(gate) rounded to the input dtype (as transformers' act_fn returns it), then the product
    # rounded once to the output dtype. The division is the approximate one (div.full.f32, within 2 ulp of fp32):
    # the correctly rounded div_rn made the decode step's call compute-bound (8.8 against 3.2 us at 256 rows of
    # 11,008 on the H200), and after the rounding to 16 bits the outputs matched the reference's in every element
    act = tl.math.fdiv(gate, 1.0 + tl.exp(-gate), ieee_rounding=False).to(gate_up_ptr.dtype.element_ty)
    act = act.to(tl.float32)
    out = act * up
    out_ptrs = out_ptr + row_offsets[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
