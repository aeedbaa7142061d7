"""``SchedulerKVCache``: the device KV-cache manager with the tier connector called around it, in vLLM's order.

The scheduler speaks only to this class. Without tiers it passes straight
through to the :class:`~kvpage.cache.manager.KVCacheManager`; with a
:class:`~kvpage.cache.tiers.connector.KVConnector` it adds, at fixed points:

* **match**: after the device hits, the connector's ``get_num_new_matched_tokens``
  (host, stores, a swapped-out request's own blocks) -> :class:`TieredMatch`;
* **admit**: ``allocate_slots(num_external_tokens=...)``, then ``pin`` the sources,
  hand evictions to the write policy, and ``update_state_after_alloc`` starts the
  loads into the first new blocks (a source that misses cuts the run);
* **index**: ``cache_blocks`` stops before blocks still loading (C18); newly stored
  blocks go to the connector's write policy;
* **finish**: the connector keeps blocks still receiving loads (``request_finished``);
  ``poll`` gives them back once ``get_finished`` says so (C10);
* **preempt**: ``swap_out`` first in swap mode.

A request's token regions at admission (``bs`` = block size)::

    [0, device)                 match.block_ids: device prefix hits
    [device, device+external)   match.loads: loaded by the connector into the first new blocks
    [.., num_tokens)            computed by the model (from where the loads really ended)
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvpage.cache.manager import KVCacheEvent, KVCacheManager
from kvpage.cache.requests import KVCacheBlocks, KVCacheStats, MatchResult, SupportsKVCache
from kvpage.cache.tiers.connector import ExternalMatch, KVConnector
from kvpage.cache.tiers.types import BlockLoad
from kvpage.errors import KVPageError


def _lookahead(n: int) -> int:
    if n < 0:
        raise ValueError(f"num_lookahead_tokens must be >= 0, got {n}")
    return n


class TierLoadError(KVPageError):
    """Starting the loads of a request's prefix from a tier raised; the request holds no blocks any more.

    The scheduler then admits it again without tier hits (its prefix is recomputed); ``__cause__`` is the
    tier's exception.
    """


@dataclass(frozen=True, slots=True)
class TieredMatch:
    """A request's cached prefix: device hits, then blocks a tier can load.

    Attributes:
        device: the device hits.
        external: what the connector can load after them.
    """

    device: MatchResult = MatchResult()
    external: ExternalMatch = ExternalMatch()

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Device blocks of the prefix."""
        return self.device.block_ids

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the device serves."""
        return self.device.num_cached_tokens

    @property
    def loads(self) -> tuple[BlockLoad, ...]:
        """Where each loaded block comes from."""
        return self.external.loads

    @property
    def num_loaded_tokens(self) -> int:
        """Tokens the loads hold."""
        return self.external.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV need not be computed if every load succeeds."""
        return self.device.num_cached_tokens + self.external.num_tokens


class SchedulerKVCache:
    """The scheduler's KV interface: a :class:`KVCacheManager` plus an optional :class:`KVConnector`.

    Args:
        manager: the device bookkeeping (built with ``record_block_changes=True`` when a connector is given).
        connector: the tiers, or ``None``.
        copy_blocks: copies whole blocks ``(source, destination)`` in every layer's tensors (copy-on-write of a
            forked block, :meth:`apply_block_copies`); ``None``: forks share only what no one writes again.

    Raises:
        ValueError: a connector with a manager that does not record block changes.
    """

    def __init__(self, manager: KVCacheManager, connector: KVConnector | None = None,
                 copy_blocks: Callable[[Sequence[tuple[int, int]]], None] | None = None) -> None:
        if connector is not None and not manager.records_block_changes:
            raise ValueError("a KV connector needs a KVCacheManager built with record_block_changes=True")
        self.manager = manager
        self.connector = connector
        self._copy_blocks = copy_blocks
        self._loaded: dict[str, tuple[SupportsKVCache, int]] = {}  # request id -> (request, tokens once loaded)

    # -- read-through ------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.manager.block_size

    @property
    def num_blocks(self) -> int:
        """Device blocks."""
        return self.manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free device blocks."""
        return self.manager.num_free_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Cached, unreferenced device blocks."""
        return self.manager.num_evictable_blocks

    @property
    def num_in_use_blocks(self) -> int:
        """Referenced device blocks (held loads included)."""
        return self.manager.num_in_use_blocks

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use."""
        return self.manager.usage

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens."""
        return self.manager.blocks_for(num_tokens)

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table (``KeyError`` if it holds none)."""
        return self.manager.block_ids(request_id)

    def subscribe(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Subscribe to the device prefix index's events (see :meth:`KVCacheManager.subscribe`)."""
        return self.manager.subscribe(callback)

    def drain_events(self) -> Iterator[KVCacheEvent]:
        """Buffered device prefix-index events (see :meth:`KVCacheManager.drain_events`)."""
        return self.manager.drain_events()

    def stats(self) -> KVCacheStats:
        """Device counters with the tier counters nested in ``tiers`` and their hits merged into ``tier_hits``."""
        st = self.manager.stats()
        if self.connector is None:
            return st
        tiers = self.connector.stats()
        return replace(st, tier_hits={**st.tier_hits, **tiers.tier_hits}, tiers=tiers)

    # -- admission ---------------------------------------------------------------------------------
    def match_prefix(self, request: SupportsKVCache, *, external: bool = True) -> TieredMatch:
        """Device hits, then what the connector can load after them (see :meth:`KVCacheManager.match_prefix`).

        ``external=False`` asks for the device hits only (a request whose tier load failed once).
        """
        m = self.manager.match_prefix(request)
        c = self.connector
        if c is None or not external or not self.manager.allows_external_prefix(m):
            return TieredMatch(m)
        n = len(request.all_token_ids)
        max_blocks = max(n - 1, 0) // self.block_size
        d = len(m.block_ids)
        # hashed lookups (host tier, stores) only with prefix caching; a swapped-out request's own blocks always
        hashes: list[bytes] = []
        if self.manager.enable_caching and max_blocks > d:
            hashes = self.manager.block_hashes(request, max_blocks)[d:]
        ext = c.get_num_new_matched_tokens(request.request_id, hashes, m.num_cached_tokens, n - 1)
        if ext.loads:  # a sliding-window group reads the loads only up to an end whose window holds its rows
            usable = self.manager.usable_external(m, [ld.window for ld in ext.loads], ext.num_tokens)
            if usable < ext.num_tokens:
                ext = ExternalMatch(ext.loads[: -(-usable // self.block_size)], usable)
        return TieredMatch(m, ext)

    def _split(self, match: TieredMatch | MatchResult | None) -> tuple[MatchResult | None, ExternalMatch]:
        if isinstance(match, TieredMatch):
            if match.loads and self.connector is None:
                raise ValueError("a match with loads needs a KV connector (tiers)")
            return match.device, match.external
        return match, ExternalMatch()

    def can_allocate(self, request: SupportsKVCache, num_new_tokens: int,
                     match: TieredMatch | MatchResult | None = None, *, num_lookahead_tokens: int = 0) -> bool:
        """Whether :meth:`allocate_slots` would succeed now (no side effects; the lookahead slots count)."""
        m, ext = self._split(match)
        return self.manager.can_allocate(request, num_new_tokens + _lookahead(num_lookahead_tokens), m,
                                         num_external_tokens=ext.num_tokens)

    def side_reserve(self, request: SupportsKVCache, num_computed: int, num_new_tokens: int,
                     match: TieredMatch | MatchResult | None = None, *, num_draft: int = 0) -> tuple[int, ...] | None:
        """Promise a chunk's tail slots to the next forward pass (see :meth:`KVCacheManager.side_reserve`; the chunk's
        last ``num_draft`` tokens are unverified drafts); the cached blocks evicted for them go to the connector at
        once (the pass overwrites them)."""
        m, _ = self._split(match)
        need = self.manager.side_reserve(request, num_computed, num_new_tokens, m, num_draft=num_draft)
        self._sync_block_changes()
        return need

    def side_unreserve(self, need: Sequence[int]) -> None:
        """Give back a :meth:`side_reserve` promise."""
        self.manager.side_unreserve(need)

    def side_release(self) -> None:
        """Forget every promise of tail slots (before scheduling a step)."""
        self.manager.side_release()

    def side_slots_needed(self, request: SupportsKVCache, num_computed: int, num_new_tokens: int,
                          match: TieredMatch | MatchResult | None = None, *, num_draft: int = 0) -> tuple[int, ...]:
        """Per layer group, the tail slots a chunk takes in its step, its last ``num_draft`` tokens unverified (see
        :meth:`KVCacheManager.side_slots_needed`)."""
        m, _ = self._split(match)
        return self.manager.side_slots_needed(request, num_computed, num_new_tokens, m, num_draft=num_draft)

    def allocate_slots(
        self, request: SupportsKVCache, num_new_tokens: int, match: TieredMatch | MatchResult | None = None,
        *, num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Reserve slots (see :meth:`KVCacheManager.allocate_slots`); on admission also start the match's loads.

        ``num_lookahead_tokens`` (vLLM's name): slots for draft tokens after the new ones (speculative
        decoding), reserved with them, all or nothing; :meth:`rollback` gives back those of rejected drafts.

        Returns:
            The blocks, or ``None`` when they don't fit. On the admitting call
            ``num_computed_tokens`` says how many tokens really arrived: device
            hits plus the loads that succeeded (a store record that misses at
            read time cuts the loaded run; the request then holds slots for
            ``num_computed_tokens + num_new_tokens`` tokens and already owns the
            blocks for the rest, so extending it by the shortfall takes no block).

        Raises:
            ValueError: as :meth:`KVCacheManager.allocate_slots`; a stale load source.
            TierLoadError: the connector raised while pinning or starting the loads; the request's
                blocks are freed first (nothing is left allocated for it).
        """
        c = self.connector
        admitting = not self.manager.has_request(request.request_id)
        m, ext = self._split(match)
        if c is not None and ext.loads:
            c.check(ext)
        blocks = self.manager.allocate_slots(request, num_new_tokens + _lookahead(num_lookahead_tokens), m,
                                             num_external_tokens=ext.num_tokens)
        if blocks is None or not admitting:
            if blocks is not None:
                self._sync_block_changes()
            return blocks
        m = m or MatchResult()
        computed = m.num_cached_tokens
        if c is not None:
            try:
                if ext.loads:
                    c.pin(ext)  # before evictions reach the write policy: a write-back must not take the sources
                self._sync_block_changes()
                hashes = request.block_hashes[: len(m.block_ids)]
                loaded = c.update_state_after_alloc(request.request_id, blocks.new_block_ids[: len(ext.loads)],
                                                    ext, m.block_ids, hashes)
                if loaded < ext.num_tokens and not self.manager.loads_may_stop_short:
                    raise LookupError(f"a tier source missed at read time after {loaded} of {ext.num_tokens} "
                                      "tokens, and a sliding-window group cannot compute on from there")
            except Exception as exc:
                self.free(request)
                raise TierLoadError(f"loading the cached prefix of request {request.request_id!r} from a tier "
                                    f"failed: {type(exc).__name__}: {exc}") from exc
            computed += loaded
            self.manager.count_external_hits(loaded)
            if loaded < ext.num_tokens:  # cut short: slots start at what arrived
                self.manager.shrink_slots(request, ext.num_tokens - loaded)
                blocks = replace(blocks, num_tokens=blocks.num_tokens - (ext.num_tokens - loaded))
            if loaded:
                if c.loading_from(request.request_id) is None:
                    self.cache_blocks(request, computed)  # loaded blocks are written: index them like computed ones
                else:
                    self._loaded[request.request_id] = (request, computed)
        return replace(blocks, num_computed_tokens=computed)

    def fork_point(self, num_tokens: int) -> int:
        """The most of a request's first ``num_tokens`` tokens a fork may share: all of them when copy-on-write is
        possible here, else (no copier, or a group that cannot copy a partial block) the whole blocks."""
        if self._copy_blocks is not None and all(g.copies_partial_blocks for g in self.manager.groups):
            return num_tokens
        return num_tokens // self.block_size * self.block_size

    def fork(self, parent: SupportsKVCache | str, child: SupportsKVCache, num_tokens: int) -> bool:
        """Let ``child`` share the parent's first ``num_tokens`` tokens (:meth:`KVCacheManager.fork`); ``False``
        (nothing changed) when a group cannot serve the child from them (window slots gone)."""
        try:
            self.manager.fork(parent, child, num_tokens)
        except ValueError:
            return False
        return True

    def apply_block_copies(self) -> int:
        """Apply the copy-on-write copies booked while scheduling (before the forward pass); returns how many."""
        if self._copy_blocks is None:
            if self.manager.num_pending_copies:
                raise RuntimeError("copy-on-write booked with no block copier")
            return 0
        return self.manager.apply_block_copies(self._copy_blocks)

    def rollback(self, request: SupportsKVCache | str, num_tokens: int) -> tuple[int, ...]:
        """Keep the request's first ``num_tokens`` slots after a verification step, the rejected drafts' blocks back
        to the pool (see :meth:`KVCacheManager.rollback`: the commit too, when nothing is dropped); returns the
        freed block ids. Raises as it does."""
        freed = self.manager.rollback(request, num_tokens)
        self._sync_block_changes()
        return freed

    def is_loading(self, request: SupportsKVCache | str) -> bool:
        """Whether blocks are still being loaded for the request (its forward pass must wait)."""
        rid = request if isinstance(request, str) else request.request_id
        return self.connector is not None and self.connector.loading_from(rid) is not None

    # -- after a forward pass ----------------------------------------------------------------------
    def cache_blocks(self, request: SupportsKVCache, num_computed_tokens: int) -> int:
        """Index newly full blocks (see :meth:`KVCacheManager.cache_blocks`), never one still loading (C18)."""
        c = self.connector
        limit = None if c is None else c.loading_from(request.request_id)
        n = self.manager.cache_blocks(request, num_computed_tokens, max_blocks=limit)
        self._sync_block_changes()
        return n

    def _sync_block_changes(self) -> None:
        """Hand the manager's newly evicted and stored blocks to the connector, evictions first (none without one)."""
        if self.connector is None:
            return
        stored, evicted = self.manager.take_block_changes()
        if evicted:
            self.connector.on_blocks_evicted(evicted)
        if stored:
            self.connector.on_blocks_stored(stored)

    def poll(self) -> None:
        """Acknowledge finished copies: index blocks whose load landed, give back held blocks (C10).

        The engine calls it once per step; without tiers it does nothing.
        """
        c = self.connector
        if c is None:
            return
        done = c.get_finished()
        for rid in done.loaded:
            entry = self._loaded.pop(rid, None)
            if entry is not None and self.manager.has_request(rid):
                req, computed = entry
                self.cache_blocks(req, min(computed, self.manager.num_tokens(rid), len(req.all_token_ids)))
        self.manager.release_held(done.released)

    def wait_for_loads(self, requests: Sequence[SupportsKVCache | str] | None = None) -> None:
        """Block until the loads of ``requests`` (default all) are done, then :meth:`poll`."""
        if self.connector is None:
            return
        rids = None if requests is None else [r if isinstance(r, str) else r.request_id for r in requests]
        self.connector.wait(rids)
        self.poll()

    def fence(self) -> None:
        """Block until every copy issued so far is done, then :meth:`poll` (before each forward pass: loads into the
        batch's blocks have landed, and backups reading blocks the pass overwrites have read them)."""
        if self.connector is None or not self.connector.num_pending:
            return
        self.connector.wait()
        self.poll()

    # -- leaving -----------------------------------------------------------------------------------
    def free(self, request: SupportsKVCache | str) -> bool:
        """Release the request's blocks; the connector keeps those still receiving loads (C10)."""
        rid = request if isinstance(request, str) else request.request_id
        return self.manager.free(request, keep=self._finish_loads(rid, preempted=False))

    def _finish_loads(self, rid: str, *, preempted: bool) -> tuple[int, ...]:
        """Forget the request's pending indexing; the device blocks the connector keeps for loads still in flight."""
        if self.connector is None:
            return ()
        self._loaded.pop(rid, None)
        return self.connector.request_finished(rid, preempted=preempted)

    def preempt(self, request: SupportsKVCache | str, num_computed_tokens: int | None = None) -> bool:
        """Free a running request to resume it later (see :meth:`KVCacheManager.preempt`).

        In swap mode (with a host tier, and every group able to swap) the blocks
        holding its first ``num_computed_tokens`` tokens are first copied to host
        blocks it owns; its next :meth:`match_prefix` returns them as loads.
        Falls back to recompute when the host tier has no room or ``num_computed_tokens`` is not given.

        Raises:
            ValueError: ``num_computed_tokens`` outside ``(0, reserved slots]``.
        """
        rid = request if isinstance(request, str) else request.request_id
        c = self.connector
        if not self.manager.has_request(rid):
            return False
        if c is not None and num_computed_tokens and self.manager.supports_swap:
            reserved = self.manager.num_tokens(rid)
            if not 0 < num_computed_tokens <= reserved:
                raise ValueError(f"num_computed_tokens={num_computed_tokens} must be in (0, {reserved}]")
            if c.loading_from(rid) is not None:
                self.wait_for_loads([rid])  # its blocks must hold their KV before they are copied out
            table = self.manager.block_ids(rid)
            c.swap_out(rid, table[: self.blocks_for(num_computed_tokens)], num_computed_tokens)
        return self.manager.preempt(request, keep=self._finish_loads(rid, preempted=True))

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` evictable device blocks (``write_back`` saves them first)."""
        n = self.manager.evict(num_blocks)
        self._sync_block_changes()
        return n

    def reset_prefix_cache(self) -> int:
        """Evict every evictable device block (``write_back`` saves them first)."""
        n = self.manager.reset_prefix_cache()
        self._sync_block_changes()
        return n
