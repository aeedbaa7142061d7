"""Tensor-free block bookkeeping: a free list with ref counts, per-request block tables and slot mapping.

Nothing here touches a tensor: blocks are integer ids into the pool that the
:class:`~kvpage.cache.controller.CacheController` allocated (nano-vllm's
``BlockManager`` and vLLM v1's ``BlockPool`` work the same way). Ref counts are
kept per block so that the prefix cache can share blocks between requests.

Invariants (checked by tests after every operation):
    * ``num_free + num_used == num_blocks``;
    * a block is never freed twice and a ref count never goes negative;
    * a block id is either in the free list or has ref count > 0, never both.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpage.errors import OutOfBlocksError


class BlockPool:
    """A pool of ``num_blocks`` block ids with ref counts.

    ``allocate`` takes from the front of the free list and ``free`` returns to
    the back, so recently freed blocks are reused last (the LRU order the
    prefix cache builds on).

    Args:
        num_blocks: blocks in the pool (``num_gpu_blocks``).

    Raises:
        ValueError: ``num_blocks < 0``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks in the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def ref_count(self, block_id: int) -> int:
        """Current ref count of ``block_id``.

        Raises:
            ValueError: ``block_id`` out of range.
        """
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return self._ref[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each).

        ``allocate(0)`` returns ``[]`` (case C20).

        Raises:
            ValueError: ``n < 0``.
            OutOfBlocksError: fewer than ``n`` blocks are free; nothing is taken.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} blocks, only {len(self._free)} of {self.num_blocks} are free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks already in use (sharing).

        Raises:
            ValueError: a block is free (ref count 0) or out of range; nothing is changed.
        """
        ids = list(block_ids)
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} is free; cannot add a reference")
        for b in ids:
            self._ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each block; blocks reaching 0 return to the free list.

        Args:
            block_ids: blocks to release; a request frees its table tail first
                (pass them reversed) so its deepest blocks are reused first.

        Returns:
            The blocks that became free.

        Raises:
            ValueError: a block is already free (double free) or out of range;
                nothing is changed.
        """
        ids = list(block_ids)
        drops: dict[int, int] = {}
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self._ref[b]:
                raise ValueError(f"block {b} freed more times than it is referenced (double free)")
        freed = []
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed


@dataclass
class BlockTable:
    """One request's blocks, in order, and how many tokens they hold.

    Attributes:
        block_ids: block ids; token ``t`` lives in ``block_ids[t // block_size]``.
        num_tokens: tokens whose slots are reserved.
        block_size: tokens per block.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def capacity(self) -> int:
        """Tokens the table's blocks can hold."""
        return len(self.block_ids) * self.block_size

    def slot(self, position: int) -> int:
        """Slot of token ``position``: ``block_ids[position // block_size] * block_size + position % block_size``.

        Raises:
            IndexError: the position has no reserved slot.
        """
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"token position {position} has no slot (table holds {self.num_tokens} tokens)")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, start: int, end: int) -> list[int]:
        """Slots of tokens ``start .. end-1`` (the slot mapping of one step)."""
        return [self.slot(p) for p in range(start, end)]


class BlockManager:
    """Per-request block tables over one :class:`BlockPool` (the scheduler's view of the cache).

    Paired verbs as in nano-vllm: :meth:`can_allocate`/:meth:`allocate`,
    :meth:`can_append`/:meth:`append_slots`; :meth:`free` at the end.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.tables: dict[str, BlockTable] = {}

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return math.ceil(num_tokens / self.block_size)

    def _extra_blocks(self, request_id: str, num_new_tokens: int) -> int:
        table = self.tables.get(request_id) or BlockTable(self.block_size)
        return self.blocks_for(table.num_tokens + num_new_tokens) - len(table.block_ids)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request of ``num_tokens`` tokens fits in the free blocks now."""
        return self.blocks_for(num_tokens) <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> BlockTable:
        """Create ``request_id``'s table with slots for ``num_tokens`` tokens.

        Raises:
            ValueError: the request already has a table, or ``num_tokens < 0``.
            OutOfBlocksError: not enough free blocks; nothing is taken.
        """
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        table = BlockTable(self.block_size, self.pool.allocate(self.blocks_for(num_tokens)), num_tokens)
        self.tables[request_id] = table
        return table

    def can_append(self, request_id: str, num_new_tokens: int = 1) -> bool:
        """Whether ``num_new_tokens`` more tokens of the request fit."""
        return self._extra_blocks(request_id, num_new_tokens) <= self.pool.num_free

    def append_slots(self, request_id: str, num_new_tokens: int = 1) -> list[int]:
        """Reserve slots for ``num_new_tokens`` more tokens; returns their slots.

        Raises:
            KeyError: unknown request.
            ValueError: ``num_new_tokens < 0``.
            OutOfBlocksError: not enough free blocks; nothing is taken.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self.tables[request_id]
        table.block_ids.extend(self.pool.allocate(self._extra_blocks(request_id, num_new_tokens)))
        start = table.num_tokens
        table.num_tokens += num_new_tokens
        return table.slot_mapping(start, table.num_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first) and forget its table; unknown ids are ignored."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pool.free(reversed(table.block_ids))
