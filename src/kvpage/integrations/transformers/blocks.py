"""``BlockTable``: the paged bookkeeping of one cache layer -- which pool block holds each batch row's block.

Tensor-free. Every batch row of a transformers batch holds the same number of tokens (left padding
included), so one layer's state is: ``num_tokens``, the index ``first`` of the oldest block still kept (0
unless a sliding-window layer dropped the blocks that slid out), and per row the ids of its blocks
``first, first + 1, ...`` in the layer's pool. Blocks are reference-counted: beam search
(:meth:`BlockTable.reorder`) and ``batch_repeat_interleave`` share a parent row's blocks between its
children instead of copying them, and a shared block is copied only when a row writes into it
(:meth:`BlockTable.claim`, copy-on-write).

Imports nothing from kvpage but :mod:`kvpage.errors`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvpage.errors import OutOfBlocksError


class BlockTable:
    """Block ids of one layer's batch rows over a pool of ``capacity`` blocks, with reference counts.

    Args:
        block_size: tokens per block.
        capacity: blocks in the pool (grown by :meth:`grow`).
        limit: the most blocks the pool may ever hold (``None``: no limit).

    Attributes:
        rows: per batch row, the ids of its blocks ``first ..``.
        first: index of the oldest kept block (the same for every row).
        refs: per pool block, how many (row, block) entries hold it.
    """

    def __init__(self, block_size: int, capacity: int, limit: int | None = None) -> None:
        if block_size <= 0 or capacity < 0:
            raise ValueError(f"need block_size > 0 and capacity >= 0, got {block_size}, {capacity}")
        self.block_size = block_size
        self.limit = limit
        self.rows: list[list[int]] = []
        self.first = 0
        self.refs: list[int] = [0] * capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # a stack: lowest id first

    # -- state -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks in the pool."""
        return len(self.refs)

    @property
    def num_rows(self) -> int:
        """Batch rows."""
        return len(self.rows)

    @property
    def num_blocks(self) -> int:
        """Blocks each row holds (kept ones, ``first`` on)."""
        return len(self.rows[0]) if self.rows else 0

    def blocks_in_use(self) -> int:
        """Distinct pool blocks held by any row (a block shared by beams counts once)."""
        return sum(1 for r in self.refs if r > 0)

    def filled_slots(self, num_tokens: int) -> int:
        """Token slots of the distinct blocks in use that hold one of the first ``num_tokens`` tokens (a block
        shared by beams counts once; the unfilled end of a partial block and blocks past ``num_tokens`` don't)."""
        bs = self.block_size
        filled: dict[int, int] = {}
        for r in self.rows:
            for j, b in enumerate(r):
                filled[b] = max(0, min(bs, num_tokens - (self.first + j) * bs))
        return sum(filled.values())

    def ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[num_rows, num_blocks]`` int64 block ids of blocks ``first ..`` of every row."""
        return torch.tensor(self.rows, dtype=torch.long, device=device).view(self.num_rows, self.num_blocks)

    def set_rows(self, num_rows: int) -> None:
        """Start ``num_rows`` empty rows (the table must hold no blocks).

        Raises:
            RuntimeError: rows still hold blocks.
        """
        if any(self.rows):
            raise RuntimeError("set_rows on a table whose rows still hold blocks; truncate(0) first")
        self.rows = [[] for _ in range(num_rows)]
        self.first = 0

    # -- allocation --------------------------------------------------------------------------
    def missing(self, num_tokens: int, written_from: int) -> int:
        """Fresh blocks :meth:`claim` would take to hold ``num_tokens`` tokens, writing from block ``written_from``."""
        want = math.ceil(num_tokens / self.block_size) - self.first
        new = sum(max(0, want - len(r)) for r in self.rows)
        shared = sum(1 for r in self.rows for j in range(max(0, written_from - self.first), min(len(r), want))
                     if self.refs[r[j]] > 1)
        return new + shared

    def grow(self, capacity: int) -> None:
        """Add blocks to the pool, up to ``capacity`` (the caller grows its tensors to match).

        Raises:
            OutOfBlocksError: beyond ``limit``.
        """
        if self.limit is not None and capacity > self.limit:
            raise OutOfBlocksError(
                f"the KV cache needs {capacity} blocks of {self.block_size} tokens in a layer, but "
                f"max_cache_tokens allows {self.limit}; pass a larger max_cache_tokens (or None to grow on demand)"
            )
        old = self.capacity
        self.refs.extend([0] * (capacity - old))
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free

    def _take(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"no free block among {self.capacity}; grow the pool first")
        b = self._free.pop()
        self.refs[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._free.append(b)

    def claim(self, num_tokens: int, written_from: int) -> list[tuple[int, int]]:
        """Give every row blocks for ``num_tokens`` tokens, its blocks from index ``written_from`` on its own.

        A row's block ``j >= written_from`` that is shared with another row gets a fresh id (copy-on-write);
        the caller copies the old block's data into the new one (for the tokens it keeps) before writing.
        New blocks are fresh ids. Pool capacity must suffice (:meth:`missing`, :meth:`grow`).

        Returns:
            ``(old_id, new_id)`` pairs whose data the caller must copy.
        """
        want = math.ceil(num_tokens / self.block_size) - self.first
        copies: list[tuple[int, int]] = []
        for r in self.rows:
            for j in range(max(0, written_from - self.first), min(len(r), want)):
                if self.refs[r[j]] > 1:
                    new = self._take()
                    copies.append((r[j], new))
                    self._release(r[j])
                    r[j] = new
            while len(r) < want:
                r.append(self._take())
        return copies

    def slots(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[num_rows * count]`` int64 slots (``block * block_size + offset``) of positions ``start ..`` of each row.

        Row-major: row ``b``'s ``count`` slots, then row ``b + 1``'s.
        """
        bs = self.block_size
        pos = torch.arange(start, start + count)
        table = torch.tensor(self.rows, dtype=torch.long).view(self.num_rows, -1)
        blocks = table[:, pos // bs - self.first]                               # [B, count]
        return (blocks * bs + pos % bs).flatten().to(device)

    # -- shrinking ---------------------------------------------------------------------------
    def truncate(self, num_tokens: int) -> None:
        """Free every row's blocks beyond those ``num_tokens`` tokens need.

        Raises:
            ValueError: ``num_tokens`` reaches back before block ``first`` (those blocks are gone).
        """
        keep = 0 if num_tokens == 0 else math.ceil(num_tokens / self.block_size) - self.first
        if keep <= 0 and num_tokens:
            raise ValueError(f"cannot truncate to {num_tokens} tokens: blocks before {self.first} were dropped")
        for r in self.rows:
            for b in r[keep:]:
                self._release(b)
            del r[keep:]
        if num_tokens == 0:
            self.first = 0

    def drop_before(self, block_index: int) -> None:
        """Free every row's blocks before block ``block_index`` (sliding-window layers); ``first`` moves there."""
        n = min(block_index, self.first + self.num_blocks) - self.first
        if n <= 0:
            return
        for r in self.rows:
            for b in r[:n]:
                self._release(b)
            del r[:n]
        self.first += n

    # -- batch -------------------------------------------------------------------------------
    def reorder(self, index: Sequence[int]) -> None:
        """Row ``i`` becomes old row ``index[i]`` (beam search, batch repeat/select); blocks are shared, not copied.

        Raises:
            IndexError: an index outside the rows.
        """
        idx = [int(i) for i in index]
        if any(not 0 <= i < self.num_rows for i in idx):
            raise IndexError(f"batch indices {idx} out of range for {self.num_rows} rows")
        new_rows = [list(self.rows[i]) for i in idx]
        for r in new_rows:
            for b in r:
                self.refs[b] += 1
        for r in self.rows:
            for b in r:
                self._release(b)
        self.rows = new_rows
