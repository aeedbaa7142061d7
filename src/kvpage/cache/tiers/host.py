"""The host (CPU) tier's tensor side, and the factory that wires every tier of an engine together.

:class:`HostTier` moves whole blocks -- every layer (main and draft/MTP) and
every tensor of the layer's format: K, V and all scales (case C07) -- between
the device caches and the host blocks that
:meth:`~kvpage.cache.controller.CacheController.initialize_host_cache`
allocated (pinned when the device is CUDA), and between the device caches and
store records (:func:`~kvpage.cache.tiers.stores.blocks.gather_blocks` /
:func:`~kvpage.cache.tiers.stores.blocks.scatter_blocks`). It is the
:class:`~kvpage.cache.tiers.connector.BlockMover` of the tensor-free
:class:`~kvpage.cache.tiers.connector.OffloadManager`, which decides what moves when.

Copies are synchronous here (``CacheController`` synchronizes after a CUDA
copy), so every :class:`~kvpage.cache.tiers.transfer.Transfer` completes at issue;
the transfer bookkeeping around them is what keeps in-flight blocks safe when
copies are deferred (tests, and an asynchronous copy engine later).

:func:`build_offload` is what ``LLM(swap_space=..., kv_offload_policy=...,
preemption_mode=..., kv_disk_dir=..., kv_store=...)`` calls: vLLM's
``swap_space`` (GiB of host blocks) and ``preemption_mode``, SGLang HiCache's
write policies, LMCache's local-disk and remote (Redis) backends.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvpage.cache.controller import CacheController
from kvpage.cache.tiers.offload import OffloadManager
from kvpage.cache.tiers.host_pool import HostBlockPool
from kvpage.cache.tiers.policy import OffloadConfig
from kvpage.cache.tiers.stores import BlockData, KVStore, open_store
from kvpage.cache.tiers.stores.blocks import gather_blocks, scatter_blocks
from kvpage.cache.tiers.transfer import TransferQueue
from kvpage.cache.tiers.types import WindowSlots
from kvpage.formats import BlockFormat

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
        layers: Sequence[int] | None = None,
    ) -> None:
        """Copy device blocks to host blocks: K, V and every scale (``CacheController.swap_out``).

        Args:
            device_ids: source device block ids.
            host_ids: destination host block ids (same length, no repeats).
            layers: global layer indices to copy (the per-layer path, as layer-wise
                offload does); default every layer, main and draft.
            window_rows: each device block's window slot in the controller's ``window_layers`` (``None``: it
                holds none, and those layers of its host block are not written); needed with window layers.

        Raises:
            ValueError / IndexError: mismatched lengths, repeated destinations, ids out of range.
            KVPageError: a layer lacks device or host tensors.
        """
        self.controller.swap_out(list(device_ids), list(host_ids), layers, window_rows)

    def host_to_device(
        self, host_ids: Sequence[int], device_ids: Sequence[int], window_rows: Sequence[int | None] | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        """Copy host blocks to device blocks (``CacheController.swap_in``; ``window_rows`` per device block, as
        :meth:`device_to_host`); errors as :meth:`device_to_host`."""
        self.controller.swap_in(list(host_ids), list(device_ids), layers, window_rows)

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


def store_tier_name(url: str) -> str:
    """The tier name a store URL gets in metrics: ``redis`` for ``redis://``/``rediss://``/``unix://``, else ``disk``."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return "redis" if scheme in ("redis", "rediss", "unix") else "disk"


def build_offload(
    controller: CacheController,
    *,
    swap_space: float = 0.0,
    config: OffloadConfig | None = None,
    kv_disk_dir: str | None = None,
    kv_disk_max_bytes: int | None = None,
    kv_store: str | None = None,
    store_options: dict[str, Any] | None = None,
    queue: TransferQueue | None = None,
    supports_swap: bool = True,
    window_slots: WindowSlots | None = None,
) -> OffloadManager | None:
    """Allocate the host tier, open the stores and return the :class:`OffloadManager` (``None`` when no tier is asked for).

    Args:
        controller: the engine's controller (device caches already allocated).
        swap_space: host tier size in GiB (vLLM's ``swap_space``); 0 = no host tier.
        config: the write policy, preemption mode (``swap`` needs ``swap_space > 0``; with a layer
            group that cannot swap, ``supports_swap=False``, it falls back to recompute), threshold and
            load deadline, validated already (``EngineConfig.offload``); default ``OffloadConfig()``.
        kv_disk_dir: directory of a :class:`~kvpage.cache.tiers.stores.disk.DiskStore`, or ``None``.
        kv_disk_max_bytes: size cap of the disk store in bytes (LRU), ``None`` = unbounded.
        kv_store: ``redis://host:port/db`` of a shared :class:`~kvpage.cache.tiers.stores.redis.RedisStore`, or ``None``.
        store_options: extra keyword options for the Redis store (``ttl_seconds``, ``timeout_s``, ...).
        queue: the transfer queue (default synchronous).
        supports_swap: whether every layer group's blocks can be swapped out and back
            (``KVCacheManager.supports_swap``; block-wise formats keep a tail pool outside them).
        window_slots: where the window layers keep each block's rows, when the controller has window layers
            (the bounded sliding-window group's :class:`~kvpage.cache.groups.SlidingWindowManager`);
            ``ValueError`` when it has them and this is missing.

    Raises:
        ValueError: bad sizes; ``swap`` without a host tier; a disk cap without a disk store.
        CacheAllocationError: the host tier could not be allocated for some layer group (case C08).
    """
    config = config or OffloadConfig()
    if controller.window_layers and window_slots is None:
        raise ValueError(f"layers {sorted(controller.window_layers)} keep their device rows in window slots: "
                         "the tiers need window_slots to find them")
    n_host = host_blocks_for_swap_space(controller, swap_space)
    if config.preemption_mode == "swap" and n_host == 0:
        raise ValueError("preemption_mode='swap' needs a host tier: set swap_space (GiB) > 0")
    if kv_disk_max_bytes is not None and kv_disk_dir is None:
        raise ValueError("kv_disk_max_bytes needs kv_disk_dir")
    if n_host == 0 and kv_disk_dir is None and not kv_store:
        return None
    if config.preemption_mode == "swap" and not supports_swap:
        logger.warning("preemption_mode='swap' falls back to 'recompute' for quantize-on-seal KV formats "
                       "(%s): a request's partial last block lives in the tail pool, outside the swappable blocks",
                       ", ".join(sorted({g.layer.kv_format for g in controller.spec.groups})))
        config = replace(config, preemption_mode="recompute")
    stores: list[tuple[str, KVStore]] = []
    try:
        if kv_disk_dir is not None:
            stores.append(("disk", open_store(str(kv_disk_dir), controller.spec, max_bytes=kv_disk_max_bytes)))
        if kv_store:
            if store_tier_name(kv_store) != "redis":
                raise ValueError(f"kv_store must be a redis:// URL (use kv_disk_dir for a directory), got {kv_store!r}")
            stores.append(("redis", open_store(kv_store, controller.spec, **(store_options or {}))))
        controller.initialize_host_cache(n_host)  # CacheAllocationError names the layer group (C08)
    except BaseException:
        for _, s in stores:
            s.close()
        raise
    host = HostBlockPool(controller.num_host_blocks) if n_host else None
    return OffloadManager(HostTier(controller), host, stores, config, queue, window_slots=window_slots)
