"""Attention backends, one per layer group, chosen from the layer's spec and the device (as vLLM selects them).

=============  =====================================================================
name           what it is
=============  =====================================================================
``reference``  PyTorch gather + dequantize + SDPA (:mod:`.reference`): every format,
               every device; the oracle of the tests
``cpu``        kvpage's C++ kernels (:mod:`.cpu`): fused paged decode over codes and
               scales, fused quantized writes
``triton``     Triton kernels (:mod:`.triton`; CUDA, or the CPU under
               ``TRITON_INTERPRET=1`` for tests): one paged-attention launch per layer
               over codes and scales, fused quantized writes; token-wise formats only
``auto``       on the CPU ``cpu`` where it serves the layer; on CUDA ``triton`` where
               it serves the layer; else ``reference``
=============  =====================================================================

``triton`` needs the optional ``triton`` package (extra ``gpu``), imported only when the backend is built.
"""
from __future__ import annotations

import torch

from kvpage.ops.backends.base import AttentionBackend
from kvpage.ops.backends.cpu import CpuBackend, cpu_backend
from kvpage.ops.backends.reference import ReferenceBackend
from kvpage.ops.backends.triton import TritonBackend
from kvpage.ops.cpu.build import kernels_unavailable_reason
from kvpage.spec import LayerSpec

#: Values ``attention_backend`` takes.
BACKEND_NAMES = ("auto", "reference", "cpu", "triton")


def select_backend(name: str, spec: LayerSpec, device: torch.device | str) -> AttentionBackend:
    """The backend ``name`` for layers of ``spec`` on ``device``.

    ``"auto"`` takes ``cpu`` on the CPU and ``triton`` on a CUDA device when it serves the layer, and
    ``reference`` otherwise (never ``triton`` on the CPU, even under the interpreter). Side effects: asking
    for (or auto-selecting on) the CPU compiles the kernels on first use; building ``triton`` imports triton.

    Raises:
        ValueError: an unknown name, or a named backend that cannot serve the layer's format on
            ``device`` (the message names both and why; case C27).
    """
    dev = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}; got {name!r}")
    if name == "reference":
        return ReferenceBackend()
    if name == "triton" or (name == "auto" and dev.type == "cuda"):
        why = TritonBackend.unsupported(spec, dev)
        if why is None:
            return TritonBackend()
        if name == "triton":
            raise ValueError(
                f"attention backend 'triton' cannot serve kv_cache_dtype {spec.kv_format!r} on {dev}: {why}"
            )
        return ReferenceBackend()
    why = CpuBackend.unsupported(spec, dev)
    if why is None:
        backend = cpu_backend()
        if backend is not None:
            return backend
        why = f"its C++ kernels are not available: {kernels_unavailable_reason() or 'they did not load'}"
    if name == "cpu":
        raise ValueError(f"attention backend 'cpu' cannot serve kv_cache_dtype {spec.kv_format!r} on {dev}: {why}")
    return ReferenceBackend()


__all__ = ["BACKEND_NAMES", "AttentionBackend", "CpuBackend", "ReferenceBackend", "TritonBackend", "select_backend"]
