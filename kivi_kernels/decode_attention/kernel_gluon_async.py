"""The Gluon FMA decode-attention kernel's packed-block loops (kernel_gluon.py): plain, and with ASYNC the
pipelined one, where the next block's words arrive by cp.async into two shared-memory stages while the current
block's math runs. Register prefetches do not do this: ptxas moves such loads next to their use at the loop's
end (kernel_notes.md, version 12). Only @gluon.jit code."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from .kernel_gluon_magic import _packed_step_magic
from .kernel_gluon_step import _block_load, _packed_step, _value_scales

# cp.async from global to shared memory: async_copy_global_to_shared in triton 3.6, async_load from 3.7 on
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared


@gluon.jit
def _load_packed(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, blk, n_end, nq,
                 stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_vs_n, stride_vs_h,
                 LK: gl.constexpr, LV: gl.constexpr, stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr,
                 stride_vc_t: gl.constexpr, stride_vs_t: gl.constexpr, GROUP: gl.constexpr, PAGE: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """_block_load of packed block blk through the block table (the loop without cp.async)."""
    page, off = _page_of(bt_row, blk, n_end, PAGE, BLOCK_N)
    return _block_load(kc_ptr + page * stride_kc_n + h * stride_kc_h, ks_ptr + page * stride_ks_n + h * stride_ks_h,
                       kz_ptr + page * stride_ks_n + h * stride_ks_h, vc_ptr + page * stride_vc_n + h * stride_vc_h,
                       vs_ptr + page * stride_vs_n + h * stride_vs_h, vz_ptr + page * stride_vs_n + h * stride_vs_h,
                       off, nq - blk * BLOCK_N, LK, LV, stride_kc_w, stride_ks_g, stride_vc_t, stride_vs_t, GROUP)


@gluon.jit
def _page_of(bt_row, blk, n_end, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """(page, first token's offset in it) of packed block blk; past n_end page 0's first block (a prefetch
    beyond the last block reads it, and the caller never uses it)."""
    inside = blk < n_end
    tok = gl.where(inside, blk, 0) * BLOCK_N
    page = gl.where(inside, gl.load(bt_row + tok // PAGE, mask=inside, other=0), 0).to(gl.int64)
    return page, tok % PAGE


@gluon.jit
def _issue_block(kw_smem, ks_smem, kz_smem, vw_smem, stage, kc_ptr, ks_ptr, kz_ptr, vc_ptr, bt_row, h, blk, n_end,
                 stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h,
                 stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr, GROUP: gl.constexpr,
                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """cp.async of packed block blk (_page_of; KV head h) into stage `stage`: key words [K_WORDS, 128], key
    scales and zeros [K_WORDS, 128] (each word's group), value words [8 j, NI, 8 w] of tokens 16 i + 8 a + j for
    each half a (buffers 2 stage + a); 16-byte copies; one commit group."""
    K_WORDS: gl.constexpr = BLOCK_N // 16
    page, off = _page_of(bt_row, blk, n_end, PAGE, BLOCK_N)
    kc_ptr = kc_ptr + page * stride_kc_n + h * stride_kc_h
    ks_ptr = ks_ptr + page * stride_ks_n + h * stride_ks_h
    kz_ptr = kz_ptr + page * stride_ks_n + h * stride_ks_h
    vc_ptr = vc_ptr + page * stride_vc_n + h * stride_vc_h
    CK: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])
    CS: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    CV: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 2, 2], [1, 1, 1], [2, 1, 0])
    # key words and their groups' scales
    offs_kw = gl.arange(0, K_WORDS, layout=gl.SliceLayout(1, CK))
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(0, CK))
    _async_load(kw_smem.index(stage), kc_ptr + (off // 16 + offs_kw)[:, None] * stride_kc_w + offs_c[None, :])
    offs_sw = gl.arange(0, K_WORDS, layout=gl.SliceLayout(1, CS))
    offs_sc = gl.arange(0, 128, layout=gl.SliceLayout(0, CS))
    g_offs = ((off + offs_sw * 16) // GROUP)[:, None] * stride_ks_g + offs_sc[None, :]
    _async_load(ks_smem.index(stage), ks_ptr + g_offs)
    _async_load(kz_smem.index(stage), kz_ptr + g_offs)
    # value words of each half a, stored [j, i, w] so that reads of [i, j, w] with lanes on (i, w) are free of
    # bank conflicts
    offs_j = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, CV)))
    offs_i = gl.arange(0, K_WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(2, CV)))
    offs_w = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CV)))
    rows = (off + offs_j[:, None] + (offs_i * 16)[None, :])[:, :, None] * stride_vc_t + offs_w[None, None, :]
    _async_load(vw_smem.index(2 * stage), vc_ptr + rows)
    _async_load(vw_smem.index(2 * stage + 1), vc_ptr + 8 * stride_vc_t + rows)
    cp.commit_group()


@gluon.jit
def _packed_loop_async(q_c, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, bt_row, h, lo, n_end, nq,
                       m_i, l_i, acc_lo, acc_hi, m_acc, off_acc, stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h,
                       stride_vc_n, stride_vc_h, stride_vs_n, stride_vs_h, LK: gl.constexpr, LV: gl.constexpr,
                       stride_kc_w: gl.constexpr, stride_ks_g: gl.constexpr, stride_vc_t: gl.constexpr,
                       stride_vs_t: gl.constexpr, GROUP: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                       MAGIC: gl.constexpr):
    """Packed blocks [lo, n_end) through two shared-memory stages: block blk + 1's words arrive by cp.async
    while block blk's math runs (the compiler cannot move these copies next to their use, as it does with
    register prefetches). Value scales are plain loads, issued at the top of each step. MAGIC: the steps of
    kernel_gluon_magic.py (m_acc and off_acc carry its raw partials; otherwise they pass through)."""
    K_WORDS: gl.constexpr = BLOCK_N // 16
    SH3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # per stage
    SH4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    KW2: gl.constexpr = gl.SliceLayout(2, LK)
    VT3: gl.constexpr = gl.SliceLayout(3, LV)
    kw_smem = gl.allocate_shared_memory(gl.int32, [2, K_WORDS, 128], SH3)
    ks_smem = gl.allocate_shared_memory(ks_ptr.dtype.element_ty, [2, K_WORDS, 128], SH3)
    kz_smem = gl.allocate_shared_memory(kz_ptr.dtype.element_ty, [2, K_WORDS, 128], SH3)
    vw_smem = gl.allocate_shared_memory(gl.int32, [4, 8, K_WORDS, 8], SH4)  # [2 stage + a, j, i, w]
    _issue_block(kw_smem, ks_smem, kz_smem, vw_smem, 0, kc_ptr, ks_ptr, kz_ptr, vc_ptr, bt_row, h, lo, n_end,
                 stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h, stride_kc_w,
                 stride_ks_g, stride_vc_t, GROUP, PAGE, BLOCK_N)
    for blk in range(lo, n_end):
        stage = (blk - lo) % 2
        _issue_block(kw_smem, ks_smem, kz_smem, vw_smem, 1 - stage, kc_ptr, ks_ptr, kz_ptr, vc_ptr, bt_row, h,
                     blk + 1, n_end, stride_kc_n, stride_kc_h, stride_ks_n, stride_ks_h, stride_vc_n, stride_vc_h,
                     stride_kc_w, stride_ks_g, stride_vc_t, GROUP, PAGE, BLOCK_N)
        n_valid = nq - blk * BLOCK_N
        page, off = _page_of(bt_row, blk, n_end, PAGE, BLOCK_N)
        vs_row = page * stride_vs_n + h * stride_vs_h
        v0_mult, v0_off = _value_scales(vs_ptr + vs_row, vz_ptr + vs_row, off, n_valid, 0, LV, stride_vs_t, GROUP)
        v1_mult, v1_off = _value_scales(vs_ptr + vs_row, vz_ptr + vs_row, off, n_valid, 1, LV, stride_vs_t, GROUP)
        cp.wait_group(1)  # block blk's group (all but the newest) has landed
        k_words = kw_smem.index(stage).permute([1, 0]).load(KW2)
        k_mult = ks_smem.index(stage).permute([1, 0]).load(KW2).to(gl.float32) * 4.0
        k_off = kz_smem.index(stage).permute([1, 0]).load(KW2).to(gl.float32) - k_mult
        v0_words = vw_smem.index(2 * stage).permute([1, 0, 2]).load(VT3)
        v1_words = vw_smem.index(2 * stage + 1).permute([1, 0, 2]).load(VT3)
        if MAGIC:
            m_i, l_i, acc_lo, acc_hi, m_acc, off_acc = _packed_step_magic(
                q_c, k_words, k_mult, k_off, v0_words, v0_mult, v0_off, v1_words, v1_mult, v1_off, n_valid, m_i, l_i,
                acc_lo, acc_hi, m_acc, off_acc, LK, LV)
        else:
            m_i, l_i, acc_lo, acc_hi = _packed_step(q_c, k_words, k_mult, k_off, v0_words, v0_mult, v0_off,
                                                    v1_words, v1_mult, v1_off, n_valid, m_i, l_i, acc_lo, acc_hi, LK,
                                                    LV)
    cp.wait_group(0)
    return m_i, l_i, acc_lo, acc_hi, m_acc, off_acc

