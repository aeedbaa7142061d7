"""``TailPool``: the per-layer tensors of the tail (16-bit slots, 8-bit first-block copies) and their dtype.

Imports :mod:`kvpage.spec`, :mod:`kvpage.formats` and the seal context of :mod:`kvpage.ops.sealed_attention`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvpage.cache.tail.table import TailTable
from kvpage.formats import KEY, KEY_SCALE, VALUE, VALUE_SCALE, BlockFormat, Int8Format
from kvpage.ops.seal_plan import SealPlan
from kvpage.ops.sealed_attention import SealContext
from kvpage.spec import CacheSpec

#: Format of first-block (sink) copies: int8 per (token, head), unrotated.
SINK_FORMAT = Int8Format()


def tail_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """16-bit dtype of tail slots: the model dtype when it is 16-bit, else float16 (KIVI keeps fp16)."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16


class TailPool:
    """Per-layer tail and sink tensors of every quantize-on-seal layer, with their :class:`TailTable`.

    Tensors of layer ``L`` (``S`` = ``num_slots``, ``K`` = ``num_sink_slots``, rows flat
    as ``slot * block_size + offset``):
    ``key``/``value`` ``[S * block_size, kv_heads, head_dim]`` in :func:`tail_dtype`;
    ``sink_key``/``sink_value`` ``[K * block_size, kv_heads, head_dim]`` uint8 and
    ``sink_key_scale``/``sink_value_scale`` ``[K * block_size, kv_heads]`` float16 (the
    ``int8`` format's per-token codes).

    Over side groups (``table.side`` set, :mod:`kvpage.cache.tail.side`) the 16-bit rows and the sink codes
    are zero-copy views of the layer's pool codes (``key``/``value``, its first ``S * r`` blocks): slot ``g``
    is blocks ``[r*g, r*g + r)``, sink slot ``2g`` the first half of their code bytes; only the sink scales
    (``K = 2S``) are tensors of their own, the bytes :meth:`bytes_for` counts. The views follow a
    re-allocated pool (``caches`` is read again at each :meth:`context`).

    Args:
        spec: the cache layout; only layers whose format seals get tensors.
        table: the bookkeeping (its block size must be the spec's).
        model_dtype: the model's compute dtype (decides :func:`tail_dtype`).
        device: where the tensors live.
        layers: global indices of the layers to serve (one layer group's); default every block-wise layer.
        caches: global layer index -> the layer's pool tensors; required over side groups, else unused.

    Raises:
        ValueError: the layers include none in a block-wise format, or block sizes differ; side groups
            without ``caches``.
    """

    def __init__(
        self, spec: CacheSpec, table: TailTable, model_dtype: torch.dtype, device: torch.device | str = "cpu",
        layers: Sequence[int] | None = None, caches: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        if table.side is not None and caches is None:
            raise ValueError("a tail over side groups views the pool: pass the layers' caches")
        self._caches = caches
        self._viewed: dict[int, torch.Tensor] = {}  # layer -> the pool tensor its views were made of
        self.spec = spec
        self.table = table
        self.dtype = tail_dtype(model_dtype)
        self.sink_format = SINK_FORMAT
        if table.block_size != spec.block_size:
            raise ValueError(f"tail block_size {table.block_size} != spec block_size {spec.block_size}")
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        rows, sink_rows = table.num_slots * table.block_size, table.num_sink_slots * table.block_size
        for i in range(spec.num_layers) if layers is None else layers:
            ls = spec.layer(i)
            if not isinstance(ls.format, BlockFormat):
                continue
            t: dict[str, torch.Tensor] = {}
            for kind in (KEY, VALUE) if ls.has_value else (KEY,):
                if table.side is None:
                    t[kind] = torch.zeros((rows, ls.kv_heads, ls.head_dim), dtype=self.dtype, device=device)
                    t["sink_" + kind] = torch.zeros((sink_rows, ls.kv_heads, ls.head_dim), dtype=torch.uint8,
                                                    device=device)
                scale_name = KEY_SCALE if kind == KEY else VALUE_SCALE
                t["sink_" + scale_name] = torch.zeros((sink_rows, ls.kv_heads), dtype=torch.float16, device=device)
            self.layers[i] = t
        if not self.layers:
            raise ValueError("the cache spec has no quantize-on-seal layer; it needs no tail pool")
        self._own = {i: dict(t) for i, t in self.layers.items()}  # the tensors this pool allocated
        if table.side is not None:
            self._refresh()

    def _refresh(self) -> None:
        """(Re)make the views of the pool tensors over side groups (when the pool was re-allocated)."""
        assert self._caches is not None
        for i, t in self.layers.items():
            cache = self._caches[i]
            if self._viewed.get(i) is cache[KEY]:
                continue
            ls, rows = self.spec.layer(i), self.table.num_slots * self.table.block_size
            for kind in (KEY, VALUE) if ls.has_value else (KEY,):
                flat = cache[kind].view(-1)[: rows * ls.kv_heads * ls.head_dim * 2]           # uint8, contiguous
                t[kind] = flat.view(self.dtype).view(rows, ls.kv_heads, ls.head_dim)         # [S*bs, Hkv, D]
                t["sink_" + kind] = flat.view(2 * rows, ls.kv_heads, ls.head_dim)             # [2S*bs, Hkv, D]
            self._viewed[i] = cache[KEY]

    def context(self, plan: SealPlan) -> SealContext:
        """What :func:`~kvpage.ops.sealed_attention.sealed_attention` needs for one step: ``plan``, the tensors, the sink format.

        No side effects beyond re-making views of a re-allocated pool; the context refers to (does not
        copy) the tensors.
        """
        if self.table.side is not None:
            self._refresh()
        return SealContext(plan=plan, tails=self.layers, sink_format=self.sink_format)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this pool allocated (views of the block pool are the pool's bytes)."""
        return sum(t.numel() * t.element_size() for layer in self._own.values() for t in layer.values())

    @staticmethod
    def bytes_for(spec: CacheSpec, model_dtype: torch.dtype, num_slots: int, num_sink_slots: int,
                  layers: Sequence[int] | None = None) -> int:
        """Bytes a :class:`TailPool` of these sizes allocates for ``spec``'s ``layers`` (for memory budgets)."""
        total, item = 0, tail_dtype(model_dtype).itemsize
        for i in range(spec.num_layers) if layers is None else layers:
            ls = spec.layer(i)
            if isinstance(ls.format, BlockFormat):
                per_row = ls.kv_heads * (num_slots * ls.head_dim * item + num_sink_slots * (ls.head_dim + 2))
                total += (2 if ls.has_value else 1) * spec.block_size * per_row
        return total

    @staticmethod
    def scale_bytes_for(spec: CacheSpec, num_sink_slots: int, layers: Sequence[int] | None = None) -> int:
        """Bytes of the sink scale tensors alone (all a :class:`TailPool` over side groups allocates)."""
        total = 0
        for i in range(spec.num_layers) if layers is None else layers:
            ls = spec.layer(i)
            if isinstance(ls.format, BlockFormat):
                total += (2 if ls.has_value else 1) * num_sink_slots * spec.block_size * ls.kv_heads * 2
        return total
