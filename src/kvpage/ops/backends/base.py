"""The attention backend interface: how one layer group's layers write and read their paged blocks.

As vLLM selects an attention backend per layer from the layer's spec and the
device, kvpage picks one :class:`AttentionBackend` per layer group
(:func:`kvpage.ops.backends.select_backend`). Every backend serves the same two
calls with the same semantics, defined by the reference implementation
(:mod:`kvpage.ops.attention` and :mod:`kvpage.ops.sealed_attention`):

* :meth:`AttentionBackend.forward` for token-wise formats (rows coded when written);
* :meth:`AttentionBackend.forward_sealed` for block-wise (quantize-on-seal) formats,
  with the step's :class:`~kvpage.ops.sealed_attention.SealContext`.

A backend that cannot serve a format on a device says why
(:meth:`AttentionBackend.unsupported`), so a request for it fails at start-up
naming both (case C27) instead of running a wrong kernel.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch

from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.ops.sealed_attention import SealContext
from kvpage.spec import LayerSpec


class AttentionBackend(ABC):
    """Writes a step's new K/V into a layer's blocks and attends over them (one instance per layer group).

    Subclasses are stateless between steps apart from caches keyed by the step's objects, so one
    instance may serve every layer of its group in turn.
    """

    #: the name users select it by (``attention_backend=...``).
    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def unsupported(cls, spec: LayerSpec, device: torch.device) -> str | None:
        """Why this backend cannot serve layers of ``spec`` on ``device``, or ``None`` when it can."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        cache: Mapping[str, torch.Tensor],
        spec: LayerSpec,
        meta: AttentionMetadata,
        *,
        layer_index: int,
        params: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        """Token-wise layers: as :func:`kvpage.ops.attention.paged_attention` (same arguments, result and errors)."""

    @abstractmethod
    def forward_sealed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        cache: Mapping[str, torch.Tensor],
        spec: LayerSpec,
        meta: AttentionMetadata,
        ctx: SealContext,
        *,
        layer_index: int,
        params: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        """Block-wise layers: as :func:`kvpage.ops.sealed_attention.sealed_attention` (same arguments, result, errors)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
