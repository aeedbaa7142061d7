"""``CacheSpec``: the one description of a KV cache's memory layout.

Every cache tensor kvpage allocates -- main layers, draft/MTP layers, host
blocks, stored blocks -- takes its shape and dtype from a :class:`CacheSpec`,
and the attention op checks what it is handed against the same spec. This is
what makes FastDeploy's bug (PR 7757: an int8/fp8 cache allocated in the
model's bfloat16 and the attention op crashing on a dtype mismatch)
impossible here: there is no second place that picks a dtype.

A spec is a list of *layer groups* (``main``, then optionally ``draft``); all
layers in a group share one :class:`LayerSpec`. Groups may differ: draft
layers in bfloat16 beside fp8 main layers (vLLM ``speculative_config.
kv_cache_dtype``), or a key-only layer (MLA-style latent cache) with no value
tensor. All groups share one block table, so they have the same number of
blocks and ``block_size``.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from kvpage.errors import KVCacheLayoutError
from kvpage.formats import KVFormat, TensorSpec, canonical_format_name, get_format

#: Bumped when the meaning of a spec field changes; part of every fingerprint.
SPEC_VERSION = 1


@dataclass(frozen=True)
class LayerSpec:
    """Layout of one attention layer's cache, per block.

    Attributes:
        kv_heads: key/value heads (GQA: fewer than query heads).
        head_dim: channels per head.
        block_size: tokens per block.
        kv_format: canonical format name (``auto`` already resolved).
        has_value: ``False`` for a key-only (latent) layer.
    """

    kv_heads: int
    head_dim: int
    block_size: int
    kv_format: str
    has_value: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_heads", "head_dim", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"LayerSpec.{name} must be positive, got {getattr(self, name)}")

    @cached_property
    def format(self) -> KVFormat:
        """The :class:`~kvpage.formats.KVFormat` instance that reads and writes this layer."""
        return get_format(self.kv_format)

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
        }


@dataclass(frozen=True)
class LayerGroupSpec:
    """Consecutive layers that share one :class:`LayerSpec`.

    Attributes:
        name: ``"main"`` or ``"draft"`` (draft/MTP layers).
        first_layer: global index of the group's first layer.
        num_layers: layers in the group.
        layer: their common layout.
    """

    name: str
    first_layer: int
    num_layers: int
    layer: LayerSpec

    @property
    def layer_indices(self) -> range:
        """Global indices of the group's layers."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers of the group."""
        return self.num_layers * self.layer.bytes_per_block


@dataclass(frozen=True)
class CacheConfig:
    """User-facing cache settings (engine flags).

    Attributes:
        block_size: tokens per block (page).
        kv_cache_dtype: format name or alias for main layers (``auto`` = model dtype).
        draft_kv_cache_dtype: format for draft/MTP layers; ``None`` = same as main.
    """

    block_size: int = 16
    kv_cache_dtype: str = "auto"
    draft_kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if int(self.block_size) <= 0:
            raise ValueError(f"block_size must be a positive number of tokens, got {self.block_size}")


@dataclass(frozen=True)
class CacheSpec:
    """Layout of a whole KV cache: layer groups sharing one block table.

    Build it with :meth:`build` or :meth:`from_configs`; everything else is derived.

    Attributes:
        groups: ``main`` first, then ``draft`` if any; contiguous global layer indices.
        block_size: tokens per block (same for every group).
        model_name: identifies the model in the fingerprint (e.g. file name).
    """

    groups: tuple[LayerGroupSpec, ...]
    block_size: int
    model_name: str = ""
    _by_layer: dict[int, LayerGroupSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a CacheSpec needs at least one layer group")
        by_layer: dict[int, LayerGroupSpec] = {}
        expected_first = 0
        for g in self.groups:
            if g.layer.block_size != self.block_size:
                raise ValueError(f"group {g.name!r} has block_size {g.layer.block_size}, spec has {self.block_size}")
            if g.first_layer != expected_first:
                raise ValueError(f"group {g.name!r} starts at layer {g.first_layer}, expected {expected_first}")
            expected_first += g.num_layers
            for i in g.layer_indices:
                by_layer[i] = g
        object.__setattr__(self, "_by_layer", by_layer)

    @classmethod
    def build(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model_dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        num_draft_layers: int = 0,
        draft_kv_cache_dtype: str | None = None,
        has_value: bool = True,
        model_name: str = "",
    ) -> CacheSpec:
        """Spec for ``num_layers`` main layers and ``num_draft_layers`` draft/MTP layers.

        Raises:
            UnknownKVFormatError: unknown ``kv_cache_dtype`` / ``draft_kv_cache_dtype``.
            ValueError: non-positive sizes, negative draft layer count.
        """
        if num_layers <= 0 or num_draft_layers < 0:
            raise ValueError(f"need num_layers > 0 and num_draft_layers >= 0, got {num_layers}, {num_draft_layers}")
        main_fmt = canonical_format_name(kv_cache_dtype, model_dtype)
        main = LayerSpec(num_kv_heads, head_dim, block_size, main_fmt, has_value)
        groups = [LayerGroupSpec("main", 0, num_layers, main)]
        if num_draft_layers:
            draft_fmt = canonical_format_name(draft_kv_cache_dtype, model_dtype) if draft_kv_cache_dtype else main_fmt
            draft = LayerSpec(num_kv_heads, head_dim, block_size, draft_fmt, has_value)
            groups.append(LayerGroupSpec("draft", num_layers, num_draft_layers, draft))
        return cls(tuple(groups), block_size, model_name)

    @classmethod
    def from_configs(cls, model_config: Any, cache_config: CacheConfig, *, num_draft_layers: int = 0) -> CacheSpec:
        """Spec from a model config (``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``) and a :class:`CacheConfig`."""
        return cls.build(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            model_dtype=model_config.dtype,
            block_size=cache_config.block_size,
            kv_cache_dtype=cache_config.kv_cache_dtype,
            num_draft_layers=num_draft_layers,
            draft_kv_cache_dtype=cache_config.draft_kv_cache_dtype,
            model_name=getattr(model_config, "name", "") or "",
        )

    # -- derived layout ------------------------------------------------------------------
    @property
    def main(self) -> LayerGroupSpec:
        """The main model's layer group."""
        return self.groups[0]

    @property
    def draft(self) -> LayerGroupSpec | None:
        """The draft/MTP layer group, or ``None``."""
        return next((g for g in self.groups if g.name == "draft"), None)

    @property
    def num_layers(self) -> int:
        """All layers, main and draft."""
        return sum(g.num_layers for g in self.groups)

    def group(self, name: str) -> LayerGroupSpec:
        """The group called ``name``.

        Raises:
            KeyError: no such group.
        """
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"cache spec has no layer group {name!r} (groups: {[g.name for g in self.groups]})")

    def layer(self, index: int) -> LayerSpec:
        """The :class:`LayerSpec` of global layer ``index``.

        Raises:
            IndexError: no such layer.
        """
        try:
            return self._by_layer[index].layer
        except KeyError:
            raise IndexError(f"layer {index} is outside the cache spec's {self.num_layers} layers") from None

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every layer of every group, scales included."""
        return sum(g.bytes_per_block for g in self.groups)

    @property
    def bytes_per_token(self) -> float:
        """``bytes_per_block / block_size``: KV bytes one cached token costs."""
        return self.bytes_per_block / self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return math.ceil(num_tokens / self.block_size)

    def describe(self) -> dict[str, Any]:
        """JSON-able layout description: everything the fingerprint covers."""
        return {
            "spec_version": SPEC_VERSION,
            "model": self.model_name,
            "block_size": self.block_size,
            "groups": [
                {"name": g.name, "first_layer": g.first_layer, "num_layers": g.num_layers, **g.layer.describe()}
                for g in self.groups
            ],
        }

    @cached_property
    def fingerprint(self) -> str:
        """Stable SHA-256 hex digest of :meth:`describe` (same in every process and machine).

        Two specs share a fingerprint exactly when their stored bytes mean the
        same thing, so stores keyed by it never mix layouts.
        """
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()
