"""``KVCache``: the one object the scheduler talks to about the KV cache; it decides everything, the worker executes.

Modelled on vLLM v1's ``KVCacheManager`` (and its coordinator over per-group managers), with the tier
connector's scheduler half called around it at fixed points. Tensor-free: what the worker must do comes out as a
plain-data :class:`~kvpage.cache.step_plan.KVStepPlan` (transfers and copy-on-write copies of a step) and
:class:`~kvpage.cache.step_plan.PassPlan` (block tables, slot mappings, seals and window slots of a forward pass).

A request's token regions and life (``bs`` = block size)::

    [0, device)                   match(req): device prefix hits, whole blocks, at most len-1 tokens
    [device, device + external)   match(req).loads: loaded by the connector into its first new blocks
    [.., num_tokens)              allocate(req, n, match): slots for tokens the model computes (None: no room)
    step_plan()                   the step's transfers and copies;  plan_pass(...) -> commit/abort: each pass
    cache(req, n)                 after a forward pass: full blocks inside [0, n) enter the prefix index
    rollback(req, n)              after a verification pass: keep n slots, blocks holding only rejected drafts go back
    free(req) / preempt(req)      finished or aborted / recompute (or swap) later; full blocks stay cached

The verbs: :meth:`~KVCache.match`, :meth:`~KVCache.can_allocate` / :meth:`~KVCache.allocate`,
:meth:`~KVCache.step_plan`, :meth:`~KVCache.plan_pass` / :meth:`~KVCache.commit` / :meth:`~KVCache.abort`,
:meth:`~KVCache.cache`, :meth:`~KVCache.free` / :meth:`~KVCache.preempt`, :meth:`~KVCache.rollback`,
:meth:`~KVCache.fork`, :meth:`~KVCache.poll`, :meth:`~KVCache.stats`, :meth:`~KVCache.subscribe`,
:meth:`~KVCache.reset`.

Invariants (checked after every operation by the state-machine test): free + evictable + in use + side = total
blocks; only full, written blocks are indexed (C15, C18), never a block still loading; a match never returns a
block whose tokens, prefix, salt or extra keys differ, even under a hash collision; ``allocate`` is all or nothing
(blocks and every group's side slots); once every request is freed and every held block released, no block is in
use.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from kvpage.cache.block_table import BlockTable
from kvpage.cache.events import KVEventBus
from kvpage.cache.groups import FullAttentionManager, GroupManager, SideNeed, manager_for
from kvpage.cache.hashing import DEFAULT_HASH_ALGO, BlockHasher, BlockHashFn
from kvpage.cache.prefix_cache import ROOT, BlockRemoved, KVCacheEvent, PrefixBlockPool
from kvpage.cache.prefix_index import PrefixIndex
from kvpage.cache.requests import KVCacheBlocks, KVCacheStats, KVUpdate, MatchResult, SupportsKVCache
from kvpage.cache.step_plan import KVStepPlan, PassPlan, PassRequest, TransferReport
from kvpage.cache.tiers.connector import ExternalMatch, KVConnectorScheduler
from kvpage.errors import KVPageError
from kvpage.spec import CacheSizing, CacheSpec

__all__ = ["KVCache", "PrefixMatch", "TierLoadError"]


class TierLoadError(KVPageError):
    """Issuing the loads of a request's prefix from a tier raised; the request holds no blocks any more.

    The scheduler then admits it again without tier hits (its prefix is recomputed); ``__cause__`` is the tier's
    exception.
    """


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A request's cached prefix: device hits, then blocks a tier can load (from :meth:`KVCache.match`).

    Attributes:
        device: the device hits.
        external: what the connector can load after them.
        compute_first: tokens to compute before matching again, else 0. A group may let tiers serve a prefix only
            behind device-resident first blocks (``int4``/``int2``: the first block's 8-bit copy never leaves the
            device); when the tiers hold the blocks after those, computing the first ones (their copy is made as
            they seal) and matching again turns the rest into loads instead of a whole recompute.
    """

    device: MatchResult = MatchResult()
    external: ExternalMatch = ExternalMatch()
    compute_first: int = 0

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Device blocks of the prefix."""
        return self.device.block_ids

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the device serves."""
        return self.device.num_cached_tokens

    @property
    def loads(self) -> tuple:
        """Where each loaded block comes from (:class:`~kvpage.cache.tiers.types.BlockLoad`)."""
        return self.external.loads

    @property
    def num_loaded_tokens(self) -> int:
        """Tokens the loads hold."""
        return self.external.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV need not be computed if every load succeeds."""
        return self.device.num_cached_tokens + self.external.num_tokens


@dataclass(slots=True)
class _Table:
    """One request's bookkeeping: its block table and how far it is indexed."""

    block_ids: list[int]
    num_tokens: int  # slots reserved
    num_cached_blocks: int  # block_ids[:num_cached_blocks] are indexed (or deduplicated / given up on)
    parent: int  # block that holds the prefix up to num_cached_blocks (ROOT at 0)
    anchors: list[int] = field(default_factory=list)  # extra refs on indexed twins of our duplicate blocks
    stop_caching: bool = False  # a hash collision stopped this request's chain


@dataclass(slots=True)
class _Loading:
    """A request admitted with tier loads in flight: its request object and its tokens once they land."""

    request: SupportsKVCache
    num_device_tokens: int
    num_external_tokens: int


class KVCache:
    """Prefix-cached paged KV bookkeeping for a scheduler: match, allocate, plan, cache, free.

    Args:
        num_blocks: device blocks in the pool.
        block_size: tokens per block.
        groups: one group manager per layer group (default one full-attention group); build them over ``pool``
            (or use :meth:`from_spec`).
        enable_caching: prefix caching on (default) or off (then nothing is hashed or indexed).
        hash_fn: block hash function of the ``kvpage`` scheme (default
            :func:`~kvpage.cache.hashing.hash_block_tokens`, SHA-256); tests pass colliding ones.
        prefix_caching_hash_algo: the block hash scheme, ``kvpage`` (default) or vLLM's ``sha256_cbor``
            (:class:`~kvpage.cache.hashing.BlockHasher`; its root reads ``PYTHONHASHSEED`` here, once).
        enable_events: buffer :class:`~kvpage.cache.prefix_cache.BlockStored` / ``BlockRemoved`` events for
            :meth:`drain_events` (subscribers of :meth:`subscribe` are called either way).
        max_buffered_events: the buffer keeps the newest this many events.
        connector: the tier connector's scheduler half, or ``None`` (no tiers).
        pool: the block pool the group managers were built over; default a new one of ``num_blocks``.

    Raises:
        ValueError: ``num_blocks < 0``, ``block_size <= 0``, no group, a pool of another size, or an unknown
            ``prefix_caching_hash_algo``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        groups: Sequence[GroupManager] | None = None,
        enable_caching: bool = True,
        hash_fn: BlockHashFn | None = None,
        prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO,
        enable_events: bool = False,
        max_buffered_events: int = 1_000_000,
        connector: KVConnectorScheduler | None = None,
        pool: PrefixBlockPool | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if pool is not None and pool.num_blocks != num_blocks:
            raise ValueError(f"the pool has {pool.num_blocks} blocks, not {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.pool = PrefixBlockPool(num_blocks) if pool is None else pool
        self.groups: tuple[GroupManager, ...] = tuple(groups) if groups is not None else (
            FullAttentionManager(None, self.pool),)
        if not self.groups:
            raise ValueError("a KVCache needs at least one group manager")
        self._by_name = {g.name: g for g in self.groups}
        self.connector = connector
        self.index = PrefixIndex(self.pool, block_size, BlockHasher(prefix_caching_hash_algo, hash_fn=hash_fn))
        self.events = KVEventBus(self.pool, buffer=enable_events, max_buffered=max_buffered_events,
                                 record_changes=connector is not None)
        self.events.subscribe(self._on_event)  # a block's death reaches every group at once
        self._tables: dict[str, _Table] = {}
        self._copies: list[tuple[str, int, int]] = []  # copy-on-write booked, not in a step plan yet
        self._promises: dict[str, list[tuple[GroupManager, SideNeed]]] = {}  # this step's side slots
        self._loading: dict[str, _Loading] = {}  # admitted with loads in flight
        # (a freed request, the blocks kept for its loads in flight) -> the id their window pins are held under
        self._holders: dict[tuple[str, tuple[int, ...]], str] = {}
        self._step = 0
        self._plan_ids = itertools.count()
        self._holder_ids = itertools.count()
        self._requests = self._queries = self._hits = self._stored = self._preemptions = 0
        self._device_hit_blocks = 0
        self._rematching: dict[str, int] = {}  # freed by rematch(): request id -> tokens it computed itself

    @classmethod
    def from_spec(cls, spec: CacheSpec, num_blocks: int, sizing: CacheSizing | None = None, *,
                  window_slots: int | None = None, enable_caching: bool = True, enable_events: bool = False,
                  connector: KVConnectorScheduler | None = None) -> KVCache:
        """A cache whose group managers follow ``spec``'s kinds (:func:`~kvpage.cache.groups.manager_for`) over a
        new pool of ``num_blocks`` blocks (``window_slots``: of a group whose rows are window slots, default the
        kind's count; the other keywords as the constructor's)."""
        pool = PrefixBlockPool(num_blocks)
        groups = [manager_for(g, sizing, pool=pool, num_window_slots=window_slots) for g in spec.groups]
        return cls(num_blocks, spec.block_size, groups=groups, pool=pool, enable_caching=enable_caching,
                   enable_events=enable_events, connector=connector)

    # -- views ---------------------------------------------------------------------------------------------

    def group(self, name: str) -> GroupManager:
        """The manager of layer group ``name`` (``KeyError`` if none)."""
        return self._by_name[name]

    @property
    def supports_swap(self) -> bool:
        """Whether every layer group's blocks may be swapped to the host tier and back (their kinds)."""
        return all(g.kind.supports_swap for g in self.groups)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens (``ValueError`` if negative)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds blocks (was allocated and not freed)."""
        return request_id in self._tables

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (vLLM's ``get_block_ids``; ``KeyError`` if it holds none)."""
        return tuple(self._tables[request_id].block_ids)

    def block_table(self, request_id: str) -> BlockTable:
        """A copy of the request's table (``KeyError`` if it holds none)."""
        st = self._tables[request_id]
        return BlockTable(self.block_size, list(st.block_ids), st.num_tokens)

    def is_loading(self, request: SupportsKVCache | str) -> bool:
        """Whether tier loads into the request's blocks are in flight (it must not be computed until :meth:`poll`
        reports them)."""
        rid = request if isinstance(request, str) else request.request_id
        return rid in self._loading

    def stats(self) -> KVCacheStats:
        """Counters since construction and block counts now (see :class:`~kvpage.cache.requests.KVCacheStats`), with
        the connector's counters nested in ``tiers`` and its hits merged into ``tier_hits``."""
        p = self.pool
        st = KVCacheStats(
            num_blocks=p.num_blocks, num_free=p.num_free, num_evictable=p.num_evictable, num_in_use=p.num_in_use,
            num_side=p.num_side, usage=p.usage, side_usage=p.side_usage, requests=self._requests,
            prefix_queries=self._queries,
            prefix_hits=self._hits, hit_rate=self._hits / self._queries if self._queries else 0.0,
            blocks_stored=self._stored, evictions=p.num_evictions, preemptions=self._preemptions,
            tier_hits={"device": self._device_hit_blocks},
        )
        if self.connector is None:
            return st
        tiers = self.connector.stats()
        return replace(st, tier_hits={**st.tier_hits, **tiers.tier_hits}, tiers=tiers)

    # -- events ------------------------------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every future ``BlockStored`` / ``BlockRemoved`` of the prefix index, in order;
        returns a function that unsubscribes it."""
        return self.events.subscribe(callback)

    def drain_events(self) -> Iterator[KVCacheEvent]:
        """Buffered events since the last drain, oldest first (empty unless ``enable_events=True``)."""
        return self.events.drain()

    def _on_event(self, event: KVCacheEvent) -> None:
        """An evicted block's content died: every group drops what it kept for it now."""
        if isinstance(event, BlockRemoved):
            for g in self.groups:
                g.on_blocks_dead([event.block_id], evicted=True)

    def _sync(self) -> None:
        """Hand the connector the blocks stored and evicted since the last call (none without one)."""
        if self.connector is None:
            return
        stored, evicted = self.events.take_changes()
        if stored or evicted:
            self.connector.on_block_changes(stored, evicted)

    # -- admission -----------------------------------------------------------------------------------------

    def match(self, request: SupportsKVCache, *, external: bool = True) -> PrefixMatch:
        """The longest cached prefix: device hits (vLLM's ``get_computed_blocks``), then what the connector can load
        after them.

        Device hits are whole blocks of at most ``len(all_token_ids) - 1`` tokens (the last token is always
        computed, for logits), each token-checked (a hash collision is a miss), shortened to what every group can
        read (:meth:`~kvpage.cache.groups.GroupManager.usable_prefix`). Loads follow when every group allows them
        and only up to an end every group can read (a sliding window's rows). ``external=False`` asks for the
        device hits only (a request whose tier load failed once). No side effects apart from extending
        ``request.block_hashes``.
        """
        device = MatchResult()
        max_blocks = max(len(request.all_token_ids) - 1, 0) // self.block_size
        if self.enable_caching and max_blocks:
            out = self.index.lookup_chain(request, max_blocks)
            usable = min(g.usable_prefix(out) for g in self.groups)
            device = MatchResult(tuple(out[:usable]), usable * self.block_size)
        c = self.connector
        if c is None or not external:
            return PrefixMatch(device)
        n = len(request.all_token_ids)
        d = len(device.block_ids)
        if not all(g.allows_external_prefix(d) for g in self.groups):
            return PrefixMatch(device, compute_first=self._compute_first(request, d, max_blocks))
        # hashed lookups (host tier, stores) only with prefix caching; a swapped-out request's own blocks always
        hashes: list[bytes] = []
        if self.enable_caching and max_blocks > d:
            hashes = self.index.block_hashes(request, max_blocks)[d:]
        ext = c.get_num_new_matched_tokens(request.request_id, hashes, device.num_cached_tokens, n - 1)
        if ext.loads:  # a sliding-window group reads the loads only up to an end whose window holds its rows
            windows = [ld.window for ld in ext.loads]
            usable = min(g.usable_external(device.block_ids, windows, ext.num_tokens) for g in self.groups)
            if usable < ext.num_tokens:
                ext = ExternalMatch(ext.loads[: -(-usable // self.block_size)], usable)
        return PrefixMatch(device, ext)

    def _compute_first(self, request: SupportsKVCache, num_device_blocks: int, max_blocks: int) -> int:
        """Tokens to compute before tiers may serve the request's prefix (see :attr:`PrefixMatch.compute_first`):
        the first block when the groups allow tiers behind one device block and a tier holds the next block
        by hash (a swapped-out request's own blocks are not looked for: freeing it would drop them); else 0.
        One lookup in the tiers, no other side effects."""
        c = self.connector
        if (c is None or num_device_blocks or not self.enable_caching or max_blocks < 2
                or not all(g.allows_external_prefix(1) for g in self.groups)):
            return 0
        hashes = self.index.block_hashes(request, max_blocks)[1:2]
        ext = c.get_num_new_matched_tokens(request.request_id, hashes, self.block_size, 2 * self.block_size)
        return self.block_size if ext.loads and ext.loads[0].tier != "swap" else 0

    @staticmethod
    def _split(match: PrefixMatch | MatchResult | None) -> tuple[MatchResult, ExternalMatch]:
        if isinstance(match, PrefixMatch):
            return match.device, match.external
        return match or MatchResult(), ExternalMatch()

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
                f"stale match for request {request.request_id!r}: a matched block was evicted since match; call "
                "match again right before allocate"
            )

    def _block_need(self, request: SupportsKVCache, end: int, device: MatchResult,
                    num_external: int) -> tuple[int, int]:
        """``(blocks to take from the pool, blocks available to take)`` for the request to hold ``end`` slots;
        validates the arguments."""
        st = self._tables.get(request.request_id)
        available = self.pool.num_free + self.pool.num_evictable
        if st is not None:
            cow = int(self._needs_copy(request.request_id, end))  # a forked partial block to copy first
            return max(0, self.blocks_for(end) - len(st.block_ids)) + cow, available
        if device.num_cached_tokens + num_external > len(request.all_token_ids):
            raise ValueError(f"{device.num_cached_tokens} cached + {num_external} external tokens exceed the "
                             f"request's {len(request.all_token_ids)} tokens")
        # matched blocks that are evictable now stop being evictable once referenced
        available -= sum(1 for b in device.block_ids if self.pool.ref_count(b) == 0)
        return self.blocks_for(end) - len(device.block_ids), available

    def _chunk(self, request: SupportsKVCache, num_new_tokens: int, match: PrefixMatch | MatchResult | None,
               num_lookahead: int, num_computed: int | None) -> tuple[MatchResult, ExternalMatch, int, Sequence[int]]:
        """``(device hits, loads, first position, blocks held)`` of a chunk; validates the arguments."""
        if num_new_tokens < 0 or num_lookahead < 0:
            raise ValueError(f"num_new_tokens and num_lookahead must be >= 0, got {num_new_tokens}, {num_lookahead}")
        device, ext = self._split(match)
        st = self._tables.get(request.request_id)
        if st is None:
            if ext.loads and self.connector is None:
                raise ValueError("a match with loads needs a KV connector (tiers)")
            self._check_match(request, device)
            return device, ext, device.num_cached_tokens + ext.num_tokens, device.block_ids
        if device.block_ids or ext.num_tokens:
            raise ValueError(f"request {request.request_id!r} already holds blocks; a prefix match and loads are "
                             "for admission")
        start = st.num_tokens if num_computed is None else num_computed
        if not 0 <= start <= st.num_tokens:
            raise ValueError(f"num_computed={num_computed} must be in [0, reserved slots {st.num_tokens}]")
        return device, ext, start, st.block_ids

    def _side_need(self, request: SupportsKVCache, held: Sequence[int], start: int, n: int,
                   num_draft: int) -> list[tuple[GroupManager, SideNeed]]:
        cow = request.request_id in self._tables and self._needs_copy(request.request_id, start + n)
        return [(g, g.slots_needed(request, held, start, n, num_draft=num_draft, copy_on_write=cow))
                for g in self.groups]

    def can_allocate(self, request: SupportsKVCache, num_new_tokens: int,
                     match: PrefixMatch | MatchResult | None = None, *, num_lookahead: int = 0,
                     num_computed: int | None = None) -> bool:
        """Whether :meth:`allocate` with the same arguments (not ``chunkable``) would succeed now: its blocks and
        every group's side slots (no side effects; the same errors)."""
        device, ext, start, held = self._chunk(request, num_new_tokens, match, num_lookahead, num_computed)
        end = start + num_new_tokens + num_lookahead
        need, available = self._block_need(request, end, device, ext.num_tokens)
        if need > available:
            return False
        protected = device.block_ids
        return all(g.fits(k, protected) for g, k in self._side_need(request, held, start, num_new_tokens + num_lookahead,
                                                                    num_lookahead))

    def allocate(
        self,
        request: SupportsKVCache,
        num_new_tokens: int,
        match: PrefixMatch | MatchResult | None = None,
        *,
        num_lookahead: int = 0,
        num_computed: int | None = None,
        chunkable: bool = False,
    ) -> KVCacheBlocks | None:
        """Reserve slots for a chunk of the request and promise its side slots to the step, all or none; admit the
        request (and issue its loads) on its first call.

        The first call references the matched blocks and reserves ``match.num_computed_tokens + num_new_tokens``
        slots (the first new blocks receive the loaded tokens); later calls reserve up to ``num_computed +
        num_new_tokens``. Blocks come from the free list, then by evicting cached unreferenced blocks, leaves
        first, LRU (vLLM v1). The chunk's side slots (tail slots of quantize-on-seal groups, window slots) are
        promised to the step first, so the allocation sees what is left and no pass runs short (as vLLM's
        coordinator sums what each group needs).

        Args:
            request: the request.
            num_new_tokens: tokens the step computes (>= 0; 0 takes no block, case C20).
            match: the result of :meth:`match` just before, on the first call only.
            num_lookahead: slots for draft tokens after the new ones (speculative decoding, vLLM's
                ``num_lookahead_tokens``); they count as the chunk's unverified drafts, and :meth:`rollback` gives back
                those of rejected drafts.
            num_computed: the chunk's first position for a request that holds blocks (default: its reserved slots).
            chunkable: when the side slots of ``num_new_tokens`` cannot be promised, take the longest chunk ending
                on a block boundary whose can (a block that fills is sealed and needs no open slot); never with a
                lookahead.

        Returns:
            The request's blocks with the chunk granted (``num_new_tokens``), or ``None`` when it does not fit;
            then nothing changed and the scheduler may preempt a request and retry. On the admitting call
            ``num_computed_tokens`` is the device hits plus the tokens the loads will bring, and ``loading`` says
            whether they are in flight (compute the chunk only after :meth:`poll` reports them).

        Raises:
            ValueError: negative counts; a match or loads for a request that holds blocks; a stale match (a matched
                block or a host source was evicted after :meth:`match`).
            TierLoadError: the connector raised while issuing the loads; the request's blocks are freed first.
        """
        device, ext, start, held = self._chunk(request, num_new_tokens, match, num_lookahead, num_computed)
        admitting = request.request_id not in self._tables
        if ext.loads:
            assert self.connector is not None
            self.connector.reserve_sources(ext)  # before any eviction: a write-back must not take the sources
        n = num_new_tokens
        promise = self._promise(request, held, start, n + num_lookahead, num_lookahead, device.block_ids)
        if promise is None and chunkable and not num_lookahead:  # the longest chunk ending on a block boundary
            end = (start + n) // self.block_size * self.block_size
            while promise is None and end > start:
                if end - start < n:
                    promise = self._promise(request, held, start, end - start, 0, device.block_ids)
                    n = end - start
                end -= self.block_size
        blocks = None if promise is None else self._reserve_blocks(request, start + n + num_lookahead, device, ext)
        if blocks is None:
            if promise is not None:
                self._unpromise(promise)
            if ext.loads:
                assert self.connector is not None
                self.connector.release_sources(ext)
            self._sync()
            return None
        assert promise is not None
        self._promises[request.request_id] = promise
        blocks = replace(blocks, num_new_tokens=n)
        if not admitting:
            self._sync()
            return blocks
        computed = device.num_cached_tokens + ext.num_tokens
        c = self.connector
        if c is not None:
            try:
                self._sync()
                hashes = request.block_hashes[: len(device.block_ids)]
                c.update_state_after_alloc(request.request_id, blocks.new_block_ids[: len(ext.loads)], ext,
                                           device.block_ids, hashes)
            except Exception as exc:
                self.free(request)
                raise TierLoadError(f"loading the cached prefix of request {request.request_id!r} from a tier "
                                    f"failed: {type(exc).__name__}: {exc}") from exc
            if ext.loads:
                self._loading[request.request_id] = _Loading(request, device.num_cached_tokens, ext.num_tokens)
        return replace(blocks, num_computed_tokens=computed, loading=bool(ext.loads))

    def _promise(self, request: SupportsKVCache, held: Sequence[int], start: int, n: int, num_draft: int,
                 protected: Sequence[int]) -> list[tuple[GroupManager, SideNeed]] | None:
        """Promise every group's side slots of a chunk (any earlier promise of the request this step is given back
        first), all or none; the cached blocks evicted for them go to the connector at once."""
        old = self._promises.pop(request.request_id, None)
        if old is not None:
            self._unpromise(old)
        need = self._side_need(request, held, start, n, num_draft)
        done: list[tuple[GroupManager, SideNeed]] = []
        for g, k in need:
            if not g.reserve(k, protected):
                self._unpromise(done)
                self._sync()
                return None
            done.append((g, k))
        self._sync()
        return done

    @staticmethod
    def _unpromise(promise: Sequence[tuple[GroupManager, SideNeed]]) -> None:
        for g, k in promise:
            g.unreserve(k)

    def _reserve_blocks(self, request: SupportsKVCache, end: int, device: MatchResult,
                        ext: ExternalMatch) -> KVCacheBlocks | None:
        """Reserve ``end`` slots for the request (the block half of :meth:`allocate`); ``None`` when the blocks do
        not fit after idle first-block copies gave theirs back."""
        need, available = self._block_need(request, end, device, ext.num_tokens)
        if need > available:
            if not sum(g.shrink(device.block_ids) for g in self.groups):
                return None
            need, available = self._block_need(request, end, device, ext.num_tokens)
            if need > available:
                return None
        rid = request.request_id
        st = self._tables.get(rid)
        if st is not None:
            copied: list[int] = []
            if self._needs_copy(rid, end):
                copied = [self._copy_on_write(rid)]
                need -= 1
            new = copied + self._take(max(need, 0))
            st.block_ids.extend(new[len(copied):])
            st.num_tokens = max(st.num_tokens, end)
            for g in self.groups:
                g.on_request_blocks(rid, st.block_ids, None)
            return KVCacheBlocks(tuple(st.block_ids), tuple(new), st.num_tokens)
        self.pool.touch(device.block_ids)
        new = self._take(max(need, 0))
        st = _Table(block_ids=[*device.block_ids, *new], num_tokens=end, num_cached_blocks=len(device.block_ids),
                    parent=device.block_ids[-1] if device.block_ids else ROOT)
        self._tables[rid] = st
        for g in self.groups:  # the hit ends after the loads: a window starts there
            g.on_request_blocks(rid, st.block_ids, device.num_cached_tokens + ext.num_tokens)
        own = self._rematching.pop(rid, None)  # admitted again after rematch(): counted once, its own blocks no hit
        if own is None:
            self._requests += 1
            self._queries += len(request.all_token_ids)
        hit_blocks = max(len(device.block_ids) - (own or 0) // self.block_size, 0)
        self._device_hit_blocks += hit_blocks
        self._hits += hit_blocks * self.block_size
        return KVCacheBlocks(tuple(st.block_ids), tuple(new), st.num_tokens)

    def _take(self, n: int) -> list[int]:
        """``n`` blocks from the pool; every group forgets what it kept for their old content."""
        new = self.pool.allocate(n)
        if new:
            for g in self.groups:
                g.on_blocks_dead(new)
        return new

    # -- after a forward pass ----------------------------------------------------------------------------------

    def cache(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """Index the request's blocks that became full now that KV is written for ``num_computed_tokens`` tokens.

        Only blocks lying entirely within the first ``num_computed_tokens`` tokens are indexed (C15, C18), as far
        as every group allows (:meth:`~kvpage.cache.groups.GroupManager.max_indexable_tokens`), never a block still
        loading; an equal block indexed already is referenced instead, and a hash collision stops the request's
        chain (:meth:`PrefixIndex.insert_chain`). The newly stored blocks go to the connector's write policy.

        Returns:
            Blocks newly indexed by this call.

        Raises:
            KeyError: the request holds no blocks.
            ValueError: ``num_computed_tokens`` is negative, exceeds the reserved slots or ``len(all_token_ids)``.
        """
        st = self._tables[request.request_id]
        if not 0 <= num_computed_tokens <= min(st.num_tokens, len(request.all_token_ids)):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} must be in [0, min(reserved slots {st.num_tokens}, "
                f"tokens {len(request.all_token_ids)})]"
            )
        if not self.enable_caching or st.stop_caching:
            return 0
        indexable = min(g.max_indexable_tokens(request, num_computed_tokens) for g in self.groups)
        num_full = indexable // self.block_size
        limit = None if self.connector is None else self.connector.loading_from(request.request_id)
        if limit is not None:
            num_full = min(num_full, limit)
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
        self._sync()
        return res.num_stored

    def rollback(self, request: SupportsKVCache | str, num_tokens: int) -> tuple[int, ...]:
        """Keep the request's first ``num_tokens`` reserved slots after a verification pass, dropping the rest::

            [0, num_cached_blocks * bs)   indexed blocks: never rolled back into (ValueError)
            [.., num_tokens)              kept: verified tokens
            [num_tokens, reserved)        dropped; blocks past blocks_for(num_tokens) go back to the pool

        The dropped blocks were never indexed: they return to the free list and every group hears of their death,
        then of the kept table (:meth:`~kvpage.cache.groups.GroupManager.on_rollback`) -- also when nothing is
        dropped (the *commit* after a verification step, when a quantize-on-seal group learns which provisional
        seals are verified). Returns the freed block ids in table order (maybe empty).

        Raises:
            KeyError: the request holds no blocks.
            ValueError: ``num_tokens`` below its indexed blocks' tokens or above its reserved slots.
        """
        rid = request if isinstance(request, str) else request.request_id
        st = self._tables[rid]
        indexed = st.num_cached_blocks * self.block_size
        if not indexed <= num_tokens <= st.num_tokens:
            raise ValueError(f"request {rid!r} cannot roll back to {num_tokens} tokens: it must keep its indexed "
                             f"{indexed} and holds {st.num_tokens} slots")
        keep = self.blocks_for(num_tokens)
        freed = st.block_ids[keep:]
        del st.block_ids[keep:]
        st.num_tokens = num_tokens
        if freed:
            self.pool.release(list(reversed(freed)))
            self._dead(freed)
        for g in self.groups:
            g.on_rollback(st.block_ids, num_tokens)
        self._sync()
        return tuple(freed)

    # -- fork and copy-on-write --------------------------------------------------------------------------------

    def fork_point(self, num_tokens: int) -> int:
        """The most of a request's first ``num_tokens`` tokens a fork may share: all of them when every group's kind
        copies a partial block on write, else the whole blocks."""
        if all(g.kind.copies_partial_blocks for g in self.groups):
            return num_tokens
        return num_tokens // self.block_size * self.block_size

    def fork(self, parent: SupportsKVCache | str, child: SupportsKVCache, num_tokens: int) -> bool:
        """Give ``child`` the parent's first ``num_tokens`` tokens by reference (parallel sampling: ``n`` completions
        over one prompt); ``False`` (nothing changed) when a group cannot serve the child from them.

        A fork's regions, for a child of ``n`` tokens::

            [0, n // bs * bs)    full blocks: shared by reference (never written again by anyone)
            [n // bs * bs, n)    the partial last block: shared until parent or child first writes into it; the
                                 writer then gets a copy of the whole block (K, V, every scale, every group)

        Every block holding them gains a reference (no block is taken from the pool, except the child's copy of a
        partial block the parent will write into), the child's table points at them and it resumes at
        ``num_tokens``. Every group hears of it (``on_fork``).

        Raises:
            KeyError: the parent holds no blocks.
            ValueError: the child holds blocks already, or ``num_tokens`` is outside ``[0, parent's tokens]``.
        """
        pid = parent if isinstance(parent, str) else parent.request_id
        st = self._tables[pid]
        if child.request_id in self._tables:
            raise ValueError(f"request {child.request_id!r} already holds blocks; fork needs a new request")
        if not 0 <= num_tokens <= st.num_tokens:
            raise ValueError(f"cannot fork {num_tokens} tokens of request {pid!r}, which holds {st.num_tokens}")
        ids = st.block_ids[:self.blocks_for(num_tokens)]
        if not all(g.can_fork(ids, num_tokens) for g in self.groups):
            return False
        # the parent holds slots past num_tokens in the shared partial block: it will write there without asking
        # for slots, so the child takes its copy of that block now
        eager = num_tokens % self.block_size != 0 and st.num_tokens > num_tokens
        if eager and self.pool.num_free + self.pool.num_evictable < 1:
            return False
        # the child also references the indexed twins the parent chained the duplicate blocks it shares onto (the
        # shared blocks indexed after a twin are that twin's cached children, kept in use); anchors follow the
        # parent's duplicates in table order, and its indexed range holds indexed blocks and duplicates only
        shared_full = min(num_tokens // self.block_size, st.num_cached_blocks)
        anchors = st.anchors[:sum(1 for b in st.block_ids[:shared_full] if self.pool.block_hash(b) is None)]
        self.pool.touch([*ids, *anchors])
        # the child indexes its full blocks itself (passing over those a sibling indexed, twins of duplicates)
        self._tables[child.request_id] = _Table(block_ids=list(ids), num_tokens=num_tokens, num_cached_blocks=0,
                                                parent=ROOT, anchors=list(anchors))
        for g in self.groups:
            g.on_fork(pid, child.request_id, ids, num_tokens)
        if eager:
            self._copy_on_write(child.request_id)
        self._sync()
        return True

    def _needs_copy(self, request_id: str, end: int) -> bool:
        """Whether the request's next write (reserving up to ``end`` slots) lands in a block another request still
        holds or that is indexed (a fork's partial block): then its allocation copies that block first (one more
        block). References kept only by pending copies do not count: those copies read the block before the step's
        first pass (:meth:`step_plan`), so its last holder writes into it in place (``n`` completions sharing a
        partial block make ``n - 1`` copies, not ``n``)."""
        st = self._tables.get(request_id)
        if st is None or end <= st.num_tokens or st.num_tokens % self.block_size == 0:
            return False
        idx = st.num_tokens // self.block_size
        if idx >= len(st.block_ids):
            return False
        b = st.block_ids[idx]
        pending = sum(1 for _, old, _ in self._copies if old == b)
        return self.pool.ref_count(b) - pending > 1 or self.pool.block_hash(b) is not None

    def _copy_on_write(self, request_id: str) -> int:
        """Replace the block the request's next write lands in by a fresh block and book the copy (the old block
        keeps the reference of the pending copy until the copy goes into a step plan); returns the fresh block."""
        st = self._tables[request_id]
        idx = st.num_tokens // self.block_size
        old, (new,) = st.block_ids[idx], self._take(1)
        st.block_ids[idx] = new
        self._copies.append((request_id, old, new))
        for g in self.groups:
            g.on_block_copied(request_id, old, new)
        return new

    def _drop_copies(self, request_id: str) -> None:
        """The request let go of its table before its booked copies went into a step plan: forget them and drop
        their sources' references (their destinations went with the table)."""
        mine = [(a, b) for r, a, b in self._copies if r == request_id]
        if mine:
            self._copies = [c for c in self._copies if c[0] != request_id]
            self._release_sources(mine)

    def _release_sources(self, pairs: Sequence[tuple[int, int]]) -> None:
        for g in self.groups:
            g.on_copies_applied(pairs)
        olds = [a for a, _ in pairs]
        self.pool.release(olds)
        self._dead(olds)

    # -- the step and its passes -------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new scheduling pass: the last step's unused side-slot promises are forgotten."""
        self._promises.clear()
        for g in self.groups:
            g.release()

    def step_plan(self) -> KVStepPlan:
        """The worker's part of the step scheduled since the last call: the connector's transfers (in issue order)
        and the copy-on-write copies (block ids, and window slots where a group's rows are slots). The copies'
        sources are released here: the worker copies them before anything can overwrite them (the next pass)."""
        self._step += 1
        pairs = [(a, b) for _, a, b in self._copies]
        window: list[tuple[int, int]] = []
        if pairs:
            rows = next((g for g in self.groups if g.kind.window_rows), None)
            if rows is not None:
                src, dst = rows.rows_of([a for a, _ in pairs]), rows.rows_of([b for _, b in pairs])
                window = [(a, b) for a, b in zip(src, dst) if a is not None and b is not None]
            self._copies = []
            self._release_sources(pairs)
        meta = self.connector.build_connector_meta() if self.connector is not None else None
        plan = KVStepPlan(self._step, copies=tuple(pairs), window_copies=tuple(window))
        return plan if meta is None else replace(plan, connector=meta)

    def plan_pass(self, requests: Sequence[PassRequest], *, groups: Sequence[str] | None = None,
                  final: bool = True) -> PassPlan:
        """Book one forward pass over ``requests`` in every group it runs (``groups``, default all) and return what
        the worker executes: per group the rows, slot mapping and seals (:class:`~kvpage.cache.step_plan.GroupPlan`).

        ``final``: the step's last pass over these groups. A drafter's earlier passes over the same layers (a
        layer-skip self-draft) are not: they keep the step's promised tail slots and everything a later pass
        reads, and do not move any window. Settle a final pass with :meth:`commit` after it ran, or :meth:`abort`
        when it raised (a non-final pass is settled when planned, or aborted).

        Raises:
            KeyError: an unknown group name.
            RuntimeError, KVPageError, OutOfBlocksError: a group could not plan the pass (nothing stays booked).
        """
        names = [g.name for g in self.groups] if groups is None else list(groups)
        managers = [self._by_name[n] for n in names]
        done: list[GroupManager] = []
        plans = []
        try:
            for m in managers:
                plans.append(m.plan(requests, final))
                done.append(m)
        except BaseException:
            for m in done:
                m.abort()
            raise
        return PassPlan(next(self._plan_ids), self.block_size, tuple(requests), tuple(plans), final)

    def commit(self, plan: PassPlan) -> None:
        """The pass ran: every group it booked frees what it retired (tail slots every layer has read)."""
        for g in plan.groups:
            self._by_name[g.group].commit()

    def abort(self, plan: PassPlan) -> None:
        """The pass raised (some layers may not have run): every group keeps what a re-run of the same tokens needs
        (their writes are idempotent)."""
        for g in plan.groups:
            self._by_name[g.group].abort()

    # -- tiers ---------------------------------------------------------------------------------------------------

    def poll(self, report: TransferReport | None = None) -> KVUpdate:
        """Hand the connector the worker's report of finished transfers and settle what it means: loaded blocks are
        indexed and their requests ready; a load cut short at read time leaves its request to compute from where
        the KV ends (or, where a group cannot compute on from there, frees it to be recomputed whole); held blocks
        whose loads ended go back (C10). Without tiers it does nothing.
        """
        c = self.connector
        if c is None:
            return KVUpdate()
        up = c.update_connector_output(report or TransferReport())
        for rid, ids in up.released:
            self._release_held(rid, ids)
        ready: list[str] = []
        cut: dict[str, int] = {}
        recompute: list[str] = []
        for rid, arrived in up.loaded.items():
            ld = self._loading.pop(rid, None)
            if ld is None or rid not in self._tables:
                continue
            self._hits += arrived
            computed = ld.num_device_tokens + arrived
            if arrived >= ld.num_external_tokens:
                ready.append(rid)
                self.cache(ld.request, min(computed, self._tables[rid].num_tokens, len(ld.request.all_token_ids)))
                continue
            if not all(g.kind.loads_may_stop_short for g in self.groups):
                self.free(ld.request)
                recompute.append(rid)
                continue
            self._tables[rid].num_tokens = computed  # the rest is computed: re-reserving it takes no block
            self.cache(ld.request, computed)
            cut[rid] = computed
        self._sync()
        return KVUpdate(tuple(ready), cut, tuple(recompute))

    def _release_held(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Give back blocks a freed request kept for its loads (their loads ended or were abandoned)."""
        holder = self._holders.pop((request_id, tuple(block_ids)), None)
        if holder is not None:
            for g in self.groups:
                g.on_request_freed(holder)
        if block_ids:
            self.pool.release(list(block_ids))
            self._dead(block_ids)

    # -- leaving ------------------------------------------------------------------------------------------------

    def free(self, request: SupportsKVCache | str) -> bool:
        """Release the request's blocks (finished or aborted); returns whether it held any.

        Tail first, then the indexed twins it referenced, so its deepest cached blocks are evicted first; cached
        blocks become evictable, others free. ``block_hashes`` are kept (a preempted request re-hits its prefix).
        Blocks still receiving loads stay referenced until their loads end or their deadline passes (C10).
        """
        self._rematching.pop(request if isinstance(request, str) else request.request_id, None)
        return self._free(request, preempted=False)

    def rematch(self, request: SupportsKVCache | str, num_computed_tokens: int) -> bool:
        """Release the request's blocks to admit it again at once (:attr:`PrefixMatch.compute_first`: its first
        ``num_computed_tokens`` tokens were computed so that the tiers may serve the rest); returns whether it held
        any. As :meth:`free`, except that the next admission counts in the stats neither as another request nor
        as a device hit on the blocks it computed itself."""
        rid = request if isinstance(request, str) else request.request_id
        held = self._free(request, preempted=False)
        self._rematching[rid] = num_computed_tokens
        return held

    def _free(self, request: SupportsKVCache | str, *, preempted: bool) -> bool:
        rid = request if isinstance(request, str) else request.request_id
        ld = self._loading.pop(rid, None)
        held: tuple[int, ...] = ()
        if self.connector is not None:
            held = self.connector.request_finished(rid, preempted=preempted)
        st = self._tables.pop(rid, None)
        promise = self._promises.pop(rid, None)
        if promise is not None:
            self._unpromise(promise)
        if st is None:
            return False
        keep = set(held)
        if held and ld is not None:  # the held blocks keep the window slots their loads write (C10)
            holder = f"{rid}\x00held{next(self._holder_ids)}"
            self._holders[(rid, tuple(held))] = holder
            for g in self.groups:
                g.on_fork(rid, holder, st.block_ids, ld.num_device_tokens + ld.num_external_tokens)
        for g in self.groups:
            g.on_request_freed(rid)
        ids = [b for b in st.block_ids if b not in keep]
        # one call: an indexed twin can be a parent of our blocks or a child of them
        self.pool.release([*reversed(ids), *reversed(st.anchors)])
        self._dead(ids)
        self._drop_copies(rid)  # copies it booked this step and will not need
        self._sync()
        return True

    def _dead(self, block_ids: Sequence[int]) -> None:
        """Tell every group which of ``block_ids`` died (not cached, no longer referenced)."""
        dead = [b for b in block_ids if not self.pool.is_live(b)]
        if dead:
            for g in self.groups:
                g.on_blocks_dead(dead)

    def preempt(self, request: SupportsKVCache | str, num_computed_tokens: int | None = None) -> bool:
        """Free a running request to resume it later (vLLM v1), counting a preemption if it held blocks.

        Its indexed blocks stay cached, so its next :meth:`match` hits them unless evicted. In swap mode (a host
        tier, every group's kind able to swap, no load in flight for it) the blocks holding its first
        ``num_computed_tokens`` tokens are first copied to host blocks it owns, and its next :meth:`match` returns
        them as loads; it is recomputed when the host tier has no room or ``num_computed_tokens`` is not given.

        Raises:
            ValueError: ``num_computed_tokens`` outside ``(0, reserved slots]``.
        """
        rid = request if isinstance(request, str) else request.request_id
        st = self._tables.get(rid)
        if st is None:
            return False
        c = self.connector
        if c is not None and num_computed_tokens and self.supports_swap and rid not in self._loading:
            if not 0 < num_computed_tokens <= st.num_tokens:
                raise ValueError(f"num_computed_tokens={num_computed_tokens} must be in (0, {st.num_tokens}]")
            # a block copied on write that no step plan has copied yet holds nothing: its source holds the KV
            # (referenced until the copy is dropped below, and no pass runs before the swap-out reads it)
            pending = {new: old for r, old, new in self._copies if r == rid}
            blocks = [pending.get(b, b) for b in st.block_ids[: self.blocks_for(num_computed_tokens)]]
            c.swap_out(rid, blocks, num_computed_tokens)
        self._free(request, preempted=True)
        self._preemptions += 1
        return True

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` evictable cached blocks (leaves first, LRU); returns how many (``write_back``
        saves them first; ``ValueError`` if < 0)."""
        n = len(self.pool.evict(num_blocks))
        self._sync()
        return n

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block (vLLM's ``reset_prefix_cache``; blocks in use stay); returns how many."""
        n = len(self.pool.evict_all())
        self._sync()
        return n

    def reset(self) -> None:
        """The device tensors were re-allocated: evict every cached block and reset every group manager.

        Raises:
            RuntimeError: a request still holds blocks.
        """
        if self._tables or self.pool.num_in_use:
            raise RuntimeError(f"reset() needs an idle cache; {len(self._tables)} requests hold blocks")
        self.reset_prefix_cache()
        for g in self.groups:
            g.reset()
