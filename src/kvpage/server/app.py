"""The OpenAI-compatible HTTP API: ``build_app(llm, served_model_name)`` and a thread runner for tests and benchmarks.

Routes:
    ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
    answers with server-sent events in OpenAI's chunk format, ending with
    ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Errors are OpenAI-style bodies ``{"error": {"message", "type", "param", "code"}}``:

======  =====================================================================================
status  when
======  =====================================================================================
400     malformed JSON; a value out of range (``max_tokens <= 0``, ``temperature > 2``,
        ``n != 1``, ...); a prompt that reaches the model's context (code
        ``context_length_exceeded``) or cannot fit in the KV cache; a token id outside the vocabulary
404     unknown model name (code ``model_not_found``) or route
422     a field of the wrong type, or a required field missing
500     the engine failed while the request ran (a stream gets an error event instead)
503     the engine is not running
======  =====================================================================================

A client that disconnects (mid-stream or while waiting for a non-streamed
answer) aborts its request; its KV blocks are freed before the engine's next step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kvpage.engine.outputs import RequestOutput
from kvpage.engine.sampling import SamplingParams
from kvpage.errors import PromptTooLongError
from kvpage.server.async_engine import AsyncEngine, EngineNotRunningError, EngineStepError, RequestStream
from kvpage.server.metrics import ServerMetrics
from kvpage.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
)

if TYPE_CHECKING:
    from kvpage.engine.llm import LLM

logger = logging.getLogger(__name__)

#: Pydantic error types that mean "a value out of range" (400) rather than "the wrong type" (422).
_VALUE_ERROR_TYPES = frozenset({
    "value_error", "greater_than", "greater_than_equal", "less_than", "less_than_equal",
    "too_short", "too_long", "literal_error",
})


class APIError(Exception):
    """An error answered with an OpenAI-style body.

    Args:
        status: HTTP status.
        message: what was wrong and what to do.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if one is.
        code: a machine-readable code (``model_not_found``, ``context_length_exceeded``).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        """The error as a JSON response."""
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def default_model_name(llm: LLM) -> str:
    """The name a model is served under by default: the GGUF file's stem or the model folder's name."""
    path = Path(llm.model_path)
    return path.stem if path.suffix == ".gguf" else path.name


def _validation_error(exc: RequestValidationError) -> APIError:
    """One OpenAI-style error for all of a request's validation errors.

    400 for malformed JSON and out-of-range values, 422 for wrong types and
    missing fields. The alternatives of a union field (``prompt``) are merged
    into one "expected one of" message.
    """
    errors = list(exc.errors())
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        e = dict(e, _loc=loc)
        key = "" if e.get("type") == "json_invalid" else (loc[0] if loc else "")
        groups.setdefault(key, []).append(e)
    parts: list[str] = []
    for field, errs in groups.items():
        if errs[0].get("type") == "json_invalid":
            detail = (errs[0].get("ctx") or {}).get("error", "")
            where = ".".join(errs[0]["_loc"])
            parts.append(f"malformed JSON body{f' at position {where}' if where else ''}"
                         f"{f': {detail}' if detail else ''}")
        elif len(errs) > 1 and all(len(e["_loc"]) > 1 and not e["_loc"][1].isdigit() for e in errs):
            kinds = sorted({e["_loc"][1] for e in errs})  # a union: loc = (field, member type, ...)
            parts.append(f"{field}: wrong type; expected one of {', '.join(kinds)}")
        else:
            for e in errs:
                msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
                parts.append(f"{'.'.join(e['_loc'])}: {msg}" if e["_loc"] else msg)
    types = {e.get("type") for e in errors}
    status = 400 if "json_invalid" in types or types <= _VALUE_ERROR_TYPES else 422
    param = next((k for k in groups if k), None)
    return APIError(status, "; ".join(parts) or "invalid request", param=param)


class _SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops its body iterator as soon as the client disconnects.

    Starlette watches for the disconnect only under some ASGI spec versions; this
    always does, so the body's ``finally`` (which aborts the request) runs at once.
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


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _final_unless_disconnected(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The finished output, or ``None`` when the client went away first (the request is then aborted).

    Raises:
        APIError: 500 when the engine failed while the request ran.
    """
    final = asyncio.ensure_future(stream.final())
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (final, gone):
            task.cancel()
        stream.abort()
    if final not in done:
        return None
    try:
        return final.result()
    except EngineStepError as e:
        raise APIError(500, str(e), type="server_error") from e


def _sse(payload: Any) -> str:
    """One server-sent event (``data: <json>``)."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _usage(out: RequestOutput) -> UsageInfo:
    m = out.metrics
    return UsageInfo.build(m.prompt_tokens, len(out.outputs[0].token_ids), m.cached_tokens)


def _engine_error_body(e: Exception) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=str(e), type="server_error"))


def build_app(llm: LLM, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` under ``served_model_name``.

    The app owns an :class:`~kvpage.server.async_engine.AsyncEngine` (started and
    stopped by the app's lifespan) and its own metrics registry. From startup
    until shutdown, nothing else may use ``llm.engine`` or ``llm.tokenizer``.

    Args:
        llm: the model and engine to serve.
        served_model_name: the ``model`` clients must send; default :func:`default_model_name`.

    Returns:
        The app; ``app.state.engine`` is the :class:`AsyncEngine`, ``app.state.metrics``
        the :class:`~kvpage.server.metrics.ServerMetrics`.
    """
    name = served_model_name or default_model_name(llm)
    metrics = ServerMetrics(lambda: engine.stats(), name)  # scraped only once the engine below exists
    engine = AsyncEngine(llm, observer=metrics)
    vocab_size = int(llm.config.vocab_size)
    context_tokens = min(int(llm.max_model_len), int(llm.max_cache_tokens))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="kvpage", description="OpenAI-compatible API on a paged KV cache.", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served_model_name = name

    # -- errors --------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    # -- helpers -------------------------------------------------------------------------------
    def check_model(model: str) -> None:
        if model != name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}` "
                                f"(see GET /v1/models).", param="model", code="model_not_found")

    async def submit(rid: str, make_prompt: Callable[[], tuple[str | None, list[int]]],
                     params: SamplingParams | Callable[[list[int]], SamplingParams], param: str) -> RequestStream:
        try:
            return await engine.add_request(rid, make_prompt, params)
        except PromptTooLongError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from e
        except EngineNotRunningError as e:
            raise APIError(503, str(e), type="server_error") from e
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=param) from e
        except Exception as e:  # jinja2 template errors and the like: the input could not be rendered
            if type(e).__module__.startswith("jinja2"):
                raise APIError(400, f"the messages cannot be rendered with the chat template: {e}",
                               param=param) from e
            raise

    def sampling(body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
        try:
            return body.sampling_params(default_max_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    # -- routes --------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        """200 while the engine thread runs, 503 otherwise."""
        if not engine.is_running:
            raise APIError(503, f"the engine is not running{f': {engine.error}' if engine.error else ''}",
                           type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        """Prometheus text exposition of the ``kvpage:`` metrics."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        """The one served model."""
        return ModelList(data=[ModelCard(id=name, max_model_len=int(llm.max_model_len))])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI's text completion; ``stream: true`` answers with SSE chunks."""
        check_model(body.model)
        params = sampling(body, DEFAULT_COMPLETION_MAX_TOKENS)
        prompt = body.prompt
        if isinstance(prompt, str):
            text = prompt

            def make_prompt() -> tuple[str | None, list[int]]:
                return llm.encode(text)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                               param="prompt")

            def make_prompt() -> tuple[str | None, list[int]]:
                return None, ids

        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await submit(rid, make_prompt, params, "prompt")
        created = int(time.time())
        if body.stream:
            return _SSEResponse(_completion_events(stream, rid, created, name, body.include_usage), stream.abort)
        out = await _final_unless_disconnected(stream, request)
        if out is None:
            return Response(status_code=499)  # nobody is listening
        c = out.outputs[0]
        return JSONResponse(CompletionResponse(
            id=rid, created=created, model=name, usage=_usage(out),
            choices=[CompletionChoice(text=c.text, finish_reason=c.finish_reason)],
        ).model_dump())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completion; ``stream: true`` answers with SSE ``chat.completion.chunk`` s."""
        check_model(body.model)
        messages = body.chat_messages()
        asked = body.requested_max_tokens()
        params = sampling(body, asked or 1)

        def make_prompt() -> tuple[str | None, list[int]]:
            rendered = llm.chat_prompt(messages)
            return rendered["prompt"], list(rendered["prompt_token_ids"])

        def until_context_end(ids: list[int]) -> SamplingParams:
            return replace(params, max_tokens=max(1, context_tokens - len(ids)))

        # Without a limit, answer up to the end of the context (or of the KV cache, if smaller).
        params_arg = params if asked is not None else until_context_end

        stream = await submit(f"chatcmpl-{uuid.uuid4().hex}", make_prompt, params_arg, "messages")
        rid = stream.request_id
        created = int(time.time())
        if body.stream:
            return _SSEResponse(_chat_events(stream, rid, created, name, body.include_usage), stream.abort)
        out = await _final_unless_disconnected(stream, request)
        if out is None:
            return Response(status_code=499)
        c = out.outputs[0]
        return JSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=name, usage=_usage(out),
            choices=[ChatChoice(message=AssistantMessage(content=c.text), finish_reason=c.finish_reason)],
        ).model_dump())

    return app


async def _completion_events(stream: RequestStream, rid: str, created: int, model: str,
                             include_usage: bool) -> AsyncIterator[str]:
    """SSE body of a streamed completion: text deltas, a finish chunk, optional usage, ``[DONE]``."""
    try:
        last: RequestOutput | None = None
        async for out in stream:
            last = out
            c = out.outputs[0]
            if c.delta_text:
                yield _sse(CompletionResponse(id=rid, created=created, model=model,
                                              choices=[CompletionChoice(text=c.delta_text)]))
            if out.finished:
                yield _sse(CompletionResponse(id=rid, created=created, model=model,
                                              choices=[CompletionChoice(text="", finish_reason=c.finish_reason)]))
        if include_usage and last is not None:
            yield _sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=_usage(last)))
    except EngineStepError as e:
        yield _sse(_engine_error_body(e))
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"


async def _chat_events(stream: RequestStream, rid: str, created: int, model: str,
                       include_usage: bool) -> AsyncIterator[str]:
    """SSE body of a streamed chat completion: role chunk, content deltas, finish chunk, optional usage, ``[DONE]``."""
    try:
        yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
            ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))]))
        last: RequestOutput | None = None
        async for out in stream:
            last = out
            c = out.outputs[0]
            if c.delta_text:
                yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                    ChatStreamChoice(delta=DeltaMessage(content=c.delta_text))]))
            if out.finished:
                yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                    ChatStreamChoice(delta=DeltaMessage(), finish_reason=c.finish_reason)]))
        if include_usage and last is not None:
            yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=_usage(last)))
    except EngineStepError as e:
        yield _sse(_engine_error_body(e))
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"


class ServerThread:
    """Run an app on uvicorn in a background thread on a loopback port (tests, benchmarks, notebooks).

    Args:
        app: the ASGI app (e.g. from :func:`build_app`).
        host: interface to bind.
        port: TCP port; ``0`` picks a free one (see :attr:`port` after :meth:`start`).
        log_level: uvicorn's log level.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                     timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self._thread = threading.Thread(target=self.server.run, name="kvpage-uvicorn", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start serving and wait until the socket listens (and the app's startup ran).

        Raises:
            RuntimeError: the server did not start within ``timeout`` seconds or exited.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the uvicorn server exited during startup (port in use? see its log)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the uvicorn server did not start within {timeout:.0f} s")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit (the app's shutdown stops the engine) and join the thread."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
