"""What the attention backends' tests compare against: float64 attention over unquantized K/V, and the
calibrated-looking static scales the ``*_static`` formats are built with (shared by the cpu and Triton tests)."""
from __future__ import annotations

import math

import torch

from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.scales import StaticScales


def static_scales(fmt: str, kv_heads: int, head_dim: int) -> StaticScales | None:
    """Calibrated-looking absolute maxima for a ``*_static`` format (unit-normal data stays below 4.5 but for rare
    samples); ``None`` for any other format."""
    if not fmt.endswith("_static"):
        return None
    absmax = 4.5 + torch.rand(kv_heads, head_dim, generator=torch.Generator().manual_seed(9))
    return StaticScales({0: absmax}, {0: absmax}, kind="absmax")


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int,
                      params: LayerAttention = PLAIN) -> torch.Tensor:
    """Dense causal attention in float64: query ``j`` (position ``first + j``) sees keys ``0 .. first + j``
    (those after ``first + j - sliding_window`` only), scores scaled then soft-capped as ``params`` say.

    ``q`` is ``[n, H, D]``, ``k``/``v`` are ``[s, Hkv, D]`` (GQA: ``H`` a multiple of ``Hkv``); returns
    ``[n, H, D]`` float64."""
    n, h, d = q.shape
    rep = h // k.shape[1]
    kx, vx = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    sc = torch.einsum("nhd,shd->hns", q.double(), kx) * (d**-0.5 if params.scale is None else params.scale)
    if params.logit_softcap is not None:
        sc = params.logit_softcap * torch.tanh(sc / params.logit_softcap)
    pos = first + torch.arange(n)
    mask = torch.arange(k.shape[0])[None, :] <= pos[:, None]
    if params.sliding_window is not None:
        mask &= torch.arange(k.shape[0])[None, :] > (pos - params.sliding_window)[:, None]
    return torch.einsum("hns,shd->nhd", sc.masked_fill(~mask, -math.inf).softmax(-1), vx)
