"""``SealedGroupManager``: the group manager of quantize-on-seal (block-wise) formats such as ``int4``/``int2``.

It owns the :class:`~kvpage.cache.tail.TailTable` (open blocks, the
full-precision window and first-block copies, :mod:`kvpage.cache.tail`) and the
prefix policy those copies imply: a match is usable only behind a first block
that still has its 8-bit copy, tiers serve a prefix only after such a device
hit, and only prompt blocks are indexed. Each pass's seals come from its table
(:meth:`SealedGroupManager.plan`). Tensor-free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpage.cache.groups.base import GroupManager, SideNeed
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.requests import SupportsKVCache
from kvpage.cache.step_plan import GroupPlan, PassRequest, SealOps
from kvpage.cache.tail import TailTable
from kvpage.cache.tail.side import SideGroups
from kvpage.spec import LayerGroupSpec, TailLayout


class SealedGroupManager(GroupManager):
    """Prefix policy and tail bookkeeping of a block-wise (quantize-on-seal) layer group.

    Args:
        group: the layer group's spec (its kind seals: :class:`~kvpage.spec.Sealed`).
        layout: the tail's sizes (:meth:`~kvpage.spec.Sealed.tail`); a carved layout takes its slots out of
            ``pool`` on demand (:class:`~kvpage.cache.tail.side.SideGroups`).
        pool: the device block pool (ref counts and index: which blocks are live or in use); required to carve.

    Raises:
        ValueError: bad tail sizes (see :class:`~kvpage.cache.tail.TailTable`); a carved layout without a pool.
    """

    def __init__(self, group: LayerGroupSpec, layout: TailLayout, pool: PrefixBlockPool | None = None) -> None:
        super().__init__(group, pool)
        side = None
        if layout.carved:
            if pool is None:
                raise ValueError(f"group {group.name!r}: a tail carved from the block pool needs the pool")
            side = SideGroups(pool, layout.blocks_per_slot)
        #: Global indices of the group's layers (whose tail tensors it books).
        self.layers = group.layer_indices
        self.layout = layout
        self.table = TailTable(group.layer.block_size, layout.num_slots, layout.num_sink_slots, layout.window_blocks,
                               side, window_bits=layout.window_bits)
        self._reserved = 0  # fixed pools: slots promised to the next plan
        self._heirs: dict[int, int] = {}  # a duplicate first block -> its indexed twin, heir of its 8-bit copy
        self._final = False  # the last plan was a final pass (its slots retire at commit)

    def _in_use(self, b: int) -> bool:
        return True if self.pool is None else self.pool.is_in_use(b)

    def _live(self, b: int) -> bool:
        return True if self.pool is None else self.pool.is_live(b)

    def can_fork(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        """Only whole blocks: a partial block's rows live in its 16-bit tail slot, keyed by block id."""
        return num_tokens % self.table.block_size == 0

    def usable_prefix(self, block_ids: Sequence[int]) -> int:
        """All blocks when the first one still has its 8-bit copy, else none.

        Reading a first block at 4 or 2 bits without its copy would answer
        differently than computing it, so the whole prefix is recomputed instead.
        """
        if block_ids and self.table.sink_of(block_ids[0]) is None and self.table.num_sink_slots:
            return 0
        return len(block_ids)

    def allows_external_prefix(self, num_device_blocks: int) -> bool:
        """Only after a device hit on the first block (the tiers carry no first-block copy; the KV cache then has
        the first block computed before it matches again: :attr:`~kvpage.cache.kv_cache.PrefixMatch.compute_first`)."""
        return num_device_blocks > 0 or not self.table.num_sink_slots

    def max_indexable_tokens(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """Only prompt tokens: generated tokens were computed reading their open block at 16 bits.

        A prefill of the same tokens reads them sealed, so reusing such blocks as a
        later prompt's prefix would answer differently than computing it.
        """
        prompt = getattr(request, "num_prompt_tokens", None)
        return num_computed_tokens if prompt is None else min(num_computed_tokens, int(prompt))

    def on_blocks_dead(self, block_ids: Sequence[int], *, evicted: bool = False) -> None:
        """Free at once the tail entries of dead blocks (a freed request's open block and window copies, an evicted
        first block's 8-bit copy; a block handed out anew may never show another request's tokens).

        A dead duplicate first block whose indexed twin is the heir of its 8-bit copy
        (:meth:`on_blocks_deduplicated`) hands the copy over instead of dropping it; an heir that died itself
        inherits nothing.
        """
        for b in block_ids:
            heir = self._heirs.pop(b, None)
            if heir is not None:
                self.table.move_sink(b, heir)
        self._forget_heirs(block_ids)
        self.table.release(block_ids)

    def _forget_heirs(self, block_ids: Sequence[int]) -> None:
        """Drop the pairs of :meth:`on_blocks_deduplicated` that name one of ``block_ids`` (its content died)."""
        if self._heirs:
            gone = set(block_ids)
            self._heirs = {d: h for d, h in self._heirs.items() if d not in gone and h not in gone}

    def on_blocks_deduplicated(self, pairs: Sequence[tuple[int, int]], ref_count: Callable[[int], int]) -> None:
        """Make an original first block that lost its 8-bit copy the heir of the duplicate's fresh one.

        Without it such a prefix never hits again while its blocks stay indexed (:meth:`usable_prefix` says 0,
        the recompute's duplicate gets a copy and dies with its request). The copy is of equal tokens and
        replaces block 0's codes when read, so a hit reads what the duplicate's request read. It moves when
        the duplicate dies (:meth:`on_blocks_freed`: its request finished or was preempted), not now: the
        duplicate's request reads its first block through that copy until then (moving it at once made the
        request's later steps read its first block at 4 or 2 bits). Only when nobody but the duplicate's
        request references the original (a request reading the original keeps reading it as it began).
        """
        for dup, orig in pairs:
            if ref_count(orig) <= 1 and self.table.sink_of(dup) is not None and self.table.sink_of(orig) is None:
                self._heirs[dup] = orig

    def fits(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Whether ``need`` tail slots can be promised now without giving up first-block copies (no side effects)."""
        (k,) = need
        if not k:
            return True
        side = self.table.side
        if side is not None:
            return side.can_reserve(k, protected)
        return self._reserved + k <= self.table.num_takeable(self._in_use, self._live)

    def reserve(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Promise ``need`` tail slots to the next plan, all or none; whether they were promised.

        Over side groups the groups are claimed out of the block pool now (evicting cached blocks no request
        uses, never ``protected`` ones), so the step's block allocations cannot take them; over fixed pools
        the promise is counted against :meth:`TailTable.num_takeable`.
        """
        (k,) = need
        if not k:
            return True
        side = self.table.side
        if side is not None:
            if side.reserve(k, protected):
                return True
            # first-block copies of idle cached prefixes hold groups too: give them up before the step waits
            return bool(self.table.drop_idle_sinks(self._in_use, protected)) and side.reserve(k, protected)
        if self._reserved + k > self.table.num_takeable(self._in_use, self._live):
            return False
        self._reserved += k
        return True

    def unreserve(self, need: SideNeed) -> None:
        """Take back a promise of ``need`` slots (its chunk left the step)."""
        (k,) = need
        if self.table.side is not None:
            self.table.side.unreserve(k)
        else:
            self._reserved = max(0, self._reserved - k)

    def release(self) -> None:
        """Forget every promise (a new scheduling pass begins; a final pass's commit does it too)."""
        self._reserved = 0
        if self.table.side is not None:
            self.table.side.release_spare()

    def shrink(self, keep: Sequence[int]) -> int:
        """Give the pool back the groups of idle first-block copies (not ``keep``'s); returns how many copies."""
        return self.table.drop_idle_sinks(self._in_use, keep) if self.table.side is not None else 0

    def side_blocks(self) -> int:
        """Pool blocks the group's tail and first-block copies hold now (0 over fixed pools)."""
        side = self.table.side
        return 0 if side is None else side.num_held * side.r

    def slots_needed(self, request: SupportsKVCache, block_ids: Sequence[int], num_computed: int, num_new: int, *,
                     num_draft: int = 0, copy_on_write: bool = False) -> SideNeed:
        """``(tail slots)`` the chunk's plan takes (:meth:`TailTable.slots_to_take`, owner = the request id, as the plans;
        its last ``num_draft`` tokens unverified, as the plan's drafts); over side groups also the group of the
        first block's 8-bit copy when the chunk seals that block (provisionally or not), and the groups its 8-bit
        window copies would fill (:meth:`TailTable.copies_to_take`, ``sinks_per_group`` a group), counted as if no
        held group had a free part: the free parts are shared by every chunk of the step, and a copy that found none
        took a group promised to another request's open slot (the plan then raised). Unused promises go back after
        the step. (A block-wise group is never copied on write: forks share whole blocks.)"""
        given = getattr(request, "num_prompt_tokens", None)
        prompt = 0 if given is None else int(given)
        table = self.table
        need = table.slots_to_take(block_ids, num_computed, num_new, prompt, request.request_id, num_draft=num_draft)
        bs = table.block_size
        if table.side is not None:
            if table.num_sink_slots and num_computed < bs <= num_computed + num_new:
                need += 1
            copies = table.copies_to_take(block_ids, num_computed, num_new, prompt, request.request_id,
                                          num_draft=num_draft)
            need += -(-copies // max(1, table.sinks_per_group))
        return (need,)

    def seal_ops(self, requests: Sequence[PassRequest], final: bool) -> SealOps:
        """Book a pass's seals over block ids (:meth:`TailTable.plan`); a pass that is not the step's final one over
        the group retires nothing and keeps the step's promised slots (``finish(release_spare=False)``) at once, a
        final one at :meth:`commit`."""
        ops = self.table.plan([r.block_ids for r in requests], [r.seq_len for r in requests],
                              [r.num_new for r in requests], owners=[r.request_id for r in requests],
                              prompt_lens=[r.prompt_len for r in requests], is_live=self._live,
                              is_in_use=self._in_use, draft_lens=[r.num_draft for r in requests])
        self._final = final
        if not final:
            self.table.finish(release_spare=False)
        return ops

    def plan(self, requests: Sequence[PassRequest], final: bool) -> GroupPlan:
        """The pass's seals, tail writes and reads (block ids: the group's rows are block ids)."""
        return GroupPlan(self.name, seals=self.seal_ops(requests, final))

    def commit(self) -> None:
        """Free the tail slots the final pass retired (every layer has read them) and the promises it did not use."""
        if self._final:
            self._final = False
            self.table.finish()
            self._reserved = 0

    def abort(self) -> None:
        """The pass raised: keep the open slots of the blocks the plan sealed (:meth:`TailTable.abort`)."""
        self._final = False
        self.table.abort()

    def on_rollback(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """Resolve the request's provisional seals (:meth:`TailTable.rollback`): verified ones give their 16-bit slot
        back (or keep it as a window copy), a block the rollback reopened keeps it as its open slot."""
        self.table.rollback(block_ids, num_tokens)

    def reset(self) -> None:
        """Drop every tail entry."""
        self._heirs.clear()
        self.table.reset()
