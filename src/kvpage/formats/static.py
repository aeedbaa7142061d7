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

from typing import ClassVar

import torch

from kvpage.errors import StaticScalesError
from kvpage.formats.base import KEY, VALUE, KVFormat, QuantizedRows, TensorSpec
from kvpage.formats.codes import decode_e4m3, decode_int8, encode_e4m3, encode_int8

#: Smallest normal float16: floor of ``absmax / qmax`` when a calibration saw only zeros in a channel.
STATIC_SCALE_FLOOR = 2.0**-14


class StaticScaleFormat(KVFormat):
    """Base of the formats whose scales are per-layer constants (calibrated), not stored per block.

    The cache holds only uint8 codes; :meth:`quantize` and :meth:`dequantize`
    take the layer's static scale (float32, shape :meth:`static_scale_shape`),
    which the attention op gets from the layer's :class:`~kvpage.spec.LayerSpec`
    (``spec.static_scale(name)``). Subclasses set ``qmax``, ``per_channel`` and
    implement :meth:`encode` / :meth:`decode`.

    Attributes:
        qmax: largest code magnitude (127 for int8, 448 for e4m3).
        per_channel: ``True`` -> scale ``[kv_heads, head_dim]`` (FastDeploy ``cache_int8``);
            ``False`` -> one scalar per layer and K/V (vLLM ``k_scale``/``v_scale``).
    """

    quantized: ClassVar[bool] = True
    qmax: ClassVar[float]
    per_channel: ClassVar[bool]

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

    def quantize(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> QuantizedRows:
        """Encode ``x`` ``[N, kv_heads, head_dim]`` (any float dtype) with the layer's static ``scale``.

        Args:
            x: keys or values.
            scale: float32 static scale of shape :meth:`static_scale_shape` (broadcast
                over tokens), on ``x``'s device.

        Returns:
            uint8 codes ``[N, kv_heads, head_dim]`` and ``scale=None`` (nothing is stored per block).

        Raises:
            StaticScalesError: ``scale`` is ``None`` (a static format never falls back to 1.0).
        """
        if scale is None:
            raise StaticScalesError(
                f"{self.name} quantizes with the layer's calibrated static scale; none was given "
                f"(load one with kv_cache_scales=... / --kv-cache-scales, made by `kvpage calibrate`)"
            )
        return QuantizedRows(self.encode(x.float() / scale.to(device=x.device, dtype=torch.float32)), None)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Codes ``[..., kv_heads, head_dim]`` and the static ``scale`` -> ``decode(codes) * scale`` in ``dtype``.

        Raises:
            StaticScalesError: ``scale`` is ``None``.
        """
        if scale is None:
            raise StaticScalesError(f"{self.name} dequantizes with the layer's static scale; none was given")
        return self.decode(codes, dtype) * scale.to(device=codes.device, dtype=dtype)

    def encode(self, y: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """``x / scale`` float32 ``[N, H, D]`` -> uint8 codes (saturating)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - abstract
        """uint8 codes -> code values in ``dtype`` (not yet multiplied by the scale)."""
        raise NotImplementedError


class Int8StaticFormat(StaticScaleFormat):
    """Symmetric int8 with a static per-channel scale per (layer, K/V): FastDeploy's ``cache_int8``.

    Codes in [-127, 127] stored as uint8 (two's-complement bits); scale float32
    ``[kv_heads, head_dim]``. Error ``|x - x_hat| <= s[h, c] / 2`` inside
    ``+-127.5 s``; saturates to ``+-127 s`` beyond (inf included).
    """

    name: ClassVar[str] = "int8_static"
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

    name: ClassVar[str] = "fp8_static"
    aliases: ClassVar[tuple[str, ...]] = ("fp8_per_tensor",)
    qmax: ClassVar[float] = 448.0
    per_channel: ClassVar[bool] = False

    encode = staticmethod(encode_e4m3)
    decode = staticmethod(decode_e4m3)


def needs_static_scales(fmt: KVFormat) -> bool:
    """Whether ``fmt`` quantizes with per-layer calibrated scales (and so cannot run without them)."""
    return isinstance(fmt, StaticScaleFormat)
