"""Step metadata to the device: the same values on every device, and on CUDA without waiting for queued kernels.

The CUDA test runs in the device check (``KVPAGE_TRITON_TEST_DEVICE=cuda``, ``benchmarks/gpu_check.sh``): a long
kernel is queued first, and the copy must return while it still runs (a pageable copy would have waited for it).
"""
from __future__ import annotations

import os

import pytest
import torch

from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.staging import to_device

CUDA = os.environ.get("KVPAGE_TRITON_TEST_DEVICE") == "cuda"


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8])
def test_values_dtype_and_shape_are_kept(dtype: torch.dtype) -> None:
    vals = [3, 0, 7, 255 if dtype == torch.uint8 else 2**20]
    t = to_device(vals, dtype, "cpu")
    assert t.dtype == dtype and t.device.type == "cpu" and t.tolist() == vals
    grid = torch.arange(12, dtype=torch.int64).view(3, 4)
    g = to_device(grid, dtype, "cpu")
    assert g.shape == (3, 4) and g.dtype == dtype and torch.equal(g.long(), grid)
    assert to_device([], dtype, "cpu").shape == (0,)


def test_attention_metadata_is_built_through_it() -> None:
    meta = AttentionMetadata.build(block_tables=[[4, 2], [9]], seq_lens=[20, 3], query_lens=[1, 3],
                                   slot_mapping=[35, 144, 145, 146], block_size=16, device="cpu")
    assert meta.block_tables.tolist() == [[4, 2], [9, 0]]
    assert meta.slot_mapping.tolist() == [35, 144, 145, 146] and meta.slot_mapping.dtype == torch.long


@pytest.mark.skipif(not CUDA, reason="CUDA: the device check (KVPAGE_TRITON_TEST_DEVICE=cuda)")
def test_cuda_copy_does_not_wait_for_queued_kernels() -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)                      # ~1 s of GPU time queued on the current stream
    after_sleep = torch.cuda.current_stream().record_event()
    t = to_device(list(range(4096)), torch.long, "cuda")
    assert not after_sleep.query()                        # the host came back while the kernel still ran
    torch.cuda.synchronize()
    assert t.device.type == "cuda" and t.tolist() == list(range(4096))
    meta = AttentionMetadata.build(block_tables=[[4, 2]], seq_lens=[20], query_lens=[1], slot_mapping=[35],
                                   block_size=16, device="cuda")
    assert meta.block_tables.is_cuda and meta.block_tables.tolist() == [[4, 2]]
