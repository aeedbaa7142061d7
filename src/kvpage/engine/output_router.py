"""``OutputRouter``: each engine step's outputs go to the ``generate`` call or stream that owns the request.

One :class:`~kvpage.engine.engine.LLMEngine` steps every request it holds at once, so a step run by one
caller (``LLM.generate``) also produces outputs of another's requests (a paused ``generate_stream``).
The router keeps one queue per caller and files each output under its request, whoever ran the step:
no output is lost and no caller waits for an output another has already taken. Tensor-free bookkeeping.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvpage.engine.engine import EngineStepError, LLMEngine
from kvpage.engine.outputs import RequestOutput


class RequestLostError(RuntimeError):
    """A routed request finished without an output reaching its queue (e.g. ``engine.abort_request`` was called directly)."""


class OutputRouter:
    """Routes :meth:`LLMEngine.step` outputs to per-caller queues.

    Args:
        engine: the engine every caller shares.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._routes: dict[str, deque[RequestOutput]] = {}

    def open(self, request_ids: Iterable[str]) -> deque[RequestOutput]:
        """A new queue that receives every later output of ``request_ids`` (requests already added to the engine)."""
        queue: deque[RequestOutput] = deque()
        for rid in request_ids:
            self._routes[rid] = queue
        return queue

    def close(self, request_ids: Iterable[str]) -> None:
        """Stop routing ``request_ids``; those still unfinished are aborted (blocks freed). Idempotent."""
        for rid in request_ids:
            if self._routes.pop(rid, None) is not None:
                self.engine.abort_request(rid)  # None for a finished one

    def step(self) -> None:
        """Run one engine step and file its outputs.

        A step whose every request failed alone (:class:`EngineStepError`) still delivers each
        request's final ``"error"`` output, so an ``LLM`` answers with ``finish_reason="error"``
        rather than raising, and stays usable.
        """
        try:
            outputs = self.engine.step()
        except EngineStepError as e:
            outputs = e.outputs
        for out in outputs:
            queue = self._routes.get(out.request_id)
            if queue is not None:
                queue.append(out)
                if out.finished:
                    del self._routes[out.request_id]

    def next_output(self, queue: deque[RequestOutput], pending: set[str]) -> RequestOutput:
        """The oldest output in ``queue``, stepping the engine until one arrives.

        Args:
            queue: a queue from :meth:`open`.
            pending: that queue's requests not yet seen finished (to detect a lost request).

        Raises:
            RequestLostError: none of ``pending`` is in the engine any more and the queue is empty
                (they were finished by a call that bypassed the router, e.g. ``engine.abort_request``).
        """
        while not queue:
            engine = self.engine
            if not any(rid in engine.requests or rid in engine.parallel.parents for rid in pending):
                for rid in pending:
                    self._routes.pop(rid, None)
                raise RequestLostError(
                    f"requests {sorted(pending)[:5]} finished outside LLM.generate/generate_stream "
                    f"(e.g. llm.engine.abort_request); their outputs went to that caller"
                )
            self.step()
        return queue.popleft()
