"""The numpy reference backend: slow and obviously correct, the oracle for every fast kernel.

Weights are dequantized with gguf.quants.dequantize (the format's reference) on first use and
kept as float32; all math is float32 numpy.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ..gguf_file import Tensor
from ..kvcache import LayerKV
from ..rope import Rope


def dequantize_tensor(t: Tensor) -> np.ndarray:
    """float32 (rows, cols) of a 2-D weight, or the float32 vector of a 1-D one."""
    w = dequantize(np.asarray(t.raw), GGMLQuantizationType(t.qtype)).astype(np.float32, copy=False)
    return w.reshape(t.shape)


class ReferenceBackend:
    name = "reference"

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
        y = np.concatenate([(x @ self._w(t).T).astype(np.float32) for t in ws], axis=-1)
        if residual is None:
            return y
        residual += y if post_w is None else self.rmsnorm(y, post_w, eps)
        return residual

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

    def attention(self, q, q_pos, kv: LayerKV, k, v, scale: float, rope: Rope, softcap: float = 0.0) -> np.ndarray:
        n, H, hd = q.shape
        kv.calibrate(q, k, offset=not softcap)  # on an empty ring: the key offset and channel weights
        k_stored = kv.key_space(k)  # (n, Hkv, hd) as the ring stores keys
        e0 = kv.exact_lo(q_pos)  # before this batch lands in the recent slots
        first = kv.write_first(n)
        if first:  # nothing this batch needs gets evicted: store, then read back
            kv.write(k_stored, v, q_pos)
        # three sources (kv_attention's): 0 the ring as stored, 1 the exact recent slots,
        # 2 this batch exact: all of it when not yet stored, else only for the recent rule
        kk, vv = kv.read()  # (fill, Hkv, hd), keys in stored (maybe rotated) space
        ring_pos = kv.pos[: kv.fill]  # slots past the fill are empty (LayerKV.fill)
        live, rlive = ring_pos >= 0, kv.rpos >= 0
        fresh = not first or kv.recent > 0
        keys = np.concatenate([kk[live], kv.rk[rlive].astype(np.float32)] + ([k_stored] if fresh else []))  # (T, Hkv, hd)
        vals = np.concatenate([vv[live], kv.rv[rlive].astype(np.float32)] + ([v] if fresh else []))
        k_pos = np.concatenate([ring_pos[live], kv.rpos[rlive]] + ([q_pos] if fresh else []))
        src = np.repeat([0, 1, 2], [live.sum(), rlive.sum(), n if fresh else 0])
        # sinks: ring slots 0..n_sink-1 and their exact copies (positions < n_sink)
        sink = np.zeros(len(k_pos), bool)
        sink[: live.sum()] = (np.arange(kv.fill) < kv.n_sink)[live]
        sink[live.sum():] = k_pos[live.sum():] < kv.n_sink
        q_sink = self.rope(q, -kv.sink_shift(q_pos), rope, mag=1.0)  # sinks just before the window (q is scaled)
        sink_bias = kv.sink_bias(q, q_sink).T[:, :, None]  # (H, n, 1)
        q, q_sink = kv.query_space(q), kv.query_space(q_sink)
        group = H // keys.shape[1]  # query head h reads kv head h // group
        keys = np.repeat(keys, group, axis=1)  # (T, H, hd)
        vals = np.repeat(vals, group, axis=1)
        s = np.einsum("nhd,thd->hnt", q, keys)  # (H, n, T)
        s_sink = np.einsum("nhd,thd->hnt", q_sink, keys) + sink_bias
        s = np.where(sink[None, None, :], s_sink, s) * np.float32(scale)
        if softcap:  # gemma2: scores squashed into (-softcap, softcap)
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        dist = q_pos[:, None] - k_pos[None, :]  # (n, T)
        masked = (dist < 0) | ((dist >= kv.span) & ~sink[None, :])  # sinks: causal, but never out of span
        exact = ((dist < kv.recent) & (k_pos >= e0)[None, :]) | (k_pos < kv.first)[None, :]  # read from an exact copy
        masked |= np.where(src == 0, exact, ~exact & ((src == 1) | first))
        s = np.where(masked[None], -np.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("hnt,thd->nhd", p, vals).astype(np.float32)
        if not first:
            kv.write(k_stored, v, q_pos)
        kv.write_recent(k_stored, v, q_pos)
        return out

    def add_(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a += b
        return a
