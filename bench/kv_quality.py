"""KV-cache quality: KL divergence and top-1 agreement of int8/int4 caches against the f16
cache, for edgekv and (when llama-cpp-python is importable) llama.cpp's q8_0/q4_0 caches on
the same tokens in the same run; plus the streaming test (a text 4x the ring, sinks on/off).
edgekv's caches are compared with float prefill products (the cache's own effect; int8
activations add KL ~0.003 between any two slightly different runs); --int8-prefill measures
them as they run by default on VNNI machines.

    python bench/kv_quality.py [--tokens 4096] [--ctx 512] [--models smollm2,gemma3] [--stream 512]
    /work/llvenv/bin/python bench/kv_quality.py --llamacpp-only   # then --llamacpp-json bench/kv_quality_llamacpp.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np

from edgekv.hub import resolve
from edgekv.kernels_cpu.qmatmul import float_prefill
from edgekv.llm import LLM
from edgekv.perplexity import perplexity, streaming_nll

TEXT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "text_en.txt"
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


def llamacpp_kl(path, ids, n_ctx, kinds=("q8_0", "q4_0")) -> dict:
    """llama.cpp's own quantized caches against its own f16 cache, same windows and scoring."""
    try:
        import llama_cpp
    except ImportError:
        return {}
    ggml = {"f16": 1, "q8_0": 8, "q4_0": 2}

    def logprobs(kind):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                              type_k=ggml[kind], type_v=ggml[kind], flash_attn=True, n_threads=2, verbose=False)
        out = []
        for w in range(len(ids) // n_ctx):
            llm.reset()
            llm.eval(ids[w * n_ctx : (w + 1) * n_ctx])
            x = np.asarray(llm.scores[:n_ctx], dtype=np.float64)[n_ctx // 2 : -1]
            out.append(x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))
        return np.concatenate(out)

    base = logprobs("f16")
    p = np.exp(base)
    res = {}
    for k in kinds:
        lp = logprobs(k)
        kl = np.sum(p * (base - lp), axis=-1)
        res[k] = dict(mean_kl=float(kl.mean()), p99_kl=float(np.percentile(kl, 99)),
                      top1_agreement=float((base.argmax(-1) == lp.argmax(-1)).mean()))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--stream", type=int, default=512, help="ring size for the streaming test (0 = skip)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--int8-prefill", action="store_true", help="edgekv's default prefill (int8 activations)")
    ap.add_argument("--llamacpp-only", action="store_true", help="only llama.cpp's caches (print JSON)")
    ap.add_argument("--llamacpp-json", help="llama.cpp results from a --llamacpp-only run, instead of measuring")
    args = ap.parse_args()
    if args.llamacpp_only:  # llama.cpp in its own run (e.g. another venv): same ids, same windows
        res = {}
        for key in args.models.split(","):
            path = resolve(MODELS[key])
            ids = LLM(path, n_ctx=args.ctx).tokenize(TEXT.read_text(), special=False)[: args.tokens]
            res[key] = llamacpp_kl(path, ids, args.ctx)
            print(json.dumps({key: res[key]}), flush=True)
        Path(__file__).with_name("kv_quality_llamacpp.json").write_text(json.dumps(res, indent=2))
        return
    given = json.loads(Path(args.llamacpp_json).read_text()) if args.llamacpp_json else {}
    text = TEXT.read_text()
    report = {}
    for key in args.models.split(","):
        path = resolve(MODELS[key])
        llm = LLM(path, n_ctx=args.ctx, threads=args.threads)
        ids = llm.tokenize(text, special=False)[: args.tokens]
        t = time.time()
        r = dict(tokens=len(ids), n_ctx=args.ctx)
        with contextlib.nullcontext() if args.int8_prefill else float_prefill():
            r["edgekv"] = perplexity(llm, ids, n_ctx=args.ctx, kinds=("f16", "int8", "int4"), kl_base="f16")
        r["llama.cpp"] = given[key] if key in given else llamacpp_kl(path, ids, args.ctx)
        if args.stream:
            # Perplexity inside one ring vs far past it (4x), sinks on and off.
            s = LLM(path, n_ctx=args.stream, threads=args.threads)
            long = ids[: 4 * args.stream]
            inside = float(np.exp(streaming_nll(s, long[: args.stream], "f16", 4, progress=False).mean()))
            st = dict(ring=args.stream, tokens=len(long), ppl_inside_ring=inside)
            for kind in ("f16", "int4"):
                for sinks in (4, 0):
                    nll = streaming_nll(s, long, kind, sinks)
                    st[f"{kind}_sinks{sinks}_ppl_last_ring"] = float(np.exp(nll[-args.stream :].mean()))
            r["streaming"] = st
        r["bytes"] = cache_bytes(llm)
        r["seconds"] = round(time.time() - t, 1)
        report[key] = r
        print(json.dumps({key: r}, indent=2), flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(markdown(report))


def cache_bytes(llm) -> dict:
    """Per kind: ring bytes per token (all layers, K+V, scales included), its ratio to f16, and
    the fixed bytes of the exact recent slots (per cache, whatever its size)."""
    out = {}
    for kind in ("f16", "int8", "int4"):
        c = llm.new_cache(kind)
        per_tok = sum(lk.ring_nbytes / lk.capacity for lk in c.layers)
        out[kind] = dict(per_token=per_tok, fixed=c.recent_nbytes)
    for kind in out:
        out[kind]["ratio"] = out[kind]["per_token"] / out["f16"]["per_token"]
    return out


def markdown(report: dict) -> str:
    rows = ["| model | cache | bits/value | mean KL | p99 KL | top-1 | ppl |", "| --- | --- | --- | --- | --- | --- | --- |"]
    bits = {"f16": 16, "int8": 8.5, "int4": 4.5, "q8_0": 8.5, "q4_0": 4.5}
    for key, r in report.items():
        for kind, m in r["edgekv"].items():
            kl = f"{m['mean_kl']:.5f} | {m['p99_kl']:.4f} | {100 * m['top1_agreement']:.1f}%" if "mean_kl" in m else "- | - | -"
            rows.append(f"| {key} | edgekv {kind} | {bits[kind]} | {kl} | {m['ppl']:.3f} |")
        for kind, m in r["llama.cpp"].items():
            rows.append(f"| {key} | llama.cpp {kind} | {bits[kind]} | {m['mean_kl']:.5f} | {m['p99_kl']:.4f} | "
                        f"{100 * m['top1_agreement']:.1f}% | - |")
    rows += ["", "| model | cache | bytes/token (all layers, K+V, scales) | x f16 | fixed (exact first + recent tokens) |",
             "| --- | --- | --- | --- | --- |"]
    for key, r in report.items():
        for kind, b in r["bytes"].items():
            rows.append(f"| {key} | {kind} | {b['per_token']:.0f} | {b['ratio']:.3f} | {b['fixed'] / 1024:.0f} KiB |")
    if any("streaming" in r for r in report.values()):
        rows += ["", "| model | ring | tokens | ppl inside ring (f16) | f16 sinks 4 | f16 no sinks | int4 sinks 4 | int4 no sinks |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for key, r in report.items():
            st = r.get("streaming")
            if st:
                rows.append(f"| {key} | {st['ring']} | {st['tokens']} | {st['ppl_inside_ring']:.2f} | "
                            + " | ".join(f"{st[f'{k}_sinks{n}_ppl_last_ring']:.2f}" for k in ("f16", "int4") for n in (4, 0)) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
