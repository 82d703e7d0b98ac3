"""Generation: a Sequence (a KV cache and the tokens in it), prefill, decode one token, and
the `generate` iterator of events that the API, the chat and the bench share."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Sequence as Seq

import numpy as np

from .errors import EdgekvError
from .evict import OBSERVE
from .sampling import Sampler

UBATCH = 512  # prefill chunk: bounds activation memory, and the attention working set


@dataclass
class Event:
    """One step of generation: the text it adds (may be "" while a UTF-8 sequence or a
    possible stop string is held back), the token, and on the last event why it ended."""

    text: str
    token: int | None
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "cancelled"
    logprob: float | None = None  # the token's log-probability (generate's logprobs=; Sampler.logprobs)
    top_logprobs: list[tuple[int, float]] | None = None  # the likeliest (token, logprob) pairs at this step


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
    evict: str = "window"  # the cache's eviction policy (edgekv.evict)
    kv_evicted: int = 0  # tokens its policy has overwritten, summed over the evicting layers
    kv_kept_mass: float | None = None  # estimated attention the kept tokens hold (KVCache.evict_stats; None: window)

    def measure_kv(self, cache) -> None:
        """Record how full `cache` is."""
        self.kv_tokens = max((min(lk.n_written, lk.capacity) for lk in cache.layers), default=0)
        self.kv_capacity = max((lk.capacity for lk in cache.layers), default=0)
        self.kv_bytes = cache.nbytes
        self.kv_bytes_used = sum(lk.nbytes * min(lk.n_written, lk.capacity) // lk.capacity for lk in cache.layers)
        if hasattr(cache, "evict_stats"):
            ev = cache.evict_stats()
            self.evict, self.kv_evicted, self.kv_kept_mass = ev["evict"], ev["kv_evicted"], ev["kv_kept_mass"]

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
                    kv_capacity=self.kv_capacity, kv_bytes_used=self.kv_bytes_used, kv_bytes=self.kv_bytes,
                    evict=self.evict, kv_evicted=self.kv_evicted, kv_kept_mass=self.kv_kept_mass)


class Sequence:
    """A KV cache and the token ids it holds, in order. Positions are indices into `tokens`."""

    def __init__(self, llm, cache=None):
        self.llm = llm
        self.cache = cache if cache is not None else llm.new_cache()
        self.tokens: list[int] = []
        self.observe = None  # while feeding a long input: its last ids (an eviction policy's probe)
        self._serial = getattr(llm.backend, "serial", NO_DEFER)  # the backend's: forward passes may take turns

    def fork(self) -> "Sequence":
        """A sequence holding the same tokens in a cache of its own (KVCache.fork: a copy), to go on
        apart from this one: what it computes next is what this one would."""
        sync = getattr(self.llm.backend, "sync_to_host", None)  # a GPU backend holds the rings
        if sync is not None:
            sync(self.cache)
        twin = Sequence(self.llm, self.cache.fork())
        twin.tokens = list(self.tokens)
        return twin

    def feed(self, ids: Seq[int], cancel: threading.Event | None = None) -> np.ndarray | None:
        """Append ids, run them through the model; the logits (n_vocab,) after the last one.
        Long inputs run in chunks; if `cancel` is set between two chunks, stop there and return
        None (the chunks already run stay cached and accounted for)."""
        if len(ids) == 1:  # decode: no chunking
            return self._run(ids)
        logits = None
        self.observe = ids[-OBSERVE:]  # each part's probe, under an eviction policy (LLM.forward)
        try:
            for part in self._parts(ids):
                if cancel is not None and cancel.is_set():
                    return None
                logits = self._run(part)
        finally:
            self.observe = None
        return logits

    def _run(self, ids: Seq[int]) -> np.ndarray:
        return submit(self.llm, [self], [ids])[0]

    def _parts(self, ids: Seq[int]) -> Iterator[Seq[int]]:
        """ids in prefill chunks. A batch that wraps a ring attends over (ring, batch) and only
        ring slots act as attention sinks, so while a ring still lacks its sinks the first chunk
        stops where that ring is full: the sinks are stored before anything is evicted, and a
        prompt longer than the context sees the same sinks + recent window as token-by-token."""
        n, first = len(ids), 0
        rooms = [lk.capacity - lk.n_written for lk in self.cache.layers if lk.n_written < lk.n_sink]
        if rooms and min(rooms) < n:
            first = min(rooms)
        step = min(UBATCH, getattr(self.cache, "batch_limit", None) or UBATCH)  # an evicting ring takes less at once
        cuts = [*range(0, first, step), *range(first, n, step), n]
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


def run(seqs: list[Sequence], parts: list[Seq[int]]) -> list[np.ndarray]:
    """Append parts[j] to seqs[j] (sequences of one LLM, each at most once) and run them through
    the model, several as one batch (LLM.forward_batch); the logits (n_vocab,) after each part."""
    llm = seqs[0].llm
    # A batch that overwrites ring slots cannot be rolled back: Ctrl-C waits until it is done.
    wraps = any(lk.n_written + len(p) > lk.capacity for s, p in zip(seqs, parts) for lk in s.cache.layers)
    with DeferSigint() if wraps else NO_DEFER, seqs[0]._serial:
        try:
            if len(seqs) == 1:
                logits = [llm.forward(parts[0], seqs[0].cache, len(seqs[0].tokens), observe=seqs[0].observe)[-1]]
            else:
                logits = llm.forward_batch([(p, s.cache, len(s.tokens), s.observe) for s, p in zip(seqs, parts)])
        except BaseException:
            # Interrupted (an error) mid-batch: some layers hold this batch, others not.
            # Roll every layer back to the tokens we account for, so each cache stays coherent.
            for s in seqs:
                if not s.cache.trim(len(s.tokens)):
                    s.reset()
            raise
        for s, p in zip(seqs, parts):
            s.tokens.extend(int(i) for i in p)
    return logits


class Batcher:
    """Continuous batching of one LLM's forward passes across threads: each thread submits its
    sequences' next ids (a decode token or a prefill chunk) and waits; a pass gathers what is
    pending (waiting up to `gather_s` until every thread with a sequence still generating has
    submitted), runs it all as one `run` (the decode tokens as one batched step, each prefill
    chunk alone, so a long prompt delays the others by a chunk, never by all of it) and hands
    each thread its logits. A sequence joins when it first submits and drops out when its
    generate ends (`leave`). Each sequence's logits are those of its run alone
    (LLM.forward_batch), whatever else shares the pass.

    Who runs a pass: a thread that generates alone runs its own (no hand-off, and Ctrl-C stops
    a prompt's pass between layers and a decode step after its token, as without a scheduler:
    LLM.forward). While several threads generate, one worker
    thread runs every pass: the kernels' OpenMP pool is that thread's, made once, instead of a
    pool in each thread that led a pass (with two pools alive libgomp's idle workers sleep
    between regions: kernels ran ~2x slower, bench/RESULTS.md). The worker gives its pool back
    and ends when at most one thread is left generating."""

    def __init__(self, gather_s: float = 0.002, release=None):
        self.gather_s = gather_s
        self.release = release  # gives the calling thread's kernel pool back (CPUBackend.release_threads)
        self._cv = threading.Condition()
        self._pending: dict[Sequence, Seq[int]] = {}  # insertion order: arrival order
        self._done: dict[Sequence, object] = {}  # logits, or the exception the pass raised
        # the sequences generating now -> their thread; weak: one fed outside generate (never left) goes with it
        self._owner: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._running: set[Sequence] = set()  # the pass under way (a sequence of it is not popped on Ctrl-C)
        self._busy = False  # a pass is under way
        self._worker: threading.Thread | None = None
        self._led: set[int] = set()  # threads that ran a pass and may still hold a kernel pool

    def submit(self, seqs: list[Sequence], parts: list[Seq[int]]) -> list[np.ndarray]:
        """run(seqs, parts), batched with what other threads submit meanwhile."""
        me = threading.get_ident()
        with self._cv:
            if any(s in self._pending or s in self._done for s in seqs):
                raise EdgekvError("a sequence is fed from two threads at once (one session or generate per thread)")
            self._pending.update(zip(seqs, parts))
            self._owner.update((s, me) for s in seqs)
            self._cv.notify_all()
            try:
                while not all(s in self._done for s in seqs):
                    if self._worker is None and len(set(self._owner.values())) > 1:
                        self._worker = threading.Thread(target=self._serve, name="edgekv-batcher", daemon=True)
                        self._worker.start()
                    if self._worker is not None:
                        if me in self._led:  # this thread's pool goes: the worker's is the one
                            self._led.discard(me)
                            self._release()
                        self._cv.wait()
                    elif self._busy:
                        self._cv.wait()
                    else:
                        self._led.add(me)
                        self._lead()
            except BaseException:  # Ctrl-C while leading or waiting: this thread's entries go
                for s in seqs:
                    self._pending.pop(s, None)
                while any(s in self._running for s in seqs):  # in the worker's pass: it ends first
                    try:
                        self._cv.wait()
                    except KeyboardInterrupt:
                        pass
                for s in seqs:
                    self._done.pop(s, None)
                raise
            outs = [self._done.pop(s) for s in seqs]
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        return outs

    def _release(self) -> None:
        if self.release is not None:
            self.release()

    def _gathered(self) -> bool:
        return set(self._owner.values()) <= {self._owner.get(s) for s in self._pending}

    def _serve(self) -> None:
        """The worker: runs the passes while several threads generate."""
        with self._cv:
            try:
                while self._pending or len(set(self._owner.values())) > 1:
                    if self._pending and not self._busy:
                        self._lead()
                    else:
                        self._cv.wait()
            finally:
                self._worker = None
                self._cv.notify_all()
        self._release()

    def _lead(self) -> None:
        """Run one pass of what is pending; called and returns with the lock held."""
        self._busy = True
        try:
            deadline = time.monotonic() + self.gather_s
            while not self._gathered() and deadline > time.monotonic():
                self._cv.wait(deadline - time.monotonic())
            batch, self._pending = self._pending, {}
            self._running = set(batch)
            worker = threading.current_thread() is self._worker
            others = not worker and len({self._owner.get(s) for s in batch}) > 1
            self._cv.release()
            try:
                # Ctrl-C in the leading (main) thread waits until the other threads have their logits
                with DeferSigint() if others else NO_DEFER:
                    try:
                        outs = run(list(batch), list(batch.values()))
                    except Exception as e:  # every sequence of the pass was rolled back: each thread raises it
                        outs = [e] * len(batch)
                    if others:  # the next pass may be led by another thread
                        self._release()
                    with self._cv:
                        self._done.update(zip(batch, outs))
            finally:
                self._cv.acquire()
        finally:
            self._busy = False
            self._running = set()
            self._cv.notify_all()

    def leave(self, seqs: list[Sequence]) -> None:
        """These sequences will not submit again soon (their generate ended): a pass does not wait for them."""
        with self._cv:
            for s in seqs:
                self._owner.pop(s, None)
            self._led.discard(threading.get_ident())  # generate.leave gives this thread's pool back next
            self._cv.notify_all()


class DeferSigint:
    """Holds back Ctrl-C (SIGINT under Python's default handler, main thread only) for the
    duration of a block and raises KeyboardInterrupt when it ends: around work that must not stop
    half done (a decode step's caches in LLM.forward and forward_batch, a pass that overwrites
    ring slots, a pass other threads wait on). NO_DEFER: the same `with` holding nothing."""

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


NO_DEFER = contextlib.nullcontext()


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


class Turn:
    """One sequence's decoding, a token at a time: `pick` samples from the logits and says what
    to yield and what to feed next, `last` is the final event. `generate` drives one turn;
    `generate_many` drives several and feeds their tokens as one batch."""

    def __init__(self, llm, seq: Sequence, sampler: Sampler, max_tokens: int, stop: Seq[str],
                 cancel: threading.Event | None, stats: Stats, logprobs: int | None = None):
        self.seq, self.sampler, self.left, self.cancel, self.stats = seq, sampler, max_tokens, cancel, stats
        self.logprobs = logprobs  # None: no logprobs on the events; k: each token's and k alternatives'
        self.detok = llm.tokenizer.stream()
        self.stopper = StopMatcher(stop)
        self.eog = llm.tokenizer.eot_ids
        self.reason, self.hit = "length", False

    def pick(self, logits: np.ndarray) -> tuple[Event | None, int | None]:
        """(event to yield or None, token to feed next or None: the turn has ended, `reason` says why)."""
        if self.left <= 0:
            return None, None
        if self.cancel is not None and self.cancel.is_set():
            self.reason = "cancelled"
            return None, None
        tok = self.sampler(logits, self.seq.tokens)
        if tok in self.eog:
            self.reason = "stop"
            return None, None
        text, self.hit = self.stopper.push(self.detok.push(tok))
        self.stats.generated_tokens += 1
        self.left -= 1
        event = Event(text, tok)
        if self.logprobs is not None:
            event.logprob, event.top_logprobs = self.sampler.logprobs(logits, tok, self.logprobs)
        if self.hit:
            self.reason = "stop"
            return event, None
        return event, tok

    def last(self) -> Event:
        """The final event: what was held back (an incomplete stop string, trailing bytes), and why it ended."""
        tail = ""
        if not self.hit:
            tail, self.hit = self.stopper.push(self.detok.flush())
            if not self.hit:
                tail += self.stopper.flush()
        return Event(tail, None, self.reason)


def prefill(llm, seq: Sequence, prompt_ids: Seq[int], cancel: threading.Event | None, stats: Stats, *,
            keep: int = 0, remember: bool = False) -> np.ndarray | None:
    """Feed prompt_ids (reusing whatever prefix seq already holds, or the longest one in
    llm.prompt_cache) and record it in stats; the logits after the last id, or None if
    cancelled between chunks. keep, remember: as `generate`'s."""
    if not prompt_ids:
        raise EdgekvError("empty prompt: nothing to continue from")
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
        return logits
    finally:
        stats.prefill_tokens = len(seq.tokens) - cached
        stats.prefill_s = time.perf_counter() - t0
        stats.measure_kv(seq.cache)


def generate(llm, seq: Sequence, prompt_ids: Seq[int], sampler: Sampler, *, max_tokens: int,
             stop: Seq[str] = (), cancel: threading.Event | None = None, stats: Stats | None = None,
             keep: int = 0, remember: bool = False, logprobs: int | None = None) -> Iterator[Event]:
    """Prefill prompt_ids (reusing whatever prefix seq already holds, or the longest one in
    llm.prompt_cache), then sample up to max_tokens, yielding an Event per token; the last
    event carries finish_reason. keep: prefill prompt_ids[:keep] as a batch of its own and keep
    it in the prompt cache, on disk too, and take nothing else from there (a chat's system
    prompt: a cached one then gives exactly what a cold run gives, edgekv.prompt_cache);
    remember: keep the cache after the prompt (with its logits: the same prompt again needs no
    prefill) and as the call leaves it, in the prompt cache's memory. logprobs: as Turn's."""
    stats = stats if stats is not None else Stats()
    try:
        logits = prefill(llm, seq, prompt_ids, cancel, stats, keep=keep, remember=remember)
    except BaseException:
        leave(llm, [seq])
        raise
    yield from decode(llm, seq, logits, sampler, max_tokens=max_tokens, stop=stop, cancel=cancel, stats=stats,
                      remember=remember, logprobs=logprobs)


def decode(llm, seq: Sequence, logits: np.ndarray | None, sampler: Sampler, *, max_tokens: int,
           stop: Seq[str] = (), cancel: threading.Event | None = None, stats: Stats | None = None,
           remember: bool = False, logprobs: int | None = None) -> Iterator[Event]:
    """generate's sampling part, from a prefilled seq: logits after its last token (None: the
    prefill was cancelled). Several forks of one prefilled sequence (Sequence.fork), each
    decoded in a thread of its own, are n samples of one prompt sharing its prefill."""
    stats = stats if stats is not None else Stats()
    try:
        if logits is None:  # cancelled between prefill chunks
            yield Event("", None, "cancelled")
            return
        t0 = time.perf_counter()
        turn = Turn(llm, seq, sampler, max_tokens, stop, cancel, stats, logprobs)
        try:
            while True:
                event, tok = turn.pick(logits)
                if tok is None:
                    if event is not None:
                        yield event
                    break
                try:
                    yield event  # out before the step that feeds it: time to first token is the prefill's
                except GeneratorExit:  # the caller stops here: the cache still takes every token it was given
                    seq.feed([tok])
                    raise
                logits = seq.feed([tok])
        finally:
            stats.decode_s = time.perf_counter() - t0
            stats.measure_kv(seq.cache)
        pc = getattr(llm, "prompt_cache", None)
        if remember and pc is not None:
            pc.remember(seq)
    finally:
        leave(llm, [seq])
    yield turn.last()


def prefill_forks(llm, seq: Sequence, prompt_ids: Seq[int], cancel: threading.Event | None, stats: list[Stats], *,
                  keep: int = 0, remember: bool = False) -> tuple[list[Sequence], list]:
    """Prefill seq once, then fork it for each further entry of stats, before anything decodes:
    (the sequences, the logits after the prompt for each: own copies, a sampler may write to
    its logits; None if cancelled). Every stats carries the prompt's one prefill."""
    logits = prefill(llm, seq, prompt_ids, cancel, stats[0], keep=keep, remember=remember)
    for st in stats[1:]:
        st.__dict__.update(vars(stats[0]))
    if logits is None:
        return [seq] * len(stats), [None] * len(stats)
    return [seq] + [seq.fork() for _ in stats[1:]], [logits] + [logits.copy() for _ in stats[1:]]


def interleave(streams: list[Iterator[Event]], cancel: threading.Event) -> Iterator[tuple[int, Event]]:
    """(i, event) of every stream as they come, each stream read in a thread of its own (so
    their steps run as one batch). A stream's exception sets cancel (the others stop at their
    next token) and is raised once all have ended; so does leaving the iterator early."""
    import queue

    q: queue.Queue = queue.Queue()

    def read(i: int, events: Iterator[Event]) -> None:
        err = None
        try:
            for e in events:
                q.put((i, e, None))
        except BaseException as exc:  # handed to the reader
            err = exc
        q.put((i, None, err or StopIteration))

    threads = [threading.Thread(target=read, args=(i, events), name=f"edgekv-stream-{i}", daemon=True)
               for i, events in enumerate(streams)]
    for t in threads:
        t.start()
    live, error = len(threads), None
    try:
        while live:
            i, e, end = q.get()
            if end is None:
                yield i, e
                continue
            live -= 1
            if end is not StopIteration and error is None:
                error = end
                cancel.set()
        if error is not None:
            raise error
    finally:
        cancel.set()  # early exit: the rest stop at their next token
        for t in threads:
            t.join()


def forks(llm, prompt_ids: Seq[int], samplers: list[Sampler], *, max_tokens: int, stop: Seq[str] = (),
          cancel: threading.Event | None = None, stats: list[Stats], keep: int = 0, remember: bool = False,
          logprobs: int | None = None) -> list[Iterator[Event]]:
    """One stream per sampler for one prompt (LLM.streams): the first stream read prefills a new
    Sequence and forks it once per further stream, before any of them decodes; each then
    decodes its own (`decode`). Each equals `generate` with its sampler."""
    lock, ready = threading.Lock(), []

    def start() -> tuple[list[Sequence], list]:
        with lock:
            if not ready:
                seq = Sequence(llm)
                try:
                    ready.append(prefill_forks(llm, seq, prompt_ids, cancel, stats, keep=keep, remember=remember))
                except BaseException as e:
                    leave(llm, [seq])
                    ready.append(e)
        if isinstance(ready[0], BaseException):
            raise ready[0]
        return ready[0]

    def stream(i: int) -> Iterator[Event]:
        seqs, logits = start()
        yield from decode(llm, seqs[i], logits[i], samplers[i], max_tokens=max_tokens, stop=stop, cancel=cancel,
                          stats=stats[i], remember=remember and i == 0, logprobs=logprobs)

    return [stream(i) for i in range(len(samplers))]


def submit(llm, seqs: list[Sequence], parts: list[Seq[int]]) -> list[np.ndarray]:
    """run(seqs, parts) through the LLM's Batcher (batched with other threads' passes)."""
    batcher = getattr(llm, "batcher", None)
    return batcher.submit(seqs, parts) if batcher is not None else run(seqs, parts)


def leave(llm, seqs: list[Sequence]) -> None:
    """These sequences' generation has ended (Batcher.leave); this thread is done with kernels for
    now (the backend's release_threads: another thread's passes then run at full speed)."""
    batcher = getattr(llm, "batcher", None)
    if batcher is not None:
        batcher.leave(seqs)
    release = getattr(llm.backend, "release_threads", None)
    if release is not None:
        release()


def usage(prompts: list[Stats], choices: list[Stats]) -> dict:
    """OpenAI's `usage` object: the prompt (and cached) tokens of each prompt once, one Stats per
    prompt, and the generated tokens of every choice."""
    p, c = sum(s.prompt_tokens for s in prompts), sum(s.generated_tokens for s in choices)
    return dict(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                prompt_tokens_details=dict(cached_tokens=sum(s.cached_tokens for s in prompts)))


@dataclass
class Completion:
    """One prompt's result in `generate_many`: what its `generate` events add up to."""

    text: str
    tokens: list[int]  # the generated ids (a stop string's token included, as generate's events)
    finish_reason: str  # "stop", "length" or "cancelled"
    stats: Stats


def generate_many(llm, seqs: list[Sequence], prompts: list[Seq[int]], samplers: list[Sampler], *, n: int = 1,
                  max_tokens: int, stop: Seq[str] = (), cancel: threading.Event | None = None) -> list[Completion]:
    """`generate` for several prompts at once, n samples of each: every prompt is prefilled once
    (alone, in its chunks) into its sequence, which then forks (Sequence.fork) for each further
    sample; then the next tokens of all unfinished samples run as one batch per step (run ->
    LLM.forward_batch), a sample dropping out when it finishes. samplers and the results are
    prompt-major (prompt j's sample i at j * n + i); each result equals its prompt's `generate`
    with its sampler, and its stats carry its prompt's one prefill."""
    runs: list[Sequence] = []
    try:
        logits, stats = [], []
        for seq, p in zip(seqs, prompts):
            runs.append(seq)
            st = [Stats() for _ in range(n)]
            forked, lgs = prefill_forks(llm, seq, p, cancel, st)
            runs += forked[1:]
            stats += st
            logits += lgs
        return decode_many(llm, runs, logits, samplers, stats, max_tokens=max_tokens, stop=stop, cancel=cancel)
    finally:
        leave(llm, runs)


def decode_many(llm, seqs: list[Sequence], logits: list, samplers: list[Sampler], stats: list[Stats], *,
                max_tokens: int, stop: Seq[str] = (), cancel: threading.Event | None = None) -> list[Completion]:
    """Decode prefilled sequences (logits[j]: after seqs[j]'s prompt, None if its prefill was
    cancelled), the next tokens of all unfinished ones as one batch per step."""
    t0 = time.perf_counter()
    turns = [Turn(llm, s, sm, max_tokens, stop, cancel, st) for s, sm, st in zip(seqs, samplers, stats)]
    texts: list[list[str]] = [[] for _ in seqs]
    tokens: list[list[int]] = [[] for _ in seqs]
    for j, lg in enumerate(logits):
        if lg is None:
            turns[j].reason = "cancelled"
    live = [j for j, lg in enumerate(logits) if lg is not None]
    while live:
        feed = []
        for j in live:
            event, tok = turns[j].pick(logits[j])
            if event is not None:
                texts[j].append(event.text)
                tokens[j].append(event.token)
            if tok is None:
                stats[j].decode_s = time.perf_counter() - t0
                leave(llm, [seqs[j]])
            else:
                feed.append((j, tok))
        if feed:
            out = submit(llm, [seqs[j] for j, _ in feed], [[tok] for _, tok in feed])
            for (j, _), lg in zip(feed, out):
                logits[j] = lg
        live = [j for j, _ in feed]
    results = []
    for j, turn in enumerate(turns):
        stats[j].measure_kv(seqs[j].cache)
        results.append(Completion("".join(texts[j]) + turn.last().text, tokens[j], turn.reason, stats[j]))
    return results
