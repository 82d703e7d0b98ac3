"""Shared prefixes (issue 17): a fork or an adopted prompt-cache entry maps the frozen pages of
the ring it came from (edgekv/pages.py), copy-on-write. What each ring reads is what a copy
would hold (the reference: np.copy of the same arrays, and a cold run of the same tokens); the
memory is one copy plus each ring's own written pages (the process's proportional set size)."""
import numpy as np
import pytest

from edgekv import pages
from edgekv.generate import Sequence
from edgekv.kvcache import KVCache

pytestmark = pytest.mark.skipif(not pages.SUPPORTED, reason="copy-on-write pages need Linux")
PAGE = pages.PAGE


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024


def test_frozen_arrays_read_one_copy_and_write_their_own():
    rng = np.random.default_rng(0)
    a = np.zeros((300, 5, 7), np.float16)  # rows of 70 bytes: pages end inside rows
    a[:200] = rng.standard_normal((200, 5, 7))
    want = a.copy()
    f, = pages.freeze([(a, 200 * a[0].nbytes, None, 0)])
    b, c = f.array(), f.array()
    assert b.shape == a.shape and b.dtype == a.dtype
    assert np.array_equal(b, want) and np.array_equal(c, want)  # rows past the frozen ones are zeros
    b[150:260] = 1
    c[10] = 2
    a[:] = 3  # the array it was frozen from is not the frozen copy
    assert np.array_equal(c[11:], want[11:]) and (c[10] == 2).all() and np.array_equal(c[:10], want[:10])
    assert np.array_equal(b[:150], want[:150]) and (b[150:260] == 1).all() and not b[260:].any()
    assert np.array_equal(f.array(), want)  # the frozen pages themselves never change


def test_freezing_again_reuses_the_clean_pages_and_bounds_the_files(monkeypatch):
    row = 64
    a = np.arange(4096 * row, dtype=np.uint8).reshape(4096, row)
    base, = pages.freeze([(a, 1000 * row, None, 0)])
    b = base.array()
    b[990:1500] = 7  # rows 0..989 still as in base
    again, = pages.freeze([(b, 1500 * row, base, 990 * row)])
    assert again.segments[0][0] is base.segments[0][0]  # the same file, not a copy
    assert again.segments[0][3] == 990 * row // PAGE * PAGE and again.segments[1][2] == again.segments[0][3]
    assert np.array_equal(again.array()[:1500], b[:1500])
    monkeypatch.setattr(pages, "MAX_SEGMENTS", 3)
    f, arr, n = again, again.array(), 1500
    for _ in range(4):  # every freeze adds a file; past the bound all but the first are merged
        arr[n:n + 100] = n % 251
        n += 100
        f, = pages.freeze([(arr, n * row, f, (n - 100) * row)])
        assert len(f.segments) <= 3 and f.segments[0][0] is base.segments[0][0]
        arr = f.array()
        assert np.array_equal(arr[:n], np.concatenate([b[:1500]] + [np.full((100, row), m % 251, np.uint8)
                                                                    for m in range(1500, n, 100)]))


def _fill(cache: KVCache, n: int, seed: int, start: int = 0) -> None:
    """Write n tokens at positions start.. into every layer through the cache's protocol."""
    rng = np.random.default_rng(seed)
    for lk in cache.layers:
        plan = lk.plan(np.arange(start, start + n, dtype=np.int64))
        rows, slots = plan.writers
        lk.k[slots] = rng.standard_normal((len(slots),) + lk.k.shape[1:])
        lk.v[slots] = rng.standard_normal((len(slots),) + lk.v.shape[1:])
        lk.place(plan)
        lk.commit(plan)


def test_eight_forks_of_a_long_prefix_cost_one_copy_plus_their_tails():
    cache = KVCache([4096] * 4, n_head_kv=8, head_dim=128, kind="f16")  # 16 MiB a layer
    _fill(cache, 2048, seed=1)
    one = cache.used_nbytes
    before = pss_bytes()
    forks = [cache.fork() for _ in range(8)]
    files = {id(f) for lk in cache.layers for a in lk.frozen.values() for f, *_ in a.segments}
    assert len(files) == 1  # one descriptor for the whole cache, not one per array
    for i, f in enumerate(forks):
        _fill(f, 64, seed=10 + i, start=2048)
    grown = pss_bytes() - before
    tails = 8 * 64 * one // 2048
    assert grown < 0.25 * one + 2 * tails, (grown, one, tails)  # a copy each would be 8 * one
    ref = [lk.k[:2048].copy() for lk in cache.layers]
    for i, f in enumerate(forks):  # each reads the prefix and its own tail, nothing of the others'
        g = np.random.default_rng(10 + i)
        for lk, r in zip(f.layers, ref):
            assert np.array_equal(lk.k[:2048], r)
            assert np.array_equal(lk.k[2048:2112], g.standard_normal((64,) + lk.k.shape[1:]).astype(np.float16))
            g.standard_normal((64,) + lk.v.shape[1:])
            assert lk.pos[2111] == 2111 and lk.clean == 2048
    assert all(lk.n_written == 2048 and lk.pos[2048] != 2048 for lk in cache.layers)


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_forks_of_forks_through_a_wrapping_ring_equal_cold_runs(kv):
    """a -> fork b (goes on) -> fork c of b (its frozen copy reuses a's clean pages) -> c and a go
    on past the ring's end: each gives the logits of a fresh sequence fed the same tokens."""
    from test_batch import llm_for

    llm = llm_for("smollm2", "cpu", kv, 96)
    prompt, more = llm.tokenize("Count: " + " ".join(str(i) for i in range(30))), [11, 203, 7, 99, 42]
    assert len(prompt) * llm.new_cache().layers[0].k[0].nbytes > pages.PAGE  # the prefix fills a page
    a = Sequence(llm)
    a.feed(prompt)
    b = a.fork()
    b.feed(more[:2])
    c = b.fork()
    assert c.cache.layers[0].frozen["rows"].segments[0][0] is a.cache.layers[0].frozen["rows"].segments[0][0]
    tail = list(range(300, 340))  # 40 more tokens: every ring wraps
    assert len(prompt) + 2 + len(tail) > 96
    got_c = [c.feed([t]) for t in tail]
    got_a = [a.feed([t]) for t in tail[:30]]
    got_b = b.feed(more[2:])
    for feeds, steps, got in (([prompt, more[:2]], tail, got_c), ([prompt], tail, got_a),
                              ([prompt, more[:2]], [more[2:]], [got_b])):
        cold = Sequence(llm)  # the same batches as the forks' lineage fed
        for ids in feeds:
            cold.feed(ids)
        for ids, g in zip(steps, got):
            assert np.array_equal(cold.feed(ids if isinstance(ids, list) else [ids]), g)


def test_chats_sharing_a_cached_system_prompt_map_its_pages(tmp_path):
    """Sessions whose system prompt is in the prompt cache hold its pages, not copies: every
    session's ring maps the one frozen file of the cache's entry for it."""
    from test_prompt_cache import new_llm

    from edgekv.prompt_cache import MIN_TOKENS

    llm = new_llm("int8", tmp_path, n_ctx=1024)
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly." for i in range(60))
    sessions = [llm.session(system=system, max_tokens=4, temperature=0.0) for _ in range(3)]
    replies = [s.send(f"Say {w}.") for s, w in zip(sessions, ("one", "two", "three"))]
    n_sys = max(len(e.tokens) for e in llm.prompt_cache._mem.values() if e.logits is None)
    assert n_sys >= MIN_TOKENS
    entry = next(e for e in llm.prompt_cache._mem.values() if len(e.tokens) == n_sys)
    files = {id(s[0]) for s in entry.cache.layers[0].frozen["rows"].segments}
    for s in sessions:
        lk = s.seq.cache.layers[0]
        assert lk.frozen is not None and id(lk.frozen["rows"].segments[0][0]) in files
    cold = new_llm("int8", tmp_path / "cold", n_ctx=1024, prompt_cache=False)
    assert replies == [cold.session(system=system, max_tokens=4, temperature=0.0).send(f"Say {w}.")
                       for w in ("one", "two", "three")]
