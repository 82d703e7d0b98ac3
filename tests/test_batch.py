"""Batched decode (issue 17): several sequences in one forward pass, each at its own position in
its own cache, give the same bits as each run alone (the reference here: solo `forward` and solo
`generate` on the same backend), through a wrapping ring, with every cache kind."""
import time
from functools import lru_cache

import numpy as np
import pytest

from conftest import model_path
from edgekv import LLM, EdgekvError
from edgekv.generate import Completion
from edgekv.kvcache import BatchCache

PROMPTS = ["The capital of France is", "Once upon a time", "1 2 3 4 5 6 7 8 9 10 11 12 13", "Hi"]


@lru_cache(maxsize=None)
def tiny(arch: str) -> str:
    """A synthetic tiny model (llama's weights peaked: its greedy text is not one repeated token)."""
    import tempfile
    from pathlib import Path

    from edgekv.synth import write_synthetic

    root = Path(tempfile.mkdtemp(prefix="edgekv-batch-"))
    return str(write_synthetic(root / f"{arch}.gguf", arch, "tiny", "q8_0", seed=3, progress=False,
                               peaked=arch == "llama"))


@lru_cache(maxsize=None)
def llm_for(model: str, device: str, kv: str, n_ctx: int) -> LLM:
    """Without the prompt cache: a call that restores another call's prefix continues as that
    call would have (edgekv.prompt_cache), not as a cold run; here each run must be cold."""
    path = model_path(model) if model == "smollm2" else tiny(model)
    return LLM(path, n_ctx=n_ctx, kv=kv, device=device, prompt_cache=False)


def decode(llm: LLM, steps: int, batched: bool) -> tuple[list[list[np.ndarray]], list]:
    """Greedy decode of PROMPTS, each prompt prefilled alone: per step every sequence's logits,
    from one forward_batch (batched) or from a forward per sequence (the reference); the caches."""
    ids = [llm.tokenize(p) for p in PROMPTS]
    caches = [llm.new_cache() for _ in ids]
    logits = [llm.forward(i, c, 0)[-1] for i, c in zip(ids, caches)]
    pos = [len(i) for i in ids]
    seen = []
    for _ in range(steps):
        seen.append(logits)
        toks = [int(np.argmax(lg)) for lg in logits]
        if batched:
            logits = llm.forward_batch([([t], c, p) for t, c, p in zip(toks, caches, pos)])
        else:
            logits = [llm.forward([t], c, p)[-1] for t, c, p in zip(toks, caches, pos)]
        pos = [p + 1 for p in pos]
    return seen, caches


@pytest.mark.parametrize("model,device,n_ctx,steps", [
    ("smollm2", "cpu", 24, 30), ("smollm2", "reference", 12, 14), ("llama", "cpu", 24, 40),
    ("llama", "reference", 24, 40), ("gemma3", "cpu", 24, 40), ("gemma3", "reference", 24, 40)])
@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_batched_decode_is_bit_identical_to_solo_through_a_wrapping_ring(model, device, n_ctx, steps, kv):
    # every ring wraps within the steps (prompts of 1 to 14 tokens, 4 sinks)
    llm = llm_for(model, device, kv, n_ctx)
    (solo, _), (batch, caches) = decode(llm, steps, False), decode(llm, steps, True)
    assert len(PROMPTS) <= llm.backend.batch_rows  # one pass per step, not one per sequence
    assert all(c[0].n_written > c[0].capacity for c in caches)  # every sequence's ring has wrapped
    for step, (a, b) in enumerate(zip(solo, batch)):
        for j, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), f"step {step}, sequence {j}: max |diff| {np.abs(x - y).max()}"


def test_one_forward_pass_per_step_reads_each_weight_once_for_the_batch(monkeypatch):
    llm = llm_for("llama", "cpu", "int8", 64)
    calls = []
    inner = llm.model.forward

    def forward(ids, pos, cache, last_only=True):
        calls.append(len(ids))
        return inner(ids, pos, cache, last_only=last_only)

    monkeypatch.setattr(llm.model, "forward", forward)
    caches = [llm.new_cache() for _ in range(4)]
    for j, c in enumerate(caches):
        llm.forward([1, 5 + j], c, 0)
    calls.clear()
    out = llm.forward_batch([([7], c, 2) for c in caches])
    assert calls == [4] and len(out) == 4 and out[0].shape == (llm.cfg.n_vocab,)


def test_more_sequences_than_the_small_batch_kernel_and_a_prefill_among_them():
    llm = llm_for("llama", "cpu", "int4", 32)
    n = llm.backend.batch_rows + 3  # two passes: each row stays on the per-row decode kernel
    prompts = [[1, 10 + j, 20 + j] for j in range(n)]
    solo_caches, caches = [llm.new_cache() for _ in prompts], [llm.new_cache() for _ in prompts]
    for p, a, b in zip(prompts, solo_caches, caches):
        llm.forward(p, a, 0)
        llm.forward(p, b, 0)
    # sequence 0 goes on with a 5-token chunk, the others with one token each
    parts = [[3, 4, 5, 6, 7]] + [[30 + j] for j in range(1, n)]
    want = [llm.forward(p, c, 3)[-1] for p, c in zip(parts, solo_caches)]
    got = llm.forward_batch([(p, c, 3) for p, c in zip(parts, caches)])
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_forward_batch_refuses_one_cache_twice_and_bad_ids():
    llm = llm_for("llama", "cpu", "f16", 32)
    c = llm.new_cache()
    with pytest.raises(EdgekvError, match="cache of its own"):
        llm.forward_batch([([1], c, 0), ([2], c, 0)])
    with pytest.raises(EdgekvError, match="out of range"):
        llm.forward_batch([([1], llm.new_cache(), 0), ([llm.cfg.n_vocab], llm.new_cache(), 0)])


def solo(llm: LLM, prompt, **kw) -> tuple[str, list[int], str]:
    events = list(llm.generate(prompt, **kw))
    return "".join(e.text for e in events), [e.token for e in events if e.token is not None], events[-1].finish_reason


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_generate_many_equals_generate_per_prompt_greedy_and_seeded(kv):
    llm = llm_for("smollm2", "cpu", kv, 40)  # the ring wraps within 40 tokens
    for kw in (dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=7)):
        got = llm.generate_many(PROMPTS, max_tokens=36, **kw)
        assert all(isinstance(c, Completion) for c in got) and len(got) == len(PROMPTS)
        for p, c in zip(PROMPTS, got):
            text, toks, reason = solo(llm, p, max_tokens=36, **kw)
            assert (c.text, c.tokens, c.finish_reason) == (text, toks, reason)
            assert c.stats.generated_tokens == len(toks) and c.stats.prompt_tokens == len(llm.tokenize(p))


def test_generate_many_sequences_drop_out_at_their_own_stop():
    llm = llm_for("smollm2", "cpu", "int8", 256)
    free = [solo(llm, p, max_tokens=16, temperature=0.0)[0] for p in PROMPTS]
    stop = [free[0].split()[2], free[2].split()[1]]  # words inside two of the greedy continuations
    seeds = [1, 2, 3, 4]
    got = llm.generate_many(PROMPTS, max_tokens=16, stop=stop, temperature=0.7, seed=seeds)
    for p, s, c in zip(PROMPTS, seeds, got):
        assert (c.text, c.tokens, c.finish_reason) == solo(llm, p, max_tokens=16, stop=stop, temperature=0.7, seed=s)
    greedy = llm.generate_many(PROMPTS, max_tokens=16, stop=stop, temperature=0.0)
    assert greedy[0].finish_reason == "stop" and greedy[1].finish_reason == "length"
    assert len(greedy[0].tokens) < len(greedy[1].tokens)


def test_generate_many_arguments():
    llm = llm_for("llama", "cpu", "f16", 32)
    assert llm.generate_many([]) == []
    with pytest.raises(EdgekvError, match="2 seeds for 3 prompts"):
        llm.generate_many([[1, 2], [1, 3], [1, 4]], seed=[1, 2])
    with pytest.raises(EdgekvError, match="empty prompt"):
        llm.generate_many([[1, 2], []])


@pytest.mark.parametrize("model", ["smollm2", "llama"])
def test_threads_on_one_llm_are_batched_and_each_gets_its_solo_text(model, monkeypatch):
    import threading

    llm = llm_for(model, "cpu", "int8", 48)
    kws = [dict(temperature=0.0), dict(temperature=0.8, seed=5), dict(temperature=0.0, stop=["."]),
           dict(temperature=1.0, top_p=0.9, seed=11)]
    want = [solo(llm, p, max_tokens=24 + 4 * j, **kw) for j, (p, kw) in enumerate(zip(PROMPTS, kws))]
    rows, inner = [], llm.model.forward

    def forward(ids, pos, cache, last_only=True):
        # sequences in the pass, and the thread that ran it
        rows.append((len(ids) if isinstance(cache, BatchCache) else 1, threading.current_thread().name))
        return inner(ids, pos, cache, last_only=last_only)

    monkeypatch.setattr(llm.model, "forward", forward)
    got, start = [None] * len(PROMPTS), threading.Barrier(len(PROMPTS))

    def work(j):
        start.wait()
        got[j] = solo(llm, PROMPTS[j], max_tokens=24 + 4 * j, **kws[j])

    threads = [threading.Thread(target=work, args=(j,)) for j in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want
    assert max(r for r, _ in rows) >= 3  # passes held several threads' sequences
    # those passes ran on the scheduler's one worker thread (one OpenMP pool), which ends with them
    assert {name for r, name in rows if r > 1} == {"edgekv-batcher"}
    deadline = time.monotonic() + 10
    while any(t.name == "edgekv-batcher" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "edgekv-batcher" for t in threading.enumerate())


def test_a_session_in_one_thread_and_generate_in_another():
    import threading

    llm = llm_for("llama", "cpu", "int8", 64)
    chat_alone = llm.session(temperature=0.7, seed=2, max_tokens=12)
    want_chat = [chat_alone.send(m) for m in ("hello there", "and more")]
    want_gen = solo(llm, PROMPTS[0], max_tokens=40, temperature=0.0)
    got = {}

    def chat():
        s = llm.session(temperature=0.7, seed=2, max_tokens=12)
        got["chat"] = [s.send(m) for m in ("hello there", "and more")]

    t = threading.Thread(target=chat)
    t.start()
    got["gen"] = solo(llm, PROMPTS[0], max_tokens=40, temperature=0.0)
    t.join(timeout=300)
    assert got == {"chat": want_chat, "gen": want_gen}


def test_ctrl_c_while_the_worker_runs_the_pass_leaves_every_sequence_whole(monkeypatch):
    # Ctrl-C lands in the main thread wherever it happens to be (often waiting for the worker's
    # pass that holds its token): the pass ends first, nothing of it is left behind, the other
    # thread's text is its solo text and the next generate is the solo one again
    import signal
    import threading

    llm = llm_for("llama", "cpu", "int8", 64)
    want_other = solo(llm, PROMPTS[1], max_tokens=150, temperature=0.0)
    want_main = solo(llm, PROMPTS[0], max_tokens=12, temperature=0.0)
    got, third, inner = {}, threading.Event(), llm.model.forward

    def forward(ids, pos, cache, last_only=True):  # the worker's batched passes take a while
        if isinstance(cache, BatchCache):
            time.sleep(0.02)
        return inner(ids, pos, cache, last_only=last_only)

    monkeypatch.setattr(llm.model, "forward", forward)

    def other():
        got["other"] = solo(llm, PROMPTS[1], max_tokens=150, temperature=0.0)

    # the signal goes only while the loop below runs (`gate`, `over`): none may reach a later test
    over, gate = threading.Event(), threading.Lock()

    def interrupt():
        third.wait(60)
        time.sleep(0.002)
        with gate:
            if not over.is_set():
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python's own handler: a process started in the background inherits SIGINT ignored (CI)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t, k = threading.Thread(target=other), threading.Thread(target=interrupt)
        t.start()
        k.start()
        with pytest.raises(KeyboardInterrupt):
            try:
                for i, _ in enumerate(llm.generate(PROMPTS[0], max_tokens=150, temperature=0.0)):
                    if i == 3:
                        third.set()
                    if i > 3:
                        time.sleep(0.001)  # the interrupt lands in this loop at the latest
            finally:
                with gate:
                    over.set()
        k.join()
        t.join(timeout=300)
    finally:
        signal.signal(signal.SIGINT, before)
    assert got["other"] == want_other
    assert solo(llm, PROMPTS[0], max_tokens=12, temperature=0.0) == want_main
    assert not llm.batcher._pending and not llm.batcher._done


@pytest.mark.parametrize("batched", [False, True])
def test_ctrl_c_in_a_decode_step_waits_for_its_token(monkeypatch, batched):
    # Ctrl-C in the middle of a decode step (here at its first fused call: the stack of all
    # blocks for one token, the first layer's block for a batch) is held until
    # the step's every layer has run, then raised: it never lands inside numba's dispatch of a
    # block (where it would surface as a TypeError), and the caches stay whole
    import signal

    llm = llm_for("llama", "cpu", "int8", 64)
    be, calls = llm.backend, []
    name = "decode_block" if batched else "decode_stack"  # one token alone: every block in one call
    inner = getattr(be.blk, name)

    def decode(pack, x, pos, layers, ats, threads=None):
        calls.append(len(layers))
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        return inner(pack, x, pos, layers, ats, threads)

    caches = [llm.new_cache() for _ in range(2)]
    for j, c in enumerate(caches):
        llm.forward([1, 4 + j, 9], c, 0)
    monkeypatch.setattr(be.blk, name, decode)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            if batched:
                llm.forward_batch([([20 + j], c, 3) for j, c in enumerate(caches)])
            else:
                llm.forward([20], caches[0], 3)
    finally:
        signal.signal(signal.SIGINT, before)
    assert len(calls) == (llm.cfg.n_layer if batched else 1)  # every layer, then the interrupt
    assert all(lk.n_written == 4 for c in caches[: 2 if batched else 1] for lk in c.layers)


def test_generate_many_cancelled_like_generate():
    import threading

    llm = llm_for("llama", "cpu", "int8", 64)
    stop = threading.Event()
    stop.set()
    got = llm.generate_many([[1, 2, 3], [4]], max_tokens=8, cancel=stop)
    assert [(c.text, c.tokens, c.finish_reason) for c in got] == [
        solo(llm, [1, 2, 3], max_tokens=8, cancel=stop), solo(llm, [4], max_tokens=8, cancel=stop)]
    assert {c.finish_reason for c in got} == {"cancelled"}


def test_a_batch_runs_through_the_fused_block_whatever_its_caches_kinds(monkeypatch):
    # one fused call a layer for the whole batch, cache kinds and eviction policies mixed (the
    # kernel takes every kind's arrays as one numba type); a batch whose cache arrays type
    # differently (here: said to) runs a fused call per sequence. The same bits as each sequence
    # alone, every way.
    llm = llm_for("llama", "cpu", "int8", 32)
    be = llm.backend
    sizes, inner = [], be.blk.decode_block

    def decode_block(pack, x, pos, layers, ats, threads=None):
        sizes.append(len(layers))
        return inner(pack, x, pos, layers, ats, threads)

    monkeypatch.setattr(be.blk, "decode_block", decode_block)
    mixed = [("int8", "window"), ("f16", "h2o"), ("int4", "window")]
    for specs, fused in (([("int8", "window")] * 3, True), (mixed, True), (mixed, False)):
        solo = [llm.new_cache(k, evict=e) for k, e in specs]
        batch = [llm.new_cache(k, evict=e) for k, e in specs]
        for j, (a, b) in enumerate(zip(solo, batch)):
            llm.forward([1, 4 + j, 9], a, 0)
            llm.forward([1, 4 + j, 9], b, 0)
        if not fused:
            for lk in batch[1].layers:
                state = be._layer(lk)
                lk.backend_state = (state[0], object(), state[2])  # another type than the others'
        for step in range(3):
            want = [llm.forward([20 + j + step], c, 3 + step)[-1] for j, c in enumerate(solo)]
            sizes.clear()
            got = llm.forward_batch([([20 + j + step], c, 3 + step) for j, c in enumerate(batch)])
            assert all(np.array_equal(a, b) for a, b in zip(want, got)), (specs, step)
            assert sizes == ([3] * llm.cfg.n_layer if fused else [1] * 3 * llm.cfg.n_layer), (specs, fused)


def test_a_batchs_list_of_caches_is_kept_remade_when_a_pack_changes_and_dropped_with_its_caches():
    # the CPU backend keeps each layer's typed list of a batch's cache packs from step to step
    # (CPUBackend._group); a member's new pack (a resize, a load) makes a new list, and a
    # collected member takes its lists (and the packs they hold) with it
    import gc

    llm = llm_for("llama", "cpu", "int8", 32)
    be = llm.backend
    solo = [llm.new_cache() for _ in range(2)]
    batch = [llm.new_cache() for _ in range(2)]
    for j in range(2):
        llm.forward([1, 4 + j, 9], solo[j], 0)
        llm.forward([1, 4 + j, 9], batch[j], 0)
    be._groups.clear()
    lists = []
    for step in range(3):
        if step == 2:
            batch[1].layers[0].backend_state = None  # as a resize leaves it: packed anew
        want = [llm.forward([20 + j + step], c, 3 + step)[-1] for j, c in enumerate(solo)]
        got = llm.forward_batch([([20 + j + step], c, 3 + step) for j, c in enumerate(batch)])
        assert all(np.array_equal(a, b) for a, b in zip(want, got)), step
        assert len(be._groups) == llm.cfg.n_layer
        lists.append([be._groups[tuple(map(id, lks))][1] for lks in zip(*(c.layers for c in batch))])
    assert all(a is b for a, b in zip(lists[0], lists[1]))  # the same caches: the same lists
    assert lists[2][0] is not lists[1][0] and all(a is b for a, b in zip(lists[1][1:], lists[2][1:]))
    del lists, got, batch[1]
    gc.collect()
    assert not be._groups
