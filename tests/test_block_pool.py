"""BlockPool / BlockTable / BlockManager: tensor-free bookkeeping and its invariants."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvpage.cache.block_pool import BlockManager, BlockPool, BlockTable
from kvpage.errors import OutOfBlocksError


def check_pool(pool: BlockPool) -> None:
    """The pool's documented invariants."""
    free = list(pool._free)
    assert pool.num_free + pool.num_used == pool.num_blocks
    assert len(free) == len(set(free)), "a block is in the free list twice"
    for b in range(pool.num_blocks):
        r = pool.ref_count(b)
        assert r >= 0
        assert (b in free) == (r == 0), f"block {b}: ref {r}, in free list {b in free}"
    assert 0.0 <= pool.usage <= 1.0


# -- BlockPool -----------------------------------------------------------------------------------


def test_c20_allocate_zero_and_negative() -> None:
    pool = BlockPool(4)
    assert pool.allocate(0) == []
    assert pool.num_free == 4 and pool.num_used == 0
    for bad in (-1, -5):
        with pytest.raises(ValueError, match="negative"):
            pool.allocate(bad)
        assert pool.num_free == 4
    check_pool(pool)
    # on an empty pool too
    empty = BlockPool(0)
    assert empty.allocate(0) == [] and empty.usage == 0.0
    with pytest.raises(ValueError):
        empty.allocate(-1)
    # and through the manager: a 0-token request takes no block
    m = BlockManager(4, block_size=3)
    assert m.allocate("r", 0).block_ids == []
    assert m.pool.num_free == 4
    with pytest.raises(ValueError):
        m.allocate("s", -1)
    assert "s" not in m.tables and m.pool.num_free == 4


def test_negative_pool_size() -> None:
    with pytest.raises(ValueError):
        BlockPool(-1)


def test_free_list_accounting_after_every_op() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    check_pool(pool)
    b = pool.allocate(3)
    check_pool(pool)
    assert a == [0, 1] and b == [2, 3, 4]  # taken from the front
    assert (pool.num_free, pool.num_used) == (1, 5)
    assert pool.usage == pytest.approx(5 / 6)
    assert pool.free(reversed(a)) == [1, 0]  # the tail first
    check_pool(pool)
    # freed blocks go to the back: the never-used block 5 comes out first
    assert pool.allocate(2) == [5, 1]
    check_pool(pool)
    assert pool.allocate(1) == [0]
    assert pool.num_free == 0 and pool.usage == 1.0
    pool.free(b)
    check_pool(pool)


def test_out_of_blocks_takes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    before = (list(pool._free), [pool.ref_count(i) for i in range(3)])
    with pytest.raises(OutOfBlocksError, match="need 2 blocks, only 1 of 3"):
        pool.allocate(2)
    assert (list(pool._free), [pool.ref_count(i) for i in range(3)]) == before
    check_pool(pool)
    assert pool.allocate(1) == [2]


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    pool.free([ids[0]])
    state = (list(pool._free), [pool.ref_count(i) for i in range(4)])
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[0]])
    # a valid block before the bad one in the same call is not freed either
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[1], ids[0]])
    # the same block twice in one call, referenced once
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[2], ids[2]])
    for bad in (-1, 4, 100):
        with pytest.raises(ValueError, match="out of range"):
            pool.free([ids[1], bad])
    assert (list(pool._free), [pool.ref_count(i) for i in range(4)]) == state
    check_pool(pool)


def test_ref_counts() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.ref_count(a) == pool.ref_count(b) == 1
    pool.incref([a, a, b])
    assert (pool.ref_count(a), pool.ref_count(b)) == (3, 2)
    assert pool.free([a, b]) == []  # still referenced
    check_pool(pool)
    assert pool.free([a, b]) == [b]
    assert pool.free([a]) == [a]
    assert pool.num_free == 3
    check_pool(pool)
    # freeing a shared block twice in one call is fine when it has two references
    (c,) = pool.allocate(1)
    pool.incref([c])
    assert pool.free([c, c]) == [c]
    check_pool(pool)


def test_incref_of_free_block_changes_nothing() -> None:
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    with pytest.raises(ValueError, match="free"):
        pool.incref([a, 2])  # 2 is free; a must not be incremented
    assert pool.ref_count(a) == 1
    check_pool(pool)


def test_incref_out_of_range_is_refused() -> None:
    """Regression: ``incref([-1])`` used to add a reference to the *last* block (Python negative indexing)."""
    pool = BlockPool(3)
    pool.allocate(3)
    for bad in (-1, -3, 3):
        with pytest.raises(ValueError, match="out of range"):
            pool.incref([0, bad])
    assert [pool.ref_count(i) for i in range(3)] == [1, 1, 1]
    check_pool(pool)


# -- BlockTable ----------------------------------------------------------------------------------


def test_block_table_slots() -> None:
    t = BlockTable(block_size=4, block_ids=[7, 2, 9], num_tokens=10)
    assert t.capacity == 12
    # block * block_size + offset, computed by hand
    assert [t.slot(p) for p in range(10)] == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert t.slot_mapping(3, 6) == [31, 8, 9]
    assert t.slot_mapping(5, 5) == []
    for bad in (10, 11, -1):
        with pytest.raises(IndexError):
            t.slot(bad)
    with pytest.raises(IndexError):
        t.slot_mapping(8, 11)


def test_block_table_block_size_one_and_non_power_of_two() -> None:
    t = BlockTable(block_size=1, block_ids=[3, 0, 5], num_tokens=3)
    assert t.slot_mapping(0, 3) == [3, 0, 5]
    t = BlockTable(block_size=5, block_ids=[1, 0], num_tokens=7)
    assert t.slot_mapping(0, 7) == [5, 6, 7, 8, 9, 0, 1]


# -- BlockManager --------------------------------------------------------------------------------


def test_manager_allocate_append_free() -> None:
    m = BlockManager(num_blocks=6, block_size=4)
    assert m.can_allocate(24) and not m.can_allocate(25)
    t = m.allocate("a", 5)  # 2 blocks
    assert t.block_ids == [0, 1] and t.num_tokens == 5
    assert t.slot_mapping(0, 5) == [0, 1, 2, 3, 4]
    # three more tokens fit in block 1
    assert m.can_append("a", 3)
    assert m.append_slots("a", 3) == [5, 6, 7]
    assert m.pool.num_free == 4 and t.num_tokens == 8
    # the 9th token needs a new block
    assert m.append_slots("a") == [8]
    assert t.block_ids == [0, 1, 2]
    b = m.allocate("b", 4)
    assert b.block_ids == [3]
    assert m.append_slots("b", 6) == [16, 17, 18, 19, 20, 21]  # blocks 4 and 5
    assert b.block_ids == [3, 4, 5] and m.pool.num_free == 0
    # b holds 10 tokens in 12 slots, a 9 in 12: both can grow to the end of their last block, no further
    assert m.can_append("b", 2) and not m.can_append("b", 3)
    assert m.can_append("a", 3) and not m.can_append("a", 4)
    assert m.append_slots("a", 0) == []
    with pytest.raises(OutOfBlocksError):
        m.append_slots("a", 4)
    assert t.block_ids == [0, 1, 2] and t.num_tokens == 9  # nothing taken
    check_pool(m.pool)
    m.free("a")
    assert "a" not in m.tables and m.pool.num_free == 3
    assert list(m.pool._free) == [2, 1, 0]  # tail first
    m.free("a")  # unknown ids are ignored
    m.free("b")
    assert m.pool.num_free == 6
    check_pool(m.pool)


def test_manager_errors() -> None:
    m = BlockManager(num_blocks=2, block_size=3)
    m.allocate("a", 3)
    with pytest.raises(ValueError, match="already"):
        m.allocate("a", 1)
    with pytest.raises(KeyError):
        m.append_slots("zzz")
    with pytest.raises(ValueError):
        m.append_slots("a", -1)
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", 4)
    assert "b" not in m.tables and m.pool.num_free == 1
    with pytest.raises(ValueError):
        m.blocks_for(-1)
    with pytest.raises(ValueError):
        BlockManager(4, block_size=0)
    assert [m.blocks_for(n) for n in (0, 1, 3, 4, 6, 7)] == [0, 1, 1, 2, 2, 3]


# -- stateful ------------------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / free / share sequences on a small pool, checked against a model."""

    NUM_BLOCKS = 7
    BLOCK_SIZE = 3

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.tokens: dict[str, int] = {}  # model: request -> tokens
        self.extra_refs: list[int] = []  # blocks shared through incref, released later
        self.counter = 0

    def _need(self, n: int) -> int:
        return -(-n // self.BLOCK_SIZE)

    @rule(target=requests, n=st.integers(0, 12))
    def allocate(self, n: int) -> str:
        rid = f"r{self.counter}"
        self.counter += 1
        free_before = self.m.pool.num_free
        fits = self._need(n) <= free_before
        assert self.m.can_allocate(n) == fits
        if fits:
            t = self.m.allocate(rid, n)
            assert len(t.block_ids) == self._need(n) and t.num_tokens == n
            self.tokens[rid] = n
        else:
            with pytest.raises(OutOfBlocksError):
                self.m.allocate(rid, n)
            assert self.m.pool.num_free == free_before and rid not in self.m.tables
        return rid

    @rule(rid=requests, n=st.integers(0, 5))
    def append(self, rid: str, n: int) -> None:
        if rid not in self.tokens:
            with pytest.raises(KeyError):
                self.m.append_slots(rid, n)
            return
        have = self.tokens[rid]
        extra = self._need(have + n) - self._need(have)
        free_before = self.m.pool.num_free
        assert self.m.can_append(rid, n) == (extra <= free_before)
        table = self.m.tables[rid]
        if extra <= free_before:
            slots = self.m.append_slots(rid, n)
            bs = self.BLOCK_SIZE
            assert slots == [table.block_ids[p // bs] * bs + p % bs for p in range(have, have + n)]
            self.tokens[rid] = have + n
            assert self.m.pool.num_free == free_before - extra
        else:
            ids = list(table.block_ids)
            with pytest.raises(OutOfBlocksError):
                self.m.append_slots(rid, n)
            assert table.block_ids == ids and table.num_tokens == have
            assert self.m.pool.num_free == free_before

    @rule(rid=consumes(requests))
    def free(self, rid: str) -> None:
        table = self.m.tables.get(rid)
        free_before = self.m.pool.num_free
        self.m.free(rid)
        self.tokens.pop(rid, None)
        assert rid not in self.m.tables
        if table is not None:
            exclusively = [b for b in table.block_ids if b not in self.extra_refs]
            assert self.m.pool.num_free == free_before + len(exclusively)

    @precondition(lambda self: any(t.block_ids for t in self.m.tables.values()))
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        owners = [t for t in self.m.tables.values() if t.block_ids]
        table = data.draw(st.sampled_from(owners))
        b = data.draw(st.sampled_from(table.block_ids))
        before = self.m.pool.ref_count(b)
        self.m.pool.incref([b])
        self.extra_refs.append(b)
        assert self.m.pool.ref_count(b) == before + 1

    @precondition(lambda self: bool(self.extra_refs))
    @rule(data=st.data())
    def unshare(self, data: st.DataObject) -> None:
        b = self.extra_refs.pop(data.draw(st.integers(0, len(self.extra_refs) - 1)))
        before = self.m.pool.ref_count(b)
        freed = self.m.pool.free([b])
        assert self.m.pool.ref_count(b) == before - 1
        assert freed == ([b] if before == 1 else [])

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def double_free_is_refused(self, b: int) -> None:
        if self.m.pool.ref_count(b) == 0:
            state = list(self.m.pool._free)
            with pytest.raises(ValueError):
                self.m.pool.free([b])
            assert list(self.m.pool._free) == state

    @invariant()
    def pool_invariants(self) -> None:
        check_pool(self.m.pool)

    @invariant()
    def refs_match_the_model(self) -> None:
        expected = [0] * self.NUM_BLOCKS
        for rid, t in self.m.tables.items():
            assert t.num_tokens == self.tokens[rid]
            assert len(t.block_ids) == self._need(t.num_tokens)
            for b in t.block_ids:
                expected[b] += 1
        for b in self.extra_refs:
            expected[b] += 1
        assert [self.m.pool.ref_count(b) for b in range(self.NUM_BLOCKS)] == expected
        # no block belongs to two tables (sharing only goes through extra refs here)
        owned = [b for t in self.m.tables.values() for b in t.block_ids]
        assert len(owned) == len(set(owned))


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase


def test_ref_count_out_of_range_is_refused():
    """Regression: ref_count(-1) used to read the last block through negative indexing."""
    pool = BlockPool(3)
    pool.allocate(3)
    with pytest.raises(ValueError, match="out of range"):
        pool.ref_count(-1)
    with pytest.raises(ValueError, match="out of range"):
        pool.ref_count(3)
