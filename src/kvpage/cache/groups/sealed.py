"""``SealedGroupManager``: the group manager of quantize-on-seal (block-wise) formats such as ``int4``/``int2``.

It owns the :class:`~kvpage.cache.tail.TailTable` (open blocks, the
full-precision window and first-block copies, :mod:`kvpage.cache.tail`) and the
prefix policy those copies imply: a match is usable only behind a first block
that still has its 8-bit copy, tiers serve a prefix only after such a device
hit, and only prompt blocks are indexed. Tensor-free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpage.cache.groups.base import GroupManager
from kvpage.cache.requests import SupportsKVCache
from kvpage.cache.tail import TailTable
from kvpage.spec import LayerGroupSpec


class SealedGroupManager(GroupManager):
    """Prefix policy and tail bookkeeping of a block-wise (quantize-on-seal) layer group.

    Args:
        group: the layer group's spec (its format is a :class:`~kvpage.formats.BlockFormat`).
        num_slots: 16-bit tail slots (open blocks + window copies), >= 1.
        num_sink_slots: 8-bit first-block slots (0 disables first-block copies).
        window_blocks: sealed blocks per request that keep a 16-bit copy (``ceil(residual_tokens / block_size)``).

    Raises:
        ValueError: bad tail sizes (see :class:`~kvpage.cache.tail.TailTable`).
    """

    def __init__(
        self,
        group: LayerGroupSpec,
        *,
        num_slots: int,
        num_sink_slots: int,
        window_blocks: int,
    ) -> None:
        super().__init__(group)
        #: Global indices of the group's layers (whose tail tensors it books).
        self.layers: range = group.layer_indices
        self.table = TailTable(group.layer.block_size, num_slots, num_sink_slots, window_blocks)

    @property
    def supports_swap(self) -> bool:
        """No: the tail, window and first-block copies do not travel to the host tier, so preemption recomputes."""
        return False

    def usable_prefix(self, block_ids: Sequence[int]) -> int:
        """All blocks when the first one still has its 8-bit copy, else none.

        Reading a first block at 4 or 2 bits without its copy would answer
        differently than computing it, so the whole prefix is recomputed instead.
        """
        if block_ids and self.table.sink_of(block_ids[0]) is None and self.table.num_sink_slots:
            return 0
        return len(block_ids)

    def allows_external_prefix(self, num_device_blocks: int) -> bool:
        """Only after a device hit on the first block (the tiers carry no first-block copy)."""
        return num_device_blocks > 0 or not self.table.num_sink_slots

    def max_indexable_tokens(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """Only prompt tokens: generated tokens were computed reading their open block at 16 bits.

        A prefill of the same tokens reads them sealed, so reusing such blocks as a
        later prompt's prefix would answer differently than computing it.
        """
        prompt = getattr(request, "num_prompt_tokens", None)
        return num_computed_tokens if prompt is None else min(num_computed_tokens, int(prompt))

    def on_blocks_allocated(self, block_ids: Sequence[int]) -> None:
        """Drop the tail entries of blocks handed out anew (they may never show another request's tokens)."""
        self.table.invalidate(block_ids)

    def on_blocks_freed(self, block_ids: Sequence[int]) -> None:
        """Free at once the tail slots of a freed request's dead blocks (its open block and window copies)."""
        self.table.release(block_ids)

    def on_blocks_deduplicated(self, pairs: Sequence[tuple[int, int]], ref_count: Callable[[int], int]) -> None:
        """Hand an original first block that lost its 8-bit copy the duplicate's fresh one.

        Without it such a prefix never hits again while its blocks stay indexed (:meth:`usable_prefix` says 0,
        the recompute's duplicate gets a copy and dies with its request). The copy is of equal tokens and
        replaces block 0's codes when read, so a hit reads what the duplicate's request read. Only when
        nobody but the duplicate's request references the original (a request reading the original now
        keeps reading it as it began).
        """
        for dup, orig in pairs:
            if ref_count(orig) <= 1:
                self.table.move_sink(dup, orig)

    def side_slots_free(self, is_in_use: Callable[[int], bool], is_live: Callable[[int], bool]) -> int:
        """Tail slots the next plan can take whatever its batch (:meth:`TailTable.num_takeable`)."""
        return self.table.num_takeable(is_in_use, is_live)

    def side_slots_needed(self, request: SupportsKVCache, block_ids: Sequence[int], num_computed: int,
                          num_new_tokens: int) -> int:
        """Tail slots the chunk's plan takes (:meth:`TailTable.slots_to_take`, owner = the request id, as the engine's plans)."""
        prompt = getattr(request, "num_prompt_tokens", None)
        return self.table.slots_to_take(block_ids, num_computed, num_new_tokens,
                                        0 if prompt is None else int(prompt), request.request_id)

    def reset(self) -> None:
        """Drop every tail entry."""
        self.table.reset()
