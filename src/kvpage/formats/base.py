"""The KV-format interfaces: what a ``kv_cache_dtype`` stores per block and how it writes and reads it.

:class:`KVFormat` is what every format answers -- its **layout**
(:meth:`KVFormat.tensor_specs`: the tensors one layer needs per block, from which
:class:`~kvpage.spec.CacheSpec` builds every allocation, byte count and
fingerprint, so no other code decides a cache dtype) and its accounting. Formats
then split by what they do with values:

* :class:`TokenFormat` -- **token-wise**: each token's key or value row is
  quantized when it is written (:meth:`TokenFormat.quantize`) and stored in its
  slot; :meth:`TokenFormat.dequantize` reads rows back. Float, per-token int8/fp8
  and static-scale formats.
* :class:`BlockFormat` -- **block-wise**: a whole block is quantized once, when it
  fills (:meth:`BlockFormat.seal`), and read whole (:meth:`BlockFormat.unseal`);
  until then its tokens live in a full-precision tail (``int4``, ``int2``).

The attention ops (:mod:`kvpage.ops`) are the only callers of the value methods.
Imports nothing from kvpage but itself.

Per-block layout (token-major, "NHD", as vLLM's CPU and FlashAttention caches):
``key``/``value`` ``[block_size, kv_heads, head_dim]``, scales
``[block_size, kv_heads]``. Flattening the first two dims of a layer's
``[num_blocks, block_size, ...]`` tensor gives one row per slot, so a write is
``tensor.view(num_slots, ...)[slot_mapping] = rows``.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

#: Names of the per-layer cache tensors, in allocation order.
KEY, VALUE, KEY_SCALE, VALUE_SCALE = "key", "value", "key_scale", "value_scale"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One cache tensor of one layer, per block.

    Attributes:
        name: ``"key"``, ``"value"``, ``"key_scale"``, ``"value_scale"`` (or a format's own, e.g. ``"key_zero"``).
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
    """Stored form of ``[num_tokens, kv_heads, head_dim]`` keys or values (a :class:`TokenFormat`'s output).

    Attributes:
        codes: ``[num_tokens, kv_heads, head_dim]`` in the format's storage dtype.
        scale: ``[num_tokens, kv_heads]`` float16 dequantization scales stored beside the codes,
            or ``None`` when the format stores none per token (float and static-scale formats).
    """

    codes: torch.Tensor
    scale: torch.Tensor | None


class KVFormat(ABC):
    """A KV-cache storage format (one ``kv_cache_dtype``): layout and accounting.

    Subclasses set the class attributes and implement :meth:`tensor_specs`; they
    derive from :class:`TokenFormat` or :class:`BlockFormat`, never from this
    class directly. A format instance is immutable and cheap;
    :func:`kvpage.formats.get_format` returns it. Two instances are equal when
    they store the same bytes the same way (same class and name, and for a
    static-scale format the same bound scales).

    Attributes:
        name: canonical name, as written in specs and fingerprints.
        aliases: other accepted spellings (vLLM, FastDeploy, PyTorch names).
        quantized: whether the format stores codes plus scales.
        version: bumped whenever stored bytes change meaning; part of the
            layout fingerprint, so stores never mix versions.
        preferred_block_size: the block size ``LLM`` uses when none is given.
        default_residual_tokens: the full-precision window (``kv_quant_residual_tokens``)
            used when none is given; only block-wise formats read it.
    """

    name: str
    aliases: ClassVar[tuple[str, ...]] = ()
    quantized: ClassVar[bool] = False
    block_wise: ClassVar[bool] = False
    version: ClassVar[int] = 1
    preferred_block_size: ClassVar[int] = 16
    default_residual_tokens: ClassVar[int] = 0

    @abstractmethod
    def tensor_specs(
        self, *, block_size: int, kv_heads: int, head_dim: int, has_value: bool = True
    ) -> tuple[TensorSpec, ...]:
        """Tensors one layer needs per block, in allocation order (no side effects).

        Args:
            block_size: tokens per block.
            kv_heads: key/value heads of the layer.
            head_dim: channels per head.
            has_value: ``False`` for key-only layers (MLA-style latent cache):
                no value tensor and no value scale is listed.
        """

    def bits_per_value(self, *, block_size: int, kv_heads: int, head_dim: int) -> float:
        """Stored bits per cached value, everything counted (codes, scales, packing).

        Derived from :meth:`tensor_specs`, so it cannot disagree with what is allocated.
        """
        specs = self.tensor_specs(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)
        values = 2 * block_size * kv_heads * head_dim
        return 8 * sum(s.nbytes for s in specs) / values

    def effective_bits_per_value(
        self, *, num_tokens: int, block_size: int, kv_heads: int, head_dim: int, residual_tokens: int = 0,
        window_bits: int | None = None,
    ) -> float:
        """Bits per cached value that one sequence of ``num_tokens`` tokens really costs, everything counted.

        For formats that store every token in its block (all token-wise formats) this is
        :meth:`bits_per_value`. Block-wise formats (:mod:`kvpage.formats.kivi`) override it to
        add what they keep beside the pool: the full-precision tail of the last, partial block,
        the full-precision window of the most recent ``residual_tokens`` tokens and the 8-bit
        copy of the first block.

        Args:
            num_tokens: tokens in the sequence (> 0).
            residual_tokens: the full-precision window (``kv_quant_residual_tokens``), in tokens.
            window_bits: the window copies' precision where it is not the format's own (block-wise formats).
        """
        return self.bits_per_value(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)

    def full_precision_tokens(self, *, num_tokens: int, block_size: int, residual_tokens: int = 0) -> int:
        """Tokens of a ``num_tokens``-token sequence that the format also keeps in 16 bits beside its pool.

        0 for every format that stores each token in its block (all token-wise formats); block-wise
        formats (:mod:`kvpage.formats.kivi`) override it: the open block's tokens and the window's.
        """
        return 0

    def _identity(self) -> tuple[object, ...]:
        """What equality and hashing compare: the class and the name (subclasses add bound state)."""
        return (type(self), self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVFormat) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class TokenFormat(KVFormat):
    """A token-wise format: each key or value row is coded on its own when written, and decoded on read.

    A row's stored bytes depend on that row alone (never on the other rows written in
    the same call), so prefill, chunked prefill and decode store identical blocks.
    ``kind`` (``"key"`` or ``"value"``) says which tensor a row belongs to; only
    static-scale formats, whose scale differs between K and V, read it.
    """

    @abstractmethod
    def quantize(self, x: torch.Tensor, *, kind: str) -> QuantizedRows:
        """Encode ``x`` ``[num_tokens, kv_heads, head_dim]`` (any float dtype) for storage; ``x`` is not modified.

        Args:
            x: keys or values (RoPE already applied to keys).
            kind: ``"key"`` or ``"value"``.

        Raises:
            StaticScalesError: a static-scale format not bound to its layer's scales.
        """

    @abstractmethod
    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, *, kind: str
    ) -> torch.Tensor:
        """Decode stored rows back to ``dtype`` (the original basis); the inputs are not modified.

        Args:
            codes: ``[..., kv_heads, head_dim]`` storage dtype.
            scale: ``[..., kv_heads]`` float16 as stored beside the codes, or ``None`` for
                formats that store no per-token scale.
            dtype: the compute dtype to return.
            kind: ``"key"`` or ``"value"``.

        Returns:
            ``[..., kv_heads, head_dim]`` in ``dtype``.

        Raises:
            StaticScalesError: a static-scale format not bound to its layer's scales.
        """

    def rotation(self, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
        """The orthonormal ``[head_dim, head_dim]`` matrix stored rows are rotated by, or ``None``.

        When not ``None``, :meth:`dequantize_rotated` returns ``x @ R`` rather
        than ``x``; attention rotates its queries by the same ``R`` and its
        output back by ``R.T`` (see :mod:`kvpage.formats.rotation`).
        """
        return None

    def dequantize_rotated(
        self, codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, *, kind: str
    ) -> torch.Tensor:
        """Decode stored rows in the format's rotated basis (``x @ R``; ``x`` itself when :meth:`rotation` is ``None``).

        Same arguments and shapes as :meth:`dequantize`; the attention op's fast path.
        """
        return self.dequantize(codes, scale, dtype, kind=kind)


class BlockFormat(KVFormat):
    """A block-wise (quantize-on-seal) format: a block is coded whole, once, when it fills.

    A sealed block's bytes depend on its own ``block_size`` tokens alone, so it can be
    shared by the prefix cache and copied by the tiers like any block. Until a block
    fills its tokens live in a full-precision tail outside the pool
    (:mod:`kvpage.cache.tail`), and attention reads it through
    :func:`kvpage.ops.sealed_attention.sealed_attention`.

    Attributes:
        sink_bits: precision of the extra copy of a request's first block that attention reads instead of its
            codes (attention sinks); 0 keeps none. The group kind sizes its first-block slots from it.
        sink_rows: how many of the first block's rows that copy holds (its first ones: the sink is token 0),
            ``None`` for the whole block; the rest of the block is read from its sealed codes, which hold every
            row, so a block 0 without its copy reads as any block does. :meth:`copied_rows` at a block size.
        window_bits: precision of the copies of the sealed blocks in the recent window (KIVI's residual): 16 keeps
            the block's own 16-bit rows; 8 an ``int8`` copy per token and head in a first-block-copy slot, read
            instead (half the bytes; only where that slot holds a whole block: :meth:`window_copy_bits`).
    """

    block_wise = True
    sink_bits: ClassVar[int] = 0
    sink_rows: ClassVar[int | None] = None
    window_bits: ClassVar[int] = 16

    def copied_rows(self, block_size: int) -> int:
        """Rows of a first block of ``block_size`` tokens that the 8-bit copy holds: :attr:`sink_rows` (the whole
        block when ``None``), at most the block, lowered to a divisor of ``2 * block_size`` (whole copies fill a
        16-bit tail slot's bytes, :func:`~kvpage.spec.sinks_per_group`); 0 without a copy. No side effects."""
        if not self.sink_bits:
            return 0
        n = block_size if self.sink_rows is None else max(1, min(self.sink_rows, block_size))
        while (2 * block_size) % n:
            n -= 1
        return n

    def window_copy_bits(self, block_size: int) -> int:
        """Bits per value of a window copy at ``block_size``: :attr:`window_bits` when 8 and the format's 8-bit
        copy slots hold whole blocks (:meth:`copied_rows` is the block: the window copies share those slots), else 16.
        No side effects."""
        return 8 if self.window_bits == 8 and self.sink_bits == 8 and self.copied_rows(block_size) == block_size else 16

    @abstractmethod
    def names(self, kind: str) -> tuple[str, ...]:
        """Names of the per-block tensors holding ``kind`` (``"key"`` or ``"value"``), as :meth:`seal` returns them.

        Raises:
            ValueError: another ``kind``.
        """

    @abstractmethod
    def seal(self, blocks: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        """Quantize whole blocks; ``blocks`` is not modified.

        Args:
            blocks: ``[num_blocks, block_size, kv_heads, head_dim]`` keys or values (any float dtype).
            kind: ``"key"`` or ``"value"``.

        Returns:
            tensor name (:meth:`names`) -> ``[num_blocks, *per_block_shape]`` (see :meth:`~KVFormat.tensor_specs`).
        """

    @abstractmethod
    def unseal(
        self, tensors: Mapping[str, torch.Tensor], kind: str, dtype: torch.dtype, head_dim: int
    ) -> torch.Tensor:
        """Dequantize sealed blocks; the inputs are not modified.

        Args:
            tensors: tensor name (:meth:`names`) -> ``[..., *per_block_shape]`` (as :meth:`seal`
                returns them or the pool holds them).
            kind: ``"key"`` or ``"value"``.
            dtype: compute dtype of the result.
            head_dim: channels per head (packed rows may carry padding).

        Returns:
            ``[..., block_size, kv_heads, head_dim]`` in ``dtype``.
        """

    def rotation(self, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
        """The orthonormal ``[head_dim, head_dim]`` matrix ``R`` rows are stored rotated by, or ``None`` (no side effects).

        When not ``None`` the pool, the tail and the first-block copies all hold ``x @ R``: the attention ops
        rotate q, k and v (:meth:`to_stored_basis`) when a layer's pass enters them and the output back by
        ``R.T``, so their kernels never see the original basis (``(q R) . (k R) = q . k``). :meth:`seal` and
        :meth:`unseal` still take and return the original basis; :meth:`seal_rotated` and
        :meth:`unseal_rotated` are the stored-basis pair the attention ops call.
        """
        return None

    def to_stored_basis(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., head_dim]`` in the stored basis (``x @ R``; ``x`` itself when :meth:`rotation` is ``None``).

        Each row's result depends on that row alone, bit for bit, whatever the batch (stored codes must not
        depend on which tokens were written together). ``x`` is not modified.
        """
        return x

    def seal_rotated(self, blocks: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        """:meth:`seal` of blocks already in the stored basis (:meth:`to_stored_basis`); same arguments and result."""
        return self.seal(blocks, kind)

    def unseal_rotated(
        self, tensors: Mapping[str, torch.Tensor], kind: str, dtype: torch.dtype, head_dim: int
    ) -> torch.Tensor:
        """:meth:`unseal` returning the stored basis (``x @ R``); same arguments and result shape."""
        return self.unseal(tensors, kind, dtype, head_dim)
