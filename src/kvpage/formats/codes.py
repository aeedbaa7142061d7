"""The two 8-bit code encodings kvpage stores as uint8: int8 and fp8 e4m3.

Shared by the dynamic per-token formats (:mod:`kvpage.formats.per_token`) and the
static-scale ones (:mod:`kvpage.formats.static`), which differ only in where the
scale comes from. Inputs are already divided by their scale.
"""
from __future__ import annotations

import torch

#: Largest code magnitudes: int8 is kept symmetric (-127..127), e4m3 saturates at 448.
INT8_QMAX, E4M3_QMAX = 127.0, 448.0


def encode_int8(y: torch.Tensor) -> torch.Tensor:
    """Round to nearest, clamp to [-127, 127], store the int8 bits as uint8 (same shape as ``y``)."""
    return torch.round(y).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8).view(torch.uint8)


def decode_int8(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int8 values of the stored uint8 bits, in ``dtype``."""
    return codes.view(torch.int8).to(dtype)


def encode_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Clamp to +-448 (saturate), cast to float8_e4m3fn (round to nearest even), store the bits as uint8."""
    return y.clamp(-E4M3_QMAX, E4M3_QMAX).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The e4m3 values of the stored uint8 bits, in ``dtype``."""
    return codes.view(torch.float8_e4m3fn).to(dtype)
