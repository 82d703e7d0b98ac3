"""The KV cache: one preallocated ring per layer, never reallocated while generating.

A layer's ring holds `capacity` tokens. Until it is full, token i goes to slot i. Once full,
the first `n_sink` slots stay (attention sinks, StreamingLLM) and the oldest of the rest is
overwritten. Each slot remembers the position of the token in it (-1 = empty): attention
masks by positions, so the order of slots never matters.

Sliding-window layers (gemma3) get a ring of exactly their window and no sinks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Bytes per cached value, scales included: f16 is the baseline; int8 and int4 store groups of
# 32 values with one f16 scale each (34 and 18 bytes per group).
KV_BYTES_PER_VALUE = {"f16": 2.0, "int8": 34 / 32, "int4": 18 / 32}


def kv_bytes(kind: str, capacities: list[int], n_head_kv: int, head_dim: int) -> int:
    """Bytes a cache of this kind holds when every layer's ring is full (K and V)."""
    return int(sum(capacities) * 2 * n_head_kv * head_dim * KV_BYTES_PER_VALUE[kind])


@dataclass
class LayerKV:
    """One layer's ring. Attention reads k/v where pos >= 0."""

    k: np.ndarray  # (capacity, n_head_kv, head_dim) float16
    v: np.ndarray  # (capacity, n_head_kv, head_dim) float16
    pos: np.ndarray  # (capacity,) int64, -1 = empty slot
    n_sink: int
    n_written: int = 0  # tokens ever written (the ring's write cursor)

    @property
    def capacity(self) -> int:
        return self.pos.shape[0]

    def slots(self, n: int) -> np.ndarray:
        """Slots for the next n tokens, in order (a batch longer than the ring wraps onto itself)."""
        i = self.n_written + np.arange(n)
        cap, s = self.capacity, self.n_sink
        return np.where(i < cap, i, s + (i - s) % max(cap - s, 1))

    def write(self, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        """k, v: (n, n_head_kv, head_dim) float32; pos: (n,) int64."""
        n = pos.shape[0]
        slots = self.slots(n)
        if n > self.capacity:  # the batch wraps the ring: keep each slot's last writer
            _, last = np.unique(slots[::-1], return_index=True)
            sel = n - 1 - last
            k, v, pos, slots = k[sel], v[sel], pos[sel], slots[sel]
        self.k[slots] = k
        self.v[slots] = v
        self.pos[slots] = pos
        self.n_written += n

    def reset(self) -> None:
        self.pos[:] = -1
        self.n_written = 0

    def trim(self, n: int) -> bool:
        """Forget every token at position >= n. False (and nothing changed) when the ring has
        wrapped: the tokens those overwrote are gone, so the caller must prefill again."""
        if self.n_written > self.capacity:
            return False
        self.pos[self.pos >= n] = -1
        self.n_written = min(self.n_written, n)
        return True


class KVCache:
    """All layers' rings. `capacities[l]` is layer l's ring size."""

    def __init__(self, capacities: list[int], n_head_kv: int, head_dim: int, n_sink: int = 4, windows: list[int] | None = None):
        self.layers = []
        for l, cap in enumerate(capacities):
            sink = 0 if windows and windows[l] else n_sink
            self.layers.append(LayerKV(
                k=np.zeros((cap, n_head_kv, head_dim), np.float16),
                v=np.zeros((cap, n_head_kv, head_dim), np.float16),
                pos=np.full(cap, -1, np.int64),
                n_sink=min(sink, cap),
            ))

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
        return sum(lk.k.nbytes + lk.v.nbytes for lk in self.layers)
