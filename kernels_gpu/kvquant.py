"""GPU twin of kernels_cpu/kvquant.py: store, load and attention over a layer's ring in f16,
int8 or int4, with the CPU module's layouts and semantics (positions, causal mask, window,
attention sinks scored with a counter-rotated query, Hadamard-rotated int keys with a key
offset mu and channel weights kmul, exact f16 copies of the first and the most recent tokens,
fitted int4 steps; see edgekv/kvcache.py for why).

On the device one of a ring's K or V is a triple (h, b, s), as in the CPU cores: h uint16
(cap, Hkv, hd) half bits of the f16 kind; b uint8 (cap, Hkv, hd) int8 values as bytes, or
(cap, Hkv, hd/2) int4 nibble pairs (value 2i low, 2i+1 high, as q + 8); s uint16 (cap, Hkv,
hd/32) half scales. The arrays a kind does not use are (1, 1, 1) placeholders. The bytes are
the host LayerKV's, so a ring moves between host and device as it is. The exact copies rk, rv
(r, Hkv, hd) are uint16 half bits, rpos (r,) int64 their positions (-1 = empty).

Storing is exact IEEE arithmetic in the CPU kernel's order (`kv_space`, `kv_store`), so the
same inputs give the same bytes on both.

Attention: one block per (query, head); its threads take one key each per tile of
blockDim keys (score, mask), the tile's max and sum come from shared-memory trees, and each
thread keeps the running output of the head dims it owns (online softmax, as flash attention).
The keys are one index space: ring slots 0..n_ring-1, then the exact slots, then fresh keys.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

from edgekv.kvkinds import GROUP, KINDS as _SPEC, KV_KINDS as KINDS, hadamard_block

from . import launch
from .launch import launch as _launch
from .ops import MAXT, _F0, _F1, _NEG, f2h, h2f, rint

_F16, _INT8, _INT4 = 0, 1, 2  # KINDS' order
_KIND_ID = {name: i for i, name in enumerate(KINDS)}
# The fit rule's step factors 0.75 + 0.025 ci, rounded as the CPU kernel rounds them (a product,
# then a sum): computed on the device, they could become one fma, rounded once.
_FIT_F = np.array([0.75 + 0.025 * ci for ci in range(15)], np.float64)
MAX_HD = launch.MAX_HD
ADIM = 8  # head dims one attention thread owns at most: hd <= ADIM * blockDim


# Products on the way to stored bytes are rounded as products, as on the CPU: numba.cuda
# emits plain mul.f32, which ptxas may fuse with a following add or sub (rint's
# `x * inv - floor(x * inv)`) into one fma of the unrounded product. libdevice's _rn
# multiplies (mul.rn) are never fused; the simulator (numpy scalars) has no libdevice, no fma.
if numba.config.ENABLE_CUDASIM:  # plain functions: a simulated device call costs a context switch

    def _mul32(a, b):
        return a * b

    _mul64 = _mul32

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _mul32(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def _mul64(a, b):
        return libdevice.dmul_rn(a, b)


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
        buf[j] = _mul32(buf[j], s)


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


@cuda.jit(device=True)
def _rint64(y):
    """float64 y rounded to the nearest integer, ties to even (numpy's rint), for |y| < 2**62."""
    f = np.float64(math.floor(y))
    r = y - f
    if r > 0.5 or (r == 0.5 and math.fmod(f, 2.0) != 0.0):
        f += 1.0
    return f


@cuda.jit
def _kv_space_kernel(q, k, mu, kmul, B, qo, ko):
    """Row r of the queries (n, H, hd) then of the keys (m, Hkv, hd): qo = H(q / kmul),
    ko = H((k - mu) * kmul), in kernels_cpu.kvquant._kv_space_core's operations."""
    r = cuda.grid(1)
    n, nh, hd = q.shape
    nkv = mu.shape[0]
    nq = n * nh
    if r >= nq + k.shape[0] * nkv:
        return
    buf = cuda.local.array(MAX_HD, np.float32)
    if r < nq:
        t = r // nh
        hq = r % nh
        g = hq // (nh // nkv)
        for c in range(hd):
            buf[c] = q[t, hq, c] / kmul[g, c]
        _fwht(buf, hd, B)
        for c in range(hd):
            qo[t, hq, c] = buf[c]
    else:
        t = (r - nq) // nkv
        g = (r - nq) % nkv
        for c in range(hd):
            buf[c] = _mul32(k[t, g, c] - mu[g, c], kmul[g, c])
        _fwht(buf, hd, B)
        for c in range(hd):
            ko[t, g, c] = buf[c]


@cuda.jit
def _sink_bias_kernel(q, q_sink, mu, out):
    """out[i, h] = (q_sink - q)[i, h] . mu[h // group] (edgekv.kvcache.LayerKV.sink_bias)."""
    r = cuda.grid(1)
    n, nh, hd = q.shape
    if r >= n * nh:
        return
    i = r // nh
    hq = r % nh
    g = hq // (nh // mu.shape[0])
    s = _F0
    for c in range(hd):
        s += (q_sink[i, hq, c] - q[i, hq, c]) * mu[g, c]
    out[i, hq] = s


@cuda.jit
def _store_kernel(kind, x, rows, slots, rotate, B, h, b, s):
    """Row (rows[i], g) of x (n, Hkv, hd) float32 -> ring row (slots[i], g), quantized exactly
    like kernels_cpu.kvquant._quant_row (IEEE division and rounding; int4's fitted step)."""
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
    fit_f = cuda.const.array_like(_FIT_F)
    for gi in range(hd // 32):
        amax = _F0
        smax = _F0  # int4: the value of largest magnitude, the first one on ties
        for c in range(32 * gi, 32 * gi + 32):
            if abs(buf[c]) > amax:
                amax = abs(buf[c])
                smax = buf[c]
        if kind == _INT4:
            # candidate inverse steps -8 / (f x_m); each gives levels q and the least-squares
            # step sum(xq) / sum(q^2); the largest sum(xq)^2 / sum(q^2) (least error) wins, the
            # first on ties. Summed in the CPU kernel's order; each float64 product (a float32
            # times a small integer) is exact, so a fused multiply-add rounds the same.
            best = -1.0
            best_inv = 0.0
            best_d = 0.0
            for ci in range(15):
                cinv = -8.0 / (np.float64(smax) * fit_f[ci]) if smax != _F0 else 0.0
                sxq = 0.0
                sqq = 0.0
                for c in range(32 * gi, 32 * gi + 32):
                    xv = np.float64(buf[c])
                    qv = min(max(_rint64(_mul64(xv, cinv)), -8.0), 7.0)
                    sxq += xv * qv
                    sqq += qv * qv
                score = sxq * sxq / sqq if sqq > 0.0 else 0.0
                if score > best:
                    best = score
                    best_inv = cinv
                    best_d = sxq / sqq if sqq > 0.0 else 0.0
            s[j, g, gi] = f2h(np.float32(best_d))
            for i2 in range(16):
                lo = np.int32(min(max(_rint64(_mul64(np.float64(buf[32 * gi + 2 * i2]), best_inv)), -8.0), 7.0))
                hi = np.int32(min(max(_rint64(_mul64(np.float64(buf[32 * gi + 2 * i2 + 1]), best_inv)), -8.0), 7.0))
                b[j, g, 16 * gi + i2] = (lo + 8) | ((hi + 8) << 4)
            continue
        hs = f2h(amax / np.float32(127.0))  # int8
        s[j, g, gi] = hs
        d = h2f(hs)
        inv = _F1 / d if d != _F0 else _F0
        for c in range(32 * gi, 32 * gi + 32):
            q = np.int32(min(max(rint(_mul32(buf[c], inv)), np.float32(-127.0)), np.float32(127.0)))
            b[j, g, c] = q & 255


@cuda.jit
def _f16_rows_kernel(k, v, rows, dst, rk, rv):
    """rk[dst[i]], rv[dst[i]] = half bits of k[rows[i]], v[rows[i]] (n, Hkv, hd) float32."""
    tid = cuda.grid(1)
    nkv = k.shape[1]
    hd = k.shape[2]
    if tid >= rows.shape[0] * nkv * hd:
        return
    c = tid % hd
    g = (tid // hd) % nkv
    i = tid // (hd * nkv)
    rk[dst[i], g, c] = f2h(k[rows[i], g, c])
    rv[dst[i], g, c] = f2h(v[rows[i], g, c])


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


@cuda.jit(device=True)
def _key_source(j, n_ring, n_res, pos, rpos, fpos, n_sink):
    """(source, row, position, sink) of key j of the joined index space: source 0 the ring, 1
    the exact slots, 2 the fresh keys. Sinks: ring slots and exact slots below n_sink (slot i
    of each holds position i), and fresh keys at positions below n_sink."""
    if j < n_ring:
        return 0, j, pos[j], j < n_sink
    if j < n_ring + n_res:
        t = j - n_ring
        return 1, t, rpos[t], t < n_sink
    t = j - n_ring - n_res
    kp = fpos[t]
    return 2, t, kp, kp >= 0 and kp < n_sink


@cuda.jit
def _attn_kernel(kind, q, q_sink, q_pos, kh, kb, ks, vh, vb, vs, pos, n_ring, n_sink, fk, fv, fpos,
                 rk, rv, rpos, recent, exact_lo, first, fresh_all, sb, scale, window, softcap, out):
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
    bias = sb[i, hq] * scale if sb.shape[0] > 0 else _F0  # the sinks' share of the key offset
    m_run = _NEG
    l_run = _F0
    qp = q_pos[i]
    n_res = rpos.shape[0]
    n_all = n_ring + n_res + fk.shape[0]
    for j0 in range(0, n_all, nt):
        j = j0 + tid
        sc = _NEG
        vis = False
        if j < n_all:
            src, t, kp, sink = _key_source(j, n_ring, n_res, pos, rpos, fpos, n_sink)
            # sinks sit just before the window (StreamingLLM): causal, never windowed
            vis = kp >= 0 and kp <= qp and (window == 0 or sink or qp - kp < window)
            # the first positions, and the last `recent` ones from exact_lo on, are read from
            # their exact copy (exact slots or fresh keys) and hidden in the quantized ring;
            # fresh keys are all seen when the batch is not in the ring yet (fresh_all)
            exact = (qp - kp < recent and kp >= exact_lo) or kp < first
            if src == 0:
                vis = vis and not exact
            elif src == 1 or not fresh_all:
                vis = vis and exact
            if vis:
                sc = _F0
                if src == 0:
                    if sink:
                        for c in range(hd):
                            sc += qss[c] * ring_value(kind, kh, kb, ks, t, g, c)
                    else:
                        for c in range(hd):
                            sc += qsh[c] * ring_value(kind, kh, kb, ks, t, g, c)
                elif src == 1:
                    if sink:
                        for c in range(hd):
                            sc += qss[c] * h2f(np.int32(rk[t, g, c]))
                    else:
                        for c in range(hd):
                            sc += qsh[c] * h2f(np.int32(rk[t, g, c]))
                else:
                    if sink:
                        for c in range(hd):
                            sc += qss[c] * fk[t, g, c]
                    else:
                        for c in range(hd):
                            sc += qsh[c] * fk[t, g, c]
                if sink:
                    sc += bias
                if softcap > _F0:  # gemma2's attention logit soft-cap
                    sc = softcap * math.tanh(sc / softcap)
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
                            elif jg < n_ring + n_res:
                                sv += pj * h2f(np.int32(rv[jg - n_ring, g, c]))
                            else:
                                sv += pj * fv[jg - n_ring - n_res, g, c]
                    acc[a] = sv
            cuda.syncthreads()  # pr and red are rewritten by the next tile
    inv = _F1 / l_run if l_run > _F0 else _F0  # a query that sees no key gets zeros
    for a in range(ADIM):
        c = tid + a * nt
        if c < hd:
            out[i, hq, c] = acc[a] * inv


# --- public API -----------------------------------------------------------------------

_dummies: dict = {}


def _dummy(dtype, shape=(1, 1, 1)):
    key = (np.dtype(dtype), shape)
    if key not in _dummies:
        _dummies[key] = cuda.to_device(np.zeros(shape, dtype))
    return _dummies[key]


def ring_arrays(kind: str, q_arr, scale_arr):
    """(h, b, s) kernel inputs for one of a ring's K or V: q_arr the device copy of the host
    ring array viewed as uint16 (f16) or uint8 (int8/int4), scale_arr its uint16 scales."""
    if not _SPEC[kind].quantized:
        return q_arr, _dummy(np.uint8), _dummy(np.uint16)
    return _dummy(np.uint16), q_arr, scale_arr


def _check_kind(kind: str, hd: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}; one of {KINDS}")
    _check_hd(hd)


def _check_hd(hd: int) -> None:
    if hd <= 0 or hd % GROUP or hd > MAX_HD:
        raise ValueError(f"head dim {hd} must be a positive multiple of {GROUP}, at most {MAX_HD}")


def _f32_3d(name, a):
    if a.dtype != np.float32 or a.ndim != 3 or not a.is_c_contiguous():
        raise ValueError(f"{name}: {a.dtype}{a.shape} must be a float32 (n, heads, hd) device array, C-contiguous")


def hadamard_(x):
    """x = H x in place over the last axis of x (..., hd) float32 C-contiguous (see kernels_cpu)."""
    hd = x.shape[x.ndim - 1]
    _check_hd(hd)
    rows = x.size // hd
    if rows:
        _launch(_hadamard_kernel, *launch.elementwise(rows), x.reshape(rows, hd), hadamard_block(hd))
    return x


def kv_space(q, k, mu, kmul):
    """(H(q / kmul), H((k - mu) * kmul)): queries q (n, H, hd) and keys k (m, Hkv, hd) float32
    device arrays (k None: queries only, and None back) moved into an int ring's key space, with
    mu, kmul (Hkv, hd) float32 on the device; query head h uses kv head h // (H // Hkv)'s kmul.
    The same operations as kernels_cpu.kvquant.kv_space, so the same bits. Returns new arrays."""
    _f32_3d("kv_space q", q)
    n, nh, hd = q.shape
    _check_hd(hd)
    nkv = mu.shape[0]
    keys = k is not None
    k = k if keys else _dummy(np.float32, (0, nkv, hd))
    _f32_3d("kv_space k", k)
    if (k.shape[1:] != (nkv, hd) or nh % nkv or tuple(mu.shape) != (nkv, hd) or tuple(kmul.shape) != (nkv, hd)
            or mu.dtype != np.float32 or kmul.dtype != np.float32):
        raise ValueError(f"kv_space: q {q.shape}, k {k.shape}, mu {mu.dtype}{mu.shape}, kmul {kmul.dtype}{kmul.shape} do not fit")
    qo = cuda.device_array(q.shape, np.float32)
    ko = cuda.device_array(k.shape, np.float32)
    total = n * nh + k.shape[0] * nkv
    if total:
        _launch(_kv_space_kernel, *launch.elementwise(total), q, k, mu, kmul, hadamard_block(hd), qo, ko)
    return qo, ko if keys else None


def sink_bias(q, q_sink, mu):
    """(n, H) float32 device array: (q_sink - q) . mu per query and head (q, q_sink (n, H, hd)
    before the key-space move; mu (Hkv, hd)): what sink scores add back for the key offset
    (edgekv.kvcache.LayerKV.sink_bias)."""
    _f32_3d("sink_bias q", q)
    _f32_3d("sink_bias q_sink", q_sink)
    n, nh, hd = q.shape
    if q_sink.shape != q.shape or mu.ndim != 2 or mu.shape[1] != hd or nh % mu.shape[0]:
        raise ValueError(f"sink_bias: q {q.shape}, q_sink {q_sink.shape}, mu {mu.shape} do not fit")
    out = cuda.device_array((n, nh), np.float32)
    if n * nh:
        _launch(_sink_bias_kernel, *launch.elementwise(n * nh), q, q_sink, mu, out)
    return out


def kv_store(kind: str, x, ring: tuple, rows, slots, rotate: bool) -> None:
    """Quantize rows `rows` (m,) int64 of x (n, Hkv, hd) float32 into ring slots (m,) int64
    (distinct) of ring = ring_arrays(...), Hadamard-rotating each row first when rotate."""
    _f32_3d("kv_store", x)
    _check_kind(kind, x.shape[2])
    if rows.dtype != np.int64 or slots.dtype != np.int64 or rows.shape != slots.shape:
        raise ValueError("kv_store: rows and slots must be int64 arrays of one length")
    total = rows.shape[0] * x.shape[1]
    if total:
        _launch(_store_kernel, *launch.elementwise(total), _KIND_ID[kind], x, rows, slots,
                bool(rotate), hadamard_block(x.shape[2]), *ring)


def store_f16_rows(k, v, rows, dst, rk, rv) -> None:
    """The exact copies: rk[dst], rv[dst] = f16 of k[rows], v[rows] (k, v (n, Hkv, hd) float32;
    rk, rv (r, Hkv, hd) uint16 half bits; rows, dst (m,) int64), rounded as numpy's astype."""
    _f32_3d("store_f16_rows k", k)
    _f32_3d("store_f16_rows v", v)
    if v.shape != k.shape or rk.dtype != np.uint16 or rv.shape != rk.shape or rk.shape[1:] != k.shape[1:]:
        raise ValueError(f"store_f16_rows: k {k.shape}, v {v.shape}, rk {rk.dtype}{rk.shape}, rv {rv.shape} do not fit")
    if rows.dtype != np.int64 or dst.dtype != np.int64 or rows.shape != dst.shape:
        raise ValueError("store_f16_rows: rows and dst must be int64 arrays of one length")
    total = rows.shape[0] * k.shape[1] * k.shape[2]
    if total:
        _launch(_f16_rows_kernel, *launch.elementwise(total), k, v, rows, dst, rk, rv)


def set_pos(pos, slots, vals) -> None:
    """pos[slots] = vals on the device (all int64)."""
    if slots.shape[0]:
        _launch(_set_pos_kernel, *launch.elementwise(slots.shape[0]), pos, slots, vals)


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
                 fresh_k, fresh_v, fresh_pos, scale: float, window: int, out=None, *, recent_k=None,
                 recent_v=None, recent_pos=None, recent: int = 0, exact_lo: int = 0, first: int = 0,
                 fresh_all: bool = True, sink_bias=None, softcap: float = 0.0):
    """softmax(q K^T * scale + mask) V over ring slots 0..n_ring-1 (K, V = ring_arrays(...), pos
    (cap,) int64 on the device, -1 = empty), the exact slots recent_k, recent_v (r, Hkv, hd)
    uint16 half bits at recent_pos (r,) int64 (None = none) and fresh keys fresh_k, fresh_v
    (m, Hkv, hd) float32 at fresh_pos (m,) int64: the semantics of
    kernels_cpu.kvquant.kv_attention, arguments of the same names (q_sink None = q; keys in
    stored space; v never rotated; positions below `first` and the last `recent` from exact_lo
    on read from exact copies; sink_bias (n, H) float32 or None; softcap > 0: scores
    softcap * tanh(s / softcap)). q (n, H, hd) float32.
    Returns out (n, H, hd)."""
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
    if recent_k is None and recent_v is None and recent_pos is None:
        recent_k = recent_v = _dummy(np.uint16, (0, nkv, hd))
        recent_pos = _dummy(np.int64, (0,))
    if (recent_k is None or recent_v is None or recent_pos is None or recent_k.dtype != np.uint16
            or recent_k.shape[1:] != (nkv, hd) or recent_v.shape != recent_k.shape
            or recent_pos.shape != (recent_k.shape[0],) or recent_pos.dtype != np.int64):
        raise ValueError("kv_attention: recent_k, recent_v must be uint16 (r, Hkv, hd) and recent_pos int64 (r,)")
    if recent < 0 or first < 0:
        raise ValueError(f"kv_attention: recent={recent}, first={first} must be >= 0")
    if sink_bias is None:
        sink_bias = _dummy(np.float32, (0, 0))
    elif sink_bias.dtype != np.float32 or tuple(sink_bias.shape) != (n, nh):
        raise ValueError(f"kv_attention: sink_bias {sink_bias.dtype}{sink_bias.shape} must be float32 ({n}, {nh})")
    t = launch.threads()
    if hd > ADIM * t:
        raise ValueError(f"kv_attention: head dim {hd} needs more than {t} threads")
    out = cuda.device_array(q.shape, np.float32) if out is None else out
    if n:
        _launch(_attn_kernel, n * nh, t, _KIND_ID[kind], q, q_sink, q_pos, *K, *V, pos, int(n_ring), int(n_sink),
                fresh_k, fresh_v, fresh_pos, recent_k, recent_v, recent_pos, int(recent), int(exact_lo), int(first),
                bool(fresh_all), sink_bias, np.float32(scale), int(window), np.float32(softcap), out)
    return out
