"""numba CPU kernels: plain functions on arrays that know nothing of models.

- simd: the vector layer (LLVM IR through @intrinsic functions) the others are written in
- layouts: each GGML type's block decoders, and the per-type switch of the prefill ones
- qmatmul: quantized matrix x vector/matrix straight from GGUF blocks, embedding row lookup
- igemm: the int8 prefill GEMM (VNNI)
- ops: RMSNorm, RoPE, gated activations, residual adds
- kvquant: the INT8/INT4 KV ring (quantized writes, attention reading the blocks directly)
- block: a whole decoder block for one decode token
- membw: measured read bandwidth, the yardstick for memory-bound kernels
"""
from __future__ import annotations

import hashlib
from pathlib import Path


def _drop_stale_cache() -> None:
    """numba's disk cache (cache=True) checks only the stamp of a function's own file, yet a
    compiled function holds copies of what it calls from other files: after an edit or a git pull
    that changes qmatmul.py but not block.py, block's cached code would still run the old matvec.
    So the cache files of these kernels are dropped whenever any kernel source changed (a hash of
    all of them), in the directory numba picks for this folder (the first of its locators that
    can write: NUMBA_CACHE_DIR, __pycache__ here, the user's cache directory)."""
    from numba.core.caching import CacheImpl

    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("*.py")))).hexdigest()
    for locator in CacheImpl._locator_classes:
        found = locator.from_function(_drop_stale_cache, str(here / "ops.py"))
        if found is not None:
            break
    else:
        return
    cache = Path(found.get_cache_path())
    stamp = cache / "edgekv-kernels.sha256"
    try:
        if stamp.read_text() == digest:
            return
    except OSError:
        pass
    try:
        for f in cache.glob("*.nb[ic]"):
            f.unlink()
        stamp.write_text(digest)
    except OSError:
        pass  # numba then recompiles what it cannot load, as without this


_drop_stale_cache()
