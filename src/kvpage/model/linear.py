"""Bias-free linear layers whose bfloat16 CPU weights are packed once for a matrix-multiply kernel.

Why: on CPU, torch's ``F.linear`` in bfloat16 streams the weight at only ~7 GB/s
when the batch is small (one thread, SmolLM2-135M shapes), no faster per
parameter than float32 at twice the bytes, and decode is bound by exactly that
read. Two packings of the same bytes, behind one interface (:class:`WeightPacking`),
the first that works on this CPU and torch chosen per weight (:data:`PACKINGS`):

* :class:`AmxTiles` (CPUs with AMX: Intel Xeon 4th generation and later): the weight
  reordered into the AMX B tiles that ``TDPBF16PS`` reads, multiplied by kvpage's
  own kernel (``ops/cpu/amx_linear.cpp``), which prefetches the weight's lines
  ahead of the tiles it multiplies and costs ~1 us a call against oneDNN's ~15.
  A decode step's 121 SmolLM2-135M projections, one thread, weights cold: at 32
  rows 31.2 ms with oneDNN's packing, 21.6 ms with these tiles (1.44x); at one row
  25.6 -> 19.8 ms; two threads at 32 rows 17.9 -> 11.8 ms. Prefill is the other
  way round: compute-bound at 256-2,048 rows, oneDNN's kernel is faster (the
  tiles take 1.2-1.4x its time per decoder layer), and the one packed copy serves
  both; ``benchmarks/ab_commits.py``'s mix, prefill included, is the check.
* :class:`OneDnnBlocked` (any CPU oneDNN runs bfloat16 on): the weight reordered once
  into oneDNN's preferred blocked layout streams at ~10-15 GB/s: at one row 1.4x
  faster than ``F.linear`` summed over a decoder layer's four projections and 1.7x
  for SmolLM2's 49152-row LM head, 1.3-1.5x for 512-row prefill chunks. Where it
  comes from: the ops inductor's CPU freezing pass emits for a bfloat16 linear
  (``torch/_inductor/fx_passes/mkldnn_fusion.py``):
  ``torch.ops.mkldnn._reorder_linear_weight(weight [N, K])`` returns the weight as an
  opaque MKLDNN tensor in the blocked layout (same number of bytes as the dense
  weight; the dense one can then be freed), and
  ``torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")`` computes
  ``x @ weight.T`` from it. The batch-size hint of the reorder is left unset: one
  layout then serves decode and prefill, within noise of per-batch-size layouts.

float32 gains nothing from packing (MKL's and oneDNN's packed float32 paths are at
best 1.05x), float16 only ~1.1x, so both stay on plain ``F.linear``.

Numerics: bfloat16 inputs and weights, float32 accumulation, one rounding of
each output to bfloat16 (nearest even): the same contract as ``F.linear`` in
bfloat16 on CPU; they differ only in summation order (so a few outputs differ by
one bf16 rounding step). Both packings are lossless (``weight`` gives back the
dense weight bit for bit).

Fallback: the plain ``F.linear`` is used, with the dense weight kept as an
ordinary parameter, whenever no packing applies: a weight that is not a 2-D
bfloat16 CPU tensor (float32, float16, CUDA, ...), a torch without the ops, a CPU
that runs neither, the module switch :data:`ENABLED` off, or a packing's one-time
self-check failing. So the module runs on any CPU, any torch 2.x and any device.
"""
from __future__ import annotations

import abc
import functools
import os
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AMX_ENABLED", "ENABLED", "PACKINGS", "PACK_TIED_LM_HEAD", "AmxTiles", "OneDnnBlocked", "PackedLinear",
           "WeightPacking", "packing_available", "packing_for"]

#: Pack bfloat16 CPU weights (``KVPAGE_PACKED_LINEAR=0`` turns it off). Read when a weight is packed,
#: i.e. at model load; flipping it later does not unpack already-loaded models.
ENABLED: bool = os.environ.get("KVPAGE_PACKED_LINEAR", "1") != "0"

#: Prefer :class:`AmxTiles` where the CPU has AMX (``KVPAGE_AMX_LINEAR=0``: oneDNN's packing instead, e.g. for an
#: A/B). Read when a weight is packed.
AMX_ENABLED: bool = os.environ.get("KVPAGE_AMX_LINEAR", "1") != "0"

#: With tied embeddings, also keep a packed copy of the embedding matrix for the LM head. This is
#: a second copy of that matrix (the embedding lookup needs the dense one): ``V * E * 2`` bytes,
#: 56.6 MB for SmolLM2-135M, +21% of its bf16 weights. ``KVPAGE_PACK_TIED_LM_HEAD=0`` turns it off.
PACK_TIED_LM_HEAD: bool = os.environ.get("KVPAGE_PACK_TIED_LM_HEAD", "1") != "0"

_CHECKED_ERRORS = (AttributeError, RuntimeError, NotImplementedError, TypeError)


def _self_check(pack: Callable[[torch.Tensor], torch.Tensor],
                matmul: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]) -> bool:
    """Whether ``matmul(x, pack(w), N, K)`` is ``x @ w.T`` within bfloat16 rounding on two tiny cases: odd sizes, and
    a model's (K a multiple of 32, more than 32 rows)."""
    gen = torch.Generator().manual_seed(0)
    for n, k, m in ((48, 40, 3), (40, 64, 40)):
        w = torch.randn(n, k, generator=gen).bfloat16()  # [N, K]
        x = torch.randn(m, k, generator=gen).bfloat16()  # [M, K]
        with torch.no_grad():
            y = matmul(x, pack(w), n, k)  # [M, N]
        ref = x.double() @ w.double().T
        if not (y.dtype == torch.bfloat16 and y.shape == ref.shape
                and bool(torch.allclose(y.double(), ref, rtol=2**-7, atol=1e-2))):
            return False
    return True


class WeightPacking(abc.ABC):
    """A way to hold a 2-D bfloat16 CPU weight ``[N, K]`` for a kernel: pack once, multiply many times, unpack.

    Subclasses implement the five abstract methods (and may narrow :meth:`allowed`); :data:`PACKINGS` lists them in
    order of preference.
    """

    #: Short name, shown in :meth:`PackedLinear.extra_repr`.
    name = ""

    def allowed(self) -> bool:
        """Whether the switches let :func:`packing_for` choose this packing now (read at each call; default: yes)."""
        return True

    @abc.abstractmethod
    def works(self) -> bool:
        """Whether this torch and CPU run the packing (checked once per process, on a tiny case)."""
        raise NotImplementedError

    @abc.abstractmethod
    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` (contiguous bfloat16 CPU) -> the packed tensor (no side effects)."""
        raise NotImplementedError

    @abc.abstractmethod
    def unpack(self, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """The dense ``[N, K]`` weight of ``packed``, bit for bit, as a new tensor."""
        raise NotImplementedError

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """``x [M, K]`` bfloat16 -> ``x @ weight.T`` ``[M, N]`` bfloat16 (float32 sums, one rounding).

        Raises:
            RuntimeError: ``x``'s last size is not ``in_features`` (as ``F.linear`` does).
        """
        raise NotImplementedError

    @abc.abstractmethod
    def nbytes(self, packed: torch.Tensor, out_features: int, in_features: int) -> int:
        """Bytes ``packed`` takes in memory."""
        raise NotImplementedError


class OneDnnBlocked(WeightPacking):
    """oneDNN's blocked layout (an opaque MKLDNN tensor), multiplied by ``torch.ops.mkldnn._linear_pointwise``."""

    name = "onednn"

    def allowed(self) -> bool:
        """See :meth:`WeightPacking.allowed`: only with ``torch.backends.mkldnn.enabled``."""
        return torch.backends.mkldnn.enabled

    @functools.lru_cache(maxsize=None)  # (few instances: PACKINGS' and the tests'; each cached for the process)
    def works(self) -> bool:
        """See :meth:`WeightPacking.works`."""
        try:
            mkldnn = torch.ops.mkldnn
            if not torch.backends.mkldnn.is_available() or not mkldnn._is_mkldnn_bf16_supported():
                return False
            return _self_check(self.pack, self.matmul)
        except _CHECKED_ERRORS:
            return False

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """See :meth:`WeightPacking.pack`: an MKLDNN tensor of ``N * K`` bfloat16s."""
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def unpack(self, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """See :meth:`WeightPacking.unpack`."""
        return packed.to_dense()

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """See :meth:`WeightPacking.matmul` (any leading shape of ``x`` also works)."""
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def nbytes(self, packed: torch.Tensor, out_features: int, in_features: int) -> int:
        """See :meth:`WeightPacking.nbytes`: the dense size, which the blocked layout keeps."""
        return out_features * in_features * 2


class AmxTiles(WeightPacking):
    """AMX B tiles (``ops/cpu/amx_linear.cpp``: 16 outputs x 32 inputs per 1 KiB tile, zero-padded), multiplied by
    kvpage's ``amx_linear`` kernel. Works where the kernels built with AMX and the OS grants the tile state."""

    name = "amx"

    @staticmethod
    def kernels() -> ModuleType | None:
        """The compiled CPU kernels (:func:`~kvpage.ops.cpu.build.load_kernels`: may build them once)."""
        from kvpage.ops.cpu.build import load_kernels

        return load_kernels()

    def allowed(self) -> bool:
        """See :meth:`WeightPacking.allowed`: only with :data:`AMX_ENABLED`."""
        return AMX_ENABLED

    def works(self) -> bool:
        """See :meth:`WeightPacking.works` (the kernels are looked up each time, as :func:`~kvpage.ops.cpu.build.
        load_kernels` answers now (it caches its answer; tests reset it); the self-check runs once per module)."""
        k = self.kernels()
        return k is not None and self._checked(k)

    @functools.lru_cache(maxsize=None)  # (few instances: PACKINGS' and the tests'; each cached for the process)
    def _checked(self, kernels: ModuleType) -> bool:
        """Whether ``kernels`` run AMX here and pass the self-check."""
        try:
            return bool(kernels.amx_linear_available()) and _self_check(self.pack, self.matmul)
        except _CHECKED_ERRORS:
            return False

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """See :meth:`WeightPacking.pack`: a flat bfloat16 tensor of ``ceil(N/16)*16 * ceil(K/32)*32`` elements."""
        k = self.kernels()
        assert k is not None  # works() was checked
        return k.amx_pack_linear(weight.contiguous())

    def unpack(self, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """See :meth:`WeightPacking.unpack`."""
        k = self.kernels()
        assert k is not None
        return k.amx_unpack_linear(packed, out_features, in_features)

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """See :meth:`WeightPacking.matmul` (any leading shape of ``x`` also works)."""
        k = self.kernels()
        assert k is not None
        lead = x.shape[:-1]
        rows = x.reshape(lead.numel(), x.shape[-1])  # (not -1: K may be 0)
        y = k.amx_linear(rows, packed, out_features, in_features)  # raises on a wrong K
        return y.view(*lead, out_features)  # [..., N]

    def nbytes(self, packed: torch.Tensor, out_features: int, in_features: int) -> int:
        """See :meth:`WeightPacking.nbytes`: the padded tiles."""
        return packed.numel() * packed.element_size()


#: The packings, most preferred first; :func:`packing_for` takes the first that works.
PACKINGS: tuple[WeightPacking, ...] = (AmxTiles(), OneDnnBlocked())


def packing_for(weight: torch.Tensor) -> WeightPacking | None:
    """The packing :class:`PackedLinear` uses for ``weight`` (a 2-D bfloat16 strided CPU tensor, :data:`ENABLED`;
    :class:`AmxTiles` only with :data:`AMX_ENABLED`, :class:`OneDnnBlocked` only with
    ``torch.backends.mkldnn.enabled``), or ``None`` (plain ``F.linear``)."""
    if not (ENABLED and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.layout == torch.strided):
        return None
    for packing in PACKINGS:
        if packing.allowed() and packing.works():
            return packing
    return None


def packing_available(weight: torch.Tensor) -> bool:
    """Whether :class:`PackedLinear` would pack ``weight`` (:func:`packing_for` finds a packing)."""
    return packing_for(weight) is not None


class PackedLinear(nn.Module):
    """``y = x @ weight.T`` (no bias), from a packed weight (:func:`packing_for`) where that pays, else ``F.linear``.

    Shapes and dtypes: ``weight [N, K]`` (``out_features``, ``in_features``);
    ``forward(x [..., K]) -> [..., N]`` in ``x``'s dtype, which must equal the
    weight's (as for ``F.linear``).

    Packed (2-D bfloat16 CPU weight, see the module docstring; ``packing`` names the
    :class:`WeightPacking`): the module holds only the packed tensor; the dense weight passed in is not kept (drop your own
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
        self.packing: WeightPacking | None = None
        self._set_weight(weight.detach())

    def _set_weight(self, weight: torch.Tensor) -> None:
        self._parameters.pop("weight", None)
        self._packed = None
        self.packing = packing_for(weight)
        if self.packing is not None:
            self._packed = self.packing.pack(weight)
        elif not self.copy_of_shared:
            self._parameters["weight"] = nn.Parameter(weight, requires_grad=False)

    def _dense(self) -> torch.Tensor:
        """The dense ``[N, K]`` weight of the packed tensor (a new tensor)."""
        assert self._packed is not None and self.packing is not None
        return self.packing.unpack(self._packed, self.out_features, self.in_features)

    @property
    def is_packed(self) -> bool:
        """Whether ``forward`` runs on the packed weight."""
        return self._packed is not None

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed weight (0 when not packed)."""
        if self._packed is None or self.packing is None:
            return 0
        return self.packing.nbytes(self._packed, self.out_features, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """``[N, K]``: the parameter when unpacked; a new dense copy of the packed weight otherwise."""
        if self._packed is not None:
            return self._dense()
        if "weight" not in self._parameters:
            raise AttributeError("this PackedLinear holds no weight (a dropped copy of a shared weight)")
        return self._parameters["weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` → ``[..., N]``."""
        packed = self._packed
        if packed is not None and self.packing is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return self.packing.matmul(x, packed, self.out_features, self.in_features)
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
            return self  # .to("cpu"), share_memory_(), ...: stays packed, as it is (not moved into shared memory)
        if self.copy_of_shared:
            self._packed = self.packing = None
            return self
        self._set_weight(fn(self._dense()))
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self._packed is not None and not self.copy_of_shared:
            destination[prefix + "weight"] = self._dense()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def extra_repr(self) -> str:
        packed = self.packing.name if self.is_packed and self.packing is not None else False
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={packed}"
