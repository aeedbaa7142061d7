"""The ``reference`` attention backend: the PyTorch ops that define the semantics (gather, dequantize, SDPA).

Kept as the oracle the other backends are tested against and as the path for
devices and formats they do not serve. It reads each request's whole context
into a float tensor per layer, so it is not the fast path on the CPU.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from kvpage.ops.attention import AttentionMetadata, paged_attention
from kvpage.ops.backends.base import AttentionBackend
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.ops.sealed_attention import SealContext, sealed_attention
from kvpage.spec import LayerSpec


class ReferenceBackend(AttentionBackend):
    """:func:`~kvpage.ops.attention.paged_attention` and :func:`~kvpage.ops.sealed_attention.sealed_attention`, as they are."""

    name = "reference"

    @classmethod
    def unsupported(cls, spec: LayerSpec, device: torch.device) -> str | None:
        """Serves every format on every device: always ``None``."""
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cache: Mapping[str, torch.Tensor],
        spec: LayerSpec, meta: AttentionMetadata, *, layer_index: int,
        params: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`."""
        return paged_attention(q, k, v, cache, spec, meta, layer_index=layer_index, params=params)

    def forward_sealed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cache: Mapping[str, torch.Tensor],
        spec: LayerSpec, meta: AttentionMetadata, ctx: SealContext, *, layer_index: int,
        params: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward_sealed`."""
        return sealed_attention(q, k, v, cache, spec, meta, ctx, layer_index=layer_index, params=params)
