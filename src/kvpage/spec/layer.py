"""``LayerSpec``: the layout of one attention layer's cache, per block, and the format object that writes and reads it.

Imports only :mod:`kvpage.formats` and :mod:`kvpage.errors`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from kvpage.errors import KVCacheLayoutError, StaticScalesError
from kvpage.formats import KVFormat, LayerScales, StaticScaleFormat, TensorSpec, get_format


@dataclass(frozen=True, init=False)
class LayerSpec:
    """Layout of one attention layer's cache, per block, and the format object that writes and reads it.

    Args:
        kv_heads: key/value heads (GQA: fewer than query heads).
        head_dim: channels per head.
        block_size: tokens per block.
        format: the :class:`~kvpage.formats.KVFormat`, or a name/alias resolved by
            :func:`~kvpage.formats.get_format` (``auto`` means float32 here; resolve it
            against the model dtype first, as :meth:`CacheSpec.build` does).
        has_value: ``False`` for a key-only (latent) layer.

    Attributes:
        format: the format instance. For static-scale formats (``int8_static``,
            ``fp8_static``) it is bound to this layer's calibrated scales in the
            :class:`LayerSpec` of :meth:`CacheSpec.layer`; a group's shared one is unbound.

    Raises:
        ValueError: a non-positive size.
        UnknownKVFormatError: an unknown format name.
        StaticScalesError: bound static scales whose shapes do not fit ``kv_heads``/``head_dim``.
    """

    kv_heads: int
    head_dim: int
    block_size: int
    format: KVFormat
    has_value: bool = True

    def __init__(
        self, kv_heads: int, head_dim: int, block_size: int, format: KVFormat | str, has_value: bool = True
    ) -> None:
        for name, v in (("kv_heads", kv_heads), ("head_dim", head_dim), ("block_size", block_size)):
            if int(v) <= 0:
                raise ValueError(f"LayerSpec.{name} must be positive, got {v}")
        fmt = get_format(format) if isinstance(format, str) else format
        object.__setattr__(self, "kv_heads", kv_heads)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "has_value", has_value)
        if isinstance(fmt, StaticScaleFormat) and fmt.scales is not None:
            want = fmt.static_scale_shape(kv_heads, head_dim)
            got = [fmt.scales.key] + ([fmt.scales.value] if has_value else [])
            if any(t is None or tuple(t.shape) != want for t in got):
                raise StaticScalesError(
                    f"static scales of shape {[None if t is None else list(t.shape) for t in got]} do not fit "
                    f"{fmt.name} with kv_heads {kv_heads}, head_dim {head_dim} (expected {list(want)})"
                )

    @property
    def kv_format(self) -> str:
        """Canonical format name (``format.name``), as written in specs and fingerprints."""
        return self.format.name

    @property
    def needs_static_scales(self) -> bool:
        """Whether the format quantizes with per-layer calibrated scales (``int8_static``, ``fp8_static``)."""
        return isinstance(self.format, StaticScaleFormat)

    @property
    def static_scales(self) -> LayerScales | None:
        """The calibrated K/V scales bound to this layer's static-scale format; ``None`` for other formats or unbound."""
        return self.format.scales if isinstance(self.format, StaticScaleFormat) else None

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """Per-block tensors of this layer (``key``, ``value``, scales ...), in allocation order."""
        return self.format.tensor_specs(
            block_size=self.block_size, kv_heads=self.kv_heads, head_dim=self.head_dim, has_value=self.has_value
        )

    @cached_property
    def tensor_by_name(self) -> dict[str, TensorSpec]:
        """The same tensors keyed by name."""
        return {t.name: t for t in self.tensors}

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of this layer, scales and zero points included."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def bits_per_value(self) -> float:
        """Stored bits per cached key or value element, everything counted."""
        values = (2 if self.has_value else 1) * self.block_size * self.kv_heads * self.head_dim
        return 8 * self.bytes_per_block / values

    def validate(self, tensors: Mapping[str, torch.Tensor], *, layer_index: int, num_blocks: int | None = None) -> None:
        """Check a layer's cache tensors against this spec before any data is touched.

        Args:
            tensors: name -> ``[num_blocks, *per_block_shape]`` tensor.
            layer_index: global layer index, for the message.
            num_blocks: if given, the leading dim every tensor must have.

        Raises:
            KVCacheLayoutError: a tensor is missing, unexpected, or has another
                dtype or per-block shape; the message names the layer, the
                tensor, the expected and the actual dtype/shape.
        """
        expected = self.tensor_by_name
        missing = [n for n in expected if n not in tensors]
        extra = [n for n in tensors if n not in expected]
        if missing or extra:
            raise KVCacheLayoutError(
                f"layer {layer_index}: cache tensors {sorted(tensors)} do not match the spec "
                f"({self.kv_format}: expected {list(expected)}; missing {missing}, unexpected {extra})"
            )
        lead = None
        for name, t in expected.items():
            actual = tensors[name]
            if actual.dtype != t.dtype or tuple(actual.shape[1:]) != t.shape or actual.dim() != len(t.shape) + 1:
                raise KVCacheLayoutError(
                    f"layer {layer_index}: cache tensor {name!r} expected dtype {t.dtype} shape "
                    f"[num_blocks, {', '.join(map(str, t.shape))}] (format {self.kv_format}), "
                    f"got dtype {actual.dtype} shape {list(actual.shape)}"
                )
            n = actual.shape[0]
            if (num_blocks is not None and n != num_blocks) or (lead is not None and n != lead):
                raise KVCacheLayoutError(
                    f"layer {layer_index}: cache tensor {name!r} has {n} blocks, expected "
                    f"{num_blocks if num_blocks is not None else lead}"
                )
            lead = n

    def describe(self) -> dict[str, Any]:
        """JSON-able description (used by the fingerprint and by stored-record metadata)."""
        return {
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "format": self.kv_format,
            "format_version": self.format.version,
            "has_value": self.has_value,
            "tensors": [[t.name, list(t.shape), str(t.dtype).removeprefix("torch.")] for t in self.tensors],
            **({"static_scales_sha256": self.static_scales.sha256} if self.static_scales is not None else {}),
        }
