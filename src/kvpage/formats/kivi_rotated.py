"""``int4_rotated``, ``int3_rotated``, ``int2_rotated``: the KIVI formats of :mod:`kvpage.formats.kivi` on Hadamard-rotated rows.

Same bytes per block as ``int4``/``int3``/``int2`` and the same coding (their step search, scales and zero
points), applied to ``x @ R`` instead of ``x`` (``R``: the per-head orthonormal Hadamard matrix of
:mod:`kvpage.formats.rotation`, block-diagonal for a ``head_dim`` that is not a power of two, 96 = 64 + 32).
The rotation spreads keys' outlier channels over the head (QuaRot, RotateKV), so the per-channel key steps and
per-token value steps code the rest more finely. Attention does not un-rotate: the ops rotate q, k and v when
the layer's pass enters them and the output back (:meth:`~kvpage.formats.BlockFormat.rotation`), so the tail,
the window and first-block copies hold rotated rows too and the kernels run unchanged.

Measured (``benchmarks/ACCURACY.md``, chunked-32 suite): lower Δppl and KLD than the plain formats at the same
bits. The price: a value group with a large common offset (case C21) is not coded within ``int4``'s 0.04 --
the rotation gathers the offset into one coordinate per Sylvester block, whose range then sets the group's
step. The bound that holds is the plain formats' bound in the rotated basis, which the orthonormal ``R`` keeps
as an L2 bound in the original basis: per value row and head, ``||x_hat - x||_2^2 <= sum_G g * (c_G / 2)^2``
over its groups ``G`` of ``g`` channels of ``x @ R`` (``c_G``: :func:`~kvpage.formats.kivi.covering_step`); per
key block, head and channel of ``x @ R``, RMS over the block's tokens ``<= c / 2`` (so the block's Frobenius
error is at most ``sqrt(block_size * sum_channels (c / 2)^2)``), plus float32 rounding of the rotation.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from kvpage.formats.kivi import Int2Format, Int3Format, Int4Format, SealedFormat
from kvpage.formats.rotation import hadamard_rotation, hadamard_transform


class RotatedSealedFormat(SealedFormat):
    """A KIVI format whose rows are stored rotated by ``R`` (mixed in before ``Int4Format`` and its siblings).

    :meth:`seal` / :meth:`unseal` keep the original basis (integrations that hand over plain rows, e.g. the
    transformers cache, work unchanged); :meth:`seal_rotated` / :meth:`unseal_rotated` are the base format's
    coding in the stored basis, what the attention ops call. ``version`` is the base coding's: the name (part of
    the spec fingerprint as well) tells the rotation apart.
    """

    def rotation(self, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """``R`` ``[head_dim, head_dim]`` (:func:`~kvpage.formats.rotation.hadamard_rotation`; symmetric, ``R R = I``)."""
        return hadamard_rotation(head_dim, dtype, str(device))

    def to_stored_basis(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R`` in float32 by the row-independent butterflies (:func:`~kvpage.formats.rotation.hadamard_transform`)."""
        return hadamard_transform(x.float())

    def seal(self, blocks: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        """Rotate ``blocks`` (original basis, any float dtype) and code them (:meth:`seal_rotated`); not modified."""
        return self.seal_rotated(self.to_stored_basis(blocks), kind)

    def seal_rotated(self, blocks: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
        """The base format's :meth:`~kvpage.formats.kivi.SealedFormat.seal` of stored-basis blocks."""
        return super().seal(blocks, kind)

    def unseal(
        self, tensors: Mapping[str, torch.Tensor], kind: str, dtype: torch.dtype, head_dim: int
    ) -> torch.Tensor:
        """Decode and rotate back to the original basis (``R`` is its own inverse) in ``dtype``; inputs not modified."""
        return self.to_stored_basis(self.unseal_rotated(tensors, kind, torch.float32, head_dim)).to(dtype)

    def unseal_rotated(
        self, tensors: Mapping[str, torch.Tensor], kind: str, dtype: torch.dtype, head_dim: int
    ) -> torch.Tensor:
        """The base format's :meth:`~kvpage.formats.kivi.SealedFormat.unseal`: the stored basis ``x @ R``."""
        return super().unseal(tensors, kind, dtype, head_dim)


class Int4RotatedFormat(RotatedSealedFormat, Int4Format):
    """``int4_rotated``: ``int4``'s codes and bytes of Hadamard-rotated rows (module docstring: bound, cost).

    Its first-block copy holds row 0 alone (``sink_rows = 1``): screened on the tuning members
    (``benchmarks/ACCURACY.md``, "Row 0 copied, block 0 sealed as it is"), the copy of the whole block (0.26 bits at
    1,024 tokens) gave 0.0044 mean KLD of the first three members, row 0 alone (0.008 bits, block 0 sealed as it is)
    0.0047, no copy 0.0097: the rotation spreads the sink's outlier channels, so block 0's other rows survive their
    seal (unrotated ``int4`` lost 29% there, and keeps the whole block).
    """

    name = "int4_rotated"
    aliases = ()
    sink_rows = 1


class Int3RotatedFormat(RotatedSealedFormat, Int3Format):
    """``int3_rotated``: ``int3``'s codes and bytes of Hadamard-rotated rows (module docstring: bound, cost).

    Row 0 alone in its first-block copy, as ``int3`` (screened: 0.0191 mean KLD of the first three tuning members
    against 0.0179 with the whole block, for 0.25 bits less at 1,024 tokens).
    """

    name = "int3_rotated"
    aliases = ()


class Int2RotatedFormat(RotatedSealedFormat, Int2Format):
    """``int2_rotated``: ``int2``'s codes and bytes (and its 32-token window) of Hadamard-rotated rows."""

    name = "int2_rotated"
    aliases = ()
