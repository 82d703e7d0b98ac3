"""Measured memory read bandwidth: the ceiling a memory-bound decode step is compared against."""
from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from . import simd


@njit(cache=True, parallel=True)
def _read_bytes(a, n_chunks, sink):
    # a: (n,) uint8, any bits (weights), read in n_chunks contiguous parts of whole 256-byte
    # steps, 4 wide integer loads a step, back to back as the matvec kernels issue them (a plain
    # `s += a[i]` loop reads at a fraction of this); each part's sum (64 wrapping byte lanes) in sink[c]
    step = a.size // n_chunks // 256 * 256
    for c in prange(n_chunks):
        a0 = simd.splat(np.uint8(0), 64)
        a1, a2, a3 = a0, a0, a0
        i = c * step
        while i < c * step + step:
            a0 = simd.vadd(a0, simd.ld(a, i, 64))
            a1 = simd.vadd(a1, simd.ld(a, i + 64, 64))
            a2 = simd.vadd(a2, simd.ld(a, i + 128, 64))
            a3 = simd.vadd(a3, simd.ld(a, i + 192, 64))
            i += 256
        simd.st(sink[c], 0, simd.vadd(simd.vadd(a0, a1), simd.vadd(a2, a3)))
    return n_chunks * step


def read_pass(arrays) -> tuple[int, float]:
    """Read every array once (C-contiguous; a decode step's weights), each as its own parallel
    region of numba's current thread count in contiguous parts: (bytes read, seconds). The bytes
    a decode step streams, in the same order and regions, with nothing else to do: the read
    bandwidth a decode of those weights can reach at that moment."""
    chunks = numba.get_num_threads()
    sink = np.empty((chunks, 64), np.uint8)
    flat = [a.reshape(-1).view(np.uint8) for a in arrays if a.size]
    if flat:
        _read_bytes(flat[0][: 256 * chunks], chunks, sink)  # compiled (or loaded) before the clock
    total, t = 0, time.perf_counter()
    for a in flat:
        total += _read_bytes(a, chunks, sink)
    return total, time.perf_counter() - t


def read_bandwidth(nbytes: int = 1 << 30, part: int = 128 << 20, reps: int = 16) -> float:
    """Best bytes/s of parallel reads (numba's current thread count) of `part`-byte slices taken
    in turn from an nbytes array: short timings like the decode calls, never cache-resident."""
    a = np.ones(nbytes, np.uint8)
    chunks = numba.get_num_threads()
    sink = np.empty((chunks, 64), np.uint8)
    _read_bytes(a[: 1 << 16], chunks, sink)
    best, got = float("inf"), 0
    for r in range(reps):
        s = a[(r % (nbytes // part)) * part :][:part]
        t = time.perf_counter()
        got = _read_bytes(s, chunks, sink)
        best = min(best, time.perf_counter() - t)
    return got / best
