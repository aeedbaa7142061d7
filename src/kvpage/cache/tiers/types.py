"""Small types the tiers' scheduler side exchanges: load sources, swap records, counters, the protocols of window
slots and stores. Tensor-free (imports only the transfer bookkeeping), so the connector, the offload policy and the
tests share them without cycles.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpage.cache.tiers.transfer import Transfer


class WindowSlots(Protocol):
    """Where a layer group whose rows are window slots keeps each block's rows (any
    :class:`~kvpage.cache.groups.GroupManager`: a bounded sliding-window group's answers slots); block ids are device
    block ids, ``None`` = no row."""

    def rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """Each block's row now."""

    def evicted_rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """The row each block held when the device evicted it in this scheduling pass (the row's content is intact
        until the next forward pass, though the row and the id may be handed out again)."""


class StoreLike(Protocol):
    """What the scheduler side of the tiers uses of a :class:`kvpage.cache.tiers.stores.base.KVStore` (the worker
    half reads and writes it)."""

    stats: Any

    def key(self, block_hash: bytes) -> Any:
        """The store key of ``block_hash`` (under the store's spec fingerprint)."""

    def exists(self, keys: Sequence[Any]) -> list[bool]:
        """Batched probe."""

    def close(self) -> None:
        """Release connections and handles."""


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Where one block of a match comes from, below the device.

    Attributes:
        tier: ``"host"``, ``"swap"`` (a swapped-out request's own host block) or a store's name (``"disk"``, ``"redis"``).
        block_hash: the block's chained hash (``None`` for a swap load of a partial block).
        host_block: the host block id for ``host`` and ``swap`` loads, else -1.
        store: index of the store in :attr:`OffloadManager.stores` for store loads, else -1.
        window: whether the source holds the block's rows of the bounded sliding-window layers (a block backed
            up after its window slot was gone holds only the other layers: usable before the window of a hit's
            end, :meth:`~kvpage.cache.groups.GroupManager.usable_external`); always true without such layers.
    """

    tier: str
    block_hash: bytes | None
    host_block: int = -1
    store: int = -1
    window: bool = True


@dataclass(frozen=True, slots=True)
class SwapRecord:
    """A swapped-out request's host copy.

    Attributes:
        host_ids: host block ``i`` holds the request's block ``i``.
        num_tokens: tokens whose KV the blocks hold (the request's computed tokens at preemption).
        transfer: the device->host copy.
    """

    host_ids: tuple[int, ...]
    num_tokens: int
    transfer: Transfer


@dataclass(frozen=True, slots=True)
class OffloadStats:
    """Counters of the tiers (monotonic since start unless noted).

    Attributes:
        tier_hits: tier name (``host`` and each store's name) -> blocks served from it to a request.
        tier_bytes: direction (:data:`DIRECTIONS`) -> payload bytes moved (blocks x ``bytes_per_block``).
        store_rejected: records stores refused (bad checksum, layout or key), summed over stores.
        store_errors: failed store I/O operations, summed over stores.
        num_host_blocks, num_host_free, num_host_evictable, num_host_busy: host block counts now.
        backups: blocks copied to the host tier by the write policy.
        backups_dropped: blocks the policy wanted to back up but the host tier had no free or evictable block for.
        swapped_out_blocks, swapped_in_blocks: blocks moved by swap preemption.
        swap_fallbacks: swap preemptions that fell back to recompute (no host room).
        pending_transfers: transfers issued and not yet acknowledged (now).
        num_held_blocks: device blocks held for loads of freed requests (now; case C10).
    """

    tier_hits: dict[str, int]
    tier_bytes: dict[str, int]
    store_rejected: int
    store_errors: int
    num_host_blocks: int
    num_host_free: int
    num_host_evictable: int
    num_host_busy: int
    backups: int
    backups_dropped: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    swap_fallbacks: int
    pending_transfers: int
    num_held_blocks: int = 0
