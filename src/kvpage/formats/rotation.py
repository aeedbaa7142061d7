"""Orthonormal Hadamard rotations along ``head_dim``, used by the 8-bit formats before quantizing.

Keys (and to a lesser degree values) have a few outlier channels; with one
scale per (token, head) they set the scale and every other channel is coded
coarsely. Multiplying each head's vector by an orthonormal Hadamard matrix
``R`` spreads an outlier over all channels, so the same 8 bits code the row far
more finely. Attention is unchanged because ``R`` is orthonormal:
``(q R) . (k R) = q . k`` and ``sum_i p_i (v_i R) R^T = sum_i p_i v_i``; the attention op
therefore rotates the queries, attends over the stored (rotated) keys and values, and
rotates the output back -- it never un-rotates the cache.

Sources: QuaRot (Ashkboos et al., 2024) rotations for KV quantization; llama.cpp
PR 21038 (Hadamard rotation before q8_0/q4_0 KV quantization); vLLM PR 39668
(rotated per-token-head INT4 KV).

For ``head_dim`` that is not a power of two the matrix is block-diagonal with
Sylvester-Hadamard blocks of the binary decomposition of ``head_dim`` (96 =
64 + 32), so it stays exact, deterministic and free of random seeds (stored
bytes must mean the same in every process).
"""
from __future__ import annotations

from functools import lru_cache

import torch


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def _blocks(head_dim: int) -> list[int]:
    """Sizes of the diagonal Sylvester blocks, largest first (96 -> [64, 32])."""
    return [1 << b for b in reversed(range(head_dim.bit_length())) if head_dim >> b & 1]


@lru_cache(maxsize=None)
def _rotation64(head_dim: int) -> torch.Tensor:
    return torch.block_diag(*[_sylvester(n) for n in _blocks(head_dim)])


@lru_cache(maxsize=64)
def hadamard_rotation(head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """Orthonormal ``[head_dim, head_dim]`` (block-)Hadamard matrix ``R`` (``R @ R.T == I``).

    Args:
        head_dim: channels per head (any positive integer).
        dtype: dtype of the returned matrix.
        device: device of the returned matrix.

    Raises:
        ValueError: ``head_dim <= 0``.
    """
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return _rotation64(head_dim).to(dtype=dtype, device=device)


@lru_cache(maxsize=None)
def _inv_sqrt32(n: int) -> float:
    """``1/sqrt(n)`` rounded to float32 (exact for ``n`` a power of 4): the very constant ``R`` holds."""
    return float(torch.tensor(1.0 / n**0.5, dtype=torch.float64).float())


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ R`` along the last dim (``R = hadamard_rotation(x.shape[-1])``, symmetric, so also ``x @ R.T``).

    Computed with fixed-order butterflies (``a + b``, ``a - b``, then one multiply by
    ``1/sqrt(block)``), elementwise ops only: each row's result depends on that row alone,
    bit for bit, whatever the batch shape or device. A matmul does not guarantee that (its
    blocking and kernel depend on the shape), and stored codes must not depend on which
    other tokens were written in the same call. Equal to ``x @ R`` up to float rounding.
    """
    d = x.shape[-1]
    if d <= 0:
        raise ValueError(f"head_dim must be positive, got {d}")
    parts, start = [], 0
    for n in _blocks(d):
        y = x[..., start:start + n]
        h = 1
        while h < n:
            y = y.unflatten(-1, (n // (2 * h), 2, h))
            a, b = y[..., 0, :], y[..., 1, :]
            y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
            h *= 2
        parts.append(y * _inv_sqrt32(n))
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
