"""The KV cache: one preallocated ring per layer, in f16, int8 or int4 (edgekv/kvkinds.py),
reallocated only by an eviction policy's lending (below); the only code that changes a cache's state.

Ring. A layer's ring holds `capacity` tokens. Until it is full, token i goes to slot i; then the
first `n_sink` slots keep the first tokens (attention sinks) and the oldest of the rest is
overwritten. Each slot remembers its token's position (-1 = empty); attention masks by position,
so slot order never matters. Slots from `fill` on are empty whatever they hold and never read;
the arrays are `lazy_zeros`, so an empty cache of a huge n_ctx costs no memory yet. A sliding-
window layer's ring is its window (at most n_ctx: `capacities`), without sinks. Keys are
stored after RoPE at their absolute positions; once the ring wraps, the sinks are seen through a
query turned back by `shift` positions, so they sit just before the window (StreamingLLM). Int
kinds also keep exact f16 copies of the first `first` positions and of the last `recent`
(rk, rv, rpos), store keys as H((k - mu) * kmul) and read queries as H(q / kmul): why, and what
the measurements chose, is in bench/RESULTS.md ("Why the KV cache stores what it does").

Protocol. For a batch of positions a layer gives a `Plan`: plain integers (ring slots, the sink
shift, the exact-token range, the exact rows) that backends and kernels take as they are and
never derive. The attention step (backends/attention.py) stores the batch where the plan says,
`place`s it (its slots' positions), attends, writes the exact rows, then `commit`s (the write
cursor); a probe (`ProbeCache`: an eviction policy's look ahead, edgekv/evict.py) only attends,
with `probe_plan`, and changes nothing but the policy's probe scores. `trim`, `reset`, `fork` / `adopt` (another ring holding the same tokens, to go on apart: parallel
samples, beams, prompt-cache entries) and `state` / `load_state` (sessions) are the other state
changes.

Shared prefixes. A fork shares the filled slots' memory with the ring it came from instead of
copying them: both map one frozen copy (edgekv/pages.py: OS pages as the blocks, copy-on-write
at the first page either writes), so N chats restored from one cached system prompt hold one
copy of it plus N tails, and a ring that wraps stops sharing just the pages it overwrites. Each
ring counts `clean`, its leading slots still as in its frozen copy (place, trim, reset and
load_state lower it), so freezing it again reuses those pages. A slot's keys, values and scales
are one record (`rows`; k, v and the scales are views of it), so a chat writing past a shared
prefix gets a page of its own in two arrays a layer (records, positions), not five: at
SmolLM2's int4 rows that was most of a chat's own memory (bench/RESULTS.md).

Several sequences in one batch (`BatchCache`): their tokens are stacked, so every matmul reads a
weight once for all of them, and each layer of the batch is the sequences' own LayerKVs with the
batch rows that belong to each; the attention step runs its one-sequence path per sequence, one
plan per sequence's cache.

Eviction (edgekv/evict.py). A policy other than "window" chooses the slots of `plan` once a
batch overflows the ring: the least important tokens' (their attention, which the attention
kernel writes out as it computes it: kv_attention's `scores`, the fused decode step), never the
sinks', the last 32 positions' or marked template tokens'. The kernels mask by position, so the
holes it leaves among the kept positions cost nothing. Positions: every kept key stays at the
absolute position RoPE gave it, and the sinks at theirs (shift 0, no counter-rotated query), so
a query sees each kept token at its true distance, exactly as an uncapped cache shows it, and
with an uncapped cache's own mask (span 0: a kept token may be any distance back). The window
policy's shift exists because its ring is read as one contiguous run ending at the query, which
StreamingLLM's cache-relative positions reproduce; once holes appear there is no such run, and
any relative renumbering would move a kept token to a distance it never had (the scores that
chose it were computed at its true distance). The price: past the model's trained context the
true distances leave the trained range, where the window policy's do not.

Lending (`lend`). Under a policy, in a model of sliding and global layers, the batch that
overflows the global rings changes every ring's size (`sizes`, `resize`): the global rings share
their slots 1.5x their mean for the first down to 0.5x for the last (a ring that shrinks drops
its least important tokens), and while they are smaller than twice the window the sliding
rings give them up to a quarter of it (dropping their least important in-window tokens: their
scores are kept from the start for this). The sum of the slots, the memory, is the window
policy's at every moment, and until that batch every output is the window policy's. On
Gemma-3's 4096 tokens it takes ema from 0.59x / 0.63x of the window's KL to 0.46x / 0.28x at
rings of 1024 / 512 (bench/RESULTS.md).
"""
from __future__ import annotations

import itertools
import mmap
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from . import pages
from .errors import ContextError, EdgekvError
from .kvkinds import GROUP, KINDS, KV_KINDS

KV_BYTES_PER_VALUE = {name: k.bytes_per_value for name, k in KINDS.items()}
# Every array of a layer's cache, as sessions save them.
LAYER_ARRAYS = ("k", "v", "k_scale", "v_scale", "pos", "rk", "rv", "rpos", "mu", "kmul")
SHARED = ("rows", "pos")  # the arrays of a slot's row each: what a fork shares (the records hold k, v and scales)
EXACT = ("rk", "rv", "rpos", "mu", "kmul")  # the rest, a fixed size per layer: a fork copies them
RECENT = 32  # tokens per layer kept exact (f16) beside an int ring (KIVI's residual)
FIRST = 4  # and the first tokens (the attention sinks: the keys most attended to)


def capacities(windows: list[int], n_ctx: int) -> list[int]:
    """Ring sizes per layer: n_ctx for a global layer, the window (at most n_ctx) for a sliding one."""
    return [min(w, n_ctx) if w else n_ctx for w in windows]


def kv_bytes(kind: str, capacities: list[int], n_head_kv: int, head_dim: int) -> int:
    """Bytes of a cache of this kind's rings (K and V, scales included), not counting the
    fixed exact recent slots (`recent_bytes`)."""
    return int(sum(capacities) * 2 * n_head_kv * head_dim * KV_BYTES_PER_VALUE[kind])


def recent_bytes(kind: str, n_layer: int, n_head_kv: int, head_dim: int) -> int:
    """Fixed bytes of the exact slots of an int cache: FIRST + RECENT f16 tokens (K and V)
    per layer, whatever the capacity (default sinks; less for a ring too small to hold them)."""
    return n_layer * (FIRST + RECENT) * 2 * n_head_kv * head_dim * 2 if KINDS[kind].quantized else 0


# what a layer's plan of one token depends on under the window policy (LayerKV.plan)
_PLAN_KEY = operator.attrgetter("capacity", "n_sink", "recent", "first", "n_written", "exact_from")


def cache_bytes(kind: str, capacities: list[int], n_head_kv: int, head_dim: int) -> int:
    """Bytes a cache of these rings holds once full: the rings, the exact slots and one int64
    position per slot. An empty cache costs almost none of it (the arrays are `lazy_zeros`,
    backed by the OS as the ring fills), but a chat that fills the ring touches all of it."""
    return (kv_bytes(kind, capacities, n_head_kv, head_dim) + 8 * sum(capacities)
            + recent_bytes(kind, len(capacities), n_head_kv, head_dim))


def _ring_slot(i, cap: int, n_sink: int):
    """Slot of the i-th token ever written (an int, or an int64 array): slot i until the ring is
    full, then round the slots after the sinks."""
    if type(i) is int:
        return i if i < cap else n_sink + (i - n_sink) % (cap - n_sink or 1)
    return np.where(i < cap, i, n_sink + (i - n_sink) % (cap - n_sink or 1))


class Plan(NamedTuple):
    """One batch at one layer, positions p0 .. p0 + n - 1 (they continue the cache's tokens),
    placed by the layer's rules: plain integers a kernel takes as they are. The arrays a batch
    needs come from the properties, from these same integers."""

    p0: int
    n: int
    store_first: bool  # stored before it attends: none of its queries needs a key the store evicts
    n_ring: int  # ring slots attention reads, 0 .. n_ring - 1 (the batch included when store_first)
    exact_lo: int  # oldest position with an exact copy (kernels_cpu.kvquant.kv_attention's exact_lo)
    shift: int  # how far the last query turns back for the sinks (0: the sinks are where they were)
    slot: int  # ring slot of the batch's first token
    exact_row: int  # row of rk/rv for the last token (-1: the layer keeps no exact copies)
    written: int  # tokens written before the batch (the write cursor)
    capacity: int  # the layer's shape, for the arrays below
    n_sink: int
    first: int
    recent: int
    slots: np.ndarray | None = None  # (n,) int64 ring slots an eviction policy chose (None: the ring's order)
    probe: bool = False  # attend only (LayerKV.probe_plan): nothing stored, placed or committed

    @property
    def one_token(self) -> tuple[int, int, int, int]:
        """(slot, n_ring, exact_lo, exact_row): what the one-token kernels take (kvquant.kv_decode)."""
        return self.slot, self.n_ring, self.exact_lo, self.exact_row

    @property
    def shifts(self) -> np.ndarray:
        """(n,) int64: each query's sink shift (query p sees the window p - span + 1 .. p; the
        sinks then sit at p - span + 1 - n_sink + i, not at i)."""
        q = np.arange(self.p0, self.p0 + self.n, dtype=np.int64)
        return np.maximum(q - self.capacity + 1, 0) if self.n_sink else np.zeros_like(q)

    @property
    def writers(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch rows, ring slots) (m,) int64 of the tokens that land in the ring: when a batch
        wraps the ring onto itself, only each slot's last writer."""
        rows = np.arange(self.n, dtype=np.int64)
        if self.slots is not None:
            return rows, self.slots
        if self.n == 1:
            return rows, np.array([self.slot], np.int64)
        slots = _ring_slot(self.written + rows, self.capacity, self.n_sink)
        if self.n <= self.capacity - min(self.written, self.capacity):
            return rows, slots
        _, last = np.unique(slots[::-1], return_index=True)
        sel = np.sort(self.n - 1 - last)
        return sel, slots[sel]

    @property
    def exact(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch rows, rows of rk/rv) (m,) int64 kept exact after the batch has attended: the
        first positions in rows of their own for good, the batch's last `recent` others at row
        first + pos % recent."""
        if not self.recent:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if self.n == 1:
            return np.zeros(1, np.int64), np.array([self.exact_row], np.int64)
        pos = np.arange(self.p0, self.p0 + self.n, dtype=np.int64)
        head = np.flatnonzero(pos < self.first)
        tail = np.flatnonzero(pos >= self.first)[-self.recent:]
        return np.concatenate([head, tail]), np.concatenate([pos[head], self.first + pos[tail] % self.recent])


@dataclass
class LayerKV:
    """One layer's ring. Attention reads slots where pos >= 0. Int kinds also keep exact copies
    of the first and the last positions (rk, rv, rpos)."""

    kind: str  # a name of edgekv.kvkinds.KINDS
    # (cap + 1, record) uint8: slot j's keys, values and their scales (KVKind.views), one record a
    # slot so that a chat past a shared prefix writes pages of one array, not four; the spare
    # last record keeps the kernels' row windows (kvquant._window) inside the buffer
    rows: np.ndarray
    pos: np.ndarray  # (cap,) int64, -1 = empty slot; slots from `fill` on are empty whatever they hold
    n_sink: int  # slots 0..n_sink-1 keep the first tokens forever
    window: int  # the model's sliding window for this layer (0 = global)
    n_head_kv: int
    head_dim: int
    n_written: int = 0  # tokens ever written (the ring's write cursor)
    recent: int = 0  # the last `recent` positions before a query are read exact (0 = off)
    first: int = 0  # and so are positions 0..first-1 (the sinks among them)
    rk: np.ndarray | None = None  # f16 (first + recent, Hkv, hd) exact keys, in stored key space:
    rv: np.ndarray | None = None  # rows 0..first-1 positions 0..first-1, then row first + pos % recent
    rpos: np.ndarray | None = None  # (first + recent,) int64, -1 = empty
    mu: np.ndarray | None = None  # float32 (Hkv, hd) key offset subtracted before storing (int kinds)
    kmul: np.ndarray | None = None  # float32 (Hkv, hd) channel weights: keys * kmul, queries / kmul
    # oldest position in the recent rows (-1: none). They hold one run of positions, the last
    # tokens before the cursor (less what a trim cut), so this one int stands for rpos there.
    exact_from: int = -1
    epoch: int = 0  # bumped by every change no plan describes (trim, reset, load, calibrate): device copies resync
    frozen: dict | None = field(default=None, compare=False, repr=False)  # slot array name -> pages.Frozen it maps
    clean: int = 0  # leading slots whose rows are still as in `frozen` (nothing wrote them since)
    backend_state: object = field(default=None, compare=False, repr=False)  # a backend's derived per-layer data
    evictor: object = field(default=None, compare=False, repr=False)  # edgekv.evict.Evictor; None: the ring's order
    # (capacity made with, tokens written past which it changes, capacity after) under an eviction
    # policy's lending (KVCache.set_policy); () none. Every layer of a cache changes in one batch.
    sizes: tuple = ()
    # views of rows: f16 (cap, Hkv, hd) | int8 (cap, Hkv, hd) | uint8 (cap, Hkv, hd/2); int keys Hadamard-rotated
    k: np.ndarray = field(init=False, repr=False, compare=False)
    v: np.ndarray = field(init=False, repr=False, compare=False)  # same layout as k (values are not rotated)
    k_scale: np.ndarray = field(init=False, repr=False, compare=False)  # f16 (cap, Hkv, hd/32); (1, 1, 1) for f16
    v_scale: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.rotated = KINDS[self.kind].quantized  # keys stored Hadamard-rotated (queries too)
        self._view_rows()
        hd = self.head_dim
        if self.rk is None:
            shape = (self.first + self.recent, self.n_head_kv, hd)
            self.rk, self.rv = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
            self.rpos = np.full(shape[0], -1, np.int64)
        if self.mu is None:
            self.mu = np.zeros((self.n_head_kv, hd), np.float32)
        if self.kmul is None:
            self.kmul = np.ones((self.n_head_kv, hd), np.float32)

    def _view_rows(self) -> None:
        """k, v and the scales as views of rows (after rows or pos is replaced)."""
        self.capacity = self.pos.shape[0]
        self.k, self.v, self.k_scale, self.v_scale = KINDS[self.kind].views(
            self.rows, self.capacity, self.n_head_kv, self.head_dim)

    # -- the protocol --------------------------------------------------------------------
    def plan(self, q_pos: np.ndarray) -> Plan:
        """Where a batch at q_pos (n,) int64 (positions n_written, n_written + 1, ..) goes. Called
        per layer and token: plain arithmetic, no numpy (the arrays are the plan's properties).
        With an eviction policy, a batch the ring cannot hold as it is takes the slots the policy
        chooses (edgekv.evict.Evictor.plan)."""
        if self.sizes and self.n_written + len(q_pos) > self.sizes[1] and self.capacity != self.sizes[2]:
            self.resize(self.sizes[2], q_pos.item(0))
        if self.evictor is not None and self.n_written + len(q_pos) > self.capacity and self.evictor.plans:
            return self.evictor.plan(self, q_pos)
        n, p0 = len(q_pos), q_pos.item(0)
        nw, cap, s, r, f = self.n_written, self.capacity, self.n_sink, self.recent, self.first
        fill = nw if nw < cap else cap
        # one token can always be stored first: the slot it takes held the token that just left its span
        first = n == 1 or fill + n <= cap
        last = p0 + n - 1
        return tuple.__new__(Plan, (p0, n, first, (nw + n if nw + n < cap else cap) if first else fill,
                                    self.exact_from if self.exact_from >= 0 else p0,
                                    last - cap + 1 if s and last >= cap else 0, _ring_slot(nw, cap, s),
                                    (last if last < f else f + last % r) if r else -1, nw, cap, s, f, r, None, False))

    def probe_plan(self, q_pos: np.ndarray) -> Plan:
        """A batch that attends over what the layer holds, its own keys beside, and is never
        stored: an eviction policy's probe (evict.Evictor.probe). Its rows have no slot (-1)."""
        fill = min(self.n_written, self.capacity)
        if self.evictor is None or not self.evictor.plans:  # the ring's own rules (sinks' shift, sliding span)
            plan = self.plan(q_pos)
        else:  # every slot read, no shift (as Evictor.plan)
            p0 = q_pos.item(0)
            plan = Plan(p0, len(q_pos), False, fill, self.exact_from if self.exact_from >= 0 else p0, 0, -1, -1,
                        self.n_written, self.capacity, self.n_sink, self.first, self.recent)
        return plan._replace(store_first=False, n_ring=fill, slots=np.full(len(q_pos), -1, np.int64), probe=True)

    def place(self, plan: Plan) -> None:
        """The batch is in its ring slots now: record their positions (attention reads them)."""
        if plan.n == 1:
            self.pos[plan.slot] = plan.p0
            if plan.slot < self.clean:
                self.clean = plan.slot
        else:
            rows, slots = plan.writers
            self.pos[slots] = plan.p0 + rows
            self.clean = min(self.clean, int(slots.min()))
        if self.evictor is not None:
            self.evictor.placed(plan)

    def commit(self, plan: Plan) -> None:
        """The batch has attended and its exact rows are written: record them, advance the cursor."""
        if self.recent:
            if plan.n == 1:
                self.rpos[plan.exact_row] = plan.p0
            else:
                rows, dst = plan.exact
                self.rpos[dst] = plan.p0 + rows
        self._advance(plan)

    def stored(self, plan: Plan) -> None:
        """One token's place and commit after a kernel that wrote its slot's and its exact row's
        positions itself (kernels_cpu.kvquant's decode step): the counters only. No eviction
        policy (its hooks run in place and commit). In a SmolLM2 step of 8 sequences these two
        numpy writes a layer and sequence cost 0.3-0.7 ms of ~10: each touches cold objects."""
        if plan.slot < self.clean:
            self.clean = plan.slot
        self._advance(plan)

    def _advance(self, plan: Plan) -> None:
        r = self.recent
        if r:
            last = plan.p0 + plan.n - 1
            if last >= self.first:  # the recent rows hold the last r positions of one run
                lo = self.exact_from if self.exact_from >= 0 else plan.p0
                self.exact_from = max(lo, last + 1 - r, self.first)
            if self.evictor is not None:
                self.evictor.committed(plan)
        self.n_written += plan.n

    def calibrate(self, q: np.ndarray, k: np.ndarray, offset: bool = True) -> None:
        """The first batch written to an empty int ring sets the key offset mu (its mean key)
        and the channel weights kmul = sqrt(rms(q_c) / rms(k_c - mu_c)), geometric mean 1,
        from its queries q (n, H, hd) and keys k (n, Hkv, hd). Any values keep attention
        exact (q.(k - mu) differs from q.k by the same amount for every key of a query);
        these make the int4 error land where queries are small. offset=False keeps mu at 0:
        a soft-capped score (gemma2) is not shift-invariant."""
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
        self.epoch += 1

    def sink_bias(self, q: np.ndarray, q_sink: np.ndarray) -> np.ndarray:
        """(n, H) float32: what sink scores must add back, (q_sink - q) . mu. Keys are stored
        as k - mu, which takes q . mu off every score, a constant per query that softmax
        ignores, except that sinks are scored with q_sink and lose q_sink . mu instead."""
        grp = q.shape[1] // self.mu.shape[0]
        return np.einsum("nhd,hd->nh", q_sink - q, np.repeat(self.mu, grp, axis=0)).astype(np.float32)

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
    def made(self) -> int:
        """The capacity the ring was made with (before any lending)."""
        return self.sizes[0] if self.sizes else self.capacity

    def capacity_at(self, n_written: int) -> int:
        """The capacity the ring has once n_written tokens are in it."""
        return self.sizes[2] if self.sizes and n_written > self.sizes[1] else self.made

    @property
    def span(self) -> int:
        """How far back (in positions) a query sees the non-sink slots: the model's window, or
        for a global layer everything the ring keeps, capacity - n_sink tokens including itself
        (0, no limit, under an eviction policy: what it keeps may be any distance back)."""
        return self.window or (0 if self.evictor is not None else self.capacity - self.n_sink)

    def resize(self, cap: int, p0: int | None = None) -> None:
        """Hold `cap` slots from now on (an eviction policy's lending, `sizes`): a ring that grows
        keeps every token; one that shrinks drops the least important ones its policy chooses
        for a batch at p0 (never sinks, the recent window or marked tokens), the survivors
        packed into the first slots. New arrays (lazy zeros), so the memory let go goes back to
        the OS once nothing holds the old ones; the frozen pages and a backend's data are let go."""
        fill = self.fill
        keep = np.arange(fill, dtype=np.int64)
        if cap < fill:
            victims = self.evictor.victims(self, fill - cap, p0)
            if victims is None:
                raise ContextError(f"a {self.capacity}-token ring cannot give up {fill - cap} slots")
            keep = np.setdiff1d(keep, victims)
        for name in SHARED:
            a = getattr(self, name)
            b = lazy_zeros((slot_rows(name, cap),) + a.shape[1:], a.dtype)
            b[: len(keep)] = a[keep]
            setattr(self, name, b)
        self._view_rows()
        if self.evictor is not None:
            self.evictor.resized(self, keep)
        self.frozen, self.clean, self.backend_state = None, 0, None
        self.epoch += 1

    def reset(self) -> None:
        self.pos[: self.fill] = -1
        self.clean = 0
        self.rpos[:] = -1
        if self.evictor is not None:
            self.evictor.reset()
        self.n_written, self.exact_from = 0, -1
        if self.sizes and self.capacity != self.sizes[0]:  # lent or borrowed slots: back to the ring it was made
            self.resize(self.sizes[0])
        self.epoch += 1

    def trim(self, n: int) -> bool:
        """Forget every token at position >= n. False (and nothing changed) when the ring has
        wrapped: the tokens those overwrote are gone, so the caller must prefill again."""
        if self.n_written > self.capacity:
            return False
        live = self.pos[: self.fill]
        live[live >= n] = -1
        self.clean = min(self.clean, n)  # not wrapped: slot i holds position i
        self.rpos[self.rpos >= n] = -1
        self.n_written = min(self.n_written, n)
        if self.exact_from >= n:
            self.exact_from = -1
        self.epoch += 1
        return True

    def fork(self) -> "LayerKV":
        """A ring of its own holding what this one holds, to go on apart from it: the filled slots
        shared (`frozen`; copied where pages.SUPPORTED is False), the exact rows, mu, kmul and
        the eviction policy's state copied; a backend's derived data is made again on first use."""
        shared = freeze([self])[0]
        arrays = {name: shared[name].array() if shared else _copy(getattr(self, name), self.fill) for name in SHARED}
        arrays.update({name: _copy(getattr(self, name), None) for name in EXACT})
        twin = LayerKV(self.kind, n_sink=self.n_sink, window=self.window, n_head_kv=self.n_head_kv,
                       head_dim=self.head_dim, n_written=self.n_written, recent=self.recent, first=self.first,
                       exact_from=self.exact_from, frozen=shared, clean=self.fill if shared else 0, sizes=self.sizes,
                       **arrays)
        twin.evictor = self.evictor.copy(twin) if self.evictor is not None else None  # evicts as this ring would
        return twin

    def map_frozen(self, frozen: dict) -> None:
        """Map the slot arrays from `frozen` (pages.Frozen of this ring's filled rows) in place of
        its own: all made before any is replaced, so a failed mapping leaves the ring as it was."""
        arrays = {name: f.array() for name, f in frozen.items()}
        for name, a in arrays.items():
            setattr(self, name, a)
        self._view_rows()
        self.frozen, self.clean, self.backend_state = frozen, self.fill, None

    def adopt(self, other: "LayerKV") -> None:
        """Hold what `other` (a ring of the same shape) holds, as a fork of it would, in place of
        what this ring held; other is left as it is."""
        if (other.kind, other.made, other.k.shape[1:], other.n_sink, other.window) != \
                (self.kind, self.made, self.k.shape[1:], self.n_sink, self.window):
            raise ValueError("a ring of another shape")
        epoch = self.epoch
        self.__dict__.update(other.fork().__dict__)
        self.epoch = epoch + 1

    # -- save / load (edgekv.session) --------------------------------------------------
    @property
    def slot_arrays(self) -> tuple[str, ...]:
        """The arrays with one row per ring slot (f16's scales are a placeholder)."""
        return ("k", "v", "pos") + (("k_scale", "v_scale") if self.rotated else ())

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(metadata, arrays) as a session saves them: every array in its stored dtype, the
        per-slot ones only up to the fill (a wrapped ring whole), so a saved chat grows with
        its tokens, not with the capacity; the exact slots, mu and kmul whole."""
        m = self.fill
        meta = dict(n_written=self.n_written, n_sink=self.n_sink)
        arrays = {name: getattr(self, name)[:m] if name in self.slot_arrays else getattr(self, name) for name in LAYER_ARRAYS}
        if self.evictor is not None:  # what the policy knows of the kept tokens goes with them
            meta["evict"], ev = self.evictor.state(m)
            arrays.update(ev)
        return meta, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray], n_tokens: int, every_slot: bool = False) -> None:
        """Take a `state` of a conversation of n_tokens (`checked`, then copied in)."""
        self.take_state(*self.checked(meta, arrays, n_tokens, every_slot))

    def checked(self, meta: dict, arrays: dict[str, np.ndarray], n_tokens: int,
                every_slot: bool = False) -> tuple[int, dict[str, np.ndarray]]:
        """(n_written, the arrays cut to what this layer takes) of a `state` of a conversation of
        n_tokens; every_slot: the arrays hold every slot, filled or not (session files of version
        2). ValueError unless every array has this layer's shape and dtype (the per-slot ones cut
        at the fill) and every position lies in -1 .. n_tokens - 1. Changes nothing."""
        n_written = int(meta["n_written"])
        if n_written < 0:
            raise ValueError("negative n_written")
        m = min(n_written, self.capacity_at(n_written))
        missing = [name for name in LAYER_ARRAYS if name not in arrays]
        if missing:
            raise ValueError(f"array {missing[0]} missing")
        saved = arrays
        arrays = {name: arrays[name][:m] if every_slot and name in self.slot_arrays else arrays[name]
                  for name in LAYER_ARRAYS}
        for name in LAYER_ARRAYS:
            a, want = arrays[name], getattr(self, name)
            shape = (m,) + want.shape[1:] if name in self.slot_arrays else want.shape
            if a.shape != shape or a.dtype != want.dtype:
                raise ValueError(f"array {name} {a.dtype}{a.shape} does not fit this cache ({want.dtype}{shape})")
        for name in ("pos", "rpos"):
            if arrays[name].size and not -1 <= arrays[name].min() <= arrays[name].max() < n_tokens:
                raise ValueError(f"{name} out of range")
        if self.evictor is not None:  # None under another policy: this one starts afresh
            arrays["evictor"] = self.evictor.checked(meta.get("evict"), saved, m, n_tokens, self.capacity_at(n_written))
        return n_written, arrays

    def take_state(self, n_written: int, arrays: dict[str, np.ndarray], frozen: dict | None = None) -> None:
        """Hold a `checked` state: its arrays copied in, or with frozen (its slot arrays frozen,
        pages.freeze) those mapped instead of copied."""
        if self.capacity != self.capacity_at(n_written):  # a state from before or after the lending
            self.n_written = 0
            self.resize(self.capacity_at(n_written))
        self.n_written = n_written
        if frozen is not None:
            self.map_frozen(frozen)
        else:
            self.frozen, self.clean = None, 0
        for name in LAYER_ARRAYS:
            if frozen is None or name not in self.slot_arrays:  # frozen: the slot arrays are mapped
                getattr(self, name)[: len(arrays[name])] = arrays[name]
        live = self.rpos[self.first:][self.rpos[self.first:] >= 0]
        self.exact_from = int(live.min()) if len(live) else -1
        if self.evictor is not None:
            self.evictor.take(arrays.get("evictor"))
        self.epoch += 1

    @property
    def ring_nbytes(self) -> int:
        """Bytes of the ring: K, V and their scales, proportional to the capacity."""
        return self.k.nbytes + self.v.nbytes + (self.k_scale.nbytes + self.v_scale.nbytes if self.rotated else 0)

    @property
    def recent_nbytes(self) -> int:
        """Bytes of the exact recent slots: a fixed amount per layer, whatever the capacity."""
        return self.rk.nbytes + self.rv.nbytes

    @property
    def nbytes(self) -> int:
        return self.ring_nbytes + self.recent_nbytes


def freeze(layers: list[LayerKV]) -> list[dict | None]:
    """Each layer's filled slot rows frozen (pages.freeze, one file for all of them), which the
    layers then map too (their own copies let go); a layer's same Frozen again while nothing
    wrote its slots. None for a layer where pages cannot be shared (then forks copy)."""
    if not pages.SUPPORTED:
        return [None] * len(layers)
    todo = [lk for lk in layers if lk.frozen is None or lk.clean < lk.fill]
    items = []
    for lk in todo:
        for name in SHARED:
            a = getattr(lk, name)
            row = a.nbytes // a.shape[0]
            items.append((a, lk.fill * row, (lk.frozen or {}).get(name), lk.clean * row))
    try:
        made = iter(pages.freeze(items))
        for lk in todo:
            lk.map_frozen({name: next(made) for name in SHARED})
    except OSError:  # out of descriptors or mappings: what is not frozen yet is copied instead
        pass
    return [lk.frozen if lk.frozen is not None and lk.clean >= lk.fill else None for lk in layers]


def take_frozen(layers: list[LayerKV], states: list[tuple]) -> None:
    """Each layer takes its `checked` state (n_written, arrays), the slot arrays frozen straight
    from the given ones into one file and mapped (a loaded prompt-cache file: one copy, shared
    by whatever adopts these layers later); copied in where pages cannot be shared."""
    items = []
    for lk, (n, arrays) in zip(layers, states):
        m, cap = len(arrays["pos"]), lk.capacity_at(n)
        rows = np.zeros((m, lk.rows.shape[1]), np.uint8)  # the filled slots' records, from the named arrays
        for name, a in zip(("k", "v", "k_scale", "v_scale"), KINDS[lk.kind].views(rows, m, lk.n_head_kv, lk.head_dim)):
            if name in lk.slot_arrays:
                a[:] = arrays[name]
        items.append((rows, rows.nbytes, None, 0, (slot_rows("rows", cap), rows.shape[1])))
        items.append((arrays["pos"], arrays["pos"].nbytes, None, 0, (slot_rows("pos", cap),)))
    try:
        made = iter(pages.freeze(items)) if pages.SUPPORTED else None
    except OSError:
        made = None
    for lk, (n_written, arrays) in zip(layers, states):
        lk.take_state(n_written, arrays, None if made is None else {name: next(made) for name in SHARED})


def slot_rows(name: str, cap: int) -> int:
    """Rows of a ring's slot array (SHARED) for cap slots: the records have a spare last one,
    which keeps the kernels' row windows (kernels_cpu.kvquant._window) inside the buffer."""
    return cap + (name == "rows")


def lazy_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros whose memory the OS provides page by page as they are first written. np.zeros
    is that only for blocks malloc maps afresh: below its mmap threshold (up to 32 MiB once
    it adapts) calloc clears reused heap memory itself, which makes it all resident at once."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if n < mmap.PAGESIZE:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, n), dtype).reshape(shape)  # the array keeps the mapping alive


def _copy(a: np.ndarray, rows: int | None) -> np.ndarray:
    """A new array like a with its first `rows` rows (all: None) copied, the rest lazy zeros."""
    out = lazy_zeros(a.shape, a.dtype)
    out[:rows] = a[:rows]
    return out


def new_layer(kind: str, capacity: int, n_head_kv: int, head_dim: int, n_sink: int, window: int,
              recent: int | None = None) -> LayerKV:
    if kind not in KINDS:
        raise EdgekvError(f"unknown KV cache type {kind!r} (choose {', '.join(KV_KINDS)})")
    spec = KINDS[kind]
    if spec.quantized and head_dim % GROUP:
        raise EdgekvError(f"{kind} KV cache needs head_dim a multiple of {GROUP}, this model has {head_dim}")
    rows = lazy_zeros((slot_rows("rows", capacity), spec.record(n_head_kv, head_dim)), np.uint8)
    n_sink = min(n_sink, capacity)
    # f16 is exact already. At most capacity - n_sink: a sink then is only ever read exact
    # before the ring wraps, while its query needs no counter-rotation (sink shift 0).
    recent = min(RECENT if recent is None else recent, capacity - n_sink) if spec.quantized else 0
    first = max(n_sink, FIRST) if recent else 0
    pos = lazy_zeros((capacity,), np.int64)  # no -1 fill: slots from `fill` on are empty anyway
    return LayerKV(kind, rows, pos, n_sink, window, n_head_kv, head_dim, recent=recent, first=first)


def lend(layers: list[LayerKV], evict: str) -> None:
    """Under an eviction policy, in a model of sliding and global layers whose sliding rings
    hold their whole window: once the global rings are full (`sizes`) they are split from
    SPLIT[0] to SPLIT[1] times their mean, first to last (the first global layer wants the most
    room, the last little: bench/RESULTS.md), and when they are smaller than twice the window the
    sliding layers lend them up to LEND of it. Until then every ring is as the window policy's;
    the slots in all stay the same."""
    from .evict import LEND, SPLIT

    glob = [lk for lk in layers if not lk.window]
    lenders = [lk for lk in layers if lk.window and lk.capacity >= lk.window]
    if evict == "window" or not glob or not lenders:
        return
    at = min(lk.capacity for lk in glob)
    if at < max(lk.capacity for lk in lenders):
        return
    # the less the global rings see past the window, the more they gain: LEND at a ring of the
    # window, none from twice it on (where lending measured no gain and its one-time drop a loss)
    give = [int(lk.capacity * LEND * min(1.0, max(0.0, 2.0 - at / lk.window))) for lk in lenders]
    total = sum(lk.capacity for lk in glob) + sum(give)
    hi, lo = SPLIT
    w = np.linspace(hi, lo, len(glob))
    caps = np.rint(total * w / w.sum()).astype(int)
    caps[0] += total - caps.sum()
    for lk, g in zip(lenders, give):
        if g:
            lk.sizes = (lk.capacity, at, lk.capacity - g)
    for lk, c in zip(glob, caps):
        if c != lk.capacity:
            lk.sizes = (lk.capacity, at, int(c))


class KVCache:
    """All layers' rings. Layer l keeps `capacities[l]` tokens; `windows[l]` is its sliding window."""

    def __init__(self, capacities: list[int], n_head_kv: int, head_dim: int, n_sink: int = 4,
                 windows: list[int] | None = None, kind: str = "f16", recent: int | None = None,
                 evict: str = "window"):
        windows = windows or [0] * len(capacities)
        self.kind = kind
        self.layers = [new_layer(kind, cap, n_head_kv, head_dim, 0 if w else n_sink, w, recent)
                       for cap, w in zip(capacities, windows)]
        self.set_policy(evict)

    @classmethod
    def for_model(cls, cfg, n_ctx: int, kind: str = "f16", n_sink: int = 4, evict: str = "window") -> "KVCache":
        """An empty cache for a model's Config: rings of n_ctx tokens, of the window for sliding layers."""
        windows = cfg.windows()
        return cls(capacities(windows, n_ctx), cfg.n_head_kv, cfg.head_dim, n_sink=n_sink, windows=windows, kind=kind,
                   evict=evict)

    # -- eviction (edgekv/evict.py) --------------------------------------------------------
    def set_policy(self, evict: str) -> None:
        """The eviction policy of every layer whose ring can drop a token its queries still
        see (global layers; a sliding layer when its ring is smaller than its window, or when it
        lends: `lend`, its scores then choose what it gives up)."""
        from .evict import Evictor, check_policy

        self.evict = check_policy(evict)
        for lk in self.layers:  # a lending not begun yet is this policy's to choose again
            if lk.sizes and lk.capacity == lk.sizes[0]:
                lk.sizes = ()
        if not any(lk.sizes for lk in self.layers):
            lend(self.layers, evict)
        for lk in self.layers:
            lk.evictor = None if evict == "window" or (lk.window and lk.capacity >= lk.window and not lk.sizes) \
                else Evictor(evict, lk)
            lk.backend_state = None  # the fused decode pack holds the policy's arrays

    @property
    def batch_limit(self) -> int | None:
        """The largest batch every evicting ring can take once full, leaving room for protected
        tokens (None: no policy limits it)."""
        rooms = [(min((lk.capacity,) + lk.sizes[2:]) - lk.n_sink - lk.evictor.recent) // 2  # a lent ring: its least
                 for lk in self.layers if lk.evictor is not None]
        return max(1, min(rooms)) if rooms else None

    def evicts(self, n: int) -> bool:
        """Would a batch of n tokens make an eviction policy overwrite a token?"""
        return any(lk.n_written + n > lk.capacity_at(lk.n_written + n) for lk in self.layers
                   if lk.evictor is not None and (lk.evictor.plans or lk.n_written + n > lk.sizes[1]))

    def probed(self) -> None:
        """A probe (ProbeCache) has run over this cache: its scores count from now (Evictor.pool)."""
        for lk in self.layers:
            if lk.evictor is not None:
                lk.evictor.pool(lk)

    def protect(self, positions) -> None:
        """Never evict these positions (chat-template tokens) once written, while anything else can go."""
        for lk in self.layers:
            if lk.evictor is not None:
                lk.evictor.pending.update(int(p) for p in positions)

    def evict_stats(self) -> dict:
        """The policy, tokens evicted (summed over the evicting layers) and the estimated attention
        mass the kept tokens hold: 1 - the mean attention an evicted token had when overwritten."""
        evs = [lk.evictor for lk in self.layers if lk.evictor is not None]
        if not evs:  # the ring's order: a global layer drops what it has no room for, unscored
            n = sum(max(0, lk.n_written - lk.capacity) for lk in self.layers if not lk.window)
            return dict(evict=getattr(self, "evict", "window"), kv_evicted=n, kv_kept_mass=None)
        n = sum(e.evicted for e in evs)
        return dict(evict=self.evict, kv_evicted=n,
                    kv_kept_mass=round(1.0 - sum(e.lost for e in evs) / n, 6) if n else 1.0)

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def decode_plans(self, q_pos: np.ndarray) -> list[Plan] | None:
        """The plans of one token at q_pos (1,) for every layer, as each layer's `plan` makes
        them, made once for all the layers that plan it alike (one Plan object for them): a
        batched decode step plans a sequence once, not once a layer. None under an eviction
        policy, whose plans change what they plan (each layer plans in its own turn then)."""
        if self.evict != "window":
            return None
        keys = list(map(_PLAN_KEY, self.layers))
        if keys.count(keys[0]) == len(keys):  # one kind of layer (every llama-style model)
            return [self.layers[0].plan(q_pos)] * len(keys)
        plans = {key: lk.plan(q_pos) for key, lk in dict(zip(keys, self.layers)).items()}  # a layer of each kind plans
        return list(map(plans.__getitem__, keys))

    def fork(self) -> "KVCache":
        """A cache of its own holding what this one holds (LayerKV.fork: the filled slots shared,
        copy-on-write)."""
        freeze(self.layers)  # one file for every layer's new pages; each lk.fork then finds its own
        twin = object.__new__(KVCache)
        twin.kind, twin.layers, twin.evict = self.kind, [lk.fork() for lk in self.layers], self.evict
        return twin

    def adopt(self, other: "KVCache") -> None:
        """Hold what `other` (a cache of the same shape) holds, sharing its pages (LayerKV.adopt)."""
        if len(other.layers) != len(self.layers):
            raise ValueError("a cache of another shape")
        policy = self.evict
        for lk, olk in zip(self.layers, other.layers):
            lk.adopt(olk)
        if other.evict != policy:  # another policy's scores mean nothing to this one: it starts afresh
            self.set_policy(policy)

    @property
    def used_nbytes(self) -> int:
        """Bytes a copy of what the cache holds takes (its filled slots, exact rows, mu, kmul):
        what a session or a prompt-cache entry stores."""
        return sum(a.nbytes for lk in self.layers for a in lk.state()[1].values())

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


class BatchLayer(NamedTuple):
    """One layer of a batch of sequences: sequence j's cache is layers[j] and its tokens are the
    batch rows starts[j] .. starts[j + 1] - 1 (the attention step splits q, k, v there)."""

    layers: tuple[LayerKV, ...]
    starts: tuple[int, ...]  # len(layers) + 1 row offsets, from 0 to the batch's rows
    # a decode step's plans, one a sequence (KVCache.decode_plans), made before the step; layers
    # whose sequences all plan alike share one tuple object. None: each layer plans in its turn
    plans: tuple[Plan, ...] | None = None

    def parts(self):
        """(layer, first row, end row) per sequence."""
        return zip(self.layers, self.starts, self.starts[1:])


class ProbeLayer(NamedTuple):
    """A layer seen by an eviction policy's probe: the attention step attends over it
    (LayerKV.probe_plan) and changes nothing but the policy's probe scores."""

    layer: LayerKV


class ProbeCache:
    """A cache as a model's forward pass over probe tokens sees it (`[i]`: a ProbeLayer)."""

    def __init__(self, cache: KVCache):
        self.views = [ProbeLayer(lk) for lk in cache.layers]

    def __getitem__(self, layer: int) -> ProbeLayer:
        return self.views[layer]


class BatchCache:
    """Several sequences' caches as one cache for a model's forward pass over their stacked
    tokens (caches[j] takes counts[j] rows, in order): `[i]` is layer i of every sequence."""

    def __init__(self, caches: list[KVCache], counts: list[int], q_pos: np.ndarray | None = None):
        """q_pos (n,) int64: a decode step's positions (counts all 1), planned here once a
        sequence for all its alike layers (KVCache.decode_plans)."""
        starts = tuple(itertools.accumulate(map(int, counts), initial=0))
        self.caches = caches
        layers = list(zip(*(c.layers for c in caches)))  # layer i of every sequence
        plans = [None] * len(layers)
        if q_pos is not None and starts[-1] == len(caches):  # one token a sequence
            each = [c.decode_plans(q_pos[j : j + 1]) for j, c in enumerate(caches)]
            if all(p is not None for p in each):
                if all(p.count(p[0]) == len(p) for p in each):  # one kind of layer: one tuple for all
                    plans = [tuple(p[0] for p in each)] * len(layers)
                else:
                    same: dict = {}  # a column of plans alike as a column before it: that tuple object
                    plans = [same.setdefault(tuple(map(id, col)), col) for col in zip(*each)]
        self.views = [BatchLayer(lks, starts, ps) for lks, ps in zip(layers, plans)]

    def __getitem__(self, layer: int) -> BatchLayer:
        return self.views[layer]
