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
    for name in ("ELEMENTWISE_PAR_MIN", "RMSNORM_PAR_MIN", "ROPE_PAR_MIN", "ATTN_PAR_MIN"):
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


def ref_attention(q, k, v, q_pos, k_pos, scale, window):
    n, n_head, hd = q.shape
    grp = n_head // k.shape[1]
    k = k.astype(np.float64)
    v = v.astype(np.float64)
    out = np.zeros((n, n_head, hd))
    for i in range(n):
        vis = (k_pos >= 0) & (k_pos <= q_pos[i])
        if window:
            vis &= q_pos[i] - k_pos < window
        if not vis.any():
            continue
        for h in range(n_head):
            s = k[vis, h // grp] @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ v[vis, h // grp] / p.sum()
    return out


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


# --- attention ------------------------------------------------------------------------


def make_cache(n_kv, n_head_kv, hd, dtype, n_empty=0, ring=True):
    """A cache with slots in shuffled order (a ring that wrapped) and some empty slots
    holding NaN, which must never reach the output."""
    k = randn(n_kv, n_head_kv, hd).astype(dtype)
    v = randn(n_kv, n_head_kv, hd).astype(dtype)
    k_pos = RNG.permutation(n_kv).astype(np.int64) if ring else np.arange(n_kv, dtype=np.int64)
    if n_empty:
        empty = RNG.choice(n_kv, n_empty, replace=False)
        k_pos[empty] = -1
        k[empty] = np.nan
        v[empty] = np.nan
    return k, v, k_pos


ATTN_CASES = [
    # n, n_head, n_head_kv, hd, n_kv, window
    (1, 9, 3, 64, 300, 0),  # decode, SmolLM2 heads
    (1, 4, 1, 256, 700, 512),  # decode, gemma3 heads, sliding window
    (2, 9, 3, 64, 37, 0),
    (7, 4, 1, 256, 130, 16),
    (64, 9, 3, 64, 200, 0),  # prefill-like: causal among the new tokens
    (64, 4, 1, 256, 96, 40),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n, n_head, n_head_kv, hd, n_kv, window", ATTN_CASES)
def test_attention(dtype, n, n_head, n_head_kv, hd, n_kv, window, path):
    k, v, k_pos = make_cache(n_kv, n_head_kv, hd, dtype, n_empty=n_kv // 10)
    q = randn(n, n_head, hd)
    # queries are the last n positions; the window (when set) hides the oldest keys
    q_pos = np.arange(n_kv - n, n_kv, dtype=np.int64)
    scale = 1.0 / np.sqrt(hd)
    got = ops.attention(q, k, v, q_pos, k_pos, scale, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref_attention(q, k, v, q_pos, k_pos, scale, window), rtol=1e-5, atol=2e-6)


def test_attention_sharp_softmax_and_out():
    # large scores exercise the max subtraction and the rescaling between tiles
    k, v, k_pos = make_cache(500, 2, 64, np.float16, ring=False)
    q = randn(3, 4, 64, scale=8.0)
    q_pos = np.array([499, 250, 10], np.int64)
    out = np.empty_like(q)
    assert ops.attention(q, k, v, q_pos, k_pos, 1.0, 0, out=out) is out
    np.testing.assert_allclose(out, ref_attention(q, k, v, q_pos, k_pos, 1.0, 0), rtol=1e-5, atol=2e-6)


def test_attention_window_boundary():
    # q_pos - k_pos == window is masked, window - 1 is not (llama.cpp is_masked_swa);
    # with q = 0 the weights are uniform, so one-hot values count the visible keys
    n_kv, window = 12, 4
    k = randn(n_kv, 1, 16)
    v = np.zeros((n_kv, 1, 16), np.float32)
    v[np.arange(n_kv), 0, np.arange(n_kv)] = 1.0
    q = np.zeros((1, 1, 16), np.float32)
    k_pos = np.arange(n_kv, dtype=np.int64)
    got = ops.attention(q, k, v, np.array([10], np.int64), k_pos, 1.0, window)[0, 0]
    want = ref_attention(q, k, v, np.array([10], np.int64), k_pos, 1.0, window)[0, 0]
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert np.nonzero(got)[0].tolist() == [7, 8, 9, 10]


def test_attention_no_visible_key_gives_zeros():
    k, v, k_pos = make_cache(20, 1, 32, np.float32, ring=False)
    k_pos += 5  # every key is in the future of query position 2
    got = ops.attention(randn(1, 2, 32), k, v, np.array([2], np.int64), k_pos, 0.2)
    np.testing.assert_array_equal(got, 0.0)


@pytest.mark.parametrize("core", ["_attn_serial", "_attn_parallel"])
@pytest.mark.parametrize("n_split", [2, 3, 7])
def test_attention_key_splits_merge(core, n_split):
    # decode splits the keys among threads; the thread count decides the split, so the
    # merge is tested at fixed split counts, with one split holding only empty slots
    k, v, k_pos = make_cache(700, 3, 64, np.float16, n_empty=20, ring=False)
    k_pos[:100] = -1
    k[:100] = v[:100] = np.nan
    q = randn(1, 9, 64)
    q_pos = np.array([699], np.int64)
    out = np.empty_like(q)
    getattr(ops, core)(q, k.view(np.uint16), v.view(np.uint16), q_pos, k_pos, 0.125, 0, 1, n_split, out)
    np.testing.assert_allclose(out, ref_attention(q, k, v, q_pos, k_pos, 0.125, 0), rtol=1e-5, atol=2e-6)


def test_attention_rejects_bad_inputs():
    k, v, k_pos = make_cache(10, 2, 16, np.float16)
    q, q_pos = randn(1, 4, 16), np.array([9], np.int64)
    with pytest.raises(ValueError):  # 3 query heads do not share 2 kv heads
        ops.attention(randn(1, 3, 16), k, v, q_pos, k_pos, 1.0)
    with pytest.raises(ValueError):
        ops.attention(q, k, v.astype(np.float32), q_pos, k_pos, 1.0)
    with pytest.raises(ValueError):
        ops.attention(q, k, v, q_pos.astype(np.int32), k_pos, 1.0)
    with pytest.raises(ValueError):
        ops.attention(q, k[:, :, :8], v[:, :, :8], q_pos, k_pos, 1.0)
    with pytest.raises(ValueError):
        ops.attention(q, k, v, q_pos, k_pos, 1.0, window=-1)
