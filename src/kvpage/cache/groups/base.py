"""``GroupManager``: what one kind of layer group adds to the shared block bookkeeping.

The :class:`~kvpage.cache.manager.KVCacheManager` owns the block pool, the
per-request block tables and the prefix index; each layer group of the
:class:`~kvpage.spec.CacheSpec` gets one group manager, chosen from its spec
(:func:`kvpage.cache.groups.manager_for`, as vLLM maps each ``KVCacheSpec``
class to its single-type manager), which answers the questions where layer
kinds differ: which part of a device match it can use, which blocks may be
indexed, what to drop when a block id is handed out anew. Tensor-free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpage.cache.requests import SupportsKVCache
from kvpage.spec import LayerGroupSpec


class GroupManager:
    """Policy of one layer group over the shared block table; the defaults are full attention's.

    Every method is cheap and has no effect on the pool; the manager calls them
    at fixed points (match, index, allocate, reset) for every group and
    combines the answers (the most restrictive wins).

    Args:
        group: the layer group's spec; ``None`` for a bare manager in tests (named ``main``).
    """

    def __init__(self, group: LayerGroupSpec | None = None) -> None:
        self.group = group

    @property
    def name(self) -> str:
        """The layer group's name (``main``, ``draft``)."""
        return self.group.name if self.group is not None else "main"

    @property
    def supports_swap(self) -> bool:
        """Whether a preempted request's blocks of this group may be swapped to the host tier and back."""
        return True

    def usable_prefix(self, block_ids: Sequence[int]) -> int:
        """How many leading blocks of a device prefix match this group can read as computed (no side effects)."""
        return len(block_ids)

    def allows_external_prefix(self, num_device_blocks: int) -> bool:
        """Whether tiers may serve the blocks after a device match of ``num_device_blocks`` blocks."""
        return True

    def usable_external(self, device_ids: Sequence[int], windows: Sequence[bool], num_external_tokens: int) -> int:
        """How many of ``num_external_tokens`` tokens a tier holds after the device hits ``device_ids`` this group
        can read (no side effects): ``windows[i]`` says whether the source of the ``i``-th loaded block holds its
        window layers' rows (:attr:`~kvpage.cache.tiers.types.BlockLoad.window`). Default: all of them."""
        return num_external_tokens

    @property
    def loads_may_stop_short(self) -> bool:
        """Whether a tier load cut short at read time (a store record gone) may be followed by computing the rest
        from where it stopped. Default: yes."""
        return True

    def max_indexable_tokens(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """Tokens of the request whose full blocks may enter the prefix index (at most ``num_computed_tokens``)."""
        return num_computed_tokens

    def on_blocks_allocated(self, block_ids: Sequence[int]) -> None:
        """The pool handed ``block_ids`` out for new content: forget anything kept for their old content."""

    def on_request_blocks(self, request_id: str, block_ids: Sequence[int], num_matched_tokens: int | None) -> None:
        """The request's table became ``block_ids`` (admitted with a hit of ``num_matched_tokens`` tokens, or grown:
        ``None``). Default: nothing."""

    @property
    def copies_partial_blocks(self) -> bool:
        """Whether a fork may share a partial block of this group, copied on write. Default: yes."""
        return True

    @property
    def side_slots_per_copy(self) -> int:
        """Side slots one copy-on-write takes in this group (its new block's). Default: 0."""
        return 0

    def can_fork(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        """Whether a child sharing ``block_ids`` (its first ``num_tokens`` tokens) could read all it needs of
        them (no side effects). Default: yes."""
        return True

    def on_fork(self, parent_id: str, child_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        """``child_id`` now shares ``block_ids`` (its first ``num_tokens`` tokens) with ``parent_id``. Default:
        nothing."""

    def on_block_copied(self, request_id: str, old: int, new: int) -> None:
        """Copy-on-write: the request's block ``old`` is replaced by ``new``, whose content is copied from ``old``
        before the next forward pass (``old`` stays referenced until then). Default: nothing."""

    def on_copies_applied(self, pairs: Sequence[tuple[int, int]]) -> None:
        """The booked copies were applied to the tensors. Default: nothing."""

    def on_request_freed(self, request_id: str) -> None:
        """The request let go of its table (finished, aborted or preempted), before dead blocks are reported.
        Default: nothing."""

    def on_blocks_freed(self, block_ids: Sequence[int]) -> None:
        """A request was freed and ``block_ids`` died with it (back on the free list): drop what was kept for them."""

    def on_rollback(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """A request rolled back to ``num_tokens`` tokens and keeps the table ``block_ids`` (blocks dropped past it
        were reported by :meth:`on_blocks_freed` first); also called with nothing dropped, as the commit after a
        verification step (:meth:`~kvpage.cache.manager.KVCacheManager.rollback`). Default: nothing."""

    def on_blocks_deduplicated(self, pairs: Sequence[tuple[int, int]], ref_count: Callable[[int], int]) -> None:
        """Each ``(duplicate, original)`` pair: a request's block equals the indexed ``original``, which the index
        keeps (the duplicate dies with the request); ``ref_count`` is the pool's count. Default: nothing."""

    def side_reserve(self, need: int, protected: Sequence[int], is_in_use: Callable[[int], bool],
                     is_live: Callable[[int], bool]) -> bool:
        """Promise ``need`` side slots (:meth:`side_slots_needed`) to the next forward pass, all or none; whether
        they were promised (``protected``: cached blocks a match is about to use). Default: nothing to promise."""
        return True

    def side_unreserve(self, need: int) -> None:
        """Take back a promise of :meth:`side_reserve` (its chunk left the step)."""

    def side_release(self) -> None:
        """Forget every promise (before a step is scheduled)."""

    def side_shrink(self, is_in_use: Callable[[int], bool], keep: Sequence[int]) -> int:
        """Give optional side space back to the pool (the pool ran short); returns how much. Default: none."""
        return 0

    def on_block_evicted(self, block_id: int) -> None:
        """The device evicted the cached ``block_id`` (its content died; the id may be handed out at once). Only
        called when :attr:`drops_on_eviction`. Default: :meth:`on_blocks_freed`."""
        self.on_blocks_freed([block_id])

    @property
    def drops_on_eviction(self) -> bool:
        """Whether evicted blocks must be reported (:meth:`on_blocks_freed`) at once: side space kept for them
        is pool space. Default: no."""
        return False

    def side_blocks(self) -> int:
        """Device blocks the group holds as side space now (tail slots carved from the pool); default 0."""
        return 0

    def side_slots_needed(self, request: SupportsKVCache, block_ids: Sequence[int], num_computed: int,
                          num_new_tokens: int, *, num_draft: int = 0) -> int:
        """Side slots a chunk of ``num_new_tokens`` after ``num_computed`` takes in its step, its last ``num_draft``
        tokens unverified drafts (0 without side slots)."""
        return 0

    def reset(self) -> None:
        """The device pool was re-allocated: forget everything kept per block."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FullAttentionManager(GroupManager):
    """Full attention over token-wise formats: every token stays in its block; any match and any block is usable.

    (vLLM's ``FullAttentionManager``.) All behaviour is :class:`GroupManager`'s default.
    """
