"""Time to first token of a chat whose ~1,000-token system prompt is in the prompt cache, against
the same chat cold (issue 17's target: >= 20x faster, in the same process and in a new one).

    python bench/prompt_cache.py [MODEL] [--kv int8] [--tokens 1000] [-r 3] [--threads N] [--json]

Each rep, on an empty cache folder, in this process after a warm-up (kernels loaded, two short
chats): a cold chat (nothing cached: the system prompt is prefilled and kept in memory and on
disk), a chat with another question (from memory), the same with memory emptied (from disk).
Then two new processes that load the model and its kernels (`prepare`, as `edgekv chat` does
before the prompt: with a warm disk cache it loads every kernel; not timed) and time their
first chat: one on an empty folder (cold), one on the folder the first wrote (from disk); a new
process's ratio is against the cold new process. Time to first token is wall
time from the `llm.chat(stream=True)` call to the first token's chunk (template, tokenizer,
cache lookup and load, prefill, the first token sampled: generate yields it before feeding it); medians over the reps. Also
the bytes of the cached prefix (in memory, and its file) and the KV bytes the chat holds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("What is this text about?", "Name one person in it.", "Give it a title.", "Is it fiction?")


def system_prompt(llm, tokens: int) -> str:
    """About `tokens` tokens of English text (tests/fixtures/text_en.txt), cut at a word."""
    text = (ROOT / "tests" / "fixtures" / "text_en.txt").read_text(encoding="utf-8")
    words = text.split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words under `tokens` tokens
        mid = (lo + hi + 1) // 2
        if len(llm.tokenize(" ".join(words[:mid]), add_bos=False)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return "Answer questions about this text.\n\n" + " ".join(words[:lo])


def ttft(llm, system: str, question: str) -> tuple[float, dict]:
    """(seconds to the first token's chunk, the call's stats) of one chat turn."""
    t0 = time.perf_counter()
    chunks = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": question}],
                      stream=True, max_tokens=8, temperature=0)
    first = None
    for i, c in enumerate(chunks):
        if i == 1:  # the first token's chunk (the one before only says role=assistant)
            first = time.perf_counter() - t0
    st = llm.stats
    return first if first is not None else time.perf_counter() - t0, dict(
        cached_tokens=st.cached_tokens, cached_from=st.cached_from, prompt_tokens=st.prompt_tokens,
        prefill_s=st.prefill_s, kv_bytes_used=st.kv_bytes_used)


def load(args, directory: Path):
    from edgekv import load as edgekv_load

    llm = edgekv_load(args.model, kv=args.kv, n_ctx=args.ctx, threads=args.threads, progress=False)
    llm.prompt_cache._directory = directory
    return llm


def child(args) -> None:
    """A new process: load and prepare the kernels (not timed: `edgekv chat` and `run` do both
    before the prompt), then its first chat, cold or from the files in --child."""
    from edgekv.warmup import prepare

    llm = load(args, Path(args.child))
    prepare(llm, progress=False)
    system = system_prompt(llm, args.tokens)
    t, st = ttft(llm, system, QUESTIONS[3])
    print(json.dumps(dict(ttft=t, **st)))


def warm_up(llm) -> None:
    from edgekv.warmup import prepare

    prepare(llm, progress=False)
    for q in QUESTIONS[:2]:  # compile what a cold chat and a continued one need (too short for the disk)
        ttft(llm, "You are terse. " * 16, q)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--kv", default="int8")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1000, help="system prompt length")
    p.add_argument("-r", type=int, default=3, help="reps")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    root = Path(tempfile.mkdtemp(prefix="edgekv-pcache-"))
    try:
        d = root / "prompt-cache"
        llm = load(args, d)
        system = system_prompt(llm, args.tokens)
        warm_up(llm)
        rows = {k: [] for k in ("cold", "memory", "disk, same process", "cold, new process", "disk, new process")}
        info = {}
        for _ in range(args.r):
            shutil.rmtree(d, ignore_errors=True)
            llm.prompt_cache.clear()
            for name, q in (("cold", QUESTIONS[0]), ("memory", QUESTIONS[1])):
                t, st = ttft(llm, system, q)
                rows[name].append(t)
                info[name] = st
            llm.prompt_cache.clear()
            t, st = ttft(llm, system, QUESTIONS[2])
            rows["disk, same process"].append(t)
            info["disk, same process"] = st
            rep = len(rows["cold"])
            for name, folder in (("cold, new process", root / f"empty-{rep}"), ("disk, new process", d)):
                cmd = [sys.executable, __file__, args.model, "--kv", args.kv, "--ctx", str(args.ctx), "--tokens",
                       str(args.tokens), "--child", str(folder)] + (["--threads", str(args.threads)]
                                                                    if args.threads else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                st = json.loads(out)
                rows[name].append(st.pop("ttft"))
                info[name] = st
        files = list(d.glob("*.ekvp"))
        entry = dict(memory_bytes=llm.prompt_cache.memory_used, file_bytes=sum(f.stat().st_size for f in files))
        med = {k: statistics.median(v) for k, v in rows.items()}
        base = {k: med[k.replace("disk", "cold") if "new process" in k else "cold"] for k in rows}  # same kind of process
        result = dict(model=str(llm.path.name), kv=args.kv, reps=args.r, system_tokens=info["memory"]["cached_tokens"],
                      prompt_tokens=info["cold"]["prompt_tokens"], entry=entry,
                      rows={k: dict(ttft_ms=round(med[k] * 1e3, 1), speedup=round(base[k] / med[k], 1),
                                    **{f: info[k][f] for f in ("cached_tokens", "cached_from", "kv_bytes_used")})
                            for k in rows})
        if args.json:
            print(json.dumps(result, indent=2))
            return
        print(f"{result['model']}, kv {args.kv}: system prompt {result['system_tokens']} tokens of "
              f"{result['prompt_tokens']}; cached prefix {entry['memory_bytes'] / 2**20:.1f} MiB in memory, "
              f"{entry['file_bytes'] / 2**20:.1f} MiB on disk; median of {args.r}")
        print("| chat | cached tokens (from) | time to first token | vs cold | KV bytes in use |")
        print("| --- | --- | --- | --- | --- |")
        for k, r in result["rows"].items():
            print(f"| {k} | {r['cached_tokens']} ({r['cached_from'] or '-'}) | {r['ttft_ms']:.0f} ms | "
                  f"{r['speedup']:.1f}x | {r['kv_bytes_used'] / 2**20:.1f} MiB |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
