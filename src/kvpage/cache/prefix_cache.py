"""Tensor-free block pool with a prefix index: ref counts, hash -> block map, leaves-first LRU eviction.

Every block is in exactly one of three states:

* **free** — ref count 0, not in the index; in the free list;
* **cached, evictable** — ref count 0, in the index (its KV is written and
  shareable); kept for reuse until evicted;
* **in use** — ref count > 0 (cached or not).

Invariants (checked by :meth:`PrefixBlockPool.validate`, which the tests call
after every operation):

* ``num_free + num_evictable + num_in_use == num_blocks``; a block is never
  freed twice and a ref count never goes negative;
* a block is in the index iff ``index[block.hash] is block``; a block enters
  the index only through :meth:`PrefixBlockPool.insert`, which the manager
  calls after the block's KV was written, and leaves it only by eviction, so a
  block that is free, being written or reallocated is never returned by a lookup;
* every cached block's parent (``key[0]``) is cached too (the index is a tree);
* a cached block in use has its cached parent in use too (:meth:`~PrefixBlockPool.touch`
  takes a chain root first, :meth:`~PrefixBlockPool.release` refuses to make a
  block evictable while a cached child is in use). So every evictable block's
  cached descendants are evictable and were released before it;
* evictable blocks are kept in release order and evicted least recently
  released first (LRU, like vLLM's free queue), which by the point above is
  always a leaf: a block is never evicted while one of its descendants is
  cached (**leaves first**, like SGLang's radix cache and TensorRT-LLM), and
  all ``num_evictable`` blocks can be reclaimed.

A lookup compares the stored :data:`BlockKey` — parent block id, token ids,
extra keys — not just the hash, and a parent block cannot be evicted (and
reused) while a child is cached. By induction over the chain, a hit's whole
token prefix equals the request's, so a hash collision can cost a hit but never
returns another prefix's KV (vLLM trusts the digest alone; SGLang compares
tokens in its radix tree — we do the latter with the former as the key).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpage.cache.idpool import IdPool
from kvpage.errors import OutOfBlocksError

#: Parent id of a request's first block.
ROOT = -1

#: What a cached block holds: ``(parent block id or ROOT, token ids, extra)``,
#: where ``extra`` is ``(cache_salt, extra_keys)``. Two blocks with equal keys
#: (and, recursively, equal parents) hold the same KV.
BlockKey = tuple[int, tuple[int, ...], tuple]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A block entered the prefix index (vLLM/SGLang ``BlockStored`` event).

    Attributes:
        block_hash: the block's chained hash.
        parent_block_hash: the parent's hash, ``None`` for a first block.
        token_ids: the block's tokens.
        block_id: the device block that holds the KV.
    """

    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A block left the prefix index (it was evicted; its id may be reused for other KV).

    Attributes:
        block_hash: the hash it was indexed under.
        block_id: the device block.
    """

    block_hash: bytes
    block_id: int


#: An event of the prefix index.
KVCacheEvent = BlockStored | BlockRemoved


class PrefixBlockPool:
    """``num_blocks`` block ids with ref counts, a free list and a prefix index with leaves-first LRU eviction.

    Nothing here touches a tensor. :meth:`allocate` takes free blocks first and
    evicts cached, unreferenced blocks only when the free list runs short, so
    cached KV stays as long as possible (vLLM v1's ``BlockPool`` keeps both in
    one queue; we keep them apart so a never-cached block always goes first).

    Args:
        num_blocks: blocks in the pool.
        on_event: called with every :class:`BlockStored` / :class:`BlockRemoved`.

    Raises:
        ValueError: ``num_blocks < 0``.
    """

    def __init__(self, num_blocks: int, on_event: Callable[[KVCacheEvent], None] | None = None) -> None:
        self._ids = IdPool(num_blocks, what="block")  # free = never cached or evicted; taken = in use or evictable
        self.num_blocks = num_blocks
        self.on_event = on_event
        self._hash: list[bytes | None] = [None] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._children = [0] * num_blocks  # cached children per block
        self._children_in_use = [0] * num_blocks  # cached children with ref > 0
        self._index: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, ref 0 (evictable), least recent first
        self._side: set[int] = set()  # claimed as side space (tail slots of quantize-on-seal formats)
        self.num_evictions = 0

    # -- counts ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks in the free list (ref 0, not cached)."""
        return self._ids.num_free

    @property
    def num_evictable(self) -> int:
        """Cached blocks with ref count 0 (reusable by a hit, reclaimable by eviction)."""
        return len(self._idle)

    @property
    def num_in_use(self) -> int:
        """Blocks with ref count > 0."""
        return self._ids.num_taken - len(self._idle) - len(self._side)

    @property
    def num_side(self) -> int:
        """Blocks claimed as side space (:meth:`claim`); ``free + evictable + in use + side == num_blocks``."""
        return len(self._side)

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix index (in use or evictable)."""
        return len(self._index)

    @property
    def usage(self) -> float:
        """Fraction of blocks requests hold (ref count > 0), in [0, 1], as vLLM's ``kv_cache_usage``: evictable
        blocks and side space (:attr:`side_usage`) count as not in use, so an idle pool reads 0."""
        return self.num_in_use / self.num_blocks if self.num_blocks else 0.0

    @property
    def side_usage(self) -> float:
        """Fraction of blocks claimed as side space (:meth:`claim`: 16-bit tail slots and 8-bit first-block copies,
        including the copies kept beside cached first blocks after their requests finished), in [0, 1]."""
        return len(self._side) / self.num_blocks if self.num_blocks else 0.0

    def ref_count(self, block_id: int) -> int:
        """Current ref count of ``block_id``.

        Raises:
            ValueError: ``block_id`` out of range.
        """
        return self._ids.ref_count(block_id)

    def is_in_use(self, block_id: int) -> bool:
        """Whether some request references the block (ref count > 0)."""
        return self._ids.ref_count(block_id) > 0

    def is_live(self, block_id: int) -> bool:
        """Whether the block's content is still held: referenced, or cached and not evicted."""
        return self._ids.ref_count(block_id) > 0 or self._hash[block_id] is not None

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash ``block_id`` is indexed under, or ``None`` if it is not cached.

        Raises:
            ValueError: ``block_id`` out of range.
        """
        self._check_id(block_id)
        return self._hash[block_id]

    def block_key(self, block_id: int) -> BlockKey | None:
        """The stored :data:`BlockKey` of a cached block, ``None`` if it is not cached.

        Raises:
            ValueError: ``block_id`` out of range.
        """
        self._check_id(block_id)
        return self._key[block_id]

    def _parent(self, b: int) -> int:
        """The parent block id (or :data:`ROOT`) of cached block ``b``; only called for cached blocks."""
        key = self._key[b]
        assert key is not None, f"block {b} is not cached"
        return key[0]

    def _check_id(self, b: int) -> None:
        self._ids.check(b)

    # -- prefix index ----------------------------------------------------------------------------

    def lookup(self, block_hash: bytes, key: BlockKey) -> int | None:
        """The cached block indexed under ``block_hash`` whose stored key equals ``key``, else ``None``.

        A hash hit whose tokens, extra keys or parent block differ (a collision)
        is a miss. Side-effect free: the caller takes a reference with :meth:`touch`.
        """
        b = self._index.get(block_hash)
        if b is None or self._key[b] != key:
            return None
        return b

    def insert(self, block_id: int, block_hash: bytes, key: BlockKey) -> int | None:
        """Index a block whose KV has just been written; returns the block that now holds this prefix.

        Args:
            block_id: an in-use, not yet cached block.
            block_hash: its chained hash.
            key: ``(parent, token_ids, extra)``; ``parent`` is :data:`ROOT` or a
                cached, in-use block (the chain's previous block).

        Returns:
            ``block_id`` if it was indexed (a :class:`BlockStored` event is
            emitted); the already indexed block if another block with an equal
            key holds ``block_hash`` (two requests computed the same block; the
            existing entry stays and ``block_id`` is not indexed, as in vLLM);
            ``None`` if ``block_hash`` is indexed with a different key (a hash
            collision: nothing is indexed).

        Raises:
            ValueError: ``block_id`` is out of range, free or already cached; or
                the parent is not a cached, in-use block.
        """
        if self._ids.ref_count(block_id) <= 0:
            raise ValueError(f"block {block_id} is free; only an in-use block with written KV can be cached")
        if self._hash[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached")
        parent = key[0]
        if parent != ROOT:
            if self._ids.ref_count(parent) <= 0 or self._hash[parent] is None:
                raise ValueError(f"parent block {parent} of block {block_id} must be cached and in use")
        existing = self._index.get(block_hash)
        if existing is not None:
            return existing if self._key[existing] == key else None
        self._index[block_hash] = block_id
        self._hash[block_id] = block_hash
        self._key[block_id] = key
        if parent != ROOT:
            self._children[parent] += 1
            self._children_in_use[parent] += 1
        if self.on_event is not None:
            self.on_event(
                BlockStored(block_hash, self._hash[parent] if parent != ROOT else None, key[1], block_id)
            )
        return block_id

    # -- references ------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref count 1 each): free blocks first, then evicted ones (leaves first, LRU).

        ``allocate(0)`` returns ``[]`` (case C20).

        Raises:
            ValueError: ``n < 0``.
            OutOfBlocksError: ``n > num_free + num_evictable``; nothing is taken or evicted.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        free = self._ids.num_free
        if n > free + len(self._idle):
            raise OutOfBlocksError(
                f"need {n} blocks, only {free} free + {len(self._idle)} evictable of {self.num_blocks}"
            )
        out = self._ids.take(min(n, free), ref=1)
        if n > free:
            evicted = self._evict_leaves(n - free)
            self._ids.incref(evicted)
            out.extend(evicted)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block: in-use blocks, or cached evictable ones (a prefix hit).

        A cached block with ref 0 leaves the evictable set. Take a chain root
        first: an evictable block can be touched only when its parent is in
        use (or touched earlier in the same call), which keeps every evictable
        block's subtree evictable.

        Raises:
            ValueError: a block is out of range or free (not cached, ref 0), or
                an evictable block's parent is not in use; nothing is changed.
        """
        ids = list(block_ids)
        n, refs = self.num_blocks, self._ids.refs
        pending: dict[int, int] = {}
        for b in ids:
            if not 0 <= b < n:
                self._ids.check(b)
            if refs[b] + pending.get(b, 0) == 0:
                if self._hash[b] is None:
                    raise ValueError(f"block {b} is free; cannot add a reference")
                p = self._parent(b)
                if p != ROOT and refs[p] + pending.get(p, 0) == 0:
                    raise ValueError(f"cannot reference block {b} before its evictable parent {p}")
            pending[b] = pending.get(b, 0) + 1
        for b in pending:  # (each block once: an evictable one leaves the evictable set before any increment)
            if refs[b] == 0:
                del self._idle[b]
                p = self._parent(b)
                if p != ROOT:
                    self._children_in_use[p] += 1
        self._ids.incref(ids)

    def release(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each block, in the order given.

        A block reaching ref 0 becomes evictable if it is cached (the most
        recent in LRU order, with any ancestors released earlier in the same
        call moved after it; release a request's blocks tail first, which is
        also the cheap order) and returns to the free list otherwise.

        Returns:
            The blocks that reached ref 0.

        Raises:
            ValueError: a block is out of range or dropped more often than it is
                referenced (double free); or a cached block would become
                evictable while one of its cached children stays in use
                (release a chain tail first); nothing is changed.
        """
        released = self._ids.decref(block_ids, veto=self._refuse_pinned_release)
        hashes = self._hash
        uncached = [b for b in released if hashes[b] is None]
        if uncached:
            self._ids.put(uncached)
        for b in released:
            if hashes[b] is not None:
                p = self._parent(b)
                if p != ROOT:
                    self._children_in_use[p] -= 1
                self._idle[b] = None  # most recent
                # a parent released earlier in this same call must stay after its child
                # (an idle parent of a just-released block can only come from this call)
                while p != ROOT and p in self._idle:
                    self._idle.move_to_end(p)
                    p = self._parent(p)
        return released

    def _refuse_pinned_release(self, drops: dict[int, int]) -> None:
        """Raise ``ValueError`` if ``drops`` would make a cached block evictable while a cached child stays in use."""
        refs, hashes = self._ids.refs, self._hash
        idle_now = [b for b, d in drops.items() if d == refs[b] and hashes[b] is not None]
        if idle_now:
            in_use_children = {b: self._children_in_use[b] for b in idle_now}
            for b in idle_now:
                p = self._parent(b)
                if p in in_use_children:
                    in_use_children[p] -= 1
            pinned = [b for b, c in in_use_children.items() if c > 0]
            if pinned:
                raise ValueError(f"blocks {pinned} still have cached children in use; release a chain tail first")

    # -- eviction --------------------------------------------------------------------------------

    def evict(self, n: int) -> list[int]:
        """Evict up to ``n`` evictable blocks (leaves first, least recently released first) to the free list.

        Evicting 0 blocks is always safe. Each evicted block leaves the index
        (a :class:`BlockRemoved` event) before it can be reused.

        Returns:
            The evicted block ids, in eviction order.

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({n})")
        out = self._evict_leaves(min(n, len(self._idle)))
        self._ids.put(out)
        return out

    def evict_all(self) -> list[int]:
        """Evict every evictable block (vLLM's ``reset_prefix_cache`` for unreferenced blocks)."""
        return self.evict(len(self._idle))

    def _evict_leaves(self, n: int) -> list[int]:
        """Evict exactly ``n`` idle blocks, least recently released first; the caller checked ``n <= num_evictable``.

        The least recent idle block is always a leaf: a block becomes idle only
        once none of its cached children is in use (:meth:`release`), and a child
        can be referenced again only while its parent is in use (:meth:`touch`,
        :meth:`insert`), so every idle block's cached children are idle and were
        released before it. The check below makes that a hard guarantee.
        """
        out: list[int] = []
        while len(out) < n:
            b, _ = self._idle.popitem(last=False)
            if self._children[b]:
                self._idle[b] = None
                self._idle.move_to_end(b, last=False)
                raise RuntimeError(f"leaves-first eviction broken: block {b} has {self._children[b]} cached children")
            self._forget(b)
            out.append(b)
        return out

    def _forget(self, b: int) -> None:
        """Take idle leaf ``b`` (already out of the idle set) out of the index, with its event."""
        h, key = self._hash[b], self._key[b]
        assert h is not None and key is not None
        del self._index[h]
        self._hash[b] = self._key[b] = None
        if key[0] != ROOT:
            self._children[key[0]] -= 1
        self.num_evictions += 1
        if self.on_event is not None:
            self.on_event(BlockRemoved(h, b))

    # -- side space ------------------------------------------------------------------------------

    def claimable(self, b: int, protected: frozenset[int] | set[int] = frozenset(), *, evict: bool = True) -> bool:
        """Whether :meth:`claim` may take ``b``: free, or (``evict``) evictable and not in ``protected``.

        No side effects. Claim evictable blocks only where the tier connector hears of the evictions
        before the next forward pass overwrites them (the scheduler's reservations), never inside one.
        """
        if b in self._side or self._ids.refs[b]:
            return False
        return self._hash[b] is None or (evict and b not in protected)

    def claim(self, block_ids: Sequence[int]) -> None:
        """Take claimable blocks (:meth:`claimable`) out of the pool as side space (ref 0, neither free nor cached).

        An evictable block is evicted first, with its cached descendants (all evictable; they go to the free
        list), so the index stays a tree. Raises ``ValueError`` (nothing changed) if a block is not claimable.
        """
        if any(not self.claimable(b) for b in block_ids):
            raise ValueError(f"blocks {list(block_ids)} are not all claimable (free or evictable)")
        for b in block_ids:
            if self._hash[b] is not None:
                self._evict_subtree(b)
                self._side.add(b)  # taken with ref 0 already
            else:
                self._ids.take_ids([b])
                self._side.add(b)

    def _evict_subtree(self, b: int) -> None:
        """Evict idle ``b`` and its cached descendants (descendants to the free list, ``b`` stays taken)."""
        kids = [x for x in self._idle if self._key[x] is not None and self._parent(x) == b] if self._children[b] else []
        for x in kids:
            self._evict_subtree(x)
            self._ids.put([x])
        del self._idle[b]
        self._forget(b)

    def unclaim(self, block_ids: Sequence[int]) -> None:
        """Give side blocks back to the free list (``ValueError``, nothing changed, if one is not side space)."""
        if any(b not in self._side for b in block_ids):
            raise ValueError(f"blocks {list(block_ids)} are not all side space")
        self._side.difference_update(block_ids)
        self._ids.put(block_ids)

    # -- checks ----------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every invariant of the module docstring (O(num_blocks); for tests and debugging).

        Raises:
            AssertionError: an invariant is broken; the message says which.
        """
        self._ids.validate()
        free_set = set(self._ids.free_ids())
        assert self.num_free + self.num_evictable + self.num_in_use + self.num_side == self.num_blocks
        children = [0] * self.num_blocks
        children_in_use = [0] * self.num_blocks
        for b in range(self.num_blocks):
            r, h, k = self._ids.ref_count(b), self._hash[b], self._key[b]
            assert r >= 0, f"block {b}: negative ref count {r}"
            assert (h is None) == (k is None), f"block {b}: hash and key disagree"
            side = b in self._side
            assert not (side and (r or h is not None)), f"side block {b} is referenced or cached"
            assert (b in free_set) == (r == 0 and h is None and not side), f"block {b}: ref {r}, free list"
            assert (b in self._idle) == (r == 0 and h is not None), f"block {b}: ref {r}, evictable set"
            if h is not None and k is not None:
                assert self._index.get(h) == b, f"block {b} is cached but the index points elsewhere"
                parent = k[0]
                if parent != ROOT:
                    assert self._hash[parent] is not None, f"cached block {b} has an uncached parent {parent}"
                    children[parent] += 1
                    children_in_use[parent] += r > 0
                    if r > 0:
                        parent_ref = self._ids.ref_count(parent)
                        assert parent_ref > 0, f"block {b} is in use but its parent {parent} is evictable"
        assert len(self._index) == sum(h is not None for h in self._hash), "index holds a block that is not cached"
        assert children == self._children, "cached-children counts are off"
        assert children_in_use == self._children_in_use, "in-use cached-children counts are off"
        order = {b: i for i, b in enumerate(self._idle)}
        for b in self._idle:  # leaves first: every idle block's cached parent is idle and later in LRU order
            parent = self._parent(b)
            if parent != ROOT and parent in order:
                assert order[parent] > order[b], f"evictable block {b} would be evicted after its parent {parent}"
