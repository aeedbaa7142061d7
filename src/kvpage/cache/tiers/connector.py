"""``KVConnector``: the verbs the scheduler calls around the device KV-cache manager to use the tiers below it.

Modelled on the scheduler side of vLLM's v1 KV connector
(``kv_connector/v1/base.py``: ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``request_finished``, ``get_finished``), so a
third-party store can plug in by implementing :class:`KVConnector`.
:class:`TieredConnector` is kvpage's own: the host tier, the disk and Redis
stores and swap preemption of :class:`~kvpage.cache.tiers.offload.OffloadManager`.
Tensor-free; it imports nothing above :mod:`kvpage.cache`.

The scheduler's sequence (:class:`~kvpage.engine.kv_cache.SchedulerKVCache`)::

    m = manager.match_prefix(req)                                   # device hits
    ext = connector.get_num_new_matched_tokens(req_id, hashes_after_m, m.num_cached_tokens, max_tokens)
    blocks = manager.allocate_slots(req, n, m, num_external_tokens=ext.num_tokens)
    n_loaded = connector.update_state_after_alloc(req_id, blocks.new_block_ids[:len(ext.loads)], ext, ...)
    ...                                                             # forward pass after connector.fence()
    connector.on_blocks_stored(...) / on_blocks_evicted(...)        # write policies and stores
    keep = connector.request_finished(req_id); manager.free(req, keep=keep)   # held blocks: C10
    finished = connector.get_finished()                             # loads done, held blocks to release
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpage.cache.tiers.offload import OffloadManager
from kvpage.cache.tiers.transfer import Transfer
from kvpage.cache.tiers.types import BlockLoad, OffloadStats


@dataclass(frozen=True, slots=True)
class ExternalMatch:
    """Blocks after a device match that a tier holds (from :meth:`KVConnector.get_num_new_matched_tokens`).

    Attributes:
        loads: where each block comes from, in order.
        num_tokens: tokens they hold (``len(loads) * block_size``, except a swap-in's
            last block, which may be partial).
    """

    loads: tuple[BlockLoad, ...] = ()
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class FinishedTransfers:
    """What :meth:`KVConnector.get_finished` found done since the last call.

    Attributes:
        loaded: requests whose loads all landed (their loaded blocks may be indexed now).
        released: device blocks held for loads of freed requests that completed or were
            abandoned (give them back with ``KVCacheManager.release_held``).
    """

    loaded: tuple[str, ...] = ()
    released: tuple[int, ...] = ()


class KVConnector(ABC):
    """The scheduler-side interface of a KV tier below the device (host memory, disk, a shared store).

    Block ids are device block ids; hashes are the manager's chained block hashes.
    """

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int, max_tokens: int
    ) -> ExternalMatch:
        """Tokens after the device hits that this tier can load (side-effect free, but may wait for a swap-out).

        Args:
            request_id: the request.
            block_hashes: hashes of its full blocks after the device hits, up to ``max_tokens``.
            num_computed_tokens: tokens the device serves (whole blocks).
            max_tokens: at most this many tokens in all (``len(tokens) - 1``).
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request_id: str, device_ids: Sequence[int], match: ExternalMatch, device_hits: Sequence[int],
        device_hit_hashes: Sequence[bytes],
    ) -> int:
        """Start loading ``match`` into the fresh device blocks ``device_ids``; return the tokens that will arrive.

        A source that misses at read time cuts the run there (the rest is computed).
        """

    @abstractmethod
    def pin(self, match: ExternalMatch) -> None:
        """Keep the sources of ``match`` from being reused until :meth:`update_state_after_alloc` loads them."""

    @abstractmethod
    def check(self, match: ExternalMatch) -> None:
        """Raise ``ValueError`` if a source of ``match`` is gone (a stale match)."""

    @abstractmethod
    def loading_from(self, request_id: str) -> int | None:
        """Index of the request's first block still receiving a load, or ``None`` when nothing is in flight."""

    @abstractmethod
    def request_finished(self, request_id: str, *, preempted: bool = False) -> tuple[int, ...]:
        """The request finished, was aborted or (``preempted``) will come back: the device blocks this tier keeps
        until their loads end. A finished request's swapped-out copy is dropped; a preempted one's is kept."""

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Acknowledge finished copies; report loaded requests and held blocks to release."""

    @abstractmethod
    def on_blocks_stored(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Blocks entered the device prefix index: the tier's write policy may save them."""

    @abstractmethod
    def on_blocks_evicted(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Cached device blocks were evicted (their KV is intact until the next forward pass)."""

    @abstractmethod
    def swap_out(self, request_id: str, device_ids: Sequence[int], num_tokens: int) -> bool:
        """Copy a preempted request's blocks out to resume it later; ``False``: recompute instead."""

    @abstractmethod
    def wait(self, request_ids: Sequence[str] | None = None) -> None:
        """Block until the loads of ``request_ids`` (default every pending copy) are done."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Copies issued and not yet acknowledged."""

    @abstractmethod
    def stats(self) -> OffloadStats:
        """The tier's counters."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and handles; no call may follow."""


@dataclass(slots=True)
class _Loading:
    """Copies into a request's blocks ``[start, start + len(device_ids))`` in flight."""

    start: int
    device_ids: list[int]
    transfers: list[Transfer]


@dataclass(slots=True)
class _Held:
    """Device blocks of a freed request still receiving loads (case C10)."""

    device_ids: list[int]
    transfers: list[Transfer]
    deadline: float
    done: bool = field(default=False)


class TieredConnector(KVConnector):
    """kvpage's host tier, stores and swap preemption behind the connector verbs.

    Args:
        offload: the tier mechanics (host pool, stores, transfer queue, write policies).
        block_size: tokens per device block.

    Raises:
        ValueError: ``block_size < 1``.
    """

    def __init__(self, offload: OffloadManager, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.offload = offload
        self.block_size = block_size
        self._loading: dict[str, _Loading] = {}
        self._held: list[_Held] = []

    @property
    def preemption_mode(self) -> str:
        """``recompute`` or ``swap``."""
        return self.offload.config.preemption_mode

    # -- admission -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int, max_tokens: int
    ) -> ExternalMatch:
        """Host, store or swapped-out blocks after the device hits (see :class:`KVConnector`).

        A request swapped out by :meth:`swap_out` gets its own host blocks back
        (its whole computed prefix, partial last block included); otherwise the
        next block hashes are looked up in the host tier, then each store.
        """
        block_size = self.block_size
        d = num_computed_tokens // block_size
        swap = self.offload.swap_loads(request_id, d, max_tokens, block_size)
        if swap is not None:
            loads, num_tokens = swap
            return ExternalMatch(tuple(loads), max(num_tokens - num_computed_tokens, 0))
        loads = self.offload.lookup(block_hashes)
        return ExternalMatch(tuple(loads), len(loads) * block_size)

    def check(self, match: ExternalMatch) -> None:
        """Raise ``ValueError`` on a stale host source."""
        self.offload.check_loads(match.loads)

    def pin(self, match: ExternalMatch) -> None:
        """Pin the host blocks ``match`` reads (a write-back eviction must not take them)."""
        self.offload.pin_sources(match.loads)

    def update_state_after_alloc(
        self, request_id: str, device_ids: Sequence[int], match: ExternalMatch, device_hits: Sequence[int],
        device_hit_hashes: Sequence[bytes],
    ) -> int:
        """Begin the loads (pinned by :meth:`pin`) and count the device hits for the write policy."""
        n = 0
        if match.loads:
            res = self.offload.begin_loads(request_id, match.loads, device_ids)
            # cut short at a store miss: only whole blocks arrived (a swap-in's partial block is always last)
            n = match.num_tokens if res.num_loaded == len(match.loads) else res.num_loaded * self.block_size
            pending = [t for t in res.transfers if not t.acknowledged]
            if pending:
                self._loading[request_id] = _Loading(len(device_hits), list(device_ids[: res.num_loaded]), pending)
        self.offload.drop_swapped(request_id)  # swapped out, but the device still held all of it
        if device_hits:
            self.offload.on_device_hits(device_hits, device_hit_hashes)
        return n

    def loading_from(self, request_id: str) -> int | None:
        """First block index of the request still receiving a load, or ``None``."""
        ld = self._loading.get(request_id)
        return None if ld is None else ld.start

    # -- completion ------------------------------------------------------------------------------
    def request_finished(self, request_id: str, *, preempted: bool = False) -> tuple[int, ...]:
        """Drop the request's swapped-out copy (unless ``preempted``); hold its blocks still receiving loads until
        they land or their deadline passes."""
        if not preempted:
            self.offload.drop_swapped(request_id)
        ld = self._loading.pop(request_id, None)
        if ld is None:
            return ()
        pending = [t for t in ld.transfers if not t.acknowledged]
        if not pending:
            return ()
        deadline = self.offload.clock() + self.offload.config.load_deadline_s
        self._held.append(_Held(ld.device_ids, pending, deadline))
        return tuple(ld.device_ids)

    def get_finished(self) -> FinishedTransfers:
        """Poll the copy queue; report requests whose loads all landed and held blocks that may go back.

        A held load past its deadline is cancelled (a late completion is then ignored, C10).
        """
        o = self.offload
        o.poll()
        loaded = tuple(rid for rid, ld in self._loading.items() if all(t.acknowledged for t in ld.transfers))
        for rid in loaded:
            del self._loading[rid]
        released: list[int] = []
        if self._held:
            now = o.clock()
            keep: list[_Held] = []
            for h in self._held:
                if all(t.acknowledged or t.cancelled for t in h.transfers):
                    released.extend(h.device_ids)
                elif now >= h.deadline:
                    for t in h.transfers:
                        o.cancel(t)
                    released.extend(h.device_ids)
                else:
                    keep.append(h)
            self._held = keep
        return FinishedTransfers(loaded, tuple(released))

    def wait(self, request_ids: Sequence[str] | None = None) -> None:
        """Block until the loads of ``request_ids`` (default: every pending copy) are done (one copy stream:
        every copy issued before them finishes first)."""
        if request_ids is None:
            self.offload.wait()
            return
        todo = [t for rid in request_ids if rid in self._loading for t in self._loading[rid].transfers]
        if todo:
            self.offload.wait(todo)

    @property
    def num_pending(self) -> int:
        """Copies issued and not yet acknowledged."""
        return self.offload.queue.num_pending

    # -- saving ----------------------------------------------------------------------------------
    def on_blocks_stored(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Apply the host write policy and write the blocks through to the stores."""
        if blocks:
            self.offload.on_cached([b for b, _ in blocks], [h for _, h in blocks])

    def on_blocks_evicted(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """``write_back`` copies evicted blocks to the host tier."""
        for b, h in blocks:
            self.offload.on_device_evicted(b, h)

    def swap_out(self, request_id: str, device_ids: Sequence[int], num_tokens: int) -> bool:
        """Copy a preempted request's blocks to host blocks it owns (``swap`` mode only)."""
        if self.preemption_mode != "swap":
            return False
        return self.offload.swap_out(request_id, device_ids, num_tokens)

    # -- the rest --------------------------------------------------------------------------------
    @property
    def num_held_blocks(self) -> int:
        """Device blocks held for loads of freed requests (now)."""
        return sum(len(h.device_ids) for h in self._held)

    def stats(self) -> OffloadStats:
        """The tiers' counters, with the held device blocks."""
        return self.offload.stats(num_held_blocks=self.num_held_blocks)

    def close(self) -> None:
        """Close every store."""
        for _, store in self.offload.stores:
            store.close()
