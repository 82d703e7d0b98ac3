"""Phi-3 / Phi-3.5 / Phi-4-mini decoder (GGUF architecture phi3), as llama.cpp's phi3 graph:
llama's pre-norm block with q, k and v in one attn_qkv.weight (rows q, k, v), gate and up in one
ffn_up.weight (first half gate, second half up, SiLU), NeoX RoPE over rope.dimension_count dims
(Phi-4-mini: 96 of 128) and LongRoPE: per-pair factors rope_factors_long/short.weight picked by the
context the model runs with against rope.scaling.original_context_length, with
rope.scaling.attn_factor on the rotated dims of q and k (edgekv/rope.py). GQA; a tied output
(Phi-4-mini) reads token_embd. attention.sliding_window (Phi-3-mini-4k: 2047; Phi-3.5-mini:
262144, past its context) is read but not applied: llama.cpp disables Phi's sliding window
(its PR 13676), and edgekv follows it. Weights keep their GGUF names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import rope as ropes
from ..errors import ModelFileError, UnsupportedModelError
from ..gguf_file import GGUFFile
from ..validate import validate_model
from .llama import Block, check_shapes

ROPE_BY_CONTEXT = True  # build_model passes n_ctx: LongRoPE's factors depend on it


@dataclass(frozen=True)
class Config:
    arch: str
    n_layer: int  # transformer blocks
    n_embd: int  # residual width
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (GQA: n_head is a multiple)
    head_dim: int  # per-head width (n_embd / n_head; attention.key_length if given)
    n_ff: int  # FFN hidden width (ffn_up holds 2 * n_ff rows: gate, then up)
    n_vocab: int
    n_ctx_train: int  # context the model was trained for (128K for Phi-3.5-mini)
    n_ctx_orig: int  # rope.scaling.original_context_length: past it LongRoPE's long factors apply
    norm_eps: float
    rope_dim: int  # leading dims of a head that rotate
    rope: ropes.Rope  # NEOX pairs; LongRoPE's factors for this n_ctx folded into its frequencies
    file_window: int  # attention.sliding_window as the file has it, not applied (llama.cpp disables it)

    @classmethod
    def from_gguf(cls, f: GGUFFile, n_ctx: int | None = None) -> "Config":
        """n_ctx: the context the model will run with (LongRoPE's choice); None: the trained one."""
        a = f.arch
        n_embd = f.require(f"{a}.embedding_length", int)
        n_head = f.require(f"{a}.attention.head_count", int)
        head_dim = f.get(f"{a}.attention.key_length", n_embd // max(n_head, 1), kind=int)
        if f.get(f"{a}.attention.value_length", head_dim, kind=int) != head_dim:
            raise UnsupportedModelError(f"{a} with attention.value_length != key_length is not supported")
        rope_dim = f.get(f"{a}.rope.dimension_count", head_dim, kind=int)
        n_ctx_train = f.get(f"{a}.context_length", 4096, kind=int)
        cfg = cls(
            arch=a,
            n_layer=f.require(f"{a}.block_count", int),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=f.get(f"{a}.attention.head_count_kv", n_head, kind=int),
            head_dim=head_dim,
            n_ff=f.require(f"{a}.feed_forward_length", int),
            n_vocab=f.tensor("token_embd.weight").shape[0],
            n_ctx_train=n_ctx_train,
            n_ctx_orig=f.get(f"{a}.rope.scaling.original_context_length", 0, kind=int) or n_ctx_train,
            norm_eps=float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5, kind=(int, float))),
            rope_dim=rope_dim,
            rope=ropes.from_gguf(f, rope_dim, neox=True, n_ctx=n_ctx),
            file_window=f.get(f"{a}.attention.sliding_window", 0, kind=int),
        )
        cfg.validate(f)
        validate_model(f, cfg)
        return cfg

    def validate(self, f: GGUFFile) -> None:
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_ff) <= 0:
            raise ModelFileError(f"{self.arch}: non-positive size in metadata: {self}")
        if self.n_head % self.n_head_kv:
            raise ModelFileError(f"{self.arch}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ModelFileError(f"{self.arch}: rope.dimension_count {self.rope_dim} does not fit head size {self.head_dim}")
        if self.n_layer > 1024:
            raise ModelFileError(f"{self.arch}: block_count {self.n_layer} is not plausible")
        biases = [n for n in f.tensors if n.endswith(".bias")]
        if biases:
            raise UnsupportedModelError(f"{self.arch} with biases ({biases[0]}, ...) is not supported")
        qd, kvd, e = self.n_head * self.head_dim, self.n_head_kv * self.head_dim, self.n_embd
        expect = {"token_embd.weight": (self.n_vocab, e), "output_norm.weight": (e,)}
        for i in range(self.n_layer):
            p = f"blk.{i}."
            expect.update({
                p + "attn_norm.weight": (e,), p + "ffn_norm.weight": (e,), p + "attn_output.weight": (e, qd),
                p + "ffn_up.weight": (2 * self.n_ff, e), p + "ffn_down.weight": (e, self.n_ff),
            })
            if p + "attn_qkv.weight" in f.tensors:
                expect[p + "attn_qkv.weight"] = (qd + 2 * kvd, e)
            else:  # llama.cpp takes separate q/k/v too
                expect.update({p + "attn_q.weight": (qd, e), p + "attn_k.weight": (kvd, e),
                               p + "attn_v.weight": (kvd, e)})
        if "output.weight" in f.tensors:
            expect["output.weight"] = (self.n_vocab, e)
        check_shapes(f, expect)

    def windows(self) -> list[int]:
        """Sliding window per layer (0 = attends to everything): none, as llama.cpp runs phi3."""
        return [0] * self.n_layer


class Model:
    def __init__(self, f: GGUFFile, be, n_ctx: int | None = None):
        self.cfg = cfg = Config.from_gguf(f, n_ctx)
        self.be = be
        norm = lambda name: f.tensor(name).as_float().astype(np.float32)  # noqa: E731 (small vectors)
        self.token_embd = be.prepare(f.tensor("token_embd.weight"))
        self.output = be.prepare(f.tensor("output.weight")) if "output.weight" in f.tensors else self.token_embd
        self.output_norm = norm("output_norm.weight")
        # LongRoPE's attn_factor is not in here: rope applies it to the rotated dims only
        self.attn_scale = 1.0 / math.sqrt(cfg.head_dim)
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            qkv = p + "attn_qkv.weight"
            self.layers.append(Block(
                attn_norm=norm(p + "attn_norm.weight"),
                attn_qkv=be.prepare(f.tensor(qkv)) if qkv in f.tensors else
                be.fuse([f.tensor(p + f"attn_{x}.weight") for x in "qkv"]),
                attn_output=be.prepare(f.tensor(p + "attn_output.weight")),
                ffn_norm=norm(p + "ffn_norm.weight"),
                ffn_gate_up=be.prepare(f.tensor(p + "ffn_up.weight")),  # (2 n_ff, n_embd): gate rows, then up
                ffn_down=be.prepare(f.tensor(p + "ffn_down.weight")),
            ))
        # the same block as one fused call for decode, where the backend has one (see forward)
        self.blocks = [be.decoder_block(
            attn_norm=L.attn_norm, qkv=L.attn_qkv, qkv_bias=None, q_norm=None, k_norm=None,
            attn_output=L.attn_output, post_attn_norm=None, ffn_norm=L.ffn_norm, gate_up=L.ffn_gate_up,
            act="silu", ffn_down=L.ffn_down, post_ffw_norm=None, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
            head_dim=cfg.head_dim, eps=cfg.norm_eps, scale=self.attn_scale, rope=cfg.rope) for L in self.layers]
        self.stack = be.decoder_stack(self.blocks)  # all of them in one call a decode token

    def forward(self, ids: np.ndarray, pos: np.ndarray, cache, last_only: bool = True) -> np.ndarray:
        """ids, pos: (n,) int64 -> logits (1 or n, n_vocab) float32; appends this batch's k/v to `cache`."""
        cfg, be = self.cfg, self.be
        n, hd, qd = len(ids), cfg.head_dim, cfg.n_head * cfg.head_dim
        H, Hkv, eps, rope = cfg.n_head, cfg.n_head_kv, cfg.norm_eps, cfg.rope
        x = be.embed(self.token_embd, ids)  # (n, n_embd), the residual stream
        stacked = self.stack is not None and be.run_stack(self.stack, x, pos, cache)  # decode: every block
        for i, L in enumerate(self.layers):
            if stacked or self.blocks[i] is not None and be.run_block(self.blocks[i], x, pos, cache[i]):
                continue  # decode: the lines below in one call
            qkv = be.matmul(x, L.attn_qkv, pre="norm", pre_w=L.attn_norm, eps=eps)  # (n, qd + 2 kvd)
            qkv = be.rope(qkv.reshape(n, H + 2 * Hkv, hd), pos, rope, heads=H + Hkv)  # heads: q, k, v
            q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
            a = be.attention(q, pos, cache[i], k, v, self.attn_scale, rope)  # (n, H, hd)
            x = be.matmul(a.reshape(n, qd), L.attn_output, residual=x)
            gu = be.matmul(x, L.ffn_gate_up, pre="norm", pre_w=L.ffn_norm, eps=eps)  # (n, 2 n_ff)
            x = be.matmul(gu, L.ffn_down, pre="silu", residual=x)
        if last_only:
            x = x[-1:]
        return be.matmul(x, self.output, pre="norm", pre_w=self.output_norm, eps=eps)
