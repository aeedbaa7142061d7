"""``SlidingWindowManager``: a sliding-window layer group whose memory is bounded by the window, not the context.

The group's layers keep their KV in a pool of *window slots* of their own, far smaller than the block pool:
a block of the shared block table has a slot only while some request's window still covers it (or while it is
cached in the prefix index and no slot is wanted for newer content). A query at position ``p`` reads positions
``> p - sliding_window``, so once a request's next token is at ``t``, its blocks before ``(t - W + 1) // bs`` are
never read by it again and their slots go back. A prefix hit of ``L`` blocks is usable only when the blocks
inside the window of its end still have slots (vLLM's ``SlidingWindowManager`` rule); blocks a tier loads count
when their source holds the window rows (:meth:`SlidingWindowManager.usable_external`). Either the ``sliding``
group beside full-attention layers (Gemma 2/3), or the ``main`` group of a model whose every layer is windowed
(Mistral): then block ids carry no tensor at all. Tensor-free: each pass's plan carries the block tables and
slot mapping translated to window slots (:meth:`SlidingWindowManager.plan`), and the tiers' transfers the slots
of their blocks (:meth:`SlidingWindowManager.window_rows`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvpage.cache.groups.base import GroupManager, SideNeed
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.requests import SupportsKVCache
from kvpage.cache.step_plan import GroupPlan, PassRequest
from kvpage.spec import LayerGroupSpec


class WindowSlotsExhaustedError(RuntimeError):
    """A block needed a window slot and none was free or evictable (the promises of :meth:`~SlidingWindowManager.reserve`
    were bypassed: a caller allocated blocks without promising their slots first)."""


class SlidingWindowManager(GroupManager):
    """Window-slot bookkeeping and prefix policy of a sliding-window group.

    Slot life: a block gets a slot when a request takes it for new content (promised before by
    :meth:`reserve`); it is *pinned* by every request whose window reaches it; unpinned, it stays as a
    cached slot (LRU, evictable) while the block is in the prefix index, else it is freed at once; the block's
    death (freed, evicted, rolled back) frees it.

    Args:
        group: the layer group's spec (``sliding_window`` set; a block-wise format's group is served by a
            :class:`~kvpage.cache.groups.SealedWindowManager`, which holds one of these for its codes).
        num_slots: window slots (rows of the group's cache tensors), >= 1.
        pool: the device block pool, asked which blocks are cached (their slots are worth keeping); ``None``: none.

    Raises:
        ValueError: no window in ``group``, or ``num_slots < 1``.
    """

    def __init__(self, group: LayerGroupSpec, num_slots: int, pool: PrefixBlockPool | None = None) -> None:
        super().__init__(group, pool)
        if group.sliding_window is None:
            raise ValueError(f"group {group.name!r} has no sliding window")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.window = group.sliding_window
        self.block_size = group.layer.block_size
        self.num_slots = num_slots
        self._slot: dict[int, int] = {}                   # block id -> slot
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._pins: dict[int, int] = {}                   # block id -> requests whose window reaches it
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned blocks keeping a slot, oldest first
        self._req: dict[str, dict[int, None]] = {}        # request -> its pinned blocks, table order
        self._start: dict[str, int] = {}                  # request -> table index its window starts at
        self._promised = 0
        self._evicted: dict[int, int] = {}                # block id -> slot it held when evicted, this pass

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is in the prefix index (its slot is worth keeping once no window reaches it)."""
        return self.pool is not None and self.pool.block_hash(block_id) is not None

    # -- the window -------------------------------------------------------------------------------------------

    def first_block(self, position: int) -> int:
        """Index of the first block a query at ``position`` (or any later one) reads."""
        return max(0, position - self.window + 1) // self.block_size

    def slot_of(self, block_id: int) -> int | None:
        """The block's window slot, or ``None`` when its window-layer KV is not held (no side effects)."""
        return self._slot.get(block_id)

    def window_rows(self, block_ids: Sequence[int]) -> list[int | None]:
        """:meth:`slot_of` of each block (the tiers' :class:`~kvpage.cache.tiers.types.WindowSlots`)."""
        return [self._slot.get(b) for b in block_ids]

    def rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """The group's rows are window slots: :meth:`window_rows`."""
        return self.window_rows(block_ids)

    def evicted_rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """:meth:`evicted_window_rows`."""
        return self.evicted_window_rows(block_ids)

    def evicted_window_rows(self, block_ids: Sequence[int]) -> list[int | None]:
        """The slot each block held when the device evicted it in this scheduling pass (``None``: it held none,
        or was not evicted); its content stays until the next forward pass, so a ``write_back`` copy reads it."""
        return [self._evicted.get(b) for b in block_ids]

    @property
    def num_free_slots(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    @property
    def num_pinned_slots(self) -> int:
        """Slots of blocks some request's window reaches."""
        return sum(1 for b in self._slot if self._pins.get(b, 0) > 0)

    @property
    def num_cached_slots(self) -> int:
        """Slots kept for cached blocks no window reaches (evictable)."""
        return len(self._lru)

    # -- GroupManager -----------------------------------------------------------------------------------------

    def usable_prefix(self, block_ids: Sequence[int]) -> int:
        """The longest ``L`` whose blocks inside the window of position ``L * block_size`` all hold slots."""
        held = [b in self._slot for b in block_ids]
        for n in range(len(block_ids), 0, -1):
            if all(held[self.first_block(n * self.block_size):n]):
                return n
        return 0

    def usable_external(self, device_ids: Sequence[int], windows: Sequence[bool], num_external_tokens: int) -> int:
        """The most loaded tokens whose end keeps the window rule: every block inside the window of the end is a
        device hit holding a slot or a load whose source holds the window rows (``windows``). Ends are the
        whole run (its last block may be partial: a swap-in) or a block boundary; 0 when none qualifies (the
        device hits alone always do: :meth:`usable_prefix`)."""
        bs = self.block_size
        d = len(device_ids)
        held = [b in self._slot for b in device_ids] + [bool(w) for w in windows]
        ends = [num_external_tokens] + [k * bs for k in range(len(windows) - 1, 0, -1) if k * bs < num_external_tokens]
        for n in ends:
            end = d * bs + n
            if n > 0 and all(held[self.first_block(end):-(-end // bs)]):
                return n
        return 0

    def on_blocks_dead(self, block_ids: Sequence[int], *, evicted: bool = False) -> None:
        """Dead blocks (freed uncached, evicted, rolled back, handed out anew): their slots go back and no request
        pins them; an evicted block's slot is kept in mind until the next pass (:meth:`evicted_window_rows`)."""
        for b in block_ids:
            slot = self._slot.get(b)
            self._drop([b])
            if evicted and slot is not None:
                self._evicted[b] = slot

    def slots_needed(self, request: SupportsKVCache, block_ids: Sequence[int], num_computed: int, num_new: int, *,
                     num_draft: int = 0, copy_on_write: bool = False) -> SideNeed:
        """``(new slots)`` a chunk takes: one per block it adds to the table from the window of its first query on
        (matched in-window blocks hold theirs; loaded blocks before that window get none), one more for a block
        copied on write."""
        first_new = max(len(block_ids), self.first_block(num_computed))
        return (max(0, -(-(num_computed + num_new) // self.block_size) - first_new) + int(copy_on_write),)

    def fits(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Whether free plus evictable slots (not ``protected``' ones) cover every promise and ``need`` more."""
        (k,) = need
        if not k:
            return True
        keep = set(protected)
        evictable = sum(1 for b in self._lru if b not in keep)
        return self._promised + k <= len(self._free) + evictable

    def reserve(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Promise ``need`` slots when they :meth:`fits`."""
        if not self.fits(need, protected):
            return False
        self._promised += need[0]
        return True

    def unreserve(self, need: SideNeed) -> None:
        """Take back a promise."""
        self._promised = max(0, self._promised - need[0])

    def release(self) -> None:
        """Forget every promise and the slots of blocks evicted in the last pass (a new scheduling pass begins)."""
        self._promised = 0
        self._evicted.clear()

    def on_request_blocks(self, request_id: str, block_ids: Sequence[int], num_matched_tokens: int | None) -> None:
        """The request's table is now ``block_ids``: pin what its window reaches, giving new blocks their slots.

        ``num_matched_tokens``: on admission, the tokens of its prefix hit (its window starts there); ``None``
        when the request grew (every block past the pinned ones is new content, ahead of the window).

        Raises:
            WindowSlotsExhaustedError: a new block found no free or evictable slot.
        """
        pinned = self._req.get(request_id)
        if pinned is None:  # admission: the window starts at the end of the hit
            pinned = self._req[request_id] = {}
            self._start[request_id] = self.first_block(num_matched_tokens or 0)
        for b in block_ids[self._start[request_id]:]:
            if b in pinned:
                continue
            if b not in self._slot:
                self._assign(b)
            pinned[b] = None
            self._pins[b] = self._pins.get(b, 0) + 1
            self._lru.pop(b, None)

    def can_fork(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        """Whether every block the child's window reaches at ``num_tokens`` still holds a slot."""
        return all(b in self._slot for b in block_ids[self.first_block(num_tokens):])

    def on_fork(self, parent_id: str, child_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        """The child pins the shared blocks its window reaches (they hold slots: :meth:`can_fork`)."""
        self._start[child_id] = self.first_block(num_tokens)
        pinned = self._req[child_id] = {}
        for b in block_ids[self._start[child_id]:]:
            pinned[b] = None
            self._pins[b] = self._pins.get(b, 0) + 1
            self._lru.pop(b, None)

    def on_block_copied(self, request_id: str, old: int, new: int) -> None:
        """The request's ``old`` becomes ``new``: ``new`` gets a slot and the request's pin; ``old`` keeps a pin
        of the pending copy (its slot is read by the copy) until :meth:`on_copies_applied`."""
        self._assign(new)
        pinned = self._req.setdefault(request_id, {})
        pinned[new] = None
        self._pins[new] = self._pins.get(new, 0) + 1
        if pinned.pop(old, False) is None:  # the request pinned it: its pin becomes the copy's
            return
        self._pins[old] = self._pins.get(old, 0) + 1
        self._lru.pop(old, None)

    def on_copies_applied(self, pairs: Sequence[tuple[int, int]]) -> None:
        """The copies read their sources: drop the pins they held."""
        for old, _ in pairs:
            self._unpin(old)

    def window_table(self, table: Sequence[int], start: int, seq_len: int) -> list[int]:
        """A request's block table in window slots: the slot of each block from the window of its first query
        (``start``) on, 0 before it (never read) and for blocks past ``seq_len`` without one (no side effects).

        Raises:
            RuntimeError: a block inside the window (before ``seq_len``) has no window slot.
        """
        bs = self.block_size
        row = [0] * len(table)
        for j in range(self.first_block(start), len(table)):
            slot = self._slot.get(table[j])
            if slot is None:
                if j * bs < seq_len:
                    raise RuntimeError(f"group {self.name!r}: block {table[j]} (index {j}) inside the window has "
                                       f"no window slot")
                continue
            row[j] = slot
        return row

    def advance_all(self, requests: Sequence[PassRequest]) -> None:
        """The step's final pass starts each owned request's queries at ``num_computed``: release the slots that
        slid out of its window (:meth:`advance`; a drafter's earlier passes start later and must not)."""
        for r in requests:
            if r.request_id is not None:
                self.advance(r.request_id, r.block_ids, r.num_computed)

    def plan(self, requests: Sequence[PassRequest], final: bool) -> GroupPlan:
        """The pass's block tables and slot mapping in window slots; on the step's final pass the slots that slid out
        of every window go back first.

        Raises:
            RuntimeError: a block the pass writes or reads inside a window has no window slot.
        """
        if final:
            self.advance_all(requests)
        bs = self.block_size
        tables: list[tuple[int, ...]] = []
        slots: list[int] = []
        for r in requests:
            row = self.window_table(r.block_ids, r.num_computed, r.seq_len)
            tables.append(tuple(row))
            slots.extend(row[p // bs] * bs + p % bs for p in range(r.num_computed, r.seq_len))
        return GroupPlan(self.name, block_tables=tuple(tables), slot_mapping=tuple(slots))

    def advance(self, request_id: str, block_ids: Sequence[int], position: int) -> None:
        """The request's next query is at ``position`` (its tokens before are computed): unpin the blocks before
        its window. Unpinned cached blocks keep their slots (evictable); the others free them."""
        pinned = self._req.get(request_id)
        if pinned is None:
            return
        first = self.first_block(position)
        start = self._start[request_id]
        if first <= start:
            return
        for b in block_ids[start:first]:
            if b in pinned:
                del pinned[b]
                self._unpin(b)
        self._start[request_id] = first

    def on_request_freed(self, request_id: str) -> None:
        """The request let go of its table (finished, aborted, preempted): unpin all it pinned."""
        self._start.pop(request_id, None)
        for b in self._req.pop(request_id, {}):
            self._unpin(b)

    def reset(self) -> None:
        """The pool was re-allocated: every slot is free, nothing pinned or promised."""
        if self._req:
            raise RuntimeError(f"reset() with {len(self._req)} requests pinning window slots")
        self._start.clear()
        self._slot.clear()
        self._pins.clear()
        self._lru.clear()
        self._evicted.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._promised = 0

    # -- internals --------------------------------------------------------------------------------------------

    def _assign(self, block_id: int) -> None:
        if not self._free:
            if not self._lru:
                raise WindowSlotsExhaustedError(
                    f"group {self.name!r}: all {self.num_slots} window slots are pinned; a chunk was allocated "
                    f"without promising its slots (reserve)")
            old, _ = self._lru.popitem(last=False)
            self._free.append(self._slot.pop(old))
        self._slot[block_id] = self._free.pop()
        self._promised = max(0, self._promised - 1)

    def _unpin(self, block_id: int) -> None:
        n = self._pins.get(block_id, 0) - 1
        if n > 0:
            self._pins[block_id] = n
            return
        self._pins.pop(block_id, None)
        if block_id in self._slot:
            if self.is_cached(block_id):
                self._lru[block_id] = None
            else:
                self._free.append(self._slot.pop(block_id))

    def _drop(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            for pinned in self._req.values():
                pinned.pop(b, None)
            self._pins.pop(b, None)
            self._lru.pop(b, None)
            slot = self._slot.pop(b, None)
            if slot is not None:
                self._free.append(slot)
