"""``SideSlots``: the side-slot verbs of :class:`~kvpage.cache.manager.KVCacheManager` (tail slots of quantize-on-seal groups).

A mixin over the manager's ``groups``, ``pool``, ``_reqs``, ``is_in_use`` and ``is_live``: what a chunk's
16-bit tail slots need, promising them to the next forward pass before its blocks are allocated, and
giving back side space when a block is evicted. Tensor-free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpage.cache.groups import GroupManager
from kvpage.cache.prefix_cache import BlockRemoved, KVCacheEvent, PrefixBlockPool
from kvpage.cache.requests import MatchResult, SupportsKVCache

if TYPE_CHECKING:
    from kvpage.cache.req_state import _ReqState


class SideSlots:
    """The side-slot verbs (mixed into :class:`~kvpage.cache.manager.KVCacheManager`)."""

    groups: tuple[GroupManager, ...]
    pool: PrefixBlockPool
    _reqs: dict[str, _ReqState]

    def is_in_use(self, block_id: int) -> bool:  # (the manager's)
        """Whether some request references the block."""
        raise NotImplementedError

    def is_live(self, block_id: int) -> bool:  # (the manager's)
        """Whether the block's content is still held."""
        raise NotImplementedError

    #: Whether the request's next write copies a shared block first (:class:`~kvpage.cache.table_edits.TableEdits`).
    needs_copy: Callable[[str, int], bool]

    # -- side slots (the tail of quantize-on-seal groups) -----------------------------------------

    def _on_event(self, event: KVCacheEvent) -> None:
        """An evicted block's content died: groups that keep side space for it give it back now."""
        if isinstance(event, BlockRemoved):
            for g in self.groups:
                if g.drops_on_eviction:
                    g.on_block_evicted(event.block_id)

    @property
    def num_side_blocks(self) -> int:
        """Device blocks held as side space now (tail slots and first-block copies carved from the pool)."""
        return self.pool.num_side

    def side_reserve(self, request: SupportsKVCache, num_computed: int, num_new_tokens: int,
                     match: MatchResult | None = None, *, num_draft: int = 0) -> tuple[int, ...] | None:
        """Promise the side slots a chunk takes (:meth:`side_slots_needed`) to the next forward pass, per group.

        Over side groups this claims their blocks now, so call it before :meth:`allocate_slots` of the chunk:
        the allocation then sees the blocks that are really left. The blocks of ``match`` are never evicted
        for them; ``num_draft``: the chunk's last tokens that are unverified drafts (as :meth:`side_slots_needed`). Returns the promised counts (give them back with :meth:`side_unreserve` if the chunk leaves
        the step), or ``None`` when some group cannot promise them (nothing is promised then).
        """
        need = self.side_slots_needed(request, num_computed, num_new_tokens, match, num_draft=num_draft)
        protected = match.block_ids if match is not None else ()
        done: list[tuple[GroupManager, int]] = []
        for g, k in zip(self.groups, need):
            if k and not g.side_reserve(k, protected, self.is_in_use, self.is_live):
                for h, j in done:
                    h.side_unreserve(j)
                return None
            done.append((g, k))
        return need

    def side_unreserve(self, need: Sequence[int]) -> None:
        """Give back what :meth:`side_reserve` promised."""
        for g, k in zip(self.groups, need):
            if k:
                g.side_unreserve(k)

    def side_release(self) -> None:
        """Forget every promise of side slots (before scheduling a step)."""
        for g in self.groups:
            g.side_release()

    def side_slots_needed(self, request: SupportsKVCache, num_computed: int, num_new_tokens: int,
                          match: MatchResult | None = None, *, num_draft: int = 0) -> tuple[int, ...]:
        """Per group, the side slots a chunk of ``num_new_tokens`` after ``num_computed`` takes in its step.

        Counted before :meth:`allocate_slots` (the blocks it would add are new: nothing kept for them).
        A step fits when, per group, the sum over its chunks is at most :meth:`side_slots_free`.

        Args:
            request: the request (held blocks, or being admitted with ``match``).
            num_computed: tokens already in the cache before the chunk (its first position).
            num_new_tokens: tokens of the chunk.
            match: the admission's device match (its blocks are the request's first ones); ignored once
                the request holds blocks.
            num_draft: the chunk's last this many tokens are unverified drafts of a verification step (a
                quantize-on-seal block they fill keeps its 16-bit slot until :meth:`rollback` verifies it).

        Raises:
            ValueError: negative counts, or ``num_draft > num_new_tokens``.
        """
        if not 0 <= num_draft <= num_new_tokens:
            raise ValueError(f"num_draft must be in [0, num_new_tokens={num_new_tokens}], got {num_draft}")
        st = self._reqs.get(request.request_id)
        held: Sequence[int] = st.block_ids if st is not None else (match.block_ids if match is not None else ())
        cow = st is not None and self.needs_copy(request.request_id, num_new_tokens)  # a forked block copied first
        return tuple(g.side_slots_needed(request, held, num_computed, num_new_tokens, num_draft=num_draft)
                     + (g.side_slots_per_copy if cow else 0) for g in self.groups)
