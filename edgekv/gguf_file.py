"""Reading GGUF files: metadata and zero-copy tensor views, validated before anything reads them.

The `gguf` package is the reference for the format (its enums and block sizes are used here and
its GGUFReader is the oracle in the tests), but its reader builds one numpy view per string
element: opening gemma-3-270m (262,144 vocab strings) takes it ~30 s. This parser walks the
header once with struct and keeps tensor data as views into one read-only memory map, so a
model opens in well under a second.

GGUF layout (little-endian): magic "GGUF", version u32 (2 or 3), n_tensors u64, n_kv u64,
n_kv x (key: string, type: u32, value), n_tensors x (name: string, n_dims: u32, ne: u64 x n_dims,
type: u32, offset: u64), padding to `general.alignment` (default 32), then the tensor data.
A string is a u64 length + UTF-8 bytes; an array is (elem type u32, count u64, elems).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ModelFileError, UnsupportedModelError
from .quants import QUANT_TYPES

# GGUF metadata value types -> (struct format, size); 8 = string, 9 = array.
_SCALAR = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

MAX_DIMS = 4
MAX_STRING = 1 << 28  # a chat template or a token is never near 256 MiB
MAX_KEY = 1 << 16


@dataclass(frozen=True)
class Tensor:
    """One tensor as it lies in the file. `shape` is numpy order (ggml's ne reversed), so a
    weight is (out_features, in_features); `raw` is a uint8 (n_rows, row_bytes) view."""

    name: str
    qtype: int  # GGML type id, a key of quants.QUANT_TYPES
    shape: tuple[int, ...]
    raw: np.ndarray  # uint8 (n_rows, row_bytes), read-only view into the memory map

    @property
    def type_name(self) -> str:
        return QUANT_TYPES[self.qtype].name

    @property
    def nbytes(self) -> int:
        return self.raw.size

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    def as_float(self) -> np.ndarray:
        """F32/F16 tensors as a float view in numpy shape (no copy); anything else raises."""
        if self.qtype == 0:
            return self.raw.view(np.float32).reshape(self.shape)
        if self.qtype == 1:
            return self.raw.view(np.float16).reshape(self.shape)
        raise ModelFileError(f"tensor {self.name} is {self.type_name}, expected F32 or F16")


class _Cursor:
    """Bounds-checked reads from the header; every read names what it was reading."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelFileError(f"truncated GGUF: {what} runs past the end of the file "
                                 f"(needs {n} bytes at offset {self.pos}, file is {self.size})")

    def scalar(self, vtype: int, what: str):
        fmt, n = _SCALAR[vtype]
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str, limit: int = MAX_STRING) -> str:
        n = self.scalar(10, what)
        if n > limit:
            raise ModelFileError(f"bad GGUF: {what} claims a {n}-byte string")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # llama.cpp keeps such bytes as they are; a vocab can hold partial sequences.
            return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar(4, what + " element type")
            count = self.scalar(10, what + " length")
            if etype in _NP:
                size = np.dtype(_NP[etype]).itemsize
                self.need(count * size, what)
                arr = np.frombuffer(self.buf, dtype=_NP[etype], count=count, offset=self.pos).copy()
                self.pos += count * size
                return arr
            if etype == _STRING:
                if count * 8 > self.size - self.pos:  # each string costs at least its length field
                    raise ModelFileError(f"bad GGUF: {what} claims {count} strings, more than the file holds")
                return [self.string(what) for _ in range(count)]
            raise ModelFileError(f"bad GGUF: {what} has array element type {etype}")
        raise ModelFileError(f"bad GGUF: {what} has unknown value type {vtype}")


class GGUFFile:
    """An open GGUF file: `meta` (key -> python value) and `tensors` (name -> Tensor).

    Numeric arrays in `meta` are numpy arrays, string arrays are lists of str. Tensor data stays
    in the read-only memory map; nothing is read until a kernel touches it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise ModelFileError(f"{self.path.name}: not a GGUF file ({size} bytes)")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(f"cannot open {self.path}: {e.strerror or e}") from None
        self.size = size
        try:
            self._parse()
        except ModelFileError as e:
            raise type(e)(f"{self.path.name}: {e}") from None

    def _parse(self) -> None:
        c = _Cursor(self._mmap, self.size)
        if bytes(self._mmap[:4]) != b"GGUF":
            raise ModelFileError("not a GGUF file (bad magic)")
        c.pos = 4
        self.version = c.scalar(4, "version")
        if self.version not in (2, 3):
            raise ModelFileError(f"unsupported GGUF version {self.version} (edgekv reads 2 and 3, little-endian)")
        n_tensors = c.scalar(10, "tensor count")
        n_kv = c.scalar(10, "metadata count")
        # Each key-value costs >= 13 bytes and each tensor info >= 28: reject inflated counts at once.
        if n_kv * 13 + n_tensors * 28 > self.size:
            raise ModelFileError(f"bad GGUF: header claims {n_kv} keys and {n_tensors} tensors, more than the file holds")

        meta: dict = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}", MAX_KEY)
            vtype = c.scalar(4, f"type of {key}")
            meta[key] = c.value(vtype, key)
        self.meta = meta

        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}", MAX_KEY)
            n_dims = c.scalar(4, f"dims of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFileError(f"bad GGUF: tensor {name} has {n_dims} dimensions")
            ne = [c.scalar(10, f"shape of {name}") for _ in range(n_dims)]
            qtype = c.scalar(4, f"type of {name}")
            offset = c.scalar(10, f"offset of {name}")
            infos.append((name, ne, qtype, offset))

        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 16:
            raise ModelFileError(f"bad GGUF: general.alignment is {align!r}")
        self.alignment = align
        self.data_offset = (c.pos + align - 1) // align * align

        tensors: dict[str, Tensor] = {}
        spans = []
        for name, ne, qtype, offset in infos:
            if name in tensors:
                raise ModelFileError(f"bad GGUF: tensor {name} appears twice")
            if qtype not in QUANT_TYPES:
                raise UnsupportedModelError(f"tensor {name} has type {_type_name(qtype)}, which edgekv does not support "
                                            f"(supported: {', '.join(q.name for q in QUANT_TYPES.values())})")
            qt = QUANT_TYPES[qtype]
            if any(d <= 0 or d > 1 << 40 for d in ne):
                raise ModelFileError(f"bad GGUF: tensor {name} has shape {ne}")
            if ne[0] % qt.block_elems:
                raise ModelFileError(f"bad GGUF: tensor {name} has {ne[0]} columns, not a multiple of "
                                     f"{qt.name}'s block of {qt.block_elems}")
            n_rows = int(np.prod(ne[1:], dtype=np.float64)) if len(ne) > 1 else 1
            row_bytes = qt.row_bytes(ne[0])
            nbytes = n_rows * row_bytes
            start = self.data_offset + offset
            if offset % align:
                raise ModelFileError(f"bad GGUF: tensor {name} offset {offset} is not aligned to {align}")
            if start + nbytes > self.size:
                raise ModelFileError(f"truncated GGUF: tensor {name} ends at byte {start + nbytes}, "
                                     f"the file has {self.size}")
            spans.append((start, start + nbytes, name))
            raw = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=start).reshape(n_rows, row_bytes)
            tensors[name] = Tensor(name, qtype, tuple(reversed(ne)), raw)
        spans.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ModelFileError(f"bad GGUF: tensors {n0} and {n1} overlap")
        self.tensors = tensors

    @property
    def arch(self) -> str:
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError("metadata key general.architecture is missing")
        return arch

    def get(self, key: str, default=None, *, kind: type | tuple | None = None):
        """A metadata value, checked to be of `kind` (int accepts any integer type)."""
        if key not in self.meta:
            return default
        v = self.meta[key]
        if kind is not None and not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, float)):
            raise ModelFileError(f"metadata key {key} is {type(v).__name__} {v!r:.60}, expected {_kind_name(kind)}")
        return v

    def require(self, key: str, kind: type | tuple | None = None):
        if key not in self.meta:
            raise ModelFileError(f"{self.path.name}: metadata key {key} is missing")
        return self.get(key, kind=kind)

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path.name}: tensor {name} is missing") from None

    def close(self) -> None:
        # Views may still reference the map; closing then would crash readers, so only the
        # file handle is dropped by the GC when nothing refers to the arrays any more.
        self.tensors = {}


def _type_name(qtype: int) -> str:
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(qtype).name
    except Exception:
        return f"#{qtype}"


def _kind_name(kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def read_metadata(path: str | os.PathLike) -> dict:
    """Just the metadata of a GGUF file (key -> python value)."""
    return GGUFFile(path).meta
