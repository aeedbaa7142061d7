"""The ``cpu`` attention backend: kvpage's own C++ kernels (:mod:`kvpage.ops.cpu`) on the hot path.

Decode rows and short query runs (up to :data:`KERNEL_MAX_QUERY` new tokens of a
request, e.g. speculative verification) of the whole batch attend in **one kernel
call per layer**, reading codes and scales straight from the blocks through the
block table with an online softmax; the float context is never materialized.
Longer query runs (prefill chunks) are compute-bound and go, one request at a
time, through the reference gather + SDPA path (torch's flash attention), in
bfloat16 for bfloat16 models (:func:`_sdpa_dtype`), else in float32.

Writes: float formats scatter with ``index_copy_``; the dynamic 8-bit formats
(``int8``, ``fp8``, ``int8_rotated``, ``fp8_per_token_head``) quantize and store in
one fused kernel call per tensor, byte-identical to their Python ``quantize``
(rotated formats rotate first with the same butterflies); static-scale formats
write through the reference code; the quantize-on-seal formats seal whole blocks in one kernel call per
tensor (``seal_blocks``, byte-identical to :meth:`~kvpage.formats.BlockFormat.seal`) and code their
first-block copies with the fused 8-bit write (:class:`KernelSealCodec`).

Formats the kernels read: ``float32``/``bfloat16``/``float16``, every per-token and
static 8-bit format, ``int4``/``int3``/``int2`` (sealed blocks, 16-bit tail and window
copies, int8 first-block copies) and their ``_rotated`` variants (q, k, v rotated on entry -- k and v by the
``hadamard_rows`` kernel -- and the output back: :func:`~kvpage.ops.sealed_attention.enter_stored_basis`).
Anything else is refused by :meth:`CpuBackend.unsupported` with the reason.

Per-step tensors (context lengths, query offsets, which rows the kernel takes,
the sealed formats' per-block source table) are built once per step and shared
by every layer of the group.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvpage.formats import (
    KEY, KEY_SCALE, VALUE, VALUE_SCALE, BlockFormat, FloatFormat, SealedFormat, StaticScaleFormat, TokenFormat,
)
from kvpage.formats.codes import E4M3_QMAX, INT8_QMAX
from kvpage.formats.per_token import PerTokenFormat
from kvpage.ops.attention import AttentionMetadata, check_inputs, token_format, window_context, write_kv
from kvpage.ops.backends.base import AttentionBackend
from kvpage.ops.backends.sealed_sources import sealed_sources
from kvpage.ops.causal import request_attention
from kvpage.ops.cpu.build import kernels_unavailable_reason, load_kernels
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.formats.kivi import value_group_size
from kvpage.ops.seal_plan import RequestRead
from kvpage.ops.sealed_attention import (
    SealContext, SealCodec, enter_stored_basis, read_sealed_context, sealed_attention_checks, sealed_request,
    write_sealed_kv,
)
from kvpage.spec import LayerSpec, sink_rows

#: Requests with at most this many new tokens attend in the fused kernel; longer runs use SDPA.
KERNEL_MAX_QUERY = 32

# element encodings of the kernels (paged_attention.cpp: enum Enc)
_F32, _BF16, _F16, _I8, _E4M3 = 0, 1, 2, 3, 4
_FLOAT_ENC = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}
#: Code widths of the block-wise formats the kernels seal and read (int4, int3, int2).
_SEALED_BITS = (2, 3, 4)


def _code_encoding(qmax: float) -> int | None:
    return {INT8_QMAX: _I8, E4M3_QMAX: _E4M3}.get(qmax)


def token_encoding(fmt: TokenFormat) -> int | None:
    """The kernels' element encoding of a token-wise format, or ``None`` when they cannot read it."""
    if isinstance(fmt, FloatFormat):
        return _FLOAT_ENC.get(fmt.dtype)
    if isinstance(fmt, (PerTokenFormat, StaticScaleFormat)):
        return _code_encoding(fmt.qmax)
    return None


def _sdpa_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the SDPA path (long query runs): bfloat16 for bfloat16 models, else float32.

    torch's CPU flash attention runs bfloat16 (float32 accumulation, AMX/AVX-512 bf16 where the CPU has
    it) 2.4x faster than float32 for a 1,000-token prefill here; the inputs are bfloat16 already. float16
    has no such path and float32 models keep float32 (the reference's arithmetic).
    """
    return torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float32


@dataclass(frozen=True, slots=True)
class _StepRows:
    """One step's batch as the kernel takes it."""

    seq_lens: torch.Tensor          # [B] int64
    query_start_loc: torch.Tensor   # [B + 1] int64
    kernel_rows: torch.Tensor       # [b] int64 requests the kernel serves
    sdpa_rows: tuple[int, ...]      # requests with longer query runs


@dataclass(frozen=True, slots=True)
class _SealedSources:
    """Per logical block of each request: 0 = sealed pool block, 1 = 16-bit tail slot, 2 = sealed first block with its
    first rows from the int8 sink slot ``sink[request]``."""

    kind: torch.Tensor   # [B, W] uint8
    index: torch.Tensor  # [B, W] int64
    sink: torch.Tensor   # [B] int64 (-1: none)
    kernel_rows: torch.Tensor   # [b] int64 requests the kernel serves
    sdpa_rows: tuple[int, ...]  # the others: long query runs, and short ones whose own block sealed without a slot


def _scale(spec: LayerSpec, params: LayerAttention) -> float:
    """The layer's softmax scale as the kernels take it."""
    return spec.head_dim**-0.5 if params.scale is None else params.scale


def _split_rows(kernel_rows: torch.Tensor, sdpa_rows: tuple[int, ...], meta: AttentionMetadata,
                params: LayerAttention) -> tuple[torch.Tensor, Sequence[int]]:
    """``(kernel rows, SDPA rows)`` of a layer: as planned for plain layers; every request through SDPA for a
    windowed or soft-capped one (the kernels read the whole context, uncapped)."""
    if params.is_plain:
        return kernel_rows, sdpa_rows
    return kernel_rows[:0], range(meta.num_requests)


#: torch's CPU flash attention returning the log-sum-exp of each query's scores (``None`` on a torch without it).
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


#: Query rows of one segment of :func:`_block_split_attention`'s earlier-blocks part (whole blocks): measured at
#: 512 queries from position 0, 9 heads of 64 over 3 kv heads, blocks of 32, bfloat16, one thread (a Xeon with
#: AMX), segments of 32/64/128/256/512 rows took 2.6/2.3/2.2/2.5/2.8 ms; from position 1,536: 14.0/9.8/9.1/9.6/10.1.
_SEGMENT_ROWS = 128


def _own_block_split(read: RequestRead, seq_len: int, n: int, block_size: int, params: LayerAttention) -> bool:
    """Whether :func:`_block_split_attention` serves a request's ``n`` queries: a plain layer, a pass starting at
    a block boundary (a prefill chunk or a prefix hit) and no window copies (each query would read its own)."""
    return (_FLASH_WITH_LSE is not None and params.is_plain and not read.window_copies and n > 0
            and (seq_len - n) % block_size == 0)


@functools.lru_cache(maxsize=16)
def _own_block_mask(block_size: int, g: int, dtype: torch.dtype) -> torch.Tensor:
    """``[block_size * g, block_size]`` additive mask of a block's own rows in the folded GQA layout: row
    ``t * g + i`` (token ``t``, the kv head's ``i``-th query head) reads columns ``0 .. t`` (0), not the rest
    (``-inf``): :func:`_staircase` with a step per token. Cached per shape and dtype; callers never write to it."""
    return _staircase(block_size, 1, g, block_size, dtype)


#: Columns up to which :func:`_earlier_blocks_mask` keeps its staircase (longer segments build their mask).
_STAIR_COLUMNS = 16384
_stairs: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}


def _earlier_blocks_mask(k: int, rows: int, s_seg: int, block_size: int, g: int, seg: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """``[rows, s_seg]`` additive mask of a segment of ``k`` query blocks (``k <= seg``) over the stored rows
    before its last block, in the folded GQA layout (row ``r`` is query ``r // g``): a query of the segment's
    block ``b`` reads the first ``s_seg - (k - 1 - b) * block_size`` columns (every block before its own).

    A view of a cached right-aligned staircase (``seg`` blocks of ``block_size * g`` rows, block ``b`` reading
    all but the last ``(seg - 1 - b) * block_size`` of its columns), so a prefill builds no mask per segment;
    segments longer than :data:`_STAIR_COLUMNS` build their own. The result is shared: callers never write to it.
    """
    if s_seg > _STAIR_COLUMNS:
        stair = _staircase(seg, block_size, g, s_seg, dtype)
    else:
        key = (seg, block_size, g, dtype)
        stair = _stairs.get(key)
        if stair is None or stair.shape[1] < s_seg:
            cap = min(_STAIR_COLUMNS, max(s_seg, 2 * (0 if stair is None else stair.shape[1])))
            stair = _stairs[key] = _staircase(seg, block_size, g, cap, dtype)
    r0 = (seg - k) * block_size * g
    return stair[r0:r0 + rows, stair.shape[1] - s_seg:]


def _staircase(seg: int, block_size: int, g: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[seg * block_size * g, cols]`` staircase of :func:`_earlier_blocks_mask`."""
    rblk = torch.arange(seg * block_size * g) // (block_size * g)
    limit = cols - (seg - 1 - rblk) * block_size                                      # columns each row reads
    blocked = torch.arange(cols)[None, :] >= limit[:, None]
    return torch.zeros((rblk.numel(), cols), dtype=dtype).masked_fill_(blocked, float("-inf"))


def _block_split_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, own_keys: torch.Tensor,
                           own_values: torch.Tensor, start: int, block_size: int, scale: float,
                           kernels: ModuleType) -> torch.Tensor:
    """Sealed-format attention of a pass whose queries start at a block boundary, without a mask over the rows.

    The query at position ``p`` (block ``j = p // block_size``) reads every block before ``j`` as stored and its
    own block at full precision up to ``p`` (:func:`~kvpage.ops.sealed_attention.sealed_request_attention`). The
    reference attends over the stored context plus the own-block rows under one ``[n, s + n]`` mask; here
    the two parts are two attentions merged by their log-sum-exp (the flash-decoding merge, the kernels'
    ``merge_attention``): the stored blocks before each query's own under a block mask, a segment of
    :data:`_SEGMENT_ROWS` query rows at a time (each reads only up to its last block), and the own blocks batched
    block by block under a causal mask. Both run GQA folded into rows (a kv head's ``g`` query heads are ``g``
    rows each of one attention over that kv head's keys), so keys and values are read as they are, never
    repeated per query head; the masks are views of cached ones; the merge reads flash's outputs as they come.
    Float32 merge, result in ``q.dtype``.

    Args:
        q: ``[n, H, D]`` queries of positions ``start .. start + n - 1``.
        keys: ``[s', Hkv, D]`` the stored context from position 0 (rows from the last query block on are not read).
        values: likewise, ``[s', Hkv, Dv]``.
        own_keys: ``[n, Hkv, D]`` the queries' own rows at full precision (as their blocks were sealed).
        own_values: ``[n, Hkv, Dv]``.
        start: the first query's position, a multiple of ``block_size``.
        block_size: tokens per block.
        scale: the softmax scale.
        kernels: the compiled extension (its ``merge_attention``).

    Returns:
        ``[n, H, Dv]`` in ``q.dtype``. No side effects.
    """
    assert _FLASH_WITH_LSE is not None
    n, h, d = q.shape
    hkv = keys.shape[1]
    g = h // hkv
    nb = -(-n // block_size)
    pad = nb * block_size - n
    # GQA folded into rows: a kv head's g query heads are g rows each of one attention over that kv head's keys
    # (rows in (token, head) order), so keys are read as stored, never repeated per query head. One copy of q.
    qp = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad)) if pad else q
    qs = qp.view(nb * block_size, hkv, g, d).permute(1, 0, 2, 3).reshape(1, hkv, nb * block_size * g, d)
    # own blocks: one batch entry per query block, each row reading its block's rows up to its own token
    # (padding rows come last and are never read); keys and values as views of the rows
    qo = qs[0].view(hkv, nb, block_size * g, d).transpose(0, 1)                      # [nb, Hkv, bs*g, D]
    ko, vo = ((torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) if pad else t).view(nb, block_size, hkv, -1)
              .transpose(1, 2) for t in (own_keys, own_values))                       # [nb, Hkv, bs, D]
    ob, lb = _FLASH_WITH_LSE(qo, ko, vo, attn_mask=_own_block_mask(block_size, g, q.dtype), scale=scale)[:2]
    # earlier blocks: each query reads the stored blocks before its own, a segment of query blocks at a time so
    # that a segment's keys end where its last block starts (the masked-out share falls from ~1/2 to ~1/(2k)).
    a0 = start // block_size
    out = torch.empty((n, h, ob.shape[-1]), dtype=q.dtype, device=q.device)
    s_before = start + (nb - 1) * block_size                                          # keys before the last block
    kq, vq = (t[:s_before].transpose(0, 1).unsqueeze(0) for t in (keys, values))      # [1, Hkv, s', D] (views)
    seg = max(1, _SEGMENT_ROWS // block_size)                                         # query blocks a segment
    for j0 in range(0, nb, seg):
        j1 = min(nb, j0 + seg)
        r0, r1 = j0 * block_size, min(n, j1 * block_size)
        s_seg = start + (j1 - 1) * block_size
        if s_seg == 0:  # block 0 of a pass from position 0: nothing before it
            out[r0:r1] = (ob[j0:j1].unflatten(2, (block_size, g)).permute(0, 2, 1, 3, 4)
                          .reshape((j1 - j0) * block_size, h, -1)[: r1 - r0])
            continue
        mask = _earlier_blocks_mask(j1 - j0, (r1 - r0) * g, s_seg, block_size, g, seg, q.dtype)
        oa, la = _FLASH_WITH_LSE(qs[:, :, r0 * g:r1 * g], kq[:, :, :s_seg], vq[:, :, :s_seg], attn_mask=mask,
                                 scale=scale)[:2]
        # the first block's queries read no earlier block when the pass starts at 0 (the merge skips them)
        kernels.merge_attention(out[r0:r1], oa[0], la[0], ob[j0:j1], lb[j0:j1],
                                block_size if a0 == 0 and j0 == 0 else 0)
    return out


def _plain_index(idx: torch.Tensor) -> bool:
    """Whether ``idx`` is what the kernels take as an index: contiguous int64 on the CPU."""
    return idx.dtype == torch.int64 and idx.is_contiguous() and idx.device.type == "cpu"


class KernelSealCodec(SealCodec):
    """Sealed blocks, first-block copies and row moves through the C++ kernels (``seal_blocks``,
    ``unseal_blocks``, ``write_rows``, ``move_rows``).

    Bytes are those of the formats' own code (:class:`~kvpage.ops.sealed_attention.SealCodec`), which is
    the fallback for what the kernels do not code: a block-wise format other than ``int4``/``int3``/``int2``, a
    rotated or non-8-bit sink format, non-contiguous tensors.
    """

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def move_rows(self, dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> None:
        """See :meth:`SealCodec.move_rows`: one ``memcpy`` a row."""
        if not (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
                and dst.device.type == src.device.type == "cpu" and _plain_index(dst_idx) and _plain_index(src_idx)):
            super().move_rows(dst, dst_idx, src, src_idx)
            return
        self.kernels.move_rows(dst, dst_idx, src, src_idx)

    @staticmethod
    def _kernel_names(cache: Mapping[str, torch.Tensor], fmt: BlockFormat, kind: str) -> tuple[str, ...]:
        """The pool tensors' names of ``kind`` when the C++ seal codes ``fmt``, else ``()``."""
        names = fmt.names(kind) if isinstance(fmt, SealedFormat) else ()
        if not (names and fmt.bits in _SEALED_BITS and fmt.step_search.step == 1
                and all(cache[n].is_contiguous() for n in names)):
            return ()
        return names

    def write_blocks(self, cache: Mapping[str, torch.Tensor], fmt: BlockFormat, kind: str, blocks: torch.Tensor,
                     ids: torch.Tensor) -> None:
        """See :meth:`SealCodec.write_blocks`: the int4/int3/int2 step search, codes and pool write in one call."""
        names = self._kernel_names(cache, fmt, kind)
        if not names or blocks.dtype not in _FLOAT_ENC or not _plain_index(ids):
            super().write_blocks(cache, fmt, kind, blocks, ids)
            return
        assert isinstance(fmt, SealedFormat)
        max_error = -1.0 if fmt.max_error is None else fmt.max_error
        self.kernels.seal_blocks(cache[names[0]], cache[names[1]], cache[names[2]], blocks.contiguous(), ids,
                                 kind == KEY, fmt.bits, value_group_size(blocks.shape[-1]), max_error,
                                 fmt.step_search.start, fmt.step_search.stop)

    def read_blocks(self, cache: Mapping[str, torch.Tensor], fmt: BlockFormat, kind: str, ids: torch.Tensor,
                    dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        """See :meth:`SealCodec.read_blocks`: unpack, offset and step in one pass over the blocks."""
        names = self._kernel_names(cache, fmt, kind)
        if not names or dtype not in _FLOAT_ENC or not _plain_index(ids):
            return super().read_blocks(cache, fmt, kind, ids, dtype, head_dim)
        assert isinstance(fmt, SealedFormat)
        codes = cache[names[0]]
        out = torch.empty((ids.numel(), codes.shape[1], codes.shape[2], head_dim), dtype=dtype)
        self.kernels.unseal_blocks(out, codes, cache[names[1]], cache[names[2]], ids, kind == KEY, fmt.bits,
                                   value_group_size(head_dim))
        return out

    def write_sink(self, codes: torch.Tensor, scales: torch.Tensor, sink_format: TokenFormat, kind: str,
                   rows: torch.Tensor, dst: torch.Tensor) -> None:
        """See :meth:`SealCodec.write_sink`: the fused per-token write of plain 8-bit formats."""
        enc = _code_encoding(sink_format.qmax) if isinstance(sink_format, PerTokenFormat) else None
        if (enc is None or sink_format.rotate or rows.dtype not in _FLOAT_ENC or not codes.is_contiguous()
                or not scales.is_contiguous() or scales.dtype != torch.float16):
            super().write_sink(codes, scales, sink_format, kind, rows, dst)
            return
        self.kernels.write_rows(codes, scales, rows.contiguous(), dst, enc, sink_format.qmax)


class CpuBackend(AttentionBackend):
    """Fused paged-attention kernels for the CPU (see the module docstring).

    Args:
        kernels: the compiled extension (:func:`kvpage.ops.cpu.build.load_kernels`).
        integer_dots: whether the decode kernel over sealed (int4/int3/int2) pool blocks may take its dot products
            in integers, where the build has them (``kernels.sealed_int_dots(head_dim)``: AVX-512 at head_dim 64 or
            128): q times the block's key steps coded as int16 per (block, query head), the softmax weights times
            the value steps as int16 per (32-token chunk, query head, group of 64 channels), each with the scale
            ``max / 32767`` (the int8 keys' coding of q). Outputs move by 2e-5 to 3e-4 of their scale from the float
            path's (which agrees with the reference backend to 1e-5); on the bundled model int4's KLD over 1,024
            GPL-3 tokens reads 0.0063 against the float path's 0.0061 (README, kernels); measured 1.1-1.2x faster
            for int4 and int3 at batch 32, depth 1,024 (``benchmarks/attention.py`` shape, one thread).
            ``False``: float32 throughout, as for the other formats.
    """

    name = "cpu"

    def __init__(self, kernels: ModuleType, *, integer_dots: bool = True) -> None:
        self.kernels = kernels
        self.integer_dots = integer_dots
        self._seal_codec = KernelSealCodec(kernels)
        self._rows: tuple[AttentionMetadata, _StepRows] | None = None
        self._sources: tuple[SealContext, _SealedSources] | None = None
        self._chan: dict[tuple[int, str], torch.Tensor] = {}
        self._validated: dict[int, tuple[weakref.ref[torch.Tensor], ...]] = {}

    @classmethod
    def unsupported(cls, spec: LayerSpec, device: torch.device) -> str | None:
        """Why not: a device other than the CPU, kernels that did not build or ``KVPAGE_CPU_KERNELS=0`` turned off
        (:func:`~kvpage.ops.cpu.build.kernels_unavailable_reason` says which), or a format they cannot read."""
        if torch.device(device).type != "cpu":
            return f"it runs on the CPU only, not on {device}"
        fmt = spec.format
        if isinstance(fmt, TokenFormat):
            if token_encoding(fmt) is None:
                return f"its kernels do not read format {spec.kv_format}"
        elif not (isinstance(fmt, SealedFormat) and fmt.bits in _SEALED_BITS):
            return f"its kernels do not read format {spec.kv_format}"
        if spec.head_dim > 512:
            return f"its kernels take head_dim up to 512, not {spec.head_dim}"
        why = kernels_unavailable_reason()
        if why is not None:
            return f"its C++ kernels are not available: {why}"
        return None

    # -- per-step state ---------------------------------------------------------------------------

    def _step_rows(self, meta: AttentionMetadata) -> _StepRows:
        if self._rows is not None and self._rows[0] is meta:
            return self._rows[1]
        qsl = meta.query_start_loc
        fused = [i for i in range(meta.num_requests) if qsl[i + 1] - qsl[i] <= KERNEL_MAX_QUERY]
        rows = _StepRows(
            seq_lens=torch.tensor(meta.seq_lens, dtype=torch.long),
            query_start_loc=torch.tensor(qsl, dtype=torch.long),
            kernel_rows=torch.tensor(fused, dtype=torch.long),
            sdpa_rows=tuple(i for i in range(meta.num_requests) if qsl[i + 1] - qsl[i] > KERNEL_MAX_QUERY),
        )
        self._rows = (meta, rows)
        return rows

    def _sealed_sources(self, ctx: SealContext, meta: AttentionMetadata) -> _SealedSources:
        """The step's source tables (:func:`~kvpage.ops.backends.sealed_sources.sealed_sources`, shared with the
        ``triton`` backend), built once per step and shared by the group's layers."""
        if self._sources is not None and self._sources[0] is ctx:
            return self._sources[1]
        tables = sealed_sources(ctx, meta, KERNEL_MAX_QUERY)
        src = _SealedSources(tables.kind, tables.index, tables.sink, torch.tensor(tables.kernel_rows, dtype=torch.long),
                             tables.sdpa_rows)
        self._sources = (ctx, src)
        return src

    def _static_channels(self, fmt: StaticScaleFormat, spec: LayerSpec, layer_index: int, kind: str) -> torch.Tensor:
        """The bound static scale of ``kind`` as a contiguous float32 ``[kv_heads, head_dim]`` (cached per layer)."""
        key = (layer_index, kind)
        t = self._chan.get(key)
        if t is None:
            t = fmt.scale(kind, "cpu").float().expand(spec.kv_heads, spec.head_dim).contiguous()
            self._chan[key] = t
        return t

    # -- token-wise formats -----------------------------------------------------------------------

    def _write(self, cache: Mapping[str, torch.Tensor], spec: LayerSpec, fmt: TokenFormat,
               k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor) -> None:
        """Store this step's rows: one fused kernel call per tensor, except static-scale formats (Python)."""
        if isinstance(fmt, FloatFormat):
            for name, x in ((KEY, k), (VALUE, v)):
                if x is not None:
                    self.kernels.write_rows(cache[name], None, x.contiguous(), slots, _FLOAT_ENC[fmt.dtype], 0.0)
            return
        if not isinstance(fmt, PerTokenFormat):
            write_kv(cache, spec, k, v, slots)
            return
        enc = _code_encoding(fmt.qmax)
        for name, scale_name, x in ((KEY, KEY_SCALE, k), (VALUE, VALUE_SCALE, v)):
            if x is None:
                continue
            y = fmt.to_stored_basis(x) if fmt.rotate else x
            self.kernels.write_rows(cache[name], cache[scale_name], y.contiguous(), slots, enc, fmt.qmax)

    def _validate(self, cache: Mapping[str, torch.Tensor], spec: LayerSpec, layer_index: int) -> None:
        """``spec.validate`` once per layer and set of cache tensors (other tensors, e.g. a re-allocated pool,
        are checked again); weak references, so a dropped pool is not kept alive."""
        seen = self._validated.get(layer_index)
        tensors = tuple(cache.values())
        if seen is None or len(seen) != len(tensors) or any(r() is not t for r, t in zip(seen, tensors)):
            spec.validate(cache, layer_index=layer_index)
            self._validated[layer_index] = tuple(weakref.ref(t) for t in tensors)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cache: Mapping[str, torch.Tensor],
        spec: LayerSpec, meta: AttentionMetadata, *, layer_index: int,
        params: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`; the cache tensors are checked against ``spec`` before writing.

        The kernels serve plain layers at any scale; a windowed or soft-capped layer attends through SDPA.
        """
        fmt = token_format(spec, layer_index)
        self._validate(cache, spec, layer_index)
        check_inputs(spec, layer_index, q, k, v)
        self._write(cache, spec, fmt, k, v, meta.slot_mapping)
        rows = self._step_rows(meta)
        kernel_rows, sdpa_rows = _split_rows(rows.kernel_rows, rows.sdpa_rows, meta, params)
        rot = fmt.rotation(spec.head_dim, torch.float32, q.device)
        # the kernel reads q and writes the output in the model dtype; rotated formats attend in float32
        qa = q.contiguous() if rot is None else (q.float() @ rot).contiguous()
        out = torch.empty_like(qa)
        value_name = VALUE if spec.has_value else KEY
        if kernel_rows.numel():
            enc = token_encoding(fmt)
            kchan = vchan = None
            if isinstance(fmt, StaticScaleFormat):
                kchan = self._static_channels(fmt, spec, layer_index, KEY)
                vchan = self._static_channels(fmt, spec, layer_index, value_name)
            self.kernels.paged_attention(
                out, qa, cache[KEY], cache[value_name], cache.get(KEY_SCALE),
                cache.get(VALUE_SCALE if spec.has_value else KEY_SCALE), kchan, vchan,
                meta.block_tables, rows.seq_lens, rows.query_start_loc, kernel_rows, enc, _scale(spec, params),
            )
        dt = _sdpa_dtype(qa.dtype)
        for i in sdpa_rows:
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            keys, vals = window_context(cache, spec, meta.block_tables[i], meta.seq_lens[i], b - a, params, dt)
            out[a:b] = request_attention(qa[a:b].to(dt), keys, vals, params)
        if rot is not None:
            out = out @ rot.T
        return out.to(q.dtype)

    # -- quantize-on-seal formats -----------------------------------------------------------------

    def _rotate_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R`` of a rotated format's k or v rows in one kernel call (``hadamard_rows``: the format's own
        butterflies, bit for bit), float32 ``[..., D]``; ``x`` is not modified."""
        return self.kernels.hadamard_rows(x.float().contiguous())

    def forward_sealed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cache: Mapping[str, torch.Tensor],
        spec: LayerSpec, meta: AttentionMetadata, ctx: SealContext, *, layer_index: int,
        params: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward_sealed` (rotated formats: in their stored basis, as the reference)."""
        fmt, tail = sealed_attention_checks(q, k, v, cache, spec, meta, ctx, layer_index=layer_index)
        basis = enter_stored_basis(fmt, q, k, v, self._rotate_rows)
        k, v = basis.k, basis.v
        batch = write_sealed_kv(cache, tail, fmt, ctx, spec.block_size, k, v, self._seal_codec)
        rows = self._step_rows(meta)
        qa = basis.q.contiguous()
        out = torch.empty_like(qa)
        src = self._sealed_sources(ctx, meta)  # once per step, shared by the group's layers
        kernel_rows, sdpa_rows = _split_rows(src.kernel_rows, src.sdpa_rows, meta, params)
        if kernel_rows.numel():
            assert isinstance(fmt, SealedFormat)  # unsupported() admits no other block-wise format
            has_value = spec.has_value
            vn = VALUE if has_value else KEY
            vs = fmt.names(vn)
            ks = fmt.names(KEY)
            tail_v = tail[vn]
            self.kernels.sealed_attention(
                out, qa, cache[ks[0]], cache[ks[1]], cache[ks[2]], cache[vs[0]], cache[vs[1]], cache[vs[2]],
                tail[KEY], tail_v, tail["sink_" + KEY], tail["sink_" + KEY_SCALE],
                tail["sink_" + vn], tail["sink_" + (VALUE_SCALE if has_value else KEY_SCALE)],
                src.kind, src.index, src.sink, max(1, sink_rows(fmt, spec.block_size)), rows.seq_lens,
                rows.query_start_loc, kernel_rows,
                fmt.bits, _FLOAT_ENC[tail[KEY].dtype], has_value, _scale(spec, params), self.integer_dots,
            )
        dt = _sdpa_dtype(qa.dtype)
        bs = spec.block_size
        for i in sdpa_rows:
            a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            read, s = ctx.plan.reads[i], meta.seq_lens[i]
            if _own_block_split(read, s, b - a, bs, params):
                keys, vals = read_sealed_context(cache, tail, fmt, ctx.sink_format, spec, read, dt,
                                                  codec=self._seal_codec)
                # the own blocks' rows as sealed: this step's rows rounded to the tail dtype (a pass starting
                # at a block boundary holds every row of its blocks)
                own_k = k[a:b].to(tail[KEY].dtype).to(dt)
                own_v = own_k if v is None else v[a:b].to(tail[KEY].dtype).to(dt)
                out[a:b] = _block_split_attention(qa[a:b].to(dt), keys, vals, own_k, own_v, s - (b - a), bs,
                                                  _scale(spec, params), self.kernels)
            else:
                out[a:b] = sealed_request(qa[a:b].to(dt), cache, tail, fmt, ctx, spec, read, batch, s, params,
                                          self._seal_codec)
        return basis.leave(out, q.dtype)


def cpu_backend() -> CpuBackend | None:
    """A :class:`CpuBackend` over the compiled kernels, or ``None`` when they could not be built."""
    kernels = load_kernels()
    return None if kernels is None else CpuBackend(kernels)
