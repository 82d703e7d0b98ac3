"""Kernels of the quantized KV cache: store, load and attention over a layer's ring in
float16, int8 or int4.

Storage of one layer's ring (cap token slots, Hkv kv heads, head dim hd, a multiple of 32);
every row (one token, one head) is quantized in groups of 32 consecutive values:

  f16:  q (cap, Hkv, hd)    float16                                      2 bytes / value
  int8: q (cap, Hkv, hd)    int8,  scale (cap, Hkv, hd//32) float16      34 bytes / 32 values
        x ~ q * d, d = f16(max|x| / 127), q = round(x / d)
  int4: q (cap, Hkv, hd//2) uint8, scale (cap, Hkv, hd//32) float16      18 bytes / 32 values
        byte i holds value 2i (low nibble) and 2i+1 (high nibble) as q + 8, q in [-8, 7];
        the step d fitted: inverse steps -8 / (f x_m), f = 0.75, 0.775, .., 1.1, x_m the
        value of largest magnitude, each give levels q with their least-squares step
        sum(xq) / sum(q^2); the one of least squared error is kept (f = 1 is llama.cpp's
        q4_0 step, d = x_m / -8)

Quantization divides by the f16-rounded scale, the one a reader multiplies by, so the
int8 error is at most d/2 per value. Keys of the int kinds are stored Hadamard-rotated
(`rotate`): the normalized Walsh-Hadamard transform over blocks of B values (B the largest
power of two dividing hd, at most 256) spreads outlier channels over their block, so a
group's scale is not set by one channel. H is orthonormal and symmetric, so q.k = (Hq).(Hk):
the caller rotates queries once and attention never un-rotates keys. Rotated values are
un-rotated once, on the attention output.

Inside attention an int4 row is used in "kernel order": within each group of 32, the 16
low nibbles (values 0, 2, .., 30) then the 16 high nibbles (1, 3, .., 31), so unpacking is
two contiguous streams with no interleaving shuffles. Queries and fresh keys/values are
gathered into that order and the output scattered back; dot products do not care.

A cache keeps these arrays as views of one record per slot (edgekv.kvkinds.KVKind.views: K, V
and their scales side by side), so a q or scale array's rows may lie further apart than its
own row; any C-contiguous array of these shapes works too.
"""
from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange

from edgekv.kvkinds import GROUP, KINDS as _SPEC, KV_KINDS as KINDS, hadamard_block

from .evict import _score_update
from .ops import _expf, _rope_token
from .simd import deq32_f16 as _deq32_f16, deq32_f16_eo as _deq32_f16_eo, deq32_i4 as _deq32_i4, deq32_i8 as _deq32_i8
from .simd import cvt, hsum, ld, narrow as _narrow, shuffler, shuffler2, splat, st, vadd, vmax, vmin, vmul, vrint, vsub
from .simd import widen as _widen


# Work (n_query * n_head * n_slot * head_dim) from which attention runs on the thread pool;
# below it waking the threads costs more than the work. Read at each call: tests patch these
# to reach every path.
KV_ATTN_PAR_MIN = 1 << 16
KV_ATTN_Q_BLOCK = 16  # queries sharing one dequantized key/value tile
KV_ATTN_SPLIT_MIN_KEYS = 256  # fewest slots per split when decode splits the ring
# tasks a split aims at: divides evenly among 1, 2, 3, 4, 6, 8, 12, 16, 24 threads (numba's omp
# prange schedules statically); a compile-time constant of _attn_core
KV_ATTN_SPLIT_TASKS = 48
KV_HADAMARD_PAR_MIN = 1 << 16  # elements from which hadamard_ runs rows in parallel

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_NEG = np.float32(-3.0e38)  # "no score yet"; finite, so no inf arithmetic is needed
SCORE_NONE = float(_NEG)  # kv_attention's scores where a query sees no key
_FM = {"nsz", "arcp", "contract", "reassoc", "afn"}
_KERNEL = dict(cache=True, error_model="numpy", fastmath=_FM)
# Quantizing stays exact IEEE (no arcp: max|x| / 127 must not become max|x| * (1/127)), so
# the stored bytes are reproducible by a plain numpy quantizer.
_EXACT = dict(cache=True, error_model="numpy")


def kv_arrays(kind: str, cap: int, n_head_kv: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed (q, scale) arrays for one of K or V of a ring of this kind. The f16 kind's
    scale is a (1, 1, 1) placeholder."""
    _check_kind(kind, head_dim)
    spec = _SPEC[kind]
    q = np.zeros((cap, n_head_kv, spec.width(head_dim)), spec.dtype)
    return q, np.zeros((cap, n_head_kv, head_dim // GROUP) if spec.quantized else (1, 1, 1), np.float16)


# --- scalar helpers -------------------------------------------------------------------


# butterflies of span h < 16 inside one vector of 16 lanes: lane j's partner is lane j ^ h; lanes
# with bit h clear take a + c (x[j] + x[j + h]), the others a - c (x[j - h] - x[j])
_FLIP1, _FLIP2, _FLIP4, _FLIP8 = (shuffler(*[j ^ h for j in range(16)]) for h in (1, 2, 4, 8))
_PICK1, _PICK2, _PICK4, _PICK8 = (shuffler2(*[j + 16 * (j & h > 0) for j in range(16)]) for h in (1, 2, 4, 8))


@njit(inline="always", **_KERNEL)
def _fwht(x, B):
    """Normalized Walsh-Hadamard transform in place on each block of B values of x (hd,)
    float32, C-contiguous (Sylvester order, the explicit matrix H_2n = [[H, H], [H, -H]] /
    sqrt(2)). B >= 32 (hadamard_block). Each value goes through the butterflies h = 1, 2, 4 ..
    in order, each one float add or subtract, then one multiply: the scalar loop's bits,
    16 lanes at a time (the spans below 16 by lane shuffles within a vector)."""
    hd = x.shape[0]
    for i in range(0, hd, 16):
        v = ld(x, i, 16)
        p = _FLIP1(v)
        v = _PICK1(vadd(v, p), vsub(p, v))
        p = _FLIP2(v)
        v = _PICK2(vadd(v, p), vsub(p, v))
        p = _FLIP4(v)
        v = _PICK4(vadd(v, p), vsub(p, v))
        p = _FLIP8(v)
        st(x, i, _PICK8(vadd(v, p), vsub(p, v)))
    h = 16
    while h < B:  # a butterfly over all of x at once: B divides hd, so blocks stay apart
        for b0 in range(0, hd, 2 * h):
            for j in range(b0, b0 + h, 16):
                a, c = ld(x, j, 16), ld(x, j + h, 16)
                st(x, j, vadd(a, c))
                st(x, j + h, vsub(a, c))
        h *= 2
    s = splat(np.float32(1.0 / math.sqrt(B)), 16)
    for i in range(0, hd, 16):
        st(x, i, vmul(ld(x, i, 16), s))


# --- row (de)quantizers ---------------------------------------------------------------
# The cores take a ring's K or V as a tuple (h, b, s): h the f16 kind's half bits as uint16
# (numba has no float16 on CPU), b the int kinds' bytes as int8 (int8 values, or int4 nibble
# pairs), s their f16 scales as uint16; the arrays a kind does not use are empty. Each is 2-d
# (cap, row stride), C-contiguous, row j starting at slot j's first head (_window): a head's
# row is at g * its width in it. One compiled core then serves every kind and every layout:
# compiling it takes seconds, a branch per row nothing.

_F16, _INT8, _INT4 = 0, 1, 2  # KINDS' order
_KIND_ID = {name: i for i, name in enumerate(KINDS)}


@njit(inline="always", **_KERNEL)
def _deq_rows(kind, h, b, s, j0, nj, g, dst):
    """Dequantize rows j0:j0+nj (kv head g) of a ring (h, b, s) into dst[:nj] (rows, hd)
    float32 C-contiguous, in kernel order. A whole tile per call: every call of a function
    taking arrays costs atomic refcount updates, too many for once per row."""
    hd = dst.shape[1]
    if kind == _F16:
        for jj in range(nj):
            base = (j0 + jj) * h.shape[1] + g * hd
            for c in range(0, hd, 32):
                _deq32_f16(h, base + c, dst, jj * hd + c)
    elif kind == _INT8:
        for jj in range(nj):
            base = (j0 + jj) * b.shape[1] + g * hd
            for gi in range(hd // 32):
                _deq32_i8(b, base + 32 * gi, _widen(s[j0 + jj, g * (hd // 32) + gi]), dst, jj * hd + 32 * gi)
    else:
        for jj in range(nj):
            base = (j0 + jj) * b.shape[1] + g * (hd // 2)
            for gi in range(hd // 32):
                _deq32_i4(b, base + 16 * gi, _widen(s[j0 + jj, g * (hd // 32) + gi]), dst, jj * hd + 32 * gi)


@njit(inline="always", **_EXACT)
def _level4(x, inv):
    """The int4 level of x (float32) at inverse step inv (float64): round, clamp to [-8, 7]."""
    return min(max(np.rint(np.float64(x) * inv), -8.0), 7.0)


@njit(inline="always", **_EXACT)
def _levels4(x, inv):
    """_level4 of 8 float64 lanes."""
    return vmin(vmax(vrint(vmul(x, inv)), splat(-8.0, 8)), splat(7.0, 8))


@njit(inline="always", **_EXACT)
def _quant_row(kind, x, ring, j, g):
    """Quantize x (hd,) float32, in original order, into row (slot j, kv head g) of ring."""
    h, b, s = ring
    hd = x.shape[0]
    if kind == _F16:
        for c in range(hd):
            h[j, g * hd + c] = _narrow(x[c])
    elif kind == _INT8:
        for gi in range(x.shape[0] // 32):
            amax = _F0
            for c in range(32 * gi, 32 * gi + 32):
                amax = max(amax, abs(x[c]))
            hs = _narrow(amax / np.float32(127.0))
            s[j, g * (hd // 32) + gi] = hs
            d = _widen(hs)
            inv = _F1 / d if d > _F0 else _F0
            for c in range(32 * gi, 32 * gi + 32):
                b[j, g * hd + c] = np.int8(min(max(np.rint(x[c] * inv), np.float32(-127.0)), np.float32(127.0)))
    else:
        for gi in range(x.shape[0] // 32):
            amax = _F0
            smax = _F0  # the value of largest magnitude, the first one on ties (as q4_0)
            for c in range(32 * gi, 32 * gi + 32):
                if abs(x[c]) > amax:
                    amax = abs(x[c])
                    smax = x[c]
            # candidates inv = -8 / (f x_m), f = 0.75, 0.775, .., 1.1; each gives levels q
            # and the least-squares d = sum(xq) / sum(q^2); keep the one of least squared
            # error, i.e. largest sum(xq)^2 / sum(q^2). The sums are exact in float64
            # (32 products of a float32 and a small integer), so any order gives the
            # same bytes as the numpy quantizer.
            # (8 float64 lanes at a time: the same products, summed exactly)
            best = -1.0
            best_inv = 0.0
            best_d = 0.0
            x0, x1 = cvt(ld(x, 32 * gi, 8), np.float64), cvt(ld(x, 32 * gi + 8, 8), np.float64)
            x2, x3 = cvt(ld(x, 32 * gi + 16, 8), np.float64), cvt(ld(x, 32 * gi + 24, 8), np.float64)
            for ci in range(15):
                cinv = -8.0 / (np.float64(smax) * (0.75 + 0.025 * ci)) if smax != _F0 else 0.0
                inv = splat(cinv, 8)
                q0, q1, q2, q3 = _levels4(x0, inv), _levels4(x1, inv), _levels4(x2, inv), _levels4(x3, inv)
                sxq = hsum(vadd(vadd(vmul(x0, q0), vmul(x1, q1)), vadd(vmul(x2, q2), vmul(x3, q3)))) + 0.0
                sqq = hsum(vadd(vadd(vmul(q0, q0), vmul(q1, q1)), vadd(vmul(q2, q2), vmul(q3, q3)))) + 0.0
                score = sxq * sxq / sqq if sqq > 0.0 else 0.0
                if score > best:
                    best = score
                    best_inv = cinv
                    best_d = sxq / sqq if sqq > 0.0 else 0.0
            s[j, g * (hd // 32) + gi] = _narrow(np.float32(best_d))
            for i in range(16):
                lo = _level4(x[32 * gi + 2 * i], best_inv)
                hi = _level4(x[32 * gi + 2 * i + 1], best_inv)
                # the int8 cast keeps the low 8 bits: the byte's pattern, as uint8 would
                b[j, g * (hd // 2) + 16 * gi + i] = np.int8((np.int32(lo) + 8) | ((np.int32(hi) + 8) << 4))


# --- Hadamard, store, load ------------------------------------------------------------


# Exact IEEE like the store: a query rotated here and a key rotated inside kv_store go
# through the same float operations.
@njit(**_EXACT)
def _hadamard_serial(x, B):
    for r in range(x.shape[0]):
        _fwht(x[r], B)


@njit(parallel=True, **_EXACT)
def _hadamard_parallel(x, B):
    for r in prange(x.shape[0]):
        _fwht(x[r], B)


def hadamard_(x: np.ndarray) -> np.ndarray:
    """x = H x in place over the last axis of x (..., hd) float32, C-contiguous, hd a
    multiple of 32: the normalized Walsh-Hadamard transform on each block of
    B = hadamard_block(hd) values. H is its own inverse. Returns x."""
    if x.dtype != np.float32 or x.ndim == 0 or not x.flags.c_contiguous:
        raise ValueError(f"hadamard_: x {x.dtype}{x.shape} must be float32 (..., hd), C-contiguous")
    hd = x.shape[-1]
    if hd == 0 or hd % GROUP:
        raise ValueError(f"hadamard_: head dim {hd} must be a positive multiple of {GROUP}")
    x2 = x.reshape(-1, hd)  # (rows, hd) view
    if x.size >= KV_HADAMARD_PAR_MIN:
        _hadamard_parallel(x2, hadamard_block(hd))
    else:
        _hadamard_serial(x2, hadamard_block(hd))
    return x


@njit(**_EXACT)
def _kv_space_core(q, k, mu, kmul, B, qo, ko):
    n, n_head, hd = q.shape
    n_head_kv = k.shape[1]
    grp = n_head // n_head_kv
    for t in range(n):
        for h in range(n_head):
            g = h // grp
            for c in range(hd):
                qo[t, h, c] = q[t, h, c] / kmul[g, c]
            _fwht(qo[t, h], B)
        for g in range(n_head_kv):
            for c in range(hd):
                ko[t, g, c] = (k[t, g, c] - mu[g, c]) * kmul[g, c]
            _fwht(ko[t, g], B)


def kv_space(q: np.ndarray, k: np.ndarray, mu: np.ndarray, kmul: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H(q / kmul), H((k - mu) * kmul)): queries q (n, H, hd) and keys k (n, Hkv, hd) float32,
    C-contiguous, moved into an int ring's key space (edgekv.backends.reference's
    query_space / key_space; query head h uses kv head h // (H // Hkv)'s kmul), in one call: the decode step
    would otherwise spend more on numpy temporaries than on the arithmetic."""
    n, n_head, hd = q.shape
    if (q.dtype != np.float32 or k.dtype != np.float32 or k.ndim != 3 or k.shape[0] != n or k.shape[2] != hd
            or n_head % k.shape[1] or mu.shape != k.shape[1:] or kmul.shape != k.shape[1:]):
        raise ValueError(f"kv_space: q {q.dtype}{q.shape}, k {k.dtype}{k.shape}, mu {mu.shape}, kmul {kmul.shape} do not fit")
    qo, ko = np.empty_like(q), np.empty_like(k)
    _kv_space_core(q, k, mu, kmul, hadamard_block(hd), qo, ko)
    return qo, ko


@njit(**_EXACT)
def _store_core(kind, x, ring, slots, rotate, B):
    n, n_head_kv, hd = x.shape
    buf = np.empty(hd, np.float32)
    for t in range(n):
        for g in range(n_head_kv):
            for c in range(hd):
                buf[c] = x[t, g, c]
            if rotate:
                _fwht(buf, B)
            _quant_row(kind, buf, ring, slots[t], g)


@njit(**_KERNEL)
def _load_core(kind, ring, slots, rotate, B, perm, out):
    n, n_head_kv, hd = out.shape
    h, b, s = ring
    buf = np.empty((1, hd), np.float32)
    for t in range(n):
        for g in range(n_head_kv):
            _deq_rows(kind, h, b, s, slots[t], 1, g, buf)
            for c in range(hd):
                out[t, g, perm[c]] = buf[0, c]
            if rotate:
                _fwht(out[t, g], B)


_perm_cache: dict[tuple[str, int], np.ndarray] = {}


def _perm(kind: str, hd: int) -> np.ndarray:
    """(hd,) int64: the original dim of each kernel-order index."""
    p = _perm_cache.get((kind, hd))
    if p is None:
        p = np.arange(hd, dtype=np.int64)
        if _SPEC[kind].per_element == 2:  # int4's nibble pairs
            i = np.arange(16)
            p = (np.arange(0, hd, GROUP)[:, None] + np.concatenate([2 * i, 2 * i + 1])[None, :]).reshape(-1)
        _perm_cache[(kind, hd)] = p
    return p


def _check_kind(kind: str, hd: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}; one of {KINDS}")
    if hd <= 0 or hd % GROUP:
        raise ValueError(f"head dim {hd} must be a positive multiple of {GROUP}")


_NO_H = np.zeros((0, 0), np.uint16)
_NO_B = np.zeros((0, 0), np.int8)
NO_SINK_BIAS = np.zeros((0, 0), np.float32)  # kv_attention's sink_bias when there is none
NO_SCORES = np.zeros((0, 0, 0), np.float32)  # kv_attention's scores when none are wanted


def _rowwise(a: np.ndarray) -> bool:
    """a (cap, n, w): each slot's n rows contiguous, slots a non-negative whole number of its rows apart
    (C-contiguous, or views of a cache's records)."""
    isz = a.itemsize
    return a.ndim == 3 and a.strides[2] == isz and a.strides[1] == a.shape[2] * isz and (
        a.shape[0] <= 1 or a.strides[0] >= a.shape[1] * a.shape[2] * isz and a.strides[0] % isz == 0)


def _ring(name: str, kind: str, qa: np.ndarray, sa: np.ndarray | None, hd: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check one of a ring's K or V against its kind; return the (h, b, s) views the cores take."""
    if qa.ndim != 3 or not _rowwise(qa):
        raise ValueError(f"{name}: ring array {qa.dtype}{qa.shape} must be 3-d (cap, n_head_kv, ...), its rows contiguous")
    cap, n_head_kv = qa.shape[:2]
    spec = _SPEC[kind]
    if qa.dtype != spec.dtype or qa.shape[2] != spec.width(hd):
        raise ValueError(f"{name}: {kind} ring array must be {np.dtype(spec.dtype)} (cap, n_head_kv, {spec.width(hd)}), "
                         f"not {qa.dtype}{qa.shape}")
    if spec.quantized and (sa is None or sa.dtype != np.float16 or sa.shape != (cap, n_head_kv, hd // GROUP)
                          or not _rowwise(sa)):
        got = "None" if sa is None else f"{sa.dtype}{sa.shape}"
        raise ValueError(f"{name}: {kind} scales must be float16 ({cap}, {n_head_kv}, {hd // GROUP}), rows contiguous, "
                         f"not {got}")
    return _views(kind, qa, sa)


def _window(a: np.ndarray, dtype) -> np.ndarray:
    """a (cap, n, w) as the cores read it: (cap, stride) C-contiguous from a's first element, row
    j at a[j]'s first row. In a cache's records a row runs on into the next fields (and the last
    into the spare record the cache keeps past them, edgekv.kvcache): the cores read only its
    first n * w elements."""
    a = a.view(dtype)
    stride = a.strides[0] // a.itemsize if a.shape[0] > 1 else a.shape[1] * a.shape[2]
    return np.lib.stride_tricks.as_strided(a, (a.shape[0], stride), (stride * a.itemsize, a.itemsize))


def _views(kind: str, qa: np.ndarray, sa: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (h, b, s) views of a ring array the cores take: f16 bits, int bytes, f16 scale bits."""
    if not _SPEC[kind].quantized:
        return _window(qa, np.uint16), _NO_B, _NO_H
    return _NO_H, _window(qa, np.int8), _window(sa, np.uint16)


def _check_slots(name: str, slots: np.ndarray, cap: int) -> None:
    if slots.dtype != np.int64 or slots.ndim != 1:
        raise ValueError(f"{name}: slots {slots.dtype}{slots.shape} must be int64 (n,)")
    if slots.shape[0] and (slots.min() < 0 or slots.max() >= cap):
        raise ValueError(f"{name}: slots must lie in [0, {cap})")


def kv_store(
    kind: str,
    x: np.ndarray,
    q_arr: np.ndarray,
    scale_arr: np.ndarray | None,
    slots: np.ndarray,
    rotate: bool,
    *,
    check: bool = True,
    ring: tuple | None = None,
) -> None:
    """Quantize x (n, Hkv, hd) float32 into ring slots (n,) int64 (distinct) of q_arr /
    scale_arr (see the module doc for layouts), Hadamard-rotating each row first when
    rotate (x itself is not changed). The f16 kind ignores scale_arr (pass anything, or
    None) and rounds x to half. Writing the slots' positions is the caller's job. check=False skips the checks (a backend's decode step,
    whose arrays the cache made: the checks cost more than storing one token); with it, ring
    may give the arrays as a kv_decode_layer pack holds them (its K or V), made once per cache."""
    if not check:
        hd = x.shape[2]
        _store_core(_KIND_ID[kind], x, ring or _views(kind, q_arr, scale_arr), slots, bool(rotate), hadamard_block(hd))
        return
    if x.dtype != np.float32 or x.ndim != 3 or not x.flags.c_contiguous:
        raise ValueError(f"kv_store: x {x.dtype}{x.shape} must be float32 (n, n_head_kv, hd), C-contiguous")
    n, n_head_kv, hd = x.shape
    _check_kind(kind, hd)
    ring = _ring("kv_store", kind, q_arr, scale_arr, hd)
    if q_arr.shape[1] != n_head_kv:
        raise ValueError(f"kv_store: x has {n_head_kv} kv heads, the ring {q_arr.shape[1]}")
    _check_slots("kv_store", slots, q_arr.shape[0])
    if slots.shape[0] != n:
        raise ValueError(f"kv_store: {slots.shape[0]} slots for {n} rows")
    if n > 1 and np.unique(slots).shape[0] != n:
        raise ValueError("kv_store: slots must be distinct (keep only each slot's last writer)")
    if n:
        _store_core(_KIND_ID[kind], x, ring, slots, bool(rotate), hadamard_block(hd))


def kv_load(kind: str, q_arr: np.ndarray, scale_arr: np.ndarray | None, slots: np.ndarray, rotate: bool) -> np.ndarray:
    """Dequantized rows of ring slots (n,) int64 -> (n, Hkv, hd) float32, un-rotated when
    rotate (the rows were stored with rotate=True). For tests and debugging."""
    if q_arr.ndim != 3:
        raise ValueError(f"kv_load: ring array {q_arr.dtype}{q_arr.shape} must be 3-d")
    hd = q_arr.shape[2] * _SPEC[kind].per_element if kind in _SPEC else 0
    _check_kind(kind, hd)
    ring = _ring("kv_load", kind, q_arr, scale_arr, hd)
    _check_slots("kv_load", slots, q_arr.shape[0])
    out = np.empty((slots.shape[0], q_arr.shape[1], hd), np.float32)
    _load_core(_KIND_ID[kind], ring, slots, bool(rotate), hadamard_block(hd), _perm(kind, hd), out)
    return out


# --- attention ------------------------------------------------------------------------
# Flash attention over two key sources: the ring (quantized, slots in any order, masked by
# position) and an optional fresh float32 batch, joined in one index space (ring slots,
# then fresh keys). A task is (query block, kv head, key split): it walks its keys in
# tiles, dequantizes each K and V tile once into float32 scratch and reuses it for every
# (query, head) row of the block, keeping a running max m, denominator l and unnormalized
# value sum acc per row. Decode (one query) splits the keys among threads and merges the
# partial softmaxes, so both threads work even when Hkv = 1.


@njit(inline="always", **_KERNEL)
def _is_exact(qp, kp, recent, exact_lo, n_first):
    """Whether a query at qp reads the key at kp from its exact copy (kv_attention's rule): the
    first n_first positions, and the last `recent` before qp from exact_lo on. Once true for a
    query, true for every earlier one."""
    return (qp - kp < recent and kp >= exact_lo) or kp < n_first


@njit(**_KERNEL)
def _attn_block(kind, q, q_sink, q_pos, kh, kb, ks, vh, vb, vs, pos, n_sink, fk, fv, fpos, scale, window, perm,
                v_rotated, B, n_ring, X, i0, i1, g0, g1, j0, j1, sp, n_split, out, pm, pl, pacc):
    """Attend queries i0:i1 of the query heads of kv heads g0:g1, one kv head after another, to
    keys j0:j1 of the joined index space (ring slots 0:n_ring, then the exact recent slots
    rk/rv, then fresh keys): split sp of n_split. Each head's rows, ordered (query, head in
    group), accumulate in acc (rows, hd) in kernel order with m, l (rows,); then they go to out
    (one split) or to pm, pl, pacc (split sp's partial softmax). The heads share one call and
    its scratch: in a decode step a head's work is a few microseconds, about what a call with
    these arguments and its allocations cost."""
    n_head, hd = q.shape[1], q.shape[2]
    grp = n_head // fk.shape[1]
    rows = (i1 - i0) * grp
    tile = max(16, min(64, 4096 // hd))  # K and V tiles of 16 KiB each stay in L1
    kt = np.empty((tile, hd), np.float32)  # (tile, hd) dequantized keys, kernel order
    vt = np.empty((tile, hd), np.float32)  # (tile, hd) values
    pr = np.empty((grp, tile), np.float32)  # (grp, tile) scores, then probabilities
    ok = np.empty(tile, np.bool_)
    qb = np.empty((rows, hd), np.float32)  # (rows, hd)
    qs = np.empty((rows if n_sink > 0 else 0, hd), np.float32)
    acc = np.empty((rows, hd), np.float32)  # (rows, hd)
    m = np.empty(rows, np.float32)
    l = np.empty(rows, np.float32)
    # the block's queries in kernel order with the softmax scale folded in; q_sink's too
    # when the keys include sink slots
    # sinks: ring slots 0:n_sink, and the exact copies of their positions (recent slots
    # 0:n_sink, fresh keys at positions < n_sink)
    has_sink = n_sink > 0
    rk, rv, rpos, recent, exact_lo, fresh_all, sb, n_first, softcap, sc = X
    has_sb = sb.shape[0] > 0
    n_obs = sc.shape[0]  # the last n_obs queries write their scores (kv_attention's scores)
    obs0 = q.shape[0] - n_obs
    n_res = rpos.shape[0]
    qmin = q_pos[i0]
    qmax = q_pos[i0]
    for i in range(i0, i1):
        qmin = min(qmin, q_pos[i])
        qmax = max(qmax, q_pos[i])
    for g in range(g0, g1):
        for r in range(rows):
            for c in range(hd):
                acc[r, c] = _F0
            m[r] = _NEG
            l[r] = _F0
        for i in range(i0, i1):
            for hh in range(grp):
                r = (i - i0) * grp + hh
                _start_row(q[i, g * grp + hh], scale, perm, qb[r])
                if has_sink:
                    _start_row(q_sink[i, g * grp + hh], scale, perm, qs[r])
        j = j0
        while j < j1:
            # source of this tile: 0 the quantized ring, 1 the exact recent slots, 2 fresh keys
            if j < n_ring:
                src, t0, end = 0, j, min(j1, n_ring)
            elif j < n_ring + n_res:
                src, t0, end = 1, j - n_ring, min(j1, n_ring + n_res)
            else:
                src, t0, end = 2, j - n_ring - n_res, j1
            nt = min(tile, end - j)
            jt = j  # the tile's first key in the joined index space
            j += nt
            n_sink_t = max(0, min(nt, n_sink - t0)) if src != 2 else 0  # sink slots in this tile
            if src == 2:  # fresh keys (ascending positions) at sink positions: the first batch's
                while n_sink_t < nt and 0 <= fpos[t0 + n_sink_t] < n_sink:
                    n_sink_t += 1
            # skip tiles no query of the block sees (empty, future, outside the window; ring slots
            # read from their exact copy by every query, as the whole ring is early in a context:
            # exact for the latest query, exact for all). A skipped tile is one whose
            # queries would all take `nv == 0` below: the same bits, without its loads.
            last = -1  # the last key of the tile a query of the block may see
            for jj in range(nt - 1, -1, -1):
                kp = pos[t0 + jj] if src == 0 else (rpos[t0 + jj] if src == 1 else fpos[t0 + jj])
                if kp >= 0 and kp <= qmax and (window == 0 or jj < n_sink_t or qmin - kp < window):
                    if src != 0 or not _is_exact(qmax, kp, recent, exact_lo, n_first):
                        last = jj
                        break
            if last < 0:
                continue
            # nor are the keys after it loaded, scored and summed (a few exact recent copies in a
            # tile of mostly empty rows: 7B int8 at 9 keys, 53 -> 38 us a layer). The four-key
            # score groups up to it stay as they were, and the softmax still runs over the
            # tile (a vector sum's order follows its length): the same bits for every key.
            nd = min(nt, last + 1 if last < n_sink_t else n_sink_t + (last - n_sink_t + 4) // 4 * 4)
            if src == 0:
                # empty slots of the tile are dequantized too (hidden keys never reach the sums)
                _deq_rows(kind, kh, kb, ks, t0, nd, g, kt)
                _deq_rows(kind, vh, vb, vs, t0, nd, g, vt)
            elif src == 1:  # f16 copies, 32 values a step (the int4 kernel order by a shuffle)
                for jj in range(nd):
                    base = ((t0 + jj) * rk.shape[1] + g) * hd
                    for c in range(0, hd, 32):
                        if kind == _INT4:
                            _deq32_f16_eo(rk, base + c, kt, jj * hd + c)
                            _deq32_f16_eo(rv, base + c, vt, jj * hd + c)
                        else:
                            _deq32_f16(rk, base + c, kt, jj * hd + c)
                            _deq32_f16(rv, base + c, vt, jj * hd + c)
            else:
                for jj in range(nd):
                    for c in range(hd):
                        kt[jj, c] = fk[t0 + jj, g, perm[c]]
                    for c in range(hd):
                        vt[jj, c] = fv[t0 + jj, g, perm[c]]
            for i in range(i0, i1):
                qp = q_pos[i]
                nv = 0
                for jj in range(nt):
                    kp = pos[t0 + jj] if src == 0 else (rpos[t0 + jj] if src == 1 else fpos[t0 + jj])
                    # sinks sit just before the window (StreamingLLM): causal, never windowed
                    vis = kp >= 0 and kp <= qp and (window == 0 or jj < n_sink_t or qp - kp < window)
                    # the first n_first positions, and the last `recent` ones from exact_lo on,
                    # are read from their exact copy (recent slots or fresh keys) and hidden in
                    # the quantized ring
                    exact = _is_exact(qp, kp, recent, exact_lo, n_first)
                    if src == 0:
                        vis = vis and not exact
                    elif src == 1 or not fresh_all:
                        vis = vis and exact
                    ok[jj] = vis
                    nv += vis
                if nv == 0:
                    continue
                for hh in range(grp):
                    r = (i - i0) * grp + hh
                    # scores, four keys per pass sharing the query loads; sinks take q_sink
                    jj = 0
                    while jj < nd:
                        if jj + 4 <= nd and jj >= n_sink_t:
                            s0 = _F0
                            s1 = _F0
                            s2 = _F0
                            s3 = _F0
                            for c in range(hd):
                                qv = qb[r, c]
                                s0 += qv * kt[jj, c]
                                s1 += qv * kt[jj + 1, c]
                                s2 += qv * kt[jj + 2, c]
                                s3 += qv * kt[jj + 3, c]
                            pr[hh, jj] = s0
                            pr[hh, jj + 1] = s1
                            pr[hh, jj + 2] = s2
                            pr[hh, jj + 3] = s3
                            jj += 4
                        else:
                            s = _F0
                            if jj < n_sink_t:
                                for c in range(hd):
                                    s += qs[r, c] * kt[jj, c]
                                if has_sb:  # sinks' share of the key offset (see kv_attention)
                                    s += sb[i, g * grp + hh] * scale
                            else:
                                for c in range(hd):
                                    s += qb[r, c] * kt[jj, c]
                            pr[hh, jj] = s
                            jj += 1
                    if softcap > _F0:  # gemma2's attention logit soft-cap, on the scaled score
                        for jj in range(nt):
                            pr[hh, jj] = softcap * np.tanh(pr[hh, jj] / softcap)
                    if i >= obs0:  # an observed query: its visible scores, for an eviction policy
                        for jj in range(nt):
                            if ok[jj]:
                                sc[i - obs0, g * grp + hh, jt + jj] = pr[hh, jj]
                    mt = _NEG
                    for jj in range(nt):
                        if ok[jj]:
                            mt = max(mt, pr[hh, jj])
                    if mt > m[r]:
                        if m[r] > _NEG:
                            alpha = _expf(m[r] - mt)
                            l[r] *= alpha
                            for c in range(hd):
                                acc[r, c] *= alpha
                        m[r] = mt
                    mr = m[r]
                    lsum = _F0
                    for jj in range(nt):
                        p = _expf(pr[hh, jj] - mr) if ok[jj] else _F0
                        pr[hh, jj] = p
                        lsum += p
                    l[r] += lsum
                # values: two heads per pass share the value loads, four keys per pass the
                # acc loads and stores; hidden keys are skipped, not multiplied by 0 (stale scratch)
                for hh in range(0, grp, 2):
                    r = (i - i0) * grp + hh
                    pair = hh + 1 < grp
                    jj = 0
                    while jj < nd:
                        if jj + 4 <= nd and ok[jj] and ok[jj + 1] and ok[jj + 2] and ok[jj + 3]:
                            p0, p1, p2, p3 = pr[hh, jj], pr[hh, jj + 1], pr[hh, jj + 2], pr[hh, jj + 3]
                            if pair:
                                u0, u1, u2, u3 = pr[hh + 1, jj], pr[hh + 1, jj + 1], pr[hh + 1, jj + 2], pr[hh + 1, jj + 3]
                                for c in range(hd):
                                    v0, v1, v2, v3 = vt[jj, c], vt[jj + 1, c], vt[jj + 2, c], vt[jj + 3, c]
                                    acc[r, c] += p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3
                                    acc[r + 1, c] += u0 * v0 + u1 * v1 + u2 * v2 + u3 * v3
                            else:
                                for c in range(hd):
                                    acc[r, c] += p0 * vt[jj, c] + p1 * vt[jj + 1, c] + p2 * vt[jj + 2, c] + p3 * vt[jj + 3, c]
                            jj += 4
                        else:
                            if ok[jj]:
                                p0 = pr[hh, jj]
                                u0 = pr[hh + 1, jj] if pair else _F0
                                for c in range(hd):
                                    acc[r, c] += p0 * vt[jj, c]
                                if pair:
                                    for c in range(hd):
                                        acc[r + 1, c] += u0 * vt[jj, c]
                            jj += 1
        for i in range(i0, i1):
            for hh in range(grp):
                r = (i - i0) * grp + hh
                h = g * grp + hh
                if n_split == 1:  # a query that sees no key gets zeros
                    _finish_row(acc[r], _F1 / l[r] if l[r] > _F0 else _F0, perm, v_rotated, B, out, i, h)
                else:
                    pm[i, h, sp] = m[r]
                    pl[i, h, sp] = l[r]
                    for c in range(hd):
                        pacc[i, h, sp, c] = acc[r, c]


@njit(inline="always", **_KERNEL)
def _start_row(src, scale_by, perm, dst):
    """dst = src * scale_by gathered into kernel order (_finish_row's inverse)."""
    if perm[1] == 1:  # the original order (every kind but int4's): a vector loop, not a gather
        for c in range(dst.shape[0]):
            dst[c] = src[c] * scale_by
    else:
        for c in range(dst.shape[0]):
            dst[c] = src[perm[c]] * scale_by


@njit(inline="always", **_KERNEL)
def _finish_row(src, scale_by, perm, v_rotated, B, out, i, h):
    """out[i, h] = src * scale_by scattered to original order, then un-rotated."""
    if perm[1] == 1:  # the original order (every kind but int4's): a vector loop, not a scatter
        for c in range(src.shape[0]):
            out[i, h, c] = src[c] * scale_by
    else:
        for c in range(src.shape[0]):
            out[i, h, perm[c]] = src[c] * scale_by
    if v_rotated:
        _fwht(out[i, h], B)


@njit(inline="always", **_KERNEL)
def _attn_task(kind, q, q_sink, q_pos, kh, kb, ks, vh, vb, vs, pos, n_sink, fk, fv, fpos, scale, window, perm,
               v_rotated, B, n_ring, X, bq, n_split, hpt, out, pm, pl, pacc, t):
    n = q.shape[0]
    n_head_kv = fk.shape[1]
    ngr = (n_head_kv + hpt - 1) // hpt
    nqb = (n + bq - 1) // bq
    s = t % n_split
    gi = (t // n_split) % ngr
    b = t // (n_split * ngr)
    # interleave light (early) and heavy (late) causal blocks so static chunks balance
    qb = b // 2 if b % 2 == 0 else nqb - 1 - b // 2
    i0 = qb * bq
    i1 = min(n, i0 + bq)
    n_all = n_ring + X[2].shape[0] + fk.shape[0]
    split_len = (n_all + n_split - 1) // n_split
    j0 = min(n_all, s * split_len)
    j1 = min(n_all, j0 + split_len)
    _attn_block(kind, q, q_sink, q_pos, kh, kb, ks, vh, vb, vs, pos, n_sink, fk, fv, fpos, scale, window, perm,
                v_rotated, B, n_ring, X, i0, i1, gi * hpt, min(n_head_kv, gi * hpt + hpt), j0, j1, s, n_split, out,
                pm, pl, pacc)


@njit(parallel=True, **_KERNEL)
def _attn_core(kind, q, q_sink, q_pos, K, V, pos, n_sink, fk, fv, fpos, scale, window, perm,
               v_rotated, B, X, bq, par_min, split_min, threads, out):
    # array expressions here would each become a parfor of their own (seconds of compile
    # time): only the task loop is parallel, everything else is written as loops
    n, n_head, hd = q.shape
    kh, kb, ks = K  # unpacked once: rebinding arrays in the hot loops costs refcount calls
    vh, vb, vs = V
    # ring slots past the last live one are never visited: a ring fills from slot 0, so
    # early in a long context most of it is empty and the splits must cover only the rest
    n_ring = pos.shape[0]
    while n_ring > 0 and pos[n_ring - 1] < 0:
        n_ring -= 1
    n_all = n_ring + X[2].shape[0] + fk.shape[0]
    n_head_kv = fk.shape[1]
    nqb = (n + bq - 1) // bq
    tasks = nqb * n_head_kv  # (query block, kv head) pairs: what the split below counts
    parallel = n * n_head * n_all * hd >= par_min and threads > 1
    # too few (query block, kv head) tasks to keep the threads busy: split the keys too, into
    # SPLIT_TASKS tasks in all where the keys allow. The split depends on the problem alone,
    # never on the thread count or the parallel choice, and the splits merge in a fixed
    # order: a result is the same bits whatever count the thread tuner picked (float sums in
    # another grouping differ in the last bit, which int8 activations then round apart)
    n_split = 1
    max_split = max(1, n_all // split_min)
    if tasks < KV_ATTN_SPLIT_TASKS and max_split > 1:
        n_split = min(-(-KV_ATTN_SPLIT_TASKS // tasks), max_split)
    pm = np.empty((n, n_head, n_split), np.float32)  # (n, n_head, n_split) partial maxima
    pl = np.empty((n, n_head, n_split), np.float32)  # partial denominators
    pacc = np.empty((n, n_head, n_split if n_split > 1 else 0, hd), np.float32)  # partial sums
    # One query block (a decode step): a head's work is about a task's fixed cost, so the kv
    # heads go hpt to a task, all of them on one thread, an equal share per thread otherwise
    # (7B's 32 heads, 9 keys, f16: 41 -> 20 us). Each head's sums are the same whoever runs
    # it, and the split above counted single heads: the same bits for any grouping.
    hpt = 1 if nqb > 1 else (n_head_kv if not parallel else -(-n_head_kv // threads))
    tasks = nqb * -(-n_head_kv // hpt)
    if parallel:
        for t in prange(tasks * n_split):
            _attn_task(kind, q, q_sink, q_pos, kh, kb, ks, vh, vb, vs, pos, n_sink, fk, fv, fpos, scale, window, perm,
                       v_rotated, B, n_ring, X, bq, n_split, hpt, out, pm, pl, pacc, t)
    else:  # the calling thread alone: no pool wake-up
        for t in range(tasks * n_split):
            _attn_task(kind, q, q_sink, q_pos, kh, kb, ks, vh, vb, vs, pos, n_sink, fk, fv, fpos, scale, window, perm,
                       v_rotated, B, n_ring, X, bq, n_split, hpt, out, pm, pl, pacc, t)
    if n_split > 1:
        # merge the splits' partial softmaxes (max m, denominator l, unnormalized sum)
        row = np.empty(hd, np.float32)
        for i in range(n):
            for h in range(n_head):
                mx = _NEG
                for s in range(n_split):
                    if pl[i, h, s] > _F0:
                        mx = max(mx, pm[i, h, s])
                for c in range(hd):
                    row[c] = _F0
                den = _F0
                for s in range(n_split):
                    if pl[i, h, s] > _F0:
                        w = _expf(pm[i, h, s] - mx)
                        den += w * pl[i, h, s]
                        for c in range(hd):
                            row[c] += w * pacc[i, h, s, c]
                _finish_row(row, _F1 / den if den > _F0 else _F0, perm, v_rotated, B, out, i, h)


def _check_extra(name: str, k, v, pos, dtype, n_head_kv: int, hd: int) -> None:
    """kv_attention's extra key sources (fresh / recent): k, v (m, Hkv, hd) of dtype, pos (m,) int64."""
    for a in (k, v):
        if a is None or a.dtype != dtype or a.ndim != 3 or a.shape[1:] != (n_head_kv, hd) or not a.flags.c_contiguous:
            got = "None" if a is None else f"{a.dtype}{a.shape}"
            raise ValueError(f"kv_attention: {name}_k, {name}_v must be {np.dtype(dtype)} (m, {n_head_kv}, {hd}), "
                             f"C-contiguous, not {got}")
    m = k.shape[0]
    if v.shape[0] != m or pos is None or pos.dtype != np.int64 or pos.shape != (m,):
        raise ValueError(f"kv_attention: {name}_v {v.shape} and {name}_pos must match {name}_k's {m} rows ({name}_pos int64)")


def kv_attention(
    kind: str,
    q: np.ndarray,
    q_sink: np.ndarray | None,
    q_pos: np.ndarray,
    k: np.ndarray,
    k_scale: np.ndarray | None,
    v: np.ndarray,
    v_scale: np.ndarray | None,
    pos: np.ndarray,
    n_sink: int,
    fresh_k: np.ndarray | None,
    fresh_v: np.ndarray | None,
    fresh_pos: np.ndarray | None,
    scale: float,
    window: int,
    v_rotated: bool,
    out: np.ndarray | None = None,
    *,
    recent_k: np.ndarray | None = None,
    recent_v: np.ndarray | None = None,
    recent_pos: np.ndarray | None = None,
    recent: int = 0,
    exact_lo: int = 0,
    first: int = 0,
    fresh_all: bool = True,
    sink_bias: np.ndarray | None = None,
    softcap: float = 0.0,
    scores: np.ndarray | None = None,
    check: bool = True,
    rings: tuple | None = None,
) -> np.ndarray:
    """softmax(q K^T * scale + mask) V over the union of a ring (k, k_scale, v, v_scale of
    `kind`; pos (cap,) int64, -1 = empty) and fresh keys fresh_k, fresh_v (m, Hkv, hd)
    float32 at fresh_pos (m,) int64 (all three None = none). q (n, H, hd) float32 at
    q_pos (n,) int64; query head h reads kv head h // (H // Hkv).

    Key at position p is seen by query i iff 0 <= p <= q_pos[i] and (window == 0 or
    q_pos[i] - p < window), except that ring slots j < n_sink (attention sinks) ignore the
    window and are scored with q_sink (n, H, hd) instead of q (None = q). q, q_sink and
    fresh_k must be in the ring's key space (Hadamard-rotated when keys are), fresh_v in
    its value space; v_rotated un-rotates the output. A query that sees no key gets zeros.

    Exact keys (KIVI's residual, and the first tokens): a key at position p < first, or
    with q_pos[i] - p < recent and p >= exact_lo, is read, for query i, from its exact copy
    instead of the ring: the ring slot is hidden and the copy is taken from recent_k,
    recent_v (r, Hkv, hd) float16 at recent_pos (r,) int64 (-1 = empty; in key space like
    fresh_k) or from the fresh keys. Recent slots j < n_sink hold the sinks' copies (position
    j) and are scored as sinks, as are fresh keys at positions < n_sink (fresh keys come in
    ascending positions).
    The caller guarantees every such position has exactly one copy there. Recent slots are
    seen only under that rule; fresh keys under it too unless fresh_all (then always: the
    batch is not in the ring yet). sink_bias (n, H) float32, when given, is added (times
    scale) to every sink score: the part of a key offset subtracted before storing that
    q_sink does not share with q. softcap > 0: every scaled score s becomes
    softcap * tanh(s / softcap) before the softmax (gemma2; 0 = off). Returns out (n, H, hd) float32.

    scores (n_obs, H, width) float32, when given: the last n_obs queries' scaled (and capped)
    scores of every key they see, at its index in the joined key space (the ring's slots up to
    the last live one, then the recent slots, then the fresh keys); what they do not see is left
    as it was (the caller fills it with kvquant.SCORE_NONE first). An eviction policy's input
    (kernels_cpu.evict.score_update): the scores this attention computes anyway, not a second pass.

    check=False skips the checks (a backend's decode step; arrays as the cache made them, every
    optional one given, out included): at one token they cost more than the attention. With it,
    rings may give (K, V) as a kv_decode_layer pack holds them, made once per cache."""
    if not check:
        hd = q.shape[2]
        K, V = rings or (_views(kind, k, k_scale), _views(kind, v, v_scale))
        _attn_core(_KIND_ID[kind], q, q_sink, q_pos, K, V, pos,
                   n_sink, fresh_k, fresh_v, fresh_pos, np.float32(scale), window, _perm(kind, hd), v_rotated,
                   hadamard_block(hd), (recent_k.view(np.uint16), recent_v.view(np.uint16), recent_pos, recent,
                                        exact_lo, fresh_all, sink_bias, first, np.float32(softcap),
                                        NO_SCORES if scores is None else scores),
                   min(q.shape[0], KV_ATTN_Q_BLOCK), KV_ATTN_PAR_MIN, KV_ATTN_SPLIT_MIN_KEYS, get_num_threads(), out)
        return out
    if q.dtype != np.float32 or q.ndim != 3 or not q.flags.c_contiguous:
        raise ValueError(f"kv_attention: q {q.dtype}{q.shape} must be float32 (n, n_head, hd), C-contiguous")
    n, n_head, hd = q.shape
    _check_kind(kind, hd)
    K = _ring("kv_attention", kind, k, k_scale, hd)
    V = _ring("kv_attention", kind, v, v_scale, hd)
    cap, n_head_kv = k.shape[:2]
    if v.shape != k.shape or n_head % n_head_kv:
        raise ValueError(f"kv_attention: k {k.shape}, v {v.shape} do not fit q {q.shape} (kv heads, GQA groups)")
    if q_sink is None:
        q_sink = q
    elif q_sink.dtype != np.float32 or q_sink.shape != q.shape or not q_sink.flags.c_contiguous:
        raise ValueError(f"kv_attention: q_sink {q_sink.dtype}{q_sink.shape} must be float32 {q.shape}, C-contiguous")
    if q_pos.dtype != np.int64 or q_pos.shape != (n,) or pos.dtype != np.int64 or pos.shape != (cap,):
        raise ValueError(f"kv_attention: q_pos {q_pos.dtype}{q_pos.shape}, pos {pos.dtype}{pos.shape} must be int64 ({n},), ({cap},)")
    if fresh_k is None and fresh_v is None and fresh_pos is None:
        fresh_k = fresh_v = np.zeros((0, n_head_kv, hd), np.float32)
        fresh_pos = np.zeros(0, np.int64)
    _check_extra("fresh", fresh_k, fresh_v, fresh_pos, np.float32, n_head_kv, hd)
    if not 0 <= n_sink <= cap or window < 0:
        raise ValueError(f"kv_attention: n_sink={n_sink} must be in [0, {cap}], window={window} >= 0")
    if recent_k is None and recent_v is None and recent_pos is None:
        recent_k = recent_v = np.zeros((0, n_head_kv, hd), np.float16)
        recent_pos = np.zeros(0, np.int64)
    _check_extra("recent", recent_k, recent_v, recent_pos, np.float16, n_head_kv, hd)
    if recent < 0 or first < 0:
        raise ValueError(f"kv_attention: recent={recent}, first={first} must be >= 0")
    if sink_bias is None:
        sink_bias = NO_SINK_BIAS
    elif sink_bias.dtype != np.float32 or sink_bias.shape != (n, n_head) or not sink_bias.flags.c_contiguous:
        raise ValueError(f"kv_attention: sink_bias {sink_bias.dtype}{sink_bias.shape} must be float32 ({n}, {n_head}), C-contiguous")
    if scores is None:
        scores = NO_SCORES
    elif (scores.dtype != np.float32 or scores.ndim != 3 or scores.shape[0] > n or scores.shape[1] != n_head
          or scores.shape[2] < cap + recent_pos.shape[0] + fresh_pos.shape[0] or not scores.flags.c_contiguous):
        raise ValueError(f"kv_attention: scores {scores.dtype}{scores.shape} must be float32 (<= {n}, {n_head}, "
                         f">= {cap + recent_pos.shape[0] + fresh_pos.shape[0]}), C-contiguous")
    if out is None:
        out = np.empty_like(q)
    elif out.dtype != np.float32 or out.shape != q.shape or not out.flags.c_contiguous:
        raise ValueError(f"kv_attention: out {out.dtype}{out.shape} must be float32 {q.shape}, C-contiguous")
    if n == 0:
        return out
    _attn_core(_KIND_ID[kind], q, q_sink, q_pos, K, V, pos, int(n_sink), fresh_k, fresh_v, fresh_pos,
               np.float32(scale), int(window), _perm(kind, hd), bool(v_rotated), hadamard_block(hd),
               (recent_k.view(np.uint16), recent_v.view(np.uint16), recent_pos, int(recent), int(exact_lo),
                bool(fresh_all), sink_bias, int(first), np.float32(softcap), scores), min(n, KV_ATTN_Q_BLOCK), KV_ATTN_PAR_MIN, KV_ATTN_SPLIT_MIN_KEYS, get_num_threads(), out)
    return out


# --- one decode step ------------------------------------------------------------------
NO_EVICT = (0, np.zeros(0, np.float32), np.zeros(0, np.int64))  # kv_decode_layer's evict when none
# A decode step of one layer is one token: the transforms, two stores, the attention and the
# exact-copy bookkeeping are each a few microseconds of work, and as separate calls their
# dispatch and numpy glue cost several times that (a 135M model has 30 layers, ~7 ms a token).


@njit(**_EXACT)
def _decode_core(L, q, k, v, q_pos, at, rope, scale, par, out, softcap):
    kind, K, V, pos, n_sink, span, R, mu, kmul, rotated, perm, B, E = L
    _, n_head, hd = q.shape
    n_head_kv = k.shape[1]
    grp = n_head // n_head_kv
    rk, rv, rpos, recent, first = R
    inv_freq, neox, shift = rope
    p = q_pos[0]
    slot0, n_ring, e0, row = at  # where the cache's plan puts the token (edgekv.kvcache.Plan)
    # copies, not slice assignments (`qo[:] = q`): each compiles numba's shape-mismatch message (~2 s cold)
    vo = v.copy()
    if rotated:  # q and k in the ring's key space
        qo = np.empty((1, n_head, hd), np.float32)
        ko = np.empty((1, n_head_kv, hd), np.float32)
        _kv_space_core(q, k, mu, kmul, B, qo, ko)
    else:
        qo = q.copy()
        ko = k.copy()
    # sinks, once the ring is full, are scored by q turned back by `shift` positions, with
    # their share of the key offset added back (LayerKV.sink_bias)
    sb = np.zeros((1 if shift and rotated else 0, n_head), np.float32)  # (1, H) or none
    qs = qo
    if shift:
        qr = q.copy()
        spos = np.empty(1, np.int64)
        spos[0] = -shift
        cs = np.empty(inv_freq.shape[0], np.float32)
        sn = np.empty(inv_freq.shape[0], np.float32)
        _rope_token(qr, spos, inv_freq, neox, n_head, 0, cs, sn, 1.0)  # q holds its magnitude already
        if rotated:
            qs = np.empty((1, n_head, hd), np.float32)
            for h in range(n_head):
                g = h // grp
                acc = 0.0
                for c in range(hd):
                    acc += np.float64(qr[0, h, c] - q[0, h, c]) * np.float64(mu[g, c])
                    qs[0, h, c] = qr[0, h, c] / kmul[g, c]
                sb[0, h] = np.float32(acc)
                _fwht(qs[0, h], B)
        else:
            qs = qr
    # stored first (a token always can be); the cache has recorded its position
    slot = np.empty(1, np.int64)
    slot[0] = slot0
    unrotated = slot[0] < 0  # False, typed bool: kv_store's own _store_core, not one for a literal False
    _store_core(kind, ko, K, slot, unrotated, B)
    _store_core(kind, vo, V, slot, unrotated, B)
    pos[slot0] = p  # the slot's position, as the cache's place records it (the same value)
    # with exact recent slots the token is read exact from the fresh batch, hidden in the ring
    m = 1 if recent > 0 else 0
    fk = ko[:m].copy()
    fv = vo[:m].copy()
    fpos = np.empty(m, np.int64)
    if m:
        fpos[0] = p
    fresh_all = m < 0  # False: the token is in the ring already
    v_rotated = m < 0  # False: values are stored as they are
    # an eviction policy's scores (E: mode, score, rslot; kernels_cpu.evict): this query's, in
    # the joined key space of _attn_core
    mode, score, rslot = E
    sc = np.full((1 if mode else 0, n_head, n_ring + rpos.shape[0] + m if mode else 0), _NEG, np.float32)
    # the filled slots only: slots past them are empty and hold no -1s
    _attn_core(kind, qo, qs, q_pos, K, V, pos[:n_ring], n_sink, fk, fv, fpos, scale, span, perm,
               v_rotated, B,
               (rk, rv, rpos, recent, e0, fresh_all, sb, first, softcap, sc), q.shape[0], par[0], par[1], par[2], out)
    if mode:
        fslot = np.empty(m, np.int64)
        if m:
            fslot[0] = slot0
        _score_update(sc, pos[:n_ring], rpos.shape[0], rslot, fslot, mode, score)
    if m:  # the exact copy, in the plan's row, and its position (as the cache's commit records it)
        for g in range(n_head_kv):
            for c in range(hd):
                rk[row, g, c] = _narrow(ko[0, g, c])
                rv[row, g, c] = _narrow(vo[0, g, c])
        rpos[row] = p


def kv_decode_layer(kind: str, k_arr: np.ndarray, k_scale: np.ndarray, v_arr: np.ndarray, v_scale: np.ndarray,
                    pos: np.ndarray, n_sink: int, span: int, recent_k: np.ndarray, recent_v: np.ndarray,
                    recent_pos: np.ndarray, recent: int, first: int, mu: np.ndarray, kmul: np.ndarray,
                    evict: tuple | None = None) -> tuple:
    """A layer's cache arrays (as edgekv.kvcache.LayerKV holds them: the ring of `kind`, its
    positions, n_sink sink slots, a query sees `span` positions back; the exact recent/first
    copies; the key offset mu and channel weights kmul (Hkv, hd); evict: an eviction policy's
    (mode, score (cap,) float32, rslot (first + recent,) int64), kernels_cpu.evict, None = none)
    packed once for kv_decode.
    The pack holds views: writes through it land in these arrays, and in-place updates of them
    are seen by it."""
    hd = mu.shape[1]
    return (_KIND_ID[kind], _views(kind, k_arr, k_scale), _views(kind, v_arr, v_scale), pos, n_sink, span,
            (recent_k.view(np.uint16), recent_v.view(np.uint16), recent_pos, recent, first), mu, kmul,
            _SPEC[kind].quantized,
            _perm(kind, hd), hadamard_block(hd), evict or NO_EVICT)


def kv_decode(layer: tuple, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, at: tuple,
              rope: tuple, scale: float, out: np.ndarray, softcap: float = 0.0, threads: int | None = None) -> np.ndarray:
    """One token through a layer's cache (kv_decode_layer) in one call, unchecked (a backend's
    decode step): what kv_space, kv_store of k and v, kv_attention (the token itself read exact
    when the layer keeps recent copies) and the exact-row write do one after another.
    q (1, H, hd), k, v (1, Hkv, hd) float32 after RoPE, q_pos (1,) int64.
    at (slot, n_ring, exact_lo, exact_row): the cache's plan for the token (edgekv.kvcache.Plan);
    the token's position is written to the slot's pos and the exact row's rpos here (the values
    the cache's place and commit write: a caller may do either, LayerKV.stored). rope (inv_freq (n_rot/2,) float64, neox,
    shift): once the ring is full, sinks are scored by q turned back by shift positions
    (kv_attention's q_sink and sink_bias). softcap: kv_attention's. threads: the calling thread's
    numba count where the caller knows it (block.decode_block's). Writes out (1, H, hd) and
    returns it; the caller's cache advances its cursor."""
    _decode_core(layer, q, k, v, q_pos, at, rope, np.float32(scale),
                 (KV_ATTN_PAR_MIN, KV_ATTN_SPLIT_MIN_KEYS, threads or get_num_threads()), out, np.float32(softcap))
    return out
