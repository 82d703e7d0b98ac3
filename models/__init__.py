"""One file per GGUF `general.architecture`; families that share a graph share a file."""
from __future__ import annotations

from importlib import import_module

from ..errors import UnsupportedModelError

# architecture -> module in this package
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",  # llama graph + QKV bias + NeoX RoPE
    "qwen3": "qwen3",
    "granite": "llama",  # llama graph + embedding, residual, attention and logit multipliers
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",  # fused qkv and gate/up, LongRoPE
}


def model_module(arch: str):
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return import_module(f".{ARCHITECTURES[arch]}", __name__)


def build_model(f, backend, n_ctx: int | None = None):
    """The Model for an open GGUFFile, its weights prepared on `backend`. n_ctx: the context it
    will run with, for the modules whose RoPE depends on it (ROPE_BY_CONTEXT: phi3's LongRoPE
    factors); None: the trained context."""
    mod = model_module(f.arch)
    return mod.Model(f, backend, n_ctx=n_ctx) if getattr(mod, "ROPE_BY_CONTEXT", False) else mod.Model(f, backend)
