"""The ``cpu`` attention backend against the ``reference`` one and against float64 attention (case C27).

Every format is run through both backends on identical inputs, each over its own copy
of the cache, for batches that mix context lengths 1, block_size - 1, block_size,
block_size + 1 and longer ones, decode rows with prefix-cached contexts, short query runs
(chunked prefill, speculative verification) and long ones (which the cpu backend sends to
SDPA), GQA ratios 1 to 8 and head_dim 64 to 128. Block tables come from a
shuffled pool and caches are NaN-filled, so a read of an unwritten slot shows up.

What must hold:

* the cache bytes each backend writes are identical (the fused write quantizes as the
  Python formats do, bit for bit);
* the outputs agree within 1e-5 relative to the output's scale: both read the same stored
  values and differ only in summation order and the kernel's polynomial exp (int8 keys: the
  kernel codes q as int16 for its integer dot products, so the reference is given q coded the
  same way for the rows the kernel serves, :func:`int16_coded_q`);
* each backend's output is within the format's bound of float64 attention over the
  unquantized K/V (the bounds of ``tests/test_attention.py`` and ``tests/test_kivi.py``).
"""
from __future__ import annotations

import math
import os
import random
import warnings

import pytest
import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.tail import TailTable
from kvpage.cache.tail.pool import TailPool
from kvpage.formats import get_format
from kvpage.formats.rotation import hadamard_transform
from kvpage.ops.attention import AttentionMetadata
from kvpage.ops.backends import BACKEND_NAMES, CpuBackend, ReferenceBackend, select_backend
from kvpage.ops.backends import cpu as cpu_module
from kvpage.ops.cpu import build as cpu_build
from kvpage.ops.layer_attention import PLAIN, LayerAttention
from kvpage.spec import CacheSpec, TailLayout
from _attention_oracle import float64_attention, static_scales

TOKEN_FORMATS = ["float32", "bfloat16", "float16", "int8", "fp8", "int8_rotated", "fp8_per_token_head",
                 "int8_static", "fp8_static"]
SEALED_FORMATS = ["int4", "int3", "int2", "int4_rotated", "int3_rotated", "int2_rotated"]
# Output error against float64 attention over the unquantized K/V (unit-normal q/k/v), per format.
LOOSE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3, "int8": 0.06, "fp8": 0.25, "int8_rotated": 0.06,
         "fp8_per_token_head": 0.25, "int8_static": 0.08, "fp8_static": 0.3, "int4": 0.35, "int3": 0.7, "int2": 1.2,
         "int4_rotated": 0.35, "int3_rotated": 0.7, "int2_rotated": 1.2}

# The kernels must build wherever `make test` runs (a fresh machine has the compiler and ninja); only an
# explicit KVPAGE_CPU_KERNELS=0 skips the tests that need them.
pytestmark = pytest.mark.skipif(os.environ.get("KVPAGE_CPU_KERNELS") == "0", reason="KVPAGE_CPU_KERNELS=0")


def test_the_kernels_build_here() -> None:
    assert cpu_module.cpu_backend() is not None, "kvpage's CPU kernels did not build (see the RuntimeWarning)"


#: Formats whose keys the kernel reads as int8 codes with per-row scales: q . k as integer dot products.
INT8_KEYED = ("int8", "int8_rotated")


def int16_coded_q(q: torch.Tensor, fmt: str, head_dim: int) -> torch.Tensor:
    """``q`` [T, H, D] as the kernel sees it for ``fmt``'s int8 keys: each (token, head) row of q (rotated
    first for a rotated format) coded to int16 with the scale ``max|q| / 32767``, rounded to nearest, then
    rotated back, in float32 (the kernel attends in float32; :meth:`Pair.step` casts the reference's output to the
    model dtype); any other format's q, or a head_dim the kernel reads otherwise, unchanged.

    Regression: this was rounded back to a 16-bit model's dtype, so for a rotated format the reference's q was
    one bfloat16 step (2^-9 relative) off the kernel's in every rotated channel, and the comparison failed by up to
    ~1e-2 of the output's scale (``int8_rotated``, bfloat16, head_dim 128) with both backends right."""
    if fmt not in INT8_KEYED or not cpu_module.cpu_backend().kernels.int8_keys_as_codes(head_dim):
        return q
    rot = get_format(fmt).rotation(head_dim, torch.float32, q.device)
    x = q.float() if rot is None else q.float() @ rot
    mx = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(32767.0) / mx, torch.zeros_like(mx))
    coded = torch.round((x * inv).clamp(-32767, 32767)) * (mx / 32767.0)
    return coded if rot is None else coded @ rot.T


class Pair:
    """The same layer, cache and tail state twice: once for the reference backend, once for the cpu one."""

    def __init__(self, fmt: str, *, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 window_blocks: int = 1, integer_dots: bool = False) -> None:
        scales = static_scales(fmt, kv_heads, head_dim)
        self.spec = CacheSpec.build(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                                    kv_cache_dtype=fmt, static_scales=scales)
        self.layer = self.spec.layer(0)
        self.sealed = fmt in SEALED_FORMATS
        self.caches = [CacheController(self.spec, fill_value=float("nan")).initialize_kv_cache(num_blocks)[0]
                       for _ in range(2)]
        self.backends = [ReferenceBackend(), select_backend("cpu", self.layer, "cpu")]
        self.backends[1].integer_dots = integer_dots  # False: the float path, which agrees to 1e-5
        if self.sealed:
            # the format's window copies: int2's are int8 copies in 8-bit slots (read by the kernel as source kind 3)
            bits = self.layer.format.window_copy_bits(block_size) if window_blocks else 16
            layout = TailLayout(num_slots=24, num_sink_slots=8 if bits == 16 else 32, window_blocks=window_blocks,
                                window_bits=bits)
            self.tables = [TailTable(block_size, num_slots=layout.num_slots, num_sink_slots=layout.num_sink_slots,
                                     window_blocks=layout.window_blocks, window_bits=bits) for _ in range(2)]
            self.pools = [TailPool(self.spec, layout, torch.float32) for _ in self.tables]

    def step(self, tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
             q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: LayerAttention = PLAIN,
             q_ref: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One step through both backends (``q_ref``, when given, is the reference backend's q, whose output is cast
        to ``q``'s dtype: a float32 ``q_ref`` serves a 16-bit model)."""
        bs = self.spec.block_size
        slots = [tables[i][p // bs] * bs + p % bs for i in range(len(tables))
                 for p in range(seq_lens[i] - query_lens[i], seq_lens[i])]
        meta = AttentionMetadata.build(block_tables=tables, seq_lens=seq_lens, query_lens=query_lens,
                                       slot_mapping=slots, block_size=bs)
        outs = []
        for i, backend in enumerate(self.backends):
            q_in = q_ref if i == 0 and q_ref is not None else q
            if self.sealed:
                ctx = self.pools[i].context(self.tables[i].plan(tables, seq_lens, query_lens))
                outs.append(backend.forward_sealed(q_in, k, v, self.caches[i], self.layer, meta, ctx, layer_index=0,
                                                   params=params))
                self.tables[i].finish()
            else:
                outs.append(backend.forward(q_in, k, v, self.caches[i], self.layer, meta, layer_index=0,
                                            params=params))
            if i == 0 and q_ref is not None:  # the reference's output in the model dtype; the kernel's dtype stays checked
                outs[-1] = outs[-1].to(q.dtype)
        return outs

    def assert_same_bytes(self) -> None:
        for name, t in self.caches[0].items():
            a, b = t.view(torch.uint8), self.caches[1][name].view(torch.uint8)
            assert torch.equal(a, b), f"cache tensor {name} differs between the backends"
        if self.sealed:
            for layer, tails in self.pools[0].layers.items():
                for name, t in tails.items():
                    assert torch.equal(t.view(torch.uint8), self.pools[1].layers[layer][name].view(torch.uint8)), name


#: Sealed formats' kernel outputs with ``integer_dots`` (q' and the weights coded as int16, CpuBackend's docstring)
#: against the reference's, relative to the output's scale (16-bit models: plus one rounding step of their dtype):
#: measured 2e-5 to 8e-5 over this file's cases, up to 3.3e-4 for the rotated formats, where the float path stays
#: under 1e-5; a code, step or offset read from the wrong lane or block moves outputs by 1e-1 and more.
INTEGER_DOTS_TOL = 1e-3


def run_batch(fmt: str, *, lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int,
              block_size: int, seed: int = 0, dtype: torch.dtype = torch.float32,
              params: LayerAttention = PLAIN, window_blocks: int = 1, integer_dots: bool = False) -> float:
    """Prefill each request's cached part, then one step of ``query_lens`` new tokens; check both backends
    (sealed formats: with ``window_blocks`` window copies; with ``integer_dots`` the kernel's integer path, compared
    within INTEGER_DOTS_TOL). Returns the largest kernel-vs-reference difference relative to the output's scale."""
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    nb = sum(math.ceil(s / bs) for s in lens) + 3
    pair = Pair(fmt, kv_heads=kv_heads, head_dim=head_dim, block_size=bs, num_blocks=nb, window_blocks=window_blocks,
                integer_dots=integer_dots)
    ids = list(range(nb))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for s in lens:
        tables.append(ids[at:at + math.ceil(s / bs)])
        at += math.ceil(s / bs)
    full = [tuple(torch.randn(s, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
            for s in lens]
    cached = [s - n for s, n in zip(lens, query_lens)]
    pre = [i for i, c in enumerate(cached) if c > 0]
    if pre:  # the prefix-cached part, written by each backend's own path
        cat = lambda j: torch.cat([full[i][j][: cached[i]] for i in pre])  # noqa: E731
        pair.step([tables[i] for i in pre], [cached[i] for i in pre], [cached[i] for i in pre], cat(0), cat(1), cat(2),
                  params)
    cat = lambda j: torch.cat([full[i][j][cached[i]:] for i in range(len(lens))])  # noqa: E731
    q = cat(0)
    in_kernel = torch.cat([torch.full((n,), n <= cpu_module.KERNEL_MAX_QUERY and params.is_plain) for n in query_lens])
    q_ref = torch.where(in_kernel[:, None, None], int16_coded_q(q, fmt, head_dim), q)
    ref, got = pair.step(tables, lens, query_lens, q, cat(1), cat(2), params, q_ref=q_ref)
    pair.assert_same_bytes()
    scale = ref.abs().max().item()
    assert torch.isfinite(got).all() and got.dtype == ref.dtype == dtype
    diff = (got.float() - ref.float()).abs().max().item() / scale
    if integer_dots:
        step = INTEGER_DOTS_TOL * scale + (0 if dtype == torch.float32 else torch.finfo(dtype).eps * ref.float().abs())
        assert ((got.float() - ref.float()).abs() <= step).all(), (fmt, diff)
    elif dtype == torch.float32:
        assert (got - ref).abs().max().item() <= 1e-5 * scale, fmt
    else:  # both round the same float32 result to the model dtype: at most one rounding step apart
        step = torch.finfo(dtype).eps * ref.float().abs() + 1e-5 * scale
        rows = torch.cat([torch.full((n,), n > cpu_module.KERNEL_MAX_QUERY) for n in query_lens])
        if dtype == torch.bfloat16:  # long query runs attend in bfloat16 (probabilities rounded to it)
            step = torch.where(rows[:, None, None], 2 * torch.finfo(dtype).eps * scale, step)
        assert ((got.float() - ref.float()).abs() <= step).all(), fmt
    # both within the format's bound of float64 attention over the unquantized K/V
    a = 0
    for i, s in enumerate(lens):
        n = query_lens[i]
        want = float64_attention(full[i][0][s - n:], full[i][1], full[i][2], s - n, params)
        for out in (ref, got):
            assert (out[a:a + n].double() - want).abs().max().item() < LOOSE[fmt], (fmt, s, n)
        a += n
    return diff


@pytest.mark.parametrize("fmt", TOKEN_FORMATS + SEALED_FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 96), (8, 2, 128), (6, 2, 80), (6, 3, 72),
                                                    (14, 2, 64), (8, 1, 128)])
def test_c27_decode_batch_matches_reference_and_float64(fmt: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """Case C27: decode rows of contexts 1, bs-1, bs, bs+1 and longer, in one batch.

    Head sizes 64/80/96/128 take the kernels' fixed-width (SIMD) paths, 72 the portable loops. GQA ratios 1 to 8
    cover every split of a kv head's query heads into the kernels' groups (AVX-512: up to 3 per pass; 4 -> 2 + 2,
    7 -> 3 + 2 + 2, 8 -> 3 + 3 + 2).
    """
    bs = 8 if fmt in SEALED_FORMATS else 16
    lens = [1, bs - 1, bs, bs + 1, 5 * bs + 3, 70]
    run_batch(fmt, lens=lens, query_lens=[1] * len(lens), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              block_size=bs)


@pytest.mark.parametrize("fmt", SEALED_FORMATS)
@pytest.mark.parametrize("head_dim", [44, 21, 8])
def test_c27_sealed_head_dims_off_the_simd_width(fmt: str, head_dim: int) -> None:
    """Head sizes that are no multiple of 8 codes: the portable unpacking's last codes (int3: 44 and 21 channels end
    in codes straddling two bytes of a row that ends mid-byte; nothing past the row may be read) and 8 channels
    (one 3-byte word per int3 row)."""
    bs = 8
    lens = [1, bs - 1, bs + 1, 5 * bs + 3, 40]
    run_batch(fmt, lens=lens, query_lens=[1, 1, 1, 1, 8], heads=4, kv_heads=2, head_dim=head_dim, block_size=bs,
              seed=head_dim)


@pytest.mark.parametrize("fmt", SEALED_FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 32), (8, 2, 128, 16), (4, 4, 96, 8),
                                                               (6, 2, 80, 16), (7, 1, 64, 8), (4, 2, 128, 32)])
def test_sealed_pool_blocks_read_as_packed_codes(fmt: str, heads: int, kv_heads: int, head_dim: int,
                                                  block_size: int) -> None:
    """Contexts long enough that most of the kernel's chunks hold sealed pool blocks only, which it scores and
    accumulates from their packed codes (q times the block's key steps; weights times the tokens' value steps; the
    offsets' terms added once), next to chunks holding the int8 sink copy or 16-bit window and open rows, which it
    decodes. Decode rows and short runs over odd lengths; GQA groups of 1 to 7 (AVX-512 passes of 1 to 3 query
    heads); head_dim 64 and 128 (one and two value groups), 96 (groups of 48: a pair of 16-lane vectors spans two)
    and 80 (groups of 40: AVX-512 decodes these, AVX2 reads them as codes); blocks of 8, 16 and 32 tokens (four,
    two or one of them per chunk)."""
    bs = block_size
    lens = [5 * 32 + 1, 4 * bs + 3, 300, 97, 64 + 7]
    run_batch(fmt, lens=lens, query_lens=[1, 1, 1, 3, 2], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              block_size=bs, seed=head_dim + bs, window_blocks=2 if fmt.startswith("int2") else 1)


@pytest.mark.parametrize("fmt", SEALED_FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 32), (8, 2, 128, 16), (7, 1, 64, 8),
                                                               (4, 2, 128, 32), (14, 2, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sealed_integer_dots_match_the_reference(fmt: str, heads: int, kv_heads: int, head_dim: int,
                                                 block_size: int, dtype: torch.dtype) -> None:
    """The engine's default path over sealed pool blocks (CpuBackend's integer_dots): the same cases as the packed
    codes' test above, float32 and bfloat16 models, within INTEGER_DOTS_TOL of the reference and within the
    format's bound of float64 attention; where the build takes integer dot products (AVX-512 at head_dim 64 and
    128) the outputs differ from the float path's (the coding acts), elsewhere they are the float path's."""
    bs = block_size
    lens = [5 * 32 + 1, 4 * bs + 3, 300, 97, 64 + 7]
    # (bfloat16: no run of 3, which the sealed path attends in bfloat16 outside the kernel, further from the float32
    # reference than run_batch's one-rounding-step check allows, on the float path as well)
    query_lens = [1, 1, 1, 3, 2] if dtype == torch.float32 else [1, 1, 1, 1, 2]
    kw = dict(lens=lens, query_lens=query_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              block_size=bs, seed=head_dim + bs, dtype=dtype, window_blocks=2 if fmt.startswith("int2") else 1)
    coded = run_batch(fmt, integer_dots=True, **kw)
    plain = run_batch(fmt, **kw)
    if dtype == torch.float32:
        acts = cpu_module.cpu_backend().kernels.sealed_int_dots(head_dim)
        assert (coded > plain) == acts, (coded, plain)


@pytest.mark.parametrize("fmt", INT8_KEYED)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (7, 1, 64, 8)])
def test_int8_keys_as_codes_with_a_bfloat16_model(fmt: str, heads: int, kv_heads: int, head_dim: int,
                                                  block_size: int) -> None:
    """A bfloat16 model over int8 keys read as codes (q coded as int16 in float32, rotated first for
    ``int8_rotated``): both backends round the same float32 result to bfloat16, at most one rounding step apart,
    and both within the int8 bound of float64 attention. Regression for :func:`int16_coded_q`, which handed the
    reference a q rounded back to bfloat16 (fails on ``int8_rotated`` at head_dim 128 without its fix)."""
    bs = block_size
    run_batch(fmt, lens=[5 * 32 + 1, 4 * bs + 3, 300, 97, 64 + 7], query_lens=[1, 1, 1, 1, 2], heads=heads,
              kv_heads=kv_heads, head_dim=head_dim, block_size=bs, seed=head_dim + bs, dtype=torch.bfloat16)


@pytest.mark.parametrize("fmt", TOKEN_FORMATS + SEALED_FORMATS)
def test_c27_mixed_batch_of_decode_chunks_and_prefill(fmt: str) -> None:
    """Decode rows, short query runs over cached prefixes (kernel), a long chunk and a whole prefill (SDPA)."""
    bs = 8 if fmt in SEALED_FORMATS else 16
    lens = [40, 23, 90, 45, 17]
    query_lens = [1, 3, 40, 45, 8]
    run_batch(fmt, lens=lens, query_lens=query_lens, heads=9, kv_heads=3, head_dim=64, block_size=bs, seed=3)


@pytest.mark.parametrize("fmt", ["float32", "int8", "fp8", "int8_rotated", "int4", "int3", "int2", "int4_rotated"])
@pytest.mark.parametrize("params", [LayerAttention(scale=0.06), LayerAttention(sliding_window=11),
                                    LayerAttention(scale=0.25, sliding_window=16, logit_softcap=2.0),
                                    LayerAttention(logit_softcap=1.5)], ids=["scale", "window", "all", "softcap"])
def test_layer_attention_scale_window_and_softcap(fmt: str, params: LayerAttention) -> None:
    """Per-layer knobs of the model families (Gemma's scale and soft-cap, sliding windows): both backends equal
    float64 attention with the same knobs over decode rows, short runs and a long chunk; the window is shorter and
    longer than a block and cuts through sealed blocks."""
    bs = 8 if fmt in SEALED_FORMATS else 16
    run_batch(fmt, lens=[1, 12, 40, 23, 90], query_lens=[1, 1, 1, 3, 40], heads=6, kv_heads=2, head_dim=64,
              block_size=bs, seed=11, params=params)


def test_window_and_softcap_change_the_output() -> None:
    """The knobs reach the ops: each one moves the result (a test whose knobs were dropped would pass above only
    if float64 attention also ignored them; this pins that they act)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 32, generator=gen), torch.randn(30, 2, 32, generator=gen), torch.randn(30, 2, 32, generator=gen)
    base = float64_attention(q, k, v, 29)
    for p in (LayerAttention(scale=0.05), LayerAttention(sliding_window=4), LayerAttention(logit_softcap=0.5)):
        assert (float64_attention(q, k, v, 29, p) - base).abs().max() > 1e-3, p


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "fp8_static", "int4", "int2_rotated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models_read_q_and_write_the_output_in_their_dtype(fmt: str, dtype: torch.dtype) -> None:
    """A bfloat16/float16 model hands q/k/v in its dtype; the kernel converts them itself."""
    bs = 8 if fmt in SEALED_FORMATS else 16
    run_batch(fmt, lens=[1, 17, 40, 33], query_lens=[1, 1, 3, 33], heads=9, kv_heads=3, head_dim=64, block_size=bs,
              seed=7, dtype=dtype)


@pytest.mark.parametrize("fmt", ["float32", "int8", "fp8", "int4"])
def test_long_contexts_split_over_the_context_match(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With more threads than work items the kernel splits long contexts and merges the parts."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bs = 8 if fmt == "int4" else 16
        run_batch(fmt, lens=[1500], query_lens=[1], heads=4, kv_heads=1, head_dim=64, block_size=bs, seed=5)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int8_rotated", "fp8_per_token_head"])
def test_fused_write_is_byte_identical_to_the_format_quantize(fmt: str) -> None:
    """Extremes included: zeros (the scale floor), +-inf (saturation), huge and tiny magnitudes."""
    f = get_format(fmt)
    x = torch.randn(40, 3, 64)
    x[0] = 0
    x[1, 0, 5], x[2, 1, 7] = math.inf, -math.inf
    x[3] *= 1e6
    x[4] *= 1e-6
    x[5, 2] = 65504.0 * 500
    spec = CacheSpec.build(num_layers=1, num_kv_heads=3, head_dim=64, block_size=8, kv_cache_dtype=fmt)
    cache = CacheController(spec).initialize_kv_cache(6)[0]
    slots = torch.randperm(48)[:40]
    select_backend("cpu", spec.layer(0), "cpu")._write(cache, spec.layer(0), f, x, x.clone(), slots)
    want = f.quantize(x, kind="key")
    assert torch.equal(cache["key"].view(-1, 3, 64)[slots], want.codes)
    assert torch.equal(cache["key_scale"].view(-1, 3)[slots].view(torch.int16), want.scale.view(torch.int16))


@pytest.mark.parametrize("head_dim", [64, 96, 80, 128, 7, 1, 512, 1027])
def test_hadamard_rows_kernel_is_the_formats_butterflies_bit_for_bit(head_dim: int) -> None:
    """The rotated sealed formats' k/v rotation in the kernel (``hadamard_rows``) is ``hadamard_transform``'s
    float32 result exactly, one row or a batch alike (stored codes must not depend on the batch), extremes too."""
    kernels = cpu_module.cpu_backend().kernels
    x = torch.randn(37, 3, head_dim) * torch.logspace(-6, 6, 37)[:, None, None]
    x[0] = 0
    x[1, 0, 0] = math.inf
    before = x.clone()
    want = hadamard_transform(x)
    torch.testing.assert_close(kernels.hadamard_rows(x), want, rtol=0, atol=0, equal_nan=True)
    for i in (2, 20, 36):
        assert torch.equal(kernels.hadamard_rows(x[i:i + 1].contiguous()).view(torch.int32),
                           want[i:i + 1].view(torch.int32))
    torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)  # not modified


def test_selection_auto_cpu_and_reference() -> None:
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="int8")
    assert BACKEND_NAMES == ("auto", "reference", "cpu", "triton")
    assert isinstance(select_backend("auto", spec.layer(0), "cpu"), CpuBackend)
    assert isinstance(select_backend("reference", spec.layer(0), "cpu"), ReferenceBackend)
    assert isinstance(select_backend("auto", spec.layer(0), "cuda"), ReferenceBackend)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("flash", spec.layer(0), "cpu")


def test_c27_a_backend_that_cannot_serve_refuses_at_start_naming_format_and_device() -> None:
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"'cpu' cannot serve kv_cache_dtype 'fp8' on cuda"):
        select_backend("cpu", spec.layer(0), "cuda")


def test_a_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.cpp_extension as ext

    def broken(**_: object) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setattr(ext, "load", broken)
    with pytest.warns(RuntimeWarning, match="could not be built.*no compiler here.*reference"):
        assert cpu_build.load_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_build.load_kernels() is None  # remembered: no second warning, no second build
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="int8")
    assert isinstance(select_backend("auto", spec.layer(0), "cpu"), ReferenceBackend)
    with pytest.raises(ValueError, match="could not be built"):
        select_backend("cpu", spec.layer(0), "cpu")


def test_kernels_turned_off_name_the_variable_not_a_failed_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVPAGE_CPU_KERNELS=0 kvpage generate --attention-backend cpu`` said the kernels "could not be built on this
    machine (see the warning above)": there was no warning, the user had turned them off. The refusal names the
    variable, and ``auto`` falls back without a word."""
    monkeypatch.setattr(cpu_build, "_state", {})
    monkeypatch.setenv("KVPAGE_CPU_KERNELS", "0")
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(select_backend("auto", spec.layer(0), "cpu"), ReferenceBackend)
        with pytest.raises(ValueError, match=r"turned off by KVPAGE_CPU_KERNELS=0") as e:
            select_backend("cpu", spec.layer(0), "cpu")
    assert "could not be built" not in str(e.value) and "warning above" not in str(e.value)
    assert cpu_build.kernels_unavailable_reason() == cpu_build.DISABLED_REASON


def test_the_build_cache_is_keyed_by_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    key = cpu_build.build_key()
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "another cpu")
    assert cpu_build.build_key() != key


def test_the_build_cache_is_keyed_by_where_sources_and_torch_live(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path) -> None:
    """torch's build.ninja names the sources and torch's include folders by absolute path: two checkouts (or two
    virtual environments) sharing one folder made ninja rebuild at every alternation, minutes per engine start."""
    key = cpu_build.build_key()
    assert cpu_build.build_key() == key                                  # stable
    monkeypatch.setattr(cpu_build, "_HERE", tmp_path)                     # another checkout, same sources
    other = cpu_build.build_key()
    assert other != key
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv2" / "torch" / "__init__.py"))
    assert cpu_build.build_key() not in (key, other)


def test_a_stale_torch_build_lock_is_cleared_under_the_os_lock(tmp_path) -> None:
    """A build killed half-way leaves torch's ``lock`` file, on which every later build waited forever (seen when
    a benchmark was interrupted mid-compile); under kvpage's OS lock no other process builds, so it goes."""
    import fcntl

    from kvpage.ops.cpu.build import _build_lock

    (tmp_path / "lock").write_text("")
    with _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / ".kvpage-build.lock") as f:   # held: another process could not take it now
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / ".kvpage-build.lock") as f:       # released on exit
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize("fmt", SEALED_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stair_columns", [16384, 100])
def test_prefill_from_a_block_boundary_splits_own_blocks_and_matches(fmt: str, dtype: torch.dtype, stair_columns: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Long passes starting at a block boundary (fresh prefill, a prefix hit, a whole-block chunk) attend as two
    parts merged by log-sum-exp; the result is the reference's (run_batch's bounds), GQA and a partial last
    block included. int2's window copies keep the masked path for passes that read them. The segments' masks
    come from a fresh staircase cache, grown as the passes need it, or (``stair_columns`` 100) built per
    segment past its cap."""
    monkeypatch.setattr(cpu_module, "_stairs", {})
    monkeypatch.setattr(cpu_module, "_STAIR_COLUMNS", stair_columns)
    calls: list[int] = []
    real = cpu_module._block_split_attention

    def counted(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, own_keys: torch.Tensor,
                own_values: torch.Tensor, start: int, block_size: int, scale: float, kernels) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(q, keys, values, own_keys, own_values, start, block_size, scale, kernels)

    monkeypatch.setattr(cpu_module, "_block_split_attention", counted)
    for window in (0, 1):
        calls.clear()
        run_batch(fmt, lens=[300, 97, 64, 118], query_lens=[300, 65, 48, 40], heads=9, kv_heads=3, head_dim=64,
                  block_size=16, dtype=dtype, window_blocks=window)
        # 300: fresh prefill; 65: after a 2-block prefix; 48: a whole-block chunk; 40 starts mid-block
        if window == 0:
            assert {300, 65, 48} <= set(calls) and 40 not in calls, calls


@pytest.mark.parametrize("head_dim", [64, 80, 128, 72])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "float16"])
def test_kernel_decodes_every_code_exactly(fmt: str, head_dim: int) -> None:
    """Every stored element, decoded by the attention kernel, is the format's value times its scale, bit for bit.

    One-token contexts make the attention output the value row itself (softmax weight exactly 1), so each
    output element is one decoded code times the row's float16 scale (none for float16 rows), rounded once to
    float32; the oracle is torch's own int8 / float8_e4m3fn / float16 conversion. All 256 codes of the 8-bit
    formats and all 65,536 float16 bit patterns (infinities, NaNs, subnormals) are read. Head dims 64 and 128
    take the compiled fixed-width kernels, 80 the fixed-width kernel with a tail short of a vector, 72 the
    runtime-width loops.
    """
    backend = cpu_module.cpu_backend()
    assert backend is not None
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=head_dim, block_size=16, kv_cache_dtype=fmt)
    ls = spec.layer(0)
    values = 1 << 16 if fmt == "float16" else 256
    rows = -(-values // head_dim)
    cache = CacheController(spec).initialize_kv_cache(rows)[0]
    codes = torch.arange(rows * head_dim) % values
    scaled = "value_scale" in cache
    scales = torch.empty(rows, dtype=torch.float16).uniform_(0.5, 3.0, generator=torch.Generator().manual_seed(3))
    if fmt == "float16":
        stored = codes.to(torch.int32).to(torch.int16).view(torch.float16).view(rows, head_dim)
        decoded = stored.float()
    else:
        stored = codes.to(torch.uint8).view(rows, head_dim)
        decoded = stored.view(torch.int8).float() if fmt == "int8" else stored.view(torch.float8_e4m3fn).float()
    assert decoded.isnan().any() == (fmt != "int8")  # the NaN codes are read too
    cache["key"].zero_()  # keys decode to 0: every score is 0 and finite
    if scaled:
        cache["key_scale"].fill_(1.0)
    for r in range(rows):  # request r's one token: slot 0 of block r
        cache["value"][r, 0, 0] = stored[r]
        if scaled:
            cache["value_scale"][r, 0, 0] = scales[r]
    q = torch.randn(rows, 1, head_dim)
    out = torch.empty_like(q)
    tables = torch.arange(rows).view(rows, 1)
    backend.kernels.paged_attention(
        out, q, cache["key"], cache["value"], cache.get("key_scale"), cache.get("value_scale"), None, None,
        tables, torch.ones(rows, dtype=torch.long), torch.arange(rows + 1), torch.arange(rows),
        cpu_module.token_encoding(ls.format), head_dim**-0.5)
    expected = decoded * scales.float()[:, None] if scaled else decoded
    torch.testing.assert_close(out[:, 0], expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_int8_keys_as_codes_at_the_extremes(head_dim: int) -> None:
    """The integer q . k path at its extremes: an all-zero q row (scale 0), a q row with one dominant channel
    (the others code to 0 or +-1), keys coded at +-127 in every channel and a q row coded at +-32767 aligned with
    them (the largest int32 sums, head_dim * 32767 * 127): it agrees with the reference given the same int16-coded
    q, and with float64 attention within the int8 bound."""
    if not cpu_module.cpu_backend().kernels.int8_keys_as_codes(head_dim):
        pytest.skip("this build reads int8 keys as floats at this head_dim")
    heads, kv_heads, bs, s = 4, 2, 16, 37
    pair = Pair("int8", kv_heads=kv_heads, head_dim=head_dim, block_size=bs, num_blocks=6)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(s, kv_heads, head_dim, generator=gen)
    k[:8] = torch.where(k[:8] >= 0, 1.0, -1.0)  # every channel at the row's max: codes +-127
    v = torch.randn(s, kv_heads, head_dim, generator=gen)
    q = torch.randn(1, heads, head_dim, generator=gen)
    q[0, 0] = 0.0
    q[0, 1] = 1e-3 * torch.randn(head_dim, generator=gen)
    q[0, 1, 3] = 40.0
    q[0, 2] = 0.5 * k[0, 1]  # q head 2 reads kv head 1: codes +-32767 against +-127 in every channel
    tables = [[4, 0, 2]]
    pair.step(tables, [s - 1], [s - 1], q.expand(s - 1, -1, -1).contiguous(), k[: s - 1], v[: s - 1])
    ref, got = pair.step(tables, [s], [1], q, k[s - 1:], v[s - 1:], q_ref=int16_coded_q(q, "int8", head_dim))
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert (got[0, 0] - v[:, 0].mean(dim=0)).abs().max() < 0.02  # zero q: uniform weights over the values
    assert (got.double() - float64_attention(q, k, v, s - 1)).abs().max().item() < LOOSE["int8"]


def test_sealed_integer_dots_fall_back_past_the_int32_range() -> None:
    """A chunk longer than the integer value sums hold exactly (int4: 4,369 tokens at codes of 15 times weights
    of 32,767; blocks of 8,192 tokens here, read one block per chunk) takes the float weights: equal scores
    (zero keys) give every token the largest weight code, and values alternating 0 and 1 over the channels
    the largest code in half of them, where int32 sums wrap (regression: without the fall-back the outputs were
    off by 0.37)."""
    fmt, bs = "int4", 8192
    if not cpu_module.cpu_backend().kernels.sealed_int_dots(64):
        pytest.skip("this build takes no integer dot products over sealed blocks")
    pair = Pair(fmt, kv_heads=1, head_dim=64, block_size=bs, num_blocks=5, integer_dots=True)
    s = 3 * bs + 1  # block 0: its sink copy; block 1: the pool's codes; block 2: its window copy
    k = torch.zeros(s, 1, 64)
    v = (torch.arange(64) % 2).float().expand(s, 1, 64).contiguous()
    table = [[0, 1, 2, 3]]
    for a in range(0, s - 1, bs):  # the cached part, a block per step
        q = torch.zeros(bs, 1, 64)
        pair.step(table, [a + bs], [bs], q, k[a:a + bs], v[a:a + bs])
    ref, got = pair.step(table, [s], [1], torch.randn(1, 1, 64), k[-1:], v[-1:])
    torch.testing.assert_close(ref, v[-1:], rtol=0, atol=1e-2)  # int4 codes 0 and 15 of a UE5M3 step
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3)
