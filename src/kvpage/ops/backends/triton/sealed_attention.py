"""The paged attention kernel of the quantize-on-seal formats (``int4``, ``int3``, ``int2``): decode rows and short runs.

The token-wise kernel's structure (:mod:`.paged_attention`: one program per query tile and kv head with all its
GQA heads, online softmax, split-K merged by log-sum-exp), reading each context position through the step's
source tables (:mod:`kvpage.ops.backends.sealed_sources`) instead of a block table: a sealed pool block (KIVI
codes: keys per (kv head, channel) of the block, values per (token, kv head, channel group); UE5M3 steps and int8
zero points in steps, ``x = (code + zero) * step``), a 16-bit tail slot (window copies, the open block, the
block sealed this step) or a sealed first block whose first rows its int8 (sink) copy holds. The decode is the C++ ``SealedSource``'s
(``ops/cpu/paged_attention.cpp``) and :meth:`kvpage.formats.kivi.SealedFormat.unseal`'s. Imports triton; loaded
lazily by :mod:`kvpage.ops.backends.triton`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpage.ops.backends.triton.codes import decode_int8, dequantize
from kvpage.ops.backends.triton.paged_attention import _merge_splits_kernel
from kvpage.ops.backends.triton.step import num_warps
from kvpage.ops.backends.triton.tile import online_softmax_step, query_tile, store_tile


@triton.jit
def decode_ue5m3(c):
    """UE5M3 scale bytes (uint8) -> float32 steps ``(1 + m / 8) * 2**(e - 16)``, built on the float32 bits (exact:
    the byte's exponent ``e - 16`` in ``[-16, 15]`` is always a normal float32 exponent)."""
    b = c.to(tl.int32)
    return ((((b >> 3) + 111) << 23) | ((b & 7) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def _unpack(ptr, row, d, m2, BITS: tl.constexpr, PACKED: tl.constexpr):
    """Codes (float32) of channels ``d`` of packed rows ``row`` (``[BLOCK_N]`` int64): int4 channel ``2i`` in the
    low nibble of byte ``i``; int3 channel ``i`` at bit ``3i`` of the row's little-endian bit stream (a code whose
    bit offset in its byte is above 5 takes its high bits from the next byte, which the row holds: no load past
    it); int2 channel ``4i + j`` in bits ``2j`` of byte ``i``."""
    if BITS == 4:
        byte = tl.load(ptr + row[:, None] * PACKED + (d // 2)[None, :], mask=m2, other=0).to(tl.int32)
        code = (byte >> ((d % 2) * 4)[None, :]) & 15
    elif BITS == 3:
        at = row[:, None] * PACKED + ((d * 3) // 8)[None, :]
        sh = ((d * 3) % 8)[None, :]
        lo = tl.load(ptr + at, mask=m2, other=0).to(tl.int32)
        hi = tl.load(ptr + at + 1, mask=m2 & (sh > 5), other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> sh) & 7
    else:
        byte = tl.load(ptr + row[:, None] * PACKED + (d // 4)[None, :], mask=m2, other=0).to(tl.int32)
        code = (byte >> ((d % 4) * 2)[None, :]) & 3
    return code.to(tl.float32)


@triton.jit
def _load_sealed(codes_ptr, scale_ptr, zero_ptr, tail_ptr, sink_ptr, sink_scale_ptr,
                 kind, idx, off, sink_slot, sink_rows, kvh, kv_heads, head_dim, block_size, d, mask,
                 IS_KEY: tl.constexpr, BITS: tl.constexpr, PACKED: tl.constexpr, GROUPS: tl.constexpr,
                 GROUP_SIZE: tl.constexpr, TAIL_ENC: tl.constexpr):
    """Dequantized ``[BLOCK_N, BLOCK_D]`` float32 rows of kv head ``kvh``: position ``i`` is offset ``off[i]`` of
    logical block source ``(kind[i], idx[i])`` (0 pool block, 1 tail slot, 2 pool block whose offsets below
    ``sink_rows`` read the request's sink slot ``sink_slot``, 3 the int8 copy in 8-bit slot ``idx[i]``, which holds
    the whole block); 0 where ``mask`` is off."""
    dm = d < head_dim
    m2 = mask[:, None] & dm[None, :]
    row = (idx * block_size + off) * kv_heads + kvh                                  # [BLOCK_N] int64 (token, head)
    in_sink = ((kind == 2) & (off < sink_rows)) | (kind == 3)
    # sealed pool block
    pm = m2 & (((kind == 0) | (kind == 2)) & ~in_sink)[:, None]
    code = _unpack(codes_ptr, row, d, pm, BITS, PACKED)
    if IS_KEY:  # one step and zero point per (kv head, channel) of the block
        meta = (idx * kv_heads + kvh)[:, None] * head_dim + d[None, :]
    else:       # one per (token, kv head, group of GROUP_SIZE channels)
        meta = row[:, None] * GROUPS + (d // GROUP_SIZE)[None, :]
    step = decode_ue5m3(tl.load(scale_ptr + meta, mask=pm, other=0))
    zero = tl.load(zero_ptr + meta, mask=pm, other=0).to(tl.float32)
    x = (code + zero) * step
    # 16-bit tail rows
    tm = m2 & (kind == 1)[:, None]
    t = tl.load(tail_ptr + row[:, None] * head_dim + d[None, :], mask=tm, other=0)
    x = tl.where(tm, dequantize(t, 1.0, TAIL_ENC), x)
    # int8 first-block copy of the first rows, one float16 scale per (token, kv head)
    sm = m2 & in_sink[:, None]
    srow = (tl.where(kind == 3, idx, sink_slot) * sink_rows + off) * kv_heads + kvh
    sc = tl.load(sink_ptr + srow[:, None] * head_dim + d[None, :], mask=sm, other=0)
    ss = tl.load(sink_scale_ptr + srow, mask=mask & in_sink, other=0.0).to(tl.float32)
    x = tl.where(sm, decode_int8(sc) * ss[:, None], x)
    return tl.where(m2, x, 0.0)


@triton.jit
def _sealed_attention_kernel(
    out_ptr, lse_ptr, q_ptr,
    k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, tk_ptr, tv_ptr, sk_ptr, sks_ptr, sv_ptr, svs_ptr,
    kind_ptr, idx_ptr, sink_ptr, seq_lens_ptr, qstart_ptr, items_ptr,
    num_tokens, num_heads, kv_heads, head_dim, block_size, src_stride, sink_rows, sm_scale, tiles_per_split,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BITS: tl.constexpr, PACKED: tl.constexpr, GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, TAIL_ENC: tl.constexpr, HAS_VALUE: tl.constexpr, SPLIT: tl.constexpr,
):
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req, q0, seq_len, n, row_ok, qrow, qpos, d, dm, q = query_tile(
        q_ptr, items_ptr, seq_lens_ptr, qstart_ptr, num_heads, head_dim, GROUP, BLOCK_Q, BLOCK_M, BLOCK_D)
    hi = seq_len - n + tl.minimum(q0 + BLOCK_Q, n)  # keys the tile's queries read: [0, hi)
    start = 0
    if SPLIT:
        start = split * tiles_per_split * BLOCK_N
        hi = tl.minimum(hi, start + tiles_per_split * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    sink_slot = tl.load(sink_ptr + req).to(tl.int64)                                 # -1: none (kind 2 absent)
    for s0 in range(start, hi, BLOCK_N):
        kpos = s0 + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        blk = kpos // block_size
        kind = tl.load(kind_ptr + req * src_stride + blk, mask=kmask, other=0).to(tl.int32)
        idx = tl.load(idx_ptr + req * src_stride + blk, mask=kmask, other=0).to(tl.int64)
        off = kpos % block_size
        k = _load_sealed(k_ptr, ks_ptr, kz_ptr, tk_ptr, sk_ptr, sks_ptr, kind, idx, off, sink_slot, sink_rows, kvh,
                         kv_heads, head_dim, block_size, d, kmask, True, BITS, PACKED, GROUPS, GROUP_SIZE, TAIL_ENC)
        if HAS_VALUE:
            v = _load_sealed(v_ptr, vs_ptr, vz_ptr, tv_ptr, sv_ptr, svs_ptr, kind, idx, off, sink_slot, sink_rows,
                             kvh, kv_heads, head_dim, block_size, d, kmask, False, BITS, PACKED, GROUPS, GROUP_SIZE,
                             TAIL_ENC)
        else:  # a key-only layer's values are its keys
            v = k
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale                # [BLOCK_M, BLOCK_N]
        ok = row_ok[:, None] & kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc)
    store_tile(out_ptr, lse_ptr, acc, m_i, l_i, qrow, row_ok, d, dm, num_tokens, num_heads, head_dim, SPLIT)


def sealed_attention(
    out: torch.Tensor, q: torch.Tensor, key: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    value: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    tail_key: torch.Tensor, tail_value: torch.Tensor, sink_key: tuple[torch.Tensor, torch.Tensor],
    sink_value: tuple[torch.Tensor, torch.Tensor], src_kind: torch.Tensor, src_index: torch.Tensor,
    src_sink: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, items: torch.Tensor,
    *, sink_rows: int, bits: int, group_size: int, tail_encoding: int, block_q: int, block_m: int, sm_scale: float,
    num_splits: int, tiles_per_split: int, block_n: int = 16,
) -> None:
    """Attention of the queries of ``items`` over their quantize-on-seal contexts, written into ``out`` (one launch,
    plus the flash-decoding merge when ``num_splits > 1``). Rows of ``out`` outside ``items`` are not written.

    Args:
        out: float32 ``[num_tokens, num_heads, head_dim]``, contiguous.
        q: float32 ``[num_tokens, num_heads, head_dim]``, contiguous.
        key: the pool's ``(codes, scale, zero)``: uint8 ``[num_blocks, block_size, kv_heads, P]``, uint8
            ``[num_blocks, kv_heads, head_dim]``, int8 likewise; contiguous.
        value: ``(codes, scale, zero)``: uint8 ``[num_blocks, block_size, kv_heads, P]``, uint8 and int8
            ``[num_blocks, block_size, kv_heads, G]``; ``None`` for a key-only layer (its values are its keys).
        tail_key, tail_value: ``[S * block_size, kv_heads, head_dim]`` 16-bit tail rows (float16, or bfloat16
            viewed as int16); a key-only layer passes its keys twice.
        sink_key, sink_value: ``(codes, scales)``: int8 codes as uint8 ``[K * sink_rows, kv_heads, head_dim]`` and
            float16 ``[K * sink_rows, kv_heads]`` of the first-block copies (slot ``s``: rows ``s * sink_rows ..``).
        src_kind: ``[B, W]`` uint8, src_index: ``[B, W]`` int64, src_sink: ``[B]`` int64
            (:mod:`kvpage.ops.backends.sealed_sources`).
        sink_rows: rows of the first block each copy holds (:func:`~kvpage.spec.sink_rows`, at least 1).
        seq_lens: ``[B]`` int32 context lengths after this step; query_start_loc: ``[B + 1]`` int32.
        items: ``[num_items, 2]`` int32 ``(request, first query)`` of each query tile (only kernel rows).
        bits: 4, 3 or 2; group_size: value channels per group (:func:`~kvpage.formats.kivi.value_group_size`).
        tail_encoding: ``ENC_BF16`` or ``ENC_F16`` (:mod:`.codes`).
        block_q, block_m, sm_scale, num_splits, tiles_per_split, block_n: as
            :func:`.paged_attention.paged_attention` (no window, no soft-cap: such layers take the SDPA path).

    Query ``j`` of a request with ``n`` new tokens and ``s`` in context reads positions ``<= s - n + j``; no
    position outside ``[0, s)`` is loaded.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = key[0].shape[2]
    group = num_heads // kv_heads
    vals = value if value is not None else key
    split = num_splits > 1
    if split:
        part = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:
        part, lse = out, out
    grid = (items.shape[0], kv_heads, num_splits)
    _sealed_attention_kernel[grid](
        part, lse, q, key[0], key[1], key[2], vals[0], vals[1], vals[2], tail_key, tail_value,
        sink_key[0], sink_key[1], sink_value[0], sink_value[1],
        src_kind, src_index, src_sink, seq_lens, query_start_loc, items,
        num_tokens, num_heads, kv_heads, head_dim, key[0].shape[1], src_kind.stride(0), sink_rows, sm_scale,
        tiles_per_split,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        BITS=bits, PACKED=key[0].shape[3], GROUPS=head_dim // group_size, GROUP_SIZE=group_size,
        TAIL_ENC=tail_encoding, HAS_VALUE=value is not None, SPLIT=split,
        num_warps=num_warps(block_m, head_dim),
    )
    if split:
        rows = num_tokens * num_heads
        _merge_splits_kernel[(triton.cdiv(rows, 16),)](out, part, lse, rows, head_dim, num_splits,
                                                       BLOCK_R=16, BLOCK_D=triton.next_power_of_2(head_dim))
