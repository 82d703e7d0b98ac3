"""Llama-family decoder (llama, mistral, smollm, qwen2, granite): RMSNorm, RoPE, GQA attention,
SwiGLU.

Weights keep their GGUF names; qwen2 adds biases on q/k/v and rotates in NeoX order; granite
adds four multipliers from its metadata (embeddings, each block's residual branches, the
attention scale, logits divided by logit_scale). RoPE
comes from edgekv/rope.py: linear, YaRN, and Llama 3.x's frequency factors (rope_freqs.weight).
The head size is attention.key_length (Mistral-Nemo: 128 with n_embd 5120 and 32 heads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import rope as ropes
from ..errors import ModelFileError, UnsupportedModelError
from ..gguf_file import GGUFFile
from ..validate import validate_model

NEOX_ARCHS = {"qwen2"}  # llama.cpp's LLAMA_ROPE_TYPE_NEOX for these; NORM (adjacent pairs) otherwise


@dataclass(frozen=True)
class Config:
    arch: str
    n_layer: int  # transformer blocks
    n_embd: int  # residual width
    n_head: int  # query heads
    n_head_kv: int  # key/value heads (GQA: n_head is a multiple)
    head_dim: int  # per-head width
    n_ff: int  # FFN hidden width
    n_vocab: int
    n_ctx_train: int  # context the model was trained for
    norm_eps: float
    rope_dim: int  # leading dims of a head that rotate
    rope: ropes.Rope  # per-pair frequencies (scaling, factors), NEOX or NORM pairs
    # granite's multipliers (1.0 elsewhere; a 0 in the file means "none", as in llama.cpp)
    embedding_scale: float = 1.0  # token embeddings times this
    residual_scale: float = 1.0  # attention and FFN outputs times this before the residual add
    attention_scale: float = 0.0  # q.k times this (0: 1/sqrt(head_dim))
    logit_scale: float = 1.0  # logits divided by this

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        a = f.arch
        n_embd = f.require(f"{a}.embedding_length", int)
        n_head = f.require(f"{a}.attention.head_count", int)
        n_head_kv = f.get(f"{a}.attention.head_count_kv", n_head, kind=int)
        head_dim = f.get(f"{a}.attention.key_length", n_embd // max(n_head, 1), kind=int)
        if f.get(f"{a}.attention.value_length", head_dim, kind=int) != head_dim:
            raise UnsupportedModelError(f"{a} with attention.value_length != key_length is not supported")
        rope_dim = f.get(f"{a}.rope.dimension_count", head_dim, kind=int)
        tok = f.tensor("token_embd.weight")
        cfg = cls(
            arch=a,
            n_layer=f.require(f"{a}.block_count", int),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=f.require(f"{a}.feed_forward_length", int),
            n_vocab=tok.shape[0],
            n_ctx_train=f.get(f"{a}.context_length", 4096, kind=int),
            norm_eps=float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5, kind=(int, float))),
            rope_dim=rope_dim,
            rope=ropes.from_gguf(f, rope_dim, neox=a in NEOX_ARCHS),
            **(granite_scales(f) if a == "granite" else {}),
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
        qd, kvd = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        expect = {"token_embd.weight": (self.n_vocab, self.n_embd), "output_norm.weight": (self.n_embd,)}
        for i in range(self.n_layer):
            p = f"blk.{i}."
            expect.update({
                p + "attn_norm.weight": (self.n_embd,), p + "ffn_norm.weight": (self.n_embd,),
                p + "attn_q.weight": (qd, self.n_embd), p + "attn_k.weight": (kvd, self.n_embd),
                p + "attn_v.weight": (kvd, self.n_embd), p + "attn_output.weight": (self.n_embd, qd),
                p + "ffn_gate.weight": (self.n_ff, self.n_embd), p + "ffn_up.weight": (self.n_ff, self.n_embd),
                p + "ffn_down.weight": (self.n_embd, self.n_ff),
            })
        if "output.weight" in f.tensors:
            expect["output.weight"] = (self.n_vocab, self.n_embd)
        check_shapes(f, expect)

    def windows(self) -> list[int]:
        """Sliding window per layer (0 = attends to everything)."""
        return [0] * self.n_layer


def granite_scales(f: GGUFFile) -> dict:
    """Granite's multipliers, read as llama.cpp's granite loader does (logit_scale required)."""
    a = f.arch
    num = lambda key, default: float(f.get(f"{a}.{key}", default, kind=(int, float)) or default)  # noqa: E731
    if not f.get(f"{a}.rope.scaling.finetuned", True, kind=(bool, int)):
        raise UnsupportedModelError("granite without RoPE (rope.scaling.finetuned = false) is not supported")
    logit = float(f.require(f"{a}.logit_scale", (int, float)))
    if not logit > 0:
        raise ModelFileError(f"metadata key {a}.logit_scale is {logit}, expected a positive number")
    return dict(embedding_scale=num("embedding_scale", 1.0), residual_scale=num("residual_scale", 1.0),
                attention_scale=num("attention.scale", 0.0), logit_scale=logit)


def check_shapes(f: GGUFFile, expect: dict) -> None:
    for name, shape in expect.items():
        t = f.tensor(name)
        if t.shape != tuple(shape):
            raise ModelFileError(f"tensor {name} has shape {t.shape}, expected {tuple(shape)}")
    for name in f.tensors:
        if name.endswith(".bias") and f.tensors[name].qtype not in (0, 1):
            raise ModelFileError(f"bias {name} must be F32 or F16")


@dataclass(frozen=True)
class Block:
    """One decoder block's weights by their GGUF names (blk.{i}.<name>.weight): float32 norm
    vectors and backend handles (be.prepare / be.fuse); the fused ones join several tensors."""
    attn_norm: np.ndarray  # (n_embd,)
    attn_qkv: object  # attn_q, attn_k, attn_v: (n_head + 2 n_head_kv) * head_dim outputs
    attn_output: object  # n_embd outputs
    ffn_norm: np.ndarray  # (n_embd,)
    ffn_gate_up: object  # ffn_gate, ffn_up: 2 n_ff outputs
    ffn_down: object  # n_embd outputs


@dataclass(frozen=True)
class LlamaBlock(Block):
    qkv_bias: np.ndarray | None  # qwen2: attn_q, attn_k, attn_v biases side by side; else None


class Model:
    def __init__(self, f: GGUFFile, be):
        self.cfg = cfg = Config.from_gguf(f)
        self.be = be
        norm = lambda name: f.tensor(name).as_float().astype(np.float32)  # noqa: E731 (small vectors)
        opt = lambda name: norm(name) if name in f.tensors else None  # noqa: E731
        self.token_embd = be.prepare(f.tensor("token_embd.weight"))
        self.output = be.prepare(f.tensor("output.weight")) if "output.weight" in f.tensors else self.token_embd
        self.output_norm = norm("output_norm.weight")
        # YaRN's magnitude on q and k enters as its square
        self.attn_scale = cfg.attention_scale or 1.0 / math.sqrt(cfg.head_dim)  # YaRN's magnitude: in rope
        self.layers = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            bias = [opt(p + f"attn_{x}.bias") for x in "qkv"]
            self.layers.append(LlamaBlock(
                attn_norm=norm(p + "attn_norm.weight"),
                attn_qkv=be.fuse([f.tensor(p + f"attn_{x}.weight") for x in "qkv"]),
                qkv_bias=np.concatenate(bias) if all(b is not None for b in bias) else None,
                attn_output=be.prepare(f.tensor(p + "attn_output.weight")),
                ffn_norm=norm(p + "ffn_norm.weight"),
                ffn_gate_up=be.fuse([f.tensor(p + "ffn_gate.weight"), f.tensor(p + "ffn_up.weight")]),
                ffn_down=be.prepare(f.tensor(p + "ffn_down.weight")),
            ))
        # the same block as one fused call for decode, where the backend has one (see forward)
        self.blocks = [be.decoder_block(
            attn_norm=L.attn_norm, qkv=L.attn_qkv, qkv_bias=L.qkv_bias, q_norm=None, k_norm=None,
            attn_output=L.attn_output, post_attn_norm=None, ffn_norm=L.ffn_norm, gate_up=L.ffn_gate_up,
            act="silu", ffn_down=L.ffn_down, post_ffw_norm=None, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv,
            head_dim=cfg.head_dim, eps=cfg.norm_eps, scale=self.attn_scale, rope=cfg.rope,
            residual_scale=cfg.residual_scale) for L in self.layers]
        self.stack = be.decoder_stack(self.blocks)  # all of them in one call a decode token

    def forward(self, ids: np.ndarray, pos: np.ndarray, cache, last_only: bool = True) -> np.ndarray:
        """ids, pos: (n,) int64 -> logits (1 or n, n_vocab) float32; appends this batch's k/v to `cache`."""
        cfg, be = self.cfg, self.be
        n, hd, qd = len(ids), cfg.head_dim, cfg.n_head * cfg.head_dim
        H, Hkv, eps, rope, rs = cfg.n_head, cfg.n_head_kv, cfg.norm_eps, cfg.rope, cfg.residual_scale
        x = be.embed(self.token_embd, ids)  # (n, n_embd), the residual stream
        if cfg.embedding_scale != 1.0:
            x *= np.float32(cfg.embedding_scale)
        stacked = self.stack is not None and be.run_stack(self.stack, x, pos, cache)  # decode: every block
        for i, L in enumerate(self.layers):
            if stacked or self.blocks[i] is not None and be.run_block(self.blocks[i], x, pos, cache[i]):
                continue  # decode: the lines below in one call
            qkv = be.matmul(x, L.attn_qkv, pre="norm", pre_w=L.attn_norm, eps=eps)  # (n, qd + 2 kvd)
            if L.qkv_bias is not None:
                qkv += L.qkv_bias
            qkv = be.rope(qkv.reshape(n, H + 2 * Hkv, hd), pos, rope, heads=H + Hkv)  # heads: q, k, v
            q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
            a = be.attention(q, pos, cache[i], k, v, self.attn_scale, rope)  # (n, H, hd)
            if rs != 1.0:  # rs * (a @ Wo.T) as (rs * a) @ Wo.T
                a *= np.float32(rs)
            x = be.matmul(a.reshape(n, qd), L.attn_output, residual=x)
            gu = be.matmul(x, L.ffn_gate_up, pre="norm", pre_w=L.ffn_norm, eps=eps)  # (n, 2 n_ff)
            if rs != 1.0:  # rs * down(silu(g) * u) as down(silu(g) * u * rs)
                h = be.silu_mul(gu[:, : cfg.n_ff], gu[:, cfg.n_ff :])  # (n, n_ff)
                h *= np.float32(rs)
                x = be.matmul(h, L.ffn_down, residual=x)
            else:
                x = be.matmul(gu, L.ffn_down, pre="silu", residual=x)
        if last_only:
            x = x[-1:]
        logits = be.matmul(x, self.output, pre="norm", pre_w=self.output_norm, eps=eps)
        if cfg.logit_scale != 1.0:
            logits /= np.float32(cfg.logit_scale)
        return logits
