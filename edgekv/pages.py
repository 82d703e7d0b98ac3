"""Copy-on-write pages: how KV caches that hold the same first tokens share their memory.

A `Frozen` is the leading bytes of a ring array, kept in anonymous in-memory files (memfd). Any
number of arrays are made from it (`Frozen.array`): their first pages map those files privately,
so they all read the one copy, and the first write to a page gives the writer a page of its own
(the OS's copy-on-write); the rest of each array is ordinary anonymous memory (lazy zeros). The
OS pages are the blocks of PagedAttention, its page tables the block tables and its reference
counts ours, so the attention kernels read a shared ring exactly as any other: one array, no
block table, no gather. A block is a page (4 KiB: a quarter of a token to 19 tokens of a
layer's slot records, 512 of its positions).

Freezing a ring that came from a Frozen and whose first rows were not written since reuses that
Frozen's pages for them and writes only the rest to a new file (`freeze`'s base and clean), so
a chat that took a system prompt's pages and then its own turns shares the system prompt's pages
with every other such chat after each turn is frozen too. Past MAX_SEGMENTS files, all but the first are
copied into one (each file is a mapping, and a process may hold only so many).

Needs memfd and mmap(MAP_FIXED) (Linux; elsewhere `SUPPORTED` is False and caches copy instead).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import weakref

import numpy as np

PAGE = mmap.PAGESIZE
MAX_SEGMENTS = 4
_PROT_RW, _MAP_PRIVATE, _MAP_FIXED = mmap.PROT_READ | mmap.PROT_WRITE, 0x02, 0x10


def _libc_mmap():
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        f = libc.mmap
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_void_p
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    return f


_mmap = _libc_mmap()
SUPPORTED = _mmap is not None


class _File:
    """An anonymous in-memory file holding `parts` (byte buffers) one after another, each from a
    page boundary (`offsets`); its descriptor closed when nothing refers to it (a mapping of it
    keeps its pages alive by itself). One file for a whole cache: a process may open only so many."""

    def __init__(self, parts: list[memoryview]):
        self.offsets, end = [], 0
        for part in parts:
            self.offsets.append(end)
            end += -(-len(part) // PAGE) * PAGE
        self.fd = os.memfd_create("edgekv-kv", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, end)
        for at, part in zip(self.offsets, parts):
            done = 0
            while done < len(part):
                done += os.pwrite(self.fd, part[done:], at + done)


class Frozen:
    """The first `nbytes` bytes of an array of `shape` and `dtype`, as segments (file, offset,
    at, length): the array's bytes [at, at + length) are the file's from offset, in order from
    byte 0, every figure a multiple of PAGE."""

    def __init__(self, shape: tuple, dtype, segments: tuple):
        self.shape, self.dtype, self.segments = tuple(shape), np.dtype(dtype), segments
        self.nbytes = segments[-1][2] + segments[-1][3] if segments else 0

    def array(self) -> np.ndarray:
        """A new array: these bytes in shared pages (each written page becomes its own), then zeros."""
        count = int(np.prod(self.shape))
        region = mmap.mmap(-1, max(count * self.dtype.itemsize, self.nbytes, 1))
        base = np.frombuffer(region, np.uint8).ctypes.data
        for f, off, at, length in self.segments:
            if _mmap(base + at, length, _PROT_RW, _MAP_PRIVATE | _MAP_FIXED, f.fd, off) != base + at:
                err = ctypes.get_errno()
                region.close()
                raise OSError(err, "mmap of shared KV pages failed")
        return np.frombuffer(region, self.dtype, count=count).reshape(self.shape)


def freeze(items: list[tuple]) -> list[Frozen]:
    """Frozen of each (a, used, base, clean[, shape]): an array's first `used` bytes, for arrays
    of a's shape (or of `shape`: a holds their first rows). When a was made from `base` (or
    None) and its first `clean` bytes are as base has them, base's whole pages among those are
    reused and only the bytes after them are copied, into one new file for all the items."""
    plans, parts = [], []
    for a, used, base, clean, *shape in items:
        keep = min(clean, used, base.nbytes) // PAGE * PAGE if base is not None else 0
        segments = tuple((f, off, at, min(length, keep - at)) for f, off, at, length in base.segments
                         if at < keep) if keep else ()
        if len(segments) >= MAX_SEGMENTS:  # the first (the oldest prefix, shared the widest) stays
            segments = segments[:1]
            keep = segments[0][2] + segments[0][3]
        part = np.ascontiguousarray(a).reshape(-1).view(np.uint8)[keep:used] if used > keep else None
        plans.append((shape[0] if shape else a.shape, a.dtype, segments, keep, None if part is None else len(parts)))
        if part is not None:
            parts.append(memoryview(part))
    f = _File(parts) if parts else None
    out = []
    for shape, dtype, segments, keep, i in plans:
        if i is not None:
            segments += ((f, f.offsets[i], keep, -(-len(parts[i]) // PAGE) * PAGE),)
        out.append(Frozen(shape, dtype, segments))
    return out
