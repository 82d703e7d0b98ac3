"""Kernels of the eviction policies (edgekv/evict.py): the importance update from the scores the
attention kernel wrote (kvquant.kv_attention's `scores`), and the choice of the slots to overwrite.

A layer's importance is one float32 per ring slot, the mean over query heads (and observed
queries) of the attention probability its token got:
  h2o  (mode 1) accumulates it over every query since the token was stored (H2O's heavy hitters)
  tova (mode 2) keeps only the last query's (TOVA)
  ema  (mode 3) accumulates it with each earlier query's share decayed by EMA_DECAY a step
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .ops import _expf

MODE_H2O, MODE_TOVA, MODE_EMA = 1, 2, 3
EMA_DECAY = np.float32(0.8)  # edgekv.evict.EMA_DECAY (a compile-time constant here)
_NEG = np.float32(-3.0e38)  # kvquant's "no score": a key the query does not see
_F0 = np.float32(0.0)
_KERNEL = dict(cache=True, error_model="numpy", fastmath={"nsz", "arcp", "contract", "reassoc", "afn"})


@njit(**_KERNEL)
def _score_update(sc, pos, n_res, rslot, fslot, mode, score):
    """score (cap,) += (h2o), = (tova) or *= EMA_DECAY then += (ema) the observed queries' attention probabilities from
    their scores sc (n_obs, H, >= n_all), indexed as _attn_core joins its keys: ring slots up
    to the last live one of pos, then n_res exact rows (their token's slot: rslot, -1 none),
    then the fresh keys (their slots: fslot). A key's probability reaches its ring slot
    whichever copy of it was read."""
    n_obs, n_head = sc.shape[0], sc.shape[1]
    n_ring = pos.shape[0]
    while n_ring > 0 and pos[n_ring - 1] < 0:  # as _attn_core trims its ring
        n_ring -= 1
    n_all = n_ring + n_res + fslot.shape[0]
    tot = np.zeros(n_all, np.float32)
    e = np.empty(n_all, np.float32)  # one exp a key, in branch-free loops LLVM vectorizes
    for i in range(n_obs):
        for h in range(n_head):
            mx = _NEG
            for j in range(n_all):
                mx = max(mx, sc[i, h, j])
            if mx <= _NEG:
                continue
            den = _F0
            for j in range(n_all):
                x = sc[i, h, j]
                ej = _expf(x - mx)
                ej = ej if x > _NEG else _F0
                e[j] = ej
                den += ej
            inv = np.float32(1.0) / den
            for j in range(n_all):
                tot[j] += e[j] * inv
    w = np.float32(1.0 / (n_obs * n_head)) if n_obs else _F0
    if mode == MODE_EMA:
        for j in range(score.shape[0]):
            score[j] *= EMA_DECAY
    if mode == MODE_TOVA:
        for j in range(n_ring):
            score[j] = _F0
        for j in range(n_ring, n_all):
            s = rslot[j - n_ring] if j < n_ring + n_res else fslot[j - n_ring - n_res]
            if s >= 0:
                score[s] = _F0
    for j in range(n_all):
        s = j if j < n_ring else (rslot[j - n_ring] if j < n_ring + n_res else fslot[j - n_ring - n_res])
        if s >= 0:
            score[s] += tot[j] * w


def score_update(sc: np.ndarray, pos: np.ndarray, n_res: int, rslot: np.ndarray, fslot: np.ndarray, mode: int,
                 score: np.ndarray) -> None:
    """The importance update (see _score_update), unchecked: the cache made every array."""
    _score_update(sc, pos, n_res, rslot, fslot, mode, score)


@njit(cache=True, error_model="numpy")
def _choose(score, keep, pos, n_sink, protect_from, window, p0, out):
    """Fill out (need,) with the slots to overwrite for a batch from position p0, least
    important first: a slot whose token has left a sliding window (p0 - pos >= window), then
    the lowest score; never a sink slot (< n_sink) nor a position >= protect_from (the recent
    window); slots marked keep (chat-template tokens) only once nothing else is left.
    Returns how many it found (< need: the ring cannot take the batch). Called straight from
    edgekv.evict.Evictor.plan (30 layers a decode token: no wrapper, out given)."""
    cap = pos.shape[0]
    need = out.shape[0]
    if need == 1:  # decode: one pass
        best, bkey = -1, np.inf
        for j in range(n_sink, cap):
            p = pos[j]
            if p >= protect_from:
                continue
            key = -1.0 if p < 0 or (window and p0 - p >= window) else np.float64(score[j]) + (1e30 if keep[j] else 0.0)
            if key < bkey:
                best, bkey = j, key
        if best < 0:
            return 0
        out[0] = best
        return 1
    key = np.empty(cap, np.float64)
    for j in range(cap):
        p = pos[j]
        if j < n_sink or p >= protect_from:
            key[j] = np.inf
        elif p < 0 or (window and p0 - p >= window):
            key[j] = -1.0
        else:
            key[j] = np.float64(score[j]) + (1e30 if keep[j] else 0.0)
    order = np.argsort(key, kind="mergesort")
    got = 0
    for t in range(min(need, cap)):
        if key[order[t]] == np.inf:
            break
        out[t] = order[t]
        got += 1
    return got
