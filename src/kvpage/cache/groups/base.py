"""``GroupManager``: what one kind of layer group adds to the shared block bookkeeping, and its part of each pass.

The :class:`~kvpage.cache.kv_cache.KVCache` owns the block pool, the per-request block tables and the prefix
index; each layer group of the :class:`~kvpage.spec.CacheSpec` gets one group manager, chosen by the group's kind
(:func:`kvpage.cache.groups.manager_for`, as vLLM maps each ``KVCacheSpec`` class to its single-type manager). A
manager answers the questions where kinds differ -- which part of a device match it can read, which blocks may be
indexed, which side slots a chunk needs -- and plans its group's part of every forward pass
(:class:`~kvpage.cache.step_plan.GroupPlan`). Static answers (may it swap, copy a partial block, ...) are the
kind's (:mod:`kvpage.spec.kinds`). Tensor-free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.requests import SupportsKVCache
from kvpage.cache.step_plan import GroupPlan, PassRequest
from kvpage.spec import GroupKind, LayerGroupSpec
from kvpage.spec.kinds import FULL_ATTENTION

#: Side slots a chunk needs from a group: one count per pool of side slots the group keeps (a sliding window's
#: window slots; a quantize-on-seal group's tail slots; both for a sealed group in a window), ``()`` for none.
SideNeed = tuple[int, ...]


class GroupManager:
    """Policy of one layer group over the shared block table; the defaults are full attention's.

    The cache calls the hooks at fixed points for every group and combines their answers (the most restrictive
    wins). The questions (``usable_*``, ``can_fork``, ``slots_needed``, ...) have no side effects; the ``on_*`` hooks
    say what happened to the shared tables; :meth:`plan` books the group's part of a forward pass, which
    :meth:`commit` or :meth:`abort` settles after it ran.

    Args:
        group: the layer group's spec; ``None`` for a bare full-attention manager in tests (named ``main``).
        pool: the device block pool (its ref counts and index are the views some kinds read).
    """

    def __init__(self, group: LayerGroupSpec | None = None, pool: PrefixBlockPool | None = None) -> None:
        self.group = group
        self.pool = pool

    @property
    def name(self) -> str:
        """The layer group's name (``main``, ``sliding``, ``draft``)."""
        return self.group.name if self.group is not None else "main"

    @property
    def kind(self) -> GroupKind:
        """The group's kind (its static answers: swap, partial-block copies, loads cut short, ...)."""
        return self.group.kind if self.group is not None else FULL_ATTENTION

    # -- prefix policy (no side effects) ----------------------------------------------------------------------

    def usable_prefix(self, block_ids: Sequence[int]) -> int:
        """How many leading blocks of a device prefix match this group can read as computed."""
        return len(block_ids)

    def allows_external_prefix(self, num_device_blocks: int) -> bool:
        """Whether tiers may serve the blocks after a device match of ``num_device_blocks`` blocks."""
        return True

    def usable_external(self, device_ids: Sequence[int], windows: Sequence[bool], num_external_tokens: int) -> int:
        """How many of ``num_external_tokens`` tokens a tier holds after the device hits ``device_ids`` this group
        can read: ``windows[i]`` says whether the source of the ``i``-th loaded block holds its window layers' rows
        (:attr:`~kvpage.cache.tiers.types.BlockLoad.window`). Default: all of them."""
        return num_external_tokens

    def max_indexable_tokens(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """Tokens of the request whose full blocks may enter the prefix index (at most ``num_computed_tokens``)."""
        return num_computed_tokens

    def can_fork(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        """Whether a child sharing ``block_ids`` (its first ``num_tokens`` tokens) could read all it needs of them."""
        return True

    # -- what happened to the shared tables -------------------------------------------------------------------

    def on_request_blocks(self, request_id: str, block_ids: Sequence[int], num_matched_tokens: int | None) -> None:
        """The request's table became ``block_ids`` (admitted with a hit of ``num_matched_tokens`` tokens, or grown:
        ``None``). Default: nothing."""

    def on_fork(self, parent_id: str, child_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        """``child_id`` now shares ``block_ids`` (its first ``num_tokens`` tokens) with ``parent_id``."""

    def on_block_copied(self, request_id: str, old: int, new: int) -> None:
        """Copy-on-write: the request's block ``old`` is replaced by ``new``, whose content the worker copies from
        ``old`` before the next pass (``old`` stays referenced until :meth:`on_copies_applied`)."""

    def on_copies_applied(self, pairs: Sequence[tuple[int, int]]) -> None:
        """The booked copies went into a step plan (the worker copies them before any pass of that step)."""

    def on_request_freed(self, request_id: str) -> None:
        """The request let go of its table (finished, aborted or preempted), before dead blocks are reported."""

    def on_rollback(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """A request rolled back to ``num_tokens`` tokens and keeps the table ``block_ids`` (blocks dropped past it
        were reported dead first); also called with nothing dropped, as the commit after a verification step."""

    def on_blocks_deduplicated(self, pairs: Sequence[tuple[int, int]], ref_count: Callable[[int], int]) -> None:
        """Each ``(duplicate, original)`` pair: a request's block equals the indexed ``original``, which the index
        keeps (the duplicate dies with the request); ``ref_count`` is the pool's count."""

    def on_blocks_dead(self, block_ids: Sequence[int], *, evicted: bool = False) -> None:
        """The content of ``block_ids`` died: freed uncached, rolled back, evicted from the index (``evicted``), or
        handed out anew (reported again then, harmlessly). Drop what was kept for them."""

    # -- side slots of a step ---------------------------------------------------------------------------------

    def slots_needed(self, request: SupportsKVCache, block_ids: Sequence[int], num_computed: int, num_new: int, *,
                     num_draft: int = 0, copy_on_write: bool = False) -> SideNeed:
        """Side slots a chunk of ``num_new`` tokens after ``num_computed`` takes in its step, its last ``num_draft``
        tokens unverified drafts, ``copy_on_write``: its first write copies a shared block first -- one count per
        pool of side slots the group keeps, handed back to :meth:`reserve` (``()`` without side slots)."""
        return ()

    def fits(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Whether :meth:`reserve` of ``need`` would succeed now (no side effects). Default: yes."""
        return True

    def reserve(self, need: SideNeed, protected: Sequence[int]) -> bool:
        """Promise ``need`` (:meth:`slots_needed`) to the next pass, all or none; whether it was promised
        (``protected``: cached blocks a match is about to use, never evicted for it). Default: nothing to promise."""
        return True

    def unreserve(self, need: SideNeed) -> None:
        """Take back a promise of :meth:`reserve` (its chunk left the step)."""

    def release(self) -> None:
        """Forget every promise (a new scheduling pass begins)."""

    def shrink(self, keep: Sequence[int]) -> int:
        """Give optional side space back to the pool (the pool ran short; not ``keep``'s); returns how much."""
        return 0

    def side_blocks(self) -> int:
        """Device blocks the group holds as side space now (tail slots carved from the pool)."""
        return 0

    def rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """The row each block lives in in the group's tensors (``None``: it holds none). Default: the block ids."""
        return list(block_ids)

    def evicted_rows_of(self, block_ids: Sequence[int]) -> list[int | None]:
        """The row each block held when the device evicted it in this scheduling pass (its content is intact until
        the next pass, though the row may be handed out again). Default: the block ids."""
        return list(block_ids)

    # -- passes ------------------------------------------------------------------------------------------------

    def plan(self, requests: Sequence[PassRequest], final: bool) -> GroupPlan:
        """Book the group's part of a forward pass over ``requests`` (``final``: the step's last pass over the group;
        see :meth:`~kvpage.cache.kv_cache.KVCache.plan_pass`). Default: the pass's block tables, nothing booked."""
        return GroupPlan(self.name)

    def commit(self) -> None:
        """The last planned pass ran."""

    def abort(self) -> None:
        """The last planned pass raised (some layers may not have run): keep what a re-run of the same tokens needs."""

    def reset(self) -> None:
        """The device pool was re-allocated: forget everything kept per block."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FullAttentionManager(GroupManager):
    """Full attention over token-wise formats: every token stays in its block; any match and any block is usable.

    (vLLM's ``FullAttentionManager``.) All behaviour is :class:`GroupManager`'s default.
    """
