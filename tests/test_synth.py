"""Synthetic GGUF models: valid files (gguf's reader is the oracle), weights of the intended
magnitude (gguf.quants.dequantize is the oracle), and tiny models of both architectures that
run the same on the numba backend as on the numpy reference."""
from functools import lru_cache

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from conftest import teacher_forced_logits
from edgekv.gguf_file import GGUFFile
from edgekv.quants import BY_NAME
from edgekv.synth import BLOCK_MAKERS, SIZES, SPECIALS, write_synthetic

STD = 0.02  # write_synthetic's default weight_std


@lru_cache(maxsize=None)
def synth(tmp_root, arch: str, qtype: str, **overrides):
    path = tmp_root / f"{arch}-{qtype}-{'-'.join(f'{k}{v}' for k, v in sorted(overrides.items()))}.gguf"
    return write_synthetic(path, arch, "tiny", qtype, progress=False, **overrides)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synth")


@pytest.mark.parametrize("tname", sorted(BLOCK_MAKERS))
def test_blocks_dequantize_to_intended_magnitude(tname):
    blocks = BLOCK_MAKERS[tname](np.random.default_rng(1), 4096, STD)
    assert blocks.shape == (4096, BY_NAME[tname].block_bytes) and blocks.dtype == np.uint8
    w = dequantize(blocks, gguf.GGMLQuantizationType[tname])  # (4096, block_elems)
    assert np.isfinite(w).all()
    assert abs(w.std() / STD - 1) < 0.1, w.std()
    assert abs(w.mean()) < 0.02 * STD, w.mean()  # zero-centred, no per-type bias
    per_block = w.std(axis=1)
    assert per_block.min() > 0.3 * STD and per_block.max() < 2 * STD  # no dead or wild blocks


def _reader_meta(r: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        a = a.tolist()
    return a == b and isinstance(a, bool) == isinstance(b, bool)


@pytest.mark.parametrize("arch,qtype", [(a, q) for a in SIZES for q in ("q4_0", "q4_k", "q8_0", "q6_k", "f16", "f32")])
def test_file_agrees_with_gguf_reader(tmp_root, arch, qtype):
    path = synth(tmp_root, arch, qtype)
    f, r = GGUFFile(path), gguf.GGUFReader(path)
    assert f.version == 3
    ref = _reader_meta(r)
    assert sorted(f.meta) == sorted(ref)
    for k, v in f.meta.items():
        assert _same(v, ref[k]), k
    assert f.meta["edgekv.synthetic"] is True
    assert f.meta["general.architecture"] == arch
    assert [t.name for t in r.tensors] == list(f.tensors)
    for t in r.tensors:
        mine = f.tensors[t.name]
        assert mine.qtype == int(t.tensor_type)
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(mine.raw.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


@pytest.mark.parametrize("arch,qtype", [(a, q) for a in SIZES for q in ("q4_0", "q4_k", "q8_0", "q6_k", "f16")])
def test_weights_are_finite_and_sized(tmp_root, arch, qtype):
    f = GGUFFile(synth(tmp_root, arch, qtype))
    for t in f.tensors.values():
        w = dequantize(np.asarray(t.raw), gguf.GGMLQuantizationType(t.qtype)).reshape(t.shape)
        assert np.isfinite(w).all(), t.name
        if len(t.shape) == 1:  # norms: llama's are ones, gemma's (which hold the +1) near one
            assert 0.5 < w.mean() < 1.5 and w.min() > 0, t.name
        else:
            assert abs(w.std() / STD - 1) < 0.15, (t.name, w.std())


def test_tensor_types_follow_llamacpp_rules(tmp_root):
    """Bulk weights in the requested type, output in Q6_K for 4/5-bit types, norms F32, and
    K-quants on rows not divisible by 256 falling back like llama.cpp (Q4_K->Q5_0, Q6_K->Q8_0)."""
    types = lambda f: {n: t.type_name for n, t in f.tensors.items()}  # noqa: E731
    t = types(GGUFFile(synth(tmp_root, "llama", "q4_0")))
    assert t.pop("output.weight") == "Q6_K" and t.pop("token_embd.weight") == "Q4_0"
    assert {v for n, v in t.items() if "norm" in n} == {"F32"}
    assert {v for n, v in t.items() if "norm" not in n} == {"Q4_0"}
    assert types(GGUFFile(synth(tmp_root, "llama", "q8_0")))["output.weight"] == "Q8_0"

    # gemma3 ties the output to token_embd; attn_output's input is 2 heads x 32 = 64 wide
    t = types(GGUFFile(synth(tmp_root, "gemma3", "q4_k")))
    assert "output.weight" not in t and t["token_embd.weight"] == "Q6_K"
    assert t["blk.0.attn_output.weight"] == "Q5_0" and t["blk.0.attn_q.weight"] == "Q4_K"
    t = types(GGUFFile(synth(tmp_root, "llama", "q4_k", n_embd=64, n_ff=128)))
    assert t["output.weight"] == "Q8_0" and t["blk.1.ffn_down.weight"] == "Q5_0"


def test_config_and_vocab(tmp_root):
    from edgekv.models import model_module

    for arch in SIZES:
        f = GGUFFile(synth(tmp_root, arch, "q8_0"))
        cfg = model_module(arch).Config.from_gguf(f)
        want = SIZES[arch]["tiny"]
        assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.n_ff, cfg.n_vocab) == tuple(
            want[k] for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab"))
        tokens, types = f.meta["tokenizer.ggml.tokens"], f.meta["tokenizer.ggml.token_type"]
        scores = f.meta["tokenizer.ggml.scores"]
        assert len(tokens) == len(set(tokens)) == len(types) == len(scores) == want["n_vocab"]
        n_sp = len(SPECIALS[arch])
        assert tokens[n_sp + 0x41] == "<0x41>" and set(types[n_sp : n_sp + 256].tolist()) == {6}
        assert set(types[:n_sp].tolist()) == {3} and set(types[n_sp + 256 :].tolist()) == {1}
        assert np.all(np.diff(scores[n_sp + 256 :]) < 0)  # earlier pieces merge first
        for key in ("bos", "eos", "unknown"):
            assert tokens[f.meta[f"tokenizer.ggml.{key}_token_id"]] in SPECIALS[arch]
    f = GGUFFile(synth(tmp_root, "gemma3", "q8_0"))
    windows = model_module("gemma3").Config.from_gguf(f).windows()
    assert windows == [8] * 5 + [0] + [8]


def test_tokenizer_uses_word_pieces(tmp_root):
    """With room for the word list, SentencePiece merges build whole words from characters."""
    from edgekv.tokenizer import Tokenizer

    f = GGUFFile(synth(tmp_root, "llama", "q4_0", n_vocab=2000))
    tok = Tokenizer.from_metadata(f.meta)
    text = "Hello world, the model jumps over the lazy dog"
    ids = tok.encode(text)
    assert ids[0] == f.meta["tokenizer.ggml.bos_token_id"]
    assert tok.decode(ids[1:]) == text
    pieces = [f.meta["tokenizer.ggml.tokens"][i] for i in ids[1:]]
    assert "▁the" in pieces and "▁model" in pieces and "▁Hello" in pieces


def test_deterministic_and_validated(tmp_root):
    a = write_synthetic(tmp_root / "a.gguf", "llama", "tiny", "q4_k", seed=3, progress=False)
    b = write_synthetic(tmp_root / "b.gguf", "llama", "tiny", "q4_k", seed=3, progress=False)
    c = write_synthetic(tmp_root / "c.gguf", "llama", "tiny", "q4_k", seed=4, progress=False)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert not list(tmp_root.glob("*.part"))
    from edgekv.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError):
        write_synthetic(tmp_root / "x.gguf", "llama", "tiny", "q3_k", progress=False)
    with pytest.raises(UnsupportedModelError):
        write_synthetic(tmp_root / "x.gguf", "llama", "70b", progress=False)
    with pytest.raises(ValueError):
        write_synthetic(tmp_root / "x.gguf", "llama", "tiny", n_head=3, progress=False)
    with pytest.raises(ValueError):
        write_synthetic(tmp_root / "x.gguf", "llama", "tiny", n_vocab=100, progress=False)
    assert not (tmp_root / "x.gguf").exists()


def _one_at_a_time(model, ids: list[int], n_ctx: int = 64) -> np.ndarray:
    """Logits after every prefix of ids, fed one token per forward call (the decode path)."""
    from edgekv.kvcache import KVCache

    cache = KVCache.for_model(model.cfg, n_ctx)
    return np.concatenate([model.forward(np.array([t]), np.array([i]), cache) for i, t in enumerate(ids)])


@pytest.mark.parametrize("arch,qtype", [(a, q) for a in SIZES for q in ("q4_0", "q4_k", "q8_0", "q6_k", "f16")])
def _as_good_within_int8_noise(got: np.ndarray, ref: np.ndarray) -> None:
    """int8 activations cost ~0.5% per matmul; through 2 (llama) or 7 (gemma3, whose post-norms
    rescale each block's output to full size) layers that measures 1-7% over ten prompts, as
    much as a numpy model that rounds its activations the same way. Random logits have
    near-ties, so rather than equal argmax: got's pick is, by ref, as good as the best within
    that noise."""
    rel = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert np.isfinite(got).all() and rel.max() < 0.1, rel.max()
    noise = np.sqrt(np.mean((got - ref) ** 2, axis=-1))
    picked = ref[np.arange(len(ref)), got.argmax(-1)]
    assert np.all(picked >= ref.max(-1) - 5 * noise)  # two logits each off by ~noise


@pytest.mark.parametrize("arch,qtype", [(a, q) for a in SIZES for q in ("q4_0", "q4_k", "q8_0", "q6_k", "f16")])
def test_cpu_backend_matches_reference(tmp_root, arch, qtype):
    """20 tokens (past gemma3's 8-token window), every position, the numba backend against the
    float32 numpy oracle: once as one batch (the prefill kernels: int8 activations on VNNI
    machines, else float) and once a token at a time (the decode kernels, which quantize
    activations to int8 blocks like llama.cpp)."""
    from edgekv.backends import get_backend
    from edgekv.kernels_cpu.qmatmul import INT8_PREFILL
    from edgekv.models import build_model

    f = GGUFFile(synth(tmp_root, arch, qtype))
    n_vocab = SIZES[arch]["tiny"]["n_vocab"]
    ids = np.random.default_rng(7).integers(0, n_vocab, 20).tolist()
    ref_model, cpu_model = build_model(f, get_backend("reference")), build_model(f, get_backend("cpu"))
    ref = teacher_forced_logits(ref_model, ids)
    assert ref.shape == (20, n_vocab) and np.isfinite(ref).all()
    # the random model's logits are not flat (granite's divided by its logit_scale)
    assert ref.std(axis=-1).min() * f.meta.get(f"{arch}.logit_scale", 1.0) > 0.1

    cpu = teacher_forced_logits(cpu_model, ids)
    if INT8_PREFILL and qtype != "f16":
        _as_good_within_int8_noise(cpu, ref)
    else:
        rel = np.linalg.norm(cpu - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert rel.max() < 2e-2, rel.max()  # measured <= 7e-4
        assert (cpu.argmax(-1) == ref.argmax(-1)).mean() >= 0.9

    ref_step, step = _one_at_a_time(ref_model, ids), _one_at_a_time(cpu_model, ids)
    # the oracle itself: one batch and one token at a time differ only by the f16 cache rounding
    assert (np.linalg.norm(ref_step - ref, axis=-1) / np.linalg.norm(ref, axis=-1)).max() < 2e-3
    _as_good_within_int8_noise(step, ref_step)
