"""Static-scale 8-bit formats: ``int8_static`` (FastDeploy ``cache_int8``) and ``fp8_static`` (vLLM fp8).

Both store one uint8 code per value and **no per-block scale**: the scales are
per-layer constants, calibrated offline (``kvpage calibrate``) and loaded with
the model, as in FastDeploy (``cachek_matmul.activation_scale`` of a
``cache_int8`` checkpoint), vLLM (the attention layer's ``k_scale`` /
``v_scale``) and TensorRT-LLM (``kv_cache_scaling_factor``). A block therefore
costs exactly 8 bits per value (``2 * block_size * kv_heads * head_dim`` bytes
per layer), and its codes only mean something together with the scales they
were written with -- which is why the scales are part of the
:class:`~kvpage.spec.CacheSpec` and its fingerprint, not of the pool.

The scales are bound to the format instance: :meth:`StaticScaleFormat.bind`
returns the layer's format holding its :class:`LayerScales`, and that instance
quantizes and dequantizes with them; :func:`~kvpage.formats.get_format` returns
an unbound instance, which describes the layout but refuses to code values.

======================  =================================  ============================================
format                  codes                              static scale per layer (K and V each)
======================  =================================  ============================================
``int8_static``         symmetric int8 in [-127, 127]      float32 ``[kv_heads, head_dim]`` (per channel)
``fp8_static``          e4m3 (``float8_e4m3fn`` bits)      float32 ``[]`` (per tensor)
======================  =================================  ============================================

From a calibration's absolute maxima ``absmax`` ``[kv_heads, head_dim]`` of the
keys (post-RoPE, as stored) or values of one layer:

* ``int8_static``: ``s[h, c] = max(absmax[h, c], 2**-14 * 127) / 127`` (FastDeploy:
  ``cache_k_dequant_scale = absmax / 127`` per channel);
* ``fp8_static``: ``s = max(absmax.max(), 2**-14 * 448) / 448`` (vLLM / llm-compressor
  ``k_scale = absmax / 448``).

The floor keeps a channel that was always zero during calibration at a tiny
positive scale (2^-14, the smallest normal float16), so it still decodes to 0.

Encoding ``x`` (any float dtype) with scale ``s``:

* int8: ``code = clamp(round(x / s), -127, 127)``; error ``|x - x_hat| <= s / 2`` for
  ``|x| <= 127.5 s``; beyond that it saturates to ``+-127 s`` (inf too).
* fp8: ``code = e4m3(clamp(x / s, -448, 448))`` (round to nearest even); error
  ``|x - x_hat| <= 2**-4 * |x| + 2**-10 * s`` for ``|x| <= 448 s``; beyond that it
  saturates to ``+-448 s`` (inf too), never inf or NaN.

A NaN input stays NaN under fp8 and gives an unspecified int8 code (as the dynamic formats).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ClassVar, Self

import torch

from kvpage.errors import StaticScalesError
from kvpage.formats.base import KEY, VALUE, KVFormat, QuantizedRows, TensorSpec, TokenFormat
from kvpage.formats.codes import decode_e4m3, decode_int8, encode_e4m3, encode_int8

#: Smallest normal float16: floor of ``absmax / qmax`` when a calibration saw only zeros in a channel.
STATIC_SCALE_FLOOR = 2.0**-14


def scales_digest(parts: list[tuple[str, torch.Tensor | None]]) -> str:
    """SHA-256 hex digest of named tensors: each name, then its shape and float32 bytes (``None`` marked as such).

    Deterministic across processes and devices (tensors are read as contiguous CPU float32).
    """
    h = hashlib.sha256()
    for name, t in parts:
        h.update(name.encode())
        if t is None:
            h.update(b"\x00none")
            continue
        c = t.detach().to("cpu", torch.float32).contiguous()
        h.update(repr(tuple(c.shape)).encode())
        h.update(c.numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class LayerScales:
    """One layer's static K/V scales, resolved for its format (what a bound static format multiplies codes by).

    Built by :meth:`kvpage.scales.StaticScales.resolve` (checked there) and bound to the
    layer's format with :meth:`StaticScaleFormat.bind`. Equality and hashing go by
    ``sha256``, computed once, so treat the tensors as read-only (the spec's fingerprint
    would no longer match them).

    Attributes:
        key: float32 key scale, shape ``format.static_scale_shape(kv_heads, head_dim)``
            (``[kv_heads, head_dim]`` for ``int8_static``, ``[]`` for ``fp8_static``), CPU.
        value: float32 value scale of the same shape, or ``None`` for a key-only layer.
        sha256: digest of both tensors' shapes and float32 bytes (:func:`scales_digest`).
    """

    key: torch.Tensor = field(compare=False, repr=False)
    value: torch.Tensor | None = field(compare=False, repr=False)
    sha256: str = ""
    _on_device: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.sha256:
            object.__setattr__(self, "sha256", scales_digest([(KEY, self.key), (VALUE, self.value)]))

    def get(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The ``key`` or ``value`` scale on ``device`` (copied there once and memoized; the only side effect).

        Raises:
            KeyError: ``name`` is not ``key``/``value``, or ``value`` of a key-only layer.
        """
        dev = torch.device(device)
        memo = (name, str(dev))
        t = self._on_device.get(memo)
        if t is None:
            src = {KEY: self.key, VALUE: self.value}.get(name)
            if src is None:
                raise KeyError(f"no static {name!r} scale in this layer (key-only layers have no value scale)")
            t = src if src.device == dev else src.to(dev)
            self._on_device[memo] = t
        return t


class StaticScaleFormat(TokenFormat):
    """Base of the formats whose scales are per-layer constants (calibrated), not stored per block.

    The cache holds only uint8 codes. An instance is either **unbound** (what
    :func:`~kvpage.formats.get_format` returns and a layer group's shared
    :class:`~kvpage.spec.LayerSpec` holds: it describes the layout but cannot code
    values) or **bound** to one layer's :class:`LayerScales` by :meth:`bind` (what
    :meth:`kvpage.spec.CacheSpec.layer` hands the attention op). A bound instance's
    :meth:`quantize` / :meth:`dequantize` use the ``kind``'s bound scale; an
    unbound one raises :class:`~kvpage.errors.StaticScalesError` -- a static format
    never falls back to a scale of 1.0. Subclasses set ``qmax``, ``per_channel`` and
    implement :meth:`encode` / :meth:`decode`.

    Args:
        scales: the layer's scales, or ``None`` for an unbound instance (prefer :meth:`bind`).

    Attributes:
        qmax: largest code magnitude (127 for int8, 448 for e4m3).
        per_channel: ``True`` -> scale ``[kv_heads, head_dim]`` (FastDeploy ``cache_int8``);
            ``False`` -> one scalar per layer and K/V (vLLM ``k_scale``/``v_scale``).
        scales: the bound scales, or ``None``.
    """

    quantized: ClassVar[bool] = True
    qmax: ClassVar[float]
    per_channel: ClassVar[bool]

    def __init__(self, scales: LayerScales | None = None) -> None:
        self.scales = scales

    def bind(self, scales: LayerScales) -> Self:
        """A new instance of this format bound to one layer's ``scales`` (``self`` is not changed).

        The shapes are not checked here (the format does not know the layer's heads);
        :class:`~kvpage.spec.LayerSpec` checks them against :meth:`static_scale_shape`.
        """
        return type(self)(scales)

    @property
    def is_bound(self) -> bool:
        """Whether the instance holds a layer's scales (and so can quantize and dequantize)."""
        return self.scales is not None

    def tensor_specs(
        self, *, block_size: int, kv_heads: int, head_dim: int, has_value: bool = True
    ) -> tuple[TensorSpec, ...]:
        """uint8 ``key`` (and ``value``) ``[block_size, kv_heads, head_dim]``; no scale tensors (8 bits/value)."""
        codes = (block_size, kv_heads, head_dim)
        specs = [TensorSpec(KEY, codes, torch.uint8)]
        if has_value:
            specs.append(TensorSpec(VALUE, codes, torch.uint8))
        return tuple(specs)

    def static_scale_shape(self, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K (or V) static scale: ``(kv_heads, head_dim)`` per channel, ``()`` per tensor."""
        return (kv_heads, head_dim) if self.per_channel else ()

    def scale_from_absmax(self, absmax: torch.Tensor) -> torch.Tensor:
        """Static scale from calibrated absolute maxima.

        Args:
            absmax: ``[kv_heads, head_dim]`` float, finite, ``>= 0``: per-channel
                ``max |x|`` of the keys (post-RoPE) or values of one layer.

        Returns:
            float32 scale of shape :meth:`static_scale_shape`: ``absmax / qmax`` per
            channel (int8) or ``absmax.max() / qmax`` (fp8), floored at
            :data:`STATIC_SCALE_FLOOR`.
        """
        a = absmax.detach().to(torch.float32)
        if not self.per_channel:
            a = a.amax()
        return (a / self.qmax).clamp(min=STATIC_SCALE_FLOOR).contiguous()

    def scale(self, kind: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The bound float32 scale of ``kind`` (``"key"``/``"value"``) on ``device`` (shape :meth:`static_scale_shape`).

        Raises:
            StaticScalesError: the instance is not bound to a layer's scales.
            KeyError: another ``kind``, or ``"value"`` of a key-only layer.
        """
        if self.scales is None:
            raise StaticScalesError(
                f"{self.name} codes values with its layer's calibrated static scale, but this format instance has "
                f"none bound: none was given (use CacheSpec.layer(i) of a spec built with static_scales=..., i.e. "
                f"kv_cache_scales=... / --kv-cache-scales, made by `kvpage calibrate`)"
            )
        return self.scales.get(kind, device)

    def quantize(self, x: torch.Tensor, *, kind: str) -> QuantizedRows:
        """Encode ``x`` ``[N, kv_heads, head_dim]`` (any float dtype) with the bound scale of ``kind``.

        Returns:
            uint8 codes ``[N, kv_heads, head_dim]`` and ``scale=None`` (nothing is stored per block).

        Raises:
            StaticScalesError: the instance is not bound (see :meth:`scale`).
        """
        s = self.scale(kind, x.device)
        return QuantizedRows(self.encode(x.float() / s), None)

    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, *, kind: str
    ) -> torch.Tensor:
        """Codes ``[..., kv_heads, head_dim]`` -> ``decode(codes) * s`` in ``dtype``, ``s`` the bound scale of ``kind``.

        Args:
            scale: must be ``None``: these formats store no per-token scale.

        Raises:
            StaticScalesError: the instance is not bound (see :meth:`scale`).
            ValueError: a stored ``scale`` was given.
        """
        if scale is not None:
            raise ValueError(f"{self.name} stores no per-token scale; dequantize takes scale=None")
        return self.decode(codes, dtype) * self.scale(kind, codes.device).to(dtype)

    def encode(self, y: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``x / scale`` float32 ``[N, H, D]`` -> uint8 codes (saturating)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - abstract
        """uint8 codes -> code values in ``dtype`` (not yet multiplied by the scale)."""
        raise NotImplementedError

    def _identity(self) -> tuple[object, ...]:
        """Class, name and the bound scales' digest: formats bound to other scales store other bytes."""
        return (*super()._identity(), None if self.scales is None else self.scales.sha256)

    def __repr__(self) -> str:
        bound = "unbound" if self.scales is None else f"scales {self.scales.sha256[:12]}"
        return f"{type(self).__name__}({self.name!r}, {bound})"


class Int8StaticFormat(StaticScaleFormat):
    """Symmetric int8 with a static per-channel scale per (layer, K/V): FastDeploy's ``cache_int8``.

    Codes in [-127, 127] stored as uint8 (two's-complement bits); scale float32
    ``[kv_heads, head_dim]``. Error ``|x - x_hat| <= s[h, c] / 2`` inside
    ``+-127.5 s``; saturates to ``+-127 s`` beyond (inf included).
    """

    name = "int8_static"
    aliases: ClassVar[tuple[str, ...]] = ("cache_int8",)
    qmax: ClassVar[float] = 127.0
    per_channel: ClassVar[bool] = True

    encode = staticmethod(encode_int8)
    decode = staticmethod(decode_int8)


class Fp8StaticFormat(StaticScaleFormat):
    """FP8 e4m3 with one static per-tensor scale per (layer, K/V): vLLM's fp8 KV cache with ``k_scale``/``v_scale``.

    Also TensorRT-LLM's FP8 KV cache (``kv_cache_scaling_factor``, shape ``[1]``)
    and FlashInfer's scalar ``k_scale``/``v_scale``. Saturating: ``x / s`` is
    clamped to +-448 before the cast, so values beyond the range (and inf) store
    as +-448 and decode to ``+-448 s``, never inf or NaN. Error
    ``|x - x_hat| <= 2**-4 |x| + 2**-10 s`` inside the range.
    """

    name = "fp8_static"
    aliases: ClassVar[tuple[str, ...]] = ("fp8_per_tensor",)
    qmax: ClassVar[float] = 448.0
    per_channel: ClassVar[bool] = False

    encode = staticmethod(encode_e4m3)
    decode = staticmethod(decode_e4m3)


def needs_static_scales(fmt: KVFormat) -> bool:
    """Whether ``fmt`` quantizes with per-layer calibrated scales (and so cannot run without them)."""
    return isinstance(fmt, StaticScaleFormat)
