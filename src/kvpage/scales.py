"""Static (calibrated) K/V scales: the per-layer constants ``int8_static`` and ``fp8_static`` quantize with.

Two objects:

* :class:`StaticScales` -- what the user hands in: for each global layer index
  (main layers, then draft/MTP layers), a key and a value tensor, either
  calibrated **absolute maxima** ``[kv_heads, head_dim]`` (what ``kvpage
  calibrate`` writes; one file serves both formats) or ready **scales** (set
  programmatically, e.g. vLLM's ``k_scale = 0.02``). It is format-independent.
* :class:`~kvpage.formats.static.LayerScales` (defined beside the formats that
  use it) -- one layer's resolved scales in its format's shape (float32
  ``[kv_heads, head_dim]`` for ``int8_static``, ``[]`` for ``fp8_static``), made
  by :meth:`StaticScales.resolve`. :class:`~kvpage.spec.CacheSpec` binds them to
  that layer's format (:meth:`~kvpage.formats.StaticScaleFormat.bind`), which is
  what the attention op quantizes and dequantizes with.

Because the scales live in the spec -- not in the pool tensors -- freeing and
re-allocating the pool keeps them (vLLM issue 25800, case C12), and the spec's
fingerprint covers their SHA-256, so a store keyed by it never mixes blocks
quantized with different scales.

File layout (safetensors, float32 tensors)::

    layers.{i}.k_absmax   [kv_heads, head_dim]     (or layers.{i}.k_scale: a scale, any shape the format takes)
    layers.{i}.v_absmax   [kv_heads, head_dim]     (or layers.{i}.v_scale)

with string metadata ``kvpage_scales`` (file version), ``kind`` (``absmax`` or
``scale``), and from ``kvpage calibrate``: ``model``, ``tokens``, ``head_dim``,
``kv_heads``, ``num_layers``, ``dtype``, ``text``.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch

from kvpage.errors import StaticScalesError
from kvpage.formats.base import KEY, VALUE
from kvpage.formats.static import LayerScales, StaticScaleFormat, scales_digest

#: Version of the scales file layout (metadata ``kvpage_scales``).
SCALES_FILE_VERSION = "1"
#: ``absmax``: calibrated max |x| per (kv head, channel); ``scale``: dequantization scales as the format uses them.
ScaleKind = Literal["absmax", "scale"]
_NAME = re.compile(r"^layers\.(\d+)\.([kv])_(absmax|scale)$")


class StaticScales:
    """Per-layer static K/V scale sources, keyed by global layer index (main layers, then draft/MTP layers).

    Format-independent: :meth:`resolve` turns a layer's entry into the
    :class:`LayerScales` of a given static format (FastDeploy ``cache_int8``:
    per channel; vLLM / TensorRT-LLM fp8: per tensor). Treat it as immutable:
    equality and hashing go by :attr:`sha256`, computed when it is built.

    Args:
        key: layer index -> key tensor (``kind="absmax"``: ``[kv_heads, head_dim]``;
            ``kind="scale"``: the format's scale shape, or a 0-d/1-element tensor
            broadcast to it).
        value: layer index -> value tensor, same rules (absent for key-only layers).
        kind: ``"absmax"`` (calibrated max |x|) or ``"scale"`` (dequantization scale itself).
        metadata: free-form strings (model, tokens, ...), kept and written back by :meth:`save`.
        source: where they came from (a path), for error messages.

    Raises:
        ValueError: unknown ``kind``, a negative layer index.
    """

    def __init__(
        self,
        key: Mapping[int, torch.Tensor | float],
        value: Mapping[int, torch.Tensor | float] | None = None,
        *,
        kind: ScaleKind = "scale",
        metadata: Mapping[str, str] | None = None,
        source: str = "scales given in code",
    ) -> None:
        if kind not in ("absmax", "scale"):
            raise ValueError(f"kind must be 'absmax' or 'scale', got {kind!r}")
        as_t = lambda x: torch.as_tensor(x, dtype=torch.float32).detach().cpu().clone()  # noqa: E731
        self.key: dict[int, torch.Tensor] = {int(i): as_t(t) for i, t in key.items()}
        self.value: dict[int, torch.Tensor] = {int(i): as_t(t) for i, t in (value or {}).items()}
        if any(i < 0 for i in (*self.key, *self.value)):
            raise ValueError("layer indices of static scales must be >= 0")
        self.kind: ScaleKind = kind
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in (metadata or {}).items()}
        self.source = source
        parts: list[tuple[str, torch.Tensor | None]] = [("kind", None), (kind, None)]
        for which, d in (("k", self.key), ("v", self.value)):
            parts += [(f"{i}.{which}", d[i]) for i in sorted(d)]
        self.sha256: str = scales_digest(parts)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def uniform(
        cls, num_layers: int, k_scale: float, v_scale: float | None, *, first_layer: int = 0
    ) -> StaticScales:
        """The same ``k_scale`` / ``v_scale`` for layers ``first_layer .. first_layer + num_layers - 1``.

        vLLM's per-tensor ``k_scale``/``v_scale`` set by hand (e.g. ``k_scale=0.02``);
        for ``int8_static`` the value is broadcast to every (kv head, channel).
        ``v_scale=None`` gives key-only layers.
        """
        layers = range(first_layer, first_layer + num_layers)
        return cls({i: k_scale for i in layers}, None if v_scale is None else {i: v_scale for i in layers},
                   kind="scale", source=f"uniform k_scale={k_scale} v_scale={v_scale}")

    @classmethod
    def load(cls, path: str | Path) -> StaticScales:
        """Read a scales file (see the module docstring for its layout).

        Raises:
            FileNotFoundError: no file at ``path``.
            StaticScalesError: not a safetensors file, a tensor name that is not
                ``layers.{i}.{k,v}_{absmax,scale}``, or absmax and scale tensors mixed.
        """
        from safetensors import safe_open

        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"no KV scales file at {p} (make one with `kvpage calibrate --text FILE --out {p}`)")
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = dict(f.metadata() or {})
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise StaticScalesError(f"{p} is not a readable safetensors scales file: {e}") from e
        key: dict[int, torch.Tensor] = {}
        value: dict[int, torch.Tensor] = {}
        kinds: set[str] = set()
        for name, t in tensors.items():
            m = _NAME.match(name)
            if m is None:
                raise StaticScalesError(
                    f"{p}: unexpected tensor {name!r}; a scales file holds only layers.{{i}}.k_absmax / "
                    f"layers.{{i}}.v_absmax (or ..._scale) tensors"
                )
            kinds.add(m.group(3))
            (key if m.group(2) == "k" else value)[int(m.group(1))] = t
        if len(kinds) > 1:
            raise StaticScalesError(f"{p} mixes *_absmax and *_scale tensors; use one kind per file")
        kind: ScaleKind = "scale" if kinds == {"scale"} else "absmax"
        return cls(key, value, kind=kind, metadata=meta, source=str(p))

    @classmethod
    def coerce(cls, scales: StaticScales | str | Path) -> StaticScales:
        """``scales`` itself, or :meth:`load` of a path."""
        return scales if isinstance(scales, StaticScales) else cls.load(scales)

    def save(self, path: str | Path, metadata: Mapping[str, str] | None = None) -> Path:
        """Write the tensors and metadata (plus ``kvpage_scales`` and ``kind``) as a safetensors file.

        Returns:
            the path written.
        """
        from safetensors.torch import save_file

        suffix = self.kind
        tensors = {f"layers.{i}.k_{suffix}": t.contiguous() for i, t in self.key.items()}
        tensors.update({f"layers.{i}.v_{suffix}": t.contiguous() for i, t in self.value.items()})
        meta = {**self.metadata, **{str(k): str(v) for k, v in (metadata or {}).items()},
                "kvpage_scales": SCALES_FILE_VERSION, "kind": self.kind}
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(p), metadata=meta)
        return p

    # -- use ---------------------------------------------------------------------------------
    def tensor_name(self, layer_index: int, which: str) -> str:
        """File name of a layer's tensor: ``layers.{i}.k_absmax`` (``which`` ``key``/``k`` or ``value``/``v``)."""
        return f"layers.{layer_index}.{which[0]}_{self.kind}"

    def resolve(
        self,
        fmt: StaticScaleFormat,
        *,
        layer_index: int,
        kv_heads: int,
        head_dim: int,
        has_value: bool = True,
        group: str = "main",
    ) -> LayerScales:
        """Layer ``layer_index``'s scales for format ``fmt``, checked.

        Args:
            fmt: the layer's static format.
            layer_index: global layer index (draft/MTP layers follow the main ones).
            kv_heads, head_dim: the layer's layout.
            has_value: ``False`` for a key-only layer (no value scale needed).
            group: the layer group's name, for messages.

        Returns:
            :class:`LayerScales` with float32 tensors of ``fmt.static_scale_shape(kv_heads, head_dim)``.

        Raises:
            StaticScalesError: the tensor is missing, mis-shaped, non-finite,
                negative (absmax), not positive (scale) or all zero (absmax);
                the message names the layer, the group and the tensor.
        """
        want = fmt.static_scale_shape(kv_heads, head_dim)
        out: dict[str, torch.Tensor | None] = {KEY: None, VALUE: None}
        for which, table in ((KEY, self.key), (VALUE, self.value)):
            if which == VALUE and not has_value:
                continue
            tname = self.tensor_name(layer_index, which)
            where = f"layer {layer_index} ({group} group, {fmt.name})"
            t = table.get(layer_index)
            if t is None:
                have = sorted(set(self.key) | set(self.value))
                raise StaticScalesError(
                    f"{where}: the static scales ({self.source}) have no tensor {tname!r}; they cover layers "
                    f"{_ranges(have) or 'none'}. Calibrate every layer, draft/MTP layers included "
                    f"(`kvpage calibrate`); kvpage never uses a default scale of 1.0"
                )
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                raise StaticScalesError(f"{where}: tensor {tname!r} has {int(bad.sum())} non-finite entries "
                                        f"(first at {_first(bad)})")
            if self.kind == "absmax":
                if tuple(t.shape) != (kv_heads, head_dim):
                    raise StaticScalesError(f"{where}: tensor {tname!r} has shape {list(t.shape)}, expected "
                                            f"[{kv_heads}, {head_dim}] (kv_heads, head_dim)")
                if bool((t < 0).any()):
                    raise StaticScalesError(f"{where}: tensor {tname!r} has negative absolute maxima "
                                            f"(first at {_first(t < 0)})")
                if not bool((t > 0).any()):
                    raise StaticScalesError(f"{where}: tensor {tname!r} is all zero; the calibration saw no signal "
                                            f"for this layer")
                s = fmt.scale_from_absmax(t)
            else:
                if t.numel() == 1:
                    s = t.reshape(()).expand(want).clone()
                elif tuple(t.shape) == want:
                    s = t.clone()
                else:
                    shape = ", ".join(map(str, want)) or "a scalar"
                    raise StaticScalesError(f"{where}: tensor {tname!r} has shape {list(t.shape)}, expected "
                                            f"[{shape}] or one value")
                if bool((s <= 0).any()):
                    raise StaticScalesError(f"{where}: tensor {tname!r} has scales <= 0 "
                                            f"(first at {_first(s <= 0)}); a scale must be positive")
            out[which] = s.to(torch.float32).contiguous()
        key = out[KEY]
        assert key is not None
        return LayerScales(key, out[VALUE])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StaticScales) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)

    def __repr__(self) -> str:
        layers = sorted(set(self.key) | set(self.value))
        return f"StaticScales(kind={self.kind!r}, layers={_ranges(layers)!r}, sha256={self.sha256[:12]}..., source={self.source!r})"


def _first(mask: torch.Tensor) -> str:
    """Index of the first ``True`` of ``mask``, for messages (``"[1, 5]"``; ``"the scalar"`` for a 0-d mask)."""
    if mask.dim() == 0:
        return "the scalar"
    return str(mask.nonzero()[0].tolist())


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for x in sorted(xs):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
