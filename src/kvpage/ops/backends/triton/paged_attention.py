"""The paged attention kernel: every query row of a step (decode rows and prefill-chunk runs) in one launch.

One program serves a tile of up to ``BLOCK_Q`` consecutive queries of one request and **all** query heads of
one kv head (GQA: ``BLOCK_Q * group`` rows share each key/value tile they load). It walks the request's
context ``BLOCK_N`` positions at a time, mapping each position through the block table to its slot, loads the
stored codes and scales and dequantizes them in registers, and folds the tile into an online softmax
(FlashAttention's running maximum and sum; FlashAttention-2's ordering, Dao 2023). Long contexts may be split
over a third grid axis whose partial results a second kernel merges by their log-sum-exp (flash-decoding,
Dao et al. 2023), as vLLM's paged attention v2 does. Imports triton; loaded lazily by
:mod:`kvpage.ops.backends.triton`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpage.ops.backends.triton.codes import dequantize
from kvpage.ops.backends.triton.step import num_warps
from kvpage.ops.backends.triton.tile import online_softmax_step, query_tile, store_tile


@triton.jit
def _load_rows(ptr, scale_ptr, chan_ptr, slot, kvh, kv_heads, head_dim, d, mask,
               ENC: tl.constexpr, SCALE: tl.constexpr):
    """Dequantized ``[BLOCK_N, BLOCK_D]`` float32 rows of kv head ``kvh`` at ``slot`` (0 where ``mask`` is off)."""
    row = slot * kv_heads + kvh                                                       # [BLOCK_N] int64
    dm = d < head_dim
    m2 = mask[:, None] & dm[None, :]
    codes = tl.load(ptr + row[:, None] * head_dim + d[None, :], mask=m2, other=0)
    if SCALE == 1:
        s = tl.load(scale_ptr + row, mask=mask, other=0.0).to(tl.float32)[:, None]
    elif SCALE == 2:
        s = tl.load(chan_ptr + kvh * head_dim + d, mask=dm, other=0.0)[None, :]
    else:
        s = 1.0
    return tl.where(m2, dequantize(codes, s, ENC), 0.0)


@triton.jit
def _paged_attention_kernel(
    out_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kc_ptr, vc_ptr,
    block_tables_ptr, seq_lens_ptr, qstart_ptr, items_ptr,
    num_tokens, num_heads, kv_heads, head_dim, block_size, bt_stride,
    sm_scale, softcap, window, tiles_per_split,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ENC: tl.constexpr, SCALE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, SPLIT: tl.constexpr,
):
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req, q0, seq_len, n, row_ok, qrow, qpos, d, dm, q = query_tile(
        q_ptr, items_ptr, seq_lens_ptr, qstart_ptr, num_heads, head_dim, GROUP, BLOCK_Q, BLOCK_M, BLOCK_D)
    # keys the tile's queries read: [lo, hi)
    first = seq_len - n + q0
    hi = seq_len - n + tl.minimum(q0 + BLOCK_Q, n)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    start = (lo // BLOCK_N) * BLOCK_N
    if SPLIT:
        start = start + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(hi, start + tiles_per_split * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s0 in range(start, hi, BLOCK_N):
        kpos = s0 + tl.arange(0, BLOCK_N)
        kmask = (kpos >= lo) & (kpos < hi)
        phys = tl.load(block_tables_ptr + req * bt_stride + kpos // block_size, mask=kmask, other=0)
        slot = phys.to(tl.int64) * block_size + kpos % block_size
        k = _load_rows(k_ptr, ks_ptr, kc_ptr, slot, kvh, kv_heads, head_dim, d, kmask, ENC, SCALE)
        v = _load_rows(v_ptr, vs_ptr, vc_ptr, slot, kvh, kv_heads, head_dim, d, kmask, ENC, SCALE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale                # [BLOCK_M, BLOCK_N]
        if HAS_CAP:
            # c * tanh(s / c), tanh from one exp: sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|})
            x = s / softcap
            e = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -th, th)
        ok = row_ok[:, None] & kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            ok = ok & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc)
    store_tile(out_ptr, lse_ptr, acc, m_i, l_i, qrow, row_ok, d, dm, num_tokens, num_heads, head_dim, SPLIT)


@triton.jit
def _merge_splits_kernel(out_ptr, part_ptr, lse_ptr, rows, head_dim, num_splits,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[row] = sum_s w_s part[s, row] / sum_s w_s, w_s = exp(lse_s - max_s lse_s): the flash-decoding merge,
    folded over the splits with a running maximum (BLOCK_R rows per program)."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = row < rows
    d = tl.arange(0, BLOCK_D)
    m2 = rm[:, None] & (d < head_dim)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    wsum = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for sp in range(num_splits):
        lse = tl.load(lse_ptr + sp * rows + row, mask=rm, other=float("-inf"))
        part = tl.load(part_ptr + (sp * rows + row)[:, None] * head_dim + d[None, :], mask=m2, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        wsum = wsum * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * part
        m = m_new
    o = acc / tl.where(wsum == 0.0, 1.0, wsum)[:, None]
    tl.store(out_ptr + row[:, None] * head_dim + d[None, :], o, mask=m2)


def paged_attention(
    out: torch.Tensor, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    key_scale: torch.Tensor | None, value_scale: torch.Tensor | None,
    key_channels: torch.Tensor | None, value_channels: torch.Tensor | None,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, items: torch.Tensor,
    *, block_q: int, block_m: int, encoding: int, scale_kind: int, sm_scale: float,
    sliding_window: int | None, logit_softcap: float | None, num_splits: int, tiles_per_split: int,
    block_n: int = 16,
) -> None:
    """Attention of every query of a step over its paged context, written into ``out`` (one launch, plus a merge
    launch when ``num_splits > 1``).

    Args:
        out: float32 ``[num_tokens, num_heads, head_dim]``, contiguous; every row of ``items`` is written.
        q: float32 ``[num_tokens, num_heads, head_dim]``, contiguous (rotated formats: already rotated).
        key, value: the layer's ``[num_blocks, block_size, kv_heads, head_dim]`` stored rows, contiguous:
            float32/float16, bfloat16 viewed as int16, or uint8 codes (a key-only layer passes its keys twice).
        key_scale, value_scale: float16 ``[num_blocks, block_size, kv_heads]`` per-token scales, or ``None``.
        key_channels, value_channels: float32 ``[kv_heads, head_dim]`` static scales, or ``None``.
        block_tables: ``[batch, max_blocks]`` int64, contiguous in its last dim.
        seq_lens: ``[batch]`` int32 context lengths after this step.
        query_start_loc: ``[batch + 1]`` int32 offsets of each request's queries in ``q``.
        items: ``[num_items, 2]`` int32 ``(request, first query)`` of each query tile (:mod:`.step`).
        block_q: queries per tile; ``block_m`` (a power of two ``>= block_q * group``) rows per program.
        encoding, scale_kind: the stored elements' code and scale source (:mod:`.codes`).
        sm_scale: softmax scale; sliding_window, logit_softcap: as in
            :class:`~kvpage.ops.layer_attention.LayerAttention`.
        num_splits: context splits per tile (flash-decoding); ``tiles_per_split`` ``block_n``-position tiles each.

    Semantics are :func:`kvpage.ops.attention.paged_attention`'s: query ``j`` of a request with ``n`` new tokens
    and ``s`` in context reads positions ``<= s - n + j`` (and ``> s - n + j - sliding_window``); no position
    outside that range is loaded, so stale or NaN slots never reach the output.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = key.shape[2]
    group = num_heads // kv_heads
    dummy_s = key_scale if key_scale is not None else q
    dummy_c = key_channels if key_channels is not None else q
    split = num_splits > 1
    if split:
        part = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    else:
        part, lse = out, out
    grid = (items.shape[0], kv_heads, num_splits)
    _paged_attention_kernel[grid](
        part, lse, q, key, value,
        dummy_s, value_scale if value_scale is not None else dummy_s,
        dummy_c, value_channels if value_channels is not None else dummy_c,
        block_tables, seq_lens, query_start_loc, items,
        num_tokens, num_heads, kv_heads, head_dim, key.shape[1], block_tables.stride(0),
        sm_scale, 1.0 if logit_softcap is None else logit_softcap,
        0 if sliding_window is None else sliding_window, tiles_per_split,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), ENC=encoding, SCALE=scale_kind,
        HAS_WINDOW=sliding_window is not None, HAS_CAP=logit_softcap is not None, SPLIT=split,
        num_warps=num_warps(block_m, head_dim),
    )
    if split:
        rows = num_tokens * num_heads
        _merge_splits_kernel[(triton.cdiv(rows, 16),)](out, part, lse, rows, head_dim, num_splits,
                                                       BLOCK_R=16, BLOCK_D=triton.next_power_of_2(head_dim))
