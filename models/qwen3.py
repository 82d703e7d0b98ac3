"""Qwen3 decoder: llama's graph plus an RMSNorm on every q and k head before RoPE (QK-norm),
NeoX RoPE, no QKV bias, and a head size from attention.key_length (128 for every size, while
n_embd / n_head is 64 for the 0.6B). Long-context files use YaRN (edgekv/rope.py).
Weights keep their GGUF names.
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


@dataclass(frozen=True)
class Config:
    arch: str
    n_layer: int  # transformer blocks
    n_embd: int  # residual width
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (GQA: n_head is a multiple)
    head_dim: int  # per-head width (attention.key_length)
    n_ff: int  # FFN hidden width
    n_vocab: int
    n_ctx_train: int  # context the model was trained for
    norm_eps: float  # of every RMSNorm, the q/k norms included
    rope: ropes.Rope  # NEOX pairs over the whole head

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        a = f.arch
        n_embd = f.require(f"{a}.embedding_length", int)
        n_head = f.require(f"{a}.attention.head_count", int)
        head_dim = f.get(f"{a}.attention.key_length", n_embd // max(n_head, 1), kind=int)
        if f.get(f"{a}.attention.value_length", head_dim, kind=int) != head_dim:
            raise UnsupportedModelError(f"{a} with attention.value_length != key_length is not supported")
        if f.get(f"{a}.rope.dimension_count", head_dim, kind=int) != head_dim:  # llama.cpp asserts it too
            raise ModelFileError(f"metadata key {a}.rope.dimension_count must equal the head size {head_dim}")
        cfg = cls(
            arch=a,
            n_layer=f.require(f"{a}.block_count", int),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=f.get(f"{a}.attention.head_count_kv", n_head, kind=int),
            head_dim=head_dim,
            n_ff=f.require(f"{a}.feed_forward_length", int),
            n_vocab=f.tensor("token_embd.weight").shape[0],
            n_ctx_train=f.get(f"{a}.context_length", 40960, kind=int),
            norm_eps=float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, kind=(int, float))),
            rope=ropes.from_gguf(f, head_dim, neox=True, factors=False),
        )
        cfg.validate(f)
        validate_model(f, cfg)
        return cfg

    def validate(self, f: GGUFFile) -> None:
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_ff) <= 0:
            raise ModelFileError(f"{self.arch}: non-positive size in metadata: {self}")
        if self.n_head % self.n_head_kv or self.head_dim % 2:
            raise ModelFileError(f"{self.arch}: {self.n_head} heads / {self.n_head_kv} kv heads / head size {self.head_dim} do not fit")
        if self.n_layer > 1024:
            raise ModelFileError(f"{self.arch}: block_count {self.n_layer} is not plausible")
        qd, kvd, e = self.n_head * self.head_dim, self.n_head_kv * self.head_dim, self.n_embd
        expect = {"token_embd.weight": (self.n_vocab, e), "output_norm.weight": (e,)}
        for i in range(self.n_layer):
            p = f"blk.{i}."
            expect.update({
                p + "attn_norm.weight": (e,), p + "ffn_norm.weight": (e,),
                p + "attn_q_norm.weight": (self.head_dim,), p + "attn_k_norm.weight": (self.head_dim,),
                p + "attn_q.weight": (qd, e), p + "attn_k.weight": (kvd, e), p + "attn_v.weight": (kvd, e),
                p + "attn_output.weight": (e, qd), p + "ffn_gate.weight": (self.n_ff, e),
                p + "ffn_up.weight": (self.n_ff, e), p + "ffn_down.weight": (e, self.n_ff),
            })
        if "output.weight" in f.tensors:
            expect["output.weight"] = (self.n_vocab, e)
        check_shapes(f, expect)

    def windows(self) -> list[int]:
        """Sliding window per layer (0 = attends to everything)."""
        return [0] * self.n_layer


@dataclass(frozen=True)
class Qwen3Block(Block):
    attn_q_norm: np.ndarray  # (head_dim,), on every query head
    attn_k_norm: np.ndarray  # (head_dim,), on every key head


class Model:
    def __init__(self, f: GGUFFile, be):
        self.cfg = cfg = Config.from_gguf(f)
        self.be = be
        norm = lambda name: f.tensor(name).as_float().astype(np.float32)  # noqa: E731 (small vectors)
        self.token_embd = be.prepare(f.tensor("token_embd.weight"))
        self.output = be.prepare(f.tensor("output.weight")) if "output.weight" in f.tensors else self.token_embd
        self.output_norm = norm("output_norm.weight")
        self.attn_scale = 1.0 / math.sqrt(cfg.head_dim)  # YaRN's magnitude on q and k: in rope
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            self.layers.append(Qwen3Block(
                attn_norm=norm(p + "attn_norm.weight"),
                attn_qkv=be.fuse([f.tensor(p + f"attn_{x}.weight") for x in "qkv"]),
                attn_q_norm=norm(p + "attn_q_norm.weight"),
                attn_k_norm=norm(p + "attn_k_norm.weight"),
                attn_output=be.prepare(f.tensor(p + "attn_output.weight")),
                ffn_norm=norm(p + "ffn_norm.weight"),
                ffn_gate_up=be.fuse([f.tensor(p + "ffn_gate.weight"), f.tensor(p + "ffn_up.weight")]),
                ffn_down=be.prepare(f.tensor(p + "ffn_down.weight")),
            ))
        # the same block as one fused call for decode, where the backend has one (see forward)
        self.blocks = [be.decoder_block(
            attn_norm=L.attn_norm, qkv=L.attn_qkv, qkv_bias=None, q_norm=L.attn_q_norm,
            k_norm=L.attn_k_norm, attn_output=L.attn_output, post_attn_norm=None, ffn_norm=L.ffn_norm,
            gate_up=L.ffn_gate_up, act="silu", ffn_down=L.ffn_down, post_ffw_norm=None, n_head=cfg.n_head,
            n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, eps=cfg.norm_eps, scale=self.attn_scale, rope=cfg.rope)
            for L in self.layers]
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
            qkv = qkv.reshape(n, H + 2 * Hkv, hd)  # heads: q, k, v
            q = be.rope(be.rmsnorm(qkv[:, :H], L.attn_q_norm, eps), pos, rope)
            k = be.rope(be.rmsnorm(qkv[:, H : H + Hkv], L.attn_k_norm, eps), pos, rope)
            a = be.attention(q, pos, cache[i], k, qkv[:, H + Hkv :], self.attn_scale, rope)  # (n, H, hd)
            x = be.matmul(a.reshape(n, qd), L.attn_output, residual=x)
            gu = be.matmul(x, L.ffn_gate_up, pre="norm", pre_w=L.ffn_norm, eps=eps)  # (n, 2 n_ff)
            x = be.matmul(gu, L.ffn_down, pre="silu", residual=x)
        if last_only:
            x = x[-1:]
        return be.matmul(x, self.output, pre="norm", pre_w=self.output_norm, eps=eps)
