"""Continuous-batching scheduler: per-step token budget, chunked prefill, decodes first, FCFS, preemption by recompute.

Each :meth:`Scheduler.schedule` call builds one step (vLLM v1's scheduler):

1. **Running requests**, decodes first, then unfinished (chunked) prefills: each gets the tokens it still needs,
   capped by the step's ``max_num_batched_tokens`` budget. When the cache cannot supply its blocks (or its side
   slots: tail slots of quantize-on-seal groups, window slots), a chunk is first cut back to a block boundary
   whose side slots fit, and when even that does not fit, the most recently admitted running request is
   **preempted by recompute** (or swapped): its blocks are freed (full blocks stay in the prefix cache), its
   progress reset, and it goes back to the front of the queue; on readmission it re-hits its own cached prefix.
2. **Waiting requests**, first come first served, while the budget, the ``max_num_seqs`` limit and the free
   blocks allow (none when this step preempted someone). Each is first matched against the prefix cache and the
   tiers; only the uncached tokens are computed. With chunked prefill a long prompt is split across steps. A tier
   load that raises at admission falls back to recomputing that request's prefix (it is matched against the device
   only from then on): a failing tier never fails a request. When a group lets the tiers serve a prefix only
   behind device-resident first blocks (``int4``/``int2``) and they hold the blocks after those, the request
   computes its first block alone, then goes back to the front of the queue (no preemption: its first block
   stays cached) and is matched again, loading the rest (:attr:`~kvpage.cache.kv_cache.PrefixMatch.compute_first`).

The step's KV work goes out as data: :meth:`~kvpage.cache.kv_cache.KVCache.step_plan` at the end of the pass
(tier transfers, copy-on-write copies). A request admitted with tier loads computes only once the worker reports
them landed (:meth:`Scheduler.update_from_kv`): in the same step when the worker loads synchronously, steps later
otherwise; a load cut short at read time leaves it to compute from where its KV ends.

Speculative decoding (``num_lookahead_tokens = k``): a decoding request's chunk is its last sampled token plus
``k`` **lookahead slots** for draft tokens (capped by the budget and by the tokens it may still emit), allocated
with it, all or nothing; when they do not fit the request decodes without drafts this step before anyone is
preempted. After verification :meth:`Scheduler.update_after_step` gives back the rejected drafts' slots
(:meth:`~kvpage.cache.kv_cache.KVCache.rollback`).

Tensor-free: the scheduler sees requests and block ids through the :class:`~kvpage.cache.kv_cache.KVCache`, never
tensors.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpage.cache.kv_cache import KVCache, TierLoadError
from kvpage.cache.requests import KVUpdate
from kvpage.cache.step_plan import KVStepPlan
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
        kv: the step's KV work for the worker (tier transfers, copy-on-write copies), as data.
    """

    scheduled: list[ScheduledRequestChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv: KVStepPlan = KVStepPlan(0)

    @property
    def num_tokens(self) -> int:
        """Tokens the step may run: new tokens plus the draft tokens its lookahead slots allow."""
        return sum(c.num_new_tokens + c.num_lookahead for c in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run."""
        return not self.scheduled


class Scheduler:
    """FCFS continuous batching over a :class:`~kvpage.cache.kv_cache.KVCache`.

    Args:
        kv: the KV cache (the only way the scheduler touches it).
        config: batching limits.
    """

    def __init__(self, kv: KVCache, config: SchedulerConfig | None = None) -> None:
        self.kv = kv
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

    @property
    def num_waiting_for_kv(self) -> int:
        """Running requests whose tier loads have not landed yet (they compute once :meth:`update_from_kv` says)."""
        return sum(1 for r in self.running if self.kv.is_loading(r))

    # -- scheduling ----------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        # swap mode copies the blocks of its computed tokens to the host tier; recompute ignores the count
        self.kv.preempt(victim, num_computed_tokens=victim.num_computed_tokens)
        self._requeue(victim)

    def _requeue(self, victim: Request, *, preempted: bool = True) -> None:
        """Back to the front of the queue, to be recomputed from its cached prefix (it holds no blocks); counted as
        a preemption unless a tier load failed it."""
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED if preempted else RequestStatus.WAITING
        self.waiting.appendleft(victim)
        if preempted:
            victim.num_preemptions += 1
            self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Choose the next step (see the module docstring for the policy); its KV work is ``output.kv``."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.kv.begin_step()
        self._rematch()
        # 1. running: decodes first, then unfinished prefills, each in admission order.
        order = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        order += [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in order:
            if budget <= 0:
                break
            if req not in self.running or self.kv.is_loading(req):  # preempted earlier in this loop; KV not here
                continue
            want = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.rematch_at:  # its first block in several chunks (a small budget): none past it
                want = min(want, req.rematch_at - req.num_computed_tokens)
            look = self._lookahead(req, budget) if want == 1 else 0
            while True:
                n = 0
                if look:  # a speculating decode: its token and the drafts' slots, or no drafts this step
                    blocks = self.kv.allocate(req, 1, num_lookahead=look, num_computed=req.num_computed_tokens)
                    if blocks is not None:
                        n = 1
                        break
                    look = 0
                blocks = self.kv.allocate(req, want, num_computed=req.num_computed_tokens, chunkable=True)
                if blocks is not None:
                    n = want if blocks.num_new_tokens is None else blocks.num_new_tokens
                    break
                # Preempt the most recently admitted request; if it was already scheduled
                # this step (a decode ahead of this prefill), take its chunk back too.
                victim = self.running[-1]
                for i, chunk in enumerate(out.scheduled):
                    if chunk.request is victim:
                        budget += chunk.num_new_tokens + chunk.num_lookahead
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
            match = self.kv.match(req, external=not req.tier_load_failed)
            n = req.num_tokens - match.num_computed_tokens
            first = 0 if req.num_first_computed else match.compute_first  # once: no loop if its block is evicted
            if first:
                n = min(n, first)
            if n > budget:
                if self.config.enable_chunked_prefill:
                    n = budget
                elif out.scheduled:
                    break  # a whole prefill runs alone when it exceeds the budget
            try:
                blocks = self.kv.allocate(req, n, match, chunkable=self.config.enable_chunked_prefill)
            except TierLoadError as e:  # the tier is a cache: recompute what it failed to load
                logger.warning("%s; recomputing it", e)
                req.tier_load_failed = True
                continue
            if blocks is None:
                break  # no room for it this step (blocks or side slots): it waits
            n = n if blocks.num_new_tokens is None else blocks.num_new_tokens
            self.waiting.popleft()
            computed = blocks.num_computed_tokens if blocks.num_computed_tokens is not None else match.num_cached_tokens
            req.num_computed_tokens = computed
            req.rematch_at = first
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = max(computed - req.num_first_computed, 0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequestChunk(req, n, req.num_computed_tokens, blocks.block_ids))
            budget -= n
        out.kv = self.kv.step_plan()
        return out

    def _rematch(self) -> None:
        """Requests that computed the first blocks :attr:`~kvpage.cache.kv_cache.PrefixMatch.compute_first` asked
        for go back to the front of the queue, their blocks freed (the first ones stay cached, with what the tiers
        need behind them): admitted again, they hit those on the device and load the rest from the tiers."""
        for req in [r for r in self.running if r.rematch_at and r.num_computed_tokens >= r.rematch_at]:
            self.running.remove(req)
            self.kv.rematch(req, req.num_computed_tokens)
            req.num_first_computed = req.num_computed_tokens
            req.rematch_at = 0
            req.num_cached_tokens = -1
            self._requeue(req, preempted=False)

    def update_from_kv(self, update: KVUpdate, output: SchedulerOutput | None = None) -> None:
        """What the worker's transfers came to (:meth:`~kvpage.cache.kv_cache.KVCache.poll`), before a pass runs: a
        request whose load was cut short computes from where its KV ends; one that must recompute whole (a sliding
        window's rows missing) goes back to the front of the queue, device hits only; and the chunks of ``output``
        whose request's KV has not arrived (still loading, cut short, freed) leave the step.
        """
        if update.cut_short or update.recompute:
            by_id = {r.request_id: r for r in self.running}
            for rid, computed in update.cut_short.items():
                req = by_id.get(rid)
                if req is not None:
                    req.num_computed_tokens = computed
                    req.num_cached_tokens = min(req.num_cached_tokens, max(computed - req.num_first_computed, 0))
            for rid in update.recompute:
                req = by_id.get(rid)
                if req is not None:  # (the cache freed it already)
                    self.running.remove(req)
                    req.tier_load_failed = True
                    req.num_cached_tokens = -1
                    self._requeue(req, preempted=False)
        if output is not None:
            gone = set(update.cut_short) | set(update.recompute)
            output.scheduled = [c for c in output.scheduled
                                if c.request.request_id not in gone and not self.kv.is_loading(c.request)]

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
            self.kv.cache(req, min(req.num_computed_tokens, limit.get(req.request_id, req.num_computed_tokens)))
