"""Causal attention of one request's new tokens over exactly its own context (no padding, no batch).

Both functions take the layer's :class:`~kvpage.ops.layer_attention.LayerAttention`: its softmax scale,
its sliding window (a query reads only the last ``sliding_window`` positions, itself included) and its
tanh soft-cap of the scores (Gemma 2). Plain layers run one SDPA call; windowed or soft-capped ones
build the mask explicitly, and soft-capped ones compute the scores themselves (SDPA has no cap).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpage.ops.layer_attention import PLAIN, LayerAttention


def request_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      params: LayerAttention = PLAIN) -> torch.Tensor:
    """Attention of a request's ``n`` newest tokens over its ``s``-token context.

    Args:
        q: ``[n, num_heads, head_dim]`` queries of positions ``s - n .. s - 1``.
        keys: ``[s, kv_heads, head_dim]`` the whole context (new tokens last).
        values: ``[s, kv_heads, head_dim_v]``.
        params: the layer's scale, sliding window and soft-cap.

    Returns:
        ``[n, num_heads, head_dim_v]``: query ``j`` attends to keys ``0 .. s - n + j`` (within its
        window: positions ``> s - n + j - sliding_window``; GQA: each kv head serves
        ``num_heads / kv_heads`` query heads). Reading exactly the request's own context means stale or
        NaN data in unwritten slots never reaches the output (case C19).
    """
    n, s = q.shape[0], keys.shape[0]
    if params.sliding_window is not None or params.logit_softcap is not None or (n != 1 and n != s):
        pos = s - n + torch.arange(n, device=q.device)                                    # [n]
        t = torch.arange(s, device=q.device)                                              # [s]
        mask = t[None, :] <= pos[:, None]                                                 # [n, s]
        if params.sliding_window is not None:
            mask &= t[None, :] > (pos - params.sliding_window)[:, None]
        return masked_attention(q, keys, values, mask, params)
    # 4-D tensors (batch of one): SDPA's CPU kernels; a 3-D call falls back to a path 4x slower.
    qi = q.transpose(0, 1).unsqueeze(0)                                       # [1, H, n, D]
    ki = keys.transpose(0, 1).unsqueeze(0)                                    # [1, Hkv, s, D]
    vi = values.transpose(0, 1).unsqueeze(0)                                  # [1, Hkv, s, Dv]
    # a decode token sees its whole context; a whole prefill is plain causal
    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=n > 1, scale=params.scale, enable_gqa=True)
    return o[0].transpose(0, 1)                                               # [n, H, Dv]


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
    params: LayerAttention = PLAIN,
) -> torch.Tensor:
    """Attention of ``n`` queries over ``s`` keys under an explicit boolean mask.

    Args:
        q: ``[n, num_heads, head_dim]``.
        keys: ``[s, kv_heads, head_dim]``.
        values: ``[s, kv_heads, head_dim_v]``.
        mask: ``[n, s]`` bool, ``True`` where query ``i`` may read key ``j``; every row needs at least one.
        params: the layer's scale and soft-cap (its window is the caller's to put in ``mask``).

    Returns:
        ``[n, num_heads, head_dim_v]`` (GQA as in :func:`request_attention`).
    """
    qi = q.transpose(0, 1).unsqueeze(0)                                       # [1, H, n, D]
    ki = keys.transpose(0, 1).unsqueeze(0)                                    # [1, Hkv, s, D]
    vi = values.transpose(0, 1).unsqueeze(0)                                  # [1, Hkv, s, Dv]
    cap = params.logit_softcap
    if cap is None:
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=params.scale, enable_gqa=True)
        return o[0].transpose(0, 1)                                           # [n, H, Dv]
    group = qi.shape[1] // ki.shape[1]
    ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)  # [1, H, s, D]
    scale = q.shape[-1] ** -0.5 if params.scale is None else params.scale
    scores = (qi @ ki.transpose(-1, -2)) * scale                              # [1, H, n, s]
    scores = torch.tanh(scores / cap) * cap                                   # Gemma 2's soft-cap
    scores = scores.masked_fill(~mask, float("-inf"))
    o = scores.softmax(dim=-1) @ vi                                           # [1, H, n, Dv]
    return o[0].transpose(0, 1)                                               # [n, H, Dv]
