"""The OpenAI-compatible HTTP API: ``build_app(llm, served_model_name)`` and a thread runner for tests and benchmarks.

Routes:
    ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
    answers with server-sent events in OpenAI's chunk format, ending with
    ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
    ``GET /openapi.json`` (this server's schema: the request constraints of
    :mod:`kvpage.server.protocol`, with ``model`` and the token limits of the served model).

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``
(:mod:`kvpage.server.errors`); ``param`` names the field at fault where there is one:

======  =====================================================================================
status  when
======  =====================================================================================
400     any field of the wrong type (strict: ``"5"`` is not an integer, ``"yes"`` not a
        boolean), out of range, or missing; malformed JSON; a body that is not a JSON object;
        a prompt that reaches the model's context, or prompt + ``max_tokens`` beyond it (code
        ``context_length_exceeded``, both numbers in the message); a token id outside the vocabulary
404     unknown model name (code ``model_not_found``) or route (code ``not_found``)
405     a route asked with the wrong method (``Allow`` header lists the right one)
500     the engine failed on this request (``finish_reason="error"``, or its step raised);
        code ``engine_error``. A stream gets a final ``data: {"error": ...}`` event before
        ``[DONE]`` instead. Other requests and the server go on.
503     the engine is not running
======  =====================================================================================

A client that disconnects (mid-stream or while waiting for a non-streamed
answer) aborts its request; its KV blocks are freed before the engine's next step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvpage.engine.outputs import RequestOutput
from kvpage.engine.sampling import MAX_N, SamplingParams
from kvpage.errors import PromptTooLongError
from kvpage.server.async_engine import AsyncEngine, EngineNotRunningError, EngineStepError, RequestStream
from kvpage.server.errors import ERROR_RESPONSES, APIError, install_error_handlers
from kvpage.server.jsonsafe import SafeJSONResponse
from kvpage.server.metrics import ServerMetrics
from kvpage.server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from kvpage.server.sse import SSEResponse, chat_events, completion_events, raise_if_failed, usage

if TYPE_CHECKING:
    from kvpage.engine.llm import LLM

logger = logging.getLogger(__name__)


class ContextOverflowError(PromptTooLongError):
    """Prompt + the requested output tokens exceed the context; ``param`` names the limit's field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def default_model_name(llm: LLM) -> str:
    """The name a model is served under by default: the GGUF file's stem or the model folder's name."""
    path = Path(llm.model_path)
    return path.stem if path.suffix == ".gguf" else path.name


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _finals_unless_disconnected(streams: Sequence[RequestStream],
                                      request: Request) -> list[RequestOutput] | None:
    """The finished outputs of ``streams`` in order, or ``None`` when the client went away first (every
    request is then aborted).

    Raises:
        APIError: 500 when the engine failed while a request ran (its step raised,
            or it finished the request with ``finish_reason="error"``).
    """
    finals = asyncio.ensure_future(asyncio.gather(*(s.final() for s in streams)))
    finals.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled gather's error: seen, not logged
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({finals, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (finals, gone):
            task.cancel()
        for s in streams:
            s.abort()
    if finals not in done:
        return None
    try:
        outs = finals.result()
    except EngineStepError as e:
        raise APIError(500, str(e), type="server_error", code="engine_error") from e
    for out in outs:
        raise_if_failed(out)
    return list(outs)


def _cap_integers(node: Any, maximum: int) -> None:
    """Set ``maximum`` on every integer-typed node of a JSON schema (the branches of an ``anyOf`` too)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = min(maximum, node.get("maximum", maximum))
        for key in ("anyOf", "oneOf", "items"):
            sub = node.get(key)
            for s in sub if isinstance(sub, list) else [sub]:
                _cap_integers(s, maximum)


def _serve_openapi(app: FastAPI, name: str, context_tokens: int, vocab_size: int) -> None:
    """Put this server's facts in the app's cached OpenAPI schema: ``model`` is ``name``, token limits the model's.

    FastAPI's own 422 responses are replaced by the 400 this server answers. Call
    after every route is added (FastAPI rebuilds the schema when routes change).
    """
    schema = app.openapi()
    comps = schema.get("components", {}).get("schemas", {})
    for cls in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps.get(cls, {}).get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": [name], "title": "Model",
                              "description": "The served model's name (GET /v1/models); others get 404."}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _cap_integers(props[field], context_tokens - 1)
        for field in ("prompt", "stop_token_ids"):
            if field in props:
                _cap_integers(props[field], vocab_size - 1)
    for name_ in ("HTTPValidationError", "ValidationError"):
        comps.pop(name_, None)
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)


def build_app(llm: LLM, served_model_name: str | None = None, *, close_llm: bool = False) -> FastAPI:
    """The FastAPI app serving ``llm`` under ``served_model_name``.

    The app owns an :class:`~kvpage.server.async_engine.AsyncEngine` (started and
    stopped by the app's lifespan) and its own metrics registry. From startup
    until shutdown, nothing else may use ``llm.engine`` or ``llm.tokenizer``.

    Args:
        llm: the model and engine to serve.
        served_model_name: the ``model`` clients must send; default :func:`default_model_name`.
        close_llm: the app owns ``llm`` (``kvpage serve``): its shutdown closes it after the engine thread stops
            (:meth:`LLM.close <kvpage.engine.llm.LLM.close>`: the KV events publisher sends what is queued and closes
            its sockets, the stores close). Off by default, for callers that serve one ``LLM`` several times.

    Returns:
        The app; ``app.state.engine`` is the :class:`AsyncEngine`, ``app.state.metrics``
        the :class:`~kvpage.server.metrics.ServerMetrics`, ``app.state.context_tokens``
        the most prompt + output tokens one request may have.
    """
    name = served_model_name or default_model_name(llm)
    metrics = ServerMetrics(lambda: engine.stats(), name)  # scraped only once the engine below exists
    engine = AsyncEngine(llm, observer=metrics)
    vocab_size = int(llm.config.vocab_size)
    max_model_len = int(llm.max_model_len)
    context_tokens = min(max_model_len, int(llm.max_cache_tokens))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            if close_llm:
                await asyncio.to_thread(llm.close)  # after the engine's last step: its last batch is queued

    app = FastAPI(title="kvpage", description="OpenAI-compatible API on a paged KV cache.", lifespan=lifespan,
                  default_response_class=SafeJSONResponse)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served_model_name = name
    app.state.context_tokens = context_tokens
    install_error_handlers(app)

    # -- helpers -------------------------------------------------------------------------------
    def check_model(model: str) -> None:
        if model != name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}` "
                                f"(see GET /v1/models).", param="model", code="model_not_found")

    def check_stop_token_ids(body: CompletionRequest | ChatCompletionRequest) -> None:
        bad = [t for t in body.stop_token_ids if t >= vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids: ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                           param="stop_token_ids")

    async def submit(rid: str, make_prompt: Callable[[], tuple[str | None, list[int]]],
                     params: SamplingParams | Callable[[list[int]], SamplingParams], param: str) -> RequestStream:
        try:
            return await engine.add_request(rid, make_prompt, params)
        except ContextOverflowError as e:
            raise APIError(400, str(e), param=e.param, code="context_length_exceeded") from e
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

    def kv_transfer(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
        """Check ``kv_transfer_params`` against the server's ``kv_role``; the answer's ``kv_transfer_params`` (a
        prefill request's, ``do_remote_decode``: the decode request's, as vLLM's proxy passes it on) or ``None``."""
        p = body.kv_transfer_params
        if p is None:
            return None
        kt = llm.engine_config.kv_transfer
        if kt is None:
            raise APIError(400, "kv_transfer_params: this server was started without --kv-transfer-config "
                                "(prefill/decode disaggregation is off)", param="kv_transfer_params")
        if p.do_remote_decode and not kt.is_kv_producer:
            raise APIError(400, f"kv_transfer_params.do_remote_decode needs kv_role kv_producer or kv_both; this "
                                f"server is {kt.kv_role}", param="kv_transfer_params")
        if p.do_remote_prefill and not kt.is_kv_consumer:
            raise APIError(400, f"kv_transfer_params.do_remote_prefill needs kv_role kv_consumer or kv_both; this "
                                f"server is {kt.kv_role}", param="kv_transfer_params")
        if not p.do_remote_decode:
            return None
        if body.stream:
            raise APIError(400, "kv_transfer_params.do_remote_decode needs stream false: the answer carries the "
                                "decode request's kv_transfer_params", param="kv_transfer_params")
        # the blocks are in the store when the answer leaves (the engine flushes a producer's writes): the decode
        # instance finds them by hash, so vLLM's remote addresses stay empty
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}

    def sampling(body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
        try:
            return body.sampling_params(default_max_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    def fitted(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams,
               default: int | None) -> Callable[[list[int]], SamplingParams]:
        """``params`` for a prompt of known length: an asked-for limit must fit the context (else 400);
        without one, ``default`` (``None``: up to the end of the context) is cut to what fits."""
        asked = body.requested_max_tokens()
        field = body.max_tokens_param

        def fit(ids: list[int]) -> SamplingParams:
            n = len(ids)
            if n >= max_model_len:
                return params  # the engine's own "prompt too long" error names max_model_len
            room = context_tokens - n
            if asked is None:
                return replace(params, max_tokens=max(1, room if default is None else min(default, room)))
            if asked > room:
                where = (f"This model's maximum context length is {max_model_len} tokens"
                         if context_tokens == max_model_len else
                         f"The KV cache holds {context_tokens} tokens (max_model_len {max_model_len})")
                raise ContextOverflowError(
                    f"{where}. However, you requested {n + asked} tokens ({n} in the prompt, {asked} in "
                    f"{field}). Reduce the prompt or {field} (at most {max(room, 0)} here).", field)
            return params

        return fit

    # -- routes --------------------------------------------------------------------------------
    health_ok = {"content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"type": "string", "enum": ["ok"]}}, "required": ["status"]}}}}

    @app.get("/health", responses={200: health_ok, 503: ERROR_RESPONSES[503]})
    async def health() -> Response:
        """200 while the engine thread runs, 503 otherwise."""
        if not engine.is_running:
            raise APIError(503, f"the engine is not running{f': {engine.error}' if engine.error else ''}",
                           type="server_error")
        return SafeJSONResponse({"status": "ok"})

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics_route() -> Response:
        """Prometheus text exposition of the ``kvpage:`` metrics."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        """The one served model."""
        return ModelList(data=[ModelCard(id=name, max_model_len=max_model_len)])

    def generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
        event = {"type": "object", "required": ["data"], "properties": {"data": {
            "type": "string", "description": "a chunk or error object as JSON, or [DONE] (the last event)"}}}
        return {200: {"model": model, "description": "The completion, or with stream: true its server-sent events",
                      "content": {"text/event-stream": {"schema": event}}}, **ERROR_RESPONSES}

    def prompt_maker(prompt: str | list[int], field: str) -> Callable[[], tuple[str | None, list[int]]]:
        """The engine-thread tokenizer of one completion prompt; token ids are checked here (400 naming ``field``)."""
        if isinstance(prompt, str):
            return lambda: llm.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"{field}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                           param=field)
        return lambda: (None, ids)

    @app.post("/v1/completions", response_model=None, responses=generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI's text completion of one prompt or an array of them; ``stream: true`` answers with SSE chunks.

        Prompt ``i`` of an array is its own engine request (``<id>-<i>``); its ``n`` choices are the response's
        ``index`` ``i * n`` to ``i * n + n - 1``, and ``usage`` sums every prompt's tokens. An error of one
        prompt (``prompt[i]`` in ``param`` or the message) fails the whole request; nothing of it runs on.
        """
        check_model(body.model)
        check_stop_token_ids(body)
        transfer = kv_transfer(body)
        params = sampling(body, body.requested_max_tokens() or DEFAULT_COMPLETION_MAX_TOKENS)
        prompts = body.prompts()
        if len(prompts) * params.n > MAX_N:
            raise APIError(400, f"prompt: {len(prompts)} prompts x n {params.n} = {len(prompts) * params.n} choices; "
                                f"a request may ask for at most {MAX_N} in all (send fewer prompts per request, "
                                f"or a smaller n)", param="prompt")
        arrayed = isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list))  # an array of prompts
        fields = [f"prompt[{i}]" if arrayed else "prompt" for i in range(len(prompts))]
        makers = [prompt_maker(p, f) for p, f in zip(prompts, fields)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, (make_prompt, field) in enumerate(zip(makers, fields)):
                try:
                    streams.append(await submit(rid if len(makers) == 1 else f"{rid}-{i}", make_prompt,
                                                fitted(body, params, DEFAULT_COMPLETION_MAX_TOKENS), field))
                except APIError as e:
                    if arrayed and not e.info.message.startswith(field):
                        e.info.message = f"{field}: {e.info.message}"
                    raise
        except BaseException:
            for s in streams:
                s.abort()
            raise
        created = int(time.time())
        if body.stream:
            def close() -> None:
                for s in streams:
                    s.abort()

            return SSEResponse(completion_events(streams, rid, created, name, body.include_usage, params.n), close)
        outs = await _finals_unless_disconnected(streams, request)
        if outs is None:
            return Response(status_code=499)  # nobody is listening
        return SafeJSONResponse(CompletionResponse(
            id=rid, created=created, model=name, usage=usage(*outs), kv_transfer_params=transfer,
            choices=[CompletionChoice(index=i * params.n + c.index, text=c.text, finish_reason=c.finish_reason)
                     for i, out in enumerate(outs) for c in sorted(out.outputs, key=lambda c: c.index)],
        ).model_dump())

    @app.post("/v1/chat/completions", response_model=None, responses=generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completion; ``stream: true`` answers with SSE ``chat.completion.chunk`` s.

        Without ``max_tokens``/``max_completion_tokens`` the answer may run to the end of the
        context (or of the KV cache, if smaller).
        """
        check_model(body.model)
        check_stop_token_ids(body)
        transfer = kv_transfer(body)
        messages = body.chat_messages()
        params = sampling(body, body.requested_max_tokens() or 1)

        def make_prompt() -> tuple[str | None, list[int]]:
            rendered = llm.chat_prompt(messages)
            return rendered["prompt"], list(rendered["prompt_token_ids"])

        stream = await submit(f"chatcmpl-{uuid.uuid4().hex}", make_prompt, fitted(body, params, None), "messages")
        rid = stream.request_id
        created = int(time.time())
        if body.stream:
            return SSEResponse(chat_events(stream, rid, created, name, body.include_usage, params.n), stream.abort)
        finals = await _finals_unless_disconnected([stream], request)
        if finals is None:
            return Response(status_code=499)
        (out,) = finals
        return SafeJSONResponse(ChatCompletionResponse(
            id=rid, created=created, model=name, usage=usage(out), kv_transfer_params=transfer,
            choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason)
                     for c in out.outputs],
        ).model_dump())

    _serve_openapi(app, name, context_tokens, vocab_size)  # what /openapi.json serves
    return app


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
