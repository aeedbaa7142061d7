"""Attention over quantize-on-seal layers (``int4``, ``int2``): sealed blocks plus the full-precision tail.

Write (once per layer, following the step's :class:`~kvpage.cache.tail.SealPlan`):

1. blocks that fill this step are gathered whole -- earlier tokens from their tail
   slot, new tokens from this step -- rounded to the tail dtype (so a block's bytes
   do not depend on whether prefill or decode filled it), sealed
   (:meth:`~kvpage.formats.kivi.SealedFormat.seal`) and written to the pool; first
   blocks also get their 8-bit sink copy;
2. new tokens of open blocks and window blocks go to their tail slots.

Read (per request, after the write): its full blocks dequantized from the pool,
with window blocks replaced by their 16-bit copies and the first block by its
8-bit copy when they exist, then the open block's tokens from its tail slot. The
attention itself is the reference path of :mod:`kvpage.ops.attention`: float32
on the CPU, each request over exactly its own context. This is the KIVI read
(quantized history + full-precision residual, concatenated) built first as a
dequantize-then-SDPA reference, as the research notes recommend.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvpage.cache.tail import RequestRead, SealPlan, TailPool
from kvpage.formats import KEY, KEY_SCALE, VALUE, VALUE_SCALE
from kvpage.ops.causal import request_attention
from kvpage.spec import LayerSpec


@dataclass(frozen=True, slots=True)
class SealContext:
    """What a quantize-on-seal layer needs beside its pool tensors for one forward pass.

    Attributes:
        plan: the step's plan (shared by all layers).
        pool: the tail pool (its ``layers[layer_index]`` holds this layer's tail and sink tensors).
    """

    plan: SealPlan
    pool: TailPool


def write_sealed(
    cache: Mapping[str, torch.Tensor], tail: Mapping[str, torch.Tensor], pool: TailPool, spec: LayerSpec,
    kind: str, x: torch.Tensor, plan: SealPlan,
) -> None:
    """Seal the blocks this step fills and store the other new tokens in their tail slots.

    Args:
        cache: the layer's pool tensors (``[num_blocks, *per_block_shape]``).
        tail: the layer's tail tensors (see :class:`~kvpage.cache.tail.TailPool`).
        kind: ``"key"`` or ``"value"``.
        x: ``[num_tokens, kv_heads, head_dim]`` this step's keys or values.
    """
    fmt, bs = spec.format, spec.block_size
    rows = tail[kind]                                                          # [S*bs, Hkv, D]
    xt = x.to(rows.dtype)
    m = plan.seal_ids.numel()
    if m:
        data = torch.empty((m * bs, *x.shape[1:]), dtype=rows.dtype, device=x.device)
        data[plan.seal_from_new_dst] = xt[plan.seal_from_new_src]
        data[plan.seal_from_tail_dst] = rows[plan.seal_from_tail_src]
        blocks = data.view(m, bs, *x.shape[1:])                                # [m, bs, Hkv, D]
        for name, t in fmt.seal(blocks, kind).items():                         # type: ignore[attr-defined]
            cache[name].index_copy_(0, plan.seal_ids, t)
        if plan.sink_pos.numel():
            q = pool.sink_format.quantize(blocks[plan.sink_pos].flatten(0, 1))  # [k*bs, Hkv, D]
            dst = (plan.sink_slots[:, None] * bs + torch.arange(bs, device=x.device)).flatten()
            tail["sink_" + kind].index_copy_(0, dst, q.codes)
            tail["sink_" + (KEY_SCALE if kind == KEY else VALUE_SCALE)].index_copy_(0, dst, q.scale)
    rows.index_copy_(0, plan.tail_dst, xt[plan.tail_src])


def read_sealed(
    cache: Mapping[str, torch.Tensor], tail: Mapping[str, torch.Tensor], pool: TailPool, spec: LayerSpec,
    kind: str, read: RequestRead, dtype: torch.dtype,
) -> torch.Tensor:
    """One request's context keys or values, ``[seq_len, kv_heads, head_dim]`` in ``dtype``."""
    fmt, bs, d = spec.format, spec.block_size, spec.head_dim
    names = fmt.names(kind)                                                    # type: ignore[attr-defined]
    rows = tail[kind]
    full = fmt.unseal({n: cache[n][read.full_ids] for n in names}, kind, dtype, d)  # type: ignore[attr-defined]
    for j, slot in read.fp_blocks:
        full[j] = rows[slot * bs:(slot + 1) * bs]
    if read.sink_slot is not None:
        a = read.sink_slot * bs
        scale_name = "sink_" + (KEY_SCALE if kind == KEY else VALUE_SCALE)
        full[0] = pool.sink_format.dequantize(tail["sink_" + kind][a:a + bs], tail[scale_name][a:a + bs], dtype)
    out = full.flatten(0, 1)                                                   # [nf*bs, Hkv, D]
    if read.open_slot is not None:
        a = read.open_slot * bs
        out = torch.cat([out, rows[a:a + read.open_len].to(dtype)])
    return out


def sealed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cache: Mapping[str, torch.Tensor],
    spec: LayerSpec,
    query_start_loc: tuple[int, ...],
    seal: SealContext,
    *,
    layer_index: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V through the seal plan, then attend (shapes as :func:`~kvpage.ops.attention.paged_attention`).

    Inputs are already validated by the caller.
    """
    tail = seal.pool.layers[layer_index]
    plan = seal.plan
    write_sealed(cache, tail, seal.pool, spec, KEY, k, plan)
    if spec.has_value:
        assert v is not None
        write_sealed(cache, tail, seal.pool, spec, VALUE, v, plan)
    adtype = torch.float32 if q.device.type == "cpu" else q.dtype
    qa = q.to(adtype)
    out = torch.empty_like(qa)
    for i, read in enumerate(plan.reads):
        a, b = query_start_loc[i], query_start_loc[i + 1]
        keys = read_sealed(cache, tail, seal.pool, spec, KEY, read, adtype)    # [s, Hkv, D]
        vals = read_sealed(cache, tail, seal.pool, spec, VALUE, read, adtype) if spec.has_value else keys
        out[a:b] = request_attention(qa[a:b], keys, vals, scale)                # [n, H, D]
    return out.to(q.dtype)
