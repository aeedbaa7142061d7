"""``LLMEngine``: requests in, one scheduled forward pass per :meth:`LLMEngine.step`, incremental outputs out.

The loop of vLLM's engine core, on one process: the
:class:`~kvpage.engine.scheduler.Scheduler` picks the step's tokens and the cache
(:class:`~kvpage.cache.kv_cache.KVCache`) plans what the step does to it; the
:class:`~kvpage.engine.worker.Worker` executes the plans (tier transfers, copies, then the
model over the paged cache); the scheduler commits them; the sampler picks each finished
sequence's next token, and the detokenizer and stop checks turn tokens into text. ``LLM.generate`` and the HTTP server both
drive this class. With a drafter (``speculative_config``) a decoding request's step
also proposes draft tokens before the forward pass, which verifies them
(:mod:`kvpage.engine.speculative`); a step may then emit several tokens per request.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import torch

from kvpage.cache.kv_cache import KVCache
from kvpage.cache.kv_events.collector import KVEventCollector
from kvpage.engine.detokenize import REPLACEMENT, IncrementalDetokenizer, ends_with_split_character
from kvpage.engine.forced import ForcedSequence
from kvpage.engine.model_runner import ScheduledRequest, pass_requests
from kvpage.engine.parallel import ParallelSampling, ParentRequest, child_request_id
from kvpage.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from kvpage.engine.sampling import SamplingParams, check_sampling_params, child_params, sample
from kvpage.engine.scheduler import ScheduledRequestChunk, Scheduler, SchedulerConfig, SchedulerOutput
from kvpage.engine.sequence import Request, RequestStatus
from kvpage.engine.speculative.acceptance import verify
from kvpage.engine.speculative.metrics import SpecDecodingCounters
from kvpage.engine.speculative.proposer import Drafter, Proposal
from kvpage.engine.validate import check_text, check_token_ids
from kvpage.engine.worker import Worker
from kvpage.errors import PromptTooLongError

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A forward pass failed for every request of the step, each alone too: not one request's fault.

    Every scheduled request was finished with ``finish_reason="error"`` (blocks freed) before this was raised,
    so the engine stays consistent and usable; the original exception is ``__cause__``.

    Attributes:
        outputs: the final :class:`RequestOutput` of each request it finished.
    """

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class LLMEngine:
    """Continuous-batching generation over a paged, prefix-cached KV cache.

    Args:
        worker: executes the plans: tier transfers, copies and forward passes over the cache tensors.
        tokenizer: a transformers tokenizer (encode/decode).
        kv: the KV cache as the scheduler sees it (device bookkeeping and the tier connector's scheduler half).
        eos_token_ids: tokens that end a sequence (unless ``ignore_eos``).
        max_model_len: longest prompt + output, in tokens.
        vocab_size: token ids must lie in ``[0, vocab_size)``; ``None`` skips the check.
        scheduler_config: batching limits (its ``num_lookahead_tokens`` is the drafter's ``k``).
        drafter: the speculation method (:mod:`kvpage.engine.speculative`), or ``None``: no speculation.
        kv_events: collects the cache's events and publishes one batch per step (``kv_events_config``), or ``None``.
        flush_finished: a step in which a request finished hands the worker its tier writes before it returns
            (:meth:`flush_kv`), so the request's blocks are in the stores when its output is read (a ``kv_producer``
            of prefill/decode disaggregation); default they go with the next step.
    """

    def __init__(
        self,
        worker: Worker,
        tokenizer: Any,
        kv: KVCache,
        *,
        eos_token_ids: set[int],
        max_model_len: int,
        vocab_size: int | None = None,
        scheduler_config: SchedulerConfig | None = None,
        drafter: Drafter | None = None,
        kv_events: KVEventCollector | None = None,
        flush_finished: bool = False,
    ) -> None:
        self.worker = worker
        self.flush_finished = flush_finished
        self.kv_events = kv_events
        self.runner = worker.runner
        self.tokenizer = tokenizer
        self.kv = kv
        self.num_blocks = kv.num_blocks
        self.block_size = kv.block_size
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.scheduler = Scheduler(kv, scheduler_config)
        k = self.scheduler.config.num_lookahead_tokens
        if (drafter is None) != (k == 0):
            raise ValueError(f"a drafter needs num_lookahead_tokens > 0 and the reverse; got drafter={drafter!r}, "
                             f"num_lookahead_tokens={k}")
        self.drafter = drafter
        self.spec_counters = SpecDecodingCounters(k) if drafter is not None else None
        self.requests: dict[str, Request] = {}
        self.parallel = ParallelSampling()  # requests with n > 1 and their children
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request after checking every field (nothing is queued when a check fails).

        Args:
            prompt: the prompt's text (kept for outputs), or ``None`` for a token prompt.
            prompt_token_ids: the tokens to run: a list/tuple of ints in ``[0, vocab_size)``.
            params: a :class:`SamplingParams`; its ``stop_token_ids`` must lie in the vocabulary too.
            request_id: a non-empty str, unique among unfinished requests; default a fresh uuid.
            cache_salt: a str that separates this tenant's prefix-cache entries, or ``None`` (shared).

        Raises:
            TypeError: an argument of the wrong type: ``prompt`` not str/None, ``prompt_token_ids`` not a
                list/tuple, ``params`` not a :class:`SamplingParams` (the message says ``sampling_params``),
                ``request_id`` not str, ``cache_salt`` not str/None.
            ValueError: empty prompt, a token id (prompt or ``stop_token_ids``) that is not an int or lies
                outside the vocabulary, a lone surrogate in ``prompt`` or ``cache_salt``, an empty or duplicate
                ``request_id``; a field of ``params`` that breaks its rule now (changed with
                ``object.__setattr__`` after it was built: :func:`~kvpage.engine.sampling.check_sampling_params`).
            PromptTooLongError: the prompt reaches ``max_model_len``; prompt + ``max_tokens`` exceeds it (the one
                policy of the CLI, ``LLM`` and the server: a limit that cannot be honoured is refused, naming
                ``max_tokens`` and the most that fits, never cut silently); or prompt + ``max_tokens`` cannot fit
                in the whole cache (it could never finish, even alone).
        """
        check_text(prompt, "prompt", optional=True)
        ids = check_token_ids(prompt_token_ids, "prompt_token_ids", self.vocab_size)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}; "
                            f"build one with SamplingParams(**fields)")
        check_sampling_params(params)  # its fields as they are now, not as they were built
        check_token_ids(list(params.stop_token_ids), "stop_token_ids", self.vocab_size, allow_empty=True)
        if request_id is not None:
            check_text(request_id, "request_id")
            if not request_id:
                raise ValueError("request_id must be a non-empty str")
        check_text(cache_salt, "cache_salt", optional=True)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context (max_model_len) is {self.max_model_len}. "
                f"Shorten the prompt."
            )
        room = self.max_model_len - len(ids)
        if params.max_tokens > room:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} = {len(ids) + params.max_tokens} "
                f"tokens exceed the model's context (max_model_len) of {self.max_model_len}. Lower max_tokens to at "
                f"most {room}, or shorten the prompt."
            )
        max_tokens = params.max_tokens
        need = self.kv.blocks_for(len(ids) + max_tokens)
        if need > self.num_blocks:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} needs {need} blocks of "
                f"{self.block_size} tokens, but the KV cache holds only {self.num_blocks} "
                f"block{'s' if self.num_blocks != 1 else ''} "
                f"({self.num_blocks * self.block_size} tokens). Raise kv_cache_memory_bytes/num_blocks, pick a "
                f"smaller kv_cache_dtype, or lower max_tokens."
            )
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self.requests or self.parallel.in_use(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        now = time.perf_counter()
        if params.n == 1:
            req = Request(rid, prompt, ids, params, now, max_tokens, cache_salt=cache_salt)
            self.requests[rid] = req
            self.scheduler.add_request(req)
            return req
        # n > 1: children share the prompt's blocks (kvpage.engine.parallel); greedy ones are one computation
        count = 1 if params.greedy else params.n
        children = [Request(child_request_id(rid, i), prompt, ids, child_params(params, i), now, max_tokens,
                            cache_salt=cache_salt) for i in range(count)]
        if any(c.request_id in self.requests or self.parallel.in_use(c.request_id) for c in children):
            raise ValueError(f"request id {rid!r} is already in use (by its completions' ids)")
        for c in children:
            self.requests[c.request_id] = c
        self.parallel.add(ParentRequest(rid, params.n, children, held=children[1:]))
        self.scheduler.add_request(children[0])
        return children[0]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (finish reason ``abort``) and free its blocks; unknown or finished ids return ``None``.
        A request with ``n > 1`` aborts all its completions.

        Raises:
            TypeError: ``request_id`` is not a str.
            ValueError: ``request_id`` names one completion of an unfinished ``n > 1`` request (``"q#1"``): the
                engine's own id, which only the whole request (``"q"``) may abort.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        parent = self.parallel.owner_of(request_id)
        if parent is not None:
            raise ValueError(f"request_id {request_id!r} is one completion of request {parent!r} (n > 1): abort "
                             f"{parent!r}, whose completions end together")
        if request_id in self.parallel.parents:
            return self.parallel.abort(request_id, self._abort_one)
        return self._abort_one(self.requests.get(request_id))

    def _abort_one(self, req: Request | None) -> RequestOutput | None:
        """Abort one (child) request; ``None`` when unknown or already finished (a held child is just forgotten)."""
        if req is None or req.is_finished:
            if req is not None:
                self.requests.pop(req.request_id, None)
            return None
        request_id = req.request_id
        self.scheduler.finish(req, "abort")
        if self.drafter is not None:
            self.drafter.forget(request_id)
        req.finish_time = time.perf_counter()
        self._trim_split_character(req)
        out = self._output(req)
        self.requests.pop(request_id, None)
        return out

    def has_unfinished_requests(self) -> bool:
        """Whether any request waits or runs (children held for their prompt included)."""
        return self.scheduler.num_unfinished > 0 or self.parallel.has_held

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; return an output for every request that got a token or finished.

        Fault isolation: a failure attributable to one request finishes only that request, with
        ``finish_reason="error"`` and the message in ``CompletionOutput.error``; its blocks are freed and the
        others go on. When the batch's forward pass raises, each request is re-run alone (the forward writes
        the same K/V into the same slots, so a re-run is idempotent); those that fail alone are finished with
        ``"error"``, the others keep the results of their re-run. Sampling, verification, detokenization and
        stop checks are isolated per request the same way; a drafter that raises only costs the step its drafts.

        Speculating requests: the drafter proposes first, the forward pass verifies, the accepted drafts and one
        more token are appended (up to the first stop), then the step's progress is recorded (rejected drafts'
        slots given back, verified full blocks indexed) and only then are stopped requests finished.

        Raises:
            EngineStepError: every request of the step failed alone too (a broken model, say); each was
                finished with ``"error"`` first, so the engine stays usable.
            RuntimeError: requests wait but none can be scheduled, nothing was preempted to make room and no load is
                in flight (cannot happen for requests admitted by :meth:`add_request`; guards against a hang).
        """
        try:
            for child in self.parallel.release():  # the first completion ended before its prompt's logits
                self.scheduler.add_request(child)  # admitted as any request: it computes the prompt itself
            outputs = self._step()
            if self.flush_finished and any(o.finished for o in outputs):
                self.flush_kv()  # write-through before the answer: the decode instance reads the store next
            return self.parallel.fan_in(outputs)
        finally:
            if self.kv_events is not None:  # one batch per step, queued for the publisher's thread
                self.kv_events.publish()

    def _start_held(self, first: Request, logits: torch.Tensor, now: float) -> list[RequestOutput]:
        """The held siblings of ``first``, which has just computed the prompt: each samples its first token from
        the prompt's logits ``logits`` (``[vocab]`` float32, the row ``first`` sampled from) with its own generator,
        then forks from ``first`` (:meth:`_fork`), or is admitted as a new request when it cannot; one that stops at
        that token finishes at once. Returns their outputs (each got a token or finished)."""
        outputs: list[RequestOutput] = []
        for child in self.parallel.take_held(first):
            try:
                reason = self._append_token(child, sample(logits, child.params, child.generator), now)
                self.generation_tokens += 1
            except Exception as exc:  # its sampling, detokenization or stop check
                reason, child.error = "error", _describe(exc)
            if reason is not None:  # it holds no blocks and was never queued: nothing to release
                child.status, child.finish_reason, child.finish_time = RequestStatus.FINISHED, reason, now
            elif not self._fork(first, child):
                self.scheduler.add_request(child)  # it computes what it cannot share (its prompt blocks may hit)
            outputs.append(self._output(child))
            if child.is_finished:
                self.requests.pop(child.request_id, None)
        return outputs

    def _fork(self, first: Request, child: Request) -> bool:
        """Start ``child`` (prompt + its first token) on ``first``'s blocks of the whole prompt (int4/int2: of its
        whole blocks; the child computes the rest of the prompt and its first token); ``False`` when ``first``
        holds no blocks or a group refuses."""
        if first.is_finished or first.num_computed_tokens < first.num_prompt_tokens:
            return False
        n = self.kv.fork_point(child.num_prompt_tokens)
        if not self.kv.fork(first, child, n):
            return False
        child.num_computed_tokens = n
        self.scheduler.add_running(child)
        return True

    def _poll_kv(self, sched: SchedulerOutput | None = None) -> None:
        """Hand the worker's finished transfers to the cache and what they came to to the scheduler (a request whose
        KV has not arrived leaves ``sched``)."""
        update = self.kv.poll(self.worker.get_finished())
        self.scheduler.update_from_kv(update, sched)

    def _run_pass(self, batch: list[ScheduledRequest]) -> torch.Tensor:
        """Plan one final pass over ``batch`` in the model's groups, run it and commit it (abort it if it raises)."""
        plan = self.kv.plan_pass(pass_requests(batch), groups=self.worker.runner.groups)
        try:
            logits = self.runner.execute(batch, plan=plan)              # [sum(num_logits), vocab] float32
        except BaseException:
            self.kv.abort(plan)
            raise
        self.kv.commit(plan)
        return logits

    def _step(self) -> list[RequestOutput]:
        """:meth:`step` before children's outputs are merged per parent."""
        self._poll_kv()  # transfers the worker finished since the last step (no-op without tiers)
        sched = self.scheduler.schedule()
        planned = not sched.is_empty
        self.worker.begin_step(sched.kv)  # the step's transfers and copy-on-write copies
        self._poll_kv(sched)  # loads the worker finished at once; a request whose KV has not arrived waits
        if sched.is_empty:  # (a step that preempted or whose loads have not landed makes room for the next one)
            if (not planned and not sched.preempted and self.scheduler.num_unfinished
                    and not self.scheduler.num_waiting_for_kv):
                raise RuntimeError(
                    f"{len(self.scheduler.waiting)} waiting requests cannot be scheduled with "
                    f"{self.kv.stats().num_free} free blocks"
                )
            return []
        proposals = self._propose(sched.scheduled)
        batch = [
            ScheduledRequest(c.token_ids + list(p.tokens), c.num_computed, c.block_ids, c.request.request_id,
                             c.request.num_prompt_tokens, num_draft=len(p.tokens), num_logits=1 + len(p.tokens))
            for c, p in zip(sched.scheduled, proposals)
        ]
        outputs: list[RequestOutput] = []
        try:
            logits = self._run_pass(batch)                                # [sum(num_logits), vocab] float32
        except Exception as exc:
            kept, logits, outputs = self._isolate_forward(sched, batch, exc)
            sched = SchedulerOutput([sched.scheduled[i] for i in kept], sched.preempted, sched.kv)
            proposals = [proposals[i] for i in kept]
            if not sched.scheduled:
                return outputs
        now = time.perf_counter()
        # greedy rows: one argmax over the batch (per-row calls cost ~0.1 ms each at a 49k vocabulary; max().indices
        # is the same first-maximum index, 2.7x faster than argmax here)
        greedy = logits.max(-1).indices.tolist() if any(c.request.params.greedy for c in sched.scheduled) else None
        accepted: dict[str, int] = {}
        stopped: list[tuple[Request, str]] = []
        sampled: list[Request] = []  # requests that got tokens (chunk.completes_sequence is read before appending)
        prompt_rows: list[tuple[Request, torch.Tensor]] = []  # first completions' prompt logits, [vocab] each
        row = 0
        for chunk, prop in zip(sched.scheduled, proposals):
            req = chunk.request
            rows = 1 + len(prop.tokens)
            first, row = row, row + rows
            self.prompt_tokens_computed += max(
                0, min(chunk.num_computed + chunk.num_new_tokens, req.num_prompt_tokens) - chunk.num_computed
            )
            if not chunk.completes_sequence:
                continue  # a prefill chunk: its logits are not needed
            sampled.append(req)
            if self.parallel.holds_for(req):  # its prompt's logits: its held siblings sample their first tokens
                prompt_rows.append((req, logits[first]))
            try:
                verdict = None
                if chunk.num_lookahead:
                    verdict = verify(logits[first:row], list(prop.tokens), prop.probs, req.params, req.generator)
                    tokens = list(verdict.tokens)
                else:
                    tokens = [greedy[first] if greedy is not None and req.params.greedy
                              else sample(logits[first], req.params, req.generator)]
                reason = None
                n = 0
                for token in tokens:
                    n += 1
                    reason = self._append_token(req, token, now)
                    if reason is not None:
                        break
                self.generation_tokens += n
                if verdict is not None:
                    accepted[req.request_id] = n - 1  # appended drafts: their KV is kept
                    self._observe(chunk, prop, verdict.num_accepted, n)
                if reason is not None:
                    stopped.append((req, reason))
            except Exception as exc:  # this request's sampling, verification, detokenization or stop check
                self._fail(req, exc, now)
        limit = {}
        if self.drafter is not None:
            for chunk in sched.scheduled:
                lim = self.drafter.index_limit(chunk.request.request_id)
                if lim is not None:
                    limit[chunk.request.request_id] = lim
        self.scheduler.update_after_step(sched, accepted, limit)
        for req, row in prompt_rows:  # before a stopped first completion lets go of the prompt's blocks
            outputs.extend(self._start_held(req, row, now))
        for req, reason in stopped:
            if not req.is_finished:
                self.scheduler.finish(req, reason)
                req.finish_time = now
        got = {id(r) for r in sampled}
        for chunk in sched.scheduled:
            req = chunk.request
            if id(req) not in got and not req.is_finished:
                continue
            outputs.append(self._output(req))
            if req.is_finished:
                self.requests.pop(req.request_id, None)
                if self.drafter is not None:
                    self.drafter.forget(req.request_id)
        return outputs

    # -- speculative decoding ------------------------------------------------------------------
    def _propose(self, chunks: list[ScheduledRequestChunk]) -> list[Proposal]:
        """Each chunk's drafts (none without a drafter or lookahead); a drafter that raises drafts nothing
        this step (the step still runs, without speculation)."""
        if self.drafter is None:
            return [Proposal() for _ in chunks]
        try:
            props = self.drafter.propose(chunks)
        except Exception as exc:
            logger.warning("the drafter failed; this step runs without drafts: %s", _describe(exc))
            return [Proposal() for _ in chunks]
        return [p if len(p.tokens) <= c.num_lookahead else Proposal(p.tokens[:c.num_lookahead],
                None if p.probs is None else p.probs[:c.num_lookahead]) for c, p in zip(chunks, props)]

    def _observe(self, chunk: ScheduledRequestChunk, prop: Proposal, num_accepted: int, num_emitted: int) -> None:
        """Count one verification round: ``num_accepted`` drafts verification accepted (vLLM counts the same,
        before stop checks), ``num_emitted`` tokens appended (fewer when a stop cut the round short)."""
        drafted = len(prop.tokens)
        if self.spec_counters is not None and drafted:
            self.spec_counters.observe(drafted, num_accepted, num_emitted)
        if self.drafter is not None:
            self.drafter.on_verified(chunk.request.request_id, chunk.num_computed, drafted, num_emitted - 1)

    def _isolate_forward(
        self, sched: SchedulerOutput, batch: list[ScheduledRequest], exc: Exception
    ) -> tuple[list[int], torch.Tensor, list[RequestOutput]]:
        """The batch's forward raised: re-run each request alone, finish those that fail with ``"error"``.

        Returns:
            The indices of the chunks that ran alone, their logits (``sum(num_logits)`` rows, in order)
            and the failed requests' final outputs.

        Raises:
            EngineStepError: every request failed alone too (after finishing them all).
        """
        now = time.perf_counter()
        kept: list[int] = []
        rows, failed = [], []
        for i, (chunk, one) in enumerate(zip(sched.scheduled, batch)):
            if len(batch) == 1:
                error: Exception = exc
            else:
                try:
                    rows.append(self._run_pass([one]))
                    kept.append(i)
                    continue
                except Exception as e:
                    error = e
            logger.warning("request %s failed in the forward pass: %s", chunk.request.request_id, _describe(error))
            self._fail(chunk.request, error, now)
            failed.append(self._output(chunk.request))
            self.requests.pop(chunk.request.request_id, None)
        if not kept:
            raise EngineStepError(
                f"the forward pass failed for every request of the step ({len(failed)}), each alone too: "
                f"{_describe(exc)}", failed
            ) from exc
        return kept, torch.cat(rows), failed

    def _fail(self, req: Request, exc: BaseException, now: float) -> None:
        """Finish ``req`` with ``"error"`` (blocks freed), keeping what went wrong in ``req.error``."""
        self.scheduler.finish(req, "error")
        req.finish_reason = "error"  # also when the failure came after another finish reason was set
        req.error = _describe(exc)
        req.finish_time = now

    def _append_token(self, req: Request, token: int, now: float) -> str | None:
        """Append one output token, update the text and check every stop; returns the finish reason, or ``None``.

        The caller finishes the request (after the step's blocks are indexed)."""
        if req.first_token_time is None:
            req.first_token_time = now
        req.all_token_ids.append(token)
        p = req.params
        reason = None
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        text = self._detokenize(req, token)
        cut_by_string = False
        for s in p.stop:
            cut = text.find(s)
            if cut >= 0:
                text, reason, cut_by_string = text[:cut], "stop", True
        req.text = text
        if reason is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None and not cut_by_string:
            self._trim_split_character(req)
        return reason

    def _detokenize(self, req: Request, token: int) -> str:
        """``req``'s output text after ``token`` (just appended): ``decode(output_token_ids, skip_special_tokens=True)``,
        kept up to date by the request's :class:`~kvpage.engine.detokenize.IncrementalDetokenizer` (a few tokens
        decoded per token instead of the whole output)."""
        detok = req.detokenizer
        if detok is None or detok.num_tokens != req.num_output_tokens - 1:  # first token (or tokens changed under it)
            detok = req.detokenizer = IncrementalDetokenizer(self.tokenizer)
            for t in req.output_token_ids[:-1]:
                detok.append(t)
        return detok.append(token)

    def _trim_split_character(self, req: Request) -> None:
        """Drop a final U+FFFD that stands for a character cut by the end of the output (see :mod:`~kvpage.engine.detokenize`)."""
        if req.text.endswith(REPLACEMENT) and ends_with_split_character(self.tokenizer, req.output_token_ids, req.text):
            req.text = req.text[:-1]

    def _output(self, req: Request) -> RequestOutput:
        out_ids = req.output_token_ids
        # While running, hold back text that may still become a stop string or an incomplete UTF-8 character.
        visible = req.text if req.is_finished else req.text.rstrip("\ufffd")
        if not req.is_finished and req.params.stop:
            hold = max(len(s) for s in req.params.stop) - 1
            visible = visible[: max(len(visible) - hold, req._emitted_text)]
        delta_text = visible[req._emitted_text:] if len(visible) >= req._emitted_text else ""
        delta_ids = out_ids[req._emitted_tokens:]
        req._emitted_text = max(req._emitted_text, len(visible))
        req._emitted_tokens = len(out_ids)
        metrics = RequestMetrics(
            prompt_tokens=req.num_prompt_tokens,
            output_tokens=len(out_ids),
            cached_tokens=max(req.num_cached_tokens, 0),
            time_to_first_token_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            total_time_s=None if req.finish_time is None else req.finish_time - req.arrival_time,
            num_preemptions=req.num_preemptions,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, req.text, list(out_ids), req.finish_reason, delta_text, delta_ids, req.error)],
            finished=req.is_finished,
            metrics=metrics,
        )

    def flush_kv(self) -> None:
        """Hand the worker the KV work issued outside a step (a ``write_back`` save of the blocks an eviction took,
        say) and settle what it finished, so the next step's matches see it."""
        self.worker.begin_step(self.kv.step_plan())
        self._poll_kv()

    def reset_prefix_cache(self) -> int:
        """Evict every cached, unreferenced device block (vLLM's ``reset_prefix_cache``); returns how many. A
        ``write_back`` host tier receives the evicted blocks first."""
        n = self.kv.reset_prefix_cache()
        self.flush_kv()
        if self.kv_events is not None:
            if self.kv.pool.num_cached == 0:  # vLLM's AllBlocksCleared, after the removals (blocks in use stay)
                self.kv_events.cleared()
            self.kv_events.publish()
        return n

    def reset_kv_cache(self) -> None:
        """Free the whole KV pool and allocate it afresh from the same plan as the build (same blocks, same window
        slots): the prefix cache is emptied (its tier saves run first), every group's bookkeeping reset, then every
        layer's tensors re-allocated (vLLM's ``sleep()`` + ``wake_up()`` of the KV cache).

        Raises:
            RuntimeError: requests are still running or waiting.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("reset_kv_cache() needs an idle engine; finish or abort the running requests first")
        self.reset_prefix_cache()  # write-back saves read the blocks before they go
        self.kv.reset()
        self.worker.controller.reallocate_device()

    def open_sequence(self, *, prompt_len: int = 0) -> ForcedSequence:
        """A teacher-forced sequence over this engine's cache (see :class:`~kvpage.engine.forced.ForcedSequence`).

        Its blocks come from the same pool as the running requests'; don't call :meth:`step` while it is open.
        It holds at most :attr:`max_model_len` tokens (a longer feed is a ``ValueError``).
        """
        return ForcedSequence(self.kv, self.worker, prompt_len=prompt_len, vocab_size=self.vocab_size,
                              max_model_len=self.max_model_len)

    # -- metrics -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters and gauges for metrics and benchmarks."""
        kv = self.kv.stats()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=kv.usage,
            kv_side_usage=kv.side_usage,
            kv=kv,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens,
            spec_decoding=None if self.spec_counters is None else self.spec_counters.snapshot(),
        )
