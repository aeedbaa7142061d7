"""Causal attention of one request's new tokens over exactly its own context (no padding, no batch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def request_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Attention of a request's ``n`` newest tokens over its ``s``-token context.

    Args:
        q: ``[n, num_heads, head_dim]`` queries of positions ``s - n .. s - 1``.
        keys: ``[s, kv_heads, head_dim]`` the whole context (new tokens last).
        values: ``[s, kv_heads, head_dim]``.
        scale: softmax scale, ``None`` = ``head_dim ** -0.5``.

    Returns:
        ``[n, num_heads, head_dim]``: query ``j`` attends to keys ``0 .. s - n + j`` (GQA: each
        kv head serves ``num_heads / kv_heads`` query heads). Reading exactly the request's own
        context means stale or NaN data in unwritten slots never reaches the output (case C19).
    """
    n, s = q.shape[0], keys.shape[0]
    if n != 1 and n != s:
        # Query j (position s - n + j) sees keys 0 .. s - n + j.
        mask = torch.arange(s, device=q.device)[None, :] <= (s - n + torch.arange(n, device=q.device))[:, None]
        return masked_attention(q, keys, values, mask, scale)
    # 4-D tensors (batch of one): SDPA's CPU kernels; a 3-D call falls back to a path 4x slower.
    qi = q.transpose(0, 1).unsqueeze(0)                                       # [1, H, n, D]
    ki = keys.transpose(0, 1).unsqueeze(0)                                    # [1, Hkv, s, D]
    vi = values.transpose(0, 1).unsqueeze(0)                                  # [1, Hkv, s, D]
    # a decode token sees its whole context; a whole prefill is plain causal
    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=n > 1, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)                                               # [n, H, D]


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Attention of ``n`` queries over ``s`` keys under an explicit boolean mask.

    Args:
        q: ``[n, num_heads, head_dim]``.
        keys: ``[s, kv_heads, head_dim]``.
        values: ``[s, kv_heads, head_dim]``.
        mask: ``[n, s]`` bool, ``True`` where query ``i`` may read key ``j``; every row needs at least one.
        scale: softmax scale, ``None`` = ``head_dim ** -0.5``.

    Returns:
        ``[n, num_heads, head_dim]`` (GQA as in :func:`request_attention`).
    """
    qi = q.transpose(0, 1).unsqueeze(0)                                       # [1, H, n, D]
    ki = keys.transpose(0, 1).unsqueeze(0)                                    # [1, Hkv, s, D]
    vi = values.transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)                                               # [n, H, D]
