"""Triton kernels that store K/V into the KIVI cache (ops 1 and 2 of docs/design.md).

Only @triton.jit code lives here; shapes, dtypes and strides are checked by ops.py. All math is fp32
(the interpreter gets bf16 arithmetic wrong, so tiles are cast right after loading). Codes follow
kivi_kernels/packing.py bit for bit: scale and zero are rounded to the scale dtype first, codes are computed
from the stored values with IEEE division (div_rn), and the launcher disables FMA contraction so
(x - zero) * inv + 0.5 rounds like the PyTorch reference.
"""

import triton
import triton.language as tl

from ..packing import FP16_MAX as _FP16_MAX

FP16_MAX = tl.constexpr(_FP16_MAX)  # fp16 scales and zeros saturate here (packing.quantize_groups)


@triton.jit
def _scale_zero_inv(mn, mx, QMAX: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """fp32 min/max -> (scale, zero) in the scale dtype and inv = 1/scale (0 where scale == 0), fp32. fp16
    scales saturate at +-FP16_MAX: the codes of values past it clamp to the ends."""
    if CACHE_DTYPE == tl.float16:
        mn = tl.minimum(tl.maximum(mn, -FP16_MAX), FP16_MAX)
        mx = tl.minimum(tl.maximum(mx, -FP16_MAX), FP16_MAX)
    scale = tl.math.div_rn(mx - mn, tl.full(mn.shape, QMAX, tl.float32)).to(CACHE_DTYPE)
    zero = mn.to(CACHE_DTYPE)
    scale_f = scale.to(tl.float32)
    safe = tl.where(scale_f > 0, scale_f, 1.0)
    inv = tl.where(scale_f > 0, tl.math.div_rn(tl.full(mn.shape, 1.0, tl.float32), safe), 0.0)
    return scale, zero, inv


@triton.jit
def _codes(x, zero, inv, QMAX: tl.constexpr):
    """clamp(floor((x - zero) * inv + 0.5), 0, QMAX) as int32; zero/inv broadcast against x.

    The clamped value is in [0, QMAX + 1), so truncation is the floor: one conversion, no separate rounding,
    and never out of int32's range (saturated fp16 scales leave values far past a group's clamped max)."""
    q = tl.minimum(tl.maximum((x - zero.to(tl.float32)) * inv + 0.5, 0.0), QMAX + 0.5)
    return q.to(tl.int32)


@triton.jit
def _store_key_chunk(
    x, codes_ptr, scale_ptr, zero_ptr, stride_kc_w, offs_c, mask_c,
    BITS: tl.constexpr, GROUP: tl.constexpr,
):
    """x: [GROUP tokens, BLOCK_C channels] fp32 -> GROUP * BITS / 32 words per channel and 1 scale/zero per
    channel. codes_ptr points at word 0 of the group, scale_ptr/zero_ptr at the group's [D] row; offs_c are the
    chunk's channels."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_C: tl.constexpr = x.shape[1]
    # stage 1: per-channel statistics over the GROUP tokens
    scale, zero, inv = _scale_zero_inv(tl.min(x, axis=0), tl.max(x, axis=0), QMAX, scale_ptr.dtype.element_ty)
    # stage 2: codes, packed along tokens (token w * PER_WORD + i -> bits [i * BITS, (i + 1) * BITS) of word w;
    # the fields never overlap, so a sum packs them)
    codes = _codes(x, zero[None, :], inv[None, :], QMAX)
    codes = tl.reshape(codes, (GROUP // PER_WORD, PER_WORD, BLOCK_C))
    shifts = tl.arange(0, PER_WORD) * BITS
    words = tl.sum(codes << shifts[None, :, None], axis=1)  # [GROUP // PER_WORD, BLOCK_C] int32
    # stage 3: store words and the per-channel scale/zero
    offs_w = tl.arange(0, GROUP // PER_WORD)
    tl.store(codes_ptr + offs_w[:, None] * stride_kc_w + offs_c[None, :], words, mask=mask_c[None, :])
    tl.store(scale_ptr + offs_c, scale, mask=mask_c)
    tl.store(zero_ptr + offs_c, zero, mask=mask_c)


@triton.jit
def _store_value_chunk(
    x, codes_ptr, scale_ptr, zero_ptr, stride_vc_t, stride_vs_t, c0, D,
    BITS: tl.constexpr, GROUP: tl.constexpr,
):
    """x: [GROUP tokens, BLOCK_C channels from c0] fp32 -> per token BLOCK_C * BITS / 32 words and BLOCK_C / GROUP
    scale/zero. codes_ptr / scale_ptr / zero_ptr point at the group's first token row (channel 0)."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_C: tl.constexpr = x.shape[1]
    NG: tl.constexpr = BLOCK_C // GROUP
    # stage 1: per-token statistics over groups of GROUP channels
    xg = tl.reshape(x, (GROUP, NG, GROUP))
    scale, zero, inv = _scale_zero_inv(tl.min(xg, axis=2), tl.max(xg, axis=2), QMAX,
                                       scale_ptr.dtype.element_ty)  # [GROUP, NG]
    # stage 2: codes, packed along channels
    codes = _codes(xg, zero[:, :, None], inv[:, :, None], QMAX)
    codes = tl.reshape(codes, (GROUP, BLOCK_C // PER_WORD, PER_WORD))
    shifts = tl.arange(0, PER_WORD) * BITS
    words = tl.sum(codes << shifts[None, None, :], axis=2)  # [GROUP, BLOCK_C // PER_WORD] int32
    # stage 3: store words and the per-group scale/zero (channels beyond D are masked)
    offs_t = tl.arange(0, GROUP)
    offs_w = c0 // PER_WORD + tl.arange(0, BLOCK_C // PER_WORD)
    offs_g = c0 // GROUP + tl.arange(0, NG)
    mask_w = offs_w[None, :] < D // PER_WORD
    mask_g = offs_g[None, :] < D // GROUP
    tl.store(codes_ptr + offs_t[:, None] * stride_vc_t + offs_w[None, :], words, mask=mask_w)
    tl.store(scale_ptr + offs_t[:, None] * stride_vs_t + offs_g[None, :], scale, mask=mask_g)
    tl.store(zero_ptr + offs_t[:, None] * stride_vs_t + offs_g[None, :], zero, mask=mask_g)


@triton.jit
def _store_chunk(
    x, is_key, c0, page, g, h,
    k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
    stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
    stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
    offs_c, mask_c, D,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr,
):
    """Quantize one chunk (x: [GROUP, BLOCK_C] fp32, channels offs_c = c0 + i) of the keys (is_key) or values of
    group g of page `page`, head h."""
    if is_key:
        KW: tl.constexpr = GROUP * K_BITS // 32  # key words per group
        kc = k_codes_ptr + page * stride_kc_n + h * stride_kc_h + g * KW * stride_kc_w
        ks = page * stride_ks_n + h * stride_ks_h + g * stride_ks_g
        _store_key_chunk(x, kc, k_scale_ptr + ks, k_zero_ptr + ks, stride_kc_w, offs_c, mask_c, K_BITS, GROUP)
    else:
        vc = v_codes_ptr + page * stride_vc_n + h * stride_vc_h + g * GROUP * stride_vc_t
        vs = page * stride_vs_n + h * stride_vs_h + g * GROUP * stride_vs_t
        _store_value_chunk(x, vc, v_scale_ptr + vs, v_zero_ptr + vs, stride_vc_t, stride_vs_t, c0, D, V_BITS, GROUP)


@triton.jit
def _part(j, NC: tl.constexpr, BLOCK_C: tl.constexpr):
    """Part j of a group's 2 * NC parts -> (is_key, first channel c0, channel offsets): keys first, then values,
    BLOCK_C channels each."""
    is_key = j < NC
    c0 = (j % NC) * BLOCK_C
    return is_key, c0, c0 + tl.arange(0, BLOCK_C)


@triton.jit
def store_prefill_kernel(
    key_ptr, value_ptr, starts_ptr, lengths_ptr, slots_ptr, block_table_ptr,
    k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, k_res_ptr, v_res_ptr,
    D,
    stride_key_b, stride_key_h, stride_key_t, stride_value_b, stride_value_h, stride_value_t,
    stride_bt_s,
    stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
    stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
    stride_res_s, stride_res_h, stride_res_t,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, RESIDUAL: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_C: tl.constexpr, NC: tl.constexpr,
):
    """Grid (B, H, cdiv(T, GROUP) * 2 * NC): program (b, h, j) stores part j % (2 * NC) (keys or values,
    BLOCK_C channels; NC = cdiv(D, BLOCK_C)) of tokens [t0, t0 + GROUP) of row b, t0 = (j // (2 * NC)) * GROUP."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2)
    # stage 1: row state; nq = GROUP * ceil(max(0, L - RESIDUAL) / GROUP) tokens go to pages
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    nq = tl.cdiv(tl.maximum(length - RESIDUAL, 0), GROUP) * GROUP
    t0 = (j // (2 * NC)).to(tl.int64) * GROUP
    is_key, c0, offs_c = _part(j % (2 * NC), NC, BLOCK_C)
    mask_c = offs_c < D
    offs_t = tl.arange(0, GROUP)
    rows = start + t0 + offs_t  # input positions of the group's tokens
    if is_key:
        src = key_ptr + b * stride_key_b + h * stride_key_h + rows[:, None] * stride_key_t + offs_c[None, :]
        res_ptr = k_res_ptr
    else:
        src = value_ptr + b * stride_value_b + h * stride_value_h + rows[:, None] * stride_value_t + offs_c[None, :]
        res_ptr = v_res_ptr
    if t0 < nq:
        # stage 2a: a whole group below nq -> quantize into group (t0 % PAGE) / GROUP of its page
        x = tl.load(src, mask=mask_c[None, :], other=0.0).to(tl.float32)
        page = tl.load(block_table_ptr + slot * stride_bt_s + t0 // PAGE).to(tl.int64)
        _store_chunk(x, is_key, c0, page, (t0 % PAGE) // GROUP, h,
                     k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                     stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
                     stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                     offs_c, mask_c, D, K_BITS, V_BITS, GROUP)
    elif t0 < length:
        # stage 2b: tokens in [nq, L) -> residual ring slots t % RESIDUAL, copied in the cache dtype
        mask = ((t0 + offs_t) < length)[:, None] & mask_c[None, :]
        x = tl.load(src, mask=mask)
        ring = (t0 + offs_t) % RESIDUAL
        res = slot * stride_res_s + h * stride_res_h + ring[:, None] * stride_res_t + offs_c[None, :]
        tl.store(res_ptr + res, x.to(res_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flush_chunk(
    ring_ptr, ring, offs_c, is_key, c0, page, t0, h,
    k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
    stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
    stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
    stride_res_t, D,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
):
    """Quantize channels offs_c (from c0) of the oldest group, ring slots `ring` of the row's head (ring_ptr),
    into group (t0 % PAGE) / GROUP of page `page`."""
    mask_c = offs_c < D
    x = tl.load(ring_ptr + ring[:, None] * stride_res_t + offs_c[None, :], mask=mask_c[None, :],
                other=0.0).to(tl.float32)
    _store_chunk(x, is_key, c0, page, (t0 % PAGE) // GROUP, h,
                 k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                 stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
                 stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                 offs_c, mask_c, D, K_BITS, V_BITS, GROUP)


@triton.jit
def _live(mask, offs, seq_len):
    """mask where the row is active (seq_len > 0), as a block: the interpreter rejects a block mask and-ed with a
    scalar predicate."""
    return mask & (seq_len + 0 * offs > 0)


@triton.jit
def store_decode_kernel(
    key_ptr, value_ptr, seq_lens_ptr, slots_ptr, block_table_ptr,
    k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr, k_res_ptr, v_res_ptr,
    D,
    stride_key_b, stride_key_h, stride_value_b, stride_value_h,
    stride_bt_s,
    stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
    stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
    stride_res_s, stride_res_h, stride_res_t,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, GROUP: tl.constexpr, RESIDUAL: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_C: tl.constexpr, NC: tl.constexpr, LOOP_CHUNKS: tl.constexpr = False,
    BLOCK_D: tl.constexpr = 1,
):
    """Grid (B, H, 2 * NC): append part j (keys or values, BLOCK_C channels) of token L = seq_lens[b] - 1 of row
    b, head h; flush that part of the oldest group first if the ring is full. LOOP_CHUNKS: grid (B, H, 2), part j
    the keys or the values of the whole head, its flush a loop over the NC chunks."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if LOOP_CHUNKS:
        # the keys (is_key) or values of the whole head, all D channels (BLOCK_D = next_power_of_2(D)); if the ring
        # is full the oldest group is flushed first, NC chunks of BLOCK_C channels in turn (a loop, so the
        # program's registers are those of one [GROUP, BLOCK_C] tile; appends, 31 rows in 32 at a staggered step,
        # never wait on a flush)
        is_key = tl.program_id(2) == 0
        c0 = 0
        offs = tl.arange(0, BLOCK_D)
    else:
        is_key, c0, offs = _part(tl.program_id(2), NC, BLOCK_C)
    mask = offs < D
    # stage 1: the row's state and the new token's channels, loaded together (none depends on another). No branch
    # on seq_len: seq_lens == 0 marks an inactive row, whose flush test fails (t0 < 0) and whose append is masked,
    # so the compiler cannot sink the slot and token loads below a test of seq_len, which would wait for one load
    # before issuing the next
    if is_key:
        x_new = tl.load(key_ptr + b * stride_key_b + h * stride_key_h + offs, mask=mask)
        res_ptr = k_res_ptr
    else:
        x_new = tl.load(value_ptr + b * stride_value_b + h * stride_value_h + offs, mask=mask)
        res_ptr = v_res_ptr
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    L = seq_len - 1
    res_base = slot * stride_res_s + h * stride_res_h
    t0 = L - RESIDUAL
    if (t0 >= 0) & (t0 % GROUP == 0):
        # stage 2: the ring is full -> quantize tokens [t0, t0 + GROUP) from slots t0 % RESIDUAL + i
        ring = t0 % RESIDUAL + tl.arange(0, GROUP)
        page = tl.load(block_table_ptr + slot * stride_bt_s + t0 // PAGE).to(tl.int64)
        if LOOP_CHUNKS:
            for ci in range(NC):  # a loop, not unrolled: one chunk's tile in registers at a time
                offs_c = ci * BLOCK_C + tl.arange(0, BLOCK_C)
                _flush_chunk(res_ptr + res_base, ring, offs_c, is_key, ci * BLOCK_C, page, t0, h,
                             k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                             stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
                             stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                             stride_res_t, D, K_BITS, V_BITS, GROUP, PAGE)
        else:
            _flush_chunk(res_ptr + res_base, ring, offs, is_key, c0, page, t0, h,
                         k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
                         stride_kc_n, stride_kc_h, stride_kc_w, stride_ks_n, stride_ks_h, stride_ks_g,
                         stride_vc_n, stride_vc_h, stride_vc_t, stride_vs_n, stride_vs_h, stride_vs_t,
                         stride_res_t, D, K_BITS, V_BITS, GROUP, PAGE)
        # every thread must have read the old slot before any thread overwrites it below
        tl.debug_barrier()
    # stage 3: the new token into ring slot L % RESIDUAL
    tl.store(res_ptr + res_base + (L % RESIDUAL) * stride_res_t + offs, x_new.to(res_ptr.dtype.element_ty),
             mask=_live(mask, offs, seq_len))
