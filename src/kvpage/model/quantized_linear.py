"""GGUF Q4_0 / Q4_1 / Q8_0 linear layers run as shipped, by kvpage's own CPU kernel (``gguf_matmul.cpp``).

Why: batch-1 decode reads every weight once per token. The bundled SmolLM2 GGUF ships its projections as
Q4_1 (4.5 bits per weight plus a 16-bit minimum per 32 weights) and its tied embedding / LM head as Q8_0;
dequantized to bfloat16 they are 3.6x and 1.9x those bytes. Kept as shipped, a token reads the file's bytes,
expanded in registers (the way llama.cpp runs these files).

Exactness: the blocks are the file's bytes, only reordered (:func:`to_tiles`: four weight rows' blocks side
by side, so one load serves their scales); every weight is ``d * q + mn`` in float32, exactly gguf-py's
dequantized weight (``d * q`` is exact: an 11-bit step times an at most 8-bit code). The product codes each
row of ``x`` once per call as int16 with one scale (half of ``max|x| / 32767`` per element at most, 1/128 of
rounding ``x`` to bfloat16) and sums the code products in int32 per block, scaled in float32: an output is
off the float64 product by at most that half step times ``sum |w|`` plus float32 summation (the tests' bound;
measured about ``1e-5`` of ``sum |x| |w|``).

Speed (one thread, this project's AVX-512 CPU). Hot in cache, one projection alone (``gguf_matmul`` vs torch's
``_weight_int4pack_mm_for_cpu`` vs the oneDNN-prepacked bfloat16 :class:`~kvpage.model.linear.PackedLinear`),
at one row: 960x576 Q4_1 22 / 41 / 36 us, 3072x576 64 / 108 / 74 us, 576x1536 32 / 59 / 45 us, the 49152x576
Q8_0 LM head 0.90 / - / 2.8 ms. In a model the weights are not hot: a step streams all of them (90 MB for the
bundled model) from the last-level cache or memory, and the kernel prefetches 4 KiB ahead of the block it
multiplies (the 121 projections of one token, one thread: 14.3 ms without, 8.8 ms with; batch-1 decode
48.6 -> 73.2 tokens/s). Streamed so, the kernel also beats decoding the weight to bfloat16 for the BLAS up to
about 36 rows (all 121 projections per step, one thread / two: 24 rows 75.7 / 41.6 ms against 93.3 / 63.1,
32 rows 99.8 / 56.6 against 113.4 / 60.6, 40 rows 120.7 against 107.6), so from :data:`DENSE_ROWS` rows on
(prefill chunks, the largest decode batches) the weight is decoded to bfloat16 for the call and multiplied by
the BLAS. A bfloat16 copy held beside it (``--weights-dtype dequantized``: 26-30 ms per step at 1-32 rows)
is faster from about 8 rows on, at 2x the memory: the as-shipped form is for batch 1-8.

Fallback: where kvpage's CPU kernels are not built (no compiler), :func:`quantized_linear` returns ``None``
and the loader dequantizes as before (with a warning).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["DENSE_ROWS", "QUANTIZED_TYPES", "TILE_ROWS", "WEIGHTS_DTYPES", "GgufLinear", "GgufWeight",
           "check_weights_dtype", "gguf_kernels_available", "quantized_linear", "to_tiles"]

#: ggml type ids (``gguf.GGMLQuantizationType``) of the blocks :class:`GgufLinear` runs.
QUANTIZED_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
#: Rows of ``x`` from which :meth:`GgufLinear.forward` decodes the weight to bfloat16 and runs a dense matmul
#: instead of the kernel. Measured over a whole step of the bundled model (every projection once, weights
#: streamed as a decode step streams them; module docstring): the two cross between 32 and 40 rows at one
#: thread and at two. (One projection hot in cache alone put it near 24: that measure misses the kernel's
#: smaller stream.)
DENSE_ROWS = 36
#: Bytes of one row's scales and of its 32 codes in a block: Q4_0 = float16 d + 16 code bytes; Q4_1 = float16
#: d and m + 16 code bytes; Q8_0 = float16 d + 32 int8 codes.
_SCALE_BYTES = {2: 2, 3: 4, 8: 2}
_CODE_BYTES = {2: 16, 3: 16, 8: 32}
#: Weight rows per tile (:func:`to_tiles`).
TILE_ROWS = 4


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


def to_tiles(weight: GgufWeight) -> np.ndarray:
    """The blocks of ``weight`` reordered for ``gguf_matmul``: byte-for-byte the file's bytes, rows in groups of
    :data:`TILE_ROWS` (``N`` padded with zero rows, which decode to 0), per group and block the four rows' steps,
    then (Q4_1) their minimums, then their codes one row after another.

    Returns:
        1-D uint8 array of ``ceil(N / 4) * (K / 32) * 4 * block bytes`` bytes.

    Raises:
        ValueError: a ggml type other than :data:`QUANTIZED_TYPES`, or ``K`` not a multiple of 32.
    """
    t = weight.ggml_type
    if t not in QUANTIZED_TYPES:
        raise ValueError(f"ggml type {t} is not one of {QUANTIZED_TYPES}")
    N, K = weight.shape
    if K % 32:
        raise ValueError(f"in_features {K} is not a multiple of 32")
    hb, cb, nb = _SCALE_BYTES[t], _CODE_BYTES[t], K // 32
    blocks = np.asarray(weight.data, dtype=np.uint8).reshape(N, nb, hb + cb)
    pad = -N % TILE_ROWS
    if pad:
        blocks = np.concatenate([blocks, np.zeros((pad, nb, hb + cb), np.uint8)])
    tiles = blocks.reshape(-1, TILE_ROWS, nb, hb + cb).transpose(0, 2, 1, 3)  # [tile, block, row, bytes]
    # scales: [row, (d, m), 2 bytes] -> [(d, m), row, 2 bytes]: all steps, then all minimums
    scales = tiles[..., :hb].reshape(*tiles.shape[:3], hb // 2, 2).transpose(0, 1, 3, 2, 4)
    scales = scales.reshape(*tiles.shape[:2], TILE_ROWS * hb)
    codes = tiles[..., hb:].reshape(*tiles.shape[:2], TILE_ROWS * cb)
    return np.ascontiguousarray(np.concatenate([scales, codes], axis=-1)).reshape(-1)


def gguf_kernels_available() -> bool:
    """Whether kvpage's CPU kernels (with ``gguf_matmul``) are built or can be built here."""
    from kvpage.ops.cpu.build import load_kernels

    return load_kernels() is not None


class GgufLinear(nn.Module):
    """``y = x @ W.T`` (no bias) for a GGUF Q4_0/Q4_1/Q8_0 weight ``W [N, K]`` kept in its blocks.

    Buffer: ``tiles`` (uint8, :func:`to_tiles`: the file's bytes reordered). ``forward(x [..., K]) -> [..., N]``
    in ``x``'s dtype (float32, bfloat16 or float16). ``weight`` gives the dense float32 weight (gguf-py's
    dequantized values exactly), for inspection. CPU only: moving the module to another device raises.

    Args:
        weight: a :class:`GgufWeight` of a :data:`QUANTIZED_TYPES` type with ``K % 32 == 0``.

    Raises:
        ValueError: another ggml type, or ``K`` not a multiple of 32.
    """

    def __init__(self, weight: GgufWeight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.ggml_type = weight.ggml_type
        self.register_buffer("tiles", torch.from_numpy(to_tiles(weight)))

    def _kernels(self) -> Any:
        from kvpage.ops.cpu.build import kernels_unavailable_reason, load_kernels

        k = load_kernels()
        if k is None:
            raise RuntimeError(f"GgufLinear needs kvpage's CPU kernels, which are not available: "
                               f"{kernels_unavailable_reason() or 'they are not loaded'}")
        return k

    @property
    def weight(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight the module multiplies by, decoded from the tiles."""
        return self._kernels().gguf_dequantize(self.tiles, self.ggml_type, self.out_features, self.in_features, False)

    def dense(self) -> torch.Tensor:
        """``W`` as a new bfloat16 ``[N, K]`` tensor (each float32 weight rounded to nearest even)."""
        return self._kernels().gguf_dequantize(self.tiles, self.ggml_type, self.out_features, self.in_features, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` → ``[..., N]`` in ``x``'s dtype.

        Below :data:`DENSE_ROWS` rows (decode) the kernel multiplies from the blocks; from there on the weight
        is decoded to bfloat16 for this call (:meth:`dense`) and multiplied by the BLAS (a float32 or float16
        ``x`` is rounded to bfloat16 for it, the output cast back).
        """
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] >= DENSE_ROWS:
            xb = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
            y = torch.nn.functional.linear(xb, self.dense()).to(x.dtype)
        else:
            y = self._kernels().gguf_matmul(x2.contiguous(), self.tiles, self.ggml_type, self.out_features)
        return y.reshape(*lead, self.out_features)

    def _apply(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        probe = fn(torch.empty(0, dtype=torch.bfloat16))
        if probe.device.type != "cpu":
            raise RuntimeError("GgufLinear runs on the CPU only (kvpage's gguf_matmul kernel); load with "
                               "weights_dtype='dequantized' for another device")
        return self  # casts do not apply: the weight stays in its blocks, the output follows x's dtype

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"ggml_type={QUANTIZED_TYPES[self.ggml_type]}")


def quantized_linear(weight: GgufWeight) -> GgufLinear | None:
    """A :class:`GgufLinear` for ``weight``, or ``None`` where it does not apply: another ggml type, ``K`` not a
    multiple of 32, or kvpage's CPU kernels not available (:func:`gguf_kernels_available`)."""
    if weight.ggml_type not in QUANTIZED_TYPES or weight.shape[1] % 32:
        return None
    if not gguf_kernels_available():
        return None
    return GgufLinear(weight)
