"""``KVEventCollector``: gathers a KV cache's events between engine steps and hands each step's batch to a publisher.

It subscribes to :attr:`KVCache.events <kvpage.cache.kv_cache.KVCache.events>` (the prefix index's
``BlockStored`` / ``BlockRemoved``, medium :data:`~kvpage.cache.kv_events.wire.MEDIUM_DEVICE`) and, through
:meth:`KVEventCollector.record_tier` (given to
:meth:`OffloadManager.record_events <kvpage.cache.tiers.offload.OffloadManager.record_events>`), to the tiers below
it (host ``"CPU"``, disk ``"DISK"``, Redis ``"REMOTE"``: :func:`~kvpage.cache.kv_events.wire.medium_of`); recording
an event is one list append on the engine's thread. :meth:`publish` hands the records since the last call to the publisher as one
batch (vLLM publishes one batch per scheduler step). Tensor-free.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvpage.cache.kv_events.wire import MEDIUM_DEVICE, AllBlocksCleared, Record, medium_of
from kvpage.cache.prefix_cache import KVCacheEvent

logger = logging.getLogger(__name__)


class EventSink(Protocol):
    """What receives batches (:class:`~kvpage.cache.kv_events.publisher.ZmqEventPublisher`)."""

    def publish(self, records: list[Record]) -> int | None:
        """Queue one batch; never raises."""

    def close(self) -> None:
        """Stop publishing."""


class KVEventCollector:
    """Records of one engine's cache events, handed to ``sink`` one batch per :meth:`publish`.

    Args:
        subscribe: a cache's ``subscribe`` (``KVCache.subscribe``): called once with the device recorder.
        sink: the publisher.
    """

    def __init__(self, subscribe: Callable[[Callable[[KVCacheEvent], None]], Callable[[], None]],
                 sink: EventSink) -> None:
        self.sink = sink
        self._records: list[Record] = []
        self._unsubscribe = subscribe(self._on_device)

    def _on_device(self, event: KVCacheEvent) -> None:
        self._records.append((MEDIUM_DEVICE, event))

    def record_tier(self, tier: str, event: KVCacheEvent) -> None:
        """Record an event of the tier named ``tier`` (``"host"``, ``"disk"``, ``"redis"``) under its medium."""
        self._records.append((medium_of(tier), event))

    def cleared(self) -> None:
        """Record ``AllBlocksCleared`` (the device index is empty now; its removals were recorded before; vLLM's
        event names no medium, so lower tiers never send it)."""
        self._records.append((MEDIUM_DEVICE, AllBlocksCleared()))

    def take(self) -> list[Record]:
        """The records since the last call, oldest first (emptied)."""
        out, self._records = self._records, []
        return out

    def publish(self) -> None:
        """Hand the records since the last call to the sink as one batch (nothing without records). Never raises:
        a failing sink is logged, the engine goes on."""
        records = self.take()
        if not records:
            return
        try:
            self.sink.publish(records)
        except Exception:
            logger.exception("KV events: the publisher failed; %d events dropped", len(records))

    def close(self) -> None:
        """Publish what is left, unsubscribe and close the sink."""
        self.publish()
        self._unsubscribe()
        try:
            self.sink.close()
        except Exception:
            logger.exception("KV events: closing the publisher failed")
