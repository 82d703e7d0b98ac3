"""Matrix products on GGUF weights as they lie in the memory-mapped file.

A weight of shape (out_features, in_features) is a uint8 array w (rows, row_bytes): each row is
its in_features weights packed in the blocks of its GGML type. Nothing here dequantizes a whole
matrix; rows are decoded a block at a time, in registers.

- qmatmul(x, w, qtype): x (n, k) float32 -> (n, m) = x @ W.T; w may be a tuple of up to 3
  weights of one type (fused QKV, gate+up) whose outputs come side by side.
  Up to SMALL_N tokens (decode): memory-bound. Each weight row is read once from memory (and
  prefetched ahead in software) and dotted with the activations, quantized per call to int8 the
  way llama.cpp does (Q8_0-like blocks of 32 for the 32-element types, Q8_K-like blocks of 256
  with per-16 sums for the K types and IQ4_XS): unsigned quants x int8 activations in 512-bit
  products (vpdpbusd, pmaddubsw + vpdpwssd; the i-quants' 16-entry table is a byte shuffle,
  pshufb), four 32-element blocks or 64 K-type weights per product, the activations permuted per
  call to match the blocks' nibble order; one float FMA per 4 blocks (per 256 weights for K
  types, per 128 for IQ4_XS). Each block is decoded once for up to 4 tokens (a batch's rows).
  More tokens (prefill): compute-bound. Quantized types: int8 activations and a tile of rows
  unpacked once for integer dot products over all tokens (kernels_cpu/igemm.py). Float types: a
  tile of rows x 32 tokens accumulates over k with broadcast-FMA (float32 throughout).
- dequantize_rows(w, qtype, rows, out): float32 rows (embedding lookup), same block decoders.

Blocks are decoded in registers with the vector layer of simd.py (Vec values, @intrinsic
functions).
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
from numba import njit, prange

from edgekv import quants as qt
from edgekv.errors import EdgekvError, UnsupportedModelError
from edgekv.quants import QUANT_TYPES

from . import igemm, ops
from .layouts import (_NB_IQ4_NL, _NB_IQ4_XS, _NB_Q2_K, _NB_Q3_K, _NB_Q4_0, _NB_Q4_1, _NB_Q4_K, _NB_Q5_0, _NB_Q5_1,
                      _NB_Q5_K, _NB_Q6_K, _NB_Q8_0, _OFF_IQ4_XS, _OFF_Q2_K, _OFF_Q3_K, _OFF_Q4_K, _OFF_Q5_K, _OFF_Q6_K,
                      BF16, F16, F32, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
                      _block_iq4_nl, _block_q4_0, _block_q4_1, _block_q5_0, _block_q5_1, _block_q8_0,
                      _each_block, _half_iq4_xs, _load_bf16, _load_f16, _load_f32, _pair_q2_k, _pair_q3_k, _pair_q6_k,
                      _quad_iq4_nl, _quad_q4_0, _quad_q4_1, _quad_q4_k, _quad_q5_0, _quad_q5_1, _quad_q5_k, _quad_q8_0,
                      _scales_iq4_xs, _scales_k4_dot, _scales_q2_k, _scales_q3_k, _scales_q6_k, _tile_at, _tiles,
                      X16, Q4_0X16, Q4_1X16, Q8_0X16, Q4_KX16, Q6_KX16, _K4D, _K4Q, _K4U, _K6P, _K6U, k4x16_block,
                      k4x16_scales, k6_line, k6_scales, _quants_k6x16, _scales_k6x16, repack_x16, repack_x16_k4,
                      repack_x16_k6, x16_at, x16_block, x16_fits, x16_geometry)
from .ops import _KERNEL, _gelu_mul_1d, _rmsnorm_row, _silu_mul_1d
from .simd import (_PMADDUBSW, _VPDPBUSD, PMADDUBSW_DOTS, add_kept, at, cat, cvt, dot4, dot4acc, dot4acc_biased,
                   dot4acc_small, dot8acc_biased, dot8acc_small, fma, fma_kept, hmax, hsum, lane, ld, ld_f16, madd,
                   madd_acc, maddubs, maddubs2_acc, mul_kept, opaque, prefetch, shuffler, shuffler2, splat, st, vabs,
                   vadd, vmax, vmul, vmul_kept, vrint, vsub, h2f, vand, view, vsar, vshr, vxor, word, ZEN)

SUPPORTED = qt.CPU_TYPES
_FLOAT_TYPES = qt.FLOAT_TYPES

# What a matmul does to its input first (qmatmul's `pre`): nothing, rmsnorm, or a gated activation.
PRE = {None: 0, "norm": 1, "silu": 2, "gelu": 3}
PRE_NONE, PRE_NORM, PRE_SILU, PRE_GELU = 0, 1, 2, 3
_PF = 4096  # decode: bytes of weights prefetched ahead (1024 streamed at 0.89x of 4096 in a 7B model)
_X16_TOK = 4 if 64 in _VPDPBUSD else 2  # X16 tokens a pass (AVX2: 4 tokens' sums spill its 16 ymm)
_PF_X16 = 8192  # the same for the X16 layouts, 2 or more tokens (4096 streamed at ~0.85x); none for one
# Q4_KX16: 4096 ahead for 2 or more tokens (one 11008 x 4096 matrix streamed at 2 threads: 2 tokens
# 16 -> 34 GB/s), none for one (26 with, 28-30 without, as the GGUF rows' 29-30)
_PF_K4X16 = 4096
# K-type GGUF rows (_k_pass), one token: none on AMD Zen, whose own prefetcher keeps up with a
# row's stream there, while software prefetch on top held Q6_K back (11008 x 4096, 2 threads, the
# host's fast minutes: 47.5 GB/s without, 39.5 with, plain read 53; the same ~32 in its slow
# minutes); on Sapphire Rapids the hardware prefetcher stops at each 4 KiB page (12-16 GB/s
# without, 24-26 with). 2 or more tokens: _PF everywhere (Zen, 4096 x 11008 Q6_K streamed, 2 / 4
# / 8 tokens: 2.24 / 2.56 / 4.17 ms without, 1.27 / 1.60 / 3.08 with).
_PF_K = 0 if ZEN else _PF
_CHUNK = 16  # decode: rows per parallel work item (the type is dispatched once per item)
_ROWS = 6  # prefill register tile: _ROWS rows x _TOK tokens = 12 accumulators of 16 lanes
_TOK = 32

f32, i16, i32 = np.float32, np.int16, np.int32

# Compile time: numba's own inlining (inline="always") copies and retypes a function's IR at each
# call site, and a decode row function inlines the same small dot step dozens of times (tokens x
# halves x tile sizes x types). The X16 rows' leaf steps (_x16_token, _x16_half, AVX2's
# _x16_q8_rows8 and _x16_nib_rows8) are plain functions: compiled once, inlined by LLVM all the
# same (no slower in bench/kernels-style timings); _qmatvec's cold compile went from 257 s to
# 116 s (bench/RESULTS.md). The 32-element steps stay inline: as plain functions (103 s) Q5_1's
# batched tokens lost their one-token bits.


# Prefill on integer products where vpdpbusd exists; without it (AVX2) for the types whose quants
# pmaddubsw takes (igemm.SMALL_TYPES), while Q8_0 and the IQ4 types keep float FMAs there (an
# exact emulation of vpdpbusd is slower than them). EDGEKV_PREFILL=float (or float_prefill())
# keeps float prefill: to measure a cache's own effect, since int8 activations add a rounding of
# their own (KL ~0.003 against float activations, as llama.cpp's do).
INT8_PREFILL = bool(_VPDPBUSD or 32 in _PMADDUBSW) and os.environ.get("EDGEKV_PREFILL", "") != "float"


def int8_prefill(qtype: int) -> bool:
    """Whether a prefill product of this type runs on int8 activations (the GEMM of igemm.py)."""
    return INT8_PREFILL and qtype not in _FLOAT_TYPES and (bool(_VPDPBUSD) or igemm.small(qtype))
# Up to this many tokens: integer dots on rows read once (decode). Measured crossovers: ~8 tokens
# against the float prefill tiles, ~16-24 against the int8 GEMM (which unpacks every tile first);
# on AVX2 (11008 x 4096, 2 threads) ~13-16 against either (Q6_K's GEMM: beyond 16).
SMALL_N = 15


@contextlib.contextmanager
def float_prefill():
    """Float32 prefill products inside the block (process-wide: for measurements)."""
    global INT8_PREFILL
    was, INT8_PREFILL = INT8_PREFILL, False
    try:
        yield
    finally:
        INT8_PREFILL = was


def kernel_paths() -> str:
    """The CPU kernels' code paths on this machine, in words (`edgekv info`, bench headers)."""
    dots = ("AVX-512 VNNI vpdpbusd" if 64 in _VPDPBUSD else "AVX-VNNI vpdpbusd" if _VPDPBUSD else
            "AVX2 pmaddubsw" if 32 in _PMADDUBSW else "generic integer vectors")
    pre = ("float32 FMA tiles (" + ("EDGEKV_PREFILL=float" if _VPDPBUSD or _PMADDUBSW else "no int8 products") + ")"
           if not INT8_PREFILL else f"int8 GEMM ({dots})" if _VPDPBUSD else
           f"int8 GEMM ({dots}) for Q4/Q5/K types, float32 FMA tiles for Q8_0 and IQ4")
    return f"decode int8 dots ({dots}); prefill {pre}"


# ---------------------------------------------------------------------------------------------
# Activation quantization (per call, per token row).
# ---------------------------------------------------------------------------------------------
@njit(cache=True, fastmath=True)
def _quantize_q8(x, bs, xq, xd, xsum, bsum):
    """x (k,) -> xq (k,) int8, xd (k/bs,) scale per block of bs,
    xsum (k/bs,) = xd * sum of the block's xq, bsum (k/16,) int sums of xq per 16 (K types).
    16 lanes at a time (bs is 32 or 256): a decode call's serial part, before its parallel region."""
    for b in range(x.size // bs):
        o = b * bs
        m = splat(f32(0), 16)
        for i in range(o, o + bs, 16):
            m = vmax(m, vabs(ld(x, i, 16)))
        amax = hmax(m)
        d = amax / f32(127)
        inv = f32(127) / amax if amax > 0 else f32(0)
        total = i32(0)
        for i in range(o, o + bs, 16):
            q = cvt(vrint(vmul(ld(x, i, 16), inv)), np.int32)
            st(xq, i, cvt(q, np.int8))
            s = hsum(q)
            bsum[i // 16] = s
            total += s
        xd[b] = d
        xsum[b] = d * f32(total)


_ACT_LO = shuffler2(*[32 * j + i for j in range(4) for i in range(16)])  # (a, b): the group's 128 bytes
_ACT_HI = shuffler2(*[32 * j + 16 + i for j in range(4) for i in range(16)])
_SPREAD4 = shuffler(*[j for j in range(4) for _ in range(4)])
_ACT_K_LO = shuffler2(*range(32), *range(64, 96))
_ACT_K_HI = shuffler2(*range(32, 64), *range(96, 128))


@njit(fastmath=True, inline="always")
def _acts_k4(xq, k, t):
    """Token t's int8 activations (at t * k) in the order of _quad_q4_k's lanes: in each 128,
    elements 0-31, 64-95, then 32-63, 96-127 (bsum, taken before, stays in natural order)."""
    for g in range(k // 128):
        o = t * k + 128 * g
        a, b = ld(xq, o, 64), ld(xq, o + 64, 64)
        st(xq, o, _ACT_K_LO(a, b))
        st(xq, o + 64, _ACT_K_HI(a, b))


@njit(fastmath=True, inline="always")
def _acts_quad(xq, off, k, t, xoff):
    """Token t's int8 activations (at t * k) rearranged for the products of the quad layout
    (_dot_32, IQ4_XS): in each group of 128, element i < 16 of sub-block j of 32 at 16j + i, the
    rest at 64 + 16j + i. xoff = -off * the sums of the xq that a lane of the products covers
    (16 a group; in natural order, 8 per block of 32, past the last whole group)."""
    xo = t * k
    ones = splat(np.uint8(1), 64)
    for g in range(k // 128):
        o = xo + 128 * g
        a, b = ld(xq, o, 64), ld(xq, o + 64, 64)
        lo, hi = _ACT_LO(a, b), _ACT_HI(a, b)
        st(xq, o, lo)
        st(xq, o + 64, hi)
        st(xoff, (xo >> 2) + 16 * g, vmul(dot8acc_small(splat(np.int32(0), 16), ones, lo, ones, hi), -off))
    for i in range((xo >> 2) + 32 * (k // 128), (xo >> 2) + k // 4, 8):
        st(xoff, i, vmul(dot4acc_small(splat(np.int32(0), 8), splat(np.uint8(1), 32), ld(xq, 4 * i, 32)), -off))


# ---------------------------------------------------------------------------------------------
# Row dot products (decode), one loop per family, specialized on the decoder passed in (the loops
# are inlined: a decoder argument must not outlive compilation). Arrays are flat and addressed by
# offsets (a view per row would cost atomic reference counting per row; so would an inlined
# helper taking arrays inside the block loop, where numba cannot prune the counts): w holds all
# rows, the row starts at byte ro; the token's activations (from _quantize_q8, permuted by
# _acts_quad) start at xo in x and xq, at xo / 4 in xoff, and at bo in the per-block arrays.
# ---------------------------------------------------------------------------------------------
@njit(fastmath=True, inline="always")
def _dot_float(w, ro, x, xo, k, load):
    a0 = splat(f32(0), 16)
    a1 = splat(f32(0), 16)
    i = 0
    while i + 32 <= k:
        a0 = fma(load(w, ro, i, 16), ld(x, xo + i, 16), a0)
        a1 = fma(load(w, ro, i + 16, 16), ld(x, xo + i + 16, 16), a1)
        i += 32
    acc = hsum(vadd(a0, a1))
    while i < k:  # rows whose length is not a multiple of 32
        acc += hsum(load(w, ro, i, 1)) * at(x, xo + i)
        i += 1
    return acc


@njit(fastmath=True, inline="always")
def _dot_32(w, ro, xq, xo, xd, xsum, xoff, bo, nb, block, quad, nbytes, has_min, small):
    # Groups of 4 blocks (quad): two 512-bit products started from xoff's -off * (sums of 4 xq),
    # so that they yield sum((q - off) * xq) in 4 lanes per block, times d and the activations'
    # xd spread to the block's lanes (a copy per lane in memory read slower at large k: 33 KB
    # of activations a row at k = 11008). Groups alternate between two accumulators (one would
    # make each group wait for the last FMA).
    acc0, acc1, am0, am1 = _zeros_32()
    ng = nb // 4
    for g in range(ng):
        lo, hi, d, m = _fetch_32(w, ro + 4 * nbytes * g, quad, nbytes)
        acc0, am0 = _group_32(lo, hi, d, m, xq, xo, xd, xsum, xoff, bo, g, acc0, am0, has_min, small)
        acc0, acc1 = acc1, acc0  # the next group adds to the other one
        am0, am1 = am1, am0
    mins = f32(0)
    tail = splat(f32(0), 8)
    for b in range(ng * 4, nb):  # the last nb % 4 blocks, in natural order
        q, off, d, m = block(w, ro + nbytes * b)
        tail, mins = _block_32(q, d, m, xq, xo, xd, xsum, xoff, bo, b, tail, mins, small)
    return _total_32(acc0, acc1, am0, am1, tail, mins)


@njit(fastmath=True, inline="always")
def _dot_32x2(w, ro, xq, xo, yo, xd, xsum, xoff, bo, co, nb, block, quad, nbytes, has_min, small):
    """_dot_32 for two tokens (activations at xo, bo and at yo, co) from one unpacking of each
    weight group: each token's sums are _dot_32's, in its order, so each result has its bits."""
    acc0, acc1, am0, am1 = _zeros_32()
    bcc0, bcc1, bm0, bm1 = _zeros_32()
    ng = nb // 4
    for g in range(ng):
        lo, hi, d, m = _fetch_32(w, ro + 4 * nbytes * g, quad, nbytes)
        acc0, am0 = _group_32(lo, hi, d, m, xq, xo, xd, xsum, xoff, bo, g, acc0, am0, has_min, small)
        bcc0, bm0 = _group_32(lo, hi, d, m, xq, yo, xd, xsum, xoff, co, g, bcc0, bm0, has_min, small)
        acc0, acc1, am0, am1 = acc1, acc0, am1, am0
        bcc0, bcc1, bm0, bm1 = bcc1, bcc0, bm1, bm0
    mins, nins = f32(0), f32(0)
    tail = splat(f32(0), 8)
    bail = splat(f32(0), 8)
    for b in range(ng * 4, nb):
        q, off, d, m = block(w, ro + nbytes * b)
        tail, mins = _block_32(q, d, m, xq, xo, xd, xsum, xoff, bo, b, tail, mins, small)
        bail, nins = _block_32(q, d, m, xq, yo, xd, xsum, xoff, co, b, bail, nins, small)
    return _total_32(acc0, acc1, am0, am1, tail, mins), _total_32(bcc0, bcc1, bm0, bm1, bail, nins)


@njit(fastmath=True, inline="always")
def _pass_2x4(w, ro, rb, xq, xo, k, xd, xsum, xoff, bo, nb, quad, nbytes, par, scr, so, small):
    """One of _dot_32's two group accumulators (groups par, par + 2, ...) of the rows at ro and
    ro + rb for the tokens at xo, xo + k, ... (blocks at bo, bo + nb, ...), stored to scr at so
    (row-major 2 x 4, 16 lanes each): each group unpacked once for the 4 tokens, each token's
    activations and scales loaded once for both rows (LLVM shares them)."""
    a0, a1, a2, a3 = _zeros_32()  # row 0, tokens 0..3
    b0, b1, b2, b3 = _zeros_32()  # row 1
    for g in range(par, nb // 4, 2):
        o = ro + 4 * nbytes * g
        if par == 0:  # both groups of each pair, for both rows
            for p in range(0, 8 * nbytes, 64):
                prefetch(w, o + _PF + p)
                prefetch(w, o + rb + _PF + p)
        lo, hi, d, m = quad(w, o)
        lp, hp, dp, mp = quad(w, o + rb)
        a0, _ = _group_32(lo, hi, d, m, xq, xo, xd, xsum, xoff, bo, g, a0, a0, False, small)
        b0, _ = _group_32(lp, hp, dp, mp, xq, xo, xd, xsum, xoff, bo, g, b0, b0, False, small)
        a1, _ = _group_32(lo, hi, d, m, xq, xo + k, xd, xsum, xoff, bo + nb, g, a1, a1, False, small)
        b1, _ = _group_32(lp, hp, dp, mp, xq, xo + k, xd, xsum, xoff, bo + nb, g, b1, b1, False, small)
        a2, _ = _group_32(lo, hi, d, m, xq, xo + 2 * k, xd, xsum, xoff, bo + 2 * nb, g, a2, a2, False, small)
        b2, _ = _group_32(lp, hp, dp, mp, xq, xo + 2 * k, xd, xsum, xoff, bo + 2 * nb, g, b2, b2, False, small)
        a3, _ = _group_32(lo, hi, d, m, xq, xo + 3 * k, xd, xsum, xoff, bo + 3 * nb, g, a3, a3, False, small)
        b3, _ = _group_32(lp, hp, dp, mp, xq, xo + 3 * k, xd, xsum, xoff, bo + 3 * nb, g, b3, b3, False, small)
    _store8(scr, so, a0, a1, a2, a3, b0, b1, b2, b3)


@njit(fastmath=True, inline="always")
def _mins_2x4(w, ro, rb, xsum, bo, nb, quad, nbytes, par, scr, so):
    """_pass_2x4 for one of _dot_32's two minimum accumulators (types with a min)."""
    a0, a1, a2, a3 = _zeros_32()
    b0, b1, b2, b3 = _zeros_32()
    for g in range(par, nb // 4, 2):
        o = ro + 4 * nbytes * g
        m = quad(w, o)[3]
        mp = quad(w, o + rb)[3]
        a0, b0 = _min_32(m, xsum, bo, g, a0), _min_32(mp, xsum, bo, g, b0)
        a1, b1 = _min_32(m, xsum, bo + nb, g, a1), _min_32(mp, xsum, bo + nb, g, b1)
        a2, b2 = _min_32(m, xsum, bo + 2 * nb, g, a2), _min_32(mp, xsum, bo + 2 * nb, g, b2)
        a3, b3 = _min_32(m, xsum, bo + 3 * nb, g, a3), _min_32(mp, xsum, bo + 3 * nb, g, b3)
    _store8(scr, so, a0, a1, a2, a3, b0, b1, b2, b3)


@njit(fastmath=True, inline="always")
def _store8(scr, so, a0, a1, a2, a3, b0, b1, b2, b3):
    st(scr, so, a0)
    st(scr, so + 16, a1)
    st(scr, so + 32, a2)
    st(scr, so + 48, a3)
    st(scr, so + 64, b0)
    st(scr, so + 80, b1)
    st(scr, so + 96, b2)
    st(scr, so + 112, b3)


@njit(fastmath=True, inline="always")
def _tile_2x4(w, ro, rb, xq, xo, k, xd, xsum, xoff, bo, nb, block, quad, nbytes, has_min, small, out, t, c, scr):
    """out[t : t + 4, c : c + 2] for the rows at ro, ro + rb and tokens t .. t + 3 (at xo, bo),
    each _dot_32's result with its bits: one pass per accumulator of _dot_32 (even groups, odd
    groups; then the mins' two) keeps 8 accumulators live, not 32 (in 32 registers), their sums
    parked in scr (4 x 8 x 16 float32)."""
    for par in range(2):
        _pass_2x4(w, ro, rb, xq, xo, k, xd, xsum, xoff, bo, nb, quad, nbytes, par, scr, 128 * par, small)
    z = splat(f32(0), 16)
    for par in range(2):
        if has_min:
            _mins_2x4(w, ro, rb, xsum, bo, nb, quad, nbytes, par, scr, 256 + 128 * par)
        else:
            _store8(scr, 256 + 128 * par, z, z, z, z, z, z, z, z)
    for i in range(8):  # (row, token) of the tile: the last blocks and the total
        r, j = ro + rb * (i // 4), i % 4
        y, yb = xo + j * k, bo + j * nb
        mins = f32(0)
        tail = splat(f32(0), 8)
        for b in range(nb // 4 * 4, nb):
            q, off, d, m = block(w, r + nbytes * b)
            tail, mins = _block_32(q, d, m, xq, y, xd, xsum, xoff, yb, b, tail, mins, small)
        out[t + j, c + i // 4] = _total_32(ld(scr, 16 * i, 16), ld(scr, 128 + 16 * i, 16), ld(scr, 256 + 16 * i, 16),
                                           ld(scr, 384 + 16 * i, 16), tail, mins)


@njit(fastmath=True, inline="always")
def _zeros_32():
    """_dot_32's accumulators: two for the groups' products, two for their minimums."""
    z = splat(f32(0), 16)
    return z, z, z, z


@njit(fastmath=True, inline="always")
def _fetch_32(w, o, quad, nbytes):
    """The group of 4 blocks at byte o unpacked (lo, hi, d, m), the stream prefetched _PF bytes
    ahead of it (the hardware prefetcher stops at each 4 KiB page)."""
    for p in range(0, 4 * nbytes, 64):
        prefetch(w, o + _PF + p)
    return quad(w, o)


@njit(inline="always")
def _dots8(small, acc, a0, b0, a1, b1):
    """acc + dot4(a0, b0) + dot4(a1, b1) for small quants (Q4 / Q5 nibbles, < 32: without VNNI 3
    products where the exact form takes 4 + widening), else for biased signed ones (Q8_0,
    IQ4_NL: their bias left out where simd.PMADDUBSW_DOTS, see _acts_off)."""
    return dot8acc_small(acc, a0, b0, a1, b1) if small else dot8acc_biased(acc, a0, b0, a1, b1)


@njit(fastmath=True, inline="always")
def _group_32(lo, hi, d, m, xq, xo, xd, xsum, xoff, bo, g, acc, am, has_min, small):
    """One token's share of group g (its 4 blocks unpacked: lo, hi, d, m) added to acc, am."""
    xg = xo + 128 * g
    i = _dots8(small, ld(xoff, (xo >> 2) + 16 * g, 16), lo, ld(xq, xg, 64), hi, ld(xq, xg + 64, 64))
    acc = fma(cvt(i, np.float32), vmul_kept(d, _SPREAD4(ld(xd, bo + 4 * g, 4))), acc)
    if has_min:
        am = _min_32(m, xsum, bo, g, am)
    return acc, am


@njit(fastmath=True, inline="always")
def _min_32(m, xsum, bo, g, am):
    return fma(m, _SPREAD4(ld(xsum, bo + 4 * g, 4)), am)


@njit(fastmath=True, inline="always")
def _block_32(q, d, m, xq, xo, xd, xsum, xoff, bo, b, tail, mins, small):
    """One token's share of a last block b (past the whole groups) added to tail, mins."""
    if small:
        i = dot4acc_small(ld(xoff, (xo >> 2) + 8 * b, 8), q, ld(xq, xo + 32 * b, 32))
    else:
        i = dot4acc_biased(ld(xoff, (xo >> 2) + 8 * b, 8), q, ld(xq, xo + 32 * b, 32))
    p = cvt(i, np.float32)
    return fma(p, splat(mul_kept(d, at(xd, bo + b)), 8), tail), add_kept(mins, mul_kept(m, at(xsum, bo + b)))


@njit(fastmath=True, inline="always")
def _total_32(acc0, acc1, am0, am1, tail, mins):
    # 4 lanes a block; the scalar sums in this order wherever this is inlined (simd.add_kept)
    return add_kept(add_kept(hsum(vadd(vadd(acc0, acc1), vmul(vadd(am0, am1), f32(0.25)))), hsum(tail)), mins)


# sc (16 lanes, one per sub-block of 16) -> the int16 scale of each pair sum of pair i (32 lanes)
_SCQ0, _SCQ1, _SCQ2, _SCQ3 = (shuffler(*[4 * i + j // 8 for j in range(32)]) for i in range(4))
# the same for the halves of Q4_K / Q5_K (_quad_q4_k) from one lane per sub-block of 32: chunks
# (c, c + 2) for c = 0, 1, 4, 5
_SCN0, _SCN1, _SCN2, _SCN3 = (shuffler(*[c + j // 16 * 2 for j in range(32)]) for c in (0, 1, 4, 5))
# float scales fs (16 lanes, sub-block j of 32 at 2j) -> the scale of each lane of half h's
# products in the quad layout (IQ4_XS: sub-blocks 4h..4h+3, 4 lanes each)
_SCH0, _SCH1 = (shuffler(*[2 * (4 * h + j) for j in range(4) for _ in range(4)]) for h in range(2))
_LO8 = shuffler(*range(8))
_HI8 = shuffler(*range(8, 16))
_DM = shuffler(*[0] * 8, *[1] * 8)  # (d, dmin) -> 8 lanes of each


@njit(fastmath=True, inline="always")
def _k_token(v0, v1, v2, v3, s0, s1, s2, s3, so, mn, dm, d, xq, xb, xdb, bsum, bi, off, has_min, acc, dacc):
    """One token's share of a super-block decoded once (_k_pass): its quants v0..v3 (64 unsigned
    bytes each, elements 64i.. or the halves of _quad_q4_k) times the int8 activations at xb,
    int32 sums times the int16 scales s0..s3 in two chains (pmaddubsw, vpdpwssd), the offset's
    share so (-off * scales) times the activations' per-16 sums, then one float FMA (with mins:
    sums and mins side by side times d * xd and dmin * xd)."""
    ia = madd(maddubs(v0, ld(xq, xb, 64)), s0)
    ib = madd(maddubs(v1, ld(xq, xb + 64, 64)), s1)
    ia = madd_acc(ia, maddubs(v2, ld(xq, xb + 128, 64)), s2)
    ib = madd_acc(ib, maddubs(v3, ld(xq, xb + 192, 64)), s3)
    ia = vadd(ia, ib)
    bs = ld(bsum, 16 * bi, 16)
    ia8 = vadd(_LO8(ia), _HI8(ia))
    if off:
        ia8 = vadd(ia8, madd(so, bs))
    if has_min:
        return acc, fma(cvt(cat(ia8, madd(mn, bs)), np.float32), _DM(vmul(dm, xdb)), dacc)
    return fma(cvt(ia8, np.float32), splat(d * xdb, 8), acc), dacc


@njit(fastmath=True, inline="always")
def _k_wide(lo0, hi0, lo1, hi1, scf, d, xq, xb, xoff, xob, xdb, fa):
    """_k_token for quants past 127 (IQ4_XS's, up to 241: pmaddubsw's pair sums would saturate):
    exact sums of 4 (vpdpbusd) started from xoff's -off * (sums of xq), in the quad layout the
    activations were permuted to (_acts_quad), times the float scales into fa, a half at a time."""
    fs = vmul(scf, d * xdb)
    i = dot4acc(dot4acc(ld(xoff, xob, 16), lo0, ld(xq, xb, 64)), hi0, ld(xq, xb + 64, 64))
    fa = fma(cvt(i, np.float32), _SCH0(fs), fa)
    i = dot4acc(dot4acc(ld(xoff, xob + 16, 16), lo1, ld(xq, xb + 128, 64)), hi1, ld(xq, xb + 192, 64))
    return fma(cvt(i, np.float32), _SCH1(fs), fa)


@njit(fastmath=True, inline="always")
def _k_total(acc, dacc, fa):
    return hsum(acc) + hsum(fa) + hsum(_LO8(dacc)) - hsum(_HI8(dacc))


@njit(fastmath=True, inline="always")
def _k_pass(w, ro, xq, k, xd, bsum, xoff, t, nt, nb, scales, pair, nbytes, off, has_min, dm_at, nib, wide, out, c):
    """out[t : t + nt, c] (nt 1, 2 or 4 tokens from t) for the K-type row at byte ro: each super-
    block decoded once for the tokens, each token's sums in the same order whatever nt is (the
    bits it gets alone). The sub-block scales are small integers: int32 sums over the super-block,
    one float FMA per 256 weights (_k_token; IQ4_XS's float scales one per 128, _k_wide). pair(w,
    o, i) -> 64 weights, or `nib` (Q4_K, Q5_K) the halves of _quad_q4_k with sc one lane per 32,
    or `wide` (IQ4_XS) its halves. Offsets and mins per super-block, 8 lanes of 2 sub-blocks; with
    mins (dmin at byte dm_at after d) sums and mins share one FMA. The weight stream is prefetched
    _PF bytes ahead for 2 or more tokens, _PF_K for one."""
    z8, z16 = splat(f32(0), 8), splat(f32(0), 16)
    a0, a1, a2, a3 = z8, z8, z8, z8
    m0, m1, m2, m3 = z16, z16, z16, z16
    f0, f1, f2, f3 = z16, z16, z16, z16
    xo, bo = t * k, t * nb
    pf = _PF if nt > 1 else _PF_K
    for b in range(nb):
        o = ro + b * nbytes
        if pf:
            for p in range(0, nbytes, 64):
                prefetch(w, o + pf + p)
        d, dmin, sc, mn = scales(w, o)
        xb = xo + 256 * b
        if wide:
            lo0, hi0 = pair(w, o, 0)
            lo1, hi1 = pair(w, o, 1)
            scf = cvt(sc, np.float32)
            xob = (xo >> 2) + 32 * b
            f0 = _k_wide(lo0, hi0, lo1, hi1, scf, d, xq, xb, xoff, xob, at(xd, bo + b), f0)
            if nt > 1:
                f1 = _k_wide(lo0, hi0, lo1, hi1, scf, d, xq, xb + k, xoff, xob + k // 4, at(xd, bo + nb + b), f1)
            if nt > 2:
                f2 = _k_wide(lo0, hi0, lo1, hi1, scf, d, xq, xb + 2 * k, xoff, xob + k // 2, at(xd, bo + 2 * nb + b), f2)
                f3 = _k_wide(lo0, hi0, lo1, hi1, scf, d, xq, xb + 3 * k, xoff, xob + 3 * k // 4, at(xd, bo + 3 * nb + b),
                             f3)
        else:
            sc = opaque(sc)
            if nib:  # Q4_K, Q5_K: pair(w, o, h) -> the (lo, hi) of half h (_quad_q4_k), sc per 32
                v0, v1 = pair(w, o, 0)
                v2, v3 = pair(w, o, 1)
                s0, s1, s2, s3 = _SCN0(sc), _SCN1(sc), _SCN2(sc), _SCN3(sc)
            else:
                v0, v1, v2, v3 = pair(w, o, 0), pair(w, o, 1), pair(w, o, 2), pair(w, o, 3)
                s0, s1, s2, s3 = _SCQ0(sc), _SCQ1(sc), _SCQ2(sc), _SCQ3(sc)
            so = vmul(sc, -off)
            mn16 = cvt(mn, np.int16)
            dm = ld_f16(w, o + dm_at, 2)
            a0, m0 = _k_token(v0, v1, v2, v3, s0, s1, s2, s3, so, mn16, dm, d, xq, xb, at(xd, bo + b), bsum, bo + b,
                              off, has_min, a0, m0)
            if nt > 1:
                a1, m1 = _k_token(v0, v1, v2, v3, s0, s1, s2, s3, so, mn16, dm, d, xq, xb + k, at(xd, bo + nb + b),
                                  bsum, bo + nb + b, off, has_min, a1, m1)
            if nt > 2:
                a2, m2 = _k_token(v0, v1, v2, v3, s0, s1, s2, s3, so, mn16, dm, d, xq, xb + 2 * k,
                                  at(xd, bo + 2 * nb + b), bsum, bo + 2 * nb + b, off, has_min, a2, m2)
                a3, m3 = _k_token(v0, v1, v2, v3, s0, s1, s2, s3, so, mn16, dm, d, xq, xb + 3 * k,
                                  at(xd, bo + 3 * nb + b), bsum, bo + 3 * nb + b, off, has_min, a3, m3)
    out[t, c] = _k_total(a0, m0, f0)
    if nt > 1:
        out[t + 1, c] = _k_total(a1, m1, f1)
    if nt > 2:
        out[t + 2, c] = _k_total(a2, m2, f2)
        out[t + 3, c] = _k_total(a3, m3, f3)


@njit(fastmath=True, inline="always")
def _rows_32(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col, block, quad, nbytes, has_min, small):
    nb = k // 32
    n4 = n // 4 * 4  # tokens in tiles of 4 on pairs of rows (_tile_2x4), the rest in pairs and alone
    r2 = r0
    if n4:  # (one token allocates nothing: 16 rows of it are ~1 us)
        r2 = r0 + (r1 - r0) // 2 * 2
        scr = np.empty(512, np.float32)  # _tile_2x4's sums
        for r in range(r0, r2, 2):
            for t in range(0, n4, 4):
                _tile_2x4(w, r * rb, rb, xq, t * k, k, xd, xsum, xoff, t * nb, nb, block, quad, nbytes, has_min, small,
                          out, t, col + r, scr)
    for r in range(r0, r1):
        t = n4 if r < r2 else 0
        while t + 2 <= n:  # tokens in pairs: each weight group unpacked once for both
            out[t, col + r], out[t + 1, col + r] = _dot_32x2(w, r * rb, xq, t * k, t * k + k, xd, xsum, xoff, t * nb,
                                                             t * nb + nb, nb, block, quad, nbytes, has_min, small)
            t += 2
        if t < n:
            out[t, col + r] = _dot_32(w, r * rb, xq, t * k, xd, xsum, xoff, t * nb, nb, block, quad, nbytes, has_min,
                                      small)


@njit(fastmath=True)
def _x16_token(v, ds, ms, xq, xo, xd, xsum, xoff, bt, f, has_min, small):
    """One token's share of a block of 16 repacked rows (v: 8 vectors of their quants as unsigned
    bytes, v[s] at k = 4s .. 4s+3 of the block; ds, ms: 16 scales and mins) added to f: the
    block's 8 sums of 4 on broadcast activations (_dots32), started from -off * the block's sum
    of xq (xoff), then one scale (and min) per lane."""
    # (small: nibbles; else Q8_0's bytes + 128, the bias left to xoff or out: _dots8)
    b0, b1, b2, b3 = _bx(xq, xo), _bx(xq, xo + 4), _bx(xq, xo + 8), _bx(xq, xo + 12)
    b4, b5, b6, b7 = _bx(xq, xo + 16), _bx(xq, xo + 20), _bx(xq, xo + 24), _bx(xq, xo + 28)
    i = _dots32(small, splat(at(xoff, bt), 16), v, b0, b1, b2, b3, b4, b5, b6, b7)
    return _x16_scale(i, ds, ms, xd, xsum, bt, f, has_min)


@njit(fastmath=True, inline="always")
def _x16_scale(i, ds, ms, xd, xsum, bt, f, has_min):
    """f + a block's integer sums i (a lane a row) times the rows' scales ds and the token's xd[bt]
    (and Q4_1's mins ms times xsum[bt]): the float step of the Q4_0X16 / Q4_1X16 loops, AVX-512
    and AVX2, so each token gets the same bits whichever loop ran it (fma_kept, vmul_kept: one
    rounding each, no reassociation)."""
    f = fma_kept(cvt(i, f32), vmul_kept(ds, at(xd, bt)), f)
    return fma_kept(ms, at(xsum, bt), f) if has_min else f


@njit(inline="always")
def _dots32(small, acc, v, b0, b1, b2, b3, b4, b5, b6, b7):
    """acc + a block's sums of 4 (v: its 8 vectors of quants, b0 .. b7 the broadcast activations).
    Nibbles on AVX2: the 8 pmaddubsw pair sums added in int16 (< 8 x 2 x 15 x 127 < 2**15), one
    pmaddwd (one token: 5-9% faster than pairs, bench/RESULTS.md); otherwise two chains of pairs
    (_dots8: two vpdpbusd with VNNI). Integer sums: the same bits either way. One expression: an
    early return for this branch in _x16_token kept numba's incref / decref calls there (4x slower)."""
    return (vadd(madd(_sum16(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], b0, b1, b2, b3, b4, b5, b6, b7),
                      splat(np.int16(1), 32)), acc)
            if small and PMADDUBSW_DOTS else
            vadd(_dots8(small, _dots8(small, acc, v[0], b0, v[1], b1), v[2], b2, v[3], b3),
                 _dots8(small, _dots8(small, splat(i32(0), 16), v[4], b4, v[5], b5), v[6], b6, v[7], b7)))


@njit(inline="always")
def _sum16(v0, v1, v2, v3, v4, v5, v6, v7, b0, b1, b2, b3, b4, b5, b6, b7):
    """AVX2: the 8 pmaddubsw of nibbles v_s (unsigned, < 16) and activations b_s added in int16
    (exact: 8 x 2 x 15 x 127 < 2**15), for _dots32 and _x16_q4_tok8."""
    return vadd(vadd(vadd(maddubs(v0, b0), maddubs(v1, b1)), vadd(maddubs(v2, b2), maddubs(v3, b3))),
                vadd(vadd(maddubs(v4, b4), maddubs(v5, b5)), vadd(maddubs(v6, b6), maddubs(v7, b7))))


@njit(inline="always")
def _bx(xq, i):
    """The 4 int8 activations at xq[i] broadcast to 64 bytes."""
    return view(splat(word(xq, i), 16), np.int8)


@njit(fastmath=True, inline="always")
def _x16_quants(w, q, qb):
    """A repacked block's quants at byte q as 8 vectors of unsigned bytes (see _x16_token)."""
    v0, v1, v2, v3 = ld(w, q, 64), ld(w, q + 64, 64), ld(w, q + 128, 64), ld(w, q + 192, 64)
    if qb == 32:  # Q8_0: int8 + 128
        v4, v5, v6, v7 = ld(w, q + 256, 64), ld(w, q + 320, 64), ld(w, q + 384, 64), ld(w, q + 448, 64)
        return (vxor(v0, 128), vxor(v1, 128), vxor(v2, 128), vxor(v3, 128),
                vxor(v4, 128), vxor(v5, 128), vxor(v6, 128), vxor(v7, 128))
    return (vand(v0, 15), vand(v1, 15), vand(v2, 15), vand(v3, 15), _hi4(v0), _hi4(v1), _hi4(v2), _hi4(v3))


@njit(inline="always")
def _hi4(v):
    return vand(view(vshr(view(v, np.uint32), 4), np.uint8), 15)


@njit(fastmath=True, inline="always")
def _x16_nib16(w, q, ds, ms, xq, xo, xd, xsum, xoff, bt, f, has_min):
    """_x16_token for one token of a Q4_0X16 / Q4_1X16 block at quants byte q, with vpdpbusd: the
    low nibbles masked (& 15), the high ones masked in place (& 240: 16 x their value, unsigned
    bytes still) in a chain of their own, shifted back by 4 (exact) before the chains add up.
    8 masks where unpacking takes 4 masks, 4 shifts and 4 more masks (one token, 4096 x 4096 from
    L3: 5-7% faster); the same integer sums, so the same bits. Tokens that share an unpacked
    block keep _x16_quants (a shift per token would eat the saving)."""
    u0, u1, u2, u3 = ld(w, q, 64), ld(w, q + 64, 64), ld(w, q + 128, 64), ld(w, q + 192, 64)
    lo = dot8acc_small(splat(at(xoff, bt), 16), vand(u0, 15), _bx(xq, xo), vand(u1, 15), _bx(xq, xo + 4))
    lo = dot8acc_small(lo, vand(u2, 15), _bx(xq, xo + 8), vand(u3, 15), _bx(xq, xo + 12))
    hi = dot8acc_small(splat(i32(0), 16), vand(u0, 240), _bx(xq, xo + 16), vand(u1, 240), _bx(xq, xo + 20))
    hi = dot8acc_small(hi, vand(u2, 240), _bx(xq, xo + 24), vand(u3, 240), _bx(xq, xo + 28))
    return _x16_scale(vadd(lo, vsar(hi, 4)), ds, ms, xd, xsum, bt, f, has_min)


@njit(fastmath=True)
def _x16_half(w, o, h, qb, has_min, xq, k, xd, xsum, xoff, t, nb, b, nt, f0, f1, f2, f3):
    """Block b (= h of the unit at byte o) of the group for the tile's nt tokens."""
    sc, q = x16_at(o, h, qb, has_min)
    ds = h2f(view(ld(w, sc, 32), np.uint16))
    ms = h2f(view(ld(w, sc + 64, 32), np.uint16)) if has_min else ds
    if nt == 1 and qb == 16 and not PMADDUBSW_DOTS:  # one token of nibbles with vpdpbusd: _x16_nib16
        return (_x16_nib16(w, q, ds, ms, xq, t * k + 32 * b, xd, xsum, xoff, t * nb + b, f0, has_min),
                f1, f2, f3)
    v = _x16_quants(w, q, qb)
    f0 = _x16_token(v, ds, ms, xq, t * k + 32 * b, xd, xsum, xoff, t * nb + b, f0, has_min, qb == 16)
    if nt > 1:
        f1 = _x16_token(v, ds, ms, xq, (t + 1) * k + 32 * b, xd, xsum, xoff, (t + 1) * nb + b, f1, has_min,
                        qb == 16)
    if nt > 2:
        f2 = _x16_token(v, ds, ms, xq, (t + 2) * k + 32 * b, xd, xsum, xoff, (t + 2) * nb + b, f2, has_min,
                        qb == 16)
        f3 = _x16_token(v, ds, ms, xq, (t + 3) * k + 32 * b, xd, xsum, xoff, (t + 3) * nb + b, f3, has_min,
                        qb == 16)
    return f0, f1, f2, f3


@njit(fastmath=True, inline="always")
def _x16_pass(w, g0, nb, qtype, xq, k, xd, xsum, xoff, t, nt, out, c):
    """out[t : t + nt, c : c + 16] for the group of 16 repacked rows at byte g0 and nt (1, 2 or 4)
    tokens from t: each block unpacked once for the tokens; each token's sums in the same order
    whatever nt is (even and odd blocks in two accumulators), so its result has one set of bits."""
    qb, unit, has_min, _, _ = x16_geometry(qtype)
    z = splat(f32(0), 16)
    e0, e1, e2, e3, o0, o1, o2, o3 = z, z, z, z, z, z, z, z
    for u in range(nb // 2):
        o = g0 + unit * u
        if nt > 1:  # one token streams a little faster without (bench/RESULTS.md), as Q4_KX16's
            for p in range(0, unit, 64):
                prefetch(w, o + _PF_X16 + p)
        e0, e1, e2, e3 = _x16_half(w, o, 0, qb, has_min, xq, k, xd, xsum, xoff, t, nb, 2 * u, nt, e0, e1, e2, e3)
        o0, o1, o2, o3 = _x16_half(w, o, 1, qb, has_min, xq, k, xd, xsum, xoff, t, nb, 2 * u + 1, nt, o0, o1, o2, o3)
    _x16_store(out, t, c, vadd(e0, o0))
    if nt > 1:
        _x16_store(out, t + 1, c, vadd(e1, o1))
    if nt > 2:
        _x16_store(out, t + 2, c, vadd(e2, o2))
        _x16_store(out, t + 3, c, vadd(e3, o3))


@njit(fastmath=True, inline="always")
def _x16_pair(wa, ga, wb, gb, nb, qtype, xq, k, xd, xsum, xoff, out, ca, cb):
    """_x16_pass for one token on two groups at once (at byte ga of wa, gb of wb), a block of each
    in turn: two streams of weights a thread keep more lines in flight than one (see _qmatvec);
    each group's sums in _x16_pass's order (the same bits)."""
    qb, unit, has_min, _, _ = x16_geometry(qtype)
    z = splat(f32(0), 16)
    ea, oa, eb, ob = z, z, z, z
    for u in range(nb // 2):
        a, b = ga + unit * u, gb + unit * u
        ea = _x16_half(wa, a, 0, qb, has_min, xq, k, xd, xsum, xoff, 0, nb, 2 * u, 1, ea, z, z, z)[0]
        eb = _x16_half(wb, b, 0, qb, has_min, xq, k, xd, xsum, xoff, 0, nb, 2 * u, 1, eb, z, z, z)[0]
        oa = _x16_half(wa, a, 1, qb, has_min, xq, k, xd, xsum, xoff, 0, nb, 2 * u + 1, 1, oa, z, z, z)[0]
        ob = _x16_half(wb, b, 1, qb, has_min, xq, k, xd, xsum, xoff, 0, nb, 2 * u + 1, 1, ob, z, z, z)[0]
    _x16_store(out, 0, ca, vadd(ea, oa))
    _x16_store(out, 0, cb, vadd(eb, ob))


@njit(fastmath=True)
def _x16_q8_rows8(w, o, h, r, xq, k, xd, xoff, t, nb, b, f0, f1):
    """AVX2, Q8_0X16: f0, f1 + rows 8r .. 8r + 7 of block b (= h of the unit at byte o) for tokens
    t and t + 1. A ymm holds 8 rows' quads: each line is loaded once and its |w| (dot4acc_biased's
    pabsb) serves both tokens, the live registers a line and the two tokens' int32 sums (16 rows'
    8 vectors held for the tokens spilled the 16 ymm: 0.8-0.9 ms a token for 49152 x 576, whatever
    the batch, bench/RESULTS.md). Then _x16_token's float steps: the same bits per row."""
    qb = x16_geometry(Q8_0X16)[0]
    sc, q = x16_at(o, h, qb, False)
    sc, q = sc + 16 * r, q + 32 * r
    xo, bt = t * k + 32 * b, t * nb + b
    i0, i1 = splat(at(xoff, bt), 8), splat(at(xoff, bt + nb), 8)
    for s in range(0, 32, 4):
        u = vxor(ld(w, q + 16 * s, 32), 128)  # quad s / 4 of the 8 rows as int8 + 128 (_x16_quants)
        i0 = dot4acc_biased(i0, u, _bx8(xq, xo + s))
        i1 = dot4acc_biased(i1, u, _bx8(xq, xo + k + s))
    ds = h2f(view(ld(w, sc, 16), np.uint16))
    f0 = fma_kept(cvt(i0, f32), vmul_kept(ds, splat(at(xd, bt), 8)), f0)
    return f0, fma_kept(cvt(i1, f32), vmul_kept(ds, splat(at(xd, bt + nb), 8)), f1)


@njit(fastmath=True, inline="always")
def _x16_q8_pair(w, g0, nb, xq, k, xd, xoff, t, out, c):
    """_x16_pass for Q8_0X16 on AVX2 and tokens t, t + 1, the group's rows 8 at a time
    (_x16_q8_rows8), each row's steps in _x16_pass's order (the same bits)."""
    unit = x16_geometry(Q8_0X16)[1]
    z = splat(f32(0), 8)
    a0, a1, b0, b1, c0, c1, d0, d1 = z, z, z, z, z, z, z, z  # even blocks: rows 0-7, 8-15; odd: c, d
    for u in range(nb // 2):
        o = g0 + unit * u
        for p in range(0, unit, 64):
            prefetch(w, o + _PF_X16 + p)
        a0, a1 = _x16_q8_rows8(w, o, 0, 0, xq, k, xd, xoff, t, nb, 2 * u, a0, a1)
        b0, b1 = _x16_q8_rows8(w, o, 0, 1, xq, k, xd, xoff, t, nb, 2 * u, b0, b1)
        c0, c1 = _x16_q8_rows8(w, o, 1, 0, xq, k, xd, xoff, t, nb, 2 * u + 1, c0, c1)
        d0, d1 = _x16_q8_rows8(w, o, 1, 1, xq, k, xd, xoff, t, nb, 2 * u + 1, d0, d1)
    _x16_store8(out, t, c, vadd(a0, c0), vadd(b0, d0))
    _x16_store8(out, t + 1, c, vadd(a1, c1), vadd(b1, d1))


@njit(fastmath=True)
def _x16_nib_rows8(w, o, h, r, has_min, xq, k, xd, xsum, xoff, t, nb, b, f0, f1, f2, f3):
    """AVX2, Q4_0X16 / Q4_1X16 (has_min): f0 .. f3 + rows 8r .. 8r + 7 of block b (= h of the unit
    at byte o) for tokens t .. t + 3: the block's 8 unpacked ymm (8 rows each) held for the 4
    tokens, each token's pmaddubsw added in int16 and one pmaddwd (as _dots32), then _x16_token's
    float steps: the same bits per row. A plain function, as _x16_q8_rows8: inlined by numba, its 4
    token steps at _x16_nib_quads' 4 sites, each inlined at _rows_x16's 3 (48 steps), were ~480 of
    _qmatvec's ~770 CPU-s of cold compile on AVX2; LLVM inlines it all the same (the same speed and
    bits, bench/RESULTS.md)."""
    qb = x16_geometry(Q4_0X16)[0]  # (Q4_1X16's too)
    sc, q = x16_at(o, h, qb, has_min)
    sc, q = sc + 16 * r, q + 32 * r
    u0, u1, u2, u3 = ld(w, q, 32), ld(w, q + 64, 32), ld(w, q + 128, 32), ld(w, q + 192, 32)
    v0, v1, v2, v3 = vand(u0, 15), vand(u1, 15), vand(u2, 15), vand(u3, 15)
    v4, v5, v6, v7 = _hi4(u0), _hi4(u1), _hi4(u2), _hi4(u3)
    ds = h2f(view(ld(w, sc, 16), np.uint16))
    ms = h2f(view(ld(w, sc + 64, 16), np.uint16)) if has_min else ds
    xo, bt = t * k + 32 * b, t * nb + b
    f0 = _x16_q4_tok8(v0, v1, v2, v3, v4, v5, v6, v7, ds, ms, has_min, xq, xo, xd, xsum, xoff, bt, f0)
    f1 = _x16_q4_tok8(v0, v1, v2, v3, v4, v5, v6, v7, ds, ms, has_min, xq, xo + k, xd, xsum, xoff, bt + nb, f1)
    f2 = _x16_q4_tok8(v0, v1, v2, v3, v4, v5, v6, v7, ds, ms, has_min, xq, xo + 2 * k, xd, xsum, xoff, bt + 2 * nb,
                      f2)
    return f0, f1, f2, _x16_q4_tok8(v0, v1, v2, v3, v4, v5, v6, v7, ds, ms, has_min, xq, xo + 3 * k, xd, xsum, xoff,
                                    bt + 3 * nb, f3)


@njit(fastmath=True, inline="always")
def _x16_q4_tok8(v0, v1, v2, v3, v4, v5, v6, v7, ds, ms, has_min, xq, xo, xd, xsum, xoff, bt, f):
    i = madd(_sum16(v0, v1, v2, v3, v4, v5, v6, v7, _bx8(xq, xo), _bx8(xq, xo + 4), _bx8(xq, xo + 8),
                    _bx8(xq, xo + 12), _bx8(xq, xo + 16), _bx8(xq, xo + 20), _bx8(xq, xo + 24), _bx8(xq, xo + 28)),
             splat(i16(1), 16))
    i = i if has_min else vadd(i, splat(at(xoff, bt), 8))  # (Q4_1's xoff is 0)
    return _x16_scale(i, ds, ms, xd, xsum, bt, f, has_min)


@njit(inline="always")
def _bx8(xq, i):
    """The 4 int8 activations at xq[i] broadcast to 32 bytes."""
    return view(splat(word(xq, i), 8), np.int8)


@njit(fastmath=True, inline="always")
def _x16_nib_quads(w, g0, nb, has_min, xq, k, xd, xsum, xoff, n, out, c):
    """_x16_pass for Q4_0X16 / Q4_1X16 on AVX2 and tokens 0 .. n - 1 in fours (n a multiple of 4),
    the group's rows 8 at a time (_x16_nib_rows8), each row's steps in _x16_pass's order (the same
    bits)."""
    unit = x16_geometry(Q4_1X16 if has_min else Q4_0X16)[1]
    z = splat(f32(0), 8)
    for t in range(0, n, 4):
        a0, a1, a2, a3, b0, b1, b2, b3 = z, z, z, z, z, z, z, z  # even blocks: rows 0-7, 8-15
        c0, c1, c2, c3, d0, d1, d2, d3 = z, z, z, z, z, z, z, z  # odd blocks
        for u in range(nb // 2):
            o = g0 + unit * u
            for p in range(0, unit, 64):
                prefetch(w, o + _PF_X16 + p)
            a0, a1, a2, a3 = _x16_nib_rows8(w, o, 0, 0, has_min, xq, k, xd, xsum, xoff, t, nb, 2 * u, a0, a1, a2, a3)
            b0, b1, b2, b3 = _x16_nib_rows8(w, o, 0, 1, has_min, xq, k, xd, xsum, xoff, t, nb, 2 * u, b0, b1, b2, b3)
            c0, c1, c2, c3 = _x16_nib_rows8(w, o, 1, 0, has_min, xq, k, xd, xsum, xoff, t, nb, 2 * u + 1, c0, c1, c2,
                                            c3)
            d0, d1, d2, d3 = _x16_nib_rows8(w, o, 1, 1, has_min, xq, k, xd, xsum, xoff, t, nb, 2 * u + 1, d0, d1, d2,
                                            d3)
        _x16_store8(out, t, c, vadd(a0, c0), vadd(b0, d0))
        _x16_store8(out, t + 1, c, vadd(a1, c1), vadd(b1, d1))
        _x16_store8(out, t + 2, c, vadd(a2, c2), vadd(b2, d2))
        _x16_store8(out, t + 3, c, vadd(a3, c3), vadd(b3, d3))


@njit(inline="always")
def _x16_store(out, t, c, v):
    for i in range(16):
        out[t, c + i] = lane(v, i)


@njit(inline="always")
def _x16_store8(out, t, c, lo, hi):
    """out[t, c : c + 16] = a group's rows 0-7 (lo) and 8-15 (hi), 8-lane halves (AVX2 forms)."""
    for i in range(8):
        out[t, c + i], out[t, c + 8 + i] = lane(lo, i), lane(hi, i)


# Defined for the machine at import: numba types and inlines a branch that cannot run all the same,
# and the AVX2 passes inlined at _rows_x16's three sites were half of _qmatvec's cold compile
# where vpdpbusd makes them dead (bench/RESULTS.md, "a first start's compile").
if PMADDUBSW_DOTS:
    @njit(fastmath=True, inline="always")
    def _x16_avx2_first(w, g0, nb, qtype, n, xq, k, xd, xsum, xoff, out, c):
        """AVX2's own passes over a group, before _x16_pass takes the rest: Q8_0X16 in pairs of
        tokens (_x16_q8_pair), Q4_0X16 / Q4_1X16 in fours (_x16_nib_quads). Returns the tokens done."""
        t = 0
        if qtype == Q8_0X16:
            while t + 2 <= n:
                _x16_q8_pair(w, g0, nb, xq, k, xd, xoff, t, out, c)
                t += 2
        elif n >= 4:
            t = n - n % 4
            _x16_nib_quads(w, g0, nb, qtype == Q4_1X16, xq, k, xd, xsum, xoff, t, out, c)
        return t
else:
    @njit(inline="always")
    def _x16_avx2_first(w, g0, nb, qtype, n, xq, k, xd, xsum, xoff, out, c):
        return 0  # vpdpbusd: _x16_pass takes every token


@njit(fastmath=True, inline="always")
def _rows_x16(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col, qtype):
    """An X16 type (layouts.py): rows r0 .. r1 - 1 (whole groups of 16) for the n tokens, _X16_TOK
    at a time, then 2, then 1 (on AVX2 first Q8_0 in pairs, Q4_0 and Q4_1 in fours: _x16_avx2_first)."""
    nb = k // 32
    for g in range(r0, r1, 16):
        t = _x16_avx2_first(w, g * rb, nb, qtype, n, xq, k, xd, xsum, xoff, out, col + g)
        while t + _X16_TOK <= n:
            _x16_pass(w, g * rb, nb, qtype, xq, k, xd, xsum, xoff, t, _X16_TOK, out, col + g)
            t += _X16_TOK
        if t + 2 <= n:
            _x16_pass(w, g * rb, nb, qtype, xq, k, xd, xsum, xoff, t, 2, out, col + g)
            t += 2
        if t < n:
            _x16_pass(w, g * rb, nb, qtype, xq, k, xd, xsum, xoff, t, 1, out, col + g)


# Q4_KX16 (layouts.py): per unit (a super-block of 16 rows) and token, 64 vpdpbusd on broadcast
# activations give each sub-block's int32 sums, times the rows' 6-bit scales in int32 (exact: the
# order of the sums cannot change a bit); the mins' sums one vpdpwssd per sub-block on the
# activations' per-16 sums; then two FMAs a unit, d * xd and dmin * xd. The nibbles are unpacked
# once for up to 4 tokens. (~3x fewer vector operations per byte, one token, than the GGUF rows' _k_pass.)
_SUB0, _SUB1, _SUB2, _SUB3 = (shuffler(*range(16 * j, 16 * j + 16)) for j in range(4))  # sub-block's 16 rows
_DUP0, _DUP1, _DUP2, _DUP3 = (shuffler(*[16 * j + r for r in range(16) for _ in range(2)]) for j in range(4))


# A sub-block's sums (16 rows x 32 products): on AVX2 pmaddubsw's int16 pair sums added over the
# whole sub-block (16 products a lane, < 16 x 15 x 128 < 2**15) and multiplied by the rows' scales
# in one pmaddwd (each row's scale in both int16 halves of its lane), as Q6_KX16: per sub-block
# and vector of 16 rows 8 pmaddubsw, 7 paddw and one pmaddwd, where sums of 4 took 4 paddw, 4
# pmaddwd by ones, 4 paddd and a vpmulld (one token from L2 1.2x, streamed 1.0-1.1x, 2-8 tokens
# 1.1-1.35x: bench/RESULTS.md; before the pairs of _k4x16_pair the same change measured 0.93x).
# With vpdpbusd: int32 sums of 4 times the scales (vpmulld). Exact integers either way.
if PMADDUBSW_DOTS:  # intrinsics, not numba-inlined functions: each of those is retyped at every call site
    _k4_dot, _k4_scaled = maddubs2_acc, madd

    @njit(inline="always")
    def _k4_zero():
        return splat(i16(0), 32)

    @njit(inline="always")
    def _k4_widen(sc03, sc47):
        return (cvt(_DUP0(sc03), i16), cvt(_DUP1(sc03), i16), cvt(_DUP2(sc03), i16), cvt(_DUP3(sc03), i16),
                cvt(_DUP0(sc47), i16), cvt(_DUP1(sc47), i16), cvt(_DUP2(sc47), i16), cvt(_DUP3(sc47), i16))
else:
    _k4_dot, _k4_scaled = dot8acc_small, vmul

    @njit(inline="always")
    def _k4_zero():
        return splat(i32(0), 16)

    @njit(inline="always")
    def _k4_widen(sc03, sc47):
        return (cvt(_SUB0(sc03), i32), cvt(_SUB1(sc03), i32), cvt(_SUB2(sc03), i32), cvt(_SUB3(sc03), i32),
                cvt(_SUB0(sc47), i32), cvt(_SUB1(sc47), i32), cvt(_SUB2(sc47), i32), cvt(_SUB3(sc47), i32))


@njit(fastmath=True)
def _k4_token(lo, hi, sl, sh, xq, xo, a):
    """a + one token's share of a Q4_KX16 chunk: lo, hi (8 vectors of 16 rows x 4 elements, the
    chunk's two sub-blocks) dotted with the activations at xo and xo + 32, times the scales sl, sh."""
    # four chains of 4 products (shorter dependencies; two chains of 8 measured the same)
    z = _k4_zero()
    i = _k4_dot(z, lo[0], _bx(xq, xo), lo[2], _bx(xq, xo + 8))
    j = _k4_dot(z, hi[0], _bx(xq, xo + 32), hi[2], _bx(xq, xo + 40))
    i2 = _k4_dot(z, lo[1], _bx(xq, xo + 4), lo[3], _bx(xq, xo + 12))
    j2 = _k4_dot(z, hi[1], _bx(xq, xo + 36), hi[3], _bx(xq, xo + 44))
    i = _k4_dot(i, lo[4], _bx(xq, xo + 16), lo[6], _bx(xq, xo + 24))
    j = _k4_dot(j, hi[4], _bx(xq, xo + 48), hi[6], _bx(xq, xo + 56))
    i2 = _k4_dot(i2, lo[5], _bx(xq, xo + 20), lo[7], _bx(xq, xo + 28))
    j2 = _k4_dot(j2, hi[5], _bx(xq, xo + 52), hi[7], _bx(xq, xo + 60))
    return vadd(a, vadd(_k4_scaled(vadd(i, i2), sl), _k4_scaled(vadd(j, j2), sh)))


@njit(fastmath=True, inline="always")
def _k4_chunk(w, q, xq, xo, k, nt, sl, sh, a0, a1, a2, a3):
    """Chunk q of a Q4_KX16 unit (its 8 lines) for the tile's nt tokens, 1 or 4 (activations at xo,
    + k ..)."""
    if nt > 1:  # 4 tokens, unpacked line by line (the chunk's 16 unpacked vectors held at once spill)
        for p in range(0, 512, 64):  # prefetches spread over the unit's chunks (see _PF_K4X16)
            prefetch(w, q + _PF_K4X16 + p)
        z = _k4_zero()
        i0, j0, i1, j1, i2, j2, i3, j3 = z, z, z, z, z, z, z, z
        for s in range(0, 8, 2):  # two lines at a time
            v, u = ld(w, q + 64 * s, 64), ld(w, q + 64 * s + 64, 64)
            lo, hi, lu, hu = vand(v, 15), _hi4(v), vand(u, 15), _hi4(u)
            x = xo + 4 * s
            i0 = _k4_dot(i0, lo, _bx(xq, x), lu, _bx(xq, x + 4))
            j0 = _k4_dot(j0, hi, _bx(xq, x + 32), hu, _bx(xq, x + 36))
            i1 = _k4_dot(i1, lo, _bx(xq, x + k), lu, _bx(xq, x + k + 4))
            j1 = _k4_dot(j1, hi, _bx(xq, x + k + 32), hu, _bx(xq, x + k + 36))
            i2 = _k4_dot(i2, lo, _bx(xq, x + 2 * k), lu, _bx(xq, x + 2 * k + 4))
            j2 = _k4_dot(j2, hi, _bx(xq, x + 2 * k + 32), hu, _bx(xq, x + 2 * k + 36))
            i3 = _k4_dot(i3, lo, _bx(xq, x + 3 * k), lu, _bx(xq, x + 3 * k + 4))
            j3 = _k4_dot(j3, hi, _bx(xq, x + 3 * k + 32), hu, _bx(xq, x + 3 * k + 36))
        # integers throughout: the same sums as _k4_token's, whatever their order
        return (vadd(a0, vadd(_k4_scaled(i0, sl), _k4_scaled(j0, sh))),
                vadd(a1, vadd(_k4_scaled(i1, sl), _k4_scaled(j1, sh))),
                vadd(a2, vadd(_k4_scaled(i2, sl), _k4_scaled(j2, sh))),
                vadd(a3, vadd(_k4_scaled(i3, sl), _k4_scaled(j3, sh))))
    v0, v1, v2, v3 = ld(w, q, 64), ld(w, q + 64, 64), ld(w, q + 128, 64), ld(w, q + 192, 64)
    v4, v5, v6, v7 = ld(w, q + 256, 64), ld(w, q + 320, 64), ld(w, q + 384, 64), ld(w, q + 448, 64)
    lo = (vand(v0, 15), vand(v1, 15), vand(v2, 15), vand(v3, 15), vand(v4, 15), vand(v5, 15), vand(v6, 15),
          vand(v7, 15))
    hi = (_hi4(v0), _hi4(v1), _hi4(v2), _hi4(v3), _hi4(v4), _hi4(v5), _hi4(v6), _hi4(v7))
    return _k4_token(lo, hi, sl, sh, xq, xo, a0), a1, a2, a3


@njit(inline="always")
def _bs2(bsum, i):
    """The activations' sums of 16 at bsum[i], bsum[i + 1] as int16 pairs in 16 lanes."""
    pair = (i32(at(bsum, i)) & 0xFFFF) | (i32(at(bsum, i + 1)) << 16)
    return view(splat(i32(pair), 16), np.int16)


@njit(fastmath=True)
def _k4_finish(a, m03, m47, d, dmin, xd, bsum, bo, f):
    """f + one token's unit: a (the sums times the scales) and the mins times the activations'
    sums (sub-block j's two at bsum[bo + 2j]), as d * xd * a - dmin * xd * mins."""
    i16 = np.int16
    mn = madd(cvt(_DUP0(m03), i16), _bs2(bsum, bo))
    mn = madd_acc(mn, cvt(_DUP1(m03), i16), _bs2(bsum, bo + 2))
    mn = madd_acc(mn, cvt(_DUP2(m03), i16), _bs2(bsum, bo + 4))
    mn = madd_acc(mn, cvt(_DUP3(m03), i16), _bs2(bsum, bo + 6))
    mn = madd_acc(mn, cvt(_DUP0(m47), i16), _bs2(bsum, bo + 8))
    mn = madd_acc(mn, cvt(_DUP1(m47), i16), _bs2(bsum, bo + 10))
    mn = madd_acc(mn, cvt(_DUP2(m47), i16), _bs2(bsum, bo + 12))
    mn = madd_acc(mn, cvt(_DUP3(m47), i16), _bs2(bsum, bo + 14))
    f = fma_kept(cvt(a, f32), vmul_kept(d, splat(xd, 16)), f)
    return fma_kept(cvt(mn, f32), vmul_kept(dmin, splat(-xd, 16)), f)


@njit(fastmath=True, inline="always")
def _k4x16_pass(w, g0, nsb, xq, k, xd, bsum, t, nt, out, c):
    """out[t : t + nt, c : c + 16] for the Q4_KX16 group at byte g0 (nsb units) and nt (1 or 4)
    tokens from t; each token's floats in the same order whatever nt is (one set of bits)."""
    z = splat(f32(0), 16)
    f0, f1, f2, f3 = z, z, z, z
    zi = splat(i32(0), 16)
    k16 = k // 16
    for b in range(nsb):
        u = g0 + _K4U * b
        if nt > 1:
            for p in range(0, _K4Q, 64):
                prefetch(w, u + _PF_K4X16 + p)
        sc03, sc47, m03, m47 = k4x16_scales(w, u)
        sc = _k4_widen(sc03, sc47)  # 8 sub-blocks' scales as _k4_scaled takes them (16 rows each)
        xo = t * k + 256 * b
        a0, a1, a2, a3 = _k4_chunk(w, u + _K4Q, xq, xo, k, nt, sc[0], sc[1], zi, zi, zi, zi)
        a0, a1, a2, a3 = _k4_chunk(w, u + _K4Q + 512, xq, xo + 64, k, nt, sc[2], sc[3], a0, a1, a2, a3)
        a0, a1, a2, a3 = _k4_chunk(w, u + _K4Q + 1024, xq, xo + 128, k, nt, sc[4], sc[5], a0, a1, a2, a3)
        a0, a1, a2, a3 = _k4_chunk(w, u + _K4Q + 1536, xq, xo + 192, k, nt, sc[6], sc[7], a0, a1, a2, a3)
        d = h2f(view(ld(w, u + _K4D, 32), np.uint16))
        dmin = h2f(view(ld(w, u + _K4D + 32, 32), np.uint16))
        bo = t * k16 + 16 * b
        f0 = _k4_finish(a0, m03, m47, d, dmin, at(xd, t * nsb + b), bsum, bo, f0)
        if nt > 1:  # 4 tokens
            f1 = _k4_finish(a1, m03, m47, d, dmin, at(xd, (t + 1) * nsb + b), bsum, bo + k16, f1)
            f2 = _k4_finish(a2, m03, m47, d, dmin, at(xd, (t + 2) * nsb + b), bsum, bo + 2 * k16, f2)
            f3 = _k4_finish(a3, m03, m47, d, dmin, at(xd, (t + 3) * nsb + b), bsum, bo + 3 * k16, f3)
    _x16_store(out, t, c, f0)
    if nt > 1:
        _x16_store(out, t + 1, c, f1)
        _x16_store(out, t + 2, c, f2)
        _x16_store(out, t + 3, c, f3)


@njit(fastmath=True, inline="always")
def _k4_half(w, q, xq, xo, i, j):
    """i, j + the low and high nibbles' sums of 4 lines of a Q4_KX16 chunk at q (a half: lines
    0-3 with the chunk's activations at xo, or 4-7 at xo + 16)."""
    v0, v1, v2, v3 = ld(w, q, 64), ld(w, q + 64, 64), ld(w, q + 128, 64), ld(w, q + 192, 64)
    i = _k4_dot(i, vand(v0, 15), _bx(xq, xo), vand(v2, 15), _bx(xq, xo + 8))
    j = _k4_dot(j, _hi4(v0), _bx(xq, xo + 32), _hi4(v2), _bx(xq, xo + 40))
    i = _k4_dot(i, vand(v1, 15), _bx(xq, xo + 4), vand(v3, 15), _bx(xq, xo + 12))
    return i, _k4_dot(j, _hi4(v1), _bx(xq, xo + 36), _hi4(v3), _bx(xq, xo + 44))


@njit(fastmath=True, inline="always")
def _k4x16_pair(wa, ga, wb, gb, nsb, xq, k, xd, bsum, out, ca, cb):
    """One token on two Q4_KX16 groups at once (at byte ga of wa, gb of wb), taking turns every
    half chunk (4 lines, 256 bytes) as _x16_pair's half blocks: one thread, 11008 x 4096 streamed,
    21.9 GB/s against 16.9 one group at a time and a plain read's 24.6 (turns of a chunk or a
    unit ran slower than one group: bench/RESULTS.md). Integer sums exact in any order, the
    floats in _k4x16_pass's: the same bits."""
    z = splat(f32(0), 16)
    zi, z4 = splat(i32(0), 16), _k4_zero()
    fa, fb = z, z
    for b in range(nsb):
        ua, ub = ga + _K4U * b, gb + _K4U * b
        # unpacked here, widened apart: a nested tuple unpacked fails numba's array analysis when
        # this loop is inlined in _qmatvec's parfor ("Dimension mismatch")
        sa03, sa47, ma03, ma47 = k4x16_scales(wa, ua)
        sb03, sb47, mb03, mb47 = k4x16_scales(wb, ub)
        sa, sb = _k4_widen(sa03, sa47), _k4_widen(sb03, sb47)
        aa, ab = zi, zi
        # a rolled loop (the scales' tuple indexed at run time): unrolled, the same work streamed
        # at half the speed on a Zen 3 core (bench/RESULTS.md, "AVX2, eighth session")
        for ch in range(4):
            xo = 256 * b + 64 * ch
            ia, ja = _k4_half(wa, ua + _K4Q + 512 * ch, xq, xo, z4, z4)
            ib, jb = _k4_half(wb, ub + _K4Q + 512 * ch, xq, xo, z4, z4)
            ia, ja = _k4_half(wa, ua + _K4Q + 512 * ch + 256, xq, xo + 16, ia, ja)
            ib, jb = _k4_half(wb, ub + _K4Q + 512 * ch + 256, xq, xo + 16, ib, jb)
            aa = vadd(aa, vadd(_k4_scaled(ia, sa[2 * ch]), _k4_scaled(ja, sa[2 * ch + 1])))
            ab = vadd(ab, vadd(_k4_scaled(ib, sb[2 * ch]), _k4_scaled(jb, sb[2 * ch + 1])))
        fa = _k4_finish(aa, ma03, ma47, h2f(view(ld(wa, ua + _K4D, 32), np.uint16)),
                        h2f(view(ld(wa, ua + _K4D + 32, 32), np.uint16)), at(xd, b), bsum, 16 * b, fa)
        fb = _k4_finish(ab, mb03, mb47, h2f(view(ld(wb, ub + _K4D, 32), np.uint16)),
                        h2f(view(ld(wb, ub + _K4D + 32, 32), np.uint16)), at(xd, b), bsum, 16 * b, fb)
    _x16_store(out, 0, ca, fa)
    _x16_store(out, 0, cb, fb)


@njit(fastmath=True, inline="always")
def _rows_kx16(w, rb, r0, r1, k, n, xq, xd, bsum, out, col, step, tile):
    """A K type's X16 rows r0 .. r1 - 1 (whole groups of 16) for the n tokens, `tile` at a time
    (step: the type's pass), then one by one."""
    nsb = k // 256
    for g in range(r0, r1, 16):
        t = 0
        while t + tile <= n:
            step(w, g * rb, nsb, xq, k, xd, bsum, t, tile, out, col + g)
            t += tile
        while t < n:
            step(w, g * rb, nsb, xq, k, xd, bsum, t, 1, out, col + g)
            t += 1


@njit(fastmath=True)
def _dot_rows_k4x16(w, rb, r0, r1, k, n, xq, xd, bsum, out, col):
    """Q4_KX16 rows in tiles of 4 tokens (from L2, 256 rows x 4096, one core: 92-115 cycles a unit
    and token in fours, 131 alone; a tile of 2 took 137-209 whichever way its lines were ordered)."""
    _rows_kx16(w, rb, r0, r1, k, n, xq, xd, bsum, out, col, _k4x16_pass, 4)


# Q6_KX16 (layouts.py): per unit, sub-block by sub-block (4 lines of 16 rows x 4 quants): the
# 6-bit quants times broadcast activations in int16 pairs (pmaddubsw; two lines' sums stay below
# 2**15: 4 x 63 x 127), times the rows' scales into int32 (pmaddwd with each row's scale in both
# halves of its lane); the offset 32 is the scales times -16 x the sub-block's activation sum in
# both halves (16 x 2032 < 2**15). One float FMA a unit (d * xd). Exact integers: one set of bits
# whatever the order or the token count. Decoding the quants is most of the work: one AND for
# 3 lines of 4, three shifts, ANDs and two ORs for the fourth (GGUF's ql / qh split took twice).
@njit(inline="always")
def _k6_off(bsum, i):
    """-16 x the activations' sum of 16 at bsum[i] in both int16 halves of 16 int32 lanes."""
    b = -16 * i32(at(bsum, i))
    return view(splat(i32((b & 0xFFFF) | (b << 16)), 16), i16)


@njit(fastmath=True)
def _k6_sub(w, u, h, i, sh, xq, xo, k, nt, bsum, bo, k16, a0, a1):
    """a0 (and a1, the next token, for nt 2) + sub-block 8 h + 2 i + sh of the Q6_KX16 unit at u,
    activations at xo (xo + k) and their sums of 16 at bsum[bo] (bo + k16). A plain function (a
    leaf, as _x16_token): inlined at its 16 call sites by numba it added 67 s to _qmatvec's cold
    compile (296 -> 363 s; as a leaf 302 s, the same speed: bench/RESULTS.md)."""
    j = 8 * h + 2 * i + sh
    q = u + _K6P + 768 * (2 * h + sh)
    xb = xo + 128 * h + 32 * i + 16 * sh
    sc = k6_scales(w, u, j)
    v0, v1 = k6_line(w, q, i), k6_line(w, q + 64, i)
    a0 = vadd(a0, madd(vadd(maddubs(v0, _bx(xq, xb)), maddubs(v1, _bx(xq, xb + 4))), sc))
    if nt > 1:
        a1 = vadd(a1, madd(vadd(maddubs(v0, _bx(xq, xb + k)), maddubs(v1, _bx(xq, xb + k + 4))), sc))
    v2, v3 = k6_line(w, q + 128, i), k6_line(w, q + 192, i)
    a0 = vadd(a0, vadd(madd(vadd(maddubs(v2, _bx(xq, xb + 8)), maddubs(v3, _bx(xq, xb + 12))), sc),
                       madd(sc, _k6_off(bsum, bo + j))))
    if nt > 1:
        a1 = vadd(a1, vadd(madd(vadd(maddubs(v2, _bx(xq, xb + k + 8)), maddubs(v3, _bx(xq, xb + k + 12))), sc),
                           madd(sc, _k6_off(bsum, bo + k16 + j))))
    return a0, a1


@njit(fastmath=True)
def _k6_sub2(wa, ua, wb, ub, h, i, sh, xq, xo, bsum, bo, aa, ab):
    """aa, ab + sub-block 8 h + 2 i + sh of one token (activations at xo, sums of 16 at bsum[bo])
    on the Q6_KX16 units at ua of wa and ub of wb (_k6_sub's steps): the broadcast activations
    and the offset made once for both, one call a sub-block (a leaf, as _k6_sub)."""
    j = 8 * h + 2 * i + sh
    qo = _K6P + 768 * (2 * h + sh)
    xb = xo + 128 * h + 32 * i + 16 * sh
    x0, x1, x2, x3 = _bx(xq, xb), _bx(xq, xb + 4), _bx(xq, xb + 8), _bx(xq, xb + 12)
    off = _k6_off(bsum, bo + j)
    sa, sb = k6_scales(wa, ua, j), k6_scales(wb, ub, j)
    qa, qb = ua + qo, ub + qo
    aa = vadd(aa, madd(vadd(maddubs(k6_line(wa, qa, i), x0), maddubs(k6_line(wa, qa + 64, i), x1)), sa))
    ab = vadd(ab, madd(vadd(maddubs(k6_line(wb, qb, i), x0), maddubs(k6_line(wb, qb + 64, i), x1)), sb))
    aa = vadd(aa, vadd(madd(vadd(maddubs(k6_line(wa, qa + 128, i), x2), maddubs(k6_line(wa, qa + 192, i), x3)), sa),
                       madd(sa, off)))
    ab = vadd(ab, vadd(madd(vadd(maddubs(k6_line(wb, qb + 128, i), x2), maddubs(k6_line(wb, qb + 192, i), x3)), sb),
                       madd(sb, off)))
    return aa, ab


@njit(fastmath=True, inline="always")
def _k6_finish(w, u, a, xd, f):
    return fma_kept(cvt(a, f32), vmul_kept(h2f(view(ld(w, u, 32), np.uint16)), splat(xd, 16)), f)


@njit(fastmath=True, inline="always")
def _k6x16_pass(w, g0, nsb, xq, k, xd, bsum, t, nt, out, c):
    """out[t : t + nt, c : c + 16] for the Q6_KX16 group at byte g0 (nsb units) and nt (1 or 2)
    tokens from t, the quants decoded once for both."""
    z, zi = splat(f32(0), 16), splat(i32(0), 16)
    f0, f1 = z, z
    k16 = k // 16
    for b in range(nsb):
        u = g0 + _K6U * b  # no software prefetch: 2-8 tokens 1.10-1.12x faster without (4096 ahead)
        a0, a1 = zi, zi
        xo, bo = t * k + 256 * b, t * k16 + 16 * b
        for p in range(4):
            h, sh = p >> 1, p & 1
            a0, a1 = _k6_sub(w, u, h, 0, sh, xq, xo, k, nt, bsum, bo, k16, a0, a1)
            a0, a1 = _k6_sub(w, u, h, 1, sh, xq, xo, k, nt, bsum, bo, k16, a0, a1)
            a0, a1 = _k6_sub(w, u, h, 2, sh, xq, xo, k, nt, bsum, bo, k16, a0, a1)
            a0, a1 = _k6_sub(w, u, h, 3, sh, xq, xo, k, nt, bsum, bo, k16, a0, a1)
        f0 = _k6_finish(w, u, a0, at(xd, t * nsb + b), f0)
        if nt > 1:
            f1 = _k6_finish(w, u, a1, at(xd, (t + 1) * nsb + b), f1)
    _x16_store(out, t, c, f0)
    if nt > 1:
        _x16_store(out, t + 1, c, f1)


@njit(fastmath=True, inline="always")
def _k6x16_pair(wa, ga, wb, gb, nsb, xq, k, xd, bsum, out, ca, cb):
    """One token on two Q6_KX16 groups at once (as _k4x16_pair), taking turns every sub-block
    (_k6_sub2): 11008 x 4096 and 4096 x 11008 streamed on two Zen 4 cores at 1.00-1.01 of a
    plain read of the same bytes at 50-60 GB/s (_k6_sub per group: 0.95-0.97). Integer sums
    exact in any order: the bits of _k6x16_pass."""
    z, zi = splat(f32(0), 16), splat(i32(0), 16)
    fa, fb = z, z
    for b in range(nsb):
        ua, ub = ga + _K6U * b, gb + _K6U * b
        aa, ab = zi, zi
        xo, bo = 256 * b, 16 * b
        for p in range(4):
            h, sh = p >> 1, p & 1
            aa, ab = _k6_sub2(wa, ua, wb, ub, h, 0, sh, xq, xo, bsum, bo, aa, ab)
            aa, ab = _k6_sub2(wa, ua, wb, ub, h, 1, sh, xq, xo, bsum, bo, aa, ab)
            aa, ab = _k6_sub2(wa, ua, wb, ub, h, 2, sh, xq, xo, bsum, bo, aa, ab)
            aa, ab = _k6_sub2(wa, ua, wb, ub, h, 3, sh, xq, xo, bsum, bo, aa, ab)
        fa = _k6_finish(wa, ua, aa, at(xd, b), fa)
        fb = _k6_finish(wb, ub, ab, at(xd, b), fb)
    _x16_store(out, 0, ca, fa)
    _x16_store(out, 0, cb, fb)


@njit(fastmath=True)
def _dot_rows_k6x16(w, rb, r0, r1, k, n, xq, xd, bsum, out, col):
    """Q6_KX16 rows in tiles of 2 tokens (AVX2's 16 ymm registers hold no more)."""
    _rows_kx16(w, rb, r0, r1, k, n, xq, xd, bsum, out, col, _k6x16_pass, 2)


@njit(fastmath=True, inline="always")
def _rows_k(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col, scales, pair, nbytes, off, has_min, dm_at, nib,
            wide):
    """A K type's GGUF rows r0 .. r1 - 1 for the n tokens, 4 at a time, then 2, then 1 (_k_pass; one
    call site: numba's inlining copies the pass at each, and three took twice the compile time)."""
    nb = k // 256
    for r in range(r0, r1):
        t = 0
        while t < n:
            nt = 4 if n - t >= 4 else (2 if n - t >= 2 else 1)
            _k_pass(w, r * rb, xq, k, xd, bsum, xoff, t, nt, nb, scales, pair, nbytes, off, has_min, dm_at, nib, wide,
                    out, col + r)
            t += nt


@njit(fastmath=True, inline="always")
def _rows_float(w, rb, r0, r1, k, n, x, out, col, load):
    for r in range(r0, r1):
        for t in range(n):
            out[t, col + r] = _dot_float(w, r * rb, x, t * k, k, load)


@njit(fastmath=True)
def _dot_rows_x16(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col):
    if qtype == Q4_0X16:
        _rows_x16(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col, Q4_0X16)
    elif qtype == Q4_1X16:
        _rows_x16(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col, Q4_1X16)
    else:
        _rows_x16(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col, Q8_0X16)


def _rows_32_of(block, quad, nbytes, has_min, small):
    """_rows_32 for one type, compiled apart: inlined at _dot_rows_32's six sites, the one
    function was 150-180 s of _qmatvec's cold compile (numba's passes grow faster than a
    function's size); apart, the six take ~60 s in all. A dispatcher passed as an argument to a
    compiled function instead would keep _qmatvec out of the disk cache (a dynamic global)."""
    @njit(fastmath=True)
    def rows(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col):
        _rows_32(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col, block, quad, nbytes, has_min, small)
    return rows


# (..., has_min, small: quants < 32, which pmaddubsw takes without VNNI; see _group_32)
_rows_q4_0 = _rows_32_of(_block_q4_0, _quad_q4_0, _NB_Q4_0, False, True)
_rows_q4_1 = _rows_32_of(_block_q4_1, _quad_q4_1, _NB_Q4_1, True, True)
_rows_q5_0 = _rows_32_of(_block_q5_0, _quad_q5_0, _NB_Q5_0, False, True)
_rows_q5_1 = _rows_32_of(_block_q5_1, _quad_q5_1, _NB_Q5_1, True, True)
_rows_q8_0 = _rows_32_of(_block_q8_0, _quad_q8_0, _NB_Q8_0, False, False)
_rows_iq4_nl = _rows_32_of(_block_iq4_nl, _quad_iq4_nl, _NB_IQ4_NL, False, False)


@njit(fastmath=True)
def _dot_rows_32(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col):
    if qtype == Q4_0:
        _rows_q4_0(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col)
    elif qtype == Q4_1:
        _rows_q4_1(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col)
    elif qtype == Q5_0:
        _rows_q5_0(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col)
    elif qtype == Q5_1:
        _rows_q5_1(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col)
    elif qtype == Q8_0:
        _rows_q8_0(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col)
    else:
        _rows_iq4_nl(w, rb, r0, r1, k, n, xq, xd, xsum, xoff, out, col)


def _rows_k_of(scales, pair, nbytes, off, has_min, dm_at, nib, wide):
    """_rows_k for one type, compiled apart (as _rows_32_of)."""
    @njit(fastmath=True)
    def rows(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col):
        _rows_k(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col, scales, pair, nbytes, off, has_min, dm_at, nib, wide)
    return rows


# (..., has_min, dm_at: byte of dmin after d, nib: Q4_K / Q5_K's halves, wide: IQ4_XS; see _k_pass)
_rows_q2_k = _rows_k_of(_scales_q2_k, _pair_q2_k, _NB_Q2_K, _OFF_Q2_K, True, 80, False, False)
_rows_q3_k = _rows_k_of(_scales_q3_k, _pair_q3_k, _NB_Q3_K, _OFF_Q3_K, False, 0, False, False)
_rows_q4_k = _rows_k_of(_scales_k4_dot, _quad_q4_k, _NB_Q4_K, _OFF_Q4_K, True, 0, True, False)
_rows_q5_k = _rows_k_of(_scales_k4_dot, _quad_q5_k, _NB_Q5_K, _OFF_Q5_K, True, 0, True, False)
_rows_q6_k = _rows_k_of(_scales_q6_k, _pair_q6_k, _NB_Q6_K, _OFF_Q6_K, False, 0, False, False)
_rows_iq4_xs = _rows_k_of(_scales_iq4_xs, _half_iq4_xs, _NB_IQ4_XS, _OFF_IQ4_XS, False, 0, False, True)


@njit(fastmath=True)
def _dot_rows_k(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col):
    if qtype == Q2_K:
        _rows_q2_k(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col)
    elif qtype == Q3_K:
        _rows_q3_k(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col)
    elif qtype == Q4_K:
        _rows_q4_k(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col)
    elif qtype == Q5_K:
        _rows_q5_k(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col)
    elif qtype == Q6_K:
        _rows_q6_k(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col)
    else:
        _rows_iq4_xs(w, rb, r0, r1, k, n, xq, xd, bsum, xoff, out, col)


@njit(fastmath=True)
def _dot_rows_float(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col):
    if qtype == F32:
        _rows_float(w, rb, r0, r1, k, n, x, out, col, _load_f32)
    elif qtype == F16:
        _rows_float(w, rb, r0, r1, k, n, x, out, col, _load_f16)
    else:
        _rows_float(w, rb, r0, r1, k, n, x, out, col, _load_bf16)

@njit(fastmath=True)
def _dot_rows(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col):
    """out[:n, col + r0 : col + r1] for rows r0..r1-1 (at byte r * rb of w) and the n tokens; the
    type is dispatched once per call, outside the row loop, to one function per family (LLVM's
    time grows faster than a function's size: apart they compile in a fraction of one's time)."""
    if qtype == Q4_KX16:
        _dot_rows_k4x16(w, rb, r0, r1, k, n, xq, xd, bsum, out, col)
    elif qtype == Q6_KX16:
        _dot_rows_k6x16(w, rb, r0, r1, k, n, xq, xd, bsum, out, col)
    elif qtype > X16:
        _dot_rows_x16(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col)
    elif qtype == Q4_0 or qtype == Q4_1 or qtype == Q5_0 or qtype == Q5_1 or qtype == Q8_0 or qtype == IQ4_NL:
        _dot_rows_32(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col)
    elif qtype == F32 or qtype == F16 or qtype == BF16:
        _dot_rows_float(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col)
    else:
        _dot_rows_k(qtype, w, rb, r0, r1, k, n, x, xq, xd, xsum, bsum, xoff, out, col)


# ---------------------------------------------------------------------------------------------
# Row dequantization (prefill tiles, get_rows): dst[at : at + k] = float weights of the row at
# byte ro of w.
# ---------------------------------------------------------------------------------------------
@njit(fastmath=True, inline="always")
def _deq_float(w, ro, k, dst, at, load):
    i = 0
    while i + 16 <= k:
        st(dst, at + i, load(w, ro, i, 16))
        i += 16
    while i < k:
        dst[at + i] = hsum(load(w, ro, i, 1))
        i += 1


@njit(fastmath=True, inline="always")
def _deq_32(a, block, nbytes):
    w, ro, k, dst, at = a
    for b in range(k // 32):
        q, off, d, m = block(w, ro + nbytes * b)
        st(dst, at + 32 * b, vadd(vmul(cvt(vsub(cvt(q, np.int16), off), np.float32), d), m))


@njit(inline="always")
def _deq_chunk(w, o, c, d, dmin, sc, mn, dst, at_, quants, off):
    scale = cat(splat(lane(sc, 2 * c), 16), splat(lane(sc, 2 * c + 1), 16))
    mins = cat(splat(dmin * f32(lane(mn, 2 * c)), 16), splat(dmin * f32(lane(mn, 2 * c + 1)), 16))
    q = vmul(vsub(cvt(quants(w, o, c), np.int16), off), scale)
    st(dst, at_ + 32 * c, vsub(vmul(cvt(q, np.float32), d), mins))


@njit(fastmath=True, inline="always")
def _deq_k(a, scales, quants, nbytes, off, sb):
    w, ro, k, dst, at_ = a
    for b in range(k // 256):
        o = ro + b * nbytes
        d, dmin, sc, mn = scales(w, o)
        a = at_ + 256 * b
        _deq_chunk(w, o, 0, d, dmin, sc, mn, dst, a, quants, off)
        _deq_chunk(w, o, 1, d, dmin, sc, mn, dst, a, quants, off)
        _deq_chunk(w, o, 2, d, dmin, sc, mn, dst, a, quants, off)
        _deq_chunk(w, o, 3, d, dmin, sc, mn, dst, a, quants, off)
        _deq_chunk(w, o, 4, d, dmin, sc, mn, dst, a, quants, off)
        _deq_chunk(w, o, 5, d, dmin, sc, mn, dst, a, quants, off)
        _deq_chunk(w, o, 6, d, dmin, sc, mn, dst, a, quants, off)
        _deq_chunk(w, o, 7, d, dmin, sc, mn, dst, a, quants, off)


@njit(fastmath=True)
def _dequant_row(qtype, w, ro, k, dst, at):
    if qtype == F32:
        _deq_float(w, ro, k, dst, at, _load_f32)
    elif qtype == F16:
        _deq_float(w, ro, k, dst, at, _load_f16)
    elif qtype == BF16:
        _deq_float(w, ro, k, dst, at, _load_bf16)
    elif qtype == Q4_KX16:  # as _deq_chunk computes it: the same bits as the GGUF rows
        rb = k // 256 * _NB_Q4_K
        for b in range(k // 32):
            q, d, dmin, sc, m = k4x16_block(w, rb, ro // rb, b)
            st(dst, at + 32 * b, vsub(vmul(cvt(vmul(cvt(q, np.int16), sc), np.float32), d), dmin * f32(m)))
    elif qtype == Q6_KX16:  # the GGUF decoders on the repacked bytes: the same bits
        _deq_k(((w, k // 256 * _NB_Q6_K), ro, k, dst, at), _scales_k6x16, _quants_k6x16, _NB_Q6_K, _OFF_Q6_K, 16)
    elif qtype > X16:
        rb = k // 32 * x16_geometry(qtype)[3]
        for b in range(k // 32):
            q, off, d, m = x16_block(w, qtype, rb, ro // rb, b)
            st(dst, at + 32 * b, vadd(vmul(cvt(vsub(cvt(q, np.int16), off), np.float32), d), m))
    else:
        _each_block(qtype, _deq_32, _deq_k, (w, ro, k, dst, at))


# ---------------------------------------------------------------------------------------------
# Drivers: one parallel region per call.
# ---------------------------------------------------------------------------------------------
@njit(**_KERNEL)
def _prologue(x, pre, pre_w, eps, xa):
    """xa (n, k) = the matmul's input from x: x itself (PRE_NONE), rmsnorm(x) * pre_w (PRE_NORM),
    or act(x[:, :k]) * x[:, k:] (PRE_SILU, PRE_GELU: x holds gate and up side by side)."""
    k = xa.shape[1]
    for t in range(x.shape[0]):
        if pre == PRE_NORM:
            _rmsnorm_row(x, pre_w, eps, xa, t)
        elif pre == PRE_SILU:
            _silu_mul_1d(x[t, :k], x[t, k:], xa[t])
        elif pre == PRE_GELU:
            _gelu_mul_1d(x[t, :k], x[t, k:], xa[t])
        else:  # a loop: a slice assignment would compile numba's shape-mismatch message (~1 s cold)
            for j in range(k):
                xa[t, j] = x[t, j]


@njit(**_KERNEL)
def _epilogue(y, col0, m, eps, res, post_w):
    """res (n, m) += y[:, col0 : col0 + m], first normed (rmsnorm * post_w) when post_w is given."""
    for t in range(res.shape[0]):
        s = f32(1)
        if post_w.size:
            ss = 0.0  # float64, as rmsnorm
            for j in range(m):
                v = np.float64(y[t, col0 + j])
                ss += v * v
            s = f32(1.0 / np.sqrt(ss / m + eps))
            for j in range(m):
                res[t, j] += (y[t, col0 + j] * s) * post_w[j]
        else:
            for j in range(m):
                res[t, j] += y[t, col0 + j]


@njit(inline="always")
def _acts_off(qtype):
    """The quant offset the decode products' start values take out (xoff = -off * sums of xq): the
    type's, except for the biased types whose products leave it out themselves (simd.dot8acc_biased
    where PMADDUBSW_DOTS)."""
    if PMADDUBSW_DOTS and (qtype == Q8_0 or qtype == IQ4_NL or qtype == Q8_0X16):
        return 0
    return igemm._type_info(qtype)[0]


@njit(cache=True, parallel=True, fastmath=True)
def _qmatvec(x, ws, qtype, out, col0, pre, pre_w, eps, res, post_w):
    """Few tokens: out[:, col0 : col0 + m] = pre(x) @ [ws[0]; ws[1]; ws[2]].T, ws three weights of
    one type (some may have 0 rows); then, if res has rows, res += post(that). Chunks of rows in
    parallel; each row is read from memory once and stays in L1 for the n tokens. The pre/post
    steps (norm, gated activation, residual) run here, serially (a token's row is a few KB), so a
    decode step pays one call and one parallel region per matrix, not three or four."""
    n = x.shape[0]
    k = x.shape[1] // 2 if pre == PRE_SILU or pre == PRE_GELU else x.shape[1]
    xa = np.empty((n, k), np.float32)  # the matmul's input
    _prologue(x, pre, pre_w, eps, xa)
    m0, m1, rb = ws[0].shape[0], ws[1].shape[0], ws[0].shape[1]
    fam = 0 if (qtype == F32 or qtype == F16 or qtype == BF16) else (
        256 if (qtype >= Q2_K and qtype <= Q6_K) or qtype == IQ4_XS or qtype == Q4_KX16 or qtype == Q6_KX16 else (
            16 if qtype > X16 else 32))
    bs = max(fam, 32)
    nb = k // bs
    # np.empty and plain loops: under parallel=True, np.zeros would be a parallel region of its own
    xq = np.empty(n * k, np.int8)  # token t at t * k
    xd = np.empty(n * nb, np.float32)  # token t at t * nb
    xsum = np.empty(n * nb, np.float32)
    bsum = np.empty(n * (k // 16), np.int16)  # token t at t * k // 16 (|sum of 16 int8| < 2**15)
    xoff = np.empty(n * k // 4, np.int32)  # -off * (sums of xq): see _dot_32
    if fam != 0:
        for t in range(n):
            sl = slice(t * nb, t * nb + nb)
            _quantize_q8(xa[t], bs, xq[t * k : t * k + k], xd[sl], xsum[sl], bsum[t * (k // 16) : (t + 1) * (k // 16)])
    off = _acts_off(qtype)
    if fam == 16:  # X16 types: activations in order, xoff = -off * each block's sum (bsum: halves)
        for t in range(n):
            for b in range(nb):
                h = t * (k // 16) + 2 * b
                xoff[t * nb + b] = -off * (i32(bsum[h]) + i32(bsum[h + 1]))
    if fam == 32 or qtype == IQ4_XS:
        for t in range(n):
            _acts_quad(xq, off, k, t, xoff)
    if qtype == Q4_K or qtype == Q5_K:
        for t in range(n):
            _acts_k4(xq, k, t)
    xf = xa.reshape(-1)
    m0, m1, m2, tiles = _tiles(ws, _CHUNK)
    # One token of a repacked type: work item i is tiles i and i + half, a group of each in turn,
    # so a thread (OpenMP hands each a run of items) streams two runs of the weights at once: the
    # hardware prefetcher keeps more lines in flight for two streams than for one (11008 x 4096
    # Q4_0, 2 threads: ~50 vs ~44 GB/s where a plain read gives ~53; bench/RESULTS.md), when
    # they take turns every 256 bytes or so (Q4_KX16: _k4x16_pair).
    half = (tiles + 1) // 2 if n == 1 and qtype > X16 else tiles
    # The parts flattened once, and the one-token X16 pair loops inlined in the parallel loop
    # itself (not behind a helper's call): a reshape per item is a helper call that the loop
    # cannot hoist. 7B Q4_0 decode's matrices, old loop and this one layer by layer in turn:
    # 0.92 -> 0.99 of the read (bench/RESULTS.md).
    w0, w1, w2 = ws[0].reshape(-1), ws[1].reshape(-1), ws[2].reshape(-1)
    for item in prange(half):
        p, col, r0, nr = _tile_at(item, m0, m1, m2, _CHUNK, col0)
        wa = w0 if p == 0 else (w1 if p == 1 else w2)
        if half < tiles and item + half < tiles:
            p2, col2, r2, _ = _tile_at(item + half, m0, m1, m2, _CHUNK, col0)
            wb = w0 if p2 == 0 else (w1 if p2 == 1 else w2)
            if qtype == Q4_0X16:
                _x16_pair(wa, r0 * rb, wb, r2 * rb, nb, Q4_0X16, xq, k, xd, xsum, xoff, out, col + r0, col2 + r2)
            elif qtype == Q4_1X16:
                _x16_pair(wa, r0 * rb, wb, r2 * rb, nb, Q4_1X16, xq, k, xd, xsum, xoff, out, col + r0, col2 + r2)
            elif qtype == Q8_0X16:
                _x16_pair(wa, r0 * rb, wb, r2 * rb, nb, Q8_0X16, xq, k, xd, xsum, xoff, out, col + r0, col2 + r2)
            elif qtype == Q4_KX16:
                _k4x16_pair(wa, r0 * rb, wb, r2 * rb, k // 256, xq, k, xd, bsum, out, col + r0, col2 + r2)
            else:
                _k6x16_pair(wa, r0 * rb, wb, r2 * rb, k // 256, xq, k, xd, bsum, out, col + r0, col2 + r2)
        else:
            _dot_rows(qtype, wa, rb, r0, r0 + nr, k, n, xf, xq, xd, xsum, bsum, xoff, out, col)
    if res.shape[0]:
        _epilogue(out, col0, m0 + m1 + ws[2].shape[0], eps, res, post_w)


@njit(cache=True, parallel=True, fastmath=True)
def _qgemm(x, ws, qtype, out, col0):
    """Many tokens: out[:, col0 : col0 + m] = x @ W.T as _qmatvec (the pre/post steps are the
    caller's). Tokens are packed 32 to a vector group (k, 32); then tiles of _ROWS rows in parallel: decode the tile to float once (L2), and for each group of tokens
    accumulate rows x tokens in registers over k."""
    n, k = x.shape
    rb = ws[0].shape[1]
    ngroups = (n + _TOK - 1) // _TOK
    xp = np.zeros((ngroups, k, _TOK), np.float32)  # tokens packed along lanes, zero padded
    for g in prange(ngroups):  # transposed 64 columns at a time: the stores stay in L1
        for i0 in range(0, k, 64):
            for j in range(min(_TOK, n - g * _TOK)):
                for i in range(i0, min(k, i0 + 64)):
                    xp[g, i, j] = x[g * _TOK + j, i]
    xpf = xp.reshape(-1)
    m0, m1, m2, tiles = _tiles(ws, _ROWS)
    for item in prange(tiles):
        p, col, r0, nr = _tile_at(item, m0, m1, m2, _ROWS, col0)
        w = ws[p]
        wf = w.reshape(-1)
        wt = np.empty(_ROWS * k, np.float32)  # (_ROWS, k) decoded rows
        res = np.empty(_ROWS * _TOK, np.float32)  # (_ROWS, _TOK) tile results
        for rr in range(nr):
            _dequant_row(qtype, wf, (r0 + rr) * rb, k, wt, rr * k)
        wt[nr * k :] = 0  # rows past the end of the weight (their results are dropped)
        for g in range(ngroups):
            base = g * k * _TOK
            if n - g * _TOK > 16:
                _tile_32(xpf, base, wt, k, res)
            else:  # a last group of at most 16 tokens: half the work
                _tile_16(xpf, base, wt, k, res)
            for j in range(min(_TOK, n - g * _TOK)):
                for rr in range(nr):
                    out[g * _TOK + j, col + r0 + rr] = res[rr * _TOK + j]


@njit(fastmath=True, inline="always")
def _tile_32(xp, base, wt, k, res):
    """res (_ROWS, 32) = wt (_ROWS, k) @ tokens packed at xp[base:] (k, 32): 12 accumulators,
    per k two vector loads of tokens and one broadcast weight per row."""
    z = splat(f32(0), 16)
    c00, c01, c10, c11, c20, c21 = z, z, z, z, z, z
    c30, c31, c40, c41, c50, c51 = z, z, z, z, z, z
    for i in range(k):
        x0 = ld(xp, base + i * _TOK, 16)
        x1 = ld(xp, base + i * _TOK + 16, 16)
        s = splat(at(wt, i), 16)
        c00, c01 = fma(s, x0, c00), fma(s, x1, c01)
        s = splat(at(wt, k + i), 16)
        c10, c11 = fma(s, x0, c10), fma(s, x1, c11)
        s = splat(at(wt, 2 * k + i), 16)
        c20, c21 = fma(s, x0, c20), fma(s, x1, c21)
        s = splat(at(wt, 3 * k + i), 16)
        c30, c31 = fma(s, x0, c30), fma(s, x1, c31)
        s = splat(at(wt, 4 * k + i), 16)
        c40, c41 = fma(s, x0, c40), fma(s, x1, c41)
        s = splat(at(wt, 5 * k + i), 16)
        c50, c51 = fma(s, x0, c50), fma(s, x1, c51)
    st(res, 0, cat(c00, c01))
    st(res, 32, cat(c10, c11))
    st(res, 64, cat(c20, c21))
    st(res, 96, cat(c30, c31))
    st(res, 128, cat(c40, c41))
    st(res, 160, cat(c50, c51))


@njit(fastmath=True, inline="always")
def _tile_16(xp, base, wt, k, res):
    """_tile_32 for the first 16 tokens only."""
    z = splat(f32(0), 16)
    c0, c1, c2, c3, c4, c5 = z, z, z, z, z, z
    for i in range(k):
        x0 = ld(xp, base + i * _TOK, 16)
        c0 = fma(splat(at(wt, i), 16), x0, c0)
        c1 = fma(splat(at(wt, k + i), 16), x0, c1)
        c2 = fma(splat(at(wt, 2 * k + i), 16), x0, c2)
        c3 = fma(splat(at(wt, 3 * k + i), 16), x0, c3)
        c4 = fma(splat(at(wt, 4 * k + i), 16), x0, c4)
        c5 = fma(splat(at(wt, 5 * k + i), 16), x0, c5)
    st(res, 0, c0)
    st(res, 32, c1)
    st(res, 64, c2)
    st(res, 96, c3)
    st(res, 128, c4)
    st(res, 160, c5)


@njit(cache=True, parallel=True, fastmath=True)
def _dequant_rows(w, qtype, rows, k, out):
    wf, of, rb = w.reshape(-1), out.reshape(-1), w.shape[1]
    for i in prange(rows.size):
        _dequant_row(qtype, wf, rows[i] * rb, k, of, i * k)


# ---------------------------------------------------------------------------------------------
# Public API: validate, allocate, dispatch.
# ---------------------------------------------------------------------------------------------
def _check_weight(w, qtype, what="weight") -> tuple[np.ndarray, int]:
    """w as a read-only uint8 (m, row_bytes) view, and k (weights per row)."""
    qt = QUANT_TYPES.get(qtype - X16 if qtype > X16 else qtype)  # a repacked layout: its type's bytes
    if qtype not in SUPPORTED and qtype not in (Q4_0X16, Q4_1X16, Q8_0X16, Q4_KX16, Q6_KX16):
        raise UnsupportedModelError(f"qmatmul: tensor type {qt.name if qt else f'id {qtype}'} is not supported")
    if not isinstance(w, np.ndarray) or w.ndim != 2:
        raise EdgekvError(f"qmatmul: {what} must be a 2-D array, got {type(w).__name__} {getattr(w, 'shape', '')}")
    if w.dtype != np.uint8 and qtype in _FLOAT_TYPES:
        want = {F32: np.float32, F16: np.float16, BF16: np.uint16}[qtype]
        if w.dtype != want:
            raise EdgekvError(f"qmatmul: {qt.name} {what} must be uint8 or {np.dtype(want)}, got {w.dtype}")
        w = w.view(np.uint8) if w.flags.c_contiguous else w
    if w.dtype != np.uint8:
        raise EdgekvError(f"qmatmul: {what} must be raw uint8 blocks, got {w.dtype}")
    if not w.flags.c_contiguous:
        raise EdgekvError(f"qmatmul: {what} must be C-contiguous")
    if w.shape[1] % qt.block_bytes:
        raise EdgekvError(
            f"qmatmul: row of {w.shape[1]} bytes is not whole {qt.name} blocks of {qt.block_bytes} bytes"
        )
    return _readonly(w), w.shape[1] // qt.block_bytes * qt.block_elems


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: weights come as read-only memory maps, and numba compiles writable and
    read-only arrays separately; one signature per kernel keeps compile time down."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


_NO_ROWS: dict[int, np.ndarray] = {}  # row bytes -> read-only (0, row_bytes): unused fused parts
_NONE1 = np.empty(0, np.float32)  # pre_w / post_w when unused
_NONE2 = np.empty((0, 0), np.float32)  # residual when unused


class QWeight:
    """A weight checked once for qmatmul: ws, its raw parts padded to three with empty ones (the
    kernels take one tuple type), the GGML type, k inputs per row, m output rows in all."""

    __slots__ = ("ws", "qtype", "k", "m")

    def __init__(self, w, qtype: int):
        if isinstance(w, (tuple, list)):
            if not 1 <= len(w) <= 3:
                raise EdgekvError(f"qmatmul: expected one weight or a tuple of up to 3, got {len(w)}")
            parts = [_check_weight(p, qtype, f"weight {i}")[0] for i, p in enumerate(w)]
            k = _check_weight(w[0], qtype)[1]
            if any(p.shape[1] != parts[0].shape[1] for p in parts):
                raise EdgekvError("qmatmul: fused weights must have the same number of columns")
        else:
            first, k = _check_weight(w, qtype)
            parts = [first]
        rb = parts[0].shape[1]
        if rb not in _NO_ROWS:
            _NO_ROWS[rb] = _readonly(np.zeros((0, rb), np.uint8))
        self.ws = tuple(parts) + (_NO_ROWS[rb],) * (3 - len(parts))
        self.qtype, self.k, self.m = qtype, k, sum(p.shape[0] for p in parts)


def _aligned(shape: tuple[int, int]) -> np.ndarray:
    """An empty uint8 array of shape whose data starts on a 64-byte boundary (whole-line loads)."""
    n = shape[0] * shape[1]
    buf = np.empty(n + 64, np.uint8)
    o = -buf.ctypes.data % 64
    return buf[o : o + n].reshape(shape)


def packable(qtype: int, shapes) -> bool:
    """Whether pack would repack a weight of this type whose parts have these (rows, row bytes):
    with AVX-512 VNNI or AVX2's pmaddubsw (not AVX-VNNI alone: its 256-bit vpdpbusd would run the
    layout's 512-bit products in halves, unmeasured). Q6_KX16's kernel is pmaddubsw's on both (on
    AVX-512 one token streams at 95-99% of a plain read where the GGUF rows reach 84-85%)."""
    ok = 64 in _VPDPBUSD or (not _VPDPBUSD and 32 in _PMADDUBSW)  # (the latter: simd.PMADDUBSW_DOTS)
    return ok and all(x16_fits(qtype, *sh) for sh in shapes if sh[0])


def pack(qw: QWeight, alloc=_aligned) -> QWeight:
    """qw in this machine's faster decode layout where there is one, else qw itself: Q4_0, Q4_1,
    Q8_0, Q4_K and Q6_K with AVX-512 VNNI or AVX2 -> their X16 layout (layouts.py; every
    part whole groups of 16 rows and pairs of blocks). The parts are new arrays from alloc(shape) (empty uint8, 64-byte
    aligned): the caller's may be released."""
    if not packable(qw.qtype, [p.shape for p in qw.ws]):
        return qw
    parts = []
    for p in qw.ws:
        if p.shape[0]:
            d = alloc(p.shape)
            if qw.qtype == Q4_K:
                repack_x16_k4(p, d)
            elif qw.qtype == Q6_K:
                repack_x16_k6(p, d)
            else:
                repack_x16(p, d, qw.qtype)
            p = _readonly(d)
        parts.append(p)
    out = QWeight.__new__(QWeight)
    out.ws, out.qtype, out.k, out.m = tuple(parts), X16 + qw.qtype, qw.k, qw.m
    return out


def _f32(a, shape, what: str) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape and a.flags.c_contiguous):
        got = f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}"
        raise EdgekvError(f"qmatmul: {what} must be a C-contiguous float32 array of shape {shape}, got {got}")


def qmatmul(x: np.ndarray, w, qtype: int | None = None, out: np.ndarray | None = None, *, pre: str | None = None,
            pre_w: np.ndarray | None = None, eps: float = 1e-6, residual: np.ndarray | None = None,
            post_w: np.ndarray | None = None) -> np.ndarray:
    """out (n, m) float32 = pre(x) @ W.T; with `residual` (n, m): residual += post(out), returned.

    w: the raw GGUF rows of a weight with k columns, uint8 (m, row_bytes) as memory-mapped
    (F32/F16/BF16 weights may also be given as float32/float16/uint16 (m, k) arrays); or a tuple
    of up to 3 such weights of the same type and k (fused QKV, gate+up: one pass over the
    activations, no copy of the weights), whose outputs are the consecutive column ranges of out;
    or a QWeight (checked once, for repeated calls). qtype: the GGML type id.
    pre: None (x (n, k) as is), "norm" (rmsnorm(x) * pre_w, eps), "silu"/"gelu" (x (n, 2k) holds
    gate and up side by side: act(gate) * up). post_w (m,): rmsnorm the product (times post_w)
    before adding it to residual. out, if given, is filled and returned (or is the scratch for
    the product when residual is given)."""
    qw = w if isinstance(w, QWeight) else QWeight(w, qtype)
    if pre not in PRE:
        raise EdgekvError(f"qmatmul: pre must be one of {list(PRE)}, got {pre!r}")
    code = PRE[pre]
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous):
        got = f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}"
        raise EdgekvError(f"qmatmul: x must be a C-contiguous float32 (n, k) array, got {got}")
    n, kx = x.shape[0], qw.k * (2 if code >= PRE_SILU else 1)
    if x.shape[1] != kx:
        raise EdgekvError(f"qmatmul: x has {x.shape[1]} columns but the weight needs {kx}")
    if code == PRE_NORM:
        _f32(pre_w, (qw.k,), "pre_w")
    if residual is not None:
        _f32(residual, (n, qw.m), "residual")
        if post_w is not None:
            _f32(post_w, (qw.m,), "post_w")
    elif post_w is not None:
        raise EdgekvError("qmatmul: post_w needs a residual to add to")
    if out is None:
        out = np.empty((n, qw.m), np.float32)
    else:
        _f32(out, (n, qw.m), "out")
    if not x.flags.writeable:  # one signature per kernel (see _readonly): activations are writable
        x = x.copy()
    return run(qw, x, out, 0, code, _NONE1 if pre_w is None else pre_w, float(eps),
               _NONE2 if residual is None else residual, _NONE1 if post_w is None else post_w)


def run(qw: QWeight, x: np.ndarray, out: np.ndarray, col0: int, pre: int, pre_w: np.ndarray, eps: float,
        res: np.ndarray, post_w: np.ndarray) -> np.ndarray:
    """qmatmul without its checks, for a backend's hot path (a decode step calls this ~4 times a
    layer; the checks cost more than the kernel call): arguments as qmatmul checks them, pre as
    its PRE code, the unused arrays as empty ones, and the product written to columns col0 ...
    col0 + m of out (n, >= col0 + m), so parts of one fused output can come from several calls.
    Returns res if it has rows, else out."""
    n = x.shape[0]
    if n and qw.m:
        if n <= SMALL_N:
            _qmatvec(x, qw.ws, qw.qtype, out, col0, pre, pre_w, eps, res, post_w)
        else:  # prefill: the pre/post steps as their own (parallel) kernels; compute dominates
            if pre == PRE_NORM:
                x = ops.rmsnorm(x, pre_w, eps)
            elif pre:
                act = ops.silu_mul if pre == PRE_SILU else ops.gelu_mul
                x = act(np.ascontiguousarray(x[:, : qw.k]), np.ascontiguousarray(x[:, qw.k :]))
            if int8_prefill(qw.qtype):
                igemm._igemm(x, qw.ws, qw.qtype, out, col0, igemm.narrow(qw.qtype))
            else:
                _qgemm(x, qw.ws, qw.qtype, out, col0)
            if res.shape[0]:
                y = np.ascontiguousarray(out[:, col0 : col0 + qw.m])
                ops.add_(res, ops.rmsnorm(y, post_w, eps) if post_w.size else y)
    return res if res.shape[0] else out


def dequantize_rows(w: np.ndarray, qtype: int, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 (len(rows), k) of the selected rows of w (raw GGUF rows): embedding lookup."""
    w, k = _check_weight(w, qtype)
    rows = np.asarray(rows)
    if rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise EdgekvError("dequantize_rows: rows must be a 1-D integer array")
    if rows.size and (rows.min() < 0 or rows.max() >= w.shape[0]):
        raise EdgekvError(f"dequantize_rows: row index out of range [0, {w.shape[0]})")
    if out is None:
        out = np.empty((rows.size, k), np.float32)
    elif out.dtype != np.float32 or out.shape != (rows.size, k) or not out.flags.c_contiguous:
        raise EdgekvError(f"dequantize_rows: out must be a C-contiguous float32 array of shape {(rows.size, k)}")
    if rows.size:
        _dequant_rows(w, qtype, rows.astype(np.int64), k, out)
    return out
