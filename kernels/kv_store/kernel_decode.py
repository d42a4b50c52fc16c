"""The decode store with its flushes shared out as items (store 14, `flush_items`; ops 2 of docs/design.md).
Only @triton.jit code; ops.store_decode checks and launches it.

store_decode_kernel runs a program for each (row, head, keys or values): 16,384 one-warp programs at 256 rows of
32 KV heads, about four waves of them, although in a step of staggered rows only 1 row in 32 flushes a group and
every other program only copies 256 bytes. Here a row's append is one program for each BLOCK_H heads' keys (or
values), and the flushes go to a fixed set of programs that count the flushing rows from seq_lens themselves (a
prefix sum in registers: no atomics, no workspace, so a CUDA graph can hold the call) and take their (row, head,
part) items in turn. An item quantizes one BLOCK_C-channel part of the oldest group, then writes the same
channels of the new token into the slot it just read, so no item waits on another.
"""

import triton
import triton.language as tl

from .kernel import _store_chunk


@triton.jit
def _append_row(new_ptr, res_ptr, seq_len, slot, stride_new_h, stride_res_s, stride_res_h, stride_res_t, H, D,
                RESIDUAL: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token L = seq_len - 1 of the first min(H, BLOCK_H) heads [., D] (new_ptr, res_ptr at the row's first such
    head) into ring slot L % RESIDUAL, unless the row is inactive (seq_len 0) or flushes at this step (its flush
    items write the token)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < H)[:, None] & (offs_d < D)[None, :]
    x = tl.load(new_ptr + offs_h[:, None] * stride_new_h + offs_d[None, :], mask=mask)
    t0 = seq_len - 1 - RESIDUAL
    if (seq_len > 0) & ((t0 < 0) | (t0 % GROUP != 0)):
        res = slot * stride_res_s + offs_h[:, None] * stride_res_h + ((seq_len - 1) % RESIDUAL) * stride_res_t
        tl.store(res_ptr + res + offs_d[None, :], x.to(res_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flushing_rows(seq_lens_ptr, B, RESIDUAL: tl.constexpr, GROUP: tl.constexpr, BLOCK_B: tl.constexpr):
    """[BLOCK_B] int32: 1 where row b < B flushes at this step (active, ring full: L >= RESIDUAL and
    (L - RESIDUAL) % GROUP == 0), else 0."""
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens_ptr + offs_b, mask=offs_b < B, other=0)
    t0 = lens - 1 - RESIDUAL
    return ((lens > 0) & (t0 >= 0) & (t0 % GROUP == 0)).to(tl.int32)


@triton.jit
def store_decode_items_kernel(
    key_ptr, value_ptr, seq_lens_ptr, slots_ptr, block_table_ptr,
    k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, k_res_ptr, v_res_ptr,
    B, H, D, num_flush_programs,
    stride_key_b, stride_key_h, stride_value_b, stride_value_h,
    stride_bt_s,
    stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
    stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
    stride_res_s, stride_res_h, stride_res_t,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, RESIDUAL: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_C: tl.constexpr, NC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Grid (2 B HB + num_flush_programs,), HB = cdiv(H, BLOCK_H): program (2 b + k) HB + j appends heads
    [j BLOCK_H, (j + 1) BLOCK_H) of row b's keys (k = 0) or values (k = 1); program 2 B HB + f takes key items
    f, f + num_flush_programs, ... of the n_flush * H * NC, then the value items of the same numbers (_flush_item:
    item i is chunk i % NC of head (i // NC) % H of the (i // (NC H))-th row that flushes, in row order)."""
    pid = tl.program_id(0)
    HB = tl.cdiv(H, BLOCK_H)
    if pid < 2 * B * HB:
        # appends: one program for BLOCK_H heads' keys or values of a row
        b = (pid // (2 * HB)).to(tl.int64)
        h0 = ((pid % HB) * BLOCK_H).to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        if (pid // HB) % 2 == 0:
            _append_row(key_ptr + b * stride_key_b + h0 * stride_key_h, k_res_ptr + h0 * stride_res_h, seq_len,
                        slot, stride_key_h, stride_res_s, stride_res_h, stride_res_t, H - h0, D, RESIDUAL, GROUP,
                        BLOCK_H, BLOCK_D)
        else:
            _append_row(value_ptr + b * stride_value_b + h0 * stride_value_h, v_res_ptr + h0 * stride_res_h,
                        seq_len, slot, stride_value_h, stride_res_s, stride_res_h, stride_res_t, H - h0, D, RESIDUAL,
                        GROUP, BLOCK_H, BLOCK_D)
    else:
        # stage 1: how many rows flush at this step; then their key items, then their value items (two loops,
        # each over one kind, so that the program's registers are those of one kind's tile: one loop over both
        # took 255 registers and spilled at one warp, keys alone 140)
        n_flush = tl.sum(_flushing_rows(seq_lens_ptr, B, RESIDUAL, GROUP, BLOCK_B), axis=0)
        f = pid - 2 * B * HB
        for item in range(f, n_flush * H * NC, num_flush_programs):
            _flush_item(item, True, key_ptr, seq_lens_ptr, slots_ptr, block_table_ptr, k_codes_ptr, k_scale_ptr,
                        k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, k_res_ptr, B, H, D, stride_key_b,
                        stride_key_h, stride_bt_s, stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h,
                        stride_ks_g, stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                        stride_res_s, stride_res_h, stride_res_t, K_BITS, V_BITS, GROUP, RESIDUAL, PAGE, BLOCK_C, NC,
                        BLOCK_B)
        for item in range(f, n_flush * H * NC, num_flush_programs):
            _flush_item(item, False, value_ptr, seq_lens_ptr, slots_ptr, block_table_ptr, k_codes_ptr, k_scale_ptr,
                        k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, v_res_ptr, B, H, D, stride_value_b,
                        stride_value_h, stride_bt_s, stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h,
                        stride_ks_g, stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                        stride_res_s, stride_res_h, stride_res_t, K_BITS, V_BITS, GROUP, RESIDUAL, PAGE, BLOCK_C, NC,
                        BLOCK_B)


@triton.jit
def _flush_item(item, IS_KEY: tl.constexpr, new_ptr, seq_lens_ptr, slots_ptr, block_table_ptr, k_codes_ptr,
                k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, res_ptr, B, H, D, stride_new_b,
                stride_new_h, stride_bt_s, stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
                stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t, stride_res_s,
                stride_res_h, stride_res_t, K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr,
                RESIDUAL: tl.constexpr, PAGE: tl.constexpr, BLOCK_C: tl.constexpr, NC: tl.constexpr,
                BLOCK_B: tl.constexpr):
    """Key (IS_KEY) or value item `item`: chunk item % NC of head (item // NC) % H of the (item // (NC H))-th
    flushing row: its part of the oldest group quantized into its page, then the same channels of the new token
    (new_ptr: key or value [B, H, D]) into the slot just read (res_ptr: k_res or v_res)."""
    # stage 2: the row (the k-th flushing row: k rows flush before it; the prefix sum is redone here from
    # seq_lens in L1, so that it holds no registers across the loop), head and chunk
    k = item // (H * NC)
    before = tl.cumsum(_flushing_rows(seq_lens_ptr, B, RESIDUAL, GROUP, BLOCK_B), axis=0)
    b = tl.sum((before <= k).to(tl.int32), axis=0).to(tl.int64)
    h = ((item // NC) % H).to(tl.int64)
    c0 = (item % NC) * BLOCK_C
    offs_c = c0 + tl.arange(0, BLOCK_C)
    mask_c = offs_c < D
    L = tl.load(seq_lens_ptr + b).to(tl.int64) - 1
    slot = tl.load(slots_ptr + b).to(tl.int64)
    t0 = L - RESIDUAL
    # stage 3: quantize the chunk of tokens [t0, t0 + GROUP) from slots t0 % RESIDUAL + i into its page
    res_base = slot * stride_res_s + h * stride_res_h
    ring = t0 % RESIDUAL + tl.arange(0, GROUP)
    x = tl.load(res_ptr + res_base + ring[:, None] * stride_res_t + offs_c[None, :], mask=mask_c[None, :],
                other=0.0).to(tl.float32)
    page = tl.load(block_table_ptr + slot * stride_bt_s + t0 // PAGE).to(tl.int64)
    _store_chunk(x, IS_KEY, c0, page, (t0 % PAGE) // GROUP, h,
                 k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                 stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
                 stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                 offs_c, mask_c, D, K_BITS, V_BITS, GROUP)
    # every thread must have read the old slot before any thread overwrites it below
    tl.debug_barrier()
    # stage 4: the same channels of the new token into slot L % RESIDUAL (the group's first, just read)
    x_new = tl.load(new_ptr + b * stride_new_b + h * stride_new_h + offs_c, mask=mask_c)
    tl.store(res_ptr + res_base + (L % RESIDUAL) * stride_res_t + offs_c, x_new.to(res_ptr.dtype.element_ty),
             mask=mask_c)
