"""Oracle tests for kernels_cpu/ops.py: each kernel against a slow, obviously correct float64
numpy version written here from the definition (llama.cpp's semantics where they matter:
NORM vs NEOX rope pairs, the tanh gelu, the SWA mask `q_pos - k_pos >= window`)."""
from __future__ import annotations

import numpy as np
import pytest

from edgekv.kernels_cpu import ops

RNG = np.random.default_rng(1234)


@pytest.fixture(params=["serial", "parallel"])
def path(request, monkeypatch):
    """Run a test through the serial and the parallel cores by moving the thresholds."""
    big = 1 << 62
    for name in ("ELEMENTWISE_PAR_MIN", "RMSNORM_PAR_MIN", "ROPE_PAR_MIN"):
        monkeypatch.setattr(ops, name, 0 if request.param == "parallel" else big)
    return request.param


# --- oracles (float64) ----------------------------------------------------------------


def ref_rmsnorm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def ref_rope(x, pos, base, neox, n_rot, freq_scale):
    x = x.astype(np.float64)  # (n, heads, hd)
    y = x.copy()
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    theta = pos.astype(np.float64)[:, None] * base ** (-2.0 * i / n_rot) * freq_scale  # (n, half)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        y[..., :half] = a * c - b * s
        y[..., half:n_rot] = a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        y[..., 0:n_rot:2] = a * c - b * s
        y[..., 1:n_rot:2] = a * s + b * c
    return y


def ref_silu_mul(g, u):
    g = g.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * u.astype(np.float64)


def ref_gelu_mul(g, u):
    g = g.astype(np.float64)
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * u.astype(np.float64)


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# --- rmsnorm --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (7, 960), (64, 64), (3, 4, 256), (1, 9, 64)])
def test_rmsnorm(shape, path):
    x = randn(*shape, scale=3.0)
    w = randn(shape[-1])
    got = ops.rmsnorm(x, w, 1e-6)
    np.testing.assert_allclose(got, ref_rmsnorm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_rmsnorm_in_place_and_eps():
    x = randn(5, 128, scale=1e-3)  # small enough that eps matters
    w = randn(128)
    want = ref_rmsnorm(x, w, 1e-5)
    assert ops.rmsnorm(x, w, 1e-5, out=x) is x
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)


def test_rmsnorm_rejects_bad_inputs():
    x = randn(2, 8)
    with pytest.raises(ValueError):
        ops.rmsnorm(x, randn(7), 1e-5)
    with pytest.raises(ValueError):
        ops.rmsnorm(x.astype(np.float64), randn(8), 1e-5)
    with pytest.raises(ValueError):
        ops.rmsnorm(x, randn(8), 1e-5, out=np.empty((8, 2), np.float32).T)  # not contiguous


# --- rope -----------------------------------------------------------------------------


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize(
    "n, heads, hd, n_rot, base, freq_scale",
    [
        (1, 9, 64, 64, 10000.0, 1.0),
        (7, 3, 64, 32, 10000.0, 1.0),  # partial rotation
        (64, 4, 256, 256, 1e6, 0.125),  # linear position scaling
        (2, 1, 256, 128, 1e4, 1.0),
    ],
)
def test_rope(neox, n, heads, hd, n_rot, base, freq_scale, path):
    x = randn(n, heads, hd)
    pos = RNG.integers(0, 8192, n).astype(np.int64)
    want = ref_rope(x, pos, base, neox, n_rot, freq_scale)
    got = x.copy()
    assert ops.rope(got, pos, base, neox, n_rot, freq_scale) is got
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])  # unrotated dims untouched


@pytest.mark.parametrize("neox", [False, True])
def test_rotate_magnitude_on_rotated_dims_only(neox, path):
    """mag (ggml's attn_factor) multiplies the n_rot rotated dims after their turn; the dims past
    n_rot stay as they are (Phi-4-mini: 96 of 128)."""
    x = randn(64, 4, 128)
    pos = RNG.integers(0, 131072, 64).astype(np.int64)
    want = ref_rope(x, pos, 10000.0, neox, 96, 1.0)
    want[..., :96] *= 1.7
    got = ops.rotate(x.copy(), pos, ops.rope_freqs(10000.0, 96), neox, mag=1.7)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., 96:], x[..., 96:])


@pytest.mark.parametrize("n", [1, 5])
def test_rope_first_heads_only(n, path):
    """heads=h rotates q and k of a fused (n, H + 2 Hkv, hd) QKV output and leaves v alone."""
    x = randn(n, 7, 64)
    pos = RNG.integers(0, 4096, n).astype(np.int64)
    got = x.copy()
    ops.rope(got, pos, 10000.0, False, 64, heads=5)
    np.testing.assert_allclose(got[:, :5], ref_rope(x[:, :5], pos, 10000.0, False, 64, 1.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[:, 5:], x[:, 5:])
    with pytest.raises(ValueError):
        ops.rope(got, pos, 10000.0, False, 64, heads=8)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_large_positions(neox):
    # endless chats reach positions past 1e6; a float32 angle would be off by radians here
    x = randn(5, 3, 64)
    pos = np.array([10**6, 10**7, 10**7 + 1, 3 * 10**7 + 12345, 2**31 + 7], np.int64)
    got = ops.rope(x.copy(), pos, 10000.0, neox, 64)
    np.testing.assert_allclose(got, ref_rope(x, pos, 10000.0, neox, 64, 1.0), rtol=1e-4, atol=1e-5)


def test_rope_pairs_differ_between_norm_and_neox():
    x = randn(1, 1, 8)
    pos = np.array([3], np.int64)
    norm = ops.rope(x.copy(), pos, 10000.0, False, 8)
    neox = ops.rope(x.copy(), pos, 10000.0, True, 8)
    np.testing.assert_allclose(norm, ref_rope(x, pos, 10000.0, False, 8, 1.0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(norm, neox)


def test_rope_rejects_bad_inputs():
    x = randn(2, 3, 64)
    with pytest.raises(ValueError):
        ops.rope(x, np.arange(2, dtype=np.int32), 1e4, False, 64)
    with pytest.raises(ValueError):
        ops.rope(x, np.arange(2, dtype=np.int64), 1e4, False, 65)
    with pytest.raises(ValueError):
        ops.rope(x, np.arange(2, dtype=np.int64), 1e4, False, 128)


# --- gated activations ----------------------------------------------------------------


@pytest.mark.parametrize("fn, ref", [(ops.silu_mul, ref_silu_mul), (ops.gelu_mul, ref_gelu_mul)])
@pytest.mark.parametrize("shape", [(1, 576), (1, 1536), (7, 2048), (64, 1536), (3, 5)])
def test_gated(fn, ref, shape, path):
    g = randn(*shape, scale=4.0)
    g.flat[:4] = [-95.0, -30.0, 30.0, 95.0][: g.size]  # the clamped tails of exp
    u = randn(*shape)
    np.testing.assert_allclose(fn(g, u), ref(g, u), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fn, ref", [(ops.silu_mul, ref_silu_mul), (ops.gelu_mul, ref_gelu_mul)])
def test_gated_in_place(fn, ref):
    g, u = randn(2, 300, scale=3.0), randn(2, 300)
    want = ref(g, u)
    assert fn(g, u, out=g) is g
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_gated_rejects_bad_inputs():
    with pytest.raises(ValueError):
        ops.silu_mul(randn(2, 8), randn(2, 9))
    with pytest.raises(ValueError):
        ops.gelu_mul(randn(2, 8), randn(2, 8).astype(np.float64))


# --- add, scale, rows -----------------------------------------------------------------


def test_add_scale_rows():
    a, b = randn(3, 576), randn(3, 576)
    want = a.astype(np.float64) + b
    np.testing.assert_allclose(ops.add(a, b), want, rtol=1e-6)
    out = np.empty_like(a)
    assert ops.add(a, b, out=out) is out
    assert ops.add_(a, b) is a
    np.testing.assert_allclose(a, want, rtol=1e-6)
    s = float(np.sqrt(640.0))
    want = a.astype(np.float64) * s
    assert ops.scale_(a, s) is a
    np.testing.assert_allclose(a, want, rtol=1e-6)
    table = randn(50, 16)
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_array_equal(ops.get_rows_f32(table, ids), table[[3, 0, 49, 3]])
    with pytest.raises(IndexError):
        ops.get_rows_f32(table, np.array([50]))
    with pytest.raises(ValueError):
        ops.add_(a, b[:2])
