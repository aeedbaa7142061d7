"""The store interface: KV blocks kept outside device memory, keyed by ``(spec fingerprint, block hash)``.

A *store* holds whole KV blocks -- every layer (main and draft/MTP) and every
tensor of the layer's format (``key``, ``value``, ``key_scale``, ...) -- so a
block read back is complete or absent, never half a block. Keys pair the
:attr:`~kvpage.spec.CacheSpec.fingerprint` with the prefix cache's chained
block hash (:mod:`kvpage.cache.hashing`), so an instance with another layout
(another ``kv_cache_dtype``, head count, block size, format version ...) asks
for other keys and can never read a block as its own; a record reaching the
wrong reader anyway is rejected by its metadata (:mod:`kvpage.cache.tiers.stores.record`).

The shape of the API follows the KV connectors of LMCache
(``contains``/``get``/``put`` on a storage backend) and vLLM v1
(``get_num_new_matched_tokens`` probes, then loads; saves are fire-and-forget):
calls take batches, a failed read is a miss (the engine recomputes the block)
and a failed write is dropped. Stores never raise for I/O problems -- they
log once per failure episode and count -- but they do raise for programming
errors (a key of another fingerprint, block data that disagrees with the spec).
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import TracebackType

import torch

from kvpage.spec import CacheSpec

#: One block's KV in host memory: global layer index (main and draft layers) ->
#: tensor name (exactly the names of ``LayerSpec.tensors``: ``key``, ``value``,
#: ``key_scale``, ``value_scale``) -> CPU tensor with that tensor's per-block
#: shape and dtype (no leading block dimension), e.g. ``key`` ``[block_size,
#: kv_heads, head_dim]`` uint8 for ``int8``, ``key_scale`` ``[block_size, kv_heads]`` float16.
BlockData = dict[int, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class StoreKey:
    """Address of one stored block.

    Attributes:
        fingerprint: the writer's :attr:`CacheSpec.fingerprint` (64 hex chars).
        block_hash: the block's chained prefix hash (32 bytes, :mod:`kvpage.cache.hashing`).
    """

    fingerprint: str
    block_hash: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, (bytes, bytearray)) or not self.block_hash:
            raise TypeError(f"StoreKey.block_hash must be non-empty bytes, got {type(self.block_hash).__name__}")
        if not isinstance(self.fingerprint, str) or not self.fingerprint or ":" in self.fingerprint:
            raise ValueError(f"StoreKey.fingerprint must be a non-empty string without ':', got {self.fingerprint!r}")

    @property
    def text(self) -> str:
        """``"<fingerprint>:<block hash hex>"``: the key as text (Redis key suffix, log messages)."""
        return f"{self.fingerprint}:{bytes(self.block_hash).hex()}"


@dataclass
class StoreStats:
    """Counters of one store instance (monotonic, since it was opened).

    Every key passed to :meth:`KVStore.get` counts exactly once as a hit or a
    miss. ``rejected`` counts the misses caused by a record that failed its
    checks (corrupt bytes, checksum, key or layout mismatch); ``errors`` counts
    failed I/O operations (a file that could not be read or written, a Redis
    batch that failed or was skipped while the server was down).

    Attributes:
        hits: keys found with a valid record.
        misses: keys not served (absent, rejected, or lost to an I/O error).
        rejected: records found but refused (a subset of ``misses``).
        errors: failed I/O operations.
        bytes_read: record bytes read for hits (encoded size, metadata included).
        bytes_written: record bytes written.
        puts: blocks written.
        evictions: records removed to respect a size cap (disk store).
    """

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    puts: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for metrics and logs)."""
        return asdict(self)


class FailureLog:
    """Logs a store's I/O failures once per episode, not once per call.

    The first failure after a success logs a warning; further failures log at
    debug level; the first success after failures logs that the store recovered.
    """

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger = logger
        self.what = what
        self.failing = False
        self._lock = threading.Lock()

    def failed(self, action: str, exc: BaseException) -> None:
        """Record a failure of ``action`` (e.g. ``"get"``) caused by ``exc``."""
        with self._lock:
            first, self.failing = not self.failing, True
        if first:
            self.logger.warning(
                "%s: %s failed (%s: %s); serving misses and dropping writes until it recovers",
                self.what, action, type(exc).__name__, exc,
            )
        else:
            self.logger.debug("%s: %s failed again (%s: %s)", self.what, action, type(exc).__name__, exc)

    def succeeded(self) -> None:
        """Record a successful operation; logs recovery after a failure episode."""
        if self.failing:
            with self._lock:
                was, self.failing = self.failing, False
            if was:
                self.logger.warning("%s: recovered", self.what)


class KVStore(ABC):
    """A store of whole KV blocks for one :class:`~kvpage.spec.CacheSpec`.

    Calls are batched and thread-safe. Reads return ``None`` for a miss, a
    rejected record or an I/O failure; writes of a failed batch are dropped.
    Neither raises for I/O problems (they are logged once per failure episode
    and counted in :attr:`stats`).

    Args:
        spec: the layout of every block this store reads and writes.

    Attributes:
        spec: that layout.
        stats: the store's :class:`StoreStats`.
    """

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()

    # -- keys --------------------------------------------------------------------------------
    def key(self, block_hash: bytes) -> StoreKey:
        """The key of ``block_hash`` under this store's spec fingerprint."""
        return StoreKey(self.spec.fingerprint, bytes(block_hash))

    def _check_keys(self, keys: Sequence[StoreKey]) -> None:
        """Raise ``ValueError`` for a key of another spec (a caller bug, not a miss)."""
        fp = self.spec.fingerprint
        for k in keys:
            if not isinstance(k, StoreKey):
                raise TypeError(f"store keys must be StoreKey, got {type(k).__name__}")
            if k.fingerprint != fp:
                raise ValueError(
                    f"key {k.text} has fingerprint {k.fingerprint[:12]}..., but this store holds blocks of "
                    f"spec {fp[:12]}...; build keys with store.key(block_hash)"
                )

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, d in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + d)

    # -- the interface -------------------------------------------------------------------------
    @abstractmethod
    def exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Which keys have a record (a probe: the record is not read or verified).

        Returns:
            one bool per key, in order; ``False`` for every key when the store is unreachable.

        Raises:
            ValueError: a key has another spec's fingerprint.
        """

    @abstractmethod
    def get(self, keys: Sequence[StoreKey]) -> list[BlockData | None]:
        """Read and verify the blocks of ``keys``.

        Returns:
            one entry per key, in order: the block's :data:`BlockData` (CPU
            tensors, per-block shapes and dtypes of the spec), or ``None`` for a
            miss, a rejected record (removed from the store) or an I/O failure.

        Raises:
            ValueError: a key has another spec's fingerprint.
        """

    @abstractmethod
    def put(self, items: Sequence[tuple[StoreKey, BlockData]]) -> list[bool]:
        """Store blocks; each is written whole or not at all.

        Every block is validated against the spec before anything is written;
        an I/O failure drops (part of) the batch without raising, apart from the
        log and the ``errors`` counter.

        Returns:
            Per item, whether the store holds it now (written, or held already):
            ``False`` for one an I/O failure or a size cap dropped, so callers
            count and announce (KV events) only what was stored.

        Raises:
            ValueError: a key has another spec's fingerprint.
            KVCacheLayoutError: a block's layers, tensor names, dtypes or shapes
                differ from the spec (names the layer, tensor, expected and actual).
        """

    def close(self) -> None:
        """Release connections and files; the store must not be used afterwards."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
