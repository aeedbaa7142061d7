"""``KVPageCache`` pieces on random tensors: the block table, one layer's write/read, batch moves, errors.

What a layer returns is checked against kvpage's formats called directly (quantize then dequantize, seal then
unseal), so these tests hold for any rounding: they compare the same arithmetic done two ways.
"""
from __future__ import annotations

import pytest
import torch
from _hf_cache import tiny_model
from transformers import DeepseekV3Config, Llama4TextConfig, Qwen3NextConfig, T5Config

from kvpage.cache.tail.pool import SINK_FORMAT
from kvpage.errors import KVCacheLayoutError, OutOfBlocksError
from kvpage.formats import get_format
from kvpage.integrations.transformers import (
    KVPageCache,
    KVPageLayer,
    SealedKVPageLayer,
    UnsupportedModelError,
    UnsupportedTransformersError,
    check_transformers_version,
)
from kvpage.integrations.transformers.blocks import BlockTable
from kvpage.spec import LayerSpec

H, D = 2, 16


def _kv(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, H, n, D, generator=g), torch.randn(rows, H, n, D, generator=g)


def _token_roundtrip(fmt: str, x: torch.Tensor, kind: str) -> torch.Tensor:
    """``[B, H, n, D]`` through the format's per-token quantize/dequantize (what the cache must return)."""
    f = get_format(fmt)
    rows = x.transpose(1, 2).reshape(-1, H, D)
    q = f.quantize(rows, kind=kind)
    return f.dequantize(q.codes, q.scale, torch.float32, kind=kind).view(x.shape[0], -1, H, D).transpose(1, 2)


# -- BlockTable ------------------------------------------------------------------------------------


def test_block_table_shares_on_reorder_and_copies_on_write() -> None:
    t = BlockTable(block_size=4, capacity=8)
    t.set_rows(2)
    assert t.claim(6, 0) == [] and t.rows == [[0, 1], [2, 3]]
    t.reorder([1, 1])                                   # both rows are old row 1
    assert t.rows == [[2, 3], [2, 3]] and t.refs[:4] == [0, 0, 2, 2] and t.blocks_in_use() == 2
    copies = t.claim(7, 1)         # both write into block 1 (shared): the first row takes a copy, the last keeps it
    assert copies == [(3, 1)] and t.rows == [[2, 1], [2, 3]] and t.refs[:4] == [0, 1, 2, 1]
    assert t.slots(6, 1).tolist() == [1 * 4 + 2, 3 * 4 + 2]
    t.truncate(3)
    assert t.rows == [[2], [2]] and t.blocks_in_use() == 1
    t.claim(12, 0)
    t.drop_before(2)
    assert t.first == 2 and t.num_blocks == 1 and t.blocks_in_use() == 2
    with pytest.raises(ValueError, match="dropped"):
        t.truncate(5)


def test_block_table_limit_raises_out_of_blocks() -> None:
    t = BlockTable(block_size=4, capacity=2, limit=3)
    t.grow(3)
    with pytest.raises(OutOfBlocksError, match="max_cache_tokens"):
        t.grow(4)


# -- one layer ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["float32", "int8", "fp8", "int8_rotated"])
def test_token_layer_returns_what_the_format_stores(fmt: str) -> None:
    layer = KVPageLayer(LayerSpec(H, D, 4, fmt), 0)
    k1, v1 = _kv(2, 7, 0)
    k2, v2 = _kv(2, 1, 1)
    layer.update(k1, v1)
    keys, values = layer.update(k2, v2)
    assert keys.shape == values.shape == (2, H, 8, D) and layer.get_seq_length() == 8
    want_k = torch.cat([_token_roundtrip(fmt, k1, "key"), _token_roundtrip(fmt, k2, "key")], 2)
    want_v = torch.cat([_token_roundtrip(fmt, v1, "value"), _token_roundtrip(fmt, v2, "value")], 2)
    assert torch.allclose(keys, want_k, atol=1e-6) and torch.allclose(values, want_v, atol=1e-6)
    if fmt == "float32":
        assert torch.equal(keys, torch.cat([k1, k2], 2))
    assert layer.get_mask_sizes(3) == (11, 0) and layer.get_max_length() == -1


def test_sealed_layer_reads_blocks_as_the_engine_does() -> None:
    """int2, block 4, window of one block: after 13 tokens decoded one by one, the 14th token's context is
    block 0 from its 8-bit copy, block 1 sealed, block 2 its 16-bit window copy, block 3 (open) as written."""
    layer = SealedKVPageLayer(LayerSpec(H, D, 4, "int2"), 0, residual_tokens=4)
    k, v = _kv(1, 14, 2)
    for i in range(14):
        keys, _ = layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
    fmt = get_format("int2")
    blocks = k.transpose(1, 2)[0, :12].to(torch.float16).view(3, 4, H, D)        # what was sealed, tail dtype
    sealed = fmt.unseal(fmt.seal(blocks, "key"), "key", torch.float32, D)          # [3, 4, H, D]
    q = SINK_FORMAT.quantize(blocks[0], kind="key")
    got = keys[0].transpose(0, 1)                                                   # [14, H, D]
    assert torch.equal(got[:4], SINK_FORMAT.dequantize(q.codes, q.scale, torch.float32, kind="key"))
    assert torch.equal(got[4:8], sealed[1])
    assert torch.equal(got[8:12], blocks[2].float())
    assert torch.equal(got[12:], k.transpose(1, 2)[0, 12:].to(torch.float16).float())
    assert sorted(layer.copies) == [2] and layer.has_sink


def test_reorder_shares_blocks_and_each_row_keeps_its_own_history() -> None:
    layer = KVPageLayer(LayerSpec(H, D, 4, "float32"), 0)
    k, v = _kv(2, 6, 3)
    layer.update(k, v)
    layer.reorder_cache(torch.tensor([1, 1, 0]))                   # three beams: two children of row 1
    assert layer.table.num_rows == 3 and layer.kv_bytes() == 4 * layer.spec.bytes_per_block
    k2, v2 = _kv(3, 3, 4)                                            # different new tokens per beam
    keys, _ = layer.update(k2, v2)
    parents = [1, 1, 0]
    for row, parent in enumerate(parents):
        assert torch.equal(keys[row], torch.cat([k[parent], k2[row]], 1))
    layer.batch_select_indices(torch.tensor([True, False, True]))
    layer.batch_repeat_interleave(2)
    keys, _ = layer.update(*_kv(4, 1, 5))
    assert keys.shape == (4, H, 10, D)
    assert torch.equal(keys[0, :, :9], keys[1, :, :9]) and torch.equal(keys[2, :, :6], k[0])


def test_sliding_layer_frees_blocks_and_reports_mask_sizes() -> None:
    layer = KVPageLayer(LayerSpec(H, D, 4, "int8"), 0, sliding_window=6)
    assert layer.is_sliding and layer.get_max_length() == 6
    k, v = _kv(1, 20, 6)
    layer.update(k[:, :, :10], v[:, :, :10])
    for i in range(10, 20):
        kv_len, offset = layer.get_mask_sizes(1)
        keys, _ = layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
        assert keys.shape[2] == kv_len == i + 1 - offset              # what the mask was sized for
        assert offset % 4 == 0 and offset <= i - 5                     # the query's window (i-5 .. i) is kept
    assert layer.table.first == (20 - 6 + 1) // 4 and layer.table.num_blocks == 5 - layer.table.first


def test_max_cache_tokens_preallocates_and_bounds_the_pool() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    cache = KVPageCache(model.config, "int8", max_cache_tokens=32, block_size=8)
    k, v = _kv(2, 20, 7)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    assert layer.table.capacity == 32 // 8 + 2 and cache.allocated_bytes() == 6 * layer.spec.bytes_per_block
    with pytest.raises(OutOfBlocksError, match="max_cache_tokens"):
        cache.update(*_kv(2, 12, 8), 0)


def test_reset_forgets_tokens_and_keeps_the_pool() -> None:
    model = tiny_model("llama", num_hidden_layers=1)
    cache = KVPageCache(model.config, "int4", block_size=8)
    cache.update(*_kv(1, 20, 9), 0)
    allocated = cache.allocated_bytes()
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.kv_bytes() == 0
    keys, _ = cache.update(*_kv(3, 5, 10), 0)
    assert keys.shape == (3, H, 5, D) and cache.layers[0].table.capacity >= 3


def test_auto_takes_the_dtype_of_the_first_keys() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    cache = KVPageCache(model.config, "auto")
    assert cache.kv_format.name == "float32"
    k, v = _kv(1, 4, 11)
    keys, _ = cache.update(k.bfloat16(), v.bfloat16(), 0)
    assert cache.kv_format.name == "bfloat16" and keys.dtype == torch.bfloat16
    assert torch.equal(keys, k.bfloat16())


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, match", [
    (lambda: DeepseekV3Config(num_hidden_layers=2), "multi-latent"),
    (lambda: T5Config(), "encoder-decoder"),
    (lambda: Qwen3NextConfig(num_hidden_layers=4), "linear_attention"),
    (lambda: Llama4TextConfig(num_hidden_layers=4), "chunked_attention"),
])
def test_unsupported_model_configs_are_named(config, match: str) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        KVPageCache(config(), "int8")


def test_bad_updates_name_the_layer() -> None:
    model = tiny_model("llama", num_hidden_layers=2)
    cache = KVPageCache(model.config, "int8")
    with pytest.raises(KVCacheLayoutError, match="layer 1"):
        cache.update(torch.zeros(1, 3, 2, D), torch.zeros(1, 3, 2, D), 1)      # 3 KV heads, config has 2
    cache.update(*_kv(2, 3, 12), 0)
    with pytest.raises(KVCacheLayoutError, match="batch rows"):
        cache.update(*_kv(3, 1, 13), 0)


def test_transformers_version_range_is_checked() -> None:
    assert check_transformers_version("5.0.0") == "5.0.0"
    check_transformers_version()                                                # the installed one
    for bad in ("4.57.1", "6.0.0"):
        with pytest.raises(UnsupportedTransformersError, match="5.0.0"):
            check_transformers_version(bad)
