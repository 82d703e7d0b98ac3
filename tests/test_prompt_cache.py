"""The prompt cache (edgekv/prompt_cache.py) on the real 135M model: a chat whose system prompt
is cached equals the same chat run cold, logit for logit (f16/int8/int4), from memory and from
disk; other prefixes continue exactly as the sequence that computed them would have; the
lookup, the budgets, the wrapped ring, bad files on disk, the atomic write, the opt-out and the
figures that show reuse."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import model_path

import edgekv.prompt_cache as pcm
from edgekv import LLM
from edgekv.generate import Sequence, generate
from edgekv.kvfile import write_file
from edgekv.prompt_cache import system_prefix

SYSTEM = ("You are a careful assistant for a small shop that sells bicycles, spare parts and repairs. "
          "Answer in one short sentence. Opening hours are nine to six on weekdays and ten to four on "
          "Saturdays; the shop is closed on Sundays. ")


@pytest.fixture(autouse=True)
def short_system_prompts(monkeypatch):
    """A system prompt of 32 tokens counts as long here (256 by default): short prefills, same rule."""
    monkeypatch.setattr(pcm, "MIN_TOKENS", 32)


def new_llm(kv="f16", tmp=None, n_ctx=512, **kw):
    llm = LLM(model_path("smollm2"), n_ctx=n_ctx, kv=kv, **kw)
    if llm.prompt_cache is not None and tmp is not None:
        llm.prompt_cache._directory = tmp
    return llm


class Recorder:
    """A greedy sampler that keeps every logits row it was given."""

    def __init__(self):
        self.rows = []

    def __call__(self, logits, history=()):
        self.rows.append(np.array(logits))
        return int(np.argmax(logits))


def chat_ids(llm, user, system=SYSTEM):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    ids = llm.chat_ids(llm.template.render(msgs, add_generation_prompt=True))
    return msgs, ids


def run_chat(llm, user, max_tokens=5, system=SYSTEM):
    """(logits rows, tokens, stats, system prefix) of a chat turn through generate, as llm.chat runs it."""
    from edgekv.generate import Stats

    msgs, ids = chat_ids(llm, user, system)
    keep = system_prefix(llm, msgs, ids)
    rec, st = Recorder(), Stats()
    events = list(generate(llm, Sequence(llm), ids, rec, max_tokens=max_tokens, stats=st, keep=keep))
    return rec.rows, [e.token for e in events if e.token is not None], st, keep


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_chat_with_a_cached_system_prompt_equals_a_cold_one(tmp_path, kv):
    cold = new_llm(kv, prompt_cache=False)
    ref_rows, ref_toks, _, keep = run_chat(cold, "When do you open on Saturday?")
    assert keep >= 32
    warm = new_llm(kv, tmp_path)
    first = run_chat(warm, "Do you repair tyres?")
    assert first[2].cached_tokens == 0 and first[3] == keep
    rows, toks, st, _ = run_chat(warm, "When do you open on Saturday?")
    assert (st.cached_tokens, st.cached_from, st.prefill_tokens) == (keep, "memory", st.prompt_tokens - keep)
    assert same(rows, ref_rows) and toks == ref_toks
    assert [p.suffix for p in tmp_path.iterdir()] == [".ekvp"]  # the system prompt, on disk
    again = new_llm(kv, tmp_path)  # another process, as far as the cache can tell
    rows, toks, st, _ = run_chat(again, "When do you open on Saturday?")
    assert (st.cached_tokens, st.cached_from) == (keep, "disk")
    assert same(rows, ref_rows) and toks == ref_toks
    # the public API: the same reply, and the reuse in usage
    r = again.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Saturday?"}],
                   max_tokens=5, temperature=0)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == keep
    assert r["choices"][0]["message"]["content"] == cold.detokenize(ref_toks)


@pytest.mark.parametrize("kv", ["f16", "int8", "int4"])
def test_other_prefixes_continue_as_the_sequence_that_computed_them(tmp_path, kv):
    """What a chat's next turn gets from Sequence.reuse: the cached tokens as they were computed
    (int calibration and exact rows included), then the rest; the same prompt again needs no
    prefill and equals the cold call."""
    warm = new_llm(kv, tmp_path)
    warm.prompt_cache.min_reuse = 1  # short prompts: take any shared prefix
    p1 = warm.tokenize("The history of the bicycle begins in the early nineteenth century, when")
    rec1 = Recorder()
    list(generate(warm, Sequence(warm), p1, rec1, max_tokens=4, remember=True))
    out1 = [int(np.argmax(r)) for r in rec1.rows]
    cold = new_llm(kv, prompt_cache=False)

    def reference(prompt, reply):  # a plain sequence fed as the first call fed it (reply too or not), continued
        seq, rec = Sequence(cold), Recorder()
        seq.feed(p1)
        for t in out1[:-1] if reply else ():
            seq.feed([t])
        list(generate(cold, seq, prompt, rec, max_tokens=4))
        return rec.rows

    zebra = warm.tokenize(" zebra", add_bos=False)
    assert zebra[0] != out1[0]
    for prompt, cached, reply in ((p1, len(p1), False), (p1 + zebra, len(p1), False),
                                  (p1[:-3] + zebra, len(p1) - 3, False), (p1 + out1[:2] + zebra, len(p1) + 2, True)):
        from edgekv.generate import Stats

        rec, st = Recorder(), Stats()
        list(generate(warm, Sequence(warm), prompt, rec, max_tokens=4, stats=st))
        assert (st.cached_tokens, st.cached_from) == (cached, "memory")
        if prompt == p1:
            assert st.prefill_tokens == 0 and same(rec.rows, rec1.rows)
        else:
            assert same(rec.rows, reference(prompt, reply))
    assert warm.complete(cold.detokenize(p1[1:]), max_tokens=4) == cold.complete(cold.detokenize(p1[1:]), max_tokens=4)


def test_longest_prefix_and_the_memory_budget(tmp_path):
    llm = new_llm("f16", tmp_path)
    pc = llm.prompt_cache
    pc.disk_bytes = 0
    base = llm.tokenize("one two three four five six seven eight nine ten")
    seqs = {}
    for name, ids in (("short", base[:4]), ("long", base), ("other", llm.tokenize("red green blue yellow"))):
        s = Sequence(llm)
        s.feed(ids)
        pc.remember(s)
        seqs[name] = ids
    size = max(e.nbytes for e in pc._mem.values())

    def restored(ids):
        s = Sequence(llm)
        n, src, _ = pc.restore(s, ids, 0)
        assert s.tokens == list(ids[:n]) and all(lk.n_written == n for lk in s.cache.layers)
        return n, src

    assert restored(base[:7] + [5]) == (0, "")  # fewer shared tokens than min_reuse (32): run cold
    pc.min_reuse = 1
    assert restored(base[:7] + [5]) == (7, "memory")  # the long entry, trimmed to what is shared
    assert restored(base[:3] + [5]) == (3, "memory")
    assert restored([99, 98]) == (0, "")  # nothing shared
    assert restored(base + [5]) == (len(base), "memory")
    # the budget: room for two entries; the least recently used goes
    pc.memory_bytes = 2 * size + 1
    s = Sequence(llm)
    s.feed(llm.tokenize("alpha beta gamma delta"))
    pc.remember(s)  # "short" and "long" were used since "other" was kept: "other" goes first
    assert tuple(seqs["other"]) not in pc._mem and {tuple(seqs["long"]), tuple(s.tokens)} <= set(pc._mem)
    assert pc.memory_used <= pc.memory_bytes
    pc.memory_bytes = pc._mem[tuple(s.tokens)].nbytes - 1  # an entry larger than the budget is not kept
    pc.clear()
    pc.remember(s)
    assert not pc._mem
    pc.disk_bytes = 1 << 30  # too big for memory, still written to disk (straight from the live cache)
    pc.remember(s, disk=True)
    entry = pc._find_on_disk(s.tokens, len(s.tokens), 0)
    assert not pc._mem and entry is not None and entry[0] == tuple(s.tokens)  # (tokens, metas, arrays)


def test_a_wrapped_ring_is_not_reused(tmp_path):
    llm = new_llm("int8", tmp_path, n_ctx=64)
    prompt = llm.tokenize("Count with me: " + " ".join(str(i) for i in range(40)))
    assert len(prompt) > 64
    a = llm.complete(prompt, max_tokens=4)
    assert not llm.prompt_cache._mem  # neither after the prompt nor after the call
    b = llm.complete(prompt, max_tokens=4)
    assert llm.stats.cached_tokens == 0 and a == b


def _entry(tmp_path):
    files = [p for p in tmp_path.iterdir() if p.suffix == ".ekvp"]
    assert len(files) == 1
    return files[0]


def _rewrite(path, header=lambda h: None, arrays=lambda a: None):
    """path's entry rewritten with a changed header or changed arrays (index and checksum
    recomputed, unless `arrays` returns False)."""
    from edgekv.errors import PromptCacheError
    from edgekv.kvfile import raw_body, read_file

    h, views, _ = read_file(path.read_bytes(), pcm.MAGIC, path.name, "prompt-cache", PromptCacheError, raw=True)
    a = {k: np.array(v) for k, v in views.items()}
    keep = arrays(a) is False
    index, parts = raw_body(a)
    if not keep:
        h["arrays"], h["arrays_sha256"] = index, pcm._checksum(index, parts)
    header(h)
    write_file(path, pcm.MAGIC, h, parts=parts)


def test_bad_files_on_disk_are_ignored_with_one_warning(tmp_path, recwarn):
    writer = new_llm("int4", tmp_path)
    ref = run_chat(new_llm("int4", prompt_cache=False), "Do you sell helmets?")
    run_chat(writer, "Do you repair tyres?")
    path = _entry(tmp_path)
    good = path.read_bytes()
    n_head = 16 + struct.unpack_from("<Q", good, 8)[0]
    flipped = bytearray(good)
    flipped[(n_head + len(good)) // 2] ^= 0x40  # inside the arrays
    damages = {
        "truncated": lambda: path.write_bytes(good[: len(good) // 2]),
        "truncated header": lambda: path.write_bytes(good[: n_head - 5]),
        "flipped": lambda: path.write_bytes(bytes(flipped)),
        "another model": lambda: _rewrite(path, header=lambda h: h["model"].update(header_sha256="0" * 64)),
        "another cache": lambda: _rewrite(path, header=lambda h: h.update(kv="int8")),
        "wrong shapes": lambda: _rewrite(path, arrays=lambda a: a.update(k=a["k"][:, :, :, :4])),
        "a layer short": lambda: _rewrite(path, arrays=lambda a: a.update(v=a["v"][1:])),
        "positions out of range": lambda: _rewrite(path, arrays=lambda a: a["pos"].__setitem__((2, 0), 10**6)),
        "not its tokens": lambda: _rewrite(path, header=lambda h: h["tokens"].__setitem__(-1, 7)),
        "an object array": lambda: _rewrite(path, header=lambda h: h["arrays"][0].__setitem__(1, "|O")),
        "an array past the end": lambda: _rewrite(path, header=lambda h: h["arrays"][-1].__setitem__(3, 10**12)),
        "a negative shape": lambda: _rewrite(path, header=lambda h: h["arrays"][1][2].__setitem__(0, -1)),  # v
        "no index": lambda: _rewrite(path, header=lambda h: h.pop("arrays")),
    }
    for what, damage in damages.items():
        path.write_bytes(good)
        damage()
        recwarn.clear()
        rows, toks, st, _ = run_chat(new_llm("int4", tmp_path), "Do you sell helmets?")  # a new process
        assert st.cached_tokens == 0 and same(rows, ref[0]), what  # cold: the bad entry was never used
        msgs = [str(w.message) for w in recwarn if "prompt cache" in str(w.message)]
        assert len(msgs) == 1 and "\n" not in msgs[0] and msgs[0].endswith("; not used"), (what, msgs)
        again = run_chat(new_llm("int4", tmp_path), "Do you sell helmets?")  # now good again
        assert again[2].cached_from == "disk" and same(again[0], ref[0]), what


def test_a_failed_write_leaves_no_entry(tmp_path, monkeypatch, recwarn):
    llm = new_llm("f16", tmp_path)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    rows, toks, st, keep = run_chat(llm, "Do you repair tyres?")
    assert keep and toks
    assert list(tmp_path.iterdir()) == []  # no entry, no temporary file
    msgs = [str(w.message) for w in recwarn if "prompt cache" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].startswith(f"prompt cache: cannot write {tmp_path}")
    assert msgs[0].endswith(": No space left on device")


def test_the_disk_cap_keeps_the_most_recently_used(tmp_path):
    llm = new_llm("int8", tmp_path)
    run_chat(llm, "hi")
    first = _entry(tmp_path)
    llm.prompt_cache.disk_bytes = first.stat().st_size * 3 // 2  # room for one entry
    run_chat(llm, "hi", system=SYSTEM.replace("bicycles", "scooters"))
    assert _entry(tmp_path) != first  # the older one was evicted


def test_the_opt_out(tmp_path, monkeypatch):
    monkeypatch.setattr(pcm, "default_dir", lambda: tmp_path)
    llm = new_llm("f16", prompt_cache=False)
    assert llm.prompt_cache is None
    for _ in range(2):
        rows, toks, st, keep = run_chat(llm, "Do you repair tyres?")
        assert keep and st.cached_tokens == 0 and st.prefill_tokens == st.prompt_tokens
    assert list(tmp_path.iterdir()) == []
    from edgekv.cli import _load_args, build_parser

    args = build_parser().parse_args(["run", "m", "x", "--no-prompt-cache", "--prompt-cache-size", "64M"])
    assert _load_args(args)["prompt_cache"] is False and _load_args(args)["prompt_cache_size"] == 64 * 2**20
    assert _load_args(build_parser().parse_args(["chat"]))["prompt_cache"] is True


def test_sessions_and_the_chat_show_reuse(tmp_path, capsys):
    from edgekv.cli import Chat

    llm = new_llm("int8", tmp_path)
    s1 = llm.session(system=SYSTEM, temperature=0, max_tokens=4)
    s1.send("Do you repair tyres?")
    assert s1.stats.cached_tokens == 0
    s2 = llm.session(system=SYSTEM, temperature=0, max_tokens=4)
    chat = Chat(llm, s2)
    chat.cold_tokens, chat.cold_tps = s1.stats.prefill_tokens, s1.stats.prefill_tps
    chat.step("When do you open?")
    keep = s2.stats.cached_tokens
    assert keep >= 32 and s2.stats.cached_from == "memory"
    chat.step("/stats")
    out = capsys.readouterr().out
    assert f"cached {keep} of {s2.stats.prompt_tokens} prompt tokens (from the prompt cache in memory)" in out
    assert "x a cold prefill" in out
    chat.step("And on Sunday?")
    assert s2.stats.cached_from == "sequence" and s2.stats.cached_tokens > keep


def test_a_new_process_reads_the_disk_cache(tmp_path):
    """Two real `edgekv run --system` processes on one EDGEKV_HOME: the second loads the prefix."""
    env = dict(os.environ, EDGEKV_HOME=str(tmp_path))
    long_system = SYSTEM * 6  # past the default 256-token threshold
    cmd = [sys.executable, "-m", "edgekv.cli", "run", str(model_path("smollm2")), "Do you repair tyres?",
           "--system", long_system, "-n", "3", "--json", "--kv", "f16", "--ctx", "1024", "-q"]
    runs = [json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
                       .stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["cached_tokens"] == 0 and runs[1]["cached_from"] == "disk"
    assert 256 <= runs[1]["cached_tokens"] < runs[1]["prompt_tokens"] and runs[0]["text"] == runs[1]["text"]
    assert len(list((tmp_path / "prompt-cache").iterdir())) == 1


def test_keep_out_of_range_is_one_error():
    from edgekv import EdgekvError

    llm = new_llm("f16", prompt_cache=False)
    ids = llm.tokenize("Hello there, how are you?")
    for keep in (-1, len(ids)):
        with pytest.raises(EdgekvError, match="keep must be in"):
            list(llm.generate(ids, max_tokens=1, keep=keep))
