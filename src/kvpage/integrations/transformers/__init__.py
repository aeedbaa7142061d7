"""kvpage's KV formats as a Hugging Face transformers ``Cache``: :class:`KVPageCache`.

::

    from kvpage.integrations.transformers import KVPageCache

    cache = KVPageCache(model.config, kv_cache_dtype="int4")
    out = model.generate(**inputs, max_new_tokens=64, cache=cache)   # past_key_values=cache before transformers 5.2x

Every kvpage format (:func:`kvpage.formats.available_formats`) works: float, per-token ``int8``/``fp8``
(plain and rotated), the static-scale ``int8_static``/``fp8_static`` with calibrated scales
(``kv_cache_scales=``: a ``kvpage calibrate`` file or :func:`calibrate_static_scales`), and the
quantize-on-seal ``int4``/``int2`` with their full-precision open block, window and 8-bit first block. Greedy
and sampled generation, batches with left padding, beam search (``reorder_cache``), assisted generation and
prompt lookup (``crop``), and models with sliding-window layers (Mistral, Gemma 2/3, Qwen3 with
``use_sliding_window``) are supported.

Supported transformers: :data:`SUPPORTED_TRANSFORMERS` (checked on import: an
:class:`UnsupportedTransformersError` otherwise). Importing this package imports transformers and kvpage's
formats, spec, ops and tail helpers, never kvpage's engine or server.
"""
from __future__ import annotations

from kvpage.integrations.transformers.layout import (
    SUPPORTED_LAYER_TYPES,
    SUPPORTED_TRANSFORMERS,
    ModelLayout,
    UnsupportedModelError,
    UnsupportedTransformersError,
    check_transformers_version,
    model_layout,
)

check_transformers_version()

from kvpage.integrations.transformers.cache import KVMemory, KVPageCache  # noqa: E402
from kvpage.integrations.transformers.calibrate import calibrate_static_scales  # noqa: E402
from kvpage.integrations.transformers.layer import KVPageLayer  # noqa: E402
from kvpage.integrations.transformers.sealed import SealedKVPageLayer  # noqa: E402

__all__ = [
    "SUPPORTED_LAYER_TYPES",
    "SUPPORTED_TRANSFORMERS",
    "KVMemory",
    "KVPageCache",
    "KVPageLayer",
    "ModelLayout",
    "SealedKVPageLayer",
    "UnsupportedModelError",
    "UnsupportedTransformersError",
    "calibrate_static_scales",
    "check_transformers_version",
    "model_layout",
]
