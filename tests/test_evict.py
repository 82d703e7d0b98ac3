"""Eviction policies (edgekv/evict.py): the slots a full ring overwrites, checked against a plain
numpy implementation of each policy (f16) and against the numpy reference backend (every cache
type), through a ring that wraps several times, prefill batches that evict as they go, and
sliding-window layers; the protected tokens; the API and the CLI."""
import json

import numpy as np
import pytest

from conftest import decode_logits, llamacpp_fixture, model_path, open_model

H, HKV, HD, CAP = 4, 2, 32, 64
SCALE = HD ** -0.5


def _rope():
    from edgekv.rope import Rope

    return Rope(10000.0 ** (-np.arange(0, HD, 2) / HD), False)


def _qkv(rng, n):
    # peaked scores (std ~2.8 after scaling): importance differs clearly from token to token
    return (rng.standard_normal((n, H, HD)).astype(np.float32) * 2, rng.standard_normal((n, HKV, HD)).astype(np.float32) * 2,
            rng.standard_normal((n, HKV, HD)).astype(np.float32))


def _kept(lk) -> set:
    return set(lk.pos[: lk.fill][lk.pos[: lk.fill] >= 0].tolist())


class NumpyPolicy:
    """The policy written out plainly for an f16 ring of one layer: every token kept at its true
    position, attention over the kept ones, the least important unprotected one dropped."""

    def __init__(self, policy, cap, n_sink=4, recent=32, window=0):
        self.policy, self.cap, self.n_sink, self.recent, self.window = policy, cap, n_sink, recent, window
        self.k, self.v, self.score = {}, {}, {}  # by position
        self.protected: set = set()

    def step(self, q, k, v, p0):
        n = len(q)
        over = len(self.k) + n - self.cap
        if over > 0:  # drop the least important (out of the window first), never sinks / recent / marked
            cand = [p for p in self.k if p >= self.n_sink and p < p0 - self.recent]
            key = {p: (-1.0 if self.window and p0 - p >= self.window else self.score[p] + (1e30 if p in self.protected else 0))
                   for p in cand}
            for p in sorted(cand, key=lambda p: key[p])[:over]:
                del self.k[p], self.v[p], self.score[p]
        for i in range(n):
            self.k[p0 + i] = k[i].astype(np.float16).astype(np.float32)
            self.v[p0 + i] = v[i].astype(np.float16).astype(np.float32)
            self.score[p0 + i] = 0.0
        pos = np.array(sorted(self.k))
        K = np.stack([self.k[p] for p in pos])  # (T, Hkv, hd)
        V = np.stack([self.v[p] for p in pos])
        K, V = np.repeat(K, H // HKV, axis=1), np.repeat(V, H // HKV, axis=1)
        s = np.einsum("nhd,thd->hnt", q.astype(np.float64), K) * SCALE
        qp = p0 + np.arange(n)
        dist = qp[:, None] - pos[None, :]
        seen = (dist >= 0) & ((dist < self.window) if self.window else True)
        s = np.where(seen[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        imp = pr[:, -32:].mean(axis=(0, 1))  # heads, the last 32 queries
        if self.policy == "tova":
            self.score = dict.fromkeys(self.score, 0.0)
        elif self.policy == "ema":
            self.score = {p: float(np.float32(x) * np.float32(0.8)) for p, x in self.score.items()}
        for p, x in zip(pos, imp):
            self.score[int(p)] += float(x)
        return np.einsum("hnt,thd->nhd", pr, V)


@pytest.mark.parametrize("policy", ["h2o", "tova", "ema"])
def test_f16_ring_evicts_as_the_plain_policy(policy):
    """CPU backend (one-token decode step, prefill batches) against NumpyPolicy: the same kept
    positions after every step and the same attention output, through 5 wraps of the ring."""
    from edgekv.backends.cpu import CPUBackend
    from edgekv.kvcache import KVCache

    rng = np.random.default_rng(1)
    be, lk = CPUBackend(), KVCache([CAP], HKV, HD, n_sink=4, kind="f16", evict=policy)[0]
    ref = NumpyPolicy(policy, CAP)
    p, steps = 0, [40] + [1] * 100 + [7, 9] + [1] * 150 + [12] + [1] * 30
    for n in steps:
        q, k, v = _qkv(rng, n)
        out = be.attention(q, np.arange(p, p + n, dtype=np.int64), lk, k, v, SCALE, _rope())
        want = ref.step(q, k, v, p)
        p += n
        assert _kept(lk) == set(ref.k), f"after position {p - 1}"
        np.testing.assert_allclose(out, want, atol=2e-3, rtol=2e-3)
    assert lk.evictor.evicted == p - CAP


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
@pytest.mark.parametrize("policy", ["h2o", "tova", "ema"])
def test_every_cache_type_evicts_as_the_reference_backend(kind, policy):
    """CPU kernels (scores from kv_attention and the fused decode step, int kinds' exact tiers)
    against the numpy reference backend: same kept positions, same importance, same output; the
    sinks, the last 32 positions and marked positions are always kept."""
    from edgekv.backends.cpu import CPUBackend
    from edgekv.backends.reference import ReferenceBackend
    from edgekv.kvcache import KVCache

    rng = np.random.default_rng(2)
    bes = [CPUBackend(), ReferenceBackend()]
    caches = [KVCache([CAP], HKV, HD, n_sink=4, kind=kind, evict=policy) for _ in bes]
    marked = [45, 46, 120]
    for c in caches:
        c.protect(marked)
    p = 0
    for n in [30] + [1] * 90 + [8, 5] + [1] * 120 + [14] + [1] * 20:
        q, k, v = _qkv(rng, n)
        outs = [be.attention(q, np.arange(p, p + n, dtype=np.int64), c[0], k, v, SCALE, _rope())
                for be, c in zip(bes, caches)]
        p += n
        a, b = (c[0] for c in caches)
        assert _kept(a) == _kept(b), f"after position {p - 1}"
        np.testing.assert_allclose(a.evictor.score, b.evictor.score, atol=1e-5)
        np.testing.assert_allclose(outs[0], outs[1], atol=3e-3, rtol=3e-3)
        kept = _kept(a)
        assert len(kept) == a.fill == min(p, CAP)  # one position per slot, none lost
        assert max(kept) == p - 1
        assert set(range(4)) <= kept and set(range(max(0, p - 32), p)) <= kept  # sinks, recent window
        assert {m for m in marked if m < p} <= kept
    assert a.evictor.evicted == p - CAP


def test_sliding_window_layer_evicts_what_left_its_window_first():
    """A sliding layer whose ring (48) is smaller than its window (80) evicts by importance inside
    the window and drops what left it first; with a ring of its whole window it has no policy."""
    from edgekv.backends.cpu import CPUBackend
    from edgekv.kvcache import KVCache

    assert KVCache([80], HKV, HD, windows=[80], evict="tova")[0].evictor is None
    rng = np.random.default_rng(3)
    be = CPUBackend()
    lk = KVCache([48], HKV, HD, windows=[80], kind="f16", evict="tova")[0]
    assert lk.n_sink == 0 and lk.span == 80
    ref = NumpyPolicy("tova", 48, n_sink=0, window=80)
    p = 0
    for n in [20] + [1] * 200:
        q, k, v = _qkv(rng, n)
        out = be.attention(q, np.arange(p, p + n, dtype=np.int64), lk, k, v, SCALE, _rope())
        want = ref.step(q, k, v, p)
        p += n
        assert _kept(lk) == set(ref.k)
        np.testing.assert_allclose(out, want, atol=2e-3, rtol=2e-3)
    assert min(_kept(lk)) > p - 1 - 80


def test_a_batch_too_large_for_the_ring_is_one_error():
    from edgekv.backends.cpu import CPUBackend
    from edgekv.errors import ContextError
    from edgekv.kvcache import KVCache

    rng = np.random.default_rng(4)
    cache = KVCache([CAP], HKV, HD, kind="int8", evict="h2o")
    assert cache.batch_limit == (CAP - 4 - 32) // 2
    q, k, v = _qkv(rng, CAP)
    CPUBackend().attention(q, np.arange(CAP), cache[0], k, v, SCALE, _rope())
    q, k, v = _qkv(rng, 29)
    with pytest.raises(ContextError, match="does not fit"):
        CPUBackend().attention(q, np.arange(CAP, CAP + 29), cache[0], k, v, SCALE, _rope())


def _state(lk) -> dict:
    from edgekv.kvcache import LAYER_ARRAYS

    ev = lk.evictor
    return dict({a: getattr(lk, a).copy() for a in LAYER_ARRAYS}, n=lk.n_written, exact_from=lk.exact_from,
                score=ev.score.copy(), keep=ev.keep.copy(), rslot=ev.rslot.copy(), evicted=ev.evicted)


def _pooled(probe: np.ndarray, pos: np.ndarray, w: int = 7) -> np.ndarray:
    """Max over each kept position's w nearest kept positions (in position order), plainly."""
    live = sorted(np.flatnonzero(pos >= 0), key=lambda j: pos[j])
    out = probe.copy()
    for i, j in enumerate(live):
        out[j] = max(probe[live[t]] for t in range(max(0, i - w // 2), min(len(live), i + w // 2 + 1)))
    return out


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_a_probe_scores_what_it_attends_to_and_changes_nothing_else(kind):
    """A probe (kvcache.ProbeLayer: a prompt's end looking at the ring before a chunk evicts)
    stores, places and commits nothing: every array of the cache and the policy's own scores stay
    as they were; its output and scores are the reference backend's, the scores then pooled over 7
    neighbouring kept positions."""
    from edgekv.backends.cpu import CPUBackend
    from edgekv.backends.reference import ReferenceBackend
    from edgekv.kvcache import KVCache, ProbeLayer

    rng = np.random.default_rng(5)
    bes = [CPUBackend(), ReferenceBackend()]
    caches = [KVCache([CAP], HKV, HD, n_sink=4, kind=kind, evict="tova") for _ in bes]
    p = 0
    for n in [30, 20] + [1] * 40:  # a full ring that has evicted
        q, k, v = _qkv(rng, n)
        for be, c in zip(bes, caches):
            be.attention(q, np.arange(p, p + n, dtype=np.int64), c[0], k, v, SCALE, _rope())
        p += n
    q, k, v = _qkv(rng, 12)
    qp = np.arange(p, p + 12, dtype=np.int64)
    before = [_state(c[0]) for c in caches]
    outs = [be.attention(q, qp, ProbeLayer(c[0]), k, v, SCALE, _rope()) for be, c in zip(bes, caches)]
    for b, c in zip(before, caches):
        after = _state(c[0])
        for name in b:
            np.testing.assert_array_equal(after[name], b[name], err_msg=name)
    a, r = (c[0].evictor for c in caches)
    assert a.probe.sum() > 0 and not a.probed
    np.testing.assert_allclose(a.probe, r.probe, atol=1e-5)
    np.testing.assert_allclose(outs[0], outs[1], atol=3e-3, rtol=3e-3)
    raw = a.probe.copy()
    caches[0].probed()
    assert a.probed
    np.testing.assert_array_equal(a.probe, _pooled(raw, caches[0][0].pos))


def test_bounded_prefill_probes_with_the_prompts_end():
    """LLM.forward over a prompt longer than an evicting ring: before each chunk that evicts, the
    prompt's last tokens run as a probe, whose scores choose that chunk's victims; without a policy
    there is no probe. Fed in parts (generate) the prompt probes with its own end too."""
    import edgekv

    llm = edgekv.LLM(model_path("smollm2"), n_ctx=96, kv="f16", evict="tova", prompt_cache=False)
    ids = llm.tokenize(open(__file__).read()[:2000])[:400]
    seen = []
    real = llm._probe
    llm._probe = lambda obs, cache, start: (seen.append((list(obs), start)), real(obs, cache, start))
    cache = llm.new_cache()
    llm.forward(ids, cache, 0)
    lim = cache.batch_limit
    assert seen and all(obs == ids[-32:] for obs, _ in seen)
    starts = [s for _, s in seen]
    assert starts == [s for s in range(0, len(ids), lim) if s + min(lim, len(ids) - s) > 96]
    assert not any(lk.evictor.probed for lk in cache.layers)  # each probe chose one chunk's victims
    seen.clear()
    events = list(llm.generate(ids, max_tokens=1, temperature=0))
    assert seen and all(obs == ids[-32:] for obs, _ in seen) and events[-1].finish_reason
    plain = edgekv.LLM(model_path("smollm2"), n_ctx=96, kv="f16", prompt_cache=False)
    plain._probe = llm._probe
    seen.clear()
    plain.forward(ids, plain.new_cache(), 0)
    assert not seen


def _decode(model, ids, kind, policy, fused):
    from edgekv.kvcache import KVCache

    cfg = model.cfg
    windows = cfg.windows()
    cache = KVCache([w if w else 72 for w in windows], cfg.n_head_kv, cfg.head_dim, windows=windows, kind=kind,
                    evict=policy)
    return decode_logits(model, ids, cache, fused, 20), cache


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_fused_decode_block_evicts_as_the_op_by_op_path(model_key, kind):
    """The fused decode block's scores (kernels_cpu/block.py) are the op-by-op path's: the same
    tokens kept in every layer, the same logits, through a 72-token ring wrapped 2x."""
    _, model = open_model(model_key, "cpu")
    P = llamacpp_fixture(model_key)["prompts"]
    ids = sum((x["prompt_ids"] + x["continuation"] for x in P), [])[:200]
    policy = {"f16": "tova", "int8": "h2o", "int4": "ema"}[kind]
    fused, fc = _decode(model, ids, kind, policy, True)
    plain, pc = _decode(model, ids, kind, policy, False)
    for a, b in zip(fc.layers, pc.layers):
        assert _kept(a) == _kept(b)
        assert (a.evictor is None) == (b.evictor is None) == bool(a.window)  # gemma3's local layers keep their window
    assert sum(lk.evictor.evicted for lk in fc.layers if lk.evictor) > 0
    rel = np.linalg.norm(fused - plain, axis=-1) / np.linalg.norm(plain, axis=-1)
    assert rel.max() < 1e-3, rel.max()


def test_api_policies_and_protected_template_tokens():
    """edgekv.load(evict=...): a chat longer than the ring prefills in chunks that evict as they
    go, keeps every control token (role markers, turn ends) and the role name after each."""
    import edgekv
    from edgekv.errors import EdgekvError

    from edgekv.evict import EMA_DECAY
    from edgekv.kernels_cpu.evict import EMA_DECAY as KERNEL_DECAY

    assert edgekv.EVICT_POLICIES[0] == "window" and {"h2o", "tova", "ema"} <= set(edgekv.EVICT_POLICIES)
    assert np.float32(EMA_DECAY) == KERNEL_DECAY
    with pytest.raises(EdgekvError, match="unknown eviction policy 'lru'"):
        edgekv.LLM(model_path("smollm2"), evict="lru")
    llm = edgekv.LLM(model_path("smollm2"), n_ctx=128, kv="int4", evict="tova", prompt_cache=False)
    msgs = [{"role": "user", "content": open(__file__).read()[:1200]}]
    ids, _ = llm.chat_prompt(msgs)
    assert len(ids) > 2 * 128
    r = llm.chat(msgs, max_tokens=4)
    st = llm.stats.as_dict()
    assert st["evict"] == "tova" and st["kv_evicted"] > 0 and 0 < st["kv_kept_mass"] <= 1
    assert st["kv_tokens"] == 128 and r["choices"][0]["message"]["content"] is not None
    seq_cache = llm.new_cache()
    llm.forward(ids, seq_cache, 0)
    ctrl = set(llm.tokenizer.control_ids())
    want = {i for i, t in enumerate(ids) if t in ctrl} | {i + 1 for i, t in enumerate(ids) if t in ctrl and i + 1 < len(ids)}
    assert want and all(want <= _kept(lk) for lk in seq_cache.layers)
    from edgekv.cli import _kv_line

    sess = llm.session(temperature=0, max_tokens=4)
    sess.send(msgs[0]["content"])
    line = _kv_line(sess)
    assert f"evict tova: {sess.stats.kv_evicted} tokens evicted" in line and sess.stats.kv_evicted > 0


def test_cli_perplexity_ring_evict(capsys):
    """`edgekv perplexity --ring N --evict ...`: the JSON per cache and policy, scored from N on,
    each full ring having evicted (tokens fed - N) tokens per layer."""
    from edgekv.cli import main

    rc = main(["perplexity", str(model_path("smollm2")), __file__, "--ring", "64", "--tokens", "120", "--evict", "window,h2o", "--kv", "int8", "-q"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    res = out["results"]
    assert out["ring"] == 64 and set(res) == {"uncapped f16", "int8/window", "int8/h2o"}
    for name in ("int8/window", "int8/h2o"):
        assert res[name]["n_scored"] == res["uncapped f16"]["n_scored"] == 120 - 1 - 64
        assert res[name]["kv_evicted"] == (119 - 64) * 30 and res[name]["mean_kl"] > 0
        assert 0 <= res[name]["top1_agreement"] <= 1


def _evictors(cache) -> list:
    return [(lk.evictor.score.copy(), lk.evictor.keep.copy(), lk.evictor.rslot.copy(), lk.evictor.evicted, lk.evictor.lost,
             set(lk.evictor.pending)) for lk in cache.layers if lk.evictor is not None]


def _same_evictors(a, b) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) and np.array_equal(x[2], y[2])
        assert x[3:] == y[3:]


@pytest.mark.parametrize("kind,policy", [("f16", "tova"), ("int8", "h2o"), ("int4", "ema")])
def test_a_saved_session_keeps_the_policys_state(tmp_path, kind, policy):
    """A chat saved once its ring has evicted goes on after loading exactly as it would have: the
    scores, protected tokens and exact rows' slots come back, and the next turn's tokens match."""
    import edgekv
    from edgekv.errors import SessionFileError
    from edgekv.session import ChatSession

    def load(evict):
        return edgekv.LLM(model_path("smollm2"), n_ctx=128, kv=kind, evict=evict, prompt_cache=False)

    llm = load(policy)
    sess = llm.session(temperature=0, max_tokens=6)
    sess.send(open(__file__).read()[:900])
    assert sess.stats.kv_evicted > 0 and any(e[1].any() for e in _evictors(sess.seq.cache))
    sess.save(tmp_path / "s.edgekv")
    back = ChatSession.load(tmp_path / "s.edgekv", load(policy))
    _same_evictors(_evictors(sess.seq.cache), _evictors(back.seq.cache))
    assert back.send("And then?") == sess.send("And then?")
    _same_evictors(_evictors(sess.seq.cache), _evictors(back.seq.cache))
    with pytest.raises(SessionFileError, match=f"needs evict={policy}; this model is loaded with evict=window"):
        ChatSession.load(tmp_path / "s.edgekv", load("window"))
    lk = next(lk for lk in sess.seq.cache.layers if lk.evictor is not None)
    meta, arrays = lk.state()
    for name, bad in [("ev_score", -1.0), ("ev_rslot", lk.capacity), ("ev_keep", 2)]:
        if not arrays[name].size:  # an f16 ring has no exact rows
            continue
        broken = dict(arrays, **{name: np.full_like(arrays[name], bad)})
        with pytest.raises(ValueError, match="eviction state out of range"):
            lk.checked(meta, broken, len(sess.seq.tokens))
    with pytest.raises(ValueError, match="eviction array ev_keep missing"):
        lk.checked(meta, {k: a for k, a in arrays.items() if k != "ev_keep"}, len(sess.seq.tokens))
    other = dict(meta, evict=dict(meta["evict"], policy="window" if policy != "tova" else "h2o"))
    assert lk.checked(other, arrays, len(sess.seq.tokens))[1]["evictor"] is None  # another policy's: start afresh


def test_a_prompt_cache_file_keeps_the_protected_tokens():
    """A prompt-cache entry written to disk and read back (prompt_cache's packed raw body) holds
    the policy's scores and protected template tokens, which a prefix skipped by it could not mark again."""
    import edgekv
    from edgekv.kvfile import cache_arrays, load_cache, raw_arrays, raw_body
    from edgekv.prompt_cache import _pack, _unpack

    llm = edgekv.LLM(model_path("smollm2"), n_ctx=128, kv="int8", evict="tova", prompt_cache=False)
    ids, _ = llm.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."}])
    cache = llm.new_cache()
    llm.forward(ids, cache, 0)
    want = _evictors(cache)
    assert all(e[1].sum() >= 4 and e[0].any() for e in want)
    metas, arrays = cache_arrays(cache)
    index, parts = raw_body(_pack(arrays, len(metas)))
    body = memoryview(b"".join(bytes(p) for p in parts))
    back = llm.new_cache()
    load_cache(back, metas, _unpack(raw_arrays(index, body), len(metas)), len(ids))
    _same_evictors(want, _evictors(back))
    window = llm.new_cache(evict="window")  # another policy's cache takes the tokens, not the state
    load_cache(window, metas, _unpack(raw_arrays(index, body), len(metas)), len(ids))
    assert all(lk.evictor is None for lk in window.layers)


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_sliding_layers_lend_to_the_global_layer_once_it_fills(kind):
    """Under a policy, the sliding layers (rings of their whole window, 64) give a quarter of it to
    the global layer (a ring of the window too) in the batch that overflows it, the slots in all
    unchanged: until then every output is the window policy's, bit for bit; after it the global
    ring keeps all 96 positions, each sliding ring its most attended 48 of the window (never the
    last 32 nor marked ones), the CPU kernels as the reference backend; reset gives the rings
    back. From twice the window on nothing is lent."""
    from edgekv.backends.cpu import CPUBackend
    from edgekv.backends.reference import ReferenceBackend
    from edgekv.kvcache import KVCache

    rng = np.random.default_rng(5)
    shape = dict(n_sink=4, windows=[0, 64, 64], kind=kind)
    window = KVCache([64, 64, 64], HKV, HD, **shape)
    caches = [KVCache([64, 64, 64], HKV, HD, evict="ema", **shape) for _ in range(2)]
    assert [lk.sizes for lk in caches[0].layers] == [(64, 64, 96), (64, 64, 48), (64, 64, 48)]
    assert [lk.sizes for lk in KVCache([96, 64, 64], HKV, HD, evict="ema", **shape).layers] == [(96, 96, 112), (64, 96, 56), (64, 96, 56)]
    assert [lk.sizes for lk in KVCache([128, 64, 64], HKV, HD, evict="ema", **shape).layers] == [(), (), ()]
    assert all(lk.evictor is not None for lk in caches[0].layers) and caches[0].batch_limit == (48 - 32) // 2
    bes = [CPUBackend(), ReferenceBackend()]
    for c in caches:
        c.protect([70, 71])
    p = 0
    for n in [8] * 5 + [1] * 50 + [6, 5] + [1] * 60:
        q, k, v = _qkv(rng, n)
        qp = np.arange(p, p + n, dtype=np.int64)
        outs = [[be.attention(q, qp, lk, k, v, SCALE, _rope()) for lk in c.layers] for be, c in zip(bes, caches)]
        w_out = [bes[0].attention(q, qp, lk, k, v, SCALE, _rope()) for lk in window.layers]
        p += n
        a, b = caches
        assert sum(lk.capacity for lk in a.layers) == 192
        for la, lb, oa, ob in zip(a.layers, b.layers, *outs):
            assert _kept(la) == _kept(lb), f"after position {p - 1}"
            np.testing.assert_allclose(la.evictor.score, lb.evictor.score, atol=1e-5, rtol=2e-3)
            np.testing.assert_allclose(oa, ob, atol=3e-3, rtol=3e-3)
        if p <= 64:
            assert [lk.capacity for lk in a.layers] == [64, 64, 64]
            for oa, ow in zip(outs[0], w_out):
                assert np.array_equal(oa, ow)
        else:
            assert [lk.capacity for lk in a.layers] == [96, 48, 48]
            if p <= 96:  # the global ring keeps everything until its borrowed slots are full too
                assert _kept(a[0]) == set(range(p))
            for lk in a.layers[1:]:
                kept = _kept(lk)
                assert len(kept) == 48 and set(range(p - 32, p)) <= kept
                assert all(m >= p or p - n - m >= 64 or m in kept for m in (70, 71))  # marked, while in the window
    kept = _kept(caches[0][0])
    assert len(kept) == 96 and set(range(4)) <= kept and set(range(p - 32, p)) <= kept
    caches[0].reset()
    assert [lk.capacity for lk in caches[0].layers] == [64, 64, 64] and caches[0].layers[1].evictor.plans is False


@pytest.mark.parametrize("kind", ["f16", "int4"])
def test_a_lent_cache_saves_forks_and_goes_on_as_it_would(kind):
    """After the lending: a fork and a cache loaded from the layers' states (LayerKV.state /
    load_state into a fresh cache, which takes the lent sizes) go on exactly as the original."""
    from edgekv.backends.cpu import CPUBackend
    from edgekv.kvcache import KVCache

    rng = np.random.default_rng(6)
    be = CPUBackend()
    make = lambda: KVCache([64, 64, 64], HKV, HD, n_sink=4, windows=[0, 64, 64], kind=kind, evict="tova")  # noqa: E731
    cache, p = make(), 0
    for n in [8] * 4 + [1] * 90:
        q, k, v = _qkv(rng, n)
        for lk in cache.layers:
            be.attention(q, np.arange(p, p + n, dtype=np.int64), lk, k, v, SCALE, _rope())
        p += n
    assert [lk.capacity for lk in cache.layers] == [96, 48, 48]
    back = make()
    for lk, lb in zip(cache.layers, back.layers):
        lb.load_state(*lk.state(), p)
    twin = cache.fork()
    _same_evictors(_evictors(cache), _evictors(back))
    for n in [1] * 30 + [5]:
        q, k, v = _qkv(rng, n)
        qp = np.arange(p, p + n, dtype=np.int64)
        outs = [[be.attention(q, qp, lk, k, v, SCALE, _rope()) for lk in c.layers] for c in (cache, back, twin)]
        p += n
        for x, y, z in zip(*outs):
            assert np.array_equal(x, y) and np.array_equal(x, z)
    for c in (back, twin):
        assert [_kept(lk) for lk in c.layers] == [_kept(lk) for lk in cache.layers]
        assert [lk.capacity for lk in c.layers] == [96, 48, 48]


def test_fused_decode_block_lends_as_the_op_by_op_path():
    """Gemma-3 with its sliding window cut to 64 (so 200 tokens pass the lending): the fused decode
    block keeps the same tokens as the op-by-op path in every layer, the same logits, the sliding
    rings 48 slots after the global ones (64) fill, the global ones 216, 144 and 72."""
    import dataclasses

    from edgekv.kvcache import KVCache

    _, model = open_model("gemma3", "cpu")  # shared by the tests (lru_cache): its config put back after
    P = llamacpp_fixture("gemma3")["prompts"]
    ids = sum((x["prompt_ids"] + x["continuation"] for x in P), [])[:200]
    saved, runs = model.cfg, []
    model.cfg = dataclasses.replace(saved, sliding_window=64)
    try:
        windows = model.cfg.windows()
        for fused in (True, False):
            cache = KVCache.for_model(model.cfg, 64, "int8", evict="ema")
            runs.append((decode_logits(model, ids, cache, fused, 20), cache))
    finally:
        model.cfg = saved
    (fused, fc), (plain, pc) = runs
    assert [lk.capacity for lk in fc.layers if not lk.window] == [216, 144, 72]  # 3 x 64 + 15 x 16, split 1.5 : 1 : 0.5
    assert all(lk.capacity == 48 for lk in fc.layers if lk.window) and [lk.window for lk in fc.layers] == windows
    for a, b in zip(fc.layers, pc.layers):
        assert _kept(a) == _kept(b) and a.capacity == b.capacity
    rel = np.linalg.norm(fused - plain, axis=-1) / np.linalg.norm(plain, axis=-1)
    assert rel.max() < 1e-3, rel.max()
