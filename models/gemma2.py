"""Gemma 2 decoder: gemma's pre- and post-norms around attention and FFN, GeGLU, embeddings
scaled by sqrt(n_embd), tied output, NeoX RoPE, no QK-norm; every even layer slides over a
window (llama.cpp's swa pattern 2), attention scores are soft-capped (cap * tanh(s / cap),
`attn_logit_softcapping`, 50) and so are the final logits (`final_logit_softcapping`, 30).
Weights keep their GGUF names; the GGUF norm weights already include gemma's "+1".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import rope as ropes
from ..errors import ModelFileError, UnsupportedModelError
from ..gguf_file import GGUFFile
from ..validate import validate_model
from .llama import Block, check_shapes

SWA_PATTERN = 2  # layers 0, 2, 4, ... slide; 1, 3, 5, ... are global (llama.cpp's set_swa_pattern(2))


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
    norm_eps: float  # of every RMSNorm
    rope: ropes.Rope  # NEOX pairs over the whole head, every layer
    sliding_window: int  # tokens a local layer sees (llama.cpp's default 4096 when absent)
    attn_scale: float  # queries are scaled by this (1 / sqrt(query_pre_attn_scalar))
    attn_softcap: float  # attention scores: cap * tanh(s / cap); 0 = none
    final_softcap: float  # logits: cap * tanh(l / cap); 0 = none

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Config":
        a = f.arch
        n_embd = f.require(f"{a}.embedding_length", int)
        n_head = f.require(f"{a}.attention.head_count", int)
        head_dim = f.get(f"{a}.attention.key_length", n_embd // max(n_head, 1), kind=int)
        if f.get(f"{a}.attention.value_length", head_dim, kind=int) != head_dim:
            raise UnsupportedModelError(f"{a} with attention.value_length != key_length is not supported")
        n_layer = f.require(f"{a}.block_count", int)
        cfg = cls(
            arch=a,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=f.get(f"{a}.attention.head_count_kv", n_head, kind=int),
            head_dim=head_dim,
            n_ff=f.require(f"{a}.feed_forward_length", int),
            n_vocab=f.tensor("token_embd.weight").shape[0],
            n_ctx_train=f.get(f"{a}.context_length", 8192, kind=int),
            norm_eps=float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6, kind=(int, float))),
            rope=ropes.from_gguf(f, head_dim, neox=True, factors=False,
                                 base=float(f.get(f"{a}.rope.freq_base", 10000.0, kind=(int, float)))),
            sliding_window=f.get(f"{a}.attention.sliding_window", 4096, kind=int),
            # llama.cpp (after gemma_pytorch): query_pre_attn_scalar is n_embd / n_head for the 27B
            # (46 layers), the head size otherwise
            attn_scale=1.0 / np.sqrt(n_embd / max(n_head, 1) if n_layer == 46 else head_dim),
            attn_softcap=float(f.get(f"{a}.attn_logit_softcapping", 50.0, kind=(int, float))),
            final_softcap=float(f.get(f"{a}.final_logit_softcapping", 30.0, kind=(int, float))),
        )
        cfg.validate(f)
        validate_model(f, cfg)
        return cfg

    def validate(self, f: GGUFFile) -> None:
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_ff) <= 0:
            raise ModelFileError(f"{self.arch}: non-positive size in metadata: {self}")
        if self.n_head % self.n_head_kv or self.head_dim % 2:
            raise ModelFileError(f"{self.arch}: {self.n_head} heads / {self.n_head_kv} kv heads / head size {self.head_dim} do not fit")
        if self.n_layer > 1024 or self.sliding_window < 0 or self.attn_softcap < 0 or self.final_softcap < 0:
            raise ModelFileError(f"{self.arch}: implausible block_count {self.n_layer}, sliding_window "
                                 f"{self.sliding_window} or soft-caps {self.attn_softcap}/{self.final_softcap}")
        qd, kvd, e = self.n_head * self.head_dim, self.n_head_kv * self.head_dim, self.n_embd
        expect = {"token_embd.weight": (self.n_vocab, e), "output_norm.weight": (e,)}
        for i in range(self.n_layer):
            p = f"blk.{i}."
            for nm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
                expect[p + nm + ".weight"] = (e,)
            expect.update({
                p + "attn_q.weight": (qd, e), p + "attn_k.weight": (kvd, e), p + "attn_v.weight": (kvd, e),
                p + "attn_output.weight": (e, qd), p + "ffn_gate.weight": (self.n_ff, e),
                p + "ffn_up.weight": (self.n_ff, e), p + "ffn_down.weight": (e, self.n_ff),
            })
        check_shapes(f, expect)

    def windows(self) -> list[int]:
        """Sliding window per layer (0 = global)."""
        return [self.sliding_window if i % SWA_PATTERN < SWA_PATTERN - 1 else 0 for i in range(self.n_layer)]


@dataclass(frozen=True)
class Gemma2Block(Block):
    window: int  # sliding window (0 = global)
    post_attention_norm: np.ndarray  # (n_embd,), on the attention output before the residual add
    post_ffw_norm: np.ndarray  # (n_embd,), on the FFN output before the residual add


class Model:
    def __init__(self, f: GGUFFile, be):
        self.cfg = cfg = Config.from_gguf(f)
        self.be = be
        norm = lambda name: f.tensor(name).as_float().astype(np.float32)  # noqa: E731 (small vectors)
        self.token_embd = be.prepare(f.tensor("token_embd.weight"))
        self.output = self.token_embd  # llama.cpp ties gemma2's output to token_embd, always
        self.output_norm = norm("output_norm.weight")
        self.layers = []
        for i, window in enumerate(cfg.windows()):
            p = f"blk.{i}."
            self.layers.append(Gemma2Block(
                window=window,
                attn_norm=norm(p + "attn_norm.weight"),
                attn_qkv=be.fuse([f.tensor(p + f"attn_{x}.weight") for x in "qkv"]),
                attn_output=be.prepare(f.tensor(p + "attn_output.weight")),
                post_attention_norm=norm(p + "post_attention_norm.weight"),
                ffn_norm=norm(p + "ffn_norm.weight"),
                ffn_gate_up=be.fuse([f.tensor(p + "ffn_gate.weight"), f.tensor(p + "ffn_up.weight")]),
                ffn_down=be.prepare(f.tensor(p + "ffn_down.weight")),
                post_ffw_norm=norm(p + "post_ffw_norm.weight"),
            ))
        # the same block as one fused call for decode, where the backend has one (see forward)
        self.blocks = [be.decoder_block(
            attn_norm=L.attn_norm, qkv=L.attn_qkv, qkv_bias=None, q_norm=None, k_norm=None,
            attn_output=L.attn_output, post_attn_norm=L.post_attention_norm, ffn_norm=L.ffn_norm,
            gate_up=L.ffn_gate_up, act="gelu", ffn_down=L.ffn_down, post_ffw_norm=L.post_ffw_norm,
            n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim, eps=cfg.norm_eps,
            scale=cfg.attn_scale, rope=cfg.rope, softcap=cfg.attn_softcap)
            for L in self.layers]
        self.stack = be.decoder_stack(self.blocks)  # all of them in one call a decode token

    def forward(self, ids: np.ndarray, pos: np.ndarray, cache, last_only: bool = True) -> np.ndarray:
        """ids, pos: (n,) int64 -> logits (1 or n, n_vocab) float32; appends this batch's k/v to `cache`."""
        cfg, be = self.cfg, self.be
        n, hd, qd = len(ids), cfg.head_dim, cfg.n_head * cfg.head_dim
        H, Hkv, eps, rope = cfg.n_head, cfg.n_head_kv, cfg.norm_eps, cfg.rope
        x = be.embed(self.token_embd, ids)  # (n, n_embd), the residual stream
        x *= np.float32(np.sqrt(cfg.n_embd))
        stacked = self.stack is not None and be.run_stack(self.stack, x, pos, cache)  # decode: every block
        for i, L in enumerate(self.layers):
            if stacked or self.blocks[i] is not None and be.run_block(self.blocks[i], x, pos, cache[i]):
                continue  # decode: the lines below in one call
            qkv = be.matmul(x, L.attn_qkv, pre="norm", pre_w=L.attn_norm, eps=eps)  # (n, qd + 2 kvd)
            qkv = be.rope(qkv.reshape(n, H + 2 * Hkv, hd), pos, rope, heads=H + Hkv)  # heads: q, k, v
            a = be.attention(qkv[:, :H], pos, cache[i], qkv[:, H : H + Hkv], qkv[:, H + Hkv :], cfg.attn_scale, rope,
                             cfg.attn_softcap)  # (n, H, hd)
            x = be.matmul(a.reshape(n, qd), L.attn_output, residual=x, post_w=L.post_attention_norm, eps=eps)
            gu = be.matmul(x, L.ffn_gate_up, pre="norm", pre_w=L.ffn_norm, eps=eps)  # (n, 2 n_ff)
            x = be.matmul(gu, L.ffn_down, pre="gelu", residual=x, post_w=L.post_ffw_norm, eps=eps)
        if last_only:
            x = x[-1:]
        logits = be.matmul(x, self.output, pre="norm", pre_w=self.output_norm, eps=eps)
        if cfg.final_softcap:
            logits = np.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits
