"""``_ReqState``: the manager's bookkeeping of one request (its block table and how far it is indexed).

Shared by :mod:`kvpage.cache.manager` and its mixins (:mod:`kvpage.cache.table_edits`). Tensor-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _ReqState:
    """Per-request bookkeeping: the block table and how far it is indexed."""

    block_ids: list[int]
    num_tokens: int  # slots reserved
    num_cached_blocks: int  # block_ids[:num_cached_blocks] are indexed (or deduplicated / given up on)
    parent: int  # block that holds the prefix up to num_cached_blocks (ROOT at 0)
    anchors: list[int] = field(default_factory=list)  # extra refs on indexed twins of our duplicate blocks
    stop_caching: bool = False  # a hash collision stopped this request's chain
