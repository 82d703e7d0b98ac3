"""qmatmul / dequantize_rows against gguf.quants.dequantize (the reference decoder) and float64
matmuls. Quantized weights multiply activations quantized to int8 blocks (decode and prefill,
kernels_cpu/igemm.py), so they are checked twice: loosely against the exact product and tightly
against the product with the same int8 activations (re-derived here in numpy)."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from conftest import model_path
from edgekv.errors import EdgekvError, UnsupportedModelError
from edgekv.gguf_file import GGUFFile
from edgekv.kernels_cpu import qmatmul as qm
from edgekv.kernels_cpu import igemm, layouts, simd
from edgekv.quants import BY_NAME, QUANT_TYPES

ALL = [QUANT_TYPES[q].name for q in qm.SUPPORTED]
GGUF_QUANTIZES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # gguf.quants can encode these
# byte offsets of the float16 fields of a block (scales, mins), set to small finite values
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}
NS = sorted({1, 2, qm.SMALL_N, qm.SMALL_N + 1, 33, 50})  # both paths; partial token groups


def cols_for(name: str) -> int:
    """A small k: 19 blocks for the 32-element types (two groups of 8 and an odd tail), 2
    super-blocks for K types, 100 for float types (not a multiple of the vector width)."""
    return {1: 100, 32: 19 * 32, 256: 512}[BY_NAME[name].block_elems]


def random_raw(name: str, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(m, row_bytes) uint8 rows: random bytes (every bit pattern of quants, scales, high bits)
    with the float16 fields set to small finite values."""
    qt = BY_NAME[name]
    nb = k // qt.block_elems
    raw = rng.integers(0, 256, size=(m, nb, qt.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        vals = (rng.standard_normal((m, nb)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = vals.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, nb * qt.block_bytes)


def quantized(name: str, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(m, row_bytes) uint8 rows of a random Gaussian matrix encoded by gguf.quants."""
    f = rng.standard_normal((m, k), dtype=np.float32)
    return np.ascontiguousarray(quantize(f, BY_NAME[name].id)).view(np.uint8)


def reference(w: np.ndarray, name: str) -> np.ndarray:
    """Dense float64 (m, k) matrix by gguf.quants."""
    qt = BY_NAME[name]
    if name == "F32":
        return w.view(np.float32).astype(np.float64)
    if name == "F16":
        return w.view(np.float16).astype(np.float64)
    return dequantize(w, qt.id).reshape(w.shape[0], -1).astype(np.float64)


def int8_activations(x: np.ndarray, name: str, kernel_type: int | None = None) -> np.ndarray:
    """x as the kernels see it: int8 blocks (32; 256 for K types on the decode path and on the
    narrow prefill tile) times a float32 scale amax/127, rounded half to even. kernel_type: the
    weight's type as the kernels get it where it differs from name's (a repacked layout)."""
    qt = BY_NAME[name].id
    if x.shape[0] > qm.SMALL_N and not qm.int8_prefill(qt):  # float prefill: x as it is
        return x.astype(np.float64)
    q8_k = x.shape[0] <= qm.SMALL_N or igemm.q8_k(qt if kernel_type is None else kernel_type)
    bs = 256 if BY_NAME[name].block_elems == 256 and q8_k else 32
    xb = x.reshape(x.shape[0], -1, bs)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return (q * (amax / np.float32(127)).astype(np.float32)).reshape(x.shape).astype(np.float64)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(w: np.ndarray, name: str, x: np.ndarray) -> None:
    dense = reference(w, name)
    got = qm.qmatmul(x, w, BY_NAME[name].id)
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == np.float32
    exact = x.astype(np.float64) @ dense.T
    if name in ("F32", "F16", "BF16") or (x.shape[0] > qm.SMALL_N and not qm.int8_prefill(BY_NAME[name].id)):
        assert rel_err(got, exact) < 1e-5
    else:
        assert rel_err(got, exact) < 3e-2
        assert rel_err(got, int8_activations(x, name) @ dense.T) < 1e-5


@pytest.mark.parametrize("name", ALL)
def test_random_blocks(name):
    rng = np.random.default_rng(1)
    k = cols_for(name)
    w = quantized(name, 37, k, rng) if name in ("F32", "F16", "BF16") else random_raw(name, 37, k, rng)
    for n in NS:
        check(w, name, rng.standard_normal((n, k), dtype=np.float32))


@pytest.mark.parametrize("name", sorted(GGUF_QUANTIZES))
def test_gguf_quantized(name):
    rng = np.random.default_rng(2)
    k = cols_for(name)
    w = quantized(name, 37, k, rng)
    for n in (1, qm.SMALL_N + 1):
        check(w, name, rng.standard_normal((n, k), dtype=np.float32))


@pytest.mark.parametrize("name", ["IQ4_NL", "IQ4_XS"])
def test_iq4_decode_and_prefill(name):
    """The i-quants (random bytes: every index, every 6-bit scale) on both paths, 37 rows (not a
    multiple of the decode chunk or the prefill tile), k of 3 super-blocks / 24 blocks."""
    rng = np.random.default_rng(13)
    k = 768
    w = random_raw(name, 37, k, rng)
    for n in (1, 2, 7, 8, 64, 513):
        check(w, name, rng.standard_normal((n, k), dtype=np.float32))


@pytest.mark.parametrize("name,narrow", [(n, False) for n in ALL if n not in ("F32", "F16", "BF16")]
                         + [(n, True) for n in ALL if BY_NAME[n].id in igemm.SMALL_TYPES])
def test_int8_gemm(name, narrow):
    """The integer prefill kernel itself (also where qmatmul does not pick it): both register tiles
    on any machine (the 6 x 32 of VNNI, the 8 x 8 of AVX2 for the types whose quants are < 64),
    every type against gguf.quants' dequantization times the same int8 activations; fused parts
    of 37, 5 and 64 rows (partial tiles of 32 and of 8), token counts that leave partial register
    tiles of 6 and of 8."""
    qt = BY_NAME[name].id
    rng = np.random.default_rng(17)
    k = 2 * cols_for(name)
    parts = [random_raw(name, m, k, rng) for m in (37, 5, 64)]
    dense = np.concatenate([reference(p, name) for p in parts])
    qw = qm.QWeight(tuple(parts), qt)
    for n in (1, 2, 7, 13, 64, 513):
        x = rng.standard_normal((n, k), dtype=np.float32)
        out = np.full((n, qw.m + 3), np.nan, np.float32)
        igemm._igemm(x, qw.ws, qw.qtype, out, 3, narrow)
        xb = x.reshape(n, -1, 256 if narrow and name.endswith("_K") else 32)  # Q8_K's blocks (_tile8k)
        amax = np.abs(xb).max(axis=-1, keepdims=True)
        want = (np.rint(xb * (np.float32(127) / amax)) * (amax / np.float32(127))).reshape(n, k) @ dense.T
        assert rel_err(out[:, 3:], want) < 1e-5
        assert np.isnan(out[:, :3]).all()


def test_iq4_table_is_ggmls():
    """IQ4_NL's and IQ4_XS's non-linear table is gguf.quants' (ggml's kvalues_iq4nl), and every
    index of a block decodes to its entry."""
    from gguf.quants import IQ4_NL

    from edgekv.quants import KVALUES_IQ4NL

    assert KVALUES_IQ4NL == IQ4_NL.kvalues
    raw = np.zeros((1, 18), np.uint8)
    raw[0, :2] = np.array([1.0], np.float16).view(np.uint8)
    raw[0, 2:] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    got = qm.dequantize_rows(raw, BY_NAME["IQ4_NL"].id, np.array([0]))[0]
    np.testing.assert_array_equal(got, np.array(KVALUES_IQ4NL + KVALUES_IQ4NL[::-1], np.float32))


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("F32", "F16", "BF16")])
def test_decode_row_lengths(name):
    """Decode rows of every length the kernels split differently: the 32-element types in groups
    of 4 blocks, two groups a step (one group; an odd count; leftover blocks: k = 128, 640, 704),
    the K types one super-block at a time (1 and 3), with every token count of the decode path."""
    rng = np.random.default_rng(14)
    for k in ((128, 640, 704) if BY_NAME[name].block_elems == 32 else (256, 768)):
        w = random_raw(name, 21, k, rng)
        for n in (1, 2, qm.SMALL_N):
            check(w, name, rng.standard_normal((n, k), dtype=np.float32))


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("F32", "F16", "BF16")])
def test_decode_tokens_have_their_one_token_bits(name):
    """Each token of a decode batch (1 .. SMALL_N tokens: tiles of 2 rows x 4 tokens, pairs, one
    alone) gets the bits of that token multiplied alone, on row counts that leave a row (and a
    work item's rows) outside the tiles and k with and without leftover blocks (one group: 160)."""
    rng = np.random.default_rng(17)
    qt = BY_NAME[name].id
    for k in ((160, 576, 1024) if BY_NAME[name].block_elems == 32 else (512,)):
        w = random_raw(name, 37, k, rng)
        x = rng.standard_normal((qm.SMALL_N, k), dtype=np.float32)
        alone = np.concatenate([qm.qmatmul(x[t : t + 1], w, qt) for t in range(qm.SMALL_N)])
        for n in range(2, qm.SMALL_N + 1):
            np.testing.assert_array_equal(qm.qmatmul(x[:n], w, qt), alone[:n], err_msg=f"{name} k={k} n={n}")


def test_many_tokens_and_out():
    rng = np.random.default_rng(3)
    w = quantized("Q4_0", 37, 64, rng)
    x = rng.standard_normal((513, 64), dtype=np.float32)
    out = np.full((513, 37), np.nan, np.float32)
    assert qm.qmatmul(x, w, BY_NAME["Q4_0"].id, out=out) is out
    assert rel_err(out, int8_activations(x, "Q4_0") @ reference(w, "Q4_0").T) < 1e-5


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_fused_weights(name):
    """A tuple of weights (QKV, gate+up) gives the outputs side by side, as separate calls do."""
    rng = np.random.default_rng(9)
    k = cols_for(name)
    parts = [random_raw(name, m, k, rng) for m in (5, 40, 3)]
    for n in (1, qm.SMALL_N + 1):
        x = rng.standard_normal((n, k), dtype=np.float32)
        for ws in (parts, parts[:2]):
            got = qm.qmatmul(x, tuple(ws), BY_NAME[name].id)
            want = np.concatenate([qm.qmatmul(x, w, BY_NAME[name].id) for w in ws], axis=1)
            np.testing.assert_array_equal(got, want)
    with pytest.raises(EdgekvError, match="same number of columns"):
        qm.qmatmul(x, (parts[0], random_raw(name, 2, 2 * k, rng)), BY_NAME[name].id)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


ACTS = {  # float64 oracles of the gated activations (gelu: the tanh form ggml uses)
    "silu": lambda g: g / (1 + np.exp(-g)),
    "gelu": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))),
}


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "F16"])
@pytest.mark.parametrize("n", [1, 3, qm.SMALL_N + 1, 40])
def test_fused_pre_and_post_steps(name, n):
    """pre (rmsnorm or gated activation of the input) and post (residual add, optionally after an
    rmsnorm of the product) give what the separate steps give, on the decode and prefill paths."""
    rng = np.random.default_rng(11 + n)
    k, m, eps, qt = cols_for(name), 24, 1e-6, BY_NAME[name].id
    w = quantized(name, m, k, rng) if name in GGUF_QUANTIZES else random_raw(name, m, k, rng)
    dense = reference(w, name)
    tol = 1e-5 if name == "F16" or (n > qm.SMALL_N and not qm.int8_prefill(qt)) else 2e-2  # int8 activations
    x = rng.standard_normal((n, k), dtype=np.float32)
    g = rng.standard_normal(k).astype(np.float32)
    got = qm.qmatmul(x, w, qt, pre="norm", pre_w=g, eps=eps)
    assert rel_err(got, _rms(x, g, eps) @ dense.T) < tol
    gu = rng.standard_normal((n, 2 * k), dtype=np.float32)
    for act, f in ACTS.items():
        got = qm.qmatmul(gu, w, qt, pre=act)
        want = (f(gu[:, :k].astype(np.float64)) * gu[:, k:]) @ dense.T
        assert rel_err(got, want) < tol
    res0 = rng.standard_normal((n, m), dtype=np.float32)
    res = res0.copy()
    assert qm.qmatmul(x, w, qt, residual=res) is res
    prod = x.astype(np.float64) @ dense.T
    assert rel_err(res - res0, prod) < tol
    pw = rng.standard_normal(m).astype(np.float32)
    res = res0.copy()
    qm.qmatmul(x, w, qt, residual=res, post_w=pw, eps=eps)
    assert rel_err(res - res0, _rms(prod, pw, eps)) < tol
    # run(): the product lands at a column offset of a wider out, the rest untouched
    out = np.full((n, m + 7), 5.0, np.float32)
    qm.run(qm.QWeight(w, qt), x, out, 7, qm.PRE_NONE, qm._NONE1, eps, qm._NONE2, qm._NONE1)
    assert (out[:, :7] == 5).all()
    np.testing.assert_array_equal(out[:, 7:], qm.qmatmul(x, w, qt))


def test_fused_step_errors():
    rng = np.random.default_rng(12)
    w, q4 = random_raw("Q4_0", 4, 64, rng), BY_NAME["Q4_0"].id
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(EdgekvError, match="pre must be"):
        qm.qmatmul(x, w, q4, pre="relu")
    with pytest.raises(EdgekvError, match="pre_w"):
        qm.qmatmul(x, w, q4, pre="norm")
    with pytest.raises(EdgekvError, match="needs 128"):
        qm.qmatmul(x, w, q4, pre="silu")
    with pytest.raises(EdgekvError, match="residual"):
        qm.qmatmul(x, w, q4, residual=np.zeros((2, 5), np.float32))
    with pytest.raises(EdgekvError, match="post_w needs a residual"):
        qm.qmatmul(x, w, q4, post_w=np.zeros(4, np.float32))


def test_float_weights_as_float_arrays():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 40), dtype=np.float32)
    f = rng.standard_normal((5, 40), dtype=np.float32)
    want = x.astype(np.float64) @ f.T
    assert rel_err(qm.qmatmul(x, f, BY_NAME["F32"].id), want) < 1e-6
    h = f.astype(np.float16)
    assert rel_err(qm.qmatmul(x, h, BY_NAME["F16"].id), x.astype(np.float64) @ h.astype(np.float64).T) < 1e-6


@pytest.mark.parametrize("name", ALL)
def test_dequantize_rows(name):
    rng = np.random.default_rng(5)
    k = cols_for(name)
    w = quantized(name, 9, k, rng) if name in ("F32", "F16", "BF16") else random_raw(name, 9, k, rng)
    rows = np.array([8, 0, 3, 3])
    got = qm.dequantize_rows(w, BY_NAME[name].id, rows)
    np.testing.assert_allclose(got, reference(w, name)[rows], rtol=1e-6, atol=1e-30)


REAL = {  # (model, tensor) per type found in the two real models
    "smollm2": ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "token_embd.weight"],
    "gemma3": ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight"],
}


@pytest.mark.parametrize("key", sorted(REAL))
def test_real_tensors(key):
    f = GGUFFile(model_path(key))
    rng = np.random.default_rng(6)
    for tname in REAL[key]:
        t = f.tensor(tname)
        w = t.raw[:37]  # 37 rows of the memory-mapped weight, as the model code passes them
        for n in (1, qm.SMALL_N + 1):
            check(w, t.type_name, rng.standard_normal((n, t.shape[1]), dtype=np.float32))
        got = qm.dequantize_rows(w, t.qtype, np.arange(3))
        np.testing.assert_allclose(got, reference(w, t.type_name)[:3], rtol=1e-6)
    f.close()


def test_errors():
    w = np.zeros((4, 18), np.uint8)  # Q4_0, k = 32
    x = np.zeros((1, 32), np.float32)
    q4 = BY_NAME["Q4_0"].id
    with pytest.raises(UnsupportedModelError):
        qm.qmatmul(x, w, 16)  # IQ2_XXS
    with pytest.raises(EdgekvError, match="columns"):
        qm.qmatmul(np.zeros((1, 64), np.float32), w, q4)
    with pytest.raises(EdgekvError, match="float32"):
        qm.qmatmul(x.astype(np.float64), w, q4)
    with pytest.raises(EdgekvError, match="float32"):
        qm.qmatmul(np.zeros(32, np.float32), w, q4)
    with pytest.raises(EdgekvError, match="whole"):
        qm.qmatmul(x, np.zeros((4, 19), np.uint8), q4)
    with pytest.raises(EdgekvError, match="uint8"):
        qm.qmatmul(x, w.astype(np.int8), q4)
    with pytest.raises(EdgekvError, match="contiguous"):
        qm.qmatmul(x, np.zeros((4, 36), np.uint8)[:, ::2], q4)
    with pytest.raises(EdgekvError, match="out"):
        qm.qmatmul(x, w, q4, out=np.zeros((4, 1), np.float32))
    with pytest.raises(EdgekvError, match="range"):
        qm.dequantize_rows(w, q4, np.array([4]))
    assert qm.qmatmul(np.zeros((0, 32), np.float32), w, q4).shape == (0, 4)


def _one_tensor_gguf(path, qtype: int) -> None:
    """A GGUF holding one (2, 256) tensor blk.0.attn_q.weight of GGML type qtype (zero bytes)."""
    import struct

    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    name = b"blk.0.attn_q.weight"
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
    head += struct.pack("<I2QIQ", 2, 256, 2, qtype, 0)
    path.write_bytes(head + bytes(-len(head) % 32) + bytes(2 * 256 // block * nbytes))


def test_every_ggml_type_loads_or_is_refused(tmp_path):
    """Every type id gguf knows: in the quant table (then with a CPU kernel), or refused when the
    file is opened, by one UnsupportedModelError naming the tensor and the type."""
    import gguf

    import edgekv

    for q in QUANT_TYPES.values():  # the table's block sizes are gguf's
        assert (q.block_elems, q.block_bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(q.id)], q.name
        assert q.name == gguf.GGMLQuantizationType(q.id).name
    refused = []
    for t in gguf.GGMLQuantizationType:
        p = tmp_path / f"{t.name}.gguf"
        _one_tensor_gguf(p, t.value)
        if t.value in QUANT_TYPES:
            f = GGUFFile(p)
            assert f.tensors["blk.0.attn_q.weight"].type_name == t.name
            f.close()
            continue
        refused.append(t.name)
        for opener in (GGUFFile, lambda p: edgekv.load(p, progress=False)):
            with pytest.raises(UnsupportedModelError, match=f"tensor blk.0.attn_q.weight has type {t.name},"):
                opener(p)
    for name in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0", "MXFP4",
                 "Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64"):
        assert name in refused
    print("refused:", ", ".join(refused))


@pytest.mark.parametrize("isa", ["native", "avx2", "generic"])
def test_vector_primitives(monkeypatch, isa):
    """The integer products and float16 conversion on every instruction path: this machine's, AVX2
    without AVX-512/VNNI, and plain LLVM vector IR (no x86, float16 decoded with integer ops), the
    last two forced by editing the feature tables before compiling fresh kernels. The block
    decoders are target-neutral code on top of these."""
    if isa != "native":
        for table in ("_PMADDWD", "_PMADDUBSW", "_VPDPBUSD", "_VPDPWSSD", "_PSHUFB", "_PERMW", "_PSIGNB"):
            keep = {16, 32} if isa == "avx2" and table in ("_PMADDWD", "_PMADDUBSW", "_PSHUFB", "_PSIGNB") else set()
            monkeypatch.setattr(simd, table, {n: v for n, v in getattr(simd, table).items() if n in keep})
        monkeypatch.setattr(simd, "PMADDUBSW_DOTS", isa == "avx2")
        monkeypatch.setattr(simd, "_NATIVE_F16", False if isa == "generic" else simd._NATIVE_F16)

    @numba.njit
    def products(u8, i8, i16, o_madd16, o_madd32, o_ubs32, o_ubs64, o_dot32, o_dot64):
        simd.st(o_madd16, 0, simd.madd(simd.ld(i16, 0, 16), simd.ld(i16, 16, 16)))
        simd.st(o_madd32, 0, simd.madd(simd.ld(i16, 0, 32), simd.ld(i16, 32, 32)))
        simd.st(o_ubs32, 0, simd.maddubs(simd.ld(u8, 0, 32), simd.ld(i8, 0, 32)))
        simd.st(o_ubs64, 0, simd.maddubs(simd.ld(u8, 0, 64), simd.ld(i8, 0, 64)))
        simd.st(o_dot32, 0, simd.dot4(simd.ld(u8, 0, 32), simd.ld(i8, 0, 32)))
        simd.st(o_dot64, 0, simd.dot4(simd.ld(u8, 0, 64), simd.ld(i8, 0, 64)))

    @numba.njit
    def small_products(u8, u7, i8, acc, acc16, o_s32, o_s64, o_p32, o_p64, o_m32, o_m64):  # quants < 128 / < 64
        simd.st(o_m32, 0, simd.maddubs2_acc(simd.ld(acc16, 0, 16), simd.ld(u8, 0, 32), simd.ld(i8, 0, 32),
                                            simd.ld(u8, 32, 32), simd.ld(i8, 32, 32)))
        simd.st(o_m64, 0, simd.maddubs2_acc(simd.ld(acc16, 0, 32), simd.ld(u8, 0, 64), simd.ld(i8, 0, 64),
                                            simd.ld(u8, 64, 64), simd.ld(i8, 64, 64)))
        simd.st(o_s32, 0, simd.dot4acc_small(simd.ld(acc, 0, 8), simd.ld(u7, 0, 32), simd.ld(i8, 0, 32)))
        simd.st(o_s64, 0, simd.dot4acc_small(simd.ld(acc, 0, 16), simd.ld(u7, 0, 64), simd.ld(i8, 0, 64)))
        simd.st(o_p32, 0, simd.dot8acc_small(simd.ld(acc, 0, 8), simd.ld(u8, 0, 32), simd.ld(i8, 0, 32),
                                             simd.ld(u8, 32, 32), simd.ld(i8, 32, 32)))
        simd.st(o_p64, 0, simd.dot8acc_small(simd.ld(acc, 0, 16), simd.ld(u8, 0, 64), simd.ld(i8, 0, 64),
                                             simd.ld(u8, 64, 64), simd.ld(i8, 64, 64)))

    @numba.njit
    def biased_products(u8, i8, acc, o32, o64):  # Q8_0's / IQ4_NL's quants + 128
        simd.st(o32, 0, simd.dot4acc_biased(simd.ld(acc, 0, 8), simd.ld(u8, 0, 32), simd.ld(i8, 0, 32)))
        simd.st(o64, 0, simd.dot8acc_biased(simd.ld(acc, 0, 16), simd.ld(u8, 0, 64), simd.ld(i8, 0, 64),
                                             simd.ld(u8, 64, 64), simd.ld(i8, 64, 64)))

    @numba.njit
    def lookups(idx, o16, o32, o64):  # the i-quants' table (pshufb)
        simd.st(o16, 0, layouts._IQ4(simd.ld(idx, 0, 16)))
        simd.st(o32, 0, layouts._IQ4(simd.ld(idx, 0, 32)))
        simd.st(o64, 0, layouts._IQ4(simd.ld(idx, 0, 64)))

    @numba.njit
    def halves(raw, out):
        for i in range(0, raw.size // 2, 16):
            simd.st(out, i, simd.ld_f16(raw, 2 * i, 16))
        out[0] = simd.half(raw, 0)  # the scalar form as well
        out[1] = simd.half(raw, 2)

    rng = np.random.default_rng(8)
    for _ in range(20):
        u8 = rng.integers(0, 64, 64, dtype=np.uint8)  # the kernels' range: < 2**15 pair sums
        u8[:4] = 63
        i8 = rng.integers(-128, 128, 64, dtype=np.int8)
        i8[:4] = -128
        i16 = rng.integers(-(2**15), 2**15, 64).astype(np.int16)
        shapes = ((8, np.int32), (16, np.int32), (16, np.int16), (32, np.int16), (8, np.int32), (16, np.int32))
        outs = [np.zeros(n, t) for n, t in shapes]
        products(u8, i8, i16, *outs)
        wide16 = i16.astype(np.int64)
        want_madd = (wide16[:32] * wide16[32:]).reshape(-1, 2).sum(1)
        prod = u8.astype(np.int64) * i8
        np.testing.assert_array_equal(outs[0], (wide16[:16] * wide16[16:32]).reshape(-1, 2).sum(1).astype(np.int32))
        np.testing.assert_array_equal(outs[1], want_madd.astype(np.int32))  # wraps like pmaddwd
        np.testing.assert_array_equal(outs[2], prod[:32].reshape(-1, 2).sum(1))
        np.testing.assert_array_equal(outs[3], prod.reshape(-1, 2).sum(1))
        np.testing.assert_array_equal(outs[4], prod[:32].reshape(-1, 4).sum(1))
        np.testing.assert_array_equal(outs[5], prod.reshape(-1, 4).sum(1))
        u8, i8 = rng.integers(0, 64, 128, dtype=np.uint8), rng.integers(-128, 128, 128, dtype=np.int8)
        u8[:4], u8[64:68], i8[:4], i8[64:68] = 63, 63, -128, -128  # 4 x 63 x -128: the int16 sums' limit
        u7 = rng.integers(0, 128, 64, dtype=np.uint8)
        u7[:2], u7[2:4] = 127, 127
        acc = rng.integers(-(2**20), 2**20, 16).astype(np.int32)
        acc16 = rng.integers(-500, 500, 32).astype(np.int16)  # plus 4 x 63 x -128: still an int16
        outs = [np.zeros(n, np.int32) for n in (8, 16, 8, 16)] + [np.zeros(n, np.int16) for n in (16, 32)]
        small_products(u8, u7, i8, acc, acc16, *outs)
        w8 = u8.astype(np.int64)
        pairs = lambda lo, hi: (w8[lo:hi] * i8[lo:hi]).reshape(-1, 2).sum(1)  # noqa: E731
        np.testing.assert_array_equal(outs[4], acc16[:16] + pairs(0, 32) + pairs(32, 64))  # maddubs2_acc
        np.testing.assert_array_equal(outs[5], acc16 + pairs(0, 64) + pairs(64, 128))
        p7 = (u7.astype(np.int64) * i8[:64]).reshape(-1, 4).sum(1)
        p8 = (u8.astype(np.int64) * i8).reshape(2, -1, 4).sum(2)  # the two pairs' sums of 4
        np.testing.assert_array_equal(outs[0], acc[:8] + p7[:8])
        np.testing.assert_array_equal(outs[1], acc + p7)
        np.testing.assert_array_equal(outs[2], acc[:8] + (w8[:32] * i8[:32] + w8[32:64] * i8[32:64]).reshape(-1, 4).sum(1))
        np.testing.assert_array_equal(outs[3], acc + p8[0] + p8[1])
        ub = rng.integers(0, 256, 128, dtype=np.uint8)  # every signed weight, -128 (0) and 0 (128) among them
        ub[:3], ub[64:67] = (0, 128, 255), (0, 128, 1)
        xb = rng.integers(-127, 128, 128, dtype=np.int8)  # activations: never -128
        xb[:3], xb[64:67] = -127, 127
        outs = [np.zeros(n, np.int32) for n in (8, 16)]
        biased_products(ub, xb, acc, *outs)
        w = ub.astype(np.int64) - (128 if simd.PMADDUBSW_DOTS else 0)  # the trick leaves the bias out
        pb = (w * xb).reshape(2, -1, 4).sum(2)
        np.testing.assert_array_equal(outs[0], acc[:8] + pb[0, :8])
        np.testing.assert_array_equal(outs[1], acc + pb[0] + pb[1])
    from edgekv.quants import KVALUES_IQ4NL

    table = np.array(KVALUES_IQ4NL) + 128
    for _ in range(5):
        idx = rng.integers(0, 16, 64, dtype=np.uint8)
        outs = [np.zeros(n, np.uint8) for n in (16, 32, 64)]
        lookups(idx, *outs)
        for o in outs:
            np.testing.assert_array_equal(o, table[idx[: o.size]])
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every float16
    got = np.zeros(1 << 16, np.float32)
    halves(bits.view(np.uint8), got)
    np.testing.assert_array_equal(got, bits.view(np.float16).astype(np.float32))


def _x16(monkeypatch, parts, name="Q4_0"):
    """parts (rows of a GGUF type) as one weight repacked by qmatmul.pack (on any ISA: its kernels
    take the vector layer's fallbacks where AVX-512 VNNI is missing)."""
    monkeypatch.setattr(qm, "_VPDPBUSD", {64: "test", **qm._VPDPBUSD})
    qw = qm.QWeight(tuple(parts), BY_NAME[name].id)
    packed = qm.pack(qw)
    assert packed.qtype == layouts.X16 + qw.qtype and packed.m == qw.m and packed.k == qw.k
    return qw, packed


def _run(qw, x, out, col=0):
    return qm.run(qw, x, out, col, qm.PRE_NONE, qm._NONE1, 0.0, qm._NONE2, qm._NONE1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_repacked_x16(monkeypatch, name):
    """Q4_0, Q4_1, Q8_0, Q4_K, Q6_K repacked into 16 interleaved rows (decode, prefill, row
    dequantization: the GGUF rows' bits) against gguf.quants' dequantization times the kernels'
    int8 activations: fused parts of 48, 16 and 64 rows, k of 2, 18 and 32 blocks (K types: 1, 3
    and 4 super-blocks), every decode token count (each token with the bits it has alone: tiles of
    4, 2, 1 tokens), and prefill counts that leave partial tiles (16 .. 513)."""
    rng = np.random.default_rng(23)
    for k in (256, 768, 1024) if name in ("Q4_K", "Q6_K") else (64, 576, 1024):
        parts = [random_raw(name, m, k, rng) for m in (48, 16, 64)]
        dense = np.concatenate([reference(p, name) for p in parts])
        qw, packed = _x16(monkeypatch, parts, name)
        rows = np.array([0, 15, 16, 47, 48, 63, 64, 127])
        np.testing.assert_array_equal(qm.dequantize_rows(np.concatenate(packed.ws[:3]), packed.qtype, rows),
                                      qm.dequantize_rows(np.concatenate(parts), qw.qtype, rows))
        x = rng.standard_normal((513, k), dtype=np.float32)
        alone = np.concatenate([_run(packed, x[t : t + 1], np.empty((1, qw.m), np.float32)) for t in range(qm.SMALL_N)])
        for n in list(range(1, qm.SMALL_N + 1)) + [16, 64, 513]:
            out = np.full((n, qw.m + 3), np.nan, np.float32)
            _run(packed, x[:n], out, 3)
            assert np.isnan(out[:, :3]).all()
            assert rel_err(out[:, 3:], int8_activations(x[:n], name, packed.qtype) @ dense.T) < 1e-5, (k, n)
            if n <= qm.SMALL_N:
                np.testing.assert_array_equal(out[:, 3:], alone[:n], err_msg=f"k={k} n={n}")


def test_q4_0_repacked_fused_steps(monkeypatch):
    """The decode call's norm before and residual after on a repacked weight: the plain Q4_0 path's
    result to float rounding."""
    rng = np.random.default_rng(24)
    k = 256
    qw, packed = _x16(monkeypatch, [random_raw("Q4_0", 32, k, rng)])
    x = rng.standard_normal((3, k), dtype=np.float32)
    nw = rng.standard_normal(k, dtype=np.float32)
    a = rng.standard_normal((3, 32), dtype=np.float32)
    b = a.copy()
    qm.run(qw, x, np.empty((3, 32), np.float32), 0, qm.PRE_NORM, nw, 1e-6, a, qm._NONE1)
    qm.run(packed, x, np.empty((3, 32), np.float32), 0, qm.PRE_NORM, nw, 1e-6, b, qm._NONE1)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_q4_0_repack_only_whole_groups(monkeypatch):
    """pack leaves a weight as it is where the layout does not fit (rows not whole groups of 16, an
    odd number of blocks, a type without one) and with AVX-VNNI alone (256 bits); it packs with
    AVX-512 VNNI and with AVX2's pmaddubsw (Q6_K too)."""
    rng = np.random.default_rng(25)
    monkeypatch.setattr(qm, "_VPDPBUSD", {64: "test"})
    for parts, name in (([random_raw("Q4_0", 16, 64, rng), random_raw("Q4_0", 8, 64, rng)], "Q4_0"),
                        ([random_raw("Q4_1", 32, 96, rng)], "Q4_1"), ([random_raw("Q4_K", 24, 256, rng)], "Q4_K"),
                        ([random_raw("Q5_K", 32, 256, rng)], "Q5_K"), ([random_raw("Q6_K", 24, 256, rng)], "Q6_K")):
        qw = qm.QWeight(tuple(parts), BY_NAME[name].id)
        assert qm.pack(qw) is qw
    q6 = qm.QWeight(random_raw("Q6_K", 32, 256, rng), BY_NAME["Q6_K"].id)
    assert qm.pack(q6).qtype == layouts.X16 + q6.qtype
    monkeypatch.setattr(qm, "_VPDPBUSD", {32: "test"})
    qw = qm.QWeight(random_raw("Q4_0", 32, 64, rng), BY_NAME["Q4_0"].id)
    assert qm.pack(qw) is qw
    monkeypatch.setattr(qm, "_VPDPBUSD", {})
    monkeypatch.setattr(qm, "_PMADDUBSW", {32: "test"})
    assert qm.pack(qw).qtype == layouts.X16 + qw.qtype
    q8 = qm.QWeight(random_raw("Q8_0", 32, 64, rng), BY_NAME["Q8_0"].id)
    assert qm.pack(q8).qtype == layouts.X16 + q8.qtype
    assert qm.pack(q6).qtype == layouts.X16 + q6.qtype
