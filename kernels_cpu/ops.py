"""The non-matmul kernels of the forward pass: norms, rotary embedding, gated activations and
residual adds, plus `_expf`, which kvquant's attention shares.
Attention itself lives in kvquant.py, over f16, int8 and int4 rings alike.

Inputs are float32 arrays and should be C-contiguous: the
wrappers check dtypes and shapes and raise ValueError on misuse, allocate `out` when it is
not given, and never copy a contiguous input; the jitted cores trust their inputs. At decode
(one token) these run ~10 times per layer per token, so the wrappers stay thin (about a
microsecond of checks) and small inputs take a serial core, because waking the thread pool
costs more than the work. The `*_PAR_MIN` constants choose the parallel core; tests patch
them to reach both paths.
"""
from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange

from .simd import bits_as_f32

# Sizes (elements) from which the parallel core won on a 2-core znver4, where waking the pool costs ~2.5 us; below them, serial.
ELEMENTWISE_PAR_MIN = 1 << 16  # silu_mul, gelu_mul
RMSNORM_PAR_MIN = 1 << 16
ROPE_PAR_MIN = 1 << 14  # sin/cos per token make rope heavier per element

# numpy's builtin dtypes are singletons, so `a.dtype is _F32` is the cheapest exact check
_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)

# Arithmetic stays float32: numba would widen float32 * python-float to float64.
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_HALF = np.float32(0.5)
# Options of every core. Reassociation lets the reductions vectorize; nnan/ninf stay off so
# comparisons keep meaning. error_model="numpy" drops python's ZeroDivisionError check on
# float division, a branch that stops LLVM from vectorizing the loop around it.
_FM = {"nsz", "arcp", "contract", "reassoc", "afn"}
_KERNEL = dict(cache=True, error_model="numpy", fastmath=_FM)


# --- scalar helpers -------------------------------------------------------------------


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 split in two so n*ln2 subtracts exactly
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.0)  # exp(-87) ~ 1.6e-38 is still a normal float32
_EXP_HI = np.float32(88.0)  # 2**127 stays below the exponent limit
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)


@njit(inline="always", **_KERNEL)
def _expf(x):
    """exp for float32 within ~2 ulp (Cephes polynomial). Written out because LLVM only
    vectorizes libm's expf with SVML, which numba rarely has; softmax and the gated
    activations are bound by this call. Inputs are clamped to [-87, 88]."""
    x = min(max(x, _EXP_LO), _EXP_HI)
    n = np.floor(x * _LOG2E + _HALF)
    r = x - n * _LN2_HI - n * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    y = p * r * r + r + _F1
    return y * bits_as_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


# --- rmsnorm --------------------------------------------------------------------------


@njit(inline="always", **_KERNEL)
def _rmsnorm_row(x, w, eps, out, r):
    d = x.shape[1]
    ss = 0.0  # float64 sum of squares, as ggml does
    for j in range(d):
        xj = np.float64(x[r, j])
        ss += xj * xj
    s = np.float32(1.0 / math.sqrt(ss / d + eps))
    for j in range(d):
        out[r, j] = (x[r, j] * s) * w[j]


@njit(**_KERNEL)
def _rmsnorm_serial(x, w, eps, out):
    for r in range(x.shape[0]):
        _rmsnorm_row(x, w, eps, out, r)


@njit(parallel=True, **_KERNEL)
def _rmsnorm_parallel(x, w, eps, out):
    for r in prange(x.shape[0]):
        _rmsnorm_row(x, w, eps, out, r)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """y = x / sqrt(mean(x**2) + eps) * w over the last axis of x (..., d), w (d,), float32.

    Any leading shape works, so per-head QK-norm passes x (n, heads, hd) with w (hd,).
    out (C-contiguous) may be x itself. Returns out."""
    d = w.shape[0]
    if x.dtype is not _F32 or w.dtype is not _F32 or w.ndim != 1 or x.shape[-1] != d:
        raise ValueError(f"rmsnorm: x {x.dtype}{x.shape}, w {w.dtype}{w.shape} must be float32 (..., d), (d,)")
    if out is None:
        out = np.empty(x.shape, _F32)
    elif out.dtype is not _F32 or out.shape != x.shape or not out.flags.c_contiguous:
        raise ValueError(f"rmsnorm: out {out.dtype}{out.shape} must be float32 {x.shape}, C-contiguous")
    x2 = x.reshape(-1, d)  # (rows, d): a view of a contiguous x
    o2 = out.reshape(-1, d)  # a view: out is contiguous, so results land in out
    # float(): a numpy-scalar eps would compile another specialization of the core
    if x.size >= RMSNORM_PAR_MIN:
        _rmsnorm_parallel(x2, w, float(eps), o2)
    else:
        _rmsnorm_serial(x2, w, float(eps), o2)
    return out


# --- rotary position embedding --------------------------------------------------------


# No fast-math here: the float64 angle and libm's sin/cos must keep full precision.
_ROPE = dict(cache=True, error_model="numpy")


@njit(inline="always", **_ROPE)
def _rope_token(x, pos, inv_freq, neox, nh, t, cs, sn, mag):
    # mag: ggml's attn_factor, on cos and sin, so it scales the rotated dims only
    half = inv_freq.shape[0]
    p = np.float64(pos[t])
    for i in range(half):
        # float64 angle: at positions ~1e7 a float32 angle would be off by radians
        a = p * inv_freq[i]
        cs[i] = np.float32(math.cos(a) * mag)
        sn[i] = np.float32(math.sin(a) * mag)
    for h in range(nh):
        if neox:
            for i in range(half):
                x0 = x[t, h, i]
                x1 = x[t, h, i + half]
                x[t, h, i] = x0 * cs[i] - x1 * sn[i]
                x[t, h, i + half] = x0 * sn[i] + x1 * cs[i]
        else:
            for i in range(half):
                x0 = x[t, h, 2 * i]
                x1 = x[t, h, 2 * i + 1]
                x[t, h, 2 * i] = x0 * cs[i] - x1 * sn[i]
                x[t, h, 2 * i + 1] = x0 * sn[i] + x1 * cs[i]


@njit(**_ROPE)
def _rope_serial(x, pos, inv_freq, neox, nh, mag):
    half = inv_freq.shape[0]
    cs = np.empty(half, np.float32)
    sn = np.empty(half, np.float32)
    for t in range(x.shape[0]):
        _rope_token(x, pos, inv_freq, neox, nh, t, cs, sn, mag)


@njit(parallel=True, **_ROPE)
def _rope_parallel(x, pos, inv_freq, neox, nh, mag):
    half = inv_freq.shape[0]
    for t in prange(x.shape[0]):
        cs = np.empty(half, np.float32)
        sn = np.empty(half, np.float32)
        _rope_token(x, pos, inv_freq, neox, nh, t, cs, sn, mag)


_inv_freq_cache: dict[tuple[float, int, float], np.ndarray] = {}


def rope_freqs(theta_base: float, n_rot: int, freq_scale: float = 1.0) -> np.ndarray:
    """(n_rot/2,) float64: freq_scale * theta_base**(-2i/n_rot), pair i's angle per position;
    made once per (base, n_rot, scale)."""
    f = _inv_freq_cache.get((theta_base, n_rot, freq_scale))
    if f is None:
        f = freq_scale * np.power(np.float64(theta_base), -np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        _inv_freq_cache[(theta_base, n_rot, freq_scale)] = f
    return f


def rope(
    x: np.ndarray,
    pos: np.ndarray,
    theta_base: float,
    neox: bool,
    n_rot: int,
    freq_scale: float = 1.0,
    heads: int | None = None,
) -> np.ndarray:
    """Rotate x (n, heads, hd) float32 in place by token positions pos (n,) int64.

    Pair i (i < n_rot/2) turns by pos * theta_base**(-2i/n_rot) * freq_scale, the angle in
    float64. neox=False is llama.cpp's NORM rope (pairs x[2i], x[2i+1]; llama), neox=True
    its NEOX rope (pairs x[i], x[i + n_rot/2]; gemma3). Dims from n_rot on are left as
    they are. heads: rotate only heads [0, heads) (q and k side by side in one fused QKV output,
    v after them untouched). Returns x."""
    if n_rot % 2 or not 0 < n_rot <= x.shape[-1]:
        raise ValueError(f"rope: n_rot={n_rot} must be even and within head_dim {x.shape[-1]}")
    return rotate(x, pos, rope_freqs(theta_base, n_rot, freq_scale), neox, heads)


def rotate(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, neox: bool, heads: int | None = None,
           mag: float = 1.0) -> np.ndarray:
    """rope with any per-pair frequencies: pair i turns by pos * inv_freq[i] ((n_rot/2,) float64;
    llama3 factors and YaRN are such frequencies, edgekv/rope.py), and the rotated dims are
    multiplied by mag (ggml's attn_factor; dims from n_rot on stay as they are). Returns x,
    rotated in place."""
    if x.dtype is not _F32 or x.ndim != 3 or pos.dtype is not _I64 or pos.shape != x.shape[:1]:
        raise ValueError(
            f"rope: x {x.dtype}{x.shape} must be float32 (n, heads, hd), pos {pos.dtype}{pos.shape} int64 (n,)"
        )
    if inv_freq.dtype != np.float64 or inv_freq.ndim != 1 or not 0 < 2 * inv_freq.shape[0] <= x.shape[2]:
        raise ValueError(f"rope: frequencies {inv_freq.dtype}{inv_freq.shape} must be float64 (n_rot/2,) "
                         f"within head_dim {x.shape[2]}")
    nh = x.shape[1] if heads is None else heads
    if not 0 <= nh <= x.shape[1]:
        raise ValueError(f"rope: heads={heads} outside the {x.shape[1]} heads of x")
    if x.size >= ROPE_PAR_MIN:
        _rope_parallel(x, pos, inv_freq, bool(neox), nh, float(mag))
    else:
        _rope_serial(x, pos, inv_freq, bool(neox), nh, float(mag))
    return x


# --- gated activations ----------------------------------------------------------------

_GELU_C = np.float32(-2.0 * math.sqrt(2.0 / math.pi))  # -2 * sqrt(2/pi)
_GELU_A = np.float32(0.044715)


@njit(inline="always", **_KERNEL)
def _silu_mul_1d(g, u, out):
    # indices from range(shape) are known non-negative, so no wraparound blocks vectorizing
    for i in range(g.shape[0]):
        x = g[i]
        out[i] = x / (_F1 + _expf(-x)) * u[i]


@njit(inline="always", **_KERNEL)
def _gelu_mul_1d(g, u, out):
    # 0.5*x*(1 + tanh(z)) == x / (1 + exp(-2z)): one exp, and no cancellation for x << 0
    for i in range(g.shape[0]):
        x = g[i]
        out[i] = x / (_F1 + _expf(_GELU_C * (x + _GELU_A * x * x * x))) * u[i]


_CHUNK = 8192  # elements per parallel task


@njit(**_KERNEL)
def _silu_mul_serial(g, u, out):
    _silu_mul_1d(g, u, out)


@njit(parallel=True, **_KERNEL)
def _silu_mul_parallel(g, u, out):
    n = g.shape[0]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(n, (c + 1) * _CHUNK)
        _silu_mul_1d(g[lo:hi], u[lo:hi], out[lo:hi])


@njit(**_KERNEL)
def _gelu_mul_serial(g, u, out):
    _gelu_mul_1d(g, u, out)


@njit(parallel=True, **_KERNEL)
def _gelu_mul_parallel(g, u, out):
    n = g.shape[0]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        lo, hi = c * _CHUNK, min(n, (c + 1) * _CHUNK)
        _gelu_mul_1d(g[lo:hi], u[lo:hi], out[lo:hi])


def _check_pair(name: str, a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if a.dtype is not _F32 or b.dtype is not _F32 or a.shape != b.shape:
        raise ValueError(f"{name}: {a.dtype}{a.shape} and {b.dtype}{b.shape} must be float32 of one shape")
    if out is None:
        return np.empty(a.shape, _F32)
    if out.dtype is not _F32 or out.shape != a.shape or not out.flags.c_contiguous:
        raise ValueError(f"{name}: out {out.dtype}{out.shape} must be float32 {a.shape}, C-contiguous")
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out = silu(gate) * up (SwiGLU), elementwise over float32 arrays of one shape such as
    (n, n_ff); out (C-contiguous) may be gate or up. Returns out."""
    out = _check_pair("silu_mul", gate, up, out)
    if gate.size >= ELEMENTWISE_PAR_MIN:
        _silu_mul_parallel(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
    else:
        _silu_mul_serial(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
    return out


def gelu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out = gelu(gate) * up (GeGLU) with the tanh form of gelu that ggml uses,
    0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3))); same contract as silu_mul."""
    out = _check_pair("gelu_mul", gate, up, out)
    if gate.size >= ELEMENTWISE_PAR_MIN:
        _gelu_mul_parallel(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
    else:
        _gelu_mul_serial(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
    return out


# --- residual add, scale, row lookup --------------------------------------------------
# numpy's ufuncs are vectorized already and cost less per call than a numba dispatch.


def add(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """out = a + b for float32 arrays of one shape; out may be a or b. Returns out."""
    out = _check_pair("add", a, b, out)
    return np.add(a, b, out=out)


def add_(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a += b in place (the residual stream), float32 arrays of one shape. Returns a."""
    if a.dtype is not _F32 or b.dtype is not _F32 or a.shape != b.shape:
        raise ValueError(f"add_: {a.dtype}{a.shape} and {b.dtype}{b.shape} must be float32 of one shape")
    return np.add(a, b, out=a)


def scale_(x: np.ndarray, s: float) -> np.ndarray:
    """x *= s in place (gemma scales embeddings by sqrt(n_embd)), float32. Returns x."""
    if x.dtype is not _F32:
        raise ValueError(f"scale_: x must be float32, not {x.dtype}")
    return np.multiply(x, np.float32(s), out=x)


def get_rows_f32(table: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Rows of a float32 table (vocab, d) for integer ids (n,) -> (n, d); IndexError when an
    id is out of range. Quantized tables go through qmatmul's row dequantization."""
    if table.dtype is not _F32 or table.ndim != 2 or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"get_rows_f32: table {table.dtype}{table.shape} must be float32 (vocab, d), "
            f"ids {ids.dtype}{ids.shape} integer (n,)"
        )
    if out is None:
        out = np.empty((ids.shape[0], table.shape[1]), _F32)
    return np.take(table, ids, axis=0, out=out)
