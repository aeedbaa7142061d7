"""Quantize-on-seal formats ``int4`` (``int4_zp``), ``int3`` and ``int2``: KIVI mapped onto pages.

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", ICML 2024) quantizes **keys per channel** (over a group of tokens) and
**values per token** (over a group of channels), asymmetrically (scale and
zero point), and keeps the most recent tokens in full precision. KVQuant (Hooper
et al., NeurIPS 2024, App. G) shows why the axis matters: outlier *channels*
dominate keys, so a per-token key scale wastes its range on them.

On pages (see ``shared/research/quantization.md``, "quantize on seal"):

* **The token group of a key channel is the block.** A request's last, partial
  block lives in full precision in a small tail pool
  (:mod:`kvpage.cache.tail`); when it fills it is *sealed*: quantized once, from
  its own ``block_size`` tokens alone, and never re-quantized. So a sealed block
  depends only on its tokens: deterministic and shareable by the prefix cache
  and the host/disk/Redis tiers, which copy pool blocks only.
* **Values** are quantized per token in groups of :func:`value_group_size`
  channels. (A Hadamard rotation before it, as our ``int8``/``fp8`` do, measured
  no better here and breaks values with a large common offset: it gathers the
  offset into one coordinate, whose range then swamps the group's step -- case C21.)
* **Metadata costs bits**, so it is kept small: each group stores its step as one
  byte, an unsigned 8-bit float (the NVFP4 / SKVQ idea of 8-bit scales;
  :func:`encode_scale`), and its zero point as an int8 offset in steps
  (``x_hat = (code + offset) * step``): 16 bits per group where a float16 minimum
  cost 24.
* **The step is searched, not taken from min/max** (:func:`quantize_searched`):
  the candidate with the least squared error over the group wins, which clips a
  group's extremes when that codes the rest better. On the evaluation set's tuning
  texts (``benchmarks/ACCURACY.md``) it halves the 2-bit format's KL divergence.

Per-block tensors (``P = ceil(head_dim * bits / 8)`` packed bytes per row,
``G = head_dim // value_group_size`` value groups):

=============== ============================ ========= ================================
name            shape                        dtype     meaning
=============== ============================ ========= ================================
``key``         ``[block_size, kv_heads, P]`` uint8     packed codes, channel ``i`` at bit ``bits*i`` (:func:`pack`)
``key_scale``   ``[kv_heads, head_dim]``      uint8     UE5M3 per-channel step           
``key_zero``    ``[kv_heads, head_dim]``      int8      per-channel offset, in steps
``value``       ``[block_size, kv_heads, P]`` uint8     packed codes, as for keys          
``value_scale`` ``[block_size, kv_heads, G]`` uint8     UE5M3 per-token group step           
``value_zero``  ``[block_size, kv_heads, G]`` int8      per-token group offset, in steps
=============== ============================ ========= ================================

Error bound (tested): each group's RMS error is at most half its covering step
(:func:`covering_step`): ``c <= max(2 * r, b / (127 - qmax)) * (1 + 2**-3)``, at least ``2**-16``, with
``r = (max - min) / qmax`` and ``b = max(|min|, |max|)`` of the group -- one min/max step unless the
group sits far from zero relative to its spread -- as long as the step stays under 61440 (beyond it
the step saturates and the codes clamp: the output stays finite).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch

from kvpage.formats.base import KEY, KEY_SCALE, VALUE, VALUE_SCALE, BlockFormat, TensorSpec

#: Zero-point tensor names of the quantize-on-seal formats.
KEY_ZERO, VALUE_ZERO = "key_zero", "value_zero"

#: Step range of a scale byte (UE5M3: 5 exponent bits with bias 16, 3 mantissa bits, no sign).
SCALE_MIN, SCALE_MAX = 2.0**-16, 1.875 * 2.0**15
_EXP_BIAS = 16


def value_group_size(head_dim: int) -> int:
    """Channels per value quantization group: the largest divisor of ``head_dim`` that is at most 64.

    Groups divide ``head_dim`` exactly, so padding lanes never enter a group's min/max
    (case C21, head_dim 96 -> groups of 48). KIVI uses 32; 64 halves the metadata at a
    cost within the noise on SmolLM2 (GPL-3, 1,024 tokens: +0.0% vs +0.1% ppl at int4).

    Raises:
        ValueError: ``head_dim <= 0``.
    """
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return max(g for g in range(1, min(64, head_dim) + 1) if head_dim % g == 0)


def encode_scale(step: torch.Tensor) -> torch.Tensor:
    """float32 steps -> UE5M3 bytes (uint8), rounded **up**, clamped to ``[2**-16, 61440]``.

    UE5M3 is an unsigned 8-bit float: ``(1 + m / 8) * 2**(e - 16)`` for the byte
    ``e << 3 | m``. Like the e4m3 scales of NVFP4 it costs one byte, but without a
    wasted sign bit or subnormals its relative spacing is 1/8 over the whole range.
    Rounding up keeps every value of the group inside the code range. Elementwise
    (``frexp``/``ceil``), so deterministic per value.
    """
    s = step.float().nan_to_num(SCALE_MAX).clamp(SCALE_MIN, SCALE_MAX)
    mant, exp = torch.frexp(s)                                                 # s = mant * 2**exp, mant in [0.5, 1)
    m = torch.ceil((mant * 2 - 1) * 8)                                         # 0..8
    e = exp - 1 + _EXP_BIAS + (m == 8).to(exp.dtype)
    m = torch.where(m == 8, torch.zeros_like(m), m)
    return ((e << 3) | m.to(e.dtype)).to(torch.uint8)


def decode_scale(codes: torch.Tensor) -> torch.Tensor:
    """UE5M3 bytes (uint8) -> float32 steps."""
    c = codes.to(torch.int32)
    return torch.ldexp(1 + (c & 7).float() / 8, (c >> 3) - _EXP_BIAS)


#: Range of the stored offsets (int8), in steps.
OFFSET_MIN, OFFSET_MAX = -128, 127
#: Rank of a candidate over :func:`quantize_searched`'s ``max_error`` (above any squared error of float32 data).
_INFEASIBLE = 1e30
#: Default candidate steps of :func:`quantize_searched`, as UE5M3 codes relative to the min/max step's:
#: each code is 1/8 apart, so -3..8 spans about 0.7x (clipping the group's extremes) to 2x (covering them
#: with slack). The formats narrow it to where their groups' best steps fall (``SealedFormat.step_search``).
STEP_SEARCH = range(-3, 9)


def _encode(x: torch.Tensor, s: torch.Tensor, m: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` at step ``s`` and offset ``m`` (clamped to ``[0, qmax]``), and the dequantized values."""
    u = torch.round(x / s - m).clamp_(0, qmax)
    return u, (u + m) * s


def quantize_searched(
    x: torch.Tensor, dim: int, bits: int, max_error: float | None = None, steps: range = STEP_SEARCH
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of float32 ``x`` over ``dim``, the step chosen for the least squared error.

    Each group (``dim`` reduced) is coded as ``x_hat = (code + m) * s``: a UE5M3 step ``s`` and an int8
    offset ``m``, in steps. Min/max quantization (KIVI's) spends the whole code range on the group's two
    extremes; at 2 and 4 bits a smaller step that clips them codes the rest better (the clipping search
    of AWQ and OmniQuant, here per group at seal time). The candidates are the steps :data:`STEP_SEARCH`
    (``steps``, UE5M3 codes relative to the min/max step's) around the min/max step, each with the offset
    centring the codes on the group's midpoint and with the
    one starting them at its minimum, plus one *covering* candidate: a step at least twice the min/max
    step and large enough for the offset to fit int8, with the floor offset, which holds every value of
    the group within half its step. The least summed squared error wins (ties: the earlier candidate).
    With ``max_error`` only candidates moving no value by more than ``max_error`` min/max steps
    (``(max - min) / qmax``) compete, unless none does: then the one with the least largest error wins.

    Elementwise ops and reductions over the group only (no matmul), so each group's bytes depend on that
    group alone, whatever else is in the tensor. Squared errors are summed in float64 and compared in float32
    (so no summation order changes the pick) and a NaN input codes as 0: the CPU kernel ``seal_blocks``
    (``kvpage/ops/cpu/seal_blocks.cpp``) writes the same bytes.

    Returns:
        ``(codes, scale_bytes, offset)``: codes uint8 in ``[0, 2**bits - 1]`` shaped like ``x``; UE5M3
        scale bytes (uint8) and int8 offsets with ``dim`` reduced to size 1.
    """
    qmax = 2**bits - 1
    d = dim % x.dim()
    mn, mx = x.amin(d, keepdim=True), x.amax(d, keepdim=True)
    span = (mx - mn) / qmax
    e0 = encode_scale(span).to(torch.int32)
    cover = _covering_code(mn, mx, qmax).to(torch.int32)
    # Every candidate at once along a trailing axis C, in the order (k, centred), (k, floor) ..., cover.
    ks = torch.tensor(list(steps), dtype=torch.int32, device=x.device).repeat_interleave(2)
    centred = torch.tensor([True, False] * len(steps) + [False], device=x.device)
    e = torch.cat([e0.unsqueeze(-1) + ks, cover.unsqueeze(-1)], -1)           # [..., 1, ..., C]
    code = e.clamp(0, 255).to(torch.uint8)
    st = decode_scale(code)
    lo, hi = mn.unsqueeze(-1), mx.unsqueeze(-1)
    m = torch.where(centred, torch.round((lo + hi) / (2 * st) - qmax / 2), torch.floor(lo / st))
    m = m.clamp_(OFFSET_MIN, OFFSET_MAX)
    xc = x.unsqueeze(-1)                                                      # [..., 1]
    u, xh = _encode(xc, st, m, qmax)                                           # [..., C]
    diff = xh - xc
    # summed in float64 (each square is exact there), compared in float32: the order of the sum (torch's, which
    # differs between candidates, or a kernel's) only matters below float64's rounding, which the float32
    # rounding absorbs, so every implementation picks the same candidate, exact ties included
    err = diff.double().square().sum(d, keepdim=True).float()                 # [..., 1, ..., C]
    if max_error is not None:  # infeasible candidates rank after every feasible one, by their largest error
        limit = (max_error * span).unsqueeze(-1)
        worst = diff.abs().amax(d, keepdim=True)
        err = torch.where(worst <= limit, err, _INFEASIBLE * (1 + worst / limit.clamp(min=SCALE_MIN)))
    pick = err.argmin(-1, keepdim=True)                                       # the first least error (or NaN)
    codes = u.gather(-1, pick.expand(*u.shape[:-1], 1)).squeeze(-1)
    # a NaN input leaves NaN codes and offsets: stored as 0 (a float -> integer cast of NaN is undefined)
    return (codes.nan_to_num(0.0).to(torch.uint8), code.gather(-1, pick).squeeze(-1),
            m.gather(-1, pick).squeeze(-1).nan_to_num(0.0).to(torch.int8))


def _covering_code(mn: torch.Tensor, mx: torch.Tensor, qmax: int) -> torch.Tensor:
    """UE5M3 byte of the covering step of groups with minima ``mn`` and maxima ``mx``: at least twice the
    min/max step, and large enough for a floor offset to fit int8 with ``qmax`` codes above it."""
    big = torch.maximum(mn.abs(), mx.abs())
    return encode_scale(torch.maximum(2 * (mx - mn) / qmax, big / (OFFSET_MAX - qmax)))


def covering_step(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """The covering candidate's step of :func:`quantize_searched` for each group (float32, ``dim`` reduced).

    Every group's squared error is at most that of this candidate, whose values all lie within half
    of it: so a group's RMS error is at most half this step (the documented, tested bound).
    """
    return decode_scale(_covering_code(x.amin(dim, keepdim=True), x.amax(dim, keepdim=True), 2**bits - 1))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``[..., n]`` uint8 codes of ``bits`` (2, 3 or 4) bits into ``[..., ceil(n * bits / 8)]`` uint8 bytes.

    The row is one little-endian bit stream: code ``i`` sits at bit ``bits * i`` of it (2 and 4 bits: value ``i``
    of each byte at bit ``bits * i``, low bits first; 3 bits: eight codes in three bytes, code ``8j + i`` at bit
    ``3i`` of the 24-bit little-endian word of bytes ``3j .. 3j + 2``, so codes may straddle a byte). Padding
    lanes are 0.

    Raises:
        ValueError: ``bits`` not 2, 3 or 4.
    """
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4, got {bits}")
    n = codes.shape[-1]
    per = 8 if bits == 3 else 8 // bits                                         # codes per group of whole bytes
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)         # (explicit: empty inputs too)
    if bits != 3:
        out = c[..., 0].clone()
        for i in range(1, per):
            out |= c[..., i] << (bits * i)
        return out
    word = c[..., 0].to(torch.int32)                                            # [..., n / 8] 24-bit words
    for i in range(1, 8):
        word |= c[..., i].to(torch.int32) << (3 * i)
    shifts = torch.tensor([0, 8, 16], dtype=torch.int32, device=codes.device)
    out = ((word.unsqueeze(-1) >> shifts) & 255).to(torch.uint8).flatten(-2)   # [..., 3 * n / 8]
    return out[..., : math.ceil(n * 3 / 8)]


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., P]`` uint8 bytes -> ``[..., n]`` uint8 codes (``P >= ceil(n * bits / 8)``).

    Raises:
        ValueError: ``bits`` not 2, 3 or 4.
    """
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4, got {bits}")
    if bits != 3:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        vals = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)              # [..., P, per]
        return vals.flatten(-2)[..., :n]
    pad = (-packed.shape[-1]) % 3
    if pad:
        packed = torch.nn.functional.pad(packed, (0, pad))
    b = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)  # [..., P / 3, 3]
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)                     # [..., P / 3] 24-bit words
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
    vals = (word.unsqueeze(-1) >> shifts) & 7                                   # [..., P / 3, 8]
    return vals.flatten(-2)[..., :n].to(torch.uint8)


class SealedFormat(BlockFormat):
    """Base of the KIVI block-wise formats: whole blocks are quantized once, when full.

    Written per block with :meth:`seal` and read with :meth:`unseal` (the
    :class:`~kvpage.formats.base.BlockFormat` interface); the attention op for
    these layers is :func:`kvpage.ops.sealed_attention.sealed_attention`, which
    keeps the open block's tokens in the tail pool (:mod:`kvpage.cache.tail`).

    Attributes:
        bits: code width (4, 3 or 2).
        default_residual_tokens: the full-precision window (``kv_quant_residual_tokens``)
            used when none is configured, chosen by measurement (``benchmarks/ACCURACY.md``).
        preferred_block_size: the block size ``LLM`` uses for this format when none is given:
            the key group of KIVI is the block, and 32 balances per-channel metadata
            (fewer tokens per group cost more bits) against the tail (longer blocks keep
            more tokens in full precision).
        max_error: the largest error a step search may leave in a value, in min/max steps (``None``:
            unlimited; see :func:`quantize_searched`).
        step_search: the candidate steps of that search (UE5M3 codes relative to the min/max step's).
        sink_bits: precision of the extra copy of a request's first block (attention sinks,
            kept as in KVQuant, IntactKV and SKVQ).
        sink_rows: rows of the first block that copy holds (``None``: all): the whole block here; ``int3``,
            ``int3_rotated`` and ``int4_rotated`` copy row 0 alone (chosen per format by screening).
    """

    quantized = True
    version = 2  # 2: int8 offsets and searched steps (1: float16 minima, min/max steps)
    bits: ClassVar[int]
    preferred_block_size: ClassVar[int] = 32
    sink_bits: ClassVar[int] = 8
    max_error: ClassVar[float | None] = None
    step_search: ClassVar[range] = STEP_SEARCH

    # -- layout ----------------------------------------------------------------------------------

    def packed_dim(self, head_dim: int) -> int:
        """Bytes per packed row of ``head_dim`` codes."""
        return math.ceil(head_dim * self.bits / 8)

    def tensor_specs(
        self, *, block_size: int, kv_heads: int, head_dim: int, has_value: bool = True
    ) -> tuple[TensorSpec, ...]:
        """Per-block tensors, see the module table. Key-only layers list no value tensors."""
        p = self.packed_dim(head_dim)
        g = head_dim // value_group_size(head_dim)
        specs = [
            TensorSpec(KEY, (block_size, kv_heads, p), torch.uint8),
            TensorSpec(KEY_SCALE, (kv_heads, head_dim), torch.uint8),
            TensorSpec(KEY_ZERO, (kv_heads, head_dim), torch.int8),
        ]
        if has_value:
            specs += [
                TensorSpec(VALUE, (block_size, kv_heads, p), torch.uint8),
                TensorSpec(VALUE_SCALE, (block_size, kv_heads, g), torch.uint8),
                TensorSpec(VALUE_ZERO, (block_size, kv_heads, g), torch.int8),
            ]
        return tuple(specs)

    def names(self, kind: str) -> tuple[str, str, str]:
        """``(codes, scale, zero)`` tensor names of ``kind`` (``"key"`` or ``"value"``).

        Raises:
            ValueError: another ``kind``.
        """
        if kind == KEY:
            return KEY, KEY_SCALE, KEY_ZERO
        if kind == VALUE:
            return VALUE, VALUE_SCALE, VALUE_ZERO
        raise ValueError(f"kind must be {KEY!r} or {VALUE!r}, got {kind!r}")

    # -- values ----------------------------------------------------------------------------------

    def seal(self, blocks: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        """Quantize whole blocks; ``blocks`` is not modified.

        Args:
            blocks: ``[num_blocks, block_size, kv_heads, head_dim]`` keys or values (any float dtype;
                computed in float32).
            kind: ``"key"`` (per channel over the block's tokens) or ``"value"`` (per token
                in groups of :func:`value_group_size` channels).

        Returns:
            tensor name -> ``[num_blocks, *per_block_shape]`` (see :meth:`tensor_specs`).
        """
        codes_name, scale_name, zero_name = self.names(kind)
        x = blocks.float()
        d = x.shape[-1]
        if kind == KEY:
            codes, scale, zero = quantize_searched(x, 1, self.bits, self.max_error, self.step_search)  # [m, 1, kv, D]
            return {codes_name: pack(codes, self.bits), scale_name: scale.squeeze(1), zero_name: zero.squeeze(1)}
        g = value_group_size(d)
        grouped = x.reshape(*x.shape[:-1], d // g, g)                         # [m, bs, kv, G, g]
        codes, scale, zero = quantize_searched(grouped, -1, self.bits, self.max_error, self.step_search)
        return {
            codes_name: pack(codes.flatten(-2), self.bits),
            scale_name: scale.squeeze(-1),
            zero_name: zero.squeeze(-1),
        }

    def unseal(
        self, tensors: Mapping[str, torch.Tensor], kind: str, dtype: torch.dtype, head_dim: int
    ) -> torch.Tensor:
        """Dequantize sealed blocks; the inputs are not modified.

        Args:
            tensors: tensor name -> ``[..., *per_block_shape]`` (as :meth:`seal` returns or the pool holds).
            kind: ``"key"`` or ``"value"``.
            dtype: compute dtype of the result.
            head_dim: channels per head (packed rows may carry padding).

        Returns:
            ``[..., block_size, kv_heads, head_dim]`` in ``dtype``.
        """
        codes_name, scale_name, zero_name = self.names(kind)
        codes = unpack(tensors[codes_name], self.bits, head_dim).float()       # [..., bs, kv, D]
        scale, zero = decode_scale(tensors[scale_name]), tensors[zero_name].float()
        if kind == KEY:
            return ((codes + zero.unsqueeze(-3)) * scale.unsqueeze(-3)).to(dtype)
        g = value_group_size(head_dim)
        grouped = codes.unflatten(-1, (head_dim // g, g))                       # [..., bs, kv, G, g]
        return ((grouped + zero.unsqueeze(-1)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)

    # -- accounting -------------------------------------------------------------------------------

    def effective_bits_per_value(
        self, *, num_tokens: int, block_size: int, kv_heads: int, head_dim: int, residual_tokens: int = 0,
        window_bits: int | None = None,
    ) -> float:
        """Bits per value one sequence of ``num_tokens`` tokens holds, everything counted.

        Counts the pool blocks it occupies (codes, scales, zero points; the partial last
        block's pool block too), the 16-bit tail slot of its partial block, the copies
        of the sealed blocks in the full-precision window (the ``ceil(residual_tokens /
        block_size)`` blocks before the next token's block; 16-bit rows, or int8 codes plus one float16 scale per
        token and head where :meth:`window_copy_bits` is 8), and, unless ``sink_bits`` is 0,
        the 8-bit copy of its first block's ``sink_rows`` rows (int8 codes plus one float16 scale per token and
        head). ``window_bits`` overrides the window copies' precision (16 or 8; ``None``: the engine's,
        :meth:`window_copy_bits`; the transformers cache keeps 16-bit ones).

        Raises:
            ValueError: ``num_tokens <= 0``; ``window_bits`` not 8, 16 or ``None``.
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        if window_bits not in (None, 8, 16):
            raise ValueError(f"window_bits must be 8, 16 or None, got {window_bits}")
        bs = block_size
        sealed, partial = divmod(num_tokens, bs)
        block_bytes = sum(s.nbytes for s in self.tensor_specs(block_size=bs, kv_heads=kv_heads, head_dim=head_dim))
        fp_block_bytes = 2 * bs * kv_heads * head_dim * 2
        sink_bytes = 2 * self.copied_rows(bs) * kv_heads * (head_dim + 2)
        window = min(math.ceil(residual_tokens / bs), sealed)
        eight = (self.window_copy_bits(bs) if window_bits is None else window_bits) == 8
        window_bytes = 2 * bs * kv_heads * (head_dim + 2) if eight else fp_block_bytes
        total = math.ceil(num_tokens / bs) * block_bytes + (1 if partial else 0) * fp_block_bytes
        total += window * window_bytes + (sink_bytes if sealed and self.sink_bits else 0)
        return 8 * total / (2 * num_tokens * kv_heads * head_dim)

    def full_precision_tokens(self, *, num_tokens: int, block_size: int, residual_tokens: int = 0) -> int:
        """Tokens of a ``num_tokens``-token sequence held in 16 bits too: those of the open (partial) block, in
        its tail slot, and those of the sealed blocks in the window (the ``ceil(residual_tokens / block_size)``
        blocks before the open one) unless their copies are 8-bit (:meth:`window_copy_bits`), as
        :meth:`effective_bits_per_value` counts them.

        Raises:
            ValueError: ``num_tokens <= 0``.
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        sealed, partial = divmod(num_tokens, block_size)
        if self.window_copy_bits(block_size) == 8:
            return partial
        return partial + min(math.ceil(residual_tokens / block_size), sealed) * block_size


class Int4Format(SealedFormat):
    """``int4`` (FastDeploy ``int4_zp``): 4-bit asymmetric KIVI codes, 2 per byte.

    Measured on SmolLM2 / GPL-3 (1,024 tokens, decode): no full-precision window needed.
    """

    name = "int4"
    aliases = ("int4_zp", "kivi4", "int4_kivi")
    bits = 4
    default_residual_tokens = 0
    #: At 4 bits the clipping gain is small and case C21 wants every value of [5, 6] within 0.04 (0.6 of
    #: its min/max step): the search keeps every value within 0.6 steps, which steps much below the
    #: min/max one (they clip) or above 1.2 times it (half a step is 0.6) cannot; on bell-shaped groups
    #: 99.8% choose codes -1..2 around it, so only those are searched (sealing is on the decode path).
    max_error = 0.6
    step_search = range(-1, 3)


class Int3Format(SealedFormat):
    """``int3``: 3-bit asymmetric KIVI codes, 8 per 3 bytes (a little-endian bit stream, see :func:`pack`).

    Between ``int4`` and ``int2``: ``P = ceil(head_dim * 3 / 8)`` bytes per packed row (24 at head_dim 64), the
    metadata of ``int4``. At SmolLM2's geometry (3 kv heads, head_dim 64, blocks of 32) a sequence costs 3.375
    bits per value in the pool, plus the 8-bit copy of its first token: 3.383 at exactly 1,024 tokens.

    Chosen on the tuning members (chunked-32, ``kvpage eval --suite``; ``benchmarks/ACCURACY.md``): no
    full-precision window (one 32-token block would add 0.5 bits at 1,024 tokens), and a first-block copy kept:
    without one KLD was 2-3x as high on three of the four members (gpl3 0.082 against 0.026 with the search below).
    The copy holds row 0 alone (``sink_rows = 1``, block 0 sealed as it is): 0.0280 mean KLD of the first three
    tuning members against 0.0276 for the whole block, 0.25 bits less at 1,024 tokens (``int4`` lost 29% so and
    keeps its whole block).
    """

    name = "int3"
    aliases = ("kivi3", "int3_kivi", "int3_zp")
    bits = 3
    default_residual_tokens = 0
    sink_rows = 1
    #: int4's candidates. Wider searches clip more and measured worse, as at 2 bits (tuning members gpl3 /
    #: matplotlibrc KLD: -1..2 0.026 / 0.025, 0..2 0.033 / 0.028, -2..4 0.040 / 0.032, -3..8 0.049 / 0.038);
    #: int4's ``max_error`` of 0.6 steps gained nothing here (0.031 / 0.025).
    step_search = range(-1, 3)


class Int2Format(SealedFormat):
    """``int2``: 2-bit asymmetric KIVI codes, 4 per byte, with a one-block window read from 8-bit copies.

    The window's copies are ``int8`` per token and head (``window_bits = 8``) in the slots of the whole-block
    first-block copies, not 16-bit rows: screened on the tuning members (``benchmarks/ACCURACY.md``, KLD of gpl3 /
    argparse / matplotlibrc / torch_readme) ``int2_rotated`` 0.0350 / 0.0605 / 0.0364 / 0.2197 against 0.0351 /
    0.0623 / 0.0372 / 0.2379 with 16-bit copies, ``int2`` +2-4%, at 0.24 fewer bits at 1,024 tokens (2.891 against
    3.133 at SmolLM2's geometry).
    """

    name = "int2"
    aliases = ("kivi2", "int2_kivi", "int2_zp")
    bits = 2
    default_residual_tokens = 32
    window_bits = 8
    #: At 2 bits the least-squares step of a bell-shaped group is 0.55-0.75 of the min/max step (UE5M3
    #: codes -7..-3 around it), but clipping that far measured worse where it counts (GPL-3, 1,024
    #: tokens: KLD 0.082 with codes -8..0 against 0.056 with -3..8): squared error is not attention's
    #: error, and the extremes a deep clip cuts are the values attention leans on. So -3..8 it stays.
    step_search = range(-3, 9)
