"""Copy whole KV blocks between per-layer cache tensors and :data:`BlockData` (one block, CPU).

``caches`` everywhere is :attr:`CacheController.device_caches`-style: global
layer index -> tensor name -> ``[num_blocks, *per_block_shape]`` tensor (any
device). A block moves with every layer of the spec (main and draft/MTP) and
every tensor of the layer's format -- K, V and all scales together (cases C07,
C11) -- and nothing is written until every incoming tensor has been checked
against the spec (case C02's rule, applied to stored blocks).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from kvpage.cache.tiers.stores.base import BlockData
from kvpage.errors import KVCacheLayoutError
from kvpage.spec import CacheSpec

#: Per-layer caches: global layer index -> tensor name -> ``[num_blocks, *per_block_shape]``.
Caches = Mapping[int, Mapping[str, torch.Tensor]]
#: Per layer that keeps rows of its own (a bounded sliding-window layer's window slots): the row of each block
#: of a batch, ``None`` where the block holds none.
LayerRows = Mapping[int, Sequence[int | None]]


def _rows_of(layer: int, block_ids: Sequence[int], rows: LayerRows | None) -> Sequence[int | None]:
    if rows is None or layer not in rows:
        return block_ids
    if len(rows[layer]) != len(block_ids):
        raise ValueError(f"layer {layer}: {len(rows[layer])} rows for {len(block_ids)} blocks")
    return rows[layer]


def _layer_set_error(what: str, have: Sequence[int], spec: CacheSpec) -> KVCacheLayoutError | None:
    expected = set(range(spec.num_layers))
    got = set(have)
    if got == expected:
        return None
    return KVCacheLayoutError(
        f"{what} has layers {sorted(got)}, the spec has layers 0..{spec.num_layers - 1} "
        f"(missing {sorted(expected - got)}, unexpected {sorted(got - expected)})"
    )


def validate_block_data(spec: CacheSpec, data: Mapping[int, Mapping[str, torch.Tensor]], *, what: str = "block data") -> None:
    """Check one block's tensors against ``spec`` exactly: layers, tensor names, dtypes, per-block shapes.

    Args:
        spec: the layout the block must have.
        data: global layer index -> tensor name -> one block's tensor (no block dim).
        what: how to name the block in the message (e.g. ``"block 3 of the batch"``).

    Raises:
        KVCacheLayoutError: a layer is missing or unexpected, or a tensor is
            missing, unexpected, or has another dtype or shape; the message names
            the layer, the tensor, the expected and the actual layout.
    """
    err = _layer_set_error(what, list(data), spec)
    if err is not None:
        raise err
    for i in range(spec.num_layers):
        layer = spec.layer(i)
        tensors = data[i]
        expected = layer.tensor_by_name
        missing = [n for n in expected if n not in tensors]
        extra = [n for n in tensors if n not in expected]
        if missing or extra:
            raise KVCacheLayoutError(
                f"{what}, layer {i}: tensors {sorted(tensors)} do not match the spec "
                f"({layer.kv_format}: expected {list(expected)}; missing {missing}, unexpected {extra})"
            )
        for name, t in expected.items():
            actual = tensors[name]
            if not isinstance(actual, torch.Tensor):
                raise KVCacheLayoutError(f"{what}, layer {i}: {name!r} is a {type(actual).__name__}, not a tensor")
            if actual.dtype != t.dtype or tuple(actual.shape) != t.shape:
                raise KVCacheLayoutError(
                    f"{what}, layer {i}: tensor {name!r} expected dtype {t.dtype} shape {list(t.shape)} "
                    f"(format {layer.kv_format}), got dtype {actual.dtype} shape {list(actual.shape)}"
                )


def _validate_caches(caches: Caches, spec: CacheSpec, own_rows: Collection[int] = ()) -> int:
    """Check every layer's cache tensors against the spec; return the block count the layers not in
    ``own_rows`` share (layers in ``own_rows`` keep rows of their own: window slots)."""
    err = _layer_set_error("caches", list(caches), spec)
    if err is not None:
        raise err
    num_blocks: int | None = None
    for i in range(spec.num_layers):
        if i in own_rows:
            spec.layer(i).validate(caches[i], layer_index=i)
            continue
        spec.layer(i).validate(caches[i], layer_index=i, num_blocks=num_blocks)
        num_blocks = next(iter(caches[i].values())).shape[0]
    return num_blocks if num_blocks is not None else 0


def _block_index(block_ids: Sequence[int], num_blocks: int) -> torch.Tensor:
    idx = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_blocks):
        raise IndexError(f"block ids {idx.tolist()} out of range for caches of {num_blocks} blocks")
    return idx


def gather_blocks(caches: Caches, spec: CacheSpec, block_ids: Sequence[int], *,
                  rows: LayerRows | None = None) -> list[BlockData]:
    """Copy blocks out of per-layer caches into CPU :data:`BlockData`, one per block id.

    One ``index_select`` per (layer, tensor) for the whole batch, then a copy to
    the CPU; the returned tensors are independent of ``caches`` (later writes to
    the cache do not change them). Tensors of one layer and name may share one
    CPU buffer across the returned blocks.

    Args:
        caches: layer -> name -> ``[num_blocks, *per_block_shape]`` (any device).
        spec: the layout ``caches`` must have.
        block_ids: block ids to copy (repeats allowed).
        rows: layers whose tensors keep rows of their own (window slots) -> each block's row there; a whole
            block needs every row, so none may be ``None``.

    Returns:
        one :data:`BlockData` per id, in order; tensors ``[*per_block_shape]`` on the CPU.

    Raises:
        KVCacheLayoutError: ``caches`` disagrees with the spec (layers, names, dtypes, shapes).
        IndexError: a block id or row is out of range.
        ValueError: a row is ``None`` or ``rows`` has another length than ``block_ids``.
    """
    num_blocks = _validate_caches(caches, spec, rows or {})
    out: list[BlockData] = [{} for _ in range(len(block_ids))]
    if not block_ids:
        return out
    for i in range(spec.num_layers):
        ids = _rows_of(i, block_ids, rows)
        if any(r is None for r in ids):
            raise ValueError(f"layer {i}: a block to gather holds no row there (window slot)")
        n = num_blocks if rows is None or i not in rows else next(iter(caches[i].values())).shape[0]
        idx = _block_index([int(r) for r in ids if r is not None], n)
        for name, t in caches[i].items():
            got = t.index_select(0, idx.to(t.device))
            got = got.to("cpu") if got.device.type != "cpu" else got  # index_select already copied
            for j, block in enumerate(got.unbind(0)):
                out[j].setdefault(i, {})[name] = block
    return out


def scatter_blocks(caches: Caches, spec: CacheSpec, block_ids: Sequence[int], datas: Sequence[BlockData], *,
                   rows: LayerRows | None = None) -> None:
    """Write :data:`BlockData` into per-layer caches at ``block_ids`` (the reverse of :func:`gather_blocks`).

    Every block of ``datas`` and every cache tensor is checked against the spec,
    and the ids are checked, before the first byte is written: a bad batch
    leaves ``caches`` untouched.

    Args:
        caches: layer -> name -> ``[num_blocks, *per_block_shape]``, written in place.
        spec: the layout of ``caches`` and ``datas``.
        block_ids: destination block ids, one per block, no repeats.
        datas: the blocks (tensors on any device; copied to each cache tensor's device).
        rows: layers whose tensors keep rows of their own (window slots) -> each block's row there; a ``None``
            row skips that block in that layer (the block holds no window row: it is outside every window).

    Raises:
        KVCacheLayoutError: a block or a cache tensor disagrees with the spec;
            the message names the layer, the tensor, the expected and the actual layout.
        ValueError: ``block_ids`` and ``datas`` differ in length, or ids repeat.
        IndexError: a block id or row is out of range.
    """
    if len(block_ids) != len(datas):
        raise ValueError(f"{len(block_ids)} block ids for {len(datas)} blocks")
    if len(set(int(b) for b in block_ids)) != len(block_ids):
        raise ValueError(f"destination block ids repeat: {list(block_ids)}")
    num_blocks = _validate_caches(caches, spec, rows or {})
    for j, data in enumerate(datas):
        validate_block_data(spec, data, what=f"block {j} of the batch (to block id {int(block_ids[j])})")
    plan: list[tuple[int, torch.Tensor, list[int]]] = []
    for i in range(spec.num_layers):
        ids = _rows_of(i, block_ids, rows)
        keep = [j for j, r in enumerate(ids) if r is not None]
        n = num_blocks if rows is None or i not in rows else next(iter(caches[i].values())).shape[0]
        plan.append((i, _block_index([int(ids[j]) for j in keep], n), keep))  # all checked before writing
    for i, idx, keep in plan:
        if not idx.numel():
            continue
        for name, t in caches[i].items():
            t.index_copy_(0, idx.to(t.device), torch.stack([datas[j][i][name].to(t.device) for j in keep]))
