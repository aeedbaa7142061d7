"""The KV connector in two halves, vLLM v1's verbs: a scheduler half that decides, a worker half that moves bytes.

Modelled on vLLM's ``KVConnectorBase_V1`` (``kv_connector/v1/base.py``), so a third-party store plugs in the same
way and kvpage plugs into vLLM:

* **scheduler half** (:class:`KVConnectorScheduler`, tensor-free): how many tokens after the device hits a tier
  holds (``get_num_new_matched_tokens``), what to load once blocks are allocated (``update_state_after_alloc``),
  the step's transfers as data (``build_connector_meta`` -> :class:`~kvpage.cache.step_plan.ConnectorMetadata`),
  what the worker reported (``update_connector_output``), the blocks a finished request leaves held
  (``request_finished``);
* **worker half** (:class:`KVConnectorWorker`): ``start_load_kv`` performs a step's transfers,
  ``wait_for_layer_load`` / ``save_kv_layer`` / ``wait_for_save`` frame a forward pass, ``get_finished`` reports what
  is done (:class:`~kvpage.cache.step_plan.TransferReport`).

Nothing in the scheduler half assumes a transfer completes when it is issued: a request whose loads are in
flight is not computed (:meth:`KVConnectorScheduler.loading_from`) until the worker reports them, whether that is
within the step (kvpage's synchronous CPU tiers) or steps later. :class:`TieredConnector` is kvpage's own scheduler
half (host tier, disk and Redis stores, swap preemption, over
:class:`~kvpage.cache.tiers.offload.OffloadManager`); its worker half is
:class:`~kvpage.cache.tiers.host.TieredWorker`.

The cache's sequence (:class:`~kvpage.cache.kv_cache.KVCache`)::

    m = device hits;  ext = c.get_num_new_matched_tokens(req_id, hashes_after_m, m.num_cached_tokens, max_tokens)
    c.reserve_sources(ext); blocks = allocate(...); c.update_state_after_alloc(req_id, new_blocks, ext, ...)
    meta = c.build_connector_meta()                       # -> the step plan -> worker.start_load_kv(meta)
    up = c.update_connector_output(worker.get_finished())  # loads landed (or cut short), held blocks to release
    c.on_block_changes(stored, evicted)                   # write policies and stores
    keep = c.request_finished(req_id)                     # held blocks: case C10
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpage.cache.step_plan import ConnectorMetadata, TransferReport
from kvpage.cache.tiers.offload import OffloadManager
from kvpage.cache.tiers.transfer import Transfer
from kvpage.cache.tiers.types import BlockLoad, OffloadStats


@dataclass(frozen=True, slots=True)
class ExternalMatch:
    """Blocks after a device match that a tier holds (from :meth:`KVConnectorScheduler.get_num_new_matched_tokens`).

    Attributes:
        loads: where each block comes from, in order.
        num_tokens: tokens they hold (``len(loads) * block_size``, except a swap-in's last block, which may be
            partial).
    """

    loads: tuple[BlockLoad, ...] = ()
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ConnectorUpdate:
    """What :meth:`KVConnectorScheduler.update_connector_output` learnt from the worker's report.

    Attributes:
        loaded: request -> tokens its finished loads brought after its device hits: the whole run, or fewer when
            a source missed at read time (the run is cut at the first block that did not arrive).
        released: ``(request, device blocks)`` held for its loads after it was freed, whose loads completed or were
            abandoned at their deadline (give them back to the pool); one entry per time the request was freed with
            loads in flight (a request preempted twice while loading has two).
    """

    loaded: dict[str, int] = field(default_factory=dict)
    released: tuple[tuple[str, tuple[int, ...]], ...] = ()


class KVConnectorScheduler(ABC):
    """The scheduler half of a KV connector: decides what moves; never touches a tensor.

    Block ids are device block ids; hashes are the cache's chained block hashes.
    """

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int, max_tokens: int
    ) -> ExternalMatch:
        """Tokens after the device hits that this tier can load (no side effects).

        Args:
            request_id: the request.
            block_hashes: hashes of its full blocks after the device hits, up to ``max_tokens``.
            num_computed_tokens: tokens the device serves (whole blocks).
            max_tokens: at most this many tokens in all (``len(tokens) - 1``).
        """

    @abstractmethod
    def reserve_sources(self, match: ExternalMatch) -> None:
        """Keep the sources of ``match`` from being reused until its loads are issued and acknowledged.

        Raises:
            ValueError: a source is gone (a stale match); nothing is kept then.
        """

    @abstractmethod
    def release_sources(self, match: ExternalMatch) -> None:
        """Undo :meth:`reserve_sources` (the device blocks for ``match`` could not be allocated)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request_id: str, device_ids: Sequence[int], match: ExternalMatch, device_hits: Sequence[int],
        device_hit_hashes: Sequence[bytes],
    ) -> None:
        """Issue the loads of ``match`` (sources reserved) into the fresh device blocks ``device_ids``; the request
        is loading (:meth:`loading_from`) until the worker reports them."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """The transfers issued (and loads abandoned) since the last call, in order, for the worker half."""

    @abstractmethod
    def update_connector_output(self, report: TransferReport) -> ConnectorUpdate:
        """Process the worker half's report; also abandons held loads past their deadline (case C10)."""

    @abstractmethod
    def loading_from(self, request_id: str) -> int | None:
        """Index of the request's first block still receiving a load, or ``None`` when nothing is in flight."""

    @abstractmethod
    def request_finished(self, request_id: str, *, preempted: bool = False) -> tuple[int, ...]:
        """The request finished, was aborted or (``preempted``) will come back: the device blocks this tier keeps
        until their loads end. A finished request's swapped-out copy is dropped; a preempted one's is kept."""

    @abstractmethod
    def on_block_changes(self, stored: Sequence[tuple[int, bytes]], evicted: Sequence[tuple[int, bytes]]) -> None:
        """``(block id, hash)`` pairs that entered and left the device prefix index (evicted ones first; their KV is
        intact until the worker's next forward pass): the tier's write policy may save them."""

    @abstractmethod
    def swap_out(self, request_id: str, device_ids: Sequence[int], num_tokens: int) -> bool:
        """Copy a preempted request's blocks out to resume it later; ``False``: recompute instead."""

    @abstractmethod
    def stats(self) -> OffloadStats:
        """The tier's counters."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and handles; no call may follow."""


class KVConnectorWorker(ABC):
    """The worker half of a KV connector: performs the transfers the scheduler half issued; decides nothing."""

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Begin a step's transfers, in order (saves that read device blocks run before anything overwrites them);
        drop the abandoned loads of ``meta.cancelled`` that have not run."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until the loads a forward pass reads in layer ``layer_index`` are done (only loads of requests the
        pass computes; default: they are done when :meth:`start_load_kv` returns)."""

    def save_kv_layer(self, layer_index: int) -> None:
        """Layer ``layer_index`` of a forward pass wrote its KV (kvpage's tiers save whole cached blocks through
        :meth:`start_load_kv` instead; default nothing)."""

    def wait_for_save(self) -> None:
        """Block until the saves a later pass could overwrite have read their blocks (default: done already)."""

    @abstractmethod
    def get_finished(self) -> TransferReport:
        """Transfers finished since the last call."""

    def close(self) -> None:
        """Release connections and handles (default nothing)."""


@dataclass(slots=True)
class _Loading:
    """Loads into a request's blocks ``[start, start + len(device_ids))`` in flight."""

    start: int
    device_ids: list[int]
    transfers: list[tuple[Transfer, tuple[int, ...]]]
    num_blocks: int
    num_tokens: int

    def done(self) -> bool:
        return all(t.acknowledged or t.cancelled for t, _ in self.transfers)

    def arrived(self, block_size: int) -> int:
        """Tokens that arrived: the run up to its first block a transfer did not write."""
        cut = self.num_blocks
        for t, idxs in self.transfers:
            n = t.num_done if t.acknowledged else 0
            if n < len(idxs):
                cut = min(cut, idxs[n])
        return self.num_tokens if cut == self.num_blocks else cut * block_size


@dataclass(slots=True)
class _Held:
    """Device blocks of a freed request still receiving loads (case C10)."""

    request_id: str
    device_ids: list[int]
    transfers: list[Transfer]
    deadline: float


class TieredConnector(KVConnectorScheduler):
    """kvpage's host tier, stores and swap preemption behind the scheduler half's verbs.

    Args:
        offload: the tier policy (host pool, store probes, transfer bookkeeping, write policies).
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
        """Host, store or swapped-out blocks after the device hits (see :class:`KVConnectorScheduler`).

        A request swapped out by :meth:`swap_out` gets its own host blocks back (its whole computed prefix, partial
        last block included); otherwise the next block hashes are looked up in the host tier, then each store.
        """
        block_size = self.block_size
        d = num_computed_tokens // block_size
        swap = self.offload.swap_loads(request_id, d, max_tokens, block_size)
        if swap is not None:
            loads, num_tokens = swap
            return ExternalMatch(tuple(loads), max(num_tokens - num_computed_tokens, 0))
        loads = self.offload.lookup(block_hashes)
        return ExternalMatch(tuple(loads), len(loads) * block_size)

    def reserve_sources(self, match: ExternalMatch) -> None:
        """Refuse a stale host source, then pin the host blocks ``match`` reads (a write-back must not take them)."""
        self.offload.check_loads(match.loads)
        self.offload.pin_sources(match.loads)

    def release_sources(self, match: ExternalMatch) -> None:
        """Unpin what :meth:`reserve_sources` pinned."""
        ids = [ld.host_block for ld in match.loads if ld.host_block >= 0]
        if ids:
            assert self.offload.host is not None
            self.offload.host.unpin(ids)

    def update_state_after_alloc(
        self, request_id: str, device_ids: Sequence[int], match: ExternalMatch, device_hits: Sequence[int],
        device_hit_hashes: Sequence[bytes],
    ) -> None:
        """Issue the loads and count the device hits for the write policy."""
        if match.loads:
            transfers = self.offload.begin_loads(request_id, match.loads, device_ids)
            self._loading[request_id] = _Loading(len(device_hits), list(device_ids), transfers, len(match.loads),
                                                 match.num_tokens)
        self.offload.drop_swapped(request_id)  # swapped out, but the device still held all of it (or it recomputes)
        if device_hits:
            self.offload.on_device_hits(device_hits, device_hit_hashes)

    def loading_from(self, request_id: str) -> int | None:
        """First block index of the request still receiving a load, or ``None``."""
        ld = self._loading.get(request_id)
        return None if ld is None else ld.start

    def build_connector_meta(self) -> ConnectorMetadata:
        """The ops issued since the last call (loads, backups, store writes, swap-outs) and the cancelled loads."""
        return self.offload.take_metadata()

    # -- completion ------------------------------------------------------------------------------
    def update_connector_output(self, report: TransferReport) -> ConnectorUpdate:
        """Acknowledge what the worker finished; report requests whose loads all landed (with the tokens that
        arrived) and held blocks that may go back. A held load past its deadline is cancelled (a late completion is
        then ignored, C10)."""
        o = self.offload
        o.acknowledge(report)
        loaded = {rid: ld.arrived(self.block_size) for rid, ld in self._loading.items() if ld.done()}
        for rid in loaded:
            del self._loading[rid]
        released: list[tuple[str, tuple[int, ...]]] = []
        if self._held:
            now = o.clock()
            keep: list[_Held] = []
            for h in self._held:
                if all(t.acknowledged or t.cancelled for t in h.transfers):
                    released.append((h.request_id, tuple(h.device_ids)))
                elif now >= h.deadline:
                    for t in h.transfers:
                        o.cancel(t)
                    released.append((h.request_id, tuple(h.device_ids)))
                else:
                    keep.append(h)
            self._held = keep
        return ConnectorUpdate(loaded, tuple(released))

    def request_finished(self, request_id: str, *, preempted: bool = False) -> tuple[int, ...]:
        """Drop the request's swapped-out copy (unless ``preempted``); hold its blocks still receiving loads until
        they land or their deadline passes."""
        if not preempted:
            self.offload.drop_swapped(request_id)
        ld = self._loading.pop(request_id, None)
        if ld is None:
            return ()
        pending = [t for t, _ in ld.transfers if not (t.acknowledged or t.cancelled)]
        if not pending:
            return ()
        deadline = self.offload.clock() + self.offload.config.load_deadline_s
        self._held.append(_Held(request_id, ld.device_ids, pending, deadline))
        return tuple(ld.device_ids)

    # -- saving ----------------------------------------------------------------------------------
    def on_block_changes(self, stored: Sequence[tuple[int, bytes]], evicted: Sequence[tuple[int, bytes]]) -> None:
        """``write_back`` saves evicted blocks to the host tier; the write policy and the stores take stored ones."""
        for b, h in evicted:
            self.offload.on_device_evicted(b, h)
        if stored:
            self.offload.on_cached([b for b, _ in stored], [h for _, h in stored])

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
        """Close every store (the worker half shares them in one process)."""
        for _, store in self.offload.stores:
            store.close()
