"""``AsyncEngine``: one thread owns the synchronous ``LLMEngine``; asyncio handlers talk to it.

The engine (scheduler, KV-cache manager, model runner) and the tokenizer are
single-threaded objects. Here exactly one thread, the *engine thread*, ever
touches them:

* handlers send commands (add, abort, stop) through a thread-safe queue;
  an add carries a ``make_prompt`` callable, so tokenization (and chat
  templating) also runs on the engine thread;
* between two :meth:`LLMEngine.step` calls the engine thread applies every
  pending command, so a request joins the batch at the next step and an
  abort frees its blocks before the next step;
* each step's outputs go back to the event loop with one
  ``call_soon_threadsafe`` and land in per-request :class:`asyncio.Queue` s,
  which :class:`RequestStream` reads;
* after every iteration the thread publishes an :class:`EngineStats`
  snapshot, which ``/metrics`` and ``/health`` read without touching the engine.

Invariants:
    * A request whose stream is closed before it finished (client gone,
      handler cancelled) is aborted: its blocks return to the pool before the
      engine's next step.
    * A request the engine finishes with ``finish_reason="error"`` (its own
      forward, sampling or detokenization failed) ends its stream with that
      output, like any finished request; the others go on.
    * If ``step()`` raises the engine's ``EngineStepError`` (every request of the
      step failed), each failed request's final ``"error"`` output is delivered;
      if it raises anything else, every unfinished request is aborted (blocks
      freed) and its stream raises :class:`EngineStepError`. Either way the loop
      keeps serving new requests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvpage.engine.engine import EngineStepError as BatchFailedError
from kvpage.engine.outputs import RequestOutput
from kvpage.engine.sampling import SamplingParams
from kvpage.errors import KVPageError

if TYPE_CHECKING:
    from kvpage.engine.engine import EngineStats
    from kvpage.engine.llm import LLM

logger = logging.getLogger(__name__)

#: Builds a request's prompt on the engine thread: ``(prompt text or None, prompt token ids)``.
PromptFactory = Callable[[], "tuple[str | None, list[int]]"]


class EngineStepError(KVPageError, RuntimeError):
    """The engine failed while this request was in flight (its step raised, or the server stopped)."""


class EngineNotRunningError(KVPageError, RuntimeError):
    """A request was sent to an :class:`AsyncEngine` that is not started, stopped or whose thread died."""


class EngineObserver(Protocol):
    """Receives what the engine thread sees (the metrics implement this); called on the engine thread."""

    def on_outputs(self, outputs: Sequence[RequestOutput], now: float) -> None:
        """Outputs of one step (or of aborts); ``now`` is ``time.perf_counter()`` when they were made."""


@dataclass(slots=True)
class _Add:
    request_id: str
    make_prompt: PromptFactory
    params: SamplingParams | Callable[[list[int]], SamplingParams]
    future: concurrent.futures.Future  # -> (prompt text, prompt token ids)


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class RequestStream:
    """The outputs of one request, in order, as an async iterator; ends after the finished output.

    Each :class:`RequestOutput` carries cumulative text/tokens and the
    ``delta_text``/``delta_token_ids`` since the previous one. Leaving the
    iteration early (or calling :meth:`abort`) aborts the request.

    Attributes:
        request_id: the engine's id of the request.
        prompt: the prompt text the model saw (chat-templated for chat), or ``None``.
        prompt_token_ids: the prompt's tokens.
    """

    def __init__(
        self, engine: AsyncEngine, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        q: asyncio.Queue[RequestOutput | BaseException],
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self._queue = q
        self._finished = False

    @property
    def finished(self) -> bool:
        """Whether the finished output was read (or the request was aborted or failed)."""
        return self._finished

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self._finished = True
                    raise EngineStepError(f"request {self.request_id} failed in the engine: {item}") from item
                if item.finished:
                    self._finished = True
                yield item
        finally:
            self.abort()

    async def final(self) -> RequestOutput:
        """Wait for and return the finished output (cumulative text and tokens, metrics)."""
        last: RequestOutput | None = None
        async for out in self:
            last = out
        if last is None or not last.finished:  # pragma: no cover - the loop ends only on a finished output
            raise EngineStepError(f"request {self.request_id} ended without a finished output")
        return last

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent; frees its blocks before the next step)."""
        if not self._finished:
            self._finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Drive an :class:`~kvpage.engine.llm.LLM`'s engine from one background thread for asyncio callers.

    Args:
        llm: the model and its engine; from :meth:`start` on, only the engine
            thread may use ``llm.engine`` and ``llm.tokenizer``.
        observer: told about every output (metrics); called on the engine thread.

    Use ``await start()`` inside the running event loop, then
    :meth:`add_request`; ``await shutdown()`` aborts what is left and joins the thread.
    """

    def __init__(self, llm: LLM, observer: EngineObserver | None = None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.observer = observer
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._close_lock = threading.Lock()  # "closed" and the last drain vs. a late add
        self._stats: EngineStats = self.engine.stats()
        self._num_threads = torch.get_num_threads()
        self.num_steps = 0

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread; outputs will be delivered to the running event loop.

        Raises:
            EngineNotRunningError: already started.
        """
        if self._thread is not None:
            raise EngineNotRunningError("this AsyncEngine was already started; build a new one")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpage-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort every unfinished request (their streams raise :class:`EngineStepError`) and join the thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and accepting requests."""
        return self._thread is not None and self._thread.is_alive() and not self._closed

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the engine thread, if one did."""
        return self._error

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of the engine thread's latest iteration (safe from any thread)."""
        return self._stats

    # -- requests ------------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, make_prompt: PromptFactory,
        params: SamplingParams | Callable[[list[int]], SamplingParams],
    ) -> RequestStream:
        """Queue a request; it joins the batch at the next step.

        Args:
            request_id: unique id (also the response id).
            make_prompt: returns ``(prompt text or None, token ids)``; runs on the engine thread.
            params: sampling parameters, or a function of the prompt's token ids that
                returns them (e.g. ``max_tokens`` up to the end of the context).

        Returns:
            The request's :class:`RequestStream`.

        Raises:
            EngineNotRunningError: the engine thread is not running.
            PromptTooLongError, ValueError, TypeError: from ``make_prompt`` or
                :meth:`LLMEngine.add_request` (nothing is queued then).
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._close_lock:
            if not self.is_running:
                raise EngineNotRunningError(f"the engine is not running{f': {self._error}' if self._error else ''}")
            self._commands.put(_Add(request_id, make_prompt, params, fut))
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = q
        try:
            prompt, ids = await asyncio.wrap_future(fut)
        except BaseException:
            self._queues.pop(request_id, None)
            if not fut.cancelled():
                self._commands.put(_Abort(request_id))  # cancelled while the engine thread added it
            raise
        return RequestStream(self, request_id, prompt, ids, q)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished); its blocks are freed before the next step."""
        self._queues.pop(request_id, None)
        self._commands.put(_Abort(request_id))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)  # thread-local under OpenMP: match the starting thread
        reason: BaseException = EngineStepError("the server is shutting down")
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._apply(self._drain(block=not busy)):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._stats = self.engine.stats()
        except BaseException as e:  # a bug here must not leave clients waiting forever
            logger.exception("kvpage engine thread died")
            self._error = reason = e
        with self._close_lock:
            self._closed = True
            late = self._drain(block=False)
        self._fail_all(reason)
        for cmd in late:  # adds that arrived too late
            if isinstance(cmd, _Add) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineNotRunningError(f"the engine stopped: {reason}"))
        self._stats = self.engine.stats()

    def _drain(self, block: bool) -> list[_Add | _Abort | _Stop]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmds: list[_Add | _Abort | _Stop]) -> bool:
        """Apply commands in order; ``False`` on stop."""
        aborted: list[RequestOutput] = []
        for i, cmd in enumerate(cmds):
            if isinstance(cmd, _Stop):
                for late in cmds[i + 1:]:
                    if isinstance(late, _Add) and late.future.set_running_or_notify_cancel():
                        late.future.set_exception(EngineNotRunningError("the server is shutting down"))
                self._observe(aborted)
                return False
            if isinstance(cmd, _Abort):
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    aborted.append(out)
                continue
            if not cmd.future.set_running_or_notify_cancel():
                continue  # the handler gave up before we got here
            try:
                prompt, ids = cmd.make_prompt()
                params = cmd.params if isinstance(cmd.params, SamplingParams) else cmd.params(ids)
                self.engine.add_request(prompt, ids, params, request_id=cmd.request_id)
            except Exception as e:  # bad input: reported to the handler, nothing queued
                cmd.future.set_exception(e)
            else:
                cmd.future.set_result((prompt, ids))
        self._observe(aborted)
        return True

    def _observe(self, outputs: list[RequestOutput]) -> None:
        """Tell the observer (metrics); its failure is logged, never fatal to serving."""
        if not outputs or self.observer is None:
            return
        try:
            self.observer.on_outputs(outputs, time.perf_counter())
        except Exception:
            logger.exception("the engine observer failed")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except BatchFailedError as e:  # every request of the step failed; the engine finished each with "error"
            logger.error("engine step failed for every scheduled request: %s", e)
            self._observe(e.outputs)
            self._post(self._deliver, list(e.outputs))
            self._fail_all(e)  # anything else still unfinished (none, normally)
            return
        except Exception as e:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(e)
            return
        self.num_steps += 1
        if not outputs:
            return
        self._observe(outputs)
        self._post(self._deliver, outputs)

    def _fail_all(self, exc: BaseException) -> None:
        """Abort every unfinished request (finish reason ``error``) and hand ``exc`` to their streams."""
        failed: list[RequestOutput] = []
        parents = self.engine.parallel.parents
        children = {c.request_id for p in parents.values() for c in p.children}
        rids = [*parents, *(r for r in self.engine.requests if r not in children)]  # the ids callers know
        for rid in rids:
            try:
                out = self.engine.abort_request(rid)
            except Exception:  # pragma: no cover - keep failing the others
                logger.exception("aborting %s failed", rid)
                self.engine.requests.pop(rid, None)
                out = None
            if out is not None:
                for c in out.outputs:
                    c.finish_reason = "error"
                failed.append(out)
        self._observe(failed)
        if rids:
            self._post(self._deliver_error, (rids, exc))

    def _post(self, fn: Callable, arg: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # -- on the event loop ---------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is None:
                continue  # aborted: nobody listens
            q.put_nowait(out)
            if out.finished:
                del self._queues[out.request_id]

    def _deliver_error(self, failure: tuple[list[str], BaseException]) -> None:
        """Fail the streams of the requests the engine thread aborted after an error."""
        rids, exc = failure
        for rid in rids:
            q = self._queues.pop(rid, None)
            if q is not None:
                q.put_nowait(exc)
