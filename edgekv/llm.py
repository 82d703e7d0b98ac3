"""`LLM`: a loaded model — file, backend, weights, tokenizer, chat template — and the ways to run it."""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np

from .backends import get_backend
from .errors import ContextError, EdgekvError
from .evict import OBSERVE, check_policy
from .generate import NO_DEFER, UBATCH, Batcher, DeferSigint, Event
from .gguf_file import GGUFFile
from .kvcache import KV_KINDS, BatchCache, KVCache, ProbeCache, cache_bytes, capacities

_NO_STEP = contextlib.nullcontext()


class LLM:
    """A model ready to run. Create with `edgekv.load`.

    Threading: the weights, tokenizer and template are read-only once loaded, so one LLM
    serves several threads at once, each generating through its own cache: one
    `llm.session()` per thread, or `generate`/`complete`/`chat` calls (each call has its own
    cache and sampler). A ChatSession is for one thread at a time (its turns take a lock).
    Outputs do not depend on what other threads run: same seed, same text. Threads generating
    at once have their forward passes batched (`self.batcher`, generate.Batcher). `llm.stats` is
    the last call started by any thread; use `session.stats`, or pass `stats=` to generate,
    to read one thread's figures. Cancel from any thread with a threading.Event (`cancel=`).
    """

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 4096, kv: str = "int8", threads: int | None = None,
                 device: str = "cpu", n_sink: int = 4, gpu_layers: int | None = None, prompt_cache: bool = True,
                 prompt_cache_size: int | None = None, prompt_cache_memory: int | None = None, evict: str = "window"):
        from .chat_template import ChatTemplate
        from .models import build_model, model_module
        from .tokenizer import Tokenizer

        if n_ctx < 8:
            raise ContextError(f"n_ctx must be at least 8, got {n_ctx}")
        if kv not in KV_KINDS:
            raise EdgekvError(f"unknown KV cache type {kv!r} (choose {', '.join(KV_KINDS)})")
        self.path = Path(path)
        self.file = GGUFFile(path)
        self.n_ctx, self.kv_type, self.n_sink, self.evict = n_ctx, kv, n_sink, check_policy(evict)
        self._protect_ids = None  # (n_vocab,) bool: the vocabulary's control tokens, once a policy needs them
        check_context(self, model_module(self.file.arch).Config.from_gguf(self.file))  # before any weight moves
        self.backend = get_backend(device, threads, gpu_layers)
        if evict != "window" and self.backend.name not in ("cpu", "reference"):
            raise EdgekvError(f"evict={evict!r} runs on the CPU backend only (the {self.backend.name} one evicts the oldest)")
        self.model = build_model(self.file, self.backend, n_ctx)
        self.cfg = self.model.cfg
        self.tokenizer = Tokenizer.from_metadata(self.file.meta)
        tok = self.tokenizer
        self.template = ChatTemplate.from_metadata(self.file.meta, self.file.meta.get("tokenizer.ggml.tokens", []),
                                                   tok.bos_id, tok.eos_id)
        self.stats = None  # generate.Stats of the last call
        # forward passes of threads generating at once run as one batch
        self.batcher = Batcher(release=getattr(self.backend, "release_threads", None))
        # What a saved session must match: the file's header (metadata + tensor table) and size.
        header = hashlib.sha256(memoryview(self.file._mmap)[: self.file.data_offset]).hexdigest()
        self.identity = dict(name=self.path.name, size=self.file.size, header_sha256=header)
        # prefixes already computed, in memory and (chat system prompts) on disk: edgekv.prompt_cache
        self.prompt_cache = _prompt_cache(self, prompt_cache_size, prompt_cache_memory) if prompt_cache else None
        release = getattr(self.backend, "release_threads", None)
        if release is not None:  # the loading thread's kernels (repacking) are done: its OpenMP pool goes
            release()

    # -- caches ---------------------------------------------------------------------------
    def new_cache(self, kind: str | None = None, *, n_sink: int | None = None, evict: str | None = None) -> KVCache:
        """An empty KV cache for this model: `kind` (default: the LLM's kv type), a ring of
        n_ctx tokens per global layer and of the window (at most n_ctx) per sliding-window one,
        full rings evicting by `evict` (default: the LLM's policy, edgekv.EVICT_POLICIES)."""
        return KVCache.for_model(self.cfg, self.n_ctx, kind or self.kv_type, self.n_sink if n_sink is None else n_sink,
                                 evict=evict or self.evict)

    def _protect(self, cache, ids: np.ndarray, start_pos: int) -> None:
        """Mark an evicting cache's chat-template tokens (control tokens: role markers, turn
        boundaries) and the token after each (the role's name) as never to evict."""
        if getattr(cache, "evict", "window") == "window":
            return
        if self._protect_ids is None:  # a lookup: np.isin sorted Gemma's 6,250 control ids every token (1 ms)
            ctl = np.array(self.tokenizer.control_ids(), np.int64)
            mask = np.zeros(max(self.cfg.n_vocab, int(ctl.max(initial=-1)) + 1), np.bool_)
            mask[ctl] = True
            self._protect_ids = mask
        at = np.flatnonzero(self._protect_ids[ids])
        if len(at):
            cache.protect(np.concatenate([at, at + 1]) + start_pos)

    def _ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise EdgekvError("forward needs a non-empty 1-D list of token ids")
        lo, hi = (ids.item(0), ids.item(0)) if len(ids) == 1 else (ids.min(), ids.max())  # a decode step: no reductions
        if lo < 0 or hi >= self.cfg.n_vocab:
            raise EdgekvError(f"token id out of range [0, {self.cfg.n_vocab})")
        return ids

    def forward(self, ids, cache: KVCache, start_pos: int, *, last_only: bool = True, observe=None) -> np.ndarray:
        """Run ids (placed at positions start_pos...) through the model in chunks of UBATCH.
        Before a chunk that makes an eviction policy overwrite tokens, `observe` (default: the
        last OBSERVE of ids; a prompt fed in parts passes its own end) runs as a probe."""
        ids = self._ids(ids)
        self._protect(cache, ids, start_pos)
        outs = []
        step = getattr(self.backend, "step", None)  # the CPU backend's thread count for this pass
        limit = getattr(cache, "batch_limit", None)  # an evicting ring takes less at once
        ub = min(UBATCH, limit or UBATCH)
        if limit is None:  # no policy: nothing to probe for
            observe = None
        elif observe is not None:
            observe = self._ids(observe)
        elif ub < len(ids):
            observe = ids[-OBSERVE:]
        for s in range(0, len(ids), ub):
            chunk = ids[s : s + ub]
            if observe is not None and len(observe) > 1 and cache.evicts(len(chunk)):
                self._probe(observe, cache, start_pos + s)
            pos = np.arange(start_pos + s, start_pos + s + len(chunk), dtype=np.int64)
            # a decode step holds Ctrl-C until its token is done (a few ms): its fused blocks pass
            # numba a typed list of caches, typed by Python code inside numba's dispatch, where a
            # KeyboardInterrupt surfaces as "TypeError: can't unbox a List"
            with step(len(chunk)) if step else _NO_STEP, DeferSigint() if len(chunk) == 1 else NO_DEFER:
                logits = self.model.forward(chunk, pos, cache, last_only=last_only)
            if not last_only or s + ub >= len(ids):
                outs.append(logits)
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _probe(self, ids: np.ndarray, cache: KVCache, start_pos: int) -> None:
        """ids attend over the cache, as if they came next, and are not stored: the eviction
        policy's probe scores (edgekv/evict.py), which choose the coming chunk's victims."""
        step = getattr(self.backend, "step", None)
        pos = np.arange(start_pos, start_pos + len(ids), dtype=np.int64)
        with step(len(ids)) if step else _NO_STEP:
            self.model.forward(ids, pos, ProbeCache(cache), last_only=True)
        cache.probed()

    def forward_batch(self, batch: list[tuple]) -> list[np.ndarray]:
        """Several sequences, each (ids, cache, start_pos[, observe]) as in `forward` (a cache at most once):
        the logits (n_vocab,) after each one's last id, the same bits as `forward` gives it alone.
        Sequences of one token (decode) run as one pass over their stacked tokens, so each
        weight is read once for all of them, in groups of at most the backend's `batch_rows`
        (the rows its small-batch kernel computes exactly as one); longer ones run alone."""
        observe = [b[3] if len(b) > 3 else None for b in batch]  # a prompt fed in parts: its end (forward)
        batch = [(self._ids(b[0]), b[1], int(b[2])) for b in batch]
        if len({id(cache) for _, cache, _ in batch}) != len(batch):
            raise EdgekvError("forward_batch: each sequence needs a cache of its own (one appears twice)")
        out: list = [None] * len(batch)
        one = [j for j, (ids, _, _) in enumerate(batch) if len(ids) == 1]
        for j, (ids, cache, start) in enumerate(batch):
            if len(ids) > 1:
                out[j] = self.forward(ids, cache, start, observe=observe[j])[-1]
        rows = max(1, getattr(self.backend, "batch_rows", 1))
        step = getattr(self.backend, "step", None)
        for g in range(0, len(one), rows):
            group = one[g : g + rows]
            if len(group) == 1:
                out[group[0]] = self.forward(*batch[group[0]])[-1]
                continue
            ids = np.concatenate([batch[j][0] for j in group])
            pos = np.array([batch[j][2] for j in group], dtype=np.int64)
            for j in group:
                self._protect(batch[j][1], batch[j][0], batch[j][2])
            cache = BatchCache([batch[j][1] for j in group], [1] * len(group), pos)
            with step(len(group)) if step else _NO_STEP, DeferSigint():  # a decode step (forward)
                logits = self.model.forward(ids, pos, cache, last_only=False)  # (len(group), n_vocab)
            for r, j in enumerate(group):
                out[j] = logits[r]
        return out

    # -- public API -----------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text` (add_bos None: the model's default)."""
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids, special: bool = True) -> str:
        """The text of token ids (special=False drops control tokens such as BOS/EOS)."""
        return self.tokenizer.decode(ids, special=special)

    def logits(self, ids) -> np.ndarray:
        """float32 (len(ids), n_vocab): the next-token logits after every prefix of ids."""
        ids = list(ids)
        if len(ids) > self.n_ctx:
            raise ContextError(f"{len(ids)} tokens do not fit n_ctx={self.n_ctx}")
        return self.forward(ids, self.new_cache(), 0, last_only=False)

    def sampling(self, **kw) -> "SamplingParams":
        """Validated sampling parameters from generate()'s sampling keywords (EdgekvError if bad)."""
        from .sampling import SamplingParams

        params = SamplingParams(**kw)
        params.validate()
        return params

    def generate(self, prompt: str | bytes | list[int], *, max_tokens: int = 256, stop: list[str] | tuple = (),
                 cancel=None, add_bos: bool | None = None, stats=None, keep: int = 0, logprobs: int | None = None,
                 **sampling) -> Iterator[Event]:
        """Stream a continuation of `prompt` (text, or token ids) as Events; the last event has
        `finish_reason` ("stop", "length" or "cancelled"). Sampling keywords: temperature,
        top_k, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty,
        penalty_last_n, logit_bias, seed (see edgekv.sampling.SamplingParams).

        Inputs: bytes are decoded as UTF-8 with invalid sequences replaced by U+FFFD, and so
        are lone surrogates in a str; control characters are ordinary text. A prompt that
        tokenizes to nothing (e.g. "" for a model without BOS) raises EdgekvError.
        Context: the cache is a ring of n_ctx tokens. A prompt longer than that is not an
        error: as in StreamingLLM (and mlx-lm's max_kv_size), the model keeps attending to the
        first 4 tokens (sinks) and the most recent ones, and the rest drop out of view; the
        same happens when generation runs past n_ctx. Generation ends only at EOS, a stop
        string, `max_tokens` ("length") or `cancel`. `cancel` (a threading.Event) is checked
        before every token and between prefill chunks of 512 tokens.
        `stats`: a generate.Stats to fill (default: a new one); it also becomes `llm.stats`.
        Prompt cache (on unless `prompt_cache=False`): a prompt that starts with tokens a call
        of this process computed loads them (`stats.cached_tokens`); `keep`: prefill the first
        `keep` ids as a batch of their own and keep them on disk too (what `chat` does with a
        long system prompt; see edgekv.prompt_cache).
        logprobs: None, or k: each event carries its token's log-probability and the k likeliest
        tokens' (`event.logprob`, `event.top_logprobs`): the log-softmax of the model's raw
        logits, before bias, penalties, temperature and filters (Sampler.logprobs)."""
        from .generate import Sequence, Stats, generate
        from .sampling import Sampler

        params = self.sampling(**sampling)
        ids = self._checked_ids(prompt, add_bos, max_tokens, keep, logprobs)
        self.stats = stats = stats if stats is not None else Stats()
        yield from generate(self, Sequence(self), ids, Sampler(params, self.cfg.n_vocab), max_tokens=max_tokens,
                            stop=stop, cancel=cancel, stats=stats, keep=keep, remember=not keep, logprobs=logprobs)

    def streams(self, prompt: str | bytes | list[int], n: int, *, max_tokens: int = 256, stop: list[str] | tuple = (),
                cancel=None, add_bos: bool | None = None, stats: list | None = None, keep: int = 0,
                logprobs: int | None = None, **sampling) -> list[Iterator[Event]]:
        """n streams of Events for one prompt, as n `generate` calls would give (stream i seeded
        with seed + i, mod 2**128; None: fresh entropy each) but sharing one prefill: the first
        stream read prefills the prompt, in its thread, and forks its cache for the others
        (KVCache.fork). Read each in a thread of its own: their decode steps run as one batch
        (the Batcher). stats: n generate.Stats to fill; each carries the prompt's one prefill."""
        from .generate import Stats, forks

        _check_n(n)
        samplers = self._samplers(self.sampling(**sampling), n)
        ids = self._checked_ids(prompt, add_bos, max_tokens, keep, logprobs)
        stats = list(stats) if stats is not None else [Stats() for _ in range(n)]
        if len(stats) != n:
            raise EdgekvError(f"streams: {len(stats)} stats for n={n}")
        return forks(self, ids, samplers, max_tokens=max_tokens, stop=stop, cancel=cancel, stats=stats, keep=keep,
                     remember=not keep, logprobs=logprobs)

    def _samplers(self, params, n: int) -> list:
        """n samplers of params (its seed checked before it is offset), sample i seeded with
        seed + i (mod 2**128); no seed: fresh entropy each."""
        from .sampling import Sampler

        return [Sampler(params if params.seed is None else replace(params, seed=(params.seed + i) % 2**128),
                        self.cfg.n_vocab) for i in range(n)]

    def _checked_ids(self, prompt, add_bos: bool | None, max_tokens: int, keep: int, logprobs) -> list[int]:
        """The prompt's ids, generate's other arguments checked against them."""
        ids = self._prompt_ids(prompt, add_bos)
        if max_tokens < 0:
            raise EdgekvError(f"max_tokens must be >= 0, got {max_tokens}")
        if not 0 <= keep < len(ids):
            raise EdgekvError(f"keep must be in [0, {len(ids)}) for this prompt, got {keep}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise EdgekvError(f"logprobs must be None or an int >= 0, got {logprobs!r}")
        return ids

    def _prompt_ids(self, prompt, add_bos: bool | None) -> list[int]:
        if isinstance(prompt, (bytes, bytearray)):  # bytes are text, not token ids
            prompt = bytes(prompt).decode("utf-8", errors="replace")
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_bos=add_bos)
        else:
            try:
                ids = [int(i) for i in prompt]
            except (TypeError, ValueError):
                raise EdgekvError("prompt must be text or a list of token ids") from None
        if not ids:
            raise EdgekvError("empty prompt: nothing to continue from")
        return ids

    def generate_many(self, prompts: list, *, n: int = 1, max_tokens: int = 256, stop: list[str] | tuple = (),
                      cancel=None, add_bos: bool | None = None, **sampling) -> list["Completion"]:
        """Run several prompts as one batch, n samples of each (OpenAI's `n`): each prompt is
        prefilled once, alone, and its cache copied for each further sample (KVCache.fork);
        then the next tokens of all unfinished samples are decoded in one batched forward pass
        per step (every weight read once for the batch), a sample dropping out as it finishes.
        Returns a generate.Completion (text, tokens, finish_reason, stats) per sample,
        prompt-major (prompt j's sample i at j * n + i): exactly what `generate` gives that
        prompt alone, with the same keywords and its seed. `seed` may be one int (every prompt
        seeded with it, as separate generate calls would be) or a list of one per prompt; a
        prompt's sample i is seeded with its seed + i (mod 2**128); None: fresh entropy each."""
        from .generate import Sequence, generate_many

        prompts = list(prompts)
        _check_n(n)
        seed = sampling.pop("seed", None)
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise EdgekvError(f"generate_many: {len(seeds)} seeds for {len(prompts)} prompts")
        samplers = [sm for s in seeds for sm in self._samplers(self.sampling(seed=s, **sampling), n)]
        ids = [self._prompt_ids(p, add_bos) for p in prompts]
        if max_tokens < 0:
            raise EdgekvError(f"max_tokens must be >= 0, got {max_tokens}")
        if not ids:
            return []
        return generate_many(self, [Sequence(self) for _ in ids], ids, samplers, n=n, max_tokens=max_tokens,
                             stop=stop, cancel=cancel)

    def sample(self, prompt: str | bytes | list[int], n: int = 1, **kw) -> list["Completion"]:
        """n completions of one prompt, decoded as one batch after one prefill: `generate_many([prompt], n=n, **kw)`
        (sample i is exactly `generate(prompt, seed=seed + i)`)."""
        return self.generate_many([prompt], n=n, **kw)

    def beam_search(self, prompt: str | bytes | list[int], num_beams: int = 4, *, max_tokens: int = 64,
                    length_penalty: float = 1.0, early_stopping: bool = False, cancel=None,
                    add_bos: bool | None = None) -> list["Hypothesis"]:
        """Beam search over the model's log-probabilities, as Hugging Face transformers does it
        (edgekv.beam): the num_beams best hypotheses, best first, each a Completion with its
        `score` (sum of log-probabilities / generated tokens ** length_penalty; EOS counts as a
        token and ends a hypothesis, "stop"). early_stopping: end as soon as num_beams are
        finished (False: once no running beam can beat them). The beams share the prompt's
        prefill and decode as one batch; a beam that splits copies its cache (KVCache.fork)."""
        from .beam import beam_search
        from .generate import Sequence

        if not isinstance(num_beams, int) or num_beams < 1:
            raise EdgekvError(f"num_beams must be a whole number >= 1, got {num_beams!r}")
        if max_tokens < 0:
            raise EdgekvError(f"max_tokens must be >= 0, got {max_tokens}")
        if not isinstance(length_penalty, (int, float)) or not np.isfinite(length_penalty):
            raise EdgekvError(f"length_penalty must be a finite number, got {length_penalty!r}")
        ids = self._prompt_ids(prompt, add_bos)
        return beam_search(self, Sequence(self), ids, num_beams=num_beams, max_tokens=max_tokens,
                           length_penalty=float(length_penalty), early_stopping=bool(early_stopping), cancel=cancel)

    def chat_ids(self, rendered: str) -> list[int]:
        """Token ids of a rendered chat prompt: special tokens parsed, and BOS added only when
        the model wants one and the template did not already write it (gemma's does)."""
        tok = self.tokenizer
        has_bos = tok.bos_id is not None and rendered.startswith(tok.token_text(tok.bos_id))
        return tok.encode(rendered, add_bos=False if has_bos else None, special=True)

    def chat(self, messages: list[dict], *, stream: bool = False, max_tokens: int = 256, tools: list | None = None,
             template_vars: dict | None = None, n: int = 1, **kw):
        """OpenAI-style chat completion: messages [{"role", "content"}] -> a dict shaped like
        OpenAI's response, or (stream=True) an iterator of chunk dicts. Keywords as generate().
        tools and template_vars (e.g. {"enable_thinking": False} for Qwen3) reach the chat template.
        n: choices of one prompt sharing its prefill (`streams`; choice i seeded seed + i)."""
        import threading
        import time as _time
        import uuid

        from .generate import Stats, interleave, usage

        _check_n(n)
        ids, keep = self.chat_prompt(messages, tools=tools, template_vars=template_vars)
        head = dict(id="chatcmpl-" + uuid.uuid4().hex[:24], created=int(_time.time()), model=self.path.name)
        st = [Stats() for _ in range(n)]  # ours: llm.stats may be another thread's call by the time we read it
        if n == 1:
            events = ((0, e) for e in self.generate(ids, max_tokens=max_tokens, stats=st[0], keep=keep, **kw))
        else:
            cancel = kw.pop("cancel", None) or threading.Event()
            events = interleave(self.streams(ids, n, max_tokens=max_tokens, stats=st, keep=keep, cancel=cancel, **kw),
                                cancel)
        if stream:
            def chunks():
                yield dict(head, object="chat.completion.chunk",
                           choices=[dict(index=i, delta={"role": "assistant"}, finish_reason=None) for i in range(n)])
                for i, e in events:
                    delta = {"content": e.text} if e.text else {}
                    yield dict(head, object="chat.completion.chunk",
                               choices=[dict(index=i, delta=delta, finish_reason=e.finish_reason)])
            return chunks()
        parts, reasons = [[] for _ in range(n)], [None] * n
        for i, e in events:
            parts[i].append(e.text)
            reasons[i] = e.finish_reason or reasons[i]
        return dict(head, object="chat.completion",
                    choices=[dict(index=i, message={"role": "assistant", "content": "".join(parts[i])},
                                  finish_reason=reasons[i]) for i in range(n)],
                    usage=usage(st[:1], st))

    def chat_prompt(self, messages: list[dict], *, tools: list | None = None,
                    template_vars: dict | None = None) -> tuple[list[int], int]:
        """What `chat` runs for messages: the token ids of the rendered template, and how many of
        them are a long system prompt the prompt cache keeps (generate's `keep`; 0 if none)."""
        from .prompt_cache import system_prefix

        ids = self.chat_ids(self.template.render(messages, add_generation_prompt=True, tools=tools,
                                                 **(template_vars or {})))
        return ids, system_prefix(self, messages, ids, tools=tools, template_vars=template_vars)

    def session(self, system: str | None = None, **kw) -> "ChatSession":
        """A chat that keeps its KV cache between turns (see edgekv.ChatSession)."""
        from .session import ChatSession

        return ChatSession(self, system, **kw)

    def complete(self, prompt: str, max_tokens: int = 128, temperature: float = 0.0, **kw) -> str:
        """The whole continuation of `prompt` as one string (greedy by default)."""
        return "".join(e.text for e in self.generate(prompt, max_tokens=max_tokens, temperature=temperature, **kw))


def _prompt_cache(llm: LLM, disk_bytes: int | None, memory_bytes: int | None):
    from .prompt_cache import DEFAULT_DISK, DEFAULT_MEMORY, PromptCache

    for what, v in (("prompt_cache_size", disk_bytes), ("prompt_cache_memory", memory_bytes)):
        if v is not None and (not isinstance(v, int) or v < 0):
            raise EdgekvError(f"{what} must be a number of bytes >= 0, got {v!r}")
    return PromptCache(llm, disk_bytes=DEFAULT_DISK if disk_bytes is None else disk_bytes,
                       memory_bytes=DEFAULT_MEMORY if memory_bytes is None else memory_bytes)


def _check_n(n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise EdgekvError(f"n must be a whole number >= 1, got {n!r}")


def check_context(llm: LLM, cfg) -> None:
    """Refuse an n_ctx whose cache, once full, would not fit in the memory available (one
    ContextError line, before anything is allocated), and warn past the trained context."""
    need = cache_bytes(llm.kv_type, capacities(cfg.windows(), llm.n_ctx), cfg.n_head_kv, cfg.head_dim)
    avail = available_memory()
    if avail is not None and need > avail[0]:
        raise ContextError(f"n_ctx={llm.n_ctx} needs {_size(need)} of {llm.kv_type} KV cache, more than the "
                           f"{_size(avail[0])} of memory available ({avail[1]}); lower n_ctx (--ctx)"
                           + (" or use kv int4" if llm.kv_type != "int4" else ""))
    if llm.n_ctx > cfg.n_ctx_train:
        warnings.warn(f"n_ctx={llm.n_ctx} is past the {cfg.n_ctx_train} tokens {llm.path.name} was trained on: "
                      "attention that reaches further back than that may give worse text", stacklevel=_caller_level())


def _caller_level() -> int:
    """warnings.warn's stacklevel of the first caller outside edgekv (the line a warning names)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "edgekv":
        level, frame = level + 1, frame.f_back
    return level


def available_memory() -> tuple[int, str] | None:
    """(bytes this process can still allocate, where the figure comes from): the least of
    Linux's MemAvailable (sysconf's free physical pages elsewhere), the cgroup's memory limit
    less its usage, and RLIMIT_AS less the address space in use. None when nothing is known."""
    found = []
    meminfo = _read_int("/proc/meminfo", "MemAvailable:")
    if meminfo is not None:
        found.append((meminfo * 1024, "MemAvailable"))
    else:
        for name, what in (("SC_AVPHYS_PAGES", "free physical memory"), ("SC_PHYS_PAGES", "physical memory")):
            try:
                found.append((os.sysconf(name) * os.sysconf("SC_PAGE_SIZE"), what))
                break
            except (AttributeError, ValueError, OSError):
                pass
    try:  # cgroup v2: this process's group ("0::/path"); in a container usually the root
        with open("/proc/self/cgroup") as f:
            group = next((line[3:].strip() for line in f if line.startswith("0::")), "")
    except OSError:
        group = ""
    for d, limit, used in ((f"/sys/fs/cgroup{group.rstrip('/')}", "memory.max", "memory.current"),
                           ("/sys/fs/cgroup", "memory.max", "memory.current"),
                           ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")):  # v1
        lim, cur = _read_int(f"{d}/{limit}"), _read_int(f"{d}/{used}")
        if lim is not None and cur is not None:
            found.append((max(lim - cur, 0), f"cgroup {limit}"))
            break
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            vm = _read_int("/proc/self/status", "VmSize:")
            found.append((max(soft - (vm or 0) * 1024, 0), "RLIMIT_AS"))
    except (ImportError, OSError, ValueError):
        pass
    return min(found) if found else None


def _read_int(path: str, key: str | None = None) -> int | None:
    """The integer in a /proc or /sys file (after `key` on its line), None if absent ("max" too)."""
    try:
        with open(path) as f:
            for line in f:
                if key is None or line.startswith(key):
                    return int(line.split()[1 if key else 0])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.1f} GiB)" if n >= 2**30 else f"{n:,} bytes ({n / 2**20:.1f} MiB)"


def load(model: str | os.PathLike, *, n_ctx: int = 4096, kv: str = "int8", threads: int | None = None,
         device: str = "cpu", progress: bool = True, gpu_layers: int | None = None, prompt_cache: bool = True,
         prompt_cache_size: int | None = None, prompt_cache_memory: int | None = None, evict: str = "window") -> LLM:
    """Load a known model name (pulled on first use) or a .gguf path. device: "cpu", "cuda" or
    "auto" (cuda when a GPU is usable); gpu_layers: with cuda, only the first N blocks on the GPU.
    prompt_cache: reuse prefixes already computed (in memory, at most prompt_cache_memory bytes,
    default 256 MiB) and keep long chat system prompts under $EDGEKV_HOME/prompt-cache (at most
    prompt_cache_size bytes, default 1 GiB); False: neither. evict: what a full ring overwrites,
    one of edgekv.EVICT_POLICIES ("window": the oldest after the sinks; edgekv/evict.py)."""
    from .hub import resolve

    return LLM(resolve(model, progress=progress), n_ctx=n_ctx, kv=kv, threads=threads, device=device,
               gpu_layers=gpu_layers, prompt_cache=prompt_cache, prompt_cache_size=prompt_cache_size,
               prompt_cache_memory=prompt_cache_memory, evict=evict)
