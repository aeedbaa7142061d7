"""The KV-format interface: what a ``kv_cache_dtype`` stores per block and how it (de)quantizes.

A format answers two questions for the rest of kvpage:

1. **Layout** -- :meth:`KVFormat.tensor_specs` lists the tensors one layer needs
   per block (name, per-block shape, dtype). :class:`~kvpage.spec.CacheSpec`
   builds every allocation, byte count and fingerprint from that list, so no
   other code decides a cache dtype.
2. **Values** -- :meth:`KVFormat.quantize` turns ``[num_tokens, kv_heads,
   head_dim]`` keys or values into stored codes (+ scales), and
   :meth:`KVFormat.dequantize` turns them back. The attention op is the only
   caller.

Per-block layout (token-major, "NHD", as vLLM's CPU and FlashAttention caches):
``key``/``value`` ``[block_size, kv_heads, head_dim]``, scales
``[block_size, kv_heads]``. Flattening the first two dims of a layer's
``[num_blocks, block_size, ...]`` tensor gives one row per slot, so a write is
``tensor.view(num_slots, ...)[slot_mapping] = rows``.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

#: Names of the per-layer cache tensors, in allocation order.
KEY, VALUE, KEY_SCALE, VALUE_SCALE = "key", "value", "key_scale", "value_scale"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One cache tensor of one layer, per block.

    Attributes:
        name: ``"key"``, ``"value"``, ``"key_scale"`` or ``"value_scale"``.
        shape: per-block shape (the leading ``num_blocks`` dim is not included).
        dtype: storage dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements per block."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes per block (elements x itemsize)."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """Stored form of ``[num_tokens, kv_heads, head_dim]`` keys or values.

    Attributes:
        codes: ``[num_tokens, kv_heads, head_dim]`` in the format's storage dtype.
        scale: ``[num_tokens, kv_heads]`` float16 dequantization scales, or
            ``None`` for unquantized formats.
    """

    codes: torch.Tensor
    scale: torch.Tensor | None


class KVFormat(ABC):
    """A KV-cache storage format (one ``kv_cache_dtype``).

    Subclasses set the class attributes and implement the four methods. A
    format instance is immutable and cheap; :func:`kvpage.formats.get_format`
    returns it.

    Attributes:
        name: canonical name, as written in specs and fingerprints.
        aliases: other accepted spellings (vLLM, FastDeploy, PyTorch names).
        quantized: whether the format stores codes plus scales.
        version: bumped whenever stored bytes change meaning; part of the
            layout fingerprint, so stores never mix versions.
        seals: whether blocks are quantized whole when they fill (``int4``/``int2``,
            :mod:`kvpage.formats.kivi`), which routes the layer through the tail pool.
        preferred_block_size: the block size ``LLM`` uses when none is given.
        default_residual_tokens: the full-precision window (``kv_quant_residual_tokens``)
            used when none is given; only quantize-on-seal formats read it.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    quantized: ClassVar[bool] = False
    version: ClassVar[int] = 1
    seals: ClassVar[bool] = False
    preferred_block_size: ClassVar[int] = 16
    default_residual_tokens: ClassVar[int] = 0

    @abstractmethod
    def tensor_specs(
        self, *, block_size: int, kv_heads: int, head_dim: int, has_value: bool = True
    ) -> tuple[TensorSpec, ...]:
        """Tensors one layer needs per block, in allocation order.

        Args:
            block_size: tokens per block.
            kv_heads: key/value heads of the layer.
            head_dim: channels per head.
            has_value: ``False`` for key-only layers (MLA-style latent cache):
                no value tensor and no value scale is listed.
        """

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        """Encode ``x`` ``[num_tokens, kv_heads, head_dim]`` (any float dtype) for storage."""

    @abstractmethod
    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Decode stored rows back to ``dtype``.

        Args:
            codes: ``[..., kv_heads, head_dim]`` storage dtype.
            scale: ``[..., kv_heads]`` float16, or ``None`` for unquantized formats.
            dtype: the compute dtype to return.

        Returns:
            ``[..., kv_heads, head_dim]`` in ``dtype``.
        """

    def rotation(self, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
        """The orthonormal ``[head_dim, head_dim]`` matrix stored rows are rotated by, or ``None``.

        When not ``None``, :meth:`dequantize_rotated` returns ``x @ R`` rather
        than ``x``; attention rotates its queries by the same ``R`` and its
        output back by ``R.T`` (see :mod:`kvpage.formats.rotation`).
        """
        return None

    def dequantize_rotated(self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Decode stored rows in the format's rotated basis (``x @ R``; ``x`` itself when :meth:`rotation` is ``None``).

        Same arguments and shapes as :meth:`dequantize`; the attention op's fast path.
        """
        return self.dequantize(codes, scale, dtype)

    def bits_per_value(self, *, block_size: int, kv_heads: int, head_dim: int) -> float:
        """Stored bits per cached value, everything counted (codes, scales, packing).

        Derived from :meth:`tensor_specs`, so it cannot disagree with what is allocated.
        """
        specs = self.tensor_specs(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)
        values = 2 * block_size * kv_heads * head_dim
        return 8 * sum(s.nbytes for s in specs) / values

    def effective_bits_per_value(
        self, *, num_tokens: int, block_size: int, kv_heads: int, head_dim: int, residual_tokens: int = 0
    ) -> float:
        """Bits per cached value that one sequence of ``num_tokens`` tokens really costs, everything counted.

        For formats that store every token in its block (all per-token formats) this is
        :meth:`bits_per_value`. Quantize-on-seal formats (:mod:`kvpage.formats.kivi`) override it to
        add what they keep beside the pool: the full-precision tail of the last, partial block,
        the full-precision window of the most recent ``residual_tokens`` tokens and the 8-bit
        copy of the first block.

        Args:
            num_tokens: tokens in the sequence (> 0).
            residual_tokens: the full-precision window (``kv_quant_residual_tokens``), in tokens.
        """
        return self.bits_per_value(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
