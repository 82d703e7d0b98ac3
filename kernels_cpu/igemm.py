"""Prefill on integer dot products: x (n, k) @ W.T for quantized W and many tokens.

Activations are quantized per token to int8 in blocks of 32 (as Q8_0), and a tile of _R weight
rows is unpacked once into unsigned bytes laid out four k-values per row side by side:

    u[g, r] = the 4 quants of row r at k = 4g .. 4g+3 (a uint32 holding 4 bytes)

so that one vpdpbusd of 16 lanes x 4 bytes is 16 rows times one token's 4 activations (broadcast):
each int32 lane sums a whole sub-block of its row without any horizontal sum. Per sub-block
(32 or 16 weights, the type's scale granularity) an int32 lane is converted and scaled once:

    y[t, r] += s[j, r] * dx[t, j] * (sum_i u[i, r] * xq[t, i] - off * sum_i xq[t, i]) + mn[j, r] * xs[t, j]

(s: the sub-block's float scale, off: the type's quant offset, mn and xs = dx * sum(xq): the
min term of the types that have one). A register tile of _R = 32 rows x _T = 6 tokens holds 12
int32 and 12 float32 accumulators; per 4 values of k it loads two weight vectors and broadcasts
6 activations, for 12 products of 64 multiply-adds. The integer peak is ~4x the float FMA peak.

Without VNNI (AVX2: 16 registers of 256 bits, no vpdpbusd) the types whose quants are < 64
(SMALL_TYPES) take a narrow tile of 8 rows x 8 tokens instead (_tile8): per two groups of 4 k a
token's two pmaddubsw are added in int16 (4 products of |q| < 64 and |xq| <= 127 stay < 2**15)
and one pmaddwd by ones makes the int32 sums of 4; 8 int32 accumulators, their float sums kept
in the tile's result rows (L1) and added to once per sub-block. The 8 tokens' activations and
scales are laid side by side first (_by8), so that every token's broadcast is one base address
plus a constant (8 token pointers spilled the scalar registers: 226 -> 294 GFLOP/s, Q4_0 on
Zen 3, 2 threads). The K types take _tile8k there: activations per 256 (as llama.cpp's Q8_K),
+128 so that they are pmaddubsw's unsigned operand and the quants - off its signed one, the
sub-block scales applied by the pmaddwd (int16 scales instead of ones), one float flush per
super-block (4096x4096 n=512, Zen 3: Q6_K 255 -> 357 GFLOP/s, Q4_K 304 -> 321). Q8_0 and the
IQ4 types (quants up to 255) stay on the float prefill there (qmatmul.int8_prefill).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .layouts import _OFF_IQ4_XS, _OFF_Q2_K, _OFF_Q3_K, _OFF_Q4_K, _OFF_Q5_K, _OFF_Q6_K, IQ4_NL, Q2_K, Q3_K, Q4_0
from .layouts import (Q4_1, Q4_K, Q4_KX16, Q5_0, Q5_1, Q5_K, Q6_K, Q6_KX16, Q8_0, X16, _K4D, _K4Q, _K4U, _K6P, _K6U,
                      _NB_Q6_K, _each_block, _quants_k6x16, _scales_k6x16, k4x16_field, k6_line, k6_scales,
                      x16_at, x16_geometry, _tile_at, _tiles)
from .simd import (_VPDPBUSD, at, cat, cvt, dot4acc, fma, h2f, half, lane, ld, madd, maddubs, shuffler, splat, st,
                   vadd, vand, view, vmul, vshr, vsub, vxor)

_R = 32  # rows per tile: two vectors of 16 int32 lanes
_T = 6  # tokens per register tile (12 + 12 accumulators, 2 weights, 1 broadcast: 27 of 32 zmm)
_T8 = 8  # the narrow tile's tokens (8 accumulators, 2 weights, broadcasts, ones: 16 ymm)
f32, i32 = np.float32, np.int32
# Types whose quants are < 64 (pmaddubsw's int16 sums over two groups cannot overflow)
SMALL_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
# The narrow tile where there is no vpdpbusd (an emulated vpdpbusd of 512 bits takes ~3x longer)
NARROW = not _VPDPBUSD


@njit(inline="always")
def _type_info(qtype):
    """(quant offset, has a min term, sub-block size) of a quantized type (an X16 layout's: its
    GGUF type's)."""
    if qtype > X16:
        qtype -= X16
    if qtype == Q4_0:
        return 8, False, 32
    if qtype == Q5_0:
        return 16, False, 32
    if qtype == Q8_0 or qtype == IQ4_NL:
        return 128, False, 32
    if qtype == Q4_1 or qtype == Q5_1:
        return 0, True, 32
    if qtype == Q2_K:
        return _OFF_Q2_K, True, 16
    if qtype == Q3_K:
        return _OFF_Q3_K, False, 16
    if qtype == Q4_K:
        return _OFF_Q4_K, True, 32
    if qtype == Q5_K:
        return _OFF_Q5_K, True, 32
    if qtype == Q6_K:
        return _OFF_Q6_K, False, 16
    return _OFF_IQ4_XS, False, 32  # IQ4_XS


def small(qtype: int) -> bool:
    """Whether the type (an X16 layout: its GGUF type) is one of SMALL_TYPES."""
    return (qtype - X16 if qtype > X16 else qtype) in SMALL_TYPES


def narrow(qtype: int) -> bool:
    """Whether _igemm takes the narrow tile for this type on this machine."""
    return NARROW and small(qtype)


def q8_k(qtype: int) -> bool:
    """Whether _igemm quantizes the activations per 256 for this type (_tile8k's K types)."""
    return narrow(qtype) and (Q2_K <= qtype <= Q6_K or qtype == Q4_KX16 or qtype == Q6_KX16)


# ---------------------------------------------------------------------------------------------
# Activations: per token, int8 blocks of 32 with a float scale dx; per sub-block j of sb values,
# xo = -off * sum(xq) (the integer start of the row's accumulator) and xs = dx * sum(xq).
# ---------------------------------------------------------------------------------------------
@njit(fastmath=True, inline="always")
def _quantize_token(x, t, k, qb, sb, off, xq, dx, xo, xs):
    """Token t in blocks of qb (32, or 256 for the K types' narrow tile: as llama.cpp's Q8_K)."""
    nb, nsb = k // qb, k // sb
    for b in range(nb):
        amax = f32(0)
        for i in range(qb * b, qb * b + qb):
            amax = max(amax, abs(x[t, i]))
        inv = f32(127) / amax if amax > 0 else f32(0)
        d = amax / f32(127)
        dx[t * nb + b] = d
        for h in range(qb // sb):
            total = 0
            for i in range(qb * b + sb * h, qb * b + sb * h + sb):
                q = np.int8(np.rint(x[t, i] * inv))
                xq[t * k + i] = q
                total += q
            j = t * nsb + b * (qb // sb) + h
            xo[j] = -off * total
            xs[j] = d * f32(total)


# ---------------------------------------------------------------------------------------------
# Weight tiles: rows r0 .. r0 + nr - 1 -> u (k/4 groups x _R rows of 4 bytes), s and mn (k/sb
# sub-blocks x _R rows). Rows past nr are zero (their results are dropped).
# ---------------------------------------------------------------------------------------------
# A 16 x 8 transpose of uint32 (16 rows' 8 groups of 4 quants -> 8 vectors of 16 rows) in three
# rounds of two-source shuffles (vpermt2d), 24 for 16 rows x 32 quants.
# Round 1: rows 4m..4m+3 x groups 4h..4h+3 from P(2m), P(2m+1) (P(j) = rows 2j, 2j+1): lane
#   4 * group + row. Round 2: rows 8n..8n+7 x groups 4h+2p, +1: lane 8 * group + row. Round 3:
#   rows 0..15 of one group.
_T1_0, _T1_1 = (shuffler(*[8 * (i % 4) + 4 * h + i // 4 for i in range(16)]) for h in range(2))
_T2_0, _T2_1 = (shuffler(*[16 * ((i % 8) // 4) + (2 * p + i // 8) * 4 + i % 4 for i in range(16)]) for p in range(2))
_T3_0, _T3_1 = (shuffler(*[(i // 8) * 16 + g * 8 + i % 8 for i in range(16)]) for g in range(2))


@njit(inline="always")
def _transpose(tmp, k4, o, u, uo):
    """u[uo + g * _R + r] = tmp[r * k4 + o + g] for 16 rows r and 8 groups g."""
    p0 = cat(ld(tmp, o, 8), ld(tmp, k4 + o, 8))
    p1 = cat(ld(tmp, 2 * k4 + o, 8), ld(tmp, 3 * k4 + o, 8))
    p2 = cat(ld(tmp, 4 * k4 + o, 8), ld(tmp, 5 * k4 + o, 8))
    p3 = cat(ld(tmp, 6 * k4 + o, 8), ld(tmp, 7 * k4 + o, 8))
    p4 = cat(ld(tmp, 8 * k4 + o, 8), ld(tmp, 9 * k4 + o, 8))
    p5 = cat(ld(tmp, 10 * k4 + o, 8), ld(tmp, 11 * k4 + o, 8))
    p6 = cat(ld(tmp, 12 * k4 + o, 8), ld(tmp, 13 * k4 + o, 8))
    p7 = cat(ld(tmp, 14 * k4 + o, 8), ld(tmp, 15 * k4 + o, 8))
    a, b, c, d = cat(p0, p1), cat(p2, p3), cat(p4, p5), cat(p6, p7)
    q00, q01, q10, q11 = _T1_0(a), _T1_1(a), _T1_0(b), _T1_1(b)
    q20, q21, q30, q31 = _T1_0(c), _T1_1(c), _T1_0(d), _T1_1(d)
    e, f, g, h = cat(q00, q10), cat(q01, q11), cat(q20, q30), cat(q21, q31)
    t0, t1, t2, t3 = cat(_T2_0(e), _T2_0(g)), cat(_T2_1(e), _T2_1(g)), cat(_T2_0(f), _T2_0(h)), cat(_T2_1(f), _T2_1(h))
    st(u, uo, _T3_0(t0))
    st(u, uo + _R, _T3_1(t0))
    st(u, uo + 2 * _R, _T3_0(t1))
    st(u, uo + 3 * _R, _T3_1(t1))
    st(u, uo + 4 * _R, _T3_0(t2))
    st(u, uo + 5 * _R, _T3_1(t2))
    st(u, uo + 6 * _R, _T3_0(t3))
    st(u, uo + 7 * _R, _T3_1(t3))


@njit(fastmath=True, inline="always")
def _unpack_32(a, block, nbytes):
    w, rb, r0, nr, k, tmp, s, mn = a
    nb = k // 32
    for rr in range(nr):
        ro = (r0 + rr) * rb
        for b in range(nb):
            q, off, d, m = block(w, ro + nbytes * b)
            st(tmp, rr * (8 * nb) + 8 * b, view(q, np.uint32))
            s[b * _R + rr] = d
            mn[b * _R + rr] = m


@njit(fastmath=True, inline="always")
def _unpack_k(a, scales, quants, nbytes, off, sb):
    w, rb, r0, nr, k, tmp, s, mn = a
    nsup = k // 256
    per = 256 // sb  # sub-blocks per super-block
    for rr in range(nr):
        ro = (r0 + rr) * rb
        for b in range(nsup):
            o = ro + nbytes * b
            d, dmin, sc, mv = scales(w, o)
            for c in range(8):
                st(tmp, rr * (64 * nsup) + 64 * b + 8 * c, view(quants(w, o, c), np.uint32))
            for j in range(per):
                e = j * (16 // per)  # scales come per 16 (repeated for sub-blocks of 32)
                s[(per * b + j) * _R + rr] = d * f32(lane(sc, e))
                mn[(per * b + j) * _R + rr] = -dmin * f32(lane(mv, e))


@njit(fastmath=True, inline="always")
def _unpack_kint(a, scales, quants, nbytes, off, sb):
    """A K type's rows for _tile8k: quants - off as int8 into tmp; per sub-block the int16 scale
    twice in an int32 (si: pmaddwd's operand), per pair of sub-blocks their int16 mins (mi); per
    super-block d, -dmin (dd, dm) and the int32 start c0 = -128 * sum_j sc_j * (sub-block j's sum
    of quants), which takes the activations' +128 (_tile8k) back out."""
    w, rb, r0, nr, k, tmp, si, mi, dd, dm, c0 = a
    nsup = k // 256
    per = 256 // sb
    ones8, ones16 = splat(np.uint8(1), 32), splat(np.int16(1), 16)
    for rr in range(nr):
        ro = (r0 + rr) * rb
        for b in range(nsup):
            o = ro + nbytes * b
            d, dmin, sc, mv = scales(w, o)
            base = rr * (64 * nsup) + 64 * b
            total = 0
            for c in range(8):  # chunk c: weights 32c .. 32c + 31 (sub-blocks 2c, 2c + 1 of 16)
                q = vsub(quants(w, o, c), np.uint8(off))
                st(tmp, base + 8 * c, view(q, np.uint32))
                s4 = madd(maddubs(ones8, view(q, np.int8)), ones16)  # sums of 4
                lo = lane(s4, 0) + lane(s4, 1) + lane(s4, 2) + lane(s4, 3)
                hi = lane(s4, 4) + lane(s4, 5) + lane(s4, 6) + lane(s4, 7)
                total += i32(lane(sc, 2 * c)) * lo + i32(lane(sc, 2 * c + (sb == 16))) * hi
            for j in range(per):
                scj = i32(lane(sc, j * (16 // per)))  # scales come per 16 (repeated for sub-blocks of 32)
                si[(per * b + j) * _R + rr] = (scj & 0xFFFF) | (scj << 16)
            for h in range(per // 2):
                mi[(per // 2 * b + h) * _R + rr] = i32(lane(mv, 2 * h * (16 // per))) | (
                    i32(lane(mv, (2 * h + 1) * (16 // per))) << 16)
            dd[b * _R + rr] = d
            dm[b * _R + rr] = -dmin
            c0[b * _R + rr] = -128 * total


@njit(fastmath=True, inline="always")
def _to_tile(tmp, k, nr, u):
    """tmp's rows (_R, k/4 groups of 4 quants; rows past nr zeroed here) transposed into u."""
    k4 = k // 4
    for rr in range(nr, _R):
        for g in range(k4):
            tmp[rr * k4 + g] = 0
    for h in range(2):
        for b in range(k // 32):
            _transpose(tmp, k4, 16 * h * k4 + 8 * b, u, 8 * b * _R + 16 * h)


@njit(inline="always")
def _not_k(a, block, nbytes):
    """_each_block's branch for the 32-element types, which _unpack_k8 is never given."""


@njit(fastmath=True)
def _unpack_k8(qtype, w, rb, r0, nr, k, u, si, mi, dd, dm, c0, tmp):
    """The tile's rows of a K type for _tile8k (_unpack_kint), transposed into u as _unpack's."""
    _each_block(qtype, _not_k, _unpack_kint, (w, rb, r0, nr, k, tmp, si, mi, dd, dm, c0))
    for rr in range(nr, _R):
        for j in range(si.size // _R):
            si[j * _R + rr] = 0
        for j in range(mi.size // _R):
            mi[j * _R + rr] = 0
        for b in range(dd.size // _R):
            dd[b * _R + rr], dm[b * _R + rr], c0[b * _R + rr] = 0, 0, 0
    _to_tile(tmp, k, nr, u)


@njit(fastmath=True, inline="always")
def _unpack_x16(w, qtype, rb, r0, nr, k, u, s, mn):
    """X16 rows are in u's layout already, 16 at a time: nibbles split (or Q8_0's bytes made
    unsigned), scales and mins widened."""
    qb, unit, has_min, _, _ = x16_geometry(qtype)
    zu, zf = splat(np.uint32(0), 16), splat(f32(0), 16)
    for h in range(_R // 16):
        g = (r0 + 16 * h) * rb  # the group's first byte (rows past nr: zeros)
        live = 16 * h < nr
        for b in range(k // 32):
            sc, q = x16_at(g + unit * (b // 2), b % 2, qb, has_min)
            for j in range(qb // 4):
                v = view(ld(w, q + 64 * j, 64), np.uint32) if live else zu
                if qb == 32:
                    st(u, (8 * b + j) * _R + 16 * h, vxor(v, 0x80808080) if live else zu)
                else:
                    st(u, (8 * b + j) * _R + 16 * h, vand(v, 0x0F0F0F0F))
                    st(u, (8 * b + 4 + j) * _R + 16 * h, vand(vshr(v, 4), 0x0F0F0F0F))
            st(s, b * _R + 16 * h, h2f(view(ld(w, sc, 32), np.uint16)) if live else zf)
            st(mn, b * _R + 16 * h, h2f(view(ld(w, sc + 64, 32), np.uint16)) if has_min and live else zf)


@njit(fastmath=True)
def _unpack_k4x16(w, rb, r0, nr, k, u, s, mn):
    """Q4_KX16 rows as _unpack_k decodes Q4_K's: the nibbles split, the scales and mins as its."""
    zu = splat(np.uint32(0), 16)
    for h in range(_R // 16):
        g = (r0 + 16 * h) * rb
        live = 16 * h < nr
        for sb in range(k // 256):
            un = g + _K4U * sb
            for j in range(8):  # sub-block j: chunk j // 2, low or high nibbles
                b = 8 * sb + j
                for i in range(8):
                    v = vand(vshr(view(ld(w, un + _K4Q + 512 * (j // 2) + 64 * i, 64), np.uint32), 4 * (j % 2)),
                             0x0F0F0F0F) if live else zu
                    st(u, (8 * b + i) * _R + 16 * h, v)
                for r in range(16):
                    o = b * _R + 16 * h + r
                    if live:
                        sc, m = k4x16_field(w, un, r, j)
                        s[o] = half(w, un + _K4D + 2 * r) * f32(sc)
                        mn[o] = -half(w, un + _K4D + 32 + 2 * r) * f32(m)
                    else:
                        s[o], mn[o] = 0, 0


@njit(fastmath=True)
def _unpack_k4x16_int(w, rb, r0, nr, k, u, si, mi, dd, dm, c0):
    """Q4_KX16 rows for _tile8k, as _unpack_kint gives Q4_K's (its quants have no offset: u as
    _unpack_k4x16's); each row's sums of quants per sub-block from the unpacked lines."""
    zu = splat(np.uint32(0), 16)
    ones8, ones16 = splat(np.int8(1), 64), splat(np.int16(1), 32)
    sums, total = np.empty(16, np.int32), np.empty(16, np.int32)
    for h in range(_R // 16):
        g = (r0 + 16 * h) * rb
        live = 16 * h < nr
        for sb in range(k // 256):
            un = g + _K4U * sb
            total[:] = 0
            for j in range(8):  # sub-block j: chunk j // 2, low or high nibbles
                b = 8 * sb + j
                acc = splat(i32(0), 16)
                for i in range(8):
                    v = vand(vshr(view(ld(w, un + _K4Q + 512 * (j // 2) + 64 * i, 64), np.uint32), 4 * (j % 2)),
                             0x0F0F0F0F) if live else zu
                    st(u, (8 * b + i) * _R + 16 * h, v)
                    acc = vadd(acc, madd(maddubs(view(v, np.uint8), ones8), ones16))  # the rows' sums of 4
                st(sums, 0, acc)
                for r in range(16):
                    sc, m = k4x16_field(w, un, r, j) if live else (i32(0), i32(0))
                    si[b * _R + 16 * h + r] = (sc & 0xFFFF) | (sc << 16)
                    p = (4 * sb + j // 2) * _R + 16 * h + r
                    mi[p] = m if j % 2 == 0 else mi[p] | (m << 16)
                    total[r] += sc * sums[r]
            for r in range(16):
                o = sb * _R + 16 * h + r
                dd[o] = half(w, un + _K4D + 2 * r) if live else f32(0)
                dm[o] = -half(w, un + _K4D + 32 + 2 * r) if live else f32(0)
                c0[o] = -128 * total[r]


_EVEN16 = shuffler(*range(0, 32, 2))  # int16 x 32 -> its even lanes


@njit(fastmath=True)
def _unpack_k6x16_int(w, rb, r0, nr, k, u, si, mi, dd, dm, c0):
    """Q6_KX16 rows for _tile8k, as _unpack_kint gives Q6_K's: the layout's lines are u's (16 rows
    x 4 quants), the quants less 32 stored straight; each row's int16 scale twice (k6_scales: si's
    form already); c0 = -128 * sum_j sc_j * (sub-block j's sum of quants less 32); no mins."""
    zu, zi = splat(np.uint32(0), 16), splat(i32(0), 16)
    ones8, ones16 = splat(np.uint8(1), 64), splat(np.int16(1), 32)
    for h in range(_R // 16):
        g = (r0 + 16 * h) * rb
        live = 16 * h < nr
        for sb in range(k // 256):
            un = g + _K6U * sb
            total = zi
            for j in range(16):  # sub-block j: piece (j // 8, j % 2), quants q_(j % 8 // 2), 4 lines
                i = (j & 7) >> 1
                q = un + _K6P + 768 * (2 * (j >> 3) + (j & 1))
                acc = zi
                for line in range(4):
                    v = vsub(k6_line(w, q + 64 * line, i), np.uint8(32)) if live else view(zu, np.uint8)
                    st(u, (64 * sb + 4 * j + line) * _R + 16 * h, view(v, np.uint32))
                    acc = vadd(acc, madd(maddubs(ones8, view(v, np.int8)), ones16))  # the rows' sums of 4
                sc = k6_scales(w, un, j) if live else splat(np.int16(0), 32)
                st(si, (16 * sb + j) * _R + 16 * h, view(sc, i32))
                total = vadd(total, vmul(acc, cvt(_EVEN16(sc), i32)))
            st(c0, sb * _R + 16 * h, vmul(total, splat(i32(-128), 16)))
            for r in range(16):
                o = sb * _R + 16 * h + r
                dd[o] = half(w, un + 2 * r) if live else f32(0)
                dm[o] = -f32(0) if live else f32(0)  # -dmin, as _unpack_kint's
                for p in range(8):
                    mi[(8 * sb + p) * _R + 16 * h + r] = 0


@njit(fastmath=True)
def _unpack(qtype, w, rb, r0, nr, k, u, s, mn, tmp):
    """The tile's rows decoded row by row into tmp (_R, k/4), then transposed into u."""
    if qtype == Q4_KX16:
        _unpack_k4x16(w, rb, r0, nr, k, u, s, mn)
        return
    if qtype == Q6_KX16:
        _unpack_k(((w, rb), rb, r0, nr, k, tmp, s, mn), _scales_k6x16, _quants_k6x16, _NB_Q6_K, _OFF_Q6_K, 16)
    elif qtype > X16:
        _unpack_x16(w, qtype, rb, r0, nr, k, u, s, mn)
        return
    else:
        _each_block(qtype, _unpack_32, _unpack_k, (w, rb, r0, nr, k, tmp, s, mn))
    for rr in range(nr, _R):
        for j in range(s.size // _R):
            s[j * _R + rr] = 0
            mn[j * _R + rr] = 0
    _to_tile(tmp, k, nr, u)


# ---------------------------------------------------------------------------------------------
# Register tile: res (_T, _R) = the tile's rows times tokens t0 .. t0 + _T - 1.
# ---------------------------------------------------------------------------------------------
@njit(inline="always")
def _bx(xq4, i):
    """Token activations xq4[i] (4 int8 in a uint32) broadcast to 64 bytes."""
    return view(splat(at(xq4, i), 16), np.int8)


@njit(fastmath=True, inline="always")
def _flush(acc, s, m, d, e, f, has_min):
    f = fma(vmul(cvt(acc, f32), s), d, f)
    return fma(m, e, f) if has_min else f


@njit(fastmath=True, inline="always")
def _tile(u, s, mn, xq4, dx, xo, xs, k, sb, has_min, t0, res):
    k4, nb, nsb, gps = k // 4, k // 32, k // sb, sb // 4
    a, b, c, d_, e, f = t0, t0 + 1, t0 + 2, t0 + 3, t0 + 4, t0 + 5  # the tile's tokens
    z = splat(f32(0), 16)
    f00, f01, f10, f11, f20, f21 = z, z, z, z, z, z
    f30, f31, f40, f41, f50, f51 = z, z, z, z, z, z
    for j in range(nsb):
        # accumulators start at -off * sum(xq) of the sub-block: the offset costs no instruction
        z0 = splat(at(xo, a * nsb + j), 16)
        i00, i01 = z0, z0
        z1 = splat(at(xo, b * nsb + j), 16)
        i10, i11 = z1, z1
        z2 = splat(at(xo, c * nsb + j), 16)
        i20, i21 = z2, z2
        z3 = splat(at(xo, d_ * nsb + j), 16)
        i30, i31 = z3, z3
        z4 = splat(at(xo, e * nsb + j), 16)
        i40, i41 = z4, z4
        z5 = splat(at(xo, f * nsb + j), 16)
        i50, i51 = z5, z5
        for g in range(j * gps, j * gps + gps):
            w0 = view(ld(u, g * _R, 16), np.uint8)
            w1 = view(ld(u, g * _R + 16, 16), np.uint8)
            x = _bx(xq4, a * k4 + g)
            i00, i01 = dot4acc(i00, w0, x), dot4acc(i01, w1, x)
            x = _bx(xq4, b * k4 + g)
            i10, i11 = dot4acc(i10, w0, x), dot4acc(i11, w1, x)
            x = _bx(xq4, c * k4 + g)
            i20, i21 = dot4acc(i20, w0, x), dot4acc(i21, w1, x)
            x = _bx(xq4, d_ * k4 + g)
            i30, i31 = dot4acc(i30, w0, x), dot4acc(i31, w1, x)
            x = _bx(xq4, e * k4 + g)
            i40, i41 = dot4acc(i40, w0, x), dot4acc(i41, w1, x)
            x = _bx(xq4, f * k4 + g)
            i50, i51 = dot4acc(i50, w0, x), dot4acc(i51, w1, x)
        s0, s1 = ld(s, j * _R, 16), ld(s, j * _R + 16, 16)
        m0, m1 = ld(mn, j * _R, 16), ld(mn, j * _R + 16, 16)
        bj = (j * sb) >> 5  # the activation block of sub-block j
        dv, ev = splat(at(dx, a * nb + bj), 16), splat(at(xs, a * nsb + j), 16)
        f00, f01 = _flush(i00, s0, m0, dv, ev, f00, has_min), _flush(i01, s1, m1, dv, ev, f01, has_min)
        dv, ev = splat(at(dx, b * nb + bj), 16), splat(at(xs, b * nsb + j), 16)
        f10, f11 = _flush(i10, s0, m0, dv, ev, f10, has_min), _flush(i11, s1, m1, dv, ev, f11, has_min)
        dv, ev = splat(at(dx, c * nb + bj), 16), splat(at(xs, c * nsb + j), 16)
        f20, f21 = _flush(i20, s0, m0, dv, ev, f20, has_min), _flush(i21, s1, m1, dv, ev, f21, has_min)
        dv, ev = splat(at(dx, d_ * nb + bj), 16), splat(at(xs, d_ * nsb + j), 16)
        f30, f31 = _flush(i30, s0, m0, dv, ev, f30, has_min), _flush(i31, s1, m1, dv, ev, f31, has_min)
        dv, ev = splat(at(dx, e * nb + bj), 16), splat(at(xs, e * nsb + j), 16)
        f40, f41 = _flush(i40, s0, m0, dv, ev, f40, has_min), _flush(i41, s1, m1, dv, ev, f41, has_min)
        dv, ev = splat(at(dx, f * nb + bj), 16), splat(at(xs, f * nsb + j), 16)
        f50, f51 = _flush(i50, s0, m0, dv, ev, f50, has_min), _flush(i51, s1, m1, dv, ev, f51, has_min)
    st(res, 0, f00)
    st(res, 16, f01)
    st(res, 32, f10)
    st(res, 48, f11)
    st(res, 64, f20)
    st(res, 80, f21)
    st(res, 96, f30)
    st(res, 112, f31)
    st(res, 128, f40)
    st(res, 144, f41)
    st(res, 160, f50)
    st(res, 176, f51)


@njit(inline="always")
def _bx8(xi, i):
    """Token activations xi[i] (4 int8 in a uint32) broadcast to 32 bytes."""
    return view(splat(at(xi, i), 8), np.int8)


@njit(fastmath=True, inline="always")
def _pair8(acc, w0, w1, xi, i, ones):
    """acc + one token's sums of 4 for 8 rows over two groups (weights w0, w1; its activations at
    xi[i], xi[i + 8]: _by8): two pmaddubsw added in int16, one pmaddwd by ones."""
    return vadd(acc, madd(vadd(maddubs(w0, _bx8(xi, i)), maddubs(w1, _bx8(xi, i + 8))), ones))


@njit(fastmath=True, inline="always")
def _flush8(acc, s, m, dx, xs, res, o, has_min):
    f = fma(vmul(cvt(acc, f32), s), splat(dx, 8), ld(res, o, 8))
    st(res, o, fma(m, splat(xs, 8), f) if has_min else f)


@njit(fastmath=True)
def _tile8(u, s, mn, xi, dx, xo, xs, k, sb, has_min, tg, nr, res):
    """res[t * _R + r] += row r (< nr) of the tile times token 8 tg + t (t < _T8), 8 rows at a time
    in each sub-block (its weights and activations stay in L1 for all the rows), for SMALL_TYPES
    without VNNI (the module's docstring). The 8 tokens' activations, scales and sums side by
    side (_by8): every token's value at one base address plus a constant."""
    k4, nb, nsb, gps = k // 4, k // 32, k // sb, sb // 4
    ones = splat(np.int16(1), 16)
    xb, db, ob = 8 * k4 * tg, 8 * nb * tg, 8 * nsb * tg
    for j in range(nsb):
        oj, dj = ob + 8 * j, db + 8 * ((j * sb) >> 5)  # the sub-block's and its activation block's
        for r in range(0, nr, 8):
            a0, a1 = splat(at(xo, oj), 8), splat(at(xo, oj + 1), 8)
            a2, a3 = splat(at(xo, oj + 2), 8), splat(at(xo, oj + 3), 8)
            a4, a5 = splat(at(xo, oj + 4), 8), splat(at(xo, oj + 5), 8)
            a6, a7 = splat(at(xo, oj + 6), 8), splat(at(xo, oj + 7), 8)
            for g in range(j * gps, j * gps + gps, 2):
                w0 = view(ld(u, g * _R + r, 8), np.uint8)
                w1 = view(ld(u, g * _R + _R + r, 8), np.uint8)
                o = xb + 8 * g
                a0, a1 = _pair8(a0, w0, w1, xi, o, ones), _pair8(a1, w0, w1, xi, o + 1, ones)
                a2, a3 = _pair8(a2, w0, w1, xi, o + 2, ones), _pair8(a3, w0, w1, xi, o + 3, ones)
                a4, a5 = _pair8(a4, w0, w1, xi, o + 4, ones), _pair8(a5, w0, w1, xi, o + 5, ones)
                a6, a7 = _pair8(a6, w0, w1, xi, o + 6, ones), _pair8(a7, w0, w1, xi, o + 7, ones)
            sv, mv = ld(s, j * _R + r, 8), ld(mn, j * _R + r, 8)
            for t, a in ((0, a0), (1, a1), (2, a2), (3, a3), (4, a4), (5, a5), (6, a6), (7, a7)):
                _flush8(a, sv, mv, at(dx, dj + t), at(xs, oj + t), res, t * _R + r, has_min)


@njit(fastmath=True, inline="always")
def _pair8k(acc, xi, i, w0, w1, sc):
    """acc + one token's sums over two groups for 8 rows times their sub-block scales: the
    activations (+128, unsigned) first in pmaddubsw, the signed quants second, one pmaddwd by sc."""
    return vadd(acc, madd(vadd(maddubs(_bx8(xi, i), w0), maddubs(_bx8(xi, i + 8), w1)), sc))


@njit(fastmath=True, inline="always")
def _flush8k(acc, dv, dx, res, o):
    st(res, o, fma(cvt(acc, f32), vmul(dv, splat(dx, 8)), ld(res, o, 8)))


@njit(fastmath=True)
def _tile8k(u, si, mi, dd, dm, c0, xi, dx, xp, k, sb, has_min, tg, nr, res):
    """_tile8 for the K types: the sub-block scales applied in the integer domain (pmaddwd by the
    int16 scales instead of ones) and the activations quantized per super-block of 256 (one
    scale), so that a row's int32 sums run over the whole super-block and are converted and
    scaled once per 256 weights instead of once per 16 or 32. The offsets cost nothing per token:
    activations + 128 (unsigned, pmaddubsw's first operand) times quants - off (signed, |q| <= 32:
    four products of 255 * 32 stay < 2**15), the +128's share in each row's start value c0. The
    mins (Q2_K, Q4_K, Q5_K): int32 sums of the rows' int16 mins times the tokens' sub-block sums
    (xp: int16 pairs), one float FMA per super-block and token."""
    k4, nsup, nsb, gps, per = k // 4, k // 256, k // sb, sb // 4, 256 // sb
    xb, db, pb = 8 * k4 * tg, 8 * nsup * tg, 4 * nsb * tg
    for b in range(nsup):
        for r in range(0, nr, 8):
            a0 = ld(c0, b * _R + r, 8)
            a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
            for j in range(per * b, per * b + per):
                sc = view(ld(si, j * _R + r, 8), np.int16)
                for g in range(j * gps, j * gps + gps, 2):
                    w0 = view(ld(u, g * _R + r, 8), np.int8)
                    w1 = view(ld(u, g * _R + _R + r, 8), np.int8)
                    o = xb + 8 * g
                    a0, a1 = _pair8k(a0, xi, o, w0, w1, sc), _pair8k(a1, xi, o + 1, w0, w1, sc)
                    a2, a3 = _pair8k(a2, xi, o + 2, w0, w1, sc), _pair8k(a3, xi, o + 3, w0, w1, sc)
                    a4, a5 = _pair8k(a4, xi, o + 4, w0, w1, sc), _pair8k(a5, xi, o + 5, w0, w1, sc)
                    a6, a7 = _pair8k(a6, xi, o + 6, w0, w1, sc), _pair8k(a7, xi, o + 7, w0, w1, sc)
            dv, d8 = ld(dd, b * _R + r, 8), db + 8 * b
            _flush8k(a0, dv, at(dx, d8), res, r)
            _flush8k(a1, dv, at(dx, d8 + 1), res, _R + r)
            _flush8k(a2, dv, at(dx, d8 + 2), res, 2 * _R + r)
            _flush8k(a3, dv, at(dx, d8 + 3), res, 3 * _R + r)
            _flush8k(a4, dv, at(dx, d8 + 4), res, 4 * _R + r)
            _flush8k(a5, dv, at(dx, d8 + 5), res, 5 * _R + r)
            _flush8k(a6, dv, at(dx, d8 + 6), res, 6 * _R + r)
            _flush8k(a7, dv, at(dx, d8 + 7), res, 7 * _R + r)
            if has_min:  # sum_j m_j * X_j in int32 (X_j <= 32 * 127: int16), times -dmin * dx
                mv, nh = ld(dm, b * _R + r, 8), per // 2
                for t in range(8):
                    xo = pb + 8 * nh * b + t
                    m = madd(view(ld(mi, nh * b * _R + r, 8), np.int16), view(splat(at(xp, xo), 8), np.int16))
                    for h in range(1, nh):
                        m = vadd(m, madd(view(ld(mi, (nh * b + h) * _R + r, 8), np.int16),
                                         view(splat(at(xp, xo + 8 * h), 8), np.int16)))
                    o = t * _R + r
                    st(res, o, fma(cvt(m, f32), vmul(mv, splat(at(dx, d8 + t), 8)), ld(res, o, 8)))


@njit(fastmath=True)
def _by8(a, per):
    """(tokens, per) -> (tokens / 8, per, 8): each group of 8 tokens' values side by side."""
    out = np.empty_like(a)
    for t in range(a.size // per):
        o, i = (t >> 3) * (8 * per) + (t & 7), t * per
        for e in range(per):
            out[o + 8 * e] = a[i + e]
    return out


@njit(cache=True, parallel=True, fastmath=True)
def _igemm(x, ws, qtype, out, col0, narrow):
    """out[:, col0 : col0 + m] = x @ [ws[0]; ws[1]; ws[2]].T for a quantized type (as qmatmul's
    _qgemm): activations quantized in parallel over tokens, then tiles of _R rows in parallel;
    narrow: the register tiles of 8 x 8 (SMALL_TYPES only; see narrow()), the K types' with their
    scales in the integer domain (_tile8k: activations quantized per 256, as Q8_K)."""
    n, k = x.shape
    off, has_min, sb = _type_info(qtype)
    tt = _T8 if narrow else _T
    kint = narrow and (Q2_K <= qtype <= Q6_K or qtype == Q4_KX16 or qtype == Q6_KX16)  # K types (GGUF ids 10 .. 14)
    qb = 256 if kint else 32  # activation block
    npad = (n + tt - 1) // tt * tt  # padding tokens are zero: their results are dropped
    nb, nsb = k // qb, k // sb
    xq = np.empty(npad * k, np.int8)
    dx = np.empty(npad * nb, np.float32)
    xo = np.empty(npad * nsb, np.int32)
    xs = np.empty(npad * nsb, np.float32)
    for t in prange(npad):
        if t < n:  # (kint: the offset is the weights' (_tile8k), xo = the sub-blocks' sums of xq)
            _quantize_token(x, t, k, qb, sb, -1 if kint else off, xq, dx, xo, xs)
        else:
            for i in range(t * k, t * k + k):
                xq[i] = 0
            for i in range(t * nb, t * nb + nb):
                dx[i] = 0
            for i in range(t * nsb, t * nsb + nsb):
                xo[i] = 0
                xs[i] = 0
    xq4 = xq.view(np.uint32)
    if narrow:
        xi, dxi = _by8(xq4, k // 4), _by8(dx, nb)
        if kint:
            xi ^= np.uint32(0x80808080)  # + 128: unsigned, pmaddubsw's first operand
            xp = np.empty(npad * nsb // 2, np.int32)  # sub-blocks' sums of xq in int16 pairs
            for i in range(xp.size):
                xp[i] = (xo[2 * i] & 0xFFFF) | (xo[2 * i + 1] << 16)
            xp = _by8(xp, nsb // 2)
        else:
            xoi, xsi = _by8(xo, nsb), _by8(xs, nsb)
    rb = ws[0].shape[1]
    m0, m1, m2, tiles = _tiles(ws, _R)
    for item in prange(tiles):
        p, col, r0, nr = _tile_at(item, m0, m1, m2, _R, col0)
        w = ws[p]
        u = np.empty(k // 4 * _R, np.uint32)
        tmp = np.empty(k // 4 * _R, np.uint32)
        if kint:
            si, mi = np.empty(nsb * _R, np.int32), np.empty(nsb // 2 * _R, np.int32)
            dd, dm = np.empty(k // 256 * _R, np.float32), np.empty(k // 256 * _R, np.float32)
            c0 = np.empty(k // 256 * _R, np.int32)
            if qtype == Q4_KX16:
                _unpack_k4x16_int(w.reshape(-1), rb, r0, nr, k, u, si, mi, dd, dm, c0)
            elif qtype == Q6_KX16:
                _unpack_k6x16_int(w.reshape(-1), rb, r0, nr, k, u, si, mi, dd, dm, c0)
            else:
                _unpack_k8(qtype, w.reshape(-1), rb, r0, nr, k, u, si, mi, dd, dm, c0, tmp)
        else:
            s, mn = np.empty(nsb * _R, np.float32), np.empty(nsb * _R, np.float32)
            _unpack(qtype, w.reshape(-1), rb, r0, nr, k, u, s, mn, tmp)
        res = np.empty(tt * _R, np.float32)
        for g in range(npad // tt):
            if kint:
                res[:] = 0
                _tile8k(u, si, mi, dd, dm, c0, xi, dxi, xp, k, sb, has_min, g, nr, res)
            elif narrow:
                res[:] = 0
                _tile8(u, s, mn, xi, dxi, xoi, xsi, k, sb, has_min, g, nr, res)
            else:
                _tile(u, s, mn, xq4, dx, xo, xs, k, sb, has_min, g * tt, res)
            for j in range(min(tt, n - g * tt)):
                for rr in range(nr):
                    out[g * tt + j, col + r0 + rr] = res[j * _R + rr]
