"""CacheController: allocation from the spec (main, draft, host), budgets, swaps, failures."""
from __future__ import annotations

import math

import pytest
import torch

from kvpage.cache.controller import CacheAllocationError, CacheController
from kvpage.errors import KVPageError
from kvpage.formats import TensorSpec, get_format
from kvpage.ops.attention import read_kv, write_kv
from kvpage.spec import CacheSpec
from _spec_alloc import check_quantized_main_and_draft_allocation


FORMATS = ["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "block_wise_fp8",
           "int8_rotated", "fp8_per_token_head"]
FLOAT_OF = {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _layer_bytes(cache: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in cache.values())


# -- C01: dtype matrix ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("has_value", [True, False])
def test_c01_dtype_matrix(fmt: str, has_value: bool) -> None:
    heads, dim, bs, n_dev, n_host = 2, 24, 4, 5, 3
    spec = CacheSpec.build(num_layers=3, num_kv_heads=heads, head_dim=dim, block_size=bs, kv_cache_dtype=fmt,
                           model_dtype=torch.bfloat16, num_draft_layers=2, has_value=has_value)
    quantized = get_format(fmt).quantized
    ctrl = CacheController(spec)
    main = ctrl.initialize_kv_cache(n_dev)
    draft = ctrl.initialize_draft_kv_cache(n_dev)
    host = ctrl.initialize_host_cache(n_host)
    assert sorted(main) == [0, 1, 2] and sorted(draft) == [3, 4] and sorted(host) == [0, 1, 2, 3, 4]
    assert sorted(ctrl.device_caches) == [0, 1, 2, 3, 4]

    code_dtype = torch.uint8 if quantized else FLOAT_OF.get(fmt, torch.bfloat16)
    expected = {"key": ((bs, heads, dim), code_dtype)}
    if has_value:
        expected["value"] = ((bs, heads, dim), code_dtype)
    if quantized:
        expected["key_scale"] = ((bs, heads), torch.float16)
        if has_value:
            expected["value_scale"] = ((bs, heads), torch.float16)

    for tier, caches, n in (("main", main, n_dev), ("draft", draft, n_dev), ("host", host, n_host)):
        for i, layer in caches.items():
            got = {name: (tuple(t.shape[1:]), t.dtype) for name, t in layer.items()}
            assert got == expected, (tier, i)
            for name, t in layer.items():
                assert t.shape[0] == n, (tier, i, name)
                assert t.device.type == "cpu"
                assert t.is_contiguous()
            assert ("value" in layer) == has_value
    per_layer = (2 if has_value else 1) * bs * heads * (dim * code_dtype.itemsize + (2 if quantized else 0))
    assert ctrl.device_bytes == 5 * n_dev * per_layer == n_dev * spec.bytes_per_block
    assert ctrl.host_bytes == 5 * n_host * per_layer


@pytest.mark.parametrize("main_fmt,draft_fmt", [("int8", "float16"), ("bfloat16", "fp8"), ("fp8", "int8")])
def test_c01_draft_group_has_scales_exactly_when_its_format_does(main_fmt: str, draft_fmt: str) -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype=main_fmt,
                           num_draft_layers=1, draft_kv_cache_dtype=draft_fmt)
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(3)
    ctrl.initialize_draft_kv_cache(3)
    ctrl.initialize_host_cache(2)
    for tier in (ctrl.device_caches, ctrl.host_caches):
        for i, fmt in ((0, main_fmt), (1, main_fmt), (2, draft_fmt)):
            q = get_format(fmt).quantized
            assert ("key_scale" in tier[i]) == q and ("value_scale" in tier[i]) == q
            assert tier[i]["key"].dtype == (torch.uint8 if q else get_format(fmt).dtype)


def test_fill_value_fills_float_tensors_only() -> None:
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, kv_cache_dtype="int8",
                           num_draft_layers=1, draft_kv_cache_dtype="bfloat16")
    ctrl = CacheController(spec, fill_value=float("nan"))
    ctrl.initialize_kv_cache(2)
    ctrl.initialize_draft_kv_cache(2)
    assert torch.all(ctrl.device_caches[0]["key"] == 0)  # uint8 codes: zeros
    assert torch.isnan(ctrl.device_caches[0]["key_scale"]).all()
    assert torch.isnan(ctrl.device_caches[1]["value"].float()).all()
    assert torch.all(CacheController(spec).initialize_kv_cache(2)[0]["key_scale"] == 0)


# -- C06: budget split ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_c06_draft_budget_split(fmt: str) -> None:
    budget = 10 * 1024**3
    heads, dim, bs = 8, 128, 16
    spec = CacheSpec.build(num_layers=32, num_kv_heads=heads, head_dim=dim, block_size=bs, kv_cache_dtype=fmt,
                           num_draft_layers=4)
    per_layer = 2 * bs * heads * (dim * (2 if fmt == "bfloat16" else 1) + (0 if fmt == "bfloat16" else 2))
    b = CacheController(spec).num_blocks_for_budget(budget)
    assert b.bytes_per_block == 36 * per_layer
    assert b.num_blocks == budget // (36 * per_layer)
    assert b.budget_bytes == budget
    assert b.group_bytes["main"] == b.num_blocks * 32 * per_layer
    assert b.group_bytes["draft"] == b.num_blocks * 4 * per_layer
    # exact shares of what is allocated
    assert b.group_bytes["draft"] * 36 == b.total_bytes * 4
    assert b.group_bytes["main"] * 36 == b.total_bytes * 32
    # of the budget: within one block's worth of 4/36 and 32/36, never over
    assert b.total_bytes <= budget < b.total_bytes + b.bytes_per_block
    assert math.isclose(b.group_bytes["draft"] / budget, 4 / 36, rel_tol=1e-3)
    assert math.isclose(b.group_bytes["main"] / budget, 32 / 36, rel_tol=1e-3)
    # sizing only the main group would ignore the draft: its share then exceeds 32/36
    main_only = CacheController(spec).num_blocks_for_budget(budget, groups=["main"])
    assert main_only.num_blocks > b.num_blocks and set(main_only.group_bytes) == {"main"}


def test_c06_split_matches_a_real_allocation() -> None:
    spec = CacheSpec.build(num_layers=8, num_kv_heads=2, head_dim=16, block_size=4, kv_cache_dtype="fp8",
                           num_draft_layers=1)
    ctrl = CacheController(spec)
    budget = 200_000
    b = ctrl.num_blocks_for_budget(budget)
    ctrl.initialize_kv_cache(b.num_blocks)
    ctrl.initialize_draft_kv_cache(b.num_blocks)
    main_bytes = sum(_layer_bytes(ctrl.device_caches[i]) for i in range(8))
    draft_bytes = _layer_bytes(ctrl.device_caches[8])
    assert (main_bytes, draft_bytes) == (b.group_bytes["main"], b.group_bytes["draft"])
    assert draft_bytes * 9 == (main_bytes + draft_bytes) * 1
    assert main_bytes + draft_bytes <= budget


# -- C07: scales survive swaps -------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _snapshot(caches: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {n: t.clone() for n, t in c.items()} for i, c in caches.items()}


def _same_block(a: dict[str, torch.Tensor], ai: int, b: dict[str, torch.Tensor], bi: int) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(_bytes(a[n][ai]), _bytes(b[n][bi])) for n in a)


def _fill_device(ctrl: CacheController, spec: CacheSpec, blocks: list[int], seed: int) -> None:
    """Write every slot of ``blocks`` in every layer through write_kv, with real, layer-distinct values."""
    g = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    slots = torch.tensor([b * bs + o for b in blocks for o in range(bs)])
    for i, cache in ctrl.device_caches.items():
        layer = spec.layer(i)
        k = torch.randn(len(slots), layer.kv_heads, layer.head_dim, generator=g) * (i + 1)
        v = torch.randn(len(slots), layer.kv_heads, layer.head_dim, generator=g) * 3 - 1
        k[:, 0, 0] = 50.0  # an outlier: scales differ between tokens and heads
        write_kv(cache, layer, k, v if layer.has_value else None, slots)


def _swap_spec(fmt: str) -> CacheSpec:
    return CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=12, block_size=3, kv_cache_dtype=fmt,
                           num_draft_layers=1)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int8_rotated", "fp8_per_token_head"])
def test_c07_scales_survive_swap(fmt: str) -> None:
    spec = _swap_spec(fmt)
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(6)
    ctrl.initialize_draft_kv_cache(6)
    ctrl.initialize_host_cache(4)
    _fill_device(ctrl, spec, [1, 2, 3], seed=0)
    dev0 = _snapshot(ctrl.device_caches)
    # the written blocks really hold nonzero codes and distinct scales
    for i in range(3):
        assert ctrl.device_caches[i]["key_scale"][1].unique().numel() > 1
        assert ctrl.device_caches[i]["value"][2].any()

    # device -> host (whole pool, every layer incl. draft)
    ctrl.swap_out([1, 2], [3, 0])
    host1 = _snapshot(ctrl.host_caches)
    for i in range(3):
        assert _same_block(ctrl.host_caches[i], 3, dev0[i], 1)
        assert _same_block(ctrl.host_caches[i], 0, dev0[i], 2)
        for hb in (1, 2):  # untouched host blocks stay zero
            assert all(not t[hb].any() for t in ctrl.host_caches[i].values())
    # the device side is not modified by a swap-out
    for i in range(3):
        assert all(torch.equal(_bytes(dev0[i][n]), _bytes(t)) for n, t in ctrl.device_caches[i].items())

    # host -> device, into *different* device blocks
    ctrl.swap_in([3, 0], [4, 5])
    for i in range(3):
        assert _same_block(ctrl.device_caches[i], 4, dev0[i], 1)
        assert _same_block(ctrl.device_caches[i], 5, dev0[i], 2)
        for db in (0, 1, 2, 3):  # other device blocks unchanged
            assert _same_block(ctrl.device_caches[i], db, dev0[i], db)
        layer = spec.layer(i)
        for name in ("key", "value"):
            new = read_kv(ctrl.device_caches[i], layer, name, torch.tensor([4, 5]), torch.float32)
            old = read_kv(dev0[i], layer, name, torch.tensor([1, 2]), torch.float32)
            assert torch.equal(new, old)
    # host unchanged by the swap-in
    for i in range(3):
        assert all(torch.equal(_bytes(host1[i][n]), _bytes(t)) for n, t in ctrl.host_caches[i].items())


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int8_rotated", "fp8_per_token_head"])
def test_c07_scales_survive_swap_per_layer(fmt: str) -> None:
    spec = _swap_spec(fmt)
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(6)
    ctrl.initialize_draft_kv_cache(6)
    ctrl.initialize_host_cache(4)
    _fill_device(ctrl, spec, [0, 2], seed=1)
    dev0 = _snapshot(ctrl.device_caches)
    copied: list[int] = []
    for i in (2, 0, 1):  # draft layer first, then main layers, each on its own
        ctrl.swap_out([2, 0], [1, 3], layers=[i])
        copied.append(i)
        for j in range(3):
            if j in copied:
                assert _same_block(ctrl.host_caches[j], 1, dev0[j], 2)
                assert _same_block(ctrl.host_caches[j], 3, dev0[j], 0)
            else:
                assert all(not t.any() for t in ctrl.host_caches[j].values()), "layer copied that was not asked for"
    # back, one layer at a time, into other device blocks
    for i in (1, 2, 0):
        ctrl.swap_in([1, 3], [5, 4], layers=[i])
        assert _same_block(ctrl.device_caches[i], 5, dev0[i], 2)
        assert _same_block(ctrl.device_caches[i], 4, dev0[i], 0)
    for i in range(3):
        for db in (0, 1, 2, 3):
            assert _same_block(ctrl.device_caches[i], db, dev0[i], db)
    # a two-layer list works too
    ctrl.swap_in([1], [3], layers=[0, 2])
    assert _same_block(ctrl.device_caches[0], 3, dev0[0], 2)
    assert _same_block(ctrl.device_caches[2], 3, dev0[2], 2)
    assert _same_block(ctrl.device_caches[1], 3, dev0[1], 3)


def test_swap_float_and_key_only_layers() -> None:
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, kv_cache_dtype="fp8",
                           has_value=False, num_draft_layers=1, draft_kv_cache_dtype="bfloat16")
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(3)
    ctrl.initialize_draft_kv_cache(3)
    ctrl.initialize_host_cache(2)
    _fill_device(ctrl, spec, [0, 1, 2], seed=2)
    dev0 = _snapshot(ctrl.device_caches)
    ctrl.swap_out([2], [1])
    ctrl.swap_in([1], [0])
    for i in (0, 1):
        assert _same_block(ctrl.device_caches[i], 0, dev0[i], 2)
    assert set(ctrl.host_caches[0]) == {"key", "key_scale"}


# -- transfer errors -----------------------------------------------------------------------------


def _ready(fmt: str = "int8") -> tuple[CacheController, dict, dict]:
    spec = _swap_spec(fmt)
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(4)
    ctrl.initialize_draft_kv_cache(4)
    ctrl.initialize_host_cache(3)
    _fill_device(ctrl, spec, [0, 1, 2, 3], seed=3)
    return ctrl, _snapshot(ctrl.device_caches), _snapshot(ctrl.host_caches)


def _unchanged(ctrl: CacheController, dev: dict, host: dict) -> bool:
    same = lambda a, b: all(torch.equal(_bytes(a[i][n]), _bytes(b[i][n])) for i in a for n in a[i])  # noqa: E731
    return same(ctrl.device_caches, dev) and same(ctrl.host_caches, host)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda c: c.swap_out([0, 1], [0]), ValueError, "differ in length"),
        (lambda c: c.swap_in([0], [0, 1]), ValueError, "differ in length"),
        (lambda c: c.swap_out([0, 1], [2, 2]), ValueError, "repeat"),
        (lambda c: c.swap_in([0, 1], [3, 3]), ValueError, "repeat"),
        (lambda c: c.swap_out([4], [0]), IndexError, "source block ids"),
        (lambda c: c.swap_out([0], [3]), IndexError, "destination block ids"),
        (lambda c: c.swap_out([-1], [0]), IndexError, "out of range"),
        (lambda c: c.swap_in([0], [-1]), IndexError, "out of range"),
        (lambda c: c.swap_in([3], [0]), IndexError, "source block ids"),
        (lambda c: c.swap_in([0, 1], [0, 4]), IndexError, "destination block ids"),
        (lambda c: c.swap_out([0], [0], layers=[3]), KVPageError, "layer 3"),
        (lambda c: c.swap_in([0], [0], layers=[0, 7]), KVPageError, "layer 7"),
    ],
)
def test_transfer_errors_change_nothing(call, exc, match) -> None:  # type: ignore[no-untyped-def]
    ctrl, dev, host = _ready()
    with pytest.raises(exc, match=match):
        call(ctrl)
    assert _unchanged(ctrl, dev, host)


def test_swap_before_host_tier_is_an_error() -> None:
    spec = _swap_spec("int8")
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(2)
    with pytest.raises(IndexError):  # a host tier of 0 blocks
        ctrl.swap_out([0], [0])
    ctrl.initialize_host_cache(2)
    with pytest.raises(KVPageError, match="layer 2"):  # draft layer not allocated on the device
        ctrl.swap_out([0], [0])
    ctrl.swap_out([0], [0], layers=[0, 1])  # the main layers alone are fine


def test_empty_and_repeated_source_swaps() -> None:
    ctrl, dev, host = _ready()
    ctrl.swap_out([], [])
    assert _unchanged(ctrl, dev, host)
    ctrl.swap_out([2, 2], [0, 1])  # the same source twice is a legal copy
    for i in range(3):
        assert _same_block(ctrl.host_caches[i], 0, dev[i], 2) and _same_block(ctrl.host_caches[i], 1, dev[i], 2)


# -- C08: host allocation failures ---------------------------------------------------------------


def test_c08_host_alloc_failure_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="int8",
                           num_draft_layers=2)
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(3)
    ctrl.initialize_draft_kv_cache(3)
    real = CacheController._allocate
    calls = {"n": 0}
    tensors_per_layer = len(spec.main.layer.tensors)
    first_draft_call = spec.main.num_layers * tensors_per_layer + 1

    def failing(self: CacheController, t: TensorSpec, num_blocks: int, device: torch.device, pin: bool) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == first_draft_call:
            raise RuntimeError("cannot pin 4 bytes (simulated)")
        return real(self, t, num_blocks, device, pin)

    monkeypatch.setattr(CacheController, "_allocate", failing)
    with pytest.raises(CacheAllocationError) as ei:
        ctrl.initialize_host_cache(5)
    msg = str(ei.value)
    for part in ("host", "layer 2", "draft", "'key'", "simulated", "5 blocks"):
        assert part in msg, (part, msg)
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert isinstance(ei.value, KVPageError)
    # nothing half-allocated survives: no host tier, swaps are refused
    assert ctrl.host_caches == {} and ctrl.num_host_blocks == 0 and ctrl.host_bytes == 0
    with pytest.raises(IndexError):
        ctrl.swap_out([0], [0], layers=[0])
    # the device tier is untouched
    assert sorted(ctrl.device_caches) == [0, 1, 2, 3]


@pytest.mark.parametrize("err", [RuntimeError("CUDA out of memory"), MemoryError()])
def test_c08_failure_in_a_draft_group_with_its_own_format(monkeypatch: pytest.MonkeyPatch, err: Exception) -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="fp8",
                           num_draft_layers=1, draft_kv_cache_dtype="bfloat16")
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(3)
    ctrl.initialize_draft_kv_cache(3)
    real = CacheController._allocate

    def failing(self: CacheController, t: TensorSpec, num_blocks: int, device: torch.device, pin: bool) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and t.name == "value":
            raise err
        return real(self, t, num_blocks, device, pin)

    monkeypatch.setattr(CacheController, "_allocate", failing)
    with pytest.raises(CacheAllocationError, match=r"host tier: could not allocate 'value' of layer 2 \(draft group"):
        ctrl.initialize_host_cache(2)
    assert ctrl.host_caches == {} and ctrl.num_host_blocks == 0


def test_device_alloc_failure_names_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = CacheSpec.build(num_layers=3, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="int8")
    ctrl = CacheController(spec)
    real = CacheController._allocate
    calls = {"n": 0}

    def failing(self, t, num_blocks, device, pin):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2 * len(spec.main.layer.tensors) + 3:  # layer 2's third tensor
            raise RuntimeError("boom")
        return real(self, t, num_blocks, device, pin)

    monkeypatch.setattr(CacheController, "_allocate", failing)
    name = spec.main.layer.tensors[2].name
    with pytest.raises(CacheAllocationError, match=rf"device tier: could not allocate '{name}' of layer 2 \(main"):
        ctrl.initialize_kv_cache(2)


# -- initialization argument checks --------------------------------------------------------------


def test_initialization_argument_checks() -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, num_draft_layers=1)
    ctrl = CacheController(spec)
    for bad in (0, -3):
        with pytest.raises(ValueError):
            ctrl.initialize_kv_cache(bad)
    ctrl.initialize_kv_cache(4)
    with pytest.raises(ValueError, match="share the main block table"):
        ctrl.initialize_draft_kv_cache(5)
    with pytest.raises(ValueError, match="draft layers"):
        ctrl.initialize_draft_kv_cache(4, num_draft_layers=2)
    with pytest.raises(ValueError, match="layer_offset"):
        ctrl.initialize_draft_kv_cache(4, layer_offset=1)
    assert sorted(ctrl.initialize_draft_kv_cache(4, num_draft_layers=1, layer_offset=2)) == [2]
    with pytest.raises(ValueError):
        ctrl.initialize_host_cache(-1)
    assert ctrl.initialize_host_cache(0) == {} and ctrl.num_host_blocks == 0
    with pytest.raises(KeyError):
        CacheController(CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8)).initialize_draft_kv_cache(2)


def test_budget_for_unknown_group_is_a_clear_error():
    """Regression: a groups filter matching nothing used to divide by zero."""
    spec = CacheSpec.build(num_layers=2, num_kv_heads=1, head_dim=8, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="no layer group"):
        CacheController(spec).num_blocks_for_budget(1 << 20, groups=["draft"])


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_per_token_head", "int8_rotated", "int4", "int2"])
def test_c01_quantized_main_and_draft_layers_never_take_the_model_dtype_on_meta(fmt: str, model_dtype: torch.dtype) -> None:
    """Case C01 on the ``meta`` device: a quantized cache with MTP/draft layers, in a 16-bit model, allocates every
    main and draft tensor in the dtype and shape its spec says (1-byte codes, the format's scales), never in the
    model dtype, and a block costs exactly the spec's bytes. The same check serves case C29 on CUDA
    (``tests/test_c29_gpu_dtypes.py``)."""
    check_quantized_main_and_draft_allocation(fmt, model_dtype, "meta")
