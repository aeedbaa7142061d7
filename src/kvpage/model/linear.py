"""Bias-free linear layers whose bfloat16 CPU weights are prepacked once for oneDNN.

Why: on CPU, torch's ``F.linear`` in bfloat16 streams the weight at only ~7 GB/s
when the batch is small (one thread, SmolLM2-135M shapes), no faster per
parameter than float32 at twice the bytes, and decode is bound by exactly that
read. The same weights reordered once into oneDNN's preferred blocked layout
stream at ~10-15 GB/s: at one row 1.4x faster summed over a decoder layer's four
projections and 1.7x for SmolLM2's 49152-row LM head, 1.1-2.0x per projection
for 1 to 32 rows, 1.3-1.5x for 512-row prefill chunks (LM head 1.0x there).
Measured on a Xeon with AMX/AVX512-BF16, one thread, weights cold in cache,
end to end ~11 ms of a ~52 ms batch-1 decode step at depth 1,000 (commit
message of the change that added this file). float32 gains nothing from
packing (MKL's and oneDNN's packed float32 paths are at best 1.05x), float16
only ~1.1x, so both stay on plain ``F.linear``.

Where it comes from: the ops inductor's CPU freezing pass emits for a bfloat16
linear (``torch/_inductor/fx_passes/mkldnn_fusion.py``):
``torch.ops.mkldnn._reorder_linear_weight(weight [N, K])`` returns the weight
as an opaque MKLDNN tensor in the blocked layout (same number of bytes as the
dense weight; the dense one can then be freed), and
``torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")`` computes
``x @ weight.T`` from it. The batch-size hint of the reorder is left unset: one
layout then serves decode and prefill, and it measured within noise of the
per-batch-size layouts.

Numerics: bfloat16 inputs and weights, float32 accumulation, one rounding of
each output to bfloat16: the same contract as ``F.linear`` in bfloat16 on CPU;
the two differ only in summation order (so a few outputs differ by one bf16
rounding step). The reorder is lossless (``to_dense()`` gives back the weight
bit for bit).

Fallback: the plain ``F.linear`` is used, with the dense weight kept as an
ordinary parameter, whenever packing does not apply: a weight that is not a
2-D bfloat16 CPU tensor (float32, float16, CUDA, ...), a torch without these
ops or without oneDNN, a CPU that oneDNN cannot run bfloat16 on, the module
switch :data:`ENABLED` off, or a one-time self-check of the ops failing. So the
module runs on any CPU, any torch 2.x and any device.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ENABLED", "PACK_TIED_LM_HEAD", "PackedLinear", "packing_available"]

#: Pack bfloat16 CPU weights (``KVPAGE_PACKED_LINEAR=0`` turns it off). Read when a weight is packed,
#: i.e. at model load; flipping it later does not unpack already-loaded models.
ENABLED: bool = os.environ.get("KVPAGE_PACKED_LINEAR", "1") != "0"

#: With tied embeddings, also keep a packed copy of the embedding matrix for the LM head. This is
#: a second copy of that matrix (the embedding lookup needs the dense one): ``V * E * 2`` bytes,
#: 56.6 MB for SmolLM2-135M, +21% of its bf16 weights. ``KVPAGE_PACK_TIED_LM_HEAD=0`` turns it off.
PACK_TIED_LM_HEAD: bool = os.environ.get("KVPAGE_PACK_TIED_LM_HEAD", "1") != "0"


@functools.lru_cache(maxsize=None)
def _onednn_bf16_works() -> bool:
    """Whether this torch and CPU run the packed bfloat16 linear, checked once per process on a tiny case."""
    try:
        mkldnn = torch.ops.mkldnn
        reorder, linear = mkldnn._reorder_linear_weight, mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available() or not mkldnn._is_mkldnn_bf16_supported():
            return False
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=gen).bfloat16()  # [N, K]
        x = torch.randn(3, 40, generator=gen).bfloat16()  # [M, K]
        with torch.no_grad():
            y = linear(x, reorder(w), None, "none", [], "")  # [M, N]
        ref = x.double() @ w.double().T
        return y.dtype == torch.bfloat16 and y.shape == ref.shape and bool(
            torch.allclose(y.double(), ref, rtol=2**-7, atol=1e-2)
        )
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return False


def packing_available(weight: torch.Tensor) -> bool:
    """Whether :class:`PackedLinear` would pack ``weight`` (2-D bfloat16 strided CPU tensor, ops working)."""
    return (
        ENABLED
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.layout == torch.strided
        and torch.backends.mkldnn.enabled
        and _onednn_bf16_works()
    )


class PackedLinear(nn.Module):
    """``y = x @ weight.T`` (no bias), from a oneDNN-prepacked weight where that pays, else plain ``F.linear``.

    Shapes and dtypes: ``weight [N, K]`` (``out_features``, ``in_features``);
    ``forward(x [..., K]) -> [..., N]`` in ``x``'s dtype, which must equal the
    weight's (as for ``F.linear``).

    Packed (2-D bfloat16 CPU weight, see the module docstring): the module holds
    only the packed tensor; the dense weight passed in is not kept (drop your own
    references to it to free it). ``weight`` then returns a fresh dense copy, for
    inspection; it is not a parameter, and ``parameters()`` does not list it.
    Moving or casting the module (``.to("cuda")``, ``.float()``, ...) unpacks
    it and converts the dense weight; whenever a move or cast leaves a packable
    weight, it is packed (again). ``.to("cpu")`` on a packed module is a no-op. ``state_dict()``
    holds the dense weight under ``weight`` either way.

    Unpacked: ``weight`` is an ordinary ``requires_grad=False`` parameter and
    ``forward`` is ``F.linear(x, weight)``.

    ``copy_of_shared=True`` is for a packed copy of a weight that another module
    owns (the tied LM head): it packs or holds nothing (``is_packed`` False), is
    left out of ``state_dict()``, and drops its copy instead of moving it;
    callers then use the owner's weight.

    Args:
        weight: ``[N, K]`` dense weight.
        copy_of_shared: see above.
    """

    def __init__(self, weight: torch.Tensor, *, copy_of_shared: bool = False) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"PackedLinear takes a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.copy_of_shared = copy_of_shared
        self._packed: torch.Tensor | None = None
        self._set_weight(weight.detach())

    def _set_weight(self, weight: torch.Tensor) -> None:
        self._parameters.pop("weight", None)
        self._packed = None
        if packing_available(weight):
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())  # opaque [N, K]
        elif not self.copy_of_shared:
            self._parameters["weight"] = nn.Parameter(weight, requires_grad=False)

    @property
    def is_packed(self) -> bool:
        """Whether ``forward`` runs on the packed weight."""
        return self._packed is not None

    @property
    def weight(self) -> torch.Tensor:
        """``[N, K]``: the parameter when unpacked; a new dense copy of the packed weight otherwise."""
        if self._packed is not None:
            return self._packed.to_dense()
        if "weight" not in self._parameters:
            raise AttributeError("this PackedLinear holds no weight (a dropped copy of a shared weight)")
        return self._parameters["weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` → ``[..., N]``."""
        packed = self._packed
        if packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return F.linear(x, self.weight)  # unpacked, or a mismatched input (F.linear raises its usual error)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> PackedLinear:
        if self._packed is None:
            super()._apply(fn, *args, **kwargs)
            weight = self._parameters.get("weight")
            if weight is not None and packing_available(weight):  # e.g. back from CUDA to the CPU
                self._set_weight(weight.detach())
            return self
        probe = fn(torch.empty(0, dtype=torch.bfloat16))  # where does fn send a CPU bf16 tensor?
        if probe.device.type == "cpu" and probe.dtype == torch.bfloat16:
            return self  # .to("cpu"), share_memory_(), ...: stays packed (MKLDNN tensors cannot be shared)
        if self.copy_of_shared:
            self._packed = None
            return self
        self._set_weight(fn(self._packed.to_dense()))
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self._packed is not None and not self.copy_of_shared:
            destination[prefix + "weight"] = self._packed.to_dense()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.is_packed}"
