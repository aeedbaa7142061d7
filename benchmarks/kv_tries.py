"""Screening harness for accuracy ideas of the 4/3/2-bit KV formats (issue 34, items 1b, 1c, 1d): fake quantization.

Runs the bundled model (float32, loaded as ``kvpage eval`` loads it) over the first tokens of suite members
(:mod:`kvpage.eval.suite`) in ONE forward pass per text, with an attention function of its own in place of the
paged cache (the model's :class:`~kvpage.model.attention_fn.AttentionFn` contract: the engine is not involved and
nothing in ``src/`` changes). Per layer it reproduces the chunked-32 semantics of ``kvpage eval --suite --mode
chunked --chunk-size 32`` for the quantize-on-seal formats:

* a query reads its own 32-token block at full precision (rows rounded to the float16 tail dtype);
* every earlier block through the format's ``seal`` -> ``unseal`` (``seal_rotated``/``unseal_rotated`` in the
  stored basis for ``*_rotated``, whose q, k, v and output are rotated as the ops do), except block 0, read
  through the 8-bit first-block copy (``int8`` rows), and the window blocks (``int2``'s one 32-token block
  before the query's own), read as their float16 rows;
* a layer given ``int8`` reads every token per-token int8, ``auto`` reads float32 (the baseline everywhere).

Because every block depends on its own tokens only and attention is causal, one pass over all tokens equals the
suite's 32-token chunks up to float rounding of batched matmuls. Scores are :mod:`kvpage.eval.divergence`'s
(KLD against the unquantized run, Δppl, top-1), computed exactly as the suite computes them.

Variants beyond the real formats (all fake quantization, in this file only):

* **pre-RoPE keys** (KVQuant): keys are un-rotated to their pre-RoPE form, rounded to float16, sealed and
  unsealed, then RoPE is applied again to the dequantized keys (the first-block copy stays post-RoPE int8);
* **non-uniform codes**: the format's coding (same UE5M3 step byte, int8 offset, step search and candidates),
  but a code ``c`` decodes to ``(levels[c] + offset) * step`` with a per-format table ``levels`` (ascending,
  ``levels[0] = 0``, ``levels[-1] = 2**bits - 1``) instead of ``c``; tables fitted by Lloyd's algorithm on
  the tuning members' own K/V, normalized per group to its min/max range (:func:`fit_levels`);
* **per-layer precision**: any format per layer (``int8``/``int4``/``int3``/``int2``, rotated or not, ``auto``),
  a quantize-on-seal layer optionally with its own window (``kv_quant_residual_tokens``; ``int2`` without its
  32-token window is the only way below ``int2``'s bits, which the mix at ``int2``'s budget uses);
* **the first-block copy** at fewer bits or none (``<format>_sinkcopy<bits>``), of the keys only
  (``<format>_sinkcopyK``, block 0's values read sealed), or of block 0's first ``n`` rows (``<format>_sinkrows<n>``:
  block 0 sealed without them; ``<format>_sinkhead<n>``: sealed as it is, what the engine's ``sink_rows`` does);
  a format as it is copies :meth:`~kvpage.formats.BlockFormat.copied_rows` rows (the whole block costs 0.26 bits
  per value at 1,024 tokens).

Usage (one thread; the machine is shared)::

    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/kv_tries.py validate --out benchmarks/accuracy/tries
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/kv_tries.py sensitivity --out benchmarks/accuracy/tries
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/kv_tries.py screen --out benchmarks/accuracy/tries
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/kv_tries.py positions --formats bfloat16,int8,int4_rotated
    OMP_NUM_THREADS=1 nice .venv/bin/python benchmarks/kv_tries.py qcoding --formats int8,int8_rotated

``positions`` says where a format's KLD comes from per member (its top positions' share, the mean without them,
the median, how far the top positions' residual stream peaks above its layer's median: massive activations);
``bfloat16`` there is a 16-bit cache (the rounding floor any format sits on). ``qcoding`` scores token formats
with their queries coded for integer dot products (:data:`QUERY_CODES`: int16 per head as the CPU kernels' int8
path reads them, int8 per head or per 32 channels as llama.cpp's q8_0 x q8_0 path would). Each command writes
``<out>/<command>.json`` (rows: variant, member, bits, KLD, Δppl, top-1).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpage.eval.divergence import kl_divergence_rows, log_probs, summarize_divergence
from kvpage.formats import KEY, VALUE, get_format
from kvpage.formats.kivi import (
    OFFSET_MAX,
    OFFSET_MIN,
    SealedFormat,
    _covering_code,
    decode_scale,
    encode_scale,
    value_group_size,
)
from kvpage.formats.per_token import Int8Format

#: Tokens per block (the quantize-on-seal formats' preferred block size and the suite's chunk size).
BLOCK = 32
#: Tail dtype of the quantize-on-seal formats under a float32 model (:func:`kvpage.spec.kinds.tail_dtype`).
TAIL_DTYPE = torch.float16
#: The first-block (sink) copy's format (:data:`kvpage.cache.tail.pool.SINK_FORMAT`).
SINK = Int8Format()
#: Tuning members of the suite (never the held-back one here unless asked by name).
TUNING = ("gpl3", "argparse", "matplotlibrc", "torch_readme")
#: ``qcoding``'s query codings (:func:`code_queries`: ``(qmax, group)``; ``None``: float32 queries).
QUERY_CODES: dict[str, tuple[int, int] | None] = {
    "float32": None, "int16 per head": (32767, 0), "int8 per head": (127, 0), "int8 per 32 channels": (127, 32)}
#: Query rows per attention call (memory bound: scores are ``[H, rows, keys]`` float32).
QUERY_CHUNK = 256


# -- quantization pieces -------------------------------------------------------------------------------------


def rope_tables_of(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's ``(cos, sin_signed)`` RoPE tables ``[P, D]`` (one table: Llama-like families without local RoPE)."""
    return model.rope_cos, model.rope_sin


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) of ``x`` ``[T, Hkv, D]`` at ``positions`` ``[T]``: ``x * cos + roll(x, D/2) * sin_signed``,
    as :func:`kvpage.ops.fused.rope_split` computes it."""
    c, s = cos[positions].unsqueeze(1), sin_signed[positions].unsqueeze(1)    # [T, 1, D]
    return x * c + torch.roll(x, x.shape[-1] // 2, dims=-1) * s


def undo_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`apply_rope` (the rotation by minus the angle): ``x * cos - roll(x, D/2) * sin_signed``."""
    c, s = cos[positions].unsqueeze(1), sin_signed[positions].unsqueeze(1)    # [T, 1, D]
    return x * c - torch.roll(x, x.shape[-1] // 2, dims=-1) * s


def lut_fake_quant(x: torch.Tensor, dim: int, fmt: SealedFormat, levels: torch.Tensor | None) -> torch.Tensor:
    """``x`` coded and decoded as :func:`kvpage.formats.kivi.quantize_searched` codes it, with decode table ``levels``.

    The candidates are the format's (its ``step_search`` around the min/max step, centred and floor offsets, the
    covering step); a value's code is the nearest table entry in step units (``levels`` ``[2**bits]`` ascending,
    first 0, last ``2**bits - 1``; ``None``: the uniform grid, where this is the format's own rounding) and the
    candidate with the least squared error wins. Returns float32 ``x_hat`` shaped like ``x``. ``max_error``
    (``int4``'s) is honoured as the format honours it.
    """
    bits, qmax = fmt.bits, 2**fmt.bits - 1
    d = dim % x.dim()
    mn, mx = x.amin(d, keepdim=True), x.amax(d, keepdim=True)
    span = (mx - mn) / qmax
    e0 = encode_scale(span).to(torch.int32)
    cover = _covering_code(mn, mx, qmax).to(torch.int32)
    steps = list(fmt.step_search)
    ks = torch.tensor(steps, dtype=torch.int32).repeat_interleave(2)
    centred = torch.tensor([True, False] * len(steps) + [False])
    e = torch.cat([e0.unsqueeze(-1) + ks, cover.unsqueeze(-1)], -1)            # [..., C]
    st = decode_scale(e.clamp(0, 255).to(torch.uint8))
    lo, hi = mn.unsqueeze(-1), mx.unsqueeze(-1)
    m = torch.where(centred, torch.round((lo + hi) / (2 * st) - qmax / 2), torch.floor(lo / st))
    m = m.clamp_(OFFSET_MIN, OFFSET_MAX)
    xc = x.unsqueeze(-1)
    t = xc / st - m                                                            # [..., C] in step units
    if levels is None:
        val = torch.round(t).clamp_(0, qmax)
    else:
        mids = (levels[1:] + levels[:-1]) / 2
        val = levels[torch.bucketize(t.contiguous(), mids)]
    xh = (val + m) * st
    diff = xh - xc
    err = diff.double().square().sum(d, keepdim=True).float()
    if fmt.max_error is not None:
        limit = (fmt.max_error * span).unsqueeze(-1)
        worst = diff.abs().amax(d, keepdim=True)
        err = torch.where(worst <= limit, err, 1e30 * (1 + worst / limit.clamp(min=2.0**-16)))
    pick = err.argmin(-1, keepdim=True)
    return xh.gather(-1, pick.expand(*xh.shape[:-1], 1)).squeeze(-1)


def block_fake_quant(fmt: SealedFormat, blocks: torch.Tensor, kind: str, levels: torch.Tensor | None = None,
                     real: bool = True) -> torch.Tensor:
    """Sealed then unsealed ``blocks`` ``[m, bs, Hkv, D]`` (stored basis), float32.

    ``real`` with ``levels is None``: the format's own ``seal_rotated``/``unseal_rotated`` (its bytes, what the
    engine reads); otherwise :func:`lut_fake_quant` with the same grouping (keys per channel over the block,
    values per token in :func:`~kvpage.formats.kivi.value_group_size` channels).
    """
    if levels is None and real:
        return fmt.unseal_rotated(fmt.seal_rotated(blocks, kind), kind, torch.float32, blocks.shape[-1])
    x = blocks.float()
    if kind == KEY:
        return lut_fake_quant(x, 1, fmt, levels)
    d = x.shape[-1]
    g = value_group_size(d)
    return lut_fake_quant(x.unflatten(-1, (d // g, g)), -1, fmt, levels).flatten(-2)


def sink_fake_quant(rows: torch.Tensor, kind: str, bits: int = 8) -> torch.Tensor:
    """``rows`` ``[n, Hkv, D]`` through the first-block copy (quantize, dequantize), float32.

    ``bits`` 8: the engine's copy (:data:`SINK`, symmetric int8 per token and head); fewer: a try, asymmetric
    ``bits``-bit codes per token and head between its min and max, step and zero point in float16
    (:func:`sink_copy_bytes`)."""
    if bits == 8:
        q = SINK.quantize(rows, kind=kind)
        return SINK.dequantize(q.codes, q.scale, torch.float32, kind=kind)
    x = rows.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = ((hi - lo) / (2**bits - 1)).to(torch.float16).float().clamp(min=2.0**-24)
    zero = lo.to(torch.float16).float()
    return torch.round((x - zero) / step).clamp(0, 2**bits - 1) * step + zero


def sink_copy_bytes(bits: int, head_dim: int) -> float:
    """Bytes per (token, kv head) of K and V together in the first-block copy at ``bits`` (0: no copy): int8 codes
    and a float16 scale (8 bits, the engine's), or ``bits``-bit codes with a float16 step and zero point."""
    if bits == 0:
        return 0.0
    return 2 * (head_dim + 2) if bits == 8 else 2 * (head_dim * bits / 8 + 4)


# -- one layer's attention -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's cache is treated.

    Attributes:
        fmt: format name: ``auto`` (float32), ``int8`` (per-token int8 of every token), or a quantize-on-seal
            format (``int4``, ``int3_rotated``, ...).
        pre_rope: keys sealed before RoPE (re-applied to the dequantized keys).
        block_rope: keys sealed with RoPE of their block's first position only (each key rotated back by its offset
            in the block, re-rotated after): pre-RoPE's within-block channel statistics at one shared angle per
            block, so a read re-applies offsets 0..block_size-1 only (a query rotated per offset, not per key).
        key_levels, value_levels: non-uniform decode tables (``None``: the uniform grid).
        residual_tokens: full-precision window of a quantize-on-seal format in tokens (the engine's
            ``kv_quant_residual_tokens``); ``None``: the format's default (``int2``'s 32 tokens, 0 for the others).
        sink_copy_bits: the first-block copy of a format that keeps one: 8 (the engine's int8), 0 (none: block 0
            read sealed), or fewer bits (:func:`sink_fake_quant`).
        window_bits: the window copies (the blocks before the query's own that a format with a window reads
            unsealed): 16 (float16 tail rows), 8 (int8 rows as the first-block copy's) or ``None``, the engine's
            (:meth:`~kvpage.formats.BlockFormat.window_copy_bits`: 8 for ``int2``/``int2_rotated`` since 2026-12-06).
        sink_copy_values: whether the first-block copy holds the values too (``False``: keys only, block 0's values
            read sealed: values are grouped per token, so the sink token's outliers stretch no other token's range,
            while a key group spans the block's 32 tokens of one channel).
        sink_copy_tokens: how many of block 0's first tokens the copy holds (``None``: the format's own,
            :meth:`~kvpage.formats.BlockFormat.copied_rows`, block 0 sealed as it is): fewer than the block's,
            block 0 is sealed with those rows replaced by the first one after them (so they stretch no key group's
            range) and its other rows are read sealed.
        sink_rows_sealed: with ``sink_copy_tokens`` below the block's, block 0 is sealed as it is (the copied rows
            in its groups, so the sealed block stays readable on its own) instead of without them.
        query_code: a token format's query rows rounded as a kernel with integer dot products would code them
            (:func:`code_queries`): ``(qmax, group)``, ``qmax`` 32767 (int16, what the CPU kernels' int8 path does)
            or 127 (int8, llama.cpp's q8_0 x q8_0), one scale per ``group`` channels (0: per head); ``None``: float.
    """

    fmt: str = "auto"
    pre_rope: bool = False
    block_rope: bool = False
    key_levels: torch.Tensor | None = None
    value_levels: torch.Tensor | None = None
    residual_tokens: int | None = None
    sink_copy_bits: int = 8
    window_bits: int | None = None
    sink_copy_values: bool = True
    sink_copy_tokens: int | None = None
    sink_rows_sealed: bool = False
    query_code: tuple[int, int] | None = None


def fp_start_block(b: int, window: int, sink: bool) -> int:
    """First block a query in block ``b`` reads at full precision (its own, and the window blocks before it,
    block 0 excepted when a first-block copy exists): blocks before it are read sealed."""
    if b == 0:
        return 0
    return max(b - window, 1 if sink else 0)


def sealed_layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           plan: LayerPlan, scale: float | None, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Attention of one layer, one sequence (positions ``0..T-1``), with ``plan.fmt`` a quantize-on-seal format.

    ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, Hkv, D]`` float32 (RoPE applied); returns ``[T, H, D]`` float32.
    """
    from kvpage.ops.causal import masked_attention
    from kvpage.ops.layer_attention import LayerAttention

    fmt = get_format(plan.fmt)
    assert isinstance(fmt, SealedFormat)
    T, D = q.shape[0], q.shape[-1]
    rot = fmt.rotation(D, torch.float32, "cpu") is not None
    to_basis: Callable[[torch.Tensor], torch.Tensor] = fmt.to_stored_basis if rot else (lambda x: x)
    qs, ks, vs = to_basis(q), to_basis(k), to_basis(v)
    k16, v16 = ks.to(TAIL_DTYPE).float(), vs.to(TAIL_DTYPE).float()           # [T, Hkv, D] tail rows
    nf = T // BLOCK
    k_hat, v_hat = k16.clone(), v16.clone()
    if nf:
        n = nf * BLOCK
        own = plan.sink_copy_tokens is None
        n_copy = fmt.copied_rows(BLOCK) if own else plan.sink_copy_tokens
        if not (fmt.sink_bits and plan.sink_copy_bits):
            n_copy = BLOCK
        assert n_copy is not None
        if n_copy < BLOCK and not (own or plan.sink_rows_sealed):  # block 0 sealed without the copied rows
            k16s, v16s = k16.clone(), v16.clone()
            k16s[:n_copy], v16s[:n_copy] = k16[n_copy], v16[n_copy]
        else:
            k16s, v16s = k16, v16
        vb = v16s[:n].view(nf, BLOCK, *v16.shape[1:])
        v_hat[:n] = block_fake_quant(fmt, vb, VALUE, plan.value_levels).flatten(0, 1)
        if plan.pre_rope or plan.block_rope:
            at = positions % BLOCK if plan.block_rope else positions             # the angle taken off, re-applied
            pre = to_basis(undo_rope(k, at, *rope)).to(TAIL_DTYPE).float()[:n]
            deq = block_fake_quant(fmt, pre.view(nf, BLOCK, *pre.shape[1:]), KEY, plan.key_levels).flatten(0, 1)
            back = fmt.to_stored_basis(deq) if rot else deq
            k_hat[:n] = to_basis(apply_rope(back, at[:n], *rope))
        else:
            kb = k16s[:n].view(nf, BLOCK, *k16.shape[1:])
            k_hat[:n] = block_fake_quant(fmt, kb, KEY, plan.key_levels).flatten(0, 1)
        if fmt.sink_bits and plan.sink_copy_bits:
            k_hat[:n_copy] = sink_fake_quant(k16[:n_copy], KEY, plan.sink_copy_bits)
            if plan.sink_copy_values:
                v_hat[:n_copy] = sink_fake_quant(v16[:n_copy], VALUE, plan.sink_copy_bits)
    residual = fmt.default_residual_tokens if plan.residual_tokens is None else plan.residual_tokens
    window = math.ceil(residual / BLOCK)
    window_bits = fmt.window_copy_bits(BLOCK) if plan.window_bits is None else plan.window_bits
    if window_bits != 16:
        k_win, v_win = sink_fake_quant(k16, KEY, window_bits), sink_fake_quant(v16, VALUE, window_bits)
    sink = bool(fmt.sink_bits and plan.sink_copy_bits)
    params = LayerAttention(scale=scale)
    out = torch.empty_like(qs)
    blk = torch.arange(T) // BLOCK                                             # [T] block of each row
    for s in range(0, T, QUERY_CHUNK):
        e = min(T, s + QUERY_CHUNK)
        fs = fp_start_block(s // BLOCK, window, sink) * BLOCK                  # full-precision rows read from here
        qi = torch.arange(s, e)
        lo = torch.tensor([fp_start_block(int(b), window, sink) for b in blk[s:e]])  # [n]
        j_hat = torch.arange(0, e)
        j_fp = torch.arange(fs, e)
        m_hat = blk[j_hat][None, :] < lo[:, None]                              # [n, e]
        m_fp = (blk[j_fp][None, :] >= lo[:, None]) & (j_fp[None, :] <= qi[:, None])  # [n, e - fs]
        if window_bits == 16:
            keys = torch.cat([k_hat[:e], k16[fs:e]])
            vals = torch.cat([v_hat[:e], v16[fs:e]])
            out[s:e] = masked_attention(qs[s:e], keys, vals, torch.cat([m_hat, m_fp], 1), params)
        else:  # the window blocks (before the query's own) through int8 rows, the own block at 16 bits
            own = blk[j_fp][None, :] == blk[qi][:, None]                       # [n, e - fs]
            keys = torch.cat([k_hat[:e], k_win[fs:e], k16[fs:e]])
            vals = torch.cat([v_hat[:e], v_win[fs:e], v16[fs:e]])
            out[s:e] = masked_attention(qs[s:e], keys, vals, torch.cat([m_hat, m_fp & ~own, m_fp & own], 1),
                                        params)
    return to_basis(out) if rot else out


def is_sealed(fmt: str) -> bool:
    """Whether ``fmt`` is a quantize-on-seal format (``auto``: no, the float32 baseline)."""
    return fmt != "auto" and isinstance(get_format(fmt), SealedFormat)


def code_queries(q: torch.Tensor, qmax: int, group: int, fmt: str) -> torch.Tensor:
    """Query rows ``q`` ``[T, H, D]`` float32 as an integer-dot kernel reads them: in ``fmt``'s stored basis (the
    Hadamard basis for a rotated format), each run of ``group`` channels (0: the whole head) scaled so its largest
    magnitude is ``qmax``, rounded to integers and scaled back, then returned to the original basis (the rotation is
    orthonormal, so scores against keys in either basis are those of the coded query)."""
    f = get_format(fmt)
    T, H, D = q.shape
    rot = f.rotation(D, torch.float32, "cpu")
    x = q @ rot if rot is not None else q
    g = group or D
    y = x.reshape(T, H, D // g, g)
    step = y.abs().amax(-1, keepdim=True) / qmax
    step = torch.where(step > 0, step, torch.ones_like(step))
    x = (torch.round(y / step) * step).reshape(T, H, D)
    return x @ rot.T if rot is not None else x


def token_layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str,
                          scale: float | None, query_code: tuple[int, int] | None = None) -> torch.Tensor:
    """Causal attention with every token's K/V as ``fmt`` stores it (``auto``: float32 as given; a token-wise format:
    ``int8``, ``bfloat16``, ...), the queries coded as :func:`code_queries` codes them when ``query_code`` is
    ``(qmax, group)``."""
    import torch.nn.functional as F

    if fmt != "auto":
        f = get_format(fmt)
        qk, qv = f.quantize(k, kind=KEY), f.quantize(v, kind=VALUE)
        k = f.dequantize(qk.codes, qk.scale, torch.float32, kind=KEY)
        v = f.dequantize(qv.codes, qv.scale, torch.float32, kind=VALUE)
        if query_code is not None:
            q = code_queries(q.float(), *query_code, fmt)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def layer_bits(fmt: str, num_tokens: int = 1024, residual_tokens: int | None = None, sink_copy_bits: int = 8,
               window_bits: int | None = None, sink_copy_values: bool = True, sink_copy_tokens: int | None = None
               ) -> float:
    """Effective bits per value of one SmolLM2 layer in ``fmt`` at ``num_tokens`` tokens (``auto``: 16, a 16-bit
    cache; a sealed format counts its window (``residual_tokens``, ``None``: the format's default) and first-block
    copy, as ``kvpage eval`` does; a copy at ``sink_copy_bits`` other than 8 is counted by
    :func:`sink_copy_bytes` instead of the engine's int8 one, half of them without ``sink_copy_values``; window
    copies at ``window_bits``, ``None`` the format's own, as the engine counts them)."""
    if fmt == "auto":
        return 16.0
    f = get_format(fmt)
    if isinstance(f, SealedFormat):
        residual = f.default_residual_tokens if residual_tokens is None else residual_tokens
        bits = f.effective_bits_per_value(num_tokens=num_tokens, block_size=BLOCK, kv_heads=3, head_dim=64,
                                          residual_tokens=residual, window_bits=window_bits)
        own = f.copied_rows(BLOCK)                                              # rows the format's copy holds
        tokens = own if sink_copy_tokens is None else sink_copy_tokens
        if f.sink_bits and num_tokens >= BLOCK and (sink_copy_bits != 8 or not sink_copy_values or tokens != own):
            per_value = 8 * BLOCK * 3 / (2 * num_tokens * 3 * 64)               # bits per value per copied byte
            kept = sink_copy_bytes(sink_copy_bits, 64) * (1.0 if sink_copy_values else 0.5) * tokens / BLOCK
            bits += (kept - sink_copy_bytes(8, 64) * own / BLOCK) * per_value   # swap the int8 copy's bytes
        return bits
    return f.effective_bits_per_value(num_tokens=num_tokens, block_size=16, kv_heads=3, head_dim=64)


# -- running a variant -------------------------------------------------------------------------------------------


@dataclass
class Variant:
    """A try: one :class:`LayerPlan` per layer (``plans``), named for the tables."""

    name: str
    plans: list[LayerPlan]
    note: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def bits(self, num_tokens: int = 1024) -> float:
        """Mean effective bits per value over the layers at ``num_tokens`` tokens (:func:`layer_bits`)."""
        return float(np.mean([layer_bits(p.fmt, num_tokens, p.residual_tokens, p.sink_copy_bits, p.window_bits,
                                         p.sink_copy_values, p.sink_copy_tokens) for p in self.plans]))


def uniform(name: str, fmt: str, layers: int = 30, **kw: Any) -> Variant:
    """Every layer ``fmt`` with the same :class:`LayerPlan` options ``kw``."""
    return Variant(name, [LayerPlan(fmt=fmt, **kw) for _ in range(layers)])


class Runner:
    """The loaded model, members' token ids and their baseline logits; runs variants and scores them."""

    def __init__(self, members: Sequence[str], tokens: dict[str, int] | None = None) -> None:
        from kvpage.eval.suite import SUITE, member_token_ids, resolve_member
        from kvpage.model.loader import load_model

        self.loaded = load_model(None, dtype=torch.float32, progress=False)
        self.model = self.loaded.model
        self.num_layers = len(self.model.layers)
        self.ids: dict[str, list[int]] = {}
        by_name = {m.name: m for m in SUITE}
        for name in members:
            r = resolve_member(by_name[name])
            n = (tokens or {}).get(name, by_name[name].tokens)
            self.ids[name] = member_token_ids(self.loaded.tokenizer, r, n)
        self.base: dict[str, torch.Tensor] = {}
        self.norms: dict[str, torch.Tensor] = {}
        self.capture: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def hidden(self, member: str, plans: Sequence[LayerPlan] | None) -> torch.Tensor:
        """Final hidden states ``[T, E]`` of the member's first ``n - 1`` tokens under ``plans`` (``None``:
        float32 everywhere)."""
        ids = torch.tensor(self.ids[member][:-1], dtype=torch.long)
        pos = torch.arange(ids.numel())
        rope = rope_tables_of(self.model)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
            assert v is not None
            if self.capture is not None:
                self.capture(layer, k, v, pos)
            scale = self.model.attention_params(layer).scale
            plan = LayerPlan() if plans is None else plans[layer]
            if not is_sealed(plan.fmt):
                return token_layer_attention(q, k, v, plan.fmt, scale, plan.query_code)
            return sealed_layer_attention(q, k, v, pos, plan, scale, rope)

        with torch.inference_mode():
            return self.model(ids, pos, attn)

    def residual_norms(self, member: str) -> torch.Tensor:
        """Norms of the residual stream after each decoder layer over the member's positions, unquantized run:
        ``[layers, n - 1]`` float32 (massive activations show as positions many times a layer's median)."""
        if member in self.norms:
            return self.norms[member]
        norms: dict[int, torch.Tensor] = {}

        def hook(i: int) -> Callable[..., None]:
            def record(module: Any, args: Any, out: Any) -> None:
                norms[i] = (out[0] if isinstance(out, tuple) else out).detach().float().norm(dim=-1).flatten()
            return record

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.model.layers)]
        try:
            self.hidden(member, None)
        finally:
            for h in handles:
                h.remove()
        self.norms[member] = torch.stack([norms[i] for i in range(self.num_layers)])
        return self.norms[member]

    def logits_chunks(self, h: torch.Tensor, rows: int = 256) -> list[torch.Tensor]:
        """``compute_logits`` of ``h`` in chunks of ``rows`` (float32 ``[rows, V]`` each)."""
        with torch.inference_mode():
            return [self.model.compute_logits(h[a:a + rows]) for a in range(0, h.shape[0], rows)]

    def baseline(self, member: str) -> torch.Tensor:
        """The member's float32 logits ``[n - 1, V]`` with the unquantized cache (computed once)."""
        if member not in self.base:
            self.base[member] = torch.cat(self.logits_chunks(self.hidden(member, None)))
        return self.base[member]

    def rows(self, variant: Variant, member: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per predicted position of ``member`` under ``variant``: KLD against the baseline (nats), whether the
        top-1 token agrees, the variant's and the baseline's NLL of the next token; ``[n - 1]`` arrays each."""
        base = self.baseline(member)
        tgt = torch.tensor(self.ids[member][1:], dtype=torch.long)
        kld, same, nll_f, nll_b = [], [], [], []
        a = 0
        for lg in self.logits_chunks(self.hidden(member, variant.plans)):
            b = a + lg.shape[0]
            lp, lb = log_probs(lg), log_probs(base[a:b])
            kld.append(kl_divergence_rows(lb, lp).numpy())
            same.append((lg.argmax(-1) == base[a:b].argmax(-1)).numpy())
            nll_f.append((-lp.gather(1, tgt[a:b, None])[:, 0]).numpy())
            nll_b.append((-lb.gather(1, tgt[a:b, None])[:, 0]).numpy())
            a = b
        return np.concatenate(kld), np.concatenate(same), np.concatenate(nll_f), np.concatenate(nll_b)

    def score(self, variant: Variant, member: str) -> dict[str, Any]:
        """KLD / Δppl / top-1 of ``variant`` on ``member`` against its baseline, as the suite computes them."""
        start = time.perf_counter()
        ids = self.ids[member]
        d = summarize_divergence(*self.rows(variant, member))
        row = dict(variant=variant.name, member=member, num_tokens=len(ids), bits_1024=round(variant.bits(), 4),
                   kld=d.kld_mean, kld_se=d.kld_se, delta_ppl_percent=100 * math.expm1(d.ln_ppl_ratio),
                   delta_ppl_se_percent=d.delta_ppl_se_percent, top1_percent=d.top1_percent,
                   seconds=round(time.perf_counter() - start, 1), note=variant.note, **variant.meta)
        if d.depth is not None and d.depth.rest is not None:
            f = d.depth.first
            row.update(first1024_kld=f.kld_mean, first1024_delta_ppl_percent=f.delta_ppl_percent)
        return row


# -- code tables ---------------------------------------------------------------------------------------------------


def normalized_groups(x: torch.Tensor, kind: str, qmax: int) -> torch.Tensor:
    """Rows ``x`` ``[T, Hkv, D]`` (T a multiple of the block) as the format groups them, each mapped onto
    ``[0, qmax]`` by its own min/max; flat float32."""
    if kind == KEY:
        g = x.view(-1, BLOCK, *x.shape[1:])                                    # [nb, bs, Hkv, D]: group over dim 1
        mn, mx = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    else:
        d = x.shape[-1]
        g = x.unflatten(-1, (d // value_group_size(d), value_group_size(d)))
        mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    return ((g - mn) / (mx - mn).clamp(min=1e-12) * qmax).flatten()


def fit_levels(u: torch.Tensor, bits: int, iters: int = 40) -> torch.Tensor:
    """Lloyd's algorithm on samples ``u`` in ``[0, 2**bits - 1]`` with the two end levels fixed at 0 and ``qmax``
    (so a group's extremes, which attention leans on, stay exact): ``[2**bits]`` ascending float32 levels."""
    qmax = 2**bits - 1
    lev = torch.arange(qmax + 1, dtype=torch.float64)
    u = u.double()
    for _ in range(iters):
        idx = torch.bucketize(u, (lev[1:] + lev[:-1]) / 2)
        sums = torch.zeros_like(lev).index_add_(0, idx, u)
        cnt = torch.zeros_like(lev).index_add_(0, idx, torch.ones_like(u))
        new = torch.where(cnt > 0, sums / cnt.clamp(min=1), lev)
        new[0], new[-1] = 0.0, float(qmax)
        lev = new.sort().values
    return lev.float()


def collect_levels(runner: Runner, members: Sequence[str], fmts: Sequence[str], tokens: int, pre_rope: bool = False,
                   samples: int = 2_000_000) -> dict[str, dict[str, list[float]]]:
    """Fit decode tables (:func:`fit_levels`) for keys and values of each format in ``fmts`` on the baseline K/V
    of ``members``' first ``tokens`` tokens (in each format's stored basis; keys pre-RoPE with ``pre_rope``).

    Returns ``{fmt: {"key": levels, "value": levels}}``.
    """
    got: dict[str, dict[str, list[torch.Tensor]]] = {f: {KEY: [], VALUE: []} for f in fmts}
    rope = rope_tables_of(runner.model)

    def capture(layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        n = (min(k.shape[0], tokens) // BLOCK) * BLOCK
        kk = undo_rope(k, pos, *rope) if pre_rope else k
        for f in fmts:
            fmt = get_format(f)
            rot = fmt.rotation(k.shape[-1], torch.float32, "cpu") is not None
            tb = fmt.to_stored_basis if rot else (lambda x: x)
            qmax = 2**fmt.bits - 1
            got[f][KEY].append(normalized_groups(tb(kk[:n]).to(TAIL_DTYPE).float(), KEY, qmax))
            got[f][VALUE].append(normalized_groups(tb(v[:n]).to(TAIL_DTYPE).float(), VALUE, qmax))

    runner.capture = capture
    try:
        for m in members:
            runner.hidden(m, None)
    finally:
        runner.capture = None
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, list[float]]] = {}
    for f in fmts:
        out[f] = {}
        for kind in (KEY, VALUE):
            u = torch.cat(got[f][kind])
            u = u[torch.randperm(u.numel(), generator=gen)[:samples]]
            out[f][kind] = [round(float(x), 4) for x in fit_levels(u, get_format(f).bits)]
    return out


# -- commands ----------------------------------------------------------------------------------------------------


def _suite_rows(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    """``(format, member) -> {kld, dppl, first1024_kld, first1024_dppl}`` from a ``kvpage eval --suite`` results.json."""
    data = json.loads(path.read_text())
    out: dict[tuple[str, str], dict[str, float]] = {}
    for m in data["members"]:
        for r in m["results"]:
            d = r["divergence"]
            row = dict(kld=d["kld_mean"], dppl=100 * math.expm1(d["ln_ppl_ratio"]))
            depth = d.get("depth") or {}
            if depth.get("rest"):
                row.update(first1024_kld=depth["first"]["kld_mean"],
                           first1024_dppl=depth["first"]["delta_ppl_percent"])
            out[(r["name"], m["name"])] = row
    return out


def _print_row(r: dict[str, Any]) -> None:
    print(f"{r['variant']:<34} {r['member']:<13} bits {r['bits_1024']:.3f}  KLD {r['kld']:.5f}  "
          f"dppl {r['delta_ppl_percent']:+.2f}%  top1 {r['top1_percent']:.2f}  ({r['seconds']} s)", flush=True)


def _save(out: Path, name: str, payload: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``validate``, ``sensitivity``, ``fit``, ``screen``, ``positions``, ``qcoding`` (module
    docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=["validate", "sensitivity", "fit", "screen", "positions", "qcoding"])
    p.add_argument("--members", default=",".join(TUNING))
    p.add_argument("--tokens", default="argparse=2048", help="member=N,... (first N tokens of those members)")
    p.add_argument("--formats", default="int4,int3,int2,int4_rotated", help="validate/screen: base formats")
    p.add_argument("--variants", default=None, help="screen: comma-separated variant names (default all)")
    p.add_argument("--suite-json", default="benchmarks/accuracy/suite/results.json")
    p.add_argument("--sens-bits", default="int2", help="sensitivity: the format of the one quantized layer")
    p.add_argument("--out", default="benchmarks/accuracy/tries")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    members = [m for m in args.members.split(",") if m]
    tokens = {k: int(v) for k, v in (kv.split("=") for kv in args.tokens.split(",") if kv)}
    out = Path(args.out)
    runner = Runner(members, tokens)
    cmd = " ".join(["benchmarks/kv_tries.py", *(argv if argv is not None else sys.argv[1:])])
    rows: list[dict[str, Any]] = []
    payload: dict[str, Any] = dict(command=cmd, torch=torch.__version__, threads=1,
                                   tokens={m: len(runner.ids[m]) for m in members}, rows=rows)
    L = runner.num_layers
    if args.command == "validate":
        suite = _suite_rows(Path(args.suite_json))
        for f in args.formats.split(","):
            for m in members:
                r = runner.score(uniform(f, f, L), m)
                s = suite.get((f, m), {})
                if len(runner.ids[m]) == 4096 or "first1024_kld" not in s:
                    r.update(suite_kld=s.get("kld"), suite_delta_ppl_percent=s.get("dppl"))
                else:  # a shortened long member: its first 1,024 scored positions are the suite's depth split
                    r.update(suite_first1024_kld=s.get("first1024_kld"),
                             suite_first1024_delta_ppl_percent=s.get("first1024_dppl"))
                rows.append(r)
                _print_row(r)
                print(f"    suite: {json.dumps({k: v for k, v in r.items() if k.startswith('suite') or k.startswith('first')})}")
                _save(out, "validate", payload)
        return 0
    if args.command == "sensitivity":
        for layer in range(L):
            plans = [LayerPlan() for _ in range(L)]
            plans[layer] = LayerPlan(fmt=args.sens_bits)
            v = Variant(f"layer{layer}_{args.sens_bits}", plans, meta=dict(layer=layer))
            for m in members:
                r = runner.score(v, m)
                rows.append(r)
                _print_row(r)
            _save(out, f"sensitivity_{args.sens_bits}", payload)
        return 0
    if args.command == "fit":
        fmts = args.formats.split(",")
        payload["levels"] = collect_levels(runner, members, fmts, tokens=1024)
        payload["levels_pre_rope"] = collect_levels(runner, members, fmts, tokens=1024, pre_rope=True)
        _save(out, "levels", payload)
        print(json.dumps(payload["levels"], indent=1))
        return 0
    if args.command == "positions":
        for f in args.formats.split(","):
            for m in members:
                r = positions_row(runner, uniform(f, f, L), m)
                rows.append(r)
                print(f"{f:<14} {m:<13} KLD {r['kld']:.5f}  top-3 positions {r['top3_share']:.0%} of it  "
                      f"without them {r['kld_without_top3']:.5f}  median {r['kld_median']:.6f}  positions with a "
                      f"residual > 3x the median: {r['positions_over_3x_median']} ({r['massive_share']:.0%} of the "
                      f"KLD; without them {r['kld_without_massive']:.5f})  top (position, KLD, residual x "
                      f"median): {[(t['position'], round(t['kld'], 2), t['residual_x_median']) for t in r['top']]}",
                      flush=True)
                _save(out, "positions", payload)
        return 0
    if args.command == "qcoding":
        for f in args.formats.split(","):
            for label, code in QUERY_CODES.items():
                v = uniform(f"{f}, q {label}", f, L, query_code=code)
                for m in members:
                    r = runner.score(v, m)
                    rows.append(r)
                    _print_row(r)
                    _save(out, "qcoding", payload)
        return 0
    variants = build_variants(out, L, args.formats.split(","))
    wanted = None if args.variants is None else set(args.variants.split(","))
    name = "screen" if wanted is None else "screen_" + "_".join(sorted(wanted))[:80]
    for v in variants:
        if wanted is not None and v.name not in wanted:
            continue
        for m in members:
            r = runner.score(v, m)
            rows.append(r)
            _print_row(r)
            _save(out, name, payload)
    return 0


def positions_row(runner: Runner, variant: Variant, member: str, top: int = 5) -> dict[str, Any]:
    """Where ``variant``'s KLD on ``member`` comes from: its mean, median, the share of the top 3 positions and the
    mean without them; the same for the positions whose residual stream (unquantized run) peaks above 3x its
    layer's median at some layer (massive activations, Sun et al. 2024); and the ``top`` positions (index of the
    predicted token's context end, KLD, the last context tokens and the next one decoded, the residual's peak
    over the median and the layer of the peak)."""
    kld = runner.rows(variant, member)[0].astype(np.float64)
    order = np.argsort(-kld)
    ids, tok = runner.ids[member], runner.loaded.tokenizer
    rest = np.delete(kld, order[:3])
    ratio = runner.residual_norms(member)
    ratio = ratio / ratio.median(dim=1, keepdim=True).values                   # [layers, n - 1] x the layer's median
    massive = (ratio.amax(0) > 3).numpy()                                       # [n - 1] massive-activation positions
    return dict(variant=variant.name, member=member, kld=float(kld.mean()), kld_median=float(np.median(kld)),
                top3_share=float(kld[order[:3]].sum() / max(kld.sum(), 1e-30)), kld_without_top3=float(rest.mean()),
                top=[dict(position=int(t), kld=float(kld[t]), context=tok.decode(ids[max(0, t - 3):t + 1]),
                          next=tok.decode([ids[t + 1]]), residual_x_median=round(float(ratio[:, t].max()), 2),
                          at_layer=int(ratio[:, t].argmax())) for t in order[:top]],
                positions_over_3x_median=int(massive.sum()),
                massive_share=float(kld[massive].sum() / max(kld.sum(), 1e-30)),
                kld_without_massive=float(kld[~massive].mean()))


def mix(base: str, order: Sequence[int], top: tuple[int, LayerPlan] = (0, LayerPlan()),
        bottom: tuple[int, LayerPlan] = (0, LayerPlan())) -> list[LayerPlan]:
    """Per-layer plans: every layer ``base``, but the first ``top[0]`` layers of ``order`` (most sensitive first)
    planned as ``top[1]`` and the last ``bottom[0]`` as ``bottom[1]``. ``order`` holds every layer once."""
    plans = [LayerPlan(fmt=base) for _ in order]
    for i in order[:top[0]]:
        plans[i] = top[1]
    for i in order[len(order) - bottom[0]:]:
        plans[i] = bottom[1]
    return plans


def build_variants(out: Path, layers: int, fmts: Sequence[str]) -> list[Variant]:
    """The tries of ``screen``: non-uniform codes (tables from ``<out>/levels.json``), pre-RoPE keys and per-layer
    mixes (ranked by ``<out>/sensitivity_int2.json``), for the base formats ``fmts`` where they apply."""
    vs: list[Variant] = [uniform(f, f, layers) for f in fmts]                 # the formats as they are
    lev_path = out / "levels.json"
    if lev_path.exists():
        lev = json.loads(lev_path.read_text())
        for f in fmts:
            for key in ("levels", "levels_pre_rope"):
                if f not in lev.get(key, {}):
                    continue
                kl = torch.tensor(lev[key][f][KEY])
                vl = torch.tensor(lev[key][f][VALUE])
                pre = key == "levels_pre_rope"
                tag = "_prerope" if pre else ""
                if not pre:
                    vs.append(uniform(f"{f}_lut_v", f, layers, value_levels=vl))
                    vs.append(uniform(f"{f}_lut_k", f, layers, key_levels=kl))
                vs.append(uniform(f"{f}{tag}_lut_kv", f, layers, key_levels=kl, value_levels=vl, pre_rope=pre))
    for f in fmts:
        vs.append(uniform(f"{f}_prerope", f, layers, pre_rope=True))
        vs.append(uniform(f"{f}_blockrope", f, layers, block_rope=True))
    for f in fmts:  # the first-block copy: without it, and at 6 and 4 bits (what the 1,024-token bit floors cost)
        if getattr(get_format(f), "sink_bits", 0):
            vs += [uniform(f"{f}_sinkcopy{b}", f, layers, sink_copy_bits=b) for b in (0, 6, 4)]
            vs.append(uniform(f"{f}_sinkcopyK", f, layers, sink_copy_values=False))  # keys only, int8
            vs += [uniform(f"{f}_sinkrows{t}", f, layers, sink_copy_tokens=t) for t in (1, 2, 4, 8)]
            vs += [uniform(f"{f}_sinkhead{t}", f, layers, sink_copy_tokens=t, sink_rows_sealed=True)
                   for t in (1, 2, 4, 8, 16)]  # the first rows copied, block 0 sealed as it is
        if getattr(get_format(f), "default_residual_tokens", 0):  # a window: its copies as int8 or 16-bit rows
            vs += [uniform(f"{f}_window{b}", f, layers, window_bits=b) for b in (8, 16)]
    sens = out / "sensitivity_int2.json"
    if sens.exists():
        rows = json.loads(sens.read_text())["rows"]
        per = {}
        for r in rows:
            per.setdefault(r["layer"], []).append(r["kld"])
        order = sorted(per, key=lambda i: -float(np.mean(per[i])))            # most sensitive first
        for suffix in ("", "_rotated"):
            i4, i3, i2, i8 = (f"int4{suffix}", f"int3{suffix}", f"int2{suffix}", f"int8{suffix}")
            no_window = LayerPlan(fmt=i2, residual_tokens=0)
            meta = dict(order=order)
            # int3's budget: the 5 most sensitive layers int4 (+1 bit each at 1,024 tokens), the 10 least int2
            # (-0.5 each, window included), the rest int3
            vs.append(Variant(f"mix_int3budget{suffix}", mix(i3, order, top=(5, LayerPlan(fmt=i4)),
                                                             bottom=(10, LayerPlan(fmt=i2))), meta=meta))
            # int4's budget: the 2 most sensitive layers 8-bit (+3.6 bits each), the 8 least int3 (-1 each)
            vs.append(Variant(f"mix_int4budget{suffix}", mix(i4, order, top=(2, LayerPlan(fmt=i8)),
                                                             bottom=(8, LayerPlan(fmt=i3))), meta=meta))
            # TurboQuant's preset: first and last layers 8-bit, the rest int3
            plans = mix(i3, order)
            plans[0] = plans[-1] = LayerPlan(fmt="int8")
            vs.append(Variant(f"firstlast8_int3{suffix}", plans))
            # int2's budget: nothing is below int2, but its 32-token float16 window costs about as much as int3
            # over int2 (0.5 bits at 1,024 tokens): the 10 most sensitive layers int3, the 10 least int2 without
            # the window (kv_quant_residual_tokens=0), the rest int2 as it is
            vs.append(Variant(f"mix_int2budget{suffix}", mix(i2, order, top=(10, LayerPlan(fmt=i3)),
                                                             bottom=(10, no_window)), meta=meta))
            # the same with 5 and 5; and the window cut alone on the 10 least sensitive layers (what it costs)
            vs.append(Variant(f"mix5_int2budget{suffix}", mix(i2, order, top=(5, LayerPlan(fmt=i3)),
                                                              bottom=(5, no_window)), meta=meta))
            vs.append(Variant(f"nowindow10_int2{suffix}", mix(i2, order, bottom=(10, no_window)), meta=meta))
    return vs


if __name__ == "__main__":
    raise SystemExit(main())
