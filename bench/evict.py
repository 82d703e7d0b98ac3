"""Eviction policies measured (issue 19): what a full ring keeps, against the uncapped cache.

    python bench/evict.py kl [--tokens 4096] [--rings 1024,512] [--models smollm2,gemma3]
    python bench/evict.py retrieval [--tokens 2048] [--depths 0.1,0.3,0.5,0.7,0.9] [--trials 5]
    python bench/evict.py speed [--ring 512] [--depth 1024] [-n 1024] [--chunk 16] [--evict window,ema] [--background-load N]

kl: one text (tests/fixtures/text_en.txt) streamed token by token through rings of 25% and
12.5% of it per policy, in lockstep with an uncapped f16 cache (edgekv.perplexity.ring_perplexity:
mean / p99 KL, top-1 agreement, perplexity from the ring's size on). retrieval: a 5-digit key
said once at a depth of a ~2K-token filler prompt, the question last, the prompt prefilled in
chunks that evict as they go through a ring of 25% of it; the uncapped cache first. speed:
decode tokens/s through a full ring, each policy against the first one (window) at the same
ring size, in turns of --chunk tokens.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from edgekv.hub import resolve
from edgekv.llm import LLM
from edgekv.perplexity import ring_perplexity

TEXT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "text_en.txt"
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
OUT = Path(__file__).resolve().parent


def kl(args) -> None:
    rings = [int(r) for r in args.rings.split(",")]
    res = {}
    for key in args.models.split(","):
        llm = LLM(resolve(MODELS[key]), n_ctx=args.tokens, kv="f16", prompt_cache=False)
        ids = llm.tokenize(TEXT.read_text(), special=False)[: args.tokens]
        t = time.time()
        res[key] = ring_perplexity(llm, ids, rings=rings, kinds=args.kv.split(","), evicts=args.evict.split(","))
        res[key]["seconds"] = round(time.time() - t)
        print(json.dumps({key: res[key]}), flush=True)
        (OUT / f"evict_kl_{key}.json").write_text(json.dumps(res[key], indent=2))
    for key, by_ring in res.items():
        for r in rings:
            rr = by_ring[str(r)]
            for name, v in rr.items():
                if "mean_kl" in v:
                    print(f"| {key} | {r} | {name} | {v['mean_kl']:.4f} | {v['p99_kl']:.3f} | "
                          f"{100 * v['top1_agreement']:.1f}% | {v['ppl']:.2f} | {rr['uncapped f16']['ppl']:.2f} |")


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_ids(llm, n_tokens: int, depth: float, key: str) -> list[int]:
    """~n_tokens of filler with the pass key said once at `depth` (0 = start, 1 = just before the
    question), then the question; made of separately tokenized pieces so the depth is exact."""
    tok = lambda t: llm.tokenize(t, add_bos=False)  # noqa: E731
    head = llm.tokenize("There is a pass key hidden in this text. Find it and remember it. ")
    fact = tok(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    ask = tok("\nWhat is the pass key? The pass key is")
    fill = tok(FILLER * (n_tokens // 10))
    room = n_tokens - len(head) - len(fact) - len(ask)
    cut = int(round(depth * room))
    return head + fill[:cut] + fact + fill[cut:room] + ask


def answer(llm, ids: list[int], cache, n: int = 8) -> str:
    logits = llm.forward(ids, cache, 0)[-1]
    out = []
    for i in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = llm.forward([t], cache, len(ids) + i)[-1]
    return llm.detokenize(out)


def retrieval(args) -> None:
    depths = [float(d) for d in args.depths.split(",")]
    res = {}
    for key in args.models.split(","):
        path = resolve(MODELS[key])
        ring = args.ring or args.tokens // 4
        configs = [("uncapped", args.tokens + 16, "window")] + [(f"ring {ring}", ring, e) for e in args.evict.split(",")]
        rng = np.random.default_rng(0)
        keys = [[f"{rng.integers(10000, 100000)}" for _ in range(args.trials)] for _ in depths]
        res[key] = {}
        for name, n_ctx, evict in configs:
            llm = LLM(path, n_ctx=n_ctx, kv=args.kv, evict=evict, prompt_cache=False)
            row = {}
            for d, ks in zip(depths, keys):
                hits = 0
                for k in ks:
                    ids = passkey_ids(llm, args.tokens, d, k)
                    text = answer(llm, ids, llm.new_cache())
                    hits += k in text
                row[str(d)] = hits / len(ks)
            res[key][f"{name} {evict}"] = row
            print(json.dumps({key: {f"{name} {evict}": row}}), flush=True)
        (OUT / f"evict_retrieval_{key}.json").write_text(json.dumps(res[key], indent=2))
    for key, rows in res.items():
        for name, row in rows.items():
            print(f"| {key} | {name} | " + " | ".join(f"{100 * row[str(d)]:.0f}%" for d in depths) + " |")


def speed(args) -> None:
    """Decode tokens/s through a full ring: one model, one cache per policy (depth tokens of
    random ids prefilled, so every decoded token evicts), the policies taking turns every
    --chunk tokens for -n tokens each. Turns this short put the machine's drift (other VMs,
    clocks: 10-20% between runs here) on every policy alike; the ratio is of the summed times,
    with the spread of the per-turn ratios beside it."""
    from edgekv.bench import BackgroundLoad
    from edgekv.kvcache import KVCache

    policies = args.evict.split(",")
    for key in args.models.split(","):
        llm = LLM(resolve(MODELS[key]), n_ctx=args.ring, kv=args.kv, prompt_cache=False)
        rng = np.random.default_rng(0)
        caches = {e: KVCache.for_model(llm.cfg, args.ring, args.kv, llm.n_sink, evict=e) for e in policies}
        for cache in caches.values():
            llm.forward(rng.integers(0, llm.cfg.n_vocab, args.depth).tolist(), cache, 0)
        ids = rng.integers(0, llm.cfg.n_vocab, args.n + args.chunk).tolist()
        for e, cache in caches.items():  # warm-up: the decode kernels compiled, the pages touched
            for i in range(args.chunk):
                llm.forward(ids[i : i + 1], cache, args.depth + i)
        spent = {e: [] for e in policies}
        at = args.chunk
        bg = BackgroundLoad(args.background_load)
        try:
            with bg.rep(args.background_load > 0):  # every turn beside the busy processes, or none
                while at < args.chunk + args.n:
                    m = min(args.chunk, args.chunk + args.n - at)
                    for e, cache in caches.items():
                        t = time.perf_counter()
                        for i in range(at, at + m):
                            llm.forward(ids[i : i + 1], cache, args.depth + i)
                        spent[e].append(time.perf_counter() - t)
                    at += m
        finally:
            bg.close()
        base = np.asarray(spent[policies[0]])
        for e in policies:
            tps = args.n / sum(spent[e])
            turn = base / np.asarray(spent[e])
            print(f"| {key} | {args.kv} | {args.ring} | {args.background_load} | {e} | {tps:.1f} | {sum(base) / sum(spent[e]):.3f}x | "
                  f"{np.percentile(turn, 25):.3f}-{np.percentile(turn, 75):.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)

    def verb(name, func, kv):
        s = sub.add_parser(name)
        s.add_argument("--models", default="smollm2,gemma3")
        s.add_argument("--kv", default=kv)
        s.add_argument("--evict", default="window,tova,h2o")
        s.set_defaults(func=func)
        return s

    s = verb("kl", kl, "f16")
    s.add_argument("--tokens", type=int, default=4096)
    s.add_argument("--rings", default="1024,512")
    s = verb("retrieval", retrieval, "f16")
    s.add_argument("--tokens", type=int, default=2048)
    s.add_argument("--ring", type=int, default=0, help="default: 25%% of --tokens")
    s.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    s.add_argument("--trials", type=int, default=4)
    s = verb("speed", speed, "int8")
    s.add_argument("--ring", type=int, default=512)
    s.add_argument("--depth", type=int, default=1024)
    s.add_argument("-n", type=int, default=1024)
    s.add_argument("--chunk", type=int, default=16)
    s.add_argument("--background-load", type=int, default=0, help="busy processes beside every turn")
    args = ap.parse_args()
    if args.what == "speed" and (args.n < 1 or args.chunk < 1 or args.background_load < 0):
        ap.error("speed needs -n >= 1, --chunk >= 1 and --background-load >= 0")
    args.func(args)


if __name__ == "__main__":
    main()
