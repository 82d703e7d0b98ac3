"""Per-token fixed cost of decode: a 30-layer model with SmolLM2's graph and negligible widths
(its kernels do almost no work, so its time per token is dispatch and thread wake-ups) against
the real SmolLM2-135M, same cache type and threads; and how much of that fixed cost is Python
(the tiny model's step minus the same kernel calls made back to back, see in_kernels).

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


def in_kernels(llm, kv: str, n: int = 150) -> float:
    """Seconds per decode step inside the kernels alone (their dispatch included): the same
    step's embedding, block and output calls made straight to the compiled functions, with no
    model code, backend wrapper or cache bookkeeping around them. The rest of a step's time is
    Python."""
    import numpy as np

    from edgekv.kernels_cpu import block, qmatmul

    m, be = llm.model, llm.backend
    cache = llm.new_cache(kv)
    llm.forward(list(range(1, 9)), cache, 0)
    llm.forward([5], cache, 8)  # every layer's cache packed for the block kernel
    pos, ids = np.array([9]), np.array([5])
    e1, e2 = np.empty(0, np.float32), np.empty((0, 0), np.float32)
    plans = [cache[i].plan(pos) for i in range(len(m.blocks))]
    for i, p in enumerate(plans):
        cache[i].place(p)  # the token's position, as the backend's step records it
    packs = [(m.blocks[i], cache[i].backend_state[2], np.array([p.one_token + (0,)], np.int64))
             for i, p in enumerate(plans)]
    out = np.empty((1, m.output.m), np.float32)
    t = time.perf_counter()
    for _ in range(n):  # the same slot rewritten each step: the context stays at 9 tokens
        x = np.empty((1, m.token_embd.k), np.float32)
        qmatmul._dequant_rows(m.token_embd.ws[0], m.token_embd.qtype, ids, m.token_embd.k, x)
        for pack, layer, at in packs:
            W, N, dims, eps, (scale, res_scale, softcap), (freqs, neox, heads, mag) = pack
            block._block_core(x, pos, W, N, dims, eps, scale, res_scale, (freqs, neox, heads, mag), layer, at,
                              (1 << 16, 256, be.threads), softcap)
        qmatmul._qmatvec(x, m.output.ws, m.output.qtype, out, 0, qmatmul.PRE_NORM, m.output_norm, m.cfg.norm_eps, e2, e1)
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    tiny = Path(tempfile.gettempdir()) / "edgekv-overhead-tiny30-ctx1024.gguf"
    if not tiny.exists():
        write_synthetic(tiny, "llama", "tiny", "q4_0", progress=False, n_layer=30, n_embd=64, n_head=2,
                        n_head_kv=1, n_ff=64, n_vocab=320, n_ctx=1024)
    a = edgekv.load(tiny, n_ctx=1024, kv=args.kv, threads=args.threads, progress=False)
    b = edgekv.load("smollm2", n_ctx=1024, kv=args.kv, threads=args.threads, progress=False)
    for llm in (a, b):  # compile and warm up
        per_token(llm, args.kv, 20)
    # interleaved, best of each: a shared machine's noise only ever adds time
    ta = tb = float("inf")
    for _ in range(args.reps):
        ta, tb = min(ta, per_token(a, args.kv)), min(tb, per_token(b, args.kv))
    tk = min(in_kernels(a, args.kv) for _ in range(args.reps))
    print(f"kv {args.kv}: tiny 30-layer {ta * 1e3:.2f} ms/token, SmolLM2-135M {tb * 1e3:.2f} ms/token, "
          f"fixed cost {ta / tb:.1%} of decode; of it in the kernels {tk * 1e3:.2f} ms (thread wake-ups, "
          f"small work), Python {(ta - tk) * 1e3:.2f} ms = {(ta - tk) / tb:.1%} of decode")


if __name__ == "__main__":
    main()
