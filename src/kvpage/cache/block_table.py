"""``BlockTable``: one request's block ids, in order, and the slot of each of its tokens.

Tensor-free: a slot is ``block_id * block_size + offset`` into the cache tensors the
:class:`~kvpage.cache.controller.CacheController` allocated. Imports nothing from kvpage.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
        """Slots of tokens ``start .. end-1`` (the slot mapping of one step).

        Raises:
            IndexError: a position in the range has no reserved slot.
        """
        return [self.slot(p) for p in range(start, end)]
