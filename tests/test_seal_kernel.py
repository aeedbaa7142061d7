"""The C++ seal of ``int4``/``int3``/``int2`` blocks (``seal_blocks``) writes exactly the bytes of the Python format.

Blocks are drawn by hypothesis: shapes (block sizes 1..64, head_dim 8..256 with value groups that divide it,
1..4 kv heads), storage dtypes (float32, bfloat16, float16), magnitudes from subnormal to float32's largest,
a common offset (values far from zero relative to their spread), constant groups and injected extremes
(zeros, +-inf, NaN). The pool written by :class:`~kvpage.ops.backends.cpu.KernelSealCodec` must equal, byte
for byte, the pool the formats' own code writes (:class:`~kvpage.ops.sealed_attention.SealCodec`), in the
rows the plan names and nowhere else. The int8 first-block copies written by the fused kernel are checked
the same way.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpage.formats import get_format
from kvpage.formats.kivi import SCALE_MAX, SCALE_MIN, decode_scale
from kvpage.ops.backends import cpu as cpu_module
from kvpage.ops.sealed_attention import REFERENCE_CODEC

pytestmark = pytest.mark.skipif(os.environ.get("KVPAGE_CPU_KERNELS") == "0", reason="KVPAGE_CPU_KERNELS=0")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPECIALS = (0.0, float("inf"), -float("inf"), float("nan"), 3.0e38, -3.0e38, 1e-40, 65504.0)


def _writer() -> cpu_module.KernelSealCodec:
    backend = cpu_module.cpu_backend()
    assert backend is not None, "kvpage's CPU kernels did not build"
    return cpu_module.KernelSealCodec(backend.kernels)


@st.composite
def blocks(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    """``([m, bs, kv_heads, head_dim] blocks in a storage dtype, seed)``."""
    m = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([1, 2, 3, 16, 32, 64]))
    kv = draw(st.integers(1, 4))
    d = draw(st.sampled_from([8, 24, 64, 96, 128, 256]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    exp = draw(st.integers(-40, 37 if dtype != torch.float16 else 4))
    x = torch.randn(m, bs, kv, d, generator=gen, dtype=torch.float64) * 10.0**exp
    if draw(st.booleans()):  # a common offset: groups far from zero relative to their spread
        x += draw(st.floats(-1e3, 1e3)) * 10.0**exp
    if draw(st.booleans()):  # constant channels and tokens
        x[:, :, :, ::5] = x[:, :1, :, ::5]
        x[:, ::3] = x[:, ::3, :, :1]
    x = x.clamp(-3.3e38, 3.3e38).to(torch.float32)
    for _ in range(draw(st.integers(0, 4))):  # extremes at drawn places
        at = tuple(draw(st.integers(0, n - 1)) for n in x.shape)
        x[at] = draw(st.sampled_from(SPECIALS))
    return x.to(dtype), seed


def _pools(fmt_name: str, kind: str, bs: int, kv: int, d: int, nb: int) -> list[dict[str, torch.Tensor]]:
    fmt = get_format(fmt_name)
    specs = {s.name: s for s in fmt.tensor_specs(block_size=bs, kv_heads=kv, head_dim=d)}
    gen = torch.Generator().manual_seed(nb)
    pool = {n: torch.randint(0, 256, (nb, *specs[n].shape), generator=gen, dtype=torch.uint8).view(specs[n].dtype)
            for n in fmt.names(kind)}
    return [pool, {n: t.clone() for n, t in pool.items()}]


@pytest.mark.parametrize("fmt_name", ["int4", "int3", "int2"])
@pytest.mark.parametrize("kind", ["key", "value"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=blocks())
def test_kernel_seal_is_byte_identical_to_the_format(fmt_name: str, kind: str,
                                                     drawn: tuple[torch.Tensor, int]) -> None:
    x, seed = drawn
    m, bs, kv, d = x.shape
    fmt = get_format(fmt_name)
    nb = m + 2
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[:m]
    ref, got = _pools(fmt_name, kind, bs, kv, d, nb)
    REFERENCE_CODEC.write_blocks(ref, fmt, kind, x, ids)
    _writer().write_blocks(got, fmt, kind, x, ids)
    for name in ref:
        assert torch.equal(ref[name].view(torch.uint8), got[name].view(torch.uint8)), (name, x.dtype)


@pytest.mark.parametrize("fmt_name", ["int4", "int3", "int2"])
def test_extreme_groups_code_as_documented(fmt_name: str) -> None:
    """Hand-picked groups through the kernel: NaN codes and offsets store 0, steps stay in UE5M3's range."""
    fmt = get_format(fmt_name)
    x = torch.zeros(4, 32, 1, 64)
    x[0, :, 0, 0] = float("nan")                   # a NaN channel
    x[1, 3, 0, 1] = float("inf")                   # one infinite value
    x[2, :, 0, 2] = 1e-30                           # below the smallest step
    x[3, :, 0, 3] = torch.linspace(-3e38, 3e38, 32)  # beyond the largest step
    ref, got = _pools(fmt_name, "key", 32, 1, 64, 4)
    ids = torch.arange(4)
    REFERENCE_CODEC.write_blocks(ref, fmt, "key", x, ids)
    _writer().write_blocks(got, fmt, "key", x, ids)
    for name in ref:
        assert torch.equal(ref[name].view(torch.uint8), got[name].view(torch.uint8)), name
    assert got["key_zero"][0, 0, 0].item() == 0
    steps = decode_scale(got["key_scale"])
    assert steps.min().item() >= SCALE_MIN and steps.max().item() <= SCALE_MAX
    # a group beyond the largest step takes one at least the search's lowest candidate below the largest (int4 and
    # int3: one of the two largest, their -1 candidate clips more; int2 searches down to -3: 1.5 * 2**15 at least)
    lowest = decode_scale(torch.tensor([255 + fmt.step_search.start], dtype=torch.uint8)).item()
    assert lowest == {"int4": 1.75, "int3": 1.75, "int2": 1.5}[fmt_name] * 2.0**15
    assert steps[3, 0, 3].item() >= lowest and steps[2, 0, 2].item() == SCALE_MIN


@settings(max_examples=30, deadline=None)
@given(drawn=blocks())
def test_kernel_sink_copy_is_byte_identical(drawn: tuple[torch.Tensor, int]) -> None:
    x, seed = drawn
    rows = x.flatten(0, 1)                                                      # [m*bs, kv, d]
    sink = get_format("int8")
    n = rows.shape[0] + 5
    dst = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: rows.shape[0]]
    pools = [(torch.zeros(n, *rows.shape[1:], dtype=torch.uint8), torch.zeros(n, rows.shape[1], dtype=torch.float16))
             for _ in range(2)]
    REFERENCE_CODEC.write_sink(*pools[0], sink, "key", rows, dst)
    _writer().write_sink(*pools[1], sink, "key", rows, dst)
    assert torch.equal(pools[0][0], pools[1][0])
    assert torch.equal(pools[0][1].view(torch.int16), pools[1][1].view(torch.int16))


@pytest.mark.parametrize("fmt_name", ["int4", "int3", "int2"])
@pytest.mark.parametrize("kind", ["key", "value"])
@settings(max_examples=40, deadline=None)
@given(bs=st.sampled_from([1, 3, 16, 32]), kv=st.integers(1, 4), d=st.sampled_from([8, 24, 64, 96, 128]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_kernel_unseal_equals_the_format(fmt_name: str, kind: str, bs: int, kv: int, d: int, dtype: torch.dtype,
                                         seed: int) -> None:
    """Pool blocks of arbitrary bytes (every step code, offset and packed code, padding bits included) read back by
    ``unseal_blocks`` equal the format's own dequantization bit for bit, in each compute dtype (NaN payloads too)."""
    fmt = get_format(fmt_name)
    nb = 6
    pool, _ = _pools(fmt_name, kind, bs, kv, d, nb)
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[: 1 + seed % nb]
    ref = REFERENCE_CODEC.read_blocks(pool, fmt, kind, ids, dtype, d)
    got = _writer().read_blocks(pool, fmt, kind, ids, dtype, d)
    assert got.shape == ref.shape == (ids.numel(), bs, kv, d) and got.dtype == dtype
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    same = (got.view(bits) == ref.view(bits)) | (got.isnan() & ref.isnan())
    assert bool(same.all()), (fmt_name, kind, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_kernel_row_moves_equal_index_copy(dtype: torch.dtype) -> None:
    """``move_rows`` writes exactly the named rows (``dst[dst_idx] = src[src_idx]``), leaves the rest, and refuses
    an index out of range without writing."""
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 200, (9, 3, 5), generator=gen).to(dtype)
    dst = torch.randint(0, 200, (12, 3, 5), generator=gen).to(dtype)
    dst_idx, src_idx = torch.tensor([11, 0, 4, 7]), torch.tensor([2, 2, 8, 0])
    ref, got = dst.clone(), dst.clone()
    REFERENCE_CODEC.move_rows(ref, dst_idx, src, src_idx)
    _writer().move_rows(got, dst_idx, src, src_idx)
    assert torch.equal(ref, got)
    assert torch.equal(got[11], src[2]) and torch.equal(got[1], dst[1])
    _writer().move_rows(got, dst_idx[:0], src, src_idx[:0])  # nothing to move
    assert torch.equal(ref, got)
    with pytest.raises(RuntimeError, match="out of range"):
        _writer().move_rows(got, torch.tensor([12]), src, torch.tensor([0]))
    assert torch.equal(ref, got)


@pytest.mark.parametrize("fmt_name", ["int4", "int3", "int2"])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_steps_on_ue5m3_boundaries_code_as_the_format(fmt_name: str, kind: str) -> None:
    """Groups whose min/max step sits on a UE5M3 code, just above one (rounded up a code) and just above 1.875 *
    2^k (the mantissa carries into the next exponent), over the whole exponent range and past both clamps: the
    kernel's branch-free step encoding (from the float's bits) writes the format's bytes."""
    fmt = get_format(fmt_name)
    qmax = 2**fmt.bits - 1
    spans = []
    for k in range(-18, 17):
        for mant in (1.0, 1.125, 1.875):
            base = mant * 2.0**k
            spans += [base, base * (1 + 2**-20), base * (1 - 2**-20)]
    span = torch.tensor(spans, dtype=torch.float64)                               # [S] min/max steps
    n = span.numel()
    if kind == "key":   # channel c spans [0, span * qmax] over the block's 32 tokens
        x = torch.linspace(0, 1, 32, dtype=torch.float64)[:, None] * (span * qmax)[None, :]
        x = x[:, None, :].expand(32, 1, n)
        blocks = torch.nn.functional.pad(x, (0, -n % 64)).unflatten(-1, (-1, 64)).permute(2, 0, 1, 3)
    else:               # token t of head h spans [0, span * qmax] over its 64 channels
        x = torch.linspace(0, 1, 64, dtype=torch.float64)[None, :] * (span * qmax)[:, None]
        blocks = torch.nn.functional.pad(x, (0, 0, 0, -n % 32)).view(-1, 32, 1, 64)
    blocks = blocks.float().contiguous()
    m = blocks.shape[0]
    ref, got = _pools(fmt_name, kind, blocks.shape[1], 1, 64, m)
    ids = torch.arange(m)
    REFERENCE_CODEC.write_blocks(ref, fmt, kind, blocks, ids)
    _writer().write_blocks(got, fmt, kind, blocks, ids)
    for name in ref:
        assert torch.equal(ref[name].view(torch.uint8), got[name].view(torch.uint8)), name


def test_kernel_codec_takes_any_index_tensor_the_reference_takes() -> None:
    """A strided or int32 index (what a caller may hand over) is served by the reference path, with its results."""
    fmt = get_format("int4")
    pool, _ = _pools("int4", "key", 16, 2, 64, 8)
    ids = torch.tensor([5, 0, 3, 1, 6, 2])[::2]                                    # strided: 5, 3, 6
    for index in (ids, ids.to(torch.int32)):
        want = REFERENCE_CODEC.read_blocks(pool, fmt, "key", index.long().contiguous(), torch.float32, 64)
        assert torch.equal(_writer().read_blocks(pool, fmt, "key", index, torch.float32, 64), want)
    src, dst = torch.arange(14.0).view(7, 2), torch.zeros(4, 2)
    _writer().move_rows(dst, torch.tensor([3, 9, 1, 9, 0])[::2], src, ids)   # dst rows 3, 1, 0 <- src 5, 3, 6
    assert dst.tolist() == [[12.0, 13.0], [6.0, 7.0], [0.0, 0.0], [10.0, 11.0]]


def _half_step_groups(n: int, count: int, qmax: int) -> torch.Tensor:
    """``[count, n]`` float32 groups with values a hair from half a step: group ``g`` spans exactly ``[-M, qmax - M]``
    steps of a UE5M3 step ``s`` (so its min/max step is ``s``, both of that step's offsets ``-M``), seven in eight of
    its other values on that grid (so ``(s, -M)`` wins the search at 4 and 3 bits, often at 2) and every eighth at
    ``(j + 1/2) * s``, exact or one float32 ulp towards or away from zero. Divided by ``s`` such a value sits at or
    beside a half, where ``round(y - m)`` (``y - m`` rounded to float32 first, as the format does) and
    ``round(y) - m`` part: ``0.5 - 2**-25 + 1`` rounds to ``1.5``, then to 2, where ``round(0.5 - 2**-25) + 1`` is 1."""
    g = torch.arange(count)
    code = 8 * (16 + (g // 8) % 5 - 2) + g % 8                                   # steps 0.25 .. 7.5
    s = decode_scale(code.to(torch.uint8)).double()[:, None]                        # [count, 1]
    big_m = (1 + (g % 13) % (qmax - 1))[:, None]                                    # offsets -1 .. -(qmax - 1)
    i = torch.arange(n - 2)[None, :]
    j = (i * 5 % qmax - big_m).double()                                             # grid points -M .. qmax - M - 1
    half = i % 8 == 7
    x = ((j + half.double() * 0.5) * s).float()                                     # exact: few significant bits
    nudge = (i // 8) % 3                                                            # 0 exact, 1 towards 0, 2 away
    x = torch.where(half & (nudge == 1), torch.nextafter(x, torch.zeros_like(x)), x)
    x = torch.where(half & (nudge == 2), torch.nextafter(x, x.sign() * float("inf")), x)
    lo, hi = (-big_m * s).float(), ((qmax - big_m) * s).float()
    return torch.cat([lo, hi, x], 1)


@pytest.mark.parametrize("fmt_name", ["int4", "int3", "int2"])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_values_a_hair_from_half_a_step_code_as_the_format(fmt_name: str, kind: str) -> None:
    """Values that divide to a half-integer or one ulp beside it, in groups whose offsets are negative: the kernel
    codes them as ``round(x / s - m)``, ``x / s - m`` one float32 expression as in the format, and writes the format's
    bytes (``round(x / s) - m`` in the kernel's final coding fails every case here; in its search alone it moves a
    candidate's error by about 1e-7 of it, which changes bytes only where two candidates nearly tie)."""
    fmt = get_format(fmt_name)
    qmax = 2**fmt.bits - 1
    if kind == "key":   # channel c of block b: group 64 b + c, over the block's 32 tokens
        blocks = _half_step_groups(32, 128, qmax).view(2, 64, 32).transpose(1, 2).unsqueeze(2)
    else:               # token t of block b: group 32 b + t, over its 64 channels
        blocks = _half_step_groups(64, 64, qmax).view(2, 32, 1, 64)
    blocks = blocks.contiguous()
    ref, got = _pools(fmt_name, kind, 32, 1, 64, 2)
    ids = torch.tensor([1, 0])
    REFERENCE_CODEC.write_blocks(ref, fmt, kind, blocks, ids)
    _writer().write_blocks(got, fmt, kind, blocks, ids)
    for name in ref:
        assert torch.equal(ref[name].view(torch.uint8), got[name].view(torch.uint8)), name
