"""Per-layer-group cache managers, one per group, chosen by the group's kind (:mod:`kvpage.spec.kinds`).

==========================================  =========================================================
kind                                        manager
==========================================  =========================================================
:class:`~kvpage.spec.FullAttention`         :class:`FullAttentionManager` (the defaults)
:class:`~kvpage.spec.SlidingWindow`         :class:`SlidingWindowManager` (window slots)
:class:`~kvpage.spec.Sealed`                :class:`SealedGroupManager` (the quantize-on-seal tail)
:class:`~kvpage.spec.SealedWindow`          :class:`SealedWindowManager` (both)
==========================================  =========================================================

A new kind adds its class to :data:`MANAGERS` (and its worker-side attention to the worker's map,
:data:`kvpage.engine.group_attention.ATTENTION`); nothing else asks which kind a group is. Imports
:mod:`kvpage.spec` and the tensor-free parts of :mod:`kvpage.cache`; nothing from the engine.
"""
from __future__ import annotations

from collections.abc import Callable

from kvpage.cache.groups.base import FullAttentionManager, GroupManager, SideNeed
from kvpage.cache.groups.sealed import SealedGroupManager
from kvpage.cache.groups.sealed_window import SealedWindowManager
from kvpage.cache.groups.sliding import SlidingWindowManager, WindowSlotsExhaustedError
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.spec import (CacheSizing, FullAttention, GroupKind, LayerGroupSpec, Sealed, SealedWindow, SlidingWindow,
                         TailLayout)
from kvpage.spec.kinds import for_kind

__all__ = ["MANAGERS", "FullAttentionManager", "GroupManager", "SealedGroupManager", "SealedWindowManager", "SideNeed",
           "SlidingWindowManager", "WindowSlotsExhaustedError", "manager_for"]

#: A manager factory: ``(group, sizing, pool, num_blocks, num_window_slots) -> manager``.
ManagerFactory = Callable[[LayerGroupSpec, CacheSizing, PrefixBlockPool | None, int | None, int], GroupManager]


def _tail(group: LayerGroupSpec, sizing: CacheSizing, num_blocks: int | None) -> TailLayout:
    layout = group.kind.tail(group, sizing, num_blocks)
    if layout is None:
        raise ValueError(f"group {group.name!r} of kind {group.kind!r} keeps no tail")
    return layout


def _sealed(group: LayerGroupSpec, sizing: CacheSizing, pool: PrefixBlockPool | None, num_blocks: int | None,
            slots: int) -> GroupManager:
    return SealedGroupManager(group, _tail(group, sizing, None if pool is None else num_blocks), pool)


def _sealed_window(group: LayerGroupSpec, sizing: CacheSizing, pool: PrefixBlockPool | None, num_blocks: int | None,
                   slots: int) -> GroupManager:
    return SealedWindowManager(group, _tail(group, sizing, None), slots, pool)


#: Kind -> the factory of its manager (vLLM's ``spec_manager_map``).
MANAGERS: dict[type[GroupKind], ManagerFactory] = {
    FullAttention: lambda group, sizing, pool, num_blocks, slots: FullAttentionManager(group, pool),
    SlidingWindow: lambda group, sizing, pool, num_blocks, slots: SlidingWindowManager(group, slots, pool),
    Sealed: _sealed,
    SealedWindow: _sealed_window,
}


def manager_for(group: LayerGroupSpec, sizing: CacheSizing | None = None, *, pool: PrefixBlockPool | None = None,
                num_window_slots: int | None = None, carve: bool = True) -> GroupManager:
    """The manager of ``group``'s kind.

    Args:
        group: the layer group.
        sizing: the engine settings its side pools depend on (default :class:`~kvpage.spec.CacheSizing`'s).
        pool: the device block pool: a quantize-on-seal group carves its tail out of it when its layout allows
            (:meth:`~kvpage.spec.Sealed.tail`), window managers ask its index which blocks are cached; ``None``:
            fixed pools, nothing cached.
        num_window_slots: window slots of a group whose rows are window slots (default: the kind's count over the
            pool, :meth:`~kvpage.spec.GroupKind.window_slots`).
        carve: ``False``: a quantize-on-seal group keeps fixed side pools even where its own layout could carve
            (the cache's groups carve together or not at all, as :func:`~kvpage.cache.capacity.cache_capacity`
            decides: several such groups under per-layer precision).

    Raises:
        KeyError: a kind without a manager (:data:`MANAGERS`).
        ValueError: bad sizes.
    """
    sizing = CacheSizing() if sizing is None else sizing
    num_blocks = None if pool is None else pool.num_blocks
    slots = num_window_slots
    if slots is None:
        slots = group.kind.window_slots(group, num_blocks or 1, sizing) if group.kind.window_rows else 0
    return for_kind(MANAGERS, group, "kvpage.cache.groups.MANAGERS")(group, sizing, pool,
                                                                      num_blocks if carve else None, slots)
