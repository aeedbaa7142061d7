"""Exceptions that kvpage raises on bad input.

Each one carries a message that says what was wrong and what to do; none is
raised from deep inside a kernel after data was touched.
"""
from __future__ import annotations


class KVPageError(Exception):
    """Base class of every kvpage-specific error."""


class KVCacheLayoutError(KVPageError, TypeError):
    """A cache tensor handed in disagrees with the layer's :class:`~kvpage.spec.LayerSpec`.

    Raised before any data is read or written. The message names the layer, the
    tensor, the expected and the actual dtype/shape.
    """


class UnknownKVFormatError(KVPageError, ValueError):
    """A ``kv_cache_dtype`` name that no registered format or alias matches."""


class OutOfBlocksError(KVPageError, RuntimeError):
    """The block pool has fewer free blocks than a request needs."""


class PromptTooLongError(KVPageError, ValueError):
    """A prompt (plus its requested output) cannot fit in the KV cache or the model's context."""
