"""Layouts and register-built operands of the tensor-core decode-attention kernel (kernel_mma.py, version 14).
Only @gluon.jit code and layout constants.

NVMMA v2 fragments for one warp, lane = 4 r + a. Channels enter the score product in the order
    kappa = 8 m + 2 a + b  ->  channel 32 (m // 4) + 8 a + 2 (m % 4) + b          (_perm_channel)
so that each lane's 32 channels are four runs of 8 (16-byte loads of key words, 16-byte loads of bf16 scales).
Loads are issued over natural dims (contiguous innermost) and reshaped into the operands' order; every
conversion to an operand layout is asserted trivial (no data movement).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .kernel_mma_stage import _RD_KS, _RD_KW, _RD_KZ, _RD_VS1, _RD_VS2, _RD_VS4

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
_OP_A = gl.constexpr(gl.DotOperandLayout(0, _MMA, 2))
_OP_B = gl.constexpr(gl.DotOperandLayout(1, _MMA, 2))
# key words of a channel pair and word row, broadcast over the row's two halves: [64 cp, 4 row, 2 rr]
_KW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[4, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0]],
    lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0]], warp_bases=[], block_bases=[],
    shape=[64, 4, 2]))
# merged key words broadcast over the 8 codes nn: [64 cp, 8 nn, 8 r]
_KX = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[4, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], warp_bases=[], block_bases=[],
    shape=[64, 8, 8]))
# key zeros [128 kappa, 2 half, 4 jjj] broadcast over jjj: column 4 half + jjj of the bias product's B operand
_KZ3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0], [64, 0, 0]],
    lane_bases=[[2, 0, 0], [4, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0]], warp_bases=[], block_bases=[],
    shape=[128, 2, 4]))
# value words of a token pair kp, broadcast over the 4 lanes rl that read different bytes: [2 rh, 4 rl, 32 kp]
_VW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 4], [0, 0, 8], [0, 0, 16]],
    lane_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [1, 0, 0]], warp_bases=[], block_bases=[],
    shape=[2, 4, 32]))
# merged value words broadcast over the 4 codes i of a byte: [4 i, 8 r, 32 kp]
_VX = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16], [2, 0, 0]],
    lane_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[], block_bases=[],
    shape=[4, 8, 32]))
# scores of one half [8 h, 8 nn, 8 j] (column n = 8 nn + j of the accumulator: token 8 j + nn)
_S3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[], block_bases=[],
    shape=[8, 8, 8]))
# probabilities as the values' B operand, viewed [8 nn, 8 j, 8 h]
_P3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], warp_bases=[], block_bases=[],
    shape=[8, 8, 8]))
# the query of the 8 heads in the A operand's element order (no padding rows): [8 h, 128 kappa]
_Q8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32], [0, 64]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[8, 128]))
# ring scores [8 h, 1, 32 n]
_S3_RING = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]], warp_bases=[], block_bases=[],
    shape=[8, 1, 32]))
# value zeros as the zeros' product's A operand, from a stage [4 a, 16 NG]: element (a, NG (8 b + nn) + gg) is
# token 16 a + 8 b + nn (column kappa = 8 nn + 2 a + b) of group gg; lanes 4, 8 hold gg (broadcast where NG < 4)
_RD_VZ1, _RD_VZ2, _RD_VZ4 = (gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 8 << k], [0, 1 << k], [0, 2 << k], [0, 4 << k]],
    lane_bases=[[1, 0], [2, 0]] + [[0, 1 << i] for i in range(k)] + [[0, 0]] * (3 - k), warp_bases=[],
    block_bases=[], shape=[4, 16 << k])) for k in range(3))
# ... broadcast to the A operand's 16 rows: [2 m8, 8 / NG, NG gg, 64 kappa] (row 8 m8 + NG i + gg: group gg)
_VZ1, _VZ2, _VZ4 = (gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 8], [0, 0, 0, 16], [0, 0, 0, 32]],
    lane_bases=[[0, 0, 0, 2], [0, 0, 0, 4]] + [[0, 0, 1 << i, 0] for i in range(k)] + [[0, 1 << i, 0, 0]
                                                                                        for i in range(3 - k)],
    warp_bases=[], block_bases=[], shape=[2, 8 >> k, 1 << k, 64])) for k in range(3))
# the ring's keys as loaded [32 slots n, 128 channels]: channel 32 m2 + 8 a + e, slot r + 8 nn
_RK = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64], [8, 0], [16, 0]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[32, 128]))
# the ring's values of one 32-channel chunk as loaded [32 slots, 32 channels]: channel 4 r + i, slot 2 a + b + 8 m
_RV = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]], warp_bases=[], block_bases=[], shape=[32, 32]))
_ROWS = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(1, _S3)))  # [8 h] on lanes r
_COLS = gl.constexpr(gl.SliceLayout(0, _MMA))  # [8 h] on lanes a (the value accumulators' columns)


@gluon.jit
def _perm_channel(kappa):
    """The channel that operand index kappa = 8 m + 2 a + b stands for."""
    return 32 * (kappa // 32) + 8 * ((kappa % 8) // 2) + 2 * ((kappa // 8) % 4) + kappa % 2


@gluon.jit
def _prmt(x, y, sel):
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [x, y, sel], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _launch_dependents(x):
    """griddepcontrol.launch_dependents (sm_90): the split merge, launched as a programmatic dependent, may
    start once every program of this grid has passed here (it waits for their writes before reading); a no-op
    for a kernel launched otherwise. Returns x (an int32 scalar) so the instruction has an operand."""
    return gl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n mov.b32 $0, $1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _hmul2(x, y):
    """x * y of fp16 tensors, two elements per instruction (consecutive registers pair up)."""
    return gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [x, y], dtype=gl.float16,
                                     is_pure=True, pack=2)


@gluon.jit
def _codes_f16(x, mask):
    """fp16 pairs (code (lo) and code (hi) 4^w 2^-24, or 16^w 2^-24 for 4-bit codes) of x & mask; x, mask are
    int32 tensors whose pairs of consecutive registers are equal (the operand's k pairs)."""
    return gl.inline_asm_elementwise("and.b32 $0, $1, $3;", "=r,r,r,r,r", [x, mask], dtype=gl.float16,
                                     is_pure=True, pack=2)


@gluon.jit
def _to_kappa(v, N: gl.constexpr):
    """[N, 128 channels] -> [128 kappa, N]: channel 32 m2 + 8 a + 2 mm + b becomes operand index
    kappa = 32 m2 + 8 mm + 2 a + b (the inverse of _perm_channel), a register-only reshape."""
    return v.reshape([N, 4, 4, 4, 2]).permute(1, 3, 2, 4, 0).reshape([128, N])


@gluon.jit
def _key_codes(kw):
    """B operand [128 kappa, 64 n] fp16 from a stage's key words kw [4 rows, 128]: column n = 8 nn + r is token
    8 r + nn, half r % 2 of word row r // 2, code nn."""
    words = kw.load(_RD_KW)  # [4 row, 128]: channel 32 m2 + 8 a + 2 mm + b
    words = words.reshape([4, 4, 4, 4, 2]).permute(1, 3, 2, 0, 4).reshape([64, 4, 2])  # [cp, row, b]
    w0, w1 = gl.split(words)  # [64 cp, 4 row]: the pair's two channels
    w0 = gl.convert_layout(w0, gl.SliceLayout(2, _KW), assert_trivial=True)[:, :, None]
    w1 = gl.convert_layout(w1, gl.SliceLayout(2, _KW), assert_trivial=True)[:, :, None]
    rr = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, _KW)))[None, None, :]
    x = _prmt(w0, w1, gl.where(rr == 0, 0x5410, 0x7632))  # [64, 4 row, 2 rr]: the low or high halves
    x = gl.convert_layout(x.reshape([64, 8]), gl.SliceLayout(1, _KX), assert_trivial=True)
    x = x.to(gl.uint32, bitcast=True)
    nn = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, _KX)))[None, :, None]
    x3 = gl.where(nn >= 5, x[:, None, :] >> 10, x[:, None, :]).to(gl.int32, bitcast=True)  # [64, 8 nn, 8 r]
    mask3, x3 = gl.broadcast(0x00030003 << (2 * (nn % 5)), x3)
    return _key_operand(x3, mask3)


@gluon.jit
def _key_operand(x3, mask3):
    """B operand [128 kappa, 64 n] fp16 from words x3 [64 cp, 8 nn, 8 r] in _KX (int32) under masks mask3 that
    keep code nn of each half: column n = 8 nn + r, kappa pairs 2 cp, 2 cp + 1 (the halves' two channels)."""
    xp = gl.convert_layout(gl.join(x3, x3).permute(0, 3, 1, 2).reshape([128, 64]), _OP_B, assert_trivial=True)
    mp = gl.convert_layout(gl.join(mask3, mask3).permute(0, 3, 1, 2).reshape([128, 64]), _OP_B,
                           assert_trivial=True)
    return _codes_f16(xp, mp)


@gluon.jit
def _key_scale_halves(ks):
    """Key scales of the step's two 32-token halves from a stage's ks [2, 128], [128 kappa] each in the query's
    order (fp16 scales stay fp16, others become fp32)."""
    v = ks.load(_RD_KS)  # [2 half, 128]
    if v.dtype != gl.float16:
        v = v.to(gl.float32)
    v0, v1 = gl.split(_to_kappa(v, 2))  # [128 kappa] of each half
    return (gl.convert_layout(v0, gl.SliceLayout(0, _Q8), assert_trivial=True),
            gl.convert_layout(v1, gl.SliceLayout(0, _Q8), assert_trivial=True))


@gluon.jit
def _key_zeros(kz):
    """B operand [128 kappa, 8 jj] of the key zeros from a stage's kz [2, 128]: column jj holds half jj // 4."""
    v = kz.load(_RD_KZ)  # [2 half, 128]
    v = gl.convert_layout(_to_kappa(v, 2), gl.SliceLayout(2, _KZ3), assert_trivial=True)[:, :, None]
    jjj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _KZ3)))[None, None, :]
    v, _ = gl.broadcast(v, jjj)
    return gl.convert_layout(v.reshape([128, 8]), _OP_B, assert_trivial=True)


@gluon.jit
def _value_codes(words):
    """A operand [32 rho, 64 k] fp16 of channels 32 g + 4 r + i (rho = 8 i + r) from value words [2 rh, 64 tokens]
    (word 2 g + rh, in _RD_VW) of chunk g; column k = 2 kp + b is token 16 (kp % 4) + 8 b + kp // 4."""
    words = words.reshape([2, 4, 2, 8]).permute(0, 3, 1, 2).reshape([2, 32, 2])  # [rh, kp, b]
    w0, w1 = gl.split(words)  # [2 rh, 32 kp]: tokens t and t + 8 of the pair
    w0 = gl.convert_layout(w0, gl.SliceLayout(1, _VW), assert_trivial=True)[:, None, :]
    w1 = gl.convert_layout(w1, gl.SliceLayout(1, _VW), assert_trivial=True)[:, None, :]
    byte = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _VW)))[None, :, None]  # rl = r % 4
    sel = byte | (byte << 4) | ((byte + 4) << 8) | ((byte + 4) << 12)  # byte r % 4 of each word
    x = _prmt(w0, w1, sel)  # [2 rh, 4 rl, 32 kp]
    x = gl.convert_layout(x.reshape([8, 32]), gl.SliceLayout(0, _VX), assert_trivial=True)
    i = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _VX)))[:, None, None]
    mask3, x3 = gl.broadcast(0x00030003 << (2 * i), x[None, :, :])
    return _value_operand(x3, mask3)


@gluon.jit
def _value_operand(x3, mask3):
    """A operand [32 rho, 64 k] fp16 from words x3 [4 i, 8 r, 32 kp] in _VX (int32) under masks mask3 that keep
    code i: row rho = 8 i + r, column k = 2 kp + b (b: the pair's two tokens, the halves of each word)."""
    xp = gl.convert_layout(gl.join(x3, x3).reshape([32, 64]), _OP_A, assert_trivial=True)
    mp = gl.convert_layout(gl.join(mask3, mask3).reshape([32, 64]), _OP_A, assert_trivial=True)
    return _codes_f16(xp, mp)


@gluon.jit
def _value_scale_chunks(vs, NG: gl.constexpr):
    """Scales (or zeros) of tokens 8 j + nn for the four 32-channel chunks from a stage's vs [4, 16 NG],
    [8 nn, 8 j] fp32 each in the probabilities' layout."""
    RD: gl.constexpr = _RD_VS1 if NG == 1 else _RD_VS2 if NG == 2 else _RD_VS4
    v = vs.load(RD)  # [4 a, 16 NG]: token 16 a + 8 b + nn, group g (fp16 stays fp16, others become fp32)
    if v.dtype != gl.float16:
        v = v.to(gl.float32)
    v = v.reshape([4, 2, 8, NG]).permute(2, 0, 1, 3).reshape([8, 8, NG])  # [nn, j = 2 a + b, g]
    if NG == 1:
        v0 = v.reshape([8, 8])
        v1, v2, v3 = v0, v0, v0
    elif NG == 2:
        v0, v2 = gl.split(v)
        v1, v3 = v0, v2
    else:
        ve, vo = gl.split(v.reshape([8, 8, 2, 2]))  # groups 0, 2 and 1, 3
        v0, v2 = gl.split(ve)
        v1, v3 = gl.split(vo)
    S: gl.constexpr = gl.SliceLayout(2, _P3)
    return (gl.convert_layout(v0, S), gl.convert_layout(v1, S), gl.convert_layout(v2, S), gl.convert_layout(v3, S))


@gluon.jit
def _value_zeros(vz, NG: gl.constexpr):
    """A operand [16, 64 kappa] of the value zeros from a stage's vz [4, 16 NG]: row m holds group m % NG."""
    RD: gl.constexpr = _RD_VZ1 if NG == 1 else _RD_VZ2 if NG == 2 else _RD_VZ4
    L4: gl.constexpr = _VZ1 if NG == 1 else _VZ2 if NG == 2 else _VZ4
    v = vz.load(RD)  # [4 a, 16 NG]
    v = v.reshape([4, 2, 8, NG]).permute(3, 2, 0, 1).reshape([NG, 64])  # [gg, kappa = 8 nn + 2 a + b]
    v = gl.convert_layout(v, gl.SliceLayout(0, gl.SliceLayout(1, L4)), assert_trivial=True)[None, None, :, :]
    m8 = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))[:, None, None, None]
    mi = gl.arange(0, 8 // NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))[None, :, None, None]
    v, _ = gl.broadcast(v, m8)
    v, _ = gl.broadcast(v, mi)
    return gl.convert_layout(v.reshape([16, 64]), _OP_A, assert_trivial=True)


@gluon.jit
def _ring_keys(kr_ptr, start, valid, stride_res_t: gl.constexpr):
    """B operand [128 kappa, 32 n] of ring slots start + n (kr_ptr at the row's slot and head; zeros where not
    valid, a [32] mask in slot order), loaded 16 bytes at a time."""
    offs_n = start + gl.arange(0, 32, layout=gl.SliceLayout(1, _RK))
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(0, _RK))
    ok = gl.convert_layout(valid, gl.SliceLayout(1, _RK))
    k = gl.load(kr_ptr + offs_n[:, None] * stride_res_t + offs_c[None, :], mask=ok[:, None] & (offs_c < 128)[None, :],
                other=0.0)
    return gl.convert_layout(_to_kappa(k, 32), _OP_B, assert_trivial=True)


@gluon.jit
def _ring_values(vr_ptr, start, valid, g: gl.constexpr, stride_res_t: gl.constexpr, BITS: gl.constexpr = 2):
    """A operand [32 rho, 32 k] of ring slots start + k for channels 32 g + 4 r + i (rho = 8 i + r; with BITS=4 in
    the packed values' order of kernel_mma_frag4.py), loaded 8 bytes at a time (zeros where not valid)."""
    offs_k = start + gl.arange(0, 32, layout=gl.SliceLayout(1, _RV))
    offs_c = 32 * g + gl.arange(0, 32, layout=gl.SliceLayout(0, _RV))
    ok = gl.convert_layout(valid, gl.SliceLayout(1, _RV))
    v = gl.load(vr_ptr + offs_k[:, None] * stride_res_t + offs_c[None, :], mask=ok[:, None] & (offs_c < 128)[None, :],
                other=0.0)
    if BITS == 2:
        v = v.reshape([32, 8, 4]).permute(2, 1, 0).reshape([32, 32])  # [rho = 8 i + r, k]: channel 4 r + i
    else:  # channel 16 ih + 8 rh + 2 rl + ic -> rho = 16 ih + 8 ic + 4 rh + rl
        v = v.reshape([32, 2, 2, 4, 2]).permute(1, 4, 2, 3, 0).reshape([32, 32])
    return gl.convert_layout(v, _OP_A)
