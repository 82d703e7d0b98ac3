"""edgekv: quantized GGUF LLM inference on numpy + numba, with an INT8/INT4 ring-buffer KV cache.

    import edgekv
    llm = edgekv.load("smollm2-135m-instruct")
    print(llm.complete("The capital of France is", max_tokens=16))
"""
__version__ = "0.1.0"

from .errors import (  # noqa: E402
    ContextError,
    DeviceError,
    DownloadError,
    EdgekvError,
    ModelFileError,
    ModelNotFoundError,
    PromptCacheError,
    SessionFileError,
    TemplateError,
    UnsupportedModelError,
)
from .evict import EVICT_POLICIES  # noqa: E402
from .llm import LLM, load  # noqa: E402
from .session import ChatSession  # noqa: E402

__all__ = [
    "LLM", "load", "ChatSession", "EVICT_POLICIES", "EdgekvError", "ModelFileError", "UnsupportedModelError", "ModelNotFoundError",
    "DownloadError", "TemplateError", "SessionFileError", "PromptCacheError", "ContextError", "DeviceError", "__version__",
]
