"""Shared-memory stages of the tensor-core decode-attention kernel (kernel_mma.py): block blk + 1's codes,
scales and zeros arrive by cp.async while block blk's math runs (kernel_notes.md, version 12, for why not
register prefetches). Only @gluon.jit code and layout constants.

Each of the STAGES stages (2, or 3 for two blocks in flight) holds, for one 64-token block of one KV head:
key words [2 BITS rows, 128] (int32: 4 rows of 16 tokens at 2 bits, 8 of 8 at 4), key scales and zeros of the
two 32-token halves [2, 128], value words, value scales and zeros [4, 16 NG] (the 64 x NG block in 4 rows, each
row one lane group's 16 tokens). The readers load each stage in a layout whose lanes match the operands'
(kernel_mma_frag.py, kernel_mma_frag4.py) and reshape in registers.

Value words, two ways (V_COPY; kernel_notes.md, versions 15-20, for the two that came between):
- 0, transposed [4 chunks, BITS words, 64 tokens] (version 15): 4-byte copies, so that a lane reads 16
  consecutive tokens of one word in 16-byte loads; the fallback where a token's 4 BITS words are not
  contiguous. Each warp-wide 4-byte copy touches 32 sectors for 128 bytes.
- 1, sectors (version 20, the default): the block's 2 KiB copied as they lie in 16-byte pieces, each token's 32
  bytes (one global sector) kept 32 contiguous bytes in shared memory, as the key words' are: [2 halves c,
  16 rho, 16] through a SharedLinearLayout whose offsets run w, c, u, rho (global order; element (c, rho,
  4 u + w) is token 4 rho + u, word 4 c + w), 32-byte units swizzled by rho // 4 so that the reader's 4-byte
  loads (16 tokens of one word a lane, lanes 16 tokens apart) hit distinct banks. Versions 17 and 19 split a
  token's sector in two in shared memory, and LDGSTS then asked for the sector once per lane (1.3x the
  kernel's ideal global sectors); here ncu counts 1.015x. At 4 bits (version 24) a token's 16 words are two
  sectors: [4 c, 16 rho, 16] with c's low bit where the 2-bit layout has c and its high bit above rho, so each
  sector stays 32 contiguous bytes and a chunk c is still one slice.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from .kernel_gluon_async import _page_of

# cp.async from global to shared memory: async_copy_global_to_shared in triton 3.6, async_load from 3.7 on
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared

# copy layouts (one warp): 16-byte pieces along the contiguous dim
_CP_KW = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0]))  # [4, 128] int32
_CP_S = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0]))  # [2, 128] 16-bit
# readers
_RD_KW = gl.constexpr(gl.DistributedLinearLayout(  # [4 row, 128]: channel 32 m2 + 8 a + e
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64]], lane_bases=[[0, 8], [0, 16], [0, 0], [1, 0], [2, 0]],
    warp_bases=[], block_bases=[], shape=[4, 128]))
_RD_KW4 = gl.constexpr(gl.DistributedLinearLayout(  # 4-bit keys [8 row, 128]: lane r reads word row r
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[], block_bases=[], shape=[8, 128]))
_RD_KS = gl.constexpr(gl.DistributedLinearLayout(  # [2 half, 128], every r lane the same
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64], [1, 0]], lane_bases=[[0, 8], [0, 16], [0, 0], [0, 0], [0, 0]],
    warp_bases=[], block_bases=[], shape=[2, 128]))
_RD_KZ = gl.constexpr(gl.DistributedLinearLayout(  # [2 half, 128]: lane 16 picks the half
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64]], lane_bases=[[0, 8], [0, 16], [0, 0], [0, 0], [1, 0]],
    warp_bases=[], block_bases=[], shape=[2, 128]))
_RD_VW = gl.constexpr(gl.DistributedLinearLayout(  # [2 rh, 64 tokens]: token 16 a + e, word 2 g + rh
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]], lane_bases=[[0, 16], [0, 32], [0, 0], [0, 0], [1, 0]],
    warp_bases=[], block_bases=[], shape=[2, 64]))
_RD_VW4 = gl.constexpr(gl.DistributedLinearLayout(  # 4-bit values [4 wq, 64 tokens]: word 4 g + 2 ih + rh
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [2, 0]], lane_bases=[[0, 16], [0, 32], [0, 0], [0, 0], [1, 0]],
    warp_bases=[], block_bases=[], shape=[4, 64]))
# (V_COPY 1) a stage [2 c, 16 rho, 16]: offsets in global order (w, c, u, rho), u ^= rho // 4
_VW_SECTORS = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 4], [0, 8, 8]]))
# at 4 bits [4 c, 16 rho, 16]: offsets (w, c % 2, u, rho, c // 2), u ^= rho // 4 (element (c, rho, 4 u + w) is
# token 4 rho + u, word 4 c + w: a sector's two 16-byte pieces c = 2 k, 2 k + 1 side by side)
_VW_SECTORS4 = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 4], [0, 8, 8],
                  [2, 0, 0]]))
_RD_VSEC = gl.constexpr(gl.DistributedLinearLayout(  # [1, 16, 16]: one slice c (a half; at 4 bits a chunk)
    reg_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 0, 2]], lane_bases=[[0, 4, 0], [0, 8, 0], [0, 0, 0],
                                                                                  [0, 0, 0], [0, 0, 1]],
    warp_bases=[], block_bases=[], shape=[1, 16, 16]))
_CP_VSEC = gl.constexpr(gl.DistributedLinearLayout(  # lanes in address order: lane 8 rho' + 2 u + c
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 4, 0], [0, 8, 0]], lane_bases=[[1, 0, 0], [0, 0, 4], [0, 0, 8], [0, 1, 0],
                                                                       [0, 2, 0]],
    warp_bases=[], block_bases=[], shape=[2, 16, 16]))
_CP_VSEC4 = gl.constexpr(gl.DistributedLinearLayout(  # 4 bits: lane 16 rho' + 4 u + c, 512 bytes in a row
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 2, 0], [0, 4, 0], [0, 8, 0]], lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 4],
                                                                                  [0, 0, 8], [0, 1, 0]],
    warp_bases=[], block_bases=[], shape=[4, 16, 16]))
# a half as [16 rho, 16] in the reader's lanes: lane (a, rh) holds words rh and 2 + rh of tokens 16 a + e
_RD_VN = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [0, 2]], lane_bases=[[4, 0], [8, 0], [0, 0], [0, 0], [0, 1]],
    warp_bases=[], block_bases=[], shape=[16, 16]))
# value scales [4 a, 16 NG]: element NG t + g of row a is token 16 a + t, group g
_RD_VS1, _RD_VS2, _RD_VS4 = (gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1 << i] for i in range(k + 4)], lane_bases=[[1, 0], [2, 0], [0, 0], [0, 0], [0, 0]],
    warp_bases=[], block_bases=[], shape=[4, 16 << k])) for k in range(3))


@gluon.jit
def _allocate_stages(ks_ty: gl.constexpr, NG: gl.constexpr, STAGES: gl.constexpr, V_COPY: gl.constexpr,
                     BITS: gl.constexpr = 2):
    """STAGES stages of every buffer: (kw, ks, kz, vw, vs, vz), 6 KiB a stage at 2 bits, 10 KiB at 4."""
    kw = gl.allocate_shared_memory(gl.int32, [STAGES, 2 * BITS, 128], gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
    ks = gl.allocate_shared_memory(ks_ty, [STAGES, 2, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    kz = gl.allocate_shared_memory(ks_ty, [STAGES, 2, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if V_COPY == 1 and BITS == 4:
        vw = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 16, 16], _VW_SECTORS4)
    elif V_COPY == 1:
        vw = gl.allocate_shared_memory(gl.int32, [STAGES, 2, 16, 16], _VW_SECTORS)
    else:
        vw = gl.allocate_shared_memory(gl.int32, [4 * STAGES, BITS, 64], gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
    VS: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 4, [1, 0])
    vs = gl.allocate_shared_memory(ks_ty, [STAGES, 4, 16 * NG], VS)
    vz = gl.allocate_shared_memory(ks_ty, [STAGES, 4, 16 * NG], VS)
    return kw, ks, kz, vw, vs, vz


@gluon.jit
def _issue_block(kw, ks, kz, vw, vs, vz, stage, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, blk,
                 n_end, nq, stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_vs_n,
                 stride_vs_h, stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr,
                 stride_vs_t: gl.constexpr, GROUP: gl.constexpr, PAGE: gl.constexpr, V_COPY: gl.constexpr,
                 BITS: gl.constexpr = 2):
    """cp.async of packed block blk (KV head h) into `stage`, one commit group. Scales and zeros of tokens past
    nq arrive as zeros (their rows may hold anything). BITS: 2 or 4 (codes per word 16 or 8)."""
    NG: gl.constexpr = 128 // GROUP
    page, off = _page_of(bt_row, blk, n_end, PAGE, 64)
    off = gl.multiple_of(off, 64)  # a block's first token in its page
    n_valid = nq - blk * 64
    # key words [2 BITS rows, 128]
    offs_row = gl.arange(0, 2 * BITS, layout=gl.SliceLayout(1, _CP_KW))
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(0, _CP_KW))
    kc_page = kc_ptr + page * stride_kc_n + h * stride_kc_h
    _async_load(kw.index(stage), kc_page + (off // (32 // BITS) + offs_row)[:, None] * stride_kc_w + offs_c[None, :])
    # key scales and zeros of the two halves [2, 128]
    offs_half = gl.arange(0, 2, layout=gl.SliceLayout(1, _CP_S))
    offs_sc = gl.arange(0, 128, layout=gl.SliceLayout(0, _CP_S))
    s_offs = page * stride_ks_n + h * stride_ks_h + ((off + 32 * offs_half) // GROUP)[:, None] * stride_ks_g
    s_mask = (32 * offs_half < n_valid)[:, None] & (offs_sc < 128)[None, :]
    _async_load(ks.index(stage), ks_ptr + s_offs + offs_sc[None, :], mask=s_mask)
    _async_load(kz.index(stage), kz_ptr + s_offs + offs_sc[None, :], mask=s_mask)
    vc_page = vc_ptr + page * stride_vc_n + h * stride_vc_h
    if V_COPY == 1:  # element (c, rho, 4 u + w) is token 4 rho + u, word 4 c + w
        gl.static_assert(stride_vc_t == 4 * BITS)  # 128 channels: a block's words are 2 or 4 KiB in a row
        CP_VSEC: gl.constexpr = _CP_VSEC if BITS == 2 else _CP_VSEC4
        offs_c = gl.arange(0, BITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, CP_VSEC)))
        offs_r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, CP_VSEC)))
        offs_col = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, CP_VSEC)))
        tok = off + 4 * offs_r[None, :, None] + (offs_col // 4)[None, None, :]
        _async_load(vw.index(stage), vc_page + tok * stride_vc_t + (4 * offs_c)[:, None, None]
                    + (offs_col % 4)[None, None, :])
    else:  # transposed: [BITS words, 64 tokens] for each 32-channel chunk g (words BITS g .. BITS g + BITS - 1)
        CP_VW: gl.constexpr = gl.BlockedLayout([BITS, 1], [1, 32], [1, 1], [0, 1])
        offs_w = gl.arange(0, BITS, layout=gl.SliceLayout(1, CP_VW))
        offs_t = gl.arange(0, 64, layout=gl.SliceLayout(0, CP_VW))
        v_ptrs = vc_page + (off + offs_t)[None, :] * stride_vc_t + offs_w[:, None]
        for g in gl.static_range(4):
            _async_load(vw.index(4 * stage + g), v_ptrs + BITS * g)
    # value scales and zeros [4, 16 NG]: row a holds tokens 16 a .. 16 a + 15
    CP_VS: gl.constexpr = gl.BlockedLayout([1, 2 * NG], [4, 8], [1, 1], [1, 0])  # no lane holds a copy twice
    offs_a = gl.arange(0, 4, layout=gl.SliceLayout(1, CP_VS))
    offs_e = gl.arange(0, 16 * NG, layout=gl.SliceLayout(0, CP_VS))
    gl.static_assert(stride_vs_t == NG)  # contiguous rows (ops_mma._blocks_aligned)
    v_offs = gl.multiple_of((off + 16 * offs_a) * NG, 16 * NG)[:, None] + offs_e[None, :]
    v_page = page * stride_vs_n + h * stride_vs_h
    # nq is a multiple of GROUP >= 32: a token is packed iff its 32-token half is (whole 16-byte copies)
    v_mask = (32 * (offs_a // 2) < n_valid)[:, None] & (offs_e < 16 * NG)[None, :]
    _async_load(vs.index(stage), (vs_ptr + v_page) + v_offs, mask=v_mask)
    _async_load(vz.index(stage), (vz_ptr + v_page) + v_offs, mask=v_mask)
    cp.commit_group()


@gluon.jit
def _value_words(vw, st, g: gl.constexpr, V_COPY: gl.constexpr, BITS: gl.constexpr = 2):
    """Words 2 g, 2 g + 1 of stage st's 64 tokens as [2 rh, 64 tokens] in _RD_VW; at 4 bits words 4 g .. 4 g + 3
    as [4 wq, 64 tokens] in _RD_VW4."""
    if V_COPY == 1 and BITS == 4:
        x = vw.index(st).slice(g, 1, dim=0).load(_RD_VSEC).reshape([16, 16])
        # [16 rho, 16 (4 u + w)] -> [4 w, 64 (4 rho + u)]: bits (r3 r2 r1 r0 u1 u0 w1 w0) -> (w1 w0 r3 .. r0 u1 u0)
        x = gl.convert_layout(x, _RD_VN, assert_trivial=True)
        x = x.reshape([2, 2, 2, 2, 2, 2, 2, 2]).permute(6, 7, 0, 1, 2, 3, 4, 5).reshape([4, 64])
        return gl.convert_layout(x, _RD_VW4, assert_trivial=True)
    elif V_COPY == 1:
        x = vw.index(st).slice(g // 2, 1, dim=0).load(_RD_VSEC).reshape([16, 16])
        # [16 rho, 16]: (a1 a0 e3 e2), (e1 e0 j rh)
        x = gl.convert_layout(x, _RD_VN, assert_trivial=True)
        x = x.reshape([2, 2, 2, 2, 2, 2, 2, 2]).permute(7, 0, 1, 2, 3, 4, 5, 6).reshape([2, 64, 2])
        w_even, w_odd = gl.split(x)  # words 2 (2 c) + rh and 2 (2 c + 1) + rh, token 16 a + e
        w = w_even if g % 2 == 0 else w_odd
        return gl.convert_layout(w, _RD_VW, assert_trivial=True)
    elif BITS == 4:
        return vw.index(4 * st + g).load(_RD_VW4)
    else:
        return vw.index(4 * st + g).load(_RD_VW)
