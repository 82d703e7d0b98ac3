"""The KV cache: one preallocated ring per layer, in f16, int8 or int4, never reallocated.

Ring. A layer's ring holds `capacity` tokens. Until it is full, token i goes to slot i. Once
full, the first `n_sink` slots keep the first tokens (attention sinks) and the oldest of the
rest is overwritten, so a chat can run forever in bounded memory. Each slot remembers its
token's position (-1 = empty); attention masks by position, so slot order never matters.
Slots from `fill` (min(tokens written, capacity)) on are empty whatever they hold, and nothing
reads them: every array of a ring is zeros the OS backs page by page as the ring fills
(`lazy_zeros`), so an empty cache of a huge n_ctx costs no memory yet (`cache_bytes` is
what it will cost).
Sliding-window layers (gemma3) get a ring of exactly their window and no sinks.

Positions (StreamingLLM). Keys are stored after RoPE at their absolute positions. RoPE scores
depend only on the distance between query and key, so the window part of a wrapped ring keeps
its true distances, at most capacity - n_sink - 1: always inside what the model was trained on.
The sinks would drift ever further away; instead the query is counter-rotated for the sink
slots (`sink_shift`) so that they sit just before the oldest window token, exactly where
StreamingLLM's cache-relative positions put them. Nothing is re-quantized when the ring moves.

Quantization. int8 and int4 store groups of 32 values (along head_dim, per token and head) with
one f16 scale: 34 and 18 bytes per 32 values (0.531x and 0.281x of f16). int8: d = max|x| / 127.
int4: the step is fitted per group (`_fit_int4`: candidates around llama.cpp q4_0's x_m / -8,
least-squares step, least error wins; ~11% less squared error than q4_0's rule on Gaussian
data, more on real keys, at the same 18 bytes). Per-token groups keep ring writes local (a token
never re-quantizes a neighbour). What the measurements chose for keys (int kinds; KL vs f16 on
2048 tokens, Gemma-3 int4, numpy experiments, each step on top of the previous):
- Hadamard rotation H over head_dim (blocks of up to 256): spreads outlier channels over every
  group; q.k = (Hq).(Hk), so the query is rotated once and keys are never un-rotated.
- Exact recent tokens (KIVI's residual): the last `recent` = 32 positions before each query are
  read from f16 copies, the rest from the ring. Gemma-3 int4 0.066 -> (with mu) 0.025;
  SmolLM2 int4 0.056 -> 0.009.
- Exact first tokens: positions 0..3 too (the sinks, the most attended keys; with mu removed
  their int4 error cost SmolLM2 0.009 -> 0.013, exact 0.004). rk, rv hold both: a fixed
  (4 + 32) x Hkv x hd x 4 bytes per layer, not per token.
- Key offset mu: Gemma-3's global layers carry a large per-channel key mean that sets every
  group's scale after the rotation. Keys are stored as k - mu (mu = the first batch's mean key):
  q.(k - mu) = q.k - q.mu, the same for every key of a query, so softmax is unchanged; only the
  sinks, scored with the counter-rotated q_sink, lose q_sink.mu instead, and get
  (q_sink - q).mu added back (`sink_bias`). Gemma-3 int8 top-1 98.6% -> 100% (1024 tokens).
  A soft-capped score (gemma2: cap * tanh(s / cap)) is not shift-invariant: mu stays 0 there.
- Channel weights kmul (query-aware, from the first batch): keys are stored as (k - mu) * kmul
  and queries read as q / kmul, which leaves every score exact; with kmul_c = sqrt(rms(q_c) /
  rms(k_c)) the rotation spreads an error that lands, un-rotated, where queries are small
  (Cauchy-Schwarz minimum of the score error). Gemma-3 int4 (fitted steps) 0.016 / 93.8% ->
  0.0055 / 96.4%.
Tried and not taken: per-channel key groups along tokens (KIVI; 0.019 vs 0.025 before the
channel weights, and it needs token-aligned groups in a ring), asymmetric int4 keys with
64-value value groups to pay for the zero points (0.027), key groups of 16 with value groups of
64 (0.014, needs a second group size in the kernels; the channel weights do better).
This module is the numpy reference of that layout; kernels_cpu/kvquant.py is the fast one.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np

from .errors import EdgekvError

GROUP = 32  # values per quantization group (along head_dim)
KV_KINDS = ("f16", "int8", "int4")
# Bytes per cached value, scales included.
KV_BYTES_PER_VALUE = {"f16": 2.0, "int8": (GROUP + 2) / GROUP, "int4": (GROUP // 2 + 2) / GROUP}
QMAX = {"int8": 127, "int4": 7}
# Every array of a layer's cache (LayerKV's fields), as sessions save them.
LAYER_ARRAYS = ("k", "v", "k_scale", "v_scale", "pos", "rk", "rv", "rpos", "mu", "kmul")
RECENT = 32  # tokens per layer kept exact (f16) beside an int ring (KIVI's residual)
FIRST = 4  # and the first tokens (the attention sinks: the keys most attended to)


def kv_bytes(kind: str, capacities: list[int], n_head_kv: int, head_dim: int) -> int:
    """Bytes of a cache of this kind's rings (K and V, scales included), not counting the
    fixed exact recent slots (`recent_bytes`)."""
    return int(sum(capacities) * 2 * n_head_kv * head_dim * KV_BYTES_PER_VALUE[kind])


def recent_bytes(kind: str, n_layer: int, n_head_kv: int, head_dim: int) -> int:
    """Fixed bytes of the exact slots of an int cache: FIRST + RECENT f16 tokens (K and V)
    per layer, whatever the capacity (default sinks; less for a ring too small to hold them)."""
    return 0 if kind == "f16" else n_layer * (FIRST + RECENT) * 2 * n_head_kv * head_dim * 2


def cache_bytes(kind: str, capacities: list[int], n_head_kv: int, head_dim: int) -> int:
    """Bytes a cache of these rings holds once full: the rings, the exact slots and one int64
    position per slot. An empty cache costs almost none of it (the arrays are `lazy_zeros`,
    backed by the OS as the ring fills), but a chat that fills the ring touches all of it."""
    return (kv_bytes(kind, capacities, n_head_kv, head_dim) + 8 * sum(capacities)
            + recent_bytes(kind, len(capacities), n_head_kv, head_dim))


# -- the numpy reference of the stored layout ----------------------------------------------
def hadamard_block(hd: int) -> int:
    """Size of the Hadamard blocks over head_dim: the largest power of two dividing it, <= 256."""
    b = 1
    while hd % (b * 2) == 0 and b * 2 <= 256:
        b *= 2
    return b


def hadamard(x: np.ndarray) -> np.ndarray:
    """Normalized Walsh-Hadamard transform over the last axis in blocks (its own inverse)."""
    hd = x.shape[-1]
    b = hadamard_block(hd)
    y = x.astype(np.float32).reshape(*x.shape[:-1], hd // b, b).copy()
    h = 1
    while h < b:  # butterflies: pairs (i, i + h) within blocks of 2h
        y = y.reshape(*y.shape[:-1], b // (2 * h), 2, h)
        a, c = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + c, a - c
        y = y.reshape(*y.shape[:-3], b)
        h *= 2
    return (y / np.sqrt(b)).reshape(x.shape).astype(np.float32)


def quantize(kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., hd) float32 -> (q, scale): int8 (..., hd) or packed uint8 (..., hd/2); f16 (..., hd/32)."""
    g = x.reshape(*x.shape[:-1], -1, GROUP).astype(np.float32)
    if kind == "int8":
        d = (np.abs(g).max(axis=-1, keepdims=True) / 127).astype(np.float16)  # the scale as stored
        df = d.astype(np.float32)
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        q = np.clip(np.rint(g * inv), -127, 127).astype(np.int8).reshape(x.shape)
    else:
        q, d = _fit_int4(g)
        q = q.reshape(x.shape)
    if kind == "int4":
        u = (q.astype(np.int16) + 8).astype(np.uint8)
        q = u[..., 0::2] | (u[..., 1::2] << 4)
    return q, d[..., 0]


def _fit_int4(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups g (..., 32) float32 -> levels (..., 32) int8 in [-8, 7] and scales (..., 1) f16.
    Candidate steps around llama.cpp q4_0's (the largest-magnitude value x_m at -8): inverse
    steps -8 / (f x_m), f = 0.75, 0.775, .., 1.1; each gives levels q and the least-squares
    step sum(xq) / sum(q^2); the candidate of least squared error wins (largest
    sum(xq)^2 / sum(q^2), the first on ties). Float64 sums of float32 x small integer are
    exact, so the kernel's order of summation gives the same bytes."""
    x = g.astype(np.float64)
    xm = np.take_along_axis(x, np.abs(g).argmax(axis=-1)[..., None], axis=-1)  # (..., 1)
    best = np.full(xm.shape, -1.0)
    best_inv, best_d = np.zeros(xm.shape), np.zeros(xm.shape)
    for ci in range(15):
        inv = np.divide(-8.0, xm * (0.75 + 0.025 * ci), out=np.zeros_like(xm), where=xm != 0)
        q = np.clip(np.rint(x * inv), -8, 7)
        sxq, sqq = (x * q).sum(-1, keepdims=True), (q * q).sum(-1, keepdims=True)
        ok = sqq > 0
        score = np.divide(sxq * sxq, sqq, out=np.zeros_like(sxq), where=ok)
        win = score > best
        best = np.where(win, score, best)
        best_inv = np.where(win, inv, best_inv)
        best_d = np.where(win, np.divide(sxq, sqq, out=np.zeros_like(sxq), where=ok), best_d)
    q = np.clip(np.rint(x * best_inv), -8, 7).astype(np.int8)
    return q, best_d.astype(np.float32).astype(np.float16)  # via float32, as the kernel rounds


def dequantize(kind: str, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if kind == "int4":
        lo = (q & 0x0F).astype(np.int8) - 8
        hi = (q >> 4).astype(np.int8) - 8
        q = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    g = q.reshape(*q.shape[:-1], q.shape[-1] // GROUP, GROUP).astype(np.float32)  # no -1: q may be empty
    return (g * scale.astype(np.float32)[..., None]).reshape(q.shape)


@dataclass
class LayerKV:
    """One layer's ring. Attention reads slots where pos >= 0. Int kinds also keep the last
    `recent` tokens exact (rk, rv, rpos): see `exact_lo`."""

    kind: str  # "f16" | "int8" | "int4"
    k: np.ndarray  # f16 (cap, Hkv, hd) | int8 (cap, Hkv, hd) | uint8 (cap, Hkv, hd/2); int keys Hadamard-rotated
    v: np.ndarray  # same layout as k (values are not rotated)
    k_scale: np.ndarray  # f16 (cap, Hkv, hd/32); (1, 1, 1) unused for f16
    v_scale: np.ndarray
    pos: np.ndarray  # (cap,) int64, -1 = empty slot; slots from `fill` on are empty whatever they hold
    n_sink: int  # slots 0..n_sink-1 keep the first tokens forever
    window: int  # the model's sliding window for this layer (0 = global)
    n_written: int = 0  # tokens ever written (the ring's write cursor)
    recent: int = 0  # the last `recent` positions before a query are read exact (0 = off)
    first: int = 0  # and so are positions 0..first-1 (the sinks among them)
    rk: np.ndarray | None = None  # f16 (first + recent, Hkv, hd) exact keys, in stored key space:
    rv: np.ndarray | None = None  # rows 0..first-1 positions 0..first-1, then row first + pos % recent
    rpos: np.ndarray | None = None  # (first + recent,) int64, -1 = empty
    mu: np.ndarray | None = None  # float32 (Hkv, hd) key offset subtracted before storing (int kinds)
    kmul: np.ndarray | None = None  # float32 (Hkv, hd) channel weights: keys * kmul, queries / kmul
    backend_state: object = field(default=None, compare=False, repr=False)  # a backend's derived per-layer data

    def __post_init__(self):
        hd = self.v.shape[2] * (2 if self.kind == "int4" else 1)
        if self.rk is None:
            shape = (self.first + self.recent, self.k.shape[1], hd)
            self.rk, self.rv = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
            self.rpos = np.full(shape[0], -1, np.int64)
        if self.mu is None:
            self.mu = np.zeros((self.k.shape[1], hd), np.float32)
        if self.kmul is None:
            self.kmul = np.ones((self.k.shape[1], hd), np.float32)

    def calibrate(self, q: np.ndarray, k: np.ndarray, offset: bool = True) -> None:
        """The first batch written to an empty int ring sets the key offset mu (its mean key)
        and the channel weights kmul = sqrt(rms(q_c) / rms(k_c - mu_c)), geometric mean 1,
        from its queries q (n, H, hd) and keys k (n, Hkv, hd). Any values keep attention
        exact (see the module doc); these make the int4 error land where queries are small.
        offset=False keeps mu at 0: a soft-capped score (gemma2) is not shift-invariant."""
        if not self.rotated or self.n_written:
            return
        n, H, hd = q.shape
        hkv = k.shape[1]
        self.mu[...] = k.mean(axis=0) if offset else 0.0
        rq = np.sqrt(np.mean(np.square(q.reshape(n, hkv, H // hkv, hd), dtype=np.float64), axis=(0, 2)))  # (Hkv, hd)
        rk = np.sqrt(np.mean(np.square(k - self.mu, dtype=np.float64), axis=0))

        def floor(r):  # a dead channel must not get an unbounded weight
            top = r.max(axis=-1, keepdims=True)
            return np.where(top > 0, np.maximum(r, 1e-2 * top), 1.0)

        t = np.sqrt(floor(rq) / floor(rk))
        self.kmul[...] = t / np.exp(np.log(t).mean(axis=-1, keepdims=True))

    def key_space(self, k: np.ndarray) -> np.ndarray:
        """k (n, Hkv, hd) float32 after RoPE -> the keys as the ring stores them: for int kinds
        H((k - mu) * kmul), after `calibrate`."""
        if not self.rotated:
            return k
        return hadamard((k - self.mu) * self.kmul)

    def query_space(self, q: np.ndarray) -> np.ndarray:
        """q (n, H, hd) -> H(q / kmul) for int kinds: (H(q / kmul)) . (H((k - mu) kmul)) = q . (k - mu)."""
        if not self.rotated:
            return q
        return hadamard(q / np.repeat(self.kmul, q.shape[1] // self.kmul.shape[0], axis=0))

    def sink_bias(self, q: np.ndarray, q_sink: np.ndarray) -> np.ndarray:
        """(n, H) float32: what sink scores must add back, (q_sink - q) . mu. Keys are stored
        as k - mu, which takes q . mu off every score, a constant per query that softmax
        ignores, except that sinks are scored with q_sink and lose q_sink . mu instead."""
        grp = q.shape[1] // self.mu.shape[0]
        return np.einsum("nhd,hd->nh", q_sink - q, np.repeat(self.mu, grp, axis=0)).astype(np.float32)

    @property
    def capacity(self) -> int:
        return self.pos.shape[0]

    @property
    def fill(self) -> int:
        """Slots in use: a ring fills from slot 0, so slots fill.. are empty (never read)."""
        return min(self.n_written, self.capacity)

    @property
    def live(self) -> np.ndarray:
        """(cap,) bool: the slots that hold a token."""
        live = np.zeros(self.capacity, bool)
        live[: self.fill] = self.pos[: self.fill] >= 0
        return live

    @property
    def rotated(self) -> bool:
        """Keys stored Hadamard-rotated (queries must be rotated the same way)."""
        return self.kind != "f16"

    @property
    def span(self) -> int:
        """How far back (in positions) a query sees the non-sink slots: the model's window, or
        for a global layer everything the ring keeps, capacity - n_sink tokens including itself."""
        return self.window or self.capacity - self.n_sink

    def sink_shift(self, q_pos: np.ndarray) -> np.ndarray:
        """(n,) int64: how far each query must be rotated back for the sink slots. Query p sees
        the window p - span + 1 .. p; sink i then sits at p - span + 1 - n_sink + i, not at i."""
        if not self.n_sink:
            return np.zeros_like(q_pos)
        return np.maximum(q_pos - self.capacity + 1, 0)

    def slots(self, n: int) -> np.ndarray:
        """Slots for the next n tokens, in order (a batch longer than the ring wraps onto itself)."""
        i = self.n_written + np.arange(n)
        cap, s = self.capacity, self.n_sink
        return np.where(i < cap, i, s + (i - s) % max(cap - s, 1))

    def last_writers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(batch indices, slots) of the next n tokens that survive the batch: when a batch
        wraps the ring, a later token overwrites an earlier one's slot."""
        slots = self.slots(n)
        if n <= self.capacity - min(self.n_written, self.capacity) or n <= 1:
            return np.arange(n), slots
        _, last = np.unique(slots[::-1], return_index=True)
        sel = np.sort(n - 1 - last)
        return sel, slots[sel]

    def write_first(self, n: int) -> bool:
        """Whether a batch of n can be stored before attention without evicting a key one of its
        queries needs. One token always can: the slot it takes held the token that just left its
        span. A longer batch can while it fits the free slots."""
        return n == 1 or min(self.n_written, self.capacity) + n <= self.capacity

    def exact_lo(self, q_pos: np.ndarray) -> int:
        """Oldest position with an exact copy for a batch at q_pos: the recent slots hold the
        last tokens before the batch (positions run contiguously), the batch holds itself.
        A query at p reads positions p - recent + 1 .. p from exact copies when >= this;
        older ones (and any a trim cut out of the recent slots) from the quantized ring."""
        live = self.rpos[self.first:][self.rpos[self.first:] >= 0]
        return int(live.min()) if len(live) else int(q_pos.min())

    def write_recent(self, k_stored: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        """Keep the batch's last `recent` tokens exact: k_stored (n, Hkv, hd) in stored key
        space (rotated), v as computed. Called after the batch has attended."""
        if not self.recent:
            return
        if len(pos) == 1:  # decode: one row, no fancy indexing
            p = int(pos[0])
            row = p if p < self.first else self.first + p % self.recent
            self.rk[row], self.rv[row], self.rpos[row] = k_stored[0], v[0], p
            return
        head = pos < self.first  # the first tokens keep rows of their own, for good
        self.rk[pos[head]], self.rv[pos[head]], self.rpos[pos[head]] = k_stored[head], v[head], pos[head]
        t = np.flatnonzero(~head)[-self.recent:]
        slots = self.first + pos[t] % self.recent
        self.rk[slots], self.rv[slots], self.rpos[slots] = k_stored[t], v[t], pos[t]

    def write(self, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        """Reference write: k (n, Hkv, hd) float32 from key_space, v as computed; pos (n,)."""
        sel, slots = self.last_writers(len(pos))
        k, v = k[sel], v[sel]
        if self.kind == "f16":
            self.k[slots], self.v[slots] = k, v
        else:  # k arrives in stored key space (key_space)
            self.k[slots], self.k_scale[slots] = quantize(self.kind, k)
            self.v[slots], self.v_scale[slots] = quantize(self.kind, v)
        self.pos[slots] = pos[sel]
        self.n_written += len(pos)

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """Reference read of the filled slots: (k, v) float32 (fill, Hkv, hd); keys in stored space."""
        m = self.fill
        if self.kind == "f16":
            return self.k[:m].astype(np.float32), self.v[:m].astype(np.float32)
        return (dequantize(self.kind, self.k[:m], self.k_scale[:m]),
                dequantize(self.kind, self.v[:m], self.v_scale[:m]))

    def reset(self) -> None:
        self.pos[: self.fill] = -1
        self.rpos[:] = -1
        self.n_written = 0

    def trim(self, n: int) -> bool:
        """Forget every token at position >= n. False (and nothing changed) when the ring has
        wrapped: the tokens those overwrote are gone, so the caller must prefill again."""
        if self.n_written > self.capacity:
            return False
        live = self.pos[: self.fill]
        live[live >= n] = -1
        self.rpos[self.rpos >= n] = -1
        self.n_written = min(self.n_written, n)
        return True

    # -- save / load (edgekv.session) --------------------------------------------------
    @property
    def slot_arrays(self) -> tuple[str, ...]:
        """The arrays with one row per ring slot (f16's scales are a placeholder)."""
        return ("k", "v", "pos") + (("k_scale", "v_scale") if self.kind != "f16" else ())

    def state(self) -> dict[str, np.ndarray]:
        """Every array of the layer (LAYER_ARRAYS) as a session saves it, in its stored dtype:
        the per-slot ones only up to the fill (a wrapped ring whole), so a saved chat grows
        with its tokens, not with the capacity; the exact slots, mu and kmul whole."""
        m = self.fill
        return {name: getattr(self, name)[:m] if name in self.slot_arrays else getattr(self, name)
                for name in LAYER_ARRAYS}

    def load_state(self, arrays: dict[str, np.ndarray], n_written: int, n_tokens: int) -> None:
        """Take a `state` of n_written tokens of a conversation of n_tokens; ValueError (and
        nothing changed) unless every array has this layer's shape and dtype (the per-slot ones
        cut at the fill) and every position lies in -1 .. n_tokens - 1."""
        if n_written < 0:
            raise ValueError("negative n_written")
        m = min(n_written, self.capacity)
        for name in LAYER_ARRAYS:
            a, want = arrays[name], getattr(self, name)
            shape = (m,) + want.shape[1:] if name in self.slot_arrays else want.shape
            if a.shape != shape or a.dtype != want.dtype:
                raise ValueError(f"array {name} {a.dtype}{a.shape} does not fit this cache ({want.dtype}{shape})")
        for name in ("pos", "rpos"):
            if arrays[name].size and not -1 <= arrays[name].min() <= arrays[name].max() < n_tokens:
                raise ValueError(f"{name} out of range")
        for name in LAYER_ARRAYS:
            getattr(self, name)[: len(arrays[name])] = arrays[name]
        self.n_written = n_written

    @property
    def ring_nbytes(self) -> int:
        """Bytes of the ring: K, V and their scales, proportional to the capacity."""
        return self.k.nbytes + self.v.nbytes + (self.k_scale.nbytes + self.v_scale.nbytes if self.kind != "f16" else 0)

    @property
    def recent_nbytes(self) -> int:
        """Bytes of the exact recent slots: a fixed amount per layer, whatever the capacity."""
        return self.rk.nbytes + self.rv.nbytes

    @property
    def nbytes(self) -> int:
        return self.ring_nbytes + self.recent_nbytes


def lazy_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros whose memory the OS provides page by page as they are first written. np.zeros
    is that only for blocks malloc maps afresh: below its mmap threshold (up to 32 MiB once
    it adapts) calloc clears reused heap memory itself, which makes it all resident at once."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if n < mmap.PAGESIZE:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, n), dtype).reshape(shape)  # the array keeps the mapping alive


def new_layer(kind: str, capacity: int, n_head_kv: int, head_dim: int, n_sink: int, window: int,
              recent: int | None = None) -> LayerKV:
    if kind not in KV_KINDS:
        raise EdgekvError(f"unknown KV cache type {kind!r} (choose {', '.join(KV_KINDS)})")
    shape = (capacity, n_head_kv, head_dim)
    if kind == "f16":
        k, v = lazy_zeros(shape, np.float16), lazy_zeros(shape, np.float16)
        ks = vs = np.zeros((1, 1, 1), np.float16)  # unused
    else:
        if head_dim % GROUP:
            raise EdgekvError(f"{kind} KV cache needs head_dim a multiple of {GROUP}, this model has {head_dim}")
        width = head_dim if kind == "int8" else head_dim // 2
        dt = np.int8 if kind == "int8" else np.uint8
        k, v = lazy_zeros((capacity, n_head_kv, width), dt), lazy_zeros((capacity, n_head_kv, width), dt)
        ks = lazy_zeros((capacity, n_head_kv, head_dim // GROUP), np.float16)
        vs = lazy_zeros(ks.shape, ks.dtype)
    n_sink = min(n_sink, capacity)
    # f16 is exact already. At most capacity - n_sink: a sink then is only ever read exact
    # before the ring wraps, while its query needs no counter-rotation (sink_shift 0).
    recent = 0 if kind == "f16" else min(RECENT if recent is None else recent, capacity - n_sink)
    first = max(n_sink, FIRST) if recent else 0
    pos = lazy_zeros((capacity,), np.int64)  # no -1 fill: slots from `fill` on are empty anyway
    return LayerKV(kind, k, v, ks, vs, pos, n_sink, window, recent=recent, first=first)


class KVCache:
    """All layers' rings. Layer l keeps `capacities[l]` tokens; `windows[l]` is its sliding window."""

    def __init__(self, capacities: list[int], n_head_kv: int, head_dim: int, n_sink: int = 4,
                 windows: list[int] | None = None, kind: str = "f16", recent: int | None = None):
        windows = windows or [0] * len(capacities)
        self.kind = kind
        self.layers = [new_layer(kind, cap, n_head_kv, head_dim, 0 if w else n_sink, w, recent)
                       for cap, w in zip(capacities, windows)]

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def reset(self) -> None:
        for lk in self.layers:
            lk.reset()

    def trim(self, n: int) -> bool:
        """Roll back to the first n positions; False if some layer cannot (see LayerKV.trim)."""
        if any(lk.n_written > lk.capacity for lk in self.layers):
            return False
        for lk in self.layers:
            lk.trim(n)
        return True

    @property
    def nbytes(self) -> int:
        return sum(lk.nbytes for lk in self.layers)

    @property
    def recent_nbytes(self) -> int:
        return sum(lk.recent_nbytes for lk in self.layers)
