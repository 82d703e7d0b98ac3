"""The prompt cache: snapshots of a KV cache for token prefixes this model has already computed,
so a call that starts with them loads them instead of prefilling again.

In memory: one entry per `llm.generate` / `llm.chat` call (the cache as the call left it: prompt
and reply) and one per long chat system prompt, found by longest shared prefix (then trimmed to
it), evicted least recently used past a byte budget. An entry is a fork of the sequence's cache
and a restore adopts it (KVCache.fork / adopt): the entry and every sequence restored from it
map the same pages, copy-on-write, so eight chats with one cached system prompt hold one copy of
it plus their own tails; the budget counts each entry whole, as if it were a copy. On disk, under $EDGEKV_HOME/prompt-cache:
the system prompts only (a chat whose system prompt is MIN_TOKENS or longer prefills it as a batch
of its own and keeps that snapshot), one file per prefix named by a hash chain over the model's
identity and the token ids, so the longest cached prefix of a prompt is found from the folder's
listing; written atomically, evicted oldest-used first past a byte cap. A file is untrusted
until checked like a session file (format, model, kv, shapes, dtypes, ranges, a checksum of
the arrays): a bad one is ignored with one warning line.

A ring that has wrapped cannot roll back (LayerKV.trim), so its state is never kept. A loaded
prefix is the cache as the sequence that computed it held it (int kinds' calibration and exact
rows included): the call continues exactly as that sequence would have after rolling back to
the shared length, which is what a chat's next turn gets from Sequence.reuse.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import PromptCacheError
from .evict import EVICT_PREFIX
from .kvcache import LAYER_ARRAYS, KVCache
from .kvfile import cache_arrays, load_cache, raw_body, read_file, write_file

MIN_TOKENS = 256  # a chat system prompt this long is prefilled alone and kept on disk
# A part of a prompt another call computed is taken only from this many tokens on: a restored
# prefix continues as that call would have, not as a cold run (its batches split elsewhere), and
# a chat template's few shared header tokens are not worth a different result.
MIN_REUSE = 32
DEFAULT_MEMORY = 256 * 2**20  # bytes of snapshots kept in memory
DEFAULT_DISK = 2**30  # bytes of files under $EDGEKV_HOME/prompt-cache
MAGIC = b"EDGEKVP\x00"
FORMAT = "edgekv-prompt-cache"
VERSION = 2  # 2: raw arrays (kvfile's raw body), checksum over the body
SUFFIX = ".ekvp"


def default_dir() -> Path:
    """$EDGEKV_HOME/prompt-cache, read from the environment on every call (as hub.models_dir)."""
    from .hub import edgekv_home

    return edgekv_home() / "prompt-cache"


@dataclass
class Entry:
    """A cache holding exactly `tokens` (never a wrapped ring): a fork nobody writes to."""

    tokens: tuple[int, ...]
    cache: KVCache
    logits: np.ndarray | None = None  # (n_vocab,) after the last token, when the snapshot was taken after a prefill

    def __post_init__(self):
        self.nbytes = self.cache.used_nbytes + (self.logits.nbytes if self.logits is not None else 0)


def _checksum(index, parts) -> str:
    """sha256 of a raw body's index and bytes (kvfile.raw_body's parts, or the body read back)."""
    h = hashlib.sha256(json.dumps(index).encode())
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _pack(arrays: dict[str, np.ndarray], n_layer: int) -> dict[str, np.ndarray]:
    """One array per name, the layers stacked (a file of 10 arrays reads faster than of 10 per
    layer): an entry never wrapped, so every layer holds the same tokens and shapes. An eviction
    policy's arrays (evict.Evictor.state) stay per layer: only the evicting layers have them."""
    packed = {name: np.stack([arrays[f"{name}{i}"] for i in range(n_layer)]) for name in LAYER_ARRAYS}
    packed.update({key: a for key, a in arrays.items() if key.startswith(EVICT_PREFIX)})
    return packed


def _unpack(packed, n_layer: int) -> dict[str, np.ndarray]:
    """kvfile's per-layer names for the stacked arrays of a file (views; load_state checks them)."""
    for name in LAYER_ARRAYS:
        if name not in packed or packed[name].ndim < 1 or len(packed[name]) != n_layer:
            raise ValueError(f"array {name} does not hold {n_layer} layers")
    got = {f"{name}{i}": packed[name][i] for name in LAYER_ARRAYS for i in range(n_layer)}
    got.update({key: packed[key] for key in packed if key.startswith(EVICT_PREFIX)})
    return got


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """One per LLM (`llm.prompt_cache`; None with prompt_cache=False). Thread-safe: entries are
    caches nobody writes to, the index is behind a lock."""

    def __init__(self, llm, *, memory_bytes: int = DEFAULT_MEMORY, disk_bytes: int = DEFAULT_DISK,
                 directory: str | os.PathLike | None = None):
        self.llm = llm
        self.memory_bytes, self.disk_bytes = int(memory_bytes), int(disk_bytes)
        self.min_reuse = MIN_REUSE  # tokens past what the sequence holds (a whole prompt with its logits: any)
        self._directory = Path(directory) if directory is not None else None
        self._mem: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        # what every key starts from: a prefix's cache depends on the weights, the kind and the ring
        self._root = hashlib.sha256(json.dumps(dict(model=llm.identity, kv=llm.kv_type, n_ctx=llm.n_ctx,
                                                    n_sink=llm.n_sink), sort_keys=True).encode()).digest()

    @property
    def directory(self) -> Path:
        return self._directory if self._directory is not None else default_dir()

    @property
    def memory_used(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._mem.values())

    # -- the two things generation asks ---------------------------------------------------
    def restore(self, seq, ids, have: int, exact: int = 0) -> tuple[int, str, np.ndarray | None]:
        """Load into seq the longest cached prefix of ids when it is longer than the `have` tokens
        seq already holds of ids: (tokens of ids now cached, "memory" or "disk", the logits after
        the last of them when the snapshot has them, else None); (`have`, "", None) when nothing
        better was found. Only a snapshot of all of ids with its logits covers the last id (its
        logits are what generation needs). exact: only a snapshot of exactly ids[:exact] will do
        (a chat's system prompt, see generate's keep)."""
        limit = exact or len(ids) - 1
        entry, n, source, found = None, have, "", None
        with self._lock:
            if exact:
                entry = self._mem.get(tuple(ids[:exact])) if exact > have else None
                n, source = (exact, "memory") if entry is not None else (n, source)
            else:
                whole = self._mem.get(tuple(ids))
                if whole is not None and whole.logits is not None:
                    entry, n, source = whole, len(ids), "memory"
                else:
                    for e in self._mem.values():  # the longest match; of equal ones the one needing no trim
                        m = min(_common(e.tokens, ids), limit)
                        if m > n or (m == n and entry is not None and len(e.tokens) < len(entry.tokens)):
                            entry, n, source = e, m, "memory"
                    if entry is not None and n - have < self.min_reuse:
                        entry, n, source = None, have, ""
            if entry is not None:
                self._mem.move_to_end(entry.tokens)
        if self.disk_bytes > 0 and limit > n:
            found = self._find_on_disk(ids, limit, limit - 1 if exact else max(n, have + self.min_reuse - 1))
        if found is not None:
            tokens, metas, arrays = found
            cache = self.llm.new_cache()
            try:  # shapes, dtypes, ranges checked; the file's arrays frozen straight into shared pages
                load_cache(cache, metas, arrays, len(tokens), share=True)
            except ValueError as e:
                self._warn(self._names(tokens, len(tokens))[-1], f"an entry is corrupt: {e}; not used")
                return have, "", None
            entry, n, source = Entry(tokens, cache), len(tokens), "disk"
            self._keep(entry)
        elif entry is None:
            return have, "", None
        seq.cache.adopt(entry.cache)
        if n < len(entry.tokens):
            seq.cache.trim(n)
        seq.tokens = list(ids[:n])
        return n, source, entry.logits.copy() if n == len(ids) else None  # a sampler may write to its logits

    def remember(self, seq, *, logits: np.ndarray | None = None, disk: bool = False) -> None:
        """Keep a snapshot of seq's cache for the tokens it holds (with the logits after the last
        one, when given; and write it to disk), unless a ring has wrapped (it cannot be rolled
        back) or it would not fit the budget."""
        tokens = tuple(seq.tokens)
        if len(tokens) < 2 or any(lk.n_written > lk.capacity for lk in seq.cache.layers):
            return
        with self._lock:
            entry = self._mem.get(tokens)
            if entry is not None and (logits is None or entry.logits is not None):
                self._mem.move_to_end(tokens)
            else:
                entry = None
        cache = entry.cache if entry is not None else seq.cache
        if entry is None:
            sync = getattr(self.llm.backend, "sync_to_host", None)  # a GPU backend holds the rings
            if sync is not None:
                sync(seq.cache)
            if seq.cache.used_nbytes <= self.memory_bytes:  # else too big to keep (a 7B cache of thousands of tokens)
                self._keep(Entry(tokens, seq.cache.fork(), None if logits is None else np.array(logits)))
        if disk and self.disk_bytes > 0:
            self._write(tokens, cache)

    def clear(self) -> None:
        """Forget the entries in memory (the files stay)."""
        with self._lock:
            self._mem.clear()

    def _keep(self, entry: Entry) -> None:
        if entry.nbytes > self.memory_bytes:
            return
        with self._lock:
            self._mem[entry.tokens] = entry
            total = sum(e.nbytes for e in self._mem.values())
            while total > self.memory_bytes:
                _, old = self._mem.popitem(last=False)
                total -= old.nbytes

    # -- disk ---------------------------------------------------------------------------
    def _names(self, ids, limit: int) -> list[str]:
        """File names of the prefixes ids[:1] .. ids[:limit]: a hash chain, one step per token."""
        h, names = self._root, []
        for t in ids[:limit]:
            h = hashlib.sha256(h + struct.pack("<q", int(t))).digest()
            names.append(h.hex()[:40] + SUFFIX)
        return names

    def _find_on_disk(self, ids, limit: int, longer_than: int) -> tuple | None:
        d = self.directory
        try:
            present = set(os.listdir(d))
        except OSError:
            return None
        names = self._names(ids, limit)
        for n in range(limit, longer_than, -1):
            name = names[n - 1]
            if name not in present:
                continue
            entry = self._read(d / name, ids[:n])
            if entry is not None:
                try:
                    os.utime(d / name)  # recently used: evicted last
                except OSError:
                    pass
                return entry
        return None

    def _read(self, path: Path, ids) -> tuple | None:
        """(tokens, per-layer metadata, arrays) in path, for the prefix ids, or None after one warning line (a bad file is
        never used, and is warned about once per process; the cold run that follows replaces
        it). Shapes, dtypes and ranges are checked as `restore` loads it (LayerKV.load_state)."""
        llm = self.llm
        try:
            try:
                data = path.read_bytes()
            except OSError as e:
                raise PromptCacheError(f"cannot read it: {e.strerror or e}") from None
            h, arrays, body = read_file(data, MAGIC, path.name, "prompt-cache", PromptCacheError, raw=True)
            if h.get("format") != FORMAT or h.get("version") != VERSION:
                raise PromptCacheError(f"{path.name} is not an edgekv prompt-cache file of version {VERSION}")
            if h.get("model") != llm.identity:
                raise PromptCacheError(f"{path.name} was written for another model")
            if (h.get("kv"), h.get("n_ctx"), h.get("n_sink")) != (llm.kv_type, llm.n_ctx, llm.n_sink):
                raise PromptCacheError(f"{path.name} was written for another cache (kv={h.get('kv')} ctx={h.get('n_ctx')})")
            try:
                tokens = tuple(int(t) for t in h["tokens"])
                if tokens != tuple(int(t) for t in ids):
                    raise ValueError("its tokens are not the prefix its name stands for")
                packed = arrays
                if h.get("arrays_sha256") != _checksum(h["arrays"], [body]):
                    raise ValueError("its arrays do not match their checksum")
                metas = h["layers"]
                if not isinstance(metas, list) or any(not isinstance(m, dict) or m.get("n_written") != len(tokens)
                                                      for m in metas):
                    raise ValueError("its layers do not hold exactly its tokens")
                got = _unpack(packed, len(metas))
            except Exception as e:  # anything a damaged file makes numpy, zipfile or the checks raise
                raise PromptCacheError(f"{path.name} is corrupt: {e or type(e).__name__}") from None
        except PromptCacheError as e:
            self._warn(path.name, f"{e}; not used")
            return None
        return tokens, metas, got

    def _write(self, tokens: tuple, cache: KVCache) -> None:
        d = self.directory
        path = d / self._names(tokens, len(tokens))[-1]
        metas, arrays = cache_arrays(cache)
        if sum(a.nbytes for a in arrays.values()) > self.disk_bytes:
            return
        try:
            if path.exists() and path.name not in self._warned:  # a bad file of that name is replaced
                os.utime(path)
                return
            d.mkdir(parents=True, exist_ok=True)
            llm = self.llm
            index, parts = raw_body(_pack(arrays, len(metas)))
            header = dict(format=FORMAT, version=VERSION, model=llm.identity, kv=llm.kv_type, n_ctx=llm.n_ctx,
                          n_sink=llm.n_sink, tokens=list(tokens), layers=metas, arrays=index,
                          arrays_sha256=_checksum(index, parts))
            write_file(path, MAGIC, header, parts=parts)
            self._evict(d, keep=path.name)
        except OSError as e:  # a full disk, a read-only home: the chat goes on without it
            self._warn(path.name, f"cannot write {path}: {e.strerror or e}")

    def _evict(self, d: Path, keep: str) -> None:
        """Delete the least recently used files until the folder holds at most disk_bytes."""
        files = []
        for p in d.iterdir():
            if p.suffix == SUFFIX:
                try:
                    st = p.stat()
                except OSError:
                    continue
                files.append((p.name == keep, st.st_mtime, st.st_size, p))
        total = sum(f[2] for f in files)
        for _, _, size, p in sorted(files, key=lambda f: (f[0], f[1])):
            if total <= self.disk_bytes:
                break
            try:
                p.unlink()
                total -= size
            except OSError:
                pass

    def _warn(self, name: str, message: str) -> None:
        if name in self._warned:
            return
        self._warned.add(name)
        warnings.warn(f"prompt cache: {message}", stacklevel=2)


_MEMO_LOCK = threading.Lock()


def system_prefix(llm, messages, ids, *, tools=None, template_vars=None) -> int:
    """Tokens at the start of a chat's ids that stand for its system prompt (the system turn as
    the template writes it, up to where the first user message starts), when they are MIN_TOKENS
    or more; else 0. Found by rendering two probe messages after the system prompt: their shared
    leading ids do not depend on what the user wrote. Memoized per system prompt."""
    if not messages or not isinstance(messages[0], dict) or messages[0].get("role") != "system":
        return 0
    content = messages[0].get("content")
    least = MIN_TOKENS  # not the prompt cache's setting: cached or not, a chat splits its prefill alike
    if not isinstance(content, str) or len(content) < least:  # fewer characters than tokens needed
        return 0
    key = (least, content, json.dumps(tools, sort_keys=True, default=str), json.dumps(template_vars or {}, sort_keys=True,
                                                                             default=str))
    with _MEMO_LOCK:
        memo = llm.__dict__.setdefault("_system_prefixes", OrderedDict())
        prefix = memo.get(key)
    if prefix is None:
        probe = [llm.chat_ids(llm.template.render([messages[0], {"role": "user", "content": c}],
                                                  add_generation_prompt=True, tools=tools, **(template_vars or {})))
                 for c in ("a", "b")]
        n = _common(*probe)
        prefix = probe[0][:n] if n >= least else []
        with _MEMO_LOCK:
            memo[key] = prefix
            while len(memo) > 16:
                memo.popitem(last=False)
    n = len(prefix)
    return n if n and n < len(ids) and list(ids[:n]) == prefix else 0
