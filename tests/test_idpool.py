"""IdPool: the free list, ref counts and range checks under the device, host and tail pools."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.cache.idpool import IdPool
from kvpage.errors import OutOfBlocksError


def state(pool: IdPool) -> tuple[list[int], list[int]]:
    """Free list (in take order) and every ref count: what a failed call must leave alone."""
    return pool.free_ids(), [pool.ref_count(i) for i in range(pool.num_ids)]


def test_c20_take_zero_and_negative() -> None:
    pool = IdPool(4)
    assert pool.take(0) == []
    assert pool.num_free == 4 and pool.num_taken == 0
    for bad in (-1, -5):
        with pytest.raises(ValueError, match="negative"):
            pool.take(bad)
        assert pool.num_free == 4
    pool.validate()
    empty = IdPool(0)
    assert empty.take(0) == [] and empty.free_ids() == []
    with pytest.raises(ValueError):
        empty.take(-1)
    with pytest.raises(ValueError, match="must be >= 0"):
        IdPool(-1)


def test_fifo_order_takes_the_front_and_returns_to_the_back() -> None:
    pool = IdPool(6)
    a, b = pool.take(2), pool.take(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert (pool.num_free, pool.num_taken) == (1, 5)
    pool.put(reversed(a))
    pool.validate()
    assert pool.free_ids() == [5, 1, 0]
    assert pool.take(2) == [5, 1]  # the never-used id first, then in the order returned
    assert pool.take(1) == [0] and pool.num_free == 0
    pool.validate()


def test_lifo_order_reuses_the_last_returned_id_first() -> None:
    pool = IdPool(4, what="tail slot", lifo=True)
    assert pool.take(2) == [0, 1]  # a fresh pool still starts at 0
    assert pool.free_ids() == [2, 3]
    pool.put([0])
    assert pool.take(1) == [0]
    pool.put([1, 0])
    assert pool.free_ids() == [0, 1, 2, 3] and pool.take(3) == [0, 1, 2]
    pool.validate()


def test_out_of_ids_takes_nothing() -> None:
    pool = IdPool(3)
    pool.take(2)
    before = state(pool)
    with pytest.raises(OutOfBlocksError, match="need 2 blocks, only 1 of 3"):
        pool.take(2)
    assert state(pool) == before
    assert pool.take(1) == [2]


def test_refs_count_up_and_down_and_report_zero_in_order() -> None:
    pool = IdPool(3)
    a, b = pool.take(2)
    assert pool.ref_count(a) == pool.ref_count(b) == 0  # taken, not referenced
    pool.incref([a, a, b, a])
    assert (pool.ref_count(a), pool.ref_count(b)) == (3, 1)
    assert pool.drops([a, b, a]) == {a: 2, b: 1}
    assert state(pool)[1] == [3, 1, 0]  # drops changes nothing
    assert pool.decref([a, b]) == [b]
    assert pool.decref([a, a]) == [a]  # twice in one call is fine with two references
    assert not pool.is_free(a)  # zero references does not free an id: the owner puts it back
    pool.put([a, b])
    assert pool.is_free(a) and pool.num_free == 3
    pool.validate()


def test_double_free_and_over_release_raise_and_change_nothing() -> None:
    pool = IdPool(4)
    ids = pool.take(3)
    pool.incref(ids)
    pool.decref([ids[0]])
    pool.put([ids[0]])
    before = state(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.decref([ids[1], ids[0]])  # a valid id before the bad one is not released either
    with pytest.raises(ValueError, match="block 2 unpinned more often than it is referenced"):
        pool.decref([ids[2], ids[2]], verb="unpinned")
    with pytest.raises(ValueError, match="double free"):
        pool.put([ids[0]])  # already free
    with pytest.raises(ValueError, match="still referenced"):
        pool.put([ids[1]])
    pool.decref([ids[2]])
    with pytest.raises(ValueError, match="double free"):
        pool.put([ids[2], ids[2]])  # the same id twice in one call
    assert state(pool) == (before[0], [0, 1, 0, 0])
    pool.validate()


def test_incref_of_a_free_id_changes_nothing() -> None:
    pool = IdPool(3)
    (a,) = pool.take(1)
    pool.incref([a])
    with pytest.raises(ValueError, match="free"):
        pool.incref([a, 2])  # 2 is free; a must not be incremented
    assert pool.ref_count(a) == 1
    pool.validate()


@pytest.mark.parametrize("bad", [-1, -3, 3, 100])
def test_ids_out_of_range_are_refused_everywhere(bad: int) -> None:
    """Regression: ``-1`` must never reach the last id through Python's negative indexing."""
    pool = IdPool(3, what="host block")
    pool.take(3)
    pool.incref([0, 1, 2])
    before = state(pool)
    for call in (pool.ref_count, pool.is_free, pool.check):
        with pytest.raises(ValueError, match=f"host block id {bad} out of range \\[0, 3\\)"):
            call(bad)
    for batch in (pool.incref, pool.decref):
        with pytest.raises(ValueError, match="out of range"):
            batch([0, bad])  # the valid id before it is not changed either
    with pytest.raises(ValueError, match="out of range"):
        pool.put([bad])
    assert state(pool) == before


@settings(max_examples=60, deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.sampled_from(["take", "put", "incref", "decref"]), st.integers(0, 5)),
                               max_size=40))
def test_random_operations_keep_the_invariants(lifo: bool, ops: list[tuple[str, int]]) -> None:
    """Against a model: the free list is a queue (or stack), refs never negative, failed calls change nothing."""
    pool = IdPool(5, lifo=lifo)
    free = list(range(5))  # in take order
    refs = [0] * 5
    for op, x in ops:
        before = state(pool)
        try:
            if op == "take":
                got = pool.take(x)
                assert got == free[:x]
                free = free[x:]
            elif op == "put":
                pool.put([x % 5])
                free = [x % 5, *free] if lifo else [*free, x % 5]
            elif op == "incref":
                pool.incref([x % 5])
                refs[x % 5] += 1
            else:
                pool.decref([x % 5])
                refs[x % 5] -= 1
        except (ValueError, OutOfBlocksError):
            assert state(pool) == before
        assert pool.free_ids() == free and [pool.ref_count(i) for i in range(5)] == refs
        pool.validate()


def test_take_with_a_starting_count_and_a_vetoed_release() -> None:
    pool = IdPool(3)
    assert pool.take(2, ref=1) == [0, 1] and pool.refs == [1, 1, 0]
    with pytest.raises(ValueError, match="negative"):
        pool.take(1, ref=-1)

    def refuse(drops: dict[int, int]) -> None:
        assert drops == {0: 1, 1: 1}
        raise ValueError("the owner says no")

    with pytest.raises(ValueError, match="owner says no"):
        pool.decref([0, 1], veto=refuse)
    assert pool.refs == [1, 1, 0] and pool.num_free == 1  # a vetoed release changes nothing
    assert pool.decref([1, 0], veto=lambda drops: None) == [1, 0]
    pool.validate()
