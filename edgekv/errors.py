"""The exceptions users see. Every failure a user can cause (a bad file, a bad name, a bad
argument) surfaces as one of these, with a one-line message naming what was wrong."""


class EdgekvError(Exception):
    """Base class of every error edgekv raises on purpose."""


class ModelFileError(EdgekvError):
    """The file is not a valid GGUF, is truncated, or its contents are inconsistent."""


class UnsupportedModelError(EdgekvError):
    """A valid GGUF that uses an architecture, tokenizer or tensor type edgekv cannot run."""


class ModelNotFoundError(EdgekvError):
    """Neither a known model name nor an existing .gguf path."""


class DownloadError(EdgekvError):
    """Fetching or assembling a model failed (network, checksum, disk)."""


class TemplateError(EdgekvError):
    """The chat template is invalid, unsafe, too slow or raised an exception."""


class SessionFileError(EdgekvError):
    """A saved session file is corrupt, truncated, from another model or another version."""


class PromptCacheError(EdgekvError):
    """A prompt-cache file is corrupt, truncated or from another model (it is ignored, with a warning)."""


class ContextError(EdgekvError):
    """A request does not fit the context (or cannot be served by the cache)."""


class DeviceError(EdgekvError):
    """The requested device (e.g. cuda) is not usable here."""
