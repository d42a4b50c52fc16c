"""Version 28: the tensor-core decode-attention kernel (kernel_mma.py) as persistent programs. Only @gluon.jit code;
the launcher is ops_mma.launch_mma (persistent=True).

A grid of as many one-warp programs as the SMs hold (8 an SM) takes work items, one (row, KV head, split) each,
in the order of kernel_mma.py's ROW_MAJOR grid (heads fastest, then rows, then splits): program p starts on item
p, and each next item comes from an atomic counter, so programs that drew short items take more of them. The
point is what happens between two items. A program of kernel_mma.py pays, alone, its row's lookups, the query's
load and its first block's cp.async before any math; here the next item's query and first block are issued
(one cp.async group) as the current item issues its last block, so they land while the current item computes
its last block, its ring and its stores. The next item's row (seq_lens, slots) is loaded an item before that,
as the previous item starts, and its index drawn an item earlier still, so no lookup waits on the one before.

Counter: counter_ptr [2] int32, zero before a launch: [0] hands out items from the grid's size on, [1] counts
programs done; the last program done sets both to zero again for the next launch on the stream (so one counter
serves every call that runs one after another; calls running at once on two streams need two).

Two cp.async stages, one block a step (kernel_mma_loop._packed_loop's stages): stage (base + blk - lo) % 2 holds
block blk, where base is the stage of the item's first block; the query of item k sits in q_smem[k % 2].
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from .kernel_gluon_step import _row_range
from .kernel_mma import _ring_stage, _store_item
from .kernel_mma_frag import _MMA, _OP_A, _Q8, _ROWS, _launch_dependents
from .kernel_mma_loop import _block_step, _issue
from .kernel_mma_stage import _allocate_stages, _async_load

_CP_Q = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0]))  # [8 h, 128] 16-bit: 16-byte pieces
_LANES = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # [32]: one a lane


@gluon.jit
def _draw(counter_ptr):
    """An item index from the counter, drawn by lane 0 as a [32] tensor (lane 0's value). A scalar atomic would
    broadcast its value to the warp at once, and the warp would wait for the atomic there; _drawn's reduction is
    left to where the index is used, an item later. Relaxed: the counter orders nothing else."""
    lane = gl.arange(0, 32, layout=_LANES)
    return gl.atomic_add(counter_ptr + lane * 0, gl.full([32], 1, gl.int32, _LANES), mask=lane == 0, sem="relaxed")


@gluon.jit
def _drawn(drawn, n_programs):
    """The item index _draw drew: the grid's size plus lane 0's counter value."""
    lane = gl.arange(0, 32, layout=_LANES)
    return n_programs + gl.max(gl.where(lane == 0, drawn, 0), axis=0)


@gluon.jit
def _item_row(item, n_items, batch, heads, seq_lens_ptr, slots_ptr):
    """The loads of item `item`'s row: (seq_len, slot); past the last item (n_items), the last item's."""
    b = (gl.minimum(item, n_items - 1) // heads) % batch
    return gl.load(seq_lens_ptr + b), gl.load(slots_ptr + b)


@gluon.jit
def _item_range(item, n_items, batch, heads, num_splits, seq_len, slot, GROUP: gl.constexpr,
                RESIDUAL: gl.constexpr, RING_UNITS: gl.constexpr):
    """Item `item`'s (b, h, split) and its work range from its row's loads (_row_range: slot, nq, n_res, n_packed,
    n_ring, lo, hi); an item past the last has no work units (hi = lo)."""
    it = gl.minimum(item, n_items - 1)
    h = it % heads
    b = (it // heads) % batch
    split = it // (heads * batch)
    slot, nq, n_res, n_packed, n_ring, lo, hi = _row_range(seq_len, slot, split, num_splits, GROUP, RESIDUAL, 64,
                                                           RING_UNITS, True)
    hi = gl.where(item < n_items, hi, lo)
    return b.to(gl.int64), h.to(gl.int64), split, slot, nq, n_res, n_packed, n_ring, lo, hi


@gluon.jit
def _issue_head(stages, stage, q_smem, q_buf, q_ptr, b, h, stride_q_b, stride_q_h, lo, n_end, nq, bt_row, ptrs,
                strides, stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr,
                stride_vs_t: gl.constexpr, QG: gl.constexpr, GROUP: gl.constexpr, PAGE: gl.constexpr,
                V_COPY: gl.constexpr, BITS: gl.constexpr):
    """One cp.async group: an item's query [8 h, 128] (heads from QG on zero) into q_smem[q_buf] and its first
    packed block lo into `stage` (past n_end: scales and zeros as zeros, kernel_mma_stage._issue_block)."""
    offs_h = gl.arange(0, 8, layout=gl.SliceLayout(1, _CP_Q))
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(0, _CP_Q))
    q_row = q_ptr + b * stride_q_b + (h * QG) * stride_q_h
    _async_load(q_smem.index(q_buf), q_row + offs_h[:, None] * stride_q_h + offs_c[None, :],
                mask=(offs_h < QG)[:, None] & (offs_c < 128)[None, :])
    _issue(stages, stage, lo, ptrs, strides, n_end, nq, bt_row, h, stride_kc_w, stride_ks_g, stride_vc_t,
           stride_vs_t, GROUP, PAGE, V_COPY, BITS)


@gluon.jit
def _issue_next(stages, stage, q_smem, q_buf, q_ptr, item, n_items, batch, heads, num_splits, seq_len, slot,
                block_table_ptr, stride_bt_s, stride_q_b, stride_q_h, ptrs, strides, stride_kc_w: gl.constexpr,
                stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr, stride_vs_t: gl.constexpr, QG: gl.constexpr,
                GROUP: gl.constexpr, RESIDUAL: gl.constexpr, PAGE: gl.constexpr, V_COPY: gl.constexpr,
                BITS: gl.constexpr, RING_UNITS: gl.constexpr):
    """_issue_head for item `item` from its row's loads (seq_len, slot)."""
    b, h, _, slot, nq, _, n_packed, _, lo, hi = _item_range(item, n_items, batch, heads, num_splits, seq_len, slot,
                                                            GROUP, RESIDUAL, RING_UNITS)
    _issue_head(stages, stage, q_smem, q_buf, q_ptr, b, h, stride_q_b, stride_q_h, lo, gl.minimum(hi, n_packed), nq,
                block_table_ptr + slot * stride_bt_s, ptrs, strides, stride_kc_w, stride_ks_g, stride_vc_t,
                stride_vs_t, QG, GROUP, PAGE, V_COPY, BITS)


@gluon.jit
def _query_operands(q_tile, qk_scale, a_dtype: gl.constexpr, q8_fp16: gl.constexpr):
    """From an item's query [8 h, 128] in channel order (fp32): q8 [8, 128] times qk in the key operand's channel
    order (kernel_mma_frag._perm_channel; fp16 when the key scales are) and the raw query as an A operand
    [16, 128] in a_dtype (rows from 8 on zero), as kernel_mma.py's stage 1 loads them."""
    # channel 32 m2 + 8 a + 2 mm + b -> operand index 32 m2 + 8 mm + 2 a + b
    q = q_tile.reshape([8, 4, 4, 4, 2]).permute(0, 1, 3, 2, 4).reshape([8, 128])
    q8 = gl.convert_layout(q, _Q8) * qk_scale
    if q8_fp16:
        q8 = q8.to(gl.float16)
    return q8, _query_a(q_tile, a_dtype)


@gluon.jit
def _query_a(q_tile, a_dtype: gl.constexpr):
    """The raw query [8 h, 128] in channel order (fp32) as an A operand [16, 128] in a_dtype, channels in the
    operand's order, rows from 8 on zero (kernel_mma._query_operand)."""
    q = q_tile.reshape([8, 4, 4, 4, 2]).permute(0, 1, 3, 2, 4).reshape([8, 128])
    q16 = gl.join(q, gl.zeros_like(q)).permute(2, 0, 1).reshape([16, 128])  # row 8 t + h: t = 1 zero
    return gl.convert_layout(q16, _OP_A).to(a_dtype)


@gluon.jit
def _decode_attention_mma_persistent_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr,
    block_table_ptr, slots_ptr, seq_lens_ptr, o_ptr, lse_ptr, counter_ptr,
    qk_scale, num_splits, batch, heads,
    stride_q_b, stride_q_h,
    stride_kc_n, stride_kc_h, stride_kc_w: gl.constexpr,
    stride_ks_n, stride_ks_h, stride_ks_g: gl.constexpr,
    stride_vc_n, stride_vc_h, stride_vc_t: gl.constexpr,
    stride_vs_n, stride_vs_h, stride_vs_t: gl.constexpr,
    stride_res_s, stride_res_h, stride_res_t: gl.constexpr,
    stride_bt_s,
    stride_o_b, stride_o_h, stride_o_s, stride_lse_b, stride_lse_h,
    QG: gl.constexpr, GROUP: gl.constexpr, RESIDUAL: gl.constexpr, PAGE: gl.constexpr, SPLIT: gl.constexpr,
    V_COPY: gl.constexpr = 1, RING_UNITS: gl.constexpr = 2, BITS: gl.constexpr = 2, PDL: gl.constexpr = False,
):
    """grid (programs,): items of batch x heads x num_splits as the module docstring says; each item's work and
    output as kernel_mma._decode_attention_mma_kernel's program (b, h, split) (without RING_PASS, one block a
    step, two stages)."""
    gl.static_assert(PAGE % 64 == 0 and RESIDUAL % 32 == 0 and (GROUP == 32 or GROUP == 64) and QG <= 8)
    gl.static_assert(BITS == 2 or BITS == 4)
    NG: gl.constexpr = 128 // GROUP
    n_programs = gl.num_programs(0)
    n_items = batch * heads * num_splits
    item = gl.program_id(0)
    if PDL:  # the merge may launch now and wait at its start (common.merge_splits)
        item = _launch_dependents(item)
    stages = _allocate_stages(ks_ptr.dtype.element_ty, NG, 2, V_COPY, BITS)
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2, 8, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ptrs = (kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr)
    strides = (stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_vs_n, stride_vs_h)
    # stage 0: the first item's rows, its query and first block in flight; the next item's index and row loads,
    # the one after's index (each item then loads the row of the item after the next and draws the index after it)
    seq_len, slot = _item_row(item, n_items, batch, heads, seq_lens_ptr, slots_ptr)
    b, h, split, slot, nq, n_res, n_packed, n_ring, lo, hi = _item_range(
        item, n_items, batch, heads, num_splits, seq_len, slot, GROUP, RESIDUAL, RING_UNITS)
    _issue_head(stages, 0, q_smem, 0, q_ptr, b, h, stride_q_b, stride_q_h, lo, gl.minimum(hi, n_packed), nq,
                block_table_ptr + slot * stride_bt_s, ptrs, strides, stride_kc_w, stride_ks_g, stride_vc_t,
                stride_vs_t, QG, GROUP, PAGE, V_COPY, BITS)
    nxt = _drawn(_draw(counter_ptr), n_programs)
    nxt_len, nxt_slot = _item_row(nxt, n_items, batch, heads, seq_lens_ptr, slots_ptr)
    after = _drawn(_draw(counter_ptr), n_programs)
    base = 0  # the stage of this item's first block
    q_buf = 0  # the query buffer of this item
    while item < n_items:
        # stage 1: the row of the item after the next, and the index after that (used an item and two from now)
        after_len, after_slot = _item_row(after, n_items, batch, heads, seq_lens_ptr, slots_ptr)
        after_next = _draw(counter_ptr)
        # stage 2: this item's query (its group, issued an item ago, has landed by now as a rule)
        cp.wait_group(0)
        q_tile = q_smem.index(q_buf).load(_CP_Q).to(gl.float32)
        q8, q_a = _query_operands(q_tile, qk_scale, kz_ptr.dtype.element_ty, ks_ptr.dtype.element_ty == gl.float16)
        m_i = gl.full([8], float("-inf"), gl.float32, _ROWS)
        l_i = gl.full([8], 0.0, gl.float32, _ROWS)
        acc0 = gl.zeros([32, 8], gl.float32, _MMA)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        z = gl.zeros([16, 8], gl.float32, _MMA)
        # stage 3: the packed blocks; the last one issues the next item's query and first block
        bt_row = block_table_ptr + slot * stride_bt_s
        n_end = gl.minimum(hi, n_packed)
        for blk in range(lo, n_end):
            st = (base + blk - lo) % 2
            if blk + 1 < n_end:
                _issue(stages, 1 - st, blk + 1, ptrs, strides, n_end, nq, bt_row, h, stride_kc_w, stride_ks_g,
                       stride_vc_t, stride_vs_t, GROUP, PAGE, V_COPY, BITS)
            else:
                _issue_next(stages, 1 - st, q_smem, 1 - q_buf, q_ptr, nxt, n_items, batch, heads, num_splits,
                            nxt_len, nxt_slot, block_table_ptr, stride_bt_s, stride_q_b, stride_q_h, ptrs, strides,
                            stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t, QG, GROUP, RESIDUAL, PAGE, V_COPY,
                            BITS, RING_UNITS)
            cp.wait_group(1)  # block blk's group has landed
            m_i, l_i, acc0, acc1, acc2, acc3, z = _block_step(q8, q_a, qk_scale, stages, st, nq - blk * 64, m_i, l_i,
                                                              acc0, acc1, acc2, acc3, z, NG, V_COPY, BITS)
        n_blocks = gl.maximum(n_end - lo, 0)
        if n_blocks == 0:  # no packed blocks: the stages are idle (this item's group was waited for above)
            _issue_next(stages, base, q_smem, 1 - q_buf, q_ptr, nxt, n_items, batch, heads, num_splits, nxt_len,
                        nxt_slot, block_table_ptr, stride_bt_s, stride_q_b, stride_q_h, ptrs, strides, stride_kc_w,
                        stride_ks_g, stride_vc_t, stride_vs_t, QG, GROUP, RESIDUAL, PAGE, V_COPY, BITS, RING_UNITS)
        # stage 4: the ring's share, then the output (kernel_mma.py's stages 3 and 4)
        if kr_ptr.dtype.element_ty != kz_ptr.dtype.element_ty:  # fp16 scales, bf16 ring
            q_a = _query_a(q_smem.index(q_buf).load(_CP_Q).to(gl.float32), kr_ptr.dtype.element_ty)
        res = slot * stride_res_s + h * stride_res_h
        m_i, l_i, acc0, acc1, acc2, acc3, z, r0, r1, r2, r3 = _ring_stage(
            q_a, kr_ptr + res, vr_ptr + res, lo, hi, n_packed, n_ring, nq, n_res, qk_scale, m_i, l_i, acc0, acc1,
            acc2, acc3, z, stride_res_t, RESIDUAL, BITS, SPLIT, RING_UNITS)
        _store_item(o_ptr + b * stride_o_b + (h * QG) * stride_o_h + split.to(gl.int64) * stride_o_s,
                    lse_ptr + b * stride_lse_b + (h * QG) * stride_lse_h + split, m_i, l_i, acc0, acc1, acc2, acc3,
                    z, r0, r1, r2, r3, stride_o_h, stride_lse_h, QG, GROUP, BITS, SPLIT)
        # the next item
        base = (base + n_blocks) % 2
        q_buf = 1 - q_buf
        b, h, split, slot, nq, n_res, n_packed, n_ring, lo, hi = _item_range(
            nxt, n_items, batch, heads, num_splits, nxt_len, nxt_slot, GROUP, RESIDUAL, RING_UNITS)
        item = nxt
        nxt, nxt_len, nxt_slot = after, after_len, after_slot
        after = _drawn(after_next, n_programs)
    cp.wait_group(0)
    # the last program done resets the counter for the next launch
    if gl.atomic_add(counter_ptr + 1, 1) == n_programs - 1:
        gl.atomic_xchg(counter_ptr, 0)
        gl.atomic_xchg(counter_ptr + 1, 0)
