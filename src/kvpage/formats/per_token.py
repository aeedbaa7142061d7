"""Dynamic per-token, per-head 8-bit formats: ``int8`` and ``fp8`` (e4m3), rotated and plain.

One float16 scale per (token, kv head) is computed when the token is written
and stored beside its codes in the same block, so a block is self-contained
(it can be swapped, stored and shared with its scales) and no calibration is
needed. Sources: vLLM's ``int8_per_token_head``/``fp8_per_token_head`` caches,
FastDeploy's ``block_wise_fp8`` (scale caches ``[num_blocks, kv_heads,
block_size]``), QServe's in-page scales.

``fp8`` and ``int8_rotated`` first rotate each head's vector by an orthonormal
Hadamard matrix ``R`` (:mod:`kvpage.formats.rotation`), which spreads outlier
channels before the row is coded; ``int8`` (alias ``int8_per_token_head``) and
``fp8_per_token_head`` are the plain variants (vLLM's semantics). On SmolLM2 the
rotation lowers the teacher-forced KL to the unquantized cache 3-4x for int8 and
~1.4x for fp8; perplexity on GPL-3 (1,024 tokens, decode) is within its ~0.3% noise
for both int8 variants (plain +0.25%, rotated +0.24%; KLD 0.00133 and 0.00036), and
the plain one is the default ``int8``: it meets the +0.3% floor there and reads rows
without a rotation (``benchmarks/ACCURACY.md``).
e4m3's 3 mantissa bits need the rotation: fp8 rotated +0.91%, plain +1.06%.

Bytes per block (one layer, K and V): ``2 * block_size * kv_heads * (head_dim + 2)``;
at head_dim 64 that is 8.25 bits per value.

Scales: ``s = max(amax / qmax, 2**-14)`` rounded to float16, where ``amax`` is
the largest magnitude of the (rotated) row and ``qmax`` 127 (int8) or 448
(e4m3). The floor keeps ``s`` a normal float16 number, so an all-zero row gets
a finite scale and decodes to exact zeros. Codes are computed with the
*rounded* scale, so the stored pair is self-consistent.

Error bounds, with ``y = x R`` the row in the stored basis (``R = I`` for the
plain variants) and ``y_hat`` its decoded value:

* int8: ``|y - y_hat| <= s / 2`` per element;
* fp8: ``|y - y_hat| <= 2**-4 * |y| + 2**-10 * s`` per element;

and since ``R`` is orthonormal, ``||x - x_hat||_2 = ||y - y_hat||_2``.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from kvpage.formats.base import KEY, KEY_SCALE, VALUE, VALUE_SCALE, QuantizedRows, TensorSpec, TokenFormat
from kvpage.formats.codes import decode_e4m3, decode_int8, encode_e4m3, encode_int8
from kvpage.formats.rotation import hadamard_rotation, hadamard_transform

#: Smallest normal float16; floor of every dynamic scale.
SCALE_FLOOR = 2.0**-14
#: Largest float16. Rows are clamped to ``qmax * FP16_MAX`` (before and after rotation), so an
#: inf saturates instead of making an inf or NaN scale.
FP16_MAX = 65504.0


class PerTokenFormat(TokenFormat):
    """Shared layout, rotation and scale arithmetic of the dynamic per-(token, head) 8-bit formats.

    Subclasses set ``qmax``, ``rotate`` and implement :meth:`encode` / :meth:`decode`
    (the per-element code of a row already divided by its scale).
    """

    quantized: ClassVar[bool] = True
    qmax: ClassVar[float]
    rotate: ClassVar[bool] = True

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

    def rotation(self, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
        """The Hadamard matrix ``[head_dim, head_dim]`` for rotated variants, else ``None``."""
        return hadamard_rotation(head_dim, dtype, str(device)) if self.rotate else None

    def to_stored_basis(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, H, D]`` -> float32 rows as they are quantized: clamped, rotated (if the format rotates), clamped.

        NaN stays NaN; +-inf saturates to the representable limit.
        """
        limit = self.qmax * FP16_MAX
        y = x.float().clamp(-limit, limit)
        if self.rotate:
            # butterflies, not a matmul: a token's codes must not depend on the rows it is written with
            y = hadamard_transform(y).clamp_(-limit, limit)
        return y

    def quantize(self, x: torch.Tensor, *, kind: str) -> QuantizedRows:
        """``x`` ``[N, H, D]`` (any float dtype) -> uint8 codes ``[N, H, D]`` and float16 scales ``[N, H]`` (keys and values alike)."""
        y = self.to_stored_basis(x)
        s16 = (y.abs().amax(dim=-1) / self.qmax).clamp(min=SCALE_FLOOR).to(torch.float16)
        return QuantizedRows(self.encode(y / s16.float().unsqueeze(-1)), s16)

    def dequantize_rotated(
        self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, *, kind: str
    ) -> torch.Tensor:
        """Codes ``[..., H, D]`` and scales ``[..., H]`` -> ``y_hat = decode(codes) * scale`` in ``dtype`` (stored basis).

        Raises:
            ValueError: ``scale`` is ``None`` (these formats store one per token and head).
        """
        if scale is None:
            raise ValueError(f"{self.name} rows decode with the float16 scale stored beside them; none was given")
        return self.decode(codes, dtype) * scale.to(dtype).unsqueeze(-1)

    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, *, kind: str
    ) -> torch.Tensor:
        """Codes ``[..., H, D]`` and scales ``[..., H]`` -> ``x_hat = y_hat @ R.T`` in ``dtype`` (the original basis)."""
        y = self.dequantize_rotated(codes, scale, dtype, kind=kind)
        if not self.rotate:
            return y
        return y @ hadamard_rotation(y.shape[-1], dtype, str(y.device)).T

    def encode(self, y: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        """Scaled rows ``[N, H, D]`` float32 (``|y| <= ~qmax``) -> uint8 codes."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # pragma: no cover - abstract
        """uint8 codes -> code values in ``dtype`` (not yet multiplied by the scale)."""
        raise NotImplementedError


class Int8Format(PerTokenFormat):
    """Symmetric int8, one dynamic float16 scale per (token, kv head): vLLM's ``int8_per_token_head``.

    Stored as uint8 holding the int8 bit pattern (two's complement), codes in
    [-127, 127]. Error: ``|x - x_hat| <= s / 2`` with ``s = amax / 127`` of the row.

    Rows are not rotated. :class:`Int8RotatedFormat` (``int8_rotated``) rotates them
    first: its teacher-forced KL to the unquantized cache is 3-4x lower on SmolLM2, but
    both move perplexity by less than the ~0.3% noise a single 1,024-token text shows
    (+0.25% plain, +0.24% rotated in decode mode on GPL-3), so the plain one, which needs
    no rotation, is the default ``int8`` (``benchmarks/ACCURACY.md``).
    """

    name = "int8"
    aliases: ClassVar[tuple[str, ...]] = ("int8_per_token_head",)
    #: 3: plain rows again (1: plain, 2: Hadamard-rotated, now ``int8_rotated``).
    version: ClassVar[int] = 3
    qmax: ClassVar[float] = 127.0
    rotate: ClassVar[bool] = False

    encode = staticmethod(encode_int8)
    decode = staticmethod(decode_int8)


class Fp8Format(PerTokenFormat):
    """FP8 e4m3 (``float8_e4m3fn`` bits in uint8) of Hadamard-rotated rows, one dynamic float16 scale per (token, kv head).

    Saturating: scaled values are clamped to +-448 before the cast, so a value
    beyond the range (or an inf) stores as the largest e4m3 magnitude, never
    inf or NaN; a NaN input stays NaN. Error: ``|y - y_hat| <= 2**-4 * |y| +
    2**-10 * s`` in the rotated basis (3 mantissa bits give a relative
    half-step of 2^-4; e4m3 subnormals are spaced 2^-9 * s).
    """

    name = "fp8"
    aliases: ClassVar[tuple[str, ...]] = ("fp8_e4m3", "float8_e4m3fn", "float8_e4m3", "e4m3")
    #: 2: rows are Hadamard-rotated (version 1 stored plain rows under this name).
    version: ClassVar[int] = 2
    qmax: ClassVar[float] = 448.0

    encode = staticmethod(encode_e4m3)
    decode = staticmethod(decode_e4m3)


class Int8RotatedFormat(Int8Format):
    """Symmetric int8 of Hadamard-rotated rows, one dynamic float16 scale per (token, kv head).

    Error: ``|y - y_hat| <= s / 2`` in the rotated basis (about ``amax / 254`` of the
    rotated row). The rotation spreads outlier channels over the row (QuaRot, llama.cpp
    PR 21038), so the one scale fits all channels better.
    """

    name = "int8_rotated"
    aliases: ClassVar[tuple[str, ...]] = ()
    version: ClassVar[int] = 1
    rotate: ClassVar[bool] = True


class Fp8PerTokenHeadFormat(Fp8Format):
    """Plain (unrotated) per-(token, head) e4m3: vLLM's ``fp8_per_token_head``. Error ``|x - x_hat| <= 2**-4 |x| + 2**-10 s``.

    Also FastDeploy's ``block_wise_fp8`` KV cache: despite the name, its scale caches
    are shaped ``[num_blocks, kv_heads, block_size]`` -- one dynamic scale per (token,
    kv head), stored block-wise beside unrotated e4m3 codes -- which is this layout
    (FastDeploy keeps the scales in the model dtype, kvpage in float16).
    """

    name = "fp8_per_token_head"
    aliases: ClassVar[tuple[str, ...]] = ("block_wise_fp8",)
    version: ClassVar[int] = 1
    rotate: ClassVar[bool] = False
