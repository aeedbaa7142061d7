"""Host pools in 2 MiB pages (``kvpage.cache.huge_pages``): same contents as ``torch.zeros``, aligned, advised."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.huge_pages import HUGE_PAGE_BYTES, zeros_in_huge_pages
from kvpage.spec import CacheSpec

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8, torch.float16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5), (97, 16, 3, 64), (700, 16, 2, 128)])
def test_zeros_in_huge_pages_equals_torch_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = zeros_in_huge_pages(shape, dtype)
    ref = torch.zeros(shape, dtype=dtype)
    assert x.shape == ref.shape and x.dtype == dtype and x.is_contiguous()
    assert torch.equal(x.view(torch.uint8), ref.view(torch.uint8))
    nbytes = x.numel() * x.element_size()
    if sys.platform.startswith("linux") and nbytes >= HUGE_PAGE_BYTES:
        assert x.data_ptr() % HUGE_PAGE_BYTES == 0
    x.view(torch.uint8).fill_(7)  # the whole view is writable memory of its own
    assert int(x.view(torch.uint8).sum()) == 7 * nbytes


def _vm_flags(address: int) -> list[str]:
    """``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)")
def test_a_large_pool_is_advised_for_huge_pages() -> None:
    """The whole pool's mapping carries the kernel's huge-page advice (``hg`` in its VmFlags).

    Whether the kernel then finds free 2 MiB frames depends on the machine's memory (a busy CI machine may have
    none), so the advice is what is asserted, not the AnonHugePages it yields.
    """
    x = zeros_in_huge_pages((64 << 20,), torch.uint8)
    assert "hg" in _vm_flags(x.data_ptr())
    assert "hg" in _vm_flags(x.data_ptr() + x.numel() - 1 - HUGE_PAGE_BYTES)  # the advice spans the pool


def test_the_controller_allocates_host_pools_in_huge_pages() -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=64, model_dtype=torch.bfloat16, block_size=16,
                           kv_cache_dtype="int8")
    cache = CacheController(spec).initialize_kv_cache(1100)  # keys and values 1100 x 2 KiB each, scales 68 KiB
    for layer in cache.values():
        for name, t in layer.items():
            assert t.device.type == "cpu" and not t.is_pinned()
            if sys.platform.startswith("linux") and t.numel() * t.element_size() >= HUGE_PAGE_BYTES:
                assert t.data_ptr() % HUGE_PAGE_BYTES == 0, name
            assert not t.view(torch.uint8).any(), name
