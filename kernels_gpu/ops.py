"""GPU twins of kernels_cpu/ops.py: RMSNorm, RoPE, gated activations, residual adds, plus the
half-float and block-reduction helpers the other GPU modules share.

Inputs are numba device arrays of float32. Halves are decoded and encoded with integer and
power-of-two float arithmetic only (no float16 type, no bit casts): the same code then runs on
every GPU generation and, exactly, under the CUDA simulator, and rounds like numpy's astype.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from . import launch
from .launch import blocks, launch as _launch

MAXT = launch.MAX_THREADS  # compile-time size of shared reduction arrays
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_NEG = np.float32(-3.0e38)  # "no score yet"; finite, so no inf arithmetic is needed
_GELU_C = np.float32(-2.0 * math.sqrt(2.0 / math.pi))  # x / (1 + exp(-2z)) == 0.5x(1 + tanh z)
_GELU_A = np.float32(0.044715)


# --- device helpers -------------------------------------------------------------------


@cuda.jit(device=True)
def h2f(h):
    """float32 of IEEE half bits h (0..65535): m * 2**-24 for subnormals, (1024 + m) * 2**(e-25)
    for normals; exact for every half."""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = np.float32(m) * np.float32(5.960464477539063e-08)
    elif e == 31:
        v = np.float32(math.inf) if m == 0 else np.float32(math.nan)
    else:
        v = np.float32(m + 1024) * np.float32(1 << e) * np.float32(2.9802322387695312e-08)
    return -v if h & 0x8000 else v


@cuda.jit(device=True)
def half_at(w, r, o):
    """float32 of the little-endian half at bytes o, o+1 of row r of a uint8 array."""
    return h2f(np.int32(w[r, o]) | (np.int32(w[r, o + 1]) << 8))


@cuda.jit(device=True)
def rne(y):
    """y >= 0 rounded to the nearest integer, ties to even (numpy's rint), as float32."""
    f = math.floor(y)
    r = y - f
    if r > 0.5 or (r == 0.5 and f % 2 == 1):
        f += 1
    return np.float32(f)


@cuda.jit(device=True)
def rint(y):
    return -rne(-y) if y < 0 else rne(y)


@cuda.jit(device=True)
def f2h(x):
    """IEEE half bits (0..65535) of float32 x, rounded to nearest even like numpy's astype(float16):
    every step scales by a power of two, so it is exact."""
    s = 0x8000 if math.copysign(_F1, x) < 0 else 0
    a = abs(x)
    if a != a:
        return s | 0x7E00
    if a >= np.float32(65520.0):
        return s | 0x7C00
    if a < np.float32(6.103515625e-05):  # below 2**-14: subnormal, m * 2**-24 (m = 1024 is the first normal)
        return s | np.int32(rne(a * np.float32(16777216.0)))
    b = 1  # biased exponent: a in [p, 2p), p = 2**(b - 15)
    p = np.float32(6.103515625e-05)
    while b < 30 and a >= p * np.float32(2.0):
        p *= np.float32(2.0)
        b += 1
    m = np.int32(rne((a / p - _F1) * np.float32(1024.0)))
    if m == 1024:  # rounded up into the next binade
        m = 0
        b += 1
    return s | (b << 10) | m


@cuda.jit(device=True)
def tree_sum(red, t, nt):
    """red[0] = sum of red[:nt] (nt a power of two); every thread of the block must call it.
    For this module's kernels only (see kvquant.py on device functions that synchronize)."""
    s = nt // 2
    while s > 0:
        if t < s:
            red[t] += red[t + s]
        cuda.syncthreads()
        s //= 2


# --- kernels --------------------------------------------------------------------------


@cuda.jit
def _rmsnorm_kernel(x, w, eps, out):
    r = cuda.blockIdx.x  # one block per row
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    d = x.shape[1]
    red = cuda.shared.array(MAXT, np.float32)
    s = _F0
    for j in range(t, d, nt):
        v = x[r, j]
        s += v * v
    red[t] = s
    cuda.syncthreads()
    tree_sum(red, t, nt)
    sc = np.float32(1.0 / math.sqrt(np.float64(red[0]) / d + eps))
    for j in range(t, d, nt):
        out[r, j] = (x[r, j] * sc) * w[j]


@cuda.jit
def _rope_kernel(x, pos, inv_freq, neox, mag):
    n, nh = x.shape[0], x.shape[1]
    half = inv_freq.shape[0]
    i = cuda.grid(1)
    if i >= n * nh * half:
        return
    p = i % half
    th = i // half
    h = th % nh
    t = th // nh
    a = np.float64(pos[t]) * inv_freq[p]  # float64: at positions ~1e7 a float32 angle is off by radians
    c = np.float32(math.cos(a) * mag)  # mag: ggml's attn_factor, on the rotated dims only
    s = np.float32(math.sin(a) * mag)
    if neox:
        i0 = p
        i1 = p + half
    else:
        i0 = 2 * p
        i1 = 2 * p + 1
    x0 = x[t, h, i0]
    x1 = x[t, h, i1]
    x[t, h, i0] = x0 * c - x1 * s
    x[t, h, i1] = x0 * s + x1 * c


@cuda.jit
def _silu_mul_kernel(g, u, out):
    r = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j < g.shape[1]:
        x = g[r, j]
        out[r, j] = x / (_F1 + math.exp(-x)) * u[r, j]


@cuda.jit
def _gelu_mul_kernel(g, u, out):
    r = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j < g.shape[1]:
        x = g[r, j]
        out[r, j] = x / (_F1 + math.exp(_GELU_C * (x + _GELU_A * x * x * x))) * u[r, j]


@cuda.jit
def _add_kernel(a, b):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] += b[i]


@cuda.jit
def _scale_kernel(a, s):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] *= s


@cuda.jit
def _add_rows_kernel(x, b):
    r = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j < x.shape[1]:
        x[r, j] += b[j]


@cuda.jit
def _copy2d_kernel(src, dst):
    r = cuda.blockIdx.y
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j < src.shape[1]:
        dst[r, j] = src[r, j]


@cuda.jit
def _copy3d_kernel(src, dst):
    r = cuda.blockIdx.y  # (token, head) pair
    h = r % src.shape[1]
    t = r // src.shape[1]
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if j < src.shape[2]:
        dst[t, h, j] = src[t, h, j]


# --- public wrappers ------------------------------------------------------------------


def _f32(name: str, a, ndim: int | None = None, contiguous: bool = True) -> None:
    if a.dtype != np.float32 or (ndim is not None and a.ndim != ndim) or (contiguous and not a.is_c_contiguous()):
        want = f"{ndim}-d " if ndim else ""
        raise ValueError(f"{name}: {a.dtype}{a.shape} must be a {want}float32 device array{', C-contiguous' if contiguous else ''}")


def empty(shape, dtype=np.float32):
    return cuda.device_array(shape, dtype)


def rmsnorm(x, w, eps: float, out=None):
    """y = x / sqrt(mean(x**2) + eps) * w over the last axis of x (..., d) (C-contiguous), w (d,).
    out may be x. Returns out."""
    _f32("rmsnorm", x)
    _f32("rmsnorm", w, 1)
    d = w.shape[0]
    if x.shape[x.ndim - 1] != d:
        raise ValueError(f"rmsnorm: x {x.shape} does not end in w's {d}")
    out = empty(x.shape) if out is None else out
    rows = x.size // d
    if rows:
        _launch(_rmsnorm_kernel, rows, launch.threads(), x.reshape(rows, d), w, float(eps), out.reshape(rows, d))
    return out


def rope(x, pos, inv_freq, neox: bool, mag: float = 1.0):
    """Rotate x (n, heads, hd) in place by positions pos (n,) int64; inv_freq (n_rot/2,) float64
    holds pair i's angle per position, the rotated dims times mag (kernels_cpu.ops.rotate). x
    may be a strided view (the q and k heads of a fused QKV). Returns x."""
    _f32("rope", x, 3, contiguous=False)
    n, nh, hd = x.shape
    if pos.dtype != np.int64 or pos.shape != (n,) or inv_freq.dtype != np.float64 or 2 * inv_freq.shape[0] > hd:
        raise ValueError(f"rope: pos {pos.dtype}{pos.shape} must be int64 ({n},), inv_freq float64 of at most {hd // 2}")
    total = n * nh * inv_freq.shape[0]
    if total:
        _launch(_rope_kernel, *launch.elementwise(total), x, pos, inv_freq, bool(neox), float(mag))
    return x


def _gated(kernel, name, g, u, out):
    if g.dtype != np.float32 or u.dtype != np.float32 or g.ndim != 2 or g.shape != u.shape:
        raise ValueError(f"{name}: {g.dtype}{g.shape} and {u.dtype}{u.shape} must be float32 (n, f) of one shape")
    out = empty(g.shape) if out is None else out
    n, f = g.shape
    if n and f:
        _launch(kernel, (blocks(f, launch.ELEMWISE), n), launch.ELEMWISE, g, u, out)
    return out


def silu_mul(g, u, out=None):
    """out = silu(g) * u over (n, f) arrays; g and u may be column slices (strided). Returns out."""
    return _gated(_silu_mul_kernel, "silu_mul", g, u, out)


def gelu_mul(g, u, out=None):
    """out = gelu(g) * u (ggml's tanh form) over (n, f) arrays, as silu_mul."""
    return _gated(_gelu_mul_kernel, "gelu_mul", g, u, out)


def add_(a, b):
    """a += b over C-contiguous float32 arrays of one shape. Returns a."""
    _f32("add_", a)
    _f32("add_", b)
    if a.shape != b.shape:
        raise ValueError(f"add_: shapes {a.shape} and {b.shape} differ")
    if a.size:
        _launch(_add_kernel, *launch.elementwise(a.size), a.reshape(a.size), b.reshape(b.size))
    return a


def scale_(a, s: float):
    """a *= s in place (C-contiguous float32). Returns a."""
    _f32("scale_", a)
    if a.size:
        _launch(_scale_kernel, *launch.elementwise(a.size), a.reshape(a.size), np.float32(s))
    return a


def add_rows_(x, b):
    """x (n, m) += b (m,) on every row (biases). Returns x."""
    _f32("add_rows_", x, 2, contiguous=False)
    _f32("add_rows_", b, 1)
    if x.shape[1] != b.shape[0]:
        raise ValueError(f"add_rows_: x {x.shape} and b {b.shape} do not fit")
    if x.size:
        _launch(_add_rows_kernel, (blocks(x.shape[1], launch.ELEMWISE), x.shape[0]), launch.ELEMWISE, x, b)
    return x


def contiguous(a):
    """a itself when C-contiguous, else a C-contiguous copy of the 2-d or 3-d (strided) float32 a."""
    if a.is_c_contiguous():
        return a
    if a.ndim not in (2, 3) or a.dtype != np.float32:
        raise ValueError(f"contiguous: only 2-d and 3-d float32 slices are copied, not {a.dtype}{a.shape}")
    out = empty(a.shape)
    if a.size:
        rows = a.shape[0] * (a.shape[1] if a.ndim == 3 else 1)
        kern = _copy3d_kernel if a.ndim == 3 else _copy2d_kernel
        _launch(kern, (blocks(a.shape[a.ndim - 1], launch.ELEMWISE), rows), launch.ELEMWISE, a, out)
    return out
