"""Compile every GPU kernel to PTX for a real GPU target, without a GPU.

The simulator runs the kernels as Python, so it cannot catch what only the CUDA compiler
rejects (types that do not unify, unsupported calls). This compiles each kernel with the
argument types the backend launches it with. Needs numba-cuda with NVVM, e.g.
`pip install "numba-cuda[cu12]"`; no driver or GPU.

    python bench/gpu_ptx_check.py [--cc 8.0]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default="8.0", help="compute capability to compile for (default 8.0)")
    args = ap.parse_args()
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        sys.exit("unset NUMBA_ENABLE_CUDASIM: the simulator compiles nothing")
    import numba
    from numba import cuda

    from edgekv.kernels_gpu import kvquant as kv
    from edgekv.kernels_gpu import ops, qmatmul as qm

    cc = tuple(int(x) for x in args.cc.split("."))
    # Device functions are compiled for "the current device"; with no GPU, name the target.
    from types import SimpleNamespace

    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
    f32, u8, u16, i64 = np.float32, np.uint8, np.uint16, np.int64
    a = lambda dt, *shape: np.zeros(shape or (2,), dt)  # noqa: E731  (a C-contiguous stand-in for a device array)
    strided = np.zeros((2, 8), f32)[:, :4]  # a column slice: layout A
    strided3 = np.zeros((2, 4, 32), f32)[:, :2]  # the q and k heads of a fused QKV
    ring = (a(u16, 2, 1, 32), a(u8, 2, 1, 32), a(u16, 2, 1, 1))
    cases = [
        (ops._rmsnorm_kernel, (a(f32, 2, 32), a(f32, 32), 1e-6, a(f32, 2, 32))),
        (ops._rope_kernel, (a(f32, 2, 1, 32), a(i64, 2), a(np.float64, 16), True)),
        (ops._rope_kernel, (strided3, a(i64, 2), a(np.float64, 16), False)),
        (ops._copy3d_kernel, (strided3, a(f32, 2, 2, 32))),
        (ops._silu_mul_kernel, (strided, strided, a(f32, 2, 4))),
        (ops._silu_mul_kernel, (a(f32, 1, 4), a(f32, 1, 4), a(f32, 1, 4))),
        (ops._gelu_mul_kernel, (strided, strided, a(f32, 2, 4))),
        (ops._gelu_mul_kernel, (a(f32, 1, 4), a(f32, 1, 4), a(f32, 1, 4))),
        (ops._add_kernel, (a(f32, 4), a(f32, 4))),
        (ops._scale_kernel, (a(f32, 4), f32(2.0))),
        (ops._add_rows_kernel, (a(f32, 2, 4), a(f32, 4))),
        (ops._copy2d_kernel, (strided, a(f32, 2, 4))),
        (qm._rows_kernel, (a(u8, 2, 18), a(f32, 1, 1), a(u16, 1, 1), 2, a(i64, 2), 32, a(f32, 2, 32))),
        (kv._hadamard_kernel, (a(f32, 2, 32), 32)),
        (kv._kv_space_kernel, (a(f32, 1, 2, 32), a(f32, 1, 1, 32), a(f32, 1, 32), a(f32, 1, 32), 32,
                               a(f32, 1, 2, 32), a(f32, 1, 1, 32))),
        (kv._sink_bias_kernel, (a(f32, 1, 2, 32), a(f32, 1, 2, 32), a(f32, 1, 32), a(f32, 1, 2))),
        (kv._store_kernel, (1, a(f32, 2, 1, 32), a(i64, 2), a(i64, 2), True, 32, 2, *ring)),
        (kv._f16_rows_kernel, (a(f32, 2, 1, 32), a(f32, 2, 1, 32), a(i64, 2), a(i64, 2), a(u16, 4, 1, 32),
                               a(u16, 4, 1, 32))),
        (kv._set_pos_kernel, (a(i64, 4), a(i64, 2), a(i64, 2))),
        (kv._load_kernel, (1, *ring, a(i64, 2), a(f32, 2, 1, 32))),
        (kv._attn_kernel, (1, a(f32, 1, 2, 32), a(f32, 1, 2, 32), a(i64, 1), *ring, *ring, a(i64, 2), 2, 0,
                           a(f32, 1, 1, 32), a(f32, 1, 1, 32), a(i64, 1), a(u16, 4, 1, 32), a(u16, 4, 1, 32),
                           a(i64, 4), 2, 0, 4, True, a(f32, 1, 2), f32(0.1), 0, a(f32, 1, 2, 32))),
    ]
    for qt in qm.SUPPORTED:
        for tok in (1, 8):
            views = (a(u8, 4, 18), a(f32, 1, 1), a(u16, 1, 1))
            cases.append((qm.matmul_kernel(tok, qt), (*views, a(f32, 1, 32), a(f32, 1, 4), 0, 4, 1)))
    bad = 0
    for kern, example in cases:
        sig = tuple(numba.typeof(x) for x in example)
        name = kern.py_func.__qualname__
        if "<locals>" in name:  # a matmul closure: name its constants
            name += str(tuple(c.cell_contents for c in kern.py_func.__closure__ if isinstance(c.cell_contents, int)))
        try:
            ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=cc)
            print(f"ok   {name}: {len(ptx.splitlines())} PTX lines")
        except Exception as e:  # noqa: BLE001
            bad += 1
            print(f"FAIL {name}{sig}: {type(e).__name__}: {str(e)[:2000]}")
    print(f"{len(cases) - bad} of {len(cases)} kernels compiled for sm_{cc[0]}{cc[1]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
