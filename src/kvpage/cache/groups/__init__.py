"""Per-layer-group cache managers: chosen from each layer group's spec.

Full attention over token-wise formats (:class:`FullAttentionManager`) and quantize-on-seal block-wise
formats (:class:`SealedGroupManager`, which owns the tail pool's bookkeeping), sliding-window layers kept in
window slots (:class:`SlidingWindowManager`; a block-wise sliding-window group gets both, a sealed manager for
its tail and a window manager for its codes: :func:`managers_for`). Draft/MTP and latent groups need no
policy of their own. Imports :mod:`kvpage.spec`, :mod:`kvpage.formats` and the tensor-free parts of
:mod:`kvpage.cache`; nothing from the engine.
"""
from __future__ import annotations

from kvpage.cache.groups.base import FullAttentionManager, GroupManager
from kvpage.cache.groups.sealed import SealedGroupManager
from kvpage.cache.groups.sliding import SlidingWindowManager, is_bounded_window, window_slots_for
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.tail.side import SideGroups, carved_blocks_per_slot
from kvpage.formats import BlockFormat, SealedFormat
from kvpage.spec import LayerGroupSpec

__all__ = ["FullAttentionManager", "GroupManager", "SealedGroupManager", "SlidingWindowManager", "is_bounded_window",
           "manager_for", "managers_for", "may_carve", "window_slots_for"]


def may_carve(group: LayerGroupSpec) -> bool:
    """Whether ``group``'s tail may be carved from the block pool (:class:`~kvpage.cache.tail.side.SideGroups`): a
    block-wise group whose tensors have block-id rows, so not a bounded sliding-window one (its rows are window
    slots; its tail is a fixed pool). Capacity and :func:`manager_for` decide by it alike."""
    return isinstance(group.layer.format, BlockFormat) and not is_bounded_window(group)


def manager_for(
    group: LayerGroupSpec,
    *,
    max_num_seqs: int,
    residual_tokens: int,
    pool: PrefixBlockPool | None = None,
    max_model_len: int | None = None,
    num_lookahead_tokens: int = 0,
    num_window_slots: int | None = None,
) -> GroupManager:
    """The group manager for ``group``, chosen by the kind of its format.

    Args:
        group: the layer group.
        max_num_seqs: requests running at once (sizes a block-wise group's fixed tail: one open slot
            and the window's slots per request, two first-block slots per request).
        residual_tokens: full-precision window of block-wise formats, in tokens (``kv_quant_residual_tokens``;
            at most the group's sliding window: its layers never read further back).
        pool: the device block pool; a block-wise group then takes its tail slots and first-block copies
            out of it on demand (:class:`~kvpage.cache.tail.side.SideGroups`) when its layout allows
            (:func:`~kvpage.cache.tail.side.carved_blocks_per_slot`), instead of fixed pools for ``max_num_seqs``.
        max_model_len: longest request, in tokens (a carving pool must hold one beside its side space).
        num_lookahead_tokens: draft tokens a speculating request verifies per step (``num_speculative_tokens``):
            a block-wise group's blocks they fill keep a 16-bit slot until verified, ``ceil(k / block_size)``
            more slots per request at most (fixed tails get them; a carving pool must hold them too).
        num_window_slots: window slots of a bounded sliding-window group (:func:`window_slots_for`); such a
            group (:func:`is_bounded_window`) in a token-wise format gets a :class:`SlidingWindowManager` when
            this is given (and ``pool``, whose index it asks which blocks are cached).

    Raises:
        ValueError: ``max_num_seqs < 1``, ``residual_tokens < 0`` or ``num_lookahead_tokens < 0``; window slots
            for a block-wise group (it needs two managers: :func:`managers_for`).
    """
    if max_num_seqs < 1 or residual_tokens < 0 or num_lookahead_tokens < 0:
        raise ValueError(f"need max_num_seqs >= 1, residual_tokens >= 0 and num_lookahead_tokens >= 0, got "
                         f"{max_num_seqs}, {residual_tokens}, {num_lookahead_tokens}")
    fmt = group.layer.format
    if num_window_slots is not None and is_bounded_window(group):
        if isinstance(fmt, BlockFormat):
            raise ValueError(f"group {group.name!r} is block-wise and windowed: it has a sealed manager and a window "
                             f"manager (managers_for)")
        return _window_manager(group, num_window_slots, pool)
    if isinstance(fmt, BlockFormat):
        if group.sliding_window is not None:  # copies past the sliding window are never read
            residual_tokens = min(residual_tokens, group.sliding_window)
        window = -(-residual_tokens // group.layer.block_size)
        provisional = -(-num_lookahead_tokens // group.layer.block_size)
        sink = isinstance(fmt, SealedFormat) and bool(fmt.sink_bits)
        r = (None if pool is None or not may_carve(group) else
             carved_blocks_per_slot(group.layer, pool.num_blocks, max_model_len, window + provisional))
        if pool is not None and r is not None:
            side = SideGroups(pool, r)
            return SealedGroupManager(group, num_slots=side.num_groups, num_sink_slots=2 * side.num_groups * sink,
                                      window_blocks=window, side=side)
        return SealedGroupManager(group, num_slots=max_num_seqs * (1 + window + provisional),
                                  num_sink_slots=2 * max_num_seqs * sink, window_blocks=window)
    return FullAttentionManager(group)


def managers_for(
    group: LayerGroupSpec,
    *,
    max_num_seqs: int,
    residual_tokens: int,
    pool: PrefixBlockPool | None = None,
    max_model_len: int | None = None,
    num_lookahead_tokens: int = 0,
    num_window_slots: int | None = None,
) -> tuple[GroupManager, ...]:
    """Every group manager of ``group`` (arguments as :func:`manager_for`), in the order the cache manager asks them.

    One, except for a bounded sliding-window group in a block-wise format given ``num_window_slots``: its sealed
    codes live in window slots (:class:`SlidingWindowManager`) while its 16-bit tail, window copies and first-block
    copies stay keyed by block id in a fixed tail pool (:class:`SealedGroupManager`; never carved from the block
    pool, whose rows this group's tensors do not have). The cache manager combines their answers as it does across
    groups (the most restrictive wins) and promises each its own side slots, so a chunk waits until both have room.

    Raises:
        ValueError: as :func:`manager_for`.
    """
    if num_window_slots is not None and is_bounded_window(group) and isinstance(group.layer.format, BlockFormat):
        sealed = manager_for(group, max_num_seqs=max_num_seqs, residual_tokens=residual_tokens,
                             num_lookahead_tokens=num_lookahead_tokens)
        return sealed, _window_manager(group, num_window_slots, pool)
    return (manager_for(group, max_num_seqs=max_num_seqs, residual_tokens=residual_tokens, pool=pool,
                        max_model_len=max_model_len, num_lookahead_tokens=num_lookahead_tokens,
                        num_window_slots=num_window_slots),)


def _window_manager(group: LayerGroupSpec, num_slots: int, pool: PrefixBlockPool | None) -> SlidingWindowManager:
    """The window manager of ``group``, asking ``pool``'s index which blocks are cached."""
    index = pool
    is_cached = None if index is None else (lambda b: index.block_hash(b) is not None)
    return SlidingWindowManager(group, num_slots, is_cached)
