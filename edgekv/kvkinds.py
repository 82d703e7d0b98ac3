"""The KV cache's kinds, the one table: how each stores a value. edgekv/kvcache.py and the CPU and
GPU kernels (kernels_*/kvquant.py, where each layout is written out) read it from here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # values per quantization group (along head_dim), one f16 scale each


@dataclass(frozen=True)
class KVKind:
    name: str
    dtype: type  # the stored element: f16 values, int8 values, or uint8 pairs of int4 nibbles
    per_element: int  # values per stored element (int4: 2)
    qmax: int  # largest quantized level; 0 = not quantized (f16)

    @property
    def quantized(self) -> bool:
        """Stored in groups with f16 scales, keys Hadamard-rotated, recent tokens kept exact."""
        return self.qmax > 0

    @property
    def bytes_per_value(self) -> float:
        """Bytes per cached value, scales included."""
        per = np.dtype(self.dtype).itemsize / self.per_element
        return per + 2 / GROUP if self.quantized else per

    def width(self, head_dim: int) -> int:
        """Stored elements per (token, head) row."""
        return head_dim // self.per_element


KINDS = {k.name: k for k in (KVKind("f16", np.float16, 1, 0), KVKind("int8", np.int8, 1, 127),
                             KVKind("int4", np.uint8, 2, 7))}
KV_KINDS = tuple(KINDS)  # in this order the kernels number them (0, 1, 2)


def hadamard_block(hd: int) -> int:
    """Size of the Hadamard blocks over head_dim: the largest power of two dividing it, at most 256."""
    return min(hd & -hd, 256)
