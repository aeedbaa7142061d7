"""``TailEntries``: which 16-bit slot and which 8-bit first-block slot each block id holds (tensor-free).

The state under :class:`~kvpage.cache.tail.table.TailTable`: the entries, their LRU order, taking and
dropping slots, and the counts the scheduler reads. The per-step plan lives in :mod:`.table`. Imports
only :mod:`kvpage.cache.idpool` and :mod:`kvpage.errors`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from kvpage.cache.idpool import IdPool
from kvpage.errors import OutOfBlocksError

class TailEntries:
    """Tensor-free bookkeeping of tail and sink slots (see :mod:`kvpage.cache.tail`).

    Args:
        block_size: tokens per block.
        num_slots: 16-bit slots (open blocks + window copies).
        num_sink_slots: 8-bit first-block slots (0 disables sink copies).
        window_blocks: sealed blocks per request that keep their 16-bit copy.

    Raises:
        ValueError: negative sizes, or ``num_slots < 1``.
    """

    def __init__(
        self,
        block_size: int,
        num_slots: int,
        num_sink_slots: int,
        window_blocks: int,
    ) -> None:
        if block_size <= 0 or num_slots < 1 or num_sink_slots < 0 or window_blocks < 0:
            raise ValueError(
                f"bad tail sizes: block_size={block_size}, num_slots={num_slots}, "
                f"num_sink_slots={num_sink_slots}, window_blocks={window_blocks}"
            )
        self.block_size = block_size
        self.num_slots = num_slots
        self.num_sink_slots = num_sink_slots
        self.window_blocks = window_blocks
        self._is_live: Callable[[int], bool] | None = None    # the pool's views, for the plan being made
        self._is_in_use: Callable[[int], bool] | None = None
        self._slots = IdPool(num_slots, what="tail slot", lifo=True)  # a freed slot is reused first
        self._slot: dict[int, int] = {}                       # block id -> 16-bit slot
        self._window: OrderedDict[int, Hashable] = OrderedDict()  # block -> owner of its window copy, LRU first
        self._sink_slots = IdPool(num_sink_slots, what="sink slot", lifo=True)
        self._sink: OrderedDict[int, int] = OrderedDict()     # block id -> sink slot, LRU first
        self._sealed_after: list[int] = []                   # sealed blocks whose open slot the seal gather reads
        self._read_last: list[tuple[int, Hashable]] = []     # window copies only this step's last query reads

    # -- queries ---------------------------------------------------------------------------------

    def slot_of(self, block_id: int) -> int | None:
        """16-bit slot of ``block_id`` (open or window), or ``None``."""
        return self._slot.get(block_id)

    def sink_of(self, block_id: int) -> int | None:
        """Sink slot of ``block_id``, or ``None``."""
        return self._sink.get(block_id)

    @property
    def num_used(self) -> int:
        """16-bit slots in use."""
        return len(self._slot)

    @property
    def num_sink_used(self) -> int:
        """Sink slots in use."""
        return len(self._sink)

    @property
    def num_free(self) -> int:
        """16-bit slots no entry holds."""
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
        return [b for b in (int(table[j]) for j in range(max(0, first // bs - w - 1), hi))
                if b in self._window and self._window[b] == owner]

    # -- lifecycle -------------------------------------------------------------------------------

    def invalidate(self, block_ids: Sequence[int]) -> None:
        """Drop every entry of ``block_ids``: the pool handed them out for new content."""
        for b in block_ids:
            self._drop_fp(b)
            self._drop_sink(b)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop every entry of ``block_ids``: their content died (freed to the pool's free list, not cached).

        Called when a request is freed, so its open slot and window copies are free at once instead of
        waiting to be reclaimed. Call it between steps (not between a :meth:`plan` and its :meth:`finish`).
        """
        self.invalidate(block_ids)

    def reset(self) -> None:
        """Drop every entry (the pool was re-allocated)."""
        self.invalidate(list(self._slot) + list(self._sink))

    def move_sink(self, src: int, dst: int) -> bool:
        """Give ``src``'s 8-bit first-block copy to ``dst`` when ``dst`` has none (blocks of equal content);
        returns whether it moved. Call it between steps."""
        if dst in self._sink or src not in self._sink:
            return False
        self._sink[dst] = self._sink.pop(src)
        return True

    def _drop_fp(self, b: int) -> None:
        slot = self._slot.pop(b, None)
        if slot is not None:
            self._window.pop(b, None)
            self._slots.put([slot])

    def _drop_sink(self, b: int) -> None:
        slot = self._sink.pop(b, None)
        if slot is not None:
            self._sink_slots.put([slot])

    def _live(self, b: int) -> bool:
        return True if self._is_live is None else bool(self._is_live(b))

    def _take_slot(self, b: int, protected: set[int]) -> int:
        if not self._slots.num_free:
            victim = next((x for x in self._slot if x not in protected and not self._live(x)), None)
            if victim is None:
                victim = next((x for x in self._window if x not in protected), None)
            if victim is None:
                raise OutOfBlocksError(
                    f"the full-precision tail pool is full: {self.num_slots} slots hold open blocks of running "
                    f"requests; run fewer requests at once (max_num_seqs) or give the tail more slots"
                )
            self._drop_fp(victim)
        (slot,) = self._slots.take(1)
        self._slot[b] = slot
        return slot

    def _take_sink(self, b: int, protected: set[int]) -> int | None:
        if not self._sink_slots.num_free:
            victim = next((x for x in self._sink if x not in protected and not self._live(x)), None)
            if victim is None and self._is_in_use is not None:
                in_use = self._is_in_use
                victim = next((x for x in self._sink if x not in protected and not in_use(x)), None)
            if victim is None:
                victim = next((x for x in self._sink if x not in protected), None)
            if victim is None:
                return None
            self._drop_sink(victim)
        (slot,) = self._sink_slots.take(1)
        self._sink[b] = slot
        return slot
