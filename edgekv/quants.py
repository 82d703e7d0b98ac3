"""The one table of tensor types edgekv reads.

Each entry: a GGML type's name, id, elements and bytes per block, and whether the GPU kernels
run it (the CPU kernels run them all). The kernels in kernels_cpu/ and kernels_gpu/ take their
type ids, block sizes and supported lists from here, as module-level ints (numba compiles them
in as constants); the byte layout of each type is written once, beside its kernel. Values agree
with gguf.GGML_QUANT_SIZES (tested).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantType:
    name: str
    id: int  # GGML type id, as stored in the GGUF tensor info
    block_elems: int  # weights per block
    block_bytes: int  # bytes per block
    gpu: bool  # kernels_gpu decodes it (kernels_cpu decodes every type here)

    def row_bytes(self, n_cols: int) -> int:
        return (n_cols // self.block_elems) * self.block_bytes


# fmt: off
F32    = QuantType("F32",     0,   1,   4, gpu=True)
F16    = QuantType("F16",     1,   1,   2, gpu=True)
Q4_0   = QuantType("Q4_0",    2,  32,  18, gpu=True)
Q4_1   = QuantType("Q4_1",    3,  32,  20, gpu=True)
Q5_0   = QuantType("Q5_0",    6,  32,  22, gpu=True)
Q5_1   = QuantType("Q5_1",    7,  32,  24, gpu=True)
Q8_0   = QuantType("Q8_0",    8,  32,  34, gpu=True)
Q2_K   = QuantType("Q2_K",   10, 256,  84, gpu=False)
Q3_K   = QuantType("Q3_K",   11, 256, 110, gpu=False)
Q4_K   = QuantType("Q4_K",   12, 256, 144, gpu=True)
Q5_K   = QuantType("Q5_K",   13, 256, 176, gpu=True)
Q6_K   = QuantType("Q6_K",   14, 256, 210, gpu=True)
IQ4_NL = QuantType("IQ4_NL", 20,  32,  18, gpu=True)
IQ4_XS = QuantType("IQ4_XS", 23, 256, 136, gpu=True)
BF16   = QuantType("BF16",   30,   1,   2, gpu=False)
# fmt: on
QUANT_TYPES: dict[int, QuantType] = {q.id: q for q in (
    F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16)}
BY_NAME: dict[str, QuantType] = {q.name: q for q in QUANT_TYPES.values()}
CPU_TYPES = tuple(QUANT_TYPES)  # the ids kernels_cpu runs
GPU_TYPES = tuple(q.id for q in QUANT_TYPES.values() if q.gpu)  # the ids kernels_gpu runs
FLOAT_TYPES = (F32.id, F16.id, BF16.id)  # rows of plain floats, no blocks

# IQ4_NL and IQ4_XS: each 4-bit quant indexes this non-linear table (ggml's kvalues_iq4nl)
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
