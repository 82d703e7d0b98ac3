"""`edgekv perplexity`: perplexity over a text in windows of n_ctx, and how far a quantized KV
cache moves the next-token distribution away from the f16 cache (as llama-perplexity's
--kl-divergence does), plus the streaming test: one long pass through a ring smaller than the text.
"""
from __future__ import annotations

import sys

import numpy as np


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _window_logprobs(llm, ids, kind: str) -> np.ndarray:
    """log-probs (len(ids), n_vocab) of one window run from an empty cache of `kind`."""
    cache = llm.new_cache(kind)
    return _log_softmax(llm.forward(ids, cache, 0, last_only=False))


def perplexity(llm, ids: list[int], *, n_ctx: int, kinds=("f16",), kl_base: str | None = None,
               progress: bool = True) -> dict:
    """Windows of n_ctx tokens; the second half of each window is scored (the first half is
    context), like llama-perplexity. Returns {kind: {ppl, n_scored, [mean_kl, p99_kl, top1]}}."""
    from tqdm import tqdm

    n_win = len(ids) // n_ctx
    if n_win < 1:
        from .errors import ContextError

        raise ContextError(f"text has {len(ids)} tokens, fewer than one window of {n_ctx}")
    first = n_ctx // 2
    nll = {k: [] for k in kinds}
    kls = {k: [] for k in kinds if k != kl_base}
    top = {k: [] for k in kinds if k != kl_base}
    for w in tqdm(range(n_win), desc="perplexity", file=sys.stderr, disable=not progress):
        win = ids[w * n_ctx : (w + 1) * n_ctx]
        target = np.asarray(win[first + 1 :])
        base = _window_logprobs(llm, win, kl_base)[first:-1] if kl_base else None
        for k in kinds:
            lp = base if k == kl_base else _window_logprobs(llm, win, k)[first:-1]
            nll[k].extend((-lp[np.arange(len(target)), target]).tolist())
            if kl_base and k != kl_base:
                p = np.exp(base)
                kls[k].extend(np.sum(p * (base - lp), axis=-1).tolist())
                top[k].extend((base.argmax(-1) == lp.argmax(-1)).tolist())
    out = {}
    for k in kinds:
        r = dict(ppl=float(np.exp(np.mean(nll[k]))), n_scored=len(nll[k]))
        if k in kls:
            r.update(mean_kl=float(np.mean(kls[k])), p99_kl=float(np.percentile(kls[k], 99)),
                     top1_agreement=float(np.mean(top[k])))
        out[k] = r
    return out


def streaming_nll(llm, ids: list[int], kind: str, n_sink: int, progress: bool = True) -> np.ndarray:
    """Negative log-likelihood of every next token, feeding ids one by one through the ring
    (capacity llm.n_ctx, n_sink attention sinks), far past its capacity."""
    from tqdm import tqdm

    cache = llm.new_cache(kind, n_sink=n_sink)
    out = np.empty(len(ids) - 1)
    for i in tqdm(range(len(ids) - 1), desc=f"stream {kind} sinks={n_sink}", file=sys.stderr, disable=not progress):
        lp = _log_softmax(llm.forward(ids[i : i + 1], cache, i)[-1])
        out[i] = -lp[ids[i + 1]]
    return out


def ring_perplexity(llm, ids: list[int], *, rings=(512,), kinds=("f16",), evicts=("window",),
                    progress: bool = True) -> dict:
    """The text streamed one token at a time through a ring of each size in `rings` per (cache
    type, eviction policy), in lockstep with an uncapped f16 cache over the same tokens (fed the
    same way), so no run's log-probs are kept. A ring of N is scored on every next token from
    position N on, where it is full and its policy decides what attention sees; the uncapped
    cache on the same tokens. Returns {"RING": {"uncapped f16": {ppl, n_scored}, "KIND/POLICY":
    {ppl, n_scored, mean_kl, p99_kl, top1_agreement, kv_evicted, kv_kept_mass}}}."""
    from tqdm import tqdm

    from .errors import ContextError
    from .kvcache import KVCache

    if len(ids) <= max(rings) + 1:
        raise ContextError(f"text has {len(ids)} tokens: a ring of {max(rings)} needs more to evict anything")
    base_cache = KVCache.for_model(llm.cfg, len(ids), "f16", llm.n_sink)
    runs = {(r, f"{k}/{e}"): KVCache.for_model(llm.cfg, r, k, llm.n_sink, evict=e)
            for r in rings for k in kinds for e in evicts}
    base_nll = np.empty(len(ids) - 1)
    nll = {key: [] for key in runs}
    kls = {key: [] for key in runs}
    top = {key: [] for key in runs}
    for i in tqdm(range(len(ids) - 1), desc=f"rings {','.join(map(str, rings))}", file=sys.stderr,
                  disable=not progress):
        base = _log_softmax(llm.forward(ids[i : i + 1], base_cache, i)[-1])
        base_nll[i] = -base[ids[i + 1]]
        p = np.exp(base)
        for (r, name), cache in runs.items():
            lp = _log_softmax(llm.forward(ids[i : i + 1], cache, i)[-1])
            if i >= r:
                nll[(r, name)].append(-lp[ids[i + 1]])
                kls[(r, name)].append(float(np.sum(p * (base - lp))))
                top[(r, name)].append(bool(base.argmax() == lp.argmax()))
    out: dict = {}
    for r in rings:
        res = out[str(r)] = {"uncapped f16": dict(ppl=float(np.exp(base_nll[r:].mean())), n_scored=len(ids) - 1 - r)}
        for (rr, name), cache in runs.items():
            if rr == r:
                ev = cache.evict_stats()
                res[name] = dict(ppl=float(np.exp(np.mean(nll[(r, name)]))), n_scored=len(nll[(r, name)]),
                                 mean_kl=float(np.mean(kls[(r, name)])), p99_kl=float(np.percentile(kls[(r, name)], 99)),
                                 top1_agreement=float(np.mean(top[(r, name)])), kv_evicted=ev["kv_evicted"],
                                 kv_kept_mass=ev["kv_kept_mass"])
    return out
