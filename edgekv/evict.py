"""Eviction policies: which ring slot a new token overwrites once a layer's ring is full.

"window" (the default) is the ring of edgekv/kvcache.py: the oldest token after the sinks goes
(StreamingLLM). The others keep what attention needs: each token's importance comes out of the
attention kernel that already computes its scores (kvquant.kv_attention's `scores`, the fused
decode step), one float per slot, and the least important unprotected token is overwritten:

  h2o   attention accumulated over every query since the token was stored (H2O)
  tova  the last query's attention alone (TOVA)
  ema   attention accumulated with each earlier query's share decayed by EMA_DECAY a step: the
        recent queries' view, steadier than TOVA's one query, without H2O's bias to the oldest

A prefill batch scores the keys with its last OBSERVE queries (SnapKV's observation window).
A prompt longer than the ring (bounded prefill) is prefilled in chunks that evict as they go, so
the question at its end would come after what it asks about is gone. Before each chunk that
evicts, the prompt's last OBSERVE tokens run as a probe (LLM.forward: attend only, nothing
stored, at the positions right after the cache), and their attention, max-pooled over POOL
neighbouring positions so a number's digits or a name's pieces stay together (SnapKV), alone
chooses what that chunk overwrites (the chunks' own queries never saw the question; with the
policy's scores added, fewer keys survived: bench/RESULTS.md). Once the prompt is in, the
policy's scores choose again, the question's queries among them.
A model with sliding-window layers (Gemma-3) has them lend LEND of their window to the global
layers once those fill, and the global rings split by depth (SPLIT; kvcache.lend: the same slots
in all, moved to where attention reaches far back); until then a lending layer only keeps
scores, to choose what it gives up.
Never evicted: the sinks, the last `recent` positions before a batch (at least the int kinds'
exact tier), and positions marked with `KVCache.protect` (the chat template's control tokens:
role markers, turn boundaries; evicted only when nothing else is left). Positions stay exact:
keys keep their absolute RoPE positions, and the sinks theirs (no counter-rotated query), so a
query sees every kept token at its true distance, as the uncapped cache does (see the
kvcache docstring).
"""
from __future__ import annotations

import numpy as np

from .errors import ContextError, EdgekvError
from .kvcache import Plan

EVICT_POLICIES = ("window", "h2o", "tova", "ema")
_MODES = {"h2o": 1, "tova": 2, "ema": 3}  # kernels_cpu.evict's modes
MODE_TOVA, MODE_EMA = _MODES["tova"], _MODES["ema"]
EMA_DECAY = 0.8  # kernels_cpu.evict.EMA_DECAY; chosen by KL on SmolLM2 (bench/RESULTS.md)
EVICT_PREFIX = "ev_"  # the names of a policy's arrays in a saved cache (Evictor.state)
PROTECT_RECENT = 32  # positions before a batch no policy evicts (kvcache.RECENT: the exact tier is kept whole)
OBSERVE = 32  # a prefill batch's last queries that score the keys (SnapKV's window)
POOL = 7  # positions a probe's scores are max-pooled over (SnapKV's kernel)
LEND = 0.25  # of a sliding layer's full window, lent to the global layers once they fill (kvcache.lend)
SPLIT = (1.5, 0.5)  # the global rings then, first to last, times their mean (kvcache.lend; PyramidKV's idea)


def check_policy(policy: str) -> str:
    if policy not in EVICT_POLICIES:
        raise EdgekvError(f"unknown eviction policy {policy!r} (choose {', '.join(EVICT_POLICIES)})")
    return policy


class Evictor:
    """One layer's eviction state: importance per slot, protected slots, and the ring slot of each
    exact-copy row's token (an int ring reads recent tokens from those rows, and their attention
    must reach the slot)."""

    def __init__(self, policy: str, lk, recent: int = PROTECT_RECENT):
        cap = lk.capacity
        self.policy, self.mode = policy, _MODES[policy]
        self.score = np.zeros(cap, np.float32)  # (cap,) mean attention (h2o: summed over queries, ema: decayed sum)
        self.probe = np.zeros(cap, np.float32)  # (cap,) the last probe's attention, pooled (0: none)
        self.probed = False  # a probe has run for the coming batch (its plan chooses by the probe)
        self.keep = np.zeros(cap, np.bool_)  # (cap,) protected tokens (KVCache.protect)
        self.rslot = np.full(lk.first + lk.recent, -1, np.int64)  # (first + recent,) slot of each exact row's token
        self.recent = max(recent, lk.recent)
        self.window = lk.window
        self.pending: set[int] = set()  # positions to protect once stored
        self.evicted = 0  # tokens overwritten
        self.lost = 0.0  # their attention (mean per query) when overwritten, summed
        from .kernels_cpu.evict import _choose  # here, not at import: `import edgekv` loads no numba

        self._choose = _choose  # unwrapped: it runs per evicting layer and decode token

    @property
    def plans(self) -> bool:
        """Does it choose the slots of a full ring? False for a sliding ring of its whole window,
        lending (kvcache.lend): it keeps scores only, for what it gives up, and the ring's order drops."""
        return not (self.window and len(self.score) >= self.window)

    def target(self, plan) -> tuple[int, np.ndarray]:
        """(mode, scores) a batch's attention updates: a probe's replaces the probe scores."""
        return (MODE_TOVA, self.probe) if plan.probe else (self.mode, self.score)

    def pool(self, lk) -> None:
        """After a probe: each kept token's probe score becomes the largest among its POOL
        nearest kept positions (in position order, whatever the slots)."""
        self.probed = True
        live = np.flatnonzero(lk.pos[: lk.fill] >= 0)
        if len(live) < POOL:
            return
        live = live[np.argsort(lk.pos[live], kind="stable")]
        sc = np.pad(self.probe[live], POOL // 2, constant_values=0.0)
        self.probe[live] = np.lib.stride_tricks.sliding_window_view(sc, POOL).max(axis=1)

    @property
    def kernel(self) -> tuple:
        """(mode, score, rslot) as kvquant.kv_decode_layer takes them."""
        return self.mode, self.score, self.rslot

    def plan(self, lk, q_pos: np.ndarray):
        """LayerKV.plan once the batch overflows the ring: its slots chosen (free ones first),
        stored before it attends, no sink shift, every slot read."""
        n, p0 = len(q_pos), q_pos.item(0)
        nw, cap, s, r, f = lk.n_written, lk.capacity, lk.n_sink, lk.recent, lk.first
        fill = nw if nw < cap else cap
        need = n - (cap - fill)
        victims = self.victims(lk, need, p0)
        if victims is None:
            raise ContextError(f"a batch of {n} tokens does not fit a {cap}-token ring that protects "
                               f"{s} sinks and the last {self.recent} tokens (KVCache.batch_limit)")
        slots = victims if fill == cap else np.concatenate([np.arange(fill, cap, dtype=np.int64), victims])
        last = p0 + n - 1
        # tuple.__new__, as LayerKV.plan: a decode token makes one plan per evicting layer
        return tuple.__new__(Plan, (p0, n, True, cap, lk.exact_from if lk.exact_from >= 0 else p0, 0, slots.item(0),
                                    (last if last < f else f + last % r) if r else -1, nw, cap, s, f, r, slots, False))

    def victims(self, lk, need: int, p0: int) -> np.ndarray | None:
        """(need,) slots to give up before a batch at p0, least important first, counted as evicted
        (plan, LayerKV.resize); None when the ring has fewer it may give up."""
        sc = self.probe if self.probed else self.score  # a probe ran for this batch: what the prompt's end attends to chooses
        out = np.empty(need, np.int64)
        if self._choose(sc, self.keep, lk.pos, lk.n_sink, p0 - self.recent, self.window, p0, out) != need:
            return None
        self._account(lk, out, p0)
        return out

    def resized(self, lk, keep: np.ndarray) -> None:
        """The ring now holds the tokens of slots `keep` (old numbering) in slots 0 .. len(keep) - 1."""
        cap = lk.capacity
        new = np.full(len(self.score), -1, np.int64)
        new[keep] = np.arange(len(keep))
        for name in ("score", "probe", "keep"):
            a = getattr(self, name)
            b = np.zeros(cap, a.dtype)
            b[: len(keep)] = a[keep]
            setattr(self, name, b)
        live = self.rslot >= 0
        self.rslot[live] = new[self.rslot[live]]

    def _account(self, lk, victims: np.ndarray, p0: int) -> None:
        if len(victims) == 1:  # decode: plain floats (numpy's per-call cost was ~1 ms a token at 30 layers)
            v = victims.item(0)
            pos = lk.pos.item(v)
            if pos >= 0:
                self.evicted += 1
                self.lost += float(self._attention(self.score.item(v), p0 - pos))
            return
        live = lk.pos[victims]
        live_v = victims[live >= 0]
        if not len(live_v):
            return
        self.evicted += len(live_v)
        self.lost += float(self._attention(self.score[live_v].astype(np.float64), p0 - lk.pos[live_v]).sum())

    def _attention(self, score, age):
        """A token's attention per query from its score (a float or an array) and age."""
        if self.mode == 1:  # accumulated: per query seen
            return score / np.maximum(age, 1)
        if self.mode == MODE_EMA:  # decayed sum: about the attention / (1 - decay)
            return score * (1.0 - EMA_DECAY)
        return score

    def placed(self, plan) -> None:
        """The batch's slots hold new tokens: no importance yet, protected if marked. A probe
        counts for the one batch it ran before."""
        self.probed = False
        if plan.n == 1:  # decode: plain ints
            self.score[plan.slot] = self.probe[plan.slot] = 0.0
            self.keep[plan.slot] = bool(self.pending) and plan.p0 in self.pending
            self.pending.discard(plan.p0)
            return
        rows, slots = plan.writers
        self.score[slots] = self.probe[slots] = 0.0
        if not self.pending:
            self.keep[slots] = False
            return
        p = plan.p0 + rows
        self.keep[slots] = [int(x) in self.pending for x in p]
        self.pending.difference_update(int(x) for x in p)

    def committed(self, plan) -> None:
        """The exact rows the batch wrote: their tokens' slots."""
        if not len(self.rslot):
            return
        if plan.n == 1:
            self.rslot[plan.exact_row] = plan.slot
            return
        rows, dst = plan.exact
        _, slots = plan.writers
        self.rslot[dst] = slots[rows]

    def scores_for(self, plan, n_head: int, n_fresh: int) -> np.ndarray:
        """A filled (n_obs, H, width) array for kv_attention's scores over this plan's keys."""
        from .kernels_cpu.kvquant import SCORE_NONE

        return np.full((min(plan.n, OBSERVE), n_head, plan.n_ring + len(self.rslot) + n_fresh), SCORE_NONE, np.float32)

    def reset(self) -> None:
        self.score[:] = self.probe[:] = 0.0
        self.probed = False
        self.keep[:] = False
        self.rslot[:] = -1
        self.pending.clear()
        self.evicted, self.lost = 0, 0.0

    # -- save / load (LayerKV.state / checked / take_state) --------------------------
    def state(self, fill: int) -> tuple[dict, dict[str, np.ndarray]]:
        """(metadata, arrays) a saved cache keeps of the policy: the filled slots' scores and
        protected flags, the exact rows' slots, the tally; not the probe (it lives one batch)."""
        meta = dict(policy=self.policy, evicted=self.evicted, lost=self.lost, pending=sorted(self.pending))
        return meta, dict(ev_score=self.score[:fill], ev_keep=self.keep[:fill].view(np.uint8), ev_rslot=self.rslot)

    def checked(self, meta, arrays: dict, fill: int, n_tokens: int, cap: int) -> dict | None:
        """A `state` of a cache of n_tokens, checked (ValueError when it does not fit), or None when
        it was saved under another policy or none: this policy then starts afresh. Changes nothing.
        cap: the ring's capacity once the state is in (LayerKV.capacity_at)."""
        if not isinstance(meta, dict) or meta.get("policy") != self.policy:
            return None
        want = dict(ev_score=(np.float32, (fill,)), ev_keep=(np.uint8, (fill,)), ev_rslot=(np.int64, self.rslot.shape))
        for name, (dtype, shape) in want.items():
            a = arrays.get(name)
            if a is None or a.dtype != dtype or a.shape != shape:
                raise ValueError(f"eviction array {name} missing or of another shape")
        score, keep, rslot = arrays["ev_score"], arrays["ev_keep"], arrays["ev_rslot"]
        if not np.isfinite(score).all() or (score < 0).any() or (keep > 1).any() or \
                (rslot.size and not -1 <= rslot.min() <= rslot.max() < cap):
            raise ValueError("eviction state out of range")
        evicted, lost, pending = meta.get("evicted"), meta.get("lost"), meta.get("pending")
        if not isinstance(evicted, int) or evicted < 0 or not isinstance(lost, (int, float)) or \
                not 0 <= lost < float("inf") or not isinstance(pending, list) or len(pending) > n_tokens + 1 or \
                not all(isinstance(p, int) and 0 <= p <= n_tokens for p in pending):
            raise ValueError("eviction tally out of range")
        return dict(score=score, keep=keep, rslot=rslot, evicted=evicted, lost=float(lost), pending=set(pending))

    def take(self, saved: dict | None) -> None:
        """Hold a `checked` state (None: start afresh). In place: a fused decode pack holds these arrays."""
        self.reset()
        if saved is None:
            return
        f = len(saved["score"])
        self.score[:f], self.keep[:f], self.rslot[:] = saved["score"], saved["keep"] != 0, saved["rslot"]
        self.evicted, self.lost, self.pending = saved["evicted"], saved["lost"], set(saved["pending"])

    def copy(self, lk) -> "Evictor":
        twin = Evictor(self.policy, lk, self.recent)  # lk: a fork of this one's ring, of its capacity
        twin.score[:], twin.probe[:], twin.keep[:], twin.rslot[:] = self.score, self.probe, self.keep, self.rslot
        twin.pending, twin.evicted, twin.lost, twin.probed = set(self.pending), self.evicted, self.lost, self.probed
        return twin
