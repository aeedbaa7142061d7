"""KVCache: the scheduler's interface; cases C13-C18 and C20 plus collisions, preemption, stats, events."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpage.cache.block_table import BlockTable
from kvpage.cache.hashing import hash_block_chain
from kvpage.cache.kv_cache import KVCache, PrefixMatch
from kvpage.cache.prefix_cache import BlockRemoved, BlockStored
from kvpage.cache.requests import KVCacheBlocks, KVRequest, MatchResult, SupportsKVCache

SRC = Path(__file__).resolve().parents[1] / "src"


def check(m: KVCache) -> None:
    """The cache's accounting invariant (no side groups here: no side blocks) and every pool invariant."""
    st = m.stats()
    assert st.num_side == 0
    assert st.num_free + st.num_evictable + st.num_in_use == m.num_blocks
    assert 0.0 <= st.usage <= 1.0
    m.pool.validate()


def admit(m: KVCache, req: KVRequest, chunk: int | None = None) -> tuple[MatchResult, KVCacheBlocks]:
    """match -> allocate for the rest of the prompt (or ``chunk`` tokens) -> forward -> cache; returns the device
    match (no tiers here: the match has no external part)."""
    pm = m.match(req)
    assert not pm.loads and pm.num_computed_tokens == pm.num_cached_tokens
    match = pm.device
    n = len(req.all_token_ids) - match.num_cached_tokens if chunk is None else chunk
    blocks = m.allocate(req, n, pm)
    assert blocks is not None
    m.cache(req, blocks.num_tokens)
    check(m)
    return match, blocks


def decode(m: KVCache, req: KVRequest, token: int) -> KVCacheBlocks:
    """One decode step: the sampled token joins the request, gets a slot, its KV is written."""
    req.all_token_ids.append(token)
    blocks = m.allocate(req, 1)
    assert blocks is not None
    m.cache(req, len(req.all_token_ids))
    check(m)
    return blocks


def stored_removed_alternate(events: list) -> None:
    """Per (block id, hash): stored, removed, stored, ... — never 'stored' twice or 'removed' first."""
    state: dict[tuple[int, bytes], str] = {}
    for e in events:
        k = (e.block_id, e.block_hash)
        if isinstance(e, BlockStored):
            assert state.get(k) != "stored", f"block {e.block_id} stored twice without a removal"
            state[k] = "stored"
        else:
            assert state.get(k) == "stored", f"block {e.block_id} removed while not stored"
            state[k] = "removed"


# -- cases ---------------------------------------------------------------------------------------

_CHILD = """
import sys
sys.path.insert(0, {src!r})
from kvpage.cache.hashing import hash_block_chain
chain = hash_block_chain(list(range(1000, 1064)), 16, cache_salt="tenant-a", extra_keys=("lora-x", b"img", 3))
print(hash("tenant-a"), *[h.hex() for h in chain])
"""


def test_c13_hash_stable_across_processes_and_salted_tenants_never_share() -> None:
    outs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run(
            [sys.executable, "-c", _CHILD.format(src=str(SRC))], env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.split())
    (py_hash_0, *chain_0), (py_hash_1, *chain_1) = outs
    assert py_hash_0 != py_hash_1, "the two processes should really have different str hashes"
    assert chain_0 == chain_1 and len(chain_0) == 4
    here = hash_block_chain(list(range(1000, 1064)), 16, cache_salt="tenant-a", extra_keys=("lora-x", b"img", 3))
    assert chain_0 == [h.hex() for h in here]

    # tenants: identical prompts, different salts -> no shared block, no hit
    m = KVCache(16, 4)
    prompt = list(range(20))
    alice = KVRequest("alice-1", list(prompt), cache_salt="alice")
    _, a_blocks = admit(m, alice)
    bob = KVRequest("bob-1", list(prompt), cache_salt="bob")
    assert m.match(bob) == PrefixMatch()
    _, b_blocks = admit(m, bob)
    assert not set(a_blocks.block_ids) & set(b_blocks.block_ids)
    assert m.pool.num_cached == 10  # 5 full blocks each, none shared
    nosalt = KVRequest("anon", list(prompt))
    assert m.match(nosalt).num_cached_tokens == 0
    alice2 = KVRequest("alice-2", list(prompt), cache_salt="alice")
    assert m.match(alice2) == PrefixMatch(MatchResult(a_blocks.block_ids[:4], 16))  # the same tenant hits (len-1 cap)
    bob2 = KVRequest("bob-2", list(prompt), cache_salt="bob")
    assert m.match(bob2) == PrefixMatch(MatchResult(b_blocks.block_ids[:4], 16))


def test_c14_changed_tokens_change_the_hash_and_miss() -> None:
    base = list(range(100, 116))
    changed = list(base)
    changed[3] += 31
    changed[4] -= 1
    assert hash_block_chain(base, 16) != hash_block_chain(changed, 16)
    m = KVCache(8, 16)
    admit(m, KVRequest("a", base + [7]))
    assert m.match(KVRequest("same", base + [9])).num_cached_tokens == 16
    assert m.match(KVRequest("b", changed + [7])) == PrefixMatch()
    # swapping two tokens, or shifting one token's change onto another, also misses
    swapped = list(base)
    swapped[3], swapped[4] = swapped[4], swapped[3]
    assert m.match(KVRequest("c", swapped + [7])) == PrefixMatch()
    assert m.match(KVRequest("d", base[:15] + [base[15] + 1, 7])) == PrefixMatch()


def test_c15_only_full_blocks_are_hashed_once_and_no_stored_after_removed() -> None:
    m = KVCache(8, 16, enable_events=True)
    req = KVRequest("r", list(range(500, 524)))  # 24 tokens: one full block + 8
    admit(m, req)
    assert len(req.block_hashes) == 1 and m.pool.num_cached == 1
    ev = list(m.drain_events())
    assert [type(e) for e in ev] == [BlockStored] and ev[0].token_ids == tuple(range(500, 516))
    history = list(ev)
    for i in range(8):
        decode(m, req, 9000 + i)
        full = len(req.all_token_ids) // 16
        assert len(req.block_hashes) == full  # a partial block never gets a key
        assert m.pool.num_cached == full
        new = list(m.drain_events())
        history += new
        if len(req.all_token_ids) < 32:
            assert new == []
        else:  # the 8th decode token fills block 1: hashed and stored exactly once
            assert len(new) == 1 and new[0].block_id == m.block_ids("r")[1]
            assert new[0].token_ids == tuple(range(516, 524)) + tuple(range(9000, 9008))
            assert new[0].parent_block_hash == ev[0].block_hash
    # more caching calls for the same tokens store nothing again
    assert m.cache(req, 32) == 0 and list(m.drain_events()) == []
    m.free(req)
    assert m.reset_prefix_cache() == 2
    removed = list(m.drain_events())
    assert sorted(type(e).__name__ for e in removed) == ["BlockRemoved", "BlockRemoved"]
    # the same prompt again: new writes may store again, but nothing is stored without a write
    again = KVRequest("r2", list(range(500, 524)))
    match, _ = admit(m, again)
    assert match.num_cached_tokens == 0
    history += removed + list(m.drain_events())
    stored_removed_alternate(history)
    assert m.stats().blocks_stored == 3


def test_c16_sequential_finished_requests_leave_nothing_in_use() -> None:
    m = KVCache(10, 4)
    max_usage = 0.0
    for i in range(5):
        req = KVRequest(f"r{i}", [i * 100 + t for t in range(12)])  # 3 blocks, distinct prompts
        _, blocks = admit(m, req)
        assert len(blocks.block_ids) == 3
        max_usage = max(max_usage, m.stats().usage)
        m.free(req)
        check(m)
        assert m.stats().num_in_use == 0 and m.stats().usage == 0.0
        assert m.stats().num_evictable == min(3 * (i + 1), 10 - m.stats().num_free)
    assert max_usage == pytest.approx(0.3)
    st = m.stats()
    # r0..r2 filled 9 blocks (all cached, all evictable), r3 and r4 reused 1 free + 5 evicted ones
    assert (st.num_free, st.num_evictable, st.num_in_use, st.evictions) == (0, 10, 0, 5)
    # a request needing the whole pool fits: everything evictable is reclaimable
    big = KVRequest("big", list(range(10_000, 10_040)))
    _, blocks = admit(m, big)
    assert len(blocks.block_ids) == 10 and m.stats().usage == 1.0
    assert m.allocate(big, 1) is None  # 41st token: no block left, nothing changes
    check(m)
    m.free(big)
    assert m.stats().num_in_use == 0


@pytest.mark.parametrize("first", ["a", "b"])
@pytest.mark.parametrize("concurrent", [False, True], ids=["sequential", "concurrent"])
def test_c17_shared_prefix_freed_in_either_order_returns_each_block_once(first: str, concurrent: bool) -> None:
    m = KVCache(8, 4, enable_events=True)
    prefix = list(range(8))  # 2 blocks
    a = KVRequest("a", prefix + [50, 51, 52])
    b = KVRequest("b", prefix + [60, 61, 62, 63, 64])
    if concurrent:  # both prefill the prefix before either caches: b holds duplicates
        ma, mb = m.match(a), m.match(b)
        assert ma == mb == PrefixMatch()
        assert m.allocate(a, 11, ma) is not None and m.allocate(b, 13, mb) is not None
        assert m.cache(a, 11) == 2
        assert m.cache(b, 13) == 1  # its prefix copies are not indexed, its 3rd block is
        assert m.pool.num_cached == 3
    else:
        admit(m, a)
        match, _ = admit(m, b)
        assert match.num_cached_tokens == 8 and match.block_ids == m.block_ids("a")[:2]
    check(m)
    order = [a, b] if first == "a" else [b, a]
    for req in order:
        assert m.free(req)
        check(m)
    assert m.stats().num_in_use == 0
    stored = [e for e in m.drain_events() if isinstance(e, BlockStored)]
    m.reset_prefix_cache()
    removed = [e for e in m.drain_events() if isinstance(e, BlockRemoved)]
    free = m.pool._ids.free_ids()
    assert len(free) == len(set(free)) == 8  # every block once
    assert sorted((e.block_id, e.block_hash) for e in removed) == sorted((e.block_id, e.block_hash) for e in stored)
    assert m.stats().evictions == len(stored) == 3
    assert not m.free(a) and not m.free(b)  # a second free is a no-op, never a double free
    check(m)


def test_c18_blocks_still_being_prefilled_are_not_matched() -> None:
    m = KVCache(16, 16)
    prompt = list(range(3000, 3050))  # 50 tokens: 3 full blocks + 2
    a = KVRequest("a", list(prompt))
    assert m.allocate(a, 50, m.match(a)) is not None  # slots reserved, nothing written yet
    b = KVRequest("b", list(prompt))
    assert m.match(b) == PrefixMatch()  # a's blocks are allocated, not written
    assert m.pool.num_cached == 0
    m.cache(a, 16)  # chunked prefill: the first chunk's KV is written
    assert m.match(b) == PrefixMatch(MatchResult(m.block_ids("a")[:1], 16))
    m.cache(a, 40)  # block 2 is only half written
    assert m.match(b).num_cached_tokens == 32
    m.cache(a, 50)
    assert m.match(b) == PrefixMatch(MatchResult(m.block_ids("a")[:3], 48))
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.cache(a, 51)  # more than the reserved slots / known tokens
    # abort before any KV is written: nothing is indexed, nothing stays in use
    c = KVRequest("c", list(range(7000, 7040)))
    assert m.allocate(c, 40, m.match(c)) is not None
    m.free(c)
    assert m.match(KVRequest("c2", list(range(7000, 7040)))) == PrefixMatch()
    m.free(a)
    assert m.stats().num_in_use == 0
    check(m)


def test_c20_allocate_zero_returns_no_blocks_and_negative_is_an_error() -> None:
    m = KVCache(4, 4)
    req = KVRequest("r", [1, 2, 3])
    assert m.can_allocate(req, 0)
    assert m.allocate(req, 0) == KVCacheBlocks((), (), 0)
    assert (m.stats().num_free, m.stats().num_in_use) == (4, 0)
    for bad in (-1, -7):
        with pytest.raises(ValueError, match="num_new_tokens"):
            m.allocate(req, bad)
        with pytest.raises(ValueError, match="num_new_tokens"):
            m.can_allocate(req, bad)
        with pytest.raises(ValueError, match="num_new_tokens"):
            m.allocate(KVRequest("new", [1]), bad)
    assert not m.has_request("new")
    assert m.allocate(req, 3) == KVCacheBlocks((0,), (0,), 3)
    assert m.allocate(req, 0) == KVCacheBlocks((0,), (), 3)
    assert m.pool.allocate(0) == []
    with pytest.raises(ValueError):
        m.pool.allocate(-1)
    with pytest.raises(ValueError):
        m.blocks_for(-1)
    check(m)


# -- collisions ----------------------------------------------------------------------------------


def test_forced_collision_constant_hash_never_returns_foreign_blocks() -> None:
    m = KVCache(12, 4, hash_fn=lambda parent, toks, extra: b"\x00" * 32)
    p1 = KVRequest("p1", list(range(13)))
    admit(m, p1)
    assert m.pool.num_cached == 1  # every hash collides: only the first block can be indexed
    other = KVRequest("p2", [99] + list(range(1, 13)))  # block 0 differs
    assert m.match(other) == PrefixMatch()
    _, blocks = admit(m, other)  # its block 0 collides: nothing of it is indexed
    assert m.pool.num_cached == 1 and m.pool.block_hash(blocks.block_ids[0]) is None
    # the real owner still hits, and only with its own block
    again = KVRequest("p1b", list(range(13)))
    assert m.match(again) == PrefixMatch(MatchResult(m.block_ids("p1")[:1], 4))
    for r in (p1, other):
        m.free(r)
    assert m.stats().num_in_use == 0
    check(m)


def test_forced_collision_parent_ignoring_hash_checks_the_parent_block() -> None:
    """A hash of a block's own tokens only (no chaining): [A, B] and [C, B] collide on block 1."""
    m = KVCache(12, 2, hash_fn=lambda parent, toks, extra: hashlib.sha256(bytes(toks)).digest())
    x = KVRequest("x", [1, 1, 7, 7, 0])  # blocks A=[1,1], B=[7,7]
    z = KVRequest("z", [2, 2, 7, 7, 0])  # blocks C=[2,2], B=[7,7]
    admit(m, x)
    admit(m, z)  # z's block 1 collides with x's: not indexed, chain stopped
    assert m.pool.num_cached == 3
    w = KVRequest("w", [2, 2, 7, 7, 5])
    match = m.match(w)
    # block 0 hits z's block; block 1's hash points at x's block (parent A), which must not be returned
    assert match == PrefixMatch(MatchResult(m.block_ids("z")[:1], 2))
    assert m.block_ids("x")[1] not in match.block_ids


def test_forced_collision_salt_ignoring_hash_still_isolates_tenants() -> None:
    m = KVCache(8, 2, hash_fn=lambda parent, toks, extra: hashlib.sha256(bytes(toks)).digest())
    admit(m, KVRequest("a", [1, 2, 3, 4, 5], cache_salt="alice"))
    assert m.match(KVRequest("b", [1, 2, 3, 4, 5], cache_salt="bob")) == PrefixMatch()
    assert m.match(KVRequest("a2", [1, 2, 3, 4, 5], cache_salt="alice")).num_cached_tokens == 4
    assert m.match(KVRequest("l", [1, 2, 3, 4, 5], cache_salt="alice", extra_keys=("lora",))) == PrefixMatch()


# -- behaviour -----------------------------------------------------------------------------------


def test_concurrent_duplicates_chain_onto_the_indexed_block() -> None:
    m = KVCache(16, 4, enable_events=True)
    shared = list(range(8))
    a = KVRequest("a", shared + [10, 11, 12, 13, 14])
    b = KVRequest("b", shared + [20, 21, 22, 23, 24])
    for r in (a, b):
        assert m.allocate(r, 13, m.match(r)) is not None
    assert m.cache(a, 13) == 3
    assert m.cache(b, 13) == 1  # b's tail block, chained onto a's prefix blocks
    ids_a, ids_b = m.block_ids("a"), m.block_ids("b")
    assert m.pool.block_key(ids_b[2])[0] == ids_a[1]
    assert [m.pool.ref_count(x) for x in ids_a[:2]] == [2, 2]  # b references a's copies too
    d = KVRequest("d", shared + [20, 21, 22, 23, 99])
    assert m.match(d) == PrefixMatch(MatchResult((ids_a[0], ids_a[1], ids_b[2]), 12))
    m.free(a)
    check(m)
    assert m.pool.ref_count(ids_a[0]) == 1  # still held by b
    m.free(b)
    check(m)
    assert m.stats().num_in_use == 0 and m.stats().num_evictable == 4
    stored_removed_alternate(list(m.drain_events()))


def test_allocate_is_atomic_and_does_not_count_matched_blocks_as_available() -> None:
    m = KVCache(4, 2)
    a = KVRequest("a", [1, 2, 3, 4, 5])
    admit(m, a)  # blocks 0,1 (cached), 2 (partial)
    m.free(a)
    assert (m.stats().num_free, m.stats().num_evictable) == (2, 2)
    b = KVRequest("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 5 blocks: 2 matched + 3 new > 2 free + 0 other
    match = m.match(b)
    assert match.num_cached_tokens == 4
    assert not m.can_allocate(b, 5, match)
    snap = (m.stats().num_free, m.stats().num_evictable, list(m.pool._idle), m.stats())
    assert m.allocate(b, 5, match) is None
    assert (m.stats().num_free, m.stats().num_evictable, list(m.pool._idle), m.stats()) == snap
    assert not m.has_request("b")
    c = KVRequest("c", [1, 2, 3, 4, 5, 6, 7, 8])  # 2 matched + 2 new: fits exactly
    match = m.match(c)
    assert m.can_allocate(c, 4, match)
    blocks = m.allocate(c, 4, match)
    assert blocks is not None and blocks.block_ids[:2] == match.block_ids and len(blocks.new_block_ids) == 2
    assert m.stats().usage == 1.0 and m.stats().evictions == 0
    check(m)


def test_stale_match_is_refused() -> None:
    m = KVCache(3, 2)
    a = KVRequest("a", [1, 2, 3, 4, 5])
    admit(m, a)
    m.free(a)
    b = KVRequest("b", [1, 2, 3, 4, 9])
    match = m.match(b)
    assert match.num_cached_tokens == 4
    hog = KVRequest("hog", list(range(100, 106)))
    assert m.allocate(hog, 6) is not None  # evicts a's cached blocks
    with pytest.raises(ValueError, match="stale match"):
        m.allocate(b, 1, match)
    assert not m.has_request("b")
    with pytest.raises(ValueError, match="already holds"):
        m.allocate(hog, 1, MatchResult((0,), 2))
    with pytest.raises(ValueError, match="len\\(match.block_ids\\)"):
        m.allocate(b, 1, MatchResult((0,), 3))
    check(m)


def test_preemption_keeps_prefix_hits_and_is_counted() -> None:
    m = KVCache(10, 4)
    req = KVRequest("r", list(range(10)))
    admit(m, req)
    for t in range(6):
        decode(m, req, 50 + t)  # 16 tokens: 4 full blocks, all cached
    table = m.block_ids("r")
    assert m.preempt(req) and m.stats().num_in_use == 0
    assert not m.preempt(req)  # not running any more
    st = m.stats()
    assert st.preemptions == 1
    # recompute: the prefix cache re-hits its own blocks (at most len-1 tokens)
    match, blocks = admit(m, req)
    assert match == MatchResult(table[:3], 12)
    assert blocks.block_ids[:3] == table[:3] and blocks.num_tokens == 16
    st2 = m.stats()
    assert (st2.requests, st2.prefix_queries, st2.prefix_hits) == (2, 10 + 16, 12)
    assert st2.hit_rate == pytest.approx(12 / 26)
    m.free(req)
    assert m.stats().num_in_use == 0


def test_match_never_covers_the_last_token() -> None:
    m = KVCache(8, 4)
    req = KVRequest("r", list(range(8)))  # exactly two blocks
    admit(m, req)
    assert m.pool.num_cached == 2
    assert m.match(KVRequest("s", list(range(8)))).num_cached_tokens == 4
    assert m.match(KVRequest("t", list(range(9)))).num_cached_tokens == 8
    assert m.match(KVRequest("u", [])) == PrefixMatch()
    assert m.match(KVRequest("v", [0])) == PrefixMatch()


def test_stats_events_and_subscribers() -> None:
    m = KVCache(8, 2, enable_events=True)
    seen: list = []
    unsubscribe = m.subscribe(seen.append)
    a = KVRequest("a", [1, 2, 3, 4, 5])
    admit(m, a)
    assert [type(e) for e in seen] == [BlockStored, BlockStored]
    unsubscribe()
    unsubscribe()  # twice is harmless
    b = KVRequest("b", [1, 2, 3, 4, 6, 7])
    admit(m, b)
    assert len(seen) == 2  # no longer subscribed
    drained = list(m.drain_events())
    assert [type(e) for e in drained] == [BlockStored] * 3 and list(m.drain_events()) == []
    st = m.stats()
    assert (st.requests, st.prefix_queries, st.prefix_hits, st.blocks_stored) == (2, 11, 4, 3)
    assert st.hit_rate == pytest.approx(4 / 11)
    # a: 3 blocks; b: a's 2 prefix blocks (shared) + 1 new
    assert (st.num_blocks, st.num_in_use, st.num_free, st.num_evictable) == (8, 4, 4, 0)
    assert st.usage == pytest.approx(4 / 8)
    quiet = KVCache(4, 2)  # events off: nothing buffered
    admit(quiet, KVRequest("q", [1, 2, 3]))
    assert list(quiet.drain_events()) == [] and quiet.stats().hit_rate == 0.0


def test_caching_disabled() -> None:
    m = KVCache(6, 2, enable_caching=False)
    admit(m, KVRequest("a", [1, 2, 3, 4, 5]))
    assert m.pool.num_cached == 0
    assert m.match(KVRequest("b", [1, 2, 3, 4, 5])) == PrefixMatch()
    m.free("a")
    assert (m.stats().num_free, m.stats().num_evictable) == (6, 0)


def test_block_table_and_slot_mapping() -> None:
    m = KVCache(8, 4)
    req = KVRequest("r", list(range(6)))
    admit(m, req)
    t = m.block_table("r")
    assert isinstance(t, BlockTable) and t.block_ids == [0, 1] and t.num_tokens == 6
    assert t.slot_mapping(0, 6) == [0, 1, 2, 3, 4, 5]
    other = KVRequest("o", list(range(6)) + [9, 9])
    match, blocks = admit(m, other)
    assert match.block_ids == (0,) and m.block_table("o").slot_mapping(3, 6) == [3, 8, 9]
    with pytest.raises(KeyError):
        m.block_table("missing")
    with pytest.raises(KeyError):
        m.cache(KVRequest("missing", [1]), 0)
    assert isinstance(req, SupportsKVCache)
    with pytest.raises(ValueError):
        KVCache(4, 0)


def test_token_list_must_be_append_only() -> None:
    m = KVCache(4, 2)
    req = KVRequest("r", [1, 2, 3, 4, 5])
    admit(m, req)
    del req.all_token_ids[3:]  # 2 block hashes, but 3 tokens
    with pytest.raises(ValueError, match="append-only"):
        m.match(req)
