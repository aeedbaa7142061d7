"""Honest KV capacity: what a cache of a given layout allocates at a budget, and the tokens that really fit (C26).

:func:`cache_capacity` is the one computation of every capacity figure kvpage reports: the builder takes its
block count from it (through :func:`kvpage.engine.sizing.kv_capacity`), ``kvpage generate`` prints its ratio,
``kvpage formats`` its tokens at a budget. It is a loop over the spec's layer groups, each group's kind saying
what it allocates over ``N`` blocks (:meth:`~kvpage.spec.GroupKind.memory`):

* the device blocks of every group whose rows are block ids (codes, scales, zero points);
* the side space of quantize-on-seal groups (``int4``, ``int2``; see :mod:`kvpage.cache.tail`): the 16-bit
  open-block slots, the 16-bit window copies of ``kv_quant_residual_tokens`` and the 8-bit first-block copies.
  They are carved out of the block pool while running requests hold them (:mod:`kvpage.cache.tail.side`: ``r = 16
  / bits`` pool blocks per slot), so they are no reservation: the report counts the pool's blocks, and allocated
  beside it are only the first-block copies' scales (:attr:`CapacityReport.sink_bytes`). Where the layout does not
  allow it (a head dimension the packing does not divide, a pool too small) fixed pools sized by ``max_num_seqs``
  are reserved and counted instead;
* the window slots of a bounded sliding-window group (:class:`~kvpage.spec.SlidingWindow`,
  :class:`~kvpage.spec.SealedWindow`): its layers' tensors have that many rows instead of one per block, so the
  block pool is sized from what is left; when every layer is windowed the budget buys window slots alone.

"x more tokens" compares the tokens that fit with the tokens a cache in the model's dtype holds in the same bytes.
Tensor-free.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvpage.formats import get_format
from kvpage.spec import CacheSizing, CacheSpec, GroupMemory, LayerGroupSpec, LayerSpec
from kvpage.spec.kinds import window_pins

__all__ = ["BudgetTooSmallError", "CapacityReport", "MiB", "cache_capacity", "reference_spec"]

MiB = 2**20


class BudgetTooSmallError(ValueError):
    """The KV budget does not hold the side pools plus one block (the message gives both byte counts)."""


@dataclass(frozen=True)
class CapacityReport:
    """Everything the engine allocates for the KV cache at one budget, and what it holds.

    Attributes:
        kv_format: the model layers' format (``int4``, ...; with per-layer precision
            :attr:`~kvpage.spec.CacheSpec.format_label`).
        model_dtype: the compute dtype's name (``float32``, ...), the reference cache's dtype.
        block_size: tokens per block.
        num_blocks: device blocks (every layer group has this many).
        bytes_per_block: bytes of one block across all layer groups whose rows are block ids.
        group_bytes: layer group name -> bytes of its device tensors (``num_blocks x`` its bytes per block, or its
            window slots').
        tail_open_bytes: fixed side pool bytes of the 16-bit open-block slots (one per running request; 0 when
            the slots are carved from the block pool, see :attr:`side_blocks_per_slot`).
        tail_window_bytes: fixed side pool bytes of the 16-bit window copies (``kv_quant_residual_tokens``; 0
            when carved from the block pool).
        sink_bytes: bytes allocated beside the pool for the 8-bit first-block copies (fixed pools: two per
            running request; carved from the pool: their scales only).
        budget_bytes: the budget the figures are for (with ``num_blocks`` given: what is allocated).
        reference_bytes_per_block: bytes of one block of the model-dtype cache (same block size).
        reference_tokens: tokens a model-dtype cache (no side pools) holds in ``budget_bytes``; with a bounded
            sliding-window group, what :func:`cache_capacity` gives a model-dtype cache of the same layout (window
            slots too) in the same budget, so the ratio is the format's alone, side pools included (every layer
            windowed: ``tokens x`` the ratio of the two caches' window slots).
        seq_len: tokens per request for :attr:`max_concurrency` (``max_model_len`` by default).
        max_num_seqs: the scheduler's cap on running requests (sizes fixed side pools).
        side_blocks_per_slot: pool blocks one 16-bit tail slot (or first-block copy) takes while a request
            holds it, when side space is carved from the pool; 0 for fixed side pools or none.
        window_slots: window slots of a bounded sliding-window group (its layers' tensors have this many rows
            instead of ``num_blocks``); 0 without one.
        window_bytes: bytes of those slots (``window_slots x`` the group's bytes per block).
        sliding_window: that group's window in tokens (0 without one).
        window_group: that group's name (``sliding``; ``main`` when every layer is windowed, whose blocks then
            hold no tensor: ``bytes_per_block`` is 0 and the block ids are bookkeeping only); ``""`` without one.
    """

    kv_format: str
    model_dtype: str
    block_size: int
    num_blocks: int
    bytes_per_block: int
    group_bytes: dict[str, int]
    tail_open_bytes: int
    tail_window_bytes: int
    sink_bytes: int
    budget_bytes: int
    reference_bytes_per_block: int
    reference_tokens: int
    seq_len: int
    max_num_seqs: int
    side_blocks_per_slot: int = 0
    window_slots: int = 0
    window_bytes: int = 0
    sliding_window: int = 0
    window_group: str = ""

    @property
    def pool_bytes(self) -> int:
        """Bytes of the device blocks (every group but a bounded sliding-window one, see :attr:`window_bytes`)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def side_pool_bytes(self) -> int:
        """Bytes of every side pool (tail slots, window and first-block copies); 0 for token-wise formats."""
        return self.tail_open_bytes + self.tail_window_bytes + self.sink_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes allocated for the KV cache: blocks + side pools + window slots (never more than :attr:`budget_bytes`)."""
        return self.pool_bytes + self.side_pool_bytes + self.window_bytes

    @property
    def tokens(self) -> int:
        """Tokens the cache holds (every block full; the open block's tokens also take their pool block)."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> float:
        """Pool bytes per cached token (all layers but bounded sliding-window ones, scales included; side pools
        and window slots excluded)."""
        return self.bytes_per_block / self.block_size

    @property
    def effective_bytes_per_token(self) -> float:
        """Allocated bytes per token that fits (side pools included): :attr:`total_bytes` / :attr:`tokens`."""
        return self.total_bytes / self.tokens if self.tokens else math.inf

    @property
    def reference_bytes_per_token(self) -> float:
        """Bytes per token of the model-dtype cache."""
        return self.reference_bytes_per_block / self.block_size

    @property
    def ratio(self) -> float:
        """Tokens that fit / tokens a model-dtype cache holds in the same budget ("x more tokens per byte")."""
        return self.tokens / self.reference_tokens if self.reference_tokens else math.inf

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of :attr:`seq_len` tokens takes."""
        return -(-self.seq_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """Requests of :attr:`seq_len` tokens the blocks hold at once (vLLM's "Maximum concurrency").

        The KV bound only: the scheduler also caps running requests at :attr:`max_num_seqs`. With window slots
        they bound it too (each request pins ``ceil((W - 1) / bs) + 1``), alone when every layer is windowed
        (no pool bytes).
        """
        by_slots = math.inf
        if self.window_slots:
            by_slots = self.window_slots / (-(-(self.sliding_window - 1) // self.block_size) + 1)
            if not self.bytes_per_block:
                return by_slots
        return min(self.num_blocks / self.blocks_per_request, by_slots)

    def summary(self) -> str:
        """One line: format, blocks, tokens, bytes and side pools (the start-up line's cache part)."""
        carved = (f", 16-bit tail slots taken from the pool on demand ({self.side_blocks_per_slot} blocks each)"
                  if self.side_blocks_per_slot else "")
        window = (f" (+{self.window_bytes / MiB:.1f} MiB: {self.window_slots:,} window slots of the "
                  f"{self.sliding_window}-token sliding-window layers)" if self.window_slots else "")
        if not self.bytes_per_block and self.window_slots:  # every layer windowed: the ids hold no tensor
            return (f"{self.kv_format} KV cache: {self.window_slots:,} window slots x {self.block_size} tokens of the "
                    f"{self.sliding_window}-token sliding-window layers in {self.window_bytes / MiB:.1f} MiB "
                    f"({self.num_blocks:,} block ids, no tensor); max concurrency {self.max_concurrency:.2f}x "
                    f"(each request's window)")
        return (f"{self.kv_format} KV cache: {self.num_blocks:,} blocks x {self.block_size} tokens = "
                f"{self.tokens:,} tokens in {self.pool_bytes / MiB:.1f} MiB{window} "
                f"(+{self.side_pool_bytes / MiB:.1f} MiB side pools{carved}); max concurrency "
                f"{self.max_concurrency:.2f}x at {self.seq_len:,} tokens per request")


def reference_spec(spec: CacheSpec, sizing: CacheSizing) -> CacheSpec:
    """The same layout (groups, windows, draft layers, block size) in the model's dtype: the cache every "x more
    tokens" figure compares with."""
    fmt = get_format("auto", sizing.model_dtype)
    groups = tuple(replace(g, layer=LayerSpec(g.layer.kv_heads, g.layer.head_dim, spec.block_size, fmt,
                                              g.layer.has_value)) for g in spec.groups)
    return CacheSpec(groups, spec.block_size, spec.model_name)


def _memory(spec: CacheSpec, sizing: CacheSizing, n: int, carve: bool | None) -> list[GroupMemory]:
    """Every group's memory over ``n`` blocks (``carve``: force the tails' choice; ``None``: the kinds decide)."""
    return [g.kind.memory(g, n, sizing, carve=carve) for g in spec.groups]


def _carve_ratio(spec: CacheSpec, sizing: CacheSizing, n: int | None) -> int:
    """The largest ``r`` of the groups that carve their tail from a pool of ``n`` blocks (``None``: one as large as
    needed), 0 when no group may carve, -1 when one that may cannot (then every tail is a fixed pool, as the
    builder's managers decide the same way, :meth:`~kvpage.spec.Sealed.tail`)."""
    rs = [g.kind.carve_ratio(g, sizing, n) for g in spec.groups if g.kind.may_carve]
    if any(r is None for r in rs):
        return -1
    return max((r for r in rs if r is not None), default=0)


def _bisect(hi: int, fits: Callable[[int], bool]) -> int:
    """The largest ``n`` in ``[0, hi]`` with ``fits(n)`` (``fits`` holds up to some ``n``, then never again)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _too_small(spec: CacheSpec, sizing: CacheSizing, budget: int, knob: str, side: GroupMemory, need: int) -> str:
    """The message of a budget that holds no block after the side pools."""
    fmt = spec.format_label
    given = f"{budget:,} byte{'' if budget == 1 else 's'} given ({knob})"
    if side.side_bytes:
        return (f"KV budget too small: the side pools of {fmt} need {side.side_bytes:,} bytes (open-block tail slots "
                f"{side.tail_open_bytes:,}, window copies {side.tail_window_bytes:,}, first-block copies "
                f"{side.sink_bytes:,}, for max_num_seqs={sizing.max_num_seqs}) plus {need - side.side_bytes:,} bytes "
                f"for one block, {need:,} bytes in all; {given}; raise it or lower max_num_seqs")
    return f"KV budget too small: one block of {fmt} needs {need:,} bytes; {given}; raise it"


def _sum(mems: list[GroupMemory]) -> GroupMemory:
    """The side pools of ``mems`` added up (rows and row bytes left 0)."""
    return GroupMemory(0, 0, sum(m.tail_open_bytes for m in mems), sum(m.tail_window_bytes for m in mems),
                       sum(m.sink_bytes for m in mems))


def cache_capacity(
    spec: CacheSpec,
    sizing: CacheSizing,
    budget_bytes: int | None = None,
    *,
    num_blocks: int | None = None,
    seq_len: int | None = None,
    budget_knob: str = "kv_cache_memory_bytes",
) -> CapacityReport:
    """Blocks, bytes and tokens a cache of ``spec`` allocates within ``budget_bytes`` (or with ``num_blocks``).

    Args:
        spec: the layout.
        sizing: the settings side pools and window slots depend on (``max_model_len`` set: the longest request).
        budget_bytes: KV budget in bytes, side pools included; ignored when ``num_blocks`` is given (then the budget
            is what gets allocated).
        num_blocks: an exact block count (vLLM's ``num_gpu_blocks_override``).
        seq_len: tokens per request for :attr:`CapacityReport.max_concurrency`; default ``sizing.max_model_len``.
        budget_knob: the setting the budget came from, for the error message.

    Returns:
        the :class:`CapacityReport`; no memory is allocated.

    Raises:
        ValueError: neither a budget nor a block count.
        BudgetTooSmallError (a ``ValueError``): the budget is below the side pools, or holds no block after them
            (the message gives the bytes needed and the bytes given).
    """
    if budget_bytes is None and num_blocks is None:
        raise ValueError("cache_capacity needs budget_bytes or num_blocks")
    bounded = next((g for g in spec.groups if g.kind.window_rows), None)
    bpb = sum(g.bytes_per_block for g in spec.groups if not g.kind.window_rows)
    budget = 0 if budget_bytes is None else int(budget_bytes)
    if bounded is not None and bpb == 0:  # every layer windowed: blocks are ids only, the slots take the memory
        return _window_only(spec, sizing, bounded, budget, num_blocks, seq_len, budget_knob)

    def total(n: int, carve: bool) -> int:
        return sum(m.total_bytes for m in _memory(spec, sizing, n, carve))

    r = _carve_ratio(spec, sizing, None)
    n = num_blocks
    if n is None and r > 0:
        n = _bisect(budget // bpb, lambda k: total(k, True) <= budget)
    carve = r > 0 and n is not None and _carve_ratio(spec, sizing, n) > 0
    if n is None or (not carve and num_blocks is None):
        need = total(1, False)
        if budget < need:
            raise BudgetTooSmallError(_too_small(spec, sizing, budget, budget_knob, _sum(_memory(spec, sizing, 1, False)),
                                                 need))
        n = _bisect(budget // bpb, lambda k: total(k, False) <= budget)
    mems = _memory(spec, sizing, n, carve)
    if num_blocks is not None:
        budget = sum(m.total_bytes for m in mems)
    side = _sum(mems)
    window = None if bounded is None else mems[spec.groups.index(bounded)]
    ref = None if bounded is None else _reference_sizes(spec, sizing, budget)
    ref_bpb = reference_spec(spec, sizing).bytes_per_block
    return CapacityReport(
        kv_format=spec.format_label, model_dtype=str(sizing.model_dtype).removeprefix("torch."),
        block_size=spec.block_size, num_blocks=int(n), bytes_per_block=bpb,
        group_bytes={g.name: m.tensor_bytes for g, m in zip(spec.groups, mems)},
        tail_open_bytes=side.tail_open_bytes, tail_window_bytes=side.tail_window_bytes, sink_bytes=side.sink_bytes,
        budget_bytes=int(budget), reference_bytes_per_block=ref_bpb,
        reference_tokens=((int(budget) // ref_bpb) * spec.block_size
                          if bounded is None else int(n) * spec.block_size if ref is None else ref[0]),
        seq_len=int(seq_len if seq_len is not None else sizing.max_model_len or 0), max_num_seqs=sizing.max_num_seqs,
        side_blocks_per_slot=r if carve else 0,
        window_slots=0 if window is None else window.rows, window_bytes=0 if window is None else window.tensor_bytes,
        sliding_window=0 if bounded is None or bounded.sliding_window is None else bounded.sliding_window,
        window_group="" if bounded is None else bounded.name,
    )


def _reference_sizes(spec: CacheSpec, sizing: CacheSizing, budget: int) -> tuple[int, int] | None:
    """``(tokens, window slots)`` a model-dtype cache of the same layout (window slots and all) holds in ``budget``
    bytes, from :func:`cache_capacity` itself (``(0, 0)``: not one block); ``None`` when ``spec`` is that cache."""
    ref = reference_spec(spec, sizing)
    if ref.format_label == spec.format_label:
        return None
    try:
        got = cache_capacity(ref, replace(sizing, residual_tokens=0), budget)
    except BudgetTooSmallError:
        return 0, 0
    return got.tokens, got.window_slots


def _window_only(spec: CacheSpec, sizing: CacheSizing, group: LayerGroupSpec, budget: int, num_blocks: int | None,
                 seq_len: int | None, knob: str) -> CapacityReport:
    """Capacity of a model whose every layer is windowed (Mistral): the budget buys window slots only.

    Block ids cost no tensor memory here, so there are enough for ``max_num_seqs`` requests of ``max_model_len``
    tokens plus one step's chunks, and at least one per slot (``num_blocks`` when given); the slots are what the
    budget holds after a block-wise format's fixed tail pool (with ``num_blocks`` given: the kind's window slots
    of them). Slots no running window pins keep cached prefixes, as blocks do in a pool.

    Raises:
        BudgetTooSmallError: the budget holds fewer slots than one request's window plus one block.
    """
    bs, gbpb = spec.block_size, group.bytes_per_block
    assert group.sliding_window is not None
    per_request = window_pins(group)
    side = group.kind.memory(group, 1, sizing, carve=False)
    max_len = sizing.max_model_len or bs
    if num_blocks is not None:
        n = num_blocks
        slots = group.kind.window_slots(group, n, sizing)
        budget = slots * gbpb + side.side_bytes
    else:
        slots = max(0, budget - side.side_bytes) // gbpb  # the whole budget: slots beyond the windows keep prefixes
        n = max(slots, sizing.max_num_seqs * -(-max_len // bs) + -(-sizing.max_num_batched_tokens // bs))
        if slots < per_request + 1:
            extra = side.side_bytes
            raise BudgetTooSmallError(
                f"KV budget too small: one request's {group.sliding_window}-token window and one more block need "
                f"{(per_request + 1) * gbpb:,} bytes of window slots ({gbpb:,} bytes each)"
                + (f" beside {extra:,} bytes of side pools (for max_num_seqs={sizing.max_num_seqs})" if extra else "")
                + f"; {budget:,} bytes given ({knob}); raise it" + (" or lower max_num_seqs" if extra else ""))
    ref = _reference_sizes(spec, sizing, int(budget))
    tokens = int(n) * bs
    return CapacityReport(
        kv_format=spec.format_label, model_dtype=str(sizing.model_dtype).removeprefix("torch."),
        block_size=bs, num_blocks=int(n), bytes_per_block=0, group_bytes={group.name: slots * gbpb},
        tail_open_bytes=side.tail_open_bytes, tail_window_bytes=side.tail_window_bytes, sink_bytes=side.sink_bytes,
        budget_bytes=int(budget), reference_bytes_per_block=reference_spec(spec, sizing).bytes_per_block,
        reference_tokens=tokens if ref is None else tokens * ref[1] // slots,  # scaled by the two caches' slots
        seq_len=int(seq_len if seq_len is not None else max_len), max_num_seqs=sizing.max_num_seqs,
        window_slots=int(slots), window_bytes=slots * gbpb, sliding_window=group.sliding_window,
        window_group=group.name,
    )
