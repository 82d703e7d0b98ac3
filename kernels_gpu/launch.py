"""Launch sizes of every GPU kernel, and the one place kernels are launched from.

The sizes are read at each launch (tests patch them: under the CUDA simulator each thread is a
Python thread, so tests run with small blocks). Shared-memory arrays are sized by the MAX_*
compile-time bounds; a launch never asks for more threads than those hold.
"""
from __future__ import annotations

THREADS = 128  # threads per block for row-parallel kernels (matvec rows, norms, attention)
ELEMWISE = 256  # threads per block for elementwise kernels
MAX_THREADS = 256  # compile-time bound of THREADS (shared reduction arrays); a power of two
MATMUL_ROWS = 1  # weight rows one matmul block computes in turn (more: fewer, longer blocks)
TOK_TILE = 8  # prefill: tokens one matmul block multiplies with each decoded weight unit
MAX_HD = 256  # compile-time bound of the head dim (per-thread rows in the KV kernels)


def blocks(n: int, per: int) -> int:
    return max(1, (n + per - 1) // per)


def elementwise(n: int) -> tuple[int, int]:
    """(blocks, threads per block) for n independent elements: blocks of ELEMWISE, or one block of
    n when fewer (a decode step stores one row per kv head; under the simulator each idle thread
    is a Python thread started for nothing)."""
    t = max(1, min(ELEMWISE, n))
    return blocks(n, t), t


def threads(n: int | None = None) -> int:
    """Threads per block for a row-parallel kernel: THREADS, a power of two, at most MAX_THREADS."""
    t = min(THREADS, MAX_THREADS)
    if t & (t - 1):
        raise ValueError(f"launch.THREADS={THREADS} must be a power of two")
    return t


def quiet_small_grids() -> None:
    """Decode launches grids of a few blocks on purpose (one norm row, one token's rope);
    numba.cuda warns on every grid under 128 blocks. Its config lives in numba.cuda.core.config
    (numba-cuda) or numba.core.config (numba's built-in target)."""
    import importlib

    for name in ("numba.cuda.core.config", "numba.core.config"):
        try:
            importlib.import_module(name).CUDA_LOW_OCCUPANCY_WARNINGS = 0
        except ImportError:
            pass


def launch(kernel, grid, block, *args) -> None:
    kernel[grid, block](*args)
