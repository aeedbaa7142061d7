"""``TailPool``: the per-layer tensors of the tail (16-bit slots, 8-bit first-block copies), on the worker side.

It turns a pass's :class:`~kvpage.cache.step_plan.SealOps` into the index tensors of a
:class:`~kvpage.ops.seal_plan.SealPlan` on its device and hands the layers their
:class:`~kvpage.ops.sealed_attention.SealContext`. Imports :mod:`kvpage.spec`, :mod:`kvpage.formats`,
:mod:`kvpage.ops` and the plan's data types.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvpage.cache.step_plan import SealOps
from kvpage.formats import KEY, KEY_SCALE, VALUE, VALUE_SCALE, Int8Format
from kvpage.ops.seal_plan import RequestRead, SealPlan
from kvpage.ops.sealed_attention import SealContext
from kvpage.spec import CacheSpec, TailLayout, sink_rows, tail_dtype

#: Format of first-block (sink) copies: int8 per (token, head), unrotated.
SINK_FORMAT = Int8Format()


def seal_plan_tensors(ops: SealOps, device: torch.device | str) -> SealPlan:
    """The index tensors of ``ops`` on ``device`` (int64), as every block-wise layer of a pass reads them."""
    def long(xs: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(xs, dtype=torch.long, device=device)

    reads = tuple(RequestRead(full_ids=long(r.full_ids), fp_blocks=r.fp_blocks, sink_slot=r.sink_slot,
                              open_slot=r.open_slot, open_len=r.open_len, sealed_now=r.sealed_now,
                              window_blocks=r.window_blocks, copy_blocks=r.copy_blocks) for r in ops.reads)
    return SealPlan(tail_dst=long(ops.tail_dst), tail_src=long(ops.tail_src), seal_ids=long(ops.seal_ids),
                    seal_from_new_dst=long(ops.seal_from_new_dst), seal_from_new_src=long(ops.seal_from_new_src),
                    seal_from_tail_dst=long(ops.seal_from_tail_dst), seal_from_tail_src=long(ops.seal_from_tail_src),
                    sink_pos=long(ops.sink_pos), sink_slots=long(ops.sink_slots), reads=reads)


class TailPool:
    """Per-layer tail and sink tensors of one quantize-on-seal layer group (the worker's side of its tail).

    Tensors of layer ``L`` (``S`` = ``num_slots``, ``K`` = ``num_sink_slots``, rows flat
    as ``slot * block_size + offset``):
    ``key``/``value`` ``[S * block_size, kv_heads, head_dim]`` in :func:`~kvpage.spec.tail_dtype`;
    ``sink_key``/``sink_value`` ``[K * n, kv_heads, head_dim]`` uint8 and
    ``sink_key_scale``/``sink_value_scale`` ``[K * n, kv_heads]`` float16 (the ``int8`` format's per-token
    codes; ``n`` = :func:`~kvpage.spec.sink_rows`, sink slot ``s`` its rows ``s*n .. s*n + n - 1``).

    Over side groups (a carved :class:`~kvpage.spec.TailLayout`, :mod:`kvpage.cache.tail.side`) the 16-bit rows
    and the sink codes are zero-copy views of the layer's pool codes (``key``/``value``, its first ``S * r``
    blocks): slot ``g`` is blocks ``[r*g, r*g + r)``, its code bytes ``2 * block_size`` int8 rows that hold
    :func:`~kvpage.spec.sinks_per_group` sink slots; only the sink scales are tensors of their own. The views
    follow a re-allocated pool (``caches`` is read again at each :meth:`context`).

    Args:
        spec: the cache layout; only layers whose format seals get tensors.
        layout: the tail's sizes (:meth:`~kvpage.spec.Sealed.tail`, the same the scheduler side's table has).
        model_dtype: the model's compute dtype (decides the tail dtype).
        device: where the tensors live.
        layers: global indices of the layers to serve (one layer group's); default every block-wise layer.
        caches: global layer index -> the layer's pool tensors; required over side groups, else unused.

    Raises:
        ValueError: the layers include none in a block-wise format; side groups without ``caches``.
    """

    def __init__(
        self, spec: CacheSpec, layout: TailLayout, model_dtype: torch.dtype, device: torch.device | str = "cpu",
        layers: Sequence[int] | None = None, caches: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        if layout.carved and caches is None:
            raise ValueError("a tail over side groups views the pool: pass the layers' caches")
        self._caches = caches
        self._viewed: dict[int, torch.Tensor] = {}  # layer -> the pool tensor its views were made of
        self.spec = spec
        self.layout = layout
        self.device = torch.device(device)
        self.dtype = tail_dtype(model_dtype)
        self.sink_format = SINK_FORMAT
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        bs = spec.block_size
        rows = layout.num_slots * bs
        for i in range(spec.num_layers) if layers is None else layers:
            ls = spec.layer(i)
            if not ls.format.block_wise:
                continue
            n_sink = layout.num_sink_slots * sink_rows(ls.format, ls.block_size)
            t: dict[str, torch.Tensor] = {}
            for kind in (KEY, VALUE) if ls.has_value else (KEY,):
                if not layout.carved:
                    t[kind] = torch.zeros((rows, ls.kv_heads, ls.head_dim), dtype=self.dtype, device=device)
                    t["sink_" + kind] = torch.zeros((n_sink, ls.kv_heads, ls.head_dim), dtype=torch.uint8,
                                                    device=device)
                scale_name = KEY_SCALE if kind == KEY else VALUE_SCALE
                t["sink_" + scale_name] = torch.zeros((n_sink, ls.kv_heads), dtype=torch.float16, device=device)
            self.layers[i] = t
        if not self.layers:
            raise ValueError("the cache spec has no quantize-on-seal layer; it needs no tail pool")
        self._own = {i: dict(t) for i, t in self.layers.items()}  # the tensors this pool allocated
        if layout.carved:
            self._refresh()

    def _refresh(self) -> None:
        """(Re)make the views of the pool tensors over side groups (when the pool was re-allocated)."""
        assert self._caches is not None
        for i, t in self.layers.items():
            cache = self._caches[i]
            if self._viewed.get(i) is cache[KEY]:
                continue
            ls, rows = self.spec.layer(i), self.layout.num_slots * self.spec.block_size
            n_sink = self.layout.num_sink_slots * sink_rows(ls.format, ls.block_size)       # at most 2 * rows
            for kind in (KEY, VALUE) if ls.has_value else (KEY,):
                flat = cache[kind].view(-1)[: rows * ls.kv_heads * ls.head_dim * 2]           # uint8, contiguous
                t[kind] = flat.view(self.dtype).view(rows, ls.kv_heads, ls.head_dim)         # [S*bs, Hkv, D]
                t["sink_" + kind] = flat.view(2 * rows, ls.kv_heads, ls.head_dim)[:n_sink]    # [K*n, Hkv, D]
            self._viewed[i] = cache[KEY]

    def context(self, ops: SealOps) -> SealContext:
        """What :func:`~kvpage.ops.sealed_attention.sealed_attention` needs for one pass: the plan's index tensors on
        this pool's device, the tensors, the sink format.

        No side effects beyond re-making views of a re-allocated pool; the context refers to (does not copy) the
        tensors.
        """
        if self.layout.carved:
            self._refresh()
        return SealContext(plan=seal_plan_tensors(ops, self.device), tails=self.layers, sink_format=self.sink_format)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this pool allocated (views of the block pool are the pool's bytes)."""
        return sum(t.numel() * t.element_size() for layer in self._own.values() for t in layer.values())
