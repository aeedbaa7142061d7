"""Stores for whole KV blocks outside device memory, keyed by ``(spec fingerprint, block hash)``.

:mod:`~kvpage.cache.tiers.stores.base` holds the :class:`KVStore` interface and its keys; ``blocks`` and
``record`` move blocks between cache tensors and checksummed records; ``disk`` and ``redis`` are the two
stores, and :func:`open_store` here picks one from a URL. Modules here import only ``kvpage.spec``,
``kvpage.errors`` and each other (never the tier connector or the manager); ``RedisStore`` is imported
lazily, so using the disk store does not import ``redis``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from kvpage.cache.tiers.stores.base import BlockData, KVStore, StoreKey, StoreStats
from kvpage.cache.tiers.stores.blocks import gather_blocks, scatter_blocks, validate_block_data
from kvpage.cache.tiers.stores.disk import DiskStore
from kvpage.cache.tiers.stores.record import RecordRejected, decode_record, encode_record, record_metadata
from kvpage.spec import CacheSpec

if TYPE_CHECKING:
    from kvpage.cache.tiers.stores.redis import RedisStore

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


def open_store(url: str, spec: CacheSpec, **opts: Any) -> KVStore:
    """Open the store a URL names.

    * ``redis://host:port/db`` (also ``rediss://``, ``unix://``) ->
      :class:`~kvpage.cache.tiers.stores.redis.RedisStore` (options
      ``ttl_seconds``, ``timeout_s``, ``namespace``, ...);
    * ``file:///path`` or a plain path -> :class:`~kvpage.cache.tiers.stores.disk.DiskStore`
      (options ``max_bytes``, ``fsync``).

    Raises:
        ValueError: an empty URL or an unknown scheme.
    """
    if not url:
        raise ValueError("store URL is empty; use redis://host:port/db or a directory path")
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        from kvpage.cache.tiers.stores.redis import RedisStore

        return RedisStore(url, spec, **opts)
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL must name a local path (file:///dir), got {url!r}")
        return DiskStore(parsed.path, spec, **opts)
    if scheme and len(scheme) > 1:  # (a one-letter "scheme" is a Windows drive)
        raise ValueError(f"unknown store URL scheme {scheme!r} in {url!r}; use redis://, rediss://, unix://, file:// or a path")
    return DiskStore(url, spec, **opts)


def __getattr__(name: str) -> Any:
    """``RedisStore`` on first use (lazy, so that ``redis`` is imported only by those who use it)."""
    if name == "RedisStore":
        from kvpage.cache.tiers.stores.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
