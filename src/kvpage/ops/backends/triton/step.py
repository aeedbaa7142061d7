"""Per-step launch metadata of the Triton backend: query tiles, context splits, sealed source tables; torch only
(no triton import).

Built once per :class:`~kvpage.ops.attention.AttentionMetadata` from its host-side tuples (no device
synchronisation) and shared by every layer of the group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.backends.sealed_sources import sealed_sources
from kvpage.ops.sealed_attention import SealContext
from kvpage.ops.staging import to_device

#: Context positions per key/value tile (``tl.dot`` wants at least 16 on a GPU).
BLOCK_N = 16
#: Smallest rows per program (``tl.dot``'s minimum M on a GPU).
MIN_BLOCK_M = 16
#: Most queries of one request per program for prefill-chunk runs.
MAX_BLOCK_Q = 16
#: Most ``rows x padded head_dim`` elements of a program's query tile.
TILE_BUDGET = 4096


def tile_shape(group: int, max_query_len: int, head_dim: int) -> tuple[int, int]:
    """``(block_q, block_m)``: queries per tile and rows per program (a power of two ``>= block_q * group``).

    Decode-only steps take one query per tile; runs take up to :data:`MAX_BLOCK_Q` queries of a request, within
    :data:`TILE_BUDGET` row-elements (at least one query's heads): larger fp32 tiles spill registers on sm_90
    (checked by compiling, :mod:`.aot`).
    """
    g = triton_next_pow2(group)
    if max_query_len <= 1:
        return 1, max(MIN_BLOCK_M, g)
    rows = min(MAX_BLOCK_Q * g, g * triton_next_pow2(max_query_len), TILE_BUDGET // triton_next_pow2(head_dim))
    block_m = max(MIN_BLOCK_M, g, rows)
    return block_m // group, block_m


def num_warps(block_m: int, head_dim: int) -> int:
    """Warps per program: 8 for tiles of 2,048 row-elements or more, else 4 (register pressure on sm_90)."""
    return 8 if block_m * triton_next_pow2(head_dim) >= 2048 else 4


def triton_next_pow2(n: int) -> int:
    """Smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (max(1, n) - 1).bit_length()


def split_count(num_programs: int, longest_tiles: int, *, target_programs: int, min_tiles_per_split: int = 4) -> int:
    """Context splits per tile (flash-decoding): enough programs to fill ``target_programs``, but each split at
    least ``min_tiles_per_split`` tiles long; 1 when the batch already fills the device or contexts are short."""
    if num_programs >= target_programs or longest_tiles < 2 * min_tiles_per_split:
        return 1
    want = math.ceil(target_programs / max(1, num_programs))
    return max(1, min(want, longest_tiles // min_tiles_per_split))


@dataclass(frozen=True, slots=True)
class StepTiles:
    """One step's batch as the kernel takes it, for one GQA group size.

    Attributes:
        items: ``[num_items, 2]`` int32 ``(request, first query of the tile)`` on the device.
        block_tables: the step's ``[batch, max_blocks]`` int64 block tables on the device.
        slot_mapping: the step's ``[num_tokens]`` int64 slots on the device.
        seq_lens: ``[batch]`` int32 on the device.
        query_start_loc: ``[batch + 1]`` int32 on the device.
        block_q: queries per tile; block_m: rows per program.
        longest_tiles: ``BLOCK_N`` tiles of the longest key range one tile reads (bounds the splits).
    """

    items: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_q: int
    block_m: int
    longest_tiles: int


def step_tiles(meta: AttentionMetadata, group: int, head_dim: int, device: torch.device) -> StepTiles:
    """The query tiles of ``meta`` for kv heads serving ``group`` query heads each (no side effects)."""
    qsl = meta.query_start_loc
    block_q, block_m = tile_shape(group, max(meta.query_lens, default=1), head_dim)
    items: list[int] = []
    for i in range(meta.num_requests):
        for q0 in range(0, qsl[i + 1] - qsl[i], block_q):
            items += [i, q0]
    longest = max(meta.seq_lens, default=0)
    return StepTiles(
        items=to_device(items, torch.int32, device).view(-1, 2),
        block_tables=meta.block_tables.to(device).contiguous(),
        slot_mapping=meta.slot_mapping.to(device),
        seq_lens=to_device(meta.seq_lens, torch.int32, device),
        query_start_loc=to_device(qsl, torch.int32, device),
        block_q=block_q, block_m=block_m, longest_tiles=math.ceil(longest / BLOCK_N) + 1,
    )


@dataclass(frozen=True, slots=True)
class SealedStep:
    """One step's quantize-on-seal batch as the sealed kernel takes it, for one GQA group size.

    Attributes:
        kind: ``[B, W]`` uint8 source kind of each request's logical block, on the device.
        index: ``[B, W]`` int64 pool block or tail slot of each, on the device.
        sink: ``[B]`` int64 each request's first-block (sink) slot, -1 for none, on the device.
        kernel_rows: requests the kernel serves; sdpa_rows: the others (host tuples).
        items: ``[num_items, 2]`` int32 ``(request, first query of the tile)`` of the kernel rows, on the device.
        seq_lens: ``[B]`` int32; query_start_loc: ``[B + 1]`` int32, on the device.
        block_q: queries per tile; block_m: rows per program.
        longest_tiles: ``BLOCK_N`` tiles of the longest kernel row's context (bounds the splits).
    """

    kind: torch.Tensor
    index: torch.Tensor
    sink: torch.Tensor
    kernel_rows: tuple[int, ...]
    sdpa_rows: tuple[int, ...]
    items: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_q: int
    block_m: int
    longest_tiles: int


def sealed_step(ctx: SealContext, meta: AttentionMetadata, group: int, head_dim: int, device: torch.device, *,
                max_query: int) -> SealedStep:
    """The source tables (:func:`~kvpage.ops.backends.sealed_sources.sealed_sources`, runs of up to ``max_query``
    new tokens) and the kernel rows' query tiles of one step (no side effects)."""
    src = sealed_sources(ctx, meta, max_query)
    qsl = meta.query_start_loc
    qlens = [qsl[i + 1] - qsl[i] for i in src.kernel_rows]
    block_q, block_m = tile_shape(group, max(qlens, default=1), head_dim)
    items: list[int] = []
    for i, n in zip(src.kernel_rows, qlens):
        for q0 in range(0, n, block_q):
            items += [i, q0]
    longest = max((meta.seq_lens[i] for i in src.kernel_rows), default=0)
    return SealedStep(
        kind=to_device(src.kind, torch.uint8, device), index=to_device(src.index, torch.long, device),
        sink=to_device(src.sink, torch.long, device), kernel_rows=src.kernel_rows, sdpa_rows=src.sdpa_rows,
        items=to_device(items, torch.int32, device).view(-1, 2),
        seq_lens=to_device(meta.seq_lens, torch.int32, device),
        query_start_loc=to_device(qsl, torch.int32, device),
        block_q=block_q, block_m=block_m, longest_tiles=math.ceil(longest / BLOCK_N) + 1,
    )
