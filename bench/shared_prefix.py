"""KV memory of N chats that share one long system prompt (issue 17's target: 8 chats sharing a
1,000-token system prompt hold <= 1.5x one chat's KV bytes, plus their own tails).

    python bench/shared_prefix.py [MODEL] [--kv int8] [--tokens 1000] [--chats 8] [--reply 32]

Each setup runs in a process of its own: the model loaded, one short chat as a warm-up, then
`--chats` sessions with the same system prompt each send one question (greedy, `--reply`
tokens), one after another. Memory is the KV rings' share of the process's proportional set
size (`kv_memory`; Linux, /proc/self/smaps, a page mapped twice counted once) after the chats
less before them: the sessions' caches and the prompt cache's entries (the system prompt's, and each call's
snapshots) with everything else the calls allocate; then again once the prompt cache's entries
are dropped (the chats alone). Setups: `shared` (edgekv as it ships: forks
and restored entries map the same pages, edgekv/pages.py) and `copies` (pages.SUPPORTED off:
every restore and snapshot a copy, as before). One chat's KV bytes: what its cache holds
(KVCache.used_nbytes: system prompt + question + reply); a tail: what its tokens after the
system prompt take (`own_bytes`: their ring rows and the chat's exact recent rows).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

QUESTIONS = ("What is this text about?", "Name one person in it.", "Give it a title.", "Is it fiction?",
             "Who wrote it?", "Summarize it.", "What happens first?", "What happens last?", "Is it old?",
             "Where is it set?", "Is it long?", "Is it sad?")


def kv_memory() -> int:
    """Bytes of the process's KV rings (Pss: a page mapped twice counts once): the mappings of
    edgekv/kvcache.py's lazy_zeros (shared anonymous memory, "/dev/zero" in smaps) and of the
    frozen pages (edgekv/pages.py's "memfd:edgekv-kv"). Not the model's file map (its Pss moves
    with other processes that map it) nor the heap (activations, logits)."""
    total, counted = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else ""
                counted = name.startswith("/dev/zero") or name.startswith("/memfd:edgekv-kv")
            elif counted and line.startswith("Pss:"):
                total += int(head[1]) * 1024
    return total


def own_bytes(seq, n_shared: int) -> int:
    """What a copy of seq's tokens after the first n_shared takes in its cache: their ring rows,
    and the exact rows (the recent tokens' f16 copies, which are its own tokens)."""
    rows = sum(sum(getattr(lk, name)[0].nbytes for name in lk.slot_arrays) for lk in seq.cache.layers)
    return (len(seq.tokens) - n_shared) * rows + seq.cache.recent_nbytes


def child(args) -> None:
    import os
    import tempfile

    import edgekv
    from edgekv import pages
    from prompt_cache import system_prompt

    if args.setup == "copies":
        pages.SUPPORTED = False
    llm = edgekv.load(args.model, kv=args.kv, n_ctx=args.ctx, threads=args.threads)
    os.environ["EDGEKV_HOME"] = tempfile.mkdtemp(prefix="edgekv-shared-")  # empty prompt-cache folder: a cold start
    system = system_prompt(llm, args.tokens)
    llm.session(system="Be brief.", max_tokens=4, temperature=0.0).send("Hi")  # warm-up: kernels, buffers
    before = kv_memory()
    sessions = []
    for i in range(args.chats):
        s = llm.session(system=system, max_tokens=args.reply, temperature=0.0)
        s.send(QUESTIONS[i % len(QUESTIONS)])
        sessions.append(s)
    grown = kv_memory() - before
    entries = len(llm.prompt_cache._mem)
    n_sys = max(len(e.tokens) for e in llm.prompt_cache._mem.values() if e.logits is None)  # the system entry
    llm.prompt_cache.clear()  # the chats alone: their caches (and what of the entries' pages they map)
    import gc

    gc.collect()
    alone = kv_memory() - before
    caches = [s.seq.cache for s in sessions]
    print(json.dumps(dict(setup=args.setup, grown=grown, alone=alone, entries=entries, one_chat=caches[0].used_nbytes, system_tokens=n_sys,
                          chat_tokens=[len(s.seq.tokens) for s in sessions],
                          tails=sum(own_bytes(s.seq, n_sys) for s in sessions),
                          replies=[s.messages()[-1]["content"] for s in sessions])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--kv", default="int8")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1000, help="system prompt length")
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--setup", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.setup:
        return child(args)
    rows = {}
    for setup in ("shared", "copies"):
        cmd = [sys.executable, __file__, args.model, "--kv", args.kv, "--ctx", str(args.ctx), "--tokens",
               str(args.tokens), "--chats", str(args.chats), "--reply", str(args.reply), "--setup", setup]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows[setup] = json.loads(out.strip().splitlines()[-1])
    mib = 2**20
    print(f"{args.model}, kv {args.kv}, {args.chats} chats, system prompt {rows['shared']['system_tokens']} tokens, "
          f"{platform.node()}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| setup | one chat's KV | their tails | memory grown: chats + prompt-cache entries | (grown - tails) / one chat "
          "| the chats alone (entries dropped) | (alone - tails) / one chat |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for setup, r in rows.items():
        print(f"| {setup} | {r['one_chat'] / mib:.1f} MiB | {r['tails'] / mib:.1f} MiB | {r['grown'] / mib:.1f} MiB "
              f"({r['entries']} entries) | {(r['grown'] - r['tails']) / r['one_chat']:.2f}x | {r['alone'] / mib:.1f} MiB | "
              f"**{(r['alone'] - r['tails']) / r['one_chat']:.2f}x** |")
    same = rows["shared"]["replies"] == rows["copies"]["replies"]
    print(f"replies identical in both setups: {same}")


if __name__ == "__main__":
    main()
