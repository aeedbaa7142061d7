"""Continuous-batching scheduler: per-step token budget, chunked prefill, decodes first, FCFS, preemption by recompute.

Each :meth:`Scheduler.schedule` call builds one forward pass (vLLM v1's
scheduler, reduced to one KV-cache group):

1. **Running requests**, decodes first, then unfinished (chunked) prefills:
   each gets the tokens it still needs, capped by the step's
   ``max_num_batched_tokens`` budget. When the cache cannot supply a block,
   the most recently admitted running request is **preempted by recompute**:
   its blocks are freed (full blocks stay in the prefix cache), its progress
   reset, and it goes back to the front of the queue; on readmission it
   re-hits its own cached prefix.
2. **Waiting requests**, first come first served, while the budget, the
   ``max_num_seqs`` limit and the free blocks allow (none when this step
   preempted someone). Each is first matched against the prefix cache; only
   the uncached tokens are computed. With chunked prefill a long prompt is
   split across steps. A tier load that raises at admission falls back to
   recomputing that request's prefix (it is matched against the device only
   from then on): a failing tier never fails a request.

Speculative decoding (``num_lookahead_tokens = k``): a decoding request's chunk is its last sampled
token plus ``k`` **lookahead slots** for draft tokens (capped by the budget and by the tokens it may still
emit), allocated with it and counted like any slot; when they do not fit the request decodes without
drafts this step before anyone is preempted. After verification :meth:`Scheduler.update_after_step`
gives back the rejected drafts' slots (:meth:`~kvpage.engine.kv_cache.SchedulerKVCache.rollback`).

Quantize-on-seal formats (``int4``, ``int2``) also need 16-bit tail slots in each
step (open blocks, window copies, first-block copies; :mod:`kvpage.cache.tail`),
carved out of the block pool: each chunk's slots are promised (their blocks claimed)
before its blocks are allocated. A chunk whose slots cannot be promised is first cut
back to a block boundary (a block that fills is sealed and needs no new slot), and
when even that does not fit, a running request is preempted (a waiting one waits),
so the forward pass never runs out of tail slots.

Tensor-free: the scheduler sees requests and block ids through the
:class:`~kvpage.engine.kv_cache.SchedulerKVCache` (the device manager, and the
tier connector called around it), never tensors.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpage.cache.manager import KVCacheManager
from kvpage.engine.kv_cache import SchedulerKVCache, TieredMatch, TierLoadError
from kvpage.engine.sequence import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits.

    Attributes:
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per forward pass (the per-step budget).
        enable_chunked_prefill: split long prefills across steps; when off, a
            prefill runs whole (alone if it exceeds the budget).
        num_lookahead_tokens: speculative decoding's ``k``: each decoding request is given up to
            this many extra slots (and budget tokens) per step for draft tokens; 0 = no speculation.
        speculation_max_batch: no lookahead in a step where at least this many requests run
            (``speculative_config.disable_by_batch_size``); ``None`` = no limit.

    Raises:
        ValueError: non-positive limits, negative lookahead.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0
    speculation_max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be positive, got {self.max_num_seqs}, "
                f"{self.max_num_batched_tokens}"
            )
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}")


@dataclass(frozen=True, slots=True)
class ScheduledRequestChunk:
    """One request's share of a step.

    Attributes:
        request: the request.
        num_new_tokens: tokens to compute this step, starting at ``num_computed``.
        num_computed: tokens already in the cache before this step.
        block_ids: the request's block table, covering ``num_computed + num_new_tokens + num_lookahead``
            tokens.
        num_lookahead: slots reserved after the chunk for draft tokens (speculative decoding; only for
            a decode chunk, whose one new token is the last sampled one); each is a budget token too.
    """

    request: Request
    num_new_tokens: int
    num_computed: int
    block_ids: tuple[int, ...]
    num_lookahead: int = 0

    @property
    def token_ids(self) -> list[int]:
        """The tokens to run."""
        return self.request.all_token_ids[self.num_computed : self.num_computed + self.num_new_tokens]

    @property
    def completes_sequence(self) -> bool:
        """After this step every known token is computed, so the step's last logits sample a new token."""
        return self.num_computed + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What :meth:`Scheduler.schedule` decided for one step.

    Attributes:
        scheduled: the chunks of the forward pass, in batch order.
        preempted: requests preempted this step (back in the waiting queue).
    """

    scheduled: list[ScheduledRequestChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens the step may run: new tokens plus the draft tokens its lookahead slots allow."""
        return sum(c.num_new_tokens + c.num_lookahead for c in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run."""
        return not self.scheduled


class _SideSlots:
    """One step's tail slots: each scheduled chunk's are promised (over side groups: claimed out of the block
    pool) before its blocks are allocated, so the allocation sees what is left and the plan never runs short.

    A chunk that leaves the step gives its promise back; promises the step's plan did not use are dropped
    when it finishes (and before the next step is scheduled).
    """

    def __init__(self, kv: SchedulerKVCache) -> None:
        self.kv = kv
        kv.side_release()
        self.booked: dict[str, tuple[int, ...]] = {}

    def _try(self, req: Request, start: int, n: int, match: TieredMatch | None, num_draft: int = 0) -> bool:
        need = self.kv.side_reserve(req, start, n, match, num_draft=num_draft)
        if need is None:
            return False
        if any(need):
            self.booked[req.request_id] = need
        return True

    def fit(self, req: Request, start: int, n: int, *, chunkable: bool, match: TieredMatch | None = None,
            num_draft: int = 0) -> int:
        """The most of ``n`` tokens whose tail slots can be promised, promising them: ``n``, else (``chunkable``)
        the longest chunk ending on a block boundary, else 0 (nothing promised). With ``num_draft`` (the last
        of the ``n`` tokens are drafts) it is all ``n`` or nothing."""
        self.give_back(req)
        if self._try(req, start, n, match, num_draft):
            return n
        if num_draft:
            return 0
        if not chunkable:
            return 0
        bs = self.kv.block_size
        end = (start + n) // bs * bs
        while end > start:
            if self._try(req, start, end - start, match):
                return end - start
            end -= bs
        return 0

    def widen(self, req: Request, start: int, n: int, extra: int) -> int:
        """Re-promise the request's chunk as ``[start, start + n + e)`` for the largest ``e <= extra`` that fits
        (``e`` shrinks so the chunk's end keeps its offset in the block, then by blocks); returns ``e``."""
        bs = self.kv.block_size
        while extra > 0:
            self.give_back(req)
            if self._try(req, start, n + extra, None):
                return extra
            extra -= (extra % bs) or bs  # same end offset: same tail need
        self.give_back(req)
        if not self._try(req, start, n, None):  # (rare: a load fell short and the earlier start needs more slots)
            logger.warning("tail slots of request %s could not be promised again; its plan takes free ones",
                           req.request_id)
        return 0

    def give_back(self, req: Request) -> None:
        """Take back the promise of a chunk that leaves the step (its request was preempted or must wait)."""
        need = self.booked.pop(req.request_id, None)
        if need is not None:
            self.kv.side_unreserve(need)


class Scheduler:
    """FCFS continuous batching over a :class:`~kvpage.engine.kv_cache.SchedulerKVCache`.

    Args:
        kv: the KV cache (the only way the scheduler touches it); a bare
            :class:`~kvpage.cache.manager.KVCacheManager` is wrapped without tiers.
        config: batching limits.
    """

    def __init__(self, kv: SchedulerKVCache | KVCacheManager, config: SchedulerConfig | None = None) -> None:
        self.kv = kv if isinstance(kv, SchedulerKVCache) else SchedulerKVCache(kv)
        self.config = config or SchedulerConfig()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS)."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Run a request that already holds its blocks (a fork of a running one, with ``num_computed_tokens``
        set): it takes part in the next step as any running request does, after those already running."""
        request.status = RequestStatus.RUNNING
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        self.running.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """Mark ``request`` finished with ``reason`` and release its blocks (idempotent)."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    # -- scheduling ----------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        # swap mode copies the blocks of its computed tokens to the host tier; recompute ignores the count
        self.kv.preempt(victim, num_computed_tokens=victim.num_computed_tokens)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Choose the next forward pass (see the module docstring for the policy)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        side = _SideSlots(self.kv)
        # 1. running: decodes first, then unfinished prefills, each in admission order.
        order = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        order += [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in order:
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            want = min(req.num_tokens - req.num_computed_tokens, budget)
            look = self._lookahead(req, budget) if want == 1 else 0
            while True:
                n = 0
                if look:  # a speculating decode: its token and the drafts' slots, or no drafts this step
                    if side.fit(req, req.num_computed_tokens, 1 + look, chunkable=False, num_draft=look):
                        blocks = self.kv.allocate_slots(req, 1, num_lookahead_tokens=look)
                        if blocks is not None:
                            n = 1
                            break
                        side.give_back(req)
                    look = 0
                n = side.fit(req, req.num_computed_tokens, want, chunkable=True)  # tail slots first, then blocks
                blocks = self.kv.allocate_slots(req, n) if n else None
                if blocks is not None:
                    break
                side.give_back(req)
                # Preempt the most recently admitted request; if it was already scheduled
                # this step (a decode ahead of this prefill), take its chunk back too.
                victim = self.running[-1]
                for i, chunk in enumerate(out.scheduled):
                    if chunk.request is victim:
                        budget += chunk.num_new_tokens + chunk.num_lookahead
                        side.give_back(victim)
                        del out.scheduled[i]
                        break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if blocks is None:
                continue
            out.scheduled.append(ScheduledRequestChunk(req, n, req.num_computed_tokens, blocks.block_ids, look))
            budget -= n + look
        # 2. waiting: FCFS admission, unless this step had to preempt.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # device hits, then host / store / swapped-out blocks (device only once a tier load failed for it)
            match = self.kv.match_prefix(req, external=not req.tier_load_failed)
            n = req.num_tokens - match.num_computed_tokens
            if n > budget:
                if self.config.enable_chunked_prefill:
                    n = budget
                elif out.scheduled:
                    break  # a whole prefill runs alone when it exceeds the budget
            n = side.fit(req, match.num_computed_tokens, n, chunkable=self.config.enable_chunked_prefill, match=match)
            if not n:
                break  # the tail cannot take it this step: it waits, as for blocks
            try:
                blocks = self.kv.allocate_slots(req, n, match)
            except TierLoadError as e:  # the tier is a cache: recompute what it failed to load
                logger.warning("%s; recomputing it", e)
                side.give_back(req)
                req.tier_load_failed = True
                continue
            if blocks is None:
                side.give_back(req)
                break
            self.waiting.popleft()
            # what really arrived: a store record that misses at read time leaves more to compute; the
            # request already owns the blocks for it, so widen the chunk (within the budget) at no block cost
            computed = blocks.num_computed_tokens if blocks.num_computed_tokens is not None else match.num_cached_tokens
            short = match.num_computed_tokens - computed
            extra = min(short, budget - n) if self.config.enable_chunked_prefill else short
            if short:  # the chunk starts earlier than promised: promise its slots again
                extra = side.widen(req, computed, n, extra)
            if extra > 0:
                blocks = self.kv.allocate_slots(req, extra)
                assert blocks is not None and not blocks.new_block_ids
                n += extra
            req.num_computed_tokens = computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequestChunk(req, n, req.num_computed_tokens, blocks.block_ids))
            budget -= n
        return out

    def _lookahead(self, req: Request, budget: int) -> int:
        """Draft slots for a decoding request this step: ``k``, capped by the step's budget and by the tokens
        the request may still emit (accepted drafts plus one more must fit in ``max_tokens``)."""
        k = self.config.num_lookahead_tokens
        limit = self.config.speculation_max_batch
        if not k or (limit is not None and len(self.running) >= limit):
            return 0
        return max(0, min(k, budget - 1, req.max_tokens - req.num_output_tokens - 1))

    def update_after_step(self, output: SchedulerOutput, num_accepted: Mapping[str, int] | None = None,
                          index_limit: Mapping[str, int] | None = None) -> None:
        """Record that the step's KV was written: advance progress, drop rejected drafts' slots, index full blocks.

        Call after the forward pass and after appending the step's tokens (a verified draft is one of the
        request's tokens before its block is indexed), before finishing the requests that stopped.

        Args:
            output: the step.
            num_accepted: request id -> draft tokens accepted this step (their KV is kept); default none.
            index_limit: request id -> index no block past this many tokens (a draft model's KV of them is
                not written yet); default no limit.
        """
        accepted = num_accepted or {}
        limit = index_limit or {}
        for chunk in output.scheduled:
            req = chunk.request
            if req.is_finished:
                continue
            req.num_computed_tokens = chunk.num_computed + chunk.num_new_tokens + accepted.get(req.request_id, 0)
            if chunk.num_lookahead:
                self.kv.rollback(req, req.num_computed_tokens)  # rejected drafts' slots (and blocks) go back
            self.kv.cache_blocks(req, min(req.num_computed_tokens, limit.get(req.request_id, req.num_computed_tokens)))
