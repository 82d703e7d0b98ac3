"""Batched decode: aggregate decode tokens/s of 1, 2, 4, 8 sequences decoded together, as ratios
against one sequence, in one run: through LLM.forward_batch (one forward pass per step over
every sequence's next token), and as that many threads each running its own `generate` on one
LLM (its scheduler batches their passes). Batch sizes take turns rep by rep, so that a change in the
machine's load falls on all of them alike; the figure per size is the best of its reps.

    python bench/batch.py [MODEL] [--sizes 1,2,4,8] [--steps 32] [--reps 3] [--kv int8] [--threads N]
                          [--compare llama.cpp] [--no-threaded]

--compare llama.cpp: llama-cpp-python's batched decode of the same sizes beside edgekv's, rep by
rep (its batch API: one llama_decode a step carrying each sequence's next token under its own
seq_id, q8_0 / q4_0 cache with flash attention for int8 / int4, as edgekv's `bench --compare`).
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


class LlamaCppBatch:
    """llama.cpp's batched decode through llama-cpp-python's low-level API: a context of up to
    `seqs` sequences, each prefilled alone, then one llama_decode per step with one token per
    sequence (greedy argmax in between, as decode_rate)."""

    def __init__(self, path, seqs: int, n_ctx: int, kv: str, threads: int):
        import llama_cpp as lc

        from edgekv.bench import KV_TO_GGML

        self.lc = lc
        self.llm = lc.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                            n_threads_batch=threads, type_k=KV_TO_GGML[kv], type_v=KV_TO_GGML[kv],
                            flash_attn=kv != "f16", verbose=False)
        params = self.llm.context_params  # the same settings, room for `seqs` sequences of n_ctx each
        params.n_seq_max, params.n_ctx = seqs, seqs * n_ctx
        self.ctx = lc.llama_init_from_model(self.llm._model.model, params)
        self.batch = lc.llama_batch_init(512, 0, seqs)
        self.vocab = self.llm.n_vocab()

    def _decode(self, items) -> None:
        """items: (token, pos, seq, wants logits) -> one llama_decode."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        return int(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,)).argmax())

    def rate(self, size: int, steps: int, depth: int) -> float:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        for j in range(size):  # the prompts of decode_rate
            self._decode([((7 * j + i) % 1000 + 1, i, j, i == depth - 1) for i in range(depth)])
        toks = [5 + j for j in range(size)]
        t = time.perf_counter()
        for s in range(steps):
            self._decode([(tok, depth + s, j, True) for j, tok in enumerate(toks)])
            toks = [self._argmax(j) for j in range(size)]
        return size * steps / (time.perf_counter() - t)


def thread_rate(llm, size: int, steps: int, depth: int) -> float:
    """Aggregate decode tokens/s of `size` threads each running its own greedy `generate` of
    `steps` tokens at once (the LLM's scheduler batches their passes), over the span from the
    first thread's first decode step to the last thread's last."""
    spans = [None] * size
    start = threading.Barrier(size)
    # forward_batch's kernels ran on this (main) thread: its OpenMP pool goes, as generate's does
    # when it ends, or every other thread's kernels would run slower (CPUBackend.release_threads)
    getattr(llm.backend, "release_threads", lambda: None)()

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
    ap.add_argument("--compare", choices=["llama.cpp"], default=None)
    ap.add_argument("--no-threaded", action="store_true", help="skip the N-threads column")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    n_ctx = max(64, a.depth + a.steps + 1)
    llm = edgekv.load(a.model, n_ctx=n_ctx, kv=a.kv, threads=a.threads, progress=False)
    decode_rate(llm, max(sizes), 4, a.depth)  # warm: compile and fault the weights in
    ref = LlamaCppBatch(llm.path, max(sizes), n_ctx, a.kv, llm.backend.threads) if a.compare else None
    if ref:
        ref.rate(max(sizes), 4, a.depth)
    rates = {s: [] for s in sizes}
    threaded = {s: [] for s in sizes}
    theirs = {s: [] for s in sizes}
    for _ in range(a.reps):
        for s in sizes:
            rates[s].append(decode_rate(llm, s, a.steps, a.depth))
            if not a.no_threaded:
                threaded[s].append(thread_rate(llm, s, a.steps, a.depth))
            if ref:
                theirs[s].append(ref.rate(s, a.steps, a.depth))
    from edgekv.kernels_cpu.qmatmul import kernel_paths

    print(f"# {llm.path.name}, kv {a.kv}, {a.steps} steps x {a.reps} reps after {a.depth}-token prompts, "
          f"threads {llm.backend.threads}; {machine()}; {kernel_paths()}; "
          f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    # best of the reps: on a shared machine the slow reps are the ones another program took the cores from
    cols = [("forward_batch", rates)] + ([] if a.no_threaded else [("threads, one generate each", threaded)])
    cols += [("llama.cpp batch", theirs)] if ref else []
    print("| sequences | " + " | ".join(f"{name} tok/s: best (reps) | x 1" for name, _ in cols) + " |")
    print("| --- |" + " --- | --- |" * len(cols))
    for s in sizes:
        cells = []
        for _, got in cols:
            best = max(got[s])
            cells.append(f"{best:.1f} ({', '.join(f'{r:.1f}' for r in got[s])}) | {best / max(got[sizes[0]]):.2f}")
        print(f"| {s} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
