"""Tokenizer throughput on ~100 KB of mixed text (target: encode in under 1 s).

    python bench/tokenizer.py [--kb 100] [--text FILE] [--models smollm2-135m-instruct,gemma3-270m]

The default text interleaves English prose (tests/fixtures/text_en.txt), Python source (this
repo's own modules) and the tokenizer corpus (Chinese, Japanese, Korean, emoji, whitespace runs,
special-token strings) in 2 KB slices, cut to --kb kilobytes of UTF-8. "cold" encodes with a
fresh tokenizer (empty BPE word cache); "warm" encodes the same text again. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edgekv.gguf_file import read_metadata
from edgekv.hub import resolve
from edgekv.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def mixed_text(n_bytes: int) -> str:
    prose = (ROOT / "tests" / "fixtures" / "text_en.txt").read_text(encoding="utf-8")
    code = "".join(p.read_text(encoding="utf-8") for d in ("edgekv", "models", "kernels_cpu")
                   for p in sorted((ROOT / d).glob("*.py")))
    corpus_file = ROOT / "tests" / "fixtures" / "tokenizer_corpus.json"
    corpus = "\n".join(json.loads(corpus_file.read_text(encoding="utf-8")))
    sources = [prose, code, corpus]
    out, size, k = [], 0, 0
    while size < n_bytes:
        src = sources[k % 3]
        start = (k // 3) * 2048 % max(1, len(src) - 2048)
        piece = src[start:start + 2048]
        out.append(piece)
        size += len(piece.encode("utf-8"))
        k += 1
    text = "".join(out)
    return text.encode("utf-8")[:n_bytes].decode("utf-8", "ignore")


def timed(fn, *args, **kw):
    t = time.perf_counter()
    r = fn(*args, **kw)
    return r, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kb", type=float, default=100.0, help="text size in KB (1000 bytes)")
    ap.add_argument("--text", type=Path, help="benchmark this UTF-8 file instead of the mixed text")
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    args = ap.parse_args()
    n_bytes = int(args.kb * 1000)
    text = args.text.read_text(encoding="utf-8") if args.text else mixed_text(n_bytes)
    kb = len(text.encode("utf-8")) / 1000

    print(f"text: {kb:.1f} KB, {len(text)} chars\n")
    print("| model | tokenizer | load s | tokens | encode cold s | encode warm s | cold KB/s | decode s "
          "| round trip | < 1 s / 100 KB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        path = resolve(name)
        meta, t_meta = timed(read_metadata, path)
        tok, t_tok = timed(Tokenizer.from_metadata, meta)
        ids, cold = timed(tok.encode, text)
        _, warm = timed(tok.encode, text)
        back, dec = timed(tok.decode, ids)
        bos = 1 if ids[:1] == [tok.bos_id] and tok.add_bos else 0
        round_trip = tok.decode(ids[bos:]) == text  # special=True renders special strings back as text
        per_100kb = cold * 100 / kb
        print(f"| {name} | {tok!r} | {t_meta + t_tok:.2f} | {len(ids)} | {cold:.3f} | {warm:.3f} | "
              f"{kb / cold:.0f} | {dec:.3f} | {'ok' if round_trip else 'CHANGED'} | "
              f"{'yes' if per_100kb < 1 else 'NO'} ({per_100kb:.2f} s) |")


if __name__ == "__main__":
    main()
