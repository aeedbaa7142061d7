"""The Triton seal, unseal and first-block copy (:mod:`kvpage.ops.backends.triton.seal`) under Triton's interpreter.

Pools written by :class:`~kvpage.ops.backends.triton.seal.TritonSealCodec` must equal, byte for byte, the pools the
formats' own code writes (:data:`~kvpage.ops.sealed_attention.REFERENCE_CODEC`), in the blocks named and nowhere
else: ``int4``/``int3``/``int2`` and a rotated variant, keys and values, head_dim 64, 96 (value groups of 48) and
128, blocks of 16 and 32 tokens, random rows beside extremes (zeros, constant groups, huge and tiny magnitudes, a
common offset, NaN and infinities), stored as float32, bfloat16 and float16. The unseal must equal the format's
dequantization bit for bit; the int8 sink copy its ``quantize``; and a Triton backend's ``forward_sealed`` must write
the cache and tail bytes the reference backend writes over a mixed prefill + decode step, through the kernels.
Shapes are small: the interpreter runs each program in Python (about a second per launch here).

Device and ``TRITON_INTERPRET``: ``tests/_triton_device.py``.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from _triton_device import DEVICE, ON_CPU, interpreted_imports, interpreter, skip_module_without_device  # noqa: F401  (interpreter: autouse)

skip_module_without_device()

with interpreted_imports():
    triton = pytest.importorskip("triton")
    import triton.language as tl  # noqa: E402
    from kvpage.ops.backends.triton import seal as seal_kernels  # noqa: E402  (decorated interpreted)
    from kvpage.ops.backends.triton.seal import encode_ue5m3  # noqa: E402

    @triton.jit
    def _probe_encode(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        """UE5M3 codes of ``n`` float32 steps by the kernels' :func:`encode_ue5m3`."""
        i = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, encode_ue5m3(v).to(tl.uint8), mask=i < n)

from kvpage.cache.controller import CacheController  # noqa: E402
from kvpage.cache.tail import TailTable  # noqa: E402
from kvpage.cache.tail.pool import TailPool  # noqa: E402
from kvpage.formats import get_format  # noqa: E402
from kvpage.ops.attention import AttentionMetadata  # noqa: E402
from kvpage.ops.backends import ReferenceBackend, TritonBackend  # noqa: E402
from kvpage.ops.sealed_attention import REFERENCE_CODEC  # noqa: E402
from kvpage.spec import CacheSpec, TailLayout  # noqa: E402

CODEC = seal_kernels.TritonSealCodec()
#: numpy, under the interpreter, warns of the overflows and NaN the extreme inputs are made of
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")



def _pools(fmt_name: str, kind: str, bs: int, kv: int, d: int, nb: int) -> list[dict[str, torch.Tensor]]:
    """Two equal pools of ``kind``'s tensors filled with random bytes (so an unwritten byte shows)."""
    fmt = get_format(fmt_name)
    specs = {s.name: s for s in fmt.tensor_specs(block_size=bs, kv_heads=kv, head_dim=d)}
    gen = torch.Generator().manual_seed(nb + d)
    pool = {n: torch.randint(0, 256, (nb, *specs[n].shape), generator=gen, dtype=torch.uint8).view(specs[n].dtype)
            for n in fmt.names(kind)}
    return [{n: t.to(DEVICE) for n, t in pool.items()}, {n: t.clone().to(DEVICE) for n, t in pool.items()}]


def _blocks(bs: int, kv: int, d: int, seed: int) -> torch.Tensor:
    """``[2, bs, kv, d]`` float32: block 0 unit-normal rows with outlier channels, block 1 groups of every awkward
    kind at once in its head 0 (each a key channel and, as the channels of a token, a value group)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, bs, kv, d, generator=gen)
    x[0, :, :, ::7] *= 40.0                                                        # outlier channels
    b = x[1]                                                                        # [bs, kv, d]
    b[:, 0, 0:3] = 0.0                                                              # zero channels
    b[:, 0, 3] = 2.5                                                                # a constant channel
    b[:, 0, 4] = torch.randn(bs, generator=gen) * 1e-30                             # below the smallest step
    b[:, 0, 5] = torch.linspace(-3e38, 3e38, bs)                                    # beyond the largest step
    b[:, 0, 6] = 1000.0 + torch.randn(bs, generator=gen) * 1e-3                     # far from zero for its spread
    b[:, 0, 7] = torch.randn(bs, generator=gen) * 1e20
    b[3, 0, 8] = float("nan")                                                       # a NaN in a channel
    b[5, 0, 9] = float("inf")
    b[6, 0, 10] = -float("inf")
    b[:, 0, 11] = float("inf")                                                      # a channel of infinities
    b[2, 0, 12] = 65504.0
    b[1, 0, :] = 0.0                                                                # a zero token (value groups)
    b[2, 0, :] = -7.0                                                               # a constant token
    b[4, 0, :] = float("nan")                                                       # a NaN token
    b[7, 0, 13] = 1e-45                                                             # a subnormal
    return x


def _assert_same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: object) -> None:
    for name in ref:
        a, b = ref[name].view(torch.uint8).cpu(), got[name].view(torch.uint8).cpu()
        assert torch.equal(a, b), (what, name, int((a != b).sum()))


# (format, head_dim, block_size, kv heads, storage dtype): every width at head_dim 64 / blocks of 16 and 128 / 32,
# the odd head_dim 96 (value groups of 48), a rotated variant, bfloat16 and float16 rows
CASES = [
    ("int4", 64, 16, 2, torch.float32), ("int4", 128, 32, 1, torch.bfloat16), ("int4", 96, 16, 1, torch.float16),
    ("int3", 64, 16, 1, torch.float32), ("int3", 128, 32, 1, torch.float32), ("int3", 96, 16, 2, torch.bfloat16),
    ("int2", 64, 32, 1, torch.float32), ("int2", 128, 16, 1, torch.float16), ("int2", 96, 16, 1, torch.float32),
    ("int4_rotated", 64, 16, 1, torch.float32), ("int2_rotated", 96, 32, 1, torch.bfloat16),
]


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("fmt_name,d,bs,kv,dtype", CASES,
                         ids=[f"{f}-d{d}-bs{b}-kv{k}-{str(t)[6:]}" for f, d, b, k, t in CASES])
def test_seal_is_byte_identical_to_the_format(fmt_name: str, d: int, bs: int, kv: int, dtype: torch.dtype,
                                              kind: str) -> None:
    """Two blocks (random with outliers; extremes) sealed into a shuffled pool in one launch: every byte of codes,
    steps and offsets equals ``SealedFormat.seal``'s, and the other blocks keep theirs."""
    fmt = get_format(fmt_name)
    assert seal_kernels.kernel_seals(fmt, d)
    x = _blocks(bs, kv, d, seed=d + bs).to(dtype).to(DEVICE)  # float16: the huge values become infinities
    stored = fmt.to_stored_basis(x) if fmt.rotation(d, torch.float32, "cpu") is not None else x
    ids = torch.tensor([3, 0], device=DEVICE)
    ref, got = _pools(fmt_name, kind, bs, kv, d, nb=5)
    REFERENCE_CODEC.write_blocks(ref, fmt, kind, stored, ids)
    with mock.patch.object(seal_kernels, "seal_blocks", wraps=seal_kernels.seal_blocks) as spy:
        CODEC.write_blocks(got, fmt, kind, stored, ids)
    assert spy.call_count == 1
    _assert_same(ref, got, (fmt_name, kind, d, bs, dtype))


def test_encode_scale_matches_the_format_on_every_float_class() -> None:
    """The kernel's branch-free UE5M3 encoding equals ``encode_scale`` on steps at, just below and just above every
    code, and on zero, negatives, subnormals, huge values, infinities and NaN."""
    from kvpage.formats.kivi import decode_scale, encode_scale

    edges = decode_scale(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    steps = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(1e9)),
                       torch.tensor([0.0, -0.0, -1.0, 1e-45, 1e-39, 1e30, float("inf"), -float("inf"), float("nan")])])
    got = torch.empty(steps.numel(), dtype=torch.uint8)
    _probe_encode[(1,)](steps.to(DEVICE), got.to(DEVICE), steps.numel(), BLOCK=triton.next_power_of_2(steps.numel()))
    assert torch.equal(got.cpu(), encode_scale(steps))


def test_a_format_the_kernel_does_not_code_falls_back_unchanged() -> None:
    """int3 value groups of 44 channels (head_dim 44: no whole 8-code words per group) go through the format's own
    code, with the same bytes; the kernel is not launched."""
    fmt = get_format("int3")
    assert not seal_kernels.kernel_seals(fmt, 44) and seal_kernels.kernel_seals(fmt, 64)
    x = torch.randn(1, 8, 1, 44).to(DEVICE)
    ids = torch.tensor([1], device=DEVICE)
    ref, got = _pools("int3", "value", 8, 1, 44, nb=2)
    REFERENCE_CODEC.write_blocks(ref, fmt, "value", x, ids)
    with mock.patch.object(seal_kernels, "seal_blocks") as spy:
        CODEC.write_blocks(got, fmt, "value", x, ids)
    assert spy.call_count == 0
    _assert_same(ref, got, "int3 d44")


@pytest.mark.parametrize("fmt_name,kind,d", [("int4", "key", 64), ("int3", "value", 96), ("int2", "value", 128),
                                             ("int3", "key", 44)])
def test_unseal_equals_the_format_bit_for_bit(fmt_name: str, kind: str, d: int) -> None:
    """Pool blocks of arbitrary bytes (every step code, offset and packed code, padding bits included) read back by
    the kernel equal the format's own dequantization bit for bit (NaN payloads aside), in float32 and bfloat16."""
    fmt = get_format(fmt_name)
    pool, _ = _pools(fmt_name, kind, 16, 2, d, nb=4)
    ids = torch.tensor([2, 0, 3], device=DEVICE)
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        ref = REFERENCE_CODEC.read_blocks(pool, fmt, kind, ids, dtype, d)
        got = CODEC.read_blocks(pool, fmt, kind, ids, dtype, d)
        assert got.shape == ref.shape == (3, 16, 2, d) and got.dtype == dtype
        same = (got.view(bits) == ref.view(bits)) | (got.isnan() & ref.isnan())
        assert bool(same.all()), (fmt_name, kind, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_copy_is_byte_identical(dtype: torch.dtype) -> None:
    """The first-block int8 copy through the fused per-token write equals ``quantize``'s codes and float16 scales,
    tiny, huge and zero rows included, in the rows named and nowhere else."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(20, 2, 64, generator=gen)
    rows[1] *= 1e-30
    rows[2] = 0.0
    rows[3] *= 1e4
    rows[4, 0, 7] = 6e4
    rows = rows.to(dtype).to(DEVICE)
    sink = get_format("int8")
    dst = torch.randperm(26, generator=gen)[:20].to(DEVICE)
    pools = [(torch.full((26, 2, 64), 9, dtype=torch.uint8, device=DEVICE),
              torch.full((26, 2), 3.0, dtype=torch.float16, device=DEVICE)) for _ in range(2)]
    REFERENCE_CODEC.write_sink(*pools[0], sink, "key", rows, dst)
    with mock.patch.object(seal_kernels.write, "write_rows", wraps=seal_kernels.write.write_rows) as spy:
        CODEC.write_sink(*pools[1], sink, "key", rows, dst)
    assert spy.call_count == 1
    assert torch.equal(pools[0][0], pools[1][0])
    assert torch.equal(pools[0][1].view(torch.int16), pools[1][1].view(torch.int16))


@pytest.mark.parametrize("fmt_name", ["int4", "int2_rotated"])
def test_forward_sealed_writes_the_reference_bytes_through_the_kernels(fmt_name: str) -> None:
    """A prefill (whole blocks sealed, block 0's sink copy) then a mixed step (decode rows sealing their block, a
    chunk crossing block ends) through the reference and the Triton backend: identical cache and tail bytes, and the
    seal, sink and unseal kernels served the Triton side."""
    bs, kv, d, heads = 16, 2, 64, 4
    spec = CacheSpec.build(num_layers=1, num_kv_heads=kv, head_dim=d, block_size=bs, kv_cache_dtype=fmt_name)
    layer = spec.layer(0)
    nb = 10
    caches = [CacheController(spec, DEVICE, fill_value=float("nan")).initialize_kv_cache(nb)[0] for _ in range(2)]
    # int2_rotated: the window copies are int8 copies in 8-bit slots, written by the same sink-copy kernel
    bits = layer.format.window_copy_bits(bs)
    layout = TailLayout(num_slots=12, num_sink_slots=8, window_blocks=1, window_bits=bits)
    tables = [TailTable(bs, num_slots=12, num_sink_slots=8, window_blocks=1, window_bits=bits) for _ in range(2)]
    pools = [TailPool(spec, layout, torch.bfloat16, DEVICE) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    lens, block_tables = [bs + 1, 3 * bs], [[7, 2], [0, 5, 9]]
    full = [tuple(torch.randn(s + bs, h, d, generator=gen) for h in (heads, kv, kv)) for s in lens]
    calls: dict[str, int] = {"seal_blocks": 0, "write_rows": 0, "unseal_blocks": 0}

    def counting(name: str, fn):  # noqa: ANN001, ANN202
        def wrapped(*a: object, **k: object) -> object:
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    def step(seq: list[int], new: list[int]) -> None:
        first = [s - n for s, n in zip(seq, new)]
        slots = [block_tables[i][p // bs] * bs + p % bs for i in range(2) for p in range(first[i], seq[i])]
        meta = AttentionMetadata.build(block_tables=block_tables, seq_lens=seq, query_lens=new, slot_mapping=slots,
                                       block_size=bs, device=DEVICE)
        cat = lambda j: torch.cat([full[i][j][first[i]:seq[i]] for i in range(2)]).to(DEVICE)  # noqa: E731
        outs = []
        for b, c, table, pool in zip((ReferenceBackend(), TritonBackend()), caches, tables, pools):
            ctx = pool.context(table.plan(block_tables, seq, new))
            outs.append(b.forward_sealed(cat(0), cat(1), cat(2), c, layer, meta, ctx, layer_index=0).float().cpu())
            table.finish()
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-4 * outs[0].abs().max().item()

    with mock.patch.multiple(seal_kernels, seal_blocks=counting("seal_blocks", seal_kernels.seal_blocks),
                             unseal_blocks=counting("unseal_blocks", seal_kernels.unseal_blocks)), \
            mock.patch.object(seal_kernels.write, "write_rows", counting("write_rows", seal_kernels.write.write_rows)):
        step([bs - 1, 2 * bs + 3], [bs - 1, 2 * bs + 3])       # prefill: request 1 seals blocks 0 and 1
        step([bs, 3 * bs], [1, bs - 3])                          # decode sealing block 0 (sink) + a chunk to a seal
    for name, t in caches[0].items():
        assert torch.equal(t.view(torch.uint8).cpu(), caches[1][name].view(torch.uint8).cpu()), (fmt_name, name)
    for name, t in pools[0].layers[0].items():
        assert torch.equal(t.view(torch.uint8).cpu(), pools[1].layers[0][name].view(torch.uint8).cpu()), name
    assert (tables[0].num_window_copies > 0) == (bits == 8)
    assert calls["seal_blocks"] >= 4 and calls["write_rows"] >= 2 and calls["unseal_blocks"] >= 1, calls
