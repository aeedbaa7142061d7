"""``KVCacheManager``: the scheduler's only interface to the KV cache (prefix matching, slots, freeing).

Modelled on vLLM v1's ``KVCacheManager`` (``get_computed_blocks`` /
``allocate_slots`` / ``cache_blocks`` / ``free``) over the tensor-free
:class:`~kvpage.cache.prefix_cache.PrefixBlockPool`; block ids index the
tensors the :class:`~kvpage.cache.controller.CacheController` allocated.

One request's life (``bs`` = block size)::

    m = mgr.match_prefix(req)                          # cached full blocks, at most len-1 tokens
    blocks = mgr.allocate_slots(req, n_new, m)         # None: not enough blocks (preempt someone, retry)
    ... forward pass writes KV for tokens [m.num_cached_tokens, m.num_cached_tokens + n_new) ...
    mgr.cache_blocks(req, num_computed_tokens)         # newly full, written blocks enter the index
    req.all_token_ids.append(next_token)               # decode step:
    mgr.allocate_slots(req, 1); forward; mgr.cache_blocks(req, len(req.all_token_ids))
    mgr.free(req)                                      # finished or aborted (mgr.preempt(req) to recompute later)

Invariants (tested after every operation by the state-machine test):

* ``num_free_blocks + num_evictable_blocks + num_in_use_blocks == num_blocks``;
* a block is indexed only after :meth:`KVCacheManager.cache_blocks` reports
  its KV written, and only full blocks are hashed (cases C15, C18);
* a match never returns a block whose tokens (or any earlier token of the
  chain, salt or extra keys) differ from the request's, even under a hash
  collision;
* :meth:`KVCacheManager.allocate_slots` is atomic: it returns ``None`` and
  changes nothing when the blocks don't fit;
* once every request is freed, ``num_in_use_blocks == 0`` (after :meth:`KVCacheManager.poll`
  has returned blocks held for aborted loads).

Tiers (optional ``offload=``, an :class:`~kvpage.cache.tiers.connector.OffloadManager`):
:meth:`~KVCacheManager.match_prefix` continues past the device hits into the
host tier and the stores (``MatchResult.loads``); :meth:`~KVCacheManager.allocate_slots`
loads those blocks into fresh device blocks, which :meth:`~KVCacheManager.cache_blocks`
then indexes like computed ones once the load is acknowledged (C18: nothing is
indexed before its KV is there); newly cached blocks go to the write policy;
evicted ones to ``write_back``; :meth:`~KVCacheManager.preempt` swaps out in
``swap`` mode. Device blocks loading for a request that is freed stay in use
until their load completes or the deadline passes (:meth:`~KVCacheManager.poll`, case C10).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvpage.cache.block_pool import BlockTable
from kvpage.cache.hashing import BlockHashFn, hash_block_tokens, root_hash
from kvpage.cache.prefix_cache import ROOT, BlockKey, BlockRemoved, BlockStored, KVCacheEvent, PrefixBlockPool

if TYPE_CHECKING:
    from kvpage.cache.tiers.connector import BlockLoad, OffloadManager
    from kvpage.cache.tiers.transfer import Transfer

__all__ = [
    "BlockRemoved",
    "BlockStored",
    "KVCacheBlocks",
    "KVCacheEvent",
    "KVCacheManager",
    "KVCacheStats",
    "KVRequest",
    "MatchResult",
    "SupportsKVCache",
]


@runtime_checkable
class SupportsKVCache(Protocol):
    """What the manager reads from a request (the engine's sequence type can implement it).

    Attributes:
        request_id: unique id.
        all_token_ids: prompt then output tokens so far; append-only.
        cache_salt: per-tenant salt or ``None``; requests with different salts never share blocks.
        extra_keys: values mixed into every block hash and key (adapter id, multimodal digests, ...).
        block_hashes: chained hashes of the request's full blocks, filled in and
            extended by the manager (like vLLM's ``Request.block_hashes``); they
            survive preemption. Never edit it.
    """

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None
    extra_keys: tuple
    block_hashes: list[bytes]


@dataclass(slots=True)
class KVRequest:
    """A request as the KV-cache manager sees it (tensor-free). See :class:`SupportsKVCache`."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    extra_keys: tuple = ()
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a request (from :meth:`KVCacheManager.match_prefix`).

    Attributes:
        block_ids: cached device blocks holding the prefix, in order.
        num_cached_tokens: ``len(block_ids) * block_size`` tokens served by the device tier.
        loads: the blocks after those, held by a lower tier (host, stores, or the
            request's own swapped-out blocks); loaded into fresh device blocks by
            :meth:`KVCacheManager.allocate_slots`.
        num_loaded_tokens: tokens ``loads`` hold (``len(loads) * block_size``,
            except a swap-in's last block, which may be partial).
    """

    block_ids: tuple[int, ...] = ()
    num_cached_tokens: int = 0
    loads: tuple[BlockLoad, ...] = ()
    num_loaded_tokens: int = 0

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV need not be computed if every load succeeds: ``num_cached_tokens + num_loaded_tokens``."""
        return self.num_cached_tokens + self.num_loaded_tokens


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """A request's blocks after :meth:`KVCacheManager.allocate_slots`.

    Attributes:
        block_ids: the request's whole block table, in order (token ``t`` lives
            in ``block_ids[t // block_size]``).
        new_block_ids: blocks this call took from the pool (already-cached
            prefix blocks it referenced are not included).
        num_tokens: slots reserved for the request, in tokens.
        num_computed_tokens: on the admitting call, tokens whose KV is in the
            cache: device hits plus the loads that succeeded (a store record
            that misses at read time cuts the loaded run; the scheduler computes
            from here). ``None`` on later calls. Not part of equality.
    """

    block_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    num_tokens: int
    num_computed_tokens: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Counters of :meth:`KVCacheManager.stats` (vLLM's ``PrefixCacheStats`` + block counts).

    Attributes:
        num_blocks, num_free, num_evictable, num_in_use: block counts now.
        usage: ``num_in_use / num_blocks``.
        requests: requests admitted (a preempted request counts again when readmitted).
        prefix_queries: tokens of admitted requests, in tokens (vLLM's ``queries``).
        prefix_hits: of those, tokens served from the prefix cache.
        hit_rate: ``prefix_hits / prefix_queries`` (0.0 without queries).
        blocks_stored: blocks that entered the index.
        evictions: cached blocks evicted.
        preemptions: requests preempted.
        tier_hits: tier -> blocks served to admitted requests: ``device`` always; with
            tiers also ``host`` and each store (``disk``, ``redis``).
        tier_bytes: direction -> payload bytes moved between tiers (``device_to_host``,
            ``host_to_device``, ``store_read``, ``store_write``).
        store_rejected: stored records refused (checksum, layout or key mismatch), all stores.
        store_errors: failed store I/O operations, all stores.
        num_host_blocks, num_host_free, num_host_evictable, num_host_busy: host tier block counts now.
        swapped_out_blocks, swapped_in_blocks: blocks moved by swap preemption.
        num_orphaned_blocks: device blocks held for loads of freed requests (now; case C10).
        pending_transfers: block copies issued and not yet acknowledged (now).
    """

    num_blocks: int
    num_free: int
    num_evictable: int
    num_in_use: int
    usage: float
    requests: int
    prefix_queries: int
    prefix_hits: int
    hit_rate: float
    blocks_stored: int
    evictions: int
    preemptions: int
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_bytes: dict[str, int] = field(default_factory=dict)
    store_rejected: int = 0
    store_errors: int = 0
    num_host_blocks: int = 0
    num_host_free: int = 0
    num_host_evictable: int = 0
    num_host_busy: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    num_orphaned_blocks: int = 0
    pending_transfers: int = 0


@dataclass(slots=True)
class _ReqState:
    """Per-request bookkeeping: the block table and how far it is indexed."""

    block_ids: list[int]
    num_tokens: int  # slots reserved
    num_cached_blocks: int  # block_ids[:num_cached_blocks] are indexed (or deduplicated / given up on)
    parent: int  # block that holds the prefix up to num_cached_blocks (ROOT at 0)
    extra: tuple  # (cache_salt, extra_keys)
    anchors: list[int] = field(default_factory=list)  # extra refs on indexed twins of our duplicate blocks
    stop_caching: bool = False  # a hash collision stopped this request's chain
    loads: list[Transfer] = field(default_factory=list)  # copies into block_ids[load_start:load_end] in flight
    load_start: int = 0  # first block receiving a load
    load_end: int = 0  # one past the last block receiving a load


@dataclass(slots=True)
class _Orphan:
    """Device blocks of a freed request still receiving loads (case C10)."""

    block_ids: list[int]
    transfers: list[Transfer]
    deadline: float


class KVCacheManager:
    """Prefix-cached paged KV bookkeeping for a scheduler: match, allocate, cache, free.

    Args:
        num_blocks: device blocks in the pool.
        block_size: tokens per block.
        enable_caching: prefix caching on (default) or off (then nothing is hashed or indexed).
        hash_fn: block hash function (:func:`~kvpage.cache.hashing.hash_block_tokens`,
            SHA-256); tests pass colliding ones.
        enable_events: buffer :class:`BlockStored`/:class:`BlockRemoved` events for
            :meth:`drain_events` (subscribers of :meth:`subscribe` are called either way).
        max_buffered_events: the buffer keeps the newest this many events.
        offload: the tiers below the device (host tier, stores, swap preemption), or ``None``.

    Raises:
        ValueError: ``num_blocks < 0`` or ``block_size <= 0``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_fn: BlockHashFn = hash_block_tokens,
        enable_events: bool = False,
        max_buffered_events: int = 1_000_000,
        offload: OffloadManager | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self._events: deque[KVCacheEvent] | None = deque(maxlen=max_buffered_events) if enable_events else None
        self._subscribers: list[Callable[[KVCacheEvent], None]] = []
        self.pool = PrefixBlockPool(num_blocks)
        self._wire_events()
        self._reqs: dict[str, _ReqState] = {}
        self._requests = self._queries = self._hits = self._stored = self._preemptions = 0
        self._device_hit_blocks = 0
        self.offload = offload
        #: If set, a prefix match is kept only when its first block passes this check, and tiers are
        #: consulted only after a device hit on the first block. Quantize-on-seal formats read a
        #: request's first block through an 8-bit copy kept beside the pool (kvpage.cache.tail) that
        #: neither survives its eviction nor travels through the tiers; matching without it would
        #: read the block at 4 or 2 bits and answer differently than computing it.
        self.first_block_ok: Callable[[int], bool] | None = None
        #: When False, only blocks made entirely of prompt tokens are indexed for reuse (the request's
        #: ``num_prompt_tokens``). Quantize-on-seal formats compute generated tokens reading their open
        #: block at 16 bits, a prefill of the same tokens reads it sealed, so reusing those blocks as a
        #: later prompt's prefix would answer differently than computing it.
        self.index_generated_blocks = True
        self._loading: dict[str, tuple[SupportsKVCache, int]] = {}  # request id -> (request, tokens computed once loaded)
        self._orphans: list[_Orphan] = []
        if offload is not None:
            self.subscribe(self._on_pool_event)

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
        """Blocks some request references."""
        return self.pool.num_in_use

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's ``kv_cache_usage``; evictable blocks are not in use)."""
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens.

        Raises:
            ValueError: ``num_tokens < 0``.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def stats(self) -> KVCacheStats:
        """Counters since construction (see :class:`KVCacheStats`)."""
        p = self.pool
        o = self.offload.stats() if self.offload is not None else None
        tiers = {} if o is None else dict(
            tier_bytes=o.tier_bytes, store_rejected=o.store_rejected, store_errors=o.store_errors,
            num_host_blocks=o.num_host_blocks, num_host_free=o.num_host_free,
            num_host_evictable=o.num_host_evictable, num_host_busy=o.num_host_busy,
            swapped_out_blocks=o.swapped_out_blocks, swapped_in_blocks=o.swapped_in_blocks,
            pending_transfers=o.pending_transfers,
        )
        return KVCacheStats(
            num_blocks=p.num_blocks,
            num_free=p.num_free,
            num_evictable=p.num_evictable,
            num_in_use=p.num_in_use,
            usage=p.usage,
            requests=self._requests,
            prefix_queries=self._queries,
            prefix_hits=self._hits,
            hit_rate=self._hits / self._queries if self._queries else 0.0,
            blocks_stored=self._stored,
            evictions=p.num_evictions,
            preemptions=self._preemptions,
            tier_hits={"device": self._device_hit_blocks, **({} if o is None else o.tier_hits)},
            num_orphaned_blocks=sum(len(x.block_ids) for x in self._orphans),
            **tiers,
        )

    # -- per-request views -----------------------------------------------------------------------

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds blocks (was allocated and not freed)."""
        return request_id in self._reqs

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table.

        Raises:
            KeyError: unknown (or freed) request.
        """
        return tuple(self._reqs[request_id].block_ids)

    def block_table(self, request_id: str) -> BlockTable:
        """A copy of the request's table as a :class:`~kvpage.cache.block_pool.BlockTable` (for slot mappings).

        Raises:
            KeyError: unknown (or freed) request.
        """
        st = self._reqs[request_id]
        return BlockTable(self.block_size, list(st.block_ids), st.num_tokens)

    # -- hashing ---------------------------------------------------------------------------------

    def _hashes(self, request: SupportsKVCache, num_blocks: int) -> list[bytes]:
        """``request.block_hashes``, extended to at least ``num_blocks`` full blocks (never a partial one)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        if len(hashes) > len(tokens) // bs:
            raise ValueError(
                f"request {request.request_id!r} has {len(hashes)} block hashes but only {len(tokens)} tokens; "
                "all_token_ids must be append-only"
            )
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else root_hash(request.cache_salt)
            for i in range(len(hashes), num_blocks):
                parent = self.hash_fn(parent, tokens[i * bs : (i + 1) * bs], request.extra_keys)
                hashes.append(parent)
        return hashes

    def _key(self, request: SupportsKVCache, i: int, parent: int, extra: tuple) -> BlockKey:
        """Block ``i``'s index key: ``(parent block, its tokens, (salt, extra keys))``."""
        bs = self.block_size
        return (parent, tuple(request.all_token_ids[i * bs : (i + 1) * bs]), extra)

    # -- the scheduler's verbs -------------------------------------------------------------------

    def match_prefix(self, request: SupportsKVCache) -> MatchResult:
        """The longest chain of cached full blocks whose tokens equal the request's (vLLM's ``get_computed_blocks``).

        At most ``len(all_token_ids) - 1`` tokens, block aligned: the last token
        is always computed so that the step yields logits. Each hit is checked
        against the stored tokens, parent block, salt and extra keys, so a hash
        collision is a miss. Takes no reference (side-effect free apart from
        extending ``request.block_hashes``); pass the result straight to
        :meth:`allocate_slots`. Stats are counted when the request is admitted.

        With tiers, the match continues past the device hits: the next blocks
        held by the host tier or a store become ``loads`` (one batched
        ``exists`` probe per store); a request swapped out by :meth:`preempt`
        gets its own host blocks back as loads (its whole computed prefix,
        partial last block included).

        Returns:
            The matched blocks (empty with caching off, except a swap-in).
        """
        n = len(request.all_token_ids)
        max_blocks = max(n - 1, 0) // self.block_size
        out: list[int] = []
        if self.enable_caching and max_blocks:
            hashes = self._hashes(request, max_blocks)
            extra = (request.cache_salt, request.extra_keys)
            parent = ROOT
            for i in range(max_blocks):
                b = self.pool.lookup(hashes[i], self._key(request, i, parent, extra))
                if b is None:
                    break
                out.append(b)
                parent = b
        if self.first_block_ok is not None and out and not self.first_block_ok(out[0]):
            out = []  # recompute the whole prefix rather than read the first block without its copy
        d = len(out)
        bs = self.block_size
        if self.offload is not None and not (self.first_block_ok is not None and d == 0):
            swap = self.offload.swap_loads(request.request_id, d, n - 1, bs)
            if swap is not None:
                loads, num_tokens = swap
                return MatchResult(tuple(out), d * bs, tuple(loads), max(num_tokens - d * bs, 0))
            if self.enable_caching and d < max_blocks:
                loads = self.offload.lookup(request.block_hashes[d:max_blocks])
                return MatchResult(tuple(out), d * bs, tuple(loads), len(loads) * bs)
        return MatchResult(tuple(out), d * bs)

    def _check_match(self, request: SupportsKVCache, match: MatchResult) -> None:
        """Raise if ``match`` is no longer what the index holds (a block was evicted since)."""
        if match.num_cached_tokens != len(match.block_ids) * self.block_size:
            raise ValueError("match.num_cached_tokens must be len(match.block_ids) * block_size")
        if match.loads:
            if self.offload is None:
                raise ValueError("a match with loads needs a manager with tiers (offload)")
            if self.blocks_for(match.num_computed_tokens) - len(match.block_ids) != len(match.loads):
                raise ValueError(f"match of {match.num_computed_tokens} tokens does not fit its {len(match.loads)} loads")
            if match.num_computed_tokens > len(request.all_token_ids) - 1:
                raise ValueError(f"match of {match.num_computed_tokens} tokens is not valid for this request")
            self.offload.check_loads(match.loads)
        if not match.block_ids:
            return
        if not self.enable_caching or match.num_computed_tokens > len(request.all_token_ids) - 1:
            raise ValueError(f"match of {match.num_computed_tokens} tokens is not valid for this request")
        hashes = self._hashes(request, len(match.block_ids))
        extra = (request.cache_salt, request.extra_keys)
        parent = ROOT
        for i, b in enumerate(match.block_ids):
            if self.pool.lookup(hashes[i], self._key(request, i, parent, extra)) != b:
                raise ValueError(
                    f"stale match for request {request.request_id!r}: block {b} was evicted since "
                    "match_prefix; call match_prefix again right before allocate_slots"
                )
            parent = b

    def _plan(self, request: SupportsKVCache, num_new_tokens: int, match: MatchResult | None) -> tuple[int, int]:
        """``(blocks to take from the pool, blocks available to take)``; validates the arguments."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        st = self._reqs.get(request.request_id)
        available = self.pool.num_free + self.pool.num_evictable
        if st is not None:
            if match is not None and match.block_ids:
                raise ValueError(f"request {request.request_id!r} already holds blocks; a prefix match is for admission")
            return self.blocks_for(st.num_tokens + num_new_tokens) - len(st.block_ids), available
        m = match or MatchResult()
        self._check_match(request, m)
        need = self.blocks_for(m.num_computed_tokens + num_new_tokens) - len(m.block_ids)
        # matched blocks that are evictable now stop being evictable once referenced
        available -= sum(1 for b in m.block_ids if self.pool.ref_count(b) == 0)
        return need, available

    def can_allocate(self, request: SupportsKVCache, num_new_tokens: int, match: MatchResult | None = None) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed now. No side effects.

        Raises:
            ValueError: as :meth:`allocate_slots`.
        """
        need, available = self._plan(request, num_new_tokens, match)
        return need <= available

    def allocate_slots(
        self, request: SupportsKVCache, num_new_tokens: int, match: MatchResult | None = None
    ) -> KVCacheBlocks | None:
        """Reserve slots for ``num_new_tokens`` more tokens of the request; admit it on its first call.

        On the first call (the request holds no blocks) the matched prefix
        blocks are referenced (leaving the evictable set) and the request's
        slots start after them: it then holds ``match.num_cached_tokens +
        num_new_tokens`` slots. Later calls (decode steps, prefill chunks) add
        ``num_new_tokens`` slots after the reserved ones. New blocks come from
        the free list first, then by evicting cached unreferenced blocks, leaves
        first, least recently used first (vLLM v1 ``allocate_slots``).

        Args:
            request: the request.
            num_new_tokens: tokens to reserve slots for (>= 0; 0 takes no block, case C20).
            match: the result of :meth:`match_prefix` just before, on the first call only.

        Returns:
            The request's blocks, or ``None`` when they don't fit in free +
            evictable blocks (not counting matched ones); then nothing changed
            and the scheduler may preempt a request and retry.

        With tiers, the first call also loads ``match.loads`` into the first
        new blocks (host hits are swapped in, store records read and
        scattered); ``num_computed_tokens`` of the result says how many tokens
        really arrived (a store record missing at read time cuts the run; the
        request then holds slots for ``num_computed_tokens + num_new_tokens``
        tokens and already owns the blocks for the rest, so extending it by the
        shortfall takes no block). The loaded full blocks are indexed once their copy is acknowledged (at once
        with synchronous copies, else by :meth:`poll`).

        Raises:
            ValueError: ``num_new_tokens < 0``; a match given for a request that
                already holds blocks; a stale match (a matched block was evicted
                after :meth:`match_prefix`).
        """
        need, available = self._plan(request, num_new_tokens, match)
        if need > available:
            return None
        st = self._reqs.get(request.request_id)
        if st is not None:
            new = self.pool.allocate(max(need, 0))
            st.block_ids.extend(new)
            st.num_tokens += num_new_tokens
            return KVCacheBlocks(tuple(st.block_ids), tuple(new), st.num_tokens)
        m = match or MatchResult()
        offload = self.offload
        if m.loads:
            assert offload is not None
            offload.pin_sources(m.loads)  # before allocating: a write-back eviction must not take them
        self.pool.touch(m.block_ids)
        new = self.pool.allocate(max(need, 0))
        st = _ReqState(
            block_ids=[*m.block_ids, *new],
            num_tokens=m.num_computed_tokens + num_new_tokens,
            num_cached_blocks=len(m.block_ids),
            parent=m.block_ids[-1] if m.block_ids else ROOT,
            extra=(request.cache_salt, request.extra_keys),
        )
        self._reqs[request.request_id] = st
        d = len(m.block_ids)
        computed = m.num_cached_tokens
        if m.loads:
            assert offload is not None
            res = offload.begin_loads(request.request_id, m.loads, new[: len(m.loads)])
            if res.num_loaded == len(m.loads):
                computed = m.num_computed_tokens
            else:  # cut short: slots start at what arrived; the blocks after it stay allocated for the recompute
                computed += res.num_loaded * self.block_size
                st.num_tokens = computed + num_new_tokens
            st.load_start, st.load_end = d, d + res.num_loaded
            st.loads = [t for t in res.transfers if not t.acknowledged]
            if st.loads:
                self._loading[request.request_id] = (request, computed)
        if offload is not None:
            offload.drop_swapped(request.request_id)  # swapped out, but the device still held all of it
        if d and offload is not None:
            offload.on_device_hits(m.block_ids, request.block_hashes[:d])
        self._device_hit_blocks += d
        self._requests += 1
        self._queries += len(request.all_token_ids)
        self._hits += computed
        if computed > m.num_cached_tokens and not st.loads:
            self.cache_blocks(request, computed)  # loaded blocks are written: index them like computed ones
        return KVCacheBlocks(tuple(st.block_ids), tuple(new), st.num_tokens, computed)

    def cache_blocks(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """Index the request's blocks that became full now that KV is written for ``num_computed_tokens`` tokens.

        Call after each forward pass. Only blocks lying entirely within the
        first ``num_computed_tokens`` tokens are hashed and indexed (a partial
        block never is, C15; a block still being prefilled never is, C18).
        When another block with the same tokens and prefix is already indexed
        (two requests computed it concurrently), that entry stays and the
        request's copy is not indexed (vLLM); the request then references the
        indexed twin until it is freed, so its later blocks can chain onto it.
        A hash collision (same hash, other contents) stops indexing this
        request's chain.

        Args:
            request: an allocated request.
            num_computed_tokens: tokens of ``all_token_ids`` whose KV is now written.

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
        num_full = num_computed_tokens // self.block_size
        if not self.index_generated_blocks:
            num_full = min(num_full, getattr(request, "num_prompt_tokens", len(request.all_token_ids)) // self.block_size)
        if st.loads and not all(t.acknowledged for t in st.loads):
            num_full = min(num_full, st.load_start)  # blocks still loading hold no KV yet (C18)
        if num_full <= st.num_cached_blocks:
            return 0
        hashes = self._hashes(request, num_full)
        stored = 0
        new_ids: list[int] = []
        new_hashes: list[bytes] = []
        for i in range(st.num_cached_blocks, num_full):
            b = st.block_ids[i]
            holder = self.pool.insert(b, hashes[i], self._key(request, i, st.parent, st.extra))
            if holder is None:  # collision: another prefix owns this hash
                st.stop_caching = True
                break
            if holder == b:
                stored += 1
                new_ids.append(b)
                new_hashes.append(hashes[i])
            else:  # an equal block is indexed already: chain onto it
                self.pool.touch([holder])
                st.anchors.append(holder)
            st.parent = holder
            st.num_cached_blocks = i + 1
        self._stored += stored
        if new_ids and self.offload is not None:
            self.offload.on_cached(new_ids, new_hashes)
        return stored

    def free(self, request: SupportsKVCache | str) -> bool:
        """Release the request's blocks (finished or aborted); unknown requests are ignored.

        Blocks are released tail first (then the indexed twins it referenced),
        so a request's deepest cached blocks are the first evicted; cached
        blocks become evictable, others return to the free list. The request's
        ``block_hashes`` are kept (a preempted request re-hits its prefix).

        Returns:
            Whether the request held blocks.
        """
        rid = request if isinstance(request, str) else request.request_id
        if self.offload is not None:
            self.offload.drop_swapped(rid)  # a swapped-out request that finished or was aborted while waiting
        return self._release(rid)

    def _release(self, rid: str) -> bool:
        """Release a request's device blocks; blocks still receiving loads are held as orphans (C10)."""
        st = self._reqs.pop(rid, None)
        if st is None:
            return False
        self._loading.pop(rid, None)
        ids = st.block_ids
        pending = [t for t in st.loads if not t.acknowledged]
        if pending:
            held = ids[st.load_start : st.load_end]
            ids = ids[: st.load_start] + ids[st.load_end :]
            assert self.offload is not None
            self._orphans.append(_Orphan(list(held), pending, self.offload.clock() + self.offload.config.load_deadline_s))
        # one call: an indexed twin can be a parent of our blocks or a child of them
        self.pool.release([*reversed(ids), *reversed(st.anchors)])
        return True

    def preempt(self, request: SupportsKVCache | str, num_computed_tokens: int | None = None) -> bool:
        """Free a running request to resume it later; counts a preemption.

        ``recompute`` (vLLM v1's only mode, the default): its written full
        blocks stay cached (if :meth:`cache_blocks` saw them), so its next
        :meth:`match_prefix` hits them unless they were evicted.

        ``swap`` (``OffloadConfig.preemption_mode``, vLLM v0's ``preemption_mode="swap"``
        with ``swap_space``): the blocks holding its first ``num_computed_tokens``
        tokens are first copied to host blocks it owns; its next
        :meth:`match_prefix` returns them as loads (after whatever of its
        prefix is still cached on the device). Falls back to recompute when
        the host tier has no room or ``num_computed_tokens`` is not given.

        Args:
            request: the request or its id.
            num_computed_tokens: tokens whose KV the request has written (needed for ``swap``).

        Returns:
            Whether the request held blocks (only then is a preemption counted).
        """
        rid = request if isinstance(request, str) else request.request_id
        st = self._reqs.get(rid)
        if st is None:
            return False
        o = self.offload
        if o is not None and o.config.preemption_mode == "swap" and num_computed_tokens:
            if not 0 < num_computed_tokens <= st.num_tokens:
                raise ValueError(f"num_computed_tokens={num_computed_tokens} must be in (0, {st.num_tokens}]")
            if st.loads:
                o.wait(st.loads)  # its blocks must hold their KV before they are copied out
                self.poll()
            o.swap_out(rid, st.block_ids[: self.blocks_for(num_computed_tokens)], num_computed_tokens)
        self._release(rid)
        self._preemptions += 1
        return True

    # -- tiers: completions -----------------------------------------------------------------------

    def poll(self) -> None:
        """Acknowledge finished copies and act on them: index blocks whose load completed, return blocks of
        freed requests whose load completed or whose deadline passed (a late completion is then ignored, C10).

        The engine calls it once per step; without tiers it does nothing.
        """
        o = self.offload
        if o is None:
            return
        o.poll()
        for rid, (req, computed) in list(self._loading.items()):
            st = self._reqs[rid]
            if all(t.acknowledged for t in st.loads):
                del self._loading[rid]
                st.loads = []
                self.cache_blocks(req, min(computed, st.num_tokens, len(req.all_token_ids)))
        if self._orphans:
            now = o.clock()
            keep: list[_Orphan] = []
            for orphan in self._orphans:
                if all(t.acknowledged or t.cancelled for t in orphan.transfers):
                    self.pool.release(orphan.block_ids)
                elif now >= orphan.deadline:
                    for t in orphan.transfers:
                        o.cancel(t)
                    self.pool.release(orphan.block_ids)
                else:
                    keep.append(orphan)
            self._orphans = keep

    def is_loading(self, request: SupportsKVCache | str) -> bool:
        """Whether blocks are still being loaded for the request (its forward pass must wait)."""
        rid = request if isinstance(request, str) else request.request_id
        return rid in self._loading

    def wait_for_loads(self, requests: Sequence[SupportsKVCache | str] | None = None) -> None:
        """Block until the loads of ``requests`` (default all) are done, then :meth:`poll`.

        Copies issued before those loads finish first (one copy stream, see
        :meth:`~kvpage.cache.tiers.transfer.TransferQueue.wait`).
        """
        if self.offload is None or not self._loading:
            return
        rids = list(self._loading) if requests is None else [r if isinstance(r, str) else r.request_id for r in requests]
        todo = [t for rid in rids if rid in self._loading for t in self._reqs[rid].loads]
        if todo:
            self.offload.wait(todo)
        self.poll()

    def fence(self) -> None:
        """Block until every block copy issued so far is done, then :meth:`poll` (the engine calls it before a
        forward pass: loads into the batch's blocks have landed, and backups reading blocks the pass will
        overwrite have read them). Free with synchronous copies and without tiers.
        """
        if self.offload is None or not self.offload.queue.num_pending:
            return
        self.offload.wait()
        self.poll()

    def _on_pool_event(self, event: KVCacheEvent) -> None:
        """Device eviction hook: runs before an evicted block's id is handed out again."""
        if isinstance(event, BlockRemoved) and self.offload is not None:
            self.offload.on_device_evicted(event.block_id, event.block_hash)

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` evictable cached blocks (leaves first, LRU) to the free list.

        Returns:
            Blocks evicted.

        Raises:
            ValueError: ``num_blocks < 0``.
        """
        return len(self.pool.evict(num_blocks))

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block (vLLM's ``reset_prefix_cache``); blocks in use stay cached.

        Returns:
            Blocks evicted.
        """
        return len(self.pool.evict_all())

    # -- events ----------------------------------------------------------------------------------

    def _wire_events(self) -> None:
        """Build events only when someone listens (the pool skips them otherwise)."""
        self.pool.on_event = self._emit if (self._events is not None or self._subscribers) else None

    def _emit(self, event: KVCacheEvent) -> None:
        if self._events is not None:
            self._events.append(event)
        for cb in self._subscribers:
            cb(event)

    def subscribe(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every future :class:`BlockStored` / :class:`BlockRemoved`, in order.

        Returns:
            A function that unsubscribes it.
        """
        self._subscribers.append(callback)
        self._wire_events()

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)
            self._wire_events()

        return unsubscribe

    def drain_events(self) -> Iterator[KVCacheEvent]:
        """Buffered events since the last drain, oldest first (empty unless ``enable_events=True``).

        The buffer is emptied as the iterator is consumed.
        """
        buf = self._events
        while buf:
            yield buf.popleft()
