"""numba.cuda kernels mirroring kernels_cpu/ name for name (qmatmul, ops, kvquant).

Optional: imported only when a CUDA backend is asked for, never on the CPU path. Every public
function takes and returns numba device arrays (or the simulator's stand-ins under
NUMBA_ENABLE_CUDASIM=1); the wrappers check shapes and allocate, the kernels trust them.
Launch sizes live in `launch.py`, read at each call so that tests can shrink them.
"""
