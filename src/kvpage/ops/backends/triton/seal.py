"""The seal of the quantize-on-seal formats (``int4``, ``int3``, ``int2``) as Triton kernels: the step search,
codes, packing and pool write of whole blocks in one launch, byte-identical to :meth:`SealedFormat.seal
<kvpage.formats.kivi.SealedFormat.seal>`; the unseal; and :class:`TritonSealCodec`, which routes a layer's
seal, unseal and first-block copy through them. Imports triton; loaded lazily by :mod:`kvpage.ops.backends.triton`.

The arithmetic is :func:`~kvpage.formats.kivi.quantize_searched`'s, step by step and in its order, as the C++
``seal_blocks`` (``kvpage/ops/cpu/seal_blocks.cpp``) does it: IEEE divisions (``div_rn``), round-half-even,
NaN-propagating clamps and extrema, no fused multiply-add (launched with ``enable_fp_fusion=False``), each group's
squared error summed in float64 and compared in float32 (a summation order only matters below float64's
rounding), the first least error winning as in ``torch.argmin`` (the first NaN before everything).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from kvpage.formats import KEY, BlockFormat, SealedFormat, TokenFormat
from kvpage.formats.codes import E4M3_QMAX, INT8_QMAX
from kvpage.formats.kivi import value_group_size
from kvpage.formats.per_token import PerTokenFormat
from kvpage.ops.backends.triton import write
from kvpage.ops.backends.triton.codes import ENC_BF16, ENC_F16, ENC_F32, ENC_I8, ENC_E4M3, SCALE_TOKEN, dequantize
from kvpage.ops.backends.triton.codes import round_half_even
from kvpage.ops.backends.triton.sealed_attention import _unpack, decode_ue5m3
from kvpage.ops.sealed_attention import SealCodec

_FLOAT_ENC = {torch.float32: ENC_F32, torch.bfloat16: ENC_BF16, torch.float16: ENC_F16}
_CODE_ENC = {INT8_QMAX: ENC_I8, E4M3_QMAX: ENC_E4M3}
#: Most candidates a search may try (int2's -3..8: 25).
MAX_CANDIDATES = 64


@triton.jit
def encode_ue5m3(s):
    """float32 steps -> UE5M3 codes (int32 in ``[0, 255]``) as :func:`~kvpage.formats.kivi.encode_scale`: NaN ->
    the largest step, clamped to ``[2**-16, 61440]``, rounded up. Branch-free on the bits (the C++ kernel's form): a
    clamped step is a normal float32, its exponent ``E`` and fraction ``f`` give ``m = ceil(f / 2**20)`` (8: carry)."""
    s = tl.where(s != s, 61440.0, s)
    s = tl.where(s < 0.0000152587890625, 0.0000152587890625, tl.where(s > 61440.0, 61440.0, s))
    b = s.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 255) - 127
    m = ((b & 0x7FFFFF) + 0xFFFFF) >> 20
    carry = (m == 8).to(tl.int32)
    return ((e + 16 + carry) << 3) | (m * (1 - carry))


@triton.jit
def _clamp(v, lo, hi):
    """``torch.clamp``: NaN stays NaN."""
    return tl.where(v < lo, lo, tl.where(v > hi, hi, v))


@triton.jit
def _rank(x, valid, st, m, span, qmax, max_error, LIMITED: tl.constexpr):
    """A candidate's rank (float32) for each group (a column of ``x``): its summed squared error (float64 sum, rounded
    to float32); with a ``max_error`` an infeasible candidate ranks ``1e30 * (1 + worst / limit)`` (NaN stays NaN)."""
    u = _clamp(round_half_even(tl.math.div_rn(x, st) - m), 0.0, qmax)
    diff = (u + m) * st - x
    dd = diff.to(tl.float64)
    err = tl.sum(tl.where(valid, dd * dd, 0.0), axis=0, keep_dims=True).to(tl.float32)
    if LIMITED:
        worst = tl.max(tl.where(valid, tl.abs(diff), 0.0), axis=0, keep_dims=True)
        limit = max_error * span
        lim = tl.where(limit < 0.0000152587890625, 0.0000152587890625, limit)
        keep = (err != err) | (worst <= limit)
        err = tl.where(keep, err, 1e30 * (1.0 + tl.math.div_rn(worst, lim)))
    return err


@triton.jit
def _seal_blocks_kernel(
    x_ptr, ids_ptr, codes_ptr, scale_ptr, zero_ptr,
    block_size, kv_heads, head_dim, num_groups, group_size, packed, qmax, max_error,
    ENC: tl.constexpr, IS_KEY: tl.constexpr, BITS: tl.constexpr, LIMITED: tl.constexpr,
    STEP_LO: tl.constexpr, NUM_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr, PER: tl.constexpr,
):
    # one program seals block b's rows of kv head h, one group per column of a tile (the C++ kernel's lanes), so
    # every reduction runs down axis 0. Keys: [BLOCK_T, BLOCK_W * PER], token t by channel k (num_groups = 1,
    # group_size = head_dim). Values: [BLOCK_W * PER, BLOCK_T * BLOCK_G], channel k of group j of token t in column
    # t * BLOCK_G + j (the rows transposed). Packing wants [rows, BLOCK_W, PER]: the PER codes of a byte (3 bits: of a
    # 24-bit word) side by side, so the value codes are transposed back first
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(ids_ptr + b)
    if IS_KEY:
        t = tl.arange(0, BLOCK_T)[:, None]
        j = t * 0
        inner = tl.arange(0, BLOCK_W * PER)[None, :]                                # channel
    else:
        inner = tl.arange(0, BLOCK_W * PER)[:, None]                                # channel within the group
        col = tl.arange(0, BLOCK_T * BLOCK_G)[None, :]
        t = col // BLOCK_G
        j = col % BLOCK_G
    valid = (t < block_size) & (j < num_groups) & (inner < group_size)
    row = (b.to(tl.int64) * block_size + t) * kv_heads + h
    raw = tl.load(x_ptr + row * head_dim + j * group_size + inner, mask=valid, other=0)
    x = dequantize(raw, 1.0, ENC)                                                    # float32, exact
    nan = x != x
    has_nan = tl.max(tl.where(valid & nan, 1, 0), axis=0, keep_dims=True) > 0
    xs = tl.where(nan, 0.0, x)
    # amin / amax: any NaN makes both NaN
    mn = tl.where(has_nan, float("nan"), tl.min(tl.where(valid, xs, float("inf")), axis=0, keep_dims=True))
    mx = tl.where(has_nan, float("nan"), tl.max(tl.where(valid, xs, -float("inf")), axis=0, keep_dims=True))
    used = tl.max(valid.to(tl.int32), axis=0, keep_dims=True) > 0                  # padding columns: 0, not inf - inf
    mn = tl.where(used, mn, 0.0)
    mx = tl.where(used, mx, 0.0)
    span = tl.math.div_rn(mx - mn, qmax)
    e0 = encode_ue5m3(span)
    best_r = span   # (typed placeholders; candidate 0 sets them)
    best_e = e0
    best_m = span
    found = has_nan.to(tl.int32)
    # candidates in quantize_searched's order: (k, centred), (k, floor) for each k, then the covering step
    for cand in tl.static_range(2 * NUM_STEPS + 1):
        if cand == 2 * NUM_STEPS:
            a = tl.abs(mn)
            bb = tl.abs(mx)
            big = tl.where((a > bb) | (mn != mn), a, bb)                              # torch.maximum (NaN wins)
            cov_a = tl.math.div_rn(2.0 * (mx - mn), qmax)
            cov_b = tl.math.div_rn(big, 127.0 - qmax)
            cover = tl.where((cov_a != cov_a) | (cov_b != cov_b), float("nan"), tl.where(cov_a > cov_b, cov_a, cov_b))
            e = encode_ue5m3(cover)
            st = decode_ue5m3(e)
            m = _clamp(tl.floor(tl.math.div_rn(mn, st)), -128.0, 127.0)
        else:
            e = e0 + (STEP_LO + cand // 2)
            e = tl.where(e < 0, 0, tl.where(e > 255, 255, e))
            st = decode_ue5m3(e)
            if cand % 2 == 0:  # the offset centring the codes on the group's midpoint
                m = _clamp(round_half_even(tl.math.div_rn(mn + mx, 2.0 * st) - qmax * 0.5), -128.0, 127.0)
            else:              # the one starting them at its minimum
                m = _clamp(tl.floor(tl.math.div_rn(mn, st)), -128.0, 127.0)
        r = _rank(x, valid, st, m, span, qmax, max_error, LIMITED)
        is_nan = (r != r).to(tl.int32)
        if cand == 0:
            best_r = r
            best_e = e
            best_m = m
            found = is_nan
        else:
            take = (found == 0) & ((is_nan == 1) | (r < best_r))                      # torch.argmin: first least
            best_r = tl.where(take, r, best_r)
            best_e = tl.where(take, e, best_e)
            best_m = tl.where(take, m, best_m)
            found = found | is_nan
    st = decode_ue5m3(best_e)
    u = _clamp(round_half_even(tl.math.div_rn(x, st) - best_m), 0.0, qmax)
    code = tl.where(valid & (u == u), u, 0.0).to(tl.int32)                   # NaN codes store 0
    off = tl.where(best_m != best_m, 0.0, best_m).to(tl.int32).to(tl.int8)
    sbyte = best_e.to(tl.uint8)
    blk64 = blk.to(tl.int64)
    if IS_KEY:   # one step and offset per (kv head, channel)
        meta = (blk64 * kv_heads + h) * head_dim + inner
        mm = inner < head_dim
    else:        # one per (token, kv head, group)
        meta = ((blk64 * block_size + t) * kv_heads + h) * num_groups + j
        mm = (t < block_size) & (j < num_groups)
    tl.store(scale_ptr + meta, sbyte, mask=mm)
    tl.store(zero_ptr + meta, off, mask=mm)
    # pack: the PER codes of a byte (a 24-bit word at 3 bits) OR-ed along the last axis (kivi.pack)
    if not IS_KEY:
        code = tl.trans(code)                                                        # [BLOCK_T * BLOCK_G, channels]
    shift = BITS * tl.arange(0, PER)[None, None, :]
    word = tl.sum(tl.reshape(code, [BLOCK_T * BLOCK_G, BLOCK_W, PER]) << shift, axis=2)   # [rows, BLOCK_W]
    r = tl.arange(0, BLOCK_T * BLOCK_G)[:, None]
    t = r // BLOCK_G
    j = r % BLOCK_G
    w = tl.arange(0, BLOCK_W)[None, :]
    widx = j * (group_size // PER) + w                                               # the word's place in the row
    wm = (t < block_size) & (j < num_groups) & (w * PER < group_size)
    dst = ((blk64 * block_size + t) * kv_heads + h) * packed
    if BITS == 3:
        for k in tl.static_range(3):
            at = 3 * widx + k
            tl.store(codes_ptr + dst + at, ((word >> (8 * k)) & 255).to(tl.uint8), mask=wm & (at < packed))
    else:
        tl.store(codes_ptr + dst + widx, word.to(tl.uint8), mask=wm)


@triton.jit
def _unseal_blocks_kernel(
    out_ptr, ids_ptr, codes_ptr, scale_ptr, zero_ptr,
    block_size, kv_heads, head_dim, num_groups, group_size,
    IS_KEY: tl.constexpr, BITS: tl.constexpr, PACKED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program dequantizes BLOCK_T tokens of block b's kv head h: x = (code + zero) * step in float32
    b = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tm = t < block_size
    m2 = tm[:, None] & (d < head_dim)[None, :]
    blk = tl.load(ids_ptr + b).to(tl.int64)
    row = (blk * block_size + t) * kv_heads + h                                      # [BLOCK_T] pool row
    code = _unpack(codes_ptr, row, d, m2, BITS, PACKED)
    if IS_KEY:
        meta = ((blk * kv_heads + h) * head_dim + d)[None, :]
    else:
        meta = row[:, None] * num_groups + (d // group_size)[None, :]
    step = decode_ue5m3(tl.load(scale_ptr + meta, mask=m2, other=0))
    zero = tl.load(zero_ptr + meta, mask=m2, other=0).to(tl.float32)
    x = (code + zero) * step
    dst = ((b.to(tl.int64) * block_size + t) * kv_heads + h)[:, None] * head_dim + d[None, :]
    tl.store(out_ptr + dst, x, mask=m2)


def seal_warps(block_size: int, head_dim: int) -> int:
    """Warps of a seal program: 4, or 8 for tiles above 2,048 values (float64 sums keep many registers live)."""
    return 8 if triton.next_power_of_2(block_size) * triton.next_power_of_2(head_dim) > 2048 else 4


def kernel_seals(fmt: BlockFormat, head_dim: int) -> bool:
    """Whether :func:`seal_blocks` codes ``fmt``'s blocks of ``head_dim`` channels: ``int4``/``int3``/``int2`` (and
    their rotated variants, whose stored basis is sealed the same way) with a unit-stride step search of at most
    :data:`MAX_CANDIDATES` candidates, and value groups whose channels fill whole packed bytes (3 bits: whole
    8-code words), so no byte mixes two groups."""
    if not (isinstance(fmt, SealedFormat) and fmt.bits in (2, 3, 4) and fmt.step_search.step == 1):
        return False
    steps = len(fmt.step_search)
    per = 8 if fmt.bits == 3 else 8 // fmt.bits
    return 0 < 2 * steps + 1 <= MAX_CANDIDATES and value_group_size(head_dim) % per == 0


def seal_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: SealedFormat, kind: str,
                blocks: torch.Tensor, ids: torch.Tensor) -> None:
    """Seal ``blocks`` into pool blocks ``ids`` in one launch: :meth:`SealedFormat.seal` followed by ``index_copy_``.

    Args:
        codes: the layer's pool tensor of ``kind``'s codes, uint8 ``[num_blocks, block_size, kv_heads, P]``
            (``P = ceil(head_dim * bits / 8)``), contiguous; written in place at ``ids``.
        scale, zero: its UE5M3 steps (uint8) and offsets (int8), contiguous: keys ``[num_blocks, kv_heads,
            head_dim]``, values ``[num_blocks, block_size, kv_heads, head_dim // group]``; written in place.
        fmt: the format (:func:`kernel_seals` must hold for it).
        kind: ``"key"`` (per channel over the block) or ``"value"`` (per token, groups of
            :func:`~kvpage.formats.kivi.value_group_size` channels).
        blocks: ``[m, block_size, kv_heads, head_dim]`` float32, bfloat16 or float16 rows in the format's stored
            basis (made contiguous here).
        ids: ``[m]`` int64 distinct pool block ids, on the pool's device.

    Bytes equal the format's own code for every input, NaN and infinities included (the module docstring says
    how; ``tests/test_triton_seal.py`` checks it).
    """
    m, bs, kv_heads, head_dim = blocks.shape
    if m == 0:
        return
    is_key = kind == KEY
    per = 8 if fmt.bits == 3 else 8 // fmt.bits
    group = head_dim if is_key else value_group_size(head_dim)
    groups = 1 if is_key else head_dim // group
    x = blocks.contiguous()
    enc = _FLOAT_ENC[x.dtype]
    if enc == ENC_BF16:  # read as raw bits: the kernel widens them exactly
        x = x.view(torch.int16)
    _seal_blocks_kernel[(m, kv_heads)](
        x, ids, codes, scale, zero,
        bs, kv_heads, head_dim, groups, group, codes.shape[-1], float(2**fmt.bits - 1),
        -1.0 if fmt.max_error is None else float(fmt.max_error),
        ENC=enc, IS_KEY=is_key, BITS=fmt.bits, LIMITED=fmt.max_error is not None,
        STEP_LO=fmt.step_search.start, NUM_STEPS=len(fmt.step_search),
        BLOCK_T=triton.next_power_of_2(bs), BLOCK_G=triton.next_power_of_2(groups),
        BLOCK_W=triton.next_power_of_2(-(-group // per)), PER=per,
        num_warps=seal_warps(bs, head_dim), enable_fp_fusion=False,
    )


def unseal_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: SealedFormat, kind: str,
                  ids: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Pool blocks ``ids`` dequantized in one launch, as :meth:`SealedFormat.unseal
    <kvpage.formats.kivi.SealedFormat.unseal>` in float32 (``x = (code + zero) * step``, the same two roundings).

    Args:
        codes, scale, zero: the layer's pool tensors of ``kind`` (as :func:`seal_blocks` takes them; ``codes`` may
            hold more than ``P`` bytes a row), contiguous.
        fmt: the format (``int4``/``int3``/``int2`` or a rotated variant: the stored basis is returned).
        kind: ``"key"`` or ``"value"``.
        ids: ``[m]`` int64 pool block ids.
        head_dim: channels per row.

    Returns:
        ``[m, block_size, kv_heads, head_dim]`` float32 on the pool's device. No side effects.
    """
    m = ids.numel()
    _, bs, kv_heads, packed = codes.shape
    out = torch.empty((m, bs, kv_heads, head_dim), dtype=torch.float32, device=codes.device)
    if m == 0:
        return out
    is_key = kind == KEY
    group = head_dim if is_key else value_group_size(head_dim)
    block_t = min(triton.next_power_of_2(bs), 16)
    _unseal_blocks_kernel[(m, kv_heads, triton.cdiv(bs, block_t))](
        out, ids, codes, scale, zero, bs, kv_heads, head_dim, head_dim // group, group,
        IS_KEY=is_key, BITS=fmt.bits, PACKED=packed, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


class TritonSealCodec(SealCodec):
    """Sealed blocks and first-block copies through the Triton kernels: the seal (:func:`seal_blocks`), the unseal
    (:func:`unseal_blocks`) and the 8-bit sink copy (:func:`~kvpage.ops.backends.triton.write.write_rows`, the fused
    per-token write).

    Bytes are those of the formats' own code (:class:`~kvpage.ops.sealed_attention.SealCodec`), which stays the
    path for what the kernels do not code (:func:`kernel_seals` false, non-contiguous pool tensors, a storage
    dtype other than float32/bfloat16/float16, a sink format other than a per-token 8-bit one with float16
    scales), and for row moves (torch indexing).
    """

    def write_blocks(self, cache: Mapping[str, torch.Tensor], fmt: BlockFormat, kind: str, blocks: torch.Tensor,
                     ids: torch.Tensor) -> None:
        """See :meth:`SealCodec.write_blocks`: the step search, codes and pool write in one launch."""
        names = fmt.names(kind) if isinstance(fmt, SealedFormat) else ()
        if (not names or not kernel_seals(fmt, blocks.shape[-1]) or blocks.dtype not in _FLOAT_ENC
                or ids.dtype != torch.int64 or not all(cache[n].is_contiguous() for n in names)):
            super().write_blocks(cache, fmt, kind, blocks, ids)
            return
        assert isinstance(fmt, SealedFormat)
        seal_blocks(cache[names[0]], cache[names[1]], cache[names[2]], fmt, kind, blocks, ids.contiguous())

    def read_blocks(self, cache: Mapping[str, torch.Tensor], fmt: BlockFormat, kind: str, ids: torch.Tensor,
                    dtype: torch.dtype, head_dim: int) -> torch.Tensor:
        """See :meth:`SealCodec.read_blocks`: unpack, offset and step in one launch (float32, then ``dtype``)."""
        names = fmt.names(kind) if isinstance(fmt, SealedFormat) else ()
        if (not names or not isinstance(fmt, SealedFormat) or fmt.bits not in (2, 3, 4) or ids.dtype != torch.int64
                or not all(cache[n].is_contiguous() for n in names)):
            return super().read_blocks(cache, fmt, kind, ids, dtype, head_dim)
        out = unseal_blocks(cache[names[0]], cache[names[1]], cache[names[2]], fmt, kind, ids.contiguous(), head_dim)
        return out if dtype == torch.float32 else out.to(dtype)

    def write_sink(self, codes: torch.Tensor, scales: torch.Tensor, sink_format: TokenFormat, kind: str,
                   rows: torch.Tensor, dst: torch.Tensor) -> None:
        """See :meth:`SealCodec.write_sink`: one launch of the fused per-token write (``write_rows``)."""
        enc = _CODE_ENC.get(sink_format.qmax) if isinstance(sink_format, PerTokenFormat) else None
        if (enc is None or rows.dtype not in _FLOAT_ENC or not codes.is_contiguous() or not scales.is_contiguous()
                or scales.dtype != torch.float16 or dst.dtype != torch.int64):
            super().write_sink(codes, scales, sink_format, kind, rows, dst)
            return
        assert isinstance(sink_format, PerTokenFormat)
        y = sink_format.to_stored_basis(rows) if sink_format.rotate else rows.float()
        write.write_rows(codes, scales, None, y.contiguous(), dst.contiguous(), encoding=enc,
                         scale_kind=SCALE_TOKEN, qmax=sink_format.qmax)


__all__ = ["MAX_CANDIDATES", "TritonSealCodec", "encode_ue5m3", "kernel_seals", "seal_blocks", "seal_warps", "unseal_blocks"]
