"""Registry of KV-cache formats (the values ``kv_cache_dtype`` takes).

====================  ==========================================  ============================
name                  aliases                                     bits/value (head_dim 64)
====================  ==========================================  ============================
``auto``              model dtype                                 16 or 32
``float32``           ``fp32``, ``float``                         32
``bfloat16``          ``bf16``                                    16
``float16``           ``fp16``, ``half``                          16
``int8``              ``int8_per_token_head`` (vLLM semantics)    8.25
``fp8``               ``fp8_e4m3``, ``float8_e4m3fn`` (rotated)   8.25
``int8_rotated``      Hadamard-rotated int8 rows                  8.25
``fp8_per_token_head`` ``block_wise_fp8`` (FastDeploy): plain e4m3 8.25
``int8_static``       ``cache_int8`` (static per-channel scales)  8
``fp8_static``        ``fp8_per_tensor`` (static per-tensor)      8
``int4``              ``int4_zp``, ``int4_kivi``, ``kivi4``       4.38 (+ tail, sink)
``int3``              ``int3_zp``, ``int3_kivi``, ``kivi3``       3.38 (+ tail, sink)
``int2``              ``int2_zp``, ``int2_kivi``, ``kivi2``       2.38 (+ tail, window, sink)
``int4_rotated``      ``int4`` of Hadamard-rotated rows           4.38 (+ tail, sink)
``int3_rotated``      ``int3`` of Hadamard-rotated rows           3.38 (+ tail, sink)
``int2_rotated``      ``int2`` of Hadamard-rotated rows           2.38 (+ tail, window, sink)
====================  ==========================================  ============================

:func:`get_format` resolves any accepted spelling (case-insensitive) to a
format instance; an unknown name raises
:class:`~kvpage.errors.UnknownKVFormatError` listing the valid names.

Every format is a :class:`KVFormat` (layout) and exactly one of
:class:`TokenFormat` (rows coded when written: float, ``int8``/``fp8`` and the
static-scale formats, whose calibrated scales are bound to the instance with
:meth:`StaticScaleFormat.bind`) or :class:`BlockFormat` (blocks coded whole when
they fill: ``int4``, ``int3``, ``int2`` and their ``_rotated`` variants). This package imports only :mod:`kvpage.errors`.
"""
from __future__ import annotations

import torch

from kvpage.errors import UnknownKVFormatError
from kvpage.formats.base import (
    KEY,
    KEY_SCALE,
    VALUE,
    VALUE_SCALE,
    BlockFormat,
    KVFormat,
    QuantizedRows,
    TensorSpec,
    TokenFormat,
)
from kvpage.formats.dtype import FLOAT_ALIASES, FLOAT_DTYPES, FloatFormat
from kvpage.formats.kivi import KEY_ZERO, VALUE_ZERO, Int2Format, Int3Format, Int4Format, SealedFormat
from kvpage.formats.kivi_rotated import Int2RotatedFormat, Int3RotatedFormat, Int4RotatedFormat, RotatedSealedFormat
from kvpage.formats.per_token import Fp8Format, Fp8PerTokenHeadFormat, Int8Format, Int8RotatedFormat
from kvpage.formats.static import (
    Fp8StaticFormat,
    Int8StaticFormat,
    LayerScales,
    StaticScaleFormat,
    needs_static_scales,
)

#: Quantized formats by canonical name; :func:`register_format` adds more.
_QUANTIZED: dict[str, type[KVFormat]] = {}
#: alias -> canonical name, for quantized formats.
_ALIASES: dict[str, str] = {}


def register_format(cls: type[KVFormat]) -> type[KVFormat]:
    """Register a quantized format class under its ``name`` and ``aliases`` (usable as a decorator).

    Raises:
        ValueError: the name or an alias is already taken.
    """
    for key in (cls.name, *cls.aliases):
        key = key.lower()
        if key in _QUANTIZED or key in _ALIASES or key in FLOAT_DTYPES or key in FLOAT_ALIASES or key == "auto":
            raise ValueError(f"KV format name {key!r} is already registered")
    _QUANTIZED[cls.name.lower()] = cls
    for alias in cls.aliases:
        _ALIASES[alias.lower()] = cls.name.lower()
    return cls


register_format(Int8Format)
register_format(Fp8Format)
register_format(Int8RotatedFormat)
register_format(Fp8PerTokenHeadFormat)
register_format(Int8StaticFormat)
register_format(Fp8StaticFormat)
register_format(Int4Format)
register_format(Int3Format)
register_format(Int2Format)
register_format(Int4RotatedFormat)
register_format(Int3RotatedFormat)
register_format(Int2RotatedFormat)


def available_formats() -> list[str]:
    """Canonical format names, ``auto`` first, then unquantized, then quantized."""
    return ["auto", *FLOAT_DTYPES, *_QUANTIZED]


def format_aliases() -> dict[str, str]:
    """Every accepted alias mapped to its canonical name."""
    return {**FLOAT_ALIASES, **_ALIASES}


def canonical_format_name(name: str, model_dtype: torch.dtype) -> str:
    """Resolve a ``kv_cache_dtype`` spelling to its canonical name.

    ``auto`` resolves to the model dtype's name (``float32``, ``bfloat16`` or
    ``float16``). Matching is case-insensitive.

    Raises:
        UnknownKVFormatError: no format or alias has that name; the message lists them.
    """
    key = str(name).strip().lower()
    if key == "auto":
        for canon, dt in FLOAT_DTYPES.items():
            if dt == model_dtype:
                return canon
        raise UnknownKVFormatError(f"kv_cache_dtype 'auto' needs a float model dtype, got {model_dtype}")
    key = FLOAT_ALIASES.get(key, _ALIASES.get(key, key))
    if key in FLOAT_DTYPES or key in _QUANTIZED:
        return key
    aliases = ", ".join(f"{a} -> {c}" for a, c in sorted(format_aliases().items()))
    raise UnknownKVFormatError(
        f"unknown kv_cache_dtype {name!r}; valid names: {', '.join(available_formats())} "
        f"(aliases: {aliases})"
    )


def get_format(name: str, model_dtype: torch.dtype = torch.float32) -> KVFormat:
    """The format instance for a ``kv_cache_dtype`` spelling (see :func:`canonical_format_name`).

    Raises:
        UnknownKVFormatError: unknown name.
    """
    canon = canonical_format_name(name, model_dtype)
    if canon in FLOAT_DTYPES:
        return FloatFormat(FLOAT_DTYPES[canon])
    return _QUANTIZED[canon]()


__all__ = [
    "KEY",
    "KEY_SCALE",
    "VALUE",
    "VALUE_SCALE",
    "Fp8Format",
    "Fp8PerTokenHeadFormat",
    "Int8RotatedFormat",
    "FloatFormat",
    "Fp8StaticFormat",
    "Int8StaticFormat",
    "StaticScaleFormat",
    "needs_static_scales",
    "Int8Format",
    "Int4Format",
    "Int2Format",
    "Int3Format",
    "Int4RotatedFormat",
    "Int3RotatedFormat",
    "Int2RotatedFormat",
    "RotatedSealedFormat",
    "SealedFormat",
    "KEY_ZERO",
    "VALUE_ZERO",
    "BlockFormat",
    "KVFormat",
    "LayerScales",
    "QuantizedRows",
    "TensorSpec",
    "TokenFormat",
    "available_formats",
    "canonical_format_name",
    "format_aliases",
    "get_format",
    "register_format",
]
