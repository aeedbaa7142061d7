"""The fused decoder ops (:mod:`kvpage.ops.fused`) against the PyTorch expressions they replace.

float32: within 1e-6 relative. bfloat16 / float16: both round to the dtype at the same
points, so at most a few elements may differ, each by one rounding step of the dtype
(from RMSNorm's summation order or SiLU's exp); RoPE has no reduction and must match bit
for bit.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvpage.ops import fused
from kvpage.ops.cpu.build import load_kernels

pytestmark = pytest.mark.skipif(os.environ.get("KVPAGE_CPU_KERNELS") == "0", reason="KVPAGE_CPU_KERNELS=0")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        return
    step = torch.finfo(dtype).eps * want.float().abs().clamp(min=torch.finfo(dtype).tiny)
    diff = (got.float() - want.float()).abs()
    assert (diff <= 1.01 * step * 2).all()          # at most one rounding step (relative eps of the value)
    assert (diff > 0).float().mean() < 0.02          # and only a few elements


def test_kernels_are_used_on_the_cpu() -> None:
    assert load_kernels() is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_rms_norm_matches_the_unfused_expression(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = (1 + torch.randn(576, generator=g) * 0.1).to(dtype)
    _close(fused.rms_norm(x, w, 1e-5), _reference_rms(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 96), (8, 2, 128)])
def test_rope_split_is_bit_identical_to_the_unfused_expression(dtype: torch.dtype, heads: int, kv_heads: int,
                                                                head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    T, P = 11, 300
    qkv = torch.randn(T, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    cos = torch.randn(P, head_dim, generator=g).to(dtype)
    sin = torch.randn(P, head_dim, generator=g).to(dtype)
    pos = torch.randint(0, P, (T,), generator=g)
    got = fused.rope_split(qkv, cos, sin, pos, heads, kv_heads)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    qk = qkv[:, : heads + kv_heads]
    qk = qk * c + torch.roll(qk, head_dim // 2, dims=-1) * s
    want = (qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:])
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b)


def test_rope_split_refuses_a_position_outside_the_tables() -> None:
    qkv = torch.randn(2, 3, 8)
    tab = torch.randn(4, 8)
    with pytest.raises((RuntimeError, IndexError), match="out of range|index"):
        fused.rope_split(qkv, tab, tab, torch.tensor([1, 4]), 1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_unfused_expression(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(5, 2 * 1536, generator=g) * 4).to(dtype)
    gu[0, :8] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0, 1e-3, -1e-3]).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    _close(fused.silu_mul(gu), F.silu(gate) * up, dtype)
