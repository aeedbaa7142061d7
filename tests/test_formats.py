"""KV formats: the name registry and the int8 / fp8 (e4m3) per-(token, head) round trip.

The error bounds checked here are the ones the format docstrings promise
(``kvpage.formats.per_token``):

* int8: ``|x - x_hat| <= s / 2`` with ``s`` the stored float16 scale;
* fp8:  ``|x - x_hat| <= 2**-4 * |x| + 2**-10 * s``;
* both: ``s = max(amax / qmax, 2**-14)`` rounded to float16 (qmax 127 / 448).

A tiny slack of float32 rounding (relative 1e-6) is allowed on top of each bound.
"""
from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.errors import KVPageError, UnknownKVFormatError
from kvpage.formats import (
    Fp8Format,
    FloatFormat,
    Int8Format,
    KVFormat,
    available_formats,
    canonical_format_name,
    format_aliases,
    get_format,
    register_format,
)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tensors here are tiny: intra-op threads only add overhead (100x on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


QMAX = {"int8": 127.0, "fp8": 448.0}
SCALE_FLOOR = 2.0**-14
FP16_MAX = 65504.0

# -- registry -----------------------------------------------------------------------------------

ALIASES = {
    # quantized
    "int8": "int8",
    "int8_per_token_head": "int8",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e4m3": "fp8",
    "e4m3": "fp8",
    "block_wise_fp8": "fp8",
    "fp8_per_token_head": "fp8",
    # unquantized
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


@pytest.mark.parametrize("alias,canon", sorted(ALIASES.items()))
def test_every_alias_resolves(alias: str, canon: str) -> None:
    assert canonical_format_name(alias, torch.float32) == canon
    fmt = get_format(alias)
    assert fmt.name == canon
    expected_cls = {"int8": Int8Format, "fp8": Fp8Format}.get(canon, FloatFormat)
    assert type(fmt) is expected_cls


@pytest.mark.parametrize("spelling", ["FP8_E4M3", "Float8_E4M3FN", "Block_Wise_FP8", "INT8", "BF16", "  fp16 ", "Auto"])
def test_names_are_case_insensitive(spelling: str) -> None:
    lower = spelling.strip().lower()
    expected = "float32" if lower == "auto" else ALIASES[lower]
    assert canonical_format_name(spelling, torch.float32) == expected
    assert get_format(spelling).name == expected


def test_format_aliases_table_matches_docs() -> None:
    table = format_aliases()
    for alias, canon in ALIASES.items():
        if alias != canon:
            assert table[alias] == canon
    assert available_formats() == ["auto", "float32", "bfloat16", "float16", "int8", "fp8"]


@pytest.mark.parametrize(
    "model_dtype,expected", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")]
)
def test_auto_is_the_model_dtype(model_dtype: torch.dtype, expected: str) -> None:
    assert canonical_format_name("auto", model_dtype) == expected
    fmt = get_format("auto", model_dtype)
    assert isinstance(fmt, FloatFormat) and fmt.dtype == model_dtype and fmt.name == expected


def test_auto_with_non_float_model_dtype_is_an_error() -> None:
    with pytest.raises(UnknownKVFormatError, match="auto"):
        canonical_format_name("auto", torch.int8)


@pytest.mark.parametrize("bad", ["int4_typo", "fp8e5m2", "", "uint8", "float64"])
def test_unknown_name_lists_the_valid_names(bad: str) -> None:
    with pytest.raises(UnknownKVFormatError) as ei:
        get_format(bad)
    msg = str(ei.value)
    assert repr(bad) in msg
    for name in ["auto", "float32", "bfloat16", "float16", "int8", "fp8"]:
        assert name in msg
    for alias in ["fp8_e4m3", "float8_e4m3fn", "block_wise_fp8", "bf16"]:
        assert alias in msg
    # usable as a ValueError by callers that do not know kvpage's exceptions
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, KVPageError)


def test_register_format_refuses_taken_names() -> None:
    class Clash(Int8Format):
        name = "my_new_fmt"
        aliases = ("bf16",)  # already an unquantized alias

    with pytest.raises(ValueError, match="bf16"):
        register_format(Clash)
    with pytest.raises(UnknownKVFormatError):  # nothing half-registered
        get_format("my_new_fmt")

    class Clash2(Int8Format):
        name = "FP8"  # case-insensitively taken

    with pytest.raises(ValueError, match="fp8"):
        register_format(Clash2)


# -- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("has_value", [True, False])
def test_quantized_layout_is_uint8_with_fp16_scales(name: str, has_value: bool) -> None:
    specs = get_format(name).tensor_specs(block_size=5, kv_heads=3, head_dim=96, has_value=has_value)
    got = {s.name: (s.shape, s.dtype) for s in specs}
    want = {"key": ((5, 3, 96), torch.uint8), "key_scale": ((5, 3), torch.float16)}
    if has_value:
        want |= {"value": ((5, 3, 96), torch.uint8), "value_scale": ((5, 3), torch.float16)}
    assert got == want
    # bytes: codes 1 byte/value + one fp16 scale per (token, head), for K (and V)
    per_tensor = 5 * 3 * 96 + 5 * 3 * 2
    assert sum(s.nbytes for s in specs) == (2 if has_value else 1) * per_tensor


@pytest.mark.parametrize("name,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_float_layout_has_no_scales(name: str, dtype: torch.dtype) -> None:
    specs = get_format(name).tensor_specs(block_size=16, kv_heads=2, head_dim=64)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [("key", (16, 2, 64), dtype), ("value", (16, 2, 64), dtype)]
    assert get_format(name).quantized is False


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_bits_per_value_at_head_dim_64(name: str) -> None:
    # (64 * 8 bits + 16-bit scale) / 64 values
    assert get_format(name).bits_per_value(block_size=16, kv_heads=8, head_dim=64) == pytest.approx(8.25)
    assert get_format("bfloat16").bits_per_value(block_size=16, kv_heads=8, head_dim=64) == 16


def test_float_format_round_trip() -> None:
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))
    f32 = get_format("float32")
    q = f32.quantize(x)
    assert q.scale is None and q.codes.dtype == torch.float32 and torch.equal(q.codes, x)
    bf = get_format("bf16")
    q = bf.quantize(x)
    assert q.codes.dtype == torch.bfloat16
    back = bf.dequantize(q.codes, None, torch.float32)
    assert back.dtype == torch.float32
    assert torch.all((back - x).abs() <= 2.0**-8 * x.abs())  # one rounding to 8 mantissa bits


# -- property tests -----------------------------------------------------------------------------

HEAD_DIMS = [1, 3, 64, 80, 96, 128]


@st.composite
def kv_rows(draw: st.DrawFn, outlier: bool) -> torch.Tensor:
    """``[N, H, D]`` float32 rows; with ``outlier``, one channel is 100x the rest."""
    n = draw(st.integers(1, 4))
    h = draw(st.integers(1, 3))
    d = draw(st.sampled_from(HEAD_DIMS))
    arr = draw(
        hnp.arrays(
            np.float32,
            (n, h, d),
            elements=st.floats(-1000.0, 1000.0, width=32, allow_nan=False, allow_infinity=False),
        )
    )
    mag = draw(st.sampled_from([1e-6, 1e-3, 1.0, 10.0]))
    x = torch.from_numpy(arr.copy()) * mag
    if outlier:
        c = draw(st.integers(0, d - 1))
        x[..., c] *= 100.0
    return x


def _check_scale(name: str, x: torch.Tensor, s: torch.Tensor) -> None:
    assert s.dtype == torch.float16 and tuple(s.shape) == tuple(x.shape[:2])
    s64 = s.double()
    assert torch.isfinite(s64).all() and (s64 >= SCALE_FLOOR).all()
    ideal = (x.double().abs().amax(-1) / QMAX[name]).clamp(min=SCALE_FLOOR)
    # rounded to float16 (11 significant bits): relative error <= 2**-11
    assert torch.all((s64 - ideal).abs() <= 2.0**-11 * ideal)


def _check_bound(name: str, x: torch.Tensor) -> None:
    fmt = get_format(name)
    q = fmt.quantize(x)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    _check_scale(name, x, q.scale)
    back = fmt.dequantize(q.codes, q.scale, torch.float32)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert torch.isfinite(back).all()
    err = (back.double() - x.double()).abs()
    s = q.scale.double().unsqueeze(-1)
    if name == "int8":
        codes = q.codes.view(torch.int8)
        assert int(codes.min()) >= -127 and int(codes.max()) <= 127
        bound = s / 2
    else:
        assert not torch.any((q.codes & 0x7F) == 0x7F), "e4m3fn NaN code stored"
        bound = 2.0**-4 * x.double().abs() + 2.0**-10 * s
    slack = 1e-6 * (x.double().abs() + s)
    worst = (err - bound - slack).max()
    assert worst <= 0, f"{name}: error exceeds the documented bound by {float(worst)}"


@pytest.mark.parametrize("name", ["int8", "fp8"])
@settings(max_examples=60, deadline=None)
@given(x=kv_rows(outlier=False))
def test_round_trip_within_documented_bound(name: str, x: torch.Tensor) -> None:
    _check_bound(name, x)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@settings(max_examples=60, deadline=None)
@given(x=kv_rows(outlier=True))
def test_round_trip_within_bound_with_outlier_channel(name: str, x: torch.Tensor) -> None:
    _check_bound(name, x)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_non_power_of_two_head_dim_random_and_outliers(name: str, head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(33, 3, head_dim, generator=g) * 2.0
    _check_bound(name, x)
    # the very last lane is the outlier (100x the rest of its row): it must enter amax
    rest = x[..., :-1].abs().amax(-1)
    x[..., head_dim - 1] = torch.where(x[..., -1] < 0, -100.0, 100.0) * rest
    _check_bound(name, x)
    q = get_format(name).quantize(x)
    amax = x.abs().amax(-1)
    assert torch.allclose(q.scale.float(), amax / QMAX[name], rtol=2.0**-11)
    # the outlier itself comes back within a tiny relative error
    back = get_format(name).dequantize(q.codes, q.scale, torch.float32)
    rel = ((back[..., -1] - x[..., -1]).abs() / x[..., -1].abs()).max()
    assert rel <= (2.0**-4 if name == "fp8" else 1 / 254 + 1e-3)


def test_int8_error_is_much_smaller_than_fp8_on_gaussian_rows() -> None:
    # Sanity that the two formats are really different encodings with their expected precision.
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(1))
    errs = {}
    for name in ("int8", "fp8"):
        f = get_format(name)
        q = f.quantize(x)
        errs[name] = (f.dequantize(q.codes, q.scale, torch.float32) - x).abs().mean().item()
    assert 0 < errs["int8"] < errs["fp8"]
    assert errs["int8"] < 0.01 and errs["fp8"] < 0.05


@pytest.mark.parametrize("name", ["int8", "fp8"])
@settings(max_examples=30, deadline=None)
@given(x=kv_rows(outlier=False), split=st.integers(0, 4))
def test_quantization_is_deterministic_and_per_row(name: str, x: torch.Tensor, split: int) -> None:
    fmt = get_format(name)
    a, b = fmt.quantize(x), fmt.quantize(x.clone())
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scale.view(torch.int16), b.scale.view(torch.int16))  # same bytes
    # a token's bytes do not depend on which other tokens share the call (prefill vs decode)
    split = min(split, x.shape[0])
    parts = [fmt.quantize(p) for p in (x[:split], x[split:]) if p.shape[0]]
    assert torch.equal(torch.cat([p.codes for p in parts]), a.codes)
    assert torch.equal(torch.cat([p.scale for p in parts]).view(torch.int16), a.scale.view(torch.int16))


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_storage_dtype_is_uint8_for_any_input_dtype(name: str, in_dtype: torch.dtype) -> None:
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(2)).to(in_dtype)
    q = get_format(name).quantize(x)
    assert q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float16
    for out in (torch.float32, torch.bfloat16):
        assert get_format(name).dequantize(q.codes, q.scale, out).dtype == out


def test_known_codes() -> None:
    """A few hand-computed encodings (independent of the implementation's arithmetic)."""
    # int8: row [-2, 0.5, 1] -> scale 2/127, codes round(x * 127 / 2) = -127, 32 (31.75), 64 (63.5 -> even 64)
    x = torch.tensor([[[-2.0, 0.5, 1.0]]])
    q = get_format("int8").quantize(x)
    s = torch.tensor(2.0 / 127).half()
    assert q.scale.item() == s.item()
    codes = q.codes.view(torch.int8).flatten().tolist()
    expected = [round(v / s.item()) for v in (-2.0, 0.5, 1.0)]
    assert codes == expected and codes[0] == -127
    # fp8: row [448, -1, 0] -> scale 1.0, codes are the e4m3fn bit patterns 0x7E, 0xB8, 0x00
    q = get_format("fp8").quantize(torch.tensor([[[448.0, -1.0, 0.0]]]))
    assert q.scale.item() == 1.0
    assert q.codes.flatten().tolist() == [0x7E, 0xB8, 0x00]


# -- C23: fp8 range -----------------------------------------------------------------------------


def test_c23_fp8_saturates_never_inf_nan() -> None:
    fmt = get_format("fp8")
    big = 448.0 * FP16_MAX  # largest magnitude a float16 scale can represent
    x = torch.zeros(5, 2, 96)
    x[0, 0, :] = torch.linspace(-1, 1, 96)
    x[0, 0, 7] = float("inf")
    x[0, 0, 8] = float("-inf")
    x[0, 1, :] = 1e30  # far beyond e4m3 x float16-scale range
    x[0, 1, 1] = -1e30
    x[1, 0, :] = 3.0e38  # near float32 max
    x[1, 1, 0] = -float("inf")
    x[2, 0, 0] = 1e9
    x[2, 0, 1] = 1.0
    # row 3 stays all zeros (both heads); row 4 ordinary values
    x[4] = torch.randn(2, 96, generator=torch.Generator().manual_seed(3))
    q = fmt.quantize(x)
    s = q.scale.float()
    back = fmt.dequantize(q.codes, q.scale, torch.float32)

    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(back).all(), "fp8 produced inf/NaN"
    assert not torch.any((q.codes & 0x7F) == 0x7F), "e4m3fn NaN bit pattern stored"
    # every decoded magnitude is within +-448 * its row's scale
    assert torch.all(back.abs() <= 448.0 * s.unsqueeze(-1))
    # inf and out-of-range values saturate to exactly +-448 * scale
    assert s[0, 0].item() == FP16_MAX
    assert back[0, 0, 7].item() == 448.0 * FP16_MAX and back[0, 0, 8].item() == -448.0 * FP16_MAX
    assert q.codes[0, 0, 7].item() == 0x7E and q.codes[0, 0, 8].item() == 0xFE
    assert torch.all(back[0, 1, 2:] == big) and back[0, 1, 1].item() == -big and back[0, 1, 0].item() == big
    assert torch.all(back[1, 0] == big) and back[1, 1, 0].item() == -big
    # 1e9 needs a scale of 1e9 / 448 > 65504: the scale saturates at the float16 max and 1e9 decodes to 448 * 65504
    assert back[2, 0, 0].item() == big
    # the all-zero token: finite positive scale (the floor) and exact zeros
    assert torch.all(s[3] == SCALE_FLOOR)
    assert torch.all(back[3] == 0)
    # an ordinary row next to the extreme ones is unaffected (per-row scales)
    assert torch.all((back[4] - x[4]).abs() <= 2.0**-4 * x[4].abs() + 2.0**-10 * s[4].unsqueeze(-1) + 1e-7)


@settings(max_examples=60, deadline=None)
@given(
    vals=st.lists(
        st.floats(allow_nan=False, allow_infinity=True, width=32), min_size=1, max_size=40
    ),
    name=st.sampled_from(["int8", "fp8"]),
)
def test_any_finite_or_infinite_input_decodes_finite(vals: list[float], name: str) -> None:
    x = torch.tensor(vals, dtype=torch.float32).view(1, 1, -1)
    fmt = get_format(name)
    q = fmt.quantize(x)
    back = fmt.dequantize(q.codes, q.scale, torch.float32)
    assert torch.isfinite(q.scale.float()).all()
    assert torch.isfinite(back).all()
    limit = QMAX[name] * q.scale.float().unsqueeze(-1)
    assert torch.all(back.abs() <= limit)
    # sign is kept for every value that does not round to zero
    nz = back != 0
    assert torch.all(torch.sign(back[nz]) == torch.sign(x[nz]))


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_all_zero_token_has_finite_scale_and_decodes_to_zero(name: str, zero: float) -> None:
    fmt = get_format(name)
    x = torch.full((3, 2, 80), zero)
    x[1] = torch.randn(2, 80, generator=torch.Generator().manual_seed(4))  # neighbours do not matter
    q = fmt.quantize(x)
    for t in (0, 2):
        assert torch.all(q.scale[t].float() == SCALE_FLOOR)
        if name == "int8":
            assert torch.all(q.codes[t] == 0)
        else:  # +0 (0x00) or -0 (0x80) in e4m3fn
            assert torch.all((q.codes[t] & 0x7F) == 0)
        back = fmt.dequantize(q.codes[t], q.scale[t], torch.float32)
        assert torch.all(back == 0) and torch.isfinite(back).all()


def test_int8_saturates_inf_to_127_scale() -> None:
    fmt = get_format("int8")
    x = torch.tensor([[[float("inf"), -float("inf"), 1.0, 0.0]]])
    q = fmt.quantize(x)
    assert q.scale.item() == FP16_MAX
    assert q.codes.view(torch.int8).flatten().tolist() == [127, -127, 0, 0]
    back = fmt.dequantize(q.codes, q.scale, torch.float32)
    assert back.flatten().tolist() == [127 * FP16_MAX, -127 * FP16_MAX, 0.0, 0.0]


def test_formats_are_kvformat_instances() -> None:
    for name in available_formats():
        f = get_format(name)
        assert isinstance(f, KVFormat)
        assert f.quantized == (name in ("int8", "fp8"))
        assert isinstance(f.version, int) and f.version >= 1
    assert math.isclose(QMAX["fp8"], float(torch.finfo(torch.float8_e4m3fn).max))
