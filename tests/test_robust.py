"""Bad input and runtime faults, each with its defined behaviour (see LLM.generate's docstring):
prompts and generations longer than the context, empty prompts, invalid UTF-8, lone
surrogates and control characters in every entry point, cancellation mid-prefill, damaged
session files and failing saves, KV figures in the stats, and several threads sharing one model."""
import json
import os
import struct
import threading
import time

import numpy as np
import pytest

from conftest import get_llm, model_path
from edgekv import ChatSession, EdgekvError, SessionFileError, TemplateError
from edgekv.generate import Sequence

PROMPT = "The capital of France is"
CONTROL = "tab\there\x00nul \x1b[31mred\x1b[0m bell\x07 cr\r del\x7f end"


# -- context --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from edgekv.synth import write_synthetic

    d = tmp_path_factory.mktemp("tiny")
    return {a: write_synthetic(d / f"{a}.gguf", arch=a, size="tiny", qtype="q8_0", progress=False)
            for a in ("llama", "gemma3")}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("device, tol", [("reference", 1e-2), ("cpu", 5e-2)])
def test_prompt_longer_than_context_keeps_sinks_and_recent_tokens(tiny_models, arch, device, tol):
    """A prompt of ~4x n_ctx in one call must give what the ring gives token by token: every
    query sees the 4 sink tokens plus the most recent ones (a wrapping batch used to lose the
    sinks, a logit difference of ~80% of their scale)."""
    from edgekv import LLM

    llm = LLM(tiny_models[arch], n_ctx=16, device=device)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, llm.cfg.n_vocab, 60)]
    batch = Sequence(llm)
    lb = batch.feed(ids)
    step = Sequence(llm)
    for i in ids:
        ls = step.feed([i])
    assert np.abs(lb - ls).max() <= tol * np.abs(ls).max()
    assert batch.tokens == ids and all(lk.n_written == len(ids) for lk in batch.cache.layers)
    assert all(set(lk.pos[: lk.n_sink]) == set(range(lk.n_sink)) for lk in batch.cache.layers)  # sinks kept


def test_long_prompt_generates_and_the_cache_stays_bounded():
    llm = get_llm("smollm2", n_ctx=64)
    text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
    ids = llm.tokenize(text)
    assert len(ids) > 3 * llm.n_ctx
    events = list(llm.generate(text, max_tokens=6, temperature=0))
    st = llm.stats
    assert events[-1].finish_reason in ("length", "stop") and st.prompt_tokens == len(ids)
    assert st.kv_tokens == llm.n_ctx and st.kv_bytes == llm.new_cache().nbytes == st.kv_bytes_used


def test_generation_runs_through_the_ring_until_max_tokens():
    llm = get_llm("smollm2", n_ctx=64)
    ban = {t: float("-inf") for t in llm.tokenizer.eot_ids}  # no EOS: only max_tokens may end it
    events = list(llm.generate(PROMPT, max_tokens=150, temperature=0, logit_bias=ban))
    assert events[-1].finish_reason == "length" and llm.stats.generated_tokens == 150
    assert len(llm.tokenize(PROMPT)) + 150 > 2 * llm.n_ctx
    assert llm.stats.kv_tokens == llm.stats.kv_capacity == 64


def test_session_far_longer_than_the_context_keeps_going():
    llm = get_llm("smollm2", n_ctx=64)
    s = llm.session(temperature=0, max_tokens=24)
    for i in range(6):
        s.send(f"Question {i}: name an animal and a colour.")
    assert s.n_cached > 2 * llm.n_ctx and len(s.history) == 12
    assert s.stats.kv_tokens == 64 and s.stats.prefill_tokens < s.stats.prompt_tokens


def test_logits_still_refuses_more_than_the_context():
    from edgekv import ContextError

    llm = get_llm("smollm2", n_ctx=64)
    with pytest.raises(ContextError):
        llm.logits(list(range(65)))


# -- empty, non-text and odd input ----------------------------------------------------------
def test_empty_prompts():
    llm = get_llm()  # SmolLM2 adds no BOS: "" is no tokens at all
    assert llm.tokenize("") == []
    for prompt in ("", []):
        with pytest.raises(EdgekvError, match="empty prompt"):
            llm.complete(prompt, max_tokens=4)
    with pytest.raises(TemplateError):
        llm.chat([], max_tokens=4)
    r = llm.chat([{"role": "user", "content": ""}], max_tokens=4, temperature=0)  # an empty turn is a turn
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    s = llm.session(temperature=0, max_tokens=4)
    s.send("")
    assert s.history[0] == {"role": "user", "content": ""} and len(s.history) == 2


def test_empty_prompt_continues_from_bos_when_the_model_adds_one():
    llm = get_llm("gemma3", n_ctx=64)
    assert llm.tokenize("") == [llm.tokenizer.bos_id]
    events = list(llm.generate("", max_tokens=3, temperature=0))
    assert llm.stats.prompt_tokens == 1 and events[-1].finish_reason in ("stop", "length")


def test_prompts_that_are_not_text_or_ids():
    llm = get_llm()
    for bad in (3.5, ["a", "b"], [None], object()):
        with pytest.raises(EdgekvError):
            llm.complete(bad, max_tokens=2)
    with pytest.raises(EdgekvError):
        llm.complete([llm.cfg.n_vocab], max_tokens=2)
    with pytest.raises(EdgekvError):
        llm.session().send(42)


def test_invalid_utf8_bytes_become_replacement_characters():
    llm = get_llm()
    raw = b"caf\xe9 \xff\xfe na\xc3\xafve \xe2\x82"  # latin-1 byte, invalid bytes, a truncated sequence
    as_text = raw.decode("utf-8", errors="replace")
    assert "\ufffd" in as_text and "naïve" in as_text
    assert llm.complete(raw, max_tokens=6) == llm.complete(as_text, max_tokens=6)
    a, b = llm.session(temperature=0, max_tokens=6), llm.session(temperature=0, max_tokens=6)
    assert a.send(raw) == b.send(as_text) and a.history == b.history


def test_lone_surrogates_become_replacement_characters(tmp_path):
    llm = get_llm()
    bad = "half a pair \ud83d and a low one \udc00."
    fixed = bad.replace("\ud83d", "\ufffd").replace("\udc00", "\ufffd")
    assert llm.tokenize(bad) == llm.tokenize(fixed)
    assert llm.complete(bad, max_tokens=6) == llm.complete(fixed, max_tokens=6)
    msgs = [{"role": "user", "content": bad}]
    assert llm.chat(msgs, max_tokens=6, temperature=0)["choices"][0]["message"]["content"] == \
        llm.chat([{"role": "user", "content": fixed}], max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
    s = llm.session(temperature=0, max_tokens=6)
    s.send(bad)
    s.save(tmp_path / "s.ekv")  # the history keeps the caller's string; the file must hold it
    r = ChatSession.load(tmp_path / "s.ekv", llm)
    assert r.history == s.history
    assert r.send("Thanks.") == s.send("Thanks.")


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_control_characters_are_ordinary_text(key):
    llm = get_llm(key, n_ctx=64)
    ids = llm.tokenize(CONTROL, add_bos=False, special=False)
    assert llm.detokenize(ids) == CONTROL  # every byte has a token: nothing lost or altered
    events = list(llm.generate(CONTROL, max_tokens=3, temperature=0))
    assert events[-1].finish_reason in ("stop", "length")
    assert llm.chat([{"role": "user", "content": CONTROL}], max_tokens=3, temperature=0)["object"] == "chat.completion"
    s = llm.session(temperature=0, max_tokens=3)
    s.send(CONTROL)
    assert s.history[0]["content"] == CONTROL


# -- cancellation -----------------------------------------------------------------------------
def test_cancel_before_start_and_during_prefill_leaves_the_session_usable():
    llm = get_llm()
    stop = threading.Event()
    stop.set()
    events = list(llm.generate(PROMPT, max_tokens=8, cancel=stop))
    assert [e.finish_reason for e in events] == ["cancelled"] and llm.stats.generated_tokens == 0

    llm.prompt_cache.clear()  # the chunks counted below start at token 0, not after another test's prefix
    s = llm.session(temperature=0, max_tokens=4)
    long_msg = "Summarize: " + " ".join(f"fact {i} is {i * 3}." for i in range(200))
    assert len(llm.tokenize(long_msg)) > 1100  # three prefill chunks of 512

    calls, forward = [], llm.forward

    def counting_forward(ids, cache, start_pos, **kw):  # the GUI's Stop pressed during chunk 1
        calls.append(len(ids))
        stop.set()
        return forward(ids, cache, start_pos, **kw)

    stop.clear()
    llm.forward = counting_forward
    try:
        events = list(s.send(long_msg, stream=True, cancel=stop))
    finally:
        del llm.forward
    assert calls == [512] and [e.finish_reason for e in events] == ["cancelled"]
    assert s.stats.prefill_tokens == 512 < s.stats.prompt_tokens and s.n_cached == 512
    assert [m["role"] for m in s.history] == ["user", "assistant"]
    s.regenerate()  # the same message again: the 512 cached tokens are reused
    assert s.stats.prefill_tokens == s.stats.prompt_tokens - 512
    assert s.history[-1]["role"] == "assistant" and len(s.history) == 2


# -- stats ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["f16", "int8"])
def test_stats_report_speed_and_kv_use(kv):
    llm = get_llm("smollm2", n_ctx=128, kv=kv)
    llm.prompt_cache.clear()  # a cold call: another test may have left PROMPT in the prompt cache
    ban = {t: float("-inf") for t in llm.tokenizer.eot_ids}
    list(llm.generate(PROMPT, max_tokens=10, temperature=0, logit_bias=ban))
    st, n_prompt = llm.stats, len(llm.tokenize(PROMPT))
    cache = llm.new_cache()
    assert st.prefill_tokens == st.prompt_tokens == n_prompt and st.generated_tokens == 10
    assert st.prefill_tps > 0 and st.decode_tps > 0
    # Every sampled token is fed (a session's next turn needs the whole reply cached).
    assert st.kv_tokens == n_prompt + 10 and st.kv_capacity == 128 and st.kv_bytes == cache.nbytes
    assert st.kv_bytes_used == cache.nbytes * (n_prompt + 10) // 128
    d = st.as_dict()
    assert d["kv_bytes"] == cache.nbytes and d["decode_tokens_per_s"] > 0 and json.dumps(d)


def test_cli_kv_and_stats_lines_show_bytes():
    from edgekv.cli import _kv_line

    llm = get_llm("smollm2", n_ctx=128)
    s = llm.session(temperature=0, max_tokens=4)
    s.send("Hi")
    line = _kv_line(s)
    assert f"{s.stats.kv_tokens}/128 tokens" in line and "MiB in use" in line
    assert f"{llm.new_cache().nbytes / 2**20:.2f} MiB" in line


# -- session files ------------------------------------------------------------------------------
def _saved(tmp_path, n_ctx=64):
    llm = get_llm("smollm2", n_ctx=n_ctx)
    s = llm.session(temperature=0, max_tokens=6)
    s.send("Hi, who are you?")
    path = tmp_path / "s.ekv"
    s.save(path)
    return llm, s, path


def _rewrite_header(path, out, change):
    data = path.read_bytes()
    n = struct.unpack_from("<Q", data, 8)[0]
    h = json.loads(data[16 : 16 + n])
    change(h)
    blob = json.dumps(h).encode()
    out.write_bytes(data[:8] + struct.pack("<Q", len(blob)) + blob + data[16 + n :])
    return out


def test_session_from_another_version_or_model_is_refused(tmp_path):
    llm, s, path = _saved(tmp_path)
    ok = _rewrite_header(path, tmp_path / "same.ekv", lambda h: None)
    assert ChatSession.load(ok, llm).history == s.history  # the rewriting itself is faithful
    cases = {
        "version": lambda h: h.update(version=h["version"] + 1),
        "another model": lambda h: h["model"].update(header_sha256="0" * 64),
        "is not an edgekv session": lambda h: h.update(format="something-else"),
        "kv=int8": lambda h: h.update(kv="int8"),
        "needs evict=tova; this model is loaded with evict=window": lambda h: h.update(evict="tova"),
    }
    for what, change in cases.items():
        with pytest.raises(SessionFileError, match=what):
            ChatSession.load(_rewrite_header(path, tmp_path / "x.ekv", change), llm)
    with pytest.raises(SessionFileError, match="another model"):
        ChatSession.load(path, get_llm("gemma3", n_ctx=64))


def test_damaged_session_files_give_one_clear_error(tmp_path):
    """Truncated at every region, and 200 random byte flips: each load either raises
    SessionFileError or (a flip in bytes nothing checks, e.g. a cached value) gives a session
    that still runs; never another exception."""
    llm, s, path = _saved(tmp_path)
    data = path.read_bytes()
    n_head = 16 + struct.unpack_from("<Q", data, 8)[0]
    bad = tmp_path / "bad.ekv"
    for cut in (0, 4, 8, 12, 16, n_head // 2, n_head, n_head + 10, (n_head + len(data)) // 2, len(data) - 1):
        bad.write_bytes(data[:cut])
        with pytest.raises(SessionFileError):
            ChatSession.load(bad, llm)
    with pytest.raises(SessionFileError):
        ChatSession.load(tmp_path, llm)  # a directory
    with pytest.raises(SessionFileError):
        ChatSession.load(tmp_path / "missing.ekv", llm)
    rng = np.random.default_rng(1)
    outcomes = {"error": 0, "loaded": 0}
    for _ in range(200):
        b = bytearray(data)
        # Half the flips hit the JSON header, where most of the meaning is.
        at = int(rng.integers(16, n_head)) if rng.random() < 0.5 else int(rng.integers(0, len(b)))
        b[at] ^= 1 << int(rng.integers(0, 8))
        bad.write_bytes(bytes(b))
        try:
            r = ChatSession.load(bad, llm)
        except SessionFileError as e:
            assert "\n" not in str(e)
            outcomes["error"] += 1
            continue
        outcomes["loaded"] += 1
        list(r.send("Ok.", stream=True, max_tokens=1))
    assert outcomes["error"] > 50
    assert len(s.history) == 2 and s.send("Still there?")  # the session in memory never changed


class _FailingFile:
    """A file object that writes `budget` bytes, then fails like a full disk (or raises `exc`)."""

    def __init__(self, f, budget, exc):
        self.f, self.budget, self.exc = f, budget, exc

    def write(self, b):
        b = memoryview(b).cast("B")
        if len(b) > self.budget:
            self.f.write(b[: self.budget])
            self.f.flush()
            raise self.exc
        self.budget -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return self.f.__exit__(*a)


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_save_failing_midway_keeps_the_previous_file(tmp_path, monkeypatch, exc):
    llm, s, path = _saved(tmp_path)
    before = path.read_bytes()
    s.send("Tell me more.")
    import edgekv.session as session_mod

    real_fdopen = os.fdopen
    monkeypatch.setattr(session_mod.os, "fdopen",
                        lambda fd, mode: _FailingFile(real_fdopen(fd, mode), len(before) // 2, exc))
    with pytest.raises(SessionFileError if isinstance(exc, OSError) else KeyboardInterrupt):
        s.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.ekv"]  # no temp file left behind
    assert ChatSession.load(path, llm).history == s.history[:2]
    s.save(path)  # the session is unharmed: the next save works
    assert ChatSession.load(path, llm).history == s.history


def test_save_to_an_unwritable_place_is_one_error(tmp_path):
    llm, s, path = _saved(tmp_path)
    with pytest.raises(SessionFileError, match="cannot save"):
        s.save(tmp_path / "no" / "such" / "dir" / "s.ekv")


# -- several threads, one model -------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc")
def test_threads_share_one_model():
    """Three chat sessions and one plain generate loop on ONE loaded model, in four threads, for
    a bounded time: every output equals the same work run alone (same seeds), resident memory
    stays flat after the first round, and every thread finishes (no deadlock)."""
    llm = get_llm("smollm2", n_ctx=256)
    turns = ["Tell me about cats.", "And dogs?", "Which is better?"]

    def chat(i):
        s = llm.session(system="You are brief.", temperature=0.8, seed=i, max_tokens=12)
        out = [s.send(t) for t in turns]
        s.reset()
        return out + [s.send(turns[0])]

    def plain(i):
        return [llm.complete(f"Story number {i}:", max_tokens=12, temperature=0.9, seed=i + j) for j in range(3)]

    jobs = {0: chat, 1: chat, 2: chat, 3: plain}
    expected = {i: f(i) for i, f in jobs.items()}
    assert len({tuple(v) for v in expected.values()}) == 4  # the seeds give different texts

    budget_s = float(os.environ.get("EDGEKV_THREAD_TEST_S", "30"))
    rss, errors, rounds = {}, [], {i: 0 for i in jobs}
    start = time.monotonic()

    def worker(i):
        try:
            while True:
                got = jobs[i](i)
                if got != expected[i]:
                    errors.append(f"thread {i} round {rounds[i]}: {got!r} != {expected[i]!r}")
                    return
                rounds[i] += 1
                if rounds[i] == 1:
                    rss.setdefault("first", _rss())
                if time.monotonic() - start > budget_s:
                    return
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=budget_s + 240)
    assert not any(t.is_alive() for t in threads), "a thread did not finish: deadlock or hang"
    assert not errors, errors
    assert min(rounds.values()) >= 2
    grown = _rss() - rss["first"]
    print(f"threads: rounds {rounds} in {time.monotonic() - start:.0f} s, RSS grew {grown / 2**20:.1f} MiB")
    assert grown < 64 * 2**20


def test_ctrl_c_on_a_wrapped_ring_keeps_the_cache():
    """Ctrl-C lands mid-step while the ring is full: a wrapped ring cannot roll back, so the
    step completes first and KeyboardInterrupt comes after it; the next turn still extends the
    cached conversation instead of prefilling it again."""
    import signal

    # Python's own Ctrl-C handler, as in a terminal (a run started in the background by a shell
    # without job control inherits SIGINT ignored, and then Python installs none)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_on_a_wrapped_ring(signal)
    finally:
        signal.signal(signal.SIGINT, before)


def _ctrl_c_on_a_wrapped_ring(signal):
    llm = get_llm("smollm2", n_ctx=64)
    s = llm.session(temperature=0, max_tokens=60)
    s.send("Summarize: " + " ".join(f"fact {i} is {i * 3}." for i in range(12)))
    assert s.n_cached > 64  # wrapped
    calls, forward = [], llm.forward

    def interrupted_forward(ids, cache, start_pos, **kw):
        calls.append(len(ids))
        if len(calls) == 5:  # a real SIGINT, delivered while this decode step runs
            os.kill(os.getpid(), signal.SIGINT)
        return forward(ids, cache, start_pos, **kw)

    llm.forward = interrupted_forward
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in s.send("Write a long story about a dragon.", stream=True):
                pass
    finally:
        del llm.forward
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    n_before = s.n_cached
    assert len(s.history) == 4 and s.history[-1]["role"] == "assistant" and s.history[-1]["content"]
    s.send("Thanks.")
    assert s.stats.prefill_tokens < 20 and s.n_cached > n_before  # extended, not prefilled again


def test_chat_output_cannot_drive_the_terminal():
    from edgekv.cli import printable

    assert printable("ok\tnext\nline") == "ok\tnext\nline"
    assert printable("\x1b[2J\x1b]0;title\x07\r\x00\x7f\x9b") == "^[[2J^[]0;title^G^M^@^?\\x9b"
    assert printable("é中🙂") == "é中🙂"


def test_worker_threads_run_with_the_llms_thread_count():
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one CPU: every thread count is 1")
    from edgekv import LLM

    llm = LLM(model_path("smollm2"), n_ctx=512, kv="f16", threads=2)  # explicit: used as given
    seen = {}

    def worker():
        numba.set_num_threads(1)  # a thread's own count differs
        list(llm.generate(PROMPT, max_tokens=2))
        seen["n"] = numba.get_num_threads()

    t = threading.Thread(target=worker)
    t.start()
    t.join(300)
    assert seen["n"] == llm.backend.threads


def test_threads_without_a_threadsafe_numba_layer_take_turns(tmp_path):
    """numba's workqueue layer (no OpenMP or TBB installed) aborts the whole process when two
    threads launch parallel kernels at once; edgekv's forward passes then take turns."""
    import subprocess
    import sys

    from conftest import model_path

    script = tmp_path / "threads.py"
    script.write_text(f"""
import threading, numba, edgekv
llm = edgekv.LLM({str(model_path("smollm2"))!r}, n_ctx=128)
out = {{}}
def work(i):
    out[i] = llm.complete("Once upon a time " * 20, max_tokens=6, temperature=0.8, seed=i)
ts = [threading.Thread(target=work, args=(i,)) for i in range(3)]
[t.start() for t in ts]
[t.join() for t in ts]
print(numba.threading_layer(), len(out))
""")
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["workqueue", "3"]
