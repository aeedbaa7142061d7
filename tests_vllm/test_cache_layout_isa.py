"""The connector's block views against vLLM's own cache write, ISA by ISA (no engine: the op itself).

``cpu_attn_reshape_and_cache`` is what vLLM's CPU attention calls to store a step's keys and values; whatever it
writes for a block, :func:`~kvpage.integrations.vllm.cache_layout.cpu_attn_blocks`' view must read back as exactly
those keys and values, and a block the view writes must be what the op would have written.
"""
from __future__ import annotations

import pytest
import torch

from kvpage.integrations.vllm.cache_layout import cpu_attn_blocks

ops = pytest.importorskip("vllm._custom_ops")


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("bs, d", [(32, 64), (128, 64), (64, 128)])
def test_view_reads_and_writes_what_vllm_writes(isa: str, bs: int, d: int) -> None:
    h, nb = 3, 4
    g = torch.Generator().manual_seed(bs + d)
    key = torch.randn(2 * bs, h, d, generator=g).to(torch.bfloat16)            # blocks 2 and 0, in that order
    value = torch.randn(2 * bs, h, d, generator=g).to(torch.bfloat16)
    slots = torch.cat([torch.arange(2 * bs, 3 * bs), torch.arange(0, bs)])
    cache = torch.zeros(nb, h, bs, 2 * d, dtype=torch.bfloat16)
    kc, vc = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    except RuntimeError as e:  # a build or CPU without that ISA's path
        pytest.skip(f"vLLM's cache write for isa {isa} does not run here: {e}")
    view = cpu_attn_blocks("CPU_ATTN", isa, h, d, bs, "auto")
    view.check("layer", cache, torch.bfloat16)
    k, v = view.gather(cache, [2, 0])
    assert torch.equal(k.reshape(2 * bs, h, d), key) and torch.equal(v.reshape(2 * bs, h, d), value)
    again = torch.zeros_like(cache)
    view.scatter(again, [2, 0], k, v)
    assert torch.equal(again.view(torch.int16), cache.view(torch.int16))
