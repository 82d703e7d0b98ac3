"""Generation: a Sequence (a KV cache and the tokens in it), prefill, decode one token, and
the `generate` iterator of events that the API, the chat and the bench share."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence as Seq

import numpy as np

from .errors import EdgekvError
from .sampling import Sampler

UBATCH = 512  # prefill chunk: bounds activation memory, and the attention working set


@dataclass
class Event:
    """One step of generation: the text it adds (may be "" while a UTF-8 sequence or a
    possible stop string is held back), the token, and on the last event why it ended."""

    text: str
    token: int | None
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "cancelled"


@dataclass
class Stats:
    """Counts and timings of one generate call or chat turn (`llm.stats`, `session.stats`)."""

    prompt_tokens: int = 0  # tokens of this call's input
    prefill_tokens: int = 0  # of those, the ones actually computed (the rest were cached)
    cached_tokens: int = 0  # of those, the ones taken from a cache instead of computed
    cached_from: str = ""  # where from: "sequence" (the chat's own cache), "memory" or "disk" (the prompt cache)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_tokens: int = 0  # tokens held by the largest ring after the call (at most its capacity)
    kv_capacity: int = 0  # tokens the largest ring holds (n_ctx)
    kv_bytes_used: int = 0  # bytes of K/V (scales included) filled after the call, all layers
    kv_bytes: int = 0  # bytes allocated for the cache, all layers

    def measure_kv(self, cache) -> None:
        """Record how full `cache` is."""
        self.kv_tokens = max((min(lk.n_written, lk.capacity) for lk in cache.layers), default=0)
        self.kv_capacity = max((lk.capacity for lk in cache.layers), default=0)
        self.kv_bytes = cache.nbytes
        self.kv_bytes_used = sum(lk.nbytes * min(lk.n_written, lk.capacity) // lk.capacity for lk in cache.layers)

    @property
    def prefill_tps(self) -> float:
        """Prefill speed, tokens/s (0 when nothing was prefilled)."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        """Decode speed, tokens/s (0 when nothing was generated)."""
        return self.generated_tokens / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        """The figures as a JSON-ready dict (what `edgekv run --json` prints)."""
        return dict(prompt_tokens=self.prompt_tokens, prefill_tokens=self.prefill_tokens,
                    cached_tokens=self.cached_tokens, cached_from=self.cached_from,
                    generated_tokens=self.generated_tokens, prefill_s=round(self.prefill_s, 4),
                    decode_s=round(self.decode_s, 4), prefill_tokens_per_s=round(self.prefill_tps, 2),
                    decode_tokens_per_s=round(self.decode_tps, 2), kv_tokens=self.kv_tokens,
                    kv_capacity=self.kv_capacity, kv_bytes_used=self.kv_bytes_used, kv_bytes=self.kv_bytes)


class Sequence:
    """A KV cache and the token ids it holds, in order. Positions are indices into `tokens`."""

    def __init__(self, llm):
        self.llm = llm
        self.cache = llm.new_cache()
        self.tokens: list[int] = []
        self._serial = getattr(llm.backend, "serial", _NO_DEFER)  # the backend's: forward passes may take turns

    def feed(self, ids: Seq[int], cancel: threading.Event | None = None) -> np.ndarray | None:
        """Append ids, run them through the model; the logits (n_vocab,) after the last one.
        Long inputs run in chunks; if `cancel` is set between two chunks, stop there and return
        None (the chunks already run stay cached and accounted for)."""
        if len(ids) == 1:  # decode: no chunking
            return self._run(ids)[-1]
        logits = None
        for part in self._parts(ids):
            if cancel is not None and cancel.is_set():
                return None
            logits = self._run(part)
        return logits[-1]

    def _run(self, ids: Seq[int]) -> np.ndarray:
        # A batch that overwrites ring slots cannot be rolled back: Ctrl-C waits until it is done.
        wraps = any(lk.n_written + len(ids) > lk.capacity for lk in self.cache.layers)
        with _DeferSigint() if wraps else _NO_DEFER, self._serial:
            try:
                logits = self.llm.forward(ids, self.cache, len(self.tokens))
            except BaseException:
                # Interrupted (an error) mid-batch: some layers hold this batch, others not.
                # Roll every layer back to the tokens we account for, so the cache stays coherent.
                if not self.cache.trim(len(self.tokens)):
                    self.reset()
                raise
            self.tokens.extend(int(i) for i in ids)
        return logits

    def _parts(self, ids: Seq[int]) -> Iterator[Seq[int]]:
        """ids in prefill chunks. A batch that wraps a ring attends over (ring, batch) and only
        ring slots act as attention sinks, so while a ring still lacks its sinks the first chunk
        stops where that ring is full: the sinks are stored before anything is evicted, and a
        prompt longer than the context sees the same sinks + recent window as token-by-token."""
        n, first = len(ids), 0
        rooms = [lk.capacity - lk.n_written for lk in self.cache.layers if lk.n_written < lk.n_sink]
        if rooms and min(rooms) < n:
            first = min(rooms)
        cuts = [*range(0, first, UBATCH), *range(first, n, UBATCH), n]
        for a, b in zip(cuts, cuts[1:]):
            yield ids[a:b]

    def reuse(self, ids: Seq[int]) -> int:
        """Keep the longest cached prefix shared with ids (rolling the cache back if needed).
        Returns how many leading ids are already cached."""
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)  # the last id must run again: its logits are what we need
        if n < len(self.tokens) and not self.cache.trim(n):
            self.reset()  # the ring has already dropped tokens the prefix needs
            return 0
        del self.tokens[n:]
        return n

    def reset(self) -> None:
        self.cache.reset()
        self.tokens = []


class _DeferSigint:
    """Holds back Ctrl-C (SIGINT under Python's default handler, main thread only) for the
    duration of a block and raises KeyboardInterrupt when it ends."""

    def __enter__(self):
        self.prev = None
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.hit = False
            self.prev = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.hit = True

    def __exit__(self, *exc) -> None:
        if self.prev is not None:
            signal.signal(signal.SIGINT, self.prev)
            if self.hit and exc[0] is None:
                raise KeyboardInterrupt


_NO_DEFER = contextlib.nullcontext()


class StopMatcher:
    """Holds back text that could still become a stop string."""

    def __init__(self, stops: Seq[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        hold = 0
        for s in self.stops:  # longest suffix of pending that is a prefix of a stop string
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate(llm, seq: Sequence, prompt_ids: Seq[int], sampler: Sampler, *, max_tokens: int,
             stop: Seq[str] = (), cancel: threading.Event | None = None, stats: Stats | None = None,
             keep: int = 0, remember: bool = False) -> Iterator[Event]:
    """Prefill prompt_ids (reusing whatever prefix seq already holds, or the longest one in
    llm.prompt_cache), then sample up to max_tokens, yielding an Event per token; the last
    event carries finish_reason. keep: prefill prompt_ids[:keep] as a batch of its own and keep
    it in the prompt cache, on disk too, and take nothing else from there (a chat's system
    prompt: a cached one then gives exactly what a cold run gives, edgekv.prompt_cache);
    remember: keep the cache after the prompt (with its logits: the same prompt again needs no
    prefill) and as the call leaves it, in the prompt cache's memory."""
    if not prompt_ids:
        raise EdgekvError("empty prompt: nothing to continue from")
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    pc = getattr(llm, "prompt_cache", None)
    cached = seq.reuse(prompt_ids)
    stats.cached_from = "sequence" if cached else ""
    logits = None
    if pc is not None:
        cached, source, logits = pc.restore(seq, prompt_ids, cached, exact=keep)
        stats.cached_from = source or stats.cached_from
    stats.cached_tokens = cached
    try:
        if cached < keep < len(prompt_ids):  # the cold run and every later one split the prefill here
            if seq.feed(prompt_ids[cached:keep], cancel) is not None and pc is not None:
                pc.remember(seq, disk=True)
        if logits is None:
            logits = seq.feed(prompt_ids[len(seq.tokens):], cancel)
            if remember and logits is not None and pc is not None:
                pc.remember(seq, logits=logits)
    finally:
        stats.prefill_tokens = len(seq.tokens) - cached
        stats.prefill_s = time.perf_counter() - t0
        stats.measure_kv(seq.cache)
    if logits is None:  # cancelled between prefill chunks
        yield Event("", None, "cancelled")
        return
    t0 = time.perf_counter()
    detok = llm.tokenizer.stream()
    stopper = StopMatcher(stop)
    eog = llm.tokenizer.eot_ids
    reason, hit = "length", False
    try:
        for _ in range(max_tokens):
            if cancel is not None and cancel.is_set():
                reason = "cancelled"
                break
            tok = sampler(logits, seq.tokens)
            if tok in eog:
                reason = "stop"
                break
            text, hit = stopper.push(detok.push(tok))
            stats.generated_tokens += 1
            if hit:
                yield Event(text, tok)
                reason = "stop"
                break
            logits = seq.feed([tok])
            yield Event(text, tok)
    finally:
        stats.decode_s = time.perf_counter() - t0
        stats.measure_kv(seq.cache)
    if remember and pc is not None:
        pc.remember(seq)
    tail = ""
    if not hit:  # release what was held back: an incomplete stop string, trailing bytes
        tail, hit = stopper.push(detok.flush())
        if not hit:
            tail += stopper.flush()
    yield Event(tail, None, reason)
