"""llama.cpp's own tokenizer suite (tests/test-tokenizer-0): its vocab-only GGUF files with inputs
(`.inp`) and expected ids (`.out`), kept outside the project in ../shared/peer_vocab (CI has it
beside the checkout). Every case must give llama.cpp's ids exactly, with test-tokenizer-0's flags:
no BOS/EOS added, special-token strings not parsed. A file whose tokenizer model edgekv does not
run must be refused with UnsupportedModelError."""
import time
import warnings
from pathlib import Path

import pytest

from edgekv.errors import UnsupportedModelError
from edgekv.gguf_file import read_metadata
from edgekv.tokenizer import Tokenizer

CHECKOUT = Path(__file__).resolve().parents[1]
CANDIDATES = [CHECKOUT.parent / "shared" / "peer_vocab", CHECKOUT / "shared" / "peer_vocab"]
PEER = next((d for d in CANDIDATES if d.is_dir()), None)
VOCABS = sorted(PEER.glob("ggml-vocab-*.gguf")) if PEER else []
SUPPORTED_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values edgekv runs
SEP = "\n__ggml_vocab_test__\n"  # test-tokenizer-0's case separator in .inp files


def read_cases(vocab: Path) -> dict[str, list[int]]:
    """The cases as test-tokenizer-0's read_tests reads them: .inp split on SEP (a trailing SEP
    starts no case), .out one stripped line of space-separated ids per case, later duplicates win."""
    raw = vocab.with_name(vocab.name + ".inp").read_bytes().decode("utf-8")
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    lines = vocab.with_name(vocab.name + ".out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # getline yields no line after the final newline
    assert len(inputs) == len(lines), f"{vocab.name}: {len(inputs)} inputs but {len(lines)} expected id lines"
    return {s: [int(t) for t in line.split()] for s, line in zip(inputs, lines)}


def test_peer_vocab_folder_found():
    if PEER is None:
        where = " or ".join(str(d) for d in CANDIDATES)
        msg = f"llama.cpp's tokenizer suite not found ({where}): the peer-vocab tokenizer tests did not run"
        warnings.warn(msg)
        pytest.skip(msg)
    assert VOCABS, f"{PEER} holds no ggml-vocab-*.gguf files"


@pytest.mark.parametrize("vocab", VOCABS, ids=lambda p: p.name[len("ggml-vocab-"):-len(".gguf")])
def test_peer_vocab_matches_llamacpp(vocab):
    meta = read_metadata(vocab)
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model not in SUPPORTED_MODELS:
        with pytest.raises(UnsupportedModelError, match=repr(model)):
            Tokenizer.from_metadata(meta)
        print(f"{vocab.name}: tokenizer model {model!r} refused")
        return
    if model == "gpt2" and not pre:  # llama.cpp too uses "default" then, with a warning
        with pytest.warns(UserWarning, match="no tokenizer.ggml.pre"):
            tok = Tokenizer.from_metadata(meta)
    else:
        tok = Tokenizer.from_metadata(meta)
    if not vocab.with_name(vocab.name + ".inp").exists():
        assert tok.encode("Hello world", add_bos=False, special=False)  # no llama.cpp cases for this file
        print(f"{vocab.name}: model {model!r}, pre {pre!r}: loads (no cases)")
        return
    cases = read_cases(vocab)
    t0 = time.perf_counter()
    bad = [(text, got, want) for text, want in cases.items()
           if (got := tok.encode(text, add_bos=False, special=False)) != want]
    took = time.perf_counter() - t0
    print(f"{vocab.name}: model {model!r}, pre {pre!r}: {len(cases) - len(bad)}/{len(cases)} exact ({took:.2f} s)")
    assert not bad, f"{len(bad)}/{len(cases)} cases differ, first: " + "; ".join(
        f"{t[:40]!r}: {g[:12]} != {w[:12]}" for t, g, w in bad[:3])
