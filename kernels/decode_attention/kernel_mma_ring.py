"""Version 29: the tensor-core kernel's full-precision ring through shared memory (kernel_mma.py, RING_STAGED).
Only @gluon.jit code and layout constants.

Version 14's ring step loads a 32-slot chunk's keys and values into registers and waits on them: ncu put 47% of
the one-warp programs' cycles between instructions in L1TEX waits (kernel_notes.md, "The ring's chunks loaded a
step ahead"), and registers, which cap an SM at 8 programs, leave no room to load a chunk ahead. Here the chunks
arrive by cp.async in two 8 KiB buffers, keys and values, each refilled with the next chunk as soon as this
chunk's product has read it, so a load has half a step to land and holds no registers meanwhile. The buffers are
allocated after the packed loop, whose stages are dead by then, so a program's shared memory does not grow past
16 KiB (one block a step took 12) and 8 programs still fit an SM.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .kernel_mma_frag import _COLS, _MMA, _OP_A, _OP_B, _RK, _RV, _S3_RING, _to_kappa
from .kernel_mma_loop import _online_softmax
from .kernel_mma_stage import _async_load

# copy layout: a chunk [32 slots, 128 channels] of 16-bit elements in 16-byte pieces, 2 slots a warp-wide copy
_CP_RING = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0]))
# a chunk in shared memory: 16-byte pieces swizzled by slot % 8, so that the readers' 16-byte (keys, _RK: 8 slots
# a phase) and 8-byte (values, _RV: 4 slots) loads hit distinct banks
_SH_RING = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))


@gluon.jit
def _issue_ring(buf, row_ptr, start, lim, nq_mod, n_res, stride_res_t: gl.constexpr, RESIDUAL: gl.constexpr):
    """cp.async of ring slots [start, start + 32) (row_ptr at the row's slot and head) into buf, one commit group;
    slots that hold no token, or at or past lim, arrive as zeros and are not read."""
    offs_s = start + gl.arange(0, 32, layout=gl.SliceLayout(1, _CP_RING))
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(0, _CP_RING))
    ok = ((offs_s + RESIDUAL - nq_mod) % RESIDUAL < n_res) & (offs_s < lim) & (offs_s < RESIDUAL)
    _async_load(buf, row_ptr + offs_s[:, None] * stride_res_t + offs_c[None, :],
                mask=ok[:, None] & (offs_c < 128)[None, :])
    cp.commit_group()


@gluon.jit
def _staged_values(rv, g: gl.constexpr, BITS: gl.constexpr):
    """A operand [32 rho, 32 k] of the chunk's slots k for channels 32 g + 4 r + i (rho = 8 i + r; with BITS=4 in
    the packed values' order of kernel_mma_frag4.py), from the values' buffer rv [32, 128]."""
    v = rv.slice(32 * g, 32, dim=1).load(_RV)
    if BITS == 2:
        v = v.reshape([32, 8, 4]).permute(2, 1, 0).reshape([32, 32])  # [rho = 8 i + r, k]: channel 4 r + i
    else:  # channel 16 ih + 8 rh + 2 rl + ic -> rho = 16 ih + 8 ic + 4 rh + rl
        v = v.reshape([32, 2, 2, 4, 2]).permute(1, 4, 2, 3, 0).reshape([32, 32])
    return gl.convert_layout(v, _OP_A)


@gluon.jit
def _ring_stage_staged(q_a, kr_row, vr_row, ring_lo, ring_hi, nq, n_res, qk_scale, m_i, l_i, acc0, acc1, acc2,
                       acc3, z, stride_res_t: gl.constexpr, RESIDUAL: gl.constexpr, BITS: gl.constexpr):
    """Ring slots [ring_lo, ring_hi) (pointers at the row's slot and head) in 32-slot steps into sums of their
    own, r0..r3 [32, 8], the packed sums rescaled as the softmax state moves: (m_i, l_i, acc0..acc3, z, r0..r3),
    as kernel_mma._ring_stage returns them."""
    rk = gl.allocate_shared_memory(kr_row.dtype.element_ty, [32, 128], _SH_RING)
    rv = gl.allocate_shared_memory(vr_row.dtype.element_ty, [32, 128], _SH_RING)
    nq_mod = nq % RESIDUAL
    _issue_ring(rk, kr_row, ring_lo, ring_hi, nq_mod, n_res, stride_res_t, RESIDUAL)
    _issue_ring(rv, vr_row, ring_lo, ring_hi, nq_mod, n_res, stride_res_t, RESIDUAL)
    r0 = gl.zeros([32, 8], gl.float32, _MMA)
    r1 = r0
    r2 = r0
    r3 = r0
    for start in range(ring_lo, ring_hi, 32):
        # stage 1: this chunk's keys (groups in flight: its keys, its values); scores
        cp.wait_group(1)
        k = rk.load(_RK)
        raw = mma_v2(q_a, gl.convert_layout(_to_kappa(k, 32), _OP_B, assert_trivial=True),
                     gl.zeros([16, 32], gl.float32, _MMA))
        # stage 2: the next chunk's keys into the buffer just read, while the softmax and the values run
        _issue_ring(rk, kr_row, start + 32, ring_hi, nq_mod, n_res, stride_res_t, RESIDUAL)
        offs_s = start + gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, _S3_RING)))
        ok_s = ((offs_s + RESIDUAL - nq_mod) % RESIDUAL < n_res) & (offs_s < RESIDUAL)
        s, _ = gl.split(raw.reshape([2, 8, 32]).permute(1, 2, 0))
        s = gl.convert_layout(s, gl.SliceLayout(1, _S3_RING))
        s = gl.where(ok_s[None, :], s * qk_scale, float("-inf"))[:, None, :]  # [8, 1, 32]
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        alpha_c = gl.convert_layout(alpha, _COLS)[None, :]
        p_t = gl.convert_layout(p.reshape([8, 32]).permute(1, 0).to(vr_row.dtype.element_ty), _OP_B)  # [32, 8]
        # stage 3: this chunk's values (groups in flight: its values, the next keys), then the next values
        cp.wait_group(1)
        r0 = mma_v2(_staged_values(rv, 0, BITS), p_t, r0 * alpha_c)
        r1 = mma_v2(_staged_values(rv, 1, BITS), p_t, r1 * alpha_c)
        r2 = mma_v2(_staged_values(rv, 2, BITS), p_t, r2 * alpha_c)
        r3 = mma_v2(_staged_values(rv, 3, BITS), p_t, r3 * alpha_c)
        _issue_ring(rv, vr_row, start + 32, ring_hi, nq_mod, n_res, stride_res_t, RESIDUAL)
        acc0, acc1, acc2, acc3 = acc0 * alpha_c, acc1 * alpha_c, acc2 * alpha_c, acc3 * alpha_c
        z = z * alpha_c
    cp.wait_group(0)
    return m_i, l_i, acc0, acc1, acc2, acc3, z, r0, r1, r2, r3
