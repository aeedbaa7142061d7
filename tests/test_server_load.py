"""64 concurrent streaming requests against a live server, 8 of which disconnect midway.

The other 56 must finish with exactly their greedy reference output, the 8 must
be aborted (counted under ``finished_reason="abort"`` in ``/metrics``) long
before their ``max_tokens``, and afterwards no KV block may be in use.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpage import LLM, SamplingParams
from kvpage.server.app import ServerThread, build_app

MODEL = "smollm2-load"
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "A haiku about the sea:",
    "The first rule of good software design is",
]
NUM_REQUESTS = 64
DISCONNECT_EVERY = 8  # requests 0, 8, 16, ... disconnect: 8 of 64
OUTPUT_TOKENS = 12
ABANDONED_MAX_TOKENS = 400  # what the disconnecting requests ask for (they never get there)
CHUNKS_BEFORE_DISCONNECT = 3


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``{(name, sorted labels without model_name): value}`` of ``GET /metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


async def one_request(client: httpx.AsyncClient, i: int) -> dict:
    """Stream request ``i``; disconnecting ones close the connection after a few chunks."""
    disconnect = i % DISCONNECT_EVERY == 0
    body = {
        "model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0, "ignore_eos": True, "stream": True,
        "max_tokens": ABANDONED_MAX_TOKENS if disconnect else OUTPUT_TOKENS,
        "stream_options": {"include_usage": True},
    }
    text, reasons, usage, done, n_chunks = "", [], None, False, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                continue
            chunk = json.loads(payload)
            if chunk["usage"] is not None:
                usage = chunk["usage"]
            if chunk["choices"]:
                n_chunks += 1
                text += chunk["choices"][0]["text"]
                if chunk["choices"][0]["finish_reason"]:
                    reasons.append(chunk["choices"][0]["finish_reason"])
            if disconnect and n_chunks >= CHUNKS_BEFORE_DISCONNECT:
                break  # leaving the block closes the half-read response: the client is gone
    return {"i": i, "disconnected": disconnect, "text": text, "reasons": reasons, "usage": usage, "done": done}


async def run_all(url: str) -> list[dict]:
    """All requests at once, on one client with a connection per request."""
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one_request(client, i) for i in range(NUM_REQUESTS)))


@pytest.mark.slow
def test_64_concurrent_streams_with_8_disconnects(smollm2) -> None:
    ref_llm = LLM(smollm2, num_blocks=32, max_model_len=512, enable_prefix_caching=False, progress=False)
    greedy = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].text for o in ref_llm.generate(PROMPTS, greedy)]
    del ref_llm

    llm = LLM(smollm2, num_blocks=512, max_model_len=512, max_num_seqs=NUM_REQUESTS, progress=False)
    with ServerThread(build_app(llm, MODEL)) as srv:
        before = scrape(srv.url)
        t0 = time.perf_counter()
        results = asyncio.run(run_all(srv.url))
        elapsed = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while True:  # the aborts are applied before the engine's next step; wait for the snapshot
            after = scrape(srv.url)
            if after[("kvpage:num_requests_running", ())] == 0 and after[("kvpage:num_requests_waiting", ())] == 0:
                break
            assert time.monotonic() < deadline, "requests still running 30 s after every client finished"
            time.sleep(0.05)
        stats = llm.engine.stats()  # idle now: safe to read from this thread
        in_use = llm.kv_cache_stats().num_in_use

    kept = [r for r in results if not r["disconnected"]]
    gone = [r for r in results if r["disconnected"]]
    assert len(kept) == 56 and len(gone) == 8
    for r in kept:
        assert r["done"] and r["reasons"] == ["length"], r
        assert r["text"] == reference[r["i"] % len(PROMPTS)], r
        assert r["usage"]["completion_tokens"] == OUTPUT_TOKENS
    for r in gone:
        assert not r["done"] and r["reasons"] == []

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("kvpage:request_success_total", finished_reason="abort") == 8
    assert delta("kvpage:request_success_total", finished_reason="length") == 56
    assert delta("kvpage:request_success_total", finished_reason="error") == 0
    # The abandoned requests stopped long before their 400 tokens.
    generated = delta("kvpage:generation_tokens_total")
    assert 56 * OUTPUT_TOKENS + 8 * CHUNKS_BEFORE_DISCONNECT <= generated < 56 * OUTPUT_TOKENS + 8 * 100
    assert after[("kvpage:kv_cache_usage_perc", ())] == 0.0 == stats.kv_usage
    assert in_use == 0
    print(f"64 streams (8 disconnected) in {elapsed:.1f} s; {int(generated)} tokens generated")
