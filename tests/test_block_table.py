"""BlockTable: slots of a request's tokens."""
from __future__ import annotations

import pytest

from kvpage.cache.block_table import BlockTable


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
