"""The fused write: quantize a step's new key or value rows and store codes and scales in their slots.

Each program codes a tile of (new token, kv head) rows, each row on its own (as vLLM's ``reshape_and_cache``
kernels do per token), with the
arithmetic of :class:`~kvpage.formats.per_token.PerTokenFormat` (dynamic per-row scale) or of
:class:`~kvpage.formats.static.StaticScaleFormat` (calibrated per-channel scale). Imports triton; loaded
lazily by :mod:`kvpage.ops.backends.triton`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpage.ops.backends.triton.codes import encode_e4m3, encode_int8

#: (token, kv head) rows one program codes.
ROWS_PER_PROGRAM = 16


@triton.jit
def _write_rows_kernel(
    x_ptr, slots_ptr, codes_ptr, scales_ptr, chan_ptr,
    num_rows, kv_heads, head_dim, qmax, limit,
    ENC: tl.constexpr, SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # rows are (token, kv head) pairs, BLOCK_R of them per program, each coded on its own
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < num_rows
    h = r % kv_heads
    slot = tl.load(slots_ptr + r // kv_heads, mask=rm, other=0).to(tl.int64)
    dst = slot * kv_heads + h                                                        # [BLOCK_R] row of the pool
    d = tl.arange(0, BLOCK_D)
    m2 = rm[:, None] & (d < head_dim)[None, :]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * head_dim + d[None, :], mask=m2, other=0.0)
    if SCALE == 1:
        # PerTokenFormat.quantize: clamp, s16 = fp16(max(amax / qmax, 2**-14)), codes of y / float(s16)
        y = tl.clamp(x, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
        amax = tl.max(tl.abs(y), axis=1)
        s16 = tl.maximum(tl.math.div_rn(amax, qmax), 0.00006103515625).to(tl.float16)
        tl.store(scales_ptr + dst, s16, mask=rm)
        y = tl.math.div_rn(y, s16.to(tl.float32)[:, None])
    else:
        # StaticScaleFormat.quantize: x / s with the bound per-channel scale
        c = tl.load(chan_ptr + h[:, None] * head_dim + d[None, :], mask=m2, other=1.0)
        y = tl.math.div_rn(x, c)
    if ENC == 3:
        code = encode_int8(y)
    else:
        code = encode_e4m3(y)
    tl.store(codes_ptr + dst[:, None] * head_dim + d[None, :], code, mask=m2)


def write_rows(codes: torch.Tensor, scales: torch.Tensor | None, channels: torch.Tensor | None, rows: torch.Tensor,
               slots: torch.Tensor, *, encoding: int, scale_kind: int, qmax: float) -> None:
    """Code ``rows`` and store them at ``slots`` of ``codes`` (and their scales in ``scales``), in one launch.

    Args:
        codes: the layer's uint8 ``[num_blocks, block_size, kv_heads, head_dim]`` key or value tensor, contiguous.
        scales: its float16 ``[num_blocks, block_size, kv_heads]`` scales for ``scale_kind`` SCALE_TOKEN, else ``None``.
        channels: float32 ``[kv_heads, head_dim]`` static scales for ``scale_kind`` SCALE_CHANNEL, else ``None``.
        rows: float32 ``[num_tokens, kv_heads, head_dim]``, contiguous, in the format's stored basis (rotated
            formats rotate before calling).
        slots: ``[num_tokens]`` int64 slot of each row.
        encoding: ``ENC_I8`` or ``ENC_E4M3`` (:mod:`.codes`).
        scale_kind: ``SCALE_TOKEN`` (dynamic: the scale is computed per row and stored) or ``SCALE_CHANNEL``.
        qmax: the format's largest code (127 or 448).

    Bytes equal the Python formats' ``quantize`` (same clamps, float16 scale rounding, IEEE division and
    round-to-nearest-even codes); a NaN row's int8 codes are unspecified there and here.
    """
    n, kv_heads, head_dim = rows.shape
    if n == 0:
        return
    dummy = codes
    num_rows = n * kv_heads
    _write_rows_kernel[(triton.cdiv(num_rows, ROWS_PER_PROGRAM),)](
        rows, slots, codes, scales if scales is not None else dummy, channels if channels is not None else dummy,
        num_rows, kv_heads, head_dim, qmax, qmax * 65504.0,
        ENC=encoding, SCALE=scale_kind,
        BLOCK_R=ROWS_PER_PROGRAM, BLOCK_D=triton.next_power_of_2(head_dim),
    )
