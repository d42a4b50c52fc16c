"""Version 13 of the Gluon FMA kernel's packed step (kernel_gluon.py, MAGIC=True): codes become fp32 units by
one LOP3 each, with no widening, and the value accumulators stay per lane until the packed loop ends. Only
@gluon.jit code.

Unpacking. A code at bits p, p + 1 of an fp32 whose exponent is 1.0's reads 1 + c 2^(p - 23). A word holds
codes n = 0..15 at bits 2 n; four shifts of it (<< 15, << 7, >> 1, >> 9) bring codes n % 4 = r of each
quarter to bits 15 + 2 r, and one LOP3 per code keeps those two bits and sets the exponent:
    u = 1 + (c / 4) f_r,   f_r = 2^(2 r - 6) = 1/64, 1/16, 1/4, 1   (r = j % 4 for codes j and j + 8)
So a word costs 4 shifts, 16 LOP3 and 16 FFMA, against 8 rotations, 8 LOP3, 16 conversions and 16 FFMA
with fp16 pairs (version 11b): 36 instructions instead of 48. The folded sums of u then carry the codes'
share scaled by f_r, which is undone once per score or output channel: with mult = 4 scale, off = zero -
4 scale and M = sum of the mult weights (q mult for keys, p mult for values),
    sum w (mult (1 + c / 4) + off) = T / f_r + M (1 - 1 / f_r) + sum w off,     T = sum w mult u.
The subtraction costs precision: T holds the codes' share at 2^-6 of its size for r = 0, so fp32 rounding of
T reaches the result scaled by up to 64 (about 1e-4 of a score in log2 units and 4e-5 to 1.5e-4 of an output
against fp32 math on the tests' cases; bf16 and fp16 outputs do not see it).

Values. Each lane keeps its own partial sums over its token group (lanes of dim 0 of the value layout) with
their M and sum p off, rescaled by alpha each step like the accumulator, and _finish_values corrects and sums
them over the 4 token-group lanes once, before the ring, instead of a cross-lane sum per step.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .kernel_gluon_step import _softmax_step


@gluon.jit
def _units(words, j):
    """u (the docstring's) of codes j (lo) and j + 8 (hi) of int32 words, broadcast against j = 0..7: shifts and
    masks are constants per register, so each distinct shift is one SHF per word."""
    w = words.to(gl.uint32, bitcast=True)
    q4 = j >= 4
    r = j % 4
    x_lo = gl.where(q4, w << 7, w << 15).to(gl.int32, bitcast=True)
    x_hi = gl.where(q4, w >> 9, w >> 1).to(gl.int32, bitcast=True)
    mask = (3 << (15 + 2 * r)).to(gl.int32)
    asm: gl.constexpr = "lop3.b32 $0, $1, $2, 0x3F800000, 0xEA;"
    lo = gl.inline_asm_elementwise(asm, "=r,r,r", [x_lo, mask], dtype=gl.float32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(asm, "=r,r,r", [x_hi, mask], dtype=gl.float32, is_pure=True, pack=1)
    return lo, hi


@gluon.jit
def _inv_f(j):
    """1 / f_r for codes j and j + 8: 64, 16, 4, 1 for j % 4 = 0..3."""
    return (1 << (6 - 2 * (j % 4))).to(gl.float32)


@gluon.jit
def _value_raw(words, v_mult, v_off, p, LV: gl.constexpr):
    """One value half (p [NI, 8 j]): raw sums T [NI, 8 w, 8 c] of channels 16 w + c (lo) and 16 w + 8 + c (hi)
    over each thread's tokens, with M = sum p mult and sum p off [NI, 8 w, 1]."""
    p_v = gl.convert_layout(p, gl.SliceLayout(2, gl.SliceLayout(3, LV)))[:, :, None]
    p_mult = (p_v * v_mult)[:, :, :, None]
    m_sum = gl.sum(p_mult, axis=1)
    off_sum = gl.sum((p_v * v_off)[:, :, :, None], axis=1)
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LV))))
    lo, hi = _units(words[:, :, :, None], c[None, None, None, :])
    return gl.sum(lo * p_mult, axis=1), gl.sum(hi * p_mult, axis=1), m_sum, off_sum


@gluon.jit
def _packed_step_magic(q_c, k_words, k_mult, k_off, v0_words, v0_mult, v0_off, v1_words, v1_mult, v1_off, n_valid,
                       m_i, l_i, acc_lo, acc_hi, m_acc, off_acc, LK: gl.constexpr, LV: gl.constexpr):
    """_packed_step (kernel_gluon_step.py) with LOP3 units; acc_lo, acc_hi [NI, 8 w, 8 c], m_acc, off_acc
    [NI, 8 w, 1] are per-lane raw partials (_finish_values)."""
    S2: gl.constexpr = gl.SliceLayout(0, LK)  # [K_WORDS, 8] scores
    K_WORDS: gl.constexpr = LK.threads_per_warp[1]
    # stage 1: key scales folded into the query; M and sum q off per key word
    q_mult = (q_c[:, None] * k_mult)[:, :, None]
    m_k = gl.sum(q_mult, axis=0)  # [K_WORDS, 1]
    bias = gl.sum((q_c[:, None] * k_off)[:, :, None], axis=0)
    # stage 2: raw sums of tokens 16 w + j (lo) and 16 w + 8 + j (hi), corrected per score (log2 domain)
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LK)))
    lo, hi = _units(k_words[:, :, None], j[None, None, :])
    inv_f = _inv_f(gl.arange(0, 8, layout=gl.SliceLayout(0, S2)))[None, :]
    const = m_k * (1.0 - inv_f) + bias
    tok = ((gl.arange(0, K_WORDS, layout=gl.SliceLayout(1, S2)) * 16)[:, None]
           + gl.arange(0, 8, layout=gl.SliceLayout(0, S2))[None, :])
    s_lo = gl.where(tok < n_valid, gl.sum(lo * q_mult, axis=0) * inv_f + const, float("-inf"))
    s_hi = gl.where(tok + 8 < n_valid, gl.sum(hi * q_mult, axis=0) * inv_f + const, float("-inf"))
    # stage 3: online softmax
    m_new, alpha, p_lo, p_hi, l_i = _softmax_step(s_lo, s_hi, m_i, l_i)
    # stage 4: raw value partials of both token halves, per lane
    t0_lo, t0_hi, m0, off0 = _value_raw(v0_words, v0_mult, v0_off, p_lo, LV)
    t1_lo, t1_hi, m1, off1 = _value_raw(v1_words, v1_mult, v1_off, p_hi, LV)
    acc_lo = acc_lo * alpha + (t0_lo + t1_lo)
    acc_hi = acc_hi * alpha + (t0_hi + t1_hi)
    m_acc = m_acc * alpha + (m0 + m1)
    off_acc = off_acc * alpha + (off0 + off1)
    return m_new, l_i, acc_lo, acc_hi, m_acc, off_acc


@gluon.jit
def _lane_partials(LV: gl.constexpr):
    """Zero raw partials for _packed_step_magic: acc_lo, acc_hi [NI, 8, 8] and m_acc, off_acc [NI, 8, 1]."""
    NI: gl.constexpr = LV.size_per_thread[0] * LV.threads_per_warp[0]
    P3: gl.constexpr = gl.SliceLayout(1, LV)
    acc = gl.zeros([NI, 8, 8], gl.float32, layout=P3)
    return acc, acc, gl.zeros([NI, 8, 1], gl.float32, layout=P3), gl.zeros([NI, 8, 1], gl.float32, layout=P3)


@gluon.jit
def _finish_values(acc_lo, acc_hi, m_acc, off_acc, ACC2: gl.constexpr):
    """Output sums [8 w, 8 c] in ACC2 from the raw per-lane partials: T / f + M (1 - 1 / f) + sum p off, summed
    over the token-group lanes."""
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, acc_lo.type.layout)))
    inv_f = _inv_f(c)[None, None, :]
    const = m_acc * (1.0 - inv_f) + off_acc
    lo = gl.sum(acc_lo * inv_f + const, axis=0)
    hi = gl.sum(acc_hi * inv_f + const, axis=0)
    return gl.convert_layout(lo, ACC2), gl.convert_layout(hi, ACC2)
