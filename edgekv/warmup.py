"""Compile the CPU kernels a chat needs before its first prompt, behind a progress bar.

kernels_cpu/ is numba code, compiled on first use and cached on disk (cache=True; the
NUMBA_CACHE_DIR variable moves the cache). On a fresh install a chat needs ~320 CPU-seconds of
compiling on a 2-vCPU Zen 4 VM (bench/RESULTS.md), which used to be a silent pause before the
first reply and a smaller one on a later turn (paths a first turn does not take). `prepare()`
pays it up front when the disk cache lacks a kernel: the GROUPS below compile in worker
processes side by side (a child writes the cache, this process reads it), then run here to load
them, so that no turn compiles. With a warm cache it prints nothing and only runs the groups
here, once per process: numba loads a cached kernel's machine code on its first call (~1 s for
all of them, bench/RESULTS.md), which a new process's first prompt would otherwise pay.

The kernels' signatures do not depend on the model (quant types and cache kinds are run-time
arguments), so the groups run on tiny synthetic weights and `edgekv warmup` needs no model;
tests/test_warmup.py checks that real chats on both models then compile nothing.

    python -m edgekv.warmup GROUP    # compile one group, exit (what a worker runs, see _worker_cmd)
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

from .kvcache import BatchLayer, KVCache
from .rope import plain

# (name, what the bar calls it, CPU-seconds to compile on a 2-vCPU Zen 4 VM (2026-12-07), groups
# whose kernels it calls and should find cached). The estimates only pace the bar; the longest
# group goes first.
GROUPS = (
    ("matvec", "matvec", 185.0, ()),
    ("attention", "attention", 30.0, ()),
    ("prefill", "prefill", 63.0, ()),
    ("block", "block", 37.0, ("matvec", "attention")),
)
# The disk-cached kernels the groups compile (module, function): one missing means a cold
# start. tests/test_warmup.py keeps the list equal to what the groups really compile.
def _prefill_kernels() -> tuple[tuple[str, str], ...]:
    """The prefill GEMMs this machine runs for quantized types: the int8 one (VNNI: every type;
    AVX2: Q4 / Q5 / K types), the float one (Q8_0 and IQ4 on AVX2; everything without int8)."""
    from .kernels_cpu.qmatmul import Q4_0, Q8_0, int8_prefill

    return (("igemm", "_igemm"),) * int8_prefill(Q4_0) + (("qmatmul", "_qgemm"),) * (not int8_prefill(Q8_0))


KERNELS = (("qmatmul", "_qmatvec"), *_prefill_kernels(), ("qmatmul", "_dequant_rows"),
           ("ops", "_rmsnorm_serial"), ("ops", "_rmsnorm_parallel"), ("ops", "_rope_serial"), ("ops", "_rope_parallel"),
           ("ops", "_silu_mul_serial"), ("ops", "_silu_mul_parallel"), ("ops", "_gelu_mul_serial"),
           ("ops", "_gelu_mul_parallel"), ("kvquant", "_store_core"), ("kvquant", "_kv_space_core"),
           ("kvquant", "_attn_core"), ("kvquant", "_decode_core"), ("kvquant", "_hadamard_serial"),
           ("kvquant", "_hadamard_parallel"), ("block", "_block_core"), ("block", "_stack_core"), ("block", "_list_of"),
           ("block", "_list_push"), ("evict", "_score_update"),
           ("evict", "_choose"))
_H, _HKV, _HD, _D, _FF = 2, 1, 64, 128, 256  # the synthetic model: heads, kv heads, head dim, width, ffn
_ROPE = plain(10000.0, _HD)  # llama-style rope over the whole head


# -- the groups: every call path of a chat, on small arrays ---------------------------------
def _rand(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _weight(rows: int | tuple, k: int, rng, q4: bool = False):
    """A Q8_0 weight (q4: Q4_0) of k columns: fp16 scale 0.02, random quants; rows a tuple:
    same-type matrices fused (as QKV) with those rows each."""
    from .kernels_cpu.qmatmul import Q4_0, Q8_0, QWeight

    raws = []
    for m in rows if isinstance(rows, tuple) else (rows,):
        b = np.empty((m, k // 32, 18 if q4 else 34), np.uint8)
        b[:, :, :2] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
        b[:, :, 2:] = rng.integers(0, 256, b[:, :, 2:].shape, dtype=np.uint8)
        raws.append(b.reshape(m, -1))
    return QWeight(raws[0] if len(raws) == 1 else tuple(raws), Q4_0 if q4 else Q8_0)


def _layer(kind: str = "int8", capacity: int = 16, evict: str = "window"):
    return KVCache([capacity], _HKV, _HD, n_sink=4, kind=kind, evict=evict)[0]


def _attend(be, kv, rng, p0: int, n: int) -> None:
    q, k, v = _rand(rng, n, _H, _HD), _rand(rng, n, _HKV, _HD), _rand(rng, n, _HKV, _HD)
    be.attention(q, np.arange(p0, p0 + n, dtype=np.int64), kv, k, v, _HD ** -0.5, _ROPE)


def _matvec(be, rng) -> None:
    """One token (and a few: a short prompt) through a matrix, with the norm before it."""
    w, x = _weight(32, _D, rng), _rand(rng, 3, _D)
    be.matmul(x[:1], w, pre="norm", pre_w=np.ones(_D, np.float32), eps=1e-6)
    be.matmul(x, w, pre="norm", pre_w=np.ones(_D, np.float32), eps=1e-6)


def _attention(be, rng) -> None:
    """A ring's life: the first prompt (calibration, store), reply tokens (the one-call decode
    step), a later prompt, and prompts once the ring is full (sinks seen from the window)."""
    from .kernels_cpu import kvquant

    kv = _layer()
    _attend(be, kv, rng, 0, 9)
    for p in range(9, 16):
        _attend(be, kv, rng, p, 1)
    _attend(be, kv, rng, 16, 3)
    for p in range(19, 22):
        _attend(be, kv, rng, p, 1)
    kvquant.hadamard_(_rand(rng, kvquant.KV_HADAMARD_PAR_MIN // _HD, _HD))  # a long prompt's sink queries
    kvquant.hadamard_(_rand(rng, 2, _HD))
    kv = _layer(capacity=40, evict="tova")  # an importance policy (--evict): scored attention, then victims once full
    _attend(be, kv, rng, 0, 36)
    for p in range(36, 44):
        _attend(be, kv, rng, p, 1)


def _prefill(be, rng) -> None:
    """Prompt batches: embedding rows, the tiled matmul with its norm, activation and residual
    steps, and each elementwise op at a size below and above its threshold for threads."""
    from .kernels_cpu import ops
    from .kernels_cpu.qmatmul import SMALL_N

    n, ones = SMALL_N + 2, np.ones(_D, np.float32)
    emb = _weight(n, _D, rng)
    x = be.embed(emb, np.arange(n, dtype=np.int64))
    be.matmul(x, _weight((_H * _HD, _HKV * _HD, _HKV * _HD), _D, rng), pre="norm", pre_w=ones, eps=1e-6)
    x = be.matmul(_rand(rng, n, _D), _weight(_D, _D, rng), residual=x, post_w=ones, eps=1e-6)
    down = _weight(_D, _FF, rng)
    for act in ("silu", "gelu"):
        x = be.matmul(_rand(rng, n, 2 * _FF), down, pre=act, residual=x)
    be.matmul(x, _weight(_D, _D, rng, q4=True))  # AVX2: Q8_0 above on float FMAs, Q4_0 on int8
    for big in (False, True):
        rows = max(ops.RMSNORM_PAR_MIN, ops.ELEMENTWISE_PAR_MIN, ops.ROPE_PAR_MIN) // _HD if big else 2
        a, b = _rand(rng, rows, _HD), _rand(rng, rows, _HD)
        be.rmsnorm(a, np.ones(_HD, np.float32), 1e-6)
        be.silu_mul(a, b)
        be.gelu_mul(a, b)
        be.add_(a, b)
        be.rope(a.reshape(rows, 1, _HD), np.arange(rows, dtype=np.int64), _ROPE)


def _block(be, rng) -> None:
    """A decode token through the fused block (kernels_cpu/block.py) over a filled ring, then
    a batch of two (one compiled block serves every batch size), then a token through a stack
    of blocks (a model's every block in one call)."""
    ones = np.ones(_D, np.float32)
    pack = be.decoder_block(
        attn_norm=ones, qkv=_weight((_H * _HD, _HKV * _HD, _HKV * _HD), _D, rng), qkv_bias=None, q_norm=None, k_norm=None,
        attn_output=_weight(_D, _H * _HD, rng), post_attn_norm=None, ffn_norm=ones,
        gate_up=_weight((_FF, _FF), _D, rng), act="silu", ffn_down=_weight(_D, _FF, rng), post_ffw_norm=None,
        n_head=_H, n_head_kv=_HKV, head_dim=_HD, eps=1e-6, scale=_HD ** -0.5, rope=_ROPE)
    kv = _layer()
    _attend(be, kv, rng, 0, 2)
    be.run_block(pack, _rand(rng, 1, _D), np.array([2], np.int64), kv)
    other = _layer()
    _attend(be, other, rng, 0, 2)
    be.run_block(pack, _rand(rng, 2, _D), np.array([3, 2], np.int64), BatchLayer((kv, other), (0, 1, 2)))
    cache = KVCache([16, 16], _HKV, _HD, n_sink=4, kind="int8")
    for lk in cache.layers:
        _attend(be, lk, rng, 0, 2)
    if not be.run_stack(be.decoder_stack([pack, pack]), _rand(rng, 1, _D), np.array([2], np.int64), cache):
        raise RuntimeError("warmup: the stacked decode step did not run")


_RUN = {"matvec": _matvec, "attention": _attention, "prefill": _prefill, "block": _block}


def run_group(name: str, be=None) -> None:
    """Compile (or load from the disk cache) one group's kernels by calling them."""
    if be is None:
        from .backends.cpu import CPUBackend

        be = CPUBackend(threads=1)  # a worker only compiles; one thread leaves the cores to the others
    _RUN[name](be, np.random.default_rng(0))


# -- cold or warm -----------------------------------------------------------------------------
def _cached(dispatcher) -> bool:
    """The disk cache holds a compiled version of this kernel for this CPU (numba internals,
    so any surprise reads as "no")."""
    try:
        magic = dispatcher.targetctx.codegen().magic_tuple()
        return any(key[1] == magic for key in dispatcher._cache._cache_file._load_index())
    except Exception:
        return False


def cold() -> bool:
    """Whether a chat would compile kernels now (some kernel is missing from the disk cache)."""
    import importlib

    for mod, name in KERNELS:
        d = getattr(importlib.import_module(f"edgekv.kernels_cpu.{mod}"), name, None)
        if d is None or not _cached(d):
            return True
    return False


@contextmanager
def _compiles():
    """Count numba's top-level compiles (a kernel found in the disk cache is no compile) in a list."""
    from numba.core import event

    done, depth = [], [0]

    class Listener(event.Listener):
        def on_start(self, ev):
            depth[0] += 1

        def on_end(self, ev):
            depth[0] -= 1
            if depth[0] == 0:
                done.append(ev.data.get("dispatcher"))

    listener = Listener()
    event.register("numba:compile", listener)
    try:
        yield done
    finally:
        event.unregister("numba:compile", listener)


# -- the workers and the bar ------------------------------------------------------------------
def _workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus, len(GROUPS))


class _Bar:
    """One line on stderr: what is being prepared and an estimate of how far along it is
    (redrawn in place on a terminal; elsewhere a line when the note changes)."""

    def __init__(self, enabled: bool):
        self.on, self.tty = enabled, enabled and sys.stderr.isatty()
        self.t0, self.width, self.note = time.perf_counter(), 0, None
        self.show(0.0, "starting")

    def show(self, fraction: float, note: str, end: str = "") -> None:
        if not self.on or not self.tty and note == self.note and not end:
            return
        self.note = note
        pct = int(100 * min(fraction, 1.0 if end else 0.99))
        line = (f"edgekv: first run, compiling kernels [{'#' * (pct // 10):<10}] {pct:3d}% {note}"
                f"{'' if end else ', '}{time.perf_counter() - self.t0:.0f} s")[: shutil.get_terminal_size().columns - 1]
        if self.tty:  # over the last line, padded to its width (no terminal codes needed)
            line, self.width = "\r" + line.ljust(self.width), len(line)
        sys.stderr.write(line + (end if self.tty else "\n"))
        sys.stderr.flush()

    def close(self, note: str) -> None:
        self.show(1.0, f"{note} in ", end="\n")


@contextmanager
def _no_sigint():
    """A Ctrl-C in the block is held back and raised at its end, once a started worker is on
    record to be killed (inside Popen it would leave the child unknown). Main thread only,
    where Python runs signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if old is None else old)
        if got:
            raise KeyboardInterrupt


def _worker_cmd(group: str) -> list[str]:
    """A worker's command line: this very edgekv package first on its path. `python -m
    edgekv.warmup` would put the working directory first, and `pip install . && edgekv chat`
    runs in the source tree, whose edgekv/ lacks kernels_cpu (package-dir maps it at install):
    every worker failed at import and the chat compiled everything itself, one group after
    another."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); "
            f"from edgekv.warmup import run_group; run_group({group!r})"]


def _compile_in_workers(bar: _Bar, n_workers: int) -> None:
    """Run GROUPS in child processes, n_workers at a time, a group once the groups it calls are done."""
    est = {g[0]: g[2] for g in GROUPS}
    waiting, running, done = list(GROUPS), {}, set()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        while waiting or running:
            for g in list(waiting):
                if len(running) < n_workers and all(d in done for d in g[3]):
                    waiting.remove(g)
                    with _no_sigint():  # a Ctrl-C inside Popen would leave its child unknown here
                        running[g[0]] = (subprocess.Popen(_worker_cmd(g[0]), env=env,
                                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                          stderr=subprocess.DEVNULL, start_new_session=True),
                                         time.perf_counter(), g[1])
            time.sleep(0.1)
            for name, (proc, _, _) in list(running.items()):
                if proc.poll() is not None:  # a failed worker only leaves its kernels to compile here
                    del running[name]
                    done.add(name)
            now = time.perf_counter()
            part = sum(est[n] for n in done) + sum(min(now - t, 0.9 * est[n]) for n, (_, t, _) in running.items())
            bar.show(part / sum(est.values()), "+".join(r[2] for r in running.values()))
    finally:
        for proc, _, _ in running.values():  # Ctrl-C or an error here: no orphan keeps compiling
            proc.kill()
            proc.wait()


_loaded = False  # this process has run the groups: every kernel is loaded


def prepare(llm=None, *, progress: bool = True, workers: int | None = None, force: bool = False,
            load: bool = True) -> int:
    """Compile every CPU kernel a chat calls unless numba's disk cache holds them all (or
    force), and load them into this process (once), so that no turn pauses to compile or to
    load one; with progress, a bar on stderr says when it compiles. load=False: on a warm cache
    leave loading to each kernel's first call (a one-shot run needs only some of them). llm:
    the chat's model, only to skip a GPU one (the CUDA backend compiles its own kernels).
    workers: processes compiling side by side (default: one per CPU, at most one per group; 1
    compiles here). Returns the kernels compiled in this process (0 when the cache was warm or
    the workers filled it)."""
    global _loaded
    from .backends.cpu import CPUBackend

    if llm is not None and not isinstance(llm.backend, CPUBackend):
        return 0
    warm = not (force or cold())
    if warm and (_loaded or not load):
        return 0
    be = llm.backend if llm is not None else CPUBackend(threads=None)
    n_workers = _workers() if workers is None else workers
    bar = _Bar(progress and not warm)  # numba reads each kernel's machine code on its first call: now
    if not warm and n_workers > 1:
        _compile_in_workers(bar, n_workers)
        bar.show(0.99, "loading")
    total = sum(g[2] for g in GROUPS)
    with _compiles() as compiled:
        for i, g in enumerate(GROUPS):
            if n_workers <= 1:
                bar.show(sum(x[2] for x in GROUPS[:i]) / total, g[1])
            run_group(g[0], be)  # after the workers: loads from the disk cache
    _loaded = True
    if not warm:
        bar.close("ready (cached)")
    return len(compiled)


if __name__ == "__main__":
    run_group(sys.argv[1])
