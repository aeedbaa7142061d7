"""The ``triton`` backend's quantize-on-seal path (``int4``, ``int3``, ``int2``, their ``_rotated`` variants) under Triton's interpreter, against the
``reference`` backend and float64 attention.

Both backends get identical inputs, each over its own NaN-filled cache copy (block tables drawn from a shuffled
pool) and its own tail pool: a prefix written by each backend's own path, then one step of decode rows and query
runs. Contexts 1, bs-1, bs, bs+1 and a few blocks; int2's 16-bit window copies; the int8 copy of block 0; GQA 1
and 3; head_dim 64 and 128; mixed decode + chunk batches. What must hold:

* the cache and tail bytes the two write are identical (the write is the reference's own code);
* the outputs agree within 1e-5 of the output's scale (same decoded values; summation order differs);
* both are within the format's bound of float64 attention over the unquantized K/V (``tests/test_cpu_backend.py``);
* the kernel, not the fallback, served the rows it should (decode rows and short runs in one block).

Device and ``TRITON_INTERPRET``: ``tests/_triton_device.py``.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from _triton_device import DEVICE, ON_CPU, interpreted_imports, interpreter, skip_module_without_device  # noqa: F401  (interpreter: autouse)

skip_module_without_device()

with interpreted_imports():
    triton = pytest.importorskip("triton")
    from kvpage.ops.backends.triton import sealed_attention as sealed_kernels  # noqa: F401  (decorated interpreted)

from kvpage.cache.controller import CacheController  # noqa: E402
from kvpage.cache.tail import TailTable  # noqa: E402
from kvpage.cache.tail.pool import TailPool  # noqa: E402
from kvpage.errors import KVCacheLayoutError  # noqa: E402
from kvpage.ops.attention import AttentionMetadata  # noqa: E402
from kvpage.ops.backends import ReferenceBackend, TritonBackend, select_backend  # noqa: E402
from kvpage.ops.layer_attention import PLAIN, LayerAttention  # noqa: E402
from kvpage.spec import CacheSpec, TailLayout  # noqa: E402
from _attention_oracle import float64_attention  # noqa: E402

#: Output error against float64 attention over the unquantized K/V (unit-normal q/k/v): tests/test_cpu_backend.py's.
LOOSE = {"int4": 0.35, "int3": 0.7, "int2": 1.2, "int4_rotated": 0.35, "int3_rotated": 0.7, "int2_rotated": 1.2}




def run_batch(fmt: str, *, lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int,
              block_size: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32, params: LayerAttention = PLAIN,
              window_blocks: int = 0, sink_slots: int = 8, has_value: bool = True,
              backend: TritonBackend | None = None) -> tuple[int, ...]:
    """Write each request's cached part, then one step of ``query_lens`` new tokens, through both backends; check
    bytes, agreement and the float64 bound. Returns the requests the Triton kernel's launch served in the last step
    (``()`` when it was not launched)."""
    gen = torch.Generator().manual_seed(seed)
    bs = block_size
    nb = sum(math.ceil(s / bs) for s in lens) + 3
    spec = CacheSpec.build(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, block_size=bs,
                           kv_cache_dtype=fmt, has_value=has_value)
    layer = spec.layer(0)
    caches = [CacheController(spec, DEVICE, fill_value=float("nan")).initialize_kv_cache(nb)[0] for _ in range(2)]
    tri = backend or TritonBackend()
    launched: list[tuple[int, ...]] = []
    kernel: Callable[..., None] = sealed_kernels.sealed_attention

    def counted(*args: object, **kw: object) -> None:
        items = args[-1]
        assert isinstance(items, torch.Tensor)
        launched.append(tuple(sorted(set(items[:, 0].tolist()))))
        kernel(*args, **kw)

    backends = [ReferenceBackend(), tri]
    # the format's window copies (int2's: int8 copies in 8-bit slots, source kind 3) where there are 8-bit slots
    bits = layer.format.window_copy_bits(bs) if window_blocks and sink_slots else 16
    layout = TailLayout(num_slots=24, num_sink_slots=sink_slots + (24 if bits == 8 else 0),
                        window_blocks=window_blocks, window_bits=bits)
    tables_ = [TailTable(bs, num_slots=layout.num_slots, num_sink_slots=layout.num_sink_slots,
                         window_blocks=layout.window_blocks, window_bits=bits) for _ in range(2)]
    pools = [TailPool(spec, layout, dtype, DEVICE) for _ in tables_]
    ids = list(range(nb))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for s in lens:
        tables.append(ids[at:at + math.ceil(s / bs)])
        at += math.ceil(s / bs)
    full = [tuple(torch.randn(s, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
            for s in lens]
    if not has_value:
        full = [(q, k, k) for q, k, _ in full]

    def step(rows: list[int], seq: list[int], new: list[int], first: list[int]) -> list[torch.Tensor]:
        bts = [tables[i] for i in rows]
        slots = [tables[i][p // bs] * bs + p % bs for i, f, s in zip(rows, first, seq) for p in range(f, s)]
        meta = AttentionMetadata.build(block_tables=bts, seq_lens=seq, query_lens=new, slot_mapping=slots,
                                       block_size=bs, device=DEVICE)
        cat = lambda j: torch.cat([full[i][j][f:s] for i, f, s in zip(rows, first, seq)]).to(DEVICE)  # noqa: E731
        v = cat(2) if has_value else None
        outs = []
        for b, c, table, pool in zip(backends, caches, tables_, pools):
            ctx = pool.context(table.plan(bts, seq, new))
            outs.append(b.forward_sealed(cat(0), cat(1), v, c, layer, meta, ctx, layer_index=0, params=params).cpu())
            table.finish()
        return outs

    cached = [s - n for s, n in zip(lens, query_lens)]
    pre = [i for i, c in enumerate(cached) if c > 0]
    if pre:  # the prefix-cached part, written (and attended) by each backend's own path
        step(pre, [cached[i] for i in pre], [cached[i] for i in pre], [0] * len(pre))
    with mock.patch.object(sealed_kernels, "sealed_attention", counted):
        ref, got = step(list(range(len(lens))), lens, query_lens, cached)
    for name, t in caches[0].items():
        assert torch.equal(t.view(torch.uint8), caches[1][name].view(torch.uint8)), f"{fmt}: {name} bytes differ"
    for name, t in pools[0].layers[0].items():
        assert torch.equal(t.view(torch.uint8), pools[1].layers[0][name].view(torch.uint8)), f"{fmt}: tail {name}"
    scale = ref.abs().max().item()
    assert torch.isfinite(got).all() and got.dtype == ref.dtype == dtype
    if dtype == torch.float32:
        assert (got - ref).abs().max().item() <= 1e-5 * scale, fmt
    else:  # both round a float32 result to the model dtype: at most one rounding step apart
        step_ = torch.finfo(dtype).eps * ref.float().abs() + 1e-5 * scale
        assert ((got.float() - ref.float()).abs() <= step_).all(), fmt
    a = 0
    for i, s in enumerate(lens):
        n = query_lens[i]
        want = float64_attention(full[i][0][s - n:], full[i][1], full[i][2], s - n, params)
        for out in (ref, got):
            assert (out[a:a + n].double() - want).abs().max().item() < LOOSE[fmt] + 2e-2 * (dtype != torch.float32), \
                (fmt, s, n)
        a += n
    return launched[-1] if launched else ()


@pytest.mark.parametrize("fmt", ["int4", "int3", "int2"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (6, 2, 128)], ids=["gqa1-d64", "gqa3-d128"])
def test_decode_rows_of_every_length_class(fmt: str, heads: int, kv_heads: int, head_dim: int) -> None:
    """Decode rows of contexts 1, bs-1, bs, bs+1 and a few blocks in one launch (a row whose block seals this step
    reads it from its slot); the kernel serves every one."""
    bs = 8
    lens = [1, bs - 1, bs, bs + 1, 4 * bs + 3]
    served = run_batch(fmt, lens=lens, query_lens=[1] * len(lens), heads=heads, kv_heads=kv_heads,
                       head_dim=head_dim, block_size=bs)
    assert served == tuple(range(len(lens)))


@pytest.mark.parametrize("fmt,block_size", [("int2", 12), ("int4", 32), ("int3", 12), ("int4_rotated", 12),
                                            ("int2_rotated", 12)])
def test_block_sizes_other_than_the_key_tile_and_head_dim_96(fmt: str, block_size: int) -> None:
    """Blocks not dividing and larger than the kernel's 16-position key tile, head_dim 96 (a masked tile, value
    groups of 48 channels), with window copies and the sink copy."""
    bs = block_size
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 2, 2 * bs + 5]
    served = run_batch(fmt, lens=lens, query_lens=[1, 1, 1, 1, 1, 3], heads=4, kv_heads=2, head_dim=96,
                       block_size=bs, seed=bs, window_blocks=1)
    assert served == tuple(range(len(lens)))


@pytest.mark.parametrize("fmt", ["int4", "int3", "int2"])
def test_window_copies_and_the_sink_copy_of_block_0(fmt: str) -> None:
    """16-bit window copies of the blocks before a query's own (int2's residual window) and the int8 copy of
    block 0, read by decode rows through the kernel; with and without sink slots."""
    bs = 8
    lens = [2 * bs + 1, 3 * bs, 5 * bs + 4, bs + 3]
    for window, sinks in ((1, 8), (2, 0)):
        served = run_batch(fmt, lens=lens, query_lens=[1] * len(lens), heads=6, kv_heads=2, head_dim=64,
                           block_size=bs, window_blocks=window, sink_slots=sinks, seed=window)
        assert served == tuple(range(len(lens)))


@pytest.mark.parametrize("fmt", ["int4", "int3", "int2", "int3_rotated"])
def test_mixed_batch_of_decode_short_runs_and_chunks(fmt: str) -> None:
    """Decode rows and short runs within one block (kernel, tiles of several queries) beside a run crossing a block
    end, a long chunk and a whole prefill (reference path), in one step, with window copies."""
    bs = 8
    lens = [40, 23, 90, 45, 13, 30, 32]
    # 24..29: a run from a block boundary within one block; 29..31: a run that fills (seals) its block
    query_lens = [1, 3, 40, 45, 8, 6, 3]
    served = run_batch(fmt, lens=lens, query_lens=query_lens, heads=6, kv_heads=2, head_dim=64, block_size=bs,
                       seed=3, window_blocks=1)
    assert served == (0, 1, 5, 6), served


def test_int3_head_dims_whose_codes_straddle_bytes() -> None:
    """int3 rows of 44 and 20 channels end mid-byte, with codes straddling two bytes up to the row's last one: the
    kernel reads each code's high bits from the next byte only where the row holds it (masked loads)."""
    for head_dim in (44, 20):
        served = run_batch("int3", lens=[1, 9, 30], query_lens=[1, 1, 2], heads=4, kv_heads=2, head_dim=head_dim,
                           seed=head_dim)
        assert served == (0, 1, 2)


def test_key_only_layer_and_a_16_bit_model() -> None:
    """A key-only (latent) layer: its keys are its values; a bfloat16 model: bfloat16 tail rows, output rounded to
    bfloat16 like the reference's."""
    run_batch("int4", lens=[5, 17, 30], query_lens=[1, 1, 2], heads=4, kv_heads=1, head_dim=64, seed=2,
              has_value=False)
    run_batch("int4", lens=[1, 17, 40, 33], query_lens=[1, 1, 3, 33], heads=6, kv_heads=2, head_dim=64, seed=7,
              dtype=torch.bfloat16, window_blocks=1)


def test_long_contexts_split_over_the_context_match() -> None:
    """More programs wanted than tiles: long contexts split over the grid's third axis and merge by log-sum-exp,
    beside rows the fallback writes after the merge."""
    run_batch("int2", lens=[300, 9, 40], query_lens=[1, 1, 20], heads=4, kv_heads=1, head_dim=64, seed=5,
              window_blocks=1, backend=TritonBackend(target_programs=16))


@pytest.mark.parametrize("params", [LayerAttention(scale=0.06), LayerAttention(sliding_window=11),
                                    LayerAttention(logit_softcap=1.5)], ids=["scale", "window", "softcap"])
def test_layer_knobs(params: LayerAttention) -> None:
    """A layer's own scale runs in the kernel; windowed and soft-capped layers take the reference path (as in the
    ``cpu`` backend): both equal the reference."""
    served = run_batch("int4", lens=[1, 12, 40, 23], query_lens=[1, 1, 1, 3], heads=6, kv_heads=2, head_dim=64,
                       seed=11, params=params)
    assert served == ((0, 1, 2, 3) if params.is_plain else ())


def test_selection_serves_int4_and_int2_and_refuses_a_cache_of_another_dtype() -> None:
    """``unsupported`` no longer refuses int4/int3/int2; a pool tensor of the wrong dtype is refused before any write."""
    for fmt in ("int4", "int3", "int2"):
        spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=64, block_size=8, kv_cache_dtype=fmt)
        assert TritonBackend.unsupported(spec.layer(0), DEVICE) is None
        assert isinstance(select_backend("triton", spec.layer(0), DEVICE), TritonBackend)
    spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=64, block_size=8, kv_cache_dtype="int4")
    cache = dict(CacheController(spec, DEVICE).initialize_kv_cache(4)[0])
    cache["key_scale"] = torch.zeros(4, 2, 64, dtype=torch.float16, device=DEVICE)
    layout = TailLayout(num_slots=4, num_sink_slots=1, window_blocks=0)
    table = TailTable(8, num_slots=4, num_sink_slots=1, window_blocks=0)
    ctx = TailPool(spec, layout, torch.float32, DEVICE).context(table.plan([[1]], [1], [1]))
    meta = AttentionMetadata.build(block_tables=[[1]], seq_lens=[1], query_lens=[1], slot_mapping=[8], block_size=8,
                                   device=DEVICE)
    q, k, v = (torch.randn(1, h, 64, device=DEVICE) for h in (4, 2, 2))
    with pytest.raises(KVCacheLayoutError, match=r"layer 0.*key_scale.*uint8.*float16"):
        TritonBackend().forward_sealed(q, k, v, cache, spec.layer(0), meta, ctx, layer_index=0)
