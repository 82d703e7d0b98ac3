"""`edgekv serve`: an OpenAI-compatible HTTP server over one loaded LLM.

A request is checked and turned into a Job (each prompt as token ids, sampling, n, stop,
logprobs) before anything runs; it waits for free sequences (`--parallel`), then each of its
choices generates in a thread of its own, so the engine's Batcher runs the decode steps of
every request in flight as one batch. Events come back to the event loop through a queue and
leave as server-sent events or one JSON body. A client that goes away sets its job's cancel
Event: its threads end within a token and its sequences are free again.

HTTP: starlette (routing, requests, responses) on uvicorn (the ASGI server), from the optional
extra `edgekv[server]`; nothing else in edgekv imports this module.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import math
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import __version__
from .errors import EdgekvError
from .generate import Stats, usage

MAX_BODY = 4 * 2**20  # bytes of a request body: a long chat is tens of KB; images are refused anyway
MAX_STOP = 16  # stop strings per request
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's limit
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class RequestError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code=code)


# --- request fields: JSON values checked before use -------------------------------------------

def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _bad(f"{name} must be an integer {f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'}, got {v!r}",
                   name)
    return v


def _num(body: dict, name: str, lo: float, hi: float):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise _bad(f"{name} must be a number in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{name} must be true or false, got {v!r}", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP:
        raise _bad(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    return [s for s in stops if s]


def _logit_bias(body: dict, n_vocab: int) -> dict[int, float] | None:
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("logit_bias must be an object of token id -> bias", "logit_bias")
    out = {}
    for k, b in v.items():
        tok = int(k) if isinstance(k, str) and k.isdigit() else -1
        if not 0 <= tok < n_vocab:
            raise _bad(f"logit_bias: {k!r} is not a token id in [0, {n_vocab})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad(f"logit_bias[{k}] must be a number in [-100, 100], got {b!r}", "logit_bias")
        out[tok] = float(b)
    return out


def _unsupported(body: dict, names: tuple[str, ...]) -> None:
    """Fields edgekv cannot honour are refused, not dropped: a client relying on one must know."""
    for name in names:
        v = body.get(name)
        if v is None or v is False or v == [] or (name == "tool_choice" and v == "none") or (name == "best_of" and v == 1):
            continue
        raise _bad(f"{name} is not supported by this server", name, "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise _bad("response_format other than {\"type\": \"text\"} is not supported", "response_format",
                   "unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _bad("only text output is supported", "modalities", "unsupported_parameter")


# --- jobs -------------------------------------------------------------------------------------

@dataclass(eq=False)  # a job is itself (kept in sets), not equal to another with the same fields
class Job:
    """One request, checked: what each of its choices runs."""

    kind: str  # "chat" or "text" (/v1/completions)
    prompts: list[tuple[list[int], int]]  # (token ids, prompt-cache keep) per prompt
    n: int  # choices per prompt
    limits: list[int]  # max_tokens per prompt (at most what fits the context)
    stop: list[str]
    sampling: dict  # generate's sampling keywords, seed excepted
    seed: int | None
    logprobs: int | None  # None: no logprobs; k: each token's and k alternatives'
    stream: bool
    include_usage: bool
    model: str
    id: str = ""
    created: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    shutdown: bool = False  # cancelled because the server stops

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @property
    def width(self) -> int:
        """Sequences the job generates at once."""
        return len(self.prompts) * self.n


def _messages(body: dict) -> list[dict]:
    """OpenAI chat messages as the chat template takes them: text content only."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where)
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise _bad(f"{where}: tool and function messages are not supported by this server", where,
                       "unsupported_parameter")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"{where}.role must be system, developer, user or assistant, got {role!r}", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise _bad(f"{where}: content parts of type {kind!r} are not supported (text only)", where,
                               "unsupported_content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or a list of text parts", where)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _prompts(body: dict, service: "Service") -> list[list[int]]:
    """/v1/completions' prompt: a string, a list of token ids, or a list of either."""
    llm = service.llm
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise _bad("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
    out = []
    for one in p:
        if isinstance(one, str):
            service.check_length(len(one.encode("utf-8", "surrogatepass")), "prompt")
            ids = llm.tokenize(one)
        elif isinstance(one, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in one):
            if any(not 0 <= t < llm.cfg.n_vocab for t in one):
                raise _bad(f"prompt: token ids must be in [0, {llm.cfg.n_vocab})", "prompt")
            ids = list(one)
        else:
            raise _bad("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
        if not ids:
            raise _bad("prompt is empty: nothing to continue from", "prompt")
        out.append(ids)
    return out


def parse(service: "Service", kind: str, body: dict) -> Job:
    """Check a /v1/chat/completions (kind "chat") or /v1/completions ("text") body -> Job; RequestError if bad."""
    llm = service.llm
    service.check_model(body.get("model"))
    if kind == "chat":
        _unsupported(body, ("tools", "tool_choice", "functions", "function_call", "audio", "prediction",
                            "web_search_options"))
        msgs = _messages(body)
        service.check_length(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in msgs), "messages")
        try:
            prompts = [llm.chat_prompt(msgs)]
        except EdgekvError as e:  # the template refused these messages (e.g. roles out of order)
            raise _bad(f"messages: {e}", "messages") from None
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
        max_tokens = _int(body, "max_completion_tokens", None, 0)
        max_tokens = _int(body, "max_tokens", None, 0) if max_tokens is None else max_tokens
    else:
        _unsupported(body, ("suffix", "echo", "best_of"))
        prompts = [(ids, 0) for ids in _prompts(body, service)]
        logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        max_tokens = _int(body, "max_tokens", 16, 0)  # OpenAI's default for completions
    n = _int(body, "n", 1, 1)
    if n * len(prompts) > service.parallel:
        raise _bad(f"n x prompts = {n * len(prompts)} sequences, more than this server runs at once "
                   f"(--parallel {service.parallel})", "n")
    limits = []
    for ids, _ in prompts:
        room = llm.n_ctx - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise _bad(f"this model's context is {llm.n_ctx} tokens; the prompt has {len(ids)}"
                       + (f" and max_tokens asks for {max_tokens} more" if room >= 1 else ", leaving no room for a reply"),
                       "messages" if kind == "chat" else "prompt", "context_length_exceeded")
        limits.append(room if max_tokens is None else max_tokens)
    sampling = {k: v for k, v in (("temperature", _num(body, "temperature", 0.0, 2.0)),
                                  ("top_p", _num(body, "top_p", 0.0, 1.0)),
                                  ("presence_penalty", _num(body, "presence_penalty", -2.0, 2.0)),
                                  ("frequency_penalty", _num(body, "frequency_penalty", -2.0, 2.0)),
                                  ("logit_bias", _logit_bias(body, llm.cfg.n_vocab)),
                                  # llama-server's extensions (extra_body in the openai client)
                                  ("top_k", _int(body, "top_k", None, 0)),
                                  ("min_p", _num(body, "min_p", 0.0, 1.0)),
                                  ("repeat_penalty", _num(body, "repeat_penalty", 0.0, 10.0))) if v is not None}
    try:
        llm.sampling(**sampling)
    except EdgekvError as e:
        raise _bad(str(e)) from None
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return Job(kind=kind, prompts=prompts, n=n, limits=limits, stop=_stop(body), sampling=sampling,
               seed=_int(body, "seed", None, 0, 2**64 - 1), logprobs=logprobs, stream=_bool(body, "stream"),
               include_usage=_bool(opts or {}, "include_usage"), model=service.model_id)


# --- running a job ----------------------------------------------------------------------------

class Slots:
    """--parallel sequences, handed out first come first served (a job takes one per choice)."""

    def __init__(self, n: int):
        self.total = self.free = n
        self.waiting: collections.deque = collections.deque()  # (width, future), arrival order

    async def acquire(self, k: int) -> None:
        if not self.waiting and self.free >= k:
            self.free -= k
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (k, fut)
        self.waiting.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give them back
                self.release(k)
            else:
                if entry in self.waiting:
                    self.waiting.remove(entry)
                self._grant()  # the ones behind it may fit now
            raise

    def release(self, k: int) -> None:
        self.free += k
        self._grant()

    def _grant(self) -> None:
        while self.waiting and (self.waiting[0][1].done() or self.waiting[0][0] <= self.free):
            k, fut = self.waiting.popleft()
            if not fut.done():  # done: cancelled, its task not yet told
                self.free -= k
                fut.set_result(None)


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: list[tuple[int, float, list]] = field(default_factory=list)  # (token, logprob, top) with logprobs
    reason: str | None = None
    stats: Stats | None = None
    error: Exception | None = None


def loopback(host: str) -> bool:
    """localhost, 127.x.x.x or ::1."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Service:
    """The model behind the HTTP routes: admission, the choices' threads, counters for /health."""

    def __init__(self, llm, *, model_id: str, aliases=(), parallel: int = 4, api_key: str | None = None,
                 log=None, local_only: bool = False):
        self.llm, self.model_id, self.parallel, self.api_key = llm, model_id, parallel, api_key
        self.local_only = local_only  # listening on loopback: refuse other Host names
        self.max_token_bytes: int | None = None  # the vocabulary's longest token, once needed
        self.names = {model_id, *aliases}
        self.slots = Slots(parallel)
        self.log = log or (lambda record: None)
        self.jobs: set[Job] = set()
        self.closing = False
        self.lock = threading.Lock()
        self.sequences = 0  # choices generating now (their threads alive)
        self.counts = collections.Counter()  # requests by outcome, tokens generated
        self.started = time.time()
        self._stopping: asyncio.Event | None = None

    # -- checks
    def check_model(self, name) -> None:
        if name is None:
            return  # OpenAI requires it; a local server with one model can do without
        if not isinstance(name, str) or name not in self.names:
            raise RequestError(404, f"The model {name!r} does not exist; this server has {self.model_id!r} "
                               "(GET /v1/models)", param="model", code="model_not_found")

    def check_host(self, host: str | None) -> None:
        """On a loopback address, only requests for a loopback name: a site whose name a browser
        resolves to 127.0.0.1 (DNS rebinding) must not reach the model."""
        if not self.local_only:
            return
        host = host or ""
        name = host[1:].partition("]")[0] if host.startswith("[") else host.partition(":")[0] if host.count(":") == 1 \
            else host  # without the port
        if not loopback(name):
            raise RequestError(403, f"Host {host!r} is not this machine's: this server answers localhost only",
                               code="forbidden_host")

    def check_length(self, nbytes: int, param: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit the context (tokenizing a body's
        megabytes would cost seconds): no token stands for more than max_token_bytes."""
        if self.max_token_bytes is None:
            tok = self.llm.tokenizer
            self.max_token_bytes = max(len(tok.token_bytes(i)) for i in range(tok.n_vocab))
        if nbytes > 2 * self.llm.n_ctx * max(self.max_token_bytes, 1):
            raise _bad(f"this model's context is {self.llm.n_ctx} tokens; {nbytes} bytes of text cannot fit it",
                       param, "context_length_exceeded")

    def authorize(self, header: str | None) -> None:
        if self.api_key is None:
            return
        scheme, _, key = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise RequestError(401, "Incorrect or missing API key (send Authorization: Bearer KEY)",
                               code="invalid_api_key")

    def health(self) -> dict:
        return dict(status="shutting_down" if self.closing else "ok", model=self.model_id, slots_total=self.parallel,
                    slots_idle=self.slots.free, active_sequences=self.sequences,
                    waiting_requests=len(self.slots.waiting), counts=dict(self.counts))

    # -- lifecycle
    def stopping(self) -> asyncio.Event:
        if self._stopping is None:
            self._stopping = asyncio.Event()
        return self._stopping

    def shutdown(self) -> None:
        """Stop taking requests; cancel the running ones (each ends within a token). Event loop thread."""
        self.closing = True
        self.stopping().set()
        for job in list(self.jobs):
            job.shutdown = True
            job.cancel.set()

    # -- a job
    async def admit(self, job: Job, gone: asyncio.Future) -> bool:
        """Wait for the job's sequences; False if the client left or the server stops first."""
        if self.closing:
            return False
        acquire = asyncio.ensure_future(self.slots.acquire(job.width))
        stop = asyncio.ensure_future(self.stopping().wait())
        await asyncio.wait({acquire, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if acquire.done() and not (gone.done() or self.closing):
            self.jobs.add(job)
            return True
        acquire.cancel()
        try:
            await acquire
            self.slots.release(job.width)  # granted as we gave up
        except asyncio.CancelledError:
            pass
        return False

    def start(self, job: Job) -> asyncio.Queue:
        """Start a thread per choice; the queue gets ("event", i, Event), ("error", i, exc) and,
        last for each choice, ("done", i, Stats)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: the server is gone, nobody reads this
                pass

        choices = []  # every stream made before any thread starts: a failure here leaves nothing running
        for (ids, keep), limit in zip(job.prompts, job.limits):
            stats = [Stats() for _ in range(job.n)]
            # the prompt's n choices share one prefill (choice j seeded seed + j)
            choices += zip(self.llm.streams(ids, job.n, max_tokens=limit, stop=job.stop, cancel=job.cancel,
                                            stats=stats, keep=keep, logprobs=job.logprobs, seed=job.seed,
                                            **job.sampling), stats)
        for i, (events, st) in enumerate(choices):
            threading.Thread(target=self._choice, args=(i, events, st, put), name=f"edgekv-{job.id}-{i}",
                             daemon=True).start()
        return queue

    def _choice(self, i: int, events, stats: Stats, put) -> None:
        with self.lock:
            self.sequences += 1
        try:
            for e in events:
                put(("event", i, e))
        except Exception as exc:  # an EdgekvError or a bug: this request fails, the server goes on
            put(("error", i, exc))
        finally:
            with self.lock:
                self.sequences -= 1
            put(("done", i, stats))

    def finish(self, job: Job) -> None:
        self.jobs.discard(job)
        self.slots.release(job.width)


# --- response shapes (OpenAI's) ---------------------------------------------------------------

def _token_entry(tok_obj, tok: int, lp: float) -> dict:
    b = tok_obj.token_bytes(tok)
    return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}


def _logprobs(job: Job, llm, tokens: list, offset: int = 0) -> dict | None:
    """The logprobs object of a choice (or of a stream chunk) for tokens [(token, logprob, top)]."""
    if job.logprobs is None:
        return None
    tok = llm.tokenizer
    if job.kind == "chat":
        return {"content": [dict(_token_entry(tok, t, lp), top_logprobs=[_token_entry(tok, a, alp) for a, alp in top])
                            for t, lp, top in tokens], "refusal": None}
    texts = [tok.token_bytes(t).decode("utf-8", "replace") for t, _, _ in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [{tok.token_bytes(a).decode("utf-8", "replace"): alp for a, alp in top}
                             for _, _, top in tokens], "text_offset": offsets}


def _error(exc: Exception) -> RequestError:
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, EdgekvError):
        return _bad(str(exc))
    return RequestError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


SHUTTING_DOWN = RequestError(503, "the server is shutting down", type="server_error", code="server_shutting_down")


class Generation:
    """The ASGI response of a job: runs its choices, streams server-sent events or sends one
    JSON body when all are done. A client that disconnects sets the job's cancel Event at once."""

    def __init__(self, service: Service, job: Job, log_info: dict):
        self.service, self.job, self.info = service, job, log_info
        self.choices = [Choice(i) for i in range(job.width)]
        self.sent_ok = True
        self.answered = False  # the whole answer was handed to the server
        self.left = False  # the client went away before that

    async def __call__(self, scope, receive, send) -> None:
        svc, job = self.service, self.job
        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(self._gone)
        t0 = time.perf_counter()
        status = 499  # the client left before an answer (nginx's code)
        try:
            if not await svc.admit(job, gone):
                if not gone.done():
                    status = await _send_json(send, SHUTTING_DOWN.status, SHUTTING_DOWN.body())
                return
            try:
                queue = svc.start(job)
                status = await (self._stream(send, queue) if job.stream else self._respond(send, queue))
            except Exception:
                status = 500
                raise
            finally:
                svc.finish(job)
        finally:
            gone.cancel()
            outcome = "shutdown" if job.shutdown else "cancelled" if self.left else "ok" if status < 400 else "failed"
            svc.counts[f"requests_{outcome}"] += 1
            u = self._usage()
            decode_s = max((c.stats.decode_s for c in self.choices if c.stats is not None), default=0.0)
            svc.log(dict(self.info, status=status, seconds=round(time.perf_counter() - t0, 3), n=job.width,
                         prompt_tokens=u["prompt_tokens"], cached_tokens=u["prompt_tokens_details"]["cached_tokens"],
                         completion_tokens=u["completion_tokens"], outcome=outcome,
                         decode_tokens_per_s=round(u["completion_tokens"] / decode_s, 1) if decode_s else 0.0))

    def _gone(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and not self.answered:
            self.left = True
        self.job.cancel.set()  # the threads end within a token (a no-op once they have)

    async def _results(self, queue: asyncio.Queue):
        """(kind, choice) as the threads report, until every choice is done."""
        left = len(self.choices)
        while left:
            kind, i, x = await queue.get()
            c = self.choices[i]
            if kind == "event":
                c.text.append(x.text)
                if x.logprob is not None:
                    c.tokens.append((x.token, x.logprob, x.top_logprobs))
                c.reason = x.finish_reason or c.reason
                if x.token is not None:
                    self.service.counts["tokens_generated"] += 1
            elif kind == "error":
                c.error = x
            else:
                c.stats, left = x, left - 1
            yield kind, c, x

    def _failure(self) -> RequestError | None:
        """Why the job has no answer to give: a choice's error, or the server's shutdown."""
        errs = [c.error for c in self.choices if c.error is not None]
        if errs:
            return _error(errs[0])
        if self.job.shutdown and any(c.reason == "cancelled" for c in self.choices):
            return SHUTTING_DOWN
        return None

    def _usage(self) -> dict:
        st = [c.stats or Stats() for c in self.choices]
        return usage(st[:: self.job.n], st)  # each prompt once: its first choice's figures

    def _head(self, obj: str) -> dict:
        j = self.job
        return dict(id=j.id, object=obj, created=j.created, model=j.model, system_fingerprint=f"edgekv-{__version__}")

    async def _respond(self, send, queue) -> int:
        async for _ in self._results(queue):
            pass
        err = self._failure()
        if err is not None:
            self.answered = True
            return await _send_json(send, err.status, err.body())
        llm, job = self.service.llm, self.job
        out = []
        for c in self.choices:
            lp = _logprobs(job, llm, c.tokens)
            if job.kind == "chat":
                out.append(dict(index=c.index, message={"role": "assistant", "content": "".join(c.text)}, logprobs=lp,
                                finish_reason=c.reason))
            else:
                out.append(dict(index=c.index, text="".join(c.text), logprobs=lp, finish_reason=c.reason))
        body = dict(self._head("chat.completion" if job.kind == "chat" else "text_completion"), choices=out,
                    usage=self._usage())
        self.answered = True
        return await _send_json(send, 200, body)

    async def _stream(self, send, queue) -> int:
        job, llm = self.job, self.service.llm
        obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        extra = {"usage": None} if job.include_usage else {}
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def chunk(choices: list) -> None:
            await self._sse(send, dict(self._head(obj), choices=choices, **extra))

        if job.kind == "chat":
            await chunk([dict(index=c.index, delta={"role": "assistant", "content": ""}, logprobs=None,
                              finish_reason=None) for c in self.choices])
        offsets = [0] * len(self.choices)
        async for kind, c, x in self._results(queue):
            if kind != "event" or (x.finish_reason == "cancelled" and job.shutdown):
                continue
            if not x.text and x.logprob is None and x.finish_reason is None:
                continue  # a token whose text is held back: nothing to say yet
            lp = _logprobs(job, llm, [c.tokens[-1]], offsets[c.index]) if x.logprob is not None else None
            if lp is not None and job.kind == "text":
                offsets[c.index] += len(lp["tokens"][0])
            reason = x.finish_reason if x.finish_reason != "cancelled" else None
            if job.kind == "chat":
                await chunk([dict(index=c.index, delta={"content": x.text} if x.text else {}, logprobs=lp,
                                  finish_reason=reason)])
            else:
                await chunk([dict(index=c.index, text=x.text, logprobs=lp, finish_reason=reason)])
        err = self._failure()
        if err is not None:
            await self._sse(send, err.body())
        elif job.include_usage:
            await self._sse(send, dict(self._head(obj), choices=[], usage=self._usage()))
        self.answered = True
        if self.sent_ok:
            try:
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            except OSError:
                pass
        return 200 if err is None else err.status

    async def _sse(self, send, obj: dict) -> None:
        if not self.sent_ok:
            return
        try:
            await send({"type": "http.response.body", "body": b"data: " + _dumps(obj) + b"\n\n", "more_body": True})
        except OSError:  # the connection broke: stop writing, let the threads end
            self.sent_ok = False
            self.job.cancel.set()


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


async def _send_json(send, status: int, body: dict) -> int:
    data = _dumps(body)
    try:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})
    except OSError:
        pass
    return status


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the body is read by then: what comes next is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# --- the app ----------------------------------------------------------------------------------

async def _read_json(request) -> dict:
    # A web page can make a browser send text/plain anywhere, but application/json to another site
    # only after asking it (CORS preflight, which this server never grants): pages cannot use it.
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind != "application/json":
        raise RequestError(415, f"Content-Type must be application/json, got {kind or 'none'!r}",
                           code="unsupported_media_type")
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
        raise RequestError(413, f"the request body is over {MAX_BODY} bytes", code="request_too_large")
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > MAX_BODY:
            raise RequestError(413, f"the request body is over {MAX_BODY} bytes", code="request_too_large")
    try:
        body = json.loads(buf)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise _bad("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


def make_app(service: Service):
    """The starlette app: the OpenAI routes, /health, OpenAI-shaped errors for everything."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def error_response(err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    def endpoint(handler, *, auth: bool = True):
        async def run(request):
            try:
                service.check_host(request.headers.get("host"))
                if auth:
                    service.authorize(request.headers.get("authorization"))
                return await handler(request)
            except RequestError as e:
                service.counts["requests_refused"] += 1
                service.log(dict(method=request.method, path=request.url.path, status=e.status, error=e.message))
                return error_response(e)
        return run

    def generation(kind: str):
        async def handler(request):
            if service.closing:
                raise SHUTTING_DOWN
            body = await _read_json(request)
            job = await run_in_threadpool(parse, service, kind, body)  # templates and tokenizing: off the loop
            return Generation(service, job, dict(method="POST", path=request.url.path))
        return handler

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": service.model_id, "object": "model", "created": int(service.started), "owned_by": "edgekv"}]})

    async def health(request):
        return JSONResponse(service.health())

    async def http_error(request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(RequestError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                           code=code))

    async def crash(request, exc: Exception):  # a bug: one 500, the server goes on
        return error_response(_error(exc))

    routes = [Route("/v1/chat/completions", endpoint(generation("chat")), methods=["POST"]),
              Route("/v1/completions", endpoint(generation("text")), methods=["POST"]),
              Route("/v1/models", endpoint(models), methods=["GET"]),
              Route("/health", endpoint(health, auth=False), methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: crash})


# --- running it -------------------------------------------------------------------------------

def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one); EdgekvError if it cannot be had."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise EdgekvError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def uvicorn_server(service: Service):
    """A uvicorn server for the service's app whose Ctrl-C / SIGTERM also cancels the running
    jobs (uvicorn alone would wait for every stream to end)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            loop = getattr(self, "edgekv_loop", None)
            if loop is not None:
                loop.call_soon_threadsafe(service.shutdown)

        async def startup(self, sockets=None) -> None:
            self.edgekv_loop = asyncio.get_running_loop()
            await super().startup(sockets)

    config = uvicorn.Config(make_app(service), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=30)
    return Server(config)


class Console:
    """What `edgekv serve` prints: a line per request (text, or JSON with --log-format json) and,
    on a terminal, a status line kept at the bottom (requests, sequences, tokens/s)."""

    def __init__(self, service_name: str, fmt: str = "text", out=None):
        self.fmt, self.out = fmt, out or sys.stdout
        self.name = service_name
        self.tty = fmt == "text" and self.out.isatty()
        self.service: Service | None = None
        self.samples: collections.deque = collections.deque(maxlen=11)  # (time, tokens generated), 1 s apart
        self.status = ""
        self.lock = threading.Lock()

    def line(self, record: dict) -> None:
        if self.fmt == "json":
            text = json.dumps(dict(time=round(time.time(), 3), **record))
        elif "event" in record:
            text = record["message"]
        elif "error" in record:
            text = f"{record['method']} {record['path']} {record['status']}: {record['error']}"
        else:
            text = (f"{record['method']} {record['path']} {record['status']} {record['seconds']:.2f}s "
                    f"n={record['n']} prompt {record['prompt_tokens']} (cached {record['cached_tokens']}) "
                    f"+ {record['completion_tokens']} tokens, {record['decode_tokens_per_s']} tok/s"
                    + (f" [{record['outcome']}]" if record["outcome"] != "ok" else ""))
        with self.lock:
            if self.tty and self.status:
                self.out.write("\r\033[K")
            self.out.write(text + "\n")
            if self.tty and self.status:
                self.out.write(self.status)
            self.out.flush()

    def tick(self) -> None:
        """Redraw the status line (called about once a second)."""
        svc = self.service
        if not self.tty or svc is None:
            return
        now = time.monotonic()
        self.samples.append((now, svc.counts["tokens_generated"]))
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        done = sum(v for k, v in svc.counts.items() if k.startswith("requests_"))
        status = (f"[{self.name}] requests {done} done, {len(svc.jobs)} running, {len(svc.slots.waiting)} waiting | "
                  f"sequences {svc.sequences}/{svc.parallel} | {rate:.1f} tok/s")
        with self.lock:
            self.status = status
            self.out.write("\r\033[K" + status)
            self.out.flush()


def serve(llm, *, host: str = "127.0.0.1", port: int = 8080, parallel: int = 4, api_key: str | None = None,
          model_id: str | None = None, aliases=(), log_format: str = "text", out=None) -> None:
    """Run the server until Ctrl-C / SIGTERM: then stop accepting, cancel what runs, return."""
    model_id = model_id or llm.path.stem
    console = Console(model_id, log_format, out)
    service = Service(llm, model_id=model_id, aliases={llm.path.name, *aliases}, parallel=parallel, api_key=api_key,
                      log=console.line, local_only=loopback(host))
    console.service = service
    sock = listen(host, port)
    bound = sock.getsockname()
    where = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}/v1"
    server = uvicorn_server(service)
    console.name = f"{model_id} at {where}"
    console.line(dict(event="listening", url=where, model=model_id, parallel=parallel, n_ctx=llm.n_ctx,
                      kv=llm.kv_type, message=f"edgekv serve: {model_id} at {where} (parallel {parallel}, ctx "
                      f"{llm.n_ctx}, kv {llm.kv_type}); Ctrl-C stops"))

    async def ticker():
        while True:
            console.tick()
            await asyncio.sleep(1.0)

    async def main():
        tick = asyncio.ensure_future(ticker())
        try:
            await server.serve(sockets=[sock])
        finally:
            tick.cancel()

    # uvicorn re-raises the signal that stopped it once it has restored the handlers it found:
    # let those be no-ops, so a stop by Ctrl-C or SIGTERM is a clean return, not a kill
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, lambda *a: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(main())
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    if console.tty and console.status:
        console.out.write("\n")
    console.line(dict(event="stopped", message="edgekv serve: stopped", counts=dict(service.counts)))
