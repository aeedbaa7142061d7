"""Stores for whole KV blocks outside device memory, keyed by ``(spec fingerprint, block hash)``.

:mod:`~kvpage.cache.tiers.stores.base` holds the :class:`KVStore` interface and its keys; ``blocks`` and
``record`` move blocks between cache tensors and checksummed records; ``disk`` and ``redis`` are the two
stores (``redis_clients``: one Redis node or a Redis Cluster behind the same ``RedisStore``), registered by URL scheme here (:data:`STORES`, :func:`parse_store_url`, :func:`open_store`). Modules here import only ``kvpage.spec``,
``kvpage.errors`` and each other (never the tier connector or the manager); ``RedisStore`` is imported
lazily, so using the disk store does not import ``redis``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    "STORES",
    "StoreKey",
    "StoreKind",
    "StoreStats",
    "StoreURL",
    "decode_record",
    "encode_record",
    "gather_blocks",
    "open_store",
    "parse_store_url",
    "record_metadata",
    "register_store",
    "scatter_blocks",
    "validate_block_data",
]


@dataclass(frozen=True)
class StoreURL:
    """Where a store lives, parsed once (:func:`parse_store_url`; ``EngineConfig.kv_stores`` holds them).

    Attributes:
        scheme: the registry key (``disk``, ``redis``, ...).
        tier: the tier name in metrics and tier hits (``disk``, ``redis``).
        location: what the opener gets: the directory of a disk store, the URL of a Redis server.
        options: keyword options for the opener (``max_bytes`` of a disk store, ``ttl_seconds`` of Redis, ...).
    """

    scheme: str
    tier: str
    location: str
    options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class StoreKind:
    """One registered kind of store: its tier name and how to open it."""

    tier: str
    opener: Callable[..., KVStore]


def _open_redis(location: str, spec: CacheSpec, **opts: Any) -> KVStore:
    from kvpage.cache.tiers.stores.redis import RedisStore  # lazy: only Redis users import redis

    return RedisStore(location, spec, **opts)


#: URL scheme -> store kind; :func:`register_store` adds more.
STORES: dict[str, StoreKind] = {
    "disk": StoreKind("disk", DiskStore),
    "file": StoreKind("disk", DiskStore),
    "redis": StoreKind("redis", _open_redis),
    "rediss": StoreKind("redis", _open_redis),
    "unix": StoreKind("redis", _open_redis),
    "redis+cluster": StoreKind("redis", _open_redis),  # a Redis Cluster (or Valkey cluster): the same records
    "rediss+cluster": StoreKind("redis", _open_redis),
}


def register_store(scheme: str, tier: str, opener: Callable[..., KVStore]) -> None:
    """Register ``opener(location, spec, **options) -> KVStore`` for URLs ``scheme://...`` (tier name ``tier``).

    Raises:
        ValueError: the scheme is taken.
    """
    key = scheme.lower()
    if key in STORES:
        raise ValueError(f"store URL scheme {scheme!r} is already registered")
    STORES[key] = StoreKind(tier, opener)


def parse_store_url(url: str | StoreURL, **options: Any) -> StoreURL:
    """Parse a store location: ``scheme://...`` of a registered scheme (:data:`STORES`), or a plain directory path
    (a disk store). ``disk://`` and ``file://`` URLs name a local directory (``disk:///abs/dir``, ``disk://rel/dir``).

    Raises:
        ValueError: an empty URL, an unknown scheme (the message lists the registered ones), a ``file://`` URL of
            another host.
    """
    if isinstance(url, StoreURL):
        return url
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"store URL must be a non-empty string, e.g. redis://host:port/db or a directory, got {url!r}")
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    opts = tuple(sorted(options.items()))
    if not scheme or len(scheme) == 1:  # a plain path (a one-letter "scheme" is a Windows drive)
        return StoreURL("disk", "disk", url, opts)
    kind = STORES.get(scheme)
    if kind is None:
        raise ValueError(f"unknown store URL scheme {scheme!r} in {url!r}; use "
                         f"{', '.join(s + '://' for s in STORES)} or a directory path")
    if kind.opener is DiskStore:
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL must name a local path (file:///dir), got {url!r}")
        location = parsed.path if scheme == "file" else url.split("://", 1)[1]
        return StoreURL(scheme, kind.tier, location, opts)
    return StoreURL(scheme, kind.tier, url, opts)


def open_store(url: str | StoreURL, spec: CacheSpec, **opts: Any) -> KVStore:
    """Open the store a URL names (:func:`parse_store_url`), with the URL's options and ``opts``.

    * ``redis://host:port/db`` (also ``rediss://``, ``unix://``) ->
      :class:`~kvpage.cache.tiers.stores.redis.RedisStore` (options ``ttl_seconds``, ``timeout_s``, ``namespace``,
      ...); ``redis+cluster://host1:port1,host2:port2,...`` (``rediss+cluster://`` for TLS) -> the same store
      through a Redis Cluster client;
    * ``disk:///path``, ``file:///path`` or a plain path -> :class:`~kvpage.cache.tiers.stores.disk.DiskStore`
      (options ``max_bytes``, ``fsync``).

    Raises:
        ValueError: an empty URL, an unknown scheme, or a ``redis://`` URL of a Redis Cluster member.
    """
    where = parse_store_url(url)
    return STORES[where.scheme].opener(where.location, spec, **{**dict(where.options), **opts})


def __getattr__(name: str) -> Any:
    """``RedisStore`` on first use (lazy, so that ``redis`` is imported only by those who use it)."""
    if name == "RedisStore":
        from kvpage.cache.tiers.stores.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
