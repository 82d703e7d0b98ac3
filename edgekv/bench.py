"""`edgekv bench`: llama-bench style speed tests, optionally side by side with llama.cpp.

Tests: ppN (prefill N tokens) and tgN (generate N tokens one by one), each at a context depth d
already in the cache (not timed: filled once per runtime and depth, then trimmed back to d before
each rep, so a 4K depth is prefilled once, not once a rep). Random token ids, no sampling: only the model is timed.
The two runtimes run interleaved, rep by rep, so a noisy machine hits both alike. With
`background_load=N`, every rep runs once quiet and once beside N busy processes (a desktop
where other programs use the cores), so the two conditions are measured side by side too.

A decode row's bandwidth figures: `bandwidth_share` against the machine's read bandwidth measured
once at the end (the best 128 MiB read of a 1 GiB array), and `share_of_weights_read` against a
plain read of the very weight arrays a decode step reads (kernels_cpu.membw.read_pass), one pass
after each token of the rep, outside its timing: the ceiling at the moments of the tokens, on
hosts whose bandwidth moves from second to second (one pass after a 3-second rep measured
another moment: a 7B rep's share swung 0.66-0.96 from run to run, llama.cpp's alike). The share
is the reads' total time over the tokens' (their rates' harmonic means).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import EdgekvError
from .gguf_file import GGUFFile

KV_TO_GGML = {"f16": 1, "int8": 8, "int4": 2}  # edgekv cache type -> llama.cpp's (f16, q8_0, q4_0)


@dataclass
class Case:
    test: str  # "pp512" or "tg128"
    n: int
    depth: int
    kv: str
    threads: int
    auto: bool = False  # edgekv picks its count (at most `threads`) from the free cores
    load: int = 0  # busy processes running beside it

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
    reads: list[float] = field(default_factory=list)  # bytes/s of plain reads of the weights between its tokens (tg)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0


def _proc_kib(path: str, key: str) -> int | None:
    """A "key: N kB" line of a /proc file in bytes (Linux), else None."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set since the last reset_peak_rss() (Linux: VmHWM), else since start."""
    hwm = _proc_kib("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def reset_peak_rss() -> None:
    """Start the peak over from the current resident set (Linux 4.0+; elsewhere nothing)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def available_memory() -> int | None:
    """MemAvailable in bytes (Linux), else None."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def in_turn(path, n_runtimes: int) -> bool:
    """Whether the runtimes must run one after the other: llama.cpp holds its own copy of the
    weights it repacks, so the two side by side need about twice the file in memory, and a
    model that does not fit would be timed reading from disk."""
    free = available_memory()
    return n_runtimes > 1 and free is not None and 2 * os.path.getsize(path) > 0.9 * free


def measure_read_bandwidth() -> float:
    """Read bandwidth in bytes/s with numba's current thread count (kernels_cpu.membw)."""
    from .kernels_cpu.membw import read_bandwidth

    return read_bandwidth()


def decode_weight_bytes(f) -> int:
    """Weight bytes one decode step reads from GGUF file f: every matrix once, the embedding as one row."""
    total = 0
    for name, t in f.tensors.items():
        if name == "token_embd.weight":
            total += t.raw.shape[1] + (t.nbytes if "output.weight" not in f.tensors else 0)
        else:
            total += t.nbytes
    return total


def decode_weights(model) -> list:
    """The matrices (qmatmul.QWeight) a decode step of `model` calls, in its order, as its CPU
    backend holds them: every layer's and the output's, not the embedding table (one row a token)
    unless the output is tied to it."""
    from .kernels_cpu.qmatmul import QWeight

    found: list[QWeight] = []

    def visit(v) -> None:
        if isinstance(v, QWeight):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                visit(x)
        elif dataclasses.is_dataclass(v):
            for f in dataclasses.fields(v):
                visit(getattr(v, f.name))

    visit(model.layers)
    visit(model.output)
    return found


def decode_arrays(model) -> list[np.ndarray]:
    """The weight arrays a decode step of `model` reads, each once (decode_weights' parts: GGUF
    rows mapped, or a repacked copy)."""
    seen: dict[int, np.ndarray] = {}
    for w in decode_weights(model):
        for a in w.ws:
            if a.size:
                seen.setdefault(id(a), a)
    return list(seen.values())


class EdgekvRunner:
    name = "edgekv"

    def __init__(self, path, n_ctx: int, kv: str, threads: int, evict: str = "window", ring: int | None = None):
        from .llm import LLM

        self.llm = LLM(path, n_ctx=ring or n_ctx, kv=kv, threads=threads, evict=evict)
        self.vocab = self.llm.cfg.n_vocab
        self.filled = (-1, None)  # (depth, the cache holding it)
        self._weights = None  # decode_arrays, at the first read_weights

    def kv_bytes(self) -> int:
        return self.llm.new_cache().nbytes

    def read_weights(self) -> float:
        """Bytes/s of one plain read of the weights a decode step reads (kernels_cpu.membw.read_pass)."""
        from .kernels_cpu.membw import read_pass

        if self._weights is None:  # found once: the model holds the same arrays for its life
            self._weights = decode_arrays(self.llm.model)
        n, s = read_pass(self._weights)
        return n / s

    def at_depth(self, depth: int, rng: np.random.Generator):
        """A cache holding `depth` random tokens: the last one trimmed back, else filled anew."""
        d, cache = self.filled
        if d != depth or not cache.trim(depth):  # trim: False once the ring has wrapped
            cache = self.llm.new_cache()
            if depth:
                self.llm.forward(rng.integers(0, self.vocab, depth).tolist(), cache, 0)
            self.filled = (depth, cache)
        return cache

    def run(self, case: Case, rng: np.random.Generator, between=None) -> float:
        cache = self.at_depth(case.depth, rng)
        ids = rng.integers(0, self.vocab, case.n).tolist()
        if case.test.startswith("pp"):
            t = time.perf_counter()
            self.llm.forward(ids, cache, case.depth)
            return case.n / (time.perf_counter() - t)
        return _decode(lambda i: self.llm.forward(ids[i : i + 1], cache, case.depth + i), case.n, between)


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, path, n_ctx: int, kv: str, threads: int):
        import llama_cpp

        quant = kv != "f16"
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, type_k=KV_TO_GGML[kv], type_v=KV_TO_GGML[kv],
                                   flash_attn=quant, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.filled = -1  # depth in the cache

    def kv_bytes(self) -> int:
        return 0

    def run(self, case: Case, rng: np.random.Generator, between=None) -> float:
        if self.filled == case.depth:
            self.llm.n_tokens = case.depth  # eval drops the cache from n_tokens on: back to the depth
        else:
            self.llm.reset()
            if case.depth:
                self.llm.eval(rng.integers(0, self.vocab, case.depth).tolist())
            self.filled = case.depth
        ids = rng.integers(0, self.vocab, case.n).tolist()
        if case.test.startswith("pp"):
            t = time.perf_counter()
            self.llm.eval(ids)
            return case.n / (time.perf_counter() - t)
        return _decode(lambda i: self.llm.eval(ids[i : i + 1]), case.n, between)


def _decode(step, n: int, between) -> float:
    """Tokens/s of step(0) .. step(n - 1), one decode token each; between() (when given) runs after
    each, outside the timing."""
    spent = 0.0
    for i in range(n):
        t = time.perf_counter()
        step(i)
        spent += time.perf_counter() - t
        if between is not None:
            between()
    return n / spent


class BackgroundLoad:
    """n busy processes (one spinning Python loop each), stopped except during a loaded rep."""

    SETTLE_S = 0.6  # before each rep of a loaded bench: the processes are at full speed (or stopped),
    # and the runtimes see an idle gap, as a call after a pause does (edgekv then reads the load again)

    def __init__(self, n: int):
        if n and not hasattr(signal, "SIGSTOP"):
            raise EdgekvError("--background-load needs a POSIX system (it pauses its busy processes)")
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        self._signal(signal.SIGSTOP)

    def _signal(self, sig) -> None:
        for p in self.procs:
            os.kill(p.pid, sig)

    @contextlib.contextmanager
    def rep(self, loaded: bool):
        """One rep, beside the running processes (loaded) or with them stopped; a bench without
        processes runs its reps back to back."""
        if loaded:
            self._signal(signal.SIGCONT)
        if self.procs:
            time.sleep(self.SETTLE_S)
        try:
            yield
        finally:
            if loaded:
                self._signal(signal.SIGSTOP)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def plan(prompt: list[int], gen: list[int], depths: list[int], kvs: list[str], threads: list[int | None],
         loads: list[int] = (0,)) -> list[Case]:
    """The cases; a thread count of None is edgekv's own choice (at most the physical cores)."""
    from .backends.cpu import physical_cores

    cores, cases = physical_cores(), []
    for t in threads:
        for kv in kvs:
            for d in depths:
                for test, n in [(f"pp{n}", n) for n in prompt if n] + [(f"tg{n}", n) for n in gen if n]:
                    cases += [Case(test, n, d, kv, t or cores, t is None, load) for load in loads]
    return cases


def _run_setup(runners, tests, reps, bg, bar, rng, wbytes) -> list[Row]:
    """Every test of one (cache, threads) setup, the runners interleaved rep by rep."""
    rows = []
    reader = next((r for r in runners if isinstance(r, EdgekvRunner)), None)
    for group in tests.values():
        row_set = {c.load: [Row(c, r.name, kv_bytes=r.kv_bytes(), weight_bytes_per_token=wbytes)
                            for r in runners] for c in group}
        for rep in range(reps + 1):  # rep 0 warms up (JIT, page cache), quiet, not counted
            for c in group if rep else group[:1]:
                with bg.rep(c.load > 0):
                    for r, row in zip(runners, row_set[c.load]):
                        # a decode's ceiling at its moments: the same bytes read plainly after each
                        # token (a host's bandwidth moves; one figure at the end is another moment)
                        read = rep and c.test.startswith("tg") and reader is not None
                        tps = r.run(c, rng, (lambda row=row: row.reads.append(reader.read_weights())) if read else None)
                        if rep:
                            row.samples.append(tps)
                        bar.update(1 if rep else len(group))
        for rs in row_set.values():
            for row in rs:
                row.peak_rss = peak_rss_bytes()
                rows.append(row)
    return rows


def run_bench(path, *, prompt=(512,), gen=(128,), depths=(0,), kvs=("f16",), threads=(None,), reps=3,
              compare: bool = False, progress: bool = True, seed: int = 0, background_load: int = 0,
              evict: str = "window", ring: int | None = None) -> dict:
    """Run the matrix; returns {"rows": [...], "bandwidth": B/s, "model": ...}. threads None:
    edgekv chooses (as it does by default), llama.cpp gets the physical cores (its default).
    ring: edgekv's cache holds that many tokens (default: every test's), full rings evicting by
    `evict` (edgekv.EVICT_POLICIES)."""
    from tqdm import tqdm

    loads = [0, background_load] if background_load else [0]
    cases = plan(list(prompt), list(gen), list(depths), list(kvs), list(threads), loads)
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
    rows = []
    bar = tqdm(total=len(cases) * len(runtimes) * (reps + 1), desc="bench", file=sys.stderr, disable=not progress)
    rng = np.random.default_rng(seed)
    by_setup: dict = {}
    for c in cases:  # one model load per (cache, threads); each test's loads side by side
        by_setup.setdefault((c.kv, c.threads, c.auto), {}).setdefault((c.name, c.n), []).append(c)
    f = GGUFFile(path)
    wbytes = decode_weight_bytes(f)
    # `edgekv synth` files: real shapes, random weights; their speed means something, their text not
    synthetic = bool(f.meta.get("edgekv.synthetic", False))
    f.close()
    # one runtime loaded at a time where the two do not fit in memory together (then not interleaved)
    turns = [[R] for R in runtimes] if in_turn(path, len(runtimes)) else [runtimes]
    bg = BackgroundLoad(background_load)
    try:
        for (kv, t, auto), tests in by_setup.items():
            for turn in turns:
                reset_peak_rss()  # each row's peak is its own runtimes', not an earlier setup's
                runners = [R(path, n_ctx_need, kv, None if auto and R is EdgekvRunner else t,
                             **(dict(evict=evict, ring=ring) if R is EdgekvRunner else {})) for R in turn]
                rows += _run_setup(runners, tests, reps, bg, bar, rng, wbytes)
                del runners
                gc.collect()
    finally:
        bg.close()
        bar.close()
    bandwidth = measure_read_bandwidth()  # last: its 1 GiB array must not count in peak RSS
    return {"rows": rows, "bandwidth": bandwidth, "model": str(path), "synthetic": synthetic,
            "background_load": background_load, "in_turn": len(turns) > 1}


def to_records(result: dict) -> list[dict]:
    recs = []
    bw = result["bandwidth"]
    base = {}
    quiet = {}
    for row in result["rows"]:
        if row.runtime == "llama.cpp":
            base[(row.case.name, row.case.kv, row.case.threads, row.case.auto, row.case.load)] = row.mean
        if not row.case.load:
            quiet[(row.runtime, row.case.name, row.case.kv, row.case.threads, row.case.auto)] = row.mean
    for row in result["rows"]:
        c = row.case
        threads = f"auto<={c.threads}" if c.auto and row.runtime == "edgekv" else c.threads
        rec = dict(test=c.name, kv=c.kv, threads=threads, runtime=row.runtime)
        if result.get("background_load"):
            rec["load"] = c.load
        rec.update(tokens_per_s=round(row.mean, 2), stddev=round(row.std, 2))
        if c.test.startswith("tg"):
            gbs = row.weight_bytes_per_token * row.mean / 1e9
            rec.update(weight_gb_per_s=round(gbs, 2), bandwidth_share=round(gbs * 1e9 / bw, 3))
            if row.reads:  # against plain reads of the same weights, one after each of its tokens
                # rates combined by their times (harmonic means): the reads' total time over the
                # tokens' total time, whatever minute each rep fell in
                read = statistics.harmonic_mean(row.reads)
                tokens = row.weight_bytes_per_token * statistics.harmonic_mean(row.samples)
                rec.update(weights_read_gb_per_s=round(read / 1e9, 2), share_of_weights_read=round(tokens / read, 3))
        rec.update(kv_mib=round(row.kv_bytes / 2**20, 1), peak_rss_mib=round(row.peak_rss / 2**20, 1))
        ref = base.get((c.name, c.kv, c.threads, c.auto, c.load))
        if ref and row.runtime == "edgekv":
            rec["ratio_vs_llama_cpp"] = round(row.mean / ref, 3)
        calm = quiet.get((row.runtime, c.name, c.kv, c.threads, c.auto))
        if c.load and calm:
            rec["ratio_vs_quiet"] = round(row.mean / calm, 3)
        recs.append(rec)
    return recs


def format_table(result: dict, fmt: str = "md") -> str:
    from .kernels_cpu.qmatmul import kernel_paths

    recs = to_records(result)
    if fmt == "json":
        return json.dumps({"model": result["model"], "synthetic": result.get("synthetic", False),
                           "read_bandwidth_gb_s": round(result["bandwidth"] / 1e9, 2),
                           "background_load": result.get("background_load", 0),
                           "cpu_kernels": kernel_paths(),
                           "rows": recs}, indent=2)
    cols = ["test", "kv", "threads", "runtime", "load", "tokens_per_s", "stddev", "weight_gb_per_s",
            "bandwidth_share", "weights_read_gb_per_s", "share_of_weights_read", "kv_mib", "peak_rss_mib",
            "ratio_vs_llama_cpp", "ratio_vs_quiet"]
    cols = [c for c in cols if any(c in r for r in recs)]
    if fmt == "csv":
        lines = [",".join(cols)] + [",".join(str(r.get(c, "")) for c in cols) for r in recs]
        return "\n".join(lines)
    synth = " (synthetic: real shapes, random weights; speed only)" if result.get("synthetic") else ""
    load = result.get("background_load")
    load = f"; load = busy processes beside the run ({load} or none)" if load else ""
    if result.get("in_turn"):
        load += "; runtimes in turn, not interleaved (the weights twice do not fit in memory)"
    head = (f"model: {result['model']}{synth}; measured read bandwidth {result['bandwidth'] / 1e9:.1f} GB/s{load}\n"
            f"CPU kernels: {kernel_paths()}\n\n")
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
