"""Quantize-and-pack at prefill with each program looping over several groups, its loads staged through shared
memory (store kernels, 15 in benchmarks/results/kernel_notes.md). Only @triton.jit code; ops.store_prefill
launches it (staged=True). The math is kernel.py's, so the codes are the same bit for bit.

Why: one group a program (store_prefill_kernel) exposes each program's load latency once per group, and a program
holding the next group's tile in registers (store kernels, 13) halved the programs an SM. Here the loop's loads are
cp.async copies STAGES deep (tl.range's software pipelining): the tiles in flight wait in shared memory, not in
registers.
"""

import triton
import triton.language as tl

from .kernel import _part, _store_chunk


@triton.jit
def store_prefill_staged_kernel(
    key_ptr, value_ptr, starts_ptr, lengths_ptr, slots_ptr, block_table_ptr,
    k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, k_res_ptr, v_res_ptr,
    D,
    stride_key_b, stride_key_h, stride_key_t, stride_value_b, stride_value_h, stride_value_t,
    stride_bt_s,
    stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
    stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
    stride_res_s, stride_res_h, stride_res_t,
    SPLIT,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, RESIDUAL: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_C: tl.constexpr, NC: tl.constexpr, STAGES: tl.constexpr,
):
    """Grid (B, H, 2 * NC * SPLIT): program (b, h, z) stores part j = z % (2 * NC) (keys or values, BLOCK_C
    channels) of groups s, s + SPLIT, s + 2 * SPLIT, ... of row b (s = z // (2 * NC)): first the groups below nq
    (quantized into pages), then those in [nq, L) (copied into ring slots t % RESIDUAL)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    # stage 1: row state; nq = GROUP * ceil(max(0, L - RESIDUAL) / GROUP) tokens go to pages
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    nq = tl.cdiv(tl.maximum(length - RESIDUAL, 0), GROUP) * GROUP
    is_key, c0, offs_c = _part(z % (2 * NC), NC, BLOCK_C)
    first = (z // (2 * NC)).to(tl.int64)  # the loops' indices are int64: t0 * stride_t may pass 2**31
    mask_c = offs_c < D
    offs_t = tl.arange(0, GROUP)
    if is_key:
        src = key_ptr + b * stride_key_b + h * stride_key_h + (start + offs_t)[:, None] * stride_key_t + offs_c[None, :]
        stride_t = stride_key_t
        res_ptr = k_res_ptr
    else:
        src = (value_ptr + b * stride_value_b + h * stride_value_h + (start + offs_t)[:, None] * stride_value_t
               + offs_c[None, :])
        stride_t = stride_value_t
        res_ptr = v_res_ptr
    # stage 2: the program's whole groups below nq, each quantized into group (t0 % PAGE) / GROUP of its page;
    # the tiles of the next STAGES - 1 groups are in flight while one is quantized
    for g in tl.range(first, nq // GROUP, SPLIT, num_stages=STAGES):
        t0 = g * GROUP
        x = tl.load(src + t0 * stride_t, mask=mask_c[None, :], other=0.0).to(tl.float32)
        page = tl.load(block_table_ptr + slot * stride_bt_s + t0 // PAGE).to(tl.int64)
        _store_chunk(x, is_key, c0, page, (t0 % PAGE) // GROUP, h,
                     k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                     stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
                     stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                     offs_c, mask_c, D, K_BITS, V_BITS, GROUP)
    # stage 3: the program's groups in [nq, L) (at most RESIDUAL / GROUP in a row) -> ring slots t % RESIDUAL,
    # copied in the cache dtype
    for g in range(nq // GROUP + first, tl.cdiv(length, GROUP), SPLIT):
        t0 = g * GROUP
        mask = ((t0 + offs_t) < length)[:, None] & mask_c[None, :]
        x = tl.load(src + t0 * stride_t, mask=mask)
        ring = (t0 + offs_t) % RESIDUAL
        res = slot * stride_res_s + h * stride_res_h + ring[:, None] * stride_res_t + offs_c[None, :]
        tl.store(res_ptr + res, x.to(res_ptr.dtype.element_ty), mask=mask)
