"""Group attention: how the layers of one layer group write and read their paged cache during a forward pass.

The :class:`~kvpage.engine.model_runner.ModelRunner` holds one
:class:`GroupAttention` per layer group, chosen by the builder from the group's
format the way group managers are (:func:`group_attention_for`): token-wise
formats attend through their :class:`~kvpage.ops.backends.AttentionBackend`'s
``forward``; block-wise (quantize-on-seal) formats plan the step's seals once
over their group's :class:`~kvpage.cache.tail.TailTable` and attend through
``forward_sealed``. Which kernels run (``reference`` PyTorch or the ``cpu``
C++ kernels) is the backend's business; the runner never asks which kind a
group is.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from kvpage.cache.controller import LayerCache
from kvpage.cache.groups import GroupManager, SealedGroupManager, SlidingWindowManager
from kvpage.cache.tail import TailPool
from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.backends import AttentionBackend, ReferenceBackend
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.ops.sealed_attention import SealContext
from kvpage.spec import CacheSpec, LayerGroupSpec


@dataclass(frozen=True, slots=True)
class StepLayout:
    """One forward pass as every backend sees it.

    Attributes:
        meta: slot mapping, query offsets, context lengths and block tables of the batch.
        block_tables: per request, its block ids.
        owners: per request, its id (who owns the window copies it makes; ``None`` = anonymous).
        prompt_lens: per request, its prompt length in tokens.
        draft_lens: per request, how many of the last positions of its context (``seq_lens[i]``) are unverified
            drafts, ``seq_lens[i] - verified length``; it may exceed the pass's query length in a drafter's later
            passes (positions earlier passes of the step wrote). ``()``: none (see :meth:`TailTable.plan`).
        final: whether this is the step's last forward pass over the group (the verification pass); a drafter's
            earlier passes over it (layer-skip: the main group's first layers) are not, and keep the step's
            promised tail slots and everything a sealed block's later re-plan reads (:meth:`TailTable.finish`).
    """

    meta: AttentionMetadata
    block_tables: tuple[Sequence[int], ...]
    owners: tuple[str | None, ...]
    prompt_lens: tuple[int, ...]
    draft_lens: tuple[int, ...] = ()
    final: bool = True


class GroupAttention:
    """Writes and reads the layers of one group; one :meth:`begin_step` / :meth:`end_step` pair per forward pass.

    Args:
        spec: the whole cache spec (layers are looked up by global index).
        group: the layer group this backend serves.
        caches: global layer index -> that layer's cache tensors; read at each call, so a
            re-allocated pool (``LLM.reset_kv_cache``) is seen when the same dict is updated.
        ops: the attention backend whose kernels run the group's layers (default ``reference``).
    """

    def __init__(self, spec: CacheSpec, group: LayerGroupSpec, caches: Mapping[int, LayerCache],
                 ops: AttentionBackend | None = None) -> None:
        self.spec = spec
        self.group = group
        self.caches = caches
        self.ops: AttentionBackend = ReferenceBackend() if ops is None else ops
        self._meta: AttentionMetadata | None = None

    def begin_step(self, step: StepLayout, device: torch.device) -> None:
        """Prepare the step (no writes to the cache yet)."""
        self._meta = step.meta

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               params: LayerAttention = PLAIN) -> torch.Tensor:
        """Write the layer's new K/V and attend with the layer's ``params`` (scale, window, soft-cap);
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

        Raises:
            RuntimeError: called outside a step.
        """
        if self._meta is None:
            raise RuntimeError("attend() outside begin_step()/end_step()")
        return self.ops.forward(q, k, v, self.caches[layer_index], self.spec.layer(layer_index), self._meta,
                                layer_index=layer_index, params=params)

    def end_step(self) -> None:
        """The step's layers all ran: drop the step's state."""
        self._meta = None

    def abort_step(self) -> None:
        """The forward pass raised (some layers may not have run): drop the step's state so the same step can
        be run again (its writes are idempotent)."""
        self._meta = None


class SealedGroupAttention(GroupAttention):
    """Block-wise (quantize-on-seal) layers: one seal plan per step over the group's tail, shared by its layers.

    Args:
        spec, group, caches: as :class:`GroupAttention`.
        manager: the group's manager (owns the :class:`~kvpage.cache.tail.TailTable`).
        tail: the group's tail tensors.
        is_live: ``block_id -> bool``, whether the device pool still holds the block's content.
        is_in_use: ``block_id -> bool``, whether a request references the block.
        ops: as :class:`GroupAttention`.
    """

    def __init__(
        self,
        spec: CacheSpec,
        group: LayerGroupSpec,
        caches: Mapping[int, LayerCache],
        manager: SealedGroupManager,
        tail: TailPool,
        is_live: Callable[[int], bool],
        is_in_use: Callable[[int], bool],
        ops: AttentionBackend | None = None,
    ) -> None:
        super().__init__(spec, group, caches, ops)
        self.table = manager.table
        self.tail = tail
        self._is_live = is_live
        self._is_in_use = is_in_use
        self._ctx: SealContext | None = None
        self._final = True

    def begin_step(self, step: StepLayout, device: torch.device) -> None:
        """Book the step's seals, tail writes, window and first-block copies once for all the group's layers."""
        super().begin_step(step, device)
        plan = self.table.plan(
            step.block_tables, step.meta.seq_lens, step.meta.query_lens, device=device,
            owners=step.owners, prompt_lens=step.prompt_lens, is_live=self._is_live, is_in_use=self._is_in_use,
            draft_lens=step.draft_lens or None,
        )
        self._final = step.final
        self._ctx = self.tail.context(plan)

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               params: LayerAttention = PLAIN) -> torch.Tensor:
        """Seal, write the tail and attend over sealed blocks plus the tail (see :mod:`kvpage.ops.sealed_attention`)."""
        if self._meta is None or self._ctx is None:
            raise RuntimeError("attend() outside begin_step()/end_step()")
        return self.ops.forward_sealed(q, k, v, self.caches[layer_index], self.spec.layer(layer_index), self._meta,
                                       self._ctx, layer_index=layer_index, params=params)

    def end_step(self) -> None:
        """Free the tail slots the step retired (every layer has read them); after a pass that is not the step's
        final one over the group, retire nothing and keep the promised slots (``finish(release_spare=False)``)."""
        super().end_step()
        if self._ctx is not None:
            self._ctx = None
            self.table.finish(release_spare=self._final)

    def abort_step(self) -> None:
        """The forward pass raised: keep the open slots of the blocks the plan sealed (:meth:`TailTable.abort`)."""
        super().abort_step()
        if self._ctx is not None:
            self._ctx = None
            self.table.abort()


class WindowGroupAttention(GroupAttention):
    """A bounded sliding-window group: its layers' tensors are indexed by window slot, not by block id.

    Each step the block tables and slot mapping are translated through the manager's slots
    (:meth:`~kvpage.cache.groups.SlidingWindowManager.slot_of`); blocks before a request's window have no slot and
    are never read (the ops read only the window, :func:`~kvpage.ops.attention.window_context`). A step's final
    pass first tells the manager where each request's queries start, so the blocks that slid out of every
    window give their slots back (a drafter's earlier passes start later and must not).

    Args:
        spec, group, caches, ops: as :class:`GroupAttention`.
        manager: the group's :class:`~kvpage.cache.groups.SlidingWindowManager`.
    """

    def __init__(self, spec: CacheSpec, group: LayerGroupSpec, caches: Mapping[int, LayerCache],
                 manager: SlidingWindowManager, ops: AttentionBackend | None = None) -> None:
        super().__init__(spec, group, caches, ops)
        self.manager = manager

    def begin_step(self, step: StepLayout, device: torch.device) -> None:
        """Release slots that slid out (final pass), then build the step's metadata in window-slot ids.

        Raises:
            RuntimeError: a block the step writes has no window slot (it was allocated without one).
        """
        meta, bs = step.meta, step.meta.block_size
        qsl = meta.query_start_loc
        starts = advance_windows(self.manager, step)
        tables, slots = [], []
        for table, start, s in zip(step.block_tables, starts, meta.seq_lens):
            row = window_table(self.manager, table, start, s)
            tables.append(row)
            slots.extend(row[p // bs] * bs + p % bs for p in range(start, s))
        self._meta = AttentionMetadata.build(block_tables=tables, seq_lens=meta.seq_lens,
                                             query_lens=[qsl[i + 1] - qsl[i] for i in range(meta.num_requests)],
                                             slot_mapping=slots, block_size=bs, device=device)


class SealedWindowGroupAttention(SealedGroupAttention):
    """A bounded sliding-window group in a block-wise format: sealed codes in window slots, the tail by block id.

    The seal plan is made over block ids (the 16-bit tail, window copies and first-block copies are keyed by
    them), then its pool ids -- the blocks sealed this step and each request's full blocks -- are translated
    to window slots (:meth:`~kvpage.cache.groups.SlidingWindowManager.slot_of`). A full block before a
    request's window has no slot: it reads row 0 instead, which the window mask never lets a query see. A
    step's final pass first releases the slots that slid out of every window (as :class:`WindowGroupAttention`).

    Args:
        spec, group, caches, manager, tail, is_live, is_in_use, ops: as :class:`SealedGroupAttention`.
        window: the group's :class:`~kvpage.cache.groups.SlidingWindowManager`.
    """

    def __init__(self, spec: CacheSpec, group: LayerGroupSpec, caches: Mapping[int, LayerCache],
                 manager: SealedGroupManager, tail: TailPool, is_live: Callable[[int], bool],
                 is_in_use: Callable[[int], bool], window: SlidingWindowManager,
                 ops: AttentionBackend | None = None) -> None:
        super().__init__(spec, group, caches, manager, tail, is_live, is_in_use, ops)
        self.window = window

    def begin_step(self, step: StepLayout, device: torch.device) -> None:
        """Release slots that slid out (final pass), plan over block ids, then address the pool by window slot.

        Raises:
            RuntimeError: a block the step seals, or a full block inside a window, has no window slot.
        """
        starts = advance_windows(self.window, step)
        super().begin_step(step, device)
        assert self._ctx is not None
        plan = self._ctx.plan
        rows = [dict(zip(table, window_table(self.window, table, start, s)))  # per request: a shared block may
                for table, start, s in zip(step.block_tables, starts, step.meta.seq_lens)]  # be in one's window only
        sealed = plan.seal_ids.tolist()
        seal_slots = self.window.window_rows(sealed)
        missing = [b for b, slot in zip(sealed, seal_slots) if slot is None]
        if missing:
            raise RuntimeError(f"group {self.group.name!r}: blocks {missing} seal this step but hold no window slot")
        seal_ids = torch.tensor(seal_slots, dtype=torch.long, device=plan.seal_ids.device)
        reads = tuple(replace(r, full_ids=torch.tensor([row[b] for b in r.full_ids.tolist()], dtype=torch.long,
                                                       device=r.full_ids.device))
                      for r, row in zip(plan.reads, rows))
        self._ctx = replace(self._ctx, plan=replace(plan, seal_ids=seal_ids, reads=reads))


def advance_windows(manager: SlidingWindowManager, step: StepLayout) -> list[int]:
    """Each request's first query position this pass; on the step's final pass, also tell ``manager`` where
    each owned request's queries start (:meth:`~kvpage.cache.groups.SlidingWindowManager.advance`: the blocks
    that slid out of its window give their slots back; a drafter's earlier passes start later and must not)."""
    qsl = step.meta.query_start_loc
    starts = [s - (qsl[i + 1] - qsl[i]) for i, s in enumerate(step.meta.seq_lens)]
    if step.final:
        for owner, table, start in zip(step.owners, step.block_tables, starts):
            if owner is not None:
                manager.advance(owner, table, start)
    return starts


def window_table(manager: SlidingWindowManager, table: Sequence[int], start: int, seq_len: int) -> list[int]:
    """A request's block table in window slots: the slot of each block from the window of its first query
    (``start``) on, 0 before it (never read) and for blocks past ``seq_len`` without one (no side effects).

    Raises:
        RuntimeError: a block inside the window (before ``seq_len``) has no window slot.
    """
    bs = manager.block_size
    row = [0] * len(table)
    for j in range(manager.first_block(start), len(table)):
        slot = manager.slot_of(table[j])
        if slot is None:
            if j * bs < seq_len:
                raise RuntimeError(f"group {manager.name!r}: block {table[j]} (index {j}) inside the window has "
                                   f"no window slot")
            continue
        row[j] = slot
    return row


def group_attention_for(
    spec: CacheSpec,
    manager: GroupManager,
    caches: Mapping[int, LayerCache],
    *,
    tail: TailPool | None = None,
    is_live: Callable[[int], bool] | None = None,
    is_in_use: Callable[[int], bool] | None = None,
    ops: AttentionBackend | None = None,
    window: SlidingWindowManager | None = None,
) -> GroupAttention:
    """The group attention of ``manager``'s layer group over ``ops`` (sealed groups need their ``tail`` and the
    pool's views; a sealed group whose codes live in window slots also its ``window`` manager,
    :func:`~kvpage.cache.groups.managers_for`).

    Raises:
        ValueError: a sealed group without its tail tensors or pool views, or a manager without a group.
    """
    group = manager.group
    if group is None:
        raise ValueError(f"{manager!r} has no layer group")
    if isinstance(manager, SealedGroupManager):
        if tail is None or is_live is None or is_in_use is None:
            raise ValueError(f"layer group {group.name!r} quantizes on seal and needs its tail pool and pool views")
        if window is not None:
            return SealedWindowGroupAttention(spec, group, caches, manager, tail, is_live, is_in_use, window, ops)
        return SealedGroupAttention(spec, group, caches, manager, tail, is_live, is_in_use, ops)
    if isinstance(manager, SlidingWindowManager):
        return WindowGroupAttention(spec, group, caches, manager, ops)
    return GroupAttention(spec, group, caches, ops)
