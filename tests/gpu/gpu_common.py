"""Shared by the GPU test files (tests/gpu/sim_*.py): refuse to run without the simulator or a
real GPU (with a reason, never a skip), and shrink launch sizes under the simulator."""
from __future__ import annotations

import os
import sys

import numba
import pytest

SIM = bool(numba.config.ENABLE_CUDASIM)
if not SIM and os.environ.get("EDGEKV_GPU_REAL") != "1":
    raise RuntimeError("tests/gpu runs under NUMBA_ENABLE_CUDASIM=1 (tests/test_gpu.py) or on a real GPU "
                       "with EDGEKV_GPU_REAL=1 (bench/gpu_check.sh)")

from numba import cuda  # noqa: E402  (after the check: the simulator is chosen at numba's import)

if not cuda.is_available():
    raise RuntimeError(f"numba.cuda is not usable here ({'simulator' if SIM else 'real GPU'})")
if SIM:
    # The simulator's block manager busy-polls its threads at every syncthreads; with Python's
    # default 5 ms GIL switch interval each barrier costs milliseconds.
    sys.setswitchinterval(1e-5)
    # The simulator finds a block's shared array by the line that declares it, but unlocked:
    # two threads switched out between its lookup and its store get different arrays (which
    # the short switch interval makes likely). Serialize the lookup.
    import threading

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    _lock = threading.Lock()

    def _locked_array(self, shape, dtype):
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        key = (caller.f_code.co_filename, caller.f_lineno)
        with _lock:
            res = self._allocations.get(key)
            if res is None:
                res = self._allocations[key] = np.empty(shape, dtype)
        return res

    FakeCUDAShared.array = _locked_array

    # The block manager busy-polls every thread for arrival at syncthreads(); a barrier does
    # the same without the polling (these kernels never let a thread leave before a barrier
    # the others reach; if one did, the wait times out instead of hanging).
    from numba.cuda.simulator import kernel as _simk

    def _run_block(self, grid_point, *args):
        barrier = threading.Barrier(int(np.prod(self._block_dim)), timeout=120)
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            t = _simk.BlockThread(lambda: self._f(*args), self, grid_point, block_point, self._debug)
            t.syncthreads = barrier.wait
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        for t in threads:
            if t.exception:
                barrier.abort()
                raise t.exception[0].with_traceback(t.exception[1])

    _simk.BlockManager.run = _run_block


@pytest.fixture(autouse=True)
def launch_sizes(monkeypatch):
    """Under the simulator every GPU thread is a Python thread and every block a batch of them:
    blocks of 4 threads (row kernels; still two levels of every reduction tree) and 32
    (elementwise), 32 matmul rows per block, keep the tests fast."""
    if SIM:
        from edgekv.kernels_gpu import launch

        monkeypatch.setattr(launch, "THREADS", 4)
        monkeypatch.setattr(launch, "ELEMWISE", 32)
        monkeypatch.setattr(launch, "MATMUL_ROWS", 32)
    yield
