"""What a GGUF's metadata must satisfy before edgekv trusts it.

Three checks, each raising ModelFileError with the key or tensor and what was expected:
- check_metadata(meta): run by GGUFFile on open. The general and tokenizer keys have the type the
  GGUF spec gives them, and the tokenizer arrays have one entry per token, so no later `int(v)`
  or `len` meets a value of the wrong kind. Keys edgekv does not read are not checked.
- check_arch_key(arch, key, v): run by GGUFFile.get on every `<arch>.` key a model reads, so a
  hyperparameter has a plausible value (head counts >= 1, finite positive RoPE base, ...) before
  any division meets it. Checked where it is read: an architecture edgekv does not run (whose
  keys may be arrays, as OpenELM's head counts) is refused by models.model_module, not here.
- validate_model(f, cfg): once an architecture's Config is built (its validate() has checked the
  tensor shapes), what ties metadata and tensors together: the vocabulary matches the embedding,
  the special tokens generation relies on lie inside it, the RoPE width fits a head, a sliding
  window fits the trained context, optional tensors (biases, output) have the shapes the graph
  assumes.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .errors import ModelFileError

MAX_CONTEXT = 1 << 24  # trained context lengths: at most ~1e7 today (Llama 4 Scout: 10M)
# Special tokens generation relies on must lie in the vocabulary. Others (padding, fim_*) may
# not: converters write e.g. padding_token_id = n_vocab for fine-tunes that added a pad token
# without resizing the vocabulary; llama.cpp only warns and the tokenizer ignores such ids.
STRICT_TOKEN_IDS = ("bos", "eos", "unknown", "eot", "eom")


# -- value kinds: (description for messages, predicate) ----------------------------------------
def _int(lo: int, hi: int) -> tuple[str, Callable]:
    return (f"an integer in [{lo}, {hi}]", lambda v: type(v) is int and lo <= v <= hi)


def _float(lo: float, hi: float, lo_open: bool = False) -> tuple[str, Callable]:
    def ok(v) -> bool:
        if type(v) not in (int, float) or not math.isfinite(v):
            return False
        return (lo < v if lo_open else lo <= v) and v <= hi

    return (f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", ok)


_STR = ("a string", lambda v: type(v) is str)
_FLAG = ("a bool", lambda v: type(v) in (bool, int))  # the spec says bool; 0/1 integers are harmless
_STR_LIST = ("an array of strings", lambda v: type(v) is list)  # the parser makes lists only of str
_NUM_ARRAY = ("an array of numbers", lambda v: isinstance(v, np.ndarray) and v.dtype.kind in "fiu")
_INT_ARRAY = ("an array of integers", lambda v: isinstance(v, np.ndarray) and v.dtype.kind in "iu")
_TOKEN_ID = _int(0, (1 << 32) - 1)  # uint32 in the spec; the vocabulary bound is validate_model's

# fmt: off
GENERAL_KEYS = {
    "general.architecture": _STR,
    "general.alignment": _int(1, 1 << 16),
    "general.name": _STR,
    "general.file_type": _int(0, 1 << 16),
    "general.quantization_version": _int(0, 1 << 16),
    "tokenizer.ggml.model": _STR,
    "tokenizer.ggml.pre": _STR,
    "tokenizer.ggml.tokens": _STR_LIST,
    "tokenizer.ggml.scores": _NUM_ARRAY,
    "tokenizer.ggml.token_type": _INT_ARRAY,
    "tokenizer.ggml.merges": _STR_LIST,
    "tokenizer.ggml.added_tokens": _STR_LIST,
    "tokenizer.ggml.add_bos_token": _FLAG,
    "tokenizer.ggml.add_eos_token": _FLAG,
    "tokenizer.ggml.add_space_prefix": _FLAG,
    "tokenizer.chat_template": _STR,
}
# keys under "<arch>.", as the models read them
ARCH_KEYS = {
    "context_length": _int(1, MAX_CONTEXT),
    "embedding_length": _int(1, 1 << 20),
    "block_count": _int(1, 1 << 12),
    "feed_forward_length": _int(1, 1 << 22),
    "vocab_size": _int(1, 1 << 24),
    "attention.head_count": _int(1, 1 << 12),
    "attention.head_count_kv": _int(1, 1 << 12),
    "attention.key_length": _int(1, 1 << 14),
    "attention.value_length": _int(1, 1 << 14),
    "attention.sliding_window": _int(0, MAX_CONTEXT),
    "attention.layer_norm_rms_epsilon": _float(0.0, 1.0),
    "rope.dimension_count": _int(1, 1 << 14),
    "rope.freq_base": _float(0.0, 1e12, lo_open=True),
    "rope.scaling.type": _STR,
    "rope.scaling.factor": _float(0.0, 1e6, lo_open=True),
    "rope.scaling.attn_factor": _float(0.0, 1e3, lo_open=True),
    "rope.scaling.original_context_length": _int(1, MAX_CONTEXT),
    "final_logit_softcapping": _float(0.0, 1e6),
    "embedding_scale": _float(0.0, 1e6),
    "residual_scale": _float(0.0, 1e6),
    "attention.scale": _float(0.0, 1e6),
    "logit_scale": _float(0.0, 1e6),
    "attn_logit_softcapping": _float(0.0, 1e6),
}
# fmt: on


def _describe(v) -> str:
    if isinstance(v, np.ndarray):
        return f"an array of {v.size} {v.dtype}"
    if isinstance(v, list):
        return f"an array of {len(v)} strings"
    return f"{type(v).__name__} {v!r:.60}"


def _check(key: str, v, rule: tuple[str, Callable]) -> None:
    what, ok = rule
    if not ok(v):
        raise ModelFileError(f"metadata key {key} is {_describe(v)}, expected {what}")


def check_metadata(meta: dict) -> None:
    """Types and ranges of the metadata keys edgekv reads (see the module docstring)."""
    for key, rule in GENERAL_KEYS.items():
        if key in meta:
            _check(key, meta[key], rule)
    for key, v in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            _check(key, v, _TOKEN_ID)
        elif key.startswith("tokenizer.chat_template."):  # named templates (tool_use, rag, ...)
            _check(key, v, _STR)
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            if key in meta and len(meta[key]) != len(tokens):
                raise ModelFileError(f"metadata key {key} has {len(meta[key])} entries, "
                                     f"expected one per token ({len(tokens)})")


def check_arch_key(arch: str, key: str, v) -> None:
    """Type and range of the hyperparameter `key` (= "<arch>.<suffix>") as a model reads it."""
    rule = ARCH_KEYS.get(key[len(arch) + 1:]) if key.startswith(arch + ".") else None
    if rule is not None:
        _check(key, v, rule)


def validate_model(f, cfg) -> None:
    """Consistency of metadata and tensors for a built Config (llama or gemma3 family); call it
    right after cfg.validate(f). f: GGUFFile."""
    n_vocab, e = cfg.n_vocab, cfg.n_embd
    tokens = f.meta.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != n_vocab:
        raise ModelFileError(f"tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight has "
                             f"{n_vocab} rows; they must match")
    vocab_size = f.meta.get(f"{cfg.arch}.vocab_size")
    if vocab_size is not None and vocab_size != n_vocab:
        raise ModelFileError(f"metadata key {cfg.arch}.vocab_size is {vocab_size}, "
                             f"token_embd.weight has {n_vocab} rows")
    for role in STRICT_TOKEN_IDS:
        key = f"tokenizer.ggml.{role}_token_id"
        v = f.meta.get(key)
        if v is not None and not 0 <= v < n_vocab:
            raise ModelFileError(f"metadata key {key} is {v}, outside the vocabulary [0, {n_vocab})")
    rope_dim = getattr(cfg, "rope_dim", cfg.head_dim)
    if not 0 < rope_dim <= cfg.head_dim or rope_dim % 2:
        raise ModelFileError(f"metadata key {cfg.arch}.rope.dimension_count is {rope_dim}, expected an even "
                             f"number in [2, {cfg.head_dim}] (the head size)")
    if "output.weight" in f.tensors and f.tensors["output.weight"].shape != (n_vocab, e):
        raise ModelFileError(f"tensor output.weight has shape {f.tensors['output.weight'].shape}, "
                             f"expected {(n_vocab, e)}")
    qd, kvd = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    for i in range(cfg.n_layer):
        names = [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
        present = [n in f.tensors for n in names]
        if any(present) and not all(present):
            raise ModelFileError(f"layer {i} has only some of the attention biases "
                                 f"({', '.join(n for n, p in zip(names, present) if p)}); q, k and v need all three")
        for name, width in zip(names, (qd, kvd, kvd)):
            t = f.tensors.get(name)
            if t is not None and (t.shape != (width,) or t.qtype not in (0, 1)):
                raise ModelFileError(f"tensor {name} is {t.type_name} {t.shape}, expected F32 or F16 ({width},)")
    if not 1 <= cfg.n_ctx_train <= MAX_CONTEXT:
        raise ModelFileError(f"context length {cfg.n_ctx_train} is not plausible (1 to {MAX_CONTEXT})")
    # a window ring is allocated at the window's size: it must not exceed what the model was trained on
    window = getattr(cfg, "sliding_window", 0)
    if window > cfg.n_ctx_train:
        raise ModelFileError(f"metadata key {cfg.arch}.attention.sliding_window is {window}, larger than "
                             f"{cfg.arch}.context_length ({cfg.n_ctx_train})")
