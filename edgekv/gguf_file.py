"""Reading GGUF files: metadata and zero-copy tensor views, validated before anything reads them.

A model file is untrusted input (users download GGUFs from strangers) and the kernels read tensor
data without bounds checks, so everything is checked here first: every count, length and offset
against the file size and a plausible maximum, every tensor inside the data section, aligned and
disjoint, its shape whole blocks of its type; then edgekv.validate.check_metadata checks the
types of the general and tokenizer keys, and `get` the range of each hyperparameter as it is read. Any violation is a ModelFileError (or
UnsupportedModelError for a valid file edgekv cannot run) naming the key or tensor.

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

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ModelFileError, UnsupportedModelError
from .quants import QUANT_TYPES
from .validate import check_arch_key, check_metadata

# GGUF metadata value types -> (struct format, size); 8 = string, 9 = array.
_SCALAR = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# Limits far above any real model and far below what would exhaust memory: whatever a header
# claims, parsing it allocates a bounded amount (about MAX_META_BYTES of text plus the infos).
HEADER_MIN = 24  # magic + version + two counts
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NAME = 63  # tensor name bytes (llama.cpp refuses names of GGML_MAX_NAME = 64 or more)
MAX_KEY = 1 << 16  # metadata key bytes
MAX_STRING = 1 << 26  # one string (chat templates: ~50 KB; an embedded tokenizer.json: ~10 MB)
# All metadata strings and arrays together, in file bytes (real files: < 20 MB). Python holds
# decoded text in up to 4 bytes a character, so this bounds what a header can make us allocate.
MAX_META_BYTES = 1 << 26
MAX_KV = 1 << 16  # metadata entries (real files: ~50)
MAX_TENSORS = 1 << 16  # tensor infos (real files: up to ~2,000)
MAX_STRING_ARRAY = 1 << 21  # strings in one array: 8x the largest vocabularies (~262k)
MAX_ARRAY_STRINGS = 1 << 22  # strings in all arrays together (a Python str costs ~50 bytes + text)
MAX_ALIGNMENT = 1 << 16
# Each key-value costs at least 13 bytes (key length 8, type 4, a 1-byte value) and each tensor
# info at least 32 (name length 8, n_dims 4, one dim 8, type 4, offset 8), so counts beyond
# what the file can hold fail at once.
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 13, 32
# Old formats that share GGUF's purpose but not its layout (the magic read as little-endian).
_LEGACY_MAGIC = {b"lmgg": "GGML", b"fmgg": "GGMF", b"tjgg": "GGJT", b"algg": "GGLA"}


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
        return math.prod(self.shape)

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
        self.n_strings = 0  # strings read into arrays so far
        self.budget = MAX_META_BYTES  # bytes of strings and arrays still allowed

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

    def spend(self, n: int, what: str) -> None:
        self.budget -= n
        if self.budget < 0:
            raise ModelFileError(f"bad GGUF: metadata holds more than {MAX_META_BYTES >> 20} MiB of strings and "
                                 f"arrays (edgekv's limit), reached at {what}")

    def raw_string(self, what: str, limit: int) -> bytes:
        n = self.scalar(10, what + " length")
        if n > limit:
            raise ModelFileError(f"bad GGUF: {what} claims a {n}-byte string (at most {limit})")
        self.need(n, what)
        self.spend(n, what)
        raw = self.buf[self.pos:self.pos + n]  # an mmap slice is a bytes copy
        self.pos += n
        return raw

    def name(self, what: str, limit: int) -> str:
        """A key or tensor name: must be UTF-8 (names appear in messages and are matched exactly)."""
        raw = self.raw_string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"bad GGUF: {what} is not UTF-8 ({raw[:40]!r})") from None

    def string(self, what: str) -> str:
        return _text(self.raw_string(what, MAX_STRING))

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings (a vocabulary: the hot loop of opening a model, hence inlined)."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"{what}[{i}] length")
            n = unpack(buf, pos)[0]
            pos += 8
            if n > MAX_STRING or pos + n > size:
                self.pos = pos
                raise ModelFileError(f"bad GGUF: {what}[{i}] claims a {n}-byte string at offset {pos} "
                                     f"(edgekv reads strings up to {MAX_STRING} bytes; the file has {size})")
            self.budget -= n
            if self.budget < 0:
                self.spend(0, f"{what}[{i}]")
            out.append(_text(buf[pos:pos + n]))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar(4, what + " element type")
            count = self.scalar(10, what + " array length")
            if etype in _NP:
                size = np.dtype(_NP[etype]).itemsize
                self.need(count * size, f"{what} ({count} elements)")
                self.spend(count * size, what)
                arr = np.frombuffer(self.buf, dtype=_NP[etype], count=count, offset=self.pos).copy()
                self.pos += count * size
                return arr
            if etype == _STRING:
                # each string costs at least its 8-byte length field; Python strings cost more than
                # their bytes, so the count is also capped
                if count * 8 > self.size - self.pos:
                    raise ModelFileError(f"bad GGUF: {what} claims {count} strings, more than the file holds")
                self.n_strings += count
                if count > MAX_STRING_ARRAY or self.n_strings > MAX_ARRAY_STRINGS:
                    raise ModelFileError(f"bad GGUF: {what} holds {count} strings; edgekv accepts up to "
                                         f"{MAX_STRING_ARRAY} per array and {MAX_ARRAY_STRINGS} in all")
                return self.strings(count, what)
            if etype == _ARRAY:
                raise UnsupportedModelError(f"metadata key {what} is an array of arrays, which edgekv does not read")
            raise ModelFileError(f"bad GGUF: {what} has unknown array element type {etype}")
        raise ModelFileError(f"bad GGUF: {what} has unknown value type {vtype}")


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        # llama.cpp keeps such bytes as they are; a vocab can hold partial sequences.
        return raw.decode("utf-8", errors="surrogateescape")


class GGUFFile:
    """An open GGUF file: `meta` (key -> python value) and `tensors` (name -> Tensor).

    Numeric arrays in `meta` are numpy arrays, string arrays are lists of str. Tensor data stays
    in the read-only memory map; nothing is read until a kernel touches it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise ModelFileError(f"cannot open {self.path}: {e.strerror or e}") from None
        if stat.S_ISDIR(st.st_mode):
            raise ModelFileError(f"{self.path} is a directory, not a GGUF file")
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise ModelFileError(f"{self.path} is not a regular file")
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise ModelFileError("empty file, not a GGUF model")
                _check_magic(f.read(4), size)
                if size < HEADER_MIN:
                    raise ModelFileError(f"truncated GGUF: {size} bytes, the header alone needs {HEADER_MIN}")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (ModelFileError, UnsupportedModelError) as e:
            raise type(e)(f"{self.path.name}: {e}") from None
        except OSError as e:
            raise ModelFileError(f"cannot open {self.path}: {e.strerror or e}") from None
        self.size = size
        try:
            self._parse()
        except (ModelFileError, UnsupportedModelError) as e:
            raise type(e)(f"{self.path.name}: {e}") from None

    def _parse(self) -> None:
        c = _Cursor(self._mmap, self.size)
        c.pos = 4
        self.version = c.scalar(4, "version")
        if self.version not in (2, 3):
            raise _version_error(self.version)
        n_tensors = c.scalar(10, "tensor count")
        n_kv = c.scalar(10, "metadata count")
        if n_kv > MAX_KV or n_tensors > MAX_TENSORS:
            raise ModelFileError(f"bad GGUF: header claims {n_kv} metadata keys and {n_tensors} tensors "
                                 f"(edgekv accepts up to {MAX_KV} and {MAX_TENSORS})")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > self.size - c.pos:
            raise ModelFileError(f"bad GGUF: header claims {n_kv} metadata keys and {n_tensors} tensors, "
                                 f"more than the {self.size}-byte file holds")

        meta: dict = {}
        for i in range(n_kv):
            key = c.name(f"metadata key #{i}", MAX_KEY)
            if key in meta:
                raise ModelFileError(f"bad GGUF: metadata key {key} appears twice")
            vtype = c.scalar(4, f"type of {key}")
            meta[key] = c.value(vtype, key)
        self.meta = meta

        infos = []
        for i in range(n_tensors):
            name = c.name(f"tensor name #{i}", MAX_NAME)
            n_dims = c.scalar(4, f"dims of {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFileError(f"bad GGUF: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
            ne = [c.scalar(10, f"shape of {name}") for _ in range(n_dims)]
            qtype = c.scalar(4, f"type of {name}")
            offset = c.scalar(10, f"offset of {name}")
            infos.append((name, ne, qtype, offset))

        align = meta.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
            raise ModelFileError(f"bad GGUF: general.alignment is {align!r:.40}, "
                                 f"expected a power of two up to {MAX_ALIGNMENT}")
        self.alignment = align
        self.data_offset = (c.pos + align - 1) // align * align
        check_metadata(meta)
        self.tensors = self._tensors(infos, align)

    def _tensors(self, infos: list, align: int) -> dict[str, Tensor]:
        tensors: dict[str, Tensor] = {}
        spans = []
        data_size = self.size - self.data_offset  # negative when the header runs into the end
        for name, ne, qtype, offset in infos:
            if name in tensors:
                raise ModelFileError(f"bad GGUF: tensor {name} appears twice")
            if qtype not in QUANT_TYPES:
                known = _type_name(qtype)
                if known is None:
                    raise ModelFileError(f"bad GGUF: tensor {name} has unknown type id {qtype}")
                raise UnsupportedModelError(f"tensor {name} has type {known}, which edgekv does not support "
                                            f"(supported: {', '.join(q.name for q in QUANT_TYPES.values())})")
            qt = QUANT_TYPES[qtype]
            if any(d <= 0 for d in ne):
                raise ModelFileError(f"bad GGUF: tensor {name} has shape {ne} (ggml order), "
                                     "every dimension must be positive")
            if ne[0] % qt.block_elems:
                raise ModelFileError(f"bad GGUF: tensor {name} has {ne[0]} columns, not a multiple of "
                                     f"{qt.name}'s block of {qt.block_elems}")
            n_rows = math.prod(ne[1:])  # exact: python ints do not overflow
            row_bytes = qt.row_bytes(ne[0])
            nbytes = n_rows * row_bytes
            if offset % align:
                raise ModelFileError(f"bad GGUF: tensor {name} offset {offset} is not aligned to {align}")
            if offset + nbytes > data_size:
                raise ModelFileError(f"truncated GGUF: tensor {name} ({qt.name}, shape {tuple(reversed(ne))}) needs "
                                     f"bytes {offset}..{offset + nbytes} of the data section, which has "
                                     f"{max(data_size, 0)}")
            start = self.data_offset + offset
            spans.append((start, start + nbytes, name))
            raw = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=start).reshape(n_rows, row_bytes)
            tensors[name] = Tensor(name, qtype, tuple(reversed(ne)), raw)
        spans.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ModelFileError(f"bad GGUF: tensors {n0} (bytes {s0}..{e0}) and {n1} (bytes {s1}..{e1}) overlap")
        return tensors

    @property
    def arch(self) -> str:
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path.name}: metadata key general.architecture is missing")
        return arch

    def get(self, key: str, default=None, *, kind: type | tuple | None = None):
        """A metadata value, checked to be of `kind` (int accepts any integer type, float
        accepts int; bool is neither) and, for an `<arch>.` hyperparameter, in its range."""
        if key not in self.meta:
            return default
        v = self.meta[key]
        if kind is not None:
            kinds = kind if isinstance(kind, tuple) else (kind,)
            if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
                raise ModelFileError(f"{self.path.name}: metadata key {key} is {type(v).__name__} {v!r:.60}, "
                                     f"expected {_kind_name(kind)}")
        arch = self.meta.get("general.architecture")  # a string: check_metadata saw it
        if arch is not None:
            check_arch_key(arch, key, v)
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


def _check_magic(magic: bytes, size: int) -> None:
    if magic == b"GGUF":
        return
    if magic in _LEGACY_MAGIC:
        raise UnsupportedModelError(f"a legacy {_LEGACY_MAGIC[magic]} model file; edgekv reads GGUF "
                                    "(convert it with llama.cpp's convert scripts)")
    raise ModelFileError(f"not a GGUF file (starts with {magic!r}, expected b'GGUF'; {size} bytes)")


def _version_error(version: int) -> Exception:
    swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
    if swapped in (1, 2, 3):  # the version of a big-endian file, read little-endian
        return UnsupportedModelError(f"big-endian GGUF (version {swapped}); edgekv reads little-endian GGUF only")
    if version == 1:
        return UnsupportedModelError("GGUF version 1 (the 2023 draft format) is not supported; "
                                     "edgekv reads versions 2 and 3 (re-convert the model)")
    return ModelFileError(f"unknown GGUF version {version} (edgekv reads 2 and 3, little-endian)")


def _type_name(qtype: int) -> str | None:
    """The GGML name of a type id edgekv lacks a kernel for; None if gguf does not know it either."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return None


def _kind_name(kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def read_metadata(path: str | os.PathLike) -> dict:
    """Just the metadata of a GGUF file (key -> python value)."""
    return GGUFFile(path).meta
