"""The HTTP boundary on a tiny random model: strict request types, ranges, context limits, router errors, engine errors.

Every failed request must get an OpenAI-style ``{"error": {"message", "type",
"param", "code"}}`` body whose ``param`` names the field at fault, and a request
the engine finishes with ``finish_reason="error"`` must give its client a 500
(or a final SSE error event) while other requests and the server go on.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from _tiny_model import tiny_random_model

from kvpage import LLM
from kvpage.server.app import ServerThread, build_app

MODEL = "tiny"
CONTEXT = 64
MSGS = [{"role": "user", "content": "hi"}]
POISON = 4242  # a prompt starting with this token id is failed by the fake engine step below


@pytest.fixture(scope="module")
def tiny(smollm2):
    """The tiny random model on the bundled tokenizer (context 64)."""
    return tiny_random_model(smollm2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def server(tiny) -> Iterator[SimpleNamespace]:
    """A live server on the tiny model (max_model_len 64, 64 blocks of 16); ``.http`` is an httpx client."""
    llm = LLM(tiny, num_blocks=64, max_model_len=CONTEXT, progress=False)
    app = build_app(llm, MODEL)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        yield SimpleNamespace(url=srv.url, llm=llm, app=app, http=http)


def error_of(r: httpx.Response) -> dict:
    """The ``error`` object of an OpenAI-style error body (asserting its shape)."""
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def cmpl(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MSGS, **fields}


STRICT_CASES = [
    # (id, path, body, param, words in the message)
    ("max_tokens-string", "/v1/completions", cmpl(max_tokens="5"), "max_tokens", 'expected an integer, got "5"'),
    ("max_tokens-bool", "/v1/completions", cmpl(max_tokens=True), "max_tokens", "expected an integer, got true"),
    ("max_tokens-float", "/v1/completions", cmpl(max_tokens=1.5), "max_tokens", "expected an integer, got 1.5"),
    ("max_tokens-zero", "/v1/chat/completions", chat(max_tokens=0), "max_tokens", "must be >= 1, got 0"),
    ("max_completion_tokens-neg", "/v1/chat/completions", chat(max_completion_tokens=-3), "max_completion_tokens",
     "must be >= 1"),
    ("stream-string", "/v1/completions", cmpl(stream="yes"), "stream", "expected a boolean"),
    ("stream-int", "/v1/chat/completions", chat(stream=1), "stream", "expected a boolean"),
    ("ignore_eos-string", "/v1/completions", cmpl(ignore_eos="true"), "ignore_eos", "expected a boolean"),
    ("temperature-string", "/v1/completions", cmpl(temperature="1"), "temperature", "expected a number"),
    ("temperature-bool", "/v1/completions", cmpl(temperature=True), "temperature", "expected a number"),
    ("temperature-range", "/v1/completions", cmpl(temperature=2.5), "temperature", "must be <= 2"),
    ("top_p-zero", "/v1/completions", cmpl(top_p=0), "top_p", "must be > 0"),
    ("top_k-below", "/v1/completions", cmpl(top_k=-2), "top_k", "must be >= -1"),
    ("top_k-float", "/v1/completions", cmpl(top_k=5.5), "top_k", "expected an integer"),
    ("seed-string", "/v1/completions", cmpl(seed="42"), "seed", "expected an integer"),
    ("seed-huge", "/v1/completions", cmpl(seed=2**64), "seed", "must be <="),
    ("n-too-many", "/v1/completions", cmpl(n=129), "n", "must be <= 128: completions per prompt, 1 to 128"),
    ("n-string", "/v1/completions", cmpl(n="1"), "n", "expected an integer"),
    ("stop-five", "/v1/completions", cmpl(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    ("stop-int", "/v1/completions", cmpl(stop=5), "stop", "expected a string or an array of strings"),
    ("stop-empty", "/v1/completions", cmpl(stop=[""]), "stop[0]", "must not be empty"),
    ("stop_token_ids-neg", "/v1/completions", cmpl(stop_token_ids=[-1]), "stop_token_ids[0]", "must be >= 0"),
    ("stop_token_ids-vocab", "/v1/completions", cmpl(stop_token_ids=[10**7]), "stop_token_ids", "vocabulary"),
    ("stop_token_ids-str", "/v1/completions", cmpl(stop_token_ids=["1"]), "stop_token_ids[0]", "expected an integer"),
    ("echo", "/v1/completions", cmpl(echo=True), "echo", "not supported"),
    ("stream_options-no-stream", "/v1/completions", cmpl(stream_options={"include_usage": True}), "stream_options",
     "only allowed when stream is true"),
    ("include_usage-string", "/v1/completions", cmpl(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage", "expected a boolean"),
    ("model-int", "/v1/completions", cmpl(model=5), "model", "expected a string"),
    ("prompt-missing", "/v1/completions", {"model": MODEL}, "prompt", "required"),
    ("prompt-empty", "/v1/completions", cmpl(prompt=""), "prompt", "must not be empty"),
    ("prompt-mixed", "/v1/completions", cmpl(prompt=[1, "a"]), "prompt", "expected a string or an array of integers"),
    ("prompt-array-empty", "/v1/completions", cmpl(prompt=[]), "prompt", "at least 1"),
    ("prompt-array-mixed", "/v1/completions", cmpl(prompt=["a", [1, 2]]), "prompt", "expected a string or"),
    ("prompt-array-empty-string", "/v1/completions", cmpl(prompt=["a", ""]), "prompt[1]", "must not be empty"),
    ("prompt-array-empty-ids", "/v1/completions", cmpl(prompt=[[1], []]), "prompt[1]", "at least 1"),
    ("prompt-array-129", "/v1/completions", cmpl(prompt=["a"] * 129), "prompt", "at most 128"),
    ("prompt-array-x-n", "/v1/completions", cmpl(prompt=["a", "b", "c"], n=43), "prompt",
     "3 prompts x n 43 = 129 choices; a request may ask for at most 128"),
    ("prompt-array-out-of-vocab", "/v1/completions", cmpl(prompt=[[1, 2], [3, 10**9]]), "prompt[1]", "vocabulary"),
    ("prompt-negative-id", "/v1/completions", cmpl(prompt=[-1]), "prompt[0]", "must be >= 0"),
    ("prompt-out-of-vocab", "/v1/completions", cmpl(prompt=[1, 10**9]), "prompt", "vocabulary"),
    ("messages-empty", "/v1/chat/completions", chat(messages=[]), "messages", "at least 1"),
    ("messages-string", "/v1/chat/completions", chat(messages="hello"), "messages", "expected an array"),
    ("role-tool", "/v1/chat/completions", chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role",
     "must be 'system', 'developer', 'user' or 'assistant'"),
    ("role-missing", "/v1/chat/completions", chat(messages=[{"content": "x"}]), "messages[0].role", "required"),
    ("content-missing", "/v1/chat/completions", chat(messages=[{"role": "user"}]), "messages[0].content",
     "required for a user message"),
    ("content-int", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content",
     "expected a string or an array of text content parts"),
    ("content-image", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type", "must be 'text'"),
]


UNSUPPORTED_CASES = [
    # known OpenAI fields the server cannot honour: a non-"off" value is a 400 naming the field
    ("logprobs-chat", "/v1/chat/completions", chat(logprobs=True), "logprobs", "true is not supported"),
    ("top_logprobs", "/v1/chat/completions", chat(top_logprobs=2), "top_logprobs", "2 is not supported"),
    ("logprobs-cmpl", "/v1/completions", cmpl(logprobs=2), "logprobs", "2 is not supported"),
    ("logprobs-cmpl-zero", "/v1/completions", cmpl(logprobs=0), "logprobs", "0 is not supported"),
    ("best_of", "/v1/completions", cmpl(best_of=2), "best_of", "2 is not supported"),
    ("suffix", "/v1/completions", cmpl(suffix="end"), "suffix", '"end" is not supported'),
    ("response_format-json", "/v1/chat/completions", chat(response_format={"type": "json_object"}),
     "response_format", '{"type": "json_object"} is not supported'),
    ("response_format-schema", "/v1/completions", cmpl(response_format={"type": "json_schema", "json_schema": {}}),
     "response_format", "is not supported"),
    ("tools", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools",
     "is not supported"),
    ("tool_choice", "/v1/chat/completions", chat(tool_choice="auto"), "tool_choice", '"auto" is not supported'),
    ("functions", "/v1/chat/completions", chat(functions=[{"name": "f"}]), "functions", "is not supported"),
    ("function_call", "/v1/chat/completions", chat(function_call={"name": "f"}), "function_call", "is not supported"),
    ("logit_bias", "/v1/completions", cmpl(logit_bias={"5": 10}), "logit_bias", "is not supported"),
    ("presence_penalty", "/v1/completions", cmpl(presence_penalty=0.5), "presence_penalty", "0.5 is not supported"),
    ("frequency_penalty", "/v1/chat/completions", chat(frequency_penalty=-1), "frequency_penalty",
     "-1.0 is not supported"),
    # wrong types are 400 like every strict field
    ("presence_penalty-string", "/v1/completions", cmpl(presence_penalty="x"), "presence_penalty",
     'expected a number, got "x"'),
    ("frequency_penalty-range", "/v1/completions", cmpl(frequency_penalty=3), "frequency_penalty", "must be <= 2"),
    ("logprobs-chat-int", "/v1/chat/completions", chat(logprobs=1), "logprobs", "expected a boolean"),
    ("logprobs-cmpl-bool", "/v1/completions", cmpl(logprobs=True), "logprobs", "expected an integer"),
    ("best_of-string", "/v1/completions", cmpl(best_of="2"), "best_of", "expected an integer"),
    ("response_format-string", "/v1/chat/completions", chat(response_format="text"), "response_format",
     "expected an object"),
    ("tools-object", "/v1/chat/completions", chat(tools={"type": "function"}), "tools", "expected an array"),
    ("logit_bias-values", "/v1/completions", cmpl(logit_bias={"5": "x"}), "logit_bias.5", "expected a number"),
]
STRICT_CASES += UNSUPPORTED_CASES


def test_unsupported_fields_at_their_off_value_are_accepted(server) -> None:
    """null/false/0/{}/[]/"none"/{"type": "text"} of each unsupported field is what the server does anyway: 200."""
    off = dict(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"})
    r = server.http.post("/v1/completions", json=cmpl(max_tokens=2, logprobs=None, best_of=1, suffix="", **off))
    assert r.status_code == 200, r.text
    r = server.http.post("/v1/chat/completions", json=chat(max_tokens=2, logprobs=False, top_logprobs=0, tools=[],
                                                           tool_choice="none", functions=None, function_call="none",
                                                           **off))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("path,body,param,words", [c[1:] for c in STRICT_CASES], ids=[c[0] for c in STRICT_CASES])
def test_strict_fields_are_400_naming_the_field(server, path, body, param, words) -> None:
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert words in err["message"], err
    assert err["message"].startswith(param.split("[")[0]) or "vocabulary" in words, err


def test_lax_where_openai_is_lax(server) -> None:
    """An integer is a number (temperature 1), an integral number an integer (JSON Schema's rule: max_tokens 3.0),
    unknown fields are ignored, assistant content may be null."""
    r = server.http.post("/v1/completions", json=cmpl(temperature=1, top_p=1, max_tokens=3.0, ignore_eos=True,
                                                      presence_penalty=0, logit_bias={}, whatever=[1]))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    msgs = [{"role": "assistant", "content": None}, {"role": "user", "content": [{"type": "text", "text": "hi"}],
                                                     "name": "bob"}]
    r = server.http.post("/v1/chat/completions", json=chat(messages=msgs, max_completion_tokens=2, ignore_eos=True,
                                                           stop=["zz"], stop_token_ids=[7], seed=-5))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_tiny_temperature_and_top_p(server, field) -> None:
    """Found by schemathesis: 1e-300 is a valid temperature/top_p (in range) and must sample, not fail."""
    r = server.http.post("/v1/completions", json=cmpl(max_tokens=2, **{field: 1e-300}))
    assert r.status_code == 200, r.text


#: Every optional request field, per endpoint: OpenAI documents each as nullable (null = the default).
COMMON_OPTIONAL = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "n", "stream", "stream_options", "user", "presence_penalty", "frequency_penalty", "logit_bias",
                   "response_format"]
NULLABLE = ([("/v1/completions", f) for f in [*COMMON_OPTIONAL, "logprobs", "best_of", "suffix", "echo"]]
            + [("/v1/chat/completions", f) for f in [*COMMON_OPTIONAL, "max_completion_tokens", "logprobs",
                                                     "top_logprobs", "tools", "functions", "tool_choice",
                                                     "function_call"]])


def _answer(r: httpx.Response) -> list[str]:
    """The choices' texts of a (non-streamed) completion or chat completion."""
    assert r.status_code == 200, r.text
    return [c.get("text", c.get("message", {}).get("content")) for c in r.json()["choices"]]


@pytest.mark.parametrize("path,field", NULLABLE, ids=[f"{'chat' if 'chat' in p else 'cmpl'}-{f}" for p, f in NULLABLE])
def test_null_is_the_default_for_every_optional_field(server, path, field) -> None:
    """Issue 29 item 6: ``"temperature": null`` (and every other optional field) is the field left out."""
    base = {"max_tokens": 4, "seed": 7}
    if field == "seed":
        base = {"max_tokens": 4, "temperature": 0}
    elif field in ("max_tokens", "max_completion_tokens"):
        base = {"seed": 7, "ignore_eos": True} if field == "max_tokens" else {"seed": 7, "max_tokens": 3}
    body = cmpl(**base) if path == "/v1/completions" else chat(**base)
    with_null = server.http.post(path, json={**body, field: None})
    without = server.http.post(path, json=body)
    assert _answer(with_null) == _answer(without)
    counts = [{k: v for k, v in r.json()["usage"].items() if k != "prompt_tokens_details"} for r in (with_null, without)]
    assert counts[0] == counts[1]                       # (the second request may hit the prefix cache)


def test_null_stream_options_include_usage_is_false(server) -> None:
    r = server.http.post("/v1/completions", json=cmpl(max_tokens=2, stream=True,
                                                      stream_options={"include_usage": None}))
    assert r.status_code == 200, r.text
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:]).get("usage") is None for e in events[:-1])


@pytest.mark.parametrize("path,field", [("/v1/completions", "model"), ("/v1/completions", "prompt"),
                                        ("/v1/chat/completions", "model"), ("/v1/chat/completions", "messages")])
def test_null_for_a_required_field_is_still_400(server, path, field) -> None:
    body = cmpl(max_tokens=2) if path == "/v1/completions" else chat(max_tokens=2)
    r = server.http.post(path, json={**body, field: None})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == field


def test_openapi_schema_says_every_optional_field_is_nullable(server) -> None:
    schema = server.http.get("/openapi.json").json()["components"]["schemas"]

    def nullable(prop: dict) -> bool:
        types = prop.get("type")
        return (types == "null" or isinstance(types, list) and "null" in types
                or any(nullable(p) for p in prop.get("anyOf", [])))

    for path, field in NULLABLE:
        props = schema["CompletionRequest" if path == "/v1/completions" else "ChatCompletionRequest"]["properties"]
        assert nullable(props[field]), (path, field, props[field])
    for cls, required in (("CompletionRequest", ("model", "prompt")), ("ChatCompletionRequest", ("model", "messages"))):
        assert not any(nullable(schema[cls]["properties"][f]) for f in required), cls


def _prompt_tokens(server, body: dict, path: str) -> int:
    r = server.http.post(path, json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", cmpl(prompt="The answer is"), "max_tokens"),
    ("/v1/chat/completions", chat(), "max_tokens"),
    ("/v1/chat/completions", chat(), "max_completion_tokens"),
], ids=["completions", "chat", "chat-max_completion_tokens"])
def test_max_tokens_beyond_the_context_is_400(server, path, body, field) -> None:
    n = _prompt_tokens(server, body, path)
    room = CONTEXT - n
    r = server.http.post(path, json={**body, field: room + 1})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == field and err["code"] == "context_length_exceeded", err
    assert (f"maximum context length is {CONTEXT} tokens" in err["message"]
            and f"you requested {CONTEXT + 1} tokens ({n} in the prompt, {room + 1} in {field})" in err["message"]), err
    # exactly filling the context is fine, and runs to max_tokens
    r = server.http.post(path, json={**body, field: room, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == room and usage["total_tokens"] == CONTEXT


def test_defaults_fit_the_context(server) -> None:
    """Chat without a limit runs to the context's end; a completion's default 16 is cut to what is left."""
    n = _prompt_tokens(server, chat(), "/v1/chat/completions")
    r = server.http.post("/v1/chat/completions", json=chat(ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == CONTEXT - n
    ids = list(range(100, 100 + CONTEXT - 5))
    r = server.http.post("/v1/completions", json=cmpl(prompt=ids, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", cmpl(prompt=list(range(100, 100 + CONTEXT))), "prompt"),
    ("/v1/completions", cmpl(prompt="word " * (CONTEXT + 5), max_tokens=1), "prompt"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "word " * CONTEXT}]), "messages"),
], ids=["token-ids", "text", "chat"])
def test_prompt_longer_than_the_context_is_400(server, path, body, param) -> None:
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and err["code"] == "context_length_exceeded", err
    assert f"max_model_len) is {CONTEXT}" in err["message"], err


@pytest.mark.parametrize("method,path,content,headers,status,words", [
    ("POST", "/v1/nope", b"{}", {"content-type": "application/json"}, 404, "Invalid URL (POST /v1/nope)"),
    ("GET", "/v2/models", None, {}, 404, "Invalid URL"),
    ("GET", "/v1/completions", None, {}, 405, "accepts POST"),
    ("DELETE", "/v1/models", None, {}, 405, "accepts GET"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', {"content-type": "application/json"}, 400,
     "malformed JSON"),
    ("POST", "/v1/chat/completions", b"{not json}", {"content-type": "application/json"}, 400, "malformed JSON"),
    ("POST", "/v1/completions", b"[1, 2]", {"content-type": "application/json"}, 400, "must be a JSON object"),
    ("POST", "/v1/completions", b"", {"content-type": "application/json"}, 400, "body is missing"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "x"}', {"content-type": "text/plain"}, 400,
     "Content-Type: application/json"),
    ("POST", "/v1/completions", b"model=tiny", {"content-type": "application/x-www-form-urlencoded"}, 400,
     "Content-Type: application/json"),
    ("POST", "/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', {"content-type": "application/json"}, 404,
     "`gpt-4` does not exist"),
    # FastAPI's own "There was an error parsing the body" for these, said with the reason
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', {"content-type": "application/json"},
     400, "malformed request body (POST /v1/completions): the body is not UTF-8 text (invalid start byte at byte 29)"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, {"content-type": "application/json"}, 400,
     "malformed request body (POST /v1/completions): the JSON is nested too deeply to parse"),
], ids=["404-post", "404-get", "405-get", "405-delete", "json-cut", "json-garbage", "json-array", "empty-body",
        "text-plain", "form", "unknown-model", "not-utf8", "nested-too-deep"])
def test_router_and_body_errors_are_openai_style(server, method, path, content, headers, status, words) -> None:
    r = server.http.request(method, path, content=content, headers=headers)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert words in err["message"], err
    assert err["type"] == "invalid_request_error"
    if status == 405:
        assert r.headers["allow"] in ("POST", "GET")


SURROGATE_CASES = [
    # (id, path, raw JSON body with a lone-surrogate escape, status, param)
    ("model", "/v1/completions", rb'{"model": "\ud800", "max_tokens": 3, "prompt": "x"}', 404, "model"),
    ("max_tokens", "/v1/completions", rb'{"model": "tiny", "max_tokens": "\ud800", "prompt": "x"}', 400, "max_tokens"),
    ("stream", "/v1/completions", rb'{"model": "tiny", "stream": "\udfff", "prompt": "x"}', 400, "stream"),
    ("stream_options", "/v1/completions", rb'{"model": "tiny", "stream": true, "stream_options": "\ud800", '
                                          rb'"prompt": "x"}', 400, "stream_options"),
    ("seed", "/v1/completions", rb'{"model": "tiny", "seed": "\ud800", "prompt": "x"}', 400, "seed"),
    ("prompt", "/v1/completions", rb'{"model": "tiny", "prompt": "\ud800"}', 400, "prompt"),
    ("stop", "/v1/completions", rb'{"model": "tiny", "prompt": "x", "stop": ["\udc00"]}', 400, "stop[0]"),
    ("messages", "/v1/chat/completions", rb'{"model": "tiny", "messages": "\ud800"}', 400, "messages"),
    ("role", "/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "\ud800", "content": "x"}]}',
     400, "messages[0].role"),
    ("part-type", "/v1/chat/completions",
     rb'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "\ud800"}]}]}', 400,
     "messages[0].content[0].type"),
    ("content", "/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "a\ud800"}]}',
     400, "messages"),
    ("include_usage", "/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                                              rb'"stream": true, "stream_options": {"include_usage": "\ud800"}}',
     400, "stream_options.include_usage"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in SURROGATE_CASES],
                         ids=[c[0] for c in SURROGATE_CASES])
def test_lone_surrogate_is_echoed_escaped_not_a_500(server, path, body, status, param) -> None:
    """A lone surrogate (``"\ud800"`` in the JSON) in a field the message quotes gives the field's 400 (404 for the
    model), with the value written as the text ``\ud800`` in a body that is strict UTF-8 (it was a 500 from
    ``JSONResponse.render``'s UnicodeEncodeError, or a reset connection when raised inside an exception handler)."""
    import json as json_
    assert b"\\u" in body and json_.loads(body)  # the body really carries an escaped lone surrogate
    r = server.http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    text = r.content.decode("utf-8")  # strict: raises on an encoded surrogate
    assert not any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)
    err = error_of(r)
    assert err["param"] == param, err
    assert not any(0xD800 <= ord(ch) <= 0xDFFF for ch in err["message"]), err
    assert "\\ud800" in err["message"] or "\\udfff" in err["message"] or "\\udc00" in err["message"], err


def test_server_still_serves_after_surrogates(server) -> None:
    """The surrogate requests left the server healthy, and UTF-8 text in a response is sent as is (not escaped)."""
    r = server.http.post("/v1/completions", content='{"model": "tiny", "prompt": "ü", "max_tokens": 2}'.encode(),
                         headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    r = server.http.post("/v1/completions", content='{"model": "ünï", "prompt": "x"}'.encode(),
                         headers={"content-type": "application/json"})
    assert r.status_code == 404 and "`ünï`".encode() in r.content


def test_json_bodies_scrub_lone_surrogates_only() -> None:
    """:func:`dumps` keeps non-ASCII and surrogate pairs, writes lone surrogates as text; SSE events use it."""
    from kvpage.server.jsonsafe import SafeJSONResponse, dumps
    from kvpage.server.protocol import ErrorInfo, ErrorResponse
    from kvpage.server.sse import sse

    assert dumps({"a": "ü😀", "b": [1, None]}) == '{"a":"ü😀","b":[1,null]}'
    assert dumps({"k\udfff": ["x\ud800y"]}) == '{"k\\\\udfff":["x\\\\ud800y"]}'
    assert json.loads(SafeJSONResponse({"m": "\ud800"}).body) == {"m": "\\ud800"}
    event = sse(ErrorResponse(error=ErrorInfo(message="bad \udc80", type="server_error")))
    assert event.startswith("data: ") and event.endswith("\n\n")
    event.encode("utf-8")
    assert json.loads(event[6:])["error"]["message"] == "bad \\udc80"
    assert json.loads(sse({"m": "\ud800"})[6:]) == {"m": "\\ud800"}


def test_openapi_schema_states_the_limits(server) -> None:
    schema = server.http.get("/openapi.json").json()
    req = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert req["model"]["enum"] == [MODEL]
    ints = [b for b in req["max_tokens"]["anyOf"] if b.get("type") == "integer"]
    assert ints == [{"type": "integer", "minimum": 1, "maximum": CONTEXT - 1}]
    chat_req = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat_req["messages"]["minItems"] == 1 and chat_req["n"]["maximum"] == 128
    assert all("422" not in op["responses"] for ops in schema["paths"].values() for op in ops.values())
    post = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "500", "503"} <= set(post)


# -- a request the engine finishes with finish_reason "error" ----------------------------------------


@pytest.fixture
def poisoning_engine(server) -> Iterator[None]:
    """Make the engine finish every request whose prompt starts with ``POISON`` with ``finish_reason="error"``
    after its first step (blocks freed, others untouched), as ``LLMEngine.step`` does for a request that fails."""
    engine = server.llm.engine
    real_step = engine.step

    def step():
        outputs = [o for o in real_step() if not o.prompt_token_ids or o.prompt_token_ids[0] != POISON]
        for rid, req in list(engine.requests.items()):
            if req.prompt_token_ids[0] == POISON and not req.is_finished:
                out = engine.abort_request(rid)
                out.outputs[0].finish_reason = "error"
                out.outputs[0].error = "RuntimeError: poisoned for the test"
                outputs.append(out)
        return outputs

    engine.step = step
    try:
        yield
    finally:
        del engine.step


def _kv_usage_when_idle(url: str, timeout: float = 20.0) -> float:
    """``kvpage:kv_cache_usage_perc`` once no request runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        values = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("kvpage:num_requests_") or line.startswith("kvpage:kv_cache_usage_perc")}
        if values["kvpage:num_requests_running"] == values["kvpage:num_requests_waiting"] == 0:
            return values["kvpage:kv_cache_usage_perc"]
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def test_engine_error_is_500_or_sse_error_and_others_go_on(server, poisoning_engine) -> None:
    clean = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    expected = server.http.post("/v1/completions", json=clean).json()["choices"][0]["text"]
    poisoned = {**clean, "prompt": [POISON, 2, 3]}
    results: dict[str, object] = {}

    def run_clean() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            results["clean"] = http.post("/v1/completions", json=clean).json()

    t = threading.Thread(target=run_clean)
    t.start()
    r = server.http.post("/v1/completions", json=poisoned)
    t.join()
    assert r.status_code == 500, r.text
    err = error_of(r)
    assert err["type"] == "server_error" and err["code"] == "engine_error", err
    assert "poisoned for the test" in err["message"] and "other requests were not affected" in err["message"]
    assert results["clean"]["choices"][0]["text"] == expected

    with server.http.stream("POST", "/v1/completions", json={**poisoned, "stream": True}) as s:
        assert s.status_code == 200
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert set(last) == {"error"} and last["error"]["type"] == "server_error", last
    assert "poisoned for the test" in last["error"]["message"]
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert server.http.get("/health").status_code == 200
    assert _kv_usage_when_idle(server.url) == 0.0
    again = server.http.post("/v1/completions", json=clean)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected


@pytest.fixture
def faulty_runner(server) -> Iterator[None]:
    """Make the model runner raise for any batch holding a request whose tokens include ``POISON``
    (the engine's fault isolation then re-runs each request alone and fails only that one)."""
    runner = server.llm.engine.runner
    real_execute = runner.execute

    def execute(batch, **kw):  # kw: the pass's plan (the engine passes plan=...)
        if any(POISON in r.token_ids for r in batch):
            raise RuntimeError("kernel fault for the test")
        return real_execute(batch, **kw)

    runner.execute = execute
    try:
        yield
    finally:
        del runner.execute


def test_forward_failure_of_one_request_is_its_500_only(server, faulty_runner) -> None:
    """Through the real engine: a poisoned request in a running batch gets a 500 (non-streamed) or an SSE
    error event (streamed, alone in its step); a concurrent clean request's text equals a clean run's."""
    clean = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = server.http.post("/v1/completions", json=clean).json()["choices"][0]["text"]
    results: dict[str, object] = {}

    def run_clean() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            results["clean"] = http.post("/v1/completions", json=clean).json()

    t = threading.Thread(target=run_clean)
    t.start()
    r = server.http.post("/v1/completions", json={**clean, "prompt": [9, POISON, 10]})
    t.join()
    assert r.status_code == 500, r.text
    err = error_of(r)
    assert err["code"] == "engine_error" and "RuntimeError: kernel fault for the test" in err["message"], err
    assert results["clean"]["choices"][0]["text"] == expected
    with server.http.stream("POST", "/v1/completions", json={**clean, "prompt": [POISON], "stream": True}) as s:
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line]
    assert events[-1] == "[DONE]" and "kernel fault for the test" in json.loads(events[-2])["error"]["message"]
    assert _kv_usage_when_idle(server.url) == 0.0
    assert server.http.post("/v1/completions", json=clean).json()["choices"][0]["text"] == expected


# -- an array of prompts (OpenAI's /v1/completions takes one) ------------------------------------------

ARRAYS = {
    "strings": ["The cat sat on", "Rivers flow to the sea and", "One two"],
    "token-arrays": [[11, 12, 13], [21, 22, 23, 24, 25], [31]],
}


@pytest.mark.parametrize("kind", sorted(ARRAYS))
def test_an_array_of_prompts_gets_n_choices_each_in_openai_order(server, kind) -> None:
    """Prompt i's choice j is ``index`` ``i * n + j`` and equals choice j of prompt i asked alone (same seed);
    ``usage`` sums every prompt's tokens. The regression: an array of more than one prompt was a 400."""
    prompts, n = ARRAYS[kind], 2
    common = dict(max_tokens=6, temperature=1.0, seed=7, n=n, ignore_eos=True)
    alone = []
    for p in prompts:
        r = server.http.post("/v1/completions", json=cmpl(prompt=p, **common))
        assert r.status_code == 200, r.text
        alone.append(r.json())
    r = server.http.post("/v1/completions", json=cmpl(prompt=prompts, **common))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(len(prompts) * n))
    for i, single in enumerate(alone):
        for j in range(n):
            choice = body["choices"][i * n + j]
            assert choice["text"] == single["choices"][j]["text"] and choice["finish_reason"] == "length"
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(s["usage"][key] for s in alone), key
    assert body["usage"]["completion_tokens"] == len(prompts) * n * 6


def test_a_streamed_array_of_prompts_carries_each_choices_index_and_summed_usage(server) -> None:
    prompts, n = ARRAYS["token-arrays"], 2
    body = cmpl(prompt=prompts, max_tokens=5, temperature=1.0, seed=3, n=n, ignore_eos=True)
    whole = server.http.post("/v1/completions", json=body).json()
    with server.http.stream("POST", "/v1/completions",
                            json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    finished: list[int] = []
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished.append(choice["index"])
    assert sorted(finished) == list(range(len(prompts) * n))
    assert [texts[c["index"]] for c in whole["choices"]] == [c["text"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_one_prompt_of_an_array_too_long_is_a_400_naming_it_and_nothing_runs(server) -> None:
    r = server.http.post("/v1/completions", json=cmpl(prompt=[[1, 2, 3], list(range(100, 100 + CONTEXT))]))
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "prompt[1]" and err["code"] == "context_length_exceeded", err
    assert err["message"].startswith("prompt[1]: ") and f"max_model_len) is {CONTEXT}" in err["message"], err
    assert _kv_usage_when_idle(server.url) == 0.0
