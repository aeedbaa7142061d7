"""``RedisStore``: KV block records shared across engine instances through one Redis server.

Each block is one Redis string value -- a whole :mod:`~kvpage.cache.tiers.stores.record`
(safetensors + layout metadata + SHA-256) -- under the key
``"<namespace>:<spec fingerprint>:<block hash hex>"``, so a block is written
whole or not at all (``SET`` is atomic) and instances with different layouts
use disjoint keys; a foreign record reaching a reader anyway is rejected by its
metadata. This is LMCache's ``RedisConnector`` (one value per chunk, pipelined
``MGET``/``SET``) with vLLM's connector contract: batches are pipelined
(``GET``/``SET ... EX ttl``/``EXISTS``, ``transaction=False``), and a store
that cannot reach Redis reports misses and drops writes, so requests are
recomputed rather than failed.

Failure handling: every socket operation is bounded by ``timeout_s``
(``socket_timeout`` and ``socket_connect_timeout``; redis-py's own retries are
off), a failure is logged once per episode and counted in ``stats.errors``, and
for ``reconnect_interval_s`` afterwards calls return at once without touching
the network. The next call after that tries again (redis-py reconnects its
pool lazily), so the store recovers on its own when Redis comes back.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvpage.cache.tiers.stores.base import BlockData, FailureLog, KVStore, StoreKey
from kvpage.cache.tiers.stores.record import RecordRejected, decode_record, encode_record
from kvpage.spec import CacheSpec

logger = logging.getLogger(__name__)

#: Errors that mean "Redis is unreachable or misbehaving" (never raised to callers).
_IO_ERRORS: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)


class RedisStore(KVStore):
    """KV blocks as records in Redis (``redis://host:port/db``), optionally expiring.

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://...`` or ``unix:///path.sock?db=N``.
        spec: layout of the blocks this instance reads and writes.
        ttl_seconds: expiry set on every written key (``SET ... EX``), whole
            seconds > 0; ``None`` keeps keys until Redis evicts them (configure
            ``maxmemory-policy allkeys-lru`` on the server for an LRU cache).
        timeout_s: socket connect and read/write timeout in seconds; bounds how
            long any call can wait on a dead or stalled server.
        namespace: key prefix, so kvpage's keys are easy to find and flush.
        reconnect_interval_s: after a failure, calls return misses without
            trying the network for this long; then the next call reconnects.
        batch_size: keys per pipeline round trip.

    Raises:
        ValueError: bad ``ttl_seconds``, ``timeout_s``, ``batch_size`` or URL.
            Never raises for an unreachable server: the first call just misses.
    """

    def __init__(
        self,
        url: str,
        spec: CacheSpec,
        ttl_seconds: int | None = None,
        timeout_s: float = 0.5,
        *,
        namespace: str = "kvpage",
        reconnect_interval_s: float = 1.0,
        batch_size: int = 64,
    ) -> None:
        super().__init__(spec)
        if ttl_seconds is not None and (int(ttl_seconds) != ttl_seconds or ttl_seconds <= 0):
            raise ValueError(f"ttl_seconds must be a positive whole number of seconds or None, got {ttl_seconds}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.url = url
        self.ttl_seconds = None if ttl_seconds is None else int(ttl_seconds)
        self.timeout_s = float(timeout_s)
        self.namespace = namespace
        self.reconnect_interval_s = float(reconnect_interval_s)
        self.batch_size = int(batch_size)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._failures = FailureLog(logger, f"Redis KV store {_redact(url)}")
        self._retry_at = 0.0
        self._state_lock = threading.Lock()

    def redis_key(self, key: StoreKey) -> str:
        """The Redis key of ``key``: ``"<namespace>:<fingerprint>:<block hash hex>"``."""
        return f"{self.namespace}:{key.text}"

    # -- failure episodes ---------------------------------------------------------------------
    def _down(self) -> bool:
        """True while the store is backing off after a failure (no network attempt)."""
        with self._state_lock:
            return time.monotonic() < self._retry_at

    def _fail(self, action: str, exc: BaseException) -> None:
        with self._state_lock:
            self._retry_at = time.monotonic() + self.reconnect_interval_s
        self._failures.failed(action, exc)
        self._count(errors=1)
        try:
            self._client.connection_pool.disconnect()
        except Exception:  # noqa: BLE001 - best effort; the pool reconnects on the next call
            pass

    def _ok(self) -> None:
        self._failures.succeeded()

    def _pipeline(self, commands: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Run commands in pipelined chunks of ``batch_size``; results in order (errors as exception objects)."""
        results: list[Any] = []
        for start in range(0, len(commands), self.batch_size):
            pipe = self._client.pipeline(transaction=False)
            for name, args, kwargs in commands[start : start + self.batch_size]:
                getattr(pipe, name)(*args, **kwargs)
            results.extend(pipe.execute(raise_on_error=False))
        return results

    # -- the interface ------------------------------------------------------------------------
    def exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Pipelined ``EXISTS`` per key; all ``False`` when Redis is unreachable. See :meth:`KVStore.exists`."""
        self._check_keys(keys)
        if not keys:
            return []
        if self._down():
            self._count(errors=1)
            return [False] * len(keys)
        try:
            res = self._pipeline([("exists", (self.redis_key(k),), {}) for k in keys])
        except _IO_ERRORS as e:
            self._fail("exists", e)
            return [False] * len(keys)
        self._ok()
        return [not isinstance(r, Exception) and bool(r) for r in res]

    def get(self, keys: Sequence[StoreKey]) -> list[BlockData | None]:
        """Pipelined ``GET`` per key, each record verified; a rejected record is counted and deleted.

        All misses (``None``) when Redis is unreachable. See :meth:`KVStore.get`.
        """
        self._check_keys(keys)
        if not keys:
            return []
        if self._down():
            self._count(errors=1, misses=len(keys))
            return [None] * len(keys)
        try:
            blobs = self._pipeline([("get", (self.redis_key(k),), {}) for k in keys])
        except _IO_ERRORS as e:
            self._fail("get", e)
            self._count(misses=len(keys))
            return [None] * len(keys)
        self._ok()
        out: list[BlockData | None] = []
        bad: list[str] = []
        for k, blob in zip(keys, blobs):
            if isinstance(blob, Exception):
                logger.warning("Redis KV store: GET %s failed: %s", self.redis_key(k), blob)
                self._count(misses=1, errors=1)
                out.append(None)
                continue
            if blob is None:
                self._count(misses=1)
                out.append(None)
                continue
            try:
                data = decode_record(blob, self.spec, k)
            except RecordRejected as e:
                logger.warning("Redis KV store: %s: %s; deleting it", self.redis_key(k), e)
                bad.append(self.redis_key(k))
                self._count(misses=1, rejected=1)
                out.append(None)
                continue
            self._count(hits=1, bytes_read=len(blob))
            out.append(data)
        if bad:
            try:
                self._client.delete(*bad)
            except _IO_ERRORS as e:
                self._fail("delete", e)
        return out

    def put(self, items: Sequence[tuple[StoreKey, BlockData]]) -> None:
        """Pipelined ``SET key record [EX ttl]`` per block; dropped when Redis is unreachable.

        Every block is validated and encoded before anything is sent. See :meth:`KVStore.put`.
        """
        self._check_keys([k for k, _ in items])
        blobs = [(self.redis_key(k), encode_record(k, data, self.spec)) for k, data in items]
        if not blobs:
            return
        if self._down():
            self._count(errors=1)
            return
        kwargs = {} if self.ttl_seconds is None else {"ex": self.ttl_seconds}
        try:
            res = self._pipeline([("set", (name, blob), kwargs) for name, blob in blobs])
        except _IO_ERRORS as e:
            self._fail("put", e)
            return
        self._ok()
        for (name, blob), r in zip(blobs, res):
            if isinstance(r, Exception) or not r:
                logger.warning("Redis KV store: SET %s failed: %s", name, r)
                self._count(errors=1)
            else:
                self._count(puts=1, bytes_written=len(blob))

    def close(self) -> None:
        """Close the connection pool."""
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not raise
            pass

    def __repr__(self) -> str:
        return f"RedisStore({_redact(self.url)!r}, ttl_seconds={self.ttl_seconds}, namespace={self.namespace!r})"


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs)."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url
