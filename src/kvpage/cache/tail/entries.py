"""``TailEntries``: which 16-bit slot and which 8-bit slot (first-block or window copy) each block id holds.

The state under :class:`~kvpage.cache.tail.table.TailTable`: the entries, their LRU order, taking and
dropping slots, and the counts the scheduler reads. The per-step plan lives in :mod:`.table`. Imports
only :mod:`kvpage.cache.idpool` and :mod:`kvpage.errors`. Tensor-free.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from kvpage.cache.idpool import IdPool
from kvpage.cache.tail.side import SideGroups
from kvpage.errors import OutOfBlocksError

class TailEntries:
    """Tensor-free bookkeeping of tail and sink slots (see :mod:`kvpage.cache.tail`).

    Args:
        block_size: tokens per block.
        num_slots: 16-bit slots (open blocks + window copies at 16 bits).
        num_sink_slots: 8-bit slots: first-block copies (0 disables them) and window copies at 8 bits.
        window_blocks: sealed blocks per request that keep a window copy.
        side: carve slots out of the device block pool on demand (:class:`~kvpage.cache.tail.side.SideGroups`:
            slot ``g`` is group ``g``; with ``c = num_sink_slots / num_groups`` copies per group, sink slots
            ``c*g .. c*g + c - 1`` its parts); ``num_slots`` must then be its ``num_groups`` and ``num_sink_slots``
            0 or a multiple of it. Default: fixed pools of these sizes.
        window_bits: 16: a window copy is the block's 16-bit slot, kept; 8: an ``int8`` copy in an 8-bit slot
            (written at the seal; the 16-bit slot goes), which must then hold a whole block
            (:meth:`~kvpage.formats.BlockFormat.window_copy_bits`).

    Raises:
        ValueError: negative sizes, or ``num_slots < 1``; sizes that disagree with ``side``; ``window_bits`` other
            than 8 or 16, or 8 without 8-bit slots while there is a window.
    """

    def __init__(
        self,
        block_size: int,
        num_slots: int,
        num_sink_slots: int,
        window_blocks: int,
        side: SideGroups | None = None,
        *,
        window_bits: int = 16,
    ) -> None:
        if side is not None and (num_slots != side.num_groups or num_sink_slots % max(1, side.num_groups)):
            raise ValueError(f"a tail over {side.num_groups} side groups has that many slots and a multiple of it "
                             f"as sink slots, got {num_slots}, {num_sink_slots}")
        if block_size <= 0 or num_slots < 1 or num_sink_slots < 0 or window_blocks < 0:
            raise ValueError(
                f"bad tail sizes: block_size={block_size}, num_slots={num_slots}, "
                f"num_sink_slots={num_sink_slots}, window_blocks={window_blocks}"
            )
        if window_bits not in (8, 16) or (window_bits == 8 and window_blocks and not num_sink_slots):
            raise ValueError(f"window_bits must be 16, or 8 with 8-bit slots for the copies; got {window_bits} "
                             f"with {num_sink_slots} 8-bit slots and a window of {window_blocks} blocks")
        self.block_size = block_size
        self.window_bits = window_bits
        self.num_slots = num_slots
        self.num_sink_slots = num_sink_slots
        self.window_blocks = window_blocks
        self._is_live: Callable[[int], bool] | None = None    # the pool's views, for the plan being made
        self._is_in_use: Callable[[int], bool] | None = None
        self._slots = IdPool(num_slots, what="tail slot", lifo=True)  # a freed slot is reused first
        self._slot: dict[int, int] = {}                       # block id -> 16-bit slot
        self._window: OrderedDict[int, Hashable] = OrderedDict()  # block -> owner of its 16-bit window copy, LRU first
        self._wcopy: OrderedDict[int, tuple[Hashable, int]] = OrderedDict()  # block -> (owner, 8-bit slot), LRU first
        self._sink_slots = IdPool(num_sink_slots, what="sink slot", lifo=True)
        self._sink: OrderedDict[int, int] = OrderedDict()     # block id -> sink slot, LRU first
        self._part_free: set[int] = set()                     # side groups: free sink slots of groups a copy holds
        self._group_copies: dict[int, int] = {}               # side group -> first-block copies it holds
        self.sinks_per_group = num_sink_slots // side.num_groups if side is not None and side.num_groups else 0
        self.side = side
        self._planning = False                                # a plan is being made: freed groups stay reserved
        self._sealed_after: list[int] = []                   # sealed blocks whose open slot the seal gather reads
        self._read_last: list[tuple[int, Hashable]] = []     # window copies only this step's last query reads
        self._provisional: dict[int, Hashable] = {}          # sealed with unverified drafts -> owner (rollback)

    # -- queries ---------------------------------------------------------------------------------

    def slot_of(self, block_id: int) -> int | None:
        """16-bit slot of ``block_id`` (open or window), or ``None``."""
        return self._slot.get(block_id)

    def is_provisional(self, block_id: int) -> bool:
        """Whether ``block_id`` was sealed holding unverified drafts and keeps its 16-bit slot until
        :meth:`~kvpage.cache.tail.TailTable.rollback` verifies or reopens it."""
        return block_id in self._provisional

    def sink_of(self, block_id: int) -> int | None:
        """Sink slot of ``block_id``, or ``None``."""
        return self._sink.get(block_id)

    def window_copy_of(self, block_id: int) -> int | None:
        """8-bit slot of ``block_id``'s window copy (``window_bits`` 8), or ``None``."""
        entry = self._wcopy.get(block_id)
        return None if entry is None else entry[1]

    @property
    def num_window_copies(self) -> int:
        """8-bit window copies held (``window_bits`` 8)."""
        return len(self._wcopy)

    @property
    def num_used(self) -> int:
        """16-bit slots in use."""
        return len(self._slot)

    @property
    def num_sink_used(self) -> int:
        """Sink slots in use."""
        return len(self._sink)

    @property
    def num_sink_groups(self) -> int:
        """Side groups the 8-bit copies (first-block and window copies) hold (:attr:`sinks_per_group` copies share
        a group); 0 over fixed pools."""
        return len(self._group_copies)

    @property
    def num_free(self) -> int:
        """16-bit slots no entry holds (over side groups: not holding a tail entry nor reserved for one)."""
        if self.side is not None:
            return self.num_slots - len(self._slot) - self.side.num_spare
        return self._slots.num_free

    def num_takeable(self, is_in_use: Callable[[int], bool], is_live: Callable[[int], bool]) -> int:
        """16-bit slots the next plan can surely take: free ones, and those a plan reclaims whatever its batch.

        A plan reclaims the slot of a dead block (``not is_live``) and a window copy, unless a request of
        its batch references the block; counted here are only entries of blocks no request references
        (``not is_in_use``), so the count holds for any batch. No side effects.
        """
        return self._slots.num_free + sum(
            1 for b in self._slot if not is_in_use(b) and (b in self._window or not is_live(b))
        )
    def _pushed_out(self, table: Sequence[int], first: int, read_from: int, owner: Hashable) -> list[int]:
        """The request's window copies among blocks before ``read_from`` that this chunk does not touch.

        ``read_from`` is the first block of the last new query's window: the ``window_blocks`` blocks
        before the query's own block (which it reads at full precision anyway).
        """
        bs, w = self.block_size, self.window_blocks
        hi = min(max(0, read_from), first // bs, len(table))
        return [b for b in (int(table[j]) for j in range(max(0, first // bs - w - 1), hi)) if self._owns_copy(b, owner)]

    def _owns_copy(self, b: int, owner: Hashable) -> bool:
        """Whether ``b`` holds a window copy (16- or 8-bit) that ``owner`` made."""
        if b in self._window:
            return self._window[b] == owner
        entry = self._wcopy.get(b)
        return entry is not None and entry[0] == owner

    def _drop_window(self, b: int) -> None:
        """Drop ``b``'s window copy: its 16-bit slot (a 16-bit copy) and its 8-bit copy."""
        if b in self._window:
            self._drop_fp(b)
        self._drop_wcopy(b)

    # -- lifecycle -------------------------------------------------------------------------------

    def invalidate(self, block_ids: Sequence[int]) -> None:
        """Drop every entry of ``block_ids``: the pool handed them out for new content."""
        for b in block_ids:
            self._drop_fp(b)
            self._drop_sink(b)
            self._drop_wcopy(b)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop every entry of ``block_ids``: their content died (freed to the pool's free list, not cached).

        Called when a request is freed, so its open slot and window copies are free at once instead of
        waiting to be reclaimed. Call it between steps (not between a :meth:`plan` and its :meth:`finish`).
        """
        self.invalidate(block_ids)

    def reset(self) -> None:
        """Drop every entry (the pool was re-allocated)."""
        self.invalidate(list(self._slot) + list(self._sink) + list(self._wcopy))

    def drop_idle_sinks(self, is_in_use: Callable[[int], bool], keep: Sequence[int] = ()) -> int:
        """Drop the 8-bit copies of first blocks no request uses (but those in ``keep``); returns how many.

        Over side groups their blocks go back to the pool (the pool ran short). Call it between steps.
        """
        kept = set(keep)
        idle = [b for b in self._sink if b not in kept and not is_in_use(b)]
        for b in idle:
            self._drop_sink(b)
        return len(idle)

    def move_sink(self, src: int, dst: int) -> bool:
        """Give ``src``'s 8-bit first-block copy to ``dst`` when ``dst`` has none (blocks of equal content);
        returns whether it moved. Call it between steps."""
        if dst in self._sink or src not in self._sink:
            return False
        self._sink[dst] = self._sink.pop(src)
        return True

    def _drop_fp(self, b: int) -> None:
        self._provisional.pop(b, None)
        slot = self._slot.pop(b, None)
        if slot is not None:
            self._window.pop(b, None)
            if self.side is None:
                self._slots.put([slot])
            else:
                self._free_group(slot)

    def _drop_sink(self, b: int) -> None:
        slot = self._sink.pop(b, None)
        if slot is not None:
            self._put_copy_slot(slot)

    def _drop_wcopy(self, b: int) -> None:
        entry = self._wcopy.pop(b, None)
        if entry is not None:
            self._put_copy_slot(entry[1])

    def _put_copy_slot(self, slot: int) -> None:
        """Free an 8-bit slot (a first-block or window copy's); over side groups the group goes with its last copy."""
        if self.side is None:
            self._sink_slots.put([slot])
            return
        c = self.sinks_per_group
        g = slot // c
        self._group_copies[g] -= 1
        if self._group_copies[g]:
            self._part_free.add(slot)
        else:  # the group's last copy: the group goes
            del self._group_copies[g]
            self._part_free.difference_update(range(c * g, c * g + c))
            self._free_group(g)

    def _free_group(self, g: int) -> None:
        """A side group no entry holds any more: reserved for the plan being made, else back to the pool."""
        assert self.side is not None
        if self._planning:
            self.side.keep(g)
        else:
            self.side.put(g)

    def _live(self, b: int) -> bool:
        return True if self._is_live is None else bool(self._is_live(b))

    def _take_slot(self, b: int, protected: set[int]) -> int:
        if self.side is not None:
            return self._take_side_slot(b, protected)
        if not self._slots.num_free:
            victim = next((x for x in self._slot if x not in protected and not self._live(x)), None)
            if victim is None:
                victim = next((x for x in self._window if x not in protected and x not in self._provisional), None)
            if victim is None:
                raise OutOfBlocksError(
                    f"the full-precision tail pool is full: {self.num_slots} slots hold open blocks of running "
                    f"requests; run fewer requests at once (max_num_seqs) or give the tail more slots"
                )
            self._drop_fp(victim)
        (slot,) = self._slots.take(1)
        self._slot[b] = slot
        return slot

    def _take_side_slot(self, b: int, protected: set[int]) -> int:
        """:meth:`_take_slot` over side groups: a reserved or fresh group, else a reclaimed entry's."""
        assert self.side is not None
        g = self.side.take()
        if g is None:
            victim = next((x for x in self._slot if x not in protected and not self._live(x)), None)
            if victim is None:
                victim = next((x for x in self._window if x not in protected and x not in self._provisional), None)
            if victim is None:
                raise OutOfBlocksError(
                    "no block group is free for a full-precision tail slot: open blocks of running requests "
                    "hold the pool; the scheduler reserves them before a step (SideGroups.reserve)")
            self._window.pop(victim, None)
            g = self._slot.pop(victim)
        self._slot[b] = g
        return g

    def _take_side_sink(self, b: int, protected: set[int]) -> int | None:
        """:meth:`_take_sink` over side groups: a free part of a group other copies hold (an 8-bit copy takes
        ``1 / sinks_per_group`` of a group's bytes), else a reserved group (the scheduler counts a chunk that seals
        a first block), else a free one, else an idle copy's."""
        assert self.side is not None
        slot = self._free_copy_slot()
        if slot is not None:
            self._sink[b] = slot
            return slot
        victim = next((x for x in self._sink if x not in protected and not self._live(x)), None)
        if victim is None and self._is_in_use is not None:
            in_use = self._is_in_use
            victim = next((x for x in self._sink if x not in protected and not in_use(x)), None)
        if victim is None:
            return self._sink_from_window_copy(b, protected)
        self._sink[b] = slot = self._sink.pop(victim)
        return slot

    def _sink_from_window_copy(self, b: int, protected: set[int]) -> int | None:
        """The 8-bit slot of the oldest window copy of a block the plan does not touch, for ``b``'s first-block
        copy (a prefix depends on it; a window copy is optional); ``None`` when there is none."""
        victim = next((x for x in self._wcopy if x not in protected), None)
        if victim is None:
            return None
        self._sink[b] = slot = self._wcopy.pop(victim)[1]
        return slot

    def _free_copy_slot(self, *, beside_sinks: bool = False) -> int | None:
        """An 8-bit slot no copy holds, counted as held from now on; ``None`` when none is free. Over fixed pools a
        free slot; over side groups a free part of a held group (the lowest; ``beside_sinks``: one in a group a
        first-block copy holds first), else a reserved or free group, whose other parts become free parts."""
        if self.side is None:
            if not self._sink_slots.num_free:
                return None
            (slot,) = self._sink_slots.take(1)
            return slot
        c = self.sinks_per_group
        if self._part_free:
            if beside_sinks:
                # window copies come and go, so a group that holds only them is given back soon, while one beside a
                # first-block copy stays (int2: a request's first-block and window copies then share one group every
                # other block instead of never)
                lasting = {x // c for x in self._sink.values()}
                slot = min(self._part_free, key=lambda x: (x // c not in lasting, x))
            else:
                slot = min(self._part_free)
            self._part_free.discard(slot)
            self._group_copies[slot // c] += 1
            return slot
        g = self.side.take()
        if g is None:
            return None
        self._group_copies[g] = 1
        self._part_free.update(range(c * g + 1, c * g + c))
        return c * g

    def _take_window_copy(self, b: int, owner: Hashable, protected: set[int]) -> int | None:
        """An 8-bit slot for ``b``'s window copy (``window_bits`` 8), booked for ``owner``; ``None`` when there is
        none: a free slot (over side groups a free part of a held group, else a reserved or free group), else the
        oldest window copy of a block the plan does not touch. Optional, as a 16-bit window copy is: without one
        the block is read as sealed."""
        slot = self._free_copy_slot(beside_sinks=True)
        if slot is None:
            victim = next((x for x in self._wcopy if x not in protected), None)
            if victim is None:
                return None
            slot = self._wcopy.pop(victim)[1]
        self._wcopy[b] = (owner, slot)
        return slot

    def _take_sink(self, b: int, protected: set[int]) -> int | None:
        if self.side is not None:
            return self._take_side_sink(b, protected)
        if not self._sink_slots.num_free:
            victim = next((x for x in self._sink if x not in protected and not self._live(x)), None)
            if victim is None and self._is_in_use is not None:
                in_use = self._is_in_use
                victim = next((x for x in self._sink if x not in protected and not in_use(x)), None)
            if victim is None and any(x not in protected for x in self._wcopy):
                return self._sink_from_window_copy(b, protected)
            if victim is None:
                victim = next((x for x in self._sink if x not in protected), None)
            if victim is None:
                return None
            self._drop_sink(victim)
        (slot,) = self._sink_slots.take(1)
        self._sink[b] = slot
        return slot
