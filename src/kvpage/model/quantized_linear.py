"""GGUF Q4_0 / Q4_1 linear layers kept 4-bit, computed by torch's own int4 CPU kernel.

Why: batch-1 decode reads every weight once per token. The bundled SmolLM2 GGUF ships its
projections as Q4_1 (4.5 bits per weight plus a 16-bit minimum per 32 weights); dequantized to
bfloat16 they are 3.6x the bytes. Kept 4-bit they are multiplied by
``torch.ops.aten._weight_int4pack_mm_for_cpu`` (torch's AVX-512/AVX2 kernel, the one torchao's
int4 weight-only CPU layout uses), with GGUF's 32-weight blocks as torch's quantization groups.

The mapping (exact in the codes; scales and zeros rounded to bfloat16): torch computes
``w = (q - 8) * scale + zero`` per group of 32 weights along ``K``, with codes ``q`` in ``[0, 15]``
and ``scale``/``zero`` in the activations' dtype. GGUF's Q4_0 is ``w = d * (q - 8)``: scale ``d``,
zero 0. Q4_1 is ``w = d * q + m``: scale ``d``, zero ``m + 8d``. ``d`` and ``m`` are float16 in the
file; the kernel runs at speed only in bfloat16 (float32 and float16 inputs take a scalar path
15-30x slower, measured), so ``d`` and ``m + 8d`` (computed in float64) are rounded to bfloat16
(through float32, exact for ``d``): at most 2^-9 (+2^-24) relative per scale and zero, i.e. a weight is off by
at most about ``8 * |d| * 2^-9 + |m + 8d| * 2^-9`` (the tests allow twice that), about the size of rounding the dequantized weight itself to
bfloat16. The matmul accumulates in float32 and rounds the output to bfloat16 once.

Speed (one thread, this project's AVX-512 CPU, weights hot in cache): at one row the kernel beats the
oneDNN-prepacked bfloat16 :class:`~kvpage.model.linear.PackedLinear` by 1.0-1.8x (2.2x on a
49152-row LM head), at two rows it is even, and from 4 rows on it is 1.7-2.7x slower. So from
:data:`DENSE_ROWS` rows on (prefill chunks) the weight is decoded to bfloat16 for the call and multiplied
densely instead (decoding costs about a sixth of the matmul at 512 rows). Between 2 and 63 rows (batched
decode) neither beats the bfloat16 matmul: the 4-bit form pays at batch 1 only (end to end: batch-1 decode
1.6-1.7x faster, 32 requests ~0.67x; the README's ``--weights-dtype`` notes).

Codes layout: ``_convert_weight_to_int4pack_for_cpu`` takes int32 codes ``[N, K]`` and needs
``N % 16 == 0``; ``K`` is a multiple of 32 for every GGUF block type used here.

Fallback: :func:`int4_kernel_available` checks the ops once per process on a tiny case; where they are
missing (older torch 2.x) or fail, :func:`quantized_linear` returns ``None`` and the loader dequantizes
as before (with a warning).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["DENSE_ROWS", "GROUP_SIZE", "INT4_TYPES", "WEIGHTS_DTYPES", "GgufWeight", "Int4Linear", "check_weights_dtype",
           "int4_kernel_available", "quantized_linear"]

#: Weights per GGUF block of the 4-bit types, and torch's quantization group size used for them.
GROUP_SIZE = 32
#: ggml type ids (``gguf.GGMLQuantizationType``) of the blocks :class:`Int4Linear` runs: Q4_0 = 2, Q4_1 = 3.
INT4_TYPES = {2: "Q4_0", 3: "Q4_1"}
#: Rows from which :meth:`Int4Linear.forward` decodes the weight to bfloat16 and runs a dense matmul instead of the
#: int4 kernel. Measured (one thread, 512-row prefill chunk, 576 -> 3072): decoding 1.7 ms + bfloat16 matmul 9.9 ms
#: against the int4 kernel's 22.6 ms; the two cross between 40 and 80 rows for SmolLM2's shapes.
DENSE_ROWS = 64
#: Bytes per 32-weight block: Q4_0 = float16 d + 16 code bytes; Q4_1 = float16 d, float16 m + 16 code bytes.
_BLOCK_BYTES = {2: 18, 3: 20}


#: Values of ``weights_dtype`` (``load_model``, ``LLM``, ``--weights-dtype``): see :func:`kvpage.model.loader.load_model`.
WEIGHTS_DTYPES = ("auto", "as_shipped", "dequantized")


def check_weights_dtype(weights_dtype: Any) -> str:
    """``weights_dtype`` itself when it is one of :data:`WEIGHTS_DTYPES`.

    Raises:
        ValueError: any other value; the message names ``weights_dtype`` and the choices.
    """
    if not isinstance(weights_dtype, str) or weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}; got {weights_dtype!r}")
    return weights_dtype


@dataclass(frozen=True)
class GgufWeight:
    """A 2-D GGUF weight still in its ggml blocks.

    Attributes:
        ggml_type: ``gguf.GGMLQuantizationType`` value of the blocks.
        data: ``[N, bytes_per_row]`` uint8 numpy array of the row-major blocks (row ``n`` = output ``n``).
        shape: ``(N, K)`` in torch order (``out_features``, ``in_features``).
    """

    ggml_type: int
    data: np.ndarray
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The weight as a float32 ``[N, K]`` tensor, by ``gguf.quants.dequantize`` (the loader's reference)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(
            dequantize(self.data, GGMLQuantizationType(self.ggml_type)).reshape(self.shape)))

    def take_rows(self, rows: np.ndarray) -> GgufWeight:
        """The weight with its rows reordered (``rows``: int index array of length ``N``)."""
        return GgufWeight(self.ggml_type, np.ascontiguousarray(self.data[rows]), self.shape)

    @staticmethod
    def cat(weights: list[GgufWeight]) -> GgufWeight:
        """Stack weights of one ggml type and ``K`` along the rows (q/k/v, gate/up fusions).

        Raises:
            ValueError: mixed ggml types or ``K``.
        """
        types, ks = {w.ggml_type for w in weights}, {w.shape[1] for w in weights}
        if len(types) != 1 or len(ks) != 1:
            raise ValueError(f"cannot stack GGUF weights of ggml types {sorted(types)} and in_features {sorted(ks)}")
        return GgufWeight(weights[0].ggml_type, np.concatenate([w.data for w in weights], axis=0),
                          (sum(w.shape[0] for w in weights), weights[0].shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks."""
        return int(self.data.nbytes)


def int4_codes_scales(weight: GgufWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and zeros of a Q4_0/Q4_1 weight in torch's int4 form ``w = (q - 8) * scale + zero``.

    Returns:
        ``(codes, scale, zero)``: int32 ``[N, K]`` codes in ``[0, 15]``; float64 ``[N, K / 32]`` scale ``d``
        and zero (Q4_0: 0; Q4_1: ``m + 8d``), exact (float16 inputs, one float64 sum).

    Raises:
        ValueError: not a Q4_0/Q4_1 weight, or ``K`` not a multiple of 32.
    """
    if weight.ggml_type not in INT4_TYPES:
        raise ValueError(f"ggml type {weight.ggml_type} is not one of {INT4_TYPES}")
    N, K = weight.shape
    if K % GROUP_SIZE:
        raise ValueError(f"in_features {K} is not a multiple of {GROUP_SIZE}")
    blocks = weight.data.reshape(N, K // GROUP_SIZE, _BLOCK_BYTES[weight.ggml_type])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, K/32]
    if weight.ggml_type == 3:  # Q4_1: d, m, codes
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        zero, qs = m + 8.0 * d, blocks[..., 4:]
    else:  # Q4_0: d, codes
        zero, qs = np.zeros_like(d), blocks[..., 2:]
    # ggml's nibble order: byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, K)
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero)


@functools.lru_cache(maxsize=None)
def int4_kernel_available() -> bool:
    """Whether this torch has the int4 CPU ops and they compute ``(q - 8) * scale + zero``, checked once on a tiny
    case (bfloat16, 32 x 64)."""
    try:
        convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.int32)  # [N, K]
        sz = (torch.rand(2, 32, 2, generator=gen) * 0.1).bfloat16()  # [K/32, N, (scale, zero)]
        x = torch.randn(3, 64, generator=gen).bfloat16()
        with torch.no_grad():
            y = mm(x, convert(codes, 1), GROUP_SIZE, sz)
        w = ((codes.double() - 8) * sz[..., 0].double().T.repeat_interleave(GROUP_SIZE, 1)
             + sz[..., 1].double().T.repeat_interleave(GROUP_SIZE, 1))
        ref = x.double() @ w.T
        return y.shape == ref.shape and bool(torch.allclose(y.double(), ref, rtol=2**-7, atol=2e-2))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


class Int4Linear(nn.Module):
    """``y = x @ W.T`` (no bias) for a GGUF Q4_0/Q4_1 weight ``W [N, K]`` kept in 4 bits.

    Buffers: ``packed`` (uint8, torch's CPU int4 layout, ``N * K / 2`` bytes) and ``scales_and_zeros``
    (bfloat16 ``[K / 32, N, 2]``). ``forward(x [..., K]) -> [..., N]`` in ``x``'s dtype: a bfloat16 ``x`` goes
    straight to the kernel; any other dtype is rounded to bfloat16 for it and the output cast back (the
    kernel's float32 path is 15-30x slower). ``weight`` gives a dense float32 copy, for inspection.
    CPU only: moving the module to another device raises.

    Args:
        weight: a Q4_0/Q4_1 :class:`GgufWeight` with ``N % 16 == 0`` and ``K % 32 == 0``.

    Raises:
        ValueError: another ggml type, or shapes the kernel does not take.
    """

    def __init__(self, weight: GgufWeight) -> None:
        super().__init__()
        N, K = weight.shape
        if N % 16:
            raise ValueError(f"Int4Linear needs out_features divisible by 16 (torch's int4 CPU layout), got {N}")
        self.out_features, self.in_features = N, K
        self.ggml_type = weight.ggml_type
        codes, scale, zero = int4_codes_scales(weight)
        sz = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_and_zeros", sz)

    @property
    def weight(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight the kernel multiplies by (scales and zeros as rounded to bfloat16).

        Raises:
            NotImplementedError: ``out_features`` not a multiple of 64.
        """
        N, K = self.out_features, self.in_features
        if N % 64:  # torch packs whole 64-row tiles as below; a tail tile's layout is not relied on
            raise NotImplementedError("dense weight of an Int4Linear with out_features not a multiple of 64")
        p = self.packed.view(N // 64, K, 32)  # tile t, column k, byte j: rows 64t + j (low) and 64t + j + 32 (high)
        codes = torch.cat([p & 0x0F, p >> 4], dim=-1).transpose(1, 2).reshape(N, K).double()  # [N, K]
        s = self.scales_and_zeros.double()
        scale = s[..., 0].T.repeat_interleave(GROUP_SIZE, 1)
        zero = s[..., 1].T.repeat_interleave(GROUP_SIZE, 1)
        return ((codes - 8) * scale + zero).float()

    def dense_t(self) -> torch.Tensor:
        """``W.T`` as a new bfloat16 ``[K, N]`` tensor, decoded from the 4-bit buffers (for prefill-sized inputs).

        Each weight is ``(q - 8) * scale`` rounded to bfloat16, plus ``zero``, rounded again: within two bfloat16
        roundings of the kernel's weight. Needs ``N % 64 == 0`` (torch's 64-row tiles; see :attr:`weight`).
        """
        N, K = self.out_features, self.in_features
        p = self.packed.view(N // 64, K, 32).permute(1, 0, 2)  # [K, N/64, 32]: rows 64t + j (low), + 32 (high)
        codes = torch.cat((p & 0x0F, p >> 4), dim=-1).view(K // GROUP_SIZE, GROUP_SIZE, N)  # [K/32, 32, N]
        w = torch.empty(codes.shape, dtype=torch.bfloat16)
        w.copy_(codes)
        sz = self.scales_and_zeros
        w.sub_(8).mul_(sz[:, None, :, 0]).add_(sz[:, None, :, 1])
        return w.view(K, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` → ``[..., N]`` in ``x``'s dtype.

        Below :data:`DENSE_ROWS` rows (decode) torch's int4 kernel multiplies straight from the 4-bit codes; from
        there on (prefill chunks, where that kernel is 2-3x slower than a bfloat16 matmul) the weight is decoded
        to bfloat16 for this call (:meth:`dense_t`) and multiplied by the BLAS.
        """
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        xb = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
        if x2.shape[0] >= DENSE_ROWS and self.out_features % 64 == 0:
            y = torch.mm(xb, self.dense_t())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), self.packed, GROUP_SIZE,
                                                          self.scales_and_zeros)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def _apply(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        probe = fn(torch.empty(0, dtype=torch.bfloat16))
        if probe.device.type != "cpu":
            raise RuntimeError("Int4Linear runs on the CPU only (torch's int4 CPU kernel); load with "
                               "weights_dtype='dequantized' for another device")
        return self  # casts do not apply: the weight stays 4-bit, the output follows x's dtype

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"ggml_type={INT4_TYPES[self.ggml_type]}")


def quantized_linear(weight: GgufWeight) -> Int4Linear | None:
    """An :class:`Int4Linear` for ``weight``, or ``None`` where it does not apply: another ggml type, ``N`` not a
    multiple of 16, or no working int4 kernel in this torch (:func:`int4_kernel_available`)."""
    if weight.ggml_type not in INT4_TYPES or weight.shape[0] % 16 or weight.shape[1] % GROUP_SIZE:
        return None
    if not int4_kernel_available():
        return None
    return Int4Linear(weight)
