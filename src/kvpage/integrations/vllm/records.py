"""vLLM's KV layout as kvpage specs, and blocks coded into store records in kvpage's formats.

:class:`VLLMLayout` describes one vLLM deployment's attention cache (model, layers, heads, head size, block size,
dtype); :func:`record_specs` turns it and a storage format into the :class:`~kvpage.spec.CacheSpec` whose
fingerprint keys every record, so two layouts never read each other's blocks; :class:`BlockCodec` codes whole
blocks with kvpage's format objects. Imports torch and kvpage's formats and spec, never vLLM.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.cache.tiers.stores import BlockData
from kvpage.formats import KEY, VALUE, BlockFormat, FloatFormat, TokenFormat
from kvpage.formats.base import KEY_SCALE, VALUE_SCALE
from kvpage.integrations.vllm.config import STORAGE_FORMATS
from kvpage.spec import CacheSpec

#: Suffix of the model name in the spec of an ``int4`` deployment's first blocks (kept in int8, see
#: :func:`record_specs`), so they never mix with an ``int8`` deployment's records of the same model.
FIRST_BLOCK_MARK = "#first-block-int8"
#: Prefix of the model name in every record spec: blocks vLLM computed are never read by kvpage's own engine,
#: whose attention, RoPE and rounding differ, even for the same weights.
MODEL_PREFIX = "vllm:"


@dataclass(frozen=True)
class VLLMLayout:
    """One vLLM deployment's attention KV layout, as the connector learns it from vLLM's config.

    Attributes:
        model: the model's name (vLLM's ``model`` argument, or ``model_name`` of the extra config).
        num_layers: attention layers with a KV cache.
        num_kv_heads: KV heads per layer on this worker.
        head_size: channels per head (keys and values alike).
        block_size: tokens per vLLM block (the scheduler's ``cache_config.block_size``).
        dtype: vLLM's cache dtype (``auto``: the model dtype): ``torch.bfloat16``, ``torch.float16`` or
            ``torch.float32``.

    Raises:
        ValueError: a non-positive size or an unsupported dtype.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_size, self.block_size) <= 0:
            raise ValueError(f"VLLMLayout sizes must be positive, got {self}")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"KVPageConnector stores 16- and 32-bit float caches; vLLM's cache dtype is {self.dtype}")


@dataclass(frozen=True)
class RecordSpecs:
    """The specs a deployment's records are written and read under.

    Attributes:
        blocks: the spec of every block (its fingerprint keys the record).
        first_block: the spec of a request's first block (``int4``: int8, as kvpage's int4 keeps its first block
            in 8 bits for attention sinks); the same object as ``blocks`` for every other format.
    """

    blocks: CacheSpec
    first_block: CacheSpec

    def for_block(self, index: int) -> CacheSpec:
        """The spec of block ``index`` of a request (0: its first block)."""
        return self.first_block if index == 0 else self.blocks

    def runs(self, first_index: int, n: int) -> list[tuple[int, int]]:
        """``n`` consecutive blocks of a request, from its block ``first_index``, cut into ``(start, stop)`` runs
        (offsets into those ``n``) that each share one spec: a first block with a spec of its own is a run alone."""
        if n == 0:
            return []
        if first_index == 0 and n > 1 and self.first_block is not self.blocks:
            return [(0, 1), (1, n)]
        return [(0, n)]


def record_specs(layout: VLLMLayout, storage: str, int4_first_block: str = "int8") -> RecordSpecs:
    """The kvpage specs of ``layout``'s records in storage format ``storage`` (no side effects).

    Each spec's fingerprint covers the model name (as ``vllm:<model>|<vLLM dtype>``), layer count, KV heads, head
    size, block size and the format's name and version, so a deployment with any other of these asks for other
    keys. ``int4`` stores blocks 1.. in kvpage's ``int4`` and a request's first block in ``int8``
    under a spec of its own (model name marked :data:`FIRST_BLOCK_MARK`), unless ``int4_first_block`` is ``"int4"``.

    Raises:
        ValueError: ``storage`` is not one of :data:`~kvpage.integrations.vllm.config.STORAGE_FORMATS`, or
            ``int4_first_block`` is neither ``"int8"`` nor ``"int4"``.
    """
    if int4_first_block not in ("int8", "int4"):
        raise ValueError(f"int4_first_block must be 'int8' or 'int4', got {int4_first_block!r}")
    if storage not in STORAGE_FORMATS:
        raise ValueError(f"storage format {storage!r} is not one of {list(STORAGE_FORMATS)}")
    common = dict(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_size,
                  model_dtype=layout.dtype, block_size=layout.block_size)
    # the compute dtype too: a quantized record does not depend on it, but the KV it was coded from does
    name = f"{MODEL_PREFIX}{layout.model}|{str(layout.dtype).removeprefix('torch.')}"
    blocks = CacheSpec.build(kv_cache_dtype=storage, model_name=name, **common)
    if storage != "int4" or int4_first_block == "int4":
        return RecordSpecs(blocks, blocks)
    first = CacheSpec.build(kv_cache_dtype="int8", model_name=name + FIRST_BLOCK_MARK, **common)
    return RecordSpecs(blocks, first)


class BlockCodec:
    """Codes whole blocks of every layer into :data:`~kvpage.cache.tiers.stores.BlockData` of one spec, and back.

    Keys and values enter and leave as one tensor per layer, ``[num_blocks, block_size, kv_heads, head_size]``
    (kvpage's token-major per-block layout) in vLLM's dtype. A token-wise format (float, ``int8``, ``fp8``) codes
    each token row on its own (:meth:`~kvpage.formats.TokenFormat.quantize`); a block-wise one (``int4``) seals each
    block from its own tokens (:meth:`~kvpage.formats.BlockFormat.seal`), so a block's record depends on that block
    alone. Stateless; safe to share between threads.

    Args:
        spec: the records' spec (one layer group: every layer has the same format).
        dtype: the dtype decoded blocks are returned in (vLLM's cache dtype).
    """

    def __init__(self, spec: CacheSpec, dtype: torch.dtype) -> None:
        if len(spec.groups) != 1:
            raise ValueError(f"BlockCodec codes one layer group; spec has {[g.name for g in spec.groups]}")
        self.spec = spec
        self.dtype = dtype
        self.format = spec.main.layer.format
        self.head_size = spec.main.layer.head_dim

    def encode(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[BlockData]:
        """Code ``n`` blocks of every layer; the inputs are not modified.

        Args:
            keys, values: one tensor per layer, ``[n, block_size, kv_heads, head_size]`` (any float dtype).

        Returns:
            ``n`` :data:`BlockData` (CPU tensors in the spec's per-block shapes and dtypes), in block order.

        Raises:
            ValueError: not one tensor per layer of the spec, or the tensors' shapes differ.
        """
        if len(keys) != self.spec.num_layers or len(values) != self.spec.num_layers:
            raise ValueError(f"need {self.spec.num_layers} layers of keys and values, got {len(keys)} and {len(values)}")
        n = keys[0].shape[0]
        out: list[BlockData] = [{} for _ in range(n)]
        for layer, (k, v) in enumerate(zip(keys, values)):
            if k.shape != v.shape or k.shape[0] != n:
                raise ValueError(f"layer {layer}: keys {tuple(k.shape)} and values {tuple(v.shape)} differ")
            coded = {**self._encode_one(k, KEY), **self._encode_one(v, VALUE)}    # name -> [n, *per_block_shape]
            for b in range(n):
                out[b][layer] = {name: t[b].contiguous() for name, t in coded.items()}
        return out

    def _encode_one(self, x: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        fmt = self.format
        if isinstance(fmt, BlockFormat):
            return fmt.seal(x, kind)                                              # name -> [n, ...]
        assert isinstance(fmt, TokenFormat)
        n, bs, h, d = x.shape
        rows = fmt.quantize(x.reshape(n * bs, h, d), kind=kind)                 # codes [n*bs, h, d], scale [n*bs, h]
        coded = {kind: rows.codes.reshape(n, bs, h, -1)}
        if rows.scale is not None:
            coded[KEY_SCALE if kind == KEY else VALUE_SCALE] = rows.scale.reshape(n, bs, h)
        return coded

    def decode(self, blocks: Sequence[BlockData]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Decode blocks (as :meth:`encode` returns them or a store reads them); the inputs are not modified.

        Returns:
            ``(keys, values)``: one tensor per layer, ``[len(blocks), block_size, kv_heads, head_size]`` in the
            codec's ``dtype``. ``auto`` gives back the exact bytes encoded.
        """
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for layer in range(self.spec.num_layers):
            stacked = {name: torch.stack([b[layer][name] for b in blocks]) for name in blocks[0][layer]}
            keys.append(self._decode_one(stacked, KEY))
            values.append(self._decode_one(stacked, VALUE))
        return keys, values

    def _decode_one(self, t: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        fmt = self.format
        if isinstance(fmt, BlockFormat):
            return fmt.unseal(t, kind, self.dtype, self.head_size)              # [n, bs, h, d]
        assert isinstance(fmt, TokenFormat)
        scale = t.get(KEY_SCALE if kind == KEY else VALUE_SCALE)
        if isinstance(fmt, FloatFormat) and fmt.dtype == self.dtype:
            return t[kind].clone()                                              # bit-exact
        # decoded in float32 and rounded once (fp8's inverse rotation in bf16 would round twice)
        return fmt.dequantize(t[kind], scale, torch.float32, kind=kind).to(self.dtype)
