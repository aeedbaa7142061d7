"""Dynamic per-token, per-head 8-bit formats: ``int8`` and ``fp8`` (e4m3).

One float16 scale per (token, kv head) is computed when the token is written
and stored beside its codes in the same block, so a block is self-contained
(it can be swapped, stored and shared with its scales) and no calibration is
needed. Sources: vLLM's ``int8_per_token_head``/``fp8_per_token_head`` caches,
FastDeploy's ``block_wise_fp8`` (scale caches ``[num_blocks, kv_heads,
block_size]``), QServe's in-page scales.

Bytes per block (one layer, K and V):
``2 * block_size * kv_heads * (head_dim * 1 + 2)``; at head_dim 64 that is
8.25 bits per value.

The scale is ``s = max(amax / qmax, 2**-14)`` rounded to float16, where
``amax`` is the row's largest magnitude and ``qmax`` 127 (int8) or 448 (e4m3).
The floor keeps ``s`` a normal float16 number, so an all-zero row gets a
finite scale and decodes to exact zeros. Codes are computed with the
*rounded* scale, so the stored pair is self-consistent.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from kvpage.formats.base import KEY, KEY_SCALE, VALUE, VALUE_SCALE, KVFormat, QuantizedRows, TensorSpec

#: Smallest normal float16; floor of every dynamic scale.
SCALE_FLOOR = 2.0**-14
#: Largest float16; inputs are clamped to ``qmax * FP16_MAX`` so inf saturates instead of making inf/NaN scales.
FP16_MAX = 65504.0


class PerTokenFormat(KVFormat):
    """Shared layout and scale arithmetic of the dynamic per-(token, head) 8-bit formats."""

    quantized: ClassVar[bool] = True
    qmax: ClassVar[float]

    def tensor_specs(
        self, *, block_size: int, kv_heads: int, head_dim: int, has_value: bool = True
    ) -> tuple[TensorSpec, ...]:
        """uint8 ``key``/``value`` ``[block_size, kv_heads, head_dim]`` and float16 scales ``[block_size, kv_heads]``."""
        codes = (block_size, kv_heads, head_dim)
        scales = (block_size, kv_heads)
        specs = [TensorSpec(KEY, codes, torch.uint8)]
        if has_value:
            specs.append(TensorSpec(VALUE, codes, torch.uint8))
        specs.append(TensorSpec(KEY_SCALE, scales, torch.float16))
        if has_value:
            specs.append(TensorSpec(VALUE_SCALE, scales, torch.float16))
        return tuple(specs)

    def scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Input clamped to the representable range, and its float16 scales.

        Args:
            x: ``[N, H, D]`` any float dtype.

        Returns:
            ``(x32, s16)``: ``x32`` ``[N, H, D]`` float32 clamped to
            ``+-qmax * 65504`` (NaN stays NaN); ``s16`` ``[N, H]`` float16.
        """
        limit = self.qmax * FP16_MAX
        x32 = x.float().clamp(-limit, limit)
        amax = x32.abs().amax(dim=-1)
        s16 = (amax / self.qmax).clamp(min=SCALE_FLOOR).to(torch.float16)
        return x32, s16


class Int8Format(PerTokenFormat):
    """Symmetric int8, one dynamic float16 scale per (token, kv head).

    Stored as uint8 holding the int8 bit pattern (two's complement), codes in
    [-127, 127]. Error bound per element: ``|x - x_hat| <= s / 2`` with ``s``
    the stored scale, i.e. about ``amax / 254`` of the row.
    """

    name: ClassVar[str] = "int8"
    aliases: ClassVar[tuple[str, ...]] = ("int8_per_token_head",)
    qmax: ClassVar[float] = 127.0

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        """``x`` ``[N, H, D]`` -> uint8 codes ``[N, H, D]`` and float16 scales ``[N, H]``."""
        x32, s16 = self.scales(x)
        q = torch.round(x32 / s16.float().unsqueeze(-1)).clamp_(-127, 127)
        return QuantizedRows(q.to(torch.int8).view(torch.uint8), s16)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """``codes.view(int8) * scale`` in ``dtype``; codes ``[..., H, D]``, scale ``[..., H]``."""
        assert scale is not None
        return (codes.view(torch.int8).to(dtype) * scale.to(dtype).unsqueeze(-1))


class Fp8Format(PerTokenFormat):
    """FP8 e4m3 (``float8_e4m3fn`` bits in uint8), one dynamic float16 scale per (token, kv head).

    Saturating: values are clamped to ``+-448 * s`` before the cast, so a
    value beyond the range (or an inf) stores as the largest e4m3 magnitude,
    never inf or NaN; a NaN input stays NaN. Error bound per element:
    ``|x - x_hat| <= 2**-4 * |x| + 2**-10 * s`` (3 mantissa bits give a
    relative half-step of 2^-4; e4m3 subnormals are spaced 2^-9 * s).
    """

    name: ClassVar[str] = "fp8"
    aliases: ClassVar[tuple[str, ...]] = (
        "fp8_e4m3",
        "float8_e4m3fn",
        "float8_e4m3",
        "e4m3",
        "block_wise_fp8",
        "fp8_per_token_head",
    )
    qmax: ClassVar[float] = 448.0

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        """``x`` ``[N, H, D]`` -> uint8 (e4m3 bits) codes ``[N, H, D]`` and float16 scales ``[N, H]``."""
        x32, s16 = self.scales(x)
        y = (x32 / s16.float().unsqueeze(-1)).clamp_(-448.0, 448.0)
        return QuantizedRows(y.to(torch.float8_e4m3fn).view(torch.uint8), s16)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """``codes.view(float8_e4m3fn) * scale`` in ``dtype``; codes ``[..., H, D]``, scale ``[..., H]``."""
        assert scale is not None
        return codes.view(torch.float8_e4m3fn).to(dtype) * scale.to(dtype).unsqueeze(-1)
