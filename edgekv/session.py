"""ChatSession: a conversation that keeps its KV cache between turns, so each new turn
prefills only the tokens the cache does not already hold.

Summarize mode (summarize=True, `edgekv chat --summarize`): before a turn would not fit the
context (its prompt and max_tokens of reply past n_ctx, where the ring would start dropping the
oldest tokens after the sinks), the model writes a short summary of the oldest half of the
finished turns (and of the summary before, if any); the summary goes into the system prompt
and those turns leave the conversation, so the cache is rebuilt from the summary on (the
system prompt changed: `Sequence.reuse` keeps what comes before the change). The ring then
never drops a turn the model has not summarized."""
from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Iterator

from .errors import EdgekvError, SessionFileError
from .generate import Event, Sequence, Stats, generate
from .kvfile import cache_arrays, load_cache, read_file, write_file
from .prompt_cache import system_prefix
from .sampling import Sampler, SamplingParams


class ChatSession:
    """Create with `llm.session(system=...)`. One session per thread; several sessions may
    share one LLM (the weights), each with its own cache."""

    def __init__(self, llm, system: str | None = None, *, max_tokens: int = 512, template_vars: dict | None = None,
                 summarize: bool = False, **sampling):
        self.llm = llm
        self.system = system
        # the chat template's own switches (Qwen3's enable_thinking, Llama 3.1's date_string, ...)
        self.template_vars = dict(template_vars or {})
        self.max_tokens = max_tokens
        self.params = SamplingParams(**sampling)
        self.params.validate()
        self.sampler = Sampler(self.params, llm.cfg.n_vocab)
        self.history: list[dict] = []  # user/assistant messages, system excluded
        self.seq = Sequence(llm)
        self.stats = Stats()
        self._lock = threading.Lock()
        self._cached_text: str | None = None  # the text seq.tokens stands for, when known
        self.summarize = bool(summarize)
        self.summary: str | None = None  # what the turns folded so far said (summarize mode)
        self.folded = 0  # turns (user message + reply) the summary stands for

    def messages(self) -> list[dict]:
        """The conversation as the template sees it: the system prompt (if any), then history."""
        text = self.system or ""
        if self.summary:
            text += ("\n\n" if text else "") + SUMMARY_HEAD + self.summary
        return ([{"role": "system", "content": text}] if text else []) + self.history

    def _render(self) -> str:
        return self.llm.template.render(self.messages(), add_generation_prompt=True, **self.template_vars)

    def _prompt_ids(self) -> list[int]:
        """Token ids of the rendered conversation. When the new rendering extends the text the
        cache already holds, only the new tail is tokenized and appended to the cached ids: the
        cache is reused even where re-tokenizing a reply would split it differently, and even
        after the ring has dropped old tokens (it cannot roll back then)."""
        text = self._render()
        tok = self.llm.tokenizer
        if self.seq.tokens and self._cached_text is not None and text.startswith(self._cached_text):
            return self.seq.tokens + tok.encode(text[len(self._cached_text):], add_bos=False, special=True)
        return self.llm.chat_ids(text)

    def send(self, text: str, *, stream: bool = False, max_tokens: int | None = None,
             stop: list[str] | tuple = (), cancel: threading.Event | None = None):
        """Add a user message and answer it: the reply text, or (stream=True) an iterator of Events.
        Inputs and context as in `LLM.generate` (bytes decoded as UTF-8 with U+FFFD for invalid
        sequences; a conversation longer than n_ctx keeps going through the ring). `cancel`
        (a threading.Event) ends the reply within one token; what was said so far becomes the
        assistant's turn and the session stays usable."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise EdgekvError("message must be a string")
        events = self._turn(text, max_tokens or self.max_tokens, stop, cancel)
        return events if stream else "".join(e.text for e in events)

    def _turn(self, text, max_tokens, stop, cancel) -> Iterator[Event]:
        with self._lock:
            self.history.append({"role": "user", "content": text})
            try:
                ids = self._prompt_ids()
                while self.summarize and len(ids) + max_tokens > self.llm.n_ctx and self._fold():
                    ids = self._prompt_ids()
                rendered = self._render()
                keep = system_prefix(self.llm, self.messages(), ids, template_vars=self.template_vars)
            except BaseException:  # Ctrl-C too: a user turn without a reply would break alternation
                self.history.pop()
                raise
            self.stats = Stats()
            reply = []
            self._cached_text = None
            finished = False
            try:
                for e in generate(self.llm, self.seq, ids, self.sampler, max_tokens=max_tokens, stop=stop,
                                  cancel=cancel, stats=self.stats, keep=keep):
                    reply.append(e.text)
                    yield e
                finished = True
            finally:
                # Whatever was produced (even if cancelled) becomes the assistant's turn.
                fed = self.seq.tokens[len(ids):]
                whole = self.seq.tokens[: len(ids)] == ids
                if not finished and whole:
                    # Cut off (Ctrl-C, the stream dropped): text the decoder still held back
                    # never reached `reply`; the reply is what the cache holds, so the next
                    # turn still extends the cached text (a wrapped ring cannot roll back).
                    reply = [self.llm.tokenizer.decode(fed)]
                self.history.append({"role": "assistant", "content": "".join(reply)})
                if whole:
                    self._cached_text = rendered + self.llm.tokenizer.decode(fed)

    def _fold(self) -> bool:
        """Summarize the oldest half of the finished turns (at least one) into `summary`; False
        when there is no finished turn to fold. The summary is the model's greedy answer to a
        chat asking for it (a Sequence of its own: the conversation's cache is not touched)."""
        turns = (len(self.history) - 1) // 2  # the last message is the user's new one
        if turns < 1:
            return False
        k = max(1, turns // 2)
        old, self.history = self.history[: 2 * k], self.history[2 * k:]
        lines = [f"Summary so far: {self.summary}"] if self.summary else []
        lines += [f"{m['role'].capitalize()}: {m['content']}" for m in old]
        while True:  # what does not fit the context with the summary's room: the oldest lines, then halves
            ask = [{"role": "system", "content": SUMMARY_SYSTEM},
                   {"role": "user", "content": SUMMARY_ASK + "\n\n" + "\n".join(lines)}]
            ids = self.llm.chat_ids(self.llm.template.render(ask, add_generation_prompt=True, **self.template_vars))
            if len(ids) + SUMMARY_TOKENS <= self.llm.n_ctx or not lines[0]:
                break
            lines = lines[1:] if len(lines) > 1 else [lines[0][len(lines[0]) // 2:]]
        events = generate(self.llm, Sequence(self.llm), ids, Sampler(SamplingParams(temperature=0.0),
                          self.llm.cfg.n_vocab), max_tokens=SUMMARY_TOKENS)
        self.summary = "".join(e.text for e in events).strip() or self.summary
        self.folded += k
        self._cached_text = None
        return True

    def regenerate(self, **kw):
        """Drop the last reply and answer the last user message again (the cache rolls back)."""
        if len(self.history) < 2 or self.history[-1]["role"] != "assistant":
            raise EdgekvError("nothing to regenerate")
        self.history.pop()
        last = self.history.pop()["content"]
        return self.send(last, **kw)

    def undo(self) -> None:
        """Drop the last user message and its reply; the cache rolls back to the conversation
        before them (or is emptied when the ring has already dropped what that needs)."""
        with self._lock:
            if len(self.history) < 2 or self.history[-1]["role"] != "assistant":
                raise EdgekvError("nothing to undo")
            del self.history[-2:]
            self._cached_text = None
            if self.messages():  # keep the prefix the rest of the conversation still renders to
                self.seq.reuse(self.llm.chat_ids(self._render()))
            else:
                self.seq.reset()

    def reset(self, system: str | None = ...) -> None:
        """Forget the conversation (and optionally set a new system prompt)."""
        if system is not ...:
            self.system = system
        self.history = []
        self.summary, self.folded = None, 0
        self.seq.reset()
        self._cached_text = None

    @property
    def n_cached(self) -> int:
        """Tokens of the conversation held by the cache (may exceed n_ctx: the ring keeps the recent ones)."""
        return len(self.seq.tokens)

    # -- save / load -----------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the session (messages, tokens, the cache's filled slots in their stored dtype,
        sampler state, model identity) to one file, atomically: a crash mid-save keeps the old file."""
        with self._lock:
            # not dataclasses.asdict: it deep-copies logit_bias, a MappingProxyType, which cannot be copied
            params = {f.name: getattr(self.params, f.name) for f in dataclasses.fields(self.params)}
            params["logit_bias"] = sorted((int(k), float(v)) for k, v in (self.params.logit_bias or {}).items())
            header = dict(
                format=SESSION_FORMAT, version=SESSION_VERSION, model=self.llm.identity, kv=self.llm.kv_type,
                n_ctx=self.llm.n_ctx, evict=self.seq.cache.evict, system=self.system, history=self.history, max_tokens=self.max_tokens,
                template_vars=self.template_vars, summarize=self.summarize, summary=self.summary, folded=self.folded,
                tokens=self.seq.tokens, cached_text=self._cached_text, sampling=params, sampler=self.sampler.state(),
            )
            sync = getattr(self.llm.backend, "sync_to_host", None)  # a GPU backend holds the rings
            if sync is not None:
                sync(self.seq.cache)
            header["layers"], arrays = cache_arrays(self.seq.cache)
            path = Path(path)
            try:
                write_file(path, SESSION_MAGIC, header, arrays)
            except OSError as e:  # a full disk: the old file stays, no stray temp file
                raise SessionFileError(f"cannot save session to {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike, llm) -> "ChatSession":
        """A session saved by `save`, continuing exactly where it was (no prefill needed)."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SessionFileError(f"cannot read session {path}: {e.strerror or e}") from None
        h, arrays, _ = read_file(data, SESSION_MAGIC, path.name, "session", SessionFileError)
        if h.get("format") != SESSION_FORMAT:
            raise SessionFileError(f"{path.name} is not an edgekv session file")
        version = h.get("version")
        if version not in SESSION_READS:
            raise SessionFileError(f"{path.name} is session format version {version}, this edgekv reads versions "
                                   f"{', '.join(map(str, SESSION_READS))}")
        if h.get("model") != llm.identity:
            raise SessionFileError(f"{path.name} was saved with another model ({h.get('model', {}).get('name')})")
        if h.get("kv") != llm.kv_type or h.get("n_ctx") != llm.n_ctx:
            raise SessionFileError(f"{path.name} needs kv={h.get('kv')} ctx={h.get('n_ctx')}; this model is loaded with "
                                   f"kv={llm.kv_type} ctx={llm.n_ctx}")
        if h.get("evict", llm.evict) != llm.evict:  # absent before version 4: the policy starts afresh
            raise SessionFileError(f"{path.name} needs evict={h.get('evict')}; this model is loaded with evict={llm.evict}")
        try:
            sampling = dict(h["sampling"])
            sampling["logit_bias"] = {int(k): float(v) for k, v in sampling["logit_bias"]} or None
            template_vars = h.get("template_vars", {})  # absent in files of before 2026-12
            if not isinstance(template_vars, dict):
                raise ValueError("template_vars")
            summary, folded = h.get("summary"), h.get("folded", 0)  # absent before summarize mode
            if not (summary is None or isinstance(summary, str)) or not isinstance(folded, int) or folded < 0:
                raise ValueError("summary")
            sess = cls(llm, h["system"], max_tokens=int(h["max_tokens"]), template_vars=template_vars,
                       summarize=bool(h.get("summarize", False)), **sampling)
            sess.summary, sess.folded = summary, folded
            sess.sampler = Sampler.from_state(sess.params, llm.cfg.n_vocab, h["sampler"])
            sess.history = [dict(role=str(m["role"]), content=str(m["content"])) for m in h["history"]]
            tokens = [int(t) for t in h["tokens"]]
            if any(t < 0 or t >= llm.cfg.n_vocab for t in tokens):
                raise ValueError("token out of range")
            load_cache(sess.seq.cache, h["layers"], arrays, len(tokens), every_slot=version == 2)  # 2: every slot
            sess.seq.tokens = tokens
            cached = h.get("cached_text")
            sess._cached_text = cached if isinstance(cached, str) else None
        except SessionFileError:
            raise
        except Exception as e:
            raise SessionFileError(f"{path.name} is corrupt: {e}") from None
        return sess


SUMMARY_TOKENS = 128  # the most a summary may take
SUMMARY_HEAD = "Summary of the earlier conversation: "
SUMMARY_SYSTEM = "You summarize conversations. Keep names, numbers, facts and decisions; leave out pleasantries."
SUMMARY_ASK = "Summarize this conversation in a few sentences."
SESSION_MAGIC = b"EDGEKVS\x00"
SESSION_FORMAT = "edgekv-session"
# 2: int scales, exact recent slots, key offset and channel weights saved too
# 3: the per-slot arrays only up to the ring's fill (LayerKV.state)
# 4: the eviction policy and its state (scores, protected tokens: evict.Evictor.state)
SESSION_VERSION = 4
SESSION_READS = (2, 3, 4)
