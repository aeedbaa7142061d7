"""KV formats: the name registry, the Hadamard rotation and the int8 / fp8 (e4m3) per-(token, head) round trip.

The error bounds checked here are the ones the format docstrings promise
(``kvpage.formats.per_token``), with ``y = fmt.to_stored_basis(x)`` the row as it
is coded (``x @ R`` for the rotated ``int8``/``fp8``, ``x`` itself for the plain
``int8_per_token_head``/``fp8_per_token_head``) and ``y_hat = fmt.dequantize_rotated(...)``:

* int8: ``|y - y_hat| <= s / 2`` with ``s`` the stored float16 scale;
* fp8:  ``|y - y_hat| <= 2**-4 * |y| + 2**-10 * s``;
* both: ``s = max(amax(|y|) / qmax, 2**-14)`` rounded to float16 (qmax 127 / 448);
* ``R`` orthonormal: ``||x - dequantize(...)||_2 == ||y - y_hat||_2`` per (token, head).

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
    BlockFormat,
    Fp8Format,
    Fp8PerTokenHeadFormat,
    FloatFormat,
    Int8Format,
    Int8RotatedFormat,
    KVFormat,
    Int2Format,
    Int3Format,
    Int4Format,
    available_formats,
    canonical_format_name,
    format_aliases,
    get_format,
    register_format,
    TokenFormat,
)
from kvpage.formats.rotation import hadamard_rotation, hadamard_transform


ROTATED = ["int8_rotated", "fp8"]
#: The block-wise (quantize-on-seal) formats.
SEALED = ("int4", "int3", "int2", "int4_rotated", "int3_rotated", "int2_rotated")
PLAIN = ["int8", "fp8_per_token_head"]
QUANTIZED = ROTATED + PLAIN
#: the code each quantized format uses
KIND = {"int8_rotated": "int8", "fp8": "fp8", "int8": "int8", "fp8_per_token_head": "fp8"}
QMAX = {name: {"int8": 127.0, "fp8": 448.0}[kind] for name, kind in KIND.items()}
SCALE_FLOOR = 2.0**-14
FP16_MAX = 65504.0

# -- registry -----------------------------------------------------------------------------------

ALIASES = {
    # quantized
    "int8_rotated": "int8_rotated",
    "int8": "int8",
    "int8_per_token_head": "int8",  # vLLM's name for the same layout
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e4m3": "fp8",
    "e4m3": "fp8",
    "fp8_per_token_head": "fp8_per_token_head",
    "block_wise_fp8": "fp8_per_token_head",  # FastDeploy: per-(token, head) scales, unrotated
    "int4": "int4",
    "int4_zp": "int4",  # FastDeploy
    "int3": "int3",
    "kivi3": "int3",
    "int3_kivi": "int3",
    "int3_zp": "int3",
    "int2": "int2",
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
CLASS_OF = {
    "int8_rotated": Int8RotatedFormat,
    "fp8": Fp8Format,
    "int8": Int8Format,
    "fp8_per_token_head": Fp8PerTokenHeadFormat,
    "int4": Int4Format,
    "int3": Int3Format,
    "int2": Int2Format,
}


@pytest.mark.parametrize("alias,canon", sorted(ALIASES.items()))
def test_every_alias_resolves(alias: str, canon: str) -> None:
    assert canonical_format_name(alias, torch.float32) == canon
    fmt = get_format(alias)
    assert fmt.name == canon
    assert type(fmt) is CLASS_OF.get(canon, FloatFormat)


@pytest.mark.parametrize(
    "spelling",
    ["FP8_E4M3", "Float8_E4M3FN", "Block_Wise_FP8", "INT8", "BF16", "  fp16 ", "Auto", "INT8_Per_Token_Head",
     " FP8_PER_TOKEN_HEAD"],
)
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
        else:  # a canonical name is not also listed as an alias
            assert alias not in table
    assert sorted(a for a, c in table.items() if c == "fp8") == sorted(
        ["fp8_e4m3", "float8_e4m3fn", "float8_e4m3", "e4m3"]
    )
    # the plain variants are formats of their own now, not spellings of the rotated ones
    assert [a for a, c in table.items() if c == "int8"] == ["int8_per_token_head"]
    assert not [a for a, c in table.items() if c == "int8_rotated"]
    # FastDeploy's block_wise_fp8 keeps one dynamic scale per (token, kv head) of unrotated rows (its scale
    # caches are [num_blocks, kv_heads, block_size]): the plain layout, not the rotated fp8
    assert [a for a, c in table.items() if c == "fp8_per_token_head"] == ["block_wise_fp8"]
    assert available_formats() == [
        "auto", "float32", "bfloat16", "float16", "int8", "fp8", "int8_rotated", "fp8_per_token_head",
        "int8_static", "fp8_static",  # static calibrated scales: tests/test_static_scales.py
        "int4", "int3", "int2",  # quantize on seal: tests/test_kivi.py
        "int4_rotated", "int3_rotated", "int2_rotated",  # the same on Hadamard-rotated rows: tests/test_kivi.py
    ]


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


@pytest.mark.parametrize("bad", ["int4_typo", "fp8e5m2", "", "uint8", "float64", "int8_per_token"])
def test_unknown_name_lists_the_valid_names(bad: str) -> None:
    with pytest.raises(UnknownKVFormatError) as ei:
        get_format(bad)
    msg = str(ei.value)
    assert repr(bad) in msg
    for name in ["auto", "float32", "bfloat16", "float16", "int8_rotated", "fp8", "int8", "fp8_per_token_head"]:
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

    class Clash3(Int8Format):
        name = "my_other_fmt"
        aliases = ("INT8_ROTATED",)  # a canonical name, not free as an alias

    with pytest.raises(ValueError, match="int8_rotated"):
        register_format(Clash3)
    with pytest.raises(UnknownKVFormatError):
        get_format("my_other_fmt")


# -- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANTIZED)
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


@pytest.mark.parametrize("name", QUANTIZED)
def test_bits_per_value_at_head_dim_64(name: str) -> None:
    # (64 * 8 bits + 16-bit scale) / 64 values
    assert get_format(name).bits_per_value(block_size=16, kv_heads=8, head_dim=64) == pytest.approx(8.25)
    assert get_format("bfloat16").bits_per_value(block_size=16, kv_heads=8, head_dim=64) == 16


def test_float_format_round_trip() -> None:
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))
    f32 = get_format("float32")
    q = f32.quantize(x, kind="key")
    assert q.scale is None and q.codes.dtype == torch.float32 and torch.equal(q.codes, x)
    assert f32.rotation(8, torch.float32, "cpu") is None
    assert torch.equal(f32.dequantize_rotated(q.codes, None, torch.float32, kind="key"), x)
    bf = get_format("bf16")
    q = bf.quantize(x, kind="key")
    assert q.codes.dtype == torch.bfloat16
    back = bf.dequantize(q.codes, None, torch.float32, kind="key")
    assert back.dtype == torch.float32
    assert torch.all((back - x).abs() <= 2.0**-8 * x.abs())  # one rounding to 8 mantissa bits


# -- the Hadamard rotation ------------------------------------------------------------------------

HEAD_DIMS = [1, 3, 64, 80, 96, 128]


def _blocks(d: int) -> list[int]:
    """Binary decomposition of ``d``, largest first (96 -> [64, 32]); written independently of the module."""
    out, bit = [], 1 << d.bit_length()
    while bit:
        if d & bit:
            out.append(bit)
        bit >>= 1
    return out


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hadamard_rotation_is_orthonormal(head_dim: int) -> None:
    r = hadamard_rotation(head_dim)
    assert r.shape == (head_dim, head_dim) and r.dtype == torch.float32 and r.device.type == "cpu"
    eye = torch.eye(head_dim)
    assert (r @ r.T - eye).abs().max() <= 1e-6
    assert (r.T @ r - eye).abs().max() <= 1e-6
    assert torch.equal(r, r.T)  # Sylvester blocks are symmetric: R.T == R (hadamard_transform relies on it)
    r64 = hadamard_rotation(head_dim, torch.float64)
    assert r64.dtype == torch.float64
    assert (r64 @ r64.T - torch.eye(head_dim, dtype=torch.float64)).abs().max() <= 1e-12


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hadamard_rotation_is_deterministic(head_dim: int) -> None:
    a = hadamard_rotation(head_dim)
    b = hadamard_rotation(head_dim, torch.float32, "cpu")
    fresh = hadamard_rotation.__wrapped__(head_dim)  # bypass the cache: recomputed from scratch
    assert torch.equal(a, b) and torch.equal(a, fresh)
    assert torch.equal(hadamard_rotation(head_dim, torch.float64).float(), a)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_hadamard_rotation_block_structure(head_dim: int) -> None:
    """Block-diagonal, one Sylvester block per set bit of ``head_dim``, entries +-1/sqrt(block), zero elsewhere."""
    r = hadamard_rotation(head_dim, torch.float64)
    start = 0
    mask = torch.zeros(head_dim, head_dim, dtype=torch.bool)
    for n in _blocks(head_dim):
        blk = r[start:start + n, start:start + n]
        assert torch.allclose(blk.abs(), torch.full_like(blk, n**-0.5), rtol=1e-15, atol=0), n
        assert torch.all(blk.abs() == blk[0, 0])
        assert torch.all(blk[0] > 0) and torch.all(blk[:, 0] > 0)  # Sylvester: first row and column all +
        if n >= 2:  # the recursive structure [[H, H], [H, -H]]
            h = n // 2
            top = blk[:h, :h]
            assert torch.equal(blk[:h, h:], top) and torch.equal(blk[h:, :h], top) and torch.equal(blk[h:, h:], -top)
        mask[start:start + n, start:start + n] = True
        start += n
    assert start == head_dim
    assert torch.all(r[~mask] == 0)


def test_hadamard_rotation_power_of_two_entries() -> None:
    r = hadamard_rotation(128)
    assert torch.all(r.abs() == 128**-0.5)  # a single dense block
    assert torch.all(hadamard_rotation(64).abs() == 0.125)  # exact for a power of 4
    assert hadamard_rotation(1).item() == 1.0
    with pytest.raises(ValueError):
        hadamard_rotation(0)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_to_stored_basis_is_x_times_r(head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(7, 3, head_dim, generator=g) * 5.0
    ref = x.double() @ hadamard_rotation(head_dim, torch.float64)
    row_norm = x.double().norm(dim=-1, keepdim=True)
    for name in ROTATED:
        fmt = get_format(name)
        y = fmt.to_stored_basis(x)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert torch.all((y.double() - ref).abs() <= 1e-6 * row_norm)
        assert torch.equal(fmt.rotation(head_dim, torch.float32, "cpu"), hadamard_rotation(head_dim))
    assert torch.all((hadamard_transform(x).double() - ref).abs() <= 1e-6 * row_norm)
    # on unit vectors the butterflies are exact: the transform of I is R itself, bit for bit
    assert torch.equal(hadamard_transform(torch.eye(head_dim)), hadamard_rotation(head_dim))
    # orthonormal: the row norms are kept
    assert torch.allclose(hadamard_transform(x).double().norm(dim=-1, keepdim=True), row_norm, rtol=1e-6)
    # applying it twice gives x back (R @ R == I since R is symmetric)
    assert torch.allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-5)
    for name in PLAIN:
        fmt = get_format(name)
        assert fmt.rotation(head_dim, torch.float32, "cpu") is None
        assert torch.equal(fmt.to_stored_basis(x), x)


def test_stored_basis_of_a_row_does_not_depend_on_the_batch() -> None:
    """Regression: ``to_stored_basis`` was ``x @ R``, and a matmul's float rounding depends on the batch shape.

    The same token then got different codes (or scales) when written in a prefill batch
    and when written alone (decode), e.g. fp8 at head_dim 128 about once in 500 rows.
    Stored bytes must depend on the token alone (C22, prefix sharing).
    """
    for name in ROTATED:
        fmt = get_format(name)
        for seed, d in ((1, 128), (5, 128), (11, 128), (16, 128), (0, 96), (2, 80)):
            x = torch.randn(40, 3, d, generator=torch.Generator().manual_seed(seed))
            whole = fmt.to_stored_basis(x)
            q = fmt.quantize(x, kind="key")
            for i in range(x.shape[0]):
                assert torch.equal(fmt.to_stored_basis(x[i:i + 1]), whole[i:i + 1]), (name, seed, i)
                qi = fmt.quantize(x[i:i + 1], kind="key")
                assert torch.equal(qi.codes, q.codes[i:i + 1]), (name, seed, i)
                assert torch.equal(qi.scale.view(torch.int16), q.scale[i:i + 1].view(torch.int16)), (name, seed, i)


# -- property tests -----------------------------------------------------------------------------


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


def _check_scale(name: str, y: torch.Tensor, s: torch.Tensor) -> None:
    """``s`` is ``max(amax(|y|) / qmax, floor)`` rounded to float16, with ``y`` the stored-basis rows."""
    assert s.dtype == torch.float16 and tuple(s.shape) == tuple(y.shape[:2])
    s64 = s.double()
    assert torch.isfinite(s64).all() and (s64 >= SCALE_FLOOR).all()
    ideal = (y.double().abs().amax(-1) / QMAX[name]).clamp(min=SCALE_FLOOR)
    # rounded to float16 (11 significant bits): relative error <= 2**-11
    assert torch.all((s64 - ideal).abs() <= 2.0**-11 * ideal)


def _check_bound(name: str, x: torch.Tensor) -> None:
    """Scale and per-element bound in the stored basis, and the original-basis error equal to it in L2."""
    fmt = get_format(name)
    q = fmt.quantize(x, kind="key")
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    y = fmt.to_stored_basis(x)
    x64, y64 = x.double(), y.double()
    if name in PLAIN:
        assert torch.equal(y, x)  # moderate inputs: nothing to clamp, no rotation
    else:  # y is x @ R up to float32 rounding
        r = hadamard_rotation(x.shape[-1], torch.float64)
        # (plus a few float32 subnormal spacings, 2**-149 each, for rows that are themselves subnormal)
        assert torch.all((y64 - x64 @ r).abs() <= 1e-6 * x64.norm(dim=-1, keepdim=True) + 2.0**-145)
    _check_scale(name, y, q.scale)
    y_hat = fmt.dequantize_rotated(q.codes, q.scale, torch.float32, kind="key")
    assert y_hat.dtype == torch.float32 and y_hat.shape == x.shape
    assert torch.isfinite(y_hat).all()
    err = (y_hat.double() - y64).abs()
    s = q.scale.double().unsqueeze(-1)
    if KIND[name] == "int8":
        codes = q.codes.view(torch.int8)
        assert int(codes.min()) >= -127 and int(codes.max()) <= 127
        bound = s / 2
    else:
        assert not torch.any((q.codes & 0x7F) == 0x7F), "e4m3fn NaN code stored"
        bound = 2.0**-4 * y64.abs() + 2.0**-10 * s
    slack = 1e-6 * (y64.abs() + s)
    worst = (err - bound - slack).max()
    assert worst <= 0, f"{name}: error exceeds the documented bound by {float(worst)}"
    # the original basis: x_hat = y_hat @ R.T, and R orthonormal keeps the error's L2 norm
    back = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert torch.isfinite(back).all()
    if name in PLAIN:
        assert torch.equal(back, y_hat)
    err_x = (back.double() - x64).norm(dim=-1)
    err_y = (y_hat.double() - y64).norm(dim=-1)
    tol = 1e-6 * (x64.norm(dim=-1) + y_hat.double().norm(dim=-1)) + 2.0**-140
    assert torch.all((err_x - err_y).abs() <= tol), float(((err_x - err_y).abs() - tol).max())


@pytest.mark.parametrize("name", QUANTIZED)
@settings(max_examples=40, deadline=None)
@given(x=kv_rows(outlier=False))
def test_round_trip_within_documented_bound(name: str, x: torch.Tensor) -> None:
    _check_bound(name, x)


@pytest.mark.parametrize("name", QUANTIZED)
@settings(max_examples=40, deadline=None)
@given(x=kv_rows(outlier=True))
def test_round_trip_within_bound_with_outlier_channel(name: str, x: torch.Tensor) -> None:
    _check_bound(name, x)


def _outlier_rows(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(33, 3, head_dim, generator=g) * 2.0
    y = x.clone()
    # the very last lane is the outlier (100x the rest of its row): it must enter amax
    rest = y[..., :-1].abs().amax(-1)
    y[..., head_dim - 1] = torch.where(y[..., -1] < 0, -100.0, 100.0) * rest
    return x, y


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("head_dim", [80, 96])
def test_non_power_of_two_head_dim_random_and_outliers(name: str, head_dim: int) -> None:
    x, xo = _outlier_rows(head_dim)
    _check_bound(name, x)
    _check_bound(name, xo)
    fmt = get_format(name)
    q = fmt.quantize(xo, kind="key")
    amax = xo.abs().amax(-1)
    assert torch.allclose(q.scale.float(), amax / QMAX[name], rtol=2.0**-11)
    # the outlier itself comes back within a tiny relative error
    back = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")
    rel = ((back[..., -1] - xo[..., -1]).abs() / xo[..., -1].abs()).max()
    assert rel <= (2.0**-4 if KIND[name] == "fp8" else 1 / 254 + 1e-3)


@pytest.mark.parametrize("name", ROTATED)
@pytest.mark.parametrize("head_dim", [80, 96])
def test_non_power_of_two_head_dim_random_and_outliers_rotated(name: str, head_dim: int) -> None:
    x, xo = _outlier_rows(head_dim)
    _check_bound(name, x)
    _check_bound(name, xo)
    fmt = get_format(name)
    q = fmt.quantize(xo, kind="key")
    # the last lane sits in the last (smallest) Hadamard block, of size b: it spreads over those b lanes
    # as +-outlier/sqrt(b) and sets the scale
    b = _blocks(head_dim)[-1]
    y = fmt.to_stored_basis(xo)
    assert torch.allclose(q.scale.float(), y.abs().amax(-1) / QMAX[name], rtol=2.0**-11)
    assert torch.all(y.abs().amax(-1) >= xo[..., -1].abs() / b**0.5)
    assert torch.all(y[..., head_dim - b:].abs().amin(-1) >= 0.8 * xo[..., -1].abs() / b**0.5)
    # the outlier itself comes back within a small relative error (measured at most 1.6e-3 int8, 2.1e-2 fp8)
    back = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")
    rel = ((back[..., -1] - xo[..., -1]).abs() / xo[..., -1].abs()).max()
    assert rel <= (2.0**-4 if KIND[name] == "fp8" else 1 / 254 + 1e-3)


@pytest.mark.parametrize("pair", [("int8_rotated", "fp8"), ("int8", "fp8_per_token_head")])
def test_int8_error_is_much_smaller_than_fp8_on_gaussian_rows(pair: tuple[str, str]) -> None:
    # Sanity that the two formats are really different encodings with their expected precision.
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(1))
    errs = {}
    for name in pair:
        f = get_format(name)
        q = f.quantize(x, kind="key")
        errs[KIND[name]] = (f.dequantize(q.codes, q.scale, torch.float32, kind="key") - x).abs().mean().item()
    assert 0 < errs["int8"] < errs["fp8"]
    assert errs["int8"] < 0.01 and errs["fp8"] < 0.05


def _rms_error(name: str, x: torch.Tensor) -> float:
    f = get_format(name)
    q = f.quantize(x, kind="key")
    return (f.dequantize(q.codes, q.scale, torch.float32, kind="key") - x).pow(2).mean().sqrt().item()


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_rotation_reduces_int8_error_with_outlier_channel(head_dim: int) -> None:
    """Rows with one channel 100x the rest: rotated int8 is several times more accurate than plain int8.

    Measured ratio plain / rotated (original basis RMS): 7.3 (64), 6.4 (96), 10.0 (128).
    """
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(64, 4, head_dim, generator=g)
    c = torch.randint(0, head_dim, (64, 4, 1), generator=g)
    big = x.gather(-1, c).sign() * 100.0 * x.abs().amax(-1, keepdim=True)
    x.scatter_(-1, c, big)
    plain, rotated = _rms_error("int8", x), _rms_error("int8_rotated", x)
    assert 0 < rotated and plain / rotated >= 4.0, (plain, rotated)
    # without outliers the two are comparable (rotation is not a free lunch on already-flat rows)
    x = torch.randn(64, 4, head_dim, generator=g)
    ratio = _rms_error("int8", x) / _rms_error("int8_rotated", x)
    assert 0.8 < ratio < 1.25  # measured 0.99 .. 1.01


@pytest.mark.parametrize("name", QUANTIZED)
@settings(max_examples=25, deadline=None)
@given(x=kv_rows(outlier=False), split=st.integers(0, 4))
def test_quantization_is_deterministic_and_per_row(name: str, x: torch.Tensor, split: int) -> None:
    fmt = get_format(name)
    a, b = fmt.quantize(x, kind="key"), fmt.quantize(x.clone(), kind="key")
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scale.view(torch.int16), b.scale.view(torch.int16))  # same bytes
    # a token's bytes do not depend on which other tokens share the call (prefill vs decode)
    split = min(split, x.shape[0])
    parts = [fmt.quantize(p, kind="key") for p in (x[:split], x[split:]) if p.shape[0]]
    assert torch.equal(torch.cat([p.codes for p in parts]), a.codes)
    assert torch.equal(torch.cat([p.scale for p in parts]).view(torch.int16), a.scale.view(torch.int16))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_storage_dtype_is_uint8_for_any_input_dtype(name: str, in_dtype: torch.dtype) -> None:
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(2)).to(in_dtype)
    fmt = get_format(name)
    q = fmt.quantize(x, kind="key")
    assert q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float16
    # the input dtype only changes the values coded, never the arithmetic: same as quantizing x.float()
    q32 = fmt.quantize(x.float(), kind="key")
    assert torch.equal(q.codes, q32.codes) and torch.equal(q.scale, q32.scale)
    for out in (torch.float32, torch.bfloat16):
        assert fmt.dequantize(q.codes, q.scale, out, kind="key").dtype == out
        assert fmt.dequantize_rotated(q.codes, q.scale, out, kind="key").dtype == out
    ref = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")
    assert torch.allclose(fmt.dequantize(q.codes, q.scale, torch.bfloat16, kind="key").float(), ref, rtol=2**-7, atol=2**-7)


def test_known_codes() -> None:
    """A few hand-computed encodings (independent of the implementation's arithmetic)."""
    # int8: row [-2, 0.5, 1] -> scale 2/127, codes round(x * 127 / 2) = -127, 32 (31.75), 64 (63.5 -> even 64)
    x = torch.tensor([[[-2.0, 0.5, 1.0]]])
    q = get_format("int8").quantize(x, kind="key")
    s = torch.tensor(2.0 / 127).half()
    assert q.scale.item() == s.item()
    codes = q.codes.view(torch.int8).flatten().tolist()
    expected = [round(v / s.item()) for v in (-2.0, 0.5, 1.0)]
    assert codes == expected and codes[0] == -127
    # fp8: row [448, -1, 0] -> scale 1.0, codes are the e4m3fn bit patterns 0x7E, 0xB8, 0x00
    q = get_format("fp8_per_token_head").quantize(torch.tensor([[[448.0, -1.0, 0.0]]]), kind="key")
    assert q.scale.item() == 1.0
    assert q.codes.flatten().tolist() == [0x7E, 0xB8, 0x00]


def test_known_codes_rotated() -> None:
    """Hand-computed rotated encodings at head_dim 4: ``R = H4 / 2`` with H4 rows
    ``[1,1,1,1], [1,-1,1,-1], [1,1,-1,-1], [1,-1,-1,1]``, so ``y = x @ R`` is exact here."""
    # int8: [3, 1, 0, 0] -> y = (3 H4[0] + H4[1]) / 2 = [2, 1, 2, 1]; scale 2/127, codes round(y / s)
    q = get_format("int8_rotated").quantize(torch.tensor([[[3.0, 1.0, 0.0, 0.0]]]), kind="key")
    s = torch.tensor(2.0 / 127).half()
    assert q.scale.item() == s.item()
    assert q.codes.view(torch.int8).flatten().tolist() == [round(v / s.item()) for v in (2.0, 1.0, 2.0, 1.0)]
    assert q.codes.view(torch.int8).flatten().tolist()[0] == 127
    # [1, 0, 0, -1] -> y = (H4[0] - H4[3]) / 2 = [0, 1, 1, 0]: scale 1/127, codes 0, 127, 127, 0
    q = get_format("int8_rotated").quantize(torch.tensor([[[1.0, 0.0, 0.0, -1.0]]]), kind="key")
    assert q.scale.item() == torch.tensor(1.0 / 127).half().item()
    assert q.codes.view(torch.int8).flatten().tolist() == [0, 127, 127, 0]
    # fp8: [896, 0, 0, 0] -> y = 448 H4[0] = [448] * 4: scale 1.0, codes 0x7E (448) four times
    q = get_format("fp8").quantize(torch.tensor([[[896.0, 0.0, 0.0, 0.0]], [[0.0, -896.0, 0.0, 0.0]]]), kind="key")
    assert q.scale.flatten().tolist() == [1.0, 1.0]
    # [0, -896, 0, 0] -> y = -448 H4[1] = [-448, 448, -448, 448]: 0xFE, 0x7E, 0xFE, 0x7E
    assert q.codes.flatten().tolist() == [0x7E] * 4 + [0xFE, 0x7E, 0xFE, 0x7E]
    # and both decode back exactly
    back = get_format("fp8").dequantize(q.codes, q.scale, torch.float32, kind="key")
    assert back.flatten().tolist() == [896.0, 0.0, 0.0, 0.0, 0.0, -896.0, 0.0, 0.0]


# -- C23: fp8 range -----------------------------------------------------------------------------


def _c23_rows() -> torch.Tensor:
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
    return x


@pytest.mark.parametrize("name", ["fp8", "fp8_per_token_head"])
def test_c23_fp8_saturates_never_inf_nan(name: str) -> None:
    fmt = get_format(name)
    big = 448.0 * FP16_MAX  # largest magnitude a float16 scale can represent
    x = _c23_rows()
    q = fmt.quantize(x, kind="key")
    s = q.scale.float()
    y_hat = fmt.dequantize_rotated(q.codes, q.scale, torch.float32, kind="key")
    back = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")

    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(y_hat).all() and torch.isfinite(back).all(), "fp8 produced inf/NaN"
    assert not torch.any((q.codes & 0x7F) == 0x7F), "e4m3fn NaN bit pattern stored"
    # every decoded magnitude (stored basis) is within +-448 * its row's scale
    assert torch.all(y_hat.abs() <= 448.0 * s.unsqueeze(-1))
    # rows beyond the range saturate the scale at the float16 max
    assert s[0, 1].item() == s[1, 0].item() == FP16_MAX
    # an isolated +-inf (or 1e9) lane decodes to exactly +-448 * 65504 in the original basis, the other lanes
    # of its row to values far below it
    assert back[0, 0, 7].item() == big and back[0, 0, 8].item() == -big
    assert back[1, 1, 0].item() == -big
    assert back[2, 0, 0].item() == big
    others = torch.ones(96, dtype=torch.bool)
    others[[7, 8]] = False
    assert back[0, 0, others].abs().max() < 1e-3 * big
    # the all-zero token: finite positive scale (the floor) and exact zeros
    assert torch.all(s[3] == SCALE_FLOOR)
    assert torch.all(back[3] == 0) and torch.all(y_hat[3] == 0)
    # an ordinary row next to the extreme ones is unaffected (per-row scales)
    y4 = fmt.to_stored_basis(x[4])
    assert torch.all((y_hat[4] - y4).abs() <= 2.0**-4 * y4.abs() + 2.0**-10 * s[4].unsqueeze(-1) + 1e-7)
    if name == "fp8_per_token_head":  # plain: inf and out-of-range values saturate element-wise to +-448 * scale
        assert s[0, 0].item() == FP16_MAX
        assert q.codes[0, 0, 7].item() == 0x7E and q.codes[0, 0, 8].item() == 0xFE
        assert torch.all(back[0, 1, 2:] == big) and back[0, 1, 1].item() == -big and back[0, 1, 0].item() == big
        assert torch.all(back[1, 0] == big)
        # 1e9 needs a scale of 1e9 / 448 > 65504: the scale saturates at the float16 max
        assert s[2, 0].item() == FP16_MAX
    else:
        # rotated: +-inf clamps to +-big first, then spreads over its 64-lane block as +-big / 8;
        # lanes 7 and 8 together give +-big / 4 on half the block: scale big / 4 / 448
        assert s[0, 0].item() == FP16_MAX / 4
        codes = set(q.codes[0, 0, :64].tolist())
        assert {0x7E, 0xFE} <= codes <= {0x00, 0x80, 0x7E, 0xFE}  # +-0 or +-448: the small lanes vanish
        assert s[1, 1].item() == s[2, 0].item() == FP16_MAX / 8
        # a saturated all-positive row stays all positive and finite
        assert torch.all(back[1, 0] > 0)


@settings(max_examples=40, deadline=None)
@given(
    vals=st.lists(
        st.floats(allow_nan=False, allow_infinity=True, width=32), min_size=1, max_size=40
    ),
    name=st.sampled_from(QUANTIZED),
)
def test_any_finite_or_infinite_input_decodes_finite(vals: list[float], name: str) -> None:
    x = torch.tensor(vals, dtype=torch.float32).view(1, 1, -1)
    fmt = get_format(name)
    q = fmt.quantize(x, kind="key")
    y = fmt.to_stored_basis(x)
    y_hat = fmt.dequantize_rotated(q.codes, q.scale, torch.float32, kind="key")
    back = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")
    assert torch.isfinite(q.scale.float()).all() and torch.isfinite(y).all()
    assert torch.isfinite(y_hat).all() and torch.isfinite(back).all()
    limit = QMAX[name] * q.scale.float().unsqueeze(-1)
    assert torch.all(y_hat.abs() <= limit)
    # sign is kept (in the stored basis) for every value that does not round to zero
    nz = y_hat != 0
    assert torch.all(torch.sign(y_hat[nz]) == torch.sign(y[nz]))
    # the original basis has the same norm (R orthonormal)
    assert math.isclose(back.double().norm().item(), y_hat.double().norm().item(), rel_tol=1e-5, abs_tol=1e-30)
    if name in PLAIN:
        assert torch.equal(back, y_hat)
        nz = back != 0
        assert torch.all(torch.sign(back[nz]) == torch.sign(x[nz]))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_all_zero_token_has_finite_scale_and_decodes_to_zero(name: str, zero: float) -> None:
    fmt = get_format(name)
    x = torch.full((3, 2, 80), zero)
    x[1] = torch.randn(2, 80, generator=torch.Generator().manual_seed(4))  # neighbours do not matter
    q = fmt.quantize(x, kind="key")
    for t in (0, 2):
        assert torch.all(q.scale[t].float() == SCALE_FLOOR)
        if KIND[name] == "int8":
            assert torch.all(q.codes[t] == 0)
        else:  # +0 (0x00) or -0 (0x80) in e4m3fn
            assert torch.all((q.codes[t] & 0x7F) == 0)
        back = fmt.dequantize(q.codes[t], q.scale[t], torch.float32, kind="key")
        assert torch.all(back == 0) and torch.isfinite(back).all()
        assert torch.all(fmt.dequantize_rotated(q.codes[t], q.scale[t], torch.float32, kind="key") == 0)
    assert torch.all(q.scale[1].float() > SCALE_FLOOR)  # the random neighbour got a real scale


def test_int8_saturates_inf_to_127_scale() -> None:
    fmt = get_format("int8")
    x = torch.tensor([[[float("inf"), -float("inf"), 1.0, 0.0]]])
    q = fmt.quantize(x, kind="key")
    assert q.scale.item() == FP16_MAX
    assert q.codes.view(torch.int8).flatten().tolist() == [127, -127, 0, 0]
    back = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")
    assert back.flatten().tolist() == [127 * FP16_MAX, -127 * FP16_MAX, 0.0, 0.0]


def test_int8_rotated_saturates_inf_to_127_scale() -> None:
    """``[inf, -inf, 1, 0]`` clamps to ``[L, -L, 1, 0]`` (``L = 127 * 65504``); with ``R = H4 / 2``,
    ``y = [0.5, L + 0.5, -0.5, L - 0.5]`` -> scale 65504, codes ``[0, 127, 0, 127]``, and
    ``y_hat @ R.T = [L, -L, 0, 0]``: the infinities saturate to exactly +-127 * scale here too."""
    fmt = get_format("int8_rotated")
    q = fmt.quantize(torch.tensor([[[float("inf"), -float("inf"), 1.0, 0.0]]]), kind="key")
    assert q.scale.item() == FP16_MAX
    assert q.codes.view(torch.int8).flatten().tolist() == [0, 127, 0, 127]
    back = fmt.dequantize(q.codes, q.scale, torch.float32, kind="key")
    assert back.flatten().tolist() == [127 * FP16_MAX, -127 * FP16_MAX, 0.0, 0.0]


def test_formats_are_kvformat_instances() -> None:
    for name in available_formats():
        f = get_format(name)
        assert isinstance(f, KVFormat)
        # exactly one of the two interfaces: block-wise for the quantize-on-seal formats, token-wise for the rest
        block_wise = name in SEALED
        assert isinstance(f, BlockFormat) == block_wise and isinstance(f, TokenFormat) == (not block_wise)
        assert f.quantized == (name in QUANTIZED or name.endswith("_static") or name in SEALED)
        assert isinstance(f.version, int) and f.version >= 1
        if isinstance(f, TokenFormat):
            assert (f.rotation(8, torch.float32, "cpu") is not None) == (name in ROTATED)
        else:  # the token interface is not there at all (it used to raise TypeError); rotation is the block one's
            assert not hasattr(f, "quantize") and not hasattr(f, "dequantize_rotated")
            assert (f.rotation(8, torch.float32, "cpu") is not None) == name.endswith("_rotated")
        # equal when they store the same bytes the same way
        assert f == get_format(name) and hash(f) == hash(get_format(name))
    # the rotated formats store different bytes under the names int8/fp8 used for plain rows before:
    # their version (part of the layout fingerprint) moved on, so old stores are never read as rotated
    assert get_format("fp8").version == 2 and get_format("int8").version == 3  # int8: plain again, after 2 = rotated
    assert get_format("int8_rotated").version == get_format("fp8_per_token_head").version == 1
    # the rotated sealed formats carry their base coding's version; their name tells the rotation apart
    assert all(get_format(n + "_rotated").version == get_format(n).version for n in ("int4", "int3", "int2"))
    assert math.isclose(QMAX["fp8"], float(torch.finfo(torch.float8_e4m3fn).max))
    assert math.isclose(QMAX["int8"], float(torch.iinfo(torch.int8).max))
