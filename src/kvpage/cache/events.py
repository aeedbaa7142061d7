"""``KVEventBus``: the prefix index's stored/removed events, for subscribers, a drainable buffer and a tier connector.

Routers and other engines follow a cache through these events (vLLM's and
SGLang's ``BlockStored`` / ``BlockRemoved``); the scheduler's side of the tiers
reads the same changes as ``(block id, hash)`` pairs. The pool builds events
only while someone listens. Tensor-free.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from kvpage.cache.prefix_cache import BlockRemoved, BlockStored, KVCacheEvent, PrefixBlockPool

__all__ = ["BlockRemoved", "BlockStored", "KVCacheEvent", "KVEventBus"]


class KVEventBus:
    """Fan-out of one pool's events (it wires itself to ``pool.on_event`` while anyone listens).

    Args:
        pool: the pool whose events it carries (owned by the same manager).
        buffer: keep events for :meth:`drain`.
        max_buffered: the buffer keeps the newest this many events.
        record_changes: keep ``(block id, hash)`` pairs of stored and removed blocks for :meth:`take_changes`.
    """

    def __init__(self, pool: PrefixBlockPool, *, buffer: bool = False, max_buffered: int = 1_000_000,
                 record_changes: bool = False) -> None:
        self._pool = pool
        self._buffer: deque[KVCacheEvent] | None = deque(maxlen=max_buffered) if buffer else None
        self._subscribers: list[Callable[[KVCacheEvent], None]] = []
        self.records_changes = record_changes
        self._stored: list[tuple[int, bytes]] = []
        self._removed: list[tuple[int, bytes]] = []
        self._wire()

    def _wire(self) -> None:
        listening = self._buffer is not None or bool(self._subscribers) or self.records_changes
        self._pool.on_event = self._emit if listening else None

    def _emit(self, event: KVCacheEvent) -> None:
        if self.records_changes:
            (self._stored if isinstance(event, BlockStored) else self._removed).append(
                (event.block_id, event.block_hash))
        if self._buffer is not None:
            self._buffer.append(event)
        for cb in self._subscribers:
            cb(event)

    def subscribe(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every future event, in order; returns a function that unsubscribes it."""
        self._subscribers.append(callback)
        self._wire()

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)
            self._wire()

        return unsubscribe

    def drain(self) -> Iterator[KVCacheEvent]:
        """Buffered events since the last drain, oldest first (empty without ``buffer``); emptied as consumed."""
        buf = self._buffer
        while buf:
            yield buf.popleft()

    def take_changes(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """``(stored, removed)`` ``(block id, hash)`` pairs since the last call, in order (needs ``record_changes``)."""
        stored, removed = self._stored, self._removed
        self._stored, self._removed = [], []
        return stored, removed
