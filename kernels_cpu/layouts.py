"""GGML block layouts decoded in registers: each quantized type's bytes written once, here, for
qmatmul's decode dots and dequantization and igemm's tile unpacking, on simd.py's vector layer.
Also the one per-type switch of the prefill decoders (_each_block) and the work items over a
fused weight's three parts (_tiles, _tile_at) that qmatmul's and igemm's parallel loops share.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from edgekv import quants as qt
from edgekv.quants import KVALUES_IQ4NL

from .simd import (bits, cat, cvt, h2f, half, half2, lane, ld, ld_bf16, ld_f16, ld_f32, lut16, pack2, shuffler, shuffler2,
                   splat, testbits, vadd, vand, view, vor, vshl, vshr, vsub, word)

# GGML type ids and block bytes from the one table (edgekv/quants.py), as module-level ints: numba
# compiles them in as constants.
F32, F16, BF16 = qt.F32.id, qt.F16.id, qt.BF16.id
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = qt.Q4_0.id, qt.Q4_1.id, qt.Q5_0.id, qt.Q5_1.id, qt.Q8_0.id, qt.IQ4_NL.id
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = qt.Q2_K.id, qt.Q3_K.id, qt.Q4_K.id, qt.Q5_K.id, qt.Q6_K.id, qt.IQ4_XS.id
_NB_Q4_0, _NB_Q4_1, _NB_Q5_0, _NB_Q5_1, _NB_Q8_0, _NB_IQ4_NL = (
    q.block_bytes for q in (qt.Q4_0, qt.Q4_1, qt.Q5_0, qt.Q5_1, qt.Q8_0, qt.IQ4_NL))
_NB_Q2_K, _NB_Q3_K, _NB_Q4_K, _NB_Q5_K, _NB_Q6_K, _NB_IQ4_XS = (
    q.block_bytes for q in (qt.Q2_K, qt.Q3_K, qt.Q4_K, qt.Q5_K, qt.Q6_K, qt.IQ4_XS))

f32, i32 = np.float32, np.int32


# ---------------------------------------------------------------------------------------------
# Block decoders: each type's layout is written once, here, and shared by the integer dot (decode)
# and the float dequantization (prefill, get_rows). Quants come out as unsigned bytes (uint8 x 32,
# elements in GGML order) so that they multiply int8 activations directly (pmaddubsw, vpdpbusd);
# a constant offset per type restores the signed value.
#   32-element types: the block at byte o -> (q, off, d, m) with w = d * (q - off) + m.
#   K types (256-element super-blocks): see below.
# ---------------------------------------------------------------------------------------------
@njit(inline="always")
def _nibbles(v):
    """uint8 x 16 -> uint8 x 32: low nibbles (elements 0-15), then high nibbles (16-31). The
    bytes are repeated in both halves (a broadcast load) and the upper half shifted by 4 (a
    per-lane shift of 32-bit lanes): no cross-lane shuffle."""
    shifts = cat(splat(np.uint32(0), 4), splat(np.uint32(4), 4))
    return vand(view(vshr(view(cat(v, v), np.uint32), shifts), np.uint8), 15)


# Q4_0: 32 elements per 18-byte block (d:f16, qs:16); e<16: qs[e]&15, e>=16: qs[e-16]>>4;
#   w = d * (q - 8).
@njit(inline="always")
def _block_q4_0(row, o):
    return _nibbles(ld(row, o + 2, 16)), 8, half(row, o), f32(0)


# Q4_1: 32 elements per 20-byte block (d:f16, m:f16, qs:16 as Q4_0); w = d * q + m.
@njit(inline="always")
def _block_q4_1(row, o):
    d, m = half2(row, o)
    return _nibbles(ld(row, o + 4, 16)), 0, d, m


# Q5_0: 32 elements per 22-byte block (d:f16, qh:4 little-endian, bit e = bit 4 of element e,
#   qs:16 as Q4_0); w = d * (q - 16).
@njit(inline="always")
def _block_q5_0(row, o):
    return vor(_nibbles(ld(row, o + 6, 16)), vshl(bits(row, o + 2, 32), 4)), 16, half(row, o), f32(0)


# Q5_1: 32 elements per 24-byte block (d:f16, m:f16, qh:4, qs:16 as Q5_0); w = d * q + m.
@njit(inline="always")
def _block_q5_1(row, o):
    d, m = half2(row, o)
    return vor(_nibbles(ld(row, o + 8, 16)), vshl(bits(row, o + 4, 32), 4)), 0, d, m


# Q8_0: 32 elements per 34-byte block (d:f16, qs:32 int8); w = d * q (here q + 128 - 128).
@njit(inline="always")
def _block_q8_0(row, o):
    return vadd(ld(row, o + 2, 32), 128), 128, half(row, o), f32(0)


# IQ4_NL: 32 elements per 18-byte block (d:f16, qs:16 nibbles as Q4_0), each an index into the
#   non-linear table KVALUES_IQ4NL; w = d * KVALUES[q]. The table is looked up (pshufb) plus 128,
#   so that the quants stay unsigned bytes as Q8_0's: off = 128.
_IQ4 = lut16(*(v + 128 for v in KVALUES_IQ4NL))


@njit(inline="always")
def _block_iq4_nl(row, o):
    return _IQ4(_nibbles(ld(row, o + 2, 16))), 128, half(row, o), f32(0)


# Four 32-element blocks at once (decode): quad(w, o) -> (lo, hi, d, m) for the blocks at byte o:
#   lo, hi: uint8 x 64, lane 16j + i = element i (lo) or 16 + i (hi) of block j (a layout the
#   activations are permuted to per call, _quad_acts): one 512-bit product each;
#   d, m: float32 x 16, lane 4j + l = block j's scale (and min). The bytes come from two or three
#   overlapping 64-byte loads and one two-source byte shuffle (vpermt2b), not four 16-byte loads
#   and inserts per vector; the scales from the same loads (a word shuffle), not 4 scalar loads.
def _src(byte, second):
    """Lane index into (a, b) of byte `byte` of the group: a holds bytes 0-63, b from `second`."""
    assert byte < 64 or 0 <= byte - second < 64, (byte, second)
    return byte if byte < 64 else 64 + byte - second


def _qs_mask(nbytes, qs, second, half=0):
    return [_src(j * nbytes + qs + 16 * half + i, second) for j in range(4) for i in range(16)]


def _word_mask(nbytes, field, second):
    """(a, b) uint16 lanes of block j's float16 at byte `field`, each repeated 4 times."""
    return [_src(j * nbytes + field + 1, second) // 2 for j in range(4) for _ in range(4)]


@njit(inline="always")
def _split(v):
    """uint8 x 64 -> (low nibbles, high nibbles)."""
    return vand(v, 15), vand(view(vshr(view(v, np.uint16), 4), np.uint8), 15)


@njit(inline="always")
def _words(shuffle, a, b):
    return h2f(shuffle(view(a, np.uint16), view(b, np.uint16)))


_Q4_0_QS, _Q4_0_D = shuffler2(*_qs_mask(18, 2, 8)), shuffler2(*_word_mask(18, 0, 8))


@njit(inline="always")
def _quad_q4_0(row, o):
    a, b = ld(row, o, 64), ld(row, o + 8, 64)
    lo, hi = _split(_Q4_0_QS(a, b))
    return lo, hi, _words(_Q4_0_D, a, b), splat(f32(0), 16)


@njit(inline="always")
def _quad_iq4_nl(row, o):
    a, b = ld(row, o, 64), ld(row, o + 8, 64)
    lo, hi = _split(_Q4_0_QS(a, b))
    return _IQ4(lo), _IQ4(hi), _words(_Q4_0_D, a, b), splat(f32(0), 16)


_Q4_1_QS, _Q4_1_D, _Q4_1_M = shuffler2(*_qs_mask(20, 4, 16)), shuffler2(*_word_mask(20, 0, 16)), shuffler2(
    *_word_mask(20, 2, 16))


@njit(inline="always")
def _quad_q4_1(row, o):
    a, b = ld(row, o, 64), ld(row, o + 16, 64)
    lo, hi = _split(_Q4_1_QS(a, b))
    return lo, hi, _words(_Q4_1_D, a, b), _words(_Q4_1_M, a, b)


def _qh_mask(nbytes, qh, second):
    """(a, b) lanes of the qh byte holding bit 4 of element i (lo) / 16 + i (hi) of block j."""
    return [[_src(j * nbytes + qh + 2 * half + (i >> 3), second) for j in range(4) for i in range(16)]
            for half in (0, 1)]


_BIT = testbits(*[1 << (i & 7) for i in range(64)])


@njit(inline="always")
def _nibbles_bit4(qs, hl, hh):
    """The quads' (lo, hi) from 64 bytes of nibbles and the qh bytes spread per lane (Q5_0, Q5_1)."""
    lo, hi = _split(qs)
    return vor(lo, vshl(_BIT(hl), 4)), vor(hi, vshl(_BIT(hh), 4))


_Q5_0_QS, _Q5_0_D = shuffler2(*_qs_mask(22, 6, 24)), shuffler2(*_word_mask(22, 0, 24))
_Q5_0_HL, _Q5_0_HH = (shuffler2(*m) for m in _qh_mask(22, 2, 24))


@njit(inline="always")
def _quad_q5_0(row, o):
    a, b = ld(row, o, 64), ld(row, o + 24, 64)
    lo, hi = _nibbles_bit4(_Q5_0_QS(a, b), _Q5_0_HL(a, b), _Q5_0_HH(a, b))
    return lo, hi, _words(_Q5_0_D, a, b), splat(f32(0), 16)


_Q5_1_QS, _Q5_1_D, _Q5_1_M = shuffler2(*_qs_mask(24, 8, 32)), shuffler2(*_word_mask(24, 0, 32)), shuffler2(
    *_word_mask(24, 2, 32))
_Q5_1_HL, _Q5_1_HH = (shuffler2(*m) for m in _qh_mask(24, 4, 32))


@njit(inline="always")
def _quad_q5_1(row, o):
    a, b = ld(row, o, 64), ld(row, o + 32, 64)
    lo, hi = _nibbles_bit4(_Q5_1_QS(a, b), _Q5_1_HL(a, b), _Q5_1_HH(a, b))
    return lo, hi, _words(_Q5_1_D, a, b), _words(_Q5_1_M, a, b)


# Q8_0's group is 136 bytes: a (0-63), b (64-127), c (72-135); block 3's high half comes from c.
_Q8_0_LO = shuffler2(*_qs_mask(34, 2, 64))
_Q8_0_HI = shuffler2(*[_src(18 + 34 * j + i, 64) if j < 3 else 0 for j in range(4) for i in range(16)])
_Q8_0_HI3 = shuffler2(*[16 * j + i if j < 3 else 64 + 120 + i - 72 for j in range(4) for i in range(16)])
_Q8_0_D = shuffler2(*_word_mask(34, 0, 64))


@njit(inline="always")
def _quad_q8_0(row, o):
    a, b, c = ld(row, o, 64), ld(row, o + 64, 64), ld(row, o + 72, 64)
    lo, hi = vadd(_Q8_0_LO(a, b), 128), vadd(_Q8_0_HI3(_Q8_0_HI(a, b), c), 128)
    return lo, hi, _words(_Q8_0_D, a, b), splat(f32(0), 16)


# K types as 16 sub-blocks of 16 (a type with sub-blocks of 32 repeats each value twice):
#   scales(w, o) -> (d, dmin, sc: int16 x 16, m: int32 x 16) of the super-block at byte o;
#   quants(w, o, c) -> uint8 x 32, chunk c (elements 32c..32c+31, sub-blocks 2c and 2c+1);
#   w = d * sc * (q - off) - dmin * m.
_DUP8 = shuffler(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)  # 8 values -> 16 lanes


# Q2_K: 256 elements per 84-byte super-block (scales:16, one byte per sub-block = sc | m << 4;
#   qs:64; d:f16; dmin:f16).
#   chunk c = 4h + s: q = (qs[32h + l] >> 2s) & 3.
_OFF_Q2_K = 0


@njit(inline="always")
def _scales_q2_k(row, o):
    b = ld(row, o, 16)
    return half(row, o + 80), half(row, o + 82), cvt(vand(b, 15), np.int16), cvt(vshr(b, 4), np.int32)


@njit(inline="always")
def _quants_q2_k(row, o, c):
    return vand(vshr(ld(row, o + 16 + 32 * (c >> 2), 32), 2 * (c & 3)), 3)


# Q3_K: 256 elements per 110-byte super-block (hmask:32, qs:64, scales:12, d:f16).
#   chunk c = 4h + s: q = ((qs[32h + l] >> 2s) & 3) | ((hmask[l] >> c) & 1) << 2; w = d * sc * (q - 4).
#   16 signed 6-bit scales: low4 = scales[j] & 15 (j < 8) or scales[j-8] >> 4;
#   high2 = (scales[8 + j%4] >> 2(j//4)) & 3; sc = (low4 | high2 << 4) - 32.
_OFF_Q3_K = 4


@njit(inline="always")
def _scales_q3_k(row, o):
    lo8 = ld(row, o + 96, 8)
    low = cat(vand(lo8, 15), vshr(lo8, 4))
    h4 = ld(row, o + 104, 4)  # replicated 4 times; group g shifted by 2g
    u32 = np.uint32
    shifts = cat(cat(splat(u32(0), 1), splat(u32(2), 1)), cat(splat(u32(4), 1), splat(u32(6), 1)))
    high = vand(view(vshr(view(cat(cat(h4, h4), cat(h4, h4)), np.uint32), shifts), np.uint8), 3)
    sc = vsub(cvt(vor(low, vshl(high, 4)), np.int16), 32)
    return half(row, o + 108), f32(0), sc, splat(i32(0), 16)


@njit(inline="always")
def _quants_q3_k(row, o, c):
    low = vand(vshr(ld(row, o + 32 + 32 * (c >> 2), 32), 2 * (c & 3)), 3)
    high = vand(vshr(ld(row, o, 32), c), 1)
    return vor(low, vshl(high, 2))


# Q4_K and Q5_K: (d:f16, dmin:f16, scales:12, ...) with a 6-bit scale and min per sub-block j
#   of 32, s = the 12 bytes: j < 4: sc = s[j] & 63, m = s[j+4] & 63;
#   j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4, m = (s[j+4] >> 4) | (s[j] >> 6) << 4.
_K4_A = shuffler(0, 1, 2, 3, 8, 9, 10, 11)  # s[j] (j < 4), s[j+4] (j >= 4)
_K4_B = shuffler(4, 5, 6, 7, 0, 1, 2, 3)  # s[j+4] (j < 4), s[j-4] (j >= 4)
_K4_C = shuffler(4, 5, 6, 7, 8, 9, 10, 11)  # s[j+4]
_K4_D = shuffler(0, 1, 2, 3, 4, 5, 6, 7)  # s[j]


@njit(inline="always")
def _scales_k4(row, o):
    s = ld(row, o + 4, 16)  # the 12 bytes (and 4 of what follows)
    first = cat(splat(np.uint8(255), 4), splat(np.uint8(0), 4))  # lanes j < 4
    last = cat(splat(np.uint8(0), 4), splat(np.uint8(255), 4))
    a, hi_b, c, hi_d = _K4_A(s), vshl(vshr(_K4_B(s), 6), 4), _K4_C(s), vshl(vshr(_K4_D(s), 6), 4)
    sc = vor(vand(a, vor(vand(first, 63), vand(last, 15))), vand(hi_b, last))
    mn = vor(vand(c, vand(first, 63)), vand(vor(vshr(c, 4), hi_d), last))
    return half(row, o), half(row, o + 2), _DUP8(cvt(sc, np.int16)), _DUP8(cvt(mn, np.int32))


_MINS8 = shuffler(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)


@njit(inline="always")
def _scales_k4_dot(row, o):
    """_scales_k4 for decode: the 6-bit fields unpacked in general-purpose registers, 4 at a time
    (as llama.cpp's utmp), which leaves the vector ports to the products; sc one lane per
    sub-block of 32 (lanes 8-15: the mins), mins as int16."""
    s0, s1, s2 = word(row, o + 4), word(row, o + 8), word(row, o + 12)
    sc = (s0 & 0x3F3F3F3F) | (((s2 & 0x0F0F0F0F) | (((s0 >> 6) & 0x03030303) << 4)) << 32)
    mn = (s1 & 0x3F3F3F3F) | ((((s2 >> 4) & 0x0F0F0F0F) | (((s1 >> 6) & 0x03030303) << 4)) << 32)
    v = cvt(view(pack2(sc, mn), np.uint8), np.int16)  # 8 scales (one per 32: _k_pass's nib), 8 mins
    return half(row, o), half(row, o + 2), v, _MINS8(v)


# Q4_K: 256 elements per 144-byte super-block (d:f16, dmin:f16, scales:12, qs:128).
#   chunk c = 2i + s: q = (qs[32i + l] >> 4s) & 15.
_OFF_Q4_K = 0


@njit(inline="always")
def _quants_q4_k(row, o, c):
    return vand(vshr(ld(row, o + 16 + 32 * (c >> 1), 32), 4 * (c & 1)), 15)


# Q5_K: 256 elements per 176-byte super-block (d:f16, dmin:f16, scales:12, qh:32, qs:128).
#   chunk c as Q4_K, plus bit 4 = (qh[l] >> c) & 1.
_OFF_Q5_K = 0


@njit(inline="always")
def _quants_q5_k(row, o, c):
    low = vand(vshr(ld(row, o + 48 + 32 * (c >> 1), 32), 4 * (c & 1)), 15)
    return vor(low, vshl(vand(vshr(ld(row, o + 16, 32), c), 1), 4))


# Q6_K: 256 elements per 210-byte super-block (ql:128, qh:64, scales:16 int8, d:f16).
#   chunk c = 4h + t: q = (ql[64h + 32(t&1) + l] >> 4(t>>1)) & 15 | ((qh[32h + l] >> 2t) & 3) << 4;
#   w = d * sc * (q - 32).
_OFF_Q6_K = 32


@njit(inline="always")
def _scales_q6_k(row, o):
    sc = cvt(cvt(ld(row, o + 192, 16), np.int8), np.int16)
    return half(row, o + 208), f32(0), sc, splat(i32(0), 16)


@njit(inline="always")
def _quants_q6_k(row, o, c):
    h, t = c >> 2, c & 3
    low = vand(vshr(ld(row, o + 64 * h + 32 * (t & 1), 32), 4 * (t >> 1)), 15)
    high = vand(vshr(ld(row, o + 128 + 32 * h, 32), 2 * t), 3)
    return vor(low, vshl(high, 4))


# IQ4_XS: 256 elements per 136-byte super-block (d:f16, scales_h:u16, scales_l:4, qs:128); sub-
#   block j of 32 (chunk c = j): ls = (scales_l[j/2] >> 4(j%2)) & 15 | ((scales_h >> 2j) & 3) << 4,
#   quants qs[16j:16j+16] as IQ4_NL's (plus 128); w = d * (ls - 32) * KVALUES[q].
_OFF_IQ4_XS = 128
_SPREAD_L = shuffler(0, 0, 1, 1, 2, 2, 3, 3)  # scales_l byte of sub-block j
_SPREAD_H = shuffler(0, 0, 0, 0, 1, 1, 1, 1)  # scales_h byte of sub-block j


@njit(inline="always")
def _scales_iq4_xs(row, o):
    u8 = np.uint8
    s2 = cat(splat(u8(0), 1), splat(u8(4), 1))
    s4 = cat(cat(splat(u8(0), 1), splat(u8(2), 1)), cat(splat(u8(4), 1), splat(u8(6), 1)))
    low = vand(vshr(_SPREAD_L(ld(row, o + 4, 4)), cat(cat(s2, s2), cat(s2, s2))), 15)
    high = vand(vshr(_SPREAD_H(ld(row, o + 2, 2)), cat(s4, s4)), 3)
    sc = vsub(cvt(vor(low, vshl(high, 4)), np.int16), 32)
    return half(row, o), f32(0), _DUP8(sc), splat(i32(0), 16)


@njit(inline="always")
def _quants_iq4_xs(row, o, c):
    return _IQ4(_nibbles(ld(row, o + 8 + 16 * c, 16)))


@njit(inline="always")
def _half_iq4_xs(row, o, h):
    """(lo, hi) of sub-blocks 4h..4h+3 in the quad layout: their 64 bytes of nibbles, one load."""
    lo, hi = _split(ld(row, o + 8 + 64 * h, 64))
    return _IQ4(lo), _IQ4(hi)


# Pairs of K-type chunks (decode): pair(w, o, i) -> uint8 x 64, elements 64i..64i+63 of the
# super-block at o (chunks 2i and 2i+1), one 512-bit vector: the 32 bytes the two chunks share
# loaded once into both halves, each half shifted by its own count (shifts of 64-bit lanes: the
# bits shifted in from the next byte are masked off).
@njit(inline="always")
def _both(v, s0, s1):
    u64 = np.uint64
    return view(vshr(view(cat(v, v), u64), cat(splat(u64(s0), 4), splat(u64(s1), 4))), np.uint8)


@njit(inline="always")
def _pair_q2_k(row, o, i):
    s = 4 * (i & 1)
    return vand(_both(ld(row, o + 16 + 32 * (i >> 1), 32), s, s + 2), 3)


@njit(inline="always")
def _pair_q3_k(row, o, i):
    s = 4 * (i & 1)
    low = vand(_both(ld(row, o + 32 + 32 * (i >> 1), 32), s, s + 2), 3)
    return vor(low, vshl(vand(_both(ld(row, o, 32), 2 * i, 2 * i + 1), 1), 2))


# Q4_K, Q5_K: half h of the super-block as (lo, hi) = chunks (4h, 4h+2) and (4h+1, 4h+3), the
# low and high nibbles of one 64-byte load; the activations are permuted to match (_acts_k4).
@njit(inline="always")
def _quad_q4_k(row, o, h):
    return _split(ld(row, o + 16 + 64 * h, 64))


@njit(inline="always")
def _quad_q5_k(row, o, h):
    lo, hi = _split(ld(row, o + 48 + 64 * h, 64))
    qh = ld(row, o + 16, 32)
    lo = vor(lo, vshl(vand(_both(qh, 4 * h, 4 * h + 2), 1), 4))
    return lo, vor(hi, vshl(vand(_both(qh, 4 * h + 1, 4 * h + 3), 1), 4))


@njit(inline="always")
def _pair_q6_k(row, o, i):
    # chunks 4h + 2u and 4h + 2u + 1 (h = i // 2, u = i % 2): ql[64h:64h+64] >> 4u, one load
    u = i & 1
    low = vand(view(vshr(view(ld(row, o + 64 * (i >> 1), 64), np.uint16), 4 * u), np.uint8), 15)
    return vor(low, vshl(vand(_both(ld(row, o + 128 + 32 * (i >> 1), 32), 4 * u, 4 * u + 2), 3), 4))


# F32 / F16 / BF16: rows of 4 / 2 / 2-byte little-endian floats; element i of the row at byte ro
# as float32 x n.
@njit(inline="always")
def _load_f32(row, ro, i, n):
    return ld_f32(row, ro + 4 * i, n)


@njit(inline="always")
def _load_f16(row, ro, i, n):
    return ld_f16(row, ro + 2 * i, n)


@njit(inline="always")
def _load_bf16(row, ro, i, n):
    return ld_bf16(row, ro + 2 * i, n)


# ---------------------------------------------------------------------------------------------
# The prefill decoders of each quantized type, one switch (the decode dots pair other decoders
# with each type: qmatmul._dot_rows).
# ---------------------------------------------------------------------------------------------
@njit(inline="always")
def _each_block(qtype, on_32, on_k, a):
    """on_32(a, block, nbytes) for a 32-element type, on_k(a, scales, quants, nbytes, off, sb)
    for a 256-element one (sb: its sub-block of one scale, 16 or 32); a: the caller's arguments."""
    if qtype == Q4_0:
        on_32(a, _block_q4_0, _NB_Q4_0)
    elif qtype == Q4_1:
        on_32(a, _block_q4_1, _NB_Q4_1)
    elif qtype == Q5_0:
        on_32(a, _block_q5_0, _NB_Q5_0)
    elif qtype == Q5_1:
        on_32(a, _block_q5_1, _NB_Q5_1)
    elif qtype == Q8_0:
        on_32(a, _block_q8_0, _NB_Q8_0)
    elif qtype == IQ4_NL:
        on_32(a, _block_iq4_nl, _NB_IQ4_NL)
    elif qtype == Q2_K:
        on_k(a, _scales_q2_k, _quants_q2_k, _NB_Q2_K, _OFF_Q2_K, 16)
    elif qtype == Q3_K:
        on_k(a, _scales_q3_k, _quants_q3_k, _NB_Q3_K, _OFF_Q3_K, 16)
    elif qtype == Q4_K:
        on_k(a, _scales_k4, _quants_q4_k, _NB_Q4_K, _OFF_Q4_K, 32)
    elif qtype == Q5_K:
        on_k(a, _scales_k4, _quants_q5_k, _NB_Q5_K, _OFF_Q5_K, 32)
    elif qtype == Q6_K:
        on_k(a, _scales_q6_k, _quants_q6_k, _NB_Q6_K, _OFF_Q6_K, 16)
    else:  # IQ4_XS
        on_k(a, _scales_iq4_xs, _quants_iq4_xs, _NB_IQ4_XS, _OFF_IQ4_XS, 32)


# ---------------------------------------------------------------------------------------------
# Q4_0, Q4_1 and Q8_0 (and Q4_K: below) repacked at load for the decode dots (not GGUF types;
# qmatmul.pack makes them): 16 rows side by side, so that one vpdpbusd of 16 int32 lanes is 16 rows times 4
# broadcast activations and a lane sums a whole block of its row (igemm's tile layout, kept
# packed). Per group of 16 rows (16 x the row's bytes, contiguous) and pair of blocks (a unit,
# whole 64-byte lines): the float16 scales of the two blocks (row r at 2 r, then 32 + 2 r), their
# mins the same way (Q4_1), then block 2u's quants, 16 x qb bytes (bytes 4s .. 4s+3 of row r's qb
# at 64 s + 4 r), then block 2u+1's. The scale line first, as the loops read it (one token of
# Q4_0X16 / Q8_0X16 streams 1-15% nearer a plain read than with it last, bench/RESULTS.md). The
# same bytes as the GGUF rows, moved.
# ---------------------------------------------------------------------------------------------
X16 = 1000  # + the GGUF type id
Q4_0X16, Q4_1X16, Q8_0X16, Q4_KX16, Q6_KX16 = X16 + Q4_0, X16 + Q4_1, X16 + Q8_0, X16 + Q4_K, X16 + Q6_K


@njit(inline="always")
def x16_geometry(qtype):
    """(bytes of quants per row and block, bytes per unit, has a min, the GGUF block's bytes and
    its quants' offset in it) of an X16 layout (or of its GGUF type)."""
    t = qtype - X16 if qtype > X16 else qtype
    if t == Q4_1:
        return 16, 640, True, _NB_Q4_1, 4
    if t == Q8_0:
        return 32, 1088, False, _NB_Q8_0, 2
    return 16, 576, False, _NB_Q4_0, 2


@njit(inline="always")
def x16_at(o, h, qb, has_min):
    """(the scales' byte, the quants' byte) of block h (0 or 1) of the X16 unit at byte o; the
    mins (has_min) at the scales' + 64."""
    return o + 32 * h, o + (128 if has_min else 64) + 16 * qb * h


def x16_fits(qtype: int, m: int, row_bytes: int) -> bool:
    """Whether a matrix of m rows can take its type's X16 layout: whole groups and block pairs
    (Q4_K, Q6_K: whole groups; a super-block is a unit)."""
    if qtype == Q4_K or qtype == Q6_K:
        return m % 16 == 0 and row_bytes % qt.QUANT_TYPES[qtype].block_bytes == 0
    return qtype in (Q4_0, Q4_1, Q8_0) and m % 16 == 0 and row_bytes % (2 * qt.QUANT_TYPES[qtype].block_bytes) == 0


@njit(cache=True, parallel=True)
def repack_x16(src, dst, qtype):
    """dst (m, row_bytes) = the rows of src (GGUF type qtype) in its X16 layout (x16_fits holds)."""
    m, rb = src.shape
    qb, unit, has_min, nbytes, qo = x16_geometry(qtype)
    nb = rb // nbytes
    s, d = src.reshape(-1), dst.reshape(-1)
    for g in prange(m // 16):
        base = g * 16 * rb
        for r in range(16):
            ro = (16 * g + r) * rb
            for b in range(nb):
                o = ro + nbytes * b
                sc, q = x16_at(base + unit * (b // 2), b % 2, qb, has_min)
                sc, q = sc + 2 * r, q + 4 * r
                for j in range(qb):
                    d[q + 64 * (j // 4) + j % 4] = s[o + qo + j]
                d[sc], d[sc + 1] = s[o], s[o + 1]
                if has_min:
                    d[sc + 64], d[sc + 65] = s[o + 2], s[o + 3]


@njit(fastmath=True, inline="always")
def x16_block(w, qtype, rb, row, b):
    """Row `row`'s block b of an X16 weight w (flat) as the GGUF type's block decoder gives it:
    (q, off, d, m)."""
    qb, unit, has_min, nbytes, qo = x16_geometry(qtype)
    sc, q = x16_at((row // 16) * 16 * rb + unit * (b // 2), b % 2, qb, has_min)
    sc, q = sc + 2 * (row % 16), q + 4 * (row % 16)
    v = cat(cat(ld(w, q, 4), ld(w, q + 64, 4)), cat(ld(w, q + 128, 4), ld(w, q + 192, 4)))
    if qb == 32:  # Q8_0
        v2 = cat(cat(ld(w, q + 256, 4), ld(w, q + 320, 4)), cat(ld(w, q + 384, 4), ld(w, q + 448, 4)))
        return vadd(cat(v, v2), 128), 128, half(w, sc), f32(0)
    if has_min:
        return _nibbles(v), 0, half(w, sc), half(w, sc + 64)
    return _nibbles(v), 8, half(w, sc), f32(0)


# Q4_K repacked (Q4_KX16): per group of 16 rows and super-block (a unit of 2304 bytes = 16 x 144,
# 36 whole lines, read in order; the group's units one after another):
#   d of row r (float16) at 2 r, dmin at 32 + 2 r;
#   the 6-bit scale sc and min m of sub-block j (of 32) of row r, split in 4 and 2 bits:
#     at 64 + 64 (j // 4) + 16 (j % 4) + r: sc & 15 | (m & 15) << 4,
#     at 192 + 16 (j % 4) + r (j < 4): sc_j >> 4 | sc_j+4 >> 4 << 2 | m_j >> 4 << 4 | m_j+4 >> 4 << 6;
#   quants: chunk i (qs[32i .. 32i+31]: elements 64i + l low nibbles, 64i + 32 + l high) at
#     256 + 512 i, bytes 4s .. 4s+3 of row r at + 64 s + 4 r (one 64-byte load: 16 rows x 4 elements).
#   The same number of bytes as the GGUF rows: a unit's scales are 16 x 12 bytes as well.
_K4U = 2304  # bytes per unit
_K4D, _K4L, _K4H, _K4Q = 0, 64, 192, 256  # d (then dmin at + 32), low bits, high bits, quants


@njit(cache=True, parallel=True)
def repack_x16_k4(src, dst):
    """dst (m, row_bytes) = the Q4_K rows of src in the Q4_KX16 layout (x16_fits holds)."""
    m, rb = src.shape
    nb = rb // _NB_Q4_K
    s, d = src.reshape(-1), dst.reshape(-1)
    for g in prange(m // 16):
        for r in range(16):
            ro = (16 * g + r) * rb
            for b in range(nb):
                o = ro + _NB_Q4_K * b
                u = g * 16 * rb + _K4U * b
                for j in range(128):
                    d[u + _K4Q + 512 * (j // 32) + 64 * (j % 32 // 4) + 4 * r + j % 4] = s[o + 16 + j]
                d[u + _K4D + 2 * r], d[u + _K4D + 2 * r + 1] = s[o], s[o + 1]
                d[u + _K4D + 32 + 2 * r], d[u + _K4D + 33 + 2 * r] = s[o + 2], s[o + 3]
                _, _, scs, mns = _scales_k4(s, o)  # the GGUF bytes' decoder: sub-block j at lane 2j
                for j in range(4):
                    sc, mn = i32(lane(scs, 2 * j)), i32(lane(mns, 2 * j))
                    sc4, mn4 = i32(lane(scs, 2 * j + 8)), i32(lane(mns, 2 * j + 8))
                    d[u + _K4L + 16 * j + r] = (sc & 15) | ((mn & 15) << 4)
                    d[u + _K4L + 64 + 16 * j + r] = (sc4 & 15) | ((mn4 & 15) << 4)
                    d[u + _K4H + 16 * j + r] = (sc >> 4) | ((sc4 >> 4) << 2) | ((mn >> 4) << 4) | ((mn4 >> 4) << 6)


@njit(inline="always")
def k4x16_scales(w, u):
    """The 6-bit scales and mins of the Q4_KX16 unit at byte u: (sc of sub-blocks 0-3, of 4-7,
    m of 0-3, of 4-7), each uint8 x 64 with sub-block j's 16 rows at lanes 16 (j % 4) .. + 15."""
    u32 = np.uint32
    l0, l1, h = view(ld(w, u + _K4L, 64), u32), view(ld(w, u + _K4L + 64, 64), u32), view(ld(w, u + _K4H, 64), u32)
    lo4 = u32(0x0F0F0F0F)
    hi2 = u32(0x30303030)
    sc03 = vor(vand(l0, lo4), vshl(vand(h, u32(0x03030303)), 4))
    sc47 = vor(vand(l1, lo4), vand(vshl(h, 2), hi2))
    m03 = vor(vand(vshr(l0, 4), lo4), vand(h, hi2))
    m47 = vor(vand(vshr(l1, 4), lo4), vand(vshr(h, 2), hi2))
    return view(sc03, np.uint8), view(sc47, np.uint8), view(m03, np.uint8), view(m47, np.uint8)


@njit(inline="always")
def k4x16_block(w, rb, row, b):
    """Row `row`'s sub-block b (of 32) of a Q4_KX16 weight w (flat): (q uint8 x 32, d, dmin, sc,
    m), w = d * sc * q - dmin * m."""
    j = b % 8
    u = (row // 16) * 16 * rb + _K4U * (b // 8)
    r = row % 16
    q = u + _K4Q + 512 * (j // 2) + 4 * r
    v = cat(cat(cat(ld(w, q, 4), ld(w, q + 64, 4)), cat(ld(w, q + 128, 4), ld(w, q + 192, 4))),
            cat(cat(ld(w, q + 256, 4), ld(w, q + 320, 4)), cat(ld(w, q + 384, 4), ld(w, q + 448, 4))))
    if j % 2:
        v = view(vshr(view(v, np.uint32), 4), np.uint8)
    sc, m = k4x16_field(w, u, r, j)
    return vand(v, 15), half(w, u + _K4D + 2 * r), half(w, u + _K4D + 32 + 2 * r), sc, m


@njit(inline="always")
def k4x16_field(w, u, r, j):
    """(sc, m) of row r's sub-block j in the Q4_KX16 unit at byte u (one row: k4x16_scales)."""
    lo, h = i32(w[u + _K4L + 64 * (j // 4) + 16 * (j % 4) + r]), i32(w[u + _K4H + 16 * (j % 4) + r])
    sh = i32(2 * (j // 4))
    return (lo & 15) | (((h >> sh) & 3) << 4), (lo >> 4) | (((h >> (sh + 4)) & 3) << 4)


# Q6_K repacked (Q6_KX16): per group of 16 rows and super-block a unit of 3360 bytes (16 x 210;
# units start on 32-byte boundaries, AVX2's loads never split a line), read in order:
#   d of row r (float16) at 2 r;
#   the int8 scale of sub-block j (of 16) of row r at 32 + 16 j + _K6ROW[r] (rows 0-3, 8-11, 4-7,
#     12-15: one sign extension and two unpacks put each row's scale in both int16 lanes of its
#     int32 lane, pmaddwd's operand);
#   the 6-bit quants q0 .. q3 of elements 128 h + 32 i + l (i = 0..3; GGUF's ql, qh bytes for l
#     in half h) in three bytes: a = q0 | (q3 & 3) << 6, b = q1 | (q3 >> 2 & 3) << 6,
#     c = q2 | (q3 >> 4) << 6 (q0 .. q2: one AND each, q3: three), at 288 + 768 (2 h + s // 4) +
#     64 (s % 4) + 4 r + l % 4 for a (b at + 256, c at + 512), s = l // 4: each 768-byte piece
#     holds 4 sub-blocks of the 16 rows (4 lines of a, b, c; 16 rows x 4 elements a line).
#   The same number of bytes as the GGUF rows; the GGUF bytes come back exactly (_quants_k6x16).
_K6U = 3360  # bytes per unit
_K6S, _K6P = 32, 288  # scales, pieces (d at 0)
_K6ROW = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)  # row r's byte in a scale line


@njit(cache=True, parallel=True)
def repack_x16_k6(src, dst):
    """dst (m, row_bytes) = the Q6_K rows of src in the Q6_KX16 layout (x16_fits holds)."""
    m, rb = src.shape
    nb = rb // _NB_Q6_K
    s, d = src.reshape(-1), dst.reshape(-1)
    for g in prange(m // 16):
        for r in range(16):
            ro = (16 * g + r) * rb
            for b in range(nb):
                o = ro + _NB_Q6_K * b
                u = g * 16 * rb + _K6U * b
                for h in range(2):
                    for l in range(32):
                        lo, hi, qh = i32(s[o + 64 * h + l]), i32(s[o + 64 * h + 32 + l]), i32(s[o + 128 + 32 * h + l])
                        q0, q1 = (lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4)
                        q2, q3 = (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | ((qh >> 6) << 4)
                        q = u + _K6P + 768 * (2 * h + l // 16) + 64 * (l // 4 % 4) + 4 * r + l % 4
                        d[q] = q0 | ((q3 & 3) << 6)
                        d[q + 256] = q1 | (((q3 >> 2) & 3) << 6)
                        d[q + 512] = q2 | ((q3 >> 4) << 6)
                for j in range(16):
                    d[u + _K6S + 16 * j + _K6ROW[r]] = s[o + 192 + j]
                d[u + 2 * r], d[u + 2 * r + 1] = s[o + 208], s[o + 209]


@njit(inline="always")
def _k6x16_at(wr, o):
    """(flat weight, unit's byte, row in the group) of the GGUF super-block at byte o of a Q6_KX16
    weight given as wr = (flat weight, GGUF row bytes): the GGUF decoders' (row, o) for _each_block's
    callers (dequantization, prefill tiles), so the repacked rows decode to the same bits."""
    w, rb = wr
    row = o // rb
    return w, (row - row % 16) * rb + (o - row * rb) // _NB_Q6_K * _K6U, row % 16


@njit(inline="always")
def _scales_k6x16(wr, o):
    """_scales_q6_k of a Q6_KX16 row (_k6x16_at)."""
    w, u, r = _k6x16_at(wr, o)
    a = u + _K6S + _K6ROW[r]  # sub-block j at a + 16 j
    q = (cat(cat(ld(w, a, 1), ld(w, a + 16, 1)), cat(ld(w, a + 32, 1), ld(w, a + 48, 1))),
         cat(cat(ld(w, a + 64, 1), ld(w, a + 80, 1)), cat(ld(w, a + 96, 1), ld(w, a + 112, 1))),
         cat(cat(ld(w, a + 128, 1), ld(w, a + 144, 1)), cat(ld(w, a + 160, 1), ld(w, a + 176, 1))),
         cat(cat(ld(w, a + 192, 1), ld(w, a + 208, 1)), cat(ld(w, a + 224, 1), ld(w, a + 240, 1))))
    sc = cvt(cvt(cat(cat(q[0], q[1]), cat(q[2], q[3])), np.int8), np.int16)
    return half(w, u + 2 * r), f32(0), sc, splat(i32(0), 16)


@njit(inline="always")
def _quants_k6x16(wr, o, c):
    """_quants_q6_k of a Q6_KX16 row (_k6x16_at): chunk c = 4 h + i, elements 128 h + 32 i + l."""
    w, u, r = _k6x16_at(wr, o)
    return _k6_pick(w, u + _K6P + 1536 * (c >> 2) + 4 * r, c & 3, _k6_row32)


@njit(inline="always")
def _k6_row32(w, q):
    """One row's 32 bytes of a, b or c lines from byte q (4 a line, two pieces of 4 lines)."""
    return cat(cat(cat(ld(w, q, 4), ld(w, q + 64, 4)), cat(ld(w, q + 128, 4), ld(w, q + 192, 4))),
               cat(cat(ld(w, q + 768, 4), ld(w, q + 832, 4)), cat(ld(w, q + 896, 4), ld(w, q + 960, 4))))


_K6DUP = shuffler(0, 0, 1, 1, 2, 2, 3, 3, 8, 8, 9, 9, 10, 10, 11, 11, 4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15)


@njit(inline="always")
def k6_scales(w, u, j):
    """Sub-block j's scales of the Q6_KX16 unit at byte u as int16 x 32: row r's at lanes 2 r and
    2 r + 1 (pmaddwd's operand; as an int32 lane, igemm's si)."""
    return _K6DUP(cvt(view(ld(w, u + _K6S + 16 * j, 16), np.int8), np.int16))


@njit(inline="always")
def _k6_pick(w, q, i, load):
    """Quants q_i (k6_quants) from the a, b, c bytes at q, q + 256, q + 512 as load(w, byte) gives
    them: only the one that holds q_i for i < 3, all three for q_3."""
    if i == 3:
        return k6_quants(load(w, q), load(w, q + 256), load(w, q + 512), 3)
    v = load(w, q + 256 * i)
    return k6_quants(v, v, v, i)


@njit(inline="always")
def _line64(w, q):
    return ld(w, q, 64)


@njit(inline="always")
def k6_line(w, q, i):
    """Quants q_i of 16 rows x 4 elements from the Q6_KX16 piece line at byte q (k6_quants)."""
    return _k6_pick(w, q, i, _line64)


@njit(inline="always")
def k6_quants(a, b, c, i):
    """Quants q_i (0..63) from the Q6_KX16 bytes a, b, c of the same elements (uint8 vectors; for
    i < 3 only the one of a, b, c it is in is read)."""
    u = np.uint32
    if i == 0:
        v = vand(view(a, u), u(0x3F3F3F3F))
    elif i == 1:
        v = vand(view(b, u), u(0x3F3F3F3F))
    elif i == 2:
        v = vand(view(c, u), u(0x3F3F3F3F))
    else:
        v = vor(vor(vand(vshr(view(a, u), 6), u(0x03030303)), vand(vshr(view(b, u), 4), u(0x0C0C0C0C))),
                vand(vshr(view(c, u), 2), u(0x30303030)))
    return view(v, np.uint8)


# ---------------------------------------------------------------------------------------------
# Work items of a fused weight ws (three parts of one type, outputs side by side): tiles of
# `rows` rows of each part in turn.
# ---------------------------------------------------------------------------------------------
@njit(inline="always")
def _part(item, n0, n1):
    """Work item -> (part, item within the part) for three parts of n0, n1 and the rest items."""
    if item < n0:
        return 0, item
    if item < n0 + n1:
        return 1, item - n0
    return 2, item - n0 - n1


@njit(inline="always")
def _tiles(ws, rows):
    """The rows of each part and how many tiles of `rows` they make in all: plain ints for _tile_at."""
    m0, m1, m2 = ws[0].shape[0], ws[1].shape[0], ws[2].shape[0]
    return m0, m1, m2, (m0 + rows - 1) // rows + (m1 + rows - 1) // rows + (m2 + rows - 1) // rows


@njit(inline="always")
def _tile_at(item, m0, m1, m2, rows, col0):
    """Work item -> (its part, the part's first output column, the tile's first row, its rows)
    for parts of m0, m1, m2 rows whose outputs start at column col0. Ints in and out: the tuple of
    arrays handed to this inlined helper in the parallel loop cost reference counts per work item
    (5-8% of a decode matvec at 1 thread), so the caller takes ws[part] itself."""
    p, tile = _part(np.int64(item), (m0 + rows - 1) // rows, (m1 + rows - 1) // rows)  # (prange may be unsigned)
    r0 = tile * rows
    if p == 0:
        return p, col0, r0, min(rows, m0 - r0)
    if p == 1:
        return p, col0 + m0, r0, min(rows, m1 - r0)
    return p, col0 + m0 + m1, r0, min(rows, m2 - r0)
