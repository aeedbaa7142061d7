"""``TailPool``: the per-layer tensors of the tail (16-bit slots, 8-bit first-block copies) and their dtype.

Imports :mod:`kvpage.spec`, :mod:`kvpage.formats` and the seal context of :mod:`kvpage.ops.sealed_attention`.
"""
from __future__ import annotations

from collections.abc import Sequence

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

    Args:
        spec: the cache layout; only layers whose format seals get tensors.
        table: the bookkeeping (its block size must be the spec's).
        model_dtype: the model's compute dtype (decides :func:`tail_dtype`).
        device: where the tensors live.
        layers: global indices of the layers to serve (one layer group's); default every block-wise layer.

    Raises:
        ValueError: the layers include none in a block-wise format, or block sizes differ.
    """

    def __init__(
        self, spec: CacheSpec, table: TailTable, model_dtype: torch.dtype, device: torch.device | str = "cpu",
        layers: Sequence[int] | None = None,
    ) -> None:
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
                t[kind] = torch.zeros((rows, ls.kv_heads, ls.head_dim), dtype=self.dtype, device=device)
                t["sink_" + kind] = torch.zeros((sink_rows, ls.kv_heads, ls.head_dim), dtype=torch.uint8, device=device)
                scale_name = KEY_SCALE if kind == KEY else VALUE_SCALE
                t["sink_" + scale_name] = torch.zeros((sink_rows, ls.kv_heads), dtype=torch.float16, device=device)
            self.layers[i] = t
        if not self.layers:
            raise ValueError("the cache spec has no quantize-on-seal layer; it needs no tail pool")

    def context(self, plan: SealPlan) -> SealContext:
        """What :func:`~kvpage.ops.sealed_attention.sealed_attention` needs for one step: ``plan``, the tensors, the sink format.

        No side effects; the context refers to (does not copy) this pool's tensors.
        """
        return SealContext(plan=plan, tails=self.layers, sink_format=self.sink_format)

    @property
    def nbytes(self) -> int:
        """Bytes of all tail and sink tensors."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in layer.values())

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
