"""CacheSpec: bytes per block/token, budgets, fingerprints, per-group layouts, validation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpage.cache.controller import CacheController
from kvpage.errors import KVCacheLayoutError, UnknownKVFormatError
from kvpage.formats import get_format
from kvpage.ops.attention import AttentionMetadata, paged_attention
from kvpage.spec import CacheSpec, LayerGroupSpec, LayerSpec

SRC = str(Path(__file__).resolve().parents[1] / "src")


# -- C05: bytes per block ------------------------------------------------------------------------


def test_c05_block_bytes() -> None:
    layers, heads, dim, bs = 32, 8, 128, 16
    bf16 = CacheSpec.build(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=bs, kv_cache_dtype="bfloat16")
    int8 = CacheSpec.build(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=bs, kv_cache_dtype="int8")
    fp8 = CacheSpec.build(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=bs, kv_cache_dtype="fp8")
    # K and V, 2 bytes each
    assert layers * 2 * bs * heads * dim * 2 == 2_097_152
    assert bf16.bytes_per_block == 2_097_152
    # K and V codes 1 byte each + one fp16 scale per (token, head) for K and for V
    assert layers * 2 * (bs * heads * dim * 1 + bs * heads * 2) == 1_064_960
    assert int8.bytes_per_block == 1_064_960
    assert fp8.bytes_per_block == 1_064_960
    assert bf16.main.layer.bytes_per_block * layers == bf16.bytes_per_block
    assert bf16.bytes_per_token == 2_097_152 / 16

    # The block count from a budget uses the same bytes, and allocating that many fits.
    # (A budget of a few blocks keeps the allocation cheap.)
    for spec, expected_per_block in ((int8, 1_064_960), (bf16, 2_097_152)):
        budget = 3 * expected_per_block + expected_per_block - 1  # 3.99... blocks
        ctrl = CacheController(spec)
        b = ctrl.num_blocks_for_budget(budget)
        assert b.bytes_per_block == expected_per_block
        assert b.num_blocks == 3
        assert b.total_bytes == 3 * expected_per_block <= budget
        ctrl.initialize_kv_cache(b.num_blocks)
        assert ctrl.device_bytes == b.total_bytes <= budget
        # a budget of exactly 4 blocks gives 4
        assert ctrl.num_blocks_for_budget(4 * expected_per_block).num_blocks == 4


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", "int8", "fp8"])
@pytest.mark.parametrize("budget", [0, 1, 10_000, 123_457, 1_000_000])
def test_budget_is_maximal_and_allocation_fits(fmt: str, budget: int) -> None:
    spec = CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=24, block_size=5, kv_cache_dtype=fmt,
                           num_draft_layers=1)
    ctrl = CacheController(spec)
    b = ctrl.num_blocks_for_budget(budget)
    assert b.total_bytes <= budget < b.total_bytes + b.bytes_per_block
    if b.num_blocks:
        ctrl.initialize_kv_cache(b.num_blocks)
        ctrl.initialize_draft_kv_cache(b.num_blocks)
        assert ctrl.device_bytes == b.total_bytes
        by_group = {
            g.name: sum(t.numel() * t.element_size() for i in g.layer_indices for t in ctrl.device_caches[i].values())
            for g in spec.groups
        }
        assert by_group == b.group_bytes


def test_negative_budget_is_an_error() -> None:
    ctrl = CacheController(CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8))
    with pytest.raises(ValueError):
        ctrl.num_blocks_for_budget(-1)


# -- bytes per token for SmolLM2-135M's shape ----------------------------------------------------


@pytest.mark.parametrize(
    "fmt,value_bytes,scale_bytes,expected",
    [("float32", 4, 0, 46_080), ("bfloat16", 2, 0, 23_040), ("float16", 2, 0, 23_040),
     ("int8", 1, 2, 11_880), ("fp8", 1, 2, 11_880), ("int8_rotated", 1, 2, 11_880),
     ("fp8_per_token_head", 1, 2, 11_880)],
)
def test_smollm2_bytes_per_token(fmt: str, value_bytes: int, scale_bytes: int, expected: int) -> None:
    layers, heads, dim = 30, 3, 64
    # computed independently: K and V, each head_dim values + (quantized) one scale per head
    assert layers * 2 * heads * (dim * value_bytes + scale_bytes) == expected
    for bs in (16, 5, 1):
        spec = CacheSpec.build(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=bs, kv_cache_dtype=fmt)
        assert spec.bytes_per_token == expected
        assert spec.bytes_per_block == expected * bs


def test_bits_per_value() -> None:
    for fmt, bits in (("int8", 8.25), ("fp8", 8.25), ("bfloat16", 16), ("float32", 32)):
        layer = CacheSpec.build(num_layers=2, num_kv_heads=3, head_dim=64, kv_cache_dtype=fmt).layer(0)
        assert layer.bits_per_value == pytest.approx(bits)
    # key-only: still counts only what is stored per stored value
    ko = LayerSpec(3, 64, 16, "int8", has_value=False)
    assert ko.bits_per_value == pytest.approx(8.25)
    assert ko.bytes_per_block * 2 == LayerSpec(3, 64, 16, "int8").bytes_per_block


# -- fingerprint ---------------------------------------------------------------------------------

BASE = dict(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, kv_cache_dtype="int8",
            num_draft_layers=1, model_name="m")

VARIANTS = {
    "base": {},
    "format_fp8": {"kv_cache_dtype": "fp8"},
    "format_int8_rotated": {"kv_cache_dtype": "int8_rotated"},
    "format_fp8_plain": {"kv_cache_dtype": "fp8_per_token_head"},
    "format_bf16": {"kv_cache_dtype": "bfloat16"},
    "format_fp32": {"kv_cache_dtype": "float32"},
    "block_size": {"block_size": 32},
    "heads": {"num_kv_heads": 4},
    "head_dim": {"head_dim": 96},
    "layers": {"num_layers": 5},
    "draft_layers": {"num_draft_layers": 2},
    "no_draft": {"num_draft_layers": 0},
    "draft_format": {"draft_kv_cache_dtype": "bfloat16"},
    "key_only": {"has_value": False},
    "model": {"model_name": "other"},
}


def _fingerprints() -> dict[str, str]:
    return {k: CacheSpec.build(**{**BASE, **v}).fingerprint for k, v in VARIANTS.items()}


def test_fingerprint_differs_for_any_layout_change() -> None:
    fps = _fingerprints()
    assert len(set(fps.values())) == len(fps), fps
    for fp in fps.values():
        assert len(fp) == 64 and int(fp, 16) >= 0  # sha256 hex


def test_rotated_formats_record_their_format_version() -> None:
    """Rotated and plain rows have the same tensors, so only the format name and version (in describe()
    and hence the fingerprint) keep a store from reading one as the other. The name "int8" meant plain
    rows (version 1), then rotated rows (2), and plain rows again (3; rotated ones are "int8_rotated")."""
    for fmt, plain, versions in (("int8_rotated", "int8", (1, 3)), ("fp8", "fp8_per_token_head", (2, 1))):
        rot = CacheSpec.build(**{**BASE, "kv_cache_dtype": fmt})
        old = CacheSpec.build(**{**BASE, "kv_cache_dtype": plain})
        d_rot, d_old = rot.main.layer.describe(), old.main.layer.describe()
        assert d_rot["format"] == fmt and d_old["format"] == plain
        assert (d_rot["format_version"], d_old["format_version"]) == versions
        assert d_rot["tensors"] == d_old["tensors"]  # same bytes per block: only the meaning differs
        assert rot.fingerprint != old.fingerprint


@pytest.mark.parametrize("base", ["int4", "int3", "int2"])
def test_rotated_sealed_formats_never_share_a_fingerprint_with_their_base(base: str) -> None:
    """int4_rotated & co. store the very tensors of int4 & co. (same bytes per block) with another meaning:
    their name in describe() keeps records of one from ever matching the other."""
    kw = {**BASE, "block_size": 32, "num_draft_layers": 0}
    rot = CacheSpec.build(**{**kw, "kv_cache_dtype": base + "_rotated"})
    plain = CacheSpec.build(**{**kw, "kv_cache_dtype": base})
    d_rot, d_plain = rot.main.layer.describe(), plain.main.layer.describe()
    assert (d_rot["format"], d_plain["format"]) == (base + "_rotated", base)
    assert d_rot["tensors"] == d_plain["tensors"] and rot.bytes_per_block == plain.bytes_per_block
    assert rot.fingerprint != plain.fingerprint


def test_fingerprint_ignores_spelling_only() -> None:
    a = CacheSpec.build(**{**BASE, "kv_cache_dtype": "fp8"})
    b = CacheSpec.build(**{**BASE, "kv_cache_dtype": "FP8_E4M3"})
    assert a.fingerprint == b.fingerprint
    c = CacheSpec.build(**{**BASE, "kv_cache_dtype": "block_wise_fp8"})
    plain = CacheSpec.build(**{**BASE, "kv_cache_dtype": "fp8_per_token_head"})
    assert c.fingerprint == plain.fingerprint != a.fingerprint  # FastDeploy's name: unrotated rows
    auto = CacheSpec.build(**{**BASE, "kv_cache_dtype": "auto"}, model_dtype=torch.bfloat16)
    bf16 = CacheSpec.build(**{**BASE, "kv_cache_dtype": "bf16"})
    assert auto.fingerprint == bf16.fingerprint
    # the draft group defaults to the main format: explicit same format is the same layout
    same = CacheSpec.build(**{**BASE, "draft_kv_cache_dtype": "int8"})
    assert same.fingerprint == CacheSpec.build(**BASE).fingerprint
    # the description is plain JSON
    json.dumps(a.describe())


def test_fingerprint_stable_across_processes() -> None:
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {SRC!r})\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_spec import _fingerprints\n"
        "print(json.dumps(_fingerprints()))\n"
    )
    here = _fingerprints()
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": SRC}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1]) == here



#: Fingerprints of released layouts (3 layers, 2 kv heads, head_dim 64, model "m"): stored records are keyed by
#: them, so a refactor of the spec or formats must leave them alone (they changed only with a format's version).
PINNED = {
    ("int8", 16, True, 0): "c9ac194aace84f5eff2dca4cc82c71ed37d444723a002da59b1acb7106017fb2",
    ("fp8", 16, True, 2): "fa7801dac76b5af49007a3e899751bd466f6c573e7b89035627188871af77893",
    ("int8_static", 16, True, 2): "65499cabba12ad1ce368076eeaaf58b6965ee0014921ac57db15712efcbf1a47",
    ("fp8_static", 5, False, 0): "abc5782856e512d49242f9b0b82880e9d96294dee57fce32be1185670e3fb83a",
    # int4/int2 version 2 (int8 offsets instead of float16 minima): records of version 1 no longer match
    ("int4", 32, True, 0): "a55605fbb732ee3e9943a554f27755740880144b60b25a4a00ba4904be2583b1",
    ("int2", 32, True, 0): "61ba09972a93ae0c67a4d246992bd71a0912786259c97ee0925dfe267d6b6d52",
    # int3 (issue 34.2), first released at version 2 of the quantize-on-seal layout
    ("int3", 32, True, 0): "6d74005e15397f91800added40c691347cb43a601ce472440e4f185b6c12e785",
    ("float32", 16, False, 0): "63b15f60f8fddef181fc923f9f42d4c57fb8270b8629d49ab1229d839115a388",
}


@pytest.mark.parametrize("key", sorted(PINNED))
def test_fingerprints_of_released_layouts_are_unchanged(key: tuple[str, int, bool, int]) -> None:
    from kvpage.scales import StaticScales

    fmt, bs, has_value, draft = key
    scales = StaticScales.uniform(3 + draft, 0.02, 0.05 if has_value else None) if fmt.endswith("_static") else None
    spec = CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=64, block_size=bs, kv_cache_dtype=fmt,
                           num_draft_layers=draft, has_value=has_value, model_name="m", static_scales=scales)
    assert spec.fingerprint == PINNED[key]


def test_layer_spec_holds_the_format_object() -> None:
    by_name = LayerSpec(2, 16, 4, "INT8_PER_TOKEN_HEAD")  # a name is resolved once, here
    by_object = LayerSpec(2, 16, 4, get_format("int8"))
    assert by_name == by_object and hash(by_name) == hash(by_object)
    assert by_name.format == get_format("int8") and by_name.kv_format == "int8"
    assert by_name.describe() == by_object.describe()
    assert LayerSpec(2, 16, 4, "fp8") != by_name
    with pytest.raises(UnknownKVFormatError):
        LayerSpec(2, 16, 4, "int5")
# -- C04: draft bf16 beside fp8 main ------------------------------------------------------------


def test_c04_draft_bf16_beside_fp8() -> None:
    bs, heads, dim = 4, 2, 32
    # the model dtype is float32: nothing may fall back to it
    spec = CacheSpec.build(num_layers=3, num_kv_heads=heads, head_dim=dim, model_dtype=torch.float32, block_size=bs,
                           kv_cache_dtype="fp8", num_draft_layers=2, draft_kv_cache_dtype="bfloat16", model_name="toy")
    main, draft = spec.main, spec.draft
    assert draft is not None
    assert (main.layer.kv_format, draft.layer.kv_format) == ("fp8", "bfloat16")
    assert list(main.layer_indices) == [0, 1, 2] and list(draft.layer_indices) == [3, 4]

    # bytes per block, each from its own group
    fp8_layer = 2 * bs * heads * (dim * 1 + 2)
    bf16_layer = 2 * bs * heads * dim * 2
    assert main.layer.bytes_per_block == fp8_layer
    assert draft.layer.bytes_per_block == bf16_layer
    assert spec.bytes_per_block == 3 * fp8_layer + 2 * bf16_layer
    b = CacheController(spec).num_blocks_for_budget(10 * spec.bytes_per_block)
    assert b.group_bytes == {"main": 10 * 3 * fp8_layer, "draft": 10 * 2 * bf16_layer}

    # allocation
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(6)
    ctrl.initialize_draft_kv_cache(6, num_draft_layers=2, layer_offset=3)
    ctrl.initialize_host_cache(2)
    for tier in (ctrl.device_caches, ctrl.host_caches):
        for i in (0, 1, 2):
            assert {n: t.dtype for n, t in tier[i].items()} == {
                "key": torch.uint8, "value": torch.uint8, "key_scale": torch.float16, "value_scale": torch.float16}
        for i in (3, 4):
            assert {n: t.dtype for n, t in tier[i].items()} == {"key": torch.bfloat16, "value": torch.bfloat16}
    assert ctrl.device_bytes == 6 * spec.bytes_per_block
    assert ctrl.host_bytes == 2 * spec.bytes_per_block

    # the attention op uses each layer's own spec
    g = torch.Generator().manual_seed(0)
    n = 6
    q, k, v = torch.randn(n, 4, dim, generator=g), torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, dim, generator=g)
    meta = AttentionMetadata.build(block_tables=[[2, 5]], seq_lens=[n], query_lens=[n],
                                   slot_mapping=[2 * bs + i for i in range(bs)] + [5 * bs + i for i in range(n - bs)],
                                   block_size=bs)
    slots = meta.slot_mapping
    outs = {}
    for i in (0, 3):
        cache = ctrl.device_caches[i]
        outs[i] = paged_attention(q, k, v, cache, spec.layer(i), meta, layer_index=i)
        stored_k = cache["key"].view(-1, heads, dim)[slots]
        stored_v = cache["value"].view(-1, heads, dim)[slots]
        if i == 0:  # fp8 codes + scales
            qk, qv = get_format("fp8").quantize(k, kind="key"), get_format("fp8").quantize(v, kind="value")
            assert torch.equal(stored_k, qk.codes) and torch.equal(stored_v, qv.codes)
            assert torch.equal(cache["key_scale"].view(-1, heads)[slots], qk.scale)
            assert torch.equal(cache["value_scale"].view(-1, heads)[slots], qv.scale)
        else:  # plain bf16
            assert torch.equal(stored_k, k.to(torch.bfloat16)) and torch.equal(stored_v, v.to(torch.bfloat16))
    assert not torch.equal(outs[0], outs[3])  # different storage -> different rounding
    assert torch.allclose(outs[0], outs[3], atol=0.2)  # but both approximate the same attention

    # handing a group's cache to the other group's spec is refused
    with pytest.raises(KVCacheLayoutError, match="layer 3"):
        paged_attention(q, k, v, ctrl.device_caches[3], spec.layer(0), meta, layer_index=3)
    with pytest.raises(KVCacheLayoutError, match="layer 0"):
        paged_attention(q, k, v, ctrl.device_caches[0], spec.layer(3), meta, layer_index=0)


def test_draft_defaults_to_main_format_not_model_dtype() -> None:
    toy = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 32, "model_dtype": torch.bfloat16, "block_size": 8,
           "num_draft_layers": 1, "model_name": "toy"}
    spec = CacheSpec.build(**toy, kv_cache_dtype="int8")
    assert spec.draft is not None and spec.draft.layer.kv_format == "int8"
    spec = CacheSpec.build(**toy, kv_cache_dtype="auto", draft_kv_cache_dtype="fp8")
    assert spec.main.layer.kv_format == "bfloat16" and spec.draft.layer.kv_format == "fp8"
    assert spec.model_name == "toy" and spec.block_size == 8


# -- key-only layers -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,names", [("int8", ["key", "key_scale"]), ("fp8", ["key", "key_scale"]),
                                       ("bfloat16", ["key"]), ("float32", ["key"])])
def test_key_only_layer_lists_no_value_tensor(fmt: str, names: list[str]) -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, kv_cache_dtype=fmt,
                           has_value=False, num_draft_layers=1)
    for i in range(3):
        layer = spec.layer(i)
        assert [t.name for t in layer.tensors] == names
        assert "value" not in layer.tensor_by_name and "value_scale" not in layer.tensor_by_name
    full = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, kv_cache_dtype=fmt,
                           num_draft_layers=1)
    assert spec.bytes_per_block * 2 == full.bytes_per_block


# -- validate() ----------------------------------------------------------------------------------


def _cache(layer: LayerSpec, n: int) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros((n, *t.shape), dtype=t.dtype) for t in layer.tensors}


def test_validate_accepts_matching_tensors() -> None:
    layer = LayerSpec(2, 16, 4, "int8")
    layer.validate(_cache(layer, 3), layer_index=0, num_blocks=3)
    layer.validate(_cache(layer, 3), layer_index=0)


def test_validate_wrong_dtype_names_everything() -> None:
    layer = LayerSpec(2, 16, 4, "int8")
    cache = _cache(layer, 3)
    cache["value"] = torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(KVCacheLayoutError) as ei:
        layer.validate(cache, layer_index=7)
    msg = str(ei.value)
    for part in ("layer 7", "'value'", "torch.uint8", "torch.bfloat16", "int8", "[num_blocks, 4, 2, 16]"):
        assert part in msg, (part, msg)


def test_validate_wrong_shape_names_expected_and_actual() -> None:
    layer = LayerSpec(2, 16, 4, "fp8")
    cache = _cache(layer, 3)
    cache["key_scale"] = torch.zeros(3, 4, 3, dtype=torch.float16)
    with pytest.raises(KVCacheLayoutError) as ei:
        layer.validate(cache, layer_index=12)
    msg = str(ei.value)
    for part in ("layer 12", "'key_scale'", "[num_blocks, 4, 2]", "[3, 4, 3]", "torch.float16"):
        assert part in msg, (part, msg)
    # an extra dim is a shape error too
    cache = _cache(layer, 3)
    cache["key"] = cache["key"].unsqueeze(-1)
    with pytest.raises(KVCacheLayoutError, match="'key'"):
        layer.validate(cache, layer_index=0)


def test_validate_missing_and_unexpected_tensors() -> None:
    layer = LayerSpec(2, 16, 4, "int8")
    cache = _cache(layer, 3)
    del cache["value_scale"]
    with pytest.raises(KVCacheLayoutError) as ei:
        layer.validate(cache, layer_index=4)
    assert "layer 4" in str(ei.value) and "value_scale" in str(ei.value) and "missing" in str(ei.value)
    ko = LayerSpec(2, 16, 4, "bfloat16", has_value=False)
    with pytest.raises(KVCacheLayoutError) as ei:
        ko.validate(_cache(LayerSpec(2, 16, 4, "bfloat16"), 3), layer_index=1)
    assert "layer 1" in str(ei.value) and "unexpected ['value']" in str(ei.value)


def test_validate_block_counts() -> None:
    layer = LayerSpec(2, 16, 4, "int8")
    with pytest.raises(KVCacheLayoutError, match=r"layer 2: cache tensor 'key' has 3 blocks, expected 5"):
        layer.validate(_cache(layer, 3), layer_index=2, num_blocks=5)
    cache = _cache(layer, 3)
    cache["value_scale"] = torch.zeros(4, 4, 2, dtype=torch.float16)
    with pytest.raises(KVCacheLayoutError, match="'value_scale' has 4 blocks, expected 3"):
        layer.validate(cache, layer_index=2)


# -- construction errors -------------------------------------------------------------------------


def test_construction_errors() -> None:
    for bad in ({"kv_heads": 0}, {"head_dim": -1}, {"block_size": 0}):
        kw = {"kv_heads": 2, "head_dim": 8, "block_size": 4, "format": "int8", **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            LayerSpec(**kw)
    with pytest.raises(ValueError):
        CacheSpec.build(num_layers=0, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError):
        CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, num_draft_layers=-1)
    with pytest.raises(ValueError, match="block_size"):
        CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=0)
    with pytest.raises(UnknownKVFormatError):
        CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, kv_cache_dtype="int5")
    with pytest.raises(UnknownKVFormatError):
        CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, num_draft_layers=1, draft_kv_cache_dtype="nope")


def test_layer_and_group_lookup() -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=1, head_dim=8, num_draft_layers=1, draft_kv_cache_dtype="fp8")
    assert spec.num_layers == 3
    assert spec.layer(2).kv_format == "fp8" and spec.layer(1).kv_format == "float32"
    with pytest.raises(IndexError, match="layer 3"):
        spec.layer(3)
    with pytest.raises(IndexError):
        spec.layer(-1)
    assert spec.group("draft") is spec.draft
    with pytest.raises(KeyError):
        spec.group("mtp")
    no_draft = CacheSpec.build(num_layers=2, num_kv_heads=1, head_dim=8)
    assert no_draft.draft is None
    assert [spec.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        spec.blocks_for_tokens(-1)


# -- sliding-window groups (issue 15) ---------------------------------------------------------------------------

def test_layer_windows_split_full_and_sliding_layers_into_two_groups() -> None:
    """Gemma 3's pattern: windowed layers form ``sliding`` beside full-attention ``main``; layers not consecutive."""
    windows = [24, 24, None, 24, 24, None]
    spec = CacheSpec.build(num_layers=6, num_kv_heads=2, head_dim=16, layer_windows=windows, kv_cache_dtype="int8")
    assert [g.name for g in spec.groups] == ["main", "sliding"]
    assert list(spec.main.layer_indices) == [2, 5] and spec.main.sliding_window is None
    assert spec.sliding is not None and list(spec.sliding.layer_indices) == [0, 1, 3, 4]
    assert spec.sliding.sliding_window == 24
    assert spec.model_groups == spec.groups
    for i in range(6):
        assert spec.layer(i) == spec.main.layer
    # the same layers and bytes as one full-attention group, but another layout: another fingerprint
    plain = CacheSpec.build(num_layers=6, num_kv_heads=2, head_dim=16, kv_cache_dtype="int8")
    assert spec.bytes_per_block == plain.bytes_per_block
    assert spec.fingerprint != plain.fingerprint
    assert spec.describe()["groups"][1]["layers"] == [0, 1, 3, 4]


def test_all_windowed_layers_make_one_windowed_main_group_and_none_make_the_old_spec() -> None:
    mistral = CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=16, layer_windows=[8, 8, 8])
    assert [(g.name, g.sliding_window) for g in mistral.groups] == [("main", 8)]
    llama = CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=16, layer_windows=[None] * 3)
    assert llama == CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=16)
    assert llama.fingerprint == CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=16).fingerprint


def test_draft_layers_follow_windowed_model_layers() -> None:
    spec = CacheSpec.build(num_layers=4, num_kv_heads=2, head_dim=16, layer_windows=[None, 8, None, 8],
                           num_draft_layers=2)
    assert [(g.name, list(g.layer_indices)) for g in spec.groups] == [
        ("main", [0, 2]), ("sliding", [1, 3]), ("draft", [4, 5])]
    assert [g.name for g in spec.model_groups] == ["main", "sliding"]


@pytest.mark.parametrize("windows, match", [([8, None], "2 entries for 3 layers"),
                                            ([8, 16, None], "different sliding windows")])
def test_bad_layer_windows_are_refused(windows: list[int | None], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheSpec.build(num_layers=3, num_kv_heads=2, head_dim=16, layer_windows=windows)


def test_groups_must_cover_every_layer_once() -> None:
    layer = LayerSpec(2, 16, 16, "float32")
    with pytest.raises(ValueError, match="in groups"):
        CacheSpec((LayerGroupSpec("main", 0, 2, layer), LayerGroupSpec("sliding", 1, 1, layer, 8)), 16)
    with pytest.raises(ValueError, match=r"must be 0 \.\. 1, each once"):
        CacheSpec((LayerGroupSpec("main", 0, 1, layer), LayerGroupSpec("sliding", 2, 1, layer, 8)), 16)
    with pytest.raises(ValueError, match="strictly increasing"):
        LayerGroupSpec("main", 0, 2, layer, layers=(1, 0))
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        LayerGroupSpec("main", 0, 2, layer, sliding_window=0)
