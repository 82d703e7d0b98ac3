"""GPU twin of kernels_cpu/kvquant.py: store, load and attention over a layer's ring in f16,
int8 or int4, with the CPU module's layouts and semantics (positions, causal mask, window,
attention sinks scored with a counter-rotated query, Hadamard-rotated int keys).

On the device one of a ring's K or V is a triple (h, b, s), as in the CPU cores: h uint16
(cap, Hkv, hd) half bits of the f16 kind; b uint8 (cap, Hkv, hd) int8 values as bytes, or
(cap, Hkv, hd/2) int4 nibble pairs (value 2i low, 2i+1 high, as q + 8); s uint16 (cap, Hkv,
hd/32) half scales. The arrays a kind does not use are (1, 1, 1) placeholders. The bytes are
the host LayerKV's, so a ring moves between host and device as it is.

Attention: one block per (query, head); its threads take one key each per tile of
blockDim keys (score, mask), the tile's max and sum come from shared-memory trees, and each
thread keeps the running output of the head dims it owns (online softmax, as flash attention).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from . import launch
from .launch import blocks, launch as _launch
from .ops import MAXT, _F0, _F1, _NEG, f2h, h2f, rint

KINDS = ("f16", "int8", "int4")
GROUP = 32
_F16, _INT8, _INT4 = 0, 1, 2
_KIND_ID = {"f16": _F16, "int8": _INT8, "int4": _INT4}
MAX_HD = launch.MAX_HD
ADIM = 8  # head dims one attention thread owns at most: hd <= ADIM * blockDim


def hadamard_block(hd: int) -> int:
    """B: the largest power of two dividing hd, at most 256 (as kernels_cpu.kvquant)."""
    return min(hd & -hd, 256)


@cuda.jit(device=True)
def _fwht(buf, hd, B):
    """Normalized Walsh-Hadamard transform in place on each block of B values of buf[:hd]."""
    h = 1
    while h < B:
        for b0 in range(0, hd, 2 * h):
            for j in range(b0, b0 + h):
                a = buf[j]
                c = buf[j + h]
                buf[j] = a + c
                buf[j + h] = a - c
        h *= 2
    s = np.float32(1.0 / math.sqrt(B))
    for j in range(hd):
        buf[j] *= s


@cuda.jit(device=True)
def ring_value(kind, h, b, s, j, g, c):
    """Element c (original order) of row (slot j, kv head g) of a ring, as float32."""
    if kind == _F16:
        return h2f(np.int32(h[j, g, c]))
    d = h2f(np.int32(s[j, g, c // 32]))
    if kind == _INT8:
        q = np.int32(b[j, g, c])
        return d * np.float32(q - 256 if q > 127 else q)
    byte = np.int32(b[j, g, c // 2])
    q = (byte >> 4) if c % 2 else (byte & 15)
    return d * np.float32(q - 8)


# The block reductions are this module's own: under the CUDA simulator a device function from
# another module that calls cuda.syncthreads() can see the real numba.cuda instead of the
# simulated one (the simulator swaps module globals per call, unsynchronized across threads).
@cuda.jit(device=True)
def _tree_sum(red, t, nt):
    s = nt // 2
    while s > 0:
        if t < s:
            red[t] += red[t + s]
        cuda.syncthreads()
        s //= 2


@cuda.jit(device=True)
def _tree_max(red, t, nt):
    s = nt // 2
    while s > 0:
        if t < s:
            red[t] = max(red[t], red[t + s])
        cuda.syncthreads()
        s //= 2


@cuda.jit
def _hadamard_kernel(x, B):
    r = cuda.grid(1)
    if r < x.shape[0]:
        hd = x.shape[1]
        buf = cuda.local.array(MAX_HD, np.float32)
        for c in range(hd):
            buf[c] = x[r, c]
        _fwht(buf, hd, B)
        for c in range(hd):
            x[r, c] = buf[c]


@cuda.jit
def _store_kernel(kind, x, rows, slots, rotate, B, h, b, s):
    """Row (rows[i], g) of x (n, Hkv, hd) float32 -> ring row (slots[i], g), quantized exactly
    like kernels_cpu.kvquant._quant_row (IEEE division and rounding, q4_0's int4 scale)."""
    tid = cuda.grid(1)
    nkv = x.shape[1]
    hd = x.shape[2]
    if tid >= rows.shape[0] * nkv:
        return
    i = tid // nkv
    g = tid % nkv
    t = rows[i]
    j = slots[i]
    buf = cuda.local.array(MAX_HD, np.float32)
    for c in range(hd):
        buf[c] = x[t, g, c]
    if rotate:
        _fwht(buf, hd, B)
    if kind == _F16:
        for c in range(hd):
            h[j, g, c] = f2h(buf[c])
        return
    for gi in range(hd // 32):
        amax = _F0
        smax = _F0  # int4: the value of largest magnitude, the first one on ties
        for c in range(32 * gi, 32 * gi + 32):
            if abs(buf[c]) > amax:
                amax = abs(buf[c])
                smax = buf[c]
        hs = f2h(amax / np.float32(127.0)) if kind == _INT8 else f2h(smax / np.float32(-8.0))
        s[j, g, gi] = hs
        d = h2f(hs)
        inv = _F1 / d if d != _F0 else _F0
        if kind == _INT8:
            for c in range(32 * gi, 32 * gi + 32):
                q = np.int32(min(max(rint(buf[c] * inv), np.float32(-127.0)), np.float32(127.0)))
                b[j, g, c] = q & 255
        else:
            for i2 in range(16):
                lo = np.int32(min(max(rint(buf[32 * gi + 2 * i2] * inv), np.float32(-8.0)), np.float32(7.0)))
                hi = np.int32(min(max(rint(buf[32 * gi + 2 * i2 + 1] * inv), np.float32(-8.0)), np.float32(7.0)))
                b[j, g, 16 * gi + i2] = (lo + 8) | ((hi + 8) << 4)


@cuda.jit
def _set_pos_kernel(pos, slots, vals):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        pos[slots[i]] = vals[i]


@cuda.jit
def _load_kernel(kind, h, b, s, slots, out):
    i = cuda.blockIdx.x
    g = cuda.blockIdx.y
    hd = out.shape[2]
    for c in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        out[i, g, c] = ring_value(kind, h, b, s, slots[i], g, c)


@cuda.jit
def _attn_kernel(kind, q, q_sink, q_pos, kh, kb, ks, vh, vb, vs, pos, n_ring, n_sink, fk, fv, fpos, scale,
                 window, out):
    nh = q.shape[1]
    hd = q.shape[2]
    i = cuda.blockIdx.x // nh
    hq = cuda.blockIdx.x % nh
    g = hq // (nh // fk.shape[1])  # query head h reads kv head h // group
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    qsh = cuda.shared.array(MAX_HD, np.float32)  # the query, scale folded in
    qss = cuda.shared.array(MAX_HD, np.float32)  # the query for sink slots
    pr = cuda.shared.array(MAXT, np.float32)  # the tile's probabilities
    red = cuda.shared.array(MAXT, np.float32)
    acc = cuda.local.array(ADIM, np.float32)  # unnormalized output of dims tid, tid + nt, ...
    for a in range(ADIM):
        acc[a] = _F0
    for c in range(tid, hd, nt):
        qsh[c] = q[i, hq, c] * scale
        qss[c] = q_sink[i, hq, c] * scale
    cuda.syncthreads()
    m_run = _NEG
    l_run = _F0
    qp = q_pos[i]
    n_all = n_ring + fk.shape[0]
    for j0 in range(0, n_all, nt):
        j = j0 + tid
        sc = _NEG
        vis = False
        if j < n_all:
            ring = j < n_ring
            kp = pos[j] if ring else fpos[j - n_ring]
            sink = ring and j < n_sink
            # sinks sit just before the window (StreamingLLM): causal, never windowed
            vis = kp >= 0 and kp <= qp and (window == 0 or sink or qp - kp < window)
            if vis:
                sc = _F0
                if sink:
                    for c in range(hd):
                        sc += qss[c] * ring_value(kind, kh, kb, ks, j, g, c)
                elif ring:
                    for c in range(hd):
                        sc += qsh[c] * ring_value(kind, kh, kb, ks, j, g, c)
                else:
                    for c in range(hd):
                        sc += qsh[c] * fk[j - n_ring, g, c]
        red[tid] = sc
        cuda.syncthreads()
        _tree_max(red, tid, nt)
        mt = red[0]
        cuda.syncthreads()  # all have read red[0] before it is reused
        if mt > _NEG:  # the same for every thread of the block
            m_new = max(m_run, mt)
            alpha = math.exp(m_run - m_new) if m_run > _NEG else _F0
            p = math.exp(sc - m_new) if vis else _F0
            pr[tid] = p
            red[tid] = p
            cuda.syncthreads()
            _tree_sum(red, tid, nt)
            l_run = l_run * alpha + red[0]
            m_run = m_new
            jn = min(nt, n_all - j0)
            for a in range(ADIM):
                c = tid + a * nt
                if c < hd:
                    sv = acc[a] * alpha
                    for jj in range(jn):
                        pj = pr[jj]
                        if pj > _F0:
                            jg = j0 + jj
                            if jg < n_ring:
                                sv += pj * ring_value(kind, vh, vb, vs, jg, g, c)
                            else:
                                sv += pj * fv[jg - n_ring, g, c]
                    acc[a] = sv
            cuda.syncthreads()  # pr and red are rewritten by the next tile
    inv = _F1 / l_run if l_run > _F0 else _F0  # a query that sees no key gets zeros
    for a in range(ADIM):
        c = tid + a * nt
        if c < hd:
            out[i, hq, c] = acc[a] * inv


# --- public API -----------------------------------------------------------------------

_dummies: dict = {}


def _dummy(dtype):
    if dtype not in _dummies:
        _dummies[dtype] = cuda.to_device(np.zeros((1, 1, 1), dtype))
    return _dummies[dtype]


def ring_arrays(kind: str, q_arr, scale_arr):
    """(h, b, s) kernel inputs for one of a ring's K or V: q_arr the device copy of the host
    ring array viewed as uint16 (f16) or uint8 (int8/int4), scale_arr its uint16 scales."""
    if kind == "f16":
        return q_arr, _dummy(np.uint8), _dummy(np.uint16)
    return _dummy(np.uint16), q_arr, scale_arr


def _check_kind(kind: str, hd: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}; one of {KINDS}")
    if hd <= 0 or hd % GROUP or hd > MAX_HD:
        raise ValueError(f"head dim {hd} must be a positive multiple of {GROUP}, at most {MAX_HD}")


def _f32_3d(name, a):
    if a.dtype != np.float32 or a.ndim != 3 or not a.is_c_contiguous():
        raise ValueError(f"{name}: {a.dtype}{a.shape} must be a float32 (n, heads, hd) device array, C-contiguous")


def hadamard_(x):
    """x = H x in place over the last axis of x (..., hd) float32 C-contiguous (see kernels_cpu)."""
    hd = x.shape[x.ndim - 1]
    _check_kind("int8", hd)
    rows = x.size // hd
    if rows:
        _launch(_hadamard_kernel, blocks(rows, launch.ELEMWISE), launch.ELEMWISE, x.reshape(rows, hd),
                hadamard_block(hd))
    return x


def kv_store(kind: str, x, ring: tuple, rows, slots, rotate: bool) -> None:
    """Quantize rows `rows` (m,) int64 of x (n, Hkv, hd) float32 into ring slots (m,) int64
    (distinct) of ring = ring_arrays(...), Hadamard-rotating each row first when rotate."""
    _f32_3d("kv_store", x)
    _check_kind(kind, x.shape[2])
    if rows.dtype != np.int64 or slots.dtype != np.int64 or rows.shape != slots.shape:
        raise ValueError("kv_store: rows and slots must be int64 arrays of one length")
    total = rows.shape[0] * x.shape[1]
    if total:
        _launch(_store_kernel, blocks(total, launch.ELEMWISE), launch.ELEMWISE, _KIND_ID[kind], x, rows, slots,
                bool(rotate), hadamard_block(x.shape[2]), *ring)


def set_pos(pos, slots, vals) -> None:
    """pos[slots] = vals on the device (all int64)."""
    if slots.shape[0]:
        _launch(_set_pos_kernel, blocks(slots.shape[0], launch.ELEMWISE), launch.ELEMWISE, pos, slots, vals)


def kv_load(kind: str, ring: tuple, slots, n_head_kv: int, hd: int, rotate: bool):
    """Dequantized rows of ring slots (n,) int64 -> (n, Hkv, hd) float32, un-rotated when rotate."""
    _check_kind(kind, hd)
    n = slots.shape[0]
    out = cuda.device_array((n, n_head_kv, hd), np.float32)
    if n:
        _launch(_load_kernel, (n, n_head_kv), min(launch.threads(), 64), _KIND_ID[kind], *ring, slots, out)
        if rotate:
            hadamard_(out)
    return out


def kv_attention(kind: str, q, q_sink, q_pos, K: tuple, V: tuple, pos, n_ring: int, n_sink: int,
                 fresh_k, fresh_v, fresh_pos, scale: float, window: int, out=None):
    """softmax(q K^T * scale + mask) V over ring slots 0..n_ring-1 (K, V = ring_arrays(...), pos
    (cap,) int64 on the device, -1 = empty) and fresh keys fresh_k, fresh_v (m, Hkv, hd) float32
    at fresh_pos (m,) int64; the semantics of kernels_cpu.kvquant.kv_attention (q_sink None =
    q; keys in stored space; v never rotated). q (n, H, hd) float32. Returns out (n, H, hd)."""
    _f32_3d("kv_attention", q)
    n, nh, hd = q.shape
    _check_kind(kind, hd)
    q_sink = q if q_sink is None else q_sink
    _f32_3d("kv_attention q_sink", q_sink)
    _f32_3d("kv_attention fresh_k", fresh_k)
    _f32_3d("kv_attention fresh_v", fresh_v)
    nkv = fresh_k.shape[1]
    if q_sink.shape != q.shape or nh % nkv or fresh_k.shape[2] != hd or fresh_v.shape != fresh_k.shape:
        raise ValueError(f"kv_attention: q {q.shape}, q_sink {q_sink.shape}, fresh k/v {fresh_k.shape}/{fresh_v.shape} do not fit")
    if q_pos.shape != (n,) or fresh_pos.shape != (fresh_k.shape[0],) or not 0 <= n_ring <= pos.shape[0]:
        raise ValueError("kv_attention: q_pos, fresh_pos or n_ring do not fit")
    t = launch.threads()
    if hd > ADIM * t:
        raise ValueError(f"kv_attention: head dim {hd} needs more than {t} threads")
    out = cuda.device_array(q.shape, np.float32) if out is None else out
    if n:
        _launch(_attn_kernel, n * nh, t, _KIND_ID[kind], q, q_sink, q_pos, *K, *V, pos, int(n_ring), int(n_sink),
                fresh_k, fresh_v, fresh_pos, np.float32(scale), int(window), out)
    return out
