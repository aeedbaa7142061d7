"""What the KV-cache manager exchanges with its callers: the request protocol and small result dataclasses.

Tensor-free and dependency-free (only the standard library), so the scheduler,
the tier connector, the benchmarks and the tests can all speak it without
importing the manager.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvpage.cache.tiers.types import OffloadStats

__all__ = ["KVCacheBlocks", "KVCacheStats", "KVRequest", "KVUpdate", "MatchResult", "SupportsKVCache"]


@runtime_checkable
class SupportsKVCache(Protocol):
    """What the manager reads from a request (the engine's sequence type implements it).

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
    """A request as the KV-cache manager sees it (tensor-free). See :class:`SupportsKVCache`.

    Attributes:
        num_prompt_tokens: prompt length in tokens, read by group managers that index only
            prompt blocks (quantize-on-seal formats); ``None`` = every token is a prompt token.
    """

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    extra_keys: tuple = ()
    block_hashes: list[bytes] = field(default_factory=list)
    num_prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a request on the device (the device part of :meth:`KVCache.match
    <kvpage.cache.kv_cache.KVCache.match>`).

    Attributes:
        block_ids: cached device blocks holding the prefix, in order.
        num_cached_tokens: ``len(block_ids) * block_size`` tokens they hold.
    """

    block_ids: tuple[int, ...] = ()
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """A request's blocks after :meth:`KVCache.allocate <kvpage.cache.kv_cache.KVCache.allocate>`.

    Attributes:
        block_ids: the request's whole block table, in order (token ``t`` lives in ``block_ids[t // block_size]``).
        new_block_ids: blocks this call took from the pool (already-cached prefix blocks it referenced are not
            included). On the admitting call the first ``len(match.loads)`` of them are the blocks a tier loads into.
        num_tokens: slots reserved for the request, in tokens.
        num_computed_tokens: on the admitting call, tokens whose KV is (or will be, once its loads land) in the
            cache: device hits plus the tokens the loads bring; ``None`` otherwise. Not part of equality.
        num_new_tokens: tokens of the chunk granted (fewer than asked when a ``chunkable`` chunk was cut to fit its
            side slots); ``None`` from a bare table view. Not part of equality.
        loading: the admitting call issued tier loads still in flight (compute the chunk only once they are
            reported). Not part of equality.
    """

    block_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    num_tokens: int
    num_computed_tokens: int | None = field(default=None, compare=False)
    num_new_tokens: int | None = field(default=None, compare=False)
    loading: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class KVUpdate:
    """What :meth:`KVCache.poll <kvpage.cache.kv_cache.KVCache.poll>` settled from the worker's report of finished
    transfers.

    Attributes:
        ready: requests whose loads all landed: they compute from where their KV ends, as admitted.
        cut_short: request -> tokens whose KV is in the cache after a load stopped short at read time (device hits
            plus the blocks that arrived); it computes the rest (its reserved slots were given back down to that).
        recompute: requests freed because a load stopped short where a group cannot compute on from there (a
            sliding window's rows); readmit them without tier hits.
    """

    ready: tuple[str, ...] = ()
    cut_short: dict[str, int] = field(default_factory=dict)
    recompute: tuple[str, ...] = ()

@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Counters of the device KV cache (vLLM's ``PrefixCacheStats`` + block counts), with the tiers nested.

    Attributes:
        num_blocks, num_free, num_evictable, num_in_use: device block counts now.
        usage: ``num_in_use / num_blocks``: blocks requests hold (vLLM's meaning; 0 when idle).
        requests: requests admitted (a preempted request counts again when readmitted).
        prefix_queries: tokens of admitted requests, in tokens (vLLM's ``queries``).
        prefix_hits: of those, tokens served from the cache: device hits and tier loads.
        hit_rate: ``prefix_hits / prefix_queries`` (0.0 without queries).
        blocks_stored: blocks that entered the index.
        evictions: cached blocks evicted.
        preemptions: requests preempted.
        tier_hits: tier -> blocks served to admitted requests: ``device`` always; with
            tiers also ``host`` and each store (``disk``, ``redis``).
        tiers: the tier connector's counters (host blocks, bytes moved, swaps, held blocks,
            store errors), or ``None`` without tiers.
        num_side: device blocks lent as side space (the 16-bit tail slots and first-block copies of
            quantize-on-seal formats, :mod:`kvpage.cache.tail.side`);
            ``num_free + num_evictable + num_in_use + num_side == num_blocks``.
        side_usage: ``num_side / num_blocks``; first-block copies of cached prompts stay after their requests
            finish (reclaimed when blocks are needed), so this need not be 0 when idle.
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
    tiers: OffloadStats | None = None
    num_side: int = 0
    side_usage: float = 0.0
