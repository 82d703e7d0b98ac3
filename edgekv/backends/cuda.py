"""The CUDA backend: the numba.cuda kernels of kernels_gpu/ behind the backend interface, with
partial offload (the first `gpu_layers` blocks on the GPU, the rest on the CPU backend).

Where things live:
- Weights: copied to the device once, at prepare/fuse, still in their GGUF blocks (same-type
  fused weights stacked into one device array, so QKV is one launch).
- Activations: `DeviceArray`, a numba device array with the few numpy-like operations the
  model files use (column slices, reshape, `+=` a bias, `*=` a scalar).
- KV rings: a device copy of each LayerKV's arrays, made at its first attention: the ring, the
  exact first/recent copies (rk, rv, rpos) and, for int kinds, the key offset mu and channel
  weights kmul. The host LayerKV stays the bookkeeper (positions, write cursor, trim, reset,
  rpos, and mu/kmul: `LayerKV.calibrate` runs on the host on a copy of the first batch's q and
  k, once per sequence, and the result goes up); the device keeps its own copies of `pos` and
  `rpos`, updated by kernels from the cache's plan, and re-uploaded only when the host's changed
  otherwise (trim, reset, calibrate, load: `LayerKV.epoch`). `sync_to_host` copies the rings and
  exact copies back (saving a session).
- Host crossings per decode step: the token id and position in; slot indices of the ring and
  of the exact slots (small uploads, shared by all layers of one ring size); the logits out.
  The interface hands the sampler host logits, so the vocabulary projection (the GGUF's
  output.weight, or token_embd.weight when tied) is the one matmul whose result is copied
  back. Once per sequence an int cache's first batch of q and k goes down for `calibrate`.
Nothing here is imported unless a CUDA device is asked for.
"""
from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import numpy as np

from ..errors import DeviceError, UnsupportedModelError
from ..gguf_file import Tensor
from ..kvcache import LayerKV, Plan
from ..rope import Rope
from .attention import AttentionStep

_VOCAB_OUT = ("output.weight", "token_embd.weight")  # matmuls whose result goes back as host logits
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def cuda_unusable() -> str | None:
    """None when numba.cuda can run kernels here (a GPU, or the simulator), else why not, in one line."""
    try:
        from numba import cuda
    except ImportError as e:  # a numba without its built-in CUDA target and no numba-cuda
        return f"numba's CUDA target is not installed (pip install 'edgekv[cuda]'): {e}"
    if cuda.is_available():
        return None
    try:
        cuda.current_context()
    except Exception as e:  # noqa: BLE001 (the driver's own words are the reason)
        return " ".join(str(e).split()).rstrip(" :")[:300] or type(e).__name__
    return "numba.cuda reports no usable GPU"


class DeviceArray:
    """A float32 device array, with the numpy operations the model files apply to activations."""

    __slots__ = ("dev",)

    def __init__(self, dev):
        self.dev = dev

    shape = property(lambda self: tuple(self.dev.shape))
    ndim = property(lambda self: self.dev.ndim)
    dtype = property(lambda self: self.dev.dtype)
    size = property(lambda self: self.dev.size)

    def __len__(self) -> int:
        return self.dev.shape[0]

    def __getitem__(self, idx) -> "DeviceArray":
        return DeviceArray(self.dev[idx])  # a view (strided for column slices)

    def contiguous(self):
        from ..kernels_gpu.ops import contiguous

        return contiguous(self.dev)

    def reshape(self, *shape) -> "DeviceArray":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(self.size // max(known, 1) if s == -1 else s for s in shape)
        return DeviceArray(self.contiguous().reshape(*shape))  # a column slice is copied first, as numpy would

    def __iadd__(self, other) -> "DeviceArray":
        from ..kernels_gpu import ops

        b = _as_device(other)
        if tuple(b.shape) == self.shape:
            ops.add_(self.dev, _contig(b))
        elif b.ndim == 1 and self.ndim == 2:
            ops.add_rows_(self.dev, _contig(b))  # a bias on every row
        else:
            raise ValueError(f"DeviceArray +=: shapes {self.shape} and {tuple(b.shape)}")
        return self

    def __imul__(self, s) -> "DeviceArray":
        from ..kernels_gpu import ops

        if np.ndim(s) != 0:
            raise ValueError("DeviceArray *=: only a scalar")
        ops.scale_(self.dev, float(s))
        return self

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        h = self.dev.copy_to_host()
        return h if dtype is None else h.astype(dtype)

    def copy_to_host(self) -> np.ndarray:
        return self.dev.copy_to_host()


_consts: dict[int, tuple] = {}  # id(host array) -> (weakref to it, its device copy): model constants


def _as_device(a):
    """The device array for a DeviceArray, a device array, or a host array (a model constant such
    as a norm weight or a bias: uploaded once and kept, keyed by identity)."""
    if isinstance(a, DeviceArray):
        return a.dev
    if not isinstance(a, np.ndarray):
        return a
    hit = _consts.get(id(a))
    if hit is None or hit[0]() is not a:
        from numba import cuda

        hit = (weakref.ref(a), cuda.to_device(np.ascontiguousarray(a, dtype=np.float32)))
        _consts[id(a)] = hit
        weakref.finalize(a, _consts.pop, id(a), None)  # the device copy goes with the host array
    return hit[1]


def _contig(d):
    from ..kernels_gpu.ops import contiguous

    return contiguous(d)


def _dcopy(d):
    from numba import cuda

    out = cuda.device_array(d.shape, d.dtype)
    out.copy_to_device(d)
    return out


@dataclass
class GPUWeight:
    parts: tuple  # ((kernels_gpu.qmatmul.DeviceWeight, first output column), ...)
    n_out: int
    n_in: int
    host_out: bool  # the vocabulary projection: results go back to the host as logits


class _Placed:
    """token_embd / output: placed at first use, when every block has been prepared (they go to
    the GPU only when all blocks do, as llama.cpp's -ngl puts the output layer last)."""

    def __init__(self, tensors: list[Tensor]):
        self.tensors, self.handle = tensors, None


@dataclass
class _Ring:
    """Device copy of one LayerKV: K and V as kernels_gpu.kvquant (h, b, s) triples, pos, the
    exact copies (rk, rv half bits, rpos), mu and kmul, and the host's epoch they last agreed with."""
    K: tuple
    V: tuple
    k: object
    v: object
    ks: object
    vs: object
    pos: object
    rk: object  # uint16 (first + recent, Hkv, hd)
    rv: object
    rpos: object  # int64 (first + recent,)
    mu: object  # float32 (Hkv, hd)
    kmul: object
    epoch: int
    owner: object
    host: object  # the host ring array it was made from (a fork or an adopt gives the LayerKV new ones)


class CUDABackend(AttentionStep):
    name = "cuda"

    def __init__(self, threads: int | None = None, gpu_layers: int | None = None):
        reason = cuda_unusable()
        if reason:
            raise DeviceError(f"device 'cuda' is not usable: {reason}")
        if gpu_layers is not None and gpu_layers < 0:
            raise DeviceError(f"gpu_layers must be >= 0, got {gpu_layers}")
        from numba import cuda

        from ..kernels_gpu import kvquant, launch, ops, qmatmul

        launch.quiet_small_grids()
        self.cuda, self.ops, self.qm, self.kvq = cuda, ops, qmatmul, kvquant
        self.threads, self.gpu_layers = threads, gpu_layers
        self._cpu = None
        self._n_blocks = 0
        self._ints_cache: dict[bytes, object] = {}
        self._inv_freq: dict[tuple, object] = {}
        self.weight_bytes = 0  # weights on the device so far

    @property
    def cpu(self):
        """The CPU backend for the layers left on the CPU (made on first need)."""
        if self._cpu is None:
            from .cpu import CPUBackend

            self._cpu = CPUBackend(self.threads)
        return self._cpu

    # -- weights ---------------------------------------------------------------------
    def _upload(self, ts: list[Tensor]) -> GPUWeight:
        parts, col, groups = [], 0, []
        for t in ts:  # runs of one type become one stacked device weight
            if groups and groups[-1][-1].qtype == t.qtype:
                groups[-1].append(t)
            else:
                groups.append([t])
        for g in groups:
            if g[0].qtype not in self.qm.SUPPORTED:  # refused naming the tensor, as the file's types are
                raise UnsupportedModelError(f"tensor {g[0].name} has type {g[0].type_name}, which edgekv's GPU "
                                            f"kernels do not support (device cpu, or gpu_layers, keeps it on the CPU)")
            w = self.qm.upload([t.raw for t in g], g[0].qtype)
            parts.append((w, col))
            col += w.n_out
            self.weight_bytes += w.nbytes
        return GPUWeight(tuple(parts), col, parts[0][0].n_in, len(ts) == 1 and ts[0].name in _VOCAB_OUT)

    def _block_on_gpu(self, name: str) -> bool | None:
        m = _BLOCK.match(name)
        if m is None:
            return None
        i = int(m.group(1))
        self._n_blocks = max(self._n_blocks, i + 1)
        return self.gpu_layers is None or i < self.gpu_layers

    def prepare(self, t: Tensor):
        on = self._block_on_gpu(t.name)
        if on is None:
            return _Placed([t])
        return self._upload([t]) if on else self.cpu.prepare(t)

    def fuse(self, ts: list[Tensor]):
        on = self._block_on_gpu(ts[0].name)
        if on is None:
            return _Placed(list(ts))
        return self._upload(list(ts)) if on else self.cpu.fuse(ts)

    def decoder_block(self, **parts) -> None:
        """No fused block here: blocks run op by op (weights may be on either device)."""
        return None

    def run_block(self, pack, x, pos, kv) -> bool:
        return False

    def decoder_stack(self, blocks) -> None:
        return None

    def run_stack(self, stack, x, pos, cache) -> bool:
        return False

    def _w(self, w):
        if isinstance(w, _Placed):
            if w.handle is None:
                all_gpu = self.gpu_layers is None or self.gpu_layers >= self._n_blocks
                if all_gpu:
                    w.handle = self._upload(w.tensors)
                else:
                    w.handle = self.cpu.prepare(w.tensors[0]) if len(w.tensors) == 1 else self.cpu.fuse(w.tensors)
            return w.handle
        return w

    # -- where an activation lives -------------------------------------------------------
    def _dev(self, x):
        """x as a C-contiguous device array (host arrays are uploaded)."""
        if isinstance(x, DeviceArray):
            return x.contiguous()
        return self.cuda.to_device(np.ascontiguousarray(x, dtype=np.float32))

    @staticmethod
    def _host(x) -> np.ndarray:
        return x.copy_to_host() if isinstance(x, DeviceArray) else x

    def _ints(self, a: np.ndarray):
        """A small int64 host array on the device, cached by content: positions and slots repeat
        across the layers of a step, so each crosses once."""
        a = np.ascontiguousarray(a, dtype=np.int64)
        key = a.tobytes()
        d = self._ints_cache.get(key)
        if d is None:
            if len(self._ints_cache) >= 64:
                self._ints_cache.pop(next(iter(self._ints_cache)))
            d = self._ints_cache[key] = self.cuda.to_device(a)
        return d

    # -- ops -------------------------------------------------------------------------
    def matmul(self, x, w, *, pre: str | None = None, pre_w: np.ndarray | None = None, eps: float = 1e-6,
               residual=None, post_w: np.ndarray | None = None):
        """The interface's composite matmul from the primitive kernels: pre(x) @ W.T, then
        residual += y (rmsnorm(y) * post_w when given). Host inputs of a GPU weight go up; a CPU
        weight (partial offload) gets host inputs and runs the whole op on the CPU."""
        w = self._w(w)
        if not isinstance(w, GPUWeight):
            return self.cpu.matmul(self._host(x), w, pre=pre, pre_w=pre_w, eps=eps,
                                   residual=None if residual is None else self._host(residual), post_w=post_w)
        if pre == "norm":
            x = self.rmsnorm(self._as_dev_array(x), pre_w, eps)
        elif pre is not None:  # x (n, 2k): gate and up side by side
            x = self._as_dev_array(x)
            k = x.shape[1] // 2
            x = {"silu": self.silu_mul, "gelu": self.gelu_mul}[pre](x[:, :k], x[:, k:])
        xd = self._dev(x)
        out = self.cuda.device_array((xd.shape[0], w.n_out), np.float32)
        for part, col in w.parts:
            self.qm.qmatmul(xd, part, out, col)
        if w.host_out and residual is None:
            return out.copy_to_host()  # the logits: the one result the host needs
        y = DeviceArray(out)
        if residual is None:
            return y
        return self.add_(residual, y if post_w is None else self.rmsnorm(y, post_w, eps))

    def _as_dev_array(self, x) -> DeviceArray:
        return x if isinstance(x, DeviceArray) else DeviceArray(self._dev(x))

    def embed(self, w, ids: np.ndarray):
        w = self._w(w)
        if not isinstance(w, GPUWeight):
            return self.cpu.embed(w, ids)
        part = w.parts[0][0]
        return DeviceArray(self.qm.dequantize_rows(part, self._ints(ids)))

    def rmsnorm(self, x, w: np.ndarray, eps: float):
        if not isinstance(x, DeviceArray):
            return self.cpu.rmsnorm(x, w, eps)
        return DeviceArray(self.ops.rmsnorm(x.contiguous(), _as_device(w), eps))

    def rope(self, x, pos: np.ndarray, rope: Rope, heads: int | None = None):
        if not isinstance(x, DeviceArray):
            return self.cpu.rope(x, pos, rope, heads)
        xd = x.contiguous()
        part = xd if heads is None else xd[:, :heads]  # q and k of a fused QKV: rotated in place, v untouched
        self.ops.rope(part, self._ints(pos), self._freqs(rope), rope.neox, rope.attn_factor)
        return DeviceArray(xd)

    def _freqs(self, rope: Rope):
        """rope.freqs on the device, uploaded once per Rope (a model makes one per layer kind)."""
        if id(rope) not in self._inv_freq:  # the Rope is kept with its copy, so its id is never reused
            self._inv_freq[id(rope)] = (rope, self.cuda.to_device(rope.freqs))
        return self._inv_freq[id(rope)][1]

    def silu_mul(self, g, u):
        if not isinstance(g, DeviceArray):
            return self.cpu.silu_mul(g, self._host(u))
        return DeviceArray(self.ops.silu_mul(g.dev, _as_device(u)))

    def gelu_mul(self, g, u):
        if not isinstance(g, DeviceArray):
            return self.cpu.gelu_mul(g, self._host(u))
        return DeviceArray(self.ops.gelu_mul(g.dev, _as_device(u)))

    def add_(self, a, b):
        """a += b where b was computed: the residual follows the layer that just ran, so it
        crosses only where the GPU and CPU layers meet."""
        if not isinstance(b, DeviceArray):
            return self.cpu.add_(self._host(a), b)
        ad = a.contiguous() if isinstance(a, DeviceArray) else self._dev(a)
        self.ops.add_(ad, b.contiguous())
        return DeviceArray(ad)

    def attention(self, q, q_pos, kv: LayerKV, k, v, scale: float, rope: Rope, softcap: float = 0.0):
        """The attention step (backends/attention.py) on the device, or on the CPU for a layer left there."""
        if not isinstance(q, DeviceArray):
            return self.cpu.attention(q, q_pos, kv, self._host(k), self._host(v), scale, rope, softcap)
        return super().attention(q, q_pos, kv, k, v, scale, rope, softcap)

    # -- the attention step's primitives, on device arrays ----------------------------------
    def inputs(self, q, k, v):
        return q.contiguous(), self._dev(k), self._dev(v)

    def host(self, x) -> np.ndarray:
        return x.copy_to_host()

    def sink_query(self, q, shifts: np.ndarray, rope: Rope):
        return self.ops.rope(_dcopy(q), self._ints(-shifts), self._freqs(rope), rope.neox)  # q has its magnitude

    def sink_bias(self, kv: LayerKV, q, q_sink):
        return self.kvq.sink_bias(q, q_sink, self._ring(kv).mu)

    def key_space(self, kv: LayerKV, q, q_sink, k):
        r = self._ring(kv)
        if q_sink is not None:  # new arrays: the caller's q stays as it was
            q_sink = self.kvq.kv_space(q_sink, None, r.mu, r.kmul)[0]
        q, k = self.kvq.kv_space(q, k, r.mu, r.kmul)
        return q, q_sink, k

    def store(self, kv: LayerKV, plan: Plan, k, v) -> None:
        r = self._ring(kv)
        rows, slots = plan.writers
        m = len(rows)
        idx = self._ints(np.concatenate([rows, slots, plan.p0 + rows]))  # one upload: rows, slots, positions
        dslots = idx[m : 2 * m]
        self.kvq.kv_store(kv.kind, k, r.K, idx[0:m], dslots, False)
        self.kvq.kv_store(kv.kind, v, r.V, idx[0:m], dslots, False)
        self.kvq.set_pos(r.pos, dslots, idx[2 * m : 3 * m])  # the device's copy of what kv.place records

    def attend(self, kv: LayerKV, plan: Plan, q, q_sink, q_pos, k, v, sink_bias, scale: float, softcap: float):
        r = self._ring(kv)
        if not plan.store_first or kv.recent > 0:  # the batch exact: all of it while not stored, else for the recent rule
            fk, fv, fpos = k, v, self._ints(q_pos)
        else:
            fk = fv = self.cuda.device_array((0,) + tuple(k.shape[1:]), np.float32)
            fpos = self._ints(q_pos[:0])
        out = self.kvq.kv_attention(kv.kind, q, q_sink, self._ints(q_pos), r.K, r.V, r.pos, plan.n_ring, kv.n_sink,
                                    fk, fv, fpos, scale, kv.span, recent_k=r.rk, recent_v=r.rv, recent_pos=r.rpos,
                                    recent=kv.recent, exact_lo=plan.exact_lo, first=kv.first,
                                    fresh_all=not plan.store_first, sink_bias=sink_bias, softcap=softcap)
        return DeviceArray(out)

    def store_exact(self, kv: LayerKV, plan: Plan, k, v) -> None:
        r = self._ring(kv)
        rows, dst = plan.exact
        m = len(rows)
        idx = self._ints(np.concatenate([rows, dst, plan.p0 + rows]))
        self.kvq.store_f16_rows(k, v, idx[0:m], idx[m : 2 * m], r.rk, r.rv)
        self.kvq.set_pos(r.rpos, idx[m : 2 * m], idx[2 * m : 3 * m])  # the device's copy of what kv.commit records

    def _ring(self, kv: LayerKV) -> _Ring:
        """The device copy of kv (made from the host arrays on first use); its positions, key
        offset and channel weights uploaded again when the host changed them (kv.epoch: trim,
        reset, calibrate, load)."""
        r = kv.__dict__.get("_cuda_ring")
        if r is None or r.owner is not self or r.host is not kv.k:
            if kv.n_written == 0 and (kv.rpos < 0).all():
                # an empty ring: allocate only (attention reads a slot only once it is written)
                up = lambda a: self.cuda.device_array(a.shape, a.dtype)  # noqa: E731
            else:  # the host's k, v and scales are views of one record per slot: each goes up as an array of its own
                up = lambda a: self.cuda.to_device(np.ascontiguousarray(a))  # noqa: E731
            k = up(kv.k.view(np.uint8 if kv.rotated else np.uint16))
            v = up(kv.v.view(np.uint8 if kv.rotated else np.uint16))
            ks, vs = up(kv.k_scale.view(np.uint16)), up(kv.v_scale.view(np.uint16))
            to = self.cuda.to_device
            r = _Ring(self.kvq.ring_arrays(kv.kind, k, ks), self.kvq.ring_arrays(kv.kind, v, vs), k, v, ks, vs,
                      to(kv.pos), up(kv.rk.view(np.uint16)), up(kv.rv.view(np.uint16)), to(kv.rpos), to(kv.mu),
                      to(kv.kmul), kv.epoch, self, kv.k)
            kv.__dict__["_cuda_ring"] = r  # lives and dies with the LayerKV
        elif r.epoch != kv.epoch:
            for dev, host in ((r.pos, kv.pos), (r.rpos, kv.rpos), (r.mu, kv.mu), (r.kmul, kv.kmul)):
                dev.copy_to_device(host)
            r.epoch = kv.epoch
        return r

    def sync_to_host(self, cache) -> None:
        """Copy the device rings of `cache` (a KVCache) into its host arrays (before saving it)."""
        for kv in cache.layers:
            r = kv.__dict__.get("_cuda_ring")
            if r is not None:
                kv.k.view(r.k.dtype)[:] = r.k.copy_to_host()  # into the records' views (not contiguous)
                kv.v.view(r.v.dtype)[:] = r.v.copy_to_host()
                if kv.rotated:
                    kv.k_scale.view(np.uint16)[:] = r.ks.copy_to_host()
                    kv.v_scale.view(np.uint16)[:] = r.vs.copy_to_host()
                empty = ~kv.live  # never written on the device: whatever the allocation held
                for a in (kv.k, kv.v) + ((kv.k_scale, kv.v_scale) if kv.rotated else ()):
                    a[empty] = 0
                if kv.rk.shape[0]:  # the exact copies (rpos and mu, kmul are kept on the host)
                    r.rk.copy_to_host(kv.rk.view(np.uint16))
                    r.rv.copy_to_host(kv.rv.view(np.uint16))
                    kv.rk[kv.rpos < 0] = 0
                    kv.rv[kv.rpos < 0] = 0
