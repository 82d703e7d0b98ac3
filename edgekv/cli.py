"""The `edgekv` command. Each verb is a small function; errors reach the user as one line."""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import warnings
from collections import Counter

from . import __version__
from .errors import EdgekvError
from .evict import EVICT_POLICIES
from .kvcache import KV_KINDS


def cmd_pull(args) -> int:
    from .hub import pull

    for name in args.models:
        path = pull(name, progress=not args.quiet, force=args.force)
        print(path)
    return 0


def cmd_list(args) -> int:
    from .hub import list_models

    rows = list_models()
    print(f"{'name':<26} {'cached':<7} {'size':>9}  path / description")
    for r in rows:
        size = f"{r['size'] / 1e6:.0f} MB" if r.get("size") else ""
        where = r.get("path") if r.get("cached") else r.get("description", "")
        print(f"{r['name']:<26} {'yes' if r.get('cached') else 'no':<7} {size:>9}  {where}")
    return 0


def describe(path, n_ctx: int) -> list[tuple[str, str]]:
    """The facts `edgekv info` prints, as (label, value) rows."""
    from .gguf_file import GGUFFile
    from .kernels_cpu.qmatmul import kernel_paths
    from .kvcache import KV_BYTES_PER_VALUE, RECENT, capacities, kv_bytes, recent_bytes
    from .models import model_module
    from .tokenizer import Tokenizer

    f = GGUFFile(path)
    cfg = model_module(f.arch).Config.from_gguf(f)
    tok = Tokenizer.from_metadata(f.meta)
    n_params = sum(t.n_elements for t in f.tensors.values())
    types = Counter()
    nbytes = Counter()
    for t in f.tensors.values():
        types[t.type_name] += 1
        nbytes[t.type_name] += t.nbytes
    hist = ", ".join(f"{k} x{types[k]} ({nbytes[k] / 1e6:.1f} MB)" for k in sorted(types, key=lambda k: -nbytes[k]))
    special = []
    for label, tid in (("bos", tok.bos_id), ("eos", tok.eos_id)):
        if tid is not None:
            special.append(f"{label}={tid} {tok.token_text(tid)!r}")
    eot = sorted(tok.eot_ids)
    special.append("end of turn: " + ", ".join(f"{i} {tok.token_text(i)!r}" for i in eot[:6]) + (" ..." if len(eot) > 6 else ""))
    windows = cfg.windows()
    rows = [
        ("file", str(f.path)),
        ("architecture", f.arch + (f" ({f.meta['general.name']})" if isinstance(f.meta.get("general.name"), str) else "")),
        ("parameters", f"{n_params / 1e6:.1f} M ({f.size / 1e6:.1f} MB file)"),
        ("tensor types", hist),
        ("layers / width", f"{cfg.n_layer} x {cfg.n_embd}, ffn {cfg.n_ff}"),
        ("heads", f"{cfg.n_head} query, {cfg.n_head_kv} kv, head size {cfg.head_dim}"),
        ("context length", f"{cfg.n_ctx_train} (trained)"),
        ("vocab", f"{cfg.n_vocab} ({f.meta.get('tokenizer.ggml.model')}, pre {f.meta.get('tokenizer.ggml.pre', '-')})"),
        ("special tokens", "; ".join(special)),
        ("chat template", "yes (from the file)" if isinstance(f.meta.get("tokenizer.chat_template"), str) else "no (edgekv's built-in fallback)"),
        ("CPU kernels", kernel_paths()),
    ]
    if any(windows):
        rows.append(("sliding window", f"{sum(1 for w in windows if w)} of {cfg.n_layer} layers see the last {max(windows)} tokens"))
    per_tok = {k: kv_bytes(k, [1] * cfg.n_layer, cfg.n_head_kv, cfg.head_dim) for k in KV_BYTES_PER_VALUE}
    rows.append(("KV bytes / token", ", ".join(f"{k} {v:,}" for k, v in per_tok.items()) + " (all layers, K+V)"))
    caps = capacities(windows, n_ctx)
    full = [n_ctx] * cfg.n_layer
    for k in KV_BYTES_PER_VALUE:
        b = kv_bytes(k, caps, cfg.n_head_kv, cfg.head_dim)
        saved = kv_bytes(k, full, cfg.n_head_kv, cfg.head_dim) - b
        note = f" (sliding-window rings save {saved / 2**20:.1f} MiB)" if saved else ""
        rows.append((f"KV cache @ {n_ctx}", f"{k}: {b / 2**20:.1f} MiB{note}"))
    fixed = recent_bytes("int4", cfg.n_layer, cfg.n_head_kv, cfg.head_dim)
    rows.append(("KV exact recent", f"int8/int4: + {fixed / 2**10:.0f} KiB fixed (the last {RECENT} tokens per layer in f16)"))
    return rows


def cmd_info(args) -> int:
    from .hub import resolve

    rows = describe(resolve(args.model, progress=not args.quiet), args.ctx)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _sampling_args(args) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, seed=args.seed)


def _load_args(args) -> dict:
    return dict(n_ctx=args.ctx, kv=args.kv, threads=args.threads, device=args.device, gpu_layers=args.gpu_layers,
                prompt_cache=not args.no_prompt_cache, prompt_cache_size=args.prompt_cache_size, evict=args.evict)


def read_text_file(path: str) -> str:
    """A prompt or text file as a str (invalid UTF-8 as U+FFFD), or one EdgekvError line."""
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise EdgekvError(f"cannot read {path}: {e.strerror or e}") from None


def _run_prompt(args) -> str:
    if args.file is not None:
        if args.prompt is not None:
            raise EdgekvError("give PROMPT or -f FILE, not both")
        return read_text_file(args.file)
    if args.prompt is None:
        raise EdgekvError("no prompt: give PROMPT, - to read stdin, -f FILE, -p TEXT or --prompts FILE")
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def _run_prompts(args) -> list[str]:
    """run's prompts: PROMPT (or stdin, or -f FILE) if given, then each -p, then each non-blank
    line of --prompts FILE; checked against the other flags before a model loads."""
    more = list(args.more_prompts or [])
    if args.prompts_file is not None:
        lines = [line for line in read_text_file(args.prompts_file).splitlines() if line.strip()]
        if not lines:
            raise EdgekvError(f"{args.prompts_file} holds no prompts (one a line)")
        more += lines
    prompts = more if more and args.prompt is None and args.file is None else [_run_prompt(args)] + more
    if args.beams is not None:
        if args.parallel > 1:
            raise EdgekvError("--parallel does not apply to --beams (a prompt's beams already decode as one batch)")
        if args.stop:
            raise EdgekvError("--stop does not apply to --beams (a beam ends at EOS or -n)")
        if args.n_samples > args.beams:
            raise EdgekvError(f"--n-samples {args.n_samples} with --beams {args.beams}: at most the {args.beams} beams")
    return prompts


def _run_input(llm, args, prompt: str) -> tuple:
    """(what to generate from, keep) for one prompt: the text, or the chat template's ids with
    the length of a long system prompt (what the prompt cache keeps)."""
    from .prompt_cache import system_prefix

    if not (args.chat or args.system is not None):
        return prompt, 0
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    ids = llm.chat_ids(llm.template.render(messages, add_generation_prompt=True))
    return ids, system_prefix(llm, messages, ids)


def cmd_run(args) -> int:
    import json

    from .llm import load
    from .warmup import prepare

    prompts = _run_prompts(args)
    llm = load(args.model, progress=not args.quiet, **_load_args(args))
    # a fresh install compiles first, behind a bar; a warm one loads only the kernels this run calls
    prepare(llm, progress=not args.quiet, load=False)
    if len(prompts) > 1 or args.n_samples > 1 or args.beams is not None:
        return _run_many(args, llm, [_run_input(llm, args, p)[0] for p in prompts])
    prompt_in, keep = _run_input(llm, args, prompts[0])
    pieces, reason = [], None
    tty = sys.stdout.isatty()  # a terminal gets control characters escaped, a pipe the exact text
    for e in llm.generate(prompt_in, max_tokens=args.max_tokens, stop=args.stop or (), keep=keep,
                          **_sampling_args(args)):
        pieces.append(e.text)
        reason = e.finish_reason or reason
        if not args.json:
            print(printable(e.text) if tty else e.text, end="", flush=True)
    if args.json:
        print(json.dumps(dict(model=str(llm.path), text="".join(pieces), finish_reason=reason, **llm.stats.as_dict())))
    else:  # a pipe gets the text as generated; a person is told where it was cut
        print(cut_note(args.max_tokens, Style.for_stdout()) if tty and reason == "length" else "", flush=True)
    return 0


def _run_many(args, llm, prompts: list) -> int:
    """Several prompts (--parallel of them at a time: each worker thread takes the next prompt
    as soon as its last is done, and the LLM's scheduler decodes what the threads have going as
    one batch) or several samples (--n-samples, one prefill each) or beams of each: every result
    printed whole under a label, in the prompts' order, or (--json) one JSON object a line."""
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    k, tty, style = args.n_samples, sys.stdout.isatty(), Style.for_stdout()
    if args.beams is not None:
        results = (llm.beam_search(p, args.beams, max_tokens=args.max_tokens)[:k] for p in prompts)
    else:
        def one(p):
            return llm.generate_many([p], n=k, max_tokens=args.max_tokens, stop=args.stop or (), cancel=cancel,
                                     **_sampling_args(args))

        cancel = threading.Event()
        pool = ThreadPoolExecutor(max_workers=args.parallel, thread_name_prefix="edgekv-run")
        results = pool.map(one, prompts)
    try:
        for j, done in enumerate(results):
            for i, c in enumerate(done):
                score = getattr(c, "score", None)  # beams only
                if args.json:
                    extra = {} if score is None else dict(score=round(score, 6))
                    print(json.dumps(dict(model=str(llm.path), prompt=j, sample=i, text=c.text,
                                          finish_reason=c.finish_reason, **extra, **c.stats.as_dict())), flush=True)
                    continue
                label = [f"prompt {j + 1}"] if len(prompts) > 1 else []
                label += [f"beam {i + 1}, score {score:.4f}"] if score is not None else [f"sample {i + 1}"] if k > 1 else []
                cut = cut_note(args.max_tokens, style) if tty and c.finish_reason == "length" else ""
                if j or i:
                    print()  # a blank line between results
                print(f"{style.note}--- {', '.join(label)} ---{style.reset}")
                print((printable(c.text) if tty else c.text) + cut, flush=True)
    finally:
        if args.beams is None:
            cancel.set()  # Ctrl-C or an error: the workers stop at their next token
            pool.shutdown(wait=True, cancel_futures=True)
    return 0


HELP = """commands:
  /help            this text
  /reset           forget the conversation
  /regen           answer the last message again (the old reply is dropped)
  /undo            drop the last message and its reply
  /system          show the system prompt
  /system TEXT     set the system prompt (and reset)
  /system --clear  remove the system prompt (and reset)
  /save FILE       save the session (cache included) to FILE
  /load FILE       continue a saved session
  /stats           speed of the last reply, tokens prefilled and cached this turn, KV use
  /kv              cache type, capacity and fill
  /history         the conversation so far (with --summarize: the summary of the folded turns first)
  /exit            quit (Ctrl-D works too)
Ctrl-C stops the current reply and keeps the chat. End a line with \\ to continue on the next."""


class Style:
    """ANSI styles for a terminal that wants them, empty strings otherwise: what the person
    types (and its prompt) in bold green, so it stands apart from the reply; edgekv's own notes
    dim."""

    def __init__(self, on: bool):
        self.user = "\033[1;32m" if on else ""
        self.note = "\033[2m" if on else ""
        self.reset = "\033[0m" if on else ""

    @classmethod
    def for_stdout(cls) -> "Style":
        """Colour only on a terminal, and not when NO_COLOR is set (no-color.org) or TERM=dumb."""
        return cls(sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb")


def cut_note(max_tokens: int, style: Style) -> str:
    """What ends a reply that stopped at -n rather than where the model ended it."""
    return f" […]\n{style.note}(cut at -n {max_tokens} tokens){style.reset}"


# C0 controls but newline and tab, DEL, and the C1 range (0x9b is an 8-bit CSI to some terminals).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Model output made safe for a terminal: control characters other than newline and tab
    shown in caret notation (ESC as ^[), so generated text cannot move the cursor, retitle the
    window or hide what was printed."""
    return _CONTROL.sub(lambda m: "^" + chr(ord(m.group()) ^ 0x40) if m.group() <= "\x7f"
                        else f"\\x{ord(m.group()):02x}", text)


def _read_message(style: Style) -> str:
    """One message; a trailing backslash continues it on the next line. What is typed shows in
    the user's style (readline needs the escape codes in the prompt bracketed by \\001..\\002)."""
    on = f"\001{style.user}\002" if style.user else ""
    lines = []
    try:
        while True:
            line = input(on + ("> " if not lines else "... "))
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)
    finally:
        print(style.reset, end="", flush=True)


COLD_TOKENS = 64  # a prefill this long measures the cold speed /stats compares a cached turn with


def reuse_line(st, cold_tps: float) -> str:
    """/stats's second line: the tokens this turn took from a cache and the effective prompt
    speed (all prompt tokens over the prefill time) against a cold prefill's speed."""
    if not st.prompt_tokens:
        return "no turn yet"
    where = {"sequence": "this chat's cache", "memory": "the prompt cache in memory",
             "disk": "the prompt cache on disk"}.get(st.cached_from, "a cache")
    line = (f"cached {st.cached_tokens} of {st.prompt_tokens} prompt tokens" + (f" (from {where})" if st.cached_tokens else "")
            + f"; time to first token {st.prefill_s * 1e3:.0f} ms")
    if st.cached_tokens and st.prefill_s and cold_tps:
        eff = st.prompt_tokens / st.prefill_s
        line += (f": effective {eff:.0f} tok/s, {eff / cold_tps:.1f}x a cold prefill ({cold_tps:.0f} tok/s, "
                 f"~{st.prompt_tokens / cold_tps * 1e3:.0f} ms for this prompt)")
    elif st.cached_tokens:
        line += " (no cold prefill measured in this chat yet to compare with)"
    return line


def _kv_line(sess) -> str:
    from .generate import Stats

    kv = Stats()
    kv.measure_kv(sess.seq.cache)
    return (f"kv {sess.llm.kv_type}: {kv.kv_tokens}/{kv.kv_capacity} tokens in the largest ring, "
            f"{kv.kv_bytes_used / 2**20:.2f} of {kv.kv_bytes / 2**20:.2f} MiB in use, "
            f"{len(sess.seq.tokens)} tokens cached" + _evict_note(kv))


def _evict_note(kv) -> str:
    """What an eviction policy has done, for /kv ("" under the window policy)."""
    if kv.evict == "window":
        return ""
    return (f"; evict {kv.evict}: {kv.kv_evicted} tokens evicted over the layers, "
            f"~{100 * kv.kv_kept_mass:.1f}% of attention kept")


def cmd_chat(args) -> int:
    from .hub import DEFAULT_MODEL
    from .llm import load
    from .warmup import prepare

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    first = read_text_file(args.file) if args.file is not None else None
    llm = load(args.model or DEFAULT_MODEL, progress=True, **_load_args(args))
    prepare(llm)  # compile what the chat needs now, behind a bar, not in its first turns
    sess = llm.session(system=args.system, max_tokens=args.max_tokens, summarize=args.summarize, **_sampling_args(args))
    chat = Chat(llm, sess, stop=args.stop or (), style=Style.for_stdout())
    print(f"edgekv chat: {llm.path.name} ({llm.cfg.arch}, kv {llm.kv_type}, ctx {llm.n_ctx}). /help for commands.", flush=True)
    while True:
        if first is not None:
            text, first = first, None
            print(f"> (the text of {args.file}, {len(text)} characters)")
        else:
            try:
                text = _read_message(chat.style)
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print("\n(Ctrl-D or /exit to quit)")
                continue
        try:
            if not chat.step(text):
                return 0
        except KeyboardInterrupt:  # mid-reply, mid-prefill or mid-command: the session stays usable
            print("\n(stopped)", flush=True)


class Chat:
    """What `edgekv chat` does with each line: a slash command or a message to answer."""

    def __init__(self, llm, sess, *, stop=(), style: Style | None = None):
        self.llm, self.sess = llm, sess
        self.stop = tuple(stop)
        self.style = style or Style(False)
        self.cold_tokens, self.cold_tps = 0, 0.0  # the largest prefill this chat computed, and its speed

    def step(self, text: str) -> bool:
        """Handle one line; False to exit."""
        cmd, _, arg = text.strip().partition(" ")
        if not cmd.startswith("/"):
            if text.strip():
                self.reply(lambda **kw: self.sess.send(text, **kw))
            return True
        arg = arg.strip()
        if cmd in ("/exit", "/quit"):
            return False
        handler = self.COMMANDS.get(cmd)
        if handler is None:
            print(f"unknown command {cmd}; /help lists them")
            return True
        try:
            handler(self, arg)
        except EdgekvError as e:
            print(f"error: {e}")
        return True

    def reply(self, answer) -> None:
        """Stream the reply that answer(stream=True, stop=...) produces, marking a cut one."""
        reason, started = None, False
        try:
            for e in answer(stream=True, stop=self.stop):
                print(printable(e.text), end="", flush=True)
                reason, started = e.finish_reason or reason, True
            print(cut_note(self.sess.max_tokens, self.style) if reason == "length" else "", flush=True)
        except EdgekvError as e:
            print(f"\nerror: {e}" if started else f"error: {e}", flush=True)
        self._remember_speed()

    def _help(self, arg):
        print(HELP)

    def _reset(self, arg):
        self.sess.reset()
        print("(conversation reset)")

    def _regen(self, arg):
        self.reply(self.sess.regenerate)

    def _undo(self, arg):
        self.sess.undo()
        print(f"(last exchange dropped; {len(self.sess.history)} messages left)")

    def _system(self, arg):
        if not arg:
            current = self.sess.system
            print(f"(system prompt: {printable(current)})" if current else "(no system prompt; /system TEXT sets one)")
        elif arg == "--clear":
            self.sess.reset(system=None)
            print("(system prompt removed; conversation reset)")
        else:
            self.sess.reset(system=arg)
            print("(system prompt set; conversation reset)")

    def _stats(self, arg):
        st = self.sess.stats
        print(f"prefill {st.prefill_tokens} of {st.prompt_tokens} prompt tokens ({st.prefill_tps:.1f} tok/s), "
              f"decode {st.generated_tokens} tokens ({st.decode_tps:.1f} tok/s); " + _kv_line(self.sess))
        print(reuse_line(st, self.cold_tps))

    def _remember_speed(self) -> None:
        """The prefill speed of the largest uncached prefill so far: what a cold turn costs."""
        st = self.sess.stats
        if st.prefill_tokens >= COLD_TOKENS and st.prefill_tokens > self.cold_tokens and st.prefill_tps:
            self.cold_tokens, self.cold_tps = st.prefill_tokens, st.prefill_tps

    def _kv(self, arg):
        print(_kv_line(self.sess))

    def _history(self, arg):
        sess = self.sess
        if sess.summary:
            print(f"{self.style.note}[summary of {sess.folded} earlier turn{'s' if sess.folded != 1 else ''}]"
                  f"{self.style.reset} {printable(sess.summary)}")
        for m in sess.history:
            print(f"{self.style.note}{m['role']}:{self.style.reset} {printable(m['content'])}")
        if not sess.summary and not sess.history:
            print("(nothing said yet)")

    def _save(self, arg):
        if not arg:
            print("usage: /save FILE")
            return
        self.sess.save(arg)
        print(f"(saved to {arg})")

    def _load(self, arg):
        if not arg:
            print("usage: /load FILE")
            return
        from .session import ChatSession

        self.sess = ChatSession.load(arg, self.llm)  # the current one stays unless the file loads completely
        print(f"(loaded {arg}: {len(self.sess.history)} messages, {self.sess.n_cached} tokens cached)")

    COMMANDS = {"/help": _help, "/reset": _reset, "/regen": _regen, "/undo": _undo, "/system": _system,
                "/stats": _stats, "/kv": _kv, "/history": _history, "/save": _save, "/load": _load}


def cmd_warmup(args) -> int:
    from .llm import load
    from .warmup import prepare

    llm = load(args.model, kv=args.kv, progress=not args.quiet) if args.model else None
    n = prepare(llm, progress=not args.quiet)
    print(f"kernels ready{f' ({n} compiled in this process)' if n else ''}")
    return 0


def exposed(host: str, api_key: str | None) -> str | None:
    """The warning for a server other machines can reach without a key (None: no warning)."""
    from .server import loopback

    if loopback(host) or api_key is not None:  # a host name other than localhost may resolve to anything
        return None
    return (f"--host {host} lets other machines use this server, and no --api-key is set (or EDGEKV_API_KEY): "
            "anyone who can reach it can run the model")


def cmd_serve(args) -> int:
    from pathlib import Path

    from .hub import DEFAULT_MODEL
    from .llm import load
    from .warmup import prepare

    try:  # the optional extra, before the model loads: a missing one fails at once
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise EdgekvError(f"edgekv serve needs the server extra ({e.name} is not installed): "
                          'pip install "edgekv[server]"') from None
    from .server import serve

    api_key = args.api_key or os.environ.get("EDGEKV_API_KEY") or None
    if exposed(args.host, api_key):
        warnings.warn(exposed(args.host, api_key))
    model = args.model or DEFAULT_MODEL
    llm = load(model, progress=not args.quiet, **_load_args(args))
    prepare(llm, progress=not args.quiet)  # compile before the first request, not in it
    serve(llm, host=args.host, port=args.port, parallel=args.parallel, api_key=api_key,
          aliases={model, Path(model).name, Path(model).stem}, log_format=args.log_format)
    return 0


def cmd_bench(args) -> int:
    from .bench import format_table, plot, plot_backend, run_bench
    from .hub import resolve

    if args.plot:
        plot_backend()
    path = resolve(args.model, progress=not args.quiet)
    result = run_bench(path, prompt=args.p, gen=args.n, depths=args.d, kvs=args.kv, threads=args.t or [None],
                       reps=args.r, compare=args.compare == "llama.cpp", progress=not args.quiet,
                       background_load=args.background_load, evict=args.evict, ring=args.ring)
    print(format_table(result, args.o))
    if args.plot:
        plot(result, args.plot)
    return 0


def cmd_perplexity(args) -> int:
    import json

    from .llm import load
    from .perplexity import perplexity, ring_perplexity

    text = read_text_file(args.file)  # before the load: a wrong name fails at once
    if args.ring:  # streamed through a ring of that size, against an uncapped f16 cache
        llm = load(args.model, n_ctx=max(args.ctx, args.ring), threads=args.threads, progress=not args.quiet)
        ids = llm.tokenize(text, special=False)[: args.tokens]
        res = ring_perplexity(llm, ids, rings=(args.ring,), kinds=list(args.kv), evicts=list(args.evict),
                              progress=not args.quiet)[str(args.ring)]
        print(json.dumps(dict(model=str(llm.path), tokens=len(ids), ring=args.ring, results=res), indent=2))
        return 0
    if args.evict != ["window"]:
        raise EdgekvError("--evict needs --ring N: windows of --ctx never fill a ring")
    llm = load(args.model, n_ctx=args.ctx, threads=args.threads, progress=not args.quiet)
    ids = llm.tokenize(text, special=False)
    kinds = list(args.kv)
    if args.kl_base and args.kl_base not in kinds:
        kinds.insert(0, args.kl_base)
    res = perplexity(llm, ids, n_ctx=args.ctx, kinds=kinds, kl_base=args.kl_base, progress=not args.quiet)
    print(json.dumps(dict(model=str(llm.path), tokens=len(ids), n_ctx=args.ctx, results=res), indent=2))
    return 0


def cmd_synth(args) -> int:
    from pathlib import Path

    from .synth import write_synthetic

    if Path(args.out).is_dir():
        raise EdgekvError(f"{args.out} is a folder; give the file to write, e.g. {Path(args.out) / 'model.gguf'}")
    try:
        path = write_synthetic(args.out, arch=args.arch, size=args.size, qtype=args.type, seed=args.seed,
                               progress=not args.quiet)
    except OSError as e:
        raise EdgekvError(f"cannot write {args.out}: {e.strerror or e}") from None
    print(path)
    return 0


# --- arguments: a bad value is argparse's one-line error before anything loads ---------------

def int_range(lo: int, hi: int | None = None, hi_text: str | None = None):
    """An argparse type: an int in [lo, hi] (hi_text: how the message writes hi)."""
    want = f">= {lo}" if hi is None else f"in [{lo}, {hi_text or hi}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {v}")
        return v

    return parse


positive_int = int_range(1)
nonnegative_int = int_range(0)


def thread_count(text: str) -> int | None:
    """An argparse type: a thread count, or auto (None: chosen by the load)."""
    return None if text == "auto" else positive_int(text)

context_size = int_range(8)  # the ring keeps 4 sinks; fewer than 8 tokens is no context


def real_range(lo: float, hi: float = math.inf, *, lo_open: bool = False):
    """An argparse type: a finite float in [lo, hi] ((lo, hi] with lo_open)."""
    want = f"{'(' if lo_open else '['}{lo}, {hi}{']' if hi < math.inf else ')'}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
            raise argparse.ArgumentTypeError(f"must be in {want}, got {text}")
        return v

    return parse


def comma_list(item):
    """An argparse type: comma-separated values, each parsed by `item`; at least one."""

    def parse(text: str) -> list:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError("needs at least one value")
        return values

    return parse


def byte_size(text: str) -> int:
    """An argparse type: a number of bytes, with an optional K, M or G (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)i?b?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1G, 512M, 1000000)")
    return int(m[1]) * 1024 ** " kmg".index(m[2] or " ")


def evict_policy(text: str) -> str:
    """An argparse type: one of edgekv.EVICT_POLICIES."""
    if text not in EVICT_POLICIES:
        raise argparse.ArgumentTypeError(f"unknown eviction policy {text!r} (choose {', '.join(EVICT_POLICIES)})")
    return text


def kv_kind(text: str) -> str:
    """An argparse type: one of the KV cache types."""
    if text not in KV_KINDS:
        raise argparse.ArgumentTypeError(f"unknown KV cache type {text!r} (choose {', '.join(KV_KINDS)})")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage it would print first is what --help is for)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every default, except the ones that are no value (None, off)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_load_args(s) -> None:
    s.add_argument("--ctx", type=context_size, default=4096,
                   help="KV cache capacity in tokens (a ring: longer text keeps the first 4 and the most recent)")
    s.add_argument("--kv", type=kv_kind, default="int8", metavar="|".join(KV_KINDS), help="KV cache type")
    s.add_argument("--evict", type=evict_policy, default="window", metavar="|".join(EVICT_POLICIES),
                   help="what a full ring overwrites: window = the oldest after the sinks; h2o, tova = the token "
                   "attention needs least (edgekv/evict.py)")
    s.add_argument("--threads", type=positive_int, default=None, metavar="N", help="CPU threads, used as given (default: at most the physical cores, fewer while other programs keep cores busy)")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="auto: cuda when a GPU is usable")
    s.add_argument("--gpu-layers", type=nonnegative_int, default=None, metavar="N",
                   help="with cuda: only the first N blocks on the GPU (default: all)")
    s.add_argument("--no-prompt-cache", action="store_true",
                   help="do not reuse prefixes already computed, nor keep long system prompts under $EDGEKV_HOME/prompt-cache")
    s.add_argument("--prompt-cache-size", type=byte_size, default=2**30, metavar="BYTES",
                   help="most bytes the prompt cache on disk keeps, least recently used out first (K, M, G suffixes; 0 = none on disk)")


def _add_sampling_args(s, temp: float, why: str) -> None:
    s.add_argument("--temp", type=real_range(0.0), default=temp, help=f"temperature (0 = greedy; {why})")
    s.add_argument("--top-k", type=nonnegative_int, default=40, metavar="K", help="keep the K likeliest tokens (0 = off)")
    s.add_argument("--top-p", type=real_range(0.0, 1.0, lo_open=True), default=0.95, metavar="P",
                   help="keep the likeliest tokens whose probabilities sum to P (1 = off)")
    s.add_argument("--min-p", type=real_range(0.0, 1.0), default=0.05, metavar="P",
                   help="drop tokens under P times the likeliest one's probability (0 = off)")
    s.add_argument("--repeat-penalty", type=real_range(0.0, lo_open=True), default=1.0, metavar="X",
                   help="penalty on tokens already seen (1 = off)")
    s.add_argument("--stop", action="append", metavar="TEXT", help="stop at TEXT (repeatable)")
    s.add_argument("--seed", type=int_range(0, 2**128 - 1, "2**128 - 1"), default=None, help="same seed, same text (default: random)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="edgekv", description="Quantized GGUF LLM inference with an INT8/INT4 ring-buffer KV cache.")
    p.add_argument("--version", action="version", version=f"edgekv {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="COMMAND")

    def verb(name, func, help):
        s = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
        s.set_defaults(func=func)
        return s

    quiet = dict(action="store_true", help="no progress bars")
    s = verb("pull", cmd_pull, "download a known model into the cache")
    s.add_argument("models", nargs="+", metavar="MODEL", help="known model names (edgekv list)")
    s.add_argument("--force", action="store_true", help="fetch again even if cached")
    s.add_argument("-q", "--quiet", **quiet)

    verb("list", cmd_list, "known and cached models")

    s = verb("info", cmd_info, "what is in a model file")
    s.add_argument("model", metavar="MODEL", help="known name or .gguf path")
    s.add_argument("--ctx", type=context_size, default=4096, help="context size for the KV-cache figures")
    s.add_argument("-q", "--quiet", **quiet)

    s = verb("run", cmd_run, "one-shot completion, streamed to stdout")
    s.add_argument("model", metavar="MODEL", help="known name or .gguf path")
    s.add_argument("prompt", nargs="?", default=None, metavar="PROMPT", help="text, or - to read stdin (or -f FILE)")
    s.add_argument("-f", "--file", default=None, metavar="FILE", help="read the prompt from FILE")
    s.add_argument("-p", "--prompt", dest="more_prompts", action="append", metavar="TEXT",
                   help="a prompt (repeatable: several prompts, each result printed under a label)")
    s.add_argument("--prompts", dest="prompts_file", default=None, metavar="FILE", help="one prompt per line of FILE")
    s.add_argument("-n", "--max-tokens", type=nonnegative_int, default=128, metavar="N",
                   help="tokens to generate (chat's default is 512: a reply, not a continuation)")
    s.add_argument("--n-samples", type=positive_int, default=1, metavar="K",
                   help="K completions of each prompt from one prefill, decoded as one batch (sample i: --seed + i)")
    s.add_argument("--parallel", type=positive_int, default=1, metavar="N",
                   help="decode up to N prompts at a time as one batch (the next starts as one finishes)")
    s.add_argument("--beams", type=positive_int, default=None, metavar="N",
                   help="beam search with N beams (no sampling; prints the best, or the --n-samples best)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--system", default=None, metavar="TEXT", help="system prompt (implies --chat)")
    s.add_argument("--json", action="store_true", help="print one JSON object (text, token counts, timings)")
    _add_load_args(s)
    _add_sampling_args(s, 0.0, "greedy by default, the same text every run; chat's is 0.7")
    s.add_argument("-q", "--quiet", **quiet)

    s = verb("chat", cmd_chat, "interactive chat in the terminal (/help inside lists its commands)")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL", help="known name or .gguf path (default: smollm2-135m-instruct)")
    s.add_argument("-n", "--max-tokens", type=positive_int, default=512, metavar="N",
                   help="longest reply in tokens; a longer one is cut and marked (run's default is 128)")
    s.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    s.add_argument("-f", "--file", default=None, metavar="FILE", help="send the text of FILE as the first message")
    s.add_argument("--summarize", action="store_true",
                   help="before the conversation outgrows the context, fold its oldest turns into a summary "
                        "(/history shows it) instead of letting the ring drop them")
    _add_load_args(s)
    _add_sampling_args(s, 0.7, "sampled by default, for varied replies; run's is 0")

    s = verb("warmup", cmd_warmup, "compile the CPU kernels now (a first chat otherwise starts with it)")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL", help="also run this model once (default: none)")
    s.add_argument("--kv", type=kv_kind, default="int8", help="KV cache type of that run")
    s.add_argument("-q", "--quiet", **quiet)

    s = verb("serve", cmd_serve, "an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL", help="known name or .gguf path (default: smollm2-135m-instruct)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (another than localhost wants --api-key)")
    s.add_argument("--port", type=int_range(0, 65535), default=8080, help="port (0: any free one, printed at start)")
    s.add_argument("--parallel", type=positive_int, default=4, metavar="N",
                   help="sequences generated at once, batched (a request with n choices takes n); more requests wait")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on /v1 (default: $EDGEKV_API_KEY, else none)")
    s.add_argument("--log-format", default="text", choices=["text", "json"], help="one line per request, as text or JSON")
    _add_load_args(s)
    s.add_argument("-q", "--quiet", **quiet)

    s = verb("bench", cmd_bench, "speed tests like llama-bench, optionally beside llama.cpp")
    s.add_argument("model", metavar="MODEL", help="known name or .gguf path")
    s.add_argument("-p", type=comma_list(nonnegative_int), default="512", help="prompt lengths to prefill, comma-separated (0 = none)")
    s.add_argument("-n", type=comma_list(nonnegative_int), default="128", help="tokens to generate, comma-separated (0 = none)")
    s.add_argument("-d", type=comma_list(nonnegative_int), default="0", help="context depths already filled, comma-separated")
    s.add_argument("-r", type=positive_int, default=3, help="repetitions (after one warm-up run)")
    s.add_argument("-t", type=comma_list(thread_count), default=None,
                   help="thread counts, comma-separated; auto (the default): edgekv picks at most the physical cores "
                   "by the load, as run and chat do, and llama.cpp gets the physical cores")
    s.add_argument("--background-load", type=nonnegative_int, default=0, metavar="N",
                   help="also run every test beside N busy processes, quiet and loaded side by side")
    s.add_argument("--kv", type=comma_list(kv_kind), default="f16",
                   help="cache types, comma-separated; f16 as llama-bench, where run and chat default to int8")
    s.add_argument("--ring", type=context_size, default=None, metavar="N",
                   help="edgekv's cache holds N tokens (default: every test's), full rings evicting by --evict")
    s.add_argument("--evict", type=evict_policy, default="window", metavar="|".join(EVICT_POLICIES),
                   help="what edgekv's full ring overwrites (see run --help)")
    s.add_argument("-o", default="md", choices=["md", "json", "csv"], help="output format")
    s.add_argument("--compare", choices=["llama.cpp"], default=None, help="run llama.cpp too, interleaved")
    s.add_argument("--plot", default=None, metavar="FILE.png", help="plot decode speed against depth")
    s.add_argument("-q", "--quiet", **quiet)

    s = verb("perplexity", cmd_perplexity, "perplexity of a text file, and KL of a cache type vs f16")
    s.add_argument("model", metavar="MODEL", help="known name or .gguf path")
    s.add_argument("file", metavar="FILE", help="UTF-8 text")
    s.add_argument("--ctx", type=context_size, default=512, help="window size")
    s.add_argument("--kv", type=comma_list(kv_kind), default="f16", help="cache types, comma-separated")
    s.add_argument("--kl-base", type=kv_kind, default=None, help="cache type the others are compared against (e.g. f16)")
    s.add_argument("--ring", type=context_size, default=None, metavar="N",
                   help="stream the text one token at a time through a ring of N tokens per --kv and --evict, "
                   "scored against an uncapped f16 cache (KL, top-1) from position N on")
    s.add_argument("--evict", type=comma_list(evict_policy), default="window",
                   help=f"with --ring: eviction policies, comma-separated ({', '.join(EVICT_POLICIES)})")
    s.add_argument("--tokens", type=positive_int, default=None, metavar="N", help="with --ring: the text's first N tokens only")
    s.add_argument("--threads", type=positive_int, default=None, metavar="N", help="CPU threads, used as given (default: at most the physical cores, fewer while other programs keep cores busy)")
    s.add_argument("-q", "--quiet", **quiet)

    s = verb("synth", cmd_synth, "write a synthetic GGUF with real shapes and random weights (for benchmarks)")
    s.add_argument("out", metavar="OUT.gguf", help="file to write")
    s.add_argument("--arch", default="llama", choices=["llama", "gemma2", "gemma3", "qwen3", "granite", "phi3"], help="architecture")
    s.add_argument("--size", default="7b", help="llama: tiny, 1b, 7b, 13b, 8b (Llama-3.1), 12b (Mistral-Nemo); "
                   "gemma2: tiny, 9b; gemma3: tiny, 270m, 1b; qwen3: tiny, 8b; granite: tiny, 8b; "
                   "phi3: tiny, tiny-phi4, 3.8b (Phi-3.5-mini), 4b (Phi-4-mini)")
    s.add_argument("--type", default="q4_0", help="q4_0, q5_0, q8_0, q4_k, q6_k, f16, f32")
    s.add_argument("--seed", type=int_range(0, 2**64 - 1, "2**64 - 1"), default=0, help="same seed, same bytes")
    s.add_argument("-q", "--quiet", **quiet)
    return p


def _quiet_llvmlite_cleanup(hook):
    """An unraisable-exception hook that drops the cleanup error of an LLVM object half-made
    when Ctrl-C stopped a JIT compile (llvmlite's ObjectRef.__del__): harmless, the next
    compile starts over, and a traceback is not what a person pressing Ctrl-C should see."""

    def quiet(u):
        if not getattr(u.object, "__module__", "").startswith("llvmlite."):
            hook(u)

    quiet.edgekv = True
    return quiet


def _end_progress_bars() -> None:
    """Close the bars an error left open, so its line starts on a line of its own."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one `edgekv: warning:` line (Python's shows the file, line and source too)."""
    _end_progress_bars()
    print(f"edgekv: warning: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    if not getattr(sys.unraisablehook, "edgekv", False):
        sys.unraisablehook = _quiet_llvmlite_cleanup(sys.unraisablehook)
    args = build_parser().parse_args(argv)
    warnings.showwarning = _warning_line
    if not getattr(args, "func", None):
        build_parser().print_help()
        return 2
    try:
        return args.func(args)
    except EdgekvError as e:
        _end_progress_bars()
        print(f"edgekv: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nedgekv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `edgekv info ... | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
