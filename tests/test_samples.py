"""Parallel samples (issue 17): n completions of one prompt share its prefill (the cache forked,
KVCache.fork) and decode as one batch; each equals a solo `generate` with its seed."""
import numpy as np
import pytest

from edgekv import EdgekvError
from edgekv.kvcache import BatchCache
from test_batch import llm_for, solo

PROMPT = "Once upon a time"


def counting(llm, monkeypatch) -> list[tuple[int, int]]:
    """(rows, sequences) of every forward pass of llm's model from now on."""
    passes, inner = [], llm.model.forward

    def forward(ids, pos, cache, last_only=True):
        passes.append((len(ids), len(cache.caches) if isinstance(cache, BatchCache) else 1))
        return inner(ids, pos, cache, last_only=last_only)

    monkeypatch.setattr(llm.model, "forward", forward)
    return passes


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_samples_equal_solo_generate_with_their_seeds_through_a_wrapping_ring(kv, monkeypatch):
    llm = llm_for("smollm2", "cpu", kv, 16)
    n_prompt = len(llm.tokenize(PROMPT))
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=41)):
        seeds = [kw["seed"] + i if "seed" in kw else None for i in range(3)]  # sample i's seed: seed + i
        want = [solo(llm, PROMPT, max_tokens=18, **dict(kw, seed=s)) for s in seeds]
        passes = counting(llm, monkeypatch)
        got = llm.sample(PROMPT, n=3, max_tokens=18, **kw)
        monkeypatch.undo()
        assert [(c.text, c.tokens, c.finish_reason) for c in got] == want
        assert [p for p in passes if p[0] > 1 and p[1] == 1] == [(n_prompt, 1)]  # the prompt prefilled once
        assert max(p[1] for p in passes) == 3  # the samples decode as one batch
        assert all(c.stats.prompt_tokens + c.stats.generated_tokens > 16 for c in got if c.finish_reason == "length")
    assert len({tuple(c.tokens) for c in got}) > 1  # seeded samples differ from one another


def test_sample_arguments_and_a_fork_goes_on_apart():
    llm = llm_for("llama", "cpu", "int8", 32)
    with pytest.raises(EdgekvError, match="n must be"):
        llm.sample([1, 2], n=0)
    with pytest.raises(EdgekvError, match="seed"):
        llm.sample([1, 2], n=2, seed=-1)
    assert len(llm.sample([1, 2], n=1, max_tokens=3)) == 1
    # a fork's cache is its own: feeding one does not change what the other computes
    from edgekv.generate import Sequence

    a = Sequence(llm)
    a.feed([1, 5, 9])
    b = a.fork()
    assert b.tokens == a.tokens and b.cache is not a.cache
    want = a.fork().feed([7])
    a.feed([8])
    assert np.array_equal(b.feed([7]), want)


def test_generate_many_with_n_is_prompt_major_each_sample_its_solo_run():
    llm = llm_for("smollm2", "cpu", "int8", 64)
    prompts, seeds = [PROMPT, "The capital of France is"], [3, 10]
    got = llm.generate_many(prompts, n=2, max_tokens=8, temperature=0.9, seed=seeds)
    want = [solo(llm, p, max_tokens=8, temperature=0.9, seed=s + i) for p, s in zip(prompts, seeds) for i in range(2)]
    assert [(c.text, c.tokens, c.finish_reason) for c in got] == want


def test_streams_share_one_prefill_and_each_equals_generate(monkeypatch):
    """llm.streams: n event streams of one prompt, each read in a thread of its own (what the
    server does for OpenAI's n): one prefill, the streams' steps batched, each stream what
    generate gives with seed + i, its events and its stats' prompt figures."""
    import threading

    from edgekv.generate import Stats

    llm = llm_for("smollm2", "cpu", "int8", 64)
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=12)
    want = [[(e.text, e.token, e.finish_reason) for e in llm.generate(PROMPT, seed=7 + i, **kw)] for i in range(3)]
    stats = [Stats() for _ in range(3)]
    passes = counting(llm, monkeypatch)
    streams = llm.streams(PROMPT, 3, seed=7, stats=stats, **kw)
    got = [None] * 3

    def read(i):
        got[i] = [(e.text, e.token, e.finish_reason) for e in streams[i]]

    threads = [threading.Thread(target=read, args=(i,)) for i in (2, 0, 1)]  # any stream may come first
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    assert got == want
    n_prompt = len(llm.tokenize(PROMPT))
    assert [p for p in passes if p[0] > 1 and p[1] == 1] == [(n_prompt, 1)]  # the prompt prefilled once
    assert all(s.prompt_tokens == n_prompt and s.prefill_tokens == n_prompt for s in stats)
    with pytest.raises(EdgekvError, match="n must be"):
        llm.streams(PROMPT, 0)


def test_chat_with_n_gives_the_choices_of_seed_plus_i_streamed_or_not():
    llm = llm_for("smollm2", "cpu", "int8", 128)
    msgs = [{"role": "user", "content": "Name a color."}]
    kw = dict(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    solo = [llm.chat(msgs, seed=5 + i, **kw) for i in range(3)]
    got = llm.chat(msgs, n=3, seed=5, **kw)
    assert [c["message"]["content"] for c in got["choices"]] == [r["choices"][0]["message"]["content"] for r in solo]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert [c["finish_reason"] for c in got["choices"]] == [r["choices"][0]["finish_reason"] for r in solo]
    u = got["usage"]
    assert u["prompt_tokens"] == solo[0]["usage"]["prompt_tokens"]  # the prompt once, not n times
    assert u["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in solo)
    texts, reasons = ["", "", ""], [None] * 3
    for chunk in llm.chat(msgs, n=3, seed=5, stream=True, **kw):
        for c in chunk["choices"]:
            texts[c["index"]] += c["delta"].get("content", "")
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    assert texts == [c["message"]["content"] for c in got["choices"]]
    assert reasons == [c["finish_reason"] for c in got["choices"]]
    with pytest.raises(EdgekvError, match="n must be"):
        llm.chat(msgs, n=0)
