"""Element codes of the token-wise formats as ``@triton.jit`` helpers: int8 and e4m3 encode/decode, bfloat16 bits.

Written with integer and float32 arithmetic only (no hardware fp8/bf16 conversion), so the interpreter
(``TRITON_INTERPRET=1``, whose fp8/bf16 casts truncate) and a GPU compute the same bits, equal to torch's
round-to-nearest-even casts in :mod:`kvpage.formats.codes`. Imports triton: load it only through
:mod:`kvpage.ops.backends.triton`, which imports it lazily.
"""
from __future__ import annotations

import triton
import triton.language as tl

# element encodings the kernels take (one constexpr per launch)
ENC_F32, ENC_BF16, ENC_F16, ENC_I8, ENC_E4M3 = 0, 1, 2, 3, 4
# where a row's scale comes from: none (float formats), one float16 per (token, kv head), float32 per channel
SCALE_NONE, SCALE_TOKEN, SCALE_CHANNEL = 0, 1, 2



@triton.jit
def round_half_even(y):
    """``torch.round`` (ties to even) of float32 ``y``; exact for ``|y| < 2**22``, ``y`` itself beyond.

    Adding and subtracting ``1.5 * 2**23`` leaves no fraction bits in the float32 sum, so the hardware's
    round-to-nearest-even does the rounding (no ``rint``: the interpreter has no libdevice).
    """
    r = (y + 12582912.0) - 12582912.0
    return tl.where(tl.abs(y) < 4194304.0, r, y)


@triton.jit
def encode_int8(y):
    """float32 ``y`` (already divided by its scale) -> uint8 bits of ``clamp(round(y), -127, 127)`` as int8."""
    r = tl.clamp(round_half_even(y), -127.0, 127.0)
    return r.to(tl.int8).to(tl.uint8, bitcast=True)


@triton.jit
def decode_int8(codes):
    """uint8 bits of int8 codes -> their values as float32."""
    return codes.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def encode_e4m3(y):
    """float32 ``y`` -> uint8 bits of ``float8_e4m3fn(clamp(y, -448, 448))``, rounded to nearest even.

    Normal range (``|y| >= 2**-6``): the float32 mantissa is rounded to 3 bits on its bits (a carry moves into
    the exponent, as it should) and the exponent re-biased (127 -> 7); subnormals are ``round(|y| * 2**9)``
    steps of ``2**-9`` (8 steps is the smallest normal, code 8, so the two ranges meet). NaN -> ``0x7F`` with
    the sign bit, as torch stores it.
    """
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) >> 20) - (120 << 3)
    sub = round_half_even(a * 512.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(y != y, 0x7F, code)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def decode_e4m3(codes):
    """uint8 bits of e4m3 (``float8_e4m3fn``) codes -> float32 values (``0x7F``/``0xFF`` are NaN)."""
    c = codes.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where(c >= 128, -mag, mag)


@triton.jit
def decode_bf16(bits):
    """int16 bits of bfloat16 values -> float32 (exact: the bits become the top half of a float32)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def dequantize(codes, scale, ENC: tl.constexpr):
    """Stored elements (as loaded) -> float32 ``decode(codes) * scale``; ``scale`` is ignored for float encodings.

    ``codes`` is float32/float16 for those encodings, int16 bits for bfloat16, uint8 for int8 and e4m3.
    """
    if ENC == 0:
        x = codes
    elif ENC == 1:
        x = decode_bf16(codes)
    elif ENC == 2:
        x = codes.to(tl.float32)
    elif ENC == 3:
        x = decode_int8(codes) * scale
    else:
        x = decode_e4m3(codes) * scale
    return x

