"""Fused per-layer ops of the decoder (RMSNorm, RoPE + q/k/v split, SiLU-gated product), CPU kernels with a PyTorch fallback.

At decode batch sizes a layer's small ops cost more in dispatch than in arithmetic
(~35 torch calls a layer, ~13% of a batch-1 step on SmolLM2). On the CPU these
functions run one kernel each from :mod:`kvpage.ops.cpu` (``fused_ops.cpp``);
elsewhere, or when the kernels did not build, the PyTorch expression below each
one runs instead. Both round to the model dtype at the same points, so they
differ only in RMSNorm's summation order and SiLU's exp (within float rounding).
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from kvpage.ops.cpu.build import load_kernels

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The compiled kernels when ``x`` is a CPU tensor of a dtype they take, else ``None`` (use PyTorch)."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        return None
    return load_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim (Zhang & Sennrich 2019), as transformers' ``LlamaRMSNorm``.

    Args:
        x: ``[..., E]`` in the model dtype.
        weight: ``[E]``, same dtype.
        eps: added to the mean square.

    Returns:
        ``[..., E]`` in ``x.dtype``: normalized in float32, rounded to the dtype, then scaled by ``weight``.
    """
    k = _kernels_for(x)
    if k is not None and weight.dtype == x.dtype:
        return k.rms_norm(x.contiguous(), weight.contiguous(), float(eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_split(
    qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, positions: torch.Tensor, num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half layout, Su et al. 2021) on the q and k heads of a fused projection, split into q, k, v.

    Args:
        qkv: ``[T, H + 2*Hkv, D]`` q heads, then k heads, then v heads.
        cos, sin_signed: ``[P, D]`` tables (:func:`kvpage.model.llama.rope_tables`), model dtype.
        positions: ``[T]`` int64 positions in ``[0, P)``.
        num_heads, num_kv_heads: ``H`` and ``Hkv``.

    Returns:
        Contiguous ``q`` ``[T, H, D]``, ``k`` ``[T, Hkv, D]`` (RoPE applied: ``x * cos + roll(x, D/2) * sin``)
        and ``v`` ``[T, Hkv, D]``.

    Raises:
        IndexError: a position outside the tables (``RuntimeError`` from the kernel).
    """
    k = _kernels_for(qkv)
    if k is not None and cos.dtype == qkv.dtype and sin_signed.dtype == qkv.dtype:
        return k.rope_split(qkv.contiguous(), cos, sin_signed, positions, num_heads, num_kv_heads)
    H, Hkv, D = num_heads, num_kv_heads, qkv.shape[-1]
    c = cos[positions].unsqueeze(1)                                             # [T, 1, D]
    s = sin_signed[positions].unsqueeze(1)
    qk = qkv[:, : H + Hkv]
    qk = qk * c + torch.roll(qk, D // 2, dims=-1) * s
    return qk[:, :H].contiguous(), qk[:, H:].contiguous(), qkv[:, H + Hkv:].contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` (Shazeer 2020) of a fused ``[..., 2*I]`` projection (gate columns first) -> ``[..., I]``."""
    k = _kernels_for(gate_up)
    if k is not None:
        return k.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
