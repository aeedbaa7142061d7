"""``RedisStore``: KV block records shared across engine instances through Redis (one node or a Redis Cluster).

Each block is one Redis string value -- a whole :mod:`~kvpage.cache.tiers.stores.record`
(safetensors + layout metadata + SHA-256) -- under the key
``"<namespace>:<spec fingerprint>:<block hash hex>"``, so a block is written
whole or not at all (``SET`` is atomic) and instances with different layouts
use disjoint keys; a foreign record reaching a reader anyway is rejected by its
metadata. This is LMCache's ``RedisConnector`` (one value per chunk, pipelined
``MGET``/``SET``) with vLLM's connector contract: batches are pipelined
(``GET``/``SET ... EX ttl``/``EXISTS``, ``transaction=False``), and a store
that cannot reach Redis reports misses and drops writes, so requests are
recomputed rather than failed. How the servers are reached -- one node
(``redis://``) or a Redis Cluster (``redis+cluster://h1:p1,h2:p2,...``, batches
grouped by hash slot into one pipeline per node) -- is a
:class:`~kvpage.cache.tiers.stores.redis_clients.RedisClient`; records, keys,
counters and failure handling are the same for both.

Failure handling: every socket operation is bounded by ``timeout_s``
(``socket_timeout`` and ``socket_connect_timeout``; redis-py's own retries are
off), a failure is logged once per episode (one warning per outage, however many
nodes and calls it spans) and counted in ``stats.errors``, and for
``reconnect_interval_s`` afterwards the keys of the failed *target* (the server,
or the cluster node owning their slot) are misses at once without touching the
network, while the other nodes of a cluster keep serving. The next call after
that tries again (redis-py reconnects lazily), so the store recovers on its own
when the server comes back.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvpage.cache.tiers.stores.base import BlockData, FailureLog, KVStore, StoreKey
from kvpage.cache.tiers.stores.record import RecordRejected, decode_record, encode_record
from kvpage.cache.tiers.stores.redis_clients import IO_ERRORS, OUTAGE_REPLIES, WHOLE, RedisClient, redis_client_for_url
from kvpage.spec import CacheSpec

logger = logging.getLogger(__name__)

Command = tuple[str, tuple[Any, ...], dict[str, Any]]


class _NotSent(Exception):
    """The reply of a command not sent: its target was backing off, or its batch failed as a whole."""


class RedisStore(KVStore):
    """KV blocks as records in Redis (``redis://host:port/db``) or a Redis Cluster
    (``redis+cluster://h1:p1,h2:p2,...``), optionally expiring.

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://...``, ``unix:///path.sock?db=N``, or
            ``redis+cluster://[user:password@]host1:port1,host2:port2,...`` (``rediss+cluster://`` for TLS;
            any reachable members, the rest are discovered).
        spec: layout of the blocks this instance reads and writes.
        ttl_seconds: expiry set on every written key (``SET ... EX``), whole
            seconds > 0; ``None`` keeps keys until Redis evicts them (configure
            ``maxmemory-policy allkeys-lru`` on the server for an LRU cache).
        timeout_s: socket connect and read/write timeout in seconds; bounds how
            long any call can wait on a dead or stalled server.
        namespace: key prefix, so kvpage's keys are easy to find and flush.
        reconnect_interval_s: after a failure, the failed server's keys are misses
            without trying the network for this long; then the next call reconnects.
        batch_size: keys per pipeline round trip (per cluster: per batch, split by node).
        client: how to reach Redis; default the kind ``url`` names (:func:`redis_client_for_url`).

    Raises:
        ValueError: bad ``ttl_seconds``, ``timeout_s``, ``batch_size`` or URL, or a single-node URL that names
            a Redis Cluster member (the message says to use ``redis+cluster://``). Never raises for an
            unreachable server: the first call just misses.
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
        client: RedisClient | None = None,
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
        self._client = client if client is not None else redis_client_for_url(url, self.timeout_s, _redact(url))
        try:
            self._client.check()
        except BaseException:
            self._client.close()
            raise
        self._failures = FailureLog(logger, f"Redis KV store {_redact(url)}")
        self._retry_at: dict[str, float] = {}  # target -> monotonic time before which it is not tried
        self._failed: set[str] = set()  # targets that failed since they last answered (the episode)
        self._state_lock = threading.Lock()

    @property
    def client(self) -> RedisClient:
        """How this store reaches Redis (one node or a cluster)."""
        return self._client

    def redis_key(self, key: StoreKey) -> str:
        """The Redis key of ``key``: ``"<namespace>:<fingerprint>:<block hash hex>"``."""
        return f"{self.namespace}:{key.text}"

    # -- failure episodes ---------------------------------------------------------------------
    def _down(self, target: str) -> bool:
        """True while ``target`` is backing off after a failure (no network attempt)."""
        with self._state_lock:
            return time.monotonic() < self._retry_at.get(target, 0.0)

    def _reached(self, targets: set[str]) -> None:
        """Commands on ``targets`` succeeded: the episode ends (logged) once every failed target was reached."""
        with self._state_lock:
            if not self._failed:
                return
            self._failed -= targets
            done = not self._failed
        if done:
            self._failures.succeeded()

    def _fail(self, action: str, target: str, exc: BaseException) -> None:
        with self._state_lock:
            self._retry_at[target] = time.monotonic() + self.reconnect_interval_s
            self._failed.add(target)
        where = f" on {target}" if target else ""
        self._failures.failed(action + where, exc)
        self._count(errors=1)
        self._client.disconnect(target)

    def _run(self, action: str, commands: list[Command]) -> list[Any]:
        """Run ``commands`` (each names one Redis key, its first argument) in pipelined chunks of ``batch_size``.

        Returns one reply per command, in order; a command not done is an exception object (:class:`_NotSent`
        when its target was backing off or its batch failed, the per-command error otherwise). Never raises
        for I/O: failures start or extend the targets' back-off and are logged once per episode; the episode
        ends (logged as recovered) once every target that failed has answered again.
        """
        replies: list[Any] = [_NotSent()] * len(commands)
        if self._down(WHOLE):
            self._count(errors=1)
            return replies
        try:
            targets = self._client.targets([args[0] for _, args, _ in commands])
        except IO_ERRORS as e:
            self._fail(action, WHOLE, e)
            return replies
        live = [i for i, t in enumerate(targets) if not self._down(t)]
        if len(live) < len(commands):
            self._count(errors=1)
        for start in range(0, len(live), self.batch_size):
            chunk = [i for i in live[start : start + self.batch_size] if not self._down(targets[i])]
            if not chunk:
                continue
            try:
                self._send(chunk, commands, replies)
            except IO_ERRORS as e:
                by_target: dict[str, list[int]] = {}
                for i in chunk:
                    by_target.setdefault(targets[i], []).append(i)
                if len(by_target) == 1:
                    self._fail(action, targets[chunk[0]], e)
                    continue
                for t, idx in by_target.items():  # a cluster: find which node failed, serve the others
                    if self._down(t):
                        continue
                    try:
                        self._send(idx, commands, replies)
                    except IO_ERRORS as e2:
                        self._fail(action, t, e2)
        outages: dict[str, BaseException] = {}
        for i in live:
            if isinstance(replies[i], OUTAGE_REPLIES) and targets[i] not in outages:
                outages[targets[i]] = replies[i]
        for t, exc in outages.items():
            self._fail(action, t, exc)
        reached = {targets[i] for i in live if not isinstance(replies[i], (_NotSent, *OUTAGE_REPLIES))}
        answered = reached - outages.keys()
        if answered:  # some server answered, so the topology (WHOLE) was reachable too
            self._reached(answered | {WHOLE})
        return replies

    def _send(self, idx: list[int], commands: list[Command], replies: list[Any]) -> None:
        """One pipeline of ``commands[i] for i in idx``; replies stored at their positions. Raises IO errors."""
        res = self._client.execute([commands[i] for i in idx])
        for i, r in zip(idx, res):
            replies[i] = r

    # -- the interface ------------------------------------------------------------------------
    def exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Pipelined ``EXISTS`` per key; ``False`` for keys whose server is unreachable. See :meth:`KVStore.exists`."""
        self._check_keys(keys)
        if not keys:
            return []
        res = self._run("exists", [("exists", (self.redis_key(k),), {}) for k in keys])
        return [not isinstance(r, Exception) and bool(r) for r in res]

    def get(self, keys: Sequence[StoreKey]) -> list[BlockData | None]:
        """Pipelined ``GET`` per key, each record verified; a rejected record is counted and deleted.

        Misses (``None``) for keys whose server is unreachable. See :meth:`KVStore.get`.
        """
        self._check_keys(keys)
        if not keys:
            return []
        blobs = self._run("get", [("get", (self.redis_key(k),), {}) for k in keys])
        out: list[BlockData | None] = []
        bad: list[str] = []
        for k, blob in zip(keys, blobs):
            if isinstance(blob, Exception):
                if not isinstance(blob, (_NotSent, *OUTAGE_REPLIES)):  # outages are logged once per episode
                    logger.warning("Redis KV store: GET %s failed: %s", self.redis_key(k), blob)
                    self._count(errors=1)
                self._count(misses=1)
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
            self._run("delete", [("delete", (name,), {}) for name in bad])
        return out

    def put(self, items: Sequence[tuple[StoreKey, BlockData]]) -> list[bool]:
        """Pipelined ``SET key record [EX ttl]`` per block; dropped (``False``) when its server is unreachable or
        refuses it.

        Every block is validated and encoded before anything is sent. See :meth:`KVStore.put`.
        """
        self._check_keys([k for k, _ in items])
        blobs = [(self.redis_key(k), encode_record(k, data, self.spec)) for k, data in items]
        if not blobs:
            return []
        kwargs = {} if self.ttl_seconds is None else {"ex": self.ttl_seconds}
        res = self._run("put", [("set", (name, blob), kwargs) for name, blob in blobs])
        held = [False] * len(blobs)
        for i, ((name, blob), r) in enumerate(zip(blobs, res)):
            if isinstance(r, (_NotSent, *OUTAGE_REPLIES)):
                continue  # counted and logged by the episode
            if isinstance(r, Exception) or not r:
                logger.warning("Redis KV store: SET %s failed: %s", name, r)
                self._count(errors=1)
            else:
                self._count(puts=1, bytes_written=len(blob))
                held[i] = True
        return held

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

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
