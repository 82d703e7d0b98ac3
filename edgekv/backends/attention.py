"""The attention step over a layer's KV cache, written once for every backend: the cache plans the
batch and records what happened (edgekv.kvcache: plan, place, commit), a backend's primitives do
the arithmetic where its arrays live. The primitives (x float32, n = tokens in the batch):

  inputs(q, k, v) -> (q, k, v)        as the other primitives take them (contiguous, on the device)
  host(x) -> np.ndarray               a host copy (an int cache's first batch calibrates on the host)
  sink_query(q, shifts, rope) -> q turned back by shifts (n,) positions for the sinks
  sink_bias(kv, q, q_sink) -> (n, H): what the sinks' scores add back of the key offset
  key_space(kv, q, q_sink, k) -> (q, q_sink, k) moved into an int ring's key space (q_sink may be None)
  store(kv, plan, k, v)               k, v rows plan.writers into the ring (k in key space)
  attend(kv, plan, q, q_sink, q_pos, k, v, sink_bias, scale, softcap) -> (n, H, hd)
      over the ring's slots 0 .. plan.n_ring - 1, the exact copies and, where the plan says, the
      batch's own k, v (q_sink / sink_bias None: the sinks are scored with q, nothing added)
  store_exact(kv, plan, k, v)         rows plan.exact into rk, rv
  decode(kv, plan, q, q_pos, k, v, scale, rope, softcap) -> out, or None where the backend has
      no one-call decode step: all of the above for one token
  join(outs) -> the outputs of a batch's sequences, stacked in row order

A batch of several sequences (kv a kvcache.BatchLayer) runs the same step per sequence, on its
rows of q, k, v and its own cache, so each sequence attends exactly as it would alone. A probe
(kv a kvcache.ProbeLayer: an eviction policy's look at what a prompt's end attends to) runs the
step up to `attend` and stops there: nothing stored, placed or committed.
"""
from __future__ import annotations

import numpy as np

from ..kvcache import BatchLayer, ProbeLayer


class AttentionStep:
    """A backend's `attention` (see edgekv.backends), from its primitives."""

    def attention(self, q, q_pos, kv, k, v, scale: float, rope, softcap: float = 0.0):
        if isinstance(kv, BatchLayer):
            return self.join([self.attention(q[a:b], q_pos[a:b], lk, k[a:b], v[a:b], scale, rope, softcap)
                              for lk, a, b in kv.parts()])
        if isinstance(kv, ProbeLayer):  # attend only: the policy's probe scores change, nothing else
            return self._steps(kv.layer, kv.layer.probe_plan(q_pos), q, q_pos, k, v, scale, rope, softcap)
        plan = kv.plan(q_pos)
        if plan.store_first:
            kv.place(plan)  # attention reads the batch from the ring: its positions first
        out = self.decode(kv, plan, q, q_pos, k, v, scale, rope, softcap) if plan.n == 1 and plan.written else None
        if out is None:
            out = self._steps(kv, plan, q, q_pos, k, v, scale, rope, softcap)
        kv.commit(plan)
        return out

    def _steps(self, kv, plan, q, q_pos, k, v, scale, rope, softcap):
        q, k, v = self.inputs(q, k, v)
        if kv.rotated and not plan.written and not plan.probe:  # an empty int ring: the key offset and channel weights
            kv.calibrate(self.host(q), self.host(k), offset=not softcap)
        q_sink = sink_bias = None
        if plan.shift:  # sinks seen from just before the window (StreamingLLM)
            q_sink = self.sink_query(q, plan.shifts, rope)
            if kv.rotated:
                sink_bias = self.sink_bias(kv, q, q_sink)
        if kv.rotated:
            q, q_sink, k = self.key_space(kv, q, q_sink, k)
        if plan.store_first:
            self.store(kv, plan, k, v)
        out = self.attend(kv, plan, q, q_sink, q_pos, k, v, sink_bias, scale, softcap)
        if plan.probe:
            return out
        if not plan.store_first:  # attended over (ring, this batch): now store it
            self.store(kv, plan, k, v)
            kv.place(plan)
        if kv.recent:
            self.store_exact(kv, plan, k, v)
        return out

    def decode(self, kv, plan, q, q_pos, k, v, scale, rope, softcap):
        return None

    def join(self, outs):
        return np.concatenate(outs)
