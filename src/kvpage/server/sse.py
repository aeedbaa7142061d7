"""Server-sent-event bodies of streamed completions, and what an engine-failed request answers.

A stream is ``data: <chunk json>`` events ending with ``data: [DONE]``. When
the engine fails a request (its step raised, or it finished the request with
``finish_reason="error"``), the stream's last event before ``[DONE]`` is
``data: {"error": {...}}`` (OpenAI-style, type ``server_error``) instead of a
finish chunk; a non-streamed request gets a 500 with that body
(:func:`raise_if_failed`).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpage.engine.outputs import CompletionOutput, RequestOutput
from kvpage.server.async_engine import EngineStepError, RequestStream
from kvpage.server.errors import APIError
from kvpage.server.jsonsafe import dumps, model_json
from kvpage.server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
)

#: ``finish_reason`` of a request the engine gave up on (its forward, sampling or detokenization failed).
ERROR_FINISH_REASON = "error"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops its body iterator as soon as the client disconnects.

    Starlette watches for the disconnect only under some ASGI spec versions; this
    always does, so the body's ``finally`` (which aborts the request) runs at once.

    Args:
        content: the events (strings from :func:`sse`).
        on_close: called once when the response ends, however it ends (aborts the request).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the body while listening for ``http.disconnect``; whichever ends first cancels the other.

        ``on_close`` runs at the end in every case, even when the body never started.
        """
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away under us
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()


def sse(payload: Any) -> str:
    """One server-sent event (``data: <json>\\n\\n``) of a pydantic model or a JSON-able value.

    Serialised by :mod:`kvpage.server.jsonsafe`, so a lone surrogate in the payload
    (an echoed request value) is written as text instead of breaking the stream.
    """
    if hasattr(payload, "model_dump"):
        return f"data: {model_json(payload)}\n\n"
    return f"data: {dumps(payload)}\n\n"


def usage(*outs: RequestOutput) -> UsageInfo:
    """The usage block of one or more requests' (latest) outputs: each prompt once, every completion's tokens
    (as OpenAI counts a request of several prompts and ``n`` choices each), summed."""
    return UsageInfo.build(sum(o.metrics.prompt_tokens for o in outs),
                           sum(len(c.token_ids) for o in outs for c in o.outputs),
                           sum(o.metrics.cached_tokens for o in outs))


def _failed(out: RequestOutput) -> CompletionOutput | None:
    """The first completion the engine finished with ``finish_reason="error"``, or ``None``."""
    return next((c for c in out.outputs if c.finish_reason == ERROR_FINISH_REASON), None)


def failure_message(out: RequestOutput) -> str:
    """What to tell the client whose request the engine finished with ``finish_reason="error"``."""
    failed = _failed(out)
    detail = None if failed is None else failed.error
    return (f"the engine failed while running request {out.request_id}"
            f"{f': {detail}' if detail else ''}; other requests were not affected")


def raise_if_failed(out: RequestOutput) -> None:
    """Raise a 500 :class:`APIError` when the engine finished a completion of ``out`` with ``"error"``."""
    if _failed(out) is not None:
        raise APIError(500, failure_message(out), type="server_error", code="engine_error")


def _error_event(message: str) -> str:
    return sse(ErrorResponse(error=ErrorInfo(message=message, type="server_error", code="engine_error")))


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's position in ``streams``.

    Ends when every stream has ended; raises the first stream error (an :class:`EngineStepError`).
    Leaving the iteration early stops the readers and aborts every stream not yet finished.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:  # EngineStepError: handed to the reader
            q.put_nowait((i, e))
        q.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def completion_events(streams: Sequence[RequestStream], rid: str, created: int, model: str,
                            include_usage: bool, n: int = 1) -> AsyncIterator[str]:
    """SSE body of a streamed completion of one or more prompts: text deltas and a finish chunk per choice,
    optional usage (all prompts summed), ``[DONE]``.

    Choice ``j`` of prompt ``i`` (``streams[i]``) carries ``index`` ``i * n + j``, as in the non-streamed body.
    """
    try:
        last: dict[int, RequestOutput] = {}
        failed = False
        announced: set[int] = set()  # choices whose finish chunk went out
        async for i, out in merged(streams):
            last[i] = out
            if out.finished and _failed(out) is not None:
                yield _error_event(failure_message(out))
                failed = True
                continue
            for c in out.outputs:
                index = i * n + c.index
                if c.delta_text:
                    yield sse(CompletionResponse(id=rid, created=created, model=model,
                                                 choices=[CompletionChoice(index=index, text=c.delta_text)]))
                if c.finish_reason is not None and index not in announced:
                    announced.add(index)
                    yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[
                        CompletionChoice(index=index, text="", finish_reason=c.finish_reason)]))
        if include_usage and last and not failed:
            yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                         usage=usage(*(last[i] for i in sorted(last)))))
    except EngineStepError as e:
        yield _error_event(str(e))
    finally:
        for s in streams:
            s.abort()
    yield "data: [DONE]\n\n"


async def chat_events(stream: RequestStream, rid: str, created: int, model: str,
                      include_usage: bool, n: int = 1) -> AsyncIterator[str]:
    """SSE body of a streamed chat completion: a role chunk per choice, content deltas, a finish chunk per choice
    (each chunk's choice carries its ``index``), optional usage, ``[DONE]``."""
    try:
        for i in range(n):
            yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
        last: RequestOutput | None = None
        announced: set[int] = set()  # completions whose finish chunk went out
        async for out in stream:
            last = out
            if out.finished and _failed(out) is not None:
                yield _error_event(failure_message(out))
                last = None
                continue
            for c in out.outputs:
                if c.delta_text:
                    yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                        ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.delta_text))]))
                if c.finish_reason is not None and c.index not in announced:
                    announced.add(c.index)
                    yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                        ChatStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=c.finish_reason)]))
        if include_usage and last is not None:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage(last)))
    except EngineStepError as e:
        yield _error_event(str(e))
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"
