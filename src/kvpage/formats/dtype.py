"""Unquantized formats: the cache stores keys and values in a plain float dtype.

``auto`` means the model's own dtype (vLLM and FastDeploy semantics); it is
resolved to ``float32``/``bfloat16``/``float16`` before it reaches a spec, so
two specs that store the same bytes have the same fingerprint.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from kvpage.formats.base import KEY, VALUE, QuantizedRows, TensorSpec, TokenFormat

#: canonical name -> torch dtype of the unquantized formats.
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: accepted spellings -> canonical name.
FLOAT_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


class FloatFormat(TokenFormat):
    """Keys and values stored as-is in ``dtype``; no scales.

    Round trip: exact when the input already has ``dtype``; otherwise the
    error is one rounding to ``dtype`` (relative 2^-24 float32, 2^-9 bfloat16,
    2^-11 float16, float16 also overflowing beyond 65504).
    """

    quantized: ClassVar[bool] = False

    def __init__(self, dtype: torch.dtype) -> None:
        names = {v: k for k, v in FLOAT_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"unquantized KV formats are {sorted(FLOAT_DTYPES)}; got dtype {dtype}")
        self.dtype = dtype
        self.name = names[dtype]  # per-instance canonical name

    def tensor_specs(
        self, *, block_size: int, kv_heads: int, head_dim: int, has_value: bool = True
    ) -> tuple[TensorSpec, ...]:
        """``key`` (and ``value``) ``[block_size, kv_heads, head_dim]`` in the format's dtype."""
        shape = (block_size, kv_heads, head_dim)
        specs = [TensorSpec(KEY, shape, self.dtype)]
        if has_value:
            specs.append(TensorSpec(VALUE, shape, self.dtype))
        return tuple(specs)

    def quantize(self, x: torch.Tensor, *, kind: str) -> QuantizedRows:
        """Cast ``x`` ``[N, H, D]`` to the storage dtype; no scale (``kind`` is not read)."""
        return QuantizedRows(x.to(self.dtype), None)

    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, *, kind: str
    ) -> torch.Tensor:
        """Cast stored ``[..., H, D]`` to ``dtype`` (``scale`` and ``kind`` are not read)."""
        return codes.to(dtype)
