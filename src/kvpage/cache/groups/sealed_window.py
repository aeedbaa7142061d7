"""``SealedWindowManager``: a sliding-window layer group in a block-wise format (``int4``/``int2`` Gemma local layers).

Two bookkeepings serve it, combined as the cache combines groups (the most restrictive answer wins): the sealed
codes live in *window slots* (a :class:`~kvpage.cache.groups.SlidingWindowManager`), while the 16-bit tail, the
window copies and the first-block copies stay keyed by block id in a fixed tail pool (a
:class:`~kvpage.cache.groups.SealedGroupManager`, never carved: the group's tensors have no block-id rows). A
pass's seals are planned over block ids, then their pool ids -- the blocks sealed in the pass and each request's
full blocks -- are translated to window slots, per request (a shared block may be inside one request's window
only). Tensor-free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvpage.cache.groups.base import GroupManager, SideNeed
from kvpage.cache.groups.sealed import SealedGroupManager
from kvpage.cache.groups.sliding import SlidingWindowManager
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.requests import SupportsKVCache
from kvpage.cache.step_plan import GroupPlan, PassRequest
from kvpage.spec import LayerGroupSpec, TailLayout


class SealedWindowManager(GroupManager):
    """The codes in window slots, the tail by block id (see the module docstring).

    Args:
        group: the layer group's spec (kind :class:`~kvpage.spec.SealedWindow`).
        layout: its fixed tail's sizes (:meth:`~kvpage.spec.SealedWindow.tail`).
        num_window_slots: window slots of its tensors.
        pool: the device block pool.

    Attributes:
        seals: the tail's bookkeeping.
        window: the window slots' bookkeeping.

    Raises:
        ValueError: as either manager.
    """

    def __init__(self, group: LayerGroupSpec, layout: TailLayout, num_window_slots: int,
                 pool: PrefixBlockPool | None = None) -> None:
        super().__init__(group, pool)
        self.seals = SealedGroupManager(group, layout, pool)
        self.window = SlidingWindowManager(group, num_window_slots, pool)
        self._both: tuple[GroupManager, GroupManager] = (self.seals, self.window)

    # -- prefix policy: the most restrictive answer -----------------------------------------------------------

    def usable_prefix(self, block_ids: Sequence[int]) -> int:
        """The shorter of the two managers' usable prefixes."""
        return min(g.usable_prefix(block_ids) for g in self._both)

    def allows_external_prefix(self, num_device_blocks: int) -> bool:
        """Both must allow it."""
        return all(g.allows_external_prefix(num_device_blocks) for g in self._both)

    def usable_external(self, device_ids: Sequence[int], windows: Sequence[bool], num_external_tokens: int) -> int:
        """The fewer of the two."""
        return min(g.usable_external(device_ids, windows, num_external_tokens) for g in self._both)

    def max_indexable_tokens(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """The fewer of the two."""
        return min(g.max_indexable_tokens(request, num_computed_tokens) for g in self._both)

    def can_fork(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        """Both must serve the child."""
        return all(g.can_fork(block_ids, num_tokens) for g in self._both)

    # -- events: both hear them --------------------------------------------------------------------------------

    def on_request_blocks(self, request_id: str, block_ids: Sequence[int], num_matched_tokens: int | None) -> None:
        """Both managers."""
        for g in self._both:
            g.on_request_blocks(request_id, block_ids, num_matched_tokens)

    def on_fork(self, parent_id: str, child_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        """Both managers."""
        for g in self._both:
            g.on_fork(parent_id, child_id, block_ids, num_tokens)

    def on_block_copied(self, request_id: str, old: int, new: int) -> None:
        """Both managers."""
        for g in self._both:
            g.on_block_copied(request_id, old, new)

    def on_copies_applied(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Both managers."""
        for g in self._both:
            g.on_copies_applied(pairs)

    def on_request_freed(self, request_id: str) -> None:
        """Both managers."""
        for g in self._both:
            g.on_request_freed(request_id)

    def on_rollback(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """Both managers."""
        for g in self._both:
            g.on_rollback(block_ids, num_tokens)

    def on_blocks_deduplicated(self, pairs: Sequence[tuple[int, int]], ref_count: Callable[[int], int]) -> None:
        """Both managers."""
        for g in self._both:
            g.on_blocks_deduplicated(pairs, ref_count)

    def on_blocks_dead(self, block_ids: Sequence[int], *, evicted: bool = False) -> None:
        """Both managers."""
        for g in self._both:
            g.on_blocks_dead(block_ids, evicted=evicted)

    # -- side slots: tail slots and window slots, all or none -------------------------------------------------

    def slots_needed(self, request: SupportsKVCache, block_ids: Sequence[int], num_computed: int, num_new: int, *,
                     num_draft: int = 0, copy_on_write: bool = False) -> SideNeed:
        """``(tail slots, window slots)`` the chunk takes."""
        return tuple(k for g in self._both for k in g.slots_needed(request, block_ids, num_computed, num_new,
                                                                     num_draft=num_draft, copy_on_write=copy_on_write))

    def fits(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Whether both parts of ``need`` fit."""
        tail, window = need
        return self.seals.fits((tail,), protected) and self.window.fits((window,), protected)

    def reserve(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Promise both parts of ``need`` or neither."""
        tail, window = need
        if not self.seals.reserve((tail,), protected):
            return False
        if not self.window.reserve((window,), protected):
            self.seals.unreserve((tail,))
            return False
        return True

    def unreserve(self, need: SideNeed) -> None:
        """Take back both parts."""
        tail, window = need
        self.seals.unreserve((tail,))
        self.window.unreserve((window,))

    def release(self) -> None:
        """Both managers."""
        for g in self._both:
            g.release()

    def shrink(self, keep: Sequence[int]) -> int:
        """The tail's idle first-block copies (a fixed pool: none go back to the block pool)."""
        return self.seals.shrink(keep)

    # -- passes ------------------------------------------------------------------------------------------------

    def plan(self, requests: Sequence[PassRequest], final: bool) -> GroupPlan:
        """Release slots that slid out (final pass), plan the seals over block ids, then address the codes by window
        slot: the sealed blocks' ids and each request's full blocks (a full block before a request's window reads
        row 0, which its mask never lets a query see).

        Raises:
            RuntimeError: a block the pass seals, or a full block inside a window, has no window slot.
        """
        if final:
            self.window.advance_all(requests)
        ops = self.seals.seal_ops(requests, final)
        rows = [dict(zip(r.block_ids, self.window.window_table(r.block_ids, r.num_computed, r.seq_len)))
                for r in requests]
        seal_slots = self.window.window_rows(ops.seal_ids)
        missing = [b for b, slot in zip(ops.seal_ids, seal_slots) if slot is None]
        if missing:
            raise RuntimeError(f"group {self.name!r}: blocks {missing} seal this pass but hold no window slot")
        reads = tuple(replace(read, full_ids=tuple(row[b] for b in read.full_ids)) for read, row in zip(ops.reads, rows))
        return GroupPlan(self.name, seals=replace(ops, seal_ids=tuple(int(s) for s in seal_slots if s is not None),
                                                  reads=reads))

    def commit(self) -> None:
        """The tail's commit."""
        self.seals.commit()

    def abort(self) -> None:
        """The tail's abort."""
        self.seals.abort()

    def reset(self) -> None:
        """Both managers."""
        for g in self._both:
            g.reset()

    # -- the window's views (the tiers and copies address window rows) ---------------------------------------

    def window_rows(self, block_ids: Sequence[int]) -> list[int | None]:
        """:meth:`SlidingWindowManager.window_rows` of the codes' slots."""
        return self.window.window_rows(block_ids)

    def rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """The codes' rows are window slots."""
        return self.window.window_rows(block_ids)

    def evicted_window_rows(self, block_ids: Sequence[int]) -> list[int | None]:
        """:meth:`SlidingWindowManager.evicted_window_rows` of the codes' slots."""
        return self.window.evicted_window_rows(block_ids)

    def evicted_rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """The codes' slots at eviction."""
        return self.window.evicted_window_rows(block_ids)
