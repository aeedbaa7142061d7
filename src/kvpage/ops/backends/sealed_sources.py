"""Per-step source tables of the quantize-on-seal formats for kernels that read them block by block.

For each request and logical block of its context: where its rows live after this step's writes (a sealed pool
block, a 16-bit tail slot, a sealed first block whose first rows an 8-bit copy holds, a window block read from its
8-bit copy) and at which index; and
which requests a fused kernel can serve (one source per block for all of a request's queries) and which must
attend through the reference path.
Torch only; shared by the ``cpu`` and ``triton`` backends, so both kernels serve exactly the same requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.sealed_attention import SealContext

#: Source kinds of a logical block: its sealed pool block, a 16-bit tail slot (a window copy, the block sealed
#: this step while its slot still holds the rows, or the open block), a sealed first block whose first
#: :func:`~kvpage.spec.sink_rows` rows are read from its int8 (sink) copy instead (index: the pool block; the copy's
#: slot in :attr:`SealedSources.sink`), a window block whose 8-bit copy holds all its rows (index: the copy's 8-bit
#: slot, rows ``slot * sink_rows ..``; formats whose copies hold whole blocks).
SRC_POOL, SRC_TAIL, SRC_SINK, SRC_COPY = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class SealedSources:
    """One step's source tables (host tensors; the kernel's backend moves them to its device).

    Attributes:
        kind: ``[B, W]`` uint8 source kind of each request's logical block (``W`` = most blocks of any context;
            padding entries are :data:`SRC_POOL` 0 and never read).
        index: ``[B, W]`` int64 pool block id (:data:`SRC_POOL`, :data:`SRC_SINK`), tail slot (:data:`SRC_TAIL`) or
            8-bit slot (:data:`SRC_COPY`) of each.
        sink: ``[B]`` int64 each request's sink slot (-1: none), read where its first block is :data:`SRC_SINK`.
        kernel_rows: requests the kernel serves (ascending).
        sdpa_rows: the others (ascending): query runs longer than ``max_query``, runs whose queries lie in
            several blocks, and short ones whose own block sealed without a slot.
    """

    kind: torch.Tensor
    index: torch.Tensor
    sink: torch.Tensor
    kernel_rows: tuple[int, ...]
    sdpa_rows: tuple[int, ...]


def sealed_sources(ctx: SealContext, meta: AttentionMetadata, max_query: int) -> SealedSources:
    """The source tables of ``ctx.plan`` for the batch ``meta`` (no side effects).

    A request is a kernel row when it has at most ``max_query`` new tokens, all in one block, and that block is
    either open or sealed now with its tail slot still holding the rows (decode): the kernel then reads one source
    per block for all its queries, exactly what :func:`~kvpage.ops.sealed_attention.sealed_request` reads.
    """
    bs = meta.block_size
    width = max((-(-s // bs) for s in meta.seq_lens), default=0)
    kinds: list[list[int]] = []
    index: list[list[int]] = []
    sinks: list[int] = []
    sdpa: set[int] = set()
    qsl = meta.query_start_loc
    for i, read in enumerate(ctx.plan.reads):
        # the order of read_sealed: pool blocks, then window copies, then block 0 with its sink copy
        ids = read.full_ids.tolist()
        kind = [SRC_POOL] * len(ids)
        for j, slot in read.fp_blocks:
            kind[j], ids[j] = SRC_TAIL, slot
        for j, slot in read.copy_blocks:
            kind[j], ids[j] = SRC_COPY, slot
        sinks.append(-1 if read.sink_slot is None or not ids else read.sink_slot)
        if sinks[-1] >= 0:
            kind[0], ids[0] = SRC_SINK, int(read.full_ids[0])
        s, n = meta.seq_lens[i], qsl[i + 1] - qsl[i]
        if n > max_query:
            sdpa.add(i)
        elif n and (s - n) // bs != (s - 1) // bs:
            # queries in several blocks read different windows and their own blocks at full precision
            sdpa.add(i)
        elif read.sealed_now:
            # a query reads its own block at full precision: served when all lie in the one block sealed now and
            # its slot still holds the rows (decode)
            j, _, own_slot = read.sealed_now[0]
            if len(read.sealed_now) > 1 or own_slot is None or (s - n) // bs != j:
                sdpa.add(i)
            else:
                kind[j], ids[j] = SRC_TAIL, own_slot
        if read.open_slot is not None:
            kind.append(SRC_TAIL)
            ids.append(read.open_slot)
        pad = width - len(ids)
        kinds.append(kind + [SRC_POOL] * pad)
        index.append(ids + [0] * pad)
    b = len(kinds)
    return SealedSources(
        torch.tensor(kinds, dtype=torch.uint8).reshape(b, width),
        torch.tensor(index, dtype=torch.long).reshape(b, width),
        torch.tensor(sinks, dtype=torch.long),
        tuple(i for i in range(meta.num_requests) if i not in sdpa),
        tuple(sorted(sdpa)),
    )


__all__ = ["SRC_COPY", "SRC_POOL", "SRC_SINK", "SRC_TAIL", "SealedSources", "sealed_sources"]
