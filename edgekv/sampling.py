"""Turning one step's logits into the next token, the way llama.cpp's default sampler chain does.

Order (llama.cpp `common_sampler`): logit bias -> penalties (repeat / presence / frequency over
the last `penalty_last_n` tokens of history) -> top-k -> top-p -> min-p -> temperature -> draw.
top-p and min-p therefore look at temperature-1 probabilities; temperature only reshapes what
survives. temperature 0 is greedy: the argmax after bias and penalties.

Randomness is numpy's PCG64. Each non-greedy call consumes exactly one uniform draw, so token i
always uses draw i whatever the filters keep; `state()` / `from_state()` carry the generator
across a saved session, and a restored sampler continues the same stream.

Speed: vocabularies reach 262144 entries, so nothing here sorts the whole vocabulary. The k
largest logits are found through a cheap lower bound (`_top`) that leaves a few dozen
candidates, and top-p without top-k bins the probability mass (`Sampler._top_p_vocab`).
Vocabulary-sized work buffers belong to the Sampler and are reused: fresh megabyte temporaries
cost more in page faults than the arithmetic. So one Sampler serves one stream at a time.
"""
from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from .errors import EdgekvError, SessionFileError

STATE_VERSION = 1


@dataclass(frozen=True)
class SamplingParams:
    """What a llama.cpp / llama-cpp-python user sets; the defaults are llama.cpp's (common_params_sampling)."""

    temperature: float = 0.8  # 0 = greedy (argmax after bias + penalties)
    top_k: int = 40  # keep the k largest logits; 0 = off
    top_p: float = 0.95  # keep the smallest head whose probability sums to >= top_p; 1.0 = off
    min_p: float = 0.05  # drop tokens with p < min_p * p_max; 0 = off
    repeat_penalty: float = 1.0  # seen tokens: positive logits divided, others multiplied; 1.0 = off
    presence_penalty: float = 0.0  # subtracted once from every seen token
    frequency_penalty: float = 0.0  # subtracted per occurrence
    penalty_last_n: int = 64  # how many recent history tokens the penalties see; -1 = all, 0 = none
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)  # token -> added logit; -inf bans
    seed: int | None = None  # fixed seed => identical output; None = fresh entropy

    def __post_init__(self) -> None:
        self.validate()
        if self.logit_bias is not None:
            # a private read-only copy: a caller mutating its dict must not change a frozen config
            frozen = MappingProxyType({int(t): float(b) for t, b in self.logit_bias.items()})
            object.__setattr__(self, "logit_bias", frozen)

    def validate(self) -> None:
        """Raise EdgekvError naming the first bad field."""
        _real("temperature", self.temperature, lo=0.0)
        _int("top_k", self.top_k, lo=0)
        _real("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _real("min_p", self.min_p, lo=0.0, hi=1.0)
        _real("repeat_penalty", self.repeat_penalty, lo=0.0, lo_open=True)
        _real("presence_penalty", self.presence_penalty)
        _real("frequency_penalty", self.frequency_penalty)
        _int("penalty_last_n", self.penalty_last_n, lo=-1)
        if self.seed is not None:
            _int("seed", self.seed, lo=0, hi=2**128 - 1, hi_text="2**128 - 1")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise EdgekvError(f"logit_bias must be a mapping token id -> bias, got {type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
                    raise EdgekvError(f"logit_bias: token id must be an int >= 0, got {tok!r}")
                # +inf would make the softmax NaN; -inf is the documented way to ban a token
                if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or math.isnan(bias) or bias == math.inf:
                    raise EdgekvError(f"logit_bias[{tok}]: bias must be a finite number or -inf, got {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _int(name: str, v, lo: int, hi: int | None = None, hi_text: str | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise EdgekvError(f"{name} must be an int, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi_text or hi}]"
        raise EdgekvError(f"{name} must be an int {bound}, got {v}")


def _real(name: str, v, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise EdgekvError(f"{name} must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if hi is not None else ')'}"
        raise EdgekvError(f"{name} must be in {rng}, got {v}")
    if hi is not None and v > hi:
        raise EdgekvError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")


class Sampler:
    """Picks the next token from (n_vocab,) float32 logits. Holds the random generator and scratch
    buffers; the history of previous tokens is passed in on each call."""

    def __init__(self, params: SamplingParams, n_vocab: int, *, _rng: np.random.Generator | None = None):
        params.validate()
        _int("n_vocab", n_vocab, lo=1)
        self.params = params
        self.n_vocab = n = int(n_vocab)
        bias = dict(params.logit_bias or {})
        bad = [t for t in bias if t >= n]
        if bad:
            raise EdgekvError(f"logit_bias: token id {bad[0]} is outside the vocabulary (n_vocab={n})")
        self._bias_ids = np.array(sorted(bias), dtype=np.int64)  # (n_bias,)
        self._bias_vals = np.array([bias[t] for t in sorted(bias)], dtype=np.float32)  # (n_bias,)
        # llama.cpp holds p and min_p as float: use the same rounded values, so that a cumulative
        # mass landing between 0.9 and float(0.9f) cuts where llama.cpp cuts
        self._top_p = float(np.float32(params.top_p))
        self._log_min_p = np.log(np.float32(params.min_p)) if params.min_p > 0.0 else np.float32(-np.inf)
        self._penalised = params.penalty_last_n != 0 and (
            params.repeat_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        if _rng is None:
            # the seed actually used is kept, so a run with seed=None can still be replayed
            self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(16), "little")
            _rng = np.random.Generator(np.random.PCG64(self.seed))
        else:
            self.seed = params.seed
        self._rng = _rng
        self._x = np.empty(n, np.float32)  # (n_vocab,) logits after bias and penalties
        self._e = np.empty(n, np.float32)  # (n_vocab,) exp scratch
        self._mask = np.empty(n, np.bool_)  # (n_vocab,)
        c = min(n, _CHUNK)
        self._d = np.empty(c, np.float32)  # (chunk,) bin arithmetic
        self._b = np.empty(c, np.intp)  # (chunk,) bin of each token

    # ---- the chain -------------------------------------------------------------------------

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token. logits: (n_vocab,) float32, left untouched; history: prompt + generated
        token ids so far (the penalties read its last penalty_last_n)."""
        x = self._adjusted(logits, history)
        if self.params.greedy:
            return int(np.argmax(x))  # first maximum on ties, as llama.cpp's greedy sampler
        ids, w = self._candidates(x)
        i = _pick(w, self._rng.random())
        return i if ids is None else int(ids[i])

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """What __call__ draws from, without drawing: the surviving token ids (m,) int64 and their
        probabilities (m,) float64, summing to 1. Greedy gives the argmax with probability 1."""
        x = self._adjusted(logits, history)
        if self.params.greedy:
            return np.array([np.argmax(x)], dtype=np.int64), np.ones(1)
        ids, w = self._candidates(x)
        if ids is None:  # the whole vocabulary but its banned tokens
            ids = np.flatnonzero(x > -np.inf)
            w = w[ids]
        w = w.astype(np.float64)
        return ids.astype(np.int64), w / w.sum()

    def logprobs(self, logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """The model's log-probability of `token` and its k likeliest tokens with theirs, by
        logprob descending: the log-softmax of the raw logits (n_vocab,) at temperature 1,
        before bias, penalties and filters (what OpenAI and llama-server report), not of what
        the sampler drew from."""
        x = np.asarray(logits, dtype=np.float32)
        m = float(x.max())
        e = self._e
        np.subtract(x, np.float32(m), out=e)
        np.exp(e, out=e)
        lse = m + math.log(float(e.sum(dtype=np.float64)))
        top = _top(x, min(k, self.n_vocab), self._mask) if k > 0 else []
        return float(x[token]) - lse, [(int(i), float(x[i]) - lse) for i in top]

    def _adjusted(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits with logit bias, then penalties, applied, in the reused buffer _x."""
        logits = np.asarray(logits)
        if logits.shape != (self.n_vocab,):
            raise EdgekvError(f"logits must have shape ({self.n_vocab},), got {logits.shape}")
        x = self._x
        np.copyto(x, logits, casting="same_kind")
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias_vals
        if self._penalised and len(history):
            self._apply_penalties(x, history)
        m = x.max()
        if math.isnan(m):
            raise EdgekvError("logits contain NaN")
        if m == -math.inf:
            raise EdgekvError("every token is banned (all logits are -inf after logit_bias)")
        return x

    def _apply_penalties(self, x: np.ndarray, history: Sequence[int]) -> None:
        """llama.cpp's penalties sampler, in float32 like it: for each token seen c > 0 times in the
        window, l = l / r if l > 0 else l * r; then l -= c * frequency + presence."""
        p = self.params
        window = history if p.penalty_last_n < 0 else history[-p.penalty_last_n:]
        window = np.asarray(window, dtype=np.int64)  # (n_window,)
        if window.size == 0:
            return
        if window.min() < 0 or window.max() >= self.n_vocab:
            raise EdgekvError(f"history holds a token id outside [0, {self.n_vocab})")
        ids, counts = np.unique(window, return_counts=True)  # (n_seen,), (n_seen,)
        l = x[ids]
        r = np.float32(p.repeat_penalty)
        if r != 1.0:
            l = np.where(l > 0, l / r, l * r)
        l = l - (counts.astype(np.float32) * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        x[ids] = l

    def _candidates(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """top-k -> top-p -> min-p -> temperature on the adjusted logits x (n_vocab,). Returns the
        survivors' ids (m,) in a deterministic order and their weights (m,) (softmax numerators,
        the largest is 1). ids None means every token, weights then (n_vocab,) with 0 for banned."""
        p, n = self.params, x.shape[0]
        m = x.max()
        if 0 < p.top_k < n:
            ids = _top(x, p.top_k, self._mask)  # (k,) by logit descending
            if self._top_p < 1.0:  # llama.cpp's top-p renormalises over the top-k survivors
                ids = ids[: _top_p_cut(x[ids], self._top_p)]
        elif self._top_p < 1.0:
            ids = self._top_p_vocab(x, self._top_p)
        elif p.min_p > 0.0:
            ids = None
        else:  # plain temperature sampling over the whole vocabulary, in the reused buffer
            w = self._e
            np.subtract(x, m, out=w)
            # multiply by a capped 1/T: a float32 1/T could overflow to inf, and 0 * inf = NaN at the max
            w *= np.float32(min(1.0 / p.temperature, 1e30))
            np.exp(w, out=w)
            return None, w
        # min-p as llama.cpp writes it, on logits: l >= l_max + log(min_p)  <=>  p >= min_p * p_max.
        # Every filter above keeps the vocabulary's max. -inf (banned) never survives.
        thr = m + self._log_min_p  # float32; -inf when min-p is off
        if ids is None:
            np.greater_equal(x, thr, out=self._mask)
            ids = np.flatnonzero(self._mask)
            vals = x[ids]
        else:
            vals = x[ids]
            keep = np.flatnonzero((vals >= thr) & (vals > -np.inf))
            ids, vals = ids[keep], vals[keep]
        # shift before dividing: a tiny temperature then gives -inf, never inf - inf = NaN
        return ids, np.exp((vals.astype(np.float64) - float(m)) / p.temperature)

    def _top_p_vocab(self, x: np.ndarray, top_p: float) -> np.ndarray:
        """top-p over the whole vocabulary x (n,): ids of the smallest set of largest logits whose
        probability mass reaches top_p (llama.cpp's sorted prefix), without sorting the vocabulary.

        A peaked distribution is settled by a small sorted head. A flat one can need 10^5 tokens, so
        instead the mass is binned by distance below the max, the bin where the cumulative mass
        crosses top_p is found, and only that bin's tokens are sorted. Result: the tokens of nearer
        bins by id, then the boundary bin's kept tokens by logit descending."""
        n = x.shape[0]
        m = x.max()
        e = self._e
        np.subtract(x, m, out=e)
        np.exp(e, out=e)  # (n,) unnormalised probabilities
        need = top_p * float(e.sum(dtype=np.float64))
        for b in (64, 512):
            ids = _top(x, min(b, n), self._mask)  # (b,) descending
            c = np.cumsum(e[ids], dtype=np.float64)
            if c[-1] >= need or ids.shape[0] == n:
                return ids[: min(int(np.searchsorted(c, need, side="left")) + 1, ids.shape[0])]
        hist = np.zeros(_TOP_P_BINS)  # (n_bins,) float64 mass per bin
        for a in range(0, n, _CHUNK):
            bins = self._bins(x[a : a + _CHUNK], m)
            hist += np.bincount(bins, weights=e[a : a + _CHUNK], minlength=_TOP_P_BINS)
        mass = np.cumsum(hist)  # (n_bins,)
        j = min(int(np.searchsorted(mass, need, side="left")), _TOP_P_BINS - 1)  # the bin crossing top_p
        inner, edge = [], []
        for a in range(0, n, _CHUNK):
            bins = self._bins(x[a : a + _CHUNK], m)  # the same arithmetic as above, so the same bins
            inner.append(np.flatnonzero(bins < j) + a)
            edge.append(np.flatnonzero(bins == j) + a)
        edge = np.concatenate(edge)  # (n_edge,)
        edge = edge[np.lexsort((edge, -x[edge]))]
        c = (mass[j - 1] if j else 0.0) + np.cumsum(e[edge], dtype=np.float64)
        edge = edge[: min(int(np.searchsorted(c, need, side="left")) + 1, edge.shape[0])]
        return np.concatenate(inner + [edge])

    def _bins(self, x: np.ndarray, m: np.float32) -> np.ndarray:
        """Mass bin of each logit of a chunk x (c,): distance below the max m, 0 = nearest. (c,) intp,
        a view of a reused buffer (intp because bincount converts anything else, slowly)."""
        c = x.shape[0]
        d, b = self._d[:c], self._b[:c]
        np.subtract(m, x, out=d)
        d *= np.float32(_TOP_P_BINS / _EXP_UNDERFLOW)
        np.minimum(d, np.float32(_TOP_P_BINS - 1), out=d)
        b[:] = d  # truncating float -> int cast
        return b

    # ---- saving and restoring -----------------------------------------------------------------

    def state(self) -> dict:
        """JSON-serialisable generator state. The 128-bit words are hex strings so that JSON
        readers limited to doubles do not round them."""
        s = self._rng.bit_generator.state
        return {
            "version": STATE_VERSION,
            "bit_generator": s["bit_generator"],
            "state": format(s["state"]["state"], "x"),
            "inc": format(s["state"]["inc"], "x"),
            "has_uint32": int(s["has_uint32"]),
            "uinteger": int(s["uinteger"]),
        }

    @classmethod
    def from_state(cls, params: SamplingParams, n_vocab: int, state: Mapping) -> Sampler:
        """A sampler that continues the random stream `state` was taken from."""
        try:
            if state["version"] != STATE_VERSION or state["bit_generator"] != "PCG64":
                raise ValueError(f"version {state['version']!r} / {state['bit_generator']!r}")
            bg = np.random.PCG64()
            bg.state = {
                "bit_generator": "PCG64",
                "state": {"state": int(state["state"], 16), "inc": int(state["inc"], 16)},
                "has_uint32": int(state["has_uint32"]),
                "uinteger": int(state["uinteger"]),
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise SessionFileError(f"sampler state is not a valid PCG64 state: {exc}") from None
        return cls(params, n_vocab, _rng=np.random.Generator(bg))


_EXP_UNDERFLOW = 104.0  # float32 exp(-d) is 0 beyond this: those tokens carry no mass
_TOP_P_BINS = 16384
_CHUNK = 65536  # vocabulary slice per pass of the binned top-p
_PICK_BLOCK = 4096  # weights per block of the two-level draw


def _top(x: np.ndarray, k: int, mask: np.ndarray) -> np.ndarray:
    """Ids of the k largest entries of x (n,), sorted by value descending, ties by lower id.
    mask: (n,) bool scratch.

    A full argpartition of 262144 floats costs ~3 ms. Instead: split x into c >= k chunks; each
    chunk max is a distinct element, so the k-th largest chunk max t is <= the k-th largest of x.
    Every top-k entry is therefore >= t, and `x >= t` typically leaves only ~k..2k candidates."""
    n = x.shape[0]
    if k >= n:
        cand = np.arange(n)
    else:
        c = min(n, 4 * k)
        w = n // c
        mx = x[: w * c].reshape(c, w).max(axis=1)  # (c,) chunk maxima
        t = np.partition(mx, c - k)[c - k]
        np.greater_equal(x, t, out=mask)
        cand = np.flatnonzero(mask)  # (>= k,)
        if cand.shape[0] > k:
            cand = cand[np.argpartition(x[cand], cand.shape[0] - k)[-k:]]
    return cand[np.lexsort((cand, -x[cand]))]


def _top_p_cut(vals: np.ndarray, top_p: float) -> int:
    """Length of the smallest head of descending logits vals (k,) whose softmax mass is >= top_p."""
    c = np.cumsum(np.exp(vals.astype(np.float64) - float(vals[0])))  # (k,)
    return min(int(np.searchsorted(c, top_p * c[-1], side="left")) + 1, vals.shape[0])


def _pick(w: np.ndarray, u: float) -> int:
    """Index drawn from weights w (m,) (non-negative, some positive) by one uniform u in [0, 1).
    Two levels, block sums then one block's cumulative sum, so a whole-vocabulary w costs two
    cheap passes and no (m,) float64 temporary."""
    starts = np.arange(0, w.shape[0], _PICK_BLOCK)
    sums = np.cumsum(np.add.reduceat(w, starts, dtype=np.float64))  # (n_blocks,)
    t = u * sums[-1]
    bi = _search(sums, t)
    a = int(starts[bi])
    c = (sums[bi - 1] if bi else 0.0) + np.cumsum(w[a : a + _PICK_BLOCK], dtype=np.float64)
    return a + _search(c, t)


def _search(c: np.ndarray, t: float) -> int:
    """First i with c[i] > t in a non-decreasing cumulative sum c; so never a zero-weight step."""
    i = int(np.searchsorted(c, t, side="right"))
    if i >= c.shape[0]:  # t rounded up to the total: the last step that carries weight
        i = int(np.searchsorted(c, c[-1], side="left"))
    return i
