"""Batched decode: aggregate decode tokens/s of 1, 2, 4, 8 sequences decoded together, as ratios
against one sequence, in one run: through LLM.forward_batch (one forward pass per step over
every sequence's next token), and as that many threads each running its own `generate` on one
LLM (its scheduler batches their passes). Batch sizes take turns rep by rep, so that a change in the
machine's load falls on all of them alike; the figure per size is the best of its reps.

    python bench/batch.py [MODEL] [--sizes 1,2,4,8] [--steps 32] [--reps 3] [--kv int8] [--threads N]
"""
from __future__ import annotations

import argparse
import platform
import threading
import time
from datetime import datetime, timezone

import numpy as np

import edgekv
from edgekv.generate import Stats


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os

    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()}"


def decode_rate(llm, size: int, steps: int, depth: int) -> float:
    """Aggregate tokens/s of `size` sequences decoding `steps` tokens each, one batched step at a
    time, after a prompt of `depth` tokens each (the sequences' prompts differ)."""
    caches = [llm.new_cache() for _ in range(size)]
    for j, c in enumerate(caches):
        llm.forward([(7 * j + i) % 1000 + 1 for i in range(depth)], c, 0)
    toks = [5 + j for j in range(size)]
    t = time.perf_counter()
    for s in range(steps):
        logits = llm.forward_batch([([tok], c, depth + s) for tok, c in zip(toks, caches)])
        toks = [int(np.argmax(lg)) for lg in logits]
    return size * steps / (time.perf_counter() - t)


def thread_rate(llm, size: int, steps: int, depth: int) -> float:
    """Aggregate decode tokens/s of `size` threads each running its own greedy `generate` of
    `steps` tokens at once (the LLM's scheduler batches their passes), over the span from the
    first thread's first decode step to the last thread's last."""
    spans = [None] * size
    start = threading.Barrier(size)

    def work(j):
        prompt = [(7 * j + i) % 1000 + 1 for i in range(depth)]
        stats = Stats()
        start.wait()
        for _ in llm.generate(prompt, max_tokens=steps, temperature=0.0, stats=stats):
            pass
        end = time.perf_counter()
        spans[j] = (end - stats.decode_s, end, stats.generated_tokens)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(n for _, _, n in spans) / (max(e for _, e, _ in spans) - min(b for b, _, _ in spans))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--depth", type=int, default=16, help="prompt tokens per sequence before decoding")
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    llm = edgekv.load(a.model, n_ctx=max(64, a.depth + a.steps + 1), kv=a.kv, threads=a.threads, progress=False)
    decode_rate(llm, max(sizes), 4, a.depth)  # warm: compile and fault the weights in
    rates = {s: [] for s in sizes}
    threaded = {s: [] for s in sizes}
    for _ in range(a.reps):
        for s in sizes:
            rates[s].append(decode_rate(llm, s, a.steps, a.depth))
            threaded[s].append(thread_rate(llm, s, a.steps, a.depth))
    from edgekv.kernels_cpu.qmatmul import kernel_paths

    print(f"# {llm.path.name}, kv {a.kv}, {a.steps} steps x {a.reps} reps after {a.depth}-token prompts, "
          f"threads {llm.backend.threads}; {machine()}; {kernel_paths()}; "
          f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    # best of the reps: on a shared machine the slow reps are the ones another program took the cores from
    print("| sequences | forward_batch tok/s: best (reps) | x 1 | threads, one generate each: best (reps) | x 1 |")
    print("| --- | --- | --- | --- | --- |")
    base, tbase = max(rates[sizes[0]]), max(threaded[sizes[0]])
    for s in sizes:
        best, tbest = max(rates[s]), max(threaded[s])
        print(f"| {s} | {best:.1f} ({', '.join(f'{r:.1f}' for r in rates[s])}) | {best / base:.2f} "
              f"| {tbest:.1f} ({', '.join(f'{r:.1f}' for r in threaded[s])}) | {tbest / tbase:.2f} |")


if __name__ == "__main__":
    main()
