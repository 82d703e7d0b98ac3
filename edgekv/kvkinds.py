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

    def record(self, n_head_kv: int, head_dim: int) -> int:
        """Bytes of one ring slot's record: its keys (n_head_kv rows of `width`), its values,
        then (int kinds) the keys' and the values' f16 scales, one per GROUP values."""
        row = self._row(n_head_kv, head_dim)
        return 2 * row + (4 * n_head_kv * (head_dim // GROUP) if self.quantized else 0)

    def _row(self, n_head_kv: int, head_dim: int) -> int:
        """Bytes of a slot's keys (and of its values)."""
        return n_head_kv * self.width(head_dim) * np.dtype(self.dtype).itemsize

    def views(self, rows: np.ndarray, cap: int, n_head_kv: int, head_dim: int) -> tuple[np.ndarray, ...]:
        """(k, v, k_scale, v_scale): views of the first cap records of rows (>= cap, record)
        uint8, each (cap, n_head_kv, width or head_dim / GROUP), rows a record apart (f16's
        scales: (1, 1, 1) placeholders of their own). One record a slot, not one array each:
        a fork shares a ring's pages copy-on-write (edgekv/pages.py), and each array a chat
        writes past a shared prefix costs it about a page of its own a layer (bench/RESULTS.md)."""
        rec, w = rows.shape[1], self.width(head_dim)
        if rows.dtype != np.uint8 or rows.ndim != 2 or rec != self.record(n_head_kv, head_dim) or rows.shape[0] < cap:
            raise ValueError(f"{self.name} ring records {rows.dtype}{rows.shape} do not fit {cap} slots of "
                             f"{n_head_kv} x {head_dim}")
        view = lambda dtype, at, width: np.ndarray(  # noqa: E731
            (cap, n_head_kv, width), dtype, rows, at, (rec, width * np.dtype(dtype).itemsize, np.dtype(dtype).itemsize))
        row = self._row(n_head_kv, head_dim)
        k, v = view(self.dtype, 0, w), view(self.dtype, row, w)
        if not self.quantized:
            return k, v, np.zeros((1, 1, 1), np.float16), np.zeros((1, 1, 1), np.float16)
        g = head_dim // GROUP
        return k, v, view(np.float16, 2 * row, g), view(np.float16, 2 * row + 2 * n_head_kv * g, g)


KINDS = {k.name: k for k in (KVKind("f16", np.float16, 1, 0), KVKind("int8", np.int8, 1, 127),
                             KVKind("int4", np.uint8, 2, 7))}
KV_KINDS = tuple(KINDS)  # in this order the kernels number them (0, 1, 2)


def hadamard_block(hd: int) -> int:
    """Size of the Hadamard blocks over head_dim: the largest power of two dividing it, at most 256."""
    return min(hd & -hd, 256)
