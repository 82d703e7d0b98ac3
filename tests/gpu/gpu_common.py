"""Shared by the GPU test files (tests/gpu/sim_*.py): refuse to run without the simulator or a
real GPU (with a reason, never a skip), and shrink launch sizes under the simulator."""
from __future__ import annotations

import os

import numba
import pytest

SIM = bool(numba.config.ENABLE_CUDASIM)
if not SIM and os.environ.get("EDGEKV_GPU_REAL") != "1":
    raise RuntimeError("tests/gpu runs under NUMBA_ENABLE_CUDASIM=1 (tests/test_gpu.py) or on a real GPU "
                       "with EDGEKV_GPU_REAL=1 (bench/gpu_check.sh)")

from numba import cuda  # noqa: E402  (after the check: the simulator is chosen at numba's import)

if not cuda.is_available():
    raise RuntimeError(f"numba.cuda is not usable here ({'simulator' if SIM else 'real GPU'})")


@pytest.fixture(autouse=True)
def launch_sizes(monkeypatch):
    """Under the simulator every GPU thread is a Python thread: blocks of 8 (row kernels) and 32
    (elementwise) keep the tests fast and still take several threads per reduction."""
    if SIM:
        from edgekv.kernels_gpu import launch

        monkeypatch.setattr(launch, "THREADS", 8)
        monkeypatch.setattr(launch, "ELEMWISE", 32)
    yield
