"""paged_attention / write_kv / read_kv against an independent float64 dense causal attention.

Every cache here is filled with NaN when allocated (``fill_value=nan``, which
makes float16 scale tensors NaN for the quantized formats), so any unwritten
slot that reaches an output shows up as NaN. Block tables are drawn from a
shuffled pool, so they are neither contiguous nor increasing.

The rotated formats (``int8``, ``fp8``) store ``x @ R``; the op attends in that
basis (queries rotated by ``R``, output by ``R.T``). The references here read the
cache back in the original basis (``read_kv(..., rotated=False)``), so they check
the rotation algebra too: both agree up to float32 rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from kvpage.cache.controller import CacheController
from kvpage.errors import KVCacheLayoutError
from kvpage.formats import get_format
from kvpage.ops.attention import AttentionMetadata, paged_attention, read_kv, write_kv
from kvpage.ops.layer_attention import LayerAttention
from kvpage.spec import CacheSpec, LayerSpec


NAN = float("nan")
Q_HEADS, KV_HEADS = 9, 3
# Loose tolerances of the quantized output against attention over the *unquantized* K/V
# (unit-normal q, k, v). Measured maxima over this file's cases: 0.026 (int8), 0.15 (fp8),
# 0.034 (int8), 0.13 (fp8_per_token_head). The tight comparison with attention over
# the read-back values (atol = rtol = 1e-5) holds with a margin of about 9x for every format.
LOOSE = {"float32": 1e-5, "int8": 0.06, "fp8": 0.25, "int8_rotated": 0.06, "fp8_per_token_head": 0.25}
QUANTIZED = ["int8", "fp8", "int8_rotated", "fp8_per_token_head"]
ROTATED = ["int8_rotated", "fp8"]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Dense causal attention in float64 for the *last* ``n`` positions of a context of ``s`` tokens.

    Args:
        q: ``[n, H, D]`` queries of positions ``s - n .. s - 1``.
        k, v: ``[s, Hkv, D]`` every key/value of the context.
    """
    q, k, v = q.double(), k.double(), v.double()
    n, h, d = q.shape
    s, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1)  # [s, H, D]: query head j uses kv head j // (H / Hkv)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("nhd,shd->hns", q, k) * (d**-0.5 if scale is None else scale)  # [H, n, s]
    pos_q = torch.arange(s - n, s)[:, None]
    pos_k = torch.arange(s)[None, :]
    scores = scores.masked_fill(pos_k > pos_q, float("-inf"))
    scores = scores - scores.amax(-1, keepdim=True)
    p = scores.exp()
    p = p / p.sum(-1, keepdim=True)
    return torch.einsum("hns,shd->nhd", p, v)  # [n, H, D]


@dataclass
class Request:
    q: torch.Tensor  # [L, H, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor  # [L, Hkv, D]
    table: list[int]
    cached: int = 0
    outputs: list[torch.Tensor] = field(default_factory=list)


class Harness:
    """One attention layer's paged cache plus requests whose full q/k/v streams are known up front."""

    def __init__(self, fmt: str, head_dim: int, block_size: int, *, num_blocks: int = 64, seed: int = 0,
                 has_value: bool = True, fill: float | None = NAN) -> None:
        spec = CacheSpec.build(num_layers=1, num_kv_heads=KV_HEADS, head_dim=head_dim, block_size=block_size,
                               kv_cache_dtype=fmt, has_value=has_value)
        self.fmt, self.layer, self.bs = fmt, spec.layer(0), block_size
        self.cache = CacheController(spec, fill_value=fill).initialize_kv_cache(num_blocks)[0]
        self.gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.reqs: dict[str, Request] = {}

    def add(self, name: str, length: int, table: list[int] | None = None) -> Request:
        g, d = self.gen, self.layer.head_dim
        if table is None:
            table = [self.free.pop() for _ in range(math.ceil(length / self.bs))]
        r = Request(torch.randn(length, Q_HEADS, d, generator=g), torch.randn(length, KV_HEADS, d, generator=g),
                    torch.randn(length, KV_HEADS, d, generator=g), table)
        self.reqs[name] = r
        return r

    def step(self, plan: list[tuple[str, int]], scale: float | None = None) -> dict[str, torch.Tensor]:
        """Run one batch: request ``name`` adds its next ``n`` tokens. Returns name -> ``[n, H, D]``."""
        qs, ks, vs, slots, tables, seq_lens, qlens = [], [], [], [], [], [], []
        for name, n in plan:
            r = self.reqs[name]
            a, b = r.cached, r.cached + n
            qs.append(r.q[a:b])
            ks.append(r.k[a:b])
            vs.append(r.v[a:b])
            slots += [r.table[p // self.bs] * self.bs + p % self.bs for p in range(a, b)]
            tables.append(r.table)
            seq_lens.append(b)
            qlens.append(n)
        meta = AttentionMetadata.build(block_tables=tables, seq_lens=seq_lens, query_lens=qlens,
                                       slot_mapping=slots, block_size=self.bs)
        v = torch.cat(vs) if self.layer.has_value else None
        out = paged_attention(torch.cat(qs), torch.cat(ks), v, self.cache, self.layer, meta, layer_index=0,
                              params=LayerAttention(scale=scale))
        assert out.shape == (len(slots), Q_HEADS, self.layer.head_dim) and out.dtype == torch.float32
        res, start = {}, 0
        for name, n in plan:
            r = self.reqs[name]
            res[name] = out[start:start + n]
            r.outputs.append(res[name])
            r.cached += n
            start += n
        return res

    def stored(self, name: str, tensor: str, *, rotated: bool = False) -> torch.Tensor:
        """Dequantized ``[cached, Hkv, D]`` rows of a request, read back through read_kv (original basis by default)."""
        r = self.reqs[name]
        ids = torch.tensor(r.table)
        return read_kv(self.cache, self.layer, tensor, ids, torch.float32, rotated=rotated).flatten(0, 1)[: r.cached]

    def raw(self, name: str, tensor: str) -> torch.Tensor:
        """The stored bytes ``[cached, ...]`` of a request's rows of cache tensor ``tensor`` (codes or scales)."""
        r = self.reqs[name]
        t = self.cache[tensor]
        slots = torch.tensor([r.table[p // self.bs] * self.bs + p % self.bs for p in range(r.cached)])
        return t.view(-1, *t.shape[2:])[slots]

    def check(self, name: str, out: torch.Tensor, scale: float | None = None, *, edited: bool = False) -> None:
        """``out`` (the request's last step) against both references.

        ``edited``: the test changed stored bytes on purpose; only the tight
        comparison with the read-back values applies.
        """
        r = self.reqs[name]
        s, n = r.cached, out.shape[0]
        q = r.q[s - n:s]
        value_name = "value" if self.layer.has_value else "key"
        k_st, v_st = self.stored(name, "key"), self.stored(name, value_name)
        assert torch.isfinite(out).all(), "an unwritten (NaN) slot reached the output"
        # stored bytes are exactly the format's encoding of what was written (right slots, right scales),
        # and reading them back decodes exactly as the format does
        fmt = get_format(self.fmt)
        true_v = r.v[:s] if self.layer.has_value else r.k[:s]
        for tensor, st, x in () if edited else (("key", k_st, r.k[:s]), (value_name, v_st, true_v)):
            qx = fmt.quantize(x, kind=tensor)
            assert torch.equal(self.raw(name, tensor), qx.codes)
            if qx.scale is not None:
                assert torch.equal(self.raw(name, tensor + "_scale"), qx.scale)
            # the stored basis is element-wise (exact); the original basis goes through a matmul by R.T,
            # whose float32 rounding may depend on how many rows are decoded at once
            assert torch.equal(self.stored(name, tensor, rotated=True),
                               fmt.dequantize_rotated(qx.codes, qx.scale, torch.float32, kind=tensor))
            torch.testing.assert_close(st, fmt.dequantize(qx.codes, qx.scale, torch.float32, kind=tensor), atol=1e-6, rtol=1e-6)
            if self.fmt not in ROTATED:
                assert torch.equal(st, self.stored(name, tensor, rotated=True))
        # same values (original basis, while the op attended in the rotated one): tight
        ref_same = reference_attention(q, k_st, v_st, scale)
        torch.testing.assert_close(out.double(), ref_same, atol=1e-5, rtol=1e-5)
        if edited:
            return
        # against the unquantized K/V: loose for quantized formats
        ref_true = reference_attention(q, r.k[:s], true_v, scale)
        torch.testing.assert_close(out.double(), ref_true, atol=LOOSE[self.fmt], rtol=0)
        if self.fmt != "float32":  # the quantized path really quantized
            assert (out.double() - ref_true).abs().max() > 1e-4


FMTS = ["float32", *QUANTIZED]
GRID = [pytest.param(f, d, b, id=f"{f}-d{d}-bs{b}") for f in FMTS for d in (64, 96) for b in (16, 5)]


@pytest.mark.parametrize("fmt,head_dim,bs", GRID)
def test_single_prefill(fmt: str, head_dim: int, bs: int) -> None:
    h = Harness(fmt, head_dim, bs)
    h.add("a", 37)
    out = h.step([("a", 37)])["a"]
    h.check("a", out)
    assert h.reqs["a"].table != sorted(h.reqs["a"].table)  # shuffled, non-contiguous blocks


@pytest.mark.parametrize("fmt,head_dim,bs", GRID)
def test_varlen_batch_of_prefills(fmt: str, head_dim: int, bs: int) -> None:
    h = Harness(fmt, head_dim, bs)
    lens = {"a": 5, "b": 23, "c": 1, "d": 40, "e": 16}
    for name, n in lens.items():
        h.add(name, n)
    outs = h.step(list(lens.items()))
    for name in lens:
        h.check(name, outs[name])
    # batching does not change a request's result: rerun "b" alone in a fresh cache with the same blocks
    solo = Harness(fmt, head_dim, bs)
    r = solo.add("b", 23, table=h.reqs["b"].table)
    r.q, r.k, r.v = h.reqs["b"].q, h.reqs["b"].k, h.reqs["b"].v
    torch.testing.assert_close(solo.step([("b", 23)])["b"], outs["b"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("fmt,head_dim,bs", GRID)
def test_chunked_prefill(fmt: str, head_dim: int, bs: int) -> None:
    h = Harness(fmt, head_dim, bs)
    h.add("a", 45)
    h.add("b", 30)
    for chunk in (20, 25):  # the second chunk attends to the 20 cached tokens
        h.check("a", h.step([("a", chunk)])["a"])
    for chunk in (7, 11, 12):  # three chunks, not block aligned
        h.check("b", h.step([("b", chunk)])["b"])


@pytest.mark.parametrize("fmt,head_dim,bs", GRID)
def test_batched_decode_different_lengths(fmt: str, head_dim: int, bs: int) -> None:
    h = Harness(fmt, head_dim, bs)
    lens = {"a": 7, "b": 16, "c": 33, "d": 1}
    steps = 4
    for name, n in lens.items():
        h.add(name, n + steps)
    h.step(list(lens.items()))
    for _ in range(steps):
        outs = h.step([(name, 1) for name in lens])  # the decode-only path
        for name in lens:
            h.check(name, outs[name])


@pytest.mark.parametrize("fmt,head_dim,bs", GRID)
def test_mixed_prefill_and_decode_batch(fmt: str, head_dim: int, bs: int) -> None:
    h = Harness(fmt, head_dim, bs)
    h.add("dec", 12)
    h.add("chunked", 40)
    h.add("new", 19)
    h.step([("dec", 11), ("chunked", 17)])
    outs = h.step([("chunked", 23), ("dec", 1), ("new", 19)])
    for name in ("chunked", "dec", "new"):
        h.check(name, outs[name])


@pytest.mark.parametrize("fmt", FMTS)
def test_custom_softmax_scale(fmt: str) -> None:
    h = Harness(fmt, 64, 5)
    h.add("a", 13)
    h.add("b", 4)
    h.step([("a", 12), ("b", 3)], scale=0.3)
    outs = h.step([("a", 1), ("b", 1)], scale=0.3)
    h.check("a", outs["a"], scale=0.3)
    h.check("b", outs["b"], scale=0.3)


def test_decode_ignores_nan_in_padding_and_unwritten_slots() -> None:
    """Regression: the batched decode path multiplied masked (weight 0) NaN slots into the output.

    The padding of shorter block tables (block 0) and the unwritten tail of each
    last block are masked, but ``0 * NaN`` is NaN; they must be excluded, not
    just weighted 0. Stale NaN/inf in a reused block would otherwise poison
    another request's decode.
    """
    for fmt in FMTS:
        h = Harness(fmt, 64, 16, num_blocks=8)
        h.free = [2, 6, 5, 7, 3, 1, 4]  # block 0 is nobody's, yet it pads the short table
        h.add("short", 3)
        h.add("long", 40)
        h.step([("short", 2), ("long", 39)])
        outs = h.step([("short", 1), ("long", 1)])
        for name in ("short", "long"):
            assert torch.isfinite(outs[name]).all(), fmt
            h.check(name, outs[name])
        assert h.reqs["short"].table == [4] and 0 not in h.reqs["long"].table
        assert torch.isnan(h.cache["key" if fmt == "float32" else "key_scale"][0]).all()


# -- key-only layers -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_key_only_layer(fmt: str) -> None:
    h = Harness(fmt, 64, 5, has_value=False)
    assert "value" not in h.cache
    h.add("a", 17)
    h.add("b", 9)
    outs = h.step([("a", 10), ("b", 9)])
    h.check("a", outs["a"])
    h.check("b", outs["b"])
    outs = h.step([("a", 7)])  # chunked prefill
    h.check("a", outs["a"])
    h.add("c", 3)
    h.step([("c", 2)])
    outs = h.step([("c", 1)])  # decode
    h.check("c", outs["c"])


def test_v_presence_must_match_the_spec() -> None:
    """Regression: ``v=None`` on a layer with values wrote the keys, then failed with a bare AssertionError."""
    h = Harness("int8", 64, 5, fill=None)
    h.add("a", 4)
    r = h.reqs["a"]
    meta = AttentionMetadata.build(block_tables=[r.table], seq_lens=[4], query_lens=[4],
                                   slot_mapping=[r.table[0] * 5 + i for i in range(4)], block_size=5)
    before = {n: t.clone() for n, t in h.cache.items()}
    with pytest.raises(KVCacheLayoutError, match="layer 0"):
        paged_attention(r.q, r.k, None, h.cache, h.layer, meta, layer_index=0)
    assert all(torch.equal(before[n], t) for n, t in h.cache.items())
    ko = Harness("int8", 64, 5, has_value=False, fill=None)
    before = {n: t.clone() for n, t in ko.cache.items()}
    with pytest.raises(KVCacheLayoutError, match="layer 3"):
        paged_attention(r.q, r.k, r.v, ko.cache, ko.layer, meta, layer_index=3)
    assert all(torch.equal(before[n], t) for n, t in ko.cache.items())


# -- C02: wrong cache tensors are named before data is touched -----------------------------------


def _c02_setup(fmt: str = "int8") -> tuple[LayerSpec, dict[str, torch.Tensor], AttentionMetadata, tuple]:
    spec = CacheSpec.build(num_layers=6, num_kv_heads=KV_HEADS, head_dim=32, block_size=4, kv_cache_dtype=fmt)
    layer = spec.layer(5)
    cache = {t.name: torch.zeros((3, *t.shape), dtype=t.dtype) for t in layer.tensors}
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(3, Q_HEADS, 32, generator=g), torch.randn(3, KV_HEADS, 32, generator=g),
           torch.randn(3, KV_HEADS, 32, generator=g))
    meta = AttentionMetadata.build(block_tables=[[1]], seq_lens=[3], query_lens=[3], slot_mapping=[4, 5, 6],
                                   block_size=4)
    return layer, cache, meta, qkv


def _assert_untouched(cache: dict[str, torch.Tensor]) -> None:
    for name, t in cache.items():
        assert not t.float().any(), f"{name} was written before the error"


def test_c02_wrong_cache_dtype_is_named() -> None:
    layer, cache, meta, (q, k, v) = _c02_setup("int8")
    cache["key"] = torch.zeros(3, 4, KV_HEADS, 32, dtype=torch.bfloat16)  # bf16 where the spec says uint8
    with pytest.raises(KVCacheLayoutError) as ei:
        paged_attention(q, k, v, cache, layer, meta, layer_index=5)
    msg = str(ei.value)
    for part in ("layer 5", "'key'", "torch.uint8", "torch.bfloat16"):
        assert part in msg, (part, msg)
    _assert_untouched(cache)
    assert isinstance(ei.value, TypeError)  # also catchable as a TypeError
    # the same for an unquantized layer handed a uint8 cache
    layer, cache, meta, (q, k, v) = _c02_setup("bfloat16")
    cache["value"] = torch.zeros(3, 4, KV_HEADS, 32, dtype=torch.uint8)
    with pytest.raises(KVCacheLayoutError, match=r"layer 5: cache tensor 'value' expected dtype torch.bfloat16.*got dtype torch.uint8"):
        paged_attention(q, k, v, cache, layer, meta, layer_index=5)
    _assert_untouched(cache)


def test_c02_wrong_scale_dtype_is_named() -> None:
    layer, cache, meta, (q, k, v) = _c02_setup("fp8")
    cache["value_scale"] = torch.zeros(3, 4, KV_HEADS, dtype=torch.float32)
    with pytest.raises(KVCacheLayoutError, match=r"layer 5.*'value_scale'.*torch.float16.*torch.float32"):
        paged_attention(q, k, v, cache, layer, meta, layer_index=5)
    _assert_untouched(cache)


def test_c02_wrong_cache_shape_is_named() -> None:
    layer, cache, meta, (q, k, v) = _c02_setup("int8")
    cache["value"] = torch.zeros(3, 4, KV_HEADS, 16, dtype=torch.uint8)  # head_dim 16, spec says 32
    with pytest.raises(KVCacheLayoutError) as ei:
        paged_attention(q, k, v, cache, layer, meta, layer_index=5)
    msg = str(ei.value)
    for part in ("layer 5", "'value'", f"[num_blocks, 4, {KV_HEADS}, 32]", f"[3, 4, {KV_HEADS}, 16]"):
        assert part in msg, (part, msg)
    _assert_untouched(cache)
    # block counts that disagree between tensors
    layer, cache, meta, (q, k, v) = _c02_setup("int8")
    cache["key_scale"] = torch.zeros(2, 4, KV_HEADS, dtype=torch.float16)
    with pytest.raises(KVCacheLayoutError, match="layer 5.*'key_scale' has 2 blocks"):
        paged_attention(q, k, v, cache, layer, meta, layer_index=5)
    _assert_untouched(cache)


def test_c02_missing_scale_tensor_is_named() -> None:
    layer, cache, meta, (q, k, v) = _c02_setup("int8")
    del cache["key_scale"]
    with pytest.raises(KVCacheLayoutError) as ei:
        paged_attention(q, k, v, cache, layer, meta, layer_index=5)
    assert "layer 5" in str(ei.value) and "key_scale" in str(ei.value) and "missing" in str(ei.value)
    _assert_untouched(cache)


@pytest.mark.parametrize(
    "which,shape",
    [("k", (3, KV_HEADS, 16)), ("k", (3, KV_HEADS + 1, 32)), ("k", (3, KV_HEADS * 32)),
     ("v", (3, 1, 32)), ("q", (3, Q_HEADS, 16)), ("q", (3, 8, 32)), ("q", (2, Q_HEADS, 32))],
)
def test_c02_wrong_new_kv_shape_is_named(which: str, shape: tuple[int, ...]) -> None:
    layer, cache, meta, (q, k, v) = _c02_setup("int8")
    bad = torch.randn(shape)
    q, k, v = (bad if which == "q" else q), (bad if which == "k" else k), (bad if which == "v" else v)
    with pytest.raises(KVCacheLayoutError, match=rf"layer 5: .*{which}.*{list(shape)}".replace("[", r"\[").replace("]", r"\]")):
        paged_attention(q, k, v, cache, layer, meta, layer_index=5)
    _assert_untouched(cache)


# -- C22: every path stores and reads identically ------------------------------------------------


def _bytes(cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.contiguous().view(torch.uint8).clone() for n, t in cache.items()}


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("bs", [16, 5])
def test_c22_paths_dequantize_identically(fmt: str, bs: int) -> None:
    length = 23
    paths = {"prefill": [length], "chunked": [9, 8, 6], "chunked2": [12, 11], "decode": [1] * length}
    runs: dict[str, Harness] = {}
    base = Harness(fmt, 96, bs, seed=7)
    template = base.add("x", length + 1)
    for name, chunks in paths.items():
        h = Harness(fmt, 96, bs, seed=7)
        r = h.add("x", length + 1, table=template.table)
        r.q, r.k, r.v = template.q, template.k, template.v
        for c in chunks:
            h.step([("x", c)])
        runs[name] = h
    ref = runs["prefill"]
    ref_bytes = _bytes(ref.cache)
    ref_out = torch.cat(ref.reqs["x"].outputs)
    assert ref_out.shape[0] == length
    for name, h in runs.items():
        for t, b in _bytes(h.cache).items():  # codes and scales, byte for byte (NaN fill included)
            assert torch.equal(b, ref_bytes[t]), (name, t)
        out = torch.cat(h.reqs["x"].outputs)
        torch.testing.assert_close(out, ref_out, atol=3e-6, rtol=0, msg=lambda m: f"{name}: {m}")
        h.check("x", h.reqs["x"].outputs[-1])

    # the decode step of a 24th token, on copies of the cache with one stored scale changed
    def next_token(h: Harness, edit: tuple[str, int, float] | None) -> torch.Tensor:
        h2 = Harness(fmt, 96, bs, seed=7)
        h2.cache = {n: t.clone() for n, t in h.cache.items()}
        r = h2.add("x", length + 1, table=template.table)
        r.q, r.k, r.v, r.cached = template.q, template.k, template.v, length
        if edit is not None:
            tensor, pos, factor = edit
            slot = r.table[pos // bs] * bs + pos % bs
            h2.cache[tensor].view(-1, KV_HEADS)[slot, 1] *= factor
        out = h2.step([("x", 1)])["x"]
        h2.check("x", out, edited=edit is not None)  # the op read the edited scale: it matches attention over the read-back values
        return out

    plain = next_token(ref, None)
    for name, h in runs.items():
        torch.testing.assert_close(next_token(h, None), plain, atol=3e-6, rtol=0)
    k_changed = next_token(ref, ("key_scale", 3, 0.25))
    v_changed = next_token(ref, ("value_scale", 7, 0.5))
    assert (k_changed - plain).abs().max() > 1e-3
    assert (v_changed - plain).abs().max() > 1e-3
    # only the heads served by kv head 1 (query heads 3, 4, 5) change
    for changed in (k_changed, v_changed):
        assert torch.equal(changed[:, :3], plain[:, :3]) and torch.equal(changed[:, 6:], plain[:, 6:])


# -- write_kv / read_kv / metadata ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", *QUANTIZED])
def test_write_kv_puts_rows_at_their_slots(fmt: str) -> None:
    spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=8, block_size=3, kv_cache_dtype=fmt)
    layer = spec.layer(0)
    cache = CacheController(spec).initialize_kv_cache(4)[0]
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    slots = [10, 0, 5, 7]  # block 3 off 1, block 0 off 0, block 1 off 2, block 2 off 1
    write_kv(cache, layer, k, v, torch.tensor(slots))
    fmt_ = get_format(fmt)
    for name, x in (("key", k), ("value", v)):
        qx = fmt_.quantize(x, kind=name)
        for i, s in enumerate(slots):
            blk, off = divmod(s, 3)
            assert torch.equal(cache[name][blk, off], qx.codes[i])
            if qx.scale is not None:
                assert torch.equal(cache[name + "_scale"][blk, off], qx.scale[i])
        back = read_kv(cache, layer, name, torch.tensor([[3, 0], [1, 2]]), torch.float32)
        assert back.shape == (2, 2, 3, 2, 8)
        scale0 = qx.scale[0] if qx.scale is not None else None
        torch.testing.assert_close(back[0, 0, 1], fmt_.dequantize(qx.codes[0], scale0, torch.float32, kind=name))
        # rotated=True: the stored basis, x @ R for the rotated formats, x itself for the others
        rot = read_kv(cache, layer, name, torch.tensor([[3, 0], [1, 2]]), torch.float32, rotated=True)
        assert rot.shape == back.shape
        assert torch.equal(rot[0, 0, 1], fmt_.dequantize_rotated(qx.codes[0], scale0, torch.float32, kind=name))
        r = fmt_.rotation(8, torch.float32, "cpu")
        if fmt in ROTATED:
            assert r is not None
            torch.testing.assert_close(rot, back @ r, atol=1e-6, rtol=1e-6)
            assert (rot - back).abs().max() > 0.1  # really a different basis
        else:
            assert r is None and torch.equal(rot, back)
    written = set(slots)
    for s in range(12):  # every other slot is still zero
        if s not in written:
            blk, off = divmod(s, 3)
            assert not cache["key"][blk, off].float().any()


def test_metadata_build_and_errors() -> None:
    m = AttentionMetadata.build(block_tables=[[4, 2, 9], [1]], seq_lens=[7, 2], query_lens=[3, 1],
                                slot_mapping=[10, 11, 36, 5], block_size=4)
    assert m.query_start_loc == (0, 3, 4) and m.seq_lens == (7, 2) and m.query_lens == (3, 1)
    assert m.block_tables.tolist() == [[4, 2], [1, 0]]  # only the blocks the context needs, padded with 0
    assert m.num_requests == 2 and not m.is_decode_only
    assert AttentionMetadata.build(block_tables=[[1], [2]], seq_lens=[3, 1], query_lens=[1, 1],
                                   slot_mapping=[6, 8], block_size=4).is_decode_only
    with pytest.raises(ValueError, match="one entry per request"):
        AttentionMetadata.build(block_tables=[[1]], seq_lens=[1, 2], query_lens=[1], slot_mapping=[0], block_size=4)
    with pytest.raises(ValueError, match="query length"):
        AttentionMetadata.build(block_tables=[[1]], seq_lens=[2], query_lens=[3], slot_mapping=[0, 1, 2], block_size=4)
    with pytest.raises(ValueError, match="query length"):
        AttentionMetadata.build(block_tables=[[1]], seq_lens=[2], query_lens=[0], slot_mapping=[], block_size=4)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build(block_tables=[[1]], seq_lens=[5], query_lens=[5], slot_mapping=list(range(5)), block_size=4)
    with pytest.raises(ValueError, match="slot_mapping"):
        AttentionMetadata.build(block_tables=[[1]], seq_lens=[2], query_lens=[2], slot_mapping=[4], block_size=4)
