"""The layout of a KV cache: :class:`CacheSpec` (layer groups of :class:`LayerSpec`), and each group's kind.

Modules: :mod:`.layer` (:class:`LayerSpec`: one layer's tensors per block and its format object),
:mod:`.kinds` (what kind of cache a layer group keeps and its memory arithmetic), :mod:`.cache_spec`
(:class:`LayerGroupSpec`, :class:`CacheSpec` and its fingerprint). The spec imports only
:mod:`kvpage.formats`, :mod:`kvpage.scales` and :mod:`kvpage.errors`; everything above derives from it.
"""
from kvpage.spec.cache_spec import SPEC_VERSION, CacheSpec, LayerGroupSpec, format_group_name, missing_scales_error
from kvpage.spec.kinds import (
    CacheSizing,
    FullAttention,
    GroupKind,
    GroupMemory,
    Sealed,
    SealedWindow,
    SlidingWindow,
    TailLayout,
    blocks_per_slot,
    kind_of,
    sink_rows,
    sinks_per_group,
    tail_dtype,
)
from kvpage.spec.layer import LayerSpec

__all__ = ["SPEC_VERSION", "CacheSizing", "CacheSpec", "FullAttention", "GroupKind", "GroupMemory", "LayerGroupSpec",
           "LayerSpec", "Sealed", "SealedWindow", "SlidingWindow", "TailLayout", "blocks_per_slot", "kind_of",
           "format_group_name", "missing_scales_error", "sink_rows", "sinks_per_group", "tail_dtype"]
