"""Paged attention: write this step's K/V into their slots, then attend over each request's block table.

Reference implementation in PyTorch (SDPA), the behaviour other paths must
match. It follows vLLM's varlen interface: the tokens of all requests in a
batch are concatenated, ``query_start_loc`` marks where each request's tokens
start, ``seq_lens`` gives each request's context length after this step, and
``slot_mapping`` says where each new token's K/V go.

Both prefill (including chunked prefill over tokens already cached, i.e.
prefix hits) and decode read the *stored* keys and values back through the
layer's format, so every path dequantizes identically (case C22) and the
newest token sees exactly what later steps will see.

The cache tensors are checked against the layer's
:class:`~kvpage.spec.LayerSpec` before any data is touched; a mismatch raises
:class:`~kvpage.errors.KVCacheLayoutError` naming the layer (case C02).

This op serves token-wise formats (:class:`~kvpage.formats.TokenFormat`); layers
of block-wise formats go through :func:`kvpage.ops.sealed_attention.sealed_attention`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpage.errors import KVCacheLayoutError, StaticScalesError
from kvpage.formats import KEY, KEY_SCALE, VALUE, VALUE_SCALE, StaticScaleFormat, TokenFormat
from kvpage.ops.causal import request_attention
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.ops.staging import to_device
from kvpage.spec import LayerSpec


@dataclass(frozen=True)
class AttentionMetadata:
    """Where a batch's tokens come from and go to; shared by all layers of one forward pass.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 slot (``block * block_size + offset``) of each new token.
        query_start_loc: ``batch + 1`` offsets; request ``i``'s tokens are
            ``query_start_loc[i]:query_start_loc[i+1]``.
        seq_lens: ``batch`` context lengths in tokens after this step (cached + new).
        block_tables: ``[batch, max_blocks]`` int64 block ids, padded with 0.
        block_size: tokens per block.
    """

    slot_mapping: torch.Tensor
    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_tables: torch.Tensor
    block_size: int

    @classmethod
    def build(
        cls,
        *,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        slot_mapping: Sequence[int],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> AttentionMetadata:
        """Metadata from plain lists.

        Raises:
            ValueError: inconsistent lengths, a query longer than its context,
                or a block table too short for its context.
        """
        if not (len(block_tables) == len(seq_lens) == len(query_lens)):
            raise ValueError("block_tables, seq_lens and query_lens need one entry per request")
        starts = [0]
        for q, s, bt in zip(query_lens, seq_lens, block_tables):
            if not 0 < q <= s:
                raise ValueError(f"query length {q} must be in [1, context length {s}]")
            if len(bt) * block_size < s:
                raise ValueError(f"block table of {len(bt)} blocks cannot hold {s} tokens at block_size {block_size}")
            starts.append(starts[-1] + q)
        if len(slot_mapping) != starts[-1]:
            raise ValueError(f"slot_mapping has {len(slot_mapping)} entries for {starts[-1]} new tokens")
        width = max((math.ceil(s / block_size) for s in seq_lens), default=0)
        table = torch.zeros((len(seq_lens), width), dtype=torch.long)
        for i, (bt, s) in enumerate(zip(block_tables, seq_lens)):
            n = math.ceil(s / block_size)
            table[i, :n] = torch.as_tensor(list(bt[:n]), dtype=torch.long)
        return cls(
            slot_mapping=to_device(list(slot_mapping), torch.long, device),  # no host synchronisation on CUDA
            query_start_loc=tuple(starts),
            seq_lens=tuple(int(s) for s in seq_lens),
            block_tables=to_device(table, torch.long, device),
            block_size=block_size,
        )

    @property
    def num_requests(self) -> int:
        """Requests in the batch."""
        return len(self.seq_lens)

    @property
    def query_lens(self) -> tuple[int, ...]:
        """New tokens per request."""
        return tuple(b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:]))

    @property
    def is_decode_only(self) -> bool:
        """Every request adds exactly one token (the batched decode path applies)."""
        return self.query_start_loc[-1] == self.num_requests


def token_format(spec: LayerSpec, layer_index: int | None = None) -> TokenFormat:
    """The layer's format as a :class:`~kvpage.formats.TokenFormat`.

    Raises:
        KVCacheLayoutError: a block-wise format (read through :mod:`kvpage.ops.sealed_attention`).
    """
    fmt = spec.format
    if not isinstance(fmt, TokenFormat):
        where = "" if layer_index is None else f"layer {layer_index}: "
        raise KVCacheLayoutError(
            f"{where}format {spec.kv_format} is block-wise (quantized when a block fills); its layers are written "
            f"and read by kvpage.ops.sealed_attention.sealed_attention with the step's SealContext, not paged_attention"
        )
    return fmt


def write_kv(
    cache: Mapping[str, torch.Tensor], spec: LayerSpec, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor
) -> None:
    """Quantize ``k``/``v`` ``[num_tokens, kv_heads, head_dim]`` per the layer's format and store them at their slots.

    Codes and scales of a token are written together (in place into ``cache``). ``v`` is ``None``
    for key-only layers. Static-scale formats quantize with the scales bound to ``spec.format``.

    Raises:
        KVCacheLayoutError: the layer's format is block-wise.
        StaticScalesError: a static-scale format with no scales bound.
    """
    fmt = token_format(spec)
    rows = [(KEY, KEY_SCALE, k)] + ([(VALUE, VALUE_SCALE, v)] if spec.has_value else [])
    for name, scale_name, x in rows:
        assert x is not None
        q = fmt.quantize(x, kind=name)
        t = cache[name]
        t.view(-1, *t.shape[2:]).index_copy_(0, slot_mapping, q.codes)
        if q.scale is not None:
            s = cache[scale_name]
            s.view(-1, *s.shape[2:]).index_copy_(0, slot_mapping, q.scale)


def read_kv(
    cache: Mapping[str, torch.Tensor],
    spec: LayerSpec,
    name: str,
    block_ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    rotated: bool = False,
) -> torch.Tensor:
    """Dequantize the blocks ``block_ids`` (any shape ``[...]``) of tensor ``name`` (``key``/``value``); no side effects.

    Args:
        rotated: return values in the format's stored (rotated) basis ``x @ R``
            instead of ``x`` (see :meth:`~kvpage.formats.TokenFormat.rotation`);
            the attention op reads this way and rotates its queries instead.

    Returns:
        ``[..., block_size, kv_heads, head_dim]`` in ``dtype``.

    Raises:
        KVCacheLayoutError: the layer's format is block-wise.
        StaticScalesError: a static-scale format with no scales bound.
    """
    fmt = token_format(spec)
    codes = cache[name][block_ids]
    scale_name = KEY_SCALE if name == KEY else VALUE_SCALE
    # the per-token scales where the format stores them; float and static-scale formats store none
    scale = cache[scale_name][block_ids] if scale_name in cache else None
    decode = fmt.dequantize_rotated if rotated else fmt.dequantize
    return decode(codes, scale, dtype, kind=name)


def read_context(
    cache: Mapping[str, torch.Tensor], spec: LayerSpec, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's stored keys and values, each ``[seq_len, kv_heads, head_dim]`` in ``dtype`` (no side effects).

    Read in the format's stored (rotated) basis, as the attention ops attend (see :func:`read_kv`). Only
    the request's own ``seq_len`` tokens are returned, never padding (case C19). A key-only layer's
    values are its keys.

    Args:
        block_ids: the request's block table row (at least ``ceil(seq_len / block_size)`` entries).
    """
    ids = block_ids[: math.ceil(seq_len / spec.block_size)]
    keys = read_kv(cache, spec, KEY, ids, dtype, rotated=True).flatten(0, 1)[:seq_len]
    if not spec.has_value:
        return keys, keys
    return keys, read_kv(cache, spec, VALUE, ids, dtype, rotated=True).flatten(0, 1)[:seq_len]


def window_context(
    cache: Mapping[str, torch.Tensor], spec: LayerSpec, block_ids: torch.Tensor, seq_len: int, num_new: int,
    params: LayerAttention, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`read_context` of the part of a request's context its ``num_new`` newest queries may read.

    Full attention reads all ``seq_len`` tokens; a sliding window of ``W`` reads from the block holding position
    ``seq_len - num_new - W + 1`` on (earlier blocks may hold no KV any more: their window slots were reused).
    Returns ``(keys, values)``, each ``[r, kv_heads, head_dim]``: the last ``r`` positions of the context, so a
    query still sits ``seq_len - 1 - p`` rows from the end (what :func:`~kvpage.ops.causal.request_attention`
    assumes). No side effects.
    """
    if params.sliding_window is None:
        return read_context(cache, spec, block_ids, seq_len, dtype)
    first = max(0, seq_len - num_new - params.sliding_window + 1) // spec.block_size
    return read_context(cache, spec, block_ids[first:], seq_len - first * spec.block_size, dtype)


def check_inputs(spec: LayerSpec, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    """Check ``q``/``k``/``v`` against the layer's spec before anything is written (shared by both attention ops).

    Raises:
        StaticScalesError: a static-scale format with no scales bound (names the layer).
        KVCacheLayoutError: ``v`` given to a key-only layer (or missing), or a shape that disagrees
            with ``kv_heads``/``head_dim`` or with the number of new tokens (names the layer).
    """
    fmt = spec.format
    if isinstance(fmt, StaticScaleFormat) and not fmt.is_bound:
        raise StaticScalesError(
            f"layer {layer_index}: format {spec.kv_format} needs the layer's calibrated static scales, but the "
            f"LayerSpec's format has none bound (use CacheSpec.layer({layer_index}) of a spec built with "
            f"static_scales=...)"
        )
    want = (spec.kv_heads, spec.head_dim)
    if (v is not None) != spec.has_value:
        raise KVCacheLayoutError(
            f"layer {layer_index}: the cache spec {'has' if spec.has_value else 'has no'} value tensor, "
            f"but v is {'None' if v is None else 'given'}"
        )
    for name, x in (("k", k), ("v", v)):
        if x is None:
            continue
        if x.dim() != 3 or tuple(x.shape[1:]) != want:
            raise KVCacheLayoutError(
                f"layer {layer_index}: new {name} must be [num_tokens, {want[0]}, {want[1]}] per the cache spec, "
                f"got {list(x.shape)}"
            )
    if q.dim() != 3 or q.shape[2] != spec.head_dim or q.shape[1] % spec.kv_heads or q.shape[0] != k.shape[0]:
        raise KVCacheLayoutError(
            f"layer {layer_index}: q must be [{k.shape[0]}, a multiple of {spec.kv_heads} heads, {spec.head_dim}], "
            f"got {list(q.shape)}"
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cache: Mapping[str, torch.Tensor],
    spec: LayerSpec,
    meta: AttentionMetadata,
    *,
    layer_index: int,
    params: LayerAttention = PLAIN,
) -> torch.Tensor:
    """Causal attention of this step's tokens over the paged cache, after writing their K/V (token-wise formats).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` queries (RoPE applied), compute dtype.
        k: ``[num_tokens, kv_heads, head_dim]`` new keys (RoPE applied).
        v: ``[num_tokens, kv_heads, head_dim]`` new values; ``None`` for a
            key-only (MLA-style latent) layer, whose keys then serve as values.
        cache: the layer's tensors, name -> ``[num_blocks, *per_block_shape]``.
        spec: the layer's layout.
        meta: batch layout (see :class:`AttentionMetadata`).
        layer_index: global layer index, for error messages.
        params: the layer's softmax scale (default ``head_dim ** -0.5``), sliding window and soft-cap.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``. Query ``j`` of a
        request whose context is ``s`` tokens with ``n`` new ones attends to
        keys ``0 .. s - n + j`` (only those ``> s - n + j - sliding_window`` in a windowed layer;
        GQA: each kv head serves ``num_heads / kv_heads`` query heads).

    Raises:
        KVCacheLayoutError: the cache tensors or q/k/v disagree with ``spec``, or the layer's
            format is block-wise (use :func:`~kvpage.ops.sealed_attention.sealed_attention`);
            checked before anything is written.
        StaticScalesError: a static-scale format with no scales bound.
    """
    fmt = token_format(spec, layer_index)
    spec.validate(cache, layer_index=layer_index)
    check_inputs(spec, layer_index, q, k, v)
    write_kv(cache, spec, k, v, meta.slot_mapping)
    value_name = VALUE if spec.has_value else KEY
    # Attention math runs in float32 on the CPU (bfloat16 SDPA there is 5-10x slower, and less exact),
    # in the model dtype elsewhere.
    adtype = torch.float32 if q.device.type == "cpu" else q.dtype
    qa = q.to(adtype)                                                          # [T, H, D]
    # Rotated formats store x @ R (R orthonormal): attend with q @ R, rotate the output back by R.T.
    rot = fmt.rotation(spec.head_dim, adtype, q.device)
    if rot is not None:
        qa = qa @ rot                                                          # [T, H, D]
    bs = spec.block_size
    if params.is_plain and meta.is_decode_only and min(meta.seq_lens) == max(meta.seq_lens):
        # Decode batch of equal context lengths: one gather and one SDPA for all, no padding, no mask.
        longest = meta.seq_lens[0]
        tables = meta.block_tables[:, : math.ceil(longest / bs)]                           # [B, nb]
        keys = read_kv(cache, spec, KEY, tables, adtype, rotated=True).flatten(1, 2)[:, :longest]
        vals = read_kv(cache, spec, value_name, tables, adtype, rotated=True).flatten(1, 2)[:, :longest]
        o = F.scaled_dot_product_attention(
            qa.unsqueeze(2),                                                   # [B, H, 1, D]
            keys.transpose(1, 2), vals.transpose(1, 2),                        # [B, Hkv, L, D]
            scale=params.scale, enable_gqa=True,
        ).squeeze(2)                                                           # [B, H, D]
        return (o if rot is None else o @ rot.T).to(q.dtype)
    # Otherwise one request at a time, each over exactly its own context: no padding is ever read, so
    # stale or NaN data in unwritten slots cannot reach the output (case C19), and no copy is wasted.
    out = torch.empty_like(qa)
    for i in range(meta.num_requests):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        keys, vals = window_context(cache, spec, meta.block_tables[i], meta.seq_lens[i], b - a, params, adtype)
        out[a:b] = request_attention(qa[a:b], keys, vals, params)               # [n, H, D]
    return (out if rot is None else out @ rot.T).to(q.dtype)
