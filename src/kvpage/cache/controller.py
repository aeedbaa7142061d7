"""``CacheController``: allocates the per-layer cache tensors a :class:`~kvpage.spec.CacheSpec` describes and moves blocks between tiers.

This is the worker side of FastDeploy's cache manager v1 (``CacheController``:
``initialize_kv_cache``, ``initialize_host_cache``, swaps addressed by block
id), with one difference that matters: every dtype and shape comes from the
spec's layer groups, for main layers, draft/MTP layers and host blocks alike,
so a quantized cache is never allocated in the model dtype (FastDeploy PR
7757) and scale tensors always exist where the format has them and move with
their block (FastDeploy PRs 5125, 5390).

A layer's cache is a ``dict`` name -> ``[num_blocks, *per_block_shape]``
tensor (see :mod:`kvpage.formats.base` for the per-block layout).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvpage.cache.huge_pages import zeros_in_huge_pages
from kvpage.errors import KVPageError
from kvpage.formats import TensorSpec
from kvpage.spec import CacheSpec, LayerGroupSpec

#: One layer's cache: tensor name -> ``[num_blocks, *per_block_shape]``.
LayerCache = dict[str, torch.Tensor]


class CacheAllocationError(KVPageError, RuntimeError):
    """A cache tier could not allocate a layer group's tensors (FastDeploy PR 7787: never run on without them)."""


@dataclass(frozen=True, slots=True)
class BlockBudget:
    """How a memory budget is split into blocks (:meth:`CacheController.num_blocks_for_budget`).

    All groups share one block table, so they get the same number of blocks and
    the budget splits between groups in proportion to their bytes per block
    (e.g. 32 main + 4 draft layers of equal size: 32/36 and 4/36).

    Attributes:
        num_blocks: blocks every layer group gets.
        bytes_per_block: bytes of one block across all groups.
        group_bytes: group name -> bytes that group's tensors take (``num_blocks * group bytes_per_block``).
        budget_bytes: the budget asked for.
    """

    num_blocks: int
    bytes_per_block: int
    group_bytes: dict[str, int]
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes the allocation will take; never more than ``budget_bytes``."""
        return sum(self.group_bytes.values())


def _check_ids(name: str, ids: Sequence[int], num_blocks: int) -> torch.Tensor:
    idx = torch.as_tensor(list(ids), dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_blocks):
        raise IndexError(f"{name} {idx.tolist()} out of range for a tier of {num_blocks} blocks")
    return idx


def host_runs(host_ids: Sequence[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The copy order and runs of consecutive ids of a transfer's host-side block ids.

    A copy between the device and pinned host memory is asynchronous only as one contiguous slice of the host
    tensor (an ``index_select``/``index_copy_`` on the host side would run on the CPU at once, before the copy
    lands); so the host side of a transfer is cut into runs of consecutive ids, each one slice.

    Args:
        host_ids: host block (or row) ids, no repeats.

    Returns:
        ``(order, runs)``: ``order`` the positions of ``host_ids`` sorted by id; ``runs`` ``(first id, offset
        into order, length)`` per run of consecutive ids, in id order. No side effects.
    """
    order = sorted(range(len(host_ids)), key=host_ids.__getitem__)
    runs: list[tuple[int, int, int]] = []
    for k, pos in enumerate(order):
        hid = host_ids[pos]
        if runs and runs[-1][0] + runs[-1][2] == hid:
            first, off, n = runs[-1]
            runs[-1] = (first, off, n + 1)
        else:
            runs.append((hid, k, 1))
    return order, runs


class CacheController:
    """Owns the KV tensors of one engine: device (main + draft/MTP) and host tiers.

    Args:
        spec: the layout; every allocation follows it.
        device: torch device of the device tier (``"cpu"`` or ``"cuda"``). The
            host tier is always on the CPU, pinned when ``device`` is CUDA.
        fill_value: value new device tensors are filled with (tests use NaN
            to catch reads of unwritten slots); ``None`` zero-fills.

    Attributes:
        device_caches: global layer index -> :data:`LayerCache` on ``device``.
        host_caches: global layer index -> :data:`LayerCache` on the CPU.
        window_layers: layers whose device tensors have rows of their own (the window slots of a bounded
            sliding-window group) instead of one row per block id; their host rows stay one per host block.
    """

    def __init__(self, spec: CacheSpec, device: str | torch.device = "cpu", fill_value: float | None = None) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.fill_value = fill_value
        self.device_caches: dict[int, LayerCache] = {}
        self.host_caches: dict[int, LayerCache] = {}
        self.num_device_blocks = 0
        self.num_host_blocks = 0
        self.window_layers: frozenset[int] = frozenset()
        self._plan: tuple[int, dict[str, int]] | None = None  # (blocks, group rows) of allocate_device

    # -- sizing ------------------------------------------------------------------------------
    def num_blocks_for_budget(self, budget_bytes: int, groups: Iterable[str] | None = None) -> BlockBudget:
        """Largest block count whose tensors fit in ``budget_bytes``.

        Uses exactly the bytes :meth:`initialize_kv_cache` and
        :meth:`initialize_draft_kv_cache` then allocate (scales and packing
        included), so allocating the result never exceeds the budget.

        Args:
            budget_bytes: bytes available for KV tensors (all groups together).
            groups: group names to size for; default every group of the spec.

        Raises:
            ValueError: negative budget, or ``groups`` names no group of the spec.
        """
        if budget_bytes < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget_bytes}")
        names = None if groups is None else set(groups)
        chosen = [g for g in self.spec.groups if names is None or g.name in names]
        if not chosen:
            raise ValueError(f"no layer group among {sorted(names or [])}; spec groups: {[g.name for g in self.spec.groups]}")
        per_block = sum(g.bytes_per_block for g in chosen)
        n = budget_bytes // per_block
        return BlockBudget(n, per_block, {g.name: n * g.bytes_per_block for g in chosen}, budget_bytes)

    # -- allocation --------------------------------------------------------------------------
    def _allocate(self, t: TensorSpec, num_blocks: int, device: torch.device, pin: bool) -> torch.Tensor:
        """One ``[num_blocks, *t.shape]`` tensor of ``t.dtype``. Overridden in tests to inject failures."""
        shape = (num_blocks, *t.shape)
        if device.type == "cpu" and not pin:
            x = zeros_in_huge_pages(shape, t.dtype)  # the kernels' block reads miss the TLB far less
        elif device.type == "cpu":
            x = torch.zeros(shape, dtype=t.dtype, pin_memory=pin)
        else:
            x = torch.zeros(shape, dtype=t.dtype, device=device)
        if self.fill_value is not None and t.dtype.is_floating_point:
            x.fill_(self.fill_value)
        return x

    def _allocate_group(
        self, group: LayerGroupSpec, num_blocks: int, device: torch.device, pin: bool, tier: str
    ) -> dict[int, LayerCache]:
        out: dict[int, LayerCache] = {}
        for i in group.layer_indices:
            layer: LayerCache = {}
            for t in group.layer.tensors:
                try:
                    layer[t.name] = self._allocate(t, num_blocks, device, pin)
                except (RuntimeError, MemoryError) as e:
                    raise CacheAllocationError(
                        f"{tier} tier: could not allocate {t.name!r} of layer {i} ({group.name} group, "
                        f"{num_blocks} blocks x {t.nbytes} bytes, {t.dtype}): {e}. Lower the block count "
                        f"(swap space / memory budget) or free memory; refusing to run with missing {tier} buffers."
                    ) from e
            group.layer.validate(layer, layer_index=i, num_blocks=num_blocks)
            out[i] = layer
        return out

    def initialize_kv_cache(self, num_blocks: int, group_blocks: Mapping[str, int] | None = None) -> dict[int, LayerCache]:
        """Allocate the model layers' device cache (groups ``main`` and ``sliding``).

        Args:
            num_blocks: blocks per layer (``num_gpu_blocks``).
            group_blocks: group name -> rows of its layers' tensors when not ``num_blocks`` (the window slots of
                a group whose kind keeps them, :meth:`~kvpage.spec.GroupKind.window_slots`).

        Returns:
            global layer index -> tensors, for the model's groups.

        Raises:
            ValueError: ``num_blocks <= 0``.
            CacheAllocationError: a tensor could not be allocated.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        caches: dict[int, LayerCache] = {}
        rows = dict(group_blocks or {})
        for group in self.spec.model_groups:
            n = rows.get(group.name, num_blocks)
            if n <= 0:
                raise ValueError(f"group {group.name!r} needs a positive block count, got {n}")
            caches.update(self._allocate_group(group, n, self.device, False, "device"))
        self.device_caches.update(caches)
        self.window_layers = frozenset(i for g in self.spec.model_groups if g.name in rows for i in g.layer_indices)
        self.num_device_blocks = num_blocks
        return caches

    def allocate_device(self, num_blocks: int, rows: Mapping[str, int] | None = None) -> dict[int, LayerCache]:
        """Allocate every layer group's device tensors, the model's groups then draft layers (:meth:`initialize_kv_cache`,
        :meth:`initialize_draft_kv_cache`), and remember the plan so :meth:`reallocate_device` allocates the same.

        Args:
            num_blocks: device blocks.
            rows: group name -> rows of its layers' tensors when they are not ``num_blocks`` (the window slots of a
                group whose kind keeps them, :meth:`~kvpage.spec.GroupKind.rows`).

        Returns:
            :attr:`device_caches`: global layer index -> that layer's tensors (this dict is updated in place by a
            re-allocation, so holders of it see the new tensors).

        Raises:
            CacheAllocationError: a tensor could not be allocated (names the layer and group).
        """
        self._plan = (num_blocks, dict(rows or {}))
        self.initialize_kv_cache(num_blocks, rows)
        if self.spec.draft is not None:
            self.initialize_draft_kv_cache(num_blocks)
        return self.device_caches

    def reallocate_device(self) -> dict[int, LayerCache]:
        """Free the device tensors and allocate them afresh from the same plan as :meth:`allocate_device` (same
        blocks, same window slots: the bytes the build allocated, the layers the tiers address by window slot).

        Raises:
            RuntimeError: nothing was allocated with :meth:`allocate_device` yet.
            CacheAllocationError: as :meth:`allocate_device`.
        """
        if self._plan is None:
            raise RuntimeError("reallocate_device() before allocate_device()")
        num_blocks, rows = self._plan
        for cache in self.device_caches.values():
            cache.clear()  # drop the old tensors before the new ones take their memory
        return self.allocate_device(num_blocks, rows)

    def initialize_draft_kv_cache(
        self, num_blocks: int, num_draft_layers: int | None = None, layer_offset: int | None = None
    ) -> dict[int, LayerCache]:
        """Allocate the draft/MTP layers' device cache, from the spec's ``draft`` group.

        Draft layers share the request's block table, so they have the main
        cache's block count. ``num_draft_layers`` and ``layer_offset``
        (FastDeploy's arguments) are checked against the spec, never used to
        decide a layout.

        Raises:
            KeyError: the spec has no draft group.
            ValueError: the arguments disagree with the spec, or with the main block count.
            CacheAllocationError: a tensor could not be allocated.
        """
        group = self.spec.group("draft")
        if num_draft_layers is not None and num_draft_layers != group.num_layers:
            raise ValueError(f"spec has {group.num_layers} draft layers, got num_draft_layers={num_draft_layers}")
        if layer_offset is not None and layer_offset != group.first_layer:
            raise ValueError(f"spec's draft layers start at layer {group.first_layer}, got layer_offset={layer_offset}")
        if self.num_device_blocks and num_blocks != self.num_device_blocks:
            raise ValueError(
                f"draft layers share the main block table: need {self.num_device_blocks} blocks, got {num_blocks}"
            )
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        caches = self._allocate_group(group, num_blocks, self.device, False, "device")
        self.device_caches.update(caches)
        self.num_device_blocks = num_blocks
        return caches

    def initialize_host_cache(self, num_host_blocks: int) -> dict[int, LayerCache]:
        """Allocate host (CPU) blocks for every layer of every group, pinned when the device is CUDA.

        Args:
            num_host_blocks: host blocks per layer; 0 means no host tier.

        Raises:
            ValueError: negative count.
            CacheAllocationError: some layer group could not be allocated (the
                engine must not start with missing host buffers, case C08).
        """
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.host_caches = {}
        self.num_host_blocks = num_host_blocks
        if num_host_blocks == 0:
            return self.host_caches
        pin = self.device.type == "cuda"
        try:
            for g in self.spec.groups:
                self.host_caches.update(self._allocate_group(g, num_host_blocks, torch.device("cpu"), pin, "host"))
        except CacheAllocationError:
            self.host_caches, self.num_host_blocks = {}, 0  # no half-allocated host tier survives the error
            raise
        missing = [i for i in range(self.spec.num_layers) if i not in self.host_caches]
        if missing:
            raise CacheAllocationError(f"host tier has no buffers for layers {missing}")
        return self.host_caches

    # -- transfers ---------------------------------------------------------------------------
    def _copy(
        self,
        src: dict[int, LayerCache],
        dst: dict[int, LayerCache],
        src_ids: Sequence[int],
        dst_ids: Sequence[int],
        layers: Iterable[int] | None,
        window_rows: Sequence[int | None] | None,
        to_device: bool,
        synchronize: bool,
    ) -> None:
        """Copy rows ``src_ids -> dst_ids`` between two tiers; in :attr:`window_layers` the device side reads
        ``window_rows`` instead of the block ids (a ``None`` row: that block is skipped in those layers).

        The copies are issued on the current stream (asynchronous on CUDA, the host tier being pinned); with
        ``synchronize`` the call returns once they have landed."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"block id lists differ in length: {len(src_ids)} vs {len(dst_ids)}")
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError(f"destination block ids repeat: {list(dst_ids)}")
        dev_blocks, host_blocks = self.num_device_blocks, self.num_host_blocks
        _check_ids("source block ids", src_ids, host_blocks if to_device else dev_blocks)
        _check_ids("destination block ids", dst_ids, dev_blocks if to_device else host_blocks)
        todo = list(range(self.spec.num_layers)) if layers is None else list(layers)
        for i in todo:
            if i not in src or i not in dst:
                raise KVPageError(f"layer {i} has no allocated cache in both tiers of this copy")
        windowed = [i for i in todo if i in self.window_layers]
        if windowed and window_rows is None:
            raise ValueError(f"layers {windowed} keep their device rows in window slots: pass window_rows")
        if window_rows is not None and len(window_rows) != len(src_ids):
            raise ValueError(f"{len(window_rows)} window rows for {len(src_ids)} blocks")
        if not len(src_ids):
            return
        plain = (list(src_ids), list(dst_ids))
        slotted = plain
        if windowed and window_rows is not None:  # device side -> window rows, blocks without one skipped
            kept = [(r, s, d) for r, s, d in zip(window_rows, src_ids, dst_ids) if r is not None]
            slotted = ([s for _, s, _ in kept], [r for r, _, _ in kept]) if to_device else \
                ([r for r, _, _ in kept], [d for _, _, d in kept])
        # the host side moves as slices (runs of consecutive host ids), the device side by index: with a pinned
        # host tier on CUDA every slice copy is asynchronous on the current stream
        # (computed once per kind of layer the copy touches: plain, window-slotted)
        moves: dict[bool, tuple[torch.Tensor, list[tuple[int, int, int]]]] = {}
        for windowed_layer in sorted({i in self.window_layers for i in todo}):
            s_ids, d_ids = slotted if windowed_layer else plain
            host_ids, dev_ids = (s_ids, d_ids) if to_device else (d_ids, s_ids)
            order, runs = host_runs(host_ids)
            moves[windowed_layer] = (torch.tensor([dev_ids[k] for k in order], dtype=torch.long).to(self.device),
                                     runs)
        for i in todo:  # every layer's rows are checked before a byte moves
            s_ids, d_ids = slotted if i in self.window_layers else plain
            n_src, n_dst = next(iter(src[i].values())).shape[0], next(iter(dst[i].values())).shape[0]
            _check_ids(f"layer {i} source rows", s_ids, n_src)
            _check_ids(f"layer {i} destination rows", d_ids, n_dst)
        for i in todo:
            if not (slotted if i in self.window_layers else plain)[0]:
                continue
            di, runs = moves[i in self.window_layers]
            for name, s in src[i].items():
                d = dst[i][name]
                if to_device:
                    staged = torch.empty((di.numel(), *s.shape[1:]), dtype=s.dtype, device=d.device)
                    for first, off, n in runs:
                        staged[off:off + n].copy_(s[first:first + n], non_blocking=True)
                    d.index_copy_(0, di, staged)
                else:
                    rows = s.index_select(0, di)
                    for first, off, n in runs:
                        d[first:first + n].copy_(rows[off:off + n], non_blocking=True)
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]],
                    window_pairs: Sequence[tuple[int, int]] | None = None) -> None:
        """Copy whole device blocks ``source -> destination`` in every allocated layer: K, V and every scale, main,
        sliding and draft layers (copy-on-write of a forked block, as a step plan names it).

        Args:
            pairs: ``(source, destination)`` block ids, for every layer whose rows are block ids.
            window_pairs: the same copies in the :attr:`window_layers`' rows (window slots), for the pairs both of
                whose blocks hold one (:attr:`~kvpage.cache.step_plan.KVStepPlan.window_copies`).

        Raises:
            ValueError / IndexError: a destination repeated, ids out of range.
        """
        for i, cache in self.device_caches.items():
            todo = list(window_pairs or ()) if i in self.window_layers else list(pairs)
            if not todo:
                continue
            n = next(iter(cache.values())).shape[0]
            src = _check_ids("source block ids", [a for a, _ in todo], n)
            dst = _check_ids("destination block ids", [b for _, b in todo], n)
            if len(set(dst.tolist())) != len(todo):
                raise ValueError(f"destination block ids repeat: {dst.tolist()}")
            for t in cache.values():
                t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))

    def swap_out(self, device_ids: Sequence[int], host_ids: Sequence[int], layers: Iterable[int] | None = None,
                 window_rows: Sequence[int | None] | None = None, *, synchronize: bool = True) -> None:
        """Copy device blocks to host blocks: K, V and every scale, for every (or the given) layer.

        Args:
            device_ids: source device block ids.
            host_ids: destination host block ids, same length, no repeats.
            layers: global layer indices to copy (per-layer path); default all, main and draft.
            window_rows: per device block, its row in the :attr:`window_layers` (its window slot), ``None``
                where it holds none (those layers of that host block are left as they were); required when
                a copied layer is a window layer.
            synchronize: return once the copies have landed (on CUDA; a CPU copy is done when issued). Without
                it they are only issued on the current stream: the caller fences them (a copy stream's event).

        Raises:
            ValueError / IndexError: mismatched lengths, repeated destinations, ids or rows out of range, no
                ``window_rows`` for window layers (checked before anything is copied).
            KVPageError: a layer lacks host or device tensors.
        """
        self._copy(self.device_caches, self.host_caches, device_ids, host_ids, layers, window_rows, False,
                   synchronize)

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int], layers: Iterable[int] | None = None,
                window_rows: Sequence[int | None] | None = None, *, synchronize: bool = True) -> None:
        """Copy host blocks back to device blocks (the reverse of :meth:`swap_out`; ``window_rows`` per device
        block, ``None`` skips it in the window layers; ``synchronize`` as there); same errors."""
        self._copy(self.host_caches, self.device_caches, host_ids, device_ids, layers, window_rows, True,
                   synchronize)

    @property
    def device_bytes(self) -> int:
        """Bytes held by the device tier's tensors."""
        return sum(t.numel() * t.element_size() for c in self.device_caches.values() for t in c.values())

    @property
    def host_bytes(self) -> int:
        """Bytes held by the host tier's tensors."""
        return sum(t.numel() * t.element_size() for c in self.host_caches.values() for t in c.values())
