"""A step's metadata from host values to the device without synchronising the host.

Block tables, slot mappings, positions and token ids are built on the host from the scheduler's plain-data plan
each step. ``torch.as_tensor(values, device="cuda")`` copies from pageable memory, which PyTorch completes with a
stream synchronisation: the host would wait for every kernel already queued, once per tensor per step. As vLLM's
GPU model runner does with its persistent pinned buffers, :func:`to_device` stages the values in pinned (page-locked)
host memory and copies them ``non_blocking``: the copy is ordered on the current stream and the host goes on
(PyTorch's caching host allocator keeps the pinned buffer alive until the copy has run). On the CPU it is a plain
tensor. Sampling reads the logits back and is the one synchronisation a decode step keeps.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | torch.Tensor, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """``values`` (a sequence of Python numbers, or a CPU tensor) as a ``dtype`` tensor on ``device``.

    On CUDA the host-side tensor is pinned and copied ``non_blocking`` (no host synchronisation); elsewhere this is
    ``torch.as_tensor(values, dtype=dtype).to(device)``. The shape is that of ``values``. No other side effects.
    """
    device = torch.device(device)
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["to_device"]
