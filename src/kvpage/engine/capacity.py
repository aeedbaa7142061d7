"""Honest KV capacity: what the engine allocates at a budget, and the tokens that really fit (case C26).

:func:`kv_capacity` is the one computation of every capacity figure kvpage
reports: :func:`~kvpage.engine.build.build_engine` takes its block count from it,
``kvpage generate`` prints its ratio, ``kvpage formats`` its tokens at a budget,
and the README table comes from ``python -m kvpage.engine.format_table``. It counts
everything the engine allocates for the KV cache:

* the device blocks of every layer group (codes, scales, zero points; scale tensors included);
* the side space of quantize-on-seal formats (``int4``, ``int2``; see
  :mod:`kvpage.cache.tail`): the 16-bit open-block slots, the 16-bit window copies of
  ``kv_quant_residual_tokens`` and the 8-bit first-block copies. They are carved out of
  the block pool while running requests hold them (:mod:`kvpage.cache.tail.side`:
  ``r = 16 / bits`` pool blocks per slot), so they are no reservation: the report counts
  the pool's blocks, and allocated beside it are only the first-block copies' scales
  (:attr:`CapacityReport.sink_bytes`). Where the layout does not allow it (a head
  dimension the packing does not divide, fewer than ``r`` blocks) the old fixed pools
  sized by ``max_num_seqs`` are reserved and counted instead;
* the window slots of a bounded sliding-window group (:mod:`kvpage.cache.groups.sliding`): its layers' tensors
  have :func:`window_slots` rows instead of one per block, so the block pool is sized from what is left.

"x more tokens" compares the tokens that fit with the tokens a cache in the model's
dtype holds in the same bytes.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvpage.cache.groups import SealedGroupManager, is_bounded_window, manager_for, may_carve, window_slots_for
from kvpage.cache.tail import TailPool
from kvpage.cache.tail.side import blocks_per_slot, carved_blocks_per_slot
from kvpage.formats import BlockFormat, SealedFormat, canonical_format_name, get_format
from kvpage.engine.shape import SMOLLM2_SHAPE, ModelShape, Shape, model_shape
from kvpage.spec import CacheSpec, LayerGroupSpec

if TYPE_CHECKING:
    from kvpage.engine.config import EngineConfig
    from kvpage.engine.memory import KVBudget
    from kvpage.engine.threads import ThreadChoice

__all__ = ["BudgetTooSmallError", "CapacityReport", "ModelShape", "SMOLLM2_SHAPE", "Shape", "build_spec",
           "kv_capacity", "model_shape", "startup_line", "window_slots"]

MiB = 2**20


class BudgetTooSmallError(ValueError):
    """The KV budget does not hold the side pools plus one block (the message gives both byte counts)."""


@dataclass(frozen=True)
class CapacityReport:
    """Everything the engine allocates for the KV cache at one budget, and what it holds.

    Attributes:
        kv_format: the main layers' format name (``int4``, ...).
        model_dtype: the compute dtype's name (``float32``, ...), the reference cache's dtype.
        block_size: tokens per block.
        num_blocks: device blocks (every layer group has this many).
        bytes_per_block: bytes of one block across all layer groups.
        group_bytes: layer group name -> bytes of its device tensors (``num_blocks x`` its bytes per block).
        tail_open_bytes: fixed side pool bytes of the 16-bit open-block slots (one per running request; 0 when
            the slots are carved from the block pool, see :attr:`side_blocks_per_slot`).
        tail_window_bytes: fixed side pool bytes of the 16-bit window copies (``kv_quant_residual_tokens``; 0
            when carved from the block pool).
        sink_bytes: bytes allocated beside the pool for the 8-bit first-block copies (fixed pools: two per
            running request; carved from the pool: their scales only).
        budget_bytes: the budget the figures are for (with ``num_blocks`` given: what is allocated).
        reference_bytes_per_block: bytes of one block of the model-dtype cache (same block size).
        reference_tokens: tokens a model-dtype cache (no side pools) holds in ``budget_bytes``; with a bounded
            sliding-window group, what :func:`kv_capacity` gives a model-dtype cache of the same layout (window
            slots too) in the same budget, so the ratio is the format's alone, side pools included (every layer
            windowed: ``tokens x`` the ratio of the two caches' window slots).
        seq_len: tokens per request for :attr:`max_concurrency` (``max_model_len`` by default).
        max_num_seqs: the scheduler's cap on running requests (sizes fixed side pools).
        side_blocks_per_slot: pool blocks one 16-bit tail slot (or first-block copy) takes while a request
            holds it, when side space is carved from the pool; 0 for fixed side pools or none.
        window_slots: window slots of a bounded sliding-window group (its layers' tensors have this many rows
            instead of ``num_blocks``; :func:`~kvpage.cache.groups.window_slots_for`); 0 without one.
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


def _carved(spec: CacheSpec, num_blocks: int | None, max_model_len: int, residual_tokens: int,
            num_lookahead_tokens: int = 0) -> int:
    """The largest ``r`` over the block-wise groups whose tail a pool of ``num_blocks`` (``None``: any size)
    carves (0: no block-wise group), or -1 when one does not (then every group is counted with fixed pools;
    the builder decides the same way, :func:`~kvpage.cache.groups.manager_for` with
    :func:`~kvpage.cache.tail.side.carved_blocks_per_slot`: the window's blocks and those the lookahead may
    keep provisionally). A bounded sliding-window group never carves: its tensors have window-slot rows, and its
    tail is a fixed pool (:func:`_tail_bytes`)."""
    rs = []
    for g in spec.groups:
        if may_carve(g):
            w = -(-residual_tokens // g.layer.block_size) + -(-num_lookahead_tokens // g.layer.block_size)
            n = 1 << 62 if num_blocks is None else num_blocks
            rs.append(carved_blocks_per_slot(g.layer, n, max_model_len, w))
    if any(r is None for r in rs):
        return -1
    return max((r for r in rs if r is not None), default=0)


def _scale_bytes(spec: CacheSpec, num_blocks: int) -> int:
    """Bytes of the first-block copies' scales of every carving group over a pool of ``num_blocks`` blocks."""
    total = 0
    for group in spec.groups:
        fmt, r = group.layer.format, blocks_per_slot(group.layer)
        if r is not None and may_carve(group) and isinstance(fmt, SealedFormat) and fmt.sink_bits:
            total += TailPool.scale_bytes_for(spec, 2 * (num_blocks // r), layers=group.layer_indices)
    return total


def _carved_blocks(budget: int, bpb: int, spec: CacheSpec, extra: Callable[[int], int]) -> int:
    """The most blocks whose pool, first-block scales and ``extra(n)`` (a bounded window group's slots and fixed
    tail) fit ``budget``; each grows with the blocks, so a bisection finds it."""
    lo, hi = 0, budget // bpb
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mid * bpb + _scale_bytes(spec, mid) + extra(mid) <= budget else (lo, mid - 1)
    return lo


def _tail_bytes(spec: CacheSpec, config: EngineConfig, *, bounded_only: bool = False) -> tuple[int, int, int]:
    """(open, window, sink) fixed side pool bytes, from the same group managers and tail formula the builder
    uses when it does not carve them from the pool; ``bounded_only``: of bounded sliding-window groups alone
    (whose tails are fixed even when the other groups carve theirs)."""
    open_b = window_b = sink_b = 0
    for group in spec.groups:
        if bounded_only and not is_bounded_window(group):
            continue
        g = manager_for(group, max_num_seqs=config.max_num_seqs, residual_tokens=config.residual_tokens,
                        num_lookahead_tokens=config.num_lookahead_tokens)
        if not isinstance(g, SealedGroupManager):
            continue
        t, dt, layers = g.table, config.torch_dtype, g.layers
        window_slots = config.max_num_seqs * t.window_blocks
        slots = TailPool.bytes_for(spec, dt, t.num_slots, 0, layers=layers)
        window = TailPool.bytes_for(spec, dt, window_slots, 0, layers=layers)
        open_b += slots - window
        window_b += window
        sink_b += TailPool.bytes_for(spec, dt, 0, t.num_sink_slots, layers=layers)
    return open_b, window_b, sink_b


def build_spec(config: EngineConfig, model: ModelShape, model_name: str = "",
               draft: ModelShape | None = None, layer_windows: Sequence[int | None] | None = None) -> CacheSpec:
    """The cache layout ``config`` gives ``model`` (what :func:`~kvpage.engine.build.build_engine` builds).

    ``layer_windows``: per model layer, its sliding window or ``None`` (the family's ``attention_params``);
    windowed layers beside full-attention ones form the ``sliding`` group (:meth:`CacheSpec.build`); default the
    model's own ``layer_windows`` when it has them (a :class:`Shape`), else all full attention.

    With ``speculative_config`` method ``draft_model``, ``draft`` is the draft model's KV shape: its layers
    become the spec's ``draft`` group, in ``draft_kv_cache_dtype`` (default the main format when it is
    token-wise, else ``int8``: draft layers are token-wise, see :class:`~kvpage.engine.config.EngineConfig`).

    Raises:
        ValueError: a ``draft_model`` config without ``draft``.
    """
    if layer_windows is None:
        layer_windows = getattr(model, "layer_windows", None)
    sc = config.speculative
    num_draft, draft_fmt = 0, None
    if sc is not None and sc.method == "draft_model":
        if draft is None:
            raise ValueError("speculative_config method 'draft_model' needs the draft model's shape (draft=)")
        num_draft = draft.num_layers
        name = sc.draft_kv_cache_dtype
        if name is None:
            draft_fmt = config.kv_format if not isinstance(config.kv_format, BlockFormat) else \
                get_format("int8", config.torch_dtype)
        else:
            draft_fmt = get_format(canonical_format_name(name, config.torch_dtype), config.torch_dtype)
    return CacheSpec.build(
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        has_value=model.kv_has_value, layer_windows=layer_windows,
        model_dtype=config.torch_dtype, block_size=config.block_size_resolved,
        kv_cache_dtype=config.kv_format, model_name=model_name, static_scales=config.static_scales,
        num_draft_layers=num_draft, draft_kv_cache_dtype=draft_fmt,
        draft_num_kv_heads=None if draft is None else draft.num_kv_heads,
        draft_head_dim=None if draft is None else draft.head_dim,
    )


def kv_capacity(
    config: EngineConfig,
    model: ModelShape,
    budget_bytes: int | None = None,
    *,
    seq_len: int | None = None,
    spec: CacheSpec | None = None,
) -> CapacityReport:
    """Blocks, bytes and tokens the engine allocates for ``config`` on ``model`` within ``budget_bytes``.

    Args:
        config: the engine settings (format, block size, ``max_num_seqs``, ``kv_quant_residual_tokens``,
            ``num_blocks``, ``max_model_len``).
        model: the model's KV shape (a :class:`~kvpage.model.config.ModelConfig` or a :class:`Shape`).
        budget_bytes: KV budget in bytes, side pools included; default ``config.kv_budget_bytes``.
            Ignored when ``config.num_blocks`` is set (then the budget is what gets allocated).
        seq_len: tokens per request for :attr:`CapacityReport.max_concurrency`; default
            ``config.max_model_len``, else the model's context.
        spec: the layout, when the caller already built it (must be :func:`build_spec`'s).

    Returns:
        the :class:`CapacityReport`; no memory is allocated.

    Raises:
        BudgetTooSmallError (a ``ValueError``): the budget is below the side pools, or holds no block
            after them (the message gives the bytes needed and the bytes given).
    """
    spec = build_spec(config, model) if spec is None else spec
    bounded = next((g for g in spec.groups if is_bounded_window(g)), None)
    per_block = {g.name: g.bytes_per_block for g in spec.groups if g is not bounded}
    bpb = sum(per_block.values())
    max_len = config.max_model_len or int(model.max_position_embeddings)  # (build_engine's max_model_len)

    def window(n: int) -> int:
        """Bytes of the window slots over a pool of ``n`` blocks (0 without a bounded group)."""
        return 0 if bounded is None or n <= 0 else window_slots(config, bounded, n, max_len) * bounded.bytes_per_block

    r = _carved(spec, None, max_len, config.residual_tokens, config.num_lookahead_tokens)
    budget = config.kv_budget_bytes if budget_bytes is None else int(budget_bytes)
    if bounded is not None and bpb == 0:  # every layer windowed: blocks are ids only, the slots take the memory
        return _window_only(config, model, spec, bounded, budget, max_len, seq_len)
    fixed_tail = _tail_bytes(spec, config, bounded_only=True)  # a bounded window group's, carving or not
    if r > 0 and config.num_blocks is None:
        num_blocks = _carved_blocks(budget, bpb, spec, lambda n: sum(fixed_tail) + window(n))
    else:
        num_blocks = config.num_blocks if config.num_blocks is not None else 0
    if r > 0 and _carved(spec, num_blocks, max_len, config.residual_tokens, config.num_lookahead_tokens) > 0:  # as manager_for decides
        open_b, window_b, sink_b = fixed_tail
        sink_b += _scale_bytes(spec, num_blocks)
    else:
        open_b, window_b, sink_b = _tail_bytes(spec, config)
        r = 0
    side = open_b + window_b + sink_b
    if config.num_blocks is not None:
        budget = num_blocks * bpb + side + window(num_blocks)
    elif r == 0:
        if budget < side + bpb + window(1):
            knob = ("kv_cache_memory_fraction" if config.kv_cache_memory_fraction is not None
                    else "kv_cache_memory_bytes")
            given = f"{budget:,} byte{'' if budget == 1 else 's'} given ({knob})"
            if side:
                raise BudgetTooSmallError(
                    f"KV budget too small: the side pools of {config.kv_format.name} need {side:,} bytes "
                    f"(open-block tail slots {open_b:,}, window copies {window_b:,}, first-block copies {sink_b:,}, "
                    f"for max_num_seqs={config.max_num_seqs}) plus {bpb:,} bytes for one block, "
                    f"{side + bpb:,} bytes in all; {given}; raise it or lower max_num_seqs")
            raise BudgetTooSmallError(f"KV budget too small: one block of {config.kv_format.name} needs "
                                      f"{bpb + window(1):,} bytes; {given}; raise it")
        num_blocks = (budget - side) // bpb
        if bounded is not None:  # the most blocks whose pool and window slots fit together (window() grows with n)
            lo, hi = 1, num_blocks
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if mid * bpb + window(mid) <= budget - side else (lo, mid - 1)
            num_blocks = lo
    ref_bpb = _reference_bytes_per_block(config, model, spec)  # the same layers in the model dtype
    if seq_len is None:
        seq_len = config.max_model_len or int(model.max_position_embeddings)
    ref = None if bounded is None else _reference_sizes(config, model, spec, int(budget))
    return CapacityReport(
        kv_format=config.kv_format.name, model_dtype=str(config.torch_dtype).removeprefix("torch."),
        block_size=spec.block_size, num_blocks=int(num_blocks), bytes_per_block=bpb,
        group_bytes={**{n: int(num_blocks) * b for n, b in per_block.items()},
                     **({} if bounded is None else {bounded.name: window(int(num_blocks))})},
        tail_open_bytes=open_b, tail_window_bytes=window_b, sink_bytes=sink_b, budget_bytes=int(budget),
        reference_bytes_per_block=ref_bpb,
        reference_tokens=((int(budget) // ref_bpb) * spec.block_size if bounded is None
                          else int(num_blocks) * spec.block_size if ref is None else ref[0]),
        seq_len=int(seq_len), max_num_seqs=config.max_num_seqs, side_blocks_per_slot=r,
        window_slots=0 if bounded is None else window_slots(config, bounded, int(num_blocks), max_len),
        window_bytes=window(int(num_blocks)),
        sliding_window=0 if bounded is None or bounded.sliding_window is None else bounded.sliding_window,
        window_group="" if bounded is None else bounded.name,
    )


def _reference_spec(config: EngineConfig, model: ModelShape, spec: CacheSpec, *, windows: bool) -> CacheSpec:
    """The model-dtype cache with the same layers (draft ones too) and block size; ``windows``: the same
    sliding windows too (the same layout), else every layer full."""
    dg, layer_windows = spec.draft, [None] * model.num_layers
    for g in spec.model_groups if windows else ():
        for i in g.layer_indices:
            layer_windows[i] = g.sliding_window
    return CacheSpec.build(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                           has_value=model.kv_has_value, model_dtype=config.torch_dtype, block_size=spec.block_size,
                           layer_windows=layer_windows, num_draft_layers=0 if dg is None else dg.num_layers,
                           draft_num_kv_heads=None if dg is None else dg.layer.kv_heads,
                           draft_head_dim=None if dg is None else dg.layer.head_dim)


def _reference_bytes_per_block(config: EngineConfig, model: ModelShape, spec: CacheSpec) -> int:
    """Bytes of one block of the model-dtype cache with the same layers (draft ones too) and block size."""
    return _reference_spec(config, model, spec, windows=False).bytes_per_block


def _reference_sizes(config: EngineConfig, model: ModelShape, spec: CacheSpec, budget: int) -> tuple[int, int] | None:
    """``(tokens, window slots)`` a model-dtype cache of the same layout (window slots and all) holds in ``budget``
    bytes, from :func:`kv_capacity` itself (``(0, 0)``: not one block); ``None`` when ``config`` is that cache."""
    ref_config = replace(config, kv_cache_dtype="auto", kv_cache_scales=None, kv_quant_residual_tokens=None,
                         block_size=spec.block_size, num_blocks=None, kv_cache_memory_bytes=budget,
                         kv_cache_memory_fraction=None)
    if ref_config.kv_format.name == config.kv_format.name:
        return None
    try:
        ref = kv_capacity(ref_config, model, budget, spec=_reference_spec(config, model, spec, windows=True))
    except BudgetTooSmallError:
        return 0, 0
    return ref.tokens, ref.window_slots


def _window_only(config: EngineConfig, model: ModelShape, spec: CacheSpec, group: LayerGroupSpec,
                 budget: int, max_len: int, seq_len: int | None) -> CapacityReport:
    """Capacity of a model whose every layer is windowed (Mistral): the budget buys window slots only.

    Block ids cost no tensor memory here, so there are enough for ``max_num_seqs`` requests of ``max_model_len``
    tokens plus one step's chunks, and at least one per slot (``num_blocks`` when given); the slots are what the
    budget holds after a block-wise format's fixed tail pool (with ``num_blocks`` given: :func:`window_slots` of
    them). Slots no running window pins keep cached prefixes, as blocks do in a pool.

    Raises:
        BudgetTooSmallError: the budget holds fewer slots than one request's window plus one block.
    """
    bs, gbpb = spec.block_size, group.bytes_per_block
    assert group.sliding_window is not None
    per_request = -(-(group.sliding_window - 1) // bs) + 1
    open_b, window_b, sink_b = _tail_bytes(spec, config, bounded_only=True)
    side = open_b + window_b + sink_b
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
        slots = window_slots(config, group, num_blocks, max_len)
        budget = slots * gbpb + side
    else:
        slots = max(0, budget - side) // gbpb  # the whole budget: slots beyond the running windows keep cached prefixes
        num_blocks = max(slots, config.max_num_seqs * -(-max_len // bs) + -(-config.max_num_batched_tokens // bs))
        if slots < per_request + 1:
            knob = "kv_cache_memory_fraction" if config.kv_cache_memory_fraction is not None else "kv_cache_memory_bytes"
            raise BudgetTooSmallError(
                f"KV budget too small: one request's {group.sliding_window}-token window and one more block need "
                f"{(per_request + 1) * gbpb:,} bytes of window slots ({gbpb:,} bytes each)"
                + (f" beside {side:,} bytes of side pools (for max_num_seqs={config.max_num_seqs})" if side else "")
                + f"; {budget:,} bytes given ({knob}); raise it" + (" or lower max_num_seqs" if side else ""))
    ref_bpb = _reference_bytes_per_block(config, model, spec)
    ref = _reference_sizes(config, model, spec, int(budget))
    tokens = int(num_blocks) * bs
    return CapacityReport(
        kv_format=config.kv_format.name, model_dtype=str(config.torch_dtype).removeprefix("torch."),
        block_size=bs, num_blocks=int(num_blocks), bytes_per_block=0, group_bytes={group.name: slots * gbpb},
        tail_open_bytes=open_b, tail_window_bytes=window_b, sink_bytes=sink_b, budget_bytes=int(budget),
        reference_bytes_per_block=ref_bpb,
        reference_tokens=tokens if ref is None else tokens * ref[1] // slots,  # scaled by the two caches' slots
        seq_len=int(seq_len if seq_len is not None else max_len), max_num_seqs=config.max_num_seqs,
        window_slots=int(slots), window_bytes=slots * gbpb, sliding_window=group.sliding_window,
        window_group=group.name,
    )


def window_slots(config: EngineConfig, group: LayerGroupSpec, num_blocks: int, max_model_len: int) -> int:
    """Window slots the builder allocates for the bounded sliding-window ``group`` over ``num_blocks`` blocks."""
    return window_slots_for(group, num_blocks=num_blocks, max_model_len=max_model_len,
                            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            num_lookahead_tokens=config.num_lookahead_tokens)


def startup_line(threads: ThreadChoice, capacity: CapacityReport, budget: KVBudget) -> str:
    """The engine's one start-up line: torch threads (and the rule), the KV cache, where the budget came from.

    E.g. ``[kvpage] engine: 1 torch thread (rule: 2 CPUs - load 1, at most torch's 2); int8 KV cache:
    2,824 blocks x 16 tokens = 45,184 tokens in 511.9 MiB (+0.0 MiB side pools); ...; budget 512.0 MiB (default)``.
    """
    n = threads.num_threads
    size = f"{capacity.budget_bytes / MiB:,.1f} MiB ({budget.source})"
    return (f"[kvpage] engine: {n} torch thread{'s' if n != 1 else ''} ({threads.reason}); "
            f"{capacity.summary()}; budget {size}")
