"""Every GPU kernel against its CPU/numpy reference, on tiny shapes.

Run by tests/test_gpu.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (numba's CUDA simulator:
every GPU thread is a Python thread, hence the tiny shapes and blocks), and by
bench/gpu_check.sh on a real GPU (EDGEKV_GPU_REAL=1, default launch sizes). File names
sim_*.py keep these out of the normal collection, which has no simulator.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize

from gpu_common import SIM, launch_sizes  # noqa: F401  (fixture)
from edgekv.kernels_cpu import kvquant as ckv
from edgekv.kernels_cpu import ops as cops
from edgekv.backends.reference import dequantize_kv as kv_dequantize
from edgekv.backends.reference import hadamard
from edgekv.backends.reference import quantize_kv as quantize
from edgekv.quants import BY_NAME
from numba import cuda

from edgekv.kernels_gpu import kvquant as gkv
from edgekv.kernels_gpu import ops as gops
from edgekv.kernels_gpu import qmatmul as gq

F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
TYPES = ["F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def random_raw(name: str, m: int, k: int, rng) -> np.ndarray:
    """(m, row_bytes) uint8: random bytes (every bit pattern of quants and high bits) with the
    float16 fields small and finite; float types: Gaussian values."""
    if name in ("F32", "F16"):
        return np.ascontiguousarray(rng.standard_normal((m, k)).astype(np.float32 if name == "F32" else np.float16)).view(np.uint8)
    qt = BY_NAME[name]
    nb = k // qt.block_elems
    raw = rng.integers(0, 256, size=(m, nb, qt.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        vals = (rng.standard_normal((m, nb)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = vals.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, nb * qt.block_bytes)


def dense(raw: np.ndarray, name: str) -> np.ndarray:
    """float64 (m, k) by gguf.quants (the format's reference decoder)."""
    if name == "F32":
        return raw.view(np.float32).astype(np.float64)
    if name == "F16":
        return raw.view(np.float16).astype(np.float64)
    return dequantize(raw, BY_NAME[name].id).reshape(raw.shape[0], -1).astype(np.float64)


@pytest.mark.parametrize("name", TYPES)
def test_qmatmul_and_rows(name):
    rng = np.random.default_rng(BY_NAME[name].id)
    k = {1: 72, 32: 96, 256: 256}[BY_NAME[name].block_elems]  # float rows with a partial unit
    raw = random_raw(name, 3, k, rng)
    ref_w = dense(raw, name)  # (3, k)
    w = gq.upload(raw, BY_NAME[name].id)
    assert (w.n_out, w.n_in) == (3, k)
    for n in (1, 3):  # the one-token kernel and the tiled one (partial tile)
        x = rng.standard_normal((n, k)).astype(np.float32)
        got = gq.qmatmul(cuda.to_device(x), w).copy_to_host()
        ref = x.astype(np.float64) @ ref_w.T
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    ids = np.array([2, 0, 2], np.int64)
    rows = gq.dequantize_rows(w, cuda.to_device(ids)).copy_to_host()
    np.testing.assert_array_equal(rows, ref_w[ids].astype(np.float32))


def test_qmatmul_fused_into_columns():
    """Stacked same-type weights (fused QKV) and a second type written at a column offset."""
    rng = np.random.default_rng(5)
    a, b, c = (random_raw("Q8_0", m, 64, rng) for m in (2, 1, 1))
    d = random_raw("Q4_0", 2, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    out = cuda.device_array((2, 6), np.float32)
    fused = gq.upload([a, b, c], BY_NAME["Q8_0"].id)
    gq.qmatmul(cuda.to_device(x), fused, out, 0)
    gq.qmatmul(cuda.to_device(x), gq.upload(d, BY_NAME["Q4_0"].id), out, 4)
    ref = x.astype(np.float64) @ np.concatenate([dense(a, "Q8_0"), dense(b, "Q8_0"), dense(c, "Q8_0"), dense(d, "Q4_0")]).T
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-4, atol=1e-5)


def test_halves_round_like_numpy():
    """f2h / h2f against numpy on specials, subnormals, ties and random values."""
    rng = np.random.default_rng(0)
    x = np.concatenate([
        np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.0, 65520.0, -1e9, 6.1e-5, 5.96e-8, 2.98e-8, 1e-9, 3e-8,
                  1.00048828125, 1.00146484375, 2049.0, 2051.0], np.float32),  # ties go to even
        (rng.standard_normal(40) * 10.0 ** rng.integers(-8, 5, 40)).astype(np.float32),
    ])
    bits = cuda.device_array(x.shape, np.int64)
    back = cuda.device_array(x.shape, np.float32)

    @cuda.jit
    def roundtrip(x, bits, back):
        i = cuda.grid(1)
        if i < x.shape[0]:
            b = gops.f2h(x[i])
            bits[i] = b
            back[i] = gops.h2f(b)

    roundtrip[1, 64](cuda.to_device(x), bits, back)
    with np.errstate(over="ignore"):  # numpy warns when it rounds to inf; so do we
        want = x.astype(np.float16)
    np.testing.assert_array_equal(bits.copy_to_host(), want.view(np.uint16).astype(np.int64))
    np.testing.assert_array_equal(back.copy_to_host(), want.astype(np.float32))


def test_rmsnorm_rope_activations_adds():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    got = gops.rmsnorm(cuda.to_device(x), cuda.to_device(w), 1e-6).copy_to_host()
    np.testing.assert_allclose(got, cops.rmsnorm(x, w, 1e-6), rtol=1e-5, atol=1e-6)

    pos = np.array([0, 7, 1 << 20], np.int64)  # a large position: the float64 angle matters
    # mag: ggml's attn_factor on the rotated dims (Phi-4-mini: 96 of 128 dims, with LongRoPE's)
    for neox, n_rot, mag in ((False, 64, 1.0), (True, 64, 1.0), (False, 32, 1.0), (True, 48, 1.0), (True, 48, 1.7)):
        inv = 0.5 * 10000.0 ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        q = rng.standard_normal((3, 2, 64)).astype(np.float32)
        dq = cuda.to_device(q)
        gops.rope(dq, cuda.to_device(pos), cuda.to_device(inv), neox, mag)
        ref = cops.rotate(q.copy(), pos, inv, neox, mag=mag)
        np.testing.assert_allclose(dq.copy_to_host(), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(dq.copy_to_host()[..., n_rot:], q[..., n_rot:])

    gu = (rng.standard_normal((2, 80)) * 4).astype(np.float32)
    dgu = cuda.to_device(gu)
    g, u = gu[:, :40], gu[:, 40:]
    np.testing.assert_allclose(gops.silu_mul(dgu[:, :40], dgu[:, 40:]).copy_to_host(),
                               cops.silu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gops.gelu_mul(dgu[:, :40], dgu[:, 40:]).copy_to_host(),
                               cops.gelu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u)), rtol=1e-5, atol=1e-6)
    c = gops.contiguous(dgu[:, 40:])
    assert c.is_c_contiguous()
    np.testing.assert_array_equal(c.copy_to_host(), u)

    a, b = rng.standard_normal((2, 2, 5)).astype(np.float32)
    da = cuda.to_device(a)
    gops.add_(da, cuda.to_device(b))
    gops.scale_(da, 3.0)
    gops.add_rows_(da.reshape(2, 5), cuda.to_device(b[0]))
    np.testing.assert_allclose(da.copy_to_host(), (a + b) * np.float32(3.0) + b[0], rtol=1e-6)


def _ring(kind, cap, nkv, hd):
    q, s = ckv.kv_arrays(kind, cap, nkv, hd)
    dq = cuda.to_device(q.view(np.uint16) if kind == "f16" else q.view(np.uint8))
    ds = cuda.to_device(s.view(np.uint16))
    return q, s, dq, ds


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_kv_store_load_bytes_match_cpu(kind):
    """Stored bytes equal the CPU kernel's (kernels_cpu.kvquant.kv_store) and the numpy reference
    quantizer's."""
    rng = np.random.default_rng(2)
    cap, nkv, hd = 5, 2, 64
    x = rng.standard_normal((3, nkv, hd)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero group: scale 0
    x[2, 1, 32:] *= 40.0  # a group of large values beside small ones
    rows, slots = np.array([0, 2], np.int64), np.array([4, 1], np.int64)
    rotate = kind != "f16"
    _, _, dq, ds = _ring(kind, cap, nkv, hd)
    ring = gkv.ring_arrays(kind, dq, ds)
    gkv.kv_store(kind, cuda.to_device(x), ring, cuda.to_device(rows), cuda.to_device(slots), rotate)
    xr = ckv.hadamard_(np.ascontiguousarray(x[rows])) if rotate else x[rows]  # the kernels' rotation, bit for bit
    if kind == "f16":
        np.testing.assert_array_equal(dq.copy_to_host()[slots], xr.astype(np.float16).view(np.uint16))
    else:
        qa, sa = ckv.kv_arrays(kind, cap, nkv, hd)
        ckv.kv_store(kind, np.ascontiguousarray(x[rows]), qa, sa, slots, True)
        qref, sref = qa[slots], sa[slots]
        np.testing.assert_array_equal(quantize(kind, xr)[0].view(np.uint8), qref.view(np.uint8))
        np.testing.assert_array_equal(quantize(kind, xr)[1], sref)
        np.testing.assert_array_equal(dq.copy_to_host()[slots], qref.view(np.uint8))
        np.testing.assert_array_equal(ds.copy_to_host()[slots], sref.view(np.uint16))
    back = gkv.kv_load(kind, ring, cuda.to_device(slots), nkv, hd, rotate).copy_to_host()
    if kind == "f16":
        ref = xr.astype(np.float16).astype(np.float32)
    else:
        ref = hadamard(kv_dequantize(kind, qref, sref))
    np.testing.assert_allclose(back, ref, rtol=1e-5, atol=1e-6)
    dpos = cuda.to_device(np.full(cap, -1, np.int64))
    gkv.set_pos(dpos, cuda.to_device(slots), cuda.to_device(np.array([10, 11], np.int64)))
    np.testing.assert_array_equal(dpos.copy_to_host(), [-1, 11, -1, -1, 10])


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_key_space_store_bits_match_cpu(kind):
    """kv_space (H(q / kmul), H((k - mu) kmul)) bit for bit as the CPU kernel's, the keys it makes
    stored (fitted int4 steps) into the CPU kernel's bytes; the sink bias as LayerKV.sink_bias;
    the exact f16 copies as numpy's astype."""
    from edgekv.kvcache import new_layer

    rng = np.random.default_rng(6)
    n, nh, nkv, hd = 3, 4, 2, 64
    q = rng.standard_normal((n, nh, hd)).astype(np.float32)
    k = (rng.standard_normal((n, nkv, hd)) + 3.0 * rng.standard_normal(hd)).astype(np.float32)  # a shared offset
    q_sink = rng.standard_normal((n, nh, hd)).astype(np.float32)
    lk = new_layer(kind, 8, nkv, hd, 2, 0)
    lk.calibrate(q, k)  # mu = the mean key, kmul from the queries' and keys' channel sizes
    assert lk.mu.any() and not np.allclose(lk.kmul, 1.0)
    qo_c, ko_c = ckv.kv_space(q, k, lk.mu, lk.kmul)
    dmu, dkmul = cuda.to_device(lk.mu), cuda.to_device(lk.kmul)
    qo, ko = gkv.kv_space(cuda.to_device(q), cuda.to_device(k), dmu, dkmul)
    np.testing.assert_array_equal(qo.copy_to_host(), qo_c)
    np.testing.assert_array_equal(ko.copy_to_host(), ko_c)
    qs_only, none = gkv.kv_space(cuda.to_device(q_sink), None, dmu, dkmul)  # queries alone
    assert none is None
    np.testing.assert_array_equal(qs_only.copy_to_host(), ckv.kv_space(q_sink, k, lk.mu, lk.kmul)[0])

    _, _, dq, ds = _ring(kind, 4, nkv, hd)
    slots = np.array([3, 0, 2], np.int64)
    gkv.kv_store(kind, ko, gkv.ring_arrays(kind, dq, ds), cuda.to_device(np.arange(n, dtype=np.int64)),
                 cuda.to_device(slots), False)
    qa, sa = ckv.kv_arrays(kind, 4, nkv, hd)
    ckv.kv_store(kind, ko_c, qa, sa, slots, False)
    np.testing.assert_array_equal(dq.copy_to_host(), qa.view(np.uint8))
    np.testing.assert_array_equal(ds.copy_to_host(), sa.view(np.uint16))

    sb = gkv.sink_bias(cuda.to_device(q), cuda.to_device(q_sink), dmu).copy_to_host()
    np.testing.assert_allclose(sb, lk.sink_bias(q, q_sink), rtol=1e-5, atol=1e-5)

    rk = cuda.to_device(np.zeros((5, nkv, hd), np.uint16))
    rv = cuda.to_device(np.zeros((5, nkv, hd), np.uint16))
    rows, dst = np.array([2, 0], np.int64), np.array([4, 1], np.int64)
    gkv.store_f16_rows(ko, cuda.to_device(k), cuda.to_device(rows), cuda.to_device(dst), rk, rv)
    want_k, want_v = np.zeros((5, nkv, hd), np.float16), np.zeros((5, nkv, hd), np.float16)
    want_k[dst], want_v[dst] = ko_c[rows], k[rows]
    np.testing.assert_array_equal(rk.copy_to_host(), want_k.view(np.uint16))
    np.testing.assert_array_equal(rv.copy_to_host(), want_v.view(np.uint16))


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_kv_attention_matches_cpu_kernel(kind):
    """A wrapped ring (empty slots, sinks scored with q_sink, a window) plus fresh keys, GQA,
    several queries: the same numbers as kernels_cpu.kvquant.kv_attention."""
    rng = np.random.default_rng(3)
    cap, nkv, nh, hd, n = 8, 1, 2, 32, 2
    qk, ks, dq_k, ds_k = _ring(kind, cap, nkv, hd)
    qv, vs, dq_v, ds_v = _ring(kind, cap, nkv, hd)
    kx = rng.standard_normal((cap, nkv, hd)).astype(np.float32)
    vx = rng.standard_normal((cap, nkv, hd)).astype(np.float32)
    slots = np.arange(cap, dtype=np.int64)
    ckv.kv_store(kind, kx, qk, ks, slots, kind != "f16")
    ckv.kv_store(kind, vx, qv, vs, slots, False)
    pos = np.array([0, 1, 12, 13, 9, 10, 11, -1], np.int64)  # 2 sinks, a wrapped window, one empty slot
    q = rng.standard_normal((n, nh, hd)).astype(np.float32)
    q_sink = rng.standard_normal((n, nh, hd)).astype(np.float32)
    q_pos = np.array([14, 15], np.int64)
    fk = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    fv = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    for window, fresh, softcap in ((5, True, 0.0), (0, False, 0.0), (5, True, 0.5)):  # 0.5: gemma2's soft-cap reached
        f = (fk, fv, q_pos) if fresh else (None, None, None)
        ref = ckv.kv_attention(kind, q, q_sink, q_pos, qk, ks if kind != "f16" else None, qv,
                               vs if kind != "f16" else None, pos, 2, *f, 0.3, window, False, softcap=softcap)
        up = lambda a: cuda.to_device(np.ascontiguousarray(a))  # noqa: E731
        dk = gkv.ring_arrays(kind, up(qk.view(np.uint16) if kind == "f16" else qk.view(np.uint8)), up(ks.view(np.uint16)))
        dv = gkv.ring_arrays(kind, up(qv.view(np.uint16) if kind == "f16" else qv.view(np.uint8)), up(vs.view(np.uint16)))
        ffk = fk if fresh else np.zeros((0, nkv, hd), np.float32)
        ffv = fv if fresh else np.zeros((0, nkv, hd), np.float32)
        ffp = q_pos if fresh else np.zeros(0, np.int64)
        got = gkv.kv_attention(kind, up(q), up(q_sink), up(q_pos), dk, dv, up(pos), cap, 2, up(ffk), up(ffv), up(ffp),
                               0.3, window, softcap=softcap).copy_to_host()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_kv_attention_exact_copies_match_cpu_kernel(kind):
    """Exact first/recent copies beside the ring (ring slots hidden for those positions, sinks'
    copies scored with q_sink plus the sink bias, fresh keys all seen or only under the recent
    rule, fresh keys at sink positions scored as sinks): kernels_cpu.kvquant.kv_attention's numbers."""
    rng = np.random.default_rng(7)
    cap, nkv, nh, hd, n_sink, first, recent = 8, 1, 2, 32, 2, 2, 2
    qk, ks, _, _ = _ring(kind, cap, nkv, hd)
    qv, vs, _, _ = _ring(kind, cap, nkv, hd)
    slots = np.arange(cap, dtype=np.int64)
    ckv.kv_store(kind, rng.standard_normal((cap, nkv, hd)).astype(np.float32), qk, ks, slots, False)
    ckv.kv_store(kind, rng.standard_normal((cap, nkv, hd)).astype(np.float32), qv, vs, slots, False)
    rk = rng.standard_normal((first + recent, nkv, hd)).astype(np.float16)
    rv = rng.standard_normal((first + recent, nkv, hd)).astype(np.float16)
    up = lambda a: cuda.to_device(np.ascontiguousarray(a))  # noqa: E731
    dk = gkv.ring_arrays(kind, up(qk.view(np.uint16) if kind == "f16" else qk.view(np.uint8)), up(ks.view(np.uint16)))
    dv = gkv.ring_arrays(kind, up(qv.view(np.uint16) if kind == "f16" else qv.view(np.uint8)), up(vs.view(np.uint16)))
    sc = None if kind == "f16" else ks
    sv = None if kind == "f16" else vs
    cases = [  # (ring pos, exact rows' positions, exact_lo, query positions)
        # decoding past a wrapped ring: sinks 0, 1 exact, 12 from the ring, 13 exact, 14, 15 fresh
        (np.array([0, 1, 12, 13, 9, 10, 11, -1], np.int64), np.array([0, 1, 12, 13], np.int64), 12,
         np.array([14, 15], np.int64)),
        # the first batch: an empty ring, fresh keys at the sink positions
        (np.full(cap, -1, np.int64), np.full(first + recent, -1, np.int64), 0, np.array([0, 1, 2], np.int64)),
    ]
    for pos, rpos, e0, q_pos in cases:
        n = len(q_pos)
        q = rng.standard_normal((n, nh, hd)).astype(np.float32)
        q_sink = rng.standard_normal((n, nh, hd)).astype(np.float32)
        fk = rng.standard_normal((n, nkv, hd)).astype(np.float32)
        fv = rng.standard_normal((n, nkv, hd)).astype(np.float32)
        sb = rng.standard_normal((n, nh)).astype(np.float32)
        for window, fresh_all, bias in ((5, True, sb), (0, False, sb), (0, True, None)):
            ref = ckv.kv_attention(kind, q, q_sink, q_pos, qk, sc, qv, sv, pos, n_sink, fk, fv, q_pos, 0.3, window,
                                   False, recent_k=rk, recent_v=rv, recent_pos=rpos, recent=recent, exact_lo=e0,
                                   first=first, fresh_all=fresh_all, sink_bias=bias)
            got = gkv.kv_attention(kind, up(q), up(q_sink), up(q_pos), dk, dv, up(pos), cap, n_sink, up(fk), up(fv),
                                   up(q_pos), 0.3, window, recent_k=up(rk.view(np.uint16)),
                                   recent_v=up(rv.view(np.uint16)), recent_pos=up(rpos), recent=recent, exact_lo=e0,
                                   first=first, fresh_all=fresh_all,
                                   sink_bias=None if bias is None else up(bias)).copy_to_host()
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"{q_pos} {window} {fresh_all}")
            assert np.abs(ref).max() > 0.1  # every query saw keys


def test_hadamard_matches_numpy():
    x = np.random.default_rng(4).standard_normal((3, 96)).astype(np.float32)  # blocks of 32
    dx = cuda.to_device(x)
    gkv.hadamard_(dx)
    np.testing.assert_allclose(dx.copy_to_host(), hadamard(x), rtol=1e-5, atol=1e-6)
