"""Where a decode token's time goes against the memory bus: a whole decode step, the same step's
weight matrices alone (each one-token `qmatmul.run` call back to back, in the model's order, per
weight type), and a plain read of each type's arrays (kernels_cpu.membw.read_pass), round by
round so that each figure has its ceiling beside it on a host whose bandwidth moves.

    python bench/decode_split.py MODEL.gguf [--threads N] [--rounds R]

Per round: the step's median over 3 tokens (GB/s of all weights), the matrices' total, and per
type its time, GB/s and share of its plain read. A step slower than its matrices spends the
difference on the rest of the block (norms, attention, activation quantization); a type far
below its plain read is where its kernel loses the stream.
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from edgekv.bench import decode_weights
from edgekv.errors import EdgekvError
from edgekv.kernels_cpu import qmatmul as qm
from edgekv.kernels_cpu.layouts import X16
from edgekv.kernels_cpu.membw import read_pass
from edgekv.llm import LLM
from edgekv.quants import QUANT_TYPES


def type_name(qtype: int) -> str:
    """Q4_K, or Q4_KX16 for its repacked layout (kernels_cpu.layouts)."""
    return QUANT_TYPES[qtype % X16].name + ("X16" if qtype > X16 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    try:
        llm = LLM(args.model, n_ctx=256, kv="f16", threads=args.threads)
    except EdgekvError as e:  # one line, as the CLI's
        raise SystemExit(f"decode_split: {e}") from None
    qws = decode_weights(llm.model)
    rng = np.random.default_rng(0)
    xs = {q.k: rng.standard_normal((1, q.k), dtype=np.float32) for q in qws}
    outs = [np.empty((1, q.m), np.float32) for q in qws]
    types = sorted({q.qtype for q in qws})
    nbytes = {t: sum(a.nbytes for q in qws if q.qtype == t for a in q.ws) for t in types}
    total = sum(nbytes.values())
    print(f"{args.model}: {len(qws)} matrices, " + ", ".join(f"{type_name(t)} {nbytes[t] / 1e9:.3f} GB" for t in types))
    cache = llm.new_cache()
    llm.forward([1, 2, 3, 4], cache, 0)
    pos = 4
    for _ in range(args.rounds):
        steps = []
        for i in range(3):
            t0 = time.perf_counter()
            llm.forward([5 + i], cache, pos)
            steps.append(time.perf_counter() - t0)
            pos += 1
        spent: dict[int, float] = collections.defaultdict(float)
        for q, o in zip(qws, outs):
            t0 = time.perf_counter()
            qm.run(q, xs[q.k], o, 0, qm.PRE_NONE, qm._NONE1, 1e-6, qm._NONE2, qm._NONE1)  # the backend's call
            spent[q.qtype] += time.perf_counter() - t0
        step = float(np.median(steps))
        line = f"step {step * 1e3:.1f} ms ({total / step / 1e9:.1f} GB/s) | matrices {sum(spent.values()) * 1e3:.1f} ms"
        for t in types:
            n, s = read_pass([a for q in qws if q.qtype == t for a in q.ws])
            gbs = nbytes[t] / spent[t]
            line += f" | {type_name(t)} {spent[t] * 1e3:.1f} ms, {gbs / 1e9:.1f} GB/s = {gbs * s / n:.0%} of its read ({n / s / 1e9:.1f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
