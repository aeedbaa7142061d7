"""``PrefixIndex``: a request's chained block hashes, and its prefix looked up in and inserted into the pool's index.

The policy half of prefix caching (the pool, :mod:`kvpage.cache.prefix_cache`,
holds the index itself): which hash a block gets (SHA-256 chained from a salted
root, :mod:`kvpage.cache.hashing`), which key a hit is checked against (parent
block, tokens, salt and extra keys, so a hash collision is a miss), and how a
chain of newly written blocks enters the index. Tensor-free.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpage.cache.hashing import BlockHasher
from kvpage.cache.prefix_cache import ROOT, BlockKey, PrefixBlockPool
from kvpage.cache.requests import SupportsKVCache


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`PrefixIndex.insert_chain` did.

    Attributes:
        num_stored: blocks that entered the index.
        num_done: blocks of the chain now indexed or deduplicated (the request's new ``num_cached_blocks``).
        parent: the block holding the prefix up to ``num_done`` (``ROOT`` at 0).
        twins: indexed blocks equal to the request's own, now referenced by it (one ``touch`` each).
        collided: a hash collision stopped the chain (index nothing more for this request).
    """

    num_stored: int
    num_done: int
    parent: int
    twins: tuple[int, ...]
    collided: bool


class PrefixIndex:
    """Hashing and chained lookup/insert of a request's full blocks over a :class:`PrefixBlockPool`.

    Args:
        pool: the pool whose index is used.
        block_size: tokens per block.
        hasher: the block hash scheme (default kvpage's own, :class:`~kvpage.cache.hashing.BlockHasher`).
    """

    def __init__(self, pool: PrefixBlockPool, block_size: int, hasher: BlockHasher | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hasher = BlockHasher() if hasher is None else hasher

    def block_hashes(self, request: SupportsKVCache, num_blocks: int) -> list[bytes]:
        """``request.block_hashes``, extended in place to at least ``num_blocks`` full blocks (never a partial one).

        Raises:
            ValueError: the request has more hashes than full blocks (its tokens were edited).
        """
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        if len(hashes) > len(tokens) // bs:
            raise ValueError(
                f"request {request.request_id!r} has {len(hashes)} block hashes but only {len(tokens)} tokens; "
                "all_token_ids must be append-only"
            )
        if len(hashes) < num_blocks:
            salt = request.cache_salt
            parent = hashes[-1] if hashes else self.hasher.root(salt)
            for i in range(len(hashes), num_blocks):
                parent = self.hasher.block(parent, tokens[i * bs : (i + 1) * bs], i, salt, request.extra_keys)
                hashes.append(parent)
        return hashes

    def key(self, request: SupportsKVCache, i: int, parent: int) -> BlockKey:
        """Block ``i``'s index key: ``(parent block, its tokens, (salt, extra keys))``."""
        bs = self.block_size
        salt = self.hasher.salt_identity(request.cache_salt)
        return (parent, tuple(request.all_token_ids[i * bs : (i + 1) * bs]), (salt, request.extra_keys))

    def lookup_chain(self, request: SupportsKVCache, num_blocks: int) -> list[int]:
        """The longest chain of indexed blocks equal to the request's first ``num_blocks`` blocks (no side effects
        apart from extending ``request.block_hashes``)."""
        hashes = self.block_hashes(request, num_blocks)
        out: list[int] = []
        parent = ROOT
        for i in range(num_blocks):
            b = self.pool.lookup(hashes[i], self.key(request, i, parent))
            if b is None:
                break
            out.append(b)
            parent = b
        return out

    def insert_chain(self, request: SupportsKVCache, block_ids: Sequence[int], start: int, end: int,
                     parent: int) -> InsertResult:
        """Index the request's blocks ``block_ids[start:end]`` (their KV is written), chained after ``parent``.

        When an equal block is indexed already (two requests computed it at
        once), that entry stays and is referenced instead (vLLM); a block this
        request shares with a fork sibling that indexed it already is passed over;
        a hash collision (same hash, other contents) stops the chain.
        """
        hashes = self.block_hashes(request, end)
        stored = 0
        twins: list[int] = []
        done = start
        for i in range(start, end):
            b = block_ids[i]
            key = self.key(request, i, parent)
            if self.pool.block_hash(b) is not None:  # a block shared with a fork sibling, indexed by it already
                if self.pool.block_key(b) != key:
                    return InsertResult(stored, done, parent, tuple(twins), True)
                parent, done = b, i + 1
                continue
            holder = self.pool.insert(b, hashes[i], key)
            if holder is None:  # collision: another prefix owns this hash
                return InsertResult(stored, done, parent, tuple(twins), True)
            if holder == b:
                stored += 1
            else:  # an equal block is indexed already: chain onto it
                self.pool.touch([holder])
                twins.append(holder)
            parent = holder
            done = i + 1
        return InsertResult(stored, done, parent, tuple(twins), False)
