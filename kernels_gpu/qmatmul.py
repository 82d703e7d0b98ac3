"""GPU twin of kernels_cpu/qmatmul.py: x @ W.T on GGUF weights as uploaded, still in their blocks.

A weight lives on the device as its raw GGUF rows: uint8 (rows, row_bytes) for the block types,
float32 (rows, k) for F32 and uint16 half bits (rows, k) for F16 (the same bytes, typed so the
kernel reads whole values). Every type is read as "units" of 32 consecutive weights of a row:
one block of a 32-element type, one 32-wide chunk of a 256-element K super-block, 32 floats.
A matmul block owns one weight row (or MATMUL_ROWS in turn): its threads decode the row's units (each unit once) and
dot them with a tile of tokens; a shared-memory tree adds the threads' partial sums. Decode
(one token) uses a one-token tile so no work is wasted; prefill tiles TOK_TILE tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from edgekv import quants as qt
from edgekv.errors import UnsupportedModelError
from edgekv.quants import KVALUES_IQ4NL, QUANT_TYPES

from . import launch
from .launch import blocks, launch as _launch
from .ops import MAXT, _F0, h2f, half_at

# GGML type ids and block bytes from the one table (edgekv/quants.py), as module-level ints: the
# CUDA compiler takes them as constants.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = qt.F32.id, qt.F16.id, qt.Q4_0.id, qt.Q4_1.id, qt.Q5_0.id, qt.Q5_1.id, qt.Q8_0.id
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = qt.Q4_K.id, qt.Q5_K.id, qt.Q6_K.id, qt.IQ4_NL.id, qt.IQ4_XS.id
_NB_Q4_0, _NB_Q4_1, _NB_Q5_0, _NB_Q5_1, _NB_Q8_0, _NB_IQ4_NL = (
    q.block_bytes for q in (qt.Q4_0, qt.Q4_1, qt.Q5_0, qt.Q5_1, qt.Q8_0, qt.IQ4_NL))
_NB_Q4_K, _NB_Q5_K, _NB_Q6_K, _NB_IQ4_XS = (q.block_bytes for q in (qt.Q4_K, qt.Q5_K, qt.Q6_K, qt.IQ4_XS))
SUPPORTED = qt.GPU_TYPES
_KVALUES = np.array(KVALUES_IQ4NL, np.float32)  # a global array: a constant in the kernels


@cuda.jit(device=True)
def _k_scale_min(w, r, o, j):
    """(sc, m) of sub-block j of a Q4_K/Q5_K super-block at byte o, from its 12 scale bytes s:
    j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
    m = (s[j+4] >> 4) | (s[j] >> 6) << 4."""
    s = o + 4
    if j < 4:
        return np.int32(w[r, s + j]) & 63, np.int32(w[r, s + j + 4]) & 63
    a = np.int32(w[r, s + j + 4])
    return (a & 15) | ((np.int32(w[r, s + j - 4]) >> 6) << 4), (a >> 4) | ((np.int32(w[r, s + j]) >> 6) << 4)


@cuda.jit(device=True)
def decode_unit(wq, wf, wh, qtype, r, u, k, buf):
    """Weights 32u .. 32u+31 of row r as float32 into buf (32,); zeros past k (float rows only:
    block types always hold whole units)."""
    if qtype == F32:
        for l in range(32):
            c = 32 * u + l
            buf[l] = wf[r, c] if c < k else _F0
    elif qtype == F16:
        for l in range(32):
            c = 32 * u + l
            buf[l] = h2f(np.int32(wh[r, c])) if c < k else _F0
    elif qtype == Q4_0:
        # Q4_0: 32 elements per 18-byte block (d:f16, qs:16); e<16: qs[e]&15, e>=16: qs[e-16]>>4; w = d*(q-8)
        o = _NB_Q4_0 * u
        d = half_at(wq, r, o)
        for l in range(16):
            q = np.int32(wq[r, o + 2 + l])
            buf[l] = d * np.float32((q & 15) - 8)
            buf[l + 16] = d * np.float32((q >> 4) - 8)
    elif qtype == Q4_1:
        # Q4_1: 32 elements per 20-byte block (d:f16, m:f16, qs:16 as Q4_0); w = d*q + m
        o = _NB_Q4_1 * u
        d = half_at(wq, r, o)
        m = half_at(wq, r, o + 2)
        for l in range(16):
            q = np.int32(wq[r, o + 4 + l])
            buf[l] = d * np.float32(q & 15) + m
            buf[l + 16] = d * np.float32(q >> 4) + m
    elif qtype == Q5_0 or qtype == Q5_1:
        # Q5_0: 22-byte block (d:f16, qh:4 little-endian, bit e = bit 4 of element e, qs:16 as Q4_0),
        #   w = d*(q-16); Q5_1: 24-byte block (d:f16, m:f16, qh:4, qs:16), w = d*q + m
        has_m = qtype == Q5_1
        o = (_NB_Q5_1 if has_m else _NB_Q5_0) * u
        d = half_at(wq, r, o)
        m = half_at(wq, r, o + 2) if has_m else _F0
        hq = o + (4 if has_m else 2)
        qh = (np.int32(wq[r, hq]) | (np.int32(wq[r, hq + 1]) << 8) | (np.int32(wq[r, hq + 2]) << 16)
              | (np.int32(wq[r, hq + 3]) << 24))
        off = 0 if has_m else 16
        for l in range(16):
            q = np.int32(wq[r, hq + 4 + l])
            lo = (q & 15) | (((qh >> l) & 1) << 4)
            hi = (q >> 4) | (((qh >> (l + 16)) & 1) << 4)
            buf[l] = d * np.float32(lo - off) + m
            buf[l + 16] = d * np.float32(hi - off) + m
    elif qtype == Q8_0:
        # Q8_0: 32 elements per 34-byte block (d:f16, qs:32 int8); w = d*q
        o = _NB_Q8_0 * u
        d = half_at(wq, r, o)
        for l in range(32):
            q = np.int32(wq[r, o + 2 + l])
            buf[l] = d * np.float32(q - 256 if q > 127 else q)
    elif qtype == Q4_K or qtype == Q5_K:
        # Q4_K: 256 elements per 144-byte super-block (d:f16, dmin:f16, scales:12, qs:128);
        #   chunk c = 2i + s: q = (qs[32i + l] >> 4s) & 15; w = d*sc*q - dmin*m.
        # Q5_K: 176 bytes (d, dmin, scales:12, qh:32, qs:128); q as Q4_K plus bit 4 = (qh[l] >> c) & 1.
        five = qtype == Q5_K
        o = (_NB_Q5_K if five else _NB_Q4_K) * (u // 8)
        c = u % 8
        d = half_at(wq, r, o)
        dmin = half_at(wq, r, o + 2)
        sc, mn = _k_scale_min(wq, r, o, c)
        ds = d * np.float32(sc)
        dm = dmin * np.float32(mn)
        qs = o + (48 if five else 16) + 32 * (c // 2)
        sh = 4 * (c % 2)
        for l in range(32):
            q = (np.int32(wq[r, qs + l]) >> sh) & 15
            if five:
                q |= ((np.int32(wq[r, o + 16 + l]) >> c) & 1) << 4
            buf[l] = ds * np.float32(q) - dm
    elif qtype == IQ4_NL or qtype == IQ4_XS:
        # IQ4_NL: 32 elements per 18-byte block (d:f16, qs:16 nibbles as Q4_0, indices into
        #   KVALUES_IQ4NL); w = d*KVALUES[q].
        # IQ4_XS: 256 elements per 136-byte super-block (d:f16, scales_h:u16, scales_l:4, qs:128);
        #   sub-block c of 32: ls = (scales_l[c/2] >> 4(c%2)) & 15 | ((scales_h >> 2c) & 3) << 4,
        #   quants qs[16c:16c+16] as IQ4_NL's; w = d*(ls-32)*KVALUES[q].
        if qtype == IQ4_NL:
            o = _NB_IQ4_NL * u
            ds = half_at(wq, r, o)
            qs = o + 2
        else:
            o = _NB_IQ4_XS * (u // 8)
            c = u % 8
            sh = np.int32(wq[r, o + 2]) | (np.int32(wq[r, o + 3]) << 8)
            ls = ((np.int32(wq[r, o + 4 + c // 2]) >> (4 * (c % 2))) & 15) | (((sh >> (2 * c)) & 3) << 4)
            ds = half_at(wq, r, o) * np.float32(ls - 32)
            qs = o + 8 + 16 * c
        for l in range(16):
            q = np.int32(wq[r, qs + l])
            buf[l] = ds * _KVALUES[q & 15]
            buf[l + 16] = ds * _KVALUES[q >> 4]
    else:
        # Q6_K: 256 elements per 210-byte super-block (ql:128, qh:64, scales:16 int8, d:f16);
        #   chunk c = 4h + t: q = (ql[64h + 32(t&1) + l] >> 4(t>>1)) & 15 | ((qh[32h + l] >> 2t) & 3) << 4;
        #   elements 32c.. use scale 2c, 32c+16.. scale 2c+1; w = d*sc*(q-32)
        o = _NB_Q6_K * (u // 8)
        c = u % 8
        h = c // 4
        t = c % 4
        d = half_at(wq, r, o + 208)
        for half in range(2):
            s = np.int32(wq[r, o + 192 + 2 * c + half])
            ds = d * np.float32(s - 256 if s > 127 else s)
            for l in range(16 * half, 16 * half + 16):
                lo = (np.int32(wq[r, o + 64 * h + 32 * (t % 2) + l]) >> (4 * (t // 2))) & 15
                hi = (np.int32(wq[r, o + 128 + 32 * h + l]) >> (2 * t)) & 3
                buf[l] = ds * np.float32((lo | (hi << 4)) - 32)


def _make_matmul(tok: int, qtype: int):
    """The matmul kernel for a tile of `tok` tokens and one weight type, both compile-time
    constants of the closure: the compiler keeps only that type's decoder (fewer registers)."""

    @cuda.jit
    def kernel(wq, wf, wh, x, out, col0, m, rows_per_block):
        t0 = cuda.blockIdx.y * tok  # first token of the tile
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        n = x.shape[0]
        k = x.shape[1]
        buf = cuda.local.array(32, np.float32)
        acc = cuda.local.array(tok, np.float32)
        red = cuda.shared.array((tok, MAXT), np.float32)
        r0 = cuda.blockIdx.x * rows_per_block
        for r in range(r0, min(r0 + rows_per_block, m)):  # the weight row, output column col0 + r
            for j in range(tok):
                acc[j] = _F0
            for u in range(tid, (k + 31) // 32, nt):
                decode_unit(wq, wf, wh, qtype, r, u, k, buf)
                c0 = 32 * u
                for j in range(tok):
                    if t0 + j < n:
                        s = _F0
                        if c0 + 32 <= k:
                            for l in range(32):
                                s += buf[l] * x[t0 + j, c0 + l]
                        else:
                            for l in range(k - c0):
                                s += buf[l] * x[t0 + j, c0 + l]
                        acc[j] += s
            for j in range(tok):
                red[j, tid] = acc[j]
            cuda.syncthreads()
            s2 = nt // 2
            while s2 > 0:
                if tid < s2:
                    for j in range(tok):
                        red[j, tid] += red[j, tid + s2]
                cuda.syncthreads()
                s2 //= 2
            for j in range(tid, tok, nt):  # blocks may have fewer threads than tokens
                if t0 + j < n:
                    out[t0 + j, col0 + r] = red[j, 0]
            cuda.syncthreads()  # red is rewritten for the next row

    return kernel


_matmul_kernels: dict[tuple[int, int], object] = {}  # (tokens per tile, qtype) -> kernel, made on first use


def matmul_kernel(tok: int, qtype: int):
    key = (tok, qtype)
    if key not in _matmul_kernels:
        _matmul_kernels[key] = _make_matmul(tok, qtype)
    return _matmul_kernels[key]


@cuda.jit
def _rows_kernel(wq, wf, wh, qtype, ids, k, out):
    i = cuda.blockIdx.x
    u = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    buf = cuda.local.array(32, np.float32)
    if u < (k + 31) // 32:
        decode_unit(wq, wf, wh, qtype, ids[i], u, k, buf)
        for l in range(32):
            if 32 * u + l < k:
                out[i, 32 * u + l] = buf[l]


# --- public API -----------------------------------------------------------------------

_dummies: dict = {}


def _dummy(dtype):
    """A (1, 1) device array standing in for the views a weight's type does not use."""
    if dtype not in _dummies:
        _dummies[dtype] = cuda.to_device(np.zeros((1, 1), dtype))
    return _dummies[dtype]


@dataclass(frozen=True)
class DeviceWeight:
    data: object  # device array: uint8 (rows, row_bytes) blocks | float32 (rows, k) | uint16 (rows, k) half bits
    qtype: int
    n_out: int  # rows
    n_in: int  # k

    def views(self):
        """(wq, wf, wh): the kernel's three typed inputs, two of them placeholders."""
        return (self.data if self.qtype not in (F32, F16) else _dummy(np.uint8),
                self.data if self.qtype == F32 else _dummy(np.float32),
                self.data if self.qtype == F16 else _dummy(np.uint16))

    @property
    def nbytes(self) -> int:
        return int(self.data.size * self.data.dtype.itemsize)


def upload(raw: np.ndarray | list, qtype: int) -> DeviceWeight:
    """Copy a weight's raw GGUF rows, uint8 (rows, row_bytes) (or a list of same-type, same-k
    ones, stacked: fused QKV / gate+up), to the device once, still quantized."""
    parts = raw if isinstance(raw, (list, tuple)) else [raw]
    qt = QUANT_TYPES.get(qtype)
    if qtype not in SUPPORTED:
        raise UnsupportedModelError(f"GPU matmul: tensor type {qt.name if qt else f'id {qtype}'} is not supported")
    rb = parts[0].shape[1]
    for p in parts:
        if p.dtype != np.uint8 or p.ndim != 2 or p.shape[1] != rb or rb % qt.block_bytes:
            raise ValueError(f"upload: {p.dtype}{p.shape} must be uint8 (rows, {rb}) of whole {qt.name} blocks")
    host = np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0])
    k = rb // qt.block_bytes * qt.block_elems
    if qtype == F32:
        host = host.view(np.float32)
    elif qtype == F16:
        host = host.view(np.uint16)
    return DeviceWeight(cuda.to_device(host), qtype, host.shape[0], k)


def qmatmul(x, w: DeviceWeight, out=None, col0: int = 0):
    """out[:, col0:col0 + w.n_out] = x @ W.T for x (n, k) float32 C-contiguous on the device.
    out (n, >= col0 + n_out) float32 C-contiguous; allocated (n, n_out) when None. Returns out."""
    if x.dtype != np.float32 or x.ndim != 2 or not x.is_c_contiguous() or x.shape[1] != w.n_in:
        raise ValueError(f"qmatmul: x {x.dtype}{x.shape} must be float32 (n, {w.n_in}), C-contiguous")
    n = x.shape[0]
    if out is None:
        out = cuda.device_array((n, w.n_out), np.float32)
    elif out.dtype != np.float32 or out.shape[0] != n or out.shape[1] < col0 + w.n_out or not out.is_c_contiguous():
        raise ValueError(f"qmatmul: out {out.dtype}{out.shape} must be float32 ({n}, >= {col0 + w.n_out}), C-contiguous")
    if n and w.n_out:
        tile = 1 if n == 1 else launch.TOK_TILE
        rpb = max(1, launch.MATMUL_ROWS)
        _launch(matmul_kernel(tile, w.qtype), (blocks(w.n_out, rpb), blocks(n, tile)), launch.threads(), *w.views(),
                x, out, col0, w.n_out, rpb)
    return out


def dequantize_rows(w: DeviceWeight, ids, out=None):
    """float32 (len(ids), k) of rows ids (int64 device array) of w: embedding lookup."""
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise ValueError(f"dequantize_rows: ids {ids.dtype}{ids.shape} must be int64 (n,)")
    n = ids.shape[0]
    out = cuda.device_array((n, w.n_in), np.float32) if out is None else out
    if n:
        t = launch.threads()
        _launch(_rows_kernel, (n, blocks((w.n_in + 31) // 32, t)), t, *w.views(), w.qtype, ids, w.n_in, out)
    return out
