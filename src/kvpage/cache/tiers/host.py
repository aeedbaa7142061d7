"""The worker half of kvpage's tiers, and the factory that wires both halves of an engine's tiers together.

:class:`HostTier` moves whole blocks -- every layer (main and draft/MTP) and every tensor of the layer's format:
K, V and all scales (case C07) -- between the device caches and the host blocks that
:meth:`~kvpage.cache.controller.CacheController.initialize_host_cache` allocated (pinned when the device is
CUDA), and between the device caches and store records (:func:`~kvpage.cache.tiers.stores.blocks.gather_blocks` /
:func:`~kvpage.cache.tiers.stores.blocks.scatter_blocks`). :class:`TieredWorker` is the connector's worker half
over it: it performs the :class:`~kvpage.cache.step_plan.TransferOp` s the scheduler half
(:class:`~kvpage.cache.tiers.connector.TieredConnector`) issued and reports what is done.

Device<->host copies run on the worker's :class:`~kvpage.cache.tiers.copy_stream.CopyStream`: at once on a CPU
device (a transfer is done when :meth:`TieredWorker.start_load_kv` returns), on a CUDA copy stream of their own
on a CUDA device, reported done when their event has completed (saves fence the compute stream). Store
transfers run at once on the compute stream (their records pass through the host). A worker may also defer its
loads (``load_delay``, to test in-flight states).

:func:`build_tiers` is what ``LLM(swap_space=..., kv_offload_policy=..., preemption_mode=..., kv_disk_dir=...,
kv_store=...)`` calls: vLLM's ``swap_space`` (GiB of host blocks) and ``preemption_mode``, SGLang HiCache's write
policies, LMCache's local-disk and remote (Redis) backends.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.step_plan import ConnectorMetadata, TransferOp, TransferReport
from kvpage.cache.tiers.connector import KVConnectorWorker, TieredConnector
from kvpage.cache.tiers.copy_stream import CopyStream, copy_stream_for
from kvpage.cache.tiers.host_pool import HostBlockPool
from kvpage.cache.tiers.offload import OffloadManager
from kvpage.cache.tiers.policy import OffloadConfig
from kvpage.cache.tiers.stores import BlockData, KVStore, StoreURL, open_store, parse_store_url
from kvpage.cache.tiers.stores.blocks import gather_blocks, scatter_blocks
from kvpage.cache.tiers.types import WindowSlots

#: Bytes in one GiB (``swap_space`` is in GiB, as in vLLM).
GIB = 1 << 30

logger = logging.getLogger(__name__)


class HostTier:
    """Block copies between a controller's device caches, its host caches and :data:`BlockData`.

    Args:
        controller: owns the device and host tensors (``device_caches``,
            ``host_caches``); read at each call, so a re-allocated device pool
            (``LLM.reset_kv_cache``) is followed.

    Attributes:
        bytes_per_block: bytes of one block, all layers and scales (``spec.bytes_per_block``).
    """

    def __init__(self, controller: CacheController) -> None:
        self.controller = controller
        self.spec = controller.spec
        self.bytes_per_block = controller.spec.bytes_per_block

    @property
    def device(self) -> torch.device:
        """The device tier's device (the controller's)."""
        return self.controller.device

    @property
    def num_host_blocks(self) -> int:
        """Host blocks allocated by the controller."""
        return self.controller.num_host_blocks

    def _rows(self, window_rows: Sequence[int | None] | None, n: int) -> dict[int, Sequence[int | None]] | None:
        """The window layers' rows of a batch of ``n`` blocks (``None`` without window layers)."""
        layers = self.controller.window_layers
        if not layers:
            return None
        if window_rows is None or len(window_rows) != n:
            raise ValueError(f"layers {sorted(layers)} keep their rows in window slots: pass one window row per "
                             f"block ({n} blocks, got {None if window_rows is None else len(window_rows)})")
        return dict.fromkeys(layers, window_rows)

    def device_to_host(
        self, device_ids: Sequence[int], host_ids: Sequence[int], window_rows: Sequence[int | None] | None = None,
        layers: Sequence[int] | None = None, *, synchronize: bool = True,
    ) -> None:
        """Copy device blocks to host blocks: K, V and every scale (``CacheController.swap_out``).

        Args:
            device_ids: source device block ids.
            host_ids: destination host block ids (same length, no repeats).
            layers: global layer indices to copy (the per-layer path, as layer-wise
                offload does); default every layer, main and draft.
            window_rows: each device block's window slot in the controller's ``window_layers`` (``None``: it
                holds none, and those layers of its host block are not written); needed with window layers.
            synchronize: return once the copies landed (else they are only issued on the current stream).

        Raises:
            ValueError / IndexError: mismatched lengths, repeated destinations, ids out of range.
            KVPageError: a layer lacks device or host tensors.
        """
        self.controller.swap_out(list(device_ids), list(host_ids), layers, window_rows, synchronize=synchronize)

    def host_to_device(
        self, host_ids: Sequence[int], device_ids: Sequence[int], window_rows: Sequence[int | None] | None = None,
        layers: Sequence[int] | None = None, *, synchronize: bool = True,
    ) -> None:
        """Copy host blocks to device blocks (``CacheController.swap_in``; ``window_rows`` per device block and
        ``synchronize`` as :meth:`device_to_host`); errors as :meth:`device_to_host`."""
        self.controller.swap_in(list(host_ids), list(device_ids), layers, window_rows, synchronize=synchronize)

    def gather(self, device_ids: Sequence[int], window_rows: Sequence[int | None] | None = None) -> list[BlockData]:
        """One :data:`BlockData` (CPU tensors, per-block shapes of the spec) per device block.

        ``window_rows``: each block's window slot (every one held: a store record is a whole block), needed when
        the controller has window layers (``ValueError`` otherwise, or for a ``None`` row).
        """
        ids = list(device_ids)
        return gather_blocks(self.controller.device_caches, self.spec, ids, rows=self._rows(window_rows, len(ids)))

    def scatter(self, device_ids: Sequence[int], datas: Sequence[BlockData],
                window_rows: Sequence[int | None] | None = None) -> None:
        """Write store blocks into device blocks; everything is checked against the spec before a byte is written.

        ``window_rows``: each device block's window slot (``None``: outside every window, its window layers are
        not written), needed when the controller has window layers.

        Raises:
            KVCacheLayoutError: a block disagrees with the spec (names the layer and tensor).
            ValueError / IndexError: bad ids.
        """
        ids = list(device_ids)
        scatter_blocks(self.controller.device_caches, self.spec, ids, list(datas), rows=self._rows(window_rows, len(ids)))

    def gather_host(self, host_ids: Sequence[int]) -> list[BlockData]:
        """One :data:`BlockData` per host block (for tests and debugging)."""
        return gather_blocks(self.controller.host_caches, self.spec, list(host_ids))


def host_blocks_for_swap_space(controller: CacheController, swap_space_gib: float) -> int:
    """Host blocks that fit in ``swap_space_gib`` GiB: ``floor(swap_space * 2**30 / spec.bytes_per_block)``.

    Raises:
        ValueError: negative or non-finite ``swap_space_gib``, or a positive one too small for one block.
    """
    if isinstance(swap_space_gib, bool) or not (float(swap_space_gib) >= 0) or swap_space_gib == float("inf"):
        raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {swap_space_gib!r}")
    per_block = controller.spec.bytes_per_block
    n = int(float(swap_space_gib) * GIB) // per_block
    if swap_space_gib > 0 and n == 0:
        raise ValueError(
            f"swap_space={swap_space_gib} GiB holds no block of {per_block} bytes; raise it to at least "
            f"{per_block / GIB:.6f} GiB or use 0 for no host tier"
        )
    return n


class TieredWorker(KVConnectorWorker):
    """The worker half of kvpage's tiers: performs each step's transfers over a :class:`HostTier` and the stores.

    Ops run in issue order (a save that reads a device block runs before a later load that writes it) and are
    reported finished in that order. Device<->host copies go to ``copy_stream`` and count as finished once its
    fence is done; each save also fences the compute stream, so no later pass overwrites a block it reads. Store
    ops run at once on the compute stream, after the device<->host copies issued before them (they read or write
    device blocks those copies may touch). A ``store_to_device`` load writes the leading blocks whose records arrive
    and stops at the first one that does not (missing, rejected, unreachable), reporting how many it wrote; a
    ``device_to_store`` save reports the records its stores did not take; a transfer that raises is reported as
    having written nothing.

    Args:
        tier: moves blocks between the controller's device and host tensors and records.
        stores: the stores, in the scheduler half's order (its ops name them by index).
        load_delay: report loads done only this many :meth:`get_finished` calls after :meth:`start_load_kv`, and
            perform them then (0: at once). Saves always run at once (a later pass may overwrite what they read).
            For tests of loads that land steps later, as a remote or asynchronous worker's do.
        copy_stream: where device<->host copies run; default :func:`~kvpage.cache.tiers.copy_stream.copy_stream_for`
            the controller's device (a CUDA copy stream on CUDA, at once elsewhere).

    Raises:
        ValueError: a negative ``load_delay``.
    """

    def __init__(self, tier: HostTier, stores: Sequence[KVStore] = (), *, load_delay: int = 0,
                 copy_stream: CopyStream | None = None) -> None:
        if load_delay < 0:
            raise ValueError(f"load_delay must be >= 0, got {load_delay}")
        self.tier = tier
        self.stores = list(stores)
        self.load_delay = load_delay
        self.copy_stream = copy_stream_for(tier.device) if copy_stream is None else copy_stream
        self._issued: list[tuple[int, object]] = []  # (op id, fence) in issue order, not yet reported
        self._written: dict[int, int] = {}
        self._unsaved: dict[int, tuple[tuple[int, int], ...]] = {}
        self._deferred: list[list[TransferOp]] = []  # loads waiting, one list per get_finished call to come

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Drop cancelled deferred loads, then run ``meta``'s ops in order (deferring loads by ``load_delay``)."""
        if meta.cancelled:
            gone = set(meta.cancelled)
            self._deferred = [[op for op in batch if op.op_id not in gone] for batch in self._deferred]
        for op in meta.ops:
            if op.is_load and self.load_delay:
                while len(self._deferred) < self.load_delay:
                    self._deferred.append([])
                self._deferred[self.load_delay - 1].append(op)
            else:
                self._run(op)

    def _run(self, op: TransferOp) -> None:
        """Perform ``op`` (or issue it on the copy stream) and record it; a transfer that raises wrote nothing (the
        scheduler half treats its blocks as not arrived or not saved: a failing tier never fails a request)."""
        try:
            if op.kind in ("device_to_host", "host_to_device"):
                self._issued.append((op.op_id, self._issue_copy(op)))
                return
            n = self._perform(op)
        except Exception as exc:  # noqa: BLE001 -- the tier is a cache: report the failure, never raise it
            logger.warning("tier transfer %d (%s of %d blocks) failed: %s: %s", op.op_id, op.kind,
                           len(op.device_ids), type(exc).__name__, exc)
            n = 0
        if n < len(op.device_ids):
            self._written[op.op_id] = n
        self._issued.append((op.op_id, None))

    def _issue_copy(self, op: TransferOp) -> object:
        """Issue a device<->host op on the copy stream; returns its fence (a save's also fences the compute)."""
        rows = None if op.window_rows is None else list(op.window_rows)
        if op.kind == "device_to_host":
            fence = self.copy_stream.run(
                lambda: self.tier.device_to_host(op.device_ids, op.host_ids, rows, synchronize=False))
            self.copy_stream.fence_compute(fence)
        else:
            fence = self.copy_stream.run(
                lambda: self.tier.host_to_device(op.host_ids, op.device_ids, rows, synchronize=False))
        return fence

    def _perform(self, op: TransferOp) -> int:
        """Do the store transfer ``op`` now; returns the leading blocks written."""
        # a store op touches device blocks: after the copies issued before it and not yet reported (one stream:
        # the last one's fence covers the others; a reported copy has landed)
        fences = [fence for _, fence in self._issued if fence is not None]
        if fences:
            self.copy_stream.fence_compute(fences[-1])
        rows = None if op.window_rows is None else list(op.window_rows)
        if op.kind == "device_to_store":
            datas = self.tier.gather(op.device_ids, rows)
            unsaved: list[tuple[int, int]] = []
            for k, store in enumerate(self.stores):
                named = [i for i, t in enumerate(op.targets) if k in t]
                if named:
                    held = store.put([(store.key(op.block_hashes[i]), datas[i]) for i in named])
                    unsaved += [(i, k) for i, ok in zip(named, held) if not ok]
            if unsaved:
                self._unsaved[op.op_id] = tuple(sorted(unsaved))
        elif op.kind == "store_to_device":
            store = self.stores[op.store]
            got = store.get([store.key(h) for h in op.block_hashes])
            n = next((i for i, d in enumerate(got) if d is None), len(got))
            if n:
                blocks = [d for d in got[:n] if d is not None]
                self.tier.scatter(op.device_ids[:n], blocks, None if rows is None else rows[:n])
            return n
        else:
            raise ValueError(f"unknown transfer kind {op.kind!r}")
        return len(op.device_ids)

    def get_finished(self) -> TransferReport:
        """What finished since the last call, in issue order: the ops up to the first device<->host copy whose
        fence is not done yet (deferred loads whose delay ran out are performed or issued first)."""
        if self._deferred:
            for op in self._deferred.pop(0):
                self._run(op)
        k = 0
        while k < len(self._issued) and (self._issued[k][1] is None or self.copy_stream.done(self._issued[k][1])):
            k += 1
        finished, self._issued = [op_id for op_id, _ in self._issued[:k]], self._issued[k:]
        # an op reported later keeps its written count / unsaved records until then
        report = TransferReport(tuple(finished), {i: self._written.pop(i) for i in finished if i in self._written},
                                {i: self._unsaved.pop(i) for i in finished if i in self._unsaved})
        return report

    @property
    def num_deferred(self) -> int:
        """Loads waiting for their delay to run out."""
        return sum(len(b) for b in self._deferred)

    @property
    def num_unreported(self) -> int:
        """Ops performed or issued that :meth:`get_finished` has not reported yet."""
        return len(self._issued)

    def close(self) -> None:
        """Wait for every issued copy to land (their tensors stay valid until then)."""
        for _, fence in self._issued:
            if fence is not None:
                self.copy_stream.wait(fence)


def build_tiers(
    controller: CacheController,
    *,
    swap_space: float = 0.0,
    config: OffloadConfig | None = None,
    stores: Sequence[StoreURL | str] = (),
    supports_swap: bool = True,
    window_slots: WindowSlots | None = None,
    load_delay: int = 0,
) -> tuple[TieredConnector, TieredWorker] | None:
    """Allocate the host tier, open the stores and return both halves of the connector (``None`` when no tier is
    asked for).

    Args:
        controller: the engine's controller (device caches already allocated).
        swap_space: host tier size in GiB (vLLM's ``swap_space``); 0 = no host tier.
        config: the write policy, preemption mode (``swap`` needs ``swap_space > 0``; with a layer group that cannot
            swap, ``supports_swap=False``, it falls back to recompute), threshold and load deadline, validated
            already (``EngineConfig.offload``); default ``OffloadConfig()``.
        stores: the stores, probed in this order (``EngineConfig.kv_stores``: the disk store, then ``kv_store``).
        supports_swap: whether every layer group's blocks can be swapped out and back (the groups' kinds:
            block-wise formats keep a tail pool outside them).
        window_slots: where the window layers keep each block's rows, when the controller has window layers
            (the bounded sliding-window group's manager); ``ValueError`` when it has them and this is missing.
        load_delay: the worker half's (see :class:`TieredWorker`).

    Raises:
        ValueError: bad sizes; ``swap`` without a host tier; two stores of one tier name.
        CacheAllocationError: the host tier could not be allocated for some layer group (case C08).
    """
    config = config or OffloadConfig()
    if controller.window_layers and window_slots is None:
        raise ValueError(f"layers {sorted(controller.window_layers)} keep their device rows in window slots: "
                         "the tiers need window_slots to find them")
    n_host = host_blocks_for_swap_space(controller, swap_space)
    if config.preemption_mode == "swap" and n_host == 0:
        raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (GiB) > 0")
    if n_host == 0 and not stores:
        return None
    if config.preemption_mode == "swap" and not supports_swap:
        logger.warning("preemption_mode='swap' falls back to 'recompute' for quantize-on-seal KV formats "
                       "(%s): a request's partial last block lives in the tail pool, outside the swappable blocks",
                       ", ".join(sorted({g.layer.kv_format for g in controller.spec.groups})))
        config = replace(config, preemption_mode="recompute")
    opened: list[tuple[str, KVStore]] = []
    try:
        for url in stores:
            where = parse_store_url(url)
            opened.append((where.tier, open_store(where, controller.spec)))
        controller.initialize_host_cache(n_host)  # CacheAllocationError names the layer group (C08)
    except BaseException:
        for _, s in opened:
            s.close()
        raise
    host = HostBlockPool(controller.num_host_blocks) if n_host else None
    offload = OffloadManager(controller.spec.bytes_per_block, host, opened, config, window_slots=window_slots)
    worker = TieredWorker(HostTier(controller), [s for _, s in opened], load_delay=load_delay)
    return TieredConnector(offload, controller.spec.block_size), worker
