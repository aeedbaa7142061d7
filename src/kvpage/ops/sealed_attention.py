"""Attention over quantize-on-seal layers (``int4``, ``int3``, ``int2``): sealed blocks plus the full-precision tail.

A format that stores rotated rows (``int4_rotated`` etc., :meth:`~kvpage.formats.BlockFormat.rotation`) enters
first: q, k and v in its stored basis (row by row), everything below in that basis, the output rotated back
(:func:`enter_stored_basis`).

Write (once per layer, following the step's :class:`~kvpage.ops.seal_plan.SealPlan`):

1. blocks that fill this step are gathered whole -- earlier tokens from their tail
   slot, new tokens from this step -- rounded to the tail dtype (so a block's bytes
   do not depend on whether prefill or decode filled it), sealed
   (:meth:`~kvpage.formats.BlockFormat.seal`) and written to the pool; first
   blocks also get their 8-bit sink copy of their first rows (:func:`~kvpage.spec.sink_rows`), and window blocks
   of a format with 8-bit window copies an 8-bit copy of all their rows, by the same write;
2. new tokens of open blocks and window blocks go to their tail slots.

Read (per request, after the write): its full blocks dequantized from the pool,
with window blocks replaced by their copies (16-bit rows, or ``int8`` ones in an 8-bit slot for a format whose
window copies are 8-bit) and the first block's first rows by its 8-bit copy when they exist, then the open block's tokens from its tail slot.
A query reads **its own block** at full precision (the block's rows as sealed,
in the tail dtype, in the step that seals it; the open slot before): KIVI's
group being filled stays in full precision, and it makes one rule for every
schedule -- decode, prefill in whole-block chunks and a prefix hit (which starts
at a block boundary) read the same keys, so chunked evaluation with
``chunk_size == block_size`` is decode's (:func:`sealed_request_attention`). Each query reads the window copies
of its own window (the ``window_blocks`` blocks before its own): a verification pass whose queries cross a block
end reads, at every position, what decoding reads there (:func:`sealed_request`; issue 29). The
attention itself is the reference path of :mod:`kvpage.ops.attention`: float32
on the CPU, each request over exactly its own context. This is the KIVI read
(quantized history + full-precision residual, concatenated) built first as a
dequantize-then-SDPA reference, as the research notes recommend.

Everything beside the pool tensors arrives in a :class:`SealContext` (the plan,
the layers' tail tensors, the sink format); this module imports nothing from
:mod:`kvpage.cache` (the tail pool builds the context:
:meth:`kvpage.cache.tail.TailPool.context`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvpage.errors import KVCacheLayoutError
from kvpage.formats import KEY, KEY_SCALE, VALUE, VALUE_SCALE, BlockFormat, TokenFormat
from kvpage.ops.attention import AttentionMetadata, check_inputs
from kvpage.ops.causal import masked_attention, request_attention
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.ops.seal_plan import RequestRead, SealPlan
from kvpage.spec import LayerSpec, sink_rows


@dataclass(frozen=True, slots=True)
class SealContext:
    """What quantize-on-seal layers need beside their pool tensors for one forward pass.

    Attributes:
        plan: the step's plan (shared by all layers).
        tails: global layer index -> that layer's tail tensors (name -> tensor): ``key``/``value``
            ``[S * block_size, kv_heads, head_dim]`` 16-bit rows (flat as ``slot * block_size + offset``),
            ``sink_key``/``sink_value`` ``[K * n, kv_heads, head_dim]`` codes and
            ``sink_key_scale``/``sink_value_scale`` ``[K * n, kv_heads]`` in ``sink_format``'s layout (``n`` =
            :func:`~kvpage.spec.sink_rows` rows per copy, flat as ``slot * n + offset``). Written in place by
            :func:`sealed_attention`.
        sink_format: the token-wise format of the first-block (sink) copies (``int8``).
    """

    plan: SealPlan
    tails: Mapping[int, Mapping[str, torch.Tensor]]
    sink_format: TokenFormat


def _scale_name(kind: str) -> str:
    return KEY_SCALE if kind == KEY else VALUE_SCALE


class SealCodec:
    """How sealed blocks and first-block copies are coded, stored and read back, and rows moved: PyTorch ops and
    the formats' own code.

    A backend with kernels for the same bytes overrides any method (the CPU backend's C++ seal and unseal,
    byte-identical to :meth:`~kvpage.formats.BlockFormat.seal` and :meth:`~kvpage.formats.BlockFormat.unseal`);
    :func:`write_sealed` and :func:`read_sealed` call them.
    """

    def move_rows(self, dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> None:
        """``dst[dst_idx] = src[src_idx]`` (rows along dim 0; ``[n]`` int64 indices, ``dst_idx`` distinct; one
        dtype), in place."""
        dst.index_copy_(0, dst_idx, src[src_idx])

    def write_blocks(self, cache: Mapping[str, torch.Tensor], fmt: BlockFormat, kind: str, blocks: torch.Tensor,
                     ids: torch.Tensor) -> None:
        """Seal ``blocks`` (``[m, block_size, kv_heads, head_dim]``, any float dtype, in the format's stored basis)
        of ``kind`` into pool blocks ``ids`` (``[m]`` int64) of ``cache`` (in place)."""
        for name, t in fmt.seal_rotated(blocks, kind).items():
            cache[name].index_copy_(0, ids, t)

    def read_blocks(self, cache: Mapping[str, torch.Tensor], fmt: BlockFormat, kind: str, ids: torch.Tensor,
                    dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        """Pool blocks ``ids`` (``[m]`` int64) of ``kind`` dequantized, in the format's stored basis:
        ``[m, block_size, kv_heads, head_dim]`` in ``dtype`` (:meth:`~kvpage.formats.BlockFormat.unseal_rotated`).
        No side effects."""
        return fmt.unseal_rotated({n: cache[n][ids] for n in fmt.names(kind)}, kind, dtype, head_dim)

    def write_sink(self, codes: torch.Tensor, scales: torch.Tensor, sink_format: TokenFormat, kind: str,
                   rows: torch.Tensor, dst: torch.Tensor) -> None:
        """Quantize ``rows`` (``[m, kv_heads, head_dim]``) with ``sink_format`` into rows ``dst`` (``[m]`` int64) of
        the sink ``codes`` (``[K * n, kv_heads, head_dim]``) and ``scales`` (``[K * n, kv_heads]``), in place."""
        q = sink_format.quantize(rows, kind=kind)
        assert q.scale is not None  # the sink format stores a scale per token and head
        codes.index_copy_(0, dst, q.codes)
        scales.index_copy_(0, dst, q.scale)


#: PyTorch ops and the formats' own code (the reference backend's codec).
REFERENCE_CODEC = SealCodec()


def write_sealed(
    cache: Mapping[str, torch.Tensor], tail: Mapping[str, torch.Tensor], fmt: BlockFormat, sink_format: TokenFormat,
    block_size: int, kind: str, x: torch.Tensor, plan: SealPlan, codec: SealCodec = REFERENCE_CODEC,
) -> torch.Tensor | None:
    """Seal the blocks this step fills and store the other new tokens in their tail slots (in place).

    Args:
        cache: the layer's pool tensors (``[num_blocks, *per_block_shape]``).
        tail: the layer's tail tensors (see :class:`SealContext`).
        fmt: the layer's block-wise format.
        sink_format: the format of first-block copies.
        block_size: tokens per block.
        kind: ``"key"`` or ``"value"``.
        x: ``[num_tokens, kv_heads, head_dim]`` this step's keys or values.
        plan: the step's plan.
        codec: moves the rows, codes and stores the sealed blocks and first-block copies (a backend's kernels or
            the formats').

    Returns:
        The seal batch, ``[m, block_size, kv_heads, head_dim]`` in the tail dtype (the rows the
        sealed blocks were quantized from, in ``plan.seal_ids`` order), or ``None`` when nothing seals.
    """
    bs = block_size
    blocks: torch.Tensor | None = None
    rows = tail[kind]                                                          # [S*bs, Hkv, D]
    xt = x.to(rows.dtype)
    m = plan.seal_ids.numel()
    if m:
        data = torch.empty((m * bs, *x.shape[1:]), dtype=rows.dtype, device=x.device)
        codec.move_rows(data, plan.seal_from_new_dst, xt, plan.seal_from_new_src)
        codec.move_rows(data, plan.seal_from_tail_dst, rows, plan.seal_from_tail_src)
        blocks = data.view(m, bs, *x.shape[1:])                                # [m, bs, Hkv, D]
        codec.write_blocks(cache, fmt, kind, blocks, plan.seal_ids)
        if plan.sink_pos.numel():
            n = sink_rows(fmt, bs)
            dst = (plan.sink_slots[:, None] * n + torch.arange(n, device=x.device)).flatten()
            codec.write_sink(tail["sink_" + kind], tail["sink_" + _scale_name(kind)], sink_format, kind,
                             blocks[plan.sink_pos, :n].flatten(0, 1), dst)
    codec.move_rows(rows, plan.tail_dst, xt, plan.tail_src)
    return blocks


@dataclass(frozen=True, slots=True)
class SealBatch:
    """The rows this step sealed (:func:`write_sealed_kv`), for queries that read their own block.

    Attributes:
        keys: ``[m, block_size, kv_heads, head_dim]`` in the tail dtype, or ``None`` when nothing sealed.
        values: likewise (a key-only layer's values are its keys).
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None


def write_sealed_kv(
    cache: Mapping[str, torch.Tensor], tail: Mapping[str, torch.Tensor], fmt: BlockFormat, ctx: SealContext,
    block_size: int, k: torch.Tensor, v: torch.Tensor | None, codec: SealCodec = REFERENCE_CODEC,
) -> SealBatch:
    """:func:`write_sealed` of this step's keys and, unless the layer is key-only (``v is None``), values.

    Returns the step's seal batch of each (:class:`SealBatch`).
    """
    kb = write_sealed(cache, tail, fmt, ctx.sink_format, block_size, KEY, k, ctx.plan, codec)
    vb = kb if v is None else write_sealed(cache, tail, fmt, ctx.sink_format, block_size, VALUE, v, ctx.plan, codec)
    return SealBatch(kb, vb)


def first_read_block(params: LayerAttention, seq_len: int, num_new: int, block_size: int) -> int:
    """The first block a request's ``num_new`` newest queries read: 0 for full attention, else the block of
    position ``seq_len - num_new - sliding_window + 1`` (earlier ones are outside every query's window)."""
    if params.sliding_window is None:
        return 0
    return max(0, seq_len - num_new - params.sliding_window + 1) // block_size


@dataclass(frozen=True, slots=True)
class WindowCopies:
    """One request's window copies (:attr:`RequestRead.fp_blocks`, :attr:`RequestRead.copy_blocks`) as extra keys,
    for a pass whose queries
    lie in several blocks and so read different windows (:func:`read_window_copies`).

    Attributes:
        blocks: ``[c]`` int64 block index of each copy, ascending.
        keys: ``[c * block_size, kv_heads, head_dim]`` their rows, block after block.
        values: likewise (a key-only layer's values are its keys).
    """

    blocks: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def _own_and_window(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read: RequestRead, batch: SealBatch, block_size: int,
    params: LayerAttention, first: int, copies: WindowCopies | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys, values and ``[n, keys]`` mask of :func:`sealed_request_attention`: the stored context, then the
    window copies, then the rows sealed now (no side effects)."""
    bs, n, dev = block_size, q.shape[0], q.device
    off = first * bs
    s = off + keys.shape[0]
    pos = s - n + torch.arange(n, device=dev)                                               # [n]
    qblk = pos // bs
    t = torch.arange(off, s, device=dev)                                                    # [s']
    tblk = t // bs
    stored = t[None, :] <= pos[:, None]                                                     # [n, s']
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    key_pos: list[torch.Tensor] = []
    if copies is not None and copies.blocks.numel():
        w, cb = read.window_blocks, copies.blocks.to(dev)                                      # [c]
        reads_copy = (cb[None, :] >= (qblk - w)[:, None]) & (cb[None, :] < qblk[:, None])     # [n, c]
        by_block = torch.zeros((n, -(-s // bs)), dtype=torch.bool, device=dev)
        by_block[:, cb] = reads_copy
        stored &= ~by_block[:, tblk]  # a block a query reads from its copy is not read as stored
        ks.append(copies.keys.to(keys.dtype))
        vs.append(copies.values.to(values.dtype))
        masks.append(reads_copy.repeat_interleave(bs, dim=1))                               # [n, c*bs]
        key_pos.append((cb[:, None] * bs + torch.arange(bs, device=dev)).flatten())
    if read.sealed_now and batch.keys is not None and batch.values is not None:
        own = torch.tensor([j for j, _, _ in read.sealed_now], dtype=torch.long, device=dev)    # [f]
        pick = torch.tensor([m for _, m, _ in read.sealed_now], dtype=torch.long, device=dev)
        fresh_own = torch.isin(qblk, own)                                                    # [n]
        stored &= ~(fresh_own[:, None] & (tblk[None, :] == qblk[:, None]))
        fpos = (own[:, None] * bs + torch.arange(bs, device=dev)).flatten()                   # [f*bs]
        ks.append(batch.keys[pick].flatten(0, 1).to(keys.dtype))                            # [f*bs, Hkv, D]
        vs.append(batch.values[pick].flatten(0, 1).to(values.dtype))
        masks.append(((fpos // bs)[None, :] == qblk[:, None]) & (fpos[None, :] <= pos[:, None]))
        key_pos.append(fpos)
    if params.sliding_window is not None:
        lo = (pos - params.sliding_window)[:, None]
        stored &= t[None, :] > lo
        masks = [m & (p[None, :] > lo) for m, p in zip(masks, key_pos)]
    return torch.cat([keys, *ks]), torch.cat([values, *vs]), torch.cat([stored, *masks], dim=1)


def sealed_request_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read: RequestRead, batch: SealBatch,
    block_size: int, params: LayerAttention = PLAIN, first: int = 0, copies: WindowCopies | None = None,
) -> torch.Tensor:
    """Attention of one request's new tokens, each reading what decoding reads at its position.

    ``keys``/``values`` (``[s - first * block_size, kv_heads, head_dim]``, from :func:`read_sealed_context`)
    hold every block from block ``first`` on as stored -- with the window copies (``read.fp_blocks``,
    ``read.copy_blocks``) in place
    when ``copies`` is ``None``, which is exact when all queries lie in one block (they share one window);
    without them when ``copies`` gives them apart (:func:`read_window_copies`): then the query at position
    ``p`` reads the copy of each block of its own window (``p // block_size - read.window_blocks <= j <
    p // block_size``) and every other block as stored. A query whose block this step sealed
    (``read.sealed_now``) reads that block's rows from ``batch`` instead, up to its own position; every other
    key causally. Without blocks sealed now or copies apart this is
    :func:`~kvpage.ops.causal.request_attention`. ``q``: ``[n, num_heads, head_dim]`` queries of positions
    ``s - n .. s - 1``; returns ``[n, num_heads, head_dim]`` in ``keys.dtype``. ``params``: the layer's scale,
    window (keys at positions ``> pos - sliding_window`` only; ``first`` at most :func:`first_read_block`) and
    soft-cap. No side effects.
    """
    if copies is None and (not read.sealed_now or batch.keys is None or batch.values is None):
        return request_attention(q, keys, values, params)
    k_all, v_all, mask = _own_and_window(q, keys, values, read, batch, block_size, params, first, copies)
    return masked_attention(q, k_all, v_all, mask, params)


def _window_rows(tail: Mapping[str, torch.Tensor], sink_format: TokenFormat, spec: LayerSpec, kind: str,
                 read: RequestRead, dtype: torch.dtype, first: int, skip_first_block: bool
                 ) -> list[tuple[int, torch.Tensor]]:
    """``(block index, [block_size, kv_heads, head_dim] rows in dtype)`` of the request's window copies from block
    ``first`` on, ascending: 16-bit ones from their tail slot, 8-bit ones dequantized from their slot (which holds
    the whole block). ``skip_first_block``: leave out block 0 (read with its first-block copy). No side effects."""
    bs = spec.block_size
    out: list[tuple[int, torch.Tensor]] = []
    for j, slot in read.fp_blocks:
        if j >= first and not (j == 0 and skip_first_block):
            out.append((j, tail[kind][slot * bs:(slot + 1) * bs].to(dtype)))
    for j, slot in read.copy_blocks:
        if j >= first and not (j == 0 and skip_first_block):
            codes = tail["sink_" + kind][slot * bs:(slot + 1) * bs]
            scales = tail["sink_" + _scale_name(kind)][slot * bs:(slot + 1) * bs]
            out.append((j, sink_format.dequantize(codes, scales, dtype, kind=kind)))
    return sorted(out, key=lambda x: x[0])


def read_window_copies(tail: Mapping[str, torch.Tensor], sink_format: TokenFormat, spec: LayerSpec,
                       read: RequestRead, dtype: torch.dtype, first: int = 0) -> WindowCopies:
    """The request's window copies from block ``first`` on (16-bit and 8-bit ones; block 0's only without a
    first-block copy: with one, :func:`read_sealed` reads that block from its codes and the copy), in ``dtype``.
    No side effects."""
    skip = read.sink_slot is not None
    keys_of = _window_rows(tail, sink_format, spec, KEY, read, dtype, first, skip)
    dev, shape = tail[KEY].device, (0, spec.kv_heads, spec.head_dim)
    keys = torch.cat([r for _, r in keys_of]) if keys_of else torch.empty(shape, dtype=dtype, device=dev)
    if spec.has_value:
        vals_of = _window_rows(tail, sink_format, spec, VALUE, read, dtype, first, skip)
        values = torch.cat([r for _, r in vals_of]) if vals_of else torch.empty(shape, dtype=dtype, device=dev)
    else:
        values = keys
    return WindowCopies(torch.tensor([j for j, _ in keys_of], dtype=torch.long, device=dev), keys, values)


def read_sealed(
    cache: Mapping[str, torch.Tensor], tail: Mapping[str, torch.Tensor], fmt: BlockFormat, sink_format: TokenFormat,
    spec: LayerSpec, kind: str, read: RequestRead, dtype: torch.dtype, first: int = 0, *, copies: bool = True,
    codec: SealCodec = REFERENCE_CODEC,
) -> torch.Tensor:
    """One request's context keys or values from block ``first`` on (a windowed layer's earlier blocks are never
    read: :func:`first_read_block`), ``[seq_len - first * block_size, kv_heads, head_dim]`` in ``dtype`` (no
    side effects). ``copies``: blocks with a window copy (``read.fp_blocks``, ``read.copy_blocks``) read from it;
    ``False``: as stored.
    A first block with an 8-bit copy (``read.sink_slot``) reads its first :func:`~kvpage.spec.sink_rows` rows from
    it and the others as stored (never from a window copy). ``codec`` dequantizes the pool blocks."""
    bs, d = spec.block_size, spec.head_dim
    rows = tail[kind]
    ids = read.full_ids[first:]
    full = codec.read_blocks(cache, fmt, kind, ids, dtype, d)                  # [nf-first, bs, Hkv, D]
    sink = read.sink_slot if first == 0 and ids.numel() else None               # block 0 read with its copy
    if copies:
        for j, copy in _window_rows(tail, sink_format, spec, kind, read, dtype, first, sink is not None):
            full[j - first] = copy
    if sink is not None:
        n = sink_rows(fmt, bs)
        a = sink * n
        codes, scales = tail["sink_" + kind][a:a + n], tail["sink_" + _scale_name(kind)][a:a + n]
        full[0, :n] = sink_format.dequantize(codes, scales, dtype, kind=kind)
    out = full.flatten(0, 1)                                                   # [nf*bs, Hkv, D]
    if read.open_slot is not None:
        a = read.open_slot * bs
        out = torch.cat([out, rows[a:a + read.open_len].to(dtype)])
    return out


def read_sealed_context(
    cache: Mapping[str, torch.Tensor], tail: Mapping[str, torch.Tensor], fmt: BlockFormat, sink_format: TokenFormat,
    spec: LayerSpec, read: RequestRead, dtype: torch.dtype, first: int = 0, *, copies: bool = True,
    codec: SealCodec = REFERENCE_CODEC,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's keys and values from block ``first`` on (:func:`read_sealed` of each, ``copies`` as
    there, pool blocks dequantized by ``codec``), ``[seq_len - first * block_size, kv_heads, head_dim]`` in ``dtype``.

    A key-only layer's values are its keys. No side effects.
    """
    keys = read_sealed(cache, tail, fmt, sink_format, spec, KEY, read, dtype, first, copies=copies, codec=codec)
    if not spec.has_value:
        return keys, keys
    return keys, read_sealed(cache, tail, fmt, sink_format, spec, VALUE, read, dtype, first, copies=copies,
                             codec=codec)


def sealed_request(
    q: torch.Tensor, cache: Mapping[str, torch.Tensor], tail: Mapping[str, torch.Tensor], fmt: BlockFormat,
    ctx: SealContext, spec: LayerSpec, read: RequestRead, batch: SealBatch, seq_len: int,
    params: LayerAttention = PLAIN, codec: SealCodec = REFERENCE_CODEC,
) -> torch.Tensor:
    """Read one request's context and attend (:func:`read_sealed_context`, :func:`sealed_request_attention`).

    ``q``: ``[n, num_heads, head_dim]`` its queries (positions ``seq_len - n .. seq_len - 1``), in the dtype the
    context is read and attended in; returns ``[n, num_heads, head_dim]`` in that dtype. Queries in several
    blocks (a verification pass crossing a block end) read different windows: the copies then come apart
    (:func:`read_window_copies`), so each query reads what decoding reads at its position. ``codec`` dequantizes
    the pool blocks. No side effects.
    """
    bs, n = spec.block_size, q.shape[0]
    first = first_read_block(params, seq_len, n, bs)
    apart = read.window_copies and (seq_len - n) // bs != (seq_len - 1) // bs
    keys, vals = read_sealed_context(cache, tail, fmt, ctx.sink_format, spec, read, q.dtype, first, copies=not apart,
                                     codec=codec)
    copies = read_window_copies(tail, ctx.sink_format, spec, read, q.dtype, first) if apart else None
    return sealed_request_attention(q, keys, vals, read, batch, bs, params, first, copies)


def sealed_attention_checks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cache: Mapping[str, torch.Tensor],
    spec: LayerSpec,
    meta: AttentionMetadata,
    ctx: SealContext,
    *,
    layer_index: int,
) -> tuple[BlockFormat, Mapping[str, torch.Tensor]]:
    """Every check :func:`sealed_attention` makes before writing; returns the layer's format and tail tensors.

    Shared by the attention backends that serve block-wise layers. No side effects.

    Raises:
        KVCacheLayoutError: as listed in :func:`sealed_attention`.
    """
    fmt = spec.format
    if not isinstance(fmt, BlockFormat):
        raise KVCacheLayoutError(
            f"layer {layer_index}: format {spec.kv_format} is token-wise; its layers are written and read by "
            f"kvpage.ops.attention.paged_attention, not sealed_attention"
        )
    spec.validate(cache, layer_index=layer_index)
    check_inputs(spec, layer_index, q, k, v)
    tail = ctx.tails.get(layer_index)
    if tail is None:
        raise KVCacheLayoutError(
            f"layer {layer_index}: format {spec.kv_format} quantizes blocks when they fill and needs this layer's "
            f"full-precision tail tensors, but the SealContext has none for it (layers {sorted(ctx.tails)})"
        )
    if len(ctx.plan.reads) != meta.num_requests:
        raise KVCacheLayoutError(
            f"layer {layer_index}: the seal plan covers {len(ctx.plan.reads)} requests, the batch has {meta.num_requests}"
        )
    return fmt, tail


@dataclass(frozen=True, slots=True)
class StoredBasis:
    """A pass's queries, keys and values in the layer format's stored basis (:meth:`~kvpage.formats.BlockFormat.rotation`).

    Built by :func:`enter_stored_basis`; every backend's ``forward_sealed`` writes, reads and attends with these
    and returns :meth:`leave` of its output.

    Attributes:
        q: ``[T, H, D]``: ``q`` itself, or ``q @ R`` in float32.
        k, v: ``[T, Hkv, D]``: as given, or ``k @ R``, ``v @ R`` in float32.
        rotate: the row rotation that made them (``x -> x @ R``, each row from itself alone), or ``None`` for a
            format that stores the original basis.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    rotate: Callable[[torch.Tensor], torch.Tensor] | None

    def leave(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``out`` ``[T, H, D]`` in the original basis (``out @ R.T``: ``R`` is symmetric and orthonormal, so the
        same rotation) and ``dtype``; ``out`` is not modified."""
        return (out if self.rotate is None else self.rotate(out)).to(dtype)


def enter_stored_basis(
    fmt: BlockFormat, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
    rotate_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StoredBasis:
    """``q``, ``k``, ``v`` in ``fmt``'s stored basis (no side effects; unrotated formats pass them through).

    All four (q, k, v and, in :meth:`StoredBasis.leave`, the output) turn row by row (``fmt.to_stored_basis``,
    butterflies, no matmul): a row's bits never depend on the rows beside it, so decode, chunks and speculative
    verification read and write alike. ``rotate_rows``: a backend's own kernel for it, bit-identical to
    ``fmt.to_stored_basis``; default the format's.
    """
    if fmt.rotation(q.shape[-1], torch.float32, q.device) is None:
        return StoredBasis(q, k, v, None)
    rows = fmt.to_stored_basis if rotate_rows is None else rotate_rows
    return StoredBasis(rows(q), rows(k), None if v is None else rows(v), rows)


def sealed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cache: Mapping[str, torch.Tensor],
    spec: LayerSpec,
    meta: AttentionMetadata,
    ctx: SealContext,
    *,
    layer_index: int,
    params: LayerAttention = PLAIN,
) -> torch.Tensor:
    """Write this step's K/V through the seal plan, then attend (block-wise formats).

    Args and result as :func:`~kvpage.ops.attention.paged_attention` (``q`` ``[T, H, D]``,
    ``k``/``v`` ``[T, Hkv, D]``, result ``[T, H, D]`` in ``q.dtype``), plus ``ctx``: the
    step's plan, tail tensors and sink format; ``params`` the layer's scale, window and soft-cap. A format that
    stores rotated rows is written, read and attended in its stored basis (:func:`enter_stored_basis`).
    ``meta.slot_mapping`` is not read: the
    plan says where every token goes. Writes the pool tensors in ``cache`` and the
    layer's tail tensors in ``ctx`` in place.

    Raises:
        KVCacheLayoutError: the cache tensors or q/k/v disagree with ``spec``, the layer's
            format is token-wise (use :func:`~kvpage.ops.attention.paged_attention`), ``ctx``
            holds no tail tensors for this layer, or its plan covers another number of
            requests than ``meta``; checked before anything is written.
    """
    fmt, tail = sealed_attention_checks(q, k, v, cache, spec, meta, ctx, layer_index=layer_index)
    basis = enter_stored_basis(fmt, q, k, v)
    plan = ctx.plan
    batch = write_sealed_kv(cache, tail, fmt, ctx, spec.block_size, basis.k, basis.v)
    adtype = torch.float32 if q.device.type == "cpu" else basis.q.dtype
    qa = basis.q.to(adtype)
    out = torch.empty_like(qa)
    qsl = meta.query_start_loc
    for i, read in enumerate(plan.reads):
        a, b = qsl[i], qsl[i + 1]
        out[a:b] = sealed_request(qa[a:b], cache, tail, fmt, ctx, spec, read, batch, meta.seq_lens[i], params)
    return basis.leave(out, q.dtype)
