"""`edgekv bench`: llama-bench style speed tests, optionally side by side with llama.cpp.

Tests: ppN (prefill N tokens) and tgN (generate N tokens one by one), each at a context depth d
already in the cache (not timed). Random token ids, no sampling: only the model is timed.
The two runtimes run interleaved, rep by rep, so a noisy machine hits both alike.
"""
from __future__ import annotations

import gc
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import EdgekvError

KV_TO_GGML = {"f16": 1, "int8": 8, "int4": 2}  # edgekv cache type -> llama.cpp's (f16, q8_0, q4_0)


@dataclass
class Case:
    test: str  # "pp512" or "tg128"
    n: int
    depth: int
    kv: str
    threads: int

    @property
    def name(self) -> str:
        return f"{self.test} @ d{self.depth}" if self.depth else self.test


@dataclass
class Row:
    case: Case
    runtime: str  # "edgekv" or "llama.cpp"
    samples: list[float] = field(default_factory=list)  # tokens/s per rep
    kv_bytes: int = 0
    weight_bytes_per_token: int = 0
    peak_rss: int = 0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def measure_read_bandwidth() -> float:
    """Read bandwidth in bytes/s with numba's current thread count (kernels_cpu.membw)."""
    from .kernels_cpu.membw import read_bandwidth

    return read_bandwidth()


def decode_weight_bytes(llm) -> int:
    """Weight bytes one decode step reads: every matrix once, the embedding as one row."""
    total = 0
    for name, t in llm.file.tensors.items():
        if name == "token_embd.weight":
            total += t.raw.shape[1] + (t.nbytes if "output.weight" not in llm.file.tensors else 0)
        else:
            total += t.nbytes
    return total


class EdgekvRunner:
    name = "edgekv"

    def __init__(self, path, n_ctx: int, kv: str, threads: int):
        from .llm import LLM

        self.llm = LLM(path, n_ctx=n_ctx, kv=kv, threads=threads)
        self.vocab = self.llm.cfg.n_vocab

    def kv_bytes(self) -> int:
        return self.llm.new_cache().nbytes

    def run(self, case: Case, rng: np.random.Generator) -> float:
        ids = rng.integers(0, self.vocab, case.depth + case.n).tolist()
        cache = self.llm.new_cache()
        if case.depth:
            self.llm.forward(ids[: case.depth], cache, 0)
        if case.test.startswith("pp"):
            t = time.perf_counter()
            self.llm.forward(ids[case.depth :], cache, case.depth)
            return case.n / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(case.n):
            self.llm.forward(ids[case.depth + i : case.depth + i + 1], cache, case.depth + i)
        return case.n / (time.perf_counter() - t)


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, path, n_ctx: int, kv: str, threads: int):
        import llama_cpp

        quant = kv != "f16"
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, type_k=KV_TO_GGML[kv], type_v=KV_TO_GGML[kv],
                                   flash_attn=quant, verbose=False)
        self.vocab = self.llm.n_vocab()

    def kv_bytes(self) -> int:
        return 0

    def run(self, case: Case, rng: np.random.Generator) -> float:
        ids = rng.integers(0, self.vocab, case.depth + case.n).tolist()
        self.llm.reset()
        self.llm._ctx.kv_cache_clear() if hasattr(self.llm._ctx, "kv_cache_clear") else None
        if case.depth:
            self.llm.eval(ids[: case.depth])
        if case.test.startswith("pp"):
            t = time.perf_counter()
            self.llm.eval(ids[case.depth :])
            return case.n / (time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(case.n):
            self.llm.eval(ids[case.depth + i : case.depth + i + 1])
        return case.n / (time.perf_counter() - t)


def plan(prompt: list[int], gen: list[int], depths: list[int], kvs: list[str], threads: list[int]) -> list[Case]:
    cases = []
    for t in threads:
        for kv in kvs:
            for d in depths:
                cases += [Case(f"pp{n}", n, d, kv, t) for n in prompt if n]
                cases += [Case(f"tg{n}", n, d, kv, t) for n in gen if n]
    return cases


def run_bench(path, *, prompt=(512,), gen=(128,), depths=(0,), kvs=("f16",), threads=(None,), reps=3,
              compare: bool = False, progress: bool = True, seed: int = 0) -> dict:
    """Run the matrix; returns {"rows": [...], "bandwidth": B/s, "model": ...}."""
    from tqdm import tqdm

    from .backends.cpu import physical_cores

    threads = [t or physical_cores() for t in threads]
    cases = plan(list(prompt), list(gen), list(depths), list(kvs), threads)
    if not cases:
        raise EdgekvError("nothing to benchmark: every prompt length (-p) and generation length (-n) is 0")
    n_ctx_need = max(c.depth + c.n for c in cases) + 8
    runtimes = [EdgekvRunner]
    if compare:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise EdgekvError("--compare llama.cpp needs llama-cpp-python: pip install 'edgekv[compare]' "
                              "(it compiles llama.cpp, ~10 minutes)") from None
        runtimes.append(LlamaCppRunner)
    rows, synthetic = [], False
    bar = tqdm(total=len(cases) * len(runtimes) * (reps + 1), desc="bench", file=sys.stderr, disable=not progress)
    rng = np.random.default_rng(seed)
    by_setup: dict = {}
    for c in cases:
        by_setup.setdefault((c.kv, c.threads), []).append(c)
    for (kv, t), group in by_setup.items():
        runners = [R(path, n_ctx_need, kv, t) for R in runtimes]
        wbytes = decode_weight_bytes(runners[0].llm)
        # `edgekv synth` files: real shapes, random weights; their speed means something, their text not
        synthetic = bool(runners[0].llm.file.meta.get("edgekv.synthetic", False))
        for c in group:
            row_set = [Row(c, r.name, kv_bytes=r.kv_bytes(), weight_bytes_per_token=wbytes) for r in runners]
            for rep in range(reps + 1):  # rep 0 warms up (JIT, page cache) and is not counted
                for r, row in zip(runners, row_set):
                    tps = r.run(c, rng)
                    if rep:
                        row.samples.append(tps)
                    bar.update(1)
            for row in row_set:
                row.peak_rss = peak_rss_bytes()
            rows += row_set
        del runners
        gc.collect()
    bar.close()
    bandwidth = measure_read_bandwidth()  # last: its 1 GiB array must not count in peak RSS
    return {"rows": rows, "bandwidth": bandwidth, "model": str(path), "synthetic": synthetic}


def to_records(result: dict) -> list[dict]:
    recs = []
    bw = result["bandwidth"]
    base = {}
    for row in result["rows"]:
        if row.runtime == "llama.cpp":
            base[(row.case.name, row.case.kv, row.case.threads)] = row.mean
    for row in result["rows"]:
        c = row.case
        rec = dict(test=c.name, kv=c.kv, threads=c.threads, runtime=row.runtime, tokens_per_s=round(row.mean, 2),
                   stddev=round(row.std, 2))
        if c.test.startswith("tg"):
            gbs = row.weight_bytes_per_token * row.mean / 1e9
            rec.update(weight_gb_per_s=round(gbs, 2), bandwidth_share=round(gbs * 1e9 / bw, 3))
        rec.update(kv_mib=round(row.kv_bytes / 2**20, 1), peak_rss_mib=round(row.peak_rss / 2**20, 1))
        ref = base.get((c.name, c.kv, c.threads))
        if ref and row.runtime == "edgekv":
            rec["ratio_vs_llama_cpp"] = round(row.mean / ref, 3)
        recs.append(rec)
    return recs


def format_table(result: dict, fmt: str = "md") -> str:
    recs = to_records(result)
    if fmt == "json":
        return json.dumps({"model": result["model"], "synthetic": result.get("synthetic", False),
                           "read_bandwidth_gb_s": round(result["bandwidth"] / 1e9, 2),
                           "rows": recs}, indent=2)
    cols = ["test", "kv", "threads", "runtime", "tokens_per_s", "stddev", "weight_gb_per_s", "bandwidth_share",
            "kv_mib", "peak_rss_mib", "ratio_vs_llama_cpp"]
    cols = [c for c in cols if any(c in r for r in recs)]
    if fmt == "csv":
        lines = [",".join(cols)] + [",".join(str(r.get(c, "")) for c in cols) for r in recs]
        return "\n".join(lines)
    synth = " (synthetic: real shapes, random weights; speed only)" if result.get("synthetic") else ""
    head = f"model: {result['model']}{synth}; measured read bandwidth {result['bandwidth'] / 1e9:.1f} GB/s\n\n"
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in recs:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return head + "\n".join(lines)


def plot_backend():
    """matplotlib.pyplot on a file-only backend, or an EdgekvError saying how to install it
    (checked before a long bench run, not after it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgekvError("--plot needs matplotlib: pip install 'edgekv[plot]'") from None
    return plt


def plot(result: dict, path: str) -> None:
    """Decode tokens/s against context depth, one line per (runtime, cache type), into path."""
    plt = plot_backend()
    fig, ax = plt.subplots(figsize=(7, 4))
    series: dict = {}
    for row in result["rows"]:
        if row.case.test.startswith("tg"):
            series.setdefault((row.runtime, row.case.kv), []).append((row.case.depth, row.mean))
    for (rt, kv), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{rt} {kv}")
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
