"""Tensor-free bookkeeping of the host (CPU) tier: host block states, an LRU index by block hash, pins.

The host tier's tensors are allocated by
:meth:`~kvpage.cache.controller.CacheController.initialize_host_cache`; this
module only decides which host block holds what. Every host block is in
exactly one state:

* **free** — holds nothing; in the free list;
* **writing** — the target of a device->host copy that has not been
  acknowledged yet (:mod:`kvpage.cache.tiers.transfer`); never handed out, never
  read (case C09, SGLang issue 28468);
* **cached** — holds a block's KV, indexed under its chained block hash;
  *evictable* while no load reads it (ref 0), kept in LRU order and reused
  least recently used first; *pinned* while loads read it (ref > 0);
* **owned** — holds a preempted request's block (swap preemption), not
  indexed; freed when the request is swapped back in or dropped.

Invariants (:meth:`HostBlockPool.validate`):

* ``num_free + num_evictable + num_busy == num_blocks`` (busy = writing,
  pinned or owned);
* a block is in the index iff it is cached, and the index maps its hash to it;
* :meth:`HostBlockPool.allocate` takes only free or evictable blocks, so a
  block with a copy in flight, a block a load reads and a block a swapped
  request owns are never reused.

The index is keyed by the full SHA-256 chained block hash
(:mod:`kvpage.cache.hashing`), which commits to every token of the prefix, the
tenant salt and the extra keys, as vLLM's CPU offload and LMCache key theirs.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvpage.cache.idpool import IdPool
from kvpage.cache.prefix_cache import BlockRemoved, BlockStored, KVCacheEvent
from kvpage.errors import OutOfBlocksError


class HostBlockState(enum.Enum):
    """State of one host block (see the module docstring)."""

    FREE = "free"
    WRITING = "writing"
    CACHED = "cached"
    OWNED = "owned"


class HostBlockPool:
    """Host block ids, their states and the hash index (SGLang HiCache's host pool bookkeeping, tensor-free).

    Args:
        num_blocks: host blocks (``CacheController.num_host_blocks``); 0 means no host tier.

    Attributes:
        on_event: called with a :class:`~kvpage.cache.prefix_cache.BlockStored` when a block enters the index (its
            copy acknowledged; no tokens and no parent: the host tier keys blocks by hash alone, as vLLM's
            offloading connector reports them) and a :class:`~kvpage.cache.prefix_cache.BlockRemoved` when an
            allocation evicts one; ``None`` (the default) records nothing.

    Raises:
        ValueError: ``num_blocks < 0``.
    """

    def __init__(self, num_blocks: int) -> None:
        self._ids = IdPool(num_blocks, what="host block")  # free: FREE blocks; ref counts: loads reading a block
        self.num_blocks = num_blocks
        self._state = [HostBlockState.FREE] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # cached: its hash; writing: the hash it will hold
        self._index: dict[bytes, int] = {}
        self._writing_hash: dict[bytes, int] = {}  # hash -> block being written for it (dedupe of backups)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, least recent first
        self._free_on_ack: set[int] = set()  # owned blocks dropped while their copy was in flight
        self.num_evictions = 0
        self.on_event: Callable[[KVCacheEvent], None] | None = None

    # -- counts ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return self._ids.num_free

    @property
    def num_evictable(self) -> int:
        """Cached blocks no load reads (reusable, least recently used first)."""
        return len(self._lru)

    @property
    def num_busy(self) -> int:
        """Blocks being written, pinned by a load, or owned by a swapped request."""
        return self._ids.num_taken - len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks in the index (evictable or pinned)."""
        return len(self._index)

    @property
    def num_writing(self) -> int:
        """Blocks with a device->host copy in flight."""
        return sum(1 for s in self._state if s is HostBlockState.WRITING)

    def state(self, block_id: int) -> HostBlockState:
        """The state of ``block_id``.

        Raises:
            ValueError: out of range.
        """
        self._check(block_id)
        return self._state[block_id]

    def ref_count(self, block_id: int) -> int:
        """Loads reading ``block_id`` (cached or owned blocks).

        Raises:
            ValueError: out of range.
        """
        return self._ids.ref_count(block_id)

    def _check(self, b: int) -> None:
        self._ids.check(b)

    # -- index -----------------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The cached host block holding ``block_hash`` (side-effect free), else ``None``.

        A block still being written is not returned (its KV is not there yet).
        """
        return self._index.get(block_hash)

    def contains(self, block_hash: bytes) -> bool:
        """Whether ``block_hash`` is cached or being written (a backup need not start again)."""
        return block_hash in self._index or block_hash in self._writing_hash

    def touch(self, block_id: int) -> None:
        """Mark a cached block most recently used (a hit)."""
        if block_id in self._lru:
            self._lru.move_to_end(block_id)

    # -- allocation ------------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        """Whether :meth:`allocate` of ``n`` blocks would succeed now."""
        return 0 <= n <= self._ids.num_free + len(self._lru)

    def allocate(self, n: int, block_hashes: Iterable[bytes | None] | None = None) -> list[int]:
        """Take ``n`` blocks into the **writing** state: free ones first, then evict least recently used cached ones.

        Blocks being written, pinned or owned are never taken (C09). Evicted
        blocks leave the index first.

        Args:
            n: blocks to take (0 returns ``[]``).
            block_hashes: the hash each block will hold once its copy is
                acknowledged (:meth:`finish_write` indexes it), or ``None`` for
                blocks that will be owned by a swapped request.

        Raises:
            ValueError: ``n < 0``, ``len(block_hashes) != n``, or a hash that is
                already cached or being written.
            OutOfBlocksError: fewer than ``n`` free + evictable blocks; nothing changes.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of host blocks ({n})")
        hashes = [None] * n if block_hashes is None else list(block_hashes)
        if len(hashes) != n:
            raise ValueError(f"{len(hashes)} block hashes for {n} host blocks")
        named = [h for h in hashes if h is not None]
        if len(set(named)) != len(named) or any(self.contains(h) for h in named):
            raise ValueError("a block hash is repeated or already in the host tier")
        if not self.can_allocate(n):
            raise OutOfBlocksError(
                f"need {n} host blocks, only {self._ids.num_free} free + {len(self._lru)} evictable of "
                f"{self.num_blocks} ({self.num_busy} busy: copies in flight, pinned by loads or owned by "
                "swapped requests)"
            )
        out = self._ids.take(min(n, self._ids.num_free))
        while len(out) < n:
            b, _ = self._lru.popitem(last=False)
            h = self._hash[b]
            assert h is not None
            del self._index[h]
            self.num_evictions += 1
            if self.on_event is not None:
                self.on_event(BlockRemoved(h, b))
            out.append(b)
        for b, h in zip(out, hashes):
            self._state[b] = HostBlockState.WRITING
            self._hash[b] = h
            if h is not None:
                self._writing_hash[h] = b
        return out

    def _writing(self, block_id: int) -> bytes | None:
        """The hash of a **writing** block (``None`` for an owned one); ``ValueError`` if it is not being written."""
        self._check(block_id)
        if self._state[block_id] is not HostBlockState.WRITING:
            raise ValueError(f"host block {block_id} is {self._state[block_id].value}, not being written")
        return self._hash[block_id]

    def finish_write(self, block_id: int) -> None:
        """Acknowledge the copy into a **writing** block: it becomes cached (indexed, most recent) or owned.

        An owned block dropped while its copy was in flight (:meth:`free_owned`)
        is freed now instead.

        Raises:
            ValueError: the block is not being written.
        """
        h = self._writing(block_id)
        if block_id in self._free_on_ack:
            self._free_on_ack.discard(block_id)
            self._to_free(block_id)
        elif h is None:
            self._state[block_id] = HostBlockState.OWNED
        else:
            del self._writing_hash[h]
            self._state[block_id] = HostBlockState.CACHED
            self._index[h] = block_id
            self._lru[block_id] = None
            if self.on_event is not None:
                self.on_event(BlockStored(h, None, (), block_id))

    def abort_write(self, block_id: int) -> None:
        """Give up a **writing** block whose copy will never happen (it was not issued); it returns to the free list.

        Raises:
            ValueError: the block is not being written.
        """
        h = self._writing(block_id)
        if h is not None:
            del self._writing_hash[h]
        self._free_on_ack.discard(block_id)
        self._to_free(block_id)

    def _to_free(self, b: int) -> None:
        self._state[b] = HostBlockState.FREE
        self._hash[b] = None
        self._ids.put([b])

    # -- pins (loads reading a block) ------------------------------------------------------------
    def pin(self, block_ids: Iterable[int]) -> None:
        """Add a reference to cached or owned blocks that a load is about to read (they stop being evictable).

        Raises:
            ValueError: a block is free or being written; nothing changes.
        """
        ids = list(block_ids)
        for b in ids:
            self._check(b)
            if self._state[b] not in (HostBlockState.CACHED, HostBlockState.OWNED):
                raise ValueError(f"host block {b} is {self._state[b].value}; only cached or owned blocks can be read")
        for b in dict.fromkeys(ids):  # (each block once: a cached one leaves the LRU before any increment)
            if self._state[b] is HostBlockState.CACHED and self._ids.ref_count(b) == 0:
                del self._lru[b]
        self._ids.incref(ids)

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Drop a load's reference; a cached block with no reference left becomes evictable (most recent).

        Raises:
            ValueError: a block is not pinned; nothing changes.
        """
        for b in self._ids.decref(block_ids, verb="unpinned"):
            if self._state[b] is HostBlockState.CACHED:
                self._lru[b] = None

    # -- owned blocks (swap preemption) ----------------------------------------------------------
    def free_owned(self, block_ids: Iterable[int]) -> None:
        """Return a swapped request's blocks: owned blocks go to the free list; blocks still being written
        are freed when their copy is acknowledged (never reused before, C09).

        Raises:
            ValueError: a block is neither owned nor being written for an owner, or a load still reads it.
        """
        ids = list(block_ids)
        for b in ids:
            self._check(b)
            st = self._state[b]
            if not (st is HostBlockState.OWNED or (st is HostBlockState.WRITING and self._hash[b] is None)):
                raise ValueError(f"host block {b} is {st.value}, not owned by a swapped request")
            if self._ids.ref_count(b):
                raise ValueError(f"host block {b} is still read by {self._ids.ref_count(b)} load(s)")
        for b in ids:
            if self._state[b] is HostBlockState.WRITING:
                self._free_on_ack.add(b)
            else:
                self._to_free(b)

    # -- checks ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the module's invariants (O(num_blocks); for tests).

        Raises:
            AssertionError: an invariant is broken.
        """
        assert self.num_free + self.num_evictable + self.num_busy == self.num_blocks
        self._ids.validate()
        free = set(self._ids.free_ids())
        for b in range(self.num_blocks):
            st, r, h = self._state[b], self._ids.ref_count(b), self._hash[b]
            assert (b in free) == (st is HostBlockState.FREE), f"host block {b}: {st.value} vs free list"
            assert r >= 0
            if st is HostBlockState.CACHED:
                assert h is not None and self._index.get(h) == b, f"host block {b} cached but not indexed"
                assert (b in self._lru) == (r == 0), f"host block {b}: ref {r} vs LRU"
            else:
                assert b not in self._lru, f"host block {b} is {st.value} but evictable"
            if st is HostBlockState.FREE:
                assert h is None and r == 0
            if st is HostBlockState.WRITING and h is not None:
                assert self._writing_hash.get(h) == b
        assert len(self._index) == sum(s is HostBlockState.CACHED for s in self._state)
        assert all(self._state[b] is HostBlockState.WRITING for b in self._free_on_ack)
