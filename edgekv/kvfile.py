"""Files that hold a KV cache (session files, prompt-cache entries): MAGIC, an 8-byte header
length, a JSON header, then the cache's arrays as an .npz (never pickled). Written atomically
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


def load_cache(cache, metas, arrays, n_tokens: int, every_slot: bool = False) -> None:
    """Take arrays (as `cache_arrays` names them) into cache. ValueError naming the layer when
    one does not fit; layers before it are then already loaded (the caller resets or discards)."""
    layers = cache.layers
    if not isinstance(metas, list) or len(metas) != len(layers):
        raise ValueError("layer count")
    per_layer = [{} for _ in layers]
    for key in arrays.files if hasattr(arrays, "files") else arrays:
        m = _ARRAY_KEY.fullmatch(key)
        if m is not None and int(m[2]) < len(layers):
            per_layer[int(m[2])][m[1]] = arrays[key]
    for i, (lk, meta, got) in enumerate(zip(layers, metas, per_layer)):
        try:
            if not isinstance(meta, dict):
                raise ValueError("bad metadata")
            lk.load_state(meta, got, n_tokens, every_slot=every_slot)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"layer {i}: {e}") from None


def write_file(path: Path, magic: bytes, header: dict, arrays: dict[str, np.ndarray]) -> None:
    """MAGIC + header + arrays to `path` through a temporary file beside it, fsynced and renamed:
    a failure (OSError, Ctrl-C) leaves the old file, or none, and no temporary file."""
    body = io.BytesIO()
    np.savez(body, **arrays)
    blob = json.dumps(header).encode()
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
        with os.fdopen(fd, "wb") as f:
            f.write(magic + struct.pack("<Q", len(blob)) + blob)
            f.write(body.getbuffer())
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


def read_file(data: bytes, magic: bytes, name: str, what: str, error) -> tuple[dict, object, bytes]:
    """(header dict, the arrays (an NpzFile), the body's bytes) of a file's bytes, or `error`
    (an edgekv exception class) with one line: not an edgekv `what` file, truncated, corrupt."""
    try:
        start, n = body_start(data, magic)
    except ValueError as e:
        raise error(f"{name} is truncated" if str(e) == "truncated" else f"{name} is not an edgekv {what} file") from None
    try:
        h = json.loads(data[start:start + n])
        arrays = np.load(io.BytesIO(data[start + n:]), allow_pickle=False)
    except Exception as e:
        raise error(f"{name} is corrupt ({type(e).__name__})") from None
    if not isinstance(h, dict):
        raise error(f"{name} is not an edgekv {what} file")
    return h, arrays, data[start + n:]
