"""4-bit operands of the tensor-core decode-attention kernel (kernel_mma.py with BITS=4): the same fragments as
kernel_mma_frag.py's 2-bit ones, built from words that hold 8 codes instead of 16. Only @gluon.jit code and layout
constants.

A 4-bit code at bits 4 w .. 4 w + 3 of a half read as an fp16 with a zero exponent is c 16^w 2^-24 (subnormal,
exact) for w = 0, 1 only (bits 10-11 are the exponent), so a half's four codes come from one AND each, codes 2
and 3 after one shift by 8; the factor 16^(w % 2) 2^-24 is undone once per score column or output channel.
    keys    column n = 8 nn + r of the B operand is token 8 r + nn, as for 2 bits: word row r (lane r reads it
            whole), half nn // 4, code nn % 4.
    values  row rho = 8 i + r of chunk g's A operand is channel 32 g + 16 (i // 2) + 8 (r // 4) + 2 (r % 4) + i % 2:
            byte r % 4 of value word 4 g + 2 (i // 2) + r // 4, code i % 2; columns as for 2 bits.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .kernel_mma_frag import _key_operand, _prmt, _value_operand
from .kernel_mma_stage import _RD_KW4

# key words of a channel pair and word row, with the half a code sits in: [64 cp, 8 row, 2 hh]
_KW4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[4, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0], [0, 0, 1]],
    lane_bases=[[1, 0, 0], [2, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=[], block_bases=[],
    shape=[64, 8, 2]))
# merged key halves broadcast over a half's 4 codes: [64 cp, 2 hh, 4 nl, 8 r] (nn = 4 hh + nl), reshaped to
# kernel_mma_frag._KX's [64 cp, 8 nn, 8 r]
_KX4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[4, 0, 0, 0], [8, 0, 0, 0], [16, 0, 0, 0], [32, 0, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0]],
    lane_bases=[[1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]], warp_bases=[],
    block_bases=[], shape=[64, 2, 4, 8]))
# value words of a token pair kp: [2 ih, 2 rh, 4 rl, 32 kp] (word 4 g + 2 ih + rh), broadcast over the 4 lanes rl
_VW4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 4], [0, 0, 0, 8], [0, 0, 0, 16], [1, 0, 0, 0]],
    lane_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0]], warp_bases=[],
    block_bases=[], shape=[2, 2, 4, 32]))
# merged value words broadcast over a byte's 2 codes: [2 ih, 2 ic, 8 r, 32 kp], reshaped to _VX's [4 i, 8 r, 32 kp]
_VX4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0, 0], [0, 0, 0, 4], [0, 0, 0, 8], [0, 0, 0, 16], [1, 0, 0, 0]],
    lane_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]], warp_bases=[],
    block_bases=[], shape=[2, 2, 8, 32]))


@gluon.jit
def _key_codes4(kw):
    """B operand [128 kappa, 64 n] fp16 from a stage's 4-bit key words kw [8 rows, 128]: column n = 8 nn + r is
    token 8 r + nn, half nn // 4 of word row r, code nn % 4."""
    words = kw.load(_RD_KW4)  # [8 row, 128]: channel 32 m2 + 8 a + 2 mm + b
    words = words.reshape([8, 4, 4, 4, 2]).permute(1, 3, 2, 0, 4).reshape([64, 8, 2])  # [cp, row, b]
    w0, w1 = gl.split(words)  # [64 cp, 8 row]: the pair's two channels
    w0 = gl.convert_layout(w0, gl.SliceLayout(2, _KW4), assert_trivial=True)[:, :, None]
    w1 = gl.convert_layout(w1, gl.SliceLayout(2, _KW4), assert_trivial=True)[:, :, None]
    hh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, _KW4)))[None, None, :]
    x = _prmt(w0, w1, gl.where(hh == 0, 0x5410, 0x7632))  # [64, 8 row, 2 hh]: the low or high halves
    x = gl.convert_layout(x.permute(0, 2, 1), gl.SliceLayout(2, _KX4), assert_trivial=True)  # [64, 2 hh, 8 r]
    x = x.to(gl.uint32, bitcast=True)[:, :, None, :]
    nl = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _KX4))))[None, None, :, None]
    x4 = gl.where(nl >= 2, x >> 8, x).to(gl.int32, bitcast=True)  # [64, 2 hh, 4 nl, 8 r]
    mask4, x4 = gl.broadcast(0x000F000F << (4 * (nl % 2)), x4)
    return _key_operand(x4.reshape([64, 8, 8]), mask4.reshape([64, 8, 8]))  # nn = 4 hh + nl


@gluon.jit
def _value_codes4(words):
    """A operand [32 rho, 64 k] fp16 of chunk g's channels (rho = 8 i + r as in the module docstring) from its 4-bit
    value words [4 wq, 64 tokens] (word 4 g + wq, in _RD_VW4); column k = 2 kp + b is token 16 (kp % 4) + 8 b +
    kp // 4."""
    words = words.reshape([2, 2, 4, 2, 8]).permute(0, 1, 4, 2, 3).reshape([2, 2, 32, 2])  # [ih, rh, kp, b]
    w0, w1 = gl.split(words)  # [2 ih, 2 rh, 32 kp]: tokens t and t + 8 of the pair
    w0 = gl.convert_layout(w0, gl.SliceLayout(2, _VW4), assert_trivial=True)[:, :, None, :]
    w1 = gl.convert_layout(w1, gl.SliceLayout(2, _VW4), assert_trivial=True)[:, :, None, :]
    byte = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _VW4))))[None, None, :, None]
    sel = byte | (byte << 4) | ((byte + 4) << 8) | ((byte + 4) << 12)  # byte r % 4 of each word
    x = _prmt(w0, w1, sel)  # [2 ih, 2 rh, 4 rl, 32 kp]
    x = gl.convert_layout(x.reshape([2, 8, 32]), gl.SliceLayout(1, _VX4), assert_trivial=True)[:, None, :, :]
    ic = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, _VX4))))[None, :, None, None]
    mask4, x4 = gl.broadcast(0x000F000F << (4 * ic), x)  # [2 ih, 2 ic, 8 r, 32 kp]
    return _value_operand(x4.reshape([4, 8, 32]), mask4.reshape([4, 8, 32]))  # i = 2 ih + ic
