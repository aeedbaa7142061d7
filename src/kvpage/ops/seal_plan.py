"""The tensor plan of one forward pass over quantize-on-seal (block-wise) layers: what is sealed, written, read.

:class:`SealPlan` and its per-request :class:`RequestRead` are plain index
tensors, made once per step by the tail's bookkeeping
(:meth:`kvpage.cache.tail.TailTable.plan`) and applied by every block-wise layer
(:mod:`kvpage.ops.sealed_attention`). Imports nothing from kvpage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RequestRead:
    """Where request ``i``'s context is read from after this step's writes.

    Attributes:
        full_ids: ``[num_full]`` int64 pool ids of its full (sealed) blocks, in order.
        fp_blocks: ``(block index, slot)`` of full blocks holding a 16-bit window copy that a query of this
            pass reads: the query at position ``p`` reads block ``j``'s copy when ``p // block_size -
            window_blocks <= j < p // block_size`` (its own window, as decoding at ``p`` reads it), the block
            as stored otherwise. When all the pass's queries lie in one block they all read every copy.
        copy_blocks: ``(block index, 8-bit slot)`` of full blocks whose window copy is an ``int8`` copy in an 8-bit
            (first-block copy) slot instead (a format whose :meth:`~kvpage.formats.BlockFormat.window_copy_bits` is
            8; the slot holds the whole block), read by the same rule as :attr:`fp_blocks`.
        sink_slot: sink slot of its first block, or ``None`` (read the quantized block).
        open_slot: slot of its partial last block, or ``None`` when the context fills whole blocks.
        open_len: tokens in the partial block (0 when ``open_slot`` is ``None``).
        sealed_now: ``(block index, seal index, slot)`` of each of its blocks sealed this step:
            the block's index in its table, its index in :attr:`SealPlan.seal_ids` (its rows in
            the step's seal batch) and the 16-bit slot that still holds its rows during this
            step, or ``None``. A query reads **its own block** at full precision -- from the
            open slot while it is partial, from these rows in the step that seals it -- and
            every earlier block as stored, so prefill in whole-block chunks, decode and a
            prefix hit all read the same thing (see :mod:`kvpage.ops.sealed_attention`).
        window_blocks: blocks before a query's own block that it reads from their window copies (KIVI's
            residual window, ``ceil(kv_quant_residual_tokens / block_size)``).
    """

    full_ids: torch.Tensor
    fp_blocks: tuple[tuple[int, int], ...]
    sink_slot: int | None
    open_slot: int | None
    open_len: int
    sealed_now: tuple[tuple[int, int, int | None], ...] = ()
    window_blocks: int = 0
    copy_blocks: tuple[tuple[int, int], ...] = ()

    @property
    def window_copies(self) -> bool:
        """Whether any block is read from a window copy (16-bit or 8-bit)."""
        return bool(self.fp_blocks or self.copy_blocks)


@dataclass(frozen=True, slots=True)
class SealPlan:
    """What one forward pass writes and reads, shared by every quantize-on-seal layer.

    Row indices address this step's new tokens (``[num_tokens]``, in batch order), flat
    tail rows (``slot * block_size + offset``) or flat sink rows likewise.

    Attributes:
        tail_dst: ``[n]`` int64 tail rows receiving new tokens.
        tail_src: ``[n]`` int64 new-token rows written there.
        seal_ids: ``[m]`` int64 pool blocks sealed this step.
        seal_from_new_dst / seal_from_new_src: rows of the ``[m * block_size]`` seal batch
            taken from new tokens.
        seal_from_tail_dst / seal_from_tail_src: rows of the seal batch taken from tail rows
            (tokens written in earlier steps).
        sink_pos: ``[k]`` int64 indices into ``seal_ids`` of blocks getting an 8-bit copy of their first
            :func:`~kvpage.spec.sink_rows` rows: first blocks, and window blocks of a format whose window copies
            are 8-bit (:attr:`RequestRead.copy_blocks`).
        sink_slots: ``[k]`` int64 their 8-bit slots.
        reads: one :class:`RequestRead` per request.
    """

    tail_dst: torch.Tensor
    tail_src: torch.Tensor
    seal_ids: torch.Tensor
    seal_from_new_dst: torch.Tensor
    seal_from_new_src: torch.Tensor
    seal_from_tail_dst: torch.Tensor
    seal_from_tail_src: torch.Tensor
    sink_pos: torch.Tensor
    sink_slots: torch.Tensor
    reads: tuple[RequestRead, ...]
