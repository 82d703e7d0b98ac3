"""Memory bounds: an n_ctx whose cache cannot fit is refused before anything is allocated, a
warning past the trained context, no eager memory per n_ctx token, and saved sessions that
hold only the filled part of the cache."""
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from conftest import get_llm, model_path
from edgekv import LLM, ChatSession, SessionFileError
from edgekv.errors import ContextError, EdgekvError
from edgekv.kvcache import LAYER_ARRAYS, KVCache, cache_bytes, capacities

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from edgekv.synth import write_synthetic

    d = tmp_path_factory.mktemp("tiny")
    return {a: write_synthetic(d / f"{a}.gguf", arch=a, size="tiny", qtype="q8_0", progress=False)
            for a in ("llama", "gemma3")}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the check before allocating ------------------------------------------------------------
@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_cache_bytes_is_what_a_full_cache_holds(key, kind):
    """The figure the check uses is every byte of a cache's arrays (gemma3's sliding layers at
    their window), though an empty cache has touched none of it."""
    llm = get_llm(key, n_ctx=1024)
    cfg, cache = llm.cfg, llm.new_cache(kind)
    caps = capacities(cfg.windows(), 1024)
    held = sum(lk.nbytes + lk.pos.nbytes for lk in cache.layers)
    assert cache_bytes(kind, caps, cfg.n_head_kv, cfg.head_dim) == held
    assert [lk.capacity for lk in cache.layers] == caps
    if key == "gemma3":
        assert min(caps) == cfg.sliding_window < 1024 == max(caps)


def test_huge_context_is_refused_before_anything_is_allocated(monkeypatch):
    """Deterministic: the available memory is mocked, and the backend (weights, threads) must
    not even be reached."""
    import edgekv.llm as llm_mod

    cfg = get_llm("smollm2").cfg
    monkeypatch.setattr(llm_mod, "available_memory", lambda: (2**30, "mocked"))
    real_backend = llm_mod.get_backend

    def no_backend(*a, **k):
        raise AssertionError("the backend was built before the context check")

    monkeypatch.setattr(llm_mod, "get_backend", no_backend)
    path = model_path("smollm2")
    with pytest.raises(ContextError) as err:
        LLM(path, n_ctx=100_000_000, kv="int8")
    msg = str(err.value)
    need = cache_bytes("int8", [100_000_000] * cfg.n_layer, cfg.n_head_kv, cfg.head_dim)
    assert "\n" not in msg and f"{need:,} bytes" in msg and "1,073,741,824 bytes" in msg and "mocked" in msg
    monkeypatch.setattr(llm_mod, "get_backend", real_backend)
    assert LLM(path, n_ctx=4096, kv="int8").n_ctx == 4096  # 50 MB: fits


def test_available_memory_reads_meminfo_and_the_rlimit():
    import resource

    from edgekv.llm import available_memory

    got = available_memory()
    assert got is not None and got[0] > 0
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        assert got[0] <= avail * 1.5  # (the figure moves as other processes run)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY and hard == resource.RLIM_INFINITY:
        assert got[1] != "RLIMIT_AS"


@linux_only
def test_cli_refuses_a_context_over_the_address_space_limit_in_one_line():
    """A real limit: the child caps its address space at what it uses plus 1 GiB, then asks
    for a 2.6 GB int4 cache. Allocating it would fail (MemoryError, a traceback); the check
    refuses it first, in one line."""
    child = textwrap.dedent(f"""
        import resource, sys
        import edgekv.cli, edgekv.backends.cpu, numba  # everything run imports, before the limit
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))
        sys.exit(edgekv.cli.main(["run", {str(model_path("smollm2"))!r}, "Hi", "-n", "1", "--kv", "int4",
                                  "--ctx", "400000", "--quiet"]))
    """)
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    err = p.stderr.strip()
    assert p.returncode == 1, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("edgekv: error: n_ctx=400000 needs") and "available (RLIMIT_AS)" in err, err


def test_warning_past_the_trained_context():
    path = model_path("smollm2")
    trained = get_llm("smollm2").cfg.n_ctx_train
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LLM(path, n_ctx=trained)  # at the trained context: silent
    with pytest.warns(UserWarning, match=f"n_ctx={trained + 1} is past the {trained} tokens") as w:
        LLM(path, n_ctx=trained + 1)
    assert len(w) == 1 and "\n" not in str(w[0].message) and w[0].filename == __file__  # names the caller's line


# -- no eager memory per n_ctx token ----------------------------------------------------------
@linux_only
@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_an_empty_cache_costs_no_memory_per_token(kind):
    """Resident memory of an empty cache at 10k and at 1M tokens per layer (SmolLM2's head
    shapes, 4 layers): the difference must be a sliver of the rings' bytes (the positions
    filled with -1 and the value scales of zeros_like cost 2-9% of them, all resident)."""

    def grown(cap):
        before = _rss()
        cache = KVCache([cap] * 4, 3, 64, kind=kind)
        return _rss() - before, sum(lk.ring_nbytes for lk in cache.layers)

    small, ring_small = grown(10_000)
    big, ring_big = grown(1_000_000)
    assert big - small < 0.002 * (ring_big - ring_small), (big - small, ring_big - ring_small)


@linux_only
def test_generating_at_a_huge_context_adds_no_memory_per_token(tiny_models):
    """End to end (load, prefill, decode): at n_ctx = 1M the process grows by about what it
    grows at n_ctx = 512, not by anything proportional to n_ctx."""
    path = tiny_models["llama"]

    def grown(n_ctx):
        llm = LLM(path, n_ctx=n_ctx, kv="int8")
        before = _rss()
        s = llm.session(temperature=0, max_tokens=8)
        s.send("hello there")
        return _rss() - before, s.seq.cache

    grown(512)  # compiles, warms the allocator
    small, _ = grown(512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # past the tiny model's trained context
        big, cache = grown(1_000_000)
    ring = sum(lk.ring_nbytes for lk in cache.layers)
    assert big - small < max(0.004 * ring, 2 * 2**20), (big - small, ring)


# -- sessions hold the filled part of the cache -----------------------------------------------
def _state(cache) -> list[dict]:
    return [{n: a.copy() for n, a in lk.state()[1].items()} for lk in cache.layers]


def _same_state(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(np.array_equal(x[n], y[n]) for n in x) for x, y in zip(a, b))


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_saved_session_holds_only_its_tokens(tmp_path, kv):
    llm = get_llm(kv=kv, n_ctx=4096)
    ban = {t: float("-inf") for t in llm.tokenizer.eot_ids}  # replies run to max_tokens
    s = llm.session(temperature=0, max_tokens=16, logit_bias=ban)
    s.send("Tell me about the sea.")
    n1, state = s.n_cached, _state(s.seq.cache)
    assert 48 <= n1 <= 56  # a 50-token chat
    s.save(tmp_path / "a.ekv")
    size1 = os.path.getsize(tmp_path / "a.ekv")
    whole = llm.new_cache().nbytes
    assert size1 < 4e6 and size1 < whole / 10, (size1, whole)

    r = ChatSession.load(tmp_path / "a.ekv", llm)
    assert _same_state(_state(r.seq.cache), state) and r.seq.tokens == s.seq.tokens
    assert r.send("And the sky?") == s.send("And the sky?")  # the same continuation
    assert _same_state(_state(r.seq.cache), _state(s.seq.cache))

    s.save(tmp_path / "b.ekv")
    n2, size2 = s.n_cached, os.path.getsize(tmp_path / "b.ekv")
    cfg = llm.cfg
    per_token = cache_bytes(kv, [1] * cfg.n_layer, cfg.n_head_kv, cfg.head_dim) - \
        cache_bytes(kv, [0] * cfg.n_layer, cfg.n_head_kv, cfg.head_dim)
    # grows by the new tokens' slots, plus their ids and text in the JSON header
    assert (n2 - n1) * per_token <= size2 - size1 <= (n2 - n1) * (per_token + 64) + 4096

    r2 = ChatSession.load(tmp_path / "b.ekv", llm)
    t = llm.tokenize(" Yes", add_bos=False)[0]
    assert np.array_equal(r2.seq.feed([t]), s.seq.feed([t]))  # the same logits


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_session_with_wrapped_rings_round_trips(tmp_path, tiny_models, kv):
    """Tiny gemma3 at n_ctx 48: its sliding layers (window 8) wrap, its global layer wraps
    after 48 tokens. Saved before and after, a load continues with the same logits."""
    llm = LLM(tiny_models["gemma3"], n_ctx=48, kv=kv)
    s = llm.session()
    rng = np.random.default_rng(0)
    for n_tokens in (20, 70):  # global ring partly filled, then wrapped
        s.seq.feed([int(i) for i in rng.integers(3, llm.cfg.n_vocab, n_tokens - s.n_cached)])
        fills = {lk.capacity: lk.fill for lk in s.seq.cache.layers}
        assert fills[8] == 8 and fills[48] == min(n_tokens, 48)
        s.save(tmp_path / "w.ekv")
        r = ChatSession.load(tmp_path / "w.ekv", llm)
        assert _same_state(_state(r.seq.cache), _state(s.seq.cache))
        assert all(a.n_written == b.n_written for a, b in zip(r.seq.cache.layers, s.seq.cache.layers))
        assert np.array_equal(r.seq.feed([7]), s.seq.feed([7]))


def test_version_2_files_still_load_and_others_are_named(tmp_path):
    llm = get_llm(kv="int4", n_ctx=256)
    s = llm.session(temperature=0, max_tokens=8)
    s.send("Hi there")
    s.save(tmp_path / "v3.ekv")
    data = (tmp_path / "v3.ekv").read_bytes()
    n = struct.unpack_from("<Q", data, 8)[0]
    h = json.loads(data[16 : 16 + n])
    arrays = dict(np.load(io.BytesIO(data[16 + n :])))
    for i, lk in enumerate(s.seq.cache.layers):  # version 2 wrote every slot, filled or not
        for name in lk.slot_arrays:
            full = np.full_like(lk.pos, -1) if name == "pos" else np.zeros_like(getattr(lk, name))
            full[: lk.fill] = arrays[f"{name}{i}"]
            arrays[f"{name}{i}"] = full
    assert set(arrays) == {f"{name}{i}" for name in LAYER_ARRAYS for i in range(len(s.seq.cache.layers))}

    def write(version, out):
        blob = json.dumps(dict(h, version=version)).encode()
        body = io.BytesIO()
        np.savez(body, **arrays)
        out.write_bytes(data[:8] + struct.pack("<Q", len(blob)) + blob + body.getvalue())
        return out

    v2 = write(2, tmp_path / "v2.ekv")
    unfilled = sum(lk.ring_nbytes * (lk.capacity - lk.fill) // lk.capacity for lk in s.seq.cache.layers)
    assert v2.stat().st_size - len(data) >= unfilled > 0  # the slots version 3 leaves out
    r = ChatSession.load(v2, llm)
    assert _same_state(_state(r.seq.cache), _state(s.seq.cache))
    assert r.send("More?") == s.send("More?")
    with pytest.raises(SessionFileError, match="corrupt"):  # full-ring arrays are not version 3's
        ChatSession.load(write(3, tmp_path / "bad.ekv"), llm)
    with pytest.raises(SessionFileError, match="version 1, this edgekv reads versions 2, 3"):
        ChatSession.load(write(1, tmp_path / "v1.ekv"), llm)


def test_cli_shows_the_trained_context_warning_as_one_line():
    import subprocess
    import sys

    trained = get_llm("smollm2").cfg.n_ctx_train
    r = subprocess.run([sys.executable, "-m", "edgekv.cli", "run", str(model_path("smollm2")), "Hi", "-n", "1",
                        "--ctx", str(trained + 8), "-q"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"edgekv: warning: n_ctx={trained + 8} is past the {trained} tokens")


@linux_only
def test_weights_copied_out_of_the_map_on_request(monkeypatch, tiny_models):
    """EDGEKV_WEIGHTS=copy: the matrices leave the file's memory map for anonymous memory (the
    same logits, prefill and decode), and the map's pages of them are given back, so that the
    process does not hold the weights twice; any other value is refused."""
    path = tiny_models["llama"]
    ref = LLM(path, n_ctx=64, kv="f16")
    monkeypatch.setenv("EDGEKV_WEIGHTS", "copy")
    llm = LLM(path, n_ctx=64, kv="f16")
    mm = np.frombuffer(llm.file._mmap, np.uint8)
    lo, hi = mm.ctypes.data, mm.ctypes.data + mm.size
    for w in (llm.model.layers[0].ffn_down, llm.model.output):
        assert all(not lo <= a.ctypes.data < hi for a in w.ws if a.size)
    def steps(m):
        cache = m.new_cache()
        return [m.forward([1, 5, 9], cache, 0), m.forward([3], cache, 3), m.forward([7], cache, 4)]

    for a, b in zip(steps(ref), steps(llm)):
        np.testing.assert_array_equal(a, b)
    with open("/proc/self/smaps") as f:  # the map of this LLM's file: only what was not copied
        blocks = f.read().split("\n")
    at = next(i for i, line in enumerate(blocks) if line.startswith(f"{lo:x}-"))
    rss_kb = next(int(line.split()[1]) for line in blocks[at:] if line.startswith("Rss:"))
    assert rss_kb * 1024 < 0.2 * llm.file.size
    monkeypatch.setenv("EDGEKV_WEIGHTS", "mapped")
    with pytest.raises(EdgekvError, match="EDGEKV_WEIGHTS must be auto, map or copy"):
        LLM(path, n_ctx=64)


@linux_only
def test_weights_a_backend_repacks_or_copies_share_chunks_on_huge_pages():
    """The CPU backend's arena (backends/cpu.py _Arena): pieces 64-byte aligned and side by side,
    a chunk of 2 MiB or more mapped from a 2 MiB boundary (its huge pages), a piece larger than
    what is left in a chunk of its own; a small model's first chunk no larger than its piece (the
    address space a load reserves); a chunk is unmapped once no array in it is left."""
    import gc
    import weakref

    from edgekv.backends.cpu import _Arena

    tiny = _Arena()
    w = tiny.take((2, 100))
    assert w.ctypes.data % 64 == 0 and tiny.buf.nbytes <= 200 + 64
    arena = _Arena()
    if not arena.huge:
        pytest.skip("no transparent huge pages here")
    arena.CHUNK = 4 << 20
    a, b = arena.take((3, 1 << 20)), arena.take((5, 64))
    assert a.ctypes.data % arena.HUGE == 0 and b.ctypes.data == a.ctypes.data + (3 << 20)
    under = lambda x: x.base.base.obj  # noqa: E731 (a piece -> its chunk's array -> memoryview -> mmap)
    chunk = weakref.ref(under(a))
    big = arena.take((5, 1 << 20))  # more than the first chunk has left
    c = arena.take((1, 64))
    assert under(big) is not under(a) and under(c) is under(big) and under(b) is under(a)
    assert big.ctypes.data % arena.HUGE == 0 and c.ctypes.data == big.ctypes.data + (5 << 20)
    a[:], b[:] = 1, 2
    assert a.sum() == 3 << 20 and b.sum() == 640  # apart
    del a
    gc.collect()
    assert chunk() is not None  # b is still in it
    del b
    gc.collect()
    assert chunk() is None


def test_keep_freed_memory(monkeypatch):
    """The CPU backend asks glibc to keep freed blocks (prefill's activation arrays are not faulted
    in again every layer): applied where glibc's mallopt exists, left to the user when any MALLOC_*
    variable is set."""
    import platform

    from edgekv.backends import cpu

    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert cpu.keep_freed_memory() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert cpu.keep_freed_memory() is True
