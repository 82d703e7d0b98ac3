"""The `edgekv` command. Each verb is a small function; errors reach the user as one line."""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

from . import __version__
from .errors import EdgekvError


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
    from .kvcache import KV_BYTES_PER_VALUE, RECENT, kv_bytes, recent_bytes
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
    ]
    if any(windows):
        rows.append(("sliding window", f"{sum(1 for w in windows if w)} of {cfg.n_layer} layers see the last {max(windows)} tokens"))
    per_tok = {k: kv_bytes(k, [1] * cfg.n_layer, cfg.n_head_kv, cfg.head_dim) for k in KV_BYTES_PER_VALUE}
    rows.append(("KV bytes / token", ", ".join(f"{k} {v:,}" for k, v in per_tok.items()) + " (all layers, K+V)"))
    caps = [min(w, n_ctx) if w else n_ctx for w in windows]
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


def cmd_run(args) -> int:
    import json

    from .llm import load

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    llm = load(args.model, n_ctx=args.ctx, kv=args.kv, threads=args.threads, device=args.device, progress=not args.quiet,
               gpu_layers=args.gpu_layers)
    if args.chat:
        prompt_in = llm.chat_ids(llm.template.render([{"role": "user", "content": prompt}], add_generation_prompt=True))
    else:
        prompt_in = prompt
    pieces, reason = [], None
    tty = sys.stdout.isatty()  # a terminal gets control characters escaped, a pipe the exact text
    for e in llm.generate(prompt_in, max_tokens=args.max_tokens, stop=args.stop or (), **_sampling_args(args)):
        pieces.append(e.text)
        reason = e.finish_reason or reason
        if not args.json:
            print(printable(e.text) if tty else e.text, end="", flush=True)
    if args.json:
        print(json.dumps(dict(model=str(llm.path), text="".join(pieces), finish_reason=reason, **llm.stats.as_dict())))
    else:
        print(flush=True)
    return 0


HELP = """commands:
  /help            this text
  /reset           forget the conversation
  /system TEXT     set the system prompt (and reset)
  /save FILE       save the session (cache included) to FILE
  /load FILE       continue a saved session
  /stats           speed of the last reply, tokens prefilled this turn, KV use
  /kv              cache type, capacity and fill
  /exit            quit (Ctrl-D works too)
Ctrl-C stops the current reply and keeps the chat. End a line with \\ to continue on the next."""


# C0 controls but newline and tab, DEL, and the C1 range (0x9b is an 8-bit CSI to some terminals).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Model output made safe for a terminal: control characters other than newline and tab
    shown in caret notation (ESC as ^[), so generated text cannot move the cursor, retitle the
    window or hide what was printed."""
    return _CONTROL.sub(lambda m: "^" + chr(ord(m.group()) ^ 0x40) if m.group() <= "\x7f"
                        else f"\\x{ord(m.group()):02x}", text)


def _read_message(prompt: str) -> str:
    """One message; a trailing backslash continues it on the next line."""
    lines = []
    while True:
        line = input(prompt if not lines else "... ")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def _kv_line(sess) -> str:
    from .generate import Stats

    kv = Stats()
    kv.measure_kv(sess.seq.cache)
    return (f"kv {sess.llm.kv_type}: {kv.kv_tokens}/{kv.kv_capacity} tokens in the largest ring, "
            f"{kv.kv_bytes_used / 2**20:.2f} of {kv.kv_bytes / 2**20:.2f} MiB in use, "
            f"{len(sess.seq.tokens)} tokens cached")


def cmd_chat(args) -> int:
    from .hub import DEFAULT_MODEL
    from .llm import load
    from .session import ChatSession
    from .warmup import prepare

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    llm = load(args.model or DEFAULT_MODEL, n_ctx=args.ctx, kv=args.kv, threads=args.threads, device=args.device,
               progress=True, gpu_layers=args.gpu_layers)
    prepare(llm)  # compile what the chat needs now, behind a bar, not in its first turns
    sampling = dict(temperature=args.temp, seed=args.seed)
    sess = llm.session(system=args.system, max_tokens=args.max_tokens, **sampling)
    print(f"edgekv chat: {llm.path.name} ({llm.cfg.arch}, kv {llm.kv_type}, ctx {llm.n_ctx}). /help for commands.", flush=True)
    while True:
        try:
            text = _read_message("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit to quit)")
            continue
        try:
            sess = _chat_step(text, sess, llm, ChatSession)
        except KeyboardInterrupt:  # mid-reply, mid-prefill or mid-command: the session stays usable
            print("\n(stopped)", flush=True)
            continue
        if sess is None:
            return 0


def _chat_step(text: str, sess, llm, ChatSession):
    """One line of the chat: a slash command or a message. The session to continue with, or
    None to exit."""
    cmd, _, arg = text.strip().partition(" ")
    if cmd.startswith("/"):
        arg = arg.strip()
        if cmd in ("/exit", "/quit"):
            return None
        elif cmd == "/help":
            print(HELP)
        elif cmd == "/reset":
            sess.reset()
            print("(conversation reset)")
        elif cmd == "/system":
            sess.reset(system=arg or None)
            print("(system prompt set; conversation reset)")
        elif cmd == "/stats":
            st = sess.stats
            print(f"prefill {st.prefill_tokens} of {st.prompt_tokens} prompt tokens ({st.prefill_tps:.1f} tok/s), "
                  f"decode {st.generated_tokens} tokens ({st.decode_tps:.1f} tok/s); " + _kv_line(sess))
        elif cmd == "/kv":
            print(_kv_line(sess))
        elif cmd in ("/save", "/load") and not arg:
            print(f"usage: {cmd} FILE")
        elif cmd == "/save":
            try:
                sess.save(arg)
                print(f"(saved to {arg})")
            except EdgekvError as e:
                print(f"error: {e}")
        elif cmd == "/load":
            try:  # the current session stays unless the file loads completely
                sess = ChatSession.load(arg, llm)
                print(f"(loaded {arg}: {len(sess.history)} messages, {sess.n_cached} tokens cached)")
            except EdgekvError as e:
                print(f"error: {e}")
        else:
            print(f"unknown command {cmd}; /help lists them")
        return sess
    if not text.strip():
        return sess
    try:
        for e in sess.send(text, stream=True):
            print(printable(e.text), end="", flush=True)
        print(flush=True)
    except EdgekvError as e:
        print(f"\nerror: {e}", flush=True)
    return sess


def cmd_warmup(args) -> int:
    from .llm import load
    from .warmup import prepare

    llm = load(args.model, kv=args.kv, progress=not args.quiet) if args.model else None
    n = prepare(llm, progress=not args.quiet)
    print(f"kernels ready{f' ({n} compiled in this process)' if n else ''}")
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_bench(args) -> int:
    from .bench import format_table, plot, plot_backend, run_bench
    from .hub import resolve

    if args.plot:
        plot_backend()
    path = resolve(args.model, progress=not args.quiet)
    result = run_bench(path, prompt=_ints(args.p), gen=_ints(args.n), depths=_ints(args.d), kvs=args.kv.split(","),
                       threads=_ints(args.t) if args.t else [None], reps=args.r,
                       compare=args.compare == "llama.cpp", progress=not args.quiet)
    print(format_table(result, args.o))
    if args.plot:
        plot(result, args.plot)
    return 0


def cmd_perplexity(args) -> int:
    import json
    from pathlib import Path

    from .llm import load
    from .perplexity import perplexity

    llm = load(args.model, n_ctx=args.ctx, threads=args.threads, progress=not args.quiet)
    try:
        text = Path(args.file).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise EdgekvError(f"cannot read {args.file}: {e.strerror}") from None
    ids = llm.tokenize(text, special=False)
    kinds = args.kv.split(",")
    if args.kl_base and args.kl_base not in kinds:
        kinds.insert(0, args.kl_base)
    res = perplexity(llm, ids, n_ctx=args.ctx, kinds=kinds, kl_base=args.kl_base, progress=not args.quiet)
    print(json.dumps(dict(model=str(llm.path), tokens=len(ids), n_ctx=args.ctx, results=res), indent=2))
    return 0


def cmd_synth(args) -> int:
    from .synth import write_synthetic

    print(write_synthetic(args.out, arch=args.arch, size=args.size, qtype=args.type, seed=args.seed,
                          progress=not args.quiet))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgekv", description="Quantized GGUF LLM inference with an INT8/INT4 ring-buffer KV cache.")
    p.add_argument("--version", action="version", version=f"edgekv {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="COMMAND")

    s = sub.add_parser("pull", help="download a known model into the cache")
    s.add_argument("models", nargs="+", metavar="MODEL")
    s.add_argument("--force", action="store_true", help="fetch again even if cached")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_pull)

    s = sub.add_parser("list", help="known and cached models")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("info", help="what is in a model file")
    s.add_argument("model", metavar="MODEL", help="known name or .gguf path")
    s.add_argument("--ctx", type=int, default=4096, help="context size for the KV-cache figures")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("run", help="one-shot completion, streamed to stdout")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("prompt", metavar="PROMPT", help="text, or - to read stdin")
    s.add_argument("-n", "--max-tokens", type=int, default=128)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument("--json", action="store_true", help="print one JSON object (text, token counts, timings)")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ctx", type=int, default=4096)
    s.add_argument("--kv", default="int8", help="KV cache type: f16, int8 or int4")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--device", default="cpu", help="cpu, cuda, or auto (cuda when a GPU is usable)")
    s.add_argument("--gpu-layers", type=int, default=None, metavar="N", help="with cuda: only the first N blocks on the GPU")
    s.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    s.add_argument("--top-k", type=int, default=40)
    s.add_argument("--top-p", type=float, default=0.95)
    s.add_argument("--min-p", type=float, default=0.05)
    s.add_argument("--repeat-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("chat", help="interactive chat in the terminal")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL", help="known name or .gguf path (default: smollm2-135m-instruct)")
    s.add_argument("--kv", default="int8", help="KV cache type: f16, int8 or int4")
    s.add_argument("--ctx", type=int, default=4096, help="KV cache capacity in tokens")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--device", default="cpu", help="cpu, cuda, or auto (cuda when a GPU is usable)")
    s.add_argument("--gpu-layers", type=int, default=None, metavar="N", help="with cuda: only the first N blocks on the GPU")
    s.add_argument("--temp", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--system", default=None, help="system prompt")
    s.add_argument("-n", "--max-tokens", type=int, default=512, help="longest reply")
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("warmup", help="compile the CPU kernels now (a first chat otherwise starts with it)")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL", help="also run this model once (default: none)")
    s.add_argument("--kv", default="int8", help="KV cache type of that run")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_warmup)

    s = sub.add_parser("bench", help="speed tests like llama-bench, optionally beside llama.cpp")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("-p", default="512", help="prompt lengths to prefill, comma-separated (0 = none)")
    s.add_argument("-n", default="128", help="tokens to generate, comma-separated (0 = none)")
    s.add_argument("-d", default="0", help="context depths already filled, comma-separated")
    s.add_argument("-r", type=int, default=3, help="repetitions")
    s.add_argument("-t", default="", help="thread counts, comma-separated (default: physical cores)")
    s.add_argument("--kv", default="f16", help="cache types, comma-separated")
    s.add_argument("-o", default="md", choices=["md", "json", "csv"])
    s.add_argument("--compare", choices=["llama.cpp"], default=None)
    s.add_argument("--plot", default=None, metavar="FILE.png")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("perplexity", help="perplexity of a text file, and KL of a cache type vs f16")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("file", metavar="FILE")
    s.add_argument("--ctx", type=int, default=512, help="window size")
    s.add_argument("--kv", default="f16", help="cache types, comma-separated")
    s.add_argument("--kl-base", default=None, help="cache type the others are compared against (e.g. f16)")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_perplexity)

    s = sub.add_parser("synth", help="write a synthetic GGUF with real shapes and random weights (for benchmarks)")
    s.add_argument("out", metavar="OUT.gguf")
    s.add_argument("--arch", default="llama", choices=["llama", "gemma3"])
    s.add_argument("--size", default="7b", help="llama: tiny, 1b, 7b, 13b; gemma3: tiny, 270m, 1b")
    s.add_argument("--type", default="q4_0", help="q4_0, q5_0, q8_0, q4_k, q6_k, f16, f32")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=cmd_synth)
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


def main(argv: list[str] | None = None) -> int:
    if not getattr(sys.unraisablehook, "edgekv", False):
        sys.unraisablehook = _quiet_llvmlite_cleanup(sys.unraisablehook)
    args = build_parser().parse_args(argv)
    if not getattr(args, "func", None):
        build_parser().print_help()
        return 2
    try:
        return args.func(args)
    except EdgekvError as e:
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
