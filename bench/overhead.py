"""Per-token fixed cost of decode: a 30-layer model with SmolLM2's graph and negligible widths
(its kernels do almost no work, so its time per token is dispatch and thread wake-ups) against
the real SmolLM2-135M, same cache type and threads.

    python bench/overhead.py [--kv f16|int8|int4] [--threads N] [--reps R]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import edgekv
from edgekv.synth import write_synthetic


def per_token(llm, kv: str, n: int = 150) -> float:
    """Seconds per decode step after an 8-token prompt, over n steps."""
    cache = llm.new_cache(kv)
    llm.forward(list(range(1, 9)), cache, 0)
    t = time.perf_counter()
    for i in range(n):
        llm.forward([5 + i % 50], cache, 8 + i)
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    tiny = Path(tempfile.gettempdir()) / "edgekv-overhead-tiny30.gguf"
    if not tiny.exists():
        write_synthetic(tiny, "llama", "tiny", "q4_0", progress=False, n_layer=30, n_embd=64, n_head=2,
                        n_head_kv=1, n_ff=64, n_vocab=320)
    a = edgekv.load(tiny, n_ctx=1024, kv=args.kv, threads=args.threads, progress=False)
    b = edgekv.load("smollm2", n_ctx=1024, kv=args.kv, threads=args.threads, progress=False)
    for llm in (a, b):  # compile and warm up
        per_token(llm, args.kv, 20)
    # interleaved, best of each: a shared machine's noise only ever adds time
    ta = tb = float("inf")
    for _ in range(args.reps):
        ta, tb = min(ta, per_token(a, args.kv)), min(tb, per_token(b, args.kv))
    print(f"kv {args.kv}: tiny 30-layer {ta * 1e3:.2f} ms/token, SmolLM2-135M {tb * 1e3:.2f} ms/token, "
          f"fixed cost {ta / tb:.1%} of decode")


if __name__ == "__main__":
    main()
