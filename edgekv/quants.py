"""The one table of tensor types edgekv reads.

Each entry: GGML type id -> (name, elements per block, bytes per block). The kernels in
kernels_cpu/ and kernels_gpu/ dispatch on the same ids; the byte layout of each type is
written once, beside its kernel. Values agree with gguf.GGML_QUANT_SIZES (tested).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantType:
    name: str
    id: int  # GGML type id, as stored in the GGUF tensor info
    block_elems: int  # weights per block
    block_bytes: int  # bytes per block

    def row_bytes(self, n_cols: int) -> int:
        return (n_cols // self.block_elems) * self.block_bytes


# fmt: off
QUANT_TYPES: dict[int, QuantType] = {q.id: q for q in (
    QuantType("F32",   0,   1,   4),
    QuantType("F16",   1,   1,   2),
    QuantType("Q4_0",  2,  32,  18),
    QuantType("Q4_1",  3,  32,  20),
    QuantType("Q5_0",  6,  32,  22),
    QuantType("Q5_1",  7,  32,  24),
    QuantType("Q8_0",  8,  32,  34),
    QuantType("Q2_K", 10, 256,  84),
    QuantType("Q3_K", 11, 256, 110),
    QuantType("Q4_K", 12, 256, 144),
    QuantType("Q5_K", 13, 256, 176),
    QuantType("Q6_K", 14, 256, 210),
    QuantType("IQ4_NL", 20,  32,  18),
    QuantType("IQ4_XS", 23, 256, 136),
    QuantType("BF16", 30,   1,   2),
)}
# fmt: on
BY_NAME: dict[str, QuantType] = {q.name: q for q in QUANT_TYPES.values()}

F32, F16, BF16 = 0, 1, 30

# IQ4_NL and IQ4_XS: each 4-bit quant indexes this non-linear table (ggml's kvalues_iq4nl)
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
