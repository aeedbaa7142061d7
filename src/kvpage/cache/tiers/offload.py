"""``OffloadManager``: the tensor-free policy of the tiers below the device — host tier, stores, swap.

The :class:`~kvpage.cache.manager.KVCacheManager` calls it at four points of a
block's life; the data moves through a :class:`BlockMover` (the tensor side,
:class:`kvpage.cache.tiers.host.HostTier`) as :class:`~kvpage.cache.tiers.transfer.Transfer`
operations, so this module never touches a tensor:

* **lookup** (``match_prefix``): when a request's prefix runs past the device
  hits, the next block hashes are looked up in the host tier, then in each
  store in order (disk, Redis); per block the first tier that has it serves it,
  and the run stops at the first block no tier has (vLLM's
  ``get_num_new_matched_tokens`` of its offloading / LMCache connectors).
* **load** (``allocate_slots``): host hits are copied into freshly allocated
  device blocks ("swap in"), store hits are read (one batched ``get`` per
  store) and scattered into them. A store miss at load time (a record that was
  rejected, expired, or a Redis that went away) truncates the run there; the
  rest is recomputed.
* **cached** (``cache_blocks``): the write policy backs blocks up to the host
  tier (SGLang HiCache's ``--hicache-write-policy``):

  - ``write_through``: every block, as soon as it is cached (hashed, written);
  - ``write_through_selective``: once a block has been used ``write_through_threshold``
    times (the request that computed it counts once, each later prefix hit once;
    default 2, SGLang's threshold for this policy);
  - ``write_back``: only when the device evicts it.

  Every newly cached block is also ``put`` to every store (write-through to
  stores, LMCache's default), keyed ``StoreKey(spec.fingerprint, block_hash)``,
  except to the store it was just loaded from (and blocks loaded from the host
  tier, which were put when first cached).
* **preempt** (:mod:`kvpage.cache.tiers.swap`; ``preemption_mode="swap"``, vLLM's ``swap_space`` /
  ``preemption_mode``): a preempted request's written blocks are copied to host
  blocks it owns and its device blocks are freed; on readmission they are
  loaded back into fresh device blocks (after any of its full blocks still
  cached on the device). When the host tier has no room, the request is
  recomputed instead.

In-flight rules (cases C09, C10): a host block targeted by a device->host copy
is never handed out until the copy is acknowledged (:class:`~kvpage.cache.tiers.host_pool.HostBlockPool`);
host blocks a load reads are pinned until the load is acknowledged; loads into
device blocks of an aborted request are held by the manager until they
complete or ``load_deadline_s`` passes (:meth:`OffloadManager.cancel` then
drops a late completion).
"""
from __future__ import annotations

import functools
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from kvpage.cache.tiers.host_pool import HostBlockPool, HostBlockState
from kvpage.cache.tiers.policy import DIRECTIONS, OffloadConfig
from kvpage.cache.tiers.swap import SwapPreemption
from kvpage.cache.tiers.transfer import Transfer, TransferQueue
from kvpage.cache.tiers.types import BlockLoad, BlockMover, LoadResult, OffloadStats, StoreLike, SwapRecord, WindowSlots


def _hash_of(load: BlockLoad) -> bytes:
    """The block hash of a host or store load (only a swap load of a partial block has none)."""
    assert load.block_hash is not None, f"a {load.tier} load without a block hash"
    return load.block_hash


class OffloadManager(SwapPreemption):
    """Host tier, stores and swap preemption for one :class:`~kvpage.cache.manager.KVCacheManager`.

    Args:
        mover: copies block data (the tensor side).
        host: host block bookkeeping, or ``None`` for no host tier (stores only).
        stores: ``(tier name, store)`` pairs, looked up in this order (e.g. disk before Redis).
        config: policies.
        queue: the transfer queue (default a synchronous one).
        clock: monotonic seconds, for load deadlines (tests pass a fake clock).
        window_slots: where the bounded sliding-window layers keep each block's device rows, for a model that has
            them (:class:`~kvpage.cache.tiers.types.WindowSlots`); resolved when a copy is issued (the forward
            pass that could reuse a slot waits for every copy: ``fence``), from the slot a block held at eviction
            for a ``write_back`` copy. Host blocks remember whether they got window rows
            (:attr:`BlockLoad.window`); a block without them is not put to a store, so a store record is whole.

    Raises:
        ValueError: ``preemption_mode="swap"`` without a host tier, or repeated tier names.
    """

    def __init__(
        self,
        mover: BlockMover,
        host: HostBlockPool | None = None,
        stores: Sequence[tuple[str, StoreLike]] = (),
        config: OffloadConfig | None = None,
        queue: TransferQueue | None = None,
        clock: Callable[[], float] = time.monotonic,
        window_slots: WindowSlots | None = None,
    ) -> None:
        self.mover = mover
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

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers, scales included)."""
        return int(self.mover.bytes_per_block)

    def _rows(self, device_ids: Sequence[int], *, evicted: bool = False) -> dict[str, list[int | None]]:
        """The mover's ``window_rows`` argument for these device blocks (none without window layers); ``evicted``:
        the slots they held when the device evicted them."""
        w = self.window_slots
        if w is None:
            return {}
        return {"window_rows": list(w.evicted_window_rows(device_ids) if evicted else w.window_rows(device_ids))}

    def _mark_window(self, host_ids: Sequence[int], rows: dict[str, list[int | None]]) -> None:
        """Remember which host blocks got their window rows (``rows`` from :meth:`_rows`)."""
        for h, r in zip(host_ids, rows.get("window_rows", [0] * len(host_ids))):
            if r is None:
                self._no_window.add(h)
            else:
                self._no_window.discard(h)

    # -- transfers -------------------------------------------------------------------------------
    def _submit(
        self,
        kind: str,
        direction: str,
        src: Sequence[int],
        dst: Sequence[int],
        run: Callable[[], None] | None,
        on_ack: Callable[[], None],
        on_cancel: Callable[[], None] | None = None,
    ) -> Transfer:
        nbytes = len(dst) * self.block_bytes

        def acked(t: Transfer) -> None:
            self._on_cancel.pop(t.transfer_id, None)
            self._bytes[direction] += nbytes
            on_ack()

        t = self.queue.submit(kind, src, dst, nbytes, run, acked)
        if on_cancel is not None and not t.acknowledged:
            self._on_cancel[t.transfer_id] = on_cancel
        return t

    def poll(self) -> list[Transfer]:
        """Acknowledge finished transfers (host blocks become readable or free, pins drop)."""
        return self.queue.poll()

    def wait(self, transfers: Sequence[Transfer] | None = None) -> None:
        """Block until the transfers (default all pending) are done, and acknowledge them."""
        self.queue.wait(transfers)

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

        Per block the host tier wins, then the stores in order; the run stops
        at the first block no tier has. Stores are probed with one batched
        ``exists`` each, only when the host tier does not cover the run.
        """
        if not block_hashes:
            return []
        host_ids = [self.host.lookup(h) if self.host is not None else None for h in block_hashes]
        first_miss = next((i for i, b in enumerate(host_ids) if b is None), len(block_hashes))
        probes: list[list[bool]] = []
        if first_miss < len(block_hashes):
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
                        f"stale match: host block {ld.host_block} no longer holds its block; call match_prefix "
                        "again right before allocate_slots"
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

    def unpin_sources(self, loads: Sequence[BlockLoad]) -> None:
        """Undo :meth:`pin_sources` (the allocation did not happen, or the loads were dropped)."""
        ids = [ld.host_block for ld in loads if ld.host_block >= 0]
        if ids:
            assert self.host is not None
            self.host.unpin(ids)

    def begin_loads(self, request_id: str, loads: Sequence[BlockLoad], device_ids: Sequence[int]) -> LoadResult:
        """Load ``loads`` (pinned by :meth:`pin_sources`) into fresh device blocks ``device_ids``.

        Store records are read now, one batched ``get`` per store; the run is
        cut at the first record that misses (the caller recomputes from
        there). Host and swap sources are copied by a host->device transfer;
        store data by a scatter transfer. A swapped request's swap record is
        consumed: host blocks not loaded are freed now, loaded ones once their
        copy is acknowledged.

        Returns:
            How many leading loads are copied, and the transfers.

        Raises:
            ValueError: ``len(device_ids) != len(loads)``.
        """
        if len(device_ids) != len(loads):
            raise ValueError(f"{len(device_ids)} device blocks for {len(loads)} loads")
        datas: dict[int, Any] = {}
        by_store: dict[int, list[int]] = defaultdict(list)
        for i, ld in enumerate(loads):
            if ld.store >= 0:
                by_store[ld.store].append(i)
        for k, idxs in by_store.items():
            store = self.stores[k][1]
            for i, d in zip(idxs, store.get([store.key(_hash_of(loads[i])) for i in idxs])):
                datas[i] = d
        ok = next((i for i, ld in enumerate(loads) if ld.store >= 0 and datas[i] is None), len(loads))
        self.unpin_sources(loads[ok:])
        swap = self._swapped.pop(request_id, None) if any(ld.tier == "swap" for ld in loads) else None
        if swap is not None:
            assert self.host is not None  # (a swap record exists only with a host tier)
            loading = {ld.host_block for ld in loads[:ok]}
            self.host.free_owned([b for b in swap.host_ids if b not in loading])
            self._swap_in += len(loading)
        transfers: list[Transfer] = []
        host_idx = [i for i in range(ok) if loads[i].host_block >= 0]
        if host_idx:
            assert self.host is not None  # (host and swap loads come only from a host tier)
            hids = [loads[i].host_block for i in host_idx]
            dids = [int(device_ids[i]) for i in host_idx]
            owned = [loads[i].host_block for i in host_idx if loads[i].tier == "swap"]

            def release_host(host: HostBlockPool = self.host, hids: list[int] = hids, owned: list[int] = owned) -> None:
                host.unpin(hids)
                if owned:
                    host.free_owned(owned)

            transfers.append(self._submit(
                "host_to_device", "host_to_device", hids, dids,
                functools.partial(self.mover.host_to_device, hids, dids, **self._rows(dids)), release_host,
                release_host,
            ))
        for k, idxs in by_store.items():
            idxs = [i for i in idxs if i < ok]
            if not idxs:
                continue
            dids = [int(device_ids[i]) for i in idxs]
            blocks = [datas[i] for i in idxs]
            transfers.append(self._submit(
                "store_to_device", "store_read", (), dids,
                functools.partial(self.mover.scatter, dids, blocks, **self._rows(dids)), lambda: None,
            ))
        for ld in loads[:ok]:
            if ld.tier != "swap":
                self._tier_hits[ld.tier] += 1
                self._remember_source(_hash_of(ld), ld.store)
        return LoadResult(ok, tuple(transfers))

    def _remember_source(self, block_hash: bytes, store: int) -> None:
        self._loaded_from[block_hash] = store
        self._loaded_from.move_to_end(block_hash)
        while len(self._loaded_from) > 1 << 16:
            self._loaded_from.popitem(last=False)

    # -- writes ----------------------------------------------------------------------------------
    def backup(self, device_ids: Sequence[int], block_hashes: Sequence[bytes], *, evicted: bool = False) -> list[int]:
        """Copy device blocks to the host tier and index them there once the copy is acknowledged.

        Blocks the host tier already holds (or is writing) are skipped; when
        fewer host blocks are free or evictable than needed, the rest are
        dropped (counted in ``backups_dropped``). Never takes a host block
        with a copy in flight or a pinned one (C09). ``evicted``: the device just
        evicted the blocks (window rows come from the slots they held then).

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

        def written(host: HostBlockPool = self.host, hids: list[int] = hids) -> None:
            for b in hids:
                host.finish_write(b)

        self._submit("device_to_host", "device_to_host", dids, hids,
                     lambda: self.mover.device_to_host(dids, hids, **rows), written)
        return hids

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
        if not self.stores:
            return
        rows = self._rows(device_ids)
        whole = rows.get("window_rows", [0] * len(device_ids))  # a record is a whole block
        todo = [[i for i, src in enumerate(sources) if (src is None or (src >= 0 and src != k)) and whole[i] is not None]
                for k in range(len(self.stores))]
        need = sorted({i for t in todo for i in t})
        if not need:
            return
        picked = {"window_rows": [whole[i] for i in need]} if rows else {}
        gathered = dict(zip(need, self.mover.gather([device_ids[i] for i in need], **picked)))
        for k, (_, store) in enumerate(self.stores):
            if todo[k]:
                store.put([(store.key(block_hashes[i]), gathered[i]) for i in todo[k]])
                self._bytes["store_write"] += len(todo[k]) * self.block_bytes

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
