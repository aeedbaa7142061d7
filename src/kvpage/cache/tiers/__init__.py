"""Stores for KV blocks outside device memory, keyed by ``(spec fingerprint, block hash)``.

* :mod:`~kvpage.cache.tiers.base` -- :class:`StoreKey`, :data:`BlockData`,
  :class:`StoreStats`, the :class:`KVStore` interface and :func:`open_store`;
* :mod:`~kvpage.cache.tiers.blocks` -- :func:`gather_blocks` / :func:`scatter_blocks`
  between per-layer cache tensors and :data:`BlockData`;
* :mod:`~kvpage.cache.tiers.record` -- the checksummed, self-describing record format;
* :mod:`~kvpage.cache.tiers.disk` -- :class:`DiskStore` (one file per block, LRU cap);
* :mod:`~kvpage.cache.tiers.redis_store` -- :class:`RedisStore` (shared across instances).

``RedisStore`` is imported lazily, so using the disk store does not import ``redis``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpage.cache.tiers.base import BlockData, KVStore, StoreKey, StoreStats, open_store
from kvpage.cache.tiers.blocks import gather_blocks, scatter_blocks, validate_block_data
from kvpage.cache.tiers.disk import DiskStore
from kvpage.cache.tiers.record import RecordRejected, decode_record, encode_record, record_metadata

if TYPE_CHECKING:
    from kvpage.cache.tiers.redis_store import RedisStore

__all__ = [
    "BlockData",
    "DiskStore",
    "KVStore",
    "RecordRejected",
    "RedisStore",
    "StoreKey",
    "StoreStats",
    "decode_record",
    "encode_record",
    "gather_blocks",
    "open_store",
    "record_metadata",
    "scatter_blocks",
    "validate_block_data",
]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from kvpage.cache.tiers.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
