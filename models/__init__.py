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
}


def model_module(arch: str):
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return import_module(f".{ARCHITECTURES[arch]}", __name__)


def build_model(f, backend):
    """The Model for an open GGUFFile, its weights prepared on `backend`."""
    return model_module(f.arch).Model(f, backend)
