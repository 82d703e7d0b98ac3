"""The numpy reference backend: slow and obviously correct, the oracle for every fast kernel.

Weights are dequantized with gguf.quants.dequantize (the format's reference) on first use and
kept as float32; all math is float32 numpy.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..gguf_file import Tensor
from ..kvcache import LayerKV, Plan
from ..kvkinds import GROUP, hadamard_block
from ..rope import Rope
from .attention import AttentionStep


def dequantize_tensor(t: Tensor) -> np.ndarray:
    """float32 (rows, cols) of a 2-D weight, or the float32 vector of a 1-D one."""
    w = dequantize(np.asarray(t.raw), GGMLQuantizationType(t.qtype)).astype(np.float32, copy=False)
    return w.reshape(t.shape)


# -- the numpy reference of the KV cache's stored layout (kernels_cpu/kvquant.py is the fast one) --
def hadamard(x: np.ndarray) -> np.ndarray:
    """Normalized Walsh-Hadamard transform over the last axis in blocks (its own inverse)."""
    hd = x.shape[-1]
    b = hadamard_block(hd)
    y = x.astype(np.float32).reshape(*x.shape[:-1], hd // b, b).copy()
    h = 1
    while h < b:  # butterflies: pairs (i, i + h) within blocks of 2h
        y = y.reshape(*y.shape[:-1], b // (2 * h), 2, h)
        a, c = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + c, a - c
        y = y.reshape(*y.shape[:-3], b)
        h *= 2
    return (y / np.sqrt(b)).reshape(x.shape).astype(np.float32)


def quantize_kv(kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., hd) float32 -> (q, scale): int8 (..., hd) or packed uint8 (..., hd/2); f16 (..., hd/32)."""
    g = x.reshape(*x.shape[:-1], -1, GROUP).astype(np.float32)
    if kind == "int8":
        d = (np.abs(g).max(axis=-1, keepdims=True) / 127).astype(np.float16)  # the scale as stored
        df = d.astype(np.float32)
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        q = np.clip(np.rint(g * inv), -127, 127).astype(np.int8).reshape(x.shape)
    else:
        q, d = _fit_int4(g)
        q = q.reshape(x.shape)
    if kind == "int4":
        u = (q.astype(np.int16) + 8).astype(np.uint8)
        q = u[..., 0::2] | (u[..., 1::2] << 4)
    return q, d[..., 0]


def _fit_int4(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups g (..., 32) float32 -> levels (..., 32) int8 in [-8, 7] and scales (..., 1) f16.
    Candidate steps around llama.cpp q4_0's (the largest-magnitude value x_m at -8): inverse
    steps -8 / (f x_m), f = 0.75, 0.775, .., 1.1; each gives levels q and the least-squares
    step sum(xq) / sum(q^2); the candidate of least squared error wins (largest
    sum(xq)^2 / sum(q^2), the first on ties). Float64 sums of float32 x small integer are
    exact, so the kernel's order of summation gives the same bytes."""
    x = g.astype(np.float64)
    xm = np.take_along_axis(x, np.abs(g).argmax(axis=-1)[..., None], axis=-1)  # (..., 1)
    best = np.full(xm.shape, -1.0)
    best_inv, best_d = np.zeros(xm.shape), np.zeros(xm.shape)
    for ci in range(15):
        inv = np.divide(-8.0, xm * (0.75 + 0.025 * ci), out=np.zeros_like(xm), where=xm != 0)
        q = np.clip(np.rint(x * inv), -8, 7)
        sxq, sqq = (x * q).sum(-1, keepdims=True), (q * q).sum(-1, keepdims=True)
        ok = sqq > 0
        score = np.divide(sxq * sxq, sqq, out=np.zeros_like(sxq), where=ok)
        win = score > best
        best = np.where(win, score, best)
        best_inv = np.where(win, inv, best_inv)
        best_d = np.where(win, np.divide(sxq, sqq, out=np.zeros_like(sxq), where=ok), best_d)
    q = np.clip(np.rint(x * best_inv), -8, 7).astype(np.int8)
    return q, best_d.astype(np.float32).astype(np.float16)  # via float32, as the kernel rounds


def dequantize_kv(kind: str, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if kind == "int4":
        lo = (q & 0x0F).astype(np.int8) - 8
        hi = (q >> 4).astype(np.int8) - 8
        q = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    g = q.reshape(*q.shape[:-1], q.shape[-1] // GROUP, GROUP).astype(np.float32)  # no -1: q may be empty
    return (g * scale.astype(np.float32)[..., None]).reshape(q.shape)


def _importance(ev, plan, p: np.ndarray, slots: np.ndarray) -> None:
    """An eviction policy's update from attention probabilities p (H, n, T) of keys held in ring
    slots (T,): the mean over heads and the batch's last OBSERVE queries, added to each slot's
    score (h2o; ema after decaying every score) or replacing every score (tova; a probe's scores
    always replace)."""
    from ..evict import EMA_DECAY, MODE_EMA, MODE_TOVA, OBSERVE

    imp = p[:, -OBSERVE:, :].mean(axis=(0, 1))  # (T,)
    mode, score = ev.target(plan)
    if mode == MODE_EMA:
        score *= np.float32(EMA_DECAY)
    if mode == MODE_TOVA:
        score[:] = 0.0
    ok = slots >= 0
    np.add.at(score, slots[ok], imp[ok].astype(np.float32))


class ReferenceBackend(AttentionStep):
    name = "reference"
    # Up to this many rows (a batch of decode tokens: LLM.forward_batch), a matmul is one product
    # per row, the call a single token makes, so each row has its bits alone (BLAS's GEMM sums
    # in another order than its one-row product); above it, one GEMM (prefill), as the CPU kernels.
    batch_rows = 16

    def __init__(self):
        self._dense: dict[str, np.ndarray] = {}

    def prepare(self, t: Tensor) -> Tensor:
        return t

    def fuse(self, ts: list[Tensor]) -> tuple[Tensor, ...]:
        return tuple(ts)

    def decoder_block(self, **parts) -> None:
        """No fused block: the model's op-by-op code is the reference."""
        return None

    def run_block(self, pack, x, pos, kv) -> bool:
        return False

    def decoder_stack(self, blocks) -> None:
        return None

    def run_stack(self, stack, x, pos, cache) -> bool:
        return False

    def _w(self, t: Tensor) -> np.ndarray:
        if t.name not in self._dense:
            self._dense[t.name] = dequantize_tensor(t)
        return self._dense[t.name]

    def matmul(self, x: np.ndarray, w, *, pre: str | None = None, pre_w: np.ndarray | None = None,
               eps: float = 1e-6, residual: np.ndarray | None = None, post_w: np.ndarray | None = None) -> np.ndarray:
        if pre == "norm":
            x = self.rmsnorm(x, pre_w, eps)
        elif pre is not None:  # x (n, 2k): gate and up side by side
            k = x.shape[-1] // 2
            x = {"silu": self.silu_mul, "gelu": self.gelu_mul}[pre](x[:, :k], x[:, k:])
        ws = w if isinstance(w, tuple) else (w,)
        y = np.concatenate([self._product(x, self._w(t)) for t in ws], axis=-1)
        if residual is None:
            return y
        residual += y if post_w is None else self.rmsnorm(y, post_w, eps)
        return residual

    def _product(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if 1 < len(x) <= self.batch_rows:
            return np.concatenate([(x[t : t + 1] @ w.T).astype(np.float32) for t in range(len(x))])
        return (x @ w.T).astype(np.float32)

    def embed(self, w: Tensor, ids: np.ndarray) -> np.ndarray:
        rows = w.raw[np.asarray(ids)]  # each embedding row is whole blocks: dequantize just these
        return dequantize(np.ascontiguousarray(rows), GGMLQuantizationType(w.qtype)).astype(np.float32).reshape(len(ids), -1)

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(ms + eps) * w).astype(np.float32)

    def rope(self, x: np.ndarray, pos: np.ndarray, rope: Rope, heads: int | None = None,
             mag: float | None = None) -> np.ndarray:
        """mag: the rotated dims' magnitude (None: rope.attn_factor, as ggml's rope applies it)."""
        if heads is not None:  # rotate the first heads, keep the rest
            return np.concatenate([self.rope(x[:, :heads], pos, rope, mag=mag), x[:, heads:]], axis=1)
        # pair i turns by pos * freqs[i]; angles in float64 so huge positions stay exact.
        n_rot = rope.n_rot
        mag = rope.attn_factor if mag is None else mag
        ang = pos.astype(np.float64)[:, None] * rope.freqs[None, :]  # (n, n_rot/2)
        cos = (np.cos(ang) * mag).astype(np.float32)[:, None, :]
        sin = (np.sin(ang) * mag).astype(np.float32)[:, None, :]
        out = x.copy()
        if rope.neox:  # pairs (i, i + n_rot/2)
            a, b = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]
            out[..., : n_rot // 2] = a * cos - b * sin
            out[..., n_rot // 2 : n_rot] = a * sin + b * cos
        else:  # adjacent pairs (2i, 2i+1)
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        return out

    def silu_mul(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        return (g / (1.0 + np.exp(-g)) * u).astype(np.float32)

    def gelu_mul(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        # GGML's gelu is the tanh approximation
        c = np.float32(np.sqrt(2.0 / np.pi))
        return (0.5 * g * (1.0 + np.tanh(c * (g + 0.044715 * g**3))) * u).astype(np.float32)

    # -- the attention step's primitives (backends/attention.py), on numpy ----------------
    def inputs(self, q, k, v):
        return q, k, v

    def host(self, x: np.ndarray) -> np.ndarray:
        return x

    def sink_query(self, q: np.ndarray, shifts: np.ndarray, rope: Rope) -> np.ndarray:
        return self.rope(q, -shifts, rope, mag=1.0)  # q is scaled already

    def sink_bias(self, kv: LayerKV, q: np.ndarray, q_sink: np.ndarray) -> np.ndarray:
        return kv.sink_bias(q, q_sink)

    def key_space(self, kv: LayerKV, q, q_sink, k):
        """H(q / kmul) and H((k - mu) * kmul): (H(q / kmul)) . (H((k - mu) kmul)) = q . (k - mu)."""
        qmul = np.repeat(kv.kmul, q.shape[1] // kv.kmul.shape[0], axis=0)
        return hadamard(q / qmul), None if q_sink is None else hadamard(q_sink / qmul), hadamard((k - kv.mu) * kv.kmul)

    def store(self, kv: LayerKV, plan: Plan, k: np.ndarray, v: np.ndarray) -> None:
        rows, slots = plan.writers
        k, v = k[rows], v[rows]
        if kv.rotated:  # k arrives in stored key space
            kv.k[slots], kv.k_scale[slots] = quantize_kv(kv.kind, k)
            kv.v[slots], kv.v_scale[slots] = quantize_kv(kv.kind, v)
        else:
            kv.k[slots], kv.v[slots] = k, v

    def store_exact(self, kv: LayerKV, plan: Plan, k: np.ndarray, v: np.ndarray) -> None:
        rows, dst = plan.exact
        kv.rk[dst], kv.rv[dst] = k[rows], v[rows]

    def attend(self, kv: LayerKV, plan: Plan, q, q_sink, q_pos, k, v, sink_bias, scale: float, softcap: float):
        n, H, hd = q.shape
        m = plan.n_ring
        if kv.rotated:  # the ring's first m slots as stored, keys in (rotated) stored space
            kk, vv = dequantize_kv(kv.kind, kv.k[:m], kv.k_scale[:m]), dequantize_kv(kv.kind, kv.v[:m], kv.v_scale[:m])
        else:
            kk, vv = kv.k[:m].astype(np.float32), kv.v[:m].astype(np.float32)
        # three sources (kv_attention's): 0 the ring as stored, 1 the exact recent slots,
        # 2 this batch exact: all of it when not yet stored, else only for the recent rule
        first = plan.store_first
        ring_pos = kv.pos[:m]
        live, rlive = ring_pos >= 0, kv.rpos >= 0
        fresh = not first or kv.recent > 0
        keys = np.concatenate([kk[live], kv.rk[rlive].astype(np.float32)] + ([k] if fresh else []))  # (T, Hkv, hd)
        vals = np.concatenate([vv[live], kv.rv[rlive].astype(np.float32)] + ([v] if fresh else []))
        k_pos = np.concatenate([ring_pos[live], kv.rpos[rlive]] + ([q_pos] if fresh else []))
        src = np.repeat([0, 1, 2], [live.sum(), rlive.sum(), n if fresh else 0])
        # sinks: ring slots 0..n_sink-1 and their exact copies (positions < n_sink)
        sink = np.zeros(len(k_pos), bool)
        sink[: live.sum()] = (np.arange(m) < kv.n_sink)[live]
        sink[live.sum():] = k_pos[live.sum():] < kv.n_sink
        group = H // keys.shape[1]  # query head h reads kv head h // group
        keys = np.repeat(keys, group, axis=1)  # (T, H, hd)
        vals = np.repeat(vals, group, axis=1)
        s = np.einsum("nhd,thd->hnt", q, keys)  # (H, n, T)
        s_sink = s if q_sink is None else np.einsum("nhd,thd->hnt", q_sink, keys)
        if sink_bias is not None:
            s_sink = s_sink + sink_bias.T[:, :, None]  # (H, n, 1)
        s = np.where(sink[None, None, :], s_sink, s) * np.float32(scale)
        if softcap:  # gemma2: scores squashed into (-softcap, softcap)
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        dist = q_pos[:, None] - k_pos[None, :]  # (n, T)
        masked = (dist < 0) | ((dist >= kv.span) & ~sink[None, :] & (kv.span > 0))  # sinks: causal, never out of span (0: none)
        exact = ((dist < kv.recent) & (k_pos >= plan.exact_lo)[None, :]) | (k_pos < kv.first)[None, :]  # read from an exact copy
        masked |= np.where(src == 0, exact, ~exact & ((src == 1) | first))
        s = np.where(masked[None], -np.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        if kv.evictor is not None:
            _importance(kv.evictor, plan, p, np.concatenate([np.flatnonzero(live), kv.evictor.rslot[rlive]]
                                                      + ([plan.writers[1]] if fresh else [])))
        return np.einsum("hnt,thd->nhd", p, vals).astype(np.float32)

    def add_(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a += b
        return a
