"""The CPU backend: the numba kernels of kernels_cpu/ behind the backend interface.

Weights stay as quantized GGUF blocks, never dequantized; in the memory map, except where a
layout of the same bytes is faster: with AVX-512 VNNI or AVX2, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K
matrices are repacked at load into 16 interleaved rows (qmatmul.pack; kernels_cpu/layouts.py),
into anonymous memory, their pages of the map released so that the process holds one copy (as
llama.cpp repacks Q4_0 online). That layout
decodes several tokens for little more than one (batched decode). EDGEKV_WEIGHTS=map keeps every
matrix in the map (it can be paged out and re-read under memory pressure; a copy cannot);
EDGEKV_WEIGHTS=copy copies every matrix to anonymous memory: decode read them 6-12% faster there
(7B Q4_0: 5.4-5.7 -> 6.0-6.3 tok/s on a 2-core Xeon VM).
"""
from __future__ import annotations

import contextlib
import operator
import os
import threading
import time
import weakref
from pathlib import Path

import ctypes
import mmap

import numpy as np

from ..gguf_file import Tensor
from ..kvcache import BatchLayer, KVCache, LayerKV, Plan
from ..rope import Rope
from .attention import AttentionStep
from .threads import RUNNING, ThreadTuner

_NONE1 = np.empty(0, np.float32)  # qmatmul.run's unused pre_w / post_w
_NONE2 = np.empty((0, 0), np.float32)  # and residual


def _type_key(state: tuple):
    """What numba's dispatch finds an argument's compiled types by (equal keys: one numba type),
    ~0.5 us for a cache's pack where numba.typeof takes ~190 us (~6 ms a new cache of 30
    layers, at its first decode token); the type itself where that key cannot be had."""
    try:
        from numba._dispatcher import compute_fingerprint

        return compute_fingerprint(state)
    except (ImportError, ValueError, TypeError):  # numba's private name moved, or a value it cannot key
        from numba import typeof

        return typeof(state)


_WRITTEN, _STATE = operator.attrgetter("n_written"), operator.attrgetter("backend_state")  # of LayerKVs, in C
_GROUPS = 256  # batches' typed lists of caches kept (CPUBackend._group): a layer each, so ~8 batches of 30 layers


def _release(raw: np.ndarray) -> None:
    """Give back the process's pages of a read-only file map under raw (the whole pages inside it;
    the file's page cache stays): MADV_DONTNEED, Linux. Elsewhere nothing."""
    if not hasattr(mmap, "MADV_DONTNEED") or not os.path.exists("/proc/self/maps"):
        return
    start, end = raw.ctypes.data, raw.ctypes.data + raw.nbytes
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks for reuse instead of handing them back to the
    kernel: a prefill chunk frees and allocates activation arrays of tens of MB every layer, and
    each one given back is faulted in again at its next first touch (up to ~4 ms a MB on a VM:
    the gated activation took 70-130 ms into a fresh array every other layer, 1-3 ms into a
    kept one; 7B Q4_K_M 512-token forwards 1.12-1.16x faster, bench/RESULTS.md). Blocks up to 32
    MiB come from the heap, which is trimmed only above 1 GiB free at its top. The process keeps
    its peak activation memory resident (it is the peak either way). Skipped where any MALLOC_*
    variable is set (the user's choice) or there is no glibc mallopt. True if applied."""
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 1 << 30)  # (C ints)
                and mallopt(m_top_pad, 256 << 20))


class _Arena:
    """Anonymous memory for the weights the backend repacks or copies: 64-byte-aligned pieces
    side by side in chunks, from 2 MiB on mapped on transparent huge pages (madvise
    MADV_HUGEPAGE; Linux). numpy asks for huge pages itself for an array of 4 MiB or more, so a
    7B's matrices had them already; a small model's are smaller (SmolLM2's 0.2-1.8 MB) and were
    on 4 KiB pages, a TLB miss every 4 KiB. SmolLM2's batched decode steps, 4 / 8 sequences:
    -0.3-0.6 / -0.6-1.2 ms; one: -0.15-0.3 (bench/RESULTS.md). A new chunk is as large as what
    the arena holds already (up to CHUNK), so a tiny model reserves little address space; a chunk
    is unmapped when its last array goes, and its unused tail is never touched."""

    CHUNK = 64 << 20
    HUGE = 2 << 20

    def __init__(self):
        self.huge = hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage")
        self.buf, self.at, self.total = np.empty(0, np.uint8), 0, 0  # the chunk, its next free byte; bytes handed out

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        """An empty uint8 array of this shape, 64-byte aligned (qmatmul.pack's alloc)."""
        n = shape[0] * shape[1]
        if self.at + n > self.buf.shape[0]:
            self._chunk(max(n, min(self.CHUNK, self.total)))
        out = self.buf[self.at : self.at + n].reshape(shape)
        self.at += -(-n // 64) * 64
        self.total += n
        return out

    def _chunk(self, size: int) -> None:
        if self.huge and size >= self.HUGE:
            size = -(-size // self.HUGE) * self.HUGE + self.HUGE  # whole huge pages from an aligned start
            try:
                m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                m.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: huge pages from the start
                self.buf = np.frombuffer(m, np.uint8)  # the arrays keep the map alive
                self.at = -self.buf.ctypes.data % self.HUGE
                return
            except OSError:  # no address space for it (a limit): as numpy allocates, which says MemoryError
                pass
        self.buf = np.empty(size + 64, np.uint8)
        self.at = -self.buf.ctypes.data % 64


def _resident(raw: np.ndarray, arena: _Arena) -> np.ndarray:
    """A read-only copy of a weight's blocks in anonymous memory, its pages of the map given back."""
    out = arena.take(raw.shape)  # uint8 (rows, row bytes), as every tensor's raw blocks
    np.copyto(out, raw)
    out.flags.writeable = False
    _release(raw)
    return out


def physical_cores() -> int:
    """Cores, not hyper-threads: matvecs are memory-bound and a second thread per core only adds contention."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    seen = set()
    for c in cpus:
        p = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            seen.add(p.read_text().strip())
        except OSError:
            seen.add(str(c))
    return max(1, len(seen))


def _init_numba(threads: int | None) -> int:
    """Choose numba's threading layer (before its first parallel call); the most threads to use."""
    import numba

    # workqueue (numba's fallback) is not safe when several Python threads call parallel
    # kernels at once (sessions generating side by side); OpenMP and TBB are.
    if numba.config.THREADING_LAYER == "default":
        try:
            from numba.np.ufunc import omppool  # noqa: F401
            numba.config.THREADING_LAYER = "omp"
        except ImportError:
            try:
                from numba.np.ufunc import tbbpool  # noqa: F401
                numba.config.THREADING_LAYER = "tbb"
            except ImportError:
                pass
    n = max(1, min(threads or physical_cores(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


_GOMP: list = []  # libgomp's omp_pause_resource_all once looked up ([None]: not loaded)


def release_pool() -> None:
    """Free the calling thread's OpenMP thread pool (its workers exit; its next parallel kernel
    makes a new pool, ~0.1 ms). libgomp lets idle workers spin only while it manages no more
    threads than there are CPUs; with the pools of two threads alive (the one that loaded the
    model, a server's request thread, another leader of the scheduler's passes) each parallel
    region wakes its workers through the kernel: decode kernels ran 1.5-2x slower called from a
    second thread (bench/RESULTS.md). So a thread that is done with kernels for now gives its
    pool back. Only where numba runs on GNU OpenMP; elsewhere nothing."""
    if not _GOMP:
        import numba

        try:
            layer = numba.threading_layer()
        except ValueError:  # no parallel kernel has run yet: no pool to give back
            return
        fn = None
        if layer == "omp":
            try:
                with open("/proc/self/maps") as f:
                    path = next((ln.split()[-1] for ln in f if "libgomp" in ln and ln.split()[-1].startswith("/")), None)
                if path:
                    fn = ctypes.CDLL(path).omp_pause_resource_all
                    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            except (OSError, AttributeError):  # no maps, or a libgomp older than OpenMP 5.0's pause
                fn = None
        _GOMP.append(fn)
    if _GOMP[0] is not None:
        _GOMP[0](1)  # omp_pause_soft: this thread's pool only; a no-op inside a parallel region


# numba's workqueue threading layer (used when neither OpenMP nor TBB is installed) aborts the
# process when two Python threads launch parallel kernels at once: forward passes then take turns
# (CPUBackend.serial, held by generate.Sequence), in every backend of the process.
_WORKQUEUE_LOCK = threading.Lock()


class _Step:
    __slots__ = ("tuner", "n", "tokens", "t0", "tid")

    def __init__(self, tuner: ThreadTuner | None, n: int, tokens: int):
        self.tuner, self.n, self.tokens = tuner, n, tokens

    def __enter__(self):
        import numba

        n = self.tuner.begin() if self.tuner is not None else self.n
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)
        self.tid = threading.get_native_id()
        RUNNING[self.tid] = n
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc, *_):
        dt = time.perf_counter() - self.t0
        RUNNING.pop(self.tid, None)
        if self.tuner is not None and exc is None:
            self.tuner.end(dt, self.tokens)


def _threads() -> int | None:
    """The calling thread's numba count inside a forward pass (its _Step set it), else None."""
    return RUNNING.get(threading.get_native_id())


class CPUBackend(AttentionStep):
    name = "cpu"

    def __init__(self, threads: int | None = None):
        from ..kernels_cpu import block, evict, kvquant, ops, qmatmul

        import numba

        self.threads = _init_numba(threads)  # the most threads a forward pass uses
        keep_freed_memory()  # process-wide, idempotent: prefill's activation arrays stay mapped
        workqueue = numba.config.THREADING_LAYER in ("default", "workqueue")  # "default": no OpenMP, no TBB
        self.serial = _WORKQUEUE_LOCK if workqueue else contextlib.nullcontext()
        self.auto_threads = threads is None  # None: fewer while other programs keep cores busy
        self._local = threading.local()  # numba's thread count belongs to the calling thread
        self.ops, self.qm, self.kvq, self.blk, self.ev_kernels = ops, qmatmul, kvquant, block, evict
        self._groups: dict = {}  # tuple of LayerKV ids -> (their packs, typed list, weak refs): _group
        self._stacks: dict = {}  # the same for the layers of a cache (run_stack)
        self._ats: tuple = (None, None)  # the last batch's plans and their (n, 5) array (run_block)
        self.batch_rows = qmatmul.SMALL_N  # the decode kernel's rows: each computed as if alone (LLM.forward_batch)
        mode = os.environ.get("EDGEKV_WEIGHTS", "auto")
        if mode not in ("auto", "map", "copy"):
            from ..errors import EdgekvError
            raise EdgekvError(f"EDGEKV_WEIGHTS must be auto, map or copy, not {mode!r}")
        self.copy_weights = mode == "copy"
        self.arena = _Arena()  # where repacked and copied weights live
        self.repack = mode != "map"  # Q4_0/Q4_1/Q8_0/Q4_K/Q6_K in the decode kernels' interleaved layout (qmatmul.pack)

    # -- threads ---------------------------------------------------------------------
    def step(self, tokens: int) -> "_Step":
        """A context for one forward pass of `tokens` tokens in the calling thread: it runs with
        this thread's tuned count (backends.threads), and its time teaches the tuner."""
        tuner = getattr(self._local, "tuner", None)
        if tuner is None:
            tuner = self._local.tuner = ThreadTuner(self.threads) if self.auto_threads else None
        return _Step(tuner, self.threads, tokens)

    @property
    def current_threads(self) -> int:
        """The count this thread's forward passes use now."""
        tuner = getattr(self._local, "tuner", None)
        return tuner.n if tuner is not None else self.threads

    # -- weights ---------------------------------------------------------------------
    def release_threads(self) -> None:
        """The calling thread is done with kernels for now: its OpenMP pool goes (release_pool)."""
        release_pool()

    def prepare(self, t: Tensor):
        """The weight's memory-mapped blocks (or their copy: EDGEKV_WEIGHTS=copy), checked once
        here (qmatmul.QWeight) so that the per-token calls skip the checks."""
        return self._weight([t])

    def _weight(self, ts: list[Tensor]):
        """Tensors of one type on one input as one QWeight: repacked for this machine's decode
        kernels where that is faster (qmatmul.pack), else their blocks in the map (or copied:
        EDGEKV_WEIGHTS=copy). A repacked or copied tensor's pages of the map are given back: the
        process holds one copy."""
        qtype = ts[0].qtype
        if self.repack and self.qm.packable(qtype, [t.raw.shape for t in ts]):
            out = self.qm.pack(self.qm.QWeight(tuple(t.raw for t in ts), qtype), self.arena.take)
            for t in ts:
                _release(t.raw)
            return out
        return self.qm.QWeight(tuple(_resident(t.raw, self.arena) if self.copy_weights else t.raw for t in ts), qtype)

    def fuse(self, ts: list[Tensor]):
        """Same-type matrices on one input (QKV, gate+up) go to qmatmul as one tuple: one
        parallel region, outputs side by side, the weights not copied to fuse them.
        Mixed types (gemma3's Q5_0 q/k beside a Q8_0 v) are runs of same-type weights, written
        side by side into one output."""
        parts: list[list[Tensor]] = []
        for t in ts:
            if parts and parts[-1][-1].qtype == t.qtype and len(parts[-1]) < 3:
                parts[-1].append(t)
            else:
                parts.append([t])
        runs = tuple(self._weight(g) for g in parts)
        return runs[0] if len(runs) == 1 else runs

    def decoder_block(self, *, rope: Rope, **parts):
        """A whole block packed for run_block (kernels_cpu.block: one call per decode token)."""
        return self.blk.block_pack(rope_freqs=rope.freqs, rope_neox=rope.neox, rope_mag=rope.attn_factor, **parts)

    def run_block(self, pack, x: np.ndarray, pos: np.ndarray, kv) -> bool:
        """One token through a block in place of the model's op-by-op code, or one token of each
        sequence of a batch (kv a BatchLayer: batched decode, the weights read once for all);
        False (nothing done) for a prompt, or an empty cache (an int ring calibrates on its
        first batch)."""
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            return False
        if not isinstance(kv, BatchLayer):  # one token, the solo decode step: no lists on its hot path
            if pos.shape[0] != 1 or not kv.n_written:
                return False
            plan = kv.plan(pos)  # a plan may resize (lend): then pack
            if kv.evictor is not None:  # its hooks run in place and commit
                kv.place(plan)
            at = np.array((plan.one_token + (plan.shift,),), np.int64)
            self.blk.decode_block(pack, x, pos, self._layer(kv)[2], at, _threads())
            if kv.evictor is not None:
                kv.commit(plan)
            else:  # the kernel wrote the positions
                kv.stored(plan)
            return True
        layers = kv.layers
        if pos.shape[0] != len(layers) or not all(map(_WRITTEN, layers)):
            return False
        plans = kv.plans  # made before the step (no eviction policy), the same tuple for alike layers
        if plans is None:
            plans = [lk.plan(pos[j : j + 1]) for j, lk in enumerate(layers)]  # a plan may resize (lend): then pack
            for lk, plan in zip(layers, plans):
                lk.place(plan)
        last = self._ats  # one read: another thread may set it meanwhile
        if last[0] is not plans:
            last = self._ats = plans, np.array([plan.one_token + (plan.shift,) for plan in plans], np.int64)
        ats = last[1]
        group = self._group(layers)
        if group is not None:
            self.blk.decode_block(pack, x, pos, group, ats, _threads())
        else:  # never seen: each token alone, the weights read once per sequence
            for j, lk in enumerate(layers):
                self.blk.decode_block(pack, x[j : j + 1], pos[j : j + 1], self._layer(lk)[2], ats[j : j + 1],
                                      _threads())
        advance = LayerKV.commit if kv.plans is None else LayerKV.stored  # stored: the kernel wrote the positions
        for lk, plan in zip(layers, plans):
            advance(lk, plan)
        return True

    def decoder_stack(self, blocks: list):
        """A model's blocks (decoder_block's, first to last) packed for run_stack; None where a
        block is absent or their packs type apart (a typed list holds one numba type)."""
        if not blocks or any(b is None for b in blocks) or len({_type_key(b) for b in blocks}) != 1:
            return None
        return self.blk.cache_list(blocks)

    def run_stack(self, stack, x: np.ndarray, pos: np.ndarray, cache) -> bool:
        """One token through every block of a model (decoder_stack's) in one call: what run_block
        does layer after layer, the same bits, with the Python of all layers before and after
        the kernels (block.decode_stack says why). False (nothing done) where it cannot: a prompt,
        a batch, an empty cache, an eviction policy (its hooks run in each layer's turn)."""
        if (stack is None or not isinstance(cache, KVCache) or pos.shape[0] != 1 or x.dtype != np.float32
                or not x.flags.c_contiguous):
            return False
        layers = cache.layers
        if not all(map(_WRITTEN, layers)) or cache.evict != "window":
            return False
        lists = self._group(layers, stacked=True)
        if lists is None:
            return False
        plans = cache.decode_plans(pos)  # the window policy's: plain arithmetic, nothing changes
        ats = np.array([(p.one_token + (p.shift,),) for p in plans], np.int64)  # (n_layer, 1, 5)
        self.blk.decode_stack(stack, x, pos, lists, ats, _threads())
        for lk, plan in zip(layers, plans):  # the kernel wrote the positions
            lk.stored(plan)
        return True

    def _layer(self, kv: LayerKV) -> tuple:
        """The cache's arrays packed for the one-call decode kernels (kvquant.kv_decode_layer), a
        key of their numba type (two packs with equal keys type alike) and the pack alone in a
        typed list (block.decode_block's), once per cache."""
        if kv.backend_state is None:
            state = self.kvq.kv_decode_layer(kv.kind, kv.k, kv.k_scale, kv.v, kv.v_scale, kv.pos, kv.n_sink, kv.span,
                                             kv.rk, kv.rv, kv.rpos, kv.recent, kv.first, kv.mu, kv.kmul,
                                             None if kv.evictor is None else kv.evictor.kernel)
            kv.backend_state = state, _type_key(state), self.blk.cache_list([state])
        return kv.backend_state

    def _group(self, layers, stacked: bool = False):
        """One layer of a batch's caches as the typed list block.decode_block takes, kept while
        the same caches decode together (continuous batching's usual step): made anew it costs
        ~10 us, a step's whole Python per layer. stacked: a cache's layers instead, as the typed
        list of their own lists that block.decode_stack takes, kept for the cache's life. None
        where their packs type differently (the kernel takes one numba type; every kind's packs
        type alike). An entry goes when one of its layers is collected or its pack changed (a
        resize, a load); at most _GROUPS entries are kept, so that packs of caches no batch uses
        any more are not held for long."""
        groups, key = self._stacks if stacked else self._groups, tuple(map(id, layers))
        got = groups.get(key)
        if got is not None and all(map(operator.is_, got[0], map(_STATE, layers))):
            return got[1]
        states = [self._layer(lk) for lk in layers]
        if any(s[1] != states[0][1] for s in states):
            return None
        if len(groups) >= _GROUPS:
            groups.clear()
        out = self.blk.cache_list([s[2] if stacked else s[0] for s in states])
        drop = lambda _ref, groups=groups, key=key: groups.pop(key, None)  # noqa: E731
        groups[key] = (tuple(states), out, [weakref.ref(lk, drop) for lk in layers])
        return out

    # -- ops -------------------------------------------------------------------------
    # The decode step calls these ~5 times a layer; they go straight to the jitted cores (the
    # kernels' checking wrappers cost more than a small kernel), so they trust the model's shapes.
    def matmul(self, x: np.ndarray, w, *, pre: str | None = None, pre_w: np.ndarray | None = None,
               eps: float = 1e-6, residual: np.ndarray | None = None, post_w: np.ndarray | None = None) -> np.ndarray:
        qm = self.qm
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        code, pw = qm.PRE[pre], _NONE1 if pre_w is None else pre_w
        if isinstance(w, qm.QWeight):
            out = np.empty((x.shape[0], w.m), np.float32)
            res = _NONE2 if residual is None else residual
            if x.shape[0] == 1:  # decode: straight to the kernel (qmatmul.run without its branches)
                qm._qmatvec(x, w.ws, w.qtype, out, 0, code, pw, eps, res, _NONE1 if post_w is None else post_w)
                return out if residual is None else residual
            return qm.run(w, x, out, 0, code, pw, eps, res, _NONE1 if post_w is None else post_w)
        out, col = np.empty((x.shape[0], sum(p.m for p in w)), np.float32), 0
        for p in w:  # same-type runs side by side in one output
            qm.run(p, x, out, col, code, pw, eps, _NONE2, _NONE1)
            col += p.m
        if residual is None:
            return out
        return self.add_(residual, out if post_w is None else self.rmsnorm(out, post_w, eps))

    def embed(self, w, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), w.k), np.float32)
        return self.qm.dequantize_rows(w.ws[0], w.qtype, np.asarray(ids, dtype=np.int64), out)

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        return self.ops.rmsnorm(np.ascontiguousarray(x), w, eps)

    def rope(self, x: np.ndarray, pos: np.ndarray, rope: Rope, heads: int | None = None) -> np.ndarray:
        return self.ops.rotate(np.ascontiguousarray(x), pos, rope.freqs, rope.neox, heads, rope.attn_factor)

    def silu_mul(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        return self.ops.silu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u))

    def gelu_mul(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        return self.ops.gelu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u))

    def add_(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.ops.add_(a, np.ascontiguousarray(b))

    # -- the attention step's primitives (backends/attention.py) -----------------------
    # The kernels run unchecked (check=False): the cache made every ring array, the model every
    # activation; at one token the checks and numpy glue used to cost more than the attention.
    def decode(self, kv: LayerKV, plan: Plan, q, q_pos, k, v, scale: float, rope: Rope, softcap: float):
        q = np.ascontiguousarray(q)
        return self.kvq.kv_decode(self._layer(kv)[0], q, np.ascontiguousarray(k, dtype=np.float32),
                                  np.ascontiguousarray(v, dtype=np.float32), q_pos, plan.one_token,
                                  (rope.freqs, rope.neox, plan.shift), scale, np.empty_like(q), softcap, _threads())

    def inputs(self, q, k, v):
        return (np.ascontiguousarray(q), np.ascontiguousarray(k, dtype=np.float32),
                np.ascontiguousarray(v, dtype=np.float32))

    def host(self, x: np.ndarray) -> np.ndarray:
        return x

    def sink_query(self, q: np.ndarray, shifts: np.ndarray, rope: Rope) -> np.ndarray:
        return self.ops.rotate(q.copy(), -shifts, rope.freqs, rope.neox)  # q has its magnitude

    def sink_bias(self, kv: LayerKV, q: np.ndarray, q_sink: np.ndarray) -> np.ndarray:
        return kv.sink_bias(q, q_sink)

    def key_space(self, kv: LayerKV, q, q_sink, k):
        kq = self.kvq
        if q_sink is not None:
            qmul = np.repeat(kv.kmul, q.shape[1] // kv.kmul.shape[0], axis=0)  # (H, hd)
            q_sink = kq.hadamard_(q_sink / qmul)
        q, k = kq.kv_space(q, k, kv.mu, kv.kmul)
        return q, q_sink, k

    def store(self, kv: LayerKV, plan: Plan, k: np.ndarray, v: np.ndarray) -> None:
        rows, slots = plan.writers
        if len(rows) != plan.n:  # the batch wraps the ring: only each slot's last writer lands
            k, v = np.ascontiguousarray(k[rows]), np.ascontiguousarray(v[rows])
        pack = self._layer(kv)[0]  # its ring views, made once per cache
        self.kvq.kv_store(kv.kind, k, kv.k, kv.k_scale, slots, False, check=False, ring=pack[1])
        self.kvq.kv_store(kv.kind, v, kv.v, kv.v_scale, slots, False, check=False, ring=pack[2])

    def attend(self, kv: LayerKV, plan: Plan, q, q_sink, q_pos, k, v, sink_bias, scale: float, softcap: float):
        # the batch's exact keys: all of them while not stored yet, else for the recent rule
        if not plan.store_first or kv.recent > 0:
            fk, fv, fpos = k, v, q_pos
        else:
            fk = fv = np.zeros((0,) + k.shape[1:], np.float32)
            fpos = q_pos[:0]
        ev = kv.evictor  # an eviction policy: the last queries' scores, kept by the kernel
        sc = None if ev is None else ev.scores_for(plan, q.shape[1], len(fpos))
        out = self.kvq.kv_attention(
            kv.kind, q, q if q_sink is None else q_sink, q_pos, kv.k, kv.k_scale, kv.v, kv.v_scale,
            kv.pos[: plan.n_ring], kv.n_sink, fk, fv, fpos, scale, kv.span, False, np.empty_like(q), recent_k=kv.rk,
            recent_v=kv.rv, recent_pos=kv.rpos, recent=kv.recent, exact_lo=plan.exact_lo, first=kv.first,
            fresh_all=not plan.store_first, sink_bias=self.kvq.NO_SINK_BIAS if sink_bias is None else sink_bias,
            softcap=softcap, scores=sc, check=False, rings=self._layer(kv)[0][1:3])
        if ev is not None:  # the batch is stored first under a policy: every row has its slot
            fslot = plan.writers[1] if len(fpos) else fpos
            self.ev_kernels.score_update(sc, kv.pos[: plan.n_ring], len(ev.rslot), ev.rslot, fslot, *ev.target(plan))
        return out

    def store_exact(self, kv: LayerKV, plan: Plan, k: np.ndarray, v: np.ndarray) -> None:
        rows, dst = plan.exact
        kv.rk[dst], kv.rv[dst] = k[rows], v[rows]
