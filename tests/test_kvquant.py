"""kvquant kernels against a naive numpy oracle: the Hadamard transform as an explicit
Sylvester matrix, the quantizers written out in float32 numpy, attention as an explicit
float64 softmax over the union of ring slots and fresh keys."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from edgekv.kernels_cpu import kvquant as kq

SHAPES = [(9, 3, 64), (4, 1, 256)]  # (H, Hkv, hd): SmolLM2, Gemma-3


# --- oracle ---------------------------------------------------------------------------


def hadamard_matrix(B: int) -> np.ndarray:
    """Normalized Sylvester-Hadamard matrix (B, B) float64."""
    h = np.ones((1, 1))
    while h.shape[0] < B:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(B)


def rotate(x: np.ndarray) -> np.ndarray:
    """x (..., hd) -> H x blockwise, float64."""
    hd = x.shape[-1]
    B = min(hd & -hd, 256)
    xb = x.astype(np.float64).reshape(*x.shape[:-1], hd // B, B)
    return (xb @ hadamard_matrix(B).T).reshape(x.shape)


def fit_group(x: np.ndarray) -> tuple[np.ndarray, np.float16]:
    """The "fit" int4 rule on one group x (32,) float32, one candidate at a time: levels
    from inverse step -8 / (f x_m), least-squares step, least squared error wins."""
    x = x.astype(np.float64)
    xm = x[np.argmax(np.abs(x))]
    best = (-1.0, None, None)
    for f in 0.75 + 0.025 * np.arange(15):
        q = np.clip(np.rint(x * (-8.0 / (xm * f))), -8, 7) if xm != 0 else np.zeros(32)
        sqq = float(q @ q)
        d = float(x @ q) / sqq if sqq else 0.0
        err = float(np.sum((x - d * q) ** 2))
        if best[1] is None or err < best[0] * (1 - 1e-12):
            best = (err, q, d)
    return best[1].astype(np.int64), np.float32(best[2]).astype(np.float16)


def quantize(kind: str, x: np.ndarray, q4_0: bool | str = False) -> tuple[np.ndarray, np.ndarray | None]:
    """The storage formats written out in float32 numpy: x (n, Hkv, hd) -> (q, scale).
    q4_0: True for llama.cpp's q4_0 step, False for max|x| / 7, "fit" for the fitted step."""
    if kind == "f16":
        return x.astype(np.float16), None
    n, hkv, hd = x.shape
    g = x.reshape(n, hkv, hd // 32, 32)
    amax = np.abs(g).max(-1)  # (n, Hkv, ng) float32
    if kind == "int4" and q4_0 == "fit":
        qs = np.empty(g.shape, np.int64)
        d16 = np.empty(g.shape[:-1], np.float16)
        for idx in np.ndindex(*g.shape[:-1]):
            qs[idx], d16[idx] = fit_group(g[idx])
        u = (qs + 8).astype(np.uint8).reshape(n, hkv, hd)
        return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8), d16
    if kind == "int8":
        d16 = (amax / np.float32(127)).astype(np.float16)
    elif q4_0:
        first = np.argmax(np.abs(g), axis=-1)[..., None]  # first value of largest magnitude
        d16 = (np.take_along_axis(g, first, -1)[..., 0] / np.float32(-8)).astype(np.float16)
    else:
        d16 = (amax / np.float32(7)).astype(np.float16)
    d = d16.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(g * inv[..., None])
    if kind == "int8":
        return np.clip(q, -127, 127).astype(np.int8).reshape(n, hkv, hd), d16
    u = (np.clip(q, -8, 7) + 8).astype(np.uint8).reshape(n, hkv, hd)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8), d16


def dequantize(kind: str, q: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """(cap, Hkv, hd) float64 values as stored (still rotated if they were)."""
    if kind == "f16":
        return q.astype(np.float64)
    if kind == "int8":
        vals = q.astype(np.float64)
    else:
        vals = np.empty((*q.shape[:2], q.shape[2] * 2))
        vals[..., 0::2] = (q & 15).astype(np.float64) - 8
        vals[..., 1::2] = (q >> 4).astype(np.float64) - 8
    cap, hkv, hd = vals.shape
    return (vals.reshape(cap, hkv, hd // 32, 32) * scale.astype(np.float64)[..., None]).reshape(vals.shape)


def attention(q, q_sink, q_pos, k, v, pos, n_sink, fk, fv, fpos, scale, window, v_rotated):
    """Explicit masked softmax over ring slots (k, v float64, rotated space) then fresh keys."""
    n, H, hd = q.shape
    grp = H // k.shape[1]
    keys = np.concatenate([k, fk.astype(np.float64)])  # (cap + m, Hkv, hd)
    vals = np.concatenate([v, fv.astype(np.float64)])
    kpos = np.concatenate([pos, fpos])
    sink = np.arange(len(kpos)) < n_sink  # ring slots only: n_sink <= cap
    out = np.zeros((n, H, hd))
    for i in range(n):
        vis = (kpos >= 0) & (kpos <= q_pos[i])
        if window:
            vis &= sink | (q_pos[i] - kpos < window)
        if not vis.any():
            continue
        for h in range(H):
            g = h // grp
            s = np.where(sink, keys[:, g] @ q_sink[i, h].astype(np.float64), keys[:, g] @ q[i, h].astype(np.float64))
            s = s[vis] * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ vals[vis, g] / p.sum()
    return rotate(out) if v_rotated else out


# --- helpers --------------------------------------------------------------------------


def make_ring(kind, cap, hkv, hd, rng, rotate_k, rotate_v):
    """A ring filled with random rows (a few large outlier channels in K), via kv_store."""
    k, ks = kq.kv_arrays(kind, cap, hkv, hd)
    v, vs = kq.kv_arrays(kind, cap, hkv, hd)
    xk = rng.standard_normal((cap, hkv, hd)).astype(np.float32)
    xk[..., :: max(1, hd // 4)] *= 6.0
    xv = rng.standard_normal((cap, hkv, hd)).astype(np.float32)
    slots = rng.permutation(cap).astype(np.int64)
    kq.kv_store(kind, xk[slots], k, ks, slots, rotate_k)
    kq.kv_store(kind, xv[slots], v, vs, slots, rotate_v)
    return k, ks, v, vs


# --- Hadamard -------------------------------------------------------------------------


@pytest.mark.parametrize("n, H, Hkv, hd", [(1, 9, 3, 64), (3, 4, 1, 256)])
def test_kv_space(n, H, Hkv, hd):
    """kv_space moves queries and keys into the int ring's key space as LayerKV's numpy
    query_space / key_space do: H(q / kmul) and H((k - mu) kmul), so q . k - q . mu is kept."""
    rng = np.random.default_rng(hd)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    k = rng.standard_normal((n, Hkv, hd)).astype(np.float32)
    mu = rng.standard_normal((Hkv, hd)).astype(np.float32)
    kmul = np.exp(rng.standard_normal((Hkv, hd)) * 0.3).astype(np.float32)
    qo, ko = kq.kv_space(q, k, mu, kmul)
    grp = H // Hkv
    np.testing.assert_allclose(qo, rotate(q / np.repeat(kmul, grp, axis=0)), rtol=0, atol=1e-4)
    np.testing.assert_allclose(ko, rotate((k - mu) * kmul), rtol=0, atol=1e-4)
    scores = np.einsum("nhd,nhd->nh", qo, np.repeat(ko, grp, axis=1))
    want = np.einsum("nhd,nhd->nh", q, np.repeat(k - mu, grp, axis=1))
    np.testing.assert_allclose(scores, want, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError):
        kq.kv_space(q, k[:, :, :32], mu, kmul)


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256, 384, 512])
def test_hadamard_matches_matrix_and_is_orthonormal(hd):
    rng = np.random.default_rng(hd)
    x = rng.standard_normal((5, 3, hd)).astype(np.float32)
    y = kq.hadamard_(x.copy())
    np.testing.assert_allclose(y, rotate(x), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(kq.hadamard_(y), x, rtol=0, atol=1e-5)  # H^-1 = H
    assert kq.hadamard_block(hd) == min(hd & -hd, 256)


def butterflies(x: np.ndarray) -> np.ndarray:
    """The transform in float32 as the scalar loop does it (a plain implementation): butterflies
    h = 1, 2, 4 .. each one add or subtract per value, then times float32(1 / sqrt(B))."""
    y = x.astype(np.float32).copy()
    hd = y.shape[-1]
    B = min(hd & -hd, 256)
    h = 1
    while h < B:
        for b0 in range(0, hd, 2 * h):
            a, c = y[..., b0 : b0 + h].copy(), y[..., b0 + h : b0 + 2 * h].copy()
            y[..., b0 : b0 + h], y[..., b0 + h : b0 + 2 * h] = a + c, a - c
        h *= 2
    return y * np.float32(1.0 / np.sqrt(B))


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256, 384, 512])
def test_hadamard_has_the_plain_butterflies_bits(hd):
    # the kernel shuffles lanes for spans below 16: each value must still see the same float
    # operations in the same order (a query rotated in one kernel meets keys rotated in another)
    x = np.random.default_rng(hd + 1).standard_normal((7, hd)).astype(np.float32) * np.float32(3.7)
    np.testing.assert_array_equal(kq.hadamard_(x.copy()), butterflies(x))


def test_hadamard_parallel_path(monkeypatch):
    monkeypatch.setattr(kq, "KV_HADAMARD_PAR_MIN", 0)
    x = np.random.default_rng(1).standard_normal((40, 128)).astype(np.float32)
    np.testing.assert_allclose(kq.hadamard_(x.copy()), rotate(x), rtol=0, atol=1e-5)


# --- store / load ---------------------------------------------------------------------


@pytest.mark.parametrize("kind,q4_0", [("f16", False), ("int8", False), ("int4", "fit")])
@pytest.mark.parametrize("rot", [False, True])
@pytest.mark.parametrize("hd", [64, 256])
def test_store_bytes_match_numpy_quantizer(kind, q4_0, rot, hd):
    rng = np.random.default_rng(hd + rot)
    cap, hkv, n = 50, 2, 20
    x = (rng.standard_normal((n, hkv, hd)) * rng.uniform(0.01, 100, (n, 1, 1))).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero group: d = 0, q = 0
    x[1, 0, :32] = 2.5  # ties: the fitted steps start from the first value of largest magnitude
    x[1, 0, 7] = -2.5
    q, s = kq.kv_arrays(kind, cap, hkv, hd)
    q[:] = 77 if kind != "f16" else 7.0  # untouched slots keep their bytes
    slots = rng.choice(cap, n, replace=False).astype(np.int64)
    kq.kv_store(kind, x, q, s, slots, rot)
    xr = kq.hadamard_(x.copy()) if rot else x  # bytes are compared on the kernel's own rotation
    want_q, want_s = quantize(kind, xr, q4_0)
    np.testing.assert_array_equal(q[slots], want_q)
    if kind != "f16":
        np.testing.assert_array_equal(s[slots], want_s)
    rest = np.setdiff1d(np.arange(cap), slots)
    assert np.all(q[rest] == (77 if kind != "f16" else 7.0))


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
@pytest.mark.parametrize("rot", [False, True])
def test_load_roundtrip_error_bounds(kind, rot):
    rng = np.random.default_rng(3)
    cap, hkv, hd = 40, 3, 128
    x = rng.standard_normal((cap, hkv, hd)).astype(np.float32) * 3
    q, s = kq.kv_arrays(kind, cap, hkv, hd)
    slots = np.arange(cap, dtype=np.int64)
    kq.kv_store(kind, x, q, s, slots, rot)
    y = kq.kv_load(kind, q, s, slots, rot)
    np.testing.assert_allclose(y if not rot else kq.hadamard_(y.copy()), dequantize(kind, q, s), rtol=1e-5, atol=1e-5)
    if kind == "f16":  # half rounding only: exact without rotation
        if rot:
            np.testing.assert_allclose(y, x, rtol=0, atol=2**-10 * np.abs(rotate(x)).max())
        else:
            np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))
        return
    xr = (rotate(x) if rot else x.astype(np.float64)).reshape(cap, hkv, hd // 32, 32)
    err = np.abs(dequantize(kind, q, s).reshape(xr.shape) - xr)
    d = np.abs(s.astype(np.float64))[..., None]
    if kind == "int8":  # rounding to the nearest step of the stored scale: at most half a step
        assert np.all(err <= d / 2 * (1 + 1e-6) + 1e-7), float((err / d).max())
    # (int4 levels round at the winning candidate's step, not at d: the bytes test pins them)
    if rot:  # H is orthonormal: the per-row error norm carries over to the un-rotated rows
        e2 = np.linalg.norm(y - x, axis=-1)
        assert np.all(e2 <= np.linalg.norm(err.reshape(cap, hkv, hd), axis=-1) * (1 + 1e-5) + 1e-5)


@pytest.mark.parametrize("kind", kq.KINDS)
def test_record_views_match_separate_arrays(kind):
    """A cache's rings are views of one record per slot (KVKind.views: k, v, scales side by side,
    rows a record apart); the kernels give them the bytes and the outputs of separate arrays, and
    storing K never touches V's or the scales' bytes beside it."""
    from edgekv.kvkinds import KINDS

    rng = np.random.default_rng(11)
    cap, hkv, hd, H = 40, 3, 64, 9
    spec = KINDS[kind]
    rows = np.full((cap + 1, spec.record(hkv, hd)), 0x5A, np.uint8)
    k, v, ks, vs = spec.views(rows, cap, hkv, hd)
    rec = [np.ascontiguousarray(a) for a in (k, ks, v, vs)]  # the same starting bytes, apart
    xk, xv = (rng.standard_normal((cap, hkv, hd)).astype(np.float32) for _ in range(2))
    slots = rng.permutation(cap)[:30].astype(np.int64)
    kq.kv_store(kind, xk[:30], k, ks, slots, kind != "f16")
    kq.kv_store(kind, xv[:30], v, vs, slots, False)
    kq.kv_store(kind, xk[:30], rec[0], rec[1], slots, kind != "f16")
    kq.kv_store(kind, xv[:30], rec[2], rec[3], slots, False)
    for a, b in zip((k, ks, v, vs), rec):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert (rows[cap] == 0x5A).all()  # the spare record
    pos = np.full(cap, -1, np.int64)
    pos[slots] = np.arange(30)
    q = rng.standard_normal((2, H, hd)).astype(np.float32)
    q_pos = np.array([28, 29], np.int64)
    outs = [kq.kv_attention(kind, q, None, q_pos, a, b, c, d, pos, 0, None, None, None, 0.125, 0, False)
            for a, b, c, d in ((k, ks, v, vs), rec)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(kq.kv_load(kind, v, vs, slots, False), kq.kv_load(kind, rec[2], rec[3], slots, False))


def test_store_rejects_bad_input():
    q, s = kq.kv_arrays("int8", 8, 2, 64)
    x = np.zeros((2, 2, 64), np.float32)
    with pytest.raises(ValueError):
        kq.kv_store("int8", x, q, s, np.array([1, 1], np.int64), False)  # duplicate slots
    with pytest.raises(ValueError):
        kq.kv_store("int8", x, q, s, np.array([1, 8], np.int64), False)  # out of range
    with pytest.raises(ValueError):
        kq.kv_store("int8", x, q, None, np.array([1, 2], np.int64), False)  # scales missing
    with pytest.raises(ValueError):
        kq.kv_store("int4", x, q, s, np.array([1, 2], np.int64), False)  # int8 arrays for int4
    with pytest.raises(ValueError):
        kq.kv_store("int3", x, q, s, np.array([1, 2], np.int64), False)
    with pytest.raises(ValueError):
        kq.kv_store("int8", x.astype(np.float64), q, s, np.array([1, 2], np.int64), False)
    with pytest.raises(ValueError):
        kq.kv_arrays("int8", 8, 2, 48)  # head dim not a multiple of 32


# --- attention ------------------------------------------------------------------------


def scenario(rng, kind, shape, n, window, n_sink, m, v_rot, in_place):
    """A wrapped ring with empty slots, sinks, scrambled positions; queries at random
    positions over the whole span (so masks cut everywhere); optional fresh keys after it."""
    H, hkv, hd = shape
    cap = 300
    k, ks, v, vs = make_ring(kind, cap, hkv, hd, rng, kind != "f16", v_rot)
    p0 = 1000  # the ring has wrapped: window tokens are 1000.., sinks 0..n_sink-1
    pos = np.concatenate([np.arange(n_sink), p0 + rng.permutation(cap - n_sink)]).astype(np.int64)
    pos[rng.random(cap) < 0.1] = -1  # empty slots
    fk = rng.standard_normal((m, hkv, hd)).astype(np.float32)
    fv = rng.standard_normal((m, hkv, hd)).astype(np.float32)
    top = p0 + cap - n_sink
    fpos = np.arange(top, top + m, dtype=np.int64)
    if in_place:  # the batch's own keys are in the ring (store first, then attend)
        q_pos = np.sort(rng.integers(p0, top + m, n)).astype(np.int64)
    else:
        q_pos = np.sort(rng.integers(top - 1, top + m + 1, n)).astype(np.int64)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    q_sink = rng.standard_normal((n, H, hd)).astype(np.float32) if n_sink else q
    return q, q_sink, q_pos, k, ks, v, vs, pos, fk, fv, fpos


@pytest.mark.parametrize("path", ["serial", "parallel"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", kq.KINDS)
@pytest.mark.parametrize(
    "n,window,n_sink,m,v_rot,in_place",
    [
        (1, 0, 0, 0, False, False),
        (1, 0, 4, 0, True, False),
        (1, 40, 0, 5, False, False),
        (7, 0, 4, 5, False, True),
        (7, 60, 0, 0, True, True),
        (64, 0, 4, 5, True, True),
        (64, 50, 4, 0, False, True),
    ],
)
def test_attention_matches_oracle(monkeypatch, path, shape, kind, n, window, n_sink, m, v_rot, in_place):
    # parallel: any work size, and decode splits the 300 slots into several partial softmaxes
    monkeypatch.setattr(kq, "KV_ATTN_PAR_MIN", 0 if path == "parallel" else 1 << 62)
    monkeypatch.setattr(kq, "KV_ATTN_SPLIT_MIN_KEYS", 32)
    rng = np.random.default_rng(zlib.crc32(repr((shape, kind, n, window, n_sink, m)).encode()))
    q, q_sink, q_pos, k, ks, v, vs, pos, fk, fv, fpos = scenario(rng, kind, shape, n, window, n_sink, m, v_rot, in_place)
    scale = 1.0 / np.sqrt(shape[2])
    out = kq.kv_attention(kind, q, q_sink, q_pos, k, ks, v, vs, pos, n_sink, fk, fv, fpos, scale, window, v_rot)
    ref = attention(q, q_sink, q_pos, dequantize(kind, k, ks), dequantize(kind, v, vs), pos, n_sink,
                    fk, fv, fpos, scale, window, v_rot)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["f16", "int4"])
def test_attention_bits_do_not_depend_on_the_thread_count(monkeypatch, kind):
    """Decode over a long ring splits the keys among tasks: the same split, merged in the same
    order, with 1 or 2 threads, in parallel or on the calling thread alone (the thread tuner
    changes the count under load; a token must not change with it)."""
    import numba

    rng = np.random.default_rng(7)
    k, ks, v, vs = make_ring(kind, 2048, 2, 64, rng, kind != "f16", False)
    pos = np.arange(2048, dtype=np.int64)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    q_pos = np.array([2047], np.int64)
    outs = []
    for par_min, threads in ((0, 1), (0, 2), (1 << 62, 2)):
        monkeypatch.setattr(kq, "KV_ATTN_PAR_MIN", par_min)
        was = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            outs.append(kq.kv_attention(kind, q, None, q_pos, k, ks, v, vs, pos, 4, None, None, None, 0.125, 0, False))
        finally:
            numba.set_num_threads(was)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_attention_no_visible_key_gives_zeros_and_out_is_reused():
    rng = np.random.default_rng(5)
    k, ks, v, vs = make_ring("int4", 64, 1, 64, rng, True, False)
    pos = np.arange(100, 164, dtype=np.int64)
    q = rng.standard_normal((3, 2, 64)).astype(np.float32)
    q_pos = np.array([50, 120, 163], np.int64)  # the first query precedes every key
    out = np.full_like(q, np.nan)
    got = kq.kv_attention("int4", q, None, q_pos, k, ks, v, vs, pos, 0, None, None, None, 0.125, 0, False, out)
    assert got is out
    assert np.all(out[0] == 0) and np.all(np.isfinite(out))
    ref = attention(q, q, q_pos, dequantize("int4", k, ks), dequantize("int4", v, vs), pos, 0,
                    np.zeros((0, 1, 64)), np.zeros((0, 1, 64)), np.zeros(0, np.int64), 0.125, 0, False)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_attention_never_reads_empty_f16_slots():
    # an empty slot may hold anything, NaN included: it must not reach the output
    rng = np.random.default_rng(6)
    k, ks, v, vs = make_ring("f16", 40, 1, 64, rng, False, False)
    pos = np.arange(40, dtype=np.int64)
    pos[5:9] = -1
    k[5:9] = np.nan
    v[5:9] = np.inf
    q = rng.standard_normal((1, 1, 64)).astype(np.float32)
    out = kq.kv_attention("f16", q, None, np.array([50]), k, ks, v, vs, pos, 0, None, None, None, 0.125, 0, False)
    assert np.all(np.isfinite(out))


def test_attention_rejects_bad_input():
    k, ks = kq.kv_arrays("int8", 16, 1, 64)
    q = np.zeros((1, 2, 64), np.float32)
    pos = np.zeros(16, np.int64)
    qp = np.zeros(1, np.int64)
    with pytest.raises(ValueError):  # scale arrays of the wrong kind
        kq.kv_attention("int4", q, None, qp, k, ks, k, ks, pos, 0, None, None, None, 1.0, 0, False)
    with pytest.raises(ValueError):  # GQA groups do not divide
        kq.kv_attention("int8", np.zeros((1, 3, 64), np.float32), None, qp, *kq.kv_arrays("int8", 16, 2, 64),
                        *kq.kv_arrays("int8", 16, 2, 64), pos, 0, None, None, None, 1.0, 0, False)
    with pytest.raises(ValueError):  # fresh keys without positions
        kq.kv_attention("int8", q, None, qp, k, ks, k, ks, pos, 0, np.zeros((2, 1, 64), np.float32),
                        np.zeros((2, 1, 64), np.float32), None, 1.0, 0, False)
    with pytest.raises(ValueError):
        kq.kv_attention("int8", q, None, qp.astype(np.int32), k, ks, k, ks, pos, 0, None, None, None, 1.0, 0, False)


# --- quality --------------------------------------------------------------------------


def test_hadamard_lowers_int4_attention_error_with_outlier_channels():
    """Keys with a few large channels (as real K caches have): per-token groups without
    rotation spend their 4 bits on the outliers; rotated, the outliers spread out."""
    rng = np.random.default_rng(7)
    S, hkv, hd, H, n = 512, 1, 128, 4, 8
    k = rng.standard_normal((S, hkv, hd)).astype(np.float32)
    k[..., [3, 40, 77]] *= 25.0
    v = rng.standard_normal((S, hkv, hd)).astype(np.float32)
    q = (rng.standard_normal((n, H, hd)) * 0.3).astype(np.float32)
    pos = np.arange(S, dtype=np.int64)
    q_pos = np.full(n, S, np.int64)
    scale = 1.0 / np.sqrt(hd)
    none = np.zeros((0, hkv, hd), np.float32)
    ref = attention(q, q, q_pos, k.astype(np.float64), v.astype(np.float64), pos, 0, none, none,
                    np.zeros(0, np.int64), scale, 0, False)
    errs = {}
    for rot in (False, True):
        kk, ks = kq.kv_arrays("int4", S, hkv, hd)
        vv, vs = kq.kv_arrays("int4", S, hkv, hd)
        kq.kv_store("int4", k, kk, ks, pos, rot)
        kq.kv_store("int4", v, vv, vs, pos, False)
        qq = kq.hadamard_(q.copy()) if rot else q
        out = kq.kv_attention("int4", qq, None, q_pos, kk, ks, vv, vs, pos, 0, None, None, None, scale, 0, False)
        errs[rot] = float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref**2)))
    print(f"int4 attention rel. RMS error: plain {errs[False]:.4f}, Hadamard {errs[True]:.4f}")
    assert errs[True] < 0.7 * errs[False]


def test_fit_rule_lowers_int4_error():
    """The fitted int4 step (the default) against llama.cpp's q4_0 step, same 18 bytes."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((64, 2, 128)) * rng.uniform(0.1, 10, (64, 1, 1))).astype(np.float32)
    x[:8] = rng.laplace(size=(8, 2, 128))  # heavier tails too
    slots = np.arange(64, dtype=np.int64)
    sse = {}
    q, s = kq.kv_arrays("int4", 64, 2, 128)
    kq.kv_store("int4", x, q, s, slots, False)
    y = {"fit": kq.kv_load("int4", q, s, slots, False), "q4_0": dequantize("int4", *quantize("int4", x, True))}
    for rule in ("q4_0", "fit"):
        sse[rule] = ((y[rule] - x).reshape(64, 2, 4, 32) ** 2).sum(-1)  # per group
    ratio = sse["fit"].sum() / sse["q4_0"].sum()
    print(f"int4 squared error, fit / q4_0: {ratio:.3f}, worst group {np.max(sse['fit'] / sse['q4_0']):.3f}")
    assert ratio < 0.95  # measured 0.893
    assert np.all(sse["fit"] <= sse["q4_0"] * 1.05 + 1e-9)
