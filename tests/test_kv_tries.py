"""The screening harness of ``benchmarks/kv_tries.py``: its fake quantization equals the formats' own bytes, and its
attention reads what the chunked-32 suite reads (own block at float16, block 0 through the int8 copy, the rest
sealed)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvpage.formats import KEY, VALUE, get_format

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_tries.py"
_spec = importlib.util.spec_from_file_location("kv_tries", _PATH)
assert _spec is not None and _spec.loader is not None
kv_tries = importlib.util.module_from_spec(_spec)
sys.modules["kv_tries"] = kv_tries
_spec.loader.exec_module(kv_tries)


@pytest.mark.parametrize("name", ["int4", "int3", "int2", "int3_rotated"])
@pytest.mark.parametrize("kind", [KEY, VALUE])
def test_uniform_table_is_the_format_itself(name: str, kind: str) -> None:
    """The table path with the uniform grid codes as the format's seal/unseal (same candidates, same pick)."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 32, 2, 64, generator=g) * torch.rand(1, 1, 2, 64, generator=g) * 4).half().float()
    real = kv_tries.block_fake_quant(fmt, x, kind)
    table = kv_tries.block_fake_quant(fmt, x, kind, real=False)
    torch.testing.assert_close(table, real, rtol=0, atol=0)
    # the table path proper with the uniform grid: only exact ties (x / step - offset at k + 1/2, which float16
    # rows meet) round down where torch.round rounds to even
    levels = torch.arange(2**fmt.bits, dtype=torch.float32)
    differ = (kv_tries.block_fake_quant(fmt, x, kind, levels) != real).float().mean()
    assert differ < 1e-3


def test_nonuniform_table_changes_the_codes_and_keeps_the_ends() -> None:
    """A bent table decodes differently; a group's min and max stay (nearly) exact under the covering step."""
    fmt = get_format("int3")
    x = torch.randn(1, 32, 1, 64, generator=torch.Generator().manual_seed(2))
    bent = torch.tensor([0.0, 1.5, 2.5, 3.2, 3.8, 4.5, 5.5, 7.0])
    a = kv_tries.block_fake_quant(fmt, x, VALUE, bent)
    b = kv_tries.block_fake_quant(fmt, x, VALUE)
    assert not torch.equal(a, b)
    assert (a - x).abs().max() < (x.amax() - x.amin()) / 7


def test_rope_round_trip() -> None:
    """undo_rope inverts apply_rope (pre-RoPE keys are recovered to float32 rounding)."""
    T, D = 40, 64
    ang = torch.arange(T)[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2) / D))[None, :]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos(), emb.sin()
    sin_signed = torch.cat([-sin[:, : D // 2], sin[:, D // 2:]], -1)
    k = torch.randn(T, 3, D)
    pos = torch.arange(T)
    torch.testing.assert_close(kv_tries.undo_rope(kv_tries.apply_rope(k, pos, cos, sin_signed), pos, cos, sin_signed),
                               k, rtol=0, atol=1e-5)


def test_fp_start_block() -> None:
    """Own block always full precision; int2's window block too, except block 0 where the int8 copy exists."""
    assert kv_tries.fp_start_block(0, 1, True) == 0
    assert kv_tries.fp_start_block(1, 1, True) == 1      # block 0: the int8 copy, not the window
    assert kv_tries.fp_start_block(1, 1, False) == 0     # no copy: block 0 is the window
    assert kv_tries.fp_start_block(5, 1, True) == 4
    assert kv_tries.fp_start_block(5, 0, True) == 5


@pytest.mark.parametrize(("name", "residual", "window_bits"), [("int4", None, 16), ("int3_rotated", None, 16),
                                                                ("int2", None, 16), ("int2_rotated", 0, 16),
                                                                ("int2_rotated", None, 8), ("int2", 64, 8),
                                                                ("int2", None, None)])
def test_layer_attention_reads_what_the_suite_reads(name: str, residual: int | None, window_bits: int | None) -> None:
    """Query by query, the harness equals attention over [block 0 sealed, its first rows from the int8 copy,
    sealed blocks, window at float16
    (``window_bits`` 8: as int8 rows), own block at float16 up to the query], built here from the formats' own calls
    (``residual``: the window in tokens, ``None`` the format's default; ``int2`` with 0 has no window;
    ``window_bits`` ``None``: the format's own, int8 rows for ``int2``)."""
    fmt = get_format(name)
    T, H, Hkv, D = 70, 2, 1, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, Hkv, Hkv))
    plan = kv_tries.LayerPlan(fmt=name, residual_tokens=residual, window_bits=window_bits)
    out = kv_tries.sealed_layer_attention(q, k, v, torch.arange(T), plan, None, (None, None))
    rot = fmt.rotation(D, torch.float32, "cpu") is not None
    tb = fmt.to_stored_basis if rot else (lambda x: x)
    qs, k16, v16 = tb(q), tb(k).half().float(), tb(v).half().float()
    window = (fmt.default_residual_tokens if residual is None else residual) // 32
    for i in (5, 40, 69):
        b = i // 32
        ks, vs = [], []
        for j in range(b + 1):
            rows = slice(32 * j, min(32 * (j + 1), i + 1))
            blk = lambda x, kind: fmt.unseal_rotated(fmt.seal_rotated(x[rows][None], kind), kind,  # noqa: E731
                                                     torch.float32, D)[0]
            if j == b or (b - window <= j and j > 0 and (window_bits or fmt.window_copy_bits(32)) == 16):
                ks.append(k16[rows]), vs.append(v16[rows])
            elif b - window <= j and j > 0:  # a window block as int8 rows
                ks.append(kv_tries.sink_fake_quant(k16[rows], KEY))
                vs.append(kv_tries.sink_fake_quant(v16[rows], VALUE))
            elif j == 0:  # the first block sealed, its first rows from the int8 copy (the format's copied_rows)
                n = fmt.copied_rows(32)
                ks.append(torch.cat([kv_tries.sink_fake_quant(k16[:n], KEY), blk(k16, KEY)[n:]]))
                vs.append(torch.cat([kv_tries.sink_fake_quant(v16[:n], VALUE), blk(v16, VALUE)[n:]]))
            else:
                ks.append(blk(k16, KEY)), vs.append(blk(v16, VALUE))
        kk, vv = torch.cat(ks), torch.cat(vs)
        o = F.scaled_dot_product_attention(qs[i:i + 1].transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                           vv.transpose(0, 1)[None], enable_gqa=True)[0].transpose(0, 1)[0]
        torch.testing.assert_close(out[i], tb(o[None])[0] if rot else o, rtol=1e-4, atol=1e-5)


def test_int2_budget_mix_bits_are_the_layers_mean() -> None:
    """A per-layer mix costs the mean of its layers' bits: dropping int2's 32-token window saves exactly its 0.258
    bits at 1,024 tokens (an int8 copy: 8 bits and a float16 scale per 64 values, over 32 of 1,024 tokens; 0.5 as
    16-bit rows), and the int2-budget mix (10 layers int3, 10 int2 without the window, 10 int2) is the mean of
    those three, counted here by hand from the formats' own bits."""
    with_window, without = kv_tries.layer_bits("int2"), kv_tries.layer_bits("int2", residual_tokens=0)
    assert with_window - without == pytest.approx((8 + 16 / 64) * 32 / 1024)
    assert kv_tries.layer_bits("int2", window_bits=16) - without == pytest.approx(16 * 32 / 1024)
    three = kv_tries.layer_bits("int3")
    assert three == pytest.approx(get_format("int3").effective_bits_per_value(
        num_tokens=1024, block_size=32, kv_heads=3, head_dim=64))
    order = list(range(30))
    mix = [kv_tries.LayerPlan(fmt="int3") if i in order[:10] else
           kv_tries.LayerPlan(fmt="int2", residual_tokens=0) if i in order[-10:] else
           kv_tries.LayerPlan(fmt="int2") for i in range(30)]
    assert kv_tries.Variant("mix", mix).bits() == pytest.approx((three + without + with_window) / 3)


def test_fit_levels_ends_fixed_and_sorted() -> None:
    """Lloyd's tables keep 0 and qmax, ascend, and crowd where the samples are (a bell in the middle)."""
    u = (torch.randn(200_000, generator=torch.Generator().manual_seed(4)) * 1.2 + 3.5).clamp(0, 7)
    lev = kv_tries.fit_levels(u, 3)
    assert lev[0] == 0 and lev[-1] == 7 and bool((lev[1:] > lev[:-1]).all())
    assert lev[4] - lev[3] < 1.0  # denser than the uniform grid around the bell's centre


def test_mix_plans_the_ends_of_the_order() -> None:
    """``mix`` gives the first ``top`` layers of the order the top plan, the last ``bottom`` the bottom plan, the rest
    the base format; with no ends every layer is the base."""
    a, b = kv_tries.LayerPlan(fmt="int4"), kv_tries.LayerPlan(fmt="int2", residual_tokens=0)
    plans = kv_tries.mix("int3", [2, 0, 4, 1, 3], top=(1, a), bottom=(2, b))
    assert plans == [kv_tries.LayerPlan(fmt="int3"), b, a, b, kv_tries.LayerPlan(fmt="int3")]
    assert [p.fmt for p in kv_tries.mix("int3", [1, 0])] == ["int3", "int3"]


def test_token_wise_formats_read_every_token_as_stored() -> None:
    """A token-wise format (``bfloat16`` here, the rounding floor of ``positions``) goes through the token-wise
    attention: causal SDPA over the K/V as that format stores them; quantize-on-seal formats do not."""
    assert not kv_tries.is_sealed("auto") and not kv_tries.is_sealed("bfloat16") and not kv_tries.is_sealed("int8")
    assert kv_tries.is_sealed("int4") and kv_tries.is_sealed("int2_rotated")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(40, h, 64, generator=g) for h in (6, 2, 2))
    out = kv_tries.token_layer_attention(q, k, v, "bfloat16", 0.125)
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None],
                                         is_causal=True, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert not torch.equal(out, kv_tries.token_layer_attention(q, k, v, "auto", 0.125))


def test_first_block_copy_bits_are_counted_and_read() -> None:
    """The first-block copy try (``int4``: a copy of the whole block): at 8 bits the engine's copy and bits; none removes exactly the copy's bytes
    (``effective_bits_per_value`` without it); at 6 bits the codes take 6 bits and the step/zero 32 bits per row,
    and the rows read back within half a step of each row's range."""
    eight = kv_tries.layer_bits("int4")
    assert eight == pytest.approx(get_format("int4").effective_bits_per_value(
        num_tokens=1024, block_size=32, kv_heads=3, head_dim=64))
    per_byte = 32 * 8 / (2 * 1024 * 64)        # bits per value of one byte per (token, head) over block 0
    assert eight - kv_tries.layer_bits("int4", sink_copy_bits=0) == pytest.approx(2 * 66 * per_byte)
    assert eight - kv_tries.layer_bits("int4", sink_copy_bits=6) == pytest.approx(2 * (66 - 52) * per_byte)
    x = torch.randn(32, 3, 64, generator=torch.Generator().manual_seed(5)) * 3
    assert torch.equal(kv_tries.sink_fake_quant(x, KEY), kv_tries.sink_fake_quant(x, KEY, 8))
    y = kv_tries.sink_fake_quant(x, VALUE, 6)
    span = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 63
    assert bool(((y - x).abs() <= 0.51 * span + 1e-3).all()) and not torch.equal(y, x)
    assert len(torch.unique(y[0, 0])) <= 64


@pytest.mark.parametrize(("values", "rows"), [(False, 32), (True, 1), (True, 4)])
def test_part_of_the_first_block_copy_is_counted_and_read(values: bool, rows: int) -> None:
    """The partial first-block copies: the keys only (half the copy's bytes; block 0's values read sealed) or the
    first ``rows`` rows (``rows / 32`` of its bytes; block 0 sealed with those rows replaced by the next one, the
    covered rows read from the copy), checked for a query in block 1 against attention built here."""
    per_byte = 32 * 8 / (2 * 1024 * 64)
    full = kv_tries.layer_bits("int4")
    part = kv_tries.layer_bits("int4", sink_copy_values=values, sink_copy_tokens=rows)
    assert full - part == pytest.approx(2 * 66 * per_byte * (1 - (1.0 if values else 0.5) * rows / 32))
    fmt = get_format("int4")
    T, H, Hkv, D = 40, 2, 1, 64
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, Hkv, Hkv))
    k[0] *= 20                                                       # a sink-like outlier row
    plan = kv_tries.LayerPlan(fmt="int4", sink_copy_values=values, sink_copy_tokens=rows)
    out = kv_tries.sealed_layer_attention(q, k, v, torch.arange(T), plan, None, (None, None))
    k16, v16 = k.half().float(), v.half().float()
    ks16, vs16 = k16[:32].clone(), v16[:32].clone()
    if rows < 32:
        ks16[:rows], vs16[:rows] = k16[rows], v16[rows]              # sealed without the covered rows
    seal = lambda x, kind: fmt.unseal_rotated(fmt.seal_rotated(x[None], kind), kind, torch.float32, D)[0]  # noqa: E731
    k0, v0 = seal(ks16, KEY), seal(vs16, VALUE)
    k0[:rows] = kv_tries.sink_fake_quant(k16[:rows], KEY)
    if values:
        v0[:rows] = kv_tries.sink_fake_quant(v16[:rows], VALUE)
    i = 37
    kk, vv = torch.cat([k0, k16[32:i + 1]]), torch.cat([v0, v16[32:i + 1]])
    o = F.scaled_dot_product_attention(q[i:i + 1].transpose(0, 1)[None], kk.transpose(0, 1)[None],
                                       vv.transpose(0, 1)[None], enable_gqa=True)[0].transpose(0, 1)[0]
    torch.testing.assert_close(out[i], o, rtol=1e-4, atol=1e-5)
    whole = kv_tries.sealed_layer_attention(q, k, v, torch.arange(T), kv_tries.LayerPlan(fmt="int4"), None,
                                            (None, None))
    assert not torch.allclose(out[i], whole[i], rtol=0, atol=1e-6)


def test_one_angle_per_block_is_pre_rope_with_positions_taken_within_the_block() -> None:
    """``block_rope`` takes off (and puts back) each key's offset in its block: for block 0, whose positions are
    their offsets, exactly ``pre_rope``; for later blocks not (their keys keep the block's first angle)."""
    T, H, Hkv, D = 96, 2, 1, 64
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, Hkv, Hkv))
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin_signed = torch.cat([-ang.sin(), ang.sin()], -1)
    run = {name: kv_tries.sealed_layer_attention(q, k, v, torch.arange(T), kv_tries.LayerPlan(
        fmt="int4", sink_copy_bits=0, **{name: True}), None, (cos, sin_signed)) for name in ("pre_rope", "block_rope")}
    plain = kv_tries.sealed_layer_attention(q, k, v, torch.arange(T), kv_tries.LayerPlan(fmt="int4", sink_copy_bits=0),
                                            None, (cos, sin_signed))
    torch.testing.assert_close(run["block_rope"][:64], run["pre_rope"][:64], rtol=0, atol=0)  # read block 0 at most
    assert not torch.allclose(run["block_rope"][64:], run["pre_rope"][64:], atol=1e-4)      # read block 1 too
    assert not torch.allclose(run["pre_rope"][32:], plain[32:], atol=1e-4)                   # the seal saw other keys


@pytest.mark.parametrize("name", ["int8", "int8_rotated"])
@pytest.mark.parametrize("qmax, group", [(127, 0), (127, 32), (32767, 0)])
def test_coded_queries_are_integer_multiples_of_their_step_in_the_stored_basis(name: str, qmax: int,
                                                                               group: int) -> None:
    """``qcoding``'s queries: in the format's stored basis every run of ``group`` channels (a head for 0) is an
    integer multiple of its step (largest magnitude / ``qmax``), its largest element kept, each within half a step."""
    fmt = get_format(name)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 3, 64, generator=g) * torch.rand(1, 3, 64, generator=g) * 6
    coded = kv_tries.code_queries(q, qmax, group, name)
    rot = fmt.rotation(64, torch.float32, "cpu")
    assert (rot is not None) == name.endswith("_rotated")
    basis = (lambda x: x @ rot) if rot is not None else (lambda x: x)
    n = group or 64
    x, y = basis(q).reshape(5, 3, 64 // n, n), basis(coded).reshape(5, 3, 64 // n, n)
    step = x.abs().amax(-1, keepdim=True).double() / qmax
    k = y.double() / step
    torch.testing.assert_close(k, k.round(), rtol=0, atol=1e-3 + qmax * 2e-6)  # float32 rows: ~1e-6 relative
    assert k.abs().round().amax() == qmax
    assert ((y - x).abs().double() <= step / 2 + 2e-6 * x.abs().amax().item()).all()
    assert not torch.equal(coded, q)
