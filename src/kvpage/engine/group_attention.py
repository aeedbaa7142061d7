"""Group attention: how the layers of one layer group write and read their paged cache in a pass, from its plan.

The :class:`~kvpage.engine.model_runner.ModelRunner` holds one :class:`GroupAttention` per layer group, chosen by
the group's kind (:data:`ATTENTION`, the worker's half of the kind map; the scheduler's half is
:data:`kvpage.cache.groups.MANAGERS`). It only executes the pass's :class:`~kvpage.cache.step_plan.GroupPlan`:
token-wise kinds attend through their :class:`~kvpage.ops.backends.AttentionBackend`'s ``forward`` with the plan's
rows (block ids, or window slots a bounded window's plan translated already); quantize-on-seal kinds apply the
plan's seals and attend through ``forward_sealed``. Which kernels run (``reference`` PyTorch or the ``cpu`` C++
kernels) is the backend's business; nothing here consults the cache's bookkeeping.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvpage.cache.controller import LayerCache
from kvpage.cache.step_plan import GroupPlan, PassPlan
from kvpage.cache.tail.pool import TailPool
from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.backends import AttentionBackend, ReferenceBackend
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.ops.sealed_attention import SealContext
from kvpage.spec import CacheSpec, FullAttention, GroupKind, LayerGroupSpec, Sealed, SealedWindow, SlidingWindow
from kvpage.spec.kinds import for_kind


class GroupAttention:
    """Writes and reads the layers of one token-wise group: :meth:`prepare` once per pass, then :meth:`attend` per
    layer.

    Args:
        spec: the whole cache spec (layers are looked up by global index).
        group: the layer group this serves.
        caches: global layer index -> that layer's cache tensors; read at each call, so a re-allocated pool
            (``LLM.reset_kv_cache``) is seen when the same dict is updated.
        ops: the attention backend whose kernels run the group's layers (default ``reference``).
        tail: the group's tail tensors (quantize-on-seal kinds only; ignored here).
    """

    def __init__(self, spec: CacheSpec, group: LayerGroupSpec, caches: Mapping[int, LayerCache],
                 ops: AttentionBackend | None = None, tail: TailPool | None = None) -> None:
        self.spec = spec
        self.group = group
        self.caches = caches
        self.ops: AttentionBackend = ReferenceBackend() if ops is None else ops
        self._meta: AttentionMetadata | None = None

    def prepare(self, plan: PassPlan, group_plan: GroupPlan, meta: AttentionMetadata, device: torch.device) -> None:
        """Take the pass's metadata: ``meta`` (the pass's block ids) unless the group plan gives rows of its own."""
        if group_plan.block_tables is None:
            self._meta = meta
            return
        assert group_plan.slot_mapping is not None
        self._meta = AttentionMetadata.build(block_tables=group_plan.block_tables, seq_lens=plan.seq_lens,
                                             query_lens=plan.query_lens, slot_mapping=group_plan.slot_mapping,
                                             block_size=plan.block_size, device=device)

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               params: LayerAttention = PLAIN) -> torch.Tensor:
        """Write the layer's new K/V and attend with the layer's ``params`` (scale, window, soft-cap);
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

        Raises:
            RuntimeError: called outside a pass.
        """
        if self._meta is None:
            raise RuntimeError("attend() outside a pass (prepare() first)")
        return self.ops.forward(q, k, v, self.caches[layer_index], self.spec.layer(layer_index), self._meta,
                                layer_index=layer_index, params=params)

    def finish(self) -> None:
        """The pass is over: drop its state (the bookkeeping is the scheduler's: it commits or aborts the plan)."""
        self._meta = None


class SealedGroupAttention(GroupAttention):
    """Block-wise (quantize-on-seal) layers: the pass's seal operations, applied by every layer of the group.

    Args:
        spec, group, caches, ops: as :class:`GroupAttention`.
        tail: the group's tail tensors (their views follow a re-allocated pool).

    Raises:
        ValueError: no tail.
    """

    def __init__(self, spec: CacheSpec, group: LayerGroupSpec, caches: Mapping[int, LayerCache],
                 ops: AttentionBackend | None = None, tail: TailPool | None = None) -> None:
        super().__init__(spec, group, caches, ops)
        if tail is None:
            raise ValueError(f"layer group {group.name!r} quantizes on seal and needs its tail tensors")
        self.tail = tail
        self._ctx: SealContext | None = None

    def prepare(self, plan: PassPlan, group_plan: GroupPlan, meta: AttentionMetadata, device: torch.device) -> None:
        """The pass's metadata and its seal operations as index tensors on the tail's device.

        Raises:
            ValueError: the group plan has no seal operations.
        """
        if group_plan.seals is None:
            raise ValueError(f"the plan of pass {plan.plan_id} has no seal operations for group {self.group.name!r}")
        self._meta = meta  # (sealed layers read through the plan's pool rows, not the block tables)
        self._ctx = self.tail.context(group_plan.seals)

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               params: LayerAttention = PLAIN) -> torch.Tensor:
        """Seal, write the tail and attend over sealed blocks plus the tail (see :mod:`kvpage.ops.sealed_attention`)."""
        if self._meta is None or self._ctx is None:
            raise RuntimeError("attend() outside a pass (prepare() first)")
        return self.ops.forward_sealed(q, k, v, self.caches[layer_index], self.spec.layer(layer_index), self._meta,
                                       self._ctx, layer_index=layer_index, params=params)

    def finish(self) -> None:
        """Drop the pass's state."""
        super().finish()
        self._ctx = None


#: A worker-side group attention factory: ``(spec, group, caches, ops, tail) -> GroupAttention``.
AttentionFactory = Callable[[CacheSpec, LayerGroupSpec, Mapping[int, LayerCache], AttentionBackend | None,
                             TailPool | None], GroupAttention]

#: Kind -> its worker-side attention (the scheduler side's map is :data:`kvpage.cache.groups.MANAGERS`).
ATTENTION: dict[type[GroupKind], AttentionFactory] = {
    FullAttention: GroupAttention,
    SlidingWindow: GroupAttention,
    Sealed: SealedGroupAttention,
    SealedWindow: SealedGroupAttention,
}


def group_attention_for(spec: CacheSpec, group: LayerGroupSpec, caches: Mapping[int, LayerCache], *,
                        ops: AttentionBackend | None = None, tail: TailPool | None = None) -> GroupAttention:
    """The group attention of ``group``'s kind over ``ops`` (quantize-on-seal kinds need their ``tail``).

    Raises:
        KeyError: a kind without a worker-side attention.
        ValueError: a quantize-on-seal group without its tail.
    """
    return for_kind(ATTENTION, group, "kvpage.engine.group_attention.ATTENTION")(spec, group, caches, ops, tail)
