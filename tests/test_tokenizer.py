"""Tokenizer tests: exact llama.cpp ids and detokenized bytes on a mixed corpus (fixtures recorded
by tests/fixtures/record_tokens.py), streaming decode, and tiny hand-built vocabularies."""
import base64
import functools
import json
import random
from pathlib import Path

import pytest

from conftest import model_path
from edgekv.errors import EdgekvError, ModelFileError, UnsupportedModelError
from edgekv.gguf_file import read_metadata
from edgekv.tokenizer import ATTR_NORMAL, PRE_TOKENIZERS, Tokenizer, _clean_spaces

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = json.loads((FIXTURES / "tokenizer_corpus.json").read_text(encoding="utf-8"))
# Every recorded fixture; each must exist (a missing one fails, it is not skipped).
FIXTURE_NAMES = [
    "smollm2", "gemma3", "gemma3_space-prefix",
    "smollm2_pre-default", "smollm2_pre-gpt-2", "smollm2_pre-starcoder",
    "smollm2_pre-llama-bpe", "smollm2_pre-qwen2", "smollm2_pre-deepseek-r1-qwen",
]


@functools.lru_cache(maxsize=None)
def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"tokens_{name}.json").read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=None)
def base_meta(key: str) -> dict:
    return read_metadata(model_path(key))


@functools.lru_cache(maxsize=None)
def tokenizer(name: str) -> Tokenizer:
    fx = fixture(name)
    key = name.split("_")[0]  # "smollm2" or "gemma3", the conftest's model keys
    assert model_path(key).name == fx["base_model_file"], "fixtures were recorded from another model file"
    meta = dict(base_meta(key))
    meta.update(fx["overrides"])  # variants: the real model's metadata with one key changed
    return Tokenizer.from_metadata(meta)


def encode_like(tok: Tokenizer, text: str, add_special: bool, parse_special: bool) -> list[int]:
    # llama_tokenize(add_special=True) is the model default, i.e. add_bos=None here.
    return tok.encode(text, add_bos=None if add_special else False, special=parse_special)


# ---------------------------------------------------------------- llama.cpp fixtures


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_vocab_header_matches_llamacpp(name):
    tok, fx = tokenizer(name), fixture(name)
    assert tok.n_vocab == fx["n_vocab"]
    assert (tok.bos_id, tok.eos_id) == (fx["bos_id"], fx["eos_id"])
    assert (tok.add_bos, tok.add_eos) == (fx["add_bos"], fx["add_eos"])
    assert sorted(tok.eot_ids) == fx["eog_ids"]
    attrs = {}
    for i in range(tok.n_vocab):
        if tok._attrs[i] != ATTR_NORMAL:
            attrs.setdefault(str(tok._attrs[i]), []).append(i)
    assert attrs == fx["non_normal_attrs"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_encode_matches_llamacpp(name):
    tok, fx = tokenizer(name), fixture(name)
    bad = []
    for c in fx["cases"]:
        ids = encode_like(tok, CORPUS[c["item"]], c["add_special"], c["parse_special"])
        if ids != c["ids"]:
            bad.append((c["item"], c["add_special"], c["parse_special"], ids[:12], c["ids"][:12]))
    assert not bad, f"{len(bad)}/{len(fx['cases'])} cases differ, first: {bad[:3]}"
    assert len({c["item"] for c in fx["cases"]}) == len(CORPUS)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_decode_matches_llamacpp(name):
    tok, fx = tokenizer(name), fixture(name)
    bad = []
    for c in fx["cases"]:
        for special, key in ((True, "detok_special"), (False, "detok_plain")):
            want = base64.b64decode(c[key])
            got = tok.decode_bytes(c["ids"], special=special)
            if got != want:
                bad.append((c["item"], special, got[:40], want[:40]))
            assert tok.decode(c["ids"], special=special) == want.decode("utf-8", "replace")
    assert not bad, f"{len(bad)} detokenizations differ, first: {bad[:3]}"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_token_pieces_match_llamacpp(name):
    tok, fx = tokenizer(name), fixture(name)
    for tid, (with_special, plain) in fx["pieces"].items():
        assert tok.token_bytes(int(tid)) == base64.b64decode(with_special), tid
        assert tok._render(int(tid), special=False) == base64.b64decode(plain), tid


def test_corpus_round_trips_through_decode():
    """Plain text (no special strings) survives encode -> decode unchanged for both real models."""
    for name in ("smollm2", "gemma3"):
        tok = tokenizer(name)
        for text in CORPUS:
            if "<" in text:  # special-token strings decode to their text only with special=True
                continue
            assert tok.decode(tok.encode(text, add_bos=False), special=False) == text, (name, text[:40])


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_stream_concatenates_to_decode(name):
    tok, fx = tokenizer(name), fixture(name)
    held_back = 0
    for c in fx["cases"]:
        for special in (True, False):
            dec = tok.stream(special=special)
            parts = []
            for t in c["ids"]:
                s = dec.push(t)
                s.encode("utf-8")  # strict: raises on a lone surrogate
                if not _is_utf8(tok._render(t, special)):
                    held_back += 1
                parts.append(s)
            parts.append(dec.flush())
            full = tok.decode(c["ids"], special=special)
            assert "".join(parts) == full, (c["item"], special)
            if "\ufffd" not in full:
                assert not any("\ufffd" in p for p in parts), (c["item"], special)
    assert held_back > 0  # the corpus (emoji, CJK) must split characters across tokens


def test_stream_holds_back_split_emoji_bytes():
    tok = tokenizer("smollm2")
    text = "👨‍👩‍👧‍👦 中文"
    ids = tok.encode(text, add_bos=False)
    assert any(not _is_utf8(tok.token_bytes(t)) for t in ids)  # byte-level BPE splits the emoji
    dec = tok.stream()
    outs = [dec.push(t) for t in ids] + [dec.flush()]
    assert "".join(outs) == text
    assert all("\ufffd" not in o for o in outs)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_clean_spaces_stream_equals_batch():
    """The streaming clean-up passes give the batch result for any chunking of the bytes."""
    tok = tokenizer("smollm2_pre-gpt-2")
    assert tok._clean
    rng = random.Random(1234)
    alphabet = b" '?!.,smrevtdlx"
    for _ in range(2000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        dec = tok.stream()
        out = b""
        pos = 0
        while pos < len(data):
            k = rng.randint(1, 4)
            chunk = data[pos:pos + k]
            pos += k
            for stage in dec._passes:
                chunk = stage.feed(chunk)
            out += chunk
        tail = b""
        for stage in dec._passes:
            tail = stage.feed(tail) + stage.flush()
        assert out + tail == _clean_spaces(data), data


# ---------------------------------------------------------------- API behaviour on the real models


def test_add_bos_and_special_switches():
    smol, gemma = tokenizer("smollm2"), tokenizer("gemma3")
    assert smol.encode("hi")[:1] != [smol.bos_id]  # SmolLM2 adds no BOS by default
    assert smol.encode("hi", add_bos=True)[0] == smol.bos_id
    assert gemma.encode("hi")[0] == gemma.bos_id
    assert gemma.bos_id not in gemma.encode("hi", add_bos=False)
    chat = "<|im_start|>user\nhi<|im_end|>"
    im_start = smol.encode("<|im_start|>", add_bos=False)
    assert im_start == [1] and smol.token_text(1) == "<|im_start|>"
    assert 1 not in smol.encode(chat, add_bos=False, special=False)
    assert smol.decode(smol.encode(chat, add_bos=False)) == chat
    assert smol.decode(smol.encode(chat, add_bos=False), special=False) == "user\nhi"
    assert smol.token_text(smol.eos_id) == "<|im_end|>" and smol.eos_id in smol.eot_ids
    assert gemma.encode("<end_of_turn>", add_bos=False)[0] in gemma.eot_ids


def test_bad_token_id_raises():
    tok = tokenizer("smollm2")
    with pytest.raises(EdgekvError):
        tok.decode([tok.n_vocab])
    with pytest.raises(EdgekvError):
        tok.token_bytes(-1)


# ---------------------------------------------------------------- tiny hand-built vocabularies


def bpe_meta(tokens, merges, pre="gpt-2"):
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * len(tokens), "tokenizer.ggml.merges": merges}


def test_bpe_merges_follow_rank_order():
    # 'a', 'b', 'c' are their own GPT-2 byte chars. "abc" starts as a|b|c with candidate pairs
    # (a,b) and (b,c); the lower-ranked merge is applied first, and nothing merges afterwards
    # because neither (ab,c) nor (a,bc) is a merge.
    tokens = ["a", "b", "c", "ab", "bc"]
    first_ab = Tokenizer.from_metadata(bpe_meta(tokens, ["a b", "b c"]))
    first_bc = Tokenizer.from_metadata(bpe_meta(tokens, ["b c", "a b"]))
    assert first_ab.encode("abc") == [3, 2]  # ab, c
    assert first_bc.encode("abc") == [0, 4]  # a, bc
    # With (a,bc) as a third merge, b|c merges first and then a|bc gives the whole word.
    whole = Tokenizer.from_metadata(bpe_meta(tokens + ["abc"], ["b c", "a b", "a bc"]))
    assert whole.encode("abc") == [5]
    # Equal pairs merge leftmost first: a|a|a -> aa|a, never a|aa.
    aa = Tokenizer.from_metadata(bpe_meta(["a", "aa"], ["a a"]))
    assert aa.encode("aaa") == [1, 0]
    assert aa.decode([1, 0]) == "aaa"


def spm_meta(extra, add_space_prefix=True):
    # ids 0..2 control, 3..258 the byte tokens <0x00>..<0xFF>, then the given (text, score) pairs
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in extra]
    scores = [0.0] * 259 + [s for _, s in extra]
    types = [2, 3, 3] + [6] * 256 + [1] * len(extra)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": add_space_prefix}


def test_spm_byte_fallback_and_scores():
    tok = Tokenizer.from_metadata(spm_meta([("▁", -1.0), ("a", -2.0), ("▁a", -0.5), ("aa", -3.0)]))
    a, space_a, aa = 260, 261, 262
    # "a€": add_space_prefix makes it "▁a€"; ▁a (score -0.5) forms, € has no token and falls back
    # to its three UTF-8 bytes E2 82 AC, i.e. byte tokens 3 + 0xE2, 3 + 0x82, 3 + 0xAC.
    ids = tok.encode("a€")
    assert ids == [1, space_a, 3 + 0xE2, 3 + 0x82, 3 + 0xAC]
    # Decoding strips the prefixed space from the first token only, as llama_detokenize does:
    # without BOS that is ▁a; with BOS first (rendered empty when special=False) the space stays.
    assert tok.decode(ids[1:], special=False) == "a€"
    assert tok.decode(ids, special=False) == " a€"
    # Streaming the byte tokens one at a time yields nothing until the character is complete.
    dec = tok.stream(special=False)
    assert [dec.push(t) for t in ids] == ["", " a", "", "", "€"]
    assert dec.flush() == ""
    # An incomplete character at the end comes out of flush() as U+FFFD, as decode() renders it.
    dec = tok.stream()
    assert dec.push(3 + 0xE2) == "" and dec.push(3 + 0x82) == ""
    assert dec.flush() == "\ufffd" == tok.decode([3 + 0xE2, 3 + 0x82])
    # "▁aa": candidate pairs ▁a (-0.5) and aa (-3.0); the higher score wins: ▁a|a.
    assert tok.encode("aa", add_bos=False) == [space_a, a]


def test_spm_equal_scores_merge_leftmost():
    tok = Tokenizer.from_metadata(spm_meta([("a", -2.0), ("aa", -1.0)], add_space_prefix=False))
    assert tok.encode("aaa", add_bos=False) == [260, 259]  # aa, a


def test_special_tokens_split_longest_first():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["x", "<a>", "<a><b>", "<b>"]
    meta = spm_meta([], add_space_prefix=False)
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.scores"] = [0.0] * len(tokens)
    meta["tokenizer.ggml.token_type"] = [2, 3, 3] + [6] * 256 + [1, 3, 3, 4]
    tok = Tokenizer.from_metadata(meta)
    x, a, ab, b = 259, 260, 261, 262
    # "<a><b>" (control) is longer than "<a>", so it is cut out first.
    assert tok.encode("x<a><b>x<a>", add_bos=False) == [x, ab, x, a]
    # special=False: control tokens stay text (here: byte fallback), user-defined "<b>" still splits.
    plain = tok.encode("<a><b>", add_bos=False, special=False)
    assert plain[-1] == b and ab not in plain and a not in plain


def test_unsupported_and_malformed_metadata():
    with pytest.raises(UnsupportedModelError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelFileError):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelFileError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(UnsupportedModelError, match="'no-such-pre'"):
        Tokenizer.from_metadata(bpe_meta(["a", "b", "ab"], ["a b"], pre="no-such-pre"))


def test_missing_pre_tokenizer_is_default_with_a_warning():
    meta = bpe_meta(["a", "b", "ab", "1", "2", "3", "12", "123"], ["a b", "1 2", "12 3"])
    del meta["tokenizer.ggml.pre"]
    with pytest.warns(UserWarning, match="no tokenizer.ggml.pre"):
        tok = Tokenizer.from_metadata(meta)
    assert tok._pre == PRE_TOKENIZERS["default"] and tok.encode("ab123") == [2, 7]


# ---------------------------------------------------------------- every pre-tokenizer name llama.cpp knows

PRE_SPLITS = json.loads((FIXTURES / "pre_splits.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(PRE_SPLITS["names"]))
def test_pre_tokenizer_splits_like_llamacpp(name):
    """Each name edgekv accepts splits the corpus as llama.cpp's unicode_regex_split does, with
    llama.cpp's options for that name; every other name is refused with one error naming it."""
    want = PRE_SPLITS["names"][name]
    meta = bpe_meta(["a", "b", "ab"], ["a b"], pre=name)
    if name not in PRE_TOKENIZERS:
        with pytest.raises(UnsupportedModelError, match=repr(name)):
            Tokenizer.from_metadata(meta)
        return
    assert want["splits"] is not None and not want["other"], f"{name} needs options edgekv does not model"
    tok = Tokenizer.from_metadata(meta)
    pre = PRE_TOKENIZERS[name]
    assert (pre.clean_spaces, pre.ignore_merges, pre.add_bos) == (
        want["clean_spaces"], want["ignore_merges"], want["add_bos"])
    bad = [text for text, lengths in zip(PRE_SPLITS["texts"], PRE_SPLITS["splits"][want["splits"]])
           if [len(piece) for piece in tok._pretokenize(text)] != lengths]
    assert not bad, f"{len(bad)}/{len(PRE_SPLITS['texts'])} texts split differently, first: {bad[0][:60]!r}"


def test_accepted_pre_tokenizer_names_are_llamacpp_names():
    assert set(PRE_TOKENIZERS) - set(PRE_SPLITS["names"]) == {"gpt2"}  # edgekv's alias of "gpt-2"


def test_lone_surrogate_reads_as_replacement_char():
    tok = tokenizer("smollm2")
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")
