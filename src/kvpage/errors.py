"""Exceptions that kvpage raises on bad input.

Each one carries a message that says what was wrong and what to do; none is
raised from deep inside a kernel after data was touched.
"""
from __future__ import annotations


def prefix_message(err: BaseException, prefix: str) -> None:
    """Put ``prefix`` before ``err``'s message, in place (``"--formats 'int9': unknown kv_cache_dtype ..."``), so a
    boundary can say which of its inputs the error is about; type and traceback are kept. A message that is not
    ``err``'s single string argument is left alone."""
    if len(err.args) == 1 and isinstance(err.args[0], str):
        err.args = (prefix + err.args[0],)


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


class StaticScalesError(KVCacheLayoutError):
    """A static-scale format (``int8_static``, ``fp8_static``) lacks a usable calibrated scale for a layer.

    Raised when the spec is built (at load time, before anything runs): no scales
    were given, the scales have no tensor for a layer (main or draft), or a
    tensor is mis-shaped, non-finite or not positive. The message names the
    layer and the tensor. kvpage never falls back to a scale of 1.0
    (FastDeploy PR 3007, case C03).
    """
