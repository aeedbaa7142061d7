"""Per-layer-group cache managers: one :class:`GroupManager` per layer group, chosen from the group's spec.

Full attention over token-wise formats (:class:`FullAttentionManager`) and
quantize-on-seal block-wise formats (:class:`SealedGroupManager`, which owns the
tail pool's bookkeeping), sliding-window layers kept in window slots
(:class:`SlidingWindowManager`). Draft/MTP and latent groups need no policy of their own. Imports :mod:`kvpage.spec`, :mod:`kvpage.formats` and
the tensor-free parts of :mod:`kvpage.cache`; nothing from the engine.
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
           "manager_for", "window_slots_for"]


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
        residual_tokens: full-precision window of block-wise formats, in tokens (``kv_quant_residual_tokens``).
        pool: the device block pool; a block-wise group then takes its tail slots and first-block copies
            out of it on demand (:class:`~kvpage.cache.tail.side.SideGroups`) when its layout allows
            (:func:`~kvpage.cache.tail.side.carved_blocks_per_slot`), instead of fixed pools for ``max_num_seqs``.
        max_model_len: longest request, in tokens (a carving pool must hold one beside its side space).
        num_lookahead_tokens: draft tokens a speculating request verifies per step (``num_speculative_tokens``):
            a block-wise group's blocks they fill keep a 16-bit slot until verified, ``ceil(k / block_size)``
            more slots per request at most (fixed tails get them; a carving pool must hold them too).
        num_window_slots: window slots of a bounded sliding-window group (:func:`window_slots_for`); such a
            group (:func:`is_bounded_window`) gets a :class:`SlidingWindowManager` when this is given (and
            ``pool``, whose index it asks which blocks are cached).

    Raises:
        ValueError: ``max_num_seqs < 1``, ``residual_tokens < 0`` or ``num_lookahead_tokens < 0``.
    """
    if max_num_seqs < 1 or residual_tokens < 0 or num_lookahead_tokens < 0:
        raise ValueError(f"need max_num_seqs >= 1, residual_tokens >= 0 and num_lookahead_tokens >= 0, got "
                         f"{max_num_seqs}, {residual_tokens}, {num_lookahead_tokens}")
    fmt = group.layer.format
    if num_window_slots is not None and is_bounded_window(group):
        index = pool
        return SlidingWindowManager(group, num_window_slots,
                                    None if index is None else (lambda b: index.block_hash(b) is not None))
    if isinstance(fmt, BlockFormat):
        window = -(-residual_tokens // group.layer.block_size)
        provisional = -(-num_lookahead_tokens // group.layer.block_size)
        sink = isinstance(fmt, SealedFormat) and bool(fmt.sink_bits)
        r = (None if pool is None else
             carved_blocks_per_slot(group.layer, pool.num_blocks, max_model_len, window + provisional))
        if pool is not None and r is not None:
            side = SideGroups(pool, r)
            return SealedGroupManager(group, num_slots=side.num_groups, num_sink_slots=2 * side.num_groups * sink,
                                      window_blocks=window, side=side)
        return SealedGroupManager(group, num_slots=max_num_seqs * (1 + window + provisional),
                                  num_sink_slots=2 * max_num_seqs * sink, window_blocks=window)
    return FullAttentionManager(group)
