"""Measured memory read bandwidth: the ceiling a memory-bound decode step is compared against."""
from __future__ import annotations

import time

import numba as nb
import numpy as np


@nb.njit(cache=True, parallel=True, fastmath=True)
def _sum_chunks(a, n_chunks):
    # a: (n,) float32. Each thread sums contiguous chunks; the inner loop is a plain reduction
    # over a contiguous slice, which LLVM vectorizes (several ymm/zmm accumulators).
    part = np.zeros(n_chunks, np.float32)
    step = (a.shape[0] + n_chunks - 1) // n_chunks
    for c in nb.prange(n_chunks):
        s = np.float32(0.0)
        for i in range(c * step, min((c + 1) * step, a.shape[0])):
            s += a[i]
        part[c] = s
    return part.sum()


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Best read bandwidth (bytes/s) over `reps` parallel sums of an nbytes array, with numba's
    current thread count."""
    a = np.ones(nbytes // 4, np.float32)
    chunks = 64 * nb.get_num_threads()
    _sum_chunks(a[:1024], chunks)  # compile outside the timing
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        _sum_chunks(a, chunks)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best
