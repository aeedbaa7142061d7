"""The OpenAI-compatible server on the real model: official ``openai`` client, SSE streams, metrics, bad input.

One server per module (uvicorn in a thread on a free loopback port) over the
session's SmolLM2 weights. Ground truth comes from a second ``LLM`` on the same
weights (prefix caching off), computed before the server starts, so the two
never run at once.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpage import LLM, SamplingParams
from kvpage.cli import build_parser
from kvpage.server.app import ServerThread, build_app

MODEL = "smollm2-test"
MAX_MODEL_LEN = 512
COMPLETION_PROMPT = "The three primary colors are"
CHAT_MESSAGES = [{"role": "user", "content": "Name two planets of the solar system."}]
# Long enough to fill several 16-token blocks: a second identical request hits the prefix cache.
LONG_PROMPT = ("A library keeps its books on shelves sorted by subject, and every shelf has a label. " * 6
               + "The reading room opens at")
MAX_TOKENS = 12


def scrape(url: str) -> list:
    """All samples of ``GET /metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric(samples: list, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_idle(url: str, timeout: float = 30.0) -> list:
    """Samples once no request runs or waits (the engine thread publishes stats after each iteration)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if metric(samples, "kvpage:num_requests_running") == 0 and metric(samples, "kvpage:num_requests_waiting") == 0:
            return samples
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """Parsed ``data:`` payloads of a server-sent-event stream (``"[DONE]"`` as the string)."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line.removeprefix("data: ")
        yield payload if payload == "[DONE]" else json.loads(payload)


@pytest.fixture(scope="module")
def reference(smollm2) -> SimpleNamespace:
    """Greedy outputs of a separate engine (no prefix caching) for the prompts used below."""
    ref = LLM(smollm2, num_blocks=64, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, progress=False)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    completion = ref.generate([COMPLETION_PROMPT], greedy)[0]
    chat = ref.chat(CHAT_MESSAGES, greedy)[0]
    return SimpleNamespace(completion=completion, chat=chat)


@pytest.fixture(scope="module")
def server(smollm2, reference) -> Iterator[SimpleNamespace]:
    """A live server on a free loopback port; ``.url``, ``.llm``, ``.client`` (openai), ``.http`` (httpx)."""
    from openai import OpenAI

    llm = LLM(smollm2, num_blocks=256, max_model_len=MAX_MODEL_LEN, progress=False)
    app = build_app(llm, MODEL)
    with ServerThread(app) as srv:
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            yield SimpleNamespace(url=srv.url, llm=llm, app=app, client=client, http=http)
    assert not app.state.engine.is_running


def test_serve_subcommand_parses() -> None:
    args = build_parser().parse_args(["serve", "--port", "0", "--kv-cache-dtype", "int8", "--max-num-seqs", "8",
                                      "--no-enable-prefix-caching", "--served-model-name", "m"])
    assert (args.port, args.host, args.kv_cache_dtype, args.max_num_seqs) == (0, "127.0.0.1", "int8", 8)
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is True
    from kvpage.cli.generate import run_generate
    from kvpage.cli.serve import run_serve

    assert args.served_model_name == "m" and args.func is run_serve
    assert build_parser().parse_args(["generate", "hi"]).func is run_generate


# -- happy paths, official client ------------------------------------------------------------------


@pytest.mark.slow
def test_health_and_models(server) -> None:
    assert server.http.get("/health").json() == {"status": "ok"}
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.slow
def test_completion_openai_client(server, reference) -> None:
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0)
    ref = reference.completion
    choice = resp.choices[0]
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.slow
def test_chat_completion_openai_client(server, reference) -> None:
    resp = server.client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0)
    ref = reference.chat
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


@pytest.mark.slow
def test_streamed_chat_openai_client(server, reference) -> None:
    stream = server.client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    ref = reference.chat
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choice = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choice)
    assert text == ref.outputs[0].text
    reasons = [c.choices[0].finish_reason for c in with_choice if c.choices[0].finish_reason]
    assert reasons == [ref.outputs[0].finish_reason]
    assert len([c for c in with_choice if c.choices[0].delta.content]) > 1  # really streamed, not one blob
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)


@pytest.mark.slow
def test_streamed_completion_sse_format(server, reference) -> None:
    body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference.completion.outputs[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == reference.completion.outputs[0].finish_reason
    assert all(c["usage"] is None for c in chunks)  # no include_usage: no usage chunk


@pytest.mark.slow
def test_token_id_prompt(server, reference) -> None:
    ref = reference.completion
    r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": ref.prompt_token_ids,
                                                   "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text


@pytest.mark.slow
def test_cached_tokens_in_usage_and_metrics(server) -> None:
    before = wait_idle(server.url)
    usages = [server.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, temperature=0).usage
              for _ in range(2)]
    after = wait_idle(server.url)
    n = usages[0].prompt_tokens
    assert n > 3 * 16
    cached = usages[1].prompt_tokens_details.cached_tokens
    # The second request finds every full block of the first one's prompt: whole blocks only, and the
    # last prompt token is always recomputed to produce logits.
    assert cached == (n - 1) // 16 * 16 > 0
    hits = metric(after, "kvpage:prefix_cache_hits_total") - metric(before, "kvpage:prefix_cache_hits_total")
    assert hits == usages[0].prompt_tokens_details.cached_tokens + cached


@pytest.mark.slow
def test_seed_and_stop(server, reference) -> None:
    def sample() -> str:
        return server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                                temperature=1.0, top_p=0.9, seed=1234).choices[0].text
    first = sample()
    assert first and sample() == first
    greedy = reference.completion.outputs[0].text
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 3]
    cut = greedy[:greedy.find(stop)]
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == cut
    body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stop": stop, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut


@pytest.mark.slow
def test_metrics_match_engine_stats(server) -> None:
    before = wait_idle(server.url)
    resps = [server.client.completions.create(model=MODEL, prompt=f"Count to {k}:", max_tokens=k, temperature=0,
                                              extra_body={"ignore_eos": True}) for k in (3, 5, 7)]
    after = wait_idle(server.url)
    stats = server.llm.engine.stats()  # the engine thread is idle now
    assert metric(after, "kvpage:kv_cache_usage_perc") == stats.kv_usage == 0.0
    assert metric(after, "kvpage:prompt_tokens_total") == stats.prompt_tokens
    assert metric(after, "kvpage:generation_tokens_total") == stats.generation_tokens
    assert metric(after, "kvpage:prefix_cache_queries_total") == stats.kv.prefix_queries
    assert metric(after, "kvpage:prefix_cache_hits_total") == stats.kv.prefix_hits
    assert metric(after, "kvpage:prefix_cache_hit_rate") == pytest.approx(stats.kv.hit_rate)
    assert metric(after, "kvpage:num_preemptions_total") == stats.num_preemptions

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    produced = sum(r.usage.completion_tokens for r in resps)
    assert [r.usage.completion_tokens for r in resps] == [3, 5, 7]
    assert delta("kvpage:generation_tokens_total") == produced
    computed = sum(r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens for r in resps)
    assert delta("kvpage:prompt_tokens_total") == computed
    assert delta("kvpage:request_success_total", finished_reason="length") == 3
    assert delta("kvpage:time_to_first_token_seconds_count") == 3
    assert delta("kvpage:time_per_output_token_seconds_count") == produced - 3
    assert delta("kvpage:e2e_request_latency_seconds_count") == 3
    assert delta("kvpage:time_to_first_token_seconds_sum") > 0


# -- bad input ----------------------------------------------------------------------------------------

_LONG = "word " * (MAX_MODEL_LEN + 10)  # > max_model_len tokens

BAD_INPUTS = [
    # (id, path, body (str = raw bytes), status, code, words in the message)
    ("malformed-json", "/v1/completions", '{"model": "smollm2-test", "prompt": "hi", ', 400, None, "malformed JSON"),
    ("malformed-json-chat", "/v1/chat/completions", "{not json}", 400, None, "malformed JSON"),
    ("max_tokens-wrong-type", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, None,
     "max_tokens: expected an integer"),
    ("max_tokens-numeric-string", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, None,
     'max_tokens: expected an integer, got "5"'),
    ("temperature-wrong-type", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT_MESSAGES, "temperature": "hot"}, 400, None, "temperature: expected a number"),
    ("prompt-wrong-type", "/v1/completions", {"model": MODEL, "prompt": 42}, 400, None, "prompt: expected a string"),
    ("messages-wrong-type", "/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, None,
     "messages: expected an array"),
    ("stream-wrong-type", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes please"}, 400, None,
     "stream: expected a boolean"),
    ("stream-yes", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, None,
     'stream: expected a boolean (true or false), got "yes"'),
    ("prompt-missing", "/v1/completions", {"model": MODEL}, 400, None, "prompt: required"),
    ("max_tokens-zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, None,
     "max_tokens: must be >= 1, got 0"),
    ("max_tokens-negative", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "max_tokens": -5},
     400, None, "max_tokens: must be >= 1, got -5"),
    ("max_tokens-beyond-context", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN},
     400, "context_length_exceeded", f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("max_completion_tokens-zero", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT_MESSAGES, "max_completion_tokens": 0}, 400, None, "must be >= 1"),
    ("n-too-many", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 129}, 400, None,
     "n: must be <= 128"),
    ("n-zero", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_MESSAGES, "n": 0}, 400, None,
     "n: must be >= 1"),
    ("temperature-range", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 5}, 400, None,
     "temperature"),
    ("prompt-too-long", "/v1/completions", {"model": MODEL, "prompt": _LONG}, 400, "context_length_exceeded",
     "max_model_len"),
    ("chat-too-long", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": _LONG}]},
     400, "context_length_exceeded", "max_model_len"),
    ("token-out-of-vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, None, "vocabulary"),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found", "gpt-4"),
    ("unknown-model-chat", "/v1/chat/completions", {"model": "nope", "messages": CHAT_MESSAGES}, 404,
     "model_not_found", "does not exist"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path,body,status,code,words", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, path, body, status, code, words) -> None:
    if isinstance(body, str):
        r = server.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = server.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert err["code"] == code


@pytest.mark.slow
def test_bad_input_via_openai_client(server) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        server.client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=0)
    assert "max_tokens: must be >= 1" in e.value.message and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt=_LONG, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="hi", extra_body={"max_tokens": "many"})
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert e.value.code == "context_length_exceeded" and e.value.body["param"] == "max_tokens"


@pytest.mark.slow
def test_bad_input_does_not_disturb_a_running_stream(server, reference) -> None:
    """Every bad request, sent while a stream runs: the stream still yields the reference text."""
    body = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    statuses: list[int] = []

    def hammer() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _, path, bad, status, _, _ in BAD_INPUTS:
                if isinstance(bad, str):
                    r = http.post(path, content=bad, headers={"content-type": "application/json"})
                else:
                    r = http.post(path, json=bad)
                statuses.append(r.status_code)

    with server.http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
        first = next(events)
        t = threading.Thread(target=hammer)
        t.start()
        rest = list(events)
        t.join()
    chunks = [first] + [e for e in rest if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference.completion.outputs[0].text
    assert statuses == [c[3] for c in BAD_INPUTS]
    assert server.http.get("/health").status_code == 200
    assert metric(wait_idle(server.url), "kvpage:kv_cache_usage_perc") == 0.0


# -- failures and disconnects -------------------------------------------------------------------------


@pytest.mark.slow
def test_engine_step_failure_is_a_500_and_the_server_recovers(server, reference) -> None:
    wait_idle(server.url)
    runner = server.llm.engine.runner

    def broken(*args, **kwargs):
        runner.__dict__.pop("execute", None)  # fail once, then the class's method again
        raise RuntimeError("simulated kernel failure")

    runner.execute = broken
    try:
        r = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    finally:
        runner.__dict__.pop("execute", None)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "simulated kernel failure" in err["message"]
    after = wait_idle(server.url)
    assert metric(after, "kvpage:kv_cache_usage_perc") == 0.0
    assert metric(after, "kvpage:request_success_total", finished_reason="error") >= 1
    resp = server.client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0)
    assert resp.choices[0].text == reference.completion.outputs[0].text


@pytest.mark.slow
def test_non_streamed_client_disconnect_aborts(server) -> None:
    before = wait_idle(server.url)
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json={"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 400,
                                                  "ignore_eos": True}, timeout=1.5)
    after = wait_idle(server.url, timeout=10)
    aborted = (metric(after, "kvpage:request_success_total", finished_reason="abort")
               - metric(before, "kvpage:request_success_total", finished_reason="abort"))
    assert aborted == 1
    assert metric(after, "kvpage:kv_cache_usage_perc") == 0.0
    generated = metric(after, "kvpage:generation_tokens_total") - metric(before, "kvpage:generation_tokens_total")
    assert 0 < generated < 400
