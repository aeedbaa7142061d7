"""``CacheSpec``: the one description of a KV cache's memory layout.

Every cache tensor kvpage allocates -- main layers, draft/MTP layers, host
blocks, stored blocks -- takes its shape and dtype from a :class:`CacheSpec`,
and the attention op checks what it is handed against the same spec. This is
what makes FastDeploy's bug (PR 7757: an int8/fp8 cache allocated in the
model's bfloat16 and the attention op crashing on a dtype mismatch)
impossible here: there is no second place that picks a dtype.

A spec is a list of *layer groups* (``main``, then optionally one ``main@<format>``
per format of per-layer precision, ``sliding`` and ``draft``); all layers in a group share one :class:`LayerSpec` and one *kind*
(:mod:`kvpage.spec.kinds`: full attention, sliding window, quantize-on-seal,
sealed-in-window), which owns the group's memory arithmetic. Groups may
differ: draft layers in bfloat16 beside fp8 main layers (vLLM
``speculative_config.kv_cache_dtype``), or a key-only layer (MLA latent cache)
with no value tensor. All groups share one block table and ``block_size``.

Static-scale formats (``int8_static``, ``fp8_static``) quantize with per-layer
calibrated scales (:mod:`kvpage.scales`). Those are part of the layout: a
:class:`CacheSpec` of such a format cannot be built without a checked scale for
every one of its layers (main and draft), :meth:`CacheSpec.layer` hands each
layer a :class:`LayerSpec` whose format object is bound to its own scales
(:meth:`~kvpage.formats.StaticScaleFormat.bind`; the attention op codes with
it), they outlive any (re-)allocation of the pool, and the fingerprint covers
their SHA-256.

Imports only :mod:`kvpage.formats`, :mod:`kvpage.scales`, :mod:`kvpage.errors` and the rest of :mod:`kvpage.spec`.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from kvpage.errors import StaticScalesError, UnknownKVFormatError
from kvpage.formats import KVFormat, StaticScaleFormat, get_format
from kvpage.scales import StaticScales
from kvpage.spec.kinds import GroupKind, kind_of
from kvpage.spec.layer import LayerSpec

#: Bumped when the meaning of a spec field changes; part of every fingerprint.
SPEC_VERSION = 1


@dataclass(frozen=True)
class LayerGroupSpec:
    """Layers that share one :class:`LayerSpec` and one kind of attention.

    Attributes:
        name: ``"main"`` (the model's full-attention layers, or all of them), ``"main@<format>"`` (those of
            them that ``kv_layer_dtypes`` gives another format, one group per format), ``"sliding"`` (its
            sliding-window layers beside full-attention ones: Gemma 2/3's local layers) or ``"draft"``
            (draft/MTP layers).
        first_layer: global index of the group's first layer.
        num_layers: layers in the group.
        layer: their common layout.
        sliding_window: each query reads only the last ``sliding_window`` positions (itself included);
            ``None`` = full attention. A windowed group's manager may drop blocks that slid out.
        layers: the group's global layer indices when they are not consecutive (Gemma 3 interleaves
            five local layers with each global one); ``None`` = ``first_layer .. first_layer + num_layers - 1``.
        kind: derived from the name, the format and the window (:func:`~kvpage.spec.kinds.kind_of`): what kind of
            cache the group keeps and its memory arithmetic. Not part of equality (it follows from the rest).

    Raises:
        ValueError: ``layers`` not strictly increasing, or disagreeing with ``first_layer``/``num_layers``;
            a non-positive ``sliding_window``.
    """

    name: str
    first_layer: int
    num_layers: int
    layer: LayerSpec
    sliding_window: int | None = None
    layers: tuple[int, ...] | None = None
    kind: GroupKind = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kind_of(self.name, self.layer, self.sliding_window))
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"group {self.name!r}: sliding_window must be positive, got {self.sliding_window}")
        if self.layers is not None:
            ls = tuple(int(i) for i in self.layers)
            if (not ls or list(ls) != sorted(set(ls)) or ls[0] != self.first_layer
                    or len(ls) != self.num_layers):
                raise ValueError(f"group {self.name!r}: layers {list(ls)} must be strictly increasing, start at "
                                 f"first_layer {self.first_layer} and number num_layers {self.num_layers}")
            object.__setattr__(self, "layers", None if ls == tuple(range(ls[0], ls[0] + len(ls))) else ls)

    @property
    def layer_indices(self) -> Sequence[int]:
        """Global indices of the group's layers, increasing."""
        if self.layers is not None:
            return self.layers
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers of the group."""
        return self.num_layers * self.layer.bytes_per_block


def missing_scales_error(format_name: str, layer_index: int = 0, group: str = "main") -> StaticScalesError:
    """The error of a static-scale format given no calibrated scales (names the layer, the tensor and the fixes)."""
    return StaticScalesError(
        f"layer {layer_index} ({group} group): format {format_name} needs calibrated static scales "
        f"(tensor 'layers.{layer_index}.k_absmax'), but none were given. Pass kv_cache_scales=FILE, a "
        f"safetensors file made by `kvpage calibrate --text FILE --out FILE` (from Python a StaticScales object "
        f"too, CacheSpec.build's static_scales); kvpage never uses a default scale of 1.0"
    )


def format_group_name(fmt: KVFormat) -> str:
    """The name of the group of full-attention layers that ``kv_layer_dtypes`` gives format ``fmt``:
    ``main@<format>`` (e.g. ``main@int4_rotated``)."""
    return f"main@{fmt.name}"


def _split_formats(groups: list[LayerGroupSpec],
                   layer_formats: Mapping[int, KVFormat] | None) -> list[LayerGroupSpec]:
    """``groups`` with the layers of ``main`` that ``layer_formats`` gives another format moved to groups of their
    own, one per distinct format (``main@<format>``, ordered by first layer, right after ``main``).

    Raises:
        ValueError: a mapped layer outside ``main`` (a sliding-window layer), or every layer of ``main`` mapped.
    """
    if not layer_formats:
        return groups
    main = groups[0]
    if main.sliding_window is not None:
        raise ValueError("kv_layer_dtypes: this model's full-attention layers are all windowed; per-layer formats "
                         "apply to full-attention layers only")
    in_main = set(main.layer_indices)
    outside = sorted(i for i in layer_formats if i not in in_main)
    if outside:
        raise ValueError(f"kv_layer_dtypes: layer(s) {outside} are sliding-window layers; per-layer formats apply "
                         f"to the model's full-attention layers only ({sorted(in_main)})")
    by_fmt: dict[str, list[int]] = {}
    fmts: dict[str, KVFormat] = {}
    for i in sorted(layer_formats):
        f = layer_formats[i]
        if f.name == main.layer.format.name:
            continue  # the base format: the layer stays in main
        by_fmt.setdefault(f.name, []).append(i)
        fmts[f.name] = f
    if not by_fmt:
        return groups
    rest = [i for i in main.layer_indices if i not in layer_formats or layer_formats[i].name == main.layer.format.name]
    if not rest:
        raise ValueError(f"kv_layer_dtypes gives every layer another format than kv_cache_dtype="
                         f"{main.layer.format.name!r}; make the most common one kv_cache_dtype")
    out = [LayerGroupSpec("main", rest[0], len(rest), main.layer, layers=tuple(rest))]
    for name in sorted(by_fmt, key=lambda n: by_fmt[n][0]):
        ls = by_fmt[name]
        out.append(LayerGroupSpec(format_group_name(fmts[name]), ls[0], len(ls), replace(main.layer, format=fmts[name]),
                                  layers=tuple(ls)))
    return out + groups[1:]


def _resolve_layer_formats(layer_formats: Mapping[int, str | KVFormat] | None, num_layers: int,
                           num_draft_layers: int, model_dtype: torch.dtype) -> dict[int, KVFormat] | None:
    """``layer_formats`` with every format resolved and every layer index checked against the model's layers.

    Raises:
        UnknownKVFormatError: an unknown format name (the message names ``kv_layer_dtypes`` and the layer).
        ValueError: a layer index that is not an integer, negative, a draft layer or beyond the model's layers.
    """
    if not layer_formats:
        return None
    out: dict[int, KVFormat] = {}
    for i, f in layer_formats.items():
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"kv_layer_dtypes: layer index {i!r} is not an integer")
        if num_layers <= i < num_layers + num_draft_layers:
            raise ValueError(f"kv_layer_dtypes: layer {i} is a draft layer; draft layers take "
                             f"speculative_config.draft_kv_cache_dtype")
        if not 0 <= i < num_layers:
            raise ValueError(f"kv_layer_dtypes: layer {i} is out of range (the model has {num_layers} layers, "
                             f"0 .. {num_layers - 1})")
        if isinstance(f, KVFormat):
            out[i] = f
        else:
            try:
                out[i] = get_format(f, model_dtype)
            except UnknownKVFormatError as e:
                raise UnknownKVFormatError(f"kv_layer_dtypes: layer {i}: {e}") from None
    return out


def _model_groups(layer: LayerSpec, num_layers: int,
                  layer_windows: Sequence[int | None] | None) -> list[LayerGroupSpec]:
    """The model's layer groups: ``main`` (full attention) and ``sliding`` (windowed), as :meth:`CacheSpec.build`
    documents."""
    if layer_windows is None:
        return [LayerGroupSpec("main", 0, num_layers, layer)]
    windows = list(layer_windows)
    if len(windows) != num_layers:
        raise ValueError(f"layer_windows has {len(windows)} entries for {num_layers} layers")
    sizes = sorted({w for w in windows if w is not None})
    if len(sizes) > 1:
        raise ValueError(f"layers with different sliding windows {sizes} are not supported (one window per model)")
    full = [i for i, w in enumerate(windows) if w is None]
    slid = [i for i, w in enumerate(windows) if w is not None]
    if not slid:
        return [LayerGroupSpec("main", 0, num_layers, layer)]
    if not full:
        return [LayerGroupSpec("main", 0, num_layers, layer, sliding_window=sizes[0])]
    return [LayerGroupSpec("main", full[0], len(full), layer, layers=tuple(full)),
            LayerGroupSpec("sliding", slid[0], len(slid), layer, sliding_window=sizes[0], layers=tuple(slid))]


@dataclass(frozen=True)
class CacheSpec:
    """Layout of a whole KV cache: layer groups sharing one block table.

    Build it with :meth:`build`; everything else is derived.

    Attributes:
        groups: ``main`` first, then ``main@<format>`` groups, ``sliding`` and ``draft`` if any; together they hold global layers
            ``0 .. num_layers - 1``, each once (draft layers after the model's).
        block_size: tokens per block (same for every group).
        model_name: identifies the model in the fingerprint (e.g. file name).
        static_scales: per-layer calibrated scales for groups in a static-scale
            format; required (for every layer of such groups) exactly then, and
            dropped (``None``) when no group uses them.

    Raises:
        StaticScalesError: a static-scale group's layer has no scale, or a mis-shaped,
            non-finite or non-positive one (names the layer and the tensor).
    """

    groups: tuple[LayerGroupSpec, ...]
    block_size: int
    model_name: str = ""
    static_scales: StaticScales | None = field(default=None, repr=False)
    _by_layer: dict[int, LayerGroupSpec] = field(init=False, repr=False, compare=False)
    _layer_specs: dict[int, LayerSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a CacheSpec needs at least one layer group")
        by_layer: dict[int, LayerGroupSpec] = {}
        for g in self.groups:
            if g.layer.block_size != self.block_size:
                raise ValueError(f"group {g.name!r} has block_size {g.layer.block_size}, spec has {self.block_size}")
            for i in g.layer_indices:
                if i in by_layer:
                    raise ValueError(f"layer {i} is in groups {by_layer[i].name!r} and {g.name!r}")
                by_layer[i] = g
        if sorted(by_layer) != list(range(len(by_layer))):
            raise ValueError(f"the groups' layers {sorted(by_layer)} must be 0 .. {len(by_layer) - 1}, each once")
        object.__setattr__(self, "_by_layer", by_layer)
        # Static-scale groups: one LayerSpec per layer, with that layer's checked scales bound.
        layer_specs: dict[int, LayerSpec] = {}
        for g in self.groups:
            fmt = g.layer.format
            if not isinstance(fmt, StaticScaleFormat):
                continue
            for i in g.layer_indices:
                if self.static_scales is None:
                    raise missing_scales_error(fmt.name, i, g.name)
                scales = self.static_scales.resolve(
                    fmt, layer_index=i, kv_heads=g.layer.kv_heads, head_dim=g.layer.head_dim,
                    has_value=g.layer.has_value, group=g.name,
                )
                layer_specs[i] = replace(g.layer, format=fmt.bind(scales))
        if not layer_specs:
            object.__setattr__(self, "static_scales", None)  # unused scales must not change equality or fingerprint
        object.__setattr__(self, "_layer_specs", layer_specs)

    @classmethod
    def build(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model_dtype: torch.dtype = torch.float32,
        block_size: int = 16,
        kv_cache_dtype: str | KVFormat = "auto",
        num_draft_layers: int = 0,
        draft_kv_cache_dtype: str | KVFormat | None = None,
        draft_num_kv_heads: int | None = None,
        draft_head_dim: int | None = None,
        has_value: bool = True,
        model_name: str = "",
        static_scales: StaticScales | str | Path | None = None,
        layer_windows: Sequence[int | None] | None = None,
        layer_formats: Mapping[int, str | KVFormat] | None = None,
    ) -> CacheSpec:
        """Spec for ``num_layers`` model layers and ``num_draft_layers`` draft/MTP layers.

        Args:
            kv_cache_dtype: the main layers' format: a name or alias, or the format object itself
                (the engine resolves it once, in :class:`~kvpage.engine.config.EngineConfig`).
            draft_kv_cache_dtype: the draft layers' format (name or object); default the main one.
            draft_num_kv_heads, draft_head_dim: the draft layers' KV shape when the draft model's differs
                (a separate draft checkpoint); default the main layers'.
            static_scales: calibrated K/V scales (or a scales file path) for
                ``int8_static`` / ``fp8_static`` groups, keyed by global layer
                index (draft layers follow the main ones); ignored by other formats.
            layer_windows: per model layer, its sliding window in tokens or ``None`` for full attention
                (the model family's ``attention_params``). Full-attention layers form ``main`` and windowed
                ones ``sliding`` (same format; an all-windowed model has one windowed ``main`` group).
            layer_formats: per-layer precision (``kv_layer_dtypes``): model layer index -> format (name or object)
                for full-attention layers that take another format than ``kv_cache_dtype``. Each distinct format's
                layers form one group ``main@<format>`` beside ``main`` (sharing the block table, as ``sliding``
                does); layers mapped to the main format stay in ``main``. ``None`` or empty: the spec (and its
                fingerprint) is exactly that of no map.

        Raises:
            UnknownKVFormatError: unknown ``kv_cache_dtype`` / ``draft_kv_cache_dtype``.
            ValueError: non-positive sizes, negative draft layer count, ``layer_windows`` of another length
                than ``num_layers`` or with more than one window size; a ``layer_formats`` layer out of range, a
                draft layer, a sliding-window layer, or a map that leaves ``main`` no layer (the message names
                ``kv_layer_dtypes``).
            StaticScalesError: a static-scale format without a valid scale for one of its layers.
            FileNotFoundError: ``static_scales`` names no file.
        """
        if num_layers <= 0 or num_draft_layers < 0:
            raise ValueError(f"need num_layers > 0 and num_draft_layers >= 0, got {num_layers}, {num_draft_layers}")
        main_fmt = kv_cache_dtype if isinstance(kv_cache_dtype, KVFormat) else get_format(kv_cache_dtype, model_dtype)
        main = LayerSpec(num_kv_heads, head_dim, block_size, main_fmt, has_value)
        groups = _split_formats(_model_groups(main, num_layers, layer_windows),
                                _resolve_layer_formats(layer_formats, num_layers, num_draft_layers, model_dtype))
        if num_draft_layers:
            if isinstance(draft_kv_cache_dtype, KVFormat):
                draft_fmt = draft_kv_cache_dtype
            else:
                draft_fmt = get_format(draft_kv_cache_dtype, model_dtype) if draft_kv_cache_dtype else main_fmt
            draft = LayerSpec(num_kv_heads if draft_num_kv_heads is None else draft_num_kv_heads,
                              head_dim if draft_head_dim is None else draft_head_dim, block_size, draft_fmt, has_value)
            groups.append(LayerGroupSpec("draft", num_layers, num_draft_layers, draft))
        scales = None if static_scales is None else StaticScales.coerce(static_scales)
        return cls(tuple(groups), block_size, model_name, scales)

    # -- derived layout ------------------------------------------------------------------
    @property
    def sliding(self) -> LayerGroupSpec | None:
        """The sliding-window layers beside full-attention ones (group ``sliding``), or ``None``."""
        return next((g for g in self.groups if g.name == "sliding"), None)

    @property
    def model_groups(self) -> tuple[LayerGroupSpec, ...]:
        """The groups of the model's own layers (``main`` and ``sliding``), without draft layers."""
        return tuple(g for g in self.groups if g.name != "draft")

    @property
    def main(self) -> LayerGroupSpec:
        """The main model's layer group."""
        return self.groups[0]

    @property
    def format_groups(self) -> tuple[LayerGroupSpec, ...]:
        """The ``main@<format>`` groups of per-layer precision (``kv_layer_dtypes``), by first layer; ``()``
        without a map."""
        return tuple(g for g in self.groups if g.name.startswith("main@"))

    @property
    def format_label(self) -> str:
        """The model layers' format(s) in one string: the main format's name, followed by the per-layer map in
        ``kv_layer_dtypes``' spelling in brackets when there is one
        (``int3_rotated[8,17:int4_rotated;11:int2_rotated]``).
        The label of capacity lines and eval rows; no side effects."""
        base = self.main.layer.kv_format
        extra = self.format_groups
        if not extra:
            return base
        return base + "[" + ";".join(f"{','.join(map(str, g.layer_indices))}:{g.layer.kv_format}" for g in extra) + "]"

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
        """The :class:`LayerSpec` of global layer ``index`` (with its own static scales bound, for static formats).

        Raises:
            IndexError: no such layer.
        """
        try:
            return self._layer_specs.get(index) or self._by_layer[index].layer
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
                {"name": g.name, "first_layer": g.first_layer, "num_layers": g.num_layers, **g.layer.describe(),
                 **self._static_scales_digest(g),
                 **({"layers": list(g.layers)} if g.layers is not None else {}),
                 **({"sliding_window": g.sliding_window} if g.sliding_window is not None else {})}
                for g in self.groups
            ],
        }

    def _static_scales_digest(self, group: LayerGroupSpec) -> dict[str, str]:
        """``{"static_scales_sha256": ...}`` over the group's per-layer scale digests; ``{}`` without static scales."""
        if not self._layer_specs or group.first_layer not in self._layer_specs:
            return {}
        h = hashlib.sha256()
        for i in group.layer_indices:
            scales = self._layer_specs[i].static_scales
            assert scales is not None
            h.update(f"{i}:{scales.sha256};".encode())
        return {"static_scales_sha256": h.hexdigest()}

    @cached_property
    def fingerprint(self) -> str:
        """Stable SHA-256 hex digest of :meth:`describe` (same in every process and machine).

        Two specs share a fingerprint exactly when their stored bytes mean the
        same thing, so stores keyed by it never mix layouts -- nor blocks of a
        static-scale format quantized with different calibrated scales.
        """
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()
