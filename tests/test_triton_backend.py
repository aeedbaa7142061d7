"""The ``triton`` attention backend under Triton's interpreter, against the ``reference`` one and float64 attention.

Every token-wise format runs through both backends on identical inputs, each over its own NaN-filled copy of
the cache with block tables drawn from a shuffled pool (so a read of an unwritten or foreign slot shows up),
for context lengths 1, block_size - 1, block_size, block_size + 1 and longer, GQA ratios 1, 3 and 4, head_dim
64, 128 and 256, decode rows mixed with prefill-chunk runs over cached prefixes, sliding windows, soft-caps and
split contexts (flash-decoding). What must hold:

* the cache bytes the two backends write are identical (the fused write codes rows as the Python formats do);
* the outputs agree within 1e-5 of the output's scale (same stored values; summation order differs);
* both are within the format's bound of float64 attention over the unquantized K/V (``tests/test_cpu_backend.py``).

``TRITON_INTERPRET=1`` is set only while this module imports the kernels (Triton decides interpreted or compiled
when a kernel is decorated) and, by an autouse fixture, during its tests; it is restored in between, so other test
files collected into the same pytest-xdist worker do not inherit it.
"""
from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

from _triton_device import DEVICE, ON_CPU, interpreted_imports, interpreter, skip_module_without_device  # noqa: F401  (interpreter: autouse)

skip_module_without_device()

_BEFORE = os.environ.get("TRITON_INTERPRET")
with interpreted_imports():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from kvpage.ops.backends.triton import paged_attention as attn_kernels  # noqa: F401  (decorated interpreted)
    from kvpage.ops.backends.triton import write as write_kernels  # noqa: F401
    from kvpage.ops.backends.triton.codes import decode_e4m3, encode_e4m3, encode_int8

    @triton.jit
    def _codes_kernel(x_ptr, e4m3_ptr, int8_ptr, dec_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(x_ptr + i, mask=m, other=0.0)
        c = encode_e4m3(x)
        tl.store(e4m3_ptr + i, c, mask=m)
        tl.store(int8_ptr + i, encode_int8(x), mask=m)
        tl.store(dec_ptr + i, decode_e4m3(c), mask=m)
_AFTER = os.environ.get("TRITON_INTERPRET")

from kvpage.cache.controller import CacheController  # noqa: E402
from kvpage.errors import KVCacheLayoutError  # noqa: E402
from kvpage.formats import get_format  # noqa: E402
from kvpage.ops.attention import AttentionMetadata  # noqa: E402
from kvpage.ops.backends import CpuBackend, ReferenceBackend, TritonBackend, select_backend  # noqa: E402
from kvpage.ops.backends.triton.step import split_count, step_tiles  # noqa: E402
from kvpage.ops.layer_attention import PLAIN, LayerAttention  # noqa: E402
from kvpage.spec import CacheSpec  # noqa: E402
from _attention_oracle import float64_attention, static_scales  # noqa: E402

TOKEN_FORMATS = ["float32", "bfloat16", "float16", "int8", "fp8", "int8_rotated", "fp8_per_token_head",
                 "int8_static", "fp8_static"]
# Output error against float64 attention over the unquantized K/V (unit-normal q/k/v), per format: the bounds
# tests/test_cpu_backend.py holds the cpu and reference backends to.
LOOSE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3, "int8": 0.06, "fp8": 0.25, "int8_rotated": 0.06,
         "fp8_per_token_head": 0.25, "int8_static": 0.08, "fp8_static": 0.3}



cpu_only = pytest.mark.skipif(not ON_CPU, reason="about the CPU under the interpreter")


def run_batch(fmt: str, *, lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int,
              block_size: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32, params: LayerAttention = PLAIN,
              has_value: bool = True, backend: TritonBackend | None = None) -> None:
    """Write each request's cached part, then one step of ``query_lens`` new tokens, through both backends; check
    bytes, agreement and the float64 bound."""
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    nb = sum(math.ceil(s / bs) for s in lens) + 3
    spec = CacheSpec.build(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, block_size=bs,
                           kv_cache_dtype=fmt, static_scales=static_scales(fmt, kv_heads, head_dim),
                           has_value=has_value)
    layer = spec.layer(0)
    caches = [CacheController(spec, DEVICE, fill_value=float("nan")).initialize_kv_cache(nb)[0] for _ in range(2)]
    backends = [ReferenceBackend(), backend or TritonBackend()]
    ids = list(range(nb))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for s in lens:
        tables.append(ids[at:at + math.ceil(s / bs)])
        at += math.ceil(s / bs)
    full = [tuple(torch.randn(s, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
            for s in lens]
    if not has_value:  # a key-only layer's keys are its values
        full = [(q, k, k) for q, k, _ in full]

    def step(rows: list[int], seq: list[int], new: list[int], first: list[int]) -> list[torch.Tensor]:
        slots = [tables[i][p // bs] * bs + p % bs for i, f, s in zip(rows, first, seq) for p in range(f, s)]
        meta = AttentionMetadata.build(block_tables=[tables[i] for i in rows], seq_lens=seq, query_lens=new,
                                       slot_mapping=slots, block_size=bs, device=DEVICE)
        cat = lambda j: torch.cat([full[i][j][f:s] for i, f, s in zip(rows, first, seq)]).to(DEVICE)  # noqa: E731
        v = cat(2) if has_value else None
        return [b.forward(cat(0), cat(1), v, c, layer, meta, layer_index=0, params=params).cpu()
                for b, c in zip(backends, caches)]

    cached = [s - n for s, n in zip(lens, query_lens)]
    pre = [i for i, c in enumerate(cached) if c > 0]
    if pre:  # the prefix-cached part, written (and attended) by each backend's own path
        step(pre, [cached[i] for i in pre], [cached[i] for i in pre], [0] * len(pre))
    if params.sliding_window is not None:
        # blocks wholly before every new query's window may hold anything (their slots were reused): poison them
        for i, c in enumerate(cached):
            gone = tables[i][: max(0, c - params.sliding_window + 1) // bs]
            for cache in caches:
                for t in cache.values():
                    if t.is_floating_point():
                        t[gone] = float("nan")
    ref, got = step(list(range(len(lens))), lens, query_lens, cached)
    for name, t in caches[0].items():
        assert torch.equal(t.view(torch.uint8), caches[1][name].view(torch.uint8)), f"{fmt}: {name} bytes differ"
    scale = ref.abs().max().item()
    assert torch.isfinite(got).all() and got.dtype == ref.dtype == dtype
    if dtype == torch.float32:
        assert (got - ref).abs().max().item() <= 1e-5 * scale, fmt
    elif ON_CPU:  # both round a float32 result to the model dtype: at most one rounding step apart
        step_ = torch.finfo(dtype).eps * ref.float().abs() + 1e-5 * scale
        assert ((got.float() - ref.float()).abs() <= step_).all(), fmt
    else:  # on CUDA the reference attends in the model dtype itself
        step_ = 4 * torch.finfo(dtype).eps * scale
        assert ((got.float() - ref.float()).abs() <= step_).all(), fmt
    a = 0
    for i, s in enumerate(lens):
        n = query_lens[i]
        want = float64_attention(full[i][0][s - n:], full[i][1], full[i][2], s - n, params)
        for out in (ref, got):
            assert (out[a:a + n].double() - want).abs().max().item() < LOOSE[fmt] + 2e-2 * (dtype != torch.float32), \
                (fmt, s, n)
        a += n


@pytest.mark.parametrize("fmt", ["float32", "int8", "fp8"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 128), (8, 2, 64), (3, 1, 256)],
                         ids=["gqa1-d64", "gqa3-d128", "gqa4-d64", "gqa3-d256"])
def test_decode_rows_of_every_length_class(fmt: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """Decode rows of contexts 1, bs-1, bs, bs+1 and longer in one launch, per GQA ratio and head_dim."""
    run_batch(fmt, lens=[1, 15, 16, 17, 53], query_lens=[1] * 5, heads=heads, kv_heads=kv_heads,
              head_dim=head_dim)


@pytest.mark.parametrize("fmt", ["float32", "int8_rotated"])
@pytest.mark.parametrize("block_size", [8, 12, 32])
def test_block_sizes_other_than_the_key_tile(fmt: str, block_size: int) -> None:
    """Blocks smaller than, not dividing, and larger than the kernel's 16-position key tile (one tile spans blocks,
    or lies inside one), with head_dim 96 (not a power of two: a masked tile; block-diagonal Hadamard rotation)."""
    bs = block_size
    run_batch(fmt, lens=[1, bs - 1, bs, bs + 1, 3 * bs + 2, 2 * bs + 5], query_lens=[1, 1, 1, 1, 1, bs + 2],
              heads=4, kv_heads=2, head_dim=96, block_size=bs, seed=bs)


@pytest.mark.parametrize("fmt", TOKEN_FORMATS)
def test_every_format_in_a_mixed_batch_of_decode_rows_and_chunks(fmt: str) -> None:
    """Decode rows, a short run and a prefill chunk over cached prefixes, and a whole prefill, in one launch."""
    run_batch(fmt, lens=[1, 16, 40, 23, 17], query_lens=[1, 1, 20, 3, 17], heads=9, kv_heads=3, head_dim=64, seed=3)


@pytest.mark.parametrize("fmt", ["float32", "int8_rotated"])
@pytest.mark.parametrize("params", [LayerAttention(scale=0.06), LayerAttention(sliding_window=11),
                                    LayerAttention(scale=0.25, sliding_window=20, logit_softcap=2.0),
                                    LayerAttention(logit_softcap=1.5)], ids=["scale", "window", "all", "softcap"])
def test_layer_scale_window_and_softcap(fmt: str, params: LayerAttention) -> None:
    """Gemma's scale and soft-cap and sliding windows shorter and longer than a block, over decode rows and runs;
    blocks that fell out of every window are NaN-poisoned first and must not be read."""
    run_batch(fmt, lens=[1, 12, 40, 23, 45], query_lens=[1, 1, 1, 3, 30], heads=6, kv_heads=2, head_dim=64,
              seed=11, params=params)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_long_contexts_split_and_merge(fmt: str) -> None:
    """Flash-decoding: with few programs for the device, long contexts are split and merged by log-sum-exp."""
    lens, bs = [136, 7], 16
    meta = AttentionMetadata.build(block_tables=[list(range(9)), [9]], seq_lens=lens, query_lens=[1, 1],
                                   slot_mapping=[135, 9 * bs + 6], block_size=bs)
    tiles = step_tiles(meta, 2, 64, DEVICE)
    assert split_count(tiles.items.shape[0] * 2, tiles.longest_tiles, target_programs=64) == 2  # it does split
    run_batch(fmt, lens=lens, query_lens=[1, 1], heads=4, kv_heads=2, head_dim=64, seed=5,
              backend=TritonBackend(target_programs=64))
    run_batch(fmt, lens=[100, 60], query_lens=[1, 20], heads=4, kv_heads=2, head_dim=64, seed=6,
              backend=TritonBackend(target_programs=64), params=LayerAttention(sliding_window=50))


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "fp8_static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models(fmt: str, dtype: torch.dtype) -> None:
    """q/k/v in the model's 16-bit dtype; the output comes back in it, one rounding from the reference's."""
    run_batch(fmt, lens=[1, 17, 33], query_lens=[1, 1, 12], heads=6, kv_heads=2, head_dim=64, seed=7, dtype=dtype)


@pytest.mark.parametrize("fmt", ["float16", "int8"])
def test_key_only_layer(fmt: str) -> None:
    """A key-only (MLA-style latent) layer: the keys serve as values."""
    run_batch(fmt, lens=[5, 17, 30], query_lens=[1, 1, 10], heads=4, kv_heads=1, head_dim=64, seed=2,
              has_value=False)


def test_c02_a_cache_of_another_dtype_is_refused_naming_layer_expected_and_actual() -> None:
    """The seed's bug: a kernel must never read a cache allocated in another dtype; nothing is written."""
    spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, kv_cache_dtype="int8")
    cache = dict(CacheController(spec, DEVICE).initialize_kv_cache(4)[0])
    cache["key"] = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    before = {n: t.clone() for n, t in cache.items()}
    meta = AttentionMetadata.build(block_tables=[[1]], seq_lens=[1], query_lens=[1], slot_mapping=[16], block_size=16,
                                   device=DEVICE)
    q, k, v = (torch.randn(1, h, 64, device=DEVICE) for h in (4, 2, 2))
    with pytest.raises(KVCacheLayoutError, match=r"layer 7.*key.*uint8.*bfloat16"):
        TritonBackend().forward(q, k, v, cache, spec.layer(0), meta, layer_index=7)
    assert all(torch.equal(before[n].view(torch.uint8), t.view(torch.uint8)) for n, t in cache.items())


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int8_rotated", "fp8_per_token_head", "int8_static", "fp8_static"])
def test_fused_write_is_byte_identical_to_the_format_quantize(fmt: str) -> None:
    """Extremes included: zeros (the scale floor), +-inf (saturation), huge and tiny magnitudes."""
    kv_heads, head_dim = 3, 64
    scales = static_scales(fmt, kv_heads, head_dim)
    spec = CacheSpec.build(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, block_size=8,
                           kv_cache_dtype=fmt, static_scales=scales)
    layer = spec.layer(0)
    f = layer.format
    x = torch.randn(40, kv_heads, head_dim, generator=torch.Generator().manual_seed(1))
    x[0] = 0
    x[1, 0, 5], x[2, 1, 7] = math.inf, -math.inf
    x[3] *= 1e6
    x[4] *= 1e-6
    x[5, 2] = 65504.0 * 500
    x[6] *= 300
    cache = CacheController(spec, DEVICE).initialize_kv_cache(6)[0]
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(2))[:40]
    TritonBackend()._write_kv(cache, layer, f, x.to(DEVICE), x.to(DEVICE), slots.to(DEVICE))
    for kind in ("key", "value"):
        want = f.quantize(x, kind=kind)
        assert torch.equal(cache[kind].cpu().view(-1, kv_heads, head_dim)[slots], want.codes), kind
        if want.scale is not None:
            got = cache[kind + "_scale"].cpu().view(-1, kv_heads)[slots]
            assert torch.equal(got.view(torch.int16), want.scale.view(torch.int16)), kind


def test_element_codes_equal_torchs_casts_on_ties_subnormals_and_saturation() -> None:
    """e4m3 and int8 codes of a sweep that hits every e4m3 value, every midpoint between neighbours (ties to
    even), the subnormal range, the saturation limit and NaN, bit for bit as torch casts them."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = e4m3[torch.isfinite(e4m3)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    sweep = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 3, 2000)
    x = torch.cat([finite, mids, -mids, sweep, torch.tensor([500.0, -1e9, 0.0, -0.0, 2.5, -3.5, 126.5, 127.6])])
    x = torch.cat([x, torch.tensor([math.nan])])
    n = x.numel()
    e, i, dec = (torch.empty(n, dtype=dt, device=DEVICE) for dt in (torch.uint8, torch.uint8, torch.float32))
    _codes_kernel[(triton.cdiv(n, 1024),)](x.to(DEVICE), e, i, dec, n, BLOCK=1024)
    e, i, dec = e.cpu(), i.cpu(), dec.cpu()
    want_e = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(e[:-1], want_e[:-1])
    assert e[-1].item() & 0x7F == 0x7F  # NaN stays NaN
    assert torch.equal(i[:-1], torch.round(x[:-1]).clamp(-127, 127).to(torch.int8).view(torch.uint8))
    assert torch.equal(dec[:-1], want_e[:-1].view(torch.float8_e4m3fn).float()) and math.isnan(dec[-1].item())


def test_the_backends_encoding_numbers_are_the_kernels() -> None:
    """The backend repeats the kernels' constexpr numbers so that it imports no triton; they must not drift."""
    from kvpage.ops.backends import triton as backend
    from kvpage.ops.backends.triton import codes

    assert (backend._ENC_F32, backend._ENC_BF16, backend._ENC_F16, backend._ENC_I8, backend._ENC_E4M3) == (
        codes.ENC_F32, codes.ENC_BF16, codes.ENC_F16, codes.ENC_I8, codes.ENC_E4M3)
    assert (backend._SCALE_NONE, backend._SCALE_TOKEN, backend._SCALE_CHANNEL) == (
        codes.SCALE_NONE, codes.SCALE_TOKEN, codes.SCALE_CHANNEL)


@cpu_only
def test_selection_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton`` serves token-wise formats on the CPU under the interpreter; ``auto`` there never picks it (where
    the cpu kernels do not serve, it falls back to the reference as before); the block-wise int4/int2 are served
    too (tests/test_triton_sealed.py)."""
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="int8")
    assert isinstance(select_backend("triton", spec.layer(0), "cpu"), TritonBackend)
    # (the cpu kernels made unavailable without building them: a build takes minutes on a fresh checkout)
    monkeypatch.setattr(CpuBackend, "unsupported", classmethod(lambda cls, spec, device: "not here"))
    assert type(select_backend("auto", spec.layer(0), "cpu")) is ReferenceBackend
    for fmt in ("int4", "int2"):
        sealed = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype=fmt)
        assert isinstance(select_backend("triton", sealed.layer(0), "cpu"), TritonBackend)
        assert type(select_backend("auto", sealed.layer(0), "cpu")) is ReferenceBackend


@cpu_only
def test_triton_on_the_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Case C27 for ``triton``: refused at selection, naming the backend, format, device and why."""
    monkeypatch.delenv("TRITON_INTERPRET")
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"'triton' cannot serve kv_cache_dtype 'fp8' on cpu: .*TRITON_INTERPRET=1"):
        select_backend("triton", spec.layer(0), "cpu")
    # on CUDA without a CUDA device: refused by name, and auto falls back to the reference
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'triton' cannot serve .* on cuda: no CUDA device"):
            select_backend("triton", spec.layer(0), "cuda")
        assert isinstance(select_backend("auto", spec.layer(0), "cuda"), ReferenceBackend)


def test_engine_config_takes_triton_and_lists_it() -> None:
    """``EngineConfig`` (hence ``LLM``, the CLI and the server) accepts the name and names it among the choices."""
    from kvpage.engine.config import EngineConfig

    assert EngineConfig(attention_backend="triton", device="cuda").attention_backend == "triton"
    with pytest.raises(ValueError, match="must be one of auto, reference, cpu, triton"):
        EngineConfig(attention_backend="flash")


@cpu_only
def test_the_interpreter_switch_does_not_leak_out_of_this_module() -> None:
    """Importing this module leaves ``TRITON_INTERPRET`` as it found it; the kernels stay interpreted."""
    from kvpage.ops.backends.triton import kernels_interpreted

    assert kernels_interpreted() is True
    assert _AFTER == _BEFORE


def test_kvpage_imports_and_selects_without_triton() -> None:
    """With triton blocked, kvpage imports, ``auto`` selects as before and ``triton`` is refused naming why."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kvpage, kvpage.engine.config\n"
        "from kvpage.ops.backends import select_backend, TritonBackend\n"
        "from kvpage.spec import CacheSpec\n"
        "s = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype='int8').layer(0)\n"
        "select_backend('auto', s, 'cpu'); select_backend('auto', s, 'cuda')\n"
        "try:\n"
        "    select_backend('triton', s, 'cuda')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "KVPAGE_CPU_KERNELS": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "attention backend 'triton' cannot serve kv_cache_dtype 'int8' on cuda" in r.stdout
    assert "triton package is not installed" in r.stdout
    # with triton installed, importing kvpage and selecting on the CPU do not import it either (lazy)
    lazy = ("import sys, kvpage, kvpage.engine.config\n"
            "from kvpage.ops.backends import select_backend\n"
            "from kvpage.spec import CacheSpec\n"
            "s = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype='int8').layer(0)\n"
            "select_backend('auto', s, 'cpu')\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n")
    r = subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def test_the_kernels_compile_for_sm90_without_a_gpu() -> None:
    """Triton's full GPU pipeline (down to a cubin, with the wheel's ptxas) accepts every encoding and scale source,
    decode and run tiles, with and without window, soft-cap and split, the int4/int2 kernel for both tail
    encodings, and the seal and unseal of every width (the seal without FMA contraction): errors only the GPU
    compiler sees show here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-m", "kvpage.ops.backends.triton.aot", "--arch", "90"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert sum(line.startswith("_paged_attention_kernel ") for line in lines) == 28
    assert sum(line.startswith("_write_rows_kernel ") for line in lines) == 4
    assert sum(line.startswith("_sealed_attention_kernel ") for line in lines) == 17  # int4/int2 x tail x tile x split
    assert sum(line.startswith("_seal_blocks_kernel ") for line in lines) == 6  # int4/int3/int2 x key/value
    assert sum(line.startswith("_unseal_blocks_kernel ") for line in lines) == 6
    assert any(line.startswith("_merge_splits_kernel ") for line in lines)
