"""numba.cuda kernels mirroring kernels_cpu/ (optional; imported only when CUDA is asked for)."""
