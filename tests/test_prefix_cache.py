"""PrefixBlockPool: ref counts, the prefix index, leaves-first LRU eviction, events, invariants."""
from __future__ import annotations

import pytest

from kvpage.cache.prefix_cache import ROOT, BlockRemoved, BlockStored, PrefixBlockPool
from kvpage.errors import OutOfBlocksError

EXTRA = (None, ())


def h(name: str) -> bytes:
    """A fake 32-byte hash."""
    return name.encode().ljust(32, b".")


def key(parent: int, *tokens: int):
    return (parent, tuple(tokens), EXTRA)


def make_chain(pool: PrefixBlockPool, names: list[str], parent: int = ROOT, hold: list[int] | None = None) -> list[int]:
    """Allocate and index a chain of blocks under ``parent``; returns their ids (still referenced)."""
    ids = pool.allocate(len(names))
    for i, (b, name) in enumerate(zip(ids, names)):
        assert pool.insert(b, h(name), key(parent, i, len(name))) == b
        parent = b
    return ids


def counts(pool: PrefixBlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_evictable, pool.num_in_use


def test_states_and_accounting() -> None:
    events: list = []
    pool = PrefixBlockPool(5, on_event=events.append)
    assert counts(pool) == (5, 0, 0) and pool.usage == 0.0
    a, b = make_chain(pool, ["a", "b"])
    c = pool.allocate(1)[0]  # never indexed
    assert counts(pool) == (2, 0, 3) and pool.num_cached == 2
    assert pool.usage == pytest.approx(3 / 5)
    pool.validate()
    assert pool.release([c, b, a]) == [c, b, a]
    assert counts(pool) == (3, 2, 0)  # the uncached block is free, the cached ones evictable
    assert pool.block_hash(a) == h("a") and pool.block_hash(c) is None
    assert pool.block_key(b) == key(a, 1, 1)
    pool.validate()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert events[1] == BlockStored(h("b"), h("a"), (1, 1), b)
    assert events[0].parent_block_hash is None


def test_allocate_prefers_free_blocks_then_evicts_lru() -> None:
    events: list = []
    pool = PrefixBlockPool(4, on_event=events.append)
    a = make_chain(pool, ["a"])
    b = make_chain(pool, ["b"])
    pool.release(a)  # a released before b: a is the least recent
    pool.release(b)
    assert pool.allocate(2) == [2, 3]  # free blocks first, cache untouched
    assert pool.num_cached == 2 and pool.num_evictions == 0
    assert pool.allocate(1) == a  # then the least recently released
    assert pool.lookup(h("a"), key(ROOT, 0, 1)) is None and pool.block_hash(a[0]) is None
    assert events[-1] == BlockRemoved(h("a"), a[0])
    assert pool.allocate(1) == b and pool.num_evictions == 2
    assert counts(pool) == (0, 0, 4)
    pool.validate()


def test_allocate_zero_negative_and_out_of_blocks_is_atomic() -> None:
    pool = PrefixBlockPool(3)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)
    ids = make_chain(pool, ["x", "y"])
    pool.release(reversed(ids))
    before = (counts(pool), pool._ids.free_ids(), list(pool._idle), dict(pool._index))
    with pytest.raises(OutOfBlocksError, match="need 4 blocks, only 1 free \\+ 2 evictable of 3"):
        pool.allocate(4)
    assert (counts(pool), pool._ids.free_ids(), list(pool._idle), dict(pool._index)) == before
    assert len(pool.allocate(3)) == 3  # exactly free + evictable fits
    with pytest.raises(ValueError):
        pool.evict(-1)
    assert pool.evict(0) == []
    pool.validate()


def test_lookup_compares_the_key_not_just_the_hash() -> None:
    pool = PrefixBlockPool(4)
    (a,) = make_chain(pool, ["a"])
    assert pool.lookup(h("a"), key(ROOT, 0, 1)) == a
    # same hash, other tokens / other parent / other extra keys: a forced collision is a miss
    assert pool.lookup(h("a"), key(ROOT, 0, 2)) is None
    assert pool.lookup(h("a"), key(3, 0, 1)) is None
    assert pool.lookup(h("a"), (ROOT, (0, 1), ("tenant-b", ()))) is None
    assert pool.lookup(h("zzz"), key(ROOT, 0, 1)) is None


def test_insert_rules() -> None:
    events: list = []
    pool = PrefixBlockPool(6, on_event=events.append)
    (a,) = make_chain(pool, ["a"])
    free_block = 5
    with pytest.raises(ValueError, match="free"):
        pool.insert(free_block, h("q"), key(ROOT, 9))
    with pytest.raises(ValueError, match="already cached"):
        pool.insert(a, h("again"), key(ROOT, 0, 1))
    (b,) = pool.allocate(1)
    (u,) = pool.allocate(1)  # in use, never cached
    with pytest.raises(ValueError, match="must be cached"):
        pool.insert(b, h("b"), key(u, 1))  # parent not cached
    with pytest.raises(ValueError, match="out of range"):
        pool.insert(b, h("b"), key(77, 1))
    # a duplicate with an equal key: the existing block is returned, nothing indexed, no event
    n_events = len(events)
    assert pool.insert(b, h("a"), key(ROOT, 0, 1)) == a
    assert pool.block_hash(b) is None and len(events) == n_events
    # the same hash with another key (a collision): None, nothing indexed
    assert pool.insert(b, h("a"), key(ROOT, 5, 5)) is None
    assert pool.block_hash(b) is None and pool.lookup(h("a"), key(ROOT, 0, 1)) == a
    # a parent that is cached but evictable cannot get a child
    pool.release([a])
    with pytest.raises(ValueError, match="in use"):
        pool.insert(b, h("b"), key(a, 1))
    pool.validate()


def test_touch_and_release_errors_change_nothing() -> None:
    pool = PrefixBlockPool(4)
    a, b = make_chain(pool, ["a", "b"])
    pool.release([b, a])
    snap = (counts(pool), list(pool._idle), [pool.ref_count(i) for i in range(4)])
    with pytest.raises(ValueError, match="free"):
        pool.touch([a, 3])  # 3 is free
    with pytest.raises(ValueError, match="before its evictable parent"):
        pool.touch([b, a])  # child before parent
    with pytest.raises(ValueError, match="out of range"):
        pool.touch([-1])
    with pytest.raises(ValueError, match="double free"):
        pool.release([a])
    assert (counts(pool), list(pool._idle), [pool.ref_count(i) for i in range(4)]) == snap
    pool.touch([a, b])  # root first is fine
    assert counts(pool) == (2, 0, 2) and pool.ref_count(b) == 1
    with pytest.raises(ValueError, match="tail first"):
        pool.release([a])  # a would become evictable while its child b is in use
    with pytest.raises(ValueError, match="double free"):
        pool.release([b, b])
    assert pool.ref_count(a) == 1 and pool.ref_count(b) == 1
    pool.release([a, b])  # both in one call, parent first: fine, and the child still goes first
    assert counts(pool) == (2, 2, 0)
    assert list(pool._idle) == [b, a]
    assert pool.evict(1) == [b]
    pool.validate()


def test_leaves_first_lru_eviction_on_a_tree() -> None:
    """Tree a0 -> {a1 -> a2, b1}; plus an unrelated leaf x. Every eviction takes a leaf, least recent first."""
    removed: list[int] = []
    pool = PrefixBlockPool(8, on_event=lambda e: removed.append(e.block_id) if isinstance(e, BlockRemoved) else None)
    a0, a1, a2 = make_chain(pool, ["a0", "a1", "a2"])
    (b1,) = make_chain(pool, ["b1"], parent=a0)
    (x,) = make_chain(pool, ["x"])
    pool.touch([a0])  # a second request on a0 -> b1
    pool.release([a2, a1, a0])  # request 1 finishes, tail first; a0 still held
    pool.release([x])
    pool.release([b1, a0])  # request 2 finishes
    assert pool.num_evictable == 5 and pool.num_in_use == 0
    pool.validate()
    order = []
    while pool.num_evictable:
        # a block is evicted only when it has no cached child left
        for b in pool.evict(1):
            order.append(b)
            assert pool._children[b] == 0
            for other in range(8):
                k = pool.block_key(other)
                assert k is None or k[0] != b, f"evicted {b} while its child {other} is cached"
        pool.validate()
    assert order == [a2, a1, x, b1, a0] == removed
    assert pool.num_free == 8 and pool.num_cached == 0


def test_reused_block_is_never_returned_by_old_lookup() -> None:
    """Evict a cached block, reuse it for other KV and index that: the old prefix must miss."""
    pool = PrefixBlockPool(1)
    (a,) = make_chain(pool, ["a"])
    pool.release([a])
    assert pool.lookup(h("a"), key(ROOT, 0, 1)) == a
    (again,) = pool.allocate(1)
    assert again == a and pool.lookup(h("a"), key(ROOT, 0, 1)) is None
    assert pool.insert(again, h("new"), key(ROOT, 4, 4)) == again
    assert pool.lookup(h("a"), key(ROOT, 0, 1)) is None
    assert pool.lookup(h("new"), key(ROOT, 4, 4)) == again


def test_evict_all_returns_every_block_once() -> None:
    events: list = []
    pool = PrefixBlockPool(6, on_event=events.append)
    c1 = make_chain(pool, ["p", "q", "r"])
    c2 = make_chain(pool, ["s"], parent=c1[0])
    pool.touch([c1[0]])
    pool.release(reversed(c1))
    pool.release(c2 + [c1[0]])
    evicted = pool.evict_all()
    assert sorted(evicted) == sorted(c1 + c2) and len(set(evicted)) == 4
    assert sorted(pool._ids.free_ids()) == list(range(6)) and pool.num_free == 6
    assert sorted(e.block_id for e in events if isinstance(e, BlockRemoved)) == sorted(c1 + c2)
    assert pool.evict_all() == []
    pool.validate()


def test_ref_count_and_ids_out_of_range() -> None:
    pool = PrefixBlockPool(2)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="out of range"):
            pool.ref_count(bad)
        with pytest.raises(ValueError, match="out of range"):
            pool.block_hash(bad)
    with pytest.raises(ValueError):
        PrefixBlockPool(-1)
    empty = PrefixBlockPool(0)
    assert empty.usage == 0.0 and empty.allocate(0) == []
