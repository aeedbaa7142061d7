"""Test helpers: the scheduler-side tail bookkeeping of a built engine (issue 27's split of the tail).

Since issue 27 a quantize-on-seal group's tail lives in two halves: the worker-side tensors
(``llm._built.tails[name]``, a :class:`~kvpage.cache.tail.pool.TailPool` with its ``.layout``) and the
scheduler-side bookkeeping (the :class:`~kvpage.cache.tail.TailTable`: open slots, window and first-block copies,
side groups), owned by the group's manager in the :class:`~kvpage.cache.kv_cache.KVCache`: ``.table`` of a
:class:`~kvpage.cache.groups.SealedGroupManager`, ``.seals.table`` of a
:class:`~kvpage.cache.groups.SealedWindowManager`.
"""
from __future__ import annotations

from typing import Any

from kvpage.cache.groups import SealedGroupManager, SealedWindowManager
from kvpage.cache.tail import TailTable


def sealed_manager(llm: Any, name: str) -> SealedGroupManager:
    """The manager that books layer group ``name``'s tail (``AssertionError`` if the group has none)."""
    g = llm.engine.kv.group(name)
    if isinstance(g, SealedWindowManager):
        g = g.seals
    assert isinstance(g, SealedGroupManager), f"group {name!r} is a {type(g).__name__}, not a sealed group"
    return g


def tail_table(llm: Any, name: str) -> TailTable:
    """The scheduler-side tail bookkeeping of layer group ``name``."""
    return sealed_manager(llm, name).table


def tail_tables(llm: Any) -> list[TailTable]:
    """The tail table of every group that has a tail pool (``llm._built.tails``), in that dict's order; each pairs
    with the tail pool of the same index in ``list(llm._built.tails.values())``."""
    return [tail_table(llm, name) for name in llm._built.tails]
