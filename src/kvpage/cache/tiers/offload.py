"""``OffloadManager``: the tensor-free policy of the tiers below the device — host tier, stores, swap.

The scheduler half of the tier connector (:class:`~kvpage.cache.tiers.connector.TieredConnector`) calls it at
five points of a block's life; every copy it decides on is issued as a
:class:`~kvpage.cache.step_plan.TransferOp` (plain data) that the connector's worker half performs
(:class:`~kvpage.cache.tiers.host.TieredWorker`), and its effects on the bookkeeping wait for the worker's
report (:mod:`kvpage.cache.tiers.transfer`):

* **lookup** (``match``): when a request's prefix runs past the device hits, the next block hashes are looked
  up in the host tier, then probed in each store in order (disk, Redis; one batched ``exists`` each); per block
  the first tier that has it serves it, and the run stops at the first block no tier has (vLLM's
  ``get_num_new_matched_tokens`` of its offloading / LMCache connectors).
* **load** (``allocate``): host hits are copied into freshly allocated device blocks ("swap in"), store hits
  are read by the worker and scattered into them. A record that misses at read time (rejected, expired, a Redis
  that went away) cuts the run there: the worker reports how many blocks it wrote, and the rest is computed.
* **cached** (``cache``): the write policy backs blocks up to the host tier (SGLang HiCache's
  ``--hicache-write-policy``):

  - ``write_through``: every block, as soon as it is cached (hashed, written);
  - ``write_through_selective``: once a block has been used ``write_through_threshold`` times (the request that
    computed it counts once, each later prefix hit once; default 2, SGLang's threshold for this policy);
  - ``write_back``: only when the device evicts it (the save is issued before the id is reused, and the worker
    performs it before the pass that could overwrite the block).

  Every newly cached block is also written to every store (write-through to stores, LMCache's default), keyed
  ``StoreKey(spec.fingerprint, block_hash)``, except to the store it was just loaded from (and blocks loaded
  from the host tier, which were written when first cached). ``OffloadConfig.store_reads`` / ``store_writes``
  turn the store half of lookup and of this off (a ``kv_producer`` / ``kv_consumer``, :mod:`kvpage.cache.tiers.disagg`).
* **preempt** (``preemption_mode="swap"``, vLLM's ``swap_space`` / ``preemption_mode``): a preempted request's
  written blocks are copied to host blocks it owns and its device blocks are freed; on readmission they are
  loaded back into fresh device blocks (after any of its full blocks still cached on the device). When the host
  tier has no room, or its copy is not acknowledged yet, the request is recomputed instead.
* **acknowledge** (:meth:`OffloadManager.acknowledge`): the worker's report; host blocks become readable or
  free, pins drop, hits are counted.

In-flight rules (cases C09, C10): a host block targeted by a device->host copy is never handed out until the
copy is acknowledged (:class:`~kvpage.cache.tiers.host_pool.HostBlockPool`); host blocks a load reads are pinned
until the load is acknowledged; loads into device blocks of an aborted request are held by the connector until
they complete or ``load_deadline_s`` passes (:meth:`OffloadManager.cancel` then drops a late completion and tells
the worker to drop the load).
"""
from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from kvpage.cache.prefix_cache import BlockStored, KVCacheEvent
from kvpage.cache.step_plan import ConnectorMetadata, TransferOp, TransferReport
from kvpage.cache.tiers.host_pool import HostBlockPool, HostBlockState
from kvpage.cache.tiers.policy import DIRECTIONS, OffloadConfig
from kvpage.cache.tiers.transfer import Transfer, TransferQueue
from kvpage.cache.tiers.types import BlockLoad, OffloadStats, StoreLike, SwapRecord, WindowSlots


def _hash_of(load: BlockLoad) -> bytes:
    """The block hash of a host or store load (only a swap load of a partial block has none)."""
    assert load.block_hash is not None, f"a {load.tier} load without a block hash"
    return load.block_hash


class OffloadManager:
    """Host tier, stores and swap preemption for one device cache (scheduler side).

    Args:
        bytes_per_block: bytes of one block across every layer (``CacheSpec.bytes_per_block``), for the counters.
        host: host block bookkeeping, or ``None`` for no host tier (stores only).
        stores: ``(tier name, store)`` pairs, probed in this order (e.g. disk before Redis); only their ``key`` and
            ``exists`` are used here (the worker reads and writes them).
        config: policies.
        queue: the transfer bookkeeping (default a new one).
        clock: monotonic seconds, for load deadlines (tests pass a fake clock).
        window_slots: where the bounded sliding-window layers keep each block's device rows, for a model that has
            them (:class:`~kvpage.cache.tiers.types.WindowSlots`); resolved when a copy is issued, from the slot a
            block held at eviction for a ``write_back`` copy. Host blocks remember whether they got window rows
            (:attr:`BlockLoad.window`); a block without them is not written to a store, so a store record is whole.

    Raises:
        ValueError: ``preemption_mode="swap"`` without a host tier, or repeated tier names.
    """

    def __init__(
        self,
        bytes_per_block: int,
        host: HostBlockPool | None = None,
        stores: Sequence[tuple[str, StoreLike]] = (),
        config: OffloadConfig | None = None,
        queue: TransferQueue | None = None,
        clock: Callable[[], float] = time.monotonic,
        window_slots: WindowSlots | None = None,
    ) -> None:
        self.bytes_per_block = int(bytes_per_block)
        self.host = host if host is not None and host.num_blocks > 0 else None
        self.stores = list(stores)
        self.config = config or OffloadConfig()
        self.queue = queue or TransferQueue()
        self.clock = clock
        self.window_slots = window_slots
        self._no_window: set[int] = set()  # host blocks written without the window layers' rows
        names = ["device", "host", *(n for n, _ in self.stores)]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique and not 'device'/'host', got {[n for n, _ in self.stores]}")
        if self.config.preemption_mode == "swap" and self.host is None:
            raise ValueError("preemption_mode='swap' needs a host tier (swap_space > 0)")
        self._tier_hits = {n: 0 for n in names[1:] if n != "host" or self.host is not None}
        self._bytes = dict.fromkeys(DIRECTIONS, 0)
        self._use_counts: dict[bytes, int] = {}  # write_through_selective: uses per cached device block hash
        self._loaded_from: OrderedDict[bytes, int] = OrderedDict()  # hash -> -1 (host) or store index, until cached
        self._swapped: dict[str, SwapRecord] = {}
        self._on_cancel: dict[int, Callable[[], None]] = {}
        self._backups = self._dropped = self._swap_out = self._swap_in = self._swap_fallbacks = 0
        self._on_event: Callable[[str, KVCacheEvent], None] | None = None

    def record_events(self, record: Callable[[str, KVCacheEvent], None]) -> None:
        """Report each tier's index changes to ``record(tier name, event)`` (KV cache events; off by default).

        The host tier reports blocks entering its index (copy acknowledged) and leaving it (evicted by an
        allocation); each store reports the blocks a write-through wrote to it (acknowledged by the worker), never
        their removals: the worker's store evicts on its own (a size-capped disk store) or the server does (Redis
        TTL / ``maxmemory``), unseen by the scheduler. Events carry the hash alone (no tokens, no parent).
        """
        self._on_event = record
        if self.host is not None:
            self.host.on_event = lambda ev: record("host", ev)

    def _rows(self, device_ids: Sequence[int], *, evicted: bool = False) -> tuple[int | None, ...] | None:
        """The window rows of these device blocks (``None`` without window layers); ``evicted``: the slots they held
        when the device evicted them."""
        w = self.window_slots
        if w is None:
            return None
        return tuple(w.evicted_rows_of(device_ids) if evicted else w.rows_of(device_ids))

    def _mark_window(self, host_ids: Sequence[int], rows: Sequence[int | None] | None) -> None:
        """Remember which host blocks got their window rows (``rows`` from :meth:`_rows`)."""
        for h, r in zip(host_ids, rows if rows is not None else [0] * len(host_ids)):
            if r is None:
                self._no_window.add(h)
            else:
                self._no_window.discard(h)

    # -- transfers -------------------------------------------------------------------------------
    def _op(self, kind: str, device_ids: Sequence[int], **fields: Any) -> TransferOp:
        """A new op of ``kind`` over ``device_ids`` (the other :class:`~kvpage.cache.step_plan.TransferOp` fields as
        keywords)."""
        return TransferOp(self.queue.new_id(), kind, tuple(int(d) for d in device_ids), **fields)

    def _submit(self, op: TransferOp, direction: str, *, on_ack: Callable[[Transfer], None] | None = None,
                on_cancel: Callable[[], None] | None = None,
                blocks: Callable[[Transfer], int] | None = None) -> Transfer:
        """Issue ``op``; once acknowledged its bytes are counted in ``direction`` (``blocks(transfer)`` blocks, default
        the ones it wrote) and ``on_ack`` runs; ``on_cancel`` runs if it is cancelled instead."""

        def acked(t: Transfer) -> None:
            self._on_cancel.pop(t.transfer_id, None)
            self._bytes[direction] += (t.num_done if blocks is None else blocks(t)) * self.bytes_per_block
            if on_ack is not None:
                on_ack(t)

        t = self.queue.submit(op, len(op.device_ids) * self.bytes_per_block, acked)
        if on_cancel is not None:
            self._on_cancel[op.op_id] = on_cancel
        return t

    def take_metadata(self) -> ConnectorMetadata:
        """The ops issued (and loads cancelled) since the last call, for the worker half."""
        return self.queue.take_metadata()

    def acknowledge(self, report: TransferReport) -> list[Transfer]:
        """Process the worker's report (host blocks become readable or free, pins drop, hits are counted)."""
        return self.queue.acknowledge(report)

    def cancel(self, transfer: Transfer) -> bool:
        """Abandon a pending load (its deadline passed): release what it pinned; a late completion is ignored.

        Returns:
            Whether it was pending.
        """
        if not self.queue.cancel(transfer):
            return False
        cb = self._on_cancel.pop(transfer.transfer_id, None)
        if cb is not None:
            cb()
        return True

    # -- lookup and load -------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes]) -> list[BlockLoad]:
        """Sources for the longest run of ``block_hashes`` held below the device (side-effect free).

        Per block the host tier wins, then the stores in order; the run stops at the first block no tier has.
        Stores are probed with one batched ``exists`` each, only when the host tier does not cover the run.
        """
        if not block_hashes:
            return []
        host_ids = [self.host.lookup(h) if self.host is not None else None for h in block_hashes]
        first_miss = next((i for i, b in enumerate(host_ids) if b is None), len(block_hashes))
        probes: list[list[bool]] = []
        if first_miss < len(block_hashes) and self.config.store_reads:
            rest = block_hashes[first_miss:]
            for _, store in self.stores:
                probes.append(list(store.exists([store.key(h) for h in rest])))
        out: list[BlockLoad] = []
        for i, h in enumerate(block_hashes):
            hb = host_ids[i]
            if hb is not None:
                out.append(BlockLoad("host", h, host_block=hb, window=hb not in self._no_window))
                continue
            k = next((k for k, p in enumerate(probes) if p[i - first_miss]), None)
            if k is None:
                break
            out.append(BlockLoad(self.stores[k][0], h, store=k))
        return out

    def check_loads(self, loads: Sequence[BlockLoad]) -> None:
        """Raise ``ValueError`` if a host source of ``loads`` no longer holds its block (a stale match)."""
        for ld in loads:
            if ld.tier == "host":
                assert self.host is not None
                if ld.block_hash is None or self.host.lookup(ld.block_hash) != ld.host_block:
                    raise ValueError(
                        f"stale match: host block {ld.host_block} no longer holds its block; call match "
                        "again right before allocate"
                    )
            elif ld.tier == "swap":
                assert self.host is not None
                if self.host.state(ld.host_block) is not HostBlockState.OWNED:
                    raise ValueError(f"stale match: swapped host block {ld.host_block} was released")

    def pin_sources(self, loads: Sequence[BlockLoad]) -> None:
        """Pin the host blocks ``loads`` read, so no allocation can reuse them before the loads run."""
        ids = [ld.host_block for ld in loads if ld.host_block >= 0]
        if ids:
            assert self.host is not None
            self.host.pin(ids)

    def begin_loads(self, request_id: str, loads: Sequence[BlockLoad],
                    device_ids: Sequence[int]) -> list[tuple[Transfer, tuple[int, ...]]]:
        """Issue the loads of ``loads`` (pinned by :meth:`pin_sources`) into fresh device blocks ``device_ids``.

        Host and swap sources go by one host->device op, each store's by one store->device op the worker reads
        and scatters (a record missing at read time cuts that op short; the caller computes the request's loaded
        run from the reports). A swapped request's swap record is consumed: its host blocks outside the loads are
        freed now, the loaded ones once their copy is acknowledged.

        Returns:
            Each transfer with the positions in ``loads`` it covers, in order.

        Raises:
            ValueError: ``len(device_ids) != len(loads)``.
        """
        if len(device_ids) != len(loads):
            raise ValueError(f"{len(device_ids)} device blocks for {len(loads)} loads")
        swap = self._swapped.pop(request_id, None) if any(ld.tier == "swap" for ld in loads) else None
        if swap is not None:
            assert self.host is not None  # (a swap record exists only with a host tier)
            loading = {ld.host_block for ld in loads}
            self.host.free_owned([b for b in swap.host_ids if b not in loading])
            self._swap_in += len(loading)
        out: list[tuple[Transfer, tuple[int, ...]]] = []
        host_idx = tuple(i for i, ld in enumerate(loads) if ld.host_block >= 0)
        if host_idx:
            assert self.host is not None  # (host and swap loads come only from a host tier)
            hids = [loads[i].host_block for i in host_idx]
            dids = [int(device_ids[i]) for i in host_idx]
            owned = [loads[i].host_block for i in host_idx if loads[i].tier == "swap"]
            counted = [loads[i] for i in host_idx if loads[i].tier != "swap"]

            def release_host(host: HostBlockPool = self.host, hids: list[int] = hids, owned: list[int] = owned) -> None:
                host.unpin(hids)
                if owned:
                    host.free_owned(owned)

            def host_loaded(t: Transfer, counted: list[BlockLoad] = counted) -> None:
                release_host()
                for ld in counted[: t.num_done]:
                    self._tier_hits[ld.tier] += 1
                    self._remember_source(_hash_of(ld), ld.store)

            op = self._op("host_to_device", dids, host_ids=tuple(hids), window_rows=self._rows(dids))
            t = self._submit(op, "host_to_device", on_ack=host_loaded, on_cancel=release_host)
            out.append((t, host_idx))
        by_store: dict[int, list[int]] = defaultdict(list)
        for i, ld in enumerate(loads):
            if ld.store >= 0:
                by_store[ld.store].append(i)
        for k, idxs in by_store.items():
            dids = [int(device_ids[i]) for i in idxs]
            store_loads = [loads[i] for i in idxs]

            def store_loaded(t: Transfer, store_loads: list[BlockLoad] = store_loads) -> None:
                for ld in store_loads[: t.num_done]:
                    self._tier_hits[ld.tier] += 1
                    self._remember_source(_hash_of(ld), ld.store)

            op = self._op("store_to_device", dids, window_rows=self._rows(dids),
                          block_hashes=tuple(_hash_of(ld) for ld in store_loads), store=k)
            t = self._submit(op, "store_read", on_ack=store_loaded)
            out.append((t, tuple(idxs)))
        return out

    def _remember_source(self, block_hash: bytes, store: int) -> None:
        self._loaded_from[block_hash] = store
        self._loaded_from.move_to_end(block_hash)
        while len(self._loaded_from) > 1 << 16:
            self._loaded_from.popitem(last=False)

    # -- writes ----------------------------------------------------------------------------------
    def backup(self, device_ids: Sequence[int], block_hashes: Sequence[bytes], *, evicted: bool = False) -> list[int]:
        """Copy device blocks to the host tier and index them there once the copy is acknowledged.

        Blocks the host tier already holds (or is writing) are skipped; when fewer host blocks are free or
        evictable than needed, the rest are dropped (counted in ``backups_dropped``). Never takes a host block
        with a copy in flight or a pinned one (C09). ``evicted``: the device just evicted the blocks (window rows
        come from the slots they held then).

        Returns:
            The host blocks written (in ``device_ids`` order of the blocks backed up).
        """
        if self.host is None:
            return []
        pairs: list[tuple[int, bytes]] = []
        seen: set[bytes] = set()
        for d, h in zip(device_ids, block_hashes):
            if h in seen:
                continue
            seen.add(h)
            if self.host.contains(h):
                b = self.host.lookup(h)
                if b is not None:
                    self.host.touch(b)
                continue
            pairs.append((int(d), h))
        room = self.host.num_free + self.host.num_evictable
        if len(pairs) > room:
            self._dropped += len(pairs) - room
            pairs = pairs[:room]
        if not pairs:
            return []
        dids = [d for d, _ in pairs]
        hids = self.host.allocate(len(pairs), [h for _, h in pairs])
        self._backups += len(pairs)
        rows = self._rows(dids, evicted=evicted)
        self._mark_window(hids, rows)
        self._submit(self._op("device_to_host", dids, host_ids=tuple(hids), window_rows=rows), "device_to_host",
                     on_ack=self._written(hids))
        return hids

    def _written(self, hids: list[int], request_id: str | None = None) -> Callable[[Transfer], None]:
        """The acknowledgement of a copy into host blocks ``hids``: the blocks it wrote become cached (or owned), the
        others go back to the free list (the copy failed); a swap-out (``request_id``) that did not write every
        block is dropped (the request is recomputed)."""
        host = self.host
        assert host is not None

        def written(t: Transfer) -> None:
            for i, b in enumerate(hids):
                if i < t.num_done:
                    host.finish_write(b)
                else:
                    host.abort_write(b)
            if request_id is not None and t.num_done < len(hids):
                rec = self._swapped.pop(request_id, None)
                if rec is not None:
                    host.free_owned(rec.host_ids[: t.num_done])

        return written

    def on_cached(self, device_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """Blocks entered the device prefix index: apply the host write policy and write them through to the stores."""
        if not device_ids:
            return
        pol = self.config.write_policy
        if pol == "write_through":
            self.backup(device_ids, block_hashes)
        elif pol == "write_through_selective":
            self._count_uses(device_ids, block_hashes)
        sources = [self._loaded_from.pop(h, None) for h in block_hashes]
        if not self.stores or not self.config.store_writes:
            return
        rows = self._rows(device_ids)
        whole = rows if rows is not None else (0,) * len(device_ids)  # a record is a whole block
        targets = [tuple(k for k in range(len(self.stores)) if src is None or (src >= 0 and src != k))
                   if whole[i] is not None else () for i, src in enumerate(sources)]
        need = [i for i, t in enumerate(targets) if t]
        if not need:
            return
        op = self._op("device_to_store", [device_ids[i] for i in need],
                      window_rows=None if rows is None else tuple(rows[i] for i in need),
                      block_hashes=tuple(block_hashes[i] for i in need), targets=tuple(targets[i] for i in need))
        saved_targets = [targets[i] for i in need]

        def records_saved(t: Transfer) -> int:
            """Records the stores took: those of the blocks the worker got to, less the ones a store dropped."""
            return sum(len(tg) for tg in saved_targets[: t.num_done]) - len(t.unsaved)

        on_ack = None
        if self._on_event is not None:
            record = self._on_event
            wrote = [(int(device_ids[i]), block_hashes[i], targets[i]) for i in need]

            def on_ack(t: Transfer) -> None:
                for k, (name, _) in enumerate(self.stores):  # one run per store, in the op's order
                    for j, (d, h, tg) in enumerate(wrote[: t.num_done]):
                        if k in tg and (j, k) not in t.unsaved:
                            record(name, BlockStored(h, None, (), d))

        self._submit(op, "store_write", blocks=records_saved, on_ack=on_ack)

    def on_device_hits(self, device_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """A request reused cached device blocks (counts a use for ``write_through_selective``)."""
        if self.config.write_policy == "write_through_selective":
            self._count_uses(device_ids, block_hashes)

    def _count_uses(self, device_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        hot_d: list[int] = []
        hot_h: list[bytes] = []
        for d, h in zip(device_ids, block_hashes):
            n = self._use_counts.get(h, 0) + 1
            self._use_counts[h] = n
            if n >= self.config.write_through_threshold:
                hot_d.append(d)
                hot_h.append(h)
        if hot_d:
            self.backup(hot_d, hot_h)

    def on_device_evicted(self, device_id: int, block_hash: bytes) -> None:
        """A cached device block is being evicted (before its id is reused): ``write_back`` copies it to the host tier."""
        self._use_counts.pop(block_hash, None)
        if self.config.write_policy == "write_back":
            self.backup([device_id], [block_hash], evicted=True)

    # -- swap preemption ---------------------------------------------------------------------------
    def swap_loads(
        self, request_id: str, first_block: int, max_tokens: int, block_size: int
    ) -> tuple[list[BlockLoad], int] | None:
        """The loads that swap a preempted request back in, from its block ``first_block`` on.

        Args:
            request_id: the request.
            first_block: blocks before it are served otherwise (device hits).
            max_tokens: at most this many tokens come back (``len(tokens) - 1``: the last token is always computed,
                so the step yields logits).
            block_size: tokens per block.

        Returns:
            ``(loads, tokens they restore)``, or ``None`` when the request is not swapped out or its swap-out copy
            is not acknowledged yet (it is recomputed then; its record goes when it is admitted).
        """
        rec = self._swapped.get(request_id)
        if rec is None or not rec.transfer.acknowledged:
            return None
        num_tokens = max(min(rec.num_tokens, max_tokens), 0)
        last = -(-num_tokens // block_size)
        return [BlockLoad("swap", None, host_block=b, window=b not in self._no_window)
                for b in rec.host_ids[first_block:last]], num_tokens

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's blocks are in the host tier waiting for a swap-in."""
        return request_id in self._swapped

    def swap_out(self, request_id: str, device_ids: Sequence[int], num_tokens: int) -> bool:
        """Copy a preempted request's blocks (holding ``num_tokens`` tokens) to host blocks it owns.

        Returns:
            ``False`` (nothing done; recompute instead) without a host tier, with no blocks, or when fewer host
            blocks are free or evictable than needed.

        Raises:
            ValueError: the request is already swapped out.
        """
        if request_id in self._swapped:
            raise ValueError(f"request {request_id!r} is already swapped out")
        n = len(device_ids)
        if self.host is None or n == 0 or not self.host.can_allocate(n):
            if n:
                self._swap_fallbacks += 1
            return False
        dids = [int(d) for d in device_ids]
        hids = self.host.allocate(n)
        rows = self._rows(dids)
        self._mark_window(hids, rows)
        t = self._submit(self._op("device_to_host", dids, host_ids=tuple(hids), window_rows=rows), "device_to_host",
                         on_ack=self._written(hids, request_id))
        self._swapped[request_id] = SwapRecord(tuple(hids), int(num_tokens), t)
        self._swap_out += n
        return True

    def drop_swapped(self, request_id: str) -> bool:
        """Free a swapped-out request's host blocks (it finished or was aborted while waiting, or was admitted
        without them). Blocks whose swap-out copy is still in flight are freed when it is acknowledged.

        Returns:
            Whether the request was swapped out.
        """
        rec = self._swapped.pop(request_id, None)
        if rec is None:
            return False
        assert self.host is not None  # (a swap record exists only with a host tier)
        self.host.free_owned(rec.host_ids)
        return True

    # -- stats -----------------------------------------------------------------------------------
    def stats(self, *, num_held_blocks: int = 0) -> OffloadStats:
        """Counters now (see :class:`~kvpage.cache.tiers.types.OffloadStats`).

        Args:
            num_held_blocks: device blocks the connector holds for loads of freed requests (it owns that count).
        """
        h = self.host
        return OffloadStats(
            tier_hits=dict(self._tier_hits),
            tier_bytes=dict(self._bytes),
            store_rejected=sum(int(getattr(s.stats, "rejected", 0)) for _, s in self.stores),
            store_errors=sum(int(getattr(s.stats, "errors", 0)) for _, s in self.stores),
            num_host_blocks=h.num_blocks if h else 0,
            num_host_free=h.num_free if h else 0,
            num_host_evictable=h.num_evictable if h else 0,
            num_host_busy=h.num_busy if h else 0,
            backups=self._backups,
            backups_dropped=self._dropped,
            swapped_out_blocks=self._swap_out,
            swapped_in_blocks=self._swap_in,
            swap_fallbacks=self._swap_fallbacks,
            pending_transfers=self.queue.num_pending,
            num_held_blocks=num_held_blocks,
        )
