"""Fork and copy-on-write in the KV cache (issue 16 item 2), with the tensors they move (case C28).

A fork shares a request's blocks by reference; whoever first writes into a shared partial block gets a copy of
the whole block (K, V, every scale, main and draft layers) booked by the ``KVCache``, handed to the worker in the
step's plan (``KVCache.step_plan().copies``) and applied to the tensors by ``CacheController.copy_blocks`` before
the write. Checked: exact block accounting and every block freed exactly
once whatever the order of freeing; the parent's bytes untouched by a child's writes; K and V kept apart (and
their scales with them) by the copy, a swap to the host tier and back, and a disk-store round trip.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.requests import KVRequest
from kvpage.cache.tiers.stores import DiskStore
from kvpage.cache.tiers.stores.blocks import gather_blocks, scatter_blocks
from kvpage.spec import CacheSpec

BS = 4


def _fill(ctrl: CacheController, block: int, seed: int) -> None:
    """Distinct random bytes in every tensor of ``block`` (K and V never equal; scales included)."""
    gen = torch.Generator().manual_seed(seed)
    for cache in ctrl.device_caches.values():
        for name, t in cache.items():
            raw = t[block].view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
            if t.dtype.is_floating_point:  # no NaN/inf patterns in float tensors: small finite values
                t[block].copy_(torch.randn(t[block].shape, generator=gen).to(t.dtype))


def _bytes(ctrl: CacheController, block: int) -> dict[tuple[int, str], bytes]:
    """Every tensor of ``block`` (every layer, main and draft), as raw bytes."""
    return {(i, n): t[block].contiguous().view(torch.uint8).numpy().tobytes()
            for i, c in ctrl.device_caches.items() for n, t in c.items()}


def _check(m: KVCache) -> None:
    st = m.stats()
    assert st.num_free + st.num_evictable + st.num_in_use == m.num_blocks
    m.pool.validate()


def _needs_copy(m: KVCache, rid: str, n: int) -> bool:
    """Whether the request's next write of ``n`` tokens (after its reserved slots) copies a shared block first."""
    return m._needs_copy(rid, m.block_table(rid).num_tokens + n)


def _apply_copies(m: KVCache, ctrl: CacheController) -> tuple[tuple[int, int], ...]:
    """End the scheduling pass: the step plan's copy-on-write pairs, applied to the tensors as the worker does."""
    plan = m.step_plan()
    assert plan.window_copies == ()  # no window layers here
    if plan.copies:
        ctrl.copy_blocks(plan.copies, plan.window_copies)
    return plan.copies


def _setup(fmt: str = "int8") -> tuple[KVCache, CacheController, CacheSpec]:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, kv_cache_dtype=fmt,
                           num_draft_layers=1)
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(12)
    ctrl.initialize_draft_kv_cache(12)
    return KVCache(12, BS), ctrl, spec


@pytest.mark.parametrize("order", list(itertools.permutations(["parent", "a", "b"])))
def test_fork_from_a_two_block_parent_frees_every_block_once(order: tuple[str, ...]) -> None:
    m, ctrl, _ = _setup()
    parent = KVRequest("parent", list(range(6)))
    m.allocate(parent, 6)                       # blocks: one full, one with 2 of 4 slots
    p_ids = m.block_ids("parent")
    for b in p_ids:
        _fill(ctrl, b, seed=b)
    before = {b: _bytes(ctrl, b) for b in p_ids}
    m.cache(parent, 6)                          # the full block is indexed
    _check(m)
    kids = {name: KVRequest(name, list(range(6)) + [100 + i]) for i, name in enumerate("ab")}
    for kid in kids.values():
        assert m.fork(parent, kid, 6)
        assert m.block_ids(kid.request_id) == p_ids and m.block_table(kid.request_id).num_tokens == 6
        _check(m)
    assert [m.pool.ref_count(b) for b in p_ids] == [3, 3] and m.stats().num_in_use == 2  # no block taken
    # child a writes its 7th token: its partial block is shared, so it is copied first
    assert _needs_copy(m, "a", 1)
    m.allocate(kids["a"], 1)
    copy_a = m.block_ids("a")[1]
    assert copy_a not in p_ids and m.pool.ref_count(p_ids[1]) == 3  # (held by the pending copy)
    assert _apply_copies(m, ctrl) == ((p_ids[1], copy_a),)  # the one booked copy, in the step plan
    assert m.pool.ref_count(p_ids[1]) == 2
    assert _bytes(ctrl, copy_a) == before[p_ids[1]]    # the whole block copied, every tensor
    _fill(ctrl, copy_a, seed=99)                       # the child writes into its copy
    assert {b: _bytes(ctrl, b) for b in p_ids} == before  # the parent's bytes are unchanged
    _check(m)
    # the parent and child b still share the partial block; the parent writes next: it copies too
    m.allocate(parent, 1)
    assert m.block_ids("parent")[1] != p_ids[1]
    assert _apply_copies(m, ctrl) == ((p_ids[1], m.block_ids("parent")[1]),)
    assert m.block_ids("b") == p_ids and m.pool.ref_count(p_ids[1]) == 1
    assert not _needs_copy(m, "b", 1)                  # b is its only holder now: it writes in place
    _check(m)
    held = {"parent": parent, **kids}
    for name in order:
        assert m.free(held[name])
        _check(m)
        assert not m.free(held[name])                  # a second free is a no-op
    assert m.stats().num_in_use == 0
    assert m.stats().num_evictable == 1                 # the indexed full block, cached once
    m.reset_prefix_cache()
    assert m.stats().num_free == m.num_blocks
    _check(m)


def test_fork_at_a_block_boundary_copies_nothing_and_shares_indexed_blocks() -> None:
    m, _, _ = _setup()
    parent = KVRequest("p", list(range(9)))
    m.allocate(parent, 9)
    m.cache(parent, 9)
    child = KVRequest("c", list(range(8)) + [50, 51])
    assert m.fork(parent, child, 8)
    assert not _needs_copy(m, "c", 2)
    m.allocate(child, 2)
    assert m.step_plan().copies == () and m.block_ids("c")[:2] == m.block_ids("p")[:2]
    assert m.cache(child, 10) == 0              # its shared blocks are indexed already: passed over
    for r in (parent, child):
        m.free(r)
    _check(m)
    assert m.stats().num_in_use == 0


def test_a_parent_with_slots_past_the_fork_hands_the_child_its_copy_at_once() -> None:
    m, ctrl, _ = _setup()
    parent = KVRequest("p", list(range(7)))
    m.allocate(parent, 7)
    child = KVRequest("c", list(range(5)) + [9])
    assert m.fork(parent, child, 5)                    # the parent will write positions 5, 6 there without asking
    assert m.block_ids("c")[1] != m.block_ids("p")[1]
    assert _apply_copies(m, ctrl) == ((m.block_ids("p")[1], m.block_ids("c")[1]),)
    assert m.pool.ref_count(m.block_ids("p")[1]) == 1
    with pytest.raises(ValueError, match="cannot fork 8 tokens"):
        m.fork(parent, KVRequest("x", list(range(9))), 8)
    with pytest.raises(ValueError, match="already holds blocks"):
        m.fork(parent, child, 4)
    for r in (parent, child):
        m.free(r)
    _check(m)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "fp8_per_token_head"])
def test_c28_fork_swap_tier_and_copy_on_write_keep_k_and_v_apart(fmt: str, tmp_path: Path) -> None:
    """Case C28: K and V (and their scales) hold distinct patterns; a copy-on-write, a swap out and in and a disk
    round trip each move them byte for byte into the same roles."""
    m, ctrl, spec = _setup(fmt)
    ctrl.initialize_host_cache(4)
    parent = KVRequest("p", list(range(6)))
    m.allocate(parent, 6)
    src = m.block_ids("p")[1]
    gen = torch.Generator().manual_seed(3)
    for cache in ctrl.device_caches.values():   # K all 0x11-ish, V all 0xEE-ish patterns, scales random
        for name, t in cache.items():
            raw = t[src].view(torch.uint8)
            pattern = 0x11 if name.startswith("key") else 0x6E
            raw.copy_(torch.full_like(raw, pattern) ^ torch.randint(0, 2, raw.shape, generator=gen, dtype=torch.uint8))
    want = _bytes(ctrl, src)
    child = KVRequest("c", list(range(6)) + [7])
    assert m.fork(parent, child, 6)
    m.allocate(child, 1)
    dst = m.block_ids("c")[1]
    assert _apply_copies(m, ctrl) == ((src, dst),)                            # copy-on-write
    assert _bytes(ctrl, dst) == want
    ctrl.swap_out([dst], [2])                                                 # swap out ...
    ctrl.swap_in([2], [11])                                                   # ... and into another block
    assert _bytes(ctrl, 11) == want
    disk = DiskStore(tmp_path / "kv", spec)                                   # a tier round trip
    [block] = gather_blocks(ctrl.device_caches, spec, [11])
    key = disk.key(b"\x01" * 32)
    disk.put([(key, block)])
    [back] = disk.get([key])
    assert back is not None
    scatter_blocks(ctrl.device_caches, spec, [10], [back])
    assert _bytes(ctrl, 10) == want
    for (layer, name), t in want.items():                                     # K and V really differ
        if name == "key":
            assert t != want[(layer, "value")]


def test_fork_of_a_request_chained_onto_an_indexed_twin_keeps_the_twin_in_use() -> None:
    """Regression (found by the state machine): a parent whose first block duplicates an indexed block chains its
    next block onto that twin; a child sharing the next block must reference the twin too, or freeing the parent
    makes the twin evictable under a cached child still in use."""
    m = KVCache(8, 2)
    first = KVRequest("first", [0, 1, 5])
    m.allocate(first, 3)
    m.cache(first, 3)                         # block [0, 1] indexed
    parent = KVRequest("parent", [0, 1, 0, 0])
    m.allocate(parent, 4)                      # computed alongside: its [0, 1] block is a duplicate
    m.cache(parent, 4)
    twin = m.block_ids("first")[0]
    assert m._tables["parent"].anchors == [twin]
    m.free(first)
    child = KVRequest("child", [0, 1, 0, 0, 7])
    assert m.fork(parent, child, 4)
    assert m.pool.ref_count(twin) == 2               # the parent's anchor and the child's
    m.free(parent)
    _check(m)
    m.free(child)
    _check(m)
    assert m.stats().num_in_use == 0


def test_fork_before_a_duplicate_takes_no_twin_it_cannot_hold() -> None:
    """Regression (state machine): a child forked before the parent's duplicate block must not reference that
    block's twin, whose chain parent it does not hold (freeing the parent would leave the twin in use under an
    evictable parent)."""
    m = KVCache(7, 2)
    first = KVRequest("first", [0, 1, 2, 0])
    m.allocate(first, 4)
    m.cache(first, 4)
    m.free(first)
    parent = KVRequest("parent", [0, 1, 2, 0])
    match = m.match(parent)
    m.allocate(parent, 2, match)
    m.cache(parent, 4)                        # its [2, 0] block duplicates first's: chained onto the twin
    assert len(m._tables["parent"].anchors) == 1
    for n in (0, 2):
        child = KVRequest(f"child{n}", [0, 1, 2, 0][:n] + [9])
        assert m.fork(parent, child, n)
        assert m._tables[child.request_id].anchors == []  # the shared part holds no duplicate
    m.free(parent)
    _check(m)
    for n in (0, 2):
        m.free(f"child{n}")
        _check(m)
    assert m.stats().num_in_use == 0


def test_a_request_freed_before_its_copy_ran_drops_it() -> None:
    """Regression (schemathesis, n=128): a child preempted or aborted in the scheduling pass that booked its copy
    gave its destination back; another copy may take the same block. The dropped copy must not run (two copies
    into one block) and its source's pending reference must go."""
    m, ctrl, _ = _setup()
    parent = KVRequest("p", list(range(6)))
    m.allocate(parent, 6)
    a, b = KVRequest("a", list(range(6)) + [1]), KVRequest("b", list(range(6)) + [2])
    assert m.fork(parent, a, 6)
    assert m.fork(parent, b, 6)
    m.allocate(a, 1)                           # a books a copy into a fresh block ...
    dst_a = m.block_ids("a")[1]
    m.free(a)                                        # ... and is preempted in the same pass
    m.allocate(b, 1)                           # b's copy may take the same block
    applied = list(m.step_plan().copies)             # what the worker is told to copy
    assert len(applied) == 1
    assert [d for _, d in applied] == [m.block_ids("b")[1]]
    assert dst_a not in m.block_ids("b") or applied[0][1] == dst_a  # the one copy into that block is b's
    for r in (parent, b):
        m.free(r)
    _check(m)
    assert m.stats().num_in_use == 0
