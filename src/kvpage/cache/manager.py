"""``KVCacheManager``: the device blocks of every request — prefix matching, slots, indexing, freeing.

Modelled on vLLM v1's ``KVCacheManager`` over the tensor-free
:class:`~kvpage.cache.prefix_cache.PrefixBlockPool`, with one
:class:`~kvpage.cache.groups.GroupManager` per layer group for what differs
between kinds of layers. Tiers are not here: the scheduler calls the tier
connector around this class (:class:`~kvpage.engine.kv_cache.SchedulerKVCache`).

A request's token regions and life::

    [0, num_cached)          m = match_prefix(req): device hits, whole blocks, at most len-1 tokens
    [num_cached, +external)  allocate_slots(req, n, m, num_external_tokens=e): blocks a tier loads
    [.., num_tokens)         slots for tokens the model computes (None: no room; preempt and retry)
    cache_blocks(req, n)     after a forward pass: full blocks inside [0, n) enter the prefix index
    rollback(req, n)         after a verification pass: keep n slots, blocks holding only rejected drafts go back
    free(req) / preempt(req) finished or aborted / recompute later (full blocks stay cached)

Invariants (checked after every operation by the state-machine test): free +
evictable + in use = total blocks; only full, written blocks are indexed (C15,
C18); a match never returns a block whose tokens, prefix, salt or extra keys
differ, even under a hash collision; ``allocate_slots`` is atomic; once every
request is freed and every held block released, no block is in use.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvpage.cache.block_table import BlockTable
from kvpage.cache.events import EventSource, KVEventBus
from kvpage.cache.groups import FullAttentionManager, GroupManager
from kvpage.cache.hashing import BlockHashFn, hash_block_tokens
from kvpage.cache.prefix_cache import ROOT, BlockRemoved, BlockStored, KVCacheEvent, PrefixBlockPool
from kvpage.cache.prefix_index import PrefixIndex
from kvpage.cache.side_slots import SideSlots
from kvpage.cache.req_state import _ReqState
from kvpage.cache.table_edits import TableEdits
from kvpage.cache.requests import KVCacheBlocks, KVCacheStats, KVRequest, MatchResult, SupportsKVCache

__all__ = ["BlockRemoved", "BlockStored", "KVCacheBlocks", "KVCacheEvent", "KVCacheManager", "KVCacheStats",
           "KVRequest", "MatchResult", "SupportsKVCache"]


class KVCacheManager(SideSlots, TableEdits, EventSource):
    """Prefix-cached paged KV bookkeeping for a scheduler: match, allocate, cache, free.

    Args:
        num_blocks: device blocks in the pool.
        block_size: tokens per block.
        groups: one group manager per layer group (default: one full-attention group).
        enable_caching: prefix caching on (default) or off (then nothing is hashed or indexed).
        hash_fn: block hash function (:func:`~kvpage.cache.hashing.hash_block_tokens`,
            SHA-256); tests pass colliding ones.
        enable_events: buffer :class:`BlockStored`/:class:`BlockRemoved` events for
            :meth:`drain_events` (subscribers of :meth:`subscribe` are called either way).
        max_buffered_events: the buffer keeps the newest this many events.
        record_block_changes: keep newly stored and evicted ``(block id, hash)`` pairs for
            :meth:`take_block_changes` (a tier connector needs them); off by default.
        pool: the block pool, when group managers were built over it (side space carved from it,
            :func:`~kvpage.cache.groups.manager_for`); default a new one of ``num_blocks``.

    Raises:
        ValueError: ``num_blocks < 0``, ``block_size <= 0``, no group, or a pool of another size.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        groups: Sequence[GroupManager] | None = None,
        enable_caching: bool = True,
        hash_fn: BlockHashFn = hash_block_tokens,
        enable_events: bool = False,
        max_buffered_events: int = 1_000_000,
        record_block_changes: bool = False,
        pool: PrefixBlockPool | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups: tuple[GroupManager, ...] = tuple(groups) if groups is not None else (FullAttentionManager(),)
        if not self.groups:
            raise ValueError("a KVCacheManager needs at least one group manager")
        if pool is not None and pool.num_blocks != num_blocks:
            raise ValueError(f"the pool has {pool.num_blocks} blocks, not {num_blocks}")
        self.pool = PrefixBlockPool(num_blocks) if pool is None else pool
        self.index = PrefixIndex(self.pool, block_size, hash_fn)
        self.events = KVEventBus(self.pool, buffer=enable_events, max_buffered=max_buffered_events,
                                 record_changes=record_block_changes)
        self._reqs: dict[str, _ReqState] = {}
        self._copies: list[tuple[str, int, int]] = []  # copy-on-write booked, not applied (TableEdits)
        if any(g.drops_on_eviction for g in self.groups):
            self.events.subscribe(self._on_event)
        self._requests = self._queries = self._hits = self._stored = self._preemptions = 0
        self._device_hit_blocks = 0

    # -- counts ----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free list (not cached, not referenced)."""
        return self.pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no request references (reusable on a hit, reclaimed on demand)."""
        return self.pool.num_evictable

    @property
    def num_in_use_blocks(self) -> int:
        """Blocks some request references (or :meth:`free` kept for a tier load)."""
        return self.pool.num_in_use

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's ``kv_cache_usage``; evictable blocks are not in use)."""
        return self.pool.usage

    @property
    def supports_swap(self) -> bool:
        """Whether every layer group's blocks may be swapped to the host tier and back."""
        return all(g.supports_swap for g in self.groups)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens (``ValueError`` if negative)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def is_live(self, block_id: int) -> bool:
        """Whether the block's content is still held: referenced, or cached and not evicted."""
        return self.pool.ref_count(block_id) > 0 or self.pool.block_hash(block_id) is not None

    def is_in_use(self, block_id: int) -> bool:
        """Whether some request references the block."""
        return self.pool.ref_count(block_id) > 0

    def stats(self) -> KVCacheStats:
        """Device counters since construction (see :class:`~kvpage.cache.requests.KVCacheStats`; ``tiers`` is ``None``)."""
        p = self.pool
        return KVCacheStats(
            num_blocks=p.num_blocks, num_free=p.num_free, num_evictable=p.num_evictable, num_in_use=p.num_in_use,
            num_side=p.num_side,
            usage=p.usage, requests=self._requests, prefix_queries=self._queries, prefix_hits=self._hits,
            hit_rate=self._hits / self._queries if self._queries else 0.0, blocks_stored=self._stored,
            evictions=p.num_evictions, preemptions=self._preemptions, tier_hits={"device": self._device_hit_blocks},
        )

    # -- per-request views -----------------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds blocks (was allocated and not freed)."""
        return request_id in self._reqs

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (``KeyError`` if it holds none)."""
        return tuple(self._reqs[request_id].block_ids)

    def block_table(self, request_id: str) -> BlockTable:
        """A copy of the request's table as a :class:`~kvpage.cache.block_table.BlockTable` (``KeyError`` if none)."""
        st = self._reqs[request_id]
        return BlockTable(self.block_size, list(st.block_ids), st.num_tokens)

    def block_hashes(self, request: SupportsKVCache, num_blocks: int) -> list[bytes]:
        """The request's chained hashes of its first ``num_blocks`` full blocks (see :class:`PrefixIndex`)."""
        return self.index.block_hashes(request, num_blocks)

    # -- the scheduler's verbs -------------------------------------------------------------------

    def match_prefix(self, request: SupportsKVCache) -> MatchResult:
        """The longest chain of cached full blocks whose tokens equal the request's (vLLM's ``get_computed_blocks``).

        At most ``len(all_token_ids) - 1`` tokens, block aligned (the last token
        is always computed, for logits); each hit is token-checked, so a hash
        collision is a miss; every group manager may shorten the match
        (:meth:`~kvpage.cache.groups.GroupManager.usable_prefix`). No side
        effects apart from extending ``request.block_hashes``.

        Returns:
            The matched blocks (empty with caching off).
        """
        max_blocks = max(len(request.all_token_ids) - 1, 0) // self.block_size
        if not self.enable_caching or not max_blocks:
            return MatchResult()
        out = self.index.lookup_chain(request, max_blocks)
        usable = min(g.usable_prefix(out) for g in self.groups)
        return MatchResult(tuple(out[:usable]), usable * self.block_size)

    def allows_external_prefix(self, match: MatchResult) -> bool:
        """Whether a tier may serve the blocks after ``match`` (every group manager agrees; a swap-in of the
        request's own blocks needs no prefix caching, a lookup by hash does: see :attr:`enable_caching`)."""
        return all(g.allows_external_prefix(len(match.block_ids)) for g in self.groups)

    def usable_external(self, match: MatchResult, windows: Sequence[bool], num_external_tokens: int) -> int:
        """Tokens of a tier's run after ``match`` that every group can read (the least of
        :meth:`~kvpage.cache.groups.GroupManager.usable_external`; ``windows`` per loaded block)."""
        return min(g.usable_external(match.block_ids, windows, num_external_tokens) for g in self.groups)

    @property
    def loads_may_stop_short(self) -> bool:
        """Whether every group can compute on from where a tier load was cut short at read time."""
        return all(g.loads_may_stop_short for g in self.groups)

    def _check_match(self, request: SupportsKVCache, match: MatchResult) -> None:
        """Raise if ``match`` is no longer what the index holds (a block was evicted since)."""
        if match.num_cached_tokens != len(match.block_ids) * self.block_size:
            raise ValueError("match.num_cached_tokens must be len(match.block_ids) * block_size")
        if not match.block_ids:
            return
        if not self.enable_caching or match.num_cached_tokens > len(request.all_token_ids) - 1:
            raise ValueError(f"match of {match.num_cached_tokens} tokens is not valid for this request")
        if self.index.lookup_chain(request, len(match.block_ids)) != list(match.block_ids):
            raise ValueError(
                f"stale match for request {request.request_id!r}: a matched block was evicted since "
                "match_prefix; call match_prefix again right before allocate_slots"
            )

    def _plan(self, request: SupportsKVCache, num_new_tokens: int, match: MatchResult | None,
              num_external_tokens: int) -> tuple[int, int]:
        """``(blocks to take from the pool, blocks available to take)``; validates the arguments."""
        if num_new_tokens < 0 or num_external_tokens < 0:
            raise ValueError(f"num_new_tokens and num_external_tokens must be >= 0, got {num_new_tokens}, "
                             f"{num_external_tokens}")
        st = self._reqs.get(request.request_id)
        available = self.pool.num_free + self.pool.num_evictable
        if st is not None:
            if (match is not None and match.block_ids) or num_external_tokens:
                raise ValueError(f"request {request.request_id!r} already holds blocks; a prefix match and "
                                 "external tokens are for admission")
            cow = int(self.needs_copy(request.request_id, num_new_tokens))  # a forked partial block to copy first
            return self.blocks_for(st.num_tokens + num_new_tokens) - len(st.block_ids) + cow, available
        m = match or MatchResult()
        self._check_match(request, m)
        if m.num_cached_tokens + num_external_tokens > len(request.all_token_ids):
            raise ValueError(f"{m.num_cached_tokens} cached + {num_external_tokens} external tokens exceed the "
                             f"request's {len(request.all_token_ids)} tokens")
        need = self.blocks_for(m.num_cached_tokens + num_external_tokens + num_new_tokens) - len(m.block_ids)
        # matched blocks that are evictable now stop being evictable once referenced
        available -= sum(1 for b in m.block_ids if self.pool.ref_count(b) == 0)
        return need, available

    def can_allocate(self, request: SupportsKVCache, num_new_tokens: int, match: MatchResult | None = None,
                     *, num_external_tokens: int = 0) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed now (no side effects; same errors)."""
        need, available = self._plan(request, num_new_tokens, match, num_external_tokens)
        return need <= available

    def allocate_slots(
        self,
        request: SupportsKVCache,
        num_new_tokens: int,
        match: MatchResult | None = None,
        *,
        num_external_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Reserve slots for ``num_new_tokens`` more tokens of the request; admit it on its first call.

        The first call references the matched blocks and reserves
        ``match.num_cached_tokens + num_external_tokens + num_new_tokens`` slots
        (the first new blocks receive the external tokens); later calls add
        ``num_new_tokens``. New blocks come from the free list, then by evicting
        cached unreferenced blocks, leaves first, LRU (vLLM v1); every group
        manager is told which ids were handed out.

        Args:
            request: the request.
            num_new_tokens: tokens to reserve slots for (>= 0; 0 takes no block, case C20).
            match: the result of :meth:`match_prefix` just before, on the first call only.
            num_external_tokens: tokens after the match whose KV a tier will load, first call only.

        Returns:
            The request's blocks, or ``None`` when they don't fit in free +
            evictable blocks (not counting matched ones); then nothing changed
            and the scheduler may preempt a request and retry.

        Raises:
            ValueError: negative counts; a match or external tokens for a request that
                already holds blocks; a stale match (a matched block was evicted after
                :meth:`match_prefix`).
        """
        need, available = self._plan(request, num_new_tokens, match, num_external_tokens)
        if need > available:
            keep = match.block_ids if match is not None else ()
            if not sum(g.side_shrink(self.is_in_use, keep) for g in self.groups):  # idle first-block copies
                return None
            need, available = self._plan(request, num_new_tokens, match, num_external_tokens)
            if need > available:
                return None
        st = self._reqs.get(request.request_id)
        if st is not None:
            copied: list[int] = []
            if self.needs_copy(request.request_id, num_new_tokens):
                copied = [self._copy_on_write(request.request_id)]
                need -= 1
            new = copied + self._take(max(need, 0))
            st.block_ids.extend(new[len(copied):])
            st.num_tokens += num_new_tokens
            for g in self.groups:
                g.on_request_blocks(request.request_id, st.block_ids, None)
            return KVCacheBlocks(tuple(st.block_ids), tuple(new), st.num_tokens)
        m = match or MatchResult()
        self.pool.touch(m.block_ids)
        new = self._take(max(need, 0))
        st = _ReqState(
            block_ids=[*m.block_ids, *new],
            num_tokens=m.num_cached_tokens + num_external_tokens + num_new_tokens,
            num_cached_blocks=len(m.block_ids),
            parent=m.block_ids[-1] if m.block_ids else ROOT,
        )
        self._reqs[request.request_id] = st
        for g in self.groups:  # the hit ends after the loads: a window starts there
            g.on_request_blocks(request.request_id, st.block_ids, m.num_cached_tokens + num_external_tokens)
        self._device_hit_blocks += len(m.block_ids)
        self._requests += 1
        self._queries += len(request.all_token_ids)
        self._hits += m.num_cached_tokens
        return KVCacheBlocks(tuple(st.block_ids), tuple(new), st.num_tokens)

    def _take(self, n: int) -> list[int]:
        """``n`` blocks from the pool; every group manager forgets what it kept for their old content."""
        new = self.pool.allocate(n)
        if new:
            for g in self.groups:
                g.on_blocks_allocated(new)
        return new

    def shrink_slots(self, request: SupportsKVCache, num_tokens: int) -> None:
        """Give back the last ``num_tokens`` reserved slots, keeping the blocks (a tier load was cut short: the
        tokens are computed instead, and re-reserving them takes no block). ``ValueError`` past the indexed ones."""
        st = self._reqs[request.request_id]
        if not 0 <= num_tokens <= st.num_tokens - st.num_cached_blocks * self.block_size:
            raise ValueError(f"cannot give back {num_tokens} of {st.num_tokens} slots")
        st.num_tokens -= num_tokens

    def num_tokens(self, request_id: str) -> int:
        """Slots the request holds, in tokens (``KeyError`` if it holds none)."""
        return self._reqs[request_id].num_tokens

    @property
    def records_block_changes(self) -> bool:
        """Whether :meth:`take_block_changes` is fed (``record_block_changes``)."""
        return self.events.records_changes

    def count_external_hits(self, num_tokens: int) -> None:
        """Count ``num_tokens`` (>= 0) tokens a tier served to the request just admitted as prefix hits."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self._hits += num_tokens

    def cache_blocks(self, request: SupportsKVCache, num_computed_tokens: int, *, max_blocks: int | None = None) -> int:
        """Index the request's blocks that became full now that KV is written for ``num_computed_tokens`` tokens.

        Only blocks lying entirely within the first ``num_computed_tokens``
        tokens are indexed (C15, C18), as far as every group manager allows
        (:meth:`~kvpage.cache.groups.GroupManager.max_indexable_tokens`); an
        equal block indexed already is referenced instead, and a hash collision
        stops the request's chain (:meth:`PrefixIndex.insert_chain`).

        Args:
            request: an allocated request.
            num_computed_tokens: tokens of ``all_token_ids`` whose KV is now written.
            max_blocks: index at most the first this many blocks (blocks a tier is still loading hold no KV yet).

        Returns:
            Blocks newly indexed by this call.

        Raises:
            KeyError: the request holds no blocks.
            ValueError: ``num_computed_tokens`` is negative, exceeds the reserved
                slots or ``len(all_token_ids)``.
        """
        st = self._reqs[request.request_id]
        if not 0 <= num_computed_tokens <= min(st.num_tokens, len(request.all_token_ids)):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} must be in [0, min(reserved slots {st.num_tokens}, "
                f"tokens {len(request.all_token_ids)})]"
            )
        if not self.enable_caching or st.stop_caching:
            return 0
        indexable = min(g.max_indexable_tokens(request, num_computed_tokens) for g in self.groups)
        num_full = indexable // self.block_size
        if max_blocks is not None:
            num_full = min(num_full, max_blocks)
        if num_full <= st.num_cached_blocks:
            return 0
        res = self.index.insert_chain(request, st.block_ids, st.num_cached_blocks, num_full, st.parent)
        if res.twins:
            # our blocks an equal indexed block stood in for, paired with it in order (insert_chain's twins)
            dups = [b for b in st.block_ids[st.num_cached_blocks:res.num_done] if self.pool.block_hash(b) is None]
            pairs = list(zip(dups, res.twins))
            for g in self.groups:
                g.on_blocks_deduplicated(pairs, self.pool.ref_count)
        st.anchors.extend(res.twins)
        st.parent, st.num_cached_blocks, st.stop_caching = res.parent, res.num_done, res.collided
        self._stored += res.num_stored
        return res.num_stored

    def free(self, request: SupportsKVCache | str, *, keep: Sequence[int] = ()) -> bool:
        """Release the request's blocks (finished or aborted); returns whether it held any.

        Tail first, then the indexed twins it referenced, so its deepest cached
        blocks are evicted first; cached blocks become evictable, others free.
        ``block_hashes`` are kept (a preempted request re-hits its prefix).
        ``keep``: its blocks that stay referenced because a tier still loads into
        them, given back by :meth:`release_held` (C10; ``ValueError`` if not its own).
        """
        rid = request if isinstance(request, str) else request.request_id
        st = self._reqs.get(rid)
        if st is None:
            return False
        held = set(keep)
        if not held <= set(st.block_ids):
            raise ValueError(f"blocks {sorted(held - set(st.block_ids))} to keep are not request {rid!r}'s")
        del self._reqs[rid]
        for g in self.groups:
            g.on_request_freed(rid)
        ids = [b for b in st.block_ids if b not in held]
        # one call: an indexed twin can be a parent of our blocks or a child of them
        self.pool.release([*reversed(ids), *reversed(st.anchors)])
        self._freed(ids)
        self._drop_copies(rid)  # copies it booked this step and will not need
        return True

    def release_held(self, block_ids: Sequence[int]) -> None:
        """Give back blocks a :meth:`free` kept (their load finished or was abandoned)."""
        if block_ids:
            self.pool.release(list(block_ids))
            self._freed(block_ids)

    def _freed(self, block_ids: Sequence[int]) -> None:
        """Tell every group manager which of ``block_ids`` died (not cached, no longer referenced)."""
        dead = [b for b in block_ids if not self.is_live(b)]
        if dead:
            for g in self.groups:
                g.on_blocks_freed(dead)

    def preempt(self, request: SupportsKVCache | str, *, keep: Sequence[int] = ()) -> bool:
        """:meth:`free` a running request to recompute it later (vLLM v1), counting a preemption if it held blocks.

        Its indexed blocks stay cached, so its next :meth:`match_prefix` hits
        them unless evicted (a swap preemption's ``swap_out`` runs before this).
        """
        if not self.free(request, keep=keep):
            return False
        self._preemptions += 1
        return True

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` evictable cached blocks (leaves first, LRU); returns how many (``ValueError`` if < 0)."""
        return len(self.pool.evict(num_blocks))

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block (vLLM's ``reset_prefix_cache``; blocks in use stay); returns how many."""
        return len(self.pool.evict_all())

    def reset(self) -> None:
        """The device tensors were re-allocated: evict every cached block and reset every group manager.

        Raises:
            RuntimeError: a request still holds blocks.
        """
        if self._reqs or self.pool.num_in_use:
            raise RuntimeError(f"reset() needs an idle cache; {len(self._reqs)} requests hold blocks")
        self.reset_prefix_cache()
        for g in self.groups:
            g.reset()
