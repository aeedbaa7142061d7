"""Shared check of cases C01 and C29: a quantized main cache with draft/MTP layers, allocated by the controller on
some device, has every main and draft tensor in the dtype and shape its spec says -- never the model dtype."""
from __future__ import annotations

import torch

from kvpage.cache.controller import CacheController
from kvpage.spec import CacheSpec


def check_quantized_main_and_draft_allocation(fmt: str, model_dtype: torch.dtype, device: str | torch.device) -> None:
    """Allocate 5 blocks of a 3-layer model with 2 draft layers on ``device``; assert each tensor's device, dtype and
    shape against the spec, 1-byte codes that are not the model dtype, and a block costing exactly the spec's bytes."""
    device = torch.device(device)
    spec = CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=64, block_size=32, kv_cache_dtype=fmt,
                           num_draft_layers=2, model_dtype=model_dtype)
    caches = CacheController(spec, device=device).allocate_device(5)
    assert sorted(caches) == [0, 1, 2, 3, 4]  # three model layers, then the two draft layers
    assert [g.name for g in spec.groups] == ["main", "draft"]
    for i, cache in caches.items():
        ls = spec.layer(i)
        want = {t.name: t for t in ls.tensors}
        assert set(cache) == set(want), i
        for name, tensor in cache.items():
            assert tensor.device.type == device.type, (i, name)
            assert tensor.dtype == want[name].dtype and tuple(tensor.shape) == (5, *want[name].shape), (i, name)
        assert cache["key"].dtype == torch.uint8 and cache["key"].dtype != model_dtype
        assert sum(t.element_size() * t[0].numel() for t in cache.values()) == ls.bytes_per_block, i
