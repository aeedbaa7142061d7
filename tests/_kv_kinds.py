"""Shared harness of the tests of group kinds over the :class:`~kvpage.cache.kv_cache.KVCache` (test_kivi,
test_sliding_window, test_sealed_window, test_sliding_tiers).

* :func:`window_of`: the window-slot bookkeeping of a group list (a block-wise windowed group's
  :class:`~kvpage.cache.groups.SealedWindowManager` keeps it in ``.window``).
* :class:`OfferingConnector`: a tier connector's scheduler half that offers blocks after the device hits and records
  what it was asked and what it issued; it moves nothing (a test calls the cache's verbs, not a worker).
"""
from __future__ import annotations

from collections.abc import Sequence

from kvpage.cache.groups import GroupManager, SealedWindowManager, SlidingWindowManager
from kvpage.cache.step_plan import ConnectorMetadata, TransferReport
from kvpage.cache.tiers.connector import ConnectorUpdate, ExternalMatch, KVConnectorScheduler
from kvpage.cache.tiers.types import BlockLoad, OffloadStats


def window_of(groups: Sequence[GroupManager]) -> SlidingWindowManager:
    """The window slots' bookkeeping of the (one) group whose rows are window slots."""
    win = next(g for g in groups if g.kind.window_rows)
    if isinstance(win, SealedWindowManager):
        return win.window
    assert isinstance(win, SlidingWindowManager)
    return win


class OfferingConnector(KVConnectorScheduler):
    """Offers up to ``max_blocks`` host blocks after any device hit (whole blocks within ``max_tokens``, one per
    hash it is given), each holding its window rows.

    Attributes:
        asked: ``(request id, device tokens)`` of every ``get_num_new_matched_tokens``.
        issued: ``(request id, device block ids, tokens)`` of every ``update_state_after_alloc`` (the loads issued).
    """

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.asked: list[tuple[str, int]] = []
        self.issued: list[tuple[str, tuple[int, ...], int]] = []

    def get_num_new_matched_tokens(self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int,
                                   max_tokens: int) -> ExternalMatch:
        self.asked.append((request_id, num_computed_tokens))
        n = max(0, min(self.max_blocks, len(block_hashes), (max_tokens - num_computed_tokens) // self.block_size))
        loads = tuple(BlockLoad("host", h, host_block=i) for i, h in enumerate(block_hashes[:n]))
        return ExternalMatch(loads, n * self.block_size)

    def reserve_sources(self, match: ExternalMatch) -> None:
        pass

    def release_sources(self, match: ExternalMatch) -> None:
        pass

    def update_state_after_alloc(self, request_id: str, device_ids: Sequence[int], match: ExternalMatch,
                                 device_hits: Sequence[int], device_hit_hashes: Sequence[bytes]) -> None:
        if match.loads:
            self.issued.append((request_id, tuple(device_ids), match.num_tokens))

    def build_connector_meta(self) -> ConnectorMetadata:
        return ConnectorMetadata()

    def update_connector_output(self, report: TransferReport) -> ConnectorUpdate:
        return ConnectorUpdate()

    def loading_from(self, request_id: str) -> int | None:
        return None

    def request_finished(self, request_id: str, *, preempted: bool = False) -> tuple[int, ...]:
        return ()

    def on_block_changes(self, stored: Sequence[tuple[int, bytes]], evicted: Sequence[tuple[int, bytes]]) -> None:
        pass

    def swap_out(self, request_id: str, device_ids: Sequence[int], num_tokens: int) -> bool:
        return False

    def stats(self) -> OffloadStats:
        return OffloadStats({"host": sum(n for _, _, n in self.issued) // self.block_size}, {}, *[0] * 12)

    def close(self) -> None:
        pass
