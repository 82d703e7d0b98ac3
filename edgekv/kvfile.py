"""Files that hold a KV cache (session files, prompt-cache entries): MAGIC, an 8-byte header
length, a JSON header, then the cache's arrays: as an .npz (never pickled; sessions), or raw
(prompt-cache entries, read on the way to a first token): each array's bytes from a 64-byte
boundary, the header's "arrays" naming each one's dtype, shape and offset, so a read is views of
the file's bytes, no archive to unpack. Written atomically
(a temporary file renamed over the target); read back with every check that does not need the
caller's context, so a file from disk is untrusted until `load_cache` has taken it."""
from __future__ import annotations

import io
import json
import os
import re
import struct
import tempfile
from pathlib import Path

import numpy as np

_ARRAY_KEY = re.compile(r"([a-z_]+)(\d+)")  # a cache array's name in the file: its name, then its layer


def cache_arrays(cache) -> tuple[list[dict], dict[str, np.ndarray]]:
    """(per-layer metadata, arrays named "k0", "pos12", ...) of a cache, as LayerKV.state gives them."""
    metas, arrays = [], {}
    for i, lk in enumerate(cache.layers):
        meta, state = lk.state()
        metas.append(meta)
        arrays.update({f"{name}{i}": a for name, a in state.items()})
    return metas, arrays


def load_cache(cache, metas, arrays, n_tokens: int, every_slot: bool = False, share: bool = False) -> None:
    """Take arrays (as `cache_arrays` names them) into cache: copied, or (share) frozen straight
    into shared pages (kvcache.take_frozen). ValueError naming the layer when one does not
    fit; nothing is changed then."""
    from .kvcache import take_frozen

    layers = cache.layers
    if not isinstance(metas, list) or len(metas) != len(layers):
        raise ValueError("layer count")
    per_layer = [{} for _ in layers]
    for key in arrays.files if hasattr(arrays, "files") else arrays:
        m = _ARRAY_KEY.fullmatch(key)
        if m is not None and int(m[2]) < len(layers):
            per_layer[int(m[2])][m[1]] = arrays[key]
    states = []
    for i, (lk, meta, got) in enumerate(zip(layers, metas, per_layer)):
        try:
            if not isinstance(meta, dict):
                raise ValueError("bad metadata")
            states.append(lk.checked(meta, got, n_tokens, every_slot=every_slot))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"layer {i}: {e}") from None
    if share:
        take_frozen(layers, states)
    else:
        for lk, state in zip(layers, states):
            lk.take_state(*state)


ALIGN = 64
RAW_KINDS = "iuf"  # the dtype kinds a raw file may name (bool, object, strings never)


def raw_body(arrays: dict[str, np.ndarray]) -> tuple[list, list]:
    """(the header's "arrays" index, the parts to write) of a raw body."""
    index, parts, at = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        pad = -at % ALIGN
        parts += [b"\0" * pad, a.reshape(-1).view(np.uint8)]
        at += pad
        index.append([name, a.dtype.str, list(a.shape), at])
        at += a.nbytes
    return index, parts


def raw_arrays(index, body: memoryview) -> dict[str, np.ndarray]:
    """Views of body for a raw file's "arrays" index; ValueError unless each entry names a
    numeric dtype, a shape of whole numbers and bytes inside the body."""
    if not isinstance(index, list):
        raise ValueError("no array index")
    out = {}
    for entry in index:
        name, dtype, shape, at = entry  # ValueError / TypeError on anything else
        dt = np.dtype(str(dtype))
        if dt.kind not in RAW_KINDS or not isinstance(shape, list) or not all(
                isinstance(d, int) and d >= 0 for d in shape) or not isinstance(at, int) or at < 0:
            raise ValueError(f"array {name!r}: bad dtype, shape or offset")
        count = int(np.prod(shape, dtype=np.int64))
        if at + count * dt.itemsize > len(body):
            raise ValueError(f"array {name!r} runs past the end")
        out[str(name)] = np.frombuffer(body, dt, count, at).reshape(shape)
    return out


def write_file(path: Path, magic: bytes, header: dict, arrays: dict[str, np.ndarray] | None = None, *,
               parts: list | None = None) -> None:
    """MAGIC + header + arrays as an .npz (or the parts of a raw body, `raw_body`, its index in
    the header) to `path` through a temporary file beside it, fsynced and renamed: a failure
    (OSError, Ctrl-C) leaves the old file, or none, and no temporary file."""
    if parts is None:
        body = io.BytesIO()
        np.savez(body, **arrays)
        parts = [body.getbuffer()]
    blob = json.dumps(header).encode()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
        with os.fdopen(fd, "wb") as f:
            f.write(magic + struct.pack("<Q", len(blob)) + blob)
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise


def body_start(data: bytes, magic: bytes) -> tuple[int, int]:
    """(header start, header length) of a file's bytes; ValueError("not ...") or ("truncated")."""
    start = len(magic) + 8
    if not data.startswith(magic) or len(data) < start:
        raise ValueError("not")
    n = struct.unpack_from("<Q", data, len(magic))[0]
    if start + n > len(data):
        raise ValueError("truncated")
    return start, n


def read_file(data: bytes, magic: bytes, name: str, what: str, error, raw: bool = False) -> tuple[dict, object, memoryview]:
    """(header dict, the arrays (an NpzFile; raw: a dict of views of data), the body's bytes)
    of a file's bytes, or `error` (an edgekv exception class) with one line: not an edgekv
    `what` file, truncated, corrupt."""
    try:
        start, n = body_start(data, magic)
    except ValueError as e:
        raise error(f"{name} is truncated" if str(e) == "truncated" else f"{name} is not an edgekv {what} file") from None
    body = memoryview(data)[start + n:]
    try:
        h = json.loads(data[start:start + n])
        if not isinstance(h, dict):
            raise error(f"{name} is not an edgekv {what} file")
        arrays = raw_arrays(h.get("arrays"), body) if raw else np.load(io.BytesIO(body), allow_pickle=False)
    except error:
        raise
    except Exception as e:
        detail = (str(e).splitlines() or [""])[0][:200]
        raise error(f"{name} is corrupt ({type(e).__name__}{': ' + detail if detail else ''})") from None
    return h, arrays, body
